"""Forward-process RL: RAM (reinforce adjoint matching), with DiffusionNFT and AWM as options of the same method.

RL that keeps pretraining's regression structure (docs/methods/forward_rl.md). Each iteration: the lagged policy
theta_old (an EMA of theta) samples G clean endpoints x0 per prompt with the deterministic ODE (nothing of the
trajectory is kept); rewards give per-prompt advantages A over the gathered batch (failed rewards: A = 0); each
endpoint is re-noised K times, t ~ p(t) (RAM: p(t) ∝ t), x_t = (1 - t) x0 + t eps, Y = eps - x0, and the current,
old and reference velocities (conditional only) enter one regression objective
(:class:`~genrl.flow.forward_rl.ForwardRLObjective`):

- ``"ram"``: ||v_theta - sg[v_ref + m A (Y - v_old)]||^2 (Bergmeister et al. 2026, Eq. 17 as released);
- ``"nft"``: DiffusionNFT's implicit positive / negative policies mixed by r = 1/2 + clip(A)/(2C) (Zheng et al.
  2025) + kl_beta ||v_theta - v_ref||^2;
- ``"awm"``: advantage-weighted matching -A w(t, ||v_theta - Y||^2) with a PPO ratio against theta_old (Xue et al.
  2025) + kl_beta / ema_kl_beta anchors to v_ref / v_old.

The K x N units are split over ``updates_per_iteration`` optimizer steps; then theta_old <- d theta_old + (1 - d)
theta, d = min(ramp * iteration, max) (RAM 0.01 / 0.9, DiffusionNFT 0.001 / 0.5). Monitors
(:func:`~genrl.flow.forward_rl.velocity_monitors`): ``monitor/*`` velocity gaps and flow-matching errors,
``monitor/self_consistency`` (``fm_mse_old`` minus its first value), ``advantage/std``, ``reward/batch_std``.
Randomness is addressed by (seed, iteration, sample, draw): micro-batches equal one batch, resume equals an
uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.forward_rl import ForwardRLObjective, velocity_monitors
from genrl.methods.common import (
    advance_iteration,
    configure_policy,
    configure_policy_optimizer,
    gather_batch,
    init_method,
    ode_validation_config,
)
from genrl.methods.phases import (
    collect_endpoints,
    flat_validation_step,
    group_advantages_of,
    micro_batches,
    optimizer_steps,
    renoise,
    reward_spread,
    role_velocity,
    score,
)
from genrl.methods.preview import PreviewConfig, configure_preview, log_proxy_fidelity, select_batch
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import ramped_decay
from genrl.noise import stream_id
from genrl.rollout.sampler import RolloutConfig

__all__ = ["RAM"]

Objective = Literal["ram", "nft", "awm"]
_STREAM_EPS, _STREAM_T = stream_id("ram.eps"), stream_id("ram.t")


class RAM(LightningModule):
    """RAM / DiffusionNFT / AWM: forward-process RL on the policy's own clean endpoints (see the module docstring).

    Training batches come from :class:`genrl.data.PromptDataModule` (``group_size`` >= 2 rollouts per prompt):
    ``{"prompts": list[str] (P*G), "index": int64 [P*G], "group": int64 [P*G]}``; validation batches are sampled with
    ``eval_rollout`` (the current policy) and scored by the same rewards.

    Args:
        objective: ``"ram"``, ``"nft"`` or ``"awm"``.
        generator / latent_shape / lora: the policy, as in
            :class:`~genrl.methods.grpo.GRPO` (genrl's DiT or a diffusers family; LoRA optional: the reference is then
            the adapter-disabled model).
        rollout: the endpoint sampler (forced to the deterministic ODE kernel; CFG allowed).
        rewards / reward_combine: reward specs and their combination (as GRPO).
        advantage_std: ``"group"`` (per-prompt std), ``"global"`` or ``"none"``; advantage_eps: added to the std.
        multiplier: RAM's reward multiplier m > 0 (reference: 100 for GenEval / OCR-like rewards, 1000 for
            PickScore-like ones); m A plays r / lambda, so the effective temperature is about std(r) / m.
        num_draws: K >= 1 (t, eps) re-noisings per endpoint (reference 8).
        timestep_density: ``"linear"`` (p(t) ∝ t, RAM), ``"uniform"``, ``"logit_normal"``, ``"power"`` (p ∝
            t^alpha) or ``"grid"`` (the rollout's sigma grid, DiffusionNFT / AWM); ``timestep_alpha``,
            ``t_min`` / ``t_max`` (the range; t = 0 is excluded by the loss-free endpoint), ``timestep_shift``.
        updates_per_iteration: optimizer steps per iteration (the K x N units are split between them).
        micro_batch_size: endpoints per network call (None = all).
        old_decay_ramp / old_decay_max: the old-policy EMA d = min(ramp * iteration, max).
        nft_beta / nft_clip / nft_adaptive: DiffusionNFT's implicit-policy step beta, advantage clip C and x0-space
            adaptive weighting.
        awm_weighting / awm_p / awm_clip_range / awm_adv_clip: AWM's w(t, l) (``uniform``, ``t``, ``t2``,
            ``huber``, ``ghuber``), its exponent, the PPO ratio clip (None = unclipped) and the advantage clip.
        kl_beta: NFT / AWM weight of ||v_theta - v_ref||^2 (RAM needs none: its anchor is in the target).
        ema_kl_beta: AWM's weight of ||v_theta - v_old||^2.
        optimizer / max_grad_norm: optimizer factory and gradient-norm clip (0 = off; RAM's reference: off).
        eval_rollout: validation sampler (default: ODE, the rollout's steps and CFG).
        preview: Sol-RL's two-stage collect (:class:`~genrl.methods.preview.PreviewConfig`): the data module's
            ``group_size`` N candidates per prompt previewed by a low-precision copy of theta_old, K kept by their
            preview reward, regenerated by theta_old in full precision and trained on (docs/methods/sol_rl.md);
            None: every rollout is trained on.
        seed: seed of all randomness.

    Raises:
        ValueError: multiplier <= 0 (or not finite), num_draws < 1, updates_per_iteration < 1 or not dividing
            num_draws, a bad EMA schedule, an unknown objective.
    """

    def __init__(
        self,
        objective: Objective = "ram",
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        lora: LoraSpec | None = None,
        rollout: RolloutConfig | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum", "advantage_sum"] = "weighted_sum",
        advantage_std: Literal["group", "global", "none"] = "group",
        advantage_eps: float = 1e-4,
        multiplier: float = 100.0,
        num_draws: int = 8,
        timestep_density: Literal["linear", "uniform", "logit_normal", "power", "grid"] = "linear",
        timestep_alpha: float = 1.0,
        t_min: float = 0.0,
        t_max: float = 1.0,
        timestep_shift: float = 1.0,
        updates_per_iteration: int = 1,
        micro_batch_size: int | None = None,
        old_decay_ramp: float = 0.01,
        old_decay_max: float = 0.9,
        nft_beta: float = 1.0,
        nft_clip: float = 5.0,
        nft_adaptive: bool = True,
        awm_weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "ghuber",
        awm_p: float = 0.25,
        awm_clip_range: float | None = None,
        awm_adv_clip: float = 5.0,
        kl_beta: float = 0.0,
        ema_kl_beta: float = 0.0,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 0.0,
        eval_rollout: RolloutConfig | None = None,
        preview: PreviewConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.objective = ForwardRLObjective(objective, multiplier, nft_beta, nft_clip, nft_adaptive, awm_weighting,
                                            awm_p, awm_clip_range, awm_adv_clip, kl_beta, ema_kl_beta)
        if not isinstance(num_draws, int) or num_draws < 1:
            raise ValueError(f"num_draws K must be an int >= 1 (re-noisings per endpoint; reference 8), got "
                             f"{num_draws!r}")
        if updates_per_iteration < 1 or num_draws % updates_per_iteration:
            raise ValueError(f"updates_per_iteration must be >= 1 and divide num_draws={num_draws}, got "
                             f"{updates_per_iteration}")
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or null, got {micro_batch_size}")
        if not (0 <= old_decay_max < 1 and old_decay_ramp >= 0):
            raise ValueError(f"need 0 <= old_decay_max < 1 and old_decay_ramp >= 0, got {old_decay_max}, "
                             f"{old_decay_ramp}")
        if not 0 <= t_min < t_max <= 1:
            raise ValueError(f"need 0 <= t_min < t_max <= 1, got {t_min}, {t_max}")
        init_method(self, generator, rewards, reward_combine)
        base = rollout or RolloutConfig(kernel="ode")
        self.rollout_config = RolloutConfig(**{**vars(base), "kernel": "ode"})  # endpoints: deterministic ODE
        self.eval_config = eval_rollout or ode_validation_config(self.rollout_config)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer
        self.old_policy = None
        self.register_buffer("initial_self_consistency", torch.full((), float("nan")))
        self.preview = preview

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        # the reference: the initial weights (none stored under LoRA: adapter disabled); theta_old: the lagged EMA
        # that rolls out and supplies v_old (the trainable tensors only; checkpointed)
        if (gen := configure_policy(self, reference=self.objective.needs_reference)) is not None:
            self.roles.lagged("old_policy", gen.transformer)
            configure_preview(self, gen)  # Sol-RL: the low-precision copy of theta_old that previews candidates

    configure_optimizers = configure_policy_optimizer

    # ------------------------------------------------------------------ pieces
    def timestep_args(self) -> dict:
        """The options of :func:`~genrl.flow.forward_rl.sample_timesteps` for this method's p(t)."""
        h = self.hparams
        grid = self.rollout_config.sigmas()[:-1].tolist() if h.timestep_density == "grid" else None
        return dict(density=h.timestep_density, alpha=h.timestep_alpha, t_min=h.t_min, t_max=h.t_max,
                    shift=h.timestep_shift, grid=grid)

    def unit_loss(self, x0: torch.Tensor, adv: torch.Tensor, cond, index: torch.Tensor, it: int, draw: int):
        """The objective's loss on one (draw, micro-batch) unit and its monitors.

        Args:
            x0: clean endpoints [b, *latent] (detached); adv: advantages A [b]; cond: their prompts' conditioning;
            index: their global sample ids [b]; it / draw: iteration and draw number (address the noise).
        Returns:
            (0-d loss with graph, dict of detached monitors).
        """
        fd = getattr(self.generator, "frame_dim", 1)
        t, _, x_t, u = renoise(x0, index, self.hparams.seed, it, draw, _STREAM_T, _STREAM_EPS, fd,
                               **self.timestep_args())
        v = role_velocity(self, x_t, t, cond)
        v_old = role_velocity(self, x_t, t, cond, "old_policy")
        v_ref = role_velocity(self, x_t, t, cond, "reference") if self.objective.needs_reference else None
        loss, stats = self.objective.loss(v, v_old, v_ref, u, x_t, x0, t, adv.to(v.device), frame_dim=fd)
        mon = velocity_monitors(v.detach(), v_old, v_ref if v_ref is not None else v_old, u, frame_dim=fd)
        if v_ref is None:  # no reference forward for this objective: its monitors are not measured
            mon = {k: val for k, val in mon.items() if k not in ("v_ref_mse", "v_norm_ratio", "fm_mse_ref")}
        return loss, {**{f"monitor/{k}": torch.as_tensor(float(val)) for k, val in mon.items()},
                      **{f"train/{k}": torch.as_tensor(float(val)) for k, val in stats.items()}}

    def update_old_policy(self) -> float:
        """theta_old <- d theta_old + (1 - d) theta, d = min(ramp * iteration, max); returns d."""
        return self.roles.update_lagged("old_policy", ramped_decay(int(self.iteration), self.hparams.old_decay_ramp,
                                                                   self.hparams.old_decay_max))

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        h, gen = self.hparams, self.generator
        prompts, index, group = list(batch["prompts"]), batch["index"].cpu(), batch["group"].cpu()
        it, old = int(self.iteration), (lambda: self.roles.swap(gen, "old_policy"))
        selection = None
        if self.preview is not None:  # Sol-RL: preview the pool in low precision, regenerate the kept rows
            prompts, index, group, selection = select_batch(self, prompts, index, group, self.rollout_config, it, old)
        n = len(prompts)
        ro = collect_endpoints(gen, prompts, self.latent_shape, h.seed, index, self.rollout_config, it, policy=old)
        scores = score(self, self.scorer, ro, group, iteration=it)
        log_proxy_fidelity(self, selection, scores.result.total, scores.result.valid)
        adv = group_advantages_of(self, scores, std=h.advantage_std, eps=h.advantage_eps, min_group_size=2,
                                  iteration=it)
        reward_spread(self, scores, gather_batch(self, adv), it)
        # failed rewards: advantage 0 (a row at its group's baseline), never dropped, so every rank runs the same
        # backward passes and optimizer steps whatever its validity mask
        self.log("train/zero_advantage_invalid", float((~scores.result.valid).sum()), batch_size=n)
        x0, mb, per_update = ro.samples, h.micro_batch_size or n, h.num_draws // h.updates_per_iteration
        cond_all = gen.encode_prompts(prompts)
        chunks = micro_batches(n, mb)

        def unit(draw: int, c: torch.Tensor):
            loss, stats = self.unit_loss(x0[c.to(x0.device)], adv[c], cond_all.select(c.tolist()), index[c], it, draw)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"iteration {it}, draw {draw}: the {h.objective} loss is {float(loss)}; lower "
                                         f"the learning rate or the multiplier")
            logged = {k: float(v) for k, v in {"train/loss": loss.detach(), **stats}.items()}
            return loss * len(c) / (n * per_update), logged, 1

        plan = [[lambda k=k, c=c: unit(k, c) for k in range(u * per_update, (u + 1) * per_update) for c in chunks]
                for u in range(h.updates_per_iteration)]
        sums = optimizer_steps(self, self.optimizers(), plan, h.max_grad_norm)
        self.log_dict(sums, batch_size=n)
        if "monitor/fm_mse_old" in sums:  # self-consistency: v_old's FM error on its own endpoints vs at the start
            fm_old = sums["monitor/fm_mse_old"]
            if torch.isnan(self.initial_self_consistency):
                self.initial_self_consistency.fill_(fm_old)
            self.log("monitor/self_consistency", fm_old - float(self.initial_self_consistency), batch_size=n)
        self.log("train/old_decay", self.update_old_policy(), batch_size=n)
        advance_iteration(self, n)

    validation_step = flat_validation_step
