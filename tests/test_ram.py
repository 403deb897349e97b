"""RAM / DiffusionNFT / AWM (genrl.methods.RAM) through the real CLI on a tiny random policy: training changes the
policy, resume equals uninterrupted, zero advantages leave it unchanged at initialisation, monitors, bad input."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.rewards import RewardModel, register_reward

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs/ram/shapes.yaml")
TINY = str(ROOT / "configs/tiny/ram.yaml")
POLICY: list[str] = []


@pytest.fixture(autouse=True)
def _random_tiny_policy(tiny_policy_args):
    POLICY[:] = tiny_policy_args


def _fit(args: list[str], run: bool = True, extra_configs: tuple[str, ...] = ()) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    configs = [BASE, *extra_configs, TINY]
    base = [a for c in configs for a in ("--config", c)] + ["--trainer.enable_progress_bar=false", *POLICY]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _params(cli) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}


@register_reward("test_ram_constant")
class _Constant(RewardModel):
    def score(self, pixels, prompts, **meta):
        return {"reward": torch.full((len(prompts),), 0.5)}


@register_reward("test_ram_half_nan")
class _HalfNaN(RewardModel):
    def score(self, pixels, prompts, **meta):
        r = pixels.mean(dim=(1, 2, 3, 4))
        valid = torch.arange(len(prompts)) % 2 == 0
        return {"reward": torch.where(valid, r, torch.nan), "valid": valid}


@register_reward("test_ram_all_nan")
class _AllNaN(RewardModel):
    def score(self, pixels, prompts, **meta):
        return {"reward": torch.full((len(prompts),), math.nan)}


def test_ram_trains_resumes_exactly_and_logs_monitors(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _fit(["--trainer.max_steps=4"], run=False)
    full.model.configure_model()
    before = _params(full)
    full.trainer.fit(full.model, datamodule=full.datamodule)
    assert int(full.model.iteration) == 4 and full.trainer.global_step == 4
    after_full = _params(full)
    changed = [k for k in after_full if not torch.equal(before[k], after_full[k])]
    assert len(changed) > len(after_full) // 2, "RAM steps did not change the policy"
    # the old policy followed theta softly: neither the initial weights nor theta
    old = full.model.old_policy.tensors()
    k = changed[0]
    assert not torch.equal(old[k], before[k]) and not torch.equal(old[k], after_full[k])
    m = full.trainer.logged_metrics
    for key in ("monitor/v_ref_mse", "monitor/v_old_mse", "monitor/v_norm_ratio", "monitor/self_consistency",
                "advantage/std", "advantage/zero_std_fraction", "reward/total", "reward/batch_std", "train/loss"):
        assert key in m and math.isfinite(float(m[key])), key
    monkeypatch.chdir(tmp_path / "b")
    _fit(["--trainer.max_steps=2"])
    resumed = _fit(["--trainer.max_steps=4", "--ckpt_path=last"])
    assert int(resumed.model.iteration) == 4
    after_resume = _params(resumed)
    for k in after_full:
        assert torch.allclose(after_full[k], after_resume[k], atol=1e-6, rtol=0), k


def test_zero_advantages_leave_the_policy_unchanged_at_initialisation(tmp_path, monkeypatch):
    """Constant reward: every group-centred advantage is 0, so RAM's target is v_ref = v_theta at theta_ref: zero
    loss and zero gradient; AdamW without weight decay then leaves every weight unchanged."""
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                "--model.init_args.rewards=[{name: test_ram_constant}]",
                "--model.init_args.optimizer.init_args.weight_decay=0.0"], run=False)
    cli.model.configure_model()
    before = _params(cli)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = _params(cli)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert float(cli.trainer.logged_metrics["train/loss"]) == 0.0


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_nft_and_awm_are_options_of_the_same_method(objective, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--trainer.max_steps=2", "--trainer.limit_val_batches=0"], run=False,
               extra_configs=(str(ROOT / f"configs/ram/{objective}_shapes.yaml"),))
    assert type(cli.model).__name__ == "RAM" and cli.model.hparams.objective == objective
    cli.model.configure_model()
    before = _params(cli)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = _params(cli)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert math.isfinite(float(cli.trainer.logged_metrics["train/loss"]))


def test_lora_trains_only_the_adapter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--trainer.max_steps=2", "--trainer.limit_val_batches=0", "--model.init_args.lora.rank=4"],
               run=False)
    cli.model.configure_model()
    before = _params(cli)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = _params(cli)
    lora = [k for k in after if "lora_B" in k]
    assert lora and any(not torch.equal(before[k], after[k]) for k in lora)
    assert all(torch.equal(before[k], after[k]) for k in after if "lora_" not in k)


def test_nan_rewards_get_zero_advantage_and_the_same_backward_passes(tmp_path, monkeypatch):
    """Failed rewards are kept with advantage 0 (never dropped): the same number of loss units, backward passes and
    optimizer steps as an all-valid batch, so DDP ranks with different validity masks stay in step."""
    from genrl.methods import RAM

    calls: list[torch.Tensor] = []
    unit_loss = RAM.unit_loss

    def counting(self, x0, adv, *args, **kwargs):
        calls.append(adv.detach().clone())
        return unit_loss(self, x0, adv, *args, **kwargs)

    monkeypatch.setattr(RAM, "unit_loss", counting)
    monkeypatch.chdir(tmp_path)
    cli = _fit(["--trainer.max_steps=1", "--trainer.limit_val_batches=0",
                "--model.init_args.rewards=[{name: test_ram_half_nan}]"])
    m = cli.trainer.logged_metrics
    assert float(m["reward/invalid_fraction"]) == 0.5 and float(m["train/zero_advantage_invalid"]) == 4.0
    assert math.isfinite(float(m["train/loss"]))
    half_nan = torch.cat(calls[: len(calls) // cli.model.hparams.num_draws])
    n_units = len(calls)
    assert len(half_nan) == 8 and torch.equal(half_nan[1::2], torch.zeros(4))  # every row kept; NaN rows: A = 0
    calls.clear()
    _fit(["--trainer.max_steps=1", "--trainer.limit_val_batches=0"])
    assert len(calls) == n_units and cli.trainer.global_step == 1
    with pytest.raises(RuntimeError, match="every reward of the batch is invalid"):
        _fit(["--trainer.max_steps=1", "--trainer.limit_val_batches=0",
              "--model.init_args.rewards=[{name: test_ram_all_nan}]"])


def test_bad_input_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="multiplier m must be a finite number > 0"):
        _fit(["--model.init_args.multiplier=0"])
    with pytest.raises(ValueError, match="num_draws K must be an int >= 1"):
        _fit(["--model.init_args.num_draws=0"])
    with pytest.raises(ValueError, match="divide num_draws"):
        _fit(["--model.init_args.updates_per_iteration=3"])
    with pytest.raises(ValueError, match="a group of size 1.*group_size >= 2"):
        _fit(["--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--data.init_args.group_size=1"])
