"""Deterministic sampler steps on the flow-matching ODE."""

from __future__ import annotations

import torch

from genrl.flow.broadcast import SigmaLike, compute_dtype, expand_sigma

__all__ = ["euler_step"]


def euler_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    frame_dim: int = 1,
) -> torch.Tensor:
    """One deterministic Euler step of the probability-flow ODE ``dx/dsigma = v``.

    ``x_next = x + (sigma_next - sigma) * v``. Sampling goes from noise to data, so usually
    ``sigma_next < sigma`` (the step is then x - |dsigma| v); the formula holds in either direction.
    On the straight path x_sigma = (1 - sigma) x0 + sigma eps with the exact v = eps - x0, one step
    lands exactly on x_{sigma_next}, for any step size.

    Args:
        x: latents at level ``sigma``, any shape [B, ...] ([B, T, C, H, W] or Wan's [B, C, T, H, W]).
        v: velocity at (x, sigma), same shape as ``x`` (any float dtype, e.g. a bf16 model output).
        sigma: current noise level(s) in [0, 1]: float, 0-d, [B] or per-frame [B, T].
        sigma_next: next noise level(s), same accepted forms (each independently).
        frame_dim: frame dim of ``x`` for per-frame sigmas.

    Returns:
        x at ``sigma_next``, shape of ``x``, float32 (float64 if any input is float64), computed
        in that dtype (docs/architecture.md, Conventions: sampler step math in float32).

    Raises:
        ValueError: ``x`` and ``v`` shapes differ, or a sigma does not fit ``x`` (`expand_sigma`).

    Source: Euler discretisation of the flow ODE of Lipman et al. 2023 (Flow Matching, eq. 1) /
    Liu et al. 2023 (Rectified Flow); the sampler of diffusers' FlowMatchEulerDiscreteScheduler.
    """
    if x.shape != v.shape:
        raise ValueError(f"x of shape {tuple(x.shape)} and v of shape {tuple(v.shape)} must match")
    dt = compute_dtype(x, v, sigma, sigma_next)
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    s_next = expand_sigma(sigma_next, x, frame_dim, dtype=dt)
    return x.to(dt) + (s_next - s) * v.to(dt)
