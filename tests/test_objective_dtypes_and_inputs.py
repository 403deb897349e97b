"""Dtype, device, default-value and bad-input contracts of the GRPO objective pieces (genrl.flow.policy), the
gradient penalties (genrl.flow.nft) and advantage-weighted flow matching (genrl.flow.forward_rl).

Mixed-dtype tests make exactly one input float64 with values that float32 cannot represent (1/3, ...) and the others
float32: the result must be float64 and equal a float64 reference at atol 1e-12, so every input must reach the
dtype decision (docs/architecture.md, Conventions: precision).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo  # noqa: F401  (the first meta-device op imports it: ~5 s; lightning imports it for the suite)

from genrl.flow import RunningMeanStd, gaussian_kl, kl_penalty, normalize_rewards, velocity_kl
from genrl.flow.forward_rl import advantage_weighted_fm_loss, awm_loss, awm_weight
from genrl.flow.nft import r1_penalty, r2_penalty

F64, F32, F16 = torch.float64, torch.float32, torch.float16


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _third_ish(*shape: int, seed: int = 0) -> torch.Tensor:
    """float64 values not representable in float32 (a random float64 + 1/3)."""
    return _randn(*shape, seed=seed) + 1 / 3


def _kl_elements(mean: torch.Tensor, mean_ref: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    d = mean.double() - mean_ref.double()
    return d * d / (2 * s.double() ** 2)


# ================================================================================================ KL penalties


@pytest.mark.parametrize("which", ["mean", "mean_ref", "std"])
def test_gaussian_kl_float64_in_any_input_gives_float64(which):
    """gaussian_kl runs in float64 when any one of mean, mean_ref, std is float64 (float64 reference, 1e-12)."""
    args = {"mean": _randn(2, 3, 4, seed=1, dtype=F32), "mean_ref": _randn(2, 3, 4, seed=2, dtype=F32),
            "std": torch.tensor([0.5, 0.25], dtype=F32)}
    args[which] = _third_ish(2, seed=3).abs() + 0.1 if which == "std" else _third_ish(2, 3, 4, seed=4)
    s = args["std"].double().reshape(2, 1, 1)
    ref = _kl_elements(args["mean"], args["mean_ref"], s).reshape(2, -1).mean(1)
    for out in (gaussian_kl(args["mean"], args["mean_ref"], args["std"]), kl_penalty("gaussian", **args)):
        assert out.dtype == F64
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("which", ["v", "v_ref"])
def test_velocity_kl_float64_in_any_input_gives_float64(which):
    """velocity_kl runs in float64 when either velocity is float64 (float64 reference, 1e-12)."""
    args = {"v": _randn(3, 5, seed=5, dtype=F32), "v_ref": _randn(3, 5, seed=6, dtype=F32)}
    args[which] = _third_ish(3, 5, seed=7)
    ref = ((args["v"].double() - args["v_ref"].double()) ** 2).mean(1)
    for out in (velocity_kl(args["v"], args["v_ref"]), kl_penalty("velocity_mse", **args)):
        assert out.dtype == F64
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_velocity_kl_half_inputs_are_computed_in_float32():
    """velocity_kl of float16 velocities is float32, computed from the upcast values (not in float16)."""
    v, v_ref = torch.tensor([[0.1, 2.0, -3.0]], dtype=F16), torch.tensor([[0.7, -1.5, 1 / 3]], dtype=F16)
    out = velocity_kl(v, v_ref)
    assert out.dtype == F32
    ref = ((v.double() - v_ref.double()) ** 2).mean(1)
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize("which", ["mean", "mean_ref", "std", "delta"])
def test_flow_grpo_kl_float64_in_any_input_gives_float64(which):
    """kl_penalty("flow_grpo") runs in float64 when any one of mean, mean_ref, std, delta is float64."""
    args = {"mean": _randn(2, 3, 4, seed=8, dtype=F32), "mean_ref": _randn(2, 3, 4, seed=9, dtype=F32),
            "std": torch.tensor([0.5, 0.25], dtype=F32), "delta": torch.tensor([-0.125, -0.5], dtype=F32)}
    if which == "std":
        args["std"] = _third_ish(2, seed=10).abs() + 0.1
    elif which == "delta":
        args["delta"] = -(_third_ish(2, seed=11).abs() + 0.1)
    else:
        args[which] = _third_ish(2, 3, 4, seed=12)
    s, d = args["std"].double().reshape(2, 1, 1), args["delta"].double().reshape(2, 1, 1)
    ref = (_kl_elements(args["mean"], args["mean_ref"], s) * d.abs()).reshape(2, -1).mean(1)
    out = kl_penalty("flow_grpo", **args)
    assert out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_flow_grpo_kl_python_float_std_and_delta_taken_in_float64():
    """Python-float std and delta (1/3, 0.3) enter the float64 computation unrounded (not via float32)."""
    mean, mean_ref = _third_ish(2, 3, seed=13), _randn(2, 3, seed=14)
    ref = (_kl_elements(mean, mean_ref, torch.tensor(1 / 3, dtype=F64)) * 0.3).mean(1)
    out = kl_penalty("flow_grpo", mean=mean, mean_ref=mean_ref, std=1 / 3, delta=-0.3)
    assert out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    ref_g = _kl_elements(mean, mean_ref, torch.tensor(1 / 3, dtype=F64)).mean(1)
    torch.testing.assert_close(gaussian_kl(mean, mean_ref, 1 / 3), ref_g, rtol=0, atol=1e-12)


def test_per_frame_std_and_delta_on_wan_layout_use_frame_dim():
    """Per-frame [B, T] std and delta land on frame_dim = 2 of a [B, C, T, H, W] latent in both KL kinds."""
    b, c, t = 2, 3, 4
    mean, mean_ref = _randn(b, c, t, 2, 2, seed=15), _randn(b, c, t, 2, 2, seed=16)
    std = 0.2 + _randn(b, t, seed=17).abs()
    delta = -(0.05 + _randn(b, t, seed=18).abs())
    s, d = std.reshape(b, 1, t, 1, 1), delta.reshape(b, 1, t, 1, 1)
    kl = _kl_elements(mean, mean_ref, s)
    torch.testing.assert_close(kl_penalty("gaussian", mean=mean, mean_ref=mean_ref, std=std, frame_dim=2),
                               kl.reshape(b, -1).mean(1), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        kl_penalty("flow_grpo", mean=mean, mean_ref=mean_ref, std=std, delta=delta, frame_dim=2),
        (kl * d.abs()).reshape(b, -1).mean(1), rtol=0, atol=1e-12)


def test_one_dim_means_and_velocities_are_one_value_per_sample():
    """A [B] mean / velocity is accepted: the per-sample KL is that sample's single element's KL."""
    mean, mean_ref, v, v_ref = _randn(3, seed=19), _randn(3, seed=20), _randn(3, seed=21), _randn(3, seed=22)
    torch.testing.assert_close(gaussian_kl(mean, mean_ref, 0.5), (mean - mean_ref) ** 2 / 0.5, rtol=0, atol=1e-12)
    torch.testing.assert_close(velocity_kl(v, v_ref), (v - v_ref) ** 2, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="batch dim"):
        gaussian_kl(torch.tensor(1.0), torch.tensor(0.0), 0.5)
    with pytest.raises(ValueError, match="batch dim"):
        velocity_kl(torch.tensor(1.0), torch.tensor(0.0))


def test_kl_penalty_names_each_missing_argument():
    """kl_penalty raises ValueError naming exactly the missing argument, for each needed argument of each kind."""
    x = _randn(2, 3, seed=23)
    full = {"mean": x, "mean_ref": x + 1, "std": 0.5, "delta": -0.1}
    for kind, names in (("velocity_mse", ("v", "v_ref")), ("gaussian", ("mean", "mean_ref", "std")),
                        ("flow_grpo", ("mean", "mean_ref", "std", "delta"))):
        given = {"v": x, "v_ref": x + 1} if kind == "velocity_mse" else full
        for name in names:
            kw = {k: val for k, val in given.items() if k != name}
            with pytest.raises(ValueError, match=rf"^kl_penalty\('{kind}'\) needs {name}$"):
                kl_penalty(kind, **kw)  # type: ignore[arg-type]


def test_kl_errors_name_the_std_or_delta_that_does_not_fit():
    """A std / delta of the wrong shape raises ValueError naming it ("std of shape", "delta of shape")."""
    x = _randn(2, 3, seed=24)
    bad = torch.ones(3, dtype=F64)
    with pytest.raises(ValueError, match=r"^std of shape \(3,\)"):
        gaussian_kl(x, x + 1, bad)
    with pytest.raises(ValueError, match=r"^std of shape \(3,\)"):
        kl_penalty("flow_grpo", mean=x, mean_ref=x + 1, std=bad, delta=-0.1)
    with pytest.raises(ValueError, match=r"^delta of shape \(3,\)"):
        kl_penalty("flow_grpo", mean=x, mean_ref=x + 1, std=0.5, delta=bad)


# ================================================================================================ normalize_rewards


def test_normalize_rewards_default_eps_is_1e_minus_8_added_to_std():
    """The default eps is 1e-8, added to std: (r - m) / (s + 1e-8) in float64."""
    r = _third_ish(4, seed=25)
    ref = (r - 0.5) / (1.0 + 1e-8)
    torch.testing.assert_close(normalize_rewards(r, 0.5, 1.0), ref, rtol=0, atol=1e-15)


@pytest.mark.parametrize("which", ["rewards", "mean", "std"])
def test_normalize_rewards_float64_in_any_input_gives_float64(which):
    """normalize_rewards runs in float64 when any one of rewards, mean, std ([N] tensors) is float64."""
    args = {"rewards": _randn(3, seed=26, dtype=F32), "mean": torch.tensor([0.5, -1.0, 2.0], dtype=F32),
            "std": torch.tensor([1.5, 0.25, 4.0], dtype=F32)}
    args[which] = _third_ish(3, seed=27).abs() + 0.1
    ref = (args["rewards"].double() - args["mean"].double()) / (args["std"].double() + 0.125)
    out = normalize_rewards(args["rewards"], args["mean"], args["std"], eps=0.125)
    assert out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_normalize_rewards_half_inputs_are_computed_in_float32():
    """Half-precision rewards or statistics are cast to float32 before the arithmetic (0-d rewards included)."""
    r = torch.tensor(0.1, dtype=F32)  # 0-d: a [N] float16 statistic must not decide the result dtype
    m, s = torch.tensor([0.5, 2.0], dtype=F16), torch.tensor([1.0, 3.0], dtype=F16)
    ref = (0.1 - m.double()) / (s.double() + 1e-3)
    out = normalize_rewards(r, m, s, eps=1e-3)
    assert out.dtype == F32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    rh = torch.tensor([0.1, 0.7], dtype=F16)
    out_h = normalize_rewards(rh, 1 / 3, 0.0, eps=1.0)
    assert out_h.dtype == F32
    torch.testing.assert_close(out_h.double(), rh.double() - 1 / 3, rtol=0, atol=1e-7)


def test_normalize_rewards_moves_tensor_statistics_to_the_rewards_device():
    """Tensor mean / std on another device are moved to the rewards' device (meta rewards, cpu statistics)."""
    out = normalize_rewards(torch.zeros(3, device="meta"), torch.zeros(3), torch.ones(3))
    assert out.device.type == "meta" and out.shape == (3,) and out.dtype == F32


