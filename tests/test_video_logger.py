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
