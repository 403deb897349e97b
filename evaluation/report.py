"""The readable side of an evaluation: ``report.md`` and ``report.html`` (the same tables) plus PNG plots under
``plots/`` (per-dimension bars, reward bars with spread, per-video reward histogram, frame strips of sample videos),
written from a ``results.json`` of :mod:`evaluation.run`.

    python -m evaluation report outputs/vbench/eval          # rewrite the report of an existing results.json
"""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

PLOTS = "plots"


#: how an undefined metric (None, NaN: e.g. step following on a suite without multi-step prompts) is shown
NA = "n/a"


def fmt_value(v: Any, digits: int = 4) -> str:
    """A metric for a table or the terminal: ``digits`` decimals, :data:`NA` when undefined (None, NaN, inf)."""
    if v is None:
        return NA
    if isinstance(v, float):
        return NA if not math.isfinite(v) else f"{v:.{digits}f}"
    return str(v)


_fmt = fmt_value


def _spread_text(s: dict | None) -> str:
    if not s or s.get("std") is None or not math.isfinite(s["std"]):
        return NA
    return f"±{s['std']:.4f} over {s['n_groups']} {s['over']}s"


def _tables(results: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]], str]]:
    """(title, header, rows, note) of every table, shared by the Markdown and HTML writers."""
    tables = []
    dims = results.get("dimensions", {})
    if dims:
        rows = [[name + (" (proxy)" if d.get("proxy") else ""), _fmt(d.get("score")), _fmt(d.get("normalized")),
                 str(d.get("n", 0)), d.get("prompt_selection", "all"), _spread_text(d.get("spread")),
                 d.get("note") or d.get("description", "")] for name, d in dims.items()]
        tables.append(("Dimensions", ["dimension", "score", "normalised", "videos", "prompts", "seed spread",
                                      "what"], rows,
                       "VBench's dimensions and genrl's own (first_frame_fidelity, in dB: no VBench normalisation). "
                       "proxy = a weight-free stand-in for VBench's model (Farneback optical flow instead of RAFT / "
                       "AMT-S): useful for curves, not comparable with published VBench numbers. Normalised = VBench's "
                       "min-max normalisation (scripts/constant.py)."))
        comp = results.get("vbench", {})
        rows = []
        for label, key in (("native dimensions only", "composites"), ("with proxies", "composites_with_proxies")):
            for cname, c in (comp.get(key) or {}).items():
                if isinstance(c, dict):
                    missing = c.get("missing", [])
                    rows.append([cname, label, "partial" if c.get("partial") else _fmt(c.get("value")),
                                 f"{len(missing)}: " + ", ".join(missing) if missing else "-"])
        if rows and all(r[2] == "partial" for r in rows):  # the usual case without every weight: one line
            n_missing = min(int(r[3].split(":")[0]) for r in rows if r[0] == "quality")
            rows = [["quality / semantic / total", "-", "partial",
                     f"at least {n_missing} of 7 quality dimensions and the semantic ones (official vbench only)"]]
        if rows:
            tables.append(("VBench composites", ["score", "from", "value", "missing dimensions"], rows,
                           "Quality / Semantic / Total follow VBench's cal_final_score; a composite with a missing "
                           "dimension is partial and has no value."))
    rewards = results.get("rewards", {})
    if rewards:
        rows = [[name, _fmt(r.get("mean")), _fmt(r.get("std")), str(r.get("n_valid", 0)), str(r.get("n_invalid", 0)),
                 _spread_text(r.get("spread"))] for name, r in rewards.items()]
        errors = results.get("reward_errors") or {}
        note = ("invalid = the reward marked the video invalid (NaN), e.g. an attribute that does not apply"
                + (f"; reward calls that raised: {errors}" if any(errors.values()) else ""))
        tables.append(("Rewards", ["reward / key", "mean", "std", "valid", "invalid", "seed spread"], rows, note))
    dist = results.get("distribution", {})
    if dist:
        rows = []
        for name, r in dist.items():
            if "error" in r:
                rows.append([name.upper(), "-", "-", "-", "-", r["error"]])
            else:
                warn = "; ".join(r.get("warnings", [])) or "-"
                rows.append([name.upper(), _fmt(r.get(name), 3), str(r.get("n_real")), str(r.get("n_fake")),
                             str(r.get("extractor", "")), ("" if r.get("comparable", True) else "NOT COMPARABLE; ")
                             + warn])
        tables.append(("Distribution metrics", ["metric", "value", "real", "generated", "extractor", "notes"], rows,
                       "Frechet distances depend on N, clip length, resolution and the extractor: compare only equal "
                       "settings."))
    per_video = results.get("per_video", [])
    if per_video:
        dim_names = list(dims)
        reward_names = [k for k in rewards if k.endswith("/reward")] or list(rewards)[:4]
        by_prompt: dict[str, list[dict]] = defaultdict(list)
        for r in per_video:
            by_prompt[r["prompt"]].append(r)
        rows = []
        for prompt, recs in by_prompt.items():
            row = [prompt, str(len(recs))]
            for name in dim_names:
                vals = [r["dimensions"][name] for r in recs if r.get("dimensions", {}).get(name) is not None]
                row.append(_fmt(sum(vals) / len(vals)) if vals else "-")
            for name in reward_names:
                vals = [r["rewards"][name] for r in recs if (r.get("rewards") or {}).get(name) is not None]
                row.append(_fmt(sum(vals) / len(vals)) if vals else "-")
            rows.append(row)
        tables.append(("Per prompt", ["prompt", "videos"] + dim_names + reward_names, rows,
                       "mean over the prompt's videos; '-' = not scored (not in the dimension's prompt set, too short, "
                       "or invalid)"))
    skipped = results.get("skipped", [])
    rows = [[s["file"], s.get("metric") or "all", s["reason"]] for s in skipped]
    tables.append(("Skipped", ["file", "for", "reason"], rows or [["-", "-", "nothing was skipped"]],
                   "files and metrics left out, with why"))
    return tables


