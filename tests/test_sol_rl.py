"""Sol-RL's two-stage collect phase (genrl.methods.preview) composed into RAM / DiffusionNFT and GRPO, through the real
CLI on a tiny random policy: the pool is previewed by the rollout copy, K per prompt are kept (best / worst,
several groups at once), only those are regenerated and trained on, a same-precision regeneration reproduces its
preview bitwise, proxy fidelity is logged, resume equals an uninterrupted run, bad input is named."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import genrl.methods.grpo as grpo_module
import genrl.methods.preview as preview_module
import genrl.methods.ram as ram_module
from genrl.cli import GenRLCLI
from genrl.methods.preview import PreviewConfig, preview_config
from genrl.rollout.sampler import RolloutConfig

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs/sol_rl/shapes.yaml")
TINY = str(ROOT / "configs/tiny/sol_rl.yaml")
POLICY: list[str] = []


@pytest.fixture(autouse=True)
def _random_tiny_policy(tiny_policy_args):
    POLICY[:] = tiny_policy_args


def _cli(args: list[str], run: bool = False) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", BASE, "--config", TINY, "--trainer.enable_progress_bar=false", *POLICY]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _params(cli) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}


class _Spy:
    """Records what the preview's rollout and the method's regeneration were given and returned."""

    def __init__(self, monkeypatch) -> None:
        self.preview, self.regenerated = [], []
        real_rollout, real_collect = preview_module.rollout, ram_module.collect_endpoints

        def spy_rollout(gen, prompts, latent_shape, seed, index, config, **kw):
            out = real_rollout(gen, prompts, latent_shape, seed, index, config, **kw)
            self.preview.append({"index": index.clone(), "steps": config.num_steps, "final": out.final.clone(),
                                 "dtype": next(gen.transformer.parameters()).dtype})
            return out

        def spy_collect(gen, prompts, latent_shape, seed, index, config, iteration, policy=None):
            out = real_collect(gen, prompts, latent_shape, seed, index, config, iteration, policy=policy)
            self.regenerated.append({"index": index.clone(), "x0": out.samples.clone(), "prompts": list(prompts)})
            return out

        monkeypatch.setattr(preview_module, "rollout", spy_rollout)
        monkeypatch.setattr(ram_module, "collect_endpoints", spy_collect)


def test_the_pool_is_previewed_k_per_prompt_kept_and_only_those_regenerated(tmp_path, monkeypatch):
    """bf16 copy, 2-step preview of 2 prompts x 6 candidates: the regeneration (3 steps, float32) gets 2 rows per
    prompt, the best and the worst by preview reward of each prompt (several groups at once), and the update trains
    on the regenerated endpoints; the preview / fidelity statistics are logged."""
    monkeypatch.chdir(tmp_path)
    spy = _Spy(monkeypatch)
    scores = []
    real_select = preview_module.select_candidates
    monkeypatch.setattr(preview_module, "select_candidates",
                        lambda r, k, mode, generator=None, valid=None: scores.append(r.clone()) or real_select(
                            r, k, mode, generator, valid=valid))
    cli = _cli(["--trainer.max_steps=2", "--trainer.limit_val_batches=0"])
    cli.model.configure_model()
    before = _params(cli)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(spy.preview) == 2 and len(spy.regenerated) == 2
    for it in range(2):
        pv, rg = spy.preview[it], spy.regenerated[it]
        assert pv["steps"] == 2 and pv["dtype"] == torch.bfloat16 and len(pv["index"]) == 12
        assert len(rg["index"]) == 4 and set(rg["index"].tolist()) <= set(pv["index"].tolist())
        r = scores[it]  # [2 prompts, 6] preview rewards (pool order)
        for g in range(2):
            pool = pv["index"][6 * g: 6 * (g + 1)]
            kept = set(rg["index"][2 * g: 2 * (g + 1)].tolist())
            assert kept == {int(pool[int(r[g].argmax())]), int(pool[int(r[g].argmin())])}
    after = _params(cli)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    m = cli.trainer.logged_metrics
    for key in ("preview/reward", "preview/selected_reward", "preview/spearman", "preview/top_overlap",
                "preview/bottom_overlap", "preview/reward_gap", "preview/refresh_seconds", "preview/seconds",
                "train/loss", "reward/total"):
        assert key in m and math.isfinite(float(m[key])), key
    assert float(m["preview/max_weight_change"]) > 0  # the copy followed the trained old policy
    ro = cli.model.roles.get("rollout")
    assert ro.precision.format == "bf16" and not any(k.startswith("frozen.") for k in cli.model.state_dict())


def test_a_failed_preview_reward_is_never_kept(tmp_path, monkeypatch):
    """The preview reward of each prompt's first candidate fails (valid False, NaN): with keep 2 of 6, the kept rows
    are the best and the worst of the five valid candidates, never the failed one (issue 51's failed-reward
    invariant, through the method)."""
    import dataclasses

    monkeypatch.chdir(tmp_path)
    spy = _Spy(monkeypatch)
    cli = _cli(["--trainer.max_steps=1", "--trainer.limit_val_batches=0"])
    cli.model.configure_model()
    real_forward = type(cli.model.scorer).forward
    seen = []

    def failing_forward(self, pixels, prompts, *args, **kw):
        res = real_forward(self, pixels, prompts, *args, **kw)
        if len(prompts) == 12:  # the preview pool (2 prompts x 6); the regeneration scores 4
            valid, total = res.valid.clone(), res.total.clone()
            valid[[0, 6]], total[[0, 6]] = False, math.nan
            res = dataclasses.replace(res, valid=valid, total=total)
            seen.append(total.clone())
        return res

    monkeypatch.setattr(type(cli.model.scorer), "forward", failing_forward)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    pv, rg = spy.preview[0], spy.regenerated[0]
    for g in range(2):
        pool = pv["index"][6 * g: 6 * (g + 1)]
        r = seen[0][6 * g: 6 * (g + 1)]
        kept = set(rg["index"][2 * g: 2 * (g + 1)].tolist())
        assert int(pool[0]) not in kept
        valid_r = r[1:]
        assert kept == {int(pool[1 + int(valid_r.argmax())]), int(pool[1 + int(valid_r.argmin())])}


def test_a_regeneration_at_the_preview_precision_and_steps_reproduces_it_bitwise(tmp_path, monkeypatch):
    """fp32 copy, preview with the rollout's steps: the regenerated endpoints of the kept rows equal their previews
    bitwise (noise addressed by seed and sample index, whatever the batch), so the preview rewards are the
    regenerated ones: Spearman 1, full overlaps, zero reward gap."""
    monkeypatch.chdir(tmp_path)
    spy = _Spy(monkeypatch)
    cli = _cli(["--trainer.max_steps=3", "--trainer.limit_val_batches=0",
                "--model.init_args.preview.precision.format=fp32", "--model.init_args.preview.num_steps=3"])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    # iteration 2 too, where theta_old (which regenerates; d = 0.001 after iteration 1) differs from theta: the
    # copy was refreshed from theta_old
    for pv, rg in zip(spy.preview, spy.regenerated, strict=True):
        pos = {int(i): j for j, i in enumerate(pv["index"])}
        rows = torch.tensor([pos[int(i)] for i in rg["index"]])
        assert torch.equal(pv["final"][rows], rg["x0"])
    assert len(spy.preview) == 3
    m = cli.trainer.logged_metrics
    assert float(m["preview/reward_gap"]) == 0.0 and float(m["preview/spearman"]) == 1.0
    assert float(m["preview/top_overlap"]) == 1.0 and float(m["preview/bottom_overlap"]) == 1.0
    # a bf16 copy (the canary): the regeneration is not the preview
    spy2 = _Spy(monkeypatch)
    cli2 = _cli(["--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model.init_args.preview.num_steps=3"])
    cli2.trainer.fit(cli2.model, datamodule=cli2.datamodule)
    pos = {int(i): j for j, i in enumerate(spy2.preview[0]["index"])}
    rows = torch.tensor([pos[int(i)] for i in spy2.regenerated[0]["index"]])
    assert not torch.equal(spy2.preview[0]["final"][rows], spy2.regenerated[0]["x0"])


def test_sol_rl_resumes_exactly(tmp_path, monkeypatch):
    """The rollout copy is a function of the weights (refreshed before every preview), so a run resumed from its
    step-2 checkpoint ends where the uninterrupted one does."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _cli(["--trainer.max_steps=3", "--trainer.limit_val_batches=0"], run=True)
    monkeypatch.chdir(tmp_path / "b")
    _cli(["--trainer.max_steps=2", "--trainer.limit_val_batches=0"], run=True)
    resumed = _cli(["--trainer.max_steps=3", "--trainer.limit_val_batches=0", "--ckpt_path=last"], run=True)
    a, b = _params(full), _params(resumed)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), k


