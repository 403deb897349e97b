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
``--ckpt_path last`` resumes the newest checkpoint of the run. Every ``fit`` counts its training compute
(:class:`~genrl.callbacks.ComputeCounter`: ``<default_root_dir>/compute.json``); ``--compute_budget FE`` stops it at
the end of the first iteration whose total reaches FE forward-equivalents.
"""

from __future__ import annotations

import difflib
import importlib
import math
import re
import sys
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_warn

import genrl.data  # noqa: F401  (registers genrl's datamodules for short class names)
import genrl.methods  # noqa: F401  (registers genrl's methods for short class names)
import genrl.strategies  # noqa: F401  (FSDP2Strategy by its short class name)
from genrl.callbacks import ComputeCounter, InterruptCheckpoint, SamplingRecord, StepProgressBar, newest_last_checkpoint

__all__ = ["GenRLArgumentParser", "GenRLCLI", "check_legacy_keys", "main", "suggest_keys"]

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


def _parser_keys(parser) -> set[str]:
    """Every option key of ``parser`` and of its subcommand parsers (``trainer.max_steps``, ``ckpt_path``...)."""
    keys: set[str] = set()
    for action in getattr(parser, "_actions", []):
        if isinstance(action.dest, str) and action.dest not in ("help", "config", "print_config"):
            keys.add(action.dest)
        for sub in (getattr(action, "_name_parser_map", None) or {}).values():
            keys |= _parser_keys(sub)
    return keys


def _class_keys(class_path: str) -> set[str]:
    """The init argument names of ``class_path`` as jsonargparse reads them (its parents' through ``**kwargs``)."""
    try:
        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        from jsonargparse import ArgumentParser

        p = ArgumentParser(exit_on_error=False)
        p.add_class_arguments(cls, fail_untyped=False)
        return {k.split(".", 1)[0] for k in _parser_keys(p)}
    except Exception:  # noqa: BLE001 - suggestions are a courtesy: none rather than a second error
        return set()


def suggest_keys(message: str, parser=None) -> list[tuple[str, list[str]]]:
    """The unknown config keys a jsonargparse error ``message`` names, each with the closest valid keys
    (``difflib`` over the parser's keys, or over the init arguments of the class the message names).

    Example: ``"Subcommand 'fit' does not accept option 'trainer.max_stepz'"`` ->
    ``[("trainer.max_stepz", ["trainer.max_steps", ...])]``.
    """
    found: list[tuple[str, list[str]]] = []
    parser_keys = _parser_keys(parser) if parser is not None else set()
    for m in re.finditer(r"(?:does not accept option|unrecognized arguments:)\s+'?(--)?([\w.\-]+)", message):
        found.append((m.group(2), _closest(m.group(2), parser_keys)))
    owners = [(m.start(), m.group(1)) for m in re.finditer(r'Parser key "([\w.]+)"', message)]
    for m in re.finditer(r"class_path '([\w.]+)':\s*\n?\s*(?:Option|Key) '([\w.]+)' is not (?:accepted|expected)",
                         message):
        # nested components: every parser key named before the class (model -> weighting -> ...) is a level
        chain = [key for pos, key in owners if pos < m.start()]
        prefix = "".join(f"{key}.init_args." for key in chain)
        keys = _class_keys(m.group(1))
        found.append((prefix + m.group(2), [prefix + k for k in _closest(m.group(2), keys)]))
    return found


def _closest(bad: str, keys: set[str], n: int = 3) -> list[str]:
    parent, _, leaf = bad.rpartition(".")
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    close = [siblings[k] for k in difflib.get_close_matches(leaf, list(siblings), n=n, cutoff=0.6)]
    return close or difflib.get_close_matches(bad, sorted(keys), n=n, cutoff=0.6)


class GenRLArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, with errors that lead with the problem: ``error: <what>``, then for an unknown key
    the closest valid keys (``did you mean``), then jsonargparse's details and a one-line usage hint (instead of
    the whole usage block first)."""

    def error(self, message: str, ex: Exception | None = None):
        """Print the error (unknown keys with suggestions first) and exit with code 2; raise like jsonargparse
        when ``exit_on_error`` is off or its debug mode is on."""
        from jsonargparse._common import debug_mode_active

        if not self.exit_on_error or debug_mode_active():
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        lines = [f"error: {message.strip().splitlines()[0] if message.strip() else message}"]
        for key, close in suggest_keys(message, self):
            lines.append(f"  unknown key {key!r}" + (f"; did you mean: {', '.join(close)}?" if close else ""))
        rest = message.strip().splitlines()[1:]
        lines += rest
        prog = parser.prog.replace(" [options]", "")
        lines.append(f"usage: {prog} --config FILE.yaml [--KEY=VALUE ...]; all options: {prog} --help")
        sys.stderr.write("\n".join(lines) + "\n")
        self.exit(2)


def _accelerator_problem(name) -> str | None:
    """Why ``trainer.accelerator: <name>`` cannot run here (with the fix), or None when it can."""
    if not isinstance(name, str) or name == "auto":
        return None
    from lightning.pytorch.accelerators import AcceleratorRegistry, CUDAAccelerator, MPSAccelerator

    key = name.lower()
    if key == "gpu":
        available = CUDAAccelerator.is_available() or MPSAccelerator.is_available()
    elif key in AcceleratorRegistry:
        available = AcceleratorRegistry[key]["accelerator"].is_available()
    else:
        return None  # Lightning names the valid ones itself
    if available:
        return None
    return (f"trainer.accelerator={name} but this machine has no {'GPU' if key in ('gpu', 'cuda') else key} "
            f"available; add --trainer.accelerator=cpu (or --trainer.accelerator=auto) to run here")


class GenRLCLI(LightningCLI):
    """LightningCLI with genrl's defaults: subclass mode for model and data, omegaconf interpolation,
    config saved next to the logs (overwritten on resume), optimizers configured by the methods; on every run a
    :class:`~genrl.callbacks.ComputeCounter` (training compute in forward-equivalents, ``compute.json`` in the run's
    ``default_root_dir``; ``--compute_budget`` stops the run once it is spent), an
    :class:`~genrl.callbacks.InterruptCheckpoint` (Ctrl-C / SIGTERM save a resumable checkpoint and print the resume
    command) and a :class:`~genrl.callbacks.SamplingRecord` (checkpoints record the validation sampler); errors that
    lead with the problem (:class:`GenRLArgumentParser`); and an accelerator that is not available here refused
    before any model is built."""

    def __init__(self, args=None, run: bool = True, **kwargs) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf"})
        kwargs.setdefault("parser_class", GenRLArgumentParser)
        defaults = dict(kwargs.get("trainer_defaults") or {})
        callbacks = defaults.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        # the resume command repeats the arguments (a CLI built with run=False is used as `fit`)
        argv = None if args is None else [*([] if run else ["fit"]), *args]
        # the counter first: its end-of-batch hook folds the iteration's counts before an interrupt checkpoint
        self._default_counter = ComputeCounter()
        defaults["callbacks"] = [*callbacks, self._default_counter, InterruptCheckpoint(argv=argv), SamplingRecord()]
        kwargs["trainer_defaults"] = defaults
        check_legacy_keys(args)
        super().__init__(args=args, run=run, **kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Lightning's trainer, with :class:`~genrl.callbacks.StepProgressBar` in place of the rich progress bar
        Lightning adds by default (the training bar counts ``global_step`` of ``max_steps``, resumed runs
        included); a progress bar given in ``trainer.callbacks`` is kept as it is, and so is a
        :class:`~genrl.callbacks.ComputeCounter` given there (it replaces the default one: one counter per run)."""
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        # a copy: Lightning extends the configured list in place and the Trainer appends its default bar to it
        configured = list(configured) if isinstance(configured, list) else [configured]
        if any(isinstance(c, ComputeCounter) for c in configured):  # Lightning refuses two of a stateful callback
            self.trainer_defaults["callbacks"] = [c for c in self.trainer_defaults.get("callbacks", [])
                                                  if c is not self._default_counter]
        trainer = super().instantiate_trainer(**kwargs)
        bar = trainer.progress_bar_callback
        if type(bar) is RichProgressBar and not any(bar is c for c in configured):
            trainer.callbacks[trainer.callbacks.index(bar)] = StepProgressBar()
        return trainer

    def before_fit(self) -> None:
        """Refuse to resume a distributed (FSDP2) checkpoint folder on a strategy that cannot read it, naming the
        profile that can, instead of Lightning's ``IsADirectoryError``; give ``--compute_budget`` to the run's
        :class:`~genrl.callbacks.ComputeCounter`."""
        problem = _resume_problem(self.trainer, self._get(self.config, "ckpt_path"))
        if problem:
            raise SystemExit(f"genrl fit: {problem}")
        budget = self._get(self.config, "compute_budget")
        if budget is not None:
            for callback in self.trainer.callbacks:
                if isinstance(callback, ComputeCounter):
                    callback.budget = float(budget)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--run_dir", type=str | None, default=None,
                            help="put this run in another folder: every path under the config's "
                                 "trainer.default_root_dir (logger save_dir, checkpoint and export dirpaths) moves "
                                 "under run_dir, so a variant of a recipe does not overwrite the recipe's run")
        parser.add_argument("--compute_budget", type=float | None, default=None,
                            help="stop training at the end of the first iteration whose total compute reaches this "
                                 "many forward-equivalents (one forward of the policy's network over one training "
                                 "sample; a backward counts two; docs/evaluation.md, Counting compute); > 0")

    def before_instantiate_classes(self) -> None:
        """Refuse an accelerator this machine does not have (e.g. ``gpu`` without CUDA) before the model is built,
        naming the fix ``--trainer.accelerator=cpu``, and a ``--compute_budget`` that is not a finite number > 0
        (naming the value); apply ``--run_dir`` (:func:`relocate_run`), or warn when a moved
        ``trainer.default_root_dir`` leaves logger / checkpoint folders behind (:func:`stray_run_paths`)."""
        problem = _accelerator_problem(self._get(self.config, "trainer", default={}).get("accelerator"))
        if problem:
            self._parser(self.subcommand).error(problem)
        budget = self._get(self.config, "compute_budget")
        if budget is not None and not (math.isfinite(budget) and budget > 0):
            self._parser(self.subcommand).error(
                f"--compute_budget must be a finite number of forward-equivalents > 0, got {budget}; e.g. "
                f"--compute_budget 5000 (a run's compute.json reports what its iterations cost)")
        run_dir = self._get(self.config, "run_dir")
        config = self.config[self.subcommand] if self.subcommand else self.config
        if run_dir:
            relocate_run(config.trainer, str(run_dir))
        elif stray := stray_run_paths(config.trainer):
            rank_zero_warn(
                f"trainer.default_root_dir is {config.trainer.default_root_dir}, but {'; '.join(stray)} lie outside "
                f"it: this run's files would mix with another run's. To move the whole run use --run_dir "
                f"{config.trainer.default_root_dir} instead of --trainer.default_root_dir (or set those paths too)")


