"""Tests of the dtype, default-argument and argument-check contracts of genrl.flow's pure functions.

Every step / conversion / loss function documents: "float32 (float64 if any input is float64)", computed in that
dtype. The mixed-dtype tests make each input in turn the only float64 one (the others float32, sigma a python
float such as 1/3 that float32 cannot hold) and compare with a float64 closed form at atol 1e-12, so dropping any
input from the dtype decision, or letting one operand stay in its own lower dtype, fails. The low-precision tests
(bf16 inputs) check the float32 upcast.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from genrl.flow import (
    add_noise,
    cfg_combine,
    eps_from_velocity,
    euler_step,
    flow_matching_loss,
    loss_weighting,
    sample_mse,
    shift_sigmas,
    sigmas_to_timesteps,
    timesteps_to_sigmas,
    velocity_from_eps,
    velocity_from_x0,
    velocity_target,
    x0_from_velocity,
)

F64 = torch.float64
SHAPE = (2, 3, 4)  # [B, T, C] with T != C, so a per-frame sigma fits frame_dim = 1 only
THIRD = 1.0 / 3.0
SIGMA_NEXT = 0.1


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _cos(s):
    return 2.0 / (math.pi * (1 - 2 * s + 2 * s * s))


# name -> (function, argument kinds in call order, float64 reference on float64 / python-float arguments).
# kinds: "t" a latent-shaped tensor, "s" a sigma / scale (python float, or a [B] tensor when it is the f64 one).
FUNCS = {
    "add_noise": (add_noise, "tts", lambda x0, eps, s: (1 - s) * x0 + s * eps),
    "velocity_target": (velocity_target, "tt", lambda x0, eps: eps - x0),
    "x0_from_velocity": (x0_from_velocity, "tst", lambda x, s, v: x - s * v),
    "eps_from_velocity": (eps_from_velocity, "tst", lambda x, s, v: x + (1 - s) * v),
    "velocity_from_x0": (velocity_from_x0, "tst", lambda x, s, x0: (x - x0) / s),
    "velocity_from_eps": (velocity_from_eps, "tst", lambda x, s, eps: (eps - x) / (1 - s)),
    "euler_step": (euler_step, "ttss", lambda x, v, s, sn: x + (sn - s) * v),
    "cfg_combine": (cfg_combine, "tts", lambda c, u, w: w * c + (1 - w) * u),
    "flow_matching_loss": (
        lambda v, x0, eps, s: flow_matching_loss(v, x0, eps, s, weighting="cosmap"),
        "ttts",
        lambda v, x0, eps, s: (_cos(s) * (v - (eps - x0)) ** 2).reshape(2, -1).mean(dim=1),
    ),
    "sample_mse": (sample_mse, "tt", lambda v, t: ((v - t) ** 2).reshape(2, -1).mean(dim=1)),
}

# python-float values of the sigma arguments by position (euler_step has two), none exact in float32
_SCALARS = {"euler_step": (THIRD, SIGMA_NEXT), "cfg_combine": (2.7,)}


def _args(name: str, f64_pos: int | None, low: torch.dtype = torch.float32):
    """Arguments of ``name``: position ``f64_pos`` float64 (a [B] tensor for a sigma), tensors ``low`` elsewhere."""
    _, kinds, _ = FUNCS[name]
    g = torch.Generator().manual_seed(len(name))
    scalars = iter(_SCALARS.get(name, (THIRD,)))
    args = []
    for i, k in enumerate(kinds):
        if k == "t":
            t = torch.randn(SHAPE, generator=g, dtype=F64)
            args.append(t if i == f64_pos else t.to(low))
        else:
            value = next(scalars)
            # a [B] float64 sigma whose entries float32 cannot hold either
            args.append(torch.tensor([value, value + 0.2], dtype=F64) if i == f64_pos else value)
    return args


def _reference(name: str, args):
    _, kinds, ref = FUNCS[name]
    ref_args = []
    for k, a in zip(kinds, args):
        if isinstance(a, torch.Tensor):
            a = a.to(F64)
            if k == "s":
                a = a.reshape(-1, *([1] * (len(SHAPE) - 1)))
        ref_args.append(a)
    return ref(*ref_args)


MIXED = [(name, pos) for name, (_, kinds, _) in FUNCS.items() for pos in range(len(kinds))]


@pytest.mark.parametrize("name,pos", MIXED, ids=[f"{n}-arg{p}" for n, p in MIXED])
def test_any_float64_input_makes_the_whole_computation_float64(name, pos):
    """One float64 input (any position), the rest float32 / python floats: result float64, equal to the f64 form."""
    fn = FUNCS[name][0]
    args = _args(name, pos)
    out = fn(*args)
    assert out.dtype == F64
    torch.testing.assert_close(out, _reference(name, args), rtol=0, atol=1e-12)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(FUNCS))
def test_low_precision_inputs_compute_in_float32(name, low):
    """bf16 / fp16 tensors with a python-float sigma: result float32, at float32 accuracy of the exact form."""
    fn = FUNCS[name][0]
    args = _args(name, None, low)
    out = fn(*args)
    assert out.dtype == torch.float32
    ref = _reference(name, args)
    torch.testing.assert_close(out.to(F64), ref, rtol=0, atol=1e-5 * max(1.0, float(ref.abs().max())))


# ----------------------------------------------------------------------------------------------
# default frame_dim = 1


PER_FRAME = [
    ("add_noise", lambda x, y, s: add_noise(x, y, s), lambda x, y, s: (1 - s) * x + s * y),
    ("x0_from_velocity", lambda x, y, s: x0_from_velocity(x, s, y), lambda x, y, s: x - s * y),
    ("eps_from_velocity", lambda x, y, s: eps_from_velocity(x, s, y), lambda x, y, s: x + (1 - s) * y),
    ("velocity_from_x0", lambda x, y, s: velocity_from_x0(x, s, y), lambda x, y, s: (x - y) / s),
    ("velocity_from_eps", lambda x, y, s: velocity_from_eps(x, s, y), lambda x, y, s: (y - x) / (1 - s)),
    ("euler_step", lambda x, y, s: euler_step(x, y, s, s / 2), lambda x, y, s: x - s / 2 * y),
    ("cfg_combine", lambda x, y, s: cfg_combine(x, y, s), lambda x, y, s: s * x + (1 - s) * y),
]


@pytest.mark.parametrize("name,call,ref", PER_FRAME, ids=[p[0] for p in PER_FRAME])
def test_per_frame_sigma_defaults_to_frame_dim_1(name, call, ref):
    """Without frame_dim, a [B, T] sigma goes on dim 1 of the latents ([B, T, C, ...])."""
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(SHAPE, generator=g, dtype=F64) for _ in range(2))
    s = 0.1 + 0.8 * torch.rand(SHAPE[:2], generator=g, dtype=F64)  # [B, T]
    torch.testing.assert_close(call(x, y, s), ref(x, y, s[:, :, None]), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------------
# argument checks: the message names both arguments and shapes

_A, _B = torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)
SHAPE_ERRORS = [
    ("add_noise", lambda: add_noise(_A, _B, 0.5), "x0", "eps"),
    ("velocity_target", lambda: velocity_target(_A, _B), "x0", "eps"),
    ("x0_from_velocity", lambda: x0_from_velocity(_A, 0.5, _B), "x", "v"),
    ("eps_from_velocity", lambda: eps_from_velocity(_A, 0.5, _B), "x", "v"),
    ("velocity_from_x0", lambda: velocity_from_x0(_A, 0.5, _B), "x", "x0"),
    ("velocity_from_eps", lambda: velocity_from_eps(_A, 0.5, _B), "x", "eps"),
    ("euler_step", lambda: euler_step(_A, _B, 0.5, 0.25), "x", "v"),
]


@pytest.mark.parametrize("name,call,a,b", SHAPE_ERRORS, ids=[e[0] for e in SHAPE_ERRORS])
def test_shape_mismatch_names_both_arguments(name, call, a, b):
    """A shape mismatch raises ValueError naming both arguments with their shapes."""
    with pytest.raises(ValueError, match=rf"^{a} of shape \(2, 3, 4\) and {b} of shape \(2, 3, 5\) must match$"):
        call()


@pytest.mark.parametrize("fn", [velocity_from_x0, velocity_from_eps])
def test_min_denom_must_be_positive(fn):
    """min_denom = 0 (or below) is refused; the smallest positive value is accepted."""
    x = torch.zeros(2, 3)
    for bad in (0.0, -1e-3):
        with pytest.raises(ValueError, match=rf"min_denom must be > 0, got {bad}"):
            fn(x, 0.5, x, min_denom=bad)
    assert torch.equal(fn(x, 0.5, x, min_denom=5e-324), torch.zeros(2, 3))


# ----------------------------------------------------------------------------------------------
# loss_weighting


def test_loss_weighting_default_is_none():
    """The default weighting is "none": w = 1 in sigma's shape."""
    s = torch.tensor([0.2, 0.7, 1.0])
    assert torch.equal(loss_weighting(s), torch.ones(3))
    assert loss_weighting(THIRD).shape == ()


