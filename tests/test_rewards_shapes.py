"""The reward protocol, the registry and the shapes-world verifier (genrl.rewards)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from genrl.data.shapes import ShapeSpec, ShapesWorldConfig, caption, render, sample
from genrl.rewards import (
    RewardModel,
    RewardSpec,
    ShapesVerifier,
    UnknownRewardError,
    available_rewards,
    build_reward,
    register_reward,
)

WORLD = ShapesWorldConfig()
ATTRIBUTE_KEYS = ("color", "shape", "direction", "speed", "step_following", "consistency")


@pytest.fixture(scope="module")
def verifier() -> ShapesVerifier:
    return build_reward("shapes", world=WORLD)


@pytest.fixture(scope="module")
def ground_truth():
    """240 samples of every kind (split "all"): single-step moving, still, multi-step."""
    pixels, captions, specs = zip(*[sample(WORLD, 11, i, "all") for i in range(240)])
    return torch.stack(pixels), list(captions), list(specs)


def _stats(x: torch.Tensor) -> tuple[float, float, int]:
    x = x[~x.isnan()]
    return float(x.mean()), float(x.min()), len(x)


# ---------------------------------------------------------------------------------------------- must-show
def test_ground_truth_matching_captions_score_high_on_every_attribute(verifier, ground_truth):
    pixels, captions, specs = ground_truth
    assert sum(s.multi_step for s in specs) >= 30 and sum(s.directions == ("still",) for s in specs) >= 20
    out = verifier(pixels, captions)
    assert set(out) == set(ShapesVerifier.dimensions) | {"valid"}
    assert out["valid"].all() and out["valid"].dtype == torch.bool
    print("\nground truth, matching captions (mean / min / n):")
    for key in ("reward", *ATTRIBUTE_KEYS, "all_correct"):
        mean, low, n = _stats(out[key])
        print(f"  {key:15s} {mean:.4f} / {low:.4f} / {n}")
        assert n > 0 and mean >= 0.95 and low >= 0.95, key
    assert float(out["all_correct"].mean()) == 1.0
    # applicability: NaN exactly where the caption does not state the attribute
    single = torch.tensor([len(s.directions) == 1 for s in specs])
    multi = torch.tensor([s.multi_step for s in specs])
    stated_speed = torch.tensor([s.speed is not None for s in specs])
    assert torch.equal(out["speed"].isnan(), ~stated_speed)
    assert torch.equal(out["step_following"].isnan(), ~multi)
    assert not out["direction"].isnan().any() and (single | multi).all()


def _replace(spec: ShapeSpec, attribute: str, value: str, world: ShapesWorldConfig) -> ShapeSpec:
    if attribute == "color":
        return ShapeSpec(value, spec.shape, spec.directions, spec.speed)
    if attribute == "shape":
        return ShapeSpec(spec.color, value, spec.directions, spec.speed)
    if attribute == "direction":  # single-step: keep the stated speed when it still applies
        speed = None if value == "still" else (spec.speed or "slow")
        return ShapeSpec(spec.color, spec.shape, (value,), speed)
    if attribute == "speed":
        return ShapeSpec(spec.color, spec.shape, spec.directions, value)
    raise AssertionError(attribute)


@pytest.mark.parametrize("attribute", ["color", "shape", "direction", "speed"])
def test_mismatched_captions_score_at_chance(verifier, ground_truth, attribute):
    pixels, _, specs = ground_truth
    values = {"color": WORLD.colors, "shape": WORLD.shapes, "direction": WORLD.directions,
              "speed": list(WORLD.speeds)}[attribute]
    k = len(values)
    keep = [i for i, s in enumerate(specs) if len(s.directions) == 1 and (attribute != "speed" or s.speed)]
    pixels, specs = pixels[keep], [specs[i] for i in keep]
    n = len(specs)
    # (a) a uniformly random value of the attribute: mean score and argmax hit rate near 1 / K
    g = torch.Generator().manual_seed(0)
    random_values = [values[j] for j in torch.randint(k, (n,), generator=g).tolist()]
    out = verifier(pixels, [caption(_replace(s, attribute, v, WORLD)) for s, v in zip(specs, random_values)])
    mean, hit = float(out[attribute].mean()), float(out["all_correct"].mean())
    tol = 3 * math.sqrt((1 / k) * (1 - 1 / k) / n)  # 3 standard errors of a 1/K Bernoulli mean
    print(f"\nmismatched {attribute}: K={k} chance={1 / k:.3f} mean score={mean:.3f} "
          f"all_correct={hit:.3f} (n={n}, tol={tol:.3f})")
    assert abs(mean - 1 / k) < tol and abs(hit - 1 / k) < tol
    # (b) averaged over every value of the attribute the soft score is exactly chance (probabilities sum to 1)
    per_value = torch.stack([
        verifier(pixels, [caption(_replace(s, attribute, v, WORLD)) for s in specs])[attribute] for v in values
    ])
    assert torch.allclose(per_value.mean(0), torch.full((n,), 1 / k), atol=1e-4)
    # every wrong value alone scores low
    for j, v in enumerate(values):
        wrong = torch.tensor([getattr(s, attribute, None) != v if attribute != "direction" else s.directions[0] != v
                              for s in specs])
        assert float(per_value[j][wrong].max()) < 0.05, (attribute, v)


def test_robust_to_blur_and_noise(verifier, ground_truth):
    """Gaussian blur sigma = 0.8 px then additive Gaussian noise std 0.05 (clamped to [0, 1])."""
    pixels, captions, _ = ground_truth
    sigma, r = 0.8, 3
    k = torch.exp(-(torch.arange(-r, r + 1).float() ** 2) / (2 * sigma**2))
    k = k / k.sum()
    b, t, c, h, w = pixels.shape
    x = pixels.reshape(-1, 1, h, w)
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    x = F.conv2d(F.pad(x, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))
    noisy = (x.reshape(b, t, c, h, w) + 0.05 * torch.randn(pixels.shape, generator=torch.Generator().manual_seed(1)))
    out = verifier(noisy.clamp(0, 1), captions)
    print("\nblur 0.8 px + noise 0.05 (mean / min):",
          {key: tuple(round(v, 3) for v in _stats(out[key])[:2]) for key in ("reward", *ATTRIBUTE_KEYS)})
    for key in ("color", "direction", "speed", "step_following", "consistency"):
        mean, low, _ = _stats(out[key])
        assert mean >= 0.95 and low >= 0.9, key
    assert _stats(out["shape"])[0] >= 0.8  # shape is the fragile attribute at 16x16: blur rounds corners
    assert out["valid"].all()


# ---------------------------------------------------------------------------------------------- semantics
def test_empty_frames_are_bad_samples_not_failures(verifier):
    caps = ["a red circle moving left slowly", "a blue square moves up, then moves left"]
    out = verifier(torch.zeros(2, 8, 3, 16, 16), caps)
    assert out["valid"].all()
    for key in ("reward", "color", "shape", "direction", "consistency", "all_correct"):
        assert torch.equal(out[key], torch.zeros(2)), key
    assert out["speed"][0] == 0 and out["step_following"][1] == 0


def test_nan_pixels_give_nan_and_invalid_not_zero(verifier):
    px, cap, _ = sample(WORLD, 0, 0)
    batch = torch.stack([px, px.clone()])
    batch[1, 3, 0, 5, 5] = float("nan")
    out = verifier(batch, [cap, cap])
    assert out["valid"].tolist() == [True, False]
    for key in ShapesVerifier.dimensions:
        assert torch.isnan(out[key][1]), key
    assert out["reward"][0] > 0.95


def test_consistency_detects_flicker_and_color_change(verifier):
    g = torch.Generator().manual_seed(0)
    clean = render(ShapeSpec("red", "circle", ("right",), "slow"), WORLD, g)
    flicker = clean.clone()
    flicker[[2, 5]] = 0
    recolored = clean.clone()
    recolored[4:, 1] = recolored[4:, 0]  # red -> yellow halfway
    cap = "a red circle moving right slowly"
    out = verifier(torch.stack([clean, flicker, recolored]), [cap] * 3)
    assert out["consistency"][0] > 0.95 and out["consistency"][1] < 0.3 and out["consistency"][2] < 0.3


def test_image_mode_verifier():
    world = ShapesWorldConfig(num_frames=1)
    v = ShapesVerifier(world)
    pixels, caps, _ = zip(*[sample(world, 0, i) for i in range(40)])
    out = v(torch.stack(pixels), list(caps))
    assert out["color"].min() > 0.95 and out["shape"].min() > 0.95 and out["all_correct"].mean() == 1
    for key in ("direction", "speed", "step_following", "consistency"):
        assert out[key].isnan().all()
    with pytest.raises(ValueError, match="states motion but the pixels have a single frame"):
        v(torch.stack(pixels[:1]), ["a red circle moving left slowly"])


def test_other_worlds_self_calibrate():
    world = ShapesWorldConfig(height=32, width=32, object_size=10.0, shapes=["circle", "square", "triangle", "diamond"],
                              colors=["red", "crimson", "orange", "white"], speeds={"slow": 1.0, "fast": 2.5})
    v = ShapesVerifier(world)
    pixels, caps, _ = zip(*[sample(world, 0, i, "all") for i in range(60)])
    out = v(torch.stack(pixels), list(caps))
    assert out["all_correct"].mean() == 1 and out["reward"].min() > 0.95


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors(verifier):
    px = torch.rand(2, 8, 3, 16, 16)
    caps = ["a red circle staying still"] * 2
    with pytest.raises(ValueError, match=r"\[B, T, C, H, W\].*\(2, 3, 16, 16\).*unsqueeze\(1\)"):
        verifier(px[:, 0], caps)
    with pytest.raises(ValueError, match=r"C=8 in shape \(2, 3, 8, 16, 16\).*permute"):
        verifier(px.permute(0, 2, 1, 3, 4), caps)
    with pytest.raises(ValueError, match=r"\[-1, 1\].*\(pixels \+ 1\) / 2"):
        verifier(px * 2 - 1, caps)
    with pytest.raises(ValueError, match=r"\[0, 255\].*pixels / 255"):
        verifier(px * 255, caps)
    with pytest.raises(ValueError, match="float tensor"):
        verifier((px * 255).to(torch.uint8), caps)
    with pytest.raises(ValueError, match="got 1 prompts for a batch of 2"):
        verifier(px, caps[:1])
    with pytest.raises(ValueError, match=r"unknown shape 'hexagon'.*known shapes: circle, square, triangle"):
        verifier(px, ["a red hexagon staying still"] * 2)
    with pytest.raises(ValueError, match=r"unknown color 'purple'"):
        verifier(px, ["a purple circle moving left slowly"] * 2)
    with pytest.raises(ValueError, match="calibrated for 16x16 frames, got 32x32"):
        verifier(torch.rand(1, 8, 3, 32, 32), caps[:1])
    with pytest.raises(ValueError, match=r"unknown color 'purple'.*known colors"):
        build_reward("shapes", world={"colors": ["red", "purple"]})
    verifier(px + 5e-4, caps)  # within the 1e-3 tolerance


def test_registry_errors_and_specs():
    assert "shapes" in available_rewards()
    with pytest.raises(KeyError, match=r"unknown reward 'pickscore_v9'; registered rewards: .*pickscore.*shapes"):
        build_reward("pickscore_v9")
    with pytest.raises(ValueError, match="registered rewards"):
        build_reward("pickscore_v9")
    assert issubclass(UnknownRewardError, KeyError) and issubclass(UnknownRewardError, ValueError)
    with pytest.raises(ValueError, match="loads no weights"):
        build_reward("shapes", path="/weights/shapes.pt")
    with pytest.raises(NotImplementedError, match="'shapes' is not differentiable"):
        build_reward("shapes").saliency(torch.rand(1, 8, 3, 16, 16), ["a red circle staying still"])
    spec = RewardSpec(name="shapes", scale=2.0, shift=-1.0, kwargs={"calibration_samples": 8})
    scaled = spec.build()
    px, cap, _ = sample(WORLD, 0, 1)
    out = scaled(px[None], [cap])
    raw = ShapesVerifier(WORLD)(px[None], [cap])
    assert torch.allclose(out["reward"], 2 * raw["reward"] - 1, atol=1e-3)
    assert torch.allclose(out["color"], raw["color"], atol=1e-3)


class _Brightness(RewardModel):
    """A differentiable toy reward: mean brightness."""

    differentiable = True
    dimensions = ("reward", "red")

    def score(self, pixels, prompts, **meta):
        return {"reward": pixels.mean(dim=(1, 2, 3, 4)), "red": pixels[:, :, 0].mean(dim=(1, 2, 3))}


@pytest.fixture
def brightness_registered():
    from genrl.rewards import registry

    register_reward("_test_brightness")(_Brightness)
    yield
    registry.REWARDS.classes.pop("_test_brightness", None)  # keep the global registry clean for other tests


def test_protocol_with_a_differentiable_reward(brightness_registered):
    with pytest.raises(ValueError, match="already registered"):
        register_reward("_test_brightness")(ShapesVerifier)
    r = build_reward("_test_brightness", scale=3.0)
    px = torch.rand(2, 2, 3, 4, 4)
    px[1, 0, 0, 0, 0] = float("nan")
    out = r(px, ["x", "y"])
    assert out["valid"].tolist() == [True, False] and torch.isnan(out["reward"][1]) and torch.isnan(out["red"][1])
    assert torch.allclose(out["reward"][0], 3 * px[0].mean())
    sal = r.saliency(torch.rand(2, 2, 3, 4, 4), ["x", "y"])["reward"]  # || d(3 mean) / d pixel ||_2 over C
    assert sal.shape == (2, 2, 4, 4) and torch.allclose(sal, torch.full_like(sal, 3.0 / 96 * 3**0.5))
    small = r.saliency(torch.rand(2, 2, 3, 4, 4), ["x", "y"], dims=["reward", "red"], out_shape=(1, 2, 2))
    assert small["reward"].shape == (2, 1, 2, 2)
    assert torch.allclose(small["reward"], torch.full((2, 1, 2, 2), 3.0 / 96 * 3**0.5))
    with pytest.raises(KeyError, match="no output 'blue'"):
        r.saliency(torch.rand(1, 2, 3, 4, 4), ["x"], dims=["blue"])
    with pytest.raises(TypeError):
        RewardModel()  # abstract


def test_track_velocity_is_the_least_squares_slope_over_the_masked_frames():
    """A straight track (1.5, -0.5) px / frame with garbage on unmasked frames gives exactly that slope; one masked
    frame is not ok (velocity 0)."""
    from genrl.rewards.shapes import track_velocity

    t = torch.arange(8, dtype=torch.float64)
    track = torch.stack([3 + 1.5 * t, 10 - 0.5 * t], dim=-1)[None].repeat(2, 1, 1)
    track[:, 2] = 100.0  # off the line, masked out below
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[:, 2] = False
    mask[1] = False
    mask[1, 5] = True
    vel, ok = track_velocity(track, mask)
    assert torch.allclose(vel[0], torch.tensor([1.5, -0.5], dtype=torch.float64), atol=1e-12)
    assert ok.tolist() == [True, False] and torch.equal(vel[1], torch.zeros(2, dtype=torch.float64))
