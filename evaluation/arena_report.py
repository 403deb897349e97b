"""The arena's leaderboard: ``leaderboard.json`` (every number, the protocol), ``leaderboard.md`` / ``.html`` and
plots (held-out reward against compute with the seed band, final metrics as bars with spread, frame strips).

:func:`build_leaderboard` reads only what the stored runs hold (each run's ``compute.json``, ``arena_run.json`` and
``arena_eval.json``, the arena's ``protocol.json``), so the same runs always give the same JSON.

Spread: ``std`` is the standard deviation over training seeds of each seed's mean over the sampling seeds.
Standing: the entrants whose gold mean is within the larger of the two spreads of the best one are ``winner``
(a tie for first when there are several), those within the spread of the worst are ``last``, the rest ``middle``.
Hacking score: the training reward's held-out gain over the start minus the gold metric's gain (both under the
recorded sampler); flags: diversity collapsed (below ``collapse`` x the start's) and frame statistics drifted by more
than ``drift_sigmas`` x the start's spread over sampling seeds and than ``drift_floor`` (relative, default 0.25, as
the monitor's drift thresholds) of the start's value (at least 0.01); monitor: what each run's
:class:`~genrl.callbacks.RewardHackingMonitor` flagged during training (``metric@iteration`` from its
``hacking.json``), when the entrant's config has one.
"""

from __future__ import annotations

import html
import json
import math
import shutil
import statistics
from pathlib import Path
from typing import Any

#: metrics shown in the tables and bars when present (runner keys and gold metrics), in this order
SHOWN = ("fd", "flicker_gap", "temporal_flickering", "diversity_within_prompt", "brightness", "saturation",
         "constant_frames", "nfe", "frames_per_s")
FRAME_STATS = ("brightness", "saturation", "constant_frames")


