"""Image-to-video dimensions: how well a video keeps the image it was generated from.

Both take the conditioning image with the video (``score_video(frames, fps, image=...)``; evaluation/run.py reads the
image from the manifest ``pipelines/generate.py`` writes):

- ``first_frame_fidelity`` (genrl's, weight-free; not a VBench dimension): the PSNR in dB of the video's first frame
  against the image, ``10 log10(255^2 / MSE)`` over all pixels and channels in float64, capped at ``max_db`` (an
  identical frame has MSE 0). The frame is brought to the image's size first: box-averaged when it is an integer
  multiple of it (exact for ``write_video``'s nearest-neighbour playback enlargement), else resized bilinearly with
  antialiasing. A model that replaces or conditions on the first frame (Wan2.2-TI2V, Wan2.1-I2V) should score high,
  limited by its VAE's reconstruction and the video codec.
- ``i2v_subject`` (VBench-I2V's "Video-Image Subject Consistency", DINO ViT-B/16): with DINO CLS features ``g`` of
  the image and ``f_t`` of the frames, ``value = 0.5 * max_t c(g, f_t) + 0.5 * mean_{t>=1} c(f_{t-1}, f_t)`` where
  ``c`` is the cosine clipped below at 0; the dataset score is the mean over videos (Huang et al. 2024, *VBench++*,
  section on I2V; vbench2_beta_i2v's ``i2v_subject``: weights 0.5 / 0.5 / 0 on max / mean / min). Frames are
  preprocessed as :class:`~genrl.eval.dimensions.consistency.SubjectConsistency` does; the image as VBench-I2V's PIL
  path does (shorter side to 224, bilinear with antialiasing: a PIL resize, reproduced in torch up to rounding).

VBench-I2V's background dimension (DreamSim) and camera motion (CoTracker) are not implemented here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from genrl.eval.dimensions.base import Dimension, DimensionResult
from genrl.eval.dimensions.consistency import SubjectConsistency

__all__ = ["FirstFrameFidelity", "I2VSubject", "frame_at_image_size", "psnr"]


def frame_at_image_size(frame: Tensor, height: int, width: int) -> Tensor:
    """One frame brought to ``height`` x ``width``: float64 [3, height, width] on the 0-255 scale.

    An integer multiple k of the size (the same k on both sides) is box-averaged over k x k blocks (the exact
    inverse of a nearest-neighbour enlargement); any other size is resized bilinearly with antialiasing; the same
    size is returned as is.

    Args:
        frame: uint8 or float [3, H, W] (0-255). height, width: the target size in pixels (>= 1).
    """
    x = frame.double()[None]
    h, w = x.shape[-2:]
    if (h, w) == (height, width):
        return x[0]
    if h % height == 0 and w % width == 0 and h // height == w // width:
        return F.avg_pool2d(x, h // height)[0]
    return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)[0]


def psnr(a: Tensor, b: Tensor, max_db: float = 100.0) -> tuple[float, float]:
    """PSNR of two images on the 0-255 scale: ``(min(max_db, 10 log10(255^2 / MSE)), MSE)``, float64 sums.

    Args:
        a, b: same-shape tensors (any dtype; 0-255). max_db: the cap (returned for MSE 0).
    Raises:
        ValueError: different shapes.
    """
    if a.shape != b.shape:
        raise ValueError(f"psnr: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    mse = float((a.double() - b.double()).pow(2).mean())
    return (max_db if mse == 0 else min(max_db, 10.0 * math.log10(255.0 ** 2 / mse))), mse


class FirstFrameFidelity(Dimension):
    """PSNR (dB) of a video's first frame against its conditioning image (module docstring; genrl's, weight-free).

    Input: uint8 frames [T, 3, H, W] (T >= 1) and the image uint8 [3, h, w]. ``extras``: ``{"mse": float (0-255
    scale), "mae": float}``; weight 1 (the dataset score is the mean PSNR).

    Args:
        max_db: the cap of a video's PSNR (> 0; an identical first frame scores it).
    Raises:
        ValueError: ``max_db`` <= 0.
    """

    name: ClassVar[str] = "first_frame_fidelity"
    needs_image: ClassVar[bool] = True
    unit: ClassVar[str] = "dB"
    min_frames: ClassVar[int] = 1
    description: ClassVar[str] = ("PSNR (dB) of the first frame against the conditioning image (genrl; not a VBench "
                                  "dimension)")

    def __init__(self, max_db: float = 100.0) -> None:
        super().__init__()
        if not float(max_db) > 0:
            raise ValueError(f"dimension {self.name!r}: max_db must be > 0, got {max_db}")
        self.max_db = float(max_db)

    def _score(self, frames: Tensor, fps: float, image: Tensor) -> DimensionResult:
        first = frame_at_image_size(frames[0], *image.shape[-2:])
        value, mse = psnr(first, image, self.max_db)
        mae = float((first - image.double()).abs().mean())
        return DimensionResult(value=value, weight=1.0, extras={"mse": mse, "mae": mae})


class I2VSubject(Dimension):
    """VBench-I2V's video-image subject consistency on DINO ViT-B/16 CLS features (module docstring).

    Weights (``path=``) and the frame preprocessing are :class:`SubjectConsistency`'s (a local ``ViTModel`` folder,
    e.g. a copy of facebook/dino-vitb16); the image is resized with antialiasing as PIL does. Input: uint8 frames
    [T, 3, H, W], T >= 2, and the image uint8 [3, h, w] (any size: the aspect is kept, as VBench-I2V crops its images
    to the video's aspect beforehand). ``extras``: ``{"conformity": [T floats], "consecutive": [T - 1 floats]}``;
    weight 1.

    Args:
        path, max_batch, dtype, size, antialias: as :class:`SubjectConsistency` (``antialias`` applies to the
            frames; the image is always antialiased).
    Raises:
        FileNotFoundError / ValueError: as :class:`SubjectConsistency`.
    """

    name: ClassVar[str] = "i2v_subject"
    needs_weights: ClassVar[bool] = True
    needs_image: ClassVar[bool] = True
    min_frames: ClassVar[int] = 2
    description: ClassVar[str] = ("DINO ViT-B/16: 0.5 x best frame-to-image cosine + 0.5 x mean consecutive-frame "
                                  "cosine (VBench-I2V)")
    weight_files: ClassVar[dict[str, str]] = dict(SubjectConsistency.weight_files)

    def __init__(self, path: str | Path | None = None, max_batch: int = 32, dtype: str | torch.dtype = "float32",
                 size: int | None = None, antialias: bool = False) -> None:
        super().__init__()
        self.encoder = SubjectConsistency(path=path, max_batch=max_batch, dtype=dtype, size=size,
                                          antialias=antialias)
        self.path = self.encoder.path

    def _score(self, frames: Tensor, fps: float, image: Tensor) -> DimensionResult:
        f = F.normalize(self.encoder.features(frames).double(), dim=-1)
        g = F.normalize(self.encoder.features(image[None], antialias=True).double(), dim=-1)
        # float32 rounding of the cosines as VBench's F.cosine_similarity, clipped below at 0
        conformity = (f @ g[0]).float().clamp(min=0).double()
        consecutive = (f[1:] * f[:-1]).sum(-1).float().clamp(min=0).double()
        value = 0.5 * float(conformity.max()) + 0.5 * math.fsum(consecutive.tolist()) / consecutive.numel()
        return DimensionResult(value=value, weight=1.0, extras={"conformity": conformity.tolist(),
                                                                "consecutive": consecutive.tolist()})

    def to(self, device: str | torch.device) -> I2VSubject:
        super().to(device)
        self.encoder.to(self.device)
        return self
