"""Value, dtype, default and bad-input contracts of genrl.flow.forward_rl: RAM's target and loss, the addressed
training-time timesteps, the velocity monitors and ForwardRLObjective's three losses.

References are closed forms in float64. Mixed-dtype tests make exactly one input float64 with values float32 cannot
represent (random + 1/3) and the others float32: the result must be float64 and equal the float64 reference at
atol 1e-12 (docs/architecture.md, Conventions: precision). Timestep draws are pinned per address: each t is the
documented inverse CDF of the sample's own uniform U = rand_per_sample((), seed, [index], step), computed here in
float64 and rounded once to float32, so the comparison is exact.
"""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow.forward_rl import AWM_EPS, ForwardRLObjective, ram_loss, ram_target, sample_timesteps, velocity_monitors
from genrl.noise import rand_per_sample

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
SHAPE = (4, 3, 2, 3, 3)  # [B, T, C, H, W]
WAN = (4, 2, 3, 3, 3)  # [B, C, T, H, W], frame_dim = 2


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _third_ish(*shape: int, seed: int = 0) -> torch.Tensor:
    """float64 values not representable in float32 (a random float64 + 1/3)."""
    return _randn(*shape, seed=seed) + 1 / 3


def _bc(a: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] with ndim dims."""
    return a.reshape(a.shape[0], *([1] * (ndim - 1)))


def _frames(x: torch.Tensor, frame_dim: int) -> torch.Tensor:
    """[B, T] -> B on dim 0, T on frame_dim, 1 elsewhere (for a 5-d latent)."""
    shape = [1] * 5
    shape[0], shape[frame_dim] = x.shape
    return x.reshape(shape)


def _masked_mean(sq: torch.Tensor, mask: torch.Tensor, frame_dim: int) -> torch.Tensor:
    """Per-sample mean of sq over the elements of the masked-in frames [B] (float64 reference)."""
    m = _frames(mask.to(F64), frame_dim).expand(sq.shape)
    return (sq * m).reshape(sq.shape[0], -1).sum(1) / m.reshape(sq.shape[0], -1).sum(1)


# ================================================================================================ RAM


@pytest.mark.parametrize("which", ["v_ref", "v_old", "u", "advantages"])
def test_ram_target_float64_in_any_input_gives_float64(which):
    """ram_target runs in float64 when any one of v_ref, v_old, u, advantages is float64 (closed form, 1e-12)."""
    args = {"v_ref": _randn(*SHAPE, seed=1, dtype=F32), "v_old": _randn(*SHAPE, seed=2, dtype=F32),
            "u": _randn(*SHAPE, seed=3, dtype=F32), "advantages": _randn(SHAPE[0], seed=4, dtype=F32)}
    args[which] = _third_ish(SHAPE[0], seed=5) if which == "advantages" else _third_ish(*SHAPE, seed=6)
    d = {k: v.double() for k, v in args.items()}
    m = 7.3
    ref = d["v_ref"] + m * _bc(d["advantages"], 5) * (d["u"] - d["v_old"])
    out = ram_target(args["v_ref"], args["v_old"], args["u"], args["advantages"], m)
    assert out.dtype == F64 and out.shape == SHAPE and not out.requires_grad
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_ram_target_half_inputs_are_computed_in_float32():
    """ram_target of bf16 inputs (and of a bf16 A with float32 velocities) is float32, computed from the upcast
    values: m A is not rounded to bf16."""
    v_ref, v_old, u = (_randn(*SHAPE, seed=s, dtype=BF16) for s in (7, 8, 9))
    adv = torch.tensor([1.0078125, -0.33203125, 2.015625, 0.0], dtype=BF16)  # bf16-exact, m A is not
    m = 100.0
    ref = v_ref.double() + m * _bc(adv.double(), 5) * (u.double() - v_old.double())
    for vr, vo, uu in ((v_ref, v_old, u), (v_ref.float(), v_old.float(), u.float())):
        out = ram_target(vr, vo, uu, adv, m)
        assert out.dtype == F32
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)


def test_ram_target_and_loss_errors_name_the_bad_argument():
    """ram_target / ram_loss shape, type and multiplier errors name the offending argument and its reference."""
    v, adv = _randn(*SHAPE, seed=10), torch.zeros(SHAPE[0], dtype=F64)
    short, flat = v[:1], v[..., 0]
    for kw, name in (({"v_old": short}, "v_old"), ({"u": short}, "u")):
        args = {"v_ref": v, "v_old": v, "u": v, **kw}
        match = rf"v_ref of shape \(4, 3, 2, 3, 3\) and {name} of shape \(1, 3, 2, 3, 3\)"
        with pytest.raises(ValueError, match=match):
            ram_target(args["v_ref"], args["v_old"], args["u"], adv, 1.0)
    with pytest.raises(TypeError, match="v_ref must be a torch.Tensor"):
        ram_target(v.tolist(), v, v, adv, 1.0)
    for kw, name in (({"v_ref": flat}, "v_ref"), ({"v_old": flat}, "v_old"), ({"u": flat}, "u")):
        args = {"v_ref": v, "v_old": v, "u": v, **kw}
        with pytest.raises(ValueError, match=rf"v_theta of shape \(4, 3, 2, 3, 3\) and {name} of shape \(4, 3, 2, 3\)"):
            ram_loss(v, args["v_ref"], args["v_old"], args["u"], adv, 1.0)
    for m in (True, torch.tensor(2.0), "2"):
        with pytest.raises(TypeError, match="multiplier must be a python float"):
            ram_target(v, v, v, adv, m)


def test_ram_loss_with_a_mask_on_wan_layout():
    """ram_loss with a per-frame mask on [B, C, T, H, W] (frame_dim = 2) is mean_b of the masked per-sample MSE
    onto v_ref + m A (u - v_old) (float64 closed form)."""
    v, v_ref, v_old, u = (_randn(*WAN, seed=s) for s in (11, 12, 13, 14))
    adv = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=F64)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    tgt = v_ref + 3.0 * _bc(adv, 5) * (u - v_old)
    ref = _masked_mean((v - tgt) ** 2, mask, 2).mean()
    out = ram_loss(v, v_ref, v_old, u, adv, 3.0, mask=mask, frame_dim=2)
    assert out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


# ================================================================================================ timesteps


def _u(n: int, seed: int, step: int = 0) -> torch.Tensor:
    return rand_per_sample((), seed, list(range(n)), step).to(F64)


def _shift(x, s: float):
    scaled = s * x
    return scaled / (scaled + (1 - x))


def test_sample_timesteps_pinned_draws_per_density():
    """Each density's draw is its documented float64 inverse CDF of the sample's own U (step 0 by default; the
    logit-normal defaults are mean 0, std 1), restricted to [t_min, t_max] and shifted, rounded once to float32."""
    n, seed = 300, 21
    u = _u(n, seed)

    def check(ref: torch.Tensor, **kw) -> None:
        out = sample_timesteps(n, seed, range(n), **kw)
        assert out.dtype == F32 and out.shape == (n,)
        assert torch.equal(out, ref.to(F32)), kw

    check(u.pow(0.5))  # defaults: "linear" p(t) ∝ t on [0, 1], CDF t^2, step 0
    check(_u(n, seed, 3).pow(0.5), step=3)
    check(torch.sigmoid(torch.special.ndtri(u)), density="logit_normal")
    lo, hi, k = 0.2, 0.9, 3.5
    check((lo**k + u * (hi**k - lo**k)).pow(1 / k).clamp(lo, hi), density="power", alpha=2.5, t_min=lo, t_max=hi)
    lo, hi, mu, sd = 0.1, 0.7, 0.3, 0.8
    c_lo, c_hi = (float(torch.special.ndtr((torch.logit(torch.tensor(x, dtype=F64)) - mu) / sd)) for x in (lo, hi))
    check(torch.sigmoid(mu + sd * torch.special.ndtri(c_lo + u * (c_hi - c_lo))).clamp(lo, hi),
          density="logit_normal", logit_mean=mu, logit_std=sd, t_min=lo, t_max=hi)
    # shift 2: the range is pulled back through the inverse shift, the draw is pushed through the shift
    lo, hi = 0.2, 0.6
    blo, bhi = _shift(lo, 0.5), _shift(hi, 0.5)
    check(_shift(blo + u * (bhi - blo), 2.0).clamp(lo, hi), density="uniform", shift=2.0, t_min=lo, t_max=hi)
    # grid: the values in [t_min, t_max] (both ends included), each with probability 1 / their count
    kept = torch.tensor([0.9, 0.75, 0.5, 0.25], dtype=F64)
    ref = kept[(u * 4).floor().long()]
    check(ref, density="grid", grid=[1.0, 0.9, 0.75, 0.5, 0.25, 0.1], t_min=0.25, t_max=0.9)
    assert set(ref.tolist()) == set(kept.tolist())
    check(torch.tensor([0.5, 0.0], dtype=F64)[(u * 2).floor().long()], density="grid", grid=[0.5, 0.0])


def test_sample_timesteps_stays_in_range_when_the_mass_in_range_underflows():
    """A logit-normal whose mass inside [t_min, t_max] underflows still returns draws in [t_min, t_max] (the
    nearest end), never the out-of-range 0 or 1 that its inverse CDF gives."""
    for lo, hi in ((0.05, 0.1), (0.9, 0.95)):
        out = sample_timesteps(5, 3, range(5), density="logit_normal", logit_std=0.01, t_min=lo, t_max=hi)
        assert torch.equal(out, torch.full((5,), lo if lo < 0.5 else hi, dtype=F32))


def test_sample_timesteps_empty_batch_and_tensor_indices():
    """No indices give a float32 [0] for every density; a tensor of indices of any shape is flattened."""
    for kw in ({}, {"density": "uniform"}, {"density": "logit_normal", "t_min": 0.1}, {"density": "power", "alpha": 2},
               {"density": "uniform", "shift": 3.0, "t_max": 0.5}, {"density": "grid", "grid": [0.5, 0.25]}):
        out = sample_timesteps(0, 3, [], **kw)
        assert out.dtype == F32 and out.shape == (0,), kw
    assert torch.equal(sample_timesteps(1, 11, torch.tensor(5)), sample_timesteps(1, 11, [5]))
    assert torch.equal(sample_timesteps(2, 11, torch.tensor([[3, 8]]), step=2), sample_timesteps(2, 11, [3, 8], step=2))


def test_sample_timesteps_bad_arguments_are_named():
    """sample_timesteps rejects a bad n / t_min / t_max / alpha / shift / logit_std / logit_mean / grid with a
    ValueError naming it."""
    idx = [0, 1]
    bad = [
        ({"n": 2.0}, r"n must equal len\(indices\) = 2"),
        ({"n": True, "indices": [0]}, r"n must equal len\(indices\) = 1"),
        ({"t_min": -0.1}, r"t_min must be a number in \[0, 1\]"),
        ({"t_max": 1.5}, r"t_max must be a number in \[0, 1\]"),
        ({"t_max": True}, r"t_max must be a number in \[0, 1\]"),
        ({"t_min": "0"}, r"t_min must be a number in \[0, 1\]"),
        ({"density": "power", "alpha": math.inf}, "alpha must be a finite number > -1"),
        ({"density": "power", "alpha": math.nan}, "alpha must be a finite number > -1"),
        ({"density": "power", "alpha": True}, "alpha must be a finite number > -1"),
        ({"shift": 0.0}, "shift must be a finite number > 0"),
        ({"density": "logit_normal", "logit_std": 0.0}, "logit_std must be a finite number > 0"),
        ({"density": "logit_normal", "logit_mean": math.nan}, "logit_mean must be a finite number"),
        ({"density": "logit_normal", "logit_mean": math.inf}, "logit_mean must be a finite number"),
        ({"density": "grid", "grid": [0.5, 1.0 + 1e-9]}, r"grid values must lie in \[0, 1\]"),
        ({"density": "grid", "grid": [0.5, 1.5]}, r"grid values must lie in \[0, 1\]"),
        ({"density": "grid", "grid": [0.5, -0.25]}, r"grid values must lie in \[0, 1\]"),
        ({"density": "grid", "grid": [0.5, math.nan]}, r"grid values must lie in \[0, 1\]"),
    ]
    for kw, match in bad:
        args = {"n": len(kw.get("indices", idx)), "seed": 0, "indices": idx, **kw}
        with pytest.raises(ValueError, match=match):
            sample_timesteps(**args)


# ================================================================================================ monitors


def _monitor_ref(v, v_old, v_ref, u, mask, frame_dim):
    def mse(a, b):
        return float(_masked_mean((a.double() - b.double()) ** 2, mask, frame_dim).mean())

    z = torch.zeros_like(v_ref, dtype=F64)
    return {"v_ref_mse": mse(v, v_ref), "v_old_mse": mse(v, v_old),
            "v_norm_ratio": math.sqrt(mse(v, z) / mse(v_ref, z)), "fm_mse_old": mse(v_old, u),
            "fm_mse_theta": mse(v, u), "fm_mse_ref": mse(v_ref, u)}


@pytest.mark.parametrize("layout", ["btchw", "wan"])
def test_velocity_monitors_masked_values_and_keys(layout):
    """velocity_monitors with a per-frame mask returns exactly the six documented floats, each the float64 masked
    closed form (frame_dim 1 by default, 2 for Wan's layout)."""
    shape, frame_dim = (SHAPE, 1) if layout == "btchw" else (WAN, 2)
    v, v_old, v_ref, u = (_randn(*shape, seed=s, dtype=F32 if s == 30 else F64) for s in (30, 31, 32, 33))
    mask = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    kw = {} if layout == "btchw" else {"frame_dim": 2}
    mon = velocity_monitors(v, v_old, v_ref, u, mask=mask, **kw)
    ref = _monitor_ref(v, v_old, v_ref, u, mask, frame_dim)
    assert set(mon) == set(ref) and all(type(x) is float for x in mon.values())
    for key, val in ref.items():
        assert mon[key] == pytest.approx(val, rel=1e-12, abs=0), key


def test_velocity_monitors_norm_ratio_with_a_zero_reference():
    """v_norm_ratio is inf when v_ref is all zero and v_theta is not (even with ||v_theta|| < 1), and 1 when both
    are all zero."""
    z = torch.zeros(SHAPE, dtype=F64)
    u = _randn(*SHAPE, seed=34)
    assert velocity_monitors(torch.full(SHAPE, 0.5, dtype=F64), z, z, u)["v_norm_ratio"] == math.inf
    assert velocity_monitors(z, z, z, u)["v_norm_ratio"] == 1.0


def test_velocity_monitors_shape_errors_name_the_argument():
    """velocity_monitors names v_theta and the mismatching argument in its shape error, and v_theta in its type
    error."""
    v = _randn(*SHAPE, seed=35)
    for name in ("v_old", "v_ref", "u"):
        args = {"v_old": v, "v_ref": v, "u": v, name: v[:, :2]}
        match = rf"v_theta of shape \(4, 3, 2, 3, 3\) and {name} of shape \(4, 2, 2, 3, 3\)"
        with pytest.raises(ValueError, match=match):
            velocity_monitors(v, **args)
    with pytest.raises(TypeError, match="v_theta must be a torch.Tensor"):
        velocity_monitors(v.tolist(), v, v, v)


# ================================================================================================ ForwardRLObjective


def test_objective_rejects_bad_multipliers_and_negative_anchors():
    """ForwardRLObjective rejects m = 0, < 0, inf, NaN and a negative kl_beta or ema_kl_beta (each alone), naming
    the value; m = 0.5 is accepted and reaches ram_loss."""
    for m in (0.0, -1.0, math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="multiplier m must be a finite number > 0"):
            ForwardRLObjective("ram", multiplier=m)
    for kw in ({"kl_beta": -0.1}, {"ema_kl_beta": -0.1}):
        with pytest.raises(ValueError, match="kl_beta and ema_kl_beta must be >= 0"):
            ForwardRLObjective("awm", **kw)
    v, v_old, v_ref, u = (_randn(*SHAPE, seed=s) for s in (40, 41, 42, 43))
    adv = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=F64)
    t = torch.full((SHAPE[0],), 0.5, dtype=F64)
    loss, stats = ForwardRLObjective("ram", multiplier=0.5).loss(v, v_old, v_ref, u, u, u, t, adv)
    ref = ((v - (v_ref + 0.5 * _bc(adv, 5) * (u - v_old))) ** 2).mean()
    assert stats == {} and loss.dtype == F64
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layout", ["btchw", "wan"])
def test_objective_nft_loss_is_the_documented_formula_with_per_frame_t(layout):
    """ForwardRLObjective("nft") is (C / beta) mean_b mean_e [r e(v+)^2 / w(v+) + (1 - r) e(v-)^2 / w(v-)] (adaptive
    by default, r = 1/2 + clip(A, -C, C) / (2C)) + kl_beta mean ||v - v_ref||^2, with a per-frame t on frame_dim."""
    shape, frame_dim = (SHAPE, 1) if layout == "btchw" else (WAN, 2)
    v, v_old, v_ref, x0, eps = (_randn(*shape, seed=s) for s in (50, 51, 52, 53, 54))
    t = torch.tensor([[0.9, 0.5, 0.2], [0.3, 0.7, 1.0], [0.6, 0.6, 0.1], [0.45, 0.8, 0.35]], dtype=F64)
    s = _frames(t, frame_dim)
    x_t = (1 - s) * x0 + s * eps
    adv = torch.tensor([3.0, -0.5, 1.0, -4.0], dtype=F64)
    beta, c, kl = 0.5, 2.0, 0.3
    r = _bc(0.5 + adv.clamp(-c, c) / (2 * c), 5)
    v_pos, v_neg = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v

    def term(vv):
        e = x_t - s * vv - x0
        w = e.abs().reshape(shape[0], -1).mean(1).clamp_min(1e-5)
        return e**2 / _bc(w, 5)

    el = r * term(v_pos) + (1 - r) * term(v_neg)
    ref = (c / beta) * el.reshape(shape[0], -1).mean(1).mean() + kl * ((v - v_ref) ** 2).mean()
    obj = ForwardRLObjective("nft", nft_beta=beta, nft_clip=c, kl_beta=kl)
    kw = {} if layout == "btchw" else {"frame_dim": 2}
    loss, stats = obj.loss(v, v_old, v_ref, eps - x0, x_t, x0, t, adv, **kw)
    assert stats == {} and loss.dtype == F64
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)


