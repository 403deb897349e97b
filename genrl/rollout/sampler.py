"""The rollout sampler shared by every method and by evaluation.

One loop over a sigma schedule; at each step a guided velocity (CFG in the standard form) and one step
kernel from :mod:`genrl.flow.sde` (deterministic Euler ODE, Flow-GRPO SDE, DanceGRPO SDE). The kernel is
the same pure function the losses call through :func:`transition_log_prob`, so a recomputed log-prob with
unchanged weights equals the rollout's bit for bit (importance ratio exactly 1 on the first update).

Reproducibility (docs/architecture.md, Seeds and noise addressing): the initial noise of sample i is drawn from
(seed, i, step 0) and the noise of its SDE step k from (seed, i, step k + 1), on the generator's device; with
``batching="fixed"`` (the default) the network runs in fixed-size micro-batches (the last one padded by repetition)
and text is padded to a fixed length, so a sample's trajectory does not depend on which other samples share its
batch: regenerating sample i alone reproduces it bitwise. ``batching="fast"`` / ``"bucketed"`` size the calls to the
work instead (docs/architecture.md, Batching: bitwise or fast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from genrl.flow import cfg_combine, sigma_schedule
from genrl.flow.sde import sde_step, step_log_prob
from genrl.models.conditions import null_prompts
from genrl.models.text_encoder import Conditioning
from genrl.noise import NoiseBackend, check_backend, mix_seed, randn_per_sample, stream_id

#: the flat rollout's noise stream (initial noise at step 0, SDE noise at step k + 1) and the stream of initial noise
#: addressed by key (genrl.noise.STREAMS).
_FLAT, _INITIAL_BY_KEY = stream_id("rollout.flat"), stream_id("rollout.initial_by_key")

__all__ = ["BATCHING_MODES", "SDE_STEP_MODES", "RolloutConfig", "Trajectory", "call_plan", "encode_cfg",
           "guided_velocity", "rollout", "sde_mask", "transition_log_prob"]

Kernel = Literal["ode", "flow_grpo", "dance_grpo"]
Batching = Literal["fixed", "fast", "bucketed"]
#: the accepted values of ``RolloutConfig.batching``.
BATCHING_MODES = ("fixed", "fast", "bucketed")
#: the accepted values of ``RolloutConfig.sde_steps``.
SDE_STEP_MODES = ("all", "prefix", "window", "progressive", "random_steps")


@dataclass
class RolloutConfig:
    """How rollouts are sampled (a typed config block of every method).

    Attributes:
        num_steps: denoising steps S (Flow-GRPO trains with 10, evaluates with 40).
        shift: sigma-schedule shift s, sigma' = s sigma / (1 + (s - 1) sigma).
        kernel: ``"ode"``, ``"flow_grpo"`` (g = a sqrt(sigma / (1 - sigma)), a = ``noise_level``) or
            ``"dance_grpo"`` (g = eta = ``noise_level``); docs/methods/grpo.md (Exploration).
        noise_level: a (Flow-GRPO, default 0.7) or eta (DanceGRPO, 0.3).
        cfg_scale: guidance scale w of the rollout policy (1 = conditional model only).
        sde_steps: which steps are stochastic, hence recorded and trainable (the others are ODE steps); the mask is
            :func:`sde_mask`, a pure function of (config, seed, rollout_id), the training iteration being the
            rollout id:

            - ``"all"``;
            - ``"prefix"``: the first ``num_sde_steps`` (Flow-GRPO's timestep fraction);
            - ``"window"``: ``num_sde_steps`` consecutive steps starting uniformly in [``window_start``,
              ``window_end`` - ``num_sde_steps``], redrawn per rollout (Flow-GRPO-Fast);
            - ``"progressive"``: ``num_sde_steps`` consecutive steps whose start moves with the iteration k
              (MixGRPO, Li et al. 2025, arXiv 2507.21802): with the P = ``window_end`` - ``num_sde_steps`` -
              ``window_start`` + 1 starts p in [``window_start``, ``window_end`` - ``num_sde_steps``],
              ``s(k) = window_start + ((k // window_iterations) * window_stride) mod P``: the window advances by
              ``window_stride`` every ``window_iterations`` iterations and wraps round. It always holds exactly
              ``num_sde_steps`` steps (MixGRPO's own scheduler also reaches a start of T - 2, whose window is empty,
              so one block of iterations trains nothing, and clips the windows before it; genrl's starts stop where
              a whole window still fits). With ``window_stride`` > 1 the start continues from the remainder after a
              wrap (MixGRPO restarts from 0), so all starts that are multiples of gcd(``window_stride``, P) after
              ``window_start`` are visited;
            - ``"random_steps"``: ``num_sde_steps`` distinct steps drawn uniformly without replacement from
              ``sde_candidates`` (None: every step in [``window_start``, ``window_end``)), redrawn per rollout
              (Flow-Factory's step list with a step count).

            ``"window"`` and ``"random_steps"`` draw from (seed, rollout_id): the same steps for every sample and
            rank of one rollout.
        num_sde_steps: see ``sde_steps``; ignored for ``"all"``.
        window_start, window_end: range of the window (``window_end`` None = ``num_steps`` for ``"window"``; for
            ``"progressive"`` and ``"random_steps"`` None = ``num_steps - 1`` with ``skip_last_step``, else
            ``num_steps``, so that every window keeps its ``num_sde_steps`` steps; these two modes refuse a
            ``window_end`` that reaches the last step under ``skip_last_step``). ``"window"`` keeps its historical
            default: a window that reaches the last step there loses that step.
        window_iterations: ``"progressive"``: iterations per window position, >= 1 (MixGRPO 25, MixGRPO-Flash 20).
        window_stride: ``"progressive"``: steps the window advances per position, >= 1 and below the number of
            positions when there are several (MixGRPO's ``prog_overlap_step``, 1).
        sde_candidates: ``"random_steps"``: the steps to draw from (distinct, in [0, ``num_steps``), the last step
            excluded under ``skip_last_step``, at least ``num_sde_steps`` of them); ``window_start`` /
            ``window_end`` are then ignored. None: every step in [``window_start``, ``window_end``). Only valid
            with ``sde_steps="random_steps"``.
        skip_last_step: never make the last step stochastic (its Gaussian is so narrow that log-probs blow
            up; Flow-GRPO and DanceGRPO exclude it).
        micro_batch_size: samples per network call: exactly (``batching="fixed"``, the last call padded by
            repetition) or at most (``"fast"`` / ``"bucketed"``).
        batching: ``"fixed"`` (default): every call has ``micro_batch_size`` rows, so a sample's result is bitwise
            independent of the batch it was drawn in (and a recomputed log-prob equals the rollout's bitwise);
            ``"fast"``: ``ceil(B / micro_batch_size)`` calls of near-equal size, no padding (a tree's small frontier
            costs only its own rows; results depend on the call size in the last bits, the first update's ratio is 1
            up to float rounding); ``"bucketed"``: as ``"fast"`` with each call padded up to a power of two (at most
            ``micro_batch_size``), so a compiled denoiser sees a few static shapes. docs/architecture.md.
        noise_backend: ``"generator"`` (one ``torch.Generator`` per sample on the generator's device) or
            ``"philox"`` (counter-based, one batched draw, the same integer stream on every device); see
            :mod:`genrl.noise`.
        null_prompt: the unconditional prompt for CFG.
        schedule: an explicit sigma schedule of ``num_steps + 1`` values, descending from at most 1 to 0, used instead
            of the shifted uniform one (e.g. the ``sigmas`` of a diffusers scheduler after ``set_timesteps``, to
            reproduce a diffusers pipeline exactly). ``shift`` is then ignored.
        initial_noise: ``"sample"`` (default: every sample's starting noise addressed by its own index) or
            ``"group"``: the starting noise addressed by the sample's group id (:func:`rollout`'s ``initial_keys``),
            so a group's members coincide until its first stochastic step and differ only through that step's noise
            and after it ("seed groups" of TempFlow-GRPO, He et al. 2025, arXiv 2508.04324; with ``sde_steps:
            window`` and ``num_sde_steps: 1`` this is TempFlow's single branch step: a shared ODE prefix, one SDE
            step, ODE after). The stochastic steps' noise stays per sample.
    """

    num_steps: int = 10
    shift: float = 1.0
    kernel: Kernel = "flow_grpo"
    noise_level: float = 0.7
    cfg_scale: float = 1.0
    sde_steps: Literal["all", "prefix", "window", "progressive", "random_steps"] = "all"
    num_sde_steps: int = 2
    window_start: int = 0
    window_end: int | None = None
    window_iterations: int = 25
    window_stride: int = 1
    sde_candidates: list[int] | None = None
    skip_last_step: bool = True
    micro_batch_size: int = 8
    null_prompt: str = ""
    schedule: list[float] | None = None
    batching: Batching = "fixed"
    noise_backend: NoiseBackend = "generator"
    initial_noise: Literal["sample", "group"] = "sample"

    def __post_init__(self) -> None:
        if self.schedule is not None:
            sig = [float(v) for v in self.schedule]
            if len(sig) != self.num_steps + 1:
                raise ValueError(f"schedule has {len(sig)} values; num_steps={self.num_steps} needs "
                                 f"{self.num_steps + 1}")
            if not (sig[0] <= 1.0 and sig[-1] == 0.0 and all(a > b for a, b in zip(sig, sig[1:]))):
                raise ValueError(f"schedule must descend strictly from <= 1 to exactly 0, got {sig}")
            self.schedule = sig
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.kernel not in ("ode", "flow_grpo", "dance_grpo"):
            raise ValueError(f"unknown kernel {self.kernel!r}; use 'ode', 'flow_grpo' or 'dance_grpo'")
        if self.noise_level < 0 or self.cfg_scale < 0:
            raise ValueError(f"noise_level and cfg_scale must be >= 0, got {self.noise_level}, {self.cfg_scale}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"unknown batching {self.batching!r}; use 'fixed' (bitwise batch-independent), 'fast' "
                             f"(calls sized to the work) or 'bucketed' (fast, padded to powers of two for compile)")
        check_backend(self.noise_backend)
        if self.sde_steps not in SDE_STEP_MODES:
            raise ValueError(f"unknown sde_steps {self.sde_steps!r}; use one of {SDE_STEP_MODES}")
        if self.initial_noise not in ("sample", "group"):
            raise ValueError(f"initial_noise must be 'sample' (per sample) or 'group' (shared by a group's members), "
                             f"got {self.initial_noise!r}")
        if self.sde_steps != "all" and not 1 <= self.num_sde_steps <= self.num_steps:
            raise ValueError(f"num_sde_steps must be in [1, num_steps={self.num_steps}], got {self.num_sde_steps}")
        for name in ("window_iterations", "window_stride"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.sde_candidates is not None and self.sde_steps != "random_steps":
            raise ValueError(f"sde_candidates={self.sde_candidates} is only used by sde_steps='random_steps' (got "
                             f"sde_steps={self.sde_steps!r}); remove it or set sde_steps: random_steps")
        if self.sde_steps == "random_steps" and self.sde_candidates is not None:
            self.sde_candidates = self._checked_candidates(self.sde_candidates)
        elif self.sde_steps in ("progressive", "random_steps"):
            self._check_sde_range()

    def sde_range(self) -> tuple[int, int]:
        """[start, end) of the steps the ``"progressive"`` window sweeps and ``"random_steps"`` draws from (without
        ``sde_candidates``): ``window_start`` and ``window_end``, which defaults to ``num_steps - 1`` under
        ``skip_last_step`` (the last step is never stochastic), else ``num_steps``."""
        default = self.num_steps - 1 if self.skip_last_step else self.num_steps
        return self.window_start, default if self.window_end is None else self.window_end

    def _check_sde_range(self) -> None:
        """Validate [window_start, window_end) for ``"progressive"`` / ``"random_steps"`` (ValueError naming the bad
        value and the fix)."""
        mode, n = self.sde_steps, self.num_sde_steps
        start, end = self.sde_range()
        last = self.num_steps - 1
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"window_start must be an integer >= 0, got {start!r}")
        if self.window_end is not None and (isinstance(end, bool) or not isinstance(end, int)):
            raise ValueError(f"window_end must be an integer or null, got {end!r}")
        if end > self.num_steps:
            raise ValueError(f"window_end={end} is past num_steps={self.num_steps}; set window_end <= "
                             f"{self.num_steps if not self.skip_last_step else last} or leave it unset")
        if self.skip_last_step and end > last:
            raise ValueError(f"window_end={end} includes the last step {last}, which skip_last_step keeps "
                             f"deterministic, so a sde_steps={mode!r} window there would lose a step; set window_end "
                             f"<= {last} (unset defaults to {last}) or skip_last_step: false")
        if end - start < n:
            raise ValueError(f"num_sde_steps={n} steps do not fit in [window_start={start}, window_end={end}) "
                             f"(sde_steps={mode!r}, num_steps={self.num_steps}, skip_last_step="
                             f"{self.skip_last_step}); lower num_sde_steps or widen the range")
        positions = end - n - start + 1
        if mode == "progressive" and positions > 1 and self.window_stride >= positions:
            raise ValueError(f"window_stride={self.window_stride} is not below the {positions} window positions "
                             f"(starts {start}..{end - n}), so it would wrap past every start; set window_stride in "
                             f"[1, {positions - 1}]")

    def _checked_candidates(self, candidates) -> list[int]:
        """``sde_candidates`` validated (ValueError naming the bad value and the fix) and sorted."""
        if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
            raise ValueError(f"sde_candidates must be a list of step indices, got {candidates!r}")
        last = self.num_steps - 1
        for c in candidates:
            if isinstance(c, bool) or not isinstance(c, int):
                raise ValueError(f"sde_candidates holds {c!r}, not a step index; give integers in [0, {last}]")
            if not 0 <= c <= last:
                raise ValueError(f"sde_candidates holds step {c}, outside [0, {last}] (num_steps={self.num_steps}); "
                                 f"remove it")
            if self.skip_last_step and c == last:
                raise ValueError(f"sde_candidates holds the last step {c}, which skip_last_step keeps deterministic; "
                                 f"remove it or set skip_last_step: false")
        dupes = sorted({c for c in candidates if list(candidates).count(c) > 1})
        if dupes:
            raise ValueError(f"sde_candidates repeats step(s) {dupes}; list each step once")
        if len(candidates) < self.num_sde_steps:
            raise ValueError(f"sde_candidates={list(candidates)} has {len(candidates)} step(s), fewer than "
                             f"num_sde_steps={self.num_sde_steps}; add candidates or lower num_sde_steps")
        return sorted(int(c) for c in candidates)

    def sigma_at_one(self, sigmas: torch.Tensor) -> float | None:
        """The Flow-GRPO kernel's stand-in for sigma = 1 in g's denominator: the schedule's second entry
        (None for a one-step schedule); see :func:`genrl.flow.sde.diffusion_coefficient`."""
        return float(sigmas[1]) if self.num_steps > 1 else None

    def sigmas(self) -> torch.Tensor:
        """The float64 sigma schedule [num_steps + 1], from shift(1) (or ``schedule[0]``) down to 0."""
        if self.schedule is not None:
            return torch.tensor(self.schedule, dtype=torch.float64)
        return sigma_schedule(self.num_steps, shift=self.shift)


def sde_mask(config: RolloutConfig, seed: int, rollout_id: int = 0) -> torch.Tensor:
    """Which steps of a rollout use the stochastic kernel (hence are recorded and trainable).

    A pure function of (config, seed, rollout_id); see ``RolloutConfig.sde_steps`` for the modes. ``"window"`` and
    ``"random_steps"`` draw from (seed, rollout_id) with a CPU generator, so every sample and rank of one rollout gets
    the same steps; ``"progressive"`` depends on ``rollout_id`` (the training iteration k) only:
    ``start = window_start + ((k // window_iterations) * window_stride) mod P`` with P the number of window starts
    (MixGRPO, arXiv 2507.21802). An ``"ode"`` kernel has no stochastic step.

    Args:
        config: the :class:`RolloutConfig`; seed: run seed; rollout_id: the rollout's id (the iteration), an int
            (>= 0 for ``"progressive"``).
    Returns:
        bool [num_steps] on the CPU; ``"prefix"`` / ``"progressive"`` / ``"random_steps"`` have exactly
        ``num_sde_steps`` True (``"prefix"`` one fewer when it reaches the last step under ``skip_last_step``).
    Raises:
        ValueError: a ``"window"`` that does not fit in its range; a negative ``rollout_id`` with ``"progressive"``.
    """
    s = config.num_steps
    mask = torch.zeros(s, dtype=torch.bool)
    if config.kernel == "ode":
        return mask
    n = config.num_sde_steps
    if config.sde_steps == "all":
        mask[:] = True
    elif config.sde_steps == "prefix":
        mask[:n] = True
    elif config.sde_steps == "progressive":
        if int(rollout_id) < 0:
            raise ValueError(f"a progressive SDE window needs rollout_id (the training iteration) >= 0, got "
                             f"{rollout_id}")
        lo, end = config.sde_range()
        positions = end - n - lo + 1
        k = lo + ((int(rollout_id) // config.window_iterations) * config.window_stride) % positions
        mask[k : k + n] = True
    elif config.sde_steps == "random_steps":
        if config.sde_candidates is not None:
            candidates = list(config.sde_candidates)
        else:
            lo, end = config.sde_range()
            candidates = list(range(lo, end))
        g = torch.Generator().manual_seed(mix_seed(seed, rollout_id, 0, stream_id("rollout.sde_random_steps")))
        picked = torch.randperm(len(candidates), generator=g)[:n]
        mask[torch.tensor([candidates[int(i)] for i in picked], dtype=torch.long)] = True
    else:
        end = config.window_end if config.window_end is not None else s
        hi = end - n
        if hi < config.window_start:
            raise ValueError(
                f"window of {n} steps does not fit in [{config.window_start}, {end})"
            )
        g = torch.Generator().manual_seed(mix_seed(seed, rollout_id, 0, stream_id("rollout.sde_window")))
        k = int(torch.randint(config.window_start, hi + 1, (1,), generator=g))
        mask[k : k + n] = True
    if config.skip_last_step:
        mask[-1] = False
    return mask


@dataclass
class Trajectory:
    """What a rollout recorded (``record=True``); tensors on the CPU except ``final``.

    Attributes:
        latents: [B, S + 1, *latent] the state before every step and the final sample.
        sigmas: float64 [S + 1] schedule; step k goes from sigmas[k] to sigmas[k + 1].
        sde_mask: bool [S], stochastic (trainable) steps.
        log_probs: float32 [B, S] per-step Gaussian log-probs, mean over latent elements (0 on ODE steps).
        means, stds: [B, S, *latent] and [S] of the SDE transitions (None unless ``record_moments``).
        noises: [B, S, *latent] the unit Gaussian noise of each step (0 on ODE steps).
        final: [B, *latent] final latents (on the generator's device).
        seed, indices, prompts: the addresses that regenerate each sample.
        config: the :class:`RolloutConfig` used.
        live: with ``rollout(grad="sde")``, ``{step: (log_prob [B], velocity, mean)}`` of every stochastic step,
            computed in the rollout with their autograd graphs kept (what :func:`transition_log_prob` would
            recompute with unchanged weights); empty otherwise, and dropped by :meth:`select`.
    """

    latents: torch.Tensor
    sigmas: torch.Tensor
    sde_mask: torch.Tensor
    log_probs: torch.Tensor
    noises: torch.Tensor
    final: torch.Tensor
    seed: int
    indices: torch.Tensor
    prompts: list[str]
    config: RolloutConfig
    means: torch.Tensor | None = None
    stds: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)
    live: dict = field(default_factory=dict)

    @property
    def sde_steps(self) -> list[int]:
        return [int(k) for k in torch.nonzero(self.sde_mask).flatten()]

    def step_moments(self, step: int) -> tuple[torch.Tensor, float]:
        """The rollout's transition at stochastic step ``step``: (mean mu_old [B, *latent] on the CPU, std s > 0), as
        sampled (what GRPO-Guard and Flow-DPPO compare the current policy's mean with).

        Raises:
            ValueError: the rollout did not record moments (``rollout(record_moments=True)``), or ``step`` is not
                one of its stochastic steps (the message lists them).
        """
        if self.means is None or self.stds is None:
            raise ValueError("this trajectory has no step moments; roll out with record_moments=True")
        if not 0 <= step < len(self.sde_mask) or not bool(self.sde_mask[step]):
            raise ValueError(f"step {step} is not a stochastic step of this trajectory; stochastic steps: "
                             f"{self.sde_steps}")
        return self.means[:, step], float(self.stds[step])

    def select(self, rows: Sequence[int] | torch.Tensor) -> Trajectory:
        """The sub-trajectory of samples ``rows`` (for mini-batching the loss)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t[rows.to(t.device)]  # noqa: E731
        return Trajectory(
            latents=self.latents[rows], sigmas=self.sigmas, sde_mask=self.sde_mask, log_probs=self.log_probs[rows],
            noises=self.noises[rows], final=pick(self.final), seed=self.seed, indices=self.indices[rows],
            prompts=[self.prompts[int(i)] for i in rows], config=self.config, means=pick(self.means),
            stds=self.stds, extras=dict(self.extras),
        )


def call_plan(n: int, size: int, batching: str = "fixed") -> list[tuple[list[int], list[int]]]:
    """How ``n`` rows are split into network calls: a list of (rows, padded rows) per call, ``padded`` being
    ``rows`` followed by repeats of its last row.

    ``"fixed"``: consecutive calls of exactly ``size`` rows (the last one padded); ``"fast"``: ``ceil(n / size)``
    calls of near-equal size (sizes differ by at most 1), no padding; ``"bucketed"``: the fast split, each call
    padded up to the next power of two, capped at ``size``.

    Raises:
        ValueError: ``size`` < 1 or an unknown ``batching``.
    """
    if size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {size}")
    if batching not in BATCHING_MODES:
        raise ValueError(f"unknown batching {batching!r}; use one of {BATCHING_MODES}")
    if batching == "fixed":
        chunks = [list(range(s, min(n, s + size))) for s in range(0, n, size)]
        return [(rows, rows + [rows[-1]] * (size - len(rows))) for rows in chunks]
    calls = -(-n // size)
    plan, start = [], 0
    for c in range(calls):
        m = n // calls + (1 if c < n % calls else 0)
        rows = list(range(start, start + m))
        start += m
        target = min(size, 1 << (m - 1).bit_length()) if batching == "bucketed" else m
        plan.append((rows, rows + [rows[-1]] * (target - m)))
    return plan


def guided_velocity(
    generator, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning, uncond: Conditioning | None,
    cfg_scale: float, micro_batch_size: int, batching: str = "fixed",
) -> torch.Tensor:
    """Velocity with CFG ``v_u + w (v_c - v_u)`` (Ho & Salimans 2022), evaluated in the network calls of
    :func:`call_plan` (``batching``: ``"fixed"`` micro-batches by default).

    Args:
        x: [B, *latent]; sigma: [B] or [B, T]; cond / uncond: B prompts each (uncond None when w = 1).
    A generator whose guidance scale depends on the noise level (Wan2.2 A14B's second scale for its low-noise
    expert) has ``cfg_scale_at(sigma, cfg_scale) -> scale [B]``; it is used instead of ``cfg_scale`` when guidance
    is on (``cfg_scale != 1``).

    Returns:
        float32 velocity [B, *latent]; differentiable when grad is enabled.
    """
    scale_at = getattr(generator, "cfg_scale_at", None)
    outs = []
    for rows, padded in call_plan(x.shape[0], micro_batch_size, batching):
        if padded == list(range(x.shape[0])):  # one call over every row, in order: no copy
            xb, sb, cb = x, sigma, cond
        else:
            idx = torch.tensor(padded, device=x.device)
            xb, sb, cb = x[idx], sigma[idx], cond.select(padded)
        if uncond is not None and cfg_scale != 1.0:
            ub = uncond if cb is cond else uncond.select(padded)
            v_c, v_u = generator.velocity(torch.cat([xb, xb]), torch.cat([sb, sb]),
                                          Conditioning.cat([cb, ub])).float().chunk(2)
            v = cfg_combine(v_c, v_u, cfg_scale if scale_at is None else scale_at(sb, cfg_scale))
        else:
            v = generator.velocity(xb, sb, cb).float()
        outs.append(v[: len(rows)])
    return torch.cat(outs)


def encode_cfg(generator, prompts: list[str], config: RolloutConfig):
    """(conditional, unconditional) conditioning of ``prompts`` for ``config``'s CFG: the unconditional one encodes
    ``config.null_prompt`` per prompt (keeping an image-conditioned prompt's image: guidance drops only the text), and
    is None when ``config.cfg_scale`` is 1 (no guidance)."""
    cond = generator.encode_prompts(prompts)
    uncond = generator.encode_prompts(null_prompts(prompts, config.null_prompt)) if config.cfg_scale != 1.0 else None
    return cond, uncond


_encode = encode_cfg


def fixed_latents(generator, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The latents a generator's condition fixes, as ``(values [B, *latent], keep)``, or None (nothing fixed).

    ``keep`` is a bool mask broadcastable to the latents, True where the sampler draws (e.g. Wan2.2-TI2V's
    image-to-video gives latent frame 0: it is the encoded first frame at every step, carries no SDE noise and is
    left out of each step's log-prob). A generator declares it with ``fixed_latents(cond)``.
    """
    fn = getattr(generator, "fixed_latents", None)
    return None if fn is None else fn(cond)


def rollout(
    generator,
    prompts: list[str],
    latent_shape: Sequence[int],
    seed: int,
    indices: Sequence[int] | torch.Tensor | None = None,
    config: RolloutConfig | None = None,
    rollout_id: int = 0,
    record: bool = True,
    record_moments: bool = False,
    grad: Literal["none", "full", "sde"] = "none",
    progress: bool = False,
    initial_keys: Sequence[int] | torch.Tensor | None = None,
) -> Trajectory:
    """Sample a batch of trajectories.

    Args:
        generator: any :class:`~genrl.models.generator.Generator`.
        prompts: B prompts (repeat a prompt K times for a GRPO group).
        latent_shape: per-sample latent shape, e.g. (T, C, H, W).
        seed: run seed; indices: per-sample global ids (default 0..B-1); together they address all noise.
        config: the :class:`RolloutConfig`.
        rollout_id: id of this rollout (e.g. the iteration), which draws the SDE window.
        record: keep latents / noises / log-probs per step (False: only ``final`` and ``log_probs``).
        record_moments: also keep the SDE means and stds.
        grad: ``"none"`` (RL rollouts), ``"full"`` (backpropagate through every step; small models only) or
            ``"sde"``: gradients only through each stochastic step's own velocity, the state entering the step
            detached; the step's log-prob of its (detached) sample, velocity and mean are kept with their graphs in
            ``Trajectory.live``, so an on-policy update can back-propagate them instead of recomputing the forward
            (:class:`~genrl.methods.GRPO` ``reuse_rollout_forward``). Memory: the activations of every stochastic
            step of the whole batch are held until the update.
        progress: show a progress bar over steps.
        initial_keys: with ``config.initial_noise == "group"``, the samples' group ids [B]: the starting noise of a
            sample is addressed by (seed, its group id, stream 1), the same for every member of a group.
    Returns:
        :class:`Trajectory`.
    Raises:
        ValueError: len(indices) != len(prompts), an unknown grad policy, or ``initial_noise: group`` without
            ``initial_keys`` of length B.
    """
    config = config or RolloutConfig()
    if grad not in ("none", "full", "sde"):
        raise ValueError(f"grad must be 'none', 'full' or 'sde', got {grad!r}")
    n = len(prompts)
    indices = torch.arange(n) if indices is None else torch.as_tensor(list(map(int, indices)), dtype=torch.long)
    if len(indices) != n:
        raise ValueError(f"{len(indices)} indices for {n} prompts")
    device = generator.device
    sigmas = config.sigmas()
    mask = sde_mask(config, seed, rollout_id)
    sig32 = sigmas.to(device=device, dtype=torch.float32)
    sigma_at_one = config.sigma_at_one(sigmas)
    ctx = torch.enable_grad() if grad == "full" else torch.no_grad()
    with ctx:
        cond, uncond = _encode(generator, list(prompts), config)
        if config.initial_noise == "group":
            if initial_keys is None or len(initial_keys) != n:
                raise ValueError(f"initial_noise: group shares the starting noise by group id: pass initial_keys (the "
                                 f"{n} samples' group ids; GRPO passes batch['group']), got "
                                 f"{None if initial_keys is None else len(initial_keys)}")
            x = randn_per_sample(latent_shape, seed, torch.as_tensor(list(map(int, initial_keys))), step=0,
                                 stream=_INITIAL_BY_KEY, device=device, backend=config.noise_backend)
        else:
            x = randn_per_sample(latent_shape, seed, indices, step=0, stream=_FLAT, device=device,
                                 backend=config.noise_backend)
        fixed = fixed_latents(generator, cond)
        keep = None
        if fixed is not None:
            values, keep = fixed
            x = torch.where(keep, x, values.to(x.dtype))
        latents, noises, log_probs, means = [x.detach().cpu()], [], [], []
        steps = range(config.num_steps)
        if progress:
            from rich.progress import track

            steps = track(steps, description="rollout")
        live = {}
        for k in steps:
            s = sig32[k].expand(n)
            with torch.enable_grad() if grad == "sde" and mask[k] else contextlib.nullcontext():
                v = guided_velocity(generator, x, s, cond, uncond, config.cfg_scale, config.micro_batch_size,
                                    config.batching)
            if mask[k]:
                noise = randn_per_sample(latent_shape, seed, indices, step=k + 1, stream=_FLAT, device=device,
                                         backend=config.noise_backend)
                kind = config.kernel
            else:
                noise = torch.zeros_like(x)
                kind = "ode"
            out = sde_step(kind, x, v, sig32[k], sig32[k + 1], noise, noise_level=config.noise_level,
                           sigma_at_one=sigma_at_one, keep=keep)
            if grad == "sde" and mask[k]:  # the loss side of the step, on the detached sample (as recomputed)
                with torch.enable_grad():
                    lp, mean, _ = step_log_prob(kind, x, v, sig32[k], sig32[k + 1], out.sample.detach(),
                                                noise_level=config.noise_level, sigma_at_one=sigma_at_one, keep=keep)
                live[k] = (lp, v, mean)
            x = out.sample if grad != "sde" else out.sample.detach()  # (sde_step ran without grad: no graph)
            log_probs.append(out.log_prob.detach().float().cpu())
            if record:
                latents.append(x.detach().cpu())
                noises.append(noise.detach().cpu())
                if record_moments:
                    means.append((out.mean.detach().cpu(), float(out.std.flatten()[0]) if out.std.numel() else 0.0))
    empty = torch.empty(0)
    return Trajectory(
        latents=torch.stack(latents, dim=1) if record else empty,
        sigmas=sigmas,
        sde_mask=mask,
        log_probs=torch.stack(log_probs, dim=1),
        noises=torch.stack(noises, dim=1) if record else empty,
        final=x,
        seed=seed,
        indices=indices,
        prompts=list(prompts),
        config=config,
        means=torch.stack([m for m, _ in means], dim=1) if record_moments else None,
        stds=torch.tensor([s for _, s in means]) if record_moments else None,
        live=live,
    )


def transition_log_prob(
    generator, traj: Trajectory, step: int, cond: Conditioning | None = None, uncond: Conditioning | None = None,
    cfg_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of the recorded transition ``latents[:, step] -> latents[:, step + 1]`` under the current weights.

    Uses the same guided velocity (same micro-batches, same CFG) and the same kernel as :func:`rollout`,
    so with unchanged weights the result equals ``traj.log_probs[:, step]`` exactly (``batching="fixed"``; with
    ``"fast"`` / ``"bucketed"`` up to float rounding when ``traj`` is a sub-batch of the rollout).

    Args:
        traj: a recorded trajectory; step: a stochastic step (``traj.sde_mask[step]``).
        cond, uncond: encodings of ``traj.prompts`` (computed when None).
        cfg_scale: guidance of the trained policy (default: the rollout's).
    Returns:
        (log_prob float32 [B] with grad, velocity [B, *latent], mean [B, *latent]).
    Raises:
        ValueError: ``step`` is not a stochastic step of the trajectory, or it was not recorded.
    """
    config = traj.config
    if traj.latents.numel() == 0:
        raise ValueError("the trajectory was sampled with record=False; rerun the rollout with record=True")
    if not bool(traj.sde_mask[step]):
        raise ValueError(f"step {step} is an ODE step of this trajectory; trainable steps: {traj.sde_steps}")
    device = generator.device
    if cond is None:
        cond, uncond = _encode(generator, traj.prompts, config)
    w = config.cfg_scale if cfg_scale is None else cfg_scale
    sig32 = traj.sigmas.to(device=device, dtype=torch.float32)
    x = traj.latents[:, step].to(device)
    sample = traj.latents[:, step + 1].to(device)
    n = x.shape[0]
    v = guided_velocity(generator, x, sig32[step].expand(n), cond, uncond, w, config.micro_batch_size, config.batching)
    sigma_at_one = config.sigma_at_one(traj.sigmas)
    fixed = fixed_latents(generator, cond)
    log_prob, mean, _ = step_log_prob(config.kernel, x, v, sig32[step], sig32[step + 1], sample,
                                      noise_level=config.noise_level, sigma_at_one=sigma_at_one,
                                      keep=None if fixed is None else fixed[1])
    return log_prob, v, mean
