"""Rollout and GRPO training-step time of the shipped shapes DiT, eager against ``torch.compile`` (issue 19).

    python benchmarks/compile_rollout.py                                   # inductor, default mode
    python benchmarks/compile_rollout.py --modes default,max-autotune-no-cudagraphs --out compile.json
    python benchmarks/compile_rollout.py --cold                            # time a cold compile (empty caches)

The setting is the quickstart's (configs/quickstart.yaml): ``assets/shapes-dit`` with the real MiniLM encoder, 32
samples (4 prompts x 8) x 10 Flow-GRPO steps with a 3-step SDE window, one micro-batch of 32, no CFG. The compiled
policy is a copy of the eager one's weights, compiled in place as ``generator.compile`` does
(:func:`genrl.models.compile.compile_generator`).

What it measures, per variant (eager, then each compile mode):

- ``first_rollout_s``: the first rollout (iteration 0); for a compiled variant it includes the compilation, and
  ``compile_s`` is that minus the steady rollout time; ``warmup_graphs``: graphs dynamo compiled during it;
- ``rollout_s``: ``--iterations`` more rollouts (iterations 1.., each with its own seed, SDE window, prompts and
  sample ids), the eager and compiled ones interleaved so both see the same machine load; ``samples_per_s`` from
  their mean; ``recompiles``: graphs compiled during them (0 = one graph serves every iteration);
- ``max_abs_diff``: the largest difference of the final latents from the eager rollout of the same iteration;
- ``train_*`` (unless ``--no-train``): one GRPO update's network work on a recorded rollout: for each of the 3 SDE
  steps, the recomputed log-prob (forward with gradients, full fine-tuning as the quickstart) and its backward;
  the optimizer step is not included. Same first / steady / recompile split.

Compiled graphs are kept on disk by inductor (its FX-graph cache, by default under the system temp folder), so a
second run compiles faster: ``inductor_cache`` gives the cache hits and misses of this run, and ``--cold`` points the
caches at an empty temporary folder. One JSON line on stdout (``--out`` also writes it). ``loadavg`` (1-minute load
before and after; the script itself adds about its thread count) shows whether other work shared the machine.

Run time on 2 cores with nothing else running: about 2 minutes when the caches hold the graphs (a second run), about
4.5 minutes cold (the first run, or ``--cold``: the training graph's forward + backward is most of the compilation);
``--no-train`` drops the training part.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="assets/shapes-dit")
    p.add_argument("--modes", default="default",
                   help="comma-separated inductor modes compared with eager, e.g. default,max-autotune-no-cudagraphs")
    p.add_argument("--backend", default="inductor", help="eager / aot_eager: trace only (checks the script)")
    p.add_argument("--iterations", type=int, default=3, help="steady-state rollouts / training steps per variant")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--no-train", action="store_true", help="skip the training-step timing")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cold", action="store_true", help="compile with empty inductor / autograd caches")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = _parse(argv)
    if args.cold:  # before torch is imported: inductor reads it when it first compiles
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="genrl-inductor-")
    start = time.perf_counter()
    load_start = os.getloadavg()[0]

    import torch
    from torch._dynamo.utils import counters

    from genrl.data.prompts import load_prompts
    from genrl.models.compile import CompileCounter, compile_generator
    from genrl.models.generator import DiTGenerator
    from genrl.models.loading import load_generator
    from genrl.rollout import RolloutConfig, rollout, transition_log_prob

    if args.threads:
        torch.set_num_threads(args.threads)
    config = RolloutConfig(num_steps=args.steps, kernel="flow_grpo", noise_level=0.7, cfg_scale=1.0,
                           sde_steps="window", num_sde_steps=min(3, args.steps - 1), window_start=0,
                           window_end=min(7, args.steps),
                           micro_batch_size=args.micro_batch)
    shape = (8, 3, 16, 16)
    eager = load_generator(args.model)
    eager.transformer.requires_grad_(True)
    variants = {"eager": eager}
    # inductor: one variant per mode; another backend (eager, aot_eager: a quick check of the script) has no modes
    modes = [m for m in args.modes.split(",") if m] if args.backend == "inductor" else [args.backend]
    for mode in modes:
        gen = DiTGenerator(copy.deepcopy(eager.transformer), eager.text_encoder)
        options = {"mode": mode} if args.backend == "inductor" else {"backend": args.backend}
        variants[mode if args.backend == "inductor" else f"backend={mode}"] = compile_generator(gen, options,
                                                                                             where="compile")
    records = [r.prompt for r in load_prompts("shapes:train")]
    per_group = args.samples // args.group

    def batch(it: int) -> tuple[list[str], range]:
        picked = [records[(it * per_group + j) % len(records)] for j in range(per_group)]
        return [p for p in picked for _ in range(args.group)], range(it * args.samples, (it + 1) * args.samples)

    def timed_rollout(gen, it: int):
        prompts, ids = batch(it)
        with CompileCounter() as c:
            t0 = time.perf_counter()
            traj = rollout(gen, prompts, shape, seed=1000 + it, indices=ids, config=config, rollout_id=it)
            seconds = time.perf_counter() - t0
        return traj, seconds, c.graphs

    def timed_train(gen, traj):
        gen.transformer.train()
        with CompileCounter() as c:
            t0 = time.perf_counter()
            cond = gen.encode_prompts(traj.prompts)
            for k in traj.sde_steps:
                log_prob, _, _ = transition_log_prob(gen, traj, k, cond, None)
                (-log_prob.mean() / len(traj.sde_steps)).backward()
            seconds = time.perf_counter() - t0
        gen.transformer.zero_grad(set_to_none=True)
        gen.transformer.eval()
        return seconds, c.graphs

    out: dict = {name: {} for name in variants}
    trajs: dict[int, object] = {}
    finals: dict[int, torch.Tensor] = {}
    # warm-up: iteration 0 (compiles), then the steady iterations interleaved across variants
    for name, gen in variants.items():
        traj, seconds, graphs = timed_rollout(gen, 0)
        out[name].update(first_rollout_s=round(seconds, 3), warmup_graphs=graphs)
        if name == "eager":
            trajs[0], finals[0] = traj, traj.final
        else:
            out[name]["max_abs_diff"] = float((traj.final - finals[0]).abs().max())
    for name in variants:
        out[name].update(rollout_s=[], recompiles=0)
    for it in range(1, args.iterations + 1):
        for name, gen in variants.items():
            traj, seconds, graphs = timed_rollout(gen, it)
            out[name]["rollout_s"].append(round(seconds, 3))
            out[name]["recompiles"] += graphs
            if name == "eager":
                trajs[it], finals[it] = traj, traj.final
            else:
                out[name]["max_abs_diff"] = max(out[name]["max_abs_diff"],
                                                float((traj.final - finals[it]).abs().max()))
    if not args.no_train:
        for name, gen in variants.items():
            seconds, graphs = timed_train(gen, trajs[0])
            out[name].update(train_first_s=round(seconds, 3), train_warmup_graphs=graphs, train_step_s=[],
                             train_recompiles=0)
        for it in range(1, args.iterations + 1):
            for name, gen in variants.items():
                seconds, graphs = timed_train(gen, trajs[it])
                out[name]["train_step_s"].append(round(seconds, 3))
                out[name]["train_recompiles"] += graphs

    for name, r in out.items():
        r["rollout_mean_s"] = round(sum(r["rollout_s"]) / len(r["rollout_s"]), 3)
        r["samples_per_s"] = round(args.samples / r["rollout_mean_s"], 2)
        if name != "eager":
            r["compile_s"] = round(r["first_rollout_s"] - r["rollout_mean_s"], 1)
            r["rollout_speedup"] = round(out["eager"]["rollout_mean_s"] / r["rollout_mean_s"], 3)
        if not args.no_train:
            r["train_mean_s"] = round(sum(r["train_step_s"]) / len(r["train_step_s"]), 3)
            if name != "eager":
                r["train_compile_s"] = round(r["train_first_s"] - r["train_mean_s"], 1)
                r["train_speedup"] = round(out["eager"]["train_mean_s"] / r["train_mean_s"], 3)

    result = {
        "benchmark": "compile_rollout", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": args.model, "params_m": round(sum(p.numel() for p in eager.transformer.parameters()) / 1e6, 2),
        "samples": args.samples, "steps": args.steps, "micro_batch": args.micro_batch,
        "iterations": args.iterations, "backend": args.backend, "cold": args.cold,
        "inductor_cache": {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
        "variants": out,
        "loadavg": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - start, 1),
    }
    line = json.dumps(result)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return result


if __name__ == "__main__":
    main()
