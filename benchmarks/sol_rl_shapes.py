"""Sol-RL vs the same objective without a preview, at equal training wall-clock on this CPU (shapes world, issue 21).

    python benchmarks/sol_rl_shapes.py --seeds 0 1 --budget 420 --val-every 3 --out benchmarks/sol_rl_shapes.json

Both arms are configs/sol_rl/shapes.yaml (DiffusionNFT, 4 prompts per iteration, 6 grid timesteps per sample, old
policy rolling out, lr 5e-5, gradient clip 1), from the shipped model:

* ``sol_rl``: a pool of 32 candidates per prompt previewed in 6 steps by a bfloat16 copy of the old policy (2x faster
  than float32 per step on this AMX CPU), the 4 best and 4 worst regenerated in float32 with 10 steps and trained on;
* ``baseline``: ``preview: null``, ``group_size: 8``: 8 float32 rollouts of 10 steps per prompt, all trained on.

So both train on 32 samples per iteration; Sol-RL pays for 128 extra cheap previews. Each run stops when its
training clock (the time inside training steps, validation excluded) passes ``--budget`` seconds; every
``--val-every`` iterations the held-out verifier reward (the exact shapes verifiers on 64 held-out prompts, ODE 10
steps, no CFG, same noise for every run of a seed) is measured, and at step 0. Reported per run: the curve (step,
training seconds, reward), the best reward and the training seconds at which Sol-RL first reaches the baseline's
best reward of the same seed (the speed-up is the ratio of those times). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
          "--trainer.callbacks=[]", "--trainer.num_sanity_val_steps=0", "--trainer.max_steps=1000"]
ARMS = {"sol_rl": [], "baseline": ["--model.init_args.preview=null", "--data.init_args.group_size=8"]}


def run(arm: str, seed: int, budget: float, val_every: int) -> dict:
    """Train one arm until its training clock passes ``budget`` seconds; returns its validation curve."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from genrl.cli import GenRLCLI

    curve: list[dict] = []

    class Clock(Callback):
        """Training time = the sum of training-step durations; stops the run past the budget."""

        def __init__(self) -> None:
            self.train_s, self.t = 0.0, None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.train_s += time.perf_counter() - self.t
            if self.train_s >= budget:
                trainer.should_stop = True

        def on_validation_end(self, trainer, pl_module):
            val = trainer.callback_metrics.get("val/total")
            curve.append({"step": int(trainer.global_step), "train_s": round(self.train_s, 1),
                          "reward": float(val) if val is not None else float("nan")})

    args = ["--config", str(ROOT / "configs/sol_rl/shapes.yaml"), *COMMON, f"--seed_everything={seed}",
            f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
            f"--trainer.val_check_interval={val_every}", f"--trainer.default_root_dir=/tmp/sol_rl_bench/{arm}_{seed}",
            *ARMS[arm]]
    torch.manual_seed(seed)
    cli = GenRLCLI(args=args, run=False)
    clock = Clock()
    cli.trainer.callbacks.append(clock)
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)  # the base model, step 0
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if curve[-1]["step"] != int(cli.trainer.global_step):  # the last iterations since the previous validation
        cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    rewards = [c["reward"] for c in curve]
    m = cli.trainer.callback_metrics
    fidelity = {k: float(m[k]) for k in ("preview/spearman", "preview/top_overlap", "preview/bottom_overlap",
                                         "preview/seconds") if k in m}
    return {"arm": arm, "seed": seed, "steps": int(cli.trainer.global_step), "train_s": round(clock.train_s, 1),
            "s_per_step": round(clock.train_s / max(int(cli.trainer.global_step), 1), 2), "curve": curve,
            "best": max(rewards), "final": rewards[-1], "last_fidelity": fidelity}


def first_reach(curve: list[dict], target: float) -> tuple[int | None, float | None]:
    for c in curve:
        if c["reward"] >= target:
            return c["step"], c["train_s"]
    return None, None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--budget", type=float, default=420.0, help="training seconds per run")
    p.add_argument("--val-every", type=int, default=3)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runs = []
    for seed in args.seeds:
        for arm in args.arms:
            r = run(arm, seed, args.budget, args.val_every)
            print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
            runs.append(r)
    summary = {}
    for seed in args.seeds:
        by = {r["arm"]: r for r in runs if r["seed"] == seed}
        if "baseline" in by and "sol_rl" in by:
            target = by["baseline"]["best"]
            b_step, b_s = first_reach(by["baseline"]["curve"], target)
            s_step, s_s = first_reach(by["sol_rl"]["curve"], target)
            summary[seed] = {"baseline_best": target, "sol_rl_best": by["sol_rl"]["best"],
                             "baseline_reaches_at": [b_step, b_s], "sol_rl_reaches_at": [s_step, s_s],
                             "speedup": round(b_s / s_s, 2) if s_s else None}
    finals = {arm: [r["final"] for r in runs if r["arm"] == arm] for arm in args.arms}
    out = {"summary": summary, "final_mean": {a: statistics.fmean(v) for a, v in finals.items() if v},
           "runs": runs, "args": vars(args)}
    print(json.dumps({"summary": summary, "final_mean": out["final_mean"]}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
