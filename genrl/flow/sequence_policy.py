"""Policy losses over token sequences: GSPO, token-level GRPO and the k3 KL estimator.

The language-model planner of TempAct (``genrl.models.planner.LMPlanner``) is trained by group RL on its answer
tokens. These are pure functions over right-padded ``[N, L]`` tensors of per-token log-probabilities (N sequences,
L positions) and a boolean mask of the tokens the loss trains (the answer tokens); the advantages are per sequence
(e.g. :func:`genrl.flow.policy.group_advantages` over the planner's K samples per prompt).

Conventions shared by every function here:

* Only masked positions are read: the values at unmasked positions (prompt, padding) may be anything finite or
  not, they change neither the loss nor its gradient.
* A sequence with an empty mask (no answer token) contributes exactly 0 to the loss and to its gradient and is left
  out of the statistics; the loss is still the sum over sequences divided by N (the batch size, not the count of
  non-empty sequences), so its scale does not depend on how many answers are empty.
* ``old_log_probs``, ``ref_log_probs`` and ``advantages`` are constants (detached).
* Math runs in float32, or float64 when any input is float64 (:func:`genrl.flow.broadcast.compute_dtype`).
"""

from __future__ import annotations

import torch

from genrl.flow.broadcast import compute_dtype

__all__ = ["K3_LOG_RATIO_MAX", "k3_kl", "gspo_loss", "token_grpo_loss"]

K3_LOG_RATIO_MAX = 20.0
"""The per-token log-ratio ``ref - logp`` is clamped to ``[-20, 20]`` inside :func:`k3_kl` so that its ``exp`` stays
finite (verl's ``kl_penalty`` "low_var_kl" clamps the same way); the estimator and its gradient are exact inside."""


def _check(log_probs: torch.Tensor, mask: torch.Tensor, others: dict[str, torch.Tensor | None],
           advantages: torch.Tensor | None = None) -> None:
    if log_probs.ndim != 2:
        raise ValueError(f"log_probs must be [N, L] (sequences x positions), got shape {tuple(log_probs.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got dtype {mask.dtype}")
    if mask.shape != log_probs.shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} must match log_probs of shape {tuple(log_probs.shape)}")
    for name, t in others.items():
        if t is not None and t.shape != log_probs.shape:
            raise ValueError(f"{name} of shape {tuple(t.shape)} must match log_probs of shape "
                             f"{tuple(log_probs.shape)}")
    if advantages is not None and advantages.shape != log_probs.shape[:1]:
        raise ValueError(f"advantages must be [N] = [{log_probs.shape[0]}] (one per sequence), got shape "
                         f"{tuple(advantages.shape)}")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row mean of ``values`` over ``mask`` -> [N]; 0 for an empty row (no NaN, no gradient)."""
    count = mask.sum(dim=1).clamp(min=1).to(values.dtype)
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dim=1) / count


def _token_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    d = (ref_log_probs.detach().to(dt) - log_probs.to(dt)).clamp(-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX)
    return torch.expm1(d) - d


def k3_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence k3 estimate of KL(pi || pi_ref) from the sampled tokens (Schulman 2020, "Approximating KL
    divergence"): with d_t = log pi_ref(y_t) - log pi(y_t),

        k3_t = exp(d_t) - d_t - 1 >= 0,        KL_i = mean over the masked t of sequence i of k3_t.

    Unbiased for KL(pi || pi_ref) when the tokens are drawn from pi, non-negative for any input, 0 exactly where the
    two log-probs are equal. ``d_t`` is clamped to [-:data:`K3_LOG_RATIO_MAX`, +:data:`K3_LOG_RATIO_MAX`].

    Args:
        log_probs: [N, L] log-probs of the tokens under the current policy (with grad), float.
        ref_log_probs: [N, L] log-probs of the same tokens under the reference policy (treated as constant).
        mask: [N, L] bool, True on the tokens to average over.

    Returns:
        [N] float32 (float64 if an input is float64), >= 0; 0 for a sequence with an empty mask.

    Raises:
        ValueError: shapes differ, ``log_probs`` is not 2-d, or ``mask`` is not bool.

    Source: Wang et al. 2026, TempAct (arXiv 2606.28016), planner objective (KL term); Shao et al. 2024,
    DeepSeekMath GRPO, eq. 4 (the same estimator per token).
    """
    _check(log_probs, mask, {"ref_log_probs": ref_log_probs})
    dt = compute_dtype(log_probs, ref_log_probs)
    zero = torch.zeros((), dtype=dt, device=log_probs.device)
    lp, ref = torch.where(mask, log_probs.to(dt), zero), torch.where(mask, ref_log_probs.detach().to(dt), zero)
    return _masked_mean(_token_k3(lp, ref, dt), mask)


