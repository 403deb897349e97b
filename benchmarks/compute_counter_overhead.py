"""What ComputeCounter's hooks cost on a forward of the shapes DiT.

    OMP_NUM_THREADS=1 python benchmarks/compute_counter_overhead.py [--batch 16] [--calls 30] [--repeats 3]

Times the median of ``--calls`` no-grad forwards of ``assets/shapes-dit`` (batch ``--batch``, 8 x 3 x 16 x 16 latents)
without hooks and with the counter's hooks on the network and on each of its blocks (as ``genrl fit`` installs them,
counting on), alternating ``--repeats`` times so that a drift of the machine's load hits both alike. Prints one line
per repeat and a JSON summary (milliseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from genrl.callbacks.compute import ComputeCounter, _block_lists
from genrl.models import VideoDiT

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dit = VideoDiT.from_pretrained(ROOT / "assets/shapes-dit").eval()
    x = torch.randn(args.batch, 8, 3, 16, 16)
    sigma = torch.rand(args.batch)
    text = torch.randn(args.batch, 8, dit.config.text_dim)

    def median_ms() -> float:
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            with torch.no_grad():
                dit(x, sigma, text)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    counter = ComputeCounter()
    counter._counting = True  # as between on_train_start and on_train_end
    blocks = _block_lists(dit)
    out = {"plain_ms": [], "hooked_ms": [], "blocks": len(blocks), "batch": args.batch}
    median_ms()  # warm-up
    for rep in range(args.repeats):
        out["plain_ms"].append(round(median_ms(), 2))
        depth, seen = [0], set()
        counter._hook_pass(dit, "generator", 1.0, depth, 1, seen)
        for block in blocks:
            counter._hook_pass(block, "generator", 1.0 / len(blocks), depth, None, seen, block=True)
        out["hooked_ms"].append(round(median_ms(), 2))
        counter._remove()
        counter._pending.clear()
        print(f"repeat {rep}: {out['plain_ms'][-1]} ms without hooks, {out['hooked_ms'][-1]} ms with", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
