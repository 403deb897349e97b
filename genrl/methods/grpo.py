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

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.policy import clipped_policy_loss, gaussian_kl, group_advantages, group_stats, velocity_kl
from genrl.methods.common import (build_policy, ensure_reward_manager, gather_batch, log_validation_rewards,
                                  policy_optimizer,
                                  reference_weights, restore_reward_state, save_reward_state, stash_reward_state)
from genrl.models.families import GeneratorSpec
from genrl.models.generator import DiTGenerator
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import MINILM
from genrl.rollout.noise import mix_seed
from genrl.rollout.sampler import RolloutConfig, guided_velocity, rollout, transition_log_prob

__all__ = ["GRPO", "LoraSpec"]


@dataclass
class LoraSpec:
    """LoRA adapter on the policy (peft; Hu et al. 2022). Flow-GRPO SD3.5: r 32, alpha 64, gaussian init.

    Attributes:
        rank, alpha: LoRA rank r and scale alpha (update = alpha / r * B A).
        target_modules: module names to adapt (None: the attention projections of the generator's family,
            e.g. ``to_q, to_k, to_v, to_out.0`` for Wan; genrl's DiT: ``to_q, to_k, to_v, to_out``).
        init_lora_weights: peft init (``"gaussian"`` or True for Kaiming-A / zero-B).
    """

    rank: int = 8
    alpha: float = 16.0
    target_modules: list[str] | None = None
    init_lora_weights: str | bool = "gaussian"

    def add_to(self, generator) -> None:
        """Add this adapter to ``generator.transformer`` (peft); the adapter weights are kept in float32
        whatever the base weights' dtype (diffusers' cast_training_params practice)."""
        from peft import LoraConfig

        targets = self.target_modules or list(getattr(generator, "lora_target_modules", DIT_LORA_TARGETS))
        generator.transformer.add_adapter(
            LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(targets),
                       init_lora_weights=self.init_lora_weights)
        )
        for p in generator.transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()


#: LoRA targets of genrl's own DiT.
DIT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out"]


