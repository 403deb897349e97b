"""Group / tree / batch statistics with several groups at clearly different reward levels (so pooling across groups
or one group leaking into another fails), and closed-form single updates of every stateful running statistic
(RunningMeanStd, the reward manager's Welford state, LaggedCopy, ramped_decay, Roles.update_lagged, the EMA callback).

Every expected value is computed independently in float64 with plain Python loops / closed forms; the tolerance of
each comparison is stated next to it (float64 paths: 1e-12; float32 outputs: about 1e-6 of the magnitude).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from genrl.callbacks.ema import EMA
from genrl.flow.nft import centered_advantages
from genrl.flow.policy import RunningMeanStd, group_advantages, group_stats, normalize_rewards
from genrl.flow.tree_advantages import depthwise_advantages, fuse_rewards, prune_edges
from genrl.methods.phases import Scores, group_advantages_of
from genrl.models.roles import LaggedCopy, Roles, ramped_decay
from genrl.rewards import RewardManager, RewardModel, RewardResult, per_reward_advantages, register_reward
from genrl.rewards.manager import ZSCORE_EPS, _Welford

F64 = torch.float64
NAN = float("nan")
ZERO_STD = 1e-6  # the documented "constant group" threshold


# ================================================================================================ references
def _ref_group_adv(r: list[float], g: list, valid: list[bool], std: str, eps: float, ddof: int) -> list[float]:
    """GRPO advantages by plain loops, float64 (Python floats), one group at a time."""
    members: dict = {}
    for ri, gi, ok in zip(r, g, valid):
        if ok:
            members.setdefault(gi, []).append(ri)
    stats = {}
    for gi, vals in members.items():
        m = sum(vals) / len(vals)
        ss = sum((v - m) ** 2 for v in vals)
        dof = len(vals) - ddof
        stats[gi] = (m, math.sqrt(ss / dof) if dof > 0 else 0.0)
    pooled = [ri for ri, ok in zip(r, valid) if ok]
    mu = sum(pooled) / len(pooled)
    global_std = math.sqrt(sum((v - mu) ** 2 for v in pooled) / (len(pooled) - ddof))
    out = []
    for ri, gi, ok in zip(r, g, valid):
        if not ok or stats[gi][1] < ZERO_STD:
            out.append(0.0)
            continue
        m, s = stats[gi]
        denom = {"group": s + eps, "global": global_std + eps, "none": 1.0}[std]
        out.append((ri - m) / denom)
    return out


# Groups at clearly different levels: A ~ +10 (id 17, 5 members), B ~ -3 (id -2, 3 members), C constant 4 (id 5),
# D (id 40) with one NaN (invalid) member, E (id 8): one valid + one invalid member, F (id 23): all invalid.
_GROUPS = [
    (17, [10.3, 9.1, 11.7, 10.0, 8.6], [True] * 5),
    (-2, [-2.5, -3.8, -3.1], [True] * 3),
    (5, [4.0, 4.0, 4.0, 4.0], [True] * 4),
    (40, [0.5, NAN, 1.5, 2.75], [True, False, True, True]),
    (8, [7.0, NAN], [True, False]),
    (23, [NAN, NAN], [False, False]),
]


def _interleaved() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards float64 [N], group ids int64 [N], valid bool [N]) in a fixed shuffled (non-contiguous) order."""
    flat = [(gid, r, ok) for gid, rs, oks in _GROUPS for r, ok in zip(rs, oks)]
    perm = torch.randperm(len(flat), generator=torch.Generator().manual_seed(3)).tolist()
    flat = [flat[i] for i in perm]
    ids = [f[0] for f in flat]
    pos_a = [i for i, gid in enumerate(ids) if gid == 17]
    assert pos_a[-1] - pos_a[0] + 1 > len(pos_a)  # group A is not contiguous: the order really is interleaved
    return (torch.tensor([f[1] for f in flat], dtype=F64), torch.tensor(ids, dtype=torch.long),
            torch.tensor([f[2] for f in flat]))


