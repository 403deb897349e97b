"""Tests of genrl.flow.forward_rl: the shared advantage-weighted FM core, RAM, AWM, NFT's update, timesteps.

Invariants R1, R3, R4, R6, R7 and the Gaussian population fixed point of docs/methods/forward_rl.md
(Invariants tested), all in float64 against closed forms.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from genrl.flow import centered_advantages, nft_loss, shift_sigmas
from genrl.flow.forward_rl import (
    advantage_to_r,
    advantage_weighted_fm_loss,
    awm_loss,
    awm_weight,
    ram_loss,
    ram_target,
    sample_mse,
    sample_timesteps,
    velocity_monitors,
)

F64 = torch.float64
SHAPE = (4, 3, 2, 3, 3)  # [B, T, C, H, W]


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _grad(loss_fn, v: torch.Tensor) -> torch.Tensor:
    v = v.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(v), v)
    return g


def _per_sample(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], *([1] * (len(SHAPE) - 1)))


N_EL = math.prod(SHAPE[1:])  # elements per sample


# ----------------------------------------------------------------------------------------------
# the core


def test_sample_mse_values_mask_layout_and_dtype():
    v, tgt = _randn(*SHAPE, seed=1), _randn(*SHAPE, seed=2)
    expected = ((v - tgt) ** 2).reshape(SHAPE[0], -1).mean(1)
    torch.testing.assert_close(sample_mse(v, tgt), expected, rtol=1e-14, atol=0)
    # per-frame mask: mean over the kept frames only; NaN in dropped frames gives finite values, zero grad
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    v_nan = v.clone()
    v_nan[0, 2] = float("nan")
    ref = torch.stack([((v[b] - tgt[b])[mask[b]] ** 2).mean() for b in range(SHAPE[0])])
    torch.testing.assert_close(sample_mse(v_nan, tgt, mask=mask), ref, rtol=1e-14, atol=0)
    g = _grad(lambda x: sample_mse(x, tgt, mask=mask).sum(), v_nan)
    assert bool(torch.isfinite(g).all()) and bool((g[0, 2] == 0).all())
    # Wan layout [B, C, T, H, W] with frame_dim=2 gives the same numbers
    perm = (0, 2, 1, 3, 4)
    torch.testing.assert_close(
        sample_mse(v.permute(perm), tgt.permute(perm), mask=mask, frame_dim=2), ref, rtol=1e-14, atol=0
    )
    # float32 math for low-precision inputs; the target is not detached
    assert sample_mse(v.float(), tgt.bfloat16()).dtype == torch.float32
    gt = _grad(lambda y: sample_mse(v, y).sum(), tgt)
    torch.testing.assert_close(gt, -2 * (v - tgt) / N_EL, rtol=1e-12, atol=0)


def test_advantage_weighted_fm_gradient_closed_form():
    v, u = _randn(*SHAPE, seed=3), _randn(*SHAPE, seed=4)
    w = torch.tensor([1.5, -0.5, 0.0, 2.0], dtype=F64)
    g = _grad(lambda x: advantage_weighted_fm_loss(x, u, w), v)
    torch.testing.assert_close(g, _per_sample(w) * 2 * (v - u) / (SHAPE[0] * N_EL), rtol=1e-12, atol=0)
    assert float(advantage_weighted_fm_loss(v, u, w)) == pytest.approx(float((w * sample_mse(v, u)).mean()), rel=1e-14)


# ----------------------------------------------------------------------------------------------
# RAM: R1, R3, R6


def test_r3_ram_gradient_is_m_times_onpolicy_awm_with_beta_one_over_m():
    v, v_ref, u = _randn(*SHAPE, seed=5), _randn(*SHAPE, seed=6), _randn(*SHAPE, seed=7)
    adv, t = torch.tensor([1.3, -0.7, 0.2, -2.9], dtype=F64), torch.tensor([0.9, 0.5, 0.3, 0.05], dtype=F64)
    m = 3.7
    leaf = v.clone().requires_grad_(True)
    (g_ram,) = torch.autograd.grad(ram_loss(leaf, v_ref, leaf.detach(), u, adv, m), leaf)
    awm, _ = awm_loss(leaf, u, t, adv, weighting="uniform", clip_range=None, adv_clip=math.inf, adv_scale=False,
                      v_ref=v_ref, beta=1.0 / m)
    (g_awm,) = torch.autograd.grad(awm, leaf)
    torch.testing.assert_close(g_ram, m * g_awm, rtol=0, atol=1e-10)
    # and both equal the closed form 2 [(v - v_ref) + m A (v - u)] / (B N)
    expected = 2 * ((v - v_ref) + m * _per_sample(adv) * (v - u)) / (SHAPE[0] * N_EL)
    torch.testing.assert_close(g_ram, expected, rtol=1e-12, atol=1e-15)


def test_r1_constant_reward_at_reference_gives_exact_zero():
    v_ref, v_old, u = _randn(*SHAPE, seed=8), _randn(*SHAPE, seed=9), _randn(*SHAPE, seed=10)
    adv = centered_advantages(torch.full((SHAPE[0],), 0.37, dtype=F64), group=torch.tensor([0, 0, 1, 1]))
    assert bool((adv == 0).all())
    torch.testing.assert_close(ram_target(v_ref, v_old, u, adv, 100.0), v_ref, rtol=0, atol=0)
    leaf = v_ref.clone().requires_grad_(True)
    loss = ram_loss(leaf, v_ref, v_old, u, adv, 100.0)
    (g,) = torch.autograd.grad(loss, leaf)
    assert float(loss.detach()) == 0.0 and bool((g == 0).all())
    t = torch.full((SHAPE[0],), 0.5, dtype=F64)
    for weighting in ("uniform", "ghuber"):
        pol, _ = awm_loss(leaf, u, t, adv, weighting=weighting, clip_range=1.0)
        (g_pol,) = torch.autograd.grad(pol, leaf)
        assert bool((g_pol == 0).all())


def test_r6_ram_gradient_is_affine_in_the_advantage():
    v, v_ref, v_old, u = (_randn(*SHAPE, seed=s) for s in (11, 12, 13, 14))
    a1, a2 = _randn(SHAPE[0], seed=15), _randn(SHAPE[0], seed=16)
    g = {name: _grad(lambda x, a=a: ram_loss(x, v_ref, v_old, u, a, 7.0), v)
         for name, a in (("1", a1), ("2", a2), ("12", a1 + a2), ("0", torch.zeros_like(a1)))}
    torch.testing.assert_close(g["12"], g["1"] + g["2"] - g["0"], rtol=0, atol=1e-12)


def test_ram_target_value_broadcast_and_mask():
    v_ref, v_old, u = _randn(*SHAPE, seed=17), _randn(*SHAPE, seed=18), _randn(*SHAPE, seed=19)
    adv = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=F64)
    tgt = ram_target(v_ref, v_old, u, adv, 10.0)
    torch.testing.assert_close(tgt, v_ref + 10.0 * _per_sample(adv) * (u - v_old), rtol=1e-14, atol=1e-14)
    assert not tgt.requires_grad
    mask = torch.tensor([[1, 0, 1]] * SHAPE[0], dtype=torch.bool)
    v = _randn(*SHAPE, seed=20)
    sel = [0, 2]
    torch.testing.assert_close(
        ram_loss(v, v_ref, v_old, u, adv, 10.0, mask=mask),
        ram_loss(v[:, sel], v_ref[:, sel], v_old[:, sel], u[:, sel], adv, 10.0), rtol=1e-13, atol=0,
    )


# ----------------------------------------------------------------------------------------------
# Gaussian population fixed point (docs/methods/forward_rl.md, Invariants tested)

_Z, _W = (torch.tensor(a, dtype=F64) for a in np.polynomial.hermite_e.hermegauss(20))
_W = _W / _W.sum()


def _gauss_velocity(mu, s, x, t):
    """Marginal velocity E[eps - x0 | x_t = x] of x0 ~ N(mu, s^2), x_t = (1 - t) x0 + t eps."""
    var_t = t * t + (1 - t) ** 2 * s * s
    return -mu + (t - (1 - t) * s * s) / var_t * (x - (1 - t) * mu)


def _ram_population_velocity(mu, s, reward, mean_reward, beta, mu0, s0, x, t):
    """E_{p*}[ram_target | x_t] with p* = N(mu, s^2), v_old = p*'s own marginal velocity, m = beta.

    The population minimiser of ram_loss; the posterior x0 | x_t is Gaussian, integrated by Gauss-Hermite.
    """
    den = t * t / (s * s) + (1 - t) ** 2
    post_mean = (t * t / den) * mu / (s * s) + (1 - t) * x / den
    post_sd = t / den.sqrt()
    x0 = post_mean[:, None] + post_sd[:, None] * _Z
    u_star = _gauss_velocity(mu, s, x, t)
    y = u_star[:, None] - _Z / den.sqrt()[:, None]  # Y = (x_t - x0) / t, written without 0 / 0 at t = 0
    k = _Z.numel()
    tgt = ram_target(
        _gauss_velocity(mu0, s0, x, t).repeat_interleave(k), u_star.repeat_interleave(k), y.reshape(-1),
        (reward(x0) - mean_reward).reshape(-1), beta,
    )
    return (tgt.reshape(-1, k) * _W).sum(1)


def _ram_fixed_point(kind: str, beta: float, mu0: float = 0.0, s0: float = 1.0, c: float = 1.0, a: float = 2.0,
                     steps: int = 160):
    """Damped iteration of the population RAM map within Gaussians, exact here: v* is affine in x, so the ODE
    from N(0, 1) at t = 1 lands on a Gaussian; its mean / std follow m' = a m + b, S' = a S (RK4, t: 1 -> 0)."""
    h = -1.0 / steps
    t0 = 1.0 + h * torch.arange(steps, dtype=F64)
    stages = torch.stack([t0, t0 + h / 2, t0 + h], 1)  # [steps, 3]
    xs = torch.tensor([-1.0, 0.0, 1.0], dtype=F64)
    tt, xx = stages[..., None].expand(-1, -1, 3).reshape(-1), xs.expand(steps, 3, 3).reshape(-1)
    mu, s = mu0, s0
    for _ in range(200):
        if kind == "linear":
            reward, mean_r = (lambda x: c * x), c * mu
        else:
            reward, mean_r = (lambda x: -(x - a) ** 2 / 2), -((mu - a) ** 2 + s * s) / 2
        v = _ram_population_velocity(mu, s, reward, mean_r, beta, mu0, s0, xx, tt).reshape(steps, 3, 3)
        assert float((v[..., 2] + v[..., 0] - 2 * v[..., 1]).abs().max()) < 1e-9  # affine in x
        slope, icpt = ((v[..., 2] - v[..., 0]) / 2).tolist(), v[..., 1].tolist()
        m_, s_ = 0.0, 1.0
        for i in range(steps):
            k1 = (slope[i][0] * m_ + icpt[i][0], slope[i][0] * s_)
            k2 = (slope[i][1] * (m_ + h / 2 * k1[0]) + icpt[i][1], slope[i][1] * (s_ + h / 2 * k1[1]))
            k3 = (slope[i][1] * (m_ + h / 2 * k2[0]) + icpt[i][1], slope[i][1] * (s_ + h / 2 * k2[1]))
            k4 = (slope[i][2] * (m_ + h * k3[0]) + icpt[i][2], slope[i][2] * (s_ + h * k3[1]))
            m_ += h / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
            s_ += h / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
        new_mu, new_s = 0.5 * (mu + m_), 0.5 * (s + s_)
        if abs(new_mu - mu) + abs(new_s - s) < 1e-12:
            return new_mu, new_s
        mu, s = new_mu, new_s
    raise AssertionError("population RAM iteration did not converge")


def test_gaussian_fixed_point_linear_reward_is_the_exact_tilt():
    # spec: 0.500 / 1.001 at beta = 0.5 on N(0, 1) (its grid's discretisation); exact N(mu0 + beta c s0^2, s0^2)
    mu, s = _ram_fixed_point("linear", 0.5)
    assert mu == pytest.approx(0.5, abs=1e-8) and s == pytest.approx(1.0, abs=1e-8)
    mu, s = _ram_fixed_point("linear", 0.4, mu0=0.3, s0=0.7, c=-1.5)
    assert mu == pytest.approx(0.3 - 0.4 * 1.5 * 0.49, abs=1e-8) and s == pytest.approx(0.7, abs=1e-8)


def test_gaussian_fixed_point_quadratic_reward_under_tilts_to_second_order():
    def exact(beta):  # tilt of N(0, 1) by exp(-beta (x - 2)^2 / 2)
        return 2 * beta / (1 + beta), 1 / math.sqrt(1 + beta)

    errs = []
    for beta in (0.05, 0.1, 1.0):
        mu, s = _ram_fixed_point("quadratic", beta)
        mu_ex, s_ex = exact(beta)
        assert 0.0 < mu < mu_ex and s_ex < s < 1.0  # conservative: strictly between reference and exact tilt
        errs.append(mu_ex - mu)
        if beta == 1.0:  # the spec's table: RAM 0.817 / 0.756 at beta = 1 (grid iteration)
            assert mu == pytest.approx(0.817, abs=0.01) and s == pytest.approx(0.756, abs=0.01)
    # first-order accurate: halving beta divides the error by ~4 (3.45 here; -> 4 as beta -> 0)
    assert 3.0 < errs[1] / errs[0] < 4.5
    assert errs[0] / 0.05**2 < 1.5


# ----------------------------------------------------------------------------------------------
# DiffusionNFT at theta = theta_old (R4)


def _nft_inputs(seed: int = 30):
    x0, eps, v_old = _randn(*SHAPE, seed=seed), _randn(*SHAPE, seed=seed + 1), _randn(*SHAPE, seed=seed + 2)
    t = torch.tensor([0.9, 0.6, 0.35, 0.1], dtype=F64)
    x_t = (1 - _per_sample(t)) * x0 + _per_sample(t) * eps
    adv = torch.tensor([2.0, -1.0, 7.0, 0.0], dtype=F64)
    return x0, eps, v_old, t, x_t, adv


def test_r4_nft_velocity_form_is_advantage_weighted_fm_at_old_policy():
    x0, eps, v_old, t, x_t, adv = _nft_inputs()
    c, beta = 5.0, 0.3
    r = advantage_to_r(adv, c)
    g_nft = _grad(lambda v: nft_loss(v, v_old, x_t, x0, t, r, beta=beta, clip_c=c, adaptive=False), v_old)
    g_awfm = _grad(lambda v: advantage_weighted_fm_loss(v, eps - x0, c * (2 * r - 1)), v_old)
    torch.testing.assert_close(g_nft, g_awfm, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(c * (2 * r - 1), adv.clamp(-c, c), rtol=0, atol=1e-15)  # weights = clip(A)


def test_r4_nft_adaptive_form_is_t2_weighted_fm_with_normaliser():
    x0, eps, v_old, t, x_t, adv = _nft_inputs(seed=40)
    c = 5.0
    r = advantage_to_r(adv, c)
    g = _grad(lambda v: nft_loss(v, v_old, x_t, x0, t, r, beta=1.0, clip_c=c, adaptive=True), v_old)
    u = eps - x0
    w = (_per_sample(t) * (u - v_old)).abs().reshape(SHAPE[0], -1).mean(1).clamp_min(1e-5)
    direction = _per_sample(t**2 * (2 * r - 1) / w) * (v_old - u)  # spec §1.6: ∝ t^2 (2r - 1)(v_old - Y) / w
    torch.testing.assert_close(g, 2 * c * direction / (SHAPE[0] * N_EL), rtol=1e-9, atol=1e-14)


# ----------------------------------------------------------------------------------------------
# AWM


def test_awm_weight_values():
    ell = torch.tensor([0.0, 0.3, 1.7, 4.0], dtype=F64)
    t = torch.tensor([0.2, 0.5, 0.8, 1.0], dtype=F64)
    torch.testing.assert_close(awm_weight(ell, t, "uniform"), ell, rtol=0, atol=0)
    torch.testing.assert_close(awm_weight(ell, t, "t"), t * ell, rtol=1e-15, atol=0)
    torch.testing.assert_close(awm_weight(ell, t, "t2"), t * t * ell, rtol=1e-15, atol=0)
    # the reference's huber: t (sqrt(l + 1e-10) - 1e-5), and ghuber: (t / p)((l + 1e-10)^p - 1e-10^p)
    close = lambda a, b, rtol=1e-12: torch.testing.assert_close(a, b, rtol=rtol, atol=1e-15)  # noqa: E731
    close(awm_weight(ell, t, "huber"), t * (torch.sqrt(ell + 1e-10) - 1e-5))
    for p in (0.25, 0.6):
        expected = t / p * ((ell + 1e-10) ** p - 1e-10**p)
        close(awm_weight(ell, t, "ghuber", p=p), expected)
    close(awm_weight(ell, t, "ghuber", p=1.0), t * ell, rtol=1e-9)  # ghuber(p = 1) is the "t" weighting
    close(awm_weight(ell, t, "huber"), awm_weight(ell, t, "ghuber", p=0.5) / 2)
    d = 0.5
    close(awm_weight(ell, t, "huber", huber_delta=d), t * (torch.sqrt(ell + d * d) - d))
    assert float(awm_weight(ell, 0.5, "t")[2]) == pytest.approx(0.85, rel=1e-14)


def test_awm_onpolicy_gradient_is_scaled_advantage_times_grad_w():
    v, u, v_ref, v_ema = (_randn(*SHAPE, seed=s) for s in (50, 51, 52, 53))
    t = torch.tensor([0.9, 0.5, 0.3, 0.7], dtype=F64)
    adv = torch.tensor([7.0, -2.0, 0.5, -9.0], dtype=F64)  # clipped to +-5, then / 5
    a_s = torch.tensor([1.0, -0.4, 0.1, -1.0], dtype=F64)
    loss, stats = awm_loss(v, u, t, adv, weighting="ghuber", clip_range=1.0, v_ref=v_ref, beta=0.01, v_ema=v_ema,
                           beta_ema=0.5)
    ell = sample_mse(v, u)
    expected = -a_s.mean() + 0.01 * sample_mse(v, v_ref).mean() + 0.5 * sample_mse(v, v_ema).mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-13)
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["clip_frac"]) == 0.0
    assert float(stats["fm_mse"]) == pytest.approx(float(ell.mean()), rel=1e-14)
    g = _grad(lambda x: awm_loss(x, u, t, adv, weighting="ghuber")[0], v)
    dw_dl = t * (ell + 1e-10) ** (0.25 - 1)
    torch.testing.assert_close(g, _per_sample(a_s * dw_dl) * 2 * (v - u) / (SHAPE[0] * N_EL), rtol=1e-10, atol=0)


def test_awm_ppo_clip_zeroes_the_gradient_outside_the_trust_region():
    v, u = _randn(*SHAPE, seed=60), _randn(*SHAPE, seed=61)
    t = torch.full((SHAPE[0],), 0.5, dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5], dtype=F64)
    log_p_old = -sample_mse(v, u) - ratio.log()  # uniform weighting: log p = -l, so exp(log p - old) = ratio
    fn = lambda x: awm_loss(x, u, t, adv, weighting="uniform", log_p_old=log_p_old, clip_range=0.2,  # noqa: E731
                            adv_scale=False)
    loss, stats = fn(v)
    # max(-A r, -A clip(r)): 1.5 -> clipped (1.2) for A > 0, unclipped for A < 0; 0.5 the other way round
    assert float(loss) == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4, rel=1e-12)
    assert float(stats["clip_frac"]) == 1.0 and float(stats["ratio_mean"]) == pytest.approx(1.0, rel=1e-12)
    g = _grad(lambda x: fn(x)[0], v)
    assert bool((g[0] == 0).all()) and bool((g[3] == 0).all())
    for b in (1, 2):  # unclipped: d(-A r)/dv = A r dl/dv
        torch.testing.assert_close(g[b], adv[b] * ratio[b] * 2 * (v[b] - u[b]) / (SHAPE[0] * N_EL), rtol=1e-10, atol=0)


# ----------------------------------------------------------------------------------------------
# timesteps (R7)


def _ks(draws: torch.Tensor, cdf) -> float:
    x = draws.to(F64).sort().values
    n = x.numel()
    f = cdf(x)
    i = torch.arange(1, n + 1, dtype=F64)
    return float(torch.maximum(i / n - f, f - (i - 1) / n).max())


def test_r7_linear_density_matches_p_t_proportional_to_t():
    t = sample_timesteps(20000, 1234, range(20000))
    assert t.dtype == torch.float32 and t.shape == (20000,) and float(t.min()) >= 0 and float(t.max()) <= 1
    assert float(t.double().mean()) == pytest.approx(2 / 3, abs=0.005)
    assert _ks(t, lambda x: x * x) < 1.63 / math.sqrt(20000)  # KS at 1%
    # a wrong density fails the same check (uniform draws against the CDF t^2)
    assert _ks(sample_timesteps(20000, 1234, range(20000), density="uniform"), lambda x: x * x) > 0.1


def test_timesteps_are_addressed_by_seed_index_and_step():
    a = sample_timesteps(4, 11, [3, 8, 1, 5], step=2)
    b = sample_timesteps(2, 11, torch.tensor([5, 3]), step=2)
    assert float(a[3]) == float(b[0]) and float(a[0]) == float(b[1])
    c = sample_timesteps(4, 11, [3, 8, 1, 5], step=3)
    d = sample_timesteps(4, 12, [3, 8, 1, 5], step=2)
    assert not torch.equal(a, c) and not torch.equal(a, d)
    torch.testing.assert_close(sample_timesteps(4, 11, [3, 8, 1, 5], step=2), a, rtol=0, atol=0)


def test_timestep_densities_ranges_shift_and_grid():
    n, idx = 4000, range(4000)
    # p(t) ∝ t^2.5 restricted to [0.2, 0.9]
    lo, hi, k = 0.2, 0.9, 3.5
    t = sample_timesteps(n, 5, idx, density="power", alpha=2.5, t_min=lo, t_max=hi)
    assert float(t.min()) >= lo and float(t.max()) <= hi
    assert _ks(t, lambda x: (x**k - lo**k) / (hi**k - lo**k)) < 1.63 / math.sqrt(n)
    # logit-normal, shifted by 3, restricted to [0.3, 0.8]: the shifted density conditioned on the range
    lo, hi, mu, sd = 0.3, 0.8, 0.3, 0.8
    t = sample_timesteps(n, 6, idx, density="logit_normal", logit_mean=mu, logit_std=sd, shift=3.0, t_min=lo,
                         t_max=hi)
    assert float(t.min()) >= lo and float(t.max()) <= hi and float(((t == lo) | (t == hi)).float().mean()) < 0.01

    def base_cdf(x):
        return torch.special.ndtr((torch.logit(shift_sigmas(x, 1 / 3.0)) - mu) / sd)

    f_lo, f_hi = base_cdf(torch.tensor(lo, dtype=F64)), base_cdf(torch.tensor(hi, dtype=F64))
    assert _ks(t, lambda x: (base_cdf(x) - f_lo) / (f_hi - f_lo)) < 1.63 / math.sqrt(n)
    # on the full range the shift is applied to each draw
    base = sample_timesteps(50, 7, range(50), density="uniform")
    torch.testing.assert_close(sample_timesteps(50, 7, range(50), density="uniform", shift=3.0),
                               shift_sigmas(base, 3.0), rtol=1e-6, atol=1e-7)
    # grid: only grid values inside the range, each about equally often
    grid = [1.0, 0.9, 0.75, 0.5, 0.25]
    t = sample_timesteps(3000, 8, range(3000), density="grid", grid=grid, t_min=0.3, t_max=0.95)
    values, counts = torch.unique(t, return_counts=True)
    torch.testing.assert_close(values, torch.tensor([0.5, 0.75, 0.9]))
    assert bool(((counts / 3000.0 - 1 / 3).abs() < 0.03).all())


# ----------------------------------------------------------------------------------------------
# monitors and errors


def test_velocity_monitors_values():
    v, v_old, v_ref, u = (_randn(*SHAPE, seed=s) for s in (70, 71, 72, 73))
    mon = velocity_monitors(v.float(), v_old, v_ref, u)
    mse = lambda a, b: float(((a - b) ** 2).mean())  # noqa: E731
    assert mon["v_ref_mse"] == pytest.approx(mse(v.float().double(), v_ref), rel=1e-12)
    assert mon["v_old_mse"] == pytest.approx(mse(v.float().double(), v_old), rel=1e-12)
    assert mon["fm_mse_old"] == pytest.approx(mse(v_old, u), rel=1e-12)
    assert mon["fm_mse_ref"] == pytest.approx(mse(v_ref, u), rel=1e-12)
    assert mon["v_norm_ratio"] == pytest.approx(float(v.float().double().norm() / v_ref.norm()), rel=1e-12)
    assert velocity_monitors(v_ref, v_old, v_ref, u)["v_norm_ratio"] == 1.0


def test_bad_inputs_raise_clear_errors():
    v, u = _randn(*SHAPE, seed=80), _randn(*SHAPE, seed=81)
    adv, t = torch.zeros(SHAPE[0], dtype=F64), torch.full((SHAPE[0],), 0.5, dtype=F64)
    for m in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="multiplier m must be a finite number > 0"):
            ram_loss(v, u, u, u, adv, m)
    with pytest.raises(ValueError, match=r"advantages must be one value per sample, \[B\] = \[4\], got shape \(4, 1\)"):
        ram_loss(v, u, u, u, adv[:, None], 1.0)
    with pytest.raises(ValueError, match=r"advantages holds NaN / inf at sample\(s\) \[2\]"):
        ram_target(v, u, u, torch.tensor([0.0, 1.0, math.nan, 0.0], dtype=F64), 1.0)
    with pytest.raises(ValueError, match=r"v_theta of shape \(4, 3, 2, 3, 3\) and u of shape \(4, 3, 2, 3\)"):
        ram_loss(v, v, v, u[..., 0], adv, 1.0)
    with pytest.raises(ValueError, match=r"v of shape .* and target of shape"):
        sample_mse(v, u[:2])
    with pytest.raises(ValueError, match="mask selects no frame for sample"):
        sample_mse(v, u, mask=torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="unknown AWM weighting 'sqrt'"):
        awm_loss(v, u, t, adv, weighting="sqrt")
    with pytest.raises(ValueError, match="p must be a finite number > 0"):
        awm_weight(sample_mse(v, u), t, "ghuber", p=0.0)
    with pytest.raises(ValueError, match="clip_range must be a finite number > 0"):
        awm_loss(v, u, t, adv, clip_range=0.0)
    with pytest.raises(ValueError, match="adv_scale divides A by adv_clip"):
        awm_loss(v, u, t, adv, adv_clip=math.inf)
    with pytest.raises(ValueError, match="beta = 0.1 > 0 needs v_ref"):
        awm_loss(v, u, t, adv, beta=0.1)
    with pytest.raises(ValueError, match=r"t must lie in \[0, 1\]"):
        awm_loss(v, u, t + 1.0, adv)
    with pytest.raises(ValueError, match="weights holds NaN"):
        advantage_weighted_fm_loss(v, u, torch.tensor([0.0, math.nan, 0.0, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="need t_min < t_max"):
        sample_timesteps(2, 0, [0, 1], t_min=0.5, t_max=0.5)
    with pytest.raises(ValueError, match="alpha must be a finite number > -1"):
        sample_timesteps(2, 0, [0, 1], density="power", alpha=-1.0)
    with pytest.raises(ValueError, match="use density='power'"):
        sample_timesteps(2, 0, [0, 1], alpha=2.0)
    with pytest.raises(ValueError, match="unknown timestep density 'beta'"):
        sample_timesteps(2, 0, [0, 1], density="beta")
    with pytest.raises(ValueError, match="needs a non-empty grid"):
        sample_timesteps(2, 0, [0, 1], density="grid", grid=[])
    with pytest.raises(ValueError, match=r"no grid value lies in \[t_min, t_max\]"):
        sample_timesteps(2, 0, [0, 1], density="grid", grid=[0.9], t_max=0.5)
    with pytest.raises(ValueError, match=r"n must equal len\(indices\) = 2"):
        sample_timesteps(3, 0, [0, 1])


def test_awm_loss_float64_velocity_or_target_alone_gives_float64():
    """awm_loss with only v_theta (or only u) float64 runs in float64: loss -mean(A)/adv_clip on-policy and fm_mse equal
    the float64 closed forms."""
    v64 = _randn(3, 4, seed=1) + 1 / 3
    u64 = _randn(3, 4, seed=2) + 1 / 3
    t = torch.tensor([0.2, 0.5, 0.9])
    adv = torch.tensor([1.0, -2.0, 0.5])
    for v, u in ((v64, u64.float()), (v64.float(), u64)):
        loss, stats = awm_loss(v, u, t, adv, weighting="uniform")
        assert loss.dtype == F64 and stats["fm_mse"].dtype == F64
        ref_mse = ((v.to(F64) - u.to(F64)) ** 2).mean(dim=1).mean()
        torch.testing.assert_close(stats["fm_mse"], ref_mse, rtol=0, atol=1e-12)
        torch.testing.assert_close(loss, -adv.to(F64).mean() / 5.0, rtol=0, atol=1e-12)
