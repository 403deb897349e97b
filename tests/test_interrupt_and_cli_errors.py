"""`genrl fit` on interruption (Ctrl-C saves a resumable checkpoint and names the resume command) and its errors
(a config typo names the key and the closest valid ones first; an accelerator that is not there is refused)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from genrl.callbacks import InterruptCheckpoint, resume_command
from genrl.cli import GenRLCLI, main

ROOT = Path(__file__).resolve().parents[1]
QUICK = str(ROOT / "configs/quickstart.yaml")
TINY = str(ROOT / "configs/tiny/grpo.yaml")


class _CtrlCAt(Callback):
    """Delivers a real SIGINT to this process at the end of training step ``step`` (as a Ctrl-C would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGINT)


def _args(tiny_policy, tiny_text_encoder, *extra: str) -> list[str]:
    return ["fit", "--config", QUICK, "--config", TINY, "--trainer.enable_progress_bar=false",
            f"--model.init_args.generator.pretrained={tiny_policy}", "--model.init_args.generator.components={}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.limit_val_batches=0",
            *extra]


def _weights(cli) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}


def test_ctrl_c_at_step_3_saves_a_checkpoint_that_resumes_like_an_uninterrupted_run(
        tmp_path, monkeypatch, capsys, tiny_policy, tiny_text_encoder):
    (tmp_path / "full").mkdir()
    (tmp_path / "cut").mkdir()
    monkeypatch.chdir(tmp_path / "full")
    full = GenRLCLI(args=_args(tiny_policy, tiny_text_encoder, "--trainer.max_steps=5"))
    full_metrics = {k: float(v) for k, v in full.trainer.logged_metrics.items()}
    monkeypatch.chdir(tmp_path / "cut")
    args = _args(tiny_policy, tiny_text_encoder, "--trainer.max_steps=5")
    cli = GenRLCLI(args=args[1:], run=False)  # the same CLI as `genrl fit`, plus a callback that presses Ctrl-C
    cli.trainer.callbacks.insert(0, _CtrlCAt(3))
    with pytest.raises(SystemExit) as stop:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert stop.value.code == 1
    assert cli.trainer.global_step == 3  # stopped at the end of the step Ctrl-C came in, not later
    # before the first periodic checkpoint (every 10 steps): only the interrupt checkpoint exists
    ckpts = sorted(p.name for p in Path("runs/quickstart/checkpoints").glob("*.ckpt"))
    assert ckpts == ["last-interrupt.ckpt"]
    assert not list(Path("runs/quickstart/checkpoints").glob(".*tmp"))  # the temporary file was renamed
    saved = torch.load("runs/quickstart/checkpoints/last-interrupt.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3
    err = capsys.readouterr().err
    assert f"saved a checkpoint to {Path.cwd() / 'runs/quickstart/checkpoints/last-interrupt.ckpt'}" in err
    assert err.rstrip().splitlines()[-1] == "  " + resume_command(args)
    assert err.rstrip().endswith("--trainer.max_steps=5 --ckpt_path last")
    # the printed command's arguments resume: --ckpt_path last finds the interrupt checkpoint
    resumed = GenRLCLI(args=[*args, "--ckpt_path", "last"])
    assert resumed.trainer.global_step == 5 and int(resumed.model.iteration) == 5
    for k, v in _weights(full).items():
        assert torch.allclose(v, _weights(resumed)[k], atol=1e-6, rtol=0), k
    resumed_metrics = {k: float(v) for k, v in resumed.trainer.logged_metrics.items()}
    assert resumed_metrics.keys() == full_metrics.keys() and "reward/total" in full_metrics
    for k, v in full_metrics.items():
        assert resumed_metrics[k] == pytest.approx(v, abs=1e-5, nan_ok=True), k


def test_resume_command_replaces_ckpt_path():
    assert resume_command(["fit", "--config", "configs/quickstart.yaml", "--ckpt_path=runs/x.ckpt"]) == \
        "genrl fit --config configs/quickstart.yaml --ckpt_path last"
    assert resume_command(["fit", "-c", "a b.yaml", "--ckpt_path", "best"], ckpt="/r/last-interrupt.ckpt") == \
        "genrl fit -c 'a b.yaml' --ckpt_path /r/last-interrupt.ckpt"
    with pytest.raises(ValueError, match="must start with 'last'"):
        InterruptCheckpoint(filename="on_exception")


def test_every_config_gets_the_interrupt_checkpoint(tiny_policy, tiny_text_encoder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = GenRLCLI(args=_args(tiny_policy, tiny_text_encoder)[1:], run=False)
    assert sum(isinstance(c, InterruptCheckpoint) for c in cli.trainer.callbacks) == 1


def test_run_dir_moves_every_path_under_the_runs_root_and_nothing_else(tiny_policy, tiny_text_encoder, tmp_path,
                                                                      monkeypatch):
    """--run_dir: default_root_dir, the logger's save_dir and the checkpoint / export dirpaths under the config's old
    root move under the new folder (relative paths kept); paths outside the old root stay; without the flag nothing
    moves; relocate_run without a default_root_dir is an error."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    from genrl.callbacks import DiffusersExport
    from genrl.cli import relocate_run

    monkeypatch.chdir(tmp_path)
    cli = GenRLCLI(args=[*_args(tiny_policy, tiny_text_encoder)[1:], "--run_dir=runs/variant"], run=False)
    t = cli.trainer
    assert t.default_root_dir == "runs/variant" and t.logger.save_dir == "runs/variant"
    export = next(c for c in t.callbacks if isinstance(c, DiffusersExport))
    ckpt = next(c for c in t.callbacks if isinstance(c, ModelCheckpoint))
    assert export.dirpath == "runs/variant/export"
    assert Path(ckpt.dirpath) == tmp_path / "runs/variant/checkpoints"
    plain = GenRLCLI(args=_args(tiny_policy, tiny_text_encoder)[1:], run=False).trainer
    assert plain.default_root_dir == "runs/quickstart"
    entry = lambda key, value: SimpleNamespace(init_args=SimpleNamespace(**{key: value}))  # noqa: E731
    trainer = SimpleNamespace(default_root_dir="runs/a", logger=entry("save_dir", "runs/a"),
                              callbacks=[entry("dirpath", "runs/a/ck"), entry("dirpath", "elsewhere/x"),
                                         entry("dirpath", "runs/ab/y"), SimpleNamespace(init_args=None)])
    assert relocate_run(trainer, "/out/b") == ["trainer.default_root_dir", "trainer.logger[0].save_dir",
                                               "trainer.callbacks[0].dirpath"]
    assert trainer.logger.init_args.save_dir == "/out/b" and trainer.callbacks[0].init_args.dirpath == "/out/b/ck"
    assert trainer.callbacks[1].init_args.dirpath == "elsewhere/x" and trainer.callbacks[2].init_args.dirpath == \
        "runs/ab/y"  # a sibling folder with a common prefix is not under the root
    with pytest.raises(ValueError, match="--run_dir needs a trainer.default_root_dir"):
        relocate_run(SimpleNamespace(default_root_dir=None), "x")


def test_moving_only_the_root_warns_and_names_the_paths_left_behind(tiny_policy, tiny_text_encoder, tmp_path,
                                                                   monkeypatch):
    """--trainer.default_root_dir alone leaves the logger and checkpoint / export folders in the recipe's run: a
    warning names each and the --run_dir fix; --run_dir (or no override) warns nothing."""
    import warnings

    from genrl.cli import stray_run_paths

    monkeypatch.chdir(tmp_path)
    for extra, stray in ((["--trainer.default_root_dir=runs/other"], True), (["--run_dir=runs/other"], False),
                         ([], False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            GenRLCLI(args=[*_args(tiny_policy, tiny_text_encoder)[1:], *extra], run=False)
        msgs = [str(w.message) for w in caught if "lie outside it" in str(w.message)]
        assert len(msgs) == int(stray), (extra, msgs)
        if stray:
            assert "trainer.logger[0].save_dir = runs/quickstart" in msgs[0]
            assert "export" in msgs[0] and "--run_dir runs/other" in msgs[0]
    from types import SimpleNamespace

    entry = lambda key, value: SimpleNamespace(init_args=SimpleNamespace(**{key: value}))  # noqa: E731
    trainer = SimpleNamespace(default_root_dir="runs/a", logger=[entry("save_dir", "runs/a/logs")],
                              callbacks=[entry("dirpath", "runs/ab/ck"), entry("dirpath", None)])
    assert stray_run_paths(trainer) == ["trainer.callbacks[0].dirpath = runs/ab/ck"]
    assert stray_run_paths(SimpleNamespace(default_root_dir=None, callbacks=[entry("dirpath", "x")])) == []


def _first_lines(capsys, monkeypatch, args) -> list[str]:
    monkeypatch.setattr("sys.argv", ["genrl", *args])  # as typed in a shell
    with pytest.raises(SystemExit) as stop:
        main()
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_config_typo_names_the_key_and_the_closest_ones_first(tmp_path, capsys, monkeypatch):
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_stepz: 3\n")
    head = "\n".join(_first_lines(capsys, monkeypatch, ["fit", "--config", QUICK, "--config", str(typo)])[:5])
    assert "'trainer.max_stepz'" in head and "did you mean: trainer.max_steps" in head
    typo.write_text("model:\n  init_args:\n    clip_rnage: 0.1\n")
    head = "\n".join(_first_lines(capsys, monkeypatch, ["fit", "--config", QUICK, "--config", str(typo)])[:5])
    assert "'model.init_args.clip_rnage'" in head and "did you mean: model.init_args.clip_range" in head
    lines = _first_lines(capsys, monkeypatch, ["fit", "--config", QUICK, "--trainer.max_stepz=3"])
    assert len(lines) <= 5 and "did you mean: trainer.max_steps" in lines[1]


def test_a_typo_inside_a_nested_component_gets_its_full_key(capsys, monkeypatch):
    """A component inside a method (DMD's weighting: StreamR1Weighting) is suggested under its whole path."""
    lines = _first_lines(capsys, monkeypatch, ["fit", "--config", str(ROOT / "configs/dmd/shapes.yaml"), "--config",
                                               str(ROOT / "configs/stream_r1/shapes.yaml"),
                                               "--model.init_args.weighting.init_args.betta=2"])
    head = "\n".join(lines[:3])
    assert "did you mean: model.init_args.weighting.init_args.beta?" in head


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_accelerator_without_cuda_fails_before_the_model_with_the_fix(capsys, monkeypatch):
    import genrl.models.loading as loading

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the accelerator check")

    monkeypatch.setattr(loading, "load_generator", no_model)
    monkeypatch.setattr(GenRLCLI, "instantiate_classes", no_model)
    lines = _first_lines(capsys, monkeypatch, ["fit", "--config", QUICK, "--trainer.accelerator=gpu"])
    assert "trainer.accelerator=gpu" in lines[0] and "--trainer.accelerator=cpu" in lines[0]
    assert len(lines) <= 3


def test_interrupt_mid_step_names_the_newest_earlier_checkpoint(tmp_path):
    """Interrupted mid-step: the message names the newest (by mtime) last*.ckpt and how to resume it."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import ModelCheckpoint

    argv = ["fit", "--config", "a.yaml", "--ckpt_path", "x.ckpt"]
    cb = InterruptCheckpoint(argv=argv)
    folder = tmp_path / "ckpts"
    with_mc = SimpleNamespace(checkpoint_callbacks=[ModelCheckpoint(dirpath=folder)], default_root_dir=str(tmp_path),
                              logger=None)
    no_mc = SimpleNamespace(checkpoint_callbacks=[], default_root_dir=str(folder), logger=None)
    none = "No earlier checkpoint exists: a rerun starts from the beginning."
    assert cb._earlier(with_mc) == none  # no folder yet
    folder.mkdir()
    (folder / "epoch=3.ckpt").write_text("x")
    assert cb._earlier(with_mc) == none  # not a last*.ckpt
    for name, mtime in (("last-a.ckpt", 300), ("last.ckpt", 200), ("last-v1.ckpt", 100)):
        (folder / name).write_text("x")
        os.utime(folder / name, (mtime, mtime))
    newest = folder / "last-a.ckpt"  # neither first nor last by name
    head = f"Resume from the newest earlier checkpoint ({newest}) with:\n  "
    assert cb._earlier(with_mc) == head + resume_command(argv, ckpt="last")  # `--ckpt_path last` finds it
    assert cb._earlier(no_mc) == head + resume_command(argv, ckpt=str(newest))  # named by its path


def test_interrupt_mid_step_says_which_step_and_writes_nothing(tmp_path, capsys):
    """A KeyboardInterrupt without a prior request (second Ctrl-C) during step global_step + 1 writes no checkpoint
    and says so on stderr, naming that step and the earlier checkpoint to resume from."""
    from types import SimpleNamespace

    cb = InterruptCheckpoint(argv=["fit", "--config", "a.yaml"])
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / "last.ckpt").write_text("x")
    saved = []
    trainer = SimpleNamespace(checkpoint_callbacks=[], default_root_dir=str(folder), logger=None, global_step=6,
                              state=SimpleNamespace(fn="fit"), save_checkpoint=saved.append)
    cb.on_exception(trainer, None, KeyboardInterrupt())
    err = capsys.readouterr().err
    assert err == ("Interrupted in the middle of step 7: no checkpoint written (a half-done step cannot be resumed). "
                   + cb._earlier(trainer) + "\n")
    assert str(folder / "last.ckpt") in err and saved == [] and cb.saved_path is None


def _fake_trainer(root: Path, *, rank_zero: bool = True):
    """A stand-in for Trainer with what InterruptCheckpoint reads: no ModelCheckpoint, so the interrupt checkpoint
    goes to default_root_dir; save_checkpoint writes the step number to the path it is given."""
    from types import SimpleNamespace

    def save(path: str) -> None:
        Path(path).write_text("step 4")

    return SimpleNamespace(checkpoint_callbacks=[], default_root_dir=str(root), logger=None, global_step=4,
                           state=SimpleNamespace(fn="fit"), is_global_zero=rank_zero, save_checkpoint=save,
                           strategy=SimpleNamespace(barrier=lambda name=None: None))


def test_requested_interrupt_saves_atomically_into_missing_or_existing_folders(tmp_path, capsys):
    """After a first Ctrl-C (or SIGTERM), on_exception writes the checkpoint under default_root_dir, creating missing
    parent folders and accepting an existing one, leaves no temporary file, records saved_path and prints the resume
    command with the checkpoint's path (no ModelCheckpoint: `--ckpt_path last` would not find it)."""
    argv = ["fit", "--config", "a.yaml"]
    for root in (tmp_path / "new" / "nested", tmp_path / "new" / "nested"):  # missing (parent too), then existing
        cb = InterruptCheckpoint(argv=argv)
        cb._requested = True
        cb.on_exception(_fake_trainer(root), None, KeyboardInterrupt())
        path = root / "last-interrupt.ckpt"
        assert path.read_text() == "step 4"
        assert sorted(p.name for p in root.iterdir()) == ["last-interrupt.ckpt"]  # the .tmp was renamed
        assert cb.saved_path == str(path)
        assert capsys.readouterr().err == (f"Interrupted after step 4: saved a checkpoint to {path}.\nResume with:\n  "
                                           f"{resume_command(argv, ckpt=str(path))}\n")


def test_interrupt_messages_are_printed_by_local_rank_0_of_node_0_only(monkeypatch, capsys):
    """_say prints on stderr only where LOCAL_RANK and NODE_RANK are both 0 (unset counts as 0)."""
    for local, node, printed in (("0", "0", True), ("1", "0", False), ("0", "1", False), (None, None, True)):
        for name, value in (("LOCAL_RANK", local), ("NODE_RANK", node)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        InterruptCheckpoint._say("hello")
        assert capsys.readouterr().err == ("hello\n" if printed else ""), (local, node)


def test_resume_command_drops_every_ckpt_path_form_wherever_it_stands_and_names_the_program(monkeypatch):
    """resume_command keeps every other argument in order, drops `--ckpt_path X` and `--ckpt_path=X` also in the
    middle of the line, reads sys.argv[1:] when argv is None, and says `python -m genrl` only for
    .../genrl/__main__.py (else `genrl`, also with an empty sys.argv)."""
    argv = ["fit", "--ckpt_path", "a.ckpt", "--config", "c.yaml", "--ckpt_path=b.ckpt", "--seed_everything", "3",
            "--ckpt_path", "c.ckpt", "--trainer.max_steps=9"]
    kept = "fit --config c.yaml --seed_everything 3 --trainer.max_steps=9 --ckpt_path"
    assert resume_command(argv, prog="genrl") == f"genrl {kept} last"
    assert resume_command(argv, prog="x", ckpt="/r/l.ckpt") == f"x {kept} /r/l.ckpt"
    for main_path, prog in (("/env/bin/genrl", "genrl"), ("/src/genrl/__main__.py", "python -m genrl"),
                            ("/src/other/__main__.py", "genrl"), ("/src/genrl/cli.py", "genrl"),
                            ("__main__.py", "genrl")):
        monkeypatch.setattr("sys.argv", [main_path, "fit", "--config", "d.yaml"])
        assert resume_command() == f"{prog} fit --config d.yaml --ckpt_path last", main_path
        assert resume_command(["validate"]) == f"{prog} validate --ckpt_path last", main_path
    monkeypatch.setattr("sys.argv", [])
    assert resume_command(["fit"]) == "genrl fit --ckpt_path last"


def test_on_exception_saves_only_for_an_interrupt_of_fit():
    """on_exception hands the exception itself to the saver for a KeyboardInterrupt or SIGTERMException during fit,
    and saves nothing for another stage or another exception."""
    from types import SimpleNamespace

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    calls = []
    cb = InterruptCheckpoint(argv=["fit"])
    cb._save_and_say = lambda trainer, exception: calls.append((trainer, exception))
    fit = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    validate = SimpleNamespace(state=SimpleNamespace(fn="validate"))
    ctrl_c, sigterm, other = KeyboardInterrupt(), SIGTERMException(), RuntimeError("boom")
    for trainer, exc in ((fit, ctrl_c), (fit, sigterm), (fit, other), (validate, ctrl_c), (validate, sigterm)):
        cb.on_exception(trainer, None, exc)
    assert len(calls) == 2 and calls[0][0] is fit and calls[0][1] is ctrl_c and calls[1][1] is sigterm


class _BarAtFirstBatch(Callback):
    """Records the training bar's (completed, total, description) when the first batch of a fit starts."""

    def __init__(self) -> None:
        self.seen = None

    def on_train_batch_start(self, trainer, *args, **kwargs) -> None:
        if self.seen is None:
            bar = trainer.progress_bar_callback
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.seen = (task.completed, task.total, task.description)


def test_progress_bar_counts_steps_of_max_steps_and_resumes_at_the_restored_step(
        tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    from lightning.pytorch.callbacks import TQDMProgressBar

    from genrl.callbacks import StepProgressBar

    monkeypatch.chdir(tmp_path)
    args = [a for a in _args(tiny_policy, tiny_text_encoder)[1:] if a != "--trainer.enable_progress_bar=false"]
    first = GenRLCLI(args=[*args, "--trainer.max_steps=2"], run=False)
    bar = first.trainer.progress_bar_callback
    assert type(bar) is StepProgressBar  # in place of Lightning's default rich bar
    first.trainer.fit(first.model, datamodule=first.datamodule)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total, task.description) == (2, 2, "Steps")
    shown = bar.get_metrics(first.trainer, first.model)
    assert shown["version"] == "0" and "v_num" not in shown  # not "v_num: 0.000"
    # resumed at step 2 of 4: Lightning's bar would count the restored batch index against the 2 remaining steps
    resumed = GenRLCLI(args=[*args, "--trainer.max_steps=4"], run=False)
    probe = _BarAtFirstBatch()
    resumed.trainer.callbacks.insert(0, probe)
    resumed.trainer.fit(resumed.model, datamodule=resumed.datamodule, ckpt_path="last")
    bar = resumed.trainer.progress_bar_callback
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert probe.seen == (2, 4, "Steps")
    assert (task.completed, task.total) == (4, 4) and resumed.trainer.global_step == 4
    # a progress bar the config names is kept
    tqdm = GenRLCLI(args=[*args, "--trainer.max_steps=1",
                          "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], run=False)
    assert type(tqdm.trainer.progress_bar_callback) is TQDMProgressBar


def test_resuming_a_distributed_checkpoint_on_one_device_names_the_fsdp2_profile(tiny_policy, tiny_text_encoder,
                                                                                   tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs/quickstart/checkpoints"  # the quickstart's ModelCheckpoint folder
    shards = folder / ".last.ckpt.1"
    shards.mkdir(parents=True)
    (shards / "meta.pt").write_bytes(b"")
    (shards / ".metadata").write_bytes(b"")
    (folder / "last.ckpt").symlink_to(shards.name, target_is_directory=True)
    for ckpt in ("last", str(folder / "last.ckpt")):
        with pytest.raises(SystemExit, match="distributed checkpoint .*cpu_fsdp2.yaml --trainer.devices=1"):
            GenRLCLI(args=_args(tiny_policy, tiny_text_encoder, "--trainer.max_steps=1", "--ckpt_path", ckpt))
    (folder / "last.ckpt").unlink()  # a plain file is Lightning's business (here: not a checkpoint -> its error)
    (folder / "last.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception) as other:
        GenRLCLI(args=_args(tiny_policy, tiny_text_encoder, "--trainer.max_steps=1", "--ckpt_path", "last"))
    assert "distributed checkpoint" not in str(other.value)
