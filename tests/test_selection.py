"""Tests of genrl.flow.selection: Sol-RL candidate selection (best / worst, PODS max-variance, mean deviation,
random) and the preview-fidelity metrics (Spearman, top / bottom set overlap), against brute-force references."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch

from genrl.flow.selection import (
    SELECTION_MODES,
    best_worst_pairs,
    bottom_top,
    proxy_fidelity,
    select_candidates,
    set_overlap,
    spearman,
)

F64 = torch.float64
DETERMINISTIC = ("best_worst", "max_variance", "mean_deviation")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Reward rows [G, n] of several kinds: continuous, binary, few levels, constant, symmetric."""
    g = _gen(seed)
    return {
        "randn": torch.randn(6, n, generator=g, dtype=F64),
        "binary": torch.randint(0, 2, (6, n), generator=g).to(F64),
        "levels": torch.randint(0, 3, (6, n), generator=g).to(F64),
        "constant": torch.full((2, n), 0.1, dtype=F64),
        "symmetric": torch.stack([torch.arange(n, dtype=F64), torch.arange(n, dtype=F64).flip(0) * 0.5]),
    }


# ---------------------------------------------------------------------------------------------- references


def _order(r: list[float]) -> list[int]:
    """Indices by (reward, index): the module's single stable ascending order."""
    return sorted(range(len(r)), key=lambda j: (r[j], j))


def _var(vals: list[float]) -> Fraction:
    """Exact population variance (floats are dyadic rationals, so Fraction is exact)."""
    fs = [Fraction(v) for v in vals]
    mu = sum(fs) / len(fs)
    return sum((f - mu) ** 2 for f in fs) / len(fs)


def _split(r: list[float], k: int, i: int) -> list[int]:
    o = _order(r)
    return sorted(o[: k - i] + o[len(r) - i :])


def _ref_max_variance(r: list[float], k: int) -> list[int]:
    """Brute force over the k + 1 splits, exact variances; ties -> i closest to k/2, then the smaller i."""
    vs = [_var([r[j] for j in _split(r, k, i)]) for i in range(k + 1)]
    best = max(vs)
    i = min((i for i in range(k + 1) if vs[i] == best), key=lambda i: (abs(2 * i - k), i))
    return _split(r, k, i)


def _ref_mean_deviation(r: list[float], k: int) -> list[int]:
    mu = sum(Fraction(v) for v in r) / len(r)
    dev = [abs(Fraction(v) - mu) for v in r]
    order = sorted(range(len(r)), key=lambda j: (dev[j], j))  # the module's tie rule: top = last k
    return sorted(order[len(r) - k :])


