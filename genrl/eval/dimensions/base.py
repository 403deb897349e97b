"""The dimension protocol, its result type, and the VBench-style preprocessing shared by the dimensions.

A :class:`Dimension` scores one video at a time, ``score_video(frames uint8 [T, 3, H, W], fps) ->
DimensionResult``, and pools the per-video results into the dataset score with :meth:`Dimension.aggregate`
(VBench's pooling: a weighted mean, where the weight is 1 per video or, for the consistency dimensions, the
number of frame pairs). Frames are what a decoder gives: uint8 RGB, channels first, any device (CPU expected).

Preprocessing follows VBench's ``vbench/utils.py`` exactly as it runs under VBench's pinned torchvision
(< 0.16): ``load_video`` returns **float32** frames with values 0-255 (``torch.Tensor`` of the uint8 array), so
torchvision's ``Resize`` works on floats (no rounding back to uint8, no clamp) and, for tensors, without
antialiasing (torchvision < 0.17 defaults to ``antialias=False`` for tensors). :func:`resize_shorter_side`
reproduces that (``antialias=True`` is an option for newer-torchvision behaviour).
"""

from __future__ import annotations

import abc
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from genrl.rewards.clip_rewards import as_dtype, freeze, preprocessor_norm, projected_embedding
from genrl.rewards.preprocess import center_crop, normalize

__all__ = ["TooFewFrames", "DimensionResult", "Dimension", "check_frames", "check_image", "check_fps",
           "resize_shorter_side", "require_files", "load_clip_image_encoder", "clip_image_embeddings"]


class TooFewFrames(ValueError):
    """A video is too short for a dimension.

    Attributes:
        dimension: the dimension's name. num_frames: the video's T. minimum: the least T it needs.
    """

    def __init__(self, dimension: str, num_frames: int, minimum: int, detail: str = "") -> None:
        self.dimension = dimension
        self.num_frames = int(num_frames)
        self.minimum = int(minimum)
        msg = (f"dimension {dimension!r} needs a video of at least {minimum} frames, got T={num_frames}"
               + (f" ({detail})" if detail else "") + "; generate or read longer clips, or skip this video")
        super().__init__(msg)


@dataclass
class DimensionResult:
    """One video's score on one dimension.

    Attributes:
        value: the video's score (VBench's per-video number, except imaging quality, which is divided by 100 here
            so that the weighted mean of the values is VBench's dataset score).
        weight: the video's weight in the dataset score ``sum(value * weight) / sum(weight)``: 1, or for
            subject / background consistency the number of frame pairs (T - 1), which makes the pooled score
            VBench's frame-weighted mean.
        extras: per-video details (per-frame values, flow statistics, ...); plain Python values.
    """

    value: float
    weight: float = 1.0
    extras: dict = field(default_factory=dict)


def check_frames(frames: Any, name: str) -> Tensor:
    """Validate a video for :meth:`Dimension.score_video`; returns it unchanged.

    Raises:
        TypeError: not a tensor.
        ValueError: not uint8 ``[T, 3, H, W]`` (the message says how to convert float pixels), or T = 0.
    """
    if not isinstance(frames, Tensor):
        raise TypeError(f"dimension {name!r}: frames must be a torch.Tensor uint8 [T, 3, H, W], got "
                        f"{type(frames).__name__}")
    if frames.ndim != 4 or frames.shape[1] != 3:
        hint = " (channels-last? use frames.permute(0, 3, 1, 2))" if frames.ndim == 4 and frames.shape[-1] == 3 else ""
        raise ValueError(f"dimension {name!r}: frames must be uint8 [T, 3, H, W] RGB, got shape "
                         f"{tuple(frames.shape)}{hint}")
    if frames.dtype != torch.uint8:
        raise ValueError(f"dimension {name!r}: frames must be uint8 (0-255, as decoded), got {frames.dtype}; for "
                         f"float pixels in [0, 1] pass (pixels * 255).round().clamp(0, 255).to(torch.uint8)")
    if frames.shape[0] == 0:
        raise ValueError(f"dimension {name!r}: the video has no frames (T = 0)")
    return frames


def check_image(image: Any, name: str) -> Tensor:
    """Validate the conditioning image of an image-to-video dimension; returns it unchanged.

    Raises:
        TypeError: not a tensor.
        ValueError: not uint8 ``[3, H, W]`` RGB (the message says how to convert a PIL image or float pixels).
    """
    if not isinstance(image, Tensor):
        raise TypeError(f"dimension {name!r}: image must be a torch.Tensor uint8 [3, H, W], got {type(image).__name__}"
                        f" (a PIL image: torch.from_numpy(numpy.asarray(im.convert('RGB'))).permute(2, 0, 1))")
    if image.ndim != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
        raise ValueError(f"dimension {name!r}: image must be uint8 [3, H, W] RGB (0-255), got {image.dtype} of shape "
                         f"{tuple(image.shape)}")
    return image


