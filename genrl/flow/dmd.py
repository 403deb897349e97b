"""Distribution-matching distillation (DMD / DMD2 / SiD) as used by causal video students.

Pure functions shared by the DMD, Self-Forcing, Stream-R1 and AFD methods: the "warped" few-step
denoising list, the shifted-and-clamped timestep sampler of the generator and critic steps, the
normalised DMD gradient and its surrogate loss, the critic (fake score) loss, the CausVid ODE
regression loss, the SiD generator loss, and the reference repositories' CFG scale convention.

Conventions (docs/architecture.md, Conventions): sigma in [0, 1] (0 = data, 1 = noise), x_sigma = (1 - sigma) x0 +
sigma eps, velocity v = eps - x0, timestep = 1000 sigma, shift sigma' = s sigma / (1 + (s - 1) sigma).
Latents are [B, T, C, H, W] (``frame_dim=1``) or Wan's [B, C, T, H, W] (``frame_dim=2``); a
per-frame mask is [B, T] with T on ``frame_dim``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from genrl.flow.broadcast import _expand, compute_dtype
from genrl.flow.guidance import cfg_combine
from genrl.flow.losses import flow_matching_loss
from genrl.flow.schedules import NUM_TRAIN_TIMESTEPS, shift_sigmas

__all__ = [
    "warped_timesteps",
    "warped_sigmas",
    "sample_dmd_sigma",
    "dmd_gradient",
    "dmd_loss",
    "critic_loss",
    "ode_regression_loss",
    "sid_loss",
    "reference_scale_to_w",
    "w_to_reference_scale",
    "dmd_cfg",
    "gan_generator_loss",
    "gan_discriminator_loss",
]


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_num_train_timesteps(n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_train_timesteps must be an int >= 1, got {n!r}")
    return n


def _check_same_shape(ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{ref_name} of shape {tuple(ref.shape)} and {name} of shape {tuple(t.shape)} must match"
            )
    if ref.ndim < 1:
        raise ValueError(f"{ref_name} must have a batch dim, got a 0-d tensor")


def _frame_mask(mask: torch.Tensor, x: torch.Tensor, frame_dim: int) -> torch.Tensor:
    """Validate a per-frame mask [B, T] and return it as a bool tensor broadcastable to ``x``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor [B, T], got {type(mask).__name__}")
    nd = x.ndim
    fd = frame_dim + nd if frame_dim < 0 else frame_dim
    if not 0 < fd < nd or mask.shape != (x.shape[0], x.shape[fd]):
        expected = f"[{x.shape[0]}, {x.shape[fd]}]" if 0 < fd < nd else "[B, T] with 1 <= frame_dim < x.ndim"
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not fit latents of shape {tuple(x.shape)} "
            f"with frame_dim={frame_dim}: expected {expected}"
        )
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(
                "mask must be bool or hold only 0 / 1 values (use `weight` for weights), "
                f"got values {torch.unique(mask.detach()).tolist()[:8]}"
            )
        mask = mask != 0
    shape = [1] * nd
    shape[0], shape[fd] = mask.shape
    return mask.to(x.device).reshape(shape)


def _element_mask(mask: torch.Tensor | None, x: torch.Tensor, frame_dim: int) -> torch.Tensor | None:
    """Bool mask of x's full shape (or None)."""
    if mask is None:
        return None
    return _frame_mask(mask, x, frame_dim).expand(x.shape)


def _masked_count(m: torch.Tensor | None, x: torch.Tensor) -> int:
    n = x.numel() if m is None else int(m.sum())
    if n == 0:
        raise ValueError("mask selects no element in the whole batch; the loss is undefined")
    return n


