"""GRPO vs RAM vs DiffusionNFT vs AWM on the shapes world, side by side (issue 10).

    python benchmarks/forward_rl_shapes.py --seeds 0 1 --grpo-steps 100 --steps 30 \
        --out benchmarks/forward_rl_shapes.json

Every run starts from the shipped model (assets/shapes-dit) with the quickstart's prompts (4 training prompts x 8
rollouts per iteration, shapes:train), reward (the exact shapes verifiers) and rollout budget (32 rollouts of 10
Euler steps, no CFG, per iteration). GRPO is the quickstart (configs/quickstart.yaml: Flow-GRPO SDE window of 3
steps); RAM, NFT and AWM are configs/ram/shapes.yaml (+ nft_shapes.yaml / awm_shapes.yaml), endpoints only. Every
``--val-every`` optimizer steps the validation reward is measured on the same 64 held-out prompts with the same
deterministic sampler (10 Euler steps, no CFG); step 0 is the base model. Reported per method and seed: the curve
(step, wall seconds, reward), the peak, the final reward, and the optimizer steps and wall time at which the run
first reaches GRPO's peak of the same seed (the held-out prompts are drawn with the data seed). Run it with nothing
else on the machine (2 CPU cores share badly).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMON = ["--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
          "--trainer.callbacks=[]", "--trainer.num_sanity_val_steps=0"]
METHODS = {
    "grpo": [str(ROOT / "configs/quickstart.yaml")],
    "ram": [str(ROOT / "configs/ram/shapes.yaml")],
    "nft": [str(ROOT / "configs/ram/shapes.yaml"), str(ROOT / "configs/ram/nft_shapes.yaml")],
    "awm": [str(ROOT / "configs/ram/shapes.yaml"), str(ROOT / "configs/ram/awm_shapes.yaml")],
}
#: overrides after the configs: GRPO as the quickstart was when RESULTS.md's figures were measured (10-step rollouts,
#: SDE window in [0, 7), lr 5e-5; the quickstart itself now trains 6-step rollouts at lr 8e-5)
OVERRIDES = {"grpo": ["--model.init_args.rollout.num_steps=10", "--model.init_args.rollout.window_end=7",
                      "--model.init_args.optimizer.init_args.lr=0.00005"]}


def run(method: str, seed: int, steps: int, val_every: int, extra: list[str]) -> dict:
    """Train one method for ``steps`` optimizer steps; returns its validation curve."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from genrl.cli import GenRLCLI

    curve: list[dict] = []

    class Recorder(Callback):
        def __init__(self):
            self.t0 = None

        def on_train_start(self, trainer, pl_module):
            self.t0 = time.perf_counter()

        def on_validation_end(self, trainer, pl_module):
            if trainer.sanity_checking:
                return
            val = trainer.callback_metrics.get("val/total")
            curve.append({"step": int(trainer.global_step), "seconds": round(time.perf_counter() - self.t0, 1)
                          if self.t0 else 0.0, "reward": float(val) if val is not None else float("nan")})

    args = [a for c in METHODS[method] for a in ("--config", c)] + OVERRIDES.get(method, []) + COMMON + [
        f"--seed_everything={seed}", f"--model.init_args.seed={seed}", f"--data.init_args.seed={seed}",
        f"--trainer.max_steps={steps}", f"--trainer.val_check_interval={val_every}",
        f"--trainer.default_root_dir=/tmp/forward_rl/{method}_{seed}", *extra]
    torch.manual_seed(seed)
    cli = GenRLCLI(args=args, run=False)
    recorder = Recorder()
    cli.trainer.callbacks.append(recorder)
    t0 = time.perf_counter()
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)  # the base model (step 0)
    curve[-1]["seconds"] = 0.0
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    wall = time.perf_counter() - t0
    rewards = [c["reward"] for c in curve]
    return {"method": method, "seed": seed, "steps": int(cli.trainer.global_step), "wall_s": round(wall, 1),
            "curve": curve, "peak": max(rewards), "final": rewards[-1]}


def reach(curve: list[dict], target: float) -> tuple[int | None, float | None]:
    """(optimizer steps, wall seconds) of the first validation at or above ``target`` (None, None if never)."""
    for c in curve:
        if c["reward"] >= target:
            return c["step"], c["seconds"]
    return None, None


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--grpo-steps", type=int, default=100)
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of RAM / NFT / AWM")
    p.add_argument("--val-every", type=int, default=5, help="validation interval of RAM / NFT / AWM")
    p.add_argument("--grpo-val-every", type=int, default=10)
    p.add_argument("--extra", default="", help='extra CLI overrides for RAM / NFT / AWM, one string: '
                   '--extra="--model.init_args.multiplier=300 --model.init_args.optimizer.init_args.lr=0.0001"')
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runs = []
    for method in args.methods:
        for seed in args.seeds:
            grpo = method == "grpo"
            r = run(method, seed, args.grpo_steps if grpo else args.steps,
                    args.grpo_val_every if grpo else args.val_every, [] if grpo else args.extra.split())
            print(json.dumps({k: v for k, v in r.items() if k != "curve"}), flush=True)
            runs.append(r)
    return summarize(runs, args.methods, vars(args), args.out)


def summarize(runs: list[dict], methods: list[str], settings: dict, out_path: str | None = None) -> dict:
    """Per method: finals, peaks, and the steps / seconds at which each seed first reaches the GRPO peak of the
    same seed (the validation prompts are drawn with the data seed, so rewards compare within a seed)."""
    grpo_peak = {r["seed"]: r["peak"] for r in runs if r["method"] == "grpo"}
    summary = {}
    for method in methods:
        rs = [r for r in runs if r["method"] == method]
        finals, peaks = [r["final"] for r in rs], [r["peak"] for r in rs]
        hits = [reach(r["curve"], grpo_peak[r["seed"]]) if r["seed"] in grpo_peak else (None, None) for r in rs]
        summary[method] = {
            "seeds": [r["seed"] for r in rs], "base": [r["curve"][0]["reward"] for r in rs],
            "final": finals, "final_mean": statistics.fmean(finals),
            "final_spread": statistics.stdev(finals) if len(finals) > 1 else None,
            "gain": [r["final"] - r["curve"][0]["reward"] for r in rs],
            "peak": peaks, "steps_to_grpo_peak": [h[0] for h in hits], "seconds_to_grpo_peak": [h[1] for h in hits],
            "s_per_step": [round(r["wall_s"] / max(r["steps"], 1), 2) for r in rs],
        }
    out = {"grpo_peak_per_seed": grpo_peak, "summary": summary, "runs": runs, "args": settings}
    print(json.dumps({"grpo_peak_per_seed": grpo_peak, "summary": summary}, indent=1))
    if out_path:
        Path(out_path).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
