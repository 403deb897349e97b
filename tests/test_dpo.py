"""Online Diffusion-DPO (genrl.methods.DPO) through the real CLI on a tiny random policy: the loss at the reference,
the pair's shared noise, ties, the periodically refreshed reference, resume."""

from __future__ import annotations

import math

import pytest
import torch
from shapes_cli_util import fit_on_shapes_base, trainable

from genrl.cli import GenRLCLI
from genrl.rewards import RewardModel, register_reward


@register_reward("test_dpo_constant")
class _Constant(RewardModel):
    """Every sample ties: no group gives a pair under tie='skip'."""

    def score(self, pixels, prompts, **meta):
        return {"reward": torch.zeros(len(prompts))}


_METHOD = ["--model.init_args.rollout.num_steps=3", "--model.init_args.num_draws=2"]


def _fit(tiny_policy, tiny_text_encoder, args: list[str], run: bool = True) -> GenRLCLI:
    return fit_on_shapes_base("configs/dpo/shapes.yaml", tiny_policy, tiny_text_encoder, _METHOD + args, run)


_params = trainable


def test_first_loss_is_log2_and_resume_with_a_refreshed_reference_equals_uninterrupted(
        tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    one = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1"])
    m = one.trainer.logged_metrics
    # at the first update the policy is the reference: z = 0 for every pair, L = log 2 and half the pairs "correct"
    assert float(m["train/loss"]) == pytest.approx(math.log(2), rel=1e-6)
    assert float(m["train/z_mean"]) == 0.0 and float(m["pairs/count"]) == 2 and float(m["pairs/tied"]) == 0
    assert float(m["pairs/reward_margin"]) > 0

    refresh = ["--model.init_args.reference_update_every=2"]
    full = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=4", *refresh])
    after_full = _params(full)
    ref = full.model.reference_policy.tensors()
    monkeypatch.chdir(tmp_path / "b")
    first = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3", *refresh])
    after_three = _params(first)
    resumed = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=4", "--ckpt_path=last", *refresh])
    for k, v in _params(resumed).items():
        assert torch.allclose(after_full[k], v, atol=1e-6, rtol=0), k
    for k, v in resumed.model.reference_policy.tensors().items():  # the refreshed reference was checkpointed
        assert torch.allclose(ref[k], v, atol=1e-6, rtol=0), k
    changed = [k for k in after_full if not torch.equal(after_full[k], after_three[k])]
    assert len(changed) > len(after_full) // 2, "DPO steps did not change the policy"
    # the reference is refreshed after iterations 2 and 4: now a copy of the (trained) policy
    live = dict(full.model.generator.transformer.named_parameters())
    assert all(torch.equal(ref[k], live[k].detach()) for k in ref)


def test_identical_members_give_z_zero_after_training_and_ties_give_no_update(
        tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    cli = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2"])
    model = cli.model
    x = torch.randn(3, *model.latent_shape)
    cond = model.generator.encode_prompts(["a red circle"] * 6)
    # both members of a pair share (sigma, noise): identical members give z = 0 whatever the weights (trained here)
    loss, stats = model.pair_loss(x, x.clone(), torch.tensor([5, 6, 7]), cond, it=0, draw=1)
    torch.testing.assert_close(loss, torch.full((3,), math.log(2)), rtol=0, atol=1e-6)
    assert float(stats["z_mean"]) == 0.0
    # ... but two different members do not (the trained policy departs from the frozen base)
    loss2, _ = model.pair_loss(x, torch.randn_like(x), torch.tensor([5, 6, 7]), cond, it=0, draw=1)
    assert float((loss2 - math.log(2)).abs().max()) > 1e-6

    # all groups tied: no pair, the step counter advances (the run ends) with weights and optimizer state unchanged
    tied = _fit(tiny_policy, tiny_text_encoder, ["--model.init_args.rewards=[{name: test_dpo_constant}]",
                                                 "--trainer.max_steps=2"], run=False)
    tied.model.configure_model()
    start = _params(tied)
    tied.trainer.fit(tied.model, datamodule=tied.datamodule)
    m = tied.trainer.logged_metrics
    assert tied.trainer.global_step == 2 and int(tied.model.iteration) == 2
    assert float(m["pairs/count"]) == 0 and float(m["pairs/tied"]) == 2 and "train/loss" not in m
    assert all(torch.equal(start[k], v) for k, v in _params(tied).items())
    assert not tied.model.optimizers().optimizer.state  # AdamW never stepped a parameter
