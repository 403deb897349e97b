"""Tests of genrl.flow: schedules, samplers, conversions, loss, Euler step, CFG."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow import (
    TimestepSampler,
    add_noise,
    cfg_combine,
    eps_from_velocity,
    euler_step,
    expand_sigma,
    flow_matching_loss,
    loss_weighting,
    shift_sigmas,
    sigma_schedule,
    sigmas_to_timesteps,
    timesteps_to_sigmas,
    velocity_from_eps,
    velocity_from_x0,
    velocity_target,
    x0_from_velocity,
)

F64 = torch.float64


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# schedules


def test_shift_golden_timesteps():
    sigmas = timesteps_to_sigmas(torch.tensor([1000.0, 750.0, 500.0, 250.0], dtype=F64))
    got = sigmas_to_timesteps(shift_sigmas(sigmas, 5.0))
    expected = torch.tensor([1000.0, 937.5, 2500.0 / 3.0, 625.0], dtype=F64)
    assert got.dtype == F64
    assert torch.allclose(got, expected, rtol=0, atol=1e-9)
    # the same grid from sigma_schedule
    sched = sigma_schedule(4, shift=5.0)
    assert torch.allclose(sigmas_to_timesteps(sched[:-1]), expected, rtol=0, atol=1e-9)
    # python floats stay floats
    assert shift_sigmas(0.5, 5.0) == pytest.approx(2.5 / 3.0, abs=1e-15)
    assert sigmas_to_timesteps(0.25) == 250.0


def test_shift_identity_endpoints_and_composition():
    s = torch.linspace(0, 1, 101, dtype=F64)
    assert torch.equal(shift_sigmas(s, 1.0), s)
    for k in (0.3, 3.0, 5.0):
        out = shift_sigmas(s, k)
        assert out[0] == 0.0 and out[-1] == 1.0
        assert bool((out[1:] > out[:-1]).all())
        assert bool((out[1:-1] > s[1:-1]).all()) == (k > 1)
    # shifts compose multiplicatively
    assert torch.allclose(shift_sigmas(shift_sigmas(s, 2.0), 3.0), shift_sigmas(s, 6.0), rtol=0, atol=1e-12)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="shift"):
            shift_sigmas(s, bad)


@pytest.mark.parametrize("shift", [0.5, 1.0, 3.0, 5.0])
@pytest.mark.parametrize("sigma_max,sigma_min", [(1.0, 0.0), (0.9, 0.0), (1.0, 0.05)])
def test_sigma_schedule(shift, sigma_max, sigma_min):
    n = 10
    sched = sigma_schedule(n, shift=shift, sigma_max=sigma_max, sigma_min=sigma_min)
    assert sched.shape == (n + 1,) and sched.dtype == F64
    assert sched[0].item() == pytest.approx(shift_sigmas(sigma_max, shift), abs=1e-15)
    assert sched[-1].item() == 0.0
    assert bool((sched[1:] < sched[:-1]).all())
    assert bool(((sched >= 0) & (sched <= 1)).all())


def test_sigma_schedule_shift_one_is_linspace_and_errors():
    assert torch.equal(sigma_schedule(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0], dtype=F64))
    assert torch.equal(sigma_schedule(1), torch.tensor([1.0, 0.0], dtype=F64))
    with pytest.raises(ValueError, match="num_steps"):
        sigma_schedule(0)
    with pytest.raises(ValueError, match="sigma_min"):
        sigma_schedule(4, sigma_min=0.5, sigma_max=0.5)
    with pytest.raises(ValueError, match="sigma_max=1.5"):
        sigma_schedule(4, sigma_max=1.5)
    with pytest.raises(ValueError, match="shift"):
        sigma_schedule(4, shift=0.0)


# ----------------------------------------------------------------------------------------------
# timestep sampler


@pytest.mark.parametrize("kind", ["uniform", "logit_normal", "shifted", "clamped"])
def test_sampler_range_dtype_determinism(kind):
    sampler = TimestepSampler(kind=kind, shift=3.0, sigma_min=0.2, sigma_max=0.7)
    a = sampler((4000,), _gen(1))
    b = sampler(4000, _gen(1))
    c = sampler(4000, _gen(2))
    assert a.dtype == torch.float32 and a.shape == (4000,)
    assert bool(((a >= 0.2) & (a <= 0.7)).all())
    assert a.min() < 0.3 and a.max() > 0.6  # it actually covers the range
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert sampler((3, 5), _gen(0)).shape == (3, 5)


def test_sampler_does_not_touch_global_rng():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    TimestepSampler("logit_normal")(100, _gen(0))
    TimestepSampler("uniform")(100, _gen(0))
    assert torch.equal(torch.get_rng_state(), state)


def test_sampler_distributions():
    n = 200_000
    ln = TimestepSampler("logit_normal", logit_mean=0.0, logit_std=1.0)(n, _gen(3))
    assert abs(ln.mean().item() - 0.5) < 0.005
    assert abs(ln.median().item() - 0.5) < 0.01
    # logit_mean > 0 moves mass towards noise
    assert TimestepSampler("logit_normal", logit_mean=1.0)(n, _gen(3)).mean() > 0.65
    un = TimestepSampler("uniform")(n, _gen(4))
    assert abs(un.mean().item() - 0.5) < 0.005
    assert abs(un.var().item() - 1 / 12) < 0.002
    # E[shift(u)] for u ~ U[0,1], s = 3: int_0^1 3u/(1+2u) du = 1.5 - 0.75 ln 3
    sh = TimestepSampler("shifted", shift=3.0)(n, _gen(5))
    assert abs(sh.mean().item() - (1.5 - 0.75 * math.log(3.0))) < 0.005
    cl = TimestepSampler("clamped", sigma_min=0.2, sigma_max=0.6)(n, _gen(6))
    assert abs(cl.mean().item() - 0.4) < 0.005
    assert abs(cl.var().item() - 0.4**2 / 12) < 0.001


@pytest.mark.parametrize("kind", ["uniform", "logit_normal", "shifted", "clamped"])
def test_sampler_shift_then_range_map(kind):
    # stage order: base draw -> shift (any kind) -> affine map into [sigma_min, sigma_max]
    base = TimestepSampler(kind=kind)(1000, _gen(21))
    full = TimestepSampler(kind=kind, shift=3.0, sigma_min=0.1, sigma_max=0.6)(1000, _gen(21))
    expected = 0.1 + 0.5 * shift_sigmas(base, 3.0)
    assert torch.allclose(full, expected, rtol=0, atol=1e-6)
    if kind == "logit_normal":
        assert not torch.allclose(base, torch.rand(1000, generator=_gen(21)))  # not a uniform draw


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="gaussian"), "gaussian"),
        (dict(logit_std=0.0), "logit_std.*0.0"),
        (dict(logit_std=-1.0), "logit_std.*-1.0"),
        (dict(shift=0.0), "shift.*0.0"),
        (dict(sigma_min=0.5, sigma_max=0.5), "sigma_min=0.5"),
        (dict(sigma_min=0.8, sigma_max=0.3), "sigma_min=0.8"),
        (dict(sigma_max=1.5), "sigma_max.*1.5"),
        (dict(sigma_min=-0.1), "sigma_min.*-0.1"),
    ],
)
def test_sampler_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TimestepSampler(**kwargs)


# ----------------------------------------------------------------------------------------------
# expand_sigma and conversions

LAYOUTS = [((2, 3, 4, 5, 6), 1), ((2, 4, 3, 5, 6), 2)]  # [B,T,C,H,W] and Wan's [B,C,T,H,W], T = 3


def test_expand_sigma_shapes():
    x = torch.zeros(2, 4, 3, 5, 6)  # Wan layout, T = 3 on dim 2
    assert expand_sigma(0.5, x).shape == ()
    assert expand_sigma(torch.tensor(0.5), x).shape == ()
    assert expand_sigma(torch.tensor([0.1, 0.2]), x).shape == (2, 1, 1, 1, 1)
    per_frame = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    e = expand_sigma(per_frame, x, frame_dim=2)
    assert e.shape == (2, 1, 3, 1, 1)
    assert e[1, 0, 2, 0, 0] == per_frame[1, 2]
    assert torch.equal(expand_sigma(per_frame, x, frame_dim=-3), e)
    assert expand_sigma(per_frame, torch.zeros(2, 3, 4, 5, 6), frame_dim=1).shape == (2, 3, 1, 1, 1)
    assert expand_sigma(torch.tensor([0.1], dtype=F64), x).dtype == F64
    assert expand_sigma(0.1, x.to(torch.bfloat16)).dtype == torch.float32


@pytest.mark.parametrize(
    "sigma_shape,frame_dim",
    [((3,), 1), ((2, 5), 1), ((2, 3), 1), ((2, 3), 0), ((2, 3), 5), ((2, 3, 1), 1), ((3, 3), 2)],
)
def test_expand_sigma_errors(sigma_shape, frame_dim):
    x = torch.zeros(2, 4, 3, 5, 6)  # [B, C, T, H, W]: the only valid per-frame call is [2, 3] on dim 2
    with pytest.raises(ValueError, match=r"sigma of shape \(.*\) does not fit x of shape \(2, 4, 3, 5, 6\)"):
        expand_sigma(torch.rand(sigma_shape), x, frame_dim=frame_dim)


@pytest.mark.parametrize("shape,frame_dim", LAYOUTS)
@pytest.mark.parametrize("per_frame", [False, True])
def test_conversions_round_trip_float64(shape, frame_dim, per_frame):
    g = _gen(7)
    x0 = torch.randn(shape, generator=g, dtype=F64)
    eps = torch.randn(shape, generator=g, dtype=F64)
    b, t = shape[0], shape[frame_dim]
    sigma_shape = (b, t) if per_frame else (b,)
    sigma = 0.05 + 0.9 * torch.rand(sigma_shape, generator=g, dtype=F64)

    x = add_noise(x0, eps, sigma, frame_dim)
    s = expand_sigma(sigma, x0, frame_dim)
    assert torch.allclose(x, (1 - s) * x0 + s * eps, rtol=0, atol=1e-15)
    if per_frame:  # frame j of sample i is noised with sigma[i, j]
        i, j = 1, 2
        idx = (i, j) if frame_dim == 1 else (i, slice(None), j)
        ref = (1 - sigma[i, j]) * x0[idx] + sigma[i, j] * eps[idx]
        assert torch.allclose(x[idx], ref, rtol=0, atol=1e-15)

    v = velocity_from_x0(x, sigma, x0, frame_dim)
    assert v.dtype == F64
    assert torch.allclose(v, velocity_target(x0, eps), rtol=0, atol=1e-12)
    assert torch.allclose(velocity_from_eps(x, sigma, eps, frame_dim), v, rtol=0, atol=1e-12)
    assert torch.allclose(x0_from_velocity(x, sigma, v, frame_dim), x0, rtol=0, atol=1e-12)
    assert torch.allclose(eps_from_velocity(x, sigma, v, frame_dim), eps, rtol=0, atol=1e-12)


def test_conversion_endpoints_dtypes_and_errors():
    g = _gen(8)
    x0 = torch.randn(2, 3, 4, generator=g)
    eps = torch.randn(2, 3, 4, generator=g)
    assert torch.equal(add_noise(x0, eps, 0.0), x0)
    assert torch.equal(add_noise(x0, eps, 1.0), eps)
    out = add_noise(x0.bfloat16(), eps.bfloat16(), torch.tensor([0.3, 0.6]))
    assert out.dtype == torch.float32
    # denominators are clamped: finite at the singular ends
    assert torch.allclose(velocity_from_x0(x0, 0.0, x0 + 1), torch.full_like(x0, -1e5), rtol=1e-6)
    assert torch.allclose(velocity_from_eps(eps, 1.0, eps + 1), torch.full_like(eps, 1e5), rtol=1e-6)
    assert torch.allclose(velocity_from_x0(x0, 0.0, x0 + 1, min_denom=0.5), torch.full_like(x0, -2.0))
    # away from the ends no clamping happens, even close to them
    x = add_noise(x0.double(), eps.double(), 0.99)
    assert torch.allclose(velocity_from_eps(x, 0.99, eps.double()), (eps - x0).double(), atol=1e-12)
    x = add_noise(x0.double(), eps.double(), 0.01)
    assert torch.allclose(velocity_from_x0(x, 0.01, x0.double()), (eps - x0).double(), atol=1e-12)
    with pytest.raises(ValueError, match=r"\(2, 3, 4\).*\(2, 3, 5\)"):
        add_noise(x0, torch.zeros(2, 3, 5), 0.5)
    with pytest.raises(ValueError, match="min_denom"):
        velocity_from_x0(x0, 0.5, x0, min_denom=0.0)


# ----------------------------------------------------------------------------------------------
# losses


def test_loss_weighting_closed_forms():
    s = torch.tensor([0.1, 0.25, 0.5, 0.9], dtype=F64)
    assert torch.equal(loss_weighting(s, "none"), torch.ones(4, dtype=F64))
    assert torch.allclose(loss_weighting(s, "sigma_sqrt"), torch.tensor([100.0, 16.0, 4.0, 1 / 0.81], dtype=F64))
    expected_cosmap = torch.tensor([2 / (math.pi * (1 - 0.2 + 0.02)), 2 / (math.pi * 0.625), 4 / math.pi,
                                    2 / (math.pi * (1 - 1.8 + 1.62))], dtype=F64)
    assert torch.allclose(loss_weighting(s, "cosmap"), expected_cosmap, rtol=1e-14, atol=0)
    assert loss_weighting(0.0, "cosmap").item() == pytest.approx(2 / math.pi)
    assert loss_weighting(1.0, "cosmap").item() == pytest.approx(2 / math.pi)
    # sigma_sqrt is clamped at sigma = 0
    assert loss_weighting(0.0, "sigma_sqrt").item() == pytest.approx(1e6)
    assert loss_weighting(torch.tensor([0.5]), "cosmap").dtype == torch.float32
    with pytest.raises(ValueError, match="bogus"):
        loss_weighting(s, "bogus")


def _optimal_velocity(x, sigma, mu, s2):
    """E[eps - x0 | x_sigma] for x0 ~ N(mu, s2), eps ~ N(0, 1) (derived in the test module doc)."""
    var = (1 - sigma) ** 2 * s2 + sigma**2
    centered = x - (1 - sigma) * mu
    e_x0 = mu + (1 - sigma) * s2 * centered / var
    e_eps = sigma * centered / var
    return e_eps - e_x0


@pytest.mark.parametrize("sigma", [0.1, 0.3, 0.5, 0.8, 0.95])
def test_loss_matches_gaussian_closed_form(sigma):
    # x0 ~ N(mu, s^2) i.i.d. over 4 dims, eps ~ N(0, 1). With V = (1-sigma)^2 s^2 + sigma^2 the
    # Bayes-optimal velocity is E[eps - x0 | x] and the minimal expected loss per element is
    # Var(eps - x0) - Var(E[eps - x0 | x]) = 1 + s^2 - (sigma - (1-sigma) s^2)^2 / V.
    mu, std, n = 0.7, 1.5, 200_000
    s2 = std**2
    g = _gen(int(sigma * 1000))
    x0 = mu + std * torch.randn(n, 1, 4, generator=g, dtype=F64)
    eps = torch.randn(n, 1, 4, generator=g, dtype=F64)
    x = add_noise(x0, eps, sigma)
    v_star = _optimal_velocity(x, sigma, mu, s2)

    per_sample = flow_matching_loss(v_star, x0, eps, sigma)
    assert per_sample.shape == (n,) and per_sample.dtype == F64
    mc, se = per_sample.mean().item(), per_sample.std().item() / math.sqrt(n)
    var = (1 - sigma) ** 2 * s2 + sigma**2
    analytic = 1 + s2 - (sigma - (1 - sigma) * s2) ** 2 / var
    assert abs(mc - analytic) < 4 * se, (mc, analytic, se)

    # any other velocity does strictly worse: 0 has expected loss 1 + s^2 + mu^2
    zero = flow_matching_loss(torch.zeros_like(x), x0, eps, sigma).mean().item()
    assert zero > analytic + 0.1 and abs(zero - (1 + s2 + mu**2)) < 0.05
    off = flow_matching_loss(v_star + 0.1, x0, eps, sigma).mean().item()
    assert off > mc + 0.005


def test_loss_per_sample_sigma_and_weighting():
    g = _gen(9)
    x0, eps, v = (torch.randn(3, 2, 4, 5, generator=g, dtype=F64) for _ in range(3))
    sigma = torch.tensor([0.2, 0.5, 0.9], dtype=F64)
    plain = flow_matching_loss(v, x0, eps, sigma)
    manual = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    assert torch.allclose(plain, manual, rtol=1e-14, atol=0)
    for kind in ("sigma_sqrt", "cosmap"):
        weighted = flow_matching_loss(v, x0, eps, sigma, weighting=kind)
        assert torch.allclose(weighted, plain * loss_weighting(sigma, kind), rtol=1e-13, atol=0)
    # per-frame sigma: each frame gets its own weight
    pf = torch.tensor([[0.2, 0.8], [0.5, 0.5], [0.1, 0.9]], dtype=F64)
    weighted = flow_matching_loss(v, x0, eps, pf, weighting="sigma_sqrt")
    frame_se = ((v - (eps - x0)) ** 2).mean(dim=(2, 3))  # [B, T]
    assert torch.allclose(weighted, (frame_se * pf**-2).mean(dim=1), rtol=1e-13, atol=0)


def test_loss_dtype_grad_and_errors():
    g = _gen(10)
    x0, eps = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    v = torch.randn(2, 3, 4, generator=g).bfloat16().requires_grad_()
    loss = flow_matching_loss(v, x0.bfloat16(), eps.bfloat16(), torch.tensor([0.3, 0.7]))
    assert loss.dtype == torch.float32 and loss.shape == (2,)
    loss.sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"v_pred of shape \(2, 3, 4\) and x0 of shape \(2, 3, 5\)"):
        flow_matching_loss(v, torch.zeros(2, 3, 5), torch.zeros(2, 3, 5), 0.5)
    with pytest.raises(ValueError, match="sigma of shape"):
        flow_matching_loss(v, x0, eps, torch.rand(3))
    with pytest.raises(ValueError, match="weighting"):
        flow_matching_loss(v, x0, eps, 0.5, weighting="snr")


@pytest.mark.parametrize("shape,frame_dim", LAYOUTS)
def test_loss_mask(shape, frame_dim):
    g = _gen(11)
    x0, eps, v = (torch.randn(shape, generator=g, dtype=F64) for _ in range(3))
    sigma = torch.tensor([0.3, 0.6], dtype=F64)
    mask = torch.tensor([[True, False, True], [False, True, False]])
    loss = flow_matching_loss(v, x0, eps, sigma, mask=mask, frame_dim=frame_dim)

    # manual: mean over the masked frames only
    se = (v - (eps - x0)) ** 2
    se_frames = se.movedim(frame_dim, 1)  # [B, T, ...]
    manual = torch.stack([se_frames[b][mask[b]].mean() for b in range(2)])
    assert torch.allclose(loss, manual, rtol=1e-14, atol=0)
    assert not torch.allclose(loss, flow_matching_loss(v, x0, eps, sigma, frame_dim=frame_dim))

    # perturbing a masked-out frame (even to NaN / inf) changes nothing
    v2 = v.clone().movedim(frame_dim, 1)
    v2[0, 1] = float("nan")
    v2[1, 0] = float("inf")
    v2[1, 2] += 100.0
    v2 = v2.movedim(1, frame_dim)
    assert torch.equal(flow_matching_loss(v2, x0, eps, sigma, mask=mask, frame_dim=frame_dim), loss)
    # ...but perturbing a masked-in frame does
    v3 = v.clone().movedim(frame_dim, 1)
    v3[0, 0] += 1.0
    v3 = v3.movedim(1, frame_dim)
    changed = flow_matching_loss(v3, x0, eps, sigma, mask=mask, frame_dim=frame_dim)
    assert changed[0] > loss[0] and changed[1] == loss[1]

    with pytest.raises(ValueError, match=r"sample\(s\) \[1\]"):
        flow_matching_loss(v, x0, eps, sigma, mask=torch.tensor([[True, False, False], [False] * 3]),
                           frame_dim=frame_dim)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 4\)"):
        flow_matching_loss(v, x0, eps, sigma, mask=torch.ones(2, 4, dtype=torch.bool), frame_dim=frame_dim)


# ----------------------------------------------------------------------------------------------
# Euler step and CFG


@pytest.mark.parametrize("shape,frame_dim", LAYOUTS)
def test_euler_step_exact_on_linear_path(shape, frame_dim):
    g = _gen(12)
    x0 = torch.randn(shape, generator=g, dtype=F64)
    eps = torch.randn(shape, generator=g, dtype=F64)
    v = velocity_target(x0, eps)
    b, t = shape[0], shape[frame_dim]
    cases = [
        (1.0, 0.0),
        (0.3, 0.7),  # backwards (towards noise) works too
        (torch.tensor([0.9, 0.4], dtype=F64), torch.tensor([0.2, 0.35], dtype=F64)),
        (torch.rand(b, t, generator=g, dtype=F64), torch.rand(b, t, generator=g, dtype=F64)),
        (torch.rand(b, t, generator=g, dtype=F64), 0.0),
    ]
    for s, s_next in cases:
        x = add_noise(x0, eps, s, frame_dim)
        out = euler_step(x, v, s, s_next, frame_dim)
        assert out.dtype == F64
        assert torch.allclose(out, add_noise(x0, eps, s_next, frame_dim), rtol=0, atol=1e-12)


def test_euler_step_dtype_and_errors():
    x = torch.randn(2, 3, 4).bfloat16()
    v = torch.randn(2, 3, 4).bfloat16()
    out = euler_step(x, v, 0.5, 0.25)
    assert out.dtype == torch.float32
    assert torch.equal(out, x.float() - 0.25 * v.float())
    with pytest.raises(ValueError, match=r"\(2, 3, 4\).*\(2, 3, 5\)"):
        euler_step(x, torch.zeros(2, 3, 5), 0.5, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_cfg_combine(dtype):
    g = _gen(13)
    cond = torch.randn(3, 2, 4, generator=g, dtype=dtype)
    uncond = torch.randn(3, 2, 4, generator=g, dtype=dtype)
    assert torch.equal(cfg_combine(cond, uncond, 1.0), cond)
    assert torch.equal(cfg_combine(cond, uncond, 0.0), uncond)
    for s in (0.5, 2.0, 4.5):  # reference form cond + s (cond - uncond) is ours at w = s + 1
        ref = cond + s * (cond - uncond)
        assert torch.allclose(cfg_combine(cond, uncond, s + 1.0), ref, rtol=1e-6, atol=1e-6)
    w = torch.tensor([1.0, 0.0, 3.0], dtype=dtype)
    out = cfg_combine(cond, uncond, w)
    assert torch.equal(out[0], cond[0]) and torch.equal(out[1], uncond[1])
    assert torch.allclose(out[2], uncond[2] + 3.0 * (cond[2] - uncond[2]), rtol=1e-6, atol=1e-6)
    assert out.dtype == dtype


def test_cfg_combine_upcasts_and_errors():
    cond = torch.randn(2, 3).bfloat16()
    uncond = torch.randn(2, 3).bfloat16()
    assert cfg_combine(cond, uncond, 4.0).dtype == torch.float32
    assert torch.equal(cfg_combine(cond, uncond, 1.0), cond.float())
    with pytest.raises(ValueError, match=r"scale of shape \(3,\)"):
        cfg_combine(cond, uncond, torch.ones(3))
    with pytest.raises(ValueError, match=r"cond of shape \(2, 3\) and uncond of shape \(2, 4\)"):
        cfg_combine(cond, torch.zeros(2, 4), 1.0)


# ----------------------------------------------------------------------------------------------
# flow_matching_loss contracts: an explicit per-sample, per-frame formula (mutation testing, issue 26)


def _fm_weight(s: float, weighting: str) -> float:
    if weighting == "none":
        return 1.0
    if weighting == "sigma_sqrt":
        return max(s, 1e-3) ** -2
    return 2.0 / (math.pi * (1 - 2 * s + 2 * s * s))


def _fm_reference(v, x0, eps, sigma, weighting, mask, frame_dim):
    """loss[b] = sum_{t, e in frame t} m[b, t] w(sigma[b, t]) (v - (eps - x0))^2 / sum m[b, t] * #e, by loops."""
    fd = frame_dim % x0.ndim
    se = (v.double() - (eps.double() - x0.double())).square()
    b_n, t_n = x0.shape[0], x0.shape[fd]
    out = []
    for b in range(b_n):
        num = den = 0.0
        for t in range(t_n):
            frame = se[b].select(fd - 1, t)
            if isinstance(sigma, float):
                s = sigma
            elif sigma.ndim == 1:
                s = float(sigma[b])
            else:
                s = float(sigma[b, t])
            m = 1.0 if mask is None else float(mask[b, t])
            if m > 0:
                num += m * _fm_weight(s, weighting) * float(frame.sum())
            den += m * frame.numel()
        out.append(num / den)
    return torch.tensor(out, dtype=F64)


