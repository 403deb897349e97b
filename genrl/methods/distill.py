"""Pieces the distillation methods compose (DMD / Self-Forcing, AFD, ODE init, and the reward-weighted DMD of
Stream-R1 later): the causal student's rollouts (with the Self-Forcing exit step), causal sampling for validation,
and the score roles (teacher / real score, critic / fake score) evaluated through the student's generator.

docs/methods/distillation.md describes the methods; docs/new_method.md how they are composed.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Sequence
from typing import Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from genrl.flow import add_noise, x0_from_velocity
from genrl.flow.dmd import critic_loss, gan_discriminator_loss, sample_dmd_sigma
from genrl.flow.guidance import cfg_combine
from genrl.flow.losses import flow_matching_loss
from genrl.flow.nft import advantage_to_r, bt_loss, centered_advantages, r1_penalty, r2_penalty
from genrl.methods.common import build_student, gather_batch, rank_slice, trainer_of
from genrl.models.compile import is_compiled
from genrl.models.conditions import null_prompts, prompt_image
from genrl.models.roles import swapped_transformer
from genrl.models.text_encoder import Conditioning
from genrl.models.trunk import trunk_adapter
from genrl.noise import rand_per_sample, randn_per_sample, sample_generator, stream_id
from genrl.rollout.autoregressive import ARResult, ChunkSchedule, ar_rollout, sample_exit_step, teacher_forced_velocity

__all__ = ["CAUSAL_INTERFACE", "SaturationMonitor", "ScoreRole", "causal_samples", "causal_videos",
           "chunk_noise_levels", "critic_fm_step", "negative_cond", "configure_student", "discriminator_advantages",
           "discriminator_loss", "dmd_noised", "exit_step_of",
           "gan_critic_term", "gan_layers_for", "paired_instance_noise", "real_x0", "student_rollout",
           "teacher_forced_fm_loss", "teacher_gan_logits"]

#: what a causal student generator provides (genrl's DiT, the ``wan_causal`` family): the KV cache, one chunk's
#: velocity against it, and the context pass that commits a finished chunk.
CAUSAL_INTERFACE = ("init_cache", "velocity_chunk", "commit")

# random streams of the paired instance noise (:func:`paired_instance_noise`)
_STREAM_PAIR_SIGMA, _STREAM_PAIR_TEACHER, _STREAM_PAIR_STUDENT = (stream_id("distill.pair_sigma"),
                                                                 stream_id("distill.pair_teacher"),
                                                                 stream_id("distill.pair_student"))
# random streams of the teacher flow-matching term (:func:`teacher_forced_fm_loss`): noise levels and noise
_STREAM_FM_SIGMA, _STREAM_FM_EPS = stream_id("distill.fm_sigma"), stream_id("distill.fm_eps")


def configure_student(method: LightningModule, build=build_student):
    """The ``configure_model`` prologue of a causal-student method (ODE init, DMD, AFD): build
    ``method.generator_spec`` with ``method.hparams.lora`` (``build``: :func:`~genrl.methods.common.build_student`,
    whose missing-folder error names the ODE-init stage), check the causal interface and that the chunk layout
    ``method.schedule.causal`` is a multiple of the transformer's temporal patch, make the generator block-causal
    (``generator.causal``), register it as the trainable role ``generator`` and build ``method.scorer``. Warns when
    the student is compiled (``generator.compile``): causal rollouts are not static (:mod:`genrl.models.compile`).

    Returns:
        the student, or None when the method was already configured.
    Raises:
        ValueError: a generator without :data:`CAUSAL_INTERFACE`, or chunk / window / sink sizes off the temporal
            patch (each names the value and the fix).
    """
    if method.generator is not None:
        return None
    generator = build(method.generator_spec, method.hparams.get("lora"))
    missing = [a for a in CAUSAL_INTERFACE if not hasattr(generator, a)]
    if missing:
        raise ValueError(f"the {type(generator).__name__} student lacks the causal interface {missing}; use a "
                         f"causal adapter (genrl's DiT, or a family such as 'wan_causal')")
    patch = getattr(getattr(generator.transformer, "config", None), "patch_size", None)
    if isinstance(patch, (list, tuple)) and len(patch) == 3:
        method.schedule.causal.check_patch(int(patch[0]))
    generator.causal = method.schedule.causal
    if is_compiled(generator.transformer):
        warnings.warn("generator.compile is on for a causal student: chunk-wise rollouts with a KV cache change "
                      "shapes every chunk and break the graph on the cache bookkeeping, so they recompile per chunk "
                      "(then run eager past dynamo's recompile_limit) and are slower than eager; set "
                      "model.init_args.generator.compile=false", stacklevel=2)
    method.roles.trainable("generator", generator)
    method.scorer.build(trainer_of(method))
    return generator


class ScoreRole:
    """A bidirectional score network (teacher or critic) evaluated through a generator's ``velocity``.

    The generator supplies the input handling (layout, per-frame sigma, timestep = 1000 sigma) and the text
    conditioning; the role supplies its own transformer, swapped in for the call. So a 14B teacher and a 1.3B
    student share one text encoder and VAE.
    """

    def __init__(self, generator: nn.Module, transformer: nn.Module) -> None:
        self.generator = generator
        self.transformer = transformer

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Bidirectional velocity of this role at ``x`` (generator layout), sigma [B] (or per frame)."""
        with swapped_transformer(self.generator, self.transformer) as gen:
            return gen.velocity(x, sigma, cond, attention="bidirectional")

    def x0(self, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """Clean-sample prediction x0 = x_t - sigma v (float32) of this role, no guidance."""
        return x0_from_velocity(x_t.float(), sigma, self.velocity(x_t, sigma, cond).float())


@torch.no_grad()
def real_x0(teacher: ScoreRole, x_t: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, cfg_scale: float,
            negative: Conditioning | None) -> torch.Tensor:
    """Teacher (real score) x0 prediction with CFG in the standard form v_u + w (v_c - v_u) at x_t, sigma [B]
    (``negative``: the unconditional prompt's conditioning, B rows; unused when w = 1), float32."""
    v_c = teacher.velocity(x_t, sigma, cond).float()
    if cfg_scale != 1.0:
        v_c = cfg_combine(v_c, teacher.velocity(x_t, sigma, negative).float(), cfg_scale)
    return x0_from_velocity(x_t.float(), sigma, v_c)


def negative_cond(method: LightningModule, n: int, prompts: list[str] | None = None) -> Conditioning:
    """``n`` rows of the conditioning of ``method.hparams.negative_prompt`` (the unconditional prompt of a teacher's
    CFG), encoded once per device by ``method.generator`` and cached on ``method._negative``. With ``prompts`` that
    carry images (image-to-video), each row is the negative prompt with that prompt's image: CFG drops only the text
    (:func:`genrl.models.conditions.null_prompts`)."""
    if prompts is not None and any(prompt_image(p) is not None for p in prompts):
        return method.generator.encode_prompts(null_prompts(list(prompts), method.hparams.negative_prompt))
    cached = getattr(method, "_negative", None)
    if cached is None or cached.hidden_states.device != method.device:
        cached = method._negative = method.generator.encode_prompts([method.hparams.negative_prompt])
    return cached.select([0] * n)


def exit_step_of(module: LightningModule, num_steps: int, seed: int, iteration: int,
                 mode: Literal["uniform", "last"] = "uniform") -> int:
    """The Self-Forcing exit step of ``iteration``, drawn on rank 0 and broadcast through the trainer's strategy
    (:func:`genrl.rollout.autoregressive.sample_exit_step`)."""
    trainer = trainer_of(module)
    if trainer is None or trainer.world_size == 1:
        return sample_exit_step(num_steps, seed, iteration, mode, broadcast=None, rank=0)
    return sample_exit_step(num_steps, seed, iteration, mode, broadcast=trainer.strategy.broadcast,
                            rank=trainer.global_rank)


def student_rollout(generator, cond: Conditioning, schedule: ChunkSchedule, num_frames: int,
                    frame_shape: Sequence[int], seed: int, indices: torch.Tensor, exit_step: int | None = None,
                    grad_window_frames: int | None = None) -> ARResult:
    """The causal student's chunk-by-chunk rollout with its KV cache: without gradient, or (``exit_step`` given)
    under the Self-Forcing gradient policy (one exit step for every chunk; only that forward carries a graph,
    optionally only in the last ``grad_window_frames`` frames; Huang et al. 2025, sec. 3.2-3.3)."""
    return ar_rollout(generator, cond, schedule.causal.num_chunks(num_frames), frame_shape, schedule, seed=seed,
                      indices=indices, grad="self_forcing" if exit_step is not None else "none", exit_step=exit_step,
                      grad_window_frames=grad_window_frames)


@torch.no_grad()
def causal_samples(generator, prompts: list[str], indices, schedule: ChunkSchedule, num_chunks: int,
                   frame_shape: Sequence[int], seed: int) -> torch.Tensor:
    """Latents [B, *latent] of ``num_chunks`` chunks sampled causally (validation, prediction)."""
    cond = generator.encode_prompts(list(prompts))
    idx = None if indices is None else torch.as_tensor(indices).cpu()
    return ar_rollout(generator, cond, num_chunks, frame_shape, schedule, seed=seed, indices=idx).latents


@torch.no_grad()
def causal_videos(generator, prompts: list[str], indices, schedule: ChunkSchedule, num_frames: int,
                  frame_shape: Sequence[int], seed: int) -> torch.Tensor:
    """Decoded videos, pixels [B, T, C, H, W] in [0, 1], of ``num_frames`` latent frames (a chunk boundary) sampled
    causally with ``schedule`` (:func:`causal_samples`; validation and prediction of the student methods)."""
    num_chunks = schedule.causal.num_chunks(num_frames)
    return generator.decode(causal_samples(generator, prompts, indices, schedule, num_chunks, frame_shape, seed))


def dmd_noised(x: torch.Tensor, indices: torch.Tensor, seed: int, stream: int, shift: float, min_timestep: float,
               max_timestep: float, frame_dim: int = 1):
    """The DMD / critic noising of student samples x [B, *latent]: sigma [B] from DMD's shifted, clamped timestep
    draw (:func:`genrl.flow.dmd.sample_dmd_sigma`), eps ~ N(0, I), x_sigma = (1 - sigma) x + sigma eps (x detached,
    float32). Sample i's draws depend only on (seed, i, stream), so a batch split into accumulated micro-batches sees
    the same values. Returns ``(sigma, eps, x_sigma)``."""
    sigma = torch.cat([sample_dmd_sigma(1, sample_generator(seed, int(i), 0, stream), shift, min_timestep,
                                        max_timestep) for i in indices]).to(x.device)
    eps = randn_per_sample(x.shape[1:], seed, indices, step=1, stream=stream, device=x.device)
    return sigma, eps, add_noise(x.detach().float(), eps, sigma, frame_dim=frame_dim)


def critic_fm_step(generator: nn.Module, critic: nn.Module, x: torch.Tensor, cond: Conditioning,
                   indices: torch.Tensor, seed: int, stream: int, shift: float, min_timestep: float,
                   max_timestep: float, frame_dim: int = 1) -> dict[str, torch.Tensor]:
    """The critic's (fake score's) flow-matching step on student samples, shared by DMD and TMD's stage 2.

    x [B, *latent] (the student's samples; detached and cast to float32 here) is noised by :func:`dmd_noised`
    (sigma [B] from DMD's shifted, clamped timestep draw, eps ~ N(0, I), both addressed by (seed, sample index,
    stream)); the critic's velocity v at (x_sigma, sigma), evaluated through ``generator``'s input handling
    (:class:`ScoreRole`, bidirectional), regresses eps - x without time weighting (:func:`genrl.flow.dmd.critic_loss`:
    ``mean (v - (eps - x))^2``). Source: DMD2's fake-score update (Yin et al. 2024b); Self-Forcing's FlowPredLoss.

    Args:
        generator: the student's generator (layout, timestep scaling, text conditioning).
        critic: the critic's transformer (swapped into ``generator`` for the call).
        x: the student's samples [B, *latent]; cond: their conditioning (B rows).
        indices: the samples' global ids [B]; seed: the iteration's mixed seed; stream: the noise stream.
        shift, min_timestep, max_timestep: the timestep draw (:func:`genrl.flow.dmd.sample_dmd_sigma`).
        frame_dim: the latents' frame dim.

    Returns:
        ``{"loss": 0-d float32 with graph in the critic, "sigma": [B], "eps": shape of x, "x_sigma": shape of x}``
        (the last three detached: the noising, for terms that reuse it, e.g. TMD's GAN heads).

    Raises:
        ValueError: as :func:`genrl.flow.dmd.critic_loss` (shapes).
    """
    x = x.detach().float()
    sigma, eps, x_sigma = dmd_noised(x, indices, seed, stream, shift, min_timestep, max_timestep, frame_dim=frame_dim)
    v = ScoreRole(generator, critic).velocity(x_sigma, sigma, cond)
    return {"loss": critic_loss(v, x, eps, frame_dim=frame_dim), "sigma": sigma, "eps": eps, "x_sigma": x_sigma}


def discriminator_loss(discriminator: nn.Module, teacher: torch.Tensor, student: torch.Tensor, cond_t: Conditioning,
                       cond_s: Conditioning, samples_per_prompt: int, r1_weight: float = 0.0, r2_weight: float = 0.0,
                       noise_max: float = 0.0, seed: int = 0, frame_dim: int = 1, indices: torch.Tensor | None = None,
                       mismatch_weight: float = 0.0, mismatch_valid: torch.Tensor | None = None,
                       label_smoothing: float = 0.0):
    """Bradley-Terry loss of a prompt-paired discriminator (AFD): softplus(-(D(y_b) - D(x_bk))) over teacher clips y
    [B, *latent] each repeated for its K = ``samples_per_prompt`` student samples x [B K, *latent]
    (:func:`genrl.flow.nft.bt_loss`), + ``r1_weight`` R1 on the teacher + ``r2_weight`` R2 on the students (gradient
    penalties, Mescheder et al. 2018), on inputs with the paired instance noise of :func:`paired_instance_noise`
    (``noise_max`` > 0, addressed by ``seed`` and the teacher clips' global ``indices``). ``discriminator.score(latents,
    cond, sigma=, frame_dim=, double_backward=)`` -> [N].

    Two regularisers of what D keys on (docs/methods/distillation.md, "AFD", keeping the discriminator informative):

    * ``mismatch_weight`` > 0 adds the matching-aware term of conditional GANs (Reed et al. 2016, GAN-INT-CLS) in
      paired form: teacher clip b must beat the batch's previous teacher clip y_{b-1} under prompt b,
      softplus(-(D(y_b, c_b) - D(y_{b-1}, c_b))), over the pairs where ``mismatch_valid`` [B] (bool: the two prompts
      differ) holds. A score that ignores the prompt cannot lower it, so D must learn what the prompt asks for.
    * ``label_smoothing`` eps in [0, 1/2): the BT target is 1 - eps instead of 1, (1 - eps) softplus(-g) + eps
      softplus(g) for each gap g (one-sided smoothing, Salimans et al. 2016): gaps stop growing at log((1-eps)/eps).

    Returns:
        (0-d loss with graph in the discriminator, detached accuracy: the fraction of pairs with D(y) > D(x)).
    """
    use_r1, use_r2 = r1_weight > 0, r2_weight > 0
    sig_t, teacher, sig_s, student = paired_instance_noise(teacher, student, samples_per_prompt, noise_max, seed,
                                                           frame_dim, indices)
    y = teacher.detach().requires_grad_(use_r1)
    x = student.detach().requires_grad_(use_r2)
    s_y = discriminator.score(y, cond_t, sigma=sig_t, frame_dim=frame_dim, double_backward=use_r1 or None)
    s_x = discriminator.score(x, cond_s, sigma=sig_s, frame_dim=frame_dim, double_backward=use_r2 or None)
    s_y_rep = s_y.repeat_interleave(samples_per_prompt)

    def smoothed(pos, neg):
        loss = bt_loss(pos, neg, reduction="none")
        if label_smoothing <= 0:
            return loss
        return (1 - label_smoothing) * loss + label_smoothing * bt_loss(neg, pos, reduction="none")

    loss = smoothed(s_y_rep, s_x).mean()
    if mismatch_weight > 0 and teacher.shape[0] > 1:
        valid = (torch.ones(teacher.shape[0], dtype=torch.bool) if mismatch_valid is None
                 else mismatch_valid.to(torch.bool).cpu())
        if bool(valid.any()):
            y_wrong = teacher.detach().roll(1, 0)
            s_wrong = discriminator.score(y_wrong, cond_t, sigma=None if sig_t is None else sig_t.roll(1, 0),
                                          frame_dim=frame_dim)
            loss = loss + mismatch_weight * smoothed(s_y, s_wrong)[valid.to(s_y.device)].mean()
    if use_r1:
        loss = loss + r1_weight * r1_penalty(s_y, y)
    if use_r2:
        loss = loss + r2_weight * r2_penalty(s_x, x)
    return loss, (s_y_rep > s_x).float().mean().detach()


@torch.no_grad()
def discriminator_advantages(module: LightningModule, discriminator: nn.Module, teacher: torch.Tensor,
                             student: torch.Tensor, cond_t: Conditioning, cond_s: Conditioning, samples_per_prompt: int,
                             clip_c: float, frame_dim: int = 1, group: torch.Tensor | None = None):
    """AFD's advantages: score gaps d = D(x_bk) - D(y_b) [B K], centred, std-normalised and clipped to [-C, C] over
    the batch gathered from every rank (:func:`genrl.flow.nft.centered_advantages`; this rank's slice), and the
    optimality probabilities r = 1/2 + A / (2C) (:func:`genrl.flow.nft.advantage_to_r`). With ``group`` [B K] (global
    prompt-slot ids) each prompt's K samples are centred on their own mean and scaled by the batch's std (DiffusionNFT's
    per-prompt baseline): only how the K rollouts of one prompt compare counts. Returns ``(d, A, r, s_x, s_y)``, the
    last two the student [B K] and teacher [B] scores."""
    s_x = discriminator.score(student, cond_s, frame_dim=frame_dim)
    s_y = discriminator.score(teacher, cond_t, frame_dim=frame_dim)
    d = s_x - s_y.repeat_interleave(samples_per_prompt)
    g = None if group is None else gather_batch(module, group.to(d.device))
    adv = rank_slice(module, centered_advantages(gather_batch(module, d), clip=clip_c, group=g,
                                                 std="global"), len(d)).to(d.device)
    return d, adv, advantage_to_r(adv, clip_c).to(d.device), s_x, s_y


class SaturationMonitor:
    """Watches a discriminator's training accuracy and warns once when it saturates.

    ``update(accuracy)`` keeps the last ``window`` accuracies (each in [0, 1]); it returns True when the window is
    full and its *mean* is above ``threshold`` (a mean, not every value: with 16 pairs per iteration one wrong pair
    gives 0.94), and the first time it does, it warns once (``rank_zero_warn``) naming ``knobs()``. A saturated
    discriminator separates nearly every (teacher, student) pair, so its score gaps rank the student's samples by
    whatever it keys on (docs/methods/distillation.md, AFD). ``state_dict`` / ``load_state_dict`` carry the window
    and the warned flag through a checkpoint.

    Raises:
        ValueError: ``window < 1``.
    """

    def __init__(self, name: str, threshold: float = 0.95, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"saturation_window must be >= 1, got {window}")
        self.name, self.threshold, self.window = name, float(threshold), int(window)
        self.recent: deque[float] = deque(maxlen=self.window)
        self.warned = False

    def update(self, accuracy: float, knobs=lambda: "") -> bool:
        self.recent.append(float(accuracy))
        saturated = len(self.recent) == self.window and sum(self.recent) / self.window > self.threshold
        if saturated and not self.warned:
            self.warned = True
            rank_zero_warn(
                f"{self.name}: the discriminator was right on more than {self.threshold:.0%} of (teacher, student) "
                f"pairs on average over the last {self.window} iterations (last {accuracy:.3f}); its score gaps now "
                f"rank the student's samples by whatever it keys on. Knobs: {knobs()} "
                f"(docs/methods/distillation.md, AFD).")
        return saturated

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "warned": self.warned}

    def load_state_dict(self, state: dict) -> None:
        self.recent.clear()
        self.recent.extend(state.get("recent", []))
        self.warned = bool(state.get("warned", False))


