"""Contracts of the shapes-world verifier rewards, genrl/rewards/shapes.py (issue 51: mutation survivors of that file).

Each test checks one contract with tiny hand-built inputs and hand-computed (or float64) expected values: the
circular centroid and the temperature rule, the least-squares track velocity, :func:`score_windows`' windows and
argument checks, the verifier's construction (attribute subsets, calibration on crafted measurements, buffers, repr),
its pixel measurements (window, empty frames, non-empty threshold, brightness invariance), its scores (closed-form
color probability and consistency, segments, frame counts, clamping, device) and the differentiable
:class:`ShapesVideoReward` built on it. Verifiers are built with few calibration renders, so every test is fast.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict

import pytest
import torch

from genrl.data.shapes import PALETTE, ShapeSpec, ShapesWorldConfig, caption, render, sample_seed
from genrl.rewards.shapes import ShapesVerifier, ShapesVideoReward, _circular_mean, _tau, score_windows, track_velocity

DEFAULT = ShapesWorldConfig()
FAST = 2  # calibration renders per shape where the shape prototypes do not matter


def _verifier(world=None, **kwargs) -> ShapesVerifier:
    return ShapesVerifier(world, calibration_samples=kwargs.pop("calibration_samples", FAST), **kwargs)


def _render(world: ShapesWorldConfig, specs: list[ShapeSpec], seed: int = 3) -> tuple[torch.Tensor, list[str]]:
    videos = [render(s, world, torch.Generator().manual_seed(sample_seed(seed, i))) for i, s in enumerate(specs)]
    return torch.stack(videos), [caption(s) for s in specs]


def _blank(t: int, h: int = 16, w: int = 16) -> torch.Tensor:
    return torch.zeros(1, t, 3, h, w)


def _paint(x: torch.Tensor, frame: int, cols: range | list[int], rows: range | list[int],
           rgb: tuple[float, float, float] = (0.6, 0.0, 0.0)) -> None:
    """Paint pixels (col, row) of one frame of a [1, T, 3, H, W] video. Intensity 0.6 gives the foreground weight
    0.6 - 0.1 = 0.5 exactly in float32 (black background, median 0), so masses and centroids below are exact."""
    for c in cols:
        for r in rows:
            x[0, frame, :, r, c] = torch.tensor(rgb)


# ---------------------------------------------------------------------------------------------- helpers
def test_circular_mean_antipode_empty_profile_and_finite_gradient():
    """The circular mean is the weights' mean angle in [0, period): a pair at -3 and +3 on a period of 8 has its mean
    at the antipode of 0 (4, where the sine sum is exactly 0 and the cosine sum negative), one weight at 2.5 gives
    2.5, equal weights at pixels 0 and 1 of a period of 4 (or 0 and 2 of 6) give their midpoint 1 (1.5) where the
    cosine sum is exactly 0, and an all-zero profile gives 0 with finite gradients."""
    pair = _circular_mean(torch.tensor([[1.0, 1.0]]), torch.tensor([-3.0, 3.0]), 8.0)
    assert pair.item() == pytest.approx(4.0, abs=1e-5)
    one = _circular_mean(torch.tensor([[0.0, 2.0, 0.0]]), torch.tensor([0.5, 2.5, 6.5]), 8.0)
    assert one.item() == pytest.approx(2.5, abs=1e-5)
    # cosine sums that are exactly 0 with a non-zero sine sum (sqrt 2, and exactly 1): the mean is at a quarter turn
    quarter = _circular_mean(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), torch.arange(4.0) + 0.5, 4.0)
    assert quarter.item() == pytest.approx(1.0, abs=1e-5)
    sixth = _circular_mean(torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0, 0.0]]), torch.arange(6.0) + 0.5, 6.0)
    assert sixth.item() == pytest.approx(1.5, abs=1e-5)
    profile = torch.zeros(2, 8, requires_grad=True)
    mean = _circular_mean(profile, torch.arange(8.0) + 0.5, 8.0)
    assert mean.tolist() == [0.0, 0.0]
    mean.sum().backward()
    assert torch.isfinite(profile.grad).all()


def test_tau_closed_form_and_degenerate_cases():
    """tau = dmin^2 / ln((K - 1) / eps) (a sample at its prototype scores 1 / (1 + eps) against one rival at dmin); one
    class or coinciding prototypes (dmin = 0) give tau = 1."""
    assert _tau(2.0, 3, 0.01) == pytest.approx(4.0 / math.log(200.0), rel=1e-12)
    assert _tau(0.0, 3, 0.01) == 1.0
    assert _tau(0.5, 1, 0.01) == 1.0
    tau = _tau(1.0, 2, 0.01)
    assert 1.0 / (1.0 + math.exp(-1.0 / tau)) == pytest.approx(1.0 / 1.01, rel=1e-12)


# ---------------------------------------------------------------------------------------------- track_velocity
def test_track_velocity_two_frames_dtype_and_large_offsets():
    """Two adjacent masked frames (time variance 0.5 < 1) give the exact slope and count as a fit; the velocity keeps
    the track's dtype (bfloat16 in, bfloat16 out); a float32 track far from the origin (unwrapped tracks of long
    wrap-world videos drift) over irregular frames keeps its slope to 1e-5 px / frame: the fit subtracts the masked
    means of t and of the track (an uncentered or wrongly centered sum loses 1e-3 and more to float32 rounding)."""
    track = torch.tensor([[[0.0, 0.0], [2.0, 5.0], [4.0, -1.0], [9.0, 9.0]]])
    vel, ok = track_velocity(track, torch.tensor([[False, True, True, False]]))
    assert vel.tolist() == [[2.0, -6.0]] and ok.tolist() == [True]
    bf = track_velocity(track.to(torch.bfloat16), torch.ones(1, 4, dtype=torch.bool))[0]
    assert bf.dtype == torch.bfloat16
    t = torch.arange(9, dtype=torch.float64)
    far = torch.stack([100000.5 + 1.5 * t, 70000.25 - 0.75 * t], -1)[None].float()  # exact in float32
    mask = torch.tensor([[True, True, False, True, True, False, True, False, False]])
    vel, ok = track_velocity(far, mask)
    assert ok.tolist() == [True]
    assert vel[0].tolist() == pytest.approx([1.5, -0.75], abs=1e-5)


def test_track_velocity_runs_on_the_tracks_device():
    """Every intermediate lives on the track's device (checked on the meta device): outputs on it, right shapes."""
    vel, ok = track_velocity(torch.zeros(3, 5, 2, device="meta"), torch.ones(3, 5, dtype=torch.bool, device="meta"))
    assert (vel.device.type, ok.device.type, tuple(vel.shape), tuple(ok.shape)) == ("meta", "meta", (3, 2), (3,))


