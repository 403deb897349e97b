"""Tests of TMD's math (genrl.flow.tmd) and its transition sampler (genrl.rollout.transition).

Closed forms in float64; the sampler against hand-written loops, a Gaussian teacher with an analytic velocity, and
address-by-address noise checks. T-numbers refer to the TMD task's test plan (Nie et al. 2026, arXiv 2601.09881).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from genrl.flow import (
    INNER_TIME_STREAM,
    adaptive_loss,
    average_velocity,
    effective_nfe,
    finite_difference_derivative,
    inner_flow_step,
    meanflow_target,
    outer_step,
    sample_inner_times,
    sample_outer_point,
    shift_sigmas,
    tm_meanflow_loss,
    transition_grid,
    vsd_gradient,
    vsd_loss,
)
from genrl.models.text_encoder import Conditioning
from genrl.noise import rand_per_sample, randn_per_sample
from genrl.rollout import TransitionConfig, TransitionModelLike, inner_flow, transition_rollout
from genrl.rollout.transition import INNER_STREAM, OUTER_STREAM

F64 = torch.float64
PARAMS = ("noise", "denoiser")


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------------------- T3: cost


def test_effective_nfe_values():
    assert effective_nfe(2, 2, 5, 30) == pytest.approx(7 / 3, abs=1e-15)
    assert effective_nfe(1, 4, 5, 40) == pytest.approx(1.375, abs=1e-15)
    assert effective_nfe(2, 4, 5, 30) == pytest.approx(3.0, abs=1e-15)
    assert effective_nfe(3, 1, 5, 30) == 3.0  # N = 1: one full pass per outer step
    assert effective_nfe(1, 2, 30, 30) == 2.0  # a head of every layer is the whole network


@pytest.mark.parametrize("args", [(0, 2, 5, 30), (2, 0, 5, 30), (2, 2, 0, 30), (2, 2, 31, 30), (2, 2.0, 5, 30)])
def test_effective_nfe_rejects_bad_counts(args):
    with pytest.raises(ValueError):
        effective_nfe(*args)


# ------------------------------------------------------------------------------------------------- grids


def test_transition_grid_golden_shift_10_and_1():
    g = transition_grid(2, 10.0)
    assert g.dtype == F64 and g.tolist() == pytest.approx([0.999, 10 / 11, 0.0], abs=1e-15)
    g = transition_grid(4, 10.0)
    assert g.tolist() == pytest.approx([0.999, 30 / 31, 10 / 11, 10 / 13, 0.0], abs=1e-15)
    g = transition_grid(4, 1.0, t_max=0.9)
    assert g.tolist() == pytest.approx([0.9, 0.75, 0.5, 0.25, 0.0], abs=1e-15)
    assert transition_grid(1, 3.0, t_max=1.0).tolist() == [1.0, 0.0]
    assert transition_grid(3, 2.0)[-1].item() == 0.0
    assert transition_grid(2, 1.0, dtype=torch.float32, device="meta").device.type == "meta"


def test_transition_grid_first_point_is_t_max_not_its_shift():
    g = transition_grid(3, 5.0, t_max=0.999)
    assert g[0].item() == 0.999
    assert g[1:].tolist() == pytest.approx(shift_sigmas(torch.tensor([2 / 3, 1 / 3, 0.0], dtype=F64), 5.0).tolist(),
                                           abs=1e-15)


@pytest.mark.parametrize("kwargs", [dict(steps=0, shift=1.0), dict(steps=2, shift=1.0, t_max=0.0),
                                    dict(steps=2, shift=1.0, t_max=1.5), dict(steps=2, shift=0.0),
                                    dict(steps=2, shift=1.0, t_max=0.5), dict(steps=1000, shift=10.0)])
def test_transition_grid_rejects(kwargs):
    with pytest.raises(ValueError):
        transition_grid(**kwargs)


# ------------------------------------------------------------------------------------------------- inner times


def _largest_below(grid: list[float], s: float) -> float:
    return max(g for g in grid if g <= s)


def test_sample_inner_times_closed_form_and_snapping():
    grid = transition_grid(4, 3.0)
    idx = list(range(100, 400))
    s, r = sample_inner_times(7, idx, 5, grid, shift=3.0, lo=1e-3, hi=0.999, p_equal=0.75, dtype=F64)
    a = rand_per_sample((), 7, idx, 5, INNER_TIME_STREAM, dtype=F64)
    coin = rand_per_sample((), 7, idx, 5, INNER_TIME_STREAM + 1, dtype=F64)
    assert torch.equal(s, shift_sigmas(1e-3 + (0.999 - 1e-3) * a, 3.0))
    gl = grid.tolist()
    for i in range(len(idx)):
        expected = s[i].item() if coin[i] < 0.75 else _largest_below(gl, s[i].item())
        assert r[i].item() == expected
    assert bool((r <= s).all())
    assert float(s.min()) >= shift_sigmas(1e-3, 3.0) and float(s.max()) <= shift_sigmas(0.999, 3.0)


def test_sample_inner_times_fraction_equal_and_range_of_r():
    grid = transition_grid(2, 10.0)
    n = 4000
    s, r = sample_inner_times(0, range(n), 0, grid, p_equal=0.75)
    equal = (r == s).double().mean().item()
    assert abs(equal - 0.75) < 4 * math.sqrt(0.75 * 0.25 / n)
    on_grid = (r.unsqueeze(1) == grid.float().unsqueeze(0)).any(1)
    assert bool((on_grid | (r == s)).all())
    assert bool(on_grid[r != s].all()) and bool((r[r != s] < s[r != s]).all())
    # every grid interval is used (s spreads over (0, 1); s above s_N = 0.999 snaps to s_N itself)
    assert set(r[r != s].tolist()) == set(grid.float().tolist())
    s0, r0 = sample_inner_times(0, range(n), 0, grid, p_equal=0.0)
    assert not bool((r0 == s0).any())
    s1, r1 = sample_inner_times(0, range(n), 0, grid, p_equal=1.0)
    assert torch.equal(r1, s1)


def test_sample_inner_times_are_addressed():
    grid = transition_grid(2, 10.0)
    s, r = sample_inner_times(3, [5, 9, 11, 2], 4, grid)
    s2, r2 = sample_inner_times(3, [11, 77, 5], 4, grid)
    assert s[2] == s2[0] and r[2] == r2[0] and s[0] == s2[2] and r[0] == r2[2]
    s3, _ = sample_inner_times(3, [5, 9, 11, 2], 5, grid)  # another step
    s4, _ = sample_inner_times(4, [5, 9, 11, 2], 4, grid)  # another seed
    s5, _ = sample_inner_times(3, [5, 9, 11, 2], 4, grid, stream=INNER_TIME_STREAM + 7)  # another stream
    assert not bool((s3 == s).any()) and not bool((s4 == s).any()) and not bool((s5 == s).any())
    sp, rp = sample_inner_times(3, [5, 9, 11, 2], 4, grid, backend="philox")
    assert bool((rp <= sp).all())


@pytest.mark.parametrize("kwargs", [dict(lo=0.5, hi=0.5), dict(lo=-0.1), dict(hi=1.5), dict(p_equal=1.5),
                                    dict(inner_grid=torch.tensor([1.0, 0.5])), dict(inner_grid=torch.zeros(2, 2))])
def test_sample_inner_times_rejects(kwargs):
    kwargs.setdefault("inner_grid", transition_grid(2, 1.0))
    with pytest.raises(ValueError):
        sample_inner_times(0, [0, 1], 0, **kwargs)


# ------------------------------------------------------------------------------------------------- T8: outer update


def test_outer_step_equals_the_papers_form_and_moves_along_the_path():
    b = 5
    x0, x1 = _randn(b, 3, 4, seed=1), _randn(b, 3, 4, seed=2)
    t = torch.tensor([0.999, 0.9, 2 / 3, 0.5, 1 / 3], dtype=F64)
    t_next = torch.tensor([0.9, 0.5, 1 / 7, 0.0, 0.25], dtype=F64)
    x_t = (1 - t).view(b, 1, 1) * x0 + t.view(b, 1, 1) * x1
    y = _randn(b, 3, 4, seed=3)
    got = outer_step(x_t, t, t_next, y)
    g = x_t - t.view(b, 1, 1) * y
    ratio = (t_next / t).view(b, 1, 1)
    torch.testing.assert_close(got, (1 - ratio) * g + ratio * x_t, rtol=0, atol=1e-13)
    exact = outer_step(x_t, t, t_next, x1 - x0)  # the true y maps x_t to x_{t'}
    torch.testing.assert_close(exact, (1 - t_next).view(b, 1, 1) * x0 + t_next.view(b, 1, 1) * x1, rtol=0, atol=1e-13)
    assert outer_step(x_t, 0.5, 0.25, y).dtype == F64
    assert outer_step(x_t.float(), 0.5, 0.25, y.float()).dtype == torch.float32


# ------------------------------------------------------------------------------------------------- inner update


def test_inner_flow_step_closed_forms():
    b = 4
    y_s, y1, y_hat = _randn(b, 2, 3, seed=1), _randn(b, 2, 3, seed=2), _randn(b, 2, 3, seed=3)
    s = torch.tensor([0.999, 0.7, 1 / 3, 0.2], dtype=F64)
    r = torch.tensor([0.5, 0.0, 1 / 7, 0.2], dtype=F64)
    sv, rv = s.view(b, 1, 1), r.view(b, 1, 1)
    torch.testing.assert_close(inner_flow_step(y_s, s, r, y1, y_hat, "noise"), y_s - (sv - rv) * (y1 - y_hat),
                               rtol=0, atol=1e-14)
    den = inner_flow_step(y_s, s, r, y1, y_hat, "denoiser")
    torch.testing.assert_close(den, y_s - (sv - rv) * (y_s - y_hat) / sv, rtol=0, atol=1e-14)
    assert torch.equal(den[1], y_hat[1])  # r = 0: the denoiser jump lands on y_hat exactly
    assert torch.equal(den[3], y_s[3])  # r = s: no move
    torch.testing.assert_close(average_velocity(y_s, s, y1, y_hat, "noise"), y1 - y_hat, rtol=0, atol=0)
    torch.testing.assert_close(average_velocity(y_s, s, y1, y_hat, "denoiser"), (y_s - y_hat) / sv, rtol=0, atol=0)
    # s = r = 0 under "denoiser": the identity, not NaN
    zero = torch.zeros(b, dtype=F64)
    assert torch.equal(inner_flow_step(y_s, zero, zero, y1, y_hat, "denoiser"), y_s)
    # f32 inputs stay f32, a float64 time promotes
    assert inner_flow_step(y_s.float(), 0.5, 0.25, y1.float(), y_hat.float()).dtype == torch.float32
    with pytest.raises(ValueError):
        inner_flow_step(y_s, s, r, y1, y_hat, "velocity")
    with pytest.raises(ValueError):
        inner_flow_step(y_s, s, r, y1[:, :1], y_hat, "denoiser")
    with pytest.raises(ValueError):
        average_velocity(y_s, s, y1, y_hat[:2], "noise")


@pytest.mark.parametrize("param", PARAMS)
def test_both_parameterisations_follow_the_straight_path_with_the_true_y(param):
    b = 3
    y, y1 = _randn(b, 5, seed=4), _randn(b, 5, seed=5)
    s = torch.tensor([0.999, 0.6, 0.3], dtype=F64)
    r = torch.tensor([0.2, 0.0, 0.1], dtype=F64)
    y_s = (1 - s).view(b, 1) * y + s.view(b, 1) * y1
    torch.testing.assert_close(average_velocity(y_s, s, y1, y, param), y1 - y, rtol=0, atol=1e-13)
    y_r = (1 - r).view(b, 1) * y + r.view(b, 1) * y1
    torch.testing.assert_close(inner_flow_step(y_s, s, r, y1, y, param), y_r, rtol=0, atol=1e-13)


# ------------------------------------------------------------------------------------------------- T4: derivative


class _SmoothHead(nn.Module):
    """A float64 tanh MLP of (y, s): a smooth stand-in for u(y_s, s) with r, features and y1 fixed."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(dim + 1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                 nn.Linear(32, dim)).double()
        self.calls = 0

    def forward(self, y: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.net(torch.cat([y, s.unsqueeze(1)], dim=1)) * (1 + s.unsqueeze(1) ** 2)


def _jvp(fn, y, s, v):
    return torch.func.jvp(fn, (y, s), (v, torch.ones_like(s)))[1]


def test_finite_difference_matches_jvp_in_the_interior():
    fn = _SmoothHead()
    b = 16
    y, v = _randn(b, 3, seed=1), _randn(b, 3, seed=2)
    s = torch.linspace(0.05, 0.95, b, dtype=F64)
    with torch.no_grad():
        fd = finite_difference_derivative(fn, y, s, v, delta=5e-3)
    exact = _jvp(fn, y, s, v).detach()
    rel = ((fd - exact).norm(dim=1) / exact.norm(dim=1)).max().item()
    assert rel < 1e-4
    # the central formula exactly (same points, same order)
    d = 5e-3
    central = (fn(y + d * v, s + d) - fn(y - d * v, s - d)) / (2 * d)
    torch.testing.assert_close(fd, central.detach(), rtol=0, atol=1e-13)


def test_finite_difference_one_sided_at_both_ends_in_one_mixed_batch_of_two_calls():
    fn = _SmoothHead()
    d = 5e-3
    y, v = _randn(5, 3, seed=3), _randn(5, 3, seed=4)
    s = torch.tensor([0.0, 0.002, 0.5, 0.998, 1.0], dtype=F64)  # forward, forward, central, backward, backward
    fn.calls = 0
    with torch.no_grad():
        fd = finite_difference_derivative(fn, y, s, v, delta=d, lo=0.0, hi=1.0)
        assert fn.calls == 2
        fwd = (fn(y + d * v, s + d) - fn(y, s)) / d
        bwd = (fn(y, s) - fn(y - d * v, s - d)) / d
        ctr = (fn(y + d * v, s + d) - fn(y - d * v, s - d)) / (2 * d)
    torch.testing.assert_close(fd[:2], fwd[:2], rtol=0, atol=1e-12)
    torch.testing.assert_close(fd[2], ctr[2], rtol=0, atol=1e-12)
    torch.testing.assert_close(fd[3:], bwd[3:], rtol=0, atol=1e-12)
    exact = _jvp(fn, y, s, v).detach()
    rel = (fd - exact).norm(dim=1) / exact.norm(dim=1)
    assert rel[2] < 1e-4 and bool((rel < 2e-2).all())  # one-sided: first order in delta
    # the one-sided points stay inside [lo, hi]: a function that fails outside it still works
    def strict(yy, ss):
        assert bool((ss >= 0).all() and (ss <= 1).all())
        return fn(yy, ss)
    with torch.no_grad():
        finite_difference_derivative(strict, y, s, v, delta=d)


def test_finite_difference_of_a_linear_function_is_exact_with_custom_range():
    a = torch.tensor([0.5, -2.0, 3.0], dtype=F64)
    fn = lambda yy, ss: yy * a + ss.unsqueeze(1) ** 1  # noqa: E731   d/dh = v * a + 1
    y, v = _randn(3, 3, seed=5), _randn(3, 3, seed=6)
    s = torch.tensor([0.2, 0.25, 0.3], dtype=F64)
    fd = finite_difference_derivative(fn, y, s, v, delta=0.01, lo=0.2, hi=0.3)
    torch.testing.assert_close(fd, v * a + 1, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs", [dict(delta=0.0), dict(delta=0.6), dict(lo=0.4), dict(hi=0.4),
                                    dict(s=torch.tensor([0.5])), dict(v=torch.zeros(2, 4, dtype=F64))])
