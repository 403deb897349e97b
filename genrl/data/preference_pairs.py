"""Preference pairs for offline Diffusion-DPO: a folder of videos with labelled pairs or pointwise scores.

Offline Diffusion-DPO (Wallace et al. 2024, "Diffusion Model Alignment Using Direct Preference Optimization",
Pick-a-Pic v2 pairs) trains on fixed (chosen, rejected) pairs of the same prompt instead of the policy's own samples.
:class:`PreferencePairDataModule` reads them from one folder, in either of two layouts::

    folder/                                   folder/
      pairs.jsonl                               scores.jsonl
      a/0001.mp4  a/0002.mp4  ...               00000.mp4  00001.mp4  ...

* ``pairs.jsonl`` (a labelled preference set, e.g. exported from Pick-a-Pic style labels): one JSON object per line,
  ``{"prompt": str, "chosen": "a/0001.mp4", "rejected": "a/0002.mp4"}``, paths relative to the folder with "/"
  separators. Pair ``j`` is the ``j``-th non-blank line.
* ``scores.jsonl`` (a folder of scored samples, e.g. ``benchmarks/make_pair_folder.py``, or ``pipelines/
  generate.py`` followed by a scorer): ``{"file": "00000.mp4", "prompt": str, "score": float | null}`` per video.
  The videos of one prompt (the exact string) form a group. ``pairs: best_worst`` (default) gives each group its
  (best, worst) pair by :func:`genrl.flow.selection.best_worst_pairs`: one stable ascending sort by (score, line),
  the rejected the first and the chosen the last of that order; a NaN / null / infinite score is never paired; a
  group with fewer than 2 finite scores gives none; a group whose finite scores are all equal gives none under
  ``tie: skip`` and its (last, first) pair under ``tie: arbitrary`` (flow_grpo's rule). ``pairs: all`` gives every
  ordered pair (i, j) of a group with score_i - score_j > 0 (ties never). Either way a pair whose margin
  score(chosen) - score(rejected) is below ``min_margin`` is dropped. Pairs are numbered in the order of their
  group's first line (then, for ``all``, by the chosen's and the rejected's lines).

``source: auto`` reads whichever of the two files the folder holds (both is an error: set ``source``). Videos are
decoded by :func:`genrl.data.video_io.read_video` (``num_frames`` frames at ``fps`` from the start, resized and
center-cropped to ``height`` x ``width``; None keeps the file's own length / rate / size); ``.png`` / ``.jpg`` /
``.jpeg`` / ``.webp`` files are read as one-frame videos (image preference sets).

Training stream: the :class:`~genrl.data.prompts.PromptStream` design with group size 1. Global batch ``b`` holds
the pair slots ``s = b * B + k`` (``k < B = batch_size``); slot ``s`` is entry ``s mod N`` of the permutation of
epoch ``s // N`` of the ``N`` pairs, seeded by ``(seed, epoch)`` (the identity without ``shuffle``), so each epoch
has its own order, epochs continue across batch boundaries, and a batch is a pure function of its number. Rank ``r``
of ``W`` takes the contiguous slice ``r`` (``B / W`` pairs) of every global batch. Batches::

    {"prompts":       list[str] (B / W),
     "chosen":        float32 [B / W, T, C, H, W] in [0, 1]   the preferred member,
     "rejected":      float32 [B / W, T, C, H, W] in [0, 1]   the other member (same T, C, H, W),
     "index":         int64 [B / W]  global pair-slot ids s (unique over the stream; they address the noise),
     "pair":          int64 [B / W]  the pair's number in the pair set (0 .. N - 1),
     "margin":        float32 [B / W] score(chosen) - score(rejected) (NaN for labelled pairs),
     "chosen_file":   list[str], "rejected_file": list[str]  (relative to the folder)}

Resume is exact, as for every genrl stream (:class:`~genrl.data.shapes_datamodule.ResumableStreamDataModule`: the
batches delivered to ``training_step`` are counted and checkpointed). Validation batches are prompt batches
(``{"prompts", "index" (negative), "group", "metadata"}``, :func:`~genrl.data.prompts.val_prompt_batches`) for a
method's sampling validation (``flat_validation_step``): the pairs' own distinct prompts (``val: pairs``), or any
source :func:`~genrl.data.prompts.load_prompts` takes (e.g. ``shapes:heldout``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader

from genrl.data.prompts import PromptRecord, PromptStream, load_prompts, val_prompt_batches
from genrl.data.shapes import ShapesWorldConfig, as_world
from genrl.data.shapes_datamodule import ResumableStreamDataModule, ShapesTrainLoader
from genrl.data.video_io import probe_video, read_video, resize_center_crop
from genrl.flow.selection import best_worst_pairs

__all__ = ["IMAGE_EXTENSIONS", "PAIRS_FILE", "SCORES_FILE", "PairStream", "PreferencePair",
           "PreferencePairDataModule", "load_pair_set"]

log = logging.getLogger(__name__)

PAIRS_FILE = "pairs.jsonl"
"""Labelled pairs: ``{"prompt", "chosen", "rejected"}`` per line."""
SCORES_FILE = "scores.jsonl"
"""Scored videos: ``{"file", "prompt", "score"}`` per line."""
IMAGE_EXTENSIONS: tuple[str, ...] = (".png", ".jpg", ".jpeg", ".webp")
"""Suffixes read as one-frame videos."""


@dataclass(frozen=True)
class PreferencePair:
    """One pair: the prompt, the chosen and rejected files (relative to the folder), the score margin (NaN for a
    labelled pair) and where it came from (``"pairs.jsonl line 3"``, ``"scores.jsonl lines 4 / 7"``)."""

    prompt: str
    chosen: str
    rejected: str
    margin: float
    where: str


def _lines(path: Path, keys: tuple[str, ...], example: str) -> list[tuple[int, dict]]:
    """The JSON objects of a JSON-lines file with their line numbers (blank lines skipped).

    Raises:
        ValueError: malformed JSON, not an object, or a missing key (file, line and the expected form named).
    """
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{str(path)!r} line {n}: malformed JSON ({err.msg}, column {err.colno}); expected "
                             f"{example}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{str(path)!r} line {n}: expected a JSON object like {example}, got "
                             f"{type(obj).__name__}")
        missing = [k for k in keys if k not in obj]
        if missing:
            raise ValueError(f"{str(path)!r} line {n}: missing key {', '.join(map(repr, missing))} (keys present: "
                             f"{', '.join(map(repr, obj)) or 'none'}); expected {example}")
        out.append((n, obj))
    if not out:
        raise ValueError(f"{str(path)!r} holds no line; expected one JSON object per line like {example}")
    return out


def _file(folder: Path, name: Any, where: str, key: str) -> str:
    """A relative path of a line, checked to be a string naming an existing file."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"{where}: {key!r} must be a file path relative to {str(folder)!r}, got {name!r}")
    rel = Path(name.replace("\\", "/")).as_posix()
    if not (folder / rel).is_file():
        raise FileNotFoundError(f"{where}: {key} file {str(folder / rel)!r} does not exist; fix the path (relative "
                                f"to the folder) or remove the line")
    return rel


