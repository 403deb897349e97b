"""ODE initialisation of a causal, chunk-wise few-step student (CausVid sec. 4.3; Self-Forcing's ``ode_init``).

The first stage before DMD / Self-Forcing. A bidirectional teacher's deterministic ODE trajectories are stored
at the student's S noise levels s_0 = 1 > ... > s_{S-1} > 0 plus their clean endpoint x0
(``pipelines/ode_pairs.py``; :mod:`genrl.data.ode_pairs`). The student, initialised from the teacher's weights
and made block-causal (chunks attend to themselves and to earlier chunks), learns to map any stored state
straight to the endpoint:

- for each chunk k of each sample draw a state index i_k in {0..S-1} (CausVid ``_get_timestep`` with
  ``uniform_timestep=False``: constant inside a chunk, independent across chunks); with ``draw_clean_state`` the
  clean state S (sigma 0, CausVid's t = 0 entry) is a choice too, giving later chunks clean context;
- the input x [B, T, ...] takes chunk k's frames from state i_k, with per-frame sigma [B, T] = s_{i_k};
- one full-sequence block-causal forward (no KV cache): v = G(x, sigma, c), x0_hat = x - sigma v;
- loss = mean over the elements of frames with sigma != 0 of (x0_hat - x0)^2
  (:func:`genrl.flow.ode_regression_loss`; CausVid / Self-Forcing ``model/ode_regression.py``).

Every random draw is addressed by (seed, sample id, global step) through :mod:`genrl.noise`, so a run
resumed with ``--ckpt_path last`` repeats an uninterrupted one. Validation samples the student chunk by chunk
with its KV cache (:func:`genrl.rollout.autoregressive.ar_rollout`, the few-step consistency sampler), decodes,
scores with the configured rewards and returns ``{"videos", "prompts"}`` for
:class:`~genrl.callbacks.VideoLogger`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.data.ode_pairs import (
    check_pair_sigmas,
    chunk_states_to_frames,
    draw_chunk_states,
    regression_inputs,
    select_states,
)
from genrl.flow import ode_regression_loss, x0_from_velocity
from genrl.methods.common import (
    Scorer,
    build_policy,
    frame_shape_of,
    linear_warmup,
    log_validation_rewards,
    policy_optimizer,
    policy_spec,
    trainer_of,
)
from genrl.methods.distill import causal_samples, configure_student
from genrl.models.causal import CausalConfig
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import Roles
from genrl.rollout.autoregressive import ChunkSchedule

__all__ = ["ODEInit", "draw_chunk_states", "chunk_states_to_frames", "select_states", "shapes_schedule"]

def shapes_schedule() -> ChunkSchedule:
    """The shapes world's student: chunks of 2 latent frames (the DiT's temporal patch), the list
    [1000, 750, 500, 250] at shift 1 (sigmas [1, 0.75, 0.5, 0.25]), consistency re-noise, clean context."""
    return ChunkSchedule(causal=CausalConfig(chunk_size=2), timesteps=[1000.0, 750.0, 500.0, 250.0], shift=1.0)


class ODEInit(LightningModule):
    """ODE-trajectory regression of a causal few-step student onto a bidirectional teacher (CausVid sec. 4.3).

    Training batches come from :class:`genrl.data.ODEPairsDataModule`: ``{"prompts": list[str], "index": int64
    [B], "position": int64 [B] (optional), "ode_latents": float [B, S + 1, *latent], "ode_sigmas": [S + 1]}``.
    Validation batches are prompt batches (``{"prompts", "index"}``, negative ids), sampled with the student's
    chunk-wise few-step rollout and scored by ``rewards``.

    Args:
        generator: the student (:class:`~genrl.models.families.GeneratorSpec`): genrl's DiT (``family: dit``,
            default ``pretrained: assets/shapes-dit``: the student starts from the bidirectional teacher's weights)
            or a causal diffusers adapter (``init_cache`` / ``velocity_chunk`` / ``commit``, e.g. ``wan_causal``).
        schedule: the student's :class:`ChunkSchedule` (chunk layout, few-step list, sampler); the generator is
            made causal with ``generator.causal = schedule.causal``. Default: :func:`shapes_schedule`. The pairs
            file must hold states at exactly ``schedule.sigmas()``.
        draw_clean_state: also draw the clean state (sigma 0) for a chunk, as CausVid's t = 0 list entry; such
            chunks are clean context for later chunks and excluded from the loss.
        lora: train a LoRA adapter instead of all weights (:class:`~genrl.models.lora.LoraSpec`).
        optimizer: optimizer factory (default AdamW, lr 2e-6, betas (0.9, 0.999), weight decay 0.01: CausVid's
            Wan ODE stage); gradient clipping is the trainer's ``gradient_clip_val``.
        warmup_steps: linear learning-rate warm-up in optimizer steps (0 = none).
        rewards: validation reward specs (default ``[{"name": "shapes"}]``, the shapes verifier).
        reward_combine: how several rewards combine (see :class:`genrl.rewards.RewardManager`).
        latent_shape: per-sample latent shape of validation samples (default: the pairs file's, else the
            generator's ``latent_shape``).
        val_num_chunks: chunks per validation video (default: the whole latent length).
        seed: seed of all randomness.
    Raises:
        ValueError: ``warmup_steps < 0``, ``val_num_chunks < 1``.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        schedule: ChunkSchedule | None = None,
        draw_clean_state: bool = False,
        lora: LoraSpec | None = None,
        optimizer: OptimizerCallable | None = None,
        warmup_steps: int = 0,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum", "advantage_sum"] = "weighted_sum",
        latent_shape: list[int] | None = None,
        val_num_chunks: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if val_num_chunks is not None and val_num_chunks < 1:
            raise ValueError(f"val_num_chunks must be >= 1 or null, got {val_num_chunks}")
        self.save_hyperparameters(ignore=["optimizer"])
        if isinstance(schedule, dict):  # plain values (e.g. a checkpoint's hyper-parameters)
            schedule = ChunkSchedule(**schedule)
        self.generator_spec = policy_spec(self, generator)
        self.schedule = schedule or shapes_schedule()
        self.hparams["schedule"] = asdict(self.schedule)
        self.optimizer_factory = optimizer
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.generator = None
        self.scorer = Scorer(rewards, reward_combine)
        self.roles = Roles(self)

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        """Build the student from the teacher's weights and make it block-causal
        (:func:`~genrl.methods.distill.configure_student`; a missing interface or chunks off the temporal patch raise
        ValueError)."""
        configure_student(self, build=build_policy)

    def configure_optimizers(self):
        """The optimizer over the trainable student parameters (all, or the LoRA adapter), with the optional
        linear warm-up (stepped per optimizer step)."""
        factory = self.optimizer_factory or (
            lambda params: torch.optim.AdamW(params, lr=2e-6, betas=(0.9, 0.999), weight_decay=0.01))
        opt = policy_optimizer(self.generator, factory)
        return linear_warmup(opt, self.hparams.warmup_steps) if self.hparams.warmup_steps else opt

    # ------------------------------------------------------------------ helpers
    @property
    def frame_dim(self) -> int:
        """Frame axis of the generator's latents (1: [B, T, C, H, W]; 2: Wan's [B, C, T, H, W])."""
        return int(getattr(self.generator, "frame_dim", 1))

    def resolve_latent_shape(self) -> tuple[int, ...]:
        """Latent shape of validation samples: ``latent_shape``, else the datamodule's pairs file, else the
        generator's ``latent_shape``.

        Raises:
            ValueError: none of them is available.
        """
        if self.latent_shape is not None:
            return tuple(self.latent_shape)
        dm = getattr(trainer_of(self), "datamodule", None)
        shape = getattr(dm, "latent_shape", None) if dm is not None else None
        shape = shape or getattr(self.generator, "latent_shape", None)
        if shape is None:
            raise ValueError("ODEInit cannot tell the latent shape of validation samples; set "
                             "model.init_args.latent_shape (e.g. [8, 3, 16, 16] for the shapes DiT)")
        self.latent_shape = tuple(int(d) for d in shape)
        return self.latent_shape

    # ------------------------------------------------------------------ training
    def regression_loss(self, batch: dict, step: int | None = None) -> dict[str, torch.Tensor]:
        """The ODE regression loss of one batch (CausVid sec. 4.3; see the module docstring).

        Args:
            batch: ``{"prompts", "index" | "position", "ode_latents" [B, S + 1, *latent], "ode_sigmas" [S + 1]}``.
            step: addresses the per-chunk draws (default: the trainer's global step).
        Returns:
            ``{"loss": 0-d float32 with grad, "x0_pred": [B, *latent], "x0_target": [B, *latent],
            "sigma": float32 [B, T], "chunk_states": int64 [B, K]}``.
        Raises:
            ValueError: a malformed batch, stored sigmas that are not the schedule's, or frames off a chunk
                boundary (each names the values).
        """
        lat, sig = batch["ode_latents"], batch["ode_sigmas"]
        if not isinstance(lat, torch.Tensor) or lat.ndim < 4:
            raise ValueError(f"batch['ode_latents'] must be [B, S + 1, *latent], got {getattr(lat, 'shape', lat)}")
        if sig.ndim == 2:  # a default-collated [B, S + 1]: every row is the file's
            sig = sig[0]
        check_pair_sigmas(sig, self.schedule)
        prompts = list(batch["prompts"])
        b = lat.shape[0]
        if len(prompts) != b:
            raise ValueError(f"{len(prompts)} prompts for {b} trajectories")
        ids = batch.get("position", batch.get("index"))
        if ids is None:
            raise ValueError("the batch needs 'index' (or 'position') to address the per-chunk draws")
        step = self.global_step if step is None else int(step)
        fd = self.frame_dim
        x, sigma, target, chunk_states = regression_inputs(lat, sig, self.hparams.seed, ids, step,
                                                           self.schedule.causal, self.hparams.draw_clean_state, fd)
        cond = self.generator.encode_prompts(prompts)
        v = self.generator.velocity(x, sigma, cond)
        x0 = x0_from_velocity(x, sigma, v, frame_dim=fd)
        mask = sigma != 0
        if bool(mask.any()):
            loss = ode_regression_loss(x0, target, mask, fd)
        else:  # every chunk drew the clean state: nothing to regress this step
            loss = (x0 * 0.0).sum()
        return {"loss": loss, "x0_pred": x0, "x0_target": target, "sigma": sigma, "chunk_states": chunk_states}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """One ODE-regression step (:meth:`regression_loss` at the global step); logs ``train/loss``.

        Raises:
            FloatingPointError: a non-finite loss (the message suggests the fix).
        """
        out = self.regression_loss(batch)
        loss = out["loss"]
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite ODE regression loss {loss.item()} at step {self.global_step}; "
                                     f"lower the learning rate or set trainer.gradient_clip_val")
        bs = len(batch["prompts"])
        self.log("train/loss", loss, prog_bar=True, batch_size=bs)
        self.log("train/noisy_frame_fraction", (out["sigma"] != 0).float().mean(), batch_size=bs)
        if trainer_of(self) is not None and self.trainer.optimizers:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=bs)
        return loss

    # ------------------------------------------------------------------ sampling / validation
    @torch.no_grad()
    def generate(self, prompts: list[str], indices: Sequence[int] | torch.Tensor | None = None,
                 num_chunks: int | None = None) -> torch.Tensor:
        """Sample latents chunk by chunk with the student's KV cache and few-step schedule (:func:`ar_rollout`).

        Args:
            prompts: B prompts; indices: B noise addresses (default 0..B-1); num_chunks: chunks per video
                (default ``val_num_chunks``, else the whole latent length).
        Returns:
            latents [B, *latent] (generator layout; ``num_chunks`` chunks of frames).
        """
        shape = self.resolve_latent_shape()
        fd = self.frame_dim
        frame_shape = frame_shape_of(self.generator, shape)
        k = num_chunks or self.hparams.val_num_chunks or self.schedule.causal.num_chunks(shape[fd - 1])
        return causal_samples(self.generator, prompts, indices, self.schedule, k, frame_shape, self.hparams.seed)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        """Sample the validation prompts causally (:meth:`generate`), decode to pixels [B, T, C, H, W] in [0, 1],
        log ``val/<reward>/<key>`` and ``val/total``, and return ``{"videos", "prompts"}`` for the VideoLogger."""
        prompts = list(batch["prompts"])
        latents = self.generate(prompts, batch.get("index"))
        videos = self.generator.decode(latents)
        return log_validation_rewards(self, self.scorer, videos, prompts)

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        """``{"videos": pixels [B, T, C, H, W] in [0, 1], "prompts"}`` of the batch's prompts (causal sampling)."""
        prompts = list(batch["prompts"])
        latents = self.generate(prompts, batch.get("index"))
        return {"videos": self.generator.decode(latents), "prompts": prompts}