def test_finite_difference_rejects(kwargs):
    y = _randn(2, 3, seed=0)
    args = dict(y=y, s=torch.tensor([0.35, 0.5], dtype=F64), v=torch.zeros_like(y))
    args.update(kwargs)
    with pytest.raises(ValueError):
        finite_difference_derivative(lambda a, b: a, **args)


# ------------------------------------------------------------------------------------------------- T5: target, loss


def test_meanflow_target_closed_form_and_r_equal_s():
    v, dudt = _randn(3, 4, seed=1), _randn(3, 4, seed=2)
    s = torch.tensor([0.9, 0.5, 1 / 3], dtype=F64)
    r = torch.tensor([0.1, 0.5, 0.0], dtype=F64)
    dudt.requires_grad_(True)
    target = meanflow_target(v, dudt, s, r)
    assert not target.requires_grad
    torch.testing.assert_close(target, v - (s - r).view(3, 1) * dudt.detach(), rtol=0, atol=1e-15)
    assert torch.equal(target[1], v[1])  # r = s: plain flow matching
    assert torch.equal(meanflow_target(v, dudt, s, s), v)
    with pytest.raises(ValueError):
        meanflow_target(v, dudt[:, :2], s, r)


@pytest.mark.parametrize("param", PARAMS)
def test_point_mass_exact_average_velocity_gives_zero_loss(param):
    """Data y a single point: the head returning y is exact, du/ds = 0 along the path, the loss is 0."""
    b = 6
    y = _randn(1, 4, seed=7).expand(b, 4)
    y1 = _randn(b, 4, seed=8)
    s = torch.tensor([0.999, 0.8, 0.5, 0.3, 0.1, 0.004], dtype=F64)
    r = torch.tensor([0.5, 0.8, 0.0, 0.2, 0.0, 0.0], dtype=F64)
    y_s = (1 - s).view(b, 1) * y + s.view(b, 1) * y1
    v = y1 - y
    u_of = lambda yy, ss: average_velocity(yy, ss, y1, y, param)  # noqa: E731   head(y_s, s, r) = y
    u = u_of(y_s, s)
    torch.testing.assert_close(u, y1 - y, rtol=0, atol=1e-12)
    dudt = finite_difference_derivative(u_of, y_s, s, v)
    assert dudt.abs().max().item() < 1e-9
    loss = adaptive_loss(u, meanflow_target(v, dudt, s, r))
    assert loss.item() < 1e-18