def teacher_forced_fm_loss(generator, schedule: ChunkSchedule, y: torch.Tensor, cond: Conditioning,
                           indices: torch.Tensor, seed: int, step: int, per_chunk: bool = True,
                           from_schedule: bool = True, frame_dim: int = 1) -> torch.Tensor:
    """Flow matching of a causal student on clean videos ``y`` [B, T, ...] (e.g. a black-box teacher's latents):
    one noise level per chunk (:func:`chunk_noise_levels`), eps ~ N(0, I), y_sigma = (1 - sigma) y + sigma eps, the
    teacher-forced velocity (clean earlier chunks as context,
    :func:`~genrl.rollout.autoregressive.teacher_forced_velocity`) regressed on eps - y (Lipman et al. 2023, eq. 9).
    Draws addressed by (seed, sample index, step). Returns the mean of :func:`~genrl.flow.losses.flow_matching_loss`,
    a 0-d float32 tensor with graph in the generator.

    Raises:
        ValueError: the frames do not split into chunks.
    """
    sigma = chunk_noise_levels(schedule, indices, seed, step, _STREAM_FM_SIGMA, y.shape[frame_dim], per_chunk,
                               from_schedule).to(y.device)
    eps = randn_per_sample(y.shape[1:], seed, indices, step=step, stream=_STREAM_FM_EPS, device=y.device)
    v = teacher_forced_velocity(generator, y, add_noise(y, eps, sigma, frame_dim=frame_dim), sigma, cond,
                                schedule.causal).float()
    return flow_matching_loss(v, y, eps, sigma, frame_dim=frame_dim).mean()


