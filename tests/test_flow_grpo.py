"""Tests of genrl.flow SDE step kernels and GRPO objective pieces (docs/methods/grpo.md, Invariants tested)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from genrl.flow import (
    STEP_KINDS,
    RunningMeanStd,
    StepOutput,
    clipped_policy_loss,
    diffusion_coefficient,
    euler_step,
    gaussian_kl,
    gaussian_log_prob,
    group_advantages,
    group_stats,
    kl_penalty,
    normalize_rewards,
    sde_step,
    sigma_schedule,
    step_log_prob,
    step_mean_std,
    velocity_kl,
)

F64 = torch.float64
SDE_KINDS = (("flow_grpo", 0.7), ("dance_grpo", 0.3))
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype)


# ----------------------------------------------------------------------------------------------
# kernels: ODE limit, equivalent drift forms, broadcasting, dtypes


@pytest.mark.parametrize("kind,level", SDE_KINDS)
def test_zero_noise_sde_step_is_the_euler_step(kind, level):
    x, v = _randn(3, 2, 4, 5, seed=1), _randn(3, 2, 4, 5, seed=2)
    sigma, sigma_next = torch.tensor([0.9, 0.5, 0.2], dtype=F64), torch.tensor([0.8, 0.3, 0.0], dtype=F64)
    euler = euler_step(x, v, sigma, sigma_next)
    mean, std = step_mean_std(kind, x, v, sigma, sigma_next, noise_level=0.0)
    assert torch.equal(mean, euler)
    assert torch.equal(std, torch.zeros_like(std))
    out = sde_step(kind, x, v, sigma, sigma_next, _randn(3, 2, 4, 5, seed=3), noise_level=0.0)
    assert isinstance(out, StepOutput)
    assert torch.equal(out.sample, euler) and torch.equal(out.log_prob, torch.zeros(3, dtype=F64))
    # the "ode" kind: same, noise not needed
    out_ode = sde_step("ode", x, v, sigma, sigma_next, None)
    assert torch.equal(out_ode.sample, euler) and torch.equal(out_ode.log_prob, torch.zeros(3, dtype=F64))
    # the stochastic formula is continuous at noise 0 (the g^2 term vanishes, no shortcut involved)
    mean_tiny, std_tiny = step_mean_std(kind, x, v, sigma, sigma_next, noise_level=1e-9)
    assert (mean_tiny - euler).abs().max() < 1e-15
    assert 0 < float(std_tiny.max()) < 1e-9


def test_dance_score_form_and_flow_grpo_closed_form_equal_our_mean():
    x, v = _randn(4, 6, seed=4), _randn(4, 6, seed=5)
    s = torch.tensor([0.97, 0.6, 0.3, 0.05], dtype=F64)
    s_next = torch.tensor([0.9, 0.45, 0.2, 0.0], dtype=F64)
    sc, sn = s[:, None], s_next[:, None]
    d = sn - sc
    # DanceGRPO's score form: x + d v - 1/2 eta^2 score d, score = -(x - (1 - s) x0_hat) / s^2
    eta = 0.3
    x0_hat = x - sc * v
    score = -(x - (1 - sc) * x0_hat) / sc**2
    dance = x + d * v - 0.5 * eta**2 * score * d
    mean, std = step_mean_std("dance_grpo", x, v, s, s_next, noise_level=eta)
    assert torch.allclose(mean, dance, rtol=0, atol=1e-14)
    assert torch.allclose(std, eta * d.abs().sqrt(), rtol=0, atol=1e-15)
    # Flow-GRPO's closed form: x (1 + g^2 d / (2 s)) + v (1 + g^2 (1 - s) / (2 s)) d, g^2 = a^2 s / (1 - s)
    a = 0.7
    g2 = a**2 * sc / (1 - sc)
    flow = x * (1 + g2 * d / (2 * sc)) + v * (1 + g2 * (1 - sc) / (2 * sc)) * d
    mean, std = step_mean_std("flow_grpo", x, v, s, s_next, noise_level=a)
    assert torch.allclose(mean, flow, rtol=1e-13, atol=1e-13)
    assert torch.allclose(std, (g2 * d.abs()).sqrt(), rtol=1e-14, atol=0)


def test_flow_grpo_at_sigma_one_uses_sigma_at_one():
    sig = sigma_schedule(10, shift=3.0)
    s0, s1 = float(sig[0]), float(sig[1])
    assert s0 == 1.0 and s1 < 1.0
    g = diffusion_coefficient("flow_grpo", torch.tensor([1.0, s1], dtype=F64), 0.7, sigma_at_one=s1)
    # both entries use the same denominator 1 - s1
    assert torch.allclose(g, 0.7 * torch.sqrt(torch.tensor([1.0, s1], dtype=F64) / (1 - s1)), rtol=1e-15, atol=0)
    x, v = _randn(2, 8, seed=6), _randn(2, 8, seed=7)
    mean, std = step_mean_std("flow_grpo", x, v, s0, s1, noise_level=0.7, sigma_at_one=s1)
    assert bool(torch.isfinite(mean).all()) and bool(torch.isfinite(std).all())
    g2 = 0.7**2 / (1 - s1)
    d = s1 - 1.0
    expected = x * (1 + g2 * d / 2) + v * d  # (1 - sigma) = 0 at sigma = 1
    assert torch.allclose(mean, expected, rtol=0, atol=1e-13)
    assert float(std) == pytest.approx(math.sqrt(g2 * abs(d)), rel=1e-14)
    # sigma = 0: g = 0; the ODE: g = 0 everywhere; Dance: constant
    assert float(diffusion_coefficient("flow_grpo", 0.0, 0.7)) == 0.0
    assert torch.equal(diffusion_coefficient("ode", torch.tensor([0.3, 1.0]), 0.7), torch.zeros(2))
    assert torch.equal(diffusion_coefficient("dance_grpo", torch.tensor([0.3, 1.0]), 0.3), torch.full((2,), 0.3))


def test_per_frame_sigma_and_wan_layout():
    B, T, C, H, W = 2, 3, 2, 2, 2
    x, v = _randn(B, T, C, H, W, seed=8), _randn(B, T, C, H, W, seed=9)
    s = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.5, 0.2]], dtype=F64)
    sn = s - 0.1
    mean, std = step_mean_std("dance_grpo", x, v, s, sn, noise_level=0.3)
    assert mean.shape == x.shape and std.shape == (B, T, 1, 1, 1)
    for b in range(B):
        for t in range(T):
            m1, s1 = step_mean_std("dance_grpo", x[b : b + 1, t], v[b : b + 1, t], float(s[b, t]), float(sn[b, t]), 0.3)
            assert torch.allclose(mean[b, t], m1[0], rtol=0, atol=1e-15)
            assert float(std[b, t]) == pytest.approx(float(s1), rel=1e-15)
    # Wan's [B, C, T, H, W] with frame_dim=2 gives the permuted result
    xw, vw = x.permute(0, 2, 1, 3, 4), v.permute(0, 2, 1, 3, 4)
    mean_w, _ = step_mean_std("dance_grpo", xw, vw, s, sn, noise_level=0.3, frame_dim=2)
    assert torch.allclose(mean_w, mean.permute(0, 2, 1, 3, 4), rtol=0, atol=1e-15)


def test_dtypes_float32_by_default_float64_kept():
    x = torch.randn(2, 4, generator=_gen(10))
    v = torch.randn(2, 4, generator=_gen(11)).to(torch.bfloat16)
    noise = torch.randn(2, 4, generator=_gen(12))
    out = sde_step("flow_grpo", x, v, 0.5, 0.4, noise)
    assert out.sample.dtype == out.mean.dtype == out.std.dtype == out.log_prob.dtype == torch.float32
    assert out.log_prob.shape == (2,)
    out64 = sde_step("flow_grpo", x.double(), v, 0.5, 0.4, noise)
    assert out64.log_prob.dtype == F64


# ----------------------------------------------------------------------------------------------
# log-probabilities


def test_log_prob_is_the_closed_form_gaussian_density():
    B, D = 3, 16
    x, v, noise = _randn(B, D, seed=13), _randn(B, D, seed=14), _randn(B, D, seed=15)
    s, sn = torch.tensor([0.8, 0.5, 0.3], dtype=F64), torch.tensor([0.7, 0.35, 0.1], dtype=F64)
    out = sde_step("flow_grpo", x, v, s, sn, noise, noise_level=0.7)
    std = out.std.reshape(B, 1)
    # sample = mean + std * noise
    assert torch.allclose(out.sample, out.mean + std * noise, rtol=0, atol=1e-15)
    # an independent implementation of the density (torch.distributions), mean over elements
    ref = torch.distributions.Normal(out.mean, std.expand(B, D)).log_prob(out.sample).mean(dim=1)
    assert torch.allclose(out.log_prob, ref, rtol=0, atol=1e-13)
    # by hand: -noise^2/2 - log s - 1/2 log 2 pi, averaged
    by_hand = (-(noise**2) / 2).mean(dim=1) - torch.log(std[:, 0]) - HALF_LOG_2PI
    assert torch.allclose(out.log_prob, by_hand, rtol=0, atol=1e-13)
    # the true log-density is the sum (= D x mean)
    lp_sum = gaussian_log_prob(out.sample, out.mean, out.std, reduce="sum")
    assert torch.allclose(lp_sum, D * out.log_prob, rtol=1e-14, atol=0)


def test_expected_log_prob_over_many_draws():
    B, D, s = 2000, 64, 0.05
    mean = _randn(B, D, seed=16)
    sample = mean + s * _randn(B, D, seed=17)
    lp = gaussian_log_prob(sample, mean, s)
    expected = -0.5 - math.log(s) - HALF_LOG_2PI
    se = math.sqrt(0.5 / (D * B))  # Var(z^2 / 2) = 1/2 per element
    assert abs(float(lp.mean()) - expected) < 5 * se
    # and the per-sample spread is the chi-square one
    assert float(lp.var()) == pytest.approx(0.5 / D, rel=0.1)


@pytest.mark.parametrize("kind,level", SDE_KINDS)
def test_recomputed_log_prob_is_bitwise_equal_ratio_exactly_one(kind, level):
    B, T, C = 3, 2, 4
    x = torch.randn(B, T, C, 2, 2, generator=_gen(18))  # float32, the production dtype
    W = torch.randn(C, C, generator=_gen(19)) * 0.3
    s = torch.tensor([[1.0, 0.9], [0.9, 0.8], [0.5, 0.5]])
    sn = s - 0.05
    noise = torch.randn(x.shape, generator=_gen(20))

    def velocity(w: torch.Tensor) -> torch.Tensor:
        return torch.einsum("btchw,dc->btdhw", x, w)

    with torch.no_grad():
        out = sde_step(kind, x, velocity(W), s, sn, noise, level, sigma_at_one=0.95)
    Wg = W.clone().requires_grad_(True)
    lp, mean, std = step_log_prob(kind, x, velocity(Wg), s, sn, out.sample, level, sigma_at_one=0.95)
    assert lp.requires_grad and lp.dtype == torch.float32
    assert torch.equal(lp, out.log_prob) and torch.equal(mean.detach(), out.mean) and torch.equal(std, out.std)
    assert torch.equal(torch.exp(lp - out.log_prob), torch.ones(B))
    # a sub-batch recomputation gives the same values (the kernel is elementwise per sample)
    lp_sub, _, _ = step_log_prob(kind, x[1:], velocity(W)[1:], s[1:], sn[1:], out.sample[1:], level, sigma_at_one=0.95)
    assert torch.equal(lp_sub, out.log_prob[1:])
    # a changed velocity changes the log-prob
    lp2, _, _ = step_log_prob(kind, x, velocity(W * 1.01), s, sn, out.sample, level, sigma_at_one=0.95)
    assert not torch.equal(lp2, out.log_prob)


# ----------------------------------------------------------------------------------------------
# marginal preservation on Gaussian data (sign / convention test)

M, C = 1.5, 0.5  # data x0 ~ N(M, C^2)


def _exact_velocity(x: torch.Tensor, s: float) -> torch.Tensor:
    """E[eps - x0 | x_s] for x0 ~ N(M, C^2), eps ~ N(0, 1), x_s = (1 - s) x0 + s eps."""
    var = (1 - s) ** 2 * C**2 + s**2
    y = x - (1 - s) * M
    return s * y / var - (M + (1 - s) * C**2 * y / var)


def _simulate(kind: str, level: float, steps: int, n: int, wrong_sign: bool = False, seed: int = 0):
    """Run the kernel from sigma = 1 with the exact velocity; record (mean, var) after each step."""
    g = _gen(seed)
    sig = sigma_schedule(steps)
    s1 = float(sig[1])
    x = torch.randn(n, generator=g, dtype=F64)
    x = (x - x.mean()) / x.std(correction=0)  # exact N(0, 1) moments at sigma = 1: only the kernel's error remains
    moments = {}
    for i in range(steps):
        s, sn = float(sig[i]), float(sig[i + 1])
        v = _exact_velocity(x, s)
        noise = torch.randn(n, generator=g, dtype=F64)
        if wrong_sign:  # flip the sign of the g^2 / (2 sigma) eps_hat term of the drift
            mean, std = step_mean_std(kind, x, v, s, sn, level, s1)
            x = 2 * (x + (sn - s) * v) - mean + std * noise
        else:
            x = sde_step(kind, x, v, s, sn, noise, level, s1).sample
        moments[round(sn, 6)] = (float(x.mean()), float(x.var(correction=0)))
    return moments, x


CHECK_SIGMAS = (0.75, 0.5, 0.25, 0.0)
N_PATHS = 32000  # below torch's 32768-element parallel grain: stays fast on a busy 2-core machine
# Tolerances. MC standard errors at n = 32000: mean <= 0.004, relative variance 0.008. Euler-Maruyama
# bias at 200 steps: flow_grpo's relative variance error is 3-4% at sigma = 0.75 (g^2 is large near
# sigma = 1) and shrinks with the step count; Euler's is 1.5% at sigma = 0.
MEAN_TOL = 0.015  # |empirical mean - (1 - sigma) M|
VAR_RTOL = 0.06  # |empirical var / ((1 - sigma)^2 C^2 + sigma^2) - 1| at sigma = 0.75, 0.5, 0.25
FINAL_VAR_RTOL = 0.03  # the same at sigma = 0 (the data distribution N(M, C^2))
KS_TOL = 0.015  # sup |F_empirical - F_exact| at sigma = 0 (1.63 / sqrt(n) = 0.009 at alpha = 1%)


def _marginal_errors(moments):
    errs = []
    for s in CHECK_SIGMAS:
        mu, var = moments[s]
        errs.append((abs(mu - (1 - s) * M), abs(var / ((1 - s) ** 2 * C**2 + s**2) - 1)))
    return errs


def _ks_to_data(x: torch.Tensor) -> float:
    xs, _ = torch.sort(x)
    n = xs.numel()
    cdf = torch.special.ndtr((xs - M) / C)
    hi = torch.arange(1, n + 1, dtype=F64) / n
    lo = torch.arange(0, n, dtype=F64) / n
    return float(torch.maximum(hi - cdf, cdf - lo).max())


@pytest.mark.parametrize("kind,level", SDE_KINDS + (("ode", 0.0),))
def test_sde_preserves_the_marginals_of_gaussian_data(kind, level):
    moments, x = _simulate(kind, level, steps=200, n=N_PATHS)
    errs = _marginal_errors(moments)
    for s, (e_mean, e_var) in zip(CHECK_SIGMAS, errs):
        assert e_mean < MEAN_TOL, (kind, s, e_mean)
        assert e_var < (FINAL_VAR_RTOL if s == 0.0 else VAR_RTOL), (kind, s, e_var)
    # the final distribution is N(M, C^2)
    assert abs(float(x.mean()) - M) < MEAN_TOL and abs(float(x.var()) / C**2 - 1) < FINAL_VAR_RTOL
    assert _ks_to_data(x) < KS_TOL
    if kind != "ode":
        # the same check fails with the wrong sign on the g^2 term
        bad_moments, bad_x = _simulate(kind, level, steps=200, n=N_PATHS, wrong_sign=True)
        bad = _marginal_errors(bad_moments)
        assert max(e_var for _, e_var in bad) > 5 * VAR_RTOL
        assert abs(float(bad_x.var()) / C**2 - 1) > 0.4
        assert _ks_to_data(bad_x) > 2 * KS_TOL


def test_flow_grpo_discretisation_error_shrinks_with_steps():
    err = {}
    for steps in (20, 400):
        moments, _ = _simulate("flow_grpo", 0.7, steps=steps, n=N_PATHS, seed=1)
        err[steps] = _marginal_errors(moments)[0][1]  # relative variance error at sigma = 0.75
    assert err[20] > 0.08  # a visible Euler-Maruyama bias at 20 steps ...
    assert err[400] < 0.5 * err[20]  # ... that shrinks with the step count


# ----------------------------------------------------------------------------------------------
# clipped policy loss


def test_clipped_loss_gradient_at_ratio_one_is_the_policy_gradient():
    B, D = 4, 8
    x = _randn(B, D, seed=21)
    W0 = _randn(D, D, seed=22) * 0.2
    s, sn = 0.7, 0.6
    noise = _randn(B, D, seed=23)
    with torch.no_grad():
        old = sde_step("flow_grpo", x, x @ W0.T, s, sn, noise)
    adv = torch.tensor([1.5, -0.5, 7.0, -9.0], dtype=F64)  # the last two are clamped to +-5
    adv_hat = adv.clamp(-5, 5)

    def lp_of(w: torch.Tensor) -> torch.Tensor:
        return step_log_prob("flow_grpo", x, x @ w.T, s, sn, old.sample)[0]

    W = W0.clone().requires_grad_(True)
    lp = lp_of(W)
    loss, stats = clipped_policy_loss(lp, old.log_prob, adv)
    assert torch.equal(loss, -adv_hat)  # r = 1 exactly, A_hat bounded by adv_clip_max
    (grad,) = torch.autograd.grad(loss.sum(), W)
    W2 = W0.clone().requires_grad_(True)
    (grad_pg,) = torch.autograd.grad((-adv_hat * lp_of(W2)).sum(), W2)
    assert float(grad.abs().max()) > 1e-3
    assert torch.allclose(grad, grad_pg, rtol=1e-12, atol=0)
    # and against finite differences of the loss (ratio stays inside the clip range for these h)
    h = 1e-6
    for i, j in ((0, 0), (2, 5), (7, 3)):
        e = torch.zeros(D, D, dtype=F64)
        e[i, j] = h
        with torch.no_grad():
            lp_p, lp_m = lp_of(W0 + e), lp_of(W0 - e)
            fp = clipped_policy_loss(lp_p, old.log_prob, adv, clip_range=0.2)[0].sum()
            fm = clipped_policy_loss(lp_m, old.log_prob, adv, clip_range=0.2)[0].sum()
        assert float((fp - fm) / (2 * h)) == pytest.approx(float(grad[i, j]), rel=1e-5, abs=1e-9)
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["ratio_std"]) == 0.0
    assert float(stats["approx_kl"]) == 0.0 and float(stats["clipfrac"]) == 0.0
    assert float(stats["adv_abs_mean"]) == pytest.approx((1.5 + 0.5 + 5 + 5) / 4)


def test_clipped_loss_gradient_is_zero_only_on_the_clipped_side():
    eps = 1e-4
    old = torch.zeros(4, dtype=F64)
    # r > 1 + eps for the first two, r < 1 - eps for the last two
    lp = torch.tensor([1e-3, 1e-3, -1e-3, -1e-3], dtype=F64, requires_grad=True)
    adv = torch.tensor([2.0, -2.0, -2.0, 2.0], dtype=F64)
    loss, stats = clipped_policy_loss(lp, old, adv, clip_range=eps)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    r = torch.exp(lp.detach())
    # clipped: (r > 1 + eps, A > 0) and (r < 1 - eps, A < 0) -> 0; unclipped side -> -A r
    expected = torch.tensor([0.0, 2.0 * float(r[1]), 0.0, -2.0 * float(r[3])], dtype=F64)
    assert torch.allclose(g, expected, rtol=1e-15, atol=0)
    assert float(loss.detach()[0]) == pytest.approx(-2.0 * (1 + eps), rel=1e-15)
    assert float(loss.detach()[2]) == pytest.approx(2.0 * (1 - eps), rel=1e-15)
    assert float(stats["clipfrac"]) == 1.0
    assert float(stats["clipfrac_high"]) == 0.5 and float(stats["clipfrac_low"]) == 0.5
    assert float(stats["approx_kl"]) == pytest.approx(0.5e-6, rel=1e-12)
    assert float(stats["ratio_mean"]) == pytest.approx(float(r.mean()), rel=1e-15)
    assert float(stats["ratio_std"]) == pytest.approx(float(r.std(correction=0)), rel=1e-12)
    # asymmetric range: a wider upper range unclips the first sample
    loss_h, stats_h = clipped_policy_loss(lp, old, adv, clip_range=eps, clip_range_high=1e-2)
    (g_h,) = torch.autograd.grad(loss_h.sum(), lp)
    assert float(g_h[0]) == pytest.approx(-2.0 * float(r[0]), rel=1e-15)
    assert float(stats_h["clipfrac_high"]) == 0.0 and float(stats_h["clipfrac_low"]) == 0.5
    # B = 1: ratio_std is 0, not NaN
    _, st1 = clipped_policy_loss(lp[:1], old[:1], adv[:1])
    assert float(st1["ratio_std"]) == 0.0


def test_constant_reward_group_gives_zero_gradient():
    # 0.1 three times: the float mean is 0.10000000000000002, so only the explicit zeroing gives exact 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.9], dtype=F64)
    groups = torch.tensor([0, 0, 0, 1, 1])
    assert float(rewards[:3].mean()) != 0.1
    for eps in (1e-4, 0.0):
        for std in ("group", "global", "none"):
            adv = group_advantages(rewards, groups, std=std, eps=eps)
            assert torch.equal(adv[:3], torch.zeros(3, dtype=F64)), (std, eps)
            assert bool((adv[3:] != 0).all())
    adv = group_advantages(rewards, groups)
    lp = torch.tensor([0.01, -0.02, 0.0, 0.0, 0.0], dtype=F64, requires_grad=True)
    loss, _ = clipped_policy_loss(lp, torch.zeros(5, dtype=F64), adv, clip_range=0.5)
    (g,) = torch.autograd.grad(loss.sum(), lp)
    assert torch.equal(g[:3], torch.zeros(3, dtype=F64))
    assert bool((g[3:] != 0).all())


# ----------------------------------------------------------------------------------------------
# KL penalties


def test_gaussian_and_velocity_kl_by_hand():
    B, D = 3, 10
    mu, mu_ref = _randn(B, D, seed=24), _randn(B, D, seed=25)
    s = 0.2
    assert torch.equal(gaussian_kl(mu, mu.clone(), s), torch.zeros(B, dtype=F64))
    by_hand = ((mu - mu_ref) ** 2).sum(dim=1) / (2 * s**2 * D)
    assert torch.allclose(gaussian_kl(mu, mu_ref, s), by_hand, rtol=1e-14, atol=0)
    # per-sample std
    sb = torch.tensor([0.1, 0.2, 0.4], dtype=F64)
    by_hand_b = ((mu - mu_ref) ** 2).sum(dim=1) / (2 * sb**2 * D)
    assert torch.allclose(gaussian_kl(mu, mu_ref, sb), by_hand_b, rtol=1e-14, atol=0)
    assert torch.allclose(kl_penalty("gaussian", mean=mu, mean_ref=mu_ref, std=sb), by_hand_b, rtol=1e-14, atol=0)
    # velocity MSE
    v, v_ref = _randn(B, 2, 5, seed=26), _randn(B, 2, 5, seed=27)
    vk = ((v - v_ref) ** 2).reshape(B, -1).mean(dim=1)
    assert torch.allclose(velocity_kl(v, v_ref), vk, rtol=1e-14, atol=0)
    assert torch.equal(kl_penalty("velocity_mse", v=v, v_ref=v_ref), velocity_kl(v, v_ref))
    assert torch.equal(velocity_kl(v, v.clone()), torch.zeros(B, dtype=F64))


def test_flow_grpo_kl_is_gaussian_kl_times_step_size():
    B, D = 2, 6
    x, v, v_ref = _randn(B, D, seed=28), _randn(B, D, seed=29), _randn(B, D, seed=30)
    s, sn = torch.tensor([0.8, 0.4], dtype=F64), torch.tensor([0.7, 0.25], dtype=F64)
    mu, std = step_mean_std("flow_grpo", x, v, s, sn)
    mu_ref, _ = step_mean_std("flow_grpo", x, v_ref, s, sn)
    delta = sn - s
    kl_impl = kl_penalty("flow_grpo", mean=mu, mean_ref=mu_ref, std=std, delta=delta)
    assert torch.allclose(kl_impl, gaussian_kl(mu, mu_ref, std) * delta.abs(), rtol=1e-13, atol=0)
    # = mean((mu - mu_ref)^2) / (2 g^2), the reference code's expression
    g = diffusion_coefficient("flow_grpo", s, 0.7)
    ref = ((mu - mu_ref) ** 2).mean(dim=1) / (2 * g**2)
    assert torch.allclose(kl_impl, ref, rtol=1e-13, atol=0)
    # and the mean difference is Delta (1 + g^2 (1 - s) / (2 s)) (v - v_ref)
    fac = (delta * (1 + g**2 * (1 - s) / (2 * s)))[:, None]
    assert torch.allclose(mu - mu_ref, fac * (v - v_ref), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="delta"):
        kl_penalty("flow_grpo", mean=mu, mean_ref=mu_ref, std=std)
    with pytest.raises(ValueError, match="unknown KL kind"):
        kl_penalty("reverse", mean=mu, mean_ref=mu_ref, std=std)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# group advantages and reward normalisation


def test_group_advantages_zero_mean_unit_std_per_group():
    rewards = _randn(12, seed=31)
    groups = torch.tensor([5, 5, 5, 5, 2, 2, 2, 2, 9, 9, 9, 9])
    for ddof in (0, 1):
        adv = group_advantages(rewards, groups, eps=0.0, ddof=ddof)
        assert adv.dtype == F64
        for gid in (5, 2, 9):
            a = adv[groups == gid]
            assert abs(float(a.mean())) < 1e-14
            assert float(a.std(correction=ddof)) == pytest.approx(1.0, abs=1e-13)
    # default eps = 1e-4 by hand for one group, float32 for float32 rewards
    adv = group_advantages(rewards.float(), groups)
    assert adv.dtype == torch.float32
    r = rewards[groups == 2]
    expected = (r - r.mean()) / (r.std(correction=0) + 1e-4)
    assert torch.allclose(adv[groups == 2].double(), expected, rtol=1e-6, atol=1e-6)
    # "none": only the mean is removed
    adv_none = group_advantages(rewards, groups, std="none")
    assert torch.allclose(adv_none[groups == 2], r - r.mean(), rtol=0, atol=1e-15)


def test_group_advantages_global_std_and_constant_group():
    rewards = torch.tensor([0.1, 0.5, 0.9, 3.0, 4.0, 5.0, 2.0, 2.0, 2.0], dtype=F64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    adv = group_advantages(rewards, groups, std="global", eps=1e-4)
    pooled = rewards.std(correction=0)
    g0 = rewards[:3]
    assert torch.allclose(adv[:3], (g0 - g0.mean()) / (pooled + 1e-4), rtol=1e-14, atol=0)
    assert torch.equal(adv[6:], torch.zeros(3, dtype=F64))
    # group std differs: group 1 has a larger spread than group 0, so its global-std advantages are larger
    assert float(adv[5]) > float(adv[2]) > 0
    adv_g = group_advantages(rewards, groups)
    assert torch.equal(adv_g[6:], torch.zeros(3, dtype=F64))
    assert float(adv_g[5]) == pytest.approx(float(adv_g[2]), rel=1e-3)  # same z-score under the group std
    st = group_stats(rewards, groups)
    assert float(st["zero_std_fraction"]) == pytest.approx(1 / 3)
    assert float(st["reward_mean"]) == pytest.approx(float(rewards.mean()), rel=1e-6)
    assert float(st["reward_std"]) == pytest.approx(float(pooled), rel=1e-6)
    assert float(st["valid_fraction"]) == 1.0


def test_group_advantages_invalid_samples():
    rewards = torch.tensor([0.2, float("nan"), 0.8, 0.5, 1.0, 3.0], dtype=F64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    valid = torch.tensor([True, False, True, True, True, True])
    adv = group_advantages(rewards, groups, valid=valid, ddof=1)
    assert float(adv[1]) == 0.0
    kept = group_advantages(rewards[valid], groups[valid], ddof=1)
    assert torch.equal(adv[valid], kept)
    # an invalid sample with a finite reward does not shift its group's mean either
    rewards2 = rewards.clone()
    rewards2[1] = 100.0
    assert torch.equal(group_advantages(rewards2, groups, valid=valid, ddof=1), adv)
    # a group left with one valid sample has no spread: 0
    adv1 = group_advantages(rewards, groups, valid=torch.tensor([True, False, False, False, True, True]), ddof=1)
    assert float(adv1[0]) == 0.0 and float(adv1[4]) != 0.0
    st = group_stats(rewards, groups, valid)
    assert float(st["valid_fraction"]) == pytest.approx(5 / 6)
    # NaN on a valid sample is an error
    with pytest.raises(ValueError, match=r"1 reward.*valid=False"):
        group_advantages(rewards, groups)
    with pytest.raises(ValueError, match="integer"):
        group_advantages(rewards, groups.double(), valid=valid)
    with pytest.raises(ValueError, match="unknown advantage std"):
        group_advantages(rewards, groups, std="batch", valid=valid)  # type: ignore[arg-type]


def test_running_mean_std_and_normalize():
    data = _randn(50, seed=32) * 3 + 2
    rms = RunningMeanStd()
    for chunk in (data[:7], data[7:8], torch.tensor([float("nan"), float("nan")], dtype=F64), data[8:]):
        rms.update(chunk)
    rms.update(torch.tensor(float("nan")))
    assert float(rms.count) == 50
    assert float(rms.mean) == pytest.approx(float(data.mean()), rel=1e-12)
    assert float(rms.var) == pytest.approx(float(data.var(correction=0)), rel=1e-12)
    z = rms.normalize(data.float())
    assert z.dtype == torch.float32
    assert abs(float(z.mean())) < 1e-5 and float(z.std(correction=0)) == pytest.approx(1.0, abs=1e-5)
    other = RunningMeanStd()
    other.load_state_dict(rms.state_dict())
    assert torch.equal(other.mean, rms.mean) and torch.equal(other.m2, rms.m2) and torch.equal(other.count, rms.count)
    # vector stream: each component counts its own non-NaN values
    vec = RunningMeanStd(shape=(2,))
    obs = torch.tensor([[1.0, float("nan")], [3.0, 10.0], [5.0, 20.0]], dtype=F64)
    vec.update(obs)
    assert torch.equal(vec.count, torch.tensor([3.0, 2.0], dtype=F64))
    assert torch.allclose(vec.mean, torch.tensor([3.0, 15.0], dtype=F64))
    assert torch.allclose(vec.var, torch.tensor([8 / 3, 25.0], dtype=F64))
    with pytest.raises(ValueError, match="shape"):
        vec.update(torch.zeros(3))
    assert torch.allclose(normalize_rewards(torch.tensor([1.0, 3.0]), 2.0, 1.0, eps=0.0), torch.tensor([-1.0, 1.0]))


# ----------------------------------------------------------------------------------------------
# bad inputs


def test_bad_inputs_raise_clear_errors():
    x, v, n = _randn(2, 4, seed=33), _randn(2, 4, seed=34), _randn(2, 4, seed=35)
    assert set(STEP_KINDS) == {"ode", "flow_grpo", "dance_grpo"}
    with pytest.raises(ValueError, match="unknown step kind.*flow_grpo"):
        step_mean_std("sde", x, v, 0.5, 0.4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise_level"):
        sde_step("dance_grpo", x, v, 0.5, 0.4, n, noise_level=-0.1)
    with pytest.raises(ValueError, match="noise_level"):
        diffusion_coefficient("flow_grpo", 0.5, float("nan"))
    with pytest.raises(ValueError, match="sigma_at_one"):
        sde_step("flow_grpo", x, v, 1.0, 0.9, n)
    with pytest.raises(ValueError, match="sigma_at_one"):
        step_mean_std("flow_grpo", x, v, torch.tensor([1.0, 0.5], dtype=F64), 0.4, sigma_at_one=1.0)
    with pytest.raises(ValueError, match="std > 0.*no density"):
        gaussian_log_prob(x, v, 0.0)
    with pytest.raises(ValueError, match="std > 0"):
        gaussian_log_prob(x, v, torch.tensor([[0.1], [0.0]], dtype=F64))
    with pytest.raises(ValueError, match="no density"):
        step_log_prob("ode", x, v, 0.5, 0.4, n)
    with pytest.raises(ValueError, match="reduce"):
        gaussian_log_prob(x, v, 0.1, reduce="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="noise"):
        sde_step("dance_grpo", x, v, 0.5, 0.4, None)
    with pytest.raises(ValueError, match="sigma > 0"):
        step_mean_std("dance_grpo", x, v, 0.0, 0.0, 0.3)
    with pytest.raises(ValueError, match="must match"):
        step_mean_std("ode", x, v[:, :3], 0.5, 0.4)
    with pytest.raises(ValueError, match="broadcastable"):
        clipped_policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="clip_range"):
        clipped_policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), clip_range=-1e-4)
    with pytest.raises(ValueError, match="adv_clip_max"):
        clipped_policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), adv_clip_max=0.0)
    with pytest.raises(ValueError, match="std > 0"):
        gaussian_kl(x, v, 0.0)


# ----------------------------------------------------------------------------------------------
# contracts: float64 references, dtypes, boundaries (mutation testing, issue 26)


def _clipped_reference(lp, old, adv, eps_low, eps_high, adv_max):
    """The clipped surrogate and its stats in float64 straight from the docstring's formulas."""
    lp, old, adv = lp.double(), old.double(), adv.double()
    d = lp - old
    r = torch.exp(d)
    a = adv.clamp(-adv_max, adv_max)
    loss = torch.maximum(-a * r, -a * r.clamp(1 - eps_low, 1 + eps_high))
    rb = r.expand(loss.shape)
    high, low = (rb > 1 + eps_high).double(), (rb < 1 - eps_low).double()
    stats = {
        "ratio_mean": rb.mean(), "ratio_std": rb.std(correction=0), "approx_kl": 0.5 * (d * d).mean(),
        "clipfrac": (high + low).mean(), "clipfrac_high": high.mean(), "clipfrac_low": low.mean(),
        "adv_abs_mean": a.expand(loss.shape).abs().mean(),
    }
    return loss, stats