def test_adaptive_loss_value_and_gradient():
    b = 4
    u = _randn(b, 3, 2, seed=1).requires_grad_(True)
    target = _randn(b, 3, 2, seed=2).requires_grad_(True)
    c = 6.0
    loss = adaptive_loss(u, target, c=c)
    e = (u - target).detach().square().reshape(b, -1).sum(1)
    torch.testing.assert_close(loss, (e / (e + c)).mean(), rtol=0, atol=1e-15)
    loss.backward()
    expected = 2 * (u - target).detach() / ((e + c).view(b, 1, 1) * b)
    torch.testing.assert_close(u.grad, expected, rtol=0, atol=1e-15)
    assert target.grad is None  # the target is detached
    # default c = d = 6 elements per sample; power 0 = the plain per-sample sum of squares
    assert adaptive_loss(u, target).item() == pytest.approx(loss.item(), abs=1e-15)
    assert adaptive_loss(u, target, power=0.0).item() == pytest.approx(e.mean().item(), abs=1e-13)
    p2 = adaptive_loss(u, target, c=1.0, power=2.0).item()
    assert p2 == pytest.approx((e / (e + 1) ** 2).mean().item(), abs=1e-15)
    assert adaptive_loss(u.float(), target.float(), c=c).dtype == torch.float32
    for kwargs in (dict(c=0.0), dict(power=-1.0)):
        with pytest.raises(ValueError):
            adaptive_loss(u, target, **kwargs)
    with pytest.raises(ValueError):
        adaptive_loss(u, target[:, :2])


