"""Tests of genrl.flow.dmd: warped schedules, the DMD timestep sampler, DMD / SiD / critic / ODE losses, CFG."""

from __future__ import annotations

import re

import pytest
import torch

from genrl.flow import (
    critic_loss,
    dmd_cfg,
    dmd_gradient,
    dmd_loss,
    ode_regression_loss,
    reference_scale_to_w,
    sample_dmd_sigma,
    sid_loss,
    w_to_reference_scale,
    warped_sigmas,
    warped_timesteps,
)

F64 = torch.float64
SHAPE = (2, 6, 4, 4, 4)  # [B, T, C, H, W]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(seed), dtype=dtype)


# ----------------------------------------------------------------------------------------------
# warped denoising list


def test_warped_timesteps_self_forcing_golden():
    t = warped_timesteps([1000, 750, 500, 250], 5.0)
    assert t[0] == 1000.0
    assert t[1] == pytest.approx(937.5, abs=1e-9)
    assert t[2] == pytest.approx(2500.0 / 3.0, abs=1e-9)
    assert t[3] == pytest.approx(625.0, abs=1e-9)


def test_warped_timesteps_rolling_forcing_golden():
    t = warped_timesteps([1000, 800, 600, 400, 200], 5.0)
    assert [round(v, 1) for v in t] == [1000.0, 952.4, 882.4, 769.2, 555.6]


def test_warped_matches_reference_grid_construction():
    # the reference: shifted linspace(1, 0, 1001)[:-1] * 1000, 0 appended, indexed by 1000 - t
    shift = 5.0
    grid = torch.linspace(1, 0, 1001, dtype=F64)[:-1]
    grid = shift * grid / (1 + (shift - 1) * grid) * 1000
    grid = torch.cat([grid, torch.zeros(1, dtype=F64)])
    steps = [1000, 757, 522, 250, 1, 0]
    ref = grid[[1000 - s for s in steps]].tolist()
    assert warped_timesteps(steps, shift) == pytest.approx(ref, abs=1e-9)


def test_warped_shift_one_is_identity_and_monotone():
    steps = [1000, 750, 500, 250, 0]
    assert warped_timesteps(steps, 1.0) == [1000.0, 750.0, 500.0, 250.0, 0.0]
    for shift in (0.5, 3.0, 5.0, 8.0):
        t = warped_timesteps(list(range(1000, -1, -50)), shift)
        assert all(a > b for a, b in zip(t, t[1:])), shift
        assert t[0] == 1000.0 and t[-1] == 0.0


def test_warped_sigmas_are_timesteps_over_1000_without_trailing_zero():
    steps = [1000, 750, 500, 250]
    s = warped_sigmas(steps, 5.0)
    assert len(s) == 4
    assert s == pytest.approx([v / 1000 for v in warped_timesteps(steps, 5.0)], abs=1e-15)
    assert s[0] == 1.0 and s[1] == pytest.approx(0.9375, abs=1e-15)
    assert warped_sigmas(torch.tensor([1000, 500]), 3.0) == pytest.approx([1.0, 0.75], abs=1e-15)


@pytest.mark.parametrize(
    "steps, shift, match",
    [
        ([1000, 750.5], 5.0, "750.5"),
        ([1001], 5.0, "1001"),
        ([-1], 5.0, "-1"),
        ([1000], 0.0, "0.0"),
        ([1000], -2.0, "-2.0"),
    ],
)
def test_warped_bad_inputs(steps, shift, match):
    with pytest.raises(ValueError, match=match):
        warped_timesteps(steps, shift)


# ----------------------------------------------------------------------------------------------
# DMD timestep sampler


def test_sample_dmd_sigma_range_dtype_determinism():
    s = sample_dmd_sigma(4096, _gen(3))
    assert s.shape == (4096,) and s.dtype == torch.float32
    assert float(s.min()) >= 0.02 - 1e-7 and float(s.max()) <= 0.98 + 1e-7
    assert torch.equal(s, sample_dmd_sigma(4096, _gen(3)))
    assert not torch.equal(s, sample_dmd_sigma(4096, _gen(4)))


def test_sample_dmd_sigma_statistics_shift5():
    t = sample_dmd_sigma(20000, _gen(0)).double() * 1000
    assert 815 < float(t.median()) < 850  # analytic 833.3
    assert 0.33 < float((t > 900).double().mean()) < 0.39  # analytic 0.357
    at_max = torch.isclose(t, torch.tensor(980.0, dtype=F64), atol=1e-3)
    assert 0.07 < float(at_max.double().mean()) < 0.11  # clamp mass ~0.093
    assert bool(torch.isclose(t, torch.tensor(20.0, dtype=F64), atol=1e-3).any())  # tau < 4 -> 20


