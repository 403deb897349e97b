"""DGPO (genrl.methods.DGPO) through the real CLI on a tiny random policy: the group weight at the reference, the
iteration's shared sigmas, the DSM clip against the fast EMA, resume."""

from __future__ import annotations

import pytest
import torch
from shapes_cli_util import fit_on_shapes_base, trainable

from genrl.cli import GenRLCLI

_METHOD = ["--model.init_args.rollout.num_steps=4", "--model.init_args.num_timesteps=2",
           "--model.init_args.trunc_steps=2", "--model.init_args.micro_batch_size=4"]


def _fit(tiny_policy, tiny_text_encoder, args: list[str], run: bool = True) -> GenRLCLI:
    return fit_on_shapes_base("configs/dgpo/shapes.yaml", tiny_policy, tiny_text_encoder, _METHOD + args, run)


_params = trainable


def test_first_weight_is_one_half_and_resume_with_the_fast_ema_equals_uninterrupted(
        tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    one = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=1"])
    m = one.trainer.logged_metrics
    # theta = reference at the first update: z_g = 0 for every group, so every sample's weight sigmoid(z) is 1/2;
    # the fast EMA equals the policy too (ratio 1), so nothing is clipped; the EMA's first decay is min(0.3, 0.001)
    assert float(m["train/weight"]) == 0.5 and float(m["train/clipfrac"]) == 0.0
    assert float(m["train/old_decay"]) == pytest.approx(0.001)

    full = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3"])
    after_full, old_full = _params(full), full.model.old_policy.tensors()
    mf = full.trainer.logged_metrics
    assert float(mf["train/weight"]) != 0.5  # the policy left the reference: the group logits moved
    monkeypatch.chdir(tmp_path / "b")
    first = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2"])
    after_two = _params(first)
    resumed = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3", "--ckpt_path=last"])
    for k, v in _params(resumed).items():
        assert torch.allclose(after_full[k], v, atol=1e-6, rtol=0), k
    for k, v in resumed.model.old_policy.tensors().items():  # the fast EMA was checkpointed
        assert torch.allclose(old_full[k], v, atol=1e-6, rtol=0), k
    changed = [k for k in after_full if not torch.equal(after_full[k], after_two[k])]
    assert len(changed) > len(after_full) // 2, "DGPO steps did not change the policy"


def test_sigmas_are_grid_values_without_replacement_and_bad_input(tmp_path, monkeypatch, tiny_policy,
                                                                  tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    model = _fit(tiny_policy, tiny_text_encoder, ["--model.init_args.num_timesteps=3"], run=False).model
    grid = model.rollout_config.sigmas()[:3].float()  # trunc_steps 2: the first 3 of the 4-step grid
    seen = set()
    for it in range(12):
        s = model.sigmas(it)
        assert len(set(s.tolist())) == 3 and all(bool((grid == v).any()) for v in s)  # distinct grid values
        assert torch.equal(s, model.sigmas(it))  # addressed by (seed, iteration)
        seen.add(tuple(s.tolist()))
    assert len(seen) > 1  # the draw changes with the iteration
    with pytest.raises(ValueError, match="num_timesteps=4 sigmas from the first trunc_steps"):
        _fit(tiny_policy, tiny_text_encoder, ["--model.init_args.num_timesteps=4"], run=False)
    with pytest.raises(ValueError, match="clip_range > 0"):
        _fit(tiny_policy, tiny_text_encoder, ["--model.init_args.clip_range=0"], run=False)


def test_group_logits_are_the_advantage_weighted_error_gaps_of_the_policy_over_the_reference(
        tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    """After two updates the policy is not the reference: z_g = (beta / K) sum_g A_i (e_theta,i - e_ref,i) from the
    method's own errors at the group's shared noise, in any micro-batching (chunks of 1 or of all)."""
    monkeypatch.chdir(tmp_path)
    model = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2"]).model
    x0 = torch.randn(6, *model.latent_shape)
    group = torch.tensor([3, 3, 3, 8, 8, 8])
    adv = torch.tensor([1.0, -0.5, -0.5, 0.2, 0.3, -0.5])
    cond = model.generator.encode_prompts(["a red circle"] * 3 + ["a blue square"] * 3)
    e, _ = model.errors(x0, group, cond, 0.6, 5, 1, ("theta", "reference"))
    d = (e["theta"] - e["reference"]).double()
    want = torch.cat([(100.0 / 3 * (adv[:3].double() * d[:3]).sum()).expand(3),
                      (100.0 / 3 * (adv[3:].double() * d[3:]).sum()).expand(3)])
    assert float(want.abs().min()) > 1e-4  # the policy left the reference: a real test of the sign and the sums
    for chunks in ([torch.arange(6)], [torch.tensor([i]) for i in range(6)]):
        z = model.group_logits(x0, group, adv, cond, chunks, group, 3, 0.6, 5, 1)
        torch.testing.assert_close(z.double(), want, rtol=1e-4, atol=1e-6)
    # the noise is the group's: two members with the same x0 have the same error, in different positions
    twin = x0.clone()
    twin[1] = twin[0]
    e2, _ = model.errors(twin, group, cond, 0.6, 5, 1, ("theta",))
    assert float(e2["theta"][0]) == float(e2["theta"][1])
