"""Planners as a method's role: building one from a config, sampling plans for a batch, and a plan's frame spans
(TempAct, docs/methods/tempact.md). Shared by every method that conditions a causal student on step plans."""

from __future__ import annotations

from typing import Any

import torch

from genrl.models.causal import CausalConfig
from genrl.models.planner import LMPlanner
from genrl.models.plans import Plan, Step, TemplatePlanner, split_then

__all__ = ["SPLITTERS", "build_planner", "check_planner_spec", "sample_plans", "plan_frame_spans"]


def _shapes_steps(prompt: str) -> list[str]:
    from genrl.data.shapes import step_captions

    return step_captions(prompt)


#: Named step splitters of the template planner: ``then`` (generic markers), ``shapes`` (the shapes world's exact
#: step captions, genrl.data.shapes.step_captions).
SPLITTERS = {"then": split_then, "shapes": _shapes_steps}


def check_planner_spec(spec: dict[str, Any]) -> None:
    """Refuse an unknown planner kind or splitter before anything is built (ValueError naming the known ones)."""
    kind = spec.get("kind")
    if kind not in ("template", "lm"):
        raise ValueError(f"planner.kind must be 'template' or 'lm', got {kind!r} (or planner: null for the global "
                         f"prompt)")
    if kind == "template" and spec.get("splitter", "then") not in SPLITTERS:
        raise ValueError(f"unknown planner splitter {spec.get('splitter')!r}; known: {sorted(SPLITTERS)}")
    if kind == "lm" and not spec.get("path"):
        raise ValueError("planner.path is required for kind 'lm': a local transformers causal-LM folder")


def build_planner(spec: dict[str, Any] | None) -> torch.nn.Module | None:
    """The planner of a config: None, ``{"kind": "template", "splitter": "then" | "shapes", "candidates": [...],
    "init_logits": [...]}`` (:class:`~genrl.models.plans.TemplatePlanner`) or ``{"kind": "lm", "path": ..., ...}``
    (:class:`~genrl.models.planner.LMPlanner`, the other keys its arguments).

    Raises:
        ValueError: an unknown kind or splitter (naming the known ones).
    """
    if spec is None:
        return None
    check_planner_spec(spec)
    spec = dict(spec)
    if spec.pop("kind") == "template":
        return TemplatePlanner(splitter=SPLITTERS[spec.pop("splitter", "then")], **spec)
    return LMPlanner(**spec)


def sample_plans(planner, prompts: list[str], num_chunks: int, k: int, seed: int, iteration: int,
                 indices: torch.Tensor) -> list[list[Plan]]:
    """K plans per prompt from ``planner`` (addressed by (seed, iteration, sample id)); without a planner, K copies
    of the global prompt over every chunk (behaviour log-prob 0)."""
    if planner is None:
        return [[Plan(p, (Step(p, 0, num_chunks),), behaviour_log_probs=torch.zeros(1)) for _ in range(k)]
                for p in prompts]
    return planner.sample(prompts, num_chunks, k, seed, iteration, prompt_indices=[int(i) for i in indices])


def plan_frame_spans(plan: Plan, causal: CausalConfig) -> list[tuple[int, int]]:
    """Each step's latent-frame span ``(start, end)`` (end exclusive) under the chunk layout ``causal``."""
    return [(causal.chunk_start(s.start), causal.chunk_start(s.end)) for s in plan.steps]
