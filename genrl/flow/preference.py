"""Preference and group-preference losses on per-sample flow-matching errors: Diffusion-DPO, DGPO, CRD.

Every objective here trains on the "DSM error" of a clean sample x0 at a noise level sigma with noise eps,

    e(x0, eps, sigma) = mean_j (v_pred(x_sigma)_j - (eps - x0)_j)^2,   x_sigma = (1 - sigma) x0 + sigma eps,

i.e. `genrl.flow.fm_core.sample_mse` (``sample_mse(v, eps - x0)``), one value per sample. The functions take
these errors (of the trained policy, of a frozen reference, of an "old" snapshot) as [B] tensors and return
losses, logits or masks; drawing (sigma, eps), running the models and reducing across ranks is the caller's
job. Nothing here keeps state or communicates.

* `dpo_loss`: flow-matching Diffusion-DPO on (winner, loser) pairs.
* `dgpo_group_logits`, `dgpo_surrogate`: DGPO's group logit z_g and its gradient-equivalent per-sample
  surrogate; `dsm_clip_keep` / `apply_keep`: DGPO's PPO-style "DSM clipping" of the per-sample error.
* `crd_implicit_reward`, `crd_centering`, `crd_loss`, `crd_kl_weight`: Centered Reward Distillation.

Conventions (docs/architecture.md, Conventions): sigma in [0, 1] (0 = data, 1 = noise); velocity v = eps - x0;
sigmoid is the logistic function; "sg" is stop-gradient (``detach``). Math runs in float32, float64 when any
tensor input is float64 (`genrl.flow.broadcast.compute_dtype`).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from genrl.flow.broadcast import compute_dtype

__all__ = [
    "DPOWeighting",
    "CRDMode",
    "CRD_MIN_SCALE",
    "dpo_loss",
    "dgpo_group_logits",
    "dgpo_surrogate",
    "dsm_clip_keep",
    "apply_keep",
    "crd_implicit_reward",
    "CRDCentering",
    "crd_centering",
    "crd_loss",
    "CRD_KL_FLOOR",
    "crd_kl_weight",
]

DPOWeighting = Literal["velocity", "epsilon"]
_DPO_WEIGHTINGS: tuple[str, ...] = ("velocity", "epsilon")

CRDMode = Literal["mse", "bce"]
_CRD_MODES: tuple[str, ...] = ("mse", "bce")

CRD_MIN_SCALE = 1e-5
"""Floor of CRD's adaptive per-sample error scale w = sg(mean |v - u|)."""

CRD_KL_FLOOR = 1e-4
"""CRD's reward-adaptive KL coefficient of a sample with the lowest reward (a = 0)."""


# ----------------------------------------------------------------------------------------------
# argument checks


