"""The files genrl ships in the checkout's ``assets/`` folder: where it is, and the VBench suite's dimension names.

A leaf of the package (imports only the standard library and the empty root package), so that the data layer
(prompt aliases such as ``vbench:color``, :mod:`genrl.data.prompts`) and the evaluation layer (VBench bookkeeping,
:mod:`genrl.eval.vbench`) share it without importing each other.
"""

from __future__ import annotations

from pathlib import Path

import genrl

__all__ = ["assets_dir", "VBENCH_DIMENSIONS"]

#: VBench's 16 dimensions, in its order (scripts/constant.py ``TASK_INFO``): the ``dimension`` tags of the shipped
#: suite ``assets/prompts/vbench_full_info.json``, the ``vbench:<dimension>`` prompt aliases of
#: :func:`genrl.data.prompts.load_prompts`, and :data:`genrl.eval.vbench.ALL_DIMENSIONS` (this tuple).
VBENCH_DIMENSIONS: tuple[str, ...] = (
    "subject_consistency", "background_consistency", "temporal_flickering", "motion_smoothness", "dynamic_degree",
    "aesthetic_quality", "imaging_quality", "object_class", "multiple_objects", "human_action", "color",
    "spatial_relationship", "scene", "appearance_style", "temporal_style", "overall_consistency",
)


def assets_dir() -> Path:
    """The repository's ``assets/`` folder (``Path(genrl.__file__).parents[1] / "assets"``).

    Raises:
        FileNotFoundError: the folder does not exist (e.g. genrl installed from a wheel, which does not ship
            ``assets/``); the message says where it looked.
    """
    path = Path(genrl.__file__).resolve().parents[1] / "assets"
    if not path.is_dir():
        raise FileNotFoundError(
            f"genrl's assets folder is missing: looked for {path} (it exists in a source checkout of genrl, "
            f"not in an installed wheel); pass the prompt file's path instead of an alias"
        )
    return path
