"""CRD (genrl.methods.CRD) through the real CLI on a tiny random policy: the first iteration in closed form (mse and
bce), the centre over the whole batch (micro-batch invariance, a constant shift), each option, the snapshots'
schedules, resume with both snapshots checkpointed, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from shapes_cli_util import fit_on_shapes_base, trainable

import genrl.methods.crd as crd_module
from genrl.cli import GenRLCLI
from genrl.flow.fm_core import sample_mse

_METHOD = ["--model.init_args.rollout.num_steps=4", "--model.init_args.num_timesteps=2",
           "--model.init_args.micro_batch_size=4"]


def _fit(tiny_policy, tiny_text_encoder, args: list[str], run: bool = True) -> GenRLCLI:
    return fit_on_shapes_base("configs/crd/shapes.yaml", tiny_policy, tiny_text_encoder, _METHOD + args, run)


_params = trainable


def _unit(adv: torch.Tensor) -> torch.Tensor:
    return adv.double().clamp(-5, 5) / 10 + 0.5


@pytest.mark.parametrize("loss_type", ["mse", "bce"])
def test_first_iteration_in_closed_form(loss_type, tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    """theta = old at the first optimizer step, so r_theta = 0 for every sample (also with the adaptive scale) and
    theta = reference (KL 0): mse logs (c / beta) mean_i (a_i - mean a)^2 of the advantages the method computed,
    bce (c / beta) log 2 (every logit is 0). The second step (theta moved) is no longer at r_theta = 0."""
    seen = []
    real = crd_module.group_advantages_of

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(crd_module, "group_advantages_of", spy)
    monkeypatch.chdir(tmp_path)
    cli = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2", "--model.init_args.beta=2.0",
                                                f"--model.init_args.loss_type={loss_type}"])
    m = cli.trainer.logged_metrics
    (adv,) = seen
    a = _unit(adv)
    assert float(a.std()) > 0.05  # a real batch of rewards (a constant one would make the mse check vacuous)
    want = 2.5 * (float(((a - a.mean()) ** 2).mean()) if loss_type == "mse" else math.log(2))
    assert float(m["train/loss/step0"]) == pytest.approx(want, rel=1e-5)
    assert float(m["train/r_theta_mean/step0"]) == 0.0 and float(m["train/kl/step0"]) == 0.0
    assert float(m["train/r_theta_mean/step1"]) != 0.0 and float(m["train/kl/step1"]) > 0
    # the snapshots after the first iteration (2 optimizer steps): old decay 0.25 + 0.005 x 2, sampling 0 (delay 75)
    assert float(m["train/old_decay"]) == pytest.approx(0.26) and float(m["train/sampling_decay"]) == 0.0
    live = dict(cli.model.generator.transformer.named_parameters())
    assert all(torch.equal(t, live[k].detach()) for k, t in cli.model.sampling_policy.tensors().items())


def test_resume_with_both_snapshots_equals_uninterrupted(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    args = ["--model.init_args.updates_per_iteration=1", "--model.init_args.sampling_decay_delay=1",
            "--model.init_args.sampling_decay_ramp=0.3"]
    lag = []  # per rollout: the largest gap between the weights that roll out and the live ones
    real = crd_module.collect_endpoints

    def spy(gen, *a, policy=None, **kw):
        live = {n: p.detach().clone() for n, p in gen.transformer.named_parameters()}
        with policy():
            lag.append(max(float((p - live[n]).abs().max()) for n, p in gen.transformer.named_parameters()))
        return real(gen, *a, policy=policy, **kw)

    monkeypatch.setattr(crd_module, "collect_endpoints", spy)
    monkeypatch.chdir(tmp_path / "a")
    full = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3", *args])
    # the sampling snapshot rolls out: the live weights until the delay (decays 0 at s = 1), lagged at the third
    assert lag[:2] == [0.0, 0.0] and lag[2] > 1e-4
    monkeypatch.setattr(crd_module, "collect_endpoints", real)
    after_full, old_full = _params(full), full.model.old_policy.tensors()
    sampling_full = full.model.sampling_policy.tensors()
    m = full.trainer.logged_metrics  # s = 3 optimizer steps: 0.25 + 0.015 and min(0.3 x (3 - 1), 0.999)
    assert float(m["train/old_decay"]) == pytest.approx(0.265)
    assert float(m["train/sampling_decay"]) == pytest.approx(0.6)
    monkeypatch.chdir(tmp_path / "b")
    first = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2", *args])
    after_two = _params(first)
    resumed = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=3", "--ckpt_path=last", *args])
    for k, v in _params(resumed).items():
        assert torch.allclose(after_full[k], v, atol=1e-6, rtol=0), k
    for mine, want in ((resumed.model.old_policy, old_full), (resumed.model.sampling_policy, sampling_full)):
        for k, v in mine.tensors().items():  # both snapshots were checkpointed
            assert torch.allclose(want[k], v, atol=1e-6, rtol=0), k
    changed = [k for k in after_full if not torch.equal(after_full[k], after_two[k])]
    assert len(changed) > len(after_full) // 2, "CRD steps did not change the policy"
    live = dict(resumed.model.generator.transformer.named_parameters())
    assert any(not torch.equal(t, live[k].detach()) for k, t in sampling_full.items())  # it lags the policy


def test_centre_over_the_batch_and_each_option(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    """After two updates theta differs from the old snapshot and the reference. The gathered implicit rewards and
    the loss do not depend on the micro-batching; a constant added to every r_theta changes nothing (a shifted
    centre alone does); the adaptive scale, the loss type and the reward-adaptive KL each change the loss, by the
    stated formulas."""
    monkeypatch.chdir(tmp_path)
    model = _fit(tiny_policy, tiny_text_encoder, ["--trainer.max_steps=2",
                                                  "--model.init_args.updates_per_iteration=1"]).model
    h = model.hparams
    x0 = torch.randn(6, *model.latent_shape)
    keys = torch.arange(6) + 40
    adv = torch.tensor([1.5, -0.5, -1.0, 0.2, 7.0, -7.2])
    cond = model.generator.encode_prompts(["a red circle"] * 3 + ["a blue square"] * 3)
    args = (0.6, 5, 1)
    whole = model.implicit_rewards(x0, keys, cond, [torch.arange(6)], *args)
    split = model.implicit_rewards(x0, keys, cond, [torch.tensor([i]) for i in range(6)], *args)
    # float32 rounding of other micro-batch shapes: differences of O(1) error ratios, 2.4e-7 seen (torch 2.14, AVX-512)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)
    e, v, u = model.errors(x0, keys, cond, *args, ("theta", "old_policy", "reference"))
    w = {k: (v[k] - u).abs().flatten(1).mean(1) for k in v}
    r = -(e["theta"] / w["theta"] - e["old_policy"] / w["old_policy"]).detach()
    torch.testing.assert_close(whole[:, 0], r, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(whole[:, 1:], torch.stack([e["old_policy"], w["old_policy"]], 1))
    assert float(r.abs().min()) > 1e-6  # the policy left the old snapshot: the checks below see r_theta

    def loss(terms=whole, centre=None, rows=None):
        rows = [torch.arange(6)] if rows is None else rows
        centre = (terms[:, 0], adv) if centre is None else centre
        return sum(float(model.unit_loss(x0[c], keys[c], adv[c], cond.select(c.tolist()), *args, terms[c],
                                         centre)[0]) * len(c) for c in rows) / 6

    base = loss()
    a, rd, kl = _unit(adv), r.double(), sample_mse(v["theta"], v["reference"]).double()
    k = 1e-4 + a * (h.kl_beta - 1e-4)
    fit = ((h.beta * (rd - rd.mean()) - (a - a.mean())) ** 2).mean()
    assert base == pytest.approx(float(h.adv_clip / h.beta * fit + (k * kl).mean()), rel=1e-4)
    assert loss(split, rows=[torch.tensor([i]) for i in range(6)]) == pytest.approx(base, rel=1e-5)
    shifted = whole.clone()
    shifted[:, 1] += 3.0 * shifted[:, 2]  # e_old + 3 w_old: every r_theta (rows and centre) + 3
    shifted[:, 0] += 3.0
    assert loss(shifted) == pytest.approx(base, rel=1e-5)
    assert abs(loss(centre=(whole[:, 0] + 0.01, adv)) - base) > 1e-3 * base  # the centre does enter
    # each option, by its formula
    h.reward_adaptive_kl = False
    assert loss() - base == pytest.approx(float(((h.kl_beta - k) * kl).mean()), rel=1e-3)
    h.reward_adaptive_kl, h.loss_type = True, "bce"
    assert abs(loss() - base) > 1e-3 * base
    h.loss_type, h.adaptive = "mse", False
    plain = model.implicit_rewards(x0, keys, cond, [torch.arange(6)], *args)
    torch.testing.assert_close(plain[:, 0], (e["old_policy"] - e["theta"]).detach(), rtol=1e-5, atol=1e-7)
    assert float((plain[:, 0] - whole[:, 0]).abs().max()) > 1e-4 and bool((plain[:, 2] == 1).all())


def test_sigmas_cycle_the_grid_and_bad_input(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    monkeypatch.chdir(tmp_path)
    model = _fit(tiny_policy, tiny_text_encoder, ["--model.init_args.num_timesteps=8"], run=False).model
    grid = model.rollout_config.sigmas()[:4].float()
    for it in range(5):
        s = model.sigmas(it)
        assert torch.equal(torch.sort(s).values, torch.sort(torch.cat([grid, grid])).values)  # each value twice
        assert torch.equal(s, model.sigmas(it))
    assert not torch.equal(model.sigmas(0), model.sigmas(1))
    for arg, match in [("beta=0", "beta must be a finite number > 0, got 0.0"),
                       ("weight_temp=0", "weight_temp 0.0 is not supported"),
                       ("old_decay_max=1.5", "'old_decay_max': 1.5"),
                       ("num_timesteps=3", "updates_per_iteration=2 must be >= 1 and divide the 3"),
                       ("trunc_steps=4", "trunc_steps=4"), ("kl_beta=-1", "kl_beta=-1.0")]:
        with pytest.raises(ValueError, match=match):
            _fit(tiny_policy, tiny_text_encoder, [f"--model.init_args.{arg}"], run=False)
    with pytest.raises(ValueError, match="unknown CRD mode 'l1'"):
        crd_module.CRD(loss_type="l1")