def paired_instance_noise(teacher: torch.Tensor, student: torch.Tensor, samples_per_prompt: int, max_sigma: float,
                          seed: int, frame_dim: int = 1, indices: torch.Tensor | None = None):
    """Instance noise for a prompt-paired discriminator (teacher clip b is compared with its K student samples):
    sigma_b ~ U[0, max_sigma] per teacher clip, shared by its K students, fresh Gaussian noise per clip and per student
    sample, inputs noised as x_sigma = (1 - sigma) x + sigma eps. Addressed (docs/architecture.md, Seeds and noise
    addressing): clip b's sigma and noise by (seed, indices[b]), its students' noises by (seed, indices[b] K + j), each
    on its own stream, so a clip's draws do not depend on the batch (or rank) it is in.

    Args:
        teacher: [B, *latent]; student: [B * K, *latent] (teacher b's samples at rows b K .. b K + K - 1).
        indices: the teacher clips' global ids [B] (default 0..B-1).
    Returns:
        ``(sigma_teacher [B], noised teacher, sigma_student [B * K], noised student)``; with ``max_sigma <= 0`` the
        clean inputs and None sigmas.
    """
    if max_sigma <= 0:
        return None, teacher, None, student
    idx = torch.arange(teacher.shape[0]) if indices is None else torch.as_tensor(indices).cpu().long().reshape(-1)
    s_idx = (idx[:, None] * samples_per_prompt + torch.arange(samples_per_prompt)[None]).flatten()
    sig_t = (rand_per_sample((), seed, idx, stream=_STREAM_PAIR_SIGMA) * max_sigma).to(teacher.device)
    eps_t = randn_per_sample(teacher.shape[1:], seed, idx, stream=_STREAM_PAIR_TEACHER, device=teacher.device)
    eps_s = randn_per_sample(student.shape[1:], seed, s_idx, stream=_STREAM_PAIR_STUDENT, device=student.device)
    sig_s = sig_t.repeat_interleave(samples_per_prompt)
    return (sig_t, add_noise(teacher, eps_t, sig_t, frame_dim=frame_dim), sig_s,
            add_noise(student, eps_s, sig_s, frame_dim=frame_dim))