def _ref_best_worst(r: list[float], k: int) -> list[int]:
    return _split(r, k, k // 2)


def _avg_ranks(x: list[float]) -> list[float]:
    ranks = [0.0] * len(x)
    for j, v in enumerate(x):
        less = sum(1 for w in x if w < v)
        equal = sum(1 for w in x if w == v)
        ranks[j] = less + (equal + 1) / 2
    return ranks


def _ref_spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _avg_ranks(a), _avg_ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    sab = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    saa = sum((x - ma) ** 2 for x in ra)
    sbb = sum((y - mb) ** 2 for y in rb)
    return math.nan if saa == 0 or sbb == 0 else sab / math.sqrt(saa * sbb)


# ---------------------------------------------------------------------------------------------- selection: shape


@pytest.mark.parametrize("mode", SELECTION_MODES)
@pytest.mark.parametrize("kind", ["randn", "binary", "levels", "constant", "symmetric"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 8])
def test_selection_is_k_distinct_sorted_indices_in_range(mode, kind, k):
    n = 8
    r = _rows(n)[kind]
    idx = select_candidates(r, k, mode, generator=_gen(1))
    assert idx.dtype == torch.int64 and idx.shape == (r.shape[0], k)
    assert bool((idx >= 0).all()) and bool((idx < n).all())
    # strictly increasing per row: sorted and unique
    assert bool((idx[:, 1:] > idx[:, :-1]).all())
    if k == n:
        assert torch.equal(idx, torch.arange(n).expand(r.shape[0], n))


# ---------------------------------------------------------------------------------------------- best_worst


@pytest.mark.parametrize("kind", ["randn", "binary", "levels", "constant", "symmetric"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_best_worst_takes_the_extremes(kind, k):
    r = _rows(9, seed=3)[kind]
    idx = select_candidates(r, k, "best_worst")
    for row, sel in zip(r, idx):
        vals = row.tolist()
        chosen = sel.tolist()
        assert row[sel].max() == row.max() and row[sel].min() == row.min()
        by_order = [j for j in _order(vals) if j in chosen]
        bottom, top = by_order[: (k + 1) // 2], by_order[(k + 1) // 2 :]
        assert len(top) == k // 2 and len(bottom) == k - k // 2
        rest = [vals[j] for j in range(len(vals)) if j not in chosen]
        assert min(vals[j] for j in top) >= max(rest) >= min(rest) >= max(vals[j] for j in bottom)
        assert chosen == _ref_best_worst(vals, k)


def test_best_worst_odd_k_takes_one_more_worst():
    r = torch.tensor([5.0, 0.0, 9.0, 3.0, 7.0, 1.0, 8.0, 2.0, 6.0, 4.0])
    assert select_candidates(r, 5, "best_worst").tolist() == [1, 2, 5, 6, 7]  # top {9, 8}, bottom {0, 1, 2}
    assert select_candidates(r, 1, "best_worst").tolist() == [1]  # the worst alone
    assert select_candidates(r, 4, "best_worst").tolist() == [1, 2, 5, 6]


def test_best_worst_tie_rule():
    # bottom takes the lower indices of a tie, top the higher ones (one stable ascending order)
    r = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    assert select_candidates(r, 4, "best_worst").tolist() == [2, 3, 4, 5]
    c = torch.zeros(6)
    assert select_candidates(c, 3, "best_worst").tolist() == [0, 1, 5]
    assert select_candidates(c, 4, "best_worst").tolist() == [0, 1, 4, 5]


# ---------------------------------------------------------------------------------------------- max_variance


@pytest.mark.parametrize("kind", ["randn", "binary", "levels", "constant", "symmetric"])
@pytest.mark.parametrize("n", [5, 8])
def test_max_variance_matches_brute_force_over_splits(kind, n):
    r = _rows(n, seed=n)[kind]
    for k in range(1, n + 1):
        idx = select_candidates(r, k, "max_variance")
        for row, sel in zip(r, idx):
            assert sel.tolist() == _ref_max_variance(row.tolist(), k), (kind, k, row.tolist())


@pytest.mark.parametrize("kind", ["randn", "binary", "levels", "symmetric"])
@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_max_variance_is_optimal_over_all_subsets(kind, k):
    n = 7
    r = _rows(n, seed=11)[kind]
    idx = select_candidates(r, k, "max_variance")
    bw = select_candidates(r, k, "best_worst")
    for row, sel, sel_bw in zip(r, idx, bw):
        vals = row.tolist()
        got = _var([vals[j] for j in sel.tolist()])
        best_subset = max(_var([vals[j] for j in c]) for c in itertools.combinations(range(n), k))
        best_split = max(_var([vals[j] for j in _split(vals, k, i)]) for i in range(k + 1))
        assert got == best_subset == best_split
        assert got >= _var([vals[j] for j in sel_bw.tolist()])


def test_max_variance_can_differ_from_best_worst():
    # one outlier on top: the max-variance split keeps it and fills with the bottom
    r = torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 10.0])
    assert select_candidates(r, 4, "max_variance").tolist() == [0, 1, 2, 6]
    assert select_candidates(r, 4, "best_worst").tolist() == [0, 1, 5, 6]


def test_max_variance_tie_rules():
    # mirror splits tie (i = 1 and i = 2 for k = 3): the i closest to k / 2 = 1.5 is either, then the smaller
    r = torch.arange(7, dtype=F64)
    assert select_candidates(r, 3, "max_variance").tolist() == [0, 1, 6]
    # a constant row: every split ties, so i = k / 2 (k even) and i = floor(k / 2) (k odd), i.e. best_worst
    c = torch.full((9,), 0.1)
    assert select_candidates(c, 4, "max_variance").tolist() == [0, 1, 7, 8]
    assert select_candidates(c, 3, "max_variance").tolist() == [0, 1, 8]
    assert select_candidates(c, 1, "max_variance").tolist() == [0]
    # binary rewards: i = 1 and i = 2 tie for k = 3 (variance 2/9 each) -> i = 1
    b = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert select_candidates(b, 3, "max_variance").tolist() == [2, 3, 4]


def test_max_variance_rounding_ties():
    # 0.1 .. 0.7 are symmetric only up to float rounding: exactly, {0.1, 0.6, 0.7} (i = 2) beats {0.1, 0.2, 0.7}
    # (i = 1) by ~2e-18, a rounding artefact; the two count as tied and the tie rule gives i = 1, like 1 .. 7
    r = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7], dtype=F64)
    assert _var([0.1, 0.6, 0.7]) > _var([0.1, 0.2, 0.7])
    assert select_candidates(r, 3, "max_variance").tolist() == [0, 1, 6]
    assert select_candidates(r.flip(0), 3, "max_variance").tolist() == [0, 5, 6]


