"""Stream-R1's weights (genrl.flow.stream_r1) against hand computations and the spec's invariants: beta = 0 with a flat
saliency is DMD bit for bit, weights positive with mean 1, floors held, the balance penalty by hand, fusion."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow.dmd import dmd_loss
from genrl.flow.stream_r1 import (
    balance_penalty,
    final_reward,
    fuse_saliency,
    fusion_weights,
    inter_weight,
    intra_weight,
    spatial_weights,
    temporal_weights,
    to_latent_grid,
)


def _grad(x: torch.Tensor, g: torch.Tensor, weight=None) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    loss = dmd_loss(x, g, weight=weight)
    loss.backward()
    return loss.detach(), x.grad


def test_beta_zero_and_a_flat_saliency_give_dmd_bit_for_bit():
    torch.manual_seed(0)
    x, g = torch.randn(3, 4, 2, 6, 6, dtype=torch.float64), torch.randn(3, 4, 2, 6, 6, dtype=torch.float64)
    rewards = torch.randn(3, 3, dtype=torch.float64)
    w_inter = inter_weight(final_reward(rewards, penalty=0.7), beta=0.0)
    w_intra = intra_weight(torch.full((3, 3, 4, 6, 6), 0.25, dtype=torch.float64), rewards)
    assert torch.equal(w_inter, torch.ones(3, dtype=torch.float64)) and torch.equal(w_intra, torch.ones_like(w_intra))
    weight = w_inter[:, None, None, None] * w_intra  # [B, F, H, W], broadcast over channels
    loss_w, grad_w = _grad(x, g, weight[:, :, None])
    loss, grad = _grad(x, g)
    assert torch.equal(loss_w, loss) and torch.equal(grad_w, grad)


def test_the_gradient_scales_with_exp_beta_r_per_rollout():
    torch.manual_seed(1)
    x, g = torch.randn(2, 3, 1, 4, 4, dtype=torch.float64), torch.randn(2, 3, 1, 4, 4, dtype=torch.float64)
    r = torch.tensor([0.3, -0.8], dtype=torch.float64)
    w = inter_weight(r, beta=2.0)
    assert torch.allclose(w, torch.exp(2.0 * r))
    _, grad_w = _grad(x, g, w)
    _, grad = _grad(x, g)
    assert torch.allclose(grad_w, grad * w[:, None, None, None, None], rtol=1e-14, atol=0)


def test_intra_weights_are_positive_mean_one_floored_and_monotone():
    torch.manual_seed(2)
    s = torch.rand(2, 5, 6, 8, dtype=torch.float64) ** 3
    w_t, w_s = temporal_weights(s, floor=0.2), spatial_weights(s, floor=0.15)
    assert torch.allclose(w_t.mean(1), torch.ones(2, dtype=torch.float64))
    assert torch.allclose(w_s.mean((2, 3)), torch.ones(2, 5, dtype=torch.float64))
    # before the division by the mean every weight lies in [floor, 1]: so min / max >= floor
    assert bool((w_t.amin(1) / w_t.amax(1) >= 0.2 - 1e-12).all())
    assert bool((w_s.amin((2, 3)) / w_s.amax((2, 3)) >= 0.15 - 1e-12).all())
    # the frame with the largest mean saliency gets the largest temporal weight; the order of frames is kept
    p = s.mean((2, 3))
    for b in range(2):
        order = p[b].argsort()
        assert bool((w_t[b][order].diff() >= -1e-12).all())
        assert int(w_t[b].argmax()) == int(p[b].argmax())
    w = intra_weight(s)
    assert bool((w > 0).all()) and torch.allclose(w.mean((1, 2, 3)), torch.ones(2, dtype=torch.float64))
    # hand value of one temporal weight: p_hat = (p - min) / (max - min), w = max(p_hat, 0.2) / mean
    p_hat = (p[0] - p[0].min()) / (p[0].max() - p[0].min())
    pre = torch.clamp(p_hat, min=0.2)
    assert torch.allclose(w_t[0], pre / pre.mean(), rtol=1e-14)


def test_strength_zero_flattens_and_a_flat_frame_gets_weight_one():
    s = torch.rand(1, 3, 4, 4, dtype=torch.float64)
    assert torch.equal(temporal_weights(s, strength=0.0), torch.ones(1, 3, dtype=torch.float64))
    s[0, 1] = 0.5  # a constant frame: its spatial weights are exactly 1
    assert torch.equal(spatial_weights(s)[0, 1], torch.ones(4, 4, dtype=torch.float64))


def test_balance_penalty_by_hand():
    # window 4, three dimensions; rows are the per-step batch means, oldest first
    history = torch.tensor([[9.0, 9.0, 9.0],            # outside the window
                            [0.0, 1.0, 2.0],
                            [2.0, 1.0, 0.0],
                            [1.0, 3.0, 2.0],
                            [3.0, 1.0, 4.0]], dtype=torch.float64)
    # older half: rows 1-2 -> means (1, 1, 1); recent half: rows 3-4 -> (2, 2, 3); Delta = (1, 1, 2)
    # unbiased std of (1, 1, 2): mean 4/3, squares (1/9, 1/9, 4/9) sum 2/3, / 2 = 1/3
    assert balance_penalty(history, window=4) == pytest.approx(math.sqrt(1 / 3), rel=1e-12)
    assert balance_penalty(history[:3], window=4) == 0.0  # warm-up
    assert balance_penalty(torch.tensor([[1.0, 2.0, 3.0]] * 4) + torch.arange(4.0)[:, None], window=4) == 0.0
    assert final_reward(torch.tensor([[1.0, 2.0, 3.0]]), penalty=0.4, lam=0.5).item() == pytest.approx(1.8)
    with pytest.raises(ValueError, match="even"):
        balance_penalty(history, window=5)


def test_fusion_weights_sum_to_one_and_favour_the_weakest_dimension():
    r = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    w = fusion_weights(r)
    assert torch.allclose(w.sum(1), torch.ones(2, dtype=torch.float64))
    assert int(w[0].argmax()) == 1 and torch.allclose(w[1], torch.full((3,), 1 / 3, dtype=torch.float64))
    lower = r.clone()
    lower[0, 0] -= 1.0
    assert fusion_weights(lower)[0, 0] > w[0, 0]
    s = torch.rand(2, 3, 2, 3, 3, dtype=torch.float64)
    fused = fuse_saliency(s, r)
    assert torch.allclose(fused[0], (w[0][:, None, None, None] * s[0]).sum(0))


def test_latent_grid_resize_keeps_mean_one_and_the_shape():
    s = torch.rand(2, 3, 4, 10, 12, dtype=torch.float64)
    w = intra_weight(s, torch.zeros(2, 3, dtype=torch.float64), grid=(2, 5, 6))
    assert w.shape == (2, 2, 5, 6) and bool((w > 0).all())
    assert torch.allclose(w.mean((1, 2, 3)), torch.ones(2, dtype=torch.float64))
    same = torch.rand(1, 2, 3, 3, dtype=torch.float64)
    assert torch.allclose(to_latent_grid(same, (2, 3, 3)), same / same.mean())


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="beta"):
        inter_weight(torch.zeros(2), beta=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        final_reward(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="needs the rewards"):
        intra_weight(torch.rand(1, 3, 2, 2, 2))
    with pytest.raises(ValueError, match="non-negative"):
        intra_weight(-torch.rand(1, 2, 2, 2))
    with pytest.raises(ValueError, match="floor"):
        temporal_weights(torch.rand(1, 2, 2, 2), floor=0.0)
    with pytest.raises(ValueError, match=r"\[B, D, F, H, W\]"):
        fuse_saliency(torch.rand(2, 2, 2, 2), torch.zeros(2, 2))
