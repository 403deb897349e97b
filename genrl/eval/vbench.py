"""VBench's bookkeeping: dimension lists, normalisation constants, the Quality / Semantic / Total composites, and
the prompt suite with its per-dimension prompt selection.

Source: Huang et al. 2024, *VBench: Comprehensive Benchmark Suite for Video Generative Models*; Vchitect/VBench
``scripts/constant.py`` (``NORMALIZE_DIC``, ``DIM_WEIGHT``, ``QUALITY_LIST``, ``SEMANTIC_LIST``,
``QUALITY_WEIGHT = 4``, ``SEMANTIC_WEIGHT = 1``) and ``scripts/cal_final_score.py``; the suite is
``VBench_full_info.json`` (copied unchanged to ``assets/prompts/vbench_full_info.json``).

Dimension keys are VBench's with underscores (``subject_consistency``); :func:`composites` also accepts the
space-separated spelling of ``cal_final_score.py`` (``"subject consistency"``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from genrl.assets import VBENCH_DIMENSIONS, assets_dir

__all__ = ["ALL_DIMENSIONS", "QUALITY_DIMENSIONS", "SEMANTIC_DIMENSIONS", "NATIVE_DIMENSIONS", "PROXY_DIMENSIONS",
           "NORMALIZATION", "DIM_WEIGHTS", "QUALITY_WEIGHT", "SEMANTIC_WEIGHT", "normalize", "composites",
           "load_vbench_suite", "prompts_for_dimension"]

#: VBench's 16 dimensions, in its order (scripts/constant.py ``TASK_INFO``); defined with the prompt suite's
#: ``vbench:<dimension>`` prompt aliases (:data:`genrl.assets.VBENCH_DIMENSIONS`)
ALL_DIMENSIONS: tuple[str, ...] = VBENCH_DIMENSIONS
#: the 7 dimensions of the Quality score (``QUALITY_LIST``)
QUALITY_DIMENSIONS: tuple[str, ...] = (
    "subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness",
    "aesthetic_quality", "imaging_quality", "dynamic_degree",
)
#: the 9 dimensions of the Semantic score (``SEMANTIC_LIST``)
SEMANTIC_DIMENSIONS: tuple[str, ...] = (
    "object_class", "multiple_objects", "human_action", "color", "spatial_relationship", "scene",
    "appearance_style", "temporal_style", "overall_consistency",
)
#: dimensions genrl computes itself (genrl.eval.dimensions); the rest need the official vbench package
NATIVE_DIMENSIONS: tuple[str, ...] = QUALITY_DIMENSIONS
#: native dimensions whose model is a stand-in (Farneback flow), not comparable with published VBench numbers
PROXY_DIMENSIONS: tuple[str, ...] = ("dynamic_degree", "motion_smoothness")

#: per-dimension (min, max) of VBench's min-max normalisation (``NORMALIZE_DIC``)
NORMALIZATION: dict[str, tuple[float, float]] = {
    "subject_consistency": (0.1462, 1.0),
    "background_consistency": (0.2615, 1.0),
    "temporal_flickering": (0.6293, 1.0),
    "motion_smoothness": (0.706, 0.9975),
    "dynamic_degree": (0.0, 1.0),
    "aesthetic_quality": (0.0, 1.0),
    "imaging_quality": (0.0, 1.0),
    "object_class": (0.0, 1.0),
    "multiple_objects": (0.0, 1.0),
    "human_action": (0.0, 1.0),
    "color": (0.0, 1.0),
    "spatial_relationship": (0.0, 1.0),
    "scene": (0.0, 0.8222),
    "appearance_style": (0.0009, 0.2855),
    "temporal_style": (0.0, 0.364),
    "overall_consistency": (0.0, 0.364),
}
#: per-dimension weight in the composites (``DIM_WEIGHT``): dynamic degree 0.5, the rest 1
DIM_WEIGHTS: dict[str, float] = {d: (0.5 if d == "dynamic_degree" else 1.0) for d in ALL_DIMENSIONS}
QUALITY_WEIGHT = 4.0
SEMANTIC_WEIGHT = 1.0


def _key(dim: str) -> str:
    return str(dim).strip().replace(" ", "_")


def normalize(dim: str, value: float) -> float:
    """VBench's min-max normalisation ``(value - min) / (max - min)`` (not clipped; without the dimension weight).

    Raises:
        ValueError: unknown dimension (lists the known ones).
    """
    key = _key(dim)
    if key not in NORMALIZATION:
        raise ValueError(f"unknown VBench dimension {dim!r}; known: {', '.join(ALL_DIMENSIONS)}")
    lo, hi = NORMALIZATION[key]
    return (float(value) - lo) / (hi - lo)


def _weighted(scores: dict[str, float], dims: tuple[str, ...]) -> tuple[float | None, list[str]]:
    missing = [d for d in dims if d not in scores]
    if missing:
        return None, missing
    total = math.fsum(normalize(d, scores[d]) * DIM_WEIGHTS[d] for d in dims)
    return total / math.fsum(DIM_WEIGHTS[d] for d in dims), []


def composites(scores: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """VBench's Quality, Semantic and Total scores from raw dimension scores (scripts/cal_final_score.py).

    ``quality = sum_d w_d * norm_d / sum_d w_d`` over :data:`QUALITY_DIMENSIONS` (w = 0.5 for dynamic degree, so
    the denominator is 6.5); ``semantic`` the same over :data:`SEMANTIC_DIMENSIONS` (all weights 1);
    ``total = (4 * quality + 1 * semantic) / 5``. ``norm_d`` is :func:`normalize`.

    Args:
        scores: raw dataset scores (as VBench reports them) by dimension key; a None value counts as missing; keys
            that are not VBench dimensions are ignored.
    Returns:
        ``{"quality" | "semantic" | "total": {"value": float | None, "partial": bool, "missing": [dims]}}``: a
        composite with any contributing dimension missing is partial, with value None (VBench itself would
        count a missing dimension as 0).
    Raises:
        ValueError: a non-finite score (names the dimension).
    """
    clean: dict[str, float] = {}
    for dim, value in scores.items():
        key = _key(dim)
        if key not in NORMALIZATION or value is None:
            continue
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"composites: the score of {dim!r} is {value!r}; drop it (it then counts as missing) or "
                             f"fix it")
        clean[key] = v
    q, q_missing = _weighted(clean, QUALITY_DIMENSIONS)
    s, s_missing = _weighted(clean, SEMANTIC_DIMENSIONS)
    total = None if q is None or s is None else (QUALITY_WEIGHT * q + SEMANTIC_WEIGHT * s) / (
        QUALITY_WEIGHT + SEMANTIC_WEIGHT)
    return {
        "quality": {"value": q, "partial": q is None, "missing": q_missing},
        "semantic": {"value": s, "partial": s is None, "missing": s_missing},
        "total": {"value": total, "partial": total is None, "missing": q_missing + s_missing},
    }


def load_vbench_suite(path: str | Path | None = None) -> list[dict[str, Any]]:
    """VBench's prompt suite: a list of ``{"prompt_en": str, "dimension": [str, ...], "auxiliary_info"?: {...}}``
    (946 entries, 944 distinct prompts, 16 dimensions).

    Args:
        path: a ``VBench_full_info.json``; default the repository copy ``assets/prompts/vbench_full_info.json``.
    Raises:
        FileNotFoundError: no such file (or no assets folder in an installed wheel: pass ``path``).
        ValueError: the file is not VBench's format (names the first bad entry).
    """
    if path is None:
        path = assets_dir() / "prompts" / "vbench_full_info.json"
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"VBench suite not found: {str(p)!r} (VBench_full_info.json from Vchitect/VBench "
                                f"or the vbench package)")
    data = json.loads(p.read_text(encoding="utf-8"))
    if not isinstance(data, list) or not data:
        raise ValueError(f"{p} is not VBench's suite: expected a non-empty JSON list of entries")
    for i, e in enumerate(data):
        if not (isinstance(e, dict) and isinstance(e.get("prompt_en"), str) and isinstance(e.get("dimension"), list)
                and all(isinstance(d, str) for d in e["dimension"])):
            raise ValueError(f"{p}: entry {i} is not {{'prompt_en': str, 'dimension': [str, ...]}}: {e!r:.200}")
    return data


def prompts_for_dimension(dim: str, suite: list[dict[str, Any]] | None = None) -> list[str]:
    """The prompts VBench scores ``dim`` on, in suite order (VBench's ``load_dimension_info``: every entry whose
    ``dimension`` list holds ``dim``).

    Args:
        dim: a VBench dimension key. suite: from :func:`load_vbench_suite` (default: loaded from the repository copy).
    Raises:
        ValueError: unknown dimension (lists the known ones).
    """
    key = _key(dim)
    if key not in ALL_DIMENSIONS:
        raise ValueError(f"unknown VBench dimension {dim!r}; known: {', '.join(ALL_DIMENSIONS)}")
    entries = load_vbench_suite() if suite is None else suite
    return [e["prompt_en"] for e in entries if key in e["dimension"]]
