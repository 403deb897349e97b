"""TMD's transition sampler, a mode of the shared sampler: M outer transitions, each an N-step inner flow of a head.

Transition Matching Distillation (Nie et al. 2026, arXiv 2601.09881; the math is :mod:`genrl.flow.tmd`). The model
is the teacher split into a backbone and a light flow head (:class:`TransitionModelLike`). Starting from
``x_{t_M} = eps`` (treated as the state at ``t_M = t_max``), each outer transition k = 0 .. M - 1 (from
``t = outer[k]`` to ``t' = outer[k + 1]``):

1. runs the backbone once: ``m = model.features(x_t, t, cond)``;
2. runs the head N times on the inner grid ``s_N = t_max > ... > s_0 = 0`` (:func:`inner_flow`), starting from
   ``y_{s_N} = y1`` (fresh inner noise of this transition, treated as the state at s_N), jump j from
   ``s = inner[j]`` to ``r = inner[j + 1]``: ``y_r = f(y_s, s, r)`` with ``y_hat = model.head(y_s, s, r, m, t)``
   (:func:`genrl.flow.inner_flow_step`); the result ``y_hat0`` (the state at s = 0) samples ``y = x1 - x0``;
3. steps ``x_{t'} = x_t - (t - t') y_hat0`` (:func:`genrl.flow.outer_step`).

Reproducibility (docs/architecture.md, Seeds and noise addressing): the start noise of sample i is drawn from
``(seed, i, step 0, stream OUTER_STREAM)`` (stream 0, the flat rollout's initial-noise address, so a TMD student
and its teacher's :func:`genrl.rollout.rollout` start from the same noise) and the inner noise y1 of outer
transition k (k = 0 is the first one executed, from t_M) from ``(seed, i, step k, stream INNER_STREAM)``. With
``batching="fixed"`` the whole rollout runs in micro-batches of exactly ``micro_batch_size`` rows (the last one
padded by repetition), so a sample's result does not depend on the batch it was drawn in, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from genrl.flow.tmd import (
    PARAMETERIZATIONS,
    Parameterization,
    effective_nfe,
    inner_flow_step,
    outer_step,
    transition_grid,
)
from genrl.noise import NoiseBackend, check_backend, randn_per_sample, stream_id
from genrl.rollout.sampler import BATCHING_MODES, call_plan

__all__ = ["INNER_STREAM", "OUTER_STREAM", "TransitionConfig", "TransitionModelLike", "TransitionResult",
           "inner_flow", "load_transition_model", "transition_rollout"]

#: the noise stream of the start noise x_{t_M} (step 0): the flat rollout's initial-noise stream.
OUTER_STREAM = stream_id("rollout.flat")
#: the noise stream of the inner noise y1 (step k = the outer transition's number in execution order).
INNER_STREAM = stream_id("rollout.transition_inner")


@runtime_checkable
class TransitionModelLike(Protocol):
    """What :func:`transition_rollout` needs from a TMD student (genrl/models/trunk.py implements it for DiTs).

    Attributes:
        num_layers: L, the network's layer count (backbone + head); head_layers: H, the head's (1 <= H <= L).
            Only :func:`genrl.flow.effective_nfe` reads them.
    """

    num_layers: int
    head_layers: int

    def features(self, x: torch.Tensor, t: torch.Tensor, cond: Any) -> Any:
        """The backbone: features m of ``x`` [B, *latent] at outer times ``t`` [B] (an opaque object the head
        reads; run once per outer transition)."""
        ...

    def head(self, y: torch.Tensor, s: torch.Tensor, r: torch.Tensor, features: Any, t: torch.Tensor) -> torch.Tensor:
        """The flow head: ``y_hat`` (an estimate of y = x1 - x0, shape of ``y`` = shape of x) from the inner state
        ``y`` at inner time ``s`` for a jump to ``r``, given the backbone's features at outer time ``t``
        (s, r, t: [B] tensors in the state's dtype, 0 <= r <= s <= 1)."""
        ...


@dataclass
class TransitionConfig:
    """How a TMD student samples (the sampler block of a TMD method's config).

    Attributes:
        outer_steps: M, outer transitions (>= 1).
        inner_steps: N, head calls per outer transition (>= 1).
        outer_shift, inner_shift: shifts of the outer and inner grids (:func:`genrl.flow.transition_grid`), > 0.
        t_max: the first point of both grids, in (0, 1] (0.999: the start is treated as nearly pure noise).
        parameterization: how the head's y_hat becomes the inner average velocity: ``"denoiser"`` (default,
            ``u = (y_s - y_hat) / s``) or ``"noise"`` (``u = y1 - y_hat``); see :mod:`genrl.flow.tmd`. Training
            must use the same one (:func:`genrl.flow.average_velocity`).
        micro_batch_size: rows per run of the sampler: exactly (``batching="fixed"``, the last run padded by
            repetition) or at most (``"fast"`` / ``"bucketed"``); see :func:`genrl.rollout.sampler.call_plan`.
        batching: ``"fixed"`` (default; a sample's result is bitwise independent of its batch), ``"fast"`` or
            ``"bucketed"`` (docs/architecture.md, Batching: bitwise or fast).
        noise_backend: ``"generator"`` or ``"philox"`` (:mod:`genrl.noise`).

    Raises (at construction):
        ValueError: a step count not an int >= 1, a shift not finite and > 0, t_max outside (0, 1], an unknown
            parameterization / batching / backend, micro_batch_size < 1, or grids that do not decrease (the message
            names the value).
    """

    outer_steps: int = 2
    inner_steps: int = 2
    outer_shift: float = 10.0
    inner_shift: float = 10.0
    t_max: float = 0.999
    parameterization: Parameterization = "denoiser"
    micro_batch_size: int = 8
    batching: Literal["fixed", "fast", "bucketed"] = "fixed"
    noise_backend: NoiseBackend = "generator"

    def __post_init__(self) -> None:
        for name in ("outer_steps", "inner_steps", "micro_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransitionConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("outer_shift", "inner_shift", "t_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"TransitionConfig.{name} must be a finite number, got {value!r}")
        if not (self.outer_shift > 0 and self.inner_shift > 0):
            raise ValueError(f"TransitionConfig shifts must be > 0, got outer_shift={self.outer_shift}, "
                             f"inner_shift={self.inner_shift}")
        if not 0.0 < self.t_max <= 1.0:
            raise ValueError(f"TransitionConfig.t_max must lie in (0, 1], got {self.t_max}")
        if self.parameterization not in PARAMETERIZATIONS:
            raise ValueError(f"unknown TransitionConfig.parameterization {self.parameterization!r}; use one of "
                             f"{PARAMETERIZATIONS}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"unknown TransitionConfig.batching {self.batching!r}; use one of {BATCHING_MODES}")
        check_backend(self.noise_backend)
        self.outer_grid()  # a grid that would not decrease raises here, naming the values
        self.inner_grid()

    def outer_grid(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
        """The outer grid [M + 1], t_max down to 0 (:func:`genrl.flow.transition_grid`)."""
        return transition_grid(self.outer_steps, self.outer_shift, self.t_max, dtype=dtype, device=device)

    def inner_grid(self, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None) -> torch.Tensor:
        """The inner grid [N + 1], t_max down to 0 (:func:`genrl.flow.transition_grid`)."""
        return transition_grid(self.inner_steps, self.inner_shift, self.t_max, dtype=dtype, device=device)


@dataclass
class TransitionResult:
    """What :func:`transition_rollout` returns.

    Attributes:
        latents: the samples x_{t_0} [B, *latent_shape] on the model's device (with the graph under ``grad=True``).
        effective_nfe: the sampler's cost in teacher passes, ``M (1 + (N - 1) H / L)`` (paper eq. 16).
        backbone_calls: backbone evaluations per sample (M); head_calls: head evaluations per sample (M N).
        trajectory: [B, M + 1, *latent_shape], x at every outer grid point (x_{t_M} first), or None.
        velocities: [B, M, *latent_shape], the sampled y_hat0 of every outer transition, or None.
        inner_noise: [B, M, *latent_shape], the inner noise y1 of every outer transition, or None.
    """

    latents: torch.Tensor
    effective_nfe: float
    backbone_calls: int
    head_calls: int
    trajectory: torch.Tensor | None = None
    velocities: torch.Tensor | None = None
    inner_noise: torch.Tensor | None = None


def _model_device(model) -> torch.device:
    device = getattr(model, "device", None)
    if device is not None:
        return torch.device(device)
    params = getattr(model, "parameters", None)
    if callable(params):
        for p in params():
            return p.device
    return torch.device("cpu")


def _check_grid(grid: torch.Tensor, name: str) -> None:
    if not isinstance(grid, torch.Tensor) or grid.ndim != 1 or grid.numel() < 2:
        raise ValueError(f"{name} must be a 1-d tensor of at least 2 points, got "
                         f"{tuple(grid.shape) if isinstance(grid, torch.Tensor) else type(grid).__name__}")
    if not bool((grid[1:] < grid[:-1]).all()) or float(grid[-1]) < 0 or float(grid[0]) > 1:
        raise ValueError(f"{name} must decrease strictly within [0, 1], got {grid.tolist()}")


def inner_flow(
    model: TransitionModelLike,
    features: Any,
    t: float | torch.Tensor,
    y1: torch.Tensor,
    inner_grid: torch.Tensor,
    parameterization: Parameterization = "denoiser",
) -> torch.Tensor:
    """One outer transition's inner flow: N = ``len(inner_grid) - 1`` head jumps from ``y_{s_N} = y1`` down the grid.

    Jump j goes from ``s = inner_grid[j]`` to ``r = inner_grid[j + 1]``: ``y_hat = model.head(y, s, r, features,
    t)``, ``y <- inner_flow_step(y, s, r, y1, y_hat, parameterization)``. Runs in the caller's grad mode: with
    gradients enabled the graph runs through every jump, into the head's parameters and, through ``features``, into
    the backbone's (TMD's stage 2 back-propagates through the whole rollout). The state y1 is treated as the inner
    state at ``inner_grid[0]`` (exact only for a grid starting at 1).

    Args:
        model: the student (:class:`TransitionModelLike`).
        features: ``model.features(x_t, t, cond)`` for this transition.
        t: the outer time, a float, 0-d or [B] tensor (the head gets it as [B] in y1's dtype).
        y1: the inner noise [B, *latent] (its dtype is the state's dtype).
        inner_grid: the descending inner grid [N + 1] (e.g. ``TransitionConfig.inner_grid()``), normally ending at 0.
        parameterization: ``"denoiser"`` or ``"noise"`` (:func:`genrl.flow.average_velocity`).

    Returns:
        The state at ``inner_grid[-1]`` (y_hat0, the sampled y when the grid ends at 0), shape and dtype of y1.

    Raises:
        ValueError: a grid that is not 1-d descending in [0, 1], a bad parameterization, or a head output whose
            shape differs from y1's.
    """
    _check_grid(inner_grid, "inner_grid")
    b = y1.shape[0]
    grid = inner_grid.detach().to(device=y1.device, dtype=y1.dtype)
    tb = torch.as_tensor(t).to(device=y1.device, dtype=y1.dtype).expand(b)  # a float, 0-d or [B] -> [B]
    y = y1
    for j in range(grid.numel() - 1):
        s, r = grid[j].expand(b), grid[j + 1].expand(b)
        y_hat = model.head(y, s, r, features, tb)
        if y_hat.shape != y.shape:
            raise ValueError(f"model.head returned shape {tuple(y_hat.shape)}, expected the state's {tuple(y.shape)}")
        y = inner_flow_step(y, s, r, y1, y_hat, parameterization).to(y1.dtype)
    return y


def _select_cond(cond: Any, padded: list[int], n: int) -> Any:
    if cond is None or padded == list(range(n)):
        return cond
    if isinstance(cond, torch.Tensor):
        return cond[torch.as_tensor(padded, device=cond.device)]
    if hasattr(cond, "select"):
        return cond.select(padded)
    raise TypeError(f"cond of type {type(cond).__name__} cannot be split into micro-batches: pass None, a tensor "
                    f"with B rows, an object with .select(rows) (genrl's Conditioning), or set micro_batch_size >= B "
                    f"with batching='fast'")


def transition_rollout(
    model: TransitionModelLike,
    cond: Any,
    latent_shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor,
    config: TransitionConfig | None = None,
    grad: bool = False,
    noise: torch.Tensor | None = None,
    record: bool = False,
    dtype: torch.dtype = torch.float32,
) -> TransitionResult:
    """Sample B latents with M outer transitions of N head jumps each (see the module docstring).

    Args:
        model: the student (:class:`TransitionModelLike`); its device (``model.device`` or its first parameter's)
            is where noise is drawn and the state lives.
        cond: the conditioning ``model.features`` takes (B rows: a tensor, genrl's ``Conditioning``, or None);
            split per micro-batch with ``[rows]`` / ``.select(rows)``.
        latent_shape: one sample's latent shape, e.g. (T, C, H, W).
        seed, indices: address every draw (B = len(indices) global sample ids).
        config: the sampler (default ``TransitionConfig()``: M = 2, N = 2).
        grad: False: run under ``torch.no_grad()``; True: keep the whole graph (every outer transition, every inner
            jump, the backbone), as TMD's stage 2 needs.
        noise: the start noise x_{t_M} [B, *latent_shape] to use instead of the addressed draw (moved to the model's
            device and ``dtype``); the inner noise is always drawn.
        record: also return the trajectory, the sampled velocities and the inner noise.
        dtype: the state's dtype (noise is drawn in float32 and cast, so its values do not depend on it).

    Returns:
        :class:`TransitionResult`.

    Raises:
        ValueError: ``noise`` of the wrong shape, an empty ``indices``, a head output of the wrong shape.
        TypeError: a ``cond`` that cannot be split into micro-batches.
    """
    config = config or TransitionConfig()
    idx = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
    b = len(idx)
    if b == 0:
        raise ValueError("indices is empty: nothing to sample")
    shape = tuple(int(d) for d in latent_shape)
    device = _model_device(model)
    m_steps, n_steps = config.outer_steps, config.inner_steps
    if noise is not None:
        if tuple(noise.shape) != (b, *shape):
            raise ValueError(f"noise of shape {tuple(noise.shape)} must be [B, *latent_shape] = {(b, *shape)}")
        x_start = noise.to(device=device, dtype=dtype)
    else:
        x_start = randn_per_sample(shape, seed, idx, step=0, stream=OUTER_STREAM, device=device,
                                   backend=config.noise_backend).to(dtype)
    y1s = torch.stack([randn_per_sample(shape, seed, idx, step=k, stream=INNER_STREAM, device=device,
                                        backend=config.noise_backend).to(dtype) for k in range(m_steps)], dim=1)
    outer = config.outer_grid(dtype=dtype, device=device)
    inner = config.inner_grid(dtype=dtype, device=device)
    finals, trajs, vels = [], [], []
    with contextlib.nullcontext() if grad else torch.no_grad():
        for rows, padded in call_plan(b, config.micro_batch_size, config.batching):
            sel = torch.as_tensor(padded, device=device)
            x = x_start if padded == list(range(b)) else x_start[sel]
            y1_rows = y1s if padded == list(range(b)) else y1s[sel]
            c = _select_cond(cond, padded, b)
            xs, ys = [x], []
            for k in range(m_steps):
                t = outer[k].expand(x.shape[0])
                feats = model.features(x, t, c)
                y_hat0 = inner_flow(model, feats, t, y1_rows[:, k], inner, config.parameterization)
                x = outer_step(x, outer[k], outer[k + 1], y_hat0).to(dtype)
                xs.append(x)
                ys.append(y_hat0)
            n = len(rows)
            finals.append(x[:n])
            if record:
                trajs.append(torch.stack(xs, dim=1)[:n])
                vels.append(torch.stack(ys, dim=1)[:n])
    return TransitionResult(
        latents=torch.cat(finals),
        effective_nfe=effective_nfe(m_steps, n_steps, int(model.head_layers), int(model.num_layers)),
        backbone_calls=m_steps,
        head_calls=m_steps * n_steps,
        trajectory=torch.cat(trajs) if record else None,
        velocities=torch.cat(vels) if record else None,
        inner_noise=y1s if record else None,
    )


def load_transition_model(folder: str | Path, text_encoder: str | None = None, **load_kwargs):
    """A TMD export (``DiffusersExport`` of a TMD run: the student's transformer + ``flow_head.*``) as a sampler-ready
    student: returns ``(generator, TransitionModel, TransitionConfig)``, the sampler being the run's (M, N, shifts,
    parameterization). ``text_encoder`` / ``load_kwargs`` go to :func:`genrl.models.loading.load_generator`.

    Raises:
        FileNotFoundError: the folder is not a model folder, or it holds no flow head (not a TMD export).
    """
    from genrl.models.loading import load_generator
    from genrl.models.trunk import HEAD_CONFIG_FILE, FlowHead, TransitionModel, load_head, trunk_adapter

    cfg_path = Path(folder) / HEAD_CONFIG_FILE
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} holds no {HEAD_CONFIG_FILE}: not the export of a TMD run")
    cfg = json.loads(cfg_path.read_text())
    gen = load_generator(folder, text_encoder=text_encoder, **load_kwargs)
    head = FlowHead(trunk_adapter(gen), num_layers=cfg["head_layers"], gate_init=cfg["gate_init"],
                    head_time=cfg["head_time"])
    load_head(head, folder)
    config = TransitionConfig(outer_steps=cfg["outer_steps"], inner_steps=cfg["inner_steps"],
                              outer_shift=cfg["outer_shift"], inner_shift=cfg["inner_shift"], t_max=cfg["t_max"],
                              parameterization=cfg.get("parameterization", "denoiser"))
    return gen, TransitionModel(gen, head.eval()), config
