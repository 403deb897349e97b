"""Per-frame noise levels of diffusion forcing: sampling matrices and training-time per-frame sigma draws.

A video model trained with an independent noise level per frame (diffusion forcing: Chen et al. 2024, "Diffusion
Forcing: Next-token Prediction Meets Full-Sequence Diffusion", arXiv 2407.01392; Song et al. 2025, "History-Guided
Video Diffusion" (DFoT), arXiv 2502.06764) can be sampled with any *scheduling matrix*: row m holds the sigma of every
frame after m sampling steps, column f the noise levels frame f goes through. genrl's conventions hold
(docs/architecture.md, Conventions): sigma in [0, 1], 0 = clean data, 1 = pure noise,
``x_sigma = (1 - sigma) x0 + sigma eps``; per-frame sigma is ``[B, T]``.

- :func:`frame_schedule` builds the matrix ``[R, T]`` (float64) for full-sequence, pyramid and autoregressive
  sampling, with known history frames held at a constant level; :func:`schedule_transitions` turns it into the
  per-step ``(sigma_from, sigma_to, active)`` triples a sampler loops over.
- :func:`diffusion_forcing_sigmas` draws the training-time per-frame sigma ``[B, T]``: independent per frame (group)
  or history-conditioned (independent history, one shared sigma for the frames after it).

Randomness comes only from the ``torch.Generator`` passed in (docs/architecture.md, Seeds and noise addressing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from genrl.flow.schedules import TimestepSampler, sigma_schedule

__all__ = [
    "FRAME_SCHEDULE_KINDS",
    "DIFFUSION_FORCING_MODES",
    "frame_schedule",
    "schedule_transitions",
    "diffusion_forcing_sigmas",
]

FrameScheduleKind = Literal["full_sequence", "pyramid", "autoregressive"]
FRAME_SCHEDULE_KINDS: tuple[str, ...] = ("full_sequence", "pyramid", "autoregressive")
"""The kinds `frame_schedule` accepts."""

DiffusionForcingMode = Literal["independent", "history"]
DIFFUSION_FORCING_MODES: tuple[str, ...] = ("independent", "history")
"""The modes `diffusion_forcing_sigmas` accepts."""


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _history_mask(history: int | Sequence[bool] | torch.Tensor, num_frames: int) -> torch.Tensor:
    """``history`` as a bool tensor [num_frames] (True = known history frame); at least one frame is generated."""
    if isinstance(history, torch.Tensor):
        if history.dtype != torch.bool or tuple(history.shape) != (num_frames,):
            raise ValueError(
                f"a history tensor must be a bool mask of shape [num_frames] = [{num_frames}], got dtype "
                f"{history.dtype} and shape {tuple(history.shape)}; pass an int k for the first k frames"
            )
        mask = history.detach().to("cpu").clone()
    elif isinstance(history, bool):
        raise ValueError(f"history must be an int or a bool mask of length {num_frames}, got the bool {history!r}")
    elif isinstance(history, int):
        if not 0 <= history < num_frames:
            raise ValueError(
                f"history must be an int in [0, num_frames) = [0, {num_frames}) so that at least one frame is "
                f"generated, got {history}"
            )
        mask = torch.arange(num_frames) < history
    elif isinstance(history, Sequence) and not isinstance(history, str):
        if len(history) != num_frames or not all(isinstance(h, bool) for h in history):
            raise ValueError(
                f"a history sequence must hold num_frames = {num_frames} python bools (True = history frame), "
                f"got {list(history)!r}"
            )
        mask = torch.tensor(list(history), dtype=torch.bool)
    else:
        raise ValueError(f"history must be an int or a bool mask of length {num_frames}, got {type(history).__name__}")
    if bool(mask.all()):
        raise ValueError(f"the history mask marks all {num_frames} frames as history; leave at least one False")
    return mask


def frame_schedule(
    num_steps: int,
    num_frames: int,
    history: int | Sequence[bool] | torch.Tensor,
    *,
    kind: FrameScheduleKind = "full_sequence",
    lag: int | None = None,
    shift: float = 1.0,
    sigma_max: float = 1.0,
    stabilization: float = 0.0,
) -> torch.Tensor:
    """Scheduling matrix of diffusion-forcing sampling: the sigma of every frame at every sampling step.

    Row m holds the noise level of each frame after m steps; step m takes every frame from row m to row m + 1 (a
    frame whose sigma does not change is not updated, see `schedule_transitions`). All generated frames move along
    one grid, ``grid = sigma_schedule(num_steps, shift, sigma_max)`` (S = num_steps; ``grid[0] = shift(sigma_max)``,
    ``grid[S] = 0``, strictly decreasing). With G generated frames, numbered j = 0 .. G - 1 in frame order (history
    frames skipped), frame j sits at row m on

        sigma = grid[clip(m - u j, 0, S)],        m = 0 .. S + u (G - 1),

    where the lag u is:

    - ``"full_sequence"``: u = 0: every generated frame follows the same schedule (plain video diffusion);
      S + 1 rows;
    - ``"pyramid"``: u = ``lag`` in [0, S]: frame j starts u steps after frame j - 1, so earlier frames are always
      at most as noisy as later ones (Diffusion Forcing's pyramid scheduling matrix, Chen et al. 2024; DFoT's
      "pyramid" sampling). The matrix has **S + u (G - 1) + 1 rows, more than num_steps + 1** for
      u > 0 and G > 1: it takes S + u (G - 1) sampling steps (network calls). ``lag=0`` gives exactly (bitwise)
      the full-sequence matrix;
    - ``"autoregressive"``: u = S: each frame is fully denoised before the next one starts (frame-by-frame
      generation with a clean causal history); equals ``kind="pyramid", lag=num_steps`` exactly.

    Since u <= S, every step changes at least one frame: no two consecutive rows are equal. History columns hold
    ``stabilization`` in every row (0 = clean; a small level such as DFoT's 0.02 hides the flaws of *generated*
    history, Song et al. 2025).

    Args:
        num_steps: S, the number of steps each generated frame takes from ``shift(sigma_max)`` to 0, an int >= 1.
        num_frames: T, the number of frames (columns), an int >= 1.
        history: the known frames: an int k in [0, T) (the first k frames), or a bool mask [T] (a sequence of
            python bools or a ``torch.bool`` tensor; True = history) with at least one False.
        kind: "full_sequence", "pyramid" or "autoregressive".
        lag: u, an int in [0, num_steps]; required for ``kind="pyramid"``, must be None for the other kinds.
        shift: timestep shift s > 0 of the grid (`shift_sigmas`; 1 = none).
        sigma_max: the unshifted starting sigma of generated frames, in (0, 1].
        stabilization: the constant sigma of history columns, in [0, 1).

    Returns:
        float64 CPU tensor [S + u (G - 1) + 1, T] of sigmas in [0, 1]: every column non-increasing, generated
        columns start at ``shift(sigma_max)`` and end at exactly 0, history columns equal ``stabilization``.

    Raises:
        ValueError: ``num_steps < 1`` or ``num_frames < 1``; ``history`` out of range, of the wrong length / dtype,
            or marking every frame; an unknown ``kind``; ``lag`` missing for "pyramid", given for another kind,
            negative or > num_steps; ``shift`` not a finite number > 0; ``sigma_max`` outside (0, 1];
            ``stabilization`` outside [0, 1). The message names the value.

    Source: Chen et al. 2024, "Diffusion Forcing", arXiv 2407.01392, the sampling algorithm with a scheduling matrix
    K[m, t] (pyramid, full-sequence and autoregressive schedules as special cases of K); Song et al. 2025, DFoT,
    arXiv 2502.06764 (history kept at a fixed noise level; stabilization of generated history).
    """
    s_steps = _check_int(num_steps, "num_steps", 1)
    t_frames = _check_int(num_frames, "num_frames", 1)
    if kind not in FRAME_SCHEDULE_KINDS:
        raise ValueError(f"kind must be one of {FRAME_SCHEDULE_KINDS}, got {kind!r}")
    if kind == "pyramid":
        if lag is None:
            raise ValueError(f"kind='pyramid' needs an int lag in [0, num_steps] = [0, {s_steps}], got lag=None")
        if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= s_steps:
            raise ValueError(
                f"lag must be an int in [0, num_steps] = [0, {s_steps}], got {lag!r} (a larger lag would leave "
                f"steps where no frame moves; use kind='autoregressive' for lag = num_steps)"
            )
        u = lag
    else:
        if lag is not None:
            raise ValueError(f"lag applies to kind='pyramid' only; got lag={lag!r} with kind={kind!r} (pass None)")
        u = 0 if kind == "full_sequence" else s_steps
    if isinstance(sigma_max, bool) or not isinstance(sigma_max, (int, float)) or not 0.0 < sigma_max <= 1.0:
        raise ValueError(f"sigma_max must be a number in (0, 1], got {sigma_max!r}")
    if isinstance(stabilization, bool) or not isinstance(stabilization, (int, float)) or not 0.0 <= stabilization < 1.0:
        raise ValueError(f"stabilization must be a number in [0, 1) (0 = clean history), got {stabilization!r}")
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a finite number > 0, got {shift!r}")
    mask = _history_mask(history, t_frames)

    grid = sigma_schedule(s_steps, float(shift), float(sigma_max))  # [S + 1], float64, grid[S] = 0
    generated = (~mask).nonzero().flatten()  # [G] frame indices, in order
    g_frames = int(generated.numel())
    rows = s_steps + u * (g_frames - 1) + 1
    m = torch.arange(rows).unsqueeze(1)  # [R, 1]
    j = torch.arange(g_frames).unsqueeze(0)  # [1, G]
    level = (m - u * j).clamp(0, s_steps)  # [R, G] index into grid
    out = torch.full((rows, t_frames), float(stabilization), dtype=torch.float64)
    out[:, generated] = grid[level]
    return out


def schedule_transitions(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a scheduling matrix into per-step transitions ``(sigma_from, sigma_to, active)``.

    Step r takes every frame from ``matrix[r]`` to ``matrix[r + 1]``; a frame is *active* at step r when its
    sigma changes. What a sampler does with an inactive frame is its choice: the simple one keeps its value (a
    waiting generated frame, a fixed history frame); Chen et al. (2024, appendix on sampling) note the alternative
    of resampling it at the same level (a backward then a forward diffusion step) and call the question open.

    Args:
        matrix: a floating tensor [R + 1, F] with R >= 1 (e.g. from `frame_schedule`; rows = steps, columns =
            frames), any dtype / device.

    Returns:
        ``sigma_from = matrix[:-1]`` and ``sigma_to = matrix[1:]`` (views into ``matrix``, [R, F], its dtype and
        device) and ``active = sigma_from != sigma_to`` (bool [R, F]).

    Raises:
        ValueError: ``matrix`` is not a 2-d floating tensor with at least 2 rows (the message names its shape /
            dtype).

    Source: Chen et al. 2024, "Diffusion Forcing", arXiv 2407.01392, the sampling algorithm (a loop over the rows
    of the scheduling matrix K).
    """
    if not isinstance(matrix, torch.Tensor) or not matrix.is_floating_point() or matrix.ndim != 2:
        desc = (
            f"{matrix.dtype} tensor of shape {tuple(matrix.shape)}"
            if isinstance(matrix, torch.Tensor)
            else type(matrix).__name__
        )
        raise ValueError(f"matrix must be a 2-d floating tensor [steps + 1, frames], got a {desc}")
    if matrix.shape[0] < 2:
        raise ValueError(
            f"matrix needs at least 2 rows (a start and an end level) to have a transition, got shape "
            f"{tuple(matrix.shape)}"
        )
    sigma_from, sigma_to = matrix[:-1], matrix[1:]
    return sigma_from, sigma_to, sigma_from != sigma_to


