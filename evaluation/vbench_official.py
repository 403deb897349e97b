"""The official ``vbench`` package, run in its own environment on genrl's outputs, and its results brought back.

``vbench`` pins numpy < 2 and transformers 4.33, so it cannot share genrl's environment; evaluation/README.md gives
the recipe (a separate virtualenv, weights in ``VBENCH_CACHE_DIR``, ``--load_ckpt_from_local``). Its output,
``<name>_eval_results.json`` (``{dimension: [score, [{"video_path", "video_results"}, ...]]}``), becomes a genrl
``results.json`` with::

    python -m evaluation vbench-import evaluation_results/my_model_eval_results.json --out outputs/vbench/eval_official

so ``python -m evaluation compare outputs/vbench/eval outputs/vbench/eval_official`` lines the native (and proxy)
dimensions up against the official ones: the calibration of the native back-end.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def import_results(path: str | Path) -> dict[str, Any]:
    """Convert a vbench ``*_eval_results.json`` (or a folder holding exactly one) to genrl's results schema.

    Raises:
        FileNotFoundError: nothing at ``path`` / no ``*_eval_results.json`` in the folder.
        ValueError: a file that is not vbench's results format (names the offending dimension entry).
    """
    from evaluation.inputs import prompt_from_vbench_name
    from genrl.eval.vbench import composites, normalize

    p = Path(path)
    if p.is_dir():
        found = sorted(p.glob("*_eval_results.json"))
        if len(found) != 1:
            raise FileNotFoundError(f"{p} holds {len(found)} *_eval_results.json files; give the file itself")
        p = found[0]
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist (vbench writes <output_path>/<name>_eval_results.json)")
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{p} is not vbench's results (expected {{dimension: [score, per-video list]}})")
    dims: dict[str, Any] = {}
    per_video: dict[str, dict[str, Any]] = {}
    for dim, entry in data.items():
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], list)):
            raise ValueError(f"{p}: entry {dim!r} is not [score, [{{video_path, video_results}}, ...]]")
        score = float(entry[0])
        for v in entry[1]:
            if not isinstance(v, dict) or "video_path" not in v:
                raise ValueError(f"{p}: a per-video entry of {dim!r} has no video_path: {v!r}")
            name = Path(v["video_path"]).name
            parsed = prompt_from_vbench_name(name)
            rec = per_video.setdefault(name, {"file": name, "prompt": parsed[0] if parsed else name, "seed": None,
                                              "sample": parsed[1] if parsed else None, "dimensions": {}})
            value = v.get("video_results")
            if isinstance(value, (bool, int, float)):
                rec["dimensions"][dim] = float(value)
        dims[dim] = {"score": score, "normalized": normalize(dim, score) if dim in _known() else None,
                     "n": len(entry[1]), "proxy": False, "backend": "vbench (official)",
                     "description": "official vbench package", "prompt_selection": "vbench", "spread": None}
    scores = {k: v["score"] for k, v in dims.items() if math.isfinite(v["score"])}
    return {"schema": 1, "videos": str(p.parent), "out": None, "n_videos": len(per_video), "source": str(p),
            "dimensions": dims, "vbench": {"composites": composites(scores)}, "rewards": {}, "distribution": {},
            "skipped": [], "per_video": list(per_video.values()), "elapsed_s": None}


def _known() -> set[str]:
    from genrl.eval.vbench import NORMALIZATION

    return set(NORMALIZATION)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m evaluation vbench-import <results.json or folder> --out DIR``."""
    prs = argparse.ArgumentParser(prog="python -m evaluation vbench-import", description=__doc__.split("\n\n")[0])
    prs.add_argument("results", help="vbench's <name>_eval_results.json (or its output folder)")
    prs.add_argument("--out", required=True, help="folder for the genrl results.json + report")
    prs.add_argument("--videos", default=None, help="the videos folder (for frame strips in the report)")
    args = prs.parse_args(argv)
    results = import_results(args.results)
    if args.videos:
        results["videos"] = args.videos
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results["out"] = str(out)
    (out / "results.json").write_text(json.dumps(results, indent=1, ensure_ascii=False))
    from evaluation.report import write_report

    write_report(results, out, samples=6 if args.videos else 0)
    print(f"imported {len(results['dimensions'])} dimensions over {results['n_videos']} videos -> {out}")
    return results


def list_dimensions(argv: list[str] | None = None) -> None:
    """``python -m evaluation dimensions``: every VBench dimension and how genrl runs it."""
    from genrl.eval.dimensions import DIMENSIONS
    from genrl.eval.vbench import ALL_DIMENSIONS

    for name in ALL_DIMENSIONS:
        cls = DIMENSIONS.get(name)
        if cls is None:
            how = "official vbench only (evaluation/README.md)"
        else:
            how = ("native, proxy model" if cls.proxy else "native") + (
                "; weights: " + ", ".join(getattr(cls, "weight_files", {}) or ["a local folder"])
                if cls.needs_weights else "; no weights")
        print(f"{name:<24} {how}")
    from genrl.eval.dimensions import I2V_DIMENSIONS

    for name, cls in I2V_DIMENSIONS.items():
        weights = ("weights: " + ", ".join(cls.weight_files)) if cls.needs_weights else "no weights"
        print(f"{name:<24} image-to-video (needs each video's conditioning image); {weights}")
