"""Contracts of genrl's video IO (issue 51, mutation survivors of genrl/data/video_io.py).

Fast unit tests that call each function directly: the frame-sampling rule :func:`clip_indices` (argument checks,
its defaults, files without a usable frame rate, the "no frames" and "too short" errors and what their messages
report), :func:`resize_center_crop` (size checks, the box average for exact integer shrinks, the antialiased bilinear
filter otherwise, the centred crop), :func:`read_video`'s post-processing (arguments checked before the file is
opened, uint8 / 255 scaling, the [0, 1] clamp after resizing, decoded shapes that are not RGB, decord's torch bridge),
:func:`probe_video` (first-frame size, zero frames, a non-finite frame rate), the errors of ``_open_reader`` (decord's
reason in the message) and the pixel conversion of :func:`write_video` (``_to_uint8_frames``: array input, grey
frames, clamping, uint8 pass-through, shape errors and their hints) and :func:`write_video` itself (default rate
and crf, the fps check, no upscaling for min_side <= 0, padding an odd side by replication, the moov box before the
media data, every packet muxed), and the text :func:`write_json` writes (indent 2 and key order by default, UTF-8
without escapes whatever the locale), and :func:`atomic_write`'s temporary file (same folder, hidden, ``.tmp``) and
parent folders.

Tests of post-processing replace ``decord.VideoReader`` with a tiny in-memory reader (exact uint8 frames, any frame
count or rate); the torch-bridge and write_video tests read back tiny clips written with ``write_video``.
"""

from __future__ import annotations

import math
from pathlib import Path

import decord
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from locale_util import ascii_locale

from genrl.data.video_io import (
    VideoReadError,
    _to_uint8_frames,
    atomic_write,
    clip_indices,
    probe_video,
    read_video,
    resize_center_crop,
    write_json,
    write_video,
)


class _FakeReader:
    """The part of decord.VideoReader genrl uses, over a uint8 array [N, h, w, C] held in memory."""

    def __init__(self, frames: np.ndarray, fps: float):
        self.frames = frames
        self.fps = fps

    def __len__(self) -> int:
        return int(self.frames.shape[0])

    def get_avg_fps(self) -> float:
        return self.fps

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(f"frame {i} out of range")
        return decord.nd.array(self.frames[i])

    def get_batch(self, indices):
        return decord.nd.array(self.frames[list(indices)])


@pytest.fixture
def fake_video(tmp_path, monkeypatch):
    """Returns make(frames, fps) -> path: a placeholder file whose decord reader is a _FakeReader of ``frames``."""

    def make(frames: np.ndarray, fps: float = 8.0) -> Path:
        path = tmp_path / "fake.mp4"
        path.write_bytes(b"placeholder")
        monkeypatch.setattr(decord, "VideoReader", lambda uri, ctx=None: _FakeReader(frames, fps))
        return path

    return make


def _raising_reader(monkeypatch, err: BaseException) -> None:
    def open_(uri, ctx=None):
        raise err

    monkeypatch.setattr(decord, "VideoReader", open_)


# --------------------------------------------------------------------------- clip_indices


def test_clip_indices_defaults_start_at_zero_and_name_a_placeholder_path():
    """start defaults to 0 s (the clip begins at source frame 0); path defaults to "<video>", which the error's
    ``path`` attribute carries."""
    assert clip_indices(10, 8.0, 3) == [0, 1, 2]
    assert clip_indices(10, 8.0, 2, fps=4.0) == [0, 2]
    with pytest.raises(VideoReadError) as info:
        clip_indices(0, 8.0, 1)
    assert info.value.path == "<video>"


def test_clip_indices_rejects_bad_num_frames():
    """num_frames must be an int >= 1 and not a bool: 0, -1, True, 2.0 and "2" raise ValueError naming it."""
    for bad in (0, -1, True, False, 2.0, "2"):
        with pytest.raises(ValueError, match="num_frames must be a positive int"):
            clip_indices(10, 8.0, bad)
    assert clip_indices(10, 8.0, 1) == [0]


