"""Candidate selection from cheap previews, and how faithful the previews are (Sol-RL rollout scaling).

Sol-RL (Li, Chen, Xue et al. 2026, "FP4 Explore, BF16 Train", arXiv 2604.06916) previews a pool of N
candidates per prompt cheaply (low-precision sampling), scores them, keeps K of them by their preview reward,
regenerates those K in full precision and trains on them. `select_candidates` picks the K from a [G, N]
matrix of preview rewards (G prompts, N candidates each); `spearman`, `set_overlap` and `proxy_fidelity`
measure how well the preview rewards rank the candidates like the full-precision rewards do (log them every
iteration: a drop means the cheap preview no longer predicts the trained samples). `best_worst_pairs` builds one
(chosen, rejected) pair per group of a gathered batch for online preference training (DPO on pointwise rewards).

The tie rule, the one every selection and pair-building step of genrl follows (Sol-RL selection here,
``best_worst_pairs`` for DPO pairs, BranchGRPO's width pruning in :mod:`genrl.flow.tree_advantages` through
`bottom_top`): candidates are ordered by ONE stable ascending sort of their values, i.e. by (value, index)
lexicographically, so among tied values the lower index counts as the lower one. A "bottom-m" (worst) set is the
first m of that order and a "top-m" (best) set the last m; a single worst is the first element and a single best
the last. A bottom and a top set taken from the same order never share an element, so no candidate is ever both
best and worst, not even in an all-equal group. What "index" means is the caller's list order (a batch index, a
candidate column, an edge's place in a list), stated where the list is built.

Two independent ``torch.topk`` calls (Sol-RL's release: ``topk(r, K/2)`` and ``topk(r, K - K/2, largest=False)``)
give no such guarantee: ``topk`` makes no promise about which of several tied elements it returns, and with binary
rewards (an all-0, all-1 or one-1 group) both calls can return the same candidate (docs/methods/sol_rl.md, Ties).

Pure functions; everything is computed in float64 on the rewards' device.
"""

from __future__ import annotations

import math
import operator
from typing import Literal

import torch

__all__ = [
    "SelectionMode",
    "SELECTION_MODES",
    "bottom_top",
    "select_candidates",
    "PairTie",
    "best_worst_pairs",
    "spearman",
    "set_overlap",
    "proxy_fidelity",
]

SelectionMode = Literal["best_worst", "max_variance", "mean_deviation", "random"]
SELECTION_MODES: tuple[str, ...] = ("best_worst", "max_variance", "mean_deviation", "random")

_F64_EPS = torch.finfo(torch.float64).eps


# ----------------------------------------------------------------------------------------------
# helpers


def _check_k(k: int, n: int, what: str = "k") -> int:
    """``k`` as an int in [1, n]; ValueError naming both otherwise."""
    if isinstance(k, bool):
        raise ValueError(f"{what} must be an integer, got {k!r}")
    try:
        k = operator.index(k)
    except TypeError as e:
        raise ValueError(f"{what} must be an integer, got {k!r}") from e
    if not 1 <= k <= n:
        raise ValueError(f"{what} must be in [1, N] with N = {n} candidates, got {what} = {k}")
    return k


