"""LightningDataModule of the shapes world: an infinite deterministic training stream that resumes exactly.

Training batch ``b`` (counted per rank, from 0) holds the samples with global indices
``[g * B, (g + 1) * B)``, ``g = b * world_size + rank``, each ``sample(world, seed, index, split)``; so a
batch is a pure function of its number, whatever ``num_workers`` is, and ranks never repeat each other.

Batches are dicts::

    {"pixels": float32 [B, T, 3, H, W] in [0, 1], "prompts": list[str] (B captions), "index": int64 [B]}

Exact mid-run resume. The train loader (:class:`ShapesTrainLoader`) implements ``state_dict()`` /
``load_state_dict()``; Lightning 2.x saves the state of every such loader of the train ``CombinedLoader`` into
``checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]`` (``_FitLoop.on_save_checkpoint``) and
hands it back through ``load_state_dict`` in ``_FitLoop.setup_data`` before it calls ``iter()`` on the
loader when a run is resumed with ``ckpt_path``.

The saved count must be the number of batches **delivered to ``training_step``**, not the number the loader
produced: for a loader without ``__len__`` Lightning's ``_PrefetchDataFetcher`` fetches one batch ahead
(and worker processes prefetch more, inside the DataLoader iterator). So when the loader runs under a
Trainer through this DataModule, the DataModule's ``on_before_batch_transfer`` hook (which Lightning calls
only for the batch it is about to give to ``training_step``) marks the batch as delivered, and
``state_dict()`` returns ``{"batches_consumed": last delivered batch number + 1}``. Without that hook (plain
iteration, or a ``training_step(dataloader_iter)``, where Lightning does not prefetch) the loader counts the
batches it yielded. A new ``iter()`` (a new epoch when ``limit_train_batches`` ends one, or a resume)
restarts right after the last delivered batch.

The DataModule also saves the same count in its own ``state_dict`` (checkpoint key ``"ShapesDataModule"``),
which Lightning restores before ``configure_optimizers``: a module that reads
``trainer.estimated_stepping_batches`` there (with ``max_epochs`` set) makes Lightning build the train loader
before the loops are restored and then never hand the loader its state (Lightning-AI/pytorch-lightning#20550);
the DataModule's copy still starts that loader at the right batch.

Caveat: if the LightningModule also overrides ``on_before_batch_transfer``, Lightning warns that it uses the
DataModule's hook; this DataModule calls the module's hook itself, so behaviour is preserved.
"""

from __future__ import annotations

import abc
from dataclasses import asdict
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from genrl.data.shapes import ShapesWorldConfig, as_world, sample

__all__ = ["ShapesDataModule", "ShapesStream", "ShapesTrainLoader", "collate_samples", "data_parallel_of",
           "local_batch_size", "make_batch"]

_SPLITS = ("train", "heldout", "all")


