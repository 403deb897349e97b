"""Exact temporal rewards for multi-step captions of the shapes world: does a video follow its steps, in order, and
switch on time? (TempAct's executor reward on the shapes world; docs/methods/tempact.md.)

A multi-step caption ("a red circle moves right, then moves up, then moves left") commands one direction per step;
a plan gives each step a span of frames. A causal student conditions each span of chunks on the step's prompt, so a
good video moves in step k's direction over step k's frames and turns as soon as the prompt switches.

Units. Frames are pixel frames (for the shapes DiT a latent frame is a pixel frame). A *step span* is
``(start, end)`` in frames, end exclusive; the spans of a sample are contiguous and cover ``[0, T)``. A *chunk* is
``chunk_size`` frames (2 for the shapes student); chunks are counted from each step boundary, not from frame 0, so
the spans need not be chunk-aligned.

Measurement. :meth:`genrl.rewards.ShapesVerifier.measure` gives the object's centroid track (unwrapped on a
``"wrap"`` world). A *displacement* ``t`` (``1 <= t < T``) is ``track[t] - track[t - 1]`` in px/frame; it is
*measured* when both frames show the object (the verifier's ``nonempty``), and its *measured direction* is the
direction class of the nearest prototype velocity of the verifier (every configured speed and their mean times the
direction's unit vector; ``"still"`` is the zero velocity): the argmax of the verifier's direction probabilities.
An unmeasured displacement has no direction and never counts as following. Step ``k`` with span ``(s, e)`` owns the
displacements ``t = max(s, 1) .. e - 1`` (from the frame before its start, when there is one, to its last frame),
so every displacement belongs to exactly one step. The *dominant direction* of a set of displacements is the
direction measured on strictly more of them than any other direction (none on a tie or when none is measured).

Metrics (float32 ``[B]`` unless stated; all in [0, 1] except ``switch_delay``):

=========================  ===========================================================================================
``step_following``         mean over steps of the fraction of the step's displacements whose measured direction is
                           the commanded one
``first_chunk_following``  the same over the first chunk after each boundary only (the displacements ``t = s ..
                           min(s + chunk_size, e) - 1`` of a step starting at ``s > 0``, the first one from the last
                           frame before the switch), averaged over boundaries. A one-step plan has no boundary: it
                           is that step's ``step_following`` (so the key is never NaN)
``switch_delay``           chunks, mean over boundaries: the index of the first chunk after the boundary (0 = the
                           first) whose dominant direction is the new step's; a step that never reacts counts its
                           number of chunks ``ceil((e - s) / chunk_size)`` (a miss). 0 for a one-step plan
``order_correct``          1.0 when every step's dominant direction over its whole span is its commanded one, else 0.0
``consistency``            the verifier's ``consistency``: stability of the foreground area and color over all frames,
                           ``exp(-(r_mass^2 + r_color^2) / (2 * 0.2^2))``; 0 without foreground
``per_step_following``     ``[B, S_max]``: each step's fraction, NaN-padded past a sample's last step
=========================  ===========================================================================================

A rendered multi-step video of the world scores 1 / 1 / 0 / 1 at the world's own split
(:func:`genrl.data.shapes.segment_spans`) whenever its turns fall on frames: three segments always, two segments for
odd T. At even T (the default 8 frames) the two-step world turns half a frame after frame ``T/2 - 1``
(:func:`genrl.data.shapes.turn_points`, kept for compatibility), so the displacement across the turn is half of each
direction and its measured class is ambiguous.

:class:`ShapesTemporalReward` (registered as ``"shapes_temporal"``) is the reward-protocol wrapper: global captions
in, step spans from ``meta["frame_spans"]`` or the world's split.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from genrl.data.shapes import MAX_SEGMENTS, ShapesWorldConfig, parse_caption, segment_spans
from genrl.rewards.base import RANGE_TOLERANCE, RewardModel
from genrl.rewards.registry import register_reward
from genrl.rewards.shapes import _CONSISTENCY_SIGMA, ShapesVerifier

__all__ = ["temporal_metrics", "ShapesTemporalReward", "METRIC_KEYS"]

#: The per-sample ``[B]`` keys of :func:`temporal_metrics` (``per_step_following`` is ``[B, S_max]``).
METRIC_KEYS = ("step_following", "first_chunk_following", "switch_delay", "order_correct", "consistency")


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"temporal_metrics: {name} must be an int >= {low}, got {value!r}")
    return value


def _check_plan(directions: Sequence, frame_spans: Sequence, b: int, t: int, known: list[str]) -> list[list[int]]:
    """Validate the per-sample steps; returns each sample's commanded direction indices into ``known``."""
    for name, value in (("directions", directions), ("frame_spans", frame_spans)):
        if isinstance(value, (str, Tensor)) or not isinstance(value, Sequence) or len(value) != b:
            got = len(value) if isinstance(value, Sequence) and not isinstance(value, str) else type(value).__name__
            raise ValueError(f"temporal_metrics: {name} must be a list with one entry per sample (B={b}), got {got}")
    out = []
    for i, (dirs, spans) in enumerate(zip(directions, frame_spans)):
        if isinstance(dirs, str) or not isinstance(dirs, Sequence) or not dirs:
            raise ValueError(f"temporal_metrics: directions[{i}] must be a non-empty list of direction names, got "
                             f"{dirs!r}")
        idx = []
        for d in dirs:
            name = "still" if d is None else d
            if name not in known:
                raise ValueError(f"temporal_metrics: unknown direction {d!r} in directions[{i}]={list(dirs)}; the "
                                 f"verifier's world knows {', '.join(known)}")
            idx.append(known.index(name))
        try:
            pairs = [(int(s), int(e)) for s, e in spans]
        except (TypeError, ValueError):
            raise ValueError(f"temporal_metrics: frame_spans[{i}] must be a list of (start, end) frame pairs, got "
                             f"{spans!r}") from None
        if len(pairs) != len(idx):
            raise ValueError(f"temporal_metrics: sample {i} has {len(idx)} directions {list(dirs)} but "
                             f"{len(pairs)} frame spans {pairs}; give one (start, end) span per step")
        ends = [0] + [e for _, e in pairs]
        if any(s != prev for (s, _), prev in zip(pairs, ends)) or pairs[-1][1] != t or any(e <= s for s, e in pairs):
            raise ValueError(f"temporal_metrics: frame_spans[{i}]={pairs} must be non-empty contiguous (start, end) "
                             f"frame spans (end exclusive) covering [0, {t}) of the T={t} frames of the video")
        if pairs[0][1] < 2:
            raise ValueError(f"temporal_metrics: frame_spans[{i}]={pairs}: the first step needs at least two frames "
                             f"(one displacement) to have a measured direction")
        out.append(idx)
    return out


