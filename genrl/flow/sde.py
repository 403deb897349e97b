"""Stochastic (SDE) sampler step kernels with Gaussian transition log-probabilities (Flow-GRPO / DanceGRPO).

One pure function family serves both the rollout sampler and the policy loss: the sampler calls
`sde_step` to draw x -> x', the loss calls `step_log_prob` to score the recorded x -> x' under the
current velocity. Both go through `step_mean_std` and `gaussian_log_prob`, so with unchanged
weights the importance ratio exp(l_new - l_old) is exactly 1 (bit for bit, same device and batch).

Reverse-time SDE with the marginals of the flow ODE dx/dsigma = v (sigma decreasing, 1 = noise):

    dx = [v + g^2 / (2 sigma) * eps_hat] dsigma + g dW,   eps_hat = x + (1 - sigma) v,

Euler-Maruyama over sigma -> sigma_next (Delta = sigma_next - sigma < 0) gives a Gaussian step
with mean x + Delta [v + g^2/(2 sigma) eps_hat] and std g sqrt(|Delta|). The kinds differ only in
the diffusion coefficient g (`diffusion_coefficient`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from genrl.flow.broadcast import SigmaLike, compute_dtype, expand_sigma

__all__ = [
    "StepKind",
    "STEP_KINDS",
    "LogProbReduce",
    "StepOutput",
    "diffusion_coefficient",
    "step_mean_std",
    "gaussian_log_prob",
    "sde_step",
    "step_log_prob",
]

StepKind = Literal["ode", "flow_grpo", "dance_grpo"]
STEP_KINDS: tuple[str, ...] = ("ode", "flow_grpo", "dance_grpo")
"""The step kernels: deterministic Euler ODE, Flow-GRPO SDE (g = a sqrt(sigma / (1 - sigma))),
DanceGRPO / BranchGRPO SDE (constant g = eta)."""

LogProbReduce = Literal["mean", "sum"]
_REDUCES: tuple[str, ...] = ("mean", "sum")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class StepOutput:
    """One sampler step x -> sample, with its Gaussian transition.

    Attributes:
        sample: x at sigma_next, shape of x, float32 (float64 if any input is float64).
        mean: the transition mean, shape of x, same dtype (carries autograd from v).
        std: the transition std, broadcastable to x (the shape of `expand_sigma`'s output, e.g.
            0-d for float sigmas, [B, 1, ..., 1] for [B] sigmas); zeros for a deterministic step.
        log_prob: [B] log-density of ``sample`` under N(mean, std^2), reduced over the non-batch
            dims (`gaussian_log_prob`), same dtype; zeros for a deterministic step (no density).
    """

    sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor


def _check_kind(kind: str) -> None:
    if kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {kind!r}; expected one of {STEP_KINDS}")


def _check_noise_level(noise_level: float) -> None:
    if isinstance(noise_level, torch.Tensor):
        noise_level = float(noise_level)
    if not (math.isfinite(noise_level) and noise_level >= 0):
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level}")


def diffusion_coefficient(
    kind: StepKind,
    sigma: SigmaLike,
    noise_level: float,
    sigma_at_one: float | None = None,
) -> torch.Tensor:
    """Diffusion coefficient g(sigma) of the exploration SDE of each step kernel.

    * ``"ode"``: g = 0 (deterministic Euler step).
    * ``"flow_grpo"``: g = a sqrt(sigma / (1 - sigma)) with a = ``noise_level`` (Flow-GRPO's
      ``sample.noise_level``, 0.7 by default). It diverges at sigma = 1, where Flow-GRPO substitutes
      the second schedule entry in the denominator: g(1) = a sqrt(1 / (1 - sigma_at_one)). At
      sigma = 0 it is 0.
    * ``"dance_grpo"``: g = eta = ``noise_level`` (DanceGRPO / BranchGRPO ``--eta``, 0.3 for
      FLUX / Wan), constant in sigma.

    With ``noise_level = 0`` every kind gives g = 0, i.e. the ODE.

    Args:
        kind: the step kernel, one of `STEP_KINDS`.
        sigma: noise level(s) in [0, 1], a python float or a tensor of any shape.
        noise_level: a (flow_grpo) or eta (dance_grpo), >= 0; ignored by "ode".
        sigma_at_one: the sigma whose 1 - sigma replaces the denominator at sigma == 1
            ("flow_grpo" only): the second entry of the sampling schedule (the first below 1).
            Must be given, and in [0, 1), when any sigma equals 1.

    Returns:
        g, a tensor of sigma's shape (0-d for a float), float32 (float64 for a float64 sigma),
        >= 0, on sigma's device.

    Raises:
        ValueError: unknown ``kind``; ``noise_level`` negative or not finite; "flow_grpo" with a
            sigma outside [0, 1], or with sigma == 1 and ``sigma_at_one`` missing or not in [0, 1).

    Source: Liu et al. 2025, Flow-GRPO (ODE-to-SDE conversion, g = a sqrt(sigma / (1 - sigma)));
    ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`` (the sigma = 1 substitution);
    Xue et al. 2025, DanceGRPO (``flux_step``, constant eta). Documentation: docs/methods/grpo.md (Exploration).
    """
    _check_kind(kind)
    _check_noise_level(noise_level)
    dt = compute_dtype(sigma)
    if isinstance(sigma, torch.Tensor):
        s = sigma.to(dt)
    elif isinstance(sigma, bool) or not isinstance(sigma, (int, float)):
        raise TypeError(f"sigma must be a python float or a torch.Tensor, got {type(sigma).__name__}")
    else:
        s = torch.tensor(float(sigma), dtype=dt)
    if kind == "ode":
        return torch.zeros_like(s)
    if kind == "dance_grpo":
        return torch.full_like(s, float(noise_level))
    # flow_grpo
    if bool(((s < 0) | (s > 1) | torch.isnan(s)).any()):
        raise ValueError(f"flow_grpo needs sigma in [0, 1]; got values in [{float(s.min())}, {float(s.max())}]")
    at_one = s >= 1
    if bool(at_one.any()):
        if sigma_at_one is None:
            raise ValueError(
                "flow_grpo: g = a sqrt(sigma / (1 - sigma)) diverges at sigma == 1; pass sigma_at_one "
                "(the second entry of the sigma schedule, < 1) to use 1 - sigma_at_one as the denominator there"
            )
        if not 0 <= float(sigma_at_one) < 1:
            raise ValueError(f"flow_grpo: sigma_at_one must be in [0, 1), got {sigma_at_one}")
    # safe denominator everywhere (no inf in the unused branch, so no NaN gradients)
    denom = torch.where(at_one, torch.full_like(s, 1.0 - float(sigma_at_one or 0.0)), 1 - s)
    return float(noise_level) * torch.sqrt(s / denom)


def step_mean_std(
    kind: StepKind,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    noise_level: float = 0.7,
    sigma_at_one: float | None = None,
    frame_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std of the Gaussian transition of one Euler-Maruyama step of the reverse SDE.

    With Delta = sigma_next - sigma (< 0 when sampling), eps_hat = x + (1 - sigma) v and
    g = `diffusion_coefficient` (kind, sigma, noise_level, sigma_at_one):

        mean = x + Delta [v + g^2 / (2 sigma) eps_hat],    std = g sqrt(|Delta|).

    The SDE dx = [v + g^2/(2 sigma) eps_hat] dsigma + g dW has the marginals of the flow ODE for
    any g (for the exact v). Equivalent forms: the DanceGRPO score form
    mean = x + Delta (v - g^2/2 * score) with score = -(x - (1 - sigma) x0_hat) / sigma^2 = -eps_hat / sigma,
    and the Flow-GRPO closed form x (1 + g^2 Delta / (2 sigma)) + v (1 + g^2 (1 - sigma) / (2 sigma)) Delta.
    For "ode" (and for noise_level = 0) the mean is the Euler step x + Delta v exactly (`euler_step`)
    and std = 0.

    Args:
        kind: the step kernel, one of `STEP_KINDS`.
        x: latents at ``sigma``, any shape [B, ...] ([B, T, C, H, W] or Wan's [B, C, T, H, W]).
        v: velocity at (x, sigma) (guidance already applied), shape of ``x``, any float dtype.
        sigma: current noise level(s) in (0, 1]: float, 0-d, [B] or per-frame [B, T].
        sigma_next: next noise level(s) in [0, 1], same accepted forms.
        noise_level: a for "flow_grpo" (default 0.7), eta for "dance_grpo" (reference 0.3); >= 0.
        sigma_at_one: "flow_grpo" only: the schedule's second entry, used in g at sigma == 1.
        frame_dim: frame dim of ``x`` for per-frame sigmas.

    Returns:
        (mean, std): mean of ``x``'s shape; std of the broadcast shape of the expanded sigmas
        (broadcastable to ``x``), >= 0. Both float32 (float64 if any input is float64), computed
        in that dtype (docs/architecture.md, Conventions). Autograd flows from ``v`` (and ``x``) into ``mean``.

    Raises:
        ValueError: unknown ``kind``; negative ``noise_level``; ``x`` / ``v`` shapes differ; a sigma
            does not fit ``x`` (`expand_sigma`); a stochastic step (g > 0) from sigma <= 0 (the
            drift g^2 / (2 sigma) is undefined there); see `diffusion_coefficient` for sigma == 1.

    Source: Liu et al. 2025, Flow-GRPO (Euler-Maruyama of the marginal-preserving SDE);
    Xue et al. 2025, DanceGRPO (``flux_step``); Song et al. 2021, score SDE (reverse-time SDE).
    Documentation: docs/methods/grpo.md (Exploration).
    """
    _check_kind(kind)
    _check_noise_level(noise_level)
    if x.shape != v.shape:
        raise ValueError(f"x of shape {tuple(x.shape)} and v of shape {tuple(v.shape)} must match")
    dt = compute_dtype(x, v, sigma, sigma_next)
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    s_next = expand_sigma(sigma_next, x, frame_dim, dtype=dt)
    xd = x.to(dt)
    vd = v.to(dt)
    delta = s_next - s
    if kind == "ode" or float(noise_level) == 0.0:
        std = torch.zeros(torch.broadcast_shapes(s.shape, s_next.shape), dtype=dt, device=x.device)
        return xd + delta * vd, std
    g = diffusion_coefficient(kind, s, noise_level, sigma_at_one)
    if bool((s <= 0).any()):
        raise ValueError(
            f"{kind}: a stochastic step needs sigma > 0 (the drift g^2 / (2 sigma) is undefined at sigma = 0); "
            "steps start at sigma > 0 and end at sigma_next >= 0"
        )
    eps_hat = xd + (1 - s) * vd
    mean = xd + delta * (vd + (g * g / (2 * s)) * eps_hat)
    std = g * torch.sqrt(delta.abs())
    return mean, std