def test_clip_indices_rejects_bad_fps_and_start_but_takes_slow_rates():
    """fps must be finite and > 0 (0, -1, inf, nan raise ValueError); rates below 1 fps are valid (stride
    source_fps / fps). start must be finite and >= 0 (-0.5, inf, nan raise ValueError)."""
    for bad in (0, 0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="fps must be a positive number"):
            clip_indices(10, 8.0, 2, fps=bad)
    for bad in (-0.5, -1, math.inf, math.nan):
        with pytest.raises(ValueError, match="start must be a non-negative number"):
            clip_indices(10, 8.0, 2, start=bad)
    assert clip_indices(10, 1.0, 2, fps=0.5) == [0, 2]  # one frame every 2 s of a 1 fps file
    assert clip_indices(10, 8.0, 2, start=0.5) == [4, 5]


def test_clip_indices_no_frames_versus_too_short():
    """A file with 0 frames is "has no frames"; a 1-frame file serves a 1-frame clip; a file shorter than the clip
    is "too short". All are VideoReadError carrying the path."""
    with pytest.raises(VideoReadError, match="has no frames") as info:
        clip_indices(0, 8.0, 1, path="empty.mp4")
    assert info.value.path == "empty.mp4"
    with pytest.raises(VideoReadError, match="has no frames"):
        clip_indices(0, 0.0, 1)
    assert clip_indices(1, 8.0, 1) == [0]
    assert clip_indices(1, 0.0, 1) == [0]
    with pytest.raises(VideoReadError, match="too short"):
        clip_indices(1, 8.0, 2)


def test_clip_indices_without_a_frame_rate():
    """A source rate that is 0, negative, nan or inf is no rate: such a file is read at its native stride from frame 0
    (fps=None, start=0), and any fps or start > 0 (even 0.5 s) raises VideoReadError. A rate below 1 fps is a rate."""
    for no_rate in (0.0, -8.0, math.nan, math.inf, -math.inf):
        assert clip_indices(5, no_rate, 3) == [0, 1, 2], no_rate
        assert clip_indices(5, no_rate, 3, start=0.0) == [0, 1, 2], no_rate
        with pytest.raises(VideoReadError, match="reports no frame rate"):
            clip_indices(10, no_rate, 2, fps=4.0)
        with pytest.raises(VideoReadError, match="reports no frame rate"):
            clip_indices(10, no_rate, 2, fps=4.0, start=0.0)
        for start in (0.5, 1, 2.0):
            with pytest.raises(VideoReadError, match="reports no frame rate"):
                clip_indices(10, no_rate, 2, start=start)
    # 0.5 fps is a usable rate: start 2 s is source frame 1, 0.25 fps strides 2 source frames
    assert clip_indices(10, 0.5, 2, fps=0.25, start=2.0) == [1, 3]


def test_clip_indices_too_short_message_reports_the_file_and_the_request():
    """The "too short" message gives the file's frame count, duration and rate, and the clip's span (num_frames /
    fps seconds, or source frames at the native rate); without a rate it says the duration and rate are unknown."""
    with pytest.raises(VideoReadError) as info:
        clip_indices(4, 8.0, 8, fps=8.0, path="short.mp4")
    msg = str(info.value)
    assert "it has 4 frames (0.50 s at 8 fps)" in msg, msg
    assert "num_frames=8 at fps=8.0" in msg and "spanning 1.00 s" in msg, msg
    assert "up to index 7 (8 frames)" in msg, msg

    with pytest.raises(VideoReadError) as info:
        clip_indices(4, 8.0, 6, path="short.mp4")
    msg = str(info.value)
    assert "(0.50 s at 8 fps)" in msg and "fps=native" in msg and "spanning 6 source frames" in msg, msg

    with pytest.raises(VideoReadError) as info:
        clip_indices(2, 0.0, 5, path="norate.mp4")
    msg = str(info.value)
    assert info.value.path == "norate.mp4"
    assert "it has 2 frames (" in msg and "unknown duration" in msg and "unknown fps" in msg, msg
    assert "spanning 5 source frames" in msg, msg


# --------------------------------------------------------------------------- resize_center_crop


def test_resize_center_crop_rejects_bad_sizes():
    """size must be exactly two ints >= 1 that are not bools: (4,), (2, 2, 2), (0, 4), (2.5, 4), (True, 4) and
    (4, -1) raise ValueError; integral floats such as (2.0, 2) are accepted."""
    frames = torch.rand(1, 3, 4, 4)
    for bad in ((4,), (2, 2, 2), (0, 4), (2.5, 4), (True, 4), (4, -1), (4, 0.5)):
        with pytest.raises(ValueError, match="size must be"):
            resize_center_crop(frames, bad)
    assert resize_center_crop(frames, (2.0, 2)).shape == (1, 3, 2, 2)