def test_objective_awm_loss_is_the_documented_formula():
    """ForwardRLObjective("awm") with ghuber p = 0.5: mean_b -A'_b exp(w_old_b - w_b) + kl_beta mean ||v - v_ref||^2,
    w = (t / p)((l + eps)^p - eps^p), l (l_old) the FM error of v (v_old), A' = clip(A, -c, c) / c; no EMA anchor
    and a zero kl_ema statistic at ema_kl_beta = 0."""
    v, v_old, v_ref, x0, eps = (_randn(*SHAPE, seed=s) for s in (60, 61, 62, 63, 64))
    u = eps - x0
    v_old = v + 0.3 * v_old  # a ratio near 1, off-policy
    t = torch.tensor([0.9, 0.5, 0.2, 0.7], dtype=F64)
    adv = torch.tensor([3.0, -0.5, 1.0, -1.5], dtype=F64)
    p, c, kl = 0.5, 2.0, 0.2

    def w(x):
        ell = ((x - u) ** 2).reshape(SHAPE[0], -1).mean(1)
        return (t / p) * ((ell + AWM_EPS) ** p - AWM_EPS**p)

    ratio = torch.exp(w(v_old) - w(v))
    a = adv.clamp(-c, c) / c
    ref = (-a * ratio).mean() + kl * ((v - v_ref) ** 2).mean()
    obj = ForwardRLObjective("awm", awm_p=p, awm_adv_clip=c, kl_beta=kl)
    loss, stats = obj.loss(v, v_old, v_ref, u, x0 + t[:, None, None, None, None] * u, x0, t, adv)
    assert loss.dtype == F64
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(stats["ratio_mean"], ratio.mean(), rtol=0, atol=1e-12)
    assert float(stats["kl_ema"]) == 0.0