def gaussian_log_prob(
    sample: torch.Tensor,
    mean: torch.Tensor,
    std: torch.Tensor | float,
    reduce: LogProbReduce = "mean",
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-density of ``sample`` under N(mean, std^2 I), reduced per sample over all non-batch dims.

    Elementwise l_j = -(sample_j - mean_j)^2 / (2 std_j^2) - log std_j - 1/2 log(2 pi), then

    * ``reduce="mean"`` (default): mean over the D latent elements. This is the reference
      convention (Flow-GRPO, DanceGRPO, BranchGRPO; docs/architecture.md, Conventions) and NOT the log-density: the
      ratio exp(l_new - l_old) is the D-th root of the true density ratio, which is why the
      published clip ranges are tiny (1e-4 .. 1e-3, 1e-5 for Flow-GRPO-Fast). Keep it so that
      reference hyperparameters carry over.
    * ``reduce="sum"``: sum over the elements, the true log-density of the step (= D x mean).

    With ``keep``, only the sampled elements count: the mean is over the kept elements of each sample and the sum
    skips the others (a conditioning frame that is given, not sampled, e.g. Wan2.2-TI2V's first latent frame, is
    not part of the policy's action).

    Callers pass a detached sample (the recorded transition) so that gradients flow only
    through ``mean`` (and ``std``).

    Args:
        sample: the drawn x', shape [B, ...].
        mean: the transition mean, shape of ``sample``.
        std: the transition std, > 0, broadcastable to ``sample`` (e.g. `step_mean_std`'s std),
            or a python float.
        reduce: "mean" or "sum" over the non-batch dims.
        keep: optional bool mask broadcastable to ``sample``, True on the sampled elements (None: all).

    Returns:
        [B] log-probabilities, float32 (float64 if any input is float64); for a 1-d ``sample``
        ([B], one element per sample) no reduction happens.

    Raises:
        ValueError: shapes of ``sample`` and ``mean`` differ or ``std`` does not broadcast to
            them; unknown ``reduce``; any std <= 0 or NaN (a deterministic step, e.g. the "ode"
            kernel or noise_level 0, has no density and cannot be scored); a ``keep`` that does not broadcast to
            ``sample`` or keeps no element of some sample.

    Source: Liu et al. 2025, Flow-GRPO (Gaussian policy of the SDE step); reduction as in
    the reference code.
    """
    if reduce not in _REDUCES:
        raise ValueError(f"unknown reduce {reduce!r}; expected one of {_REDUCES}")
    if sample.shape != mean.shape:
        raise ValueError(f"sample of shape {tuple(sample.shape)} and mean of shape {tuple(mean.shape)} must match")
    if sample.ndim == 0:
        raise ValueError("sample must have a batch dim [B, ...]")
    dt = compute_dtype(sample, mean, std)
    sd = std.to(device=sample.device, dtype=dt) if isinstance(std, torch.Tensor) else torch.tensor(
        float(std), dtype=dt, device=sample.device
    )
    try:
        shape = torch.broadcast_shapes(sample.shape, sd.shape)
    except RuntimeError as e:
        raise ValueError(f"std of shape {tuple(sd.shape)} does not broadcast to sample {tuple(sample.shape)}") from e
    if shape != sample.shape:
        raise ValueError(f"std of shape {tuple(sd.shape)} does not broadcast to sample {tuple(sample.shape)}")
    if not bool((sd > 0).all()):
        raise ValueError(
            "gaussian_log_prob needs std > 0 everywhere; a deterministic step (the 'ode' kernel, or "
            "noise_level = 0, or sigma_next == sigma) has no density and cannot be scored"
        )
    diff = sample.to(dt) - mean.to(dt)
    lp = -(diff * diff) / (2 * sd * sd) - torch.log(sd) - _HALF_LOG_2PI
    lp = lp.expand(sample.shape).reshape(sample.shape[0], -1)
    if keep is None:
        return lp.mean(dim=1) if reduce == "mean" else lp.sum(dim=1)
    k = _keep_mask(keep, sample).reshape(sample.shape[0], -1).to(lp.dtype)
    total = (lp * k).sum(dim=1)
    return total / k.sum(dim=1) if reduce == "mean" else total


def _keep_mask(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``keep`` as a bool tensor of ``like``'s shape. Raises ValueError: it does not broadcast, or a sample keeps
    nothing."""
    try:
        k = keep.to(device=like.device, dtype=torch.bool).expand(like.shape)
    except RuntimeError as e:
        raise ValueError(f"keep mask of shape {tuple(keep.shape)} does not broadcast to {tuple(like.shape)}") from e
    if not bool(k.reshape(like.shape[0], -1).any(dim=1).all()):
        raise ValueError("keep mask keeps no element of some sample: nothing of it is sampled")
    return k


def sde_step(
    kind: StepKind,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    noise: torch.Tensor | None,
    noise_level: float = 0.7,
    sigma_at_one: float | None = None,
    frame_dim: int = 1,
    reduce: LogProbReduce = "mean",
    std_scale: float = 1.0,
    keep: torch.Tensor | None = None,
) -> StepOutput:
    """One sampler step x -> x' with the step kernel ``kind``: sample = mean + std_scale * std * noise.

    The noise is drawn by the caller (from generators addressable by (seed, sample, step),
    docs/architecture.md, Seeds and noise addressing), so the step is a pure function. ``log_prob`` is
    `gaussian_log_prob` (sample.detach(), mean, std, reduce); `step_log_prob` recomputes it from
    the recorded (x, sample) with the same code, so with unchanged v the two agree bit for bit.
    Store ``sample`` as returned (float32): recasting it (e.g. to bf16) breaks the exact ratio 1.

    A deterministic step (``kind == "ode"`` or ``noise_level == 0``) returns sample = mean (the
    Euler step), std = 0 and log_prob = zeros; ``noise`` is ignored and may be None. Such steps have
    no density and must not be trained (`step_log_prob` raises on them).

    Args:
        kind: the step kernel, one of `STEP_KINDS`.
        x: latents at ``sigma``, shape [B, ...].
        v: velocity at (x, sigma), shape of ``x``.
        sigma: current noise level(s): float, 0-d, [B] or per-frame [B, T].
        sigma_next: next noise level(s), same forms.
        noise: standard normal noise, shape of ``x`` (required for a stochastic step).
        noise_level: a ("flow_grpo", default 0.7) or eta ("dance_grpo"); >= 0.
        sigma_at_one: "flow_grpo" only: the schedule's second entry (used at sigma == 1).
        frame_dim: frame dim of ``x`` for per-frame sigmas.
        reduce: log-prob reduction over the latent elements, "mean" (reference) or "sum".
        std_scale: multiplies the kernel's std (BranchGRPO's split-step noise scale kappa); the returned
            std and log_prob are those of the scaled Gaussian actually sampled.
        keep: optional bool mask broadcastable to ``x``, True on the sampled elements: the others are given (a
            conditioning frame) and stay as they are in ``x`` (no drift, no noise) and out of ``log_prob``.

    Returns:
        `StepOutput` (sample, mean, std, log_prob [B]), float32 (float64 if any input is float64).

    Raises:
        ValueError: as `step_mean_std`; ``noise`` missing or of the wrong shape for a stochastic
            step; a zero std somewhere in a stochastic step (`gaussian_log_prob`); ``std_scale <= 0``.

    Source: Liu et al. 2025, Flow-GRPO (SDE sampling step); Xue et al. 2025, DanceGRPO (``flux_step``).
    Documentation: docs/methods/grpo.md (Exploration).
    """
    if not std_scale > 0:
        raise ValueError(f"std_scale must be > 0, got {std_scale}")
    mean, std = step_mean_std(kind, x, v, sigma, sigma_next, noise_level, sigma_at_one, frame_dim)
    if std_scale != 1.0:
        std = std * std_scale
    k = None if keep is None else _keep_mask(keep, x)
    if kind == "ode" or float(noise_level) == 0.0:
        if reduce not in _REDUCES:
            raise ValueError(f"unknown reduce {reduce!r}; expected one of {_REDUCES}")
        sample = mean if k is None else torch.where(k, mean, x.to(mean.dtype))
        return StepOutput(sample, mean, std, torch.zeros(x.shape[0], dtype=mean.dtype, device=mean.device))
    if noise is None:
        raise ValueError(f"{kind}: a stochastic step needs noise of shape {tuple(x.shape)}")
    if noise.shape != x.shape:
        raise ValueError(f"noise of shape {tuple(noise.shape)} must match x of shape {tuple(x.shape)}")
    sample = mean + std * noise.to(mean.dtype)
    if k is not None:
        sample = torch.where(k, sample, x.to(sample.dtype))
    log_prob = gaussian_log_prob(sample.detach(), mean, std, reduce, k)
    return StepOutput(sample, mean, std, log_prob)


def step_log_prob(
    kind: StepKind,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    sample: torch.Tensor,
    noise_level: float = 0.7,
    sigma_at_one: float | None = None,
    frame_dim: int = 1,
    reduce: LogProbReduce = "mean",
    std_scale: float = 1.0,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probability of a recorded transition x -> sample under a (new) velocity v.

    The loss side of `sde_step`: it calls the same `step_mean_std` and `gaussian_log_prob`, so with
    the rollout's v (same weights, same device, same batch composition) it returns the rollout's
    ``log_prob`` bit for bit and the importance ratio is exactly 1 on the first update. The sample
    is detached; gradients flow through v into the mean.

    Args:
        kind: the step kernel used in the rollout (must be stochastic).
        x: latents at ``sigma`` as recorded, shape [B, ...].
        v: velocity at (x, sigma) under the current policy, shape of ``x``.
        sigma, sigma_next: the step's noise levels as in the rollout.
        sample: the recorded x' (as `sde_step` returned it), shape of ``x``.
        noise_level, sigma_at_one, frame_dim, reduce, std_scale, keep: as in the rollout.

    Returns:
        (log_prob [B], mean, std) as in `sde_step`, float32 (float64 if any input is float64).

    Raises:
        ValueError: as `step_mean_std`; ``sample`` shape differs from ``x``; a deterministic step
            ("ode" or noise_level 0), which has no density (`gaussian_log_prob`).

    Source: Liu et al. 2025, Flow-GRPO (importance ratio of the step policies). Documentation: docs/methods/grpo.md.
    """
    if sample.shape != x.shape:
        raise ValueError(f"sample of shape {tuple(sample.shape)} must match x of shape {tuple(x.shape)}")
    if not std_scale > 0:
        raise ValueError(f"std_scale must be > 0, got {std_scale}")
    mean, std = step_mean_std(kind, x, v, sigma, sigma_next, noise_level, sigma_at_one, frame_dim)
    if std_scale != 1.0:
        std = std * std_scale
    return gaussian_log_prob(sample.detach(), mean, std, reduce, keep), mean, std
