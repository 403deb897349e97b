"""Stream-R1's weights (genrl.flow.stream_r1) against hand computations and the spec's invariants: beta = 0 with a flat
saliency is DMD bit for bit, weights positive with mean 1, floors held, the balance penalty by hand, fusion; the
flat-map threshold on both sides (relative and absolute parts), round-off noise flat at any scale, and its logging."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.flow.dmd import dmd_loss
from genrl.flow.stream_r1 import (
    FLAT_ATOL,
    FLAT_RTOL,
    balance_penalty,
    final_reward,
    flat_maps,
    fuse_saliency,
    fusion_weights,
    inter_weight,
    intra_weight,
    spatial_weights,
    temporal_weights,
    to_latent_grid,
)
from genrl.methods.stream_r1 import StreamR1Weighting
from genrl.rewards import RewardModel, register_reward


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


# ------------------------------------------------------------------------------------------------ flat saliency maps

F64 = torch.float64
NO_FLAT = dict(flat_rtol=0.0, flat_atol=0.0)  # only an exactly constant map is flat (genrl before the threshold)


def _pattern(seed: int = 3) -> torch.Tensor:
    """[2, 3, 4, 4] float64 in [0, 1], every frame with min exactly 0 and max exactly 1 (frame range 1)."""
    m = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(seed), dtype=F64)
    m[..., 0, 0], m[..., 0, 1] = 0.0, 1.0
    return m


def _normalised_spatial(s: torch.Tensor, floor: float = 0.15) -> torch.Tensor:
    """The min-max spatial weights by hand (strength 1): max(S_hat, floor) / frame mean."""
    lo, hi = s.amin((2, 3), keepdim=True), s.amax((2, 3), keepdim=True)
    w = torch.clamp((s - lo) / (hi - lo), min=floor)
    return w / w.mean((2, 3), keepdim=True)


def test_the_release_flat_threshold_is_kept_as_the_defaults_absolute_part():
    assert FLAT_ATOL == 1e-8 and FLAT_RTOL == 1e-6


@pytest.mark.parametrize("peak", [1.0, 1e-3, 1e4])
def test_relative_threshold_both_sides_at_any_scale(peak):
    """S = peak (1 + eps m): each frame's range is peak eps, the sample's peak is peak (1 + eps). With eps = 0.9e-6
    (range just below 1e-6 x peak) every frame and the temporal profile are flat and every weight is exactly 1; with
    eps = 1.1e-6 (just above) the frames get the min-max weights."""
    m = _pattern()
    below, above = peak * (1 + 0.9e-6 * m), peak * (1 + 1.1e-6 * m)
    for kw in (dict(flat_atol=0.0), {}):  # the relative part alone, and with the (here negligible) absolute part
        if peak < 1 and not kw:
            continue  # at peak 1e-3 the absolute 1e-8 is 1% of the range: tested on its own below
        assert bool(flat_maps(below, **kw)[1].all()) and bool(flat_maps(below, **kw)[0].all())
        assert torch.equal(intra_weight(below, **kw), torch.ones_like(below))
        assert torch.equal(spatial_weights(below, **kw), torch.ones_like(below))
        assert not bool(flat_maps(above, **kw)[1].any())
        w = spatial_weights(above, **kw)
        torch.testing.assert_close(w, _normalised_spatial(above), rtol=1e-8, atol=0)
        torch.testing.assert_close(w, spatial_weights(above, **NO_FLAT), rtol=0, atol=0)
        assert float(w.amax() / w.amin()) > 6  # full-strength contrast, not 1
    # the temporal side: constant frames whose means rise by peak eps over the clip
    ramp = torch.linspace(0, 1, 5, dtype=F64)[None, :, None, None].expand(1, 5, 3, 3)
    t_below, t_above = peak * (1 + 0.9e-6 * ramp), peak * (1 + 1.1e-6 * ramp)
    assert torch.equal(temporal_weights(t_below, flat_atol=0.0), torch.ones(1, 5, dtype=F64))
    w_t = temporal_weights(t_above, flat_atol=0.0)
    pre = torch.clamp(ramp[0, :, 0, 0], min=0.2)
    torch.testing.assert_close(w_t[0], pre / pre.mean(), rtol=1e-8, atol=0)


def test_absolute_threshold_both_sides_is_the_releases_rule():
    """flat_rtol = 0 is the release's rule: a range at most 1e-8 (absolute) is flat, whatever the map's scale."""
    m = _pattern()
    release = dict(flat_rtol=0.0)
    assert torch.equal(intra_weight(0.9e-8 * m, **release), torch.ones_like(m))
    w = spatial_weights(1.1e-8 * m, **release)
    torch.testing.assert_close(w, _normalised_spatial(m), rtol=1e-10, atol=0)
    # a map of ~1e-9 saliency is flat under the release's rule (and genrl's default), not under a pure relative one
    assert torch.equal(intra_weight(1e-9 * m), torch.ones_like(m))
    assert not torch.equal(intra_weight(1e-9 * m, flat_atol=0.0), torch.ones_like(m))


@pytest.mark.parametrize("scale", [1.0, 1e-4, 1e6])
def test_round_off_noise_in_a_flat_map_gives_weights_one(scale):
    """A flat map plus round-off noise, S = scale (1 + 1e-7 randn) (float64, and rounded to float32 as a reward
    returns it), has weight exactly 1 everywhere at any scale; normalising any positive range (flat tolerances 0, the
    earlier rule) turns the same noise into full-strength weights."""
    noise = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(5), dtype=F64)
    s = scale * (1 + 1e-7 * noise)
    assert float((s.amax() - s.amin()) / s.amax()) < 1e-6  # the noise is below the relative threshold
    for sal in (s, s.float()):
        w = intra_weight(sal)
        assert torch.equal(w, torch.ones_like(w))
        on_grid = intra_weight(sal, grid=(2, 6, 6))
        assert torch.equal(on_grid, torch.ones_like(on_grid))
        temporal, spatial = flat_maps(sal)
        assert bool(temporal.all()) and bool(spatial.all())
    noisy = intra_weight(s, **NO_FLAT)
    assert float(noisy.amax() / noisy.amin()) > 5  # pure noise weighted as strongly as a real saliency
    # the same through the per-dimension path (fused with the rewards)
    per_dim = torch.stack([s, 2 * s, 0.5 * s], 1)
    w = intra_weight(per_dim, torch.tensor([[0.1, -0.3, 0.7]] * 2, dtype=F64))
    assert torch.equal(w, torch.ones_like(w))


def test_flat_maps_marks_each_profile_and_frame_and_refuses_negative_tolerances():
    s = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(7), dtype=F64) + 0.5
    s[0, 1] = 0.8  # one constant frame
    s[1] = 2.0 + 1e-9 * torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(8), dtype=F64)  # a flat sample
    temporal, spatial = flat_maps(s)
    assert temporal.dtype == torch.bool and temporal.tolist() == [False, True]
    assert spatial.shape == (2, 3) and spatial.tolist() == [[False, True, False], [True, True, True]]
    w = intra_weight(s)
    assert torch.equal(w[1], torch.ones_like(w[1])) and not torch.equal(w[0], torch.ones_like(w[0]))
    assert torch.equal(spatial_weights(s)[0, 1], torch.ones(4, 4, dtype=F64))
    for bad in (dict(flat_rtol=-1e-6), dict(flat_atol=-1.0), dict(flat_rtol=float("nan"))):
        with pytest.raises(ValueError, match="flat_rtol and flat_atol"):
            flat_maps(s, **bad)
        with pytest.raises(ValueError, match="flat_rtol and flat_atol"):
            intra_weight(s, **bad)
    with pytest.raises(ValueError, match=r"\[B, F, H, W\]"):
        flat_maps(s[0])


@register_reward("test_nearly_flat_saliency")
class _NearlyFlat(RewardModel):
    """Linear in the pixels with per-element slopes 1 + a few float32 ulps: its saliency is flat up to round-off."""

    differentiable = True
    dimensions = ("reward", "a", "b", "c")
    channels = (3,)

    def score(self, pixels, prompts, **meta):
        g = torch.Generator().manual_seed(11)
        slope = (1 + 3e-7 * torch.rand(pixels.shape[1:], generator=g)).to(pixels.dtype)  # 1 .. 1 + 2 ulps
        m = (pixels * slope).mean(dim=(1, 2, 3, 4))
        return {"reward": m, "a": m, "b": 2 * m, "c": 3 * m}


class _FakeDMD:
    """What StreamR1Weighting needs of the DMD method: a generator that decodes (identity), a device, log_dict."""

    trainer = None
    device = torch.device("cpu")

    def __init__(self):
        self.generator = type("G", (), {"frame_dim": 1, "decode": staticmethod(lambda x: x)})()
        self.logged: dict = {}

    def log_dict(self, stats, batch_size):
        self.logged = dict(stats)


def test_the_weighting_gives_one_on_a_nearly_flat_saliency_and_logs_the_flat_fractions():
    x = torch.rand(2, 3, 3, 4, 4, generator=torch.Generator().manual_seed(2))  # [B, T, C, H, W] in [0, 1]
    method, prompts = _FakeDMD(), ["a", "b"]

    def weighting(**kw):
        w = StreamR1Weighting(reward={"name": "test_nearly_flat_saliency"}, dimensions=["a", "b", "c"], beta=0.0,
                              **kw)
        return w(x, x, x, torch.tensor([0, 1]), prompts=prompts, method=method), w.last

    w, last = weighting()
    assert w.shape == (2, 3, 1, 4, 4) and torch.equal(w, torch.ones_like(w))
    assert last["stream_r1/flat_temporal"] == 1.0 and last["stream_r1/flat_spatial"] == 1.0
    assert method.logged["stream_r1/flat_spatial"] == 1.0
    w, last = weighting(**NO_FLAT)  # the earlier rule: the round-off is normalised to full-strength weights
    assert float(w.amax() / w.amin()) > 2
    assert last["stream_r1/flat_temporal"] == 0.0 and last["stream_r1/flat_spatial"] == 0.0
    _, last = weighting(intra=False)
    assert "stream_r1/flat_spatial" not in last
    with pytest.raises(ValueError, match="flat_rtol and flat_atol"):
        StreamR1Weighting(flat_atol=-1e-8)
