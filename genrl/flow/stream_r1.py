"""Stream-R1's reliability and perplexity weights of the DMD generator loss (pure functions).

Stream-R1 (arXiv 2605.03849; released code wangbei1/Stream-R1) keeps Self-Forcing's DMD update and weights it with a
frozen video reward model that scores the student's decoded rollout in D named dimensions (VideoReward: visual
quality VQ, motion quality MQ, text alignment TA), under no gradient: the weights are constants of the loss.

* **Inter-reliability** (one weight per rollout): r_bar = mean_d z_d (the z-normalised dimension scores), a balance
  penalty P = std_d(Delta_d) (unbiased std over dimensions) where Delta_d = mean(recent half) - mean(older half) of
  the last ``window`` batch means of dimension d (0 until the window is full), r_final = r_bar - lambda P and
  ``W_inter = exp(beta r_final)`` (not normalised over the batch: a per-rollout learning-rate multiplier).
* **Intra-perplexity** (one weight per latent element): the reward's input-gradient saliency S_m [F, H, W] per
  dimension, fused as S = sum_m softmax(-r_m / T)_m S_m (the weakest dimension weighs most); temporal weights
  w_t[f] = max((1 - a_t) + a_t minmax_f(mean_hw S[f]), tau_min) / mean_f; spatial weights, per frame,
  w_s[f, h, w] = max((1 - a_s) + a_s minmax_hw(S[f]), sigma_min) / mean_hw; ``W_intra = w_t w_s`` divided by its
  mean, resized to the latent grid (trilinear) and renormalised to mean 1.
* **Flat maps** (:func:`flat_maps`): a temporal profile or a frame whose range max - min is at most
  ``flat_atol + flat_rtol * peak`` (peak = the sample's largest saliency) is *flat*: its weights are exactly 1 instead
  of a min-max normalisation of round-off noise. The release treats a range at most 1e-8 (absolute) as flat; genrl
  keeps that (``flat_atol = 1e-8``) and adds a relative part (``flat_rtol = 1e-6``), see :func:`flat_maps`.

The generator loss is then ``dmd_loss(x, g, weight=W_inter * W_intra)`` (:func:`genrl.flow.dmd.dmd_loss`), whose
gradient is W g / N. With beta = 0 and a flat saliency every weight is exactly 1.0 and the update is DMD's bit for
bit. Defaults are the release's: beta 2.0, window 50, lambda 0.5, T 1, a_t = a_s = 1, tau_min 0.2, sigma_min 0.15.

Shapes: rewards [B, D]; saliency [B, D, F, H, W] (or a fused [B, F, H, W]); weights [B] (inter) and [B, F, H, W]
(intra, broadcast over channels by ``dmd_loss``; frames on dim 1 of the [B, T, C, H, W] latents). Everything is
computed in float32 at least (float64 inputs stay float64).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

__all__ = ["FLAT_ATOL", "FLAT_RTOL", "balance_penalty", "final_reward", "flat_maps", "fuse_saliency", "fusion_weights",
           "inter_weight", "intra_weight", "spatial_weights", "temporal_weights", "to_latent_grid"]

#: the release's flat-map threshold: a saliency range at most this (absolute, the saliency's own units) is flat.
FLAT_ATOL = 1e-8
#: genrl's relative part of the flat-map threshold, a multiple of the sample's saliency peak (about 8 float32 ulps).
FLAT_RTOL = 1e-6


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _check(x: torch.Tensor, dims: int, name: str, layout: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dim() != dims:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be {layout}, got {shape}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} has NaN or inf values; score the rollout again or drop it")
    return _float(x)


def balance_penalty(history: torch.Tensor, window: int = 50) -> float:
    """Stream-R1's balance penalty P over a history of per-dimension reward means.

    Args:
        history: [S, D] float: row s = the batch mean of each of the D z-normalised dimensions at step s (oldest
            first). Only the last ``window`` rows are used.
        window: even number >= 2 of steps (release: 50).
    Returns:
        P = unbiased std over d of Delta_d = mean(last window/2 rows) - mean(the window/2 rows before), a float >= 0;
        0.0 while fewer than ``window`` rows exist (warm-up) or with a single dimension.
    Raises:
        ValueError: ``window`` odd or < 2; ``history`` not [S, D] or non-finite.
    """
    if window < 2 or window % 2:
        raise ValueError(f"window must be an even number >= 2 (release: 50), got {window}")
    h = _check(history, 2, "history", "[S steps, D dimensions]") if history.numel() else history.reshape(0, 1)
    if h.shape[0] < window or h.shape[1] < 2:
        return 0.0
    last = h[-window:]
    delta = last[window // 2:].mean(0) - last[: window // 2].mean(0)
    return float(delta.std(unbiased=True))


def final_reward(rewards: torch.Tensor, penalty: float = 0.0, lam: float = 0.5) -> torch.Tensor:
    """r_final = mean_d z_d - lambda P per rollout: [B, D] z-normalised scores -> [B]."""
    z = _check(rewards, 2, "rewards", "[B, D] z-normalised dimension scores")
    return z.mean(1) - lam * penalty


def inter_weight(r_final: torch.Tensor, beta: float = 2.0) -> torch.Tensor:
    """W_inter = exp(beta r_final), [B] -> [B] (> 0; exactly 1.0 for beta = 0). Raises ValueError for beta < 0."""
    if beta < 0:
        raise ValueError(f"beta must be >= 0 (release: 2.0; 0 gives DMD), got {beta}")
    return torch.exp(beta * _check(r_final, 1, "r_final", "[B]"))


def fusion_weights(rewards: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(-r_m / T) over the D dimensions: [B, D] -> [B, D], rows summing to 1; a lower score weighs more.
    Raises ValueError for T <= 0."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (release: 1), got {temperature}")
    return torch.softmax(-_check(rewards, 2, "rewards", "[B, D]") / temperature, dim=1)


def fuse_saliency(saliency: torch.Tensor, rewards: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """S = sum_m w_m S_m, w = :func:`fusion_weights`: saliency [B, D, F, H, W] (non-negative), rewards [B, D] ->
    [B, F, H, W]."""
    s = _check(saliency, 5, "saliency", "[B, D, F, H, W]")
    w = fusion_weights(rewards, temperature)
    if w.shape != s.shape[:2]:
        raise ValueError(f"rewards {tuple(w.shape)} must be [B, D] of saliency {tuple(s.shape)}")
    return (w.to(s.dtype)[:, :, None, None, None] * s).sum(1)


def _minmax(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """(x - min) / (max - min) over ``dims``; 0 where the range is 0 (the flat mask replaces those weights)."""
    lo, hi = x.amin(dims, keepdim=True), x.amax(dims, keepdim=True)
    span = hi - lo
    return torch.where(span > 0, (x - lo) / torch.where(span > 0, span, 1), torch.zeros_like(x))


def _check_floor(strength: float, floor: float, what: str) -> None:
    if not 0 <= strength <= 1:
        raise ValueError(f"{what} strength must be in [0, 1], got {strength}")
    if not 0 < floor <= 1:
        raise ValueError(f"{what} floor must be in (0, 1] (so every weight stays positive), got {floor}")


def _flat_masks(s: torch.Tensor, rtol: float, atol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(temporal [B], spatial [B, F]) flat masks of a checked saliency [B, F, H, W] (see :func:`flat_maps`)."""
    if not (rtol >= 0 and atol >= 0):  # also refuses NaN
        raise ValueError(f"flat_rtol and flat_atol must be >= 0 (0 and 0: only an exactly constant map is flat), "
                         f"got {rtol} and {atol}")
    tol = atol + rtol * s.abs().amax((1, 2, 3))  # [B]
    p = s.mean((2, 3))
    temporal = p.amax(1) - p.amin(1) <= tol
    spatial = s.amax((2, 3)) - s.amin((2, 3)) <= tol[:, None]
    return temporal, spatial