# which input is float64 (holding values float32 cannot represent) and which inputs are 0-d; the others are
# float32 [B]: the loss and every stat must be float64 and equal the float64 reference
_CLIP_CASES = {
    "log_prob_f64": ("lp", ()),
    "old_log_prob_f64": ("old", ()),
    "advantages_f64": ("adv", ()),
    "old_log_prob_f64_0d": ("old", ("old",)),
    "log_prob_f64_0d": ("lp", ("lp",)),
    "log_probs_f64_0d": ("lp+old", ("lp", "old")),
}


@pytest.mark.parametrize("case", list(_CLIP_CASES))
def test_clipped_policy_loss_mixed_dtypes_equal_the_float64_reference(case):
    """One float64 input (0-d or [B]) among float32 ones: loss and stats are float64 and equal the float64 formula."""
    f64_of, zero_d = _CLIP_CASES[case]
    b = 6
    vals = {
        "lp": _randn(b, seed=61) * 0.4 + 1 / 3,
        "old": _randn(b, seed=62) * 0.4 + 1 / 3,
        "adv": torch.tensor([2.5, -0.7, 0.3, -3.0, 1.1, -1.9], dtype=F64) + 1 / 3,
    }
    args = {}
    for k, v in vals.items():
        v = v[:1].reshape(()) if k in zero_d else v
        args[k] = v if k in f64_of.split("+") else v.float()
    kw = {"clip_range": 0.2, "clip_range_high": 0.3, "adv_clip_max": 1.5}
    loss, stats = clipped_policy_loss(args["lp"], args["old"], args["adv"], **kw)
    ref, ref_stats = _clipped_reference(args["lp"], args["old"], args["adv"], 0.2, 0.3, 1.5)
    assert loss.dtype == F64 and loss.shape == (b,)
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    assert set(stats) == set(ref_stats)
    for key, value in stats.items():
        assert value.dtype == F64 and value.shape == (), key
        torch.testing.assert_close(value, ref_stats[key], rtol=0, atol=1e-12, msg=key)
    if not zero_d:  # the inputs reach both clip sides and the advantage clamp
        assert 0 < float(stats["clipfrac_high"]) and 0 < float(stats["clipfrac_low"]) < 1