def test_sample_dmd_sigma_shift_one_is_uniform_integers_clamped():
    t = sample_dmd_sigma(5000, _gen(1), shift=1.0, min_timestep=0, max_timestep=1000).double() * 1000
    assert torch.allclose(t, t.round(), atol=1e-3)
    assert 0 <= float(t.min()) and float(t.max()) <= 999.0 + 1e-3
    assert 470 < float(t.mean()) < 530


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_timestep=600, max_timestep=500), "min_timestep=600"),
        (dict(max_timestep=1200), "1200"),
        (dict(min_timestep=-5), "-5"),
        (dict(shift=0.0), "0.0"),
    ],
)
def test_sample_dmd_sigma_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_dmd_sigma(4, _gen(), **kwargs)


def test_sample_dmd_sigma_needs_generator_and_batch():
    with pytest.raises(TypeError):
        sample_dmd_sigma(4, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch"):
        sample_dmd_sigma(0, _gen())


# ----------------------------------------------------------------------------------------------
# DMD gradient and loss


def _dmd_inputs(seed: int = 0):
    x = _randn(*SHAPE, seed=seed)
    x0_fake = _randn(*SHAPE, seed=seed + 1)
    x0_real = _randn(*SHAPE, seed=seed + 2)
    return x, x0_fake, x0_real


def test_dmd_gradient_matches_definition():
    x, f, r = _dmd_inputs()
    g = dmd_gradient(x, f, r)
    nrm = (x - r).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    assert g.dtype == F64 and not g.requires_grad
    assert torch.allclose(g, (f - r) / nrm, atol=1e-15, rtol=0)
    assert torch.equal(dmd_gradient(x, f, r, normalize=False), f - r)
    assert dmd_gradient(x.float(), f.float(), r.float()).dtype == torch.float32


def test_dmd_loss_gradient_is_g_over_n_and_value_half_mean_g2():
    x, f, r = _dmd_inputs()
    g = dmd_gradient(x, f, r)
    xg = x.clone().requires_grad_(True)
    loss = dmd_loss(xg, g)
    assert loss.dtype == F64 and loss.ndim == 0
    (grad,) = torch.autograd.grad(loss, xg)
    assert torch.allclose(grad, g / g.numel(), atol=1e-15, rtol=0)
    assert torch.allclose(loss, 0.5 * g.square().mean(), atol=1e-15, rtol=0)


def test_dmd_loss_float32_input_returns_float32_with_exact_gradient_direction():
    x, f, r = (t.float() for t in _dmd_inputs())
    g = dmd_gradient(x, f, r)
    xg = x.clone().requires_grad_(True)
    loss = dmd_loss(xg, g)
    assert loss.dtype == torch.float32
    (grad,) = torch.autograd.grad(loss, xg)
    assert grad.dtype == torch.float32
    assert torch.allclose(grad, g / g.numel(), atol=1e-12, rtol=1e-6)


def test_dmd_loss_masked():
    x, f, r = _dmd_inputs()
    mask = torch.tensor([[True, True, False, True, False, True], [False, True, True, True, True, False]])
    g = dmd_gradient(x, f, r, mask=mask)
    m = mask[:, :, None, None, None].expand(SHAPE).to(F64)
    n_masked = int(m.sum())
    assert n_masked == 8 * 64
    xg = x.clone().requires_grad_(True)
    loss = dmd_loss(xg, g, mask=mask)
    (grad,) = torch.autograd.grad(loss, xg)
    assert torch.allclose(grad, g * m / n_masked, atol=1e-15, rtol=0)
    assert torch.all(grad[~mask] == 0)
    assert torch.allclose(loss, 0.5 * (g.square() * m).sum() / n_masked, atol=1e-15, rtol=0)


def test_dmd_gradient_masked_normaliser_uses_masked_elements_only():
    x, f, r = _dmd_inputs()
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.float32)
    g = dmd_gradient(x, f, r, mask=mask)
    a = (x - r).abs()
    n0 = a[0, :2].mean()
    n1 = a[1, 3:].mean()
    assert torch.allclose(g[0], (f - r)[0] / n0, atol=1e-15, rtol=0)
    assert torch.allclose(g[1], (f - r)[1] / n1, atol=1e-15, rtol=0)
    # changing x in masked-out frames does not change the normaliser
    x2 = x.clone()
    x2[0, 3] += 100.0
    assert torch.equal(dmd_gradient(x2, f, r, mask=mask), g)


def test_dmd_gradient_wan_layout_frame_dim_2():
    x, f, r = _dmd_inputs()
    mask = torch.tensor([[True, False, True, True, True, True], [True, True, True, True, False, True]])
    g = dmd_gradient(x, f, r, mask=mask)
    perm = (0, 2, 1, 3, 4)  # [B, T, C, H, W] -> [B, C, T, H, W]
    gw = dmd_gradient(*(t.permute(perm) for t in (x, f, r)), mask=mask, frame_dim=2)
    assert torch.allclose(gw.permute(perm), g, atol=1e-15, rtol=0)
    xg = x.permute(perm).clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(dmd_loss(xg, gw, mask=mask, frame_dim=2), xg)
    assert torch.all(grad[:, :, 1][0] == 0) and torch.all(grad[1, :, 4] == 0)


