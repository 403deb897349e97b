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

__all__ = ["balance_penalty", "final_reward", "fuse_saliency", "fusion_weights", "inter_weight", "intra_weight",
           "spatial_weights", "temporal_weights", "to_latent_grid"]


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
    """(x - min) / (max - min) over ``dims``; 0 where the range is 0 (a flat map)."""
    lo, hi = x.amin(dims, keepdim=True), x.amax(dims, keepdim=True)
    span = hi - lo
    return torch.where(span > 0, (x - lo) / torch.where(span > 0, span, 1), torch.zeros_like(x))


def _check_floor(strength: float, floor: float, what: str) -> None:
    if not 0 <= strength <= 1:
        raise ValueError(f"{what} strength must be in [0, 1], got {strength}")
    if not 0 < floor <= 1:
        raise ValueError(f"{what} floor must be in (0, 1] (so every weight stays positive), got {floor}")


def temporal_weights(saliency: torch.Tensor, strength: float = 1.0, floor: float = 0.2) -> torch.Tensor:
    """w_t [B, F]: p_f = mean_{h,w} S[f], min-max over frames, w = max((1 - a) + a p_hat, floor) / mean_f (so
    mean_f w_t = 1, every w_t >= floor / max > 0, monotone in p_f). Saliency [B, F, H, W] non-negative."""
    _check_floor(strength, floor, "temporal")
    s = _check(saliency, 4, "saliency", "[B, F, H, W]")
    p = _minmax(s.mean((2, 3)), (1,))
    w = torch.clamp((1 - strength) + strength * p, min=floor)
    return w / w.mean(1, keepdim=True)


def spatial_weights(saliency: torch.Tensor, strength: float = 1.0, floor: float = 0.15) -> torch.Tensor:
    """w_s [B, F, H, W]: per frame, min-max over (h, w), w = max((1 - a) + a S_hat, floor) / mean_{h,w} (each
    frame's mean is 1)."""
    _check_floor(strength, floor, "spatial")
    s = _check(saliency, 4, "saliency", "[B, F, H, W]")
    w = torch.clamp((1 - strength) + strength * _minmax(s, (2, 3)), min=floor)
    return w / w.mean((2, 3), keepdim=True)


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
                 spatial_strength: float = 1.0, spatial_floor: float = 0.15) -> torch.Tensor:
    """W_intra [B, F', H', W'] from the per-dimension saliency [B, D, F, H, W] (fused with ``rewards`` [B, D]) or a
    fused one [B, F, H, W]: w_t * w_s renormalised to mean 1, on ``grid`` (None: the saliency's grid). Positive
    everywhere, mean 1 per sample; exactly 1.0 everywhere for a flat saliency on its own grid.

    Raises:
        ValueError: bad shapes, non-finite values, a negative saliency, strengths outside [0, 1], floors outside
            (0, 1], a per-dimension saliency without ``rewards``.
    """
    if saliency.dim() == 5:
        if rewards is None:
            raise ValueError("a per-dimension saliency [B, D, F, H, W] needs the rewards [B, D] to fuse it")
        s = fuse_saliency(saliency, rewards, temperature)
    else:
        s = _check(saliency, 4, "saliency", "[B, F, H, W] or [B, D, F, H, W]")
    if bool((s < 0).any()):
        raise ValueError("saliency must be non-negative (a gradient norm)")
    w = temporal_weights(s, temporal_strength, temporal_floor)[:, :, None, None] * spatial_weights(
        s, spatial_strength, spatial_floor)
    w = w / w.mean((1, 2, 3), keepdim=True)
    return to_latent_grid(w, grid) if grid is not None else w
