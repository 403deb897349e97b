"""Tests of genrl.flow.sde: dtypes of mixed inputs, documented defaults, boundaries of the input checks."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow import diffusion_coefficient, gaussian_log_prob, sde_step, step_log_prob, step_mean_std

F64, F32 = torch.float64, torch.float32
SHAPE = (2, 3, 4, 2)  # [B, T, C, H]: T != C, so a per-frame sigma on the wrong dim fails
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
KINDS = (("ode", 0.0), ("flow_grpo", 0.7), ("dance_grpo", 0.3))


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _ref_mean_std(kind: str, x, v, s, sn, level: float):
    """float64 closed form of the step (python / float64 inputs), sigmas [B] or floats, no sigma == 1."""
    x, v = x.to(F64), v.to(F64)
    s = torch.as_tensor(s, dtype=F64).reshape(-1, *[1] * (x.ndim - 1))
    sn = torch.as_tensor(sn, dtype=F64).reshape(-1, *[1] * (x.ndim - 1))
    d = sn - s
    if kind == "ode":
        return x + d * v, torch.zeros(torch.broadcast_shapes(s.shape, sn.shape), dtype=F64)
    g = level * torch.sqrt(s / (1 - s)) if kind == "flow_grpo" else torch.full_like(s, level)
    return x + d * (v + g**2 / (2 * s) * (x + (1 - s) * v)), g * d.abs().sqrt()


def test_step_mean_std_mixed_dtypes_run_in_float64():
    """Any one float64 input among x, v, sigma, sigma_next makes the whole step float64 (exact to 1e-12)."""
    s, sn = 1.0 / 3.0, 1.0 / 7.0  # not representable in float32
    for kind, level in KINDS:
        for wide in range(4):
            ins = [_randn(*SHAPE, seed=1, dtype=F32), _randn(*SHAPE, seed=2, dtype=F32), s, sn]
            if wide < 2:
                ins[wide] = _randn(*SHAPE, seed=3 + wide) / 3.0
            else:
                ins[wide] = torch.tensor([ins[wide]] * SHAPE[0], dtype=F64)
            mean, std = step_mean_std(kind, *ins, noise_level=level)
            ref_mean, ref_std = _ref_mean_std(kind, ins[0], ins[1], s, sn, level)
            assert mean.dtype == F64 and std.dtype == F64, (kind, wide)
            assert torch.allclose(mean, ref_mean, atol=1e-12, rtol=0), (kind, wide)
            assert std.shape == ((2, 1, 1, 1) if wide >= 2 else ()), (kind, wide)
            assert torch.allclose(std, ref_std, atol=1e-12, rtol=0), (kind, wide)


def test_step_mean_std_bf16_velocity_is_upcast_before_the_step():
    """A bf16 v with float sigmas is upcast to float32 before the arithmetic (no bf16 rounding of delta * v)."""
    x = _randn(*SHAPE, seed=5, dtype=F32)
    v = _randn(*SHAPE, seed=6, dtype=torch.bfloat16)
    for kind, level in KINDS:
        mean, std = step_mean_std(kind, x, v, 1.0 / 3.0, 1.0 / 7.0, noise_level=level)
        ref_mean, _ = _ref_mean_std(kind, x, v, 1.0 / 3.0, 1.0 / 7.0, level)
        assert mean.dtype == F32 and std.dtype == F32
        assert torch.allclose(mean.to(F64), ref_mean, atol=2e-6, rtol=0), kind


def test_deterministic_step_std_shape_dtype_and_sigma_zero():
    """The deterministic step's std has the broadcast shape of both sigmas and the step dtype; sigma 0 is allowed."""
    x, v = _randn(*SHAPE, seed=7), _randn(*SHAPE, seed=8)
    sb = torch.tensor([0.5, 0.0], dtype=F64)
    for kind, level in KINDS:
        for s, sn in ((sb, 0.0), (0.5, sb * 0.5)):
            if kind != "ode":
                level = 0.0  # noise level 0 is the deterministic step of any kind
            mean, std = step_mean_std(kind, x, v, s, sn, noise_level=level)
            assert std.shape == (2, 1, 1, 1) and std.dtype == F64 and bool((std == 0).all())
            assert torch.allclose(mean, _ref_mean_std("ode", x, v, s, sn, 0.0)[0], atol=1e-15, rtol=0)
    # the "ode" kernel from sigma = 0 (with the default noise_level) is the Euler step, not an error
    mean, std = step_mean_std("ode", x, v, sb, torch.zeros(2, dtype=F64))
    assert torch.allclose(mean, _ref_mean_std("ode", x, v, sb, 0.0, 0.0)[0], atol=1e-15, rtol=0)
    out = sde_step("ode", x.float(), v.float(), 0.5, 0.25, None)
    assert out.log_prob.dtype == F32 and out.log_prob.shape == (2,)
    out = sde_step("ode", x, v, 0.5, 0.25, None)
    assert out.log_prob.dtype == F64 and out.log_prob.shape == (2,)