def test_max_variance_small_real_difference_is_not_a_tie():
    # 0 .. 6 with the minimum lowered by 1e-9: i = 2 ({min, 5, 6}) now beats i = 1 by 8e-9 in k^2 var
    r = torch.arange(7, dtype=F64)
    r[0] = -1e-9
    assert select_candidates(r, 3, "max_variance").tolist() == [0, 5, 6]
    assert _ref_max_variance(r.tolist(), 3) == [0, 5, 6]


def test_max_variance_large_offset_is_not_a_false_tie():
    # rewards with a large common offset: variance is shift-invariant, the selection must be too
    g = _gen(5)
    r = torch.randn(4, 12, generator=g, dtype=F64)
    for k in (3, 4, 6):
        base = select_candidates(r, k, "max_variance")
        assert torch.equal(select_candidates(r + 1000.0, k, "max_variance"), base)
        assert [s.tolist() for s in base] == [_ref_max_variance(row.tolist(), k) for row in r]


# ---------------------------------------------------------------------------------------------- mean_deviation


@pytest.mark.parametrize("kind", ["randn", "binary", "levels", "constant", "symmetric"])
def test_mean_deviation_matches_brute_force(kind):
    n = 8
    r = _rows(n, seed=7)[kind]
    for k in range(1, n + 1):
        idx = select_candidates(r, k, "mean_deviation")
        for row, sel in zip(r, idx):
            assert sel.tolist() == _ref_mean_deviation(row.tolist(), k), (kind, k, row.tolist())


def test_mean_deviation_hand_example():
    # mean 2: deviations 2, 0, 1, 2, 1 -> k = 2 takes indices 0 and 3 (tied at 2); k = 3 adds index 4 (the top set
    # takes the higher index of the tie 2, 4: the module's one tie rule)
    r = torch.tensor([0.0, 2.0, 3.0, 4.0, 1.0])
    assert select_candidates(r, 2, "mean_deviation").tolist() == [0, 3]
    assert select_candidates(r, 3, "mean_deviation").tolist() == [0, 3, 4]


# ---------------------------------------------------------------------------------------------- random


def test_random_is_seeded_and_uniform():
    r = torch.zeros(4, 64)
    a = select_candidates(r, 8, "random", generator=_gen(0))
    assert torch.equal(a, select_candidates(r, 8, "random", generator=_gen(0)))
    assert not torch.equal(a, select_candidates(r, 8, "random", generator=_gen(1)))
    # the rows differ from each other, and the generator advances between calls
    assert not torch.equal(a[0], a[1])
    gen = _gen(0)
    first = select_candidates(r, 8, "random", generator=gen)
    assert not torch.equal(first, select_candidates(r, 8, "random", generator=gen))
    # independent of the reward values
    assert torch.equal(a, select_candidates(torch.randn(4, 64, generator=_gen(9)), 8, "random", generator=_gen(0)))
    # every index equally likely: 4000 rows, k = 3 of 8 -> each index 1500 times (sd ~ 31)
    many = select_candidates(torch.zeros(4000, 8), 3, "random", generator=_gen(2))
    counts = torch.bincount(many.flatten(), minlength=8)
    assert bool(((counts - 1500).abs() < 150).all()), counts.tolist()


# ---------------------------------------------------------------------------------------------- batching / inputs


@pytest.mark.parametrize("mode", DETERMINISTIC)
@pytest.mark.parametrize("k", [1, 3, 4])
def test_batched_rows_equal_row_by_row_and_1d(mode, k):
    r = torch.cat([v[:, :9] for v in _rows(9, seed=4).values()])
    idx = select_candidates(r, k, mode)
    rows = torch.stack([select_candidates(row, k, mode) for row in r])
    assert torch.equal(idx, rows)
    one = select_candidates(r[0], k, mode)
    assert one.shape == (k,) and torch.equal(one, idx[0])


@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_integer_bool_and_low_precision_inputs(mode):
    ints = torch.randint(0, 4, (5, 10), generator=_gen(8))
    ref = select_candidates(ints.to(F64), 4, mode)
    assert torch.equal(select_candidates(ints, 4, mode), ref)
    assert torch.equal(select_candidates(ints.to(torch.bfloat16), 4, mode), ref)
    b = ints > 1
    assert torch.equal(select_candidates(b, 4, mode), select_candidates(b.to(F64), 4, mode))


