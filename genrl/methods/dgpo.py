"""DGPO (Direct Group Preference Optimization) for flow-matching generators: group preferences from a pointwise reward,
trained with the flow-matching error at fresh noise, no SDE log-probs.

Luo et al. 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization" (arXiv 2510.08425). Each
iteration: G clean endpoints per prompt from the deterministic ODE; group advantages A (GRPO's, clipped to
+-``adv_clip``); ``num_timesteps`` sigmas drawn without replacement from the first ``trunc_steps`` + 1 values of the
rollout's own grid, shared by every sample and rank, and one noise per (group, sigma) shared by the group's members.
At each sigma every sample's flow-matching error under the policy and the reference gives the group's logit

    z_g = (beta / K) sum_{i in g} A_i (e_theta,i - e_ref,i)        (detached; all ranks' members of g)

and the policy descends the gradient-equivalent surrogate mean_i sg(sigmoid(z_g(i))) A_i e_theta,i
(:func:`genrl.flow.preference.dgpo_surrogate`), whose gradient is that of -log sigmoid(-z_g) summed over groups up to
a positive factor. Optional: DSM clipping against a fast EMA theta_old (decay min(``ema_decay_max``,
``ema_decay_ramp`` x iteration); :func:`~genrl.flow.preference.dsm_clip_keep`), rollouts by that EMA after
``switch_ema_ref`` iterations, and a velocity KL to the reference. Every draw is addressed by (seed, iteration, group,
sigma index): resume equals an uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.fm_core import sample_mse
from genrl.flow.preference import apply_keep, dgpo_group_logits, dgpo_surrogate, dsm_clip_keep
from genrl.methods.common import (
    advance_iteration,
    configure_policy,
    configure_policy_optimizer,
    gather_batch,
    init_method,
    ode_validation_config,
    rank_slice,
)
from genrl.methods.phases import (
    collect_endpoints,
    errors_at,
    flat_validation_step,
    gathered_pass,
    grid_sigmas,
    group_advantages_of,
    micro_batches,
    optimizer_steps,
    score,
)
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import ramped_decay
from genrl.noise import stream_id
from genrl.rollout.sampler import RolloutConfig

__all__ = ["DGPO"]

_STREAM_EPS, _STREAM_SIGMA = stream_id("dgpo.eps"), stream_id("dgpo.sigma")


class DGPO(LightningModule):
    """DGPO (see the module docstring) on any Generator.

    Training batches come from :class:`genrl.data.PromptDataModule` (``group_size`` K >= 2), as for
    :class:`~genrl.methods.ram.RAM`.

    Args:
        generator / latent_shape / lora / rollout / rewards / reward_combine / advantage_std / advantage_eps: as RAM
            (the rollout is forced to the deterministic ODE kernel).
        adv_clip: advantages clipped to [-adv_clip, adv_clip] (reference 5).
        beta: the implicit-reward temperature (reference 100; 10 for PickScore).
        num_timesteps: M sigmas trained per iteration (reference 4).
        trunc_steps: the sigmas come from grid indices [0, trunc_steps]; None: every step of the rollout grid.
        clip_range: DSM clipping epsilon against the fast EMA (None: off; reference 1e-2).
        kl_beta: weight of mean (v_theta - v_ref)^2 (reference 0.02 GenEval / OCR, 0.001 PickScore).
        ema_decay_ramp / ema_decay_max: the fast EMA theta_old's decay min(max, ramp x iteration) (reference
            1e-3 / 0.3); it is kept only when ``clip_range`` or ``switch_ema_ref`` needs it.
        switch_ema_ref: from this iteration on, theta_old rolls out (reference 200); None: the live policy always.
        updates_per_iteration: optimizer steps per iteration (must divide num_timesteps).
        micro_batch_size: samples per network call (None: this rank's whole batch).
        optimizer / max_grad_norm / eval_rollout / seed: as GRPO.

    Raises:
        ValueError: beta, adv_clip or clip_range <= 0; num_timesteps < 1 or more than the grid offers;
            updates_per_iteration not dividing num_timesteps; kl_beta < 0; a bad EMA schedule.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        lora: LoraSpec | None = None,
        rollout: RolloutConfig | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum", "advantage_sum"] = "weighted_sum",
        advantage_std: Literal["group", "global", "none"] = "group",
        advantage_eps: float = 1e-4,
        adv_clip: float = 5.0,
        beta: float = 100.0,
        num_timesteps: int = 4,
        trunc_steps: int | None = None,
        clip_range: float | None = None,
        kl_beta: float = 0.0,
        ema_decay_ramp: float = 1e-3,
        ema_decay_max: float = 0.3,
        switch_ema_ref: int | None = None,
        updates_per_iteration: int = 1,
        micro_batch_size: int | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        eval_rollout: RolloutConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not (beta > 0 and adv_clip > 0 and (clip_range is None or clip_range > 0) and kl_beta >= 0):
            raise ValueError(f"need beta > 0, adv_clip > 0, clip_range > 0 or null, kl_beta >= 0; got {beta}, "
                             f"{adv_clip}, {clip_range}, {kl_beta}")
        if num_timesteps < 1 or updates_per_iteration < 1 or num_timesteps % updates_per_iteration:
            raise ValueError(f"need num_timesteps >= 1 and updates_per_iteration >= 1 dividing it; got "
                             f"{num_timesteps}, {updates_per_iteration}")
        if not (0 <= ema_decay_max < 1 and ema_decay_ramp >= 0):
            raise ValueError(f"need 0 <= ema_decay_max < 1 and ema_decay_ramp >= 0, got {ema_decay_max}, "
                             f"{ema_decay_ramp}")
        init_method(self, generator, rewards, reward_combine)
        base = rollout or RolloutConfig(kernel="ode")
        self.rollout_config = RolloutConfig(**{**vars(base), "kernel": "ode"})
        grid = self.rollout_config.num_steps if trunc_steps is None else trunc_steps + 1
        if not 1 <= grid <= self.rollout_config.num_steps or num_timesteps > grid:
            raise ValueError(f"num_timesteps={num_timesteps} sigmas from the first trunc_steps + 1 = {grid} of the "
                             f"rollout's {self.rollout_config.num_steps} grid values: need 1 <= trunc_steps + 1 <= "
                             f"num_steps and num_timesteps <= trunc_steps + 1")
        self.eval_config = eval_rollout or ode_validation_config(self.rollout_config)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer
        self.grid_size = grid

    # ------------------------------------------------------------------ construction
    @property
    def uses_old(self) -> bool:
        """Whether the fast EMA theta_old exists (DSM clipping or EMA rollouts)."""
        return self.hparams.clip_range is not None or self.hparams.switch_ema_ref is not None

    def configure_model(self) -> None:
        if (gen := configure_policy(self, reference=True)) is not None and self.uses_old:
            self.roles.lagged("old_policy", gen.transformer)

    configure_optimizers = configure_policy_optimizer

    # ------------------------------------------------------------------ the algorithm
    def sigmas(self, it: int) -> torch.Tensor:
        """float32 [num_timesteps]: the iteration's sigmas, grid indices drawn without replacement from the first
        ``trunc_steps`` + 1, addressed by (seed, iteration): the same on every rank (:func:`grid_sigmas`)."""
        return grid_sigmas(self.rollout_config, self.grid_size, self.hparams.num_timesteps, self.hparams.seed, it,
                           _STREAM_SIGMA)

    def errors(self, x0, group, cond, sigma: float, it: int, m: int, roles: tuple[str, ...]):
        """Flow-matching errors [b] of ``x0`` [b, *latent] re-noised at ``sigma`` with its group's noise of draw
        ``m``, for each of ``roles`` (``"theta"`` with graph; others without), and the velocities ``{role: v}``
        (:func:`errors_at`)."""
        e, v, _ = errors_at(self, x0, group, cond, sigma, self.hparams.seed, it, m, _STREAM_EPS, roles)
        return e, v

    @torch.no_grad()
    def group_logits(self, x0, group, adv, cond, chunks, all_group, size: int, sigma: float, it: int,
                     m: int) -> torch.Tensor:
        """z_g of each of this rank's samples [n] at ``sigma`` (draw ``m``), from a pass without graph over its
        ``chunks`` (index tensors into ``x0`` [n, *latent], ``group`` / ``adv`` [n], ``cond``): the policy's and the
        reference's errors, gathered with the advantages over ranks and reduced per group of ``all_group`` (the
        gathered group ids; K = ``size``) by :func:`~genrl.flow.preference.dgpo_group_logits`."""
        def diff(c: torch.Tensor) -> torch.Tensor:
            e, _ = self.errors(x0[c.to(x0.device)], group[c], cond.select(c.tolist()), sigma, it, m,
                               ("theta", "reference"))
            return e["theta"] - e["reference"]

        z = dgpo_group_logits(gathered_pass(self, chunks, diff), gather_batch(self, adv), all_group,
                              self.hparams.beta, size)
        return rank_slice(self, z, len(group))

    def training_step(self, batch: dict, batch_idx: int) -> None:
        h, gen, it = self.hparams, self.generator, int(self.iteration)
        prompts, index, group = list(batch["prompts"]), batch["index"].cpu(), batch["group"].cpu()
        by_ema = h.switch_ema_ref is not None and it >= h.switch_ema_ref
        ro = collect_endpoints(gen, prompts, self.latent_shape, h.seed, index, self.rollout_config, it,
                               policy=(lambda: self.roles.swap(gen, "old_policy")) if by_ema else None)
        scores = score(self, self.scorer, ro, group, iteration=it)
        adv = group_advantages_of(self, scores, std=h.advantage_std, eps=h.advantage_eps, min_group_size=2,
                                  iteration=it).clamp(-h.adv_clip, h.adv_clip)
        n, x0, sig = len(prompts), ro.samples, self.sigmas(it)
        cond, mb = gen.encode_prompts(prompts), h.micro_batch_size or n
        chunks = micro_batches(n, mb)
        size = int(torch.unique(scores.group, return_counts=True)[1].max())  # K (groups may span ranks)

        def logits(m: int) -> torch.Tensor:
            return self.group_logits(x0, group, adv, cond, chunks, scores.group, size, float(sig[m]), it, m)

        def unit(m: int, c: torch.Tensor, z: torch.Tensor):
            roles = ("theta",) + (("old_policy",) if h.clip_range is not None else ()) + \
                (("reference",) if h.kl_beta > 0 else ())
            e, v = self.errors(x0[c.to(x0.device)], group[c], cond.select(c.tolist()), float(sig[m]), it, m, roles)
            a = adv[c].to(e["theta"].device)
            err, stats = e["theta"], {"train/weight": float(torch.sigmoid(z[c]).sum())}
            if h.clip_range is not None:
                keep = dsm_clip_keep(err.detach(), e["old_policy"], a, h.clip_range)
                err, stats["train/clipfrac"] = apply_keep(err, keep), float((~keep).sum())
            loss = dgpo_surrogate(err, a, z[c].to(err.device)).sum()
            if h.kl_beta > 0:
                kl = sample_mse(v["theta"], v["reference"])
                loss, stats["train/kl"] = loss + h.kl_beta * kl.sum(), float(kl.detach().sum())
            stats["train/loss"] = float(loss.detach())
            return loss / (n * per_update), stats, len(c)

        per_update = h.num_timesteps // h.updates_per_iteration

        def step(u: int):
            units = []
            for m in range(u * per_update, (u + 1) * per_update):
                z = logits(m)
                units += [lambda m=m, c=c, z=z: unit(m, c, z) for c in chunks]
            return units

        self.log_dict(optimizer_steps(self, self.optimizers(), (step(u) for u in range(h.updates_per_iteration)),
                                      h.max_grad_norm), batch_size=n)
        if self.uses_old:
            decay = ramped_decay(it + 1, h.ema_decay_ramp, h.ema_decay_max)
            self.log("train/old_decay", self.roles.update_lagged("old_policy", decay), batch_size=n)
        advance_iteration(self, n)

    validation_step = flat_validation_step