def _allowed_history(history: int | Sequence[int] | None, num_frames: int, group: int) -> list[int]:
    """The allowed history lengths (frames) of ``mode="history"``, sorted; validated against T and the group."""
    top = num_frames - group
    if history is None:
        return list(range(0, top + 1, group))
    if isinstance(history, bool):
        raise ValueError(f"history must be an int (the largest length) or a list of lengths, got {history!r}")
    if isinstance(history, int):
        if not 0 <= history <= top or history % group:
            raise ValueError(
                f"history (the largest history length, in frames) must be a multiple of frame_group = {group} in "
                f"[0, num_frames - frame_group] = [0, {top}], got {history}"
            )
        return list(range(0, history + 1, group))
    if isinstance(history, (str, bytes)) or not isinstance(history, Sequence) or len(history) == 0:
        raise ValueError(f"history must be None, an int or a non-empty list of lengths, got {history!r}")
    values = list(history)
    bad = [h for h in values if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= top or h % group]
    if bad:
        raise ValueError(
            f"allowed history lengths must be ints that are multiples of frame_group = {group} in "
            f"[0, num_frames - frame_group] = [0, {top}]; got {bad} in {values}"
        )
    if len(set(values)) != len(values):
        raise ValueError(
            f"allowed history lengths must be distinct (each is drawn with equal probability), got {values}"
        )
    return sorted(values)


