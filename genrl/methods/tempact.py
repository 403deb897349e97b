"""TempAct: planner-executor RL for a causal few-step video student, and RL on distilled streaming students.

Wang et al. 2026, "TempAct: Advancing Temporal Plausibility in Autoregressive Video Generation via Planner-Executor
RL" (arXiv 2606.28016; docs/methods/tempact.md). Each iteration, for P prompts:

1. the planner proposes K plans per prompt (the planning group): step prompts with chunk spans
   (:mod:`genrl.models.plans`); without a planner every "plan" is the global prompt over every chunk;
2. each plan is rolled out to the fork chunk f (drawn per iteration from ``fork_chunks``), switching prompts at its
   step boundaries, and forked into G continuations (the execution group) that finish the video
   (:func:`genrl.rollout.branches.branch_rollout`);
3. the videos are scored by the executor rewards (R_exec) and the planner rewards (R_plan, minus
   ``format_penalty * (1 - F)`` for a malformed plan); advantages are hierarchical
   (:func:`genrl.flow.hierarchical.hierarchical_advantages`: plan return = mean over its G continuations; executor
   baseline = the execution-group mean) or ``flat`` (one group advantage over a prompt's K * G videos for both
   levels: the ablation);
4. one optimizer step over two parameter groups: the executor's clipped policy loss on the re-noise Gaussian of
   the first ``train_chunks`` chunks after the fork, replayed with gradient on the rebuilt cache (ratio exactly 1
   on-policy; :func:`genrl.flow.renoise.renoise_log_prob`) plus ``kl_coef`` times the velocity KL to the reference;
   and the planner's GSPO (or token-level GRPO) loss on its answer tokens with a k3 KL to its reference.

With ``planner: null`` and K = 1 it is GRPO on a distilled causal student with KV-cache rollouts: the G
continuations of a prompt share the prefix up to a random chunk and differ after it (AR-CoPO-style forking), or are
independent videos when f = 0.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import OptimizerCallable

from genrl.flow.hierarchical import hierarchical_advantages
from genrl.flow.policy import clipped_policy_loss, group_advantages, velocity_kl
from genrl.flow.renoise import renoise_log_prob
from genrl.flow.sequence_policy import gspo_loss, token_grpo_loss
from genrl.methods.common import (
    Scorer,
    advance_iteration,
    frame_shape_of,
    gather_batch,
    init_method,
    log_validation_rewards,
    rank_slice,
    trainer_of,
)
from genrl.methods.distill import configure_student
from genrl.methods.phases import Rollouts, optimizer_steps, score
from genrl.methods.planning import build_planner, check_planner_spec, plan_frame_spans, sample_plans
from genrl.models.families import GeneratorSpec
from genrl.models.lora import LoraSpec
from genrl.noise import mix_seed, stream_id
from genrl.rollout.autoregressive import ChunkSchedule
from genrl.rollout.branches import branch_rollout, replay_forks

__all__ = ["TempAct"]

_STREAM_ROLLOUT, _STREAM_FORK, _STREAM_VAL = (stream_id("tempact.rollout"), stream_id("tempact.fork"),
                                            stream_id("tempact.val"))


class TempAct(LightningModule):
    """Planner-executor group RL on a causal student (batches: :class:`genrl.data.PromptDataModule`, group_size 1).

    Args:
        generator / lora: the executor, a causal student (the DMD / Self-Forcing export; LoRA optional).
        schedule / num_frames / frame_shape: its chunk layout and few-step sampler (kernel ``consistency``: the
            re-noise policy), rollout length in latent frames (a chunk boundary), latent frame shape.
        planner: None (the global prompt), ``{"kind": "template", "splitter": "shapes" | "then", "candidates": [...],
            "init_logits": [...]}`` or ``{"kind": "lm", "path": <local LM folder>, "lora": {...}, ...}`` (LMPlanner).
        plans_per_prompt: K >= 1; continuations: G >= 1.
        fork_chunks: chunk indices f is drawn from each iteration (None: every chunk boundary of a uniform plan of
            ``plan_steps`` steps, or 0 without a planner); train_chunks: chunks trained after the fork (None: all).
        plan_steps: the step count of the default fork chunks.
        switch_mode: ``swap``, ``crossattn_reset`` or ``recache`` (LongLive's KV re-cache).
        executor_rewards / planner_rewards: reward specs, scored on the global prompts; planner_rewards None: the
            executor rewards' total.
        reward_spans: ``world`` (the rewards judge each video against its global prompt alone, e.g. the shapes
            world's own step split) or ``plan`` (the plan's frame spans go to the rewards as ``frame_spans``).
        format_penalty: subtracted from R_plan times (1 - F).
        advantages: ``hierarchical`` or ``flat``; clip_plan / clip_exec: advantage clips; std_plan / std_exec:
            "global", "group" or "none".
        train_executor / train_planner: which levels update; update_mode: ``joint`` (both each iteration) or
            ``alternate`` (executor on even iterations, planner on odd).
        clip_range: the executor's ratio clip (1e-4); kl_coef: the executor's velocity-KL weight (needs a reference:
            LoRA or a frozen copy).
        planner_loss: ``gspo`` or ``token_grpo``; planner_clip_range, planner_kl_coef: its clip and k3 KL weight.
        optimizer: factory for the parameter groups; planner_lr: the planner group's learning rate.
        max_grad_norm, seed: as in GRPO.
    Raises:
        ValueError: K, G or train_chunks < 1; unknown modes; num_frames off a chunk boundary; train_planner without a
            trainable planner; a flat advantage with K * G < 2.
    """

    def __init__(self, generator: GeneratorSpec | None = None, lora: LoraSpec | None = None,
                 schedule: ChunkSchedule | None = None, num_frames: int = 8, frame_shape: list[int] | None = None,
                 planner: dict[str, Any] | None = None, plans_per_prompt: int = 4, continuations: int = 4,
                 fork_chunks: list[int] | None = None, train_chunks: int | None = 1, plan_steps: int = 2,
                 switch_mode: Literal["swap", "crossattn_reset", "recache"] = "recache",
                 executor_rewards: list[dict[str, Any]] | None = None,
                 planner_rewards: list[dict[str, Any]] | None = None, format_penalty: float = 0.5,
                 reward_spans: Literal["world", "plan"] = "world",
                 advantages: Literal["hierarchical", "flat"] = "hierarchical", clip_plan: float = 1.0,
                 clip_exec: float = 2.0, std_plan: str = "global", std_exec: str = "global",
                 train_executor: bool = True, train_planner: bool = True,
                 update_mode: Literal["joint", "alternate"] = "joint", clip_range: float = 1e-4, kl_coef: float = 0.0,
                 planner_loss: Literal["gspo", "token_grpo"] = "gspo", planner_clip_range: float = 5e-4,
                 planner_kl_coef: float = 0.0, optimizer: OptimizerCallable = torch.optim.AdamW,
                 planner_lr: float = 1e-2, max_grad_norm: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        if min(plans_per_prompt, continuations, train_chunks or 1) < 1:
            raise ValueError(f"plans_per_prompt, continuations and train_chunks must be >= 1, got {plans_per_prompt}, "
                             f"{continuations}, {train_chunks}")
        if reward_spans not in ("world", "plan"):
            raise ValueError(f"reward_spans must be 'world' or 'plan', got {reward_spans!r}")
        if advantages not in ("hierarchical", "flat") or update_mode not in ("joint", "alternate"):
            raise ValueError(f"advantages must be 'hierarchical' or 'flat' and update_mode 'joint' or 'alternate', got "
                             f"{advantages!r}, {update_mode!r}")
        if advantages == "flat" and plans_per_prompt * continuations < 2:
            raise ValueError("a flat advantage needs plans_per_prompt * continuations >= 2 videos per prompt")
        if planner is None and train_planner and plans_per_prompt > 1:
            raise ValueError("plans_per_prompt > 1 needs a planner (planner: {kind: template, ...}); without one set "
                             "plans_per_prompt: 1 (or train_planner: false)")
        init_method(self, generator, executor_rewards)
        self.optimizer_factory = optimizer
        self.schedule = schedule or ChunkSchedule()
        self.num_chunks = self.schedule.causal.num_chunks(num_frames)
        self.frame_shape = tuple(frame_shape) if frame_shape else None
        self._has_planner = planner is not None
        if planner is not None:
            check_planner_spec(planner)  # built in configure_model, like every network
        self.planner_scorer = Scorer(planner_rewards) if planner_rewards else None

    @property
    def plan_net(self) -> torch.nn.Module | None:
        """The planner (None: the global prompt)."""
        return self.roles.get("planner") if self._has_planner else None

    # ------------------------------------------------------------------ construction
    def configure_model(self) -> None:
        if (student := configure_student(self)) is None:
            return
        self.frame_shape = self.frame_shape or frame_shape_of(student)
        if self._has_planner:  # a trainable role (checkpointed: its logits or LoRA adapter), or a frozen one
            built = build_planner(self.hparams.planner)
            if self.hparams.train_planner and not any(p.requires_grad for p in built.parameters()):
                raise ValueError("train_planner: true, but the planner has no trainable parameters")
            if self.hparams.train_planner:
                self.roles.trainable("planner", built)
            else:
                self.roles.frozen("planner", built.requires_grad_(False))
        if self.hparams.kl_coef > 0 and self.hparams.lora is None:
            self.roles.reference_copy(student)
        if self.planner_scorer is not None:
            self.planner_scorer.build(trainer_of(self))

    def configure_optimizers(self):
        groups = [{"params": [p for p in self.generator.parameters() if p.requires_grad]}]
        if self._has_planner and self.hparams.train_planner:
            groups.append({"params": [p for p in self.plan_net.parameters() if p.requires_grad],
                           "lr": self.hparams.planner_lr})
        return self.optimizer_factory(groups)

    # ------------------------------------------------------------------ one iteration
    def fork_chunk(self, iteration: int) -> int:
        """f for ``iteration``: uniform over ``fork_chunks`` from (seed, iteration)."""
        h = self.hparams
        choices = h.fork_chunks
        if choices is None:
            steps = h.plan_steps if self._has_planner else 1
            choices = [self.num_chunks * i // steps for i in range(1, steps)] or [0]
        g = torch.Generator().manual_seed(mix_seed(h.seed, iteration, _STREAM_FORK))
        return int(choices[int(torch.randint(len(choices), (1,), generator=g))])

    def collect(self, prompts: list[str], index: torch.Tensor, iteration: int):
        """Plans, the branched rollout and its decoded videos (rows p * K + k, videos row * G + g)."""
        h = self.hparams
        plans = sample_plans(self.plan_net, prompts, self.num_chunks, h.plans_per_prompt, h.seed, iteration, index)
        flat = [p for row in plans for p in row]
        rows = (index.repeat_interleave(h.plans_per_prompt) * h.plans_per_prompt
                + torch.arange(h.plans_per_prompt).repeat(len(prompts)))
        was = self.generator.training
        self.generator.eval()
        f = self.fork_chunk(iteration)
        ro = branch_rollout(self.generator, flat, self.frame_shape, self.schedule, f, h.continuations,
                            mix_seed(h.seed, iteration, _STREAM_ROLLOUT), rows, h.train_chunks or self.num_chunks - f,
                            h.switch_mode)
        with torch.no_grad():
            pixels = self.generator.decode(ro.latents.to(self.device))
        self.generator.train(was)
        return flat, ro, pixels

    def rewards(self, prompts: list[str], flat, pixels: torch.Tensor, iteration: int):
        """(R_plan, R_exec, valid_plan, valid_exec) of the gathered batch, [P_all, K, G] each."""
        h = self.hparams
        k, g = h.plans_per_prompt, h.continuations
        video_prompts = [p for p in prompts for _ in range(k * g)]
        ro = Rollouts(video_prompts, pixels, None)
        meta = ({"frame_spans": [plan_frame_spans(p, self.schedule.causal) for p in flat for _ in range(g)]}
                if h.reward_spans == "plan" else {})
        ex = score(self, self.scorer, ro, iteration=iteration, meta=meta)
        pl = score(self, self.planner_scorer, ro, iteration=iteration, prefix="planner_reward", meta=meta) \
            if self.planner_scorer is not None else ex
        fmt = torch.tensor([plan.format_score for plan in flat], dtype=torch.float32).repeat_interleave(g)
        fmt = gather_batch(self, fmt.to(self.device)).cpu()
        self.log("planner/format_score", float(fmt.mean()), batch_size=len(prompts))
        shape = (-1, k, g)
        r_plan = (pl.total.cpu() - h.format_penalty * (1.0 - fmt)).reshape(shape)
        return r_plan, ex.total.cpu().reshape(shape), pl.valid.cpu().reshape(shape), ex.valid.cpu().reshape(shape)

    def advantages(self, r_plan, r_exec, v_plan, v_exec, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A_plan [P, K], A_exec [P, K, G])."""
        h = self.hparams
        if h.advantages == "flat":
            p_all, k, g = r_exec.shape
            total = torch.where(v_plan & v_exec, r_plan + r_exec, torch.full_like(r_exec, float("nan")))
            groups = torch.arange(p_all).repeat_interleave(k * g)
            a = group_advantages(total.reshape(-1), groups, std=h.std_exec, valid=(v_plan & v_exec).reshape(-1))
            a = a.reshape(p_all, k, g).clamp(-h.clip_exec, h.clip_exec)
            a_plan, a_exec = a.mean(dim=2), a
        else:
            out = hierarchical_advantages(r_plan, r_exec, h.clip_plan, h.clip_exec, h.std_plan, h.std_exec,
                                          plan_valid=v_plan, exec_valid=v_exec)
            a_plan, a_exec = out.plan, out.exec
            self.log("advantage/zero_std_plan_frac", out.zero_std_plan_frac, batch_size=n_local)
            self.log("advantage/zero_std_exec_frac", out.zero_std_exec_frac, batch_size=n_local)
        return rank_slice(self, a_plan, n_local), rank_slice(self, a_exec, n_local)

    def executor_units(self, flat, ro, a_exec: torch.Tensor) -> list:
        """One unit per (branch g, trained chunk, stochastic transition j): the clipped re-noise policy loss of the
        R rows, replayed on the rebuilt cache (+ the velocity KL)."""
        h, gen = self.hparams, self.generator
        states = replay_forks(gen, flat, ro, self.frame_shape, self.schedule, h.switch_mode)
        keys = [(g, c, j) for g, traces in enumerate(ro.traces) for c, tr in enumerate(traces)
                for j in range(tr.num_transitions)]
        adv = a_exec.reshape(-1, h.continuations)  # [R, G]

        def unit(g: int, c: int, j: int):
            st, tr = states[g][c], ro.traces[g][c]
            x, x_next = tr.x[j].to(self.device), tr.x[j + 1].to(self.device)
            s0, s1 = float(tr.sigmas[j]), float(tr.sigmas[j + 1])
            sig = torch.full((x.shape[0],), s0, device=self.device, dtype=x.dtype)
            v = gen.velocity_chunk(x, sig, st.cond, st.cache).to(x.dtype)
            lp = renoise_log_prob(x_next, x, v, s0, s1)
            old = renoise_log_prob(x_next, x, tr.v[j].to(self.device), s0, s1)
            loss, stats = clipped_policy_loss(lp, old, adv[:, g].to(lp), h.clip_range, adv_clip_max=h.clip_exec)
            loss = loss.mean()
            if h.kl_coef > 0:
                with torch.no_grad(), self.roles.reference(gen) as ref:
                    v_ref = ref.velocity_chunk(x, sig, st.cond, st.cache).to(x.dtype)
                kl = velocity_kl(v, v_ref).mean()
                loss = loss + h.kl_coef * kl
                stats["kl"] = kl.detach()
            out = {f"executor/{k}": float(v) for k, v in stats.items()}
            out["executor/log_ratio_abs"] = float((lp - old).detach().abs().max())
            return loss / len(keys), out, 1

        return [lambda key=key: unit(*key) for key in keys]

    def planner_unit(self, flat, a_plan: torch.Tensor):
        """The planner's GSPO / token-GRPO loss over the K * P plans (on-policy: old = behaviour log-probs)."""
        h, planner = self.hparams, self.plan_net
        self._planner_stats = {}

        def unit():
            lp, mask = planner.token_log_probs(flat)
            old = torch.nn.utils.rnn.pad_sequence([p.behaviour_log_probs for p in flat], batch_first=True)
            old = old[:, : lp.shape[1]].to(lp)
            ref = None
            if h.planner_kl_coef > 0:
                with torch.no_grad(), planner.reference():
                    ref = planner.token_log_probs(flat)[0]
            fn = gspo_loss if h.planner_loss == "gspo" else token_grpo_loss
            loss, stats = fn(lp, old, a_plan.reshape(-1).to(lp), mask.to(lp.device), h.planner_clip_range,
                             h.planner_kl_coef, ref)
            self._planner_stats = {f"planner/{k}": float(v) for k, v in stats.items()}
            return loss, {}, 0

        return unit

    def training_step(self, batch: dict, batch_idx: int) -> None:
        h, it = self.hparams, int(self.iteration)
        prompts, index = list(batch["prompts"]), batch["index"].cpu()
        flat, ro, pixels = self.collect(prompts, index, it)
        r_plan, r_exec, v_plan, v_exec = self.rewards(prompts, flat, pixels, it)
        a_plan, a_exec = self.advantages(r_plan, r_exec, v_plan, v_exec, len(prompts))
        exec_turn = h.train_executor and (h.update_mode == "joint" or it % 2 == 0)
        plan_turn = self._has_planner and h.train_planner and (h.update_mode == "joint" or it % 2 == 1)
        units = (self.executor_units(flat, ro, a_exec) if exec_turn else []) + \
            ([self.planner_unit(flat, a_plan)] if plan_turn else [])
        bs = len(prompts)
        if units:
            stats = optimizer_steps(self, self.optimizers(), [units], h.max_grad_norm)
            for key, value in (stats | getattr(self, "_planner_stats", {})).items():
                self.log(f"train/{key}", value, batch_size=bs)
        self.log("train/fork_chunk", float(ro.fork_chunk), batch_size=bs)
        if hasattr(self.plan_net, "probabilities"):  # a template planner: its distribution over the candidates
            for name, prob in zip(self.plan_net.candidates, self.plan_net.probabilities().tolist()):
                self.log(f"planner/p_{name}", prob, batch_size=bs)
        self.log("plan/return_mean", float(r_plan.nanmean()), batch_size=bs)
        advance_iteration(self, bs)

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def generate(self, prompts: list[str], indices: torch.Tensor, seed: int | None = None):
        """(videos, plans): each prompt's first planned plan (the planner's draw at iteration 0), executed without
        forking; pixels [B, T, C, H, W] in [0, 1]."""
        h = self.hparams
        seed = mix_seed(h.seed, _STREAM_VAL) if seed is None else seed
        plans = [row[0] for row in sample_plans(self.plan_net, prompts, self.num_chunks, 1, seed, 0, indices)]
        ro = branch_rollout(self.generator, plans, self.frame_shape, self.schedule, 0, 1, seed, indices,
                            switch_mode=h.switch_mode, branch_seed=seed)
        return self.generator.decode(ro.latents.to(self.device)), plans

    def validation_step(self, batch: dict, batch_idx: int) -> dict:
        prompts, index = list(batch["prompts"]), batch["index"].cpu()
        videos, plans = self.generate(prompts, index)
        meta = {"frame_spans": [plan_frame_spans(p, self.schedule.causal) for p in plans]} \
            if self.hparams.reward_spans == "plan" else {}
        return log_validation_rewards(self, self.scorer, videos, prompts, **meta)