def clipped_errors(values: list[float | None], errs: list[float | None],
                   bounds: tuple[float, float] | None) -> list[list[float]]:
    """Asymmetric error bars ``[lower, upper]`` for ``values ± errs`` that stay inside ``bounds`` (a score in
    [0, 1] never gets a bar past 0 or 1); undefined values or errors get no bar."""
    lower, upper = [], []
    for v, e in zip(values, errs):
        if v is None or e is None or not math.isfinite(v) or not math.isfinite(e):
            lower.append(0.0)
            upper.append(0.0)
            continue
        lo, hi = (v - e, v + e) if bounds is None else (max(bounds[0], v - e), min(bounds[1], v + e))
        lower.append(max(0.0, v - lo))
        upper.append(max(0.0, hi - v))
    return [lower, upper]


def _plot_bars(path: Path, labels: list[str], values: list[float], errs: list[float] | None, hatch: list[bool],
               title: str, xlim: tuple[float, float] | None, bounds: tuple[float, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    ys = list(range(len(labels)))
    xerr = clipped_errors(values, errs, bounds) if errs else None
    bars = ax.barh(ys, [v if v is not None and math.isfinite(v) else 0.0 for v in values], xerr=xerr,
                   color=["#b0c4de" if h else "#4c72b0" for h in hatch], edgecolor="black", capsize=3)
    for b, h in zip(bars, hatch):
        if h:
            b.set_hatch("//")
    finite = [v for v in values if v is not None and math.isfinite(v)]
    span = (xlim[1] - xlim[0]) if xlim else (max(finite, default=1.0) or 1.0)
    for k, (y, v) in enumerate(zip(ys, values)):
        if v is None or not math.isfinite(v):
            ax.text(0, y, f" {NA} (undefined: no video scored)", va="center", fontsize=8, color="gray")
            continue
        e = xerr[1][k] if xerr else 0.0
        ax.text(v + e + 0.01 * span, y, f"{v:.3f}", va="center", fontsize=8)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.invert_yaxis()
    if xlim:
        ax.set_xlim(xlim[0], xlim[1] + 0.12 * span)
    else:
        ax.set_xlim(right=ax.get_xlim()[1] + 0.15 * span)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hist(path: Path, series: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    for name, vals in series.items():
        ax.hist(vals, bins=min(30, max(5, len(vals) // 4)), alpha=0.6, label=f"{name} (n={len(vals)})")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _frame_strip(path: Path, video: Path, caption: str, n_frames: int = 8, height: int = 96) -> bool:
    """n frames of a video side by side (scaled to ``height`` px, nearest for tiny videos) with the caption."""
    import torch
    from PIL import Image, ImageDraw

    from evaluation.inputs import EvalItem, load_video

    try:
        frames, _ = load_video(EvalItem(video.name, video, caption))
    except (FileNotFoundError, ValueError):
        return False
    idx = torch.linspace(0, frames.shape[0] - 1, min(n_frames, frames.shape[0])).round().long().unique()
    h, w = frames.shape[2], frames.shape[3]
    scale = height / h
    tw = max(1, round(w * scale))
    resample = Image.NEAREST if h < 64 else Image.BICUBIC
    tiles = [Image.fromarray(frames[i].permute(1, 2, 0).numpy()).resize((tw, height), resample) for i in idx]
    strip = Image.new("RGB", (len(tiles) * (tw + 2), height + 18), "white")
    for k, t in enumerate(tiles):
        strip.paste(t, (k * (tw + 2), 18))
    ImageDraw.Draw(strip).text((2, 2), caption[:120], fill="black")
    strip.save(path)
    return True


def make_plots(results: dict[str, Any], out: Path, samples: int = 6) -> list[tuple[str, str]]:
    """Write the PNGs; returns (title, path relative to ``out``) of each."""
    plots = out / PLOTS
    plots.mkdir(parents=True, exist_ok=True)
    made: list[tuple[str, str]] = []
    dims = results.get("dimensions", {})
    names = [n for n in dims if not dims[n].get("unit")]  # scores in [0, 1]
    if names:
        _plot_bars(plots / "dimensions.png", [n + (" (proxy)" if dims[n].get("proxy") else "") for n in names],
                   [dims[n].get("score") for n in names],
                   [(dims[n].get("spread") or {}).get("std") for n in names],
                   [bool(dims[n].get("proxy")) for n in names], "Dimensions (raw score in [0, 1]; hatched = proxy)",
                   (0.0, 1.05), bounds=(0.0, 1.0))
        made.append(("VBench dimensions", f"{PLOTS}/dimensions.png"))
    for unit in sorted({dims[n]["unit"] for n in dims if dims[n].get("unit")}):  # e.g. PSNR in dB: its own axis
        names = [n for n in dims if dims[n].get("unit") == unit]
        _plot_bars(plots / f"dimensions_{unit}.png", names, [dims[n].get("score") for n in names],
                   [(dims[n].get("spread") or {}).get("std") for n in names], [False] * len(names),
                   f"Dimensions in {unit}", None)
        made.append((f"Dimensions in {unit}", f"{PLOTS}/dimensions_{unit}.png"))
    rewards = results.get("rewards", {})
    if rewards:
        names = list(rewards)
        per_key = [[(r.get("rewards") or {}).get(n) for r in results.get("per_video", [])] for n in names]
        unit = all(v is None or 0.0 <= v <= 1.0 for vals in per_key for v in vals) and any(
            v is not None for vals in per_key for v in vals)  # every observed score in [0, 1]: keep the bars there
        _plot_bars(plots / "rewards.png", names, [rewards[n].get("mean") for n in names],
                   [rewards[n].get("std") for n in names], [False] * len(names), "Rewards (mean ± std over videos)",
                   None, bounds=(0.0, 1.0) if unit else None)
        made.append(("Rewards", f"{PLOTS}/rewards.png"))
        main = [k for k in names if k.endswith("/reward")]
        series = {k: [r["rewards"][k] for r in results.get("per_video", [])
                      if (r.get("rewards") or {}).get(k) is not None] for k in main}
        series = {k: v for k, v in series.items() if v}
        if series:
            _plot_hist(plots / "reward_hist.png", series, "Per-video reward")
            made.append(("Per-video reward", f"{PLOTS}/reward_hist.png"))
    per_video = results.get("per_video", [])
    if samples > 0 and per_video:
        step = max(1, len(per_video) // samples)
        chosen = per_video[::step][:samples]
        root = Path(results["videos"])
        for k, r in enumerate(chosen):
            name = f"sample_{k}.png"
            if _frame_strip(plots / name, root / r["file"], f"{r['file']}: {r['prompt']}"):
                made.append((f"Sample: {r['prompt'][:80]}", f"{PLOTS}/{name}"))
    return made


def _markdown(results: dict[str, Any], tables, plots) -> str:
    lines = [f"# Evaluation of `{results['videos']}`", "",
             f"{results['n_videos']} videos evaluated in {results.get('elapsed_s')} s; "
             f"{len(results.get('skipped', []))} skipped entries (see the end).", ""]
    for title, header, rows, note in _ordered(tables, plots):
        if title is None:
            lines += ["## Plots", ""] + [f"![{t}]({p})" for t, p in plots] + [""]
            continue
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        lines += ["", f"_{note}_", ""]
    return "\n".join(lines)


def _ordered(tables, plots):
    """Summary tables, then the plots (a ``(None, ...)`` marker), then the long per-prompt and skipped tables."""
    long = ("Per prompt", "Skipped")
    head = [t for t in tables if t[0] not in long]
    tail = [t for t in tables if t[0] in long]
    return head + ([(None, None, None, None)] if plots else []) + tail


def _html(results: dict[str, Any], tables, plots) -> str:
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>genrl evaluation</title><style>",
             "body{font-family:sans-serif;margin:2em;max-width:1200px} table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left} th{background:#eee}"
             ".note{color:#555;font-size:12px} img{max-width:100%;margin:4px 0}", "</style></head><body>",
             f"<h1>Evaluation of <code>{e(results['videos'])}</code></h1>",
             f"<p>{results['n_videos']} videos evaluated in {results.get('elapsed_s')} s; "
             f"{len(results.get('skipped', []))} skipped entries.</p>"]
    for title, header, rows, note in _ordered(tables, plots):
        if title is None:
            parts.append("<h2>Plots</h2>")
            parts += [f"<h3>{e(t)}</h3><img src='{e(p)}' alt='{e(t)}'>" for t, p in plots]
            continue
        parts.append(f"<h2>{e(title)}</h2><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows]
        parts.append(f"</table><p class='note'>{e(note)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_report(results: dict[str, Any], out: str | Path, samples: int = 6) -> dict[str, Path]:
    """Write ``report.md``, ``report.html`` and ``plots/*.png`` for ``results`` into ``out``; returns their paths."""
    from genrl.data.video_io import atomic_write

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tables = _tables(results)
    plots = make_plots(results, out, samples=samples)
    md, page = _markdown(results, tables, plots), _html(results, tables, plots)
    atomic_write(out / "report.md", lambda tmp: Path(tmp).write_text(md))
    atomic_write(out / "report.html", lambda tmp: Path(tmp).write_text(page))
    return {"markdown": out / "report.md", "html": out / "report.html", "plots": out / PLOTS}


def main(argv: list[str] | None = None) -> dict[str, Path]:
    """``python -m evaluation report <results folder or results.json>``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m evaluation report", description="rewrite an evaluation's report")
    p.add_argument("results", help="an evaluation folder (with results.json) or the results.json itself")
    p.add_argument("--samples", type=int, default=6)
    args = p.parse_args(argv)
    path = Path(args.results)
    path = path / "results.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python -m evaluation run --videos ...` first")
    written = write_report(json.loads(path.read_text()), path.parent, samples=args.samples)
    print(f"wrote {written['markdown']} and {written['html']}")
    return written