_FM_LAYOUTS = (((2, 3, 2, 4), 1), ((2, 2, 3, 4), 2), ((2, 2, 3, 4), -2), ((2, 3, 2, 1, 2), -4), ((2, 3), 1))


@pytest.mark.parametrize("shape,frame_dim", _FM_LAYOUTS)
@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
@pytest.mark.parametrize("sigma_kind", ["float", "per_sample", "per_frame"])
def test_flow_matching_loss_equals_the_explicit_formula(shape, frame_dim, weighting, sigma_kind):
    """Every weighting, sigma form, frame layout (negative frame_dim too) and mask (bool, float weights,
    one frame): the loss equals a per-frame loop in float64."""
    g = _gen(12)
    x0, eps, v = (torch.randn(shape, generator=g, dtype=F64) + 1 / 3 for _ in range(3))
    t_n = shape[frame_dim % len(shape)]
    sigma = {
        "float": 0.3,
        "per_sample": torch.tensor([0.2, 0.0005], dtype=F64),
        "per_frame": torch.tensor([[0.1, 0.5, 0.9], [0.0, 0.7, 0.4]], dtype=F64)[:, :t_n],
    }[sigma_kind]
    masks = (
        None,
        torch.tensor([[True, False, True], [False, False, True]])[:, :t_n],
        torch.tensor([[0.5, 0.0, 2.0], [0.0, 0.25, 0.0]], dtype=F64)[:, :t_n],  # weights; 0.25 on one frame only
        torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float32)[:, :t_n],  # one frame each
    )
    for mask in masks:
        loss = flow_matching_loss(v, x0, eps, sigma, weighting=weighting, mask=mask, frame_dim=frame_dim)
        ref = _fm_reference(v, x0, eps, sigma, weighting, mask, frame_dim)
        assert loss.dtype == F64 and loss.shape == (2,)
        torch.testing.assert_close(loss, ref, rtol=1e-14, atol=1e-12)


