"""``genrl rewards check``: are the rewards of a config registered, and are their weight files in place?
(A missing file is reported before any training starts; docs/rewards.md, The zoo.)

Usage::

    genrl rewards check --config configs/quickstart.yaml --config my_overrides.yaml
    genrl rewards check --reward pickscore:/weights/pickscore --reward ocr
    genrl rewards list

``--config`` files compose like the training CLI's: later files override earlier ones (a later
``model.init_args.rewards`` list replaces an earlier one), and omegaconf interpolations are resolved. The
rewards are read from ``model.init_args.rewards`` (GRPO and the other RL methods) and
``model.init_args.val_rewards`` (pretraining). ``--reward name[:path]`` checks rewards given directly.

Nothing is built or loaded: the check reads each class's ``weight_files`` (``{relative path or glob: what
it is}``) and looks for them under the reward's ``path``. It prints one row per expected file::

    reward     registered  path               file                 status
    pickscore  yes         /weights/pickscore model.safetensors    MISSING
    shapes     yes         -                  (no weight files)    ok

Exit code: 0 when every reward is registered and every expected file is present, 1 otherwise (also for a
path given to a reward that loads no weights), 2 for a usage error (no rewards found, unreadable config).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import pkgutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import genrl.rewards
from genrl.rewards.manager import as_reward_spec
from genrl.rewards.registry import UnknownRewardError, available_rewards, get_reward_class

__all__ = ["CheckRow", "check_specs", "load_reward_modules", "main", "rewards_from_configs"]

logger = logging.getLogger(__name__)

#: modules of genrl.rewards that register no reward (skipped by :func:`load_reward_modules`).
_NOT_REWARDS = {"base", "registry", "manager", "image", "preprocess", "server", "check"}
_CONFIG_KEYS = ("model.init_args.rewards", "model.init_args.val_rewards")


def load_reward_modules(extra: Sequence[str] = ()) -> dict[str, str]:
    """Import ``genrl.rewards`` and each of its submodules (registering every built-in reward), then the
    ``extra`` modules (custom rewards).

    Returns:
        ``{module: error}`` for the genrl.rewards submodules that failed to import (e.g. an optional
        dependency is missing); they are logged, not raised.

    Raises:
        ImportError: an ``extra`` module cannot be imported.
    """
    failed: dict[str, str] = {}
    for info in pkgutil.iter_modules(genrl.rewards.__path__):
        if info.name in _NOT_REWARDS or info.name.startswith("_"):
            continue
        module = f"genrl.rewards.{info.name}"
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed[module] = f"{type(exc).__name__}: {exc}"
            logger.warning("could not import %s (its rewards are not registered): %s", module, failed[module])
    for module in extra:
        importlib.import_module(module)
    return failed


def rewards_from_configs(paths: Sequence[str | Path]) -> list[Any]:
    """The reward entries of composed config files (later files override earlier ones; interpolations
    resolved): ``model.init_args.rewards`` followed by ``model.init_args.val_rewards``.

    Raises:
        FileNotFoundError: a config file does not exist.
        ValueError: a rewards entry that is not a list.
    """
    from omegaconf import OmegaConf

    confs = []
    for p in paths:
        if not Path(p).is_file():
            raise FileNotFoundError(f"config file {str(p)!r} not found")
        confs.append(OmegaConf.load(p))
    merged = OmegaConf.merge(*confs) if confs else OmegaConf.create({})
    out: list[Any] = []
    for key in _CONFIG_KEYS:
        node = OmegaConf.select(merged, key, default=None)
        if node is None:
            continue
        value = OmegaConf.to_container(node, resolve=True)
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list of reward entries, got {type(value).__name__}")
        out.extend(value)
    return out


@dataclass
class CheckRow:
    """One line of the check table. ``status``: ``ok``, ``MISSING`` (an expected file is absent), ``UNKNOWN``
    (unregistered name) or ``BAD PATH`` (a path given to a reward that loads no weights: building it would
    fail)."""

    reward: str
    registered: bool
    path: str
    file: str
    status: str
    what: str = ""


def _parse_reward_arg(text: str) -> dict[str, Any]:
    name, sep, path = text.partition(":")
    if not name:
        raise ValueError(f"--reward {text!r}: expected name or name:path")
    return {"name": name, "path": path or None} if sep else {"name": name}


def check_specs(entries: Sequence[Any]) -> list[CheckRow]:
    """Check reward entries (RewardSpecs, config dicts, or names) without building anything.

    Returns:
        Rows: one per expected weight file of each registered reward (one ``(no weight files)`` row for a
        reward that loads none), one ``UNKNOWN`` row per unregistered name, one ``BAD PATH`` row per reward
        given a path it cannot take.

    Raises:
        TypeError, ValueError: a malformed entry (see :func:`genrl.rewards.as_reward_spec`).
    """
    rows: list[CheckRow] = []
    for entry in entries:
        spec = as_reward_spec({"name": entry} if isinstance(entry, str) else entry)
        shown_path = str(spec.path) if spec.path is not None else "-"
        if spec.name == "remote" and isinstance(spec.kwargs.get("url"), str):
            shown_path = spec.kwargs["url"]
        try:
            cls = get_reward_class(spec.name)
        except UnknownRewardError:
            rows.append(CheckRow(spec.name, False, shown_path, "-", "UNKNOWN", "not a registered reward"))
            continue
        if spec.path is not None and "path" not in inspect.signature(cls.__init__).parameters:
            rows.append(CheckRow(spec.name, True, shown_path, "-", "BAD PATH", "this reward loads no weights; "
                                 "drop its path"))
            continue
        if not cls.weight_files:
            rows.append(CheckRow(spec.name, True, shown_path, "(no weight files)", "ok"))
            continue
        missing = set(cls.missing_weights(spec.path, **dict(spec.kwargs)))
        if spec.path is None:
            shown_path = "(not set)"
        for f, what in cls.weight_files.items():
            rows.append(CheckRow(spec.name, True, shown_path, f, "MISSING" if f in missing else "ok", what))
    return rows


def format_table(rows: Sequence[CheckRow]) -> str:
    """The rows as an aligned plain-text table with a header."""
    head = ("reward", "registered", "path", "file", "status", "what")
    body = [(r.reward, "yes" if r.registered else "no", r.path, r.file, r.status, r.what) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="genrl rewards", description="Inspect genrl rewards without loading them.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="check that rewards are registered and their weight files are present")
    c.add_argument("--config", action="append", default=[], help="training config YAML (repeatable; later "
                                                                  "files override earlier ones)")
    c.add_argument("--reward", action="append", default=[], metavar="NAME[:PATH]",
                   help="a reward to check, with its weights folder (repeatable)")
    c.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (it registers custom rewards); repeatable")
    ls = sub.add_parser("list", help="list the registered rewards and the weight files each expects")
    ls.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE")
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """``genrl rewards check|list``. Returns the exit code (0 ok, 1 missing / unknown, 2 usage error)."""
    out = out or sys.stdout
    args = _parser().parse_args(list(argv) if argv is not None else None)
    try:
        load_reward_modules(args.imports)
    except ImportError as exc:
        print(f"genrl rewards: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "list":
        for name in available_rewards():
            cls = get_reward_class(name)
            files = ", ".join(cls.weight_files) or "(no weight files)"
            print(f"{name:<16} {cls.__module__}.{cls.__qualname__}  weights: {files}", file=out)
        return 0
    try:
        entries: list[Any] = rewards_from_configs(args.config) if args.config else []
        entries += [_parse_reward_arg(r) for r in args.reward]
        if not entries:
            where = f" in {', '.join(args.config)} (model.init_args.rewards / val_rewards)" if args.config else ""
            raise ValueError(f"no rewards to check{where}; give --config FILE or --reward NAME[:PATH]")
        rows = check_specs(entries)
    except (OSError, ValueError, TypeError) as exc:
        print(f"genrl rewards check: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows), file=out)
    bad = [r for r in rows if r.status != "ok"]
    if bad:
        missing = sum(r.status == "MISSING" for r in bad)
        unknown = sorted({r.reward for r in bad if r.status == "UNKNOWN"})
        bad_path = sorted({r.reward for r in bad if r.status == "BAD PATH"})
        parts = ([f"{missing} weight file(s) MISSING (place them under the reward's path; nothing is downloaded)"]
                 if missing else []) + ([f"unknown reward(s): {', '.join(unknown)} (registered: "
                                         f"{', '.join(available_rewards())})"] if unknown else []) + (
            [f"path given to reward(s) without weights: {', '.join(bad_path)}"] if bad_path else [])
        print("FAILED: " + "; ".join(parts), file=out)
        return 1
    print(f"OK: {len(rows)} row(s), every reward registered and every weight file present", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
