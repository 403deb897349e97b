"""The method arena: every entrant from one start, at equal counted compute, scored on held-out gold metrics.

    python -m evaluation arena --config configs/arena/shapes_rl.yaml          # train what is missing, evaluate, rank
    python -m evaluation arena --config configs/arena/shapes_rl.yaml --check  # validate the config only
    python -m evaluation arena --config configs/arena/shapes_rl.yaml --report # rewrite the leaderboard from the runs

An arena config (YAML, ``docs/evaluation.md`` "The method arena") names:

* ``entrants``: ``name: "<method config> [genrl fit flags...]"``, one line each (a later entrant joins with one line);
* ``start``: the common start (``path``) and the config keys that receive it (``keys``, e.g.
  ``model.init_args.generator.pretrained``); every entrant's config must hold each key (else the start would not
  reach it);
* ``budget``: training compute per run in network forward-equivalents (``genrl fit --compute_budget``: a backward
  is two forwards, every role counted; see :mod:`genrl.callbacks.compute`); ``max_steps`` caps the optimizer steps;
* ``seeds``: training seeds, passed through ``seed_flags``; ``common``: flags added to every training run;
* ``prepare``: commands run once before training (``creates`` names their output; skipped when it exists);
* ``evaluation``: held-out ``prompts``, ``samples_per_prompt``, sampling ``seeds`` never used in training,
  ``samplers`` (``recorded``: each export's recorded sampler, plus one common sampler as pipelines/generate.py
  flags; ``generate_flags`` go to every generate call), the runner's ``rewards`` / ``dimensions``, the ``gold``
  reward key the table ranks by, ``real: shapes`` for the distance to true videos, and the frame-strip prompt.

Each (entrant, seed) trains through ``genrl fit`` in its own folder ``<out>/runs/<entrant>/s<seed>`` (a finished run is
skipped, a cut one resumed with ``--ckpt_path last``); each export and the start are sampled by
``pipelines/generate.py`` and scored by the evaluation runner (``python -m evaluation run``) and the gold metrics of
:mod:`genrl.eval.gold`; :mod:`evaluation.arena_report` writes ``leaderboard.json`` / ``.md`` / ``.html`` and plots.
Everything the leaderboard holds is read back from the stored runs, so rerunning a finished arena rewrites an
identical ``leaderboard.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = 1
#: flags the arena sets itself; an entrant line or ``common`` giving them would break the protocol
RESERVED = ("--run_dir", "--compute_budget", "--ckpt_path", "--trainer.max_steps", "--seed_everything")


@dataclass
class Entrant:
    """One entrant: ``name``, its base method ``config`` file and the extra ``genrl fit`` flags of its line."""

    name: str
    config: str
    flags: list[str]
    line: str

    @property
    def configs(self) -> list[str]:
        """Every config file of the line, in order (the base one and each ``--config`` flag)."""
        out, flags = [self.config], self.flags
        for i, f in enumerate(flags):
            if f in ("--config", "-c") and i + 1 < len(flags):
                out.append(flags[i + 1])
            elif f.startswith("--config="):
                out.append(f.split("=", 1)[1])
        return out


@dataclass
class Arena:
    """A parsed arena config (see the module docstring); ``path`` is the YAML file, ``raw`` its parsed content."""

    path: Path
    raw: dict
    name: str
    out: Path
    publish: Path | None
    start: str
    start_keys: list[str]
    budget: float
    max_steps: int
    seeds: list[int]
    seed_flags: list[str]
    common: list[str]
    prepare: list[dict]
    entrants: list[Entrant]
    evaluation: dict
    notes: dict = field(default_factory=dict)

    @property
    def config_hash(self) -> str:
        """sha256 of the parsed config (canonical JSON: comments and key order do not change it)."""
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True).encode()).hexdigest()


class ArenaConfigError(ValueError):
    """A bad arena config, found before any training; the message names the entrant or key and the fix."""


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (Path.cwd() / p)


def load_arena(path: str | os.PathLike) -> Arena:
    """Parse and check an arena config without training anything.

    Raises:
        FileNotFoundError: the config file is missing.
        ArenaConfigError (a ValueError): a missing or malformed key, an unknown method, a missing method config,
            a start model that is neither present nor made by a ``prepare`` step, an entrant config without a start
            key, a non-positive or non-finite budget, reserved flags in an entrant line; the message names the
            entrant.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"arena config {str(path)!r} not found; the shipped ones are configs/arena/*.yaml")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise ArenaConfigError(f"{path}: an arena config is a mapping (name, start, budget, entrants, evaluation)")
    missing = [k for k in ("name", "start", "budget", "seeds", "entrants", "evaluation") if k not in raw]
    if missing:
        raise ArenaConfigError(f"{path}: missing key(s) {missing}; see docs/evaluation.md, 'The method arena'")
    if int(raw.get("protocol", PROTOCOL)) != PROTOCOL:
        raise ArenaConfigError(f"{path}: protocol {raw['protocol']} is not this genrl's arena protocol {PROTOCOL}")
    budget = raw["budget"]
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ArenaConfigError(f"{path}: budget {budget!r} must be a positive number of forward-equivalents "
                               "(one forward of the policy network over one training sample; a backward counts 2)")
    start = raw["start"] if isinstance(raw["start"], dict) else {"path": raw["start"]}
    if not start.get("path"):
        raise ArenaConfigError(f"{path}: start.path (the common start model folder) is missing")
    keys = start.get("keys") or ["model.init_args.generator.pretrained"]
    seeds = raw["seeds"]
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise ArenaConfigError(f"{path}: seeds {seeds!r} must be a non-empty list of integers (training seeds)")
    if not isinstance(raw["entrants"], dict) or not raw["entrants"]:
        raise ArenaConfigError(f"{path}: entrants must map a name to a line '<method config> [flags]'")
    entrants = []
    for name, line in raw["entrants"].items():
        if not isinstance(line, str) or not line.strip():
            raise ArenaConfigError(f"entrant {name!r}: give '<method config.yaml> [--key=value ...]', got {line!r}")
        tokens = shlex.split(line)
        bad = [t for t in tokens[1:] if t.split("=", 1)[0] in RESERVED]
        if bad:
            raise ArenaConfigError(f"entrant {name!r}: {bad[0]!r} is set by the arena itself (run folder, budget, "
                                   "seeds, resume); remove it from the line")
        entrants.append(Entrant(str(name), tokens[0], tokens[1:], line))
    evaluation = dict(raw["evaluation"] or {})
    for key in ("prompts", "seeds", "gold"):
        if key not in evaluation:
            raise ArenaConfigError(f"{path}: evaluation.{key} is missing (held-out prompts, sampling seeds, the gold "
                                   "reward key the table ranks by)")
    overlap = sorted(set(evaluation["seeds"]) & set(seeds))
    if overlap:
        raise ArenaConfigError(f"{path}: evaluation.seeds {overlap} are also training seeds; held-out sampling seeds "
                               "must be ones the training never used")
    arena = Arena(
        path=path, raw=raw, name=str(raw["name"]), out=_resolve(raw.get("out") or f"runs/arena/{raw['name']}"),
        publish=_resolve(raw["publish"]) if raw.get("publish") else None, start=str(start["path"]),
        start_keys=list(keys), budget=float(budget), max_steps=int(raw.get("max_steps", 100000)),
        seeds=list(seeds), seed_flags=list(raw.get("seed_flags") or ["--seed_everything"]),
        common=[str(c) for c in raw.get("common") or []], prepare=list(raw.get("prepare") or []),
        entrants=entrants, evaluation=evaluation, notes=dict(raw.get("notes") or {}))
    check_arena(arena)
    return arena