# ================================================================================================ group_advantages
@pytest.mark.parametrize("std", ["group", "global", "none"])
@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("eps", [1e-4, 0.3])
def test_group_advantages_interleaved_multi_level_groups_match_float64_loops(std, ddof, eps):
    """Advantages equal per-group float64 loops on interleaved multi-level groups (fails on pooled mean / std)."""
    r, g, valid = _interleaved()
    adv = group_advantages(r, g, std=std, eps=eps, ddof=ddof, valid=valid)
    assert adv.dtype == F64
    ref = torch.tensor(_ref_group_adv(r.tolist(), g.tolist(), valid.tolist(), std, eps, ddof), dtype=F64)
    torch.testing.assert_close(adv, ref, rtol=0, atol=1e-12)
    # constant group C, single-valid group E, all-invalid group F and every invalid member: exactly 0
    zero = (g == 5) | (g == 8) | (g == 23) | ~valid
    assert torch.equal(adv[zero], torch.zeros(int(zero.sum()), dtype=F64))
    assert bool((adv[g == 17] != 0).all()) and bool((adv[g == -2] != 0).all())
    for gid in (17, -2, 40):  # every non-constant group is centred on its own mean
        assert abs(float(adv[(g == gid) & valid].sum())) < 1e-12


@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_group_advantages_permuting_samples_and_relabelling_groups_permutes_outputs(std):
    """Shuffling samples and renaming group ids permutes the advantages identically (atol 1e-12)."""
    r, g, valid = _interleaved()
    adv = group_advantages(r, g, std=std, eps=1e-4, ddof=1, valid=valid)
    perm = torch.randperm(len(r), generator=torch.Generator().manual_seed(11))
    rename = {17: 3, -2: 900, 5: -50, 40: 0, 8: 41, 23: 7}  # reverses the ids' sort order in part
    g2 = torch.tensor([rename[int(x)] for x in g[perm]], dtype=torch.long)
    adv2 = group_advantages(r[perm], g2, std=std, eps=1e-4, ddof=1, valid=valid[perm])
    torch.testing.assert_close(adv2, adv[perm], rtol=0, atol=1e-12)


def test_group_advantages_one_group_does_not_leak_into_others():
    """Rescaling group B leaves the other groups' advantages bitwise unchanged (group / none std modes)."""
    r, g, valid = _interleaved()
    r2 = r.clone()
    b = g == -2
    r2[b] = r2[b] * 50 + 1000
    others = ~b
    for std in ("group", "none"):
        a1 = group_advantages(r, g, std=std, valid=valid)
        a2 = group_advantages(r2, g, std=std, valid=valid)
        assert torch.equal(a1[others], a2[others]), std
    a1 = group_advantages(r, g, std="global", valid=valid)
    a2 = group_advantages(r2, g, std="global", valid=valid)
    a_sel = (g == 17)
    assert not torch.allclose(a1[a_sel], a2[a_sel], atol=1e-3)


def test_group_stats_multi_level_groups_with_invalid_and_empty_groups():
    """group_stats: pooled mean / std, per-group std mean and zero-std fraction over non-empty groups."""
    r, g, valid = _interleaved()
    st = group_stats(r, g, valid)
    pooled = [x for x, ok in zip(r.tolist(), valid.tolist()) if ok]
    mu = sum(pooled) / len(pooled)
    sd = math.sqrt(sum((x - mu) ** 2 for x in pooled) / len(pooled))
    gstds = []
    for _, rs, oks in _GROUPS:
        vals = [x for x, ok in zip(rs, oks) if ok]
        if vals:
            m = sum(vals) / len(vals)
            gstds.append(math.sqrt(sum((x - m) ** 2 for x in vals) / len(vals)))
    assert len(gstds) == 5
    assert all(v.dtype == torch.float32 for v in st.values())
    assert float(st["reward_mean"]) == pytest.approx(mu, rel=1e-6)
    assert float(st["reward_std"]) == pytest.approx(sd, rel=1e-6)
    assert float(st["group_std_mean"]) == pytest.approx(sum(gstds) / len(gstds), rel=1e-6)
    assert float(st["zero_std_fraction"]) == pytest.approx(2 / 5, rel=1e-6)
    assert float(st["valid_fraction"]) == pytest.approx(sum(valid.tolist()) / len(valid), rel=1e-6)


def test_normalize_rewards_per_column_statistics_and_eps():
    """normalize_rewards is (r - m_k) / (s_k + eps) per column, with eps inside the denominator."""
    r = torch.tensor([[10.5, -2.0], [9.0, -3.5], [12.0, -4.0]], dtype=F64)
    m = torch.tensor([10.0, -3.0], dtype=F64)
    s = torch.tensor([1.5, 0.5], dtype=F64)
    out = normalize_rewards(r, m, s, eps=0.25)
    ref = [[(r[i, k].item() - m[k].item()) / (s[k].item() + 0.25) for k in range(2)] for i in range(3)]
    torch.testing.assert_close(out, torch.tensor(ref, dtype=F64), rtol=0, atol=1e-12)


