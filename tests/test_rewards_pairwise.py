"""Pairwise judges and group win rates (Pref-GRPO): the win-rate invariants, tie / failure handling, the shapes
judge, the groupwise path through the RewardManager and the score phase, the remote judge behind a fake reward
server, and one tiny GRPO step with the pairwise reward."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from genrl.data.shapes import ShapesWorldConfig, sample
from genrl.flow.policy import group_advantages
from genrl.rewards import (
    PairJudgeReward,
    PairwiseJudge,
    PairwiseReward,
    RemoteJudge,
    RewardManager,
    RewardModel,
    ScoreJudge,
    ShapesJudge,
    ShapesVerifier,
    UnknownJudgeError,
    available_judges,
    available_rewards,
    build_judge,
    check_complete_groups,
    parse_preference,
    register_judge,
    register_reward,
    win_rates,
)
from genrl.rewards.remote import quantize_uint8
from genrl.rewards.server import RewardServer, RewardService

ROOT = Path(__file__).resolve().parents[1]
WORLD = ShapesWorldConfig()


# ---------------------------------------------------------------------------------------------- helpers
class MeanJudge(ScoreJudge):
    """Prefers the brighter sample (score = mean pixel value, optionally transformed)."""

    def __init__(self, transform=None, tolerance: float = 0.0) -> None:
        super().__init__(tolerance)
        self.transform = transform or (lambda s: s)
        self.calls = 0

    def scores(self, pixels, prompts):
        self.calls += 1
        return self.transform(pixels.double().mean(dim=(1, 2, 3, 4)))


class Generic:
    """Any object with compare(): the per-pair path of win_rates (no score shortcut)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.pairs = 0

    def compare(self, a, b, prompts):
        self.pairs += len(prompts)
        return self.fn(a, b, prompts)


def _means(x):
    return x.double().mean(dim=(1, 2, 3, 4))


def brighter(a, b, prompts):  # symmetric: swapping a and b gives 1 - the verdict (equal brightness: a tie)
    return (torch.sign(_means(a) - _means(b)) + 1) / 2


def first_wins(a, b, prompts):  # a maximally position-biased judge
    return torch.ones(len(prompts))


def batch(levels, prompts=None):
    """Constant videos [B, 2, 3, 4, 4] with the given brightness levels."""
    x = torch.tensor(levels, dtype=torch.float32).view(-1, 1, 1, 1, 1).expand(-1, 2, 3, 4, 4).contiguous()
    return x, list(prompts) if prompts is not None else ["p"] * len(levels)


def wins_of(rates, group):
    """Per group: (G, wins_i = rate_i * (G - 1))."""
    out = {}
    for g in torch.unique(group).tolist():
        r = rates[group == g].double()
        out[g] = (len(r), r * (len(r) - 1))
    return out


# ---------------------------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("symmetric", [False, True])
def test_wins_sum_to_the_number_of_pairs_for_any_judge(symmetric):
    """Invariant 1: sum_i wins_i = C(G, 2), mean rate exactly 1/2, for an arbitrary (random, intransitive, tying,
    failing, fractional) judge."""
    gen = torch.Generator().manual_seed(0)

    def random_judge(a, b, prompts):
        choice = torch.randint(0, 5, (len(prompts),), generator=gen)
        values = torch.tensor([0.0, 1.0, 0.5, math.nan, 0.3], dtype=torch.float64)
        return values[choice]

    x, prompts = batch(torch.rand(3 + 5 + 8, generator=gen).tolist())
    group = torch.tensor([0] * 3 + [1] * 5 + [2] * 8)
    rates, stats = win_rates(Generic(random_judge), x, prompts, group, symmetric=symmetric, return_stats=True)
    assert rates.dtype == torch.float32 and rates.shape == (16,)
    assert ((rates >= 0) & (rates <= 1)).all()
    for g, (size, wins) in wins_of(rates, group).items():
        assert float(wins.sum()) == pytest.approx(math.comb(size, 2), abs=1e-5), g
        assert float(rates[group == g].double().mean()) == pytest.approx(0.5, abs=1e-7)
    pairs = 3 + 10 + 28
    assert stats["judge_calls"] == pairs * (2 if symmetric else 1) and stats["groups"] == 3
    assert 0 < stats["judge_failures"] < stats["judge_calls"]
    assert stats["judge_failure_rate"] == stats["judge_failures"] / stats["judge_calls"]