def test_defaults_are_the_documented_ones():
    """noise_level 0.7, frame_dim 1, reduce "mean" and std_scale 1 are the defaults of the step functions."""
    x, v, noise = _randn(*SHAPE, seed=9), _randn(*SHAPE, seed=10), _randn(*SHAPE, seed=11)
    s = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.5, 0.2]], dtype=F64)  # per-frame [B, T], T on dim 1
    sn = s - 0.1
    explicit = step_mean_std("flow_grpo", x, v, s, sn, 0.7, None, 1)
    default = step_mean_std("flow_grpo", x, v, s, sn)
    assert torch.equal(default[0], explicit[0]) and torch.equal(default[1], explicit[1])
    out_e = sde_step("flow_grpo", x, v, s, sn, noise, 0.7, None, 1, "mean", 1.0)
    out_d = sde_step("flow_grpo", x, v, s, sn, noise)
    for a, b in zip((out_d.sample, out_d.mean, out_d.std, out_d.log_prob), (out_e.sample, out_e.mean, out_e.std,
                                                                              out_e.log_prob)):
        assert torch.equal(a, b)
    lp_d, mean_d, std_d = step_log_prob("flow_grpo", x, v, s, sn, out_d.sample)
    assert torch.equal(lp_d, out_d.log_prob) and torch.equal(std_d, out_d.std)
    assert torch.equal(gaussian_log_prob(out_d.sample, out_d.mean, out_d.std), out_d.log_prob)


def test_std_scale_scales_the_std_exactly():
    """std_scale multiplies the std of sde_step and step_log_prob (2 doubles it, 0.5 halves it); <= 0 is refused."""
    x, v, noise = _randn(*SHAPE, seed=12), _randn(*SHAPE, seed=13), _randn(*SHAPE, seed=14)
    s, sn = torch.tensor([0.6, 0.4], dtype=F64), torch.tensor([0.5, 0.3], dtype=F64)
    base = sde_step("dance_grpo", x, v, s, sn, noise, 0.3)
    for k in (2.0, 0.5):
        out = sde_step("dance_grpo", x, v, s, sn, noise, 0.3, std_scale=k)
        assert torch.allclose(out.std, k * base.std, atol=1e-15, rtol=0)
        assert torch.allclose(out.sample, base.mean + k * base.std * noise, atol=1e-15, rtol=0)
        lp, _, std = step_log_prob("dance_grpo", x, v, s, sn, out.sample, 0.3, std_scale=k)
        assert torch.allclose(std, k * base.std, atol=1e-15, rtol=0) and torch.equal(lp, out.log_prob)
        expected = (-(noise**2) / 2).reshape(2, -1).mean(1) - torch.log(k * base.std.reshape(2)) - HALF_LOG_2PI
        assert torch.allclose(lp, expected, atol=1e-13, rtol=0)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="std_scale must be > 0"):
            sde_step("dance_grpo", x, v, s, sn, noise, 0.3, std_scale=bad)
        with pytest.raises(ValueError, match="std_scale must be > 0"):
            step_log_prob("dance_grpo", x, v, s, sn, noise, 0.3, std_scale=bad)


def test_sde_step_mixed_dtypes_noise_and_log_prob():
    """sde_step: noise is cast to the step dtype (float64 or float32), the log-prob is the float64 density."""
    x, v = _randn(*SHAPE, seed=15, dtype=F32), _randn(*SHAPE, seed=16) / 3.0
    noise = _randn(*SHAPE, seed=17, dtype=torch.bfloat16)
    out = sde_step("flow_grpo", x, v, 1.0 / 3.0, 1.0 / 7.0, noise)
    ref_mean, ref_std = _ref_mean_std("flow_grpo", x, v, 1.0 / 3.0, 1.0 / 7.0, 0.7)
    assert out.sample.dtype == F64
    assert torch.allclose(out.sample, ref_mean + ref_std * noise.to(F64), atol=1e-12, rtol=0)
    # float32 step, float64 noise: the sample is float32 (noise cast down, not the step up)
    out32 = sde_step("dance_grpo", x, x, 1.0 / 3.0, 1.0 / 7.0, _randn(*SHAPE, seed=18) / 3.0, 0.3)
    assert out32.sample.dtype == F32 and out32.log_prob.dtype == F32
    # float32 step, bf16 noise: std * noise in float32
    out_b = sde_step("dance_grpo", x, x, 1.0 / 3.0, 1.0 / 7.0, noise, 0.3)
    ref = _ref_mean_std("dance_grpo", x, x, 1.0 / 3.0, 1.0 / 7.0, 0.3)
    assert torch.allclose(out_b.sample.to(F64), ref[0] + ref[1] * noise.to(F64), atol=1e-6, rtol=0)


