"""Transition Matching Distillation (TMD): the math of a few-step transition sampler with an inner flow head.

Nie, Berner, Ma, Liu, Xie & Vahdat 2026, "Transition Matching Distillation for Fast Video Generation"
(arXiv 2601.09881). The student is the teacher split in two: a *backbone* (most layers) that runs once per outer
step and turns ``x_t`` into features m, and a light *flow head* (the last few layers) that runs N times per outer
step to sample the outer transition. Two nested processes, both in genrl's convention (docs/architecture.md:
sigma == t in [0, 1], t = 1 noise, ``x_t = (1 - t) x0 + t eps``, velocity ``v = eps - x0``):

- **outer**: M transitions on a descending grid ``t_M = t_max > ... > t_0 = 0`` (:func:`transition_grid`). The
  quantity sampled at each transition is ``y = x1 - x0`` (outer noise minus data: the outer flow's conditional
  velocity), and the update is ``x_{t'} = x_t - (t - t') y`` (:func:`outer_step`; the paper's eq. 18 writes it
  as ``(1 - t'/t) g + (t'/t) x_t`` with ``g = x_t - t y``, the same number);
- **inner**: a flow from ``y1 ~ N(0, I)`` (fresh per outer step) to y along ``y_s = (1 - s) y + s y1`` on an inner
  grid ``s_N = t_max > ... > s_0 = 0``. The head returns ``y_hat = head(y_s, s, r, m, t)``, an estimate of y, and
  the inner flow map is ``f(y_s, s, r) = y_s - (s - r) u`` with the *average velocity* u built from y_hat by one of
  two parameterisations (:data:`PARAMETERIZATIONS`, :func:`average_velocity`):

  * ``"denoiser"`` (genrl's default): ``u = (y_s - y_hat) / s``, i.e. ``f = (r / s) y_s + (1 - r / s) y_hat``,
    the inner analogue of the outer eq. 18 form;
  * ``"noise"``: ``u = y1 - y_hat`` with y1 the inner noise of this outer step, carried along (the form the
    task's specification gives).

  Both agree with the conditional velocity ``v = y1 - y`` when ``y_hat = y`` on the straight path. They differ
  in what stage-1 training makes of a head that cannot see y1: under ``"denoiser"`` u is a function of
  ``(y_s, s, r)`` alone, so MeanFlow training's fixed point is the exact average velocity of the marginal inner
  flow; under ``"noise"`` u depends on y1 itself, and the fixed point ``(s - r) y_hat = int_r^s E[y | y_sigma]
  dsigma`` (along the marginal flow) averages posterior means, which shrinks multi-modal transitions towards
  their mean (on the 2-D toy, benchmarks/tmd_toy.py: samples at radius 3.7 instead of 4.0, while "denoiser"
  keeps the radius; stage 2's distribution matching, which trains through the rollout, can correct either).

Training (stage 1, "TM-MeanFlow"): the outer point x_{t_i} from :func:`sample_outer_point`, s, r from
:func:`sample_inner_times`, the total derivative of u along the conditional tangent (v, 1) by
:func:`finite_difference_derivative`, the target :func:`meanflow_target` and the loss :func:`adaptive_loss`
(Geng et al. 2025, "Mean Flows for One-step Generative Modeling", arXiv 2505.13447: the MeanFlow identity, its
regression target and its adaptive loss weighting), assembled from the head's outputs by :func:`tm_meanflow_loss`.
Stage 2 (DMD2-v) uses the normalised variational-score direction :func:`vsd_gradient` and its surrogate
:func:`vsd_loss`. The cost of a sampler is :func:`effective_nfe` (paper eq. 16).

Pure math: imports torch, genrl.flow and genrl.noise only. Step math runs in float32 (float64 when an input is).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from genrl.flow.broadcast import _expand, compute_dtype
from genrl.flow.dmd import dmd_gradient, dmd_loss
from genrl.flow.parameterization import add_noise
from genrl.flow.schedules import shift_sigmas
from genrl.noise import NoiseBackend, rand_per_sample, randn_per_sample, stream_id

__all__ = [
    "INNER_TIME_STREAM",
    "LOSS_NORMS",
    "LossNorm",
    "PARAMETERIZATIONS",
    "Parameterization",
    "adaptive_loss",
    "average_velocity",
    "effective_nfe",
    "finite_difference_derivative",
    "inner_flow_step",
    "meanflow_target",
    "outer_step",
    "sample_inner_times",
    "sample_outer_point",
    "tm_meanflow_loss",
    "transition_grid",
    "vsd_gradient",
    "vsd_loss",
]

Parameterization = Literal["denoiser", "noise"]
#: the accepted values of every ``parameterization`` argument (see the module docstring).
PARAMETERIZATIONS = ("denoiser", "noise")

LossNorm = Literal["squared", "norm"]
#: the accepted values of every ``norm`` / ``loss_norm`` argument: what the adaptive loss weight is a function of
#: (:func:`adaptive_loss`): the squared residual norm (MeanFlow's and TMD's equation) or the norm (FastGen's default).
LOSS_NORMS = ("squared", "norm")

#: the default noise stream of :func:`sample_inner_times`: s is drawn on this stream, the r = s coin on the next.
INNER_TIME_STREAM = stream_id("tmd.inner_time")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_parameterization(p: str) -> str:
    if p not in PARAMETERIZATIONS:
        raise ValueError(f"unknown parameterization {p!r}; use 'denoiser' (u = (y_s - y_hat) / s) or 'noise' "
                         f"(u = y1 - y_hat)")
    return p


def _per_sample(value: float | torch.Tensor, like: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A float, 0-d or [B] value as a tensor broadcastable against ``like`` [B, ...]."""
    return _expand(value, like, 1, name, dtype)


