"""History-conditioned sampling with history guidance and sliding windows (DFoT), a mode of the shared sampler.

A model trained with per-frame noise levels (diffusion forcing, :func:`genrl.flow.diffusion_forcing_sigmas`) sees
known frames as frames at sigma 0 and masked ones as frames at sigma 1. :func:`sample_window` generates the frames
after ``h`` known history frames: at every step each *view* of the compiled guidance rule
(:class:`genrl.flow.CompiledGuidance`) shows the model the history at its own noise levels, the views' velocities on
the generated frames are combined into one guided velocity, and one step of the rollout's kernel (Euler ODE or a
Flow-GRPO / DanceGRPO SDE, :func:`genrl.flow.sde.sde_step`) is taken on it, drawing the step's noise once. Combining
the predictions before the step (not the stepped states) is what keeps a stochastic step's variance right
(Song et al. 2025, "History-Guided Video Diffusion", arXiv 2502.06764, Algorithm 1).

:func:`history_rollout` extends a video past the model's window: the first window continues the given history (or
starts from none); every later window keeps the last ``context`` frames as history, marked *generated* so that the
rule's ``stabilization`` applies to them, and generates ``window - context`` new ones.

Reproducibility (docs/architecture.md, Seeds and noise addressing): window w of sample i draws its initial noise from
(seed, i, step 0) and its SDE noise of step k from (seed, i, step k + 1), on stream 0 for the first window and
``WINDOW_STREAM + 2 w`` after it; the history's re-noising at step k draws from stream ``WINDOW_STREAM + 2 w + 1``
(one draw per sample and step, shared by the views, which differ only in the noise level). So the first window
without history and with conditional guidance is exactly :func:`genrl.rollout.sampler.rollout`'s ODE sample, and a
sample's video does not depend on the batch it was drawn in (``batching="fixed"``).

Layouts: :func:`sample_window` works on frames-first latents [B, F, *frame]; a generator whose latents hold the frames
on another axis (Wan's [B, C, F, h, w]: ``generator.frame_dim = 2``) gets its inputs moved to that axis and its
velocity moved back. :func:`history_rollout` takes and returns latents in the generator's own layout. (For such a
generator the noise is drawn frames-first, so its first window is not the same draw as the plain rollout's.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from genrl.flow.history_guidance import CompiledGuidance, HistoryGuidance
from genrl.flow.sde import sde_step
from genrl.models.text_encoder import Conditioning
from genrl.noise import randn_per_sample
from genrl.rollout.sampler import RolloutConfig, guided_velocity, sde_mask

__all__ = ["WINDOW_STREAM", "HistorySample", "history_rollout", "noised_history", "sample_window"]

#: the noise stream base of the windows after the first (window w: ``WINDOW_STREAM + 2 w``, its history re-noising
#: ``WINDOW_STREAM + 2 w + 1``).
WINDOW_STREAM = 1000


@dataclass
class HistorySample:
    """What :func:`history_rollout` returns.

    Attributes:
        video: the given history followed by the generated frames, N frames on the generator's frame axis ([B, N,
            *frame] for genrl's DiT, [B, C, N, h, w] for Wan); the history's values unchanged, bit for bit.
        generated: bool [N], True on generated frames.
        windows: per window, a dict with ``start`` (first frame of the window), ``history`` (its history frames),
            ``new`` (frames it generated and kept) and ``nfe`` (network calls per step).
        network_calls: per-sample network evaluations in all (views x steps, summed over windows).
        log_probs: float32 [B, windows * S] per-step log-probs of the generated frames (mean over their elements;
            0 on ODE steps).
    """

    video: torch.Tensor
    generated: torch.Tensor
    windows: list[dict] = field(default_factory=list)
    network_calls: int = 0
    log_probs: torch.Tensor | None = None

    @property
    def calls_per_frame(self) -> float:
        """Network evaluations per generated frame (the cost of the guidance rule)."""
        n = int(self.generated.sum())
        return self.network_calls / n if n else 0.0


def noised_history(history: torch.Tensor, sigma: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The history as each view sees it: ``(1 - sigma) h + sigma eps`` per frame, and ``h`` itself where sigma is 0.

    Args:
        history: clean history frames [B, h, *frame].
        sigma: per view and history frame, [V, h], in [0, 1] (1 = masked: the frame is pure noise).
        noise: standard normal noise of the history's shape [B, h, *frame].

    Returns:
        [V, B, h, *frame] in the history's dtype; frames at sigma 0 are bitwise the input.
    """
    s = sigma.to(device=history.device, dtype=history.dtype).reshape(sigma.shape[0], 1, sigma.shape[1],
                                                                     *([1] * (history.ndim - 2)))
    mixed = (1 - s) * history.unsqueeze(0) + s * noise.to(history.dtype).unsqueeze(0)
    return torch.where(s == 0, history.unsqueeze(0), mixed)


