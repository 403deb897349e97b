"""Plans: span-aware step prompts for a causal video student (TempAct's planner output).

A plan splits one global prompt ("a red circle moves right, then moves up") into steps, each a text and a span of
chunks ``[start, end)`` of the causal student's rollout (docs/methods/tempact.md, Plans). The executor switches its
prompt at every step boundary, which is always a chunk boundary.

The JSON the planners write and read (one object; spans in chunks, end exclusive; spans may be left out, then the
steps get uniform spans)::

    {"steps": [{"prompt": "a red circle moving right", "start": 0, "end": 2},
               {"prompt": "a red circle moving up", "start": 2, "end": 4}]}

:func:`parse_plan` never raises on a planner's output: malformed text gives the *fallback plan* (the global prompt
over every chunk) with format score 0, so a bad sample is penalised by the planner's reward instead of stopping the
training loop. Source: Wang et al. 2026, TempAct (arXiv 2606.28016), section 3 (span-aware step prompts) and its
released parser (format score 1 for a valid plan, 0 for a parse failure).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from genrl.noise import mix_seed, stream_id

__all__ = ["Step", "Plan", "validate_steps", "uniform_spans", "fallback_plan", "parse_plan", "plan_to_json",
           "split_then", "TEMPLATE_CANDIDATES", "template_plan", "TemplatePlanner",
           "FORMAT_VALID", "FORMAT_REPAIRED", "FORMAT_FALLBACK"]

FORMAT_VALID = 1.0
"""Format score of a plan whose JSON and spans were valid as written."""
FORMAT_REPAIRED = 0.5
"""Format score of a plan whose JSON parsed but whose spans were invalid, so uniform spans replaced them."""
FORMAT_FALLBACK = 0.0
"""Format score of the fallback plan (the text did not parse into at least one step)."""


@dataclass(frozen=True)
class Step:
    """One step of a plan: ``text`` conditions chunks ``start .. end - 1`` of the rollout (chunk indices, end
    exclusive)."""

    text: str
    start: int
    end: int

    @property
    def num_chunks(self) -> int:
        return self.end - self.start


@dataclass
class Plan:
    """A planner's answer for one global prompt.

    Attributes:
        global_prompt: the user's prompt the plan splits.
        steps: contiguous steps covering chunks ``[0, num_chunks)`` (checked by :func:`validate_steps`).
        raw_text: what the planner wrote ("" for a template plan).
        format_score: F in [0, 1]: :data:`FORMAT_VALID`, :data:`FORMAT_REPAIRED` or :data:`FORMAT_FALLBACK`.
        token_ids: int64 [L] prompt + answer tokens of a language-model planner (None otherwise).
        answer_mask: bool [L], True on the answer tokens the planner's loss trains (None otherwise).
        behaviour_log_probs: float32 [L] log-probs of ``token_ids`` under the policy that sampled them (0 outside
            the answer), or [1] for a template planner's candidate.
        candidate: the candidate index of a template planner (None otherwise).
    """

    global_prompt: str
    steps: tuple[Step, ...]
    raw_text: str = ""
    format_score: float = FORMAT_VALID
    token_ids: torch.Tensor | None = None
    answer_mask: torch.Tensor | None = None
    behaviour_log_probs: torch.Tensor | None = None
    candidate: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_chunks(self) -> int:
        return self.steps[-1].end

    @property
    def boundaries(self) -> list[int]:
        """Chunk indices where a new step starts (every step's start but the first's), ascending."""
        return [s.start for s in self.steps[1:]]

    def text_at(self, chunk: int) -> str:
        """The step text that conditions ``chunk``.

        Raises:
            IndexError: ``chunk`` outside ``[0, num_chunks)``.
        """
        for s in self.steps:
            if s.start <= chunk < s.end:
                return s.text
        raise IndexError(f"chunk {chunk} is outside the plan's chunks 0..{self.num_chunks - 1}")

    def step_index(self, chunk: int) -> int:
        """Index of the step that holds ``chunk`` (IndexError outside the plan)."""
        for i, s in enumerate(self.steps):
            if s.start <= chunk < s.end:
                return i
        raise IndexError(f"chunk {chunk} is outside the plan's chunks 0..{self.num_chunks - 1}")

    def key(self) -> tuple:
        """Hashable identity of what the executor sees: (texts, spans)."""
        return tuple((s.text, s.start, s.end) for s in self.steps)


def validate_steps(steps: list[Step] | tuple[Step, ...], num_chunks: int) -> None:
    """Check that ``steps`` are contiguous, non-overlapping, each at least one chunk, and cover ``[0, num_chunks)``.

    Raises:
        ValueError: naming the first rule broken and the offending step.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    if not steps:
        raise ValueError("a plan needs at least one step")
    expected = 0
    for i, s in enumerate(steps):
        if not isinstance(s.text, str) or not s.text.strip():
            raise ValueError(f"step {i} has an empty text")
        if s.start != expected:
            raise ValueError(f"step {i} starts at chunk {s.start}, expected {expected} (steps must be contiguous "
                             f"and start at 0)")
        if s.end <= s.start:
            raise ValueError(f"step {i} spans [{s.start}, {s.end}): each step needs at least one chunk")
        expected = s.end
    if expected != num_chunks:
        raise ValueError(f"the steps cover chunks [0, {expected}), expected [0, {num_chunks})")