# ================================================================================================ RunningMeanStd


def test_running_mean_std_statistics_are_float64_from_the_start():
    """A fresh RunningMeanStd holds float64 zeros (count, mean, m2), and its state_dict is float64."""
    rms = RunningMeanStd(shape=(2,))
    for t in (rms.count, rms.mean, rms.m2, *rms.state_dict().values()):
        assert t.dtype == F64 and t.shape == (2,) and not bool(t.any())


def test_running_mean_std_update_from_python_floats_is_float64():
    """Python-float observations are accumulated in float64 (mean and m2 equal the float64 formulas, 1e-15)."""
    vals = [1 / 3, 0.1, 2 / 3, -1 / 7]
    rms = RunningMeanStd()
    rms.update(vals)  # type: ignore[arg-type]
    m = sum(vals) / len(vals)
    assert float(rms.count) == 4.0
    assert float(rms.mean) == pytest.approx(m, rel=0, abs=1e-15)
    assert float(rms.m2) == pytest.approx(sum((v - m) ** 2 for v in vals), rel=0, abs=1e-15)


def test_running_mean_std_first_single_observation_is_the_mean():
    """One observation into an empty RunningMeanStd gives count 1, mean = that value, m2 = 0 (per component)."""
    rms = RunningMeanStd()
    rms.update(2.5)
    assert (float(rms.count), float(rms.mean), float(rms.m2)) == (1.0, 2.5, 0.0)
    vec = RunningMeanStd(shape=(2,))
    vec.update(torch.tensor([[3.0, float("nan")]], dtype=F64))
    vec.update(torch.tensor([[5.0, -4.0]], dtype=F64))
    assert vec.count.tolist() == [2.0, 1.0] and vec.mean.tolist() == [4.0, -4.0] and vec.m2.tolist() == [2.0, 0.0]