class GRPO(LightningModule):
    """Flow-GRPO / DanceGRPO on any Generator, with group advantages and a clipped policy loss.

    Training batches are prompt batches from :class:`genrl.data.PromptDataModule`:
    ``{"prompts": list[str] (P*K, each prompt K times in a row), "index": int64 [P*K] global sample ids,
    "group": int64 [P*K] global group ids}``. Validation batches (same format) are sampled with the
    deterministic ODE and scored by the same rewards.

    Args:
        transformer: the policy network when it is genrl's DiT (:class:`ModelSpec`, normally
            ``pretrained: assets/shapes-dit``).
        text_encoder / max_text_length: the DiT's prompt encoder (local folder or ``"minilm"``).
        generator: a diffusers family instead of the DiT (:class:`genrl.models.families.GeneratorSpec`:
            Wan2.1, SD3.5, FLUX.1, SANA from a local folder or config values); excludes ``transformer``.
        latent_shape: per-sample latent shape of the rollouts (default: the generator's, or (8, 3, 16, 16)
            for the DiT).
        rollout: the rollout sampler config (kernel, noise level, steps, CFG, which steps are SDE).
        rewards: reward specs (``{"name": "shapes", "weight": 1.0, ...}``; see :class:`genrl.rewards.RewardSpec`).
        reward_combine: ``"weighted_sum"``, ``"zscore_sum"`` or ``"advantage_sum"`` (per-reward advantages).
        advantage_std: ``"group"`` (per-prompt std), ``"global"`` (std of the whole gathered batch) or ``"none"``.
        advantage_eps: epsilon added to the std (Flow-GRPO 1e-4).
        adv_clip_max: advantages are clipped to [-A_max, A_max] (5 in all reference code).
        clip_range / clip_range_high: PPO ratio clip epsilon (low / high; high defaults to low).
        kl_beta: weight of the KL to the reference policy (0 disables it and the reference).
        kl_kind: ``"velocity_mse"`` (mean (v - v_ref)^2) or ``"gaussian"`` (closed-form per-step KL).
        lora: train a LoRA adapter instead of all weights; the reference is then the adapter-disabled model.
        optimizer: optimizer factory (default AdamW(lr=1e-3)).
        max_grad_norm: gradient-norm clip per optimizer step (0 disables).
        inner_epochs: passes over each rollout batch.
        mini_batch_size: samples per optimizer step (None = the whole local rollout batch).
        eval_rollout: sampler for validation (default: ODE, 20 steps, the rollout's CFG).
        seed: seed of all randomness.
    """

    def __init__(
        self,
        transformer: ModelSpec | None = None,
        text_encoder: str = MINILM,
        max_text_length: int = 32,
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
        kl_beta: float = 0.0,
        kl_kind: Literal["velocity_mse", "gaussian"] = "velocity_mse",
        lora: LoraSpec | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        inner_epochs: int = 1,
        mini_batch_size: int | None = None,
        eval_rollout: RolloutConfig | None = None,
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
        if generator is not None and transformer is not None:
            raise ValueError("give either transformer (genrl's DiT) or generator (a diffusers family), not both")
        self.save_hyperparameters(ignore=["optimizer"])
        self.generator_spec = generator
        self.automatic_optimization = False
        self.transformer_spec = transformer or ModelSpec()
        self.rollout_config = rollout or RolloutConfig()
        self.eval_config = eval_rollout or RolloutConfig(
            kernel="ode", num_steps=20, shift=self.rollout_config.shift, cfg_scale=self.rollout_config.cfg_scale,
            micro_batch_size=self.rollout_config.micro_batch_size,
        )
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer
        self.generator: DiTGenerator | None = None
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))
        self._reward_specs = rewards if rewards is not None else [{"name": "shapes"}]
        if not self._reward_specs:
            raise ValueError("GRPO needs at least one reward; e.g. rewards: [{name: shapes}]")
        self.rewards = None  # RewardManager, built in setup (not a child module: not checkpointed)

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        if self.generator is not None:
            return
        generator = build_policy(self.generator_spec, self.transformer_spec, self.hparams.text_encoder,
                                 self.hparams.max_text_length, self.hparams.lora)
        if self.latent_shape is None:
            self.latent_shape = tuple(getattr(generator, "latent_shape", (8, 3, 16, 16)))
        reference = None
        if self.hparams.lora is None and self.hparams.kl_beta > 0:
            reference = copy.deepcopy(generator.transformer).requires_grad_(False).eval()
        self.generator = generator
        object.__setattr__(self, "_reference", reference)  # frozen copy, never checkpointed

    def setup(self, stage: str) -> None:
        self.configure_model()
        ensure_reward_manager(self)

    def configure_optimizers(self):
        return policy_optimizer(self.generator, self.optimizer_factory)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_reward_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        stash_reward_state(self, checkpoint)

    # ------------------------------------------------------------------ helpers
    def _reference_velocity(self, x, sigma, cond, uncond, cfg):
        mb = self.rollout_config.micro_batch_size
        with torch.no_grad(), reference_weights(self.generator, self._reference, self.hparams.lora) as gen:
            return guided_velocity(gen, x, sigma, cond, uncond, cfg, mb)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return gather_batch(self, t)

    def _score(self, pixels: torch.Tensor, prompts: list[str]):
        result = self.rewards(pixels.float().cpu(), prompts)
        return result

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        restore_reward_state(self)
        prompts, index, group = list(batch["prompts"]), batch["index"].cpu(), batch["group"].cpu()
        cfg = self.rollout_config
        it = int(self.iteration)
        seed = self.hparams.seed
        gen = self.generator

        # 1. rollouts (no grad) and rewards
        was_training = gen.training
        gen.eval()
        traj = rollout(gen, prompts, self.latent_shape, seed, index, cfg, rollout_id=it)
        result = self._score(gen.decode(traj.final), prompts)
        gen.train(was_training)

        # 2. advantages over the gathered batch (groups may span ranks)
        total, valid = result.total, result.valid
        all_total, all_group, all_valid = self._gather(total), self._gather(group), self._gather(valid)
        if self.hparams.reward_combine == "advantage_sum":
            adv_all = self.rewards.per_reward_advantages(
                self._gather_result(result), all_group, std=self.hparams.advantage_std, eps=self.hparams.advantage_eps
            )
        else:
            adv_all = group_advantages(all_total, all_group, std=self.hparams.advantage_std,
                                       eps=self.hparams.advantage_eps, valid=all_valid)
        rank, n = (self.trainer.global_rank if self._trainer else 0), len(prompts)
        adv = adv_all[rank * n : (rank + 1) * n]
        bs = len(prompts)
        for key, value in result.metrics().items():
            if key not in ("total", "invalid_fraction"):
                self.log(f"reward/{key}", float(value), batch_size=bs)
        for key, value in group_stats(all_total, all_group, valid=all_valid).items():
            self.log(f"advantage/{key}", float(value), batch_size=bs)
        self.log("reward/total", float(all_total[all_valid].mean()) if all_valid.any() else math.nan,
                 prog_bar=True, batch_size=bs)
        self.log("reward/invalid_fraction", float((~all_valid).float().mean()), batch_size=bs)
        if not all_valid.any():
            raise RuntimeError(
                f"iteration {it}: every reward of the batch is invalid (NaN); the reward model is failing "
                f"(see the reward/*/errors and nan_rewards metrics and the logged warnings); fix it or drop it "
                f"from model.init_args.rewards"
            )

        # 3. policy update on the stochastic steps
        opt = self.optimizers()
        steps = traj.sde_steps
        if not steps:
            raise ValueError("the rollout has no stochastic step to train; check rollout.kernel / sde_steps")
        mb = self.hparams.mini_batch_size or n
        if n % mb:
            raise ValueError(
                f"mini_batch_size {mb} does not divide the local batch of {n} samples (prompts_per_batch x "
                f"group_size / devices); pick a divisor of {n}"
            )
        rows_all = torch.arange(n)  # invalid samples have advantage exactly 0: no gradient, same steps on every rank
        stats_sum: dict[str, float] = {}
        count = 0
        for epoch in range(self.hparams.inner_epochs):
            perm_gen = torch.Generator().manual_seed(mix_seed(seed, it, epoch, 11))
            order = rows_all[torch.randperm(len(rows_all), generator=perm_gen)] if self.hparams.inner_epochs > 1 else rows_all
            for start in range(0, len(order), mb):
                rows = order[start : start + mb]
                sub = traj.select(rows)
                cond = gen.encode_prompts(sub.prompts)
                uncond = gen.encode_prompts([cfg.null_prompt] * len(rows)) if cfg.cfg_scale != 1.0 else None
                opt.zero_grad()
                for k in steps:
                    log_prob, v, mean = transition_log_prob(gen, sub, k, cond, uncond)
                    old = sub.log_probs[:, k].to(log_prob.device)
                    loss_vec, stats = clipped_policy_loss(
                        log_prob, old, adv[rows].to(log_prob.device), clip_range=self.hparams.clip_range,
                        clip_range_high=self.hparams.clip_range_high, adv_clip_max=self.hparams.adv_clip_max,
                    )
                    loss = loss_vec.mean()
                    if self.hparams.kl_beta > 0:
                        x = sub.latents[:, k].to(v.device)
                        sig = sub.sigmas.to(v.device, torch.float32)
                        v_ref = self._reference_velocity(x, sig[k].expand(len(rows)), cond, uncond, cfg.cfg_scale)
                        if self.hparams.kl_kind == "velocity_mse":
                            kl = velocity_kl(v, v_ref)
                        else:
                            from genrl.flow.sde import step_mean_std

                            mean_ref, std = step_mean_std(cfg.kernel, x, v_ref, sig[k], sig[k + 1], cfg.noise_level,
                                                          sigma_at_one=float(sub.sigmas[1]))
                            kl = gaussian_kl(mean, mean_ref, std)
                        loss = loss + self.hparams.kl_beta * kl.mean()
                        stats["kl"] = kl.mean().detach()
                    self.manual_backward(loss / len(steps))
                    stats["loss"] = loss.detach()
                    for key, value in stats.items():
                        stats_sum[key] = stats_sum.get(key, 0.0) + float(value)
                    count += 1
                if self.hparams.max_grad_norm > 0:
                    self.clip_gradients(opt, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
                opt.step()
        for key, value in stats_sum.items():
            self.log(f"train/{key}", value / max(count, 1), batch_size=bs)
        self.iteration += 1
        self.log("train/iteration", float(self.iteration), batch_size=bs)

    def _gather_result(self, result):
        """The reward result of the whole global batch (every [B] tensor all-gathered across ranks)."""
        return result.map_tensors(self._gather)

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        traj = rollout(self.generator, prompts, self.latent_shape, self.hparams.seed, batch["index"].cpu(),
                       self.eval_config, record=False)
        videos = self.generator.decode(traj.final)
        log_validation_rewards(self, videos, prompts)
        return {"videos": videos, "prompts": prompts}
