"""The RL loop as plain, typed, composable phases (docs/new_method.md): collect -> score -> advantages -> update.

* **collect** (:func:`collect_flat`, :func:`collect_endpoints`, :func:`collect_tree`): rollouts through the shared
  sampler of :mod:`genrl.rollout` with the policy in eval mode and no gradient; each returns a :class:`Rollouts`.
* **score** (:func:`score`): the :class:`~genrl.methods.common.Scorer` on the decoded samples; totals, groups and
  validity gathered across ranks (groups may span ranks); reward metrics logged; an all-invalid batch is an error.
* **advantages** (:func:`group_advantages_of`): per-group (GRPO) or per-reward advantages of the gathered batch,
  this rank's slice; invalid samples get advantage 0 (never dropped).
* **update** (:func:`optimizer_steps`): a list of optimizer steps, each a list of loss units; every unit is one
  backward pass. The units depend only on the local batch size, never on the validity mask, so every rank runs the
  same backward passes and optimizer steps.

Methods are short compositions of these (GRPO, BranchGRPO, RAM, and the reward-weighted regression example,
genrl/methods/rwr.py); nothing here holds state.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule

from genrl.flow.fm_core import sample_mse
from genrl.flow.forward_rl import sample_timesteps
from genrl.flow.parameterization import add_noise
from genrl.flow.policy import group_advantages, group_stats
from genrl.flow.selection import best_worst_pairs
from genrl.methods.common import (
    Scorer,
    clip_and_step,
    gather_batch,
    gather_objects,
    log_validation_rewards,
    rank_slice,
    trainer_of,
    world_of,
)
from genrl.models.conditions import null_prompts
from genrl.noise import mix_seed, rand_per_sample, randn_per_sample, stream_id
from genrl.rollout.sampler import RolloutConfig, rollout
from genrl.rollout.tree import TreeConfig, tree_rollout

__all__ = ["Pairs", "Rollouts", "Scores", "best_worst_pairs_of", "caption_dropout", "collect_endpoints",
           "collect_flat", "collect_tree", "errors_at", "flat_validation", "flat_validation_step", "gathered_pass",
           "grid_sigmas", "group_advantages_of", "micro_batches", "optimizer_steps", "renoise", "reward_spread",
           "role_velocity", "score", "update_plan", "video_batch"]

logger = logging.getLogger(__name__)


@dataclass
class Rollouts:
    """Output of a collect phase.

    Attributes:
        prompts: the prompt of every scored sample (B; for a tree, one per leaf).
        pixels: decoded samples, float [B, T, C, H, W] in [0, 1] (what the rewards score).
        samples: what the update needs: a :class:`~genrl.rollout.sampler.Trajectory` (flat), clean endpoints x0
            [B, *latent] (endpoints) or a :class:`~genrl.rollout.tree.TreeRollout` (tree).
    """

    prompts: list[str]
    pixels: torch.Tensor
    samples: Any


def _eval_mode(generator):
    was = generator.training
    generator.eval()
    return was


def collect_flat(generator, prompts: list[str], latent_shape, seed: int, index: torch.Tensor, config: RolloutConfig,
                 iteration: int, keep_graph: bool = False, record_moments: bool = False,
                 group: torch.Tensor | None = None) -> Rollouts:
    """Flat rollouts (Flow-GRPO / DanceGRPO): one trajectory per prompt with the stochastic kernel of ``config``,
    per-step latents and log-probs recorded; decoded for scoring. Noise addressed by (seed, sample index, step) and
    the SDE window by (seed, iteration). ``keep_graph``: the stochastic steps' forwards keep their autograd graphs
    (``rollout(grad="sde")``, ``Trajectory.live``) for an on-policy update that reuses them; ``record_moments``: each
    step's transition mean and std are kept too (``Trajectory.step_moments``; one latent per step more); ``group``:
    the samples' group ids, which address the starting noise under ``config.initial_noise == "group"``."""
    was = _eval_mode(generator)
    traj = rollout(generator, prompts, latent_shape, seed, index, config, rollout_id=iteration,
                   grad="sde" if keep_graph else "none", record_moments=record_moments, initial_keys=group)
    pixels = generator.decode(traj.final)
    generator.train(was)
    return Rollouts(list(prompts), pixels, traj)