def test_gaussian_log_prob_mixed_dtypes_and_1d_sample():
    """gaussian_log_prob is float64 when any of sample, mean, std is float64; a 1-d sample is not reduced."""
    std = 1.0 / 3.0
    for wide in range(3):
        ins = [_randn(2, 5, seed=19, dtype=F32), _randn(2, 5, seed=20, dtype=F32), std]
        if wide < 2:
            ins[wide] = _randn(2, 5, seed=21) / 3.0
        else:
            ins[wide] = torch.full((2, 1), std, dtype=F64)
        lp = gaussian_log_prob(*ins)
        d = ins[0].to(F64) - ins[1].to(F64)
        ref = (-(d**2) / (2 * std**2) - math.log(std) - HALF_LOG_2PI).mean(1)
        assert lp.dtype == F64 and torch.allclose(lp, ref, atol=1e-12, rtol=0), wide
    # a float std with float32 tensors: float32
    assert gaussian_log_prob(ins[0].float(), ins[1].float(), std).dtype == F32
    # 1-d sample: one element per sample, no reduction
    a, b = torch.tensor([0.1, -0.2], dtype=F64), torch.tensor([0.0, 0.3], dtype=F64)
    lp = gaussian_log_prob(a, b, 0.5)
    assert torch.allclose(lp, -((a - b) ** 2) / (2 * 0.25) - math.log(0.5) - HALF_LOG_2PI, atol=1e-15, rtol=0)
    lp_sum = gaussian_log_prob(a, b, 0.5, reduce="sum")
    assert torch.equal(lp_sum, lp)
    with pytest.raises(ValueError, match="batch dim"):
        gaussian_log_prob(a[0], b[0], 0.5)


def test_diffusion_coefficient_dtypes_and_sigma_types():
    """g is float32 for a float / bf16 sigma (even under a float64 default dtype), float64 for a float64 sigma."""
    for kind, level in KINDS:
        g = diffusion_coefficient(kind, torch.tensor([0.25, 0.5], dtype=torch.bfloat16), level)
        assert g.dtype == F32, kind
        g64 = diffusion_coefficient(kind, torch.tensor([1.0 / 3.0], dtype=F64), level)
        ref = {"ode": 0.0, "flow_grpo": level * math.sqrt(0.5), "dance_grpo": level}[kind]
        assert g64.dtype == F64 and abs(float(g64) - ref) < 1e-15, kind
        old = torch.get_default_dtype()
        torch.set_default_dtype(F64)
        try:
            assert diffusion_coefficient(kind, 1.0 / 3.0, level).dtype == F32, kind
        finally:
            torch.set_default_dtype(old)
    g = diffusion_coefficient("flow_grpo", torch.tensor([0.25, 0.5], dtype=torch.bfloat16), 0.7)
    assert torch.allclose(g, 0.7 * torch.tensor([1 / 3, 1.0]).sqrt(), atol=1e-6, rtol=0)
    for bad in (True, "0.5", None):
        with pytest.raises(TypeError, match="sigma must be a python float or a torch.Tensor"):
            diffusion_coefficient("dance_grpo", bad, 0.3)


def test_diffusion_coefficient_input_checks():
    """flow_grpo refuses sigma outside [0, 1] and NaN; sigma_at_one 0 is allowed; noise_level: tensor ok, inf not."""
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"flow_grpo needs sigma in \[0, 1\]"):
            diffusion_coefficient("flow_grpo", torch.tensor([0.5, bad], dtype=F64), 0.7, sigma_at_one=0.5)
    # sigma_at_one = 0 is in [0, 1): at sigma == 1 the denominator is 1 - 0, so g(1) = a
    g = diffusion_coefficient("flow_grpo", torch.tensor([1.0, 0.5], dtype=F64), 0.7, sigma_at_one=0.0)
    assert torch.allclose(g, torch.tensor([0.7, 0.7], dtype=F64), atol=1e-15, rtol=0)
    # a 0-d tensor noise level is accepted
    assert float(diffusion_coefficient("dance_grpo", 0.5, torch.tensor(0.3))) == pytest.approx(0.3, abs=1e-7)
    for bad in (float("inf"), -float("inf"), torch.tensor(float("inf"))):
        with pytest.raises(ValueError, match="noise_level must be a finite number >= 0"):
            diffusion_coefficient("dance_grpo", 0.5, bad)


