"""Forward-process policy losses: Bradley-Terry discriminator loss, R1 / R2, advantages and DiffusionNFT.

Pure functions used by AFD (adversarial flow distillation from black-box teacher videos) and by the
forward-process RL methods that regress the policy's velocity on its own forward-noised samples instead
of scoring reverse-chain log-probabilities (DiffusionNFT here; RAM and AWM in `genrl.flow.forward_rl`,
whose core -- the per-sample masked mean `sample_mse` and the input checks -- this module builds on):

* `bt_loss`: logistic (Bradley-Terry) loss on the paired discriminator score gap s_pos - s_neg.
* `r1_penalty` / `r2_penalty`: squared input-gradient norm of the discriminator on real / fake inputs.
* `centered_advantages`: batch- (or group-) centred, std-normalised advantages of a raw signal d.
* `advantage_to_r`: DiffusionNFT's map A -> optimality probability r in [0, 1].
* `nft_loss`: the DiffusionNFT loss over the implicit positive / negative policies.
* `ref_regularizer`: the squared velocity distance to a frozen reference (anti-forgetting term).

Conventions (docs/architecture.md, Conventions): sigma in [0, 1] (0 = data, 1 = noise), x_sigma = (1 - sigma) x0 +
sigma eps, velocity v = eps - x0, so x0 = x_sigma - sigma v. Latents are [B, T, C, H, W]
(``frame_dim=1``) or Wan's [B, C, T, H, W] (``frame_dim=2``); per-frame values are [B, T] with T on
``frame_dim``. Documentation: docs/methods/distillation.md (AFD) and docs/methods/forward_rl.md (DiffusionNFT).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from genrl.flow.broadcast import SigmaLike, _expand, compute_dtype, expand_sigma
from genrl.flow.dmd import _element_mask
from genrl.flow.fm_core import _check_positive, _check_same_shape, _per_sample_mean, _sample_counts, sample_mse
from genrl.flow.policy import AdvantageStd, group_advantages

__all__ = [
    "NFT_MIN_NORMALIZER",
    "Reduction",
    "bt_loss",
    "r1_penalty",
    "r2_penalty",
    "centered_advantages",
    "advantage_to_r",
    "nft_loss",
    "ref_regularizer",
]

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS: tuple[str, ...] = ("mean", "sum", "none")

NFT_MIN_NORMALIZER = 1e-5
"""Floor of DiffusionNFT's adaptive per-sample normaliser sg(mean |x0_hat - x0|) (the reference's value)."""


# --------------------------------------------------------------------------------------------
# helpers (validation and the per-sample masked mean come from the shared core, genrl.flow.fm_core)
# --------------------------------------------------------------------------------------------


def _reduce(values: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return values.mean()
    if reduction == "sum":
        return values.sum()
    if reduction == "none":
        return values
    raise ValueError(f"unknown reduction {reduction!r}; expected one of {_REDUCTIONS}")


# --------------------------------------------------------------------------------------------
# discriminator losses
# --------------------------------------------------------------------------------------------


def bt_loss(score_pos: torch.Tensor, score_neg: torch.Tensor, reduction: Reduction = "mean") -> torch.Tensor:
    """Bradley-Terry (logistic) loss on the paired score gap: softplus(-(s_pos - s_neg)).

    For a pair with gap d = s_pos - s_neg the loss is -log sigmoid(d) = softplus(-d) = BCE-with-logits
    of d against label 1: the probability that the positive (teacher / real) sample beats the
    negative (student / fake) one is modelled as sigmoid(d). Properties (tested): invariant to
    adding the same per-prompt bias b(c) to both scores, so the discriminator learns the paired
    discrepancy rather than prompt difficulty; L(d) - L(-d) = -d; at d = 0 the loss is log 2 and
    dL/ds_pos = -1/2 = -dL/ds_neg per pair. Computed stably with ``F.softplus`` in float32
    (float64 if an input is float64); differentiable w.r.t. both scores.

    Args:
        score_pos: scores of the positive samples (AFD: D(teacher clip, c)), any shape (usually [B]),
            any float dtype, unbounded reals.
        score_neg: scores of the paired negative samples (AFD: D(student rollout, c)), same shape.
            With K student rollouts per teacher clip, repeat the teacher scores K times first.
        reduction: "mean" (default, 0-d), "sum" (0-d) or "none" (the per-pair loss, shape of the scores).

    Returns:
        The loss, >= 0: 0-d for "mean" / "sum", else a tensor of the scores' shape.

    Raises:
        ValueError: the shapes differ (no broadcasting: a [B] vs [B, 1] mix-up would silently build
            a [B, B] loss), an input is empty / 0-d, or ``reduction`` is unknown.
        TypeError: an input is not a tensor.

    Source: Bradley & Terry 1952; the paired logistic discriminator loss of AFD (arXiv 2605.26105),
    docs/methods/distillation.md (AFD, step 2); relativistic pairing as in Jolicoeur-Martineau
    2019 (RpGAN).
    """
    _check_same_shape("score_pos", score_pos, score_neg=score_neg)
    dt = compute_dtype(score_pos, score_neg)
    gap = score_pos.to(dt) - score_neg.to(dt)
    return _reduce(F.softplus(-gap), reduction)


def _gradient_penalty(scores: torch.Tensor, inputs: torch.Tensor, which: str) -> torch.Tensor:
    if not isinstance(scores, torch.Tensor) or not isinstance(inputs, torch.Tensor):
        raise TypeError(f"{which}: scores and inputs must be torch.Tensors")
    if inputs.ndim < 1 or inputs.shape[0] < 1:
        raise ValueError(f"{which}: inputs must have a non-empty batch dim, got shape {tuple(inputs.shape)}")
    if scores.shape != (inputs.shape[0],):
        raise ValueError(
            f"{which}: scores of shape {tuple(scores.shape)} must be [B] with B = inputs.shape[0] = {inputs.shape[0]}"
        )
    if not inputs.requires_grad:
        raise ValueError(
            f"{which}: inputs do not require grad; call inputs.requires_grad_(True) (on a detached copy) "
            "before computing the scores"
        )
    if not scores.requires_grad:
        raise ValueError(f"{which}: scores carry no graph; compute them from inputs with grad enabled")
    (grad,) = torch.autograd.grad(scores.sum(), inputs, create_graph=True)
    dt = compute_dtype(grad)
    return grad.to(dt).square().reshape(inputs.shape[0], -1).sum(dim=1).mean()


def r1_penalty(scores: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """R1 gradient penalty on real (teacher) inputs: mean_b ||dD(x_b)/dx_b||^2.

    Each sample's squared Euclidean norm of the gradient of its own score w.r.t. its own input
    (summed over all non-batch elements), averaged over the batch. Because sample b's score depends
    only on x_b (no batch-norm in the discriminator), the gradient of ``scores.sum()`` gives every
    per-sample gradient at once. Computed with ``create_graph=True`` so the penalty can itself be
    back-propagated into the discriminator's parameters. The usual weight gamma / 2 (Mescheder et al.
    2018 use gamma / 2 * E||grad||^2) is left to the caller. Float32 (float64 for float64 gradients).

    Args:
        scores: the discriminator's scores [B] on ``inputs`` (AFD: D(teacher clips, c)), computed
            with grad enabled.
        inputs: the tensor they were computed from, [B, ...] (latents or pixels), ``requires_grad=True``.

    Returns:
        0-d tensor >= 0 with a graph into the discriminator's parameters.

    Raises:
        ValueError: ``scores`` is not [B] with B = inputs.shape[0], ``inputs`` does not require grad,
            or ``scores`` carries no graph (the message says how to fix it).
        TypeError: an argument is not a tensor.
        RuntimeError: (from autograd) ``scores`` was not computed from ``inputs``.

    Source: Mescheder, Geiger & Nowozin 2018, "Which Training Methods for GANs do actually Converge?",
    eq. 9 (R1); docs/methods/distillation.md (AFD, step 2: optional R1 / R2).
    """
    return _gradient_penalty(scores, inputs, "r1_penalty")


def r2_penalty(scores: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """R2 gradient penalty on fake (student) inputs: mean_b ||dD(x_b)/dx_b||^2.

    The same computation as `r1_penalty`, applied to generated samples (AFD: student rollouts,
    detached from the generator and re-marked ``requires_grad_(True)``).

    Args:
        scores: discriminator scores [B] on ``inputs``, computed with grad enabled.
        inputs: the fake inputs [B, ...], ``requires_grad=True``.

    Returns:
        0-d tensor >= 0 with a graph into the discriminator's parameters.

    Raises:
        ValueError / TypeError / RuntimeError: as `r1_penalty`.

    Source: Mescheder et al. 2018, eq. 10 (R2); used together with R1 in R3GAN (Huang et al. 2024).
    """
    return _gradient_penalty(scores, inputs, "r2_penalty")


# --------------------------------------------------------------------------------------------
# advantages
# --------------------------------------------------------------------------------------------


def centered_advantages(
    d: torch.Tensor,
    eps: float = 1e-6,
    clip: float | None = None,
    group: torch.Tensor | None = None,
    std: AdvantageStd = "group",
) -> torch.Tensor:
    """Centred, std-normalised advantages A = (d - mean d) / (std d + eps), optionally clipped.

    Without ``group`` the statistics run over the whole batch (every entry of d); with ``group``
    (one integer id per sample, e.g. the prompt index when K > 1 rollouts share a prompt) the mean
    is each group's mean and the std is each group's std (``std="group"``), the std of the whole
    batch (``std="global"``, DiffusionNFT's per-prompt mean with global std) or 1 (``"none"``).
    Stds use ddof = 0. Centring is mandatory for AFD: an accurate discriminator makes every raw gap
    d = D(student) - D(teacher) negative, and without centring every sample would be pushed away.
    A batch (group) whose d is constant (std < 1e-6, including a single sample) gets A = 0 exactly
    (r = 1/2: no gradient). Computed in float64 (via `group_advantages`); no gradient flows into d.

    For per-chunk signals, d may be [B, T]: all B * T entries of a sample belong to its group
    (the batch without ``group``), so the statistics pool over samples and chunks; a chunk index
    that is systematically worse keeps its negative advantage.

    Args:
        d: raw signal, [B] (per sample) or [B, T] (per frame / chunk), float, finite. AFD:
            d = D(x_student, c) - D(y_teacher, c) or the raw student score.
        eps: added to the std (>= 0).
        clip: if given (> 0), clamp A to [-clip, clip] after normalising.
        group: optional [B] integer group ids.
        std: "group", "global" or "none" (see above; only matters with ``group``, since without
            it the single group is the whole batch).

    Returns:
        A, shape of d, float32 (float64 for float64 d), mean 0 and std std/(std + eps) ~ 1 per group
        (before clipping), detached.

    Raises:
        ValueError: d is not [B] or [B, T] or is empty, holds NaN / inf, ``group`` is not an integer
            [B] tensor, ``eps < 0``, ``clip <= 0``, or ``std`` is unknown.

    Source: DiffusionNFT (Zheng et al. 2025) advantage normalisation; GRPO (Shao et al. 2024) group
    baseline; AFD advantage, docs/methods/distillation.md (AFD, step 3).
    """
    if not isinstance(d, torch.Tensor):
        raise TypeError(f"d must be a torch.Tensor [B] or [B, T], got {type(d).__name__}")
    if d.ndim not in (1, 2) or d.numel() == 0:
        raise ValueError(f"d must be a non-empty [B] or [B, T] tensor, got shape {tuple(d.shape)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if clip is not None:
        clip = _check_positive("clip", clip)
    if not bool(torch.isfinite(d.detach()).all()):
        raise ValueError(f"d holds {int((~torch.isfinite(d.detach())).sum())} NaN / inf value(s); drop those samples")
    b = d.shape[0]
    if group is None:
        ids = torch.zeros(b, dtype=torch.long, device=d.device)
    else:
        if not isinstance(group, torch.Tensor) or group.shape != (b,):
            shape = tuple(group.shape) if isinstance(group, torch.Tensor) else type(group).__name__
            raise ValueError(f"group must be an integer tensor [B] = [{b}], got {shape}")
        if group.dtype.is_floating_point or group.dtype == torch.bool:
            raise ValueError(f"group must be an integer tensor, got dtype {group.dtype}")
        ids = group.to(d.device)
    if d.ndim == 2:
        ids = ids[:, None].expand(d.shape).reshape(-1)
    adv = group_advantages(d.detach().reshape(-1), ids, std=std, eps=float(eps), ddof=0).reshape(d.shape)
    if clip is not None:
        adv = adv.clamp(-clip, clip)
    return adv


def advantage_to_r(advantages: torch.Tensor, clip_c: float = 5.0) -> torch.Tensor:
    """DiffusionNFT's optimality probability r = 1/2 + clip(A, -C, C) / (2C), in [0, 1].

    Monotone non-decreasing in A, r(0) = 1/2, saturating at r = 0 for A <= -C and r = 1 for A >= C.
    r is the weight of the positive implicit policy in `nft_loss` (1 - r that of the negative).

    Args:
        advantages: A, any shape (usually [B] or [B, T]), float, finite.
        clip_c: C > 0 (DiffusionNFT's ``adv_clip_max`` = 5).

    Returns:
        r, shape of A, float32 (float64 for float64 A), detached, in [0, 1].

    Raises:
        ValueError: ``clip_c`` is not a finite number > 0, or A holds NaN.
        TypeError: A is not a tensor.

    Source: Zheng et al. 2025, DiffusionNFT (``r = clip(A, -C, C) / (2C) + 1/2``, C = 5);
    docs/methods/distillation.md (AFD, step 3).
    """
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    c = _check_positive("clip_c", clip_c)
    a = advantages.detach().to(compute_dtype(advantages))
    if bool(torch.isnan(a).any()):
        raise ValueError("advantages hold NaN; drop or zero those samples first")
    return 0.5 + a.clamp(-c, c) / (2.0 * c)


# --------------------------------------------------------------------------------------------
# DiffusionNFT policy loss and the reference regulariser
# --------------------------------------------------------------------------------------------


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: SigmaLike,
    r: torch.Tensor,
    beta: float = 1.0,
    clip_c: float = 5.0,
    adaptive: bool = True,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
    *,
    min_normalizer: float = NFT_MIN_NORMALIZER,
) -> torch.Tensor:
    """DiffusionNFT loss: flow matching on the policy's own samples, mixing two implicit policies by r.

    Implicit policies (v_old detached): v+ = beta v_theta + (1 - beta) v_old (positive) and
    v- = (1 + beta) v_old - beta v_theta (negative, the reflection of v+ about v_old). With the
    per-element residual e(v) = x_t - sigma v - x0 (= sigma (u - v), u = eps - x0 the velocity
    target) the loss is

        L = (C / beta) * mean_b l_b,
        l_b = mean_{e in sample b} [ r_e * q_e(v+) / w_b(v+) + (1 - r_e) * q_e(v-) / w_b(v-) ]

    * ``adaptive=True`` (x0 space, the reference): q_e(v) = e(v)^2 and w_b(v) =
      sg(max(mean_{e in b} |e(v)|, ``min_normalizer``)), one normaliser per sample and per policy,
      computed in float64 without gradient.
    * ``adaptive=False`` (velocity form): q_e(v) = (v - u)^2 with u = (x_t - x0) / sigma, w = 1.

    ``mean_{e in b}`` is the mean over sample b's elements (over the elements of its masked-in
    frames with ``mask``); samples weigh equally. r_e is the sample's r ([B]) or its frame's r
    ([B, T]: per-frame / per-chunk credit). With per-sample r and no mask this is exactly the
    DiffusionNFT reference, including its constant factor C / beta.

    Invariants (tested): at v_theta == v_old the value is (C / beta) * mean_b l_b(v_old), whatever
    r is; in velocity form the gradient there is C (2 r - 1) d||v_theta - u||^2 / dv_theta per
    sample (an advantage-signed flow-matching step), which is exactly zero for r = 1/2. Masked-out
    frames get exactly zero gradient and do not enter the normalisers, even if they hold NaN.

    Args:
        v_theta: current policy velocity at x_t, with graph, any shape [B, ...] ([B, T, C, H, W]
            or Wan's [B, C, T, H, W]), any float dtype.
        v_old: old-policy (EMA / lagged) velocity at the same x_t, same shape; detached here.
        x_t: the noised sample x_sigma = (1 - sigma) x0 + sigma eps, same shape; detached.
        x0: the clean sample (the policy's own rollout), same shape; detached.
        sigma: noise level(s) in [0, 1]: float, 0-d, [B], per-frame [B, T] or broadcastable
            (see `expand_sigma`); detached. The velocity form needs sigma > 0 on every masked-in
            element (u is undefined at sigma = 0); mask out clean context frames.
        r: optimality probability in [0, 1] (`advantage_to_r`), [B] or per-frame [B, T]; detached.
        beta: implicit-policy step beta > 0 (DiffusionNFT: 1.0, or 0.1 for OCR / multi-reward).
        clip_c: C > 0, the advantage clip used to build r; scales the loss (reference: 5).
        adaptive: x0-space adaptive weighting (True, reference) or the plain velocity form (False).
        mask: optional per-frame mask [B, T] (bool or 0/1), T on ``frame_dim``.
        frame_dim: frame dim of the latents (1 for [B, T, C, H, W], 2 for [B, C, T, H, W]).
        min_normalizer: floor of the adaptive normaliser (> 0; reference 1e-5).

    Returns:
        0-d tensor, float32 (float64 when an input is float64), differentiable w.r.t. v_theta only.

    Raises:
        ValueError: shapes differ (message names both), ``r`` / ``sigma`` / ``mask`` does not fit
            the latents, ``r`` leaves [0, 1] or is NaN, ``beta`` / ``clip_c`` / ``min_normalizer`` is
            not a finite number > 0, a sample's mask is empty, or (velocity form) sigma is not > 0
            on a masked-in element.

    Source: Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process"
    (implicit policies and the r-weighted objective; released ``train_nft_sd3.py``); AFD's update,
    docs/methods/distillation.md (AFD, step 4); docs/methods/forward_rl.md (DiffusionNFT).
    """
    _check_same_shape("v_theta", v_theta, v_old=v_old, x_t=x_t, x0=x0)
    beta = _check_positive("beta", beta)
    c = _check_positive("clip_c", clip_c)
    floor = _check_positive("min_normalizer", min_normalizer)
    if not isinstance(r, torch.Tensor):
        raise TypeError(f"r must be a torch.Tensor [B] or [B, T], got {type(r).__name__}")
    if r.ndim not in (1, 2):
        raise ValueError(f"r must be [B] (per sample) or [B, T] (per frame), got shape {tuple(r.shape)}")
    dt = compute_dtype(v_theta, v_old, x_t, x0, sigma, r)
    rr = r.detach().to(dt)
    if bool(torch.isnan(rr).any()) or bool(((rr < 0) | (rr > 1)).any()):
        raise ValueError(
            f"r must lie in [0, 1] (use advantage_to_r), got values in "
            f"[{float(rr.nan_to_num(nan=-1.0).min())}, {float(rr.nan_to_num(nan=2.0).max())}] or NaN"
        )
    x = v_theta
    r_e = _expand(rr, x, frame_dim, "r", dt)
    s = expand_sigma(sigma.detach() if isinstance(sigma, torch.Tensor) else sigma, x, frame_dim, dtype=dt)
    m = _element_mask(mask, x, frame_dim)
    counts = _sample_counts(m, x)
    zero = torch.zeros((), dtype=dt, device=x.device)

    vt = v_theta.to(dt)
    vo = v_old.detach().to(dt)
    xt, x0d = x_t.detach().to(dt), x0.detach().to(dt)
    v_pos = beta * vt + (1.0 - beta) * vo
    v_neg = (1.0 + beta) * vo - beta * vt

    if adaptive:

        def per_element(v: torch.Tensor) -> torch.Tensor:
            res = xt - s * v - x0d
            if m is not None:  # select before squaring: masked-out entries get zero (never NaN) gradients
                res = torch.where(m, res, zero)
            with torch.no_grad():
                norm = _per_sample_mean(res.detach().to(torch.float64).abs(), m, counts)
                norm = norm.clamp_min(floor).to(dt).reshape((-1,) + (1,) * (x.ndim - 1))
            return res.square() / norm

    else:
        s_full = s.expand(x.shape)
        used = s_full > 0 if m is None else (s_full > 0) | ~m
        if not bool(used.all()):
            bad = s_full[~used]
            raise ValueError(
                f"velocity-form nft_loss needs sigma > 0 on every masked-in element (u = (x_t - x0) / sigma), "
                f"got sigma = {float(bad.min())}; mask out clean (sigma = 0) frames or use adaptive=True"
            )
        safe_s = torch.where(s_full > 0, s_full, torch.ones((), dtype=dt, device=x.device))
        u = (xt - x0d) / safe_s

        def per_element(v: torch.Tensor) -> torch.Tensor:
            diff = v - u
            if m is not None:
                diff = torch.where(m, diff, zero)
            return diff.square()

    el = r_e * per_element(v_pos) + (1.0 - r_e) * per_element(v_neg)
    if m is not None:
        el = torch.where(m, el, zero)
    return (c / beta) * _per_sample_mean(el, m, counts).mean()


def ref_regularizer(
    v_theta: torch.Tensor,
    v_ref: torch.Tensor,
    mask: torch.Tensor | None = None,
    frame_dim: int = 1,
) -> torch.Tensor:
    """Anti-forgetting regulariser: mean squared distance of the policy velocity to a frozen reference.

    ``L = mean_b mean_{e in sample b} (v_theta - v_ref)^2`` (each sample's mean over its masked-in
    elements with ``mask``; samples weigh equally). Without a mask this is the mean over all
    elements, DiffusionNFT's "KL" term; the caller multiplies by its coefficient (DiffusionNFT 1e-4).
    v_ref is detached. Float32 (float64 when an input is float64).

    Args:
        v_theta: current policy velocity with graph, any shape [B, ...].
        v_ref: frozen reference (initial student) velocity at the same input, same shape.
        mask: optional per-frame mask [B, T] (bool or 0/1), T on ``frame_dim``.
        frame_dim: frame dim of the latents.

    Returns:
        0-d tensor >= 0, differentiable w.r.t. v_theta.

    Raises:
        ValueError: shapes differ, ``mask`` does not fit, or a sample's mask is empty.

    Source: DiffusionNFT (Zheng et al. 2025) KL-to-reference term ||v_theta - v_ref||^2;
    docs/methods/distillation.md (AFD, step 4: the reference weight).
    """
    _check_same_shape("v_theta", v_theta, v_ref=v_ref)
    return sample_mse(v_theta, v_ref.detach(), mask, frame_dim).mean()
