"""The wrapping (torus) shapes world and the long-video measurements built on it (issue 24: DFoT rollouts 4x and 8x
the training length): ``ShapesWorldConfig(boundary="wrap")``, the verifier's circular centroid and unwrapped track,
:func:`genrl.rewards.shapes.score_windows` and the analytic path :func:`genrl.data.shapes.centroid_path`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import genrl.rewards.shapes as shapes_reward
from genrl.data.shapes import (
    ShapeSpec,
    ShapesWorldConfig,
    as_world,
    caption,
    centroid_path,
    position_error,
    render,
    render_at,
    sample,
    sample_seed,
    start_position,
    trajectory,
    wrapped_delta,
)
from genrl.data.shapes_datamodule import ShapesDataModule
from genrl.rewards.shapes import ShapesVerifier, ShapesVideoReward, score_windows

WRAP = ShapesWorldConfig(boundary="wrap", multi_step_prob=0.0)  # 8 frames, the model's window
LONG = dataclasses.replace(WRAP, num_frames=32)  # 4x the window
#: the verifier's circular centroid against the analytic area centroid on clean renders (px). The bias is the
#: foreground threshold on anti-aliased edges (largest for squares, about 0.2 px), the same on an "inside" world.
CENTROID_TOL = 0.25


@pytest.fixture(scope="module")
def wrap_verifier() -> ShapesVerifier:
    return ShapesVerifier(WRAP)


@pytest.fixture(scope="module")
def long_videos():
    """Every (shape, moving direction, speed) of the default vocabulary, 32 frames on the wrap world (each travels at
    least 18.6 px, so every video crosses an edge), with its captions and analytic centroid paths."""
    videos, captions, paths = [], [], []
    moving = [d for d in LONG.directions if d != "still"]
    for i, (shape, d, speed) in enumerate((s, d, v) for s in LONG.shapes for d in moving for v in LONG.speeds):
        spec = ShapeSpec(LONG.colors[i % len(LONG.colors)], shape, (d,), speed)
        g = torch.Generator().manual_seed(sample_seed(5, i))
        start = start_position(spec, LONG, _copy(g))  # the start render draws next
        videos.append(render(spec, LONG, g))
        captions.append(caption(spec))
        paths.append(centroid_path(spec, LONG, start))
    return torch.stack(videos), captions, torch.stack(paths)


def _copy(g: torch.Generator) -> torch.Generator:
    out = torch.Generator()
    out.set_state(g.get_state())
    return out


def _crossing(videos: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the object has mass on two opposite edges of the frame (it is split by the wrap)."""
    m = videos.amax(2)  # [B, T, H, W]
    cols = (m[..., 0] > 0.05).any(-1) & (m[..., -1] > 0.05).any(-1)
    rows = (m[..., 0, :] > 0.05).any(-1) & (m[..., -1, :] > 0.05).any(-1)
    return cols | rows


# ---------------------------------------------------------------------------------------------- the world
def test_boundary_is_validated_and_wrap_lifts_the_travel_limit():
    with pytest.raises(ValueError, match=r"'torus'.*inside, wrap"):
        ShapesWorldConfig(boundary="torus")
    with pytest.raises(ValueError, match="boundary='wrap'"):
        ShapesWorldConfig(num_frames=32)  # the path leaves an "inside" frame
    long = ShapesWorldConfig(boundary="wrap", num_frames=64, speeds={"slow": 0.6, "fast": 3.0})
    assert long.num_frames == 64 and ShapesWorldConfig().boundary == "inside"
    # the field round-trips through the datamodule's hyperparameters (what checkpoints store) and as_world
    dm = ShapesDataModule(world=WRAP, batch_size=2, val_size=2)
    assert dm.hparams["world"]["boundary"] == "wrap" and as_world(dm.hparams["world"]) == WRAP
    assert as_world({k: v for k, v in dataclasses.asdict(WRAP).items() if k != "boundary"}).boundary == "inside"