@pytest.mark.parametrize("kind", ["none", "sigma_sqrt", "cosmap"])
def test_loss_weighting_dtypes(kind):
    """w is float32 for bf16 / float32 / python-float sigma (whatever torch's default dtype), float64 for float64."""
    exact = {"none": lambda s: 1.0 + 0 * s, "sigma_sqrt": lambda s: s**-2, "cosmap": _cos}[kind]
    s16 = torch.tensor([0.3, 0.7, THIRD], dtype=torch.bfloat16)
    w = loss_weighting(s16, kind)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w.to(F64), exact(s16.to(F64)), rtol=1e-6, atol=0)
    s64 = torch.tensor([THIRD, 0.7], dtype=F64)
    assert loss_weighting(s64, kind).dtype == F64
    torch.testing.assert_close(loss_weighting(s64, kind), exact(s64), rtol=1e-15, atol=0)
    with _default_dtype(F64):
        w = loss_weighting(THIRD, kind)
    assert w.dtype == torch.float32
    torch.testing.assert_close(w, torch.tensor(exact(THIRD), dtype=torch.float32), rtol=1e-6, atol=0)


def test_loss_weighting_min_sigma_must_be_positive():
    """sigma_sqrt refuses min_sigma = 0 (the weight would be infinite at sigma = 0)."""
    with pytest.raises(ValueError, match=r"min_sigma must be > 0, got 0.0"):
        loss_weighting(torch.tensor([0.0, 0.5]), "sigma_sqrt", min_sigma=0.0)
    with pytest.raises(ValueError, match=r"min_sigma must be > 0, got -1"):
        loss_weighting(0.5, "sigma_sqrt", min_sigma=-1)


