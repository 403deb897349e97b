"""Gold metrics (genrl/eval/gold.py) on hand-built videos, the pixel Frechet distance, the true shapes videos, and the
planted-hack rewards (``brightness``, ``shapes`` with ``attributes``); values in closed form or float64."""

from __future__ import annotations

import math

import pytest
import torch

from genrl.data.shapes import ShapesWorldConfig, parse_caption, render
from genrl.eval.dimensions import TemporalFlickering
from genrl.eval.dimensions.flicker import flicker_pair_mae, flicker_score
from genrl.eval.gold import (
    PixelFD,
    batch_diversity,
    frame_statistics,
    gold_metrics,
    pairwise_rms,
    real_videos,
    temporal_flicker,
    within_prompt_diversity,
)
from genrl.noise import sample_generator
from genrl.rewards import build_reward


def solid(values, t: int = 4, h: int = 5, w: int = 6) -> torch.Tensor:
    """One video per RGB triple: every pixel of every frame that colour, [N, T, 3, H, W] float64."""
    rgb = torch.tensor(values, dtype=torch.float64)
    return rgb[:, None, :, None, None].expand(len(values), t, 3, h, w).clone()


# ----------------------------------------------------------------------------------------------- frame statistics
def test_frame_statistics_closed_form_on_solid_and_black_videos():
    stats = frame_statistics(solid([(0.2, 0.4, 0.6), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)]))
    assert stats["brightness"].dtype == torch.float64 and stats["brightness"].shape == (3,)
    assert stats["brightness"][0].item() == pytest.approx(0.299 * 0.2 + 0.587 * 0.4 + 0.114 * 0.6, abs=1e-15)
    assert stats["saturation"][0].item() == pytest.approx((0.6 - 0.2) / 0.6, abs=1e-15)
    assert stats["brightness"][1].item() == 0.0 and stats["saturation"][1].item() == 0.0  # black: 0, not NaN
    assert stats["brightness"][2].item() == pytest.approx(1.0, abs=1e-15) and stats["saturation"][2].item() == 0.0
    assert stats["constant_frames"].tolist() == [1.0, 1.0, 1.0]  # solid frames are constant


def test_constant_frames_fraction_and_threshold():
    video = solid([(0.5, 0.5, 0.5)], t=4, h=4, w=4)
    checker = (torch.arange(4)[:, None] + torch.arange(4)[None, :]) % 2 * 2.0 - 1.0  # +-1, std exactly 1
    video[0, 1] += 0.01 * checker  # pixel std 0.01: near-constant under 0.02, not under 0.005
    video[0, 2] += 0.2 * checker  # std 0.2: never constant
    video[0, 3] += 0.2 * checker
    assert frame_statistics(video)["constant_frames"].item() == 0.5
    assert frame_statistics(video, constant_std=0.005)["constant_frames"].item() == 0.25
    saturation_of_a_grey_checker = 0.0
    assert frame_statistics(video)["saturation"].item() == saturation_of_a_grey_checker


def test_input_checks():
    with pytest.raises(ValueError, match=r"\[N, T, 3, H, W\]"):
        frame_statistics(torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError, match="NaN or inf"):
        frame_statistics(torch.full((1, 2, 3, 2, 2), math.nan))
    with pytest.raises(ValueError, match="at least 2 frames"):
        temporal_flicker(torch.zeros(1, 1, 3, 2, 2))
    with pytest.raises(TypeError):
        batch_diversity([[0.0]])
    with pytest.raises(ValueError, match="prompts"):
        within_prompt_diversity(torch.zeros(2, 2, 3, 2, 2), ["a"])


# ----------------------------------------------------------------------------------------------- flicker
def test_temporal_flicker_vbench_formula_on_a_known_sequence():
    levels = torch.tensor([0.0, 10.0, 30.0, 30.0]) / 255.0  # frame t all one grey level: pair MAEs 10, 20, 0
    video = levels[None, :, None, None, None].expand(1, 4, 3, 3, 3).clone()
    assert temporal_flicker(video).item() == pytest.approx((255.0 - 10.0) / 255.0, abs=1e-15)
    assert temporal_flicker(solid([(0.3, 0.1, 0.9)])).item() == 1.0  # static: exactly 1