def test_running_mean_std_all_nan_batch_changes_nothing_even_after_inf():
    """An all-NaN batch leaves mean and m2 unchanged, also when the running mean is infinite."""
    rms = RunningMeanStd()
    rms.update(torch.tensor([math.inf, 1.0], dtype=F64))
    before = rms.state_dict()
    assert float(before["mean"]) == math.inf
    rms.update(torch.tensor([float("nan"), float("nan")], dtype=F64))
    for k, t in rms.state_dict().items():
        assert torch.equal(t, before[k]) or (k == "m2" and bool(t.isnan()) and bool(before[k].isnan())), k
    assert float(rms.mean) == math.inf


def test_running_mean_std_normalize_keeps_float64_and_uses_eps():
    """normalize(x float64) equals (x - mean) / (std + eps) in float64 with the float64 statistics, eps as given."""
    rms = RunningMeanStd()
    rms.update([1 / 3, 1 / 7, 0.9])  # type: ignore[arg-type]
    x = _third_ish(5, seed=28)
    mean, std = float(rms.mean), math.sqrt(float(rms.m2) / 3)
    out = rms.normalize(x, eps=0.5)
    assert out.dtype == F64
    torch.testing.assert_close(out, (x - mean) / (std + 0.5), rtol=0, atol=1e-12)
    assert rms.normalize(torch.zeros(2, device="meta")).device.type == "meta"


