"""Forward-process RL losses: one advantage-weighted flow-matching core for RAM, AWM and DiffusionNFT.

RAM, AWM and DiffusionNFT all train a flow-matching policy on its own clean samples x0 re-noised at a
fresh (t, eps): x_t = (1 - t) x0 + t eps, with the velocity target u = eps - x0 (Y in the RAM paper).
They differ only in how the per-sample squared velocity error is weighted and anchored. This module holds
the shared core and the three objectives built on it:

* `sample_mse`: THE core, each sample's mean squared error (v - target)^2 over its (masked-in) elements [B]
  (defined in `genrl.flow.fm_core`, below this module and `genrl.flow.nft`, and re-exported here).
* `advantage_weighted_fm_loss`: mean_b w_b sample_mse(v, u)_b, advantage-weighted flow matching.
* `sample_timesteps`: addressed training-time draws of t (p(t) ∝ t^alpha, uniform, logit-normal, a grid).
* `ram_target` / `ram_loss`: Reinforce Adjoint Matching as released (regression onto v_ref + m A (u - v_old)).
* `awm_weight` / `awm_loss`: Advantage Weighted Matching (PPO on log p = -w(t, l), l the FM error).
* `nft_loss` / `advantage_to_r`: DiffusionNFT, defined in `genrl.flow.nft` (which builds on this core) and
  re-exported here so that one import site serves all three objectives.
* `velocity_monitors`: the failure-mode monitors of docs/methods/forward_rl.md (Monitors).

How they relate (tested in tests/test_flow_forward_rl.py): with v_old = sg(v_theta), the gradient of
`ram_loss` equals m times the gradient of on-policy, unclipped, uniform-weight AWM with its reference
anchor at beta = 1 / m (RAM = advantage-weighted FM + anchor); DiffusionNFT's velocity-form update at
theta = theta_old is advantage-weighted FM with weights clip(A, -C, C) = C (2 r - 1).

Conventions (docs/architecture.md): t = sigma in [0, 1] (0 = data, 1 = noise), velocity v = eps - x0. Velocities
are latents of any shape [B, ...]: [B, T, C, H, W] (``frame_dim=1``) or Wan's [B, C, T, H, W]
(``frame_dim=2``); an optional per-frame mask is [B, T] with T on ``frame_dim``. Per-sample values
(advantages, t, losses) are [B]. Math runs in float32, or float64 when an input is float64.
Documentation: docs/methods/forward_rl.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from genrl.flow.broadcast import _expand, compute_dtype
from genrl.flow.fm_core import _check_nonnegative, _check_per_sample, _check_positive, _check_same_shape, sample_mse
from genrl.flow.nft import advantage_to_r, nft_loss
from genrl.flow.schedules import shift_sigmas
from genrl.noise import rand_per_sample

__all__ = [
    "AWM_EPS",
    "AWM_WEIGHTINGS",
    "AwmWeighting",
    "TIMESTEP_DENSITIES",
    "TimestepDensity",
    "sample_mse",
    "advantage_weighted_fm_loss",
    "sample_timesteps",
    "ram_target",
    "ram_loss",
    "awm_weight",
    "awm_loss",
    "nft_loss",
    "advantage_to_r",
    "velocity_monitors",
    "ForwardRLObjective",
]

AwmWeighting = Literal["uniform", "t", "t2", "huber", "ghuber"]
AWM_WEIGHTINGS: tuple[str, ...] = ("uniform", "t", "t2", "huber", "ghuber")

TimestepDensity = Literal["uniform", "linear", "power", "logit_normal", "grid"]
TIMESTEP_DENSITIES: tuple[str, ...] = ("uniform", "linear", "power", "logit_normal", "grid")

AWM_EPS = 1e-10
"""The offset eps of AWM's huber / ghuber weightings, (l + eps)^p - eps^p (the reference's value)."""


# --------------------------------------------------------------------------------------------
# validation (the shared checks live in genrl.flow.fm_core)
# --------------------------------------------------------------------------------------------


def _check_multiplier(multiplier: float) -> float:
    if isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)):
        raise TypeError(f"multiplier must be a python float, got {type(multiplier).__name__}")
    if not (math.isfinite(multiplier) and multiplier > 0):
        raise ValueError(
            f"multiplier m must be a finite number > 0 (RAM's reward_multiplier: 100 for GenEval / OCR, "
            f"1000 for PickScore), got {multiplier!r}"
        )
    return float(multiplier)


def advantage_weighted_fm_loss(
    v: torch.Tensor,
    u: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Advantage-weighted flow matching: L = mean_b w_b * sample_mse(v, u)_b.

    With w_b = 1 it is the plain flow-matching loss on the policy's own samples; with signed w_b (an
    advantage) it pulls the velocity towards the targets of good samples and pushes it away from those
    of bad ones (dL/dv_b = 2 w_b (v_b - u_b) / (B N_b), N_b the sample's element count). Both RAM and
    DiffusionNFT reduce to this update at theta = theta_old (see the module docstring). ``u`` and
    ``weights`` are detached.

    Args:
        v: policy velocity with graph, [B, ...].
        u: velocity target eps - x0, same shape.
        weights: [B] finite per-sample weights (e.g. advantages, or C (2 r - 1) for NFT).
        mask: optional per-frame mask [B, T]; frame_dim: frame dim of the latents.

    Returns:
        0-d tensor, float32 (float64 when an input is float64), differentiable w.r.t. v.

    Raises:
        ValueError: shapes differ, ``weights`` is not [B] or holds NaN / inf, or the mask is bad.

    Source: advantage-weighted regression (Peng et al. 2019) applied to flow matching as in AWM
    (Xue et al. 2025, arXiv 2509.25050, the uniform-weight on-policy gradient); docs/methods/forward_rl.md (AWM).
    """
    _check_same_shape("v", v, u=u)
    w = _check_per_sample("weights", weights, v.shape[0])
    ell = sample_mse(v, u.detach(), mask, frame_dim)
    dt = compute_dtype(ell, w)
    return (w.to(device=ell.device, dtype=dt) * ell.to(dt)).mean()


