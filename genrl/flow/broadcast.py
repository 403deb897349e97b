"""Broadcasting of sigma (and other per-sample / per-frame values) against latents, and step dtypes.

Latent layouts differ between model families: genrl's own models use [B, T, C, H, W], Wan uses
[B, C, T, H, W], image models use [B, C, H, W]. A sigma is a python float, a 0-d tensor, [B] (one
per sample) or [B, T] (one per frame). `expand_sigma` reshapes it so that it broadcasts against the
latent, placing T on the latent's frame dimension.
"""

from __future__ import annotations

import torch

SigmaLike = float | torch.Tensor

__all__ = ["SigmaLike", "compute_dtype", "expand_sigma"]


def compute_dtype(*values: object) -> torch.dtype:
    """Return the dtype that flow-matching step math runs in for these inputs.

    genrl's convention (docs/architecture.md, Conventions: precision): step math runs in float32, whatever the inputs
    are (bf16, fp16, float32, integer); float64 is kept when any tensor input is float64, so that
    exact-arithmetic tests can run in double precision.

    Args:
        *values: tensors, python numbers or None (non-tensors are ignored).

    Returns:
        ``torch.float64`` if any tensor argument has dtype float64, else ``torch.float32``.
    """
    for v in values:
        if isinstance(v, torch.Tensor) and v.dtype == torch.float64:
            return torch.float64
    return torch.float32


def _normalize_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _expand(
    value: SigmaLike,
    x: torch.Tensor,
    frame_dim: int,
    name: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Shared implementation of `expand_sigma` (``name`` is used in error messages)."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a python float or a torch.Tensor, got {type(value).__name__}")
        return torch.tensor(float(value), dtype=dtype, device=x.device)

    v = value.to(device=x.device, dtype=dtype)
    nd = x.ndim
    xs = tuple(x.shape)
    if v.ndim == 0:
        return v

    def fail(expected: str) -> ValueError:
        return ValueError(
            f"{name} of shape {tuple(v.shape)} does not fit x of shape {xs} "
            f"(frame_dim={frame_dim}): {expected}"
        )

    if v.ndim == 1:
        if nd < 1 or v.shape[0] not in (xs[0], 1):
            raise fail(f"a 1-d {name} must be [B] with B = x.shape[0] = {xs[0] if nd else None} (or 1)")
        return v.reshape(v.shape[0], *([1] * (nd - 1)))

    if v.ndim == 2:
        fd = _normalize_dim(frame_dim, nd)
        if not 0 < fd < nd:
            raise fail(f"a per-frame [B, T] {name} needs 1 <= frame_dim < x.ndim = {nd}")
        b, t = v.shape
        if b not in (xs[0], 1) or t not in (xs[fd], 1):
            raise fail(
                f"a per-frame {name} must be [B, T] = [{xs[0]}, {xs[fd]}] "
                f"(B = x.shape[0], T = x.shape[{fd}])"
            )
        shape = [1] * nd
        shape[0], shape[fd] = b, t
        return v.reshape(shape)

    if v.ndim == nd and all(vs in (1, s) for vs, s in zip(v.shape, xs)):
        return v
    raise fail(f"expected a float, a 0-d tensor, [B], [B, T] or a tensor broadcastable to x with {nd} dims")


def expand_sigma(
    sigma: SigmaLike,
    x: torch.Tensor,
    frame_dim: int = 1,
    *,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reshape ``sigma`` so that it broadcasts against the latent ``x``.

    Accepted forms of ``sigma`` (values are noise levels in [0, 1]; 0 = data, 1 = noise):

    * python float or 0-d tensor -> 0-d tensor;
    * ``[B]`` (one sigma per sample; B = x.shape[0] or 1) -> ``[B, 1, ..., 1]`` with ``x.ndim`` dims;
    * ``[B, T]`` (one sigma per frame) -> B on dim 0, T on ``frame_dim``, 1 elsewhere. Use
      ``frame_dim=1`` for [B, T, C, H, W] latents (genrl's own models) and ``frame_dim=2`` for
      [B, C, T, H, W] latents (Wan). Negative ``frame_dim`` counts from the end;
    * a tensor with ``x.ndim`` dims already broadcastable to ``x`` -> returned as is.

    The result lives on ``x.device`` and has dtype ``dtype`` if given, else float32 (float64 when
    ``sigma`` or ``x`` is float64); see `compute_dtype`. Reshaping only, no values are changed and
    autograd flows through.

    Args:
        sigma: noise level(s), float / 0-d / [B] / [B, T] / broadcastable.
        x: the latent it will be combined with, any shape [B, ...].
        frame_dim: the dim of ``x`` that holds frames; used only for [B, T] sigmas.
        dtype: the dtype of the result (default: `compute_dtype(sigma, x)`).

    Returns:
        sigma as a tensor that broadcasts against ``x``.

    Raises:
        ValueError: the shape of ``sigma`` does not fit ``x`` (the message names both shapes), or a
            per-frame sigma is given with ``frame_dim`` pointing at the batch dim or outside ``x``.
        TypeError: ``sigma`` is neither a number nor a tensor.

    Source: genrl convention (docs/architecture.md, Conventions); per-frame noise levels as in Diffusion Forcing
    (Chen et al. 2024).
    """
    if dtype is None:
        dtype = compute_dtype(sigma, x)
    return _expand(sigma, x, frame_dim, "sigma", dtype)
