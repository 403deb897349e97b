"""Reading and writing video files as genrl pixel tensors.

genrl's pixel convention (docs/architecture.md, Conventions) is float tensors in [0, 1], channels before height
and width. This module handles one clip at a time, so its tensors are ``[T, 3, H, W]``; stack them
to ``[B, T, 3, H, W]`` for rewards and metrics.

- :func:`read_video` decodes with decord (CPU), samples frames at a target frame rate by index
  stride, and resizes with torch (antialiased bilinear, short side then center crop).
- :func:`write_video` encodes H.264 / yuv420p mp4 with PyAV, atomically.
- :func:`probe_video` reads only the container header (frame count, frame rate, size).
- :func:`clip_indices` is the frame-sampling rule shared by reading and probing.
- :func:`atomic_write` and :func:`write_json` write every run artefact (videos, manifests, compute / hacking /
  evaluation records) so that a reader never sees a partial file; :func:`strict_json` is the one rule for values
  JSON cannot hold (NaN / inf become null).

Every failure to open or decode a file is a :class:`VideoReadError` that names the file and says
how to fix it; a missing file is a :class:`FileNotFoundError`.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "atomic_write",
    "strict_json",
    "write_json",
    "VideoInfo",
    "VideoReadError",
    "clip_indices",
    "probe_video",
    "read_video",
    "resize_center_crop",
    "write_video",
]

_REENCODE_HINT = (
    "The file may be corrupt, truncated, or use a codec this decord build cannot decode. "
    "Re-encode it to H.264 mp4, for example `ffmpeg -i {path} -c:v libx264 -pix_fmt yuv420p "
    "fixed.mp4`, or remove it from the data folder."
)


class VideoReadError(ValueError):
    """A video file exists but cannot be used: unreadable, corrupt, or too short for the clip.

    Attributes:
        path: the offending file, as given.
    """

    def __init__(self, path: str | os.PathLike, message: str):
        self.path = str(path)
        super().__init__(message)


@dataclass(frozen=True)
class VideoInfo:
    """What a container header says about a video.

    Attributes:
        num_frames: number of decodable frames decord reports (int >= 0).
        fps: average frame rate in frames per second (float; may be 0 when the file lacks one).
        height: frame height in pixels.
        width: frame width in pixels.
    """

    num_frames: int
    fps: float
    height: int
    width: int

    @property
    def duration(self) -> float:
        """Length in seconds (``num_frames / fps``; ``nan`` when the frame rate is unknown)."""
        return self.num_frames / self.fps if self.fps > 0 else float("nan")


def _decode_errors() -> tuple[type[BaseException], ...]:
    """Exception types decord raises on bad input (DECORDError is not a RuntimeError)."""
    import decord

    return (RuntimeError, ValueError, IndexError, decord.DECORDError)


def _open_reader(path: str | os.PathLike):
    """Open a decord VideoReader on the CPU, mapping failures to genrl's errors."""
    import decord  # imported lazily: decord is heavy and only needed for real files

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"Video file not found: {str(p)!r}")
    if not p.is_file():
        raise VideoReadError(p, f"Video path {str(p)!r} is not a regular file.")
    try:
        return decord.VideoReader(str(p), ctx=decord.cpu(0))
    except (RuntimeError, decord.DECORDError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise VideoReadError(
            p, f"Could not open video {str(p)!r} ({reason}). " + _REENCODE_HINT.format(path=str(p))
        ) from err


def probe_video(path: str | os.PathLike) -> VideoInfo:
    """Read a video's frame count, frame rate and size without decoding the clip.

    Args:
        path: a video file decord can open (mp4, webm, mov, mkv, avi, ...).

    Returns:
        A :class:`VideoInfo`.

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it).
        VideoReadError: the file cannot be opened (corrupt, truncated, unknown codec).
    """
    vr = _open_reader(path)
    try:
        num_frames = len(vr)
        fps = float(vr.get_avg_fps())
        if num_frames > 0:
            height, width = (int(s) for s in vr[0].shape[:2])
        else:
            height = width = 0
    except _decode_errors() as err:
        raise VideoReadError(
            path,
            f"Could not decode video {str(path)!r} ({err}). "
            + _REENCODE_HINT.format(path=str(path)),
        ) from err
    finally:
        del vr
    if not math.isfinite(fps):
        fps = 0.0
    return VideoInfo(num_frames=num_frames, fps=fps, height=height, width=width)


def clip_indices(
    num_source_frames: int,
    source_fps: float,
    num_frames: int,
    fps: float | None = None,
    start: float | int = 0,
    path: str | os.PathLike = "<video>",
) -> list[int]:
    """Frame indices of a clip of ``num_frames`` frames sampled at ``fps`` from ``start`` seconds.

    The clip's frame ``i`` is shown at time ``t_i = start + i / fps``; it takes the source frame on
    screen at that time, ``floor(t_i * source_fps)``. With ``fps=None`` the stride is one source
    frame. A target fps above the source fps repeats source frames.

    Args:
        num_source_frames: frames in the file.
        source_fps: the file's average frame rate (frames / s, > 0 unless ``fps`` is None and
            ``start`` is 0).
        num_frames: clip length in frames (>= 1).
        fps: target frame rate (> 0), or None for the file's native rate.
        start: clip start in **seconds** (an int is seconds too, not a frame index; to start at
            source frame ``k`` pass ``k / source_fps``). Must be >= 0.
        path: only used in error messages.

    Returns:
        ``num_frames`` non-decreasing ints in ``[0, num_source_frames)``.

    Raises:
        ValueError: invalid ``num_frames``, ``fps`` or ``start``.
        VideoReadError: the file is too short for the requested clip, or has no usable frame rate
            while one is needed; the message gives the file's frame count and duration and what was
            asked.
    """
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"num_frames must be a positive int, got {num_frames!r}")
    if fps is not None and not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a positive number or None (native rate), got {fps!r}")
    if not (math.isfinite(start) and start >= 0):
        raise ValueError(f"start must be a non-negative number of seconds, got {start!r}")
    if num_source_frames <= 0:
        raise VideoReadError(
            path, f"Video {str(path)!r} has no frames. " + _REENCODE_HINT.format(path=str(path))
        )
    have_rate = math.isfinite(source_fps) and source_fps > 0
    if not have_rate and (fps is not None or start > 0):
        raise VideoReadError(
            path,
            f"Video {str(path)!r} reports no frame rate, so it cannot be sampled at fps={fps} or "
            f"from start={start} s. Read it with fps=None and start=0, or re-encode it with a "
            f"frame rate: `ffmpeg -i {path} -r 25 -c:v libx264 -pix_fmt yuv420p fixed.mp4`.",
        )
    eps = 1e-6  # guards floor() against float error, e.g. 0.3 * 10 = 2.9999999999999996
    start_index = int(math.floor(start * source_fps + eps)) if have_rate else 0
    stride = 1.0 if fps is None else source_fps / fps
    indices = [start_index + int(math.floor(i * stride + eps)) for i in range(num_frames)]
    needed = indices[-1] + 1
    if needed > num_source_frames:
        rate = f"{source_fps:.3g} fps" if have_rate else "unknown fps"
        duration = f"{num_source_frames / source_fps:.2f} s" if have_rate else "unknown duration"
        span = f"{num_frames / fps:.2f} s" if fps is not None else f"{num_frames} source frames"
        raise VideoReadError(
            path,
            f"Video {str(path)!r} is too short: it has {num_source_frames} frames ({duration} at "
            f"{rate}), but the requested clip (num_frames={num_frames} at "
            f"fps={'native' if fps is None else fps}, start={start} s, spanning {span}) needs "
            f"source frames up to index {indices[-1]} ({needed} frames). Ask for fewer frames, a "
            f"lower fps or an earlier start, or drop this file.",
        )
    return indices