def _stats(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return {"mean": statistics.fmean(vals) if vals else None,
            "std": statistics.stdev(vals) if len(vals) > 1 else (0.0 if vals else None), "per_seed": values}


def _sampler_metrics(evals: dict) -> dict[str, dict[str, dict[str, Any]]]:
    """{sampler: {metric: stats over training seeds}} from {seed: arena_eval.json}."""
    out: dict[str, dict] = {}
    first = next(iter(evals.values()))
    for sampler, body in first.items():
        if "same_as" in body or "error" in body:  # the same settings as an earlier sampler / failed: no numbers
            continue
        keys = [k for k in body["metrics"] if all(k in e[sampler].get("metrics", {}) for e in evals.values())]
        out[sampler] = {k: _stats([e[sampler]["metrics"][k]["mean"] for e in evals.values()]) for k in keys}
    for sampler, body in first.items():
        if "same_as" in body:
            out[sampler] = out[body["same_as"]]
    return out


def _same_as(evals: dict) -> dict[str, str]:
    """{sampler: the earlier sampler with identical settings} of one model's (any seed's) arena_eval.json."""
    first = next(iter(evals.values()))
    return {s: b["same_as"] for s, b in first.items() if "same_as" in b}


def _curve(records: dict[int, dict], key: str) -> dict[str, list]:
    return {str(seed): [[h["forward_equivalents"], h["metrics"].get(key)] for h in (r.get("history") or [])
                        if h.get("metrics", {}).get(key) is not None] for seed, r in records.items()}


def _standing(rows: list[dict], metric: str, sampler: str, higher: bool) -> None:
    def get(r):
        return r["samplers"][sampler].get(metric, {})

    scored = [r for r in rows if get(r).get("mean") is not None]
    if not scored:
        return
    scored.sort(key=lambda r: get(r)["mean"], reverse=higher)
    best, worst = scored[0], scored[-1]
    for i, r in enumerate(scored):
        r["rank"] = i + 1
        m, s = get(r)["mean"], get(r)["std"] or 0.0
        near_best = abs(m - get(best)["mean"]) <= max(s, get(best)["std"] or 0.0)
        near_worst = abs(m - get(worst)["mean"]) <= max(s, get(worst)["std"] or 0.0)
        r["standing"] = "winner" if near_best else ("last" if near_worst else "middle")


def _hacking(mine: dict, base: dict, ev: dict, gold: str, train_key: str | None) -> dict[str, Any]:
    """The hacking score and flags of one entrant (its metrics ``mine`` against the start's ``base``)."""
    hack: dict[str, Any] = {"flags": []}
    if gold in mine and gold in base:
        hack["gold_gain"] = mine[gold]["mean"] - base[gold]["mean"]
    if train_key and train_key in mine and train_key in base:
        hack["train_gain"] = mine[train_key]["mean"] - base[train_key]["mean"]
        if "gold_gain" in hack:
            hack["score"] = hack["train_gain"] - hack["gold_gain"]
    div = next((k for k in ("diversity_within_prompt", "diversity_batch") if k in mine and k in base), None)
    collapse = float(ev.get("collapse", 0.5))
    if div and base[div]["mean"] and mine[div]["mean"] < collapse * base[div]["mean"]:
        hack["flags"].append(f"{div} {mine[div]['mean']:.4f} < {collapse:g} x start {base[div]['mean']:.4f}")
    sig, floor = float(ev.get("drift_sigmas", 3.0)), float(ev.get("drift_floor", 0.25))
    for k in FRAME_STATS:
        if k in mine and k in base and base[k]["mean"] is not None:
            tol = max(sig * (base[k]["std"] or 0.0), floor * abs(base[k]["mean"]), 0.01)
            if abs(mine[k]["mean"] - base[k]["mean"]) > tol:
                hack["flags"].append(f"{k} {base[k]['mean']:.4f} -> {mine[k]['mean']:.4f} (beyond {tol:.4f})")
    return hack


def build_leaderboard(arena, evaluated: dict) -> dict[str, Any]:
    """The leaderboard dict from the arena and :func:`evaluation.arena.evaluate`'s output (see module docstring)."""
    from evaluation.arena import method_of, read_record, run_dir

    ev = arena.evaluation
    gold, train_key = ev["gold"], ev.get("training_reward")
    higher = bool(ev.get("higher_is_better", True))
    samplers = list((ev.get("samplers") or {"recorded": ""}).keys())
    rank_sampler = ev.get("rank_sampler", samplers[-1])
    start = {s: {k: _stats(v["per_seed"]) for k, v in body["metrics"].items()}
             for s, body in evaluated["start"].items() if "metrics" in body}
    start.update({s: start[b["same_as"]] for s, b in evaluated["start"].items() if "same_as" in b})
    rows = []
    for e in arena.entrants:
        records = {seed: read_record(run_dir(arena, e.name, seed) / "compute.json") or {} for seed in arena.seeds}
        metas = {seed: read_record(run_dir(arena, e.name, seed) / "arena_run.json") or {} for seed in arena.seeds}
        per = evaluated["runs"][e.name]
        row: dict[str, Any] = {
            "name": e.name, "line": e.line, "method": method_of(e), "note": arena.notes.get(e.name),
            "compute": {k: _stats([float(r.get(k, math.nan)) for r in records.values()])
                        for k in ("forward_equivalents", "wall_s", "peak_memory_bytes", "iterations", "global_step")},
            "stopped_by_budget": [bool(r.get("stopped_by_budget")) for r in records.values()],
            "samplers": _sampler_metrics(per), "same_sampler": _same_as(per),
            "curve": _curve(records, ev.get("curve_metric", "val/total")),
            "commands": {str(s): m.get("commands", []) for s, m in metas.items()},
            "genrl_commit": sorted({m.get("genrl_commit", "unknown") for m in metas.values()}),
            "monitor": {str(seed): [f"{f['metric']}@{f['iteration']}" for f in (read_record(
                run_dir(arena, e.name, seed) / "hacking.json") or {}).get("flags", [])] for seed in arena.seeds},
        }
        row["hacking"] = _hacking(row["samplers"].get(samplers[0], {}), start.get(samplers[0], {}), ev, gold,
                                  train_key)
        rows.append(row)
    _standing(rows, gold, rank_sampler, higher)
    rows.sort(key=lambda r: r.get("rank", 10**6))
    protocol = read_record(arena.out / "protocol.json") or {}
    protocol.update(config=str(arena.path), config_hash=arena.config_hash, name=arena.name, budget=arena.budget,
                    seeds=arena.seeds, start=arena.start, evaluation=ev,
                    entrants={e.name: e.line for e in arena.entrants})
    return {"protocol": protocol, "gold": gold, "training_reward": train_key, "rank_sampler": rank_sampler,
            "samplers": samplers, "start": start, "entrants": rows}


# ------------------------------------------------------------------------------------------------------- writing


def _fmt(stat: dict | None, digits: int = 3) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    s = f"{stat['mean']:.{digits}f}"
    return s + (f" ± {stat['std']:.{digits}f}" if stat.get("std") else "")


def _metric_columns(board: dict) -> list[str]:
    rs = board["rank_sampler"]
    present = set(board["start"].get(rs, {}))
    for r in board["entrants"]:
        present |= set(r["samplers"].get(rs, {}))
    first = [board["gold"]] + ([board["training_reward"]] if board["training_reward"] not in (None, board["gold"])
                               else [])
    return first + [k for k in SHOWN if k in present and k not in first]


def _table(board: dict) -> tuple[list[str], list[list[str]]]:
    rs, cols = board["rank_sampler"], _metric_columns(board)
    others = [s for s in board["samplers"] if s != rs]
    head = ["rank", "entrant", "standing"] + [f"{c} ({rs})" for c in cols]
    head += [f"{board['gold']} ({s})" for s in others]
    head += ["forward-eq. used", "iterations", "wall s", "peak MB", "hacking score", "flags", "monitor"]
    body = [["-", "start", "-"] + [_fmt(board["start"].get(rs, {}).get(c)) for c in cols]
            + [_fmt(board["start"].get(s, {}).get(board["gold"])) for s in others] + ["0", "0"] + ["-"] * 5]
    for r in board["entrants"]:
        smp = r["samplers"]
        hack = r.get("hacking") or {}
        peak = r["compute"]["peak_memory_bytes"]
        body.append([str(r.get("rank", "-")), r["name"], r.get("standing", "-")]
                    + [_fmt(smp.get(rs, {}).get(c)) for c in cols]
                    + [_fmt(smp.get(s, {}).get(board["gold"])) if s not in r.get("same_sampler", {})
                       else f"= {r['same_sampler'][s]}" for s in others]
                    + [_fmt(r["compute"]["forward_equivalents"], 0), _fmt(r["compute"]["iterations"], 1),
                       _fmt(r["compute"]["wall_s"], 0),
                       f"{peak['mean'] / 2**20:.0f}" if peak.get("mean") else "-",
                       f"{hack['score']:+.3f}" if hack.get("score") is not None else "-",
                       "; ".join(hack.get("flags", [])) or "-",
                       "; ".join(f"s{k}: {', '.join(v)}" for k, v in r.get("monitor", {}).items() if v) or "-"])
    return head, body


def _plots(board: dict, arena, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    made = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in board["entrants"]:
        curves = [c for c in r["curve"].values() if c]
        if not curves:
            continue
        n = min(len(c) for c in curves)
        xs = [statistics.fmean(c[i][0] for c in curves) for i in range(n)]
        ys = [[c[i][1] for c in curves] for i in range(n)]
        line, = ax.plot(xs, [statistics.fmean(y) for y in ys], marker="o", ms=3, label=r["name"])
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("training compute (network forward-equivalents)")
    ax.set_ylabel(arena.evaluation.get("curve_metric", "val/total") + " (held-out validation)")
    ax.set_title("held-out validation reward against compute (each entrant's own validation; band: min-max over "
                 "training seeds)", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(plots / "reward_vs_compute.png", dpi=110)
    plt.close(fig)
    made.append(("held-out validation reward against training compute, as each entrant logged it during training "
                 "(its own validation prompts, batch and sampler: compare slopes, not levels, across methods)",
                 "plots/reward_vs_compute.png"))

    rs, cols = board["rank_sampler"], _metric_columns(board)
    fig, axes = plt.subplots(1, len(cols), figsize=(3.2 * len(cols), 3.6), squeeze=False)
    for ax, c in zip(axes[0], cols):
        names = [r["name"] for r in board["entrants"]]
        stats = [r["samplers"].get(rs, {}).get(c) or {} for r in board["entrants"]]
        ax.bar(range(len(names)), [s.get("mean") or 0.0 for s in stats], yerr=[s.get("std") or 0.0 for s in stats],
               capsize=3, color="tab:blue")
        base = board["start"].get(rs, {}).get(c, {}).get("mean")
        if base is not None:
            ax.axhline(base, color="k", ls="--", lw=1, label="start")
        ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
        ax.set_title(c, fontsize=9)
    fig.tight_layout()
    fig.savefig(plots / "final_metrics.png", dpi=110)
    plt.close(fig)
    made.append((f"final held-out metrics ({rs} sampler; bars: mean over training seeds, whiskers: spread, dashed: "
                 "the start)", "plots/final_metrics.png"))
    if _strips(board, arena, plots / "strips.png"):
        made.append(("one held-out prompt per entrant (first training seed, first sampling seed)", "plots/strips.png"))
    return made


def _strips(board: dict, arena, path: Path) -> bool:
    from PIL import Image, ImageDraw

    from evaluation.arena import _load_folder, run_dir

    ev = arena.evaluation
    sampler, seed = (list((ev.get("samplers") or {"recorded": ""}).keys())[0], ev["seeds"][0])
    k = int(ev.get("samples_per_prompt", 1))
    index = int(ev.get("strip_prompt", 0)) * k
    sources = [("start", arena.out / "eval" / "start" / sampler / f"seed{seed}")]
    sources += [(r["name"], run_dir(arena, r["name"], arena.seeds[0]) / "arena_eval" / sampler / f"seed{seed}")
                for r in board["entrants"]]
    rows, prompt = [], None
    for name, folder in sources:
        if not (folder / "manifest.jsonl").is_file():
            continue
        videos, prompts = _load_folder(folder)
        prompt = prompts[index]
        frames = (videos[index].clamp(0, 1) * 255).byte()  # [T, 3, H, W]
        strip = Image.fromarray(frames.permute(2, 0, 3, 1).reshape(frames.shape[2], -1, 3).numpy())
        rows.append((name, strip.resize((strip.width * 4, strip.height * 4), Image.NEAREST)))
    if not rows:
        return False
    label_w, w, h = 130, max(s.width for _, s in rows), rows[0][1].height
    canvas = Image.new("RGB", (label_w + w, 20 + len(rows) * (h + 4)), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((4, 4), f"prompt: {prompt}", fill="black")
    for i, (name, strip) in enumerate(rows):
        y = 20 + i * (h + 4)
        canvas.paste(strip, (label_w, y))
        draw.text((4, y + h // 2 - 6), name, fill="black")
    canvas.save(path)
    return True


def _markdown(board: dict, plots: list[tuple[str, str]]) -> str:
    p = board["protocol"]
    head, body = _table(board)
    lines = [f"# Arena leaderboard: {p['name']}", "",
             f"Ranked by `{board['gold']}` under the `{board['rank_sampler']}` sampler on held-out prompts and "
             f"sampling seeds; ± = spread over {len(p['seeds'])} training seeds (the start's: over the sampling "
             f"seeds). Budget {p['budget']:g} network forward-equivalents per run (a backward counts two; every "
             "role's network counted); a run stops at the first iteration boundary at or past it, so `forward-eq. "
             "used` can exceed it by up to one iteration. Hacking score: the training reward's gain minus the gold "
             "metric's gain over the start (positive: the training reward rose more than held-out correctness). "
             "Monitor: `s<seed>: <metric>@<iteration>`, the reward-hacking monitor's warnings during training. "
             "Rank numbers order means; the standing says which differences are beyond the spread.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    winners = [r["name"] for r in board["entrants"] if r.get("standing") == "winner"]
    last = [r["name"] for r in board["entrants"] if r.get("standing") == "last"]
    lines += ["", f"Winners (within the spread of the best): {', '.join(winners) or '-'}. "
              f"Last (within the spread of the worst): {', '.join(last) or '-'}.", ""]
    notes = [(r["name"], r["note"]) for r in board["entrants"] if r.get("note")]
    if notes:
        lines += ["Against the papers:", ""] + [f"- **{n}**: {t}" for n, t in notes] + [""]
    for title, rel in plots:
        lines += [f"![{title}]({rel})", "", f"*{title}*", ""]
    lines += ["## Protocol", "", f"- arena config: `{p['config']}` (sha256 of the parsed config "
              f"`{p['config_hash'][:16]}`), protocol {p.get('protocol')}",
              f"- genrl commit at the start: `{p.get('genrl_commit')}`; versions: "
              + ", ".join(f"{k} {v}" for k, v in (p.get("versions") or {}).items()),
              f"- machine: {json.dumps(p.get('machine'))}", f"- start: `{p['start']}`; training seeds {p['seeds']}",
              f"- evaluation: `{json.dumps(p['evaluation'], sort_keys=True)}`", "", "Entrants:", ""]
    lines += [f"- `{n}`: `{line}`" for n, line in p["entrants"].items()]
    lines += ["", f"Command: `{p.get('command')}`", ""]
    return "\n".join(lines)


def _html(board: dict, plots: list[tuple[str, str]]) -> str:
    head, body = _table(board)
    e = html.escape
    rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in body)
    figs = "".join(f"<figure><img src='{e(rel)}'><figcaption>{e(t)}</figcaption></figure>" for t, rel in plots)
    p = board["protocol"]
    return (f"<!doctype html><meta charset='utf-8'><title>Arena {e(p['name'])}</title>"
            "<style>body{font-family:sans-serif}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}"
            "table{border-collapse:collapse}img{max-width:100%}</style>"
            f"<h1>Arena leaderboard: {e(p['name'])}</h1><p>Ranked by {e(board['gold'])} ({e(board['rank_sampler'])}"
            f" sampler); budget {p['budget']:g} forward-equivalents per run; config sha256 {e(p['config_hash'])}; "
            f"genrl {e(str(p.get('genrl_commit')))}.</p><table><tr>"
            + "".join(f"<th>{e(h)}</th>" for h in head) + f"</tr>{rows}</table>{figs}"
            f"<pre>{e(json.dumps(p, indent=1, sort_keys=True))}</pre>")


def write_leaderboard(arena, board: dict) -> dict[str, Path]:
    """Write leaderboard.json / .md / .html and plots/ under the arena's ``out`` (and copy them to ``publish``)."""
    from evaluation.arena import write_record

    out = arena.out
    write_record(out / "leaderboard.json", board)
    plots = _plots(board, arena, out)
    (out / "leaderboard.md").write_text(_markdown(board, plots))
    (out / "leaderboard.html").write_text(_html(board, plots))
    written = {"json": out / "leaderboard.json", "md": out / "leaderboard.md", "html": out / "leaderboard.html"}
    if arena.publish is not None:
        arena.publish.mkdir(parents=True, exist_ok=True)
        for name in ("leaderboard.json", "leaderboard.md", "leaderboard.html"):
            shutil.copyfile(out / name, arena.publish / name)
        shutil.copytree(out / "plots", arena.publish / "plots", dirs_exist_ok=True)
    print(f"[arena] leaderboard: {out / 'leaderboard.md'}" + (f" (copied to {arena.publish})" if arena.publish
                                                              else ""), flush=True)
    return written
