"""The ``genrl`` command: a LightningCLI (``genrl fit|validate|test|predict --config ...``), plus two tools
dispatched before the LightningCLI is built:

* ``genrl reward-serve --reward NAME [--path P] [--kwargs JSON] [--port N]``: serve a reward on loopback for
  the ``remote`` reward (:mod:`genrl.rewards.server`);
* ``genrl rewards check --config a.yaml [--config b.yaml] | --reward NAME[:PATH]`` and ``genrl rewards list``:
  are the configured rewards registered and their weight files present (:mod:`genrl.rewards.check`; exit code
  1 when something is missing or unknown).

Any ``genrl.methods`` LightningModule is a ``model`` and any LightningDataModule a ``data`` (class_path /
init_args in YAML). Config files compose left to right (``--config a.yaml --config b.yaml``), dotted
overrides come last (``--model.cfg_scale=4``), ``--print_config`` prints the resolved typed config, and
``--ckpt_path last`` resumes the newest checkpoint of the run.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

import genrl.data  # noqa: F401  (registers genrl's datamodules for short class names)
import genrl.methods  # noqa: F401  (registers genrl's methods for short class names)

__all__ = ["GenRLCLI", "check_legacy_keys", "main"]

#: method arguments replaced by the one ``generator:`` spec (genrl's DiT is ``generator: {family: dit, ...}``).
LEGACY_KEYS = {
    "transformer": "model.init_args.generator (with family: dit, pretrained: <folder> or components: {transformer: "
                   "{...VideoDiT values}})",
    "text_encoder": "model.init_args.generator.text_encoder",
    "max_text_length": "model.init_args.generator.max_sequence_length",
}


def check_legacy_keys(args) -> None:
    """Refuse configs and overrides that use the method arguments replaced by the one generator spec, naming the new
    key (``model.init_args.transformer`` -> ``model.init_args.generator`` with ``family: dit``, and so on).

    Raises:
        ValueError: a ``--config`` file or a ``--model.init_args.<old key>`` override uses an old key.
    """
    import yaml

    argv = list(sys.argv[1:] if args is None else args)
    found: list[tuple[str, str]] = []
    for i, a in enumerate(argv):
        path = argv[i + 1] if a in ("--config", "-c") and i + 1 < len(argv) else a.split("=", 1)[1] \
            if a.startswith(("--config=", "-c=")) else None
        if path is not None and Path(path).is_file():
            cfg = yaml.safe_load(Path(path).read_text()) or {}
            init = ((cfg.get("model") or {}).get("init_args") or {}) if isinstance(cfg, dict) else {}
            found += [(k, path) for k in LEGACY_KEYS if isinstance(init, dict) and k in init]
        for k in LEGACY_KEYS:
            if a.startswith((f"--model.init_args.{k}.", f"--model.init_args.{k}=")):
                found.append((k, a.split("=", 1)[0]))
    if found:
        key, where = found[0]
        raise ValueError(f"model.init_args.{key} (in {where}) was replaced by {LEGACY_KEYS[key]}: every method "
                         f"takes one generator spec now, e.g. generator: {{family: dit, pretrained: assets/shapes-dit, "
                         f"text_encoder: minilm}} (docs/models.md)")


class GenRLCLI(LightningCLI):
    """LightningCLI with genrl's defaults: subclass mode for model and data, omegaconf interpolation,
    config saved next to the logs (overwritten on resume), optimizers configured by the methods."""

    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf"})
        check_legacy_keys(args)
        super().__init__(args=args, run=run, **kwargs)


#: ``genrl <tool> ...`` commands that are not LightningCLI subcommands: ``{argv[1]: "module:function"}``; the
#: function takes the remaining arguments and returns the exit code.
TOOLS = {
    "reward-serve": "genrl.rewards.server:main",
    "rewards": "genrl.rewards.check:main",
}


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``genrl`` console script and of ``python -m genrl``.

    ``genrl reward-serve ...`` and ``genrl rewards ...`` run their tool and exit with its code (SystemExit);
    anything else goes to the LightningCLI (``fit``, ``validate``, ``test``, ``predict``, ``--help``).
    """
    argv = list(sys.argv[1:] if args is None else args)
    if argv and argv[0] in TOOLS:
        module, func = TOOLS[argv[0]].split(":")
        raise SystemExit(getattr(importlib.import_module(module), func)(argv[1:]))

    GenRLCLI(args=args)


if __name__ == "__main__":
    main()