def _run_paths(trainer):
    """``(key, init_args, field, value)`` of every logger ``save_dir`` and callback ``dirpath`` in the parsed trainer
    config (a namespace; logger / callbacks as class_path + init_args entries)."""
    for group, field in (("logger", "save_dir"), ("callbacks", "dirpath")):
        entries = getattr(trainer, group, None)
        entries = entries if isinstance(entries, list) else [entries]
        for i, entry in enumerate(entries):
            args = getattr(entry, "init_args", None)
            value = getattr(args, field, None) if args is not None else None
            if isinstance(value, str) and value:
                yield f"trainer.{group}[{i}].{field}", args, field, value


def _under(path: str, root: Path) -> bool:
    p = Path(path)
    return p == root or root in p.parents


def relocate_run(trainer, run_dir: str) -> list[str]:
    """Move a run's folders: ``trainer.default_root_dir`` becomes ``run_dir``, and every logger ``save_dir`` and
    callback ``dirpath`` under the old root moves under ``run_dir`` (the same relative path). Paths outside the old
    root (e.g. a pretrained model from another run) are left alone. ``trainer``: the parsed trainer config (a
    namespace; logger / callbacks as class_path + init_args entries). Returns the changed keys.

    Raises:
        ValueError: the config has no ``trainer.default_root_dir`` to move from.
    """
    old = getattr(trainer, "default_root_dir", None)
    if not old:
        raise ValueError("--run_dir needs a trainer.default_root_dir in the config (the folder whose paths it moves)")
    old_path, new_path = Path(str(old)), Path(run_dir)
    changed = ["trainer.default_root_dir"]
    trainer.default_root_dir = str(new_path)
    for key, args, field, value in list(_run_paths(trainer)):
        if _under(value, old_path):
            setattr(args, field, str(new_path / Path(value).relative_to(old_path)))
            changed.append(key)
    return changed