# ---------------------------------------------------------------------------------------------- score_windows
class _Recorder:
    """A protocol-like reward without a ``world``: records each window's frames and returns their first frame index
    (stored in the pixels) as the reward."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def __call__(self, video: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        self.lengths.append(video.shape[1])
        return {"reward": video[:, 0, 0, 0, 0].clone(), "valid": torch.ones(video.shape[0], dtype=torch.bool)}


def _numbered(b: int, t: int) -> torch.Tensor:
    return torch.arange(t, dtype=torch.float32).view(1, t, 1, 1, 1).expand(b, t, 3, 2, 2).clone()


def test_score_windows_counts_and_places_every_window():
    """n_windows = (T - window) // stride + 1 full windows starting at k * stride (the remainder is left out); window
    = T gives one window; window = 1 is allowed; a verifier without a ``world`` is accepted."""
    rec = _Recorder()
    out = score_windows(rec, _numbered(2, 5), ["a", "b"], window=2, stride=1)
    assert out["reward"].tolist() == [[0.0, 1.0, 2.0, 3.0]] * 2 and rec.lengths == [2, 2, 2, 2]
    assert out["valid"].dtype == torch.bool and out["valid"].shape == (2, 4)
    rec = _Recorder()
    assert score_windows(rec, _numbered(1, 7), ["a"], window=3, stride=2)["reward"].tolist() == [[0.0, 2.0, 4.0]]
    assert rec.lengths == [3, 3, 3]
    assert score_windows(_Recorder(), _numbered(1, 5), ["a"], window=5)["reward"].tolist() == [[0.0]]
    assert score_windows(_Recorder(), _numbered(1, 3), ["a"], window=1)["reward"].tolist() == [[0.0, 1.0, 2.0]]


def test_score_windows_rejects_bad_arguments_naming_them():
    """A non-tensor or wrong-rank video, a bool / float / < 1 window or stride and a window longer than the video are
    ValueErrors whose message names the argument and the offending value (the video's shape or type)."""
    video = _numbered(1, 4)
    with pytest.raises(ValueError, match=r"got \(1, 4, 3, 2\)"):
        score_windows(_Recorder(), video[..., 0], ["a"], window=2)
    with pytest.raises(ValueError, match="got list"):
        score_windows(_Recorder(), [[0.0]], ["a"], window=2)
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=rf"window must be an int >= 1, got {bad!r}"):
            score_windows(_Recorder(), video, ["a"], window=bad)
    with pytest.raises(ValueError, match=r"stride must be an int >= 1, got False"):
        score_windows(_Recorder(), video, ["a"], window=2, stride=False)
    with pytest.raises(ValueError, match=r"window=5 frames is longer than the video \(T=4\)"):
        score_windows(_Recorder(), video, ["a"], window=5)


