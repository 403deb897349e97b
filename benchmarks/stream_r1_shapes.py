"""DMD vs Stream-R1 (inter only, intra only, both) on the shapes world, and the shapes video reward's agreement with
the exact verifier (issue 22).

    python benchmarks/stream_r1_shapes.py --student runs/ode_init_shapes/export --seeds 0 1 --iterations 300 \
        --out benchmarks/stream_r1_shapes.json

Every arm starts from the same ODE-init student (``--student``: the export of configs/ode_init/shapes.yaml) and runs
``--iterations`` DMD iterations of configs/dmd/shapes.yaml (critic every iteration, generator every 5th), the
Stream-R1 arms with configs/stream_r1/shapes.yaml composed on top (``inter: false`` / ``intra: false`` for the
ablations); each arm's student is exported and evaluated by benchmarks/ar_distill_shapes.py (the exact verifier's
reward, all-correct and per-attribute rates, temporal consistency, a Frechet distance to real shapes videos, frames
per second) at the trained 4-step schedule on ``--num-prompts`` held-out prompts.

``--agreement N`` first samples N held-out videos with the student (4 steps) and reports the Spearman rank
correlation of each ``shapes_video`` dimension with the exact verifier's reward, all-correct and consistency.
Run it with nothing else on the machine (each arm takes about 6 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

ARMS = {
    "dmd": [],
    "stream_r1": ["--config", str(ROOT / "configs/stream_r1/shapes.yaml")],
    "inter_only": ["--config", str(ROOT / "configs/stream_r1/shapes.yaml"),
                   "--model.init_args.weighting.init_args.intra=false"],
    "intra_only": ["--config", str(ROOT / "configs/stream_r1/shapes.yaml"),
                   "--model.init_args.weighting.init_args.inter=false"],
}


def train(arm: str, seed: int, student: str, iterations: int, root: Path) -> tuple[str, float]:
    """Train one arm in its own folder (the configs' relative run paths land there); returns (its export folder,
    wall seconds)."""
    from fit_runs import fit_in

    args = ["fit", "--config", str(ROOT / "configs/dmd/shapes.yaml"), *ARMS[arm],
            f"--model.init_args.generator.pretrained={Path(student).resolve()}",
            f"--model.init_args.teacher.pretrained={ROOT / 'assets/shapes-dit'}", f"--seed_everything={seed}",
            f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}", f"--trainer.max_steps={iterations}",
            "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false", "--trainer.logger=false"]
    return fit_in(root / f"{arm}_s{seed}", args)


def agreement(student: str, n: int, seed: int = 0) -> dict:
    """Spearman of each shapes_video dimension with the exact verifier's keys over ``n`` student videos."""
    import ar_distill_shapes as ads
    import torch

    from evaluation.shapes_eval import shapes_prompts
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.flow.selection import spearman
    from genrl.models.causal import CausalConfig
    from genrl.rewards import ShapesVerifier, ShapesVideoReward
    from genrl.rollout.autoregressive import ChunkSchedule

    world = ShapesWorldConfig()
    prompts = shapes_prompts(world, "heldout", n, seed=seed, multi_step=False)
    causal = CausalConfig(2)
    gen = ads._load(student, causal)
    schedule = ChunkSchedule(causal=causal, timesteps=ads._timesteps(4), shift=1.0)
    videos = ads.sample_student(gen, prompts, world, seed, schedule, 64)
    exact = ShapesVerifier(world)(videos, prompts)
    soft = ShapesVideoReward(world)(videos, prompts)
    out = {}
    for dim in ("visual_quality", "motion_quality", "text_alignment", "reward"):
        out[dim] = {key: round(spearman(soft[dim].double(), exact[key].double()), 3)
                    for key in ("reward", "all_correct", "consistency")}
    out["n"] = n
    out["exact_reward_mean"] = float(exact["reward"].mean())
    out["soft_means"] = {d: float(torch.nanmean(soft[d])) for d in ("visual_quality", "motion_quality",
                                                                     "text_alignment")}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student", default="runs/ode_init_shapes/export")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--agreement", type=int, default=256, help="videos for the agreement study (0: skip)")
    p.add_argument("--root", default="/tmp/stream_r1_bench")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import ar_distill_shapes as ads

    report: dict = {"args": vars(args)}
    if args.agreement:
        report["agreement"] = agreement(args.student, args.agreement)
        print(json.dumps({"agreement": report["agreement"]}), flush=True)
    students, walls = [], {}
    for seed in args.seeds:
        for arm in args.arms:
            folder, wall = train(arm, seed, args.student, args.iterations, Path(args.root))
            walls[f"{arm}_s{seed}"] = wall
            students += ["--student", f"{arm}_s{seed}={folder}"]
            print(json.dumps({"trained": f"{arm}_s{seed}", "wall_s": wall}), flush=True)
    report["train_wall_s"] = walls
    report["eval"] = ads.main([*students, "--steps", "4", "--num-prompts", str(args.num_prompts), "--seeds", "0"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
