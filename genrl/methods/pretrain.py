"""Flow-matching pretraining (and supervised fine-tuning) of a text-to-video generator.

Loss: rectified-flow / flow-matching regression of the velocity ``v = eps - x0`` at
``x_sigma = (1 - sigma) x0 + sigma eps`` (Lipman et al. 2023; Liu et al. 2023; SD3, Esser et al. 2024,
eq. 1-3 with logit-normal sigma sampling, sec. 3.1). With ``diffusion_forcing="independent"`` every temporal
patch gets its own sigma (Diffusion Forcing, Chen et al. 2024, Algorithm 1; DFoT, Song et al. 2025, eq. 4); with
``"history"`` a random history prefix gets independent sigmas and the rest one shared sigma (DFoT App. A.5). Both
train the model that history-conditioned sampling and history guidance (`genrl.rollout.history_rollout`,
`genrl.flow.HistoryGuidance`) need; the draws are `genrl.flow.diffusion_forcing_sigmas`.

Every random draw of a training step (noise, sigma, caption dropout) is addressed by (seed, sample
index, stream) through :mod:`genrl.noise`, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow import DIFFUSION_FORCING_MODES, TimestepSampler, add_noise, diffusion_forcing_sigmas, flow_matching_loss
from genrl.methods.common import (
    Scorer,
    build_policy,
    linear_warmup,
    log_validation_rewards,
    policy_optimizer,
    policy_spec,
    trainer_of,
)
from genrl.methods.phases import caption_dropout, video_batch
from genrl.models.families import GeneratorSpec
from genrl.models.generator import DiTGenerator
from genrl.models.lora import LoraSpec
from genrl.models.roles import Roles
from genrl.noise import randn_per_sample, sample_generator, stream_id
from genrl.rollout.ode import sample_ode

__all__ = ["FlowMatchingPretrain"]

# random streams of one training sample (see genrl.noise)
_STREAM_NOISE, _STREAM_SIGMA, _STREAM_DROPOUT = (stream_id("pretrain.noise"), stream_id("pretrain.sigma"),
                                                stream_id("pretrain.dropout"))


class FlowMatchingPretrain(LightningModule):
    """Pretrain a generator by flow matching on (video, caption) batches.

    Batches are dicts ``{"pixels": float [B, T, C, H, W] in [0, 1], "prompts": list[str],
    "index": int64 [B]}`` (``index`` addresses the sample's randomness; without it, the global sample
    counter is used). Validation batches are sampled with the deterministic ODE sampler and CFG, scored by
    the configured rewards, and returned as ``{"videos", "prompts"}`` for :class:`~genrl.callbacks.VideoLogger`.

    Args:
        generator: the generator to train (:class:`~genrl.models.families.GeneratorSpec`; default genrl's DiT with
            its default config and random weights, ``family: dit, components: {transformer: {}}``); for the DiT,
            ``text_encoder`` (a local transformers encoder folder or ``"minilm"``, the bundled MiniLM-L6) and
            ``max_sequence_length`` (tokens per prompt, default 32).
        optimizer: optimizer factory (LightningCLI ``OptimizerCallable``); default AdamW(lr=1e-3).
        warmup_steps: linear learning-rate warm-up, in optimizer steps.
        timestep_sampler: training sigma distribution (default logit-normal(0, 1), SD3 sec. 3.1).
        loss_weighting: ``"none"``, ``"sigma_sqrt"`` or ``"cosmap"`` (SD3 sec. 3.1).
        caption_dropout: probability of training a sample with the null prompt ``""`` (enables CFG).
        diffusion_forcing: per-frame noise levels (Diffusion Forcing / DFoT): ``"none"`` (or False, one sigma per
            sample), ``"independent"`` (or True, an i.i.d. sigma per temporal patch) or ``"history"`` (per sample
            a history length h drawn uniformly from ``history_frames``; the patches of the first h frames get
            i.i.d. sigmas, all later frames share one). Every frame is in the loss. Frames are the generator's
            ``frame_dim`` axis (1 for genrl's DiT, 2 for Wan's latent frames); frames of one temporal patch share
            a sigma.
        history_frames: ``diffusion_forcing="history"`` only: the allowed history lengths in (latent) frames, each
            a multiple of the temporal patch: an int (the largest; 0, p, ..., history_frames), a list, or None
            (0 .. T - p). See `genrl.flow.diffusion_forcing_sigmas`.
        history_sigma_max: ``diffusion_forcing="history"`` only: the history prefix's levels are the marginal's
            draws scaled into [0, history_sigma_max] (a float in [0, 1]; default 1.0, unscaled): a clean or lightly
            noised history, as sampling gives it (clean history at 0, generated history at the stabilization
            level); 0.0 = always clean.
        lora: a LoRA adapter (`genrl.models.lora.LoraSpec` fields) to train instead of the full transformer
            (fine-tuning a large model, e.g. Wan2.1-1.3B, into a diffusion-forcing model).
        attention: ``"bidirectional"`` or ``"block_causal"`` (needs ``causal_chunk_size`` in the transformer).
        seed: seed of all training randomness.
        sample_steps / sample_shift / cfg_scale: validation sampler (Euler steps, sigma shift, CFG scale w).
        val_rewards: rewards scored on validation samples, as ``{"name": ..., "path": ..., **kwargs}`` dicts
            for :func:`genrl.rewards.build_reward` (e.g. ``[{"name": "shapes"}]``).
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        warmup_steps: int = 200,
        timestep_sampler: TimestepSampler | None = None,
        loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none",
        caption_dropout: float = 0.1,
        diffusion_forcing: bool | Literal["none", "independent", "history"] = False,
        history_frames: int | list[int] | None = None,
        history_sigma_max: float = 1.0,
        lora: LoraSpec | None = None,
        attention: Literal["bidirectional", "block_causal"] = "bidirectional",
        seed: int = 0,
        sample_steps: int = 20,
        sample_shift: float = 1.0,
        cfg_scale: float = 3.0,
        val_rewards: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        if not 0.0 <= caption_dropout < 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1), got {caption_dropout}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        modes = ("none", *DIFFUSION_FORCING_MODES)
        if not isinstance(diffusion_forcing, bool) and diffusion_forcing not in modes:
            raise ValueError(f"diffusion_forcing must be true / false or one of {modes}, got {diffusion_forcing!r}")
        #: "none", "independent" or "history"
        self.df_mode = {False: "none", True: "independent"}.get(diffusion_forcing, diffusion_forcing) \
            if isinstance(diffusion_forcing, bool) else diffusion_forcing
        if history_frames is not None and self.df_mode != "history":
            raise ValueError(
                f"history_frames={history_frames!r} applies to diffusion_forcing: history only (got "
                f"diffusion_forcing={diffusion_forcing!r}); set diffusion_forcing: history or drop history_frames"
            )
        if not 0.0 <= float(history_sigma_max) <= 1.0:
            raise ValueError(f"history_sigma_max must be in [0, 1] (a noise level), got {history_sigma_max!r}")
        if float(history_sigma_max) != 1.0 and self.df_mode != "history":
            raise ValueError(
                f"history_sigma_max={history_sigma_max!r} applies to diffusion_forcing: history only (got "
                f"diffusion_forcing={diffusion_forcing!r}); set diffusion_forcing: history or drop history_sigma_max"
            )
        self.save_hyperparameters(ignore=["optimizer"])
        self.generator_spec = policy_spec(self, generator, default=GeneratorSpec(components={"transformer": {}}))
        self.optimizer_factory = optimizer
        self.timestep_sampler = timestep_sampler or TimestepSampler()
        self.generator: DiTGenerator | None = None
        self.scorer = Scorer(val_rewards) if val_rewards else None  # validation rewards, as every method
        self.roles = Roles(self)  # one trainable network, visible to the strategies (DDP, FSDP2)

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        """Build the transformer and load the text encoder (heavy work happens here, not in __init__)."""
        if self.generator is not None:
            return
        self.generator = self.roles.trainable("generator", build_policy(self.generator_spec, self.hparams.lora))
        if self.scorer is not None:
            self.scorer.build(trainer_of(self))

    def configure_optimizers(self):
        return linear_warmup(policy_optimizer(self.generator, self.optimizer_factory), self.hparams.warmup_steps)

    # ------------------------------------------------------------------ training
    @property
    def frame_dim(self) -> int:
        """The frame axis of the generator's latents (1: [B, T, C, H, W]; 2: Wan's [B, C, F, h, w])."""
        return int(getattr(self.generator, "frame_dim", 1))

    def _sample_sigma(self, indices: torch.Tensor, frames: int) -> torch.Tensor:
        """Training sigma: [B] (one per sample) or per frame [B, T] under diffusion forcing, each sample's draw
        addressed by (seed, index) so it does not depend on the batch it sits in."""
        seed = self.hparams.seed
        if self.df_mode == "none":
            return torch.stack(
                [self.timestep_sampler(1, sample_generator(seed, int(i), 0, _STREAM_SIGMA)) for i in indices]
            )[:, 0]
        cfg = getattr(self.generator.transformer, "config", None)
        pt = int(cfg.patch_size[0]) if cfg is not None and hasattr(cfg, "patch_size") else 1
        history = self.hparams.history_frames if self.df_mode == "history" else None
        hmax = float(self.hparams.get("history_sigma_max", 1.0)) if self.df_mode == "history" else 1.0
        return torch.cat([
            diffusion_forcing_sigmas(1, frames, generator=sample_generator(seed, int(i), 0, _STREAM_SIGMA),
                                     mode=self.df_mode, history=history, frame_group=pt,
                                     sampler=self.timestep_sampler, history_sigma_max=hmax)
            for i in indices
        ])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x0, prompts, idx = video_batch(self, batch)
        eps = randn_per_sample(x0.shape[1:], self.hparams.seed, idx, stream=_STREAM_NOISE, device=x0.device)
        fd = self.frame_dim
        sigma = self._sample_sigma(idx, x0.shape[fd]).to(x0.device)
        prompts = caption_dropout(prompts, self.hparams.caption_dropout, self.hparams.seed, idx, _STREAM_DROPOUT)
        cond = self.generator.encode_prompts(prompts)
        x = add_noise(x0, eps, sigma, frame_dim=fd)
        v = self.generator.velocity(x, sigma, cond, attention=self.hparams.attention)
        loss = flow_matching_loss(v, x0, eps, sigma, weighting=self.hparams.loss_weighting, frame_dim=fd).mean()
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite flow-matching loss {loss.item()} at step {self.global_step}; lower the learning "
                f"rate or enable gradient clipping (trainer.gradient_clip_val)"
            )
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"] if trainer_of(self) else math.nan)
        return loss

    # ------------------------------------------------------------------ validation / prediction
    def generate(self, prompts: list[str], latent_shape, indices=None, progress: bool = False) -> torch.Tensor:
        """Sample videos [B, T, C, H, W] in [0, 1] for prompts with the configured validation sampler."""
        latents = sample_ode(
            self.generator,
            prompts,
            latent_shape,
            seed=self.hparams.seed,
            indices=indices,
            num_steps=self.hparams.sample_steps,
            shift=self.hparams.sample_shift,
            cfg_scale=self.hparams.cfg_scale,
            progress=progress,
        )
        return self.generator.decode(latents)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        latent_shape = self.generator.encode(batch["pixels"][:1]).shape[1:]
        videos = self.generate(prompts, latent_shape, indices=batch.get("index"))
        if self.scorer is not None:
            log_validation_rewards(self, self.scorer, videos, prompts)
        return {"videos": videos, "prompts": prompts}

    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        latent_shape = self.generator.encode(batch["pixels"][:1]).shape[1:]
        return {"videos": self.generate(prompts, latent_shape, indices=batch.get("index")), "prompts": prompts}
