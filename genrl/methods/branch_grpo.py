"""BranchGRPO (Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
Models"): GRPO on tree rollouts with shared prefixes, depth-wise advantages and pruning.

Each iteration: one tree per prompt from the shared sampler's tree mode (:func:`genrl.rollout.tree.tree_rollout`),
rewards on the leaves (on the last step's clean-sample prediction, as the reference, or the final latent),
leaf rewards fused up the tree (:func:`genrl.flow.tree_advantages.fuse_rewards`), depth-wise advantages
(:func:`~genrl.flow.tree_advantages.depthwise_advantages`), pruning of the edges the gradient step sees
(:func:`~genrl.flow.tree_advantages.prune_edges`; rollouts and rewards unchanged; the depth window may slide and
pruning may stop part-way through training, both pure functions of the iteration), then the clipped policy loss
of :mod:`genrl.flow.policy` on every kept edge, with the edge log-prob recomputed by the same kernel the rollout
used (ratio exactly 1 on the first update). Composition, not inheritance: nothing here subclasses GRPO.

Optimization is manual: one optimizer step per mini-batch of ``edges_per_step`` edges (None: one per iteration),
so ``trainer.max_steps`` counts optimizer steps.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.policy import clipped_policy_loss
from genrl.flow.tree_advantages import (
    depthwise_advantages,
    fuse_rewards,
    prune_edges,
    pruning_active,
    sliding_prune_depths,
)
from genrl.methods.common import (
    advance_iteration,
    configure_policy,
    configure_policy_optimizer,
    init_method,
    ode_validation_config,
)
from genrl.methods.phases import collect_tree, flat_validation_step, optimizer_steps, score
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.noise import mix_seed, stream_id
from genrl.rollout.sampler import RolloutConfig, encode_cfg
from genrl.rollout.tree import TreeConfig, edge_log_prob

#: the stream of the kept leaves' order (genrl.noise.STREAMS).
_ORDER_STREAM = stream_id("branch_grpo.order")

__all__ = ["BranchGRPO"]


class BranchGRPO(LightningModule):
    """BranchGRPO on any Generator.

    Training batches come from :class:`genrl.data.PromptDataModule` with ``group_size: 1`` (the tree is the
    group): ``{"prompts": list[str] (P), "index": int64 [P]}``; validation batches are sampled with the ODE.

    Args:
        generator / latent_shape / lora: the policy, as in :class:`genrl.methods.GRPO`.
        rollout: the step kernel and schedule (BranchGRPO: 20 steps, dance_grpo, eta 0.3).
        tree: the :class:`TreeConfig` (split steps, branch factor, split noise scale, Mix, memory budget).
        reward_on: ``"x0"`` (the last step's clean-sample prediction, the reference) or ``"final"``.
        fusion: ``"mean"`` or ``"path_prob"`` (with ``fusion_alpha``).
        advantage_eps: the depth-wise std epsilon (1e-8).
        prune_depths: child depths (step + 1) whose edges are dropped from the gradient step (the window).
        prune_slide_interval: slide the depth window one depth shallower every this many iterations
            (BranchGRPO's ``--depth_pruning_slide`` with ``--depth_pruning_slide_interval``); None: a fixed window.
        prune_slide_stop_depth: the shallowest depth the sliding window reaches, then stays at (None: the last
            split step, as BranchGRPO; ``--depth_pruning_stop_depth``). Formula:
            :func:`~genrl.flow.tree_advantages.sliding_prune_depths`.
        width_ratio / width_mode: width pruning of the edges after the last split (0 disables it); ``width_ratio``
            is the fraction pruned per group, rounded to keep ceil(n (1 - width_ratio)) (BranchGRPO's
            ``width_pruning_ratio`` is the fraction kept: docs/methods/grpo.md converts).
        prune_step_ratio / prune_total_iterations: prune (depth and width) only in the first
            floor(prune_total_iterations * prune_step_ratio) iterations, then train every edge (BranchGRPO's
            ``--pruning_step_ratio`` of ``--max_train_steps``); ratio 1 (default) prunes throughout, a ratio < 1
            needs the total. Formula: :func:`~genrl.flow.tree_advantages.pruning_active`.
        rewards / reward_combine: as in GRPO.
        clip_range / clip_range_high / adv_clip_max: the clipped loss (BranchGRPO: 1e-3, 5).
        optimizer / max_grad_norm: as in GRPO.
        edges_per_step: edges per optimizer step (None: all kept edges in one step).
        eval_rollout: validation sampler (default ODE, 20 steps).
        seed: seed of all randomness.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        rollout: RolloutConfig | None = None,
        tree: TreeConfig | None = None,
        reward_on: Literal["x0", "final"] = "x0",
        fusion: Literal["mean", "path_prob"] = "mean",
        fusion_alpha: float = 1.0,
        advantage_eps: float = 1e-8,
        prune_depths: list[int] | None = None,
        prune_slide_interval: int | None = None,
        prune_slide_stop_depth: int | None = None,
        width_ratio: float = 0.0,
        width_mode: Literal["chain", "extremes"] = "chain",
        prune_step_ratio: float = 1.0,
        prune_total_iterations: int | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum"] = "weighted_sum",
        clip_range: float = 1e-3,
        clip_range_high: float | None = None,
        adv_clip_max: float = 5.0,
        lora: LoraSpec | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        edges_per_step: int | None = None,
        eval_rollout: RolloutConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if edges_per_step is not None and edges_per_step < 1:
            raise ValueError(f"edges_per_step must be >= 1 or null, got {edges_per_step}")
        if reward_on not in ("x0", "final"):
            raise ValueError(f"reward_on must be 'x0' or 'final', got {reward_on!r}")
        init_method(self, generator, rewards, reward_combine)
        self.rollout_config = rollout or RolloutConfig(num_steps=20, kernel="dance_grpo", noise_level=0.3,
                                                       skip_last_step=False)
        self.tree_config = tree or TreeConfig()
        self.tree_config.check(self.rollout_config.num_steps)
        if prune_slide_interval is not None and not prune_depths:
            raise ValueError("prune_slide_interval slides the depth-pruning window, but prune_depths is empty")
        if prune_slide_stop_depth is not None and prune_slide_interval is None:
            raise ValueError("prune_slide_stop_depth is set but prune_slide_interval is null (a fixed window)")
        try:  # a bad pruning schedule fails here, not at the first training step
            self.pruning_at(0)
        except ValueError as e:
            raise ValueError(
                f"pruning options prune_depths={prune_depths}, prune_slide_interval={prune_slide_interval}, "
                f"prune_slide_stop_depth={prune_slide_stop_depth} (null: the last split step "
                f"{max(self.tree_config.split_steps)}), prune_step_ratio={prune_step_ratio}, "
                f"prune_total_iterations={prune_total_iterations}: {e}"
            ) from e
        self.eval_config = eval_rollout or ode_validation_config(self.rollout_config, num_steps=20)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer

    # ------------------------------------------------------------------ construction (as GRPO)
    configure_model = configure_policy

    configure_optimizers = configure_policy_optimizer

    # ------------------------------------------------------------------ the pieces
    def pruning_at(self, iteration: int) -> tuple[list[int], float]:
        """The pruning of a 0-based training iteration: (the depth window, the width ratio). Both empty / 0 once
        ``prune_step_ratio`` has stopped pruning; the window slid per ``prune_slide_interval``.

        Raises:
            ValueError: a bad schedule (see :func:`~genrl.flow.tree_advantages.sliding_prune_depths` and
                :func:`~genrl.flow.tree_advantages.pruning_active`).
        """
        h = self.hparams
        stop = h.prune_slide_stop_depth if h.prune_slide_stop_depth is not None else max(self.tree_config.split_steps)
        depths = sliding_prune_depths(h.prune_depths or [], iteration, h.prune_slide_interval, stop)
        if not pruning_active(iteration, h.prune_step_ratio, h.prune_total_iterations):
            return [], 0.0
        return depths, h.width_ratio

    def tree_advantages(self, ro, leaf_rewards: torch.Tensor, leaf_valid: torch.Tensor,
                        iteration: int | None = None):
        """(edges, per-edge advantages, kept mask) of a tree rollout and its leaf rewards, pruned as at
        ``iteration`` (default: the current one)."""
        fused, ok = fuse_rewards(ro.parent, leaf_rewards, leaf_valid, ro.log_probs, self.hparams.fusion,
                                 self.hparams.fusion_alpha)
        node_adv = depthwise_advantages(fused, ok, ro.tree, eps=self.hparams.advantage_eps)
        edges = ro.edges()  # ordered by step, then child: the per-step node advantages line up
        adv = torch.cat([node_adv[k + 1] for k in range(ro.num_steps) if bool(ro.sde_mask[k])])
        depths, width_ratio = self.pruning_at(int(self.iteration) if iteration is None else iteration)
        keep = prune_edges(edges, adv, self.tree_config.split_steps, ro.num_steps, depths=depths,
                           width_ratio=width_ratio, width_mode=self.hparams.width_mode, chain_id=edges["child"])
        return edges, adv, keep

    # ------------------------------------------------------------------ training
    def edge_loss(self, ro, edges, adv, sel: torch.Tensor, k: int, cond_t, uncond_t):
        """Clipped surrogate (per edge, [len(sel)]) on the kept edges ``sel`` of step ``k``, the edge log-prob
        recomputed with the rollout's kernel (ratio exactly 1 on the first update)."""
        child = edges["child"][sel]
        rows = ro.tree[k + 1][child]
        lp, _ = edge_log_prob(self.generator, ro, k, child, cond_t.select(rows),
                              uncond_t.select(rows) if uncond_t is not None else None)
        h = self.hparams
        return clipped_policy_loss(lp, ro.log_probs[k + 1][child].to(lp.device), adv[sel].to(lp.device),
                                   clip_range=h.clip_range, clip_range_high=h.clip_range_high,
                                   adv_clip_max=h.adv_clip_max)

    def training_step(self, batch: dict, batch_idx: int) -> None:
        prompts, index = list(batch["prompts"]), batch["index"].cpu()
        gen, cfg, it, seed = self.generator, self.rollout_config, int(self.iteration), self.hparams.seed
        leaves = collect_tree(gen, prompts, self.latent_shape, seed, index, cfg, self.tree_config,
                              self.hparams.reward_on)
        scores = score(self, self.scorer, leaves, iteration=it)
        ro, result, bs = leaves.samples, scores.result, len(leaves.prompts)
        edges, adv, keep = self.tree_advantages(ro, torch.nan_to_num(result.total), result.valid, it)
        self.log("tree/edges", float(keep.numel()), batch_size=bs)
        self.log("tree/edges_trained", float(keep.sum()), batch_size=bs)
        self.log("tree/denoiser_evals", float(ro.denoiser_evals), batch_size=bs)

        # the kept edges in a seeded order, grouped by step inside each optimizer step (one network call per step)
        cond_t, uncond_t = encode_cfg(gen, prompts, cfg)
        kept = torch.nonzero(keep).flatten()
        g = torch.Generator().manual_seed(mix_seed(seed, it, _ORDER_STREAM))
        order = kept[torch.randperm(len(kept), generator=g)]
        per_step = self.hparams.edges_per_step or len(order)

        def unit(sel: torch.Tensor, k: int, n_chunk: int):
            loss_vec, stats = self.edge_loss(ro, edges, adv, sel, k, cond_t, uncond_t)
            sums = {key: float(value) * len(sel) for key, value in stats.items()}
            sums["loss"] = sums.get("loss", 0.0) + float(loss_vec.detach().sum())
            return loss_vec.sum() / n_chunk, sums, len(sel)

        def step_units(chunk: torch.Tensor):
            steps = torch.unique(edges["step"][chunk]).tolist()
            return [lambda k=k: unit(chunk[edges["step"][chunk] == k], k, len(chunk)) for k in steps]

        plan = (step_units(order[s : s + per_step]) for s in range(0, len(order), per_step))
        stats = optimizer_steps(self, self.optimizers(), plan, self.hparams.max_grad_norm)
        self.log_dict({f"train/{key}": value for key, value in stats.items()}, batch_size=bs)
        advance_iteration(self, bs)

    validation_step = flat_validation_step