@pytest.mark.parametrize("judge", ["score", "generic"])
def test_a_transitive_judge_without_ties_gives_the_fixed_ranks(judge):
    """Invariant 2: rates are {0, 1/(G-1), ..., 1}, whatever the score gaps (tiny or huge)."""
    levels = [0.5, 0.5001, 0.9, 0.1, 0.10001, 0.3, 0.99, 0.0]
    x, prompts = batch(levels)
    j = MeanJudge() if judge == "score" else Generic(brighter)
    rates = win_rates(j, x, prompts, torch.zeros(8, dtype=torch.int64))
    expected = torch.tensor([sorted(levels).index(v) / 7 for v in levels])
    assert torch.allclose(rates, expected.float(), atol=1e-7)
    assert sorted(rates.tolist()) == pytest.approx([k / 7 for k in range(8)])
    if judge == "generic":
        assert j.pairs == 28  # C(8, 2) judge calls
    else:
        assert j.calls == 1   # a score judge scores the batch once


def test_a_strictly_monotone_transform_of_the_score_leaves_the_rates_unchanged():
    """Invariant 3 (ties included: equal scores stay equal under the transform)."""
    gen = torch.Generator().manual_seed(1)
    levels = (torch.randint(0, 6, (24,), generator=gen) / 6).tolist()
    x, prompts = batch(levels)
    group = torch.arange(24) % 3
    base = win_rates(MeanJudge(), x, prompts, group)
    for f in (lambda s: torch.exp(5 * s), lambda s: s ** 3 - 10, lambda s: torch.log1p(s) * 1e-6):
        assert torch.equal(win_rates(MeanJudge(transform=f), x, prompts, group), base)
        assert torch.equal(win_rates(Generic(lambda a, b, p, f=f: MeanJudge(transform=f).compare(a, b, p)), x,
                                     prompts, group), base)


def test_all_ties_give_one_half_and_zero_advantages():
    """Invariant 4: a judge that ties everything (or fails everywhere) gives every sample 1/2, so GRPO's group
    advantages are all zero (the group is dropped)."""
    x, prompts = batch([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    for fn in (lambda a, b, p: torch.full((len(p),), 0.5), lambda a, b, p: torch.full((len(p),), math.nan)):
        rates, stats = win_rates(Generic(fn), x, prompts, group, return_stats=True)
        assert torch.equal(rates, torch.full((6,), 0.5))
        assert torch.equal(group_advantages(rates, group), torch.zeros(6))
    assert stats["judge_failures"] == 6 and stats["judge_failure_rate"] == 1.0 and math.isnan(stats["tie_fraction"])
    equal, _ = batch([0.3] * 4)
    rates, stats = win_rates(MeanJudge(), equal, ["p"] * 4, torch.zeros(4, dtype=torch.int64), return_stats=True)
    assert torch.equal(rates, torch.full((4,), 0.5)) and stats["tie_fraction"] == 1.0


def test_presentation_order_with_a_symmetric_judge_and_position_bias():
    """Invariant 5: reversing the order (every pair presented the other way round) leaves a symmetric judge's rates
    unchanged; a position-biased judge is exposed by ``symmetric`` (asymmetry 1) and cancelled (all 1/2)."""
    levels = [0.7, 0.2, 0.9, 0.4, 0.4]
    x, prompts = batch(levels)
    group = torch.zeros(5, dtype=torch.int64)
    rev = torch.arange(4, -1, -1)
    for sym in (False, True):
        fwd, stats = win_rates(Generic(brighter), x, prompts, group, symmetric=sym, return_stats=True)
        back = win_rates(Generic(brighter), x[rev], prompts, group, symmetric=sym)
        assert torch.equal(back, fwd[rev])
    assert stats["asymmetry"] == 0.0
    biased, stats = win_rates(Generic(first_wins), x, prompts, group, return_stats=True)
    assert biased.tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])   # whoever comes first wins
    assert "asymmetry" not in stats
    fair, stats = win_rates(Generic(first_wins), x, prompts, group, symmetric=True, return_stats=True)
    assert torch.equal(fair, torch.full((5,), 0.5)) and stats["asymmetry"] == 1.0
    assert stats["judge_calls"] == 20


