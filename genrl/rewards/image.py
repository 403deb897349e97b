"""Image rewards on videos: the frame policy (which frames an image reward scores) and the base class.

An image reward (CLIPScore, PickScore, HPSv2, ImageReward, aesthetic, OCR, ...) implements
``score_images(images [N, 3, H, W], prompts [N]) -> {key: [N]}``. :class:`ImageRewardModel` turns it into a
video reward (docs/rewards.md, The protocol): it picks frames with its :class:`FramePolicy` (all frames, k
random frames, or every ``stride``-th frame; Flow-GRPO's video OCR scores every 4th frame, VADER one
random frame), scores them as a batch of images in chunks of ``max_batch``, and reduces over frames (mean or
min). An image is a one-frame video, so the same class scores images and videos.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor

from genrl.noise import mix_seed, stream_id
from genrl.rewards.base import RewardModel

__all__ = ["FramePolicy", "ImageRewardModel", "select_frames"]


@dataclass
class FramePolicy:
    """Which frames of a [B, T, C, H, W] video an image reward scores, and how they are reduced.

    Attributes:
        frames: ``"all"``; ``"random"`` (``num_frames`` distinct frames per video, drawn from ``seed`` and the
            call count, so a run is reproducible); ``"stride"`` (frames 0, stride, 2 stride, ...); ``"first"``,
            ``"middle"``, ``"last"`` (one frame).
        num_frames: k for ``"random"`` (clipped to T).
        stride: step for ``"stride"``.
        reduce: ``"mean"`` or ``"min"`` over the scored frames.
        seed: seed of the ``"random"`` draws.
        skip_first: leave out the first k frames before the policy applies (image-to-video: the given first frame is
            nearly the same in every video of a group, so scoring it dilutes the group's spread; 1 scores the
            continuation only). Raises at scoring time when a video has no frame left.
    """

    frames: Literal["all", "random", "stride", "first", "middle", "last"] = "all"
    num_frames: int = 1
    stride: int = 4
    reduce: Literal["mean", "min"] = "mean"
    seed: int = 0
    skip_first: int = 0

    def __post_init__(self) -> None:
        if self.frames not in ("all", "random", "stride", "first", "middle", "last"):
            raise ValueError(f"unknown frames policy {self.frames!r}; use all, random, stride, first, middle or last")
        if self.reduce not in ("mean", "min"):
            raise ValueError(f"unknown frame reduction {self.reduce!r}; use mean or min")
        if self.num_frames < 1 or self.stride < 1:
            raise ValueError(f"num_frames and stride must be >= 1, got {self.num_frames}, {self.stride}")
        if self.skip_first < 0:
            raise ValueError(f"skip_first must be >= 0, got {self.skip_first}")


def select_frames(num_frames: int, batch: int, policy: FramePolicy, call: int = 0) -> Tensor:
    """Frame indices int64 [B, k] that ``policy`` scores in videos of ``num_frames`` frames.

    ``"random"`` draws k distinct frames per video from ``(policy.seed, call, video)``; every other policy
    gives the same indices to every video. ``policy.skip_first`` = s applies the policy to frames s .. T - 1.

    Raises:
        ValueError: ``skip_first`` leaves no frame.
    """
    s = policy.skip_first
    if s:
        if num_frames <= s:
            raise ValueError(f"frames policy skip_first={s} leaves none of the {num_frames} frames to score; lower "
                             f"skip_first")
        return select_frames(num_frames - s, batch, replace(policy, skip_first=0), call) + s
    t = num_frames
    if policy.frames == "all":
        idx = torch.arange(t)
    elif policy.frames == "stride":
        idx = torch.arange(0, t, policy.stride)
    elif policy.frames == "first":
        idx = torch.tensor([0])
    elif policy.frames == "middle":
        idx = torch.tensor([t // 2])
    elif policy.frames == "last":
        idx = torch.tensor([t - 1])
    else:
        k = min(policy.num_frames, t)
        rows = []
        for b in range(batch):
            g = torch.Generator().manual_seed(mix_seed(policy.seed, call, b, stream_id("reward.image_policy")))
            rows.append(torch.randperm(t, generator=g)[:k].sort().values)
        return torch.stack(rows)
    return idx.unsqueeze(0).expand(batch, -1)


class ImageRewardModel(RewardModel):
    """Base class of image rewards scored frame-wise on videos.

    Subclasses implement :meth:`score_images`; the frame policy is a constructor argument, so it is set in
    config (``kwargs: {frames: {frames: stride, stride: 4}}``).

    Args:
        scale, shift: affine on the main key (see :class:`RewardModel`).
        frames: a :class:`FramePolicy` (or its fields as a dict); default all frames, mean.
        max_batch: images per ``score_images`` call.
    Raises:
        ValueError: a bad frame policy or ``max_batch < 1``.
    """

    channels: ClassVar[tuple[int, ...]] = (3,)

    def __init__(self, scale: float = 1.0, shift: float = 0.0, frames: FramePolicy | dict | None = None,
                 max_batch: int = 32) -> None:
        super().__init__(scale=scale, shift=shift)
        self.frame_policy = frames if isinstance(frames, FramePolicy) else FramePolicy(**(frames or {}))
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        self._calls = 0

    @abc.abstractmethod
    def score_images(self, images: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        """Score a batch of images.

        Args:
            images: float [N, 3, H, W] in [0, 1] (with grad when the reward is differentiable).
            prompts: N strings (the video's prompt repeated for each of its scored frames).
            **meta: per-image lists of the reward's extras, expanded like ``prompts``.
        Returns:
            ``{"reward": float [N], <other dimensions>: float [N], optional "valid": bool [N]}``.
        """

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        b, t = pixels.shape[:2]
        idx = select_frames(t, b, self.frame_policy, self._calls).to(pixels.device)
        self._calls += 1
        k = idx.shape[1]
        frames = torch.gather(pixels, 1, idx.view(b, k, 1, 1, 1).expand(-1, -1, *pixels.shape[2:]))
        images = frames.reshape(b * k, *pixels.shape[2:])
        flat_prompts = [p for p in prompts for _ in range(k)]
        flat_meta = {key: [v for v in value for _ in range(k)] if isinstance(value, (list, tuple)) else value
                     for key, value in meta.items()}
        parts: list[dict[str, Tensor]] = []
        for start in range(0, b * k, self.max_batch):
            sl = slice(start, start + self.max_batch)
            sub_meta = {key: value[sl] if isinstance(value, list) else value for key, value in flat_meta.items()}
            parts.append(self.score_images(images[sl], flat_prompts[sl], **sub_meta))
        out: dict[str, Tensor] = {}
        for key in parts[0]:
            per_frame = torch.cat([p[key] for p in parts]).reshape(b, k)
            if key == "valid":
                out[key] = per_frame.bool().all(dim=1)
            elif self.frame_policy.reduce == "min":
                out[key] = per_frame.float().min(dim=1).values
            else:
                out[key] = per_frame.float().mean(dim=1)
        return out
