"""Evaluate a folder of generated videos: VBench-compatible dimensions, reward-zoo scores, FVD / FID; results as
JSON plus a report (Markdown, HTML and PNG plots) written next to the videos.

    python -m evaluation run --videos outputs/vbench \
        --dimension temporal_flickering --dimension dynamic_degree --dimension motion_smoothness \
        --dimension subject_consistency:/weights/dino-vitb16 --dimension background_consistency:/weights/clip-vit-b-32 \
        --dimension aesthetic_quality:/weights/vbench-aesthetic \
        --reward shapes --reward clipscore:/weights/clip-vit-l-14 \
        --fvd-real /data/real_clips --i3d /weights/i3d_pretrained_400.pt \
        --fid-real /data/real_frames --inception /weights/pt_inception-2015-12-05-6726825d.pth

Inputs: ``--videos`` is the ``--out`` folder of ``pipelines/generate.py`` (its ``manifest.jsonl`` gives each file's
prompt, seed and sample index) or a folder of VBench-named files ``{prompt}-{k}.mp4``. A file without a manifest line
stops the run unless ``--allow-unlisted`` (then it is skipped and listed in the report); an unreadable file or one too
short for a dimension is skipped for what it cannot serve and listed, never dropped silently.

Dimensions (``name`` or ``name:weights_folder``; see ``genrl.eval.dimensions``): each is scored on the prompts VBench
assigns to it when every prompt of the folder is in VBench's suite (``--prompt-selection auto``, the default), else on
every video. Dimensions marked *proxy* use a weight-free model in place of VBench's (Farneback optical flow for RAFT /
AMT-S) and are not comparable with published VBench numbers. Normalised scores and the Quality / Semantic / Total
composites follow VBench's scripts; a composite with a missing dimension is reported as partial, without a value.
Image-to-video dimensions (``first_frame_fidelity``, ``i2v_subject:/weights/dino-vitb16``) compare each video with the
image it was generated from, named by its manifest line (``pipelines/generate.py --image`` or a prompt file with an
``image`` per line records it); a video without one is skipped for those dimensions and listed.

Rewards (``name`` or ``name:weights_folder``, any entry of the reward zoo; ``--reward-config run.yaml`` takes a
training config's rewards): every output key, mean over valid videos; a failed reward call marks its videos invalid
and is counted in the results.

Output (``--out``, default ``<videos>/eval``): ``results.json``, ``report.md``, ``report.html``, ``plots/*.png``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from evaluation.inputs import EvalItem, Skipped, discover, load_image, load_video

RESULTS_FILE = "results.json"
SCHEMA = 1


def _split_spec(text: str, flag: str) -> tuple[str, str | None]:
    name, sep, path = text.partition(":")
    if not name or (sep and not path):
        raise ValueError(f"{flag} {text!r}: expected name or name:/local/weights/folder")
    return name, (path or None)


@dataclass
class _Metric:
    """Per-video values of one dimension or reward key (file -> (value, weight))."""

    name: str
    kind: str  # "dimension" | "reward"
    values: dict[str, tuple[float, float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def _weighted_mean(pairs: list[tuple[float, float]]) -> float:
    pairs = [(v, w) for v, w in pairs if v is not None and math.isfinite(v)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total > 0 else float("nan")


def _spread(metric: _Metric, items: list[EvalItem], aggregate) -> dict[str, Any] | None:
    """Per-seed (else per-sample-index) aggregates of a metric and their standard deviation."""
    by: dict[str, dict[Any, list]] = {"seed": defaultdict(list), "sample": defaultdict(list)}
    for it in items:
        if it.file in metric.values:
            by["seed"][it.seed].append(metric.values[it.file])
            by["sample"][it.sample].append(metric.values[it.file])
    for key in ("seed", "sample"):
        groups = {g: v for g, v in by[key].items() if g is not None}
        if len(groups) > 1:
            per = {str(g): aggregate(v) for g, v in sorted(groups.items())}
            vals = [v for v in per.values() if math.isfinite(v)]
            std = statistics.stdev(vals) if len(vals) > 1 else float("nan")
            return {"over": key, "groups": per, "std": std, "n_groups": len(vals)}
    return None


def _check_args(args: argparse.Namespace) -> None:
    """Flag combinations and dimension specs, checked before anything heavy is loaded (CLI wording)."""
    if not (args.dimension or args.reward or args.reward_config or args.fvd_real or args.fid_real or args.i3d
            or args.inception or args.clip_fid):
        raise ValueError("nothing to evaluate: give --dimension, --reward, --reward-config, --fvd-real or --fid-real")
    if bool(args.fvd_real) != bool(args.i3d):
        raise ValueError("FVD needs both --fvd-real (a folder of real videos) and --i3d (a local I3D file: "
                         "i3d_pretrained_400.pt of VideoGPT / TATS, or StyleGAN-V's i3d_torchscript.pt)")
    if bool(args.fid_real) != bool(args.inception or args.clip_fid):
        raise ValueError("FID needs --fid-real (a folder of real videos / images) and --inception (a local "
                         "pt_inception-2015-12-05-6726825d.pth) or --clip-fid (a local CLIP folder)")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    from genrl.eval.dimensions import DIMENSIONS

    for flag in ("fvd_real", "fid_real", "i3d", "inception", "clip_fid"):
        value = getattr(args, flag, None)
        if value and not Path(value).expanduser().exists():
            raise FileNotFoundError(f"--{flag.replace('_', '-')} {value!r} does not exist; give an existing local "
                                    f"path (see evaluation/README.md)")

    for text in args.dimension:
        name, path = _split_spec(text, "--dimension")
        if path and not Path(path).expanduser().exists():
            raise FileNotFoundError(f"--dimension {text!r}: {path!r} does not exist; give the local weights folder")
        cls = DIMENSIONS.get(name)
        if cls is not None and cls.needs_weights and not path:
            files = ", ".join(getattr(cls, "weight_files", {}) or ["its weights"])
            raise ValueError(f"--dimension {name} needs local weights: give --dimension {name}:/path/to/folder "
                             f"(holding {files}); see evaluation/README.md")


def _build_dimensions(specs: list[str], device: str, max_batch: int):
    from genrl.eval.dimensions import build_dimension

    dims = []
    for text in specs:
        name, path = _split_spec(text, "--dimension")
        kwargs = {"max_batch": max_batch} if path else {}
        dims.append(build_dimension(name, path=path, device=device, **kwargs))
    return dims


def _prompt_selection(mode: str, items: list[EvalItem], dims) -> dict[str, set[str] | None]:
    """dimension -> the prompts it is scored on (None = every video)."""
    if mode == "all" or not dims:
        return {d.name: None for d in dims}
    from genrl.eval.vbench import load_vbench_suite, prompts_for_dimension

    suite = load_vbench_suite()
    known = {e["prompt_en"] for e in suite}
    if mode == "auto" and not all(it.prompt in known for it in items):
        return {d.name: None for d in dims}
    if mode == "vbench":
        unknown = sorted({it.prompt for it in items if it.prompt not in known})
        if unknown:
            raise ValueError(f"--prompt-selection vbench: {len(unknown)} prompts are not in VBench's suite (e.g. "
                             f"{unknown[0]!r}); use --prompt-selection all")
    from genrl.eval.vbench import ALL_DIMENSIONS

    # VBench assigns prompts to its own dimensions only; the image-to-video ones score every video with an image
    return {d.name: set(prompts_for_dimension(d.name, suite)) if d.name in ALL_DIMENSIONS else None for d in dims}


def _reward_manager(args):
    from genrl.rewards import RewardManager
    from genrl.rewards.check import load_reward_modules, rewards_from_configs

    specs: list[Any] = []
    for text in args.reward:
        name, path = _split_spec(text, "--reward")
        specs.append({"name": name, "path": path})
    if args.reward_config:
        specs += rewards_from_configs(args.reward_config)
    if not specs:
        return None
    load_reward_modules()
    return RewardManager(specs, batch_size=args.batch_size, on_error="invalid", device=args.device)


class _Distribution:
    """FVD (clips through an I3D) and FID (frames through the FID Inception or a CLIP) of the evaluated videos
    against a folder of real ones; the real set's statistics are cached (:func:`genrl.eval.frechet.cached_stats`)."""

    def __init__(self, args, cache_dir: Path):
        self.args, self.cache_dir = args, cache_dir
        self.fvd_ext = self.fid_ext = None
        self.skipped: list[Skipped] = []
        if args.fvd_real:
            from genrl.eval.fvd import FVDSettings, load_i3d

            self.fvd_settings = FVDSettings(num_frames=args.fvd_frames, resolution=args.fvd_resolution)
            self.fvd_ext = load_i3d(args.i3d, device=args.device, resolution=args.fvd_resolution)
        if args.fid_real:
            from genrl.eval.fid import ClipImageExtractor, InceptionExtractor

            ext = InceptionExtractor(args.inception) if args.inception else ClipImageExtractor(args.clip_fid)
            self.fid_ext = ext.to(args.device)
        self.fid_frames = args.fid_frames if args.fid_frames > 0 else "all"

    def _videos(self, items: list[EvalItem], metric: str, prefix: str = ""):
        """Decoded videos of ``items``; unreadable ones (and for FVD, too short ones) are skipped and listed."""
        from genrl.eval.fvd import video_clips

        for it in items:
            try:
                frames, _ = load_video(it)
                if metric == "fvd":
                    video_clips(frames, self.fvd_settings)  # raises on a video under min_frames
                elif self.fid_frames != "all" and frames.shape[0] < self.fid_frames:
                    frames = frames[torch.linspace(0, frames.shape[0] - 1, self.fid_frames).round().long()]
            except (FileNotFoundError, ValueError) as err:
                self.skipped.append(Skipped(prefix + it.file, str(err), metric))
                continue
            yield frames

    def _stats(self, metric: str, items: list[EvalItem], prefix: str = ""):
        from genrl.eval.fid import frame_feature_stats
        from genrl.eval.fvd import video_feature_stats

        videos = self._videos(items, metric, prefix)
        if metric == "fvd":
            return video_feature_stats(self.fvd_ext, videos, self.fvd_settings, progress=sys.stderr.isatty())
        return frame_feature_stats(self.fid_ext, videos, frames_per_video=self.fid_frames,
                                   progress=sys.stderr.isatty())

    def _real_items(self, folder: str) -> list[EvalItem]:
        from evaluation.inputs import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS

        root = Path(folder)
        if not root.is_dir():
            raise FileNotFoundError(f"real-set folder {folder!r} does not exist")
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in
                       VIDEO_EXTENSIONS + IMAGE_EXTENSIONS)
        if not files:
            raise ValueError(f"real-set folder {folder!r} holds no videos / images")
        return [EvalItem(str(p.relative_to(root)), p, "") for p in files]

    def _real_stats(self, metric: str, folder: str, extractor) -> Any:
        from genrl.eval.frechet import cached_stats, extractor_identity

        items = self._real_items(folder)
        settings = {"metric": metric, "real_folder": str(Path(folder).resolve()),
                    "listing": [[it.file, it.path.stat().st_size] for it in items],
                    **(self.fvd_settings.as_dict() if metric == "fvd" else {"frames_per_video": self.fid_frames})}
        return cached_stats(self.cache_dir, extractor_identity(extractor)[1], settings,
                            lambda: self._stats(metric, items, prefix="real:"))

    def results(self, items: list[EvalItem]) -> dict[str, Any]:
        """``{"fvd": {...}, "fid": {...}}`` for the requested metrics (see :func:`genrl.eval.fvd.fvd`)."""
        out: dict[str, Any] = {}
        for metric, ext, folder in (("fvd", self.fvd_ext, self.args.fvd_real), ("fid", self.fid_ext,
                                                                                 self.args.fid_real)):
            if ext is None:
                continue
            from genrl.eval.fid import fid
            from genrl.eval.fvd import fvd

            try:
                real = self._real_stats(metric, folder, ext)
                fake = self._stats(metric, items)
            except ValueError as err:  # e.g. fewer than 2 usable clips in a set
                out[metric] = {"error": str(err)}
                continue
            out[metric] = (fvd if metric == "fvd" else fid)(real, fake)
            out[metric]["settings"] = fake.meta.get("settings")
        return out


