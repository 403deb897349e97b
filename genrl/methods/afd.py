"""AFD: adversarial flow distillation of a causal student from a black-box teacher's finished videos.

Only the teacher's videos for the training prompts are used (an mp4 folder, :class:`genrl.data.TeacherVideoDataModule`):
no teacher scores, latents or step alignment. The paper (arXiv 2605.26105) has no public code; this follows the
formulation of docs/methods/distillation.md ("AFD"), derived from its abstract and DiffusionNFT (Zheng et al. 2025).
Each iteration: (1) roll the student out K times per prompt (shared chunk-wise sampler, no gradient); (2) train a
prompt-conditioned discriminator D with the Bradley-Terry loss softplus(-(D(teacher) - D(student))) (+ R1 / R2,
optional instance noise); (3) turn the score gaps d = D(student) - D(teacher) into batch-centred, normalised,
clipped advantages and r = 1/2 + clip(A, -C, C) / (2C); (4) update the student with the DiffusionNFT loss on its own
forward-noised samples (a sigma per chunk, teacher-forced velocities) plus a regulariser toward the initial student;
theta_old follows theta softly, theta_old <- eta theta_old + (1 - eta) theta, eta = min(ramp * step, eta_max). At
theta = theta_old the update is clip(A) grad ||v - u||^2, an advantage-signed flow-matching step.

Two optimizers (student, discriminator). ``trainer.max_steps``, ``every_n_train_steps``, ``val_check_interval`` and
the progress bar count iterations, one per training batch (the discriminator's steps are not counted:
:func:`~genrl.methods.common.step_uncounted`). Randomness is addressed by (seed, iteration, sample index), so a
resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow import add_noise
from genrl.flow.nft import nft_loss, ref_regularizer
from genrl.methods.common import (
    Scorer,
    advance_iteration,
    check_finite,
    frame_shape_of,
    log_validation_rewards,
    policy_spec,
    role_optimizers,
)
from genrl.methods.distill import (
    causal_videos,
    chunk_noise_levels,
    configure_student,
    discriminator_advantages,
    discriminator_loss,
    student_rollout,
)
from genrl.methods.phases import optimizer_steps
from genrl.models.discriminator import VideoDiscriminator
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import Roles, ramped_decay
from genrl.models.spec import ModelSpec
from genrl.noise import mix_seed, randn_per_sample
from genrl.rollout.autoregressive import ChunkSchedule, teacher_forced_velocity

__all__ = ["AFD"]

_STREAM_SIGMA = 31
_STREAM_EPS = 32


class AFD(LightningModule):
    """Adversarial flow distillation (AFD) of a causal few-step student from teacher videos.

    Training batches: ``{"prompts": list[str] (B), "index": int64 [B], "teacher_pixels": float [B, T, 3, H, W] in
    [0, 1]}`` (:class:`genrl.data.TeacherVideoDataModule`); validation batches are prompt batches.

    Args:
        generator / lora: the student (genrl's DiT, ``family: dit``, default ``pretrained: assets/shapes-dit``; or a
            causal family such as ``wan_causal``), as in :class:`~genrl.methods.DMD`.
        schedule: the student's chunk layout and few-step sampler (rollouts and validation).
        num_frames: latent frames per rollout; frame_shape: latent shape of one frame (default: derived).
        discriminator: the discriminator network (:class:`ModelSpec`, default a small
            :class:`~genrl.models.VideoDiscriminator` on latents sized from the student).
        samples_per_prompt: student rollouts K per prompt (each compared with the prompt's teacher clip).
        discriminator_steps: discriminator updates per iteration (n_D).
        r1_weight / r2_weight: gamma / 2 of the R1 (teacher) / R2 (student) gradient penalties (0 = off).
        disc_noise_max: instance noise for the discriminator: each (teacher, student) pair is noised to a shared
            sigma ~ U[0, disc_noise_max] (fresh noise per clip) before scoring, and D is told the sigma; 0 = clean
            inputs only (docs/methods/distillation.md, "AFD").
        clip_c: advantage clip C (DiffusionNFT 5).
        nft_beta: beta of the implicit policies (1.0 or 0.1).
        adaptive: DiffusionNFT's x0-space adaptive weighting (else the velocity form).
        ref_weight: weight of ||v_theta - v_ref||^2 toward the initial student (DiffusionNFT's KL 1e-4).
        old_decay_ramp / old_decay_max: eta = min(ramp * iteration, max) of the old-policy update.
        sigma_per_chunk: one noise level per chunk (diffusion forcing); False shares one per video (as DMD).
        sigma_from_schedule: draw the noise levels among the student's own step sigmas (where a few-step student
            is evaluated, as in its ODE initialisation); False draws uniformly in (0.02, 0.98).
        nft_steps: NFT gradient steps per iteration, each with a fresh sigma / noise draw.
        student_optimizer / discriminator_optimizer: optimizer factories.
        max_grad_norm: gradient-norm clip of both networks (0 = off).
        rewards / reward_combine: validation rewards (default: the shapes verifier).
        seed: seed of all randomness.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        lora: LoraSpec | None = None,
        schedule: ChunkSchedule | None = None,
        num_frames: int = 8,
        frame_shape: list[int] | None = None,
        discriminator: ModelSpec | None = None,
        samples_per_prompt: int = 2,
        discriminator_steps: int = 1,
        r1_weight: float = 0.0,
        r2_weight: float = 0.0,
        disc_noise_max: float = 0.0,
        clip_c: float = 5.0,
        nft_beta: float = 1.0,
        adaptive: bool = True,
        ref_weight: float = 1e-4,
        old_decay_ramp: float = 0.001,
        old_decay_max: float = 0.5,
        sigma_per_chunk: bool = True,
        sigma_from_schedule: bool = True,
        nft_steps: int = 1,
        student_optimizer: OptimizerCallable = torch.optim.AdamW,
        discriminator_optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum"] = "weighted_sum",
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (("samples_per_prompt", samples_per_prompt), ("discriminator_steps", discriminator_steps),
                            ("nft_steps", nft_steps)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= old_decay_max < 1 or old_decay_ramp < 0:
            raise ValueError(f"need 0 <= old_decay_max < 1 and old_decay_ramp >= 0, got {old_decay_max}, "
                             f"{old_decay_ramp}")
        self.save_hyperparameters(ignore=["student_optimizer", "discriminator_optimizer"])
        self.automatic_optimization = False
        self.generator_spec = policy_spec(self, generator)
        self.schedule = schedule or ChunkSchedule(timesteps=[1000.0, 750.0, 500.0, 250.0], shift=1.0)
        self.schedule.causal.num_chunks(num_frames)
        self.frame_shape = tuple(frame_shape) if frame_shape else None
        self.discriminator_spec = discriminator
        self.student_factory, self.disc_factory = student_optimizer, discriminator_optimizer
        self.generator = None
        self.discriminator = None
        self.old_policy = None
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))
        self.scorer = Scorer(rewards, reward_combine)
        self.roles = Roles(self)

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        if (gen := configure_student(self)) is None:
            return
        fd = self.frame_dim
        self.frame_shape = self.frame_shape or frame_shape_of(gen)
        if self.discriminator_spec is not None:
            disc = self.discriminator_spec.build()
        else:
            text_dim = getattr(getattr(gen, "text_encoder", None), "hidden_size", None) or 384
            patch = (2, 2, 2) if fd == 1 else (1, 2, 2)
            disc = VideoDiscriminator(in_channels=self.frame_shape[0], patch_size=patch, text_dim=text_dim,
                                      frame_dim=fd)
        self.roles.trainable("discriminator", disc.train())
        # theta_old: a soft copy of the trained tensors (checkpointed: exact resume); the reference is the initial
        # student (rebuilt from the spec, or the adapter-disabled model with LoRA): never checkpointed
        self.roles.lagged("old_policy", gen.transformer)
        if self.hparams.ref_weight > 0:
            self.roles.reference_copy(gen)

    def configure_optimizers(self):
        return role_optimizers(self, generator=self.student_factory, discriminator=self.disc_factory)

    # ------------------------------------------------------------------ pieces
    @property
    def frame_dim(self) -> int:
        return int(getattr(self.generator, "frame_dim", 1))

    def student_rollouts(self, cond, indices: torch.Tensor, seed: int) -> torch.Tensor:
        """Clean student latents for ``cond`` (no gradient), chunk by chunk with the KV cache."""
        with torch.no_grad():
            out = student_rollout(self.generator, cond, self.schedule, self.hparams.num_frames, self.frame_shape, seed,
                                  indices)
        return out.latents.float()

    def teacher_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Teacher clips (pixels [B, T, 3, H, W] in [0, 1], already in the student's format) -> latents."""
        with torch.no_grad():
            return self.generator.encode(pixels.to(self.device)).float()

    def discriminator_loss(self, teacher: torch.Tensor, student: torch.Tensor, cond_t, cond_s, salt: int = 0,
                           indices: torch.Tensor | None = None):
        """BT loss (+ R1 / R2) of the (teacher, K students) pairs with the instance noise of (seed, iteration, salt)
        and the teacher clips' global ``indices`` (:func:`~genrl.methods.distill.discriminator_loss`); returns (loss,
        accuracy)."""
        h = self.hparams
        return discriminator_loss(self.discriminator, teacher, student, cond_t, cond_s, h.samples_per_prompt,
                                  h.r1_weight, h.r2_weight, h.disc_noise_max,
                                  mix_seed(h.seed, int(self.iteration), salt), self.frame_dim, indices)

    def advantages(self, teacher: torch.Tensor, student: torch.Tensor, cond_t, cond_s):
        """(d, A, r) over the gathered batch (:func:`~genrl.methods.distill.discriminator_advantages`)."""
        return discriminator_advantages(self, self.discriminator, teacher, student, cond_t, cond_s,
                                        self.hparams.samples_per_prompt, self.hparams.clip_c, self.frame_dim)

    def nft_step_loss(self, x0: torch.Tensor, r: torch.Tensor, cond, indices: torch.Tensor, it: int, step: int):
        """DiffusionNFT loss (+ reference term) on the student's own samples ``x0`` with optimality ``r`` [B]."""
        fd = self.frame_dim
        t = x0.shape[fd]
        h = self.hparams
        sigma = chunk_noise_levels(self.schedule, indices, mix_seed(h.seed, it), step, _STREAM_SIGMA, t,
                                   h.sigma_per_chunk, h.sigma_from_schedule).to(x0.device)
        eps = randn_per_sample(x0.shape[1:], mix_seed(self.hparams.seed, it), indices, step=step, stream=_STREAM_EPS,
                               device=x0.device)
        x_t = add_noise(x0, eps, sigma, frame_dim=fd)
        causal = self.schedule.causal
        gen = self.generator
        v = teacher_forced_velocity(gen, x0, x_t, sigma, cond, causal).float()
        with torch.no_grad(), self.roles.swap(gen, "old_policy"):
            v_old = teacher_forced_velocity(gen, x0, x_t, sigma, cond, causal).float()
        loss = nft_loss(v, v_old, x_t, x0, sigma, r.to(v.device), beta=self.hparams.nft_beta,
                        clip_c=self.hparams.clip_c, adaptive=self.hparams.adaptive, frame_dim=fd)
        stats = {"nft_loss": loss.detach()}
        if self.hparams.ref_weight > 0:
            with torch.no_grad(), self.roles.reference(gen):
                v_ref = teacher_forced_velocity(gen, x0, x_t, sigma, cond, causal).float()
            reg = ref_regularizer(v, v_ref, frame_dim=fd)
            loss = loss + self.hparams.ref_weight * reg
            stats["ref_reg"] = reg.detach()
        return loss, stats

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        if "teacher_pixels" not in batch:
            raise ValueError("AFD batches need 'teacher_pixels' (use genrl.data.TeacherVideoDataModule, or a "
                             "datamodule that attaches teacher clips of the student's format)")
        prompts, indices = list(batch["prompts"]), batch["index"].cpu()
        k = self.hparams.samples_per_prompt
        it = int(self.iteration)
        opt_s, opt_d = self.optimizers()
        gen = self.generator
        cond_t = gen.encode_prompts(prompts)
        s_prompts = [p for p in prompts for _ in range(k)]
        s_indices = (indices[:, None] * k + torch.arange(k)[None]).flatten()
        cond_s = gen.encode_prompts(s_prompts)
        teacher = self.teacher_latents(batch["teacher_pixels"])
        student = self.student_rollouts(cond_s, s_indices, mix_seed(self.hparams.seed, it, 1))
        bs = len(s_prompts)

        h, last = self.hparams, {}

        def disc_unit(d_step: int):  # one discriminator step per unit; the last step's loss and accuracy are logged
            loss_d, acc = self.discriminator_loss(teacher, student, cond_t, cond_s, salt=100 + d_step, indices=indices)
            last.update(loss=loss_d.detach(), acc=acc)
            return loss_d, {}, 1

        optimizer_steps(self, opt_d, [[lambda s=s: disc_unit(s)] for s in range(h.discriminator_steps)],
                        h.max_grad_norm, lambda loss: check_finite(loss, "discriminator", it), counted=False)
        self.log("train/disc_loss", last["loss"], batch_size=bs)
        self.log("train/disc_accuracy", last["acc"], prog_bar=True, batch_size=bs)

        d, adv, r = self.advantages(teacher, student, cond_t, cond_s)
        self.log("train/score_gap", d.mean(), batch_size=bs)
        self.log("train/r_mean", r.mean(), batch_size=bs)

        def nft_unit(step: int):  # the NFT steps accumulate into one optimizer step; stats are already means (weight 0)
            loss, stats = self.nft_step_loss(student, r, cond_s, s_indices, it, step)
            return loss / h.nft_steps, {k: float(v) / h.nft_steps for k, v in stats.items()}, 0

        stats_sum = optimizer_steps(self, opt_s, [[lambda s=s: nft_unit(s) for s in range(h.nft_steps)]],
                                    h.max_grad_norm, check_finite=lambda loss: check_finite(loss, "student", it))
        eta = self.roles.update_lagged("old_policy", ramped_decay(it, h.old_decay_ramp, h.old_decay_max))
        for key, value in stats_sum.items():
            self.log(f"train/{key}", value, batch_size=bs)
        self.log("train/old_policy_eta", eta, batch_size=bs)
        advance_iteration(self, bs)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def generate(self, prompts: list[str], indices: torch.Tensor | None = None) -> torch.Tensor:
        """Student videos (pixels [B, T, C, H, W] in [0, 1]) with the training schedule."""
        return causal_videos(self.generator, prompts, indices, self.schedule, self.hparams.num_frames,
                             self.frame_shape, self.hparams.seed)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        videos = self.generate(prompts, batch["index"].cpu())
        log_validation_rewards(self, self.scorer, videos, prompts)
        if "teacher_pixels" in batch:  # held-out teacher clips: how well D still separates them
            cond = self.generator.encode_prompts(prompts)
            score, fd = self.discriminator.score, self.frame_dim
            acc = (score(self.teacher_latents(batch["teacher_pixels"]), cond, frame_dim=fd)
                   > score(self.generator.encode(videos.to(self.device)).float(), cond, frame_dim=fd)).float().mean()
            self.log("val/disc_accuracy", acc, batch_size=len(prompts))
        return {"videos": videos, "prompts": prompts}
