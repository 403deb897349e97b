"""Typed model specs: how a method's config names a role's network (class, weights or init values)."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["ModelSpec", "import_class"]


def import_class(class_path: str) -> type:
    """Import ``"package.module.Class"``; raises ValueError naming the path when it does not resolve."""
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import model class {class_path!r}: {e}") from e


@dataclass
class ModelSpec:
    """A network role in a config: a diffusers-style class built from weights or from plain values.

    Attributes:
        model_class: import path of a ``ModelMixin`` / ``ConfigMixin`` class (default: genrl's VideoDiT).
        pretrained: local folder written by ``save_pretrained`` (no hub ids: nothing is downloaded), or
            None to build from ``config`` with random weights.
        subfolder: subfolder inside ``pretrained`` (e.g. ``"transformer"`` of a diffusers pipeline folder).
        config: constructor values (the diffusers config) when ``pretrained`` is None; not allowed
            with ``pretrained`` (the weights fix the architecture).
        gradient_checkpointing: enable activation checkpointing per block.
        dtype: weights dtype (``"float32"``, ``"bfloat16"``, ``"float16"``; None keeps the checkpoint's / float32),
            e.g. a frozen bf16 teacher.
    """

    model_class: str = "genrl.models.dit.VideoDiT"
    pretrained: str | None = None
    subfolder: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False
    dtype: str | None = None

    def build(self) -> nn.Module:
        """Instantiate the network.

        Raises:
            FileNotFoundError: ``pretrained`` does not exist or holds no ``config.json`` (names the folder).
            ValueError: unknown class or unknown ``config`` keys (names them and lists the valid ones), or
                ``config`` given together with ``pretrained``.
        """
        cls = import_class(self.model_class)
        if self.pretrained is not None:
            if self.config:
                raise ValueError(
                    f"config {sorted(self.config)} given together with pretrained={self.pretrained!r}; "
                    f"the checkpoint's config fixes the architecture, drop config"
                )
            folder = Path(self.pretrained).expanduser()
            repo_relative = Path(__file__).resolve().parents[2] / folder
            if (not folder.exists() and not folder.is_absolute() and folder.parts[:1] == ("assets",)
                    and repo_relative.exists()):
                folder = repo_relative  # e.g. "assets/shapes-dit" run from outside the checkout
            cfg_dir = folder / self.subfolder if self.subfolder else folder
            if not (cfg_dir / "config.json").is_file():
                raise FileNotFoundError(
                    f"no model weights at {str(cfg_dir)!r} (expected config.json and *.safetensors written by "
                    f"save_pretrained); check the path, or set pretrained: null to train from scratch"
                )
            kwargs = {"subfolder": self.subfolder} if self.subfolder else {}
            model = cls.from_pretrained(str(folder), local_files_only=True, **kwargs)
        else:
            params = inspect.signature(cls.__init__).parameters
            unknown = sorted(set(self.config) - set(params))
            if unknown and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                valid = [p for p in params if p != "self"]
                raise ValueError(f"unknown config keys {unknown} for {self.model_class}; valid: {valid}")
            model = cls(**self.config)
        if self.dtype is not None:
            import torch

            dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
            if self.dtype not in dtypes:
                raise ValueError(f"dtype must be one of {sorted(dtypes)}, got {self.dtype!r}")
            model = model.to(dtypes[self.dtype])
        if self.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        return model