def test_running_mean_std_load_state_dict_converts_to_float64():
    """load_state_dict stores float64 copies: python numbers (even above int64) and float32 tensors alike."""
    rms = RunningMeanStd()
    rms.load_state_dict({"count": 2**64, "mean": 1 / 3, "m2": 0.1})  # type: ignore[dict-item]
    assert rms.count.dtype == rms.mean.dtype == rms.m2.dtype == F64
    assert (float(rms.count), float(rms.mean), float(rms.m2)) == (2.0**64, 1 / 3, 0.1)
    vec = RunningMeanStd(shape=(2,))
    state = {"count": torch.tensor([1.0, 2.0]), "mean": torch.tensor([0.5, 1.5]), "m2": torch.tensor([0.0, 2.0])}
    vec.load_state_dict(state)
    assert all(t.dtype == F64 for t in (vec.count, vec.mean, vec.m2))
    assert vec.mean.tolist() == [0.5, 1.5]


# ================================================================================================ gradient penalties


@pytest.mark.parametrize("fn,name", [(r1_penalty, "r1_penalty"), (r2_penalty, "r2_penalty")])
def test_gradient_penalty_errors_name_the_penalty(fn, name):
    """r1_penalty / r2_penalty errors start with the penalty's own name."""
    x = _randn(2, 3, seed=29)
    with pytest.raises(ValueError, match=rf"^{name}: inputs do not require grad"):
        fn(x.sum(1), x)


# ================================================================================================ advantage-weighted FM


def test_advantage_weighted_fm_loss_default_frame_dim_is_one():
    """With a [B, T] mask and the default frame_dim, T is dim 1 of a [B, T, C, H, W] latent (masked mean)."""
    b, t, c = 2, 3, 4
    v, u = _randn(b, t, c, 2, seed=30), _randn(b, t, c, 2, seed=31)
    mask = torch.tensor([[True, False, True], [False, True, True]])
    w = torch.tensor([0.5, -1.5], dtype=F64)
    sq = (v - u) ** 2
    ell = torch.stack([sq[i][mask[i]].mean() for i in range(b)])
    torch.testing.assert_close(advantage_weighted_fm_loss(v, u, w, mask), (w * ell).mean(), rtol=0, atol=1e-12)


def test_advantage_weighted_fm_loss_mask_on_wan_frame_dim():
    """A [B, T] mask with frame_dim = 2 selects frames of a [B, C, T, H, W] latent (masked per-sample mean)."""
    b, c, t = 2, 3, 4
    v, u = _randn(b, c, t, 2, seed=32), _randn(b, c, t, 2, seed=33)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    w = torch.tensor([2.0, 0.25], dtype=F64)
    sq = (v - u) ** 2
    ell = torch.stack([sq[i][:, mask[i]].mean() for i in range(b)])
    out = advantage_weighted_fm_loss(v, u, w, mask, frame_dim=2)
    torch.testing.assert_close(out, (w * ell).mean(), rtol=0, atol=1e-12)


def test_advantage_weighted_fm_loss_float64_weights_give_float64():
    """float64 weights with float32 velocities give a float64 loss with the weights unrounded; meta device kept."""
    v, u = _randn(3, 4, seed=34, dtype=F32), _randn(3, 4, seed=35, dtype=F32)
    w = _third_ish(3, seed=36)
    ell = ((v - u) ** 2).mean(1).double()  # sample_mse of float32 inputs runs in float32
    out = advantage_weighted_fm_loss(v, u, w)
    assert out.dtype == F64
    torch.testing.assert_close(out, (w * ell).mean(), rtol=0, atol=1e-12)
    out32 = advantage_weighted_fm_loss(v, u, w.float())
    assert out32.dtype == F32
    out64 = advantage_weighted_fm_loss(v.double() / 3, u.double(), w.float())
    assert out64.dtype == F64
    ell64 = ((v.double() / 3 - u.double()) ** 2).mean(1)
    torch.testing.assert_close(out64, (w.float().double() * ell64).mean(), rtol=0, atol=1e-12)
    vm = torch.zeros(2, 3, device="meta")
    assert advantage_weighted_fm_loss(vm, vm, torch.ones(2)).device.type == "meta"


def test_advantage_weighted_fm_loss_shape_error_names_v_and_u():
    """v and u of different shapes raise ValueError naming both ("v of shape ... and u of shape ...")."""
    with pytest.raises(ValueError, match=r"^v of shape \(2, 3\) and u of shape \(2, 4\)"):
        advantage_weighted_fm_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2))


# ================================================================================================ AWM loss