# --------------------------------------------------------------------------------------------------- cost and grids


def effective_nfe(outer_steps: int, inner_steps: int, head_layers: int, num_layers: int) -> float:
    """The cost of a TMD sampler in teacher forward passes: ``M (1 + (N - 1) H / L)`` (paper eq. 16).

    Each of the M outer steps runs the whole network once (backbone + head: one teacher-sized pass) and the head
    N - 1 more times; a head of H of the teacher's L layers costs H / L of a pass. Examples: M = 2, N = 2, H = 5,
    L = 30 gives 2.333...; M = 1, N = 4, H = 5, L = 40 gives 1.375; M = 2, N = 4, H = 5, L = 30 gives 3.0.

    Args:
        outer_steps: M, an int >= 1.
        inner_steps: N, an int >= 1 (N = 1: one head call per outer step, M passes in all).
        head_layers: H, the head's layer count, an int in [1, num_layers].
        num_layers: L, the whole network's layer count, an int >= 1.

    Returns:
        The effective NFE, a python float >= M.

    Raises:
        ValueError: an argument is not an int in its range (the message names it).
    """
    m = _check_int("outer_steps", outer_steps, 1)
    n = _check_int("inner_steps", inner_steps, 1)
    total = _check_int("num_layers", num_layers, 1)
    h = _check_int("head_layers", head_layers, 1)
    if h > total:
        raise ValueError(f"head_layers={h} cannot exceed num_layers={total}")
    return m * (1.0 + (n - 1) * h / total)


