"""A LightningDataModule over a folder of captioned video files.

Layout (scanned recursively; hidden files and folders, whose names start with ".", are ignored)::

    root/
      clip_a.mp4   clip_a.txt          # sidecar caption: same stem, `caption_ext`
      sub/clip_b.webm                   # caption from root/captions.jsonl (below)
      captions.jsonl                    # optional: {"file": "sub/clip_b.webm", "caption": "..."}

Each video's caption is looked up in this order:

1. the sidecar file next to it with the same stem and ``caption_ext`` (``clip.mp4`` ->
   ``clip.txt``), read as UTF-8 with surrounding whitespace stripped;
2. a JSON-lines index in ``root``: ``captions.jsonl`` and/or ``metadata.jsonl`` (the first wins
   when both list a file). One object per line with ``"file"`` (or ``"file_name"``, the Hugging
   Face imagefolder key): the video's path relative to ``root`` with "/" separators, and
   ``"caption"``;
3. ``default_caption``.

A video with none of these is an error at ``setup()`` naming the video and the sidecar path it
expected. Items are decoded by :func:`genrl.data.video_io.read_video`; a corrupt or too-short file
raises :class:`~genrl.data.video_io.VideoReadError` naming it when it is loaded, unless
``skip_bad=True`` drops it at ``setup()``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from genrl.data.video_io import VideoReadError, clip_indices, probe_video, read_video

__all__ = [
    "CAPTION_INDEX_FILES",
    "DEFAULT_VIDEO_EXTENSIONS",
    "VideoFolderDataModule",
    "VideoFolderDataset",
    "collate_videos",
]

log = logging.getLogger(__name__)

DEFAULT_VIDEO_EXTENSIONS: tuple[str, ...] = (".mp4", ".webm", ".mov", ".mkv", ".avi")
"""File suffixes (case-insensitive) treated as videos by default."""

CAPTION_INDEX_FILES: tuple[str, ...] = ("captions.jsonl", "metadata.jsonl")
"""JSON-lines caption indexes looked for in the data root, in priority order."""


class VideoFolderDataset(Dataset):
    """Decodes (video path, caption) pairs into genrl pixel clips.

    Args:
        samples: ``(path, caption)`` pairs.
        num_frames: frames per clip T.
        fps: sampling frame rate (frames / s), or None for each file's native rate.
        size: output ``(H, W)``.
        start: clip start in seconds.

    Items are dicts ``{"pixels": float32 [T, 3, H, W] in [0, 1], "prompts": str, "path": str}``.
    ``__getitem__`` raises :class:`VideoReadError` (naming the file) for an unreadable or too-short
    video and :class:`FileNotFoundError` for one deleted since the scan.
    """

    def __init__(
        self,
        samples: Sequence[tuple[str, str]],
        num_frames: int,
        fps: float | None,
        size: tuple[int, int],
        start: float = 0.0,
    ):
        self.samples = list(samples)
        self.num_frames = num_frames
        self.fps = fps
        self.size = size
        self.start = start

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, caption = self.samples[index]
        pixels = read_video(path, self.num_frames, fps=self.fps, start=self.start, size=self.size)
        return {"pixels": pixels, "prompts": caption, "path": path}


def collate_videos(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Batch dataset items.

    Args:
        items: dicts from :class:`VideoFolderDataset` with equal pixel shapes.

    Returns:
        ``{"pixels": float32 [B, T, 3, H, W] in [0, 1], "prompts": list[str] (B),
        "path": list[str] (B)}``.

    Raises:
        ValueError: ``items`` is empty.
    """
    if not items:
        raise ValueError("collate_videos got an empty batch")
    return {
        "pixels": torch.stack([item["pixels"] for item in items]),
        "prompts": [item["prompts"] for item in items],
        "path": [item["path"] for item in items],
    }


def _normalise_extensions(extensions: Sequence[str]) -> tuple[str, ...]:
    if isinstance(extensions, str):
        extensions = [extensions]
    out = []
    for ext in extensions:
        ext = str(ext).strip().lower()
        if not ext:
            continue
        out.append(ext if ext.startswith(".") else "." + ext)
    if not out:
        raise ValueError("extensions must list at least one file suffix, e.g. ['.mp4']")
    return tuple(dict.fromkeys(out))


