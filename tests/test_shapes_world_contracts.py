"""Contracts of the procedural shapes world (genrl.data.shapes) that its mutation survivors showed untested (issue 51):
the config's validation bounds (inclusive where documented), ShapeSpec's invariants, the exact float64 trajectory and
its turn points, closed-shape supersampled coverage, renders that do not depend on torch's default dtype, start
ranges and the torus reduction of render_at, position_error's dtype / device, centroid_path's argument checks, the
image-mode splits, caption parsing of malformed segments, held-out prompts and real videos (their draw addresses)
and sample_spec's draws (default split, strict multi-step threshold, its generator only)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from genrl.data.shapes import (
    ShapeSpec,
    ShapesWorldConfig,
    centroid_path,
    combos,
    heldout_combos,
    heldout_prompts,
    is_heldout,
    parse_caption,
    position_error,
    real_videos,
    render,
    render_at,
    sample_seed,
    sample_spec,
    start_position,
    trajectory,
    turn_points,
)
from genrl.noise import sample_generator, stream_id

WORLD = ShapesWorldConfig()
IMAGE = ShapesWorldConfig(num_frames=1, shapes=["circle", "square", "triangle", "diamond"])


# ---------------------------------------------------------------------------------------------- config validation
def test_config_int_fields_refuse_floats_and_bools():
    """height / width / num_frames must be ints: a float or a bool is refused (bool is an int subclass)."""
    with pytest.raises(ValueError, match="must be an int"):
        ShapesWorldConfig(height=16.0)
    with pytest.raises(ValueError, match="must be an int"):
        ShapesWorldConfig(num_frames=True)


def test_config_frame_at_least_4x4_inclusive():
    """Frames of 4 pixels per side are allowed; 3 in either dimension alone is refused."""
    ok = ShapesWorldConfig(height=4, width=16, num_frames=1, object_size=2.0)
    assert (ok.height, ok.width) == (4, 16)
    assert ShapesWorldConfig(height=16, width=4, num_frames=1, object_size=2.0).width == 4
    for h, w in ((3, 16), (16, 3)):
        with pytest.raises(ValueError, match="at least 4x4"):
            ShapesWorldConfig(height=h, width=w, num_frames=1, object_size=2.0)


def test_config_object_size_closed_range():
    """object_size may be exactly 2 and exactly min(height, width); just outside either end is refused."""
    assert ShapesWorldConfig(object_size=2.0).object_size == 2.0
    assert ShapesWorldConfig(num_frames=1, object_size=16.0).object_size == 16.0
    for size in (1.99, 16.01):
        with pytest.raises(ValueError, match="does not fit"):
            ShapesWorldConfig(num_frames=1, object_size=size)


def test_config_probability_ranges():
    """multi_step_prob is in [0, 1] and heldout_fraction in [0, 0.5], both ends included."""
    assert ShapesWorldConfig(multi_step_prob=1.0).multi_step_prob == 1.0
    assert ShapesWorldConfig(heldout_fraction=0.5).heldout_fraction == 0.5
    with pytest.raises(ValueError, match="multi_step_prob"):
        ShapesWorldConfig(multi_step_prob=1.5)
    with pytest.raises(ValueError, match="heldout_fraction"):
        ShapesWorldConfig(heldout_fraction=0.7)


def test_config_speeds_positive_and_finite():
    """A zero speed is refused (speeds are > 0 px/frame), and so is an infinite one on a wrap world (no travel check
    there to catch it)."""
    with pytest.raises(ValueError, match="finite and > 0"):
        ShapesWorldConfig(speeds={"slow": 0.0})
    with pytest.raises(ValueError, match="finite and > 0"):
        ShapesWorldConfig(speeds={"slow": 0.6, "fast": math.inf}, boundary="wrap")


def test_config_travel_check_is_exact():
    """An 'inside' world allows a path of exactly the frame: (T - 1) * max(speeds) + object_size == side (11 frames
    at 1 px/frame, 6 px object, 16 px frame); one frame more than fits (10 frames at 1.2: 16.8 px) is refused."""
    exact = ShapesWorldConfig(num_frames=11, speeds={"slow": 0.5, "fast": 1.0})
    assert exact.num_frames == 11
    with pytest.raises(ValueError, match="leaves a 16x16 frame"):
        ShapesWorldConfig(num_frames=10)


def test_config_multi_step_needs_two_directions_exactly():
    """Two directions are enough for multi-step captions; one is refused."""
    cfg = ShapesWorldConfig(directions=["left", "right"], multi_step_prob=0.5)
    assert cfg.directions == ["left", "right"]
    with pytest.raises(ValueError, match="at least two directions"):
        ShapesWorldConfig(directions=["left"], multi_step_prob=0.5)


# ---------------------------------------------------------------------------------------------- ShapeSpec
def test_shapespec_directions_become_a_hashable_tuple():
    """A list of directions is stored as a tuple, so specs are hashable and equal to their tuple-built twin."""
    spec = ShapeSpec("red", "circle", ["left", "up"])
    assert isinstance(spec.directions, tuple) and spec.directions == ("left", "up")
    assert spec == ShapeSpec("red", "circle", ("left", "up"))
    assert hash(spec) == hash(ShapeSpec("red", "circle", ("left", "up")))


@pytest.mark.parametrize("directions", [("left", "up"), ("still",), ()])
def test_shapespec_speed_only_for_one_moving_segment(directions):
    """A speed is refused with several segments, with a still segment and with no motion."""
    with pytest.raises(ValueError, match="only applies to a single moving segment"):
        ShapeSpec("red", "circle", directions, "slow")


def test_shapespec_speed_allowed_for_one_moving_segment():
    """A single moving segment takes a speed."""
    assert ShapeSpec("red", "circle", ("left",), "slow").speed == "slow"


# ---------------------------------------------------------------------------------------------- trajectory
def test_turn_points_clamped_for_short_paths():
    """With fewer frames than segments the turns are the spans of num_segments frames clamped to [0, T - 1]:
    T = 1 -> [0, 0], T = 2 -> [0, 1]; with enough frames they are the span ends - 1 (8 frames: [2, 5])."""
    assert turn_points(1, 3) == [0.0, 0.0]
    assert turn_points(2, 3) == [0.0, 1.0]
    assert turn_points(8, 3) == [2.0, 5.0]
    assert turn_points(8, 1) == [] and turn_points(8, 2) == [3.5]


def test_trajectory_is_the_float64_closed_form_rounded_once():
    """trajectory is p(t) = v t u (one segment) and v (min(t, m) u1 + max(t - m, 0) u2) (two, m = (T - 1) / 2),
    computed in float64 and rounded once to float32: bitwise equal to that reference (slow 0.6 px/frame, where a
    float32 product would differ in the last bit)."""
    t = torch.arange(8, dtype=torch.float64)
    left = (0.6 * t[:, None] * torch.tensor([-1.0, 0.0], dtype=torch.float64)).float()
    got = trajectory(ShapeSpec("red", "circle", ("left",), "slow"), WORLD)
    assert got.dtype == torch.float32 and torch.equal(got, left)
    m, v = 3.5, 0.9
    two = v * (t.clamp(max=m)[:, None] * torch.tensor([1.0, 0.0], dtype=torch.float64)
               + (t - m).clamp(min=0)[:, None] * torch.tensor([0.0, -1.0], dtype=torch.float64))
    assert torch.equal(trajectory(ShapeSpec("red", "circle", ("right", "up")), WORLD), two.float())


def test_trajectory_of_a_motionless_spec_is_zero_per_frame():
    """A spec with no motion (a caption "a red circle" in a video world) stays put: zero offsets [T, 2] for every
    frame, in video and in image mode, and its render repeats frame 0 T times."""
    spec = ShapeSpec("red", "circle")
    assert torch.equal(trajectory(spec, WORLD), torch.zeros(8, 2))
    assert torch.equal(trajectory(spec, IMAGE), torch.zeros(1, 2))
    video = render_at(spec, WORLD, (8.0, 8.0))
    assert video.shape == (8, 3, 16, 16) and torch.equal(video, video[:1].expand_as(video))


def test_two_segment_spec_renders_on_three_frames():
    """The two-frames-per-segment rule is for three segments only: a two-segment spec renders on 3 frames, turning at
    frame (T - 1) / 2 = 1 (mean speed 0.9: frame 1 is 0.9 right, frame 2 also 0.9 down)."""
    cfg = ShapesWorldConfig(num_frames=3, multi_step_prob=0.0)
    spec = ShapeSpec("red", "square", ("right", "down"))
    video = render_at(spec, cfg, (5.0, 5.0))
    assert video.shape == (3, 3, 16, 16)
    expected = torch.tensor([[5.0, 5.0], [5.9, 5.0], [5.9, 5.9]], dtype=torch.float64).float()
    assert torch.allclose(centroid_path(spec, cfg, (5.0, 5.0)), expected, atol=1e-6)


# ---------------------------------------------------------------------------------------------- rendering
def _closed_shape_reference(shape: str, cx: float, cy: float, size: float, height: int, width: int) -> np.ndarray:
    """Fraction of the 4x4 supersample points ((j + 0.5) / 4) of each pixel inside the closed shape, float64."""
    xs = (np.arange(width * 4) + 0.5) / 4
    ys = (np.arange(height * 4) + 0.5) / 4
    dx, dy = xs[None, :] - cx, ys[:, None] - cy
    h = size / 2
    if shape == "circle":
        inside = np.hypot(dx, dy) <= h
    elif shape == "square":
        inside = np.maximum(np.abs(dx), np.abs(dy)) <= h
    elif shape == "triangle":  # apex (0, -h), base corners (+-h, h): the base line and the two slanted edges
        inside = (dy <= h) & (2 * dx - dy <= h) & (-2 * dx - dy <= h)
    else:  # diamond
        inside = np.abs(dx) + np.abs(dy) <= h
    return inside.astype(np.float64).reshape(height, 4, width, 4).mean(axis=(1, 3))


@pytest.mark.parametrize("shape", ["circle", "square", "triangle", "diamond"])
def test_coverage_is_closed_shape_supersampling(shape):
    """Each pixel's coverage is the fraction of its 4x4 supersample points inside the closed shape (boundary points
    count). Centered at (8.125, 8.125), a 6 px shape has supersample points exactly on its boundary (e.g. (11.125,
    8.125) on the circle), so an open shape would differ."""
    got = render_at(ShapeSpec("red", shape), IMAGE, (8.125, 8.125))
    ref = torch.from_numpy(_closed_shape_reference(shape, 8.125, 8.125, 6.0, 16, 16)).float()
    assert torch.equal(got[0, 0], ref)
    assert torch.equal(got[0, 1:], torch.zeros(2, 16, 16))


def test_render_at_is_float32_whatever_the_default_dtype():
    """render_at is a pure function of its arguments: under torch.set_default_dtype(float64) it returns the same
    float32 pixels. The start (0.125 - 2^-27, same y) puts a supersample point at float32 distance exactly 3 (the
    square's half side) but float64 distance 3 + 2^-27, so computing any position in float64 changes the pixels."""
    cfg = ShapesWorldConfig(num_frames=1, shapes=["square"], boundary="wrap")
    spec, start = ShapeSpec("red", "square"), (0.125 - 2.0**-27, 0.125 - 2.0**-27)
    ref = render_at(spec, cfg, start)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = render_at(spec, cfg, start)
    finally:
        torch.set_default_dtype(old)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    # the boundary point is in: of pixel (row 3, col 3) only the sample (3.125, 3.125), at float32 offset (3, 3)
    assert float(ref[0, 0, 3, 3]) == 1 / 16 and float(ref[0, 0, 0, 0]) == 1.0


def test_render_at_wrap_takes_the_start_modulo_the_frame():
    """On a wrap world any start is taken modulo the frame: (2^24 + 8, 2^20 + 5.5) and (-8, -10.5) render exactly as
    (8, 5.5) (a far start is reduced before the supersample offsets are formed)."""
    cfg = ShapesWorldConfig(boundary="wrap")
    spec = ShapeSpec("green", "triangle", ("still",))
    ref = render_at(spec, cfg, (8.0, 5.5))
    assert torch.equal(render_at(spec, cfg, (2.0**24 + 8.0, 2.0**20 + 5.5)), ref)
    assert torch.equal(render_at(spec, cfg, (-8.0, -10.5)), ref)


def test_render_at_inside_range_is_inclusive():
    """On an 'inside' world render_at accepts starts exactly at both ends of the allowed range (low = h - min offset,
    high = size - h - max offset) and refuses starts 0.5 px beyond either end, on each axis."""
    spec = ShapeSpec("red", "square", ("left",), "fast")
    off = trajectory(spec, WORLD)
    low_x = float(3.0 - off[:, 0].min())  # 3 + 8.4: the last frame's box touches the left edge
    video = render_at(spec, WORLD, (low_x, 3.0))
    assert float(video[-1, 0, 3, 0]) > 0.9 and float(video[0, 0, 3, 0]) == 0.0
    render_at(spec, WORLD, (13.0, 13.0))  # high end on both axes
    for bad in ((low_x - 0.5, 8.0), (13.5, 8.0), (12.0, 2.5), (12.0, 13.5)):
        with pytest.raises(ValueError, match="outside the 16x16 frame"):
            render_at(spec, WORLD, bad)


@pytest.mark.parametrize("start", [(float("nan"), 5.0), (5.0, 5.0, 5.0)])
def test_start_must_be_two_finite_numbers(start):
    """render_at and centroid_path refuse a start that is not two finite numbers."""
    spec = ShapeSpec("red", "circle", ("still",))
    with pytest.raises(ValueError, match="two finite numbers"):
        render_at(spec, ShapesWorldConfig(boundary="wrap"), start)
    with pytest.raises(ValueError, match="two finite numbers"):
        centroid_path(spec, WORLD, start)


def test_exact_fit_world_starts_at_the_only_position():
    """When the path spans the whole frame on an axis (11 frames at 1 px/frame, 6 px object, 16 px) the start on that
    axis is the only one, low = 3, with no random offset; the other axis is low + room * u with the same uniform draw
    (room 10)."""
    cfg = ShapesWorldConfig(num_frames=11, speeds={"slow": 0.5, "fast": 1.0})
    spec = ShapeSpec("blue", "circle", ("right",), "fast")
    g = torch.Generator().manual_seed(5)
    u = torch.rand(2, generator=torch.Generator().manual_seed(5))
    start = start_position(spec, cfg, g)
    assert float(start[0]) == 3.0
    assert float(start[1]) == pytest.approx(3.0 + 10.0 * float(u[1]), abs=1e-6)
    video = render(spec, cfg, torch.Generator().manual_seed(5))
    assert torch.equal(video, render_at(spec, cfg, start))


def test_render_refuses_a_path_that_no_longer_fits():
    """A config changed after validation so that the path leaves the frame by 0.5 px (11 frames at 1.05 px/frame) is
    refused by render instead of drawing the object clipped."""
    cfg = ShapesWorldConfig(num_frames=11, speeds={"fast": 1.0})
    cfg.speeds = {"fast": 1.05}
    with pytest.raises(ValueError, match="does not fit"):
        render(ShapeSpec("red", "circle", ("right",), "fast"), cfg, torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------- positions
def test_position_error_refuses_non_pairs():
    """Both position tensors must have a last axis of 2, even when the other one broadcasts."""
    with pytest.raises(ValueError, match=r"\[\.\.\., 2\]"):
        position_error(torch.zeros(3, 2), torch.zeros(3, 1), WORLD)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2\]"):
        position_error(torch.zeros(3, 1), torch.zeros(3, 2), WORLD)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_position_error_keeps_dtype_on_a_torus(dtype):
    """On a wrap world the error comes back in a's dtype: (1, 1) vs (15, 1) on a 16-wide torus is 2 px."""
    cfg = ShapesWorldConfig(boundary="wrap")
    got = position_error(torch.tensor([[1.0, 1.0]], dtype=dtype), torch.tensor([[15.0, 1.0]], dtype=dtype), cfg)
    assert got.dtype == dtype and got.tolist() == [2.0]


def test_position_error_keeps_device_on_a_torus():
    """The period is put on the positions' device (checked with the meta device)."""
    a = torch.zeros(4, 3, 2, device="meta")
    got = position_error(a, a, ShapesWorldConfig(boundary="wrap"))
    assert got.device.type == "meta" and got.shape == (4, 3)


def test_centroid_path_num_frames_is_a_positive_int():
    """num_frames = 1 gives the start plus the centroid shift (triangle: object_size / 6 = 1 px down); 0, a bool or a
    float is refused."""
    spec = ShapeSpec("red", "triangle", ("left",), "slow")
    assert torch.equal(centroid_path(spec, WORLD, (8.0, 8.0), num_frames=1), torch.tensor([[8.0, 9.0]]))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_frames must be an int"):
            centroid_path(spec, WORLD, (8.0, 8.0), num_frames=bad)


def test_centroid_path_is_float32_for_a_float64_start():
    """centroid_path returns float32 [T, 2] also for a float64 start (it reads the start as float32)."""
    spec = ShapeSpec("red", "circle", ("right",), "slow")
    got = centroid_path(spec, WORLD, torch.tensor([4.0, 5.0], dtype=torch.float64))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.tensor([4.0, 5.0]) + trajectory(spec, WORLD))


