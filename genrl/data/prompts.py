"""Prompt sets for RL post-training: file loaders, built-in suites, and a grouped, resumable prompt stream.

Sources :func:`load_prompts` understands:

* ``*.txt``: one prompt per line (surrounding whitespace stripped, blank lines skipped); metadata ``{}``.
* ``*.jsonl``: one JSON object per line; the prompt is under ``prompt_key`` (default ``"prompt"``, else
  ``"prompt_en"``); the whole object is the metadata (GenEval lines keep ``tag`` / ``include`` / ...). A line
  with an ``image`` (a file path, relative to the prompt file's folder or absolute) is an image-to-video prompt:
  its prompt is a :class:`~genrl.models.conditions.Prompt` carrying the image (``.json`` lists alike).
* ``*.json``: a list of strings (metadata ``{}``) or of objects as in ``.jsonl`` (VBench's
  ``VBench_full_info.json`` stores ``prompt_en`` and ``dimension``: it is detected by the ``prompt_en`` key).
* ``"shapes:train"`` / ``"shapes:heldout"`` (and ``"shapes:all"``): every distinct single-step caption of the
  shapes world's split, in a fixed order (combinations in config order, then speeds in config order; a
  still combination has one caption); metadata are the :class:`~genrl.data.shapes.ShapeSpec` fields
  (``directions`` as a list). ``"shapes:<split>:steps2"`` / ``":steps3"``: every two- / three-segment caption
  ("a red circle moves right, then moves up") of moving directions, consecutive ones distinct; held out iff one
  of its (color, shape, direction) combinations is (TempAct's step plans, docs/methods/tempact.md).
* ``"vbench"``, ``"geneval"``, ``"ocr"``: the suites shipped in the repository's ``assets/prompts/`` (see its
  README for sources and licences); ``"vbench:<dimension>"``: VBench's prompts for one dimension.

Training stream (:class:`PromptStream`): global batch ``b`` holds ``P = prompts_per_batch`` prompt slots
``s = b * P + p`` (``p < P``); slot ``s`` is entry ``s mod N`` of the permutation of epoch ``s // N`` of the
``N`` training prompts (seeded by ``(seed, epoch)``; the identity without ``shuffle``), so epochs continue
across batch boundaries. Each prompt is repeated ``K = group_size`` times consecutively: the ``K`` samples of
one group are one prompt's rollouts. Batches are dicts::

    {"prompts":  list[str]  (P*K; prompt of group p at positions p*K .. p*K + K - 1),
     "index":    int64 [P*K] global sample ids b*P*K + j, unique over the whole stream,
     "group":    int64 [P*K] global group ids b*P + p (= index // K),
     "metadata": list[dict] (P*K; a copy per sample)}

Multi-rank: rank ``r`` of ``W`` takes the contiguous slice ``r`` (``P*K/W`` samples) of every global batch;
``P*K`` must be divisible by ``W``. A group may therefore span ranks (when ``K`` does not divide ``P*K/W``);
group ids stay global, so a method all-gathers rewards together with ``group`` and normalises per group
(TRL's lesson: gather before normalising). Local batch ``b`` of every rank is global batch ``b``.

Exact resume under Lightning uses the same stateful-loader design as :mod:`genrl.data.shapes_datamodule`
(the :class:`~genrl.data.shapes_datamodule.ShapesTrainLoader` drives any stream that has ``start`` and
``local_batch``): the DataModule marks the batches delivered to ``training_step`` in
``on_before_batch_transfer`` and the checkpoint stores ``{"batches_consumed": n}``, both in the loop state and
in the DataModule's own state (key ``"PromptDataModule"``).

Validation batches have the same format with negative ids: prompt ``i`` of the validation list has
``index = group = -(i + 1)`` (group size 1), so validation randomness derived from ``(seed, index)`` never
collides with training.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from genrl.assets import VBENCH_DIMENSIONS, assets_dir
from genrl.data.shapes import ShapeSpec, ShapesWorldConfig, as_world, caption, combos, heldout_combos, sample_seed
from genrl.data.shapes_datamodule import ResumableStreamDataModule, ShapesTrainLoader
from genrl.models.conditions import Prompt, image_path

__all__ = [
    "PromptRecord",
    "val_prompt_batches",
    "PromptStream",
    "PromptDataModule",
    "load_prompts",
    "assets_dir",
    "BUILTIN_SUITES",
    "SUPPORTED_EXTENSIONS",
]

#: Aliases of the prompt suites shipped in ``assets/prompts/``.
BUILTIN_SUITES: dict[str, str] = {
    "vbench": "vbench_full_info.json",
    "geneval": "geneval_test_metadata.jsonl",
    "ocr": "ocr_test.txt",
}

#: File extensions :func:`load_prompts` reads.
SUPPORTED_EXTENSIONS: tuple[str, ...] = (".txt", ".jsonl", ".json")

_SHAPES_PREFIX = "shapes:"
_VBENCH_PREFIX = "vbench:"
_DEFAULT_KEYS = ("prompt", "prompt_en")
_PERM_SALT = 0x50524F4D5054  # "PROMPT": keeps permutation seeds apart from per-sample seeds


@dataclass
class PromptRecord:
    """One prompt and its metadata (the source's whole JSON object, a ShapeSpec's fields, or ``{}``)."""

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _multi_step_records(split: str, world: ShapesWorldConfig, steps: int) -> list[PromptRecord]:
    """Every ``steps``-segment caption of moving directions, consecutive directions distinct, in config order; held
    out iff one of its (color, shape, direction) combinations is held out (train: none is)."""
    import itertools

    held = set(heldout_combos(world))
    moving = [d for d in world.directions if d != "still"]
    out = []
    for c in world.colors:
        for s in world.shapes:
            for dirs in itertools.product(moving, repeat=steps):
                if any(a == b for a, b in zip(dirs, dirs[1:])):
                    continue
                is_held = any((c, s, d) in held for d in dirs)
                if split == "all" or is_held == (split == "heldout"):
                    spec = ShapeSpec(c, s, dirs)
                    out.append(PromptRecord(caption(spec), asdict(spec) | {"directions": list(dirs)}))
    return out


def _shapes_records(split: str, world: ShapesWorldConfig) -> list[PromptRecord]:
    if ":steps" in split:  # "train:steps2": multi-step captions
        base, _, n = split.partition(":steps")
        return _multi_step_records(base, world, int(n))
    held = set(heldout_combos(world))
    pool = [c for c in combos(world) if split == "all" or ((c in held) == (split == "heldout"))]
    out = []
    for c, s, d in pool:
        if d is None:  # image mode
            specs = [ShapeSpec(c, s)]
        elif d == "still":
            specs = [ShapeSpec(c, s, (d,))]
        else:
            specs = [ShapeSpec(c, s, (d,), speed) for speed in world.speeds]
        for spec in specs:
            meta = asdict(spec)
            meta["directions"] = list(spec.directions)
            out.append(PromptRecord(caption(spec), meta))
    return out


def _prompt_of(obj: Any, prompt_key: str | None, where: str) -> str | None:
    """The prompt string of one JSON item (None for a blank one), or a ValueError naming ``where``."""
    if isinstance(obj, str):
        text = obj
    elif isinstance(obj, dict):
        keys = (prompt_key,) if prompt_key is not None else _DEFAULT_KEYS
        key = next((k for k in keys if k in obj), None)
        if key is None:
            wanted = repr(prompt_key) if prompt_key is not None else "'prompt' (or 'prompt_en')"
            raise ValueError(
                f"{where}: no {wanted} key; keys present: {', '.join(map(repr, obj)) or 'none'} "
                f"(pass prompt_key=... to choose one)"
            )
        text = obj[key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: the prompt under {key!r} must be a string, got {type(text).__name__}")
    else:
        raise ValueError(f"{where}: expected a JSON object or string, got {type(obj).__name__}")
    text = text.strip()
    return text or None


def _record(obj: Any, prompt_key: str | None, where: str) -> PromptRecord | None:
    text = _prompt_of(obj, prompt_key, where)
    if text is None:
        return None
    return PromptRecord(text, dict(obj) if isinstance(obj, dict) else {})


def _read_file(path: Path, prompt_key: str | None) -> list[PromptRecord]:
    ext = path.suffix.lower()
    if ext not in SUPPORTED_EXTENSIONS:
        raise ValueError(
            f"unsupported prompt file {str(path)!r} (extension {ext or 'none'!r}); supported: "
            f"{', '.join(SUPPORTED_EXTENSIONS)}, or the sources 'shapes:train', 'shapes:heldout', "
            f"{', '.join(map(repr, BUILTIN_SUITES))}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {str(path)!r}")
    text = path.read_text(encoding="utf-8-sig")
    records: list[PromptRecord] = []
    if ext == ".txt":
        records = [PromptRecord(line.strip(), {}) for line in text.splitlines() if line.strip()]
    elif ext == ".jsonl":
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{str(path)!r} line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"malformed JSON in {where}: {err.msg} (column {err.colno})") from None
            rec = _record(obj, prompt_key, where)
            if rec is not None:
                records.append(rec)
    else:  # .json
        if text.strip():
            try:
                data = json.loads(text)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"malformed JSON in {str(path)!r} line {err.lineno}: {err.msg} (column {err.colno})"
                ) from None
            if not isinstance(data, list):
                raise ValueError(
                    f"{str(path)!r}: expected a JSON list of prompt objects or strings, got {type(data).__name__}"
                )
            for i, obj in enumerate(data):
                rec = _record(obj, prompt_key, f"{str(path)!r} item {i}")
                if rec is not None:
                    records.append(rec)
    return [_with_image(rec, path) for rec in records]


def _with_image(rec: PromptRecord, path: Path) -> PromptRecord:
    """``rec`` with its prompt as an image-conditioned :class:`Prompt` when its metadata names an ``image`` (relative
    paths are taken from the prompt file's folder). Raises ValueError: an ``image`` that is not a string."""
    image = rec.metadata.get("image")
    if image is None:
        return rec
    file = image_path(image, path.parent, f"{str(path)!r}, the prompt {rec.prompt!r}")
    return PromptRecord(Prompt(rec.prompt, str(file)), rec.metadata)


def load_prompts(
    path: str | os.PathLike, prompt_key: str | None = None, *, world: ShapesWorldConfig | None = None
) -> list[PromptRecord]:
    """Load a prompt set (see the module docstring for the formats and built-in sources).

    Args:
        path: a ``.txt`` / ``.jsonl`` / ``.json`` file, ``"shapes:train"`` / ``"shapes:heldout"`` /
            ``"shapes:all"``, a built-in suite alias ``"vbench"`` / ``"geneval"`` / ``"ocr"``, or
            ``"vbench:<dimension>"``: the VBench prompts tagged with that dimension (e.g. ``"vbench:dynamic_degree"``,
            72 prompts), in suite order.
        prompt_key: the key holding the prompt in JSON objects (default ``"prompt"``, falling back to
            ``"prompt_en"`` per object); ignored for text files and shapes sources.
        world: the shapes world for ``"shapes:*"`` sources (default ``ShapesWorldConfig()``).

    Returns:
        The records in file order (duplicates kept: the file decides how often a prompt appears).

    Raises:
        FileNotFoundError: the file (named in the message) or the assets folder of an alias is missing.
        ValueError: no prompts (an empty file, or only blank prompts; the message names the file); malformed
            JSON (file and line number); a JSON object without the prompt key (the key and the keys present);
            an unsupported extension (the supported ones listed); an unknown ``shapes:`` split or ``vbench:``
            dimension (the dimensions listed).
    """
    source = os.fspath(path)
    if source.startswith(_SHAPES_PREFIX):
        split = source[len(_SHAPES_PREFIX) :]
        base, _, steps = split.partition(":steps")
        if base not in ("train", "heldout", "all") or (":" in split and steps not in ("2", "3")):
            raise ValueError(
                f"unknown shapes split in {source!r}; use 'shapes:train', 'shapes:heldout' or 'shapes:all', or "
                f"'shapes:<split>:steps2' / ':steps3' for two- / three-step captions"
            )
        world = world if world is not None else ShapesWorldConfig()
        records = _shapes_records(split, world)
        if not records:
            raise ValueError(
                f"no prompts in {source!r}: the split is empty (heldout_fraction={world.heldout_fraction})"
            )
    elif source in BUILTIN_SUITES:
        records = _read_file(assets_dir() / "prompts" / BUILTIN_SUITES[source], prompt_key)
    elif source.startswith(_VBENCH_PREFIX):
        dim = source[len(_VBENCH_PREFIX) :]
        records = [r for r in _read_file(assets_dir() / "prompts" / BUILTIN_SUITES["vbench"], prompt_key)
                   if dim in (r.metadata.get("dimension") or [])]
        if not records:
            raise ValueError(f"no VBench prompts for dimension {dim!r} in {source!r}; dimensions: "
                             f"{', '.join(VBENCH_DIMENSIONS)}")
    else:
        records = _read_file(Path(source), prompt_key)
    if not records:
        raise ValueError(f"no prompts in {source!r} (the file is empty or holds only blank prompts)")
    return records


# ---------------------------------------------------------------------------------------------- stream
class PromptStream(IterableDataset):
    """Infinite deterministic stream of grouped prompt batches (yields whole batches; ``batch_size=None``).

    Args:
        records: the training prompts (N >= 1).
        prompts_per_batch: prompts P per global batch.
        group_size: consecutive copies K of each prompt (a group).
        seed: permutation seed (epoch e is shuffled by a generator seeded from ``(seed, e)``).
        shuffle: permute each epoch (False: file order, cycled).
        rank, world_size: this process's share: the contiguous slice ``rank`` of each global batch.

    Attributes:
        start: local batch number of the first batch of the next iteration (set by the loader).

    Raises:
        ValueError: no records, P < 1, K < 1, a rank out of range, or ``P * K`` not divisible by
            ``world_size`` (the message gives the numbers).
    """

    def __init__(
        self,
        records: list[PromptRecord],
        prompts_per_batch: int,
        group_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        if not records:
            raise ValueError("PromptStream needs at least one prompt")
        if prompts_per_batch < 1 or group_size < 1:
            raise ValueError(f"prompts_per_batch and group_size must be >= 1, got {prompts_per_batch}, {group_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        total = prompts_per_batch * group_size
        if total % world_size:
            raise ValueError(
                f"prompts_per_batch * group_size = {prompts_per_batch} * {group_size} = {total} samples per "
                f"global batch is not divisible by the world size {world_size}; every rank needs an equal slice"
            )
        self.records, self.seed, self.shuffle = list(records), int(seed), bool(shuffle)
        self.prompts_per_batch, self.group_size = prompts_per_batch, group_size
        self.rank, self.world_size = rank, world_size
        self.global_batch_size = total
        self.local_batch_size = total // world_size
        self.start = 0
        self._perms: dict[int, list[int]] = {}  # a few recent epochs' permutations

    def permutation(self, epoch: int) -> list[int]:
        """Order of the training prompts in epoch ``epoch`` (a pure function of ``(seed, epoch)``)."""
        perm = self._perms.get(epoch)
        if perm is None:
            n = len(self.records)
            if self.shuffle:
                g = torch.Generator("cpu").manual_seed(sample_seed(self.seed ^ _PERM_SALT, epoch))
                perm = torch.randperm(n, generator=g).tolist()
            else:
                perm = list(range(n))
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def prompt_of_group(self, group: int) -> PromptRecord:
        """The record of global group (prompt slot) ``group >= 0``."""
        n = len(self.records)
        return self.records[self.permutation(group // n)[group % n]]

    def local_batch(self, first_index: int) -> int:
        """Local (= global) batch number of the batch whose first sample id is ``first_index``."""
        return first_index // self.global_batch_size

    def batch(self, local: int) -> dict[str, Any]:
        """This rank's slice of global batch ``local`` as a batch dict (a pure function of ``local``)."""
        first = local * self.global_batch_size + self.rank * self.local_batch_size
        index = torch.arange(first, first + self.local_batch_size, dtype=torch.int64)
        group = index // self.group_size
        prompts, metadata = [], []
        for g in group.tolist():
            rec = self.prompt_of_group(g)
            prompts.append(rec.prompt)
            metadata.append(copy.deepcopy(rec.metadata))
        return {"prompts": prompts, "index": index, "group": group, "metadata": metadata}

    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        b = self.start + wid
        while True:
            yield self.batch(b)
            b += n


def val_prompt_batches(records: list[PromptRecord], batch_size: int) -> list[dict[str, Any]]:
    """Validation batches of ``batch_size`` prompt records: ``{"prompts", "index" (negative ids -1, -2, ...: never
    a training sample's), "group" (= index), "metadata"}``, the training batch format of the prompt DataModules."""
    out = []
    for lo in range(0, len(records), batch_size):
        chunk = records[lo : lo + batch_size]
        index = torch.tensor([-(lo + i + 1) for i in range(len(chunk))], dtype=torch.int64)
        out.append(
            {
                "prompts": [r.prompt for r in chunk],
                "index": index,
                "group": index.clone(),
                "metadata": [copy.deepcopy(r.metadata) for r in chunk],
            }
        )
    return out


# ---------------------------------------------------------------------------------------------- datamodule
class PromptDataModule(ResumableStreamDataModule):
    """Prompt data for RL methods: an infinite grouped training stream that resumes exactly, and a fixed val set.

    Args:
        train: training prompt source (anything :func:`load_prompts` takes).
        val: validation source, or None for no validation.
        prompts_per_batch: distinct prompt slots P per global batch.
        group_size: samples per prompt K (GRPO's group); each global batch has ``P * K`` samples, split
            contiguously over ranks (``P * K`` must be divisible by the world size).
        val_size: validation uses the first ``min(val_size, len(val))`` prompts of ``val``, each once
            (0 disables validation).
        seed: permutation seed of the training stream.
        world: shapes world for ``"shapes:*"`` sources (default ``ShapesWorldConfig()``; a dict of its fields
            is accepted, as stored in checkpoint hyperparameters).
        prompt_key: JSON key of the prompt (see :func:`load_prompts`).
        shuffle: permute the training prompts each epoch (False: file order, cycled).

    Prompt files are read lazily (at the first loader), so construction is cheap. Batch format and rank
    slicing: see the module docstring.

    Raises:
        ValueError: prompts_per_batch < 1, group_size < 1 or val_size < 0. Warns when group_size == 1 (GRPO's
            group-normalised advantages are then all zero).
    """

    def __init__(
        self,
        train: str = "shapes:train",
        val: str | None = "shapes:heldout",
        prompts_per_batch: int = 8,
        group_size: int = 4,
        val_size: int = 64,
        seed: int = 0,
        world: ShapesWorldConfig | None = None,
        prompt_key: str | None = None,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if prompts_per_batch < 1:
            raise ValueError(f"prompts_per_batch must be >= 1, got {prompts_per_batch}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}")
        if group_size == 1:
            rank_zero_warn(
                "PromptDataModule(group_size=1): each group has one sample, so GRPO's group-normalised "
                "advantages would all be zero; use group_size >= 2 for GRPO (fine for BranchGRPO, whose tree "
                "leaves are the group, and for methods without groups)"
            )
        self.world = as_world(world)
        # hparams keep the world as a plain dict, so checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters_with_world()
        self._train_records: list[PromptRecord] | None = None
        self._val_batches: list[dict[str, Any]] | None = None

    @property
    def train_records(self) -> list[PromptRecord]:
        """The training prompts (loaded on first access)."""
        if self._train_records is None:
            self._train_records = load_prompts(self.hparams.train, self.hparams.prompt_key, world=self.world)
        return self._train_records

    def make_train_loader(
        self, rank: int = 0, world_size: int = 1, start: int = 0, track_delivery: bool = False
    ) -> ShapesTrainLoader:
        """A stateful train loader for ``rank`` of ``world_size`` starting at batch ``start``.

        :meth:`train_dataloader` calls this with the Trainer's rank and world size; call it directly to build
        one rank's loader without a distributed run.

        Raises:
            ValueError: ``prompts_per_batch * group_size`` not divisible by ``world_size``, or a bad rank.
        """
        h = self.hparams
        stream = PromptStream(
            self.train_records, h.prompts_per_batch, h.group_size, h.seed, h.shuffle, rank, world_size
        )
        loader = ShapesTrainLoader(stream, num_workers=0, track_delivery=track_delivery)
        loader.load_state_dict({"batches_consumed": start})
        return loader

    def val_batches(self) -> list[dict[str, Any]]:
        """The validation set as batch dicts of ``prompts_per_batch * group_size`` prompts (empty without val)."""
        if self._val_batches is None:
            h = self.hparams
            if h.val is None or h.val_size == 0:
                self._val_batches = []
            else:
                records = load_prompts(h.val, h.prompt_key, world=self.world)[: h.val_size]
                self._val_batches = val_prompt_batches(records, h.prompts_per_batch * h.group_size)
        return self._val_batches

    def val_dataloader(self) -> DataLoader:
        """The validation batches (same dict format as training, negative ids); empty when disabled."""
        return DataLoader(self.val_batches(), batch_size=None, shuffle=False)