def test_several_groups_in_shuffled_order_and_singletons():
    """Groups interleaved in any order give the same rates as sorted; a group of one (and group=None) scores 1/2
    with no judge call."""
    gen = torch.Generator().manual_seed(2)
    levels = torch.rand(13, generator=gen).tolist()
    group = torch.tensor([0] * 4 + [1] * 3 + [2] * 5 + [7])
    prompts = [f"prompt {g}" for g in group.tolist()]
    x, _ = batch(levels)
    ordered = win_rates(Generic(brighter), x, prompts, group)
    perm = torch.randperm(13, generator=gen)
    shuffled = win_rates(Generic(brighter), x[perm], [prompts[i] for i in perm], group[perm])
    assert torch.equal(shuffled, ordered[perm])
    assert float(ordered[-1]) == 0.5
    # hashable group ids (prompts) work too
    assert torch.equal(win_rates(Generic(brighter), x, prompts, prompts), ordered)
    judge = Generic(brighter)
    rates, stats = win_rates(judge, x, prompts, None, return_stats=True)
    assert torch.equal(rates, torch.full((13,), 0.5)) and judge.pairs == 0 and stats["judge_calls"] == 0


def test_failed_judgements_are_ties_and_counted():
    """NaN judgements: 1/2 to each side, counted in judge_failures (never hidden)."""
    x, prompts = batch([0.1, 0.2, 0.3])

    def flaky(a, b, p):  # pairs (0,1), (0,2), (1,2): the middle one fails
        out = brighter(a, b, p)
        out[1] = math.nan
        return out

    rates, stats = win_rates(Generic(flaky), x, prompts, torch.zeros(3, dtype=torch.int64), return_stats=True,
                             batch_size=3)
    # 0 loses to 1, ties 2 (failed); 1 beats 0, loses to 2; 2 ties 0, beats 1
    assert rates.tolist() == pytest.approx([0.25, 0.5, 0.75])
    assert stats["judge_failures"] == 1 and stats["judge_calls"] == 3
    assert stats["judge_failure_rate"] == pytest.approx(1 / 3) and stats["tie_fraction"] == 0.0


def test_win_rate_errors():
    x, prompts = batch([0.1, 0.2, 0.3, 0.4])
    group = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"group 1 holds different prompts"):
        win_rates(Generic(brighter), x, ["a", "a", "b", "c"], group)
    with pytest.raises(RuntimeError, match=r"shape \(2,\)"):
        win_rates(Generic(lambda a, b, p: torch.ones(3)), x, prompts, group)
    with pytest.raises(ValueError, match=r"in \[0, 1\] or NaN"):
        win_rates(Generic(lambda a, b, p: torch.full((len(p),), 2.0)), x, prompts, group)
    with pytest.raises(ValueError, match="3 group ids"):
        win_rates(Generic(brighter), x, prompts, group[:3])
    with pytest.raises(TypeError, match="integer tensor"):
        win_rates(Generic(brighter), x, prompts, group.float())
    with pytest.raises(ValueError, match="tolerance"):
        MeanJudge(tolerance=-1.0)


# ---------------------------------------------------------------------------------------------- shapes judge
@pytest.fixture(scope="module")
def shapes_groups():
    """3 groups of 5 shapes-world videos: the true render of the group's caption, degraded to different degrees
    (noise, a dimmed copy, an empty video) so the verifier orders them."""
    gen = torch.Generator().manual_seed(3)
    pixels, prompts = [], []
    for g in range(3):
        video, cap, _ = sample(WORLD, 5, g, "train")
        noisy = (video + 0.35 * torch.randn(video.shape, generator=gen)).clamp(0, 1)
        other, _, _ = sample(WORLD, 5, 100 + g, "train")
        pixels += [video, noisy, other, torch.zeros_like(video), video.clone()]
        prompts += [cap] * 5
    return torch.stack(pixels), prompts, torch.arange(15) // 5