def _dotted(cfg: dict, key: str) -> tuple[bool, Any]:
    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def entrant_config(entrant: Entrant) -> dict:
    """The entrant's config files merged left to right (dicts deep-merged, as ``genrl fit --config a --config b``)."""
    import yaml

    def merge(a: dict, b: dict) -> dict:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    merged: dict = {}
    for f in entrant.configs:
        merged = merge(merged, yaml.safe_load(_resolve(f).read_text()) or {})
    return merged


def method_of(entrant: Entrant) -> str:
    """The method class path of an entrant: a ``--model.class_path`` / ``--model`` flag, else its configs'."""
    for f in entrant.flags:
        for prefix in ("--model.class_path=", "--model="):
            if f.startswith(prefix):
                return f.split("=", 1)[1]
    found, value = _dotted(entrant_config(entrant), "model.class_path")
    return str(value) if found else ""


def _method_problem(class_path: str) -> str | None:
    """None when ``class_path`` (or a bare name in genrl.methods) names an importable class, else what is wrong:
    the module's import error (so a broken install is not reported as an unknown method) or the missing name."""
    module, _, name = class_path.rpartition(".")
    try:
        found = hasattr(importlib.import_module(module or "genrl.methods"), name)
    except ImportError as err:
        return f"cannot import {module or 'genrl.methods'!r} ({type(err).__name__}: {err})"
    return None if found else f"unknown method {class_path!r}"