def data_parallel_of(trainer) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of ``trainer``: which slice of every global batch this process takes,
    out of how many. Read from the strategy's ``distributed_sampler_kwargs`` (``{"rank", "num_replicas"}``, what
    Lightning gives a ``DistributedSampler``): the global rank and world size under DDP; under a strategy with a
    model-parallel dimension (genrl's FSDP2 with ``context_parallel: c``) the data-parallel coordinate, so the ``c``
    ranks of one group take the same slice. (0, 1) without a trainer; the global rank and world size when the
    strategy does not say (a single device)."""
    if trainer is None:
        return 0, 1
    try:
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    except RuntimeError:  # a model-parallel strategy before its processes are up: no mesh yet
        kwargs = None
    if kwargs and "rank" in kwargs and "num_replicas" in kwargs:
        return int(kwargs["rank"]), int(kwargs["num_replicas"])
    return int(trainer.global_rank), int(trainer.world_size)


def local_batch_size(batch_size: int, world_size: int, name: str = "batch_size") -> int:
    """Each rank's share ``batch_size / world_size`` of a global batch (the data modules' ``batch_size`` counts
    samples over all devices, so a recipe trains on the same batches on 1 or N devices).

    Raises:
        ValueError: ``world_size`` does not divide ``batch_size`` (names both and the nearest valid values).
    """
    if batch_size % world_size:
        lower = batch_size - batch_size % world_size
        raise ValueError(f"{name} {batch_size} is the global batch and must be divisible by the {world_size} "
                         f"data-parallel ranks; use {lower or world_size} or {lower + world_size}")
    return batch_size // world_size


def collate_samples(samples: list[tuple[torch.Tensor, str, int]]) -> dict[str, Any]:
    """Stack ``(pixels [T, 3, H, W], caption, index)`` triples into the batch dict."""
    return {
        "pixels": torch.stack([s[0] for s in samples]),
        "prompts": [s[1] for s in samples],
        "index": torch.tensor([s[2] for s in samples], dtype=torch.int64),
    }


def make_batch(world: ShapesWorldConfig, seed: int, indices: list[int], split: str = "train") -> dict[str, Any]:
    """The batch dict of the given global sample indices (each ``sample(world, seed, i, split)``)."""
    return collate_samples([(*sample(world, seed, i, split)[:2], i) for i in indices])


class ShapesStream(IterableDataset):
    """Infinite stream of training batches (the dataset yields whole batches; use ``batch_size=None``).

    Args:
        world: the shapes world.
        batch_size: samples per batch B.
        seed: stream seed.
        split: ``"train"``, ``"heldout"`` or ``"all"``.
        rank, world_size: this process's share: local batch b is global batch ``b * world_size + rank``.

    Attributes:
        start: local batch number of the first batch of the next iteration (set by the loader).

    Iteration: worker w of N yields local batches ``start + w, start + w + N, ...``; PyTorch's DataLoader
    interleaves workers in order, so the loader yields ``start, start + 1, ...`` for any N.
    """

    def __init__(
        self,
        world: ShapesWorldConfig,
        batch_size: int,
        seed: int = 0,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(_SPLITS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.world, self.batch_size, self.seed, self.split = world, batch_size, seed, split
        self.rank, self.world_size = rank, world_size
        self.start = 0

    def global_batch(self, local: int) -> int:
        """Global batch number of local batch ``local``."""
        return local * self.world_size + self.rank

    def local_batch(self, first_index: int) -> int:
        """Local batch number of the batch whose first global sample index is ``first_index``."""
        return (first_index // self.batch_size - self.rank) // self.world_size

    def batch(self, local: int) -> dict[str, Any]:
        """Local batch ``local`` as a batch dict (a pure function of ``local``)."""
        g = self.global_batch(local)
        indices = list(range(g * self.batch_size, (g + 1) * self.batch_size))
        return make_batch(self.world, self.seed, indices, self.split)

    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        b = self.start + wid
        while True:
            yield self.batch(b)
            b += n


class ShapesTrainLoader(DataLoader):
    """Stateful DataLoader over a :class:`ShapesStream` (``state_dict`` / ``load_state_dict`` for Lightning).

    Args:
        dataset: the stream.
        num_workers: worker processes (0 = in the main process). Workers are re-created at every ``iter()``
            (``persistent_workers`` is not supported: workers must restart from the restored position).
        track_delivery: count batches marked by :meth:`mark_delivered` (set by :class:`ShapesDataModule`
            under a Trainer) instead of batches yielded.
        **kwargs: other DataLoader options (``pin_memory``, ``timeout``, ...); not ``batch_size``, ``sampler``,
            ``shuffle`` or ``persistent_workers``.

    State: ``{"batches_consumed": n}``: the next ``iter()`` starts at local batch n.
    """

    def __init__(self, dataset: ShapesStream, num_workers: int = 0, track_delivery: bool = False, **kwargs: Any):
        for bad in ("batch_size", "sampler", "batch_sampler", "shuffle", "persistent_workers", "collate_fn"):
            if kwargs.get(bad) not in (None, False):
                raise ValueError(f"ShapesTrainLoader does not take {bad}={kwargs[bad]!r}")
            kwargs.pop(bad, None)
        super().__init__(dataset, batch_size=None, num_workers=num_workers, **kwargs)
        self.track_delivery = track_delivery
        self._consumed = 0  # batches delivered (or yielded, without delivery tracking)
        self._epoch = 0  # invalidates iterators of earlier iter() calls

    @property
    def batches_consumed(self) -> int:
        """Local batches consumed so far (the next ``iter()`` starts here)."""
        return self._consumed

    def __iter__(self):
        self._epoch += 1
        epoch = self._epoch
        self.dataset.start = self._consumed
        inner = super().__iter__()

        def gen():
            for batch in inner:
                if not self.track_delivery and epoch == self._epoch:
                    self._consumed += 1
                yield batch

        return gen()

    def mark_delivered(self, batch: dict[str, Any]) -> None:
        """Record that ``batch`` reached the training step (used with ``track_delivery``)."""
        index = batch.get("index") if isinstance(batch, dict) else None
        if isinstance(index, torch.Tensor) and index.numel():
            self._consumed = self.dataset.local_batch(int(index.reshape(-1)[0])) + 1

    def state_dict(self) -> dict[str, int]:
        """``{"batches_consumed": n}``."""
        return {"batches_consumed": self._consumed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue after ``state_dict["batches_consumed"]`` batches at the next ``iter()``.

        Raises:
            KeyError: the key is missing.
        """
        self._consumed = int(state_dict["batches_consumed"])



