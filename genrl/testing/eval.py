"""Tiny random models of the evaluation dimensions, in the layouts their ``path=`` expects (for tests).

:func:`build_tiny` picks the builder from a dimension name or class (``build_tiny("subject_consistency",
folder)``). Moved here from the dimensions' ``build_tiny`` classmethods: test fixtures are not part of the
evaluation layer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from genrl.eval.dimensions.aesthetic import AESTHETIC_V1_FILE
from genrl.eval.dimensions.base import Dimension
from genrl.testing.rewards import write_tiny_hf_clip

__all__ = ["build_tiny", "TINY_BUILDERS", "build_tiny_vit", "build_tiny_clip_vision", "build_tiny_aesthetic_v1"]


def build_tiny_vit(folder: str | Path, seed: int = 0, image_size: int = 64) -> Path:
    """Subject consistency: write a tiny random ``ViTModel`` (hidden 32, 2 layers, 2 heads, patch 16, ``image_size``
    px) to ``folder`` in the layout ``path=`` expects; returns the folder."""
    from transformers import ViTConfig, ViTModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                    image_size=image_size, patch_size=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ViTModel(cfg, add_pooling_layer=False)
    model.save_pretrained(folder)
    return folder


def build_tiny_clip_vision(folder: str | Path, seed: int = 0, vision_only: bool = False) -> Path:
    """Background consistency: write a tiny random CLIP (2 layers, width 32, 32 px, 16-d projection;
    ``vision_only``: a ``CLIPVisionModelWithProjection``) to ``folder``; returns the folder."""
    folder = Path(folder)
    write_tiny_hf_clip(folder, seed, with_tokenizer=False, vision_only=vision_only)
    return folder


def build_tiny_aesthetic_v1(folder: str | Path, seed: int = 0, vision_only: bool = False) -> Path:
    """Aesthetic quality: write a tiny random CLIP (16-d projection) to ``folder/clip`` and a random
    ``nn.Linear(16, 1)`` head as ``sa_0_4_vit_l_14_linear.pth``; returns the folder."""
    folder = Path(folder)
    write_tiny_hf_clip(folder / "clip", seed, with_tokenizer=False, vision_only=vision_only)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        head = nn.Linear(16, 1)
        nn.init.normal_(head.weight, std=1.0)
    torch.save(head.state_dict(), folder / AESTHETIC_V1_FILE)
    return folder


#: dimension name -> its tiny builder (the weight-free dimensions need none; imaging_quality's MUSIQ has none)
TINY_BUILDERS: dict[str, Callable[..., Path]] = {
    "subject_consistency": build_tiny_vit,
    "i2v_subject": build_tiny_vit,
    "background_consistency": build_tiny_clip_vision,
    "aesthetic_quality": build_tiny_aesthetic_v1,
}


def build_tiny(dimension: str | type[Dimension], folder: str | Path, seed: int = 0, **kwargs: Any) -> Path:
    """Write the tiny model of ``dimension`` (a VBench key or a dimension class) to ``folder``; returns the folder.

    Raises:
        KeyError: no tiny builder for that dimension (lists the dimensions that have one).
    """
    name = dimension if isinstance(dimension, str) else dimension.name
    if name not in TINY_BUILDERS:
        raise KeyError(f"no tiny builder for dimension {name!r}; builders: {', '.join(TINY_BUILDERS)}")
    return TINY_BUILDERS[name](folder, seed=seed, **kwargs)
