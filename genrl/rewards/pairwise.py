"""Pairwise judges and group win rates: the groupwise reward of Pref-GRPO (docs/rewards.md, Pairwise judges and
win rates).

Pref-GRPO (Wang et al. 2025, "Pairwise Preference Reward-based GRPO") keeps GRPO's loss and replaces the pointwise
reward by a **win rate**: a judge compares every unordered pair of a group's samples once, and sample i's reward is

    r_i = wins_i / (G - 1),     wins_i = sum over j != i of pref(i over j)

with ``pref`` 1 for a win, 0 for a loss and 1/2 for a tie. Every pair hands out exactly one win, so
``sum_i wins_i = C(G, 2)`` and the mean win rate of every group is exactly 1/2; with a transitive judge without
ties the rates are the fixed ranks ``{0, 1/(G-1), ..., 1}`` whatever the gaps between the samples' qualities (the
paper's point: std-normalised pointwise scores of near-identical samples inflate tiny gaps into large advantages,
"illusory advantage", which feeds reward hacking; ranks are bounded).

Pieces:

* a **judge** (:class:`PairwiseJudge`, or any object with the same ``compare``): ``compare(pixels_a, pixels_b,
  prompts) -> float [P]`` with 1.0 (a preferred), 0.0 (b preferred), 0.5 (tie) or NaN (a failed or unparseable
  judgement: scored as a tie, 1/2 to each side, and counted in ``judge_failures``). :class:`ScoreJudge` builds a
  judge from a pointwise score (each sample scored once per group, not once per pair); :class:`ShapesJudge`
  (``"shapes"``) is the shapes world's exact verifier as a judge; :class:`RemoteJudge` (``"remote"``) asks a
  judge served by ``genrl reward-serve --reward pair_judge``;
* :func:`win_rates`: the win rates of a batch holding whole groups (``symmetric`` judges each pair in both
  presentation orders and averages them, and measures the judge's position bias);
* :class:`PairwiseReward` (``"pairwise"``): the groupwise reward a :class:`~genrl.rewards.RewardManager` calls with
  the batch's group ids (``groupwise = True``); :class:`PairJudgeReward` (``"pair_judge"``): the server-side
  adapter exposing a judge through the reward server's wire format.

Cost: ``C(G, 2)`` judgements per group (28 for G = 8, 120 for G = 16), twice that with ``symmetric``.
"""

from __future__ import annotations

import abc
import inspect
import itertools
import logging
import math
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from genrl.rewards.base import RewardModel
from genrl.rewards.registry import Registry, register_reward
from genrl.rewards.remote import RemoteReward

__all__ = [
    "PairJudgeReward",
    "PairwiseJudge",
    "PairwiseReward",
    "RemoteJudge",
    "ScoreJudge",
    "ShapesJudge",
    "UnknownJudgeError",
    "available_judges",
    "build_judge",
    "check_complete_groups",
    "parse_preference",
    "register_judge",
    "win_rates",
]

logger = logging.getLogger(__name__)

#: How far outside [0, 1] a judge's finite preference may lie (float rounding) before it is called a bug.
_PREF_TOLERANCE = 1e-6


# ---------------------------------------------------------------------------------------------- judges
class PairwiseJudge(torch.nn.Module, metaclass=abc.ABCMeta):
    """Base class of pairwise judges (a module, so a judge holding a model moves with ``.to(device)``).

    Any object with a ``compare`` of this signature works with :func:`win_rates`; subclassing adds the registry
    name and device placement.
    """

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def compare(self, pixels_a: Tensor, pixels_b: Tensor, prompts: list[str]) -> Tensor:
        """Judge P pairs, sample a presented first.

        Args:
            pixels_a, pixels_b: float ``[P, T, C, H, W]`` in [0, 1] (finite), the two samples of each pair.
            prompts: P strings, the prompt both samples of pair p answer.

        Returns:
            float ``[P]`` (any device): 1.0 when a is preferred, 0.0 when b is, 0.5 for a tie, NaN for a failed or
            unparseable judgement. Values strictly between 0 and 1 are allowed (a judge's preference
            probability): a wins that share of the pair and b the rest.
        """