# ================================================================================================ trees
# Three trees (roots 0, 1, 2 at step 0) whose nodes are interleaved at every step, with unequal branching:
# step 1: 7 nodes, parents [2, 0, 1, 0, 2, 1, 0] (tree 0 has 3 nodes, trees 1 and 2 have 2);
# step 2 (leaves): 10 nodes, parents [1, 3, 0, 5, 4, 2, 1, 3, 5, 6] (tree 0: 5 leaves, tree 1: 3, tree 2: 2).
_PARENT = [torch.zeros(0, dtype=torch.long), torch.tensor([2, 0, 1, 0, 2, 1, 0]),
           torch.tensor([1, 3, 0, 5, 4, 2, 1, 3, 5, 6])]
_TREE1 = torch.tensor([2, 0, 1, 0, 2, 1, 0])
_TREE = [torch.tensor([0, 1, 2]), _TREE1, _TREE1[_PARENT[2]]]
# tree 0 ~ +10, tree 1 ~ -3, tree 2 constant 4; leaf 9 (the only leaf of node 6) and leaf 7 are invalid
_LEAF_R = torch.tensor([10.25, 9.0, 4.0, -2.5, 4.0, -3.5, 12.0, NAN, -3.0, NAN], dtype=torch.float32)
_LEAF_OK = torch.tensor([True, True, True, True, True, True, True, False, True, False])


def _children(k: int, n: int) -> list[int]:
    return [c for c in range(len(_PARENT[k + 1])) if int(_PARENT[k + 1][c]) == n]


def _ref_fuse_mean(k: int, n: int) -> tuple[float, int]:
    """(sum, count) of the valid leaves below node n of step k."""
    if k == len(_PARENT) - 1:
        return (float(_LEAF_R[n]), 1) if bool(_LEAF_OK[n]) else (0.0, 0)
    tot, cnt = 0.0, 0
    for c in _children(k, n):
        s, m = _ref_fuse_mean(k + 1, c)
        tot, cnt = tot + s, cnt + m
    return tot, cnt


def _ref_fuse_path(k: int, n: int, lp: list[torch.Tensor], alpha: float) -> float | None:
    """Path-probability fused reward (None: no valid leaf below)."""
    if k == len(_PARENT) - 1:
        return float(_LEAF_R[n]) if bool(_LEAF_OK[n]) else None
    num = den = 0.0
    for c in _children(k, n):
        rc = _ref_fuse_path(k + 1, c, lp, alpha)
        if rc is not None:
            w = math.exp(alpha * float(lp[k + 1][c]))
            num, den = num + w * rc, den + w
    return num / den if den > 0 else None


def test_fuse_rewards_mean_multi_tree_interleaved_with_invalid_leaves():
    """Mean fusion: each node's reward is the mean of its own valid leaves, per tree; no valid leaf -> NaN."""
    rewards, valid = fuse_rewards(_PARENT, _LEAF_R, _LEAF_OK)
    for k in range(3):
        assert rewards[k].dtype == F64
        for n in range(len(_TREE[k])):
            s, c = _ref_fuse_mean(k, n)
            assert bool(valid[k][n]) == (c > 0), (k, n)
            if c:
                assert float(rewards[k][n]) == pytest.approx(s / c, abs=1e-12, rel=0), (k, n)
            else:
                assert math.isnan(float(rewards[k][n])), (k, n)
    assert not bool(valid[1][6]) and float(rewards[1][3]) == pytest.approx(float(_LEAF_R[1]), abs=1e-12)


def test_fuse_rewards_path_prob_multi_tree_matches_recursive_softmax():
    """Path-prob fusion: softmax(alpha l_c) weights over each node's own valid children, recursively."""
    gen = torch.Generator().manual_seed(5)
    lp = [torch.zeros(0)] + [torch.randn(len(p), generator=gen) for p in _PARENT[1:]]
    alpha = 0.7
    rewards, valid = fuse_rewards(_PARENT, _LEAF_R, _LEAF_OK, log_probs=lp, weighting="path_prob", alpha=alpha)
    for k in range(3):
        for n in range(len(_TREE[k])):
            ref = _ref_fuse_path(k, n, lp, alpha)
            assert bool(valid[k][n]) == (ref is not None), (k, n)
            if ref is not None:
                assert float(rewards[k][n]) == pytest.approx(ref, abs=1e-12, rel=0), (k, n)