def stray_run_paths(trainer) -> list[str]:
    """``"key = value"`` of every logger ``save_dir`` / callback ``dirpath`` of the parsed trainer config that is not
    under its ``trainer.default_root_dir`` ([] when the config has none). Every shipped config keeps them under it,
    so a stray path means the root was moved in part (``--trainer.default_root_dir`` without ``--run_dir``): that
    run's checkpoints or logs would land in, and mix with, another run's folder."""
    root = getattr(trainer, "default_root_dir", None)
    if not root:
        return []
    return [f"{key} = {value}" for key, _, _, value in _run_paths(trainer) if not _under(value, Path(str(root)))]


def _resume_problem(trainer: Trainer, ckpt_path: str | None) -> str | None:
    """Why ``trainer`` cannot resume ``ckpt_path`` (``"last"``: the newest ``last*.ckpt`` in the folders of the run's
    checkpoint callbacks, as Lightning resolves it), or None: a distributed checkpoint folder needs a model-parallel
    strategy (genrl's FSDP2)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from genrl.models.loading import is_distributed_checkpoint

    if not ckpt_path or isinstance(trainer.strategy, ModelParallelStrategy):
        return None
    if ckpt_path == "last":
        path = newest_last_checkpoint(*(cb.dirpath for cb in trainer.checkpoint_callbacks
                                        if getattr(cb, "dirpath", None)))
    else:
        path = Path(ckpt_path)
    if path is None or not is_distributed_checkpoint(path):
        return None
    return (f"{path} is a distributed checkpoint (a folder of shards written by FSDP2); resume it under the FSDP2 "
            f"strategy, on any number of processes: add --config configs/trainer/fsdp2.yaml (GPUs) or --config "
            f"configs/trainer/cpu_fsdp2.yaml --trainer.devices=1 (CPU); or export its weights with python "
            f"pipelines/export.py --ckpt {path} --out <folder>")


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