def test_temporal_flicker_equals_the_vbench_dimension_on_uint8_frames():
    g = torch.Generator().manual_seed(0)
    videos = torch.rand(3, 5, 3, 8, 8, generator=g)
    ours = temporal_flicker(videos)
    dim = TemporalFlickering()
    for video, value in zip(videos, ours):
        frames = (video * 255).round().to(torch.uint8)
        assert dim.score_video(frames, 8.0).value == value.item()
    frames = (videos * 255).round()
    assert torch.equal(flicker_score(frames), ours)  # the shared function, batched
    assert flicker_pair_mae(frames).shape == (3, 4)


# ----------------------------------------------------------------------------------------------- diversity
def test_pairwise_rms_and_batch_diversity_closed_form():
    videos = solid([(0.0, 0.0, 0.0), (0.3, 0.3, 0.3), (0.5, 0.5, 0.5)])
    d = pairwise_rms(videos)
    expected = torch.tensor([[0.0, 0.3, 0.5], [0.3, 0.0, 0.2], [0.5, 0.2, 0.0]], dtype=torch.float64)
    assert torch.allclose(d, expected, atol=1e-15, rtol=0)
    assert batch_diversity(videos) == pytest.approx((0.3 + 0.5 + 0.2) / 3, abs=1e-15)
    assert batch_diversity(videos[:1]) != batch_diversity(videos[:1])  # one video: NaN
    assert batch_diversity(videos[[1, 1, 1]]) == 0.0  # identical videos: exactly 0


def test_within_prompt_diversity_groups_by_prompt():
    videos = solid([(0.0,) * 3, (0.3,) * 3, (0.1,) * 3, (0.2,) * 3, (0.9,) * 3])
    prompts = ["p", "p", "q", "q", "r"]  # p: 0.3 apart, q: 0.1 apart, r alone (ignored)
    assert within_prompt_diversity(videos, prompts) == pytest.approx((0.3 + 0.1) / 2, abs=1e-15)
    # a prompt with three samples counts once, with the mean of its three pairs
    three = solid([(0.0,) * 3, (0.3,) * 3, (0.5,) * 3, (0.1,) * 3, (0.2,) * 3])
    assert within_prompt_diversity(three, ["a", "a", "a", "b", "b"]) == pytest.approx(
        ((0.3 + 0.5 + 0.2) / 3 + 0.1) / 2, abs=1e-15)
    assert math.isnan(within_prompt_diversity(videos, ["a", "b", "c", "d", "e"]))


# ----------------------------------------------------------------------------------------------- PixelFD
def test_pixel_fd_self_zero_symmetric_and_a_known_shift():
    g = torch.Generator().manual_seed(1)
    reference = torch.rand(64, 2, 3, 4, 4, generator=g)
    fd = PixelFD(reference, dims=6)
    a = torch.rand(40, 2, 3, 4, 4, generator=g)
    b = torch.rand(40, 2, 3, 4, 4, generator=g) * 0.8
    assert abs(fd.distance(a, a)) < 1e-9
    assert fd.distance(a, b) == pytest.approx(fd.distance(b, a), rel=1e-9)
    assert fd.distance(a, b) > 0.1
    # shifting every video by m along a principal axis moves the mean by m and nothing else: fd = m^2
    axis = fd.basis[:, 0].reshape(2, 3, 4, 4)
    assert fd.distance(a, a + 0.5 * axis) == pytest.approx(0.25, abs=1e-9)
    with pytest.raises(ValueError, match="at least 2"):
        PixelFD(reference[:1])


# ----------------------------------------------------------------------------------------------- real videos
def test_real_videos_render_parsed_captions_with_addressed_generators():
    world = ShapesWorldConfig()
    prompts = ["a red circle moving left slowly", "a blue square staying still"]
    videos = real_videos(world, prompts, seed=7)
    assert videos.shape == (2, world.num_frames, 3, world.height, world.width) and videos.dtype == torch.float32
    for i, p in enumerate(prompts):
        assert torch.equal(videos[i], render(parse_caption(p, world), world, sample_generator(7, i, 0, 99)))
    assert torch.equal(real_videos(world, prompts, seed=7), videos)
    assert not torch.equal(real_videos(world, prompts, seed=8), videos)
    assert real_videos(world, [], seed=0).shape == (0, world.num_frames, 3, world.height, world.width)


