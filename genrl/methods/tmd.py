"""TMD: transition matching distillation of a video flow model into a few-step student with a flow head.

Nie, Berner, Ma, Liu, Xie, Vahdat 2026, "Transition Matching Distillation" (arXiv 2601.09881), building on Difference
Transition Matching (Shaul et al. 2025, arXiv 2506.23589), MeanFlow (Geng et al. 2025) and DMD2 (Yin et al. 2024).
The student is the teacher split in two (:mod:`genrl.models.trunk`): a *backbone* that runs once per outer transition
and a *flow head* that runs N times per transition on the inner variable y = x1 - x0; it samples with
:func:`genrl.rollout.transition.transition_rollout` (effective NFE M (1 + (N - 1) H / L)). A short composition:

- ``stage: "meanflow"`` (TM-MeanFlow, stage 1): caption dropout, the outer point
  (:func:`genrl.flow.tmd.sample_outer_point`), the optional CFG shift of y by the frozen teacher's guidance
  direction, the inner times (:func:`genrl.flow.tmd.sample_inner_times`) and the loss assembled from the head's
  outputs (:func:`genrl.flow.tmd.tm_meanflow_loss`); backbone and head train together.
- ``stage: "dmd"`` (DMD2-v with flow-head rollout, stage 2): the student's sample x_hat = x_{t_i} - t_i y_hat through
  all N inner steps with gradients, the VSD loss against the frozen teacher with CFG
  (:func:`genrl.flow.tmd.vsd_gradient`), the critic's flow-matching step shared with DMD
  (:func:`genrl.methods.distill.critic_fm_step`) every iteration and DMD2-v's optional GAN term; the student steps
  every ``critic_updates_per_generator_update``-th iteration.

Roles: ``generator`` and ``flow_head`` (trainable, one optimizer); stage 2 adds the frozen ``teacher``, the trainable
``critic`` (and ``gan_heads``, stepped with it); stage 1 adds the teacher only when ``meanflow_cfg_scale`` != 1.
Randomness is addressed by (seed, iteration, sample index, stream), so a resumed run repeats an uninterrupted one.
The equations, the choices the paper leaves open and the code map: docs/methods/tmd.md.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow import add_noise, cfg_combine, gan_generator_loss
from genrl.flow.tmd import (
    LOSS_NORMS,
    effective_nfe,
    outer_step,
    sample_inner_times,
    sample_outer_point,
    tm_meanflow_loss,
    transition_grid,
    vsd_gradient,
    vsd_loss,
)
from genrl.methods.common import (
    backward_step,
    build_policy,
    init_method,
    linear_warmup,
    log_validation_rewards,
    role_optimizers,
    trainer_of,
)
from genrl.methods.distill import (
    ScoreRole,
    critic_fm_step,
    dmd_noised,
    gan_critic_term,
    gan_layers_for,
    negative_cond,
    real_x0,
    teacher_gan_logits,
)
from genrl.methods.phases import caption_dropout, video_batch
from genrl.models.discriminator import FeatureGANHeads
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import swapped_transformer
from genrl.models.sharding import full_state_dict
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import Conditioning
from genrl.models.trunk import (  # re-exported: the export layout of a TMD run
    HEAD_CONFIG_FILE,
    HEAD_WEIGHTS_FILE,
    FlowHead,
    TransitionModel,
    load_head,
    save_head,
    trunk_adapter,
)
from genrl.noise import mix_seed, randn_per_sample, stream_id
from genrl.rollout.transition import TransitionConfig, inner_flow, load_transition_model, transition_rollout

__all__ = ["TMD", "HEAD_CONFIG_FILE", "HEAD_WEIGHTS_FILE", "load_head", "load_transition_model", "save_head"]


# random streams of one training sample (genrl.noise)
_S_X1, _S_OUTER, _S_INNER_NOISE = stream_id("tmd.x1"), stream_id("tmd.outer"), stream_id("tmd.inner_noise")
_S_DROPOUT, _S_DMD, _S_CRITIC = stream_id("tmd.dropout"), stream_id("tmd.dmd"), stream_id("tmd.critic")
_S_GAN_REAL = stream_id("tmd.gan_real")
_STAGES = ("meanflow", "dmd")
_HINT = " or check the teacher / critic weights"


class TMD(LightningModule):
    """Transition matching distillation (stage ``"meanflow"`` or ``"dmd"``) of genrl's DiT or a diffusers family.

    Training batches are ``{"pixels": [B, T, C, H, W] in [0, 1], "prompts": list[str], "index": int64 [B]}`` (a
    video datamodule: the shapes world, a video folder, teacher videos): both stages start the student's transitions
    from noised data latents x_{t_i} = (1 - t_i) x0 + t_i x1. Validation samples with the transition sampler and
    scores ``rewards``.

    Args:
        generator: the student (:class:`~genrl.models.families.GeneratorSpec`): the teacher's folder for stage 1,
            stage 1's export for stage 2. Families with a backbone / head split: genrl's DiT, ``wan``, ``sd3``
            (:func:`genrl.models.trunk.trunk_adapter`).
        stage: ``"meanflow"`` (TM-MeanFlow pretraining of the head) or ``"dmd"`` (DMD2-v with flow-head rollout).
        head_layers: H, the transformer blocks the flow head re-runs (1 <= H < L; the paper: 5 of Wan2.1's 30).
        gate_init: initial logit of the fusion gate (sigmoid(-4) = 0.018: the student starts near the teacher).
        head_time: the head's blocks see the inner time s (``"inner"``, the paper) or the outer t_i (``"outer"``).
        head_init: a folder holding ``flow_head.safetensors`` (an export of stage 1) to start the head from; None: a
            fresh head (stage 1), required in spirit for stage 2.
        outer_steps / inner_steps: M and N of the transition sampler (the paper's N2H5 with M = 2).
        outer_shift / inner_shift: time shifts of the two grids (10 / 10; 5 for a 4-step student).
        t_max: the top of both grids (0.999).
        parameterization: how the head's estimate y_hat of y becomes the inner average velocity u:
            ``"denoiser"`` u = (y_s - y_hat) / s (genrl's default) or ``"noise"`` u = y1 - y_hat (the paper's form as
            the spec reads it); see :mod:`genrl.flow.tmd` and docs/methods/tmd.md for why they differ.
        inner_time_shift: shift of the stage-1 inner time draw (3).
        p_equal: probability of r = s in stage 1 (0.75).
        fd_delta: step of the finite-difference derivative (5e-3).
        loss_c: the adaptive loss's constant c (None: the latent dimension d, the paper's choice for Wan2.1-1.3B, under
            ``loss_norm: squared``; sqrt(d) under ``norm``).
        loss_norm: what stage 1's adaptive loss weight divides by (:func:`genrl.flow.tmd.adaptive_loss`):
            ``"squared"`` (default), ``||u - target||^2 + c``, the TMD paper's equation and MeanFlow's weighting; or
            ``"norm"``, ``||u - target|| + c``, NVIDIA FastGen's MeanFlow default (``loss_type="opt_grad"``). Which
            one the paper's numbers use and how to port a FastGen config: docs/methods/tmd.md, stage 1.
        meanflow_cfg_scale: CFG scale w of the stage-1 target (1: none; the paper: 3).
        caption_dropout: probability of training a sample on ``negative_prompt`` (stage 1; 0.1).
        teacher: the frozen teacher transformer (:class:`ModelSpec`; default: the student's ``pretrained`` folder for
            the DiT; required for a family student in stage 2 or with CFG).
        critic: the fake score's initial weights (default: the teacher's).
        teacher_cfg_scale: the teacher's CFG scale w in stage 2 (the paper: 5).
        negative_prompt: the unconditional prompt of both CFGs and of caption dropout.
        dmd_shift / min_timestep / max_timestep: stage 2's VSD noise level draw (shift 5, timesteps in [1, 999]).
        critic_updates_per_generator_update: DMD2's ratio (5).
        gan_weight: weight of DMD2-v's GAN term in the generator loss (stage 2; the paper: 0.03; 0 = none, no heads
            built): :class:`~genrl.models.discriminator.FeatureGANHeads` on the frozen teacher's features tell noised
            data from noised student samples, trained with the critic's optimizer (docs/methods/tmd.md, GAN term).
        gan_layers: block counts of the teacher after which its features are tapped (None: ``[round(0.53 L),
            round(0.77 L), L]``, the paper's layers 16 / 23 / 30 of Wan2.1-1.3B's 30).
        gan_channels: width of each GAN head (64).
        lora: train a LoRA adapter on the student's transformer (the head is always trained in full).
        generator_optimizer / critic_optimizer: factories (AdamW, the paper: lr 3e-5 stage 1, 1e-5 stage 2, betas
            (0.9, 0.99), weight decay 0.01).
        warmup_steps: linear learning-rate warm-up of the generator's optimizer (stage 1).
        max_grad_norm: gradient-norm clip of every optimizer (0: none).
        rewards / reward_combine: validation rewards (default: the shapes verifier).
        seed: seed of all randomness.
    Raises:
        ValueError: an unknown stage, head_time or loss_norm, probabilities / shifts / step counts out of range (each
            names the value), a family student without a teacher where one is needed.
    """

    def __init__(self, generator: GeneratorSpec | None = None, stage: Literal["meanflow", "dmd"] = "meanflow",
                 head_layers: int = 1, gate_init: float = -4.0, head_time: Literal["inner", "outer"] = "inner",
                 head_init: str | None = None, outer_steps: int = 2, inner_steps: int = 2, outer_shift: float = 10.0,
                 inner_shift: float = 10.0, t_max: float = 0.999,
                 parameterization: Literal["denoiser", "noise"] = "denoiser", inner_time_shift: float = 3.0,
                 p_equal: float = 0.75, fd_delta: float = 5e-3, loss_c: float | None = None,
                 loss_norm: Literal["squared", "norm"] = "squared",
                 meanflow_cfg_scale: float = 1.0, caption_dropout: float = 0.1, teacher: ModelSpec | None = None,
                 critic: ModelSpec | None = None, teacher_cfg_scale: float = 3.0, negative_prompt: str = "",
                 dmd_shift: float = 5.0, min_timestep: float = 1.0, max_timestep: float = 999.0,
                 critic_updates_per_generator_update: int = 5, gan_weight: float = 0.0,
                 gan_layers: list[int] | None = None, gan_channels: int = 64, lora: LoraSpec | None = None,
                 generator_optimizer: OptimizerCallable = torch.optim.AdamW,
                 critic_optimizer: OptimizerCallable = torch.optim.AdamW, warmup_steps: int = 0,
                 max_grad_norm: float = 1.0, rewards: list[dict[str, Any]] | None = None,
                 reward_combine: Literal["weighted_sum", "zscore_sum"] = "weighted_sum", seed: int = 0) -> None:
        super().__init__()
        if stage not in _STAGES:
            raise ValueError(f"stage must be one of {_STAGES}, got {stage!r}")
        if head_time not in ("inner", "outer"):
            raise ValueError(f"head_time must be 'inner' or 'outer', got {head_time!r}")
        if not 0.0 <= p_equal <= 1.0:
            raise ValueError(f"p_equal must be in [0, 1], got {p_equal}")
        if not 0.0 <= caption_dropout < 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1), got {caption_dropout}")
        if not 0.0 < fd_delta < 0.5:
            raise ValueError(f"fd_delta must be in (0, 0.5), got {fd_delta}")
        if loss_c is not None and loss_c < 0:
            raise ValueError(f"loss_c must be >= 0 (or None for the latent dimension), got {loss_c}")
        if loss_norm not in LOSS_NORMS:
            raise ValueError(f"loss_norm must be one of {LOSS_NORMS} ('squared': the paper's ||e||^2 + c; 'norm': "
                             f"FastGen's ||e|| + c), got {loss_norm!r}")
        if critic_updates_per_generator_update < 1:
            raise ValueError(f"critic_updates_per_generator_update must be >= 1, got "
                             f"{critic_updates_per_generator_update}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        if gan_weight < 0 or (gan_weight > 0 and stage != "dmd"):
            raise ValueError(f"gan_weight must be >= 0 and applies to stage 'dmd' only; got {gan_weight} in stage "
                             f"{stage!r}")
        init_method(self, generator, rewards, reward_combine, ignore=("generator_optimizer", "critic_optimizer"))
        self.sampler = TransitionConfig(outer_steps=outer_steps, inner_steps=inner_steps, outer_shift=outer_shift,
                                        inner_shift=inner_shift, t_max=t_max,
                                        parameterization=parameterization)  # validates M, N, shifts, t_max
        teacher = ModelSpec(**teacher) if isinstance(teacher, dict) else teacher
        critic = ModelSpec(**critic) if isinstance(critic, dict) else critic
        needs_teacher = stage == "dmd" or meanflow_cfg_scale != 1.0
        if needs_teacher and self.generator_spec.family != "dit" and teacher is None:
            raise ValueError(f"a {self.generator_spec.family!r} student needs an explicit teacher transformer spec in "
                             f"stage {stage!r}{' (meanflow_cfg_scale != 1)' if stage == 'meanflow' else ''}, e.g. "
                             f"{{model_class: diffusers.WanTransformer3DModel, pretrained: <folder>, subfolder: "
                             f"transformer}}")
        self.teacher_spec = (teacher or ModelSpec(pretrained=self.generator_spec.pretrained)) if needs_teacher \
            else None
        if self.teacher_spec is not None and self.teacher_spec.pretrained is None and not self.teacher_spec.config:
            raise ValueError("TMD needs a teacher here: give teacher.pretrained (or a student with pretrained weights)")
        self.critic_spec = critic
        self.generator_factory, self.critic_factory = generator_optimizer, critic_optimizer
        self.flow_head: FlowHead | None = None
        self.critic: torch.nn.Module | None = None
        self.gan_heads: FeatureGANHeads | None = None
        self._negative: Conditioning | None = None

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        """Build the student (transformer + flow head), and the teacher / critic the stage needs (once)."""
        if self.generator is not None:
            return
        h = self.hparams
        if h.head_init is not None and not (Path(h.head_init) / HEAD_WEIGHTS_FILE).is_file():
            state = "does not exist" if not Path(h.head_init).exists() else f"holds no {HEAD_WEIGHTS_FILE}"
            raise FileNotFoundError(f"head_init {str(h.head_init)!r} {state}: stage 2 starts from the export of a TMD "
                                    f"stage-1 run (stage: meanflow); run it first (e.g. genrl fit --config "
                                    f"configs/tmd/shapes_meanflow.yaml writes runs/tmd_shapes_meanflow/export), or "
                                    f"set head_init: null for a fresh head")
        gen = self.roles.trainable("generator", build_policy(self.generator_spec, h.lora))
        adapter = trunk_adapter(gen)
        head = FlowHead(adapter, num_layers=h.head_layers, gate_init=h.gate_init, head_time=h.head_time)
        if h.head_init is not None:
            saved = load_head(head, h.head_init)
            wrong = {k: (saved[k], h[k]) for k in ("head_layers", "head_time", "parameterization")
                     if k in saved and saved[k] != h[k]}
            if wrong:
                raise ValueError(f"the flow head in head_init {str(h.head_init)!r} was trained with "
                                 + ", ".join(f"{k}={a!r}" for k, (a, _) in wrong.items()) + "; this run sets "
                                 + ", ".join(f"{k}={b!r}" for k, (_, b) in wrong.items())
                                 + ": use the stage-1 values (the head is tied to its split point and inner flow)")
        self.roles.trainable("flow_head", head)
        if self.teacher_spec is not None:
            teacher = self.roles.frozen("teacher", self.teacher_spec.build())
            if h.stage == "dmd":
                critic = self.critic_spec.build() if self.critic_spec is not None else copy.deepcopy(teacher)
                self.roles.trainable("critic", critic.requires_grad_(True).train())
                if h.gan_weight > 0:
                    layers = self.gan_layers
                    with swapped_transformer(gen, teacher):
                        width = trunk_adapter(gen).hidden_size
                    self.roles.trainable("gan_heads", FeatureGANHeads(width, len(layers), h.gan_channels))
        self.scorer.build(trainer_of(self))

    def configure_optimizers(self):
        h = self.hparams
        if h.stage == "meanflow":
            opt = role_optimizers(self, joined={"generator": ["flow_head"]}, generator=self.generator_factory)[0]
            return linear_warmup(opt, h.warmup_steps)
        joined = {"generator": ["flow_head"], **({"critic": ["gan_heads"]} if self.gan_heads is not None else {})}
        return role_optimizers(self, joined=joined, generator=self.generator_factory, critic=self.critic_factory)

    # ------------------------------------------------------------------ helpers
    @property
    def student(self) -> TransitionModel | None:
        """The student as the sampler sees it: a view over the ``generator`` and ``flow_head`` roles (built per access,
        so it holds no network of its own), or None before :meth:`configure_model`."""
        return None if self.generator is None else TransitionModel(self.generator, self.flow_head)

    @property
    def frame_dim(self) -> int:
        return int(getattr(self.generator, "frame_dim", 1))

    @property
    def effective_nfe(self) -> float:
        """M (1 + (N - 1) H / L) of the configured sampler."""
        return effective_nfe(self.sampler.outer_steps, self.sampler.inner_steps, self.student.head_layers,
                             self.student.num_layers)

    @property
    def gan_layers(self) -> list[int]:
        """The teacher block counts the GAN heads tap (``gan_layers``, or the default for this L).

        Raises:
            ValueError: an entry outside 1 .. L (naming the option).
        """
        return gan_layers_for(self.student.num_layers, self.hparams.gan_layers)

    def gan_logits(self, x_sigma: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """GAN logits [B] (float32) of noised latents ``x_sigma`` at ``sigma`` [B]: the heads on the frozen teacher's
        features at :attr:`gan_layers` (differentiable w.r.t. ``x_sigma`` and the heads)."""
        return teacher_gan_logits(self.gan_heads, self.generator, self.roles.get("teacher"), x_sigma, sigma, cond,
                                  self.gan_layers)

    def _teacher(self) -> ScoreRole:
        return ScoreRole(self.generator, self.roles.get("teacher"))

    def _outer_point(self, x0: torch.Tensor, idx: torch.Tensor, it: int):
        """(t_i [B], x1, x_{t_i}) of iteration ``it`` (:func:`~genrl.flow.tmd.sample_outer_point` on the outer grid)."""
        grid = transition_grid(self.sampler.outer_steps, self.sampler.outer_shift, self.sampler.t_max)
        return sample_outer_point(x0, grid, mix_seed(self.hparams.seed, it), idx, _S_OUTER, _S_X1,
                                  frame_dim=self.frame_dim)

    # ------------------------------------------------------------------ stage 1
    def meanflow_loss(self, x0: torch.Tensor, prompts: list[str], idx: torch.Tensor, it: int) -> dict:
        """One TM-MeanFlow step's loss on data latents x0 [B, *latent] (:func:`~genrl.flow.tmd.tm_meanflow_loss`;
        with ``meanflow_cfg_scale`` w != 1, y = x1 - x0 is shifted by w - 1 times the frozen teacher's guidance
        direction v_T(x_t, c) - v_T(x_t, null), so that E[y | x_t] is the guided teacher velocity)."""
        h = self.hparams
        seed = mix_seed(h.seed, it)
        prompts = caption_dropout(prompts, h.caption_dropout, seed, idx, _S_DROPOUT, h.negative_prompt)
        cond = self.generator.encode_prompts(prompts)
        t, x1, x_t = self._outer_point(x0, idx, it)
        y = x1 - x0
        if h.meanflow_cfg_scale != 1.0:
            with torch.no_grad():
                teacher = self._teacher()
                v_c = teacher.velocity(x_t, t, cond).float()
                v_u = teacher.velocity(x_t, t, negative_cond(self, len(prompts))).float()
                y = y + (cfg_combine(v_c, v_u, h.meanflow_cfg_scale) - v_c)
        inner = transition_grid(self.sampler.inner_steps, self.sampler.inner_shift, self.sampler.t_max)
        s, r = sample_inner_times(seed, idx, 0, inner, shift=h.inner_time_shift, p_equal=h.p_equal, device=x0.device)
        y1 = randn_per_sample(x0.shape[1:], seed, idx, stream=_S_INNER_NOISE, device=x0.device)
        feats = self.student.features(x_t, t, cond)
        return tm_meanflow_loss(lambda y_s, s_: self.student.head(y_s, s_, r, feats, t).float(), y, y1, s, r,
                                h.parameterization, h.fd_delta, h.loss_c, h.loss_norm)

    # ------------------------------------------------------------------ stage 2
    def student_sample(self, x0: torch.Tensor, cond: Conditioning, idx: torch.Tensor, it: int) -> torch.Tensor:
        """The generator's x_hat = x_{t_i} - t_i y_hat [B, *latent] with y_hat from all N inner steps, with gradients
        through the head and the backbone (DMD2-v with flow-head rollout)."""
        t, _, x_t = self._outer_point(x0, idx, it)
        feats = self.student.features(x_t, t, cond)
        inner = transition_grid(self.sampler.inner_steps, self.sampler.inner_shift, self.sampler.t_max)
        y1 = randn_per_sample(x0.shape[1:], mix_seed(self.hparams.seed, it), idx, stream=_S_INNER_NOISE,
                              device=x0.device)
        y_hat = inner_flow(self.student, feats, t, y1, inner, self.hparams.parameterization)
        return outer_step(x_t, t, 0.0, y_hat.float())

    def vsd_step_loss(self, x_hat: torch.Tensor, cond: Conditioning, idx: torch.Tensor, it: int) -> dict:
        """DMD2-v's VSD loss of the generator's samples x_hat (with their graph)."""
        h = self.hparams
        sigma, eps, x_sigma = dmd_noised(x_hat, idx, mix_seed(h.seed, it), _S_DMD, h.dmd_shift, h.min_timestep,
                                         h.max_timestep, frame_dim=self.frame_dim)
        with torch.no_grad():
            x0_fake = ScoreRole(self.generator, self.critic).x0(x_sigma, sigma, cond)
            w = h.teacher_cfg_scale
            x0_real = real_x0(self._teacher(), x_sigma, sigma, cond, w, negative_cond(self, len(cond)) if w != 1.0
                              else None)
        g = vsd_gradient(x0_fake, x0_real)
        out = {"loss": vsd_loss(x_hat, g), "g_rms": g.float().pow(2).mean().sqrt()}
        if self.gan_heads is not None:  # the non-saturating term through the teacher's features of x_sigma(x_hat)
            x_graph = add_noise(x_hat.float(), eps, sigma, frame_dim=self.frame_dim)  # x_sigma, with x_hat's graph
            out["gan"] = gan_generator_loss(self.gan_logits(x_graph, sigma, cond))
            out["loss"] = out["loss"] + h.gan_weight * out["gan"]
        return out

    def critic_step_loss(self, x_hat: torch.Tensor, cond: Conditioning, idx: torch.Tensor, it: int,
                         x0: torch.Tensor | None = None) -> dict:
        """The critic's flow-matching step on the student's samples (:func:`~genrl.methods.distill.critic_fm_step`,
        as DMD's); with GAN heads, plus their logistic loss on the teacher's features of the data latents ``x0``
        (real) and the samples (fake), both noised at the critic's sigma (independent noises)."""
        h = self.hparams
        seed = mix_seed(h.seed, it)
        out = critic_fm_step(self.generator, self.critic, x_hat, cond, idx, seed, _S_CRITIC, h.dmd_shift,
                             h.min_timestep, h.max_timestep, self.frame_dim)
        if self.gan_heads is not None:
            if x0 is None:
                raise ValueError("the GAN heads need the batch's data latents x0 (the real samples)")
            eps_real = randn_per_sample(x0.shape[1:], seed, idx, stream=_S_GAN_REAL, device=x0.device)
            real = add_noise(x0.float(), eps_real, out["sigma"], frame_dim=self.frame_dim)
            gan = gan_critic_term(self.gan_heads, self.generator, self.roles.get("teacher"), real, out["x_sigma"],
                                  out["sigma"], cond, self.gan_layers)
            out.update(gan=gan["loss"], gan_accuracy=gan["accuracy"], loss=out["loss"] + gan["loss"])
        return out

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        x0, prompts, idx = video_batch(self, batch)
        it = int(self.iteration)
        bs = len(prompts)
        if self.hparams.stage == "meanflow":
            out = self.meanflow_loss(x0, prompts, idx, it)
            backward_step(self, self.optimizers(), out["loss"], "student", " or check the data latents")
            sched = self.lr_schedulers()
            if sched is not None:
                sched.step()
            self.log("train/loss", out["loss"].detach(), prog_bar=True, batch_size=bs)
            self.log("train/mse", out["mse"], batch_size=bs)
            self.log("train/r_equal_s", out["r_equal_s"], batch_size=bs)
        else:
            opt_g, opt_c = self.optimizers()
            cond = self.generator.encode_prompts(prompts)
            if it % self.hparams.critic_updates_per_generator_update == 0:
                x_hat = self.student_sample(x0, cond, idx, it)
                out = self.vsd_step_loss(x_hat, cond, idx, it)
                backward_step(self, opt_g, out["loss"], "generator", _HINT, counted=False)  # the critic's counts
                self.log("train/generator_loss", out["loss"].detach(), batch_size=bs)
                self.log("train/vsd_grad_rms", out["g_rms"], batch_size=bs)
                if "gan" in out:
                    self.log("train/gan_generator_loss", out["gan"].detach(), batch_size=bs)
                x_hat = x_hat.detach()
            else:
                with torch.no_grad():
                    x_hat = self.student_sample(x0, cond, idx, it)
            out_c = self.critic_step_loss(x_hat, cond, idx, it, x0)
            backward_step(self, opt_c, out_c["loss"], "critic", _HINT)
            if "gan" in out_c:
                self.log("train/gan_discriminator_loss", out_c["gan"].detach(), batch_size=bs)
                self.log("train/gan_accuracy", out_c["gan_accuracy"], batch_size=bs)
            self.log("train/critic_loss", out_c["loss"].detach(), prog_bar=True, batch_size=bs)
        self.iteration += 1
        self.log("train/iteration", float(self.iteration), batch_size=bs)

    # ------------------------------------------------------------------ sampling / validation / export
    @torch.no_grad()
    def generate(self, prompts: list[str], latent_shape, indices: torch.Tensor | None = None,
                 config: TransitionConfig | None = None) -> torch.Tensor:
        """Videos [B, T, C, H, W] in [0, 1] from the transition sampler (default: the configured M, N)."""
        cond = self.generator.encode_prompts(prompts)
        idx = torch.arange(len(prompts)) if indices is None else torch.as_tensor(indices).cpu()
        out = transition_rollout(self.student, cond, tuple(latent_shape), self.hparams.seed, idx,
                                 config or self.sampler)
        return self.generator.decode(out.latents)

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        latent_shape = self.generator.encode(batch["pixels"][:1]).shape[1:]
        videos = self.generate(prompts, latent_shape, batch.get("index"))
        self.log("val/effective_nfe", self.effective_nfe, batch_size=len(prompts))
        return log_validation_rewards(self, self.scorer, videos, prompts)

    def export_extra(self, dirpath: str, write: bool = True) -> None:
        """Write the flow head (``flow_head.safetensors``) and its config with the sampler (``flow_head.json``) into
        an export folder (called by :class:`~genrl.callbacks.DiffusersExport` on every rank that exports; under FSDP2
        the head's full weights are gathered first, a collective, and only ``write`` ranks write)."""
        state = full_state_dict(self.flow_head)
        if not write:
            return
        h, c = self.hparams, self.sampler
        save_head(state, dirpath, {
            "head_layers": h.head_layers, "head_time": h.head_time, "gate_init": h.gate_init,
            "parameterization": h.parameterization, "outer_steps": c.outer_steps, "inner_steps": c.inner_steps,
            "outer_shift": c.outer_shift, "inner_shift": c.inner_shift, "t_max": c.t_max,
            "effective_nfe": self.effective_nfe})