def _positive(name: str, value: object) -> float:
    """A finite number > 0 as a float; ValueError naming ``name`` and the value otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _vectors(**tensors: torch.Tensor) -> int:
    """All arguments are real 1-d tensors of one length B >= 1; returns B. ValueError naming them otherwise."""
    first_name, first = None, None
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 1 or t.shape[0] < 1:
            raise ValueError(
                f"{name} must be a non-empty 1-d tensor (one value per sample), got shape {tuple(t.shape)}"
            )
        if t.is_complex():
            raise ValueError(f"{name} must be real, got dtype {t.dtype}")
        if first is None:
            first_name, first = name, t
        elif t.shape != first.shape:
            raise ValueError(
                f"{first_name} of shape {tuple(first.shape)} and {name} of shape {tuple(t.shape)} must match"
            )
    assert first is not None
    return first.shape[0]


def _finite(name: str, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t.detach())
    if bool(bad.any()):
        idx = bad.nonzero().flatten().tolist()
        shown = ", ".join(str(i) for i in idx[:8]) + (", ..." if len(idx) > 8 else "")
        raise ValueError(f"{name} holds NaN / inf at sample(s) {shown}")


# ----------------------------------------------------------------------------------------------
# Diffusion-DPO / Flow-DPO


def dpo_loss(
    err_w: torch.Tensor,
    err_l: torch.Tensor,
    ref_err_w: torch.Tensor,
    ref_err_l: torch.Tensor,
    beta: float,
    sigma: torch.Tensor | None = None,
    weighting: DPOWeighting = "velocity",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-matching Diffusion-DPO loss per (winner, loser) pair.

        z = -(beta / 2) ((e_w - e_ref,w) - (e_l - e_ref,l)),   loss = -log sigmoid(z),

    with e the DSM errors of the trained policy and e_ref those of the frozen reference, all four of a pair
    taken at the SAME (sigma, eps) (the winner's and loser's x_sigma share the noise). z is the implicit
    reward of the winner minus that of the loser: the loss falls as the policy lowers its error on the winner
    (relative to the reference) more than on the loser. Properties: theta = ref gives z = 0, loss = log 2 and
    gradient (beta / 4) grad(e_w - e_l) per pair; swapping winner and loser negates z; as beta -> 0,
    (loss - log 2) / beta -> ((e_w - e_ref,w) - (e_l - e_ref,l)) / 4. ``-logsigmoid`` is evaluated stably,
    so |z| of 1e4 gives a finite loss (about |z| or 0) and gradient.

    ``weighting="epsilon"`` multiplies every error by (1 - sigma)^2 first: epsilon-prediction's error is
    (eps_hat - eps) = (1 - sigma)(v_hat - v), so this reproduces the sigma dependence of the original
    epsilon-MSE form with a velocity model. The reference errors are detached.

    Args:
        err_w: [P] DSM errors of the policy on the winners (with grad), e.g. ``sample_mse(v_w, eps - x0_w)``.
        err_l: [P] the policy's errors on the losers.
        ref_err_w: [P] the reference's errors on the winners (no grad needed; detached here).
        ref_err_l: [P] the reference's errors on the losers.
        beta: the DPO temperature, finite > 0 (the codebases' beta, already including their 1/2 and the
            element mean: 100 to 5000 in the reference configurations).
        sigma: [P] noise level of each pair in [0, 1]; required with ``weighting="epsilon"``, ignored
            otherwise.
        weighting: ``"velocity"`` (plain velocity MSE, the flow codebases) or ``"epsilon"``.

    Returns:
        (loss, stats). ``loss`` [P] per pair, float32 (float64 if an input is float64); average it over pairs
        yourself (the mean of -logsigmoid per pair, not -logsigmoid of a mean). ``stats`` holds detached 0-d
        tensors: ``z_mean``; ``reward_margin`` (the same mean of z, the implicit reward of the winner minus
        that of the loser); ``implicit_accuracy`` (fraction of pairs with z > 0); ``err_w``, ``err_l``,
        ``ref_err_w``, ``ref_err_l`` (means of the errors as passed in, before any epsilon weighting).

    Raises:
        ValueError: beta not finite > 0; the four errors not 1-d tensors of one length P >= 1 (the message
            names the two that differ); unknown weighting; ``"epsilon"`` without sigma, or a sigma that is not
            [P] (or 0-d) or lies outside [0, 1].

    Source: Wallace et al. 2024, Diffusion-DPO (CVPR), eq. 14, with T omega(lambda_t) dropped and beta / 2 on
    the element-mean error, the velocity (flow-matching) target replacing the epsilon target.
    """
    beta = _positive("beta", beta)
    p = _vectors(err_w=err_w, err_l=err_l, ref_err_w=ref_err_w, ref_err_l=ref_err_l)
    if weighting not in _DPO_WEIGHTINGS:
        raise ValueError(f"unknown DPO weighting {weighting!r}; expected one of {_DPO_WEIGHTINGS}")
    dt = compute_dtype(err_w, err_l, ref_err_w, ref_err_l, sigma)
    ew, el = err_w.to(dt), err_l.to(dt)
    rw, rl = ref_err_w.detach().to(dt), ref_err_l.detach().to(dt)
    if weighting == "epsilon":
        if sigma is None:
            raise ValueError("weighting 'epsilon' needs sigma, the [P] noise level of each pair")
        if not isinstance(sigma, torch.Tensor):
            raise ValueError(f"sigma must be a torch.Tensor [P] = [{p}], got {type(sigma).__name__}")
        if sigma.shape not in ((p,), ()):
            raise ValueError(f"sigma must be [P] = [{p}] (one noise level per pair), got shape {tuple(sigma.shape)}")
        s = sigma.detach().to(device=ew.device, dtype=dt)
        if not bool(((s >= 0) & (s <= 1)).all()):
            raise ValueError(f"sigma must lie in [0, 1], got values in [{float(s.min())}, {float(s.max())}]")
        w = (1 - s) ** 2
        ew, el, rw, rl = ew * w, el * w, rw * w, rl * w
    z = -(beta / 2) * ((ew - rw) - (el - rl))
    loss = -F.logsigmoid(z)
    with torch.no_grad():
        zd = z.detach()
        stats = {
            "z_mean": zd.mean(),
            "reward_margin": zd.mean(),
            "implicit_accuracy": (zd > 0).to(dt).mean(),
            "err_w": err_w.detach().to(dt).mean(),
            "err_l": err_l.detach().to(dt).mean(),
            "ref_err_w": ref_err_w.detach().to(dt).mean(),
            "ref_err_l": ref_err_l.detach().to(dt).mean(),
        }
    return loss, stats