def check_fps(fps: Any, name: str) -> float:
    """``fps`` as a float; raises ValueError unless it is a finite number > 0 (the container's frame rate)."""
    try:
        value = float(fps)
    except (TypeError, ValueError):
        raise ValueError(f"dimension {name!r}: fps must be a number > 0 (the video's frame rate), got {fps!r}") \
            from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"dimension {name!r}: fps must be a finite number > 0 (the video's frame rate), got {fps!r}")
    return value


def resize_shorter_side(x: Tensor, size: int, mode: str, antialias: bool = False) -> Tensor:
    """torchvision ``Resize(size)`` on a float tensor: the shorter side becomes ``size``, the longer side
    ``int(size * long / short)`` (torchvision's rounding), values neither rounded nor clamped.

    Args:
        x: float [N, C, H, W] (VBench feeds 0-255 floats).
        size: target of the shorter side. mode: ``"bilinear"`` or ``"bicubic"`` (align_corners=False).
        antialias: False reproduces VBench's pinned torchvision (< 0.16) on tensors; True newer torchvision.
    Returns:
        float [N, C, H', W'] (``x`` itself when the size already matches, as torchvision does).
    """
    h, w = x.shape[-2:]
    if h <= w:
        new_h, new_w = size, int(size * w / h)
    else:
        new_h, new_w = int(size * h / w), size
    if (new_h, new_w) == (h, w):
        return x
    return F.interpolate(x, size=(new_h, new_w), mode=mode, align_corners=False, antialias=antialias)


def require_files(name: str, path: str | Path | None, files: dict[str, str]) -> Path:
    """Check a local weights folder before anything loads; returns it.

    ``files`` maps a glob (``"a|b"``: either of two globs) to what it is.

    Raises:
        FileNotFoundError: ``path`` missing, not a folder, or lacking an entry of ``files``; the message lists the
            whole expected layout and marks what is missing.
    """
    folder = Path(path).expanduser() if path is not None else None
    ok = folder is not None and folder.is_dir()
    missing = [f for f in files if not ok or not any(any(folder.glob(g)) for g in f.split("|"))]
    if not missing:
        return folder
    layout = "\n".join(f"  {'MISSING ' if f in missing else 'ok      '}{f.replace('|', ' or ')}  ({what})"
                       for f, what in files.items())
    where = "no path given" if path is None else (f"{str(path)!r} is not a folder" if not ok else repr(str(path)))
    raise FileNotFoundError(f"dimension {name!r}: weights not found: {where}; expected a local folder with:\n"
                            f"{layout}\nnothing is downloaded: place these files there")


class Dimension(abc.ABC):
    """Base class of the VBench-compatible dimensions.

    Class attributes:
        name: the VBench key (e.g. ``"temporal_flickering"``).
        proxy: True when the model differs from VBench's (Farneback flow instead of RAFT / AMT-S): such scores are
            labelled "proxy" and are not comparable with published VBench numbers.
        needs_weights: True when ``path`` (a local weights folder) is required.
        needs_image: True for an image-to-video dimension: :meth:`score_video` needs the conditioning image (the
            first frame the video was generated from) and :meth:`_score` receives it as a third argument.
        unit: the score's unit when it is not a fraction in [0, 1] (``"dB"``), else ``""``.
        min_frames: the least T :meth:`score_video` accepts.
        description: one line for reports.
        weight_files: the layout of the weights folder (glob -> what), for errors and listings.

    Subclasses implement :meth:`_score`; :meth:`score_video` validates the input first.
    """

    name: ClassVar[str] = ""
    proxy: ClassVar[bool] = False
    needs_weights: ClassVar[bool] = False
    needs_image: ClassVar[bool] = False
    unit: ClassVar[str] = ""
    min_frames: ClassVar[int] = 1
    description: ClassVar[str] = ""
    weight_files: ClassVar[dict[str, str]] = {}

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def score_video(self, frames: Tensor, fps: float, image: Tensor | None = None) -> DimensionResult:
        """Score one video.

        Args:
            frames: uint8 [T, 3, H, W] RGB (CPU expected; moved to the dimension's device where a model runs).
            fps: the video's frame rate (frames / s, > 0); only dynamic degree uses it.
            image: the conditioning image of an image-to-video sample, uint8 [3, H', W'] RGB (any size); required
                by the dimensions with :attr:`needs_image`, ignored by the others.
        Returns:
            a :class:`DimensionResult`.
        Raises:
            TypeError / ValueError: bad frames, fps or image (the message says what is expected); no image for a
                dimension that needs one.
            TooFewFrames: T < :attr:`min_frames` (or too few after resampling).
        """
        check_frames(frames, self.name)
        fps = check_fps(fps, self.name)
        if frames.shape[0] < self.min_frames:
            raise TooFewFrames(self.name, frames.shape[0], self.min_frames)
        if not self.needs_image:
            return self._score(frames, fps)
        if image is None:
            raise ValueError(f"dimension {self.name!r} compares a video with the image it was generated from: pass "
                             f"image= (uint8 [3, H, W]); evaluation/run.py reads it from the manifest's 'image'")
        return self._score(frames, fps, check_image(image, self.name))

    @abc.abstractmethod
    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        """The dimension's formula on checked frames (uint8 [T, 3, H, W], T >= min_frames) and fps > 0."""

    def aggregate(self, results: list[DimensionResult]) -> float:
        """VBench's dataset score: ``sum(value * weight) / sum(weight)`` over the videos (float64 sums).

        Raises:
            ValueError: no results, or weights that do not sum to a positive number.
        """
        if not results:
            raise ValueError(f"dimension {self.name!r}: no per-video results to aggregate")
        total = math.fsum(float(r.weight) for r in results)
        if not total > 0:
            raise ValueError(f"dimension {self.name!r}: the weights sum to {total}; they must be positive")
        return math.fsum(float(r.value) * float(r.weight) for r in results) / total

    def to(self, device: str | torch.device) -> Dimension:
        """Move the dimension's models (if any) to ``device``; returns ``self``."""
        self.device = torch.device(device)
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, proxy={self.proxy}, device={str(self.device)!r})"