def test_shapes_judge_is_the_verifier_with_the_same_targets(shapes_groups):
    pixels, prompts, group = shapes_groups
    judge = build_judge("shapes", world=WORLD)
    assert isinstance(judge, ShapesJudge) and "shapes" in available_judges() and judge.tolerance == 1e-3
    verifier = ShapesVerifier(world=WORLD)
    assert torch.equal(judge.scores(pixels, prompts), verifier(pixels, prompts)["reward"])
    rates, stats = win_rates(judge, pixels, prompts, group, return_stats=True)
    s = verifier(pixels, prompts)["reward"].double()
    for i, j in itertools.combinations(range(15), 2):   # the pair rule, spelled out
        if group[i] == group[j]:
            pref = float(judge.compare(pixels[i : i + 1], pixels[j : j + 1], [prompts[i]])[0])
            expected = 0.5 if abs(s[i] - s[j]) <= 1e-3 else float(s[i] > s[j])
            assert pref == expected, (i, j)
    # the true render and its copy tie for the top; the empty video loses every comparison
    for g in range(3):
        r = rates[group == g]
        assert r[0] == r[4] == r.max() and float(r[3]) == 0.0
    assert stats["judge_failures"] == 0 and stats["judge_calls"] == 30
    # the score shortcut gives exactly what comparing every pair gives
    assert torch.equal(win_rates(Generic(judge.compare), pixels, prompts, group), rates)
    # a wide tolerance ties everything
    assert torch.equal(win_rates(ShapesJudge(world=WORLD, tolerance=1.0), pixels, prompts, group),
                       torch.full((15,), 0.5))


def test_shapes_judge_takes_the_runs_world_from_the_build_context():
    small = ShapesWorldConfig(height=24, width=24, colors=("red", "blue"))
    manager = RewardManager([{"name": "pairwise", "judge": "shapes"}]).build({"world": small})
    assert manager["pairwise"].judge.verifier.world == small
    video, cap, _ = sample(small, 0, 0, "train")
    pixels = torch.stack([video, torch.zeros_like(video)])
    out = manager(pixels, [cap, cap], group=torch.tensor([0, 0]))
    assert out.rewards["pairwise"].tolist() == [1.0, 0.0]
    with pytest.raises(RuntimeError, match="calibrated for 24x24"):
        manager(torch.zeros(2, 8, 3, 32, 32), [cap, cap], group=torch.tensor([0, 0]))
    with pytest.raises(UnknownJudgeError, match="registered judges: .*shapes"):
        build_judge("no_such_judge")
    with pytest.raises(ValueError, match="key must be"):
        ShapesJudge(key="nope")


# ---------------------------------------------------------------------------------------------- reward + manager
@register_reward("_test_meta_probe")
class _MetaProbe(RewardModel):
    """Pointwise: mean brightness; records the meta keys it was given."""

    seen: list = []

    def score(self, pixels, prompts, **meta):
        type(self).seen.append(sorted(meta))
        return {"reward": pixels.mean(dim=(1, 2, 3, 4))}


@register_judge("_test_brighter")
class _Brighter(PairwiseJudge):
    def compare(self, a, b, prompts):
        return brighter(a, b, prompts)