def check_arena(arena: Arena) -> None:
    """Every check that needs no training (see :func:`load_arena`'s Raises)."""
    made = {str(_resolve(p["creates"])) for p in arena.prepare if isinstance(p, dict) and p.get("creates")}
    for step in arena.prepare:
        if not isinstance(step, dict) or not step.get("command") or not step.get("creates"):
            raise ArenaConfigError(f"prepare step {step!r}: give name, command and creates (the path it writes)")
    if not _resolve(arena.start).exists() and str(_resolve(arena.start)) not in made:
        raise ArenaConfigError(f"start model {arena.start!r} does not exist and no prepare step creates it; give an "
                               "existing model folder (e.g. assets/shapes-dit) or add the prepare step that makes it")
    names = set()
    for e in arena.entrants:
        if e.name in names:
            raise ArenaConfigError(f"entrant {e.name!r} is listed twice")
        names.add(e.name)
        for f in e.configs:
            if not _resolve(f).is_file():
                raise ArenaConfigError(f"entrant {e.name!r}: config {f!r} not found")
        method = method_of(e)
        if problem := _method_problem(method) if method else "no model.class_path":
            raise ArenaConfigError(f"entrant {e.name!r}: {problem}; use a genrl.methods class (GRPO, BranchGRPO, "
                                   "RAM, RewardWeightedRegression, ODEInit, DMD, TMD, AFD, ...) in model.class_path")
        cfg = entrant_config(e)
        for key in arena.start_keys:
            flag = any(f.startswith(f"--{key}=") for f in e.flags)
            if not flag and not _dotted(cfg, key)[0]:
                raise ArenaConfigError(f"entrant {e.name!r}: its config has no {key}, so the common start "
                                       f"{arena.start!r} would not reach it; add the key to the config or name the "
                                       "entrant's start key in start.keys")


# ------------------------------------------------------------------------------------------------------- running


def _fit_command(arena: Arena, e: Entrant, run_dir: Path, seed: int, *, budget: float, max_steps: int,
                 resume: bool) -> list[str]:
    cmd = [sys.executable, "-m", "genrl", "fit", "--config", e.config, *arena.common, *e.flags]  # the entrant's last
    cmd += [f"--{key}={arena.start}" for key in arena.start_keys]
    cmd += [f"{flag}={seed}" for flag in arena.seed_flags]
    cmd += [f"--run_dir={run_dir}", f"--compute_budget={budget:g}", f"--trainer.max_steps={max_steps}"]
    return cmd + (["--ckpt_path", "last"] if resume else [])


