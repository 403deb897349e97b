"""Time training steps of genrl's small video DiT on this machine (forward + backward + AdamW step).

    python benchmarks/step_time.py --batch 32 --steps 6

Prints seconds per step (excluding the first, warm-up step) and samples per second.
"""

from __future__ import annotations

import argparse
import time

import torch

from genrl.models.dit import VideoDiT


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--text-tokens", type=int, default=32)
    args = p.parse_args()
    model = VideoDiT(hidden_size=args.hidden, num_layers=args.layers)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(args.batch, args.frames, 3, args.size, args.size)
    text = torch.randn(args.batch, args.text_tokens, 384)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        model(x, torch.rand(args.batch), text).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    per_step = sum(times[1:]) / max(1, len(times) - 1)
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e6:.2f}M params, batch {args.batch}: {per_step:.3f} s/step, {args.batch / per_step:.1f} samples/s "
          f"(torch threads {torch.get_num_threads()})")


if __name__ == "__main__":
    main()
