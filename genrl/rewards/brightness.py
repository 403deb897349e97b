"""Brightness: a prompt-agnostic pixel-statistics reward, mainly a planted hack for testing reward-hacking detection."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from genrl.rewards.base import RewardModel
from genrl.rewards.registry import register_reward

__all__ = ["BrightnessReward"]

#: ITU-R BT.601 luma weights of (R, G, B) (the same as :data:`genrl.eval.gold.LUMA_WEIGHTS`).
_LUMA = (0.299, 0.587, 0.114)


@register_reward("brightness")
class BrightnessReward(RewardModel):
    """Mean luma of a video, or its darkness.

    ``brightness`` = the mean over frames and pixels of the Rec. 601 luma ``0.299 R + 0.587 G + 0.114 B`` (in
    [0, 1]; a black video 0, a white one 1). ``mode: bright`` rewards it (``reward = brightness``), ``mode: dark``
    rewards its complement (``reward = 1 - brightness``), both before the entry's ``scale`` / ``shift``.

    It ignores the prompt and is trivially gameable: it exists to plant a known hack (a training reward that pays for
    dark frames) and check that :class:`genrl.callbacks.RewardHackingMonitor` catches it
    (``benchmarks/hacking_shapes.py``), or as a small term of a mix. Differentiable, so :meth:`saliency` works.

    Keys: ``"reward"`` [B]; ``"brightness"`` [B] (the raw mean luma, whatever the mode).

    Args:
        mode: ``"bright"`` (default) or ``"dark"``.
        scale, shift: affine on ``"reward"``.

    Raises:
        ValueError: an unknown ``mode``; at call, the protocol's input checks (C must be 3).
    """

    differentiable = True
    dimensions = ("reward", "brightness")
    channels = (3,)

    def __init__(self, mode: Literal["bright", "dark"] = "bright", scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        if mode not in ("bright", "dark"):
            raise ValueError(f"brightness reward: mode must be 'bright' or 'dark', got {mode!r}")
        self.mode = mode

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        w = torch.tensor(_LUMA, dtype=torch.float32, device=pixels.device)
        luma = (pixels.float() * w[:, None, None]).sum(dim=2)  # [B, T, H, W]
        brightness = luma.flatten(1).mean(dim=1)
        reward = brightness if self.mode == "bright" else 1.0 - brightness
        return {"reward": reward, "brightness": brightness}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode!r}"
