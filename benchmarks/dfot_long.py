"""Diffusion forcing and history guidance on the shapes world (issue 24), second part: rollouts 4x and 8x the
model's window on the wrapping world.

    python benchmarks/dfot_long.py --seeds 0 1 --out benchmarks/dfot_long.json

1. **Fine-tune**: for each seed, ``genrl fit --config configs/dfot/shapes.yaml --config
   configs/dfot/shapes_wrap.yaml`` (``--steps`` steps of diffusion forcing from the shipped model on 8-frame clips of
   the wrapping world, where an object leaving one edge comes back at the other).
2. **Long rollouts**: for each held-out single-step caption, a real wrapping video of ``--frames`` frames (64 = 8x
   the window); its first ``--history`` frames are the history and the model generates the rest with
   ``history_rollout``'s sliding window (8 frames, ``--context`` of them kept from the previous window, so 4 new
   frames a window at the default), 10 Euler steps, under each rule of ``RULES``.
3. **Per window** (disjoint 8-frame windows, ``genrl.rewards.shapes.score_windows`` with the verifier of the
   wrapping world): verifier reward and all-correct; the centroid error of the generated frames against the real
   video's continuation (shortest distance on the torus, px); the foreground mass over the real one's (blob decay
   or blow-up); the fraction of frozen videos (moving caption, measured speed under 0.25 px / frame); network calls
   per generated frame. The summary rows average windows 1-3 (up to 4x the window: frames 8-31) and 4-7 (frames
   32-63); window 0 holds the real history.

The base model (trained on the inside world with one level per video) is evaluated too, as the reference without
diffusion forcing; it has never seen an object cross an edge.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from dfot_shapes import RULES as SHORT_RULES  # noqa: E402 (benchmarks/ is on the path from here on)

#: name -> HistoryGuidance kwargs: benchmarks/dfot_shapes.py's rules (text CFG 3 is part of every rule) that the
#: long rollouts run, plus DFoT's stabilized vanilla guidance (generated history seen at sigma 0.02)
RULES: dict[str, dict] = {
    **{name: SHORT_RULES[name] for name in ("conditional", "vanilla_w3", "vanilla_w6")},
    "stabilized_vanilla_w3": {**SHORT_RULES["vanilla_w3"], "stabilization": 0.02},
    "stabilized_conditional_0.05": {**SHORT_RULES["conditional"], "stabilization": 0.05},
    "fractional_w3_k0.4": SHORT_RULES["fractional_w3_k0.4"],
}
WINDOW = 8
FROZEN_PX_PER_FRAME = 0.25


@torch.no_grad()
def keyframe_positions(every: int, history: int, frames: int) -> list[int]:
    """Real keyframes every ``every`` frames, as aligned pairs ending there (frames 16k-2 and 16k-1 for 16), after
    the history; [] for ``every`` 0."""
    if not every:
        return []
    return [p for end in range(every, frames + 1, every) for p in (end - 2, end - 1) if p >= history]


def long_rollouts(gen, prompts, real, k, rule, steps, context, batch, keys=()):
    """Frames k.. of every video after its first k real frames, sliding an 8-frame window (``keys``: frame indices
    where the real frame is given as a keyframe); returns (decoded videos float32 [N, T, 3, H, W] in [0, 1], network
    calls per generated frame, wall seconds)."""
    from genrl.flow import HistoryGuidance
    from genrl.rollout import RolloutConfig
    from genrl.rollout.history import history_rollout

    config = RolloutConfig(num_steps=steps, kernel="ode", cfg_scale=1.0, micro_batch_size=batch)
    out, calls, t0 = [], 0.0, time.perf_counter()
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        kf = gen.encode(real[s:s + batch, list(keys)]) if keys else None
        res = history_rollout(gen, chunk, real.shape[2:], real.shape[1], 0, history=gen.encode(real[s:s + batch, :k]),
                              guidance=HistoryGuidance(**rule), config=config, window=WINDOW, context=context,
                              indices=range(s, s + len(chunk)), keyframes=kf, keyframe_positions=list(keys) or None)
        out.append(gen.decode(res.video).clamp(0, 1).cpu())
        calls = res.calls_per_frame
    return torch.cat(out), calls, round(time.perf_counter() - t0, 1)


@torch.no_grad()
def teacher_forced_errors(gen, verifier, prompts, real, k, rule, steps, batch) -> list[float]:
    """One window at a time from *real* history: for each offset s = 0, 4, 8, ... the model sees real frames
    s..s+k-1 and generates the rest of an 8-frame window; returns the mean centroid error (px, on the torus) of the
    generated frames against the real ones at each offset. The world is stationary, so this is the error one
    window adds when its history is right; the long rollout compounds it."""
    from genrl.data.shapes import position_error
    from genrl.flow import HistoryGuidance
    from genrl.rollout import RolloutConfig
    from genrl.rollout.history import history_rollout

    config = RolloutConfig(num_steps=steps, kernel="ode", cfg_scale=1.0, micro_batch_size=batch)
    errors = []
    for s in range(0, real.shape[1] - WINDOW + 1, WINDOW - k):
        err = []
        for b in range(0, len(prompts), batch):
            res = history_rollout(gen, prompts[b:b + batch], real.shape[2:], WINDOW, 0,
                                  history=gen.encode(real[b:b + batch, s:s + k]), guidance=HistoryGuidance(**rule),
                                  config=config, window=WINDOW, indices=range(b, b + len(prompts[b:b + batch])))
            g = verifier.measure(gen.decode(res.video).clamp(0, 1).cpu()[:, k:])
            r = verifier.measure(real[b:b + batch, s + k:s + WINDOW])
            both = g["nonempty"] & r["nonempty"]
            err.append(position_error(g["centroid"], r["centroid"], verifier.world)[both])
        errors.append(round(float(torch.cat(err).mean()), 4))
    return errors


def window_metrics(verifier, videos, real, prompts, keys=()) -> dict[str, list[float]]:
    """Per disjoint 8-frame window: mean reward / all-correct / direction / speed / consistency, centroid error
    (px, on the torus; over the frames not in ``keys``, the given keyframes), mass ratio (generated / real
    foreground mass) and frozen fraction among moving captions."""

    from genrl.data.shapes import parse_caption, position_error
    from genrl.rewards.shapes import score_windows, track_velocity

    scores = score_windows(verifier, videos, prompts, WINDOW)
    out: dict[str, list[float]] = {}
    for key in ("reward", "all_correct", "direction", "speed", "consistency"):
        v = scores[key].float()
        out[key] = [float(col[~torch.isnan(col)].mean()) for col in v.T]
    moving = torch.tensor([any(d != "still" for d in parse_caption(p, verifier.world).directions) for p in prompts])
    err, mass, frozen = [], [], []
    for s in range(0, videos.shape[1] - WINDOW + 1, WINDOW):
        g, r = verifier.measure(videos[:, s:s + WINDOW]), verifier.measure(real[:, s:s + WINDOW])
        both = g["nonempty"] & r["nonempty"]
        both[:, [p - s for p in keys if s <= p < s + WINDOW]] = False
        e = position_error(g["centroid"], r["centroid"], verifier.world)
        err.append(float(e[both].mean()) if both.any() else float("nan"))
        mass.append(float(g["mass"].sum() / r["mass"].sum().clamp(min=1e-8)))
        speed = track_velocity(g["track"], g["nonempty"])[0].norm(dim=-1)
        frozen.append(float((speed[moving] < FROZEN_PX_PER_FRAME).float().mean()))
    out.update(centroid_error_px=err, mass_ratio=mass, frozen_fraction=frozen)
    return out


def summary(per_window: dict[str, list[float]], windows: range) -> dict[str, float]:
    """The mean of each per-window metric over ``windows`` (NaN windows left out)."""
    out = {}
    for key, values in per_window.items():
        vals = [values[i] for i in windows if i < len(values) and values[i] == values[i]]
        out[key] = round(statistics.fmean(vals), 4) if vals else float("nan")
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, default=400, help="fine-tune steps per seed")
    p.add_argument("--mode", default="independent", choices=["independent", "history"],
                   help="diffusion_forcing of the fine-tune: an i.i.d. level per temporal patch, or a random history "
                        "prefix with i.i.d. levels and one shared level after it")
    p.add_argument("--history-frames", type=int, default=None,
                   help="--mode history: the longest history prefix (frames; default the pretrain's, 0 .. T - 2)")
    p.add_argument("--history-sigma-max", type=float, default=None,
                   help="--mode history: scale the history prefix's levels into [0, this] (clean or lightly noised)")
    p.add_argument("--models", nargs="*", default=None, help="name=export folder: skip training, use these")
    p.add_argument("--no-base", action="store_true", help="leave the base model out")
    p.add_argument("--prompts", type=int, default=32, help="held-out single-step captions")
    p.add_argument("--frames", type=int, default=64, help="frames per video (a multiple of 8; 64 = 8x the window)")
    p.add_argument("--history", type=int, default=4, help="real history frames (even, < 8)")
    p.add_argument("--context", type=int, default=4, help="frames each later window keeps from the previous one")
    p.add_argument("--steps-per-window", type=int, default=10, help="Euler steps of each window")
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    p.add_argument("--base-rules", nargs="*", default=["conditional"], choices=list(RULES),
                   help="the rules the base model is run with (it has no diffusion forcing: one is enough)")
    p.add_argument("--batch", type=int, default=32, help="prompts per call (padded to it: keep it <= --prompts)")
    p.add_argument("--keyframe-every", type=int, default=0,
                   help="give the real frames 16k-2, 16k-1 (for 16) as keyframes: the rollout interpolates towards "
                        "them (0: none)")
    p.add_argument("--teacher-forced", action="store_true",
                   help="also the per-window error from real history at every offset (conditional rule)")
    p.add_argument("--root", default="/tmp/dfot_long")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.frames % WINDOW or args.frames < 2 * WINDOW:
        p.error(f"--frames {args.frames}: use a multiple of {WINDOW}, at least {2 * WINDOW}")

    import ar_distill_shapes as ads
    from dfot_shapes import train

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.shapes import ShapesWorldConfig, real_videos
    from genrl.rewards.shapes import ShapesVerifier

    report: dict = {"args": vars(args), "threads": torch.get_num_threads(),
                    "command": "python benchmarks/dfot_long.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    models = {} if args.no_base else {"base": str(ROOT / "assets/shapes-dit")}
    if args.models is not None:
        models.update(dict(m.split("=", 1) for m in args.models))
    else:
        report["train_wall_s"] = {}
        extra, tag = (), ""
        if args.history_frames is not None:
            if args.mode != "history":
                p.error(f"--history-frames {args.history_frames} needs --mode history (got --mode {args.mode})")
            extra, tag = (f"--model.init_args.history_frames={args.history_frames}",), f"_h{args.history_frames}"
        if args.history_sigma_max is not None:
            if args.mode != "history":
                p.error(f"--history-sigma-max {args.history_sigma_max} needs --mode history (got --mode {args.mode})")
            extra += (f"--model.init_args.history_sigma_max={args.history_sigma_max}",)
            tag += f"_hmax{args.history_sigma_max:g}"
        if args.steps != 400:
            tag += f"_{args.steps}steps"
        name = "dfot_wrap" if args.mode == "independent" else f"dfot_wrap_history{tag}"
        for seed in args.seeds:
            folder, wall = train(seed, args.steps, args.mode, Path(args.root), ("configs/dfot/shapes_wrap.yaml",),
                                 extra, tag)
            models[f"{name}_s{seed}"] = folder
            report["train_wall_s"][f"{name}_s{seed}"] = wall
            print(json.dumps({"trained": f"{name}_s{seed}", "wall_s": wall}), flush=True)

    world = ShapesWorldConfig(boundary="wrap", multi_step_prob=0.0)
    verifier = ShapesVerifier(world=world)
    prompts = shapes_prompts(world, "heldout", args.prompts, seed=0, multi_step=False)
    real = real_videos(dataclasses.replace(world, num_frames=args.frames), prompts, seed=4000)
    report["real"] = window_metrics(verifier, real, real, prompts)
    keys = keyframe_positions(args.keyframe_every, args.history, args.frames)
    report["keyframes"] = keys
    n = args.frames // WINDOW
    spans = {"windows_1_3": range(1, min(4, n)), "windows_4_7": range(4, n), "last_window": range(n - 1, n)}
    report["runs"] = {}
    for name, path in models.items():
        gen = ads._load(path)
        if args.teacher_forced:
            tf = teacher_forced_errors(gen, verifier, prompts, real, args.history, RULES["conditional"],
                                       args.steps_per_window, args.batch)
            report.setdefault("teacher_forced_error_px", {})[name] = tf
            print(json.dumps({"teacher_forced": name, "error_px": tf}), flush=True)
        for rule in (args.base_rules if name == "base" else args.rules):
            videos, calls, wall = long_rollouts(gen, prompts, real, args.history, RULES[rule],
                                                args.steps_per_window, args.context, args.batch, keys)
            per_window = window_metrics(verifier, videos, real, prompts, keys)
            entry = {"per_window": per_window, "calls_per_frame": calls, "seconds": wall,
                     **{span: summary(per_window, r) for span, r in spans.items()}}
            report["runs"][f"{name}|{rule}"] = entry
            print(json.dumps({"run": f"{name}|{rule}", "calls_per_frame": calls, "seconds": wall,
                              **{span: entry[span] for span in spans}}), flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