# ----------------------------------------------------------------------------------------------
# DGPO


def dgpo_group_logits(
    err_diff: torch.Tensor,
    adv: torch.Tensor,
    group: torch.Tensor,
    beta: float,
    group_size: int,
) -> torch.Tensor:
    """DGPO's group logit z_g for every sample, from the policy-minus-reference DSM errors.

        z_g = (beta / K) sum_{i in g} A_i d_i,   d_i = e_theta,i - e_ref,i,

    returned at each sample's own group: out_i = z_{g(i)}. The group objective is
    J_g = -log sigmoid(-z_g) (maximising the log-odds that the advantage-positive members' implicit reward
    beats the negative ones'); its gradient is sigmoid(z_g) (beta / K) sum_i A_i grad e_theta,i, which
    `dgpo_surrogate` reproduces per sample from this z. Inputs are DETACHED: z is a constant weight.
    K is the nominal group size, not the number of members present, so a caller may pass a gathered batch
    (all ranks' members of each group) and get the group's full z; members of a group split across calls
    must be gathered first, or their partial sums all-reduced before the sigmoid. With zero-sum advantages
    inside a group and noise shared by its members, adding one constant to every e_theta,i and e_ref,i of the
    group leaves z_g unchanged; at theta = ref, z_g = 0.

    Args:
        err_diff: [B] d_i = e_theta,i - e_ref,i (DSM errors of policy and reference at the same (sigma, eps)).
        adv: [B] advantages A_i (e.g. `genrl.flow.policy.group_advantages`, clipped by the caller).
        group: [B] integer group id per sample (any values, any order; samples need not be contiguous).
        beta: finite > 0 (DGPO's beta_DPO: 10 to 100, 2000 to 5000 with an EMA reference).
        group_size: K >= 1, the nominal number of samples per group.

    Returns:
        [B] z of each sample's group, detached, float32 (float64 if err_diff or adv is float64), on
        err_diff's device.

    Raises:
        ValueError: shapes differ or are not 1-d; non-integer group ids; NaN / inf in err_diff or adv (it
            would spread to the whole group); beta not finite > 0; group_size not an integer >= 1; a group
            with more than group_size members (the message names the group and its count).

    Source: Luo et al. 2025, DGPO (arXiv 2510.08425), the group-level DPO objective with advantage-weighted
    implicit rewards.
    """
    beta = _positive("beta", beta)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    _vectors(err_diff=err_diff, adv=adv, group=group)
    if group.dtype.is_floating_point or group.dtype == torch.bool:
        raise ValueError(f"group must be an integer tensor of group ids, got dtype {group.dtype}")
    _finite("err_diff", err_diff)
    _finite("adv", adv)
    dt = compute_dtype(err_diff, adv)
    d = err_diff.detach().to(dt)
    a = adv.detach().to(device=d.device, dtype=dt)
    ids, inverse, counts = torch.unique(group.to(d.device), return_inverse=True, return_counts=True)
    over = counts > group_size
    if bool(over.any()):
        j = int(over.nonzero()[0, 0])
        raise ValueError(
            f"group {int(ids[j])} has {int(counts[j])} members, more than group_size = {group_size}; pass "
            "the nominal group size K (or fix the group ids)"
        )
    sums = torch.zeros(ids.shape[0], dtype=dt, device=d.device).index_add_(0, inverse, a * d)
    return (beta / group_size) * sums[inverse]


