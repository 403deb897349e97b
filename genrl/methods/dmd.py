"""DMD with Self-Forcing rollouts: the distillation baseline for causal, chunk-wise few-step video students.

Three roles (docs/methods/distillation.md): the causal student G (``generator``, trained), the real score (the
frozen bidirectional ``teacher``, CFG in the standard form with a cached negative-prompt embedding) and the fake
score (the ``critic``, trained by flow matching on the student's samples). Each generator update rolls the student
out under the Self-Forcing gradient policy (one exit step for all chunks, drawn on rank 0 and broadcast; Huang et al.
2025, sec. 3.2-3.3), noises the result at a shifted, clamped timestep and follows g = (x0_fake - x0_real) /
mean|x - x0_real| (DMD eq. 7-8, Yin et al. 2024; DMD2). The critic is updated on every optimizer step, the generator
on every ``critic_updates_per_generator_update``-th (DMD2's two time-scale rule, counted in optimizer steps).

Two optimizers (generator first, critic second). ``trainer.max_steps`` and ``every_n_train_steps`` count
iterations, the critic's optimizer steps (the generator's steps are not counted:
:func:`~genrl.methods.common.step_uncounted`); without gradient accumulation that is one per training batch, as the
progress bar and ``val_check_interval`` count. Randomness is addressed by (seed, iteration, sample index), so a
resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.dmd import dmd_gradient, dmd_loss, sid_loss
from genrl.methods.common import (
    check_finite,
    frame_shape_of,
    init_method,
    log_validation_rewards,
    role_optimizers,
    step_uncounted,
)
from genrl.methods.distill import (
    ScoreRole,
    causal_videos,
    configure_student,
    critic_fm_step,
    dmd_noised,
    exit_step_of,
    negative_cond,
    real_x0,
    student_rollout,
)
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import Conditioning
from genrl.noise import mix_seed, stream_id
from genrl.rollout.autoregressive import ChunkSchedule

__all__ = ["DMD", "ScoreRole"]  # ScoreRole: re-exported from genrl.methods.distill

# the generator's and the critic's noising (dmd_noised)
_STREAM_DMD_NOISE, _STREAM_CRITIC_NOISE = stream_id("dmd.noise"), stream_id("dmd.critic")


class DMD(LightningModule):
    """Self-Forcing DMD on genrl's DiT: a causal few-step student distilled from a bidirectional teacher.

    Training batches are prompt batches (:class:`genrl.data.PromptDataModule`: ``{"prompts", "index", ...}``);
    the method is data-free (the student's inputs come from its own rollouts).

    Args:
        generator: the student (:class:`~genrl.models.families.GeneratorSpec`): genrl's DiT (``family: dit``; normally
            the ODE-initialised export, or the teacher's folder: a bidirectional model becomes causal by its
            attention layout, weights unchanged), or a causal diffusers family (``family: wan_causal``: Wan2.1 with
            block-causal attention; its text encoder and VAE serve all roles).
        teacher: the real score (a transformer :class:`ModelSpec`; default for the DiT: the student's ``pretrained``
            folder, i.e. the base model; required for a family student).
        critic: the fake score's initial weights (default: the teacher's). For a family student ``teacher`` (and
            ``critic``) are then transformer specs, e.g. ``model_class: diffusers.WanTransformer3DModel`` with
            ``subfolder: transformer`` and ``dtype: bfloat16``.
        lora: train a LoRA adapter on the student instead of all its weights.
        schedule: the student's chunk layout and few-step list (:class:`ChunkSchedule`).
        num_frames: latent frames per training rollout (a chunk boundary).
        frame_shape: latent shape of one frame without the frame axis (DiT (C, H, W); Wan (C, h, w)); default: the
            family generator's latent shape, or (3, 16, 16) for the DiT.
        teacher_cfg_scale: the teacher's CFG scale w in the standard form (Self-Forcing's 3.0 is w = 4).
        negative_prompt: the unconditional prompt of the teacher's CFG.
        timestep_shift, min_timestep, max_timestep: the DMD timestep draw (shift 5, clamp [20, 980]).
        critic_updates_per_generator_update: DMD2's ratio (5): the generator is updated on optimizer steps
            0, r, 2r, ... of the critic.
        generator_loss: ``"dmd"`` (DMD eq. 7-8) or ``"sid"`` (score identity distillation, alpha 1).
        exit_mode: ``"uniform"`` (Self-Forcing) or ``"last"`` exit step.
        grad_window_frames: chunks starting before the last this-many latent frames carry no graph (None = all).
        accumulate_grad_batches: micro-batches per optimizer step (the cadence counts optimizer steps).
        generator_optimizer / critic_optimizer: factories (Self-Forcing: AdamW lr 2e-6 / 4e-7, betas (0, 0.999)).
        max_grad_norm: gradient-norm clip of both networks (10).
        eval_schedule: sampler for validation (default: ``schedule``).
        rewards / reward_combine: validation rewards (default: the shapes verifier).
        weighting: a module weighting the DMD gradient (:attr:`generator_loss_weight`), e.g.
            :class:`~genrl.methods.stream_r1.StreamR1Weighting` (Stream-R1); None: plain DMD.
        seed: seed of all randomness.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        teacher: ModelSpec | None = None,
        critic: ModelSpec | None = None,
        lora: LoraSpec | None = None,
        schedule: ChunkSchedule | None = None,
        num_frames: int = 8,
        frame_shape: list[int] | None = None,
        teacher_cfg_scale: float = 3.0,
        negative_prompt: str = "",
        timestep_shift: float = 5.0,
        min_timestep: float = 20.0,
        max_timestep: float = 980.0,
        critic_updates_per_generator_update: int = 5,
        generator_loss: Literal["dmd", "sid"] = "dmd",
        exit_mode: Literal["uniform", "last"] = "uniform",
        grad_window_frames: int | None = None,
        accumulate_grad_batches: int = 1,
        generator_optimizer: OptimizerCallable = torch.optim.AdamW,
        critic_optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 10.0,
        eval_schedule: ChunkSchedule | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum"] = "weighted_sum",
        weighting: torch.nn.Module | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if critic_updates_per_generator_update < 1:
            raise ValueError(f"critic_updates_per_generator_update must be >= 1, got "
                             f"{critic_updates_per_generator_update}")
        if accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches must be >= 1, got {accumulate_grad_batches}")
        if generator_loss not in ("dmd", "sid"):
            raise ValueError(f"generator_loss must be 'dmd' or 'sid', got {generator_loss!r}")
        init_method(self, generator, rewards, reward_combine,
                    ignore=("generator_optimizer", "critic_optimizer", "weighting"))
        if self.generator_spec.family != "dit" and teacher is None:
            raise ValueError("a family student (generator:) needs an explicit teacher transformer spec, e.g. "
                             "{model_class: diffusers.WanTransformer3DModel, pretrained: <folder>, subfolder: "
                             "transformer}")
        self.teacher_spec = teacher or ModelSpec(pretrained=self.generator_spec.pretrained)
        if self.teacher_spec.pretrained is None and not self.teacher_spec.config:
            raise ValueError("DMD needs a teacher: give teacher.pretrained (or a student with pretrained weights)")
        self.critic_spec = critic
        self.schedule = schedule or ChunkSchedule()
        self.eval_schedule = eval_schedule or self.schedule
        self.schedule.causal.num_chunks(num_frames)  # raises off a chunk boundary
        self.frame_shape = tuple(frame_shape) if frame_shape else None
        self.generator_factory, self.critic_factory = generator_optimizer, critic_optimizer
        self.critic: torch.nn.Module | None = None
        self.register_buffer("micro_step", torch.zeros((), dtype=torch.long))  # (iteration: the critic's steps)
        self._negative: Conditioning | None = None
        #: optional weight of the DMD gradient per sample / element (see :meth:`generator_loss`); None: ``weighting``
        self.generator_loss_weight: Callable[..., Any] | None = None
        self.weighting = weighting  # a child: its state (e.g. Stream-R1's balance history) is checkpointed

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        if (student := configure_student(self)) is None:
            return
        self.frame_shape = self.frame_shape or frame_shape_of(student)
        teacher = self.roles.frozen("teacher", self.teacher_spec.build())  # never checkpointed: rebuilt on resume
        critic = self.critic_spec.build() if self.critic_spec is not None else copy.deepcopy(teacher)
        self.roles.trainable("critic", critic.requires_grad_(True).train())

    def configure_optimizers(self):
        return role_optimizers(self, generator=self.generator_factory, critic=self.critic_factory)

    # ------------------------------------------------------------------ roles
    @property
    def teacher(self) -> ScoreRole:
        return ScoreRole(self.generator, self.roles.get("teacher"))

    @torch.no_grad()
    def real_x0(self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Teacher x0 prediction with CFG (standard form w) at x_t, sigma [B]."""
        w = self.hparams.teacher_cfg_scale
        return real_x0(self.teacher, x_t, sigma, cond, w,
                       negative_cond(self, x_t.shape[0], cond.prompts) if w != 1.0 else None)

    def fake_x0(self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Critic x0 prediction (no CFG) at x_t, sigma [B]."""
        return ScoreRole(self.generator, self.critic).x0(x_t, sigma, cond)

    def student_rollout(self, cond: Conditioning, indices: torch.Tensor, seed: int, grad: bool):
        """Student videos (latents) for ``cond`` with the Self-Forcing gradient policy when ``grad``."""
        h = self.hparams
        exit_step = exit_step_of(self, self.schedule.num_steps, h.seed, int(self.iteration), h.exit_mode) if grad \
            else None
        return student_rollout(self.generator, cond, self.schedule, h.num_frames, self.frame_shape, seed, indices,
                               exit_step, h.grad_window_frames)

    def _noised(self, x: torch.Tensor, indices: torch.Tensor, it: int, stream: int):
        """(sigma [B], eps, x_sigma) of iteration ``it`` (:func:`~genrl.methods.distill.dmd_noised`)."""
        h = self.hparams
        return dmd_noised(x, indices, mix_seed(h.seed, it), stream, h.timestep_shift, h.min_timestep, h.max_timestep)

    # ------------------------------------------------------------------ losses
    def generator_loss(self, cond: Conditioning, indices: torch.Tensor, it: int,
                       prompts: list[str] | None = None) -> dict[str, torch.Tensor]:
        """One Self-Forcing rollout and the DMD (or SiD) loss; returns {"loss", "grad_norm_g", "exit_step"}.

        The DMD gradient is weighted by :attr:`generator_loss_weight` (or, when that is None, the ``weighting``
        module): a callable ``(x, x0_fake, x0_real, indices, prompts=..., method=self) -> weight`` (python float,
        [B], [B, T] or broadcastable to x, non-negative, detached), so a composing method (e.g. Stream-R1's reward
        weight) changes the generator update without copying it; gradient = w * g / N.
        """
        out = self.student_rollout(cond, indices, mix_seed(self.hparams.seed, it, 1), grad=True)
        x = out.latents
        sigma, _, x_t = self._noised(x, indices, it, _STREAM_DMD_NOISE)
        with torch.no_grad():
            x0_fake = self.fake_x0(x_t, sigma, cond)
            x0_real = self.real_x0(x_t, sigma, cond)
        mask = out.grad_mask.to(x.device)
        if not bool(mask.any()):
            raise RuntimeError("the Self-Forcing rollout produced no frame with a graph; check grad_window_frames")
        fd = getattr(self.generator, "frame_dim", 1)
        g = dmd_gradient(x, x0_fake, x0_real, mask=mask, frame_dim=fd)
        if self.hparams.generator_loss == "dmd":
            hook = self.generator_loss_weight if self.generator_loss_weight is not None else self.weighting
            weight = hook(x.detach(), x0_fake, x0_real, indices, prompts=prompts, method=self) if hook is not None \
                else None
            loss = dmd_loss(x, g, mask=mask, weight=weight, frame_dim=fd)
        else:
            if self.generator_loss_weight is not None or self.weighting is not None:
                raise ValueError("a weighting applies to the DMD loss; generator_loss='sid' has no weight")
            loss = sid_loss(x, x0_fake, x0_real, mask=mask, frame_dim=fd)
        return {"loss": loss, "g_norm": g.float().pow(2).mean().sqrt(), "exit_step": torch.tensor(float(out.exit_step))}

    def critic_step_loss(self, cond: Conditioning, indices: torch.Tensor, it: int) -> dict[str, torch.Tensor]:
        """A fresh no-grad rollout and the critic's flow-matching step on it (distill's :func:`critic_fm_step`)."""
        h = self.hparams
        with torch.no_grad():
            x = self.student_rollout(cond, indices, mix_seed(h.seed, it, 2), grad=False).latents
        return critic_fm_step(self.generator, self.critic, x, cond, indices, mix_seed(h.seed, it), _STREAM_CRITIC_NOISE,
                              h.timestep_shift, h.min_timestep, h.max_timestep, getattr(self.generator, "frame_dim", 1))

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        prompts, indices = list(batch["prompts"]), batch["index"].cpu()
        acc = self.hparams.accumulate_grad_batches
        micro = int(self.micro_step)
        it = int(self.iteration)
        first, last = micro % acc == 0, micro % acc == acc - 1
        gen_turn = it % self.hparams.critic_updates_per_generator_update == 0
        opt_g, opt_c = self.optimizers()
        cond = self.generator.encode_prompts(prompts)
        bs = len(prompts)
        if gen_turn:
            if first:
                opt_g.zero_grad()
            out = self.generator_loss(cond, indices, it, prompts)
            self._check_finite(out["loss"], "generator")
            self.manual_backward(out["loss"] / acc)
            self.log("train/generator_loss", out["loss"].detach().float(), batch_size=bs)
            self.log("train/dmd_grad_rms", out["g_norm"], batch_size=bs)
            self.log("train/exit_step", out["exit_step"], batch_size=bs)
        if first:
            opt_c.zero_grad()
        out_c = self.critic_step_loss(cond, indices, it)
        self._check_finite(out_c["loss"], "critic")
        self.manual_backward(out_c["loss"] / acc)
        self.log("train/critic_loss", out_c["loss"].detach().float(), prog_bar=True, batch_size=bs)
        if last:
            clip = self.hparams.max_grad_norm
            if gen_turn:
                if clip > 0:
                    self.clip_gradients(opt_g, gradient_clip_val=clip, gradient_clip_algorithm="norm")
                step_uncounted(self, opt_g)  # the critic's step counts the iteration
            if clip > 0:
                self.clip_gradients(opt_c, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            opt_c.step()
            self.iteration += 1
        self.micro_step += 1
        self.log("train/iteration", float(self.iteration), batch_size=bs)

    def _check_finite(self, loss: torch.Tensor, role: str) -> None:
        check_finite(loss, role, int(self.iteration), " or check the teacher / critic weights")

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def generate(self, prompts: list[str], indices: torch.Tensor | None = None, schedule: ChunkSchedule | None = None,
                 num_frames: int | None = None) -> torch.Tensor:
        """Student videos (pixels [B, T, C, H, W] in [0, 1]) with the evaluation sampler."""
        return causal_videos(self.generator, prompts, indices, schedule or self.eval_schedule,
                             num_frames or self.hparams.num_frames, self.frame_shape, self.hparams.seed)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        videos = self.generate(prompts, batch["index"].cpu())
        return log_validation_rewards(self, self.scorer, videos, prompts)