class ScoreJudge(PairwiseJudge):
    """A judge from a pointwise score: the sample with the higher score wins; scores within ``tolerance`` of each
    other tie; a NaN score on either side is a failed judgement.

    :func:`win_rates` scores each sample of a group once through :meth:`scores` and compares the scores (the same
    result as calling :meth:`compare` on every pair, G scorings instead of ``G (G - 1)``).

    Args:
        tolerance: ``|s_a - s_b| <= tolerance`` is a tie (>= 0). With 0, any strictly increasing transform of the
            score leaves every win rate unchanged.

    Raises:
        ValueError: a negative or non-finite ``tolerance``.
    """

    def __init__(self, tolerance: float = 0.0) -> None:
        super().__init__()
        if not (math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"{type(self).__name__}: tolerance must be a finite number >= 0, got {tolerance!r}")
        self.tolerance = float(tolerance)

    @abc.abstractmethod
    def scores(self, pixels: Tensor, prompts: list[str]) -> Tensor:
        """float ``[B]`` scores (higher is better; NaN: no score) of pixels float ``[B, T, C, H, W]`` in [0, 1]."""

    def prefer(self, score_a: Tensor, score_b: Tensor) -> Tensor:
        """float64 ``[P]`` preferences of a over b from their scores (1, 0, 0.5 within ``tolerance``, NaN)."""
        a, b = score_a.detach().double().cpu(), score_b.detach().double().cpu()
        out = torch.where(a > b, 1.0, 0.0).double()
        out = torch.where((a - b).abs() <= self.tolerance, 0.5, out)
        return torch.where(a.isnan() | b.isnan(), math.nan, out)

    def compare(self, pixels_a: Tensor, pixels_b: Tensor, prompts: list[str]) -> Tensor:
        return self.prefer(self.scores(pixels_a, prompts), self.scores(pixels_b, prompts))

    def extra_repr(self) -> str:
        return f"tolerance={self.tolerance}"