def test_grpo_takes_the_same_preview(tmp_path, monkeypatch):
    """GRPO composes the same two-stage collect: the SDE regeneration gets the kept rows only."""
    monkeypatch.chdir(tmp_path)
    seen = []
    real = grpo_module.collect_flat

    def spy(gen, prompts, latent_shape, seed, index, config, iteration, **kw):
        seen.append(index.clone())
        return real(gen, prompts, latent_shape, seed, index, config, iteration, **kw)

    monkeypatch.setattr(grpo_module, "collect_flat", spy)
    cli = _cli(["--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model=genrl.methods.GRPO",
                "--model.init_args.rollout.kernel=flow_grpo", "--model.init_args.rollout.num_steps=3",
                "--model.init_args.rollout.micro_batch_size=4", "--model.init_args.preview.keep=3",
                "--model.init_args.preview.selection=max_variance"])
    cli.model.configure_model()
    before = _params(cli)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert len(seen) == 1 and len(seen[0]) == 6  # 2 prompts x 3 kept of 6
    assert any(not torch.equal(before[k], v) for k, v in _params(cli).items())
    assert "preview/spearman" in cli.trainer.logged_metrics


def test_bad_previews_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="must be smaller than the candidate pool N"):
        cli = _cli(["--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model.init_args.preview.keep=6"])
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    with pytest.raises(ValueError, match="preview.keep"):
        PreviewConfig(keep=0)
    with pytest.raises(ValueError, match="selection"):
        PreviewConfig(selection="top")
    with pytest.raises(ValueError, match="groups of sizes"):
        preview_module._groups_of(torch.tensor([0, 0, 0, 1, 1]))


