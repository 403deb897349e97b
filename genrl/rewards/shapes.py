"""Exact verifier rewards for the shapes world: they play GenEval's / VBench's role (docs/architecture.md,
The shapes world).

:class:`ShapesVerifier` reads only pixels (never the hidden :class:`~genrl.data.shapes.ShapeSpec`) and checks
them against the caption. Per frame it computes foreground weights from intensity,

    v = max over RGB,   w = relu(v - median_frame(v) - 0.1)

(the per-frame median removes a uniform background or noise floor; the 0.1 margin ignores low-level noise),
then twice restricts ``w`` to a window of half-side ``object_size / 2 + 1.5`` px around its weighted
centroid (so stray blobs and noise far from the object do not move it). From the windowed weights:

* **color**: chroma ``sum(w * rgb) / sum(w * v)`` (the color scaled to max channel 1, invariant to
  brightness and anti-aliasing), compared with the palette colors scaled the same way;
* **shape**: two brightness- and position-invariant moment features: the diagonal anisotropy
  ``(E[u^4] + E[v^4]) / (E[x^4] + E[y^4])`` with ``u, v = (x +- y) / sqrt 2`` (square about 1.3, circle
  1.0, diamond 0.78) and the vertical skewness ``E[y^3] / E[y^2]^1.5`` (an upward triangle is about -0.53),
  compared with prototypes obtained by rendering the configured world at construction (so they
  self-calibrate to resolution and object size), in units of the spread between prototypes;
* **direction**: least-squares velocity (px/frame) of the centroid track over non-empty frames, compared
  with the prototype velocities ``speed * unit(direction)`` for every configured speed and their mean
  (still = 0). Multi-step captions: one velocity per segment, over the frames between the world's turn points
  (``genrl.data.shapes.turn_points``; two segments: ``t <= (T-1)/2`` and ``t >= (T-1)/2``);
* **speed**: the norm of that velocity against the configured speeds;
* **step_following** (multi-step): the product of the segments' ``P(segment k correct)``;
* **consistency**: ``exp(-(r_mass^2 + r_color^2) / (2 * 0.2^2))`` with ``r_mass`` the relative std of the
  per-frame foreground mass over all frames and ``r_color`` the RMS deviation of per-frame chroma.

**Wrapping worlds** (``boundary="wrap"``, a torus frame): an object crossing an edge is split between opposite
edges, so the centroid is a **circular mean** per axis (the mass-weighted mean of the angles ``2 pi x / W``, through
``atan2``, back to pixels in ``[0, W)``); the window and the shape moments use offsets from the centroid taken to
their nearest periodic image; and the centroid track is **unwrapped** before the least-squares velocity (the
differences between successive non-empty frames brought into ``[-W/2, W/2)``, then summed), so motion is read
correctly across the edge while it stays under half a frame per frame. Shape prototypes are calibrated on renders of
the same (wrapping) world. On the default ``"inside"`` world none of this applies and the computation is the plain
one above.

Long videos (history-guided rollouts many times a model's window) are scored window by window with
:func:`score_windows`.

Each attribute score is the soft probability of the caption's class: ``softmax_k(-d_k^2 / tau)`` over the
configured classes, ``d_k`` the distance to class k's prototype(s). ``tau = D^2 / ln((K - 1) / 0.01)`` with
D the smallest distance between two classes' prototypes, so a sample exactly at its prototype scores
0.99; for shape, tau is additionally lowered until every calibration render scores >= 0.97.
Averaged over a uniformly random stated class every soft score is exactly 1/K (the probabilities sum to
one), which is why mismatched captions score at chance.

Output keys (float32 [B]; plus the protocol's bool ``"valid"``):

==================  ==========================================================================================
``reward``          mean of the applicable soft scores below except ``all_correct`` (the scalar for RL)
``color``           P(stated color)
``shape``           P(stated shape)
``direction``       P(stated direction); multi-step: mean over the segments. NaN when no motion is stated
``speed``           P(stated speed). NaN when the caption states no speed (still, multi-step, image mode)
``step_following``  P(every segment correct). NaN for single-step and image captions
``consistency``     temporal stability of area and color in [0, 1]. NaN for single frames (T = 1)
``all_correct``     1.0 when the argmax class equals the stated class for every stated attribute, else 0.0
``<attr>_correct``  hard per-attribute accuracy (argmax == stated class) for color, shape, direction (both
                    segments for multi-step) and speed; NaN where the caption does not state the attribute
==================  ==========================================================================================

NaN in an attribute key means "not stated / not applicable", not a failure; ``valid`` is False only for
failures (non-finite pixels). A video without foreground (empty or black frames) is a bad sample, not a
failure: every applicable score is 0 and it stays valid. Segments with fewer than two non-empty frames
score 0 on motion.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from genrl.data.shapes import (
    DIRECTION_VECTORS,
    PALETTE,
    ShapeSpec,
    ShapesWorldConfig,
    parse_caption,
    render,
    sample_seed,
    turn_points,
    wrapped_delta,
)
from genrl.rewards.base import RewardModel
from genrl.rewards.registry import register_reward

__all__ = ["ShapesVerifier", "ShapesVideoReward", "score_windows", "track_velocity", "REWARD_ATTRIBUTES"]

#: The soft scores the verifier's ``"reward"`` averages (``ShapesVerifier(attributes=...)`` picks a subset).
REWARD_ATTRIBUTES: tuple[str, ...] = ("color", "shape", "direction", "speed", "step_following", "consistency")

_THRESHOLD = 0.1  # foreground margin above the per-frame median intensity
_EMPTY_FRACTION = 0.2  # a frame is empty below this fraction of the smallest calibrated object mass
_CONSISTENCY_SIGMA = 0.2
_FEATURE_FLOOR = 0.1  # minimum feature scale (features are dimensionless, O(1))


def _softmax_neg(d2: Tensor, tau: float) -> Tensor:
    return torch.softmax(-d2 / tau, dim=-1)


def _circular_mean(profile: Tensor, coords: Tensor, period: float) -> Tensor:
    """Circular mean [...] of positions ``coords`` [N] (pixels) weighted by ``profile`` [..., N], in ``[0, period)``.

    The weights' mean direction of the angles ``2 pi coords / period`` (``atan2`` of their weighted sine and cosine
    sums), converted back to pixels. Where both sums are 0 (no weight) the result is 0 with finite gradients.
    """
    angle = coords * (2 * math.pi / period)
    s = (profile * torch.sin(angle)).sum(-1)
    c = (profile * torch.cos(angle)).sum(-1)
    empty = (s == 0) & (c == 0)
    mean = torch.atan2(s, torch.where(empty, torch.ones_like(c), c))
    return torch.remainder(mean * (period / (2 * math.pi)), period)


def _unwrap(track: Tensor, mask: Tensor, period: Tensor) -> Tensor:
    """Unwrap a track [B, T, 2] of positions modulo ``period`` [2] (x, y) over the frames where ``mask`` [B, T].

    Frames outside the mask take the position of the last frame inside it (or their own, before the first), then the
    successive differences are brought into ``[-period/2, period/2)`` and summed from frame 0. On the masked frames
    the result equals ``track`` modulo ``period`` and moves by less than half a period between consecutive ones.
    """
    t = torch.arange(track.shape[1], device=track.device)
    last = torch.where(mask, t, torch.zeros_like(t)).cummax(dim=1).values  # [B, T]
    filled = track.gather(1, last[..., None].expand(-1, -1, track.shape[-1]))
    steps = wrapped_delta(filled[:, 1:] - filled[:, :-1], period)
    return torch.cat([filled[:, :1], filled[:, :1] + steps.cumsum(1)], dim=1)


def _tau(dmin: float, k: int, eps: float) -> float:
    """Temperature giving probability 1 - eps at a prototype whose nearest rival is ``dmin`` away."""
    if k < 2 or dmin <= 0:
        return 1.0
    return dmin * dmin / math.log((k - 1) / eps)


def track_velocity(centroid: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Least-squares velocity of centroid tracks: the slope of a line fitted to ``centroid`` [B, T, 2] (pixels) over
    the frames where ``mask`` [B, T] (bool) holds, in pixels per frame.

    Returns:
        (velocity [B, 2] in the centroids' dtype, ok [B] bool: the masked frames span a time variance > 1e-6, i.e. at
        least two distinct frames; velocity is 0 where there is no masked frame).
    """
    t = torch.arange(centroid.shape[1], dtype=centroid.dtype, device=centroid.device)
    wt = mask.to(centroid.dtype)
    n = wt.sum(1).clamp(min=1e-8)
    tm = (wt * t).sum(1) / n
    cm = (wt[..., None] * centroid).sum(1) / n[:, None]
    dt = (t - tm[:, None]) * wt
    var = (dt * (t - tm[:, None])).sum(1)
    vel = (dt[..., None] * (centroid - cm[:, None])).sum(1) / var.clamp(min=1e-8)[:, None]
    return vel, var > 1e-6


