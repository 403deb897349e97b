"""Three-step captions of the shapes world and the exact temporal metrics / reward of multi-step videos
(``genrl/rewards/shapes_temporal.py``), checked on the world's own renders and on videos built from them with a
shifted or reversed turn."""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from genrl.data.shapes import (
    DIRECTION_VECTORS,
    ShapeSpec,
    ShapesWorldConfig,
    caption,
    combos,
    heldout_combos,
    parse_caption,
    render,
    render_at,
    sample,
    sample_seed,
    sample_spec,
    segment_spans,
    step_captions,
    trajectory,
    turn_points,
)
from genrl.rewards import ShapesVerifier, build_reward
from genrl.rewards.shapes_temporal import ShapesTemporalReward, temporal_metrics

# The first 50 captions of sample(ShapesWorldConfig(), seed=0, index=i), recorded before three-step captions and
# max_segments existed: the default world must keep sampling exactly these.
DEFAULT_CAPTIONS = [
    'a magenta triangle moving left quickly',
    'a red circle moving up slowly',
    'a magenta circle moving up quickly',
    'a red circle moves right, then moves up',
    'a cyan triangle moves left, then moves right',
    'a yellow circle moving left quickly',
    'a cyan triangle moves left, then stays still',
    'a red triangle staying still',
    'a yellow triangle staying still',
    'a blue circle staying still',
    'a yellow triangle moving down quickly',
    'a cyan triangle moving up slowly',
    'a cyan triangle moving up quickly',
    'a green circle moving down slowly',
    'a yellow square moving left slowly',
    'a red triangle moving left quickly',
    'a cyan circle staying still',
    'a yellow circle moves right, then moves left',
    'a red square stays still, then moves up',
    'a cyan circle staying still',
    'a red circle moves left, then moves up',
    'a green triangle moving left slowly',
    'a blue circle staying still',
    'a red circle moving right quickly',
    'a cyan square moving right slowly',
    'a yellow square staying still',
    'a blue square staying still',
    'a red triangle moves left, then moves right',
    'a blue triangle moving left slowly',
    'a red square moving up slowly',
    'a green circle moving up slowly',
    'a cyan triangle staying still',
    'a red triangle moves left, then stays still',
    'a blue square moving up quickly',
    'a magenta triangle moves left, then stays still',
    'a cyan circle moving left quickly',
    'a yellow triangle moving up slowly',
    'a blue square moving up slowly',
    'a green triangle moving down quickly',
    'a blue square moving right quickly',
    'a green square moving right quickly',
    'a magenta circle moving left quickly',
    'a cyan triangle stays still, then moves right',
    'a green triangle moving up slowly',
    'a magenta triangle staying still',
    'a blue square moving left quickly',
    'a green circle stays still, then moves right',
    'a red square moving down quickly',
    'a blue square staying still',
    'a blue triangle moving left quickly',
]

@functools.cache
def _world(num_frames: int = 8, height: int = 16, width: int = 16, max_segments: int = 3) -> ShapesWorldConfig:
    return ShapesWorldConfig(num_frames=num_frames, height=height, width=width, max_segments=max_segments)


@functools.cache
def _verifier(height: int = 16, width: int = 16) -> ShapesVerifier:
    return ShapesVerifier(_world(8, height, width))


def _render(text: str, world: ShapesWorldConfig, seed: int = 0) -> torch.Tensor:
    return render(parse_caption(text, world), world, torch.Generator().manual_seed(seed))