def test_dmd_normaliser_is_per_sample():
    x, f, r = _dmd_inputs()
    g = dmd_gradient(x, f, r)
    d, e = x - r, f - r
    for k in (2.0, 3.0, 0.1):
        x2, f2 = x.clone(), f.clone()
        x2[0] = r[0] + k * d[0]
        f2[0] = r[0] + k * e[0]
        g2 = dmd_gradient(x2, f2, r)
        assert torch.allclose(g2[0], g[0], atol=1e-13, rtol=0), k
        assert torch.equal(g2[1], g[1])


def test_dmd_zero_point_and_degenerate_sample():
    x, _, r = _dmd_inputs()
    assert torch.equal(dmd_gradient(x, r.clone(), r), torch.zeros_like(x))
    # a sample with x == x0_real has no normaliser: its g is 0, not inf
    f = r + 1.0
    x2 = x.clone()
    x2[1] = r[1]
    g = dmd_gradient(x2, f, r)
    assert torch.isfinite(g).all() and torch.all(g[1] == 0) and torch.all(g[0] != 0)
    # an empty mask for one sample: zero g for it, loss still defined by the other sample
    mask = torch.tensor([[True] * 6, [False] * 6])
    gm = dmd_gradient(x, f, r, mask=mask)
    assert torch.all(gm[1] == 0)
    assert torch.isfinite(dmd_loss(x, gm, mask=mask))


def test_dmd_gradient_eps_is_added_to_the_normaliser():
    """eps > 0 is added to the per-sample normaliser: g = (x0_fake - x0_real) / (mean |x - x0_real| + eps)."""
    x, f, r = _dmd_inputs()
    nrm = (x - r).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    torch.testing.assert_close(dmd_gradient(x, f, r, eps=0.5), (f - r) / (nrm + 0.5), rtol=0, atol=1e-12)


def test_sid_loss_sample_with_zero_normaliser_contributes_zero():
    """A sample with x == x0_real (normaliser 0) adds 0 to the SiD loss and gets a zero gradient; the other
    sample's terms are still divided by the full element count N (float64 closed form)."""
    x, f, r = _dmd_inputs()
    x = x.clone()
    x[1] = r[1]
    nrm = (x[0] - r[0]).abs().mean()
    expected = ((r[0] - f[0]) * ((r[0] - x[0]) - (r[0] - f[0])) / nrm).sum() / x.numel()
    xg = x.clone().requires_grad_(True)
    loss = sid_loss(xg, f, r)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(loss, xg)
    assert torch.equal(grad[1], torch.zeros_like(grad[1]))
    torch.testing.assert_close(grad[0], (f[0] - r[0]) / (nrm * x.numel()), rtol=0, atol=1e-15)


def test_dmd_loss_python_float_weight_is_not_rounded_to_float32():
    """A python-float weight (1/3) enters the float64 loss unrounded: loss = mean(g^2) / 6, gradient g / (3 N)."""
    x, f, r = _dmd_inputs()
    g = dmd_gradient(x, f, r)
    xg = x.clone().requires_grad_(True)
    loss = dmd_loss(xg, g, weight=1.0 / 3.0)
    assert loss.dtype == F64
    torch.testing.assert_close(loss, g.square().mean() / 6.0, rtol=0, atol=1e-15)
    (grad,) = torch.autograd.grad(loss, xg)
    torch.testing.assert_close(grad, g / (3.0 * g.numel()), rtol=0, atol=1e-15)


def test_dmd_loss_weight_scales_gradient():
    x, f, r = _dmd_inputs()
    g = dmd_gradient(x, f, r)
    n = g.numel()
    for w in (
        torch.tensor([0.5, 2.0], dtype=F64),  # per sample
        torch.rand(2, 6, generator=_gen(9), dtype=F64),  # per frame
        torch.rand(SHAPE, generator=_gen(10), dtype=F64),  # per element
    ):
        wr = w if w.ndim == 5 else (w.reshape(2, 1, 1, 1, 1) if w.ndim == 1 else w[:, :, None, None, None])
        xg = x.clone().requires_grad_(True)
        loss = dmd_loss(xg, g, weight=w)
        (grad,) = torch.autograd.grad(loss, xg)
        assert torch.allclose(grad, wr * g / n, atol=1e-15, rtol=0)
        assert torch.allclose(loss, 0.5 * (wr * g.square()).sum() / n, atol=1e-15, rtol=0)
    # a weight of ones reproduces plain DMD bit for bit
    xa = x.clone().requires_grad_(True)
    xb = x.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad(dmd_loss(xa, g), xa)
    (gb,) = torch.autograd.grad(dmd_loss(xb, g, weight=torch.ones(2, dtype=F64)), xb)
    assert torch.equal(ga, gb)
    # the weight carries no gradient
    wt = torch.tensor([0.5, 2.0], dtype=F64, requires_grad=True)
    xg = x.clone().requires_grad_(True)
    grads = torch.autograd.grad(dmd_loss(xg, g, weight=wt), (xg, wt), allow_unused=True)
    assert grads[1] is None


