"""Fast unit contracts of the callbacks' and roles' lifecycle, called directly with stand-in trainers (no fit): where
InterruptCheckpoint puts its checkpoint and whether `--ckpt_path last` finds it, the SIGINT handler it installs on
train start and restores on teardown, when teardown removes an older interrupt checkpoint, VideoLogger's documented
defaults and output folder, FrozenRoles' construction and its empty state_dict."""

from __future__ import annotations

import os
import signal
import threading
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint
from torch import nn

from genrl.callbacks import InterruptCheckpoint, VideoLogger
from genrl.models.roles import FrozenRoles


@pytest.fixture
def sigint():
    """Puts a known previous SIGINT handler in place and restores the original one after the test."""
    original = signal.getsignal(signal.SIGINT)

    def previous(signum, frame) -> None:
        pass

    signal.signal(signal.SIGINT, previous)
    yield previous
    signal.signal(signal.SIGINT, original)


def _trainer(tmp_path: Path, callbacks=(), logger=None, **kw) -> SimpleNamespace:
    """A stand-in with what checkpoint_path / teardown read."""
    base = dict(checkpoint_callbacks=list(callbacks), default_root_dir=str(tmp_path / "root"), logger=logger,
                interrupted=False, is_global_zero=True)
    base.update(kw)
    return SimpleNamespace(**base)


class _OtherCheckpoint(Checkpoint):
    """A checkpoint callback that is not a ModelCheckpoint but has a folder."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = dirpath


# -- InterruptCheckpoint.checkpoint_path ------------------------------------------------------------------------------
def test_checkpoint_path_is_in_the_first_model_checkpoint_folder_and_found_unless_versioned(tmp_path):
    """checkpoint_path: <first ModelCheckpoint with a folder>/last-interrupt.ckpt, found by `--ckpt_path last` exactly
    when that folder is not the logger's log_dir nor inside it; default_root_dir (not found) without one."""
    cb = InterruptCheckpoint()
    root = tmp_path / "root" / "last-interrupt.ckpt"
    ckpts, logs = tmp_path / "ckpts", tmp_path / "logs" / "version_3"
    assert cb.checkpoint_path(_trainer(tmp_path)) == (root, False)
    # a ModelCheckpoint without a folder (yet) and a non-ModelCheckpoint with one are skipped
    assert cb.checkpoint_path(_trainer(tmp_path, [ModelCheckpoint()])) == (root, False)
    skipped = [_OtherCheckpoint(str(tmp_path / "other")), ModelCheckpoint(), ModelCheckpoint(dirpath=ckpts),
               ModelCheckpoint(dirpath=tmp_path / "second")]
    assert cb.checkpoint_path(_trainer(tmp_path, skipped)) == (ckpts / "last-interrupt.ckpt", True)
    # a logger whose log_dir is elsewhere, a logger without log_dir, no logger: found
    for logger in (SimpleNamespace(log_dir=str(logs)), SimpleNamespace(), None):
        trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=ckpts)], logger=logger)
        assert cb.checkpoint_path(trainer) == (ckpts / "last-interrupt.ckpt", True), logger
    # the folder is the log_dir or inside it (a new version on rerun): not found
    for folder in (logs, logs / "checkpoints", logs / "a" / "b"):
        trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=folder)], logger=SimpleNamespace(log_dir=str(logs)))
        assert cb.checkpoint_path(trainer) == (folder / "last-interrupt.ckpt", False), folder
    named = InterruptCheckpoint(filename="last-stop")
    assert named.checkpoint_path(_trainer(tmp_path, [ModelCheckpoint(dirpath=ckpts)])) == (ckpts / "last-stop.ckpt",
                                                                                           True)


# -- SIGINT handler ---------------------------------------------------------------------------------------------------
def test_train_start_installs_the_sigint_handler_and_teardown_restores_the_previous_one(tmp_path, sigint):
    """on_train_start (main thread) resets the request and saved_path and installs _on_sigint; teardown puts the
    previous handler object back, once: a handler set afterwards is left alone by later teardowns."""
    cb = InterruptCheckpoint()
    cb._requested, cb.saved_path = True, "old.ckpt"
    cb.on_train_start(SimpleNamespace(), None)
    assert signal.getsignal(signal.SIGINT) == cb._on_sigint
    assert cb._requested is False and cb.saved_path is None
    cb.teardown(_trainer(tmp_path), None, "fit")
    assert signal.getsignal(signal.SIGINT) is sigint

    def later(signum, frame) -> None:
        pass

    signal.signal(signal.SIGINT, later)
    cb.teardown(_trainer(tmp_path), None, "fit")
    cb.on_train_end(SimpleNamespace(), None)
    assert signal.getsignal(signal.SIGINT) is later


def test_train_start_outside_the_main_thread_installs_nothing(tmp_path, sigint):
    """on_train_start in a worker thread (where signal.signal is not allowed) leaves the SIGINT handler alone and
    raises nothing; a later teardown does not touch the handler either."""
    cb = InterruptCheckpoint()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            cb.on_train_start(SimpleNamespace(), None)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    assert errors == []
    assert signal.getsignal(signal.SIGINT) is sigint

    def later(signum, frame) -> None:
        pass

    signal.signal(signal.SIGINT, later)
    cb.teardown(_trainer(tmp_path), None, "fit")
    assert signal.getsignal(signal.SIGINT) is later


