"""Conversions between the flow-matching parameterisations: x0 (data), eps (noise), velocity.

Rectified-flow / linear interpolation path (Lipman et al. 2023, Flow Matching, with sigma_min = 0;
Liu et al. 2023, Rectified Flow; Esser et al. 2024, SD3, §2 eq. 3 with a_t = 1 - t, b_t = t):

    x_sigma = (1 - sigma) * x0 + sigma * eps          sigma in [0, 1], 0 = data, 1 = noise
    v       = eps - x0                                (= d x_sigma / d sigma)
    x0      = x - sigma * v
    eps     = x + (1 - sigma) * v

All functions compute in float32 (float64 if any input is float64) and return that dtype.
"""

from __future__ import annotations

import torch

from genrl.flow.broadcast import SigmaLike, compute_dtype, expand_sigma

__all__ = [
    "MIN_DENOM",
    "add_noise",
    "velocity_target",
    "x0_from_velocity",
    "eps_from_velocity",
    "velocity_from_x0",
    "velocity_from_eps",
    "expand_sigma",
]

MIN_DENOM = 1e-5
"""Default lower clamp of the denominators sigma (in `velocity_from_x0`) and 1 - sigma (in
`velocity_from_eps`), so that the conversions stay finite at sigma = 0 / sigma = 1."""