class ResumableStreamDataModule(LightningDataModule, metaclass=abc.ABCMeta):
    """Shared plumbing of DataModules whose training data is an infinite stream of batches that resumes exactly.

    A subclass implements :meth:`make_train_loader`; this class builds it for the Trainer's rank, continues
    the stream across loader reloads, counts the batches that actually reach ``training_step`` (Lightning's
    fetcher reads one batch ahead), and keeps ``{"batches_consumed": n}`` in its own ``state_dict`` besides the
    loader's, so the position survives even when Lightning builds the loader before restoring the loops
    (Lightning-AI/pytorch-lightning#20550).
    """

    def __init__(self) -> None:
        super().__init__()
        self._train_loader: ShapesTrainLoader | None = None
        self._loader_trainer: Any = None  # the Trainer the current train loader was built for
        self._resume_from: int | None = None  # set by load_state_dict

    def save_hyperparameters_with_world(self) -> None:
        """Save the calling ``__init__``'s arguments as hyperparameters, ``world`` as a plain dict.

        Call it from a subclass ``__init__`` after setting ``self.world`` (a
        :class:`~genrl.data.shapes.ShapesWorldConfig`): Lightning collects the arguments of the ``__init__`` frames
        above this call, and the world is stored as ``asdict(self.world)`` in both ``hparams`` (so checkpoints load
        with ``torch.load(weights_only=True)``) and ``hparams_initial`` (what Lightning's loggers record), never the
        dataclass or the raw argument.
        """
        self.save_hyperparameters()
        self.save_hyperparameters({**self.hparams, "world": asdict(self.world)})

    @abc.abstractmethod
    def make_train_loader(
        self, rank: int = 0, world_size: int = 1, start: int = 0, track_delivery: bool = False
    ) -> ShapesTrainLoader:
        """A stateful train loader for ``rank`` of ``world_size`` that starts at local batch ``start``."""

    def train_dataloader(self) -> ShapesTrainLoader:
        """The stateful infinite training loader (this rank's share of every global batch)."""
        trainer = self.trainer
        rank, size = data_parallel_of(trainer)
        track = False
        if trainer is not None and trainer.datamodule is self and trainer.lightning_module is not None:
            step = trainer.lightning_module.training_step
            track = not is_param_in_hook_signature(step, "dataloader_iter", explicit=True)
        start = 0
        if self._train_loader is not None and trainer is not None and self._loader_trainer is trainer:
            start = self._train_loader.batches_consumed  # a reload within one run continues the stream
        if self._resume_from is not None:
            start, self._resume_from = self._resume_from, None
        loader = self.make_train_loader(rank, size, start, track)
        self._train_loader, self._loader_trainer = loader, trainer
        return loader

    def state_dict(self) -> dict[str, Any]:
        """``{"batches_consumed": n}`` of the current train loader (empty before training)."""
        return {} if self._train_loader is None else self._train_loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next :meth:`train_dataloader` start after ``state_dict["batches_consumed"]`` batches."""
        if "batches_consumed" in state_dict:
            self._resume_from = int(state_dict["batches_consumed"])

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Mark training batches as delivered (exact resume), then run the LightningModule's own hook."""
        trainer = self.trainer
        loader = self._train_loader
        if trainer is not None and trainer.training and loader is not None and loader.track_delivery:
            loader.mark_delivered(batch)
        module = trainer.lightning_module if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            return module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

