"""Branched rollouts of a causal student under step plans: a shared prefix, G continuations forked at a chunk, and
the exact replay of the forked chunks' log-probabilities (RL on distilled causal students; TempAct's executor).

A batch of R *rows* (one per plan; a plan gives every chunk its step text, genrl.models.plans) is rolled out
chunk by chunk with :func:`~genrl.rollout.autoregressive.ar_rollout`, switching a row's prompt wherever its plan
starts a new step. At the fork chunk f the state is switched to the texts of chunk f and forked into G
continuations (:func:`~genrl.rollout.autoregressive.fork`, every tensor cloned), each drawing its own noise for
chunks >= f. The first ``train_chunks`` chunks after the fork are recorded: their step inputs x_j, velocities v_j and
injected noises, so the re-noise policy pi(x_{j+1} | x_j) = N((1 - sigma_{j+1}) (x_j - sigma_j v), sigma_{j+1}^2 I)
(:func:`genrl.flow.renoise.renoise_log_prob`) can be evaluated at sampling time and replayed with a gradient.

:func:`replay_forks` rebuilds the prefix under the current weights by the same cache operations the rollout made
(commit every clean prefix chunk, the same switches, the same batch), then forks: on-policy, the replayed velocity
equals the sampled one bit for bit, so the importance ratio of the first update is exactly 1 (tested in float64 and
float32). Nothing flows through the cache.

Rows and continuations: continuation ``n = r * G + g`` is row r's branch g. Noise: the prefix draws at (seed, row
index, chunk, step), branch g of row r at (``branch_seed``, ``r_index * G + g``, chunk, step), so the branches of a row
differ from each other and from every other row's, and a rerun repeats them (docs/architecture.md, Seeds and noise
addressing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from genrl.models.causal import ChunkSchedule
from genrl.models.plans import Plan
from genrl.models.text_encoder import Conditioning
from genrl.noise import mix_seed, stream_id
from genrl.rollout.autoregressive import (
    ARState,
    SwitchMode,
    _renoise,
    ar_rollout,
    chunk_noise,
    fork,
    new_state,
    switch_prompt,
)

__all__ = ["BranchRollout", "ChunkTrace", "branch_rollout", "branch_indices", "replay_forks", "step_texts",
           "BRANCH_STREAM"]

BRANCH_STREAM = stream_id("rollout.branch_seed")
"""Stream mixed into the run seed for the continuations' noise (distinct from the prefix's)."""


@dataclass
class ChunkTrace:
    """The recorded denoising of one trained chunk of one fork (R rows).

    Attributes:
        chunk: the chunk index.
        x: float [S, R, *chunk] step inputs x_0 .. x_{S-1} (x_0 the chunk's initial noise).
        v: float [S, R, *chunk] the velocities the sampler used at each step.
        sigmas: float64 [S + 1] the chunk's sigmas, ending with 0.
        clean: float [R, *chunk] the committed clean chunk (the last step's x0 prediction).
    """

    chunk: int
    x: torch.Tensor
    v: torch.Tensor
    sigmas: torch.Tensor
    clean: torch.Tensor

    @property
    def num_transitions(self) -> int:
        """Stochastic transitions x_j -> x_{j+1} (j < S - 1; the last step to x0 is deterministic)."""
        return int(self.x.shape[0]) - 1


@dataclass
class BranchRollout:
    """Output of :func:`branch_rollout`.

    Attributes:
        latents: clean latents of every continuation, [R * G, T, ...] (generator layout), continuation r * G + g.
        prefix: clean prefix latents [R, f frames, ...] (None when f = 0).
        traces: ``traces[g]``: the :class:`ChunkTrace` list of fork g (the ``train_chunks`` recorded chunks).
        fork_chunk: f; num_branches: G; row_indices: int64 [R] the rows' sample ids; seed / branch_seed: the
            noise seeds of the prefix and of the continuations.
    """

    latents: torch.Tensor
    prefix: torch.Tensor | None
    traces: list[list[ChunkTrace]]
    fork_chunk: int
    num_branches: int
    row_indices: torch.Tensor
    seed: int
    branch_seed: int


def step_texts(plans: Sequence[Plan], chunk: int) -> list[str]:
    """The step text of every plan at ``chunk``."""
    return [p.text_at(chunk) for p in plans]


def branch_indices(row_indices: torch.Tensor, num_branches: int) -> list[list[int]]:
    """Noise ids of the branches: fork g gets ``[r * G + g for r in rows]``."""
    rows = [int(i) for i in row_indices]
    return [[r * num_branches + g for r in rows] for g in range(num_branches)]


class _Conds:
    """Encodes each chunk's step texts once per distinct tuple of texts."""

    def __init__(self, generator, plans: Sequence[Plan]) -> None:
        self.generator, self.plans, self._memo = generator, list(plans), {}

    def at(self, chunk: int) -> Conditioning:
        texts = tuple(step_texts(self.plans, chunk))
        if texts not in self._memo:
            self._memo[texts] = self.generator.encode_prompts(list(texts))
        return self._memo[texts]

    def changes(self, chunk: int) -> bool:
        """True when some row's text at ``chunk`` differs from its text at ``chunk - 1``."""
        return chunk > 0 and step_texts(self.plans, chunk) != step_texts(self.plans, chunk - 1)

    def switches(self, start: int, stop: int, mode: SwitchMode) -> dict[int, tuple[Conditioning, SwitchMode]]:
        return {k: (self.at(k), mode) for k in range(start, stop) if self.changes(k)}


def _check(plans: Sequence[Plan], num_chunks: int, fork_chunk: int, num_branches: int, train_chunks: int) -> None:
    if not plans:
        raise ValueError("branch_rollout needs at least one plan")
    for i, p in enumerate(plans):
        if p.num_chunks != num_chunks:
            raise ValueError(f"plan {i} covers {p.num_chunks} chunks, the rollout has {num_chunks}")
    if not 0 <= fork_chunk < num_chunks:
        raise ValueError(f"fork_chunk {fork_chunk} is outside 0..{num_chunks - 1}")
    if num_branches < 1:
        raise ValueError(f"num_branches must be >= 1, got {num_branches}")
    if not 1 <= train_chunks <= num_chunks - fork_chunk:
        raise ValueError(f"train_chunks {train_chunks} must be in 1..{num_chunks - fork_chunk} (chunks after the fork)")


def _prefix_state(generator, conds: _Conds, schedule: ChunkSchedule, fork_chunk: int, frame_shape, seed: int,
                  row_indices: torch.Tensor, mode: SwitchMode,
                  prefix: torch.Tensor | None) -> tuple[ARState, torch.Tensor | None]:
    """The state at the fork, switched to chunk f's texts: sampled (``prefix`` None) or replayed from ``prefix``."""
    if fork_chunk == 0:
        return new_state(generator, conds.at(0), schedule.causal, seed, row_indices), None
    if prefix is None:
        res = ar_rollout(generator, conds.at(0), fork_chunk, frame_shape, schedule, seed=seed, indices=row_indices,
                         prompt_switches=conds.switches(1, fork_chunk, mode))
        state = res.state
    else:
        state = new_state(generator, conds.at(0), schedule.causal, seed, row_indices)
        causal, fd = schedule.causal, state.frame_dim
        for k in range(fork_chunk):  # the rollout's cache operations without its denoising forwards
            if conds.changes(k):
                switch_prompt(generator, state, conds.at(k), mode, context_noise=schedule.context_noise)
            s0, length = causal.chunk_start(k), causal.chunk_len(k)
            clean = prefix.narrow(fd, s0, length).to(generator.device)
            _commit(generator, state, clean, k, schedule, frame_shape)
    if conds.changes(fork_chunk):
        switch_prompt(generator, state, conds.at(fork_chunk), mode, context_noise=schedule.context_noise)
    return state, state.latents


def _commit(generator, state: ARState, clean: torch.Tensor, chunk: int, schedule: ChunkSchedule, frame_shape) -> None:
    """Commit a clean chunk exactly as :func:`ar_rollout` does (context noise from the same address)."""
    n, ctx_sigma, ctx = state.batch_size, schedule.context_noise, clean
    if ctx_sigma > 0:
        eps = chunk_noise(state, frame_shape, chunk, schedule.num_steps + 1, schedule.causal.chunk_len(chunk),
                          clean.device, clean.dtype)
        ctx = _renoise(clean, ctx_sigma, eps)
    generator.commit(ctx, torch.full((n,), ctx_sigma, device=clean.device, dtype=clean.dtype), state.cond,
                     state.cache)
    state.latents = clean if state.latents is None else torch.cat([state.latents, clean], dim=state.frame_dim)
    state.chunk_index = chunk + 1


def _trace(rec: dict) -> ChunkTrace:
    return ChunkTrace(chunk=int(rec["chunk"]), x=rec["x"], v=rec["v"], sigmas=rec["sigmas"].double(),
                      clean=rec["x0"][-1])


@torch.no_grad()
def branch_rollout(generator, plans: Sequence[Plan], frame_shape: Sequence[int], schedule: ChunkSchedule,
                   fork_chunk: int, num_branches: int, seed: int, row_indices: torch.Tensor | Sequence[int],
                   train_chunks: int = 1, switch_mode: SwitchMode = "recache", branch_seed: int | None = None,
                   ) -> BranchRollout:
    """Roll out ``plans`` (one row each) to the fork chunk, fork G continuations, finish every video.

    Args:
        generator: a causal generator (genrl.models.causal interface).
        plans: R plans over the same ``num_chunks`` chunks (the rollout's length is ``plans[0].num_chunks``).
        frame_shape: latent shape of one frame without the frame axis.
        schedule: the student's few-step :class:`ChunkSchedule` (kernel ``consistency`` for a re-noise policy).
        fork_chunk: f in [0, num_chunks): the prefix is chunks < f (shared by a row's branches); 0 = no prefix
            (the G branches are independent videos, flat GRPO).
        num_branches: G >= 1 continuations per row.
        seed, row_indices: the prefix's noise addressing (int64 [R] sample ids).
        train_chunks: chunks recorded after the fork (1 = TempAct: the first chunk of the new step).
        switch_mode: how a step boundary switches the prompt (``swap``, ``crossattn_reset`` or ``recache``).
        branch_seed: the continuations' seed (default ``mix_seed(seed, BRANCH_STREAM)``).
    Returns:
        :class:`BranchRollout`.
    Raises:
        ValueError: plans of different lengths, f or ``train_chunks`` out of range, G < 1.
    """
    num_chunks = plans[0].num_chunks if plans else 0
    _check(plans, num_chunks, fork_chunk, num_branches, train_chunks)
    rows = torch.as_tensor([int(i) for i in row_indices], dtype=torch.long)
    bseed = mix_seed(seed, BRANCH_STREAM) if branch_seed is None else int(branch_seed)
    conds = _Conds(generator, plans)
    state, prefix = _prefix_state(generator, conds, schedule, fork_chunk, frame_shape, seed, rows, switch_mode, None)
    forks = fork(state, num_branches, indices=branch_indices(rows, num_branches))
    videos, traces = [], []
    for st in forks:
        st.seed = bseed
        rec = ar_rollout(generator, None, train_chunks, frame_shape, schedule, state=st, record=True,
                         prompt_switches=conds.switches(fork_chunk + 1, fork_chunk + train_chunks, switch_mode))
        rest = num_chunks - fork_chunk - train_chunks
        if rest:
            ar_rollout(generator, None, rest, frame_shape, schedule, state=st,
                       prompt_switches=conds.switches(fork_chunk + train_chunks, num_chunks, switch_mode))
        traces.append([_trace(t) for t in rec.trajectory])
        videos.append(st.latents)
    stacked = torch.stack(videos, dim=1)  # [R, G, ...]
    latents = stacked.reshape(-1, *stacked.shape[2:])
    return BranchRollout(latents=latents, prefix=prefix, traces=traces, fork_chunk=fork_chunk,
                         num_branches=num_branches, row_indices=rows, seed=seed, branch_seed=bseed)


@torch.no_grad()
def replay_forks(generator, plans: Sequence[Plan], rollout: BranchRollout, frame_shape: Sequence[int],
                 schedule: ChunkSchedule, switch_mode: SwitchMode = "recache") -> list[list[ARState]]:
    """States to replay the recorded chunks under the current weights: ``states[g][c]`` is fork g's state just
    before its c-th recorded chunk (its prompt switched), built by the rollout's own cache operations from the
    stored clean latents (no denoising forward, no gradient). On-policy, a velocity evaluated at a trace's step
    input on ``states[g][c]`` equals the recorded one bit for bit.

    Raises:
        ValueError: the plans do not match the rollout's rows.
    """
    if len(plans) != len(rollout.row_indices):
        raise ValueError(f"{len(plans)} plans for a rollout of {len(rollout.row_indices)} rows")
    conds = _Conds(generator, plans)
    state, _ = _prefix_state(generator, conds, schedule, rollout.fork_chunk, frame_shape, rollout.seed,
                             rollout.row_indices, switch_mode, rollout.prefix)
    forks = fork(state, rollout.num_branches, indices=branch_indices(rollout.row_indices, rollout.num_branches))
    out = []
    for st, traces in zip(forks, rollout.traces):
        st.seed = rollout.branch_seed
        per_chunk = []
        for c, tr in enumerate(traces):
            if c > 0 and conds.changes(tr.chunk):
                switch_prompt(generator, st, conds.at(tr.chunk), switch_mode, context_noise=schedule.context_noise)
            per_chunk.append(fork(st, 1)[0] if c + 1 < len(traces) else st)
            if c + 1 < len(traces):
                _commit(generator, st, tr.clean.to(generator.device), tr.chunk, schedule, frame_shape)
        out.append(per_chunk)
    return out