@pytest.mark.parametrize("mode", DETERMINISTIC)
def test_tie_rule_holds_for_long_rows(mode):
    # torch's unstable sort reorders ties from ~100 elements on; the selection must follow the stable order
    r = torch.randint(0, 2, (3, 300), generator=_gen(13)).to(F64)
    ref = {"best_worst": _ref_best_worst, "max_variance": _ref_max_variance, "mean_deviation": _ref_mean_deviation}
    for k in (6, 7, 40):
        idx = select_candidates(r, k, mode)
        assert [s.tolist() for s in idx] == [ref[mode](row.tolist(), k) for row in r]


def test_zero_prompts():
    assert select_candidates(torch.zeros(0, 5), 2).shape == (0, 2)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("mode", SELECTION_MODES)
def test_selection_errors(mode):
    r = torch.zeros(3, 5)
    g = _gen(0)
    with pytest.raises(ValueError, match=r"N = 5 candidates, got k = 0"):
        select_candidates(r, 0, mode, generator=g)
    with pytest.raises(ValueError, match=r"N = 5 candidates, got k = 6"):
        select_candidates(r, 6, mode, generator=g)
    with pytest.raises(ValueError, match="integer"):
        select_candidates(r, 2.5, mode, generator=g)
    bad = r.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"row\(s\) 1 contain NaN"):
        select_candidates(bad, 2, mode, generator=g)
    bad[1, 2], bad[2, 0] = 0.0, float("-inf")
    with pytest.raises(ValueError, match=r"row\(s\) 2 "):
        select_candidates(bad, 2, mode, generator=g)
    with pytest.raises(ValueError, match=r"\[N\] or \[G, N\]"):
        select_candidates(torch.zeros(2, 3, 4), 2, mode, generator=g)


def test_selection_mode_errors():
    with pytest.raises(ValueError, match="best_worst.*max_variance.*mean_deviation.*random"):
        select_candidates(torch.zeros(5), 2, "topk")
    with pytest.raises(ValueError, match="torch.Generator"):
        select_candidates(torch.zeros(5), 2, "random")
    with pytest.raises(ValueError, match="torch.Generator"):
        select_candidates(torch.zeros(5), 2, "random", generator=0)


# ---------------------------------------------------------------------------------------------- spearman


def _spearman_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(21)
    cases = [(torch.randn(n, generator=g, dtype=F64), torch.randn(n, generator=g, dtype=F64)) for n in (2, 5, 17)]
    cases += [(torch.randint(0, 3, (n,), generator=g).to(F64), torch.randint(0, 4, (n,), generator=g).to(F64))
              for n in (6, 12, 25)]
    x = torch.randn(10, generator=g, dtype=F64)
    cases += [(x, x), (x, -x), (x, x**3 + 1), (x, torch.randint(0, 2, (10,), generator=g).to(F64))]
    cases += [(torch.tensor([1.0, 2.0, 2.0, 3.0]), torch.tensor([1.0, 1.0, 2.0, 2.0]))]
    return cases


@pytest.mark.parametrize("case", range(len(_spearman_cases())))
def test_spearman_matches_reference(case):
    a, b = _spearman_cases()[case]
    ref = _ref_spearman(a.tolist(), b.tolist())
    got = spearman(a, b)
    assert isinstance(got, float)
    assert got == pytest.approx(ref, abs=1e-12)


def test_spearman_hand_values():
    x = torch.tensor([0.3, -1.0, 2.0, 0.5])
    assert spearman(x, x) == 1.0
    assert spearman(x, -x) == -1.0
    assert spearman(x, x.exp()) == 1.0  # monotone transform
    # ties: ranks [1, 2.5, 2.5, 4] vs [1, 2, 3, 4]: centred products sum 4.5, squares 4.5 and 5
    assert spearman(torch.tensor([0.0, 1.0, 1.0, 2.0]), torch.arange(4.0)) == pytest.approx(4.5 / math.sqrt(22.5))
    assert math.isnan(spearman(torch.ones(5), torch.arange(5.0)))
    assert math.isnan(spearman(torch.arange(5.0), torch.full((5,), 2.0)))
    assert math.isnan(spearman(torch.tensor([1.0]), torch.tensor([2.0])))
    assert math.isnan(spearman(torch.tensor([1.0, float("nan"), 2.0]), torch.arange(3.0)))
    with pytest.raises(ValueError, match="same length"):
        spearman(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="1-d"):
        spearman(torch.zeros(2, 3), torch.zeros(2, 3))


