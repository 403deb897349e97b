"""A failed reward is never selected as best or worst and never changes another sample's advantage (issue 51).

One invariant, applied to every consumer of a reward's valid mask: GRPO's group advantages (every std mode), the
reward manager (its total, its per-reward advantages and its running standardisation state), BranchGRPO's tree
fusion and depth-wise advantages, TempAct's two-level advantages, online DPO's best / worst pairs and Sol-RL's
preview selection. Each runs on several groups at different reward levels with failed samples in some of them, the
failed samples holding each of the values that would make them an extreme (NaN, +-inf, +-1e30): the valid
samples' outputs must equal those computed with the failed samples deleted from the batch (or, where the batch's
structure cannot lose a sample, be the same whatever the failed value), the failed samples get advantage exactly 0
and are never chosen while their group has enough valid members.
"""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow.hierarchical import hierarchical_advantages
from genrl.flow.policy import group_advantages
from genrl.flow.selection import best_worst_pairs, select_candidates
from genrl.flow.tree_advantages import depthwise_advantages, fuse_rewards
from genrl.rewards import RewardManager, RewardModel, register_reward

EXTREMES = [math.nan, math.inf, -math.inf, 1e30, -1e30]
F64 = torch.float64

# 3 groups at different levels, interleaved; group 0 has 2 failed samples, group 1 one, group 2 none
GROUP = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1])
LEVEL = torch.tensor([0.0, 10.0, -5.0])
SPREAD = torch.tensor([0.3, -1.2, 0.7, 2.0, 0.4, -0.1, -0.8, 1.1, 0.25, 0.9, -0.6, 1.5, 0.05, 0.0], dtype=F64)
VALID = torch.tensor([True, True, True, False, True, True, True, False, True, True, True, True, False, True])


def _rewards(failed_value: float) -> torch.Tensor:
    r = LEVEL[GROUP].double() + SPREAD
    return torch.where(VALID, r, torch.full_like(r, failed_value))


@pytest.mark.parametrize("std,ddof", [("group", 0), ("group", 1), ("global", 0), ("none", 0)])
@pytest.mark.parametrize("failed", EXTREMES)
def test_group_advantages_ignore_failed_samples(std, ddof, failed):
    adv = group_advantages(_rewards(failed), GROUP, std=std, ddof=ddof, valid=VALID)
    kept = group_advantages(_rewards(0.0)[VALID], GROUP[VALID], std=std, ddof=ddof)
    assert torch.equal(adv[VALID], kept)  # the same computation on the same numbers: bitwise
    assert torch.equal(adv[~VALID], torch.zeros(int((~VALID).sum()), dtype=adv.dtype))


@register_reward("t51_failing_reward")
class _FailingReward(RewardModel):
    """reward = meta[key], valid = meta["ok"]: a reward that reports its own failures, with any value there."""

    def __init__(self, key: str = "a", scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.key = key

    def score(self, pixels, prompts, **meta):
        return {"reward": meta[self.key].float(), "valid": meta["ok"]}


@pytest.mark.parametrize("failed", EXTREMES)
def test_reward_manager_total_advantages_and_running_state_ignore_failed_samples(failed):
    """The manager's total is NaN on a failed sample whatever value it held; per-reward advantages and the running
    standardisation state equal a manager's that never saw the failed samples."""
    specs = [{"name": "t51_failing_reward", "weight": 2.0, "standardize": True, "kwargs": {"key": "a"}},
             {"name": "t51_failing_reward", "weight": 0.5, "kwargs": {"key": "b"}}]
    a = _rewards(failed)
    b = torch.where(VALID, _rewards(0.0).flip(0) * 0.5 + 3.0, torch.full_like(a, failed))
    full = RewardManager(specs)
    res = full(torch.zeros(len(a), 1, 3, 2, 2), ["p"] * len(a), a=a, b=b, ok=VALID)
    assert torch.equal(res.valid, VALID) and bool(res.total[~VALID].isnan().all())
    only = RewardManager(specs)
    ref = only(torch.zeros(int(VALID.sum()), 1, 3, 2, 2), ["p"] * int(VALID.sum()), a=a[VALID], b=b[VALID],
               ok=torch.ones(int(VALID.sum()), dtype=torch.bool))
    assert full.running_stats() == only.running_stats()
    assert torch.equal(res.total[VALID], ref.total)
    adv = full.per_reward_advantages(res, GROUP)
    assert torch.equal(adv[VALID], only.per_reward_advantages(ref, GROUP[VALID]))
    assert bool((adv[~VALID] == 0).all())


# a tree of 2 roots -> 2 children each -> 2 leaves each (8 leaves); leaves 1, 2, 6 failed
_PARENT = [torch.zeros(0, dtype=torch.long), torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])]
_TREE = [torch.tensor([0, 1]), torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])]
_LEAF_OK = torch.tensor([True, False, False, True, True, True, False, True])
_LEAF_R = torch.tensor([0.5, 0.0, 0.0, 1.5, 2.0, 0.25, 0.0, -1.0], dtype=F64)