# ---------------------------------------------------------------------------------------------- CLIP helpers

CLIP_FOLDER_FILES = {
    "config.json": "transformers CLIPModel or CLIPVisionModelWithProjection config",
    "model*.safetensors|pytorch_model*.bin": "its weights (save_pretrained layout)",
}


def load_clip_image_encoder(folder: Path, dtype: str | torch.dtype, name: str):
    """Load a transformers CLIP image tower from a local folder (``model_type`` ``clip`` or
    ``clip_vision_model``), frozen and in eval mode.

    Returns:
        ``(model, vision_only, image_size, projection_dim, mean, std)``; ``mean`` / ``std`` from the folder's
        ``preprocessor_config.json`` if present, else OpenAI CLIP's (which VBench hard-codes).
    Raises:
        ValueError: the config is not a CLIP model (names the file and its model_type).
    """
    from transformers import CLIPModel, CLIPVisionModelWithProjection

    model_type = json.loads((folder / "config.json").read_text()).get("model_type", "clip")
    if model_type == "clip":
        model = CLIPModel.from_pretrained(folder, local_files_only=True, dtype=as_dtype(dtype))
        vision_cfg, proj, vision_only = model.config.vision_config, model.config.projection_dim, False
    elif model_type == "clip_vision_model":
        model = CLIPVisionModelWithProjection.from_pretrained(folder, local_files_only=True, dtype=as_dtype(dtype))
        vision_cfg, proj, vision_only = model.config, model.config.projection_dim, True
    else:
        raise ValueError(f"dimension {name!r}: {folder / 'config.json'} has model_type {model_type!r}; expected a "
                         f"CLIP model ('clip' or 'clip_vision_model')")
    mean, std = preprocessor_norm(folder)
    return freeze(model), vision_only, int(vision_cfg.image_size), int(proj), mean, std


def clip_image_embeddings(model, vision_only: bool, frames: Tensor, size: int, mean, std, antialias: bool,
                          max_batch: int) -> Tensor:
    """VBench's ``clip_transform(size)`` then CLIP's projected image embedding (``encode_image``), batched.

    Transform (vbench/utils.py): frames as 0-255 floats, shorter side to ``size`` (bicubic, see
    :func:`resize_shorter_side`), centre crop ``size`` x ``size``, divide by 255, normalise with ``mean`` / ``std``.

    Args:
        frames: uint8 [T, 3, H, W]. Returns: float32 [T, D] unnormalised embeddings on the model's device.
    """
    p = next(model.parameters())
    out = []
    with torch.no_grad():
        for chunk in frames.split(max_batch):
            x = chunk.to(p.device).float()
            x = center_crop(resize_shorter_side(x, size, "bicubic", antialias), size).div(255.0)
            x = normalize(x, mean, std).to(p.dtype)
            emb = model(pixel_values=x) if vision_only else model.get_image_features(pixel_values=x)
            out.append(projected_embedding(emb).float())
    return torch.cat(out)