@pytest.mark.parametrize("f64", ["v_pred", "x0", "eps", "sigma"])
def test_flow_matching_loss_dtype_contract_one_float64_input(f64):
    """One float64 input (values float32 cannot represent) among float32 ones: float64 result equal to the
    float64 formula; all float32 (or bf16) inputs give float32."""
    g = _gen(13)
    vals = {k: torch.randn(2, 3, 4, generator=g, dtype=F64) + 1 / 3 for k in ("v_pred", "x0", "eps")}
    vals["sigma"] = torch.tensor([[0.2, 0.6, 0.9], [1 / 3, 0.5, 0.1]], dtype=F64)
    args = {k: (t if k == f64 else t.float()) for k, t in vals.items()}
    mask = torch.tensor([[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]], dtype=torch.float32)
    for weighting in ("none", "sigma_sqrt", "cosmap"):
        for m in (None, mask):
            loss = flow_matching_loss(args["v_pred"], args["x0"], args["eps"], args["sigma"], weighting, m)
            assert loss.dtype == F64
            ref = _fm_reference(args["v_pred"], args["x0"], args["eps"], args["sigma"], weighting, m, 1)
            torch.testing.assert_close(loss, ref, rtol=1e-14, atol=1e-12)
    f32 = {k: t.float() for k, t in vals.items()}
    assert flow_matching_loss(f32["v_pred"], f32["x0"], f32["eps"], f32["sigma"], "cosmap", mask).dtype == torch.float32
    bf = {k: t.bfloat16() for k, t in vals.items()}
    assert flow_matching_loss(bf["v_pred"], bf["x0"], bf["eps"], 0.5, "cosmap", mask).dtype == torch.float32


