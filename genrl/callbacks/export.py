"""Export the trained network in diffusers format (``save_pretrained``) when training ends."""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from genrl.callbacks.ema import find_ema
from genrl.models.loading import CAUSAL_SCHEDULE_FILE, EXPORT_INFO_FILE  # the export layout load_generator reads

__all__ = ["DiffusersExport"]


class DiffusersExport(Callback):
    """At the end of ``fit``, save ``pl_module.generator.transformer`` with ``save_pretrained(dirpath)``.

    When the trainer has an :class:`~genrl.callbacks.EMA` callback, the EMA weights are exported (the
    module's raw weights are left as they are).
    The folder (``config.json`` + ``diffusion_pytorch_model.safetensors``) reloads offline with
    ``VideoDiT.from_pretrained(dirpath)`` or a ``ModelSpec(pretrained=dirpath)``.

    Args:
        dirpath: output folder (created; existing files are overwritten).
        safe_serialization: write safetensors (default) rather than a pickle.
    """

    def __init__(self, dirpath: str, safe_serialization: bool = True) -> None:
        self.dirpath = dirpath
        self.safe_serialization = safe_serialization

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        ema = find_ema(trainer)
        with ema.swapped(pl_module) if ema is not None else nullcontext():
            pl_module.generator.transformer.save_pretrained(self.dirpath, safe_serialization=self.safe_serialization)
        info = {"ema": ema is not None, "global_step": int(trainer.global_step)}
        Path(self.dirpath, EXPORT_INFO_FILE).write_text(json.dumps(info))
        schedule = getattr(pl_module, "schedule", None)
        if schedule is not None and hasattr(schedule, "causal"):  # a causal student: how it generates
            Path(self.dirpath, CAUSAL_SCHEDULE_FILE).write_text(json.dumps(asdict(schedule), indent=2))