def transition_grid(
    steps: int,
    shift: float,
    t_max: float = 0.999,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The descending time grid of TMD's outer transitions (or of the inner flow): ``steps + 1`` points, t_max to 0.

    ``grid = shift_sigmas(linspace(1, 0, steps + 1), shift)``, computed in float64, and then ``grid[0] = t_max``:
    the first point is set to t_max itself (it is *not* ``shift(t_max)``), the others are the shifted uniform
    points (``grid[-1]`` is exactly 0). Transition k goes from ``grid[k]`` to ``grid[k + 1]``. Examples:
    steps 2, shift 10: [0.999, 10/11, 0]; steps 2, shift 1: [0.999, 0.5, 0]; steps 1: [t_max, 0].

    Args:
        steps: M (outer) or N (inner), an int >= 1.
        shift: the timestep shift s > 0 of `shift_sigmas` (1 = none; TMD uses large shifts such as 10).
        t_max: the starting time, in (0, 1]; it must stay above ``grid[1]``.
        dtype: dtype of the result (the values are computed in float64 first).
        device: device of the result (default CPU).

    Returns:
        Tensor [steps + 1], strictly decreasing from t_max to 0.

    Raises:
        ValueError: ``steps`` not an int >= 1, ``t_max`` outside (0, 1], a bad ``shift``, or ``t_max <= grid[1]``
            (the grid would not decrease; lower the shift or the steps, or raise t_max).
        TypeError: ``shift`` is not a number.
    """
    n = _check_int("steps", steps, 1)
    t_max = _check_number("t_max", t_max)
    if not 0.0 < t_max <= 1.0:
        raise ValueError(f"t_max must lie in (0, 1], got {t_max}")
    grid = shift_sigmas(torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64), shift)
    grid[0] = t_max
    grid[-1] = 0.0
    if n > 1 and not t_max > float(grid[1]):
        raise ValueError(f"t_max={t_max} must exceed the grid's second point {float(grid[1])} (steps={n}, "
                         f"shift={shift}); the grid would not decrease")
    return grid.to(dtype=dtype, device=device)


def sample_inner_times(
    seed: int,
    indices,
    step: int,
    inner_grid: torch.Tensor,
    shift: float = 3.0,
    lo: float = 1e-3,
    hi: float = 0.999,
    p_equal: float = 0.75,
    stream: int = INNER_TIME_STREAM,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: NoiseBackend = "generator",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inner times (s, r) of TM-MeanFlow training, one pair per sample, r <= s, r snapped to the inner grid.

    ``s = shift_sigmas(lo + (hi - lo) a, shift)`` with ``a ~ U[0, 1)``; ``r`` = the largest point of
    ``inner_grid`` that is <= s (so the head learns exactly the jumps the sampler's grid takes); then, with
    probability ``p_equal``, ``r = s`` (a zero-length interval: plain flow matching on the inner path). Computed in
    float64, returned in ``dtype`` (rounding keeps r <= s and r == s).

    Addressed draws (docs/architecture.md, Seeds and noise addressing), via `rand_per_sample` in float64: a from
    ``(seed, indices[i], step, stream)``, the r = s coin ``c < p_equal`` from ``(seed, indices[i], step,
    stream + 1)``. A sample's pair depends only on its own address, never on the batch.

    Args:
        seed: the run seed (a method mixes its iteration in, or passes it as ``step``).
        indices: B global sample ids (ints or an int tensor).
        step: an int, the address's step component (e.g. the training iteration).
        inner_grid: the sampler's inner grid, 1-d, containing 0 (e.g. :func:`transition_grid`).
        shift: the shift applied to the uniform draw (> 0).
        lo, hi: the range of the unshifted uniform, 0 <= lo < hi <= 1.
        p_equal: probability of r = s, in [0, 1].
        stream: the stream of a; the coin uses ``stream + 1``.
        device, dtype: of the results; backend: the noise backend of `rand_per_sample`.

    Returns:
        (s, r): two tensors [B] of ``dtype`` on ``device``; ``shift(lo) <= s <= shift(hi)``, ``0 <= r <= s``.

    Raises:
        ValueError: a bad range, probability, shift or backend, or an inner grid that is not 1-d or lacks 0.
    """
    lo, hi, p_equal = _check_number("lo", lo), _check_number("hi", hi), _check_number("p_equal", p_equal)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"need 0 <= lo < hi <= 1, got lo={lo}, hi={hi}")
    if not 0.0 <= p_equal <= 1.0:
        raise ValueError(f"p_equal must lie in [0, 1], got {p_equal}")
    if not isinstance(inner_grid, torch.Tensor) or inner_grid.ndim != 1 or inner_grid.numel() < 2:
        raise ValueError("inner_grid must be a 1-d tensor of at least 2 points (e.g. transition_grid(N, shift))")
    grid = inner_grid.detach().to(device=device, dtype=torch.float64)
    if float(grid.min()) != 0.0:
        raise ValueError(f"inner_grid must contain 0 (its minimum is {float(grid.min())})")
    a = rand_per_sample((), seed, indices, step, stream, device=device, dtype=torch.float64, backend=backend)
    coin = rand_per_sample((), seed, indices, step, stream + 1, device=device, dtype=torch.float64, backend=backend)
    s = shift_sigmas(lo + (hi - lo) * a, shift)
    below = grid.unsqueeze(0) <= s.unsqueeze(1)  # [B, K]
    r = torch.where(below, grid.unsqueeze(0), torch.full((), -math.inf, dtype=torch.float64, device=grid.device))
    r = r.amax(dim=1)
    r = torch.where(coin < p_equal, s, r)
    return s.to(dtype), r.to(dtype)