def resize_center_crop(frames: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Resize frames to cover ``size`` keeping the aspect ratio, then center-crop to ``size``.

    The scale is ``max(H / h, W / w)``, so the short side (relative to the target aspect) lands
    exactly on the target and the other side is cropped equally on both ends; no padding and no
    distortion. Resizing is bilinear with antialiasing (``F.interpolate(..., antialias=True)``),
    except for a shrink by an exact integer factor on both axes, which uses a box average
    (``mode="area"``): that is also an antialiasing filter, and it exactly inverts the integer
    nearest-neighbour upscaling :func:`write_video` applies to small clips, so a 16x16 clip written
    and read back at 16x16 is not blurred across its 4x4 blocks.

    Args:
        frames: float tensor ``[T, C, h, w]``.
        size: target ``(H, W)``, positive ints.

    Returns:
        float tensor ``[T, C, H, W]`` with the input's dtype, values clamped to the input's range
        convention [0, 1] when the input is in [0, 1] (bilinear weights are non-negative).

    Raises:
        ValueError: ``size`` is not two positive ints, or ``frames`` is not 4-D.
    """
    if frames.ndim != 4:
        raise ValueError(f"frames must be [T, C, h, w], got shape {tuple(frames.shape)}")
    if len(size) != 2 or any(isinstance(s, bool) or int(s) != s or s < 1 for s in size):
        raise ValueError(f"size must be (height, width) with positive ints, got {size!r}")
    out_h, out_w = int(size[0]), int(size[1])
    h, w = frames.shape[-2:]
    if (h, w) == (out_h, out_w):
        return frames
    scale = max(out_h / h, out_w / w)
    new_h = max(out_h, int(round(h * scale)))
    new_w = max(out_w, int(round(w * scale)))
    if h % new_h == 0 and w % new_w == 0:
        # Exact integer shrink: a box average is the antialiasing filter that exactly undoes the
        # integer nearest-neighbour upscaling write_video applies to small clips.
        resized = F.interpolate(frames, size=(new_h, new_w), mode="area")
    else:
        resized = F.interpolate(
            frames, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True
        )
    top = (new_h - out_h) // 2
    left = (new_w - out_w) // 2
    return resized[..., top : top + out_h, left : left + out_w]


def read_video(
    path: str | os.PathLike,
    num_frames: int,
    fps: float | None = None,
    start: float | int = 0,
    size: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Decode a clip of a video file as genrl pixels.

    Frames are decoded with decord on the CPU. Sampling: the clip's frame ``i`` is the source frame
    on screen at ``start + i / fps`` seconds (see :func:`clip_indices`), using the file's average
    frame rate; ``fps=None`` takes consecutive source frames. Resizing (when ``size`` is given) is
    torch antialiased bilinear (box average for exact integer shrinks) to cover ``size``, then a
    center crop where the aspect differs (see :func:`resize_center_crop`).

    Args:
        path: the video file.
        num_frames: clip length T (>= 1).
        fps: target frame rate in frames / s, or None for the file's native rate.
        start: clip start in seconds (int or float; both are seconds), >= 0.
        size: output ``(H, W)``, or None to keep the file's resolution.

    Returns:
        float32 tensor ``[T, 3, H, W]`` in [0, 1] (RGB).

    Raises:
        FileNotFoundError: ``path`` does not exist (the message names it).
        VideoReadError: the file cannot be opened or decoded (the message names it and says to
            re-encode it to H.264 mp4), or it is too short for the clip (the message gives its
            frame count, duration and the request).
        ValueError: invalid ``num_frames``, ``fps``, ``start`` or ``size``.
    """
    if size is not None and (
        len(size) != 2 or any(isinstance(s, bool) or int(s) != s or s < 1 for s in size)
    ):
        raise ValueError(f"size must be (height, width) with positive ints or None, got {size!r}")
    vr = _open_reader(path)
    indices = clip_indices(len(vr), float(vr.get_avg_fps()), num_frames, fps, start, path)
    try:
        batch = vr.get_batch(indices)
    except _decode_errors() as err:
        raise VideoReadError(
            path, f"Could not decode frames of video {str(path)!r} ({err}). "
            + _REENCODE_HINT.format(path=str(path))
        ) from err
    finally:
        del vr
    # decord returns its own NDArray under the native bridge; another module may have switched
    # the global bridge to torch, so accept both without touching global state.
    array = batch.asnumpy() if hasattr(batch, "asnumpy") else np.asarray(batch)
    frames = torch.from_numpy(np.ascontiguousarray(array))  # [T, h, w, 3] uint8
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise VideoReadError(
            path,
            f"Video {str(path)!r} decoded to unexpected shape {tuple(frames.shape)}; expected "
            "[T, h, w, 3] RGB. " + _REENCODE_HINT.format(path=str(path)),
        )
    pixels = frames.permute(0, 3, 1, 2).to(torch.float32).div_(255.0)
    if size is not None:
        pixels = resize_center_crop(pixels, size).clamp_(0.0, 1.0)
    return pixels.contiguous()


def _to_uint8_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[T, C, H, W] float in [0, 1] (or uint8) -> [T, H, W, 3] uint8 on the CPU."""
    if not isinstance(pixels, torch.Tensor):
        pixels = torch.as_tensor(np.asarray(pixels))
    if pixels.ndim != 4 or pixels.shape[1] not in (1, 3):
        hint = ""
        if pixels.ndim == 4 and pixels.shape[-1] in (1, 3):
            hint = " It looks channels-last; pass pixels.permute(0, 3, 1, 2)."
        elif pixels.ndim == 5:
            hint = " For a batch [B, T, C, H, W], write one video per sample."
        raise ValueError(
            f"write_video expects pixels [T, 3, H, W] (or [T, 1, H, W]), got shape "
            f"{tuple(pixels.shape)}.{hint}"
        )
    if pixels.shape[0] < 1:
        raise ValueError("write_video got zero frames (T = 0)")
    pixels = pixels.detach().cpu()
    if pixels.dtype == torch.uint8:
        out = pixels
    elif pixels.is_floating_point():
        if torch.isnan(pixels).any():
            raise ValueError("write_video got NaN pixel values")
        out = (pixels.float().clamp(0.0, 1.0) * 255.0).round().to(torch.uint8)
    else:
        raise TypeError(f"write_video expects float pixels in [0, 1] or uint8, got {pixels.dtype}")
    if out.shape[1] == 1:
        out = out.expand(-1, 3, -1, -1)
    return out.permute(0, 2, 3, 1).contiguous()


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Write ``path`` atomically: ``write(tmp)`` fills a temporary file in the same folder, which then gets mode
    0644 and replaces ``path`` (``os.replace``), so readers and resumed runs never see a partial file; the
    temporary file is removed when anything fails (the error propagates). Creates the parent folder.

    Returns:
        ``Path(path)``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def strict_json(value: object) -> object:
    """``value`` made strict JSON: every non-finite float (NaN, +-inf) becomes None, tensors become (nested) lists,
    paths become strings, tuples become lists and mapping keys become strings; everything else is returned as is
    (``json.dumps`` raises on what it still cannot hold)."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json(path: str | os.PathLike, obj: object, indent: int | None = 2, sort_keys: bool = False) -> Path:
    """Write ``obj`` to ``path`` as strict JSON (:func:`strict_json`, then ``allow_nan=False``), atomically
    (:func:`atomic_write`), with a trailing newline. Returns ``Path(path)``.

    Raises:
        TypeError: a value JSON cannot encode (nothing is written).
    """
    text = json.dumps(strict_json(obj), indent=indent, sort_keys=sort_keys, allow_nan=False, ensure_ascii=False)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"))


def write_video(
    path: str | os.PathLike,
    pixels: torch.Tensor,
    fps: int = 8,
    *,
    crf: int = 18,
    min_side: int = 64,
) -> str:
    """Write pixels to an H.264 (yuv420p) mp4 file, atomically.

    Small frames are enlarged for playability: when ``min(H, W) < min_side`` each frame is
    upscaled by the integer nearest-neighbour factor ``ceil(min_side / min(H, W))`` (a 16x16 clip
    becomes 64x64 of crisp 4x4 blocks; reading it back with ``size=(16, 16)`` recovers the
    original grid up to codec error). yuv420p then needs even sides, so an odd height / width is
    padded by repeating the last row / column once. The file is encoded to a temporary file in the
    target folder and moved into place with :func:`os.replace`, so readers never see a
    half-written video; parent folders are created.

    Args:
        path: destination, normally ``*.mp4`` (the container is mp4 whatever the suffix).
        pixels: ``[T, 3, H, W]`` float in [0, 1] (values outside are clamped), or uint8 in
            [0, 255]; ``[T, 1, H, W]`` is written as grey. Any device; gradients are ignored.
        fps: frame rate of the file (int, or a float such as 29.97).
        crf: x264 constant rate factor, 0 (lossless-ish) to 51 (worst); 18 is visually lossless.
        min_side: upscale target for the short side (see above); 0 disables upscaling.

    Returns:
        The written path as a string.

    Raises:
        ValueError: wrong shape (e.g. channels-last or a batch), zero frames, NaN values, or
            a non-positive fps.
        TypeError: pixels are neither floating point nor uint8.
        av.error.FFmpegError: the encoder failed (the temporary file is removed).
    """
    import av  # lazily: PyAV is only needed when writing

    if not (math.isfinite(float(fps)) and fps > 0):
        raise ValueError(f"fps must be positive, got {fps!r}")
    frames = _to_uint8_frames(pixels)  # [T, H, W, 3] uint8
    h, w = frames.shape[1:3]
    if min_side and min(h, w) < min_side:
        k = math.ceil(min_side / min(h, w))
        frames = frames.repeat_interleave(k, dim=1).repeat_interleave(k, dim=2)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = F.pad(frames.permute(0, 3, 1, 2), (0, pad_w, 0, pad_h), mode="replicate")
        frames = frames.permute(0, 2, 3, 1).contiguous()
    array = frames.numpy()

    dest = Path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    def encode(tmp: str) -> None:
        with av.open(tmp, mode="w", format="mp4", options={"movflags": "+faststart"}) as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.width = int(array.shape[2])
            stream.height = int(array.shape[1])
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(int(crf))}
            for frame in array:
                video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
                for packet in stream.encode(video_frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)

    atomic_write(dest, encode)
    return str(dest)
