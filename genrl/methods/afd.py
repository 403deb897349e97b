"""AFD: adversarial flow distillation of a causal student from a black-box teacher's finished videos.

Only the teacher's videos for the training prompts are used (an mp4 folder, :class:`genrl.data.TeacherVideoDataModule`,
or an online black-box teacher queried on each batch's prompts, ``teacher:``, :mod:`genrl.data.online_teacher`): no
teacher scores, latents or step alignment. The paper (arXiv 2605.26105) has no public code; this follows the
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

from genrl.data.online_teacher import OnlineTeacherSpec
from genrl.data.teacher_videos import codec_fingerprint
from genrl.flow import add_noise
from genrl.flow.nft import nft_loss, ref_regularizer
from genrl.methods.common import (
    advance_iteration,
    check_finite,
    frame_shape_of,
    init_method,
    log_validation_rewards,
    role_optimizers,
)
from genrl.methods.distill import (
    SaturationMonitor,
    causal_videos,
    chunk_noise_levels,
    configure_student,
    discriminator_advantages,
    discriminator_loss,
    student_rollout,
    teacher_forced_fm_loss,
)
from genrl.methods.phases import optimizer_steps
from genrl.models.discriminator import TrunkDiscriminator, VideoDiscriminator
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import ramped_decay
from genrl.models.spec import ModelSpec
from genrl.noise import mix_seed, randn_per_sample, stream_id
from genrl.rollout.autoregressive import ChunkSchedule, teacher_forced_velocity

__all__ = ["AFD"]

_STREAM_SIGMA = stream_id("afd.sigma")
_STREAM_EPS = stream_id("afd.eps")
_STREAM_TEACHER = stream_id("afd.teacher")  # the online teacher's seed: mix_seed(seed, _STREAM_TEACHER)


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
        discriminator_trunk: block counts of a frozen copy of the initial student whose features
            :class:`~genrl.models.TrunkDiscriminator`'s heads score (instead of a standalone discriminator); ``[]``
            taps the default three depths; None (default) keeps ``discriminator``. No R1 / R2 with a trunk.
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
        teacher: an online black-box teacher (:class:`~genrl.data.online_teacher.OnlineTeacherSpec`: the shapes
            renderer, a local generator, or a folder of mp4s with a generator fallback), queried every iteration on
            the batch's own prompts with seed ``mix_seed(seed, 33)`` and the batch's sample indices; its clips and
            latents are cached. With a teacher the training batches need only prompts (a
            :class:`~genrl.data.PromptDataModule`); their ``teacher_pixels``, if any, are not used.
        mismatch_weight: weight of the matching-aware term (teacher clip vs another prompt's teacher clip under
            its own prompt, :func:`~genrl.methods.distill.discriminator_loss`); 0 = off.
        label_smoothing: one-sided BT label smoothing eps in [0, 0.5) of the discriminator.
        advantage_baseline: ``"batch"`` centres the score gaps over the whole batch; ``"group"`` centres each
            prompt's K rollouts on their own mean (std of the batch), so only their ranking counts (needs K >= 2).
        nft_weight: weight of the on-policy DiffusionNFT term (1; 0 leaves only the reference and teacher
            flow-matching terms: the control that isolates what the discriminator's advantages add).
        teacher_fm_weight: weight of an off-policy flow-matching term on the teacher's own clips (teacher-forced,
            one noise level per chunk drawn like the NFT term's): ``||v_theta(y_sigma) - (eps - y)||^2``. It needs
            only the teacher's videos (the black-box interface); 0 (default) is AFD as formulated, on-policy only.
        saturation_threshold / saturation_window: warn once when the discriminator's training accuracy, averaged
            over the last ``saturation_window`` iterations, is above the threshold (it then separates nearly every
            pair, and its gaps rank the student's samples by whatever it keys on); ``train/disc_saturated`` logs it.
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
        discriminator_trunk: list[int] | None = None,
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
        teacher: OnlineTeacherSpec | None = None,
        mismatch_weight: float = 0.0,
        label_smoothing: float = 0.0,
        advantage_baseline: Literal["batch", "group"] = "batch",
        nft_weight: float = 1.0,
        teacher_fm_weight: float = 0.0,
        saturation_threshold: float = 0.95,
        saturation_window: int = 20,
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
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        for name, value in (("nft_weight", nft_weight), ("teacher_fm_weight", teacher_fm_weight),
                            ("mismatch_weight", mismatch_weight)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if advantage_baseline not in ("batch", "group"):
            raise ValueError(f"advantage_baseline must be 'batch' or 'group', got {advantage_baseline!r}")
        if advantage_baseline == "group" and samples_per_prompt < 2:
            raise ValueError("advantage_baseline='group' ranks each prompt's K rollouts: set samples_per_prompt >= 2 "
                             "or use advantage_baseline='batch'")
        if discriminator_trunk is not None and (discriminator is not None or r1_weight > 0 or r2_weight > 0):
            raise ValueError("discriminator_trunk builds the discriminator on the student's own trunk: drop the "
                             "discriminator spec and set r1_weight = r2_weight = 0 (no double backward through it)")
        if not 0 <= old_decay_max < 1 or old_decay_ramp < 0:
            raise ValueError(f"need 0 <= old_decay_max < 1 and old_decay_ramp >= 0, got {old_decay_max}, "
                             f"{old_decay_ramp}")
        init_method(self, generator, rewards, reward_combine, ignore=("student_optimizer", "discriminator_optimizer"))
        self.schedule = schedule or ChunkSchedule(timesteps=[1000.0, 750.0, 500.0, 250.0], shift=1.0)
        self.schedule.causal.num_chunks(num_frames)
        self.frame_shape = tuple(frame_shape) if frame_shape else None
        self.discriminator_spec = discriminator
        self.student_factory, self.disc_factory = student_optimizer, discriminator_optimizer
        self.discriminator = None
        self.old_policy = None
        self.teacher_spec, self.teacher = teacher, None
        self.saturation = SaturationMonitor("AFD", saturation_threshold, saturation_window)

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        if (gen := configure_student(self)) is None:
            return
        fd = self.frame_dim
        self.frame_shape = self.frame_shape or frame_shape_of(gen)
        if self.hparams.discriminator_trunk is not None:
            disc = TrunkDiscriminator(gen, self.hparams.discriminator_trunk or None)
        elif self.discriminator_spec is not None:
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
        if self.teacher_spec is not None and self.teacher is None:
            self.teacher = self.teacher_spec.build()

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

    def online_teacher_latents(self, prompts: list[str], indices: torch.Tensor) -> torch.Tensor:
        """The online teacher's clips of ``prompts`` (sample ids ``indices``) as the student codec's latents
        (cached)."""
        gen = self.generator
        seed = mix_seed(self.hparams.seed, _STREAM_TEACHER)
        lat = self.teacher.latents_for(prompts, seed, indices, lambda px: gen.encode(px.to(self.device)),
                                       codec_fingerprint(gen))
        return lat.to(self.device)

    def check_saturation(self, accuracy: float) -> bool:
        """Record one iteration's discriminator accuracy (:class:`~genrl.methods.distill.SaturationMonitor`); True,
        and one warning per run naming the knobs, when the window's mean is above ``saturation_threshold``."""
        h = self.hparams
        return self.saturation.update(accuracy, lambda: (
            f"disc_noise_max (instance noise, now {h.disc_noise_max}), r1_weight / r2_weight (now {h.r1_weight} / "
            f"{h.r2_weight}), mismatch_weight (now {h.mismatch_weight}), label_smoothing (now {h.label_smoothing}), "
            f"discriminator_steps (now {h.discriminator_steps}) and the discriminator's learning rate"))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["afd_saturation"] = self.saturation.state_dict()  # exact resume of the warning's window

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.saturation.load_state_dict(checkpoint.get("afd_saturation") or {})

    def teacher_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Teacher clips (pixels [B, T, 3, H, W] in [0, 1], already in the student's format) -> latents."""
        with torch.no_grad():
            return self.generator.encode(pixels.to(self.device)).float()

    def discriminator_loss(self, teacher: torch.Tensor, student: torch.Tensor, cond_t, cond_s, salt: int = 0,
                           indices: torch.Tensor | None = None, mismatch_valid: torch.Tensor | None = None):
        """BT loss (+ R1 / R2) of the (teacher, K students) pairs with the instance noise of (seed, iteration, salt)
        and the teacher clips' global ``indices`` (:func:`~genrl.methods.distill.discriminator_loss`); returns (loss,
        accuracy)."""
        h = self.hparams
        return discriminator_loss(self.discriminator, teacher, student, cond_t, cond_s, h.samples_per_prompt,
                                  h.r1_weight, h.r2_weight, h.disc_noise_max,
                                  mix_seed(h.seed, int(self.iteration), salt), self.frame_dim, indices,
                                  h.mismatch_weight, mismatch_valid, h.label_smoothing)

    def advantages(self, teacher: torch.Tensor, student: torch.Tensor, cond_t, cond_s,
                   s_indices: torch.Tensor | None = None):
        """(d, A, r, student scores, teacher scores) over the gathered batch
        (:func:`~genrl.methods.distill.discriminator_advantages`); ``s_indices`` [B K] (the student samples' global
        ids, row b k = index_b K + k) give the prompt groups of ``advantage_baseline="group"``."""
        h = self.hparams
        group = None
        if h.advantage_baseline == "group":
            if s_indices is None:
                raise ValueError("advantage_baseline='group' needs the student samples' indices (s_indices)")
            group = torch.as_tensor(s_indices).long() // h.samples_per_prompt
        return discriminator_advantages(self, self.discriminator, teacher, student, cond_t, cond_s,
                                        h.samples_per_prompt, h.clip_c, self.frame_dim, group)

    def teacher_fm_loss(self, y: torch.Tensor, cond, indices: torch.Tensor, it: int, step: int) -> torch.Tensor:
        """Flow matching of the student on teacher latents ``y`` (:func:`~genrl.methods.distill.teacher_forced_fm_loss`,
        addressed by (seed, iteration, teacher clip index, step))."""
        h = self.hparams
        return teacher_forced_fm_loss(self.generator, self.schedule, y, cond, indices, mix_seed(h.seed, it), step,
                                      h.sigma_per_chunk, h.sigma_from_schedule, self.frame_dim)

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
        nft = nft_loss(v, v_old, x_t, x0, sigma, r.to(v.device), beta=self.hparams.nft_beta,
                       clip_c=self.hparams.clip_c, adaptive=self.hparams.adaptive, frame_dim=fd)
        stats = {"nft_loss": nft.detach()}
        loss = self.hparams.nft_weight * nft
        if self.hparams.ref_weight > 0:
            with torch.no_grad(), self.roles.reference(gen):
                v_ref = teacher_forced_velocity(gen, x0, x_t, sigma, cond, causal).float()
            reg = ref_regularizer(v, v_ref, frame_dim=fd)
            loss = loss + self.hparams.ref_weight * reg
            stats["ref_reg"] = reg.detach()
        return loss, stats

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        if self.teacher is None and "teacher_pixels" not in batch:
            raise ValueError("AFD batches need 'teacher_pixels' (use genrl.data.TeacherVideoDataModule, or a "
                             "datamodule that attaches teacher clips of the student's format), or set "
                             "model.init_args.teacher (an online teacher queried on the batch's prompts)")
        prompts, indices = list(batch["prompts"]), batch["index"].cpu()
        k = self.hparams.samples_per_prompt
        it = int(self.iteration)
        opt_s, opt_d = self.optimizers()
        gen = self.generator
        cond_t = gen.encode_prompts(prompts)
        s_prompts = [p for p in prompts for _ in range(k)]
        s_indices = (indices[:, None] * k + torch.arange(k)[None]).flatten()
        cond_s = gen.encode_prompts(s_prompts)
        if self.teacher is not None:
            teacher = self.online_teacher_latents(prompts, indices)
        else:
            teacher = self.teacher_latents(batch["teacher_pixels"])
        mismatch_valid = torch.tensor([p != q for p, q in zip(prompts, prompts[-1:] + prompts[:-1])])
        student = self.student_rollouts(cond_s, s_indices, mix_seed(self.hparams.seed, it, 1))
        bs = len(s_prompts)

        h, last = self.hparams, {}

        def disc_unit(d_step: int):  # one discriminator step per unit; the last step's loss and accuracy are logged
            loss_d, acc = self.discriminator_loss(teacher, student, cond_t, cond_s, salt=100 + d_step, indices=indices,
                                                  mismatch_valid=mismatch_valid)
            last.update(loss=loss_d.detach(), acc=acc)
            return loss_d, {}, 1

        optimizer_steps(self, opt_d, [[lambda s=s: disc_unit(s)] for s in range(h.discriminator_steps)],
                        h.max_grad_norm, lambda loss: check_finite(loss, "discriminator", it), counted=False)
        self.log("train/disc_loss", last["loss"], batch_size=bs)
        self.log("train/disc_accuracy", last["acc"], prog_bar=True, batch_size=bs)
        self.log("train/disc_saturated", float(self.check_saturation(float(last["acc"]))), batch_size=bs)

        d, adv, r, s_x, s_y = self.advantages(teacher, student, cond_t, cond_s, s_indices)
        for key, value in (("score_gap", d.mean()), ("score_gap_std", d.std(unbiased=False)),
                           ("score_student", s_x.mean()), ("score_teacher", s_y.mean()), ("r_mean", r.mean()),
                           ("adv_abs_mean", adv.abs().mean()),
                           ("adv_clipped_frac", (adv.abs() >= h.clip_c).float().mean())):
            self.log(f"train/{key}", value, batch_size=bs)

        def nft_unit(step: int):  # the NFT steps accumulate into one optimizer step; stats are already means (weight 0)
            loss, stats = self.nft_step_loss(student, r, cond_s, s_indices, it, step)
            if h.teacher_fm_weight > 0:
                fm = self.teacher_fm_loss(teacher, cond_t, indices, it, step)
                loss = loss + h.teacher_fm_weight * fm
                stats["teacher_fm"] = fm.detach()
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
        if self.teacher is not None or "teacher_pixels" in batch:  # held-out teacher clips: does D still separate?
            cond = self.generator.encode_prompts(prompts)
            score, fd = self.discriminator.score, self.frame_dim
            teacher = (self.online_teacher_latents(prompts, batch["index"].cpu()) if self.teacher is not None
                       else self.teacher_latents(batch["teacher_pixels"]))
            acc = (score(teacher, cond, frame_dim=fd)
                   > score(self.generator.encode(videos.to(self.device)).float(), cond, frame_dim=fd)).float().mean()
            self.log("val/disc_accuracy", acc, batch_size=len(prompts))
        return {"videos": videos, "prompts": prompts}