def collect_endpoints(generator, prompts: list[str], latent_shape, seed: int, index: torch.Tensor,
                      config: RolloutConfig, iteration: int, policy: Callable[[], Any] | None = None) -> Rollouts:
    """Clean endpoints x0 only (forward-process RL: RAM, DiffusionNFT, AWM), with the deterministic sampler of
    ``config`` and no trajectory kept. ``policy`` is a context factory selecting the weights that roll out (e.g.
    ``lambda: roles.swap(generator, "old_policy")``); None: the live policy."""
    was = _eval_mode(generator)
    with torch.no_grad():
        if policy is None:
            x0 = rollout(generator, prompts, latent_shape, seed, index, config, rollout_id=iteration,
                         record=False).final
        else:
            with policy():
                x0 = rollout(generator, prompts, latent_shape, seed, index, config, rollout_id=iteration,
                             record=False).final
    pixels = generator.decode(x0)
    generator.train(was)
    return Rollouts(list(prompts), pixels, x0)


def collect_tree(generator, prompts: list[str], latent_shape, seed: int, index: torch.Tensor, config: RolloutConfig,
                 tree: TreeConfig, reward_on: Literal["x0", "final"] = "x0") -> Rollouts:
    """One tree per prompt (BranchGRPO) from the sampler's tree mode; the leaves (their last-step x0 prediction, or
    the final latents) are decoded for scoring, one prompt per leaf."""
    was = _eval_mode(generator)
    ro = tree_rollout(generator, prompts, latent_shape, seed, index, config, tree)
    leaves = ro.x0 if reward_on == "x0" else ro.leaves
    leaf_prompts = [prompts[int(t)] for t in ro.tree[-1]]
    with torch.no_grad():
        pixels = generator.decode(leaves.to(generator.device))
    generator.train(was)
    return Rollouts(leaf_prompts, pixels, ro)


@dataclass
class Scores:
    """Output of the score phase.

    Attributes:
        result: this rank's :class:`~genrl.rewards.RewardResult` (B local samples).
        total / valid / group: the gathered global batch (world * B), rank order; ``group`` None when not given.
        local: B, this rank's number of samples.
    """

    result: Any
    total: torch.Tensor
    valid: torch.Tensor
    group: torch.Tensor | None
    local: int
    stats: dict[str, float] = field(default_factory=dict)


def score(module: LightningModule, scorer: Scorer, rollouts: Rollouts, group: torch.Tensor | None = None,
          iteration: int = 0, prefix: str = "reward", meta: dict | None = None) -> Scores:
    """Score ``rollouts`` and log ``<prefix>/<reward>/<key>``, ``<prefix>/total`` (mean over the valid samples of the
    gathered batch), ``<prefix>/invalid_fraction`` and, with groups, ``advantage/<group statistic>``. ``meta``: per-
    sample reward inputs beside the prompts (:meth:`Scorer.forward`); ``prefix`` names a second scorer's logs. With a
    groupwise reward (e.g. ``pairwise``, Pref-GRPO) the group ids go to the scorer as ``meta["group"]``, after a check
    that every group lies whole on one rank (a pointwise-only scorer is called exactly as before).

    Raises:
        RuntimeError: every reward of the gathered batch is invalid (NaN): the reward model is failing.
        ValueError: a groupwise reward without ``group``, or with a group spread over ranks (names the group and the
            fix: a per-rank batch that is a multiple of ``group_size``).
    """
    bs = len(rollouts.prompts)
    all_group = None
    if getattr(getattr(scorer, "manager", None), "groupwise", False):
        from genrl.rewards.pairwise import check_complete_groups

        if group is None:
            raise ValueError("a groupwise reward (e.g. pairwise) compares the samples of a group: score() needs the "
                             "batch's group ids (batch['group'])")
        all_group = gather_batch(module, group)
        check_complete_groups(all_group, bs)
        meta = {**(meta or {}), "group": group}
    result = scorer(rollouts.pixels, rollouts.prompts, **(meta or {}))
    for key, value in result.metrics().items():
        if key not in ("total", "invalid_fraction"):
            module.log(f"{prefix}/{key}", float(value), batch_size=bs)
    total, valid = gather_batch(module, result.total), gather_batch(module, result.valid)
    if all_group is None and group is not None:
        all_group = gather_batch(module, group)
    if all_group is not None:
        for key, value in group_stats(total, all_group, valid=valid).items():
            module.log(f"advantage/{key}", float(value), batch_size=bs)
    module.log(f"{prefix}/total", float(total[valid].mean()) if valid.any() else math.nan, prog_bar=True,
               batch_size=bs)
    module.log(f"{prefix}/invalid_fraction", float((~valid).float().mean()), batch_size=bs)
    if not valid.any():
        raise RuntimeError(
            f"iteration {iteration}: every reward of the batch is invalid (NaN); the reward model is failing (see the "
            f"reward/*/errors and nan_rewards metrics and the logged warnings); fix it or drop it from "
            f"model.init_args.rewards"
        )
    return Scores(result, total, valid, all_group, bs)


