"""VBench-compatible quality dimensions, natively in torch (docs/evaluation.md).

Each dimension scores one video, ``dim.score_video(frames uint8 [T, 3, H, W], fps) -> DimensionResult``, and pools
videos with ``dim.aggregate(results)`` (VBench's weighted mean). Build them by name::

    dim = build_dimension("subject_consistency", path="/weights/dino-vitb16", device="cuda")

| name | model | weights (``path``) | proxy |
|---|---|---|---|
| ``temporal_flickering`` | none (pixel MAE) | none | no |
| ``dynamic_degree`` | Farneback flow (VBench: RAFT) | none | yes |
| ``motion_smoothness`` | Farneback-warp interpolation (VBench: AMT-S) | none | yes |
| ``subject_consistency`` | DINO ViT-B/16 (transformers ViTModel) | ``config.json``, ``model.safetensors`` | no |
| ``background_consistency`` | CLIP ViT-B/32 (transformers CLIP) | ``config.json``, ``model.safetensors`` | no |
| ``aesthetic_quality`` | CLIP ViT-L/14 + LAION v1 linear head | ``clip/``, ``sa_0_4_vit_l_14_linear.pth`` | no |
| ``imaging_quality`` | MUSIQ-SPAQ (needs ``pyiqa``) | ``musiq_spaq_ckpt-358bb6af.pth`` | no |

Image-to-video dimensions (``needs_image``: ``score_video(frames, fps, image=...)``, see
:mod:`genrl.eval.dimensions.i2v`):

| name | model | weights (``path``) | source |
|---|---|---|---|
| ``first_frame_fidelity`` | none (PSNR of frame 0 vs the image) | none | genrl |
| ``i2v_subject`` | DINO ViT-B/16, as subject consistency | ``config.json``, ``model.safetensors`` | VBench-I2V |

Proxy dimensions keep VBench's rules around a different model: comparable between genrl runs, not with published
VBench numbers. The semantic dimensions run only in the official ``vbench`` package (see
:data:`genrl.eval.vbench.ALL_DIMENSIONS`). Nothing is downloaded: weights come from local folders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from genrl.eval.dimensions.aesthetic import AestheticQuality
from genrl.eval.dimensions.base import Dimension, DimensionResult, TooFewFrames
from genrl.eval.dimensions.consistency import BackgroundConsistency, SubjectConsistency
from genrl.eval.dimensions.flicker import TemporalFlickering
from genrl.eval.dimensions.i2v import FirstFrameFidelity, I2VSubject
from genrl.eval.dimensions.imaging import ImagingQuality
from genrl.eval.dimensions.motion import DynamicDegree, MotionSmoothness

__all__ = ["TooFewFrames", "DimensionResult", "Dimension", "DIMENSIONS", "build_dimension", "TemporalFlickering",
           "DynamicDegree", "MotionSmoothness", "SubjectConsistency", "BackgroundConsistency", "AestheticQuality",
           "ImagingQuality", "FirstFrameFidelity", "I2VSubject", "I2V_DIMENSIONS"]

#: image-to-video dimensions (they need each video's conditioning image)
I2V_DIMENSIONS: dict[str, type[Dimension]] = {cls.name: cls for cls in (FirstFrameFidelity, I2VSubject)}
#: name -> dimension class: the natively implemented VBench quality dimensions, then the image-to-video ones
DIMENSIONS: dict[str, type[Dimension]] = {**{cls.name: cls for cls in (
    SubjectConsistency, BackgroundConsistency, TemporalFlickering, MotionSmoothness, DynamicDegree,
    AestheticQuality, ImagingQuality)}, **I2V_DIMENSIONS}


def build_dimension(name: str, path: str | Path | None = None, device: str | torch.device = "cpu",
                    **options: Any) -> Dimension:
    """Build a dimension by its VBench key and move it to ``device``.

    Args:
        name: a key of :data:`DIMENSIONS`.
        path: the local weights folder (file for imaging_quality) of a dimension with ``needs_weights``; must be
            None for weight-free dimensions.
        device: where its model runs. options: the class's constructor arguments (e.g. ``max_batch``, ``dtype``,
            ``flow_params``).
    Raises:
        ValueError: unknown name (lists the known ones); no ``path`` for a dimension that needs weights (names
            the files expected); a ``path`` for a weight-free dimension.
        FileNotFoundError: the folder or a file is missing (lists the expected layout).
        ImportError: imaging_quality without pyiqa.
    """
    cls = DIMENSIONS.get(name)
    if cls is None:
        raise ValueError(f"unknown dimension {name!r}; native dimensions: {', '.join(DIMENSIONS)} (the other VBench "
                         f"dimensions run only in the official vbench package, see evaluation/README.md)")
    if cls.needs_weights:
        if path is None:
            files = ", ".join(f.replace("|", " or ") for f in cls.weight_files)
            raise ValueError(f"dimension {name!r} needs local weights: pass path= a folder holding {files} (nothing "
                             f"is downloaded)")
        dim = cls(path=path, **options)
    else:
        if path is not None:
            raise ValueError(f"dimension {name!r} needs no weights, but path={str(path)!r} was given; drop the path")
        dim = cls(**options)
    return dim.to(device)
