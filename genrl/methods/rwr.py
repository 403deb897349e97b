"""Reward-weighted regression (Peters & Schaal 2007; Lee et al. 2023, "Aligning Text-to-Image Models using Human
Feedback"): the "write a new method" example of docs/new_method.md, composed only of roles and phases.

Each iteration: the policy samples G clean endpoints x0 per prompt (ODE), they are scored, A is the group-normalised
advantage, and the policy regresses flow matching on its own samples weighted by w = exp(beta A) / mean(exp(beta A)):
L = mean_b w_b ||v_theta(x_t, t) - (eps - x0)||^2 with t ~ U(0, 1), x_t = (1 - t) x0 + t eps. Invalid rewards get
weight 0. As beta -> 0 it is plain self-distillation; larger beta imitates the best samples of each group.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.forward_rl import advantage_weighted_fm_loss
from genrl.methods.common import (
    advance_iteration,
    configure_policy,
    configure_policy_optimizer,
    init_method,
    log_validation_rewards,
)
from genrl.methods.phases import collect_endpoints, group_advantages_of, optimizer_steps, renoise, score
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.noise import stream_id
from genrl.rollout.sampler import RolloutConfig

_STREAM_T, _STREAM_EPS = stream_id("rwr.t"), stream_id("rwr.eps")  # the re-noising time and eps

__all__ = ["RewardWeightedRegression"]


class RewardWeightedRegression(LightningModule):
    """Reward-weighted flow-matching regression on the policy's own samples (batches as :class:`~genrl.methods.GRPO`).

    Args:
        generator / latent_shape / lora: the policy, as in GRPO (default: genrl's DiT, the shapes base model).
        rollout: the endpoint sampler (deterministic ODE); rewards: reward specs.
        beta: inverse temperature of the weights exp(beta A) (> 0). optimizer / max_grad_norm / seed: as in GRPO.
    Raises:
        ValueError: beta <= 0.
    """

    def __init__(self, generator: GeneratorSpec | None = None, latent_shape: list[int] | None = None,
                 lora: LoraSpec | None = None, rollout: RolloutConfig | None = None,
                 rewards: list[dict[str, Any]] | None = None, beta: float = 1.0,
                 optimizer: OptimizerCallable = torch.optim.AdamW, max_grad_norm: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        if not beta > 0:
            raise ValueError(f"beta must be > 0 (the weights are exp(beta * advantage)), got {beta}")
        init_method(self, generator, rewards)
        self.optimizer_factory = optimizer
        self.rollout_config = rollout or RolloutConfig(kernel="ode")
        self.latent_shape = tuple(latent_shape) if latent_shape else None

    configure_model = configure_policy

    configure_optimizers = configure_policy_optimizer

    def training_step(self, batch: dict, batch_idx: int) -> None:
        h, gen, it = self.hparams, self.generator, int(self.iteration)
        prompts, index = list(batch["prompts"]), batch["index"].cpu()
        ro = collect_endpoints(gen, prompts, self.latent_shape, h.seed, index, self.rollout_config, it)
        scores = score(self, self.scorer, ro, batch["group"].cpu(), iteration=it)
        adv = group_advantages_of(self, scores, min_group_size=2, iteration=it)
        valid = scores.result.valid
        w = torch.exp(h.beta * adv) * valid
        w = w / w[valid].mean()

        def unit():
            t, _, x_t, u = renoise(ro.samples.float(), index, h.seed, it, 0, _STREAM_T, _STREAM_EPS, density="uniform")
            v = gen.velocity(x_t, t, gen.encode_prompts(prompts)).float()
            loss = advantage_weighted_fm_loss(v, u, w.to(v.device))
            return loss, {"loss": float(loss.detach())}, 1

        stats = optimizer_steps(self, self.optimizers(), [[unit]], h.max_grad_norm)
        self.log("train/loss", stats["loss"], batch_size=len(prompts))
        self.log("train/weight_max", float(w.max()), batch_size=len(prompts))
        advance_iteration(self, len(prompts))

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts = list(batch["prompts"])
        ro = collect_endpoints(self.generator, prompts, self.latent_shape, self.hparams.seed, batch["index"].cpu(),
                               self.rollout_config, 0)
        return log_validation_rewards(self, self.scorer, ro.pixels, prompts)
