"""Log sampled videos: mp4 files on disk and frame strips in TensorBoard (or any logger with images)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from genrl.data.video_io import write_video

__all__ = ["VideoLogger", "filmstrip"]


def filmstrip(video: torch.Tensor, scale: int = 1) -> torch.Tensor:
    """[T, C, H, W] in [0, 1] -> one image [C, H, T*W] (frames side by side), nearest-upscaled by ``scale``."""
    strip = torch.cat(list(video), dim=-1)
    if scale > 1:
        strip = strip.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    return strip.clamp(0, 1)


class VideoLogger(Callback):
    """Write the videos that a method's ``validation_step`` / ``predict_step`` returns.

    The step must return ``{"videos": float [B, T, C, H, W] in [0, 1], "prompts": list[str]}``. For the
    first ``max_videos`` samples of the first ``max_batches`` batches, writes
    ``<dirpath>/step_<global_step>/<i>.mp4`` (``.png`` when T = 1, image families) with a ``manifest.jsonl``
    (prompt per file), and, when the
    trainer's logger is TensorBoard, adds a frame strip per video under ``samples/<i>``.

    Args:
        dirpath: output folder; default ``<trainer.log_dir>/videos``.
        max_videos: videos written per batch.
        max_batches: batches written per validation run.
        fps: frames per second of the mp4s.
        strip_scale: nearest-neighbour upscale of the TensorBoard strips (tiny videos are 16 px).
    """

    def __init__(
        self, dirpath: str | None = None, max_videos: int = 8, max_batches: int = 1, fps: int = 8, strip_scale: int = 4
    ) -> None:
        self.dirpath = dirpath
        self.max_videos = max_videos
        self.max_batches = max_batches
        self.fps = fps
        self.strip_scale = strip_scale

    def _root(self, trainer: Trainer) -> Path:
        base = self.dirpath or os.path.join(trainer.log_dir or trainer.default_root_dir, "videos")
        return Path(base) / f"step_{trainer.global_step:07d}"

    def _write(self, trainer: Trainer, outputs, batch_idx: int, tag: str) -> None:
        if batch_idx >= self.max_batches or not isinstance(outputs, dict) or "videos" not in outputs:
            return
        if not trainer.is_global_zero:
            return
        videos = outputs["videos"].detach().float().cpu()[: self.max_videos]
        prompts = list(outputs.get("prompts", [""] * len(videos)))[: self.max_videos]
        root = self._root(trainer)
        root.mkdir(parents=True, exist_ok=True)
        experiment = getattr(trainer.logger, "experiment", None)
        with open(root / "manifest.jsonl", "a") as manifest:
            for i, (video, prompt) in enumerate(zip(videos, prompts)):
                if video.shape[0] == 1:  # an image family: a png, not a one-frame mp4
                    from PIL import Image

                    name = f"{tag}_{batch_idx:03d}_{i:02d}.png"
                    array = (video[0].clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
                    Image.fromarray(array).save(root / name)
                else:
                    name = f"{tag}_{batch_idx:03d}_{i:02d}.mp4"
                    write_video(root / name, video, fps=self.fps)
                manifest.write(json.dumps({"file": name, "prompt": prompt}) + "\n")
                if experiment is not None and hasattr(experiment, "add_image"):
                    experiment.add_image(
                        f"{tag}/{batch_idx}_{i}", filmstrip(video, self.strip_scale), trainer.global_step
                    )
                    if hasattr(experiment, "add_text"):
                        experiment.add_text(f"{tag}/{batch_idx}_{i}/prompt", prompt, trainer.global_step)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking:
            return
        self._write(trainer, outputs, batch_idx, "val")

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._write(trainer, outputs, batch_idx, "predict")
