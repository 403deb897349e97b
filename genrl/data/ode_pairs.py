"""Teacher ODE-trajectory pairs for the ODE initialisation of causal few-step students (CausVid sec. 4.3).

File format (one ``torch.save`` file, written by ``pipelines/ode_pairs.py``; read with
``torch.load(weights_only=True, mmap=True)``, so nothing is unpickled and the latents are not copied into
memory until a batch touches them)::

    {"format": "genrl.ode_pairs", "version": 1,
     "latents":  float32 [N, S + 1, *latent]  teacher ODE states at the student's sigmas, then the clean x0,
     "sigmas":   float64 [S + 1]              the student's sigmas s_0 = 1 > ... > s_{S-1} > 0, then 0,
     "teacher_sigmas": float64 [K + 1]        the teacher's Euler schedule (contains every student sigma),
     "prompts":  list[str] (N),
     "index":    int64 [N]                    trajectory ids (the initial noise of trajectory i is drawn from
                                              (seed, index[i]) by genrl.rollout.noise),
     "settings": dict                         teacher, steps, CFG scale w, shift, seed, latent shape, ...}

``*latent`` is the generator's native per-sample layout: [T, C, H, W] for genrl's DiT, [C, T, H, W] for Wan.

Training stream (:class:`ODEPairsStream`): global batch ``b`` of ``G`` slots (the data module's ``batch_size``; each
of the ``world_size`` ranks takes ``B = G / world_size``) holds the
slots ``s = b * G + j``; slot ``s`` is trajectory ``perm_e[s mod N]`` of epoch ``e = s // N`` (a permutation
seeded by ``(seed, e)``; the identity without ``shuffle``), so epochs continue across batch boundaries and every
epoch visits every trajectory once. Rank ``r`` takes the contiguous slice ``[r * B, (r + 1) * B)`` of every
global batch. Batches are dicts::

    {"prompts":     list[str] (B),
     "index":       int64 [B]              trajectory ids (the file's ``index``),
     "position":    int64 [B]              global stream slots s (unique over the whole run),
     "ode_latents": float32 [B, S + 1, *latent],
     "ode_sigmas":  float64 [S + 1]}

Exact resume: the same stateful-loader design as :mod:`genrl.data.shapes_datamodule` (``{"batches_consumed":
n}`` in the loop state and in the DataModule's own state), counting the batches that reach ``training_step``.

Validation batches are prompt batches like :class:`~genrl.data.prompts.PromptDataModule`'s (held-out shapes
captions by default): ``{"prompts", "index" (= -(i + 1)), "group" (= index), "metadata"}``, so a method
samples the student on prompts it never regressed on and scores the videos.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from genrl.data.prompts import load_prompts, val_prompt_batches
from genrl.data.shapes import ShapesWorldConfig, as_world, sample_seed
from genrl.data.shapes_datamodule import ResumableStreamDataModule, ShapesTrainLoader, local_batch_size
from genrl.data.video_io import atomic_write
from genrl.models.causal import CausalConfig
from genrl.noise import sample_generator, stream_id

__all__ = [
    "check_pair_sigmas",
    "regression_inputs",
    "chunk_states_to_frames",
    "draw_chunk_states",
    "select_states",
    "ODE_PAIRS_FORMAT",
    "ODE_PAIRS_VERSION",
    "ODEPairs",
    "save_ode_pairs",
    "load_ode_pairs",
    "ODEPairsStream",
    "ODEPairsTrainLoader",
    "ODEPairsDataModule",
]

#: ``"format"`` entry of an ODE-pairs file.
ODE_PAIRS_FORMAT = "genrl.ode_pairs"
#: ``"version"`` entry of the files this module writes and reads.
ODE_PAIRS_VERSION = 1

_PERM_SALT = 0x4F44455041495253  # "ODEPAIRS": keeps permutation seeds apart from per-sample seeds
_KEYS = ("latents", "sigmas", "teacher_sigmas", "prompts", "index", "settings")
_HOW_TO_MAKE = "make one with `python pipelines/ode_pairs.py --out <path>` (see its --help)"


@dataclass
class ODEPairs:
    """A set of N teacher ODE trajectories stored at the student's S noise levels plus the clean endpoint.

    Attributes:
        latents: float32 [N, S + 1, *latent]: ``latents[n, i]`` is the teacher's ODE state at ``sigmas[i]``;
            ``latents[n, S]`` the clean result x0 (sigma 0).
        sigmas: float64 [S + 1]: strictly descending, ``sigmas[0] <= 1``, ``sigmas[S] == 0``.
        teacher_sigmas: float64 [K + 1]: the teacher's Euler schedule (holds every entry of ``sigmas``).
        prompts: N prompts.
        index: int64 [N] trajectory ids (noise addresses).
        settings: how the file was made (teacher, steps, CFG w, shift, seed, latent shape, ...).
    """

    latents: torch.Tensor
    sigmas: torch.Tensor
    teacher_sigmas: torch.Tensor
    prompts: list[str]
    index: torch.Tensor
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        """N."""
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        """S, the student's steps (stored noisy states)."""
        return int(self.sigmas.numel()) - 1

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape (the generator's native layout)."""
        return tuple(int(d) for d in self.latents.shape[2:])

    def validate(self, where: str = "ODE pairs") -> ODEPairs:
        """Check shapes, dtypes and the sigma layout; returns ``self``.

        Raises:
            ValueError: a mismatch, naming ``where``, the bad value and what was expected.
        """
        lat, sig = self.latents, self.sigmas
        if not isinstance(lat, torch.Tensor) or lat.ndim < 3 or not lat.is_floating_point():
            raise ValueError(f"{where}: 'latents' must be a float tensor [N, S + 1, *latent], got "
                             f"{type(lat).__name__} {tuple(getattr(lat, 'shape', ()))}")
        if not isinstance(sig, torch.Tensor) or sig.ndim != 1 or sig.numel() < 2:
            raise ValueError(f"{where}: 'sigmas' must be a 1-d tensor of S + 1 >= 2 values, got {sig!r}")
        if lat.shape[1] != sig.numel():
            raise ValueError(f"{where}: 'latents' holds {lat.shape[1]} states per trajectory but 'sigmas' has "
                             f"{sig.numel()} values; they must match (S noisy states + the clean x0)")
        s = sig.tolist()
        if not (s[0] <= 1.0 and s[-1] == 0.0 and all(a > b for a, b in zip(s, s[1:]))):
            raise ValueError(f"{where}: 'sigmas' must descend strictly from <= 1 to exactly 0, got {s}")
        t = self.teacher_sigmas.tolist()
        missing = [v for v in s if v not in t]
        if missing:
            raise ValueError(f"{where}: the teacher schedule lacks the student sigmas {missing}; the stored states "
                             f"would not sit at the student's noise levels; regenerate the file")
        n = lat.shape[0]
        if len(self.prompts) != n or self.index.shape != (n,):
            raise ValueError(f"{where}: {n} trajectories but {len(self.prompts)} prompts and index of shape "
                             f"{tuple(self.index.shape)}; the file is inconsistent, regenerate it")
        if n < 1:
            raise ValueError(f"{where}: the file holds no trajectory; {_HOW_TO_MAKE}")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The file payload (see the module docstring)."""
        return {
            "format": ODE_PAIRS_FORMAT, "version": ODE_PAIRS_VERSION,
            "latents": self.latents.to(torch.float32).contiguous(), "sigmas": self.sigmas.to(torch.float64),
            "teacher_sigmas": self.teacher_sigmas.to(torch.float64), "prompts": list(self.prompts),
            "index": self.index.to(torch.int64), "settings": dict(self.settings),
        }


def save_ode_pairs(path: str | os.PathLike, pairs: ODEPairs) -> Path:
    """Validate ``pairs`` and write them to ``path`` atomically (a temporary file in the same folder, then
    ``os.replace``), so a killed writer never leaves a partial file at ``path``.

    Returns:
        The path written.
    Raises:
        ValueError: ``pairs`` fails :meth:`ODEPairs.validate`.
    """
    path = Path(path)
    pairs.validate(str(path))
    atomic_write(path, lambda tmp: torch.save(pairs.to_dict(), tmp))
    return path


def load_ode_pairs(path: str | os.PathLike, mmap: bool = True) -> ODEPairs:
    """Read and validate an ODE-pairs file.

    Args:
        path: the file written by ``pipelines/ode_pairs.py`` / :func:`save_ode_pairs`.
        mmap: memory-map the tensors (nothing is read until used).
    Returns:
        :class:`ODEPairs`.
    Raises:
        FileNotFoundError: no file at ``path`` (the message says how to make one).
        ValueError: not a readable torch file, not an ODE-pairs file, another format version, missing keys or
            inconsistent shapes (each names the path and the problem).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ODE-pairs file at {str(path)!r}; {_HOW_TO_MAKE}")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, random bytes, a pickle of another kind, ...
        raise ValueError(f"{str(path)!r} is not a readable ODE-pairs file ({type(e).__name__}: {e}); the file is "
                         f"corrupt or of another kind: delete it and regenerate it; {_HOW_TO_MAKE}") from None
    if not isinstance(data, dict) or data.get("format") != ODE_PAIRS_FORMAT:
        what = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{str(path)!r} is not an ODE-pairs file (format {what!r}, expected "
                         f"{ODE_PAIRS_FORMAT!r}); {_HOW_TO_MAKE}")
    if data.get("version") != ODE_PAIRS_VERSION:
        raise ValueError(f"{str(path)!r} has ODE-pairs format version {data.get('version')!r}; this genrl reads "
                         f"version {ODE_PAIRS_VERSION}: regenerate the file")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise ValueError(f"{str(path)!r} lacks the entries {missing}; regenerate the file")
    pairs = ODEPairs(latents=data["latents"], sigmas=data["sigmas"], teacher_sigmas=data["teacher_sigmas"],
                     prompts=list(data["prompts"]), index=data["index"], settings=dict(data["settings"]))
    return pairs.validate(str(path))


# ---------------------------------------------------------------------------------------------- stream
class ODEPairsStream(IterableDataset):
    """Infinite, deterministic stream of ODE-pair batches (yields whole batches; use ``batch_size=None``).

    Args:
        pairs: the trajectories.
        batch_size: samples per rank and batch B.
        seed: permutation seed (epoch e is shuffled by a generator seeded from ``(seed, e)``).
        shuffle: permute each epoch (False: file order, cycled).
        rank, world_size: this process's slice of every global batch of ``B * world_size`` slots.

    Attributes:
        start: local batch number of the first batch of the next iteration (set by the loader).

    Raises:
        ValueError: ``batch_size < 1`` or a rank out of range.
    """

    def __init__(self, pairs: ODEPairs, batch_size: int, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.pairs, self.batch_size, self.seed, self.shuffle = pairs, batch_size, int(seed), bool(shuffle)
        self.rank, self.world_size = rank, world_size
        self.global_batch_size = batch_size * world_size
        self.start = 0
        self._perms: dict[int, torch.Tensor] = {}

    def permutation(self, epoch: int) -> torch.Tensor:
        """int64 [N]: order of the trajectories in epoch ``epoch`` (a pure function of ``(seed, epoch)``)."""
        perm = self._perms.get(epoch)
        if perm is None:
            n = self.pairs.num_samples
            if self.shuffle:
                g = torch.Generator("cpu").manual_seed(sample_seed(self.seed ^ _PERM_SALT, epoch))
                perm = torch.randperm(n, generator=g)
            else:
                perm = torch.arange(n)
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """int64 rows of the file for global stream slots ``positions``."""
        n = self.pairs.num_samples
        return torch.stack([self.permutation(int(p) // n)[int(p) % n] for p in positions])

    def local_batch(self, first_position: int) -> int:
        """Local batch number of the batch whose first slot is ``first_position``."""
        return first_position // self.global_batch_size

    def batch(self, local: int) -> dict[str, Any]:
        """This rank's slice of global batch ``local`` (a pure function of ``local``)."""
        first = local * self.global_batch_size + self.rank * self.batch_size
        position = torch.arange(first, first + self.batch_size, dtype=torch.int64)
        rows = self.rows(position)
        p = self.pairs
        return {
            "prompts": [p.prompts[int(r)] for r in rows],
            "index": p.index[rows].clone(),
            "position": position,
            "ode_latents": p.latents.index_select(0, rows).to(torch.float32),
            "ode_sigmas": p.sigmas.clone(),
        }

    def __iter__(self):
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info is not None else (0, 1)
        b = self.start + wid
        while True:
            yield self.batch(b)
            b += n


class ODEPairsTrainLoader(ShapesTrainLoader):
    """The stateful train loader of :class:`ODEPairsStream`: a batch's place in the stream is its
    ``"position"`` (its ``"index"`` holds trajectory ids, which repeat across epochs)."""

    def mark_delivered(self, batch: dict[str, Any]) -> None:
        """Record that ``batch`` reached the training step."""
        position = batch.get("position") if isinstance(batch, dict) else None
        if isinstance(position, torch.Tensor) and position.numel():
            self._consumed = self.dataset.local_batch(int(position.reshape(-1)[0])) + 1


# ---------------------------------------------------------------------------------------------- datamodule
class ODEPairsDataModule(ResumableStreamDataModule):
    """ODE pairs for the ODE initialisation of a causal student, plus held-out prompts for validation.

    Args:
        path: the ODE-pairs file (``pipelines/ode_pairs.py --out``); read lazily (at the first loader or
            ``setup``), so building the DataModule never touches it.
        batch_size: trajectories per training batch over all devices (each of W ranks takes ``batch_size / W``).
        seed: permutation seed of the training stream.
        shuffle: permute the trajectories each epoch (False: file order, cycled).
        val: validation prompt source (anything :func:`genrl.data.prompts.load_prompts` takes; default the
            held-out shapes captions), or None for no validation.
        val_size: validation uses the first ``min(val_size, len(val))`` prompts, each once (0 disables it).
        val_batch_size: prompts per validation batch (default ``batch_size``).
        world: shapes world of ``"shapes:*"`` prompt sources and of the shapes verifier reward (default
            ``ShapesWorldConfig()``; a dict of its fields is accepted).
        prompt_key: JSON key of the prompt in validation prompt files.

    Batch formats: see the module docstring.

    Raises:
        ValueError: batch_size < 1, val_size < 0 or val_batch_size < 1. Loading raises FileNotFoundError for a
            missing file and ValueError for a corrupt one (see :func:`load_ode_pairs`).
    """

    def __init__(
        self,
        path: str = "runs/ode_pairs/shapes.pt",
        batch_size: int = 32,
        seed: int = 0,
        shuffle: bool = True,
        val: str | None = "shapes:heldout",
        val_size: int = 64,
        val_batch_size: int | None = None,
        world: ShapesWorldConfig | None = None,
        prompt_key: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if val_size < 0:
            raise ValueError(f"val_size must be >= 0, got {val_size}")
        if val_batch_size is not None and val_batch_size < 1:
            raise ValueError(f"val_batch_size must be >= 1 or null, got {val_batch_size}")
        self.world = as_world(world)
        self.save_hyperparameters_with_world()
        self._pairs: ODEPairs | None = None
        self._val_batches: list[dict[str, Any]] | None = None

    @property
    def pairs(self) -> ODEPairs:
        """The loaded (memory-mapped) pairs file (loaded on first access)."""
        if self._pairs is None:
            self._pairs = load_ode_pairs(self.hparams.path)
        return self._pairs

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape of the stored trajectories."""
        return self.pairs.latent_shape

    @property
    def sigmas(self) -> torch.Tensor:
        """float64 [S + 1]: the stored noise levels (student sigmas, then 0)."""
        return self.pairs.sigmas

    def setup(self, stage: str) -> None:
        """Load the pairs file when fitting (a missing or corrupt file fails before any training)."""
        if stage == "fit":
            _ = self.pairs

    def make_train_loader(self, rank: int = 0, world_size: int = 1, start: int = 0,
                          track_delivery: bool = False) -> ODEPairsTrainLoader:
        """A stateful train loader for ``rank`` of ``world_size`` starting at local batch ``start``."""
        h = self.hparams
        stream = ODEPairsStream(self.pairs, local_batch_size(h.batch_size, world_size), h.seed, h.shuffle, rank,
                                world_size)
        loader = ODEPairsTrainLoader(stream, num_workers=0, track_delivery=track_delivery)
        loader.load_state_dict({"batches_consumed": start})
        return loader

    def val_batches(self) -> list[dict[str, Any]]:
        """The validation prompts as batch dicts (negative ids; empty without validation)."""
        if self._val_batches is None:
            h = self.hparams
            if h.val is None or h.val_size == 0:
                self._val_batches = []
            else:
                records = load_prompts(h.val, h.prompt_key, world=self.world)[: h.val_size]
                self._val_batches = val_prompt_batches(records, h.val_batch_size or h.batch_size)
        return self._val_batches

    def val_dataloader(self) -> DataLoader:
        """The validation prompt batches (empty when disabled)."""
        return DataLoader(self.val_batches(), batch_size=None, shuffle=False)


# ---------------------------------------------------------------------------- training states of the regression
#: random stream of the per-chunk state draw (see genrl.noise).
_STREAM_CHUNK_STATE = stream_id("data.ode_chunk_state")


def draw_chunk_states(seed: int, sample_ids: Sequence[int] | torch.Tensor, step: int, num_chunks: int,
                      num_states: int) -> torch.Tensor:
    """Per-chunk state indices of the ODE regression (CausVid sec. 4.3, ``uniform_timestep=False``).

    Row b holds ``num_chunks`` independent uniform draws from {0, ..., num_states - 1}, taken from the CPU
    generator addressed by (seed, sample_ids[b], step, stream) (:func:`genrl.noise.sample_generator`):
    a pure function of those integers, whatever the batch composition.

    Args:
        seed: run seed.
        sample_ids: B sample ids (ints or an int tensor [B]); unique within a step.
        step: the training step (global step).
        num_chunks: K chunks per sample.
        num_states: number of choices (S noisy states, or S + 1 with the clean state).
    Returns:
        int64 [B, K] on the CPU.
    Raises:
        ValueError: ``num_chunks < 1`` or ``num_states < 1``.
    """
    if num_chunks < 1 or num_states < 1:
        raise ValueError(f"need num_chunks >= 1 and num_states >= 1, got {num_chunks} and {num_states}")
    ids = sample_ids.tolist() if isinstance(sample_ids, torch.Tensor) else list(sample_ids)
    rows = [torch.randint(num_states, (num_chunks,), generator=sample_generator(seed, int(i), int(step),
                                                                               _STREAM_CHUNK_STATE))
            for i in ids]
    return torch.stack(rows) if rows else torch.zeros(0, num_chunks, dtype=torch.long)


def chunk_states_to_frames(chunk_states: torch.Tensor, causal: CausalConfig, num_frames: int) -> torch.Tensor:
    """Spread per-chunk state indices [B, K] to per-frame indices [B, T] with the chunk layout of ``causal``.

    Raises:
        ValueError: ``num_frames`` is not on a chunk boundary, or K differs from the number of chunks.
    """
    k = causal.num_chunks(num_frames)
    if chunk_states.ndim != 2 or chunk_states.shape[1] != k:
        raise ValueError(f"chunk states of shape {tuple(chunk_states.shape)} for {num_frames} frames in {k} chunks; "
                         f"expected [B, {k}]")
    chunk = causal.chunk_of(torch.arange(num_frames)).to(chunk_states.device)
    return chunk_states[:, chunk]


def select_states(ode_latents: torch.Tensor, ode_sigmas: torch.Tensor, frame_states: torch.Tensor,
                  frame_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Assemble the student's input: frame t of sample b is frame t of the stored state ``frame_states[b, t]``.

    Args:
        ode_latents: [B, S + 1, *latent] stored states (frames on axis ``frame_dim - 1`` of ``*latent``).
        ode_sigmas: [S + 1] their sigmas.
        frame_states: int64 [B, T] state index per frame, in 0..S.
        frame_dim: frame axis of the generator's latents [B, *latent] (1 for [B, T, C, H, W], 2 for Wan's
            [B, C, T, H, W]).
    Returns:
        ``(x, sigma)``: x [B, *latent] (exact copies of the stored values, dtype of ``ode_latents``) and the
        per-frame sigma [B, T] (dtype of ``ode_sigmas``).
    Raises:
        ValueError: shapes do not fit (named in the message) or an index is out of range.
    """
    if ode_latents.ndim < 3 or ode_sigmas.ndim != 1 or ode_latents.shape[1] != ode_sigmas.numel():
        raise ValueError(f"ode_latents {tuple(ode_latents.shape)} and ode_sigmas {tuple(ode_sigmas.shape)} do not "
                         f"fit: expected [B, S + 1, *latent] and [S + 1]")
    b, n_states = ode_latents.shape[:2]
    latent = ode_latents.shape[2:]
    if not 1 <= frame_dim <= len(latent):
        raise ValueError(f"frame_dim={frame_dim} is outside 1..{len(latent)} for latents {tuple(latent)}")
    t = latent[frame_dim - 1]
    if frame_states.shape != (b, t):
        raise ValueError(f"frame_states of shape {tuple(frame_states.shape)}; expected [B, T] = [{b}, {t}]")
    if bool((frame_states < 0).any()) or bool((frame_states >= n_states).any()):
        raise ValueError(f"frame_states must lie in 0..{n_states - 1}, got values {frame_states.unique().tolist()}")
    fs = frame_states.to(ode_latents.device)
    shape = [b, 1] + [1] * len(latent)
    shape[frame_dim + 1] = t
    idx = fs.reshape(shape).expand(b, 1, *latent)
    x = ode_latents.gather(1, idx).squeeze(1)
    sigma = ode_sigmas.to(fs.device)[fs]
    return x, sigma


def check_pair_sigmas(ode_sigmas: torch.Tensor, schedule) -> None:
    """Check that stored ODE states lie at the student's noise levels.

    Args:
        ode_sigmas: [S + 1] sigmas of the stored states (flattened first, so a [1, S + 1] passes too; a collated
            [B, S + 1] with B > 1 does not: :meth:`genrl.methods.ode_init.ODEInit.regression_loss` passes
            its row 0).
        schedule: the student's :class:`~genrl.rollout.autoregressive.ChunkSchedule` (its ``sigmas()``).
    Raises:
        ValueError: the sigmas differ from ``schedule.sigmas()`` by more than 1e-6 (names both lists and how to
            regenerate the pairs or change the schedule).
    """
    want = schedule.sigmas()
    got = ode_sigmas.detach().to("cpu", torch.float64).reshape(-1)
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-6, rtol=0):
        raise ValueError(
            f"the ODE pairs hold states at sigmas {[round(v, 6) for v in got.tolist()]} but the student's schedule "
            f"(model.init_args.schedule: timesteps {schedule.timesteps}, shift {schedule.shift}, warp "
            f"{schedule.warp}) needs {[round(v, 6) for v in want.tolist()]}; regenerate the pairs with the "
            f"same list (pipelines/ode_pairs.py --student-timesteps ... --student-shift ...) or change the schedule"
        )


def regression_inputs(ode_latents: torch.Tensor, ode_sigmas: torch.Tensor, seed: int, sample_ids: torch.Tensor,
                      step: int, causal: CausalConfig, draw_clean_state: bool = False, frame_dim: int = 1):
    """The inputs of one ODE-regression batch (CausVid sec. 4.3): a state index per chunk (:func:`draw_chunk_states`,
    among the S noisy states, or S + 1 with the clean one), spread to frames, and the stored frames of those states.

    Args:
        ode_latents: [B, S + 1, *latent]; ode_sigmas: [S + 1]; seed / sample_ids [B] / step: address the draws;
        causal: the chunk layout; draw_clean_state: also draw the clean state S; frame_dim: frame axis of latents.
    Returns:
        ``(x [B, *latent], sigma float32 [B, T], target x0 [B, *latent], chunk_states int64 [B, K])``.
    Raises:
        ValueError: frames off a chunk boundary, or shapes that do not fit (from the helpers).
    """
    num_frames = ode_latents.shape[1 + frame_dim]
    num_steps = ode_sigmas.numel() - 1
    chunk_states = draw_chunk_states(seed, sample_ids.cpu(), step, causal.num_chunks(num_frames),
                                     num_steps + 1 if draw_clean_state else num_steps)
    frame_states = chunk_states_to_frames(chunk_states, causal, num_frames)
    x, sigma = select_states(ode_latents, ode_sigmas.to(ode_latents.device), frame_states, frame_dim)
    return x, sigma.to(torch.float32), ode_latents[:, num_steps], chunk_states