def test_clipped_policy_loss_ratio_on_the_clip_bound_is_not_clipped():
    """r exactly 1 + eps_high or 1 - eps_low counts as inside the range; clip ranges of 0 are accepted."""
    zeros = torch.zeros(4, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 2.0, -2.0], dtype=F64)
    loss, stats = clipped_policy_loss(zeros, zeros, adv, clip_range=0.0, clip_range_high=0.0)
    assert torch.equal(loss, -adv)
    for key in ("clipfrac", "clipfrac_high", "clipfrac_low"):
        assert float(stats[key]) == 0.0, key
    loss, stats = clipped_policy_loss(zeros, zeros, adv, clip_range=0.0)
    assert torch.equal(loss, -adv) and float(stats["clipfrac"]) == 0.0
    # ratios exactly on the bounds (Sterbenz: r - 1 and 1 - r are exact), plus one just outside each
    lp = torch.tensor([0.25, -0.25, 0.2500001, -0.2500001], dtype=F64)
    r = torch.exp(lp)
    eps_high, eps_low = float(r[0]) - 1.0, 1.0 - float(r[1])
    assert 1.0 + eps_high == float(r[0]) and 1.0 - eps_low == float(r[1])
    _, stats = clipped_policy_loss(lp, zeros, adv, clip_range=eps_low, clip_range_high=eps_high)
    assert float(stats["clipfrac_high"]) == 0.25 and float(stats["clipfrac_low"]) == 0.25
    assert float(stats["clipfrac"]) == 0.5


