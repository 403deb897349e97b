"""Direction of learning: on a toy reward with a known better direction (brighter videos), a few training steps of
each RL method raise the reward of the policy's own deterministic samples. A sign error anywhere in the wiring
(advantages, loss, the old / reference policies) turns the change negative and fails here; "parameters changed" would
not. Also: the reward-weighted regression example (docs/new_method.md) trains 3 steps through ``genrl fit``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genrl.cli import GenRLCLI
from genrl.rewards import RewardModel, ScoreJudge, register_judge, register_reward
from genrl.rollout.sampler import RolloutConfig, rollout

ROOT = Path(__file__).resolve().parents[1]


@register_reward("test_brightness")
class _Brightness(RewardModel):
    """Mean pixel value: the better direction is known (brighter)."""

    def score(self, pixels, prompts, **meta):
        return {"reward": pixels.float().mean(dim=(1, 2, 3, 4))}


@register_judge("test_brightness")
class _BrightnessJudge(ScoreJudge):
    """The brighter of two samples wins (Pref-GRPO's win rates on the brightness toy reward)."""

    def scores(self, pixels, prompts):
        return pixels.float().mean(dim=(1, 2, 3, 4))


_TINY_DIT = ["--model.init_args.generator.components={}", "--model.init_args.rewards=[{name: test_brightness}]",
             "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
             "--trainer.enable_checkpointing=false", "--trainer.callbacks=[]"]

#: a 3-step ODE group sampler, 2 prompts x 4 per iteration (the methods composed after configs/base/shapes.yaml)
_TINY_ENDPOINTS = ["--model.init_args.rollout.num_steps=3", "--model.init_args.rollout.micro_batch_size=8",
                   "--data.init_args.prompts_per_batch=2", "--data.init_args.group_size=4"]

#: method -> (configs composed left to right, extra overrides, optimizer steps)
CASES = {
    "grpo": (["configs/quickstart.yaml", "configs/tiny/grpo.yaml"],
             ["--model.init_args.clip_range=0.2", "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    # GRPO's variants: the same tiny GRPO with another per-step loss, SDE window or reward
    "grpo_guard": (["configs/quickstart.yaml", "configs/tiny/grpo.yaml", "configs/grpo/shapes_guard.yaml"],
                   ["--model.init_args.clip_range=0.2", "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "flow_dppo": (["configs/quickstart.yaml", "configs/tiny/grpo.yaml", "configs/grpo/shapes_dppo.yaml"],
                  ["--model.init_args.mini_batch_size=4", "--model.init_args.policy_loss_args={max_divergence: 1.0}",
                   "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "mixgrpo": (["configs/quickstart.yaml", "configs/tiny/grpo.yaml", "configs/grpo/shapes_mixgrpo.yaml"],
                ["--model.init_args.rollout.window_iterations=1", "--model.init_args.clip_range=0.2",
                 "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "tempflow": (["configs/quickstart.yaml", "configs/tiny/grpo.yaml", "configs/grpo/shapes_tempflow.yaml"],
                 ["--model.init_args.clip_range=0.2", "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "pref_grpo": (["configs/quickstart.yaml", "configs/tiny/grpo.yaml", "configs/grpo/shapes_pref.yaml"],
                  ["--model.init_args.rewards=[{name: pairwise, judge: test_brightness}]",
                   "--model.init_args.clip_range=0.2", "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "branch_grpo": (["configs/branch_grpo/shapes.yaml"],
                    ["--model.init_args.rollout.num_steps=4", "--model.init_args.tree.split_steps=[0,2]",
                     "--model.init_args.rollout.micro_batch_size=8", "--model.init_args.clip_range=0.2",
                     "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "ram": (["configs/ram/shapes.yaml", "configs/tiny/ram.yaml"],
            ["--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "nft": (["configs/ram/shapes.yaml", "configs/ram/nft_shapes.yaml", "configs/tiny/ram.yaml"],
            ["--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "awm": (["configs/ram/shapes.yaml", "configs/ram/awm_shapes.yaml", "configs/tiny/ram.yaml"],
            ["--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "dgpo": (["configs/base/shapes.yaml", "configs/dgpo/shapes.yaml"], _TINY_ENDPOINTS
             + ["--model.init_args.trunc_steps=null", "--model.init_args.num_timesteps=2",
                "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "crd": (["configs/base/shapes.yaml", "configs/crd/shapes.yaml"], _TINY_ENDPOINTS
            + ["--model.init_args.num_timesteps=2", "--model.init_args.updates_per_iteration=1",
               "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "dpo": (["configs/base/shapes.yaml", "configs/dpo/shapes.yaml"], _TINY_ENDPOINTS
            + ["--model.init_args.beta=1000", "--model.init_args.optimizer.init_args.lr=0.003"], 4),
    "rwr": (["configs/rwr/shapes.yaml", "configs/tiny/rwr.yaml"],
            ["--model.init_args.beta=3.0", "--model.init_args.optimizer.init_args.lr=0.003"], 4),
}

PROMPTS = ["a red circle moving left", "a blue square staying still", "a green triangle moving up",
           "a yellow circle moving right"] * 2


def _eval_reward(model) -> float:
    """Mean brightness of the policy's deterministic (ODE, 4-step) samples at fixed noise."""
    gen = model.generator
    gen.eval()
    with torch.no_grad():
        traj = rollout(gen, PROMPTS, model.latent_shape, 1234, torch.arange(len(PROMPTS)),
                       RolloutConfig(kernel="ode", num_steps=4, cfg_scale=1.0), record=False)
        value = float(gen.decode(traj.final).float().mean())
    gen.train()
    return value


@pytest.mark.parametrize("method", sorted(CASES))
def test_a_few_steps_raise_a_toy_reward(method, tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    configs, extra, steps = CASES[method]
    monkeypatch.chdir(tmp_path)
    args = [a for c in configs for a in ("--config", str(ROOT / c))] + _TINY_DIT + extra + [
        f"--model.init_args.generator.pretrained={tiny_policy}",
        f"--model.init_args.generator.text_encoder={tiny_text_encoder}",
        f"--trainer.max_steps={steps}"]
    cli = GenRLCLI(args=args, run=False)
    cli.model.configure_model()
    before = _eval_reward(cli.model)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    after = _eval_reward(cli.model)
    assert after > before + 1e-3, f"{method}: brightness {before:.4f} -> {after:.4f} did not rise"


def test_reward_weighted_regression_example_trains_through_genrl_fit(tmp_path, monkeypatch, tiny_text_encoder):
    from genrl.cli import main

    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", str(ROOT / "configs/rwr/shapes.yaml"), "--config", str(ROOT / "configs/tiny/rwr.yaml"),
          f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.enable_progress_bar=false"])
    ckpt = torch.load(tmp_path / "runs/rwr_shapes/checkpoints/last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 3 and int(ckpt["state_dict"]["iteration"]) == 3
    assert "scorer._extra_state" in ckpt["state_dict"]  # the reward manager's state travels in the state dict
