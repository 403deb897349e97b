"""Forward time of the shipped shapes DiT's rollout copies on this CPU, per precision (Sol-RL, issue 21).

    python benchmarks/rollout_precision_speed.py --batch 32 --reps 5 --out benchmarks/rollout_precision_speed.json

One velocity call of the shipped model (assets/shapes-dit, latents [B, 8, 3, 16, 16], 256 tokens per sample) with
each rollout copy of genrl.models.quantized (fp32 = the policy itself, bf16, the simulated formats) and, for
comparison, torchao's int8 dynamic-activation / int8-weight quantization of every Linear (``quantize_`` with
``Int8DynamicActivationInt8WeightConfig``): median ms of ``--reps`` calls after one warm-up, the speed-up over fp32
and the relative L2 error of the velocity. Also one refresh of each copy (seconds). Run with nothing else on the
machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--formats", nargs="+", default=["bf16", "fake_fp8", "fake_mxfp8", "fake_nvfp4", "fake_mxfp4"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from genrl.models.families import build_generator
    from genrl.models.quantized import RolloutPrecision, build_rollout_module, refresh_rollout_module
    from genrl.models.roles import swapped_transformer

    gen = build_generator({"family": "dit", "pretrained": str(ROOT / "assets/shapes-dit"), "text_encoder": "minilm"})
    gen.eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 8, 3, 16, 16, generator=g)
    sigma = torch.full((args.batch,), 0.5)
    cond = gen.encode_prompts(["a red circle moving left slowly"] * args.batch)

    def timed() -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            v = gen.velocity(x, sigma, cond)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                v = gen.velocity(x, sigma, cond)
                times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times), v.float()

    ref_ms, ref = timed()
    rows = [{"format": "fp32 (policy)", "ms": round(ref_ms, 1), "speedup": 1.0, "rel_err": 0.0}]
    print(json.dumps(rows[-1]), flush=True)
    live = gen.transformer
    for fmt in args.formats:
        precision = RolloutPrecision(fmt)
        module, report = build_rollout_module(live, precision)
        with swapped_transformer(gen, module):
            ms, v = timed()
        refresh = refresh_rollout_module(module, live, precision)["seconds"]
        rows.append({"format": fmt, "ms": round(ms, 1), "speedup": round(ref_ms / ms, 2),
                     "rel_err": round(float((v - ref).norm() / ref.norm()), 5), "refresh_s": round(refresh, 4),
                     "quantized_linears": len(report.replaced)})
        print(json.dumps(rows[-1]), flush=True)
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

        q = copy.deepcopy(live)
        quantize_(q, Int8DynamicActivationInt8WeightConfig())
        with swapped_transformer(gen, q):
            ms, v = timed()
        rows.append({"format": "torchao int8 dynamic (W8A8)", "ms": round(ms, 1), "speedup": round(ref_ms / ms, 2),
                     "rel_err": round(float((v - ref).norm() / ref.norm()), 5)})
    except Exception as err:  # noqa: BLE001 - report, do not fail the other rows
        rows.append({"format": "torchao int8 dynamic (W8A8)", "error": f"{type(err).__name__}: {err}"[:200]})
    print(json.dumps(rows[-1]), flush=True)
    out = {"batch": args.batch, "tokens_per_sample": 256, "threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
