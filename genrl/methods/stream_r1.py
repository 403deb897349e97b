"""Stream-R1: DMD whose generator update is weighted by a video reward (docs/methods/distillation.md, "Stream-R1").

Stream-R1 (arXiv 2605.03849; released code wangbei1/Stream-R1) is not a new loss: it is Self-Forcing DMD
(:class:`~genrl.methods.dmd.DMD`) with a weight on the generator's DMD gradient. :class:`StreamR1Weighting` is that
weight, a component the DMD method takes as ``weighting`` (composition through DMD's weight hook; nothing of DMD is
copied). At every generator update it

1. decodes the student's rollout x under no gradient and scores it with a frozen video reward in D named dimensions
   (VideoAlign's ``vq`` / ``mq`` / ``ta``; the shapes world's ``shapes_video``: ``visual_quality`` /
   ``motion_quality`` / ``text_alignment``), z-normalised with fixed statistics;
2. keeps the balance history (the batch mean of each dimension, last ``window`` updates; checkpointed) and computes
   W_inter = exp(beta (mean_d z_d - lambda P)) per rollout (:mod:`genrl.flow.stream_r1`);
3. takes the reward's input-gradient saliency per dimension on the latent grid, fuses it (softmax(-z / T): the
   weakest dimension weighs most) and turns it into W_intra (temporal x spatial, floors, mean 1; a flat temporal
   profile or frame, range <= ``flat_atol + flat_rtol * peak``, gets weight exactly 1, as in the release);
4. returns W = W_inter W_intra (detached), so the generator's gradient is W g / N; the critic's loss is unchanged.

No gradient reaches the student through the reward: the weights are constants (computed from a detached copy of
x). A rollout whose reward failed (NaN) gets W = 1 (plain DMD) and is counted in ``stream_r1/invalid``. Logged every
generator update: ``stream_r1/w_inter_{mean,min,max}``, ``stream_r1/r_final``, ``stream_r1/penalty``,
``stream_r1/w_intra_{min,max,std}``, ``stream_r1/fusion_<dim>`` and ``stream_r1/<dim>`` (batch means); with ``intra``
on, ``stream_r1/flat_temporal`` (the fraction of valid rollouts whose temporal profile is flat) and
``stream_r1/flat_spatial`` (the fraction of their frames that are flat).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from genrl.flow.stream_r1 import (
    FLAT_ATOL,
    FLAT_RTOL,
    balance_penalty,
    final_reward,
    flat_maps,
    fuse_saliency,
    fusion_weights,
    inter_weight,
    intra_weight,
)
from genrl.methods.common import gather_batch
from genrl.rewards import RewardManager

__all__ = ["StreamR1Weighting"]

logger = logging.getLogger(__name__)


class StreamR1Weighting(nn.Module):
    """Stream-R1's reward weight of the DMD generator update (see the module docstring).

    Args:
        reward: the reward spec (``{"name": "shapes_video"}``, ``{"name": "videoalign", "path": ...}``); it must be
            differentiable when ``intra`` is on (its :meth:`~genrl.rewards.RewardModel.saliency`).
        dimensions: the reward's output keys that play VQ, MQ and TA (any D >= 1, in that order).
        normalization: optional ``{dim: [mean, std]}``: z = (score - mean) / std (VideoAlign's scores are already
            standardised; the shapes reward's are in [0, 1]). Missing dims: (0, 1).
        inter / intra: use the per-rollout weight / the per-position weight (both: Stream-R1; neither: DMD).
        beta: the inter temperature's inverse (release 2.0); window: the balance history (release 50); lam: the
            balance penalty's weight lambda (release 0.5); temperature: the fusion softmax's T (release 1).
        temporal_strength / temporal_floor / spatial_strength / spatial_floor: a_t, tau_min, a_s, sigma_min (release
            1, 0.2, 1, 0.15).
        flat_rtol / flat_atol: a temporal profile or frame of the fused saliency whose range is at most
            ``flat_atol + flat_rtol * peak`` (peak: the rollout's largest saliency) is flat and weighs exactly 1
            (:func:`genrl.flow.stream_r1.flat_maps`). The release's rule is absolute, range <= 1e-8 (``flat_rtol:
            0``); genrl's default adds the relative 1e-6 so that round-off in a nearly flat map at any scale is
            not normalised to full-strength weights; 0 and 0: only an exactly constant map is flat.

    Raises:
        ValueError: no dimension, a non-positive std, an even / odd window problem (from the weights), beta < 0, a
            negative flat tolerance.
    """

    def __init__(self, reward: dict[str, Any] | None = None, dimensions: list[str] | None = None,
                 normalization: dict[str, list[float]] | None = None, inter: bool = True, intra: bool = True,
                 beta: float = 2.0, window: int = 50, lam: float = 0.5, temperature: float = 1.0,
                 temporal_strength: float = 1.0, temporal_floor: float = 0.2, spatial_strength: float = 1.0,
                 spatial_floor: float = 0.15, flat_rtol: float = FLAT_RTOL, flat_atol: float = FLAT_ATOL) -> None:
        super().__init__()
        self.reward_spec = dict(reward or {"name": "shapes_video"})
        self.dimensions = list(dimensions or ["visual_quality", "motion_quality", "text_alignment"])
        if not self.dimensions:
            raise ValueError("stream_r1 dimensions is empty; name the reward's VQ / MQ / TA keys")
        norm = normalization or {}
        unknown = set(norm) - set(self.dimensions)
        if unknown:
            raise ValueError(f"normalization names {sorted(unknown)}, which are not in dimensions {self.dimensions}")
        stats = [list(norm.get(d, [0.0, 1.0])) for d in self.dimensions]
        if any(len(s) != 2 or not s[1] > 0 for s in stats):
            raise ValueError(f"normalization entries must be [mean, std > 0], got {norm}")
        if beta < 0:
            raise ValueError(f"beta must be >= 0 (release: 2.0; 0 turns the inter weight off), got {beta}")
        if window < 2 or window % 2:
            raise ValueError(f"window must be an even number >= 2 (release: 50), got {window}")
        if not (flat_rtol >= 0 and flat_atol >= 0):
            raise ValueError(f"flat_rtol and flat_atol must be >= 0 (release: 0 and 1e-8), got {flat_rtol} and "
                             f"{flat_atol}")
        self.inter, self.intra = inter, intra
        self.flat_rtol, self.flat_atol = flat_rtol, flat_atol
        self.beta, self.window, self.lam, self.temperature = beta, window, lam, temperature
        self.temporal = (temporal_strength, temporal_floor)
        self.spatial = (spatial_strength, spatial_floor)
        self.register_buffer("stats", torch.tensor(stats, dtype=torch.float64), persistent=False)
        # the balance history: batch means of the z-scores, oldest first; checkpointed with the method
        self.register_buffer("history", torch.zeros(window, len(self.dimensions), dtype=torch.float64))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))
        self.manager = RewardManager([self.reward_spec])  # not a child: the reward is frozen, never checkpointed
        self.last: dict[str, float] = {}

    @property
    def reward(self):
        """The built reward model."""
        return self.manager[self.manager.names[0]]

    def _history(self) -> torch.Tensor:
        n = int(self.filled)
        return self.history[-n:] if n else self.history[:0]

    @torch.no_grad()
    def _push(self, means: torch.Tensor) -> None:
        self.history.copy_(torch.cat([self.history[1:], means.to(self.history)[None]]))
        self.filled.fill_(min(int(self.filled) + 1, self.window))

    def forward(self, x: torch.Tensor, x0_fake: torch.Tensor, x0_real: torch.Tensor, indices: torch.Tensor, *,
                prompts: list[str], method) -> torch.Tensor:
        """The weight of the DMD gradient of the rollout ``x`` (latents [B, T, C, H, W], or Wan's [B, C, T, H, W]
        with ``method.generator.frame_dim == 2``): float32 [B, T, 1, H, W] (or [B, 1, T, H, W]), detached, > 0.
        ``method`` is the DMD module (its generator decodes, it logs)."""
        gen = method.generator
        fd = getattr(gen, "frame_dim", 1)
        b = x.shape[0]
        with torch.no_grad():
            pixels = gen.decode(x.detach()).float().clamp(0, 1).cpu()
        model = self.reward
        out = model(pixels, prompts)
        missing = [d for d in self.dimensions if d not in out]
        if missing:
            keys = sorted(k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dtype != torch.bool)
            raise ValueError(f"stream_r1 dimensions {missing} are not outputs of the reward "
                             f"{type(model).__name__}; it returns {keys}: set weighting.init_args.dimensions to "
                             f"three of them (VQ, MQ, TA)")
        raw = torch.stack([out[d].detach().double().cpu() for d in self.dimensions], 1)  # [B, D]
        z = (raw - self.stats[:, 0].cpu()) / self.stats[:, 1].cpu()
        valid = torch.isfinite(z).all(1) & out["valid"].cpu()
        if not bool(valid.all()):
            logger.warning("stream_r1: the reward failed on %d of %d rollouts; they get weight 1 (plain DMD)",
                           int((~valid).sum()), b)
        z_ok = torch.where(valid[:, None], z, torch.zeros_like(z))
        # the balance history: the global batch mean of each dimension (every rank pushes the same row)
        g_z = gather_batch(method, z_ok.to(method.device)).double().cpu()
        g_valid = gather_batch(method, valid.to(method.device)).cpu()
        if bool(g_valid.any()):
            self._push(g_z[g_valid].mean(0))
        penalty = balance_penalty(self._history(), self.window)
        r_final = final_reward(z_ok, penalty, self.lam)
        w_inter = inter_weight(r_final, self.beta) if self.inter else torch.ones(b, dtype=torch.float64)
        w_inter = torch.where(valid, w_inter, torch.ones_like(w_inter))
        grid = (x.shape[fd], x.shape[-2], x.shape[-1])
        if self.intra:
            maps = model.saliency(pixels, prompts, dims=self.dimensions, out_shape=grid)
            sal = torch.stack([maps[d].double() for d in self.dimensions], 1)  # [B, D, F, H, W]
            sal = torch.nan_to_num(sal, nan=0.0, posinf=0.0)
            fused = fuse_saliency(sal, z_ok, self.temperature)  # [B, F, H, W]
            w_intra = intra_weight(fused, None, None, self.temperature, *self.temporal, *self.spatial,
                                   self.flat_rtol, self.flat_atol)
            w_intra = torch.where(valid[:, None, None, None], w_intra, torch.ones_like(w_intra))
            flat_t, flat_s = flat_maps(fused, self.flat_rtol, self.flat_atol)
            flat = (flat_t[valid], flat_s[valid])  # the valid rollouts' masks, [n] and [n, F]
        else:
            w_intra = torch.ones(b, *grid, dtype=torch.float64)
            flat = None
        weight = (w_inter[:, None, None, None] * w_intra).float()
        weight = weight.unsqueeze(2) if fd == 1 else weight.unsqueeze(1)
        self._log(method, raw, valid, z_ok, r_final, penalty, w_inter, w_intra, b, flat)
        return weight.to(x.device)

    def _log(self, method, raw, valid, z, r_final, penalty, w_inter, w_intra, b, flat=None) -> None:
        fusion = fusion_weights(z, self.temperature).mean(0)
        stats = {"stream_r1/w_inter_mean": float(w_inter.mean()), "stream_r1/w_inter_min": float(w_inter.min()),
                 "stream_r1/w_inter_max": float(w_inter.max()), "stream_r1/r_final": float(r_final.mean()),
                 "stream_r1/penalty": penalty, "stream_r1/w_intra_min": float(w_intra.min()),
                 "stream_r1/w_intra_max": float(w_intra.max()), "stream_r1/w_intra_std": float(w_intra.std()),
                 "stream_r1/invalid": float((~valid).sum())}
        if flat is not None:  # fractions over the valid rollouts (NaN when none is valid)
            stats["stream_r1/flat_temporal"] = float(flat[0].double().mean()) if flat[0].numel() else math.nan
            stats["stream_r1/flat_spatial"] = float(flat[1].double().mean()) if flat[1].numel() else math.nan
        for i, d in enumerate(self.dimensions):
            stats[f"stream_r1/fusion_{d}"] = float(fusion[i])
            ok = raw[valid, i]
            stats[f"stream_r1/{d}"] = float(ok.mean()) if len(ok) else math.nan
        self.last = stats
        method.log_dict(stats, batch_size=b)

    def get_extra_state(self) -> dict:
        return {"last": dict(self.last)}  # the last update's weight statistics (the history is a buffer)

    def set_extra_state(self, state: dict) -> None:
        self.last = dict((state or {}).get("last", {}))