# ---------------------------------------------------------------------------------------------- construction
def test_attributes_are_validated_and_select_the_reward():
    """``attributes`` must be a non-empty subset of REWARD_ATTRIBUTES (else ValueError); the reward is the mean of the
    listed soft scores that apply to each caption (speed + color for a moving caption, color alone for a still one),
    and NaN (invalid) when none applies; the other keys are unchanged."""
    for bad in ([], ["color", "bogus"]):
        with pytest.raises(ValueError, match="non-empty subset"):
            _verifier(attributes=bad)
    specs = [ShapeSpec("red", "square", ("right",), "fast"), ShapeSpec("blue", "circle", ("still",)),
             ShapeSpec("green", "triangle", ("left",), "slow")]
    pixels, captions = _render(DEFAULT, specs)
    out = _verifier(attributes=("speed", "color"))(pixels, captions)
    assert set(out) == set(ShapesVerifier.dimensions) | {"valid"}
    expected = torch.stack([(out["speed"][0] + out["color"][0]) / 2, out["color"][1],
                            (out["speed"][2] + out["color"][2]) / 2])
    assert float(out["color"].min()) > 0.5 and float(out["speed"][0]) > 0.5
    assert torch.allclose(out["reward"], expected, rtol=0, atol=1e-7)
    full = _verifier()(pixels, captions)
    assert torch.equal(full["color"], out["color"]) and torch.equal(full["speed"].nan_to_num(-1),
                                                                    out["speed"].nan_to_num(-1))
    only = _verifier(attributes=["speed"])(pixels, captions)
    assert only["reward"][1].isnan() and only["valid"].tolist() == [True, False, True]
    assert torch.equal(only["reward"][[0, 2]], out["speed"][[0, 2]])


def test_buffers_are_not_saved_and_repr_names_the_configuration():
    """The verifier's prototypes are rebuilt from the world at construction, so they are non-persistent buffers (an
    empty state_dict: a module holding the reward loads old checkpoints); extra_repr names the world and the
    attribute subset."""
    v = _verifier()
    assert v.state_dict() == {} and ShapesVideoReward().state_dict() == {}
    assert {name for name, _ in v.named_buffers()} == {"palette", "direction_protos", "speed_values", "shape_protos",
                                                       "shape_scale"}
    base = "name='shapes', differentiable=False, scale=1.0, shift=0.0"
    assert v.extra_repr() == f"{base}, world={asdict(DEFAULT)}"
    assert _verifier(attributes=["color"]).extra_repr() == f"{base}, world={asdict(DEFAULT)}, attributes=['color']"


def test_image_world_without_speeds_builds_and_scores():
    """An image world (num_frames = 1) needs no speeds (ShapesWorldConfig accepts ``speeds={}``); the verifier builds
    for it (every direction prototype still, unused in image mode) and scores a matching image near 1."""
    world = ShapesWorldConfig(num_frames=1, speeds={})
    v = _verifier(world)
    assert torch.equal(v.direction_protos, torch.zeros_like(v.direction_protos))
    pixels, captions = _render(world, [ShapeSpec("red", "square")])
    out = v(pixels, captions)
    assert out["valid"].tolist() == [True] and float(out["color"][0]) > 0.9


def _crafted(shapes: list[str], feats: list[list[list[float]]], masses: list[list[float]]) -> ShapesVerifier:
    """A verifier of an image world whose calibration measurements are replaced by crafted ones: ``feats[k]`` the
    (anisotropy, skewness) features of shape k's calibration renders, ``masses[k]`` their masses."""
    queue = [(torch.tensor(f), torch.tensor(m)[:, None]) for f, m in zip(feats, masses)]

    class Crafted(ShapesVerifier):
        def measure(self, pixels, _calibrating=False):
            if _calibrating:
                f, m = queue.pop(0)
                return {"shape_features": f, "mass": m}
            return super().measure(pixels, _calibrating)

    return Crafted(ShapesWorldConfig(num_frames=1, shapes=shapes), calibration_samples=len(feats[0]))


