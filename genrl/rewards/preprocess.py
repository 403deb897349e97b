"""Image preprocessing for reward models, in torch (differentiable) with a PIL reference for parity tests.

Reference scorers (flow_grpo, DanceGRPO) convert to PIL / uint8 before the processor, which breaks the
gradient and quantises; genrl builds the same transform in torch from the processor constants
(docs/rewards.md, The protocol): resize the shortest side with antialiased bicubic interpolation, centre-crop,
normalise. :func:`pil_reference` is the PIL path (what ``transformers`` CLIP processors and open_clip's
validation transform do) that the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["CLIP_MEAN", "CLIP_STD", "IMAGENET_MEAN", "IMAGENET_STD", "resize_shortest_side", "center_crop",
           "normalize", "clip_preprocess", "pil_reference"]

#: OpenAI CLIP normalisation (also used by open_clip ViT-H, PickScore, HPSv2, BLIP / ImageReward).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _check(images: Tensor) -> None:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be float [N, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise ValueError(f"images must be float in [0, 1], got dtype {images.dtype}; use images.float() / 255")


def resize_shortest_side(images: Tensor, size: int, interpolation: str = "bicubic", antialias: bool = True) -> Tensor:
    """Resize float [N, 3, H, W] in [0, 1] so that the shorter side is ``size`` (aspect kept; the longer side is
    ``int(size * long / short)``, the rounding of transformers' CLIP processor).

    Like PIL's resampler it works in two separable passes, width first, and clips to [0, 1] after each (so
    bicubic overshoot is cut where PIL cuts it); with ``antialias`` torch's kernel is PIL's bicubic (a = -0.5)
    with PIL's support scaling when shrinking. Differentiable (except at clipped pixels).

    Returns:
        same dtype [N, 3, H', W'] in [0, 1], min(H', W') == ``size``.
    Raises:
        ValueError: not float [N, 3, H, W].
    """
    _check(images)
    h, w = images.shape[-2:]
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    x = images
    if new_w != w:
        x = F.interpolate(x, size=(h, new_w), mode=interpolation, align_corners=False, antialias=antialias).clamp(0, 1)
    if new_h != h:
        x = F.interpolate(x, size=(new_h, new_w), mode=interpolation, align_corners=False,
                          antialias=antialias).clamp(0, 1)
    return x


def center_crop(images: Tensor, size: int | tuple[int, int]) -> Tensor:
    """Centre crop [N, C, H, W] to ``size`` (int or (h, w)); the offsets round like torchvision's.

    Raises:
        ValueError: ``size`` larger than the images.
    """
    th, tw = (size, size) if isinstance(size, int) else size
    h, w = images.shape[-2:]
    if th > h or tw > w:
        raise ValueError(f"cannot crop {h}x{w} images to {th}x{tw}; resize first")
    top = int(round((h - th) / 2.0))
    left = int(round((w - tw) / 2.0))
    return images[..., top : top + th, left : left + tw]


def normalize(images: Tensor, mean: Sequence[float], std: Sequence[float]) -> Tensor:
    """(images - mean) / std per channel, for float [N, 3, H, W]."""
    m = torch.tensor(mean, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=images.dtype, device=images.device).view(1, -1, 1, 1)
    return (images - m) / s


def clip_preprocess(
    images: Tensor, size: int = 224, mean: Sequence[float] = CLIP_MEAN, std: Sequence[float] = CLIP_STD,
    crop: bool = True, interpolation: str = "bicubic", antialias: bool = True,
) -> Tensor:
    """CLIP-style preprocessing in torch: shortest side to ``size``, centre crop ``size`` x ``size``, normalise.

    Args:
        images: float [N, 3, H, W] in [0, 1] (gradients flow through).
        size: output side (224 for CLIP ViT-L/14 and ViT-H/14).
        mean, std: normalisation (default OpenAI CLIP's).
        crop: centre-crop after the resize (False: resize both sides to ``size`` directly).
    Returns:
        float [N, 3, size, size]. Against :func:`pil_reference` (uint8 PIL path) the difference is at most
        about 0.016 in normalised units (one uint8 step) on uniform-noise images (tests/test_reward_preprocess.py).
    Raises:
        ValueError: not [N, 3, H, W] float.
    """
    _check(images)
    if crop:
        x = center_crop(resize_shortest_side(images, size, interpolation, antialias), size)
    else:
        x = F.interpolate(images, size=(size, size), mode=interpolation, align_corners=False, antialias=antialias)
    return normalize(x, mean, std)


def pil_reference(
    images: Tensor, size: int = 224, mean: Sequence[float] = CLIP_MEAN, std: Sequence[float] = CLIP_STD,
    crop: bool = True,
) -> Tensor:
    """The reference PIL path: uint8 conversion, ``PIL.Image.resize(BICUBIC)`` of the shortest side, centre
    crop, ToTensor, normalise (what CLIP processors and open_clip's val transform do). For parity tests only
    (not differentiable; quantises to uint8).

    Returns:
        float32 [N, 3, size, size] on the CPU.
    """
    import numpy as np
    from PIL import Image

    _check(images)
    out = []
    for img in images.detach().float().clamp(0, 1).cpu():
        arr = (img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        pil = Image.fromarray(arr)
        w, h = pil.size
        if crop:
            if h <= w:
                nh, nw = size, int(size * w / h)
            else:
                nh, nw = int(size * h / w), size
            pil = pil.resize((nw, nh), Image.BICUBIC)
            top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
            pil = pil.crop((left, top, left + size, top + size))
        else:
            pil = pil.resize((size, size), Image.BICUBIC)
        t = torch.from_numpy(np.asarray(pil, dtype=np.float32) / 255.0).permute(2, 0, 1)
        out.append(t)
    return normalize(torch.stack(out), mean, std)