# ---------------------------------------------------------------------------------------------- splits
def test_image_mode_combos_and_heldout_have_no_direction():
    """In image mode a combination is (color, shape, None): 6 x 3 of them, round(0.15 * 18) = 3 held out while every
    color and shape keeps a training combination; is_heldout ignores a spec's directions there."""
    img = ShapesWorldConfig(num_frames=1)
    all_combos = combos(img)
    assert len(all_combos) == 18 and all(d is None for _, _, d in all_combos)
    held = heldout_combos(img)
    assert len(held) == 3 and all(d is None for _, _, d in held)
    train = [c for c in all_combos if c not in held]
    assert {c for c, _, _ in train} == set(img.colors) and {s for _, s, _ in train} == set(img.shapes)
    c, s, _ = held[0]
    assert is_heldout(ShapeSpec(c, s), img) and is_heldout(ShapeSpec(c, s, ("left",)), img)


def test_is_heldout_of_a_motionless_video_spec():
    """In a video world a spec with no motion has no (color, shape, direction) combination: never held out."""
    assert all(not is_heldout(ShapeSpec(c, s), WORLD) for c, s, _ in heldout_combos(WORLD))


# ---------------------------------------------------------------------------------------------- captions
@pytest.mark.parametrize(
    "text", ["a red circle moves right, and moves up", "a red circle moves right, then moves still"]
)
def test_parse_caption_rejects_malformed_segments(text):
    """Every segment after the first is joined by ', then', and a still segment reads 'stays still' (never
    'moves still')."""
    with pytest.raises(ValueError, match="malformed caption"):
        parse_caption(text)