class VideoFolderDataModule(LightningDataModule):
    """Captioned videos from a folder, as batches of genrl pixels.

    ``__init__`` only stores and checks arguments; ``setup()`` scans ``root`` recursively, finds
    captions (sidecar file, then ``captions.jsonl`` / ``metadata.jsonl`` in root, then
    ``default_caption``; see the module docstring), optionally probes and drops bad files, and
    splits off a validation set. Clips are decoded in the dataloader workers.

    Batches: ``{"pixels": float32 [B, T, 3, H, W] in [0, 1], "prompts": list[str],
    "path": list[str]}`` with T = ``num_frames``, (H, W) = (``height``, ``width``). Frames are
    sampled at ``fps`` from ``start`` seconds (see :func:`genrl.data.video_io.read_video`) and
    resized (short side) then center-cropped to (H, W).

    Args:
        root: folder with the videos (searched recursively).
        num_frames: frames per clip T (>= 1).
        fps: sampling frame rate in frames / s, or None for each file's native rate.
        height: output frame height H (>= 1).
        width: output frame width W (>= 1).
        batch_size: clips per batch (>= 1).
        num_workers: dataloader worker processes (>= 0).
        caption_ext: suffix of sidecar caption files (".txt": ``clip.mp4`` -> ``clip.txt``).
        default_caption: caption for videos without one; None makes a missing caption an error.
        extensions: video file suffixes to collect (case-insensitive).
        val_fraction: share of videos held out for validation, in [0, 1). When > 0 at least one
            video is held out and at least one must remain for training. 0 means no validation
            loader (``val_dataloader()`` returns an empty list).
        seed: seeds the train / validation split and the training shuffle order.
        start: clip start in seconds, the same for every video.
        skip_bad: if True, ``setup()`` probes every file's header with decord (frame count and
            rate, first frame) and drops, with a logged warning, files that cannot be opened or
            are too short for the requested clip. If False (default) nothing is probed and such a
            file raises :class:`VideoReadError` naming it when its batch is loaded.

    Raises (from ``__init__``):
        ValueError: an argument is out of range.

    Raises (from ``setup()``):
        FileNotFoundError: ``root`` does not exist; ``root`` holds no file with one of
            ``extensions`` (the message lists them); a video has no caption and no
            ``default_caption`` is set (the message names the video and the expected sidecar).
        NotADirectoryError: ``root`` is a file.
        ValueError: a malformed caption index line (file and line number given), a split that
            leaves no training video, or every video dropped by ``skip_bad``.
    """

    def __init__(
        self,
        root: str,
        num_frames: int = 16,
        fps: float | None = None,
        height: int = 64,
        width: int = 64,
        batch_size: int = 4,
        num_workers: int = 0,
        caption_ext: str = ".txt",
        default_caption: str | None = None,
        extensions: Sequence[str] = DEFAULT_VIDEO_EXTENSIONS,
        val_fraction: float = 0.0,
        seed: int = 0,
        start: float = 0.0,
        skip_bad: bool = False,
    ):
        super().__init__()
        for name, value, low in (
            ("num_frames", num_frames, 1),
            ("height", height, 1),
            ("width", width, 1),
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if fps is not None and not fps > 0:
            raise ValueError(f"fps must be > 0 or None (native rate), got {fps!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        if not start >= 0:
            raise ValueError(f"start must be >= 0 seconds, got {start!r}")
        self.save_hyperparameters()
        self.root = root
        self.num_frames = num_frames
        self.fps = fps
        self.height = height
        self.width = width
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.caption_ext = caption_ext if caption_ext.startswith(".") else "." + caption_ext
        self.default_caption = default_caption
        self.extensions = _normalise_extensions(extensions)
        self.val_fraction = float(val_fraction)
        self.seed = seed
        self.start = float(start)
        self.skip_bad = skip_bad
        self.train_dataset: VideoFolderDataset | None = None
        self.val_dataset: VideoFolderDataset | None = None

    # ------------------------------------------------------------------ scanning

    def _find_videos(self, root: Path) -> list[Path]:
        if not root.exists():
            raise FileNotFoundError(f"Video folder root does not exist: {str(root)!r}")
        if not root.is_dir():
            raise NotADirectoryError(f"Video folder root is not a directory: {str(root)!r}")
        videos = []
        for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                suffix = os.path.splitext(name)[1].lower()
                if not name.startswith(".") and suffix in self.extensions:
                    videos.append(Path(dirpath) / name)
        if not videos:
            raise FileNotFoundError(
                f"No videos found under {str(root)!r} (searched recursively for files ending in "
                f"{', '.join(self.extensions)}; hidden files are ignored). Point `root` at the "
                f"folder with your clips or set `extensions`."
            )
        return sorted(videos)

    @staticmethod
    def _read_caption_index(root: Path) -> dict[str, str]:
        captions: dict[str, str] = {}
        for index_name in reversed(CAPTION_INDEX_FILES):  # earlier files override later ones
            index_path = root / index_name
            if not index_path.is_file():
                continue
            with open(index_path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        entry = json.loads(line)
                        file = entry.get("file", entry.get("file_name"))
                        caption = entry["caption"]
                    except (json.JSONDecodeError, AttributeError, KeyError) as err:
                        raise ValueError(
                            f"{str(index_path)!r} line {line_no}: expected a JSON object like "
                            f'{{"file": "clip.mp4", "caption": "..."}}, got {line.strip()[:200]!r} '
                            f"({type(err).__name__}: {err})"
                        ) from err
                    if not isinstance(file, str) or not isinstance(caption, str):
                        raise ValueError(
                            f"{str(index_path)!r} line {line_no}: 'file' (or 'file_name') and "
                            f"'caption' must be strings, got {line.strip()[:200]!r}"
                        )
                    # normalise separators and "./a.mp4" -> "a.mp4" to match the scan's keys
                    captions[Path(file.replace("\\", "/")).as_posix()] = caption
        return captions

    def _caption_for(self, video: Path, root: Path, index: dict[str, str]) -> str:
        sidecar = video.with_suffix(self.caption_ext)
        if sidecar.is_file():
            return sidecar.read_text(encoding="utf-8").strip()
        rel = video.relative_to(root).as_posix()
        if rel in index:
            return index[rel]
        if self.default_caption is not None:
            return self.default_caption
        raise FileNotFoundError(
            f"No caption for video {str(video)!r}: expected a sidecar file {str(sidecar)!r}, or an "
            f'entry {{"file": {rel!r}, "caption": ...}} in '
            f"{str(root / CAPTION_INDEX_FILES[0])!r} or {str(root / CAPTION_INDEX_FILES[1])!r}, "
            f"or set `default_caption`."
        )

    def _usable(self, path: str) -> bool:
        try:
            info = probe_video(path)
            clip_indices(info.num_frames, info.fps, self.num_frames, self.fps, self.start, path)
        except (VideoReadError, FileNotFoundError) as err:
            log.warning("Skipping video (skip_bad=True): %s", err)
            return False
        return True

    def setup(self, stage: str | None = None) -> None:
        """Scan ``root``, resolve captions, optionally drop bad files, and split train / val.

        Idempotent: later calls (one per Trainer stage) reuse the first scan.

        Raises:
            See the class docstring.
        """
        if self.train_dataset is not None:
            return
        root = Path(self.root).expanduser()
        videos = self._find_videos(root)
        index = self._read_caption_index(root)
        samples = [(str(v), self._caption_for(v, root, index)) for v in videos]
        if self.skip_bad:
            kept = [s for s in samples if self._usable(s[0])]
            if not kept:
                raise ValueError(
                    f"skip_bad=True dropped all {len(samples)} videos under {str(root)!r}: none "
                    f"could be read with num_frames={self.num_frames}, fps={self.fps}, "
                    f"start={self.start} s (see the warnings above)."
                )
            if len(kept) < len(samples):
                log.warning("Dropped %d of %d videos under %r.", len(samples) - len(kept),
                            len(samples), str(root))
            samples = kept

        train, val = samples, []
        if self.val_fraction > 0:
            n = len(samples)
            n_val = max(1, int(round(n * self.val_fraction)))
            if n_val >= n:
                raise ValueError(
                    f"val_fraction={self.val_fraction} holds out {n_val} of {n} videos under "
                    f"{str(root)!r}, leaving none for training; lower val_fraction or add videos."
                )
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed)).tolist()
            val_ids = set(order[:n_val])
            train = [s for i, s in enumerate(samples) if i not in val_ids]
            val = [s for i, s in enumerate(samples) if i in val_ids]

        size = (self.height, self.width)
        self.train_dataset = VideoFolderDataset(train, self.num_frames, self.fps, size, self.start)
        self.val_dataset = VideoFolderDataset(val, self.num_frames, self.fps, size, self.start)

    # --------------------------------------------------------------- dataloaders

    def _loader(self, dataset: VideoFolderDataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            collate_fn=collate_videos,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (order seeded by ``seed``); runs ``setup()`` if needed."""
        self.setup()
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        """Validation batches in file order, or ``[]`` (no validation) when none are held out."""
        self.setup()
        if len(self.val_dataset) == 0:
            return []
        return self._loader(self.val_dataset, shuffle=False)