def sample_outer_point(
    x0: torch.Tensor,
    outer_grid: torch.Tensor,
    seed: int,
    indices,
    time_stream: int,
    noise_stream: int,
    step: int = 0,
    frame_dim: int = 1,
    dtype: torch.dtype = torch.float32,
    backend: NoiseBackend = "generator",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outer point of a TMD training sample: a time ``t_i`` of the outer grid and the noised data ``x_{t_i}``.

    ``k = min(floor(M a), M - 1)`` (M a in float32) with ``a ~ U[0, 1)`` and M = ``len(outer_grid) - 1``, so
    ``t = outer_grid[k]`` is one of the grid's M upper points t_M .. t_1 (never the final 0), each with probability
    1/M; the outer noise ``x1 ~ N(0, I)`` and ``x_t = (1 - t) x0 + t x1`` (:func:`genrl.flow.add_noise`), the
    starting point of the transition that both TMD stages train (Nie et al. 2026: stage 1 regresses y = x1 - x0 at
    x_t, stage 2 rolls the student out from it).

    Addressed draws (docs/architecture.md, Seeds and noise addressing): a from ``(seed, indices[i], step,
    time_stream)`` (`rand_per_sample`, float32), x1 from ``(seed, indices[i], step, noise_stream)``
    (`randn_per_sample`); a sample's draws depend only on its own address, never on the batch.

    Args:
        x0: data latents [B, ...], any float dtype.
        outer_grid: the descending outer grid [M + 1] ending in 0 (:func:`transition_grid`; float64 there).
        seed: the run seed (a method mixes its iteration in, or passes it as ``step``).
        indices: B global sample ids (ints or an int tensor).
        time_stream, noise_stream: the streams of a and of x1 (distinct).
        step: an int, the address's step component.
        frame_dim: the frame dim of x0 (only for the noising).
        dtype: the dtype of t and x1 (float32; float64 for closed-form checks).
        backend: the noise backend of both draws.

    Returns:
        ``(t [B], x1, x_t)`` on x0's device: t of ``dtype``, each an entry of ``outer_grid[:-1]`` rounded to it; x1
        of x0's shape and ``dtype``; x_t of x0's shape, float32 (float64 when x0 or ``dtype`` is float64).

    Raises:
        ValueError: a grid that is not 1-d with at least 2 points, or B != len(indices).
    """
    if not isinstance(outer_grid, torch.Tensor) or outer_grid.ndim != 1 or outer_grid.numel() < 2:
        raise ValueError("outer_grid must be a 1-d tensor of at least 2 points (e.g. transition_grid(M, shift))")
    n = len(indices)
    if x0.ndim < 1 or x0.shape[0] != n:
        raise ValueError(f"x0 of shape {tuple(x0.shape)} must have one row per index ({n} indices)")
    m = outer_grid.numel() - 1
    a = rand_per_sample((), seed, indices, step, time_stream, backend=backend)
    k = (a * m).long().clamp_max(m - 1)
    t = outer_grid[k.to(outer_grid.device)].to(device=x0.device, dtype=dtype)
    x1 = randn_per_sample(x0.shape[1:], seed, indices, step, noise_stream, device=x0.device, dtype=dtype,
                          backend=backend)
    return t, x1, add_noise(x0, x1, t, frame_dim=frame_dim)


# ------------------------------------------------------------------------------------------------- the two updates


def outer_step(x: torch.Tensor, t: float | torch.Tensor, t_next: float | torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One outer transition ``x_{t'} = x_t - (t - t') y`` (paper eq. 18).

    With ``y = x1 - x0`` exactly, ``x_t = (1 - t) x0 + t x1`` goes to ``(1 - t') x0 + t' x1``. The paper writes the
    step as ``(1 - t'/t) g + (t'/t) x_t`` with the clean estimate ``g = x_t - t y``; that is the same number
    (for t > 0).

    Args:
        x: x_t, [B, ...] any float dtype.
        t, t_next: current and next outer time, python floats, 0-d or [B] tensors, 0 <= t_next <= t <= 1.
        y: the sampled outer velocity (the inner flow's result y_hat0), shape of x.

    Returns:
        x_{t_next}, shape of x, float32 (float64 when an input is float64); differentiable.

    Raises:
        ValueError: t or t_next does not fit x (shape).
    """
    dt = compute_dtype(x, t, t_next, y)
    tt, tn = _per_sample(t, x, "t", dt), _per_sample(t_next, x, "t_next", dt)
    return x.to(dt) - (tt - tn) * y.to(dt)


def average_velocity(
    y_s: torch.Tensor,
    s: float | torch.Tensor,
    y1: torch.Tensor,
    y_hat: torch.Tensor,
    parameterization: Parameterization = "denoiser",
) -> torch.Tensor:
    """The inner average velocity u built from the head's estimate ``y_hat`` of y.

    ``"denoiser"``: ``u = (y_s - y_hat) / s`` (depends on (y_s, s, y_hat) only; y1 is not used). ``"noise"``:
    ``u = y1 - y_hat``. Both equal the conditional velocity ``v = y1 - y`` when ``y_hat = y`` and
    ``y_s = (1 - s) y + s y1``. See the module docstring for why the two differ after training.

    Args:
        y_s: the inner state [B, ...]; s: its inner time (float, 0-d or [B]), in (0, 1] for ``"denoiser"``
            (s = 0 divides by zero).
        y1: the inner noise of this outer step, shape of y_s (unused by ``"denoiser"``, still checked).
        y_hat: the head's output, shape of y_s.
        parameterization: ``"denoiser"`` or ``"noise"``.

    Returns:
        u, shape of y_s, float32 (float64 when an input is float64); differentiable.

    Raises:
        ValueError: shapes differ, or an unknown parameterization.
    """
    _check_parameterization(parameterization)
    for name, other in (("y1", y1), ("y_hat", y_hat)):
        if other.shape != y_s.shape:
            raise ValueError(f"{name} of shape {tuple(other.shape)} must match y_s of shape {tuple(y_s.shape)}")
    dt = compute_dtype(y_s, s, y1, y_hat)
    if parameterization == "noise":
        return y1.to(dt) - y_hat.to(dt)
    return (y_s.to(dt) - y_hat.to(dt)) / _per_sample(s, y_s, "s", dt)


def inner_flow_step(
    y_s: torch.Tensor,
    s: float | torch.Tensor,
    r: float | torch.Tensor,
    y1: torch.Tensor,
    y_hat: torch.Tensor,
    parameterization: Parameterization = "denoiser",
) -> torch.Tensor:
    """One jump of the inner flow map ``f(y_s, s, r) = y_s - (s - r) u`` (u from :func:`average_velocity`).

    ``"noise"``: ``y_s - (s - r) (y1 - y_hat)``. ``"denoiser"``: ``(r / s) y_s + (1 - r / s) y_hat`` (the same as
    ``y_s - (s - r) (y_s - y_hat) / s``; written with the ratio so that r = 0 returns y_hat exactly, and s = r = 0
    returns y_s). A head that ignores its input and returns a constant c telescopes: from ``y_{s_N} = y1``, N
    jumps down to 0 give ``(1 - s_N) y1 + s_N c`` under ``"noise"`` and exactly c under ``"denoiser"``.

    Args:
        y_s: the inner state [B, ...]; s, r: from and to inner times (floats, 0-d or [B]), 0 <= r <= s <= 1.
        y1: the inner noise of this outer step (unused by ``"denoiser"``); y_hat: the head's output; shape of y_s.
        parameterization: ``"denoiser"`` or ``"noise"``.

    Returns:
        y_r, shape of y_s, float32 (float64 when an input is float64); differentiable.

    Raises:
        ValueError: shapes differ, s or r does not fit y_s, or an unknown parameterization.
    """
    _check_parameterization(parameterization)
    dt = compute_dtype(y_s, s, r, y1, y_hat)
    ss, rr = _per_sample(s, y_s, "s", dt), _per_sample(r, y_s, "r", dt)
    if parameterization == "noise":
        return y_s.to(dt) - (ss - rr) * average_velocity(y_s, s, y1, y_hat, "noise").to(dt)
    if y1.shape != y_s.shape or y_hat.shape != y_s.shape:
        average_velocity(y_s, s, y1, y_hat, "denoiser")  # raises with the shapes named
    one = torch.ones((), dtype=dt, device=ss.device)
    ratio = torch.where(ss > 0, rr / torch.where(ss > 0, ss, one), one)  # r / s, and 1 at s = 0 (then r = 0 too)
    return ratio * y_s.to(dt) + (1 - ratio) * y_hat.to(dt)


# ------------------------------------------------------------------------------------------------ stage-1 training


def finite_difference_derivative(
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y: torch.Tensor,
    s: torch.Tensor,
    v: torch.Tensor,
    delta: float = 5e-3,
    lo: float = 0.0,
    hi: float = 1.0,
) -> torch.Tensor:
    """The total derivative ``d/dh fn(y + h v, s + h)`` at h = 0 (along the tangent (v, 1)) by finite differences.

    Per sample: central ``[fn(y + delta v, s + delta) - fn(y - delta v, s - delta)] / (2 delta)`` when
    ``[s - delta, s + delta]`` lies in ``[lo, hi]``; forward ``[fn(y + delta v, s + delta) - fn(y, s)] / delta``
    where ``s - delta < lo``; backward ``[fn(y, s) - fn(y - delta v, s - delta)] / delta`` where
    ``s + delta > hi``. The whole batch takes exactly two calls of fn: one at the per-sample "plus" points
    ``(y + a+ v, s + a+)`` and one at the "minus" points ``(y + a- v, s + a-)``, with ``(a+, a-)`` = ``(delta,
    -delta)``, ``(delta, 0)`` or ``(0, -delta)`` (an offset of 0 evaluates at (y, s) itself, exactly). Errors:
    O(delta^2) central, O(delta) one-sided. This replaces MeanFlow's JVP (``torch.func.jvp`` of fn along (v, 1)),
    which the paper avoids for large video backbones. It runs in whatever grad mode is active: wrap it in
    ``torch.no_grad()`` when it only feeds :func:`meanflow_target` (which detaches it anyway).

    Args:
        fn: maps ``(y [B, ...], s [B])`` to a tensor of y's shape (e.g. the average velocity u of the head with
            r, the features, t and y1 fixed); it must treat rows independently.
        y: the point [B, ...]; v: the tangent's y part, shape of y (the conditional velocity ``y1 - y``).
        s: the time [B], each in [lo, hi].
        delta: the step, > 0 with ``2 delta <= hi - lo``.
        lo, hi: the interval fn may be evaluated on (the one-sided formulas keep s inside it).

    Returns:
        The derivative, shape of fn's output, in its dtype.

    Raises:
        ValueError: shapes do not fit, ``delta`` not > 0 or too large for [lo, hi], or some s outside [lo, hi].
    """
    delta, lo, hi = _check_number("delta", delta), _check_number("lo", lo), _check_number("hi", hi)
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}")
    if not 2 * delta <= hi - lo:
        raise ValueError(f"need 2 * delta <= hi - lo, got delta={delta}, lo={lo}, hi={hi}")
    if v.shape != y.shape:
        raise ValueError(f"v of shape {tuple(v.shape)} must match y of shape {tuple(y.shape)}")
    if not isinstance(s, torch.Tensor) or s.shape != (y.shape[0],):
        raise ValueError(f"s must be a tensor [B] with B = {y.shape[0]}, got "
                         f"{tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__}")
    if bool(((s < lo) | (s > hi)).any()):
        raise ValueError(f"every s must lie in [lo, hi] = [{lo}, {hi}], got values in "
                         f"[{float(s.min())}, {float(s.max())}]")
    forward = s - delta < lo
    backward = s + delta > hi
    zero = torch.zeros((), dtype=s.dtype, device=s.device)
    a_plus = torch.where(backward, zero, zero + delta)
    a_minus = torch.where(forward, zero, zero - delta)
    span = a_plus - a_minus
    shape = (y.shape[0],) + (1,) * (y.ndim - 1)
    f_plus = fn(y + a_plus.reshape(shape).to(y.dtype) * v, s + a_plus)
    f_minus = fn(y + a_minus.reshape(shape).to(y.dtype) * v, s + a_minus)
    return (f_plus - f_minus) / span.reshape((y.shape[0],) + (1,) * (f_plus.ndim - 1)).to(f_plus.dtype)