def test_clipped_policy_loss_rejects_clip_ranges_outside_their_bounds():
    """clip_range must lie in [0, 1) (1 and 1.5 raise), clip_range_high must be >= 0; the error names the argument."""
    z = torch.zeros(2, dtype=F64)
    for bad in (1.0, 1.5):
        with pytest.raises(ValueError, match=r"^clip_range must be in \[0, 1\), got"):
            clipped_policy_loss(z, z, z, clip_range=bad)
    with pytest.raises(ValueError, match=r"^clip_range_high must be >= 0, got -0.1"):
        clipped_policy_loss(z, z, z, clip_range_high=-0.1)
    clipped_policy_loss(z, z, z, clip_range=0.999999)  # just below 1 is fine


@pytest.mark.parametrize("odd", ["log_prob", "old_log_prob", "advantages"])
def test_clipped_policy_loss_shape_error_names_all_three_shapes(odd):
    """Any one of the three inputs with a shape that does not broadcast raises ValueError naming all three shapes."""
    shapes = {k: (2,) for k in ("log_prob", "old_log_prob", "advantages")}
    shapes[odd] = (3,)
    args = [torch.zeros(shapes[k], dtype=F64) for k in ("log_prob", "old_log_prob", "advantages")]
    lp, old, adv = (str(tuple(shapes[k])).replace("(", r"\(").replace(")", r"\)")
                    for k in ("log_prob", "old_log_prob", "advantages"))
    with pytest.raises(ValueError, match=rf"^log_prob {lp}, old_log_prob {old} and advantages {adv} must have"):
        clipped_policy_loss(*args)


