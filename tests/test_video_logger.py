"""VideoLogger: the predict hook writes the first batches' samples under the "predict" tag with a manifest."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from genrl.callbacks.video_logger import VideoLogger


def test_predict_batch_end_writes_tagged_files_and_manifest(tmp_path):
    """on_predict_batch_end writes predict_<batch>_<i>.png (T = 1) for batches below max_batches, with prompts."""
    trainer = SimpleNamespace(is_global_zero=True, log_dir=None, default_root_dir=str(tmp_path), global_step=12,
                              logger=None)
    cb = VideoLogger(max_videos=2, max_batches=2)
    videos = torch.rand(3, 1, 3, 4, 4)
    cb.on_predict_batch_end(trainer, None, {"videos": videos, "prompts": ["a", "b", "c"]}, None, 1)
    cb.on_predict_batch_end(trainer, None, {"videos": videos, "prompts": ["d", "e", "f"]}, None, 2)  # >= max_batches
    root = tmp_path / "videos" / "step_0000012"
    assert sorted(p.name for p in root.iterdir()) == ["manifest.jsonl", "predict_001_00.png", "predict_001_01.png"]
    lines = [json.loads(x) for x in (root / "manifest.jsonl").read_text().splitlines()]
    assert lines == [{"file": "predict_001_00.png", "prompt": "a"}, {"file": "predict_001_01.png", "prompt": "b"}]


def test_filmstrip_puts_frames_side_by_side_upscales_by_blocks_and_clamps():
    """filmstrip([T, C, H, W]) is [C, H*s, T*W*s]: pixel (c, h*s+i, (t*W+w)*s+j) is frame t's (c, h, w) clamped
    to [0, 1]; the default scale is 1 (no upscale), and scale 2 already upscales."""
    from genrl.callbacks.video_logger import filmstrip

    T, C, H, W = 3, 2, 2, 3
    video = torch.arange(T * C * H * W, dtype=torch.float64).reshape(T, C, H, W) / 15 - 0.8  # -0.8 .. 1.53
    expected = torch.empty(C, H, T * W, dtype=torch.float64)
    for t in range(T):
        for c in range(C):
            for h in range(H):
                for w in range(W):
                    expected[c, h, t * W + w] = min(max(video[t, c, h, w].item(), 0.0), 1.0)
    assert (video < 0).any() and ((video > 1) & (video < 2)).any() and ((video > 0) & (video < 1)).any()
    assert torch.equal(filmstrip(video), expected)
    assert torch.equal(filmstrip(video, 1), expected)
    for s in (2, 3):
        up = torch.empty(C, H * s, T * W * s, dtype=torch.float64)
        for h in range(H):
            for x in range(T * W):
                up[:, h * s:(h + 1) * s, x * s:(x + 1) * s] = expected[:, h, x, None, None]
        assert torch.equal(filmstrip(video, s), up), s


class _Experiment:
    """A TensorBoard-like experiment that records add_image / add_text calls (global_step missing -> 'unset')."""

    def __init__(self) -> None:
        self.images: list = []
        self.texts: list = []

    def add_image(self, tag, image, global_step="unset"):
        self.images.append((tag, image, global_step))

    def add_text(self, tag, text, global_step="unset"):
        self.texts.append((tag, text, global_step))


def _trainer(tmp_path, logger=None, step=3):
    return SimpleNamespace(is_global_zero=True, log_dir=None, default_root_dir=str(tmp_path), global_step=step,
                           logger=logger, sanity_checking=False)


def test_validation_batches_write_mp4s_manifest_and_tensorboard_strips(tmp_path):
    """on_validation_batch_end writes val_<batch>_<i>.mp4 at the callback's fps (.png for one frame) for two batches
    into the same step folder, a manifest with the prompts, and one add_image (the filmstrip at strip_scale) and
    add_text per video with tag val/<batch>_<i> at the global step."""
    from genrl.callbacks.video_logger import filmstrip
    from genrl.data.video_io import probe_video

    exp = _Experiment()
    trainer = _trainer(tmp_path, logger=SimpleNamespace(experiment=exp), step=7)
    cb = VideoLogger(max_videos=2, max_batches=2, fps=5, strip_scale=2)
    torch.manual_seed(0)
    v0, v1 = torch.rand(3, 3, 3, 8, 8), torch.rand(1, 1, 3, 8, 8)
    cb.on_validation_batch_end(trainer, None, {"videos": v0, "prompts": ["a", "b", "c"]}, None, 0)
    cb.on_validation_batch_end(trainer, None, {"videos": v1, "prompts": ["d"]}, None, 1)  # same folder again
    root = tmp_path / "videos" / "step_0000007"
    names = ["val_000_00.mp4", "val_000_01.mp4", "val_001_00.png"]
    assert sorted(p.name for p in root.iterdir()) == ["manifest.jsonl", *names]
    for name in names[:2]:
        info = probe_video(root / name)
        assert (info.num_frames, info.fps) == (3, 5.0), name
    lines = [json.loads(x) for x in (root / "manifest.jsonl").read_text().splitlines()]
    assert lines == [{"file": n, "prompt": p} for n, p in zip(names, "abd")]
    assert [(tag, step) for tag, _, step in exp.images] == [("val/0_0", 7), ("val/0_1", 7), ("val/1_0", 7)]
    for (_, image, _), video in zip(exp.images, [v0[0], v0[1], v1[0]]):
        assert image.shape == (3, 16, 16 * video.shape[0]) and torch.equal(image, filmstrip(video, 2))
    assert exp.texts == [("val/0_0/prompt", "a", 7), ("val/0_1/prompt", "b", 7), ("val/1_0/prompt", "d", 7)]


def test_write_skips_outputs_without_videos_and_sanity_checks_and_defaults_prompts(tmp_path):
    """Nothing is written for outputs that are not a dict with "videos", nor during the sanity check; outputs
    without "prompts" get empty prompts in the manifest; a logger whose experiment has no add_image gets no strips."""
    cb = VideoLogger(max_videos=4, max_batches=1)
    trainer = _trainer(tmp_path, logger=SimpleNamespace(experiment=SimpleNamespace(add_text=None)))
    for outputs in (None, {"loss": torch.tensor(1.0)}, torch.rand(2, 1, 3, 4, 4)):
        cb.on_validation_batch_end(trainer, None, outputs, None, 0)
    sanity = _trainer(tmp_path)
    sanity.sanity_checking = True
    cb.on_validation_batch_end(sanity, None, {"videos": torch.rand(1, 1, 3, 4, 4)}, None, 0)
    assert not (tmp_path / "videos").exists()
    cb.on_validation_batch_end(trainer, None, {"videos": torch.rand(2, 1, 3, 4, 4)}, None, 0)
    root = tmp_path / "videos" / "step_0000003"
    lines = [json.loads(x) for x in (root / "manifest.jsonl").read_text().splitlines()]
    assert lines == [{"file": "val_000_00.png", "prompt": ""}, {"file": "val_000_01.png", "prompt": ""}]


def test_image_png_holds_the_rounded_clamped_pixels(tmp_path):
    """A one-frame video is written as an RGB png whose pixel is round(clamp(v, 0, 1) * 255) (k / 255 -> k,
    below 0 -> 0, above 1 -> 255)."""
    import numpy as np
    from PIL import Image

    ks = torch.tensor([0, 1, 51, 127, 128, 153, 200, 254, 255], dtype=torch.float64)
    values = torch.cat([ks / 255, torch.tensor([-0.5, 1.5, -3.0], dtype=torch.float64)])
    want = np.concatenate([ks.numpy(), [0, 255, 0]]).astype(np.uint8)
    pixels = torch.stack([values, values.flip(0), values.roll(3)])  # [3, 12]: channels differ
    video = pixels.reshape(3, 3, 4)[None, None].float()  # [B=1, T=1, C=3, H=3, W=4]
    cb = VideoLogger()
    cb.on_predict_batch_end(_trainer(tmp_path), None, {"videos": video, "prompts": ["x"]}, None, 0)
    array = np.asarray(Image.open(tmp_path / "videos" / "step_0000003" / "predict_000_00.png"))
    expected = np.stack([want, want[::-1], np.roll(want, 3)]).reshape(3, 3, 4).transpose(1, 2, 0)
    assert array.dtype == np.uint8 and array.shape == (3, 4, 3)
    np.testing.assert_array_equal(array, expected)