def test_pairwise_reward_in_the_manager(shapes_groups):
    pixels, prompts, group = shapes_groups
    specs = [{"name": "shapes"}, {"name": "_test_meta_probe", "weight": 0.5}]
    plain = RewardManager(specs, batch_size=4).build({"world": WORLD})
    mixed = RewardManager([*specs, {"name": "pairwise", "judge": "shapes", "weight": 2.0}], batch_size=4)
    mixed.build({"world": WORLD})
    assert mixed.groupwise and not plain.groupwise and PairwiseReward.groupwise
    assert "pairwise" in available_rewards() and "pair_judge" in available_rewards()
    _MetaProbe.seen.clear()
    a = plain(pixels, prompts, extra=list(range(15)))
    b = mixed(pixels, prompts, extra=list(range(15)), group=group)
    assert all(keys == ["extra"] for keys in _MetaProbe.seen)   # pointwise rewards never see "group"
    for key, value in a.components.items():                    # ... and score bitwise the same
        assert torch.equal(value.view(torch.int32), b.components[key].view(torch.int32)), key  # NaN too
    # the groupwise reward was called once on the whole batch (batch_size 4 would cut the groups of 5)
    direct = win_rates(build_judge("shapes", world=WORLD), pixels, prompts, group)
    assert torch.equal(b.rewards["pairwise"], direct)
    assert torch.allclose(b.total, a.total + 2.0 * direct, atol=1e-6)
    m = b.metrics()
    assert m["pairwise/judge_failures"] == 0.0 and m["pairwise/judge_calls"] == 30.0
    assert m["pairwise/reward"] == pytest.approx(0.5, abs=1e-7) and "pairwise/asymmetry" not in m
    # without group ids (a validation batch) every sample is alone: 1/2, no judge call
    c = mixed(pixels, prompts)
    assert torch.equal(c.rewards["pairwise"], torch.full((15,), 0.5)) and c.metrics()["pairwise/judge_calls"] == 0


def test_pairwise_reward_options_and_invalid_samples():
    x, prompts = batch([0.1, 0.5, 0.9, 0.3, 0.2, 0.8])
    x[1, 0, 0, 0, 0] = math.nan                            # sample 1 cannot be scored
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    reward = PairwiseReward(judge="_test_brighter", symmetric=True, decimals=3, scale=2.0, shift=-1.0)
    out = reward(x, prompts, group=group)
    assert out["valid"].tolist() == [True, False, True, True, True, True]
    assert math.isnan(float(out["reward"][1]))
    # group 0 without sample 1: levels 0.1, 0.9, 0.3 -> ranks 0, 1, 1/2; group 1: 0.2 < 0.8
    assert out["reward"][[0, 2, 3, 4, 5]].tolist() == pytest.approx([-1.0, 1.0, 0.0, -1.0, 1.0])
    assert reward.last_stats["asymmetry"] == 0.0 and reward.last_stats["judge_calls"] == 8
    rounded = PairwiseReward(judge=_Brighter(), decimals=3)(batch([0.1, 0.2, 0.3, 0.4])[0], ["p"] * 4,
                                                           group=torch.zeros(4, dtype=torch.int64))
    assert rounded["reward"].tolist() == pytest.approx([0.0, 0.333, 0.667, 1.0], abs=1e-7)
    with pytest.raises(ValueError, match="pair_batch_size"):
        PairwiseReward(judge="_test_brighter", pair_batch_size=0)
    with pytest.raises(ValueError, match="judge_args"):
        PairwiseReward(judge=_Brighter(), judge_args={"tolerance": 0.1})
    with pytest.raises(TypeError, match="compare"):
        PairwiseReward(judge=object())


def test_check_complete_groups():
    check_complete_groups(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]), 4)     # two whole groups per rank
    check_complete_groups(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), 4)
    with pytest.raises(ValueError, match=r"group 1 \(4 samples\) is spread over ranks 0\.\.1.*multiple of "
                                         r"data\.init_args\.group_size"):
        check_complete_groups(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]), 6)


def test_score_phase_passes_groups_to_groupwise_rewards_only(monkeypatch):
    from genrl.methods import phases
    from genrl.methods.common import Scorer

    logs: dict[str, float] = {}
    module = SimpleNamespace(trainer=None, log=lambda key, value, **kw: logs.__setitem__(key, value))
    x, prompts = batch([0.1, 0.4, 0.3, 0.2, 0.9, 0.5])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    ro = phases.Rollouts(prompts, x, None)

    _MetaProbe.seen.clear()
    pointwise = phases.score(module, Scorer([{"name": "_test_meta_probe"}]), ro, group)
    assert _MetaProbe.seen == [[]] and torch.equal(pointwise.group, group)

    scorer = Scorer([{"name": "_test_meta_probe", "weight": 0.0}, {"name": "pairwise", "judge": "_test_brighter"}])
    scores = phases.score(module, scorer, ro, group, meta={"extra": [1] * 6})
    assert _MetaProbe.seen[-1] == ["extra"]
    assert scores.result.rewards["pairwise"].tolist() == pytest.approx([0.0, 1.0, 0.5, 0.0, 1.0, 0.5])
    assert logs["reward/pairwise/judge_failures"] == 0.0 and logs["reward/pairwise/judge_calls"] == 6.0
    assert logs["reward/total"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="needs the batch's group ids"):
        phases.score(module, scorer, ro, None)
    # two ranks whose per-rank batch (6) is not a multiple of the group size (4): group 1 straddles them
    monkeypatch.setattr(phases, "gather_batch", lambda m, t: torch.cat([t, torch.tensor([1, 1, 2, 2, 2, 2])]))
    with pytest.raises(ValueError, match="group 1 .* spread over ranks 0..1"):
        phases.score(module, scorer, phases.Rollouts(prompts, x, None), torch.tensor([0, 0, 0, 0, 1, 1]))