def test_depthwise_advantages_are_per_tree_per_depth():
    """Depth-wise advantages group the valid nodes of one depth within one tree (ddof 1, eps), never across trees."""
    rewards, valid = fuse_rewards(_PARENT, _LEAF_R, _LEAF_OK)
    eps = 0.05
    adv = depthwise_advantages(rewards, valid, _TREE, eps=eps)
    for k in range(3):
        assert adv[k].dtype == torch.float32
        ref = _ref_group_adv(torch.nan_to_num(rewards[k]).tolist(), _TREE[k].tolist(), valid[k].tolist(), "group",
                             eps, 1)
        torch.testing.assert_close(adv[k].double(), torch.tensor(ref, dtype=F64), rtol=0, atol=1e-6)
    assert torch.equal(adv[0], torch.zeros(3))  # one node per tree at depth 0
    assert torch.equal(adv[2][_TREE[2] == 2], torch.zeros(2))  # tree 2 is constant
    assert bool((adv[2][(_TREE[2] == 0) & _LEAF_OK] != 0).all())


def test_depthwise_advantages_one_tree_does_not_leak_into_others():
    """Rescaling tree 1's leaves leaves trees 0 and 2's fused rewards and advantages bitwise unchanged."""
    r2 = _LEAF_R.clone()
    t1 = _TREE[2] == 1
    r2[t1] = r2[t1] * 40 - 500
    f1, v1 = fuse_rewards(_PARENT, _LEAF_R, _LEAF_OK)
    f2, v2 = fuse_rewards(_PARENT, r2, _LEAF_OK)
    a1 = depthwise_advantages(f1, v1, _TREE)
    a2 = depthwise_advantages(f2, v2, _TREE)
    for k in range(1, 3):
        keep = _TREE[k] != 1
        assert torch.equal(torch.nan_to_num(f1[k][keep]), torch.nan_to_num(f2[k][keep])), k
        assert torch.equal(a1[k][keep], a2[k][keep]), k


def _ref_prune(adv: list[float], step: list[int], groups: list[int], last: list[bool], ratio: float, mode: str):
    keep = [True] * len(adv)
    for gid in sorted({gi for gi, la in zip(groups, last) if la}):
        members = [i for i in range(len(adv)) if last[i] and groups[i] == gid]
        ranked = sorted(members, key=lambda i: (-adv[i], step[i], i))  # best first, ties: shallow, then index
        n_keep = math.ceil(len(members) * (1 - ratio) - 1e-9)
        if mode == "chain":
            drop = ranked[n_keep:]
        else:
            top = n_keep // 2
            drop = ranked[top: len(ranked) - (n_keep - top)]
        for i in drop:
            keep[i] = False
    return keep


@pytest.mark.parametrize("mode", ["extremes", "chain"])
def test_prune_edges_width_ranks_within_each_tree_or_chain(mode):
    """Width pruning ranks last-layer edges within each tree (extremes) or chain (chain), never pooled."""
    gen = torch.Generator().manual_seed(8)
    n = 24
    step = torch.tensor([0, 1] * 4 + [2, 3, 4, 5] * 4)  # steps 2..5 are below the last split (1)
    tree = torch.tensor([0, 1] * 4 + [0, 1, 1, 0] * 4)  # interleaved trees
    chain = torch.tensor([9] * 8 + [0, 1, 2, 3] * 4)
    adv = torch.randn(n, generator=gen) + torch.where(tree == 0, 10.0, -3.0)
    edges = {"step": step, "tree": tree}
    keep = prune_edges(edges, adv, [0, 1], 6, width_ratio=0.5, width_mode=mode, chain_id=chain)
    groups = tree if mode == "extremes" else chain
    ref = _ref_prune(adv.tolist(), step.tolist(), groups.tolist(), (step > 1).tolist(), 0.5, mode)
    assert keep.tolist() == ref
    if mode == "extremes":
        for t in (0, 1):  # each tree keeps its own best and worst edges
            sel = (step > 1) & (tree == t)
            assert bool(keep[sel & (adv == adv[sel].max())].all()) and bool(keep[sel & (adv == adv[sel].min())].all())


# ================================================================================================ centered_advantages
@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_centered_advantages_interleaved_groups_per_frame(std):
    """centered_advantages [B, T] with interleaved groups: a sample's T entries join its own group's statistics."""
    gen = torch.Generator().manual_seed(21)
    group = torch.tensor([4, 9, 4, 1, 9, 4, 1, 4])  # sizes 4, 2, 2; interleaved
    level = {4: 10.0, 9: -3.0, 1: 0.5}
    d = torch.randn(8, 3, generator=gen, dtype=F64) + torch.tensor([level[int(x)] for x in group], dtype=F64)[:, None]
    eps = 0.2
    a = centered_advantages(d, eps=eps, group=group, std=std)
    flat_g = [int(group[i]) for i in range(8) for _ in range(3)]
    ref = _ref_group_adv(d.reshape(-1).tolist(), flat_g, [True] * 24, std, eps, 0)
    torch.testing.assert_close(a, torch.tensor(ref, dtype=F64).reshape(8, 3), rtol=0, atol=1e-12)
    # clipping after normalisation
    ac = centered_advantages(d, eps=eps, group=group, std=std, clip=0.8)
    torch.testing.assert_close(ac, torch.tensor(ref, dtype=F64).clamp(-0.8, 0.8).reshape(8, 3), rtol=0, atol=1e-12)