def test_dmd_bad_inputs():
    x, f, r = _dmd_inputs()
    with pytest.raises(ValueError, match=r"\(2, 6, 4, 4\)"):
        dmd_gradient(x, f[..., 0], r)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 5\)"):
        dmd_gradient(x, f, r, mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="0.5"):
        dmd_gradient(x, f, r, mask=torch.full((2, 6), 0.5))
    with pytest.raises(ValueError, match="eps"):
        dmd_gradient(x, f, r, eps=-1.0)
    g = dmd_gradient(x, f, r)
    with pytest.raises(ValueError, match=r"^x of shape \(2, 6, 4, 4, 4\) and g of shape \(2, 6, 4, 4\)"):
        dmd_loss(x, g[..., 0])
    with pytest.raises(ValueError, match=r"mask of shape \(3, 6\)"):
        dmd_loss(x, g, mask=torch.ones(3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="no element"):
        dmd_loss(x, g, mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="non-negative"):
        dmd_loss(x, g, weight=torch.tensor([1.0, -1.0], dtype=F64))
    with pytest.raises(ValueError, match=r"weight of shape \(3,\)"):
        dmd_loss(x, g, weight=torch.ones(3, dtype=F64))


# ----------------------------------------------------------------------------------------------
# SiD, critic, ODE regression


def test_sid_loss_alpha_one_hand_computed_and_gradient():
    x, f, r = _dmd_inputs()
    nrm = (x - r).abs().mean(dim=(1, 2, 3, 4), keepdim=True)
    expected = ((r - f) * ((r - x) - (r - f)) / nrm).mean()
    xg = x.clone().requires_grad_(True)
    loss = sid_loss(xg, f, r, alpha=1.0)
    assert loss.dtype == F64
    assert torch.allclose(loss, expected, atol=1e-14, rtol=0)
    # only x carries a graph: dL/dx = (x0_fake - x0_real) / (nrm N) = DMD's g / N
    (grad,) = torch.autograd.grad(loss, xg)
    assert torch.allclose(grad, dmd_gradient(x, f, r) / x.numel(), atol=1e-15, rtol=0)
    # alpha changes the value, not the gradient
    alpha_half = ((r - f) * ((r - x) - 0.5 * (r - f)) / nrm).mean()
    assert torch.allclose(sid_loss(x, f, r, alpha=0.5), alpha_half, atol=1e-14, rtol=0)
    fg, rg = f.clone().requires_grad_(True), r.clone().requires_grad_(True)
    out = torch.autograd.grad(sid_loss(xg, fg, rg), (fg, rg), allow_unused=True)
    assert out == (None, None)


def test_sid_loss_masked_and_bad_inputs():
    x, f, r = _dmd_inputs()
    mask = torch.tensor([[True, True, True, False, False, False], [True] * 6])
    m = mask[:, :, None, None, None].expand(SHAPE)
    nrm = torch.stack([(x - r).abs()[b][m[b]].mean() for b in range(2)]).reshape(2, 1, 1, 1, 1)
    el = (r - f) * ((r - x) - (r - f)) / nrm
    assert torch.allclose(sid_loss(x, f, r, mask=mask), el[m].mean(), atol=1e-14, rtol=0)
    with pytest.raises(ValueError, match=r"x0_real of shape"):
        sid_loss(x, f, r[:1])
    with pytest.raises(ValueError, match="alpha"):
        sid_loss(x, f, r, alpha=float("nan"))


def test_critic_loss_is_plain_flow_matching():
    v, x0, eps = (_randn(*SHAPE, seed=s) for s in (4, 5, 6))
    expected = (v - (eps - x0)).square().mean()
    vg = v.clone().requires_grad_(True)
    x0g = x0.clone().requires_grad_(True)
    loss = critic_loss(vg, x0g, eps)
    assert loss.ndim == 0 and loss.dtype == F64
    assert torch.allclose(loss, expected, atol=1e-15, rtol=0)
    gv, gx = torch.autograd.grad(loss, (vg, x0g), allow_unused=True)
    assert torch.allclose(gv, 2 * (v - (eps - x0)) / v.numel(), atol=1e-15, rtol=0)
    assert gx is None  # the critic step never updates the generator
    mask = torch.tensor([[True] * 3 + [False] * 3, [True] * 6])
    se = (v - (eps - x0)).square()
    by_hand = 0.5 * (se[0, :3].mean() + se[1].mean())
    assert torch.allclose(critic_loss(v, x0, eps, mask=mask), by_hand, atol=1e-15, rtol=0)
    with pytest.raises(ValueError, match=r"\(1, 6, 4, 4, 4\)"):
        critic_loss(v, x0[:1], eps)


def test_critic_loss_mask_on_wan_frame_dim():
    """frame_dim = 2 puts the [B, T] mask on T of a [B, C, T, H, W] latent: the masked per-sample MSE, float64."""
    b, c, t = 2, 3, 4
    v, x0, eps = (_randn(b, c, t, 2, seed=s) for s in (40, 41, 42))
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    se = (v - (eps - x0)).square()
    by_hand = torch.stack([se[i][:, mask[i]].mean() for i in range(b)]).mean()
    out = critic_loss(v, x0, eps, mask=mask, frame_dim=2)
    assert out.dtype == F64 and out.ndim == 0
    torch.testing.assert_close(out, by_hand, rtol=0, atol=1e-12)


def test_ode_regression_loss_masked():
    pred, target = _randn(*SHAPE, seed=7), _randn(*SHAPE, seed=8)
    assert torch.allclose(ode_regression_loss(pred, target), (pred - target).square().mean(), atol=1e-15, rtol=0)
    mask = torch.tensor([[False, True, True, False, True, True], [True, False, False, False, False, False]])
    m = mask[:, :, None, None, None].expand(SHAPE)
    expected = (pred - target).square()[m].mean()
    pred_nan = pred.clone()
    pred_nan[~m] = float("nan")  # masked-out frames are ignored entirely
    pg = pred_nan.clone().requires_grad_(True)
    loss = ode_regression_loss(pg, target, mask=mask)
    assert torch.allclose(loss, expected, atol=1e-15, rtol=0)
    (grad,) = torch.autograd.grad(loss, pg)
    assert torch.all(grad[~m] == 0)
    assert torch.allclose(grad[m], 2 * (pred - target)[m] / int(m.sum()), atol=1e-15, rtol=0)
    with pytest.raises(ValueError, match="no element"):
        ode_regression_loss(pred, target, mask=torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 6\)"):
        ode_regression_loss(pred, target, mask=mask, frame_dim=2)
    with pytest.raises(ValueError, match=r"x0_target of shape"):
        ode_regression_loss(pred, target[:, :3])


# ----------------------------------------------------------------------------------------------
# CFG convention


def test_dmd_cfg_reference_form():
    cond, uncond = _randn(*SHAPE, seed=11), _randn(*SHAPE, seed=12)
    for s in (0.0, 2.0, 3.0, 3.5):
        out = dmd_cfg(cond, uncond, s)
        assert out.dtype == F64
        assert torch.allclose(out, cond + s * (cond - uncond), atol=1e-12, rtol=0), s
    assert torch.equal(dmd_cfg(cond, uncond, 0.0), cond)
    per_sample = torch.tensor([0.0, 3.0], dtype=F64)
    out = dmd_cfg(cond, uncond, per_sample)
    assert torch.equal(out[0], cond[0])
    assert torch.allclose(out[1], cond[1] + 3.0 * (cond[1] - uncond[1]), atol=1e-12, rtol=0)


def test_reference_scale_conversions():
    assert reference_scale_to_w(3.0) == 4.0 and reference_scale_to_w(3.5) == 4.5
    assert w_to_reference_scale(4.0) == 3.0
    assert w_to_reference_scale(reference_scale_to_w(1.25)) == 1.25
    with pytest.raises(ValueError, match="inf"):
        reference_scale_to_w(float("inf"))
    with pytest.raises(ValueError, match="nan"):
        w_to_reference_scale(float("nan"))


def test_masked_out_nan_latents_get_zero_gradient():
    x, f, r = _dmd_inputs()
    mask = torch.tensor([[True, True, False, True, True, True], [True, False, True, True, True, True]])
    g = dmd_gradient(x, f, r, mask=mask)
    x_nan = x.clone()
    x_nan[~mask] = float("nan")
    for loss_fn in (lambda xx: dmd_loss(xx, g, mask=mask), lambda xx: sid_loss(xx, f, r, mask=mask)):
        xg = x_nan.clone().requires_grad_(True)
        loss = loss_fn(xg)
        (grad,) = torch.autograd.grad(loss, xg)
        assert torch.isfinite(loss) and torch.all(grad[~mask] == 0) and torch.isfinite(grad).all()


# ----------------------------------------------------------------------------------------------
# dtypes (mixed inputs), messages that name the inputs, non-number scalars


def _sid_reference(x: torch.Tensor, f: torch.Tensor, r: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    x, f, r = x.to(F64), f.to(F64), r.to(F64)
    nrm = (x - r).abs().mean(dim=tuple(range(1, x.ndim)), keepdim=True)
    return ((r - f) * ((r - x) - alpha * (r - f)) / nrm).mean()


@pytest.mark.parametrize("wide", [0, 1, 2])
def test_sid_loss_mixed_dtypes_keep_float64(wide: int):
    """sid_loss runs in float64 and returns float64 when any one of x, x0_fake, x0_real is float64."""
    ins = [_randn(*SHAPE, seed=20 + i, dtype=torch.float32) for i in range(3)]
    ins[wide] = _randn(*SHAPE, seed=30) / 3.0  # float64 values that float32 cannot represent
    loss = sid_loss(*ins, alpha=0.7)
    assert loss.dtype == F64
    assert torch.allclose(loss, _sid_reference(*ins, alpha=0.7), atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sid_loss_low_precision_inputs_computed_in_float64_returned_float32(dtype: torch.dtype):
    """sid_loss of float32 / bf16 inputs is the float64 value rounded once to float32."""
    x, f, r = (_randn(*SHAPE, seed=40 + i, dtype=dtype) for i in range(3))
    loss = sid_loss(x, f, r, alpha=0.7)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, _sid_reference(x, f, r, alpha=0.7).to(torch.float32))


@pytest.mark.parametrize("pred_wide", [True, False])
def test_ode_regression_loss_mixed_dtypes_keep_float64(pred_wide: bool):
    """ode_regression_loss is float64 (exactly) when either x0_pred or x0_target is float64."""
    wide = _randn(*SHAPE, seed=50) / 3.0
    narrow = _randn(*SHAPE, seed=51, dtype=torch.float32)
    pred, target = (wide, narrow) if pred_wide else (narrow, wide)
    mask = torch.tensor([[True, False, True, True, False, True], [False, True, True, True, True, True]])
    m = mask[:, :, None, None, None].expand(SHAPE)
    for mk, sel in ((None, torch.ones(SHAPE, dtype=torch.bool)), (mask, m)):
        loss = ode_regression_loss(pred, target, mask=mk)
        assert loss.dtype == F64
        expected = (pred.to(F64) - target.to(F64)).square()[sel].mean()
        assert torch.allclose(loss, expected, atol=1e-12, rtol=0)


def test_ode_regression_loss_bf16_inputs_return_float32():
    """ode_regression_loss of bf16 inputs runs in float32 and returns float32 (the documented step dtype)."""
    pred, target = (_randn(*SHAPE, seed=s, dtype=torch.bfloat16) for s in (52, 53))
    mask = torch.tensor([[True, False, True, True, False, True], [False, True, True, True, True, True]])
    for mk in (None, mask):
        loss = ode_regression_loss(pred, target, mask=mk)
        assert loss.dtype == torch.float32
        m = torch.ones(SHAPE, dtype=torch.bool) if mk is None else mk[:, :, None, None, None].expand(SHAPE)
        expected = (pred.to(F64) - target.to(F64)).square()[m].mean()
        assert torch.allclose(loss.to(F64), expected, atol=1e-6, rtol=0)


def test_shape_errors_name_the_reference_input():
    """Shape mismatches name the reference input and the mismatched one, with both shapes."""
    x, f, r = _dmd_inputs()
    with pytest.raises(ValueError, match=r"^x0_pred of shape \(2, 6, 4, 4, 4\) and x0_target of shape \(2, 3,"):
        ode_regression_loss(x, r[:, :3])
    with pytest.raises(ValueError, match=r"^x of shape \(2, 6, 4, 4, 4\) and x0_real of shape \(1, 6,"):
        sid_loss(x, f, r[:1])
    # a broadcastable x0_fake is refused too (it is not silently broadcast)
    with pytest.raises(ValueError, match=r"^x of shape \(2, 6, 4, 4, 4\) and x0_fake of shape \(1, 6, 4, 4, 4\)"):
        sid_loss(x, f[:1], r)
    g = dmd_gradient(x, f, r)
    with pytest.raises(ValueError, match=r"^x of shape \(2, 6, 4, 4, 4\) and g of shape \(2, 6, 4, 4\)"):
        dmd_loss(x, g[..., 0])


@pytest.mark.parametrize("bad", [True, False, "3.0", None])
def test_scale_conversions_and_sid_alpha_refuse_non_numbers(bad):
    """A bool or a non-number scale / alpha is a ValueError naming the value, never taken as 0 / 1."""
    x, f, r = _dmd_inputs()
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        reference_scale_to_w(bad)
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        w_to_reference_scale(bad)
    with pytest.raises(ValueError, match=f"got {bad!r}"):
        sid_loss(x, f, r, alpha=bad)


def test_dmd_cfg_per_frame_scale_on_frame_dim():
    """A [B, T] reference scale lands on frame_dim: dim 1 by default, dim 2 for Wan's [B, C, T, H, W]."""
    cond, uncond = _randn(*SHAPE, seed=13), _randn(*SHAPE, seed=14)  # [B, T=6, C=4, H, W]
    s = torch.linspace(0.0, 2.5, 12, dtype=F64).reshape(2, 6)
    out = dmd_cfg(cond, uncond, s)
    sb = s[:, :, None, None, None]
    assert torch.allclose(out, cond + sb * (cond - uncond), atol=1e-12, rtol=0)
    cw, uw = cond.transpose(1, 2), uncond.transpose(1, 2)  # [B, C=4, T=6, H, W]
    out_w = dmd_cfg(cw, uw, s, frame_dim=2)
    assert torch.allclose(out_w, (cond + sb * (cond - uncond)).transpose(1, 2), atol=1e-12, rtol=0)


@pytest.mark.parametrize("wide", [0, 1, 2, None])
def test_dmd_loss_dtype_follows_x_g_and_weight(wide):
    """dmd_loss is 0.5 mean(w g^2) computed in float64, returned float64 iff x, g or weight is float64."""
    x, g = _randn(*SHAPE, seed=60, dtype=torch.float32), _randn(*SHAPE, seed=61, dtype=torch.float32)
    w = torch.tensor([0.25, 1.0 / 3.0], dtype=torch.float32)
    ins = [x, g, w]
    if wide is not None:
        ins[wide] = ins[wide].to(F64) / 3.0
    loss = dmd_loss(ins[0], ins[1], weight=ins[2])
    ref = 0.5 * (ins[2].to(F64)[:, None, None, None, None] * ins[1].to(F64).square()).mean()
    assert loss.dtype == (torch.float32 if wide is None else F64)
    if wide is None:
        assert torch.equal(loss, ref.to(torch.float32))
    else:
        assert torch.allclose(loss, ref, atol=1e-12, rtol=0)


def test_num_train_timesteps_of_one_is_accepted_and_bad_values_are_named():
    """num_train_timesteps = 1 is a valid grid (shift 1 keeps the list); 0, -3, 2.5 and True raise ValueError
    naming num_train_timesteps."""
    assert warped_timesteps([1], 1.0, num_train_timesteps=1) == [1.0]
    assert warped_timesteps([1, 0], 3.0, num_train_timesteps=1) == [1.0, 0.0]
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"^num_train_timesteps must be an int >= 1, got {bad!r}"):
            warped_timesteps([1], 1.0, num_train_timesteps=bad)


def test_dmd_losses_accept_one_dimensional_batches():
    """[B] tensors (a batch dim and nothing else) are valid inputs: dmd_loss = 0.5 mean(g^2) and dmd_gradient's
    per-sample normaliser is |x - x0_real| of the single element (float64 closed forms)."""
    x = torch.tensor([1.0, 2.0], dtype=F64)
    g = torch.tensor([0.5, -3.0], dtype=F64)
    torch.testing.assert_close(dmd_loss(x, g), torch.tensor(0.5 * (0.25 + 9.0) / 2, dtype=F64), rtol=0, atol=1e-15)
    r = torch.tensor([3.0, 0.0], dtype=F64)  # |x - r| = 2 for both samples
    torch.testing.assert_close(dmd_gradient(x, g, r), (g - r) / 2.0, rtol=0, atol=1e-15)


# ----------------------------------------------------------------------------------------------
# mask validation, warped-list inputs, the sampler's pinned draw (mutation-testing survivors)


def test_mask_frame_dim_range_negative_dims_and_expected_shape_in_the_message():
    """A per-frame mask accepts frame_dim in [1, ndim) or its negative form (-4 on 5-d latents is dim 1, -3 is dim 2);
    frame_dim 0, -5 or ndim is a ValueError naming frame_dim and the valid range, and a mask of the wrong shape for
    a valid frame_dim is one naming the expected [B, T] shape."""
    x, g = _randn(*SHAPE, seed=70), _randn(*SHAPE, seed=71)  # [B=2, T=6, C=4, H=4, W=4]
    m = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    for fd in (1, -4):
        torch.testing.assert_close(dmd_loss(x, g, mask=m, frame_dim=fd), dmd_loss(x, g, mask=m), rtol=0, atol=0)
    m4 = torch.tensor([[1, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)  # T = 4 on dim 2 (Wan layout)
    ref = 0.5 * (g.square() * m4[:, None, :, None, None]).sum() / (m4.sum() * 6 * 4 * 4)
    for fd in (2, -3):
        torch.testing.assert_close(dmd_loss(x, g, mask=m4, frame_dim=fd), ref, rtol=0, atol=1e-12)
    square = torch.ones(2, 2, dtype=torch.bool)  # [B, B]: would fit if the batch dim were taken as the frame dim
    for fd in (0, -5, 5):
        with pytest.raises(
            ValueError,
            match=rf"^mask of shape \(2, 2\) does not fit latents of shape \(2, 6, 4, 4, 4\) with frame_dim={fd}: "
            r"expected \[B, T\] with 1 <= frame_dim < x\.ndim$",
        ):
            dmd_loss(x, g, mask=square, frame_dim=fd)
    for fd, expected in ((1, r"\[2, 6\]"), (-4, r"\[2, 6\]"), (2, r"\[2, 4\]")):
        with pytest.raises(ValueError, match=rf"with frame_dim={fd}: expected {expected}$"):
            dmd_loss(x, g, mask=square, frame_dim=fd)


def test_mask_is_moved_to_the_latents_device():
    """A CPU per-frame mask is moved to the latents' device: dmd_gradient on meta latents with a CPU mask returns a
    meta tensor of x's shape (a mask left on the CPU cannot be combined with meta latents)."""
    x, f, r = (torch.empty(SHAPE, dtype=F64, device="meta") for _ in range(3))
    m = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1]], dtype=torch.bool)
    g = dmd_gradient(x, f, r, mask=m)
    assert g.device.type == "meta" and g.shape == SHAPE and g.dtype == F64


