"""Diffusion-DPO for flow-matching generators, online (pairs from the policy's own groups) and offline (pairs from a
dataset or a folder of scored videos).

Online, each iteration samples a group of G clean endpoints per prompt (the deterministic ODE, or an SDE kernel for
more diverse groups), scores them, and keeps one (best, worst) pair per group (:func:`~genrl.methods.phases.
best_worst_pairs_of`: failed rewards never paired, all-equal groups skipped by default). Offline, a batch of
:class:`genrl.data.preference_pairs.PreferencePairDataModule` brings the pairs' pixels, which the generator encodes
(Wallace et al.'s setting: Pick-a-Pic pairs, no sampling). Either way each pair is re-noised ``num_draws`` times at a
sigma and noise shared by its two members (sigma ~ logit-normal(0, 1), as every flow codebase draws it), and the
policy's and the reference's flow-matching errors enter the DPO loss (Wallace et al. 2024, "Diffusion Model
Alignment Using Direct Preference Optimization", eq. 14, in the flow form of :func:`genrl.flow.preference.dpo_loss`):

    z = -(beta / 2) [(e_theta(x_w) - e_ref(x_w)) - (e_theta(x_l) - e_ref(x_l))],   L = -log sigmoid(z).

Both paths run the same update (:meth:`DPO.update`). The reference is the frozen base (``reference_update_every:
null``; the LoRA-disabled model under LoRA), or a copy of the policy refreshed every N iterations (flow_grpo's
"OnlineDPO"); online, ``rollout_policy: reference`` samples the groups with the reference instead of the live policy
(flow_grpo's DPO). No reward scale enters the loss: only the order within a group does. Randomness is addressed by
(seed, iteration, pair key, draw), so resume equals an uninterrupted run.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.fm_core import sample_mse
from genrl.flow.preference import dpo_loss
from genrl.methods.common import (
    advance_iteration,
    configure_policy,
    configure_policy_optimizer,
    init_method,
    ode_validation_config,
    world_of,
)
from genrl.methods.phases import (
    Pairs,
    best_worst_pairs_of,
    collect_endpoints,
    flat_validation_step,
    micro_batches,
    optimizer_steps,
    renoise,
    role_velocity,
    score,
    video_batch,
)
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.noise import stream_id
from genrl.rollout.sampler import RolloutConfig

__all__ = ["DPO"]

_STREAM_T, _STREAM_EPS = stream_id("dpo.t"), stream_id("dpo.eps")


class DPO(LightningModule):
    """Diffusion-DPO / Flow-DPO, online and offline (see the module docstring), on any Generator.

    Training batches decide the path. Online: :class:`genrl.data.PromptDataModule` (``group_size`` G >= 2),
    ``{"prompts": list[str] (P*G), "index": int64 [P*G], "group": int64 [P*G]}``. Offline:
    :class:`genrl.data.preference_pairs.PreferencePairDataModule`, ``{"prompts": list[str] (B), "chosen" / "rejected":
    float [B, T, C, H, W] in [0, 1], "index": int64 [B] global pair ids}``; ``rollout``, ``rollout_policy`` and
    ``tie`` then do not apply and ``rewards`` only score validation. Validation (both paths) samples the live policy
    with ``eval_rollout`` on the data module's validation prompts and scores it with ``rewards``.

    Args:
        generator / latent_shape / lora: the policy, as in :class:`~genrl.methods.grpo.GRPO`.
        rollout: the group sampler (any kernel; the endpoints alone are kept).
        rewards / reward_combine: pointwise reward specs; only their order within a group matters (offline: the
            validation rewards).
        beta: the DPO temperature beta > 0 in the codebases' convention (beta / 2, errors averaged over elements;
            flow_grpo 100, Flow-Factory / verl-omni 2000, Diffusion-DPO's SD models 5000). The paper's beta is
            2 beta / (T omega(lambda)) of this one.
        weighting: ``"velocity"`` (the flow form: velocity errors) or ``"epsilon"`` (errors x (1 - sigma)^2, the
            epsilon-prediction form's weighting over sigma).
        tie: ``"skip"`` (a group whose valid rewards are all equal gives no pair) or ``"arbitrary"`` (it still gives
            a pair by the stable tie rule; flow_grpo's behaviour).
        num_draws: (sigma, noise) draws per pair and iteration (Flow-Factory 1; flow_grpo about 0.99 x steps).
        updates_per_iteration: optimizer steps per iteration (must divide ``num_draws``).
        micro_batch_size: pairs per network call (None: all of this rank's pairs); both members of a pair are
            always in the same call.
        logit_mean / logit_std: the logit-normal sigma density.
        reference_update_every: None: the reference is the frozen base; N: a copy of the policy, refreshed every N
            iterations (the first copy is the base).
        rollout_policy: ``"policy"`` (the live weights sample the groups) or ``"reference"``.
        optimizer / max_grad_norm / eval_rollout / seed: as in GRPO.

    Raises:
        ValueError: beta <= 0, num_draws < 1, updates_per_iteration not dividing num_draws, micro_batch_size < 1,
            reference_update_every < 1, an unknown tie / weighting / rollout_policy.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        lora: LoraSpec | None = None,
        rollout: RolloutConfig | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum", "advantage_sum"] = "weighted_sum",
        beta: float = 100.0,
        weighting: Literal["velocity", "epsilon"] = "velocity",
        tie: Literal["skip", "arbitrary"] = "skip",
        num_draws: int = 4,
        updates_per_iteration: int = 1,
        micro_batch_size: int | None = None,
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        reference_update_every: int | None = None,
        rollout_policy: Literal["policy", "reference"] = "policy",
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        eval_rollout: RolloutConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not beta > 0 or weighting not in ("velocity", "epsilon") or tie not in ("skip", "arbitrary"):
            raise ValueError(f"need beta > 0, weighting 'velocity' | 'epsilon', tie 'skip' | 'arbitrary'; got beta="
                             f"{beta}, weighting={weighting!r}, tie={tie!r}")
        if num_draws < 1 or updates_per_iteration < 1 or num_draws % updates_per_iteration:
            raise ValueError(f"need num_draws >= 1 and updates_per_iteration >= 1 dividing it; got {num_draws}, "
                             f"{updates_per_iteration}")
        if (micro_batch_size is not None and micro_batch_size < 1) or (reference_update_every or 1) < 1:
            raise ValueError(f"micro_batch_size and reference_update_every must be >= 1 or null; got "
                             f"{micro_batch_size}, {reference_update_every}")
        if rollout_policy not in ("policy", "reference"):
            raise ValueError(f"rollout_policy must be 'policy' or 'reference', got {rollout_policy!r}")
        init_method(self, generator, rewards, reward_combine)
        self.rollout_config = rollout or RolloutConfig(kernel="ode")
        self.eval_config = eval_rollout or ode_validation_config(self.rollout_config)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        refreshed = self.hparams.reference_update_every is not None
        if (gen := configure_policy(self, reference=not refreshed)) is not None and refreshed:
            self.roles.lagged("reference_policy", gen.transformer)  # the periodically refreshed copy

    configure_optimizers = configure_policy_optimizer

    @property
    def reference_role(self) -> str:
        """The role whose errors e_ref enter z: ``"reference"`` (frozen base) or ``"reference_policy"``."""
        return "reference" if self.hparams.reference_update_every is None else "reference_policy"

    def _sampler(self):
        if self.hparams.rollout_policy == "policy":
            return None
        if self.reference_role == "reference":
            return lambda: self.roles.reference(self.generator)
        return lambda: self.roles.swap(self.generator, "reference_policy")

    # ------------------------------------------------------------------ the algorithm
    def pair_loss(self, chosen, rejected, keys, cond, it: int, draw: int, weight: torch.Tensor | None = None):
        """Per-pair DPO loss [p] of one (draw, micro-batch) unit and its statistics (over the pairs of ``weight`` > 0:
        padding slots left out; none when there is no real pair): both members re-noised at the pair's shared (sigma,
        noise), one policy and one reference forward over the 2p rows."""
        h, fd = self.hparams, getattr(self.generator, "frame_dim", 1)
        args = dict(density="logit_normal", logit_mean=h.logit_mean, logit_std=h.logit_std)
        t, _, x_w, u_w = renoise(chosen, keys, h.seed, it, draw, _STREAM_T, _STREAM_EPS, fd, **args)
        _, _, x_l, u_l = renoise(rejected, keys, h.seed, it, draw, _STREAM_T, _STREAM_EPS, fd, **args)
        x, tt, u = torch.cat([x_w, x_l]), torch.cat([t, t]), torch.cat([u_w, u_l])
        err = sample_mse(role_velocity(self, x, tt, cond), u)
        err_ref = sample_mse(role_velocity(self, x, tt, cond, self.reference_role), u)
        p = len(keys)
        loss, stats = dpo_loss(err[:p], err[p:], err_ref[:p], err_ref[p:], h.beta, sigma=t, weighting=h.weighting)
        if weight is not None and not bool((weight > 0).all()):  # the statistics of the real pairs only
            keep = (weight > 0).to(err.device)
            e, r = err.detach(), err_ref
            stats = dpo_loss(e[:p][keep], e[p:][keep], r[:p][keep], r[p:][keep], h.beta, sigma=t[keep],
                             weighting=h.weighting)[1] if keep.any() else {}
        return loss, stats

    def training_step(self, batch: dict, batch_idx: int) -> None:
        """One iteration: the batch's pairs (offline, when it has ``"chosen"`` / ``"rejected"``) or the policy's own
        groups' (online), then :meth:`update` on them."""
        if "chosen" in batch:
            self.update(self.dataset_pairs(batch), len(batch["prompts"]))
            return
        h, gen, it = self.hparams, self.generator, int(self.iteration)
        prompts, index, group = list(batch["prompts"]), batch["index"].cpu(), batch["group"].cpu()
        ro = collect_endpoints(gen, prompts, self.latent_shape, h.seed, index, self.rollout_config, it,
                               policy=self._sampler())
        scores = score(self, self.scorer, ro, group, iteration=it)
        self.update(best_worst_pairs_of(self, scores, ro.samples, prompts, tie=h.tie), len(prompts))

    def dataset_pairs(self, batch: dict) -> Pairs:
        """The pairs of an offline batch (:class:`genrl.data.preference_pairs.PreferencePairDataModule`): both members
        encoded by the generator without gradient (``x0 = generator.encode(pixels)``, :func:`~genrl.methods.phases.
        video_batch`), weight 1, keys the batch's global pair-slot ids (``index``), margin the batch's (NaN when it
        has none), count B x data-parallel world size (every rank holds B pairs). Logs ``pairs/count``.

        Raises:
            ValueError: ``chosen`` / ``rejected`` not [B, T, C, H, W] (names the shape), or of different shapes.
        """
        if batch["chosen"].shape != batch["rejected"].shape:
            raise ValueError(f"batch['chosen'] {tuple(batch['chosen'].shape)} and batch['rejected'] "
                             f"{tuple(batch['rejected'].shape)} must have one shape [B, T, C, H, W]")
        members = [video_batch(self, {**batch, "pixels": batch[k]}) for k in ("chosen", "rejected")]
        (x_w, prompts, keys), (x_l, _, _) = members
        count = len(prompts) * world_of(self)[1]
        self.log("pairs/count", float(count), batch_size=len(prompts))
        margin = batch.get("margin", torch.full((len(prompts),), math.nan)).float().cpu()
        return Pairs(x_w, x_l, prompts, keys, torch.ones(len(prompts)), margin, count)

    def update(self, pairs: Pairs, n: int) -> None:
        """The DPO update on this rank's ``pairs`` (either path): ``updates_per_iteration`` optimizer steps, each over
        ``num_draws / updates_per_iteration`` draws x the micro-batches of pairs, the loss a mean over the global
        batch's ``pairs.count`` real pairs; then the reference refresh and the iteration counter (``n``: the local
        batch size, for logging)."""
        h, gen, it = self.hparams, self.generator, int(self.iteration)
        p = len(pairs.keys)
        # a mean over the global batch's real pairs: ranks' gradients are averaged, so each rank scales by W. No pair
        # anywhere (all groups tied): the same optimizer steps with no gradient, which leave weights and state as
        # they are (torch optimizers skip parameters without a gradient) while the step count advances.
        mb, per_update = h.micro_batch_size or max(p, 1), h.num_draws // h.updates_per_iteration
        chunks = micro_batches(p, mb)
        cond_all = gen.encode_prompts(pairs.prompts * 2) if p else None

        def unit(draw: int, c: torch.Tensor):
            dev, w = gen.device, pairs.weight[c]
            loss_vec, stats = self.pair_loss(pairs.chosen[c].to(dev), pairs.rejected[c].to(dev), pairs.keys[c],
                                             cond_all.select(c.tolist() + (c + p).tolist()), it, draw, w)
            w, real = w.to(loss_vec.device), float(w.sum())
            logged = {f"train/{k}": float(v) * real for k, v in stats.items()}
            logged["train/loss"] = float((loss_vec.detach() * w).sum())
            return (loss_vec * w).sum() * world_of(self)[1] / (pairs.count * per_update), logged, real

        plan = [[lambda k=k, c=c: unit(k, c) for k in range(u * per_update, (u + 1) * per_update) for c in chunks]
                for u in range(h.updates_per_iteration)]
        self.log_dict(optimizer_steps(self, self.optimizers(), plan, h.max_grad_norm), batch_size=n)
        if h.reference_update_every is not None and (it + 1) % h.reference_update_every == 0:
            self.roles.update_lagged("reference_policy", 0.0)  # the reference <- the current policy
        advance_iteration(self, n)

    validation_step = flat_validation_step