def test_spearman_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for a, b in _spearman_cases()[1:]:  # scipy needs n > 2
        ref = float(stats.spearmanr(a.numpy(), b.numpy()).statistic)
        assert spearman(a, b) == pytest.approx(ref, abs=1e-12)


# ---------------------------------------------------------------------------------------------- overlap / fidelity


def test_set_overlap_hand_examples():
    x = torch.tensor([0.4, -1.0, 3.0, 0.0, 2.0, 1.0])
    assert set_overlap(x, x, 2) == {"top": 1.0, "bottom": 1.0}
    assert set_overlap(x, -x, 3) == {"top": 0.0, "bottom": 0.0}
    assert set_overlap(x, -x, 6) == {"top": 1.0, "bottom": 1.0}
    a, b = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.0, 2.0, 1.0, 3.0])
    assert set_overlap(a, b, 2) == {"top": 0.5, "bottom": 0.5}  # top {2, 3} vs {1, 3}; bottom {0, 1} vs {0, 2}
    assert set_overlap(a, b, 1) == {"top": 1.0, "bottom": 1.0}
    # tie rule: a constant preview's top set is its highest indices, its bottom set its lowest
    c = torch.ones(4)
    assert set_overlap(c, torch.arange(4.0), 2) == {"top": 1.0, "bottom": 1.0}
    assert set_overlap(c, torch.arange(4.0).flip(0), 2) == {"top": 0.0, "bottom": 0.0}
    nan = set_overlap(torch.tensor([0.0, float("nan")]), torch.zeros(2), 1)
    assert math.isnan(nan["top"]) and math.isnan(nan["bottom"])
    with pytest.raises(ValueError, match="N = 4"):
        set_overlap(a, b, 5)


def test_set_overlap_matches_reference():
    g = _gen(31)
    for _ in range(20):
        a, b = torch.randint(0, 4, (9,), generator=g).to(F64), torch.randn(9, generator=g, dtype=F64)
        for k in (1, 3, 5):
            oa, ob = _order(a.tolist()), _order(b.tolist())
            top = len(set(oa[-k:]) & set(ob[-k:])) / k
            bottom = len(set(oa[:k]) & set(ob[:k])) / k
            assert set_overlap(a, b, k) == {"top": top, "bottom": bottom}
            # the same sets as best_worst keeps (same tie rule)
            if 2 * k <= 9:
                assert select_candidates(a, 2 * k, "best_worst").tolist() == sorted(oa[:k] + oa[-k:])


def test_set_overlap_tie_rule_on_long_rows():
    # binary rewards on 300 candidates: the sets must follow the stable order (torch's unstable sort does not)
    g = _gen(37)
    a, b = torch.randint(0, 2, (300,), generator=g).to(F64), torch.randint(0, 3, (300,), generator=g).to(F64)
    oa, ob = _order(a.tolist()), _order(b.tolist())
    for k in (10, 50):
        top = len(set(oa[-k:]) & set(ob[-k:])) / k
        bottom = len(set(oa[:k]) & set(ob[:k])) / k
        assert set_overlap(a, b, k) == {"top": top, "bottom": bottom}


def test_proxy_fidelity_averages_rows():
    g = _gen(41)
    p = torch.randn(5, 8, generator=g, dtype=F64)
    f = p + 0.5 * torch.randn(5, 8, generator=g, dtype=F64)
    f[2] = 1.0  # a constant row: no Spearman, but overlaps still defined
    out = proxy_fidelity(p, f, 3)
    rhos = [spearman(a, b) for a, b in zip(p, f)]
    ovs = [set_overlap(a, b, 3) for a, b in zip(p, f)]
    defined = [r for r in rhos if not math.isnan(r)]
    assert out["spearman_rows"] == 4.0
    assert out["spearman"] == pytest.approx(sum(defined) / 4)
    assert out["top_overlap"] == pytest.approx(sum(o["top"] for o in ovs) / 5)
    assert out["bottom_overlap"] == pytest.approx(sum(o["bottom"] for o in ovs) / 5)
    same = proxy_fidelity(p, p, 3)
    assert same == {"spearman": 1.0, "spearman_rows": 5.0, "top_overlap": 1.0, "bottom_overlap": 1.0}
    one = proxy_fidelity(p[0], f[0], 3)
    assert one["spearman"] == pytest.approx(rhos[0]) and one["top_overlap"] == ovs[0]["top"]
    allnan = proxy_fidelity(torch.ones(2, 4), torch.ones(2, 4), 2)
    assert math.isnan(allnan["spearman"]) and allnan["spearman_rows"] == 0.0 and allnan["top_overlap"] == 1.0
    with pytest.raises(ValueError, match="same shape"):
        proxy_fidelity(p, f[:, :4], 2)
    with pytest.raises(ValueError, match="N = 8"):
        proxy_fidelity(p, f, 9)