def meanflow_target(
    v: torch.Tensor, dudt: torch.Tensor, s: float | torch.Tensor, r: float | torch.Tensor
) -> torch.Tensor:
    """The MeanFlow regression target ``sg(v - (s - r) du/ds)`` (Geng et al. 2025; TMD stage 1).

    From the MeanFlow identity ``u(y_s, s, r) = v(y_s, s) - (s - r) d/ds u(y_s, s, r)``: with the conditional
    velocity ``v = y1 - y`` in place of the marginal one and the total derivative along (v, 1). With r = s the
    target is v itself (plain flow matching on the inner path).

    Args:
        v: the conditional inner velocity ``y1 - y``, [B, ...].
        dudt: the total derivative of u along (v, 1) (:func:`finite_difference_derivative`), shape of v.
        s, r: inner times (floats, 0-d or [B]).

    Returns:
        The detached target, shape of v, float32 (float64 when an input is float64).

    Raises:
        ValueError: shapes do not fit.
    """
    if dudt.shape != v.shape:
        raise ValueError(f"dudt of shape {tuple(dudt.shape)} must match v of shape {tuple(v.shape)}")
    dt = compute_dtype(v, dudt, s, r)
    gap = _per_sample(s, v, "s", dt) - _per_sample(r, v, "r", dt)
    return (v.to(dt) - gap * dudt.to(dt)).detach()