def _min_truth_prob(v: ShapesVerifier, feats: list[list[list[float]]], tau: float) -> float:
    z = torch.tensor(feats, dtype=torch.float64).flatten(0, 1) / v.shape_scale.double()
    d2 = torch.cdist(z, v.shape_protos.double()) ** 2
    truth = torch.arange(len(feats)).repeat_interleave(len(feats[0]))
    return float(torch.softmax(-d2 / tau, 1).gather(1, truth[:, None]).min())


def test_shape_calibration_prototypes_scale_mass_and_temperature():
    """Calibration on crafted measurements: prototypes are the per-shape mean features divided by the prototypes'
    unbiased std per feature (floored at 0.1), reference_mass is the smallest per-shape mean mass, tau starts at
    dmin^2 / ln(100) for two shapes and is multiplied by 0.8 until every calibration sample scores >= 0.97 (here 2
    steps: the largest such tau on that grid); separable samples raise no warning."""
    s = 0.135
    feats = [[[1.0 - s, 0.5], [1.0 + s, 0.5]], [[1.6 - s, 0.5], [1.6 + s, 0.5]]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = _crafted(["circle", "square"], feats, [[10.0, 12.0], [9.0, 9.5]])
    spread = 0.6 / math.sqrt(2)
    assert v.shape_scale.tolist() == pytest.approx([spread, 0.1], rel=1e-5)
    assert v.shape_protos.flatten().tolist() == pytest.approx([1.0 / spread, 5.0, 1.6 / spread, 5.0], rel=1e-5)
    assert v.reference_mass == pytest.approx(9.25, rel=1e-6)
    tau0 = 2.0 / math.log(100.0)
    assert v.tau_shape == pytest.approx(tau0 * 0.8**2, rel=1e-5)
    assert _min_truth_prob(v, feats, v.tau_shape) >= 0.97 > _min_truth_prob(v, feats, v.tau_shape / 0.8)


def test_shape_calibration_sharpening_stops_after_40_steps():
    """A calibration sample a hair on its own side of the boundary never reaches 0.97: tau is sharpened exactly 40
    times (tau0 * 0.8^40) and no warning is raised (every sample is still classified correctly)."""
    feats = [[[0.0, 0.5], [1.99999, 0.5]], [[3.0, 0.5], [3.0, 0.5]]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = _crafted(["circle", "square"], feats, [[9.0, 9.0], [9.0, 9.0]])
    dmin = float(v.shape_protos[1, 0] - v.shape_protos[0, 0])
    assert v.tau_shape == pytest.approx(dmin**2 / math.log(100.0) * 0.8**40, rel=1e-5)


def test_shape_calibration_accepts_a_sample_at_exactly_097():
    """The sharpening stops once every calibration sample scores >= 0.97 (inclusive): with the least confident sample
    at exactly 0.97 at the starting tau (on this platform; the probability is computed with the verifier's float32
    operations), tau is not lowered; were it below, it would be lowered to a tau where every sample is >= 0.97."""
    s = 0.07355226576328278
    feats = [[[1.0 - s, 0.5], [1.0 + s, 0.5]], [[1.6 - s, 0.5], [1.6 + s, 0.5]]]
    v = _crafted(["circle", "square"], feats, [[9.0, 9.0], [9.0, 9.0]])
    dmin = float(torch.cdist(v.shape_protos[0][None], v.shape_protos[1][None]).min())
    tau0 = dmin * dmin / math.log(100.0)
    z = torch.tensor(feats).flatten(0, 1) / v.shape_scale
    d2 = torch.cdist(z, v.shape_protos) ** 2
    p0 = torch.softmax(-d2 / tau0, dim=-1).gather(1, torch.tensor([[0], [0], [1], [1]])).min()
    assert (v.tau_shape == tau0) == bool(p0 >= 0.97)
    assert _min_truth_prob(v, feats, v.tau_shape) >= 0.97 - 1e-6


def test_non_separable_calibration_warns_with_its_accuracy():
    """A calibration sample nearer another shape's prototype makes the shapes not separable: a UserWarning giving
    the calibration accuracy (3 of 4 samples right: 75.0%), and tau is not sharpened."""
    feats = [[[0.0, 0.5], [1.0, 0.5]], [[0.9, 0.5], [1.1, 0.5]]]
    with pytest.warns(UserWarning, match=r"not separable .* \(calibration accuracy 75\.0%\)"):
        v = _crafted(["circle", "square"], feats, [[9.0, 9.0], [9.0, 9.0]])
    dmin = float(v.shape_protos[1, 0] - v.shape_protos[0, 0])
    assert v.tau_shape == pytest.approx(dmin**2 / math.log(100.0), rel=1e-5)


def test_single_shape_world_has_unit_scale_and_certain_shape():
    """With one shape there is no spread: the feature scale is 1 (not a NaN std of one prototype), tau is 1, and the
    shape score of any image with foreground is 1."""
    world = ShapesWorldConfig(num_frames=1, shapes=["circle"])
    v = _verifier(world)
    assert v.shape_scale.tolist() == [1.0, 1.0] and v.tau_shape == 1.0 and torch.isfinite(v.shape_protos).all()
    pixels, captions = _render(world, [ShapeSpec("red", "circle")])
    assert v(pixels, captions)["shape"].tolist() == [1.0]


# ---------------------------------------------------------------------------------------------- measure
def test_measure_window_is_a_closed_box_around_the_object():
    """Foreground outside the box of half-side object_size / 2 + 1.5 = 4.5 px around the centroid is left out (a
    stray pixel 5.5 px away in the object's row, one 13.5 px away across the left / right edge of an "inside"
    world), and pixels exactly 4.5 px away (in x or in y) are in: exact masses and centroids."""
    v = _verifier()
    x = _blank(4)
    block = (range(4, 8), range(4, 8))  # centroid (6, 6), mass 8
    _paint(x, 0, *block)
    _paint(x, 0, [11], [5])  # 5.5 px right of the centroid, in the object's rows
    _paint(x, 1, range(0, 4), range(4, 8))  # centroid (2, 6)
    _paint(x, 1, [15], [9])  # 13.5 px right: its nearest periodic image would be 2.5 px left
    _paint(x, 2, *block)
    _paint(x, 2, [1], [5])
    _paint(x, 2, [10], [6])  # 4.5 px left and right of x = 6
    _paint(x, 3, *block)
    _paint(x, 3, [5], [1])
    _paint(x, 3, [6], [10])  # 4.5 px above and below y = 6
    m = v.measure(x)
    assert m["mass"][0].tolist() == [8.0, 8.0, 9.0, 9.0]
    assert m["centroid"][0].tolist() == [[6.0, 6.0], [2.0, 6.0], [6.0, 6.0], [6.0, 6.0]]
    assert torch.equal(m["track"], m["centroid"])


def test_measure_centroid_of_empty_and_faint_frames():
    """An empty frame's centroid is the frame center (W / 2, H / 2) (non-square: 6, 4); a faint one-pixel frame
    (mass 0.5) has its centroid at that pixel's center; neither counts as non-empty."""
    v = _verifier(ShapesWorldConfig(height=8, width=12, num_frames=1))
    x = _blank(2, 8, 12)
    _paint(x, 1, [3], [5])
    m = v.measure(x)
    assert m["centroid"][0].tolist() == [[6.0, 4.0], [3.5, 5.5]]
    assert m["mass"][0].tolist() == [0.0, 0.5] and m["nonempty"][0].tolist() == [False, False]


def test_measure_nonempty_threshold_is_a_fifth_of_the_reference_mass():
    """A frame is non-empty when its mass is >= 0.2 * reference_mass (the smallest calibrated object mass): with
    reference_mass 20, mass 4.0 (8 pixels) is non-empty, 3.5 (7 pixels) is not."""
    v = _verifier()
    v.reference_mass = 20.0
    x = _blank(2)
    _paint(x, 0, range(4, 8), range(4, 6))
    _paint(x, 1, range(4, 8), range(4, 6))
    x[0, 1, :, 5, 7] = 0.0
    m = v.measure(x)
    assert m["mass"][0].tolist() == [4.0, 3.5] and m["nonempty"][0].tolist() == [True, False]


def test_calibration_measure_counts_frames_from_a_fifth_of_a_quarter_box():
    """While calibrating (no reference mass yet) a frame is non-empty from 0.2 * object_size^2 / 4 = 1.8 (object
    size 6): mass 1.5 is empty, mass 2.0 is not."""
    v = _verifier()
    x = _blank(2)
    _paint(x, 0, range(4, 7), [5])
    _paint(x, 1, range(4, 8), [5])
    m = v.measure(x, _calibrating=True)
    assert m["mass"][0].tolist() == [1.5, 2.0] and m["nonempty"][0].tolist() == [False, True]


def _moments(pixels: list[tuple[int, int]]) -> tuple[float, float]:
    """float64 reference (anisotropy, skewness) of equal weights at pixel (col, row) centers."""
    xs = [c + 0.5 for c, _ in pixels]
    ys = [r + 0.5 for _, r in pixels]
    cx, cy = sum(xs) / len(xs), sum(ys) / len(ys)
    dx = [x - cx for x in xs]
    dy = [y - cy for y in ys]

    def e(vals):
        return sum(vals) / len(vals)

    x4, y4 = e([a**4 for a in dx]), e([b**4 for b in dy])
    u4 = e([((a + b) / math.sqrt(2)) ** 4 for a, b in zip(dx, dy)])
    v4 = e([((a - b) / math.sqrt(2)) ** 4 for a, b in zip(dx, dy)])
    return (u4 + v4) / (x4 + y4), e([b**3 for b in dy]) / e([b**2 for b in dy]) ** 1.5


def test_measure_features_and_chroma_are_brightness_invariant_for_small_faint_objects():
    """Shape features (diagonal anisotropy, vertical skewness) and chroma (the color scaled to max channel 1) are
    normalised by the object's own mass: a small L-shaped object (moments < 1 px^4) gives the float64 reference
    features and chroma (1, 0.5, 0) both bright (mass 2) and faint (mass 0.25, counted as non-empty here)."""
    v = _verifier(ShapesWorldConfig(num_frames=1))
    v.reference_mass = 1.0
    pixels = [(5, 5), (6, 5), (5, 6), (5, 7)]
    ref = _moments(pixels)
    for peak in (0.6, 0.1 + 2.0**-4):
        x = _blank(1)
        for c, r in pixels:
            x[0, 0, :, r, c] = torch.tensor([peak, peak / 2, 0.0])
        m = v.measure(x)
        assert m["nonempty"].tolist() == [[True]]
        assert m["shape_features"][0].tolist() == pytest.approx(ref, rel=1e-4, abs=1e-5)
        assert m["chroma"][0].tolist() == pytest.approx([1.0, 0.5, 0.0], abs=1e-5)
        assert m["frame_chroma"][0, 0].tolist() == pytest.approx([1.0, 0.5, 0.0], abs=1e-5)


# ---------------------------------------------------------------------------------------------- scores
def test_color_probability_closed_form():
    """P(red) = exp(-|red - c|^2 / tau) / sum_k exp(-|c_k - c|^2 / tau) over the default palette for the object's
    chroma c, with tau = 1 / ln(5 / 0.01) (nearest palette colors at distance 1): for a pure red object (c = red)
    and for one halfway to yellow (c = (1, 0.5, 0), P(red) just under 1/2)."""
    world = ShapesWorldConfig(num_frames=1)
    v = _verifier(world)
    tau = 1.0 / math.log(500.0)
    assert v.tau_color == pytest.approx(tau, rel=1e-6)
    red = torch.tensor(PALETTE["red"], dtype=torch.float64)
    d2 = [float(((torch.tensor(PALETTE[c], dtype=torch.float64) - red) ** 2).sum()) for c in world.colors]
    expected = 1.0 / sum(math.exp(-d / tau) for d in d2)
    x = _blank(1)
    _paint(x, 0, range(5, 10), range(5, 10))
    out = v(x, ["a red square"])
    assert out["color"].item() == pytest.approx(expected, rel=1e-5)
    # chroma (1, 0.5, 0): halfway between red and yellow (squared distance 0.25 to each)
    half = torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    d2 = [float(((torch.tensor(PALETTE[c], dtype=torch.float64) - half) ** 2).sum()) for c in world.colors]
    _paint(x, 0, range(5, 10), range(5, 10), (0.6, 0.3, 0.0))
    out = v(x, ["a red square"])
    assert out["color"].item() == pytest.approx(math.exp(-0.25 / tau) / sum(math.exp(-d / tau) for d in d2), rel=1e-5)


def test_consistency_closed_forms():
    """consistency = exp(-(r_mass^2 + r_color^2) / (2 * 0.2^2)): the same object lit in 2 of 8 frames (mean mass
    0.875 < 1) has r_mass = sqrt(3) exactly and r_color = 0; a constant-mass object red in 4 frames and yellow in 4
    has r_mass = 0 and r_color = |red - yellow| / 2 = 0.5."""
    v = _verifier()
    flicker = _blank(8)
    for f in (2, 5):
        _paint(flicker, f, range(5, 9), range(5, 7))
        flicker[0, f, :, 6, 8] = 0.0  # 7 pixels: mass 3.5, non-empty
    color = _blank(8)
    for f in range(8):
        _paint(color, f, range(5, 9), range(5, 9), (0.6, 0.6 if f % 2 else 0.0, 0.0))
    out = v(torch.cat([flicker, color]), ["a red square staying still"] * 2)
    assert out["consistency"][0].item() == pytest.approx(math.exp(-3.0 / 0.08), rel=1e-4, abs=0)
    assert out["consistency"][1].item() == pytest.approx(math.exp(-0.25 / 0.08), rel=1e-5)


def test_still_object_under_a_fast_caption_speed_closed_form():
    """A still object (velocity exactly 0) has speed norm 0, so with speeds 0.6 and 1.2 and tau = 0.6^2 / ln(100),
    P(fast) = 1 / (1 + exp((1.2^2 - 0.6^2) / tau)) = 1 / (1 + 100^3) exactly (no smoothing in the exact
    verifier)."""
    x = _blank(8)
    for f in range(8):
        _paint(x, f, range(5, 9), range(5, 9))
    out = _verifier()(x, ["a red square moving left quickly"])
    assert out["speed"].item() == pytest.approx(1.0 / (1.0 + 1e6), rel=2e-6, abs=0)


def test_two_frame_videos_score_motion():
    """T = 2 is a video: direction, speed and consistency are scored (not NaN) and a clean render scores high."""
    world = ShapesWorldConfig(num_frames=2, multi_step_prob=0.0)
    pixels, captions = _render(world, [ShapeSpec("red", "square", ("right",), "fast")])
    out = _verifier(world)(pixels, captions)
    assert float(out["direction"][0]) > 0.9 and float(out["speed"][0]) > 0.5 and float(out["consistency"][0]) > 0.9


def test_two_step_segments_include_both_ends_on_four_frames():
    """On 4 frames a two-step caption's segments are frames {0, 1} and {2, 3} (turn at 1.5, bounds inclusive): each
    segment has two frames, so both directions are read and followed."""
    world = ShapesWorldConfig(num_frames=4)
    pixels, captions = _render(world, [ShapeSpec("red", "square", ("right", "down")),
                                       ShapeSpec("blue", "circle", ("up", "left"))])
    out = _verifier(world)(pixels, captions)
    assert out["direction_correct"].tolist() == [1.0, 1.0]
    assert float(out["step_following"].min()) > 0.9 and float(out["direction"].min()) > 0.9


def test_motionless_captions_on_videos_leave_motion_unscored():
    """A caption without motion ("a red square") on a video scores color and shape only: direction, speed and
    step_following are NaN, also in a world with a single direction (where a two-step caption next to a single-step
    one is scored too)."""
    for world in (DEFAULT, ShapesWorldConfig(directions=["left"], multi_step_prob=0.0)):
        pixels, captions = _render(world, [ShapeSpec("red", "square", ("left",), "slow"), ShapeSpec("red", "square")])
        out = _verifier(world)(pixels, ["a red square", "a red square moving left slowly"])
        assert out["direction"][0].isnan() and out["speed"][0].isnan() and out["step_following"][0].isnan()
        assert not out["direction"][1].isnan() and out["valid"].all()
    # one direction class: a two-step caption scores its segments while the single-step row is left alone
    out = _verifier(world)(pixels, ["a red square moves left, then moves left", "a red square moving left slowly"])
    assert out["step_following"][1].isnan() and float(out["direction"][1]) == 1.0 and out["valid"].all()


def test_pixels_within_the_range_tolerance_score_as_clamped():
    """Pixels at most RANGE_TOLERANCE outside [0, 1] pass the protocol's check and are clamped before scoring: every
    output of the verifier and of ShapesVideoReward equals that of the clamped video (values 1.0009 and -0.0009 in
    alternate frames would otherwise change mass, chroma and consistency)."""
    x = _blank(8)
    for f in range(8):
        _paint(x, f, range(5, 9), range(5, 9), (1.0, 0.0, 0.0))
    bent = x.clone()
    bent[0, ::2, 0] = torch.where(bent[0, ::2, 0] == 1.0, 1.0009, bent[0, ::2, 0])
    bent[0, 1::2, 1:] = -0.0009
    bent[0, 1::2, 0] = torch.where(bent[0, 1::2, 0] == 0.0, -0.0009, bent[0, 1::2, 0])
    prompts = ["a red square staying still"]
    for reward in (_verifier(), ShapesVideoReward()):
        a, b = reward(x, prompts), reward(bent, prompts)
        for key in a:
            assert torch.equal(a[key].nan_to_num(-7.0), b[key].nan_to_num(-7.0)), (type(reward).__name__, key)
    assert float(_verifier()(x, prompts)["consistency"][0]) == 1.0


MIXED = ["a red circle moving left slowly", "a red circle staying still", "a red circle moves right, then moves up",
         "a red circle"]


def _on_meta(world: ShapesWorldConfig) -> None:
    v = _verifier(world).to("meta")
    out = v(torch.zeros(4, 8, 3, 16, 16), MIXED)
    assert {t.device.type for t in out.values()} == {"meta"} and out["reward"].shape == (4,)
    assert {t.device.type for t in v.measure(torch.zeros(2, 8, 3, 16, 16, device="meta")).values()} == {"meta"}


def test_scores_run_where_the_verifier_lives():
    """score() moves the pixels to the verifier's device and every intermediate follows (checked on the meta device):
    single-step, still, multi-step and motionless captions on an inside world, and an image."""
    _on_meta(DEFAULT)
    image = _verifier(ShapesWorldConfig(num_frames=1)).to("meta")(torch.zeros(1, 1, 3, 16, 16), ["a red circle"])
    assert {t.device.type for t in image.values()} == {"meta"}


def test_wrap_world_and_video_reward_run_where_they_live():
    """The same on a wrap world (circular centroids, unwrapped tracks) and for ShapesVideoReward (meta device)."""
    _on_meta(ShapesWorldConfig(boundary="wrap"))
    vr = ShapesVideoReward().to("meta")(torch.zeros(4, 8, 3, 16, 16), MIXED)
    assert {t.device.type for t in vr.values()} == {"meta"}


# ---------------------------------------------------------------------------------------------- ShapesVideoReward
def test_video_reward_dimensions_per_sample_and_scale_shift():
    """ShapesVideoReward per sample: visual_quality = (max_k P(color k) + max_k P(shape k)) / 2 (0 for a black video),
    text_alignment = the verifier's mean of the stated soft scores (within 1e-6, also for a still object under a
    moving caption, where the smoothed speed norm sits at 0), reward = scale * mean of the three + shift."""
    world = DEFAULT
    pixels, _ = _render(world, [ShapeSpec("red", "square", ("right",), "fast"), ShapeSpec("red", "square", ("still",))])
    pixels = torch.cat([pixels, torch.zeros_like(pixels[:1])])
    prompts = ["a red square moving right quickly", "a red square moving left slowly", "a red square staying still"]
    vr = ShapesVideoReward(world, scale=2.0, shift=0.5)
    out = vr(pixels, prompts)
    ref = vr.verifier(pixels, prompts)
    stated = torch.stack([ref[k] for k in ("color", "shape", "direction", "speed", "step_following")], 1)
    assert torch.allclose(out["text_alignment"], stated.nanmean(1), atol=1e-6, rtol=0)
    assert out["visual_quality"][2].item() == 0.0 and float(out["visual_quality"][:2].min()) > 0.9
    raw = torch.stack([out["visual_quality"], out["motion_quality"], out["text_alignment"]], 1).mean(1)
    assert torch.allclose(out["reward"], 2.0 * raw + 0.5, atol=1e-6, rtol=0)


def test_video_reward_parses_captions_for_its_own_world():
    """Captions are parsed with the reward's world: a vocabulary beyond the default one (orange, pink) is understood
    and scored."""
    world = ShapesWorldConfig(colors=["orange", "pink"], multi_step_prob=0.0)
    pixels, prompts = _render(world, [ShapeSpec("orange", "square", ("left",), "slow")])
    out = ShapesVideoReward(world)(pixels, prompts)
    assert out["valid"].all() and float(out["text_alignment"][0]) > 0.9
