"""History guidance compiler (genrl.flow.history_guidance): DFoT's invariants in float64 (spec: weights sum to 1,
w = 1 is the conditional prediction, fractional at sigma 0 is vanilla, one subset is vanilla, calls per step), and
DFoT's noise-level units (fractions of its schedule) against genrl's sigma at equal SNR."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from genrl.flow import (
    CompiledGuidance,
    GuidanceView,
    HistoryGuidance,
    HistoryTerm,
    combine_views,
    dfot_level_to_sigma,
    sigma_to_dfot_level,
)


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


# --- DFoT's noise-level units (issue 48) ---------------------------------------------------------------------------

def _equal_snr_sigma(alpha_bar: float) -> float:
    """genrl's sigma whose SNR ((1 - sigma) / sigma)^2 equals the DDPM marginal's alpha_bar / (1 - alpha_bar)."""
    return math.sqrt(1 - alpha_bar) / (math.sqrt(alpha_bar) + math.sqrt(1 - alpha_bar))


def _dfot_cosine_alpha_bars(timesteps: int = 1000, s: float = 0.008) -> torch.Tensor:
    """DFoT's discrete cosine schedule built the way a DDPM builds it: alpha_bar on t = 1/T .. 1 normalised at
    t = 0, betas from successive ratios clipped to [1e-9, 1], alpha_bar again as the cumulative product (float64)."""
    t = torch.arange(timesteps + 1, dtype=torch.float64) / timesteps
    f = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
    ab = (f / f[0])[1:]
    betas = (1 - torch.cat([ab[:1], ab[1:] / ab[:-1]])).clamp(1e-9, 1.0)
    return torch.cumprod(1 - betas, dim=0)


def test_dfot_levels_convert_to_sigma_at_equal_snr_on_its_cosine_schedule():
    # hand values (float64): DFoT's stabilization 0.02 and fractional levels 0.4 / 0.8 and the others in the docs
    want = {0.02: 0.04015957521372477, 0.1: 0.14488667517087758, 0.4: 0.4245832760172952,
            0.5: 0.5030783214567307, 0.8: 0.7563192349735367}
    for k, sigma in want.items():
        assert dfot_level_to_sigma(k) == pytest.approx(sigma, rel=1e-14, abs=0)
        assert dfot_level_to_sigma(k, "cosine") == dfot_level_to_sigma(k)
    # the reference samples level k at timestep index k T - 1 of its discrete table: equal SNR at every grid level
    # (to 1e-10: the table's 1 - alpha_bar loses digits near k = 0, where alpha_bar is 1 - 4e-5)
    table = _dfot_cosine_alpha_bars()
    for i in range(0, 999):
        ab = float(table[i])
        sigma = dfot_level_to_sigma((i + 1) / 1000)
        assert sigma == pytest.approx(_equal_snr_sigma(ab), rel=1e-10)
        assert ((1 - sigma) / sigma) ** 2 == pytest.approx(ab / (1 - ab), rel=1e-10)


def test_dfot_levels_on_the_shifted_cosine_schedule():
    """RealEstate10K / Minecraft: logSNR(t) = -2 ln tan(phi_min + t (phi_max - phi_min)) + 2 ln 0.125 over
    t = i / 999, level k at index k T - 1; sigma = 1 / (1 + exp(logSNR / 2))."""
    phi_min, phi_max = math.atan(math.exp(-7.5)), math.atan(math.exp(7.5))
    for k, sigma in {0.02: 0.19570921077756603, 0.4: 0.8529882028024369, 0.8: 0.9608877649646009}.items():
        t = (k * 1000 - 1) / 999
        logsnr = -2 * math.log(math.tan(phi_min + t * (phi_max - phi_min))) + 2 * math.log(0.125)
        assert dfot_level_to_sigma(k, "shifted_cosine") == pytest.approx(1 / (1 + math.exp(logsnr / 2)), rel=1e-13)
        assert dfot_level_to_sigma(k, "shifted_cosine") == pytest.approx(sigma, rel=1e-14)
    assert dfot_level_to_sigma(0.0, "shifted_cosine") == 0.0
    assert dfot_level_to_sigma(1.0, "shifted_cosine") == pytest.approx(1 / (1 + math.exp((-15 + 2 * math.log(0.125))
                                                                                       / 2)), rel=1e-14)


@pytest.mark.parametrize("schedule", ["cosine", "shifted_cosine"])
def test_dfot_conversion_round_trips_and_increases(schedule):
    g = torch.Generator().manual_seed(0)
    levels = torch.cat([torch.linspace(0.001, 1.0, 1000, dtype=torch.float64),
                        0.001 + 0.999 * torch.rand(200, generator=g, dtype=torch.float64)]).tolist()
    for k in levels:
        assert sigma_to_dfot_level(dfot_level_to_sigma(k, schedule), schedule) == pytest.approx(k, rel=1e-12,
                                                                                                abs=1e-14)
    grid = torch.linspace(0.001, 1.0, 1000, dtype=torch.float64).tolist()
    sig = [dfot_level_to_sigma(k, schedule) for k in grid]
    assert all(a < b for a, b in zip(sig, sig[1:]))  # strictly increasing
    lo, hi = sig[0], sig[-1]
    sigmas = torch.linspace(lo, hi, 500, dtype=torch.float64).tolist()
    back = [sigma_to_dfot_level(s, schedule) for s in sigmas]
    assert all(a < b for a, b in zip(back, back[1:]))
    for s, k in zip(sigmas, back):
        assert dfot_level_to_sigma(k, schedule) == pytest.approx(s, rel=1e-12, abs=1e-15)
    assert dfot_level_to_sigma(0.0, schedule) == 0.0 and sigma_to_dfot_level(0.0, schedule) == 0.0


def test_dfot_conversion_endpoints_and_bad_inputs():
    assert dfot_level_to_sigma(1.0) == 1.0 and sigma_to_dfot_level(1.0) == 1.0  # fully masked: zero terminal SNR
    assert 0.0 < dfot_level_to_sigma(1e-6) < 1e-3 and 1 - 1e-4 < dfot_level_to_sigma(1 - 1e-6) < 1.0  # continuous
    assert isinstance(dfot_level_to_sigma(1), float) and isinstance(sigma_to_dfot_level(0.5), float)
    for bad in (-0.01, 1.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"got {bad!r}" if math.isfinite(bad) else "finite real number"):
            dfot_level_to_sigma(bad)
        with pytest.raises(ValueError, match=f"got {bad!r}" if math.isfinite(bad) else "finite real number"):
            sigma_to_dfot_level(bad)
    with pytest.raises(ValueError, match="finite real number, got True"):
        dfot_level_to_sigma(True)
    with pytest.raises(ValueError, match="finite real number, got '0.4'"):
        dfot_level_to_sigma("0.4")
    with pytest.raises(ValueError, match="no level between 0 .* got 0.0005"):
        dfot_level_to_sigma(0.0005, "shifted_cosine")
    with pytest.raises(ValueError, match=r"reaches sigma 0 or \[0.0044.*got 0.001"):
        sigma_to_dfot_level(0.001, "shifted_cosine")
    with pytest.raises(ValueError, match="unknown DFoT schedule 'linear'"):
        dfot_level_to_sigma(0.4, "linear")


def test_new_defaults_are_dfots_levels_at_equal_snr():
    """Issue 48: the defaults were sigma 0 (stabilization off) and sigma 0.4 (k_H); they are now DFoT's levels 0.02
    and 0.4, i.e. sigma 0.0402 and 0.4246."""
    rule = HistoryGuidance()
    assert rule.units == "sigma"
    assert rule.stabilization == pytest.approx(0.04015957521372477, rel=1e-14)
    assert rule.fractional_sigma == pytest.approx(0.4245832760172952, rel=1e-14)
    # generated history now reaches the views at sigma 0.0402 (it was clean), ground truth stays clean
    views = _views(HistoryGuidance("fractional", scale=3.0).compile(4, generated=[False, False, True, True]))
    s, k = rule.stabilization, rule.fractional_sigma
    assert views == {GuidanceView((0.0, 0.0, s, s)): 1.0, GuidanceView((k,) * 4): 2.0, GuidanceView(EMPTY4, True): -2.0}
    # in DFoT's units the defaults are the reference's numbers themselves, and compile to the same views
    dfot = HistoryGuidance("fractional", scale=3.0, units="dfot")
    assert (dfot.stabilization, dfot.fractional_sigma) == (0.02, 0.4)
    assert _views(dfot.compile(4, generated=[False, False, True, True])) == views
    # the former behaviour is one explicit value away
    old = HistoryGuidance(stabilization=0.0, fractional_sigma=0.4)
    assert old.stabilization_sigma == 0.0 and old.fractional_sigma_as_sigma == 0.4


def test_dfot_units_give_the_same_guidance_as_the_converted_sigmas_bit_for_bit():
    gen = [True, False, True]
    pairs = [
        (dict(kind="fractional", scale=4.0, fractional_sigma=0.4, stabilization=0.02, text_scale=2.0),
         dict(fractional_sigma=dfot_level_to_sigma(0.4), stabilization=dfot_level_to_sigma(0.02))),
        (dict(kind="fractional", scale=3.0, fractional_sigma=0.8, stabilization=0.0),
         dict(fractional_sigma=dfot_level_to_sigma(0.8), stabilization=0.0)),
        (dict(kind="vanilla", scale=2.0, stabilization=0.1),
         dict(stabilization=dfot_level_to_sigma(0.1))),
        (dict(kind="custom", terms=[HistoryTerm(2.0, (0, 1), 0.5), HistoryTerm(-0.5, (-1,), 0.1, True)],
              stabilization=0.02),
         dict(terms=[HistoryTerm(2.0, (0, 1), dfot_level_to_sigma(0.5)),
                     HistoryTerm(-0.5, (-1,), dfot_level_to_sigma(0.1), True)],
              stabilization=dfot_level_to_sigma(0.02))),
    ]
    for dfot_kwargs, sigma_override in pairs:
        in_dfot = HistoryGuidance(**dfot_kwargs, units="dfot").compile(3, generated=gen)
        in_sigma = HistoryGuidance(**{**dfot_kwargs, **sigma_override}, units="sigma").compile(3, generated=gen)
        assert in_dfot == in_sigma  # the same views (every sigma bit for bit) and weights, in the same order
        bank: dict = {}
        assert torch.equal(in_dfot.combine(_preds(in_dfot, bank)), in_sigma.combine(_preds(in_sigma, bank)))
        assert torch.equal(in_dfot.history_sigmas(dtype=torch.float64), in_sigma.history_sigmas(dtype=torch.float64))
    # sigma units leave explicit values untouched (no round trip through the conversion)
    assert _views(HistoryGuidance("fractional", scale=2.0, fractional_sigma=0.3, stabilization=0.02).compile(
        2, generated=[False, True])) == {GuidanceView((0.0, 0.02)): 1.0, GuidanceView((0.3, 0.3)): 1.0,
                                         GuidanceView((1.0, 1.0), True): -1.0}


def test_shifted_dfot_units_are_dfots_realestate10k_levels():
    """units="dfot_shifted" reads DFoT's levels on its shifted cosine schedule (RealEstate10K / Minecraft): its
    stabilized-fractional preset 0.02 / 0.4 compiles to the views of sigma 0.1957 / 0.853, bit for bit those of the
    converted sigmas, and not to the cosine ones; the defaults stay DFoT's levels in those units."""
    gen = [True, False, True]
    shifted = HistoryGuidance("fractional", scale=4.0, fractional_sigma=0.4, stabilization=0.02, units="dfot_shifted")
    in_sigma = HistoryGuidance("fractional", scale=4.0, fractional_sigma=dfot_level_to_sigma(0.4, "shifted_cosine"),
                               stabilization=dfot_level_to_sigma(0.02, "shifted_cosine"))
    assert shifted.compile(3, generated=gen) == in_sigma.compile(3, generated=gen)
    assert shifted.stabilization_sigma == pytest.approx(0.1957, abs=1e-4)
    assert shifted.compile(3, generated=gen) != HistoryGuidance(
        "fractional", scale=4.0, fractional_sigma=0.4, stabilization=0.02, units="dfot").compile(3, generated=gen)
    default = HistoryGuidance("fractional", units="dfot_shifted")
    assert (default.stabilization, default.fractional_sigma) == (0.02, 0.4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(units="ddpm"), "unknown noise-level units 'ddpm'"),
    (dict(units="dfot", stabilization=1.0), r"stabilization must be in \[0, 1\) in units='dfot' .* got 1.0"),
    (dict(kind="fractional", units="dfot", fractional_sigma=-0.1), "fractional_sigma must be in .* got -0.1"),
])
def test_bad_units_and_levels_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HistoryGuidance(**kwargs)
    with pytest.raises(ValueError, match="sigma must be in \\[0, 1\\) in units='dfot', got 1.0"):
        HistoryGuidance("custom", terms=[HistoryTerm(1.0, sigma=1.0)], units="dfot").compile(2)