def test_clipped_policy_loss_ratio_std_for_zero_one_and_two_samples():
    """ratio_std is 0 (in the loss dtype, on the inputs' device) for B = 0 and B = 1, and |r1 - r2| / 2 for B = 2."""
    for dt in (F64, torch.float32):
        one = torch.tensor([0.3], dtype=dt)
        loss, stats = clipped_policy_loss(one, torch.zeros(1, dtype=dt), one)
        assert loss.dtype == dt
        for key, value in stats.items():
            assert value.dtype == dt, key
        assert float(stats["ratio_std"]) == 0.0
        loss, stats = clipped_policy_loss(*(torch.zeros(0, dtype=dt) for _ in range(3)))
        assert loss.shape == (0,) and stats["ratio_std"].dtype == dt and float(stats["ratio_std"]) == 0.0
    lp = torch.tensor([0.1, -0.2], dtype=F64)
    _, stats = clipped_policy_loss(lp, torch.zeros(2, dtype=F64), torch.ones(2, dtype=F64))
    r = torch.exp(lp)
    torch.testing.assert_close(stats["ratio_std"], (r[0] - r[1]).abs() / 2, rtol=0, atol=1e-15)
    meta = torch.zeros(1, device="meta")
    _, stats = clipped_policy_loss(meta, meta, meta)
    for key, value in stats.items():
        assert value.device.type == "meta", key


