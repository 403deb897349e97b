"""Classifier-free guidance combiner (standard form, w = 1 is the conditional model)."""

from __future__ import annotations

import torch

from genrl.flow.broadcast import _expand, compute_dtype

__all__ = ["cfg_combine"]


def cfg_combine(
    cond: torch.Tensor,
    uncond: torch.Tensor,
    scale: float | torch.Tensor,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Classifier-free guidance: ``pred = uncond + w * (cond - uncond)``.

    Standard form (docs/architecture.md, Conventions): ``w = 1`` returns the conditional prediction, ``w = 0`` the
    unconditional one, ``w > 1`` extrapolates away from uncond. Reference code that writes
    ``cond + s * (cond - uncond)`` uses ``s = w - 1``. Evaluated as ``w * cond + (1 - w) * uncond``,
    so ``w = 1`` returns ``cond`` and ``w = 0`` returns ``uncond`` exactly (bit for bit, after the
    upcast). Works for any prediction type (velocity, x0, eps): the combination is linear.

    Args:
        cond: conditional prediction, any shape [B, ...], any float dtype.
        uncond: unconditional prediction, same shape.
        scale: the guidance scale w: a python float, a 0-d tensor, a [B] tensor (one per sample,
            broadcast over the remaining dims) or a per-frame [B, T] tensor (T on ``frame_dim``).
        frame_dim: the frame dim of the predictions, used only for a [B, T] scale.

    Returns:
        The guided prediction, shape of ``cond``, float32 (float64 if any input is float64).

    Raises:
        ValueError: ``cond`` and ``uncond`` shapes differ, or ``scale`` does not fit them.

    Source: Ho & Salimans 2022, Classifier-Free Diffusion Guidance (eq. 6, written with
    w_standard = 1 + w_paper).
    """
    if cond.shape != uncond.shape:
        raise ValueError(f"cond of shape {tuple(cond.shape)} and uncond of shape {tuple(uncond.shape)} must match")
    dt = compute_dtype(cond, uncond, scale)
    w = _expand(scale, cond, frame_dim, "scale", dt)
    return w * cond.to(dt) + (1 - w) * uncond.to(dt)
