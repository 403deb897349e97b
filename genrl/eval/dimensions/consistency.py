"""VBench's subject consistency (DINO ViT-B/16) and background consistency (CLIP ViT-B/32).

Both score a video by how similar each frame's feature is to the previous frame's and to the first frame's:

    c_t = ( max(0, cos(f_t, f_{t-1})) + max(0, cos(f_t, f_0)) ) / 2,   t = 1 .. T-1
    video value = sum_t c_t / (T - 1),   weight = T - 1

and the dataset score is **frame-weighted**: ``sum over videos of sum_t c_t / sum over videos of (T - 1)``, which
is :meth:`Dimension.aggregate` with these weights (vbench/subject_consistency.py and background_consistency.py:
``sim / cnt``; not the mean of the per-video values).

Sources: Huang et al. 2024, *VBench*, section 3.1; Caron et al. 2021, *DINO* (facebookresearch/dino,
``vision_transformer.py``: CLS token after the final norm, bicubic position-embedding interpolation);
Radford et al. 2021, *CLIP*; VBench's ``dino_transform`` / ``clip_transform`` (vbench/utils.py).
"""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from genrl.eval.dimensions.base import (
    CLIP_FOLDER_FILES,
    Dimension,
    DimensionResult,
    clip_image_embeddings,
    load_clip_image_encoder,
    require_files,
    resize_shorter_side,
)
from genrl.rewards.clip_rewards import as_dtype, freeze
from genrl.rewards.preprocess import IMAGENET_MEAN, IMAGENET_STD, normalize

__all__ = ["consistency_terms", "SubjectConsistency", "BackgroundConsistency"]


def consistency_terms(features: Tensor) -> list[float]:
    """VBench's per-frame consistency terms ``c_t`` (t = 1 .. T-1) from frame features.

    Cosines are computed in float64 on L2-normalised features, then rounded to float32 (VBench's precision: its
    ``F.cosine_similarity`` runs in float32, so identical features give exactly 1.0) and clipped below at 0.

    Args:
        features: float [T, D], T >= 2 (unnormalised).
    Returns:
        T - 1 Python floats in [0, 1].
    """
    f = F.normalize(features.detach().double(), dim=-1)
    prev = (f[1:] * f[:-1]).sum(-1).float().clamp(min=0).double()
    first = (f[1:] * f[:1]).sum(-1).float().clamp(min=0).double()
    return ((prev + first) / 2).tolist()


def _result(features: Tensor) -> DimensionResult:
    terms = consistency_terms(features)
    return DimensionResult(value=math.fsum(terms) / len(terms), weight=float(len(terms)), extras={"terms": terms})


def _dino_pos_encoding(self, embeddings: Tensor, height: int, width: int) -> Tensor:
    """DINO's ``interpolate_pos_encoding`` (facebookresearch/dino, vision_transformer.py), bound to a transformers
    ``ViTEmbeddings`` in place of its own (which resizes to an exact size instead of DINO's ``scale_factor`` with
    the +0.1 offset, giving slightly different embeddings for non-square or non-224 inputs)."""
    pos = self.position_embeddings
    n = pos.shape[1] - 1
    if embeddings.shape[1] - 1 == n and height == width:
        return pos
    p = self.patch_size if isinstance(self.patch_size, int) else self.patch_size[0]
    side = math.sqrt(n)
    h0, w0 = height // p + 0.1, width // p + 0.1
    grid = pos[:, 1:].float().reshape(1, int(side), int(side), -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=(h0 / side, w0 / side), mode="bicubic")
    grid = grid.permute(0, 2, 3, 1).reshape(1, -1, pos.shape[-1]).to(pos.dtype)
    return torch.cat([pos[:, :1], grid], dim=1)