def group_advantages_of(module: LightningModule, scores: Scores, std: Literal["group", "global", "none"] = "group",
                        eps: float = 1e-4, per_reward: bool = False, min_group_size: int = 1,
                        iteration: int = 0) -> torch.Tensor:
    """Advantages of this rank's samples, float32 [B]: (r - group mean) / (std + eps) over the gathered batch
    (GRPO, Shao et al. 2024; :func:`genrl.flow.policy.group_advantages`), or per reward and summed (``per_reward``,
    :meth:`genrl.rewards.RewardManager.per_reward_advantages`); invalid samples get exactly 0.

    Raises:
        ValueError: a group smaller than ``min_group_size`` (names ``data.init_args.group_size``).
    """
    if scores.group is None:
        raise ValueError("group advantages need the samples' group ids (batch['group'])")
    _, counts = torch.unique(scores.group, return_counts=True)
    if bool((counts < min_group_size).any()):
        raise ValueError(f"iteration {iteration}: a group of size {int(counts.min())}: a per-prompt advantage needs at "
                         f"least {min_group_size} rollouts of the prompt (the group mean is the baseline); set "
                         f"data.init_args.group_size >= {min_group_size} (reference: 8-24)")
    if per_reward:
        gathered = scores.result.map_tensors(lambda t: gather_batch(module, t))
        adv_all = module.scorer.manager.per_reward_advantages(gathered, scores.group, std=std, eps=eps)
    else:
        adv_all = group_advantages(scores.total, scores.group, std=std, eps=eps, valid=scores.valid)
    return rank_slice(module, adv_all, scores.local)


@dataclass
class Pairs:
    """Output of :func:`best_worst_pairs_of`: this rank's share of the global batch's (chosen, rejected) pairs.

    Attributes:
        chosen / rejected: clean endpoints [p, *latent] of the higher / lower rewarded member (on the CPU).
        prompts: the pairs' prompt (p).
        keys: int64 [p], the pair's group id: the address of the noise both members share.
        weight: float32 [p], 1 for a real pair, 0 for a padding slot (a copy of a real pair, so every rank runs the
            same backward passes; its loss is multiplied by 0).
        margin: float32 [p], reward(chosen) - reward(rejected) (0 on padding).
        count: real pairs in the global batch (the loss is a mean over them).
    """

    chosen: torch.Tensor
    rejected: torch.Tensor
    prompts: list[str]
    keys: torch.Tensor
    weight: torch.Tensor
    margin: torch.Tensor
    count: int