def _group_reference(rewards, groups, valid, std, eps, ddof):
    """group_advantages by hand: a python loop over the groups in float64."""
    r, g, ok = rewards.double().tolist(), groups.tolist(), valid.tolist()

    def spread(values):
        if len(values) - ddof <= 0:
            return 0.0
        mu = sum(values) / len(values)
        return math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - ddof))

    members = {gid: [r[i] for i in range(len(r)) if g[i] == gid and ok[i]] for gid in set(g)}
    pooled = spread([r[i] for i in range(len(r)) if ok[i]])
    out = []
    for i in range(len(r)):
        vals = members[g[i]]
        if not ok[i] or spread(vals) < 1e-6:
            out.append(0.0)
            continue
        denom = {"group": spread(vals) + eps, "global": pooled + eps, "none": 1.0}[std]
        out.append((r[i] - sum(vals) / len(vals)) / denom)
    return torch.tensor(out, dtype=F64)


def _interleaved_groups():
    """Four interleaved groups (ids 7, -3, 40, 0) of sizes 5, 3, 2, 4 at reward levels ~0, ~10, ~-5, ~100."""
    groups = torch.tensor([7, -3, 7, 40, 0, 7, -3, 0, 40, 7, 0, -3, 7, 0])
    level = {7: 0.0, -3: 10.0, 40: -5.0, 0: 100.0}
    noise = _randn(len(groups), seed=71)
    rewards = torch.tensor([level[int(gid)] for gid in groups], dtype=F64) + noise + 1 / 3
    valid = torch.ones(len(groups), dtype=torch.bool)
    valid[[2, 11]] = False  # one invalid sample in group 7 and one in group -3
    rewards[2] = float("nan")
    return rewards, groups, valid