def _prompt(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {value!r}")
    return value.strip()


def _labelled_pairs(folder: Path) -> list[PreferencePair]:
    path = folder / PAIRS_FILE
    example = '{"prompt": "...", "chosen": "a.mp4", "rejected": "b.mp4"}'
    out = []
    for n, obj in _lines(path, ("prompt", "chosen", "rejected"), example):
        where = f"{str(path)!r} line {n}"
        chosen, rejected = _file(folder, obj["chosen"], where, "chosen"), _file(folder, obj["rejected"], where,
                                                                                 "rejected")
        if chosen == rejected:
            raise ValueError(f"{where}: chosen and rejected are the same file {chosen!r}: the pair carries no "
                             f"preference (its DPO loss is log 2 with zero gradient); remove the line")
        out.append(PreferencePair(_prompt(obj["prompt"], where), chosen, rejected, math.nan, f"{PAIRS_FILE} line {n}"))
    return out


def _score(value: Any, where: str) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: 'score' must be a number or null (a failed score), got {value!r}")
    return float(value)


def _scored_pairs(folder: Path, pairs: str, tie: str, min_margin: float) -> list[PreferencePair]:
    path = folder / SCORES_FILE
    rows = _lines(path, ("file", "prompt", "score"), '{"file": "00000.mp4", "prompt": "...", "score": 0.7}')
    files, prompts, scores, lines, seen = [], [], [], [], {}
    for n, obj in rows:
        where = f"{str(path)!r} line {n}"
        rel = _file(folder, obj["file"], where, "file")
        if rel in seen:
            raise ValueError(f"{where}: {rel!r} is listed again (first on line {seen[rel]}); score each video once")
        seen[rel] = n
        files.append(rel)
        prompts.append(_prompt(obj["prompt"], where))
        scores.append(_score(obj["score"], where))
        lines.append(n)
    ids = {p: i for i, p in enumerate(dict.fromkeys(prompts))}
    group = torch.tensor([ids[p] for p in prompts])
    counts = torch.bincount(group, minlength=len(ids))
    if bool((counts < 2).any()):
        g = int((counts < 2).nonzero()[0])
        p = next(q for q, i in ids.items() if i == g)
        raise ValueError(f"{str(path)!r} line {lines[prompts.index(p)]}: prompt {p!r} has a single video; a pair "
                         f"needs two videos of the same prompt (generate >= 2 samples per prompt, or remove the line)")
    total = torch.tensor(scores, dtype=torch.float64)
    if pairs == "best_worst":
        chosen, rejected = (t.tolist() for t in best_worst_pairs(total, group, tie=tie))
    else:  # every strictly ordered pair of a group, in line order
        chosen, rejected = [], []
        for g in range(len(ids)):
            members = [i for i in (group == g).nonzero().flatten().tolist() if math.isfinite(scores[i])]
            for i in members:
                for j in members:
                    if scores[i] > scores[j]:
                        chosen.append(i)
                        rejected.append(j)
    return [PreferencePair(prompts[c], files[c], files[r], scores[c] - scores[r],
                           f"{SCORES_FILE} lines {lines[c]} / {lines[r]}")
            for c, r in zip(chosen, rejected, strict=True) if scores[c] - scores[r] >= min_margin]


def load_pair_set(folder: str | Path, source: Literal["auto", "pairs", "scores"] = "auto",
                  pairs: Literal["best_worst", "all"] = "best_worst", tie: Literal["skip", "arbitrary"] = "skip",
                  min_margin: float = 0.0) -> list[PreferencePair]:
    """The pairs of a preference folder (layouts and pairing rules: module docstring).

    Args:
        folder: the folder holding ``pairs.jsonl`` or ``scores.jsonl`` and the files they name.
        source: ``"pairs"`` / ``"scores"`` reads that file; ``"auto"`` the one present.
        pairs, tie, min_margin: the pairing of scored videos (ignored for ``pairs.jsonl``).

    Returns:
        The pairs in order (possibly none from a scored folder, e.g. every group tied under ``tie: skip``).

    Raises:
        FileNotFoundError: no folder, no pair / score file (both names listed), or a line naming a missing file.
        ValueError: both files under ``source: auto``; a malformed line, a missing key, a non-string prompt, a
            non-numeric score, a file scored twice, a prompt with a single scored video, a labelled pair of one
            file (each naming the file and line); an unknown option.
    """
    if source not in ("auto", "pairs", "scores") or pairs not in ("best_worst", "all") or tie not in ("skip",
                                                                                                   "arbitrary"):
        raise ValueError(f"need source auto | pairs | scores, pairs best_worst | all, tie skip | arbitrary; got "
                         f"{source!r}, {pairs!r}, {tie!r}")
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"preference folder {str(root)!r} does not exist (make one with "
                                f"benchmarks/make_pair_folder.py, or point data.init_args.folder at yours)")
    has = {"pairs": (root / PAIRS_FILE).is_file(), "scores": (root / SCORES_FILE).is_file()}
    if source == "auto":
        if all(has.values()):
            raise ValueError(f"{str(root)!r} holds both {PAIRS_FILE} and {SCORES_FILE}; set source: pairs or "
                             f"source: scores")
        source = "pairs" if has["pairs"] else "scores"
    if not has[source]:
        raise FileNotFoundError(f"{str(root)!r} has no {PAIRS_FILE if source == 'pairs' else SCORES_FILE} (a "
                                f"preference folder holds {PAIRS_FILE}: {{prompt, chosen, rejected}} per line, or "
                                f"{SCORES_FILE}: {{file, prompt, score}} per line)")
    return _labelled_pairs(root) if source == "pairs" else _scored_pairs(root, pairs, tie, min_margin)


