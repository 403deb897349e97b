"""History guidance compiler (genrl.flow.history_guidance): DFoT's invariants in float64 (spec: weights sum to 1,
w = 1 is the conditional prediction, fractional at sigma 0 is vanilla, one subset is vanilla, calls per step)."""

from __future__ import annotations

import itertools

import pytest
import torch

from genrl.flow import CompiledGuidance, GuidanceView, HistoryGuidance, HistoryTerm, combine_views


def _views(c: CompiledGuidance) -> dict[GuidanceView, float]:
    return dict(zip(c.views, c.weights))


def _preds(c: CompiledGuidance, bank: dict, shape=(3, 4, 2), seed=0) -> torch.Tensor:
    """A fixed random prediction per distinct view (the same view always gets the same tensor)."""
    g = torch.Generator().manual_seed(seed)
    for v in c.views:
        if v not in bank:
            bank[v] = torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.stack([bank[v] for v in c.views])


H4 = (0.0, 0.0, 0.0, 0.0)
EMPTY4 = (1.0, 1.0, 1.0, 1.0)


def test_presets_compile_to_the_documented_views_and_weights():
    assert _views(HistoryGuidance().compile(4)) == {GuidanceView(H4): 1.0}
    assert _views(HistoryGuidance("vanilla", scale=2.5).compile(4)) == {
        GuidanceView(H4): 2.5, GuidanceView(EMPTY4, True): -1.5}
    assert _views(HistoryGuidance("vanilla", scale=2.5, drop_text_in_uncond=False).compile(4)) == {
        GuidanceView(H4): 2.5, GuidanceView(EMPTY4, False): -1.5}
    assert _views(HistoryGuidance("fractional", scale=4.0, fractional_sigma=0.4).compile(4)) == {
        GuidanceView(H4): 1.0, GuidanceView((0.4,) * 4): 3.0, GuidanceView(EMPTY4, True): -3.0}
    temporal = HistoryGuidance("temporal", subsets=[[0, 1, 2], [-3, -2, -1]], weights=[2.0, 2.0]).compile(4)
    assert _views(temporal) == {GuidanceView((0.0, 0.0, 0.0, 1.0)): 2.0, GuidanceView((1.0, 0.0, 0.0, 0.0)): 2.0,
                                GuidanceView(EMPTY4, True): -3.0}


@pytest.mark.parametrize("rule, nfe", [
    (HistoryGuidance(), 1),
    (HistoryGuidance("vanilla", scale=2.0), 2),
    (HistoryGuidance("vanilla", scale=2.0, stabilization=0.02), 2),
    (HistoryGuidance("fractional", scale=3.0, fractional_sigma=0.8), 3),
    (HistoryGuidance("fractional", scale=3.0, fractional_sigma=0.8, stabilization=0.02), 3),
    (HistoryGuidance("temporal", subsets=[[0], [1], [2]], weights=[1.0, 1.0, 1.0]), 4),
    (HistoryGuidance("temporal", subsets=[[0, 1, 2, 3], [2, 3]], weights=[0.5, 0.5]), 2),  # sum 1: no empty view
    (HistoryGuidance("vanilla", scale=2.0, drop_text_in_uncond=False, text_scale=4.0), 3),
])
def test_calls_per_step(rule, nfe):
    compiled = rule.compile(4, generated=[False, False, True, True])
    assert compiled.nfe == nfe == len(set(compiled.views))
    assert abs(sum(compiled.weights) - 1.0) < 1e-12


def test_weights_sum_to_one_for_random_custom_rules_and_duplicates_merge():
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        n = int(torch.randint(1, 6, (1,), generator=g))
        terms = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            frames = tuple(i for i in range(n) if torch.rand(1, generator=g) < 0.6) or (0,)
            sigma = float(torch.randint(0, 3, (1,), generator=g)) * 0.3
            terms.append(HistoryTerm(float(torch.randn(1, generator=g)), frames, sigma,
                                     bool(torch.rand(1, generator=g) < 0.3)))
        c = HistoryGuidance("custom", terms=terms, text_scale=float(torch.rand(1, generator=g) * 3)).compile(n)
        assert abs(sum(c.weights) - 1.0) < 1e-12 and len(set(c.views)) == c.nfe
        assert all(w != 0.0 for w in c.weights)
    # the same view twice is one call with the summed weight
    twice = HistoryGuidance("custom", terms=[HistoryTerm(1.5), HistoryTerm(0.5, frames=(0, 1))]).compile(2)
    assert _views(twice) == {GuidanceView((0.0, 0.0)): 2.0, GuidanceView((1.0, 1.0), True): -1.0}


def test_scale_one_is_the_conditional_prediction_bit_for_bit():
    bank: dict = {}
    cond = HistoryGuidance().compile(3)
    want = _preds(cond, bank)[0]
    for rule in (HistoryGuidance("vanilla", scale=1.0), HistoryGuidance("fractional", scale=1.0),
                 HistoryGuidance("temporal", subsets=[[0, 1, 2]], weights=[1.0]),
                 HistoryGuidance("vanilla", scale=1.0, text_scale=1.0)):
        c = rule.compile(3)
        assert c.nfe == 1
        assert torch.equal(c.combine(_preds(c, bank)), want)


