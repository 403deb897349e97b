"""Pretraining through the real CLI: smoke run, typed --print_config, exact resume, trained params change."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs/pretrain/shapes.yaml")
TINY = str(ROOT / "configs/tiny/pretrain.yaml")


def _fit(args: list[str]) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    return GenRLCLI(args=["fit", "--config", BASE, "--config", TINY, "--trainer.enable_progress_bar=false", *args])


def _params(cli: GenRLCLI) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in cli.model.generator.transformer.state_dict().items()}


def test_resume_equals_uninterrupted(tmp_path, monkeypatch, tiny_text_encoder):
    enc = f"--model.init_args.generator.text_encoder={tiny_text_encoder}"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _fit([enc, "--trainer.max_steps=4"])
    after_full = _params(full)
    monkeypatch.chdir(tmp_path / "b")
    first = _fit([enc, "--trainer.max_steps=2"])
    after_two = _params(first)
    assert (Path("runs/pretrain_shapes/checkpoints/last.ckpt")).is_file()
    resumed = _fit([enc, "--trainer.max_steps=4", "--ckpt_path=last"])
    after_resume = _params(resumed)
    assert resumed.trainer.global_step == 4
    for k in after_full:
        assert torch.allclose(after_full[k], after_resume[k], atol=1e-6, rtol=0), k
    # trained parameters actually changed between step 2 and step 4 (the test can fail)
    changed = [k for k in after_full if not torch.allclose(after_full[k], after_two[k], atol=1e-7)]
    assert len(changed) > len(after_full) // 2
    # validation ran and wrote sample videos with a manifest; the diffusers export reloads
    videos = list(Path("runs/pretrain_shapes").rglob("*.mp4"))
    assert videos and list(Path("runs/pretrain_shapes").rglob("manifest.jsonl"))
    from genrl.callbacks import find_ema
    from genrl.models import ModelSpec

    ema_full, ema_resumed = find_ema(full.trainer), find_ema(resumed.trainer)
    assert ema_full.num_updates == ema_resumed.num_updates == 4
    for k in ema_full.shadow:
        assert torch.allclose(ema_full.shadow[k], ema_resumed.shadow[k], atol=1e-6, rtol=0), k
    exported = ModelSpec(pretrained="runs/pretrain_shapes/export").build()
    for k, v in exported.state_dict().items():
        assert torch.equal(v, ema_resumed.shadow["generator.transformer." + k]), k
        assert not torch.equal(v, after_resume[k]) or v.abs().sum() == 0, k  # EMA, not the raw weights


def test_print_config_is_typed(capsys, tiny_text_encoder):
    with pytest.raises(SystemExit) as exit_info:
        _fit([f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--print_config"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "class_path: genrl.methods.FlowMatchingPretrain" in out
    assert "kind: logit_normal" in out and "caption_dropout: 0.1" in out
    assert "class_path: genrl.data.ShapesDataModule" in out or "ShapesDataModule" in out


def test_bad_config_values_are_rejected(tiny_text_encoder, capsys):
    with pytest.raises(SystemExit):
        _fit([f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
              "--model.init_args.loss_weighting=banana"])
    assert "banana" in capsys.readouterr().err


def test_missing_pretrained_folder_is_a_clear_error(tmp_path, monkeypatch, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model weights at"):
        _fit([
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            "--model.init_args.generator.components={}",
            f"--model.init_args.generator.pretrained={tmp_path / 'missing'}",
        ])


def test_cli_smoke_real_config_subprocess(tmp_path):
    """The issue's command, as a user runs it: real MiniLM, real DiT size, 3 steps on CPU."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "genrl", "fit", "--config", BASE, "--trainer.max_steps=3",
         "--trainer.enable_progress_bar=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "runs/pretrain_shapes/checkpoints/last.ckpt").is_file()
    assert (tmp_path / "runs/pretrain_shapes/export/config.json").is_file()
