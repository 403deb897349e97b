"""genrl.flow.sequence_policy: GSPO, token-level GRPO and the k3 KL estimator (float64, exact checks)."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow import gspo_loss, k3_kl, token_grpo_loss

DT = torch.float64


def _batch(n=3, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, length, generator=g, dtype=DT) * 3
    mask = torch.zeros(n, length, dtype=torch.bool)
    for i in range(n):  # prompt of 2 tokens, answers of different lengths, right padding
        mask[i, 2:length - i] = True
    adv = torch.randn(n, generator=g, dtype=DT)
    return lp, mask, adv


@pytest.mark.parametrize("loss_fn", [gspo_loss, token_grpo_loss])
def test_on_policy_ratio_one_and_policy_gradient(loss_fn):
    lp0, mask, adv = _batch()
    lp = lp0.clone().requires_grad_(True)
    loss, stats = loss_fn(lp, lp0.clone(), adv, mask)
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["ratio_min"]) == 1.0 and float(stats["ratio_max"]) == 1.0
    assert float(stats["clipfrac"]) == 0.0
    loss.backward()
    # the policy gradient: -A_i / N times grad of sequence i's mean masked log-prob
    lp2 = lp0.clone().requires_grad_(True)
    n = mask.sum(1).to(DT)
    mean_lp = (lp2 * mask).sum(1) / n
    (-(adv * mean_lp).sum() / lp0.shape[0]).backward()
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(loss, -(adv * 1.0).mean(), rtol=0, atol=1e-15)


def test_gspo_clipping_zeroes_gradient_on_the_clipped_side_only():
    eps = 0.01
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.full((1, 4), -1.0, dtype=DT)
    for adv, shift, zero in ((1.0, +0.05, True), (1.0, -0.05, False), (-1.0, -0.05, True), (-1.0, +0.05, False)):
        lp = (old + shift).clone().requires_grad_(True)
        loss, stats = gspo_loss(lp, old, torch.tensor([adv], dtype=DT), mask, clip_range=eps)
        loss.backward()
        assert float(stats["clipfrac"]) == 1.0
        if zero:
            assert torch.all(lp.grad == 0), (adv, shift)
        else:
            s = math.exp(shift)
            torch.testing.assert_close(lp.grad, torch.full_like(lp, -adv * s / 4), rtol=1e-12, atol=0)


def test_token_grpo_clipping_is_per_token():
    eps = 0.1
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=DT)
    lp = torch.tensor([[0.5, -0.5, 0.0]], dtype=DT, requires_grad=True)  # ratios e^.5 (clipped), e^-.5, 1
    loss, stats = token_grpo_loss(lp, old, torch.tensor([2.0], dtype=DT), mask, clip_range=eps)
    loss.backward()
    expected = torch.tensor([[0.0, -2.0 * math.exp(-0.5) / 3, -2.0 / 3]], dtype=DT)
    torch.testing.assert_close(lp.grad, expected, rtol=1e-12, atol=0)
    assert abs(float(stats["clipfrac"]) - 2 / 3) < 1e-12


def test_k3_nonnegative_zero_when_equal_and_matches_definition():
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(50, 9, generator=g, dtype=DT) * 3
    ref = torch.randn(50, 9, generator=g, dtype=DT) * 3
    mask = torch.rand(50, 9, generator=g, dtype=DT) > 0.3
    kl = k3_kl(lp, ref, mask)
    assert kl.shape == (50,) and torch.all(kl >= 0)
    assert torch.all(k3_kl(lp, lp.clone(), mask) == 0)
    d = ref - lp
    manual = ((torch.exp(d) - d - 1) * mask).sum(1) / mask.sum(1).clamp(min=1)
    torch.testing.assert_close(kl, manual, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_fn", [gspo_loss, token_grpo_loss])
def test_masked_tokens_do_not_change_loss_or_grad(loss_fn):
    lp0, mask, adv = _batch(seed=2)
    old = lp0 - 0.01 * torch.arange(lp0.shape[1], dtype=DT)
    ref = lp0 + 0.3

    def run(garbage):
        lp = torch.where(mask, lp0, garbage).requires_grad_(True)
        o = torch.where(mask, old, garbage)
        r = torch.where(mask, ref, garbage)
        loss, stats = loss_fn(lp, o, adv, mask, clip_range=0.005, kl_coef=0.1, ref_log_probs=r)
        loss.backward()
        return loss.detach(), lp.grad * mask, stats

    a = run(torch.tensor(-3.0, dtype=DT))
    b = run(torch.tensor(-math.inf, dtype=DT))
    c = run(torch.tensor(17.0, dtype=DT))
    for other in (b, c):
        torch.testing.assert_close(a[0], other[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], other[1], rtol=0, atol=0)
        for k in a[2]:
            torch.testing.assert_close(a[2][k], other[2][k], rtol=0, atol=0)
    assert torch.isfinite(b[1]).all()


@pytest.mark.parametrize("loss_fn", [gspo_loss, token_grpo_loss])
def test_empty_mask_sequence_contributes_zero(loss_fn):
    lp0, mask, adv = _batch(seed=3)
    old = lp0 - 0.002
    mask[1] = False
    lp = lp0.clone().requires_grad_(True)
    loss, stats = loss_fn(lp, old, adv, mask, kl_coef=0.5, ref_log_probs=lp0 + 0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert torch.all(lp.grad[1] == 0)
    assert all(torch.isfinite(v) for v in stats.values())
    # same total as the two other sequences alone, divided by the full N = 3
    keep = [0, 2]
    sub, _ = loss_fn(lp0[keep], old[keep], adv[keep], mask[keep], kl_coef=0.5, ref_log_probs=lp0[keep] + 0.1)
    torch.testing.assert_close(loss.detach() * 3, sub * 2, rtol=1e-12, atol=1e-15)
    # every mask empty: loss 0, stats neutral
    none = torch.zeros_like(mask)
    loss0, st0 = loss_fn(lp0.clone().requires_grad_(True), old, adv, none)
    assert float(loss0.detach()) == 0.0 and float(st0["ratio_mean"]) == 1.0 and float(st0["clipfrac"]) == 0.0


def test_closed_form_small_example():
    # one sequence, tokens 2 and 3 masked; log-ratios 0.1 and 0.3 -> s = exp(0.2); A = 2, eps = 0.5 (unclipped)
    lp = torch.tensor([[-9.0, -1.0, -2.0, 5.0]], dtype=DT)
    old = torch.tensor([[0.0, -1.1, -2.3, 0.0]], dtype=DT)
    ref = torch.tensor([[0.0, -1.5, -2.0, 0.0]], dtype=DT)
    mask = torch.tensor([[False, True, True, False]])
    beta = 0.25
    loss, stats = gspo_loss(lp, old, torch.tensor([2.0], dtype=DT), mask, clip_range=0.5, kl_coef=beta,
                            ref_log_probs=ref)
    kl = ((math.exp(-0.5) + 0.5 - 1) + 0.0) / 2
    expected = -2.0 * math.exp(0.2) + beta * kl
    assert abs(float(loss) - expected) < 1e-12
    assert abs(float(stats["kl_mean"]) - kl) < 1e-12
    assert abs(float(stats["ratio_mean"]) - math.exp(0.2)) < 1e-12
    # clipped at eps = 0.1: -A * 1.1 + beta KL
    loss_c, _ = gspo_loss(lp, old, torch.tensor([2.0], dtype=DT), mask, clip_range=0.1, kl_coef=beta,
                          ref_log_probs=ref)
    assert abs(float(loss_c) - (-2.0 * 1.1 + beta * kl)) < 1e-12
    # token-level: per-token terms -2 e^0.1 and -2 e^0.3 (eps 0.5), mean over the two tokens
    loss_t, _ = token_grpo_loss(lp, old, torch.tensor([2.0], dtype=DT), mask, clip_range=0.5)
    assert abs(float(loss_t) - (-(math.exp(0.1) + math.exp(0.3)))) < 1e-12


def test_errors():
    lp, mask, adv = _batch()
    with pytest.raises(ValueError, match="ref_log_probs"):
        gspo_loss(lp, lp, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(lp, lp, adv[:2], mask)
    with pytest.raises(ValueError, match="bool"):
        token_grpo_loss(lp, lp, adv, mask.to(DT))
    with pytest.raises(ValueError, match="clip_range"):
        gspo_loss(lp, lp, adv, mask, clip_range=1.5)
    with pytest.raises(ValueError, match="must match"):
        k3_kl(lp, lp[:, :3], mask)