# -- teardown removes an older interrupt checkpoint ----------------------------------------------------------------
def _setup_folder(tmp_path: Path, last_mtime: float | None) -> tuple[Path, Path]:
    folder = tmp_path / "ckpts"
    folder.mkdir(exist_ok=True)
    interrupt = folder / "last-interrupt.ckpt"
    interrupt.write_text("interrupt")
    os.utime(interrupt, (1000, 1000))
    if last_mtime is not None:
        (folder / "last.ckpt").write_text("last")
        os.utime(folder / "last.ckpt", (last_mtime, last_mtime))
    return folder, interrupt


@pytest.mark.parametrize(("stage", "interrupted", "rank_zero", "last_mtime", "removed"), [
    ("fit", False, True, 2000, True),  # a normal fit wrote a newer last.ckpt: the interrupt checkpoint goes
    ("fit", True, True, 2000, False),  # the fit was interrupted
    ("fit", False, False, 2000, False),  # not global rank 0
    ("validate", False, True, 2000, False),  # not a fit
    ("fit", False, True, 500, False),  # the run's last.ckpt is older
    ("fit", False, True, 1000, False),  # ... or exactly as old: not newer
    ("fit", False, True, None, False),  # no other last*.ckpt
])
def test_teardown_removes_the_interrupt_checkpoint_only_after_a_normal_fit_with_a_newer_last(
        tmp_path, sigint, stage, interrupted, rank_zero, last_mtime, removed):
    """teardown deletes last-interrupt.ckpt exactly when stage is fit, the fit was not interrupted, this is global
    rank 0 and another last*.ckpt in its folder is strictly newer; it never touches the other files."""
    folder, interrupt = _setup_folder(tmp_path, last_mtime)
    (folder / "epoch=1.ckpt").write_text("epoch")
    os.utime(folder / "epoch=1.ckpt", (3000, 3000))  # newer, but not a last*.ckpt
    trainer = _trainer(tmp_path, [ModelCheckpoint(dirpath=folder)], interrupted=interrupted, is_global_zero=rank_zero)
    cb = InterruptCheckpoint()
    cb.teardown(trainer, None, stage)
    assert interrupt.exists() is not removed
    assert (folder / "epoch=1.ckpt").read_text() == "epoch"
    if last_mtime is not None:
        assert (folder / "last.ckpt").read_text() == "last"


# -- VideoLogger ----------------------------------------------------------------------------------------------------
def test_video_logger_defaults_and_output_folder(tmp_path):
    """VideoLogger's defaults are the signature's (8 videos, 1 batch, 8 fps, strips x4, no dirpath); the output
    folder is <dirpath>/step_<7 digits>, else <log_dir or default_root_dir>/videos/step_<7 digits>."""
    cb = VideoLogger()
    assert (cb.dirpath, cb.max_videos, cb.max_batches, cb.fps, cb.strip_scale) == (None, 8, 1, 8, 4)
    trainer = SimpleNamespace(global_step=12, log_dir=str(tmp_path / "logs"), default_root_dir=str(tmp_path / "r"))
    assert cb._root(trainer) == tmp_path / "logs" / "videos" / "step_0000012"
    trainer.log_dir = None
    assert cb._root(trainer) == tmp_path / "r" / "videos" / "step_0000012"
    given = VideoLogger(dirpath=str(tmp_path / "out"), max_videos=2, max_batches=3, fps=24, strip_scale=1)
    assert (given.dirpath, given.max_videos, given.max_batches, given.fps, given.strip_scale) == (
        str(tmp_path / "out"), 2, 3, 24, 1)
    assert given._root(trainer) == tmp_path / "out" / "step_0000012"


# -- FrozenRoles ----------------------------------------------------------------------------------------------------
def test_frozen_roles_built_from_a_dict_hold_the_modules_frozen_in_order():
    """FrozenRoles(modules) registers each given module itself, in order, frozen and in eval mode."""
    teacher, ref = nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    roles = FrozenRoles({"teacher": teacher, "ref": ref})
    assert list(roles.keys()) == ["teacher", "ref"]
    assert roles["teacher"] is teacher and roles["ref"] is ref
    assert not any(p.requires_grad for p in roles.parameters()) and len(list(roles.parameters())) == 4
    assert not teacher.training and not ref.training and not ref[1].training
    assert len(FrozenRoles()) == 0 and len(FrozenRoles(None)) == 0


def test_frozen_roles_state_dict_is_empty_and_returns_the_given_destination():
    """FrozenRoles.state_dict() is an empty OrderedDict; a destination passed positionally or by keyword is returned
    itself, unchanged; a parent's state_dict holds exactly the parent's own tensors."""
    torch.manual_seed(0)
    roles = FrozenRoles({"teacher": nn.Linear(2, 2)})
    empty = roles.state_dict()
    assert type(empty) is OrderedDict and empty == OrderedDict()
    w = torch.randn(3, dtype=torch.float64)
    for call in (lambda d: roles.state_dict(d), lambda d: roles.state_dict(d, "p.", True),
                 lambda d: roles.state_dict(destination=d), lambda d: roles.state_dict(destination=d, prefix="p.")):
        dest = OrderedDict(w=w)
        assert call(dest) is dest
        assert list(dest) == ["w"] and dest["w"] is w

    parent = nn.Module()
    parent.own = nn.Linear(2, 3)
    parent.frozen = roles
    sd = parent.state_dict()
    assert list(sd) == ["own.weight", "own.bias"]
    assert torch.equal(sd["own.weight"], parent.own.weight) and torch.equal(sd["own.bias"], parent.own.bias)