def _progress(seq, label: str):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    seq = list(seq)
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(label, total=len(seq))
        for x in seq:
            yield x
            bar.advance(task)


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    """Run the evaluation described by the parsed arguments of :func:`parser`; returns the results dict (also
    written to ``<out>/results.json`` with the report next to it)."""
    t0 = time.perf_counter()
    _check_args(args)
    videos = Path(args.videos)
    out = Path(args.out) if args.out else videos / "eval"
    items, skipped = discover(videos, args.manifest, allow_unlisted=args.allow_unlisted, images=args.images)
    if args.limit is not None:
        items = items[: args.limit]
    if not items:
        raise ValueError(f"no usable videos in {videos} ({len(skipped)} skipped: see the reasons above)")
    dims = _build_dimensions(args.dimension, args.device, args.batch_size)
    selection = _prompt_selection(args.prompt_selection, items, dims)
    manager = _reward_manager(args)
    dist = _Distribution(args, Path(args.cache_dir) if args.cache_dir else Path.home() / ".cache" / "genrl" / "eval")

    metrics: dict[str, _Metric] = {d.name: _Metric(d.name, "dimension", info={
        "proxy": bool(d.proxy), "description": d.description, "needs_weights": bool(d.needs_weights),
        **({"needs_image": True} if d.needs_image else {}), **({"unit": d.unit} if d.unit else {})}) for d in dims}
    per_video: dict[str, dict[str, Any]] = {}
    reward_errors: dict[str, int] = defaultdict(int)
    pending: list[tuple[EvalItem, torch.Tensor]] = []

    def score_rewards(batch: list[tuple[EvalItem, torch.Tensor]]) -> None:
        groups: dict[tuple, list] = defaultdict(list)
        for it, fr in batch:
            groups[tuple(fr.shape)].append((it, fr))
        for group in groups.values():
            pixels = torch.stack([fr for _, fr in group]).float().div_(255.0)
            if args.reward_size == "generated":
                pixels = _generated_size(pixels, group[0][0])
            meta = {}
            if any(it.metadata for it, _ in group):
                meta["metadata"] = [it.metadata for it, _ in group]
            res = manager(pixels, [it.prompt for it, _ in group], **meta)
            for name, n in res.errors.items():
                reward_errors[name] += n
            for key, values in res.components.items():
                name = key.split("/")[0]
                m = metrics.setdefault(f"reward:{key}", _Metric(key, "reward"))
                for (it, _), v, ok in zip(group, values.tolist(), res.reward_valid[name].tolist()):
                    per_video[it.file].setdefault("rewards", {})[key] = v if ok else None
                    if ok and math.isfinite(v):
                        m.values[it.file] = (v, 1.0)

    for it in _progress(items, "evaluating"):
        try:
            frames, fps = load_video(it)
        except (FileNotFoundError, ValueError) as err:
            skipped.append(Skipped(it.file, f"unreadable: {err}"))
            continue
        rec = per_video[it.file] = {"file": it.file, "prompt": it.prompt, "seed": it.seed, "sample": it.sample,
                                    "fps": fps, "frames": int(frames.shape[0]), "height": int(frames.shape[2]),
                                    "width": int(frames.shape[3]), "dimensions": {}}
        image: Any = None  # the conditioning image, read once per video for the dimensions that need it
        for d in dims:
            chosen = selection[d.name]
            if chosen is not None and it.prompt not in chosen:
                continue
            if d.needs_image and image is None:
                image = _conditioning_image(it)
            if d.needs_image and isinstance(image, str):
                skipped.append(Skipped(it.file, image, d.name))
                continue
            try:
                r = d.score_video(frames, fps, image) if d.needs_image else d.score_video(frames, fps)
            except ValueError as err:  # TooFewFrames and bad input for this dimension
                skipped.append(Skipped(it.file, str(err), d.name))
                continue
            metrics[d.name].values[it.file] = (float(r.value), float(r.weight))
            rec["dimensions"][d.name] = float(r.value)
        if manager is not None:
            pending.append((it, frames))
            if len(pending) >= args.batch_size:
                score_rewards(pending)
                pending = []
    if manager is not None and pending:
        score_rewards(pending)
    evaluated = [it for it in items if it.file in per_video]
    if not evaluated:
        raise ValueError(f"none of the {len(items)} videos could be read: "
                         + "; ".join(f"{s.file}: {s.reason}" for s in skipped[:3]))

    results: dict[str, Any] = {"schema": SCHEMA, "videos": str(videos), "out": str(out), "n_videos": len(evaluated),
                               "settings": {k: v for k, v in vars(args).items() if k != "func"},
                               "dimensions": {}, "rewards": {}}
    from genrl.eval.vbench import NORMALIZATION, composites, normalize

    for d in dims:
        m = metrics[d.name]
        pairs = list(m.values.values())
        score = d.aggregate([_result(v, w) for v, w in pairs]) if pairs else float("nan")
        results["dimensions"][d.name] = {
            **m.info, "score": score, "n": len(pairs),
            "normalized": normalize(d.name, score) if math.isfinite(score) and d.name in NORMALIZATION else None,
            "prompt_selection": "vbench" if selection[d.name] is not None else "all",
            **({"note": "no video of this folder has a prompt VBench assigns to this dimension: generate its prompts "
                        f"with `pipelines/generate.py --prompts vbench:{d.name}`, or score every video with "
                        "--prompt-selection all"}
               if not pairs and selection[d.name] is not None else {}),
            "spread": _spread(m, evaluated, lambda vs, d=d: d.aggregate([_result(v, w) for v, w in vs])),
        }
    native = {k: v["score"] for k, v in results["dimensions"].items()
              if math.isfinite(v["score"]) and not v["proxy"]}
    proxied = {k: v["score"] for k, v in results["dimensions"].items() if math.isfinite(v["score"])}
    results["vbench"] = {"composites": composites(native), "composites_with_proxies": composites(proxied)}
    for m in metrics.values():
        if m.kind != "reward":
            continue
        vals = [v for v, _ in m.values.values()]
        n_scored = sum(1 for r in per_video.values() if m.name in r.get("rewards", {}))
        results["rewards"][m.name] = {
            "mean": statistics.fmean(vals) if vals else float("nan"),
            "std": statistics.stdev(vals) if len(vals) > 1 else float("nan"),
            "n_valid": len(vals), "n_invalid": n_scored - len(vals),
            "spread": _spread(m, evaluated, lambda vs: _weighted_mean(vs)),
        }
    results["reward_errors"] = dict(reward_errors)
    results["distribution"] = dist.results(evaluated)
    skipped += dist.skipped
    results["skipped"] = [s.as_dict() for s in skipped]
    results["per_video"] = [per_video[it.file] for it in evaluated]
    results["elapsed_s"] = round(time.perf_counter() - t0, 2)

    out.mkdir(parents=True, exist_ok=True)
    from genrl.data.video_io import write_json

    write_json(out / RESULTS_FILE, results, indent=1)
    if not args.no_report:
        from evaluation.report import write_report

        write_report(results, out, samples=args.report_samples)
    return results


