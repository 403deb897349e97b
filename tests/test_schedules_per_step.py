"""Schedules that change per step or per iteration, checked at every early step through the real CLI (issue 51).

A test of a schedule's end state or default leaves an off-by-one at its start unseen (the warm-up's first factor
1/W or 2/W, the iteration a moving SDE window reads). These record the value the training loop actually used at each
of the first steps and compare it with the closed form: the linear learning-rate warm-up of pretraining (also after a
resume in the middle of the warm-up) and MixGRPO's progressive SDE window of GRPO (which steps each iteration's
rollout makes stochastic and trains).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch import Callback

from genrl.cli import GenRLCLI

ROOT = Path(__file__).resolve().parents[1]


class _LearningRates(Callback):
    """The learning rate of the first optimizer at the start of every training batch (before its step)."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def _pretrain(args: list[str], callback: Callback, ckpt_path: str | None = None) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    cli = GenRLCLI(args=["--config", str(ROOT / "configs/pretrain/shapes.yaml"), "--config",
                         str(ROOT / "configs/tiny/pretrain.yaml"), "--trainer.enable_progress_bar=false",
                         "--trainer.limit_val_batches=0", *args], run=False)
    cli.trainer.callbacks.append(callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    return cli


def test_pretrain_warmup_learning_rate_at_each_of_the_first_steps_and_after_a_resume(tmp_path, monkeypatch,
                                                                                     tiny_text_encoder):
    """warmup_steps W = 3, base lr 1e-3: the lr of optimizer step k is 1e-3 min(1, (k + 1) / 3), i.e. 1/3, 2/3, 1,
    1, 1 of it; a run stopped after 2 steps and resumed continues at 1 (not back at 1/3)."""
    enc = f"--model.init_args.generator.text_encoder={tiny_text_encoder}"
    base = [enc, "--model.init_args.warmup_steps=3", "--model.init_args.optimizer.init_args.lr=0.001"]
    expected = {k: 1e-3 * min(1.0, (k + 1) / 3) for k in range(5)}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _LearningRates()
    _pretrain(base + ["--trainer.max_steps=5"], full)
    assert full.lrs == pytest.approx(expected, rel=1e-12)
    monkeypatch.chdir(tmp_path / "b")
    first, resumed = _LearningRates(), _LearningRates()
    _pretrain(base + ["--trainer.max_steps=2"], first)
    _pretrain(base + ["--trainer.max_steps=5"], resumed, ckpt_path="last")
    assert first.lrs == pytest.approx({k: expected[k] for k in (0, 1)}, rel=1e-12)
    assert resumed.lrs == pytest.approx({k: expected[k] for k in (2, 3, 4)}, rel=1e-12)


def test_progressive_sde_window_trains_the_closed_form_steps_at_each_iteration(tmp_path, monkeypatch, tiny_policy,
                                                                                tiny_text_encoder):
    """MixGRPO through GRPO (6 steps, a window of 2, skip_last_step: starts 0..3, P = 4 positions, one iteration
    per position): iteration k's rollout is stochastic exactly on steps [s, s + 1] with s = k mod 4, so iterations
    0..4 record (hence train) [0, 1], [1, 2], [2, 3], [3, 4], [0, 1] (the wrap at P included)."""
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    import genrl.methods.grpo as grpo_module

    seen: list[tuple[int, list[int]]] = []
    real = grpo_module.collect_flat

    def spy(gen, prompts, latent_shape, seed, index, config, iteration, *args, **kwargs):
        ro = real(gen, prompts, latent_shape, seed, index, config, iteration, *args, **kwargs)
        seen.append((int(iteration), list(ro.samples.sde_steps)))
        return ro

    monkeypatch.setattr(grpo_module, "collect_flat", spy)
    monkeypatch.chdir(tmp_path)
    GenRLCLI(args=["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--config",
                   str(ROOT / "configs/tiny/grpo.yaml"), "--config", str(ROOT / "configs/grpo/shapes_mixgrpo.yaml"),
                   "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
                   f"--model.init_args.generator.pretrained={tiny_policy}", "--model.init_args.generator.components={}",
                   f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
                   "--model.init_args.rollout.num_steps=6", "--model.init_args.rollout.window_iterations=1",
                   "--trainer.max_steps=5"])
    assert [k for k, _ in seen] == list(range(5))
    assert [steps for _, steps in seen] == [[(k % 4), (k % 4) + 1] for k in range(5)]
