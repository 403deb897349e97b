"""Tests of genrl.flow.hierarchical: TempAct's planner / executor group advantages."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow import HierarchicalAdvantages, group_advantages, hierarchical_advantages

F64 = torch.float64
MODES = ("global", "group", "none")
NO_CLIP = {"clip_plan": math.inf, "clip_exec": math.inf}


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---------------------------------------------------------------------------------------------- closed form


def test_hand_example_global_std() -> None:
    # P=1, K=2, G=2. Plan returns: mean(1, 3) = 2 and mean(4, 6) = 5 -> centred -1.5, +1.5; the global
    # std of the plan returns {2, 5} is 1.5. Executor: plan means 1 and 3 -> centred -1, 1, -2, 2; the
    # global std of {0, 2, 1, 5} (mean 2, squared deviations 4, 0, 1, 9) is sqrt(14 / 4) = sqrt(3.5).
    plan_r = torch.tensor([[[1.0, 3.0], [4.0, 6.0]]], dtype=F64)
    exec_r = torch.tensor([[[0.0, 2.0], [1.0, 5.0]]], dtype=F64)
    out = hierarchical_advantages(plan_r, exec_r, eps_plan=1e-4, eps_exec=1e-6, **NO_CLIP)
    assert isinstance(out, HierarchicalAdvantages)
    assert out.plan.dtype == F64 and out.exec.dtype == F64 and out.plan_return.dtype == F64
    assert out.plan.shape == (1, 2) and out.exec.shape == (1, 2, 2) and out.plan_return.shape == (1, 2)
    torch.testing.assert_close(out.plan_return, torch.tensor([[2.0, 5.0]], dtype=F64), rtol=0, atol=1e-15)
    a = 1.5 / (1.5 + 1e-4)
    torch.testing.assert_close(out.plan, torch.tensor([[-a, a]], dtype=F64), rtol=0, atol=1e-14)
    s = math.sqrt(3.5) + 1e-6
    expected = torch.tensor([[[-1 / s, 1 / s], [-2 / s, 2 / s]]], dtype=F64)
    torch.testing.assert_close(out.exec, expected, rtol=0, atol=1e-14)
    assert out.zero_std_plan_frac == 0.0 and out.zero_std_exec_frac == 0.0


def test_hand_example_default_clip_binds() -> None:
    # the same example without std division ("none"): A_plan = +-1.5 is clipped to the default +-1;
    # A_exec = -1, 1, -2, 2 lies within the default +-2; with rewards x3 it is -3, 3, -6, 6 -> +-2.
    plan_r = torch.tensor([[[1.0, 3.0], [4.0, 6.0]]], dtype=F64)
    exec_r = torch.tensor([[[0.0, 2.0], [1.0, 5.0]]], dtype=F64)
    out = hierarchical_advantages(plan_r, exec_r, std_plan="none", std_exec="none")
    torch.testing.assert_close(out.plan, torch.tensor([[-1.0, 1.0]], dtype=F64), rtol=0, atol=0)
    torch.testing.assert_close(out.exec, torch.tensor([[[-1.0, 1.0], [-2.0, 2.0]]], dtype=F64), rtol=0, atol=0)
    out = hierarchical_advantages(plan_r, exec_r * 3, std_plan="none", std_exec="none")
    torch.testing.assert_close(out.exec, torch.tensor([[[-2.0, 2.0], [-2.0, 2.0]]], dtype=F64), rtol=0, atol=0)


def test_hand_example_group_std() -> None:
    # group std: plan std within the prompt = 1.5 (same as global, one prompt); executor: plan 0 values
    # {0, 2} std 1, plan 1 values {1, 5} std 2 -> -1/(1+e), 1/(1+e), -2/(2+e), 2/(2+e).
    plan_r = torch.tensor([[2.0, 5.0]], dtype=F64)  # [P, K] returns used directly
    exec_r = torch.tensor([[[0.0, 2.0], [1.0, 5.0]]], dtype=F64)
    e = 1e-6
    out = hierarchical_advantages(plan_r, exec_r, std_plan="group", std_exec="group", eps_exec=e, **NO_CLIP)
    a = 1.5 / (1.5 + 1e-4)
    torch.testing.assert_close(out.plan, torch.tensor([[-a, a]], dtype=F64), rtol=0, atol=1e-14)
    expected = torch.tensor([[[-1 / (1 + e), 1 / (1 + e)], [-2 / (2 + e), 2 / (2 + e)]]], dtype=F64)
    torch.testing.assert_close(out.exec, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(out.plan_return, plan_r, rtol=0, atol=0)


def test_global_std_spans_prompts() -> None:
    # two prompts, plan returns (0, 2) and (0, 4): centred -1, 1 and -2, 2. The global std is over all four
    # returns {0, 2, 0, 4}: mean 1.5, squared deviations 2.25, 0.25, 2.25, 6.25 -> variance 11 / 4 = 2.75.
    # The group stds are 1 and 2, so "group" gives -1, 1 for both prompts.
    plan_r = torch.tensor([[0.0, 2.0], [0.0, 4.0]], dtype=F64)
    exec_r = torch.zeros(2, 2, 3, dtype=F64)
    out = hierarchical_advantages(plan_r, exec_r, eps_plan=0.0, **NO_CLIP)
    s = math.sqrt(2.75)
    torch.testing.assert_close(out.plan, torch.tensor([[-1 / s, 1 / s], [-2 / s, 2 / s]], dtype=F64))
    out = hierarchical_advantages(plan_r, exec_r, std_plan="group", eps_plan=0.0, **NO_CLIP)
    torch.testing.assert_close(out.plan, torch.tensor([[-1.0, 1.0], [-1.0, 1.0]], dtype=F64))


# ---------------------------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("std", MODES)
def test_advantages_sum_to_zero_per_group(std: str) -> None:
    plan_r, exec_r = _rand(3, 4, 5, seed=1), _rand(3, 4, 5, seed=2)
    out = hierarchical_advantages(plan_r, exec_r, std_plan=std, std_exec=std, **NO_CLIP)
    torch.testing.assert_close(out.plan.sum(dim=1), torch.zeros(3, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.exec.sum(dim=2), torch.zeros(3, 4, dtype=F64), rtol=0, atol=1e-12)
    assert out.plan.abs().min() > 0 and out.exec.abs().min() > 0


@pytest.mark.parametrize("std", MODES)
def test_single_plan_gives_zero_plan_advantage_and_grpo_exec(std: str) -> None:
    plan_r, exec_r = _rand(3, 1, 6, seed=3), _rand(3, 1, 6, seed=4)
    out = hierarchical_advantages(plan_r, exec_r, std_plan=std, std_exec=std, eps_exec=1e-3, **NO_CLIP)
    assert torch.equal(out.plan, torch.zeros(3, 1, dtype=F64))
    assert out.zero_std_plan_frac == 1.0
    ref = group_advantages(exec_r.reshape(-1), torch.arange(3).repeat_interleave(6), std=std, eps=1e-3)
    torch.testing.assert_close(out.exec.reshape(-1), ref, rtol=0, atol=1e-14)
    clipped = hierarchical_advantages(plan_r, exec_r * 10, std_plan=std, std_exec=std, clip_exec=0.5)
    ref = group_advantages((exec_r * 10).reshape(-1), torch.arange(3).repeat_interleave(6), std=std, eps=1e-6)
    torch.testing.assert_close(clipped.exec.reshape(-1), ref.clamp(-0.5, 0.5), rtol=0, atol=1e-14)


@pytest.mark.parametrize("std", MODES)
def test_single_continuation_gives_zero_exec_advantage(std: str) -> None:
    plan_r, exec_r = _rand(2, 3, 1, seed=5), _rand(2, 3, 1, seed=6)
    out = hierarchical_advantages(plan_r, exec_r, std_plan=std, std_exec=std)
    assert torch.equal(out.exec, torch.zeros(2, 3, 1, dtype=F64))
    assert out.zero_std_exec_frac == 1.0
    assert out.plan.abs().min() > 0
    torch.testing.assert_close(out.plan_return, plan_r[..., 0], rtol=0, atol=0)


@pytest.mark.parametrize("std", ("group", "none"))
def test_exec_invariant_to_per_plan_constant(std: str) -> None:
    plan_r, exec_r = _rand(2, 3, 4, seed=7), _rand(2, 3, 4, seed=8)
    shift = _rand(2, 3, 1, seed=9) * 5
    a = hierarchical_advantages(plan_r, exec_r, std_exec=std).exec
    b = hierarchical_advantages(plan_r, exec_r + shift, std_exec=std).exec
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_exec_global_std_under_per_plan_constant() -> None:
    # the global std is over the raw rewards (TempAct / Flow-GRPO): a common constant changes nothing;
    # per-plan constants keep every centred reward and only rescale all advantages by one positive factor
    plan_r, exec_r = _rand(2, 3, 4, seed=7), _rand(2, 3, 4, seed=8)
    a = hierarchical_advantages(plan_r, exec_r, **NO_CLIP).exec
    torch.testing.assert_close(hierarchical_advantages(plan_r, exec_r + 3.0, **NO_CLIP).exec, a, rtol=0, atol=1e-12)
    b = hierarchical_advantages(plan_r, exec_r + _rand(2, 3, 1, seed=9) * 5, **NO_CLIP).exec
    ratio = b / a
    assert float(ratio.min()) > 0
    torch.testing.assert_close(ratio, torch.full_like(ratio, float(ratio[0, 0, 0])), rtol=0, atol=1e-12)


@pytest.mark.parametrize("std", MODES)
def test_plan_invariant_to_permuting_continuations(std: str) -> None:
    plan_r, exec_r = _rand(2, 3, 5, seed=10), _rand(2, 3, 5, seed=11)
    valid = torch.ones(2, 3, 5, dtype=torch.bool)
    valid[0, 1, 2] = False
    perm = torch.randperm(5, generator=torch.Generator().manual_seed(0))
    a = hierarchical_advantages(plan_r, exec_r, std_plan=std, exec_valid=valid)
    b = hierarchical_advantages(plan_r[..., perm], exec_r[..., perm], std_plan=std, exec_valid=valid[..., perm])
    torch.testing.assert_close(a.plan, b.plan, rtol=0, atol=1e-14)
    torch.testing.assert_close(a.plan_return, b.plan_return, rtol=0, atol=1e-14)
    torch.testing.assert_close(a.exec[..., perm], b.exec, rtol=0, atol=1e-14)


def test_clip_bounds_hold_and_bind() -> None:
    plan_r, exec_r = _rand(4, 6, 8, seed=12) ** 3, _rand(4, 6, 8, seed=13) ** 3
    out = hierarchical_advantages(plan_r, exec_r, clip_plan=0.3, clip_exec=0.7, std_plan="none", std_exec="none")
    assert float(out.plan.abs().max()) == pytest.approx(0.3, abs=0)
    assert float(out.exec.abs().max()) == pytest.approx(0.7, abs=0)
    zero = hierarchical_advantages(plan_r, exec_r, clip_plan=0.0, clip_exec=0.0)
    assert torch.equal(zero.plan, torch.zeros_like(zero.plan)) and torch.equal(zero.exec, torch.zeros_like(zero.exec))


@pytest.mark.parametrize("std", MODES)
def test_zero_std_groups_give_exact_zero(std: str) -> None:
    plan_r = torch.tensor([[[1.0, 1.0], [1.0, 1.0]], [[0.0, 1.0], [2.0, 5.0]]], dtype=F64)
    exec_r = torch.tensor([[[3.0, 3.0], [0.0, 1.0]], [[2.0, 2.0], [7.0, 7.0]]], dtype=F64)
    out = hierarchical_advantages(plan_r, exec_r, std_plan=std, std_exec=std, eps_plan=0.0, eps_exec=0.0)
    assert torch.isfinite(out.plan).all() and torch.isfinite(out.exec).all()
    assert torch.equal(out.plan[0], torch.zeros(2, dtype=F64)) and out.plan[1].abs().min() > 0
    assert torch.equal(out.exec[0, 0], torch.zeros(2, dtype=F64))
    assert torch.equal(out.exec[1], torch.zeros(2, 2, dtype=F64))
    assert out.exec[0, 1].abs().min() > 0
    assert out.zero_std_plan_frac == 0.5 and out.zero_std_exec_frac == 0.75
    # everything constant: all zero, no NaN, even with eps = 0 and the global std 0
    const = hierarchical_advantages(torch.ones(2, 2, 3), torch.ones(2, 2, 3), eps_plan=0.0, eps_exec=0.0)
    assert torch.equal(const.plan, torch.zeros(2, 2)) and torch.equal(const.exec, torch.zeros(2, 2, 3))


@pytest.mark.parametrize("std", MODES)
def test_invalid_entries_zero_and_excluded(std: str) -> None:
    plan_r, exec_r = _rand(2, 3, 4, seed=14), _rand(2, 3, 4, seed=15)
    valid = torch.ones(2, 3, 4, dtype=torch.bool)
    valid[0, 0, 1] = valid[1, 2, 3] = False
    pr, er = plan_r.clone(), exec_r.clone()
    pr[~valid] = math.nan
    er[~valid] = math.nan
    out = hierarchical_advantages(pr, er, std_plan=std, std_exec=std, exec_valid=valid)
    assert torch.isfinite(out.exec).all() and torch.isfinite(out.plan).all()
    assert torch.equal(out.exec[~valid], torch.zeros(2, dtype=F64))
    # statistics ignore the invalid entries: any finite value there gives the same result
    pr2, er2 = pr.clone(), er.clone()
    pr2[~valid], er2[~valid] = 1e6, -1e6
    again = hierarchical_advantages(pr2, er2, std_plan=std, std_exec=std, exec_valid=valid)
    torch.testing.assert_close(again.exec, out.exec, rtol=0, atol=0)
    torch.testing.assert_close(again.plan, out.plan, rtol=0, atol=0)
    # the plan return is the mean over valid continuations only
    torch.testing.assert_close(out.plan_return[0, 0], plan_r[0, 0, [0, 2, 3]].mean(), rtol=0, atol=1e-15)
    # the executor group with one invalid entry is standardised over its remaining three
    if std == "none":
        torch.testing.assert_close(out.exec[0, 0, [0, 2, 3]], exec_r[0, 0, [0, 2, 3]] - exec_r[0, 0, [0, 2, 3]].mean())
    # plan_valid separately from exec_valid (3-d plan rewards)
    pv = torch.ones(2, 3, 4, dtype=torch.bool)
    pv[1, 1, 0] = False
    sep = hierarchical_advantages(plan_r, er, std_plan=std, std_exec=std, exec_valid=valid, plan_valid=pv)
    torch.testing.assert_close(sep.plan_return[1, 1], plan_r[1, 1, 1:].mean(), rtol=0, atol=1e-15)
    torch.testing.assert_close(sep.plan_return[0, 0], plan_r[0, 0].mean(), rtol=0, atol=1e-15)


@pytest.mark.parametrize("std", MODES)
def test_plan_with_no_valid_continuation(std: str) -> None:
    plan_r, exec_r = _rand(1, 3, 2, seed=16), _rand(1, 3, 2, seed=17)
    valid = torch.ones(1, 3, 2, dtype=torch.bool)
    valid[0, 2] = False
    pr, er = plan_r.clone(), exec_r.clone()
    pr[0, 2] = math.nan
    er[0, 2] = math.nan
    out = hierarchical_advantages(pr, er, std_plan=std, std_exec=std, exec_valid=valid, **NO_CLIP)
    assert out.plan[0, 2] == 0 and torch.isnan(out.plan_return[0, 2])
    assert torch.equal(out.exec[0, 2], torch.zeros(2, dtype=F64))
    # the remaining two plans are standardised between themselves
    torch.testing.assert_close(out.plan[0, 0] + out.plan[0, 1], torch.zeros((), dtype=F64), rtol=0, atol=1e-14)
    two = hierarchical_advantages(plan_r[:, :2], exec_r[:, :2], std_plan=std, std_exec=std, **NO_CLIP)
    torch.testing.assert_close(out.plan[:, :2], two.plan, rtol=0, atol=1e-14)
    # [P, K] plan rewards with plan_valid
    pv = torch.tensor([[True, True, False]])
    direct = hierarchical_advantages(
        torch.tensor([[1.0, 2.0, math.nan]], dtype=F64), exec_r, plan_valid=pv, std_plan=std, **NO_CLIP
    )
    assert direct.plan[0, 2] == 0 and direct.plan[0, 0] < 0 < direct.plan[0, 1]
    assert torch.isnan(direct.plan_return[0, 2]) and direct.plan_return[0, 1] == 2.0
    finite = hierarchical_advantages(
        torch.tensor([[1.0, 2.0, 7.0]], dtype=F64), exec_r, plan_valid=pv, std_plan=std, **NO_CLIP
    )
    assert torch.isnan(finite.plan_return[0, 2])  # an invalid plan's return is reported as NaN
    torch.testing.assert_close(finite.plan, direct.plan, rtol=0, atol=0)


def test_several_prompts_match_one_at_a_time_in_group_mode() -> None:
    plan_r, exec_r = _rand(3, 4, 5, seed=18), _rand(3, 4, 5, seed=19)
    out = hierarchical_advantages(plan_r, exec_r, std_plan="group", std_exec="group")
    for p in range(3):
        one = hierarchical_advantages(plan_r[p : p + 1], exec_r[p : p + 1], std_plan="group", std_exec="group")
        torch.testing.assert_close(out.plan[p : p + 1], one.plan, rtol=0, atol=1e-14)
        torch.testing.assert_close(out.exec[p : p + 1], one.exec, rtol=0, atol=1e-14)
    # global mode: prompts interact only through the shared std
    g = hierarchical_advantages(plan_r, exec_r, std_plan="none", std_exec="none", **NO_CLIP)
    glob = hierarchical_advantages(plan_r, exec_r, eps_plan=0.0, eps_exec=0.0, **NO_CLIP)
    ret = plan_r.mean(dim=2)
    torch.testing.assert_close(glob.plan, g.plan / ret.std(correction=0), rtol=0, atol=1e-12)
    torch.testing.assert_close(glob.exec, g.exec / exec_r.std(correction=0), rtol=0, atol=1e-12)


def test_dtypes() -> None:
    plan_r, exec_r = _rand(2, 2, 3, seed=20), _rand(2, 2, 3, seed=21)
    out = hierarchical_advantages(plan_r.float(), exec_r.float())
    assert out.plan.dtype == out.exec.dtype == out.plan_return.dtype == torch.float32
    ref = hierarchical_advantages(plan_r, exec_r)
    torch.testing.assert_close(out.exec, ref.exec.float())
    assert hierarchical_advantages(plan_r.float(), exec_r).plan.dtype == F64
    assert hierarchical_advantages(plan_r.bfloat16(), exec_r.half()).exec.dtype == torch.float32
    assert isinstance(out.zero_std_plan_frac, float) and isinstance(out.zero_std_exec_frac, float)


def test_errors() -> None:
    pr, er = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match=r"exec_rewards must be \[P, K, G\]"):
        hierarchical_advantages(pr, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="plan_rewards must be"):
        hierarchical_advantages(torch.zeros(2, 4), er)
    with pytest.raises(ValueError, match="plan_rewards must be"):
        hierarchical_advantages(torch.zeros(2, 3, 5), er)
    with pytest.raises(ValueError, match="plan_rewards must be"):
        hierarchical_advantages(torch.zeros(2), er)
    with pytest.raises(ValueError, match="exec_valid of shape"):
        hierarchical_advantages(pr, er, exec_valid=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="plan_valid of shape"):
        hierarchical_advantages(torch.zeros(2, 3), er, plan_valid=torch.ones(2, 3, 4, dtype=torch.bool))
    bad = er.clone()
    bad[0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="exec_rewards: 1 reward"):
        hierarchical_advantages(pr, bad)
    with pytest.raises(ValueError, match="plan_rewards: 1 reward"):
        hierarchical_advantages(bad, er)
    with pytest.raises(ValueError, match="plan_rewards: 6 reward"):
        hierarchical_advantages(torch.full((2, 3), math.inf), er)
    for kw in ({"clip_plan": -1.0}, {"clip_exec": -0.1}, {"eps_plan": -1e-4}, {"eps_exec": math.nan}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be >= 0"):
            hierarchical_advantages(pr, er, **kw)
    for kw in ({"std_plan": "batch"}, {"std_exec": "prompt"}):
        with pytest.raises(ValueError, match=f"unknown {next(iter(kw))}"):
            hierarchical_advantages(pr, er, **kw)
