"""BranchGRPO through the real CLI on a tiny random policy: training signal, edge counts, pruning, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs/branch_grpo/shapes.yaml")


def _fit(tiny_policy, tiny_text_encoder, args: list[str], run: bool = True) -> GenRLCLI:
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    base = ["--config", BASE, "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0",
            f"--model.init_args.generator.pretrained={tiny_policy}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
            "--model.init_args.rollout.num_steps=4", "--model.init_args.tree.split_steps=[0,2]",
            "--model.init_args.rollout.micro_batch_size=8", "--model.init_args.optimizer.init_args.lr=0.01",
            "--model.init_args.rewards=[{name: shapes}, {name: colorfulness}]"]
    return GenRLCLI(args=(["fit"] if run else []) + base + args, run=run)


def _params(cli) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}


def test_trains_counts_edges_and_resumes_exactly(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    full = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3"])
    after_full = _params(full)
    m = full.trainer.logged_metrics
    # 2 trees, 4 steps, splits {0, 2}: per tree 1 + 2 + 2 + 4 = 9 evaluations and 2 + 2 + 4 + 4 = 12 edges
    assert float(m["tree/denoiser_evals"]) == 18 and float(m["tree/edges"]) == 24 == float(m["tree/edges_trained"])
    assert float(m["train/ratio_mean"]) > 0
    monkeypatch.chdir(tmp_path / "b")
    first = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1"])
    after_one = _params(first)
    resumed = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3", "--ckpt_path=last"])
    for k, v in _params(resumed).items():
        assert torch.allclose(after_full[k], v, atol=1e-6, rtol=0), k
    changed = [k for k in after_full if not torch.equal(after_full[k], after_one[k])]
    assert len(changed) > len(after_full) // 2, "BranchGRPO steps did not change the policy"


def test_pruning_trains_fewer_edges_and_bad_input(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    cli = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1", "--model.init_args.width_ratio=0.5",
                                                "--model.init_args.prune_depths=[1]",
                                                "--model.init_args.rollout.num_steps=5"])
    m = cli.trainer.logged_metrics
    # 5 steps, splits {0, 2}: 2 + 2 + 4 + 4 + 4 = 16 edges per tree; depth 1 = the 2 root edges per tree; width:
    # the 4 chains after the last split have 2 edges each (steps 3, 4), half of each chain kept: 4 per tree dropped
    assert float(m["tree/edges"]) == 32 and float(m["tree/edges_trained"]) == 32 - 4 - 8
    # pruning acts on the gradient step only: the same iteration without pruning sampled the same trees and rewards
    plain = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1", "--model.init_args.rollout.num_steps=5"])
    p = plain.trainer.logged_metrics
    assert float(p["tree/edges_trained"]) == 32
    for key in ("reward/total", "reward/shapes/reward", "reward/colorfulness/reward", "tree/denoiser_evals"):
        assert float(p[key]) == float(m[key]), key
    with pytest.raises(ValueError, match="outside the schedule"):
        _fit(tiny_policy, tiny_text_encoder, ["--model.init_args.tree.split_steps=[0,7]"], run=False)
    with pytest.raises(ValueError, match="no edge to train"):
        _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1", "--model.init_args.prune_depths=[1,2,3,4]"])
