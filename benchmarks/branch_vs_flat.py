"""Flat GRPO vs BranchGRPO vs BranchGRPO-Mix on the shapes world, side by side, at equal wall time.

    python benchmarks/branch_vs_flat.py --budget 150 --seeds 0 1 --out benchmarks/branch_vs_flat_fast.json
    python benchmarks/branch_vs_flat.py --micro-batch 8 --batching fixed --out benchmarks/branch_vs_flat.json

Every run starts from the shipped model (assets/shapes-dit) with 2 prompts per iteration and 16 leaves per prompt
(flat: a group of 16 independent rollouts; tree: factor 2, splits at steps 0, 2, 4, 6 of 10), the DanceGRPO kernel
(eta 0.3), no CFG, lr 5e-5, clip 1e-3, every stochastic step trained (the flat run trains all 10 steps, as BranchGRPO
does). Network calls: at most ``--micro-batch`` rows (default 32, the quickstart's), sized to the work
(``--batching fast``, the default: a tree's frontier of 2 nodes costs 2 rows) or padded to exactly that size
(``fixed``, bitwise batch-independent). Mix: stochastic steps 0-1 plus the split steps (training only; rollouts
still take every step).
Each run trains for ``--budget`` seconds (Lightning ``max_time``), then the verifier reward is measured on
held-out prompts with the deterministic sampler (10 Euler steps, no CFG). Prints and writes, per method: wall
time per iteration (and its ratio to flat), denoiser evaluations per iteration, iterations done, and the held-out
reward per seed with mean and spread. Run it with nothing else on the machine (2 CPU cores share badly).

With ``--batching fixed`` the sampler pads every network call to the micro-batch (bitwise reproducibility), so a tree
saves compute only where its frontier is smaller than the flat batch by whole micro-batches: with micro-batches of 32
both rollouts take 10 padded calls per iteration and the tree saves nothing on this CPU (measured 8.66 vs 8.74 s per
iteration); with 8 the tree's 154 evaluations take 21 calls against the flat run's 40 (the first round in
benchmarks/RESULTS.md). ``fast`` removes the padding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = [
    "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
    "--trainer.limit_val_batches=0", "--trainer.callbacks=[]", "--trainer.max_steps=100000",
    "--model.init_args.rollout.num_steps=10", "--model.init_args.rollout.kernel=dance_grpo",
    "--model.init_args.rollout.noise_level=0.3", "--model.init_args.rollout.cfg_scale=1.0",
    "--model.init_args.rollout.skip_last_step=false",
    "--model.init_args.optimizer.init_args.lr=0.00005", "--model.init_args.clip_range=0.001",
    "--data.init_args.prompts_per_batch=2",
]
METHODS = {
    "flat": ["--config", str(ROOT / "configs/quickstart.yaml"), "--model.init_args.rollout.sde_steps=all",
             "--data.init_args.group_size=16", "--model.init_args.advantage_std=group",
             "--model.init_args.advantage_eps=0.00000001"],
    "branch": ["--config", str(ROOT / "configs/branch_grpo/shapes.yaml")],
    "mix": ["--config", str(ROOT / "configs/branch_grpo/shapes.yaml"), "--model.init_args.tree.mix_window=2",
            "--model.init_args.tree.mix_stride=30"],
    # BranchGRPO with depth pruning of the two deepest depths (60 of 92 edges per tree trained, the paper's
    # WidPru / DepPru proportion 138 / 218): what the paper's 0.45x compares
    "pruned": ["--config", str(ROOT / "configs/branch_grpo/shapes.yaml"), "--model.init_args.prune_depths=[9, 10]"],
}


def run(method: str, seed: int, budget: float, micro_batch: int = 32, batching: str = "fast") -> dict:
    import torch

    from genrl.cli import GenRLCLI

    args = METHODS[method] + COMMON + [
        f"--model.init_args.rollout.micro_batch_size={micro_batch}", f"--model.init_args.rollout.batching={batching}",
        f"--seed_everything={seed}", f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
        f"--trainer.max_time=00:00:{int(budget) // 60:02d}:{int(budget) % 60:02d}",
        f"--trainer.default_root_dir=/tmp/branch_vs_flat/{method}_{seed}",
    ]
    cli = GenRLCLI(args=args, run=False)
    from lightning.pytorch import Callback

    class IterationTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.t0)

    timer = IterationTimes()
    cli.trainer.callbacks.append(timer)
    t0 = time.perf_counter()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall = time.perf_counter() - t0
    model = cli.model
    iters = int(model.iteration)
    metrics = {k: float(v) for k, v in cli.trainer.logged_metrics.items() if isinstance(v, (float, torch.Tensor))}
    if method == "flat":
        nfe, trained = 2 * 16 * 10, 2 * 16 * 10
    else:
        nfe, trained = int(metrics["tree/denoiser_evals"]), int(metrics["tree/edges_trained"])
    steady = timer.times[1:] or timer.times  # the first iteration also warms caches up
    return {"method": method, "seed": seed, "wall_s": wall, "iterations": iters, "s_per_iter": wall / max(iters, 1),
            "median_iter_s": statistics.median(steady),
            "nfe_per_iter": nfe, "trained_transitions_per_iter": trained, "generator": model.generator}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=150, help="training seconds per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    p.add_argument("--eval-prompts", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=32, help="most rows per network call")
    p.add_argument("--batching", default="fast", choices=["fixed", "fast", "bucketed"])
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import sys

    sys.path.insert(0, str(ROOT / "evaluation"))
    from shapes_eval import evaluate, shapes_prompts

    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401
    from genrl.data.shapes import ShapesWorldConfig
    from genrl.models.loading import load_generator

    world = ShapesWorldConfig()
    prompts = shapes_prompts(world, "heldout", args.eval_prompts, seed=0, multi_step=False)
    base = load_generator(str(ROOT / "assets/shapes-dit"))
    base_scores = [evaluate(base, world, prompts, s, 10, 1.0)["reward"] for s in args.seeds]
    rows = []
    for method in args.methods:
        for seed in args.seeds:
            r = run(method, seed, args.budget, args.micro_batch, args.batching)
            gen = r.pop("generator").eval()
            r["heldout_reward"] = evaluate(gen, world, prompts, seed, 10, 1.0)["reward"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    summary = {"base_heldout_reward": base_scores, "budget_s": args.budget, "seeds": args.seeds,
               "micro_batch": args.micro_batch, "batching": args.batching, "methods": {}}
    flat_t = statistics.mean(r["s_per_iter"] for r in rows if r["method"] == "flat") if any(
        r["method"] == "flat" for r in rows) else None
    flat_med = statistics.mean(r["median_iter_s"] for r in rows if r["method"] == "flat") if flat_t else None
    for method in args.methods:
        rs = [r for r in rows if r["method"] == method]
        rewards = [r["heldout_reward"] for r in rs]
        t = statistics.mean(r["s_per_iter"] for r in rs)
        med = statistics.mean(r["median_iter_s"] for r in rs)
        summary["methods"][method] = {
            "s_per_iter": t, "time_ratio_vs_flat": (t / flat_t) if flat_t else None, "median_iter_s": med,
            "median_ratio_vs_flat": (med / flat_med) if flat_med else None,
            "nfe_per_iter": rs[0]["nfe_per_iter"], "iterations": [r["iterations"] for r in rs],
            "heldout_reward": rewards, "mean": statistics.mean(rewards),
            "spread": statistics.stdev(rewards) if len(rewards) > 1 else 0.0,
        }
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