def test_centered_advantages_without_groups_pool_the_whole_batch():
    """Without group ids the whole batch is one group: pooled mean and ddof-0 std (AFD's batch centring)."""
    d = torch.tensor([10.2, -3.1, 9.7, -2.8, 10.9, -3.6], dtype=F64)
    a = centered_advantages(d, eps=0.1)
    ref = _ref_group_adv(d.tolist(), [0] * 6, [True] * 6, "group", 0.1, 0)
    torch.testing.assert_close(a, torch.tensor(ref, dtype=F64), rtol=0, atol=1e-12)
    assert bool((a[::2] > 0).all()) and bool((a[1::2] < 0).all())


# ================================================================================================ reward manager
@register_reward("t26_meta_reward")
class _MetaReward(RewardModel):
    """reward = meta[key] (NaN marks the sample invalid for this reward)."""

    def __init__(self, key: str = "a", scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.key = key

    def score(self, pixels, prompts, **meta):
        return {"reward": meta[self.key].to(torch.float32)}


def _result(rewards: dict[str, list[float]], weights: dict[str, float]) -> RewardResult:
    """A RewardResult built by hand: each reward's own validity is its finiteness, ``valid`` their AND."""
    rs = {k: torch.tensor(v, dtype=torch.float32) for k, v in rewards.items()}
    ok = {k: torch.isfinite(v) for k, v in rs.items()}
    valid = torch.stack(list(ok.values())).all(0)
    total = torch.zeros(len(valid))
    return RewardResult(components={f"{k}/reward": v for k, v in rs.items()}, rewards=rs, reward_valid=ok,
                        valid=valid, total=total, weights=weights)


# reward a: prompt "x" ~ +10, "y" ~ -3, "z" constant; reward b on another scale, NaN on one sample where a is valid
_PRA = {
    "a": [10.5, -2.5, 4.0, 9.0, -3.5, 4.0, 12.0, -3.0, 4.0, 8.0],
    "b": [0.1, 50.0, 0.3, NAN, 20.0, 0.9, 0.2, 35.0, 0.6, 0.4],
}
_PRA_GROUPS = ["x", "y", "z", "x", "y", "z", "x", "y", "z", "x"]


@pytest.mark.parametrize("std", ["group", "global", "none"])
def test_per_reward_advantages_multi_group_multi_reward(std):
    """Per-reward advantages: per group over result.valid, weighted and summed; permuting samples permutes them."""
    weights = {"a": 1.5, "b": -0.25}
    res = _result(_PRA, weights)
    valid = res.valid.tolist()
    assert valid.count(False) == 1
    adv, per, details = per_reward_advantages(res, _PRA_GROUPS, std=std, eps=0.1, return_details=True)
    hand = [0.0] * 10
    for name, w in weights.items():
        r = res.rewards[name].double().tolist()
        ref = _ref_group_adv(r, _PRA_GROUPS, valid, std, 0.1, 0)
        torch.testing.assert_close(per[name].double(), torch.tensor(ref, dtype=F64), rtol=0, atol=1e-5)
        hand = [h + w * x for h, x in zip(hand, ref)]
    torch.testing.assert_close(adv.double(), torch.tensor(hand, dtype=F64), rtol=0, atol=1e-5)
    assert float(adv[3]) == 0.0
    assert details["a/zero_std_groups"] == pytest.approx(1 / 3) and details["b/zero_std_groups"] == 0.0
    # permuting the samples permutes the advantages (groups are named by their labels, not their positions)
    perm = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
    res_p = _result({k: [v[i] for i in perm] for k, v in _PRA.items()}, weights)
    adv_p = per_reward_advantages(res_p, [_PRA_GROUPS[i] for i in perm], std=std, eps=0.1)
    torch.testing.assert_close(adv_p, adv[perm], rtol=0, atol=1e-6)


@pytest.mark.parametrize("per_reward", [False, True])
def test_group_advantages_of_matches_reference_on_one_process(per_reward):
    """group_advantages_of equals the multi-group reference with its std / eps, total or per reward."""
    weights = {"a": 1.5, "b": -0.25}
    res = _result(_PRA, weights)
    total = torch.tensor([sum(weights[k] * _PRA[k][i] for k in weights) for i in range(10)], dtype=torch.float32)
    ids = {"x": 0, "y": 1, "z": 2}
    group = torch.tensor([ids[x] for x in _PRA_GROUPS])
    scores = Scores(res, torch.where(res.valid, total, torch.full_like(total, NAN)), res.valid, group, 10)
    module = LightningModule()
    module.scorer = SimpleNamespace(manager=RewardManager([{"name": "t26_meta_reward"}]))
    adv = group_advantages_of(module, scores, std="global", eps=0.1, per_reward=per_reward, min_group_size=2)
    valid = res.valid.tolist()
    if per_reward:
        ref = [0.0] * 10
        for name, w in weights.items():
            part = _ref_group_adv(res.rewards[name].double().tolist(), _PRA_GROUPS, valid, "global", 0.1, 0)
            ref = [x + w * y for x, y in zip(ref, part)]
    else:
        ref = _ref_group_adv(scores.total.double().tolist(), _PRA_GROUPS, valid, "global", 0.1, 0)
    torch.testing.assert_close(adv.double(), torch.tensor(ref, dtype=F64), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="group_size >= 5"):
        group_advantages_of(module, scores, min_group_size=5)


def test_manager_standardize_running_state_over_two_batches():
    """standardize: running a-stats merge over batches (this one included); total = w (a - m) / (s + eps) + w_b b."""
    specs = [{"name": "t26_meta_reward", "weight": 2.0, "standardize": True, "kwargs": {"key": "a"}},
             {"name": "t26_meta_reward", "weight": 0.5, "kwargs": {"key": "b"}}]
    mgr = RewardManager(specs, batch_size=3)
    batches = [
        ({"a": [10.5, 9.0, NAN, 12.0, 8.0], "b": [1.0, NAN, 2.0, 3.0, 4.0]}),
        ({"a": [-2.5, -3.5, -3.0, 4.0], "b": [5.0, 6.0, 7.0, NAN]}),
    ]
    seen: list[float] = []
    for batch in batches:
        a, b = batch["a"], batch["b"]
        meta = {k: torch.tensor(v) for k, v in batch.items()}
        res = mgr(torch.zeros(len(a), 1, 3, 2, 2), ["p"] * len(a), **meta)
        seen += [float(torch.tensor(x, dtype=torch.float32)) for x in a if not math.isnan(x)]
        m = sum(seen) / len(seen)
        s = math.sqrt(sum((x - m) ** 2 for x in seen) / len(seen))
        count, mean, std = mgr.running_stats()["t26_meta_reward"]
        assert count == len(seen)
        assert mean == pytest.approx(m, rel=1e-12, abs=1e-12) and std == pytest.approx(s, rel=1e-12)
        assert mgr.running_stats()["t26_meta_reward_2"] == (0.0, 0.0, 0.0)  # b is never standardised
        for i in range(len(a)):
            if math.isnan(a[i]) or math.isnan(b[i]):
                assert math.isnan(float(res.total[i])), i
            else:
                expect = 2.0 * (float(torch.tensor(a[i])) - m) / (s + ZSCORE_EPS) + 0.5 * b[i]
                assert float(res.total[i]) == pytest.approx(expect, rel=1e-6, abs=1e-5), i


def test_welford_single_and_merged_update_closed_form():
    """_Welford update is Chan's merge once (fails if weight inverted, cross term dropped or count doubled)."""
    x1, x2 = [10.5, 9.0, 12.0, 8.5], [-3.0, -2.0, -4.5]
    w = _Welford()
    w.update(torch.tensor(x1, dtype=F64))
    m1 = sum(x1) / 4
    assert w.count == 4 and w.mean == pytest.approx(m1, rel=1e-12)
    assert w.m2 == pytest.approx(sum((x - m1) ** 2 for x in x1), rel=1e-12)
    w.update(torch.tensor(x2, dtype=F64))
    allx = x1 + x2
    m = sum(allx) / 7
    assert w.count == 7 and w.mean == pytest.approx(m, rel=1e-12)
    assert w.m2 == pytest.approx(sum((x - m) ** 2 for x in allx), rel=1e-12)
    assert w.std == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in allx) / 7), rel=1e-12)
    before = w.state()
    w.update(torch.zeros(0))
    assert w.state() == before