def _as_rows(rewards: torch.Tensor, name: str = "rewards") -> tuple[torch.Tensor, bool]:
    """[N] or [G, N] real tensor -> ([G, N] float64, was_1d)."""
    if not isinstance(rewards, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() not in (1, 2):
        raise ValueError(f"{name} must be [N] or [G, N] (G prompts, N candidates), got shape {tuple(rewards.shape)}")
    if rewards.is_complex():
        raise ValueError(f"{name} must be real, got dtype {rewards.dtype}")
    r = rewards.detach().to(torch.float64)
    return (r.unsqueeze(0), True) if rewards.dim() == 1 else (r, False)


def _split_positions(n: int, k: int, n_top: torch.Tensor) -> torch.Tensor:
    """Bool [G, n] mask over ascending-sorted positions: the first k - i and the last i, i = ``n_top`` [G]."""
    pos = torch.arange(n, device=n_top.device).unsqueeze(0)
    i = n_top.unsqueeze(1)
    return (pos < k - i) | (pos >= n - i)


def _gather_sorted(perm: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """The original indices ``perm`` [G, N] at the ``mask`` [G, N] positions (k per row), ascending: [G, k]."""
    return perm.masked_select(mask).view(perm.shape[0], k).sort(dim=1).values


# ----------------------------------------------------------------------------------------------
# selection


def bottom_top(values: torch.Tensor, n_bottom: int, n_top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's tie rule on one list: the ``n_bottom`` lowest and the ``n_top`` highest of ``values``.

    One stable ascending sort of ``values`` (ties keep their list order, so the lower index counts as lower); the
    bottom set is the first ``n_bottom`` of that order and the top set the last ``n_top``. Since
    ``n_bottom + n_top <= N`` the two sets are disjoint: no element is both, however many values tie.

    Args:
        values: [N] real tensor (any real dtype, compared in float64; NaN is not allowed: it has no place in an
            order). N = 0 is fine with ``n_bottom = n_top = 0``.
        n_bottom, n_top: set sizes, integers >= 0 with ``n_bottom + n_top <= N``.

    Returns:
        (bottom, top): int64 [n_bottom] and [n_top] indices into ``values``, each in the sort's order (bottom:
        lowest first; top: its lowest first, so ``top[-1]`` is the single best), on the values' device.

    Raises:
        ValueError: values not a 1-d real tensor, or containing NaN; a negative or non-integer size, or
            ``n_bottom + n_top > N`` (the message names the three numbers).
    """
    if not isinstance(values, torch.Tensor) or values.dim() != 1 or values.is_complex():
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"values must be a 1-d real tensor [N], got {shape}")
    n = values.shape[0]
    sizes = []
    for name, m in (("n_bottom", n_bottom), ("n_top", n_top)):
        if isinstance(m, bool):
            raise ValueError(f"{name} must be an integer >= 0, got {m!r}")
        try:
            m = operator.index(m)
        except TypeError as e:
            raise ValueError(f"{name} must be an integer >= 0, got {m!r}") from e
        if m < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {m}")
        sizes.append(m)
    n_bottom, n_top = sizes
    if n_bottom + n_top > n:
        raise ValueError(f"n_bottom + n_top = {n_bottom} + {n_top} exceeds the {n} values: the sets would overlap")
    v = values.detach().to(torch.float64)
    if bool(torch.isnan(v).any()):
        raise ValueError("values contain NaN, which has no place in the order; mask or replace them first")
    order = v.sort(stable=True).indices
    return order[:n_bottom], order[n - n_top :]


def select_candidates(
    rewards: torch.Tensor,
    k: int,
    mode: SelectionMode = "best_worst",
    generator: torch.Generator | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Indices of the K candidates (of N per prompt) to regenerate and train on, from their preview rewards.

    Modes (``i`` below is the number taken from the top, the rest ``k - i`` from the bottom; top / bottom
    sets as in the module's tie rule, one stable ascending ``torch.sort`` per row):

    - ``"best_worst"`` (Sol-RL): the floor(k/2) highest and the ceil(k/2) lowest rewards (K odd: one more
      worst, as Sol-RL's code does). Indices are unique even under tied rewards (binary rewards), which
      two independent ``topk`` calls do not guarantee.
    - ``"max_variance"`` (PODS, Xu et al. 2025, arXiv 2504.13818, max-variance down-sampling): among the k + 1
      splits "top-i plus bottom-(k - i)", i = 0..k, the one whose selected rewards have the largest
      population variance (PODS shows that the maximum over all k-subsets is attained by such a split).
      Splits whose variances agree to float64 rounding (k^2 var within 8 eps k^3 M^2, M the largest
      |r - median| of the row) are ties, broken by the i closest to k/2, then the smaller i; so a constant
      row (or any all-tied case) gives the ``"best_worst"`` selection. O(N log N + k) per row: prefix sums of
      the sorted (median-shifted) rewards and their squares from both ends.
    - ``"mean_deviation"``: the k largest |r - mean(r)| (row mean, float64): the top-k set of the deviations
      under the tie rule, so among tied deviations the higher indices are taken (an all-equal row keeps its last
      k candidates).
    - ``"random"``: k distinct indices, uniform over k-subsets, drawn from ``generator`` (required; the
      draws come from the generator's device: one float64 uniform per candidate, the k smallest).

    Args:
        rewards: [G, N] real preview rewards (G prompts, N candidates each), or [N] for one prompt; any
            real dtype (bool / integer rewards are fine), compared in float64. Every value must be finite.
        k: how many to keep per prompt, 1 <= k <= N.
        mode: one of `SELECTION_MODES`.
        generator: a ``torch.Generator``; required for ``"random"``, ignored by the other modes.
        valid: optional bool mask of the rewards' shape: False marks a failed preview reward (its value may be NaN
            or infinite). A failed candidate is never selected while its row has k valid ones: such a row's
            selection is the selection on the row without its failed candidates (mapped back to columns of N);
            a row with fewer than k valid candidates keeps all of them and fills up with its failed ones of lowest
            index. Rows are then selected one at a time (in ``"random"`` mode the generator is drawn row by row).

    Returns:
        int64 [G, k] (or [k] for 1-d rewards) indices into N, sorted ascending in each row, distinct within a
        row, on the rewards' device.

    Raises:
        ValueError: rewards not a real [N] / [G, N] tensor; k not an integer in [1, N] (the message names k
            and N); a NaN or +-inf reward on a valid candidate (the message names the rows; NaN is not treated
            as "lowest": a failed preview would then always be selected as a "worst" candidate, so mark failures
            with ``valid``); ``valid`` not a bool tensor of the rewards' shape; unknown mode (the message lists
            the modes); ``"random"`` without a ``torch.Generator``.

    Source: Li, Chen, Xue et al. 2026, Sol-RL (arXiv 2604.06916, best / worst preview selection);
    Xu et al. 2025, PODS (arXiv 2504.13818, max-variance down-sampling).
    """
    if mode not in SELECTION_MODES:
        raise ValueError(f"unknown selection mode {mode!r}; expected one of {SELECTION_MODES}")
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != rewards.shape:
            raise ValueError(f"valid must be a bool tensor of the rewards' shape {tuple(rewards.shape)}, got "
                             f"{getattr(valid, 'dtype', type(valid).__name__)} {tuple(getattr(valid, 'shape', ()))}")
        if not bool(valid.all()):
            return _select_valid(rewards, k, mode, generator, valid)
    r, one_d = _as_rows(rewards)
    g, n = r.shape
    k = _check_k(k, n)
    finite = torch.isfinite(r).all(dim=1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().flatten().tolist()
        shown = ", ".join(str(b) for b in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise ValueError(
            f"rewards row(s) {shown} contain NaN or infinite values ({len(bad)} of {g} rows); replace failed "
            "previews with a finite reward (e.g. the row's minimum) before selecting"
        )

    if mode == "random":
        if not isinstance(generator, torch.Generator):
            raise ValueError(
                f"mode 'random' needs a torch.Generator (generator=torch.Generator().manual_seed(seed)), "
                f"got {type(generator).__name__}"
            )
        u = torch.rand(g, n, generator=generator, dtype=torch.float64, device=generator.device)
        idx = u.argsort(dim=1, stable=True)[:, :k].sort(dim=1).values.to(r.device)
    elif mode == "mean_deviation":
        dev = (r - r.mean(dim=1, keepdim=True)).abs()
        idx = dev.sort(dim=1, stable=True).indices[:, n - k :].sort(dim=1).values
    else:
        s, perm = r.sort(dim=1, stable=True)
        if mode == "best_worst":
            n_top = torch.full((g,), k // 2, dtype=torch.long, device=r.device)
        else:
            n_top = _max_variance_split(s, k)
        idx = _gather_sorted(perm, _split_positions(n, k, n_top), k)
    return idx[0] if one_d else idx


def _select_valid(rewards: torch.Tensor, k: int, mode: SelectionMode, generator: torch.Generator | None,
                  valid: torch.Tensor) -> torch.Tensor:
    """:func:`select_candidates` with failed candidates (``valid`` False): row by row on the valid ones."""
    r, one_d = _as_rows(rewards)
    ok = valid.reshape(r.shape)
    k = _check_k(k, r.shape[1])
    rows = []
    for row, mask in zip(r, ok.to(r.device)):
        good = mask.nonzero().flatten()
        if good.numel() >= k:
            rows.append(good[select_candidates(row[good], k, mode, generator)])
        else:  # too few valid: all of them, then the failed ones of lowest index
            rows.append(torch.cat([good, (~mask).nonzero().flatten()[: k - good.numel()]]).sort().values)
    idx = torch.stack(rows)
    return idx[0] if one_d else idx


def _max_variance_split(s: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of the ascending-sorted float64 ``s`` [G, N]: the number i of top rewards ([G], int64) of PODS'
    max-variance split "top-i + bottom-(k - i)"; ties (to rounding) -> i closest to k/2, then the smaller i."""
    g, n = s.shape
    # shift by an element of the row (its median): variance is shift-invariant, the sums stay small, and a
    # constant row becomes exactly 0 (so all its splits tie exactly)
    c = s - s[:, n // 2 : n // 2 + 1]
    zero = c.new_zeros(g, 1)
    # bottom[j] = sum of the j smallest, top[j] = sum of the j largest (j = 0..k), each summed from its own end
    bot1 = torch.cat([zero, c[:, :k].cumsum(1)], dim=1)
    bot2 = torch.cat([zero, (c[:, :k] ** 2).cumsum(1)], dim=1)
    rev = c.flip(1)[:, :k]
    top1 = torch.cat([zero, rev.cumsum(1)], dim=1)
    top2 = torch.cat([zero, (rev**2).cumsum(1)], dim=1)
    i = torch.arange(k + 1, device=s.device)
    s1 = top1[:, i] + bot1[:, k - i]
    s2 = top2[:, i] + bot2[:, k - i]
    score = k * s2 - s1 * s1  # = k^2 * population variance of the split's k rewards
    # rounding bound of the k-term sums: splits within it are ties (M = the row's largest |r - median|)
    m = torch.maximum(-c[:, :1], c[:, -1:])
    tol = 8 * _F64_EPS * k**3 * m * m
    tied = score >= score.max(dim=1, keepdim=True).values - tol
    # preference among tied splits: |2i - k| smallest, then i smallest (rank (k + 1) |2i - k| + i < 3 (k + 1)^2)
    pref = (2 * i - k).abs() * (k + 1) + i
    return torch.where(tied, pref, 3 * (k + 1) ** 2).argmin(dim=1)


# ----------------------------------------------------------------------------------------------
# preference pairs


PairTie = Literal["skip", "arbitrary"]
_PAIR_TIES: tuple[str, ...] = ("skip", "arbitrary")


def best_worst_pairs(
    rewards: torch.Tensor,
    group: torch.Tensor,
    valid: torch.Tensor | None = None,
    tie: PairTie = "skip",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (chosen, rejected) pair per group from pointwise rewards: the group's best and worst sample.

    Online DPO on pointwise rewards (Flow-GRPO's DPO / OnlineDPO, Flow-Factory's ``dpo``, verl-omni's online
    DPO) pairs each prompt's highest-reward sample with its lowest. Within each group's valid members the
    module's tie rule orders the rewards: ONE stable ascending sort by reward, i.e. by (reward, batch index),
    so among equal rewards the lower batch index counts as lower. The rejected sample is the first of that
    order and the chosen the last, which is the same rule as `select_candidates`' bottom / top sets; hence
    chosen != rejected whenever the group has >= 2 valid members, and reward(chosen) >= reward(rejected).
    With binary rewards and a single 1 among 0s, the chosen is the 1 and the rejected the lowest-index 0.

    Groups with fewer than 2 valid members give no pair. A group whose valid rewards are all equal (its
    maximum equals its minimum, e.g. an all-0 binary group) gives no pair with ``tie="skip"`` (a pair of equal
    rewards carries no preference), and the (last, first) pair of the stable order with ``tie="arbitrary"``
    (Flow-GRPO's behaviour: an arbitrary pair is trained).

    Args:
        rewards: [B] real rewards of a (gathered) batch; any real dtype, compared in float64.
        group: [B] integer group id per sample (e.g. the prompt index); any values, any order.
        valid: optional [B] bool mask of usable samples. Samples with a NaN or +-inf reward are invalid in
            any case (never chosen nor rejected); None means every finite reward is valid.
        tie: ``"skip"`` or ``"arbitrary"``, the all-tied group's policy above.

    Returns:
        (chosen, rejected): two int64 [P] index tensors into the batch (P = number of pairs, possibly 0), one
        entry per paired group, ordered by the group's first appearance in the batch (its lowest batch index,
        valid or not), on the rewards' device.

    Raises:
        ValueError: rewards not a 1-d real tensor; group / valid not of its shape; group ids not integers;
            valid not bool; unknown tie policy.

    Source: Wallace et al. 2024, Diffusion-DPO (pairs); the best / worst pairing of online DPO in Flow-GRPO
    (Liu et al. 2025) and its ports.
    """
    if tie not in _PAIR_TIES:
        raise ValueError(f"unknown tie policy {tie!r}; expected one of {_PAIR_TIES}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or rewards.is_complex():
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a 1-d real tensor [B], got {shape}")
    b = rewards.shape[0]
    if not isinstance(group, torch.Tensor) or group.shape != rewards.shape:
        shape = tuple(group.shape) if isinstance(group, torch.Tensor) else type(group).__name__
        raise ValueError(f"group must be a [B] = [{b}] tensor of group ids, got {shape}")
    if group.dtype.is_floating_point or group.dtype.is_complex or group.dtype == torch.bool:
        raise ValueError(f"group must hold integer ids, got dtype {group.dtype}")
    r = rewards.detach().to(torch.float64)
    ok = torch.isfinite(r)
    if valid is not None:
        if not isinstance(valid, torch.Tensor) or valid.shape != rewards.shape or valid.dtype != torch.bool:
            desc = f"{tuple(valid.shape)} {valid.dtype}" if isinstance(valid, torch.Tensor) else type(valid).__name__
            raise ValueError(f"valid must be a bool [B] = [{b}] tensor or None, got {desc}")
        ok = ok & valid.to(r.device)
    empty = torch.zeros(0, dtype=torch.long, device=r.device)
    if b == 0:
        return empty, empty.clone()
    _, inverse = torch.unique(group.to(r.device), return_inverse=True)
    n_groups = int(inverse.max()) + 1
    index = torch.arange(b, device=r.device)
    first_seen = torch.full((n_groups,), b, dtype=torch.long, device=r.device).scatter_reduce_(
        0, inverse, index, reduce="amin"
    )
    members = ok.nonzero().flatten()  # valid batch indices, ascending
    if members.numel() == 0:
        return empty, empty.clone()
    # the tie rule: one stable sort by reward (ties keep ascending batch index), then a stable sort by group,
    # so each group's valid members end up contiguous and in (reward, index) order
    order = members[r[members].sort(stable=True).indices]
    order = order[inverse[order].sort(stable=True).indices]
    g_sorted = inverse[order]
    _, counts = torch.unique_consecutive(g_sorted, return_counts=True)
    end = counts.cumsum(0)
    rejected, chosen = order[end - counts], order[end - 1]
    keep = counts >= 2
    if tie == "skip":
        keep = keep & (r[chosen] > r[rejected])
    chosen, rejected = chosen[keep], rejected[keep]
    by_first = first_seen[inverse[chosen]].sort().indices
    return chosen[by_first], rejected[by_first]


# ----------------------------------------------------------------------------------------------
# proxy fidelity


def _average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks of the 1-d float64 ``x``, tied values sharing the average of their positions."""
    v, perm = x.sort(stable=True)
    _, inverse, counts = torch.unique_consecutive(v, return_inverse=True, return_counts=True)
    end = counts.cumsum(0).to(torch.float64)  # 1-based position of each tie group's last member
    avg = end - (counts.to(torch.float64) - 1) / 2
    ranks = torch.empty_like(x)
    ranks[perm] = avg[inverse]
    return ranks


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.is_complex():
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 1-d real tensor, got {shape}")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same length, got {a.shape[0]} and {b.shape[0]}")
    return a.detach().to(torch.float64), b.detach().to(torch.float64).to(a.device)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-d tensors: the Pearson correlation of their average ranks.

        rho = cov(R(a), R(b)) / (std R(a) std R(b)),

    with tied values given the mean of the ranks they span (as ``scipy.stats.spearmanr``). Computed in
    float64.

    Args:
        a, b: [N] real tensors (e.g. a prompt's preview and full-precision rewards); +-inf rank as
            extremes.

    Returns:
        a float in [-1, 1]; NaN when either side is constant (including N < 2) or contains NaN (NaN
        propagates, as scipy's default ``nan_policy``; a logging value, so no exception).

    Raises:
        ValueError: not 1-d real tensors, or lengths differ.

    Source: Spearman 1904; the tie convention of ``scipy.stats.spearmanr`` (``rankdata(method="average")``).
    """
    x, y = _check_pair(a, b)
    if x.numel() < 2 or bool(torch.isnan(x).any() | torch.isnan(y).any()):
        return math.nan
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()  # ranks are exact half-integers: a constant side gives exactly 0
    sxx, syy = float((rx * rx).sum()), float((ry * ry).sum())
    if sxx == 0.0 or syy == 0.0:
        return math.nan
    rho = float((rx * ry).sum()) / math.sqrt(sxx * syy)
    return max(-1.0, min(1.0, rho))


def set_overlap(a_preview: torch.Tensor, b_full: torch.Tensor, k: int) -> dict[str, float]:
    """How many of the k best (worst) candidates by the preview are among the k best (worst) by the full reward.

        top = |top_k(a) & top_k(b)| / k,   bottom = |bottom_k(a) & bottom_k(b)| / k,

    with top / bottom sets by the module's tie rule (one stable ascending sort; among tied values the bottom
    set takes the lower indices, the top set the higher ones), the same sets ``select_candidates`` uses.

    Args:
        a_preview: [N] real preview rewards.
        b_full: [N] real full-precision rewards of the same candidates.
        k: set size, 1 <= k <= N (k = N gives 1.0 trivially).

    Returns:
        ``{"top": float, "bottom": float}`` in [0, 1]; both NaN if either side contains NaN.

    Raises:
        ValueError: not 1-d real tensors of equal length; k not an integer in [1, N].
    """
    x, y = _check_pair(a_preview, b_full)
    n = x.numel()
    k = _check_k(k, n)
    if bool(torch.isnan(x).any() | torch.isnan(y).any()):
        return {"top": math.nan, "bottom": math.nan}
    px, py = x.sort(stable=True).indices, y.sort(stable=True).indices

    def shared(ix: torch.Tensor, iy: torch.Tensor) -> float:
        member = torch.zeros(n, dtype=torch.bool, device=x.device)
        member[ix] = True
        return int(member[iy].sum()) / k

    return {"top": shared(px[n - k :], py[n - k :]), "bottom": shared(px[:k], py[:k])}


def proxy_fidelity(preview: torch.Tensor, full: torch.Tensor, k: int) -> dict[str, float]:
    """Per-iteration fidelity of the preview rewards: `spearman` and `set_overlap` averaged over prompts.

    Args:
        preview: [G, N] (or [N]) preview rewards of G prompts' N candidates.
        full: the full-precision rewards of the same candidates, same shape.
        k: set size of the overlaps, 1 <= k <= N (e.g. the number kept per side).

    Returns:
        python floats: ``spearman`` (mean over the rows where it is defined: rows with a constant side or a
        NaN are skipped, as they are common with binary rewards; NaN if no row is defined),
        ``spearman_rows`` (how many rows entered that mean), ``top_overlap`` and ``bottom_overlap``
        (means over the rows without NaN; NaN if there are none).

    Raises:
        ValueError: shapes differ or are not [N] / [G, N]; k not an integer in [1, N].
    """
    p, _ = _as_rows(preview, "preview")
    f, _ = _as_rows(full, "full")
    if p.shape != f.shape:
        raise ValueError(f"preview {tuple(preview.shape)} and full {tuple(full.shape)} must have the same shape")
    k = _check_k(k, p.shape[1])
    rhos, tops, bottoms = [], [], []
    for row_p, row_f in zip(p, f):
        rho = spearman(row_p, row_f)
        if not math.isnan(rho):
            rhos.append(rho)
        ov = set_overlap(row_p, row_f, k)
        if not math.isnan(ov["top"]):
            tops.append(ov["top"])
            bottoms.append(ov["bottom"])

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else math.nan

    return {
        "spearman": mean(rhos),
        "spearman_rows": float(len(rhos)),
        "top_overlap": mean(tops),
        "bottom_overlap": mean(bottoms),
    }
