"""Ranking fidelity of low-precision / few-step previews on the shapes world (Sol-RL, issue 21).

    python benchmarks/sol_rl_fidelity.py --prompts 12 --pool 32 --keep 8 --out benchmarks/sol_rl_fidelity.json

The shipped base model (assets/shapes-dit) samples ``--prompts`` held-out prompts x ``--pool`` candidates (noise
addressed by seed and sample index) with the deterministic sampler, no CFG. The reference is the float32 model with
10 steps; each preview is a rollout copy (genrl.models.quantized: bf16, simulated FP8 / NVFP4 / MXFP4 / MXFP8, or
float32 itself) with 10, 6 or 4 steps. All samples are scored by the exact shapes verifiers. Reported per preview:
Spearman of preview vs reference rewards per prompt (mean over prompts), the best-k / worst-k overlaps with k =
keep / 2 (Sol-RL keeps the keep/2 best and keep/2 worst), the mean |reward difference| and the wall seconds of the
preview's sampling (this CPU; the simulated formats are slower than float32 by construction, they measure error, not
speed). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ["fp32", "bf16", "fake_fp8", "fake_mxfp8", "fake_nvfp4", "fake_mxfp4"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--keep", type=int, default=8)
    p.add_argument("--steps", type=int, nargs="+", default=[10, 6, 4])
    p.add_argument("--formats", nargs="+", default=FORMATS)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from genrl.data.prompts import load_prompts
    from genrl.flow.selection import proxy_fidelity
    from genrl.methods.common import Scorer
    from genrl.models.families import build_generator
    from genrl.models.quantized import RolloutPrecision
    from genrl.models.roles import RolloutCopy, swapped_transformer
    from genrl.rollout.sampler import RolloutConfig, rollout

    torch.manual_seed(args.seed)
    gen = build_generator({"family": "dit", "pretrained": str(ROOT / "assets/shapes-dit"), "text_encoder": "minilm"})
    gen.eval()
    records = load_prompts("shapes:heldout")[: args.prompts]
    prompts = [r.prompt for r in records for _ in range(args.pool)]
    index = torch.arange(len(prompts))
    scorer = Scorer([{"name": "shapes", "weight": 1.0}])
    scorer.build()
    latent = (8, 3, 16, 16)

    def sample(steps: int) -> tuple[torch.Tensor, float]:
        cfg = RolloutConfig(num_steps=steps, kernel="ode", cfg_scale=1.0, micro_batch_size=args.micro_batch)
        t0 = time.perf_counter()
        with torch.no_grad():
            x0 = rollout(gen, prompts, latent, args.seed, index, cfg, record=False).final
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            rewards = scorer(gen.decode(x0), prompts).total.float()
        return rewards.reshape(args.prompts, args.pool), seconds

    reference, ref_s = sample(10)
    rows = [{"format": "fp32 (reference)", "steps": 10, "seconds": round(ref_s, 1)}]
    print(json.dumps(rows[0]), flush=True)
    live = gen.transformer
    for fmt in args.formats:
        copy_ = RolloutCopy(live, RolloutPrecision(fmt))
        for steps in args.steps:
            if fmt == "fp32" and steps == 10:
                continue
            with swapped_transformer(gen, copy_.module):
                rewards, seconds = sample(steps)
            fid = proxy_fidelity(rewards, reference, max(1, args.keep // 2))
            row = {"format": fmt, "steps": steps, "spearman": round(fid["spearman"], 3),
                   "top_overlap": round(fid["top_overlap"], 3), "bottom_overlap": round(fid["bottom_overlap"], 3),
                   "mean_abs_reward_diff": round(float((rewards - reference).abs().mean()), 4),
                   "seconds": round(seconds, 1), "quantized_linears": len(copy_.report.replaced)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = {"args": vars(args), "candidates": len(prompts), "reference_reward_mean": float(reference.mean()),
           "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