def test_resize_center_crop_integer_shrink_is_a_box_average():
    """A shrink by an exact integer factor on both axes averages each k x k block (mode "area"), exactly."""
    frames = torch.rand(2, 3, 4, 6, generator=torch.Generator().manual_seed(0))
    out = resize_center_crop(frames, (2, 3))
    expected = frames.double().reshape(2, 3, 2, 2, 3, 2).mean(dim=(3, 5))
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=0)


def test_resize_center_crop_non_integer_shrink_is_antialiased_bilinear():
    """Otherwise the resize is bilinear (align_corners=False) with antialiasing, even when one axis alone divides:
    a 9x9 checkerboard shrunk to 4x4 matches F.interpolate(..., antialias=True) on float64 and is nearly flat grey
    (plain bilinear would alias it)."""
    board = ((torch.arange(9)[:, None] + torch.arange(9)[None, :]) % 2).float().expand(1, 3, 9, 9)
    out = resize_center_crop(board, (4, 4))
    ref = F.interpolate(board.double(), size=(4, 4), mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)
    assert (out - 0.5).abs().max() < 0.1
    # 8x9 -> 4x4: the scale 0.5 divides the height but not the width, so it is bilinear, not a box average
    frames = torch.rand(1, 1, 8, 9, generator=torch.Generator().manual_seed(1))
    out = resize_center_crop(frames, (4, 4))
    ref = F.interpolate(frames.double(), size=(4, 4), mode="bilinear", align_corners=False, antialias=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=0)


def test_resize_center_crop_crops_the_centre():
    """The long side is cropped equally on both ends ((new - out) // 2 first): an 8x4 frame to 2x2 is box-averaged
    to 4x2 and keeps rows 1..2; a 4x8 frame keeps columns 1..2."""
    tall = torch.arange(32, dtype=torch.float64).reshape(1, 1, 8, 4)
    boxed = tall.reshape(1, 1, 4, 2, 2, 2).mean(dim=(3, 5))  # [1, 1, 4, 2]
    torch.testing.assert_close(resize_center_crop(tall, (2, 2)), boxed[..., 1:3, :])
    wide = tall.reshape(1, 1, 4, 8)
    boxed = wide.reshape(1, 1, 2, 2, 4, 2).mean(dim=(3, 5))  # [1, 1, 2, 4]
    torch.testing.assert_close(resize_center_crop(wide, (2, 2)), boxed[..., :, 1:3])


# --------------------------------------------------------------------------- read_video


def test_read_video_checks_size_before_opening_the_file(tmp_path):
    """An invalid size is a ValueError raised before the file is touched: a missing file with a bad size gives the
    size error, not FileNotFoundError."""
    missing = tmp_path / "missing.mp4"
    for bad in ((4,), (2, 2, 2), (0, 4), (2.5, 4), (True, 4), (4, -1)):
        with pytest.raises(ValueError, match="size must be"):
            read_video(missing, 2, size=bad)
    with pytest.raises(FileNotFoundError):
        read_video(missing, 2, size=(4, 4))


def test_read_video_scales_uint8_by_255_and_clamps_the_resize_to_one(fake_video):
    """Decoded uint8 frames become float32 / 255 exactly ([T, 3, h, w]); after a resize (here the antialiased
    bilinear 2x7 -> 1x6, whose float32 weights sum a white frame to 1 + 1.2e-7) values are clamped to [0, 1], and
    a size with a side of 1 is valid."""
    frames = np.zeros((2, 2, 7, 3), dtype=np.uint8)
    frames[0, 0, 0] = (0, 51, 255)
    frames[1] = 255
    path = fake_video(frames)
    pixels = read_video(path, 2)
    assert pixels.shape == (2, 3, 2, 7) and pixels.dtype == torch.float32
    torch.testing.assert_close(pixels[0, :, 0, 0], torch.tensor([0.0, 0.2, 1.0]), atol=1e-7, rtol=0)
    assert pixels[1].eq(1.0).all()

    white = read_video(path, 1, start=0.125, size=(1, 6))
    assert white.shape == (1, 3, 1, 6)
    assert white.max().item() == 1.0 and white.min().item() > 0.999999
    assert read_video(path, 2, size=(1, 1)).shape == (2, 3, 1, 1)


