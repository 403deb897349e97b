"""Compare evaluations: two or more ``results.json`` folders -> one table of values and deltas against the first
(the baseline), each with its seed spread.

    python -m evaluation compare outputs/base/eval outputs/rl/eval outputs/rl_kl/eval \
        --labels base rl rl+kl --out outputs/compare.md

A value's spread is the standard deviation of the metric over the run's seeds (the ``seed`` of its manifest), or over
its sample index k when it has one seed and several samples per prompt (VBench's 5 samples are 5 noise draws). A
delta is flagged ``*`` when it exceeds the larger of the two spreads (a rough guide, not a significance test). Rows
are every dimension (raw score), reward key (mean) and distribution metric found in any run with a value; '-' where a
run lacks it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any


def load_results(path: str | Path) -> dict[str, Any]:
    """Read ``<folder>/results.json`` (or the file itself).

    Raises:
        FileNotFoundError: no results.json there (the message says how to make one).
        ValueError: not an evaluation results file.
    """
    given = Path(path)
    p = given / "results.json" if given.is_dir() else given
    if not p.is_file():
        if given.is_dir() and (given / "eval" / "results.json").is_file():
            raise FileNotFoundError(f"{given} is a videos folder; its evaluation is {given / 'eval'}: pass that")
        folder = given if given.suffix != ".json" else given.parent
        raise FileNotFoundError(f"{p} does not exist: evaluate first with `python -m evaluation run --videos "
                                f"<videos folder> --out {folder}` (or pass the eval/ folder of an earlier run)")
    data = json.loads(p.read_text())
    if not isinstance(data, dict) or "schema" not in data:
        raise ValueError(f"{p} is not a results.json of `python -m evaluation run`")
    return data


def metric_table(results: dict[str, Any]) -> dict[str, tuple[float | None, dict | None, bool]]:
    """metric -> (value, spread or None, higher_is_better) for one run; a spread is ``{"std", "n_groups", "over"}``
    (seed or sample)."""
    rows: dict[str, tuple[float | None, dict | None, bool]] = {}
    for name, d in results.get("dimensions", {}).items():
        rows[f"dimension: {name}" + (" (proxy)" if d.get("proxy") else "")] = (d.get("score"), d.get("spread"), True)
    for name, r in results.get("rewards", {}).items():
        rows[f"reward: {name}"] = (r.get("mean"), r.get("spread"), True)
    for name, r in results.get("distribution", {}).items():
        if name in r:
            rows[name.upper()] = (r.get(name), None, False)
    for key in ("composites", "composites_with_proxies"):
        for cname, c in ((results.get("vbench") or {}).get(key) or {}).items():
            if isinstance(c, dict) and not c.get("partial") and c.get("value") is not None:
                rows[f"VBench {cname}" + (" (with proxies)" if key.endswith("proxies") else "")] = (c["value"], None,
                                                                                                  True)
    return rows


def _num(v: float | None, d: int = 4) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.{d}f}"


def compare(paths: list[str | Path], labels: list[str] | None = None) -> dict[str, Any]:
    """The comparison as data: ``{"labels", "rows": [{"metric", "values", "spreads", "deltas", "flags"}]}``.

    Raises:
        ValueError: fewer than two runs, or a label count that differs from the run count.
    """
    if len(paths) < 2:
        raise ValueError(f"compare needs two or more result folders, got {len(paths)}")
    labels = list(labels) if labels else [Path(p).parent.name if Path(p).name in ("eval", "results.json")
                                          else Path(p).name for p in paths]
    if len(labels) != len(paths):
        raise ValueError(f"got {len(labels)} labels for {len(paths)} result folders")
    tables = [metric_table(load_results(p)) for p in paths]
    metrics: list[str] = []
    for t in tables:
        metrics += [m for m in t if m not in metrics]
    rows, empty = [], []
    for m in metrics:
        vals = [t.get(m, (None, None, True)) for t in tables]
        if all(v is None or not math.isfinite(v) for v, _, _ in vals):
            empty.append(m)  # e.g. an attribute no video had (NaN everywhere)
            continue
        sds = [_std(s) for _, s, _ in vals]
        base = vals[0][0]
        deltas, flags = [], []
        for (v, _, _), sd in zip(vals[1:], sds[1:]):
            if base is None or v is None:
                deltas.append(None)
                flags.append(False)
                continue
            delta = v - base
            spreads = [s for s in (sds[0], sd) if s is not None]
            deltas.append(delta)
            flags.append(bool(spreads) and abs(delta) > max(spreads))
        rows.append({"metric": m, "values": [v for v, _, _ in vals], "spreads": sds,
                     "spread_groups": [(s or {}).get("n_groups") for _, s, _ in vals],
                     "spread_over": [(s or {}).get("over") for _, s, _ in vals],
                     "deltas": deltas, "flags": flags, "higher_is_better": vals[0][2]})
    return {"labels": labels, "paths": [str(p) for p in paths], "rows": rows, "without_value": empty}


def _std(spread: dict | None) -> float | None:
    std = (spread or {}).get("std") if isinstance(spread, dict) else None
    return float(std) if std is not None and math.isfinite(std) else None


def to_markdown(cmp: dict[str, Any]) -> str:
    """The comparison as a Markdown table: value ± spread per run, delta vs the first run."""
    labels = cmp["labels"]
    head = ["metric"] + labels + [f"Δ {lab} - {labels[0]}" for lab in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in cmp["rows"]:
        cells = [r["metric"] + ("" if r["higher_is_better"] else " (lower is better)")]
        for v, s, n, over in zip(r["values"], r["spreads"], r["spread_groups"], r["spread_over"]):
            group = f" ({n} {over}s)" if n and over else ""
            cells.append(_num(v) + (f" ± {_num(s)}{group}" if s is not None else ""))
        for d, f in zip(r["deltas"], r["flags"]):
            text = _num(d)
            cells.append(("+" if d is not None and math.isfinite(d) and float(text) > 0 else "") + text
                         + (" *" if f else ""))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "_± = standard deviation of the run's per-seed (or per-sample-index) values over the groups "
                  "counted in brackets; * = |Δ| larger than either run's spread, a rough guide: with 2 groups the "
                  "spread itself is very uncertain._"]
    if cmp.get("without_value"):
        lines.append(f"_Left out (no value in any run): {', '.join(cmp['without_value'])}._")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m evaluation compare A B [C ...] [--labels ...] [--out table.md]``."""
    p = argparse.ArgumentParser(prog="python -m evaluation compare", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="evaluation folders (or results.json files); the first is the baseline")
    p.add_argument("--labels", nargs="+", default=None, help="a name per folder (default: folder names)")
    p.add_argument("--out", default=None, help="also write the table here (.md; a .json next to it holds the data)")
    args = p.parse_args(argv)
    cmp = compare(args.results, args.labels)
    text = to_markdown(cmp)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        out.with_suffix(".json").write_text(json.dumps(cmp, indent=1))
    return cmp