def best_worst_pairs_of(module: LightningModule, scores: Scores, x0: torch.Tensor, prompts: list[str],
                        tie: Literal["skip", "arbitrary"] = "skip") -> Pairs:
    """The pair phase of online preference methods (online Diffusion-DPO): one (best, worst) pair per group of the
    gathered batch (:func:`genrl.flow.selection.best_worst_pairs`: failed rewards never paired, the stated tie rule,
    ``tie="skip"`` drops all-equal groups), dealt round-robin to the ranks (pair j to rank j mod W). Groups may span
    ranks: the endpoints and prompts are gathered first. Every rank gets ceil(P / W) slots (padding with weight 0),
    so all ranks run the same backward passes. Logs ``pairs/count`` (real pairs per global batch), ``pairs/tied``
    (groups dropped as all-equal or with < 2 valid rewards) and ``pairs/reward_margin``.

    Args:
        scores: the score phase's output (its gathered totals, validity and groups).
        x0: this rank's clean endpoints [B, *latent]; prompts: their prompts (B).
    Returns:
        :class:`Pairs` (``count`` 0 and no slot when no group gives a pair).
    """
    if scores.group is None:
        raise ValueError("pairs need the samples' group ids (batch['group'])")
    rank, world = world_of(module)
    chosen, rejected = best_worst_pairs(scores.total, scores.group, scores.valid, tie=tie)
    count, groups = len(chosen), len(torch.unique(scores.group))
    bs = len(prompts)
    module.log("pairs/count", float(count), batch_size=bs)
    module.log("pairs/tied", float(groups - count), batch_size=bs)
    margin = (scores.total[chosen] - scores.total[rejected]).float()
    module.log("pairs/reward_margin", float(margin.mean()) if count else 0.0, batch_size=bs)
    if count == 0:
        empty = x0[:0].cpu()
        return Pairs(empty, empty, [], torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0), 0)
    all_x0, all_prompts = gather_batch(module, x0.detach()).cpu(), gather_objects(module, list(prompts))
    slots = torch.arange(rank, -(-count // world) * world, world)
    weight = (slots < count).float()
    slots = torch.where(slots < count, slots, torch.zeros_like(slots))
    c, r = chosen[slots], rejected[slots]
    return Pairs(all_x0[c], all_x0[r], [all_prompts[int(i)] for i in c], scores.group[c].long(), weight,
                 margin[slots] * weight, count)


@torch.no_grad()
def flat_validation(module: LightningModule, scorer: Scorer, batch: dict, config: RolloutConfig,
                    latent_shape, seed: int) -> dict:
    """A validation step of a flat-rollout method: deterministic samples of ``module.generator`` with ``config``
    (normally the ODE) at the batch's noise addresses, scored and logged (``val/*``); returns ``{"videos",
    "prompts"}`` for the VideoLogger."""
    prompts = list(batch["prompts"])
    traj = rollout(module.generator, prompts, latent_shape, seed, batch["index"].cpu(), config, record=False)
    return log_validation_rewards(module, scorer, module.generator.decode(traj.final), prompts)


def flat_validation_step(module: LightningModule, batch: dict, batch_idx: int) -> dict:
    """``validation_step`` of a flat-rollout method (assign it in the class body: ``validation_step =
    flat_validation_step``): :func:`flat_validation` with ``module.scorer``, ``module.eval_config``,
    ``module.latent_shape`` and ``module.hparams.seed``."""
    return flat_validation(module, module.scorer, batch, module.eval_config, module.latent_shape, module.hparams.seed)


def reward_spread(module: LightningModule, scores: Scores, advantages: torch.Tensor, iteration: int) -> float:
    """Log ``advantage/std`` (of the gathered advantages [world * B] over the valid samples) and ``reward/batch_std``
    (of the gathered valid rewards); warn when every valid rollout scored the same (no advantage, no update: a
    collapsed policy or a saturated reward). Returns the reward std (0.0 with fewer than two valid samples)."""
    valid, bs = scores.valid, scores.local
    module.log("advantage/std", float(advantages[valid].std()) if int(valid.sum()) > 1 else 0.0, batch_size=bs)
    rstd = float(scores.total[valid].std()) if int(valid.sum()) > 1 else 0.0
    module.log("reward/batch_std", rstd, batch_size=bs)
    if rstd < 1e-6:
        logger.warning("iteration %d: every valid rollout scores the same (reward std %.2g): no advantage, no "
                       "update; a collapsed policy or a saturated reward", iteration, rstd)
    return rstd


def micro_batches(n: int, size: int) -> list[torch.Tensor]:
    """The consecutive row chunks of ``n`` rows, ``size`` each (the last one shorter): int64 index tensors, none when
    ``n`` is 0. The micro-batches of one optimizer step, or (:func:`update_plan`) the mini-batches of one pass."""
    return [torch.arange(s, min(s + size, n)) for s in range(0, n, size)]


def update_plan(seed: int, iteration: int, n: int, mini_batch: int, inner_epochs: int = 1,
                stream: int = stream_id("phases.update_order")) -> list[torch.Tensor]:
    """The rows of every optimizer step of a PPO-style update (Schulman et al. 2017, "epochs" of mini-batches over one
    rollout batch): ``inner_epochs`` passes over the ``n`` local rows, each cut into consecutive mini-batches of
    ``mini_batch`` rows (the last one shorter when ``mini_batch`` does not divide ``n``). With one pass the rows keep
    their order; with several, each pass is a fresh permutation addressed by (seed, iteration, pass, ``stream``), so a
    resumed run repeats an uninterrupted one.

    Returns:
        a list of int64 [<= mini_batch] row-index tensors, one per optimizer step
        (``inner_epochs * ceil(n / mini_batch)`` of them).
    Raises:
        ValueError: ``n``, ``mini_batch`` or ``inner_epochs`` < 1.
    """
    if n < 1 or mini_batch < 1 or inner_epochs < 1:
        raise ValueError(f"an update plan needs n >= 1 rows, mini_batch >= 1 and inner_epochs >= 1; got n={n}, "
                         f"mini_batch={mini_batch}, inner_epochs={inner_epochs}")
    plan = []
    for epoch in range(inner_epochs):
        if inner_epochs > 1:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(mix_seed(seed, iteration, epoch, stream)))
        else:
            order = torch.arange(n)
        plan += [order[rows] for rows in micro_batches(n, mini_batch)]
    return plan


def renoise(x0: torch.Tensor, keys: torch.Tensor, seed: int, iteration: int, draw: int, t_stream: int,
            eps_stream: int, frame_dim: int = 1, t: torch.Tensor | None = None,
            **timestep_args: Any) -> tuple[torch.Tensor, ...]:
    """Draw ``draw`` of the forward process on clean endpoints (the regression step of forward-process RL and of the
    DSM-error preference objectives: RAM, DPO, DGPO, CRD): t ~ p(t) (:func:`genrl.flow.forward_rl.sample_timesteps`,
    ``timestep_args`` its density options), eps ~ N(0, I), x_t = (1 - t) x0 + t eps and the velocity target
    u = eps - x0. Both draws are addressed by (seed, iteration, stream, key, draw): rows with the same key get the
    same t and eps, so passing group or pair ids as ``keys`` shares the noise within a group (DGPO) or a pair (DPO),
    and passing sample indices gives every sample its own (RAM).

    Args:
        x0: clean endpoints [B, *latent] (any float dtype; t and eps come out on its device).
        keys: int64 [B] noise addresses.
        t_stream / eps_stream: the method's stream numbers for t and eps (distinct per method and per use).
        t: given noise levels float [B] (e.g. a rollout grid value shared by the batch, DGPO) instead of a draw.
    Returns:
        ``(t float32 [B], eps [B, *latent], x_t [B, *latent], u [B, *latent])``.
    """
    if t is None:
        t = sample_timesteps(len(keys), mix_seed(seed, iteration, t_stream), keys, step=draw, **timestep_args)
    t = t.to(x0.device)
    eps = randn_per_sample(x0.shape[1:], mix_seed(seed, iteration, eps_stream), keys, step=draw, device=x0.device)
    return t, eps, add_noise(x0, eps, t, frame_dim=frame_dim), eps - x0


def role_velocity(module: LightningModule, x: torch.Tensor, t: torch.Tensor, cond, role: str = "theta",
                  snapshot: str | None = None) -> torch.Tensor:
    """The conditional velocity (no CFG) of ``module.generator`` as one of its policy snapshots, float32 [B, *latent]:
    ``"theta"`` the live weights (with graph); ``"reference"`` the frozen reference (adapter disabled under LoRA, else
    the declared copy; :meth:`genrl.models.roles.Roles.reference`), without graph; any other value the lagged or
    frozen role ``snapshot or role`` swapped in (e.g. ``"old_policy"``, RAM / DGPO's fast EMA), without graph.

    Raises:
        KeyError: the role is not declared (the message lists the declared ones).
    """
    gen = module.generator
    if role == "theta":
        return gen.velocity(x, t, cond).float()
    with torch.no_grad():
        if role == "reference":
            with module.roles.reference(gen):
                return gen.velocity(x, t, cond).float()
        with module.roles.swap(gen, snapshot or role):
            return gen.velocity(x, t, cond).float()


def grid_sigmas(config: RolloutConfig, grid: int, count: int, seed: int, iteration: int,
                stream: int) -> torch.Tensor:
    """The noise levels an iteration trains on, taken from the rollout's own grid (DGPO, CRD): ``count`` of the first
    ``grid`` sigmas of ``config`` (its starting levels, from the highest down; the final 0 is never one), drawn as
    consecutive random permutations of those values: without replacement while ``count <= grid``; beyond it every
    value appears ``count // grid`` times or once more (CRD's 20 training timesteps on a 10-step grid). Addressed by
    (seed, iteration, stream): the same on every rank and after a resume.

    Returns:
        float32 [count], shared by every sample of the iteration.
    Raises:
        ValueError: ``grid`` not in [1, config.num_steps] or ``count`` < 1.
    """
    if not 1 <= grid <= config.num_steps or count < 1:
        raise ValueError(f"grid sigmas: need 1 <= grid <= num_steps = {config.num_steps} and count >= 1, got grid="
                         f"{grid}, count={count}")
    g = torch.Generator().manual_seed(mix_seed(seed, iteration, stream))
    picked = torch.cat([torch.randperm(grid, generator=g) for _ in range(-(-count // grid))])[:count]
    return config.sigmas()[picked].float()


def errors_at(module: LightningModule, x0: torch.Tensor, keys: torch.Tensor, cond, sigma: float, seed: int,
              iteration: int, draw: int, eps_stream: int,
              roles: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """The flow-matching (DSM) errors of several policy snapshots at one noise level (DGPO, CRD): ``x0`` re-noised at
    ``sigma`` (one value for all rows) with noise addressed by (seed, iteration, ``eps_stream``, key, ``draw``)
    (:func:`renoise`: rows with the same key share it), and e_r = mean_j (v_r - u)_j^2, u = eps - x0, for each role r
    of ``roles`` (:func:`role_velocity`: ``"theta"`` with graph, the others without).

    Args:
        x0: clean endpoints [b, *latent]; keys: int64 [b] noise addresses; cond: the rows' conditioning.
    Returns:
        ``(errors {role: float32 [b]}, velocities {role: float32 [b, *latent]}, u [b, *latent])``.
    Raises:
        KeyError: a role that is not declared (:func:`role_velocity`).
    """
    t = torch.full((len(keys),), sigma, device=x0.device)
    fd = getattr(module.generator, "frame_dim", 1)
    _, _, x_t, u = renoise(x0, keys, seed, iteration, draw, 0, eps_stream, fd, t=t)  # t given: no t stream drawn
    v = {r: role_velocity(module, x_t, t, cond, r) for r in roles}
    return {r: sample_mse(v[r], u) for r in roles}, v, u


@torch.no_grad()
def gathered_pass(module: LightningModule, chunks: Iterable[torch.Tensor],
                  fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A pass without graph over this rank's samples, gathered over ranks: the batch statistic that a second pass
    with graph needs before it starts (DGPO's group logits, CRD's centre), whatever the micro-batching. ``fn(rows)``
    gives a value per row [b, ...] for each of ``chunks`` (int64 row-index tensors covering the local batch, in
    order); the values are concatenated on the CPU and gathered (:func:`~genrl.methods.common.gather_batch`).

    Returns:
        [world * n, ...] on the CPU, in rank order (this rank's rows: :func:`~genrl.methods.common.rank_slice`).
    """
    return gather_batch(module, torch.cat([fn(c).cpu() for c in chunks]))


#: a loss unit: () -> (loss to back-propagate (already scaled), {stat: weighted value}, stat weight)
Unit = Callable[[], tuple[torch.Tensor, dict[str, float], float]]


def optimizer_steps(module: LightningModule, optimizer, steps: Iterable[Iterable[Unit]], max_grad_norm: float = 0.0,
                    check_finite: Callable[[torch.Tensor], None] | None = None,
                    counted: bool = True) -> dict[str, float]:
    """The update phase: for each optimizer step, zero the gradients, back-propagate every unit's loss (one backward
    pass each; gradients accumulate), clip the gradient norm (``max_grad_norm`` > 0) and step. ``steps`` may be a
    generator: each step's units are then built (e.g. its mini-batch conditioning encoded) just before it runs.
    ``counted=False`` steps a secondary network without advancing ``trainer.global_step``
    (:func:`~genrl.methods.common.step_uncounted`), so a multi-optimizer method counts iterations.

    Returns:
        ``{stat: sum of the units' weighted values / sum of their weights}`` over all steps and, on several
        processes, over all ranks (so the logged statistics do not depend on the device count). When there is more
        than one optimizer step, also ``{stat}/step{j}``: the same mean over step ``j`` alone (0 = the first), so
        an off-policy step's statistics (e.g. a PPO ratio away from 1) are not hidden in an average with the
        on-policy first step's (ratio exactly 1).

    A unit whose loss has no graph (it ran frozen weights only, e.g. a step of Wan2.2's untrained expert) is not
    back-propagated.

    Raises:
        ValueError: an optimizer step whose units all lack a gradient (names the likely cause and the fix).
    """
    per_step: list[tuple[dict[str, float], float]] = []
    for units in steps:
        optimizer.zero_grad()
        sums: dict[str, float] = {}
        weight, any_grad, n_units = 0.0, False, 0
        for unit in units:
            n_units += 1
            loss, stats, w = unit()
            if check_finite is not None:
                check_finite(loss)
            if loss.requires_grad:  # a unit that ran frozen weights only (one trained Wan2.2 expert) adds no gradient
                module.manual_backward(loss)
                any_grad = True
            for key, value in stats.items():
                sums[key] = sums.get(key, 0.0) + value
            weight += w
        if n_units and not any_grad:
            raise ValueError("this optimizer step has no gradient: every trained step ran frozen weights only (e.g. "
                             "Wan2.2 with experts: [high] and SDE steps all below the expert boundary); put the "
                             "rollout's SDE steps (rollout.sde_steps / num_sde_steps) on the trained expert's side")
        clip_and_step(module, optimizer, max_grad_norm, counted)
        per_step.append((sums, weight))
    total: dict[str, float] = {}
    for sums, _ in per_step:
        for key, value in sums.items():
            total[key] = total.get(key, 0.0) + value
    groups = [(total, sum(w for _, w in per_step))]
    if len(per_step) > 1:
        groups += [({f"{key}/step{j}": v for key, v in sums.items()}, w) for j, (sums, w) in enumerate(per_step)]
    return _global_means(module, groups)


def _global_means(module: LightningModule, groups: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """``{stat: sum / weight}`` of every ``(sums, weight)`` group, over every rank (one all-reduce of all the sums and
    weights; every rank runs the same units, so the keys agree): the logged training statistics are the global
    batch's, whatever the device count."""
    layout = [(sorted(sums), sums, weight) for sums, weight in groups]
    _, world = world_of(module)
    if world > 1:
        flat = [v for keys, sums, weight in layout for v in (weight, *(sums[k] for k in keys))]
        packed = module.trainer.strategy.reduce(torch.tensor(flat, dtype=torch.float64, device=module.device),
                                                reduce_op="sum").cpu().tolist()
        reduced, at = [], 0
        for keys, _, _ in layout:
            reduced.append((keys, dict(zip(keys, packed[at + 1 : at + 1 + len(keys)], strict=True)), packed[at]))
            at += 1 + len(keys)
        layout = reduced
    return {key: sums[key] / max(weight, 1) for keys, sums, weight in layout for key in keys}


def video_batch(method: LightningModule, batch: dict) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """A video datamodule's batch as data latents: ``(x0, prompts, index)``.

    Args:
        batch: ``{"pixels": float [B, T, C, H, W] in [0, 1], "prompts": B captions, "index": int64 [B] (optional)}``.
    Returns:
        x0: ``method.generator.encode(pixels)`` in float32, without gradients; prompts: the B captions; index: int64
        [B] on the CPU, the batch's global sample ids, or when the batch has none, ids unique over steps and
        data-parallel ranks: ``(global_step * world + rank) * B + arange(B)`` (they address every random draw).
    Raises:
        ValueError: pixels that are not 5-D (names the shape).
    """
    pixels = batch["pixels"]
    if pixels.ndim != 5:
        raise ValueError(f"batch['pixels'] must be [B, T, C, H, W] in [0, 1], got {tuple(pixels.shape)}")
    b = pixels.shape[0]
    if "index" in batch:
        index = batch["index"].cpu()
    else:
        rank, world = world_of(method)
        step = int(getattr(trainer_of(method), "global_step", 0) or 0)
        index = torch.arange(b) + (step * world + rank) * b
    with torch.no_grad():
        x0 = method.generator.encode(pixels).float()
    return x0, list(batch["prompts"]), index


def caption_dropout(prompts: list[str], probability: float, seed: int, index: torch.Tensor, stream: int,
                    null_prompt: str = "") -> list[str]:
    """Replace each prompt's text by ``null_prompt`` (an image-conditioned prompt keeps its image) with
    ``probability`` (classifier-free guidance training, Ho & Salimans
    2022), sample i's draw addressed by (``seed``, ``index[i]``, ``stream``): the same samples are dropped whatever
    the batch composition or device count."""
    if probability <= 0:
        return list(prompts)
    drop = rand_per_sample((), seed, index, stream=stream) < probability
    return [null_prompts([p], null_prompt)[0] if d else p for p, d in zip(prompts, drop.tolist(), strict=True)]
