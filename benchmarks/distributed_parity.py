"""Figures of the multi-process runs on this CPU: how far DDP, FSDP2 and context-parallel runs (2 gloo processes,
launched with torchrun) end from the single-process run of the same recipe, and what each FSDP2 rank holds.

    python benchmarks/distributed_parity.py --out benchmarks/distributed_parity.json

It runs the slow multi-process tests (``pytest -m slow tests/test_distributed.py``, about 4 minutes on 2 cores) in
a kept temporary folder, then reads what their ``RunRecorder`` callbacks wrote: for every method folder
``<method>_<strategy>/rec`` the largest parameter difference to ``<method>_one`` after the same optimizer steps,
and the parameter elements per rank under FSDP2. Prints a markdown table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _max_diff(a: dict, b: dict) -> float:
    keys = [k for k in a if k in b and a[k].is_floating_point()]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def collect(base: Path) -> list[dict]:
    """One row per run folder that has a single-process sibling: method, strategy, max |param difference|, elements
    per rank of the policy (local, whole) under FSDP2."""
    rows = []
    for rec in sorted(base.rglob("rec/params.pt")):
        run = rec.parent.parent
        method, _, strategy = run.name.rpartition("_")
        one = run.parent / f"{method}_one" / "rec" / "params.pt"
        if strategy == "one" or not one.is_file():
            continue
        row = {"method": method, "strategy": strategy, "folder": run.parent.name,
               "max_param_diff": _max_diff(torch.load(rec), torch.load(one))}
        numel = run / "rec" / "numel_rank0.json"
        if numel.is_file():
            row["numel_rank0"] = json.loads(numel.read_text()).get("generator")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--basetemp", default=None, help="folder for the runs (default: a new temporary folder)")
    args = p.parse_args(argv)
    base = Path(args.basetemp or tempfile.mkdtemp(prefix="genrl_distributed_"))
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", str(ROOT / "tests/test_distributed.py"),
                    f"--basetemp={base}"], cwd=ROOT, check=True)
    rows = collect(base)
    print("| method | strategy | max abs parameter difference to 1 process | policy elements on rank 0 "
          "(local / whole) |")
    print("|---|---|---|---|")
    for r in rows:
        numel = r.get("numel_rank0")
        print(f"| {r['method']} | {r['strategy']} | {r['max_param_diff']:.2e} | "
              f"{f'{numel[0]:,} / {numel[1]:,}' if numel else ''} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