# ------------------------------------------------------------------------------------------------- T6: DMD2-v


def test_vsd_gradient_closed_form_zero_and_scale_free():
    fake, teacher = _randn(3, 2, 5, seed=1), _randn(3, 2, 5, seed=2)
    teacher[1] = fake[1]
    g = vsd_gradient(fake, teacher)
    diff = fake - teacher
    norm = diff.abs().reshape(3, -1).mean(1).view(3, 1, 1)
    torch.testing.assert_close(g[[0, 2]], (diff / norm)[[0, 2]], rtol=0, atol=1e-14)
    assert torch.equal(g[1], torch.zeros_like(g[1]))  # all-zero difference: zero, not NaN
    assert torch.equal(vsd_gradient(fake, fake), torch.zeros_like(fake))
    for c in (1e-3, 7.0, 1e4):
        torch.testing.assert_close(vsd_gradient(teacher + c * diff, teacher), g, rtol=1e-12, atol=1e-12)
    assert vsd_gradient(fake.float(), teacher.float()).dtype == torch.float32


def test_vsd_loss_gradient_is_grad_over_elements():
    b = 3
    x_hat = _randn(b, 2, 5, seed=3).requires_grad_(True)
    g = vsd_gradient(_randn(b, 2, 5, seed=4), _randn(b, 2, 5, seed=5))
    vsd_loss(x_hat, g).backward()
    torch.testing.assert_close(x_hat.grad, g / (b * 10), rtol=0, atol=1e-15)
    # the same gradient as the linear surrogate mean_b sum(g x_hat) / d
    x2 = x_hat.detach().clone().requires_grad_(True)
    ((g * x2).reshape(b, -1).sum(1) / 10).mean().backward()
    torch.testing.assert_close(x_hat.grad, x2.grad, rtol=0, atol=1e-15)


def test_vsd_descent_moves_a_one_d_gaussian_generator_towards_the_teacher():
    """Generator x = mu + z; fake score N(mu, 1), teacher N(mu_T, 1): x0 predictions of a Gaussian at noise
    level sigma; gradient descent on vsd_loss moves mu towards mu_T, and stops there."""
    def x0_pred(x_sig, sigma, mean):  # E[x0 | x_sigma] for x0 ~ N(mean, 1)
        var = (1 - sigma) ** 2 + sigma**2
        return mean + (1 - sigma) * (x_sig - (1 - sigma) * mean) / var

    mu_t = 2.0
    for mu0 in (-1.0, 5.0):
        mu = torch.tensor(mu0, dtype=F64, requires_grad=True)
        opt = torch.optim.SGD([mu], lr=0.5)
        gen = torch.Generator().manual_seed(0)
        for _ in range(200):
            z = torch.randn(64, 1, generator=gen, dtype=F64)
            x = mu + z
            sigma = torch.rand(64, 1, generator=gen, dtype=F64) * 0.96 + 0.02
            x_sig = (1 - sigma) * x.detach() + sigma * torch.randn(64, 1, generator=gen, dtype=F64)
            g = vsd_gradient(x0_pred(x_sig, sigma, mu.detach()), x0_pred(x_sig, sigma, torch.tensor(mu_t)))
            opt.zero_grad()
            vsd_loss(x, g).backward()
            opt.step()
        assert abs(mu.item() - mu_t) < 0.05


# ------------------------------------------------------------------------------------------------- the sampler


class ConstantHead:
    """Closed gate: the head ignores y and returns the features (the teacher's velocity) unchanged."""

    num_layers, head_layers = 30, 5

    def __init__(self, velocity=None) -> None:
        self.velocity = velocity
        self.device = torch.device("cpu")
        self.feature_calls = 0
        self.head_calls = 0

    def features(self, x, t, cond):
        self.feature_calls += 1
        return self.velocity(x, t) if self.velocity is not None else x * 0 + 0.25

    def head(self, y, s, r, features, t):
        self.head_calls += 1
        return features


def gaussian_velocity(mean: torch.Tensor, std: float):
    """The exact FM velocity E[eps - x0 | x_t] for x0 ~ N(mean, std^2 I) (float64)."""
    def v(x, t):
        tt = t.to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
        var = (1 - tt) ** 2 * std**2 + tt**2
        dev = x - (1 - tt) * mean
        return tt * dev / var - (mean + (1 - tt) * std**2 * dev / var)
    return v


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_closed_gate_inner_flow_telescopes(n):
    b = 4
    c, y1 = _randn(b, 3, seed=1), _randn(b, 3, seed=2)
    model = ConstantHead()
    grid = transition_grid(n, 10.0, t_max=0.999)
    y0 = inner_flow(model, c, 0.7, y1, grid, "noise")
    torch.testing.assert_close(y0, (1 - 0.999) * y1 + 0.999 * c, rtol=0, atol=1e-13)
    torch.testing.assert_close(inner_flow(model, c, 0.7, y1, transition_grid(n, 3.0, t_max=1.0), "noise"), c,
                               rtol=0, atol=1e-13)
    torch.testing.assert_close(inner_flow(model, c, 0.7, y1, grid, "denoiser"), c, rtol=0, atol=1e-13)
    assert model.head_calls == 3 * n


