"""Export the trained network in diffusers format (``save_pretrained``) when training ends."""

from __future__ import annotations

import json
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer

from genrl.callbacks.ema import find_ema
from genrl.models.loading import (  # the export / checkpoint layout load_generator reads
    CAUSAL_SCHEDULE_FILE,
    CHECKPOINT_SAMPLING_KEY,
    EXPORT_INFO_FILE,
    readable_by_all,
)
from genrl.models.sharding import full_state_dict, is_sharded

__all__ = ["DiffusersExport", "SamplingRecord", "sampling_of"]


def sampling_of(pl_module: LightningModule) -> dict | None:
    """The sampler a method validates with, as ``{"steps", "cfg_scale", "shift"}``: the method's ``eval_config`` (or
    its ODE ``rollout_config``), or a pretraining run's ``sample_steps`` / ``cfg_scale`` / ``sample_shift``; None for
    a causal student (its chunk schedule is recorded instead) or a method without one. Exports record it so that
    ``pipelines/generate.py`` and ``evaluation/shapes_eval.py`` sample a trained model, by default, the way it was
    trained and validated (flags override)."""
    if getattr(getattr(pl_module, "schedule", None), "causal", None) is not None:
        return None
    cfg = getattr(pl_module, "eval_config", None) or getattr(pl_module, "rollout_config", None)
    if cfg is not None and hasattr(cfg, "num_steps"):
        return {"steps": int(cfg.num_steps), "cfg_scale": float(cfg.cfg_scale), "shift": float(cfg.shift)}
    h = getattr(pl_module, "hparams", {})
    if "sample_steps" in h:
        return {"steps": int(h["sample_steps"]), "cfg_scale": float(h["cfg_scale"]), "shift": float(h["sample_shift"])}
    return None


class SamplingRecord(Callback):
    """Write the method's validation sampler (:func:`sampling_of`, or None) into every Lightning checkpoint under
    ``checkpoint["genrl_sampling"]``, so that a checkpoint, like an export, tells
    :func:`genrl.models.loading.load_generator` (``load_info["sampling"]``), ``pipelines/generate.py``,
    ``evaluation/shapes_eval.py`` and ``pipelines/export.py`` how the model was trained and validated.

    :class:`genrl.cli.GenRLCLI` adds it to every run; add it yourself when building a ``Trainer`` in Python.
    Checkpoints written without it load with ``load_info["sampling"]`` None (the family defaults apply).
    """

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        checkpoint[CHECKPOINT_SAMPLING_KEY] = sampling_of(pl_module)


@contextmanager
def _state_dict_of(module, state: dict | None):
    """``module.state_dict()`` returns ``state`` inside (None: unchanged), so ``save_pretrained`` writes gathered full
    weights of a sharded module with diffusers' own file layout (config, safetensors shards, index)."""
    if state is None:
        yield module
        return
    module.state_dict = lambda *args, **kwargs: state
    try:
        yield module
    finally:
        del module.state_dict


class DiffusersExport(Callback):
    """At the end of ``fit``, save ``pl_module.generator.transformer`` with ``save_pretrained(dirpath)``.

    Under FSDP2 (:class:`genrl.strategies.FSDP2Strategy`) every rank gathers the full weights
    (:func:`genrl.models.sharding.full_state_dict`, a collective) and rank 0 writes them: the folder is the same as a
    single-process run's. Under DDP rank 0 writes its (identical) copy.

    When the trainer has an :class:`~genrl.callbacks.EMA` callback, the EMA weights are exported (the
    module's raw weights are left as they are). A method with an ``export_extra(dirpath, write)`` method writes its own
    further files there with the same (EMA) weights swapped in (TMD: its flow head): every rank that takes part in
    the export calls it (all of them under FSDP2, so it may gather), with ``write`` True on rank 0 only.
    The folder (``config.json`` + ``diffusion_pytorch_model.safetensors``) reloads offline with
    ``VideoDiT.from_pretrained(dirpath)`` or a ``ModelSpec(pretrained=dirpath)``; ``genrl_export.json`` records
    whether the weights are the EMA's, the step, and the validation sampler (:func:`sampling_of`), which
    :func:`genrl.models.loading.load_generator` exposes as ``generator.load_info["sampling"]``.

    Args:
        dirpath: output folder (created; existing files are overwritten).
        safe_serialization: write safetensors (default) rather than a pickle.
    """

    def __init__(self, dirpath: str, safe_serialization: bool = True) -> None:
        self.dirpath = dirpath
        self.safe_serialization = safe_serialization

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        transformer = pl_module.generator.transformer
        ema = find_ema(trainer)
        sharded = is_sharded(transformer)
        if not sharded and not trainer.is_global_zero:
            return
        with ema.swapped(pl_module) if ema is not None else nullcontext():
            # under FSDP2 every rank takes part in gathering the full weights; rank 0 writes them
            full = full_state_dict(transformer) if sharded else None
            if trainer.is_global_zero:
                with _state_dict_of(transformer, full):
                    transformer.save_pretrained(self.dirpath, safe_serialization=self.safe_serialization)
            extra = getattr(pl_module, "export_extra", None)
            if callable(extra):  # a method's own parts beside the transformer (TMD's flow head), same weights; every
                # rank here calls it (under FSDP2 its gather is a collective), rank 0 writes
                extra(self.dirpath, write=trainer.is_global_zero)
        if not trainer.is_global_zero:
            return
        info = {"ema": ema is not None, "global_step": int(trainer.global_step), "sampling": sampling_of(pl_module)}
        Path(self.dirpath, EXPORT_INFO_FILE).write_text(json.dumps(info))
        schedule = getattr(pl_module, "schedule", None)
        if schedule is not None and hasattr(schedule, "causal"):  # a causal student: how it generates
            Path(self.dirpath, CAUSAL_SCHEDULE_FILE).write_text(json.dumps(asdict(schedule), indent=2))
        readable_by_all(self.dirpath)