def adaptive_loss(
    u: torch.Tensor, target: torch.Tensor, c: float | None = None, power: float = 1.0, norm: LossNorm = "squared"
) -> torch.Tensor:
    """MeanFlow's adaptively weighted squared error ``mean_b e_b / sg(a_b + c)^power``, ``e_b = ||u_b - target_b||^2``.

    ``e_b`` is the sum of squares over sample b's elements, ``n_b = sqrt(e_b)`` its L2 norm, and ``a_b`` what the
    weight is a function of (``norm``):

    * ``"squared"`` (default): ``a_b = e_b``. MeanFlow's adaptive loss weighting (Geng et al. 2025, arXiv 2505.13447:
      w = 1 / (||Delta||^2 + c)^p) with p = 1, which is the TMD paper's stage-1 loss
      ``||u - u_tgt||^2 / sg(||u - u_tgt||^2 + c)`` with c = d (Wan2.1-1.3B) or 1e-5 d (14B); NVIDIA FastGen's
      MeanFlow with ``loss_type="l2"``, ``norm_method="poly_<p>"``, ``norm_const=c`` (same value and gradient).
      Gradient ``2 (u_b - target_b) / ((e_b + c)^power B)``; the value, ``e_b / (e_b + c)`` for power 1, lies in
      [0, 1). Default c = d, the elements per sample.
    * ``"norm"``: ``a_b = n_b``, the weight divides by the norm rather than its square: NVIDIA FastGen's MeanFlow
      default (NVlabs/FastGen, fastgen/methods/consistency_model/mean_flow.py: ``loss_type="opt_grad"``,
      ``norm_method="poly_<p>"``, ``norm_const=c``). Gradient ``2 (u_b - target_b) / ((n_b + c)^power B)``,
      identical to FastGen's; the value here is ``e_b / (n_b + c)^power``, the loss whose gradient that is (FastGen
      logs ``e_b / (n_b + c)^(2 power)``, so logged curves differ while the updates agree). For power 1 and c -> 0
      it is the gradient of ``2 n_b`` (an L2, not squared-L2, loss). Default c = sqrt(d): the weight's knee sits at
      an RMS residual of 1, as with c = d under ``"squared"``. FastGen's ``tangent_spatial_invariance=True`` (the
      residual divided by sqrt(d) before the weight) with constant c0 and power 1 equals ``"norm"`` with
      c = c0 sqrt(d).

    Because the weight is detached, either gradient is that of the plain squared error scaled per sample.

    Args:
        u: the model's average velocity [B, ...], carrying the graph.
        target: the target (:func:`meanflow_target`), shape of u; detached here.
        c: the constant > 0 (default: d = u[0].numel() under ``"squared"``, sqrt(d) under ``"norm"``).
        power: the weight's exponent p >= 0 (0: the plain per-sample sum of squares, averaged over the batch).
        norm: ``"squared"`` or ``"norm"`` (:data:`LOSS_NORMS`), see above.

    Returns:
        0-d tensor, float32 (float64 when an input is float64).

    Raises:
        ValueError: shapes differ, u has no batch dim, c not > 0, power < 0, an unknown ``norm``.
    """
    if norm not in LOSS_NORMS:
        raise ValueError(f"unknown norm {norm!r}; use 'squared' (weight 1 / (||e||^2 + c)^p: MeanFlow, the TMD paper) "
                         f"or 'norm' (weight 1 / (||e|| + c)^p: FastGen's MeanFlow default)")
    if target.shape != u.shape:
        raise ValueError(f"target of shape {tuple(target.shape)} must match u of shape {tuple(u.shape)}")
    if u.ndim < 1 or u.shape[0] < 1:
        raise ValueError(f"u must have a non-empty batch dim, got shape {tuple(u.shape)}")
    b = u.shape[0]
    d = float(u[0].numel())
    c = (d if norm == "squared" else math.sqrt(d)) if c is None else _check_number("c", c)
    if not c > 0:
        raise ValueError(f"c must be > 0, got {c}")
    power = _check_number("power", power)
    if power < 0:
        raise ValueError(f"power must be >= 0, got {power}")
    dt = compute_dtype(u, target)
    err = (u.to(dt) - target.detach().to(dt)).square().reshape(b, -1).sum(dim=1)
    scale = err.detach() if norm == "squared" else err.detach().sqrt()
    weight = (scale + c).pow(-power)
    return (err * weight).mean()