class PairStream(PromptStream):
    """The stream of pair batches (format and slot rule: module docstring); a batch is a pure function of its number.

    Args:
        folder: the preference folder; pair_set: its pairs (N >= 1).
        batch_size: pairs B per global batch (divisible by ``world_size``); seed, shuffle, rank, world_size: as in
            :class:`~genrl.data.prompts.PromptStream`.
        num_frames, fps, height, width: how files are read (None: the file's own; module docstring).

    Raises:
        ValueError: as PromptStream (no pairs, B < 1, B not divisible by world_size). :meth:`batch` raises
            ValueError when the two members of a pair, or two pairs of a batch, decode to different shapes (naming
            the files and the options that fix it), and the readers' errors (missing / unreadable file).
    """

    def __init__(self, folder: str | Path, pair_set: list[PreferencePair], batch_size: int, seed: int = 0,
                 shuffle: bool = True, rank: int = 0, world_size: int = 1, num_frames: int | None = None,
                 fps: float | None = None, height: int | None = None, width: int | None = None) -> None:
        records = [PromptRecord(p.prompt, {"pair": j}) for j, p in enumerate(pair_set)]
        super().__init__(records, batch_size, 1, seed, shuffle, rank, world_size)
        self.folder, self.pair_set = Path(folder).expanduser(), list(pair_set)
        self.num_frames, self.fps = num_frames, fps
        self.size = (height, width) if height is not None else None

    def read(self, rel: str) -> torch.Tensor:
        """One file as float32 [T, C, H, W] in [0, 1] (an image as T = 1)."""
        path = self.folder / rel
        if path.suffix.lower() in IMAGE_EXTENSIONS:
            import numpy as np
            from PIL import Image

            with Image.open(path) as im:
                pixels = torch.from_numpy(np.asarray(im.convert("RGB"))).permute(2, 0, 1)[None].float() / 255
            return resize_center_crop(pixels, self.size).clamp(0, 1) if self.size else pixels
        frames = self.num_frames or probe_video(path).num_frames
        return read_video(path, frames, fps=self.fps, size=self.size)

    def batch(self, local: int) -> dict[str, Any]:
        """This rank's slice of global batch ``local`` (format: module docstring)."""
        out = super().batch(local)
        ids = [m["pair"] for m in out.pop("metadata")]
        out.pop("group")
        pairs = [self.pair_set[j] for j in ids]
        chosen, rejected = [], []
        for p in pairs:
            w, lo = self.read(p.chosen), self.read(p.rejected)
            if w.shape != lo.shape:
                raise ValueError(f"the pair of {p.where} decodes to {tuple(w.shape)} ({p.chosen!r}) and "
                                 f"{tuple(lo.shape)} ({p.rejected!r}); both members need the same frames and size: "
                                 f"set num_frames, height and width to read every file alike")
            if chosen and w.shape != chosen[0].shape:
                raise ValueError(f"{p.chosen!r} ({p.where}) decodes to {tuple(w.shape)} but {pairs[0].chosen!r} to "
                                 f"{tuple(chosen[0].shape)}; a batch needs one shape: set num_frames, height and "
                                 f"width")
            chosen.append(w)
            rejected.append(lo)
        out.update(chosen=torch.stack(chosen), rejected=torch.stack(rejected),
                   pair=torch.tensor(ids, dtype=torch.int64),
                   margin=torch.tensor([p.margin for p in pairs], dtype=torch.float32),
                   chosen_file=[p.chosen for p in pairs], rejected_file=[p.rejected for p in pairs])
        return out


