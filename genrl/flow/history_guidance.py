"""History guidance (DFoT): declarative guidance rules compiled into weighted conditioning views.

A video model trained with an independent noise level per frame (diffusion forcing) can be asked for its
prediction of the frames to generate, G, given any subset of the known history frames H, each seen at any noise
level: sigma 0 = visible, sigma 1 = masked (pure noise). History guidance (Song et al. 2025, "History-Guided Video
Diffusion", arXiv 2502.06764, eq. 5 and Algorithm 1) extrapolates between such predictions like CFG does between
text-conditional and unconditional ones:

    pred = pred(G | empty) + sum_i w_i [pred(G | H_i at sigma_i) - pred(G | empty)]

where "empty" sees every history frame at sigma 1. The coefficients of the distinct predictions (one per
*conditioning view*: the sigma of every history frame and whether the text is dropped) sum to 1, so the rule is the
same whether it combines velocities, x0 or eps predictions, and a sampler step on the combined prediction is a step of
the ordinary kind. This module is the pure part: the rules (:class:`HistoryGuidance`), their compilation into unique
views with summed weights (:class:`CompiledGuidance`: duplicate branches merged, zero-weight branches dropped, the
number of network calls per step reported) and the combination of the views' predictions. The sampler that builds
each view's input and steps once on the combined prediction is :mod:`genrl.rollout.history`.

Presets (``HistoryGuidance.kind``), with w = ``scale``:

- ``conditional``: pred(G | H); 1 call.
- ``vanilla`` (HG-v): empty + w (H - empty); 2 calls (1 at w = 1). w of 1.5 to 3 helps; w >= 3-4 freezes motion.
- ``fractional`` (HG-f): pred(G | H) + (w - 1) [pred(G | H at ``fractional_sigma``) - empty]; 3 calls. A noisy history
  keeps its low frequencies only, so the guidance enforces consistency without freezing motion (DFoT's Algorithm 1
  and code put w - 1 on the bracket; the main text's eq. 6 writes w).
- ``temporal`` (HG-t): empty + sum_i w_i (H_i - empty) over history subsets ``subsets`` with weights ``weights``
  (no empty view when the weights sum to 1); 1 call per subset (+1).

``stabilization`` > 0 shows *generated* history frames (not ground-truth ones) to every view that sees them at at
least that noise level (DFoT's stabilized variants, level 0.02: generated history is imperfect, a little noise hides
it). ``drop_text_in_uncond`` (DFoT's default) drops the text in the empty view too, so text CFG comes for free;
``text_scale`` w_t != 1 adds independent text CFG, (w_t - 1) [pred(G | H, text) - pred(G | H, no text)].

Noise-level units. DFoT states its levels (stabilization 0.02, fractional k_H 0.4 / 0.8) as fractions k of its
1,000-step diffusion schedule, not as flow-matching sigmas. :func:`dfot_level_to_sigma` and
:func:`sigma_to_dfot_level` convert at equal signal-to-noise ratio; ``HistoryGuidance(units="dfot")`` takes every
level of the rule in DFoT's units, and the defaults (stabilization and k_H) are DFoT's levels 0.02 and 0.4 at equal
SNR in either units: sigma 0.0402 and 0.4246 (before: 0 and 0.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from genrl.flow.broadcast import compute_dtype

__all__ = [
    "DFOT_FRACTIONAL_LEVEL",
    "DFOT_STABILIZATION_LEVEL",
    "DFOT_TIMESTEPS",
    "CompiledGuidance",
    "GuidanceView",
    "HistoryGuidance",
    "HistoryTerm",
    "combine_views",
    "dfot_level_to_sigma",
    "sigma_to_dfot_level",
]

GuidanceKind = Literal["conditional", "vanilla", "fractional", "temporal", "custom"]
_KINDS = ("conditional", "vanilla", "fractional", "temporal", "custom")
NoiseUnits = Literal["sigma", "dfot", "dfot_shifted"]
_UNITS = ("sigma", "dfot", "dfot_shifted")
#: units -> the DFoT schedule its levels are fractions of
_UNIT_SCHEDULES = {"dfot": "cosine", "dfot_shifted": "shifted_cosine"}
DfotSchedule = Literal["cosine", "shifted_cosine"]
_SCHEDULES = ("cosine", "shifted_cosine")

#: DFoT's discrete schedule length T: a level k is its timestep index k T - 1 (k = 0: clean).
DFOT_TIMESTEPS = 1000
#: DFoT's stabilization level for generated history (a fraction of its schedule; sigma 0.0402 at equal SNR).
DFOT_STABILIZATION_LEVEL = 0.02
#: DFoT's fractional-guidance level k_H of its long RealEstate10K rollouts (Kinetics-600: 0.8), the default read on
#: its cosine schedule: sigma 0.4246 (its RealEstate10K model's shifted schedule makes it sigma 0.853).
DFOT_FRACTIONAL_LEVEL = 0.4
_COSINE_OFFSET = 0.008  # s of the cosine schedule (Nichol & Dhariwal 2021)
_SHIFT = 0.125  # the shifted cosine's shift (logSNR + 2 ln 0.125)
_LOGSNR_MIN, _LOGSNR_MAX = -15.0, 15.0  # the shifted cosine's logSNR range before the shift
_PHI_MIN, _PHI_MAX = math.atan(math.exp(-_LOGSNR_MAX / 2)), math.atan(math.exp(-_LOGSNR_MIN / 2))


def _number(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def _check_schedule(schedule: str) -> None:
    if schedule not in _SCHEDULES:
        raise ValueError(f"unknown DFoT schedule {schedule!r}; use 'cosine' (DFoT's default, its Kinetics-600 model) "
                         f"or 'shifted_cosine' (its RealEstate10K and Minecraft models)")


def dfot_level_to_sigma(level: float, schedule: DfotSchedule = "cosine") -> float:
    """The flow-matching sigma with the same signal-to-noise ratio as DFoT's noise level ``level``.

    DFoT (Song et al. 2025, "History-Guided Video Diffusion", arXiv 2502.06764) writes a history frame's noise
    level as a fraction k in [0, 1] of its T = 1000-step schedule (k = 0 clean, k = 1 fully masked) and samples it at
    timestep index k T - 1, where the DDPM marginal is ``x_k = sqrt(abar) x0 + sqrt(1 - abar) eps``,
    SNR = abar / (1 - abar). genrl's ``x_sigma = (1 - sigma) x0 + sigma eps`` has SNR = ((1 - sigma) / sigma)^2, so
    equal SNR is

        sigma = sqrt(1 - abar) / (sqrt(abar) + sqrt(1 - abar)) = 1 / (1 + sqrt(SNR)).

    ``schedule="cosine"`` (DFoT's default algorithm config, its Kinetics-600 model): Nichol & Dhariwal's cosine with
    offset s = 0.008, no shift, zero terminal SNR; index k T - 1 is the point t = k of
    ``abar(t) = cos^2(theta) / cos^2(theta_0)``, ``theta = (t + s) / (1 + s) pi / 2``, ``theta_0 = theta(0)``, so

        sigma = r / (cos(theta) + r),  r = sqrt(sin(theta - theta_0) sin(theta + theta_0)).

    ``schedule="shifted_cosine"`` (its RealEstate10K and Minecraft models): Simple Diffusion's cosine logSNR on
    [-15, 15] shifted by 2 ln 0.125, ``logSNR(t) = -2 ln tan(phi) + 2 ln 0.125``,
    ``phi = phi_min + t (phi_max - phi_min)``, ``phi_min = atan(exp(-7.5))``, ``phi_max = atan(exp(7.5))``, over T
    points t = i / (T - 1); index k T - 1 is t = (k T - 1) / (T - 1), so

        sigma = sin(phi) / (sin(phi) + 0.125 cos(phi)).

    Both are exact on the reference's grid (k a multiple of 1 / T, as every published level): the sigmas of its
    float64 tables (built from the betas) agree within 2e-14, those of its float32 buffers within 2e-6. Between grid
    points the reference truncates k T - 1 to an integer; this function follows the closed form (at most one step,
    1 / T, of k apart).

    ====== ========= ================
    k      cosine    shifted_cosine
    ====== ========= ================
    0.02   0.04016   0.19571
    0.1    0.14489   0.55735
    0.4    0.42458   0.85299
    0.5    0.50308   0.88873
    0.8    0.75632   0.96089
    ====== ========= ================

    Args:
        level: DFoT's level k, a float64 in [0, 1] (``shifted_cosine``: 0, or in [1 / T, 1]: the reference has no
            level between clean and its first timestep).
        schedule: ``"cosine"`` or ``"shifted_cosine"``.

    Returns:
        sigma, a float64: in [0, 1] for ``cosine`` (0 -> 0, 1 -> 1 exactly); for ``shifted_cosine`` 0 -> 0 and
        [1 / T, 1] -> [0.0044, 0.99993] (its last timestep keeps logSNR -19.2, not zero SNR). Increasing in k.

    Raises:
        ValueError: ``level`` not a finite number in the range above (the message names it), or an unknown schedule.
    """
    _check_schedule(schedule)
    k = _number("a DFoT noise level", level)
    if not 0.0 <= k <= 1.0:
        raise ValueError(f"a DFoT noise level is a fraction of its schedule in [0, 1], got {level!r}; for a "
                         f"flow-matching sigma use units='sigma'")
    if k == 0.0:
        return 0.0
    if schedule == "cosine":
        if k == 1.0:
            return 1.0
        theta = (k + _COSINE_OFFSET) / (1 + _COSINE_OFFSET) * math.pi / 2
        theta_0 = _COSINE_OFFSET / (1 + _COSINE_OFFSET) * math.pi / 2
        r = math.sqrt(math.sin(k / (1 + _COSINE_OFFSET) * math.pi / 2) * math.sin(theta + theta_0))
        return r / (math.cos(theta) + r)
    if k * DFOT_TIMESTEPS < 1.0:
        raise ValueError(f"DFoT's shifted cosine schedule has no level between 0 (clean) and its first timestep "
                         f"1/{DFOT_TIMESTEPS}, got {level!r}; use 0 or a level >= {1 / DFOT_TIMESTEPS}")
    phi = _PHI_MIN + (k * DFOT_TIMESTEPS - 1) / (DFOT_TIMESTEPS - 1) * (_PHI_MAX - _PHI_MIN)
    return math.sin(phi) / (math.sin(phi) + _SHIFT * math.cos(phi))


def sigma_to_dfot_level(sigma: float, schedule: DfotSchedule = "cosine") -> float:
    """DFoT's noise level k with the same SNR as the flow-matching ``sigma``: the inverse of
    :func:`dfot_level_to_sigma` (see there for both schedules).

    cosine: with ``theta_0 = s / (1 + s) pi / 2``, ``theta = atan2(sqrt(sin^2(theta_0) (1 - sigma)^2 + sigma^2),
    cos(theta_0) (1 - sigma))`` and ``k = theta (1 + s) 2 / pi - s``. shifted_cosine:
    ``phi = atan2(0.125 sigma, 1 - sigma)`` and ``k = ((phi - phi_min) / (phi_max - phi_min) (T - 1) + 1) / T``.
    E.g. genrl's former k_H and the benchmarks' stabilization, sigma 0.4 and 0.02, are k 0.369 and 0.0073 on
    the cosine schedule.

    Args:
        sigma: a float64 in [0, 1] (``shifted_cosine``: 0, or between the levels 1 / T and 1, sigma 0.0044 to
            0.99993).
        schedule: ``"cosine"`` or ``"shifted_cosine"``.

    Returns:
        k, a float64 in [0, 1] (0 -> 0 and, for ``cosine``, 1 -> 1 exactly); increasing in sigma.

    Raises:
        ValueError: ``sigma`` not a finite number in the range above (the message names it), or an unknown schedule.
    """
    _check_schedule(schedule)
    x = _number("sigma", sigma)
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"sigma must be in [0, 1] (0 = clean, 1 = noise), got {sigma!r}")
    if x == 0.0:
        return 0.0
    if schedule == "cosine":
        if x == 1.0:
            return 1.0
        theta_0 = _COSINE_OFFSET / (1 + _COSINE_OFFSET) * math.pi / 2
        theta = math.atan2(math.hypot(math.sin(theta_0) * (1 - x), x), math.cos(theta_0) * (1 - x))
        return theta * (1 + _COSINE_OFFSET) * 2 / math.pi - _COSINE_OFFSET
    lo, hi = dfot_level_to_sigma(1 / DFOT_TIMESTEPS, schedule), dfot_level_to_sigma(1.0, schedule)
    if not lo <= x <= hi:
        raise ValueError(f"DFoT's shifted cosine schedule reaches sigma 0 or [{lo:.6g}, {hi:.6g}] only, got {sigma!r}")
    phi = math.atan2(_SHIFT * x, 1 - x)
    t = (phi - _PHI_MIN) / (_PHI_MAX - _PHI_MIN)
    return min(1.0, max(1 / DFOT_TIMESTEPS, (t * (DFOT_TIMESTEPS - 1) + 1) / DFOT_TIMESTEPS))


@dataclass(frozen=True)
class HistoryTerm:
    """One term ``weight * [pred(G | frames at sigma) - pred(G | empty)]`` of a custom history-guidance rule.

    Attributes:
        weight: the term's weight w_i (any real; the empty view gets 1 - sum of the weights).
        frames: positions among the history frames (0 = the oldest; negative counts from the newest, -1 = the
            newest) that this view sees; the others are masked (sigma 1). None: all history frames.
        sigma: the noise level in [0, 1) the visible frames are seen at (0 = clean; > 0 = fractional guidance), in
            the rule's ``units`` (:class:`HistoryGuidance`).
        drop_text: the view also drops the text condition.
    """

    weight: float
    frames: tuple[int, ...] | None = None
    sigma: float = 0.0
    drop_text: bool = False


@dataclass(frozen=True)
class GuidanceView:
    """One network call per step: the noise level of each history frame and whether the text is dropped.

    Attributes:
        history_sigma: one sigma in [0, 1] per history frame (1 = masked), oldest first.
        drop_text: the call uses the null prompt.
    """

    history_sigma: tuple[float, ...]
    drop_text: bool = False


@dataclass
class HistoryGuidance:
    """A history-guidance rule (DFoT, arXiv 2502.06764, eq. 5), declared by a preset or by explicit terms.

    Attributes:
        kind: ``"conditional"``, ``"vanilla"`` (HG-v), ``"fractional"`` (HG-f), ``"temporal"`` (HG-t) or
            ``"custom"`` (``terms``); see the module docstring for each formula.
        scale: w of vanilla / fractional guidance (1 = the conditional prediction; DFoT's defaults: 1.5 to 3 for
            vanilla on Kinetics, 4 for fractional rollouts on RealEstate10K).
        fractional_sigma: the history's noise level k_H in [0, 1) of the fractional view, in ``units``. None (the
            default): DFoT's level 0.4, i.e. 0.4 with ``units="dfot"`` and sigma 0.4246 (its equal-SNR value) with
            ``units="sigma"`` (before issue 48 the default was sigma 0.4, DFoT's level 0.369). DFoT uses 0.4 to 0.8
            (sigma 0.42 to 0.76).
        subsets: temporal: the history subsets, each a list of history positions (negative = from the newest).
        weights: temporal: one weight per subset.
        terms: custom: the terms (their ``sigma`` in ``units``); the empty view gets 1 - their weight sum.
        stabilization: the noise level in [0, 1), in ``units``, at which views see *generated* history frames at
            the least (0 = clean). None (the default): DFoT's level 0.02, i.e. 0.02 with ``units="dfot"`` and sigma
            0.0402 with ``units="sigma"`` (before issue 48 the default was 0, off; pass 0 for that).
        drop_text_in_uncond: the empty view drops the text too (joint text and history guidance; DFoT's default).
        text_scale: independent text CFG scale w_t in the standard form (1 = none; adds one call).
        units: what the rule's noise levels (``fractional_sigma``, ``stabilization``, the terms' ``sigma``) mean:
            ``"sigma"`` (genrl's flow-matching sigma, the views' own), ``"dfot"`` (fractions of DFoT's 1,000-step
            cosine schedule, as its configs write them: ``stabilization_level``, ``freq_scale``; its Kinetics-600
            models) or ``"dfot_shifted"`` (the same on DFoT's shifted cosine schedule: its RealEstate10K and
            Minecraft models), converted at equal SNR by :func:`dfot_level_to_sigma`. The views (:meth:`compile`)
            are always in sigma.

    Raises:
        ValueError (in ``__post_init__``): an unknown kind or units, scales < 0, levels outside their range, temporal
        subsets and weights of different lengths or empty, custom without terms.
    """

    kind: GuidanceKind = "conditional"
    scale: float = 1.0
    fractional_sigma: float | None = None
    subsets: list[list[int]] | None = None
    weights: list[float] | None = None
    terms: list[HistoryTerm] | None = None
    stabilization: float | None = None
    drop_text_in_uncond: bool = True
    text_scale: float = 1.0
    units: NoiseUnits = "sigma"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown history guidance kind {self.kind!r}; use one of {', '.join(_KINDS)}")
        if self.units not in _UNITS:
            raise ValueError(f"unknown noise-level units {self.units!r}; use 'sigma' (flow-matching sigma), 'dfot' "
                             f"(fractions of DFoT's cosine schedule, as its configs write them) or 'dfot_shifted' "
                             f"(of its shifted cosine schedule: the RealEstate10K / Minecraft models)")
        for name in ("scale", "text_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (1 = no guidance), got {value}")
        if self.stabilization is None:
            self.stabilization = self._default(DFOT_STABILIZATION_LEVEL)
        if self.fractional_sigma is None:
            self.fractional_sigma = self._default(DFOT_FRACTIONAL_LEVEL)
        if not 0.0 <= self.stabilization < 1.0:
            raise ValueError(f"stabilization must be in [0, 1) in units={self.units!r} (0 = off; DFoT's 0.02 is "
                             f"{self._default(DFOT_STABILIZATION_LEVEL):.6g}), got {self.stabilization}")
        if self.kind == "fractional" and not 0.0 <= self.fractional_sigma < 1.0:
            raise ValueError(f"fractional_sigma must be in [0, 1) in units={self.units!r} (DFoT uses levels 0.4 to "
                             f"0.8: {self._default(0.4):.4g} to {self._default(0.8):.4g}), got {self.fractional_sigma}")
        if self.kind == "temporal":
            if not self.subsets or self.weights is None or len(self.subsets) != len(self.weights):
                raise ValueError(f"temporal guidance needs subsets and as many weights, got subsets={self.subsets} "
                                 f"weights={self.weights}; e.g. subsets=[[0, 1, 2], [1, 2, 3]] weights=[2.0, 2.0]")
            if any(len(s) == 0 for s in self.subsets):
                raise ValueError(f"every temporal subset needs at least one history frame, got {self.subsets}")
        if self.kind == "custom" and not self.terms:
            raise ValueError("custom history guidance needs terms, e.g. terms=[HistoryTerm(weight=2.0)]")

    def _default(self, dfot_level: float) -> float:
        """DFoT's level ``dfot_level`` in this rule's units (its cosine schedule's level for ``units="sigma"``)."""
        return dfot_level if self.units != "sigma" else dfot_level_to_sigma(dfot_level)

    def to_sigma(self, level: float) -> float:
        """A noise level in this rule's ``units`` as a flow-matching sigma (``units="sigma"``: unchanged)."""
        return float(level) if self.units == "sigma" else dfot_level_to_sigma(level, _UNIT_SCHEDULES[self.units])

    @property
    def stabilization_sigma(self) -> float:
        """``stabilization`` as a sigma."""
        return self.to_sigma(self.stabilization)

    @property
    def fractional_sigma_as_sigma(self) -> float:
        """``fractional_sigma`` (k_H) as a sigma."""
        return self.to_sigma(self.fractional_sigma)

    def to_terms(self) -> list[HistoryTerm]:
        """The rule as terms, their ``sigma`` in sigma whatever ``units`` (the empty view's weight is implied): see
        the module docstring for each preset.

        Raises:
            ValueError: a custom term's level outside [0, 1).
        """
        w = self.scale
        if self.kind == "conditional":
            return [HistoryTerm(1.0)]
        if self.kind == "vanilla":
            return [HistoryTerm(w)]
        if self.kind == "fractional":
            return [HistoryTerm(1.0), HistoryTerm(w - 1.0, sigma=self.fractional_sigma_as_sigma)]
        if self.kind == "temporal":
            return [HistoryTerm(float(wi), frames=tuple(int(i) for i in s)) for s, wi in zip(self.subsets,
                                                                                             self.weights)]
        for t in self.terms:
            if not 0.0 <= t.sigma < 1.0:
                raise ValueError(f"a history term's sigma must be in [0, 1) in units={self.units!r}, got {t.sigma}")
        return [HistoryTerm(float(t.weight), None if t.frames is None else tuple(t.frames), self.to_sigma(t.sigma),
                            bool(t.drop_text)) for t in self.terms]

    def compile(self, num_history: int, generated: Sequence[bool] | None = None) -> CompiledGuidance:
        """Compile the rule for ``num_history`` history frames into unique weighted views.

        Args:
            num_history: number of history frames (>= 0; with 0 the views differ only in their text, so joint
                guidance becomes text CFG of the same scale, and without ``drop_text_in_uncond`` one call).
            generated: per history frame, True where it was generated by the model (gets ``stabilization``),
                False where it is ground truth; None: all ground truth.

        The views' levels are sigmas (``units="dfot"`` levels converted by :func:`dfot_level_to_sigma`), so a rule in
        DFoT's units compiles to exactly the views of the same rule given the converted sigmas.

        Returns:
            The views with their summed weights (sum 1 up to float rounding; zero-weight views dropped).

        Raises:
            ValueError: a history position out of range, ``generated`` of the wrong length, or a term's level
                outside [0, 1).
        """
        if num_history < 0:
            raise ValueError(f"num_history must be >= 0, got {num_history}")
        gen = [False] * num_history if generated is None else [bool(g) for g in generated]
        if len(gen) != num_history:
            raise ValueError(f"generated has {len(gen)} entries for {num_history} history frames")
        empty = GuidanceView((1.0,) * num_history, self.drop_text_in_uncond)
        acc: dict[GuidanceView, float] = {}

        def add(view: GuidanceView, weight: float) -> None:
            acc[view] = acc.get(view, 0.0) + weight

        stab = self.stabilization_sigma
        total = 0.0
        for term in self.to_terms():
            visible = set(range(num_history)) if term.frames is None else {
                _position(i, num_history) for i in term.frames}
            sig = tuple(max(term.sigma, stab if gen[i] else 0.0) if i in visible else 1.0 for i in range(num_history))
            add(GuidanceView(sig, term.drop_text), term.weight)
            total += term.weight
        add(empty, 1.0 - total)
        if self.text_scale != 1.0:
            full = tuple(stab if g else 0.0 for g in gen)
            add(GuidanceView(full, False), self.text_scale - 1.0)
            add(GuidanceView(full, True), 1.0 - self.text_scale)
        views = tuple(v for v, w in acc.items() if w != 0.0)
        return CompiledGuidance(views, tuple(acc[v] for v in views), num_history)


def _position(i: int, n: int) -> int:
    j = i + n if i < 0 else i
    if not 0 <= j < n:
        raise ValueError(f"history position {i} is out of range for {n} history frames (use 0..{n - 1} or "
                         f"-{n}..-1)")
    return j


@dataclass(frozen=True)
class CompiledGuidance:
    """Unique conditioning views and their weights, ready for a sampler.

    Attributes:
        views: the distinct network calls per step (their order is the order of the ``preds`` ``combine`` takes).
        weights: one weight per view; they sum to 1 (up to float rounding).
        num_history: the number of history frames the views describe.
    """

    views: tuple[GuidanceView, ...]
    weights: tuple[float, ...]
    num_history: int

    @property
    def nfe(self) -> int:
        """Network calls per sampler step (the number of views)."""
        return len(self.views)

    def history_sigmas(self, device: torch.device | str | None = None,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The history frames' sigma per view, [V, num_history]."""
        return torch.tensor([v.history_sigma for v in self.views], device=device, dtype=dtype).reshape(
            self.nfe, self.num_history)

    def drop_text(self) -> list[bool]:
        """Per view, whether it uses the null prompt."""
        return [v.drop_text for v in self.views]

    def combine(self, preds: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """The guided prediction ``sum_v weight_v * preds[v]`` (see :func:`combine_views`)."""
        return combine_views(preds, self.weights)


def combine_views(preds: torch.Tensor | Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Linear combination of the views' predictions, in float32 (float64 if any prediction is float64).

    A single view of weight 1 is returned unchanged (upcast only), so guidance that compiles to one view equals
    the plain prediction bit for bit. With weights summing to 1 the result is the same for velocity, x0 and eps
    predictions (each is an affine function of the velocity with coefficients that depend only on x and sigma,
    which all views share on the generated frames); with other weights it is not.

    Args:
        preds: [V, B, ...] or a sequence of V tensors [B, ...], any float dtype.
        weights: V real weights.

    Returns:
        The combined prediction [B, ...].

    Raises:
        ValueError: the number of weights differs from the number of predictions, or the predictions' shapes differ.
    """
    items = list(preds.unbind(0)) if isinstance(preds, torch.Tensor) else list(preds)
    if len(items) != len(weights) or not items:
        raise ValueError(f"{len(items)} predictions for {len(weights)} weights")
    if any(p.shape != items[0].shape for p in items):
        raise ValueError(f"the views' predictions differ in shape: {[tuple(p.shape) for p in items]}")
    dt = compute_dtype(*items)
    if len(items) == 1 and float(weights[0]) == 1.0:
        return items[0].to(dt)
    out = float(weights[0]) * items[0].to(dt)
    for w, p in zip(weights[1:], items[1:]):
        out = out + float(w) * p.to(dt)
    return out