def chunk_noise_levels(schedule: ChunkSchedule, indices: torch.Tensor, seed: int, step: int, stream: int,
                       num_frames: int, per_chunk: bool = True, from_schedule: bool = True) -> torch.Tensor:
    """Per-frame noise levels sigma [B, T] of a causal student's training sample: one level per chunk (diffusion
    forcing; ``per_chunk=False``: one per video), each one of the student's own step sigmas (``from_schedule``,
    where a few-step student is evaluated) or uniform in (0.02, 0.98). Addressed by (seed, sample index, step,
    stream), so any batch split draws the same values.

    Raises:
        ValueError: ``num_frames`` off a chunk boundary (from the chunk layout).
    """
    causal = schedule.causal
    chunks = causal.num_chunks(num_frames) if per_chunk else 1
    u = rand_per_sample((chunks,), seed, indices, step=step, stream=stream)
    if from_schedule:
        levels = schedule.sigmas()[:-1].float()
        u = levels[(u * len(levels)).long().clamp_max(len(levels) - 1)]
    else:
        u = 0.02 + 0.96 * u
    if not per_chunk:
        return u.expand(len(indices), num_frames).contiguous()
    return u.repeat_interleave(torch.tensor([causal.chunk_len(k) for k in range(chunks)]), dim=1)