def _masked_ell(v: torch.Tensor, u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    sq = (v - u) ** 2
    return torch.stack([sq[i][mask[i]].mean() for i in range(v.shape[0])])


def test_awm_loss_adv_clip_below_one_and_default_frame_dim():
    """Uniform AWM with log p_old = 0 is -mean(clip(A, c) / c * exp(-l)), c = 0.5, a [B, T] mask on dim 1 by default."""
    b, t = 3, 2
    v, u = _randn(b, t, 3, 2, seed=40), _randn(b, t, 3, 2, seed=41)
    mask = torch.tensor([[True, False], [False, True], [True, True]])
    adv = torch.tensor([0.2, -1.0, 3.0], dtype=F64)
    loss, stats = awm_loss(v, u, 0.5, adv, weighting="uniform", log_p_old=torch.zeros(b, dtype=F64), adv_clip=0.5,
                           mask=mask)
    a = torch.tensor([0.4, -1.0, 1.0], dtype=F64)
    torch.testing.assert_close(loss, -(a * torch.exp(-_masked_ell(v, u, mask))).mean(), rtol=0, atol=1e-12)
    assert float(stats["adv_abs_mean"]) == pytest.approx(0.8, abs=1e-12)


@pytest.mark.parametrize("adv_clip", [0, 0.0, -1.0, float("nan"), True, "5", None])
def test_awm_loss_rejects_bad_adv_clip(adv_clip):
    """adv_clip must be a number > 0 (not bool, not NaN, not a string): ValueError naming adv_clip."""
    v = _randn(2, 3, seed=42)
    with pytest.raises(ValueError, match="^adv_clip must be a number > 0"):
        awm_loss(v, v + 1, 0.5, torch.zeros(2, dtype=F64), adv_clip=adv_clip)  # type: ignore[arg-type]


def test_awm_loss_errors_name_the_offending_argument():
    """awm_loss errors name the argument: v_theta / u / v_ref shapes, advantages, beta, beta_ema."""
    v = _randn(2, 3, seed=43)
    adv = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match=r"^v_theta of shape \(2, 3\) and u of shape \(2, 4\)"):
        awm_loss(v, _randn(2, 4, seed=44), 0.5, adv)
    with pytest.raises(ValueError, match=r"^v_theta of shape \(2, 3\) and v_ref of shape \(2, 4\)"):
        awm_loss(v, v + 1, 0.5, adv, v_ref=_randn(2, 4, seed=45), beta=0.1)
    with pytest.raises(ValueError, match=r"^v_theta of shape \(2, 3\) and v_ema of shape \(2, 4\)"):
        awm_loss(v, v + 1, 0.5, adv, v_ema=_randn(2, 4, seed=46), beta_ema=0.1)
    with pytest.raises(ValueError, match=r"^advantages must be one value per sample"):
        awm_loss(v, v + 1, 0.5, torch.zeros(3, dtype=F64))
    with pytest.raises(ValueError, match=r"^advantages holds NaN / inf at sample\(s\) \[1\]"):
        awm_loss(v, v + 1, 0.5, torch.tensor([0.0, math.nan], dtype=F64))
    with pytest.raises(ValueError, match=r"^beta must be a finite number >= 0"):
        awm_loss(v, v + 1, 0.5, adv, beta=-0.1)
    with pytest.raises(ValueError, match=r"^beta_ema must be a finite number >= 0"):
        awm_loss(v, v + 1, 0.5, adv, beta_ema=-0.1)


def test_awm_loss_any_positive_beta_ema_needs_v_ema():
    """beta_ema = 0.5 (> 0, < 1) without v_ema raises ValueError naming v_ema."""
    v = _randn(2, 3, seed=47)
    with pytest.raises(ValueError, match="needs v_ema"):
        awm_loss(v, v + 1, 0.5, torch.zeros(2, dtype=F64), beta_ema=0.5)


def test_awm_loss_passes_mask_frame_dim_p_eps_and_huber_delta_to_the_weighting():
    """AWM (log p_old = 0) is -mean(A exp(-w)), w = awm_weight(masked l on Wan frame_dim 2, t, p, eps, huber_delta)."""
    b, c, t = 2, 3, 4
    v, u = _randn(b, c, t, 2, seed=48), _randn(b, c, t, 2, seed=49)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    sq = (v - u) ** 2
    ell = torch.stack([sq[i][:, mask[i]].mean() for i in range(b)])
    adv, tt = torch.tensor([0.5, -2.0], dtype=F64), torch.tensor([0.3, 0.8], dtype=F64)
    for weighting, kw in (("ghuber", {"p": 0.5, "eps": 0.01}), ("huber", {"eps": 0.04, "huber_delta": 0.3})):
        loss, _ = awm_loss(v, u, tt, adv, weighting=weighting, log_p_old=torch.zeros(b, dtype=F64),
                           adv_clip=math.inf, adv_scale=False, mask=mask, frame_dim=2, **kw)
        ref = -(adv * torch.exp(-awm_weight(ell, tt, weighting, **kw))).mean()
        torch.testing.assert_close(loss, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"^log_p_old must be one value per sample"):
        awm_loss(v, u, tt, adv, log_p_old=torch.zeros(3, dtype=F64))


