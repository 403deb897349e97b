"""VBench's temporal flickering (weight-free, exact).

Source: Huang et al. 2024, *VBench*, section 3.1 "Temporal Flickering"; vbench/temporal_flickering.py
(``calculate_mae`` / ``cal_score``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from genrl.eval.dimensions.base import Dimension, DimensionResult

__all__ = ["TemporalFlickering", "flicker_pair_mae", "flicker_score"]


def flicker_pair_mae(frames: Tensor) -> Tensor:
    """VBench's per-pair mean absolute difference of consecutive frames.

    Args:
        frames: ``[..., T, C, H, W]`` with values on the 0-255 scale (uint8 as decoded, or float), T >= 2; any
            leading batch dimensions.

    Returns:
        float64 ``[..., T - 1]``: for each consecutive pair, the mean of ``|frame_{t+1} - frame_t|`` over every
        pixel and channel (0-255 scale).

    Raises:
        ValueError: fewer than 4 dimensions or T < 2.
    """
    if frames.ndim < 4 or frames.shape[-4] < 2:
        raise ValueError(f"flicker needs frames [..., T >= 2, C, H, W], got shape {tuple(frames.shape)}")
    x = frames.to(torch.float64)
    return (x[..., 1:, :, :, :] - x[..., :-1, :, :, :]).abs().flatten(-3).mean(dim=-1)


def flicker_score(frames: Tensor) -> Tensor:
    """VBench's temporal-flickering score ``(255 - mean_t MAE(frame_t, frame_{t+1})) / 255`` of each video.

    Args:
        frames: ``[..., T, C, H, W]`` on the 0-255 scale (uint8 or float), T >= 2.

    Returns:
        float64 ``[...]`` in [0, 1] for 0-255 inputs; 1.0 exactly for a static video, higher is better.

    Raises:
        ValueError: as :func:`flicker_pair_mae`.
    """
    return (255.0 - flicker_pair_mae(frames).mean(dim=-1)) / 255.0


class TemporalFlickering(Dimension):
    """Temporal flickering: ``(255 - mean_t MAE(frame_t, frame_{t+1})) / 255``.

    Per consecutive pair, MAE is the mean absolute difference over every pixel and channel of the uint8 frames
    (computed in float: 0-255); the pair MAEs are averaged over the video's T - 1 pairs. A static video scores
    exactly 1.0; higher is better, range [0, 1]. The dataset score is the mean over videos (weight 1).

    VBench scores this dimension on its static-scene prompts ("In a still frame, ...") after filtering out videos
    that RAFT finds moving (vbench/cli/static_filter.py). genrl does **not** filter: the runner restricts this
    dimension to VBench's prompt subset for it, and a generator that moves on those prompts is penalised here
    instead of dropped.

    Input: uint8 [T, 3, H, W], T >= 2. Output ``extras``: ``{"pair_mae": [T - 1 floats]}``.
    """

    name: ClassVar[str] = "temporal_flickering"
    proxy: ClassVar[bool] = False
    needs_weights: ClassVar[bool] = False
    min_frames: ClassVar[int] = 2
    description: ClassVar[str] = "1 - mean absolute difference of consecutive frames / 255 (VBench, exact)"

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        pair_mae = flicker_pair_mae(frames)  # [T - 1]
        value = (255.0 - float(pair_mae.mean())) / 255.0
        return DimensionResult(value=value, weight=1.0, extras={"pair_mae": pair_mae.tolist()})