def test_parse_caption_reads_a_stays_still_segment():
    """'..., then stays still' parses to a still second segment."""
    assert parse_caption("a red circle moves right, then stays still").directions == ("right", "still")


# ---------------------------------------------------------------------------------------------- held-out prompts
def test_heldout_prompts_zero_and_default_seed():
    """n = 0 gives no prompt; the default seed is 0 (seed 1 gives another order)."""
    assert heldout_prompts(WORLD, 0) == []
    assert heldout_prompts(WORLD, 7) == heldout_prompts(WORLD, 7, seed=0) != heldout_prompts(WORLD, 7, seed=1)


def test_heldout_prompts_cover_the_heldout_combos_with_speeds():
    """n prompts visit every held-out combination n // k or n // k + 1 times (k of them); moving captions state one
    of the world's speeds, still ones none."""
    held = heldout_combos(WORLD)
    n = 2 * len(held) + 3
    specs = [parse_caption(p, WORLD) for p in heldout_prompts(WORLD, n, seed=3)]
    counts = {c: 0 for c in held}
    for spec in specs:
        counts[(spec.color, spec.shape, spec.directions[0])] += 1
        assert len(spec.directions) == 1
        if spec.directions[0] == "still":
            assert spec.speed is None
        else:
            assert spec.speed in WORLD.speeds
    assert set(counts.values()) <= {2, 3} and sum(counts.values()) == n
    assert any(s.directions[0] != "still" for s in specs)