def tm_meanflow_loss(
    head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y: torch.Tensor,
    y1: torch.Tensor,
    s: torch.Tensor,
    r: torch.Tensor,
    parameterization: Parameterization = "denoiser",
    delta: float = 5e-3,
    c: float | None = None,
    norm: LossNorm = "squared",
) -> dict[str, torch.Tensor]:
    """TMD's stage-1 (TM-MeanFlow) loss of one batch, assembled from the flow head's outputs.

    The inner point ``y_s = (1 - s) y + s y1`` and the conditional velocity ``v = y1 - y``; the average velocity
    ``u = average_velocity(y_s, s, y1, head(y_s, s))`` (with graph); its total derivative along (v, 1) by
    :func:`finite_difference_derivative` under ``torch.no_grad`` (two more head calls); the MeanFlow target
    ``sg(v - (s - r) du/ds)`` (:func:`meanflow_target`) and the adaptively weighted loss (:func:`adaptive_loss`).
    This is MeanFlow's regression (Geng et al. 2025, arXiv 2505.13447: the MeanFlow identity
    ``u = v - (s - r) du/ds`` with the conditional velocity and its loss ``||u - sg(u_tgt)||^2`` with adaptive
    weighting) on TMD's inner flow (Nie et al. 2026, arXiv 2601.09881, stage 1). With r = s the target is v: plain
    transition matching on the inner path.

    Args:
        head: maps ``(y_s [B, ...], s [B])`` to the head's estimate y_hat of y (shape of y); r, the features and
            the outer time are fixed by the caller. It must treat rows independently; it is called three times
            (once with graph).
        y: the transition's target ``x1 - x0`` (possibly CFG-shifted), [B, ...], float32 or float64.
        y1: the inner noise, shape of y.
        s, r: inner times [B] (:func:`sample_inner_times`), 0 <= r <= s <= 1 (s > 0 for ``"denoiser"``).
        parameterization: ``"denoiser"`` or ``"noise"`` (:func:`average_velocity`).
        delta: the finite-difference step (0 < delta, 2 delta <= 1).
        c: the adaptive loss's constant (None: d, the elements per sample, under ``"squared"``; sqrt(d) under
            ``"norm"``).
        norm: what the adaptive weight divides by (:func:`adaptive_loss`): ``"squared"``, ``(||u - target||^2 +
            c)`` (the TMD paper's equation, MeanFlow's weighting; default) or ``"norm"``, ``(||u - target|| + c)``
            (NVIDIA FastGen's MeanFlow default).

    Returns:
        ``{"loss": 0-d with graph through head, "mse": mean (u - target)^2, "r_equal_s": fraction of r == s,
        "u_minus_target": u - target [B, ...] detached}``; float32 (float64 when the inputs are float64).

    Raises:
        ValueError: y1 not of y's shape, s or r not [B], or as the composed functions (delta, c, norm,
            parameterization).
    """
    if y1.shape != y.shape:
        raise ValueError(f"y1 of shape {tuple(y1.shape)} must match y of shape {tuple(y.shape)}")
    for name, value in (("s", s), ("r", r)):
        if not isinstance(value, torch.Tensor) or value.shape != (y.shape[0],):
            raise ValueError(f"{name} must be a tensor [B] with B = {y.shape[0]}")
    shape = (-1,) + (1,) * (y.ndim - 1)
    y_s = (1 - s.view(shape)) * y + s.view(shape) * y1
    v = y1 - y

    def u_of(yy: torch.Tensor, ss: torch.Tensor) -> torch.Tensor:
        return average_velocity(yy, ss, y1, head(yy, ss), parameterization)

    u = u_of(y_s, s)
    with torch.no_grad():
        dudt = finite_difference_derivative(u_of, y_s, s, v, delta=delta)
    target = meanflow_target(v, dudt, s, r)
    loss = adaptive_loss(u, target, c, norm=norm)
    diff = u.detach() - target
    return {"loss": loss, "mse": diff.pow(2).mean(), "r_equal_s": (r == s).float().mean(), "u_minus_target": diff}


