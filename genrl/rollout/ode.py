"""Deterministic probability-flow ODE sampling with classifier-free guidance (the evaluation sampler)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from genrl.models.generator import Generator
from genrl.rollout.sampler import RolloutConfig, rollout

__all__ = ["sample_ode"]


@torch.no_grad()
def sample_ode(
    generator: Generator,
    prompts: list[str],
    latent_shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor | None = None,
    num_steps: int = 20,
    shift: float = 1.0,
    cfg_scale: float = 1.0,
    null_prompt: str = "",
    micro_batch_size: int = 32,
    progress: bool = False,
) -> torch.Tensor:
    """Sample latents by Euler integration of dx/dsigma = v from sigma = 1 to 0 (Lipman et al. 2023).

    A thin front of :func:`genrl.rollout.sampler.rollout` with the ``"ode"`` kernel. Guidance is the
    standard form ``v = v_uncond + w (v_cond - v_uncond)`` (Ho & Salimans 2022); ``w = 1`` runs the
    conditional model only. Initial noise of sample i comes from (seed, indices[i]), so a sample is the
    same whatever batch it is drawn in.

    Args:
        generator: any :class:`~genrl.models.generator.Generator`.
        prompts: B prompts.
        latent_shape: per-sample latent shape, e.g. (T, C, H, W).
        seed: run seed; indices: per-sample indices (default 0..B-1).
        num_steps: Euler steps; shift: sigma-schedule shift s (sigma' = s sigma / (1 + (s - 1) sigma)).
        cfg_scale: guidance scale w (>= 0).
        micro_batch_size: samples per network call.
    Returns:
        latents [B, *latent_shape] float32 on the generator's device.
    Raises:
        ValueError: num_steps < 1, negative cfg_scale, or len(indices) != len(prompts).
    """
    config = RolloutConfig(num_steps=num_steps, shift=shift, kernel="ode", cfg_scale=cfg_scale,
                           null_prompt=null_prompt, micro_batch_size=micro_batch_size)
    return rollout(generator, prompts, latent_shape, seed, indices, config, record=False, progress=progress).final
