"""Deterministic probability-flow ODE sampling with classifier-free guidance (the evaluation sampler)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from genrl.flow import cfg_combine, euler_step, sigma_schedule
from genrl.models.generator import Generator
from genrl.rollout.noise import randn_per_sample

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
    progress: bool = False,
) -> torch.Tensor:
    """Sample latents by Euler integration of dx/dsigma = v from sigma = 1 to 0 (Lipman et al. 2023).

    Guidance is the standard form ``v = v_uncond + w (v_cond - v_uncond)`` (Ho & Salimans 2022); ``w = 1``
    runs the conditional model only. Initial noise of sample i comes from (seed, indices[i]), so a sample
    is the same whatever batch it is drawn in.

    Args:
        generator: any :class:`~genrl.models.generator.Generator`.
        prompts: B prompts.
        latent_shape: per-sample latent shape, e.g. (T, C, H, W).
        seed: run seed; indices: per-sample indices (default 0..B-1).
        num_steps: Euler steps; shift: sigma-schedule shift s (sigma' = s sigma / (1 + (s - 1) sigma)).
        cfg_scale: guidance scale w (>= 0).
    Returns:
        latents [B, *latent_shape] float32 on the generator's device.
    Raises:
        ValueError: num_steps < 1, negative cfg_scale, or len(indices) != len(prompts).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if cfg_scale < 0:
        raise ValueError(f"cfg_scale must be >= 0, got {cfg_scale}")
    indices = list(range(len(prompts))) if indices is None else [int(i) for i in indices]
    if len(indices) != len(prompts):
        raise ValueError(f"{len(indices)} indices for {len(prompts)} prompts")
    device = generator.device
    x = randn_per_sample(latent_shape, seed, indices, device=device)
    cond = generator.encode_prompts(prompts)
    guided = cfg_scale != 1.0
    if guided:
        uncond = generator.encode_prompts([null_prompt] * len(prompts))
        from genrl.models.text_encoder import Conditioning

        both = Conditioning.cat([cond, uncond])
    sigmas = sigma_schedule(num_steps, shift=shift).to(device=device, dtype=torch.float32)
    steps = range(num_steps)
    if progress:
        from rich.progress import track

        steps = track(steps, description="sampling")
    b = len(prompts)
    for i in steps:
        s = sigmas[i].expand(b)
        if guided:
            v_c, v_u = generator.velocity(torch.cat([x, x]), torch.cat([s, s]), both).float().chunk(2)
            v = cfg_combine(v_c, v_u, cfg_scale)
        else:
            v = generator.velocity(x, s, cond).float()
        x = euler_step(x, v, sigmas[i], sigmas[i + 1])
    return x