def test_wrap_render_equals_inside_render_while_the_path_stays_inside():
    inside = dataclasses.replace(WRAP, boundary="inside")
    for i in range(24):
        g = torch.Generator().manual_seed(sample_seed(1, i))
        spec = ShapeSpec(inside.colors[i % 6], inside.shapes[i % 3], (inside.directions[i % 5],),
                         None if inside.directions[i % 5] == "still" else "fast")
        start = start_position(spec, inside, _copy(g))  # a start that keeps the path inside
        assert torch.equal(render_at(spec, WRAP, start), render(spec, inside, g))
        # and on the wrap world, start_position is the start render draws (two draws, uniform over the frame)
        g = torch.Generator().manual_seed(sample_seed(1, i))
        start = start_position(spec, LONG, _copy(g))
        assert float(start.min()) >= 0 and float(start.max()) < 16
        assert torch.equal(render(spec, LONG, g), render_at(spec, LONG, start))
    with pytest.raises(ValueError, match="outside the 16x16 frame"):
        render_at(ShapeSpec("red", "circle", ("right",), "fast"), inside, (14.0, 8.0))


def test_an_object_crossing_the_edge_is_split_and_keeps_its_mass():
    # 1 px / frame: every frame is frame 0 rolled by whole pixels, exactly
    world = ShapesWorldConfig(boundary="wrap", num_frames=20, speeds={"fast": 1.0}, multi_step_prob=0.0)
    for shape in world.shapes:
        video = render_at(ShapeSpec("green", shape, ("right",), "fast"), world, (12.25, 6.5))
        for t in range(20):
            assert torch.equal(video[t], torch.roll(video[0], t, dims=-1))
        cols = video.amax(dim=(1, 2))  # [T, W]: the brightest value per column
        # frame 6: box center 18.25 = 2.25 (mod 16), the box spans [-0.75, 5.25]: the last column holds a part
        assert cols[6, 0] > 0.9 and cols[6, -1] > 0.2 and cols[6, 6:-1].max() == 0
    # subpixel steps (the default speeds), both axes: each frame, rolled by whole pixels to bring the object to the
    # middle, is the "inside" render of the object there, so its mass and pixels are those of an unsplit object
    still = ShapesWorldConfig(num_frames=1)
    for spec, start in ((ShapeSpec("red", "square", ("up",), "slow"), (3.0, 2.0)),
                        (ShapeSpec("cyan", "circle", ("left",), "fast"), (1.3, 15.1)),
                        (ShapeSpec("yellow", "triangle", ("down",), "fast"), (15.2, 11.7))):
        video = render_at(spec, LONG, start)
        assert _crossing(video[None])[0].sum() >= 6
        centers = torch.remainder(torch.tensor(start) + trajectory(spec, LONG), 16.0)  # box centers [T, 2]
        for t in range(LONG.num_frames):
            shift = torch.round(8.0 - centers[t])
            alone = render_at(ShapeSpec(spec.color, spec.shape), still, centers[t] + shift)[0]
            rolled = torch.roll(video[t], (int(shift[1]), int(shift[0])), dims=(-2, -1))
            torch.testing.assert_close(rolled, alone, atol=1e-5, rtol=0)
            assert abs(float(video[t].sum()) - float(alone.sum())) < 1e-4
    # the frame is a torus on both axes: a start outside the frame is taken modulo the frame
    spec = ShapeSpec("blue", "triangle", ("left",), "fast")
    assert torch.equal(render_at(spec, LONG, (3.5 + 16, 9.0 - 32)), render_at(spec, LONG, (3.5, 9.0)))