@pytest.mark.parametrize("std", ["group", "global", "none"])
@pytest.mark.parametrize("ddof", [0, 1, 2])
def test_group_advantages_equal_a_per_group_loop_reference(std, ddof):
    """Interleaved groups of unequal sizes at different reward levels (with invalid samples): equal a loop, float64."""
    rewards, groups, valid = _interleaved_groups()
    for eps in (0.0, 1e-4):
        adv = group_advantages(rewards, groups, std=std, eps=eps, ddof=ddof, valid=valid)
        assert adv.dtype == F64 and adv.shape == rewards.shape
        torch.testing.assert_close(adv, _group_reference(rewards, groups, valid, std, eps, ddof), rtol=0, atol=1e-12)
    # float32 rewards: the float64 computation rounded once to float32
    adv32 = group_advantages(rewards.float(), groups, std=std, ddof=ddof, valid=valid)
    assert adv32.dtype == torch.float32
    ref = _group_reference(rewards.float(), groups, valid, std, 1e-4, ddof)
    assert torch.equal(adv32, ref.float())


def test_group_advantages_small_groups_and_the_zero_std_bound():
    """A group with fewer than ddof + 1 valid samples gives 0; a group std exactly ZERO_STD is not constant."""
    # ddof = 2: a group of two distinct rewards has no spread estimate -> 0; a group of three does
    rewards = torch.tensor([1.0, 3.0, 0.0, 1.0, 5.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1, 1])
    adv = group_advantages(rewards, groups, ddof=2, eps=0.0)
    assert torch.equal(adv[:2], torch.zeros(2, dtype=F64)) and bool((adv[2:] != 0).all())
    # std exactly 1e-6 (rewards 0 and 2e-6, ddof 0): kept, advantages +-1e-6 / (1e-6 + eps)
    rewards = torch.tensor([0.0, 2e-6, 4.0, 4.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(rewards, groups, eps=1e-6)
    assert torch.equal(adv, torch.tensor([-0.5, 0.5, 0.0, 0.0], dtype=F64))
    st = group_stats(rewards, groups)
    assert float(st["zero_std_fraction"]) == 0.5 and float(st["group_std_mean"]) == pytest.approx(5e-7, rel=1e-6)


def test_group_advantages_global_std_with_few_valid_samples():
    """"global" std: n - ddof = 1 uses the pooled std; one valid sample or none gives exactly 0 everywhere."""
    rewards = torch.tensor([1.0, 3.0, 7.0, float("nan")], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1])
    valid = torch.tensor([True, True, False, False])
    adv = group_advantages(rewards, groups, std="global", ddof=1, eps=1e-4, valid=valid)
    s = math.sqrt(2.0)  # two valid rewards 1, 3: sum of squares 2 over n - ddof = 1
    torch.testing.assert_close(adv, torch.tensor([-1 / (s + 1e-4), 1 / (s + 1e-4), 0, 0], dtype=F64), rtol=0,
                               atol=1e-15)
    for v in ([True, False, False, False], [False] * 4):
        adv = group_advantages(rewards, groups, std="global", ddof=1, valid=torch.tensor(v))
        assert torch.equal(adv, torch.zeros(4, dtype=F64))


def test_group_advantages_and_stats_of_an_empty_batch():
    """No samples: group_advantages gives an empty [0] tensor in the output dtype; group_stats gives NaN means."""
    for dt, out_dt in ((F64, F64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
        adv = group_advantages(torch.zeros(0, dtype=dt), torch.zeros(0, dtype=torch.int64))
        assert adv.shape == (0,) and adv.dtype == out_dt
    st = group_stats(torch.zeros(0, dtype=F64), torch.zeros(0, dtype=torch.int64))
    assert float(st["valid_fraction"]) == 0.0 and math.isnan(float(st["reward_mean"]))


def test_group_valid_mask_may_be_integer_or_float_zero_one():
    """valid given as 0 / 1 integers or floats acts exactly as the bool mask (advantages and stats)."""
    rewards, groups, valid = _interleaved_groups()
    adv = group_advantages(rewards, groups, valid=valid)
    st = group_stats(rewards, groups, valid)
    for v in (valid.to(torch.int64), valid.to(torch.uint8), valid.to(torch.float32)):
        assert torch.equal(group_advantages(rewards, groups, valid=v), adv)
        other = group_stats(rewards, groups, v)
        for key in st:
            assert torch.equal(other[key], st[key]), key


def test_group_stats_equal_a_per_group_reference():
    """group_stats over interleaved groups (one with no valid sample, one constant) equal a float64 reference."""
    rewards, groups, valid = _interleaved_groups()
    groups = groups.clone()
    groups[[4, 7]] = 99  # a group with one valid sample (group -3 is left with one too)...
    valid[7] = False
    rewards[[10, 13]] = 100.0  # ...and group 0 reduced to the constant pair (10, 13)
    groups[1] = 55  # a group whose only sample is invalid
    valid[1] = False
    st = group_stats(rewards, groups, valid)
    rv = rewards[valid]
    stds = []
    for gid in groups.unique().tolist():
        vals = rewards[(groups == gid) & valid]
        if len(vals):
            stds.append(float(vals.std(correction=0)))
    assert len(stds) == 5 and sum(s < 1e-6 for s in stds) == 3
    ref = {
        "reward_mean": float(rv.mean()), "reward_std": float(rv.std(correction=0)),
        "group_std_mean": sum(stds) / len(stds), "zero_std_fraction": 3 / 5, "valid_fraction": 10 / 14,
    }
    assert set(st) == set(ref)
    for key, value in st.items():
        assert value.dtype == torch.float32 and value.shape == (), key
        assert float(value) == float(torch.tensor(ref[key], dtype=F64).float()), key


def test_group_stats_one_sample_and_all_invalid():
    """One valid sample: mean r, stds 0, zero_std_fraction 1; none valid: NaN means, valid_fraction 0, no warning."""
    st = group_stats(torch.tensor([0.7], dtype=F64), torch.tensor([3]))
    assert {k: float(v) for k, v in st.items()} == {
        "reward_mean": float(torch.tensor(0.7).float()), "reward_std": 0.0, "group_std_mean": 0.0,
        "zero_std_fraction": 1.0, "valid_fraction": 1.0,
    }
    rewards = torch.tensor([1.0, float("nan"), 2.0], dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = group_stats(rewards, torch.tensor([0, 0, 1]), torch.zeros(3, dtype=torch.bool))
    assert set(st) == {"reward_mean", "reward_std", "group_std_mean", "zero_std_fraction", "valid_fraction"}
    for key, value in st.items():
        assert value.dtype == torch.float32 and value.shape == (), key
        assert math.isnan(float(value)) == (key != "valid_fraction"), key
    assert float(st["valid_fraction"]) == 0.0


def test_group_stats_are_float32_whatever_the_default_dtype():
    """The stats are float32 as documented, also when torch's default dtype is float64 (empty or not)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        for valid in (None, torch.zeros(2, dtype=torch.bool)):
            st = group_stats(torch.tensor([1.0, 2.0], dtype=F64), torch.tensor([0, 1]), valid)
            for key, value in st.items():
                assert value.dtype == torch.float32, key
    finally:
        torch.set_default_dtype(old)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device next to the CPU")
def test_group_advantages_and_stats_cuda_rewards_with_cpu_group_ids_and_valid():
    """Rewards on CUDA, group ids and valid on the CPU: advantages and every stat are on CUDA and equal the all-CPU
    values (also for an empty batch and for a batch with no valid sample)."""
    rewards, groups, valid = _interleaved_groups()
    for std in ("group", "global", "none"):
        adv = group_advantages(rewards.cuda(), groups, std=std, valid=valid)
        assert adv.device.type == "cuda"
        assert torch.equal(adv.cpu(), group_advantages(rewards, groups, std=std, valid=valid))
    empty = group_advantages(torch.zeros(0, dtype=F64).cuda(), torch.zeros(0, dtype=torch.int64))
    assert empty.device.type == "cuda" and empty.shape == (0,)
    for v in (valid, torch.zeros_like(valid)):
        st = group_stats(rewards.cuda(), groups, v)
        ref = group_stats(rewards, groups, v)
        for key, value in st.items():
            assert value.device.type == "cuda", key
            torch.testing.assert_close(value.cpu(), ref[key], rtol=0, atol=0, equal_nan=True, msg=key)