def dgpo_surrogate(err: torch.Tensor, adv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """DGPO's gradient-equivalent per-sample surrogate: sg(sigmoid(z_g(i))) A_i e_theta,i.

    Its value is not the objective; its gradient is. Summed over a group g with K members,

        grad sum_{i in g} surrogate_i = sigmoid(z_g) sum_i A_i grad e_theta,i = (K / beta) grad J_g,

    J_g = -log sigmoid(-z_g) with z_g = (beta / K) sum_i A_i (e_theta,i - e_ref,i) as a function of theta
    (d/dz [-log sigmoid(-z)] = sigmoid(z)). So for a batch of N samples in complete groups,
    grad mean(surrogate) = (K / (N beta)) grad sum_g J_g. At theta = ref (z = 0) the weight is 1/2 and the
    gradient is half the advantage-weighted flow-matching gradient (1/2) mean(A_i grad e_theta,i).

    Args:
        err: [B] DSM errors e_theta of the policy (with grad).
        adv: [B] advantages A_i (detached here).
        z: [B] each sample's group logit, from `dgpo_group_logits` (detached here).

    Returns:
        [B] per-sample surrogate, float32 (float64 if an input is float64); average it over the batch.

    Raises:
        ValueError: the three are not 1-d tensors of one length.

    Source: Luo et al. 2025, DGPO (arXiv 2510.08425), gradient of the group objective.
    """
    _vectors(err=err, adv=adv, z=z)
    dt = compute_dtype(err, adv, z)
    e = err.to(dt)
    weight = torch.sigmoid(z.detach().to(device=e.device, dtype=dt))
    return weight * adv.detach().to(device=e.device, dtype=dt) * e


def dsm_clip_keep(err: torch.Tensor, old_err: torch.Tensor, adv: torch.Tensor, clip_range: float) -> torch.Tensor:
    """DGPO's "DSM clipping" mask: which samples keep their error gradient.

        rho_i = exp(e_old,i - e_theta,i),
        keep_i = not ((A_i > 0 and rho_i > 1 + eps) or (A_i < 0 and rho_i < 1 - eps)),

    the PPO clip transferred to the DSM error (exp(-e) plays the likelihood): once the policy has lowered the
    error of a positive sample (raised that of a negative sample) by more than the trust region relative to
    the "old" snapshot (a fast EMA in DGPO), that sample's gradient is cut. Sign-aware: a positive sample whose
    error went up, or a negative one whose error went down, keeps its gradient; A = 0 always keeps. At
    theta = old, rho = 1 and every sample is kept. Apply the mask with `apply_keep`.

    Args:
        err: [B] DSM errors of the policy (detached here).
        old_err: [B] DSM errors of the old snapshot at the same (sigma, eps).
        adv: [B] advantages.
        clip_range: eps, finite > 0 (DGPO: 1e-2; 1e-5 to 1e-4 in its CFG-free modes).

    Returns:
        [B] bool, True where the sample's gradient is kept.

    Raises:
        ValueError: clip_range not finite > 0; the three are not 1-d tensors of one length.

    Source: Luo et al. 2025, DGPO (arXiv 2510.08425), DSM clipping; Schulman et al. 2017, PPO, eq. 7.
    """
    eps = _positive("clip_range", clip_range)
    _vectors(err=err, old_err=old_err, adv=adv)
    e = err.detach().to(torch.float64)
    rho = torch.exp(old_err.detach().to(device=e.device, dtype=torch.float64) - e)
    a = adv.detach().to(e.device)
    cut = ((a > 0) & (rho > 1 + eps)) | ((a < 0) & (rho < 1 - eps))
    return ~cut


def apply_keep(err: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``where(keep, err, sg(err))``: the same values, with zero gradient at the samples not kept.

    Args:
        err: [B] per-sample errors (with grad).
        keep: [B] bool, e.g. from `dsm_clip_keep`.

    Returns:
        [B], err's dtype; equal to ``err`` in value.

    Raises:
        ValueError: shapes differ; keep is not bool.
    """
    _vectors(err=err, keep=keep)
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor, got dtype {keep.dtype}")
    return torch.where(keep.to(err.device), err, err.detach())


# ----------------------------------------------------------------------------------------------
# CRD


def _scale(
    name: str, scale: torch.Tensor | None, b: int, device: torch.device, dt: torch.dtype
) -> torch.Tensor | float:
    if scale is None:
        return 1.0
    if not isinstance(scale, torch.Tensor) or scale.shape != (b,):
        shape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"{name} must be a [B] = [{b}] tensor (one scale per sample) or None, got {shape}")
    _finite(name, scale)
    return scale.detach().to(device=device, dtype=dt).clamp_min(CRD_MIN_SCALE)


def crd_implicit_reward(
    err: torch.Tensor,
    old_err: torch.Tensor,
    scale: torch.Tensor | None = None,
    old_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """CRD's implicit reward of each sample: r_theta = -(e_theta / w_theta - e_old / w_old).

    e are DSM errors at the same (sigma, eps) of the policy and of the "old" snapshot; the implicit reward is
    positive where the policy fits the sample better than the snapshot. w = 1 when the scale is None; CRD's
    adaptive mode passes the detached per-sample scale w = mean_j |v - (eps - x0)|_j of each model, clamped
    here to >= `CRD_MIN_SCALE`. At theta = old with w = 1, r_theta = 0 exactly.

    Args:
        err: [B] the policy's DSM errors (with grad).
        old_err: [B] the snapshot's errors (detached here).
        scale: optional [B] w_theta (detached and clamped here).
        old_scale: optional [B] w_old (detached and clamped here); each scale is independent of the other.

    Returns:
        [B] r_theta, float32 (float64 if an input is float64).

    Raises:
        ValueError: err / old_err not 1-d tensors of one length; a scale that is not [B] or holds NaN / inf.

    Source: CRD, Centered Reward Distillation (arXiv 2603.14128), the implicit reward of the policy against
    the old model.
    """
    b = _vectors(err=err, old_err=old_err)
    dt = compute_dtype(err, old_err, scale, old_scale)
    e = err.to(dt)
    w = _scale("scale", scale, b, e.device, dt)
    w_old = _scale("old_scale", old_scale, b, e.device, dt)
    return -(e / w - old_err.detach().to(device=e.device, dtype=dt) / w_old)


class CRDCentering(NamedTuple):
    """The centred quantities of `crd_centering`, one row per centering direction ([D, B], D = 1 or 2)."""

    a: torch.Tensor
    """[B] the advantage mapped to [0, 1]: clip(A, -c, c) / (2c) + 1/2 (detached)."""
    p: torch.Tensor
    """[D, B] centering weights, each row sums to 1 (detached); [D, N] over the centering set given as ``over``."""
    target: torch.Tensor
    """[D, B] R_c = a - sum_j p_j a_j (detached); sum_i p_i R_c,i = 0 in each row."""
    reward: torch.Tensor
    """[D, B] R_theta_c = r_theta - sg(sum_j p_j r_theta,j) (gradient through r_theta only)."""


def _unit_advantage(adv: torch.Tensor, c: float, device: torch.device, dt: torch.dtype) -> torch.Tensor:
    """a = clip(A, -c, c) / (2c) + 1/2 in [0, 1], detached."""
    return adv.detach().to(device=device, dtype=dt).clamp(-c, c) / (2 * c) + 0.5


def crd_centering(
    r_theta: torch.Tensor,
    adv: torch.Tensor,
    weight_temp: float = -1.0,
    adv_clip: float = 5.0,
    over: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> CRDCentering:
    """CRD's centred target and centred implicit reward (the inputs of `crd_loss`).

        a = clip(A, -c, c) / (2c) + 1/2 in [0, 1],
        R_c = a - sum_j p_j a_j,   R_theta_c = r_theta - sg(sum_j p_j r_theta,j),

    with centering weights p over the whole batch given:

    * ``weight_temp < 0``: uniform, p_j = 1 / B (one direction, D = 1);
    * ``weight_temp > 0`` (tau): two directions (D = 2), p+ = softmax(a / tau) (centred on the high-reward
      samples) and p- = softmax(-a / tau) (on the low-reward ones); `crd_loss` averages the two.

    ``weight_temp == 0`` (CRD's hard positive / negative pools) is not supported.

    ``over = (r_all, adv_all)`` centres the B rows given on a larger set of N samples that holds them: p, the
    centre sum_j p_j a_j and the stop-gradient centre sum_j p_j r_all,j are taken over the set, R_c and
    R_theta_c are returned for the B rows. CRD centres over the whole batch gathered from every rank and
    micro-batch, while each micro-batch carries its own graph: ``r_all`` then comes from a pass without graph.
    Rows and set may be given in any split: the rows' results do not depend on it (micro-batch invariance).

    Args:
        r_theta: [B] implicit rewards (`crd_implicit_reward`, with grad).
        adv: [B] advantages (detached here; finite).
        weight_temp: tau, see above; NaN and 0 are rejected.
        adv_clip: c, finite > 0 (5 in CRD).
        over: optional (r_all [N], adv_all [N]), the centering set (detached here; finite advantages);
            None: the B rows given are the set.

    Returns:
        `CRDCentering` (a [B], p [D, B] or [D, N] with ``over``, target [D, B], reward [D, B]); float32
        (float64 if an input is float64).

    Raises:
        ValueError: shapes (also of ``over``); NaN / inf advantages; adv_clip not finite > 0; weight_temp 0 or
            NaN (the message names the supported values).

    Source: CRD, Centered Reward Distillation (arXiv 2603.14128), centred reward matching.
    """
    c = _positive("adv_clip", adv_clip)
    _vectors(r_theta=r_theta, adv=adv)
    _finite("adv", adv)
    tau = float(weight_temp)
    if math.isnan(tau) or tau == 0:
        raise ValueError(
            f"weight_temp {weight_temp!r} is not supported: use a value < 0 (uniform centering over the batch) "
            "or > 0 (softmax(+-a / weight_temp) centering, the two directions averaged); the hard "
            "positive / negative pools of weight_temp = 0 are not implemented"
        )
    if over is not None:
        _vectors(r_all=over[0], adv_all=over[1])
        _finite("adv_all", over[1])
    dt = compute_dtype(r_theta, adv, *(over or ()))
    r = r_theta.to(dt)
    a = _unit_advantage(adv, c, r.device, dt)
    if over is None:
        r_set, a_set = r.detach(), a
    else:
        r_set, a_set = over[0].detach().to(device=r.device, dtype=dt), _unit_advantage(over[1], c, r.device, dt)
    if tau < 0:
        p = torch.full_like(a_set, 1.0 / a_set.shape[0]).unsqueeze(0)
    else:
        p = torch.stack([torch.softmax(a_set / tau, dim=0), torch.softmax(-a_set / tau, dim=0)])
    target = a.unsqueeze(0) - (p * a_set).sum(dim=1, keepdim=True)
    reward = r.unsqueeze(0) - (p * r_set).sum(dim=1, keepdim=True)
    return CRDCentering(a=a, p=p, target=target, reward=reward)


def crd_loss(
    r_theta: torch.Tensor,
    adv: torch.Tensor,
    beta: float,
    mode: CRDMode = "mse",
    weight_temp: float = -1.0,
    adv_clip: float = 5.0,
    over: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Centered Reward Distillation: match the centred implicit reward to the centred external reward.

    With a, R_c, R_theta_c from `crd_centering` (centering over the whole batch given),

        mse:  L = mean_i (beta R_theta_c,i - R_c,i)^2,
        bce:  L = mean_i BCE(logit = beta R_theta_c,i, target = sigmoid(R_c,i)),

    averaged over the two directions when ``weight_temp > 0``. The loss is 0 (mse) iff beta R_theta_c = R_c;
    adding one constant to every r_theta leaves it unchanged (it is centred away). The returned loss is NOT
    scaled: CRD multiplies it by c / beta (5 / beta at the default clip c = 5) to normalise the gradient
    size, which is the calling method's job (as are the KL term and the snapshots).

    The mean runs over the B rows given. Without ``over`` they are also the centering set: pass the samples
    the centering should cover (one group, or a whole batch). With ``over = (r_all, adv_all)`` the rows are
    centred on that larger set (`crd_centering`), so a batch split into micro-batches (or ranks) gives, as the
    row-count-weighted mean of its parts, the loss and gradient of the whole batch.

    Args:
        r_theta: [B] implicit rewards (`crd_implicit_reward`, with grad).
        adv: [B] advantages (detached).
        beta: finite > 0.
        mode: ``"mse"`` or ``"bce"``.
        weight_temp: centering temperature (`crd_centering`): < 0 uniform, > 0 two-direction softmax.
        adv_clip: c, finite > 0.
        over: optional (r_all [N], adv_all [N]), the centering set (`crd_centering`).

    Returns:
        (loss, stats): ``loss`` a 0-d tensor, float32 (float64 if an input is float64); ``stats`` detached
        0-d tensors ``r_theta_mean``, ``r_theta_std`` (ddof 0), ``a_mean`` and ``fit_abs_mean``
        (mean |beta R_theta_c - R_c| over rows and samples).

    Raises:
        ValueError: beta or adv_clip not finite > 0; unknown mode; unsupported weight_temp; shapes; NaN / inf
            advantages.

    Source: CRD, Centered Reward Distillation (arXiv 2603.14128), centred reward distillation loss.
    """
    beta = _positive("beta", beta)
    if mode not in _CRD_MODES:
        raise ValueError(f"unknown CRD mode {mode!r}; expected one of {_CRD_MODES}")
    cen = crd_centering(r_theta, adv, weight_temp=weight_temp, adv_clip=adv_clip, over=over)
    logits = beta * cen.reward
    if mode == "mse":
        per_dir = (logits - cen.target).square().mean(dim=1)
    else:
        per_dir = F.binary_cross_entropy_with_logits(logits, torch.sigmoid(cen.target), reduction="none").mean(dim=1)
    loss = per_dir.mean()
    with torch.no_grad():
        rd = r_theta.detach().to(logits.dtype)
        stats = {
            "r_theta_mean": rd.mean(),
            "r_theta_std": rd.std(correction=0),
            "a_mean": cen.a.mean(),
            "fit_abs_mean": (logits.detach() - cen.target).abs().mean(),
        }
    return loss, stats


def crd_kl_weight(adv: torch.Tensor, kl_beta: float, adv_clip: float = 5.0) -> torch.Tensor:
    """CRD's reward-adaptive coefficient of the velocity KL to the reference, per sample:

        k_i = kl_beta (m + a_i (1 - m)),   m = `CRD_KL_FLOOR` / kl_beta,   i.e.   k_i = 1e-4 + a_i (kl_beta - 1e-4),

    with a = clip(A, -c, c) / (2c) + 1/2 in [0, 1]: the best-rewarded samples (a = 1) are held to the reference
    with the full kl_beta, the worst (a = 0) with 1e-4 only. The KL term is mean_i k_i mean_j (v_theta - v_ref)_j^2.

    Args:
        adv: [B] advantages (detached here; finite).
        kl_beta: finite > 0.
        adv_clip: c, finite > 0.

    Returns:
        [B] k, float32 (float64 if adv is float64), detached.

    Raises:
        ValueError: kl_beta or adv_clip not finite > 0; adv not a non-empty 1-d tensor or with NaN / inf.

    Source: CRD, Centered Reward Distillation (arXiv 2603.14128), the reward-adaptive KL of its released trainer.
    """
    kl = _positive("kl_beta", kl_beta)
    c = _positive("adv_clip", adv_clip)
    _vectors(adv=adv)
    _finite("adv", adv)
    return CRD_KL_FLOOR + _unit_advantage(adv, c, adv.device, compute_dtype(adv)) * (kl - CRD_KL_FLOOR)