# ------------------------------------------------------------------------------------------------ stage-2 (DMD2-v)


def vsd_gradient(
    x0_fake: torch.Tensor,
    x0_teacher: torch.Tensor,
    eps: float = 0.0,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """DMD2-v's normalised direction ``g = (x0_fake - x0_teacher) / mean|x0_fake - x0_teacher|`` per sample.

    The normaliser is the per-sample *mean* absolute difference (over the sample's elements, the masked frames'
    with ``mask``), so g is scale-free: multiplying the difference by any c > 0 leaves g unchanged. A sample whose
    difference is all zero gets g = 0 (not NaN). Descent along g (via :func:`vsd_loss`) moves the generator's
    sample towards the teacher's distribution.

    This is exactly :func:`genrl.flow.dmd_gradient` with ``x = x0_fake``: its normaliser
    ``mean|x - x0_real|`` becomes ``mean|x0_fake - x0_teacher|`` (DMD's own normaliser uses the generator sample
    x instead). No new code path: the name documents the choice.

    Args:
        x0_fake: the fake score's (critic's) clean prediction at the noised generator sample, [B, ...].
        x0_teacher: the teacher's (CFG-guided) clean prediction at the same point, same shape.
        eps: added to the normaliser (>= 0).
        mask: optional per-frame mask [B, T]; frame_dim: the latents' frame dim.

    Returns:
        g, shape of x0_fake, float32 (float64 when an input is float64), detached and finite.

    Raises:
        ValueError: as :func:`genrl.flow.dmd_gradient` (shapes, mask, eps < 0).
    """
    return dmd_gradient(x0_fake, x0_fake, x0_teacher, normalize=True, eps=eps, mask=mask, frame_dim=frame_dim)


def vsd_loss(
    x_hat: torch.Tensor,
    grad: torch.Tensor,
    mask: torch.Tensor | None = None,
    weight: float | torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Surrogate loss whose gradient with respect to ``x_hat`` is ``grad / (B * d)`` (d = elements per sample).

    Exactly :func:`genrl.flow.dmd_loss`: ``0.5 * sum((x_hat - sg(x_hat) + sg(grad))^2) / N`` with N = B d (the
    masked element count with ``mask``), whose gradient is ``w * m * grad / N``: the gradient of the linear
    surrogate ``mean_b sum(sg(grad_b) * x_hat_b) / d``, with a bounded value (``0.5 mean(grad^2)``) instead of one
    that grows with x_hat. Only the gradient has a meaning.

    Args:
        x_hat: the generator's sample carrying the graph (through the whole transition rollout), [B, ...].
        grad: :func:`vsd_gradient`, same shape.
        mask, weight, frame_dim: as :func:`genrl.flow.dmd_loss`.

    Returns:
        0-d tensor, float32 (float64 when an input is float64).

    Raises:
        ValueError: as :func:`genrl.flow.dmd_loss`.
    """
    return dmd_loss(x_hat, grad, mask=mask, weight=weight, frame_dim=frame_dim)