def test_sample_dmd_sigma_is_the_pinned_float64_draw_on_the_generators_device():
    """sample_dmd_sigma = float32(clamp(N shift(tau / N), min, max) / N), computed in float64 from tau =
    randint(0, N) drawn from the generator (bitwise); the draw stays on the generator's device under a default-device
    context, and the result moves to ``device`` when one is given (else stays on the generator's device)."""
    n = 1000
    for shift, lo, hi in ((5.0, 20, 980), (3.0, 0, 1000), (1.0, 0, 1000)):
        u = torch.randint(0, n, (4096,), generator=_gen(9)).to(F64) / n
        if shift != 1.0:
            su = shift * u
            u = su / (su + (1 - u))
        ref = ((u * n).clamp(float(lo), float(hi)) / n).to(torch.float32)
        got = sample_dmd_sigma(4096, _gen(9), shift=shift, min_timestep=lo, max_timestep=hi)
        assert got.device.type == "cpu" and torch.equal(got, ref), shift
    ref = sample_dmd_sigma(64, _gen(5))
    with torch.device("meta"):
        assert torch.equal(sample_dmd_sigma(64, _gen(5)), ref)  # drawn and returned on the CPU generator's device
    moved = sample_dmd_sigma(64, _gen(5), device="meta")
    assert moved.device.type == "meta" and moved.shape == (64,) and moved.dtype == torch.float32
    same = sample_dmd_sigma(8, _gen(5), min_timestep=500, max_timestep=500)  # min == max is a valid (point) range
    assert torch.equal(same, torch.full((8,), 0.5))