def test_heldout_prompts_in_image_mode():
    """In image mode held-out prompts are "a <color> <shape>" captions of the held-out (color, shape) pairs."""
    img = ShapesWorldConfig(num_frames=1)
    held = heldout_combos(img)
    prompts = heldout_prompts(img, len(held))
    assert all(isinstance(p, str) for p in prompts)
    assert sorted((parse_caption(p, img).color, parse_caption(p, img).shape, None) for p in prompts) == sorted(held)
    assert all(parse_caption(p, img).directions == () and len(p.split()) == 3 for p in prompts)


def test_heldout_prompts_draw_address():
    """The held-out prompts' order is the permutation drawn from the generator of sample_seed(seed, -1) (validation's
    index, apart from every training sample's index >= 0)."""
    held = heldout_combos(WORLD)
    g = torch.Generator("cpu").manual_seed(sample_seed(4, -1))
    order = torch.randperm(len(held), generator=g).tolist()
    specs = [parse_caption(p, WORLD) for p in heldout_prompts(WORLD, len(held), seed=4)]
    assert [(s.color, s.shape, s.directions[0]) for s in specs] == [held[i] for i in order]


# ---------------------------------------------------------------------------------------------- real videos
def test_real_videos_of_no_prompt():
    """No prompt gives an empty float32 [0, T, 3, H, W] (non-square world: H = 12, W = 20)."""
    cfg = ShapesWorldConfig(height=12, width=20, num_frames=5)
    out = real_videos(cfg, [], seed=0)
    assert out.shape == (0, 5, 3, 12, 20) and out.dtype == torch.float32


