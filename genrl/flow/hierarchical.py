"""Two-level (planner / executor) group advantages of TempAct's planner-executor RL.

A batch holds P prompts; each prompt gets K plans (the planning group; a plan is e.g. a list of
per-segment step prompts written by a language-model planner); each plan gets G continuations
(the execution group), all forked from one shared state, so they differ only by the executor's
own sampling. Two rewards are scored per continuation: a planner-level reward (e.g. a video-level
temporal-order judge) and an executor-level reward (e.g. local step-following). Each level is
standardised against its own group, so the planner is credited for what differs between plans and
the executor for what differs between continuations of the same plan:

    A_plan[p, k]    = clip((R_plan[p, k] - mean_k' R_plan[p, k']) / (s_plan + eps_plan), +-c_plan)
    A_exec[p, k, g] = clip((R_exec[p, k, g] - mean_g' R_exec[p, k, g']) / (s_exec + eps_exec), +-c_exec)

Both are `genrl.flow.policy.group_advantages` (groups = prompts, resp. plans) with a clip on top.
Pure functions; cross-rank gathering is the caller's job (gather the full [P, K, G] batch first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from genrl.flow.broadcast import compute_dtype
from genrl.flow.policy import _ADV_STDS, AdvantageStd, group_advantages, group_stats

__all__ = ["HierarchicalAdvantages", "hierarchical_advantages"]


@dataclass
class HierarchicalAdvantages:
    """Planner and executor advantages of one [P, K, G] batch (`hierarchical_advantages`).

    Attributes:
        plan: [P, K] planner advantages, in [-clip_plan, clip_plan]; 0 for an invalid plan, a plan
            with no valid continuation, and every plan of a prompt whose valid plan returns are
            constant (e.g. K = 1).
        exec: [P, K, G] executor advantages, in [-clip_exec, clip_exec]; 0 for an invalid
            continuation and every continuation of a plan whose valid executor rewards are
            constant (e.g. G = 1).
        plan_return: [P, K] the planner reward R_plan each plan was scored with (the mean over its
            valid continuations for [P, K, G] planner rewards); NaN where the plan is invalid or
            has no valid continuation.
        zero_std_plan_frac: fraction of prompts (with at least one valid plan) whose valid plan
            returns have std < `ZERO_STD` (they train no planner step); NaN if no plan is valid.
        zero_std_exec_frac: the same over plans (execution groups), for the executor rewards.

    ``plan``, ``exec`` and ``plan_return`` are float32 (float64 if either reward tensor is float64),
    on the rewards' device.
    """

    plan: torch.Tensor
    exec: torch.Tensor
    plan_return: torch.Tensor
    zero_std_plan_frac: float
    zero_std_exec_frac: float


def _check_finite(r: torch.Tensor, valid: torch.Tensor, name: str) -> None:
    n_bad = int((valid & ~torch.isfinite(r)).sum())
    if n_bad:
        raise ValueError(
            f"{name}: {n_bad} reward(s) are NaN or infinite on entries marked valid; mark failed entries "
            "invalid (valid=False) so that they get advantage 0 and are excluded from the group statistics"
        )


def _mask(valid: torch.Tensor | None, shape: torch.Size, device: torch.device, name: str) -> torch.Tensor:
    if valid is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if valid.shape != shape:
        raise ValueError(f"{name} of shape {tuple(valid.shape)} must match its rewards' shape {tuple(shape)}")
    return valid.to(device=device, dtype=torch.bool)


def hierarchical_advantages(
    plan_rewards: torch.Tensor,
    exec_rewards: torch.Tensor,
    clip_plan: float = 1.0,
    clip_exec: float = 2.0,
    std_plan: AdvantageStd = "global",
    std_exec: AdvantageStd = "global",
    eps_plan: float = 1e-4,
    eps_exec: float = 1e-6,
    plan_valid: torch.Tensor | None = None,
    exec_valid: torch.Tensor | None = None,
) -> HierarchicalAdvantages:
    """TempAct's planner and executor advantages over P prompts x K plans x G continuations.

    Planner (planning group = the K plans of one prompt), with R_plan[p, k] the plan return:

        A_plan[p, k] = clip((R_plan[p, k] - mean_k' R_plan[p, k']) / (s_plan + eps_plan), -c_plan, c_plan)

    Executor (execution group = the G continuations of one plan, forked from the same state):

        A_exec[p, k, g] = clip((R_exec[p, k, g] - mean_g' R_exec[p, k, g']) / (s_exec + eps_exec), -c_exec, c_exec)

    Means run over the group's valid entries. The std s is, per level, the std (ddof 0) of all
    valid entries of that level in the batch ("global", TempAct's default: all valid plan returns
    for the planner, all valid continuations for the executor), the group's own std ("group"), or
    1 ("none"). As in `group_advantages`, which computes both levels, a group whose valid values
    have std < `ZERO_STD` (constant, or a single valid entry: K = 1 for the planner, G = 1 for the
    executor) gets advantage exactly 0 in every mode, and invalid entries get exactly 0 without
    shifting any statistic. Hence, without a binding clip, each level's advantages sum to 0 over
    every group; A_exec is unchanged by adding a per-plan constant to the executor rewards (only
    within-plan differences matter; the global std is over raw rewards, so it changes if the
    constants differ between plans); A_plan does not depend on the order of the continuations.
    Computed in float64.

    Args:
        plan_rewards: [P, K, G] planner-level reward per continuation (the plan return is the mean
            over the plan's valid continuations) or [P, K] one return per plan (used directly).
            NaN allowed on invalid entries.
        exec_rewards: [P, K, G] executor-level reward per continuation; NaN allowed on invalid entries.
        clip_plan: c_plan >= 0 (``math.inf`` disables the clip).
        clip_exec: c_exec >= 0 (``math.inf`` disables the clip).
        std_plan: "global", "group" or "none" for the planner.
        std_exec: "global", "group" or "none" for the executor.
        eps_plan: added to the planner std (>= 0).
        eps_exec: added to the executor std (>= 0).
        plan_valid: bool mask of ``plan_rewards``' shape. Default: ``exec_valid`` when
            ``plan_rewards`` is [P, K, G] (a failed continuation usually fails both judges), else
            all valid. A plan with no valid continuation (3-d case) is invalid.
        exec_valid: [P, K, G] bool mask of usable executor rewards (default: all valid).

    Returns:
        `HierarchicalAdvantages` (plan [P, K], exec [P, K, G], plan_return [P, K], and the two
        zero-std fractions as python floats); tensors float32 (float64 if either reward tensor is
        float64), on ``exec_rewards``' device.

    Raises:
        ValueError: ``exec_rewards`` not 3-d; ``plan_rewards`` neither [P, K, G] nor [P, K] with
            (P, K) of ``exec_rewards``; a mask of the wrong shape; a NaN / inf reward on a valid
            entry (the message names the tensor and the count); a negative (or NaN) clip or eps;
            an unknown std mode.

    Source: Wang et al. 2026, TempAct (arXiv 2606.28016), hierarchical group advantages of the
    planner and the executor (planner-executor GRPO; code jingw193/TempAct, built on Flow-GRPO);
    Shao et al. 2024, DeepSeekMath GRPO (group-relative advantages).
    """
    for name, mode in (("std_plan", std_plan), ("std_exec", std_exec)):
        if mode not in _ADV_STDS:
            raise ValueError(f"unknown {name} {mode!r}; expected one of {_ADV_STDS}")
    for name, val in (("clip_plan", clip_plan), ("clip_exec", clip_exec), ("eps_plan", eps_plan),
                      ("eps_exec", eps_exec)):
        if not float(val) >= 0:
            raise ValueError(f"{name} must be >= 0, got {val}")
    if exec_rewards.ndim != 3:
        raise ValueError(f"exec_rewards must be [P, K, G], got shape {tuple(exec_rewards.shape)}")
    p, k, g = exec_rewards.shape
    if plan_rewards.ndim not in (2, 3) or tuple(plan_rewards.shape[:2]) != (p, k) or (
        plan_rewards.ndim == 3 and plan_rewards.shape[2] != g
    ):
        raise ValueError(
            f"plan_rewards must be [P, K, G] = {[p, k, g]} or [P, K] = {[p, k]} to match exec_rewards, "
            f"got shape {tuple(plan_rewards.shape)}"
        )
    device = exec_rewards.device
    out_dt = compute_dtype(plan_rewards, exec_rewards)
    f64 = torch.float64

    # ---- executor: groups = plans (p, k), std over all valid continuations or within the plan
    ev = _mask(exec_valid, exec_rewards.shape, device, "exec_valid")
    er = exec_rewards.detach().to(device=device, dtype=f64)
    _check_finite(er, ev, "exec_rewards")
    exec_groups = torch.arange(p * k, device=device).repeat_interleave(g)
    a_exec = group_advantages(er.reshape(-1), exec_groups, std=std_exec, eps=eps_exec, valid=ev.reshape(-1))
    a_exec = a_exec.clamp(-clip_exec, clip_exec).reshape(p, k, g)
    exec_zero = float(group_stats(er.reshape(-1), exec_groups, ev.reshape(-1))["zero_std_fraction"])

    # ---- plan returns
    pr = plan_rewards.detach().to(device=device, dtype=f64)
    if plan_rewards.ndim == 3:
        pv3 = ev if plan_valid is None else _mask(plan_valid, plan_rewards.shape, device, "plan_valid")
        _check_finite(pr, pv3, "plan_rewards")
        w = pv3.to(f64)
        count = w.sum(dim=2)
        total = torch.where(pv3, pr, torch.zeros_like(pr)).sum(dim=2)
        pv = count > 0
        ret = torch.where(pv, total / count.clamp_min(1), torch.full_like(total, math.nan))
    else:
        pv = _mask(plan_valid, plan_rewards.shape, device, "plan_valid")
        _check_finite(pr, pv, "plan_rewards")
        ret = torch.where(pv, pr, torch.full_like(pr, math.nan))

    # ---- planner: groups = prompts, std over all valid plans or within the prompt
    plan_groups = torch.arange(p, device=device).repeat_interleave(k)
    a_plan = group_advantages(ret.reshape(-1), plan_groups, std=std_plan, eps=eps_plan, valid=pv.reshape(-1))
    a_plan = a_plan.clamp(-clip_plan, clip_plan).reshape(p, k)
    plan_zero = float(group_stats(ret.reshape(-1), plan_groups, pv.reshape(-1))["zero_std_fraction"])

    return HierarchicalAdvantages(
        plan=a_plan.to(out_dt),
        exec=a_exec.to(out_dt),
        plan_return=ret.to(out_dt),
        zero_std_plan_frac=plan_zero,
        zero_std_exec_frac=exec_zero,
    )