def temporal_metrics(
    verifier: ShapesVerifier,
    pixels: Tensor,
    directions: Sequence[Sequence[str | None]],
    frame_spans: Sequence[Sequence[tuple[int, int]]],
    chunk_size: int,
) -> dict[str, Tensor]:
    """Exact step-following metrics of videos against their commanded steps (see the module docstring).

    Args:
        verifier: a :class:`~genrl.rewards.ShapesVerifier` of the videos' world (its resolution, object size,
            speeds, directions and boundary).
        pixels: float ``[B, T, 3, H, W]`` in [0, 1] (the verifier's range), ``T >= 2``, ``H x W`` the verifier's
            world's. Non-finite values are read as 0 (the object's color is lost there), like the verifier does.
        directions: per sample, the commanded direction name of each step (``["right", "up"]``), each a direction
            of the verifier's world; ``None`` means ``"still"`` (which the world must then have).
        frame_spans: per sample, the ``(start, end)`` frames of each step (end exclusive): as many spans as
            directions, contiguous, non-empty, covering ``[0, T)``; the first holds at least two frames.
        chunk_size: frames per chunk of the executor (>= 1), the unit of ``first_chunk_following`` and
            ``switch_delay``.

    Returns:
        float32 tensors on the verifier's device: ``step_following``, ``first_chunk_following``, ``switch_delay``
        (in chunks), ``order_correct``, ``consistency`` of shape ``[B]`` and ``per_step_following``
        ``[B, max steps]`` (NaN past a sample's last step).

    Raises:
        ValueError: ``pixels`` not a float tensor ``[B, T, 3, H, W]`` with ``T >= 2``, frames whose size differs
            from the verifier's world, finite values outside [0, 1] (beyond the protocol's tolerance; the message
            gives the range), ``directions`` / ``frame_spans`` not one entry per sample, an unknown direction, a
            sample whose step count differs between the two, spans that are empty, not contiguous or do not cover
            the T frames, a first span of a single frame, or ``chunk_size`` not an int >= 1. Each message names
            the value.
    """
    if not isinstance(pixels, Tensor) or pixels.ndim != 5 or pixels.shape[2] != 3 or not pixels.is_floating_point():
        got = (tuple(pixels.shape), pixels.dtype) if isinstance(pixels, Tensor) else type(pixels).__name__
        raise ValueError(f"temporal_metrics: pixels must be a float tensor [B, T, 3, H, W] in [0, 1], got {got}")
    b, t, _, h, wd = pixels.shape
    world = verifier.world
    if (h, wd) != (world.height, world.width):
        raise ValueError(f"temporal_metrics: the verifier is calibrated for {world.height}x{world.width} (HxW) frames, "
                         f"got {h}x{wd} (pixels shape {tuple(pixels.shape)})")
    if t < 2:
        raise ValueError(f"temporal_metrics: steps need motion, so T >= 2 frames; got T={t}")
    c = _check_int("chunk_size", chunk_size, 1)
    cmd = _check_plan(directions, frame_spans, b, t, list(verifier.direction_names))
    spans = [[(int(s), int(e)) for s, e in sp] for sp in frame_spans]
    x = pixels.detach()
    finite = torch.isfinite(x)
    if bool(finite.any()):
        lo, hi = float(x[finite].min()), float(x[finite].max())
        if lo < -RANGE_TOLERANCE or hi > 1 + RANGE_TOLERANCE:
            raise ValueError(f"temporal_metrics: pixel values must be in [0, 1], got min {lo:.4g}, max {hi:.4g}")
    dev = verifier.direction_protos.device
    x = torch.nan_to_num(x.float(), nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1).to(dev)

    m = verifier.measure(x)
    track, nonempty = m["track"], m["nonempty"]
    disp = track[:, 1:] - track[:, :-1]  # [B, T-1, 2]: displacement t is index t - 1
    measured = nonempty[:, 1:] & nonempty[:, :-1]
    d2 = ((disp[:, :, None, None, :] - verifier.direction_protos) ** 2).sum(-1).amin(-1)  # [B, T-1, Kd]
    cls = torch.where(measured, d2.argmin(-1), torch.full_like(measured, -1, dtype=torch.long))  # -1: unmeasured
    kd = len(verifier.direction_names)
    cls_cpu = cls.cpu()

    def count(i: int, lo: int, hi: int) -> Tensor:
        """Measured-direction counts [Kd] over displacements t = lo .. hi - 1 of sample i."""
        seg = cls_cpu[i, lo - 1 : hi - 1]
        return torch.bincount(seg[seg >= 0], minlength=kd).float()

    def dominant_is(counts: Tensor, k: int) -> bool:
        others = torch.cat([counts[:k], counts[k + 1 :]])
        return bool(counts[k] > 0) and bool((counts[k] > others).all())

    s_max = max(len(sp) for sp in spans)
    per_step = torch.full((b, s_max), float("nan"))
    first_chunk, delay, order = torch.zeros(b), torch.zeros(b), torch.zeros(b)
    for i in range(b):
        ok, firsts, delays = True, [], []
        for k, ((s, e), want) in enumerate(zip(spans[i], cmd[i])):
            lo = max(s, 1)
            counts = count(i, lo, e)
            per_step[i, k] = counts[want] / (e - lo)
            ok &= dominant_is(counts, want)
            if k == 0:
                continue
            firsts.append(float(count(i, s, min(s + c, e))[want]) / (min(s + c, e) - s))
            n_chunks = -(-(e - s) // c)
            react = next((j for j in range(n_chunks) if dominant_is(count(i, s + j * c, min(s + (j + 1) * c, e)),
                                                                    want)), n_chunks)
            delays.append(float(react))
        step = per_step[i, : len(spans[i])]
        first_chunk[i] = sum(firsts) / len(firsts) if firsts else float(step.mean())
        delay[i] = sum(delays) / len(delays) if delays else 0.0
        order[i] = float(ok)

    mass = m["mass"]
    r_mass = mass.std(1, unbiased=False) / mass.mean(1).clamp(min=1e-8)
    dev_c = ((m["frame_chroma"] - m["chroma"][:, None]) ** 2).sum(-1)
    r_color = ((dev_c * nonempty).sum(1) / nonempty.sum(1).clamp(min=1)).sqrt()
    consistency = torch.exp(-(r_mass**2 + r_color**2) / (2 * _CONSISTENCY_SIGMA**2)) * nonempty.any(1)

    return {
        "step_following": per_step.nanmean(1).to(dev),
        "first_chunk_following": first_chunk.to(dev),
        "switch_delay": delay.to(dev),
        "order_correct": order.to(dev),
        "consistency": consistency.float(),
        "per_step_following": per_step.to(dev),
    }


@register_reward("shapes_temporal")
class ShapesTemporalReward(RewardModel):
    """Temporal reward of multi-step shapes captions: :func:`temporal_metrics` under the reward protocol.

    ``reward(pixels [B, T, 3, H, W] in [0, 1], prompts, frame_spans=...)`` takes the *global* captions as prompts
    ("a red circle moves right, then moves up, then moves left"); each caption's directions (one per segment,
    :func:`~genrl.data.shapes.parse_caption`) are the commanded steps. ``meta["frame_spans"]`` (optional) gives per
    sample the ``(start, end)`` frames of each step (end exclusive, contiguous, covering the T frames; e.g. a plan's
    chunk spans times ``chunk_size``); without it every sample uses the world's own split of its T frames into as
    many segments as its caption has (:func:`~genrl.data.shapes.segment_spans`, the renderer's split), so the
    reward also works as a plain video reward. A single-step or still caption is a one-step plan.

    Output keys (float32 ``[B]``, plus the protocol's bool ``"valid"``):

    ==========================  ===================================================================================
    ``reward``                  ``step_weight * step_following + order_weight * order_correct + consistency_weight
                                * consistency + first_chunk_weight * first_chunk_following - delay_weight *
                                switch_delay``; with the defaults in [-0.1 * max chunks per step, 1], 1 for a
                                video that follows every step from the first chunk on
    ``step_following``,         as :func:`temporal_metrics` (``switch_delay`` in chunks)
    ``first_chunk_following``,
    ``switch_delay``,
    ``order_correct``,
    ``consistency``
    ``step1_following`` ..      each step's following fraction (``per_step_following``), NaN past the sample's
    ``step3_following``         last step
    ==========================  ===================================================================================

    A sample is **invalid** (``valid`` False and NaN in every key; never an exception, so a training step goes on)
    when its caption does not parse for the world, or when its ``frame_spans`` entry has a different number of steps
    than its caption has segments or does not cover its frames (a plan that does not fit the caption).

    Args:
        world: the shapes world (a :class:`~genrl.data.shapes.ShapesWorldConfig`, a dict of its fields or None for
            the default). Its vocabulary, resolution and speeds calibrate the verifier; captions of up to three
            segments parse whatever its ``max_segments`` (that field only steers sampling).
        chunk_size: frames per executor chunk (>= 1; 2 for the shapes student).
        step_weight, order_weight, consistency_weight, first_chunk_weight, delay_weight: the weights of the
            ``reward`` sum above (finite; defaults 0.5, 0.3, 0.2, 0.0 and 0.1 per chunk of delay).
        scale, shift: affine on ``"reward"``.

    Raises:
        ValueError: (construction) ``chunk_size`` not an int >= 1, a non-finite weight, a bad world; (call) the
            protocol's input checks, frames whose size differs from the world's, ``T < 2``, ``frame_spans`` not a
            list with one entry per sample.
    """

    differentiable = False
    dimensions = ("reward", *METRIC_KEYS, *(f"step{k + 1}_following" for k in range(MAX_SEGMENTS)))
    higher_is_better = True
    channels = (3,)

    def __init__(
        self,
        world: ShapesWorldConfig | dict[str, Any] | None = None,
        chunk_size: int = 2,
        step_weight: float = 0.5,
        order_weight: float = 0.3,
        consistency_weight: float = 0.2,
        first_chunk_weight: float = 0.0,
        delay_weight: float = 0.1,
        scale: float = 1.0,
        shift: float = 0.0,
    ) -> None:
        super().__init__(scale=scale, shift=shift)
        self.chunk_size = _check_int("chunk_size", chunk_size, 1)
        self.weights = {"step_following": float(step_weight), "order_correct": float(order_weight),
                        "consistency": float(consistency_weight), "first_chunk_following": float(first_chunk_weight),
                        "switch_delay": -float(delay_weight)}
        for key, value in self.weights.items():
            if not math.isfinite(value):
                raise ValueError(f"{self._label()}: the weight of {key} must be finite, got {value}")
        self.verifier = ShapesVerifier(world)

    @property
    def world(self) -> ShapesWorldConfig:
        return self.verifier.world

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        w = self.world
        b, t, _, h, wd = pixels.shape
        if (h, wd) != (w.height, w.width):
            raise ValueError(f"{self._label()} is calibrated for {w.height}x{w.width} (HxW) frames, got {h}x{wd}; "
                             f"build it with world={{height: {h}, width: {wd}}}")
        if t < 2:
            raise ValueError(f"{self._label()}: steps need motion, so T >= 2 frames; got pixels shape "
                             f"{tuple(pixels.shape)}")
        given = meta.get("frame_spans")
        if given is not None and (isinstance(given, (str, Tensor)) or not isinstance(given, Sequence)
                                  or len(given) != b):
            raise ValueError(f"{self._label()}: meta['frame_spans'] must be a list with one list of (start, end) "
                             f"frame spans per sample (B={b}), got {type(given).__name__}"
                             f"{f' of length {len(given)}' if isinstance(given, Sequence) else ''}")
        dirs: list[list[str]] = []
        spans: list[list[tuple[int, int]]] = []
        keep: list[int] = []
        errors: list[str] = []
        for i, text in enumerate(prompts):
            try:
                spec = parse_caption(text, w)
                d = list(spec.directions) or ["still"]
                sp = [tuple(s) for s in given[i]] if given is not None else segment_spans(t, len(d))
                _check_plan([d], [sp], 1, t, list(self.verifier.direction_names))
            except (ValueError, TypeError) as err:
                errors.append(f"sample {i}: {err}")
                continue
            dirs.append(d)
            spans.append(sp)
            keep.append(i)
        if errors:
            more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
            warnings.warn(f"{self._label()}: {len(errors)} of {b} samples are invalid (NaN): {'; '.join(errors[:3])}"
                          f"{more}", stacklevel=2)
        dev = self.verifier.palette.device
        out = {k: torch.full((b,), float("nan"), device=dev) for k in self.dimensions}
        valid = torch.zeros(b, dtype=torch.bool, device=dev)
        if keep:
            finite = torch.isfinite(pixels[keep])
            x = torch.where(finite, pixels[keep], torch.zeros_like(pixels[keep])).clamp(0, 1)
            metrics = temporal_metrics(self.verifier, x, dirs, spans, self.chunk_size)
            idx = torch.tensor(keep, device=dev)
            total = sum(wgt * metrics[k] for k, wgt in self.weights.items())
            out["reward"][idx] = total
            for k in METRIC_KEYS:
                out[k][idx] = metrics[k]
            steps = metrics["per_step_following"]
            for k in range(steps.shape[1]):
                out[f"step{k + 1}_following"][idx] = steps[:, k]
            valid[idx] = True
        out["valid"] = valid
        return out

    def extra_repr(self) -> str:
        weights = ", ".join(f"{k}={v:g}" for k, v in self.weights.items())
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}, weights=({weights}), world={asdict(self.world)}"