def _piecewise(world: ShapesWorldConfig, dirs: list[str], turns: list[int], color: str = "red",
               shape: str = "circle") -> torch.Tensor:
    """A video of ``world.num_frames`` frames that follows ``dirs[k]`` between the integer frames ``turns[k-1]`` and
    ``turns[k]`` at the mean speed, built by concatenating the renderer's single-step clips (each clip starts where
    the previous one ended); the start is centred in the range that keeps the path inside the frame."""
    t = world.num_frames
    bounds = [0, *turns, t - 1]
    v = world.mean_speed
    steps = [torch.tensor(DIRECTION_VECTORS[d]) * v for d in dirs]
    offsets = [torch.zeros(2)]
    for k, u in enumerate(steps):
        for _ in range(bounds[k + 1] - bounds[k]):
            offsets.append(offsets[-1] + u)
    path = torch.stack(offsets)
    h = world.object_size / 2
    size = torch.tensor([world.width, world.height], dtype=torch.float32)
    low, high = h - path.min(0).values, size - h - path.max(0).values
    start = (low + high) / 2
    clips = []
    for k, d in enumerate(dirs):
        n = bounds[k + 1] - bounds[k] + 1
        clip = render_at(ShapeSpec(color, shape, (d,)), dataclasses.replace(world, num_frames=n, multi_step_prob=0.0),
                         start + path[bounds[k]])
        clips.append(clip if k == 0 else clip[1:])
    video = torch.cat(clips)
    assert video.shape[0] == t
    return video


def _metrics(videos, dirs, spans, chunk_size=2, verifier=None):
    x = torch.stack(list(videos)) if isinstance(videos, (list, tuple)) else videos
    return temporal_metrics(verifier or _verifier(x.shape[-2], x.shape[-1]), x, dirs, spans, chunk_size)


def _values(out, i=0):
    return {k: float(out[k][i]) for k in ("step_following", "first_chunk_following", "switch_delay", "order_correct")}


PERFECT = {"step_following": 1.0, "first_chunk_following": 1.0, "switch_delay": 0.0, "order_correct": 1.0}


# ------------------------------------------------------------------------------------------------ the world
def test_default_sampling_is_unchanged():
    world = ShapesWorldConfig()
    assert world.max_segments == 2
    assert [sample(world, 0, i)[1] for i in range(50)] == DEFAULT_CAPTIONS
    # and the same videos: the historical draws (combination, multi-step coin, second direction or speed), then the
    # render's start; no extra draw for the number of segments
    pool = [c for c in combos(world) if c not in set(heldout_combos(world))]
    for i in range(50):
        g = torch.Generator().manual_seed(sample_seed(0, i))
        c, s, d = pool[int(torch.randint(len(pool), (1,), generator=g))]
        if float(torch.rand(1, generator=g)) < world.multi_step_prob:
            others = [x for x in world.directions if x != d]
            spec = ShapeSpec(c, s, (d, others[int(torch.randint(len(others), (1,), generator=g))]))
        else:
            speed = list(world.speeds)[int(torch.randint(len(world.speeds), (1,), generator=g))]
            spec = ShapeSpec(c, s, (d,), None if d == "still" else speed)
        assert caption(spec) == DEFAULT_CAPTIONS[i]
        assert torch.equal(render(spec, world, g), sample(world, 0, i)[0])
    # the held-out split and forced multi-step draws are two-segment as before
    g = torch.Generator().manual_seed(3)
    specs = [sample_spec(world, g, split, multi_step=True) for split in ("train", "heldout", "all") for _ in range(40)]
    assert all(len(s.directions) == 2 for s in specs)


@pytest.mark.parametrize("num_frames", [4, 5, 6, 7, 8, 9, 12])
def test_two_step_trajectory_is_bit_identical_to_the_historical_formula(num_frames):
    world = ShapesWorldConfig(num_frames=num_frames, speeds={"slow": 0.3, "fast": 0.6}, boundary="wrap")
    t = torch.arange(num_frames, dtype=torch.float64)
    m = (num_frames - 1) / 2
    for d1, d2 in [("right", "up"), ("left", "still"), ("still", "down"), ("up", "down")]:
        u1 = torch.tensor(DIRECTION_VECTORS[d1], dtype=torch.float64)
        u2 = torch.tensor(DIRECTION_VECTORS[d2], dtype=torch.float64)
        old = (world.mean_speed * (t.clamp(max=m)[:, None] * u1 + (t - m).clamp(min=0)[:, None] * u2)).float()
        assert torch.equal(trajectory(ShapeSpec("red", "circle", (d1, d2)), world), old)
    assert turn_points(num_frames, 2) == [m]