# ---------------------------------------------------------------------------------------------- best / worst pairs


def _ref_pairs(rewards, group, valid, tie):
    """Brute-force reference: per group (by first appearance), valid finite members ordered by (reward, index)."""
    seen = []
    for g in group:
        if g not in seen:
            seen.append(g)
    chosen, rejected = [], []
    for g in seen:
        idx = [i for i in range(len(rewards)) if group[i] == g and valid[i] and math.isfinite(rewards[i])]
        if len(idx) < 2:
            continue
        order = sorted(idx, key=lambda i: (rewards[i], i))
        lo, hi = order[0], order[-1]
        if tie == "skip" and rewards[hi] == rewards[lo]:
            continue
        chosen.append(hi)
        rejected.append(lo)
    return chosen, rejected


def test_best_worst_pairs_shuffled_groups_with_invalid_members():
    nan = math.nan
    #              0    1    2    3    4    5    6    7    8    9   10   11
    rewards = [0.3, 0.9, nan, 0.5, 0.1, 0.9, 0.2, 0.7, 0.2, 5.0, 0.4, 0.4]
    group = [8, 3, 8, 3, 8, 5, 3, 5, 8, 5, 1, 1]
    valid = [True] * 12
    valid[9] = False  # the highest reward of group 5, but invalid: never chosen
    r = torch.tensor(rewards, dtype=F64)
    g = torch.tensor(group)
    v = torch.tensor(valid)
    chosen, rejected = best_worst_pairs(r, g, v)
    # group 8 first (index 0): valid {0: .3, 4: .1, 8: .2} (2 is NaN) -> (0, 4); group 3: {1: .9, 3: .5, 6: .2}
    # -> (1, 6); group 5: {5: .9, 7: .7} -> (5, 7); group 1: tied {10, 11} -> skipped
    assert chosen.tolist() == [0, 1, 5] and rejected.tolist() == [4, 6, 7]
    assert chosen.dtype == torch.long and rejected.dtype == torch.long
    assert (chosen.tolist(), rejected.tolist()) == _ref_pairs(rewards, group, valid, "skip")
    c_a, r_a = best_worst_pairs(r, g, v, tie="arbitrary")
    # the all-tied group 1 now pairs its later index (chosen) with its earlier one (rejected)
    assert c_a.tolist() == [0, 1, 5, 11] and r_a.tolist() == [4, 6, 7, 10]
    # valid=None: every finite reward counts, so the 5.0 of sample 9 is group 5's chosen
    c_n, r_n = best_worst_pairs(r, g)
    assert c_n.tolist() == [0, 1, 9] and r_n.tolist() == [4, 6, 7]
    # +-inf rewards are invalid too (a failed score must not become the best or the worst)
    r_inf = torch.tensor([math.inf, 0.2, 0.5, -math.inf, 0.3])
    c_i, r_i = best_worst_pairs(r_inf, torch.zeros(5, dtype=torch.long))
    assert c_i.tolist() == [2] and r_i.tolist() == [1]