def test_read_video_rejects_frames_that_are_not_rgb(fake_video):
    """A decoded batch whose last axis is not 3 channels (grey or RGBA) is a VideoReadError naming the file."""
    for channels in (1, 4):
        path = fake_video(np.zeros((2, 4, 4, channels), dtype=np.uint8))
        with pytest.raises(VideoReadError, match="expected") as info:
            read_video(path, 2)
        assert info.value.path == str(path)


def test_read_video_under_decords_torch_bridge(tmp_path):
    """When another module switched decord's global bridge to torch (get_batch returns a torch tensor without
    asnumpy), read_video gives the same pixels as under the native bridge."""
    clip = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    # 32x32: decord 0.6's torch bridge itself fails on 16x16 frames ("Check failed: from_size == to_size")
    path = write_video(tmp_path / "clip.mp4", clip, fps=8, min_side=0)
    native = read_video(path, 2)
    decord.bridge.set_bridge("torch")
    try:
        bridged = read_video(path, 2)
    finally:
        decord.bridge.set_bridge("native")
    assert native.shape == (2, 3, 32, 32)
    torch.testing.assert_close(bridged, native, atol=0, rtol=0)


# --------------------------------------------------------------------------- probe_video and _open_reader


def test_probe_video_size_comes_from_the_first_frame(fake_video):
    """A 1-frame file reports that frame's height and width (5 x 7), its frame count and rate."""
    info = probe_video(fake_video(np.zeros((1, 5, 7, 3), dtype=np.uint8), fps=12.5))
    assert (info.num_frames, info.fps, info.height, info.width) == (1, 12.5, 5, 7)


def test_probe_video_zero_frames_and_non_finite_rate(fake_video):
    """A reader with no frames gives size 0 x 0 (nothing is decoded); a nan or inf average rate is reported as
    0.0 (unknown), so the duration is nan."""
    info = probe_video(fake_video(np.zeros((0, 5, 7, 3), dtype=np.uint8), fps=8.0))
    assert (info.num_frames, info.fps, info.height, info.width) == (0, 8.0, 0, 0)
    for rate in (math.nan, math.inf):
        info = probe_video(fake_video(np.zeros((3, 4, 6, 3), dtype=np.uint8), fps=rate))
        assert (info.num_frames, info.height, info.width) == (3, 4, 6)
        assert info.fps == 0.0 and isinstance(info.fps, float)
        assert math.isnan(info.duration)


def test_open_errors_carry_decords_reason(tmp_path, monkeypatch):
    """A file decord cannot open is a VideoReadError with the first line of decord's message as the reason, or the
    exception's type name when decord gives no message."""
    path = tmp_path / "bad.mp4"
    path.write_bytes(b"placeholder")
    _raising_reader(monkeypatch, RuntimeError("  first line of the reason\nsecond line  "))
    with pytest.raises(VideoReadError) as info:
        probe_video(path)
    msg = str(info.value)
    assert "(first line of the reason)" in msg and "second line" not in msg, msg
    assert info.value.path == str(path)
    for err, name in ((RuntimeError(""), "RuntimeError"), (decord.DECORDError("  \n "), "DECORDError")):
        _raising_reader(monkeypatch, err)
        with pytest.raises(VideoReadError) as info:
            read_video(path, 1)
        assert f"({name})" in str(info.value), str(info.value)


# --------------------------------------------------------------------------- _to_uint8_frames (write_video)