def read_record(path: Path) -> dict | None:
    """The JSON record at ``path`` (compute.json, arena_run.json, arena_eval.json, ...), or None when it is missing
    or unreadable (a run that never wrote it, or was cut while writing it)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_record(path: Path, obj: Any) -> None:
    """Write an arena record: strict JSON (NaN -> null), sorted keys, atomically (so a rerun reads it back as is)."""
    from genrl.data.video_io import write_json

    write_json(path, obj, indent=1, sort_keys=True)


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "a") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=Path.cwd(), env=env)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise RuntimeError(f"command failed (exit {rc}), log {log}:\n{tail}")


def prepare(arena: Arena) -> list[str]:
    """Run each ``prepare`` step whose ``creates`` path is missing; returns the commands (run or skipped)."""
    cmds = []
    for step in arena.prepare:
        cmds.append(step["command"])
        if _resolve(step["creates"]).exists():
            continue
        print(f"[arena] prepare {step.get('name', step['creates'])}: {step['command']}", flush=True)
        cmd = shlex.split(step["command"]) if isinstance(step["command"], str) else list(step["command"])
        if cmd[0] == "python":  # this interpreter (the environment genrl is installed in)
            cmd[0] = sys.executable
        elif cmd[0] == "genrl":
            cmd[:1] = [sys.executable, "-m", "genrl"]
        _run(cmd, arena.out / "prepare" / f"{step.get('name', 'step')}.log")
        if not _resolve(step["creates"]).exists():
            raise RuntimeError(f"prepare step {step.get('name')!r} finished but did not create {step['creates']!r}")
    return cmds


def probe(arena: Arena) -> dict[str, dict]:
    """One iteration of each entrant (seed ``seeds[0]``) in ``<out>/probe/<entrant>``: its cost per iteration in
    forward-equivalents and optimizer steps (cached). Raises ArenaConfigError, naming the entrants, when the budget
    cannot be reached within ``max_steps`` by any entrant."""
    costs = {}
    for e in arena.entrants:
        folder = arena.out / "probe" / e.name
        record = read_record(folder / "compute.json")
        if not (record and record.get("finished")):
            print(f"[arena] probe {e.name}: one iteration", flush=True)
            _run(_fit_command(arena, e, folder, arena.seeds[0], budget=1e-6, max_steps=arena.max_steps,
                              resume=False) + ["--trainer.limit_val_batches=0"], folder / "probe.log")
            record = read_record(folder / "compute.json") or {}
        iters = max(1, int(record.get("iterations", 1)))
        costs[e.name] = {"forward_equivalents_per_iteration": record["forward_equivalents"] / iters,
                         "optimizer_steps_per_iteration": max(1, int(record.get("global_step", 1))) / iters}
    reach = {n: c["forward_equivalents_per_iteration"] * arena.max_steps / c["optimizer_steps_per_iteration"]
             for n, c in costs.items()}
    if all(r < arena.budget for r in reach.values()):
        raise ArenaConfigError(
            f"budget {arena.budget:g} cannot be reached by any entrant within max_steps {arena.max_steps}: "
            + ", ".join(f"{n} reaches {r:.0f}" for n, r in reach.items()) + "; lower the budget or raise max_steps")
    for n, c in costs.items():
        if c["forward_equivalents_per_iteration"] > arena.budget:
            print(f"[arena] warning: entrant {n!r} costs {c['forward_equivalents_per_iteration']:.0f} per iteration, "
                  f"more than the budget {arena.budget:g}: it stops after one iteration", flush=True)
    return costs


def run_dir(arena: Arena, entrant: str, seed: int) -> Path:
    """The folder of one training run."""
    return arena.out / "runs" / entrant / f"s{seed}"


def _locked(folder: Path) -> bool:
    """Whether another live arena process holds ``folder`` (its ``arena.lock`` names a running pid)."""
    try:
        pid = int((folder / "arena.lock").read_text().strip())
    except (FileNotFoundError, ValueError):
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def train(arena: Arena, only: list[str] | None = None) -> dict[str, dict[int, dict]]:
    """Train every (entrant, seed) that has not finished (a cut run resumes; ``only``: these entrants); a run another
    live arena process is training (its ``arena.lock``) is left to it. Returns the compute records."""
    out: dict[str, dict[int, dict]] = {}
    for e in arena.entrants:
        if only and e.name not in only:
            continue
        for seed in arena.seeds:
            folder = run_dir(arena, e.name, seed)
            record = read_record(folder / "compute.json")
            if not (record and record.get("finished")) and _locked(folder):
                print(f"[arena] {e.name} seed {seed}: another arena process is training it; skipped", flush=True)
                continue
            if not (record and record.get("finished")):
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "arena.lock").write_text(str(os.getpid()))
                resume = any(folder.glob("**/checkpoints/last*.ckpt"))
                cmd = _fit_command(arena, e, folder, seed, budget=arena.budget, max_steps=arena.max_steps,
                                   resume=resume)
                print(f"[arena] train {e.name} seed {seed}{' (resumed)' if resume else ''}", flush=True)
                t0, commit = time.time(), genrl_commit()  # the code the run starts with
                _run(cmd, folder / "train.log")
                record = read_record(folder / "compute.json") or {}
                meta = read_record(folder / "arena_run.json") or {"commands": []}
                meta["commands"].append(shlex.join(cmd))
                meta.update(entrant=e.name, line=e.line, seed=seed, machine=machine(), versions=versions(),
                            genrl_commit=commit)
                meta.setdefault("process_wall_s", 0.0)
                meta["process_wall_s"] = round(meta["process_wall_s"] + time.time() - t0, 1)
                write_record(folder / "arena_run.json", meta)
                (folder / "arena.lock").unlink(missing_ok=True)
            out.setdefault(e.name, {})[seed] = record
    return out


# ---------------------------------------------------------------------------------------------------- evaluation


def _generate_module():
    spec = importlib.util.spec_from_file_location("genrl_pipelines_generate", ROOT / "pipelines" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def eval_prompts(arena: Arena) -> list[str]:
    """The held-out evaluation prompts (``evaluation.prompts``: any pipelines/generate.py source; ``limit``)."""
    from genrl.data.prompts import load_prompts

    records = load_prompts(arena.evaluation["prompts"])
    limit = arena.evaluation.get("limit")
    return [r.prompt for r in records[:limit]]


def _load_folder(folder: Path) -> tuple[Any, list[str]]:
    """Videos of a generate.py folder, decoded at the generated size: float [N, T, 3, H, W] in [0, 1], prompts."""
    import torch

    from evaluation.inputs import discover, load_video
    from evaluation.run import _generated_size

    items, _ = discover(folder)
    videos = [_generated_size(load_video(it)[0][None].float() / 255.0, it)[0] for it in items]
    return torch.stack(videos), [it.prompt for it in items]


def real_set(arena: Arena) -> Path | None:
    """True videos of the evaluation prompts (``evaluation.real: shapes``), written once as a generate.py-style
    folder so they pass through the same codec as the generated ones; None without ``real``."""
    if arena.evaluation.get("real") != "shapes":
        return None
    folder = arena.out / "eval" / "real"
    if (folder / "manifest.jsonl").is_file():
        return folder
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.data.video_io import write_video
    from genrl.eval.gold import real_videos

    prompts = eval_prompts(arena)
    k = int(arena.evaluation.get("samples_per_prompt", 1))
    listed = [p for p in prompts for _ in range(k)]
    world = ShapesWorldConfig()
    videos = real_videos(world, listed, seed=int(arena.evaluation.get("real_seed", 5000)))
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, (p, v) in enumerate(zip(listed, videos)):
        name = f"{i:05d}.mp4"
        write_video(folder / name, v, fps=8)
        lines.append(json.dumps({"file": name, "prompt": p, "index": i, "sample": i % k, "seed": 0,
                                 "height": world.height, "width": world.width}))
    (folder / "manifest.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def evaluate_model(arena: Arena, model: Path, dest: Path, recorded_flags: str = "") -> dict[str, dict]:
    """Sample ``model`` on the held-out prompts with each sampler and sampling seed, score with the runner and the
    gold metrics; cached in ``<dest>/arena_eval.json``. ``recorded_flags`` stand in for the sampler a model without a
    recorded one (the start) is evaluated with under ``recorded``. Returns ``{sampler: {"settings", "metrics":
    {metric: {"mean", "per_seed"}}}}`` (or ``{"same_as": sampler}`` / ``{"error": message}``)."""
    cached = read_record(dest / "arena_eval.json")
    if cached is not None:
        return cached
    from evaluation.run import main as run_main
    from genrl.eval.gold import PixelFD, gold_metrics

    ev = arena.evaluation
    prompts = eval_prompts(arena)
    prompt_file = arena.out / "eval" / "prompts.txt"
    prompt_file.parent.mkdir(parents=True, exist_ok=True)
    prompt_file.write_text("\n".join(prompts) + "\n")
    real_folder = real_set(arena)
    real, fd = (None, None)
    if real_folder is not None:
        real, _ = _load_folder(real_folder)
        fd = PixelFD(real)
    generate = _generate_module()
    samplers = ev.get("samplers") or {"recorded": ""}
    result: dict[str, dict] = {}
    settings_seen: dict[str, str] = {}
    for sampler, flags in samplers.items():
        per_seed: list[dict[str, float]] = []
        settings, seconds, frames = None, 0.0, 0
        for s in ev["seeds"]:
            folder = dest / sampler / f"seed{s}"
            argv = ["--model", str(model), "--prompts", str(prompt_file), "--samples-per-prompt",
                    str(int(ev.get("samples_per_prompt", 1))), "--seed", str(s), "--out", str(folder),
                    "--batch-size", str(int(ev.get("batch_size", 64))), *shlex.split(ev.get("generate_flags") or ""),
                    *shlex.split(flags or (recorded_flags if sampler == "recorded" else ""))]
            t0 = time.perf_counter()
            try:
                records = generate.main(argv)
            except (ValueError, SystemExit) as err:  # a sampler this model cannot use (e.g. a step list for TMD)
                print(f"[arena] {model}: sampler {sampler!r} failed: {err}", flush=True)
                result[sampler] = {"error": str(err) or type(err).__name__}
                break
            seconds += time.perf_counter() - t0
            frames += sum(int(r.get("num_frames") or 1) for r in records)
            settings = {k: v for k, v in records[0].items()
                        if k not in ("file", "path", "prompt", "prompt_index", "sample", "index", "metadata")}
            runner = ["--videos", str(folder), "--no-report"]
            for r in ev.get("rewards") or []:
                runner += ["--reward", r]
            for d in ev.get("dimensions") or []:
                runner += ["--dimension", d]
            results = run_main(runner)
            metrics = {k: float(v["mean"]) for k, v in results["rewards"].items()}
            metrics.update({k: float(v["score"]) for k, v in results["dimensions"].items()})
            videos, vprompts = _load_folder(folder)
            metrics.update(gold_metrics(videos, vprompts, real=real, fd=fd))
            per_seed.append(metrics)
        if sampler in result:  # failed
            continue
        key = json.dumps({k: v for k, v in settings.items() if k not in ("seed", "model")}, sort_keys=True)
        if key in settings_seen:  # the same sampler as another one (e.g. recorded == common): say so
            result[sampler] = {"same_as": settings_seen[key]}
            continue
        settings_seen[key] = sampler
        keys = [k for k in per_seed[0] if all(k in m for m in per_seed)]
        metrics = {k: {"mean": _mean([m[k] for m in per_seed]), "per_seed": [m[k] for m in per_seed]} for k in keys}
        nfe, fps = network_evaluations(settings), frames / max(seconds, 1e-9)
        metrics.update(nfe={"mean": nfe, "per_seed": [nfe]}, frames_per_s={"mean": fps, "per_seed": [fps]})
        result[sampler] = {"settings": {k: v for k, v in settings.items() if k not in ("seed", "model")},
                           "metrics": metrics}
    write_record(dest / "arena_eval.json", result)
    return result


def network_evaluations(settings: dict) -> float:
    """Network evaluations per video of a generate.py sampler record: TMD's effective NFE when recorded, else the
    steps (a causal student's step list, applied to each chunk, whose context pass is not counted) x 2 with CFG."""
    if settings.get("effective_nfe") is not None:
        return float(settings["effective_nfe"])
    steps = len(settings["timesteps"]) if settings.get("timesteps") else int(settings.get("steps") or 0)
    return float(steps * (2 if float(settings.get("cfg_scale") or 1.0) != 1.0 else 1))


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(vals) if vals else None


def evaluate(arena: Arena, only: list[str] | None = None) -> dict[str, Any]:
    """Evaluate the start and every finished run's export (cached per run; ``only``: these entrants)."""
    out = {"start": evaluate_model(arena, _resolve(arena.start), arena.out / "eval" / "start",
                                   arena.evaluation.get("start_recorded") or ""), "runs": {}}
    for e in arena.entrants:
        if only and e.name not in only:
            continue
        for seed in arena.seeds:
            folder = run_dir(arena, e.name, seed)
            if not (read_record(folder / "compute.json") or {}).get("finished"):
                # another process (--only) still trains it: it, or the run that writes the leaderboard, evaluates it
                print(f"[arena] {e.name} seed {seed}: not finished; not evaluated yet", flush=True)
                continue
            export = next((p.parent for p in sorted(folder.glob("**/export/config.json"))), None)
            if export is None:
                raise FileNotFoundError(f"entrant {e.name!r} seed {seed}: no export under {folder} (the method "
                                        "config needs a genrl.callbacks.DiffusersExport callback)")
            print(f"[arena] evaluate {e.name} seed {seed}", flush=True)
            out["runs"].setdefault(e.name, {})[seed] = evaluate_model(arena, export, folder / "arena_eval")
    return out


# -------------------------------------------------------------------------------------------------- provenance


def genrl_commit() -> str:
    """The checkout's commit (``+dirty`` when tracked files differ), or ``unknown`` outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return (sha + ("+dirty" if dirty else "")) if sha else "unknown"
    except OSError:
        return "unknown"


def versions() -> dict[str, str]:
    """torch / diffusers / lightning / transformers versions."""
    out = {}
    for name in ("torch", "diffusers", "lightning", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = "absent"
    return out


def machine() -> dict[str, Any]:
    """This machine: OS, CPU, core count, GPU (name) when CUDA is available."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"system": platform.system(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "gpu": gpu}


# ----------------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> dict:
    """``python -m evaluation arena`` (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m evaluation arena", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="arena config (configs/arena/<track>.yaml)")
    p.add_argument("--check", action="store_true", help="validate the config (and probe each entrant's cost); "
                   "train nothing")
    p.add_argument("--report", action="store_true", help="rewrite the leaderboard from the stored runs only")
    p.add_argument("--no-probe", action="store_true", help="skip the one-iteration cost probe of each entrant")
    p.add_argument("--only", default=None, help="comma-separated entrants: train / evaluate just these (to share the "
                   "work between processes or machines over one out folder); the leaderboard is written when every "
                   "run is finished")
    args = p.parse_args(argv)
    arena = load_arena(args.config)
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    if only and (unknown := sorted(set(only) - {e.name for e in arena.entrants})):
        raise ArenaConfigError(f"--only names {unknown}, which are not entrants of {arena.path} "
                               f"({', '.join(e.name for e in arena.entrants)})")
    from evaluation.arena_report import build_leaderboard, write_leaderboard

    if not args.report:
        arena.out.mkdir(parents=True, exist_ok=True)
        prepared = prepare(arena)
        costs = {} if args.no_probe else probe(arena)
        if costs:
            write_record(arena.out / "probe.json", costs)
        if args.check:
            print(f"[arena] {arena.name}: config ok ({len(arena.entrants)} entrants x {len(arena.seeds)} seeds)")
            return {"costs": costs}
        if not (arena.out / "protocol.json").is_file():
            write_record(arena.out / "protocol.json", {
                "protocol": PROTOCOL, "config": str(arena.path), "config_hash": arena.config_hash,
                "genrl_commit": genrl_commit(), "versions": versions(), "machine": machine(),
                "prepare": prepared, "command": "python -m evaluation arena --config " + str(arena.path)})
        train(arena, only)
    unfinished = [f"{e.name} seed {s}" for e in arena.entrants for s in arena.seeds
                  if not (read_record(run_dir(arena, e.name, s) / "compute.json") or {}).get("finished")]
    if only:
        evaluate(arena, only)
        print(f"[arena] done: {', '.join(only)}" + (f"; still unfinished: {', '.join(unfinished)}" if unfinished
                                                    else "; run without --only to write the leaderboard"))
        return {"unfinished": unfinished}
    if unfinished:
        if not any(run_dir(arena, e.name, s).exists() for e in arena.entrants for s in arena.seeds):
            raise RuntimeError(f"no stored runs under {arena.out}: the run folders are not committed (a published "
                               f"leaderboard is the stored result: {arena.publish or arena.out}/leaderboard.json); "
                               f"train them with: python -m evaluation arena --config {arena.path}")
        raise RuntimeError(f"runs not finished (another process may still train them): {', '.join(unfinished)}; "
                           "rerun when they are")
    evaluated = evaluate(arena)
    board = build_leaderboard(arena, evaluated)
    write_leaderboard(arena, board)
    return board


if __name__ == "__main__":
    sys.exit(main())