@register_reward("shapes")
class ShapesVerifier(RewardModel):
    """Verifier of captions of the shapes world, from pixels only (see the module docstring for the method
    and the output keys).

    Args:
        world: the world the videos come from (a :class:`~genrl.data.shapes.ShapesWorldConfig`, a dict of
            its fields, or None for the default). Its vocabulary defines the classes; its resolution and
            object size the calibration; its ``boundary`` whether positions wrap around the frame (a
            ``"wrap"`` world: circular centroids and unwrapped tracks, see the module docstring).
        scale, shift: affine on ``"reward"``.
        calibration_samples: renders per shape used to build the shape prototypes (deterministic).
        attributes: the soft scores ``"reward"`` averages (of those that apply to each caption), a subset of
            :data:`REWARD_ATTRIBUTES`; None (default) = all of them. E.g. ``[color]`` pays one attribute only (a
            planted single-attribute hack, ``benchmarks/hacking_shapes.py``); the per-attribute keys are unchanged.
            A sample none of whose listed attributes applies (``[speed]`` on a "staying still" caption) scores NaN
            and is invalid.

    Call: ``verifier(pixels float [B, T, 3, H, W] in [0, 1], prompts: list[str]) -> dict[str, Tensor[B]]``.

    Raises:
        ValueError: ``attributes`` empty or naming an unknown attribute.
        ValueError (at call): a caption that does not parse for ``world`` (unknown word, malformed); frames
            whose size differs from ``world``'s; a caption that states motion for single-frame pixels;
            plus the protocol's input checks (rank, C = 3, range, number of prompts).
    """

    differentiable = False
    dimensions = (
        "reward", "color", "shape", "direction", "speed", "step_following", "consistency", "all_correct",
        "color_correct", "shape_correct", "direction_correct", "speed_correct",
    )
    higher_is_better = True
    channels = (3,)

    def __init__(
        self,
        world: ShapesWorldConfig | dict[str, Any] | None = None,
        scale: float = 1.0,
        shift: float = 0.0,
        calibration_samples: int = 32,
        attributes: Sequence[str] | None = None,
    ) -> None:
        super().__init__(scale=scale, shift=shift)
        if attributes is not None:
            attributes = tuple(attributes)
            unknown = [a for a in attributes if a not in REWARD_ATTRIBUTES]
            if not attributes or unknown:
                raise ValueError(f"ShapesVerifier: attributes must be a non-empty subset of {REWARD_ATTRIBUTES}, got "
                                 f"{list(attributes)}")
        self.attributes = attributes
        if world is None:
            world = ShapesWorldConfig()
        elif isinstance(world, dict):
            world = ShapesWorldConfig(**world)
        elif not isinstance(world, ShapesWorldConfig):
            raise TypeError(f"world must be a ShapesWorldConfig or a dict of its fields, got {type(world)}")
        self.world = world
        eps = 0.01

        # colors: palette scaled to max channel 1
        pal = torch.tensor([PALETTE[c] for c in world.colors], dtype=torch.float32)
        pal = pal / pal.amax(dim=1, keepdim=True)
        self.register_buffer("palette", pal, persistent=False)
        self.tau_color = _tau(self._min_class_distance([p[None] for p in pal]), len(pal), eps)

        # directions: prototype velocities per class (every configured speed and their mean; an image world may have
        # no speeds, then mean_speed is 0 and every direction's prototype is still, unused without motion)
        self.direction_names = list(world.directions)
        speeds = sorted(set(world.speeds.values()) | {world.mean_speed})
        protos = []
        for d in self.direction_names:
            u = torch.tensor(DIRECTION_VECTORS[d], dtype=torch.float32)
            protos.append(torch.zeros(1, 2) if d == "still" else torch.stack([s * u for s in speeds]))
        n = max(len(p) for p in protos)
        padded = torch.stack([torch.cat([p, p[-1:].expand(n - len(p), 2)]) for p in protos])  # [Kd, P, 2]
        self.register_buffer("direction_protos", padded, persistent=False)
        self.tau_direction = _tau(self._min_class_distance(protos), len(protos), eps)

        # speeds
        self.speed_names = list(world.speeds)
        sv = torch.tensor([world.speeds[s] for s in self.speed_names], dtype=torch.float32)
        self.register_buffer("speed_values", sv, persistent=False)
        self.tau_speed = _tau(self._min_class_distance([s.view(1, 1) for s in sv]), len(sv), eps)

        self._calibrate_shapes(calibration_samples, eps)

    # ------------------------------------------------------------------ construction helpers
    @staticmethod
    def _min_class_distance(protos: list[Tensor]) -> float:
        best = math.inf
        for i in range(len(protos)):
            for j in range(i + 1, len(protos)):
                best = min(best, float(torch.cdist(protos[i], protos[j]).min()))
        return best if math.isfinite(best) else 0.0

    def _calibrate_shapes(self, n: int, eps: float) -> None:
        w = self.world
        feats, masses = [], []
        for k, shape in enumerate(w.shapes):
            videos = []
            for i in range(n):
                g = torch.Generator("cpu").manual_seed(sample_seed(0x5EED, k * 100003 + i))
                color = w.colors[i % len(w.colors)]
                if w.image_mode:
                    spec = ShapeSpec(color, shape)
                else:
                    d = w.directions[i % len(w.directions)]
                    speed = None if d == "still" else list(w.speeds)[(i // len(w.directions)) % len(w.speeds)]
                    spec = ShapeSpec(color, shape, (d,), speed)
                videos.append(render(spec, w, g))
            m = self.measure(torch.stack(videos), _calibrating=True)
            feats.append(m["shape_features"])
            masses.append(m["mass"].mean())
        self.reference_mass = float(min(masses))
        protos = torch.stack([f.mean(0) for f in feats])  # [Ks, F]
        spread = protos.std(0, unbiased=True) if len(protos) > 1 else torch.ones(protos.shape[1])
        scale = spread.clamp(min=_FEATURE_FLOOR)
        self.register_buffer("shape_protos", protos / scale, persistent=False)
        self.register_buffer("shape_scale", scale, persistent=False)
        ks = len(protos)
        tau = _tau(self._min_class_distance([p[None] for p in self.shape_protos]), ks, eps)
        if ks > 1:
            z = torch.cat(feats) / scale
            truth = torch.arange(ks).repeat_interleave(n)
            d2 = torch.cdist(z, self.shape_protos) ** 2
            if (d2.argmin(1) != truth).any():
                acc = float((d2.argmin(1) == truth).float().mean())
                warnings.warn(
                    f"ShapesVerifier: shapes {w.shapes} are not separable at {w.height}x{w.width} with object_size "
                    f"{w.object_size} (calibration accuracy {acc:.1%}); shape scores will be unreliable",
                    stacklevel=3,
                )
            else:
                for _ in range(40):  # sharpen until every clean calibration render is >= 0.97 confident
                    p = _softmax_neg(d2, tau).gather(1, truth[:, None]).min()
                    if p >= 0.97:
                        break
                    tau *= 0.8
        self.tau_shape = tau

    # ------------------------------------------------------------------ measurement
    def measure(self, pixels: Tensor, _calibrating: bool = False) -> dict[str, Tensor]:
        """Pixel measurements behind the scores (useful for debugging and evaluation reports).

        Args:
            pixels: float ``[B, T, 3, H, W]`` in [0, 1], finite.

        Returns:
            dict of ``mass`` [B, T] (foreground weight per frame), ``nonempty`` bool [B, T], ``centroid``
            [B, T, 2] (x, y in pixels; on a ``"wrap"`` world the circular mean, in ``[0, W) x [0, H)``), ``track``
            [B, T, 2] (the centroid track the velocities are fitted to: on a ``"wrap"`` world unwrapped over the
            non-empty frames, so it may leave the frame; else the centroid itself), ``chroma`` [B, 3] (video color,
            max-channel-normalised), ``frame_chroma`` [B, T, 3], ``shape_features`` [B, 2] (anisotropy, vertical
            skewness).
        """
        x = pixels.float()
        b, t, _, h, wd = x.shape
        v = x.amax(dim=2)  # [B, T, H, W]
        bg = v.flatten(2).median(dim=-1).values
        w = (v - bg[..., None, None] - _THRESHOLD).clamp(min=0)
        xs = torch.arange(wd, dtype=x.dtype, device=x.device) + 0.5
        ys = torch.arange(h, dtype=x.dtype, device=x.device) + 0.5
        wrap = self.world.boundary == "wrap"

        def offset(d: Tensor, period: int) -> Tensor:  # a coordinate minus the centroid (nearest image when wrapping)
            return wrapped_delta(d, float(period)) if wrap else d

        def centroid(weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            m = weights.sum(dim=(-2, -1))
            safe = m.clamp(min=1e-8)
            if wrap:
                cx = _circular_mean(weights.sum(-2), xs, float(wd))
                cy = _circular_mean(weights.sum(-1), ys, float(h))
            else:
                cx = (weights.sum(-2) * xs).sum(-1) / safe
                cy = (weights.sum(-1) * ys).sum(-1) / safe
            cx = torch.where(m > 0, cx, torch.full_like(cx, wd / 2))
            cy = torch.where(m > 0, cy, torch.full_like(cy, h / 2))
            return m, cx, cy

        _, cx, cy = centroid(w)
        r = self.world.object_size / 2 + 1.5
        for _ in range(2):
            win = ((offset(xs - cx[..., None], wd).abs() <= r)[..., None, :]
                   & (offset(ys - cy[..., None], h).abs() <= r)[..., :, None])
            ww = w * win
            mass, cx, cy = centroid(ww)
        safe = mass.clamp(min=1e-8)
        ref = self.world.object_size**2 * 0.25 if _calibrating else self.reference_mass
        nonempty = mass >= _EMPTY_FRACTION * ref

        # color: chroma of the foreground, per frame and per video (mass-weighted over non-empty frames)
        num = (ww[:, :, None] * x).sum(dim=(-2, -1))  # [B, T, 3]
        den = (ww * v).sum(dim=(-2, -1)).clamp(min=1e-8)  # [B, T]
        frame_chroma = num / den[..., None]
        fw = mass * nonempty
        chroma = (fw[..., None] * frame_chroma).sum(1) / fw.sum(1).clamp(min=1e-8)[:, None]

        # shape: central moments of the windowed weights
        dx = offset(xs - cx[..., None], wd)[..., None, :]  # [B, T, 1, W]
        dy = offset(ys - cy[..., None], h)[..., :, None]  # [B, T, H, 1]

        def e(f: Tensor) -> Tensor:
            return (ww * f).sum(dim=(-2, -1)) / safe

        x4, y4, y2, y3 = e(dx**4), e(dy**4), e(dy**2), e(dy**3)
        u4 = e(((dx + dy) / math.sqrt(2)) ** 4)
        v4 = e(((dx - dy) / math.sqrt(2)) ** 4)
        aniso = (u4 + v4) / (x4 + y4).clamp(min=1e-8)
        skew = y3 / y2.clamp(min=1e-8) ** 1.5
        frame_feats = torch.stack([aniso, skew], dim=-1)  # [B, T, 2]
        shape_features = (fw[..., None] * frame_feats).sum(1) / fw.sum(1).clamp(min=1e-8)[:, None]
        cen = torch.stack([cx, cy], dim=-1)
        track = _unwrap(cen, nonempty, cen.new_tensor([float(wd), float(h)])) if wrap else cen
        return {
            "mass": mass,
            "nonempty": nonempty,
            "centroid": cen,
            "track": track,
            "chroma": chroma,
            "frame_chroma": frame_chroma,
            "shape_features": shape_features,
        }

    @staticmethod
    def _velocity(centroid: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return track_velocity(centroid, mask)

    def _direction_probs(self, vel: Tensor, ok: Tensor) -> Tensor:
        d2 = ((vel[:, None, None, :] - self.direction_protos[None]) ** 2).sum(-1).amin(-1)  # [B, Kd]
        return _softmax_neg(d2, self.tau_direction) * ok[:, None]

    # ------------------------------------------------------------------ scoring
    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        w = self.world
        b, t, _, h, wd = pixels.shape
        if (h, wd) != (w.height, w.width):
            raise ValueError(
                f"ShapesVerifier is calibrated for {w.height}x{w.width} frames, got {h}x{wd} (pixels shape "
                f"{tuple(pixels.shape)}); build it with world=ShapesWorldConfig(height={h}, width={wd}, ...)"
            )
        specs = [parse_caption(p, w) for p in prompts]
        for p, s in zip(prompts, specs):
            if t == 1 and s.directions:
                raise ValueError(f"caption {p!r} states motion but the pixels have a single frame (T=1)")
        dev = self.palette.device  # score where the verifier lives (move it with .to(device))
        x = torch.nan_to_num(pixels.detach().float(), nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1).to(dev)
        out = self._scores(x, specs)[0]
        if self.attributes is not None:  # the mean of the listed soft scores that apply (NaN when none does)
            parts = torch.stack([out[a] for a in self.attributes], dim=1)
            applies = (~parts.isnan()).sum(1)
            out["reward"] = torch.where(applies > 0, parts.nansum(1) / applies.clamp(min=1),
                                        torch.full_like(out["reward"], float("nan")))
        return out

    def _scores(self, x: Tensor, specs: list[ShapeSpec], smooth: bool = False) -> tuple[dict[str, Tensor],
                                                                                       dict[str, Tensor]]:
        """The output keys of :meth:`score` for finite pixels ``x`` [B, T, 3, H, W] in [0, 1] (on the verifier's
        device) and their parsed captions, plus the class probabilities ``{"color": [B, Kc], "shape": [B, Ks]}``.
        Differentiable in ``x`` almost everywhere; ``smooth`` adds 1e-12 under the square roots (the chroma RMS and
        the speed norm) so that their gradients stay finite at 0 (the values move by at most 1e-6)."""
        w = self.world
        b, t = x.shape[:2]
        dev = x.device
        tiny = 1e-12 if smooth else 0.0
        m = self.measure(x)
        nonempty = m["nonempty"]
        has_fg = nonempty.any(1)
        nan = torch.full((b,), float("nan"), device=dev)

        def idx(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        def pick(probs: Tensor, index: Tensor) -> Tensor:
            return probs.gather(1, index.clamp(min=0)[:, None])[:, 0]

        def hit(probs: Tensor, index: Tensor, ok: Tensor) -> Tensor:
            return (probs.argmax(1) == index) & ok

        # color and shape
        p_color = _softmax_neg(torch.cdist(m["chroma"], self.palette) ** 2, self.tau_color) * has_fg[:, None]
        z = m["shape_features"] / self.shape_scale
        p_shape = _softmax_neg(torch.cdist(z, self.shape_protos) ** 2, self.tau_shape) * has_fg[:, None]
        ci = idx([w.colors.index(s.color) for s in specs])
        si = idx([w.shapes.index(s.shape) for s in specs])
        color, shape = pick(p_color, ci), pick(p_shape, si)
        color_ok, shape_ok = hit(p_color, ci, has_fg), hit(p_shape, si, has_fg)
        correct = color_ok & shape_ok
        direction_ok, speed_ok = nan.clone(), nan.clone()

        # motion
        direction, speed, steps = nan.clone(), nan.clone(), nan.clone()
        if t > 1:
            cen = m["track"]  # the centroid; unwrapped on a wrapping world
            tt = torch.arange(t, device=dev, dtype=cen.dtype)
            v_all, ok_all = self._velocity(cen, nonempty)
            p_all = self._direction_probs(v_all, ok_all)
            speed_norm = (v_all.square().sum(1, keepdim=True) + tiny).sqrt()
            p_speed = _softmax_neg((speed_norm - self.speed_values) ** 2, self.tau_speed)
            p_speed = p_speed * ok_all[:, None]
            names = self.direction_names
            d1 = idx([names.index(s.directions[0]) if s.directions else -1 for s in specs])
            sp = idx([self.speed_names.index(s.speed) if s.speed is not None else -1 for s in specs])
            single = idx([len(s.directions) == 1 for s in specs]).bool()
            multi = idx([s.multi_step for s in specs]).bool()
            # multi-step: one velocity per segment, over the frames between the world's turn points (two segments:
            # t <= (T-1)/2 and t >= (T-1)/2); direction = the segments' mean, step_following = their product
            seg_sum, seg_prod = torch.zeros_like(direction), torch.ones_like(direction)
            seg_hit = torch.ones_like(multi)
            for n in sorted({len(s.directions) for s in specs if s.multi_step}):
                rows = idx([len(s.directions) == n and s.multi_step for s in specs]).bool()
                turns = [0.0, *turn_points(t, n), float(t - 1)]
                for k in range(n):
                    vk, okk = self._velocity(cen, nonempty & (tt >= turns[k]) & (tt <= turns[k + 1]))
                    pk = self._direction_probs(vk, okk)
                    dk = idx([names.index(s.directions[k]) if len(s.directions) == n and s.multi_step else -1
                              for s in specs])
                    ak = pick(pk, dk)
                    seg_sum = torch.where(rows, seg_sum + ak, seg_sum)
                    seg_prod = torch.where(rows, seg_prod * ak, seg_prod)
                    seg_hit = torch.where(rows, seg_hit & hit(pk, dk, okk), seg_hit)
            n_seg = idx([max(len(s.directions), 1) for s in specs]).to(seg_sum.dtype)
            direction = torch.where(single, pick(p_all, d1), direction)
            direction = torch.where(multi, seg_sum / n_seg, direction)
            steps = torch.where(multi, seg_prod, steps)
            stated_speed = sp >= 0
            speed = torch.where(stated_speed, pick(p_speed, sp), speed)
            dir_hit = torch.where(single, hit(p_all, d1, ok_all), seg_hit)
            speed_hit = hit(p_speed, sp, ok_all)
            correct &= dir_hit
            correct &= ~stated_speed | speed_hit
            direction_ok = dir_hit.float()
            speed_ok = torch.where(stated_speed, speed_hit.float(), nan)
            # temporal consistency of foreground area and color
            mass = m["mass"]
            r_mass = mass.std(1, unbiased=False) / mass.mean(1).clamp(min=1e-8)
            dev_c = ((m["frame_chroma"] - m["chroma"][:, None]) ** 2).sum(-1)
            r_color = ((dev_c * nonempty).sum(1) / nonempty.sum(1).clamp(min=1) + tiny).sqrt()
            consistency = torch.exp(-(r_mass**2 + r_color**2) / (2 * _CONSISTENCY_SIGMA**2)) * has_fg
        else:
            consistency = nan.clone()

        parts = torch.stack([color, shape, direction, speed, steps, consistency], dim=1)
        reward = parts.nansum(1) / (~parts.isnan()).sum(1).clamp(min=1)
        return {
            "reward": reward,
            "color": color,
            "shape": shape,
            "direction": direction,
            "speed": speed,
            "step_following": steps,
            "consistency": consistency,
            "all_correct": correct.float(),
            "color_correct": color_ok.float(),
            "shape_correct": shape_ok.float(),
            "direction_correct": direction_ok,
            "speed_correct": speed_ok,
        }, {"color": p_color, "shape": p_shape}

    def extra_repr(self) -> str:
        chosen = "" if self.attributes is None else f", attributes={list(self.attributes)}"
        return f"{super().extra_repr()}, world={asdict(self.world)}{chosen}"


@register_reward("shapes_video")
class ShapesVideoReward(RewardModel):
    """A differentiable video reward for the shapes world with the three named dimensions of a video reward model
    (VideoReward / VideoAlign's visual quality, motion quality and text alignment), for reward-weighted
    distillation (Stream-R1's saliency): the exact verifier's soft scores computed with gradients.

    Built on :class:`ShapesVerifier` (same measurements, same prototypes and temperatures), in float32:

    ==================  ======================================================================================
    ``visual_quality``  text-free appearance: (max_k P(color k) + max_k P(shape k)) / 2, how cleanly the video
                        shows *some* palette color and *some* shape of the world
    ``motion_quality``  text-free temporal quality: the verifier's ``consistency`` (stability of area and
                        color over frames); NaN for single frames
    ``text_alignment``  the caption: mean of the stated soft scores (color, shape, direction, speed, step
                        following), the verifier's ``reward`` without ``consistency``
    ``reward``          mean of the three (of the defined ones)
    ==================  ======================================================================================

    ``saliency(pixels, prompts, dims=[...])`` gives each dimension's per-pixel input-gradient norm; the gradient
    reaches the foreground (the weights above the per-frame median) and nothing else. The exact verifier
    (``shapes``) stays the evaluation; this reward differs from it by at most 1e-6 where both define a key.

    Args:
        world: the shapes world (as :class:`ShapesVerifier`). scale, shift: affine on ``"reward"``.
    """

    differentiable = True
    dimensions = ("reward", "visual_quality", "motion_quality", "text_alignment")
    higher_is_better = True
    channels = (3,)

    def __init__(self, world: ShapesWorldConfig | dict[str, Any] | None = None, scale: float = 1.0,
                 shift: float = 0.0) -> None:
        super().__init__(scale=scale, shift=shift)
        self.verifier = ShapesVerifier(world)

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        w = self.verifier.world
        h, wd = pixels.shape[-2:]
        if (h, wd) != (w.height, w.width):
            raise ValueError(f"ShapesVideoReward is calibrated for {w.height}x{w.width} frames, got {h}x{wd}; build "
                             f"it with world={{height: {h}, width: {wd}}}")
        specs = [parse_caption(p, w) for p in prompts]
        dev = self.verifier.palette.device
        finite = torch.isfinite(pixels)
        x = torch.where(finite, pixels, torch.zeros_like(pixels)).float().clamp(0, 1).to(dev)
        out, probs = self.verifier._scores(x, specs, smooth=True)
        vq = (probs["color"].amax(1) + probs["shape"].amax(1)) / 2
        mq = out["consistency"]
        stated = torch.stack([out[k] for k in ("color", "shape", "direction", "speed", "step_following")], 1)
        ta = stated.nansum(1) / (~stated.isnan()).sum(1).clamp(min=1)
        parts = torch.stack([vq, mq, ta], 1)
        reward = parts.nansum(1) / (~parts.isnan()).sum(1).clamp(min=1)
        return {"reward": reward, "visual_quality": vq, "motion_quality": mq, "text_alignment": ta}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, world={self.verifier.world.height}x{self.verifier.world.width}"


def score_windows(
    verifier: RewardModel, video: Tensor, prompts: list[str], window: int, stride: int | None = None
) -> dict[str, Tensor]:
    """Score a long video window by window: every key of ``verifier`` per window, ``[B, n_windows]``.

    A history-guided rollout many times a model's window long (``genrl.rollout.history_rollout``) cannot be scored by
    a verifier built for clips of ``window`` frames as a whole; this scores frames ``[k * stride, k * stride +
    window)`` for ``k = 0 .. n_windows - 1``, ``n_windows = (T - window) // stride + 1`` (the last
    ``(T - window) % stride`` frames are left out when the stride does not divide), each with the full caption. Use
    single-step captions (a two-segment caption's turn is at the middle of each window, not of the video) and, for
    the shapes world, a ``"wrap"`` world so the object may travel any distance.

    Args:
        verifier: a reward following genrl's protocol (``verifier(pixels, prompts) -> dict[str, Tensor[B]]``),
            typically a :class:`ShapesVerifier` whose world has ``num_frames == window``.
        video: float ``[B, T, C, H, W]`` in [0, 1] (decoded pixels, e.g. ``generator.decode(sample.video)``;
            [-1, 1] or uint8 pixels are refused by the verifier's input check).
        prompts: B captions, one per video.
        window: frames per window, ``1 <= window <= T``.
        stride: frames between the starts of consecutive windows (>= 1); default ``window`` (disjoint windows).

    Returns:
        ``{key: Tensor [B, n_windows]}`` for every key the verifier returns, in its dtype (float32 scores, bool
        ``"valid"``); column k is window k. NaN keeps the verifier's meaning (not stated / invalid).

    Raises:
        ValueError: ``video`` not of rank 5; ``window`` or ``stride`` not an int in range (the message gives T); a
            verifier with a ``world`` whose ``num_frames`` differs from ``window`` (build it with
            ``num_frames=window``); plus the verifier's own input checks.
    """
    if not isinstance(video, Tensor) or video.ndim != 5:
        shape = tuple(video.shape) if isinstance(video, Tensor) else type(video).__name__
        raise ValueError(f"score_windows: video must be a tensor [B, T, C, H, W], got {shape}")
    t = video.shape[1]
    stride = window if stride is None else stride
    for name, value in (("window", window), ("stride", stride)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"score_windows: {name} must be an int >= 1, got {value!r}")
    if window > t:
        raise ValueError(f"score_windows: window={window} frames is longer than the video (T={t}); use window <= {t}")
    world = getattr(verifier, "world", None)
    frames = getattr(world, "num_frames", None)
    if frames is not None and frames != window:
        raise ValueError(
            f"score_windows: the verifier's world has num_frames={frames} but window={window}; build the verifier "
            f"with num_frames={window} (e.g. ShapesVerifier(dataclasses.replace(world, num_frames={window}))) or "
            f"use window={frames}"
        )
    per_window = [verifier(video[:, s:s + window], list(prompts)) for s in range(0, t - window + 1, stride)]
    return {key: torch.stack([out[key] for out in per_window], dim=1) for key in per_window[0]}