# ================================================================================================ AWM weight / loss:
# dtypes, defaults, input checks, anchors and stats


@pytest.mark.parametrize("which", ["t", "advantages", "log_p_old", "v_ref", "v_ema"])
def test_awm_loss_float64_in_any_input_gives_float64(which):
    """awm_loss runs in float64 when any one input is float64 (float64 reference at 1e-12; the others float32)."""
    b = 3
    v, u = _randn(b, 4, seed=60, dtype=F32), _randn(b, 4, seed=61, dtype=F32)
    args = {"t": torch.tensor([0.25, 0.5, 0.75], dtype=F32), "advantages": torch.tensor([0.5, -1.5, 2.0], dtype=F32),
            "log_p_old": torch.tensor([-0.5, -1.0, -2.0], dtype=F32), "v_ref": _randn(b, 4, seed=62, dtype=F32),
            "v_ema": _randn(b, 4, seed=63, dtype=F32)}
    args[which] = {"t": torch.tensor([0.3, 0.6, 0.9], dtype=F64) + 1e-9,
                   "advantages": _third_ish(b, seed=64), "log_p_old": -_third_ish(b, seed=65).abs(),
                   "v_ref": _third_ish(b, 4, seed=66), "v_ema": _third_ish(b, 4, seed=67)}[which]
    loss, stats = awm_loss(v, u, args["t"], args["advantages"], weighting="t", log_p_old=args["log_p_old"],
                           clip_range=None, adv_clip=2.0, v_ref=args["v_ref"], beta=0.5, v_ema=args["v_ema"],
                           beta_ema=0.25)
    d = {k: x.double() for k, x in args.items()}
    ell = ((v - u) ** 2).mean(1).double()  # sample_mse of two float32 velocities runs in float32
    ratio = torch.exp(-d["t"] * ell - d["log_p_old"])
    policy = (-(d["advantages"].clamp(-2, 2) / 2) * ratio).mean()
    kl_ref = ((v - args["v_ref"]) ** 2).mean(1).mean().double()  # float64 only when v_ref is
    kl_ema = ((v - args["v_ema"]) ** 2).mean(1).mean().double()
    assert loss.dtype == F64
    torch.testing.assert_close(loss, policy + 0.5 * kl_ref + 0.25 * kl_ema, rtol=0, atol=1e-12)
    for key in ("policy_loss", "kl_ref", "kl_ema", "fm_mse", "ratio_mean", "clip_frac", "adv_abs_mean"):
        assert stats[key].dtype == F64, key
    # with float32 everywhere the loss and every stat are float32
    args32 = {k: x.float() for k, x in args.items()}
    loss32, stats32 = awm_loss(v, u, args32["t"], args32["advantages"], log_p_old=args32["log_p_old"])
    assert loss32.dtype == F32 and all(s.dtype == F32 for s in stats32.values())


