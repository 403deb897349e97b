"""Gold metrics: reward-free statistics of generated videos that a training reward cannot game without showing.

A reward model is a proxy. When training pushes it up by some shortcut (darker frames, a frozen frame, every sample
alike, one attribute at the cost of the others), the proxy rises while plain statistics of the videos move. This
module computes those statistics; :class:`genrl.callbacks.RewardHackingMonitor` tracks them during training.

Every function takes float videos ``[N, T, 3, H, W]`` with values in [0, 1] (any float dtype and device; computed in
float64 on the CPU) and is a pure function of its inputs:

- :func:`frame_statistics`: per video, mean brightness (Rec. 601 luma), mean HSV saturation and the fraction of
  near-constant frames;
- :func:`temporal_flicker`: VBench's temporal-flickering score on the pixels quantised to uint8
  (:func:`genrl.eval.dimensions.flicker.flicker_score`);
- :func:`within_prompt_diversity` / :func:`batch_diversity`: mean pairwise RMS pixel distance between the samples
  of a prompt / of the whole set (collapse shows as a fall);
- :class:`PixelFD`: a Frechet distance in a PCA space of flattened real videos (a weight-free stand-in for FVD on
  small worlds such as the shapes world);
- :func:`gold_metrics`: all of the above as one dict of floats, with the gaps to real videos when given.

The true videos of the shapes world for the same prompts are :func:`genrl.data.shapes.real_videos` (re-exported
here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from genrl.data.shapes import real_videos
from genrl.eval.dimensions.flicker import flicker_score

__all__ = [
    "LUMA_WEIGHTS",
    "NEAR_CONSTANT_STD",
    "frame_statistics",
    "temporal_flicker",
    "pairwise_rms",
    "within_prompt_diversity",
    "batch_diversity",
    "PixelFD",
    "gold_metrics",
    "real_videos",
]

#: ITU-R BT.601 luma weights of (R, G, B).
LUMA_WEIGHTS: tuple[float, float, float] = (0.299, 0.587, 0.114)
#: A frame is "near-constant" (blank, or one uniform colour) when the spatial standard deviation of each of its
#: channels (population, over H x W, values in [0, 1]) is below this. 0.02 is about 5 levels of 255.
NEAR_CONSTANT_STD = 0.02


def _check(videos: Tensor, name: str = "videos", min_frames: int = 1) -> Tensor:
    """``videos`` as float64 on the CPU after the shape / dtype / finiteness checks (range is not enforced beyond
    finiteness; values are expected in [0, 1])."""
    if not isinstance(videos, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [N, T, 3, H, W] in [0, 1], got {type(videos).__name__}")
    if videos.ndim != 5 or videos.shape[2] != 3 or not videos.is_floating_point():
        raise ValueError(f"{name} must be a float tensor [N, T, 3, H, W] in [0, 1], got shape "
                         f"{tuple(videos.shape)} dtype {videos.dtype}")
    if videos.shape[1] < min_frames:
        raise ValueError(f"{name} need at least {min_frames} frames, got shape {tuple(videos.shape)}")
    x = videos.detach().to("cpu", torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contain NaN or inf values")
    return x


def frame_statistics(videos: Tensor, constant_std: float = NEAR_CONSTANT_STD) -> dict[str, Tensor]:
    """Per-video brightness, saturation and fraction of near-constant frames.

    Args:
        videos: float ``[N, T, 3, H, W]`` in [0, 1].
        constant_std: a frame is near-constant when the spatial population std (over H x W) of every one of its
            3 channels is below this (default :data:`NEAR_CONSTANT_STD` = 0.02), i.e. blank or one uniform colour.

    Returns:
        ``{"brightness", "saturation", "constant_frames"}``, each float64 ``[N]`` in [0, 1]:

        - ``brightness``: mean over frames and pixels of the luma ``0.299 R + 0.587 G + 0.114 B``;
        - ``saturation``: mean over frames and pixels of the HSV saturation ``(max - min) / max`` of (R, G, B),
          0 where max = 0 (black);
        - ``constant_frames``: fraction of the T frames that are near-constant.

    Raises:
        TypeError: not a tensor. ValueError: not a float ``[N, T, 3, H, W]`` tensor, or non-finite values.
    """
    x = _check(videos)
    w = torch.tensor(LUMA_WEIGHTS, dtype=torch.float64)
    luma = (x * w[:, None, None]).sum(dim=2)  # [N, T, H, W]
    hi, lo = x.amax(dim=2), x.amin(dim=2)
    sat = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-300), torch.zeros_like(hi))
    frame_std = x.flatten(3).std(dim=-1, unbiased=False).amax(dim=-1)  # [N, T]: the largest channel's std
    return {
        "brightness": luma.flatten(1).mean(dim=1),
        "saturation": sat.flatten(1).mean(dim=1),
        "constant_frames": (frame_std < constant_std).to(torch.float64).mean(dim=1),
    }


def temporal_flicker(videos: Tensor) -> Tensor:
    """VBench's temporal-flickering score of each video, ``(255 - mean_t MAE(frame_t, frame_{t+1})) / 255``.

    The pixels are quantised as a decoder would give them (``round(clamp(x, 0, 1) * 255)``, uint8) and scored with
    :func:`genrl.eval.dimensions.flicker.flicker_score`, the formula of the ``temporal_flickering`` dimension, so a
    video's value equals that dimension's score of its uint8 frames. VBench scores only static-scene prompts; on
    moving content this measures frame-to-frame change of any kind (motion included), so compare it with real videos
    of the same prompts (``flicker_gap`` in :func:`gold_metrics`) rather than with 1.

    Args:
        videos: float ``[N, T, 3, H, W]`` in [0, 1], T >= 2.

    Returns:
        float64 ``[N]`` in [0, 1]; 1.0 exactly for a static video; higher is steadier.

    Raises:
        TypeError / ValueError: as :func:`frame_statistics`, or T < 2.
    """
    x = _check(videos, min_frames=2)
    frames = (x.clamp(0, 1) * 255.0).round().to(torch.uint8)
    return flicker_score(frames)


def pairwise_rms(videos: Tensor) -> Tensor:
    """RMS pixel distance between every two videos: ``D[i, j] = sqrt(mean((v_i - v_j)^2))`` over frames, channels
    and pixels.

    Args:
        videos: float ``[N, T, 3, H, W]`` in [0, 1].

    Returns:
        float64 ``[N, N]``, symmetric, zero diagonal, values in [0, 1].

    Raises:
        TypeError / ValueError: as :func:`frame_statistics`.
    """
    x = _check(videos).flatten(1)
    # direct differences (not the Gram-matrix expansion), so identical videos are exactly 0 apart
    d = torch.cdist(x[None], x[None], compute_mode="donot_use_mm_for_euclid_dist")[0]
    return d / math.sqrt(x.shape[1])


def _mean_offdiag(d: Tensor) -> float:
    n = d.shape[0]
    return float(d.sum() / (n * (n - 1)))


def batch_diversity(videos: Tensor) -> float:
    """Mean pairwise RMS pixel distance over all ``N (N - 1) / 2`` pairs of videos (:func:`pairwise_rms`): the
    diversity of a set with one sample per prompt. All videos identical gives 0.

    Args:
        videos: float ``[N, T, 3, H, W]`` in [0, 1].

    Returns:
        a float in [0, 1]; NaN when N < 2.

    Raises:
        TypeError / ValueError: as :func:`frame_statistics`.
    """
    if _check(videos).shape[0] < 2:
        return math.nan
    return _mean_offdiag(pairwise_rms(videos))


def within_prompt_diversity(videos: Tensor, prompts: Sequence[str]) -> float:
    """Diversity among samples of the same prompt: for every prompt with at least 2 samples, the mean pairwise RMS
    pixel distance between its samples (:func:`pairwise_rms`); then the mean over those prompts (each prompt counts
    once, whatever its number of samples).

    Args:
        videos: float ``[N, T, 3, H, W]`` in [0, 1].
        prompts: N strings, the prompt of each video.

    Returns:
        a float in [0, 1]; NaN when no prompt has two samples.

    Raises:
        TypeError / ValueError: as :func:`frame_statistics`; ``len(prompts) != N``.
    """
    x = _check(videos)
    prompts = list(prompts)
    if len(prompts) != x.shape[0]:
        raise ValueError(f"got {len(prompts)} prompts for {x.shape[0]} videos")
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    values = [_mean_offdiag(pairwise_rms(x[idx])) for idx in groups.values() if len(idx) >= 2]
    return float(sum(values) / len(values)) if values else math.nan


class PixelFD:
    """Frechet distance between two sets of videos in a PCA space of flattened real videos.

    The top ``dims`` principal components of ``reference`` (flattened videos, mean removed, in float64) are fit once;
    :meth:`distance` projects two sets on them and returns the Frechet distance between their Gaussian fits,
    ``|mu_a - mu_b|^2 + tr(C_a) + tr(C_b) - 2 tr sqrt(C_a C_b)`` (sample covariances, ``torch.cov``). A weight-free
    stand-in for FVD on small worlds (the shapes world: 2,048 real videos give the basis). Like FVD it is biased
    upward at small set sizes: compare distances of sets of equal size, next to the distance between two independent
    real sets (the noise floor).

    Args:
        reference: float ``[M, T, C, H, W]`` (or any ``[M, ...]``) real videos; M >= 2.
        dims: number of principal components kept (at most min(M, T*C*H*W)); default 32.

    Raises:
        ValueError: fewer than 2 reference videos, ``dims`` < 1.
    """

    def __init__(self, reference: Tensor, dims: int = 32) -> None:
        if len(reference) < 2:
            raise ValueError(f"PixelFD needs at least 2 reference videos, got {len(reference)}")
        if dims < 1:
            raise ValueError(f"dims must be >= 1, got {dims}")
        x = reference.reshape(len(reference), -1).double().cpu()
        self.mean = x.mean(0)
        _, _, v = torch.linalg.svd(x - self.mean, full_matrices=False)
        self.basis = v[:dims].T

    def features(self, videos: Tensor) -> Tensor:
        """float64 ``[N, dims]``: the projections of ``videos`` (same per-video size as the reference)."""
        return (videos.reshape(len(videos), -1).double().cpu() - self.mean) @ self.basis

    def distance(self, a: Tensor, b: Tensor) -> float:
        """The Frechet distance between the sets ``a`` and ``b`` (each ``[N >= 2, ...]``); symmetric, >= 0 up to
        rounding, ~0 for a set with itself."""
        fa, fb = self.features(a), self.features(b)
        mu_a, mu_b = fa.mean(0), fb.mean(0)
        ca, cb = torch.cov(fa.T), torch.cov(fb.T)
        # tr sqrt(ca cb) via the eigenvalues of sqrt(ca) cb sqrt(ca) (symmetric PSD)
        ea, va = torch.linalg.eigh(ca)
        sa = va @ torch.diag(ea.clamp_min(0).sqrt()) @ va.T
        m = sa @ cb @ sa
        tr_sqrt = torch.linalg.eigvalsh((m + m.T) / 2).clamp_min(0).sqrt().sum()
        return float((mu_a - mu_b).square().sum() + ca.trace() + cb.trace() - 2 * tr_sqrt)


def gold_metrics(videos: Tensor, prompts: Sequence[str], *, real: Tensor | None = None, fd: PixelFD | None = None,
                 constant_std: float = NEAR_CONSTANT_STD) -> dict[str, float]:
    """The gold metrics of a set of generated videos, as plain floats.

    Args:
        videos: float ``[N, T, 3, H, W]`` in [0, 1], T >= 2.
        prompts: N strings.
        real: true videos of the same prompts (same shape as ``videos``, e.g. :func:`real_videos`), or None.
        fd: a :class:`PixelFD` fit on real videos of the same world; used only with ``real``.
        constant_std: the near-constant frame threshold of :func:`frame_statistics`.

    Returns:
        ``brightness``, ``saturation``, ``constant_frames``, ``flicker``: means over videos of
        :func:`frame_statistics` and :func:`temporal_flicker`; ``diversity_within_prompt``
        (:func:`within_prompt_diversity`) when some prompt has two or more samples, else ``diversity_batch``
        (:func:`batch_diversity`); with ``real``: ``flicker_gap`` = ``|flicker - mean temporal_flicker(real)|``;
        with ``real`` and ``fd``: ``fd`` = ``fd.distance(videos, real)``.

    Raises:
        TypeError / ValueError: as :func:`frame_statistics`; T < 2; ``len(prompts) != N``; ``real`` of another
            shape than ``videos``.
    """
    x = _check(videos, min_frames=2)
    prompts = list(prompts)
    if len(prompts) != x.shape[0]:
        raise ValueError(f"got {len(prompts)} prompts for {x.shape[0]} videos")
    stats = frame_statistics(x, constant_std)
    out = {key: float(value.mean()) for key, value in stats.items()}
    flicker = float(temporal_flicker(x).mean())
    out["flicker"] = flicker
    if len(set(prompts)) < len(prompts):
        out["diversity_within_prompt"] = within_prompt_diversity(x, prompts)
    else:
        out["diversity_batch"] = batch_diversity(x)
    if real is not None:
        r = _check(real, "real", min_frames=2)
        if r.shape != x.shape:
            raise ValueError(f"real videos must have the shape of the generated ones {tuple(x.shape)}, got "
                             f"{tuple(r.shape)}")
        out["flicker_gap"] = abs(flicker - float(temporal_flicker(r).mean()))
        if fd is not None:
            out["fd"] = fd.distance(x, r)
    return out