def test_reductions_fractional_at_sigma_zero_and_one_subset_are_vanilla():
    bank: dict = {}
    for w in (0.0, 0.5, 1.5, 2.0, 3.7):
        vanilla = HistoryGuidance("vanilla", scale=w).compile(4)
        frac = HistoryGuidance("fractional", scale=w, fractional_sigma=0.0).compile(4)
        one = HistoryGuidance("temporal", subsets=[[0, 1, 2, 3]], weights=[w]).compile(4)
        ref = vanilla.combine(_preds(vanilla, bank))
        for other in (frac, one):
            assert set(other.views) == set(vanilla.views)
            torch.testing.assert_close(other.combine(_preds(other, bank)), ref, rtol=0, atol=1e-14)


def test_combination_is_the_closed_form():
    bank: dict = {}
    w, k = 3.0, 0.6
    c = HistoryGuidance("fractional", scale=w, fractional_sigma=k, text_scale=2.0, drop_text_in_uncond=False
                        ).compile(2)
    _preds(c, bank)
    cond, noisy = bank[GuidanceView((0.0, 0.0))], bank[GuidanceView((k, k))]
    empty, no_text = bank[GuidanceView((1.0, 1.0))], bank[GuidanceView((0.0, 0.0), True)]
    want = cond + (w - 1) * (noisy - empty) + (2.0 - 1) * (cond - no_text)
    torch.testing.assert_close(c.combine(_preds(c, bank)), want, rtol=0, atol=1e-14)


def test_velocity_and_x0_composition_agree_only_when_weights_sum_to_one():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, dtype=torch.float64, generator=g)
    sigma = torch.tensor([0.3, 0.8], dtype=torch.float64)[:, None, None]
    v = torch.randn(3, 2, 4, 3, dtype=torch.float64, generator=g)
    x0 = x - sigma * v
    good = HistoryGuidance("fractional", scale=2.5, fractional_sigma=0.5).compile(3).weights
    torch.testing.assert_close(x - sigma * combine_views(v, good), combine_views(x0, good), rtol=0, atol=1e-13)
    bad = (2.5, 1.0, -1.0)  # sums to 2.5
    assert (x - sigma * combine_views(v, bad) - combine_views(x0, bad)).abs().max() > 0.1


def test_stabilization_reaches_generated_history_only():
    rule = HistoryGuidance("fractional", scale=2.0, fractional_sigma=0.01, stabilization=0.02)
    c = _views(rule.compile(4, generated=[False, False, True, True]))
    assert c == {GuidanceView((0.0, 0.0, 0.02, 0.02)): 1.0,
                 GuidanceView((0.01, 0.01, 0.02, 0.02)): 1.0,  # max(k_H, stabilization) on generated frames
                 GuidanceView(EMPTY4, True): -1.0}
    assert _views(HistoryGuidance("vanilla", scale=2.0, stabilization=0.02).compile(2)) == {
        GuidanceView((0.0, 0.0)): 2.0, GuidanceView((1.0, 1.0), True): -1.0}  # all ground truth: nothing changes


def test_history_sigmas_and_text_flags_follow_the_view_order():
    c = HistoryGuidance("temporal", subsets=[[0], [1, 2]], weights=[1.0, 2.0]).compile(3)
    sig = c.history_sigmas(dtype=torch.float64)
    assert sig.shape == (3, 3)
    for row, view, drop in zip(sig, c.views, c.drop_text()):
        assert tuple(row.tolist()) == view.history_sigma and drop == view.drop_text
    assert HistoryGuidance().compile(0).history_sigmas().shape == (1, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kind="history"), "unknown history guidance kind 'history'"),
    (dict(kind="vanilla", scale=-1.0), "scale must be"),
    (dict(kind="fractional", fractional_sigma=1.0), "fractional_sigma must be in"),
    (dict(kind="temporal", subsets=[[0]], weights=[1.0, 2.0]), "as many weights"),
    (dict(kind="temporal", subsets=[[]], weights=[1.0]), "at least one history frame"),
    (dict(kind="custom"), "needs terms"),
    (dict(stabilization=1.0), "stabilization must be in"),
])
def test_bad_rules_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HistoryGuidance(**kwargs)


def test_bad_compile_inputs_name_the_value():
    with pytest.raises(ValueError, match="history position 4 is out of range for 4"):
        HistoryGuidance("temporal", subsets=[[4]], weights=[1.0]).compile(4)
    with pytest.raises(ValueError, match="generated has 2 entries for 3"):
        HistoryGuidance().compile(3, generated=[True, False])
    with pytest.raises(ValueError, match="sigma must be in"):
        HistoryGuidance("custom", terms=[HistoryTerm(1.0, sigma=1.0)]).compile(2)
    with pytest.raises(ValueError, match="3 predictions for 2 weights"):
        combine_views(torch.zeros(3, 2), [0.5, 0.5])


def test_every_combination_of_presets_and_history_lengths_sums_to_one():
    for n, rule in itertools.product(range(0, 5), (
            HistoryGuidance("vanilla", scale=2.0), HistoryGuidance("fractional", scale=4.0),
            HistoryGuidance("vanilla", scale=1.5, text_scale=3.0, stabilization=0.02))):
        c = rule.compile(n, generated=[True] * n)
        assert abs(sum(c.weights) - 1.0) < 1e-12 and c.history_sigmas().shape == (c.nfe, n)