@pytest.mark.parametrize("param,t_max", [("noise", 1.0), ("noise", 0.999), ("denoiser", 0.999)])
def test_closed_gate_sampler_is_the_teachers_euler_sampler(param, t_max):
    mean = torch.tensor([1.5, -0.5, 0.25], dtype=F64)
    velocity = gaussian_velocity(mean, 0.4)
    model = ConstantHead(velocity)
    cfg = TransitionConfig(outer_steps=3, inner_steps=2, outer_shift=3.0, inner_shift=10.0, t_max=t_max,
                           parameterization=param, micro_batch_size=4)
    idx = [3, 1, 4, 1, 5, 9]
    out = transition_rollout(model, None, (3,), seed=11, indices=idx, config=cfg, record=True, dtype=F64)
    x = randn_per_sample((3,), 11, idx, step=0, stream=OUTER_STREAM).double()
    grid = transition_grid(3, 3.0, t_max=t_max)
    for k in range(3):
        v = velocity(x, grid[k].expand(len(idx)))
        if param == "noise":  # the leak of the inner noise for s_N < 1
            y1 = randn_per_sample((3,), 11, idx, step=k, stream=INNER_STREAM).double()
            v = (1 - t_max) * y1 + t_max * v
        x = x - (grid[k] - grid[k + 1]) * v
    torch.testing.assert_close(out.latents, x, rtol=0, atol=1e-12)
    assert out.trajectory.shape == (6, 4, 3) and out.velocities.shape == (6, 3, 3)
    torch.testing.assert_close(out.trajectory[:, -1], out.latents, rtol=0, atol=0)
    assert out.effective_nfe == pytest.approx(3 * (1 + 5 / 30))
    assert (out.backbone_calls, out.head_calls) == (3, 6)


def test_sampler_counts_calls_and_reports_effective_nfe():
    model = ConstantHead()
    cfg = TransitionConfig(outer_steps=2, inner_steps=4, micro_batch_size=8)
    out = transition_rollout(model, None, (2, 3), seed=0, indices=range(8), config=cfg)
    assert model.feature_calls == 2 and model.head_calls == 8
    assert out.effective_nfe == pytest.approx(3.0) and out.backbone_calls == 2 and out.head_calls == 8
    assert out.trajectory is None and out.latents.shape == (8, 2, 3) and out.latents.dtype == torch.float32
    assert isinstance(model, TransitionModelLike)


def test_sampler_noise_addresses():
    """x_{t_M} = (seed, i, step 0, stream 0); y1 of outer transition k = (seed, i, step k, INNER_STREAM)."""
    model = ConstantHead()
    cfg = TransitionConfig(outer_steps=3, inner_steps=1, micro_batch_size=2)
    idx = [40, 2, 17]
    out = transition_rollout(model, None, (4,), seed=5, indices=idx, config=cfg, record=True)
    assert torch.equal(out.trajectory[:, 0], randn_per_sample((4,), 5, idx, step=0, stream=OUTER_STREAM))
    for k in range(3):
        assert torch.equal(out.inner_noise[:, k], randn_per_sample((4,), 5, idx, step=k, stream=INNER_STREAM))
    given = _randn(3, 4, seed=9, dtype=torch.float32)
    out2 = transition_rollout(model, None, (4,), seed=5, indices=idx, config=cfg, record=True, noise=given)
    assert torch.equal(out2.trajectory[:, 0], given) and torch.equal(out2.inner_noise, out.inner_noise)
    with pytest.raises(ValueError):
        transition_rollout(model, None, (4,), seed=5, indices=idx, config=cfg, noise=given[:2])


class MLPStudent(nn.Module):
    """A small random float32 student: backbone MLP of (x, t, cond), head MLP of (y, s, r, m, t)."""

    num_layers, head_layers = 4, 2

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.backbone = nn.Sequential(nn.Linear(dim + 2, 32), nn.SiLU(), nn.Linear(32, 32))
        self.head_net = nn.Sequential(nn.Linear(dim + 32 + 3, 32), nn.SiLU(), nn.Linear(32, dim))

    def features(self, x, t, cond):
        c = cond.hidden_states[:, 0] if isinstance(cond, Conditioning) else cond  # [B, 1]
        return self.backbone(torch.cat([x, t.unsqueeze(1), c], dim=1))

    def head(self, y, s, r, m, t):
        return self.head_net(torch.cat([y, m, s.unsqueeze(1), r.unsqueeze(1), t.unsqueeze(1)], dim=1))


@pytest.mark.parametrize("param", PARAMS)
def test_sampler_is_bitwise_reproducible_across_batch_compositions(param):
    model = MLPStudent()
    cfg = TransitionConfig(outer_steps=2, inner_steps=3, parameterization=param, micro_batch_size=4)
    idx = list(range(100, 110))
    cond = torch.linspace(-1, 1, 10).unsqueeze(1)
    full = transition_rollout(model, cond, (6,), seed=3, indices=idx, config=cfg).latents
    for rows in ([7, 3], [9], [0, 1, 2, 3, 4, 5, 6, 7, 8]):
        part = transition_rollout(model, cond[rows], (6,), seed=3, indices=[idx[i] for i in rows], config=cfg).latents
        assert torch.equal(part, full[rows])
    other = transition_rollout(model, cond, (6,), seed=4, indices=idx, config=cfg).latents
    assert not bool((other == full).any())
    # genrl's Conditioning is split with .select(rows)
    text = Conditioning(cond.unsqueeze(1), torch.ones(10, 1, dtype=torch.bool), [f"p{i}" for i in range(10)])
    assert torch.equal(transition_rollout(model, text, (6,), seed=3, indices=idx, config=cfg).latents, full)
    part = transition_rollout(model, text.select([8, 2]), (6,), seed=3, indices=[idx[8], idx[2]], config=cfg)
    assert torch.equal(part.latents, full[[8, 2]])


class StepScaledStudent(nn.Module):
    """Backbone ``m = A x`` and head ``y_hat = m + scale[j] tanh(y + t)``, j = the inner jump's index (read from s)."""

    num_layers, head_layers = 6, 1

    def __init__(self, grid: torch.Tensor, dim: int = 3) -> None:
        super().__init__()
        self.grid = grid.double()
        self.A = nn.Parameter(torch.eye(dim, dtype=F64) + 0.1 * _randn(dim, dim, seed=3))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, grid.numel() - 1, dtype=F64))

    def features(self, x, t, cond):
        return x @ self.A.T

    def head(self, y, s, r, m, t):
        j = int((self.grid - s[0]).abs().argmin())
        return m + self.scale[j] * torch.tanh(y + t.unsqueeze(1))


