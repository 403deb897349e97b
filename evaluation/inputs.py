"""The videos an evaluation runs on: a folder plus the ``manifest.jsonl`` of ``pipelines/generate.py``, or a folder
of VBench-named files (``{prompt}-{k}.mp4``), checked so that nothing is dropped silently.

:func:`discover` pairs every video file with its record (prompt, seed, sample index, fps, metadata) and returns the
files it cannot use with the reason; :func:`load_video` decodes one file to uint8 frames.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mov", ".mkv", ".webm", ".gif")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
MANIFEST = "manifest.jsonl"
_VBENCH_NAME = re.compile(r"^(?P<prompt>.+)-(?P<k>\d+)$")


@dataclass
class EvalItem:
    """One video (or image) to evaluate.

    Attributes:
        file: the file name relative to the videos folder (the key of every per-video result).
        path: the file.
        prompt: its prompt (from the manifest, else from the VBench file name).
        seed: the generation seed (manifest ``seed``), or None when unknown.
        sample: the sample index k of this prompt (manifest ``sample`` or the ``-k`` of a VBench name), or None.
        fps: frames per second recorded by the manifest, or None (then the container's rate is used).
        metadata: the manifest's per-prompt metadata (e.g. a GenEval spec), passed to rewards as ``metadata``.
        record: the whole manifest line ({} without a manifest).
        image: the conditioning image of an image-to-video sample (the manifest's ``image``, written by
            ``pipelines/generate.py`` as an absolute path; else ``metadata["image"]``, absolute or relative to the
            manifest's folder), or None. Not checked for existence here: a missing file skips only the dimensions
            that need it.
    """

    file: str
    path: Path
    prompt: str
    seed: int | None = None
    sample: int | None = None
    fps: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    image: Path | None = None


@dataclass
class Skipped:
    """A file (or manifest line) left out of the evaluation, with why; every report lists these."""

    file: str
    reason: str
    metric: str | None = None  # None: left out of everything; else only of this dimension / metric

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "reason": self.reason, **({"metric": self.metric} if self.metric else {})}


def prompt_from_vbench_name(name: str) -> tuple[str, int] | None:
    """``"a cat running-3.mp4"`` -> ``("a cat running", 3)``; None when the stem does not end in ``-<k>``.

    This is VBench's naming (``{prompt}-{k}.mp4``, written by ``pipelines/generate.py --vbench-names``); a ``/`` of
    the prompt was written as ``_`` and is not restored."""
    m = _VBENCH_NAME.match(Path(name).stem)
    return (m.group("prompt"), int(m.group("k"))) if m else None


def _read_manifest(path: Path) -> dict[str, dict]:
    records: dict[str, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: line {n} is not JSON ({err}); fix or delete that line") from None
        if not isinstance(r, dict) or "file" not in r or "prompt" not in r:
            raise ValueError(f"{path}: line {n} has no 'file' / 'prompt' field; manifest lines look like "
                             f'{{"file": "00000.mp4", "prompt": "...", ...}} (pipelines/generate.py writes them)')
        records[str(r["file"])] = r
    return records


def discover(videos: str | Path, manifest: str | Path | None = None, allow_unlisted: bool = False,
             images: bool = False) -> tuple[list[EvalItem], list[Skipped]]:
    """Pair the video files of a folder with their prompts.

    With a manifest (``manifest`` or ``videos/manifest.jsonl``), each file needs a line; without one, each file
    needs a VBench name ``{prompt}-{k}.<ext>``.

    Args:
        videos: the folder (searched non-recursively).
        manifest: a manifest.jsonl (default: the folder's own, when present).
        allow_unlisted: skip files without a manifest line / VBench name (listed in the returned skipped list)
            instead of raising.
        images: also take .png / .jpg files (T = 1: rewards and FID only).

    Returns:
        (items sorted by file name, skipped): manifest lines whose file is missing are skipped with that reason.

    Raises:
        FileNotFoundError: ``videos`` is not a folder, or the given manifest does not exist.
        ValueError: no video files; files without a manifest line / VBench name (unless ``allow_unlisted``; the
            message lists them and the fixes); a malformed manifest line.
    """
    root = Path(videos)
    if not root.is_dir():
        raise FileNotFoundError(f"videos folder {str(root)!r} does not exist (give the --out folder of "
                                f"pipelines/generate.py)")
    exts = VIDEO_EXTENSIONS + (IMAGE_EXTENSIONS if images else ())
    files = sorted(p.name for p in root.iterdir() if p.is_file() and p.suffix.lower() in exts)
    if not files:
        raise ValueError(f"{root} holds no video files ({', '.join(exts)})")
    mpath = Path(manifest) if manifest is not None else root / MANIFEST
    if manifest is not None and not mpath.is_file():
        raise FileNotFoundError(f"manifest {str(mpath)!r} does not exist")
    items: list[EvalItem] = []
    skipped: list[Skipped] = []
    unlisted: list[str] = []
    if mpath.is_file():
        records = _read_manifest(mpath)
        for f in files:
            r = records.get(f)
            if r is None:
                unlisted.append(f)
                continue
            fps = r.get("fps")
            items.append(EvalItem(f, root / f, str(r["prompt"]), r.get("seed"), r.get("sample"),
                                  float(fps) if fps else None, dict(r.get("metadata") or {}), r,
                                  _conditioning_image(r, mpath.parent)))
        present = set(files)
        skipped += [Skipped(f, f"listed in {mpath.name} but the file is missing") for f in records if f not in present]
        hint = (f"add them to {mpath}, move them out of the folder, or pass --allow-unlisted to skip them "
                f"(they are then listed in the report)")
        what = f"have no line in {mpath}"
    else:
        for f in files:
            parsed = prompt_from_vbench_name(f)
            if parsed is None:
                unlisted.append(f)
                continue
            items.append(EvalItem(f, root / f, parsed[0], sample=parsed[1]))
        hint = ("name them {prompt}-{k}.mp4 (pipelines/generate.py --vbench-names), write a manifest.jsonl "
                "(pipelines/generate.py writes one), or pass --allow-unlisted to skip them")
        what = "are not VBench-named ({prompt}-{k}.mp4) and there is no manifest.jsonl"
    if unlisted:
        if not allow_unlisted:
            shown = ", ".join(repr(f) for f in unlisted[:5]) + (" ..." if len(unlisted) > 5 else "")
            raise ValueError(f"{len(unlisted)} of {len(files)} files in {root} {what}: {shown}; {hint}")
        skipped += [Skipped(f, "no manifest line" if mpath.is_file() else "no prompt (not VBench-named)")
                    for f in unlisted]
    return items, skipped


def _conditioning_image(record: dict[str, Any], folder: Path) -> Path | None:
    """The image a manifest line was generated from: its ``image``, else ``metadata["image"]`` (relative paths
    from ``folder``, the manifest's); None for a text-only sample. Raises ValueError: a value that is not a path."""
    from genrl.models.conditions import image_path

    value = record.get("image") or (record.get("metadata") or {}).get("image")
    if value is None:
        return None
    return image_path(value, folder, f"manifest line of {record.get('file')!r}")


def load_image(path: Path) -> torch.Tensor:
    """Decode one image file to uint8 ``[3, H, W]`` RGB on the CPU.

    Raises:
        FileNotFoundError: the file is gone.
        genrl.data.video_io.VideoReadError (a ValueError): not a readable image (the message names it).
    """
    import numpy as np
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"image file not found: {str(path)!r}")
    try:
        with Image.open(path) as im:
            array = np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError) as err:
        from genrl.data.video_io import VideoReadError

        raise VideoReadError(path, f"could not read image {str(path)!r} ({err})") from err
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


def load_video(item: EvalItem) -> tuple[torch.Tensor, float]:
    """Decode a whole file.

    Returns:
        (frames uint8 ``[T, 3, H, W]`` RGB on the CPU, fps): fps from the manifest, else the container's rate
        (VBench takes it from the container too, so it must be right), else 8 for an image (T = 1).

    Raises:
        FileNotFoundError: the file is gone.
        genrl.data.video_io.VideoReadError (a ValueError): unreadable / corrupt file (the message names it and says
            how to re-encode it).
    """
    if item.path.suffix.lower() in IMAGE_EXTENSIONS:
        return load_image(item.path)[None], item.fps or 8.0
    from genrl.data.video_io import VideoReadError, probe_video, read_video

    info = probe_video(item.path)
    if info.num_frames < 1:
        raise VideoReadError(item.path, f"video {str(item.path)!r} has no decodable frames; re-encode it to H.264 mp4")
    pixels = read_video(item.path, num_frames=info.num_frames)
    frames = (pixels * 255.0).round_().clamp_(0, 255).to(torch.uint8)
    fps = item.fps or (info.fps if info.fps > 0 else 8.0)
    return frames, float(fps)
