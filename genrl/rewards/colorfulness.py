"""Colorfulness: a prompt-agnostic, differentiable image-statistics reward that works on any pixels."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from genrl.rewards.base import RewardModel
from genrl.rewards.registry import register_reward

__all__ = ["ColorfulnessReward"]


@register_reward("colorfulness")
class ColorfulnessReward(RewardModel):
    """Hasler & Suesstrunk colorfulness (2003, "Measuring colourfulness in natural images", eq. 3).

    Per frame, with opponent channels rg = R - G and yb = (R + G) / 2 - B over the pixels:
    ``M = sqrt(std_rg^2 + std_yb^2) + 0.3 * sqrt(mean_rg^2 + mean_yb^2)``; the score is the mean of M over
    frames. Pixels in [0, 1] give M in about [0, 1.1] (the paper's 0-255 values divided by 255; a black
    or grey video scores 0). It ignores the prompt, so it rewards any prompt suite (e.g. VBench) and is a
    smoke-test reward for real text; it is differentiable, so :meth:`saliency` works.

    Keys: ``"reward"`` [B] (mean M), ``"frame_min"`` [B] (least colourful frame).
    Raises (at call): the protocol's input checks; C must be 3.
    """

    differentiable = True
    dimensions = ("reward", "frame_min")
    channels = (3,)

    def __init__(self, scale: float = 1.0, shift: float = 0.0, eps: float = 1e-8) -> None:
        super().__init__(scale=scale, shift=shift)
        self.eps = eps

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        x = pixels.float()
        r, g, b = x[:, :, 0], x[:, :, 1], x[:, :, 2]  # [B, T, H, W]
        rg = (r - g).flatten(2)
        yb = (0.5 * (r + g) - b).flatten(2)
        spread = torch.sqrt(rg.var(dim=-1, unbiased=False) + yb.var(dim=-1, unbiased=False) + self.eps)
        level = torch.sqrt(rg.mean(-1) ** 2 + yb.mean(-1) ** 2 + self.eps)
        m = spread + 0.3 * level  # [B, T]
        return {"reward": m.mean(1), "frame_min": m.min(1).values}