# ----------------------------------------------------------------------------------------------
# schedules: integer tensors become float32


@pytest.mark.parametrize("default", [torch.float32, F64])
def test_schedule_conversions_turn_integers_into_float32(default):
    """Integer (and bool) tensors become float32 in the timestep / sigma maps, whatever torch's default dtype."""
    with _default_dtype(default):
        t = sigmas_to_timesteps(torch.tensor([0, 1], dtype=torch.int32))
        s = timesteps_to_sigmas(torch.tensor([0, 250, 1000]))
        sh = shift_sigmas(torch.tensor([0, 1]), 3.0)
        sb = sigmas_to_timesteps(torch.tensor([False, True]))
    assert t.dtype == s.dtype == sh.dtype == sb.dtype == torch.float32
    assert torch.equal(t, torch.tensor([0.0, 1000.0]))
    assert torch.equal(sb, torch.tensor([0.0, 1000.0]))
    assert torch.equal(s, torch.tensor([0.0, 0.25, 1.0]))
    assert torch.equal(sh, torch.tensor([0.0, 1.0]))
    # float tensors keep their dtype
    assert sigmas_to_timesteps(torch.tensor([THIRD], dtype=F64)).dtype == F64
    assert timesteps_to_sigmas(torch.tensor([1.0], dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_timestep_sampler_draw_device_dtype_and_rng_use():
    """TimestepSampler: float32 whatever torch's default dtype; with no generator the draw is made on ``device`` (a meta
    draw leaves the CPU RNG untouched) or on the CPU; with a generator it is made on the generator's device (the
    generator advances) and moved to ``device``."""
    from genrl.flow.schedules import TimestepSampler

    sampler = TimestepSampler(kind="uniform")
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert sampler(3, torch.Generator().manual_seed(0)).dtype == torch.float32
        assert TimestepSampler()(3, torch.Generator().manual_seed(0)).dtype == torch.float32
    finally:
        torch.set_default_dtype(old)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    out = sampler(4, None, device="meta")
    assert out.device.type == "meta" and torch.equal(torch.get_rng_state(), state)
    assert sampler(4, None).device.type == "cpu" and not torch.equal(torch.get_rng_state(), state)
    g = torch.Generator().manual_seed(1)
    g_state = g.get_state()
    moved = sampler(4, g, device="meta")
    assert moved.device.type == "meta" and not torch.equal(g.get_state(), g_state)
    assert sampler(4, torch.Generator().manual_seed(1)).device.type == "cpu"


def test_timestep_sampler_shift_two_and_upper_clamp():
    """TimestepSampler: shift 2 is applied (sigma = 2u / (1 + u)); the affine map's float32 round-off above
    sigma_max is clamped (logit-normal draws saturate at u = 1, where 0.3 + 0.4 u rounds above 0.7 in float32)."""
    from genrl.flow.schedules import TimestepSampler

    u = torch.rand(64, generator=torch.Generator().manual_seed(3), dtype=torch.float32)
    got = TimestepSampler(kind="uniform", shift=2.0)(64, torch.Generator().manual_seed(3))
    torch.testing.assert_close(got, 2 * u / (1 + u), rtol=0, atol=1e-6)
    wide = TimestepSampler(kind="logit_normal", logit_std=30.0, sigma_min=0.3, sigma_max=0.7)
    sig = wide(100_000, torch.Generator().manual_seed(0))
    assert bool((sig <= 0.7).all()) and bool((sig >= 0.3).all()) and bool((sig == sig.max()).any())