class UnknownJudgeError(KeyError, ValueError):
    """An unregistered judge name (a KeyError and a ValueError); the message lists the registered judges."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


JUDGES = Registry("judge", PairwiseJudge, UnknownJudgeError)
#: ``@register_judge(name)``: register a :class:`PairwiseJudge` subclass (``Registry.register``).
register_judge = JUDGES.register
#: sorted registered judge names.
available_judges = JUDGES.names


def build_judge(name: str, world: Any = None, **kwargs: Any) -> PairwiseJudge:
    """Instantiate the judge registered as ``name`` with ``kwargs``; ``world`` (the shapes world of the run) is
    passed only to judges whose constructor takes a ``world`` argument, and only when not None.

    Raises:
        UnknownJudgeError (KeyError, ValueError): unknown name, listing the registered judges.
        TypeError, ValueError: from the judge's constructor.
    """
    cls = JUDGES.get(name)
    if world is not None and "world" in inspect.signature(cls.__init__).parameters and "world" not in kwargs:
        kwargs["world"] = world
    return cls(**kwargs)


@register_judge("shapes")
class ShapesJudge(ScoreJudge):
    """The shapes world's exact verifier (reward ``"shapes"``, :class:`~genrl.rewards.ShapesVerifier`) as a judge:
    the sample with the higher verifier score wins, scores within ``tolerance`` tie. The verifier parses each
    prompt with the run's world, exactly as the ``shapes`` reward does.

    Args:
        world: the shapes world (a ``ShapesWorldConfig``, a dict of its fields, None: the default); the pairwise
            reward passes the run's world.
        tolerance: scores within this distance tie (default 1e-3: the verifier's soft scores are in [0, 1]).
        key: the verifier output compared (default ``"reward"``; e.g. ``"all_correct"`` for a hard verdict).
        **verifier_args: further :class:`~genrl.rewards.ShapesVerifier` arguments (``attributes``,
            ``calibration_samples``).

    Raises:
        ValueError: ``key`` not a verifier output; a bad ``tolerance``; plus the verifier's construction errors.
        ValueError (at call): a caption that does not parse for ``world``, frames of another size (the verifier's).
    """

    def __init__(self, world: Any = None, tolerance: float = 1e-3, key: str = "reward", **verifier_args: Any) -> None:
        super().__init__(tolerance)
        from genrl.rewards.shapes import ShapesVerifier

        if key not in ShapesVerifier.dimensions:
            raise ValueError(f"ShapesJudge: key must be a verifier output {ShapesVerifier.dimensions}, got {key!r}")
        self.key = key
        self.verifier = ShapesVerifier(world=world, **verifier_args)

    def scores(self, pixels: Tensor, prompts: list[str]) -> Tensor:
        return self.verifier(pixels, prompts)[self.key]

    def extra_repr(self) -> str:
        return f"tolerance={self.tolerance}, key={self.key!r}"


@register_judge("remote")
class RemoteJudge(PairwiseJudge):
    """A judge behind the loopback reward server (a VLM judge in its own environment): the server runs
    ``genrl reward-serve --reward pair_judge --kwargs '{"judge": "<name>", "judge_args": {...}}'``
    (:class:`PairJudgeReward`), and this client sends each pair through :class:`~genrl.rewards.RemoteReward`.

    A request of P pairs holds 2P videos interleaved ``[a_0, b_0, a_1, b_1, ...]`` (uint8, see
    :mod:`genrl.rewards.remote`) with each pair's prompt twice; the answer's raw ``reward`` of row ``2p`` is the
    preference of a over b. A preference is accepted when its row is valid and it is a number in [0, 1]; anything
    else (a failed request after the retries, a server-side judge that could not parse its model's answer, a value
    out of range) is NaN: a failed judgement, scored as a tie and counted in ``judge_failures`` (and logged).

    Args:
        url: server base URL, e.g. ``"http://127.0.0.1:8765"``.
        expected_name: the reward the server must serve (default ``"pair_judge"``).
        pairs_per_request: at most this many pairs per request (None: every pair of a call in one request).
        timeout, retries, backoff, max_backoff, expected_weights_sha256, connect: as
            :class:`~genrl.rewards.RemoteReward`.

    Raises:
        ValueError, ConnectionError: as :class:`~genrl.rewards.RemoteReward` (bad URL, unreachable server with
            ``connect``, a server serving another reward); ``pairs_per_request < 1``.
    """

    def __init__(
        self,
        url: str,
        expected_name: str | None = "pair_judge",
        pairs_per_request: int | None = None,
        timeout: float = 60.0,
        retries: int = 2,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        expected_weights_sha256: str | None = None,
        connect: bool = True,
    ) -> None:
        super().__init__()
        if pairs_per_request is not None and pairs_per_request < 1:
            raise ValueError(f"RemoteJudge: pairs_per_request must be >= 1 or None, got {pairs_per_request}")
        self.client = RemoteReward(
            url, timeout=timeout, retries=retries, backoff=backoff, max_backoff=max_backoff,
            expected_name=expected_name, expected_weights_sha256=expected_weights_sha256,
            batch_size=None if pairs_per_request is None else 2 * pairs_per_request, connect=connect,
        )

    def compare(self, pixels_a: Tensor, pixels_b: Tensor, prompts: list[str]) -> Tensor:
        p = pixels_a.shape[0]
        x = torch.stack([pixels_a, pixels_b], dim=1).reshape(2 * p, *pixels_a.shape[1:])
        out = self.client(x, [q for q in prompts for _ in range(2)])
        pref = out["reward"][0::2].detach().double().cpu()
        ok = out["valid"][0::2].cpu() & torch.isfinite(pref)
        bad_range = ok & ((pref < 0) | (pref > 1))
        if bool(bad_range.any()):
            logger.warning("remote judge %s: %d preference(s) outside [0, 1] (e.g. %g); counted as failed judgements",
                           self.client.url, int(bad_range.sum()), float(pref[bad_range][0]))
        return torch.where(ok & ~bad_range, pref, math.nan)


_FIRST = r"(?:(?:image|video|sample|option|candidate|picture)\s*(?:1|a)|first|1|a)"
_SECOND = r"(?:(?:image|video|sample|option|candidate|picture)\s*(?:2|b)|second|2|b)"
_BETTER = r"\s+(?:is|was)\s+(?:better|preferred|superior|the\s+winner)"
_TIE = re.compile(r"\b(?:tie|tied|equal|equally|same|both)\b")


def parse_preference(answer: str) -> float:
    """A judge model's text answer -> a preference of the first sample: 1.0, 0.0, 0.5 (tie) or NaN (unparseable).

    For judges that instruct their model to end with a verdict. Only the text after the last ``answer`` /
    ``conclusion`` / ``verdict`` marker followed by ``:`` is read (the whole text when there is none),
    case-insensitively. Recognised, in this order: ``"<label> is better"`` (also ``preferred``, ``superior``,
    ``the winner``; the first such phrase decides), a bare label (``"1"``, ``"B"``, ``"Image 2"``,
    ``"second"``; an optional trailing ``.``), and a tie word (``tie``, ``equal``, ``equally``, ``same``, ``both``).
    Labels: ``1 / a / first`` (optionally after ``image``, ``video``, ``sample``, ``option``, ``candidate``,
    ``picture``) for the first sample, ``2 / b / second`` for the second. Anything else is NaN.

    Raises:
        TypeError: ``answer`` not a string.
    """
    if not isinstance(answer, str):
        raise TypeError(f"parse_preference needs a string, got {type(answer).__name__}")
    text = answer.lower()
    markers = list(re.finditer(r"\b(?:final\s+answer|answer|conclusion|verdict)\b[^:\n]*:", text))
    if markers:
        text = text[markers[-1].end():]
    text = text.strip()
    better = re.search(rf"\b({_FIRST}|{_SECOND}){_BETTER}\b", text)
    if better:
        return 1.0 if re.fullmatch(_FIRST, better.group(1)) else 0.0
    bare = text.strip(" .*\"'`").strip()
    if re.fullmatch(_FIRST, bare):
        return 1.0
    if re.fullmatch(_SECOND, bare):
        return 0.0
    if _TIE.search(text):
        return 0.5
    return math.nan


# ---------------------------------------------------------------------------------------------- win rates
def _group_keys(group: Tensor | Sequence[Hashable] | None, n: int) -> list[Hashable]:
    if group is None:
        return list(range(n))  # every sample its own group: no comparisons, rate 1/2
    if isinstance(group, Tensor):
        ids = group.detach().cpu().reshape(-1)
        if ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"group ids must be an integer tensor or a sequence of hashables, got {ids.dtype}")
        keys: list[Hashable] = ids.tolist()
    else:
        keys = list(group)
    if len(keys) != n:
        raise ValueError(f"got {len(keys)} group ids for a batch of {n} samples")
    return keys


def _check_prefs(judge: Any, p: Any, n: int) -> Tensor:
    who = getattr(judge, "name", "") or type(judge).__name__
    if not isinstance(p, Tensor) or tuple(p.shape) != (n,):
        got = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
        raise RuntimeError(f"judge {who!r}: compare() must return a float tensor of shape ({n},), got {got}")
    p = p.detach().double().cpu()
    finite = torch.isfinite(p)
    if bool((finite & ((p < -_PREF_TOLERANCE) | (p > 1 + _PREF_TOLERANCE))).any()):
        raise ValueError(f"judge {who!r}: preferences must be in [0, 1] or NaN, got {p[finite].min():.4g} .. "
                         f"{p[finite].max():.4g}")
    return torch.where(finite, p.clamp(0.0, 1.0), math.nan)


def _judge_pairs(judge: Any, pixels: Tensor, prompts: list[str], a: Tensor, b: Tensor, batch_size: int,
                 scores: Tensor | None) -> Tensor:
    """float64 [P] preferences of a[p] over b[p] (NaN: failed), P = len(a)."""
    if scores is not None:
        return _check_prefs(judge, judge.prefer(scores[a], scores[b]), len(a))
    parts = []
    for lo in range(0, len(a), batch_size):
        ia, ib = a[lo : lo + batch_size], b[lo : lo + batch_size]
        out = judge.compare(pixels[ia.to(pixels.device)], pixels[ib.to(pixels.device)],
                            [prompts[i] for i in ia.tolist()])
        parts.append(_check_prefs(judge, out, len(ia)))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def win_rates(
    judge: Any,
    pixels: Tensor,
    prompts: Sequence[str],
    group: Tensor | Sequence[Hashable] | None,
    symmetric: bool = False,
    valid: Tensor | None = None,
    batch_size: int = 64,
    return_stats: bool = False,
) -> Tensor | tuple[Tensor, dict[str, float]]:
    """Pref-GRPO win rates of a batch of whole groups: ``r_i = wins_i / (G_i - 1)``.

    In every group each unordered pair (i, j), i before j in batch order, is judged once with i presented first
    (``symmetric``: also with j first, and the two verdicts are averaged: ``pref = (p_ij + 1 - p_ji) / 2``). i
    gets ``pref`` of a win and j ``1 - pref``; a failed judgement (NaN) counts 1/2 to each side. Hence
    ``sum_i wins_i = C(G, 2)`` and every group's mean rate is exactly 1/2.

    A group of one sample (or with one valid sample) has nothing to be compared with: its rate is 1/2 (a GRPO
    group of one gets advantage 0 anyway). ``group=None`` makes every sample its own group (all rates 1/2, no
    judge call), e.g. a validation batch. Groups may come in any order and interleaved.

    Args:
        judge: a :class:`PairwiseJudge` or any object with ``compare(pixels_a, pixels_b, prompts) -> [P]``; a
            :class:`ScoreJudge` has each valid sample scored once (:meth:`ScoreJudge.scores`) instead.
        pixels: float ``[B, T, C, H, W]`` in [0, 1].
        prompts: B strings; every group's valid samples must share one prompt.
        group: int tensor ``[B]`` or B hashables naming each sample's group; None: every sample alone.
        symmetric: judge both presentation orders (twice the judge calls) and log the asymmetry.
        valid: bool ``[B]``: samples to compare (default: all); the others get NaN and are left out of their
            group (its size G counts the valid samples only).
        batch_size: pairs per ``compare`` call (>= 1).
        return_stats: also return the logging scalars.

    Returns:
        float32 ``[B]`` rates in [0, 1] (NaN where ``valid`` is False); with ``return_stats``, ``(rates, stats)``:
        ``judge_calls`` (pair judgements made, both orders counted), ``judge_failures`` (judgements that were NaN),
        ``judge_failure_rate``, ``tie_fraction`` (parsed judgements of exactly 1/2), ``groups`` and, with
        ``symmetric``, ``asymmetry``: the mean ``|p_ij - (1 - p_ji)|`` over pairs with both orders parsed (0 for
        a judge without position bias, 1 for one that always prefers the first sample; NaN when no pair had both).

    Raises:
        ValueError: ``len(prompts)`` or the group ids not of length B; a group whose valid samples have different
            prompts (names the group); ``batch_size < 1``; a judge returning a finite preference outside [0, 1].
        TypeError: float group ids.
        RuntimeError: a judge returning a wrong shape.
    """
    n = pixels.shape[0]
    prompts = list(prompts)
    if len(prompts) != n:
        raise ValueError(f"win_rates: got {len(prompts)} prompts for a batch of {n} samples")
    if batch_size < 1:
        raise ValueError(f"win_rates: batch_size must be >= 1, got {batch_size}")
    keys = _group_keys(group, n)
    ok = torch.ones(n, dtype=torch.bool) if valid is None else valid.detach().cpu().bool().reshape(-1)
    members: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        if ok[i]:
            members.setdefault(k, []).append(i)
    a_list, b_list = [], []
    for k, idx in members.items():
        if len({prompts[i] for i in idx}) > 1:
            raise ValueError(f"win_rates: group {k!r} holds different prompts ({sorted({prompts[i] for i in idx})[:3]}"
                             f"); a judge compares samples of one prompt: pass the prompt's group ids")
        for i, j in itertools.combinations(idx, 2):
            a_list.append(i)
            b_list.append(j)
    a = torch.tensor(a_list, dtype=torch.int64)
    b = torch.tensor(b_list, dtype=torch.int64)
    scores = None
    if isinstance(judge, ScoreJudge) and len(a):
        used = sorted(set(a_list) | set(b_list))
        s = judge.scores(pixels[torch.tensor(used, device=pixels.device)], [prompts[i] for i in used])
        scores = torch.full((n,), math.nan, dtype=torch.float64)
        scores[torch.tensor(used)] = s.detach().double().cpu().reshape(-1)
    p = _judge_pairs(judge, pixels, prompts, a, b, batch_size, scores)
    failed = p.isnan()
    calls, failures = len(p), int(failed.sum())
    parsed = p[~failed]
    ties = int((parsed == 0.5).sum())
    stats: dict[str, float] = {}
    pref = torch.where(failed, 0.5, p)
    if symmetric:
        q = _judge_pairs(judge, pixels, prompts, b, a, batch_size, scores)
        q_failed = q.isnan()
        both = ~failed & ~q_failed
        stats["asymmetry"] = float((p[both] - (1 - q[both])).abs().mean()) if bool(both.any()) else math.nan
        calls, failures = calls + len(q), failures + int(q_failed.sum())
        ties += int((q[~q_failed] == 0.5).sum())
        pref = (pref + 1 - torch.where(q_failed, 0.5, q)) / 2
    wins = torch.zeros(n, dtype=torch.float64)
    wins.index_add_(0, a, pref)
    wins.index_add_(0, b, 1 - pref)
    rates = torch.full((n,), math.nan, dtype=torch.float64)
    for idx in members.values():
        t = torch.tensor(idx)
        rates[t] = wins[t] / (len(idx) - 1) if len(idx) > 1 else 0.5
    stats.update(judge_calls=float(calls), judge_failures=float(failures),
                 judge_failure_rate=failures / calls if calls else 0.0,
                 tie_fraction=ties / (calls - failures) if calls > failures else math.nan,
                 groups=float(len(members)))
    out = rates.float()
    return (out, stats) if return_stats else out


def check_complete_groups(group: Tensor, per_rank: int) -> None:
    """Check that every group of a gathered batch lies on one rank (a groupwise reward scores each rank's samples
    alone, so a group split over ranks would be judged in pieces).

    Args:
        group: int ``[world * per_rank]``: the gathered group ids in rank order (rank r holds rows
            ``r * per_rank : (r + 1) * per_rank``).
        per_rank: samples per rank (>= 1).

    Raises:
        ValueError: a group spread over several ranks; the message names the group, its ranks and the fix.
    """
    ids = group.detach().cpu().reshape(-1)
    if per_rank < 1 or ids.numel() % per_rank:
        raise ValueError(f"{ids.numel()} gathered group ids do not split into ranks of {per_rank} samples")
    rank = torch.arange(ids.numel()) // per_rank
    uniq, inverse = torch.unique(ids, return_inverse=True)
    lo = torch.full((len(uniq),), ids.numel(), dtype=torch.int64).scatter_reduce(0, inverse, rank, "amin")
    hi = torch.zeros(len(uniq), dtype=torch.int64).scatter_reduce(0, inverse, rank, "amax")
    split = (lo != hi).nonzero().flatten()
    if len(split):
        g = int(split[0])
        size = int((inverse == g).sum())
        raise ValueError(
            f"group {int(uniq[g])} ({size} samples) is spread over ranks {int(lo[g])}..{int(hi[g])}, but a "
            f"groupwise (pairwise) reward needs each group whole on the rank that scores it: make the per-rank batch "
            f"(prompts_per_batch * group_size / devices = {per_rank}) a multiple of data.init_args.group_size "
            f"({len(split)} group(s) split)"
        )


# ---------------------------------------------------------------------------------------------- rewards
def _make_judge(judge: str | Any, judge_args: Mapping[str, Any] | None, world: Any) -> Any:
    if isinstance(judge, str):
        return build_judge(judge, world=world, **dict(judge_args or {}))
    if judge_args:
        raise ValueError("judge_args are for a judge given by name; this judge is already built")
    if not callable(getattr(judge, "compare", None)):
        raise TypeError(f"a judge needs a compare(pixels_a, pixels_b, prompts) method, got {type(judge).__name__}")
    return judge


@register_reward("pairwise")
class PairwiseReward(RewardModel):
    """Pref-GRPO's groupwise reward (Wang et al. 2025, "Pairwise Preference Reward-based GRPO"): each sample's
    reward is its win rate in its group under a pairwise judge (:func:`win_rates`).

    ``groupwise = True``: the :class:`~genrl.rewards.RewardManager` calls it once on the whole batch (not in
    ``batch_size`` chunks, which could cut a group) with ``group=`` the samples' group ids, and the GRPO score
    phase checks that no group is spread over ranks. Without ``group`` (validation batches) every sample is its
    own group and scores 1/2: a win rate says nothing about one sample, and a group's mean is 1/2 by construction,
    so monitor a pointwise reward (e.g. ``shapes`` with weight 0) for progress.

    Config: ``{name: pairwise, judge: shapes, weight: 1.0}``, ``{name: pairwise, judge: shapes, judge_args:
    {tolerance: 0.01}, symmetric: true}``, ``{name: pairwise, judge: remote, judge_args: {url:
    "http://127.0.0.1:8765"}}``.

    Args:
        judge: a registered judge name (:func:`available_judges`: ``"shapes"``, ``"remote"``) or a judge object.
        judge_args: the judge's constructor arguments (with a name only).
        world: the run's shapes world (filled in by the manager's build context), passed to judges taking one.
        symmetric: judge every pair in both orders and average (twice the cost; logs ``asymmetry``).
        pair_batch_size: pairs per judge call (>= 1).
        decimals: round the rates to this many decimals (the reference implementation rounds to 3); None: exact.
        scale, shift: affine on the rate.

    Output: ``{"reward": float32 [B] in [0, 1]}``; after each call :attr:`last_stats` holds the scalars of
    :func:`win_rates` (``judge_calls``, ``judge_failures``, ``judge_failure_rate``, ``tie_fraction``, ``groups``,
    ``asymmetry``), which the manager logs as ``<reward>/<key>`` (``reward/pairwise/judge_failures``).

    Raises:
        UnknownJudgeError: an unregistered judge name. ValueError: ``pair_batch_size < 1``, negative ``decimals``,
            ``judge_args`` with a built judge. TypeError: an object without ``compare``.
        At call: as :func:`win_rates` and the judge.
    """

    groupwise: ClassVar[bool] = True
    differentiable = False
    dimensions = ("reward",)

    def __init__(
        self,
        judge: str | Any = "shapes",
        judge_args: Mapping[str, Any] | None = None,
        world: Any = None,
        symmetric: bool = False,
        pair_batch_size: int = 64,
        decimals: int | None = None,
        scale: float = 1.0,
        shift: float = 0.0,
    ) -> None:
        super().__init__(scale=scale, shift=shift)
        if isinstance(pair_batch_size, bool) or not isinstance(pair_batch_size, int) or pair_batch_size < 1:
            raise ValueError(f"pairwise reward: pair_batch_size must be an int >= 1, got {pair_batch_size!r}")
        if decimals is not None and (isinstance(decimals, bool) or not isinstance(decimals, int) or decimals < 0):
            raise ValueError(f"pairwise reward: decimals must be an int >= 0 or None, got {decimals!r}")
        self.judge = _make_judge(judge, judge_args, world)
        self.symmetric = bool(symmetric)
        self.pair_batch_size = pair_batch_size
        self.decimals = decimals
        self.last_stats: dict[str, float] = {}

    def score(self, pixels: Tensor, prompts: list[str], group: Tensor | Sequence[Hashable] | None = None,
              **meta: Any) -> dict[str, Tensor]:
        self.last_stats = {}
        b = pixels.shape[0]
        ok = torch.isfinite(pixels.detach()).reshape(b, -1).all(dim=1).cpu()
        rates, stats = win_rates(self.judge, pixels, prompts, group, symmetric=self.symmetric, valid=ok,
                                 batch_size=self.pair_batch_size, return_stats=True)
        if self.decimals is not None:
            rates = torch.round(rates.double(), decimals=self.decimals).float()
        self.last_stats = stats
        return {"reward": rates.to(pixels.device)}

    def extra_repr(self) -> str:
        judge = getattr(self.judge, "name", "") or type(self.judge).__name__
        return f"{super().extra_repr()}, judge={judge!r}, symmetric={self.symmetric}"


@register_reward("pair_judge")
class PairJudgeReward(RewardModel):
    """A judge in the reward protocol, to serve it: ``genrl reward-serve --reward pair_judge --kwargs
    '{"judge": "shapes"}'`` (a custom VLM judge: register it with :func:`register_judge` in a module given with
    ``--import``). :class:`RemoteJudge` is its client. Not a training reward: its rows are pairs.

    Rows come in pairs ``(2p, 2p + 1)`` = (a, b), both for ``prompts[2p]``: ``reward[2p]`` is the judge's
    preference of a over b, ``reward[2p + 1]`` its complement, NaN (invalid) for a failed judgement. Serve it with
    an even ``--batch-size`` so that no chunk cuts a pair.

    Args:
        judge: a registered judge name or a judge object; judge_args: its constructor arguments.
        world: the shapes world for judges taking one (or give it in ``judge_args``).
        scale, shift: affine on the main key (keep the defaults: the client reads raw preferences).

    Raises:
        ValueError (at call): an odd number of rows (names the fix), plus the judge's errors.
    """

    differentiable = False
    dimensions = ("reward",)

    def __init__(self, judge: str | Any = "shapes", judge_args: Mapping[str, Any] | None = None, world: Any = None,
                 scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.judge = _make_judge(judge, judge_args, world)

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        b = pixels.shape[0]
        if b % 2:
            raise ValueError(f"pair_judge scores pairs of rows (2p, 2p + 1), got an odd batch of {b}; serve it with "
                             f"an even --batch-size and send whole pairs")
        ok = torch.isfinite(pixels.detach()).reshape(b // 2, -1).all(dim=1)
        pa, pb = pixels[0::2], pixels[1::2]
        p = torch.full((b // 2,), math.nan, dtype=torch.float64)
        if bool(ok.any()):
            rows = ok.nonzero().flatten()
            sub = [prompts[2 * int(i)] for i in rows]
            p[rows.cpu()] = _check_prefs(self.judge, self.judge.compare(pa[rows], pb[rows], sub), len(rows))
        return {"reward": torch.stack([p, 1 - p], dim=1).reshape(-1).float().to(pixels.device)}
