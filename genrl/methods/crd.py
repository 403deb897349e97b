"""CRD (Centered Reward Distillation) for flow-matching generators: the policy's implicit reward against a lagged
"old" snapshot is fitted to the external reward, both centred over the batch; no SDE log-probs.

"Diffusion Reinforcement Learning via Centered Reward Distillation" (arXiv 2603.14128). Each iteration: G ODE
endpoints per prompt (rolled out by a lagged sampling snapshot, optional); GRPO advantages A mapped to a = clip(A,
+-c) / (2c) + 1/2 in [0, 1] (c = ``adv_clip``); ``num_timesteps`` sigmas from the rollout's own grid, each sample
re-noised with its own noise. At each sigma, with e the flow-matching errors and w = 1 or (``adaptive``) w =
sg(mean_j |v - u|_j) >= 1e-5, the implicit reward r_theta,i = -(e_theta,i / w_theta,i - e_old,i / w_old,i) is matched
to the reward after centring both over the WHOLE gathered batch (every prompt together, not per prompt):

    L = (c / beta) mean_i (beta (r_theta,i - sg(sum_j p_j r_theta,j)) - (a_i - sum_j p_j a_j))^2     (``mse``)

or BCE(beta R_theta_c, sigmoid(R_c)) (``bce``), p uniform or softmax(+-a / ``weight_temp``)
(:mod:`genrl.flow.preference`). The centre needs every r_theta before the pass with graph: a pass without graph,
gathered over ranks (:func:`~genrl.methods.phases.gathered_pass`), gives it with the old snapshot's errors, which the
pass with graph reuses. Plus ``kl_beta`` x the velocity KL to the reference, reward-adaptive per sample
(:func:`~genrl.flow.preference.crd_kl_weight`). After every iteration both snapshots blend toward the policy on the
reference's schedules (:func:`~genrl.models.roles.ramped_decay`; see the class). Every draw is addressed by (seed,
iteration, sample, sigma draw): micro-batching changes nothing and resume equals an uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.fm_core import sample_mse
from genrl.flow.preference import crd_implicit_reward, crd_kl_weight, crd_loss
from genrl.methods.common import (
    advance_iteration,
    configure_policy,
    configure_policy_optimizer,
    gather_batch,
    init_method,
    ode_validation_config,
    rank_slice,
)
from genrl.methods.phases import (
    collect_endpoints,
    errors_at,
    flat_validation_step,
    gathered_pass,
    grid_sigmas,
    group_advantages_of,
    micro_batches,
    optimizer_steps,
    score,
)
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.models.roles import ramped_decay
from genrl.noise import stream_id
from genrl.rollout.sampler import RolloutConfig

__all__ = ["CRD"]

_STREAM_EPS, _STREAM_SIGMA = stream_id("crd.eps"), stream_id("crd.sigma")


class CRD(LightningModule):
    """CRD (see the module docstring) on any Generator; batches from :class:`genrl.data.PromptDataModule` (K >= 2).

    Args:
        generator / latent_shape / lora / rollout / rewards / reward_combine / advantage_std / advantage_eps: as DGPO
            (the rollout is forced to the ODE kernel; the reference normalises by the global std: ``"global"``).
        adv_clip: c > 0, advantages clipped to [-c, c] before the map to [0, 1]; the loss is scaled by c / beta (5).
        beta: > 0, the implicit-reward scale (reference 1).
        loss_type: ``"mse"`` or ``"bce"``. weight_temp: centering weights, < 0 uniform, > 0 softmax(+-a / tau).
        adaptive: the per-sample scale w = sg(mean |v - u|) of each model's error (reference on).
        num_timesteps: sigma draws per iteration, consecutive permutations of the grid values (None: each once;
            reference 20 on a 10-step grid); trunc_steps: the draws use grid indices [0, trunc_steps] (None: all).
        kl_beta: >= 0, the velocity-KL weight (reference 0.1); reward_adaptive_kl: per sample 1e-4 + a (kl_beta - 1e-4).
        old_decay_*: after every iteration old <- d old + (1 - d) theta, d = min(start + ramp s, max), s the optimizer
            steps so far (reference 0.25 / 0.005 / 0.999). sampling_decay_*: the sampling snapshot's, d = 0 while
            s < delay, then min(ramp (s - delay), max) (reference 75 / 0.0075 / 0.999); delay None: none, the live
            policy rolls out.
        updates_per_iteration: optimizer steps per iteration (must divide the sigma draws; each takes its share).
        micro_batch_size: samples per network call (None: this rank's whole batch).
        optimizer / max_grad_norm / eval_rollout / seed: as GRPO.

    Raises:
        ValueError (naming the value): beta, adv_clip not finite > 0; a bad loss_type or weight_temp (0, NaN); kl_beta
            < 0; a decay outside [0, 1], a negative ramp or delay; a bad trunc_steps or num_timesteps, or
            updates_per_iteration not dividing the sigma draws.
    """

    def __init__(
        self,
        generator: GeneratorSpec | None = None,
        latent_shape: list[int] | None = None,
        lora: LoraSpec | None = None,
        rollout: RolloutConfig | None = None,
        rewards: list[dict[str, Any]] | None = None,
        reward_combine: Literal["weighted_sum", "zscore_sum", "advantage_sum"] = "weighted_sum",
        advantage_std: Literal["group", "global", "none"] = "global",
        advantage_eps: float = 1e-4,
        adv_clip: float = 5.0,
        beta: float = 1.0,
        loss_type: Literal["mse", "bce"] = "mse",
        weight_temp: float = -1.0,
        adaptive: bool = True,
        num_timesteps: int | None = None,
        trunc_steps: int | None = None,
        kl_beta: float = 0.1,
        reward_adaptive_kl: bool = True,
        old_decay_start: float = 0.25,
        old_decay_ramp: float = 0.005,
        old_decay_max: float = 0.999,
        sampling_decay_delay: int | None = 75,
        sampling_decay_ramp: float = 0.0075,
        sampling_decay_max: float = 0.999,
        updates_per_iteration: int = 1,
        micro_batch_size: int | None = None,
        optimizer: OptimizerCallable = torch.optim.AdamW,
        max_grad_norm: float = 1.0,
        eval_rollout: RolloutConfig | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        crd_loss(torch.zeros(1), torch.zeros(1), beta, loss_type, weight_temp, adv_clip)  # the loss's own checks
        decays = dict(old_decay_start=old_decay_start, old_decay_max=old_decay_max, sampling_max=sampling_decay_max)
        if not (kl_beta >= 0 <= min(old_decay_ramp, sampling_decay_ramp, sampling_decay_delay or 0)
                and all(0 <= d <= 1 for d in decays.values())):
            raise ValueError(f"need kl_beta >= 0, decays in [0, 1], ramps and the delay >= 0; got kl_beta={kl_beta}, "
                             f"{decays}, ramps {old_decay_ramp} / {sampling_decay_ramp}, delay {sampling_decay_delay}")
        init_method(self, generator, rewards, reward_combine)
        base = rollout or RolloutConfig(kernel="ode")
        self.rollout_config = RolloutConfig(**{**vars(base), "kernel": "ode"})
        steps = self.rollout_config.num_steps
        self.grid_size = steps if trunc_steps is None else trunc_steps + 1
        self.num_timesteps = self.grid_size if num_timesteps is None else num_timesteps
        if not 1 <= self.grid_size <= steps or self.num_timesteps < 1:
            raise ValueError(f"need 1 <= trunc_steps + 1 <= num_steps = {steps} and num_timesteps >= 1; got "
                             f"trunc_steps={trunc_steps}, num_timesteps={num_timesteps}")
        if updates_per_iteration < 1 or self.num_timesteps % updates_per_iteration:
            raise ValueError(f"updates_per_iteration={updates_per_iteration} must be >= 1 and divide the "
                             f"{self.num_timesteps} sigma draws (num_timesteps)")
        self.eval_config = eval_rollout or ode_validation_config(self.rollout_config)
        self.latent_shape = tuple(latent_shape) if latent_shape else None
        self.optimizer_factory = optimizer

    def configure_model(self) -> None:
        if (gen := configure_policy(self, reference=self.hparams.kl_beta > 0)) is not None:
            self.roles.lagged("old_policy", gen.transformer)
            if self.hparams.sampling_decay_delay is not None:
                self.roles.lagged("sampling_policy", gen.transformer)

    configure_optimizers = configure_policy_optimizer

    def sigmas(self, it: int) -> torch.Tensor:
        """float32 [num_timesteps]: the iteration's grid sigmas (:func:`~genrl.methods.phases.grid_sigmas`)."""
        return grid_sigmas(self.rollout_config, self.grid_size, self.num_timesteps, self.hparams.seed, it,
                           _STREAM_SIGMA)

    def errors(self, x0, keys, cond, sigma: float, it: int, m: int, roles: tuple[str, ...]):
        """:func:`~genrl.methods.phases.errors_at` at ``sigma``, draw ``m``, noise addressed by ``keys`` [b]."""
        return errors_at(self, x0, keys, cond, sigma, self.hparams.seed, it, m, _STREAM_EPS, roles)

    def scale(self, v: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
        """w = sg(mean_j |v - u|_j), float32 [b], with ``adaptive`` (clamped >= 1e-5 by the reward); else None (1)."""
        return (v - u).detach().abs().flatten(1).mean(1) if self.hparams.adaptive else None

    @torch.no_grad()
    def implicit_rewards(self, x0, keys, cond, chunks, sigma: float, it: int, m: int) -> torch.Tensor:
        """float32 [world * n, 3] on the CPU: (r_theta, e_old, w_old; w_old = 1 without ``adaptive``) of the gathered
        batch at ``sigma`` (draw ``m``), a pass without graph over ``chunks`` (rows of ``x0``, ``keys``, ``cond``)."""
        def rows(c: torch.Tensor) -> torch.Tensor:
            e, v, u = self.errors(x0[c.to(x0.device)], keys[c], cond.select(c.tolist()), sigma, it, m,
                                  ("theta", "old_policy"))
            w, w_old = self.scale(v["theta"], u), self.scale(v["old_policy"], u)
            r = crd_implicit_reward(e["theta"], e["old_policy"], w, w_old)
            return torch.stack([r, e["old_policy"], torch.ones_like(r) if w_old is None else w_old], dim=1)

        return gathered_pass(self, chunks, rows)

    def unit_loss(self, x0, keys, adv, cond, sigma: float, it: int, m: int, old: torch.Tensor, centre):
        """One (sigma draw, micro-batch) unit with graph: ((c / beta) x the CRD loss centred on ``centre`` = (r_theta
        [N], A [N]) of the gathered batch, plus the KL term; a mean over the rows, {stat: sum over the rows}). The rows:
        ``x0`` [b, *latent], ``keys`` [b], raw ``adv`` [b], ``cond``, and ``old`` [b, 3] of :meth:`implicit_rewards`."""
        h = self.hparams
        e, v, u = self.errors(x0, keys, cond, sigma, it, m, ("theta",) + (("reference",) if h.kl_beta > 0 else ()))
        old, adv = old.to(e["theta"].device), adv.to(e["theta"].device)
        r = crd_implicit_reward(e["theta"], old[:, 1], self.scale(v["theta"], u), old[:, 2] if h.adaptive else None)
        fit, st = crd_loss(r, adv, h.beta, h.loss_type, h.weight_temp, h.adv_clip, over=centre)
        loss, b = fit * (h.adv_clip / h.beta), len(keys)
        stats = {"train/policy_loss": float(loss.detach()) * b, "train/r_theta_mean": float(st["r_theta_mean"]) * b,
                 "train/fit_abs_mean": float(st["fit_abs_mean"]) * b}
        if h.kl_beta > 0:
            kl = sample_mse(v["theta"], v["reference"])
            k = crd_kl_weight(adv, h.kl_beta, h.adv_clip) if h.reward_adaptive_kl else torch.full_like(kl, h.kl_beta)
            loss = loss + (k.to(kl) * kl).mean()
            stats["train/kl"] = float(kl.detach().sum())
        stats["train/loss"] = float(loss.detach()) * b
        return loss, stats

    def training_step(self, batch: dict, batch_idx: int) -> None:
        h, gen, it = self.hparams, self.generator, int(self.iteration)
        prompts, index, group = list(batch["prompts"]), batch["index"].cpu(), batch["group"].cpu()
        sampler = None if h.sampling_decay_delay is None else (lambda: self.roles.swap(gen, "sampling_policy"))
        ro = collect_endpoints(gen, prompts, self.latent_shape, h.seed, index, self.rollout_config, it, policy=sampler)
        scores = score(self, self.scorer, ro, group, iteration=it)
        adv = group_advantages_of(self, scores, std=h.advantage_std, eps=h.advantage_eps, min_group_size=2,
                                  iteration=it)
        n, x0, sig, all_adv = len(prompts), ro.samples, self.sigmas(it), gather_batch(self, adv)
        cond, mb, per_update = gen.encode_prompts(prompts), h.micro_batch_size or n, len(sig) // h.updates_per_iteration
        chunks = micro_batches(n, mb)

        def unit(m: int, c: torch.Tensor, terms: torch.Tensor):
            old = rank_slice(self, terms, n)[c]
            loss, stats = self.unit_loss(x0[c.to(x0.device)], index[c], adv[c], cond.select(c.tolist()),
                                         float(sig[m]), it, m, old, (terms[:, 0], all_adv))
            return loss * len(c) / (n * per_update), stats, len(c)

        def step(u: int):  # built just before its optimizer step: the centre is the current policy's
            units = []
            for m in range(u * per_update, (u + 1) * per_update):
                terms = self.implicit_rewards(x0, index, cond, chunks, float(sig[m]), it, m)
                units += [lambda m=m, c=c, t=terms: unit(m, c, t) for c in chunks]
            return units

        self.log_dict(optimizer_steps(self, self.optimizers(), (step(u) for u in range(h.updates_per_iteration)),
                                      h.max_grad_norm), batch_size=n)
        s = (it + 1) * h.updates_per_iteration  # optimizer steps taken so far: the reference's schedule clock
        decay = ramped_decay(s, h.old_decay_ramp, h.old_decay_max, start=h.old_decay_start)
        self.log("train/old_decay", self.roles.update_lagged("old_policy", decay), batch_size=n)
        if h.sampling_decay_delay is not None:
            decay = ramped_decay(s, h.sampling_decay_ramp, h.sampling_decay_max, delay=h.sampling_decay_delay)
            self.log("train/sampling_decay", self.roles.update_lagged("sampling_policy", decay), batch_size=n)
        advance_iteration(self, n)

    validation_step = flat_validation_step
