"""The per-step policy losses of genrl.flow.policy beside the clipped surrogate: GRPO-Guard and Flow-DPPO against
their closed forms in float64 on real Flow-GRPO SDE transitions, their invariants (objectives.md sections 2 and 5),
the registry's errors, and GRPO's ``policy_loss`` option through ``genrl fit``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from genrl.flow.policy import (
    POLICY_LOSSES,
    StepMoments,
    check_policy_loss,
    clipped_policy_loss,
    dppo_policy_loss,
    guard_log_ratio,
    guard_policy_loss,
    policy_loss,
    step_divergence,
)
from genrl.flow.sde import step_log_prob, step_mean_std

ROOT = Path(__file__).resolve().parents[1]
SIG, SIG_NEXT = 0.7, 0.6  # one Flow-GRPO step, |delta sigma| = 0.1


def _transition(b: int = 4, shift: float = 0.05, seed: int = 0, noise_level: float = 0.7):
    """A Flow-GRPO SDE step in float64: the rollout's velocity v_old, the current policy's v = v_old + shift * u
    (u fixed), the rollout's sample x' = mu_old + s xi. Returns (x, v_old, v (leaf with grad), sample, xi, s)."""
    g = torch.Generator().manual_seed(seed)
    shape = (b, 2, 3, 4, 4)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    v_old = torch.randn(shape, generator=g, dtype=torch.float64)
    v = (v_old + shift * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    mean_old, std = step_mean_std("flow_grpo", x, v_old, SIG, SIG_NEXT, noise_level)
    xi = torch.randn(shape, generator=g, dtype=torch.float64)
    return x, v_old, v, mean_old + std * xi, xi, std


def _log_probs_and_moments(x, v_old, v, sample, noise_level: float = 0.7):
    lp, mean, std = step_log_prob("flow_grpo", x, v, SIG, SIG_NEXT, sample, noise_level=noise_level)
    lp_old, mean_old, _ = step_log_prob("flow_grpo", x, v_old, SIG, SIG_NEXT, sample, noise_level=noise_level)
    s = float(std.flatten()[0])
    return lp, lp_old, StepMoments(mean, mean_old, s, SIG - SIG_NEXT)


# ------------------------------------------------------------------------------------------------ GRPO-Guard
def test_guard_log_ratio_is_the_noise_projection_of_the_mean_shift():
    """log r_G = s (log r + D) equals mean_j(xi_j d_j) to float64 rounding, and log r = mean(xi d) / s - D."""
    x, v_old, v, sample, xi, _ = _transition()
    lp, lp_old, mom = _log_probs_and_moments(x, v_old, v, sample)
    d = (mom.mean - mom.old_mean).detach()
    s = mom.std
    expected = (xi * d).flatten(1).mean(1)
    assert torch.allclose(guard_log_ratio(lp, lp_old, mom).detach(), expected, rtol=0, atol=1e-12)
    div = (d**2).flatten(1).mean(1) / (2 * s**2)
    assert torch.allclose(step_divergence(mom).detach(), div, rtol=1e-12, atol=0)
    assert torch.allclose((lp - lp_old).detach(), expected / s - div, rtol=0, atol=1e-12)


def test_guard_at_the_rollout_policy_is_one_with_s_times_the_gradient():
    """theta = theta_old: r_G = 1 exactly and grad(log r_G) = s grad(log r) (autograd through the velocity)."""
    x, v_old, _, sample, _, _ = _transition()
    v = v_old.clone().requires_grad_(True)
    lp, lp_old, mom = _log_probs_and_moments(x, v_old, v, sample)
    log_rg = guard_log_ratio(lp, lp_old, mom)
    assert torch.equal(log_rg.detach(), torch.zeros(4, dtype=torch.float64))
    (g_guard,) = torch.autograd.grad(log_rg.sum(), v, retain_graph=True)
    (g_raw,) = torch.autograd.grad((lp - lp_old).sum(), v)
    assert torch.allclose(g_guard, mom.std * g_raw, rtol=1e-10, atol=1e-15)
    assert g_raw.abs().max() > 0


def test_guard_removes_the_left_shift_over_the_rollout_noise():
    """Monte Carlo over xi at a fixed theta != theta_old: E[log r] = -D while E[log r_G] = 0 (8192 draws)."""
    x, v_old, v, _, _, _ = _transition(b=1, shift=0.2)
    mean_old, std = step_mean_std("flow_grpo", x, v_old, SIG, SIG_NEXT, 0.7)
    xi = torch.randn((8192, *x.shape[1:]), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sample = mean_old + std * xi
    n = len(xi)
    lp, lp_old, mom = _log_probs_and_moments(x.expand(n, -1, -1, -1, -1), v_old.expand(n, -1, -1, -1, -1),
                                             v.detach().expand(n, -1, -1, -1, -1), sample)
    raw, guard, div = (lp - lp_old), guard_log_ratio(lp, lp_old, mom), step_divergence(mom)
    assert float(div[0]) > 1e-3
    se_raw, se_guard = float(raw.std()) / math.sqrt(n), float(guard.std()) / math.sqrt(n)
    assert abs(float(raw.mean()) + float(div[0])) < 4 * se_raw
    assert abs(float(guard.mean())) < 4 * se_guard
    assert abs(float(raw.mean())) > 10 * se_raw  # the raw ratio's shift is real, not noise


def test_guard_stays_bounded_as_the_noise_vanishes():
    """At a fixed theta != theta_old, shrinking the SDE noise makes log r blow up like 1 / s^2 while log r_G stays
    O(|d|): noise level 0.7 -> 0.007 (s / 100)."""
    out = {}
    for level in (0.7, 0.007):
        x, v_old, v, sample, _, _ = _transition(b=2, noise_level=level)
        lp, lp_old, mom = _log_probs_and_moments(x, v_old, v, sample, noise_level=level)
        out[level] = (float((lp - lp_old).abs().max()), float(guard_log_ratio(lp, lp_old, mom).abs().max()))
    assert out[0.007][0] > 1000 * out[0.7][0]
    assert out[0.007][1] < 2 * out[0.7][1] + 1e-3


def test_guard_loss_clips_on_the_normalised_ratio_and_scales_by_the_step():
    """The loss is the clipped surrogate on r_G (no gradient for A > 0 with r_G > 1 + eps), and scale: step divides
    it by |delta sigma|."""
    lp = torch.tensor([0.3, 0.3, -0.3], dtype=torch.float64, requires_grad=True)
    lp_old = torch.zeros(3, dtype=torch.float64)
    mean = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    mom = StepMoments(mean, torch.zeros(3, 4, dtype=torch.float64), 0.5, 0.1)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss, stats = guard_policy_loss(lp, lp_old, adv, mom, clip_range=0.1)
    r_g = torch.exp(0.5 * lp.detach())  # D = 0: log r_G = s log r
    ref, _ = clipped_policy_loss(0.5 * lp.detach(), torch.zeros(3, dtype=torch.float64), adv, clip_range=0.1)
    assert torch.allclose(loss.detach(), ref, rtol=1e-14, atol=0)
    assert float(stats["ratio_mean"]) == pytest.approx(float(r_g.mean()), rel=1e-14)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad[0] == 0 and grad[1] != 0 and grad[2] != 0  # sample 0: A > 0, r_G = e^0.15 > 1.1: clipped
    scaled, _ = guard_policy_loss(lp, lp_old, adv, mom, clip_range=0.1, scale="step")
    assert torch.allclose(scaled.detach(), loss.detach() / 0.1, rtol=1e-14, atol=0)
    with pytest.raises(ValueError, match="scale"):
        guard_policy_loss(lp, lp_old, adv, mom, scale="batch")


# ------------------------------------------------------------------------------------------------ Flow-DPPO
def test_dppo_divergence_is_the_gaussian_kl_per_element_and_zero_at_the_rollout_policy():
    x, v_old, v, sample, _, _ = _transition()
    _, _, mom = _log_probs_and_moments(x, v_old, v, sample)
    p = torch.distributions.Normal(mom.mean.detach(), mom.std)
    q = torch.distributions.Normal(mom.old_mean, mom.std)
    kl = torch.distributions.kl_divergence(p, q).flatten(1).sum(1) / mom.mean[0].numel()
    assert torch.allclose(step_divergence(mom).detach(), kl, rtol=1e-12, atol=0)
    same = StepMoments(mom.old_mean.clone(), mom.old_mean, mom.std, mom.step)
    assert torch.equal(step_divergence(same), torch.zeros(4, dtype=torch.float64))


def test_dppo_masks_only_steps_that_leave_the_trust_region_and_move_away():
    """Samples: (A > 0, r > 1, D large) masked; (A < 0, r > 1, D large) corrective, kept; (A > 0, r > 1, D small)
    kept. A masked sample has zero gradient, a kept one -A grad r; epsilon = inf is the plain -A r."""
    lp = torch.tensor([0.2, 0.2, 0.2], dtype=torch.float64, requires_grad=True)
    lp_old = torch.zeros(3, dtype=torch.float64)
    d = torch.tensor([1.0, 1.0, 1e-4], dtype=torch.float64)[:, None].expand(3, 4)
    mom = StepMoments(d.clone().requires_grad_(True), torch.zeros(3, 4, dtype=torch.float64), 1.0, 0.1)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss, stats = dppo_policy_loss(lp, lp_old, adv, mom, max_divergence=1e-5)
    r = math.exp(0.2)
    assert loss.tolist() == pytest.approx([0.0, r, -r], rel=1e-14)
    assert float(stats["masked_frac"]) == pytest.approx(1 / 3)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    assert grad.tolist() == pytest.approx([0.0, r, -r], rel=1e-14)  # d(-A r)/d lp = -A r
    plain, stats_inf = dppo_policy_loss(lp, lp_old, adv, mom, max_divergence=math.inf)
    assert torch.allclose(plain.detach(), -adv * r, rtol=1e-14, atol=0) and float(stats_inf["masked_frac"]) == 0
    with pytest.raises(ValueError, match="max_divergence"):
        dppo_policy_loss(lp, lp_old, adv, mom, max_divergence=-1.0)


# ------------------------------------------------------------------------------------------------ the registry
def test_policy_loss_dispatches_and_names_bad_choices():
    lp = torch.tensor([0.01, -0.02], dtype=torch.float64)
    old, adv = torch.zeros(2, dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64)
    mom = StepMoments(torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64), 0.3, 0.1)
    assert set(POLICY_LOSSES) == {"clipped", "guard", "dppo"}
    assert [check_policy_loss(n) for n in ("clipped", "guard", "dppo")] == [False, True, True]
    a, _ = policy_loss("clipped", lp, old, adv, clip_range=0.05)
    assert torch.equal(a, clipped_policy_loss(lp, old, adv, clip_range=0.05)[0])
    b, _ = policy_loss("dppo", lp, old, adv, mom, clip_range=0.05, max_divergence=0.0)
    assert torch.equal(b, dppo_policy_loss(lp, old, adv, mom, max_divergence=0.0)[0])
    c, _ = policy_loss("guard", lp, old, adv, mom, clip_range=0.05, scale="step")
    assert torch.equal(c, guard_policy_loss(lp, old, adv, mom, clip_range=0.05, scale="step")[0])
    with pytest.raises(ValueError, match=r"unknown policy loss 'gspo'.*\['clipped', 'dppo', 'guard'\]"):
        check_policy_loss("gspo")
    with pytest.raises(ValueError, match=r"does not take the options \['max_divergence'\].*\['scale'\]"):
        check_policy_loss("guard", {"max_divergence": 1e-5})
    with pytest.raises(ValueError, match="record_moments"):
        policy_loss("guard", lp, old, adv)


# ------------------------------------------------------------------------------------------------ GRPO's option
def _fit(args: list[str], tiny_policy: str, tiny_text_encoder: str):
    from genrl.cli import GenRLCLI

    base = ["--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(ROOT / "configs/tiny/grpo.yaml"),
            "--trainer.enable_progress_bar=false", f"--model.init_args.generator.pretrained={tiny_policy}",
            "--model.init_args.generator.components={}",
            f"--model.init_args.generator.text_encoder={tiny_text_encoder}", "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0"]
    return GenRLCLI(args=["fit", *base, *args], run=True)


def test_grpo_policy_loss_option_changes_the_update(tmp_path, monkeypatch, tiny_policy, tiny_text_encoder):
    """One on-policy GRPO iteration: Flow-DPPO with no trust region (epsilon = inf) is -A r, whose gradient at r = 1
    equals the clipped surrogate's, so the weights match exactly; GRPO-Guard's gradient is s x that per step, so
    they differ; guard records the moments and logs its divergence (0 on-policy); a bad option fails at parse."""
    weights, metrics = {}, {}
    for name, extra in (("clipped", []), ("dppo", ["--model.init_args.policy_loss=dppo",
                                                    "--model.init_args.policy_loss_args={max_divergence: .inf}"]),
                        ("guard", ["--model.init_args.policy_loss=guard"])):
        (tmp_path / name).mkdir()
        monkeypatch.chdir(tmp_path / name)
        cli = _fit(extra, tiny_policy, tiny_text_encoder)
        weights[name] = {n: p.detach().clone() for n, p in cli.model.generator.transformer.named_parameters()}
        metrics[name] = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    for n in weights["clipped"]:
        assert torch.allclose(weights["clipped"][n], weights["dppo"][n], rtol=1e-5, atol=1e-7), n
    assert any(not torch.allclose(weights["clipped"][n], weights["guard"][n], rtol=1e-4, atol=1e-6)
               for n in weights["clipped"])
    assert metrics["guard"]["train/ratio_mean"] == 1.0 and metrics["guard"]["train/divergence"] == 0.0
    assert metrics["dppo"]["train/masked_frac"] == 0.0
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not take the options"):
        _fit(["--model.init_args.policy_loss=dppo", "--model.init_args.policy_loss_args={scale: step}"],
             tiny_policy, tiny_text_encoder)