def test_flow_matching_loss_errors_name_the_bad_argument():
    """Shape errors name x0 / eps with both shapes; a bad mask or frame_dim names the mask, frame_dim and the
    expected [B, T] (numbers when frame_dim is valid)."""
    v = torch.zeros(2, 4, 5, dtype=F64)
    for name in ("x0", "eps"):
        args = {"x0": v, "eps": v, name: torch.zeros(2, 4, 6, dtype=F64)}
        with pytest.raises(ValueError, match=rf"^v_pred of shape \(2, 4, 5\) and {name} of shape \(2, 4, 6\) must"):
            flow_matching_loss(v, args["x0"], args["eps"], 0.5)
    for frame_dim, t_n in ((1, 4), (2, 5), (-1, 5), (-2, 4)):
        with pytest.raises(ValueError, match=(
            rf"^mask of shape \(2, 3\) does not fit latents of shape \(2, 4, 5\) with frame_dim={frame_dim}: "
            rf"expected \[2, {t_n}\]$"
        )):
            flow_matching_loss(v, v, v, 0.5, mask=torch.ones(2, 3, dtype=torch.bool), frame_dim=frame_dim)
    for frame_dim, mask_shape in ((0, (2, 2)), (3, (2, 5)), (-3, (2, 2)), (-4, (2, 4))):
        with pytest.raises(ValueError, match=(
            rf"^mask of shape \({mask_shape[0]}, {mask_shape[1]}\) does not fit latents of shape \(2, 4, 5\) "
            rf"with frame_dim={frame_dim}: expected \[B, T\]$"
        )):
            flow_matching_loss(v, v, v, 0.5, mask=torch.ones(mask_shape, dtype=torch.bool), frame_dim=frame_dim)
    # Wan layout: a per-frame sigma is matched against frame_dim (T = 3 on dim 2, C = 2 on dim 1)
    wan = torch.zeros(2, 2, 3, 4, dtype=F64)
    flow_matching_loss(wan, wan, wan, torch.full((2, 3), 0.5, dtype=F64), "cosmap", frame_dim=2)
    with pytest.raises(ValueError, match=r"sigma of shape \(2, 2\)"):
        flow_matching_loss(wan, wan, wan, torch.full((2, 2), 0.5, dtype=F64), "cosmap", frame_dim=2)
