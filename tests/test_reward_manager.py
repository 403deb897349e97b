"""RewardManager: chunked scoring, combination modes, failures, placement outside the LightningModule."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from lightning.pytorch import LightningModule

from genrl.data.shapes import ShapesWorldConfig
from genrl.data.shapes_datamodule import make_batch
from genrl.rewards import (
    RewardManager,
    RewardModel,
    RewardResult,
    RewardSpec,
    ShapesVerifier,
    UnknownRewardError,
    build_reward,
    build_reward_with_context,
    per_reward_advantages,
    register_reward,
)
from genrl.rewards.manager import ZSCORE_EPS

WORLD = ShapesWorldConfig()
SHAPES = {"name": "shapes", "kwargs": {"calibration_samples": 8}}


# ---------------------------------------------------------------------------------------------- fake rewards
@register_reward("test_mgr_const")
class ConstReward(RewardModel):
    """reward = value (before scale / shift); "aux" = 3 everywhere."""

    dimensions = ("reward", "aux")

    def __init__(self, value: float = 0.25, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.value = value

    def score(self, pixels, prompts, **meta):
        b = pixels.shape[0]
        return {"reward": torch.full((b,), self.value), "aux": torch.full((b,), 3.0)}


@register_reward("test_mgr_mean")
class MeanReward(RewardModel):
    """reward = mean pixel intensity (varies across samples); invalid (NaN) where meta ``bad`` is True;
    raises when a chunk contains a sample with meta ``explode`` True."""

    def score(self, pixels, prompts, bad=None, explode=None, **meta):
        if explode is not None and bool(explode.any()):
            raise RuntimeError("boom")
        r = pixels.float().mean(dim=(1, 2, 3, 4))
        out = {"reward": r}
        if bad is not None:
            out["valid"] = ~bad
        return out


@register_reward("test_mgr_lying")
class LyingReward(RewardModel):
    """Breaks the protocol: NaN main score for sample 0 while claiming it valid."""

    def score(self, pixels, prompts, **meta):
        return {"reward": torch.ones(pixels.shape[0])}

    def forward(self, pixels, prompts, **meta):
        b = pixels.shape[0]
        r = torch.ones(b)
        r[0] = float("nan")
        return {"reward": r, "valid": torch.ones(b, dtype=torch.bool)}


@register_reward("test_mgr_param")
class ParamReward(RewardModel):
    """A reward with a trainable-looking parameter: reward = w * mean pixel."""

    def __init__(self, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.w = torch.nn.Parameter(torch.tensor(2.0))

    def score(self, pixels, prompts, **meta):
        return {"reward": self.w * pixels.float().mean(dim=(1, 2, 3, 4))}


@register_reward("test_mgr_world")
class WorldReward(RewardModel):
    """Records the ``world`` it was built with; reward = world["k"]."""

    def __init__(self, world=None, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.world = world

    def score(self, pixels, prompts, **meta):
        return {"reward": torch.full((pixels.shape[0],), float(self.world["k"]))}


@pytest.fixture(scope="module")
def batch():
    """8 ground-truth shapes videos with their captions."""
    b = make_batch(WORLD, 3, list(range(8)))
    return b["pixels"], b["prompts"]


def _means(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.float().mean(dim=(1, 2, 3, 4))


# ---------------------------------------------------------------------------------------------- weighted sum
def test_weighted_sum_with_real_shapes_verifier_and_chunking(batch):
    pixels, prompts = batch
    specs = [
        {**SHAPES, "weight": 0.7},
        RewardSpec("test_mgr_const", weight=2.0, scale=2.0, shift=0.1, kwargs={"value": 0.25}),
        {"name": "test_mgr_mean", "weight": -0.5},
    ]
    one = RewardManager(specs, batch_size=64).build({"world": WORLD})
    res = one(pixels, prompts)
    assert isinstance(res, RewardResult) and len(res) == 8

    direct = build_reward("shapes", world=WORLD, calibration_samples=8)(pixels, prompts)
    assert torch.allclose(res.rewards["shapes"], direct["reward"])
    assert float(res.rewards["shapes"].min()) > 0.95  # ground truth matches its captions
    assert torch.allclose(res.rewards["test_mgr_const"], torch.full((8,), 0.6))  # 2 * 0.25 + 0.1
    assert torch.allclose(res.rewards["test_mgr_mean"], _means(pixels))
    hand = 0.7 * direct["reward"] + 2.0 * 0.6 - 0.5 * _means(pixels)
    assert torch.allclose(res.total, hand, atol=1e-6)
    assert res.weights == {"shapes": 0.7, "test_mgr_const": 2.0, "test_mgr_mean": -0.5}
    assert res.valid.dtype == torch.bool and bool(res.valid.all())

    # every output key, namespaced, float32 on the CPU; the verifier's non-applicable NaNs pass through
    expected = {f"shapes/{k}" for k in ShapesVerifier.dimensions} | {
        "test_mgr_const/reward", "test_mgr_const/aux", "test_mgr_mean/reward"}
    assert set(res.components) == expected
    for k, v in res.components.items():
        assert v.dtype == torch.float32 and v.device.type == "cpu" and v.shape == (8,), k
    assert torch.equal(res.components["shapes/speed"].isnan(), direct["speed"].isnan())
    assert torch.allclose(res.components["test_mgr_const/aux"], torch.full((8,), 3.0))

    m = res.metrics()
    assert m["invalid_fraction"] == 0.0
    assert m["total"] == pytest.approx(float(hand.double().mean()), abs=1e-6)
    assert m["test_mgr_const/reward"] == pytest.approx(0.6)
    assert m["shapes/reward"] == pytest.approx(float(direct["reward"].double().mean()), abs=1e-6)
    speed = direct["speed"][~direct["speed"].isnan()]
    assert m["shapes/speed"] == pytest.approx(float(speed.double().mean()), abs=1e-6)
    assert m["shapes/errors"] == 0.0 and m["shapes/invalid_fraction"] == 0.0

    # chunks of 3 (3 + 3 + 2) give identical results
    chunked = RewardManager(specs, batch_size=3).build({"world": WORLD})(pixels, prompts)
    assert torch.equal(chunked.total, res.total) and torch.equal(chunked.valid, res.valid)
    for k in res.components:
        assert torch.equal(chunked.components[k].nan_to_num(-7), res.components[k].nan_to_num(-7)), k


def test_chunks_see_only_their_slice(monkeypatch):
    seen = []
    orig = ConstReward.score

    def spy(self, pixels, prompts, **meta):
        seen.append((pixels.shape[0], len(prompts), meta["ids"].tolist(), meta["fps"]))
        return orig(self, pixels, prompts, **meta)

    monkeypatch.setattr(ConstReward, "score", spy)
    mgr = RewardManager([{"name": "test_mgr_const"}], batch_size=3)
    mgr(torch.rand(8, 2, 3, 4, 4), [str(i) for i in range(8)], ids=torch.arange(8), fps=8)
    assert seen == [(3, 3, [0, 1, 2], 8), (3, 3, [3, 4, 5], 8), (2, 2, [6, 7], 8)]


# ---------------------------------------------------------------------------------------------- z-score
def test_zscore_sum_uses_running_stats_and_state_round_trip():
    g = torch.Generator().manual_seed(0)
    batches = [torch.rand(6, 2, 3, 4, 4, generator=g) * s for s in (0.5, 1.0, 0.8)]
    prompts = ["p"] * 6
    specs = [{"name": "test_mgr_mean", "weight": 2.0}, {"name": "test_mgr_param", "weight": 0.5, "scale": 3.0}]
    mgr = RewardManager(specs, combine="zscore_sum", batch_size=4)

    seen = {"test_mgr_mean": [], "test_mgr_param": []}
    for x in batches[:2]:
        res = mgr(x, prompts)
        r1, r2 = _means(x).double(), 3.0 * 2.0 * _means(x).double()
        seen["test_mgr_mean"].append(r1)
        seen["test_mgr_param"].append(r2)
        hand = torch.zeros(6, dtype=torch.float64)
        for name, w in (("test_mgr_mean", 2.0), ("test_mgr_param", 0.5)):
            allr = torch.cat(seen[name])  # every sample so far, this batch included
            mean, std = allr.mean(), allr.std(unbiased=False)
            cur = seen[name][-1]
            hand += w * (cur - mean) / (std + ZSCORE_EPS)
        assert torch.allclose(res.total.double(), hand, atol=1e-5)
        cnt, mean, std = mgr.running_stats()["test_mgr_mean"]
        assert cnt == len(torch.cat(seen["test_mgr_mean"]))
        assert mean == pytest.approx(float(torch.cat(seen["test_mgr_mean"]).mean()), abs=1e-9)
        assert res.metrics()["test_mgr_mean/running_std"] == pytest.approx(std)
    # first batch: z-scores of a single batch have zero mean; second batch is not centred on itself
    assert abs(float(res.total.mean())) > 1e-3

    state = mgr.state_dict()
    resumed = RewardManager(specs, combine="zscore_sum", batch_size=4)
    resumed.load_state_dict(state)
    a, b = mgr(batches[2], prompts), resumed(batches[2], prompts)
    assert torch.equal(a.total, b.total)
    assert mgr.state_dict() == resumed.state_dict()
    fresh = RewardManager(specs, combine="zscore_sum")(batches[2], prompts)
    assert not torch.allclose(fresh.total, a.total)  # the statistics matter
    with pytest.raises(ValueError, match="rewards"):
        RewardManager([{"name": "test_mgr_const"}], combine="zscore_sum").load_state_dict(state)


def test_zscore_excludes_invalid_samples_from_stats():
    x = torch.rand(6, 1, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    bad = torch.tensor([False, True, False, False, True, False])
    mgr = RewardManager([{"name": "test_mgr_mean"}], combine="zscore_sum")
    res = mgr(x, ["p"] * 6, bad=bad)
    good = _means(x)[~bad].double()
    cnt, mean, std = mgr.running_stats()["test_mgr_mean"]
    assert cnt == 4 and mean == pytest.approx(float(good.mean()))
    assert std == pytest.approx(float(good.std(unbiased=False)))
    assert torch.equal(res.total.isnan(), bad)
    assert torch.allclose(res.total[~bad].double(), (good - good.mean()) / (good.std(unbiased=False) + ZSCORE_EPS),
                          atol=1e-5)


# ---------------------------------------------------------------------------------------------- advantages
def test_per_reward_advantages_match_hand_computation():
    x = torch.rand(8, 1, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    specs = [{"name": "test_mgr_mean", "weight": 1.5}, {"name": "test_mgr_param", "weight": 0.5, "shift": 1.0},
             {"name": "test_mgr_const", "weight": 4.0}]
    mgr = RewardManager(specs, combine="advantage_sum")
    res = mgr(x, ["p"] * 8)
    m = _means(x).double()
    # advantage_sum: total is the plain weighted sum
    assert torch.allclose(res.total.double(), 1.5 * m + 0.5 * (2 * m + 1) + 4.0 * 0.25, atol=1e-6)

    adv, per, details = mgr.per_reward_advantages(res, groups, eps=1e-4, return_details=True)
    hand = torch.zeros(8, dtype=torch.float64)
    for name, r, w in (("test_mgr_mean", m, 1.5), ("test_mgr_param", 2 * m + 1, 0.5)):
        a = torch.empty(8, dtype=torch.float64)
        for gi in (0, 1):
            sel = groups == gi
            a[sel] = (r[sel] - r[sel].mean()) / (r[sel].std(unbiased=False) + 1e-4)
        assert torch.allclose(per[name].double(), a, atol=1e-5), name
        hand += w * a
    assert torch.equal(per["test_mgr_const"], torch.zeros(8))  # constant reward: zero-std groups -> exactly 0
    assert torch.allclose(adv.double(), hand, atol=1e-5)
    for gi in (0, 1):
        assert abs(float(adv[groups == gi].sum())) < 1e-5  # zero mean per group
    assert details == {"test_mgr_mean/zero_std_groups": 0.0, "test_mgr_param/zero_std_groups": 0.0,
                       "test_mgr_const/zero_std_groups": 1.0}
    # the module-level function agrees; groups may also be given as prompts
    labels = ["a"] * 4 + ["b"] * 4
    assert torch.allclose(per_reward_advantages(res, labels), adv)
    with pytest.raises(ValueError, match="group ids"):
        per_reward_advantages(res, groups[:5])
    # map_tensors (e.g. an all-gather): two copies of the batch = each group doubled, same advantages
    doubled = res.map_tensors(lambda t: torch.cat([t, t]))
    assert len(doubled) == 16 and doubled.valid.dtype == torch.bool
    assert torch.allclose(per_reward_advantages(doubled, torch.cat([groups, groups])), torch.cat([adv, adv]),
                          atol=1e-5)


def test_advantages_are_zero_for_invalid_samples():
    x = torch.rand(6, 1, 3, 4, 4, generator=torch.Generator().manual_seed(3))
    bad = torch.tensor([False, True, False, False, False, False])
    res = RewardManager([{"name": "test_mgr_mean"}])(x, ["p"] * 6, bad=bad)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = per_reward_advantages(res, groups)
    assert float(adv[1]) == 0.0
    m = _means(x).double()
    sel = torch.tensor([0, 2])
    hand = (m[sel] - m[sel].mean()) / (m[sel].std(unbiased=False) + 1e-4)
    assert torch.allclose(adv[sel].double(), hand, atol=1e-5)
    assert abs(float(adv[:3].sum())) < 1e-5 and abs(float(adv[3:].sum())) < 1e-5


# ---------------------------------------------------------------------------------------------- failures
def test_invalid_samples_propagate_nan_and_are_excluded_from_metrics():
    x = torch.rand(8, 1, 3, 4, 4, generator=torch.Generator().manual_seed(4))
    bad = torch.zeros(8, dtype=torch.bool)
    bad[[2, 5]] = True
    mgr = RewardManager([{"name": "test_mgr_mean", "weight": 1.0}, {"name": "test_mgr_const", "weight": 1.0}],
                        batch_size=3)
    res = mgr(x, ["p"] * 8, bad=bad)
    assert torch.equal(res.valid, ~bad)
    assert torch.equal(res.reward_valid["test_mgr_mean"], ~bad) and bool(res.reward_valid["test_mgr_const"].all())
    assert torch.equal(res.total.isnan(), bad) and torch.equal(res.rewards["test_mgr_mean"].isnan(), bad)
    m = res.metrics()
    good = _means(x)[~bad].double()
    assert m["invalid_fraction"] == pytest.approx(0.25)
    assert m["test_mgr_mean/invalid_fraction"] == pytest.approx(0.25)
    assert m["test_mgr_const/invalid_fraction"] == 0.0
    assert m["test_mgr_mean/reward"] == pytest.approx(float(good.mean()), abs=1e-6)
    assert m["total"] == pytest.approx(float((good + 0.25).mean()), abs=1e-6)
    assert not any(math.isnan(v) for v in m.values())


def test_nan_marked_valid_is_treated_as_invalid_with_warning(caplog):
    mgr = RewardManager([{"name": "test_mgr_lying"}, {"name": "test_mgr_const"}])
    with caplog.at_level(logging.WARNING, logger="genrl.rewards.manager"):
        res = mgr(torch.rand(4, 1, 3, 4, 4), ["p"] * 4)
    assert "test_mgr_lying" in caplog.text and "non-finite" in caplog.text
    assert res.valid.tolist() == [False, True, True, True]
    assert res.total[0].isnan() and torch.allclose(res.total[1:], torch.full((3,), 1.25))
    assert res.metrics()["test_mgr_lying/nan_rewards"] == 1.0
    assert mgr.failure_counts["test_mgr_lying"]["nan_rewards"] == 1


def test_on_error_raise_and_invalid(caplog):
    x = torch.rand(8, 1, 3, 4, 4)
    explode = torch.zeros(8, dtype=torch.bool)
    explode[4] = True  # in the second chunk (samples 3:6)
    specs = [{"name": "test_mgr_mean"}, {"name": "test_mgr_const"}]
    with pytest.raises(RuntimeError, match=r"reward 'test_mgr_mean' failed on a chunk of 3 samples.*boom") as err:
        RewardManager(specs, batch_size=3)(x, ["p"] * 8, explode=explode)
    assert isinstance(err.value.__cause__, RuntimeError) and str(err.value.__cause__) == "boom"

    mgr = RewardManager(specs, batch_size=3, on_error="invalid")
    with caplog.at_level(logging.WARNING, logger="genrl.rewards.manager"):
        res = mgr(x, ["p"] * 8, explode=explode)
    assert "test_mgr_mean" in caplog.text and "boom" in caplog.text
    expected = torch.tensor([True, True, True, False, False, False, True, True])
    assert torch.equal(res.valid, expected)
    assert torch.equal(res.components["test_mgr_mean/reward"].isnan(), ~expected)
    assert torch.allclose(res.total[expected], _means(x)[expected] + 0.25)
    m = res.metrics()
    assert m["test_mgr_mean/errors"] == 1.0 and m["test_mgr_const/errors"] == 0.0
    assert m["invalid_fraction"] == pytest.approx(3 / 8)
    assert mgr.state_dict()["failure_counts"]["test_mgr_mean"]["errors"] == 1


# ---------------------------------------------------------------------------------------------- placement
class _Method(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 2)
        self.rewards = RewardManager([{"name": "test_mgr_param"}, {"name": "test_mgr_const"}])


def test_manager_is_outside_the_lightning_module():
    method = _Method()
    mgr = method.rewards
    assert not isinstance(mgr, torch.nn.Module)
    mgr.build()
    method.train()
    model = mgr["test_mgr_param"]
    assert not model.training and not model.w.requires_grad
    assert set(method.state_dict()) == {"net.weight", "net.bias"}
    assert len(list(method.parameters())) == 2
    assert all(p is not model.w for p in method.parameters())
    assert "rewards" not in dict(method.named_children())
    assert mgr.to("cpu") is mgr and mgr.device == torch.device("cpu")
    assert model.w.device.type == "cpu"


def test_build_context_goes_to_rewards_that_take_it():
    mgr = RewardManager([{"name": "test_mgr_world"}, {"name": "test_mgr_world", "world": {"k": 5}},
                         {"name": "test_mgr_const"}])
    assert mgr.names == ["test_mgr_world", "test_mgr_world_2", "test_mgr_const"]
    mgr.build(context={"world": {"k": 2}, "unused": 1})
    assert mgr["test_mgr_world"].world == {"k": 2}  # from the context
    assert mgr["test_mgr_world_2"].world == {"k": 5}  # the spec wins
    res = mgr(torch.rand(2, 1, 3, 4, 4), ["p", "q"])
    assert torch.allclose(res.total, torch.full((2,), 2 + 5 + 0.25))
    shapes = build_reward_with_context({"name": "shapes", "calibration_samples": 8},
                                       {"world": ShapesWorldConfig(num_frames=1)})
    assert shapes.world.num_frames == 1 and not shapes.training


def test_bad_config_errors():
    with pytest.raises(UnknownRewardError, match="shapes") as err:
        RewardManager([{"name": "no_such_reward"}])
    assert "test_mgr_const" in str(err.value)
    with pytest.raises(ValueError, match="at least one"):
        RewardManager([])
    with pytest.raises(ValueError, match="batch_size"):
        RewardManager([{"name": "test_mgr_const"}], batch_size=-1)
    with pytest.raises(ValueError, match="batch_size"):
        RewardManager([{"name": "test_mgr_const"}], batch_size=0)
    with pytest.raises(ValueError, match="weight"):
        RewardManager([{"name": "test_mgr_const", "weight": float("nan")}])
    with pytest.raises(ValueError, match="weight"):
        RewardManager([RewardSpec("test_mgr_const", weight=float("inf"))])
    with pytest.raises(ValueError, match="combine"):
        RewardManager([{"name": "test_mgr_const"}], combine="product")
    with pytest.raises(ValueError, match="on_error"):
        RewardManager([{"name": "test_mgr_const"}], on_error="ignore")
    mgr = RewardManager([{"name": "test_mgr_const"}])
    with pytest.raises(ValueError, match="3 prompts for a batch of 2"):
        mgr(torch.rand(2, 1, 3, 4, 4), ["a", "b", "c"])
    with pytest.raises(ValueError, match="B, T, C, H, W"):
        mgr(torch.rand(2, 3, 4, 4), ["a", "b"])


# ---------------------------------------------------------------------------------------------- by-hand results
def _result(rewards: dict[str, list[float]], valid: list[bool], weights: dict[str, float], **kw) -> RewardResult:
    r = {k: torch.tensor(v, dtype=torch.float32) for k, v in rewards.items()}
    masks = {k: torch.isfinite(v) for k, v in r.items()}
    return RewardResult(components={f"{k}/reward": v for k, v in r.items()}, rewards=r, reward_valid=masks,
                        valid=torch.tensor(valid, dtype=torch.bool), total=torch.zeros(len(valid)), weights=weights,
                        **kw)


def test_per_reward_advantages_pass_std_eps_ddof_through():
    """Non-default std / eps / ddof reach every reward's group advantages (the method and the function alike)."""
    res = _result({"a": [1.0, 2.0, 4.0, 0.5, 3.0, 3.5]}, [True] * 6, {"a": 2.0})
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    r = res.rewards["a"].double()
    hand = torch.empty(6, dtype=torch.float64)
    for gi in (0, 1):
        sel = groups == gi
        hand[sel] = r[sel] - r[sel].mean()
    glob = r.std(unbiased=True)  # ddof 1 over every valid sample
    expected = 2.0 * hand / (glob + 0.3)
    mgr = RewardManager([{"name": "test_mgr_const"}])
    for fn in (per_reward_advantages, mgr.per_reward_advantages):
        adv = fn(res, groups, std="global", eps=0.3, ddof=1)
        assert torch.allclose(adv.double(), expected, atol=1e-6)
        assert torch.allclose(fn(res, groups, std="none").double(), 2.0 * hand, atol=1e-6)