def test_real_videos_render_address():
    """Video i is render(parse_caption(prompt_i, config), config, sample_generator(seed, i, 0, 99)) (stream 99,
    data.shapes_render), parsed with the world's own vocabulary (a white diamond is not in the default world); a
    repeated prompt gets a fresh start; the global RNG is neither used nor advanced."""
    assert stream_id("data.shapes_render") == 99
    cfg = ShapesWorldConfig(colors=["red", "white"], shapes=["circle", "diamond"])
    diamond = "a white diamond moving left quickly"
    prompts = [diamond, "a red circle staying still", diamond]
    state = torch.get_rng_state()
    out = real_videos(cfg, prompts, seed=11)
    assert torch.equal(torch.get_rng_state(), state)
    assert out.shape == (3, 8, 3, 16, 16)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i], render(parse_caption(p, cfg), cfg, sample_generator(11, i, 0, 99)))
    assert not torch.equal(out[0], out[2])


# ---------------------------------------------------------------------------------------------- sample_spec
def test_sample_spec_default_split_is_train():
    """sample_spec's default split is "train": the same spec as split="train", never a held-out combination."""
    for seed in range(6):
        spec = sample_spec(WORLD, torch.Generator().manual_seed(seed))
        assert spec == sample_spec(WORLD, torch.Generator().manual_seed(seed), "train")
        assert not is_heldout(spec, WORLD)