def test_best_worst_pairs_all_equal_binary_group():
    r = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    g = torch.tensor([0, 0, 1, 1, 0, 1, 1, 0])  # group 1 is all 0
    chosen, rejected = best_worst_pairs(r, g)
    assert chosen.tolist() == [4] and rejected.tolist() == [0]
    assert not torch.isnan(r[chosen]).any() and not torch.isnan(r[rejected]).any()
    c_a, r_a = best_worst_pairs(r, g, tie="arbitrary")
    assert c_a.tolist() == [4, 6] and r_a.tolist() == [0, 2]
    assert bool((c_a != r_a).all())
    # a batch of only tied groups gives no pair at all (two empty int64 tensors)
    c0, r0 = best_worst_pairs(torch.zeros(6), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert c0.shape == (0,) and r0.shape == (0,) and c0.dtype == torch.long


def test_best_worst_pairs_one_winner_among_zeros():
    r = torch.tensor([0, 0, 0, 1, 0, 0], dtype=torch.int64)  # integer rewards are fine
    g = torch.full((6,), 4)
    chosen, rejected = best_worst_pairs(r, g)
    assert chosen.tolist() == [3] and rejected.tolist() == [0]  # the 1, and the lowest-index 0
    # the same rule as select_candidates' top / bottom sets
    assert select_candidates(r, 2, "best_worst").tolist() == sorted([3, 0])
    # an invalid lowest-index 0 moves the rejected to the next 0
    v = torch.tensor([False, True, True, True, True, True])
    assert best_worst_pairs(r, g, v)[1].tolist() == [1]


def test_best_worst_pairs_single_valid_member_gives_no_pair():
    r = torch.tensor([0.2, math.nan, 0.9, 0.4, 0.1], dtype=F64)
    g = torch.tensor([0, 0, 1, 2, 2])  # group 0: one finite reward; group 1: one member
    v = torch.tensor([True, True, True, False, True])  # group 2: one valid member
    for tie in ("skip", "arbitrary"):
        chosen, rejected = best_worst_pairs(r, g, v, tie=tie)
        assert chosen.numel() == 0 and rejected.numel() == 0
    assert best_worst_pairs(torch.zeros(0), torch.zeros(0, dtype=torch.long))[0].shape == (0,)


def test_best_worst_pairs_matches_reference_on_random_batches():
    gen = _gen(50)
    for trial in range(20):
        n = 3 + trial
        r = torch.randint(0, 3, (n,), generator=gen).to(F64)
        if trial % 3 == 0:
            r[torch.randint(0, n, (2,), generator=gen)] = math.nan
        g = torch.randint(0, 5, (n,), generator=gen) * 7 - 10
        v = torch.rand(n, generator=gen) > 0.2
        for tie in ("skip", "arbitrary"):
            chosen, rejected = best_worst_pairs(r, g, v, tie=tie)
            assert (chosen.tolist(), rejected.tolist()) == _ref_pairs(r.tolist(), g.tolist(), v.tolist(), tie)
            assert bool((r[chosen] >= r[rejected]).all()) and bool((chosen != rejected).all())
            if tie == "skip":
                assert bool((r[chosen] > r[rejected]).all())


def test_best_worst_pairs_errors():
    r = torch.rand(4)
    g = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="unknown tie policy 'random'"):
        best_worst_pairs(r, g, tie="random")
    with pytest.raises(ValueError, match=r"rewards must be a 1-d real tensor \[B\], got \(2, 2\)"):
        best_worst_pairs(r.view(2, 2), g)
    with pytest.raises(ValueError, match=r"group must be a \[B\] = \[4\] tensor.*\(3,\)"):
        best_worst_pairs(r, g[:3])
    with pytest.raises(ValueError, match="group must hold integer ids.*float32"):
        best_worst_pairs(r, g.float())
    with pytest.raises(ValueError, match=r"valid must be a bool \[B\] = \[4\].*int64"):
        best_worst_pairs(r, g, torch.tensor([1, 1, 0, 1]))


# ---------------------------------------------------------------------------------------------- ties (issue 48)
# the one tie rule under binary rewards: all-equal and nearly-all-equal groups, for every selection step


_BINARY = {  # N = 8 binary groups and their stable ascending (value, index) order
    "all 0": ([0, 0, 0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5, 6, 7]),
    "all 1": ([1, 1, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5, 6, 7]),
    "one 1": ([0, 0, 0, 1, 0, 0, 0, 0], [0, 1, 2, 4, 5, 6, 7, 3]),
    "one 0": ([1, 1, 1, 0, 1, 1, 1, 1], [3, 0, 1, 2, 4, 5, 6, 7]),
}


@pytest.mark.parametrize("name", list(_BINARY))
def test_bottom_top_is_the_stable_order_and_never_shares_an_element(name):
    """bottom_top: the first n_bottom and the last n_top of the stable ascending order, disjoint for every split of
    an all-equal or nearly-all-equal binary group, also when the two sets together take every element."""
    r, order = _BINARY[name]
    t = torch.tensor(r, dtype=torch.int64)
    for nb in range(9):
        for nt in range(9 - nb):
            bottom, top = bottom_top(t, nb, nt)
            assert bottom.tolist() == order[:nb] and top.tolist() == order[8 - nt :]
            assert not set(bottom.tolist()) & set(top.tolist())
    lo, hi = bottom_top(t, 1, 1)  # the single worst is the first, the single best the last
    assert lo.tolist() == [order[0]] and hi.tolist() == [order[-1]]


