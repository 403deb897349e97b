"""VBench's aesthetic quality: CLIP ViT-L/14 + the LAION aesthetic predictor v1 linear head.

Source: Huang et al. 2024, *VBench*, section 3.1; vbench/aesthetic_quality.py (``get_aesthetic_model`` /
``laion_aesthetic``); LAION-AI/aesthetic-predictor (``sa_0_4_vit_l_14_linear.pth``, the v1 linear head). Not the
v2 MLP of genrl.rewards' ``aesthetic`` reward.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrl.eval.dimensions.base import (
    Dimension,
    DimensionResult,
    clip_image_embeddings,
    load_clip_image_encoder,
    require_files,
)

__all__ = ["AestheticQuality", "AESTHETIC_V1_FILE"]

#: the LAION aesthetic predictor v1 head VBench uses (``nn.Linear(768, 1)`` state dict, keys weight / bias)
AESTHETIC_V1_FILE = "sa_0_4_vit_l_14_linear.pth"


class AestheticQuality(Dimension):
    """Aesthetic quality: per frame ``(w . e / ||e|| + b) / 10``, e the CLIP ViT-L/14 image embedding and (w, b) the
    LAION v1 linear head; per video the mean over frames; the dataset score is the mean over videos (weight 1).
    About 0.4-0.7 for real weights; higher is better.

    Preprocessing: VBench's ``clip_transform(224)`` as in
    :class:`~genrl.eval.dimensions.consistency.BackgroundConsistency` (bicubic shorter side to the model's
    ``image_size``, centre crop, CLIP mean / std, on 0-255 floats). Embeddings are cast to float32 before the head.

    Weights (``path=``)::

        path/
          clip/config.json                transformers CLIPModel or CLIPVisionModelWithProjection (ViT-L/14)
          clip/model.safetensors          e.g. a local copy of openai/clip-vit-large-patch14
          sa_0_4_vit_l_14_linear.pth      the head: torch.save of nn.Linear(768, 1).state_dict()

    Input: uint8 [T, 3, H, W], T >= 1. ``extras``: ``{"frame_scores": [T floats]}`` (already divided by 10).

    Args:
        path: the folder. max_batch: frames per forward pass. dtype: CLIP weights dtype (VBench's openai-clip runs
        float16 on CUDA). antialias: see :func:`~genrl.eval.dimensions.base.resize_shorter_side`.
    Raises:
        FileNotFoundError: a file is missing (the message lists the layout).
        ValueError: the head is not an ``nn.Linear(D, 1)`` state dict, or D differs from the CLIP projection size.
    """

    name: ClassVar[str] = "aesthetic_quality"
    proxy: ClassVar[bool] = False
    needs_weights: ClassVar[bool] = True
    min_frames: ClassVar[int] = 1
    description: ClassVar[str] = "LAION aesthetic predictor v1 (CLIP ViT-L/14 + linear head) / 10, mean over frames"
    weight_files: ClassVar[dict[str, str]] = {
        "clip/config.json": "transformers CLIP ViT-L/14 config (CLIPModel or CLIPVisionModelWithProjection)",
        "clip/model*.safetensors|clip/pytorch_model*.bin": "its weights, e.g. from openai/clip-vit-large-patch14",
        AESTHETIC_V1_FILE: "LAION aesthetic predictor v1 head: nn.Linear(768, 1) state dict (weight, bias)",
    }

    def __init__(self, path: str | Path | None = None, max_batch: int = 32, dtype: str | torch.dtype = "float32",
                 antialias: bool = False) -> None:
        super().__init__()
        folder = require_files(self.name, path, self.weight_files)
        if int(max_batch) < 1:
            raise ValueError(f"dimension {self.name!r}: max_batch must be >= 1, got {max_batch}")
        (self.model, self.vision_only, self.size, self.embed_dim, self.mean,
         self.std) = load_clip_image_encoder(folder / "clip", dtype, self.name)
        head_file = folder / AESTHETIC_V1_FILE
        state = torch.load(head_file, map_location="cpu", weights_only=True)
        weight = state.get("weight") if isinstance(state, dict) else None
        if weight is None or "bias" not in state or weight.ndim != 2 or weight.shape[0] != 1 or len(state) != 2:
            found = list(state)[:6] if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"dimension {self.name!r}: {head_file} is not an nn.Linear(D, 1) state dict (expected "
                             f"keys 'weight' [1, D] and 'bias' [1]; found {found})")
        if weight.shape[1] != self.embed_dim:
            raise ValueError(f"dimension {self.name!r}: the head takes {weight.shape[1]}-d embeddings but the CLIP in "
                             f"{folder / 'clip'} projects to {self.embed_dim}-d; VBench's head needs CLIP ViT-L/14 "
                             f"(768-d)")
        self.head = nn.Linear(weight.shape[1], 1)
        self.head.load_state_dict({k: v.float() for k, v in state.items()})
        self.head.eval().requires_grad_(False)
        self.path, self.max_batch, self.antialias = str(folder), int(max_batch), bool(antialias)

    def frame_scores(self, frames: Tensor) -> Tensor:
        """Per-frame aesthetic scores / 10 of uint8 [T, 3, H, W] frames: float32 [T] on the model's device."""
        emb = clip_image_embeddings(self.model, self.vision_only, frames, self.size, self.mean, self.std,
                                    self.antialias, self.max_batch)
        with torch.no_grad():
            return self.head(F.normalize(emb.float(), dim=-1)).squeeze(-1) / 10.0

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        scores = self.frame_scores(frames).tolist()
        return DimensionResult(value=math.fsum(scores) / len(scores), weight=1.0, extras={"frame_scores": scores})

    def to(self, device: str | torch.device) -> AestheticQuality:
        super().to(device)
        self.model.to(self.device)
        self.head.to(self.device)
        return self