def test_sample_dmd_sigma_bad_batch_and_range_values_are_named():
    """A batch that is not an int >= 1 (a bool, 2.5, "4", 0) and a range bound that is not a number in [0, N] (a
    bool, a string, NaN, -5, 1200) are ValueErrors naming the argument and the value."""
    for bad in (True, 2.5, "4", 0):
        with pytest.raises(ValueError, match=rf"^batch must be an int >= 1, got {re.escape(repr(bad))}$"):
            sample_dmd_sigma(bad, _gen())
    for name in ("min_timestep", "max_timestep"):
        for bad in (True, "20", float("nan"), -5, 1200):
            with pytest.raises(
                ValueError,
                match=rf"^{name} must be a number in \[0, num_train_timesteps=1000\], got {re.escape(repr(bad))}$",
            ):
                sample_dmd_sigma(4, _gen(), **{name: bad})


def test_warped_timesteps_refuses_non_integer_entries_and_validates_the_shift_of_an_empty_list():
    """A warped entry must be an integer-valued real number: a bool, a string, None, inf, NaN or 2.5 is a ValueError
    naming it; an empty list gives [] but its shift is still validated; warped_sigmas divides by the given N."""
    for bad in (True, False, "500", None, float("inf"), float("nan"), 2.5):
        with pytest.raises(
            ValueError, match=rf"^warped denoising steps must be integer-valued numbers, got {re.escape(repr(bad))}$"
        ):
            warped_timesteps([1000, bad], 5.0)
    assert warped_timesteps([], 5.0) == [] and warped_sigmas([], 5.0) == []
    with pytest.raises(ValueError, match=r"^shift must be a finite number > 0, got -1\.0$"):
        warped_timesteps([], -1.0)
    # N = 4, shift 3: sigma = 3 (t / 4) / (1 + 2 t / 4), exact in binary floating point
    assert warped_sigmas([4, 2, 0], 3.0, num_train_timesteps=4) == [1.0, 0.75, 0.0]