def flat_maps(saliency: torch.Tensor, flat_rtol: float = FLAT_RTOL,
              flat_atol: float = FLAT_ATOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Which temporal profiles and which frames of a fused saliency are *flat* (their weights are exactly 1).

    A map is flat when its range is at most ``flat_atol + flat_rtol * peak``, with peak = max |S| over the sample
    (all frames): the temporal profile p_f = mean_hw S[f] over f, and each frame S[f] over (h, w), both against the
    same per-sample peak (a frame whose saliency is tiny next to the sample's peak is flat).

    The release (wangbei1/Stream-R1, its factored temporal x spatial normalisation) treats a range at most 1e-8 as
    flat and gives that map weight 1; its 1e-8 is *absolute*, in the units of its saliency (float32 norms of the reward
    logit's input gradient), whose scale depends on the reward model and the video size and is not known in
    advance. An absolute threshold alone is therefore not scale-free, while the rest of W_intra is (min-max
    normalisation ignores the map's scale): a nearly flat map of round-off noise at any peak other than ~1e-8 would
    get full-strength weights. genrl keeps the release's absolute part (``flat_atol`` = 1e-8: whatever the release
    calls flat is flat here) and adds a relative part, ``flat_rtol`` = 1e-6 (about 8 float32 ulps of the peak: the
    saliency comes from the reward in float32, so trilinear resizing and fusion of a constant map leave a few ulps of
    noise). ``flat_rtol = 0`` gives the release's rule exactly; ``flat_rtol = flat_atol = 0`` gives the earlier genrl
    rule (only an exactly constant map is flat, any positive range is normalised).

    Args:
        saliency: the fused saliency [B, F, H, W], float (non-negative in use; the peak is taken of |S|).
        flat_rtol: the relative part (>= 0; default :data:`FLAT_RTOL`).
        flat_atol: the absolute part (>= 0, the saliency's units; default :data:`FLAT_ATOL`, the release's).

    Returns:
        (temporal bool [B], spatial bool [B, F]): True where the temporal profile / the frame is flat.

    Raises:
        ValueError: saliency not [B, F, H, W] or non-finite; a negative (or NaN) tolerance.
    """
    return _flat_masks(_check(saliency, 4, "saliency", "[B, F, H, W]"), flat_rtol, flat_atol)


def temporal_weights(saliency: torch.Tensor, strength: float = 1.0, floor: float = 0.2,
                     flat_rtol: float = FLAT_RTOL, flat_atol: float = FLAT_ATOL) -> torch.Tensor:
    """w_t [B, F]: p_f = mean_{h,w} S[f], min-max over frames, w = max((1 - a) + a p_hat, floor) / mean_f (so
    mean_f w_t = 1, every w_t >= floor / max > 0, monotone in p_f); exactly 1.0 for a sample whose profile is flat
    (:func:`flat_maps`: range <= flat_atol + flat_rtol * peak). Saliency [B, F, H, W] non-negative."""
    _check_floor(strength, floor, "temporal")
    s = _check(saliency, 4, "saliency", "[B, F, H, W]")
    flat, _ = _flat_masks(s, flat_rtol, flat_atol)
    p = _minmax(s.mean((2, 3)), (1,))
    w = torch.clamp((1 - strength) + strength * p, min=floor)
    w = w / w.mean(1, keepdim=True)
    return torch.where(flat[:, None], torch.ones_like(w), w)


def spatial_weights(saliency: torch.Tensor, strength: float = 1.0, floor: float = 0.15,
                    flat_rtol: float = FLAT_RTOL, flat_atol: float = FLAT_ATOL) -> torch.Tensor:
    """w_s [B, F, H, W]: per frame, min-max over (h, w), w = max((1 - a) + a S_hat, floor) / mean_{h,w} (each
    frame's mean is 1); exactly 1.0 on a flat frame (:func:`flat_maps`)."""
    _check_floor(strength, floor, "spatial")
    s = _check(saliency, 4, "saliency", "[B, F, H, W]")
    _, flat = _flat_masks(s, flat_rtol, flat_atol)
    w = torch.clamp((1 - strength) + strength * _minmax(s, (2, 3)), min=floor)
    w = w / w.mean((2, 3), keepdim=True)
    return torch.where(flat[:, :, None, None], torch.ones_like(w), w)


def to_latent_grid(weight: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
    """Resize a [B, F, H, W] weight map to the latent grid (F', H', W') (trilinear, corners not aligned; unchanged
    when the sizes already match) and renormalise to mean 1 per sample."""
    w = _check(weight, 4, "weight", "[B, F, H, W]")
    grid = tuple(int(g) for g in grid)
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"grid must be (frames, height, width) >= 1, got {grid}")
    if tuple(w.shape[1:]) != grid:
        w = F.interpolate(w[:, None], size=grid, mode="trilinear", align_corners=False)[:, 0]
    return w / w.mean((1, 2, 3), keepdim=True)


def intra_weight(saliency: torch.Tensor, rewards: torch.Tensor | None = None, grid: Sequence[int] | None = None,
                 temperature: float = 1.0, temporal_strength: float = 1.0, temporal_floor: float = 0.2,
                 spatial_strength: float = 1.0, spatial_floor: float = 0.15, flat_rtol: float = FLAT_RTOL,
                 flat_atol: float = FLAT_ATOL) -> torch.Tensor:
    """W_intra [B, F', H', W'] from the per-dimension saliency [B, D, F, H, W] (fused with ``rewards`` [B, D]) or a
    fused one [B, F, H, W]: w_t * w_s renormalised to mean 1, on ``grid`` (None: the saliency's grid). Positive
    everywhere, mean 1 per sample; exactly 1.0 everywhere for a sample whose profile and frames are all flat
    (:func:`flat_maps`: range <= ``flat_atol + flat_rtol * peak``; 0 and 0: only a constant map) on its own grid.

    Raises:
        ValueError: bad shapes, non-finite values, a negative saliency, strengths outside [0, 1], floors outside
            (0, 1], a negative tolerance, a per-dimension saliency without ``rewards``.
    """
    if saliency.dim() == 5:
        if rewards is None:
            raise ValueError("a per-dimension saliency [B, D, F, H, W] needs the rewards [B, D] to fuse it")
        s = fuse_saliency(saliency, rewards, temperature)
    else:
        s = _check(saliency, 4, "saliency", "[B, F, H, W] or [B, D, F, H, W]")
    if bool((s < 0).any()):
        raise ValueError("saliency must be non-negative (a gradient norm)")
    w = temporal_weights(s, temporal_strength, temporal_floor, flat_rtol, flat_atol)[:, :, None, None] * \
        spatial_weights(s, spatial_strength, spatial_floor, flat_rtol, flat_atol)
    w = w / w.mean((1, 2, 3), keepdim=True)
    return to_latent_grid(w, grid) if grid is not None else w