def _reference_rollout(model, x, y1s, outer, inner, param):
    """The same computation written out by hand (no library sampler), with autograd."""
    for k in range(outer.numel() - 1):
        t = outer[k].expand(x.shape[0])
        m = x @ model.A.T
        y = y1s[:, k]
        for j in range(inner.numel() - 1):
            s, r = inner[j], inner[j + 1]
            y_hat = m + model.scale[j] * torch.tanh(y + t.unsqueeze(1))
            u = y1s[:, k] - y_hat if param == "noise" else (y - y_hat) / s
            y = y - (s - r) * u
        x = x - (outer[k] - outer[k + 1]) * y
    return x


@pytest.mark.parametrize("param", PARAMS)
def test_grad_reaches_backbone_and_every_inner_step(param):
    cfg = TransitionConfig(outer_steps=2, inner_steps=4, outer_shift=3.0, inner_shift=2.0, parameterization=param)
    inner, outer = cfg.inner_grid(), cfg.outer_grid()
    model = StepScaledStudent(inner)
    out = transition_rollout(model, None, (3,), seed=2, indices=range(5), config=cfg, grad=True, record=True,
                             dtype=F64)
    weights = _randn(5, 3, seed=7)
    (out.latents * weights).sum().backward()
    grads = (model.A.grad.clone(), model.scale.grad.clone())
    assert bool((grads[1].abs() > 1e-6).all()), grads[1]  # every inner jump is on the graph
    assert grads[0].abs().max() > 1e-6
    model.zero_grad()
    ref = _reference_rollout(model, out.trajectory[:, 0].detach(), out.inner_noise, outer, inner, param)
    torch.testing.assert_close(out.latents.detach(), ref.detach(), rtol=0, atol=1e-12)
    (ref * weights).sum().backward()
    torch.testing.assert_close(grads[0], model.A.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[1], model.scale.grad, rtol=0, atol=1e-12)
    # grad=False: no graph
    assert transition_rollout(model, None, (3,), seed=2, indices=range(5), config=cfg,
                              dtype=F64).latents.grad_fn is None


def test_inner_flow_rejects_bad_grids_and_head_shapes():
    model = ConstantHead()
    y1 = _randn(2, 3, seed=0)
    with pytest.raises(ValueError):
        inner_flow(model, y1, 0.5, y1, torch.tensor([0.5, 0.9], dtype=F64))
    with pytest.raises(ValueError):
        inner_flow(model, y1, 0.5, y1, torch.tensor([1.0]))
    with pytest.raises(ValueError):
        inner_flow(model, y1[:, :2], 0.5, y1, transition_grid(2, 1.0))


@pytest.mark.parametrize("kwargs", [dict(outer_steps=0), dict(inner_steps=1.5), dict(outer_shift=0.0),
                                    dict(inner_shift=float("nan")), dict(t_max=0.0), dict(t_max=1.2),
                                    dict(parameterization="velocity"), dict(micro_batch_size=0),
                                    dict(batching="any"), dict(noise_backend="numpy"),
                                    dict(inner_steps=1000, inner_shift=10.0)])
def test_transition_config_rejects(kwargs):
    with pytest.raises(ValueError):
        TransitionConfig(**kwargs)


def test_transition_rollout_splits_cond_or_refuses():
    model = ConstantHead()
    cfg = TransitionConfig(outer_steps=1, inner_steps=1, micro_batch_size=2)
    with pytest.raises(TypeError):
        transition_rollout(model, object(), (2,), seed=0, indices=range(3), config=cfg)
    with pytest.raises(ValueError):
        transition_rollout(model, None, (2,), seed=0, indices=[], config=cfg)
    fast = TransitionConfig(outer_steps=1, inner_steps=1, micro_batch_size=8, batching="fast")
    assert transition_rollout(model, object(), (2,), seed=0, indices=range(3), config=fast).latents.shape == (3, 2)


# ------------------------------------------------------------------------------- stage-1 parts shared by the method


def test_sample_outer_point_closed_form_bounds_and_addressing():
    """t = grid[min(floor(M a), M - 1)] with a the addressed uniform, so t is one of t_M .. t_1 (never 0), each with
    probability 1/M; x1 is the addressed normal and x_t = (1 - t) x0 + t x1 exactly (float64); a sample's draws
    depend only on its own (seed, index, step, stream)."""
    grid = transition_grid(3, 10.0, 0.999)
    idx = torch.tensor([4, 0, 9, 2, 7, 11])
    x0 = _randn(6, 2, 3, seed=1)
    t, x1, x_t = sample_outer_point(x0, grid, 5, idx, time_stream=32, noise_stream=31, step=2, dtype=F64)
    assert t.dtype == x1.dtype == x_t.dtype == F64 and t.shape == (6,) and x1.shape == x0.shape
    a = rand_per_sample((), 5, idx, 2, 32)
    k = torch.clamp((a.double() * 3).floor().long(), max=2)
    assert torch.equal(t, grid[k]) and bool((t > 0).all())
    assert torch.equal(x1, randn_per_sample((2, 3), 5, idx, 2, 31, dtype=F64))
    tt = t.view(-1, 1, 1)
    assert torch.equal(x_t, (1 - tt) * x0 + tt * x1)
    # addressing: a sub-batch in another order draws the same rows; another step / stream / seed draws others
    sub = torch.tensor([2, 3])
    t2, x12, _ = sample_outer_point(x0[sub.flip(0)], grid, 5, idx[sub.flip(0)], 32, 31, step=2, dtype=F64)
    assert torch.equal(t2, t[sub.flip(0)]) and torch.equal(x12, x1[sub.flip(0)])
    for kwargs in ({"step": 3}, {"time_stream": 33, "noise_stream": 34}):
        args = {"time_stream": 32, "noise_stream": 31, "step": 2, "dtype": F64, **kwargs}
        _, other, _ = sample_outer_point(x0, grid, 5, idx, **args)
        assert not torch.equal(other, x1)
    # the default float32 draws: t is the float32 rounding of the same grid point (x_t float64 with float64 data)
    t32, x132, x_t32 = sample_outer_point(x0.float(), grid, 5, idx, 32, 31, step=2)
    assert t32.dtype == x132.dtype == x_t32.dtype == torch.float32 and torch.equal(t32, t.float())
    assert sample_outer_point(x0, grid, 5, idx, 32, 31, step=2)[2].dtype == F64