def test_running_mean_std_single_and_merged_update_closed_form():
    """RunningMeanStd update is Chan's merge per component, NaN skipped (fails if inverted, dropped or doubled)."""
    rms = RunningMeanStd(shape=(2,))
    b1 = [[10.0, -3.0], [12.0, -2.0], [11.5, -4.5]]
    b2 = [[-3.0, 100.0], [-1.0, NAN], [-2.5, 90.0], [-4.0, NAN]]

    def moments(vals):
        m = sum(vals) / len(vals)
        return len(vals), m, sum((v - m) ** 2 for v in vals)

    rms.update(torch.tensor(b1, dtype=F64))
    for k in range(2):
        n, m, m2 = moments([row[k] for row in b1])
        assert float(rms.count[k]) == n and float(rms.mean[k]) == pytest.approx(m, rel=1e-12)
        assert float(rms.m2[k]) == pytest.approx(m2, rel=1e-12)
    rms.update(torch.tensor(b2, dtype=F64))
    for k in range(2):
        vals = [row[k] for row in b1 + b2 if not math.isnan(row[k])]
        n, m, m2 = moments(vals)
        assert float(rms.count[k]) == n, k
        assert float(rms.mean[k]) == pytest.approx(m, rel=1e-12), k
        assert float(rms.m2[k]) == pytest.approx(m2, rel=1e-12), k
        assert float(rms.var[k]) == pytest.approx(m2 / n, rel=1e-12), k
    assert rms.count.tolist() == [7.0, 5.0]