def test_analytic_path_and_wrapped_distances():
    spec = ShapeSpec("red", "triangle", ("left",), "fast")
    path = centroid_path(spec, LONG, (2.0, 5.0), num_frames=40)
    assert path.shape == (40, 2) and float(path.min()) >= 0 and float(path[:, 0].max()) < 16
    assert torch.allclose(path[3], torch.tensor([14.4, 6.0]), atol=1e-5)  # 2 - 3.6 + 16; y + object_size / 6
    assert torch.allclose(path[:8], centroid_path(spec, WRAP, (2.0, 5.0)))  # the first window of the same path
    assert torch.equal(wrapped_delta(torch.tensor([0.3, -7.9, 8.0, 15.0, -24.0]), 16.0),
                       torch.tensor([0.3, -7.9, -8.0, -1.0, -8.0]))
    a, b = torch.tensor([[0.5, 15.5]]), torch.tensor([[15.5, 0.5]])
    assert torch.allclose(position_error(a, b, WRAP), torch.tensor([2**0.5]))
    assert torch.allclose(position_error(a, b, ShapesWorldConfig()), torch.tensor([2 * 15**2]).sqrt())
    with pytest.raises(ValueError, match="num_frames"):
        centroid_path(spec, LONG, (2.0, 5.0), num_frames=0)


# ---------------------------------------------------------------------------------------------- the verifier
def test_circular_centroid_tracks_the_analytic_path_across_the_edges(long_videos):
    videos, _, paths = long_videos
    m = ShapesVerifier(LONG).measure(videos)
    assert m["nonempty"].all()
    err = position_error(m["centroid"], paths, LONG)
    crossing = _crossing(videos)
    assert crossing.sum() >= 100
    assert float(err.max()) <= CENTROID_TOL, float(err.max())
    # the unwrapped track moves like the analytic (unwrapped) path: the same displacement from frame 0
    moved = m["track"] - m["track"][:, :1]
    truth = wrapped_delta(paths[:, 1:] - paths[:, :-1], 16.0).cumsum(1)
    assert float((moved[:, 1:] - truth).abs().max()) <= 2 * CENTROID_TOL
    # a linear (non-circular) mean on the same frames is far off where the object is split
    lin = ShapesVerifier(dataclasses.replace(WRAP, boundary="inside")).measure(videos)["centroid"]
    assert float(position_error(lin, paths, LONG)[crossing].max()) > 3.0


def test_long_wrap_videos_score_correct_window_by_window(wrap_verifier, long_videos):
    videos, captions, _ = long_videos
    out = score_windows(wrap_verifier, videos, captions, window=8, stride=8)
    assert set(out) == set(ShapesVerifier.dimensions) | {"valid"}
    assert all(v.shape == (len(captions), 4) for v in out.values()) and out["valid"].all()
    crossing = _crossing(videos).reshape(len(captions), 4, 8).any(-1)  # [B, windows]
    assert crossing.sum() >= 40
    assert float(out["all_correct"].min()) == 1.0
    assert float(out["direction"].min()) >= 0.95 and float(out["speed"].min()) >= 0.95
    # overlapping windows: (32 - 8) // 4 + 1 = 7, each equal to scoring that slice alone
    over = score_windows(wrap_verifier, videos, captions, window=8, stride=4)
    assert over["reward"].shape == (len(captions), 7)
    assert torch.equal(over["reward"][:, 3], wrap_verifier(videos[:, 12:20], captions)["reward"])


def test_a_non_circular_centroid_or_no_unwrapping_would_fail(wrap_verifier, long_videos, monkeypatch):
    """The planted bugs the wrap tests must catch: a linear centroid, or a track that is not unwrapped."""
    videos, captions, _ = long_videos

    def linear(profile, coords, period):
        return (profile * coords).sum(-1) / profile.sum(-1).clamp(min=1e-8)

    with monkeypatch.context() as mp:
        mp.setattr(shapes_reward, "_circular_mean", linear)
        out = score_windows(wrap_verifier, videos, captions, window=8, stride=8)
    assert float(out["all_correct"].mean()) < 0.8
    with monkeypatch.context() as mp:
        mp.setattr(shapes_reward, "_unwrap", lambda track, mask, period: track)
        out = score_windows(wrap_verifier, videos, captions, window=8, stride=8)
    assert float(out["all_correct"].mean()) < 0.8


