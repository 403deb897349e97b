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

from genrl.flow import x0_from_velocity
from genrl.flow.guidance import cfg_combine
from genrl.methods.common import trainer_of
from genrl.models.roles import swapped_transformer
from genrl.models.text_encoder import Conditioning
from genrl.rollout.autoregressive import ARResult, ChunkSchedule, ar_rollout, sample_exit_step

__all__ = ["ScoreRole", "causal_samples", "exit_step_of", "real_x0", "student_rollout"]


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
