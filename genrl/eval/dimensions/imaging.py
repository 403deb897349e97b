"""VBench's imaging quality: MUSIQ trained on SPAQ, through ``pyiqa`` (optional dependency, imported lazily).

``pyiqa`` is not a genrl dependency (VBench pins ``pyiqa==0.1.10``, whose own pins may clash with genrl's);
without it this dimension raises ImportError when built. Only the preprocessing and pooling are genrl's.

Source: Huang et al. 2024, *VBench*, section 3.1; vbench/imaging_quality.py (``transform`` / ``technical_quality``);
Ke et al. 2021, *MUSIQ: Multi-scale Image Quality Transformer*; chaofengc/IQA-PyTorch (``pyiqa.archs.musiq_arch``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from genrl.eval.dimensions.base import Dimension, DimensionResult, require_files
from genrl.rewards.preprocess import center_crop

__all__ = ["ImagingQuality", "MUSIQ_SPAQ_FILE", "PREPROCESS_MODES"]

#: the checkpoint VBench uses (IQA-PyTorch release v0.1-weights)
MUSIQ_SPAQ_FILE = "musiq_spaq_ckpt-358bb6af.pth"
#: VBench's ``imaging_quality_preprocessing_mode`` values; "longer" is its default
PREPROCESS_MODES = ("longer", "shorter", "shorter_centercrop", "None")


def _import_musiq():
    try:
        from pyiqa.archs.musiq_arch import MUSIQ
    except ImportError as err:
        raise ImportError(
            "dimension 'imaging_quality' needs pyiqa (MUSIQ), which is not installed: `pip install pyiqa` (VBench "
            "uses pyiqa==0.1.10; install it in a separate environment if its pins conflict with genrl's), or leave "
            "imaging_quality out of the evaluation") from err
    return MUSIQ


class ImagingQuality(Dimension):
    """Imaging quality: MUSIQ-SPAQ score of each frame (0-100), mean over frames; the dataset score is the mean over
    videos divided by 100. Here each video's ``value`` is already divided by 100 (VBench's per-video JSON entries
    are on 0-100; only its dataset score is divided), so :meth:`aggregate` gives VBench's dataset score.

    Preprocessing (VBench's ``transform``, mode ``"longer"`` by default): frames as 0-255 floats; if the longer side
    exceeds 512, resize to ``(int(s * H), int(s * W))`` with ``s = 512 / max(H, W)`` (bilinear, no antialias under
    VBench's pinned torchvision); divide by 255. ``"shorter"`` caps the shorter side at 512 instead,
    ``"shorter_centercrop"`` also centre-crops 512 x 512, ``"None"`` leaves the size.

    Weights (``path=``): a folder holding ``musiq_spaq_ckpt-358bb6af.pth``, or that file itself. Input: uint8
    [T, 3, H, W], T >= 1. ``extras``: ``{"frame_scores": [T floats on 0-100]}``.

    Args:
        path: the folder or file. max_batch: frames per forward pass. preprocess_mode: one of
        :data:`PREPROCESS_MODES`. antialias: antialiased resize (newer torchvision's behaviour; VBench's is False).
    Raises:
        ImportError: pyiqa is not installed (the message says what to do).
        FileNotFoundError: the checkpoint is missing (the message lists the layout).
        ValueError: an unknown ``preprocess_mode``.
    """

    name: ClassVar[str] = "imaging_quality"
    proxy: ClassVar[bool] = False
    needs_weights: ClassVar[bool] = True
    min_frames: ClassVar[int] = 1
    description: ClassVar[str] = "MUSIQ-SPAQ image quality / 100, mean over frames (VBench; needs pyiqa)"
    weight_files: ClassVar[dict[str, str]] = {
        MUSIQ_SPAQ_FILE: "MUSIQ trained on SPAQ (IQA-PyTorch release v0.1-weights)",
    }

    def __init__(self, path: str | Path | None = None, max_batch: int = 32, preprocess_mode: str = "longer",
                 antialias: bool = False) -> None:
        super().__init__()
        if preprocess_mode not in PREPROCESS_MODES:
            raise ValueError(f"dimension {self.name!r}: unknown preprocess_mode {preprocess_mode!r}; use one of "
                             f"{PREPROCESS_MODES}")
        if int(max_batch) < 1:
            raise ValueError(f"dimension {self.name!r}: max_batch must be >= 1, got {max_batch}")
        musiq = _import_musiq()
        if path is not None and Path(path).expanduser().is_file():
            ckpt = Path(path).expanduser()
        else:
            ckpt = require_files(self.name, path, self.weight_files) / MUSIQ_SPAQ_FILE
        self.model = musiq(pretrained_model_path=str(ckpt))
        self.model.eval().requires_grad_(False)
        self.path, self.max_batch = str(ckpt), int(max_batch)
        self.preprocess_mode, self.antialias = preprocess_mode, bool(antialias)

    def preprocess(self, frames: Tensor) -> Tensor:
        """VBench's imaging-quality transform of uint8 [N, 3, H, W]: float32 [N, 3, H', W'] in [0, 1]."""
        x = frames.float()
        h, w = x.shape[-2:]
        mode = self.preprocess_mode
        side = max(h, w) if mode == "longer" else min(h, w)
        if mode != "None" and side > 512:
            s = 512.0 / side
            x = F.interpolate(x, size=(int(s * h), int(s * w)), mode="bilinear", align_corners=False,
                              antialias=self.antialias)
            if mode == "shorter_centercrop":
                x = center_crop(x, 512)
        return x / 255.0

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        p = next(self.model.parameters())
        scores: list[float] = []
        with torch.no_grad():
            for chunk in frames.split(self.max_batch):
                out = self.model(self.preprocess(chunk.to(p.device)))
                scores += out.reshape(chunk.shape[0], -1)[:, 0].float().tolist()
        return DimensionResult(value=math.fsum(scores) / len(scores) / 100.0, weight=1.0,
                               extras={"frame_scores": scores})

    def to(self, device: str | torch.device) -> ImagingQuality:
        super().to(device)
        self.model.to(self.device)
        return self