def test_gaussian_log_prob_float32_std_tensor_with_float64_sample_and_bad_std_shapes():
    """A float32 std tensor is upcast before squaring / log when sample is float64; a std that does not fit raises."""
    sample, mean = _randn(2, 5, seed=22) / 3.0, _randn(2, 5, seed=23) / 3.0
    std = torch.tensor([[0.3137], [0.7071]], dtype=F32)
    lp = gaussian_log_prob(sample, mean, std)
    s64 = std.to(F64)
    ref = (-((sample - mean) ** 2) / (2 * s64**2) - torch.log(s64) - HALF_LOG_2PI).mean(1)
    assert lp.dtype == F64 and torch.allclose(lp, ref, atol=1e-12, rtol=0)
    for bad in (torch.ones(3, 2, 5), torch.ones(2, 3)):
        with pytest.raises(ValueError, match=r"std of shape .* does not broadcast to sample \(2, 5\)"):
            gaussian_log_prob(sample, mean, bad)


def test_sde_step_and_step_log_prob_pass_frame_dim_and_reduce_through():
    """frame_dim reaches the per-frame sigmas (Wan layout) and reduce reaches the log-prob, in both functions."""
    x, v, noise = _randn(*SHAPE, seed=24), _randn(*SHAPE, seed=25), _randn(*SHAPE, seed=26)
    s = torch.tensor([[0.9, 0.6, 0.3], [0.8, 0.5, 0.2]], dtype=F64)
    sn = s - 0.1
    xw, vw, nw = (t.transpose(1, 2) for t in (x, v, noise))  # [B, C=4, T=3, H]
    ref = sde_step("dance_grpo", x, v, s, sn, noise, 0.3, reduce="sum")
    out = sde_step("dance_grpo", xw, vw, s, sn, nw, 0.3, frame_dim=2, reduce="sum")
    assert torch.allclose(out.sample, ref.sample.transpose(1, 2), atol=1e-15, rtol=0)
    assert torch.allclose(out.log_prob, ref.log_prob, atol=1e-12, rtol=0)
    mean_lp = sde_step("dance_grpo", x, v, s, sn, noise, 0.3).log_prob
    assert torch.allclose(ref.log_prob, x[0].numel() * mean_lp, atol=1e-12, rtol=0)
    lp, mean, _ = step_log_prob("dance_grpo", xw, vw, s, sn, out.sample, 0.3, frame_dim=2, reduce="sum")
    assert torch.equal(lp, out.log_prob) and torch.equal(mean, out.mean)


def test_deterministic_sde_step_returns_mean_and_zero_std():
    """The deterministic sde_step returns sample = mean = the Euler step and a zero std of the sigmas' shape."""
    x, v = _randn(*SHAPE, seed=27), _randn(*SHAPE, seed=28)
    s, sn = torch.tensor([0.5, 0.4], dtype=F64), 0.2
    euler = _ref_mean_std("ode", x, v, s, sn, 0.0)[0]
    for kind, level in KINDS:
        out = sde_step(kind, x, v, s, sn, None, noise_level=0.0 if kind != "ode" else level)
        assert torch.allclose(out.mean, euler, atol=1e-15, rtol=0) and torch.equal(out.sample, out.mean)
        assert out.std.shape == (2, 1, 1, 1) and torch.equal(out.std, torch.zeros(2, 1, 1, 1, dtype=F64))


def test_outputs_stay_on_the_latents_device():
    """The tensors a deterministic step makes (its zero std and zero log-prob) live on the latents' device: checked on
    the meta device, where a tensor made on the CPU by mistake shows."""
    x = torch.zeros(2, 3, 4, 4, device="meta")
    v = torch.zeros_like(x)
    sig = torch.full((2,), 0.5, device="meta")
    sig_next = torch.full((2,), 0.25, device="meta")
    mean, std = step_mean_std("ode", x, v, sig, sig_next)
    assert mean.device.type == "meta" and std.device.type == "meta"
    out = sde_step("ode", x, v, sig, sig_next, noise=None)
    assert out.std.device.type == "meta" and out.log_prob.device.type == "meta" and out.log_prob.shape == (2,)