def diffusion_forcing_sigmas(
    batch: int,
    num_frames: int,
    *,
    generator: torch.Generator,
    mode: DiffusionForcingMode = "independent",
    history: int | Sequence[int] | None = None,
    frame_group: int = 1,
    sampler: TimestepSampler | Callable[..., torch.Tensor] | None = None,
    history_sigma_max: float = 1.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Training-time per-frame noise levels of diffusion forcing, ``[B, T]``.

    Frames are handled in groups of g = ``frame_group`` consecutive frames that share one sigma (frames in one
    temporal patch of the DiT must: genrl's DiT has temporal patch 2); with N = T / g groups:

    - ``mode="independent"``: every group gets its own i.i.d. sigma from the marginal ``sampler`` (DFoT's
      training objective with independent per-frame noise levels, Song et al. 2025, eq. 4; Chen et al. 2024,
      Algorithm 1);
    - ``mode="history"``: per sample, a history length h (in frames) is drawn uniformly from the allowed set;
      the groups of the first h frames get i.i.d. sigmas and all later frames share one sigma (DFoT App. A.5, the
      history-conditioned "uniform future" variant: a noisy-to-clean history prefix and a future denoised as one
      block). h = 0 is plain full-sequence diffusion. Every frame's marginal is still the sampler's, unless
      ``history_sigma_max`` < 1: then each history group's level is its draw times ``history_sigma_max``, so the
      history is clean or lightly noised (the issue's "random prefix of clean or lightly noised frames"; at
      sampling, clean history sits at sigma 0 and generated history at the stabilization level, both inside
      [0, history_sigma_max] when that is chosen at or above the stabilization level).

    Draws, all from ``generator`` (so the output is a function of its state, and a given state gives the same
    values for any ``device``): for ``mode="history"`` first ``torch.randint(len(allowed), (B,))`` (the index of
    h in the sorted allowed set, on the generator's device); then, in both modes, ``sampler((B, N), generator)``.
    For "history", group k >= h / g takes the value drawn for group h / g. For per-sample reproducibility
    independent of the batch (docs/architecture.md, Seeds and noise addressing), call with ``batch=1`` and one
    addressed generator per sample.

    Args:
        batch: B, an int >= 1.
        num_frames: T, an int >= 1, divisible by ``frame_group``.
        generator: the ``torch.Generator`` every draw comes from (required; the global RNG is never used).
        mode: "independent" or "history".
        history: ``mode="history"`` only (must be None otherwise): the allowed history lengths in frames, each a
            multiple of g in [0, T - g]: an int (the largest; allowed = 0, g, ..., history), a list of distinct
            lengths, or None (0, g, ..., T - g).
        frame_group: g, the number of consecutive frames that share a sigma, an int >= 1.
        sampler: the marginal of one sigma: a `genrl.flow.TimestepSampler` or any callable
            ``sampler(shape, generator) -> tensor of shape`` with values in [0, 1]. Default:
            ``TimestepSampler("uniform")``, i.e. U[0, 1).
        device: device of the result (default: the generator's device).
        dtype: floating dtype of the result (default float32; TimestepSampler draws in float32, so float64 holds
            the same values).

    Returns:
        Tensor [B, T] of sigma in [0, 1] (0 = clean, 1 = noise), constant within each frame group.

    Raises:
        ValueError: ``batch < 1``, ``num_frames < 1``, ``frame_group < 1`` or T not divisible by g; an unknown
            ``mode``; ``history`` given with ``mode="independent"``, or an allowed length that is not a multiple of
            g, outside [0, T - g], or repeated; a sampler that is not callable or returns the wrong shape;
            ``dtype`` not floating; ``history_sigma_max`` outside [0, 1], or not 1.0 with ``mode="independent"``.
            The message names the value.
        TypeError: ``generator`` is not a ``torch.Generator`` (e.g. None).

    Source: Chen et al. 2024, "Diffusion Forcing", arXiv 2407.01392, Algorithm 1 (independent per-token noise
    levels); Song et al. 2025, "History-Guided Video Diffusion", arXiv 2502.06764, eq. 4 and App. A.5.
    """
    b = _check_int(batch, "batch", 1)
    t_frames = _check_int(num_frames, "num_frames", 1)
    g = _check_int(frame_group, "frame_group", 1)
    if t_frames % g:
        raise ValueError(
            f"num_frames = {t_frames} must be divisible by frame_group = {g} (frames of one temporal patch share a "
            f"sigma); pad or crop the clip to a multiple of {g} frames"
        )
    if mode not in DIFFUSION_FORCING_MODES:
        raise ValueError(f"mode must be one of {DIFFUSION_FORCING_MODES}, got {mode!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator (the only source of randomness), got {type(generator).__name__}"
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
    if sampler is None:
        sampler = TimestepSampler("uniform")
    elif not callable(sampler):
        raise ValueError(f"sampler must be a TimestepSampler or a callable (shape, generator), got {sampler!r}")
    if mode == "independent" and history is not None:
        raise ValueError(f"history applies to mode='history' only; got history={history!r} with mode='independent'")
    hmax = float(history_sigma_max)
    if not 0.0 <= hmax <= 1.0:
        raise ValueError(f"history_sigma_max must be in [0, 1] (a noise level), got {history_sigma_max!r}")
    if mode == "independent" and hmax != 1.0:
        raise ValueError(
            f"history_sigma_max applies to mode='history' only; got history_sigma_max={history_sigma_max!r} with "
            f"mode='independent'"
        )
    n_groups = t_frames // g

    if mode == "history":
        allowed = _allowed_history(history, t_frames, g)
        pick = torch.randint(len(allowed), (b,), generator=generator, device=generator.device)
        start = torch.tensor(allowed, device=pick.device)[pick] // g  # [B] first group of the shared future
    sig = sampler((b, n_groups), generator)
    if not isinstance(sig, torch.Tensor) or tuple(sig.shape) != (b, n_groups):
        got = tuple(sig.shape) if isinstance(sig, torch.Tensor) else type(sig).__name__
        raise ValueError(f"sampler must return a tensor of the requested shape {(b, n_groups)}, got {got}")
    if mode == "history":
        k = torch.arange(n_groups, device=sig.device).unsqueeze(0)  # [1, N]
        start = start.to(sig.device).unsqueeze(1)  # [B, 1]
        sig = torch.gather(sig, 1, torch.minimum(k, start).expand(b, n_groups))
        if hmax != 1.0:
            sig = torch.where(k < start, sig * hmax, sig)
    out = sig.repeat_interleave(g, dim=1)  # [B, T]
    return out.to(device=device if device is not None else out.device, dtype=dtype)