def _streams(window: int) -> tuple[int, int]:
    if window == 0:
        return 0, WINDOW_STREAM + 1
    return WINDOW_STREAM + 2 * window, WINDOW_STREAM + 2 * window + 1


def sample_window(
    generator,
    history: torch.Tensor,
    num_new: int,
    cond: Conditioning,
    null: Conditioning | None,
    compiled: CompiledGuidance,
    seed: int,
    indices: torch.Tensor,
    config: RolloutConfig,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate ``num_new`` frames after ``history`` under the compiled guidance rule, one combined step per step.

    Args:
        generator: a generator whose ``velocity`` takes a per-frame sigma [B, T] (genrl's DiT; Wan through its
            per-token timesteps); its ``frame_dim`` (default 1) says where its latents hold the frames.
        history: frames-first [B, h, *frame] clean (or given) history latents, h = ``compiled.num_history`` (may be
            0).
        num_new: frames to generate (the model sees h + num_new frames).
        cond: the prompts' conditioning (B rows); null: the null prompt's (B rows), needed when a view drops text.
        compiled: the guidance rule compiled for h history frames.
        seed, indices: address the noise (see the module docstring); window: this window's number.
        config: the rollout's kernel, schedule, micro-batching; its ``cfg_scale`` must be 1 (text CFG is part of
            the rule: ``HistoryGuidance.text_scale`` or ``drop_text_in_uncond``).

    Returns:
        (new frames [B, num_new, *frame] float32, log-probs float32 [B, S]).

    Raises:
        ValueError: the history's frame count differs from the rule's, ``cfg_scale`` != 1, or a view drops the text
            and ``null`` is None.
    """
    b, h = history.shape[0], history.shape[1]
    if h != compiled.num_history:
        raise ValueError(f"the guidance was compiled for {compiled.num_history} history frames, the history has {h}")
    if config.cfg_scale != 1.0:
        raise ValueError(f"history sampling takes text guidance from the rule (HistoryGuidance.text_scale, "
                         f"drop_text_in_uncond), so the rollout's cfg_scale must be 1, got {config.cfg_scale}")
    drops = compiled.drop_text()
    if any(drops) and null is None:
        raise ValueError("a guidance view drops the text but no null conditioning was given")
    device = generator.device
    fd = int(getattr(generator, "frame_dim", 1))
    frame_shape = tuple(history.shape[2:])
    gen_stream, hist_stream = _streams(window)
    sigmas = config.sigmas()
    sig32 = sigmas.to(device=device, dtype=torch.float32)
    sigma_at_one = config.sigma_at_one(sigmas)
    mask = sde_mask(config, seed, window)
    view_sigma = compiled.history_sigmas(device=device, dtype=torch.float32)  # [V, h]
    v_count = compiled.nfe
    conds = Conditioning.cat([null if d else cond for d in drops])
    history = history.to(device=device, dtype=torch.float32)
    x = randn_per_sample((num_new, *frame_shape), seed, indices, step=0, stream=gen_stream, device=device,
                         backend=config.noise_backend)
    log_probs = []
    for k in range(config.num_steps):
        if h:
            eps_h = randn_per_sample((h, *frame_shape), seed, indices, step=k, stream=hist_stream, device=device,
                                     backend=config.noise_backend)
            views = noised_history(history, view_sigma, eps_h)  # [V, B, h, ...]
            frames = torch.cat([views, x.unsqueeze(0).expand(v_count, *x.shape)], dim=2)
        else:
            frames = x.unsqueeze(0).expand(v_count, *x.shape)
        sig_frames = torch.cat([view_sigma[:, None, :].expand(v_count, b, h),
                                sig32[k].expand(v_count, b, num_new)], dim=2)
        inputs = frames.reshape(v_count * b, h + num_new, *frame_shape).movedim(1, fd)  # the generator's layout
        vel = guided_velocity(generator, inputs, sig_frames.reshape(v_count * b, h + num_new), conds, None, 1.0,
                              config.micro_batch_size, config.batching).movedim(fd, 1)
        v = compiled.combine(vel.reshape(v_count, b, h + num_new, *frame_shape)[:, :, h:])
        if mask[k]:
            noise = randn_per_sample((num_new, *frame_shape), seed, indices, step=k + 1, stream=gen_stream,
                                     device=device, backend=config.noise_backend)
            kind = config.kernel
        else:
            noise, kind = None, "ode"
        out = sde_step(kind, x, v, sig32[k], sig32[k + 1], noise, noise_level=config.noise_level,
                       sigma_at_one=sigma_at_one)
        x = out.sample
        log_probs.append(out.log_prob.float().cpu())
    return x, torch.stack(log_probs, dim=1)


def history_rollout(
    generator,
    prompts: list[str],
    frame_shape: Sequence[int],
    num_frames: int,
    seed: int,
    history: torch.Tensor | None = None,
    guidance: HistoryGuidance | None = None,
    config: RolloutConfig | None = None,
    window: int = 8,
    context: int | None = None,
    indices: Sequence[int] | torch.Tensor | None = None,
    progress: bool = False,
) -> HistorySample:
    """Sample ``num_frames`` frames per prompt: continue ``history`` and slide a window of ``window`` frames.

    Args:
        generator: see :func:`sample_window`.
        prompts: B prompts (the same prompt conditions every window).
        frame_shape: one latent frame's shape without the frame axis, e.g. (C, H, W) (Wan: (C, h, w)).
        num_frames: frames of the output, history included (> the history's length).
        seed: run seed; indices: per-sample ids (default 0..B-1); they address all noise.
        history: the known frames in the generator's layout ([B, h0, *frame]; Wan: [B, C, h0, h, w]), or None
            (the first window starts from nothing).
        guidance: the rule (default: conditional).
        config: kernel, steps, shift, micro-batching (``cfg_scale`` must be 1; default: an ODE rollout of 10 steps).
        window: frames the model sees at once (its training length; the shapes DiT: 8).
        context: history frames kept by every later window (default ``window // 2``); 0 < context < window.
        progress: a progress bar over windows.

    Returns:
        :class:`HistorySample`.

    Raises:
        ValueError: ``num_frames`` not above the history's length, the history not shorter than ``window``,
            ``context`` outside (0, window), a history batch different from the prompts'.
    """
    guidance = guidance or HistoryGuidance()
    config = config or RolloutConfig(kernel="ode")
    b = len(prompts)
    fd = int(getattr(generator, "frame_dim", 1))
    if history is not None:
        history = history.movedim(fd, 1)  # frames-first inside
    h0 = 0 if history is None else int(history.shape[1])
    context = window // 2 if context is None else int(context)
    if not 0 < context < window:
        raise ValueError(f"context must be in (0, window={window}), got {context}")
    if h0 >= window:
        raise ValueError(f"the history has {h0} frames; the window of {window} frames needs room for new ones: "
                         f"pass the last {context} frames or a larger window")
    if num_frames <= h0:
        raise ValueError(f"num_frames={num_frames} must exceed the history's {h0} frames")
    if history is not None and history.shape[0] != b:
        raise ValueError(f"the history has {history.shape[0]} samples for {b} prompts")
    idx = torch.arange(b) if indices is None else torch.as_tensor(list(map(int, indices)), dtype=torch.long)
    device = generator.device
    with torch.no_grad():
        cond = generator.encode_prompts(list(prompts))
        null = generator.encode_prompts([config.null_prompt] * b)
        frames = [] if history is None else list(history.to(device=device, dtype=torch.float32).unbind(1))
        generated = [False] * h0
        windows, calls, log_probs = [], 0, []
        w = 0
        bar = None
        if progress:
            from rich.progress import Progress

            bar = Progress(transient=True)
            bar.start()
            task = bar.add_task("history rollout", total=num_frames - h0)
        while len(frames) < num_frames:
            hist_len = h0 if w == 0 else context
            hist = (torch.stack(frames[len(frames) - hist_len:], dim=1) if hist_len
                    else torch.empty(b, 0, *frame_shape, device=device))
            compiled = guidance.compile(hist_len, generated[len(generated) - hist_len:] if hist_len else [])
            new, lp = sample_window(generator, hist, window - hist_len, cond, null, compiled, seed, idx, config, w)
            keep = min(window - hist_len, num_frames - len(frames))
            windows.append({"start": len(frames) - hist_len, "history": hist_len, "new": keep, "nfe": compiled.nfe})
            frames.extend(new[:, :keep].unbind(1))
            generated.extend([True] * keep)
            calls += compiled.nfe * config.num_steps
            log_probs.append(lp)
            if bar is not None:
                bar.advance(task, keep)
            w += 1
        if bar is not None:
            bar.stop()
    video = torch.stack(frames, dim=1)
    if history is not None:
        video[:, :h0] = history.to(device=device, dtype=video.dtype)
    return HistorySample(video=video.movedim(1, fd), generated=torch.tensor(generated), windows=windows,
                         network_calls=calls, log_probs=torch.cat(log_probs, dim=1))
