"""Behaviour kept across a refactor: the first logged losses / rewards of the shapes configs at a fixed seed.

Runs each shapes config (the shipped base model, the real MiniLM text encoder, CPU) for a few optimizer steps
through the real CLI with a callback that records every scalar logged at each training batch, and writes them to
a JSON file. ``--compare OLD.json`` then prints, per run, the largest absolute difference to an earlier record
(0.0 means bit-identical) and exits 1 when one exceeds ``--atol``.

    python benchmarks/seam_parity.py --out runs/seam_parity/before.json            # on the commit before
    python benchmarks/seam_parity.py --out runs/seam_parity/after.json --compare runs/seam_parity/before.json

The distillation runs (DMD, AFD) start their student from the base model (the ODE-init export is not needed);
AFD's teacher folder is written once by pipelines/generate.py (8 shapes prompts, the base model, 20 steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: run name -> (config files composed left to right, extra dotted overrides, max_steps)
RUNS: dict[str, tuple[list[str], list[str], int]] = {
    "quickstart": (["configs/quickstart.yaml"], [], 3),
    "branch_grpo": (["configs/branch_grpo/shapes.yaml"], [], 3),
    "ram": (["configs/ram/shapes.yaml"], [], 2),
    "nft": (["configs/ram/shapes.yaml", "configs/ram/nft_shapes.yaml"], [], 2),
    "awm": (["configs/ram/shapes.yaml", "configs/ram/awm_shapes.yaml"], [], 2),
    "dmd": (["configs/dmd/shapes.yaml"], ["@student=assets/shapes-dit", "--model.init_args.rewards=[{name: shapes}]",
                                          "--data.init_args.prompts_per_batch=4"], 7),
    "afd": (["configs/afd/shapes.yaml"], ["@student=assets/shapes-dit", "--data.init_args.folder=@teacher",
                                          "--data.init_args.prompts_per_batch=4"], 6),
    "pretrain": (["configs/pretrain/shapes.yaml"], ["--data.init_args.num_workers=0",
                                                    "--data.init_args.batch_size=8"], 3),
}


def _policy_key(config: Path) -> str:
    """``transformer`` (the pre-seam key of genrl's DiT) or ``generator``, whichever the config uses."""
    text = config.read_text()
    return "transformer" if "\n    transformer:" in text else "generator"


def _teacher_folder(out: Path) -> str:
    folder = out / "teacher"
    if not (folder / "manifest.jsonl").is_file():
        from pipelines.generate import main as generate

        generate(["--model", str(ROOT / "assets/shapes-dit"), "--prompts", "shapes:train", "--limit", "8",
                  "--steps", "20", "--cfg-scale", "3", "--out", str(folder), "--device", "cpu"])
    return str(folder)


def run(name: str, out: Path) -> list[dict[str, float]]:
    """Train run ``name`` for its steps in ``out / name`` and return the scalars logged at each training batch."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from genrl.cli import GenRLCLI

    configs, extra, steps = RUNS[name]
    key = _policy_key(ROOT / configs[0])
    args = []
    for c in configs:
        args += ["--config", str(ROOT / c)]
    for a in extra:
        if a.startswith("@student="):
            a = f"--model.init_args.{key}.pretrained={ROOT / a.split('=', 1)[1]}"
        a = a.replace("@teacher", _teacher_folder(out)) if "@teacher" in a else a
        args.append(a)
    args += [f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
             "--trainer.enable_progress_bar=false", "--trainer.logger=false", "--trainer.enable_checkpointing=false",
             "--trainer.callbacks=[]", "--trainer.accelerator=cpu"]
    records: list[dict[str, float]] = []

    class Capture(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            records.append({k: float(v) for k, v in sorted(trainer.callback_metrics.items())
                            if torch.is_tensor(v) and v.numel() == 1})

    import genrl.data  # noqa: F401
    import genrl.methods  # noqa: F401

    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(run_dir)
    try:
        cli = GenRLCLI(args=args, run=False)
        cli.trainer.callbacks.append(Capture())
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        os.chdir(cwd)
    return records


def compare(new: dict, old: dict, atol: float) -> bool:
    """Print the largest |new - old| per run (over the keys both logged); True when all are within ``atol``."""
    ok = True
    for name in new:
        if name not in old:
            print(f"{name:12s} not in the old record")
            continue
        worst, where, missing = 0.0, "", set()
        for step, (a, b) in enumerate(zip(new[name], old[name])):
            missing |= set(b) ^ set(a)
            for k in set(a) & set(b):
                if math.isnan(a[k]) and math.isnan(b[k]):
                    continue
                d = abs(a[k] - b[k])
                if d > worst or math.isnan(d):
                    worst, where = d, f"step {step} {k}"
        same_len = len(new[name]) == len(old[name])
        flag = "ok" if (worst <= atol and same_len) else "DIFFERS"
        ok &= flag == "ok"
        print(f"{name:12s} {len(new[name])} batches, max |diff| {worst:.3g} ({where or '-'}) {flag}"
              + (f"; keys only in one record: {sorted(missing)}" if missing else "")
              + ("" if same_len else f"; batches {len(new[name])} vs {len(old[name])}"))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/seam_parity/record.json")
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    p.add_argument("--compare", default=None, help="an earlier record to compare with")
    p.add_argument("--atol", type=float, default=1e-6)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ.get("GENRL_THREADS", "2")))
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {}
    for name in a.runs:
        t0 = time.time()
        record[name] = run(name, out.parent)
        print(f"{name}: {len(record[name])} batches in {time.time() - t0:.1f} s", flush=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")
    if a.compare:
        return 0 if compare(record, json.loads(Path(a.compare).read_text()), a.atol) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
