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


def test_sliding_window_and_step_ratio_change_the_edges_trained(tmp_path, monkeypatch, tiny_policy,
                                                                tiny_text_encoder):
    """4 iterations, 2 trees of 4 steps split at {0, 2}: per tree 2, 2, 4, 4 edges into depths 1..4 (24 in all).
    The window [3, 4] slides every 2 iterations down to the last split step 2 (one move: shift = min(floor(s / 2),
    1), s the 1-based iteration) and pruning stops after floor(6 * 0.5) = 3 iterations: iteration 0 prunes depths
    3, 4 (16 edges: 8 trained), iterations 1 and 2 depths 2, 3 (12: 12 trained), iteration 3 nothing (24)."""
    from genrl.methods.branch_grpo import BranchGRPO

    monkeypatch.chdir(tmp_path)
    trained: list[float] = []
    real_log = BranchGRPO.log

    def spy(self, name, value, *args, **kwargs):
        if name == "tree/edges_trained":
            trained.append(float(value))
        return real_log(self, name, value, *args, **kwargs)

    monkeypatch.setattr(BranchGRPO, "log", spy)
    cli = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=4", "--model.init_args.prune_depths=[3,4]",
                                                "--model.init_args.prune_slide_interval=2",
                                                "--model.init_args.prune_step_ratio=0.5",
                                                "--model.init_args.prune_total_iterations=6"])
    assert trained == [8.0, 12.0, 12.0, 24.0]
    assert float(cli.trainer.logged_metrics["tree/edges"]) == 24
    assert [cli.model.pruning_at(i) for i in range(4)] == [([3, 4], 0.0), ([2, 3], 0.0), ([2, 3], 0.0), ([], 0.0)]


@pytest.mark.parametrize("args, match", [
    (["--model.init_args.prune_slide_interval=2"], "prune_depths is empty"),
    (["--model.init_args.prune_depths=[3]", "--model.init_args.prune_slide_stop_depth=1"],
     "prune_slide_interval is null"),
    (["--model.init_args.prune_depths=[2,3]", "--model.init_args.prune_slide_interval=2"],
     r"stop depth 2 for the window \[2, 3\]: it could never move"),
    (["--model.init_args.prune_step_ratio=0.5"], r"prune_total_iterations=None: a pruning step ratio 0.5 < 1 needs"),
])
def test_bad_pruning_schedules_are_refused_at_construction(tiny_policy, tiny_text_encoder, args, match):
    with pytest.raises(ValueError, match=match):
        _fit(tiny_policy, tiny_text_encoder, args, run=False)