class SubjectConsistency(Dimension):
    """Subject consistency: the consistency formula (module docstring) on DINO ViT-B/16 CLS features.

    Model: a transformers ``ViTModel`` from a local folder, e.g. a copy of the HF port ``facebook/dino-vitb16``
    (its ``last_hidden_state[:, 0]``, the CLS token after the final layernorm, is DINO's output). DINO's position
    interpolation replaces transformers' (see :func:`_dino_pos_encoding`). Note: the HF port's config keeps ViT's
    layer-norm epsilon 1e-12 where DINO uses 1e-6; the effect is far below the score's precision.

    Preprocessing (VBench's ``dino_transform(224)``, as it runs under its pinned torchvision): frames as 0-255
    floats, shorter side to ``size`` with bilinear interpolation (no crop: the aspect is kept), divide by 255,
    ImageNet mean / std. ``size`` defaults to the config's ``image_size`` (224 for DINO ViT-B/16).

    Weights (``path=``): ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``), ``save_pretrained``
    layout. Input: uint8 [T, 3, H, W], T >= 2. ``extras``: ``{"terms": [T - 1 floats]}``; ``weight`` = T - 1.

    Args:
        path: the folder. max_batch: frames per forward pass. dtype: weights dtype (float32, bfloat16, float16;
        VBench runs DINO in float32). size: resize target of the shorter side. antialias: see
        :func:`~genrl.eval.dimensions.base.resize_shorter_side`.
    Raises:
        FileNotFoundError: the folder or a file is missing (the message lists the layout).
        ValueError: the config is not a ViT.
    """

    name: ClassVar[str] = "subject_consistency"
    proxy: ClassVar[bool] = False
    needs_weights: ClassVar[bool] = True
    min_frames: ClassVar[int] = 2
    description: ClassVar[str] = "DINO ViT-B/16 CLS cosine to the previous and the first frame (VBench)"
    weight_files: ClassVar[dict[str, str]] = {
        "config.json": "transformers ViTModel config, e.g. a local copy of facebook/dino-vitb16",
        "model*.safetensors|pytorch_model*.bin": "its weights (save_pretrained layout)",
    }

    def __init__(self, path: str | Path | None = None, max_batch: int = 32, dtype: str | torch.dtype = "float32",
                 size: int | None = None, antialias: bool = False) -> None:
        super().__init__()
        from transformers import ViTModel

        folder = require_files(self.name, path, self.weight_files)
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        if model_type != "vit":
            raise ValueError(f"dimension {self.name!r}: {folder / 'config.json'} has model_type {model_type!r}; "
                             f"expected a ViT ('vit'), e.g. facebook/dino-vitb16")
        if int(max_batch) < 1:
            raise ValueError(f"dimension {self.name!r}: max_batch must be >= 1, got {max_batch}")
        self.model = freeze(ViTModel.from_pretrained(folder, local_files_only=True, add_pooling_layer=False,
                                                     dtype=as_dtype(dtype)))
        self.model.embeddings.interpolate_pos_encoding = types.MethodType(_dino_pos_encoding, self.model.embeddings)
        self.path, self.max_batch, self.antialias = str(folder), int(max_batch), bool(antialias)
        self.size = int(size) if size is not None else int(self.model.config.image_size)

    def features(self, frames: Tensor, antialias: bool | None = None) -> Tensor:
        """DINO CLS features of uint8 [T, 3, H, W] frames: float32 [T, D] on the model's device (unnormalised).
        ``antialias`` overrides the dimension's for this call (an image resized as PIL does)."""
        p = next(self.model.parameters())
        antialias = self.antialias if antialias is None else bool(antialias)
        out = []
        with torch.no_grad():
            for chunk in frames.split(self.max_batch):
                x = resize_shorter_side(chunk.to(p.device).float(), self.size, "bilinear", antialias)
                x = normalize(x.div(255.0), IMAGENET_MEAN, IMAGENET_STD).to(p.dtype)
                hidden = self.model(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
                out.append(hidden[:, 0].float())
        return torch.cat(out)

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        return _result(self.features(frames))

    def to(self, device: str | torch.device) -> SubjectConsistency:
        super().to(device)
        self.model.to(self.device)
        return self


class BackgroundConsistency(Dimension):
    """Background consistency: the consistency formula (module docstring) on CLIP ViT-B/32 image embeddings.

    Model: a transformers ``CLIPModel`` or ``CLIPVisionModelWithProjection`` from a local folder (e.g. a copy of
    openai/clip-vit-base-patch32); the feature is the projected image embedding (openai-clip's ``encode_image``).
    Preprocessing (VBench's ``clip_transform(224)`` under its pinned torchvision): 0-255 floats, shorter side to the
    model's ``image_size`` (224) with bicubic interpolation, centre crop, divide by 255, CLIP mean / std. VBench's
    openai-clip runs in float16 on CUDA; ``dtype="float16"`` reproduces that, the default is float32.

    Weights (``path=``): ``config.json`` + ``model.safetensors`` (or ``pytorch_model.bin``); an optional
    ``preprocessor_config.json`` supplies mean / std. Input: uint8 [T, 3, H, W], T >= 2. ``extras``:
    ``{"terms": [T - 1 floats]}``; ``weight`` = T - 1.

    Args:
        path, max_batch, dtype, antialias: as :class:`SubjectConsistency`.
    Raises:
        FileNotFoundError: the folder or a file is missing (the message lists the layout).
        ValueError: the config is not a CLIP model.
    """

    name: ClassVar[str] = "background_consistency"
    proxy: ClassVar[bool] = False
    needs_weights: ClassVar[bool] = True
    min_frames: ClassVar[int] = 2
    description: ClassVar[str] = "CLIP ViT-B/32 image-embedding cosine to the previous and the first frame (VBench)"
    weight_files: ClassVar[dict[str, str]] = dict(CLIP_FOLDER_FILES)

    def __init__(self, path: str | Path | None = None, max_batch: int = 32, dtype: str | torch.dtype = "float32",
                 antialias: bool = False) -> None:
        super().__init__()
        folder = require_files(self.name, path, self.weight_files)
        if int(max_batch) < 1:
            raise ValueError(f"dimension {self.name!r}: max_batch must be >= 1, got {max_batch}")
        (self.model, self.vision_only, self.size, self.embed_dim, self.mean,
         self.std) = load_clip_image_encoder(folder, dtype, self.name)
        self.path, self.max_batch, self.antialias = str(folder), int(max_batch), bool(antialias)

    def features(self, frames: Tensor) -> Tensor:
        """CLIP image embeddings of uint8 [T, 3, H, W] frames: float32 [T, D] (unnormalised)."""
        return clip_image_embeddings(self.model, self.vision_only, frames, self.size, self.mean, self.std,
                                     self.antialias, self.max_batch)

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        return _result(self.features(frames))

    def to(self, device: str | torch.device) -> BackgroundConsistency:
        super().to(device)
        self.model.to(self.device)
        return self
