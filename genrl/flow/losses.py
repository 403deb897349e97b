"""The flow-matching (velocity regression) loss and its SD3 loss weightings."""

from __future__ import annotations

import math
from typing import Literal

import torch

from genrl.flow.broadcast import SigmaLike, _expand, compute_dtype, expand_sigma

__all__ = ["LossWeighting", "SIGMA_SQRT_MIN_SIGMA", "loss_weighting", "flow_matching_loss"]

LossWeighting = Literal["none", "sigma_sqrt", "cosmap"]
_WEIGHTINGS: tuple[str, ...] = ("none", "sigma_sqrt", "cosmap")

SIGMA_SQRT_MIN_SIGMA = 1e-3
"""Default lower clamp of sigma in the "sigma_sqrt" weighting (caps the weight at 1e6)."""


def loss_weighting(
    sigma: SigmaLike,
    kind: LossWeighting = "none",
    *,
    min_sigma: float = SIGMA_SQRT_MIN_SIGMA,
) -> torch.Tensor:
    """Per-sigma loss weight w(sigma) of the SD3 training recipes.

    * ``"none"``: w = 1.
    * ``"sigma_sqrt"``: w = sigma^-2 (the form of diffusers'
      ``compute_loss_weighting_for_sd3("sigma_sqrt")``). It diverges at sigma = 0, so sigma is
      first clamped to at least ``min_sigma`` (default 1e-3, i.e. w <= 1e6).
    * ``"cosmap"``: w = 2 / (pi * (1 - 2 sigma + 2 sigma^2)), the density of the CosMap timestep
      distribution of SD3 used as a weight; w(0) = w(1) = 2/pi, w(1/2) = 4/pi.

    Args:
        sigma: noise level(s) in [0, 1], a python float or a tensor of any shape.
        kind: the weighting.
        min_sigma: lower clamp of sigma for "sigma_sqrt" (> 0).

    Returns:
        w, a tensor of sigma's shape (0-d for a float), float32 (float64 for a float64 sigma).

    Raises:
        ValueError: unknown ``kind`` or ``min_sigma <= 0``.

    Source: Esser et al. 2024, SD3, §3.1 (CosMap, eq. 21 density 2 / (pi - 2 pi t + 2 pi t^2));
    diffusers ``training_utils.compute_loss_weighting_for_sd3`` for the "sigma_sqrt" form.
    """
    dt = compute_dtype(sigma)
    s = sigma.to(dt) if isinstance(sigma, torch.Tensor) else torch.tensor(float(sigma), dtype=dt)
    if kind == "none":
        return torch.ones_like(s)
    if kind == "sigma_sqrt":
        if not min_sigma > 0:
            raise ValueError(f"min_sigma must be > 0, got {min_sigma}")
        return s.clamp_min(min_sigma).pow(-2)
    if kind == "cosmap":
        return 2.0 / (math.pi * (1 - 2 * s + 2 * s * s))
    raise ValueError(f"unknown loss weighting {kind!r}; expected one of {_WEIGHTINGS}")


def flow_matching_loss(
    v_pred: torch.Tensor,
    x0: torch.Tensor,
    eps: torch.Tensor,
    sigma: SigmaLike,
    weighting: LossWeighting = "none",
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Per-sample flow-matching loss: weighted mean squared error of v_pred against eps - x0.

    ``loss[b] = mean_{elements e of sample b} w(sigma_{b,e}) * (v_pred - (eps - x0))^2``, where the
    weight follows sigma's broadcast (per sample for [B], per frame for [B, T]). With ``mask``
    the mean runs over the elements of the masked frames only: entries of other frames do not
    enter (even NaN / inf predictions there are ignored). Computed in float32 (float64 when any
    input is float64); differentiable w.r.t. ``v_pred``.

    Args:
        v_pred: predicted velocity, any shape [B, ...] (e.g. [B, T, C, H, W] or Wan's
            [B, C, T, H, W]), any float dtype.
        x0: clean latents, same shape.
        eps: the noise used to build x_sigma, same shape.
        sigma: noise level(s) in [0, 1]: float, 0-d, [B] or per-frame [B, T] (see `expand_sigma`).
            Only used for the weighting.
        weighting: "none", "sigma_sqrt" or "cosmap" (see `loss_weighting`).
        mask: optional per-frame loss mask [B, T], bool or float 0/1 (non-negative float values act
            as weights), T on ``frame_dim`` of the latents.
        frame_dim: the frame dim of the latents (1 for [B, T, C, H, W], 2 for [B, C, T, H, W]).

    Returns:
        Tensor [B], the per-sample loss (callers take ``.mean()`` or weight it).

    Raises:
        ValueError: ``v_pred`` / ``x0`` / ``eps`` shapes differ (message names both shapes),
            ``sigma`` or ``mask`` does not fit the latents, or a sample has an empty mask.

    Source: Lipman et al. 2023, Flow Matching, conditional flow-matching objective (eq. 9) on the
    OT / rectified path; Esser et al. 2024, SD3, §2-3 (weighted objective, velocity target
    eps - x0).
    """
    for name, t in (("x0", x0), ("eps", eps)):
        if t.shape != v_pred.shape:
            raise ValueError(f"v_pred of shape {tuple(v_pred.shape)} and {name} of shape {tuple(t.shape)} must match")
    dt = compute_dtype(v_pred, x0, eps, sigma)
    target = eps.to(dt) - x0.to(dt)
    se = (v_pred.to(dt) - target).square()
    if weighting not in _WEIGHTINGS:
        raise ValueError(f"unknown loss weighting {weighting!r}; expected one of {_WEIGHTINGS}")
    s = expand_sigma(sigma, x0, frame_dim, dtype=dt)  # validates sigma's shape in every case
    if weighting != "none":
        se = se * loss_weighting(s, weighting)
    b = x0.shape[0]
    if mask is None:
        return se.reshape(b, -1).mean(dim=1)

    fd = frame_dim + x0.ndim if frame_dim < 0 else frame_dim
    if not 0 < fd < x0.ndim or mask.shape != (b, x0.shape[fd]):
        expected = f"[{b}, {x0.shape[fd]}]" if 0 < fd < x0.ndim else "[B, T]"
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not fit latents of shape {tuple(x0.shape)} "
            f"with frame_dim={frame_dim}: expected {expected}"
        )
    m = _expand(mask.to(dt), x0, fd, "mask", dt).expand_as(se)
    den = m.reshape(b, -1).sum(dim=1)
    empty = (den <= 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"mask selects no frame for sample(s) {empty}; every sample needs a non-empty mask")
    num = torch.where(m > 0, se * m, torch.zeros((), dtype=dt, device=se.device)).reshape(b, -1).sum(dim=1)
    return num / den
