"""Block-causal attention layout and the self-attention KV cache of causal, chunk-wise video students.

Shared by genrl's DiT and the causal Wan2.1 adapter. The layout follows CausVid (Yin et al. 2025, sec. 3)
and Self-Forcing (Huang et al. 2025, sec. 3): latent frames are grouped into chunks (optionally a
different first chunk, e.g. [1, 3, 3, ...]); a query attends to every frame of its own chunk and of
earlier chunks, optionally only to a trailing local window plus the first ``sink_frames`` frames
(LongLive, Yang et al. 2025, "frame sink").

The cache stores keys *before* rotary position embedding (as LongLive's relative mode and TempAct's
fork API ask), so a fork or a window shift never rewrites stored keys; positions are applied when the
keys are read, either absolute (frame index) or cache-relative (rank of the frame among the frames
attended to). Keys and values are per layer ``[B, heads, N_tokens, head_dim]``, with one frame-index
entry per stored frame group; tensors are replaced (never written in place), so forks never alias.
:class:`StaticKVCache` (``CausalConfig.static_cache``) is the fixed-shape variant: buffers allocated once and
written in place, read whole under a mask, so every chunk's forward has the same shapes (one ``torch.compile``).

:class:`ChunkSchedule` (how a causal student generates: layout, few-step list, re-noise rule) lives here, next to
the layout it wraps, because a loaded causal generator carries one (``generator.schedule``, set by
:func:`genrl.models.loading.load_generator`); the autoregressive sampler (:mod:`genrl.rollout.autoregressive`)
re-exports it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch

from genrl.flow.dmd import warped_sigmas
from genrl.flow.schedules import shift_sigmas

__all__ = ["CausalConfig", "ChunkSchedule", "KVCache", "StaticKVCache", "make_kv_cache", "CausalGenerator",
           "frame_visibility"]

Positions = Literal["absolute", "relative"]


@dataclass
class CausalConfig:
    """Chunk layout and attention window of a causal student, in latent frames.

    Attributes:
        chunk_size: latent frames per chunk (Self-Forcing on Wan: 3; the shapes DiT: 2).
        first_chunk_size: size of chunk 0 when it differs (Self-Forcing's ``independent_first_frame``: 1).
        local_window: latent frames a query may attend to, counted back from the end of its own chunk (its
            chunk included); None attends to everything before (Self-Forcing ``local_attn_size``).
        sink_frames: the first latent frames, always attended to when ``local_window`` is set (LongLive's
            frame sink; 0 = none).
        positions: ``"absolute"`` (frame index, Self-Forcing) or ``"relative"`` (rank of the frame among the
            frames a forward attends to: sink, then window, then the input; LongLive's KV-relative RoPE), which
            keeps positions inside the trained range for unbounded streaming.
        static_cache: keep the KV cache in buffers of fixed, pre-allocated shape written in place
            (:class:`StaticKVCache`) instead of tensors that grow and shrink every chunk (:class:`KVCache`); every
            forward then has the same shapes, so ``torch.compile`` compiles once and CUDA graphs become possible.
            Needs ``local_window`` (the buffers hold the sink plus the window) or ``max_frames``. Default False.
        max_frames: latent frames a static cache without a window can hold (the whole video); ignored with a
            ``local_window``; unused by the dynamic cache.

    Raises:
        ValueError: non-positive sizes, a negative sink, a window smaller than a chunk, or ``static_cache``
            without ``local_window`` or ``max_frames``.
    """

    chunk_size: int = 2
    first_chunk_size: int | None = None
    local_window: int | None = None
    sink_frames: int = 0
    positions: Positions = "absolute"
    static_cache: bool = False
    max_frames: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or (self.first_chunk_size is not None and self.first_chunk_size < 1):
            raise ValueError(f"chunk sizes must be >= 1, got chunk_size={self.chunk_size}, "
                             f"first_chunk_size={self.first_chunk_size}")
        if self.sink_frames < 0:
            raise ValueError(f"sink_frames must be >= 0, got {self.sink_frames}")
        if self.local_window is not None and self.local_window < max(self.chunk_size, self.first_chunk_size or 0):
            raise ValueError(f"local_window={self.local_window} is smaller than a chunk ({self.chunk_size} frames); "
                             f"a chunk must see itself: use local_window >= chunk size")
        if self.positions not in ("absolute", "relative"):
            raise ValueError(f"positions must be 'absolute' or 'relative', got {self.positions!r}")
        if self.max_frames is not None and self.max_frames < 1:
            raise ValueError(f"max_frames must be >= 1 latent frame, got {self.max_frames}")
        if self.static_cache and self.local_window is None and self.max_frames is None:
            raise ValueError("static_cache=True needs a bound on the cached frames: set local_window (the cache then "
                             "holds sink_frames + local_window - chunk_size latent frames) or max_frames (the "
                             "longest video it must hold)")

    def check_patch(self, patch_frames: int) -> None:
        """Raise ValueError if chunk / window / sink sizes are not multiples of the temporal patch."""
        for name in ("chunk_size", "first_chunk_size", "local_window", "sink_frames"):
            value = getattr(self, name)
            if value is not None and value % patch_frames:
                raise ValueError(f"{name}={value} is not a multiple of the model's temporal patch {patch_frames}; "
                                 f"chunk, window and sink sizes are counted in latent frames")

    def chunk_start(self, k: int) -> int:
        """First latent frame of chunk ``k``."""
        first = self.first_chunk_size or self.chunk_size
        return 0 if k == 0 else first + (k - 1) * self.chunk_size

    def chunk_len(self, k: int) -> int:
        return (self.first_chunk_size or self.chunk_size) if k == 0 else self.chunk_size

    def chunk_of(self, frames: torch.Tensor) -> torch.Tensor:
        """Chunk index of each latent frame index (int64 tensor of any shape)."""
        first = self.first_chunk_size or self.chunk_size
        later = torch.div(frames - first, self.chunk_size, rounding_mode="floor") + 1
        return torch.where(frames < first, torch.zeros_like(frames), later)

    def num_chunks(self, num_frames: int) -> int:
        """Number of chunks covering ``num_frames`` latent frames.

        Raises:
            ValueError: the frames do not end on a chunk boundary.
        """
        k = 0
        while self.chunk_start(k) < num_frames:
            k += 1
        if self.chunk_start(k) != num_frames:
            first = f"a first chunk of {self.first_chunk_size} then " if self.first_chunk_size else ""
            raise ValueError(f"{num_frames} latent frames do not split into {first}chunks of {self.chunk_size} latent "
                             f"frames; use a number of frames on a chunk boundary")
        return k


def frame_visibility(config: CausalConfig, query_frames: torch.Tensor, key_frames: torch.Tensor) -> torch.Tensor:
    """Boolean ``[Nq, Nk]``: may a token of latent frame ``query_frames[i]`` attend to frame ``key_frames[j]``.

    Rule: ``chunk(j) <= chunk(i)`` and, with a local window W and S sink frames,
    ``j < S or j >= end(chunk(i)) - W`` (end = one past the last frame of i's chunk).
    """
    cq, ck = config.chunk_of(query_frames), config.chunk_of(key_frames)
    visible = ck[None, :] <= cq[:, None]
    if config.local_window is not None:
        first = config.first_chunk_size or config.chunk_size
        end = torch.where(cq == 0, torch.full_like(cq, first), first + cq * config.chunk_size)
        in_window = key_frames[None, :] >= (end - config.local_window)[:, None]
        in_sink = key_frames[None, :] < config.sink_frames
        visible = visible & (in_window | in_sink)
    return visible


def _check_commit(cache, layer_kv: list, group_frames: torch.Tensor, tokens_per_group: int,
                  holds_tokens: bool) -> torch.Tensor:
    """The checks of a commit into ``cache`` (a :class:`KVCache` or :class:`StaticKVCache`); returns
    ``group_frames`` as int64 on the CPU. ``holds_tokens``: the cache's token layout is fixed already.

    Raises:
        ValueError: another token count per frame group or layer count than the cache's, or frames that do not
            start where the cache ends.
    """
    group_frames = group_frames.to(torch.long).cpu()
    if holds_tokens and tokens_per_group != cache.tokens_per_group:
        raise ValueError(f"committing {tokens_per_group} tokens per frame group into a cache of "
                         f"{cache.tokens_per_group}; the latent height / width changed mid-video")
    if cache.keys and len(layer_kv) != len(cache.keys):
        raise ValueError(f"{len(layer_kv)} layers committed into a cache of {len(cache.keys)}")
    if int(group_frames[0]) != cache.end_frame:
        raise ValueError(f"commit starts at latent frame {int(group_frames[0])} but the cache ends at "
                         f"{cache.end_frame}; commit chunks in order")
    return group_frames


@dataclass
class KVCache:
    """Self-attention keys / values of the committed (context) frames of a batch of videos.

    Attributes:
        config: the chunk layout and window the cache serves.
        keys, values: per layer ``[B, heads, N_tokens, head_dim]`` (keys un-roped); empty lists before the first
            commit.
        frames: int64 ``[N_groups]``: first latent frame of each stored frame group (groups of ``patch_frames``
            latent frames share tokens), ascending.
        tokens_per_group: tokens each frame group holds.
        patch_frames: latent frames per frame group (the model's temporal patch).
        end_frame: one past the last committed latent frame (where the next chunk starts).
        cross: cross-attention cache, ``{layer: (key, k, v)}``; ``key`` identifies the conditioning it was built
            from, so a different prompt never reads a stale entry.
        batch_size: B.
    """

    config: CausalConfig
    batch_size: int
    patch_frames: int = 1
    tokens_per_group: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    frames: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    end_frame: int = 0
    cross: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ reads
    @property
    def num_groups(self) -> int:
        return int(self.frames.numel())

    def visible(self, query_frames: torch.Tensor) -> torch.Tensor:
        """Boolean ``[Nq_groups, N_groups]`` visibility of the stored groups from query frame groups."""
        return frame_visibility(self.config, query_frames.cpu(), self.frames)

    def token_rows(self, group_mask: torch.Tensor) -> torch.Tensor:
        """Token indices (int64) of the stored groups selected by the boolean ``group_mask`` [N_groups]."""
        idx = group_mask.nonzero().flatten()
        return (idx[:, None] * self.tokens_per_group + torch.arange(self.tokens_per_group)).flatten()

    # ------------------------------------------------------------------ writes (return new tensors)
    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], group_frames: torch.Tensor,
               tokens_per_group: int) -> None:
        """Store the K/V of newly committed frame groups (one ``(k, v)`` per layer, un-roped keys
        ``[B, heads, n_groups * tokens_per_group, head_dim]``) and drop groups no later chunk can see.

        Raises:
            ValueError: frames not contiguous with the cache, or a layer count / token count mismatch.
        """
        group_frames = _check_commit(self, layer_kv, group_frames, tokens_per_group, bool(self.num_groups))
        self.tokens_per_group = tokens_per_group
        if not self.keys:
            self.keys = [k for k, _ in layer_kv]
            self.values = [v for _, v in layer_kv]
        else:
            self.keys = [torch.cat([a, k], dim=2) for a, (k, _) in zip(self.keys, layer_kv)]
            self.values = [torch.cat([a, v], dim=2) for a, (_, v) in zip(self.values, layer_kv)]
        self.frames = torch.cat([self.frames, group_frames])
        self.end_frame = int(group_frames[-1]) + self.patch_frames
        self.evict()

    def evict(self) -> None:
        """Drop stored groups that no future chunk can attend to (outside sink and every future window)."""
        w = self.config.local_window
        if w is None or not self.num_groups:
            return
        # every later chunk ends at e >= end_frame + chunk_size and sees frames >= e - w
        keep = (self.frames < self.config.sink_frames) | (self.frames >= self.end_frame + self.config.chunk_size - w)
        if bool(keep.all()):
            return
        self._select(keep)

    def truncate(self, keep_frames_before: int, keep_sink: bool = True) -> None:
        """Keep only groups before latent frame ``keep_frames_before`` (and the sink when ``keep_sink``), set
        ``end_frame`` to ``keep_frames_before`` and clear the cross-attention cache (a prompt re-cache)."""
        keep = self.frames < keep_frames_before
        if not keep_sink:
            keep = keep & (self.frames >= self.config.sink_frames)
        self._select(keep)
        self.end_frame = int(keep_frames_before)
        self.cross = {}

    def keep_groups(self, keep: torch.Tensor) -> None:
        """Keep only the stored groups where ``keep`` [N_groups] is True (end_frame unchanged)."""
        self._select(keep)

    def _select(self, keep: torch.Tensor) -> None:
        rows = self.token_rows(keep)
        if self.keys:
            dev = self.keys[0].device
            rows = rows.to(dev)
            self.keys = [k.index_select(2, rows) for k in self.keys]
            self.values = [v.index_select(2, rows) for v in self.values]
        self.frames = self.frames[keep]

    def reset(self) -> None:
        """Forget everything (a new video)."""
        self.keys, self.values, self.cross = [], [], {}
        self.frames = torch.zeros(0, dtype=torch.long)
        self.end_frame = 0

    # ------------------------------------------------------------------ copies
    def clone(self) -> KVCache:
        """A deep copy: every tensor cloned, every index and dict new (writing into one never changes the other)."""
        return KVCache(
            config=copy.deepcopy(self.config), batch_size=self.batch_size, patch_frames=self.patch_frames,
            tokens_per_group=self.tokens_per_group, keys=[k.clone() for k in self.keys],
            values=[v.clone() for v in self.values], frames=self.frames.clone(), end_frame=self.end_frame,
            cross={layer: (key, k.clone(), v.clone()) for layer, (key, k, v) in self.cross.items()},
        )

    def repeat_interleave(self, n: int) -> KVCache:
        """A new cache of batch ``B * n``: row ``b`` repeated ``n`` times in a row (batched fork)."""
        out = self.clone()
        out.batch_size = self.batch_size * n
        out.keys = [k.repeat_interleave(n, dim=0) for k in self.keys]
        out.values = [v.repeat_interleave(n, dim=0) for v in self.values]
        out.cross = {}  # conditioning rows change with the batch; rebuilt on first use
        return out

    def select_rows(self, rows: list[int]) -> KVCache:
        """A new cache holding batch rows ``rows`` (cloned)."""
        out = self.clone()
        idx = torch.as_tensor(rows, dtype=torch.long)
        out.batch_size = len(rows)
        out.keys = [k.index_select(0, idx.to(k.device)) for k in out.keys]
        out.values = [v.index_select(0, idx.to(v.device)) for v in out.values]
        out.cross = {}
        return out

    def nbytes(self) -> int:
        """Bytes held by stored keys and values."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class StaticKVCache:
    """A :class:`KVCache` of fixed, pre-allocated shape, written in place (``CausalConfig.static_cache``).

    Same interface and same numerics as :class:`KVCache` (un-roped keys, positions applied at read time), but the
    per-layer keys / values are buffers ``[B, heads, capacity * tokens_per_group, head_dim]`` allocated once (on
    the first forward that uses the cache, when the token layout is known) and never reallocated: a commit copies
    the chunk's keys / values into *slots* (one slot = one latent frame's tokens) and eviction only marks slots
    empty. A forward reads the whole buffer with a visibility mask of fixed shape (empty and invisible slots
    masked out), so every chunk's forward has the same shapes: ``torch.compile`` compiles once, and the forward
    could be captured as a CUDA graph.

    Slot layout (latent frames; Wan's temporal patch is 1, one frame group = one frame):

    - with ``local_window`` W and ``sink_frames`` S: slots ``0 .. S-1`` hold frames ``0 .. S-1`` (fixed, never
      overwritten while they are valid); a ring of ``R = W - chunk_size`` slots holds the other frames, frame
      ``t`` in slot ``S + (t - S) mod R``. A later chunk (ending at e >= end_frame + chunk_size) sees the sink and
      frames >= e - W, so at most ``R`` non-sink frames are ever needed: capacity ``S + W - chunk_size`` frames
      (the query chunk's own keys are not cached: they are the input's);
    - without a window: ``max_frames`` slots, frame ``t`` in slot ``t mod max_frames``; committing a frame whose
      slot still holds a live frame (more than ``max_frames`` frames) raises.

    Slot order is not frame order; attention is a sum over keys, so only the mask and the positions matter
    (relative positions are the rank of a slot's frame among the visible ones, as in :class:`KVCache`).

    Attributes:
        config: the chunk layout and window the cache serves (``static_cache`` need not be set on it).
        batch_size: B.
        patch_frames: 1 (other temporal patches are refused).
        tokens_per_group: tokens per latent frame (0 before allocation).
        key_buffer, value_buffer: ``[layers, B, heads, capacity * tokens_per_group, head_dim]`` (keys un-roped), the
            storage; None before allocation.
        keys, values: per layer views ``[B, heads, capacity * tokens_per_group, head_dim]`` of the buffers (empty
            lists before allocation).
        slot_frames: int64 ``[capacity]`` (CPU): latent frame held by each slot, -1 when empty.
        end_frame: one past the last committed latent frame.
        cross: cross-attention cache, as :class:`KVCache`'s.

    Raises:
        ValueError: ``patch_frames`` other than 1; no ``local_window`` and no ``max_frames``.
    """

    def __init__(self, config: CausalConfig, batch_size: int, patch_frames: int = 1) -> None:
        if patch_frames != 1:
            raise ValueError(f"StaticKVCache supports a temporal patch of 1 latent frame, got patch_frames="
                             f"{patch_frames}; use the dynamic KVCache (static_cache=False)")
        if config.local_window is None and config.max_frames is None:
            raise ValueError("a static KV cache needs CausalConfig.local_window or CausalConfig.max_frames to size "
                             "its buffers")
        self.config, self.batch_size, self.patch_frames = config, int(batch_size), 1
        if config.local_window is not None:
            self.sink_slots = int(config.sink_frames)
            self.ring_slots = int(config.local_window - config.chunk_size)
        else:
            self.sink_slots, self.ring_slots = 0, int(config.max_frames)
        self.tokens_per_group = 0
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slot_frames = torch.full((self.capacity,), -1, dtype=torch.long)
        self.end_frame = 0
        self.cross: dict = {}

    # ------------------------------------------------------------------ layout
    @property
    def capacity(self) -> int:
        """Slots (latent frames) the buffers hold: sink + ring."""
        return self.sink_slots + self.ring_slots

    @property
    def frames(self) -> torch.Tensor:
        """int64 ``[N_groups]``: the stored latent frames, ascending (as :attr:`KVCache.frames`)."""
        return self.slot_frames[self.slot_frames >= 0].sort().values

    @property
    def num_groups(self) -> int:
        return int((self.slot_frames >= 0).sum())

    def visible(self, query_frames: torch.Tensor) -> torch.Tensor:
        """Boolean ``[Nq, N_groups]`` visibility of the stored frames (ascending, as :attr:`frames`)."""
        return frame_visibility(self.config, query_frames.cpu(), self.frames)

    def slot_visibility(self, query_frames: torch.Tensor) -> torch.Tensor:
        """Boolean ``[Nq, capacity]``: may query frame ``i`` attend to the frame in slot ``j`` (False: empty)."""
        valid = self.slot_frames >= 0
        return frame_visibility(self.config, query_frames.cpu(), self.slot_frames.clamp(min=0)) & valid[None, :]

    def slot_of(self, frame: int) -> int:
        """The slot of latent frame ``frame`` (sink slots first, then the ring)."""
        if frame < self.sink_slots:
            return int(frame)
        if self.ring_slots == 0:
            raise ValueError(f"latent frame {frame} has no slot: the ring is empty (local_window == chunk_size)")
        return self.sink_slots + (int(frame) - self.sink_slots) % self.ring_slots

    def _survives(self, frames: torch.Tensor) -> torch.Tensor:
        """Which of ``frames`` some later chunk can still attend to (the dynamic cache's eviction rule)."""
        w = self.config.local_window
        if w is None:
            return torch.ones_like(frames, dtype=torch.bool)
        return (frames < self.config.sink_frames) | (frames >= self.end_frame + self.config.chunk_size - w)

    # ------------------------------------------------------------------ allocation and writes (in place)
    def allocate(self, num_layers: int, heads: int, head_dim: int, tokens_per_group: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """Allocate the zero-filled buffers, once; a second call with the same layout does nothing.

        Raises:
            ValueError: the cache is already allocated for another token count, layer count or batch layout
                (the latent height / width changed mid-video).
        """
        if self.keys:
            shape = (self.batch_size, heads, self.capacity * tokens_per_group, head_dim)
            if tokens_per_group != self.tokens_per_group or len(self.keys) != num_layers \
                    or tuple(self.keys[0].shape) != shape:
                raise ValueError(f"static KV cache allocated for {len(self.keys)} layers, buffers "
                                 f"{tuple(self.keys[0].shape)} ({self.tokens_per_group} tokens per latent frame); "
                                 f"asked for {num_layers} layers, {shape}: the latent height / width changed "
                                 f"mid-video (reset does not change the layout; build a new cache)")
            return
        shape = (num_layers, self.batch_size, heads, self.capacity * tokens_per_group, head_dim)
        self.tokens_per_group = int(tokens_per_group)
        self._set_buffers(torch.zeros(shape, dtype=dtype, device=device),
                          torch.zeros(shape, dtype=dtype, device=device))

    def _set_buffers(self, key_buffer: torch.Tensor | None, value_buffer: torch.Tensor | None) -> None:
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.keys = [] if key_buffer is None else list(key_buffer.unbind(0))
        self.values = [] if value_buffer is None else list(value_buffer.unbind(0))

    def _token_index(self, groups: torch.Tensor, device) -> torch.Tensor:
        tpg = self.tokens_per_group
        return (groups[:, None] * tpg + torch.arange(tpg)).flatten().to(device)

    def append(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], group_frames: torch.Tensor,
               tokens_per_group: int) -> None:
        """Write the K/V of newly committed frames into their slots (one ``(k, v)`` per layer, un-roped keys
        ``[B, heads, n_frames * tokens_per_group, head_dim]``), after marking empty the slots of frames no later
        chunk can see; frames that no later chunk can see are not written at all. Allocates on first use.

        Raises:
            ValueError: frames not contiguous with the cache, a layer / token count mismatch.
            RuntimeError: a frame's slot still holds a live frame (a cache without a window committed more than
                ``max_frames`` frames: raise ``CausalConfig.max_frames``).
        """
        group_frames = _check_commit(self, layer_kv, group_frames, tokens_per_group, bool(self.keys))
        if not self.keys:
            k0 = layer_kv[0][0]
            self.allocate(len(layer_kv), k0.shape[1], k0.shape[3], tokens_per_group, k0.dtype, k0.device)
        self.end_frame = int(group_frames[-1]) + 1
        self.evict()
        keep = self._survives(group_frames)
        if not bool(keep.any()):
            return
        frames = group_frames[keep]
        slots = torch.tensor([self.slot_of(int(t)) for t in frames], dtype=torch.long)
        live = self.slot_frames[slots]
        if bool((live >= 0).any()):
            bad = int(frames[(live >= 0).nonzero()[0, 0]])
            raise RuntimeError(f"static KV cache full: latent frame {bad} would overwrite the live frame "
                               f"{int(live[live >= 0][0])} in slot {self.slot_of(bad)} (capacity {self.capacity} "
                               f"frames); raise CausalConfig.max_frames or set local_window")
        if len(set(slots.tolist())) != len(slots):
            raise RuntimeError(f"static KV cache full: frames {frames.tolist()} share slots {slots.tolist()} "
                               f"(capacity {self.capacity}); raise CausalConfig.max_frames")
        device = self.keys[0].device
        dst = self._token_index(slots, device)
        src = None if bool(keep.all()) else self._token_index(keep.nonzero().flatten(), device)
        for buf_k, buf_v, (k, v) in zip(self.keys, self.values, layer_kv):
            if src is not None:
                k, v = k.index_select(2, src.to(k.device)), v.index_select(2, src.to(v.device))
            buf_k.index_copy_(2, dst, k.to(device=device, dtype=buf_k.dtype))
            buf_v.index_copy_(2, dst, v.to(device=device, dtype=buf_v.dtype))
        self.slot_frames[slots] = frames

    def evict(self) -> None:
        """Mark empty the slots of frames no future chunk can attend to (the data stay; they are masked)."""
        valid = self.slot_frames >= 0
        self.slot_frames[valid & ~self._survives(self.slot_frames)] = -1

    def keep_groups(self, keep: torch.Tensor) -> None:
        """Keep only the stored frames (ascending, as :attr:`frames`) where ``keep`` [N_groups] is True.

        Raises:
            ValueError: ``keep`` does not have one entry per stored frame.
        """
        keep = torch.as_tensor(keep, dtype=torch.bool).cpu()
        slots = (self.slot_frames >= 0).nonzero().flatten()
        order = self.slot_frames[slots].argsort()
        if keep.shape != order.shape:
            raise ValueError(f"keep has shape {tuple(keep.shape)}; the cache stores {len(order)} frames")
        self.slot_frames[slots[order][~keep]] = -1

    def truncate(self, keep_frames_before: int, keep_sink: bool = True) -> None:
        """As :meth:`KVCache.truncate`: keep frames before ``keep_frames_before`` (and the sink when
        ``keep_sink``), set ``end_frame`` there and clear the cross-attention cache."""
        frames = self.frames
        keep = frames < keep_frames_before
        if not keep_sink:
            keep = keep & (frames >= self.config.sink_frames)
        self.keep_groups(keep)
        self.end_frame = int(keep_frames_before)
        self.cross = {}

    def reset(self) -> None:
        """Forget everything (a new video); the buffers are kept (same storage, no reallocation)."""
        self.slot_frames.fill_(-1)
        self.end_frame = 0
        self.cross = {}

    # ------------------------------------------------------------------ copies (new buffers)
    def _copy(self, batch_size: int, fn) -> StaticKVCache:
        out = StaticKVCache(copy.deepcopy(self.config), batch_size, self.patch_frames)
        out.sink_slots, out.ring_slots = self.sink_slots, self.ring_slots
        out.slot_frames = torch.full((out.capacity,), -1, dtype=torch.long)
        out.tokens_per_group = self.tokens_per_group
        if self.key_buffer is not None:
            out._set_buffers(fn(self.key_buffer), fn(self.value_buffer))
        out.slot_frames, out.end_frame = self.slot_frames.clone(), self.end_frame
        return out

    def clone(self) -> StaticKVCache:
        """A deep copy with its own buffers (writing into one never changes the other)."""
        out = self._copy(self.batch_size, torch.clone)
        out.cross = {layer: (key, k.clone(), v.clone()) for layer, (key, k, v) in self.cross.items()}
        return out

    def repeat_interleave(self, n: int) -> StaticKVCache:
        """A new cache of batch ``B * n`` (new buffers of that batch): row ``b`` repeated ``n`` times in a row."""
        return self._copy(self.batch_size * n, lambda t: t.repeat_interleave(n, dim=1))

    def select_rows(self, rows: list[int]) -> StaticKVCache:
        """A new cache (new buffers) holding batch rows ``rows``."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return self._copy(len(rows), lambda t: t.index_select(1, idx.to(t.device)))

    def nbytes(self) -> int:
        """Bytes held by the key / value buffers (constant once allocated)."""
        return sum(t.numel() * t.element_size() for t in (self.key_buffer, self.value_buffer) if t is not None)


def make_kv_cache(config: CausalConfig, batch_size: int, patch_frames: int = 1) -> KVCache | StaticKVCache:
    """An empty cache for ``config``: :class:`StaticKVCache` when ``config.static_cache``, else :class:`KVCache`."""
    if config.static_cache:
        return StaticKVCache(config, batch_size, patch_frames)
    return KVCache(config, batch_size, patch_frames=patch_frames)


@dataclass
class ChunkSchedule:
    """How a causal student generates: chunk layout, few-step list, re-noise rule and context noise.

    Attributes:
        causal: chunk sizes, local window, sink frames and position policy (:class:`CausalConfig`).
        timesteps: the configured denoising list in [0, 1000], descending (Self-Forcing [1000, 750, 500, 250]).
        shift: timestep shift s.
        warp: Self-Forcing's ``warp_denoising_step``: the list indexes the shifted 1000-step grid (shift 5 gives
            [1000, 937.5, 833.3, 625]); False shifts each value directly.
        kernel: ``"consistency"`` (x_{j+1} = (1 - sigma_{j+1}) x0_hat + sigma_{j+1} eps', fresh eps'; Self-Forcing)
            or ``"ode"`` (Euler step x + (sigma_{j+1} - sigma_j) v; deterministic).
        context_noise: sigma of the context pass that commits a finished chunk (0 = clean context).

    Raises:
        ValueError: an empty or non-descending list, values outside [0, 1000], a bad kernel or context noise.
    """

    causal: CausalConfig = field(default_factory=CausalConfig)
    timesteps: list[float] = field(default_factory=lambda: [1000.0, 750.0, 500.0, 250.0])
    shift: float = 5.0
    warp: bool = True
    kernel: Literal["consistency", "ode"] = "consistency"
    context_noise: float = 0.0

    def __post_init__(self) -> None:
        ts = [float(t) for t in self.timesteps]
        if not ts or any(not 0 < t <= 1000 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
            raise ValueError(f"timesteps must be a strictly descending list in (0, 1000], got {self.timesteps}")
        self.timesteps = ts
        if self.kernel not in ("consistency", "ode"):
            raise ValueError(f"kernel must be 'consistency' or 'ode', got {self.kernel!r}")
        if not 0.0 <= self.context_noise < 1.0:
            raise ValueError(f"context_noise is a sigma in [0, 1), got {self.context_noise}")
        if isinstance(self.causal, dict):
            self.causal = CausalConfig(**self.causal)
        elif not isinstance(self.causal, CausalConfig) and hasattr(self.causal, "__dict__"):  # a config Namespace
            self.causal = CausalConfig(**{k: v for k, v in vars(self.causal).items() if not k.startswith("_")})

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    def sigmas(self) -> torch.Tensor:
        """float64 [S + 1]: the step sigmas, then 0."""
        if self.warp:
            sig = [float(v) for v in warped_sigmas(self.timesteps, self.shift)]
        else:
            sig = [float(shift_sigmas(torch.tensor(t / 1000.0, dtype=torch.float64), self.shift))
                   for t in self.timesteps]
        return torch.tensor(sig + [0.0], dtype=torch.float64)


@runtime_checkable
class CausalGenerator(Protocol):
    """What the autoregressive sampler needs from a causal student (genrl's DiT, the causal Wan2.1 adapter).

    - ``frame_dim``: frame axis of the latents (1 for [B, T, C, H, W], 2 for Wan's [B, C, T, H, W]);
    - ``init_cache(batch_size, causal) -> KVCache``;
    - ``velocity_chunk(x, sigma, cond, cache) -> v``: a chunk starting at ``cache.end_frame``, attending to the
      cached context (read only); sigma [B] or per frame;
    - ``commit(x, sigma, cond, cache)``: the context pass, appending the chunk's keys / values (no gradient);
    - ``velocity(x, sigma, cond, attention=..., causal=..., start_frame=...)``: full-sequence forward
      (``"block_causal"`` with the same layout, or ``"bidirectional"``).
    """

    frame_dim: int

    def init_cache(self, batch_size: int, causal: CausalConfig) -> KVCache: ...

    def velocity_chunk(self, x: torch.Tensor, sigma: torch.Tensor, cond, cache: KVCache) -> torch.Tensor: ...

    def commit(self, x: torch.Tensor, sigma: torch.Tensor, cond, cache: KVCache) -> None: ...