def test_sigma_schedule_device_and_num_steps_type():
    """sigma_schedule builds on the requested device (meta here) and rejects a bool or non-int num_steps by name."""
    out = sigma_schedule(3, device="meta")
    assert out.device.type == "meta" and out.dtype == F64 and out.shape == (4,)
    for bad in (True, 2.5):
        with pytest.raises(ValueError, match="num_steps must be an int"):
            sigma_schedule(bad)


def test_expand_sigma_default_frame_dim_and_promoted_dtype():
    """expand_sigma's frame_dim defaults to 1 ([B, T, C, H, W]); without dtype the result is compute_dtype(sigma, x)."""
    per_frame = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    x = torch.zeros(2, 3, 4, 5, 6)
    e = expand_sigma(per_frame, x)
    assert e.shape == (2, 3, 1, 1, 1) and torch.equal(e[:, :, 0, 0, 0], per_frame)
    assert expand_sigma(torch.tensor([0.25, 0.5]), x.to(F64)).dtype == F64  # float32 sigma, float64 x
    assert expand_sigma(torch.tensor([0.25, 0.5], dtype=torch.float16), x).dtype == torch.float32
    assert expand_sigma(per_frame, x, dtype=torch.float16).dtype == torch.float16


def test_expand_sigma_type_device_and_shape_rules():
    """expand_sigma: a non-number sigma is a TypeError naming sigma; the result is on x's device (meta here) for a float
    or a CPU tensor; B = 1 broadcasts in a [B, T] sigma; frame_dim 0 is rejected by name; a broadcastable tensor needs
    x.ndim dims and may hold 1s."""
    for bad in (True, "0.5", [0.5]):
        with pytest.raises(TypeError, match="sigma must be a python float or a torch.Tensor"):
            expand_sigma(bad, torch.zeros(2, 3))
    meta = torch.empty(2, 4, 3, 5, 6, device="meta")
    for s in (0.5, torch.tensor(0.5), torch.tensor([0.1, 0.2]), torch.rand(2, 4)):
        assert expand_sigma(s, meta, frame_dim=1).device.type == "meta"
    x = torch.zeros(3, 4, 2, 5)
    one_b = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    assert torch.equal(expand_sigma(one_b, x), one_b.reshape(1, 4, 1, 1))
    with pytest.raises(ValueError, match=r"sigma of shape \(2, 4\) does not fit"):
        expand_sigma(torch.rand(2, 4), x)
    with pytest.raises(ValueError, match="needs 1 <= frame_dim"):
        expand_sigma(torch.rand(3, 3), torch.zeros(3, 3, 2), frame_dim=0)
    full = torch.rand(3, 1, 2, 1)
    assert torch.equal(expand_sigma(full, x), full)
    with pytest.raises(ValueError, match=r"sigma of shape \(3, 1, 1\) does not fit"):
        expand_sigma(torch.rand(3, 1, 1), x)


def test_shift_must_be_a_python_number():
    """A bool or non-number shift is a TypeError naming shift (sigma_schedule and shift_sigmas)."""
    for bad in (True, "2.0"):
        with pytest.raises(TypeError, match="shift must be a python float"):
            sigma_schedule(4, shift=bad)
        with pytest.raises(TypeError, match="shift must be a python float"):
            shift_sigmas(0.5, bad)
