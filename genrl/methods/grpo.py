"""GRPO for flow-matching generators: the Flow-GRPO / DanceGRPO baseline.

Each iteration: sample a group of K rollouts per prompt with a stochastic step kernel (Flow-GRPO: Liu et
al. 2025, "Flow-GRPO", eq. 9-10 ODE-to-SDE conversion; DanceGRPO: Xue et al. 2025), score the decoded
videos, turn rewards into group-normalised advantages (GRPO, Shao et al. 2024), and update the policy with
the clipped surrogate on every trained step's Gaussian log-prob (PPO, Schulman et al. 2017, eq. 7), plus an
optional KL to the reference policy. The method composes the shared parts: :mod:`genrl.rollout` (sampler
and the transition log-prob), :mod:`genrl.flow` (kernels, clipped loss, KL, advantages) and
:class:`genrl.rewards.RewardManager` (rewards held outside the module's children).

Optimization is manual: one Lightning optimizer step per mini-batch, so ``trainer.max_steps`` counts
optimizer steps (= iterations x ``inner_epochs`` x mini-batches per rollout). The iteration counter is the
module's own (a checkpointed buffer), and every random draw is addressed by (seed, sample index, step) or
(seed, iteration), so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.policy import PolicyLossName, StepMoments, check_policy_loss, gaussian_kl, policy_loss, velocity_kl
from genrl.flow.sde import step_mean_std
from genrl.methods.common import (
    advance_iteration,
    check_no_dropout,
    configure_policy,
    configure_policy_optimizer,
    init_method,
    local_mini_batch,
    ode_validation_config,
)
from genrl.methods.phases import (
    collect_flat,
    flat_validation_step,
    group_advantages_of,
    optimizer_steps,
    score,
    update_plan,
)
from genrl.methods.preview import PreviewConfig, configure_preview, log_proxy_fidelity, select_batch
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.rollout.sampler import RolloutConfig, encode_cfg, guided_velocity, transition_log_prob

__all__ = ["GRPO"]


class GRPO(LightningModule):
    """Flow-GRPO / DanceGRPO on any Generator, with group advantages and a clipped policy loss.

    Training batches are prompt batches from :class:`genrl.data.PromptDataModule`:
    ``{"prompts": list[str] (P*K, each prompt K times in a row), "index": int64 [P*K] global sample ids,
    "group": int64 [P*K] global group ids}``. Validation batches (same format) are sampled with the
    deterministic ODE and scored by the same rewards.

    Args:
        generator: the policy (:class:`~genrl.models.families.GeneratorSpec`): genrl's DiT (``family: dit``,
            default ``pretrained: assets/shapes-dit``, ``text_encoder: minilm``) or a diffusers family (Wan2.1, SD3.5,
            FLUX.1, SANA) from a local folder or config values.
        latent_shape: per-sample latent shape of the rollouts (default: the generator's, or (8, 3, 16, 16)
            for the DiT).
        rollout: the rollout sampler config (kernel, noise level, steps, CFG, which steps are SDE).
        rewards: reward specs (``{"name": "shapes", "weight": 1.0, ...}``; see :class:`genrl.rewards.RewardSpec`).
        reward_combine: ``"weighted_sum"``, ``"zscore_sum"`` or ``"advantage_sum"`` (per-reward advantages).
        advantage_std: ``"group"`` (per-prompt std), ``"global"`` (std of the whole gathered batch) or ``"none"``.
        advantage_eps: epsilon added to the std (Flow-GRPO 1e-4).
        adv_clip_max: advantages are clipped to [-A_max, A_max] (5 in all reference code).
        clip_range / clip_range_high: PPO ratio clip epsilon (low / high; high defaults to low).
        policy_loss: the per-step objective (:data:`genrl.flow.policy.POLICY_LOSSES`): ``"clipped"`` (PPO / GRPO's
            clipped surrogate), ``"guard"`` (GRPO-Guard: the clip on the normalised ratio r_G) or ``"dppo"``
            (Flow-DPPO: unclipped, masked outside a KL trust region). ``guard`` and ``dppo`` need each SDE step's
            rollout mean and std, which the rollout then records (one latent per step more).
        policy_loss_args: the loss's own options, e.g. ``{scale: step}`` (guard: x 1 / |delta sigma|, verl-omni) or
            ``{max_divergence: 1e-5}`` (dppo's epsilon_D).
        kl_beta: weight of the KL to the reference policy (0 disables it and the reference).
        kl_kind: ``"velocity_mse"`` (mean (v - v_ref)^2) or ``"gaussian"`` (closed-form per-step KL).
        lora: train a LoRA adapter instead of all weights; the reference is then the adapter-disabled model.
        optimizer: optimizer factory (default AdamW(lr=1e-3)).
        max_grad_norm: gradient-norm clip per optimizer step (0 disables).
        inner_epochs: passes over each rollout batch.
        mini_batch_size: samples per optimizer step over all devices (None = the whole rollout batch, one step per
            inner epoch); each rank takes ``mini_batch_size / devices`` of its samples, so the optimizer steps are the
            same on 1 or N devices.
        eval_rollout: sampler for validation (default: ODE, 20 steps, the rollout's CFG).
        preview: Sol-RL's two-stage collect (:class:`~genrl.methods.preview.PreviewConfig`): the ``group_size`` N
            candidates per prompt previewed by a low-precision copy of the policy, K kept by preview reward and
            regenerated (same noise addresses) in full precision for the update (docs/methods/sol_rl.md).
        reuse_rollout_forward: the update back-propagates the velocities the rollout computed at its stochastic
            steps (kept with their graphs, ``rollout(grad="sde")``) instead of running those forwards again. The
            first update after a rollout is on-policy, so this is the same gradient (importance ratio exactly 1)
            for one network forward less per trained step and sample (the quickstart: 3 of 13 forward-equivalents
            per iteration); the rollout then holds the activations of every trained step of the whole batch until
            the update. Needs ``inner_epochs: 1``, ``mini_batch_size: null`` (one optimizer step per rollout), no
            ``preview`` and a policy without active dropout (the rollout runs in eval mode).
        seed: seed of all randomness.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        rollout: RolloutConfig | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum", "advantage_sum"] = "weighted_sum",
        advantage_std: Literal["group", "global", "none"] = "group",
        advantage_eps: float = 1e-4,
        adv_clip_max: float = 5.0,
        clip_range: float = 1e-4,
        clip_range_high: float | None = None,
        policy_loss: PolicyLossName = "clipped",
        policy_loss_args: dict[str, Any] | None = None,
        kl_beta: float = 0.0,
        kl_kind: Literal["velocity_mse", "gaussian"] = "velocity_mse",
        lora: LoraSpec | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        inner_epochs: int = 1,
        mini_batch_size: int | None = None,
        eval_rollout: RolloutConfig | None = None,
        preview: PreviewConfig | None = None,
        reuse_rollout_forward: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if inner_epochs < 1:
            raise ValueError(f"inner_epochs must be >= 1, got {inner_epochs}")
        if mini_batch_size is not None and mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1 or null, got {mini_batch_size}")
        if clip_range <= 0 or adv_clip_max <= 0 or kl_beta < 0:
            raise ValueError(
                f"need clip_range > 0, adv_clip_max > 0, kl_beta >= 0; got {clip_range}, {adv_clip_max}, {kl_beta}"
            )
        if reuse_rollout_forward and (inner_epochs != 1 or mini_batch_size is not None or preview is not None):
            raise ValueError(
                "reuse_rollout_forward needs one on-policy optimizer step per rollout: inner_epochs: 1 (got "
                f"{inner_epochs}), mini_batch_size: null (got {mini_batch_size}) and no preview (got "
                f"{'a preview' if preview is not None else 'none'}); set reuse_rollout_forward: false for these"
            )
        if preview is not None and rollout is not None and rollout.initial_noise == "group":
            raise ValueError("rollout.initial_noise: group (a group's shared starting noise) does not combine with "
                             "preview (its candidates are kept by sample); use initial_noise: sample with preview")
        self.needs_moments = check_policy_loss(policy_loss, policy_loss_args)
        init_method(self, generator, rewards, reward_combine)
        self.rollout_config = rollout or RolloutConfig()
        self.eval_config = eval_rollout or ode_validation_config(self.rollout_config, num_steps=20)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer
        self.preview = preview

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        if (gen := configure_policy(self, reference=self.hparams.kl_beta > 0)) is not None:
            configure_preview(self, gen)

    configure_optimizers = configure_policy_optimizer

    # ------------------------------------------------------------------ the algorithm
    def _reference_velocity(self, x, sigma, cond, uncond, cfg):
        rc = self.rollout_config
        with torch.no_grad(), self.roles.reference(self.generator) as gen:
            return guided_velocity(gen, x, sigma, cond, uncond, cfg, rc.micro_batch_size, rc.batching)

    def step_loss(self, sub, k: int, cond, uncond, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The ``policy_loss`` (default: the clipped surrogate, PPO eq. 7) on step ``k`` of the trajectories ``sub``
        with advantages ``adv`` [b], plus ``kl_beta`` x the KL to the reference (velocity MSE, or the closed-form
        Gaussian KL of the step). The step's log-prob is recomputed under the current weights, or taken from
        ``sub.live`` when the rollout kept it (``reuse_rollout_forward``)."""
        h, cfg = self.hparams, self.rollout_config
        if k in sub.live:
            log_prob, v, mean = sub.live.pop(k)  # popped: its graph is freed by this step's backward
        else:
            log_prob, v, mean = transition_log_prob(self.generator, sub, k, cond, uncond)
        moments = None
        if self.needs_moments:
            old_mean, std = sub.step_moments(k)
            moments = StepMoments(mean, old_mean.to(mean.device), std, float(sub.sigmas[k] - sub.sigmas[k + 1]))
        loss_vec, stats = policy_loss(h.get("policy_loss", "clipped"), log_prob,
                                      sub.log_probs[:, k].to(log_prob.device), adv.to(log_prob.device), moments,
                                      clip_range=h.clip_range, clip_range_high=h.clip_range_high,
                                      adv_clip_max=h.adv_clip_max, **(h.get("policy_loss_args") or {}))
        loss = loss_vec.mean()
        if h.kl_beta > 0:
            x, sig = sub.latents[:, k].to(v.device), sub.sigmas.to(v.device, torch.float32)
            v_ref = self._reference_velocity(x, sig[k].expand(len(sub.prompts)), cond, uncond, cfg.cfg_scale)
            if h.kl_kind == "velocity_mse":
                kl = velocity_kl(v, v_ref)
            else:
                mean_ref, std = step_mean_std(cfg.kernel, x, v_ref, sig[k], sig[k + 1], cfg.noise_level,
                                              sigma_at_one=float(sub.sigmas[1]))
                kl = gaussian_kl(mean, mean_ref, std)
            loss = loss + h.kl_beta * kl.mean()
            stats["kl"] = kl.mean().detach()
        stats["loss"] = loss.detach()
        return loss, stats

    def training_step(self, batch: dict, batch_idx: int) -> None:
        h, cfg, gen = self.hparams, self.rollout_config, self.generator
        prompts, index, group = list(batch["prompts"]), batch["index"].cpu(), batch["group"].cpu()
        it, selection = int(self.iteration), None
        if self.preview is not None:  # Sol-RL: preview the pool in low precision, regenerate the kept rows
            prompts, index, group, selection = select_batch(self, prompts, index, group, cfg, it)
        n = len(prompts)
        reuse = h.get("reuse_rollout_forward", False)
        if reuse:
            check_no_dropout(gen)
        ro = collect_flat(gen, prompts, self.latent_shape, h.seed, index, cfg, it, keep_graph=reuse,
                          record_moments=self.needs_moments, group=group)
        scores = score(self, self.scorer, ro, group, iteration=it)
        log_proxy_fidelity(self, selection, scores.result.total, scores.result.valid)
        adv = group_advantages_of(self, scores, std=h.advantage_std, eps=h.advantage_eps,
                                  per_reward=h.reward_combine == "advantage_sum", iteration=it)
        traj, steps = ro.samples, ro.samples.sde_steps
        if not steps:
            raise ValueError("the rollout has no stochastic step to train; check rollout.kernel / sde_steps")
        mb = local_mini_batch(self, h.mini_batch_size, n)

        if reuse and mb < n:
            raise ValueError(f"reuse_rollout_forward needs the whole local batch in one optimizer step; this rank "
                             f"has {n} samples and a mini-batch of {mb}")

        def units(rows: torch.Tensor):  # one optimizer step: every trained step of the mini-batch
            sub = traj if reuse else traj.select(rows)
            cond, uncond = encode_cfg(gen, sub.prompts, cfg)

            def unit(k: int):
                loss, stats = self.step_loss(sub, k, cond, uncond, adv[rows])
                return loss / len(steps), {key: float(v) for key, v in stats.items()}, 1
            return [lambda k=k: unit(k) for k in steps]

        # invalid samples have advantage exactly 0: no gradient, the same steps on every rank
        plan = update_plan(h.seed, it, n, mb, h.inner_epochs)
        stats = optimizer_steps(self, self.optimizers(), (units(rows) for rows in plan), h.max_grad_norm)
        self.log_dict({f"train/{key}": value for key, value in stats.items()}, batch_size=n)
        advance_iteration(self, n)

    validation_step = flat_validation_step
