"""Tests of genrl.flow.nft (BT loss, R1 / R2, advantages, DiffusionNFT loss) and genrl.models.VideoDiscriminator.

Invariants listed in docs/methods/distillation.md and docs/methods/forward_rl.md (Invariants tested; R4).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from genrl.flow import (
    advantage_to_r,
    bt_loss,
    centered_advantages,
    flow_matching_loss,
    nft_loss,
    r1_penalty,
    r2_penalty,
    ref_regularizer,
)
from genrl.models import Conditioning, VideoDiscriminator

F64, F32 = torch.float64, torch.float32
SHAPE = (3, 6, 4, 4, 4)  # [B, T, C, H, W]


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _nft_batch(shape=SHAPE, per_frame_sigma: bool = False, seed: int = 0):
    """Random (v_old, x_t, x0, eps, sigma) with x_t = (1 - sigma) x0 + sigma eps."""
    b, t = shape[0], shape[1]
    x0, eps, v_old = _randn(*shape, seed=seed), _randn(*shape, seed=seed + 1), _randn(*shape, seed=seed + 2)
    sigma = 0.1 + 0.8 * (_rand(b, t, seed=seed + 3) if per_frame_sigma else _rand(b, seed=seed + 3))
    s = sigma.reshape(b, t, 1, 1, 1) if per_frame_sigma else sigma.reshape(b, 1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * eps
    return v_old, x_t, x0, eps, sigma


def _grad(loss_fn, v: torch.Tensor) -> torch.Tensor:
    v = v.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(loss_fn(v), v)
    return g


# ----------------------------------------------------------------------------------------------
# Bradley-Terry loss


def test_bt_equals_bce_with_logits_and_softplus():
    s_t, s_s = _randn(16, seed=1) * 3, _randn(16, seed=2) * 3
    d = s_t - s_s
    expected = F.binary_cross_entropy_with_logits(d, torch.ones_like(d))
    torch.testing.assert_close(bt_loss(s_t, s_s), expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(bt_loss(s_t, s_s, reduction="none"), F.softplus(-d), rtol=0, atol=1e-14)
    torch.testing.assert_close(bt_loss(s_t, s_s, reduction="sum"), F.softplus(-d).sum(), rtol=0, atol=1e-13)
    assert bt_loss(s_t, s_s, reduction="none").shape == (16,)


def test_bt_invariant_to_per_prompt_bias_and_antisymmetry():
    s_t, s_s, bias = _randn(8, seed=3), _randn(8, seed=4), 10 * _randn(8, seed=5)
    torch.testing.assert_close(
        bt_loss(s_t + bias, s_s + bias, reduction="none"), bt_loss(s_t, s_s, reduction="none"), rtol=0, atol=1e-12
    )
    d = s_t - s_s
    zero = torch.zeros_like(d)
    # L(d) - L(-d) = -d
    torch.testing.assert_close(
        bt_loss(d, zero, reduction="none") - bt_loss(-d, zero, reduction="none"), -d, rtol=0, atol=1e-12
    )


def test_bt_gradient_at_zero_gap_is_minus_half_per_pair():
    s_t = torch.full((5,), 0.7, dtype=F64, requires_grad=True)
    s_s = torch.full((5,), 0.7, dtype=F64, requires_grad=True)
    g_t, g_s = torch.autograd.grad(bt_loss(s_t, s_s, reduction="none").sum(), (s_t, s_s))
    torch.testing.assert_close(g_t, torch.full((5,), -0.5, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(g_s, torch.full((5,), 0.5, dtype=F64), rtol=0, atol=1e-15)
    assert float(bt_loss(s_t, s_s).detach()) == pytest.approx(float(torch.log(torch.tensor(2.0, dtype=F64))), abs=1e-15)


def test_bt_rejects_mismatched_shapes_and_bad_reduction():
    with pytest.raises(ValueError, match=r"\(4,\).*\(4, 1\)"):
        bt_loss(torch.zeros(4), torch.zeros(4, 1))
    with pytest.raises(ValueError, match="reduction"):
        bt_loss(torch.zeros(4), torch.zeros(4), reduction="max")


@pytest.mark.parametrize("which", ["score_pos", "score_neg"])
def test_bt_loss_float64_in_either_score_gives_float64(which):
    """bt_loss is float64 when either score is float64 (1/3-offset values), equal to a float64 reference at 1e-12."""
    args = {"score_pos": _randn(7, seed=15, dtype=F32), "score_neg": _randn(7, seed=16, dtype=F32)}
    args[which] = _randn(7, seed=17) + 1 / 3
    ref = F.softplus(-(args["score_pos"].double() - args["score_neg"].double()))
    out = bt_loss(**args, reduction="none")
    assert out.dtype == F64
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_bt_loss_half_scores_are_computed_in_float32(half):
    """bt_loss of two half-precision scores is float32, the softplus of the float32 gap."""
    pos, neg = _randn(6, seed=18, dtype=half), _randn(6, seed=19, dtype=half)
    out = bt_loss(pos, neg, reduction="none")
    assert out.dtype == F32
    torch.testing.assert_close(out, F.softplus(-(pos.float() - neg.float())), rtol=0, atol=0)


def test_bt_loss_errors_name_score_pos_and_score_neg():
    """bt_loss's shape and type errors name score_pos and score_neg."""
    with pytest.raises(ValueError, match=r"^score_pos of shape \(4,\) and score_neg of shape \(4, 1\) must match"):
        bt_loss(torch.zeros(4), torch.zeros(4, 1))
    with pytest.raises(TypeError, match="^score_pos must be a torch.Tensor, got list"):
        bt_loss([0.0, 1.0], torch.zeros(2))
    with pytest.raises(TypeError, match="^score_neg must be a torch.Tensor, got list"):
        bt_loss(torch.zeros(2), [0.0, 1.0])