@pytest.mark.parametrize("weighting", ["mean", "path_prob"])
@pytest.mark.parametrize("failed", EXTREMES)
def test_tree_fusion_and_depthwise_advantages_do_not_depend_on_failed_leaves(weighting, failed):
    log_probs = [torch.zeros(2, dtype=F64), torch.tensor([-0.5, -1.0, -0.2, -2.0], dtype=F64),
                 torch.linspace(-1.0, -0.1, 8, dtype=F64)]
    out = {}
    for value in (failed, 0.0):
        leaves = torch.where(_LEAF_OK, _LEAF_R, torch.full_like(_LEAF_R, value))
        fused, ok = fuse_rewards(_PARENT, leaves, _LEAF_OK, log_probs, weighting)
        adv = depthwise_advantages(fused, ok, _TREE)
        out[value] = (fused, ok, adv)
    (f1, ok1, a1), (f0, ok0, a0) = out[failed], out[0.0]
    for k in range(len(f1)):
        assert torch.equal(ok1[k], ok0[k])
        assert torch.equal(f1[k][ok1[k]], f0[k][ok0[k]]) and bool(f1[k][~ok1[k]].isnan().all())
        assert torch.equal(a1[k], a0[k]) and bool((a1[k][~ok1[k]] == 0).all())
    # a child keeps the valid leaves below it: mean fusion of leaves (0, 1) is leaf 0, of (2, 3) leaf 3
    if weighting == "mean":
        assert f1[1].tolist() == [0.5, 1.5, 1.125, -1.0] and bool(ok1[1].all())


@pytest.mark.parametrize("failed", EXTREMES)
def test_hierarchical_advantages_ignore_failed_continuations(failed):
    """TempAct: a failed continuation gets 0 at both levels and moves neither its plan's return nor anyone's
    advantage (P = 2 prompts x K = 3 plans x G = 3 continuations)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 3, generator=g, dtype=F64) + torch.tensor([0.0, 5.0], dtype=F64).view(2, 1, 1)
    ok = torch.ones(2, 3, 3, dtype=torch.bool)
    ok[0, 1, 2] = ok[1, 0, 0] = ok[1, 2, 1] = False
    runs = {}
    for value in (failed, 0.0):
        r = torch.where(ok, base, torch.full_like(base, value))
        runs[value] = hierarchical_advantages(r, r * 2 - 1, math.inf, math.inf, "global", "global",
                                              exec_valid=ok)
    a, b = runs[failed], runs[0.0]
    assert torch.equal(a.plan, b.plan) and torch.equal(a.exec, b.exec)
    assert bool((a.exec[~ok] == 0).all())
    # the plan with a failed continuation is ranked on its two valid ones: its return is their mean
    assert float(a.plan_return[0, 1]) == pytest.approx(float(base[0, 1, :2].mean()), abs=1e-12)


@pytest.mark.parametrize("tie", ["skip", "arbitrary"])
@pytest.mark.parametrize("failed", EXTREMES)
def test_best_worst_pairs_never_pair_a_failed_sample(tie, failed):
    rewards = _rewards(failed)
    chosen, rejected = best_worst_pairs(rewards, GROUP, VALID, tie=tie)
    assert bool(VALID[chosen].all()) and bool(VALID[rejected].all()) and len(chosen) == 3
    kept = VALID.nonzero().flatten()
    c_ref, r_ref = best_worst_pairs(_rewards(0.0)[VALID], GROUP[VALID], tie=tie)
    assert torch.equal(chosen, kept[c_ref]) and torch.equal(rejected, kept[r_ref])


@pytest.mark.parametrize("mode", ["best_worst", "max_variance", "mean_deviation", "random"])
@pytest.mark.parametrize("failed", EXTREMES)
def test_preview_selection_never_takes_a_failed_candidate_while_k_valid_remain(mode, failed):
    """Sol-RL: K = 3 of N = 5 per prompt; prompt 0 has 1 failed candidate, prompt 1 three (fewer than K valid left),
    prompt 2 none, prompt 3 two (exactly K valid left). With K valid the selection is the one on the valid candidates
    alone; with fewer, every valid one is kept and the rest are failed ones of lowest index."""
    r = torch.tensor([[0.0, 1.0, 0.5, 1.0, 1.0], [3.0, 1.0, 2.0, 4.0, 0.0], [-1.0, 2.0, 0.5, 0.5, 1.5],
                      [0.3, 0.1, 0.2, 0.9, 0.4]], dtype=F64)
    ok = torch.tensor([[True, True, False, True, True], [False, True, False, True, False], [True] * 5,
                       [False, True, True, False, True]])
    rows = torch.where(ok, r, torch.full_like(r, failed))
    sel = select_candidates(rows, 3, mode, generator=torch.Generator().manual_seed(1), valid=ok)
    assert sel.shape == (4, 3) and bool(ok[0, sel[0]].all()) and bool(ok[2, sel[2]].all())
    assert sel[1].tolist() == [0, 1, 3]  # both valid + the failed one of lowest index
    assert sel[3].tolist() == [1, 2, 4]  # exactly K valid: all of them
    if mode != "random":  # deterministic: the selection on the valid candidates alone
        good = ok[0].nonzero().flatten()
        assert torch.equal(sel[0], good[select_candidates(r[0, good], 3, mode)])
        assert torch.equal(sel[2], select_candidates(r[2], 3, mode))
    # the old rule (a failed reward replaced by its prompt's mean) took it as a "worst" for binary rewards: with
    # valid [0, 1, 1, 1] the mean 0.75 is the second lowest
    mean_fill = torch.where(ok[0], r[0], r[0][ok[0]].mean())
    if mode == "best_worst":
        assert 2 in select_candidates(mean_fill, 3, mode).tolist() and 2 not in sel[0].tolist()
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        select_candidates(rows, 3, mode, generator=torch.Generator(), valid=ok.float())
    with pytest.raises(ValueError, match="NaN or infinite"):  # without the mask a NaN is still refused
        select_candidates(torch.where(ok, r, torch.full_like(r, math.nan)), 3, mode, torch.Generator())