def uniform_spans(num_steps: int, num_chunks: int) -> list[tuple[int, int]]:
    """``num_steps`` contiguous spans over ``num_chunks`` chunks, as even as possible (earlier spans get the
    remainder), e.g. 3 steps over 4 chunks: (0, 2), (2, 3), (3, 4).

    Raises:
        ValueError: ``num_steps < 1`` or more steps than chunks.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if num_steps > num_chunks:
        raise ValueError(f"{num_steps} steps cannot each get a chunk of {num_chunks}; use at most {num_chunks} steps "
                         f"or a longer rollout")
    base, extra = divmod(num_chunks, num_steps)
    spans, start = [], 0
    for i in range(num_steps):
        end = start + base + (1 if i < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def fallback_plan(global_prompt: str, num_chunks: int, raw_text: str = "", reason: str = "") -> Plan:
    """The plan a malformed answer falls back to: the global prompt over every chunk, format score 0."""
    extra = {"fallback_reason": reason} if reason else {}
    return Plan(global_prompt, (Step(global_prompt, 0, num_chunks),), raw_text=raw_text,
                format_score=FORMAT_FALLBACK, extra=extra)


def _json_object(text: str) -> Any:
    start = text.find("{")
    end = text.rfind("}")
    if start < 0 or end <= start:
        raise ValueError("no JSON object in the answer")
    return json.loads(text[start:end + 1])


def parse_plan(text: str, global_prompt: str, num_chunks: int, max_steps: int | None = None) -> Plan:
    """Parse a planner's answer into a :class:`Plan`; never raises on the answer's content.

    The answer's first ``{`` to its last ``}`` must be the JSON of the module docstring. Steps with explicit spans
    that pass :func:`validate_steps` give format score 1. Steps without spans get :func:`uniform_spans` (score 1);
    steps whose spans are invalid get uniform spans too (score 0.5). Anything else (no JSON, no steps, an empty
    text, more steps than chunks or than ``max_steps``) gives :func:`fallback_plan` (score 0), with the reason in
    ``plan.extra["fallback_reason"]``.

    Args:
        text: the planner's answer (thinking already stripped).
        global_prompt: the prompt the plan splits (the fallback's text).
        num_chunks: chunks of the rollout the plan must cover (>= 1).
        max_steps: refuse plans with more steps (None: at most ``num_chunks``).
    Raises:
        ValueError: ``num_chunks < 1`` (a caller's error, not the planner's).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    limit = num_chunks if max_steps is None else min(max_steps, num_chunks)
    try:
        obj = _json_object(text)
        raw_steps = obj["steps"] if isinstance(obj, dict) else None
        if not isinstance(raw_steps, list) or not raw_steps:
            raise ValueError("'steps' is missing or empty")
        if len(raw_steps) > limit:
            raise ValueError(f"{len(raw_steps)} steps for at most {limit}")
        texts = []
        for s in raw_steps:
            t = s.get("prompt") if isinstance(s, dict) else None
            if not isinstance(t, str) or not t.strip():
                raise ValueError("a step has no 'prompt' text")
            texts.append(" ".join(t.split()))
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:  # the planner's fault: fall back
        return fallback_plan(global_prompt, num_chunks, raw_text=text, reason=str(e))
    has_spans = all(isinstance(s.get("start"), int) and isinstance(s.get("end"), int) for s in raw_steps)
    if has_spans:
        steps = tuple(Step(t, s["start"], s["end"]) for t, s in zip(texts, raw_steps))
        try:
            validate_steps(steps, num_chunks)
            return Plan(global_prompt, steps, raw_text=text, format_score=FORMAT_VALID)
        except ValueError as e:
            spans = uniform_spans(len(texts), num_chunks)
            steps = tuple(Step(t, a, b) for t, (a, b) in zip(texts, spans))
            return Plan(global_prompt, steps, raw_text=text, format_score=FORMAT_REPAIRED,
                        extra={"repair_reason": str(e)})
    spans = uniform_spans(len(texts), num_chunks)
    steps = tuple(Step(t, a, b) for t, (a, b) in zip(texts, spans))
    return Plan(global_prompt, steps, raw_text=text, format_score=FORMAT_VALID)


def plan_to_json(plan: Plan | list[Step] | tuple[Step, ...], spans: bool = True) -> str:
    """The canonical JSON text of a plan (what a language-model planner is supervised to write); inverse of
    :func:`parse_plan` for valid plans."""
    steps = plan.steps if isinstance(plan, Plan) else tuple(plan)
    items = [{"prompt": s.text, "start": s.start, "end": s.end} if spans else {"prompt": s.text} for s in steps]
    return json.dumps({"steps": items}, separators=(", ", ": "))


# ---------------------------------------------------------------------------------------------- template planner
def split_then(prompt: str) -> list[str]:
    """The generic step splitter: the prompt's parts between ", then " / " then " / "first" / "finally" markers,
    e.g. "a cat jumps, then lands" -> ["a cat jumps", "lands"]. A prompt without markers is one step."""
    text = " ".join(prompt.split())
    for marker in (", and then ", ", then ", " and then ", " then ", ", finally ", " finally "):
        text = text.replace(marker, "\x00")
    parts = [p.strip(" ,.") for p in text.split("\x00")]
    parts = [p[len("first "):] if p.lower().startswith("first ") else p for p in parts]
    return [p for p in parts if p] or [prompt]


#: The candidate plans of :class:`TemplatePlanner`, in logit order.
TEMPLATE_CANDIDATES = ("ordered", "reversed", "merged", "front_loaded", "back_loaded")


def template_plan(kind: str, global_prompt: str, steps: list[str], num_chunks: int) -> Plan:
    """One candidate plan from the step texts ``steps`` of ``global_prompt``:

    - ``ordered``: the steps in order over uniform spans (the right plan when the splitter is exact);
    - ``reversed``: the steps in reverse order (a wrong order);
    - ``merged``: one step, the global prompt over every chunk (no plan: what a single-prompt executor sees);
    - ``front_loaded`` / ``back_loaded``: the steps in order, one chunk moved from the last step to the first /
      from the first to the last (skewed spans; equal to ``ordered`` when the step cannot give a chunk).

    Raises:
        ValueError: an unknown kind; more steps than chunks.
    """
    if kind not in TEMPLATE_CANDIDATES:
        raise ValueError(f"unknown template candidate {kind!r}; expected one of {TEMPLATE_CANDIDATES}")
    if kind == "merged" or len(steps) == 1:
        return Plan(global_prompt, (Step(global_prompt if kind == "merged" else steps[0], 0, num_chunks),))
    texts = list(reversed(steps)) if kind == "reversed" else list(steps)
    spans = [list(s) for s in uniform_spans(len(texts), num_chunks)]
    if kind == "front_loaded" and spans[-1][1] - spans[-1][0] > 1:
        spans[0][1] += 1
        for s in spans[1:-1]:
            s[0] += 1
            s[1] += 1
        spans[-1][0] += 1
    if kind == "back_loaded" and spans[0][1] - spans[0][0] > 1:
        spans[0][1] -= 1
        for s in spans[1:-1]:
            s[0] -= 1
            s[1] -= 1
        spans[-1][0] -= 1
    return Plan(global_prompt, tuple(Step(t, a, b) for t, (a, b) in zip(texts, spans)))


class TemplatePlanner(torch.nn.Module):
    """A planner with learnable logits over a fixed candidate set (TempAct spec, section 3: a deterministic planner
    for tests and ablations): plan-level RL without a language model.

    Each global prompt is split into step texts by ``splitter`` (a callable ``str -> list[str]``; the shapes world's
    is ``genrl.data.shapes.step_captions``), and candidate c of ``candidates`` (see :func:`template_plan`) is drawn
    with probability softmax(logits)_c. A plan's "tokens" are its one candidate choice: ``token_log_probs`` returns
    [N, 1] log-probs and an all-True mask, so the sequence losses of genrl.flow.sequence_policy apply unchanged (GSPO
    reduces to PPO on a categorical). The reference (for a KL) is the initial logits.

    Args:
        candidates: candidate kinds, a subset of :data:`TEMPLATE_CANDIDATES` (no repeats).
        splitter: the step splitter (default :func:`split_then`).
        init_logits: initial logits (default zeros: uniform).
    Raises:
        ValueError: unknown or repeated candidates; ``init_logits`` of the wrong length.
    """

    def __init__(self, candidates: tuple[str, ...] | list[str] = TEMPLATE_CANDIDATES, splitter=None,
                 init_logits: list[float] | None = None) -> None:
        super().__init__()
        candidates = tuple(candidates)
        bad = [c for c in candidates if c not in TEMPLATE_CANDIDATES]
        if bad or not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct names from {TEMPLATE_CANDIDATES}, got {list(candidates)}")
        init = (torch.zeros(len(candidates)) if init_logits is None
                else torch.as_tensor(init_logits, dtype=torch.float32))
        if init.shape != (len(candidates),):
            raise ValueError(f"init_logits has {init.numel()} values for {len(candidates)} candidates")
        self.candidates, self.splitter = candidates, splitter or split_then
        self.logits = torch.nn.Parameter(init.clone())
        self.register_buffer("reference_logits", init.clone())

    def plans_for(self, global_prompt: str, num_chunks: int) -> list[Plan]:
        """Every candidate plan of ``global_prompt``, in logit order."""
        steps = self.splitter(global_prompt)[:num_chunks]
        out = []
        for c, kind in enumerate(self.candidates):
            out.append(replace(template_plan(kind, global_prompt, steps, num_chunks), candidate=c))
        return out

    def probabilities(self) -> torch.Tensor:
        """softmax(logits), float32 [num candidates] (detached)."""
        return torch.softmax(self.logits.detach().float(), dim=0)

    @torch.no_grad()
    def sample(self, global_prompts: list[str], num_chunks: int, k: int, seed: int, iteration: int = 0,
               prompt_indices: list[int] | None = None) -> list[list[Plan]]:
        """K plans per prompt, candidate c ~ Categorical(softmax(logits)), drawn from (seed, iteration, prompt id):
        prompt i's plans do not depend on the rest of the batch. ``prompt_indices``: the prompts' sample ids
        (default 0..P-1). Each plan carries ``candidate`` and ``behaviour_log_probs`` [1]."""
        ids = list(range(len(global_prompts))) if prompt_indices is None else [int(i) for i in prompt_indices]
        logp = torch.log_softmax(self.logits.detach().float().cpu(), dim=0)
        out = []
        for prompt, i in zip(global_prompts, ids):
            g = torch.Generator().manual_seed(mix_seed(seed, iteration, i, stream_id("planner.plan")))
            picks = torch.multinomial(logp.exp(), k, replacement=True, generator=g)
            cands = self.plans_for(prompt, num_chunks)
            out.append([replace(cands[int(c)], behaviour_log_probs=logp[int(c)].reshape(1).clone()) for c in picks])
        return out

    @contextmanager
    def reference(self):
        """Inside, :meth:`token_log_probs` uses the reference (initial) logits."""
        self._reference = True
        try:
            yield self
        finally:
            self._reference = False

    def token_log_probs(self, plans: list[Plan]) -> tuple[torch.Tensor, torch.Tensor]:
        """log softmax(logits)[candidate] per plan, [N, 1] (the reference logits inside :meth:`reference`), and the
        mask [N, 1].

        Raises:
            ValueError: a plan that is not one of this planner's candidates.
        """
        if any(p.candidate is None or not 0 <= p.candidate < len(self.candidates) for p in plans):
            raise ValueError("token_log_probs needs plans sampled by this TemplatePlanner (plan.candidate is unset "
                             "or out of range)")
        logits = self.reference_logits if getattr(self, "_reference", False) else self.logits
        logp = torch.log_softmax(logits.float(), dim=0)
        idx = torch.tensor([p.candidate for p in plans], device=logp.device)
        return logp[idx].unsqueeze(1), torch.ones(len(plans), 1, dtype=torch.bool, device=logp.device)
