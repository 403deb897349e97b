"""Pieces the distillation methods compose (DMD / Self-Forcing, AFD, ODE init, and the reward-weighted DMD of
Stream-R1 later): the causal student's rollouts (with the Self-Forcing exit step), causal sampling for validation,
and the score roles (teacher / real score, critic / fake score) evaluated through the student's generator.

docs/methods/distillation.md describes the methods; docs/new_method.md how they are composed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from lightning.pytorch import LightningModule
from torch import nn

from genrl.flow import add_noise, x0_from_velocity
from genrl.flow.guidance import cfg_combine
from genrl.methods.common import trainer_of
from genrl.models.roles import swapped_transformer
from genrl.models.text_encoder import Conditioning
from genrl.noise import rand_per_sample
from genrl.rollout.autoregressive import ARResult, ChunkSchedule, ar_rollout, sample_exit_step

__all__ = ["ScoreRole", "causal_samples", "chunk_noise_levels", "exit_step_of", "paired_instance_noise", "real_x0",
           "student_rollout"]


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


def paired_instance_noise(teacher: torch.Tensor, student: torch.Tensor, samples_per_prompt: int, max_sigma: float,
                          seed: int, frame_dim: int = 1):
    """Instance noise for a prompt-paired discriminator (teacher clip b is compared with its K student samples):
    sigma_b ~ U[0, max_sigma] per teacher clip, shared by its K students, fresh Gaussian noise per clip, inputs noised
    as x_sigma = (1 - sigma) x + sigma eps. All drawn from one CPU generator seeded with ``seed``.

    Args:
        teacher: [B, *latent]; student: [B * K, *latent] (teacher b's samples at rows b K .. b K + K - 1).
    Returns:
        ``(sigma_teacher [B], noised teacher, sigma_student [B * K], noised student)``; with ``max_sigma <= 0`` the
        clean inputs and None sigmas.
    """
    if max_sigma <= 0:
        return None, teacher, None, student
    g = torch.Generator().manual_seed(seed)
    sig_t = (torch.rand(teacher.shape[0], generator=g) * max_sigma).to(teacher.device)
    eps_t = torch.randn(teacher.shape, generator=g).to(teacher.device)
    eps_s = torch.randn(student.shape, generator=g).to(student.device)
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