def test_bottom_top_errors_and_empty():
    b, t = bottom_top(torch.zeros(0), 0, 0)
    assert b.shape == (0,) and t.shape == (0,) and b.dtype == torch.long
    with pytest.raises(ValueError, match=r"n_bottom \+ n_top = 2 \+ 2 exceeds the 3 values"):
        bottom_top(torch.zeros(3), 2, 2)
    with pytest.raises(ValueError, match="n_top must be an integer >= 0"):
        bottom_top(torch.zeros(3), 1, -1)
    with pytest.raises(ValueError, match="n_bottom must be an integer >= 0"):
        bottom_top(torch.zeros(3), 1.0, 1)
    with pytest.raises(ValueError, match="NaN"):
        bottom_top(torch.tensor([0.0, math.nan]), 1, 1)
    with pytest.raises(ValueError, match="1-d real tensor"):
        bottom_top(torch.zeros(2, 2), 1, 1)


@pytest.mark.parametrize("mode", ["best_worst", "max_variance"])
@pytest.mark.parametrize("name", list(_BINARY))
def test_sol_rl_selection_of_binary_groups_by_hand(mode, name):
    """Sol-RL selection of K of 8 under the tie rule: ceil(K/2) worst = the first of the stable order, floor(K/2)
    best = the last; K distinct candidates even when every reward ties. max_variance picks the same split here
    (all splits tie, or the one 1 / one 0 makes i = 1..K tie, and the i closest to K/2 wins). By hand for K = 4:
    all 0 / all 1 -> {0, 1, 6, 7}; one 1 at 3 -> {0, 1, 3, 7}; one 0 at 3 -> {0, 3, 6, 7}."""
    r, order = _BINARY[name]
    for k in range(1, 9):
        got = select_candidates(torch.tensor(r, dtype=F64), k, mode).tolist()
        assert got == sorted(order[: k - k // 2] + order[8 - k // 2 :]), (k, got)
        assert len(set(got)) == k
    by_hand = {"all 0": [0, 1, 6, 7], "all 1": [0, 1, 6, 7], "one 1": [0, 1, 3, 7], "one 0": [0, 3, 6, 7]}
    assert select_candidates(torch.tensor(r), 4, mode).tolist() == by_hand[name]


@pytest.mark.parametrize("mode", ["best_worst", "max_variance"])
def test_release_sized_binary_pools_keep_24_distinct(mode):
    """The release's 24 of 96 on binary rewards (all 0, all 1, a single 1, a single 0, 95 % ones): 24 distinct
    indices, the 12 worst first in the stable order and the 12 best last; a single 1 is always kept."""
    rows = torch.stack([torch.zeros(96), torch.ones(96), (torch.arange(96) == 40).double(),
                        (torch.arange(96) != 40).double(), (torch.arange(96) % 20 != 7).double()]).to(F64)
    idx = select_candidates(rows, 24, mode)
    for row, sel in zip(rows.tolist(), idx.tolist()):
        assert len(set(sel)) == 24
        assert sel == _split(row, 24, 12)
    assert 40 in idx[2].tolist() and 40 in idx[3].tolist()


def test_mean_deviation_ties_take_the_top_of_the_stable_order():
    """mean_deviation keeps the k largest deviations as the tie rule's top set: an all-equal group keeps its last
    k candidates, a single 1 among 0s is kept with the highest-index 0s (before issue 48 it took the lowest)."""
    assert select_candidates(torch.zeros(8), 3, "mean_deviation").tolist() == [5, 6, 7]
    assert select_candidates(torch.ones(8), 3, "mean_deviation").tolist() == [5, 6, 7]
    one = torch.tensor([0.0, 0, 0, 1, 0, 0, 0, 0])
    assert select_candidates(one, 3, "mean_deviation").tolist() == [3, 6, 7]


def test_best_worst_pairs_nearly_all_equal_binary_groups():
    """best_worst_pairs follows the same rule: a single 0 among 1s is the rejected and the highest-index 1 the
    chosen; an all-1 group is skipped, or paired (last, first) with tie="arbitrary", never a sample with itself."""
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])  # group 0: one 0 (index 2); group 1: all 1
    chosen, rejected = best_worst_pairs(r, g)
    assert chosen.tolist() == [3] and rejected.tolist() == [2]
    c_a, r_a = best_worst_pairs(r, g, tie="arbitrary")
    assert c_a.tolist() == [3, 7] and r_a.tolist() == [2, 4]
    # the pair is the single best and the single worst of bottom_top on each group
    for members in ([0, 1, 2, 3], [4, 5, 6, 7]):
        lo, hi = bottom_top(r[members], 1, 1)
        assert [members[int(hi)], members[int(lo)]] in ([3, 2], [7, 4])
