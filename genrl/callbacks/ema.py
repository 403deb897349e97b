"""Exponential moving average of the trainable weights, resumable and used for validation and export."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from genrl.models.sharding import full_tensor, placed_like

__all__ = ["EMA", "find_ema"]


class EMA(Callback):
    """EMA of every parameter with ``requires_grad`` (the trained role; frozen parts and LoRA bases skipped).

    After each optimizer step, ``shadow = decay * shadow + (1 - decay) * param`` with the warm-up
    ``decay_t = min(decay, (1 + t) / (10 + t))`` (t = updates so far; as in diffusers' ``EMAModel`` with
    ``use_ema_warmup=False`` defaults), so early averages are not dominated by the random init. The
    shadow weights are swapped in for validation (samples and scores use the EMA model) and used by
    :class:`~genrl.callbacks.DiffusersExport`; the raw weights keep training. The shadow and the update
    count live in the callback's state in the Lightning checkpoint, so ``--ckpt_path last`` resumes exactly. Under
    FSDP2 the shadow is sharded like the parameters (each rank averages its slice) and is gathered whole into the
    checkpoint.

    Args:
        decay: EMA decay in [0, 1).
        update_every: optimizer steps between updates.
        warmup: use the (1 + t) / (10 + t) warm-up of the decay.
        validate_with_ema: swap the EMA weights in during validation.
        include: only parameters whose name starts with this prefix (e.g. ``"generator."``: the student of DMD,
            not its critic), or with any prefix of a list (TMD's student: ``["generator.", "flow_head."]``); None =
            every trainable parameter.
        start_step: first global step at which the average starts (Self-Forcing creates its EMA at step 200);
            before it the shadow follows the raw weights.
    Raises:
        ValueError: decay outside [0, 1), update_every < 1 or start_step < 0.
    """

    def __init__(
        self, decay: float = 0.999, update_every: int = 1, warmup: bool = True, validate_with_ema: bool = True,
        include: str | list[str] | None = None, start_step: int = 0,
    ) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        if update_every < 1:
            raise ValueError(f"update_every must be >= 1, got {update_every}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.include = include
        self.start_step = start_step
        self.decay = decay
        self.update_every = update_every
        self.warmup = warmup
        self.validate_with_ema = validate_with_ema
        self.shadow: dict[str, torch.Tensor] = {}
        self.num_updates = 0
        self._pending: dict[str, Any] | None = None
        self._swapped = False

    # ---------------------------------------------------------------- state
    def _trainable(self, pl_module: LightningModule) -> dict[str, torch.nn.Parameter]:
        prefix = self.include or ""
        prefix = prefix if isinstance(prefix, str) else tuple(prefix)  # str.startswith takes a tuple of prefixes
        return {n: p for n, p in pl_module.named_parameters() if p.requires_grad and n.startswith(prefix)}

    def _ensure(self, pl_module: LightningModule) -> None:
        if self.shadow:
            return
        params = self._trainable(pl_module)
        if self._pending is not None:
            missing = sorted(set(params) - set(self._pending["shadow"]))
            if missing:
                raise KeyError(f"EMA state in the checkpoint lacks trained parameters {missing[:5]}...")
            self.shadow = {n: placed_like(self._pending["shadow"][n], params[n], torch.float32) for n in params}
            self.num_updates = int(self._pending["num_updates"])
            self._pending = None
        else:
            self.shadow = {n: p.detach().float().clone() for n, p in params.items()}

    def state_dict(self) -> dict[str, Any]:
        """``{"shadow": {name: full float32 CPU tensor}, "num_updates": n}``. Under FSDP2 the shadow is sharded like
        the parameters and each tensor is gathered here (a collective: Lightning asks every rank for the callback
        states), so the checkpoint holds the whole average whatever the number of processes."""
        return {"shadow": {n: full_tensor(t) for n, t in self.shadow.items()}, "num_updates": self.num_updates}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict
        self.shadow = {}

    # ---------------------------------------------------------------- updates
    def current_decay(self) -> float:
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._ensure(pl_module)

    @torch.no_grad()
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.update_every:
            return
        self._ensure(pl_module)
        if trainer.global_step < self.start_step:  # not started: the shadow tracks the raw weights
            for n, p in self._trainable(pl_module).items():
                self.shadow[n].copy_(p.detach().float())
            return
        d = self.current_decay()
        for n, p in self._trainable(pl_module).items():
            self.shadow[n].lerp_(p.detach().float(), 1.0 - d)
        self.num_updates += 1

    # ---------------------------------------------------------------- swapping
    @torch.no_grad()
    def _swap(self, pl_module: LightningModule) -> None:
        self._ensure(pl_module)
        for n, p in self._trainable(pl_module).items():
            raw = p.detach().float().clone()
            p.copy_(self.shadow[n].to(p.dtype))
            self.shadow[n].copy_(raw)
        self._swapped = not self._swapped

    @contextmanager
    def swapped(self, pl_module: LightningModule):
        """Context in which ``pl_module``'s trainable parameters hold the EMA weights."""
        self._swap(pl_module)
        try:
            yield pl_module
        finally:
            self._swap(pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.validate_with_ema and trainer.state.fn == "fit" and not self._swapped:
            self._swap(pl_module)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._swapped:
            self._swap(pl_module)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if self._swapped:  # never checkpoint EMA weights as the raw ones
            raise RuntimeError("checkpoint requested while EMA weights are swapped in; report this as a bug")


def find_ema(trainer: Trainer) -> EMA | None:
    """The trainer's :class:`EMA` callback, if any."""
    return next((c for c in trainer.callbacks if isinstance(c, EMA)), None)