def test_three_step_captions_round_trip():
    spec = ShapeSpec("red", "circle", ("right", "up", "left"))
    text = "a red circle moves right, then moves up, then moves left"
    assert caption(spec) == text and parse_caption(text) == spec
    still = ShapeSpec("blue", "square", ("still", "down", "still"))
    assert caption(still) == "a blue square stays still, then moves down, then stays still"
    assert parse_caption(caption(still)) == still and still.multi_step
    assert parse_caption("  An RED circle moves right ,then moves up,  then moves LEFT. ") == spec
    # every caption of a three-segment world parses back to its spec
    world = _world(8)
    for i in range(200):
        _, cap, s = sample(dataclasses.replace(world, multi_step_prob=1.0), 0, i, "all")
        assert parse_caption(cap, world) == s
    for bad in ["a red circle moves right, then moves up, then moves left, then moves down",
                "a red circle moves right, then moves up,", "a red circle moves right, moves up, then moves left",
                "a red circle moves right, then moves up then moves left"]:
        with pytest.raises(ValueError, match="malformed caption"):
            parse_caption(bad)
    with pytest.raises(ValueError, match="at most 3 motion segments"):
        ShapeSpec("red", "circle", ("right", "up", "left", "down"))


def test_step_captions_is_the_ground_truth_plan():
    assert step_captions("a red circle moves right, then moves up") == ["a red circle moving right",
                                                                        "a red circle moving up"]
    assert step_captions("a green triangle moves left, then stays still, then moves down") == [
        "a green triangle moving left", "a green triangle staying still", "a green triangle moving down"]
    for single in ["a red circle moving left slowly", "a red circle staying still", "a red circle",
                   "a red circle moving up"]:
        assert step_captions(single) == [single]
    # each step caption parses to one direction at the unstated (mean) speed
    for s in step_captions("a red circle moves right, then moves up, then moves left"):
        spec = parse_caption(s)
        assert len(spec.directions) == 1 and spec.speed is None
    with pytest.raises(ValueError, match="unknown color 'purple'"):
        step_captions("a purple circle moves right, then moves up")
    white = ShapesWorldConfig(colors=["white"])
    assert step_captions("a white circle moves up, then moves down", white) == ["a white circle moving up",
                                                                               "a white circle moving down"]