# ---------------------------------------------------------------------------------------------- remote judge
def test_parse_preference():
    assert parse_preference("Image 1 is better than Image 2.") == 1.0
    assert parse_preference("The second video is worse. Final answer: Video 2 is better") == 0.0
    assert parse_preference("Reasoning: image 1 has artifacts...\nConclusion: B") == 0.0
    assert parse_preference("  a ") == 1.0 and parse_preference("2.") == 0.0 and parse_preference("first") == 1.0
    assert parse_preference("Final answer: they are equally good (tie)") == 0.5
    assert math.isnan(parse_preference("I cannot decide"))
    assert math.isnan(parse_preference(""))
    with pytest.raises(TypeError):
        parse_preference(None)


#: what the fake VLM "says" for a pair, by the brightness order of (a, b)
ANSWERS = {1: "<think>...</think> Final answer: Image 1 is better", 0: "Conclusion: Image 2",
           -1: "Hmm, these look alike to me; I would rather not pick"}


@register_judge("_test_text_vlm")
class _FakeVLM(PairwiseJudge):
    """A stand-in VLM judge: writes a text verdict, parsed with parse_preference; pairs whose two samples are equally
    bright get an unparseable rambling answer."""

    def compare(self, a, b, prompts):
        ma, mb = _means(a), _means(b)
        key = [-1 if abs(u - v) < 1e-9 else int(u > v) for u, v in zip(ma.tolist(), mb.tolist())]
        return torch.tensor([parse_preference(ANSWERS[k]) for k in key])


@register_reward("_test_out_of_range")
class _OutOfRange(RewardModel):
    def score(self, pixels, prompts, **meta):
        return {"reward": torch.full((pixels.shape[0],), 3.0)}


@pytest.fixture
def serve():
    servers: list[RewardServer] = []

    def start(service: RewardService) -> RewardServer:
        srv = RewardServer(service, "127.0.0.1", 0)
        srv.start()
        servers.append(srv)
        return srv

    yield start
    for srv in servers:
        srv.stop()


def test_remote_judge_against_a_fake_vlm_server(serve, caplog):
    srv = serve(RewardService(PairJudgeReward(judge="_test_text_vlm"), batch_size=4, device="cpu"))
    assert srv.service.info["name"] == "pair_judge"
    x, prompts = batch([0.2, 0.6, 0.2, 0.9, 0.4])   # samples 0 and 2 equally bright: an unparseable answer
    judge = RemoteJudge(srv.url, retries=0, pairs_per_request=3)
    p = judge.compare(x[[0, 1, 0]], x[[1, 0, 2]], prompts[:3])
    assert p[:2].tolist() == [0.0, 1.0] and math.isnan(float(p[2]))
    reward = PairwiseReward(judge="remote", judge_args={"url": srv.url, "retries": 0})
    out = reward(x, prompts, group=torch.tensor([0, 0, 0, 1, 1]))
    # group 0: 0.2, 0.6, 0.2 with (0, 2) a failed judgement -> a tie: wins 0.5, 2, 0.5 over 2 each
    assert out["reward"].tolist() == pytest.approx([0.25, 1.0, 0.25, 1.0, 0.0])
    assert reward.last_stats["judge_failures"] == 1 and reward.last_stats["judge_calls"] == 4
    # a served judge equals the local one on what crossed the wire (uint8 frames)
    video, cap, _ = sample(WORLD, 0, 1, "train")
    frames = torch.stack([video, torch.zeros_like(video), video.flip(-1), (video * 0.5)])
    frames = quantize_uint8(frames).float() / 255
    shapes = serve(RewardService(PairJudgeReward(judge="shapes", world=WORLD), batch_size=16, device="cpu"))
    group, caps = torch.zeros(4, dtype=torch.int64), [cap] * 4
    remote = win_rates(RemoteJudge(shapes.url, retries=0), frames, caps, group, symmetric=True)
    assert torch.equal(remote, win_rates(ShapesJudge(world=WORLD), frames, caps, group, symmetric=True))