def test_preview_config_changes_only_steps_and_clips_the_sde_window():
    base = RolloutConfig(num_steps=10, kernel="flow_grpo", sde_steps="window", num_sde_steps=3, window_start=0,
                         window_end=7, micro_batch_size=8)
    cfg = preview_config(base, PreviewConfig(keep=2, num_steps=6, micro_batch_size=16))
    assert cfg.num_steps == 6 and cfg.window_end == 6 and cfg.micro_batch_size == 16 and cfg.kernel == "flow_grpo"
    same = preview_config(base, PreviewConfig(keep=2))
    assert vars(same) == vars(base)


def test_binary_preview_rewards_regenerate_distinct_candidates(tmp_path, monkeypatch):
    """Binary preview rewards through the real collect phase (2 prompts x a pool of 6, K = 4): an all-0 pool and a
    pool with a single 1 (column 2). The tie rule keeps the 2 worst first and the 2 best last of the stable order,
    so columns [0, 1, 4, 5] and [0, 1, 2, 5] are regenerated: 4 distinct candidates per prompt, the single 1 among
    them; the release's two topk calls may return one candidate twice here (docs/methods/sol_rl.md, Ties)."""
    monkeypatch.chdir(tmp_path)
    spy = _Spy(monkeypatch)
    real_select = preview_module.select_candidates
    binary = torch.tensor([[0.0] * 6, [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    monkeypatch.setattr(preview_module, "select_candidates",
                        lambda r, k, mode, generator=None, valid=None: real_select(binary, k, mode, generator))
    cli = _cli(["--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--model.init_args.preview.keep=4"])
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    pv, rg = spy.preview[0], spy.regenerated[0]
    for g, cols in enumerate(([0, 1, 4, 5], [0, 1, 2, 5])):
        pool = pv["index"][6 * g: 6 * (g + 1)]
        kept = rg["index"][4 * g: 4 * (g + 1)].tolist()
        assert kept == pool[cols].tolist() and len(set(kept)) == 4