def _conditioning_image(item: EvalItem) -> torch.Tensor | str:
    """The item's conditioning image, uint8 [3, H, W], or why there is none (a reason for the skipped list)."""
    if item.image is None:
        return ("no conditioning image: the manifest line has no 'image' (an image-to-video dimension needs the "
                "samples of pipelines/generate.py --image, or a prompt file with an 'image' per line)")
    try:
        return load_image(item.image)
    except (FileNotFoundError, ValueError) as err:
        return f"conditioning image unusable: {err}"


def _generated_size(pixels: torch.Tensor, item: EvalItem) -> torch.Tensor:
    """Undo ``write_video``'s playback enlargement: frames of [B, T, 3, H, W] that are k x the size the manifest
    records (``height`` / ``width``; k an integer) are box-averaged back to it (exact for nearest-neighbour blocks,
    up to codec error), so a reward calibrated on the generated size (e.g. the shapes verifiers) sees it."""
    h, w = item.record.get("height"), item.record.get("width")
    big_h, big_w = pixels.shape[-2:]
    if not h or not w or (big_h, big_w) == (h, w) or big_h % h or big_w % w or big_h // h != big_w // w:
        return pixels
    k = big_h // h
    b, t = pixels.shape[:2]
    small = torch.nn.functional.avg_pool2d(pixels.flatten(0, 1), k)
    return small.reshape(b, t, *small.shape[1:])