# ================================================================================================ lagged copies
class _Gen(nn.Module):
    """A generator stand-in: the lagged roles follow ``generator.transformer``."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.transformer = net


class _Owner(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.roles = Roles(self)
        self.roles.trainable("generator", _Gen(net))


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    net[2].bias.requires_grad_(False)  # frozen: not lagged, never touched
    return net


def _perturb(net: nn.Module, scale: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def test_lagged_copy_update_closed_form_per_tensor_and_edges():
    """LaggedCopy.update is old <- d old + (1 - d) live per tensor, once (fails if d inverted, skipped, doubled)."""
    net = _net()
    lagged = LaggedCopy(net)
    assert set(lagged.tensors()) == {"0.weight", "0.bias", "2.weight"}
    old0 = {n: t.clone() for n, t in lagged.tensors().items()}
    _perturb(net, 1.0, 1)
    live1 = {n: p.detach().clone() for n, p in net.named_parameters()}
    lagged.update(net, 0.3)
    mid = {}
    for n, t in lagged.tensors().items():
        mid[n] = 0.3 * old0[n] + 0.7 * live1[n]
        torch.testing.assert_close(t, mid[n], rtol=0, atol=1e-14)
    _perturb(net, 2.0, 2)
    live2 = {n: p.detach().clone() for n, p in net.named_parameters()}
    lagged.update(net, 0.8)
    for n, t in lagged.tensors().items():
        torch.testing.assert_close(t, 0.8 * mid[n] + 0.2 * live2[n], rtol=0, atol=1e-14)
    assert torch.equal(dict(net.named_parameters())["2.bias"], live2["2.bias"])
    snap = {n: t.clone() for n, t in lagged.tensors().items()}
    lagged.update(net, 1.0)
    assert all(torch.equal(t, snap[n]) for n, t in lagged.tensors().items())
    lagged.update(net, 0.0)
    assert all(torch.equal(t, live2[n]) for n, t in lagged.tensors().items())


def test_ramped_decay_formula():
    """ramped_decay(i, ramp, max) = min(ramp * i, max) (fails on an off-by-one iteration or max for min)."""
    assert ramped_decay(0, 0.01, 0.9) == 0.0
    assert ramped_decay(7, 0.05, 0.9) == 0.05 * 7
    assert ramped_decay(17, 0.05, 0.9) == 0.05 * 17
    assert ramped_decay(18, 0.05, 0.9) == 0.9
    assert ramped_decay(1000, 0.05, 0.9) == 0.9


def test_roles_update_lagged_updates_only_the_named_role():
    """Roles.update_lagged applies d old + (1 - d) live to the named role only (fails if inverted or skipped)."""
    net = _net()
    owner = _Owner(net)
    a = owner.roles.lagged("old_policy", net)
    b = owner.roles.lagged("other", net)
    old = {n: t.clone() for n, t in a.tensors().items()}
    _perturb(net, 1.0, 4)
    live = {n: p.detach().clone() for n, p in net.named_parameters()}
    assert owner.roles.update_lagged("old_policy", 0.35) == 0.35
    for n, t in a.tensors().items():
        torch.testing.assert_close(t, 0.35 * old[n] + 0.65 * live[n], rtol=0, atol=1e-14)
    assert all(torch.equal(t, old[n]) for n, t in b.tensors().items())


def test_ram_update_old_policy_uses_ramped_decay_of_the_iteration():
    """RAM.update_old_policy uses d = min(ramp * iteration, max), applied once (fails off by one or inverted)."""
    from genrl.methods.ram import RAM

    net = _net()
    owner = _Owner(net)
    lag = owner.roles.lagged("old_policy", net)
    old = {n: t.clone() for n, t in lag.tensors().items()}
    _perturb(net, 1.0, 6)
    live = {n: p.detach().clone() for n, p in net.named_parameters()}
    stub = SimpleNamespace(roles=owner.roles, iteration=torch.tensor(7),
                           hparams=SimpleNamespace(old_decay_ramp=0.05, old_decay_max=0.9))
    d = RAM.update_old_policy(stub)
    assert d == 0.05 * 7
    for n, t in lag.tensors().items():
        torch.testing.assert_close(t, d * old[n] + (1 - d) * live[n], rtol=0, atol=1e-14)


# ================================================================================================ EMA callback
class _Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.generator = nn.Linear(3, 2)
        self.critic = nn.Linear(2, 2)
        self.frozen_part = nn.Parameter(torch.ones(2), requires_grad=False)


def _step(ema: EMA, module: nn.Module, global_step: int, seed: int) -> dict[str, torch.Tensor]:
    """Perturb the trainable parameters (an optimizer step), run the callback; returns the new raw params (float64)."""
    _perturb(module, 0.5, seed)
    ema.on_train_batch_end(SimpleNamespace(global_step=global_step), module, None, None, 0)
    return {n: p.detach().double().clone() for n, p in module.named_parameters()}


def test_ema_callback_warmup_schedule_closed_form():
    """EMA warm-up: shadow <- d_t shadow + (1 - d_t) p, d_t = min(decay, (1+t)/(10+t)); fails inverted / doubled."""
    module = _Module()
    ema = EMA(decay=0.25, warmup=True)
    ema.on_fit_start(None, module)
    ref = {n: p.detach().double().clone() for n, p in module.named_parameters() if p.requires_grad}
    assert set(ema.shadow) == set(ref)
    expected_d = [1 / 10, 2 / 11, 0.25, 0.25, 0.25]  # (1 + t) / (10 + t) until it reaches decay = 0.25
    for t, d in enumerate(expected_d):
        assert ema.current_decay() == pytest.approx(d, rel=1e-15)
        live = _step(ema, module, t + 1, seed=10 + t)
        for n in ref:
            ref[n] = d * ref[n] + (1 - d) * live[n]
            torch.testing.assert_close(ema.shadow[n].double(), ref[n], rtol=0, atol=1e-6)
        assert ema.num_updates == t + 1
    raw = {n: p.detach().clone() for n, p in module.named_parameters()}
    with ema.swapped(module):  # the shadow is what validation sees, and the raw weights come back afterwards
        for n, p in module.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.detach().double(), ref[n], rtol=0, atol=1e-6)
    assert all(torch.equal(p.detach(), raw[n]) for n, p in module.named_parameters())


def test_ema_callback_constant_decay_update_every_start_step_and_include():
    """EMA: 0.9 / 0.1 step on update_every multiples from start_step, copy before, include prefix (fails skipped)."""
    module = _Module()
    ema = EMA(decay=0.9, warmup=False, update_every=2, start_step=4, include="generator.")
    ema.on_fit_start(None, module)
    assert set(ema.shadow) == {"generator.weight", "generator.bias"}
    live = _step(ema, module, 2, seed=20)  # before start_step: copy, no update counted
    for n in ema.shadow:
        torch.testing.assert_close(ema.shadow[n].double(), live[n], rtol=0, atol=1e-7)
    assert ema.num_updates == 0
    ref = {n: live[n].clone() for n in ema.shadow}
    _step(ema, module, 3, seed=21)  # not a multiple of update_every: untouched
    for n in ema.shadow:
        torch.testing.assert_close(ema.shadow[n].double(), ref[n], rtol=0, atol=1e-7)
    live = _step(ema, module, 4, seed=22)
    for n in ema.shadow:
        ref[n] = 0.9 * ref[n] + 0.1 * live[n]
        torch.testing.assert_close(ema.shadow[n].double(), ref[n], rtol=0, atol=1e-6)
    assert ema.num_updates == 1 and ema.current_decay() == 0.9
    live = _step(ema, module, 6, seed=23)
    for n in ema.shadow:
        ref[n] = 0.9 * ref[n] + 0.1 * live[n]
        torch.testing.assert_close(ema.shadow[n].double(), ref[n], rtol=0, atol=1e-6)
    assert ema.num_updates == 2