def test_differentiable_reward_on_a_wrap_world_has_finite_gradients(long_videos):
    videos, captions, _ = long_videos
    reward = ShapesVideoReward(WRAP)
    x = videos[:4, 8:16].clone().requires_grad_(True)
    out = reward(x, captions[:4])
    assert (out["text_alignment"] > 0.9).all()
    out["reward"].sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_score_windows_checks_its_arguments(wrap_verifier, long_videos):
    videos, captions, _ = long_videos
    with pytest.raises(ValueError, match="num_frames=8 but window=16"):
        score_windows(wrap_verifier, videos[:2], captions[:2], window=16)
    with pytest.raises(ValueError, match="longer than the video"):
        score_windows(wrap_verifier, videos[:2, :4], captions[:2], window=8)
    with pytest.raises(ValueError, match="stride must be an int >= 1"):
        score_windows(wrap_verifier, videos[:2], captions[:2], window=8, stride=0)
    with pytest.raises(ValueError, match=r"\[B, T, C, H, W\]"):
        score_windows(wrap_verifier, videos[0], captions[:1], window=8)
    with pytest.raises(ValueError, match="pixel values must be in"):  # the verifier's own check: [-1, 1] pixels
        score_windows(wrap_verifier, videos[:2] * 2 - 1, captions[:2], window=8)


# ---------------------------------------------------------------------------------------------- "inside" unchanged
def test_inside_world_scores_are_unchanged():
    """The default world's verifier on fixed samples gives the values recorded before the wrap world was added (to
    float32 rounding), and its track is its centroid."""
    world = ShapesWorldConfig()
    pixels, captions, _ = zip(*[sample(world, 0, i) for i in range(6)])
    videos = torch.stack(pixels)
    # the renders: total coverage and its first column moment, as recorded (an "inside" start is not re-drawn)
    assert float(videos.double().sum()) == 1935.875
    assert float((videos.double() * torch.arange(16.0, dtype=torch.float64)).sum()) == 12700.9375
    verifier = ShapesVerifier(world)
    out = verifier(videos, list(captions))
    recorded = {
        "reward": [0.995620846748352, 0.9949911236763, 0.9956805109977722, 0.9972585439682007, 0.9963620901107788,
                   0.9947298169136047],
        "shape": [0.9922716617584229, 0.9916998744010925, 0.9926671385765076, 0.990402102470398, 0.9861847758293152,
                  0.9883143901824951],
        "direction": [1.0, 0.9974840879440308, 1.0, 0.9999985694885254, 0.9999967813491821, 1.0],
        "consistency": [0.99970942735672, 0.999635636806488, 0.9994727969169617, 0.9998868703842163,
                        0.9996273517608643, 0.9992222189903259],
    }
    for key, values in recorded.items():
        torch.testing.assert_close(out[key], torch.tensor(values), atol=2e-6, rtol=0, msg=key)
    assert out["all_correct"].tolist() == [1.0] * 6
    m = verifier.measure(videos)
    assert m["track"] is m["centroid"]


# ---------------------------------------------------------------------------------------------- the config
def test_wrap_fine_tune_config_composes_over_the_dfot_shapes_config(tmp_path, monkeypatch):
    from pathlib import Path

    import genrl.data  # noqa: F401  (registers the datamodules)
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    cli = GenRLCLI(args=["--config", str(root / "configs/dfot/shapes.yaml"), "--config",
                         str(root / "configs/dfot/shapes_wrap.yaml"), "--trainer.accelerator=cpu"], run=False)
    assert cli.datamodule.world == ShapesWorldConfig(boundary="wrap", multi_step_prob=0.0)
    assert cli.model.df_mode == "independent" and cli.trainer.default_root_dir.endswith("runs/dfot_shapes_wrap")
    assert cli.trainer.max_steps == 1200  # the wrapping world needs 3x the inside world's 400 steps
    dirs = [getattr(cb, "dirpath", None) for cb in cli.trainer.callbacks]
    assert all(d is None or "dfot_shapes_wrap" in str(d) for d in dirs) and any(d is not None for d in dirs)
