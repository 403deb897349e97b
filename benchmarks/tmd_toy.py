"""TMD on a 2-D toy: one outer transition (M = 1) from noise, before and after TM-MeanFlow (stage 1).

    python benchmarks/tmd_toy.py --out benchmarks/tmd_toy.json        # about 2 minutes on 1 thread
    python benchmarks/tmd_toy.py --parameterization noise --out benchmarks/tmd_toy_noise.json

Data: 8 equal Gaussians (std 0.3) on a circle of radius 4; the teacher is the mixture's exact flow-matching
velocity (genrl/testing/tmd_toy.py). The student's head starts as the teacher (gate closed), so M = 1 first gives
the blurry posterior mean (samples near the origin). Stage 1 trains backbone and head with TM-MeanFlow (inner grids
N = 1, 2, 4 in turn, (s, r) from genrl.flow.sample_inner_times, du/ds by finite differences, adaptive loss with
c = 2 and power 1); then 20k samples per N in {1, 2, 4} are drawn with genrl.rollout.transition_rollout (M = 1).

Metrics (genrl.testing.tmd_toy.mode_metrics): per-mode weights w_k = fraction of all samples nearest to mode k and
within 4 std of it; recovered modes under |w_k - 1/8| < 0.05 / 8 (5% relative, strict) and under
|w_k - 1/8| < 0.05 (absolute, the goal's criterion); the fraction of samples within 4 std of a mode; the mean
distance to the nearest mode (about 0.376 for exact samples); the mean norm (about 4.01 exact, 0 for the mean).
Goal: with N >= 2, at least 7 of 8 modes recovered (absolute criterion).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(steps: int = 4000, batch: int = 512, lr: float = 2e-3, seed: int = 0, samples: int = 20000,
        inner: tuple[int, ...] = (1, 2, 4), parameterization: str = "denoiser", log_every: int = 0) -> dict:
    """Train one toy student and evaluate it before (gate closed) and after stage 1; returns the JSON record."""
    from genrl.testing.tmd_toy import GaussianMixture2D, ToyTMDStudent, mode_metrics, sample_student, train_stage1

    torch.manual_seed(seed)
    mixture = GaussianMixture2D()
    student = ToyTMDStudent(mixture)
    rows = []
    xs, nfe = sample_student(student, samples, 1, parameterization=parameterization)
    rows.append({"stage": "gate closed (teacher)", "M": 1, "N": 1, "effective_nfe": nfe, **mode_metrics(xs, mixture)})
    start = time.perf_counter()
    losses = train_stage1(student, steps=steps, batch=batch, lr=lr, seed=seed, inner_choices=inner,
                          parameterization=parameterization, log_every=log_every)
    train_s = time.perf_counter() - start
    for n in inner:
        xs, nfe = sample_student(student, samples, n, parameterization=parameterization)
        rows.append({"stage": "after stage 1", "M": 1, "N": n, "effective_nfe": nfe, **mode_metrics(xs, mixture)})
    goal = all(r["recovered_abs"] >= 7 for r in rows if r["stage"] == "after stage 1" and r["N"] >= 2)
    return {
        "command": "python benchmarks/tmd_toy.py " + " ".join(sys.argv[1:]),
        "config": {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "samples": samples, "inner": list(inner),
                   "parameterization": parameterization, "loss": "adaptive, c = 2, power 1", "threads":
                   torch.get_num_threads(), "student_parameters": sum(p.numel() for p in student.parameters())},
        "train_seconds": round(train_s, 1),
        "final_loss": round(sum(losses[-100:]) / min(100, len(losses)), 5),
        "rows": rows,
        "goal_met": goal,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=20000)
    p.add_argument("--parameterization", choices=("denoiser", "noise"), default="denoiser")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    record = run(args.steps, args.batch, args.lr, args.seed, args.samples, parameterization=args.parameterization,
                 log_every=args.log_every)
    print(f"{'stage':<22} {'N':>2} {'eNFE':>5} {'rec 5%rel':>9} {'rec .05abs':>10} {'max|dw|':>8} {'in-mode':>8} "
          f"{'dist':>6} {'|x|':>6}")
    for r in record["rows"]:
        print(f"{r['stage']:<22} {r['N']:>2} {r['effective_nfe']:>5.2f} {r['recovered_rel']:>9} "
              f"{r['recovered_abs']:>10} {r['max_abs_error']:>8.4f} {r['in_mode']:>8.3f} {r['mean_dist']:>6.3f} "
              f"{r['mean_norm']:>6.3f}")
    print(f"train {record['train_seconds']} s, goal (N >= 2: >= 7 of 8 modes, absolute 0.05): {record['goal_met']}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return record


if __name__ == "__main__":
    main()