# ----------------------------------------------------------------------------------------------- gold_metrics
def test_gold_metrics_keys_and_values():
    videos = solid([(0.2, 0.4, 0.6), (0.0, 0.0, 0.0), (0.2, 0.4, 0.6)])
    out = gold_metrics(videos, ["a", "b", "c"])
    assert set(out) == {"brightness", "saturation", "constant_frames", "flicker", "diversity_batch"}
    assert out["brightness"] == pytest.approx(2 * (0.299 * 0.2 + 0.587 * 0.4 + 0.114 * 0.6) / 3, abs=1e-15)
    assert out["flicker"] == 1.0 and out["constant_frames"] == 1.0
    rms = math.sqrt((0.2**2 + 0.4**2 + 0.6**2) / 3)
    assert out["diversity_batch"] == pytest.approx(2 * rms / 3, abs=1e-15)  # pairs: rms, 0, rms
    out = gold_metrics(videos, ["a", "b", "a"])  # "a" twice: within-prompt diversity, identical samples
    assert "diversity_batch" not in out and out["diversity_within_prompt"] == 0.0

    levels = torch.tensor([0.0, 51.0, 0.0, 51.0]) / 255.0  # flicker 1 - 51/255 = 0.8
    real = levels[None, :, None, None, None].expand(3, 4, 3, 5, 6).clone()
    fd = PixelFD(torch.rand(16, 4, 3, 5, 6, generator=torch.Generator().manual_seed(0)), dims=4)
    out = gold_metrics(videos, ["a", "b", "c"], real=real, fd=fd)
    assert out["flicker_gap"] == pytest.approx(0.2, abs=1e-15)
    assert out["fd"] == pytest.approx(fd.distance(videos, real), abs=1e-12)
    assert "fd" not in gold_metrics(videos, ["a", "b", "c"], real=real)
    with pytest.raises(ValueError, match="shape of the generated"):
        gold_metrics(videos, ["a", "b", "c"], real=real[:2])


# ----------------------------------------------------------------------------------------------- planted hacks
def test_brightness_reward_bright_and_dark():
    videos = solid([(0.2, 0.4, 0.6), (1.0, 0.0, 0.0)]).float()
    luma = torch.tensor([0.299 * 0.2 + 0.587 * 0.4 + 0.114 * 0.6, 0.299])
    bright = build_reward("brightness")(videos, ["", ""])
    assert torch.allclose(bright["reward"], luma, atol=1e-6) and torch.allclose(bright["brightness"], luma, atol=1e-6)
    dark = build_reward("brightness", mode="dark", scale=2.0)(videos, ["", ""])
    assert torch.allclose(dark["reward"], 2.0 * (1.0 - luma), atol=1e-6)
    assert torch.allclose(dark["brightness"], luma, atol=1e-6)
    with pytest.raises(ValueError, match="mode"):
        build_reward("brightness", mode="dim")


def test_shapes_verifier_single_attribute_reward():
    world = ShapesWorldConfig()
    prompts = ["a red circle moving left slowly", "a blue square staying still"]
    videos = real_videos(world, prompts, seed=0)
    videos[0] = videos[0].roll(1, dims=0)  # scramble frame order: the direction / speed scores change
    full = build_reward("shapes")(videos, prompts)
    color = build_reward("shapes", attributes=["color"])(videos, prompts)
    assert torch.equal(color["reward"], full["color"])
    for key in ("color", "shape", "direction", "consistency"):
        assert torch.allclose(color[key], full[key], atol=0, rtol=0, equal_nan=True)  # the other keys unchanged
    speed = build_reward("shapes", attributes=["speed", "color"])(videos, prompts)
    assert speed["reward"][0].item() == pytest.approx((full["speed"][0] + full["color"][0]).item() / 2, abs=1e-6)
    assert speed["reward"][1].item() == pytest.approx(full["color"][1].item(), abs=1e-6)  # no speed when still
    only_speed = build_reward("shapes", attributes=["speed"])(videos, prompts)
    assert only_speed["valid"].tolist() == [True, False]  # nothing applies to the still caption: NaN, invalid
    with pytest.raises(ValueError, match="subset"):
        build_reward("shapes", attributes=["colour"])