def test_sample_outer_point_is_uniform_over_the_grid_and_rejects_bad_inputs():
    grid = transition_grid(4, 3.0, 0.999)
    n = 4000
    t, _, _ = sample_outer_point(torch.zeros(n, 1, dtype=F64), grid, 0, torch.arange(n), 1, 2, dtype=F64)
    for point in grid[:-1]:
        share = float((t == point).double().mean())
        assert abs(share - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n), (float(point), share)
    assert not bool((t == 0).any())
    with pytest.raises(ValueError, match="1-d tensor of at least 2 points"):
        sample_outer_point(torch.zeros(2, 1), grid[:1], 0, [0, 1], 1, 2)
    with pytest.raises(ValueError, match="1-d tensor"):
        sample_outer_point(torch.zeros(2, 1), grid.view(1, -1), 0, [0, 1], 1, 2)
    with pytest.raises(ValueError, match="one row per index"):
        sample_outer_point(torch.zeros(3, 1), grid, 0, [0, 1], 1, 2)


def test_tm_meanflow_loss_closed_form_noise_parameterization():
    """A linear head y_hat = a y_s under "noise": u = y1 - a y_s, whose derivative along (v, 1) is -a v exactly, so
    the target is v (1 + a (s - r)) and the loss mean_b e_b / (e_b + c) with e_b = ||u_b - target_b||^2; its
    gradient in a is mean_b 2 <u_b - target_b, -y_s_b> / (e_b + c) (the target and the weight are detached)."""
    y, y1 = _randn(3, 2, 2, seed=2), _randn(3, 2, 2, seed=3)
    s = torch.tensor([0.7, 0.4, 0.9], dtype=F64)
    r = torch.tensor([0.2, 0.4, 0.0], dtype=F64)
    a = torch.tensor(0.3, dtype=F64, requires_grad=True)
    calls = []

    def head(y_s, s_):
        calls.append(torch.is_grad_enabled())
        return a * y_s

    out = tm_meanflow_loss(head, y, y1, s, r, "noise", delta=1e-3, c=2.0)
    assert calls == [True, False, False]  # u with graph, the two finite-difference points without
    col = (-1, 1, 1)
    y_s = (1 - s.view(col)) * y + s.view(col) * y1
    v = y1 - y
    u = y1 - a.detach() * y_s
    target = v * (1 + a.detach() * (s - r).view(col))
    e = (u - target).pow(2).flatten(1).sum(1)
    torch.testing.assert_close(out["u_minus_target"], u - target, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out["loss"], (e / (e + 2.0)).mean(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out["mse"], (u - target).pow(2).mean(), rtol=1e-10, atol=1e-12)
    assert float(out["r_equal_s"]) == pytest.approx(1 / 3)
    assert out["loss"].dtype == F64 and not out["u_minus_target"].requires_grad
    out["loss"].backward()
    want = (2 * ((u - target) * -y_s).flatten(1).sum(1) / (e + 2.0)).mean()
    torch.testing.assert_close(a.grad, want, rtol=1e-9, atol=1e-12)


def test_tm_meanflow_loss_closed_form_denoiser_and_default_c():
    """Under "denoiser" a head y_hat = y_s - s w gives the constant average velocity u = w: du/ds = 0, so the target
    is v whatever r is, and c defaults to d (elements per sample); bad shapes are refused."""
    y, y1, w = _randn(2, 3, seed=4), _randn(2, 3, seed=5), _randn(2, 3, seed=6)
    s, r = torch.tensor([0.5, 0.8], dtype=F64), torch.tensor([0.1, 0.8], dtype=F64)
    out = tm_meanflow_loss(lambda y_s, s_: y_s - s_.view(-1, 1) * w, y, y1, s, r, "denoiser")
    v = y1 - y
    torch.testing.assert_close(out["u_minus_target"], w - v, rtol=1e-9, atol=1e-10)
    e = (w - v).pow(2).sum(1)
    torch.testing.assert_close(out["loss"], (e / (e + 3.0)).mean(), rtol=1e-9, atol=1e-10)
    with pytest.raises(ValueError, match="y1 of shape"):
        tm_meanflow_loss(lambda y_s, s_: y_s, y, y1[:, :2], s, r)
    with pytest.raises(ValueError, match="s must be a tensor"):
        tm_meanflow_loss(lambda y_s, s_: y_s, y, y1, s[:1], r)
    with pytest.raises(ValueError, match="r must be a tensor"):
        tm_meanflow_loss(lambda y_s, s_: y_s, y, y1, s, 0.5)


# ------------------------------------------------------------------------- the adaptive weight: squared norm or norm


def test_adaptive_loss_both_weightings_in_closed_form():
    """A hand case (float64): residuals e_b = u_b - target_b = (3, 4) and (1, 0), so ||e||^2 = (25, 1) and
    ||e|| = (5, 1); with c = 2, "squared" (the TMD paper / MeanFlow) gives mean(25/27, 1/3) and per-sample gradients
    2 e_b / ((||e_b||^2 + c) B); "norm" (FastGen's default) gives mean(25/7, 1/3) and 2 e_b / ((||e_b|| + c) B)."""
    target = torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=F64)
    res = torch.tensor([[3.0, 4.0], [1.0, 0.0]], dtype=F64)
    want = {"squared": ([25 / 27, 1 / 3], [27.0, 3.0]), "norm": ([25 / 7, 1 / 3], [7.0, 3.0])}
    grads = {}
    for norm, (values, denominators) in want.items():
        u = (target + res).requires_grad_(True)
        loss = adaptive_loss(u, target, c=2.0, norm=norm)
        assert loss.dtype == F64
        torch.testing.assert_close(loss, torch.tensor(sum(values) / 2, dtype=F64), rtol=0, atol=1e-15)
        loss.backward()
        expected = 2 * res / (torch.tensor(denominators, dtype=F64)[:, None] * 2)
        torch.testing.assert_close(u.grad, expected, rtol=0, atol=1e-15)
        grads[norm] = u.grad
    # the option rescales each sample's gradient by (||e||^2 + c) / (||e|| + c): 27/7 and 3/3
    torch.testing.assert_close(grads["norm"], grads["squared"] * torch.tensor([[27 / 7], [1.0]], dtype=F64),
                               rtol=1e-14, atol=0)
    # the default is the paper's form; the default c is d = 2 ("squared") or sqrt(d) ("norm"); power applies to both
    u = target + res
    assert adaptive_loss(u, target).item() == pytest.approx((25 / 27 + 1 / 3) / 2, abs=1e-15)
    r2 = math.sqrt(2.0)
    assert adaptive_loss(u, target, norm="norm").item() == pytest.approx((25 / (5 + r2) + 1 / (1 + r2)) / 2,
                                                                         abs=1e-14)
    assert adaptive_loss(u, target, c=2.0, power=0.5, norm="norm").item() == pytest.approx(
        (25 / math.sqrt(7) + 1 / math.sqrt(3)) / 2, abs=1e-14)
    assert adaptive_loss(u, target, power=0.0, norm="norm").item() == pytest.approx(13.0, abs=1e-13)
    with pytest.raises(ValueError, match="unknown norm"):
        adaptive_loss(u, target, norm="l1")