def _prepare(log_probs, old_log_probs, advantages, mask, clip_range, kl_coef, ref_log_probs):
    _check(log_probs, mask, {"old_log_probs": old_log_probs, "ref_log_probs": ref_log_probs}, advantages)
    if not 0 <= float(clip_range) < 1:
        raise ValueError(f"clip_range must be in [0, 1), got {clip_range}")
    if not float(kl_coef) >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_log_probs (the reference policy's log-probs of the same "
                         f"tokens); pass them or set kl_coef=0")
    dt = compute_dtype(log_probs, old_log_probs, advantages, ref_log_probs)
    zero = torch.zeros((), dtype=dt, device=log_probs.device)
    # unmasked positions are replaced before any arithmetic, so -inf / NaN there cannot leak into values or grads
    diff = torch.where(mask, log_probs.to(dt) - torch.where(mask, old_log_probs.detach().to(dt), zero), zero)
    adv = advantages.detach().to(dt)
    valid = mask.any(dim=1)
    if ref_log_probs is not None:
        kl = k3_kl(log_probs, ref_log_probs, mask).to(dt)
    else:
        kl = torch.zeros(log_probs.shape[0], dtype=dt, device=log_probs.device)
    return dt, diff, adv, valid, kl


def _stats(ratio: torch.Tensor, sel: torch.Tensor, eps: float, kl: torch.Tensor, valid: torch.Tensor) -> dict:
    """Ratio mean / min / max and clipped fraction over the selected entries, kl mean over valid sequences."""
    with torch.no_grad():
        r = ratio.detach()[sel]
        one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        if r.numel() == 0:
            return {"ratio_mean": one, "ratio_min": one, "ratio_max": one, "clipfrac": zero, "kl_mean": zero}
        clipped = ((r > 1.0 + eps) | (r < 1.0 - eps)).to(ratio.dtype)
        return {"ratio_mean": r.mean(), "ratio_min": r.min(), "ratio_max": r.max(), "clipfrac": clipped.mean(),
                "kl_mean": kl.detach()[valid].mean()}


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 5e-4,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the clipped surrogate on the *sequence* importance ratio (length-normalised), plus a k3 KL penalty.

        s_i = exp( mean_{t in mask_i} (log pi(y_it) - log pi_old(y_it)) ),
        loss_i = -min(s_i A_i, clip(s_i, 1 - eps, 1 + eps) A_i) + beta KL_i,       loss = (1 / N) sum_i loss_i,

    with KL_i = :func:`k3_kl` (0 when ``ref_log_probs`` is None). On-policy (s = 1) the gradient is
    ``-A_i / N`` times the gradient of sequence i's mean masked log-prob. It is 0 for A > 0 once s > 1 + eps and for
    A < 0 once s < 1 - eps (the clipped branch wins and is constant), and unclipped on the other side.

    Args:
        log_probs: [N, L] per-token log-probs under the current policy (with grad), float.
        old_log_probs: [N, L] per-token log-probs under the policy that sampled the tokens (constant).
        advantages: [N] per-sequence advantages (constant).
        mask: [N, L] bool, True on the trained (answer) tokens.
        clip_range: eps in [0, 1); TempAct's default 5e-4 (a sequence ratio is a geometric mean, hence tiny).
        kl_coef: beta >= 0 (TempAct: 5e-4).
        ref_log_probs: [N, L] per-token log-probs under the reference policy (required when ``kl_coef > 0``).

    Returns:
        (loss, stats). ``loss`` is a 0-d tensor, float32 (float64 if an input is float64). ``stats`` holds detached
        0-d tensors over the non-empty sequences: ``ratio_mean``, ``ratio_min``, ``ratio_max`` (of s),
        ``clipfrac`` (fraction with s outside [1 - eps, 1 + eps]) and ``kl_mean`` (mean KL_i; 0 without a
        reference). With no non-empty sequence the ratios read 1 and the rest 0.

    Raises:
        ValueError: shapes that do not fit ([N, L] tensors, [N] advantages), a non-bool mask, a clip range outside
            [0, 1), ``kl_coef < 0``, or ``kl_coef > 0`` without ``ref_log_probs``.

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071), eqs. 5-7; Wang et al. 2026,
    TempAct (arXiv 2606.28016), planner objective (GSPO + beta k3 KL, eps = beta = 5e-4).
    """
    dt, diff, adv, valid, kl = _prepare(log_probs, old_log_probs, advantages, mask, clip_range, kl_coef,
                                        ref_log_probs)
    eps = float(clip_range)
    ratio = torch.exp(_masked_mean(diff, mask))  # [N]
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps, 1.0 + eps))
    per_seq = torch.where(valid, surrogate + float(kl_coef) * kl, torch.zeros((), dtype=dt, device=diff.device))
    return per_seq.sum() / max(int(log_probs.shape[0]), 1), _stats(ratio, valid, eps, kl, valid)


def token_grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float = 0.2,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level GRPO: the clipped surrogate on each token's ratio, averaged per sequence, then over sequences.

        r_it = exp(log pi(y_it) - log pi_old(y_it)),
        loss_i = mean_{t in mask_i} [ -min(r_it A_i, clip(r_it, 1 - eps, 1 + eps) A_i) + beta k3_it ],
        loss = (1 / N) sum_i loss_i,

    with k3_it the per-token term of :func:`k3_kl`. Same arguments and conventions as :func:`gspo_loss`; the default
    ``clip_range`` is PPO's 0.2 (a per-token ratio is not length-normalised, so GSPO's 5e-4 would clip almost
    everything). On-policy the gradient is ``-A_i / (N n_i)`` times the gradient of each masked log-prob of
    sequence i (n_i its mask count).

    Returns:
        (loss, stats) as :func:`gspo_loss`, except that ``ratio_*`` and ``clipfrac`` are over the masked tokens.

    Raises:
        ValueError: as :func:`gspo_loss`.

    Source: Shao et al. 2024, DeepSeekMath GRPO, eq. 3 (sequence-mean of token terms); Wang et al. 2026, TempAct
    (arXiv 2606.28016), the token-level planner baseline.
    """
    dt, diff, adv, valid, kl = _prepare(log_probs, old_log_probs, advantages, mask, clip_range, kl_coef,
                                        ref_log_probs)
    eps = float(clip_range)
    ratio = torch.exp(diff)  # [N, L]; 1 at unmasked positions
    a = adv[:, None]
    token = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - eps, 1.0 + eps))
    zero = torch.zeros((), dtype=dt, device=diff.device)
    if ref_log_probs is not None and kl_coef > 0:
        safe_lp = torch.where(mask, log_probs.to(dt), zero)
        safe_ref = torch.where(mask, ref_log_probs.detach().to(dt), zero)
        token = token + float(kl_coef) * _token_k3(safe_lp, safe_ref, dt)
    per_seq = _masked_mean(token, mask)  # 0 for an empty mask
    return per_seq.sum() / max(int(log_probs.shape[0]), 1), _stats(ratio, mask, eps, kl, valid)