class PreferencePairDataModule(ResumableStreamDataModule):
    """Offline preference pairs from a folder (layouts, pairing and batch format: the module docstring), for the
    offline path of :class:`genrl.methods.DPO`.

    Args:
        folder: the preference folder (read lazily: at ``setup("fit")`` or the first loader, so a config parses
            without it).
        source: ``"auto"`` (the pair or score file present), ``"pairs"`` or ``"scores"``.
        pairs: scored folders: ``"best_worst"`` (one pair per prompt) or ``"all"`` (every strictly ordered pair).
        tie: scored folders, ``best_worst``: ``"skip"`` (an all-equal prompt gives no pair) or ``"arbitrary"``.
        min_margin: scored folders: drop pairs with score(chosen) - score(rejected) below it (>= 0).
        num_frames / fps / height / width: how files are read (None: the file's own length / rate / size; height
            and width are given together; ``fps`` needs ``num_frames``).
        batch_size: pairs per global batch (each of W ranks takes ``batch_size / W``).
        seed / shuffle: the per-epoch pair permutation (False: file order, cycled).
        val: validation prompts: ``"pairs"`` (the pairs' distinct prompts in order), any source of
            :func:`~genrl.data.prompts.load_prompts` (e.g. ``"shapes:heldout"``), or None.
        val_size: at most this many validation prompts (0 disables validation).
        val_batch_size: prompts per validation batch (default ``batch_size``).
        world: the shapes world of ``"shapes:*"`` sources and of the shapes verifier rewards (exposed as ``.world``).
        prompt_key: JSON key of prompts in validation files.
        num_workers: DataLoader workers decoding training batches.

    Raises:
        ValueError: an argument out of range or an unknown option (at construction). ``setup`` / the loaders raise
            :func:`load_pair_set`'s errors, ValueError when the folder gives no pair, and the stream's errors.
    """

    def __init__(
        self,
        folder: str = "runs/pairs/shapes",
        source: Literal["auto", "pairs", "scores"] = "auto",
        pairs: Literal["best_worst", "all"] = "best_worst",
        tie: Literal["skip", "arbitrary"] = "skip",
        min_margin: float = 0.0,
        num_frames: int | None = None,
        fps: float | None = None,
        height: int | None = None,
        width: int | None = None,
        batch_size: int = 8,
        seed: int = 0,
        shuffle: bool = True,
        val: str | None = "pairs",
        val_size: int = 64,
        val_batch_size: int | None = None,
        world: ShapesWorldConfig | None = None,
        prompt_key: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        optional = {"num_frames": num_frames, "height": height, "width": width, "val_batch_size": val_batch_size}
        for name, value, low in (("batch_size", batch_size, 1), ("val_size", val_size, 0),
                                 ("num_workers", num_workers, 0), *((k, v, 1) for k, v in optional.items())):
            if (value is not None or name not in optional) and (isinstance(value, bool) or not isinstance(value, int)
                                                               or value < low):
                raise ValueError(f"{name} must be an int >= {low}{' or null' if name in optional else ''}, got "
                                 f"{value!r}")
        if (height is None) != (width is None):
            raise ValueError(f"give height and width together (or neither, for each file's own size); got height="
                             f"{height}, width={width}")
        if fps is not None and (not fps > 0 or num_frames is None):
            raise ValueError(f"fps must be > 0 and needs num_frames (frames read at that rate); got fps={fps}, "
                             f"num_frames={num_frames}")
        if not min_margin >= 0:
            raise ValueError(f"min_margin must be >= 0, got {min_margin}")
        if source not in ("auto", "pairs", "scores") or pairs not in ("best_worst", "all") or tie not in (
                "skip", "arbitrary"):
            raise ValueError(f"need source auto | pairs | scores, pairs best_worst | all, tie skip | arbitrary; got "
                             f"{source!r}, {pairs!r}, {tie!r}")
        self.world = as_world(world)
        self.save_hyperparameters_with_world()
        self._pairs: list[PreferencePair] | None = None
        self._val_batches: list[dict[str, Any]] | None = None

    @property
    def pair_set(self) -> list[PreferencePair]:
        """The folder's pairs (read on first access).

        Raises:
            ValueError: the folder gives no pair (e.g. every prompt tied under ``tie: skip``); and
                :func:`load_pair_set`'s errors.
        """
        if self._pairs is None:
            h = self.hparams
            found = load_pair_set(h.folder, h.source, h.pairs, h.tie, h.min_margin)
            if not found:
                raise ValueError(f"{h.folder!r} gives no preference pair (pairs={h.pairs}, tie={h.tie}, min_margin="
                                 f"{h.min_margin}): every prompt's scores tie or fail; use tie: arbitrary, a lower "
                                 f"min_margin, or more samples per prompt")
            log.info("%d preference pairs from %s", len(found), h.folder)
            self._pairs = found
        return self._pairs

    def setup(self, stage: str) -> None:
        """Read the folder's pairs when fitting, so a bad folder fails before training."""
        if stage == "fit":
            _ = self.pair_set

    def make_train_loader(self, rank: int = 0, world_size: int = 1, start: int = 0,
                          track_delivery: bool = False) -> ShapesTrainLoader:
        """A stateful train loader for ``rank`` of ``world_size`` starting at local batch ``start``.

        Raises:
            ValueError: ``batch_size`` not divisible by ``world_size`` (and :attr:`pair_set`'s errors).
        """
        h = self.hparams
        stream = PairStream(h.folder, self.pair_set, h.batch_size, h.seed, h.shuffle, rank, world_size,
                            h.num_frames, h.fps, h.height, h.width)
        loader = ShapesTrainLoader(stream, num_workers=h.num_workers, track_delivery=track_delivery)
        loader.load_state_dict({"batches_consumed": start})
        return loader

    def val_batches(self) -> list[dict[str, Any]]:
        """The validation prompt batches (negative ids; empty when disabled)."""
        if self._val_batches is None:
            h = self.hparams
            if h.val is None or h.val_size == 0:
                self._val_batches = []
            else:
                records = ([PromptRecord(p) for p in dict.fromkeys(q.prompt for q in self.pair_set)]
                           if h.val == "pairs" else load_prompts(h.val, h.prompt_key, world=self.world))
                self._val_batches = val_prompt_batches(records[: h.val_size], h.val_batch_size or h.batch_size)
        return self._val_batches

    def val_dataloader(self) -> DataLoader:
        """The validation batches (empty when disabled)."""
        return DataLoader(self.val_batches(), batch_size=None, shuffle=False)
