"""Export a genrl generator (normally a ``genrl fit`` checkpoint) as a diffusers folder.

Examples::

    # a Wan / SD3 / FLUX / SANA run: the whole pipeline folder with the trained transformer (LoRA merged)
    python pipelines/export.py --ckpt runs/wan_grpo/checkpoints/last.ckpt --mode full --out exports/wan_grpo
    python -c "import diffusers; diffusers.WanPipeline.from_pretrained('exports/wan_grpo')"
    # only the LoRA adapter, in the diffusers LoRA format (pytorch_lora_weights.safetensors)
    python pipelines/export.py --ckpt runs/wan_grpo/checkpoints/last.ckpt --mode lora --out exports/wan_grpo_lora
    python -c "import diffusers; p = diffusers.WanPipeline.from_pretrained('/models/Wan2.1-T2V-1.3B-Diffusers'); \
        p.load_lora_weights('exports/wan_grpo_lora')"
    # genrl's shapes DiT (the quickstart): a transformer folder that generate.py and ModelSpec load
    python pipelines/export.py --ckpt runs/quickstart/checkpoints/last.ckpt --out exports/quickstart
    python pipelines/generate.py --model exports/quickstart --prompts shapes:heldout --limit 16
    # an FSDP2 run's checkpoint is a folder of shards (one per rank): the same command, on one process
    python pipelines/export.py --ckpt runs/wan_fsdp2/checkpoints/last.ckpt --mode full --out exports/wan_fsdp2
    # a checkpoint moved from another machine: the base folder it was trained from, as it is here
    python pipelines/export.py --ckpt last.ckpt --pretrained /models/Wan2.1-T2V-1.3B-Diffusers --out exports/wan

Modes:

* ``--mode full`` (the default for a run without LoRA): for a diffusers family, the pipeline folder
  (``model_index.json`` + every component) whose transformer holds the trained weights; a LoRA, if the run
  had one, is merged into the base weights (``fuse_lora``) and its layers removed (``unload_lora``), so
  the transformer has the base model's key names and ``<Family>Pipeline.from_pretrained(out)`` loads it
  as is. For genrl's DiT, the transformer's ``save_pretrained`` folder (``config.json`` +
  ``diffusion_pytorch_model.safetensors``).
* ``--mode lora`` (the default for a LoRA run): the adapter only, in the diffusers LoRA format
  (``pytorch_lora_weights.safetensors`` with the adapter config as metadata): the family pipeline's
  ``load_lora_weights(out)``; for the DiT (no pipeline class: keys without the ``transformer.`` prefix)
  ``VideoDiT.from_pretrained(base).load_lora_adapter(out, prefix=None, use_safetensors=True)``.

The EMA weights are exported when the run had the EMA callback (``--no-ema``: the raw weights). Everything is
written to a temporary folder beside ``--out`` and renamed into place at the end, so a failed export leaves
nothing half-written; an existing ``--out`` is replaced only with ``--overwrite``. ``genrl_export.json`` in the
folder records the source, mode, whether a LoRA was merged and whether EMA weights were exported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Export a genrl checkpoint as a diffusers folder (full or LoRA).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ckpt", "--model", dest="model", required=True,
                   help="a genrl fit .ckpt file or distributed-checkpoint folder (FSDP2), or any folder "
                        "generate.py takes, to re-save it")
    p.add_argument("--out", required=True, help="output folder (must not exist unless --overwrite)")
    p.add_argument("--mode", choices=["full", "lora"], default=None,
                   help="full weights (LoRA merged) or the LoRA adapter only (default: lora for LoRA runs, else full)")
    p.add_argument("--no-ema", action="store_true", help="export the raw weights, not the EMA")
    p.add_argument("--pretrained", default=None,
                   help="local base-model folder replacing the one the checkpoint recorded (moved checkpoints)")
    p.add_argument("--dtype", default="float32", help="weights dtype of the exported family components")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p


def _listing(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(f.relative_to(folder)), f.stat().st_size) for f in folder.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> dict:
    """Run the export; returns ``{"out", "mode", "kind", "lora", "ema", "files": [(relative path, bytes)]}``
    (``ema``: an EMA shadow was exported).

    Raises:
        FileExistsError: ``--out`` exists and ``--overwrite`` was not given.
        ValueError: ``--mode lora`` for a generator without a LoRA adapter (and :func:`load_generator`'s errors).
        FileNotFoundError: see :func:`genrl.models.loading.load_generator`.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    if args.pretrained is not None and not Path(args.pretrained).expanduser().is_dir():
        parser.error(f"--pretrained {args.pretrained!r} is not a folder; give the local base-model folder the "
                     f"checkpoint was trained from")
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{str(out)!r} exists; choose another --out or pass --overwrite to replace it")

    from genrl.models.generator import DiTGenerator
    from genrl.models.loading import has_lora, load_generator, readable_by_all

    gen = load_generator(args.model, torch_dtype=args.dtype, use_ema=not args.no_ema, pretrained=args.pretrained)
    lora = has_lora(gen)
    mode = args.mode or ("lora" if lora else "full")
    kind = "dit" if isinstance(gen, DiTGenerator) else gen.family
    if mode == "lora" and not lora:
        raise ValueError(f"{args.model!r} has no LoRA adapter (the run trained all weights); use --mode full")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        if mode == "lora":
            if kind == "dit":
                gen.transformer.save_lora_adapter(str(tmp))  # pytorch_lora_weights.safetensors + adapter metadata
            else:
                gen.save_lora(tmp)
        else:
            if lora:  # merge W + alpha / r * B A into the base weights and drop the adapter layers
                gen.transformer.fuse_lora(lora_scale=1.0)
                gen.transformer.unload_lora()
            if kind == "dit":
                gen.transformer.save_pretrained(str(tmp))
            else:
                gen.save_pretrained(tmp)  # the adapter's denoiser in the pipeline's slot(s) (both Wan2.2 experts)
        ema = bool(gen.load_info["ema"])
        info = dict(source=str(args.model), mode=mode, kind=kind, lora=lora, lora_merged=lora and mode == "full",
                    ema=ema, dtype=args.dtype, sampling=gen.load_info.get("sampling"))
        (tmp / "genrl_export.json").write_text(json.dumps(info, indent=2) + "\n")
        tmp.chmod(0o755)
        readable_by_all(tmp)
        if out.exists():  # --overwrite: swap, then drop the old folder
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
            old.rmdir()
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = _listing(out)
    what = {"lora": "LoRA adapter (diffusers format)",
            "full": "diffusers pipeline folder" if kind != "dit" else "genrl DiT transformer folder"}[mode]
    print(f"exported {what} of {args.model} ({kind}, {'EMA' if ema else 'raw'} weights"
          f"{', LoRA merged' if info['lora_merged'] else ''}) to {out}:")
    for name, size in files:
        print(f"  {name}  ({size / 1e6:.2f} MB)")
    return dict(out=str(out), mode=mode, kind=kind, lora=lora, ema=ema, files=files)


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        sys.exit(f"error: {e}")
