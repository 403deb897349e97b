"""Tests of genrl.flow.renoise: the Gaussian policy of the few-step re-noise (consistency) sampler."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow import renoise_log_prob, renoise_log_ratio, renoise_mean

F64 = torch.float64
SHAPE = (3, 2, 4, 3, 5)  # [B, T, C, H, W]


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _step(seed: int = 0) -> tuple[torch.Tensor, ...]:
    x, v, v_old, eps = (_rand(*SHAPE, seed=seed + i) for i in range(4))
    return x, v, v_old, eps


SIGMAS = [
    (0.75, 0.5),
    (torch.tensor([0.9, 0.6, 0.3], dtype=F64), torch.tensor([0.7, 0.25, 0.1], dtype=F64)),
    (1.0, 0.8),
]


@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMAS)
def test_mean_is_renoised_clean_prediction(sigma, sigma_next) -> None:
    x, v, _, eps = _step(0)
    s = sigma if isinstance(sigma, float) else sigma.view(-1, 1, 1, 1, 1)
    sn = sigma_next if isinstance(sigma_next, float) else sigma_next.view(-1, 1, 1, 1, 1)
    # a consistent pair: x = (1 - s) x0 + s e0 with the exact velocity v = e0 - x0 -> x0_hat = x0
    x0, e0 = _rand(*SHAPE, seed=10), _rand(*SHAPE, seed=11)
    xs = (1 - s) * x0 + s * e0
    torch.testing.assert_close(renoise_mean(xs, e0 - x0, sigma, sigma_next), (1 - sn) * x0, rtol=0, atol=1e-13)
    torch.testing.assert_close(renoise_mean(x, v, sigma, sigma_next), (1 - sn) * (x - s * v), rtol=0, atol=0)
    # last step: sigma_next = 0 returns x0_hat
    torch.testing.assert_close(renoise_mean(x, v, sigma, 0.0), x - s * v, rtol=0, atol=0)


@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMAS)
@pytest.mark.parametrize("reduce", ("mean", "sum"))
def test_log_prob_matches_torch_normal(sigma, sigma_next, reduce: str) -> None:
    x, v, _, eps = _step(1)
    s = sigma if isinstance(sigma, float) else sigma.view(-1, 1, 1, 1, 1)
    sn = sigma_next if isinstance(sigma_next, float) else sigma_next.view(-1, 1, 1, 1, 1)
    mu = (1 - sn) * (x - s * v)
    x_next = mu + sn * eps + 0.3 * _rand(*SHAPE, seed=20)  # not exactly the mean + std * eps
    ref = torch.distributions.Normal(mu, torch.as_tensor(sn, dtype=F64).expand(SHAPE)).log_prob(x_next)
    ref = ref.reshape(SHAPE[0], -1)
    ref = ref.mean(dim=1) if reduce == "mean" else ref.sum(dim=1)
    lp = renoise_log_prob(x_next, x, v, sigma, sigma_next, reduce=reduce)
    assert lp.shape == (SHAPE[0],) and lp.dtype == F64
    torch.testing.assert_close(lp, ref, rtol=1e-12, atol=1e-12)


def test_log_prob_per_frame_sigma() -> None:
    x, v, _, eps = _step(2)
    sigma = torch.rand(3, 2, generator=torch.Generator().manual_seed(0), dtype=F64) * 0.5 + 0.5
    sigma_next = sigma * 0.5
    s, sn = sigma.view(3, 2, 1, 1, 1), sigma_next.view(3, 2, 1, 1, 1)
    mu = (1 - sn) * (x - s * v)
    x_next = mu + sn * eps
    ref = torch.distributions.Normal(mu, sn.expand(SHAPE)).log_prob(x_next).reshape(3, -1).mean(dim=1)
    torch.testing.assert_close(renoise_log_prob(x_next, x, v, sigma, sigma_next), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMAS)
@pytest.mark.parametrize("reduce", ("mean", "sum"))
def test_exact_ratio_equals_log_prob_difference(sigma, sigma_next, reduce: str) -> None:
    x, v, v_old, eps = _step(3)
    v = v_old + 0.2 * v  # a nearby policy
    mu_old = renoise_mean(x, v_old, sigma, sigma_next)
    sn = sigma_next if isinstance(sigma_next, float) else sigma_next.view(-1, 1, 1, 1, 1)
    x_next = mu_old + sn * eps
    diff = renoise_log_prob(x_next, x, v, sigma, sigma_next, reduce) - renoise_log_prob(
        x_next, x, v_old, sigma, sigma_next, reduce
    )
    ratio = renoise_log_ratio(eps, v, v_old, sigma, sigma_next, reduce=reduce)
    assert ratio.shape == (SHAPE[0],) and ratio.dtype == F64
    torch.testing.assert_close(ratio, diff, rtol=0, atol=1e-10)
    assert ratio.abs().min() > 1e-5  # a non-trivial ratio


@pytest.mark.parametrize(("sigma", "sigma_next"), SIGMAS)
def test_normalized_ratio(sigma, sigma_next) -> None:
    _, v, v_old, eps = _step(4)
    norm = renoise_log_ratio(eps, v, v_old, sigma, sigma_next, normalized=True)
    torch.testing.assert_close(norm, -(eps * (v - v_old)).reshape(3, -1).mean(dim=1), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        renoise_log_ratio(eps, v, v_old, sigma, sigma_next, normalized=True, reduce="sum"),
        -(eps * (v - v_old)).reshape(3, -1).sum(dim=1), rtol=0, atol=1e-12,
    )
    # = the exact ratio's linear term times sigma_next / ((1 - sigma_next) sigma)
    s = torch.as_tensor(sigma, dtype=F64).expand(3)
    sn = torch.as_tensor(sigma_next, dtype=F64).expand(3)
    d = -(1 - sn).view(-1, 1, 1, 1, 1) * s.view(-1, 1, 1, 1, 1) * (v - v_old)
    linear = (eps * d).reshape(3, -1).mean(dim=1) / sn
    quad = (d * d).reshape(3, -1).mean(dim=1) / (2 * sn * sn)
    torch.testing.assert_close(norm, linear * sn / ((1 - sn) * s), rtol=1e-12, atol=1e-14)
    exact = renoise_log_ratio(eps, v, v_old, sigma, sigma_next)
    torch.testing.assert_close(exact, linear - quad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("normalized", (False, True))
def test_ratio_zero_for_same_velocity(normalized: bool) -> None:
    _, v, _, eps = _step(5)
    r = renoise_log_ratio(eps, v, v.clone(), 0.8, 0.4, normalized=normalized)
    assert torch.equal(r, torch.zeros(3, dtype=F64))


def test_ratio_detaches_eps_and_v_old() -> None:
    _, v, v_old, eps = _step(6)
    v, v_old, eps = v.requires_grad_(), v_old.requires_grad_(), eps.requires_grad_()
    renoise_log_ratio(eps, v, v_old, 0.8, 0.4).sum().backward()
    assert v.grad is not None and v.grad.abs().sum() > 0
    assert v_old.grad is None and eps.grad is None


def test_log_prob_gradcheck() -> None:
    x, v, _, eps = (t[:2, :1, :2, :2, :2].contiguous() for t in _step(7))
    x_next = renoise_mean(x, v, 0.7, 0.3) + 0.3 * eps + 0.1
    sig = torch.tensor([0.9, 0.5], dtype=F64)
    sig_next = torch.tensor([0.6, 0.2], dtype=F64)
    for reduce in ("mean", "sum"):
        assert torch.autograd.gradcheck(
            lambda vv, r=reduce: renoise_log_prob(x_next, x, vv, sig, sig_next, reduce=r),
            (v.clone().requires_grad_(),),
        )
        assert torch.autograd.gradcheck(
            lambda vv: renoise_log_ratio(eps, vv, x, sig, sig_next), (v.clone().requires_grad_(),)
        )
    # closed-form gradient: d/dv of mean_j l_j = -(x_next - mu) (1 - sn) s / (sn^2 D)
    vv = v.clone().requires_grad_()
    renoise_log_prob(x_next, x, vv, 0.7, 0.3).sum().backward()
    mu = renoise_mean(x, v, 0.7, 0.3)
    expected = -(x_next - mu) * (1 - 0.3) * 0.7 / (0.3**2 * x[0].numel())
    torch.testing.assert_close(vv.grad, expected, rtol=1e-12, atol=1e-14)


def test_float32_compute() -> None:
    x, v, v_old, eps = (t.float() for t in _step(8))
    x_next = renoise_mean(x, v_old, 0.6, 0.3) + 0.3 * eps
    assert renoise_mean(x.bfloat16(), v.half(), 0.6, 0.3).dtype == torch.float32
    assert renoise_log_prob(x_next, x, v.bfloat16(), 0.6, 0.3).dtype == torch.float32
    assert renoise_log_ratio(eps, v, v_old, 0.6, 0.3).dtype == torch.float32
    assert renoise_log_prob(x_next, x.double(), v, 0.6, 0.3).dtype == F64


def test_errors() -> None:
    x, v, v_old, eps = _step(9)
    with pytest.raises(ValueError, match=r"sigma_next must be > 0 .* got 0\.0"):
        renoise_log_prob(x, x, v, 0.5, 0.0)
    with pytest.raises(ValueError, match=r"sigma_next must be > 0 .* got 0\.0"):
        renoise_log_prob(x, x, v, 0.5, torch.tensor([0.2, 0.0, 0.3], dtype=F64))
    with pytest.raises(ValueError, match=r"sigma_next must lie in \[0, 1\]; got values in \[-0\.1"):
        renoise_log_prob(x, x, v, 0.5, torch.tensor([0.2, -0.1, 0.3], dtype=F64))
    with pytest.raises(ValueError, match="sigma_next must be > 0"):
        renoise_log_ratio(eps, v, v_old, 0.5, 0.0)
    with pytest.raises(ValueError, match="sigma_next must be > 0"):
        renoise_log_ratio(eps, v, v_old, 0.5, 0.0, normalized=True)
    with pytest.raises(ValueError, match="sigma must lie in"):
        renoise_mean(x, v, 1.5, 0.2)
    with pytest.raises(ValueError, match="sigma_next must lie in"):
        renoise_mean(x, v, 0.5, math.nan)
    with pytest.raises(ValueError, match="must match"):
        renoise_mean(x, v[:2], 0.5, 0.2)
    with pytest.raises(ValueError, match="x_next of shape"):
        renoise_log_prob(x[:, :1], x, v, 0.5, 0.2)
    with pytest.raises(ValueError, match="must match"):
        renoise_log_prob(x, x, v[..., :2], 0.5, 0.2)
    with pytest.raises(ValueError, match="must have the same shape"):
        renoise_log_ratio(eps, v, v_old[:1], 0.5, 0.2)
    with pytest.raises(ValueError, match="does not fit"):
        renoise_log_prob(x, x, v, torch.full((4,), 0.5), 0.2)
    with pytest.raises(ValueError, match="unknown reduce"):
        renoise_log_prob(x, x, v, 0.5, 0.2, reduce="max")
    with pytest.raises(ValueError, match="unknown reduce"):
        renoise_log_ratio(eps, v, v_old, 0.5, 0.2, reduce="max")
