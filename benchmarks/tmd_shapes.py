"""TMD on the shapes world: stage 1 (TM-MeanFlow) and stage 2 (DMD2-v with flow-head rollout) from the shipped model,
then the student at M in {1, 2} outer x N in {1, 2, 4} inner steps next to the teacher.

    python benchmarks/tmd_shapes.py --seeds 0 1 --out benchmarks/tmd_shapes.json
    python benchmarks/tmd_shapes.py --no-train --models s0=<export> ... --out ...     # evaluate given exports only

Each training seed runs ``configs/tmd/shapes_meanflow.yaml`` (``--stage1-steps``) and then
``configs/tmd/shapes_dmd.yaml`` (``--stage2-steps``) from its export, in ``--root``/<seed>/.
Evaluation uses the protocol of ``benchmarks/ar_distill_shapes.py`` (256 held-out single-step prompts, sampling
seed = training seed, the exact verifier, ``fd_pix`` to real videos of the same prompts in a 32-d pixel PCA space,
frames per second of sampling +
decoding on this CPU), so the rows compare with its DMD student and teacher rows in benchmarks/RESULTS.md. Effective
NFE is M (1 + (N - 1) H / L) = M (1 + (N - 1) / 4) for the shapes model (L = 4, H = 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

GRID = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4)]


def train(seed: int, root: Path, steps1: int, steps2: int, overrides: tuple[str, ...] = (),
          stage2_overrides: tuple[str, ...] = (), stage1_root: Path | None = None) -> dict:
    """Stage 1 then stage 2 for one seed (``overrides``: further ``--key=value`` arguments of both runs,
    ``stage2_overrides`` of stage 2 only; ``stage1_root``: take stage 1's export from that earlier ``--root``
    instead of training it); returns their exports and wall seconds."""
    from fit_runs import fit_in

    common = [f"--seed_everything={seed}", f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
              "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false",
              "--data.init_args.num_workers=0", *overrides]
    if stage1_root is not None:
        s1, w1 = (stage1_root / f"s{seed}" / "meanflow/runs/tmd_shapes_meanflow/export").resolve(), 0.0
        if not s1.is_dir():
            raise FileNotFoundError(f"--stage1-root {stage1_root}: no stage-1 export at {s1}")
    else:
        s1, w1 = fit_in(root / f"s{seed}" / "meanflow", [
            "fit", "--config", str(ROOT / "configs/tmd/shapes_meanflow.yaml"),
            f"--model.init_args.generator.pretrained={ROOT / 'assets/shapes-dit'}", f"--trainer.max_steps={steps1}",
            *common])
    s2, w2 = fit_in(root / f"s{seed}" / "dmd", [
        "fit", "--config", str(ROOT / "configs/tmd/shapes_dmd.yaml"), f"--model.init_args.generator.pretrained={s1}",
        f"--model.init_args.head_init={s1}", f"--model.init_args.teacher.pretrained={ROOT / 'assets/shapes-dit'}",
        f"--trainer.max_steps={steps2}", *common, *stage2_overrides])
    return {"meanflow": str(s1), "meanflow_seconds": w1, "dmd": s2, "dmd_seconds": w2}


@torch.no_grad()
def sample_tmd(student, gen, prompts, world, seed, config, batch) -> torch.Tensor:
    from genrl.rollout.transition import transition_rollout

    shape = (world.num_frames, 3, world.height, world.width)
    out = []
    for s in range(0, len(prompts), batch):
        chunk = prompts[s:s + batch]
        res = transition_rollout(student, gen.encode_prompts(chunk), shape, seed, torch.arange(s, s + len(chunk)),
                                 config)
        out.append(gen.decode(res.latents).cpu())
    return torch.cat(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--stage1-steps", type=int, default=400)
    p.add_argument("--stage2-steps", type=int, default=300)
    p.add_argument("--root", default="runs/tmd_shapes_bench")
    p.add_argument("--override", action="append", default=[],
                   help="a further genrl fit argument for both stages, e.g. --override=--model.init_args.gate_init=0")
    p.add_argument("--stage2-override", action="append", default=[],
                   help="a further genrl fit argument for stage 2 only, e.g. "
                        "--stage2-override=--model.init_args.gan_weight=0.03")
    p.add_argument("--stage1-root", default=None, help="reuse the stage-1 exports of an earlier --root (per seed)")
    p.add_argument("--no-train", action="store_true", help="evaluate --models only")
    p.add_argument("--models", nargs="*", default=[], help="name=export folder of a TMD run (evaluated per seed "
                                                           "listed in the name's suffix _s<seed>, else seed 0)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--teacher", action="store_true", help="also evaluate the teacher (20 Euler steps, CFG 3)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from ar_distill_shapes import _score, _summary, sample_teacher

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.eval.gold import PixelFD, real_videos
    from genrl.flow.tmd import effective_nfe
    from genrl.methods.tmd import load_transition_model
    from genrl.rewards.shapes import ShapesVerifier
    from genrl.rollout.transition import TransitionConfig

    world = ShapesWorldConfig()
    verifier = ShapesVerifier(world=world)
    prompts = shapes_prompts(world, "heldout", args.num_prompts, seed=0, multi_step=False)
    fd = PixelFD(real_videos(world, [prompts[i % len(prompts)] for i in range(2048)], seed=1000))
    real_a = real_videos(world, prompts, seed=2000)
    result = {"num_prompts": len(prompts), "seeds": args.seeds, "threads": torch.get_num_threads(), "runs": {},
              "models": {}, "command": "python benchmarks/tmd_shapes.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv)}
    exports: dict[str, dict[int, str]] = {}
    if not args.no_train:
        for seed in args.seeds:
            run = train(seed, Path(args.root), args.stage1_steps, args.stage2_steps, tuple(args.override),
                        tuple(args.stage2_override), Path(args.stage1_root) if args.stage1_root else None)
            result["runs"][str(seed)] = run
            print(f"seed {seed}: stage 1 {run['meanflow_seconds']:.0f} s, stage 2 {run['dmd_seconds']:.0f} s",
                  flush=True)
            if not args.stage1_root:  # a reused stage 1 was evaluated with its own run
                exports.setdefault("meanflow", {})[seed] = run["meanflow"]
            exports.setdefault("dmd", {})[seed] = run["dmd"]
    for spec in args.models:
        name, path = spec.split("=", 1)
        base, _, tail = name.rpartition("_s")
        seed = int(tail) if base and tail.isdigit() else 0
        exports.setdefault(base if base and tail.isdigit() else name, {})[seed] = path

    def record(name: str, per_seed: list, fds: list, secs: float, frames: int, nfe: float) -> None:
        entry = {"scores": _summary(per_seed), "fd_pix": statistics.fmean(fds), "fps_cpu": frames / secs,
                 "effective_nfe": nfe}
        result["models"][name] = entry
        s = entry["scores"]
        spread = (lambda k: f"±{s[k]['std']:.3f}") if len(per_seed) > 1 else (lambda k: " (1 seed)")
        print(f"{name:>18s}: NFE {nfe:5.2f}  reward {s['reward']['mean']:.3f}{spread('reward')}  all-correct "
              f"{s['all_correct']['mean']:.3f}{spread('all_correct')}  fd_pix {entry['fd_pix']:.1f}  "
              f"{entry['fps_cpu']:.0f} frames/s", flush=True)

    if args.teacher:
        from ar_distill_shapes import _load

        teacher = _load(str(ROOT / "assets/shapes-dit"))
        per_seed, fds, secs, frames = [], [], 0.0, 0
        for seed in args.seeds:
            t0 = time.perf_counter()
            videos = sample_teacher(teacher, prompts, world, seed, 20, 3.0, args.batch)
            secs += time.perf_counter() - t0
            frames += videos.shape[0] * videos.shape[1]
            per_seed.append(_score(verifier, videos, prompts))
            fds.append(fd.distance(videos, real_a))
        record("teacher_20x2", per_seed, fds, secs, frames, 40.0)

    for stage, by_seed in exports.items():
        loaded = {seed: load_transition_model(path, text_encoder="minilm") for seed, path in by_seed.items()}
        for m, n in GRID:
            per_seed, fds, secs, frames = [], [], 0.0, 0
            for seed, (gen, student, cfg) in loaded.items():
                config = TransitionConfig(outer_steps=m, inner_steps=n, outer_shift=cfg.outer_shift,
                                          inner_shift=cfg.inner_shift, t_max=cfg.t_max,
                                          parameterization=cfg.parameterization, micro_batch_size=args.batch)
                t0 = time.perf_counter()
                videos = sample_tmd(student, gen, prompts, world, seed, config, args.batch)
                secs += time.perf_counter() - t0
                frames += videos.shape[0] * videos.shape[1]
                per_seed.append(_score(verifier, videos, prompts))
                fds.append(fd.distance(videos, real_a))
            any_student = next(iter(loaded.values()))[1]
            record(f"{stage}_M{m}N{n}", per_seed, fds, secs, frames,
                   effective_nfe(m, n, any_student.head_layers, any_student.num_layers))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