def test_sample_spec_draws_only_from_its_generator():
    """With max_segments = 3, multi-step specs (and their segment count / third direction) are a pure function of the
    generator: the global RNG is neither read nor advanced, and both 2- and 3-segment specs occur."""
    cfg = ShapesWorldConfig(max_segments=3, multi_step_prob=1.0)
    state = torch.get_rng_state()
    specs = [sample_spec(cfg, torch.Generator().manual_seed(s), multi_step=True) for s in range(12)]
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(123)
    assert specs == [sample_spec(cfg, torch.Generator().manual_seed(s), multi_step=True) for s in range(12)]
    assert {len(s.directions) for s in specs} == {2, 3}
    assert all(a != b for s in specs for a, b in zip(s.directions, s.directions[1:]))


def test_sample_spec_multi_step_threshold_is_strict():
    """A spec is multi-step iff its uniform draw u (after the combination's draw) is < multi_step_prob: with
    multi_step_prob == u exactly it is single-step, with the next float above u multi-step."""
    g = torch.Generator().manual_seed(2)
    pool = combos(WORLD)
    pool = [c for c in pool if c not in set(heldout_combos(WORLD))]
    torch.randint(len(pool), (1,), generator=g)
    u = float(torch.rand(1, generator=g))
    assert 0.0 < u < 1.0
    single = sample_spec(ShapesWorldConfig(multi_step_prob=u), torch.Generator().manual_seed(2))
    multi = sample_spec(ShapesWorldConfig(multi_step_prob=math.nextafter(u, 1.0)), torch.Generator().manual_seed(2))
    assert not single.multi_step and multi.multi_step
