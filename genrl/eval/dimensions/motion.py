"""Weight-free proxies of VBench's dynamic degree (RAFT) and motion smoothness (AMT-S), with OpenCV Farneback flow.

The rules around the flow model are VBench's, exactly (frame selection, statistics, thresholds, quantisation);
only the model differs, so both dimensions have ``proxy = True``: useful for curves and comparisons between
genrl runs, not comparable with published VBench numbers.

Sources: Huang et al. 2024, *VBench*, section 3.1; vbench/dynamic_degree.py (``get_frames`` / ``set_params`` /
``get_score`` / ``check_move``), vbench/motion_smoothness.py (``extract_frame`` / ``vfi_score``) and AMT's
``tensor2img``; Farneback 2003, "Two-frame motion estimation based on polynomial expansion"
(``cv2.calcOpticalFlowFarneback``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from genrl.eval.dimensions.base import Dimension, DimensionResult, TooFewFrames

__all__ = ["DynamicDegree", "MotionSmoothness", "FARNEBACK_DEFAULTS", "vbench_resample_indices", "farneback_flow",
           "flow_midpoint"]

#: ``cv2.calcOpticalFlowFarneback`` parameters (OpenCV's tutorial values; ``flags`` 0).
FARNEBACK_DEFAULTS: dict[str, Any] = dict(pyr_scale=0.5, levels=3, winsize=15, iterations=3, poly_n=5,
                                          poly_sigma=1.2, flags=0)


def vbench_resample_indices(num_frames: int, fps: float, target_fps: float = 8.0) -> list[int]:
    """The frames VBench's dynamic degree keeps: every ``interval``-th from frame 0, ``interval =
    max(1, round(fps / 8))`` with Python's round (half to even: 20 fps -> 2, 12 fps -> 2, 25 fps -> 3, 30 fps -> 4).

    Args:
        num_frames: T. fps: the container's frame rate (> 0). target_fps: 8 in VBench.
    Returns:
        the kept indices ``list(range(0, T, interval))``.
    """
    interval = max(1, round(fps / target_fps))
    return list(range(0, int(num_frames), interval))


def _gray(frame_chw: np.ndarray) -> np.ndarray:
    import cv2

    return cv2.cvtColor(np.ascontiguousarray(frame_chw.transpose(1, 2, 0)), cv2.COLOR_RGB2GRAY)


def farneback_flow(prev_gray: np.ndarray, next_gray: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
    """Dense optical flow from ``prev_gray`` to ``next_gray`` (uint8 [H, W]): float32 [H, W, 2] (dx, dy) in pixels,
    ``prev(y, x) ~ next(y + dy, x + dx)``."""
    import cv2

    p = {**FARNEBACK_DEFAULTS, **(params or {})}
    return cv2.calcOpticalFlowFarneback(prev_gray, next_gray, None, p["pyr_scale"], p["levels"], p["winsize"],
                                        p["iterations"], p["poly_n"], p["poly_sigma"], p["flags"])


def flow_midpoint(a: np.ndarray, b: np.ndarray, params: dict[str, Any] | None = None) -> np.ndarray:
    """Interpolate the frame halfway between ``a`` and ``b`` (uint8 [H, W, 3]) with Farneback flow.

    With ``F`` the flow from ``a`` to ``b`` (on grayscale), each neighbour is warped halfway with ``cv2.remap``
    (bilinear, replicated border): ``a(x - F(x) / 2)`` and ``b(x + F(x) / 2)``, and the two are averaged. The result
    is quantised like AMT's ``tensor2img`` (clip to [0, 255], then truncate to uint8). Identical neighbours are
    returned unchanged (Farneback reports a few hundredths of a pixel of flow on identical textured frames, which
    the truncation would turn into a spurious error).

    Returns:
        uint8 [H, W, 3].
    """
    import cv2

    if np.array_equal(a, b):
        return a.copy()
    flow = farneback_flow(cv2.cvtColor(a, cv2.COLOR_RGB2GRAY), cv2.cvtColor(b, cv2.COLOR_RGB2GRAY), params)
    h, w = a.shape[:2]
    gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    half_x, half_y = 0.5 * flow[..., 0], 0.5 * flow[..., 1]
    wa = cv2.remap(a.astype(np.float32), gx - half_x, gy - half_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    wb = cv2.remap(b.astype(np.float32), gx + half_x, gy + half_y, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
    return np.clip((wa + wb) / 2.0, 0, 255).astype(np.uint8)


class _FlowDimension(Dimension):
    """A weight-free dimension built on Farneback flow: holds the flow parameters (:data:`FARNEBACK_DEFAULTS`
    overridden by ``flow_params``; an unknown key raises ValueError listing the known ones)."""

    def __init__(self, flow_params: dict[str, Any] | None = None) -> None:
        super().__init__()
        unknown = set(flow_params or {}) - set(FARNEBACK_DEFAULTS)
        if unknown:
            raise ValueError(f"dimension {self.name!r}: unknown flow_params {sorted(unknown)}; known: "
                             f"{sorted(FARNEBACK_DEFAULTS)}")
        self.flow_params = {**FARNEBACK_DEFAULTS, **(flow_params or {})}


class DynamicDegree(_FlowDimension):
    """Dynamic degree (proxy): is the video moving? 1.0 or 0.0 per video; the dataset score is the fraction of
    moving videos.

    VBench's rule, with Farneback flow on grayscale frames in place of RAFT (20 iterations, RGB):

    1. Keep every ``interval``-th frame from frame 0, ``interval = max(1, round(fps / 8))`` (about 8 fps;
       :func:`vbench_resample_indices`); n frames are kept.
    2. For each consecutive kept pair, the flow magnitude ``sqrt(dx^2 + dy^2)`` per pixel; the pair's score is the
       mean of its ``int(0.05 * H' * W')`` largest magnitudes. As RAFT's ``InputPadder`` does, frames are first
       padded (replicate) to multiples of 8, and H', W' are the padded sides.
    3. Threshold ``6 * min(H, W) / 256`` (unpadded sides): the video is dynamic when at least
       ``round(4 * n / 16)`` pairs score strictly above it (Python's round; with n <= 2 that count is 0, so any
       video of two kept frames is dynamic, as in VBench). This is vbench/core/dynamic_degree.py; one earlier
       revision of vbench/dynamic_degree.py also multiplied the threshold by ``max(1, 8 / fps)``, which only
       matters below 8 fps.

    Input: uint8 [T, 3, H, W] with at least 2 kept frames (T >= interval + 1); frames of at least 20 pixels.
    ``extras``: ``indices``, ``pair_scores``, ``threshold``, ``count_needed``, ``count_above``, ``interval``.

    Args:
        flow_params: overrides of :data:`FARNEBACK_DEFAULTS`.
    Raises (at scoring): TooFewFrames: fewer than 2 kept frames. ValueError: frames too small for a top-5% mean.
    """

    name: ClassVar[str] = "dynamic_degree"
    proxy: ClassVar[bool] = True
    needs_weights: ClassVar[bool] = False
    min_frames: ClassVar[int] = 2
    description: ClassVar[str] = ("share of videos whose top-5% flow exceeds 6*min(H,W)/256 on enough pairs at ~8 fps "
                                  "(VBench's rule; Farneback flow instead of RAFT: proxy)")

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        import cv2

        t, _, h, w = frames.shape
        indices = vbench_resample_indices(t, fps)
        interval = max(1, round(fps / 8.0))
        if len(indices) < 2:
            raise TooFewFrames(self.name, t, interval + 1,
                               f"at {fps:g} fps VBench keeps one frame in {interval} (about 8 fps) and needs 2 kept "
                               f"frames")
        pad_h, pad_w = (-h) % 8, (-w) % 8
        cut = int((h + pad_h) * (w + pad_w) * 0.05)
        if cut < 1:
            raise ValueError(f"dimension {self.name!r}: {h}x{w} frames are too small for the top-5% flow statistic "
                             f"(need at least 20 pixels)")
        kept = frames[indices].cpu().numpy()
        grays = []
        for f in kept:
            g = _gray(f)
            if pad_h or pad_w:
                g = cv2.copyMakeBorder(g, pad_h // 2, pad_h - pad_h // 2, pad_w // 2, pad_w - pad_w // 2,
                                       cv2.BORDER_REPLICATE)
            grays.append(g)
        scores = []
        for g0, g1 in zip(grays[:-1], grays[1:]):
            mag = np.linalg.norm(farneback_flow(g0, g1, self.flow_params).astype(np.float64), axis=-1).ravel()
            scores.append(float(np.partition(mag, mag.size - cut)[mag.size - cut:].mean()))
        threshold = 6.0 * min(h, w) / 256.0
        count_needed = round(4 * len(indices) / 16.0)
        above = sum(s > threshold for s in scores)
        return DimensionResult(value=1.0 if above >= count_needed else 0.0, weight=1.0, extras={
            "indices": indices, "pair_scores": scores, "threshold": threshold, "count_needed": count_needed,
            "count_above": above, "interval": interval})


class MotionSmoothness(_FlowDimension):
    """Motion smoothness (proxy): how well the odd frames are predicted by interpolating their even neighbours.

    VBench's rule, with :func:`flow_midpoint` (Farneback flow, halfway warps of both neighbours, average) in place
    of AMT-S: keep the even frames 0, 2, 4, ...; interpolate one frame between each consecutive kept pair (K =
    ceil(T / 2) - 1 frames); compare interpolated frame k with the real frame 2k + 1 by the mean absolute uint8
    difference; ``value = (255 - mean_k MAE_k) / 255`` (the last real frame of an even-length video is unused).
    Interpolations are truncated to uint8 as AMT's ``tensor2img`` does. A static video scores exactly 1.0; higher
    is better. The dataset score is the mean over videos. VBench feeds the frames at the file's native rate.

    Input: uint8 [T, 3, H, W], T >= 3. ``extras``: ``{"frame_mae": [K floats]}``.

    Args:
        flow_params: overrides of :data:`FARNEBACK_DEFAULTS`.
    """

    name: ClassVar[str] = "motion_smoothness"
    proxy: ClassVar[bool] = True
    needs_weights: ClassVar[bool] = False
    min_frames: ClassVar[int] = 3
    description: ClassVar[str] = ("1 - MAE/255 of odd frames re-created from their even neighbours (VBench's rule; "
                                  "Farneback-warp interpolation instead of AMT-S: proxy)")

    def _score(self, frames: Tensor, fps: float) -> DimensionResult:
        x = frames.cpu().numpy().transpose(0, 2, 3, 1)  # [T, H, W, 3] uint8
        evens = x[0::2]
        maes = []
        for k in range(len(evens) - 1):
            mid = flow_midpoint(np.ascontiguousarray(evens[k]), np.ascontiguousarray(evens[k + 1]), self.flow_params)
            diff = np.abs(mid.astype(np.int16) - x[2 * k + 1].astype(np.int16))
            maes.append(float(diff.mean()))
        value = (255.0 - float(np.mean(maes))) / 255.0
        return DimensionResult(value=value, weight=1.0, extras={"frame_mae": maes})
