"""The differentiable shapes video reward (``shapes_video``): equal to the exact verifier where both define a value,
three named dimensions, finite input gradients that land on the object, saliency on the latent grid."""

from __future__ import annotations

import math

import torch

from genrl.data.shapes import ShapeSpec, ShapesWorldConfig, caption, render
from genrl.rewards import ShapesVerifier, ShapesVideoReward, build_reward


def _videos(n: int = 6, seed: int = 0):
    world = ShapesWorldConfig()
    g = torch.Generator().manual_seed(seed)
    specs = [ShapeSpec(world.colors[i % len(world.colors)], world.shapes[i % len(world.shapes)],
                       (world.directions[i % len(world.directions)],),
                       None if world.directions[i % len(world.directions)] == "still" else list(world.speeds)[0])
             for i in range(n)]
    videos = torch.stack([render(s, world, g) for s in specs])
    return videos, [caption(s) for s in specs], specs


def test_the_dimensions_agree_with_the_exact_verifier():
    videos, prompts, _ = _videos()
    noisy = (videos + 0.15 * torch.randn(videos.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    exact, soft = ShapesVerifier(), build_reward("shapes_video")
    assert isinstance(soft, ShapesVideoReward) and soft.differentiable
    for x in (videos, noisy):
        e, s = exact(x, prompts), soft(x, prompts)
        assert torch.allclose(s["motion_quality"], e["consistency"], atol=1e-6, equal_nan=True)
        stated = torch.stack([e[k] for k in ("color", "shape", "direction", "speed", "step_following")], 1)
        ta = stated.nansum(1) / (~stated.isnan()).sum(1)
        assert torch.allclose(s["text_alignment"], ta, atol=1e-6)
        for k in ("reward", "visual_quality", "text_alignment"):
            assert bool(((s[k] >= 0) & (s[k] <= 1)).all()) and s["valid"].all(), k
    # clean renders look clean: visual quality near 1; noise lowers text alignment and visual quality on average
    clean, dirty = soft(videos, prompts), soft(noisy, prompts)
    assert float(clean["visual_quality"].min()) > 0.9
    assert float(dirty["text_alignment"].mean()) < float(clean["text_alignment"].mean())


def test_a_wrong_caption_lowers_text_alignment_not_visual_quality():
    videos, prompts, specs = _videos(4)
    world = ShapesWorldConfig()
    wrong = [caption(ShapeSpec(world.colors[(world.colors.index(s.color) + 1) % len(world.colors)], s.shape,
                               s.directions, s.speed)) for s in specs]
    soft = ShapesVideoReward()
    right, bad = soft(videos, prompts), soft(videos, wrong)
    assert torch.equal(right["visual_quality"], bad["visual_quality"])
    assert bool((bad["text_alignment"] < right["text_alignment"] - 0.1).all())


def test_saliency_is_finite_non_zero_on_the_object_and_on_the_latent_grid():
    videos, prompts, _ = _videos(3)
    x = (videos * 0.9 + 0.05).clamp(0, 1)
    soft = ShapesVideoReward()
    maps = soft.saliency(x, prompts, dims=["visual_quality", "motion_quality", "text_alignment"])
    for key, m in maps.items():
        assert m.shape == (3, 8, 16, 16) and bool(torch.isfinite(m).all()) and bool((m >= 0).all()), key
        assert float(m.sum()) > 0, key
    # the gradient lands where the object is: the brightest pixels carry most of it
    fg = x.amax(2) > x.amax(2).flatten(2).median(-1).values[..., None, None] + 0.1
    ta = maps["text_alignment"]
    assert float(ta[fg].sum()) > 0.9 * float(ta.sum())
    resized = soft.saliency(x, prompts, dims=["text_alignment"], out_shape=(4, 8, 8))["text_alignment"]
    assert resized.shape == (3, 4, 8, 8) and float(resized.sum()) > 0
    assert not any(p.grad is not None for p in soft.parameters())
    assert math.isfinite(float(soft(x, prompts)["reward"].sum()))