def test_norm_weighting_has_fastgens_opt_grad_gradient_and_spatially_invariant_constant():
    """FastGen's default MeanFlow loss, restated from its formula: tangent = target - sg(u), w = 1 / (||tangent|| +
    c0)^p (detached), loss = mean_b ||u_b - sg(u_b + w_b tangent_b)||^2. Its gradient equals ``norm="norm"`` with
    c = c0; with the tangent first scaled by 1 / sqrt(d) (``tangent_spatial_invariance``) and p = 1 it equals c =
    c0 sqrt(d). Its value is ||e||^2 w^2, genrl's ||e||^2 w (same gradient, other logged value)."""
    b, d, c0 = 3, 12, 0.7
    u0, target = _randn(b, 3, 4, seed=11), _randn(b, 3, 4, seed=12)

    def fastgen_like(invariant: bool, power: float = 1.0):
        u = u0.clone().requires_grad_(True)
        tangent = target - u.detach()
        if invariant:
            tangent = tangent / math.sqrt(d)
        w = (tangent.flatten(1).norm(dim=1) + c0).pow(-power).view(b, 1, 1)
        loss = (u - (u + w * tangent).detach()).pow(2).flatten(1).sum(1).mean()
        loss.backward()
        return loss.detach(), u.grad

    def genrl(c: float, power: float = 1.0):
        u = u0.clone().requires_grad_(True)
        loss = adaptive_loss(u, target, c=c, power=power, norm="norm")
        loss.backward()
        return loss.detach(), u.grad

    for power in (1.0, 0.75):
        (fg_value, fg_grad), (value, grad) = fastgen_like(False, power), genrl(c0, power)
        torch.testing.assert_close(grad, fg_grad, rtol=1e-13, atol=0)
        n = (u0 - target).flatten(1).norm(dim=1)
        torch.testing.assert_close(fg_value, (n.square() / (n + c0).pow(2 * power)).mean(), rtol=1e-13, atol=0)
        torch.testing.assert_close(value, (n.square() / (n + c0).pow(power)).mean(), rtol=1e-13, atol=0)
    _, fg_grad = fastgen_like(True)
    _, grad = genrl(c0 * math.sqrt(d))
    torch.testing.assert_close(grad, fg_grad, rtol=1e-13, atol=0)


def test_tm_meanflow_loss_norm_option_closed_form():
    """The linear-head case of test_tm_meanflow_loss_closed_form_noise_parameterization under ``norm="norm"``: the
    same target and residual, the loss mean_b e_b / (sqrt(e_b) + c) and its gradient in a
    mean_b 2 <u_b - target_b, -y_s_b> / (sqrt(e_b) + c)."""
    y, y1 = _randn(3, 2, 2, seed=2), _randn(3, 2, 2, seed=3)
    s = torch.tensor([0.7, 0.4, 0.9], dtype=F64)
    r = torch.tensor([0.2, 0.4, 0.0], dtype=F64)
    a = torch.tensor(0.3, dtype=F64, requires_grad=True)
    out = tm_meanflow_loss(lambda y_s, s_: a * y_s, y, y1, s, r, "noise", delta=1e-3, c=2.0, norm="norm")
    col = (-1, 1, 1)
    y_s = (1 - s.view(col)) * y + s.view(col) * y1
    u = y1 - a.detach() * y_s
    target = (y1 - y) * (1 + a.detach() * (s - r).view(col))
    e = (u - target).pow(2).flatten(1).sum(1)
    torch.testing.assert_close(out["loss"], (e / (e.sqrt() + 2.0)).mean(), rtol=1e-10, atol=1e-12)
    out["loss"].backward()
    want = (2 * ((u - target) * -y_s).flatten(1).sum(1) / (e.sqrt() + 2.0)).mean()
    torch.testing.assert_close(a.grad, want, rtol=1e-9, atol=1e-12)
    squared = tm_meanflow_loss(lambda y_s, s_: a.detach() * y_s, y, y1, s, r, "noise", delta=1e-3, c=2.0)
    torch.testing.assert_close(squared["loss"], (e / (e + 2.0)).mean(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="unknown norm"):
        tm_meanflow_loss(lambda y_s, s_: y_s, y, y1, s, r, norm="squared_l2")


def test_tmd_passes_loss_norm_to_the_stage1_loss(tiny_policy, tiny_text_encoder):
    """TMD(loss_norm=...) reaches the stage-1 loss: on one batch the residual is the same under both, and the loss is
    each weighting's closed form of it with the default c (d, or sqrt(d)); an unknown value is refused early."""
    from genrl.methods.tmd import TMD

    model = TMD(generator={"family": "dit", "pretrained": tiny_policy, "text_encoder": tiny_text_encoder},
                head_layers=1, caption_dropout=0.0, seed=3, loss_norm="norm")
    model.configure_model()
    x0 = torch.randn(2, 8, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    prompts, idx = ["a red circle moving left", "a blue square moving up"], torch.tensor([0, 1])
    out = {}
    for norm in ("norm", "squared"):
        model.hparams.loss_norm = norm
        with torch.no_grad():
            out[norm] = model.meanflow_loss(x0, prompts, idx, it=0)
    diff = out["norm"]["u_minus_target"].double()
    torch.testing.assert_close(out["squared"]["u_minus_target"].double(), diff, rtol=0, atol=0)
    e, d = diff.flatten(1).square().sum(1), diff[0].numel()
    torch.testing.assert_close(out["squared"]["loss"].double(), (e / (e + d)).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(out["norm"]["loss"].double(), (e / (e.sqrt() + math.sqrt(d))).mean(), rtol=1e-5,
                               atol=0)
    with pytest.raises(ValueError, match="loss_norm"):
        TMD(generator={"family": "dit", "pretrained": tiny_policy}, loss_norm="l2")