# --------------------------------------------------------------------------------------------
# training-time timesteps
# --------------------------------------------------------------------------------------------


def _restricted(inv_cdf_lo: float, inv_cdf_hi: float, u: torch.Tensor) -> torch.Tensor:
    return inv_cdf_lo + u * (inv_cdf_hi - inv_cdf_lo)


def sample_timesteps(
    n: int,
    seed: int,
    indices: Sequence[int] | torch.Tensor,
    step: int = 0,
    density: TimestepDensity = "linear",
    alpha: float = 1.0,
    t_min: float = 0.0,
    t_max: float = 1.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 1.0,
    grid: Sequence[float] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Training-time t in [t_min, t_max], one per sample, addressed by (seed, sample index, step).

    Each sample draws one uniform U in [0, 1) from its own generator (`genrl.noise.rand_per_sample`
    with (seed, indices[i], step)), so a sample's t does not depend on the batch it is in; use ``step``
    to address the k-th of K fresh (t, eps) draws per endpoint (RAM: K = 8). U is mapped by an inverse CDF:

    * ``"linear"``: p(t) ∝ t on [0, 1] (RAM as released; biased to noise), i.e. ``"power"`` with alpha = 1;
    * ``"power"``: p(t) ∝ t^alpha (alpha > -1), CDF t^(alpha + 1), so t = U^(1 / (alpha + 1));
    * ``"uniform"``: p(t) = 1;
    * ``"logit_normal"``: t = sigmoid(logit_mean + logit_std * Phi^-1(U)) (SD3, Esser et al. 2024 eq. 19);
    * ``"grid"``: one of the given sigma-grid values (those in [t_min, t_max]), each with probability
      1 / their count (DiffusionNFT / AWM train on the sampler grid). Duplicated grid values weigh more.

    then by the optional timestep shift t' = s t / (1 + (s - 1) t) (SD3 §5.3.2). The range restriction
    applies to the final (shifted) t: the draw is the shifted density conditioned on [t_min, t_max],
    computed exactly by restricting U to [F(shift^-1(t_min)), F(shift^-1(t_max))] (F the base CDF), so no
    draw is clamped or rejected. Math in float64, returned as float32.

    Args:
        n: number of draws, must equal len(indices).
        seed: base seed (mix in the iteration / stream first: docs/architecture.md, Seeds and noise addressing).
        indices: the samples' global indices, length n.
        step: draw number (RAM: 0..K-1).
        density: "linear" (default), "power", "uniform", "logit_normal" or "grid".
        alpha: exponent of "power" (> -1); must be 1 for "linear".
        t_min, t_max: range, 0 <= t_min < t_max <= 1.
        logit_mean, logit_std: the normal before the sigmoid ("logit_normal"; logit_std > 0).
        shift: timestep shift s > 0 (1 = none); must be 1 for "grid" (the grid is already shifted).
        grid: the sigma values of "grid" (e.g. the rollout schedule without its final 0), each in [0, 1].

    Returns:
        float32 [n] on the CPU, in [t_min, t_max].

    Raises:
        ValueError: n != len(indices), t_min >= t_max or outside [0, 1], alpha <= -1 (or != 1 for
            "linear"), logit_std <= 0, shift <= 0, unknown density, "grid" without a (non-empty) grid or
            with no grid value in range or with shift != 1, or a grid given for another density.

    Source: RAM (Bergmeister et al. 2026, arXiv 2605.10759) p(t) ∝ t, K = 8 draws per endpoint
    (docs/methods/forward_rl.md, Training-time timesteps); logit-normal / shift from Esser et al. 2024; grid
    timesteps from DiffusionNFT ``train_nft_sd3.py`` and AWM ``train_sd3_awm.py``.
    """
    if density not in TIMESTEP_DENSITIES:
        raise ValueError(f"unknown timestep density {density!r}; expected one of {TIMESTEP_DENSITIES}")
    idx = indices.detach().cpu().reshape(-1).tolist() if isinstance(indices, torch.Tensor) else list(indices)
    if isinstance(n, bool) or not isinstance(n, int) or n != len(idx):
        raise ValueError(f"n must equal len(indices) = {len(idx)}, got n = {n!r}")
    for name, value in (("t_min", t_min), ("t_max", t_max)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    if not t_min < t_max:
        raise ValueError(f"need t_min < t_max, got t_min = {t_min}, t_max = {t_max}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= -1:
        raise ValueError(f"alpha must be a finite number > -1 (p(t) ∝ t^alpha must be integrable), got {alpha!r}")
    if density == "linear" and alpha != 1:
        raise ValueError(f"density 'linear' is p(t) ∝ t (alpha = 1), got alpha = {alpha}; use density='power'")
    s = _check_positive("shift", shift)
    _check_positive("logit_std", logit_std)
    if not (isinstance(logit_mean, (int, float)) and math.isfinite(logit_mean)):
        raise ValueError(f"logit_mean must be a finite number, got {logit_mean!r}")
    if density == "grid":
        if grid is None or len(grid) == 0:
            raise ValueError("density 'grid' needs a non-empty grid of sigma values (e.g. the rollout schedule)")
        if s != 1.0:
            raise ValueError(f"density 'grid' draws the grid's own (already shifted) values; got shift = {shift}")
    elif grid is not None:
        raise ValueError(f"a grid was given but density is {density!r}; use density='grid' or drop the grid")

    u = rand_per_sample((), seed, idx, step).to(torch.float64) if idx else torch.zeros(0, dtype=torch.float64)

    if density == "grid":
        g = torch.as_tensor(grid, dtype=torch.float64).reshape(-1).cpu()
        if not bool(torch.isfinite(g).all()) or bool(((g < 0) | (g > 1)).any()):
            raise ValueError(f"grid values must lie in [0, 1], got {g.tolist()[:8]}")
        g = g[(g >= t_min) & (g <= t_max)]
        if g.numel() == 0:
            raise ValueError(f"no grid value lies in [t_min, t_max] = [{t_min}, {t_max}]")
        pick = (u * g.numel()).floor().long().clamp_(0, g.numel() - 1)
        return g[pick].to(torch.float32)

    # the base (pre-shift) range whose image under the shift is [t_min, t_max]
    lo, hi = float(t_min), float(t_max)
    if s != 1.0:
        lo, hi = shift_sigmas(lo, 1.0 / s), shift_sigmas(hi, 1.0 / s)
    if density == "uniform":
        t = _restricted(lo, hi, u)
    elif density in ("linear", "power"):
        k = float(alpha) + 1.0
        t = _restricted(lo**k, hi**k, u).pow(1.0 / k)
    else:  # logit_normal
        mu, sd = float(logit_mean), float(logit_std)
        ends = torch.tensor([lo, hi], dtype=torch.float64)
        cdf = torch.special.ndtr((torch.logit(ends) - mu) / sd)
        t = torch.sigmoid(mu + sd * torch.special.ndtri(_restricted(float(cdf[0]), float(cdf[1]), u)))
    if s != 1.0:
        t = shift_sigmas(t, s)
    return t.clamp(float(t_min), float(t_max)).to(torch.float32)


# --------------------------------------------------------------------------------------------
# RAM
# --------------------------------------------------------------------------------------------


def ram_target(
    v_ref: torch.Tensor,
    v_old: torch.Tensor,
    u: torch.Tensor,
    advantages: torch.Tensor,
    multiplier: float,
    frame_dim: int = 1,
) -> torch.Tensor:
    """RAM's regression target v_ref + m A (u - v_old), detached.

    The reference velocity plus the reward-signed step from the old policy's velocity towards the
    sample's own velocity target u = eps - x0. m A plays r / lambda of the KL-regularised objective
    (effective lambda ~ std(r) / m); |m A| > 1 extrapolates past u by design. A is broadcast per
    sample; no clipping (the release does not clip).

    Args:
        v_ref: frozen reference (base) velocity at x_t, [B, ...].
        v_old: old (lagged-EMA, rollout) policy velocity at x_t, same shape.
        u: velocity target eps - x0, same shape.
        advantages: A [B], finite (group-centred rewards; the method handles NaN rewards).
        multiplier: m > 0 (RAM's ``reward_multiplier``: 100 GenEval / OCR, 1000 PickScore).
        frame_dim: frame dim of the latents (only for the error messages of the broadcast).

    Returns:
        Tensor of v_ref's shape, float32 (float64 when an input is float64), detached.

    Raises:
        ValueError: shapes differ, A is not [B] or holds NaN / inf, m is not a finite number > 0.

    Source: RAM (Bergmeister, Jegelka, Nüsken, Domingo-Enrich, Pidstrigach 2026, arXiv 2605.10759)
    Eq. 17 as released in ``scripts/training_sd3.py`` (v_old from the lagged EMA, m A for r);
    docs/methods/forward_rl.md (RAM).
    """
    _check_same_shape("v_ref", v_ref, v_old=v_old, u=u)
    m = _check_multiplier(multiplier)
    a = _check_per_sample("advantages", advantages, v_ref.shape[0], "; drop those samples (NaN rewards)")
    dt = compute_dtype(v_ref, v_old, u, advantages)
    with torch.no_grad():
        a_e = _expand(a, v_ref, frame_dim, "advantages", dt)
        return v_ref.detach().to(dt) + (m * a_e) * (u.detach().to(dt) - v_old.detach().to(dt))


def ram_loss(
    v_theta: torch.Tensor,
    v_ref: torch.Tensor,
    v_old: torch.Tensor,
    u: torch.Tensor,
    advantages: torch.Tensor,
    multiplier: float,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """RAM loss as released: L = mean_b sample_mse(v_theta, sg[v_ref + m A (u - v_old)])_b.

    Plain MSE onto a stop-gradient target, no explicit KL term (the anchor v_ref is inside the target).
    Without a mask this equals the reference's mean over all elements. Properties (tested):

    * with v_old = sg(v_theta) the gradient equals m * the gradient of `awm_loss` with uniform weight,
      on-policy, unclipped, unscaled advantages and the reference anchor at beta = 1 / m;
    * A = 0 and v_theta = v_ref give loss and gradient exactly 0;
    * the gradient is affine in A (multi-reward advantages add);
    * in the Gaussian population limit the fixed point reproduces the exact tilt of a linear reward and
      under-tilts a concave one, accurate to first order (docs/methods/forward_rl.md, Invariants tested).

    Args:
        v_theta: current policy velocity at x_t, with graph, [B, ...].
        v_ref, v_old, u, advantages, multiplier: see `ram_target` (all detached).
        mask: optional per-frame mask [B, T]; frame_dim: frame dim of the latents.

    Returns:
        0-d tensor >= 0, float32 (float64 when an input is float64), differentiable w.r.t. v_theta only.

    Raises:
        ValueError: as `ram_target`, plus a bad mask.

    Source: RAM (arXiv 2605.10759) Eq. 17, ``scripts/training_sd3.py`` via its ports
    (docs/methods/forward_rl.md, RAM).
    """
    _check_same_shape("v_theta", v_theta, v_ref=v_ref, v_old=v_old, u=u)
    target = ram_target(v_ref, v_old, u, advantages, multiplier, frame_dim)
    return sample_mse(v_theta, target, mask, frame_dim).mean()


# --------------------------------------------------------------------------------------------
# AWM
# --------------------------------------------------------------------------------------------


def awm_weight(
    ell: torch.Tensor,
    t: torch.Tensor | float,
    weighting: AwmWeighting = "uniform",
    p: float = 0.25,
    eps: float = AWM_EPS,
    huber_delta: float | None = None,
) -> torch.Tensor:
    """AWM's weighted flow-matching error w(t, l); the AWM log-likelihood surrogate is log p = -w.

    * ``"uniform"``: l;  ``"t"``: t l;  ``"t2"``: t^2 l;
    * ``"huber"``: t (sqrt(l + delta^2) - delta), a pseudo-Huber in sqrt(l) (the reference's
      t (sqrt(l + 1e-10) - 1e-5): delta = sqrt(eps) by default);
    * ``"ghuber"``: (t / p) ((l + eps)^p - eps^p), the generalised Huber (reference default, p = 0.25).

    All vanish at l = 0 and increase with l; ghuber with p = 1 is ``"t"`` and huber is ghuber(p = 1/2) / 2.
    Differentiable w.r.t. ``ell``.

    Args:
        ell: the per-sample flow-matching error l = `sample_mse` (v, u), [B], >= 0.
        t: the samples' noise level, [B] or a python float / 0-d tensor, in [0, 1]; detached.
        weighting: "uniform", "t", "t2", "huber" or "ghuber".
        p: ghuber power, > 0 (reference 0.25).
        eps: offset of huber / ghuber, > 0 (reference 1e-10).
        huber_delta: delta of "huber" (> 0); None uses sqrt(eps) (the reference).

    Returns:
        w [B], in ell's dtype rules (float32, or float64 for float64 inputs).

    Raises:
        ValueError: unknown weighting, p / eps / huber_delta not a finite number > 0, ell not [B] or
            negative / NaN, t not [B] (or scalar) or outside [0, 1].

    Source: AWM (Xue, Ge, Zhang, Li, Ma 2025, arXiv 2509.25050), ``scripts/train_sd3_awm.py``
    ``compute_log_prob_awm`` weightings; docs/methods/forward_rl.md (AWM).
    """
    if weighting not in AWM_WEIGHTINGS:
        raise ValueError(f"unknown AWM weighting {weighting!r}; expected one of {AWM_WEIGHTINGS}")
    p = _check_positive("p", p)
    eps = _check_positive("eps", eps)
    if not isinstance(ell, torch.Tensor):
        raise TypeError(f"ell must be a torch.Tensor [B], got {type(ell).__name__}")
    if ell.ndim != 1 or ell.numel() == 0:
        raise ValueError(f"ell must be the per-sample error [B], got shape {tuple(ell.shape)}")
    if bool((torch.isnan(ell.detach()) | (ell.detach() < 0)).any()):
        raise ValueError("ell must be a non-negative per-sample squared error (got NaN or a negative value)")
    dt = compute_dtype(ell, t)
    if isinstance(t, torch.Tensor):
        tt = t.detach().to(device=ell.device, dtype=dt)
        if tt.ndim > 1 or (tt.ndim == 1 and tt.shape != ell.shape):
            raise ValueError(f"t must be [B] = [{ell.shape[0]}] or a scalar, got shape {tuple(t.shape)}")
    elif isinstance(t, (int, float)) and not isinstance(t, bool):
        tt = torch.tensor(float(t), dtype=dt, device=ell.device)
    else:
        raise TypeError(f"t must be a torch.Tensor [B] or a python float, got {type(t).__name__}")
    if not bool(((tt >= 0) & (tt <= 1)).all()):
        raise ValueError(f"t must lie in [0, 1], got values in [{float(tt.min())}, {float(tt.max())}] or NaN")
    x = ell.to(dt)
    if weighting == "uniform":
        return x
    if weighting == "t":
        return tt * x
    if weighting == "t2":
        return tt.square() * x
    if weighting == "huber":
        delta = math.sqrt(eps) if huber_delta is None else _check_positive("huber_delta", huber_delta)
        return tt * (torch.sqrt(x + delta * delta) - delta)
    return (tt / p) * ((x + eps).pow(p) - eps**p)


def awm_loss(
    v_theta: torch.Tensor,
    u: torch.Tensor,
    t: torch.Tensor | float,
    advantages: torch.Tensor,
    weighting: AwmWeighting = "ghuber",
    log_p_old: torch.Tensor | None = None,
    clip_range: float | None = None,
    adv_clip: float = 5.0,
    v_ref: torch.Tensor | None = None,
    beta: float = 0.0,
    v_ema: torch.Tensor | None = None,
    beta_ema: float = 0.0,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
    p: float = 0.25,
    *,
    adv_scale: bool = True,
    eps: float = AWM_EPS,
    huber_delta: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM loss: PPO on the flow-matching log-likelihood surrogate log p = -w(t, l), plus anchors.

    With l_b = sample_mse(v_theta, u)_b and log p_b = -`awm_weight` (l_b, t_b):

        ratio_b = exp(log p_b - sg(log p_old_b))          (log p_old = sg(log p) when None: ratio 1)
        A_b     = clip(A_b, -adv_clip, adv_clip) [/ adv_clip if adv_scale]
        policy  = mean_b max(-A_b ratio_b, -A_b clip(ratio_b, 1 - e, 1 + e))   (e = clip_range; None: -A ratio)
        loss    = policy + beta * mean_b sample_mse(v_theta, v_ref) + beta_ema * mean_b sample_mse(v_theta, v_ema)

    On-policy (ratio 1) the policy gradient is mean_b A_b grad w_b: advantage-weighted flow matching
    with the weighting w. A sample whose ratio left [1 - e, 1 + e] in the direction its advantage
    pushes gets zero policy gradient (the PPO clip). The reference scales A to [-1, 1] (its
    ``advantage_max = 1``); ``adv_scale=False`` keeps the clipped A (for the RAM equivalence).

    Args:
        v_theta: current policy velocity at x_t, with graph, [B, ...].
        u: velocity target eps - x0, same shape; detached.
        t: noise level [B] (or a scalar) in [0, 1].
        advantages: A [B], finite.
        weighting: see `awm_weight` (reference default "ghuber"; the paper reports "uniform" works too).
        log_p_old: [B] old-policy log p (off-policy: -awm_weight(sample_mse(v_old, u), t) with the same
            weighting); None = on-policy.
        clip_range: PPO epsilon > 0 (reference 1.0); None = unclipped.
        adv_clip: advantage clip > 0 (reference 5); may be ``math.inf`` when ``adv_scale`` is False.
        v_ref, beta: frozen reference velocity and its anchor weight >= 0 (reference 1e-4 .. 3e-3).
        v_ema, beta_ema: EMA (old) policy velocity and its anchor weight >= 0 (reference 1).
        mask, frame_dim: optional per-frame mask [B, T] and the frame dim of the latents.
        p: ghuber power (> 0). adv_scale: divide the clipped A by adv_clip. eps, huber_delta: see `awm_weight`.

    Returns:
        (loss, stats): loss is 0-d, float32 (float64 when an input is float64), differentiable w.r.t.
        v_theta only; stats holds detached 0-d tensors "policy_loss", "kl_ref", "kl_ema", "fm_mse"
        (mean l), "ratio_mean", "clip_frac" (fraction with |ratio - 1| > e; 0 when unclipped) and
        "adv_abs_mean" (mean |A| after clip / scale).

    Raises:
        ValueError: shapes differ, A / log_p_old not [B] or not finite, clip_range / adv_clip not > 0,
            adv_scale with an infinite adv_clip, beta / beta_ema < 0, beta > 0 without v_ref (or
            beta_ema > 0 without v_ema), plus `awm_weight`'s errors.

    Source: AWM (Xue et al. 2025, arXiv 2509.25050), ``scripts/train_sd3_awm.py`` (loss_type
    ``exp_first``: one ratio per (t, sample) row) and ``config/dgx_awm.py``; docs/methods/forward_rl.md (AWM).
    """
    _check_same_shape("v_theta", v_theta, u=u)
    b = v_theta.shape[0]
    a = _check_per_sample("advantages", advantages, b, "; drop those samples (NaN rewards)")
    if isinstance(adv_clip, bool) or not isinstance(adv_clip, (int, float)) or math.isnan(adv_clip) or adv_clip <= 0:
        raise ValueError(f"adv_clip must be a number > 0 (math.inf allowed without adv_scale), got {adv_clip!r}")
    if adv_scale and not math.isfinite(adv_clip):
        raise ValueError("adv_scale divides A by adv_clip, which must then be finite; pass adv_scale=False")
    if clip_range is not None:
        clip_range = _check_positive("clip_range", clip_range)
    beta = _check_nonnegative("beta", beta)
    beta_ema = _check_nonnegative("beta_ema", beta_ema)
    if beta > 0 and v_ref is None:
        raise ValueError(f"beta = {beta} > 0 needs v_ref (the frozen reference velocity)")
    if beta_ema > 0 and v_ema is None:
        raise ValueError(f"beta_ema = {beta_ema} > 0 needs v_ema (the EMA policy velocity)")
    if v_ref is not None:
        _check_same_shape("v_theta", v_theta, v_ref=v_ref)
    if v_ema is not None:
        _check_same_shape("v_theta", v_theta, v_ema=v_ema)

    dt = compute_dtype(v_theta, u, t, advantages, log_p_old, v_ref, v_ema)
    ell = sample_mse(v_theta, u.detach(), mask, frame_dim).to(dt)
    log_p = -awm_weight(ell, t, weighting, p=p, eps=eps, huber_delta=huber_delta)
    if log_p_old is None:
        old = log_p.detach()
    else:
        old = _check_per_sample("log_p_old", log_p_old, b).to(device=log_p.device)
    ratio = torch.exp(log_p - old)

    adv = a.to(device=log_p.device, dtype=dt).clamp(-float(adv_clip), float(adv_clip))
    if adv_scale:
        adv = adv / float(adv_clip)
    unclipped = -adv * ratio
    if clip_range is None:
        per_sample = unclipped
        clip_frac = torch.zeros((), dtype=dt, device=log_p.device)
    else:
        clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
        per_sample = torch.maximum(unclipped, clipped)
        clip_frac = ((ratio.detach() - 1.0).abs() > clip_range).to(dt).mean()
    policy = per_sample.mean()

    zero = torch.zeros((), dtype=dt, device=log_p.device)
    kl_ref = sample_mse(v_theta, v_ref.detach(), mask, frame_dim).mean().to(dt) if v_ref is not None else zero
    kl_ema = sample_mse(v_theta, v_ema.detach(), mask, frame_dim).mean().to(dt) if v_ema is not None else zero
    loss = policy
    if beta > 0:
        loss = loss + beta * kl_ref
    if beta_ema > 0:
        loss = loss + beta_ema * kl_ema
    stats = {
        "policy_loss": policy.detach(),
        "kl_ref": kl_ref.detach(),
        "kl_ema": kl_ema.detach(),
        "fm_mse": ell.detach().mean(),
        "ratio_mean": ratio.detach().mean(),
        "clip_frac": clip_frac,
        "adv_abs_mean": adv.abs().mean(),
    }
    return loss, stats


# --------------------------------------------------------------------------------------------
# monitors
# --------------------------------------------------------------------------------------------


def velocity_monitors(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor,
    u: torch.Tensor,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> dict[str, float]:
    """The failure-mode monitors of forward-process RL (docs/methods/forward_rl.md, Monitors), as python floats.

    * ``"v_ref_mse"``: mean_b sample_mse(v_theta, v_ref), the drift from the reference;
    * ``"v_old_mse"``: mean_b sample_mse(v_theta, v_old), the lag behind the rollout policy;
    * ``"v_norm_ratio"``: ||v_theta|| / ||v_ref|| over the batch (root-mean-square norms; norm inflation,
      NormGuard arXiv 2606.27771; inf when v_ref is all zero and v_theta is not, 1 when both are);
    * ``"fm_mse_old"``: mean_b sample_mse(v_old, u), the old policy's flow-matching error on its own
      rollouts: self-inconsistency; its excess over the value at initialisation estimates ||u - v_old||^2,
      the quantity whose growth precedes RAM's divergence;
    * ``"fm_mse_theta"`` / ``"fm_mse_ref"``: the same error of v_theta and of v_ref.

    No gradient; computed in float64 (so bf16 / fp32 inputs lose nothing in the reduction).

    Args:
        v_theta, v_old, v_ref, u: velocities and target at the same x_t, same shape [B, ...].
        mask, frame_dim: optional per-frame mask [B, T] and the frame dim of the latents.

    Returns:
        dict of the six floats above.

    Raises:
        ValueError / TypeError: shapes differ or an input is not a tensor; a bad mask.

    Source: docs/methods/forward_rl.md (Monitors; Known limits: the lagged-velocity instability).
    """
    _check_same_shape("v_theta", v_theta, v_old=v_old, v_ref=v_ref, u=u)
    with torch.no_grad():
        f = [x.detach().to(torch.float64) for x in (v_theta, v_old, v_ref, u)]
        vt, vo, vr, uu = f

        def mse(a: torch.Tensor, b: torch.Tensor) -> float:
            return float(sample_mse(a, b, mask, frame_dim).mean())

        zeros = torch.zeros_like(vt)
        norm_t, norm_r = mse(vt, zeros), mse(vr, zeros)
        ratio = math.sqrt(norm_t / norm_r) if norm_r > 0 else (math.inf if norm_t > 0 else 1.0)
        return {
            "v_ref_mse": mse(vt, vr),
            "v_old_mse": mse(vt, vo),
            "v_norm_ratio": ratio,
            "fm_mse_old": mse(vo, uu),
            "fm_mse_theta": mse(vt, uu),
            "fm_mse_ref": mse(vr, uu),
        }


# --------------------------------------------------------------------------------------------
# one objective, three losses
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForwardRLObjective:
    """The loss of one forward-process RL unit, chosen among RAM, DiffusionNFT and AWM with their settings.

    Attributes:
        objective: ``"ram"`` (:func:`ram_loss`, multiplier m > 0), ``"nft"`` (:func:`nft_loss` with r = 1/2 +
            clip(A, -C, C) / (2C), + ``kl_beta`` ||v - v_ref||^2) or ``"awm"`` (:func:`awm_loss`, log p_old from
            v_old, + ``kl_beta`` / ``ema_kl_beta`` anchors).
        multiplier: RAM's m; nft_beta / nft_clip / nft_adaptive: DiffusionNFT's beta, C and x0-space weighting;
        awm_weighting / awm_p / awm_clip_range / awm_adv_clip: AWM's w(t, l), exponent, PPO clip, advantage clip;
        kl_beta: reference anchor of NFT / AWM (RAM's anchor is in its target); ema_kl_beta: AWM's anchor to v_old.
    Raises:
        ValueError: an unknown objective, m not finite or <= 0, a negative anchor weight (each names the value).
    """

    objective: Literal["ram", "nft", "awm"] = "ram"
    multiplier: float = 100.0
    nft_beta: float = 1.0
    nft_clip: float = 5.0
    nft_adaptive: bool = True
    awm_weighting: AwmWeighting = "ghuber"
    awm_p: float = 0.25
    awm_clip_range: float | None = None
    awm_adv_clip: float = 5.0
    kl_beta: float = 0.0
    ema_kl_beta: float = 0.0

    def __post_init__(self) -> None:
        if self.objective not in ("ram", "nft", "awm"):
            raise ValueError(f"objective must be 'ram', 'nft' or 'awm', got {self.objective!r}")
        m = self.multiplier
        if not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
            raise ValueError(f"multiplier m must be a finite number > 0 (reference: 100 for GenEval / OCR-like "
                             f"rewards, 1000 for PickScore-like ones), got {m!r}")
        if self.kl_beta < 0 or self.ema_kl_beta < 0:
            raise ValueError(f"kl_beta and ema_kl_beta must be >= 0, got {self.kl_beta}, {self.ema_kl_beta}")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads v_ref (RAM always; NFT / AWM with ``kl_beta`` > 0)."""
        return self.objective == "ram" or self.kl_beta > 0

    def loss(self, v: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor | None, u: torch.Tensor,
             x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, advantages: torch.Tensor,
             frame_dim: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective's loss on one unit.

        Args:
            v: current velocity at x_t with graph [B, ...]; v_old / v_ref: old-policy / reference velocities
                (detached; v_ref None when :attr:`needs_reference` is False); u = eps - x0; x_t, x0: the noised
                and clean samples; t: [B] in (0, 1]; advantages: A [B]; frame_dim: frame axis of the latents.
        Returns:
            (0-d loss with graph, AWM's detached statistics or ``{}``).
        """
        if self.objective == "ram":
            return ram_loss(v, v_ref, v_old, u, advantages, self.multiplier, frame_dim=frame_dim), {}
        if self.objective == "nft":
            r = advantage_to_r(advantages, self.nft_clip)
            loss = nft_loss(v, v_old, x_t, x0, t, r, beta=self.nft_beta, clip_c=self.nft_clip,
                            adaptive=self.nft_adaptive, frame_dim=frame_dim)
            if self.kl_beta > 0:
                loss = loss + self.kl_beta * sample_mse(v, v_ref, frame_dim=frame_dim).mean()
            return loss, {}
        log_p_old = -awm_weight(sample_mse(v_old, u, frame_dim=frame_dim), t, self.awm_weighting, p=self.awm_p)
        return awm_loss(v, u, t, advantages, weighting=self.awm_weighting, log_p_old=log_p_old,
                        clip_range=self.awm_clip_range, adv_clip=self.awm_adv_clip, v_ref=v_ref, beta=self.kl_beta,
                        v_ema=v_old if self.ema_kl_beta > 0 else None, beta_ema=self.ema_kl_beta,
                        frame_dim=frame_dim, p=self.awm_p)