def _per_sample_normalizer(
    x: torch.Tensor, x0_real: torch.Tensor, m: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DMD eq. 8 normaliser: per-sample mean |x - x0_real| (+ eps) over (masked) elements.

    Returns ``(denom, valid)``, both [B, 1, ..., 1] broadcastable to x: ``valid`` is False for a
    sample whose normaliser is not a finite number > 0 (e.g. an empty mask or x == x0_real), and
    ``denom`` is replaced by 1 there so that divisions stay finite.
    """
    b = x.shape[0]
    a = (x - x0_real).abs()
    if m is None:
        mean = a.reshape(b, -1).mean(dim=1)
    else:
        num = torch.where(m, a, torch.zeros((), dtype=a.dtype, device=a.device)).reshape(b, -1).sum(dim=1)
        cnt = m.reshape(b, -1).sum(dim=1).to(a.dtype)
        mean = num / cnt  # 0 / 0 = nan for an empty sample -> invalid below
    denom = mean + eps
    valid = torch.isfinite(denom) & (denom > 0)
    denom = torch.where(valid, denom, torch.ones((), dtype=denom.dtype, device=denom.device))
    shape = (b,) + (1,) * (x.ndim - 1)
    return denom.reshape(shape), valid.reshape(shape)


# --------------------------------------------------------------------------------------------
# schedules
# --------------------------------------------------------------------------------------------


def warped_timesteps(
    steps: Sequence[float] | torch.Tensor,
    shift: float,
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
) -> list[float]:
    """Self-Forcing's "warped" few-step denoising list (``warp_denoising_step: true``).

    The configured list (e.g. [1000, 750, 500, 250]) is not used as timesteps directly: each entry
    t is an index into the shifted training grid. That grid is the one of a flow-matching scheduler
    with N = ``num_train_timesteps`` steps, sigma_min = 0 and one extra step: unshifted
    sigma_i = 1 - i / N for i = 0 .. N - 1 (``linspace(1, 0, N + 1)[:-1]``), shifted with
    sigma' = s sigma / (1 + (s - 1) sigma) and scaled by N, with 0 appended at index N. Entry t
    maps to ``grid[N - t]``, i.e. to the timestep ``N * shift(t / N)``. For shift 5:
    [1000, 750, 500, 250] -> [1000, 937.5, 833.33.., 625.0] and Rolling Forcing's
    [1000, 800, 600, 400, 200] -> [1000, 952.38.., 882.35.., 769.23.., 555.56..]. Shift 1 returns
    the list unchanged; the map is strictly increasing in t, so a descending list stays descending.

    Computed in float64 from t / N exactly; the reference builds the grid with a float32
    ``linspace``, so its values differ from these in about the 5th significant digit.

    Args:
        steps: the configured list, integer-valued numbers in [0, N] (python numbers or a 1-d
            tensor), usually descending.
        shift: timestep shift s, a finite python number > 0 (Self-Forcing / Rolling Forcing use 5).
        num_train_timesteps: N, the number of training timesteps (1000 for Wan and diffusers models).

    Returns:
        list[float] of timesteps in [0, N], one per entry of ``steps`` (same order).

    Raises:
        ValueError: an entry is not integer-valued or lies outside [0, N] (the message names it),
            ``shift`` is not finite or not > 0, or ``num_train_timesteps`` is not an int >= 1.
        TypeError: ``shift`` is not a number.

    Source: Self-Forcing (Huang et al. 2025) ``warp_denoising_step`` over ``FlowMatchScheduler(shift,
    sigma_min=0, extra_one_step=True)``; shift from Esser et al. 2024 (SD3) §5.3.2.
    """
    n = _check_num_train_timesteps(num_train_timesteps)
    values = steps.detach().cpu().reshape(-1).tolist() if isinstance(steps, torch.Tensor) else list(steps)
    out: list[float] = []
    for t in values:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t != int(t):
            raise ValueError(f"warped denoising steps must be integer-valued numbers, got {t!r}")
        if not 0 <= t <= n:
            raise ValueError(f"warped denoising step {t!r} is outside [0, num_train_timesteps={n}]")
        out.append(shift_sigmas(int(t) / n, shift) * n)
    if not values:
        shift_sigmas(0.0, shift)  # still validate the shift
    return out


def warped_sigmas(
    steps: Sequence[float] | torch.Tensor,
    shift: float,
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
) -> list[float]:
    """The sigmas of `warped_timesteps`: ``timestep / num_train_timesteps``, in [0, 1].

    The list holds exactly one sigma per configured step and nothing else: the final 0 (clean
    data) that a sampler steps to after the last entry is NOT appended; callers that need a
    ``num_steps + 1`` schedule append 0.0 themselves.

    Args:
        steps: the configured list (see `warped_timesteps`).
        shift: timestep shift s > 0.
        num_train_timesteps: N.

    Returns:
        list[float] of sigmas in [0, 1], same length and order as ``steps``.

    Raises:
        ValueError / TypeError: as `warped_timesteps`.

    Source: as `warped_timesteps`.
    """
    n = _check_num_train_timesteps(num_train_timesteps)
    return [t / n for t in warped_timesteps(steps, shift, n)]


def sample_dmd_sigma(
    batch: int,
    generator: torch.Generator,
    shift: float = 5.0,
    min_timestep: float = 20,
    max_timestep: float = 980,
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One sigma per sample for the DMD generator and critic steps (shifted, clamped).

    tau ~ U{0, ..., N - 1} (integers, N = ``num_train_timesteps``); tau <- N * s tau' / (1 + (s - 1)
    tau') with tau' = tau / N; tau <- clamp(tau, min_timestep, max_timestep); sigma = tau / N. The
    shifted tau is not rounded back to an integer. For the defaults (s = 5, [20, 980]) the median
    timestep is about 833, about 36% of draws lie above 900, and about 9% sit exactly at 980 (the
    clamp). One sigma per video: the teacher is bidirectional, so all frames share it.

    Draws use only ``generator`` (never the global RNG), on the generator's device, then move to
    ``device``: one generator state gives the same sigmas on any target device.

    Args:
        batch: B, number of sigmas, an int >= 1.
        generator: the torch.Generator to draw from.
        shift: timestep shift s, finite and > 0 (1 = none).
        min_timestep, max_timestep: the clamp, in timestep units,
            0 <= min_timestep <= max_timestep <= N.
        num_train_timesteps: N (1000).
        device: device of the result (default: the generator's device).

    Returns:
        Tensor [B], float32, sigma in [min_timestep / N, max_timestep / N].

    Raises:
        ValueError: ``batch < 1``, a bad range (min > max or outside [0, N]), a bad ``shift`` or
            ``num_train_timesteps``; the message names the value.
        TypeError: ``generator`` is not a torch.Generator, or ``shift`` is not a number.

    Source: DMD2 (Yin et al. 2024b) timestep range [0.02, 0.98] N; Self-Forcing ``_get_timestep``
    with ``timestep_shift`` (shift from Esser et al. 2024, SD3 §5.3.2).
    """
    n = _check_num_train_timesteps(num_train_timesteps)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    for name, v in (("min_timestep", min_timestep), ("max_timestep", max_timestep)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= n:
            raise ValueError(f"{name} must be a number in [0, num_train_timesteps={n}], got {v!r}")
    if min_timestep > max_timestep:
        raise ValueError(
            f"min_timestep must be <= max_timestep, got min_timestep={min_timestep}, max_timestep={max_timestep}"
        )
    tau = torch.randint(0, n, (batch,), generator=generator, device=generator.device)
    tau = shift_sigmas(tau.to(torch.float64) / n, shift) * n
    tau = tau.clamp(float(min_timestep), float(max_timestep))
    sigma = (tau / n).to(torch.float32)
    return sigma.to(device) if device is not None else sigma


# --------------------------------------------------------------------------------------------
# generator losses
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def dmd_gradient(
    x: torch.Tensor,
    x0_fake: torch.Tensor,
    x0_real: torch.Tensor,
    normalize: bool = True,
    eps: float = 0.0,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """The normalised DMD gradient g = (x0_fake - x0_real) / mean |x - x0_real|.

    The difference of the fake-score (critic) and real-score (teacher, with CFG) clean predictions
    at the noised generator output approximates s_real - s_fake up to a time weighting; DMD
    replaces that weighting by the per-sample normaliser mean_{non-batch elements} |x - x0_real|
    (eq. 8), which makes the update scale-free. Descent on `dmd_loss` with this g moves x towards
    the teacher's distribution. With ``mask`` the normaliser's mean runs over the elements of the
    masked frames only; g itself is returned for every element (`dmd_loss` applies the mask).

    Computed without autograd: inputs are detached and the result carries no graph. Non-finite
    entries are set to 0, and so is the whole g of a sample whose normaliser is not a finite
    number > 0 (x == x0_real everywhere, or an empty mask for that sample): such a sample gets no
    update. (The reference applies ``nan_to_num`` with its defaults, which turns x / 0 into the
    largest finite float.)

    Args:
        x: generator output x0 (the rollout's clean prediction), any shape [B, ...], any float dtype.
        x0_fake: the critic's x0 prediction at x_sigma = (1 - sigma) x + sigma eps, same shape.
        x0_real: the teacher's (CFG-guided) x0 prediction at the same x_sigma, same shape.
        normalize: divide by the per-sample normaliser (True, DMD) or return x0_fake - x0_real.
        eps: added to the normaliser (>= 0; the reference uses 0).
        mask: optional per-frame mask [B, T] (bool or 0/1), T on ``frame_dim``.
        frame_dim: frame dim of the latents (1 for [B, T, C, H, W], 2 for Wan's [B, C, T, H, W]).

    Returns:
        g, shape of x, float32 (float64 if any input is float64), finite.

    Raises:
        ValueError: shapes differ (the message names both), ``mask`` does not fit, ``eps < 0``.

    Source: Yin et al. 2024, One-step Diffusion with Distribution Matching Distillation (DMD),
    eq. 7-8; DMD2 (Yin et al. 2024b); Self-Forcing ``model/dmd.py``.
    """
    _check_same_shape("x", x, x0_fake=x0_fake, x0_real=x0_real)
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    dt = compute_dtype(x, x0_fake, x0_real)
    x_, f, r = (t.detach().to(dt) for t in (x, x0_fake, x0_real))
    g = f - r
    if normalize:
        m = _element_mask(mask, x_, frame_dim)
        denom, valid = _per_sample_normalizer(x_, r, m, float(eps))
        g = torch.where(valid, g / denom, torch.zeros((), dtype=dt, device=g.device))
    elif mask is not None:
        _frame_mask(mask, x_, frame_dim)  # validate even when unused
    return torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)


def dmd_loss(
    x: torch.Tensor,
    g: torch.Tensor,
    mask: torch.Tensor | None = None,
    weight: float | torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Surrogate loss whose gradient w.r.t. x is the (weighted) DMD gradient g / N.

    ``L = 0.5 * sum(w * m * (x - sg(x - g))^2) / N``, where sg is stop-gradient, m the element mask
    (1 without ``mask``), w the weight (1 without ``weight``) and N the number of elements of x (or
    of masked elements with ``mask``, counted over the whole batch; N does not depend on w). So
    ``dL/dx = w * m * g / N`` and masked-out elements get exactly zero gradient. The value is
    evaluated as 0.5 * sum(w m (x - sg(x) + g)^2) / N, the same function, whose value is exactly
    0.5 * mean(w m g^2) and whose gradient is exactly w m g / N (no x - (x - g) round-off). The
    value has no meaning by itself; only its gradient does.

    Computed in float64 (the reference's choice), then cast to float32, or kept float64 when x,
    g or weight is float64; autograd flows into x only (g and weight are detached).

    Args:
        x: generator output carrying the graph, any shape [B, ...], any float dtype.
        g: the DMD gradient from `dmd_gradient`, same shape.
        mask: optional per-frame mask [B, T] (bool or 0/1), T on ``frame_dim``.
        weight: optional non-negative weight: a python float, 0-d, [B] (per sample), [B, T]
            (per frame, T on ``frame_dim``) or a tensor of x.ndim dims broadcastable to x (per
            element). Stream-R1 uses it for saliency x reward weights; gradient = w * g / N.
        frame_dim: frame dim of the latents (1 for [B, T, C, H, W], 2 for Wan's [B, C, T, H, W]).

    Returns:
        0-d tensor, float32 (float64 when an input is float64).

    Raises:
        ValueError: shapes differ, ``mask`` or ``weight`` does not fit x, ``weight`` has a negative
            or NaN entry, or the mask selects nothing in the whole batch.

    Source: Yin et al. 2024 (DMD) eq. 7-8 as implemented in DMD2 / Self-Forcing ``model/dmd.py``
    (0.5 * mse(x, (x - g).detach()) in float64).
    """
    _check_same_shape("x", x, g=g)
    out_dtype = compute_dtype(x, g, weight)
    dt = torch.float64
    m = _element_mask(mask, x, frame_dim)
    n = _masked_count(m, x)
    x64 = x.to(dt)
    r = x64 - x64.detach() + g.detach().to(dt)
    if m is not None:  # mask before squaring: masked-out entries get a zero (never NaN) gradient
        r = torch.where(m, r, torch.zeros((), dtype=dt, device=r.device))
    se = r.square()
    if weight is not None:
        w = _expand(weight.detach() if isinstance(weight, torch.Tensor) else weight, x, frame_dim, "weight", dt)
        if not bool((w >= 0).all()):
            raise ValueError("weight must be non-negative (and not NaN) everywhere")
        se = se * w
    return (0.5 * se.sum() / n).to(out_dtype)


def sid_loss(
    x: torch.Tensor,
    x0_fake: torch.Tensor,
    x0_real: torch.Tensor,
    alpha: float = 1.0,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Score identity Distillation (SiD) generator loss with the DMD normaliser.

    ``L = mean over (masked) elements of (x0_real - x0_fake) * ((x0_real - x) - alpha (x0_real -
    x0_fake)) / nrm_b``, where nrm_b = mean |x - x0_real| per sample (over masked elements with
    ``mask``), exactly as in `dmd_gradient`. Only x carries a graph (x0_fake and x0_real are
    detached, as in the reference), so dL/dx = m (x0_fake - x0_real) / (nrm_b N): the same
    direction as DMD; alpha only changes the value. Samples whose normaliser is not a finite
    number > 0 contribute 0. Computed in float64; returned as float32 (float64 when an input is).

    Args:
        x: generator output carrying the graph, any shape [B, ...].
        x0_fake: the critic's x0 prediction at x_sigma, same shape.
        x0_real: the teacher's (CFG-guided) x0 prediction at x_sigma, same shape.
        alpha: the SiD alpha (1.0 in Self-Forcing's SiD config), a finite number.
        mask: optional per-frame mask [B, T] (bool or 0/1), T on ``frame_dim``.
        frame_dim: frame dim of the latents.

    Returns:
        0-d tensor.

    Raises:
        ValueError: shapes differ, ``mask`` does not fit or selects nothing, ``alpha`` not finite.

    Source: Zhou et al. 2024, Score identity Distillation (SiD), the alpha-weighted generator
    loss; Self-Forcing ``model/sid.py`` (with the DMD eq. 8 normaliser).
    """
    _check_same_shape("x", x, x0_fake=x0_fake, x0_real=x0_real)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"alpha must be a finite number, got {alpha!r}")
    out_dtype = compute_dtype(x, x0_fake, x0_real)
    dt = torch.float64
    m = _element_mask(mask, x, frame_dim)
    n = _masked_count(m, x)
    x64 = x.to(dt)
    f, r = x0_fake.detach().to(dt), x0_real.detach().to(dt)
    with torch.no_grad():
        denom, valid = _per_sample_normalizer(x64.detach(), r, m, 0.0)
    keep = valid if m is None else (valid & m)
    zero = torch.zeros((), dtype=dt, device=x64.device)
    # select before multiplying, so that excluded entries get a zero (never NaN) gradient
    d = torch.where(keep, r - f, zero)
    resid = torch.where(keep, r - x64, zero)
    el = d * (resid - alpha * d) / denom
    return (el.sum() / n).to(out_dtype)


# --------------------------------------------------------------------------------------------
# critic and ODE-init losses
# --------------------------------------------------------------------------------------------


def critic_loss(
    v_fake: torch.Tensor,
    x0: torch.Tensor,
    eps: torch.Tensor,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Fake-score (critic) loss of the DMD critic step: plain flow matching on generator samples.

    ``L = mean_b mean_e (v_fake - (eps - x0))^2`` with no time weighting, where x0 is a generator
    output (regenerated under no_grad), eps the noise and v_fake the critic's velocity at
    x_sigma = (1 - sigma) x0 + sigma eps. Without ``mask`` this is the mean over all elements; with
    ``mask`` each sample's mean runs over its masked frames and samples weigh equally (see
    `flow_matching_loss`). x0 and eps are detached so the critic step never updates the generator.

    Args:
        v_fake: the critic's velocity prediction, any shape [B, ...], any float dtype.
        x0: the generator sample, same shape.
        eps: the noise used to build x_sigma, same shape.
        mask: optional per-frame mask [B, T], T on ``frame_dim``.
        frame_dim: frame dim of the latents.

    Returns:
        0-d tensor, float32 (float64 when an input is float64), differentiable w.r.t. v_fake.

    Raises:
        ValueError: as `flow_matching_loss` (shape mismatch, mask does not fit or is empty).

    Source: DMD2 (Yin et al. 2024b) fake-score update; Self-Forcing ``utils/loss.py`` FlowPredLoss.
    """
    return flow_matching_loss(v_fake, x0.detach(), eps.detach(), 0.0, "none", mask, frame_dim).mean()


def ode_regression_loss(
    x0_pred: torch.Tensor,
    x0_target: torch.Tensor,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """CausVid ODE-initialisation loss: MSE between the student's x0 and the teacher ODE's endpoint.

    ``L = sum(m (x0_pred - x0_target)^2) / sum(m)``: the mean over the elements of the frames the
    mask selects, pooled over the whole batch (CausVid selects the frames whose sigma != 0). Other
    frames do not enter, even if they hold NaN. x0_target is detached.

    Args:
        x0_pred: the student's clean prediction G(x_sigma_i, sigma_i), any shape [B, ...].
        x0_target: the clean result of the teacher's ODE trajectory, same shape.
        mask: optional per-frame mask [B, T] (bool or 0/1), T on ``frame_dim``.
        frame_dim: frame dim of the latents.

    Returns:
        0-d tensor, float32 (float64 when an input is float64), differentiable w.r.t. x0_pred.

    Raises:
        ValueError: shapes differ, ``mask`` does not fit, or the mask selects nothing.

    Source: Yin et al. 2025, CausVid §4.3 (student initialisation by ODE-trajectory regression);
    CausVid / Self-Forcing ``model/ode_regression.py``.
    """
    _check_same_shape("x0_pred", x0_pred, x0_target=x0_target)
    dt = compute_dtype(x0_pred, x0_target)
    diff = x0_pred.to(dt) - x0_target.detach().to(dt)
    m = _element_mask(mask, x0_pred, frame_dim)
    n = _masked_count(m, x0_pred)
    if m is not None:  # mask before squaring: other frames get a zero (never NaN) gradient
        diff = torch.where(m, diff, torch.zeros((), dtype=dt, device=diff.device))
    return diff.square().sum() / n


# --------------------------------------------------------------------------------------------
# CFG scale convention of the reference repositories
# --------------------------------------------------------------------------------------------


def reference_scale_to_w(s: float) -> float:
    """Convert the reference repos' guidance scale s (cond + s (cond - uncond)) to standard w = s + 1.

    Self-Forcing's ``guidance_scale: 3.0`` is w = 4; CausVid's 3.5 is w = 4.5.

    Raises:
        ValueError: s is not a finite number.

    Source: docs/architecture.md, Conventions (CFG forms); Ho & Salimans 2022 eq. 6.
    """
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise ValueError(f"reference CFG scale must be a finite number, got {s!r}")
    return float(s) + 1.0


def w_to_reference_scale(w: float) -> float:
    """Inverse of `reference_scale_to_w`: s = w - 1.

    Raises:
        ValueError: w is not a finite number.
    """
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise ValueError(f"CFG scale w must be a finite number, got {w!r}")
    return float(w) - 1.0


def dmd_cfg(
    cond: torch.Tensor,
    uncond: torch.Tensor,
    reference_scale: float | torch.Tensor,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Teacher CFG in the reference repos' form ``cond + s (cond - uncond)``, via `cfg_combine`.

    Equals the standard form with w = s + 1; s = 0 returns ``cond`` exactly.

    Args:
        cond, uncond: conditional / unconditional predictions (x0, velocity or eps), same shape.
        reference_scale: s, a python float or a tensor (0-d, [B], [B, T]) as `cfg_combine`'s scale.
        frame_dim: frame dim, used only for a [B, T] scale.

    Returns:
        The guided prediction, shape of ``cond``, float32 (float64 if an input is float64).

    Raises:
        ValueError: as `cfg_combine`, or a non-finite python scale.

    Source: Self-Forcing / CausVid ``model/dmd.py`` teacher guidance; Ho & Salimans 2022 eq. 6.
    """
    if isinstance(reference_scale, torch.Tensor):
        w: float | torch.Tensor = reference_scale + 1
    else:
        w = reference_scale_to_w(reference_scale)
    return cfg_combine(cond, uncond, w, frame_dim)


# --------------------------------------------------------------------------------------------
# DMD2's GAN term (non-saturating)
# --------------------------------------------------------------------------------------------


def gan_generator_loss(logit_fake: torch.Tensor) -> torch.Tensor:
    """Non-saturating generator loss ``mean softplus(-D(x_fake)) = mean -log sigmoid(D(x_fake))`` (Goodfellow et al.
    2014, section 3; the GAN term of DMD2, Yin et al. 2024, eq. 7, and of TMD's DMD2-v stage, weight 0.03).

    Args:
        logit_fake: discriminator logits of generated samples, [B] (any float dtype; computed in float32).
    Returns:
        scalar float32 loss; its gradient w.r.t. a logit is ``-(1 - sigmoid(logit)) / B``: it pushes fake logits up.
    """
    return F.softplus(-logit_fake.float()).mean()


def gan_discriminator_loss(logit_real: torch.Tensor, logit_fake: torch.Tensor) -> torch.Tensor:
    """The discriminator's logistic loss ``mean softplus(-D(x_real)) + mean softplus(D(x_fake))`` (binary
    cross-entropy with real = 1, fake = 0; DMD2 trains its classifier head with it).

    Args:
        logit_real: logits of real (data) samples [B_r]; logit_fake: logits of generated samples [B_f] (detached
            from the generator by the caller).
    Returns:
        scalar float32 loss, ``2 log 2`` when every logit is 0.
    """
    return F.softplus(-logit_real.float()).mean() + F.softplus(logit_fake.float()).mean()
