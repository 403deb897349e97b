"""The shapes world and its verifier on non-square frames (issue 51): a width used where a height belongs passes every
test on square frames, so each geometric rule is checked here on a wide (16 x 40) and a tall (40 x 16) frame, on both
boundaries ("inside" and the wrapping world): the rendered video's size and where the object is (the verifier's
measured centroid against the analytic path, within the documented 0.2 px), the wrap of positions modulo W in x and
H in y, the uniform start over the whole frame, and the verifier's direction verdicts.
"""

from __future__ import annotations

import functools

import pytest
import torch

from genrl.data.shapes import ShapeSpec, ShapesWorldConfig, centroid_path, position_error, render_at, start_position
from genrl.rewards.shapes import ShapesVerifier

SIZES = [(16, 40), (40, 16)]  # (height, width): wide, tall


def _world(h: int, w: int, boundary: str) -> ShapesWorldConfig:
    return ShapesWorldConfig(height=h, width=w, num_frames=8, object_size=6.0, boundary=boundary,
                             speeds={"slow": 0.6, "fast": 1.2})


@functools.cache
def _verifier(h: int, w: int, boundary: str) -> ShapesVerifier:
    return ShapesVerifier(_world(h, w, boundary))  # its calibration renders: built once per world


@pytest.mark.parametrize("boundary", ["inside", "wrap"])
@pytest.mark.parametrize("size", SIZES)
def test_render_and_measured_centroid_follow_the_path_on_non_square_frames(size, boundary):
    h, w = size
    world = _world(h, w, boundary)
    verifier = _verifier(h, w, boundary)
    for direction in ("right", "left", "down", "up"):
        spec = ShapeSpec("red", "circle", (direction,), "fast")
        # from one edge along the motion, centred on the other axis (W / 2 or H / 2: a swap moves it)
        start = {"right": (3.5, h / 2), "left": (w - 3.5, h / 2), "down": (w / 2, 3.5), "up": (w / 2, h - 3.5)}[
            direction]
        video = render_at(spec, world, start)
        assert video.shape == (8, 3, h, w)
        measured = verifier.measure(video[None])["centroid"][0]
        expected = centroid_path(spec, world, start)
        err = position_error(measured, expected, world)
        assert float(err.max()) < 0.2, (direction, err.tolist())


@pytest.mark.parametrize("size", SIZES)
def test_wrap_takes_x_modulo_width_and_y_modulo_height(size):
    h, w = size
    world = _world(h, w, "wrap")
    right = centroid_path(ShapeSpec("red", "circle", ("right",), "fast"), world, (w - 1.0, 2.0))
    down = centroid_path(ShapeSpec("red", "circle", ("down",), "fast"), world, (2.0, h - 1.0))
    steps = torch.arange(8, dtype=torch.float32) * 1.2
    assert torch.allclose(right[:, 0], torch.remainder(w - 1.0 + steps, w)) and bool((right[:, 1] == 2.0).all())
    assert torch.allclose(down[:, 1], torch.remainder(h - 1.0 + steps, h)) and bool((down[:, 0] == 2.0).all())
    # at frame 1 the square (centre x = W + 0.2, i.e. 0.2) straddles the right edge: it covers the first and the
    # last columns of the same rows
    video = render_at(ShapeSpec("red", "square", ("right",), "fast"), world, (w - 1.0, h / 2))
    frame = video[1].amax(0)  # [H, W]
    cols = frame.amax(0).nonzero().flatten().tolist()
    rows = frame.amax(1).nonzero().flatten()
    assert 0 in cols and w - 1 in cols and w // 2 not in cols
    assert int(rows.min()) >= h / 2 - 4 and int(rows.max()) <= h / 2 + 3


@pytest.mark.parametrize("size", SIZES)
def test_wrap_start_is_uniform_over_the_whole_non_square_frame(size):
    h, w = size
    world = _world(h, w, "wrap")
    spec = ShapeSpec("red", "circle", ("right",), "fast")
    starts = torch.stack([start_position(spec, world, torch.Generator().manual_seed(i)) for i in range(400)])
    assert float(starts[:, 0].min()) >= 0 and float(starts[:, 0].max()) < w
    assert float(starts[:, 1].min()) >= 0 and float(starts[:, 1].max()) < h
    # both coordinates spread over their own side (a swapped H / W would put x within [0, H) only)
    assert float(starts[:, 0].max()) > 0.8 * w and float(starts[:, 1].max()) > 0.8 * h


@pytest.mark.parametrize("boundary", ["inside", "wrap"])
@pytest.mark.parametrize("size", SIZES)
def test_verifier_direction_verdicts_on_non_square_frames(size, boundary):
    h, w = size
    world = _world(h, w, boundary)
    verifier = _verifier(h, w, boundary)
    videos, prompts = [], []
    for direction, start in (("right", (3.5, h / 2)), ("down", (w / 2, 3.5))):
        videos.append(render_at(ShapeSpec("blue", "square", (direction,), "fast"), world, start))
    pixels = torch.stack(videos)
    for truth, claimed in (("right", "right"), ("down", "down"), ("right", "down"), ("down", "right")):
        prompts.append((truth, claimed))
    captions = [f"a blue square moving {c} quickly" for _, c in prompts]
    index = [0 if t == "right" else 1 for t, _ in prompts]
    out = verifier(pixels[index], captions)
    assert out["direction_correct"].tolist() == [1.0, 1.0, 0.0, 0.0]
