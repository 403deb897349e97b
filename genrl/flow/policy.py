"""GRPO objective pieces: clipped policy loss, KL penalties, group advantages, reward normalisation.

Pure functions over per-sample (or per-(sample, step)) tensors; the log-probabilities come from
`genrl.flow.sde` (mean over latent elements by default, hence the tiny clip ranges). Cross-rank
gathering of rewards is the caller's job: gather (rewards, group_ids, valid) first, then call
`group_advantages` on the gathered tensors and take this rank's slice.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

from genrl.flow.broadcast import SigmaLike, _expand, compute_dtype

__all__ = [
    "clipped_policy_loss",
    "StepMoments",
    "step_divergence",
    "guard_log_ratio",
    "guard_policy_loss",
    "dppo_policy_loss",
    "POLICY_LOSSES",
    "PolicyLossName",
    "policy_loss",
    "check_policy_loss",
    "KLKind",
    "gaussian_kl",
    "velocity_kl",
    "kl_penalty",
    "AdvantageStd",
    "ZERO_STD",
    "group_advantages",
    "group_stats",
    "normalize_rewards",
    "RunningMeanStd",
]

KLKind = Literal["gaussian", "flow_grpo", "velocity_mse"]
_KL_KINDS: tuple[str, ...] = ("gaussian", "flow_grpo", "velocity_mse")

AdvantageStd = Literal["group", "global", "none"]
_ADV_STDS: tuple[str, ...] = ("group", "global", "none")

ZERO_STD = 1e-6
"""A group whose reward std is below this has constant reward and gets advantage exactly 0."""


# ----------------------------------------------------------------------------------------------
# clipped policy loss


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float = 1e-4,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The pessimistic PPO / GRPO clipped surrogate, per sample.

        r = exp(log_prob - old_log_prob),   A_hat = clamp(A, -adv_clip_max, adv_clip_max),
        loss = max(-A_hat r, -A_hat clip(r, 1 - eps_low, 1 + eps_high)).

    At r = 1 the gradient is the plain policy gradient -A_hat grad(log_prob). It is 0 when
    r > 1 + eps_high with A_hat > 0 or r < 1 - eps_low with A_hat < 0 (the clipped branch is the
    maximum and constant), and unclipped on the other side. ``old_log_prob`` and ``advantages``
    are treated as constants (detached). With the reference mean-over-elements log-probs the
    ratio is the D-th root of the density ratio, hence the tiny default clip range 1e-4
    (Flow-GRPO / DanceGRPO; 1e-3 for Wan and BranchGRPO, 1e-5 for Flow-GRPO-Fast).

    Args:
        log_prob: [B] log-probabilities under the current policy (with grad), e.g. from
            `step_log_prob`.
        old_log_prob: [B] log-probabilities recorded at rollout time.
        advantages: [B] advantages (e.g. `group_advantages`).
        clip_range: eps_low >= 0 (and eps_high unless given); must be < 1.
        clip_range_high: eps_high >= 0 (asymmetric clipping as in GRPO-Guard's
            ``clip_range_lt / gt``); default ``clip_range``.
        adv_clip_max: A_max > 0 (5 in all reference repos; ``math.inf`` disables the clamp).

    Returns:
        (loss, stats). ``loss`` has the broadcast shape of the inputs ([B]), float32 (float64 if any
        input is float64); reduce it yourself (mean, or divided by micro-steps per optimizer step).
        ``stats`` holds detached 0-d tensors: ``ratio_mean``, ``ratio_std`` (ddof 0, so 0 for
        B = 1), ``approx_kl`` = 1/2 mean((log_prob - old_log_prob)^2), ``clipfrac`` (fraction with
        r outside [1 - eps_low, 1 + eps_high]), ``clipfrac_high`` (r > 1 + eps_high),
        ``clipfrac_low`` (r < 1 - eps_low), ``adv_abs_mean`` (mean |A_hat|, after the clamp).

    Raises:
        ValueError: the three shapes do not broadcast together (the message names them); a clip
            range outside [0, 1) (eps_high: < 0); ``adv_clip_max <= 0``.

    Source: Schulman et al. 2017, PPO, eq. 7; Shao et al. 2024, DeepSeekMath GRPO, eq. 3;
    Liu et al. 2025, Flow-GRPO (GRPO objective; ``train_sd3.py``).
    Documentation: docs/methods/grpo.md (Clipped loss and KL).
    """
    eps_low = float(clip_range)
    eps_high = eps_low if clip_range_high is None else float(clip_range_high)
    if not 0 <= eps_low < 1:
        raise ValueError(f"clip_range must be in [0, 1), got {clip_range}")
    if not eps_high >= 0:
        raise ValueError(f"clip_range_high must be >= 0, got {clip_range_high}")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    try:
        torch.broadcast_shapes(log_prob.shape, old_log_prob.shape, advantages.shape)
    except RuntimeError as e:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must have the same (or broadcastable) shapes"
        ) from e
    dt = compute_dtype(log_prob, old_log_prob, advantages)
    diff = log_prob.to(dt) - old_log_prob.detach().to(dt)
    ratio = torch.exp(diff)
    adv = advantages.detach().to(dt).clamp(-adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    # inside the clip range both branches are equal; torch.maximum then sends half the gradient to
    # each and both carry -A_hat dr, so the sum is the plain policy gradient (tested)
    loss = torch.maximum(unclipped, clipped)

    with torch.no_grad():
        r = ratio.detach().expand(loss.shape)
        high = (r > 1.0 + eps_high).to(dt)
        low = (r < 1.0 - eps_low).to(dt)
        stats = {
            "ratio_mean": r.mean(),
            "ratio_std": r.std(correction=0) if r.numel() > 1 else torch.zeros((), dtype=dt, device=r.device),
            "approx_kl": 0.5 * (diff.detach() ** 2).mean(),
            "clipfrac": (high + low).mean(),
            "clipfrac_high": high.mean(),
            "clipfrac_low": low.mean(),
            "adv_abs_mean": adv.expand(loss.shape).abs().mean(),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------
# per-step policy losses that need the transition's moments (GRPO-Guard, Flow-DPPO) and their registry


class StepMoments(NamedTuple):
    """The Gaussian transition of one SDE step under the current and the rollout policy.

    Fields:
        mean: [B, *latent] the current policy's transition mean mu_theta (with grad).
        old_mean: [B, *latent] the rollout's mean mu_old (``Trajectory.step_moments``; treated as a constant).
        std: the transition std s > 0 shared by both (a float, or a tensor broadcastable to [B]).
        step: the step length |delta sigma| = sigma_k - sigma_{k+1} > 0 (GRPO-Guard's optional 1 / |delta| scale).
    """

    mean: torch.Tensor
    old_mean: torch.Tensor
    std: torch.Tensor | float
    step: float


def _per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(dim=1) if t.ndim > 1 else t


def step_divergence(moments: StepMoments) -> torch.Tensor:
    """D = mean_j (mu_theta - mu_old)_j^2 / (2 s^2) per sample, float [B] (float64 if any input is float64): the
    closed-form KL(N(mu_theta, s^2 I) || N(mu_old, s^2 I)) divided by the number of latent elements, i.e. the KL of
    the mean-over-elements log-probs genrl uses. Gradient flows through ``mean`` only. 0 at theta = theta_old.

    Source: Flow-DPPO's trust region (verl-omni ``FlowDPPOLoss``); GRPO-Guard's bias term D_t (arXiv 2510.22319).
    """
    dt = compute_dtype(moments.mean, moments.old_mean)
    d = moments.mean.to(dt) - moments.old_mean.detach().to(dt)
    std = torch.as_tensor(moments.std, dtype=dt, device=d.device)
    return _per_sample_mean(d.pow(2)) / (2 * std.pow(2))


def guard_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, moments: StepMoments) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio, per sample [B]:

        log r_G = s (log r + D),   log r = log_prob - old_log_prob,   D = :func:`step_divergence`.

    With genrl's mean-over-elements Gaussian log-probs and xi = (x - mu_old) / s the rollout's standardised noise,
    log r = mean_j(xi_j d_j) / s - D with d = mu_theta - mu_old, so log r_G = mean_j(xi_j d_j) exactly: its mean over
    the rollout noise is 0 (log r's is -D) and its scale does not grow like 1 / s as the noise shrinks. At
    theta = theta_old it is 0 and its gradient is s x grad(log r).

    Args:
        log_prob: [B] current log-prob (with grad); old_log_prob: [B] the rollout's.
        moments: the step's :class:`StepMoments` (mean with grad).
    Source: Wang et al. 2025, "GRPO-Guard" (arXiv 2510.22319), ratio normalisation (per sample, as the paper reads;
    verl-omni / flow_grpo ``rationorm`` average s over the batch first: the same when s is one per step, as here).
    """
    dt = compute_dtype(log_prob, old_log_prob, moments.mean)
    std = torch.as_tensor(moments.std, dtype=dt, device=log_prob.device)
    return std * (log_prob.to(dt) - old_log_prob.detach().to(dt) + step_divergence(moments).to(dt))


def guard_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    moments: StepMoments,
    clip_range: float = 1e-4,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
    scale: Literal["none", "step"] = "none",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard's per-sample loss: :func:`clipped_policy_loss` on the normalised ratio r_G = exp(log r_G)
    (:func:`guard_log_ratio`) instead of r, times c = 1 (``scale: none``, Flow-Factory) or 1 / |delta sigma|
    (``scale: step``, verl-omni: then the step length cancels from the gradient as well as the noise scale).

    Returns:
        (loss [B], stats): the clipped loss's stats on r_G (``ratio_mean`` ... ``clipfrac``) plus ``log_ratio_raw``
        (mean log r, in float64 when inputs are: Flow-Factory#157's ratio that "stays 1" is a display precision
        matter) and ``divergence`` (mean D).
    Raises:
        ValueError: as :func:`clipped_policy_loss`; an unknown ``scale``; ``moments.step`` <= 0 with ``scale: step``.
    Source: arXiv 2510.22319 (GRPO-Guard); Flow-Factory ``GRPOGuardTrainer``, verl-omni ``GRPOGuardLoss``.
    """
    if scale not in ("none", "step"):
        raise ValueError(f"GRPO-Guard scale must be 'none' or 'step', got {scale!r}")
    if scale == "step" and not moments.step > 0:
        raise ValueError(f"GRPO-Guard scale 'step' needs a step length > 0, got {moments.step}")
    log_ratio = guard_log_ratio(log_prob, old_log_prob, moments)
    loss, stats = clipped_policy_loss(log_ratio, torch.zeros_like(log_ratio), advantages, clip_range=clip_range,
                                      clip_range_high=clip_range_high, adv_clip_max=adv_clip_max)
    if scale == "step":
        loss = loss / moments.step
    with torch.no_grad():
        stats["log_ratio_raw"] = (log_prob.detach() - old_log_prob.detach()).mean()
        stats["divergence"] = step_divergence(moments).mean()
    return loss, stats


def dppo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    moments: StepMoments,
    adv_clip_max: float = 5.0,
    max_divergence: float = 1e-5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's per-sample loss: the unclipped surrogate -A_hat r, set to 0 (no gradient) where the step has left
    the trust region, D >= ``max_divergence`` (:func:`step_divergence`, the exact Gaussian KL per element), *and*
    moves further away (A_hat > 0 and r > 1, or A_hat < 0 and r < 1); corrective moves are always kept.

    Args:
        max_divergence: epsilon_D >= 0 (verl-omni's default 1e-5); ``math.inf`` gives the plain -A_hat r.
    Returns:
        (loss [B], stats): ``ratio_mean``, ``ratio_std``, ``approx_kl``, ``adv_abs_mean`` as the clipped loss's,
        ``masked_frac`` (samples set to 0) and ``divergence`` (mean D).
    Raises:
        ValueError: ``max_divergence`` < 0 or NaN; ``adv_clip_max`` <= 0.
    Source: verl-omni ``FlowDPPOLoss`` / docs/algo/flowdppo.md (Flow-DPPO, arXiv 2606.11025).
    """
    if not max_divergence >= 0:
        raise ValueError(f"Flow-DPPO max_divergence must be >= 0 (math.inf: no mask), got {max_divergence}")
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    dt = compute_dtype(log_prob, old_log_prob, advantages)
    diff = log_prob.to(dt) - old_log_prob.detach().to(dt)
    ratio = torch.exp(diff)
    adv = advantages.detach().to(dt).clamp(-adv_clip_max, adv_clip_max)
    with torch.no_grad():
        div = step_divergence(moments).to(dt)
        away = ((adv > 0) & (ratio > 1)) | ((adv < 0) & (ratio < 1))
        masked = (div >= max_divergence) & away
    loss = torch.where(masked, torch.zeros_like(ratio), -adv * ratio)
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "ratio_mean": r.mean(),
            "ratio_std": r.std(correction=0) if r.numel() > 1 else torch.zeros((), dtype=dt, device=r.device),
            "approx_kl": 0.5 * (diff.detach() ** 2).mean(),
            "adv_abs_mean": adv.abs().mean(),
            "masked_frac": masked.to(dt).mean(),
            "divergence": div.mean(),
        }
    return loss, stats


PolicyLossName = Literal["clipped", "guard", "dppo"]

#: name -> (per-sample loss, needs the step's moments). Every entry takes (log_prob, old_log_prob, advantages) and,
#: when it needs them, ``moments``; its other keywords come from the method's clip settings and ``policy_loss_args``.
POLICY_LOSSES: dict[str, tuple[Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]], bool]] = {
    "clipped": (clipped_policy_loss, False),
    "guard": (guard_policy_loss, True),
    "dppo": (dppo_policy_loss, True),
}


@functools.cache
def _parameters(fn: Callable) -> tuple[str, ...]:
    """The keyword names of a registered loss (read once per function: the training step calls the loss every step)."""
    return tuple(inspect.signature(fn).parameters)


def check_policy_loss(name: str, options: dict | None = None) -> bool:
    """Validate a policy-loss choice before any training: ``name`` is in :data:`POLICY_LOSSES` and ``options`` are
    keywords that loss takes. Returns whether it needs the step moments (the rollout must record them).

    Raises:
        ValueError: an unknown name (the message lists the registry) or option (it lists the loss's own options).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    fn, needs = POLICY_LOSSES[name]
    own = set(_parameters(fn)) - {"log_prob", "old_log_prob", "advantages", "moments", "clip_range",
                                  "clip_range_high", "adv_clip_max"}
    if unknown := sorted(set(options or {}) - own):
        raise ValueError(f"policy loss {name!r} does not take the options {unknown}; its own options: {sorted(own)}")
    return needs


def policy_loss(
    name: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    moments: StepMoments | None = None,
    clip_range: float = 1e-4,
    clip_range_high: float | None = None,
    adv_clip_max: float = 5.0,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-step policy loss ``name`` of :data:`POLICY_LOSSES` (per sample [B], plus detached stats): the one
    place a GRPO-style update picks its objective, so a variant (GRPO-Guard, Flow-DPPO, a new one registered here)
    is a config value, not a copy of the update. ``clip_range`` / ``clip_range_high`` go to the losses that clip
    (``clipped``, ``guard``); ``options`` are the loss's own keywords (``scale`` for guard, ``max_divergence`` for
    dppo).

    Raises:
        ValueError: as :func:`check_policy_loss`; a loss that needs ``moments`` called without them (record them in
            the rollout: ``rollout(record_moments=True)``).
    """
    needs = check_policy_loss(name, options)
    fn = POLICY_LOSSES[name][0]
    kwargs = dict(options, adv_clip_max=adv_clip_max)
    if needs:
        if moments is None:
            raise ValueError(f"the {name!r} policy loss needs the step's transition moments (mean and std); record "
                             f"them in the rollout (rollout(record_moments=True))")
        kwargs["moments"] = moments
    if "clip_range" in _parameters(fn):
        kwargs.update(clip_range=clip_range, clip_range_high=clip_range_high)
    return fn(log_prob, old_log_prob, advantages, **kwargs)


# ----------------------------------------------------------------------------------------------
# KL penalties to a reference policy


def gaussian_kl(
    mean: torch.Tensor,
    mean_ref: torch.Tensor,
    std: torch.Tensor | SigmaLike,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Closed-form KL between two Gaussian step policies with equal std, averaged per element.

        KL(N(mean, s^2) || N(mean_ref, s^2)) = sum_j (mean_j - mean_ref_j)^2 / (2 s_j^2);

    this returns the mean over the D elements, i.e. ||mean - mean_ref||^2 / (2 s^2 D) for a
    constant s (the same per-element convention as the log-probs). 0 when the policies agree.

    The Flow-GRPO implementation computes mean((mean - mean_ref)^2) / (2 g^2) with the diffusion
    coefficient g instead of the step std s = g sqrt(|Delta|); its value is this KL times |Delta|
    (`kl_penalty` kind "flow_grpo"; the paper's formula divides by 2 g^2 |Delta|, i.e. this one).

    Args:
        mean: current-policy step mean [B, ...] (with grad), e.g. from `step_mean_std`.
        mean_ref: reference-policy step mean (same x, same step), shape of ``mean``.
        std: the step std s > 0: `step_mean_std`'s std (broadcastable), a float, [B] or [B, T].
        frame_dim: frame dim of ``mean`` for a per-frame [B, T] std.

    Returns:
        [B] KL per sample (mean over elements), float32 (float64 if any input is float64).

    Raises:
        ValueError: shapes differ / std does not fit; any std <= 0 (an ODE step has no density).

    Source: Liu et al. 2025, Flow-GRPO (KL of the SDE step policies; ``train_sd3.py``);
    docs/methods/grpo.md (Clipped loss and KL).
    """
    dt = compute_dtype(mean, mean_ref, std)
    return _reduce_elements(_elementwise_gaussian_kl(mean, mean_ref, std, frame_dim, dt), mean.shape)


def _elementwise_gaussian_kl(
    mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor | SigmaLike, frame_dim: int, dt: torch.dtype
) -> torch.Tensor:
    if mean.shape != mean_ref.shape:
        raise ValueError(f"mean of shape {tuple(mean.shape)} and mean_ref of shape {tuple(mean_ref.shape)} must match")
    if mean.ndim == 0:
        raise ValueError("mean must have a batch dim [B, ...]")
    s = _expand(std, mean, frame_dim, "std", dt)
    if not bool((s > 0).all()):
        raise ValueError("gaussian_kl needs std > 0 everywhere (a deterministic ODE step has no density)")
    d = mean.to(dt) - mean_ref.to(dt)
    return (d * d) / (2 * s * s)


def _reduce_elements(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Mean over all non-batch elements of ``t`` broadcast to ``shape`` -> [B]."""
    return t.expand(shape).reshape(shape[0], -1).mean(dim=1)


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """Velocity MSE to the reference policy, mean over elements: mean_j (v_j - v_ref_j)^2.

    The "velocity KL" of Flow-GRPO's no-CFG recipes (flow_grpo#198, #233): up to a per-step
    factor it is the Gaussian KL of the SDE step, since for the same x the step means differ by
    Delta (1 + g^2 (1 - sigma) / (2 sigma)) (v - v_ref); unlike `gaussian_kl` it is defined for ODE
    steps too, and is usable in full fine-tuning with a frozen or EMA reference.

    Args:
        v: current velocity [B, ...] (with grad).
        v_ref: reference velocity at the same (x, sigma), shape of ``v``.

    Returns:
        [B] float32 (float64 if any input is float64).

    Raises:
        ValueError: shapes differ.

    Source: flow_grpo#198 / #233 (velocity KL against reward hacking and for test-time CFG);
    docs/methods/grpo.md (Clipped loss and KL).
    """
    if v.shape != v_ref.shape:
        raise ValueError(f"v of shape {tuple(v.shape)} and v_ref of shape {tuple(v_ref.shape)} must match")
    dt = compute_dtype(v, v_ref)
    if v.ndim == 0:
        raise ValueError("v must have a batch dim [B, ...]")
    d = v.to(dt) - v_ref.to(dt)
    return _reduce_elements(d * d, v.shape)


def kl_penalty(
    kind: KLKind,
    *,
    mean: torch.Tensor | None = None,
    mean_ref: torch.Tensor | None = None,
    std: torch.Tensor | SigmaLike | None = None,
    delta: SigmaLike | None = None,
    v: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Dispatch to one KL form by name (for configs); multiply by beta yourself.

    * ``"gaussian"``: `gaussian_kl` (mean, mean_ref, std) - the exact per-element Gaussian KL.
    * ``"flow_grpo"``: the Flow-GRPO implementation's value, `gaussian_kl` x |delta| with
      delta = sigma_next - sigma (float, [B] or [B, T]); = mean((mean - mean_ref)^2) / (2 g^2).
      Use it to reproduce the reference betas (0.04 GenEval / OCR, 0.01 PickScore, 0.004 Wan).
    * ``"velocity_mse"``: `velocity_kl` (v, v_ref).

    Args:
        kind: the KL form.
        mean, mean_ref, std: step means and std ("gaussian", "flow_grpo").
        delta: sigma_next - sigma ("flow_grpo").
        v, v_ref: velocities ("velocity_mse").
        frame_dim: frame dim for per-frame std / delta.

    Returns:
        [B] float32 (float64 if any input is float64).

    Raises:
        ValueError: unknown ``kind`` or a needed argument missing (the message names it); errors
            of the dispatched function.

    Source: Flow-GRPO's implementation and the exact Gaussian KL; docs/methods/grpo.md (Clipped loss and KL).
    """
    if kind not in _KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {_KL_KINDS}")

    def need(**kw: object) -> None:
        missing = [k for k, val in kw.items() if val is None]
        if missing:
            raise ValueError(f"kl_penalty({kind!r}) needs {', '.join(missing)}")

    if kind == "velocity_mse":
        need(v=v, v_ref=v_ref)
        return velocity_kl(v, v_ref)  # type: ignore[arg-type]
    need(mean=mean, mean_ref=mean_ref, std=std)
    if kind == "gaussian":
        return gaussian_kl(mean, mean_ref, std, frame_dim)  # type: ignore[arg-type]
    need(delta=delta)
    # |delta| may be a float, per sample or per frame: weight each element's KL, then average
    dt = compute_dtype(mean, mean_ref, std, delta)
    kl = _elementwise_gaussian_kl(mean, mean_ref, std, frame_dim, dt)  # type: ignore[arg-type]
    d = _expand(delta, mean, frame_dim, "delta", dt).abs()  # type: ignore[arg-type]
    return _reduce_elements(kl * d, mean.shape)  # type: ignore[union-attr]


# ----------------------------------------------------------------------------------------------
# group advantages


def _prepare_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.dtype]:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-d [N], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids of shape {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    else:
        if valid.shape != rewards.shape:
            raise ValueError(f"valid of shape {tuple(valid.shape)} must match rewards {tuple(rewards.shape)}")
        valid = valid.to(device=rewards.device, dtype=torch.bool)
    out_dt = compute_dtype(rewards)
    r = rewards.detach().to(torch.float64)
    bad = valid & ~torch.isfinite(r)
    n_bad = int(bad.sum())
    if n_bad:
        raise ValueError(
            f"{n_bad} reward(s) are NaN or infinite on samples marked valid; mark failed samples invalid "
            "(valid=False) so that they get advantage 0 and are excluded from the group statistics"
        )
    _, inverse = torch.unique(group_ids.to(rewards.device), return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    return torch.where(valid, r, torch.zeros_like(r)), inverse, valid, n_groups, out_dt


def _group_moments(
    r: torch.Tensor, inverse: torch.Tensor, valid: torch.Tensor, n_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-group (count, mean, sum of squared deviations) over valid samples, float64."""
    w = valid.to(r.dtype)
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, w)
    total = torch.zeros_like(count).index_add_(0, inverse, r * w)
    mean = total / count.clamp_min(1)
    dev = (r - mean[inverse]) * w
    ss = torch.zeros_like(count).index_add_(0, inverse, dev * dev)
    return count, mean, ss


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    std: AdvantageStd = "group",
    eps: float = 1e-4,
    ddof: int = 0,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO advantages: rewards standardised within their group (samples of the same prompt).

        A_i = (r_i - mean_{group(i)}) / (std + eps)

    with std the group's std ("group"; DanceGRPO, Flow-GRPO Wan), the std of all valid rewards
    ("global"; Flow-GRPO SD3 ``global_std=True``, ddof 0) or 1 ("none"; only the mean is removed).
    Means and stds use the valid samples only, with ``ddof`` (0: np.std, Flow-GRPO; 1: torch.std,
    DanceGRPO). A group whose valid rewards have std < `ZERO_STD` (constant reward, or fewer than
    ddof + 1 valid samples) gets advantage exactly 0, in every mode, so it contributes no gradient.
    Invalid samples (``valid`` False, e.g. a failed reward) get exactly 0 and do not shift their
    group's statistics; their reward may be NaN. Computed in float64 internally.

    Distributed training: gather rewards, group ids and valid across ranks first (groups may span
    ranks, as in Flow-GRPO's stat tracker), then slice this rank's part of the result.

    Args:
        rewards: [N] float rewards.
        group_ids: [N] integer group id per sample (any values; e.g. the prompt index).
        std: "group", "global" or "none".
        eps: added to the std (>= 0): 1e-4 Flow-GRPO, 1e-8 DanceGRPO.
        ddof: delta degrees of freedom of the stds (0 or 1 usually).
        valid: [N] bool mask of usable rewards (default: all valid).

    Returns:
        [N] advantages, float32 (float64 for float64 rewards), on the rewards' device.

    Raises:
        ValueError: unknown ``std``; shapes differ or are not 1-d; non-integer group ids;
            ``eps < 0`` or ``ddof < 0``; a NaN / inf reward on a valid sample (the message gives the
            count and says to mark failures invalid).

    Source: Shao et al. 2024, DeepSeekMath GRPO (§4.1, outcome supervision); Liu et al. 2025,
    Flow-GRPO (``flow_grpo/stat_tracking.py``); Xue et al. 2025, DanceGRPO.
    Documentation: docs/methods/grpo.md (Group advantages).
    """
    if std not in _ADV_STDS:
        raise ValueError(f"unknown advantage std {std!r}; expected one of {_ADV_STDS}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if ddof < 0:
        raise ValueError(f"ddof must be >= 0, got {ddof}")
    r, inverse, valid, n_groups, out_dt = _prepare_groups(rewards, group_ids, valid)
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dt, device=rewards.device)
    count, mean, ss = _group_moments(r, inverse, valid, n_groups)
    dof = count - ddof
    group_std = torch.where(dof > 0, ss / dof.clamp_min(1), torch.zeros_like(ss)).sqrt()
    constant = group_std < ZERO_STD
    if std == "group":
        denom = group_std[inverse] + eps
    elif std == "global":
        n = valid.sum().to(r.dtype)
        mu = r[valid].mean() if bool(valid.any()) else r.new_zeros(())
        dev = (r - mu) * valid.to(r.dtype)
        var = (dev * dev).sum() / (n - ddof) if float(n) - ddof > 0 else r.new_zeros(())
        denom = var.sqrt() + eps
    else:
        denom = torch.ones_like(r)
    adv = (r - mean[inverse]) / denom
    zero = ~valid | constant[inverse]
    adv = torch.where(zero, torch.zeros_like(adv), adv)
    return adv.to(out_dt)


def group_stats(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Logging statistics of grouped rewards (valid samples only).

    Returns detached 0-d float32 tensors: ``reward_mean``, ``reward_std`` (ddof 0, over all valid
    rewards), ``group_std_mean`` (mean of the per-group stds, ddof 0), ``zero_std_fraction``
    (fraction of groups with at least one valid sample whose valid rewards have std < `ZERO_STD`;
    these get advantage 0 and train nothing; a group with a single valid sample counts), and
    ``valid_fraction``. Means are NaN when no sample is valid.

    Args:
        rewards: [N] float rewards (NaN allowed on invalid samples).
        group_ids: [N] integer group ids.
        valid: [N] bool mask (default: all valid).

    Raises:
        ValueError: as `group_advantages` (shapes, NaN on a valid sample).

    Source: Flow-GRPO's logged zero-std ratio (its diagnostics).
    """
    r, inverse, valid, n_groups, _ = _prepare_groups(rewards, group_ids, valid)
    f32 = torch.float32
    nan = torch.tensor(float("nan"), dtype=f32, device=r.device)
    if r.numel() == 0 or not bool(valid.any()):
        return {
            "reward_mean": nan, "reward_std": nan, "group_std_mean": nan, "zero_std_fraction": nan,
            "valid_fraction": torch.zeros((), dtype=f32, device=r.device),
        }
    count, _, ss = _group_moments(r, inverse, valid, n_groups)
    has = count > 0
    gstd = (ss[has] / count[has]).sqrt()
    rv = r[valid]
    return {
        "reward_mean": rv.mean().to(f32),
        "reward_std": rv.std(correction=0).to(f32),
        "group_std_mean": gstd.mean().to(f32),
        "zero_std_fraction": (gstd < ZERO_STD).to(torch.float64).mean().to(f32),
        "valid_fraction": valid.to(torch.float64).mean().to(f32),
    }


# ----------------------------------------------------------------------------------------------
# reward normalisation


def normalize_rewards(
    rewards: torch.Tensor,
    mean: float | torch.Tensor,
    std: float | torch.Tensor,
    eps: float = 1e-8,
) -> torch.Tensor:
    """z-score: (rewards - mean) / (std + eps), e.g. with a `RunningMeanStd`'s statistics.

    Args:
        rewards: any shape, float.
        mean, std: floats or tensors broadcastable to ``rewards`` (std >= 0).
        eps: added to std (>= 0).

    Returns:
        the normalised rewards, float32 (float64 if any input is float64). NaN stays NaN.

    Raises:
        ValueError: ``eps < 0``.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    dt = compute_dtype(rewards, mean, std)
    m = mean.to(device=rewards.device, dtype=dt) if isinstance(mean, torch.Tensor) else float(mean)
    s = std.to(device=rewards.device, dtype=dt) if isinstance(std, torch.Tensor) else float(std)
    return (rewards.to(dt) - m) / (s + eps)


class RunningMeanStd:
    """Running mean / variance of a reward stream (Welford / Chan's parallel update), NaN-skipping.

    Used to z-score each reward of a multi-reward sum on a common scale before weighting. Tracks
    one statistic per component of ``shape`` (default a scalar stream); each component counts its
    own non-NaN values. Statistics are float64; `state_dict` / `load_state_dict` round-trip them
    (checkpoint them with the method's state).

    Args:
        shape: the shape of one observation (default ``()``).

    Attributes:
        count, mean, m2: float64 tensors of ``shape`` (number of values, mean, sum of squared
            deviations).

    Source: Welford 1962; Chan, Golub & LeVeque 1979 (pairwise combination of moments).
    """

    def __init__(self, shape: tuple[int, ...] = ()) -> None:
        self.shape = tuple(shape)
        self.count = torch.zeros(self.shape, dtype=torch.float64)
        self.mean = torch.zeros(self.shape, dtype=torch.float64)
        self.m2 = torch.zeros(self.shape, dtype=torch.float64)

    def update(self, x: torch.Tensor | float) -> None:
        """Add observations: ``x`` of shape ``shape`` (one) or [N, *shape] (N); NaNs are skipped."""
        t = torch.as_tensor(x, dtype=torch.float64).detach().cpu()
        if tuple(t.shape) == self.shape:
            t = t.unsqueeze(0)
        if tuple(t.shape[1:]) != self.shape:
            raise ValueError(f"expected values of shape {self.shape} or [N, *{self.shape}], got {tuple(t.shape)}")
        ok = ~torch.isnan(t)
        n_b = ok.sum(0).to(torch.float64)
        vals = torch.where(ok, t, torch.zeros_like(t))
        mean_b = vals.sum(0) / n_b.clamp_min(1)
        dev = torch.where(ok, t - mean_b, torch.zeros_like(t))
        m2_b = (dev * dev).sum(0)
        tot = self.count + n_b
        delta = mean_b - self.mean
        safe_tot = tot.clamp_min(1)
        new_mean = self.mean + delta * n_b / safe_tot
        new_m2 = self.m2 + m2_b + delta * delta * self.count * n_b / safe_tot
        upd = n_b > 0
        self.mean = torch.where(upd, new_mean, self.mean)
        self.m2 = torch.where(upd, new_m2, self.m2)
        self.count = tot

    @property
    def var(self) -> torch.Tensor:
        """Population variance (ddof 0); 0 while no value has been seen."""
        return torch.where(self.count > 0, self.m2 / self.count.clamp_min(1), torch.zeros_like(self.m2))

    @property
    def std(self) -> torch.Tensor:
        """Population std (ddof 0)."""
        return self.var.sqrt()

    def normalize(self, x: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
        """`normalize_rewards` (x, mean, std, eps) with the running statistics."""
        dt = compute_dtype(x)
        return normalize_rewards(x, self.mean.to(x.device, dt), self.std.to(x.device, dt), eps)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The statistics as cloned float64 tensors: ``count``, ``mean``, ``m2``."""
        return {"count": self.count.clone(), "mean": self.mean.clone(), "m2": self.m2.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore from `state_dict`'s output (shapes must match ``shape``)."""
        for k in ("count", "mean", "m2"):
            if k not in state:
                raise ValueError(f"RunningMeanStd state is missing {k!r}")
            v = torch.as_tensor(state[k], dtype=torch.float64).cpu()
            if tuple(v.shape) != self.shape:
                raise ValueError(f"RunningMeanStd state {k!r} has shape {tuple(v.shape)}, expected {self.shape}")
        self.count, self.mean, self.m2 = (
            torch.as_tensor(state[k], dtype=torch.float64).cpu().clone() for k in ("count", "mean", "m2")
        )