# ---------------------------------------------------------------------------------------------- DMD2's GAN term
def gan_layers_for(num_layers: int, layers: Sequence[int] | None = None) -> list[int]:
    """The teacher block counts GAN heads tap: ``layers``, or ``[round(0.53 L), round(0.77 L), L]`` (Wan2.1-1.3B's
    16 / 23 / 30 of 30, TMD's DMD2-v layers), deduplicated.

    Raises:
        ValueError: an entry outside 1 .. L (naming ``gan_layers``).
    """
    n = num_layers
    out = list(layers) if layers else sorted({max(1, round(0.53 * n)), max(1, round(0.77 * n)), n})
    if any(not 1 <= k <= n for k in out):
        raise ValueError(f"gan_layers {out}: block counts of the teacher must be in 1 .. L = {n}")
    return out


def teacher_gan_logits(heads: nn.Module, generator: nn.Module, teacher: nn.Module, x_sigma: torch.Tensor,
                       sigma: torch.Tensor, cond: Conditioning, layers: list[int]) -> torch.Tensor:
    """GAN logits float32 [B] of noised latents ``x_sigma`` (generator layout) at ``sigma`` [B]: ``heads``
    (:class:`~genrl.models.discriminator.FeatureGANHeads`) on the frozen ``teacher``'s features after ``layers``
    blocks (:meth:`genrl.models.trunk.TrunkAdapter.features_at`, through ``generator``'s input handling).
    Differentiable w.r.t. ``x_sigma`` and the heads when gradients are enabled (DMD2, Yin et al. 2024, section 4.3)."""
    with swapped_transformer(generator, teacher) as gen:
        feats = trunk_adapter(gen).features_at(x_sigma, sigma, cond, layers)
    return heads(feats)


def gan_critic_term(heads: nn.Module, generator: nn.Module, teacher: nn.Module, real: torch.Tensor,
                    fake: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, layers: list[int]) -> dict:
    """The heads' logistic loss (:func:`genrl.flow.gan_discriminator_loss`) on noised data ``real`` against noised
    samples ``fake`` (both [B, *latent] at ``sigma`` [B]), the teacher's features computed without gradients (the
    heads train on fixed features). Returns ``{"loss": scalar, "accuracy": fraction of real logits > 0 and fake
    logits < 0, averaged}``."""
    with torch.no_grad(), swapped_transformer(generator, teacher) as gen:
        adapter = trunk_adapter(gen)
        f_real, f_fake = (adapter.features_at(v, sigma, cond, layers) for v in (real, fake))
    logit_real, logit_fake = heads(f_real), heads(f_fake)
    return {"loss": gan_discriminator_loss(logit_real, logit_fake),
            "accuracy": 0.5 * ((logit_real > 0).float().mean() + (logit_fake < 0).float().mean())}