def test_to_uint8_frames_clamps_rounds_and_passes_uint8_through():
    """Floats are clamped to [0, 1], scaled by 255 and rounded (-0.5 -> 0, 0.2 -> 51, 1.5 and 2.5 -> 255); uint8
    frames pass unchanged; the result is [T, H, W, 3]. One frame is enough."""
    values = torch.tensor([-0.5, 0.0, 0.2, 0.5, 1.0, 1.5, 2.5])
    pixels = values.reshape(1, 1, 1, 7).expand(1, 3, 1, 7)
    out = _to_uint8_frames(pixels)
    assert out.shape == (1, 1, 7, 3) and out.dtype == torch.uint8
    assert out[0, 0, :, 0].tolist() == [0, 0, 51, 128, 255, 255, 255]
    raw = torch.randint(0, 256, (2, 3, 2, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_to_uint8_frames(raw), raw.permute(0, 2, 3, 1))


def test_to_uint8_frames_takes_arrays_and_grey_frames():
    """A numpy array is converted like a tensor; a grey [T, 1, H, W] clip is repeated into 3 equal channels."""
    rng = np.random.default_rng(0)
    array = rng.random((2, 3, 4, 5)).astype(np.float32)
    assert torch.equal(_to_uint8_frames(array), _to_uint8_frames(torch.from_numpy(array)))
    grey = torch.rand(2, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    out = _to_uint8_frames(grey)
    assert out.shape == (2, 3, 4, 3)
    expected = (grey[:, 0] * 255).round().to(torch.uint8)
    for c in range(3):
        assert torch.equal(out[..., c], expected)
    assert _to_uint8_frames(np.zeros((1, 1, 2, 2), dtype=np.uint8)).shape == (1, 2, 2, 3)


def test_to_uint8_frames_shape_errors_and_hints():
    """Wrong shapes raise ValueError with advice: channels-last (last axis 1 or 3) is told to permute, a 5-D batch to
    write one video per sample, other shapes (3-D, 2 channels) get no advice; zero frames raise ValueError."""
    permute = "channels-last; pass pixels.permute(0, 3, 1, 2)"
    per_sample = "For a batch [B, T, C, H, W], write one video per sample"
    for shape in ((2, 8, 8, 3), (2, 8, 8, 1)):
        with pytest.raises(ValueError, match="write_video expects") as info:
            _to_uint8_frames(torch.rand(shape))
        assert permute in str(info.value) and per_sample not in str(info.value), shape
    for shape in ((2, 2, 3, 4, 3), (2, 2, 3, 4, 4)):
        with pytest.raises(ValueError, match="write_video expects") as info:
            _to_uint8_frames(torch.rand(shape))
        assert per_sample in str(info.value) and "permute" not in str(info.value), shape
    for shape in ((3, 8, 3), (2, 2, 8, 8)):
        with pytest.raises(ValueError, match="write_video expects") as info:
            _to_uint8_frames(torch.rand(shape))
        assert "permute" not in str(info.value) and "per sample" not in str(info.value), shape
    with pytest.raises(ValueError, match="zero frames"):
        _to_uint8_frames(torch.rand(0, 3, 4, 4))


# --------------------------------------------------------------------------- write_video


def _top_level_boxes(data: bytes) -> list[str]:
    """The types of an mp4 file's top-level boxes, in file order."""
    boxes, i = [], 0
    while i + 8 <= len(data):
        size = int.from_bytes(data[i : i + 4], "big")
        boxes.append(data[i + 4 : i + 8].decode("latin-1"))
        if size < 8:
            break
        i += size
    return boxes


def test_write_video_defaults_and_encoder_settings(tmp_path):
    """By default the file runs at 8 fps and x264 encodes at crf 18 (x264 writes its settings into the stream);
    crf=30 is passed through; the index (moov) precedes the media data (mdat) for progressive playback
    (movflags +faststart)."""
    clip = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    path = Path(write_video(tmp_path / "default.mp4", clip))
    assert probe_video(path).fps == 8.0
    data = path.read_bytes()
    assert b" crf=18.0 " in data
    boxes = _top_level_boxes(data)
    assert "moov" in boxes and "mdat" in boxes and boxes.index("moov") < boxes.index("mdat"), boxes
    data = Path(write_video(tmp_path / "crf30.mp4", clip, crf=30)).read_bytes()
    assert b" crf=30.0 " in data and b" crf=18.0 " not in data


def test_write_video_fps_check(tmp_path):
    """fps must be finite and > 0 (0, -1, inf, nan raise ValueError and write nothing); a rate below 1 fps such as
    0.5 is written as is."""
    clip = torch.rand(1, 3, 16, 16)
    for bad in (0, 0.0, -1, -2.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="fps must be positive"):
            write_video(tmp_path / "bad.mp4", clip, fps=bad)
    assert not list(tmp_path.iterdir())
    info = probe_video(write_video(tmp_path / "slow.mp4", clip, fps=0.5))
    assert (info.num_frames, info.fps) == (1, 0.5)


def test_write_video_upscale_and_even_padding(tmp_path):
    """min_side <= 0 never upscales (here -1: 16x16 stays 16x16); an odd height or width alone is padded by repeating
    the last row / column (17x32 -> 18x32, 16x33 -> 16x34): a white frame reads back white on the added row and
    column, not black."""
    white = torch.ones(1, 3, 16, 16)
    info = probe_video(write_video(tmp_path / "native.mp4", white, min_side=-1))
    assert (info.height, info.width) == (16, 16)
    for (h, w), padded in (((17, 32), (18, 32)), ((16, 33), (16, 34))):
        path = write_video(tmp_path / f"odd{h}x{w}.mp4", torch.ones(1, 3, h, w), fps=4, min_side=0)
        info = probe_video(path)
        assert (info.height, info.width) == padded
        back = read_video(path, 1)
        assert back[..., -1, :].min() > 0.9 and back[..., :, -1].min() > 0.9


def test_write_video_muxes_packets_produced_while_encoding(tmp_path):
    """Every frame reaches the file, including the packets x264 returns while frames are still being sent (beyond
    its look-ahead), not only those flushed at the end: 64 frames in, 64 frames out, in order."""
    clip = torch.zeros(64, 3, 32, 32)  # 32 wide: decord 0.6 fails on some reads of 16-wide frames (see above)
    clip[:, 0] = (torch.arange(64, dtype=torch.float32) / 63).view(64, 1, 1)  # red ramps up over time
    path = write_video(tmp_path / "long.mp4", clip, fps=16, min_side=0)
    assert probe_video(path).num_frames == 64
    back = read_video(path, 64)
    red = back[:, 0].mean(dim=(1, 2))
    assert (red - clip[:, 0, 0, 0]).abs().max() < 0.05


# --------------------------------------------------------------------------- write_json




def test_write_json_default_layout_keeps_key_order_and_unicode(tmp_path):
    """By default write_json indents by 2, keeps the mapping's key order and writes non-ASCII text as UTF-8 characters
    (no \\u escapes), with a trailing newline; indent=4 and sort_keys=True are passed through."""
    obj = {"b": 1, "a": ["café", 2]}
    path = write_json(tmp_path / "rec.json", obj)
    assert path.read_bytes() == '{\n  "b": 1,\n  "a": [\n    "café",\n    2\n  ]\n}\n'.encode()
    path = write_json(tmp_path / "rec4.json", obj, indent=4, sort_keys=True)
    assert path.read_text(encoding="utf-8") == '{\n    "a": [\n        "café",\n        2\n    ],\n    "b": 1\n}\n'


def test_write_json_is_utf8_whatever_the_locale(tmp_path):
    """The file is UTF-8 even where the locale's encoding is ASCII (LC_CTYPE = "C")."""
    with ascii_locale():
        path = write_json(tmp_path / "c.json", {"caption": "café ☕"}, indent=None)
    assert path.read_bytes() == '{"caption": "café ☕"}\n'.encode()


# --------------------------------------------------------------------------- atomic_write


def test_atomic_write_hidden_temp_file_in_the_target_folder(tmp_path):
    """atomic_write creates missing parent folders (several levels), and write() fills a temporary file in the target
    folder itself (so os.replace stays on one file system) that is hidden (".<name>.", so folder scans skip it while it
    is written) and ends in ".tmp"; afterwards only the target remains."""
    seen = []

    def write(tmp: str) -> None:
        seen.append(Path(tmp))
        Path(tmp).write_bytes(b"payload")

    path = tmp_path / "a" / "b" / "clip.mp4"
    assert atomic_write(path, write) == path
    assert path.read_bytes() == b"payload"
    (tmp,) = seen
    assert tmp.parent == path.parent
    assert tmp.name.startswith(".clip.mp4.") and tmp.name.endswith(".tmp"), tmp.name
    assert list(path.parent.iterdir()) == [path]


def test_atomic_write_mode_0644_and_cleanup_on_failure(tmp_path):
    """The written file gets mode 0644 (not mkstemp's 0600, nor executable); when write() fails, its own exception
    propagates, the temporary file is removed and an existing target is left as it was."""
    path = tmp_path / "rec.json"
    atomic_write(path, lambda tmp: Path(tmp).write_text("old"))
    assert path.stat().st_mode & 0o777 == 0o644

    class WriteFailed(Exception):
        pass

    def write(tmp: str) -> None:
        Path(tmp).write_text("partial")
        raise WriteFailed("disk full")

    with pytest.raises(WriteFailed, match="disk full"):
        atomic_write(path, write)
    assert list(tmp_path.iterdir()) == [path] and path.read_text() == "old"
