"""The Gaussian policy of a few-step consistency ("re-noise") sampler, for RL on distilled students.

Distilled few-step students (Self-Forcing, LongLive, consistency models) sample by alternating a
clean prediction and a fresh re-noising instead of integrating an ODE. With genrl's conventions
(sigma in [0, 1], 0 = data; x_sigma = (1 - sigma) x0 + sigma eps; v = eps - x0) one step j -> j+1
from x_j at sigma_j to sigma_{j+1} is

    x0_hat = x_j - sigma_j v_theta(x_j),     x_{j+1} = (1 - sigma_{j+1}) x0_hat + sigma_{j+1} eps_{j+1},

eps_{j+1} ~ N(0, I) drawn fresh. So the step is the Gaussian policy

    pi_theta(x_{j+1} | x_j) = N(mu_theta, sigma_{j+1}^2 I),   mu_theta = (1 - sigma_{j+1}) (x_j - sigma_j v_theta(x_j)),

whose std does not depend on theta. The last step to sigma = 0 returns x0_hat deterministically
and has no density. Step math in float32 (float64 kept); log-probs follow
`genrl.flow.sde.gaussian_log_prob` (mean over the latent elements by default).
"""

from __future__ import annotations

import torch

from genrl.flow.broadcast import SigmaLike, compute_dtype, expand_sigma
from genrl.flow.sde import _REDUCES, LogProbReduce, gaussian_log_prob

__all__ = ["renoise_mean", "renoise_log_prob", "renoise_log_ratio"]


