"""Sampler overhead: a rollout's wall time against the raw denoiser forwards it calls, at the same shapes.

    python benchmarks/sampler_overhead.py --model dit --out benchmarks/sampler_overhead.jsonl     # the shapes DiT
    python benchmarks/sampler_overhead.py --model wan --out benchmarks/sampler_overhead.jsonl     # tiny Wan2.1
    python benchmarks/sampler_overhead.py --model dit --noise-backend philox                      # Philox noise
    python benchmarks/sampler_overhead.py --noise-cost --out benchmarks/sampler_overhead.jsonl    # noise per step

The rollout is the quickstart's (configs/quickstart.yaml): 32 samples, 10 steps, the Flow-GRPO kernel on a 3-step
SDE window, micro-batches of 32, every step recorded (latents, noises, log-probs). The raw figure is the same number
of ``generator.velocity`` calls on the same input shapes (guided velocity's CFG doubling included), each timed
alone, text encoded once outside the timing. ``overhead = rollout / raw - 1``: everything the sampler adds (noise
draws, the step kernel and its log-prob, recording, indexing); ``overhead_vs_own_forwards`` divides by the time of
the network calls inside the same rollout instead (insensitive to a change of the machine's load between the two).
The part spent drawing noise and in the step kernel is measured by timing those functions inside the rollout. Median
of ``--repeats`` after one warm-up; one JSON line per configuration on stdout (appended to ``--out``). Run it with
nothing else on the machine.

``--noise-cost`` instead times one step's noise draw (``randn_per_sample``) per backend at the shapes world's size
(32 x 8 x 3 x 16 x 16) and at Wan2.1's (16 x 16 x 21 x 60 x 104 latents) on ``--device``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(model: str):
    """(generator, latent shape, prompts) of the benchmark: the shipped shapes DiT or a tiny diffusers family."""
    if model == "dit":
        from genrl.data.shapes import ShapesWorldConfig, heldout_prompts
        from genrl.models.loading import load_generator

        gen = load_generator(str(ROOT / "assets/shapes-dit")).eval()
        prompts = heldout_prompts(ShapesWorldConfig(), 32, seed=0)
        return gen, (8, 3, 16, 16), prompts
    from genrl.models.families import GeneratorSpec, build_generator
    from genrl.testing.families import TINY, TINY_SIZE

    gen = build_generator(GeneratorSpec(family=model, components=TINY[model], **TINY_SIZE[model])).eval()
    prompts = [f"prompt {i % 4}" for i in range(32)]
    return gen, tuple(gen.latent_shape), prompts


def measure(gen, shape, prompts, config, repeats: int) -> dict:
    """Rollout and raw-forward times (s, medians) of one configuration, with the noise / kernel share."""
    import genrl.rollout.sampler as sampler
    from genrl.rollout.sampler import call_plan, encode_cfg, rollout

    spent = {"noise": 0.0, "kernel": 0.0, "forward": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - t0
            return out
        return wrapper

    real_noise, real_step = sampler.randn_per_sample, sampler.sde_step
    n = len(prompts)
    with torch.no_grad():
        cond, uncond = encode_cfg(gen, prompts, config)  # also fills the prompt cache the rollouts read
        plan = call_plan(n, config.micro_batch_size, config.batching)
        x = torch.randn(n, *shape, generator=torch.Generator().manual_seed(0)).to(gen.device)
        sigma = torch.full((n,), 0.5, device=gen.device)
        calls = []
        for _, padded in plan:
            idx = torch.tensor(padded, device=gen.device)
            c = cond.select(padded)
            if uncond is not None:
                from genrl.models.text_encoder import Conditioning

                c = Conditioning.cat([c, uncond.select(padded)])
                idx = torch.cat([idx, idx])
            calls.append((x[idx].contiguous(), sigma[idx].contiguous(), c))

        def raw_forwards() -> float:
            total = 0.0
            for _step in range(config.num_steps):
                for xb, sb, cb in calls:
                    t0 = time.perf_counter()
                    gen.velocity(xb, sb, cb)
                    total += time.perf_counter() - t0
            return total

        rollout(gen, prompts, shape, seed=0, config=config)  # warm-up
        raw_forwards()
        walls, raws, noise_s, kernel_s, inside = [], [], [], [], []
        real_velocity = gen.velocity
        for r in range(repeats):  # interleaved, so a change in the machine's load hits both alike
            spent.update(noise=0.0, kernel=0.0, forward=0.0)
            sampler.randn_per_sample, sampler.sde_step = timed("noise", real_noise), timed("kernel", real_step)
            gen.velocity = timed("forward", real_velocity)
            try:
                t0 = time.perf_counter()
                rollout(gen, prompts, shape, seed=1 + r, config=config, rollout_id=r)
                walls.append(time.perf_counter() - t0)
            finally:
                sampler.randn_per_sample, sampler.sde_step = real_noise, real_step
                del gen.velocity
            noise_s.append(spent["noise"])
            kernel_s.append(spent["kernel"])
            inside.append(spent["forward"])
            raws.append(raw_forwards())
    wall, raw = statistics.median(walls), statistics.median(raws)
    own = statistics.median(w / f - 1 for w, f in zip(walls, inside))
    return {"rollout_s": wall, "raw_forwards_s": raw, "overhead": wall / raw - 1, "overhead_vs_own_forwards": own,
            "forwards_inside_rollout_s": statistics.median(inside),
            "noise_s": statistics.median(noise_s), "kernel_s": statistics.median(kernel_s),
            "calls_per_step": len(plan), "rollout_s_all": walls, "raw_forwards_s_all": raws}


#: (name, per-sample latent shape, samples) of the noise-cost sizes
NOISE_SIZES = (("shapes", (8, 3, 16, 16), 32), ("wan2.1_480x832x81", (16, 21, 60, 104), 16))


def noise_cost(device: str, repeats: int, sizes=NOISE_SIZES) -> list[dict]:
    """Seconds per step of ``randn_per_sample`` (median of ``repeats`` after a warm-up) per backend and size."""
    from genrl.noise import randn_per_sample

    rows = []
    for name, shape, n in sizes:
        for backend in ("generator", "philox"):
            times = []
            for r in range(repeats + 1):
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                randn_per_sample(shape, 0, range(n), step=1 + r, device=device, backend=backend)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            rows.append({"noise_cost": name, "samples": n, "latent_shape": list(shape), "backend": backend,
                         "device": device, "threads": torch.get_num_threads(),
                         "s_per_step": statistics.median(times[1:])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dit", help="'dit' (assets/shapes-dit) or a tiny family: wan, sd3, flux, sana")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--batching", default="fixed", choices=["fixed", "fast", "bucketed"])
    p.add_argument("--noise-backend", default="generator", choices=["generator", "philox"])
    p.add_argument("--cfg-scale", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    p.add_argument("--noise-cost", action="store_true", help="time the noise draw per step instead")
    p.add_argument("--device", default="cpu", help="device of --noise-cost")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.noise_cost:
        for row in noise_cost(args.device, args.repeats):
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return

    from genrl.rollout.sampler import RolloutConfig

    gen, shape, prompts = build(args.model)
    config = RolloutConfig(num_steps=args.steps, kernel="flow_grpo", noise_level=0.7, cfg_scale=args.cfg_scale,
                           sde_steps="window", num_sde_steps=3, window_end=min(7, args.steps),
                           micro_batch_size=args.micro_batch, batching=args.batching,
                           noise_backend=args.noise_backend)
    row = {"model": args.model, "latent_shape": list(shape), "samples": len(prompts), "steps": args.steps,
           "micro_batch": args.micro_batch, "batching": args.batching, "noise_backend": args.noise_backend,
           "cfg_scale": args.cfg_scale, "threads": torch.get_num_threads(),
           "params": sum(q.numel() for q in gen.parameters()), **measure(gen, shape, prompts, config, args.repeats)}
    print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
