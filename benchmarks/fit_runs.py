"""Shared by the shapes-world benchmarks: run one ``genrl fit`` in its own folder and find its export."""

from __future__ import annotations

import os
import time
from pathlib import Path


def fit_in(folder: Path, args: list[str]) -> tuple[str, float]:
    """Run ``GenRLCLI(args)`` (``args`` starts with "fit") with ``folder`` as the working directory, so the config's
    relative run paths land there.

    Returns:
        (the one export folder ``folder/runs/*/export``, wall seconds of the run).

    Raises:
        RuntimeError: the run left no export or several.
    """
    from genrl.cli import GenRLCLI

    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        t0 = time.perf_counter()
        GenRLCLI(args=args, run=True)
        wall = round(time.perf_counter() - t0, 1)
    finally:
        os.chdir(cwd)
    exports = sorted(folder.glob("runs/*/export"))
    if len(exports) != 1:
        raise RuntimeError(f"expected one export under {folder}/runs, found {exports}")
    return str(exports[0]), wall
