"""Tests of genrl.flow.preference: flow-matching Diffusion-DPO, DGPO (group logits, surrogate, DSM clipping) and CRD,
on hand-computed values and with autograd through a tiny linear velocity model v = W x_sigma (float64)."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow import (
    apply_keep,
    crd_centering,
    crd_implicit_reward,
    crd_loss,
    dgpo_group_logits,
    dgpo_surrogate,
    dpo_loss,
    dsm_clip_keep,
)
from genrl.flow.fm_core import sample_mse
from genrl.flow.parameterization import add_noise
from genrl.flow.policy import group_advantages
from genrl.flow.preference import crd_kl_weight

F64 = torch.float64
LOG2 = math.log(2.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _weights(d: int, seed: int, requires_grad: bool = True) -> torch.Tensor:
    w = torch.randn(d, d, generator=_gen(seed), dtype=F64) / math.sqrt(d)
    return w.requires_grad_(requires_grad)


def _dsm_error(w: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """e(x0, eps, sigma) of the linear velocity model v = W x_sigma: mean_j (v - (eps - x0))_j^2, [B]."""
    x = add_noise(x0, eps, sigma)
    return sample_mse(x @ w.T, eps - x0)


def _pairs(p: int, d: int, seed: int) -> dict[str, torch.Tensor]:
    """P (winner, loser) pairs of D-vectors with one (sigma, eps) per pair, shared by its two members."""
    g = _gen(seed)
    return {
        "x0_w": torch.randn(p, d, generator=g, dtype=F64),
        "x0_l": torch.randn(p, d, generator=g, dtype=F64),
        "eps": torch.randn(p, d, generator=g, dtype=F64),
        "sigma": torch.rand(p, generator=g, dtype=F64) * 0.9 + 0.05,
    }


def _pair_errors(w: torch.Tensor, w_ref: torch.Tensor, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    ew = _dsm_error(w, b["x0_w"], b["eps"], b["sigma"])
    el = _dsm_error(w, b["x0_l"], b["eps"], b["sigma"])
    with torch.no_grad():
        rw = _dsm_error(w_ref, b["x0_w"], b["eps"], b["sigma"])
        rl = _dsm_error(w_ref, b["x0_l"], b["eps"], b["sigma"])
    return ew, el, rw, rl


def _grad(value: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(value, w, retain_graph=True)
    return g


# ---------------------------------------------------------------------------------------------- DPO


def test_dpo_hand_computed_three_pairs():
    ew = torch.tensor([1.0, 2.0, 0.5], dtype=F64)
    el = torch.tensor([1.5, 1.0, 0.5], dtype=F64)
    rw = torch.tensor([1.2, 1.8, 0.7], dtype=F64)
    rl = torch.tensor([1.2, 1.1, 0.4], dtype=F64)
    loss, stats = dpo_loss(ew, el, rw, rl, beta=2.0)
    # (dw - dl) = (-0.2 - 0.3, 0.2 + 0.1, -0.2 - 0.1) = (-0.5, 0.3, -0.3); z = -(2/2)(dw - dl)
    z = [0.5, -0.3, 0.3]
    expected = torch.tensor([math.log1p(math.exp(-v)) for v in z], dtype=F64)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-14)
    assert loss.dtype == F64 and loss.shape == (3,)
    assert stats["implicit_accuracy"].item() == pytest.approx(2 / 3, abs=1e-15)
    assert stats["z_mean"].item() == pytest.approx(sum(z) / 3, abs=1e-14)
    assert stats["reward_margin"].item() == pytest.approx(sum(z) / 3, abs=1e-14)
    assert stats["err_w"].item() == pytest.approx(3.5 / 3, abs=1e-14)
    assert stats["err_l"].item() == pytest.approx(1.0, abs=1e-14)
    assert stats["ref_err_w"].item() == pytest.approx(3.7 / 3, abs=1e-14)
    assert stats["ref_err_l"].item() == pytest.approx(2.7 / 3, abs=1e-14)
    assert all(v.ndim == 0 and not v.requires_grad for v in stats.values())


def test_dpo_at_reference_is_log2_and_a_beta_over_4_fm_step():
    d, beta = 8, 37.0
    w = _weights(d, 0)
    w_ref = w.detach().clone()
    ew, el, rw, rl = _pair_errors(w, w_ref, _pairs(3, d, 1))
    loss, stats = dpo_loss(ew, el, rw, rl, beta=beta)
    assert stats["z_mean"].item() == 0.0
    assert stats["implicit_accuracy"].item() == 0.0  # z = 0 is not a correct ranking
    assert (loss - LOG2).abs().max().item() <= 1e-15
    g_dpo = _grad(loss.sum(), w)
    g_fm = _grad((ew - el).sum(), w)
    assert g_fm.abs().max() > 1e-3  # the expected gradient is not trivially 0
    torch.testing.assert_close(g_dpo, (beta / 4) * g_fm, rtol=1e-12, atol=1e-12)


def test_dpo_swapping_winner_and_loser_negates_z():
    g = _gen(3)
    ew, el, rw, rl = (torch.rand(5, generator=g, dtype=F64) for _ in range(4))
    loss, stats = dpo_loss(ew, el, rw, rl, beta=10.0)
    loss_s, stats_s = dpo_loss(el, ew, rl, rw, beta=10.0)
    assert stats_s["z_mean"].item() == pytest.approx(-stats["z_mean"].item(), abs=1e-14)
    # -logsigmoid(z) - (-logsigmoid(-z)) = -z, so the per-pair difference recovers each z
    z = -(10.0 / 2) * ((ew - rw) - (el - rl))
    torch.testing.assert_close(loss - loss_s, -z, rtol=0, atol=1e-12)
    assert stats["implicit_accuracy"] + stats_s["implicit_accuracy"] == pytest.approx(1.0)
    assert bool(((loss + loss_s) >= 2 * LOG2 - 1e-15).all())


def test_dpo_identical_samples_with_shared_noise_train_nothing():
    d = 8
    b = _pairs(4, d, 5)
    b["x0_l"] = b["x0_w"].clone()
    for seed in (0, 1):
        w = _weights(d, 10 + seed)
        w_ref = _weights(d, 20 + seed, requires_grad=False)  # theta != ref
        ew, el, rw, rl = _pair_errors(w, w_ref, b)
        loss, stats = dpo_loss(ew, el, rw, rl, beta=500.0)
        assert stats["z_mean"].item() == 0.0
        assert (loss - LOG2).abs().max().item() <= 1e-15
        assert _grad(loss.sum(), w).abs().max().item() <= 1e-12


def test_dpo_small_beta_limit_is_linear():
    g = _gen(7)
    ew, el, rw, rl = (torch.rand(6, generator=g, dtype=F64) for _ in range(4))
    beta = 1e-6
    loss, _ = dpo_loss(ew, el, rw, rl, beta=beta)
    linear = ((ew - rw) - (el - rl)) / 4
    torch.testing.assert_close((loss - LOG2) / beta, linear, rtol=0, atol=1e-7)


def test_dpo_epsilon_weighting_scales_errors_by_one_minus_sigma_squared():
    g = _gen(8)
    ew, el, rw, rl = (torch.rand(5, generator=g, dtype=F64) for _ in range(4))
    sigma = torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0], dtype=F64)
    w = (1 - sigma) ** 2
    loss_e, stats_e = dpo_loss(ew, el, rw, rl, beta=3.0, sigma=sigma, weighting="epsilon")
    loss_v, stats_v = dpo_loss(ew * w, el * w, rw * w, rl * w, beta=3.0)
    torch.testing.assert_close(loss_e, loss_v, rtol=0, atol=1e-15)
    torch.testing.assert_close(stats_e["z_mean"], stats_v["z_mean"], rtol=0, atol=1e-15)
    # at sigma = 1 the epsilon form has no signal: z = 0
    assert loss_e[-1].item() == pytest.approx(LOG2, abs=1e-15)
    # the velocity form ignores sigma
    loss_plain, _ = dpo_loss(ew, el, rw, rl, beta=3.0)
    torch.testing.assert_close(dpo_loss(ew, el, rw, rl, beta=3.0, sigma=sigma)[0], loss_plain)
    assert not torch.allclose(loss_e, loss_plain)


@pytest.mark.parametrize("z", [1e4, -1e4])
def test_dpo_large_z_is_finite(z):
    ew = torch.tensor([0.0], dtype=F64, requires_grad=True)
    el = torch.tensor([z / 5.0], dtype=F64)  # z = -(10/2)(ew - el) = 5 el
    zero = torch.zeros(1, dtype=F64)
    loss, stats = dpo_loss(ew, el, zero, zero, beta=10.0)
    assert stats["z_mean"].item() == pytest.approx(z)
    assert torch.isfinite(loss).all()
    assert loss.item() == pytest.approx(max(-z, 0.0), abs=1e-12)
    (g,) = torch.autograd.grad(loss.sum(), ew)
    assert torch.isfinite(g).all()
    # dL/de_w = (beta / 2) sigmoid(-z): 5 when confidently wrong, 0 when confidently right
    assert g.item() == pytest.approx(5.0 if z < 0 else 0.0, abs=1e-12)


def test_dpo_float32_inputs_give_float32():
    e = torch.rand(3)
    loss, stats = dpo_loss(e, e.flip(0), e, e, beta=1.0)
    assert loss.dtype == torch.float32 and stats["z_mean"].dtype == torch.float32


def test_dpo_errors():
    e = torch.rand(3, dtype=F64)
    with pytest.raises(ValueError, match=r"beta .*got 0"):
        dpo_loss(e, e, e, e, beta=0)
    with pytest.raises(ValueError, match=r"beta .*got -1\.0"):
        dpo_loss(e, e, e, e, beta=-1.0)
    with pytest.raises(ValueError, match=r"beta .*got nan"):
        dpo_loss(e, e, e, e, beta=float("nan"))
    with pytest.raises(ValueError, match=r"beta .*got inf"):
        dpo_loss(e, e, e, e, beta=float("inf"))
    with pytest.raises(ValueError, match=r"err_w of shape \(3,\) and ref_err_l of shape \(4,\)"):
        dpo_loss(e, e, e, torch.rand(4, dtype=F64), beta=1.0)
    with pytest.raises(ValueError, match=r"err_l must be a non-empty 1-d tensor.*\(3, 1\)"):
        dpo_loss(e, e[:, None], e, e, beta=1.0)
    with pytest.raises(ValueError, match="weighting 'epsilon' needs sigma"):
        dpo_loss(e, e, e, e, beta=1.0, weighting="epsilon")
    with pytest.raises(ValueError, match="unknown DPO weighting 'x0'"):
        dpo_loss(e, e, e, e, beta=1.0, weighting="x0")
    with pytest.raises(ValueError, match=r"sigma must be \[P\] = \[3\].*\(2,\)"):
        dpo_loss(e, e, e, e, beta=1.0, sigma=torch.rand(2), weighting="epsilon")
    with pytest.raises(ValueError, match=r"sigma must lie in \[0, 1\].*1\.5"):
        dpo_loss(e, e, e, e, beta=1.0, sigma=torch.tensor([0.1, 0.2, 1.5]), weighting="epsilon")


# ---------------------------------------------------------------------------------------------- DGPO


def _group_batch(groups: int, k: int, d: int, seed: int) -> dict[str, torch.Tensor]:
    """G groups of K samples; noise and sigma shared by the members of a group."""
    g = _gen(seed)
    n = groups * k
    gid = torch.arange(groups).repeat_interleave(k)
    eps = torch.randn(groups, d, generator=g, dtype=F64)[gid]
    sigma = (torch.rand(groups, generator=g, dtype=F64) * 0.9 + 0.05)[gid]
    rewards = torch.randn(n, generator=g, dtype=F64)
    return {
        "x0": torch.randn(n, d, generator=g, dtype=F64),
        "eps": eps,
        "sigma": sigma,
        "group": gid,
        "adv": group_advantages(rewards, gid),
    }


def _dgpo_objective(err, ref_err, adv, group, beta, k):
    """sum_g J_g with J_g = -logsigmoid(-z_g), z_g = (beta / K) sum_i A_i (e_i - e_ref,i) differentiable in e."""
    out = err.new_zeros(())
    for g in group.unique():
        m = group == g
        z = (beta / k) * (adv[m] * (err[m] - ref_err[m])).sum()
        out = out - torch.nn.functional.logsigmoid(-z)
    return out


@pytest.mark.parametrize("groups", [1, 2])
def test_dgpo_surrogate_gradient_equals_objective_gradient(groups):
    k, d, beta = 4, 16, 30.0
    b = _group_batch(groups, k, d, seed=11)
    w = _weights(d, 12)
    w_ref = _weights(d, 13, requires_grad=False)
    err = _dsm_error(w, b["x0"], b["eps"], b["sigma"])
    with torch.no_grad():
        ref_err = _dsm_error(w_ref, b["x0"], b["eps"], b["sigma"])
    z = dgpo_group_logits(err - ref_err, b["adv"], b["group"], beta, k)
    assert not z.requires_grad
    sur = dgpo_surrogate(err, b["adv"], z).mean()
    j = _dgpo_objective(err, ref_err, b["adv"], b["group"], beta, k)
    n = groups * k
    g_sur, g_j = _grad(sur, w), _grad(j, w)
    assert g_j.abs().max() > 1e-4
    # grad mean(surrogate) = (K / (N beta)) grad sum_g J_g
    torch.testing.assert_close(g_sur, (k / (n * beta)) * g_j, rtol=1e-10, atol=1e-14)
    # the weights are sigmoid(z_g) and genuinely differ from 1/2 (theta != ref)
    assert (torch.sigmoid(z) - 0.5).abs().max() > 1e-3


def test_dgpo_k2_reduces_to_dpo():
    g = _gen(14)
    ew, el, rw, rl = (torch.rand(1, generator=g, dtype=F64) for _ in range(4))
    beta = 7.0
    err = torch.cat([ew, el])
    ref = torch.cat([rw, rl])
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    z = dgpo_group_logits(err - ref, adv, torch.tensor([5, 5]), beta, group_size=2)
    j = -torch.nn.functional.logsigmoid(-z[0])
    loss, stats = dpo_loss(ew, el, rw, rl, beta=beta)
    assert j.item() == pytest.approx(loss.item(), abs=1e-14)
    assert z[0].item() == pytest.approx(-stats["z_mean"].item(), abs=1e-14)
    assert z[0].item() == z[1].item()


def test_dgpo_at_reference_weight_is_half():
    k, d = 4, 16
    b = _group_batch(2, k, d, seed=15)
    w = _weights(d, 16)
    err = _dsm_error(w, b["x0"], b["eps"], b["sigma"])
    z = dgpo_group_logits(err - err.detach(), b["adv"], b["group"], 50.0, k)
    assert torch.equal(z, torch.zeros_like(z))
    sur = dgpo_surrogate(err, b["adv"], z)
    torch.testing.assert_close(sur, 0.5 * b["adv"] * err.detach(), rtol=0, atol=1e-15)
    torch.testing.assert_close(_grad(sur.mean(), w), 0.5 * _grad((b["adv"] * err).mean(), w), rtol=1e-12, atol=1e-15)


def test_dgpo_per_group_constant_cancels_with_zero_sum_advantages():
    g = _gen(17)
    group = torch.tensor([3, 3, 3, 9, 9, 9, 3, 9])
    rewards = torch.randn(8, generator=g, dtype=F64)
    adv = group_advantages(rewards, group)
    err = torch.rand(8, generator=g, dtype=F64)
    ref = torch.rand(8, generator=g, dtype=F64)
    c_err = torch.where(group == 3, 0.7, -1.3).to(F64)
    c_ref = torch.where(group == 3, 2.1, 0.4).to(F64)
    z = dgpo_group_logits(err - ref, adv, group, 20.0, 4)
    z_shift = dgpo_group_logits((err + c_err) - (ref + c_ref), adv, group, 20.0, 4)
    torch.testing.assert_close(z_shift, z, rtol=0, atol=1e-12)
    # not a vacuous check: with non-zero-sum advantages the shift moves z
    z_bad = dgpo_group_logits((err + c_err) - (ref + c_ref), adv + 0.5, group, 20.0, 4)
    assert (z_bad - dgpo_group_logits(err - ref, adv + 0.5, group, 20.0, 4)).abs().max() > 1.0


def test_dgpo_several_groups_in_shuffled_order_and_partial_group():
    group = torch.tensor([7, 2, 7, 40, 2, 7, 40, 2, 7])  # group 2: 3 members, 40: 2 members, 7: 4 members
    d = torch.tensor([0.1, -0.2, 0.3, 0.5, 0.4, -0.1, 0.2, 0.0, 0.6], dtype=F64)
    adv = torch.tensor([1.0, 2.0, -1.0, 1.5, -0.5, 0.5, -2.0, 1.0, -0.5], dtype=F64)
    beta, k = 8.0, 4
    z = dgpo_group_logits(d, adv, group, beta, k)
    # by hand: (beta / K) sum A d, K the nominal size even for the incomplete groups
    s7 = 1.0 * 0.1 + (-1.0) * 0.3 + 0.5 * (-0.1) + (-0.5) * 0.6
    s2 = 2.0 * (-0.2) + (-0.5) * 0.4 + 1.0 * 0.0
    s40 = 1.5 * 0.5 + (-2.0) * 0.2
    expected = torch.tensor([{7: s7, 2: s2, 40: s40}[int(g)] * beta / k for g in group], dtype=F64)
    torch.testing.assert_close(z, expected, rtol=0, atol=1e-14)
    # invariant to shuffling the batch
    perm = torch.tensor([4, 0, 8, 2, 6, 1, 3, 7, 5])
    torch.testing.assert_close(dgpo_group_logits(d[perm], adv[perm], group[perm], beta, k), z[perm], rtol=0, atol=1e-14)


def test_dgpo_logits_linear_in_beta_and_detached():
    g = _gen(18)
    d = torch.randn(6, generator=g, dtype=F64, requires_grad=True)
    adv = torch.randn(6, generator=g, dtype=F64)
    group = torch.tensor([0, 1, 0, 1, 0, 1])
    z1 = dgpo_group_logits(d, adv, group, 1.0, 3)
    z5 = dgpo_group_logits(d, adv, group, 5.0, 3)
    assert z1.abs().min() > 1e-3
    torch.testing.assert_close(z5.abs(), 5 * z1.abs(), rtol=1e-14, atol=0)
    assert not z5.requires_grad


def test_dgpo_dtype():
    z = dgpo_group_logits(torch.rand(4), torch.rand(4), torch.tensor([0, 0, 1, 1]), 1.0, 2)
    assert z.dtype == torch.float32
    z = dgpo_group_logits(torch.rand(4, dtype=F64), torch.rand(4), torch.tensor([0, 0, 1, 1]), 1.0, 2)
    assert z.dtype == F64


def test_dgpo_errors():
    d, adv, grp = torch.rand(4, dtype=F64), torch.rand(4, dtype=F64), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="beta .*got 0.0"):
        dgpo_group_logits(d, adv, grp, 0.0, 2)
    with pytest.raises(ValueError, match="group_size .*got 0"):
        dgpo_group_logits(d, adv, grp, 1.0, 0)
    with pytest.raises(ValueError, match="group_size .*got 2.0"):
        dgpo_group_logits(d, adv, grp, 1.0, 2.0)
    with pytest.raises(ValueError, match=r"group 0 has 3 members, more than group_size = 2"):
        dgpo_group_logits(d, adv, torch.tensor([0, 0, 0, 1]), 1.0, 2)
    with pytest.raises(ValueError, match=r"err_diff of shape \(4,\) and adv of shape \(3,\)"):
        dgpo_group_logits(d, adv[:3], grp, 1.0, 2)
    with pytest.raises(ValueError, match="group must be an integer tensor.*float"):
        dgpo_group_logits(d, adv, grp.to(F64), 1.0, 2)
    with pytest.raises(ValueError, match=r"adv holds NaN / inf at sample\(s\) 2"):
        dgpo_group_logits(d, torch.tensor([0.0, 1.0, math.nan, 0.0], dtype=F64), grp, 1.0, 2)
    with pytest.raises(ValueError, match=r"err of shape \(4,\) and z of shape \(5,\)"):
        dgpo_surrogate(d, adv, torch.rand(5))


# ---------------------------------------------------------------------------------------------- DSM clip


def test_dsm_clip_keeps_everything_at_old():
    g = _gen(19)
    err = torch.rand(10, generator=g, dtype=F64)
    adv = torch.randn(10, generator=g, dtype=F64)
    for eps in (1e-5, 1e-2, 0.5):
        keep = dsm_clip_keep(err, err.clone(), adv, eps)
        assert keep.dtype == torch.bool and bool(keep.all())


def test_dsm_clip_is_sign_aware():
    rho = torch.tensor([1.5, 1.005, 0.5, 0.995, 2.0, 0.5, 1.5, 0.5], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 1.0, -2.0, 0.0], dtype=F64)
    old_err = torch.full((8,), 0.3, dtype=F64)
    err = old_err - torch.log(rho)  # rho = exp(old - err)
    keep = dsm_clip_keep(err, old_err, adv, clip_range=0.01)
    # cut: A>0 with rho>1.01 (0), A<0 with rho<0.99 (2); kept: inside the region (1, 3), A=0 (4, 7),
    # positive sample whose error went up (5), negative sample whose error went down (6)
    assert keep.tolist() == [False, True, False, True, True, True, True, True]


def test_apply_keep_zero_gradient_on_masked_samples():
    d = 8
    b = _pairs(6, d, 20)
    w = _weights(d, 21)
    err = _dsm_error(w, b["x0_w"], b["eps"], b["sigma"])
    keep = torch.tensor([True, False, True, False, False, True])
    kept = apply_keep(err, keep)
    torch.testing.assert_close(kept, err, rtol=0, atol=0)
    for i in range(6):
        g = _grad(kept[i], w)
        if keep[i]:
            torch.testing.assert_close(g, _grad(err[i], w), rtol=0, atol=0)
            assert g.abs().max() > 1e-6
        else:
            assert torch.equal(g, torch.zeros_like(g))


def test_dsm_clip_errors():
    e = torch.rand(3, dtype=F64)
    with pytest.raises(ValueError, match="clip_range .*got 0"):
        dsm_clip_keep(e, e, e, 0)
    with pytest.raises(ValueError, match=r"clip_range .*got -0\.1"):
        dsm_clip_keep(e, e, e, -0.1)
    with pytest.raises(ValueError, match=r"err of shape \(3,\) and adv of shape \(2,\)"):
        dsm_clip_keep(e, e, e[:2], 0.1)
    with pytest.raises(ValueError, match="keep must be a bool tensor.*int64"):
        apply_keep(e, torch.tensor([1, 0, 1]))


# ---------------------------------------------------------------------------------------------- CRD


def test_crd_implicit_reward():
    d = 8
    b = _pairs(5, d, 22)
    w = _weights(d, 23)
    err = _dsm_error(w, b["x0_w"], b["eps"], b["sigma"])
    r = crd_implicit_reward(err, err.detach().clone())
    assert torch.equal(r, torch.zeros_like(r))
    old = torch.tensor([0.5, 1.0, 2.0, 0.1, 0.3], dtype=F64)
    e = torch.tensor([0.4, 1.5, 2.0, 0.2, 0.3], dtype=F64)
    torch.testing.assert_close(crd_implicit_reward(e, old), old - e, rtol=0, atol=0)
    scale = torch.tensor([2.0, 0.5, 1.0, 0.0, 4.0], dtype=F64)  # 0 is clamped to 1e-5
    old_scale = torch.tensor([1.0, 1.0, 0.5, 1.0, 2.0], dtype=F64)
    expected = -(e / scale.clamp_min(1e-5) - old / old_scale)
    torch.testing.assert_close(crd_implicit_reward(e, old, scale, old_scale), expected, rtol=1e-15, atol=0)
    # scales are detached
    s = scale.clone().requires_grad_(True)
    assert crd_implicit_reward(e, old, s).requires_grad is False


@pytest.mark.parametrize("tau", [-1.0, 0.3, 2.0])
def test_crd_centering_sums_to_zero(tau):
    g = _gen(24)
    adv = torch.randn(7, generator=g, dtype=F64) * 4
    r = torch.randn(7, generator=g, dtype=F64)
    cen = crd_centering(r, adv, weight_temp=tau)
    rows = 1 if tau < 0 else 2
    assert cen.p.shape == (rows, 7) and cen.target.shape == (rows, 7)
    torch.testing.assert_close(cen.p.sum(dim=1), torch.ones(rows, dtype=F64))
    torch.testing.assert_close((cen.p * cen.target).sum(dim=1), torch.zeros(rows, dtype=F64), rtol=0, atol=1e-15)
    assert bool(((cen.a >= 0) & (cen.a <= 1)).all())
    if tau > 0:  # the + direction leans on the high advantages, the - direction on the low ones
        top, bottom = int(adv.argmax()), int(adv.argmin())
        assert cen.p[0, top] > cen.p[1, top] and cen.p[1, bottom] > cen.p[0, bottom]


@pytest.mark.parametrize("mode", ["mse", "bce"])
@pytest.mark.parametrize("tau", [-1.0, 0.5])
def test_crd_constant_shift_of_r_theta_leaves_loss_unchanged(mode, tau):
    g = _gen(25)
    adv = torch.randn(6, generator=g, dtype=F64)
    r = torch.randn(6, generator=g, dtype=F64)
    base, _ = crd_loss(r, adv, beta=3.0, mode=mode, weight_temp=tau)
    shifted, _ = crd_loss(r + 12.5, adv, beta=3.0, mode=mode, weight_temp=tau)
    assert shifted.item() == pytest.approx(base.item(), abs=1e-12)
    other, _ = crd_loss(r * 2, adv, beta=3.0, mode=mode, weight_temp=tau)
    assert abs(other.item() - base.item()) > 1e-3


@pytest.mark.parametrize("tau", [-1.0, 0.5])
def test_crd_loss_zero_iff_centered_rewards_match(tau):
    g = _gen(26)
    adv = torch.randn(6, generator=g, dtype=F64) * 3
    beta = 4.0
    a = adv.clamp(-5, 5) / 10 + 0.5
    r = a / beta - 0.37  # beta R_theta_c = R_c for any centering weights (an offset is centred away)
    loss, stats = crd_loss(r, adv, beta=beta, weight_temp=tau)
    assert loss.item() <= 1e-28
    assert stats["fit_abs_mean"].item() <= 1e-14
    r_off = r.clone()
    r_off[2] += 0.01
    assert crd_loss(r_off, adv, beta=beta, weight_temp=tau)[0].item() > 1e-7


def test_crd_hand_values_and_gradient():
    adv = torch.tensor([5.0, -5.0], dtype=F64)  # a = (1, 0), R_c = (0.5, -0.5)
    r = torch.tensor([0.3, 0.1], dtype=F64, requires_grad=True)
    beta = 2.0  # beta R_theta_c = (0.2, -0.2)
    mse, stats = crd_loss(r, adv, beta=beta, mode="mse")
    assert mse.item() == pytest.approx(0.09, abs=1e-15)
    assert stats["a_mean"].item() == 0.5
    assert stats["r_theta_mean"].item() == pytest.approx(0.2)
    bce, _ = crd_loss(r, adv, beta=beta, mode="bce")

    def bce1(x: float, t: float) -> float:
        s = 1 / (1 + math.exp(-x))
        return -(t * math.log(s) + (1 - t) * math.log(1 - s))

    t = 1 / (1 + math.exp(-0.5))
    assert bce.item() == pytest.approx((bce1(0.2, t) + bce1(-0.2, 1 - t)) / 2, abs=1e-14)
    # the centre is stop-gradient: d mse / d r_i = (2 / B) beta (beta R_theta_c,i - R_c,i)
    (g,) = torch.autograd.grad(mse, r)
    torch.testing.assert_close(g, torch.tensor([-0.6, 0.6], dtype=F64), rtol=0, atol=1e-14)


def test_crd_softmax_mode_hand_value():
    adv = torch.tensor([2.0, -1.0, 0.0], dtype=F64)
    r = torch.tensor([0.05, -0.02, 0.01], dtype=F64)
    beta, tau = 10.0, 0.25
    a = adv / 10 + 0.5
    total = 0.0
    for sign in (1, -1):
        p = torch.softmax(sign * a / tau, dim=0)
        rc = a - (p * a).sum()
        rt = r - (p * r).sum()
        total += 0.5 * ((beta * rt - rc) ** 2).mean().item()
    loss, _ = crd_loss(r, adv, beta=beta, weight_temp=tau)
    assert loss.item() == pytest.approx(total, abs=1e-15)
    # and it differs from uniform centering
    assert abs(crd_loss(r, adv, beta=beta)[0].item() - total) > 1e-4

    # gradient: the weighted centre sum_j p_j r_j is a stop-gradient constant
    def manual(rr: torch.Tensor, stop: bool) -> torch.Tensor:
        out = rr.new_zeros(())
        for sign in (1, -1):
            p = torch.softmax(sign * a / tau, dim=0)
            centre = (p * rr).sum()
            rt = rr - (centre.detach() if stop else centre)
            out = out + 0.5 * ((beta * rt - (a - (p * a).sum())) ** 2).mean()
        return out

    rg = r.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(crd_loss(rg, adv, beta=beta, weight_temp=tau)[0], rg)
    (g_stop,) = torch.autograd.grad(manual(rg, True), rg)
    (g_full,) = torch.autograd.grad(manual(rg, False), rg)
    torch.testing.assert_close(g, g_stop, rtol=1e-12, atol=1e-15)
    assert (g_stop - g_full).abs().max() > 1e-3


def test_crd_advantage_clip():
    r = torch.tensor([0.0, 0.0], dtype=F64)
    cen = crd_centering(r, torch.tensor([50.0, -2.0], dtype=F64), adv_clip=4.0)
    torch.testing.assert_close(cen.a, torch.tensor([1.0, 0.25], dtype=F64))


@pytest.mark.parametrize("mode", ["mse", "bce"])
@pytest.mark.parametrize("tau", [-1.0, 0.4])
def test_crd_centering_over_a_larger_set_is_micro_batch_invariant(mode, tau):
    """Rows centred on the whole set (``over``): the row-count-weighted mean of the parts' losses and gradients is
    the whole batch's; ``over`` = the rows themselves is the default; one constant added to every r_theta (rows and
    set) changes nothing, a shifted set centre alone does."""
    g = _gen(27)
    adv = torch.randn(7, generator=g, dtype=F64) * 3
    r = torch.randn(7, generator=g, dtype=F64).requires_grad_(True)
    whole, _ = crd_loss(r, adv, beta=2.0, mode=mode, weight_temp=tau)
    (g_whole,) = torch.autograd.grad(whole, r)
    over = (r.detach(), adv)
    same, _ = crd_loss(r, adv, beta=2.0, mode=mode, weight_temp=tau, over=over)
    assert same.item() == whole.item()
    parts = [torch.arange(0, 3), torch.arange(3, 4), torch.arange(4, 7)]
    total = sum(crd_loss(r[c], adv[c], beta=2.0, mode=mode, weight_temp=tau, over=over)[0] * len(c) for c in parts) / 7
    (g_parts,) = torch.autograd.grad(total, r)
    assert total.item() == pytest.approx(whole.item(), abs=1e-14)
    torch.testing.assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-15)
    c = parts[2]
    part = crd_loss(r[c], adv[c], beta=2.0, mode=mode, weight_temp=tau, over=over)[0].item()
    shifted = crd_loss(r[c] + 4.0, adv[c], beta=2.0, mode=mode, weight_temp=tau, over=(r.detach() + 4.0, adv))
    assert shifted[0].item() == pytest.approx(part, abs=1e-12)
    moved = crd_loss(r[c], adv[c], beta=2.0, mode=mode, weight_temp=tau, over=(r.detach() + 0.1, adv))[0].item()
    assert abs(moved - part) > 1e-3
    cen = crd_centering(r[c], adv[c], weight_temp=tau, over=over)  # target: the rows' a minus the set's centre
    a = adv.clamp(-5, 5) / 10 + 0.5
    p = cen.p
    assert p.shape == ((1 if tau < 0 else 2), 7)
    torch.testing.assert_close(cen.target, a[c].unsqueeze(0) - (p * a).sum(1, keepdim=True), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"r_all of shape \(7,\) and adv_all of shape \(2,\)"):
        crd_centering(r, adv, over=(r.detach(), adv[:2]))
    with pytest.raises(ValueError, match="adv_all holds NaN"):
        crd_centering(r, adv, over=(r.detach(), torch.full((7,), math.nan, dtype=F64)))


def test_crd_kl_weight():
    """k = 1e-4 + a (kl_beta - 1e-4) = kl_beta (m + a (1 - m)), m = 1e-4 / kl_beta: kl_beta at the best reward
    (a = 1), 1e-4 at the worst (a = 0)."""
    adv = torch.tensor([9.0, 5.0, 0.0, -2.5, -5.0], dtype=F64)
    k = crd_kl_weight(adv, 0.1)
    a = torch.tensor([1.0, 1.0, 0.5, 0.25, 0.0], dtype=F64)
    m = 1e-4 / 0.1
    torch.testing.assert_close(k, 0.1 * (m + a * (1 - m)), rtol=1e-14, atol=0)
    assert k[0].item() == pytest.approx(0.1) and k[-1].item() == pytest.approx(1e-4)
    torch.testing.assert_close(crd_kl_weight(adv, 0.1, adv_clip=2.5)[3], torch.tensor(1e-4, dtype=F64))
    assert crd_kl_weight(adv.float(), 0.1).dtype == torch.float32
    with pytest.raises(ValueError, match="kl_beta must be a finite number > 0, got 0"):
        crd_kl_weight(adv, 0)
    with pytest.raises(ValueError, match="adv holds NaN"):
        crd_kl_weight(torch.tensor([math.nan]), 0.1)


def test_crd_errors():
    r = torch.rand(3, dtype=F64)
    with pytest.raises(ValueError, match=r"beta .*got -2\.0"):
        crd_loss(r, r, beta=-2.0)
    with pytest.raises(ValueError, match="unknown CRD mode 'l1'"):
        crd_loss(r, r, beta=1.0, mode="l1")
    with pytest.raises(ValueError, match=r"weight_temp 0\.0 is not supported.*< 0.*> 0"):
        crd_loss(r, r, beta=1.0, weight_temp=0.0)
    with pytest.raises(ValueError, match="weight_temp nan is not supported"):
        crd_loss(r, r, beta=1.0, weight_temp=float("nan"))
    with pytest.raises(ValueError, match="adv_clip .*got 0"):
        crd_loss(r, r, beta=1.0, adv_clip=0)
    with pytest.raises(ValueError, match=r"r_theta of shape \(3,\) and adv of shape \(2,\)"):
        crd_loss(r, r[:2], beta=1.0)
    with pytest.raises(ValueError, match=r"scale must be a \[B\] = \[3\].*\(2,\)"):
        crd_implicit_reward(r, r, scale=torch.rand(2))
    with pytest.raises(ValueError, match=r"err of shape \(3,\) and old_err of shape \(4,\)"):
        crd_implicit_reward(r, torch.rand(4))