def _sigmas(
    sigma: SigmaLike, sigma_next: SigmaLike, x: torch.Tensor, frame_dim: int, dt: torch.dtype, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    s = expand_sigma(sigma, x, frame_dim, dtype=dt)
    s_next = expand_sigma(sigma_next, x, frame_dim, dtype=dt)
    for name, t in (("sigma", s), ("sigma_next", s_next)):
        if not bool(((t >= 0) & (t <= 1)).all()):
            raise ValueError(f"{name} must lie in [0, 1]; got values in [{float(t.min())}, {float(t.max())}]")
    if stochastic and not bool((s_next > 0).all()):
        raise ValueError(
            f"sigma_next must be > 0 for a stochastic re-noise step, got {float(s_next.min())}: the last step "
            "to sigma = 0 returns x0_hat deterministically and has no log-probability"
        )
    return s, s_next


def renoise_mean(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Mean of one re-noise step: mu = (1 - sigma_next) (x - sigma v) = (1 - sigma_next) x0_hat.

    The sampler draws x_next = mu + sigma_next eps with eps ~ N(0, I); with sigma_next = 0 (the last
    step) mu = x0_hat is the output itself.

    Args:
        x: latents at ``sigma``, any shape [B, ...] ([B, T, C, H, W] or Wan's [B, C, T, H, W]).
        v: the model's velocity at (x, sigma), shape of ``x``, any float dtype.
        sigma: current noise level(s) in [0, 1]: float, 0-d, [B] or per-frame [B, T].
        sigma_next: next noise level(s) in [0, 1], same forms.
        frame_dim: frame dim of ``x`` for per-frame sigmas.

    Returns:
        mu, shape of ``x``, float32 (float64 if any input is float64); autograd flows from ``v`` and ``x``.

    Raises:
        ValueError: ``x`` / ``v`` shapes differ; a sigma does not fit ``x`` (`expand_sigma`) or lies
            outside [0, 1].

    Source: Song et al. 2023, consistency models (multistep sampling); Huang et al. 2025,
    Self-Forcing (few-step causal student); Wang et al. 2026, TempAct (arXiv 2606.28016,
    executor policy of the re-noising sampler).
    """
    if x.shape != v.shape:
        raise ValueError(f"x of shape {tuple(x.shape)} and v of shape {tuple(v.shape)} must match")
    dt = compute_dtype(x, v, sigma, sigma_next)
    s, s_next = _sigmas(sigma, sigma_next, x, frame_dim, dt, stochastic=False)
    return (1 - s_next) * (x.to(dt) - s * v.to(dt))


def renoise_log_prob(
    x_next: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    reduce: LogProbReduce = "mean",
    frame_dim: int = 1,
) -> torch.Tensor:
    """Log-probability of a recorded re-noise transition x -> x_next under the velocity v.

        log pi(x_next | x) = `gaussian_log_prob` (x_next, `renoise_mean` (x, v, sigma, sigma_next), sigma_next)

    i.e. per element -(x_next - mu)^2 / (2 sigma_next^2) - log sigma_next - 1/2 log(2 pi), reduced
    over the non-batch elements: "mean" (default; the Flow-GRPO convention, so the ratio is the D-th
    root of the density ratio) or "sum" (the true log-density). ``x_next`` is detached; gradients
    flow through ``v`` (and ``x``) into the mean.

    Args:
        x_next: the recorded sample at ``sigma_next``, shape of ``x``.
        x: latents at ``sigma``, shape [B, ...].
        v: velocity at (x, sigma) under the policy being scored, shape of ``x``.
        sigma: current noise level(s) in [0, 1]: float, 0-d, [B] or per-frame [B, T].
        sigma_next: next noise level(s) in (0, 1], same forms.
        reduce: "mean" or "sum" over the non-batch dims.
        frame_dim: frame dim of ``x`` for per-frame sigmas.

    Returns:
        [B] log-probabilities, float32 (float64 if any input is float64).

    Raises:
        ValueError: shapes of ``x_next``, ``x``, ``v`` differ; unknown ``reduce``; a sigma does not
            fit ``x`` or lies outside [0, 1]; any sigma_next <= 0 (the message gives the value: the
            last step to x0 is deterministic and has no log-probability).

    Source: Wang et al. 2026, TempAct (arXiv 2606.28016; ``compute_log_prob_self_forcing.py`` of
    jingw193/TempAct computes this per-element density); Liu et al. 2025, Flow-GRPO (reduction).
    """
    if reduce not in _REDUCES:
        raise ValueError(f"unknown reduce {reduce!r}; expected one of {_REDUCES}")
    if x_next.shape != x.shape:
        raise ValueError(f"x_next of shape {tuple(x_next.shape)} must match x of shape {tuple(x.shape)}")
    if x.shape != v.shape:
        raise ValueError(f"x of shape {tuple(x.shape)} and v of shape {tuple(v.shape)} must match")
    dt = compute_dtype(x_next, x, v, sigma, sigma_next)
    s, s_next = _sigmas(sigma, sigma_next, x, frame_dim, dt, stochastic=True)
    mean = (1 - s_next) * (x.to(dt) - s * v.to(dt))
    return gaussian_log_prob(x_next.detach().to(dt), mean, s_next, reduce)


def renoise_log_ratio(
    eps: torch.Tensor,
    v: torch.Tensor,
    v_old: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    normalized: bool = False,
    reduce: LogProbReduce = "mean",
    frame_dim: int = 1,
) -> torch.Tensor:
    """Per-sample log importance ratio of a re-noise step, from the noise the old policy drew.

    The rollout drew x_next = mu_old + sigma_next eps. Both policies have std sigma_next, so the
    log sigma terms cancel and, with d = mu_theta - mu_old = -(1 - sigma_next) sigma (v - v_old),

        log pi_theta(x_next|x) - log pi_old(x_next|x)
          = [(x_next - mu_old)^2 - (x_next - mu_theta)^2] / (2 sigma_next^2)
          = [sigma_next^2 eps^2 - (sigma_next eps - d)^2] / (2 sigma_next^2)
          = eps d / sigma_next - d^2 / (2 sigma_next^2),

    elementwise, then reduced over the non-batch elements ("mean" by default, as
    `renoise_log_prob`; the result equals renoise_log_prob(theta) - renoise_log_prob(old) for that
    x_next, without forming x_next). This is ``normalized=False``.

    ``normalized=True`` returns TempAct's ratio-normalised form: the linear term alone, rescaled by
    sigma_next / ((1 - sigma_next) sigma), which removes the step-size factor from the ratio:

        eps d / sigma_next * sigma_next / ((1 - sigma_next) sigma) = -eps (v - v_old),

    reduced the same way. The quadratic term -d^2 / (2 sigma_next^2) is dropped (it is second order
    in v - v_old; its gradient vanishes at v = v_old, where the ratio is 1). Both forms are exactly 0
    when v == v_old, and their gradients w.r.t. v there are proportional. ``eps`` and ``v_old`` are
    treated as constants (detached); gradients flow through ``v``.

    Args:
        eps: the standard normal noise of the rollout step, shape [B, ...].
        v: velocity at (x, sigma) under the current policy (with grad), shape of ``eps``.
        v_old: velocity at (x, sigma) of the rollout policy, shape of ``eps``.
        sigma: current noise level(s) in [0, 1]: float, 0-d, [B] or per-frame [B, T].
        sigma_next: next noise level(s) in (0, 1], same forms.
        normalized: return the normalised linear form -reduce(eps (v - v_old)).
        reduce: "mean" or "sum" over the non-batch dims.
        frame_dim: frame dim of ``eps`` for per-frame sigmas.

    Returns:
        [B] log ratios, float32 (float64 if any input is float64).

    Raises:
        ValueError: shapes of ``eps``, ``v``, ``v_old`` differ or lack a batch dim; unknown
            ``reduce``; a sigma does not fit or lies outside [0, 1]; any sigma_next <= 0 (the
            message gives the value).

    Source: Wang et al. 2026, TempAct (arXiv 2606.28016), executor ratio of the re-noising sampler;
    Schulman et al. 2017, PPO (importance ratio).
    """
    if reduce not in _REDUCES:
        raise ValueError(f"unknown reduce {reduce!r}; expected one of {_REDUCES}")
    if not eps.shape == v.shape == v_old.shape:
        raise ValueError(
            f"eps {tuple(eps.shape)}, v {tuple(v.shape)} and v_old {tuple(v_old.shape)} must have the same shape"
        )
    if eps.ndim == 0:
        raise ValueError("eps must have a batch dim [B, ...]")
    dt = compute_dtype(eps, v, v_old, sigma, sigma_next)
    s, s_next = _sigmas(sigma, sigma_next, eps, frame_dim, dt, stochastic=True)
    e = eps.detach().to(dt)
    dv = v.to(dt) - v_old.detach().to(dt)
    if normalized:
        per = -(e * dv)
    else:
        d = -(1 - s_next) * s * dv
        per = e * d / s_next - d * d / (2 * s_next * s_next)
    per = per.expand(eps.shape).reshape(eps.shape[0], -1)
    return per.mean(dim=1) if reduce == "mean" else per.sum(dim=1)