def _result(value: float, weight: float):
    from genrl.eval.dimensions import DimensionResult

    return DimensionResult(value=value, weight=weight)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``run`` command's flags."""
    p.add_argument("--videos", required=True, help="folder of videos (pipelines/generate.py --out, or VBench-named)")
    p.add_argument("--manifest", default=None, help="manifest.jsonl (default: <videos>/manifest.jsonl when present)")
    p.add_argument("--out", default=None, help="results folder (default <videos>/eval)")
    p.add_argument("--dimension", action="append", default=[],
                   help="a VBench dimension, name or name:weights_folder (repeatable); `python -m evaluation "
                        "dimensions` lists them")
    p.add_argument("--prompt-selection", choices=["auto", "vbench", "all"], default="auto",
                   help="vbench: score each dimension only on the prompts VBench assigns to it; all: on every video; "
                        "auto: vbench when every prompt of the folder is in VBench's suite, else all")
    p.add_argument("--reward", action="append", default=[], help="a reward-zoo entry, name or name:weights_folder")
    p.add_argument("--reward-config", action="append", default=[], help="take the rewards of a training config")
    p.add_argument("--reward-size", choices=["generated", "file"], default="generated",
                   help="rewards see the size the manifest records (generate.py enlarges small videos for playback; "
                        "generated undoes that) or the file's size")
    p.add_argument("--fvd-real", default=None, help="folder of real videos for FVD")
    p.add_argument("--i3d", default=None, help="local I3D file (i3d_pretrained_400.pt or i3d_torchscript.pt)")
    p.add_argument("--fvd-frames", type=int, default=16, help="frames per FVD clip")
    p.add_argument("--fvd-resolution", type=int, default=224, help="FVD clip size in pixels")
    p.add_argument("--fid-real", default=None, help="folder of real videos / images for FID")
    p.add_argument("--inception", default=None, help="local FID Inception weights (pt_inception-2015-12-05-*.pth)")
    p.add_argument("--clip-fid", default=None, help="local CLIP folder: FID on CLIP image features instead")
    p.add_argument("--fid-frames", type=int, default=8, help="frames per video for FID (0 = all)")
    p.add_argument("--cache-dir", default=None, help="real-set statistics cache (default ~/.cache/genrl/eval)")
    p.add_argument("--batch-size", type=int, default=16, help="videos per reward call / frames per model call")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N files (by name)")
    p.add_argument("--allow-unlisted", action="store_true", help="skip (and list) files without a manifest line")
    p.add_argument("--images", action="store_true", help="also evaluate .png / .jpg files (rewards and FID)")
    p.add_argument("--device", default="cpu", help="cpu / cuda")
    p.add_argument("--report-samples", type=int, default=6, help="videos shown as frame strips in the report")
    p.add_argument("--no-report", action="store_true", help="write results.json only")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m evaluation run ...`` (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python -m evaluation run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    results = evaluate(args)
    print(summary(results))
    return results


def summary(results: dict[str, Any]) -> str:
    """A few lines for the terminal (undefined metrics as ``n/a``)."""
    from evaluation.report import fmt_value

    lines = [f"evaluated {results['n_videos']} videos in {results['elapsed_s']} s -> {results['out']}"]
    for name, d in results["dimensions"].items():
        tag = " (proxy)" if d["proxy"] else ""
        if d["n"]:
            lines.append(f"  {name}{tag}: {fmt_value(d['score'])} on {d['n']} videos")
        else:
            lines.append(f"  {name}{tag}: no video scored" + (f" ({d['note']})" if d.get("note") else
                                                              " (see the skipped list)"))
    for name, r in results["rewards"].items():
        lines.append(f"  {name}: {fmt_value(r['mean'])} (n={r['n_valid']}, invalid {r['n_invalid']})")
    for name, r in results.get("distribution", {}).items():
        if "error" in r:
            lines.append(f"  {name}: {r['error']}")
        else:
            lines.append(f"  {name}: {fmt_value(r[name], 3)} ({r.get('n_real')} real vs {r.get('n_fake')} generated)")
    if results["skipped"]:
        lines.append(f"  skipped: {len(results['skipped'])} (see report)")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    try:
        main()
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