def test_awm_loss_stats_are_the_documented_values():
    """stats: policy_loss, kl_ref, kl_ema (masked on frame_dim 2), fm_mse, ratio_mean, clip_frac, adv_abs_mean."""
    b, c, t = 3, 2, 4
    v, u = _randn(b, c, t, seed=70), _randn(b, c, t, seed=71)
    v_ref, v_ema = _randn(b, c, t, seed=72), _randn(b, c, t, seed=73)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False], [True, True, False, False]])

    def masked(a: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        sq = (a - z) ** 2
        return torch.stack([sq[i][:, mask[i]].mean() for i in range(b)])

    adv = torch.tensor([1.0, -4.0, 10.0], dtype=F64)
    log_p_old = -masked(v, u) + torch.tensor([0.1, -1.0, 0.05], dtype=F64)  # ratios e^-0.1, e^1, e^-0.05
    loss, stats = awm_loss(v, u, 0.5, adv, weighting="uniform", log_p_old=log_p_old, clip_range=0.3, v_ref=v_ref,
                           beta=0.2, v_ema=v_ema, beta_ema=0.7, mask=mask, frame_dim=2)
    assert set(stats) == {"policy_loss", "kl_ref", "kl_ema", "fm_mse", "ratio_mean", "clip_frac", "adv_abs_mean"}
    ell = masked(v, u)
    ratio = torch.exp(-ell - log_p_old)
    a = adv.clamp(-5, 5) / 5
    policy = torch.maximum(-a * ratio, -a * ratio.clamp(0.7, 1.3)).mean()
    ref = {"policy_loss": policy, "kl_ref": masked(v, v_ref).mean(), "kl_ema": masked(v, v_ema).mean(),
           "fm_mse": ell.mean(), "ratio_mean": ratio.mean(),
           "clip_frac": ((ratio - 1).abs() > 0.3).double().mean(), "adv_abs_mean": a.abs().mean()}
    for key, value in ref.items():
        torch.testing.assert_close(stats[key], value, rtol=0, atol=1e-12, msg=key)
    torch.testing.assert_close(loss, policy + 0.2 * ref["kl_ref"] + 0.7 * ref["kl_ema"], rtol=0, atol=1e-12)
    assert 0 < float(stats["clip_frac"]) < 1  # the reference is not degenerate
    # without the anchors' velocities their stats are float64 zeros; unclipped: clip_frac is a float64 zero
    _, s0 = awm_loss(v, u, 0.5, adv, log_p_old=log_p_old)
    for key in ("kl_ref", "kl_ema", "clip_frac"):
        assert s0[key].dtype == F64 and float(s0[key]) == 0.0, key


def test_awm_loss_clip_frac_counts_strictly_outside_the_trust_region():
    """clip_frac counts |ratio - 1| > e: a sample exactly on the boundary |ratio - 1| = e is not counted."""
    v, u = _randn(2, 3, seed=74), _randn(2, 3, seed=75)
    log_p_old = torch.tensor([-2.0, 0.5], dtype=F64)
    ratio = torch.exp(-((v - u) ** 2).mean(1) - log_p_old)  # the same float64 ops as awm_loss (uniform weighting)
    e = float((ratio[0] - 1.0).abs())  # sample 0 on the boundary; sample 1 further out (ratio < 1 - e)
    assert float((ratio[1] - 1.0).abs()) > e
    _, stats = awm_loss(v, u, 0.5, torch.ones(2, dtype=F64), weighting="uniform", log_p_old=log_p_old, clip_range=e)
    assert float(stats["clip_frac"]) == 0.5


def test_awm_loss_zero_beta_switches_an_anchor_off():
    """beta = 0 (beta_ema = 0) leaves v_ref (v_ema) out of the loss: an overflowing reference does not reach it."""
    v, u = _randn(2, 3, seed=76, dtype=F32), _randn(2, 3, seed=77, dtype=F32)
    huge = torch.full((2, 3), 3e38, dtype=F32)  # (v - huge)^2 overflows float32 to inf
    adv = torch.tensor([1.0, -1.0], dtype=F32)
    base, _ = awm_loss(v, u, 0.5, adv)
    for kw in ({"v_ref": huge, "beta": 0.0}, {"v_ema": huge, "beta_ema": 0.0}):
        loss, stats = awm_loss(v, u, 0.5, adv, **kw)
        assert torch.isfinite(loss) and float(loss) == float(base), kw
        assert math.isinf(float(stats["kl_ref" if "v_ref" in kw else "kl_ema"]))  # the stat is still reported


def test_awm_weight_defaults_are_uniform_and_ghuber_p_quarter():
    """awm_weight's default weighting is "uniform" (w = l) and ghuber's default p is 0.25 (the reference's)."""
    ell, t = torch.tensor([0.0, 0.3, 2.0], dtype=F64), torch.tensor([0.2, 0.5, 0.9], dtype=F64)
    torch.testing.assert_close(awm_weight(ell, t), ell, rtol=0, atol=0)
    torch.testing.assert_close(awm_weight(ell, t, "ghuber"), awm_weight(ell, t, "ghuber", p=0.25), rtol=0, atol=0)
    expected = (t / 0.25) * ((ell + 1e-10) ** 0.25 - 1e-10**0.25)
    torch.testing.assert_close(awm_weight(ell, t, "ghuber"), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("weighting", ["uniform", "t", "ghuber"])
def test_awm_weight_float64_t_or_ell_gives_float64(weighting):
    """float32 l with a float64 t (tensor) gives float64 w equal to the float64 reference; float32 both: float32."""
    ell32 = torch.tensor([0.1, 0.7, 1.3], dtype=F32)
    t64 = torch.tensor([1 / 3, 0.5, 2 / 3], dtype=F64)
    w = awm_weight(ell32, t64, weighting)
    assert w.dtype == F64
    torch.testing.assert_close(w, awm_weight(ell32.double(), t64, weighting), rtol=0, atol=0)
    assert awm_weight(ell32, t64.float(), weighting).dtype == F32
    assert awm_weight(ell32, 0.5, weighting).dtype == F32  # a python float t does not widen
    w64 = awm_weight(ell32.double() / 3, 1 / 3, weighting)
    assert w64.dtype == F64
    torch.testing.assert_close(w64, awm_weight(ell32.double() / 3, torch.tensor(1 / 3, dtype=F64), weighting),
                               rtol=0, atol=0)  # a python float t is taken in float64, not rounded to float32
    # a bf16 t is widened to float32 before the arithmetic (t^2, t / p are not rounded in bf16)
    t16 = torch.tensor([0.3, 0.55, 0.9], dtype=torch.bfloat16)
    w16 = awm_weight(ell32, t16, "t2" if weighting == "uniform" else weighting)
    ref16 = awm_weight(ell32, t16.float(), "t2" if weighting == "uniform" else weighting)
    assert w16.dtype == F32
    torch.testing.assert_close(w16, ref16, rtol=0, atol=0)


def test_awm_weight_accepts_t_zero_one_sample_and_a_0d_tensor_t():
    """t = 0 is allowed (w = 0 for "t"), a single sample [1] is fine, and a 0-d tensor t broadcasts over [B]."""
    ell = torch.tensor([0.4, 0.9], dtype=F64)
    torch.testing.assert_close(awm_weight(ell, 0.0, "t"), torch.zeros(2, dtype=F64), rtol=0, atol=0)
    torch.testing.assert_close(awm_weight(ell, torch.zeros(2, dtype=F64), "t"), torch.zeros(2, dtype=F64))
    torch.testing.assert_close(awm_weight(ell[:1], 0.5, "t"), torch.tensor([0.2], dtype=F64), rtol=0, atol=1e-15)
    w = awm_weight(ell, torch.tensor(0.25, dtype=F64), "t2")
    torch.testing.assert_close(w, 0.0625 * ell, rtol=0, atol=1e-15)


def test_awm_weight_rejects_bad_ell_t_and_parameters_naming_them():
    """Bad ell (not [B], empty, negative, NaN), t (wrong shape, bool, outside [0, 1]), eps / huber_delta <= 0 raise."""
    ell = torch.tensor([0.4, 0.9], dtype=F64)
    with pytest.raises(ValueError, match=r"^ell must be the per-sample error \[B\], got shape \(2, 1\)"):
        awm_weight(ell[:, None], 0.5)
    with pytest.raises(ValueError, match=r"^ell must be the per-sample error \[B\], got shape \(0,\)"):
        awm_weight(ell[:0], 0.5)
    for bad in (torch.tensor([0.4, -1e-3], dtype=F64), torch.tensor([math.nan, 0.9], dtype=F64)):
        with pytest.raises(ValueError, match="^ell must be a non-negative"):
            awm_weight(bad, 0.5)
    for t_bad in (torch.full((2, 1), 0.5, dtype=F64), torch.full((3,), 0.5, dtype=F64)):
        with pytest.raises(ValueError, match=r"^t must be \[B\] = \[2\] or a scalar"):
            awm_weight(ell, t_bad)
    with pytest.raises(TypeError, match="^t must be a torch.Tensor"):
        awm_weight(ell, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^t must lie in \[0, 1\]"):
        awm_weight(ell, -0.01)
    with pytest.raises(ValueError, match="^eps must be"):
        awm_weight(ell, 0.5, "ghuber", eps=0.0)
    with pytest.raises(ValueError, match="^huber_delta must be"):
        awm_weight(ell, 0.5, "huber", huber_delta=-1.0)


@pytest.mark.parametrize("bad", [True, "0.1", math.inf, math.nan, -1e-9, None])
def test_awm_loss_anchor_weights_must_be_finite_numbers_not_bools_or_strings(bad):
    """beta / beta_ema: a bool, a string, inf, NaN, a negative or None raises ValueError naming the weight."""
    v = _randn(2, 3, seed=78)
    for name in ("beta", "beta_ema"):
        with pytest.raises(ValueError, match=f"^{name} must be a finite number >= 0, got {bad!r}"):
            awm_loss(v, v + 1, 0.5, torch.zeros(2, dtype=F64), v_ref=v, v_ema=v, **{name: bad})


def test_batch_checks_accept_one_sample_and_reject_0d_and_empty_batches_naming_them():
    """sample_mse: a batch of one sample is fine; a 0-d or an empty batch raises ValueError naming the input."""
    from genrl.flow.fm_core import sample_mse

    one = torch.tensor([[1.0, 3.0]], dtype=F64)
    torch.testing.assert_close(sample_mse(one, torch.zeros_like(one)), torch.tensor([5.0], dtype=F64), rtol=0, atol=0)
    for bad in (torch.tensor(1.0, dtype=F64), torch.zeros(0, 3, dtype=F64)):
        with pytest.raises(ValueError, match=r"must have a non-empty batch dim, got shape"):
            sample_mse(bad, bad.clone())


def test_positive_parameters_reject_bools():
    """A bool is not a number here: awm_weight(p=True) raises ValueError naming p (True would pass as 1)."""
    with pytest.raises(ValueError, match=r"^p must be a finite number > 0, got True"):
        awm_weight(torch.tensor([0.5], dtype=F64), 0.5, "ghuber", p=True)  # type: ignore[arg-type]