class ShapesDataModule(ResumableStreamDataModule):
    """Shapes-world data for ``genrl fit``: an infinite stateful training stream and a fixed held-out val set.

    Args:
        world: the shapes world (default ``ShapesWorldConfig()``; a dict of its fields is accepted too, as
            stored in checkpoints: ``hparams["world"]`` is a plain dict).
        batch_size: samples per batch (train and val); for training the global batch over all devices (each of W
            ranks takes ``batch_size / W`` of it).
        seed: data seed (training sample i is ``sample(world, seed, i, split)``).
        num_workers: DataLoader workers for training (0 = main process).
        val_size: number of validation samples: ``sample(world, seed, -(i + 1), "heldout")`` for
            i < val_size (negative indices never occur in training); their batch ``"index"`` holds those
            negative indices. 0 disables validation.
        split: training split, ``"train"`` (default), ``"all"`` or ``"heldout"``.

    Raises:
        ValueError: batch_size < 1, num_workers < 0, val_size < 0, or an unknown split.
    """

    def __init__(
        self,
        world: ShapesWorldConfig | None = None,
        batch_size: int = 32,
        seed: int = 0,
        num_workers: int = 0,
        val_size: int = 64,
        split: str = "train",
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}")
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; use one of {', '.join(_SPLITS)}")
        self.world = as_world(world)
        # hparams keep the world as a plain dict, so checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters_with_world()
        self._val_batches: list[dict[str, Any]] | None = None

    def make_train_loader(
        self, rank: int = 0, world_size: int = 1, start: int = 0, track_delivery: bool = False
    ) -> ShapesTrainLoader:
        """The shapes stream's loader for ``rank`` of ``world_size`` starting at local batch ``start``: each rank
        takes ``batch_size / world_size`` consecutive samples of every global batch.

        Raises:
            ValueError: ``world_size`` does not divide ``batch_size``.
        """
        h = self.hparams
        local = local_batch_size(h.batch_size, world_size)
        stream = ShapesStream(self.world, local, h.seed, h.split, rank, world_size)
        loader = ShapesTrainLoader(stream, num_workers=h.num_workers, track_delivery=track_delivery)
        loader.load_state_dict({"batches_consumed": start})
        return loader

    def val_batches(self) -> list[dict[str, Any]]:
        """The validation set as a list of batch dicts (built once, deterministic)."""
        if self._val_batches is None:
            n, bsz = self.hparams.val_size, self.hparams.batch_size
            idx = [-(i + 1) for i in range(n)]
            self._val_batches = [
                make_batch(self.world, self.hparams.seed, idx[i : i + bsz], "heldout") for i in range(0, n, bsz)
            ]
        return self._val_batches

    def val_dataloader(self) -> DataLoader:
        """``val_size`` held-out samples in batches of ``batch_size`` (same dict format as training)."""
        return DataLoader(self.val_batches(), batch_size=None, shuffle=False)