def test_manager_per_reward_advantages_defaults():
    """The method's defaults are the function's: std "group", eps 1e-4, ddof 0, a plain tensor (no details)."""
    res = _result({"a": [1.0, 1.001, 1.003, 0.5, 0.5004, 0.5001]}, [True] * 6, {"a": 1.0})
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    out = RewardManager([{"name": "test_mgr_const"}]).per_reward_advantages(res, groups)
    assert isinstance(out, torch.Tensor)
    r = res.rewards["a"].double()
    hand = torch.empty(6, dtype=torch.float64)
    for gi in (0, 1):
        sel = groups == gi
        hand[sel] = (r[sel] - r[sel].mean()) / (r[sel].std(unbiased=False) + 1e-4)
    assert torch.allclose(out.double(), hand, atol=1e-4)


def test_per_reward_advantages_group_id_types():
    """Float group ids are refused; an empty batch with list ids gives an empty float32 tensor (int64 indices)."""
    res = _result({"a": [1.0, 2.0, 3.0, 4.0]}, [True] * 4, {"a": 1.0})
    with pytest.raises(TypeError, match="torch.float32"):
        per_reward_advantages(res, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    empty = _result({"a": []}, [], {"a": 1.0})
    out = per_reward_advantages(empty, [])
    assert out.dtype == torch.float32 and out.shape == (0,)


def test_per_reward_advantages_are_float32_under_a_float64_default_dtype():
    """The advantages are float32 as documented, whatever torch's default dtype."""
    res = _result({"a": [1.0, 2.0, 4.0, 0.5]}, [True] * 4, {"a": 0.5})
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = per_reward_advantages(res, [0, 0, 1, 1])
    finally:
        torch.set_default_dtype(before)
    assert out.dtype == torch.float32


def test_zero_std_groups_detail_uses_samples_valid_for_the_whole_result():
    """zero_std_groups counts a group by its samples valid for the whole result (and finite for that reward)."""
    nan = float("nan")
    # sample 1 is invalid for "a" (NaN), hence for the result; "b" is finite there but must not count
    res = _result({"a": [1.0, nan, 1.0, 2.0, 3.0, 5.0], "b": [7.0, 9.0, 7.0, 1.0, 2.0, 4.0]},
                  [True, False, True, True, True, True], {"a": 1.0, "b": 1.0})
    adv, per, details = per_reward_advantages(res, torch.tensor([0, 0, 0, 1, 1, 1]), return_details=True)
    assert details == {"a/zero_std_groups": 0.5, "b/zero_std_groups": 0.5}
    assert torch.equal(per["a"][:3], torch.zeros(3)) and torch.equal(per["b"][:3], torch.zeros(3))


def test_map_tensors_maps_every_tensor_and_copies_the_rest():
    """map_tensors applies fn to components, rewards, masks, valid and total and keeps every other field."""
    res = _result({"a": [1.0, 2.0]}, [True, False], {"a": 3.0}, combine="advantage_sum", errors={"a": 2},
                  nan_rewards={"a": 1}, stats={"a/running_mean": 0.5})
    res.total = torch.tensor([4.0, float("nan")])
    out = res.map_tensors(lambda t: torch.cat([t, t.flip(0)]))
    assert torch.equal(out.components["a/reward"], torch.tensor([1.0, 2.0, 2.0, 1.0]))
    assert torch.equal(out.rewards["a"], torch.tensor([1.0, 2.0, 2.0, 1.0]))
    assert torch.equal(out.reward_valid["a"], torch.ones(4, dtype=torch.bool))
    assert out.valid.tolist() == [True, False, False, True]
    assert torch.equal(out.total.nan_to_num(-1.0), torch.tensor([4.0, -1.0, -1.0, 4.0]))
    assert out.weights == {"a": 3.0} and out.combine == "advantage_sum"
    assert out.errors == {"a": 2} and out.nan_rewards == {"a": 1} and out.stats == {"a/running_mean": 0.5}


def test_running_stats_count_a_batch_of_one():
    """A single valid sample updates the z-score statistics (count 1, mean = that reward)."""
    mgr = RewardManager([{"name": "test_mgr_const", "kwargs": {"value": 0.75}}], combine="zscore_sum")
    mgr(torch.rand(1, 1, 3, 4, 4), ["p"])
    assert mgr.running_stats()["test_mgr_const"] == (1.0, 0.75, 0.0)


def test_to_moves_every_model_and_repr():
    """to(device) moves each built model in place; repr lists rewards with weights and the settings."""
    mgr = RewardManager([{"name": "test_mgr_param", "weight": 2.0}, {"name": "test_mgr_const", "weight": -0.5}],
                        batch_size=3)
    assert repr(mgr) == ("RewardManager([test_mgr_param(w=2), test_mgr_const(w=-0.5)], combine='weighted_sum', "
                         "batch_size=3, on_error='raise', device=None, built=False)")
    mgr.build()
    model = mgr.models["test_mgr_param"]
    assert mgr.to("meta") is mgr
    assert mgr.models["test_mgr_param"] is model and model.w.device.type == "meta"
    assert repr(mgr).endswith("device=meta, built=True)")


# ---------------------------------------------------------------------------------------------- contracts (mutation)
@register_reward("test_mgr_raw")
class RawReward(RewardModel):
    """Overrides forward (no validation, no scale / shift, no "valid" unless asked): reward = meta ``r`` (zeros
    without it); records (pixels device, chunk size) of every call in ``RawReward.calls``."""

    calls: list[tuple[str, int]] = []

    def __init__(self, mode: str = "plain", param: bool = False, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.mode = mode
        if param:
            self.p = torch.nn.Parameter(torch.zeros(()))

    def score(self, pixels, prompts, **meta):
        raise AssertionError("forward is overridden")

    def forward(self, pixels, prompts, r=None, ok=None, **meta):
        b = pixels.shape[0]
        RawReward.calls.append((pixels.device.type, b))
        reward = r.clone() if r is not None else torch.zeros(b)
        if self.mode == "noreward":
            return {"score": reward}
        out = {"reward": reward}
        if self.mode == "valid":
            out["valid"] = ok
        if self.mode == "extra":
            out["extra"] = reward + 100.0
        return out


def _x(b: int) -> torch.Tensor:
    return torch.rand(b, 1, 3, 2, 2)


def test_combine_mode_is_recorded_in_the_result():
    """RewardResult.combine is the manager's combine mode, for every mode."""
    for combine in ("weighted_sum", "zscore_sum", "advantage_sum"):
        res = RewardManager([{"name": "test_mgr_const"}], combine=combine)(_x(2), ["p", "q"])
        assert res.combine == combine


def test_prompts_must_be_a_list_of_strings():
    """Prompts that are one string or hold a non-string raise TypeError naming prompts."""
    mgr = RewardManager([{"name": "test_mgr_const"}])
    with pytest.raises(TypeError, match="prompts"):
        mgr(_x(2), [1, 2])
    with pytest.raises(TypeError, match="prompts"):
        mgr(_x(2), "ab")


def test_failed_chunks_and_nan_scores_are_counted_per_batch_and_cumulatively():
    """Each failing chunk counts once in result.errors; failure_counts add up over calls (errors and NaN scores)."""
    explode = torch.tensor([True, False, False, False, True, False])  # chunks 0:2 and 4:6 fail, 2:4 does not
    mgr = RewardManager([{"name": "test_mgr_mean"}, {"name": "test_mgr_const"}], batch_size=2, on_error="invalid")
    for call in (1, 2):
        res = mgr(_x(6), ["p"] * 6, explode=explode)
        assert res.errors == {"test_mgr_mean": 2, "test_mgr_const": 0}
        assert res.valid.tolist() == [False, False, True, True, False, False]
        assert res.metrics()["test_mgr_mean/errors"] == 2.0
        assert mgr.failure_counts == {"test_mgr_mean": {"errors": 2 * call, "nan_rewards": 0},
                                      "test_mgr_const": {"errors": 0, "nan_rewards": 0}}
    lying = RewardManager([{"name": "test_mgr_lying"}])
    for call in (1, 2):
        assert lying(_x(3), ["p"] * 3).nan_rewards == {"test_mgr_lying": 1}
        assert lying.failure_counts["test_mgr_lying"] == {"errors": 0, "nan_rewards": call}


def test_output_without_a_reward_key_is_a_reported_failure():
    """A reward output lacking "reward" raises RuntimeError naming the reward, or counts as an error chunk."""
    with pytest.raises(RuntimeError, match="reward 'test_mgr_raw' failed.*without a 'reward' key"):
        RewardManager([{"name": "test_mgr_raw", "mode": "noreward"}])(_x(2), ["p", "q"])
    res = RewardManager([{"name": "test_mgr_raw", "mode": "noreward"}], on_error="invalid")(_x(2), ["p", "q"])
    assert res.errors == {"test_mgr_raw": 1} and res.valid.tolist() == [False, False]
    assert res.nan_rewards == {"test_mgr_raw": 0}


def test_valid_mask_and_extra_keys_from_the_reward_output():
    """A "valid" output marks samples invalid (NaN, not counted as NaN scores); no "valid" means all valid;
    an undeclared float key becomes a component; chunks of 1 work."""
    r = torch.tensor([0.5, 1.5, 2.5, 3.5])
    ok = torch.tensor([True, False, True, True])
    res = RewardManager([{"name": "test_mgr_raw", "mode": "valid", "weight": 2.0}], batch_size=1)(
        _x(4), ["p"] * 4, r=r, ok=ok)
    assert res.valid.tolist() == [True, False, True, True]
    assert res.nan_rewards == {"test_mgr_raw": 0}
    torch.testing.assert_close(res.rewards["test_mgr_raw"], torch.tensor([0.5, float("nan"), 2.5, 3.5]),
                               rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(res.total, torch.tensor([1.0, float("nan"), 5.0, 7.0]), rtol=0, atol=0,
                               equal_nan=True)
    plain = RewardManager([{"name": "test_mgr_raw", "mode": "extra"}], batch_size=3)(_x(4), ["p"] * 4, r=r)
    assert plain.valid.tolist() == [True] * 4 and plain.nan_rewards == {"test_mgr_raw": 0}
    assert set(plain.components) == {"test_mgr_raw/reward", "test_mgr_raw/extra"}
    assert torch.equal(plain.components["test_mgr_raw/extra"], r + 100.0)
    assert torch.equal(plain.total, r)


def test_scores_are_float32_under_a_float64_default_dtype():
    """components, rewards and total are float32 as documented, whatever torch's default dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        res = RewardManager([{"name": "test_mgr_const"}, {"name": "test_mgr_raw", "mode": "extra"}])(
            torch.rand(3, 1, 3, 2, 2, dtype=torch.float32), ["p"] * 3, r=torch.tensor([1.0, 2.0, 3.0]))
    finally:
        torch.set_default_dtype(before)
    for k, v in [*res.components.items(), *res.rewards.items(), ("total", res.total)]:
        assert v.dtype == torch.float32, k
    torch.testing.assert_close(res.total.double(), torch.tensor([1.25, 2.25, 3.25], dtype=torch.float64),
                               rtol=0, atol=0)


def test_pixels_go_to_the_manager_device_or_the_model_parameters_device():
    """Chunks are moved to the manager's device when set, else to the device of the model's parameters (meta)."""
    RawReward.calls.clear()
    mgr = RewardManager([{"name": "test_mgr_raw"}], device="meta")
    assert mgr.device == torch.device("meta")
    res = mgr(_x(2), ["p", "q"])
    assert RawReward.calls == [("meta", 2)] and torch.equal(res.total, torch.zeros(2))

    RawReward.calls.clear()
    mgr = RewardManager([{"name": "test_mgr_raw", "param": True}]).build()
    mgr.models["test_mgr_raw"].to("meta")  # the model moved by hand: the manager has no device of its own
    assert mgr.device is None
    mgr(_x(2), ["p", "q"])
    assert RawReward.calls == [("meta", 2)]

    RawReward.calls.clear()
    RewardManager([{"name": "test_mgr_raw"}])(_x(2), ["p", "q"])
    assert RawReward.calls == [("cpu", 2)]


def test_build_places_models_on_a_device_set_before_building():
    """to() before build() is allowed (nothing built yet); build() then puts every model on that device."""
    mgr = RewardManager([{"name": "test_mgr_param"}, {"name": "test_mgr_const"}])
    assert mgr.to("meta") is mgr and mgr.models == {} and not mgr.built
    mgr.build()
    assert mgr.models["test_mgr_param"].w.device.type == "meta"
    direct = RewardManager([{"name": "test_mgr_param"}], device="meta").build()
    assert direct.models["test_mgr_param"].w.device.type == "meta"
    cpu = RewardManager([{"name": "test_mgr_param"}]).build()
    assert cpu.models["test_mgr_param"].w.device.type == "cpu"


def test_a_single_spec_and_batch_size_checks():
    """A lone spec (dict or RewardSpec) is one reward; batch_size must be an int >= 1 (1 allowed), default 64."""
    assert RewardManager({"name": "test_mgr_const"}).names == ["test_mgr_const"]
    assert RewardManager(RewardSpec("test_mgr_raw", weight=3.0)).weights == {"test_mgr_raw": 3.0}
    for bad in (True, 2.5, "4"):
        with pytest.raises(ValueError, match="batch_size"):
            RewardManager([{"name": "test_mgr_const"}], batch_size=bad)
    RawReward.calls.clear()
    RewardManager([{"name": "test_mgr_raw"}], batch_size=1)(_x(3), ["p"] * 3)
    assert RawReward.calls == [("cpu", 1)] * 3
    RawReward.calls.clear()
    mgr = RewardManager([{"name": "test_mgr_raw"}])
    assert mgr.batch_size == 64
    mgr(torch.zeros(65, 1, 1, 1, 1), ["p"] * 65)
    assert RawReward.calls == [("cpu", 64), ("cpu", 1)]


def test_state_dict_round_trip_and_partial_or_bad_states():
    """state_dict has exactly names / combine / stats / failure_counts; load_state_dict restores the counts,
    fills missing counts with 0 and refuses a state for other rewards."""
    specs = [{"name": "test_mgr_mean"}, {"name": "test_mgr_lying"}]
    mgr = RewardManager(specs, combine="zscore_sum", batch_size=2, on_error="invalid")
    mgr(_x(4), ["p"] * 4, explode=torch.tensor([True, False, False, False]))
    state = mgr.state_dict()
    assert set(state) == {"names", "combine", "stats", "failure_counts"}
    assert state["combine"] == "zscore_sum" and state["names"] == ["test_mgr_mean", "test_mgr_lying"]
    # the lying reward breaks sample 0 of each chunk of 2: 2 NaN scores
    expected = {"test_mgr_mean": {"errors": 1, "nan_rewards": 0}, "test_mgr_lying": {"errors": 0, "nan_rewards": 2}}
    assert state["failure_counts"] == expected

    resumed = RewardManager(specs, combine="zscore_sum")
    resumed.load_state_dict(state)
    assert resumed.failure_counts == expected and resumed.state_dict() == state

    no_counts = {k: v for k, v in state.items() if k != "failure_counts"}
    resumed.load_state_dict(no_counts)
    assert resumed.failure_counts == {n: {"errors": 0, "nan_rewards": 0} for n in mgr.names}
    resumed.load_state_dict({**state, "failure_counts": {"test_mgr_mean": {"errors": 3}}})
    assert resumed.failure_counts == {"test_mgr_mean": {"errors": 3, "nan_rewards": 0},
                                      "test_mgr_lying": {"errors": 0, "nan_rewards": 0}}
    with pytest.raises(ValueError, match=r"state is for rewards \[\]"):
        resumed.load_state_dict({})


def test_metrics_exact_keys_and_values_with_default_counts():
    """metrics() returns exactly the documented keys: masked means (invalid and NaN skipped), fractions, and
    errors / nan_rewards of 0 for rewards absent from those dicts."""
    nan = float("nan")
    res = RewardResult(
        components={"a/reward": torch.tensor([1.0, 2.0, nan, 4.0]), "a/aux": torch.tensor([nan, 3.0, 5.0, 9.0])},
        rewards={"a": torch.tensor([1.0, 2.0, nan, 4.0])},
        reward_valid={"a": torch.tensor([True, True, False, True]), "b": torch.tensor([True, True, True, False])},
        valid=torch.tensor([True, True, False, False]),
        total=torch.tensor([0.5, 1.0 / 3.0, nan, 7.0]),
        weights={"a": 1.0, "b": 1.0},
        stats={"a/running_mean": 0.25},
    )
    assert res.metrics() == {
        "total": float((torch.tensor(0.5).double() + torch.tensor(1.0 / 3.0).double()) / 2),
        "invalid_fraction": 0.5,
        "a/reward": 1.5,
        "a/aux": 3.0,
        "a/invalid_fraction": 0.25,
        "a/errors": 0.0,
        "a/nan_rewards": 0.0,
        "b/invalid_fraction": 0.25,
        "b/errors": 0.0,
        "b/nan_rewards": 0.0,
        "a/running_mean": 0.25,
    }


def test_metrics_of_an_empty_or_all_invalid_batch_are_nan():
    """Means and fractions over no samples are NaN (an empty batch, or a batch with every sample invalid)."""
    empty = _result({"a": []}, [], {"a": 1.0}, errors={"a": 0}, nan_rewards={"a": 0})
    m = empty.metrics()
    assert set(m) == {"total", "invalid_fraction", "a/reward", "a/invalid_fraction", "a/errors", "a/nan_rewards"}
    for key in ("total", "invalid_fraction", "a/reward", "a/invalid_fraction"):
        assert math.isnan(m[key]), key
    bad = _result({"a": [1.0, 2.0]}, [False, False], {"a": 1.0})
    m = bad.metrics()
    assert math.isnan(m["total"]) and math.isnan(m["a/reward"]) and m["invalid_fraction"] == 1.0


def test_slice_meta_slices_only_per_sample_entries():
    """Length-n lists / tuples and tensors with first dim n are sliced; 0-d tensors and other values pass whole."""
    from genrl.rewards.manager import slice_meta

    t, s, other = torch.arange(4), torch.tensor(2.0), torch.arange(3)
    out = slice_meta({"t": t, "s": s, "l": ["a", "b", "c", "d"], "tp": (0, 1, 2, 3), "short": [9, 9], "o": other,
                      "k": 7}, 4, 1, 3)
    assert set(out) == {"t", "s", "l", "tp", "short", "o", "k"}
    assert torch.equal(out["t"], torch.tensor([1, 2]))
    assert out["s"] is s and out["o"] is other
    assert out["l"] == ["b", "c"] and out["tp"] == (1, 2) and out["short"] == [9, 9] and out["k"] == 7


def test_context_keywords_skip_self_and_catch_alls():
    """Only named constructor parameters take context values: "self" and *args / **kwargs names never do."""
    from genrl.rewards.manager import _accepted_keywords

    class Ctor:
        def __init__(self, a, *args, b=1, **kw):
            pass

    assert _accepted_keywords(Ctor) == {"a", "b"}
    model = build_reward_with_context({"name": "test_mgr_world"}, {"world": {"k": 1}, "self": 0, "kwargs": 0})
    assert model.world == {"k": 1}


def test_as_reward_spec_checks_and_copies():
    """as_reward_spec copies kwargs, refuses an argument given flat and in kwargs, an empty or non-string name,
    and a bool or non-number weight, naming the bad field."""
    from genrl.rewards.manager import as_reward_spec

    spec = RewardSpec("test_mgr_const", kwargs={"value": 0.5})
    out = as_reward_spec(spec)
    out.kwargs["value"] = 9.0
    assert spec.kwargs == {"value": 0.5}
    with pytest.raises(ValueError, match=r"\['value'\] given both flat and in 'kwargs'"):
        as_reward_spec({"name": "test_mgr_const", "value": 1.0, "kwargs": {"value": 2.0}})
    for name in ("", 5):
        with pytest.raises(ValueError, match="name must be a non-empty string"):
            as_reward_spec({"name": name})
    for weight in (True, "2"):
        with pytest.raises(ValueError, match="weight must be a finite number"):
            as_reward_spec({"name": "test_mgr_const", "weight": weight})
