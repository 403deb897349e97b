"""The per-sample flow-matching error shared by the forward-process losses (`genrl.flow.forward_rl`, `genrl.flow.nft`).

* `sample_mse`: each sample's mean squared error (v - target)^2 over its (masked-in) elements [B], the core of
  RAM, AWM and DiffusionNFT (see `genrl.flow.forward_rl` for how they build on it);
* the argument checks and the per-sample masked mean both loss modules use.

It sits below both loss modules, so the two no longer import each other: `genrl.flow.nft` builds on this module,
and `genrl.flow.forward_rl` builds on it too and re-exports `sample_mse` and DiffusionNFT's losses (one import
site for the three objectives). Conventions as in
`genrl.flow.forward_rl` (docs/architecture.md, Conventions).
"""

from __future__ import annotations

import math

import torch

from genrl.flow.broadcast import compute_dtype
from genrl.flow.dmd import _element_mask

__all__ = ["sample_mse"]


# --------------------------------------------------------------------------------------------
# validation helpers (shared with genrl.flow.forward_rl and genrl.flow.nft)
# --------------------------------------------------------------------------------------------


def _check_positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_nonnegative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _check_batch_tensor(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 1 or x.shape[0] < 1:
        raise ValueError(f"{name} must have a non-empty batch dim, got shape {tuple(x.shape)}")


def _check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    _check_batch_tensor(ref_name, ref)
    for name, t in others.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != ref.shape:
            raise ValueError(
                f"{ref_name} of shape {tuple(ref.shape)} and {name} of shape {tuple(t.shape)} must match"
            )


def _check_per_sample(name: str, value: torch.Tensor, b: int, hint: str = "") -> torch.Tensor:
    """Validate a finite per-sample tensor [B] and return it detached."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B] = [{b}], got {type(value).__name__}")
    if value.shape != (b,):
        raise ValueError(f"{name} must be one value per sample, [B] = [{b}], got shape {tuple(value.shape)}")
    v = value.detach()
    bad = ~torch.isfinite(v)
    if bool(bad.any()):
        idx = bad.nonzero().flatten().tolist()[:8]
        raise ValueError(f"{name} holds NaN / inf at sample(s) {idx}{hint}")
    return v


def _per_sample_mean(values: torch.Tensor, m: torch.Tensor | None, counts: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``values`` over each sample's (masked) elements -> [B]. Masked-out entries must be 0."""
    b = values.shape[0]
    if m is None:
        return values.reshape(b, -1).mean(dim=1)
    return values.reshape(b, -1).sum(dim=1) / counts


def _sample_counts(m: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """Number of masked elements per sample [B]; raises if some sample has none."""
    if m is None:
        return None
    counts = m.reshape(x.shape[0], -1).sum(dim=1)
    empty = (counts == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(
            f"mask selects no frame for sample(s) {empty}; every sample needs at least one masked-in frame "
            "(drop those samples from the batch instead)"
        )
    return counts


# --------------------------------------------------------------------------------------------
# the core: per-sample squared velocity error
# --------------------------------------------------------------------------------------------


def sample_mse(
    v: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Per-sample mean squared error: l_b = mean_{e in sample b} (v_e - target_e)^2, shape [B].

    The core of every forward-process objective here: with target = u = eps - x0 it is the flow-matching
    error l of AWM (whose log p is -w(t, l)); with target = sg(ram target) it is RAM's loss; with target =
    v_ref it is the anchor ||v - v_ref||^2 of AWM / DiffusionNFT. The mean runs over all non-batch elements
    of a sample, or over the elements of its masked-in frames with ``mask``; masked-out entries are
    selected away before squaring, so they get exactly zero gradient even if they hold NaN / inf.

    Neither argument is detached: the gradient flows into both (callers detach their targets).

    Args:
        v: a velocity, any shape [B, ...] ([B, T, C, H, W] or Wan's [B, C, T, H, W]), any float dtype.
        target: same shape.
        mask: optional per-frame mask [B, T] (bool or 0 / 1), T on ``frame_dim``.
        frame_dim: the frame dim of the latents (used only with ``mask``).

    Returns:
        [B] >= 0, float32 (float64 when an input is float64).

    Raises:
        ValueError: the shapes differ (message names both), an input has no batch dim, the mask does
            not fit, or a sample's mask selects nothing.
        TypeError: an input is not a tensor.

    Source: the flow-matching loss of Lipman et al. 2023 / Liu et al. 2023 per sample, as the reference
    scripts reduce it (mean over non-batch dims: AWM ``compute_log_prob_awm``, RAM ``training_sd3.py``
    as its ports reduce it, DiffusionNFT's KL term).
    """
    _check_same_shape("v", v, target=target)
    dt = compute_dtype(v, target)
    diff = v.to(dt) - target.to(dt)
    m = _element_mask(mask, v, frame_dim)
    counts = _sample_counts(m, v)
    if m is not None:
        diff = torch.where(m, diff, torch.zeros((), dtype=dt, device=diff.device))
    return _per_sample_mean(diff.square(), m, counts)