def test_segment_spans_and_turn_points():
    assert segment_spans(8, 2) == [(0, 4), (4, 8)]
    assert segment_spans(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert segment_spans(7, 2) == [(0, 4), (4, 7)]
    assert segment_spans(5, 1) == [(0, 5)]
    for t in range(1, 30):
        for s in range(1, min(t, 4) + 1):
            spans = segment_spans(t, s)
            sizes = [e - a for a, e in spans]
            assert spans[0][0] == 0 and spans[-1][1] == t and all(a == e for (_, e), (a, _) in zip(spans, spans[1:]))
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert turn_points(8, 3) == [2.0, 5.0] and turn_points(8, 2) == [3.5] and turn_points(8, 1) == []
    for t in (3, 5, 7, 9):  # odd T: the two-segment turn is the last frame of the first span
        assert turn_points(t, 2) == [segment_spans(t, 2)[0][1] - 1]
    for bad in [(3, 4), (5, 0), (5.0, 2), (5, True)]:
        with pytest.raises(ValueError, match="segment_spans"):
            segment_spans(*bad)


def test_max_segments_validation():
    for bad in [1, 4, True, "3", 2.0]:
        with pytest.raises(ValueError, match=r"max_segments must be an int in \[2, 3\]"):
            ShapesWorldConfig(max_segments=bad)
    with pytest.raises(ValueError, match=r"max_segments=3 needs num_frames >= 6.*got num_frames=5.*raise num_frames"):
        ShapesWorldConfig(num_frames=5, max_segments=3)
    ShapesWorldConfig(num_frames=5, max_segments=3, multi_step_prob=0.0)  # no multi-step captions: fine
    ShapesWorldConfig(num_frames=1, max_segments=3)  # image mode ignores motion settings
    ShapesWorldConfig(num_frames=6, max_segments=3)
    assert ShapesWorldConfig(**dataclasses.asdict(_world(8))).max_segments == 3
    # a three-segment spec needs six frames to render
    with pytest.raises(ValueError, match=r"needs num_frames >= 6.*got num_frames=5"):
        render(ShapeSpec("red", "circle", ("right", "up", "left")), ShapesWorldConfig(num_frames=5, multi_step_prob=0),
               torch.Generator())


def test_three_segment_world_samples_two_and_three_steps():
    world = dataclasses.replace(_world(8), multi_step_prob=1.0)
    specs = [sample(world, 1, i)[2] for i in range(300)]
    counts = [len(s.directions) for s in specs]
    assert set(counts) == {2, 3} and 100 < counts.count(3) < 200
    assert all(a != b for s in specs for a, b in zip(s.directions, s.directions[1:]))
    # a three-segment render follows its segments: box-centre offsets turn at frames 2 and 5 (spans of 3, 3, 2)
    off = trajectory(ShapeSpec("red", "circle", ("right", "up", "left")), world)
    v = world.mean_speed
    expect = torch.tensor([[0, 0], [v, 0], [2 * v, 0], [2 * v, -v], [2 * v, -2 * v], [2 * v, -3 * v],
                           [v, -3 * v], [0, -3 * v]])
    assert torch.allclose(off, expect.float(), atol=1e-6)


# ------------------------------------------------------------------------------------------------ temporal metrics
def test_world_renders_follow_their_steps_at_the_world_split():
    cases = [(9, "a red circle moves right, then moves up"), (9, "a green square stays still, then moves left"),
             (7, "a blue triangle moves down, then moves up"),
             (8, "a red circle moves right, then moves up, then moves left"),
             (8, "a yellow square moves up, then stays still, then moves right"),
             (6, "a cyan circle moves left, then moves down, then moves right")]
    for t, text in cases:
        world = _world(t)
        dirs = list(parse_caption(text, world).directions)
        video = _render(text, world, seed=t)
        out = _metrics([video], [dirs], [segment_spans(t, len(dirs))])
        assert _values(out) == PERFECT, (t, text, _values(out))
        assert out["per_step_following"].tolist() == [[1.0] * len(dirs)]
        # consistency is the verifier's own key
        ref = _verifier()(video[None], [text])["consistency"]
        assert torch.allclose(out["consistency"], ref, atol=1e-6) and float(ref) > 0.95


def test_even_frame_two_step_world_turns_between_frames():
    # at T = 8 the two-step world turns half a frame after frame 3 (kept for compatibility): a reversal's
    # displacement 3 -> 4 is zero, measured "still", so the second step (frames 4..7, from frame 3) follows 3 of 4
    world = _world(8)
    out = _metrics([_render("a red circle moves right, then moves left", world)], [["right", "left"]],
                   [[(0, 4), (4, 8)]])
    assert _values(out) == {"step_following": 0.875, "first_chunk_following": 0.5, "switch_delay": 1.0,
                            "order_correct": 1.0}
    # the same plan on a video that turns on frame 3 follows it exactly
    out = _metrics([_piecewise(world, ["right", "left"], [3])], [["right", "left"]], [[(0, 4), (4, 8)]])
    assert _values(out) == PERFECT


def test_a_switch_one_chunk_late_costs_one_chunk():
    world = _world(8)
    spans = [[(0, 4), (4, 8)]]
    late = _piecewise(world, ["right", "up"], [5])  # right over displacements 1..5, up over 6..7
    out = _metrics([late], [["right", "up"]], spans)
    assert float(out["switch_delay"][0]) == 1.0
    assert float(out["first_chunk_following"][0]) == 0.0 < 1
    assert out["per_step_following"].tolist() == [[1.0, 0.5]] and float(out["step_following"][0]) == 0.75
    assert float(out["order_correct"][0]) == 0.0  # step 2 is half right, half up: no dominant direction
    # three steps over 12 frames, chunk-aligned spans; the second switch (frame 8) comes one chunk late
    world12 = _world(12, 24, 24)
    verifier = ShapesVerifier(world12)
    dirs, spans3 = [["right", "up", "left"]], [[(0, 4), (4, 8), (8, 12)]]
    on_time = _metrics([_piecewise(world12, dirs[0], [3, 7])], dirs, spans3, verifier=verifier)
    assert _values(on_time) == PERFECT
    out = _metrics([_piecewise(world12, dirs[0], [3, 9])], dirs, spans3, verifier=verifier)
    assert float(out["switch_delay"][0]) == 0.5  # (0 + 1) / 2 boundaries
    assert float(out["first_chunk_following"][0]) == 0.5
    assert out["per_step_following"].tolist() == [[1.0, 1.0, 0.5]]
    # a step that never reacts counts all its chunks; with a bigger chunk the same video reacts in chunk 0 of 2 frames
    never = _metrics([_piecewise(world12, ["right", "up", "up"], [3, 7])], dirs, spans3, verifier=verifier)
    assert float(never["switch_delay"][0]) == 1.0 and float(never["order_correct"][0]) == 0.0  # (0 + 2) / 2
    out = _metrics([_piecewise(world12, dirs[0], [3, 8])], dirs, spans3, chunk_size=4, verifier=verifier)
    assert float(out["switch_delay"][0]) == 0.0 and float(out["first_chunk_following"][0]) == 0.875


def test_reversed_order_is_not_order_correct():
    world = _world(9)
    video = _render("a red circle moves up, then moves right", world)
    out = _metrics([video], [["right", "up"]], [segment_spans(9, 2)])
    assert float(out["order_correct"][0]) == 0.0 and float(out["step_following"][0]) == 0.0
    assert float(out["switch_delay"][0]) == 2.0  # the second step (4 frames, 2 chunks) never turns up
    world3 = _world(8)
    video = _render("a red circle moves left, then moves up, then moves right", world3)
    out = _metrics([video], [["right", "up", "left"]], [segment_spans(8, 3)])
    assert float(out["order_correct"][0]) == 0.0 and out["per_step_following"].tolist() == [[0.0, 1.0, 0.0]]


def test_non_square_frames_keep_x_and_y_apart():
    world = _world(9, 16, 24)  # 16 rows, 24 columns
    verifier = ShapesVerifier(world)
    for text, dirs in [("a red circle moves right, then moves up", ["right", "up"]),
                       ("a red square moves down, then moves left", ["down", "left"])]:
        video = _render(text, world)
        assert video.shape[-2:] == (16, 24)
        out = temporal_metrics(verifier, video[None], [dirs], [segment_spans(9, 2)], 2)
        assert _values(out) == PERFECT
        swapped = temporal_metrics(verifier, video[None], [dirs[::-1]], [segment_spans(9, 2)], 2)
        assert float(swapped["step_following"][0]) == 0.0
    with pytest.raises(ValueError, match=r"calibrated for 16x24 \(HxW\) frames, got 24x16"):
        temporal_metrics(verifier, video.transpose(-1, -2)[None], [dirs], [segment_spans(9, 2)], 2)


def test_a_batch_mixes_step_counts():
    world = _world(8)
    texts = ["a red circle moving right", "a blue square moves up, then moves left",
             "a green triangle moves down, then moves right, then moves up", "a red circle staying still"]
    videos = [_render("a red circle moving right", world), _piecewise(world, ["up", "left"], [3], "blue", "square"),
              _render(texts[2], world), _render(texts[3], world)]
    dirs = [["right"], ["up", "left"], ["down", "right", "up"], [None]]
    spans = [[(0, 8)], [(0, 4), (4, 8)], segment_spans(8, 3), [(0, 8)]]
    out = _metrics(videos, dirs, spans)
    for k in PERFECT:
        assert out[k].tolist() == [PERFECT[k]] * 4, k
    assert out["per_step_following"].shape == (4, 3)
    assert out["per_step_following"].isnan().tolist() == [[False, True, True], [False, False, True],
                                                           [False, False, False], [False, True, True]]
    # one-step plans: first_chunk_following is the step's own following (a wrong direction scores 0, delay 0)
    wrong = _metrics([videos[0]], [["left"]], [[(0, 8)]])
    assert _values(wrong) == {"step_following": 0.0, "first_chunk_following": 0.0, "switch_delay": 0.0,
                              "order_correct": 0.0}
    # every sample scores as it does alone
    for i in range(4):
        alone = _metrics([videos[i]], [dirs[i]], [spans[i]])
        assert all(torch.equal(alone[k][0], out[k][i]) for k in ("step_following", "switch_delay", "consistency"))


def test_empty_frames_never_follow():
    out = _metrics([torch.zeros(8, 3, 16, 16)], [["still", "still"]], [[(0, 4), (4, 8)]])
    assert _values(out) == {"step_following": 0.0, "first_chunk_following": 0.0, "switch_delay": 2.0,
                            "order_correct": 0.0}
    assert float(out["consistency"][0]) == 0.0


def test_bad_inputs_raise_naming_the_value():
    world = _world(8)
    x = _render("a red circle moves right, then moves up", world)[None]
    v = _verifier()
    ok_dirs, ok_spans = [["right", "up"]], [[(0, 4), (4, 8)]]
    cases = [
        (x, [["right"]], ok_spans, 2, r"1 directions \['right'\] but 2 frame spans"),
        (x, ok_dirs, [[(0, 4), (4, 7)]], 2, r"frame_spans\[0\]=\[\(0, 4\), \(4, 7\)\].*covering \[0, 8\)"),
        (x, ok_dirs, [[(0, 4), (5, 8)]], 2, r"contiguous"),
        (x, ok_dirs, [[(0, 8), (8, 8)]], 2, r"non-empty"),
        (x, ok_dirs, [[(0, 1), (1, 8)]], 2, r"first step needs at least two frames"),
        (x, ok_dirs, [[(0, 2), (2, 4), (4, 8)]], 2, r"2 directions .* but 3 frame spans"),
        (x, [["right", "north"]], ok_spans, 2, r"unknown direction 'north'"),
        (x, ok_dirs + ok_dirs, ok_spans, 2, r"directions must be a list with one entry per sample \(B=1\), got 2"),
        (x, ok_dirs, [[0, 4, 8]], 2, r"frame_spans\[0\] must be a list of \(start, end\) frame pairs"),
        (x, ok_dirs, ok_spans, 0, r"chunk_size must be an int >= 1, got 0"),
        (x * 2 - 1, ok_dirs, ok_spans, 2, r"pixel values must be in \[0, 1\], got min -1"),
        (x[:, :1], [["right"]], [[(0, 1)]], 2, r"T >= 2 frames; got T=1"),
        (x[:, :, 0], ok_dirs, ok_spans, 2, r"pixels must be a float tensor \[B, T, 3, H, W\]"),
    ]
    for pixels, dirs, spans, chunk, match in cases:
        with pytest.raises(ValueError, match=match):
            temporal_metrics(v, pixels, dirs, spans, chunk)


# ------------------------------------------------------------------------------------------------ the reward
def test_reward_from_the_registry_scores_global_captions():
    reward = build_reward("shapes_temporal", world={"num_frames": 8, "max_segments": 3}, chunk_size=2)
    assert isinstance(reward, ShapesTemporalReward) and reward.name == "shapes_temporal"
    world = reward.world
    texts = ["a red circle moves right, then moves up, then moves left", "a blue square moves up, then moves left",
             "a green triangle moving down slowly"]
    videos = torch.stack([_render(texts[0], world), _piecewise(world, ["up", "left"], [3], "blue", "square"),
                          _render(texts[2], world)])
    out = reward(videos, texts)  # no frame_spans: the world's split
    assert set(out) == set(reward.dimensions) | {"valid"} and out["valid"].all()
    assert out["reward"].tolist() == pytest.approx((0.5 + 0.3 + 0.2 * out["consistency"]).tolist(), abs=1e-6)
    assert out["step_following"].tolist() == [1.0] * 3 and out["switch_delay"].tolist() == [0.0] * 3
    assert out["step3_following"][0] == 1.0 and out["step3_following"][1:].isnan().all()
    assert out["step2_following"][2].isnan() and out["step1_following"][2] == 1.0
    # explicit spans (a plan's chunks times chunk_size) and other weights; the reward is their weighted sum
    late = _piecewise(world, ["up", "left"], [5], "blue", "square")
    custom = ShapesTemporalReward(world, step_weight=1.0, order_weight=0.0, consistency_weight=0.0,
                                  first_chunk_weight=0.25, delay_weight=0.5, scale=2.0, shift=1.0)
    res = custom(late[None], [texts[1]], frame_spans=[[(0, 4), (4, 8)]])
    raw = 1.0 * 0.75 + 0.25 * 0.0 - 0.5 * 1.0
    assert float(res["reward"][0]) == pytest.approx(2.0 * raw + 1.0, abs=1e-6)
    assert float(res["switch_delay"][0]) == 1.0
    with pytest.raises(ValueError, match="the weight of step_following must be finite"):
        ShapesTemporalReward(step_weight=math.nan)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        ShapesTemporalReward(chunk_size=0)


def test_reward_marks_unreadable_samples_invalid_without_raising():
    reward = ShapesTemporalReward({"num_frames": 8, "max_segments": 3})
    world = reward.world
    good = "a red circle moves right, then moves up, then moves left"
    videos = torch.stack([_render(good, world)] * 4)
    texts = [good, "a purple circle moves right, then moves up", good, good]
    spans = [segment_spans(8, 3), segment_spans(8, 2), [(0, 4), (4, 8)], [(0, 3), (3, 6), (6, 7)]]
    with pytest.warns(UserWarning, match=r"3 of 4 samples are invalid.*unknown color 'purple'.*3 directions"):
        out = reward(videos, texts, frame_spans=spans)
    assert out["valid"].tolist() == [True, False, False, False]
    for k in reward.dimensions:
        assert out[k][1:].isnan().all(), k
    assert float(out["reward"][0]) == pytest.approx(0.8 + 0.2 * float(out["consistency"][0]), abs=1e-6)
    # caller errors still raise: one frame_spans entry per sample, frames of the world's size
    with pytest.raises(ValueError, match=r"meta\['frame_spans'\] must be a list .* \(B=4\), got list of length 1"):
        reward(videos, texts, frame_spans=[spans[0]])
    with pytest.raises(ValueError, match="calibrated for 16x16"):
        reward(videos[..., :12], texts)


def test_verifier_scores_every_segment_of_a_three_step_caption():
    """ShapesVerifier splits a multi-step caption at the world's turn points, one velocity per segment: a three-step
    render is right on every segment; a caption whose third step differs is not (it used to be judged on two
    halves from the first two directions only)."""
    world = ShapesWorldConfig(num_frames=12, speeds={"slow": 0.4, "fast": 0.8}, max_segments=3)
    verifier = ShapesVerifier(world)
    text = "a red circle moves right, then moves up, then moves left"
    video = _render(text, world)[None]
    right = verifier.score(video, [text])
    assert float(right["direction_correct"][0]) == 1.0 and float(right["all_correct"][0]) == 1.0
    assert float(right["step_following"][0]) > 0.9
    wrong = verifier.score(video, ["a red circle moves right, then moves up, then moves down"])
    assert float(wrong["direction_correct"][0]) == 0.0 and float(wrong["step_following"][0]) < 0.1
    two = "a blue square moves left, then moves down"
    mixed = verifier.score(torch.cat([video, _render(two, world)[None]]), [text, two])
    assert mixed["direction_correct"].tolist() == [1.0, 1.0]
