"""BranchGRPO (Li et al. 2025, "BranchGRPO: Stable and Efficient GRPO with Structured Branching in Diffusion
Models"): GRPO on tree rollouts with shared prefixes, depth-wise advantages and pruning.

Each iteration: one tree per prompt from the shared sampler's tree mode (:func:`genrl.rollout.tree.tree_rollout`),
rewards on the leaves (on the last step's clean-sample prediction, as the reference, or the final latent),
leaf rewards fused up the tree (:func:`genrl.flow.tree_advantages.fuse_rewards`), depth-wise advantages
(:func:`~genrl.flow.tree_advantages.depthwise_advantages`), pruning of the edges the gradient step sees
(:func:`~genrl.flow.tree_advantages.prune_edges`; rollouts and rewards unchanged), then the clipped policy loss
of :mod:`genrl.flow.policy` on every kept edge, with the edge log-prob recomputed by the same kernel the rollout
used (ratio exactly 1 on the first update). Composition, not inheritance: nothing here subclasses GRPO.

Optimization is manual: one optimizer step per mini-batch of ``edges_per_step`` edges (None: one per iteration),
so ``trainer.max_steps`` counts optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.policy import clipped_policy_loss
from genrl.flow.tree_advantages import depthwise_advantages, fuse_rewards, prune_edges
from genrl.methods.common import (build_policy, ensure_reward_manager, log_validation_rewards, policy_optimizer,
                                  restore_reward_state, save_reward_state, stash_reward_state)
from genrl.methods.grpo import LoraSpec
from genrl.models.families import GeneratorSpec
from genrl.models.spec import ModelSpec
from genrl.models.text_encoder import MINILM
from genrl.rollout.noise import mix_seed
from genrl.rollout.sampler import RolloutConfig, _encode, rollout
from genrl.rollout.tree import TreeConfig, edge_log_prob, tree_rollout

__all__ = ["BranchGRPO"]


class BranchGRPO(LightningModule):
    """BranchGRPO on any Generator.

    Training batches come from :class:`genrl.data.PromptDataModule` with ``group_size: 1`` (the tree is the
    group): ``{"prompts": list[str] (P), "index": int64 [P]}``; validation batches are sampled with the ODE.

    Args:
        transformer / text_encoder / max_text_length / generator / latent_shape / lora: the policy, as in
            :class:`genrl.methods.GRPO`.
        rollout: the step kernel and schedule (BranchGRPO: 20 steps, dance_grpo, eta 0.3).
        tree: the :class:`TreeConfig` (split steps, branch factor, split noise scale, Mix, memory budget).
        reward_on: ``"x0"`` (the last step's clean-sample prediction, the reference) or ``"final"``.
        fusion: ``"mean"`` or ``"path_prob"`` (with ``fusion_alpha``).
        advantage_eps: the depth-wise std epsilon (1e-8).
        prune_depths: child depths (step + 1) whose edges are dropped from the gradient step.
        width_ratio / width_mode: width pruning of the edges after the last split (0 disables it).
        rewards / reward_combine: as in GRPO.
        clip_range / clip_range_high / adv_clip_max: the clipped loss (BranchGRPO: 1e-3, 5).
        optimizer / max_grad_norm: as in GRPO.
        edges_per_step: edges per optimizer step (None: all kept edges in one step).
        eval_rollout: validation sampler (default ODE, 20 steps).
        seed: seed of all randomness.
    """

    def __init__(
        self,
        transformer: ModelSpec | None = None,
        text_encoder: str = MINILM,
        max_text_length: int = 32,
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        rollout: RolloutConfig | None = None,
        tree: TreeConfig | None = None,
        reward_on: Literal["x0", "final"] = "x0",
        fusion: Literal["mean", "path_prob"] = "mean",
        fusion_alpha: float = 1.0,
        advantage_eps: float = 1e-8,
        prune_depths: list[int] | None = None,
        width_ratio: float = 0.0,
        width_mode: Literal["chain", "extremes"] = "chain",
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
        if generator is not None and transformer is not None:
            raise ValueError("give either transformer (genrl's DiT) or generator (a diffusers family), not both")
        if edges_per_step is not None and edges_per_step < 1:
            raise ValueError(f"edges_per_step must be >= 1 or null, got {edges_per_step}")
        if reward_on not in ("x0", "final"):
            raise ValueError(f"reward_on must be 'x0' or 'final', got {reward_on!r}")
        self.save_hyperparameters(ignore=["optimizer"])
        self.automatic_optimization = False
        self.transformer_spec = transformer or ModelSpec()
        self.generator_spec = generator
        self.rollout_config = rollout or RolloutConfig(num_steps=20, kernel="dance_grpo", noise_level=0.3,
                                                       skip_last_step=False)
        self.tree_config = tree or TreeConfig()
        self.tree_config.check(self.rollout_config.num_steps)
        self.eval_config = eval_rollout or RolloutConfig(kernel="ode", num_steps=20, shift=self.rollout_config.shift,
                                                         cfg_scale=self.rollout_config.cfg_scale,
                                                         micro_batch_size=self.rollout_config.micro_batch_size)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer
        self.generator = None
        self.register_buffer("iteration", torch.zeros((), dtype=torch.long))
        self._reward_specs = rewards if rewards is not None else [{"name": "shapes"}]
        self.rewards = None

    # ------------------------------------------------------------------ construction (as GRPO)
    def configure_model(self) -> None:
        if self.generator is not None:
            return
        generator = build_policy(self.generator_spec, self.transformer_spec, self.hparams.text_encoder,
                                 self.hparams.max_text_length, self.hparams.lora)
        if self.latent_shape is None:
            self.latent_shape = tuple(getattr(generator, "latent_shape", (8, 3, 16, 16)))
        self.generator = generator

    def setup(self, stage: str) -> None:
        self.configure_model()
        ensure_reward_manager(self)

    def configure_optimizers(self):
        return policy_optimizer(self.generator, self.optimizer_factory)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_reward_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        stash_reward_state(self, checkpoint)

    # ------------------------------------------------------------------ the pieces
    def tree_advantages(self, ro, leaf_rewards: torch.Tensor, leaf_valid: torch.Tensor):
        """(edges, per-edge advantages, kept mask) of a tree rollout and its leaf rewards."""
        fused, ok = fuse_rewards(ro.parent, leaf_rewards, leaf_valid, ro.log_probs, self.hparams.fusion,
                                 self.hparams.fusion_alpha)
        node_adv = depthwise_advantages(fused, ok, ro.tree, eps=self.hparams.advantage_eps)
        edges = ro.edges()  # ordered by step, then child: the per-step node advantages line up
        adv = torch.cat([node_adv[k + 1] for k in range(ro.num_steps) if bool(ro.sde_mask[k])])
        keep = prune_edges(edges, adv, self.tree_config.split_steps, ro.num_steps, depths=self.hparams.prune_depths,
                           width_ratio=self.hparams.width_ratio, width_mode=self.hparams.width_mode,
                           chain_id=edges["child"])
        return edges, adv, keep

    # ------------------------------------------------------------------ training
    def training_step(self, batch: dict, batch_idx: int) -> None:
        restore_reward_state(self)
        prompts, index = list(batch["prompts"]), batch["index"].cpu()
        gen, cfg, it, seed = self.generator, self.rollout_config, int(self.iteration), self.hparams.seed

        gen.eval()
        ro = tree_rollout(gen, prompts, self.latent_shape, seed, index, cfg, self.tree_config)
        leaves = ro.x0 if self.hparams.reward_on == "x0" else ro.leaves
        leaf_prompts = [prompts[int(t)] for t in ro.tree[-1]]
        with torch.no_grad():
            result = self.rewards(gen.decode(leaves.to(gen.device)).float().cpu(), leaf_prompts)
        gen.train()
        bs = len(leaf_prompts)
        for key, value in result.metrics().items():
            if key not in ("total", "invalid_fraction"):
                self.log(f"reward/{key}", float(value), batch_size=bs)
        valid = result.valid
        self.log("reward/total", float(result.total[valid].mean()) if valid.any() else math.nan, prog_bar=True,
                 batch_size=bs)
        if not valid.any():
            raise RuntimeError(f"iteration {it}: every leaf reward is invalid (NaN); the reward model is failing")

        edges, adv, keep = self.tree_advantages(ro, torch.nan_to_num(result.total), valid)
        self.log("tree/edges", float(keep.numel()), batch_size=bs)
        self.log("tree/edges_trained", float(keep.sum()), batch_size=bs)
        self.log("tree/denoiser_evals", float(ro.denoiser_evals), batch_size=bs)

        # policy update on the kept edges, grouped by step (same-step edges share a network call)
        cond_t, uncond_t = _encode(gen, prompts, cfg)
        kept = torch.nonzero(keep).flatten()
        order = kept[torch.randperm(len(kept), generator=torch.Generator().manual_seed(mix_seed(seed, it, 13)))]
        per_step = self.hparams.edges_per_step or len(order)
        opt = self.optimizers()
        stats_sum: dict[str, float] = {}
        count = 0
        for start in range(0, len(order), per_step):
            chunk = order[start : start + per_step]
            opt.zero_grad()
            for k in torch.unique(edges["step"][chunk]).tolist():
                sel = chunk[edges["step"][chunk] == k]
                child = edges["child"][sel]
                rows = ro.tree[k + 1][child]
                cond = cond_t.select(rows)
                uncond = uncond_t.select(rows) if uncond_t is not None else None
                lp, _ = edge_log_prob(gen, ro, k, child, cond, uncond)
                loss_vec, stats = clipped_policy_loss(
                    lp, ro.log_probs[k + 1][child].to(lp.device), adv[sel].to(lp.device),
                    clip_range=self.hparams.clip_range, clip_range_high=self.hparams.clip_range_high,
                    adv_clip_max=self.hparams.adv_clip_max,
                )
                self.manual_backward(loss_vec.sum() / len(chunk))
                for key, value in stats.items():
                    stats_sum[key] = stats_sum.get(key, 0.0) + float(value) * len(sel)
                stats_sum["loss"] = stats_sum.get("loss", 0.0) + float(loss_vec.detach().sum())
                count += len(sel)
            if self.hparams.max_grad_norm > 0:
                self.clip_gradients(opt, gradient_clip_val=self.hparams.max_grad_norm, gradient_clip_algorithm="norm")
            opt.step()
        for key, value in stats_sum.items():
            self.log(f"train/{key}", value / max(count, 1), batch_size=bs)
        self.iteration += 1
        self.log("train/iteration", float(self.iteration), batch_size=bs)

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        traj = rollout(self.generator, prompts, self.latent_shape, self.hparams.seed, batch["index"].cpu(),
                       self.eval_config, record=False)
        videos = self.generator.decode(traj.final)
        log_validation_rewards(self, videos, prompts)
        return {"videos": videos, "prompts": prompts}
