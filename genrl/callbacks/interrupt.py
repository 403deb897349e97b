"""Save a resumable checkpoint when ``genrl fit`` is interrupted (Ctrl-C / SIGINT, SIGTERM) and say how to resume."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["InterruptCheckpoint", "newest_last_checkpoint", "resume_command"]


def resume_command(argv: list[str] | None = None, prog: str | None = None, ckpt: str = "last") -> str:
    """The command line that resumes the run started with ``argv`` (default ``sys.argv[1:]``): the same
    arguments, any ``--ckpt_path`` replaced by ``--ckpt_path <ckpt>``, quoted for a POSIX shell.

    ``prog`` defaults to ``genrl`` (``python -m genrl`` when the run was started that way).
    """
    if prog is None:
        main = Path(sys.argv[0]) if sys.argv else Path()
        prog = "python -m genrl" if main.name == "__main__.py" and main.parent.name == "genrl" else "genrl"
    args = list(sys.argv[1:] if argv is None else argv)
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "--ckpt_path":
            skip = True
            continue
        if a.startswith("--ckpt_path="):
            continue
        kept.append(a)
    return " ".join([prog, shlex.join([*kept, "--ckpt_path", ckpt])])


def newest_last_checkpoint(*folders: str | Path) -> Path | None:
    """The newest (by modification time) ``last*.ckpt`` in ``folders`` (a file, or the link to a distributed
    checkpoint's folder): what Lightning's ``ckpt_path="last"`` resumes; None when there is none."""
    found = [p for f in folders if Path(f).is_dir() for p in Path(f).glob("last*.ckpt") if p.exists()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


class InterruptCheckpoint(Callback):
    """On Ctrl-C (SIGINT) or SIGTERM during ``fit``, finish the current training step, write a checkpoint
    atomically and print the command that resumes from it. ``genrl fit`` adds it to every run.

    The first Ctrl-C only sets a flag: the step in progress ends (its optimizer updates, logging and periodic
    checkpoint included), then the run stops with a checkpoint of a consistent state, at any step (before the
    first periodic checkpoint too). A second Ctrl-C stops at once, without a new checkpoint (the state of a
    half-done step is not resumable). SIGTERM goes through Lightning's own handler, which stops at the end of the
    step the same way (``trainer.received_sigterm``).

    The checkpoint is ``last-interrupt.ckpt`` in the folder of the run's first :class:`ModelCheckpoint`, where
    Lightning's ``ckpt_path="last"`` looks (it takes the newest ``last*.ckpt`` there), so the printed
    ``... --ckpt_path last`` resumes it; without a ModelCheckpoint (or one whose folder depends on the logger's
    version) the message names the file itself. A plain Callback (not a Lightning ``Checkpoint``), so runs with
    ``trainer.enable_checkpointing: false`` accept it (they save to ``default_root_dir`` on interruption).
    The file is written to a temporary name and renamed into place (``os.replace``; a strategy with
    ``atomic_checkpoints``, e.g. genrl's FSDP2, publishes it itself), and removed when a later ``fit`` of the run
    finishes normally (the run's own checkpoints are newer then).

    Args:
        argv: the command's arguments (default ``sys.argv[1:]``), to print the resume command.
        filename: file name (without ``.ckpt``) of the interrupt checkpoint; must start with ``last`` for
            ``--ckpt_path last`` to find it.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, argv: list[str] | None = None, filename: str = "last-interrupt") -> None:
        super().__init__()
        if not filename.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST):
            raise ValueError(f"filename {filename!r} must start with 'last' so that --ckpt_path last finds it; "
                             f"e.g. filename='last-interrupt'")
        self.argv = None if argv is None else list(argv)
        self.filename = filename
        self.saved_path: str | None = None
        self._requested = False
        self._previous_handler: Any = None
        self._installed = False

    # -- where ---------------------------------------------------------------------------------------------------
    def checkpoint_path(self, trainer: Trainer) -> tuple[Path, bool]:
        """The interrupt checkpoint's path, and whether ``--ckpt_path last`` of a rerun finds it (it lies in a
        ModelCheckpoint folder that does not depend on the logger's version)."""
        mc = next((c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath), None)
        if mc is None:
            return Path(trainer.default_root_dir) / f"{self.filename}{self.FILE_EXTENSION}", False
        folder = Path(mc.dirpath)
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        versioned = log_dir is not None and Path(log_dir).resolve() in (folder.resolve(), *folder.resolve().parents)
        return folder / f"{self.filename}{self.FILE_EXTENSION}", not versioned

    # -- SIGINT: stop at the end of the step ----------------------------------------------------------------------
    def _on_sigint(self, signum, frame) -> None:
        if self._requested:  # second Ctrl-C: stop now
            self._restore_handler()
            raise KeyboardInterrupt
        self._requested = True
        print("\nCtrl-C: finishing the current step, then saving a checkpoint and stopping "
              "(press Ctrl-C again to stop at once without saving)", file=sys.stderr, flush=True)

    def _restore_handler(self) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous_handler)
            self._installed = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._requested = False
        self.saved_path = None
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)
            self._installed = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any) -> None:
        if self._requested:
            # Lightning's KeyboardInterrupt path: on_exception (below) saves, then the process exits with code 1
            raise KeyboardInterrupt

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_handler()

    # -- save ------------------------------------------------------------------------------------------------------
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        try:
            if trainer.state.fn == "fit" and isinstance(exception, (KeyboardInterrupt, SIGTERMException)):
                self._save_and_say(trainer, exception)
        finally:
            self._restore_handler()

    def _save_and_say(self, trainer: Trainer, exception: BaseException) -> None:
        graceful = self._requested or isinstance(exception, SIGTERMException)
        if not graceful:  # a KeyboardInterrupt in the middle of a step (second Ctrl-C, or raised elsewhere)
            self._say(f"Interrupted in the middle of step {trainer.global_step + 1}: no checkpoint written (a "
                      f"half-done step cannot be resumed). " + self._earlier(trainer))
            return
        path, last_finds_it = self.checkpoint_path(trainer)
        if trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
        if getattr(trainer.strategy, "atomic_checkpoints", False):  # FSDP2Strategy: it publishes only complete ones
            trainer.save_checkpoint(str(path))
        else:
            tmp = path.with_name(f".{path.name}.tmp")
            trainer.save_checkpoint(str(tmp))
            if trainer.is_global_zero:
                os.replace(tmp, path)
        trainer.strategy.barrier("genrl_interrupt_checkpoint")
        self.saved_path = str(path)
        resume = resume_command(self.argv, ckpt="last" if last_finds_it else str(path))
        self._say(f"Interrupted after step {trainer.global_step}: saved a checkpoint to {path}.\n"
                  f"Resume with:\n  {resume}")

    def _earlier(self, trainer: Trainer) -> str:
        path, last_finds_it = self.checkpoint_path(trainer)
        newest = newest_last_checkpoint(path.parent)
        if newest is None:
            return "No earlier checkpoint exists: a rerun starts from the beginning."
        return f"Resume from the newest earlier checkpoint ({newest}) with:\n  " + \
            resume_command(self.argv, ckpt="last" if last_finds_it else str(newest))

    @staticmethod
    def _say(message: str) -> None:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
            print(message, file=sys.stderr, flush=True)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """After a ``fit`` that ended normally, remove an older interrupt checkpoint when the run's own
        ``last*.ckpt`` is newer (``--ckpt_path last`` would not pick it any more)."""
        self._restore_handler()
        if stage != "fit" or trainer.interrupted or not trainer.is_global_zero:
            return
        path, _ = self.checkpoint_path(trainer)
        if path.exists():  # a file, or the link to a distributed checkpoint's folder
            newer = [p for p in path.parent.glob("last*.ckpt")
                     if p != path and p.stat().st_mtime > path.stat().st_mtime]
            if newer and path.is_symlink():  # FSDP2's published folder: the strategy removes link and folder
                trainer.strategy.remove_checkpoint(str(path))
            elif newer:
                path.unlink()