def _check_same_shape(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{name_a} of shape {tuple(a.shape)} and {name_b} of shape {tuple(b.shape)} must match")


def add_noise(x0: torch.Tensor, eps: torch.Tensor, sigma: SigmaLike, frame_dim: int = 1) -> torch.Tensor:
    """Noise data to level sigma on the linear path: ``x = (1 - sigma) * x0 + sigma * eps``.

    Args:
        x0: clean latents, any shape [B, ...], any float dtype.
        eps: standard Gaussian noise, same shape as ``x0``.
        sigma: noise level in [0, 1]: float, 0-d, [B] or per-frame [B, T] (see `expand_sigma`).
        frame_dim: the frame dim of ``x0`` (1 for [B, T, C, H, W], 2 for Wan's [B, C, T, H, W]).

    Returns:
        x_sigma, same shape as ``x0``, float32 (float64 if any input is float64).

    Raises:
        ValueError: ``x0`` and ``eps`` shapes differ, or ``sigma`` does not fit (`expand_sigma`).

    Source: Lipman et al. 2023, Flow Matching, conditional OT path (eq. 20 with sigma_min = 0, time
    reversed); Esser et al. 2024, SD3, eq. 3 with the rectified-flow choice a_t = 1 - t, b_t = t.
    """
    _check_same_shape(x0, eps, "x0", "eps")
    dt = compute_dtype(x0, eps, sigma)
    s = expand_sigma(sigma, x0, frame_dim, dtype=dt)
    return (1 - s) * x0.to(dt) + s * eps.to(dt)


def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The flow-matching regression target ``v = eps - x0`` (independent of sigma).

    Args:
        x0: clean latents, any shape [B, ...].
        eps: noise, same shape.

    Returns:
        ``eps - x0``, float32 (float64 if an input is float64).

    Raises:
        ValueError: shapes differ.

    Source: Lipman et al. 2023, Flow Matching, conditional vector field of the OT path (eq. 21,
    sigma_min = 0); Liu et al. 2023, Rectified Flow; Esser et al. 2024, SD3, §2.
    """
    _check_same_shape(x0, eps, "x0", "eps")
    dt = compute_dtype(x0, eps)
    return eps.to(dt) - x0.to(dt)


def x0_from_velocity(x: torch.Tensor, sigma: SigmaLike, v: torch.Tensor, frame_dim: int = 1) -> torch.Tensor:
    """Predicted clean data from a velocity prediction: ``x0 = x - sigma * v``.

    Args:
        x: noisy latents x_sigma, any shape [B, ...].
        sigma: noise level of ``x`` in [0, 1]: float, 0-d, [B] or [B, T] (see `expand_sigma`).
        v: velocity (eps - x0) prediction, same shape as ``x``.
        frame_dim: frame dim of ``x`` for per-frame sigma.

    Returns:
        x0 estimate, shape of ``x``, float32 (float64 if any input is float64).

    Raises:
        ValueError: ``x`` and ``v`` shapes differ, or ``sigma`` does not fit.

    Source: follows from x = (1 - sigma) x0 + sigma eps and v = eps - x0 (SD3 §2, rectified flow).
    """
    _check_same_shape(x, v, "x", "v")
    dt = compute_dtype(x, v, sigma)
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    return x.to(dt) - s * v.to(dt)


def eps_from_velocity(x: torch.Tensor, sigma: SigmaLike, v: torch.Tensor, frame_dim: int = 1) -> torch.Tensor:
    """Predicted noise from a velocity prediction: ``eps = x + (1 - sigma) * v``.

    Args:
        x: noisy latents x_sigma, any shape [B, ...].
        sigma: noise level in [0, 1]: float, 0-d, [B] or [B, T].
        v: velocity prediction, same shape as ``x``.
        frame_dim: frame dim of ``x`` for per-frame sigma.

    Returns:
        eps estimate, shape of ``x``, float32 (float64 if any input is float64).

    Raises:
        ValueError: ``x`` and ``v`` shapes differ, or ``sigma`` does not fit.

    Source: follows from x = (1 - sigma) x0 + sigma eps and v = eps - x0 (SD3 §2, rectified flow).
    """
    _check_same_shape(x, v, "x", "v")
    dt = compute_dtype(x, v, sigma)
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    return x.to(dt) + (1 - s) * v.to(dt)


def velocity_from_x0(
    x: torch.Tensor,
    sigma: SigmaLike,
    x0: torch.Tensor,
    frame_dim: int = 1,
    *,
    min_denom: float = MIN_DENOM,
) -> torch.Tensor:
    """Velocity implied by an x0 prediction: ``v = (x - x0) / sigma``.

    This divides by sigma. At sigma = 0 the velocity is not determined by (x, x0) (x equals x0
    there), so sigma is clamped to at least ``min_denom`` (default `MIN_DENOM` = 1e-5): the result
    stays finite but is meaningless at sigma = 0, and errors in x0 are amplified by 1 / sigma near 0.

    Args:
        x: noisy latents x_sigma, any shape [B, ...].
        sigma: noise level in [0, 1]: float, 0-d, [B] or [B, T].
        x0: x0 prediction, same shape as ``x``.
        frame_dim: frame dim of ``x`` for per-frame sigma.
        min_denom: lower clamp applied to sigma before dividing (> 0).

    Returns:
        velocity, shape of ``x``, float32 (float64 if any input is float64).

    Raises:
        ValueError: shapes differ, ``sigma`` does not fit, or ``min_denom`` <= 0.

    Source: inverts x0 = x - sigma v (rectified-flow path, SD3 §2).
    """
    if not min_denom > 0:
        raise ValueError(f"min_denom must be > 0, got {min_denom}")
    _check_same_shape(x, x0, "x", "x0")
    dt = compute_dtype(x, x0, sigma)
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    return (x.to(dt) - x0.to(dt)) / s.clamp_min(min_denom)


def velocity_from_eps(
    x: torch.Tensor,
    sigma: SigmaLike,
    eps: torch.Tensor,
    frame_dim: int = 1,
    *,
    min_denom: float = MIN_DENOM,
) -> torch.Tensor:
    """Velocity implied by a noise prediction: ``v = (eps - x) / (1 - sigma)``.

    This divides by 1 - sigma. At sigma = 1 the velocity is not determined by (x, eps) (x equals
    eps there), so 1 - sigma is clamped to at least ``min_denom`` (default `MIN_DENOM` = 1e-5): the
    result stays finite but is meaningless at sigma = 1, and errors are amplified near it.

    Args:
        x: noisy latents x_sigma, any shape [B, ...].
        sigma: noise level in [0, 1]: float, 0-d, [B] or [B, T].
        eps: noise prediction, same shape as ``x``.
        frame_dim: frame dim of ``x`` for per-frame sigma.
        min_denom: lower clamp applied to 1 - sigma before dividing (> 0).

    Returns:
        velocity, shape of ``x``, float32 (float64 if any input is float64).

    Raises:
        ValueError: shapes differ, ``sigma`` does not fit, or ``min_denom`` <= 0.

    Source: inverts eps = x + (1 - sigma) v (rectified-flow path, SD3 §2).
    """
    if not min_denom > 0:
        raise ValueError(f"min_denom must be > 0, got {min_denom}")
    _check_same_shape(x, eps, "x", "eps")
    dt = compute_dtype(x, eps, sigma)
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    return (eps.to(dt) - x.to(dt)) / (1 - s).clamp_min(min_denom)
