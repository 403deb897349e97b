"""Frechet Inception Distance (Heusel et al. 2017) and CLIP-FID on video frames.

Features: the FID Inception-v3 (pool3, 2048-d; the TF "2015-12-05" graph ported to PyTorch) through
torchmetrics' ``NoTrainInceptionV3`` (torch-fidelity's implementation) from a local weights file
(:class:`InceptionExtractor`), or CLIP image embeddings (CLIP-FID, Kynkaanniemi et al. 2023, "The Role of
ImageNet Classes in Frechet Inception Distance"; clean-fid's ``clip_vit_b_32`` uses the projected image
embedding) from a local transformers folder (:class:`ClipImageExtractor`). Any ``nn.Module`` mapping uint8
``[N, 3, H, W]`` to ``[N, D]`` works as well. :func:`frame_feature_stats` collects statistics over the frames
of a set of videos, :func:`fid` compares two of them (:func:`genrl.eval.frechet.frechet_distance`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from genrl.eval.frechet import FeatureStats, extractor_identity, file_sha256, frechet_report
from genrl.eval.fvd import _as_uint8_video
from genrl.rewards.clip_rewards import preprocessor_norm, projected_embedding
from genrl.rewards.preprocess import clip_preprocess

__all__ = ["InceptionExtractor", "ClipImageExtractor", "frame_feature_stats", "fid", "INCEPTION_FILE",
           "FID_WARN_BELOW", "FID_COMPARABLE_MIN"]

#: the FID Inception weights file (pytorch-fid's name; torch-fidelity ships the same weights as
#: weights-inception-2015-12-05-6726825d.pth)
INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"
#: below this many images a set gets a bias warning (FID-10k; FID-50k is the usual image-generation protocol)
FID_WARN_BELOW = 10_000
#: below this many images the result is marked non-comparable (fewer samples than Inception's 2048 dimensions
#: make the covariance singular)
FID_COMPARABLE_MIN = 2048


def _check_images(images: Tensor) -> None:
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"images must be uint8 [N, 3, H, W], got {shape}")
    if images.dtype != torch.uint8:
        raise TypeError(f"images must be uint8 in [0, 255], got {images.dtype}; convert genrl pixels with "
                        "(x.clamp(0, 1) * 255).round().to(torch.uint8)")


class InceptionExtractor(nn.Module):
    """FID features: Inception-v3 pool3 (2048-d) via ``torchmetrics.image.fid.NoTrainInceptionV3(
    name="inception-v3-compat", features_list=["2048"], feature_extractor_weights_path=...)``.

    The network resizes to 299 x 299 itself (bilinear) and maps [0, 255] to [-1, 1]. ``antialias=False``
    (default) is TensorFlow-1 bilinear resizing, as in the original FID code and torch-fidelity, so numbers
    match published ones; ``True`` is torchmetrics' own default (antialiased torch bilinear) and changes FID.

    Args:
        weights_path: local ``pt_inception-2015-12-05-6726825d.pth`` (pytorch-fid's release, ~92 MB; torch-fidelity's
            ``weights-inception-2015-12-05-6726825d.pth`` is the same weights). Nothing is downloaded.
        antialias: see above. batch_size: images per forward pass (used by :func:`frame_feature_stats`).
    Input: uint8 [N, 3, H, W]. Output: float64 [N, 2048] on the CPU.
    Attributes: name ``"inception_v3_fid"``, sha256 of the weights file, feature_dim 2048.
    Raises:
        FileNotFoundError: no file at ``weights_path`` (names the file and where it comes from).
    """

    def __init__(self, weights_path: str | Path, antialias: bool = False, batch_size: int = 32) -> None:
        super().__init__()
        path = Path(weights_path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(
                f"no FID Inception weights at {str(path)!r}: expected {INCEPTION_FILE}, the TF Inception-v3 of the "
                "original FID ported to PyTorch (~92 MB; pytorch-fid's GitHub release 'fid_weights', or "
                "torch-fidelity's release v0.2.0 as weights-inception-2015-12-05-6726825d.pth, the same weights). "
                "Nothing is downloaded: place the file there and pass its path")
        from torchmetrics.image.fid import NoTrainInceptionV3

        self.net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                                      feature_extractor_weights_path=str(path), antialias=antialias)
        self.net.requires_grad_(False)
        self.name, self.sha256, self.feature_dim = "inception_v3_fid", file_sha256(path), 2048
        self.batch_size, self.source = int(batch_size), str(path)

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        _check_images(images)
        device = next(self.net.parameters()).device
        return self.net(images.to(device)).double().cpu()


def _folder_sha256(folder: Path, patterns: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for pattern in patterns:
        for f in sorted(folder.glob(pattern)):
            h.update(f.name.encode() + b"|")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


class ClipImageExtractor(nn.Module):
    """CLIP-FID features: the projected CLIP image embedding (not L2-normalised, as clean-fid's CLIP features).

    Loads ``transformers.CLIPModel`` (``model_type "clip"``) or ``CLIPVisionModelWithProjection``
    (``"clip_vision_model"``) from a local folder (``local_files_only``; e.g. a copy of
    openai/clip-vit-base-patch32, the CLIP-FID backbone). Preprocessing is
    :func:`genrl.rewards.preprocess.clip_preprocess` (shortest side to the model's image size, bicubic with
    antialias, centre crop) with the folder's ``preprocessor_config.json`` mean / std (OpenAI CLIP's if absent),
    as genrl's CLIP rewards do.

    Input: uint8 [N, 3, H, W]. Output: float64 [N, projection_dim] on the CPU.
    Attributes: name ``"clip_image:<folder name>"``, sha256 over config.json and the weight files, feature_dim.
    Raises:
        FileNotFoundError: missing folder, config.json or weights (the message lists the expected files).
        ValueError: a config that is not a CLIP model.
    """

    def __init__(self, path: str | Path, batch_size: int = 32, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        from transformers import CLIPModel, CLIPVisionModelWithProjection

        folder = Path(path).expanduser()
        weights = list(folder.glob("model*.safetensors")) + list(folder.glob("pytorch_model*.bin"))
        if not (folder / "config.json").is_file() or not weights:
            raise FileNotFoundError(
                f"no CLIP model at {str(folder)!r}: expected a transformers save_pretrained folder with config.json "
                "and model.safetensors (CLIPModel or CLIPVisionModelWithProjection, e.g. a local copy of "
                "openai/clip-vit-base-patch32), optionally preprocessor_config.json. Nothing is downloaded")
        model_type = json.loads((folder / "config.json").read_text()).get("model_type", "clip")
        if model_type == "clip":
            model = CLIPModel.from_pretrained(folder, local_files_only=True, dtype=dtype)
            self.image_size = int(model.config.vision_config.image_size)
            self.feature_dim = int(model.config.projection_dim)
        elif model_type == "clip_vision_model":
            model = CLIPVisionModelWithProjection.from_pretrained(folder, local_files_only=True, dtype=dtype)
            self.image_size = int(model.config.image_size)
            self.feature_dim = int(model.config.projection_dim)
        else:
            raise ValueError(f"{folder / 'config.json'} has model_type {model_type!r}; expected a CLIP model "
                             "('clip' or 'clip_vision_model')")
        self.clip = model.eval().requires_grad_(False)
        self._vision_only = model_type == "clip_vision_model"
        self.mean, self.std = preprocessor_norm(folder)
        self.name = f"clip_image:{folder.name}"
        self.sha256 = _folder_sha256(folder, ("config.json", "model*.safetensors", "pytorch_model*.bin"))
        self.batch_size, self.source = int(batch_size), str(folder)

    @torch.no_grad()
    def forward(self, images: Tensor) -> Tensor:
        _check_images(images)
        p = next(self.clip.parameters())
        x = clip_preprocess(images.float().div(255.0), size=self.image_size, mean=self.mean, std=self.std)
        x = x.to(device=p.device, dtype=p.dtype)
        out = self.clip(pixel_values=x) if self._vision_only else self.clip.get_image_features(pixel_values=x)
        return projected_embedding(out).double().cpu()


def _frame_indices(t: int, frames_per_video: int | str) -> list[int]:
    if frames_per_video == "all":
        return list(range(t))
    k = int(frames_per_video)
    if t < k:
        raise ValueError(f"a video has {t} frames, fewer than frames_per_video={k}; pass frames_per_video='all' "
                         "or a smaller number")
    if k == 1:
        return [(t - 1) // 2]
    return [round(i * (t - 1) / (k - 1)) for i in range(k)]


def frame_feature_stats(extractor: nn.Module | Any, videos: Iterable[Tensor], frames_per_video: int | str = "all",
                        batch_size: int | None = None, progress: bool = True) -> FeatureStats:
    """Image-feature statistics over the frames of a set of videos (or images, as T = 1 videos).

    Args:
        extractor: :class:`InceptionExtractor`, :class:`ClipImageExtractor`, or any module / callable mapping
            uint8 [N, 3, H, W] to [N, D] (with ``name`` / ``sha256`` attributes unless it is an ``nn.Module``).
        videos: iterable of [T, 3, H, W], uint8 or float in [0, 1] (rounded to uint8).
        frames_per_video: ``"all"``, or k >= 1 frames evenly spaced from the first to the last (k = 1: the
            middle frame).
        batch_size: images per call (default ``extractor.batch_size``, else 32); a batch is also flushed
            when the frame size changes.
    Returns:
        :class:`FeatureStats`, meta ``{"extractor", "extractor_sha256", "settings": {"frames_per_video"},
        "n_images", "n_videos"}``.
    Raises:
        ValueError: bad frames_per_video, a video shorter than it, malformed videos, or fewer than 2 images.
    """
    from tqdm.auto import tqdm

    if frames_per_video != "all" and (isinstance(frames_per_video, bool) or not isinstance(frames_per_video, int)
                                      or frames_per_video < 1):
        raise ValueError(f"frames_per_video must be 'all' or a positive int, got {frames_per_video!r}")
    name, sha = extractor_identity(extractor)
    bs = int(batch_size or getattr(extractor, "batch_size", 32))
    feats: list[Tensor] = []
    batch: list[Tensor] = []
    n_videos = 0

    def flush() -> None:
        out = extractor(torch.stack(batch))
        feats.append(torch.as_tensor(out).detach().reshape(len(batch), -1).double().cpu())
        batch.clear()

    for video in tqdm(videos, desc=f"frame features ({name})", unit="video", disable=not progress):
        frames = _as_uint8_video(video)
        n_videos += 1
        for i in _frame_indices(int(frames.shape[0]), frames_per_video):
            if batch and (frames[i].shape != batch[0].shape or len(batch) >= bs):
                flush()
            batch.append(frames[i])
    if batch:
        flush()
    if not feats:
        raise ValueError("no videos were given; FID needs at least 2 images per set")
    features = torch.cat(feats)
    meta = {"extractor": name, "extractor_sha256": sha, "settings": {"frames_per_video": frames_per_video},
            "n_images": int(features.shape[0]), "n_videos": n_videos}
    return FeatureStats.from_features(features, meta)


def fid(real: FeatureStats, fake: FeatureStats, warn_below: int = FID_WARN_BELOW,
        comparable_min: int = FID_COMPARABLE_MIN) -> dict[str, Any]:
    """FID (or CLIP-FID, by the extractor) between real and generated frame statistics.

    Returns ``{"fid", "n_real", "n_fake", "extractor", "extractor_sha256", "comparable", "warnings"}`` (see
    :func:`genrl.eval.frechet.frechet_report`): a set under ``warn_below`` images (10k) gets "FID is biased
    upward at N=..." (also a Python warning), one under ``comparable_min`` (2048) makes it non-comparable.

    Raises:
        ValueError: different extractors or frame settings for the two sets.
    """
    return frechet_report(real, fake, metric="fid", warn_below=warn_below, comparable_min=comparable_min,
                          standard="standard protocols use 10k-50k images (FID-50k for image generators)")