# ----------------------------------------------------------------------------------------------
# R1 / R2


def test_r1_matches_hand_computed_gradient_norm_of_linear_discriminator():
    w = _randn(6, 2, 3, 3, seed=7).requires_grad_(True)
    x = _randn(4, 6, 2, 3, 3, seed=8).requires_grad_(True)
    scores = (x * w).flatten(1).sum(1) + 0.3
    pen = r1_penalty(scores, x)
    torch.testing.assert_close(pen, w.detach().square().sum(), rtol=0, atol=1e-12)
    # create_graph: the penalty is differentiable w.r.t. D's parameters, d||w||^2/dw = 2w
    (gw,) = torch.autograd.grad(pen, w)
    torch.testing.assert_close(gw, 2 * w.detach(), rtol=0, atol=1e-12)


def test_r2_per_sample_gradient_norm_of_quadratic_discriminator():
    x = _randn(3, 5, 2, seed=9).requires_grad_(True)
    scores = 0.5 * x.square().flatten(1).sum(1)  # dD/dx_b = x_b
    torch.testing.assert_close(r2_penalty(scores, x), x.detach().square().flatten(1).sum(1).mean(), rtol=0, atol=1e-12)


def test_gradient_penalty_errors():
    x = _randn(3, 4)
    with pytest.raises(ValueError, match="requires_grad"):
        r1_penalty(x.sum(1), x)
    xg = x.clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"scores of shape \(3, 1\)"):
        r1_penalty(xg.sum(1, keepdim=True), xg)


