"""The two-stage collect phase of Sol-RL: preview a large candidate pool cheaply, keep a contrastive few, regenerate
them in full precision and train on those only (docs/methods/sol_rl.md).

Sol-RL (Li, Chen, Xue et al. 2026, "FP4 Explore, BF16 Train", arXiv 2604.06916), per iteration and prompt:

1. **preview**: the N candidates of the prompt (the data module's ``group_size``: each row is one candidate with its
   own noise address, the sample ``index``) are sampled by a low-precision rollout copy of the policy
   (:class:`~genrl.models.roles.RolloutCopy`, refreshed in place from the rolling-out weights first), optionally
   with fewer steps, decoded and scored; only the rewards are kept;
2. **select** K of N per prompt from the preview rewards (:func:`genrl.flow.selection.select_candidates`: best /
   worst by default);
3. the method then **regenerates** the K chosen rows with its own collect phase (same noise addresses, full
   precision, full steps) and trains on them alone, so the update never sees a low-precision sample; the
   regenerated rewards give the preview's ranking fidelity (:func:`log_proxy_fidelity`), logged every iteration
   (the method's load-bearing assumption).

Any method with a flat or endpoint collect phase composes this (RAM / DiffusionNFT / AWM and GRPO take a
``preview`` argument): :func:`configure_preview` declares the rollout-copy role, :func:`select_batch` runs stages 1
and 2 and returns the sub-batch to regenerate.

Logged: ``preview/reward`` (mean over the pool), ``preview/selected_reward``, ``preview/invalid_fraction``,
``preview/refresh_seconds`` and ``preview/max_weight_change`` (the rollout copy's refresh), ``preview/seconds``
(preview sampling, decoding and scoring), and after the regeneration ``preview/spearman``,
``preview/top_overlap``, ``preview/bottom_overlap`` (preview vs full-precision rewards of the kept candidates,
best / worst halves) and ``preview/reward_gap`` (full minus preview, mean over the kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from lightning.pytorch import LightningModule

from genrl.flow.selection import SelectionMode, proxy_fidelity, select_candidates
from genrl.methods.common import gather_batch
from genrl.models.quantized import RolloutPrecision
from genrl.noise import mix_seed, stream_id
from genrl.rollout.sampler import RolloutConfig, rollout

__all__ = ["PreviewConfig", "Selection", "configure_preview", "log_proxy_fidelity", "preview_config",
           "select_batch"]

#: the rollout-copy role a previewing method declares
ROLE = "rollout"
_STREAM_SELECT = stream_id("preview.select")


@dataclass
class PreviewConfig:
    """Sol-RL's candidate preview (see the module docstring). The pool size N is the data module's ``group_size``.

    Attributes:
        keep: K candidates kept per prompt and regenerated (1 <= K < N; Sol-RL: 24 of 96).
        selection: ``"best_worst"`` (Sol-RL; K odd: one more worst), ``"max_variance"``, ``"mean_deviation"`` or
            ``"random"``.
        num_steps: denoising steps of the preview (Sol-RL: 6, against 10 for the regeneration); None: the method's
            rollout steps (then, in the same precision, a regeneration reproduces its preview bitwise).
        precision: the rollout copy's :class:`~genrl.models.quantized.RolloutPrecision` (Sol-RL: NVFP4 on
            Blackwell; ``fp8`` on Hopper; on a CPU ``bf16`` is the fast one, ``fake_*`` simulate a format's error).
        micro_batch_size: samples per preview call (None: the rollout's).

    Raises:
        ValueError: keep < 1, num_steps < 1, an unknown selection mode.
    """

    keep: int = 8
    selection: SelectionMode = "best_worst"
    num_steps: int | None = None
    precision: RolloutPrecision = field(default_factory=RolloutPrecision)
    micro_batch_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.precision, dict):  # from a plain mapping (a config file read without jsonargparse)
            self.precision = RolloutPrecision(**self.precision)
        if not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"preview.keep (K candidates kept per prompt) must be an int >= 1, got {self.keep!r}")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"preview.num_steps must be >= 1 or null (the rollout's), got {self.num_steps}")
        if self.selection not in ("best_worst", "max_variance", "mean_deviation", "random"):
            raise ValueError(f"preview.selection {self.selection!r} is unknown; use best_worst, max_variance, "
                             f"mean_deviation or random")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"preview.micro_batch_size must be >= 1 or null, got {self.micro_batch_size}")


@dataclass
class Selection:
    """What :func:`select_batch` chose on this rank.

    Attributes:
        rows: local row indices of the kept candidates, int64 [G * K], group by group (each group's rows ascending).
        preview_rewards: their preview rewards, float32 [G * K] (NaN where the preview reward failed).
        keep: K.
        stats: the logged preview statistics.
    """

    rows: torch.Tensor
    preview_rewards: torch.Tensor
    keep: int
    stats: dict[str, float] = field(default_factory=dict)


def preview_config(config: RolloutConfig, preview: PreviewConfig) -> RolloutConfig:
    """The rollout config of the preview: ``config`` with the preview's steps and micro-batch (an SDE window is
    clipped to the preview's steps)."""
    steps = preview.num_steps or config.num_steps
    changes = {"num_steps": steps}
    if preview.micro_batch_size is not None:
        changes["micro_batch_size"] = preview.micro_batch_size
    if steps != config.num_steps:
        changes["schedule"] = None
        if getattr(config, "window_end", None) is not None:
            changes["window_end"] = min(config.window_end, steps)
        if getattr(config, "window_start", 0) >= steps:
            changes["window_start"] = 0
    return RolloutConfig(**{**vars(config), **changes})


def configure_preview(method: LightningModule, generator) -> None:
    """Declare the rollout copy of ``generator`` in ``method.preview.precision`` (role ``"rollout"``), when the method
    previews (``method.preview`` not None)."""
    if getattr(method, "preview", None) is not None:
        method.roles.rollout_copy(ROLE, generator, method.preview.precision)


def _groups_of(group: torch.Tensor, pool: int | None = None) -> list[torch.Tensor]:
    """The local rows of each group, in first-appearance order; every group must have the same size."""
    order = []
    seen: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        if g not in seen:
            seen[g] = []
            order.append(g)
        seen[g].append(i)
    sizes = {len(v) for v in seen.values()}
    if len(sizes) != 1:
        raise ValueError(f"the candidate preview needs each prompt's whole pool on one device, got groups of sizes "
                         f"{sorted(sizes)} here; make data.init_args.prompts_per_batch a multiple of the number of "
                         f"data-parallel processes")
    return [torch.tensor(seen[g]) for g in order]


def select_batch(method: LightningModule, prompts: list[str], index: torch.Tensor, group: torch.Tensor,
                 config: RolloutConfig, iteration: int,
                 policy: Callable[[], object] | None = None) -> tuple[list[str], torch.Tensor, torch.Tensor, Selection]:
    """Stages 1 and 2 of Sol-RL on this rank's batch: refresh the rollout copy from the weights ``policy`` applies
    (None: the live policy; RAM: ``lambda: roles.swap(generator, "old_policy")``), preview every row with it (noise
    addressed by (``method.hparams.seed``, ``index``)), score, keep K per group.

    Args:
        method: a method with ``generator``, ``roles`` (holding the ``"rollout"`` copy), ``scorer``, ``preview``,
            ``latent_shape`` and ``hparams.seed``.
        prompts / index / group: the local batch (N rows per group, each group whole on this rank).
        config: the method's rollout config (the regeneration's); the preview uses :func:`preview_config` of it.
        iteration: addresses the SDE window and the random selection.
    Returns:
        (prompts, index, group) of the kept rows and the :class:`Selection`.
    Raises:
        ValueError: a group split over ranks, or K >= N (nothing to select).
        RuntimeError: every preview reward failed.
    """
    pv, gen = method.preview, method.generator
    groups = _groups_of(group)
    pool = len(groups[0])
    if pv.keep >= pool:
        raise ValueError(f"preview.keep = {pv.keep} must be smaller than the candidate pool N = "
                         f"data.init_args.group_size = {pool} (Sol-RL keeps 24 of 96)")
    start = time.perf_counter()
    with torch.no_grad():
        with policy() if policy is not None else nullcontext():
            refresh = method.roles.sync(ROLE)
        was = gen.training
        gen.eval()
        with method.roles.swap(gen, ROLE):
            x0 = rollout(gen, prompts, method.latent_shape, method.hparams.seed, index, preview_config(config, pv),
                         rollout_id=iteration, record=False).final
        pixels = gen.decode(x0.to(gen.device))
        gen.train(was)
    result = method.scorer(pixels, prompts)
    total = result.total.detach().float().cpu()
    valid = result.valid.detach().cpu() & torch.isfinite(total)
    g_valid = gather_batch(method, valid.to(method.device)).cpu()
    if not bool(g_valid.any()):
        raise RuntimeError(f"iteration {iteration}: every preview reward is invalid (NaN); the reward model is failing "
                           f"(see the logged warnings)")
    rows = torch.stack(groups)  # [G, N]
    # a failed preview is never selected while its prompt has K valid candidates (select_candidates' valid)
    rng = torch.Generator().manual_seed(mix_seed(method.hparams.seed, iteration, _STREAM_SELECT, int(index[0])))
    chosen = select_candidates(total[rows].double(), pv.keep, pv.selection, generator=rng,
                               valid=valid[rows])  # [G, K] columns, ascending
    kept = rows.gather(1, chosen).reshape(-1)
    seconds = time.perf_counter() - start
    g_total = gather_batch(method, total.to(method.device)).cpu()
    g_kept = gather_batch(method, torch.where(valid[kept], total[kept], float("nan")).to(method.device)).cpu()
    stats = {"preview/reward": float(g_total[g_valid].mean()),
             "preview/selected_reward": float(g_kept.nanmean()),
             "preview/invalid_fraction": float((~g_valid).float().mean()),
             "preview/refresh_seconds": refresh["seconds"],
             "preview/max_weight_change": refresh["max_weight_change"],
             "preview/seconds": seconds}
    method.log_dict(stats, batch_size=len(prompts))
    selection = Selection(kept, torch.where(valid[kept], total[kept], float("nan")), pv.keep, stats)
    return [prompts[i] for i in kept.tolist()], index[kept], group[kept], selection


def log_proxy_fidelity(method: LightningModule, selection: Selection | None, full: torch.Tensor,
                       valid: torch.Tensor) -> dict[str, float]:
    """Log how well the preview ranked the kept candidates: Spearman and best / worst-half overlap (k = max(1, K //
    2)) of the preview vs the regenerated rewards per prompt, averaged over the gathered prompts, and the mean reward
    gap (full minus preview). No-op (returns {}) when ``selection`` is None.

    Args:
        full: this rank's regenerated rewards, [G * K] in the selection's row order; valid: their validity mask.
    """
    if selection is None:
        return {}
    full = torch.where(valid.cpu(), full.detach().float().cpu(), float("nan"))
    k = selection.keep
    prev = gather_batch(method, selection.preview_rewards.to(method.device)).cpu().double().reshape(-1, k)
    reg = gather_batch(method, full.to(method.device)).cpu().double().reshape(-1, k)
    fid = proxy_fidelity(prev, reg, max(1, k // 2))
    stats = {"preview/spearman": fid["spearman"], "preview/top_overlap": fid["top_overlap"],
             "preview/bottom_overlap": fid["bottom_overlap"], "preview/reward_gap": float((reg - prev).nanmean())}
    method.log_dict(stats, batch_size=len(full))
    return stats
