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
rule's ``stabilization`` applies to them (by default DFoT's level 0.02, sigma 0.0402:
:func:`genrl.flow.dfot_level_to_sigma`), and generates ``window - context`` new ones. Given *keyframes* (known frames
at later positions, e.g. a target every 16 frames) join the history of the window they fall into, at their place in
it (``sample_window``'s ``history_positions``), so that window generates the frames leading up to them.

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
from genrl.models.conditions import null_prompts
from genrl.models.text_encoder import Conditioning
from genrl.noise import randn_per_sample, stream_id
from genrl.rollout.sampler import RolloutConfig, guided_velocity, sde_mask

__all__ = ["WINDOW_STREAM", "HistorySample", "history_rollout", "noised_history", "sample_window"]

#: the noise stream base of the windows after the first (window w: ``WINDOW_STREAM + 2 w``, its history re-noising
#: ``WINDOW_STREAM + 2 w + 1``).
WINDOW_STREAM = stream_id("rollout.history_window")


@dataclass
class HistorySample:
    """What :func:`history_rollout` returns.

    Attributes:
        video: the given history followed by the generated frames, N frames on the generator's frame axis ([B, N,
            *frame] for genrl's DiT, [B, C, N, h, w] for Wan); the history's values unchanged, bit for bit.
        generated: bool [N], True on generated frames.
        windows: per window, a dict with ``start`` (first frame of the window), ``history`` (its history frames
            from before it), ``keyframes`` (given frames inside it), ``new`` (frames it added to the video,
            keyframes included) and ``nfe`` (network calls per step; 0 when every frame was known).
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
        return stream_id("rollout.flat"), WINDOW_STREAM + 1
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
    history_positions: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generate ``num_new`` frames around ``history`` under the compiled guidance rule, one combined step per step.

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
        history_positions: where the known frames sit in the model's h + num_new frames, h distinct increasing
            ints in [0, h + num_new) (None: the first h, a prefix). Known frames after generated ones are
            *keyframes*: the model generates the frames between them (interpolation) or before them. The rule's
            views index the known frames in this order. For genrl's DiT the known and generated frames must fill
            whole temporal patches.

    Returns:
        (new frames [B, num_new, *frame] float32, in frame order at the positions not in ``history_positions``;
        log-probs float32 [B, S]).

    Raises:
        ValueError: the history's frame count differs from the rule's, ``cfg_scale`` != 1, a view drops the text
            and ``null`` is None, or ``history_positions`` is not h distinct increasing ints in [0, h + num_new).
    """
    b, h = history.shape[0], history.shape[1]
    if h != compiled.num_history:
        raise ValueError(f"the guidance was compiled for {compiled.num_history} history frames, the history has {h}")
    total = h + num_new
    known = list(range(h)) if history_positions is None else [int(p) for p in history_positions]
    if len(known) != h or any(not 0 <= p < total for p in known) or any(a >= c for a, c in zip(known, known[1:])):
        raise ValueError(f"history_positions must be {h} distinct increasing frame positions in [0, {total}) "
                         f"(one per history frame), got {list(history_positions or [])}")
    device = generator.device
    known_idx = torch.tensor(known, dtype=torch.long, device=device)
    gen_idx = torch.tensor(sorted(set(range(total)) - set(known)), dtype=torch.long, device=device)
    if config.cfg_scale != 1.0:
        raise ValueError(f"history sampling takes text guidance from the rule (HistoryGuidance.text_scale, "
                         f"drop_text_in_uncond), so the rollout's cfg_scale must be 1, got {config.cfg_scale}")
    drops = compiled.drop_text()
    if any(drops) and null is None:
        raise ValueError("a guidance view drops the text but no null conditioning was given")
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
        frames = x.new_empty(v_count, b, total, *frame_shape)
        sig_frames = view_sigma.new_empty(v_count, b, total)
        if h:
            eps_h = randn_per_sample((h, *frame_shape), seed, indices, step=k, stream=hist_stream, device=device,
                                     backend=config.noise_backend)
            frames[:, :, known_idx] = noised_history(history, view_sigma, eps_h)  # [V, B, h, ...]
            sig_frames[:, :, known_idx] = view_sigma[:, None, :].expand(v_count, b, h)
        frames[:, :, gen_idx] = x.unsqueeze(0).expand(v_count, *x.shape)
        sig_frames[:, :, gen_idx] = sig32[k]
        inputs = frames.reshape(v_count * b, total, *frame_shape).movedim(1, fd)  # the generator's layout
        vel = guided_velocity(generator, inputs, sig_frames.reshape(v_count * b, total), conds, None, 1.0,
                              config.micro_batch_size, config.batching).movedim(fd, 1)
        v = compiled.combine(vel.reshape(v_count, b, total, *frame_shape)[:, :, gen_idx])
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


def _keyframes_at(keyframes, positions, fd: int, b: int, h0: int, num_frames: int) -> dict[int, torch.Tensor]:
    """{output frame index: frames-first keyframe [B, *frame]} from :func:`history_rollout`'s arguments, checked."""
    if keyframes is None:
        if positions:
            raise ValueError(f"keyframe_positions {list(positions)} given without keyframes")
        return {}
    if positions is None:
        raise ValueError("keyframes need keyframe_positions: the output frame index of each keyframe")
    pos = [int(p) for p in positions]
    keyframes = keyframes.movedim(fd, 1)
    if keyframes.shape[0] != b:
        raise ValueError(f"the keyframes have {keyframes.shape[0]} samples for {b} prompts")
    if len(pos) != keyframes.shape[1]:
        raise ValueError(f"{keyframes.shape[1]} keyframes and {len(pos)} keyframe_positions {pos}: give one "
                         f"position per keyframe")
    bad = [p for p in pos if not h0 <= p < num_frames]
    if bad or len(set(pos)) != len(pos):
        raise ValueError(f"keyframe_positions must be distinct frame indices in [{h0}, {num_frames}) (after the "
                         f"{h0} history frames, inside the output), got {pos}")
    return dict(zip(pos, keyframes.unbind(1), strict=True))


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
    keyframes: torch.Tensor | None = None,
    keyframe_positions: Sequence[int] | None = None,
) -> HistorySample:
    """Sample ``num_frames`` frames per prompt: continue ``history`` and slide a window of ``window`` frames.

    With ``keyframes``, known frames at given positions of the output (e.g. a target frame every 16) join the
    history of the window they fall into: that window generates the frames before and between them (interpolating
    towards the keyframe) and the keyframes enter the video unchanged. A later window's history is its last
    ``context`` frames, keyframes among them counted as real (no stabilization).

    Args:
        generator: see :func:`sample_window`.
        prompts: B prompts (the same prompt conditions every window).
        frame_shape: one latent frame's shape without the frame axis, e.g. (C, H, W) (Wan: (C, h, w)).
        num_frames: frames of the output, history included (> the history's length).
        seed: run seed; indices: per-sample ids (default 0..B-1); they address all noise.
        history: the known frames in the generator's layout ([B, h0, *frame]; Wan: [B, C, h0, h, w]), or None
            (the first window starts from nothing).
        guidance: the rule (default ``HistoryGuidance()``: conditional, generated history seen at DFoT's
            stabilization level 0.02, sigma 0.0402 at equal SNR; before issue 48 the default showed it clean: pass
            ``HistoryGuidance(stabilization=0.0)`` for that). Its noise levels may be in DFoT's units
            (``HistoryGuidance(units="dfot")``); the sampler sees sigmas only.
        config: kernel, steps, shift, micro-batching (``cfg_scale`` must be 1; default: an ODE rollout of 10 steps).
        window: frames the model sees at once (its training length; the shapes DiT: 8).
        context: history frames kept by every later window (default ``window // 2``); 0 < context < window.
        progress: a progress bar over windows.
        keyframes: known frames in the generator's layout ([B, K, *frame]; Wan: [B, C, K, h, w]), or None.
        keyframe_positions: their K frame indices in the output, distinct, in [h0, num_frames) with h0 the
            history's length (required with ``keyframes``). For genrl's DiT each window's known frames must fill
            whole temporal patches: with an even history, context and window, give keyframes in aligned pairs
            (frames 2j and 2j + 1).

    Returns:
        :class:`HistorySample` (keyframes bitwise in ``video``, False in ``generated``).

    Raises:
        ValueError: ``num_frames`` not above the history's length, the history not shorter than ``window``,
            ``context`` outside (0, window), a history or keyframe batch different from the prompts', keyframe
            positions missing, repeated or outside [h0, num_frames), or their count not the keyframes'.
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
    keys = _keyframes_at(keyframes, keyframe_positions, fd, b, h0, num_frames)
    idx = torch.arange(b) if indices is None else torch.as_tensor(list(map(int, indices)), dtype=torch.long)
    device = generator.device
    keys = {p: f.to(device=device, dtype=torch.float32) for p, f in keys.items()}
    with torch.no_grad():
        cond = generator.encode_prompts(list(prompts))
        null = generator.encode_prompts(null_prompts(list(prompts), config.null_prompt))
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
            start = len(frames) - hist_len
            inside = [p - start for p in sorted(keys) if len(frames) <= p < start + window]  # window offsets
            known = list(range(hist_len)) + inside
            hist = [*frames[start:], *(keys[start + o] for o in inside)]
            hist = torch.stack(hist, dim=1) if hist else torch.empty(b, 0, *frame_shape, device=device)
            compiled = guidance.compile(len(known), generated[start:] + [False] * len(inside))
            num_new = window - len(known)
            if num_new:
                new, lp = sample_window(generator, hist, num_new, cond, null, compiled, seed, idx, config, w,
                                        history_positions=known)
                calls += compiled.nfe * config.num_steps
            else:  # every frame of the window is known
                new, lp = hist[:, :0], torch.zeros(b, config.num_steps)
            fresh = iter(new.unbind(1))
            keep = min(window - hist_len, num_frames - len(frames))
            for o in range(hist_len, hist_len + keep):
                frames.append(keys[start + o] if o in inside else next(fresh))
                generated.append(o not in inside)
            windows.append({"start": start, "history": hist_len, "keyframes": len(inside), "new": keep,
                            "nfe": compiled.nfe if num_new else 0})
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