@pytest.mark.parametrize("fn", [r1_penalty, r2_penalty])
def test_gradient_penalty_one_dim_inputs_and_a_single_sample(fn):
    """[B] inputs (one scalar per sample) and a batch of one are valid: the penalty is mean_b ||dD/dx_b||^2."""
    x = _randn(5, seed=20).requires_grad_(True)
    torch.testing.assert_close(fn(1.5 * x.square(), x), (3 * x.detach()).square().mean(), rtol=0, atol=1e-12)
    w = _randn(1, 4, seed=21)
    x1 = _randn(1, 4, seed=22).requires_grad_(True)
    torch.testing.assert_close(fn((x1 * w).sum(1), x1), w.square().sum(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("fn,name", [(r1_penalty, "r1_penalty"), (r2_penalty, "r2_penalty")])
def test_gradient_penalty_rejects_empty_or_0d_inputs_and_non_tensors(fn, name):
    """An empty batch or 0-d inputs raise ValueError, a non-tensor argument TypeError, each naming the penalty."""
    x0 = torch.zeros(0, 3, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^{name}: inputs must have a non-empty batch dim, got shape \(0, 3\)"):
        fn(x0.sum(1), x0)
    xs = torch.tensor(2.0, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^{name}: inputs must have a non-empty batch dim, got shape \(\)"):
        fn(xs.reshape(1), xs)
    x = _randn(2, 3, seed=23).requires_grad_(True)
    with pytest.raises(TypeError, match=rf"^{name}: scores and inputs must be torch.Tensors"):
        fn([1.0, 2.0], x)
    with pytest.raises(TypeError, match=rf"^{name}: scores and inputs must be torch.Tensors"):
        fn(x.sum(1), x.tolist())


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_gradient_penalty_half_precision_gradients_give_float32(half):
    """Half-precision inputs / gradients give a float32 penalty, the float32 sum of the exact squared gradients."""
    w = _randn(3, 4, seed=24, dtype=half)
    x = _randn(2, 3, 4, seed=25, dtype=half).requires_grad_(True)
    for fn in (r1_penalty, r2_penalty):
        pen = fn((x * w).flatten(1).sum(1), x)  # dD/dx_b = w exactly
        assert pen.dtype == F32
        torch.testing.assert_close(pen, w.float().square().sum(), rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# advantages


def test_centered_advantages_mean_zero_std_one():
    d = _randn(32, seed=11) * 4 + 2
    a = centered_advantages(d, eps=1e-12)
    assert a.dtype == F64 and a.shape == (32,)
    assert abs(float(a.mean())) < 1e-12
    assert float(a.std(unbiased=False)) == pytest.approx(1.0, abs=1e-9)
    # default eps 1e-6: std(d) / (std(d) + 1e-6)
    a6 = centered_advantages(d)
    assert float(a6.std(unbiased=False)) == pytest.approx(float(d.std(unbiased=False) / (d.std(unbiased=False) + 1e-6)))


def test_centering_is_applied_to_all_negative_gaps():
    # an accurate discriminator: every student sample scores below its teacher
    d = -5.0 - _rand(16, seed=12)
    assert bool((d < 0).all())
    a = centered_advantages(d)
    assert bool((a > 0).any()) and bool((a < 0).any())
    r = advantage_to_r(a)
    assert bool((r > 0.5).any()) and bool((r < 0.5).any())


def test_centered_advantages_groups_and_per_frame():
    d = _randn(12, seed=13) + torch.arange(12, dtype=F64)
    group = torch.arange(12) // 4
    a = centered_advantages(d, group=group, eps=0.0)
    for g in range(3):
        ag = a[group == g]
        assert abs(float(ag.mean())) < 1e-12
        assert float(ag.std(unbiased=False)) == pytest.approx(1.0, abs=1e-12)
    # global std: per-group mean, one std for all
    ag = centered_advantages(d, group=group, eps=0.0, std="global")
    centred = d - d.reshape(3, 4).mean(1).repeat_interleave(4)
    torch.testing.assert_close(ag, centred / d.std(unbiased=False), rtol=0, atol=1e-12)
    # per-frame [B, T]: pooled over samples and frames
    dt = _randn(4, 3, seed=14)
    at = centered_advantages(dt, eps=0.0)
    assert at.shape == (4, 3) and abs(float(at.mean())) < 1e-12
    torch.testing.assert_close(at, (dt - dt.mean()) / dt.std(unbiased=False), rtol=0, atol=1e-12)
    # constant signal -> exactly zero advantage
    assert torch.equal(centered_advantages(torch.full((5,), 3.0)), torch.zeros(5))


def test_advantage_clip_and_r_map():
    d = torch.tensor([0.0] * 30 + [100.0, -100.0], dtype=F64)
    a = centered_advantages(d, clip=2.0)
    assert float(a.max()) == 2.0 and float(a.min()) == -2.0
    grid = torch.linspace(-10, 10, 201, dtype=F64)
    r = advantage_to_r(grid, clip_c=5.0)
    assert bool((r[1:] >= r[:-1]).all()) and bool((r[76:126][1:] > r[76:126][:-1]).all())
    assert float(advantage_to_r(torch.zeros(1, dtype=F64))) == 0.5
    assert float(r.min()) == 0.0 and float(r.max()) == 1.0
    torch.testing.assert_close(advantage_to_r(torch.tensor([5.0, -5.0, 2.5])), torch.tensor([1.0, 0.0, 0.75]))


def test_advantage_errors():
    with pytest.raises(ValueError, match="NaN"):
        centered_advantages(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="clip"):
        centered_advantages(torch.ones(3), clip=0.0)
    with pytest.raises(ValueError, match=r"group must be an integer tensor \[B\] = \[3\]"):
        centered_advantages(torch.ones(3), group=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \(2, 2, 2\)"):
        centered_advantages(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="clip_c"):
        advantage_to_r(torch.ones(3), clip_c=-1.0)


def test_centered_advantages_single_sample_is_zero_and_empty_d_raises():
    """A single sample gets A = 0 exactly (float64 for float64 d); an empty d raises ValueError naming its shape."""
    for d in (torch.tensor([3.0], dtype=F64), torch.tensor([[1.5]], dtype=F64)):
        a = centered_advantages(d)
        assert a.dtype == F64 and torch.equal(a, torch.zeros_like(d))
    with pytest.raises(ValueError, match=r"^d must be a non-empty \[B\] or \[B, T\] tensor, got shape \(0,\)"):
        centered_advantages(torch.zeros(0, dtype=F64))


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1e-9, "0.1", None])
def test_centered_advantages_eps_must_be_a_finite_nonnegative_number(bad):
    """eps = inf, NaN, a negative, a string or None raises ValueError naming eps and the bad value."""
    with pytest.raises(ValueError, match="^eps must be a finite number >= 0, got " + re.escape(repr(bad))):
        centered_advantages(_randn(4, seed=26), eps=bad)


def test_centered_advantages_clip_error_names_clip():
    """A non-positive clip raises ValueError naming clip."""
    with pytest.raises(ValueError, match=r"^clip must be a finite number > 0, got -1.0"):
        centered_advantages(_randn(4, seed=27), clip=-1.0)


def test_centered_advantages_group_errors_give_shape_type_and_dtype():
    """A bad group raises ValueError naming group and giving its shape, its type or its dtype."""
    d = _randn(3, seed=28)
    with pytest.raises(ValueError, match=r"^group must be an integer tensor \[B\] = \[3\], got \(4,\)$"):
        centered_advantages(d, group=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^group must be an integer tensor \[B\] = \[3\], got list$"):
        centered_advantages(d, group=[0, 0, 1])
    for dtype in (F32, torch.bool):
        with pytest.raises(ValueError, match=rf"^group must be an integer tensor, got dtype {dtype}$"):
            centered_advantages(d, group=torch.zeros(3, dtype=dtype))


def test_advantage_to_r_dtypes_and_errors():
    """advantage_to_r is float64 for float64 A and float32 for bf16 A (exact values); NaN A, a bad clip_c and a
    non-tensor raise errors naming advantages / clip_c."""
    a64 = 3 * _randn(9, seed=29) + 1 / 3
    r64 = advantage_to_r(a64)
    assert r64.dtype == F64
    torch.testing.assert_close(r64, 0.5 + a64.clamp(-5.0, 5.0) / 10.0, rtol=0, atol=1e-12)
    a16 = _randn(9, seed=30, dtype=torch.bfloat16)
    r16 = advantage_to_r(a16, clip_c=0.75)
    assert r16.dtype == F32
    torch.testing.assert_close(r16, 0.5 + a16.float().clamp(-0.75, 0.75) / 1.5, rtol=0, atol=0)
    with pytest.raises(ValueError, match="^advantages hold NaN"):
        advantage_to_r(torch.tensor([0.5, float("nan")]))
    with pytest.raises(ValueError, match="^clip_c must be a finite number > 0, got 0.0"):
        advantage_to_r(torch.zeros(2), clip_c=0.0)
    with pytest.raises(TypeError, match="^advantages must be a torch.Tensor, got list"):
        advantage_to_r([0.5])


# ----------------------------------------------------------------------------------------------
# DiffusionNFT loss


@pytest.mark.parametrize("beta", [1.0, 0.3])
@pytest.mark.parametrize("per_frame_r", [False, True])
def test_nft_gradient_at_old_policy_is_advantage_signed_flow_matching(beta, per_frame_r):
    v_old, x_t, x0, eps, sigma = _nft_batch()
    b, t = SHAPE[:2]
    c = 5.0
    r = _rand(b, t, seed=20) if per_frame_r else _rand(b, seed=20)
    u = eps - x0
    g_nft = _grad(lambda v: nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta, clip_c=c, adaptive=False), v_old)
    re = r.reshape(b, t, 1, 1, 1) if per_frame_r else r.reshape(b, 1, 1, 1, 1)

    def weighted_fm(v):  # C (2 r - 1) ||v - u||^2, per-sample element mean, batch mean
        return (c * (2 * re - 1) * (v - u).square()).reshape(b, -1).mean(1).mean()

    g_ref = _grad(weighted_fm, v_old)
    torch.testing.assert_close(g_nft, g_ref, rtol=0, atol=1e-10)
    assert float(g_ref.abs().max()) > 1e-3  # the identity is not vacuous


def test_nft_gradient_zero_at_r_half():
    v_old, x_t, x0, _, sigma = _nft_batch()
    half = torch.full((SHAPE[0],), 0.5, dtype=F64)
    g = _grad(lambda v: nft_loss(v, v_old, x_t, x0, sigma, half, beta=1.0, adaptive=False), v_old)
    assert torch.equal(g, torch.zeros_like(g))
    for adaptive in (False, True):
        g = _grad(lambda v, adaptive=adaptive: nft_loss(v, v_old, x_t, x0, sigma, half, beta=0.3, adaptive=adaptive),
                  v_old)
        assert float(g.abs().max()) < 1e-12


def test_nft_value_at_old_policy_is_flow_matching_loss_whatever_r():
    v_old, x_t, x0, eps, sigma = _nft_batch(per_frame_sigma=True)
    fm = flow_matching_loss(v_old, x0, eps, sigma).mean()
    for beta in (1.0, 0.1):
        for seed in (30, 31):
            r = _rand(SHAPE[0], seed=seed)
            val = nft_loss(v_old.clone(), v_old, x_t, x0, sigma, r, beta=beta, clip_c=5.0, adaptive=False)
            torch.testing.assert_close(val, 5.0 / beta * fm, rtol=1e-12, atol=0)


def test_nft_adaptive_value_and_gradient_at_old_policy():
    v_old, x_t, x0, eps, sigma = _nft_batch(per_frame_sigma=True)
    b, t = SHAPE[:2]
    r, c, beta = _rand(b, seed=40), 5.0, 0.5
    s = sigma.reshape(b, t, 1, 1, 1)
    res = x_t - s * v_old - x0
    w = res.abs().reshape(b, -1).mean(1).clamp_min(1e-5).reshape(b, 1, 1, 1, 1)
    n = res[0].numel()
    expected = c / beta * (res.square() / w).reshape(b, -1).mean(1).mean()
    val = nft_loss(v_old.clone(), v_old, x_t, x0, sigma, r, beta=beta, clip_c=c, adaptive=True)
    torch.testing.assert_close(val, expected, rtol=1e-12, atol=0)
    # R4 (docs/methods/forward_rl.md): the gradient at theta = old is 2 C sigma^2 (2r - 1) (v_old - u) / (w N B)
    g = _grad(lambda v: nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta, clip_c=c, adaptive=True), v_old)
    u = eps - x0
    g_ref = 2 * c * s.square() * (2 * r.reshape(b, 1, 1, 1, 1) - 1) * (v_old - u) / (w * n * b)
    torch.testing.assert_close(g, g_ref, rtol=1e-9, atol=1e-13)
    # away from theta = old: finite loss and gradient
    v = (v_old + 0.3 * _randn(*SHAPE, seed=41)).requires_grad_(True)
    loss = nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta, adaptive=True)
    (gv,) = torch.autograd.grad(loss, v)
    assert torch.isfinite(loss) and bool(torch.isfinite(gv).all()) and float(gv.abs().max()) > 0


def test_nft_positive_r_pulls_towards_the_sample():
    # r = 1: a gradient step on v_theta lowers the flow-matching error on its own sample; r = 0 raises it
    v_old, x_t, x0, eps, sigma = _nft_batch()
    u = eps - x0
    for r_val, sign in ((1.0, -1.0), (0.0, 1.0)):
        r = torch.full((SHAPE[0],), r_val, dtype=F64)
        for adaptive in (False, True):
            g = _grad(lambda v, r=r, adaptive=adaptive: nft_loss(v, v_old, x_t, x0, sigma, r, adaptive=adaptive), v_old)
            v_new = v_old - 1e-3 * g / g.abs().max()
            change = (v_new - u).square().mean() - (v_old - u).square().mean()
            assert float(change) * sign > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_nft_mask_excludes_frames(adaptive):
    v_old, x_t, x0, _, sigma = _nft_batch(per_frame_sigma=True)
    b, t = SHAPE[:2]
    sigma = sigma.clone()
    sigma[:, :2] = 0.0  # clean context frames: excluded by the mask
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[:, :2] = False
    r = _rand(b, t, seed=50)
    v = v_old + 0.2 * _randn(*SHAPE, seed=51)
    v_nan, vo_nan, xt_nan = v.clone(), v_old.clone(), x_t.clone()
    for z in (v_nan, vo_nan, xt_nan):
        z[:, :2] = float("nan")
    v_nan.requires_grad_(True)
    loss = nft_loss(v_nan, vo_nan, xt_nan, x0, sigma, r, adaptive=adaptive, mask=mask)
    (g,) = torch.autograd.grad(loss, v_nan)
    assert torch.isfinite(loss)
    assert torch.equal(g[:, :2], torch.zeros_like(g[:, :2]))
    sliced = nft_loss(v[:, 2:], v_old[:, 2:], x_t[:, 2:], x0[:, 2:], sigma[:, 2:], r[:, 2:], adaptive=adaptive)
    torch.testing.assert_close(loss, sliced, rtol=1e-12, atol=0)
    # without the mask the clean frames break the velocity form
    if not adaptive:
        with pytest.raises(ValueError, match="sigma > 0"):
            nft_loss(v, v_old, x_t, x0, sigma, r, adaptive=False)


def test_nft_wan_layout_matches_native_layout():
    v_old, x_t, x0, _, sigma = _nft_batch(per_frame_sigma=True)
    v = v_old + 0.1 * _randn(*SHAPE, seed=60)
    r = _rand(SHAPE[0], SHAPE[1], seed=61)
    mask = torch.ones(SHAPE[:2], dtype=torch.bool)
    mask[0, -1] = False
    ref = nft_loss(v, v_old, x_t, x0, sigma, r, mask=mask)
    wan = [z.transpose(1, 2) for z in (v, v_old, x_t, x0)]
    torch.testing.assert_close(nft_loss(*wan, sigma, r, mask=mask, frame_dim=2), ref, rtol=1e-12, atol=0)


def test_nft_errors():
    v_old, x_t, x0, _, sigma = _nft_batch()
    b = SHAPE[0]
    r = torch.full((b,), 0.5, dtype=F64)
    with pytest.raises(ValueError, match=r"r must lie in \[0, 1\]"):
        nft_loss(v_old, v_old, x_t, x0, sigma, r + 1.0)
    with pytest.raises(ValueError, match=r"v_theta of shape .* and x0 of shape"):
        nft_loss(v_old, v_old, x_t, x0[:, :2], sigma, r)
    with pytest.raises(ValueError, match="beta"):
        nft_loss(v_old, v_old, x_t, x0, sigma, r, beta=0.0)
    with pytest.raises(ValueError, match=r"r of shape \(4,\)"):
        nft_loss(v_old, v_old, x_t, x0, sigma, torch.full((4,), 0.5))
    with pytest.raises(ValueError, match=r"mask selects no frame for sample\(s\) \[1\]"):
        mask = torch.ones(SHAPE[:2], dtype=torch.bool)
        mask[1] = False
        nft_loss(v_old, v_old, x_t, x0, sigma, r, mask=mask)

def _nft_reference(v, v_old, x_t, x0, sigma, r, beta, c, adaptive, floor=1e-5):
    """DiffusionNFT loss in float64 from nft_loss's docstring formula (per-sample r and sigma, or a float sigma)."""
    v, v_old, x_t, x0 = (z.detach().double() for z in (v, v_old, x_t, x0))
    b = v.shape[0]
    bcast = (b,) + (1,) * (v.ndim - 1)
    s = sigma.detach().double().reshape(bcast) if isinstance(sigma, torch.Tensor) else float(sigma)
    r = r.detach().double().reshape(bcast)
    v_pos, v_neg = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v

    def q(vv):
        if adaptive:
            res = x_t - s * vv - x0
            return res.square() / res.abs().reshape(b, -1).mean(1).clamp_min(floor).reshape(bcast)
        return (vv - (x_t - x0) / s).square()

    return (c / beta) * (r * q(v_pos) + (1 - r) * q(v_neg)).reshape(b, -1).mean(1).mean()


def test_nft_loss_defaults_are_beta_1_clip_5_adaptive_with_floor_1e_minus_5():
    """With every knob left at its default nft_loss is the adaptive loss with beta = 1, C = 5 and floor 1e-5."""
    v_old, x_t, x0, eps, sigma = _nft_batch()
    v = v_old + 0.2 * _randn(*SHAPE, seed=80)
    u = eps - x0
    v_old[0] = u[0] + 1e-6 * _randn(*SHAPE[1:], seed=81)  # sample 0: mean |residual| < 1e-5, the floor acts
    v[0] = u[0] + 1e-6 * _randn(*SHAPE[1:], seed=82)
    r = _rand(SHAPE[0], seed=83)
    ref = _nft_reference(v, v_old, x_t, x0, sigma, r, beta=1.0, c=5.0, adaptive=True, floor=1e-5)
    torch.testing.assert_close(nft_loss(v, v_old, x_t, x0, sigma, r), ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("which", ["v_theta", "v_old", "x_t", "x0", "sigma", "r"])
def test_nft_loss_float64_in_any_input_gives_float64(which, adaptive):
    """nft_loss is float64 when any one input is float64 (1/3-offset values, the others float32 and a python-float
    sigma of 1/3), equal to the float64 reference at 1e-12."""
    args = {name: _randn(*SHAPE, seed=84 + i, dtype=F32) for i, name in enumerate(("v_theta", "v_old", "x_t", "x0"))}
    args["sigma"] = 1 / 3
    args["r"] = _rand(SHAPE[0], seed=88, dtype=F32)
    if which == "sigma":
        args["sigma"] = 0.2 + _rand(SHAPE[0], seed=89) / 3
    elif which == "r":
        args["r"] = 1 / 3 + _rand(SHAPE[0], seed=89) / 3
    else:
        args[which] = _randn(*SHAPE, seed=89) + 1 / 3
    out = nft_loss(**args, beta=0.3, clip_c=5.0, adaptive=adaptive)
    assert out.dtype == F64
    ref = _nft_reference(*args.values(), beta=0.3, c=5.0, adaptive=adaptive)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("v_dtype", [F32, torch.bfloat16])
def test_nft_loss_float32_and_half_inputs_give_float32(v_dtype, adaptive):
    """Float32 inputs with a float32 or bf16 v_theta give a float32 loss, computed in float32 (reference 1e-5)."""
    v_old, x_t, x0, _, sigma = (z.float() for z in _nft_batch())
    v = (v_old + 0.2 * _randn(*SHAPE, seed=90, dtype=F32)).to(v_dtype)
    r = _rand(SHAPE[0], seed=91, dtype=F32)
    out = nft_loss(v, v_old, x_t, x0, sigma, r, beta=0.3, adaptive=adaptive)
    assert out.dtype == F32
    ref = _nft_reference(v, v_old, x_t, x0, sigma, r, beta=0.3, c=5.0, adaptive=adaptive)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=0)


@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_loss_is_differentiable_in_v_theta_only(adaptive):
    """No gradient reaches v_old, x_t, x0, a tensor sigma or r (all detached); v_theta gets one."""
    v_old, x_t, x0, _, sigma = _nft_batch()
    others = [z.clone().requires_grad_(True) for z in (v_old, x_t, x0, sigma, _rand(SHAPE[0], seed=92))]
    v = (v_old + 0.1).requires_grad_(True)
    loss = nft_loss(v, *others, adaptive=adaptive)
    grads = torch.autograd.grad(loss, [v, *others], allow_unused=True)
    assert grads[0] is not None and all(g is None for g in grads[1:])


def test_nft_loss_errors_name_the_offending_argument():
    """Shape errors name v_theta and the mismatched tensor, parameter errors the parameter; NaN r is rejected."""
    v_old, x_t, x0, _, sigma = _nft_batch()
    r = torch.full((SHAPE[0],), 0.5, dtype=F64)
    good = {"v_theta": v_old, "v_old": v_old, "x_t": x_t, "x0": x0}
    for name in ("v_old", "x_t", "x0"):
        bad = dict(good, **{name: good[name][:, 1:]})
        msg = rf"^v_theta of shape \(3, 6, 4, 4, 4\) and {name} of shape \(3, 5, 4, 4, 4\)"
        with pytest.raises(ValueError, match=msg):
            nft_loss(**bad, sigma=sigma, r=r)
    for name, value in (("beta", 0.0), ("clip_c", -1.0), ("min_normalizer", math.inf)):
        with pytest.raises(ValueError, match=rf"^{name} must be a finite number > 0, got {value!r}"):
            nft_loss(**good, sigma=sigma, r=r, **{name: value})
    with pytest.raises(ValueError, match=r"^r must lie in \[0, 1\]"):
        nft_loss(**good, sigma=sigma, r=torch.tensor([0.5, float("nan"), 0.5], dtype=F64))


def test_nft_velocity_form_rejects_zero_sigma_on_a_masked_in_frame_and_reports_it():
    """Velocity form: sigma = 0 on a masked-in frame raises ValueError giving that sigma (0.0); on a masked-out
    frame it is allowed."""
    v_old, x_t, x0, _, sigma = _nft_batch(per_frame_sigma=True)
    r = _rand(SHAPE[0], seed=93)
    mask = torch.ones(SHAPE[:2], dtype=torch.bool)
    mask[1, 2] = False
    bad = sigma.clone()
    bad[0, 3] = 0.0
    with pytest.raises(ValueError, match=r"needs sigma > 0 on every masked-in element .*, got sigma = 0.0;"):
        nft_loss(v_old, v_old, x_t, x0, bad, r, adaptive=False, mask=mask)
    ok = sigma.clone()
    ok[1, 2] = 0.0
    loss = nft_loss(v_old, v_old, x_t, x0, ok, r, adaptive=False, mask=mask)
    assert torch.isfinite(loss)


def test_nft_adaptive_normaliser_is_taken_in_float64_for_float32_inputs():
    """Float32 adaptive nft_loss equals bit for bit the float32 recipe whose normaliser mean |e| is taken in float64
    (wide-range data, on which a float32 mean rounds differently)."""
    beta, c, floor = 0.3, 5.0, 1e-5
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        shape = (4, 3, 16, 16, 16)
        x0 = torch.randn(shape, generator=g) * torch.rand(shape, generator=g).mul(12).exp()
        eps = torch.randn(shape, generator=g)
        sigma = torch.rand(4, generator=g) * 0.8 + 0.1
        s = sigma.reshape(4, 1, 1, 1, 1)
        x_t = (1 - s) * x0 + s * eps
        v_old = eps - x0 + torch.randn(shape, generator=g)
        v = v_old + 0.3 * torch.randn(shape, generator=g)
        r = torch.rand(4, generator=g)
        re = r.reshape(4, 1, 1, 1, 1)

        def q(vv, x_t=x_t, x0=x0, s=s):
            res = x_t - s * vv - x0
            norm = res.double().abs().reshape(4, -1).mean(dim=1).clamp_min(floor).to(F32).reshape(4, 1, 1, 1, 1)
            return res.square() / norm

        el = re * q(beta * v + (1.0 - beta) * v_old) + (1.0 - re) * q((1.0 + beta) * v_old - beta * v)
        expected = (c / beta) * el.reshape(4, -1).mean(dim=1).mean()
        out = nft_loss(v, v_old, x_t, x0, sigma, r, beta=beta, clip_c=c)
        assert out.dtype == F32 and torch.equal(out, expected), seed


def test_ref_regularizer():
    v, v_ref = _randn(*SHAPE, seed=70).requires_grad_(True), _randn(*SHAPE, seed=71)
    val = ref_regularizer(v, v_ref)
    torch.testing.assert_close(val, (v.detach() - v_ref).square().mean(), rtol=1e-12, atol=0)
    (g,) = torch.autograd.grad(val, v)
    torch.testing.assert_close(g, 2 * (v.detach() - v_ref) / v.numel(), rtol=1e-12, atol=0)
    mask = torch.ones(SHAPE[:2], dtype=torch.bool)
    mask[:, 0] = False
    torch.testing.assert_close(
        ref_regularizer(v, v_ref, mask=mask), ref_regularizer(v[:, 1:], v_ref[:, 1:]), rtol=1e-12, atol=0
    )


def test_ref_regularizer_mask_on_wan_frame_dim():
    """With frame_dim=2 the [B, T] mask selects frames on dim 2 of [B, C, T, H, W]: float64 per-sample masked mean."""
    v, v_ref = _randn(2, 3, 4, 2, 2, seed=72), _randn(2, 3, 4, 2, 2, seed=73)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    sq = (v - v_ref).square()
    ref = torch.stack([sq[b][:, mask[b]].mean() for b in range(2)]).mean()
    torch.testing.assert_close(ref_regularizer(v, v_ref, mask=mask, frame_dim=2), ref, rtol=0, atol=1e-12)


def test_ref_regularizer_errors_name_v_theta_and_v_ref():
    """ref_regularizer's shape and type errors name v_theta and v_ref."""
    with pytest.raises(ValueError, match=r"^v_theta of shape \(2, 3\) and v_ref of shape \(2, 4\) must match"):
        ref_regularizer(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="^v_theta must be a torch.Tensor, got list"):
        ref_regularizer([0.0, 1.0], torch.zeros(2))


# ----------------------------------------------------------------------------------------------
# VideoDiscriminator

TEXT_DIM = 16


def _disc(**kw) -> VideoDiscriminator:
    torch.manual_seed(0)
    return VideoDiscriminator(text_dim=TEXT_DIM, **kw).eval()


def _text(b: int = 2, length: int = 5, seed: int = 0):
    states = _randn(b, length, TEXT_DIM, seed=seed, dtype=torch.float32)
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[0, -2:] = False
    return states, mask


@torch.no_grad()
def test_discriminator_shape_dtype_and_prompt_dependence():
    d = _disc()
    x = _rand(2, 8, 3, 16, 16, seed=1, dtype=torch.float32)
    states, mask = _text()
    s = d(x, states, mask)
    assert s.shape == (2,) and s.dtype == torch.float32 and bool(torch.isfinite(s).all())
    other, _ = _text(seed=5)
    assert float((d(x, other, mask) - s).abs().min()) > 1e-6
    # padded (masked-out) text tokens do not matter
    states2 = states.clone()
    states2[0, -2:] = 100.0
    torch.testing.assert_close(d(x, states2, mask), s)
    # the explicit (double-backward) attention path computes the same scores as the fused one
    torch.testing.assert_close(d(x, states, mask, double_backward=True), s, rtol=1e-5, atol=1e-6)
    # Conditioning entry point
    torch.testing.assert_close(d.score(x, Conditioning(states, mask, ["a", "b"])), s)
    # samples are scored independently
    x2 = x.clone()
    x2[1] = 0.0
    s2 = d(x2, states, mask)
    torch.testing.assert_close(s2[0], s[0])
    assert float((s2[1] - s[1]).abs()) > 1e-6


@torch.no_grad()
def test_discriminator_sigma_input_and_size_agnostic():
    d = _disc(readout="mean")
    x = _rand(2, 4, 3, 8, 8, seed=2, dtype=torch.float32)
    states, mask = _text()
    clean = d(x, states, mask)
    torch.testing.assert_close(d(x, states, mask, sigma=torch.zeros(2)), clean)
    assert float((d(x, states, mask, sigma=torch.tensor([0.5, 0.9])) - clean).abs().min()) > 1e-6
    assert d(x, states, mask, sigma=torch.full((2, 4), 0.3)).shape == (2,)
    assert d(_rand(2, 2, 3, 12, 6, seed=3, dtype=torch.float32), states, mask).shape == (2,)
    with pytest.raises(ValueError, match=r"sigma must lie in \[0, 1\]"):
        d(x, states, mask, sigma=torch.tensor([0.5, 1.5]))


def test_discriminator_differentiable_for_r1_with_and_without_checkpointing():
    d = _disc()
    x = _rand(2, 4, 3, 8, 8, seed=4, dtype=torch.float32)
    states, mask = _text()
    outs = []
    for ckpt in (False, True):
        d.zero_grad()
        if ckpt:
            d.enable_gradient_checkpointing()
        d.train()
        xi = x.clone().requires_grad_(True)
        pen = r1_penalty(d(xi, states, mask), xi)
        pen.backward()
        grads = torch.cat([p.grad.flatten() for p in d.parameters() if p.grad is not None])
        assert float(pen.detach()) > 0 and bool(torch.isfinite(grads).all()) and float(grads.abs().max()) > 0
        outs.append((pen.detach(), grads))
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-4, atol=1e-6)


@torch.no_grad()
def test_discriminator_wan_layout():
    d = _disc(in_channels=16, frame_dim=2)
    x = _randn(2, 16, 3, 4, 4, seed=6, dtype=torch.float32)  # [B, C, T, H, W]
    states, mask = _text()
    s = d(x, states, mask)
    assert s.shape == (2,) and s.dtype == torch.float32
    torch.testing.assert_close(d(x.transpose(1, 2), states, mask, frame_dim=1), s)


@torch.no_grad()
def test_discriminator_save_load_round_trip(tmp_path):
    d = _disc(patch_size=(2, 4, 4), num_layers=3, readout="token")
    x = _rand(2, 8, 3, 16, 16, seed=7, dtype=torch.float32)
    states, mask = _text()
    d.save_pretrained(tmp_path / "disc")
    loaded = VideoDiscriminator.from_pretrained(tmp_path / "disc").eval()
    assert tuple(loaded.config.patch_size) == (2, 4, 4) and loaded.config.num_layers == 3
    ref = d.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in loaded.state_dict().items()) and len(ref) == len(loaded.state_dict())
    torch.testing.assert_close(loaded(x, states, mask), d(x, states, mask), rtol=1e-6, atol=1e-6)


def test_discriminator_bad_inputs():
    d = _disc()
    states, mask = _text()
    with pytest.raises(ValueError, match=r"got shape \(2, 3, 16, 16\)"):
        d(torch.zeros(2, 3, 16, 16), states, mask)
    with pytest.raises(ValueError, match=r"\(2, 8, 4, 16, 16\).*in_channels=3"):
        d(torch.zeros(2, 8, 4, 16, 16), states, mask)
    with pytest.raises(ValueError, match=r"15 x 16 .*patch_size \(1, 2, 2\)"):
        d(torch.zeros(2, 8, 3, 15, 16), states, mask)
    with pytest.raises(ValueError, match=r"encoder_hidden_states of shape \(2, 5, 8\)"):
        d(torch.zeros(2, 8, 3, 16, 16), torch.zeros(2, 5, 8), mask)
    with pytest.raises(ValueError, match=r"no real token in row\(s\) \[1\]"):
        empty = mask.clone()
        empty[1] = False
        d(torch.zeros(2, 8, 3, 16, 16), states, empty)
    with pytest.raises(ValueError, match="hidden_size"):
        VideoDiscriminator(hidden_size=60)