def test_remote_judge_failures_are_counted_ties(serve, caplog):
    bad = serve(RewardService(_OutOfRange(), batch_size=4, device="cpu"))
    x, prompts = batch([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="expected 'pair_judge'"):
        RemoteJudge(bad.url, retries=0)
    reward = PairwiseReward(judge="remote", judge_args={"url": bad.url, "expected_name": None, "retries": 0})
    with caplog.at_level("WARNING"):
        out = reward(x, prompts, group=torch.zeros(3, dtype=torch.int64))
    assert out["reward"].tolist() == [0.5, 0.5, 0.5] and reward.last_stats["judge_failures"] == 3
    assert "outside [0, 1]" in caplog.text
    # a server that went away: every judgement fails (logged by the client), every sample ties
    srv = serve(RewardService(PairJudgeReward(judge="_test_brighter"), batch_size=4, device="cpu"))
    reward = PairwiseReward(judge="remote", judge_args={"url": srv.url, "retries": 0, "timeout": 2})
    srv.stop()
    out = reward(x, prompts, group=torch.zeros(3, dtype=torch.int64))
    assert out["reward"].tolist() == [0.5, 0.5, 0.5] and reward.last_stats["judge_failure_rate"] == 1.0
    # an odd request cannot be split into pairs: the server refuses it (a 400), the client marks it failed
    odd = serve(RewardService(PairJudgeReward(judge="_test_brighter"), batch_size=3, device="cpu"))
    p = RemoteJudge(odd.url, retries=0).compare(x[[0, 1]], x[[1, 2]], prompts[:2])
    assert torch.isnan(p).all()
    with pytest.raises(ValueError, match="odd batch of 3"):
        PairJudgeReward(judge="_test_brighter")(x, prompts)


# ---------------------------------------------------------------------------------------------- GRPO
def test_tiny_grpo_step_with_the_pairwise_reward(tmp_path, monkeypatch, tiny_policy_args):
    """One Pref-GRPO iteration through the real CLI (quickstart + tiny + the pairwise shapes judge): it trains, logs
    the win rate (mean exactly 1/2) and the judge counters, and a validation pass runs with it."""
    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.cli import GenRLCLI

    monkeypatch.chdir(tmp_path)
    cli = GenRLCLI(args=[
        "fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--config", str(ROOT / "configs/tiny/grpo.yaml"),
        "--config", str(ROOT / "configs/grpo/shapes_pref.yaml"), "--trainer.enable_progress_bar=false",
        *tiny_policy_args, "--trainer.max_steps=1", "--trainer.val_check_interval=1", "--trainer.callbacks=[]",
        "--trainer.logger=false",
    ])
    m = {k: float(v) for k, v in cli.trainer.logged_metrics.items()}
    assert int(cli.model.iteration) == 1
    assert m["reward/pairwise/reward"] == pytest.approx(0.5, abs=1e-6)
    assert m["reward/pairwise/judge_failures"] == 0.0
    assert m["reward/pairwise/judge_calls"] == 2 * math.comb(4, 2)    # 2 prompts x C(4, 2) pairs
    assert math.isfinite(m["reward/shapes/reward"]) and m["reward/invalid_fraction"] == 0.0
    assert m["val/pairwise/reward"] == 0.5 and math.isfinite(m["val/shapes/reward"])
    assert "train/loss" in m
