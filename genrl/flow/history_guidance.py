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
least that noise level (DFoT's stabilized variants, 0.02: generated history is imperfect, a little noise hides it).
``drop_text_in_uncond`` (DFoT's default) drops the text in the empty view too, so text CFG comes for free;
``text_scale`` w_t != 1 adds independent text CFG, (w_t - 1) [pred(G | H, text) - pred(G | H, no text)].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from genrl.flow.broadcast import compute_dtype

__all__ = ["CompiledGuidance", "GuidanceView", "HistoryGuidance", "HistoryTerm", "combine_views"]

GuidanceKind = Literal["conditional", "vanilla", "fractional", "temporal", "custom"]
_KINDS = ("conditional", "vanilla", "fractional", "temporal", "custom")


@dataclass(frozen=True)
class HistoryTerm:
    """One term ``weight * [pred(G | frames at sigma) - pred(G | empty)]`` of a custom history-guidance rule.

    Attributes:
        weight: the term's weight w_i (any real; the empty view gets 1 - sum of the weights).
        frames: positions among the history frames (0 = the oldest; negative counts from the newest, -1 = the
            newest) that this view sees; the others are masked (sigma 1). None: all history frames.
        sigma: the noise level in [0, 1) the visible frames are seen at (0 = clean; > 0 = fractional guidance).
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
        fractional_sigma: the history's noise level k_H in (0, 1) of the fractional view (DFoT: 0.4 to 0.8).
        subsets: temporal: the history subsets, each a list of history positions (negative = from the newest).
        weights: temporal: one weight per subset.
        terms: custom: the terms; the empty view gets 1 - their weight sum.
        stabilization: sigma in [0, 1) at which views see *generated* history frames at the least (0 = clean;
            DFoT's stabilized variants use 0.02).
        drop_text_in_uncond: the empty view drops the text too (joint text and history guidance; DFoT's default).
        text_scale: independent text CFG scale w_t in the standard form (1 = none; adds one call).

    Raises:
        ValueError (in ``__post_init__``): an unknown kind, scales < 0, sigmas outside their range, temporal subsets
        and weights of different lengths or empty, custom without terms.
    """

    kind: GuidanceKind = "conditional"
    scale: float = 1.0
    fractional_sigma: float = 0.4
    subsets: list[list[int]] | None = None
    weights: list[float] | None = None
    terms: list[HistoryTerm] | None = None
    stabilization: float = 0.0
    drop_text_in_uncond: bool = True
    text_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown history guidance kind {self.kind!r}; use one of {', '.join(_KINDS)}")
        for name in ("scale", "text_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0 (1 = no guidance), got {value}")
        if not 0.0 <= self.stabilization < 1.0:
            raise ValueError(f"stabilization must be in [0, 1) (DFoT uses 0.02), got {self.stabilization}")
        if self.kind == "fractional" and not 0.0 <= self.fractional_sigma < 1.0:
            raise ValueError(f"fractional_sigma must be in [0, 1) (DFoT uses 0.4 to 0.8), got "
                             f"{self.fractional_sigma}")
        if self.kind == "temporal":
            if not self.subsets or self.weights is None or len(self.subsets) != len(self.weights):
                raise ValueError(f"temporal guidance needs subsets and as many weights, got subsets={self.subsets} "
                                 f"weights={self.weights}; e.g. subsets=[[0, 1, 2], [1, 2, 3]] weights=[2.0, 2.0]")
            if any(len(s) == 0 for s in self.subsets):
                raise ValueError(f"every temporal subset needs at least one history frame, got {self.subsets}")
        if self.kind == "custom" and not self.terms:
            raise ValueError("custom history guidance needs terms, e.g. terms=[HistoryTerm(weight=2.0)]")

    def to_terms(self) -> list[HistoryTerm]:
        """The rule as terms (the empty view's weight is implied): see the module docstring for each preset."""
        w = self.scale
        if self.kind == "conditional":
            return [HistoryTerm(1.0)]
        if self.kind == "vanilla":
            return [HistoryTerm(w)]
        if self.kind == "fractional":
            return [HistoryTerm(1.0), HistoryTerm(w - 1.0, sigma=self.fractional_sigma)]
        if self.kind == "temporal":
            return [HistoryTerm(float(wi), frames=tuple(int(i) for i in s)) for s, wi in zip(self.subsets,
                                                                                             self.weights)]
        return [HistoryTerm(float(t.weight), None if t.frames is None else tuple(t.frames), float(t.sigma),
                            bool(t.drop_text)) for t in self.terms]

    def compile(self, num_history: int, generated: Sequence[bool] | None = None) -> CompiledGuidance:
        """Compile the rule for ``num_history`` history frames into unique weighted views.

        Args:
            num_history: number of history frames (>= 0; with 0 the views differ only in their text, so joint
                guidance becomes text CFG of the same scale, and without ``drop_text_in_uncond`` one call).
            generated: per history frame, True where it was generated by the model (gets ``stabilization``),
                False where it is ground truth; None: all ground truth.

        Returns:
            The views with their summed weights (sum 1 up to float rounding; zero-weight views dropped).

        Raises:
            ValueError: a history position out of range, ``generated`` of the wrong length, or a term's sigma
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

        total = 0.0
        for term in self.to_terms():
            if not 0.0 <= term.sigma < 1.0:
                raise ValueError(f"a history term's sigma must be in [0, 1), got {term.sigma}")
            visible = set(range(num_history)) if term.frames is None else {
                _position(i, num_history) for i in term.frames}
            sig = tuple(max(term.sigma, self.stabilization if gen[i] else 0.0) if i in visible else 1.0
                        for i in range(num_history))
            add(GuidanceView(sig, term.drop_text), term.weight)
            total += term.weight
        add(empty, 1.0 - total)
        if self.text_scale != 1.0:
            full = tuple(self.stabilization if g else 0.0 for g in gen)
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
