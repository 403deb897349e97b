"""The Frechet distance between two Gaussians fitted to feature sets, feature statistics and their cache.

FID (Heusel et al. 2017, "GANs Trained by a Two Time-Scale Update Rule Converge to a Local Nash Equilibrium",
eq. 6) and FVD (Unterthiner et al. 2018, "Towards Accurate Generative Models of Video") are both

    d^2 = ||mu_1 - mu_2||^2 + Tr(S_1 + S_2 - 2 (S_1 S_2)^{1/2})

with (mu, S) the mean and covariance of a feature extractor's outputs over each set; they differ only in the
extractor (Inception-v3 pool3 for FID, Kinetics-400 I3D logits for FVD). This module holds the parts both
share: :func:`frechet_distance` (float64 numpy, ``scipy.linalg.sqrtm``), :class:`FeatureStats` (mean,
covariance, count and provenance, saved as ``.npz``), a cache of real-set statistics keyed by the extractor's
sha256 and the protocol settings (:func:`cached_stats`), and :func:`frechet_report`, the result dict with the
sample-size warnings that :func:`genrl.eval.fvd.fvd` and :func:`genrl.eval.fid.fid` return.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from genrl.data.video_io import atomic_write

__all__ = ["frechet_distance", "FeatureStats", "stats_cache_key", "cached_stats", "frechet_report",
           "module_sha256", "file_sha256", "extractor_identity"]

#: a trace's imaginary part above this fraction of its scale means sqrtm failed (not round-off)
IMAG_TOLERANCE = 1e-3
_STATS_FORMAT = 1


def _as_float64(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_complex():
            raise TypeError(f"{name} must be real, got a complex tensor ({x.dtype})")
        x = x.detach().cpu().double().numpy()
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must be a real float array or tensor, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def _check_gaussian(mu: np.ndarray, sigma: np.ndarray, which: str) -> None:
    if mu.ndim != 1:
        raise ValueError(f"mu{which} must be 1-D [D], got shape {mu.shape}")
    d = mu.shape[0]
    if sigma.shape != (d, d):
        raise ValueError(f"sigma{which} must be [D, D] = [{d}, {d}] to match mu{which}, got shape {sigma.shape}")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"mu{which} / sigma{which} contain NaN or inf; the features they came from are broken "
                         "(check the extractor's input range and weights)")
    if np.abs(sigma - sigma.T).max(initial=0.0) > 1e-6 * np.abs(sigma).max(initial=0.0):
        raise ValueError(f"sigma{which} is not symmetric (max |S - S^T| = {np.abs(sigma - sigma.T).max():.3g}); "
                         "it is not a covariance matrix")


def _sqrt_trace_product(sigma1: np.ndarray, sigma2: np.ndarray) -> np.ndarray:
    """``sqrtm(M)`` with ``Tr sqrtm(M) == Tr sqrtm(sigma1 @ sigma2)``: ``M = R^T sigma2 R``, ``R = V sqrt(W)`` over
    the eigenpairs of ``sigma1`` above round-off (``w > max(w) * D * eps``, numpy's rank tolerance).

    ``sigma1 @ sigma2 = R (R^T sigma2)`` and ``(R^T sigma2) R = M`` share their non-zero eigenvalues, so the
    traces of the square roots agree; ``M`` is symmetric PSD and only as large as the rank of ``sigma1`` (the
    TF-GAN ``trace_sqrt_product`` form of the original FVD code). Dropping the null space of ``sigma1`` keeps
    its round-off eigenvalues (about eps * max(w)) out of the square root, where they would add about
    ``sqrt(eps) * max(w)`` each: with fewer samples than dimensions the plain ``sqrtm(sigma1 @ sigma2)`` is off
    by roughly ``D * 1e-8`` of the scale, this form by about 1e-13.
    """
    import scipy.linalg

    w, v = np.linalg.eigh(0.5 * (sigma1 + sigma1.T))
    top = max(float(w.max()), 0.0)
    if w.min() < -IMAG_TOLERANCE * top:
        raise ValueError(f"sigma1 is not positive semi-definite (eigenvalue {w.min():.6g}, largest {top:.6g}); "
                         "it is not a covariance")
    keep = w > top * w.shape[0] * np.finfo(np.float64).eps
    if not keep.any():
        return np.zeros((1, 1))
    root = v[:, keep] * np.sqrt(w[keep])
    m = root.T @ sigma2 @ root
    return scipy.linalg.sqrtm(0.5 * (m + m.T))


def frechet_distance(mu1: Any, sigma1: Any, mu2: Any, sigma2: Any, eps: float = 1e-6) -> float:
    """The Frechet distance between N(mu1, sigma1) and N(mu2, sigma2) (Heusel et al. 2017, FID eq. 6).

    ``||mu1 - mu2||^2 + Tr(sigma1) + Tr(sigma2) - 2 Tr(sqrtm(sigma1 @ sigma2))`` in float64 numpy, the square
    root by ``scipy.linalg.sqrtm`` (as pytorch-fid and StyleGAN-V). ``Tr sqrtm(sigma1 @ sigma2)`` is taken as
    ``Tr sqrtm(R^T sigma2 R)`` with ``R R^T = sigma1`` on the range of ``sigma1`` (mathematically equal; the
    form of TF-GAN's ``trace_sqrt_product``, which the original FID / FVD code uses): it matches the plain
    product to about 1e-12 relative when ``sigma1`` has full rank and stays accurate to round-off when it does
    not (fewer samples than dimensions), where the plain product's error is about ``D * 1e-8`` of the scale.

    When ``sqrtm`` returns NaN / inf, it is recomputed with ``eps * I`` added to both covariances, as
    pytorch-fid does, with a :class:`RuntimeWarning` saying so. Round-off can leave a tiny imaginary part in
    the trace; it is dropped when below ``1e-3`` of the trace's scale, otherwise the square root has failed
    (e.g. ``sigma2`` is not a covariance) and a ValueError says so.

    Args:
        mu1, mu2: means, float [D] (numpy arrays or tensors of any float dtype; converted to float64).
        sigma1, sigma2: covariances, float [D, D], symmetric positive semi-definite.
        eps: the diagonal offset of the retry.
    Returns:
        the squared distance as a Python float (>= 0 up to round-off; 0 for identical inputs), in squared
        feature units.
    Raises:
        ValueError: mismatched / wrong shapes, asymmetric or NaN / inf inputs, a ``sigma1`` with a clearly
            negative eigenvalue, or a trace whose imaginary part is significant (the message gives it).
        TypeError: non-numeric inputs.
    """
    mu1, mu2 = _as_float64(mu1, "mu1"), _as_float64(mu2, "mu2")
    sigma1, sigma2 = _as_float64(sigma1, "sigma1"), _as_float64(sigma2, "sigma2")
    _check_gaussian(mu1, sigma1, "1")
    _check_gaussian(mu2, sigma2, "2")
    if mu1.shape != mu2.shape:
        raise ValueError(f"the two feature sets have different dimensions: mu1 {mu1.shape} vs mu2 {mu2.shape}; "
                         "they must come from the same extractor")
    diff = mu1 - mu2
    covmean = _sqrt_trace_product(sigma1, sigma2)
    if not np.isfinite(covmean).all():
        warnings.warn(f"frechet_distance: the matrix square root of sigma1 @ sigma2 is not finite; retrying with "
                      f"{eps:g} * I added to both covariances", RuntimeWarning, stacklevel=2)
        offset = np.eye(mu1.shape[0]) * eps
        covmean = _sqrt_trace_product(sigma1 + offset, sigma2 + offset)
        if not np.isfinite(covmean).all():
            raise ValueError(f"sqrtm(sigma1 @ sigma2) is not finite even with eps={eps:g} added to the diagonals; "
                             "the covariances are degenerate (check that the features vary across samples)")
    tr_covmean = np.trace(covmean)
    if np.iscomplexobj(tr_covmean):
        scale = max(abs(tr_covmean.real), 0.5 * (np.trace(sigma1) + np.trace(sigma2)), np.finfo(np.float64).tiny)
        if abs(tr_covmean.imag) > IMAG_TOLERANCE * scale:
            raise ValueError(f"Tr(sqrtm(sigma1 @ sigma2)) has a significant imaginary part {tr_covmean.imag:.6g} "
                             f"(scale {scale:.6g}, tolerance {IMAG_TOLERANCE:g} relative): the matrix square "
                             "root failed; check that both are covariances (symmetric PSD) or use more samples")
        tr_covmean = tr_covmean.real
    value = diff @ diff + np.trace(sigma1) + np.trace(sigma2) - 2.0 * float(tr_covmean)
    return float(value)


def _canonical_json(obj: Any) -> str:
    """Canonical JSON (sorted keys, no spaces); tuples become lists. TypeError names what is not JSON."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{obj!r} is not plain JSON data (str, int, float, bool, None, lists and dicts): {err}") \
            from None


@dataclass
class FeatureStats:
    """Mean, covariance and count of a feature set, with the provenance that makes it comparable.

    Attributes:
        mu: float64 [D], the feature mean.
        sigma: float64 [D, D], the unbiased covariance (divides by n - 1, as ``np.cov`` and torchmetrics do).
        n: number of feature vectors (clips or images).
        meta: JSON-serialisable provenance (extractor name and sha256, protocol settings, counts).
    Raises:
        ValueError: shapes that disagree, NaN / inf, or n < 2.
    """

    mu: np.ndarray
    sigma: np.ndarray
    n: int
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mu = _as_float64(self.mu, "mu")
        self.sigma = _as_float64(self.sigma, "sigma")
        _check_gaussian(self.mu, self.sigma, "")
        if isinstance(self.n, bool) or int(self.n) != self.n or self.n < 2:
            raise ValueError(f"n must be an int >= 2 (a Frechet distance needs at least 2 samples), got {self.n!r}")
        self.n = int(self.n)
        self.meta = dict(self.meta)

    @property
    def dim(self) -> int:
        """D, the feature dimension."""
        return int(self.mu.shape[0])

    @classmethod
    def from_features(cls, feats: Any, meta: Mapping[str, Any] | None = None) -> FeatureStats:
        """Float64 mean and unbiased covariance of ``feats``.

        Args:
            feats: [N, D] features, a tensor of any float dtype (bf16 included) or a numpy array.
            meta: provenance to keep with the statistics.
        Raises:
            ValueError: not 2-D, N < 2 (a Frechet distance needs at least 2 samples), or NaN / inf features.
        """
        if isinstance(feats, torch.Tensor):
            feats = feats.detach().cpu().double().numpy()
        x = np.asarray(feats, dtype=np.float64)
        if x.ndim != 2:
            raise ValueError(f"features must be [N, D], got shape {x.shape}")
        if x.shape[0] < 2:
            raise ValueError(f"got N={x.shape[0]} feature vectors; a Frechet distance needs at least 2 samples "
                             "per set (the covariance of fewer is undefined)")
        if not np.isfinite(x).all():
            bad = int((~np.isfinite(x)).any(axis=1).sum())
            raise ValueError(f"{bad} of {x.shape[0]} feature vectors contain NaN or inf; check the extractor's "
                             "input range and weights")
        mu = x.mean(axis=0)
        centred = x - mu
        sigma = centred.T @ centred / (x.shape[0] - 1)
        return cls(mu=mu, sigma=sigma, n=x.shape[0], meta=dict(meta or {}))

    def save(self, path: str | Path) -> Path:
        """Write ``mu``, ``sigma``, ``n`` and ``meta`` (a JSON string) to an ``.npz`` file, atomically
        (:func:`genrl.data.video_io.atomic_write`). Returns the path. TypeError if ``meta`` is not JSON data."""
        meta_json = _canonical_json(self.meta)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:  # a file object: np.savez would append ".npz" to a bare temp name
                np.savez(f, mu=self.mu, sigma=self.sigma, n=np.int64(self.n), meta=np.array(meta_json),
                         format=np.int64(_STATS_FORMAT))

        return atomic_write(path, write)

    @classmethod
    def load(cls, path: str | Path) -> FeatureStats:
        """Read statistics written by :meth:`save`.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file lacks a field or is not a statistics file (the message names it).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no feature statistics file at {str(path)!r}")
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("mu", "sigma", "n", "meta") if k not in data.files]
            if missing:
                raise ValueError(f"{str(path)!r} is not a genrl feature statistics file (missing {missing}); "
                                 "delete it so it is recomputed")
            return cls(mu=data["mu"], sigma=data["sigma"], n=int(data["n"]), meta=json.loads(str(data["meta"])))


def stats_cache_key(extractor_sha256: str, settings: Mapping[str, Any]) -> str:
    """sha256 hex digest of the canonical JSON of ``{"extractor_sha256": ..., "settings": ...}``.

    The settings are whatever changes the statistics (frames, stride, resolution, fps policy, N, the data
    set's identity ...); key order does not matter, tuples and lists are the same.

    Raises:
        TypeError: settings that are not plain JSON data.
    """
    return hashlib.sha256(_canonical_json({"extractor_sha256": str(extractor_sha256),
                                           "settings": dict(settings)}).encode()).hexdigest()


def cached_stats(cache_dir: str | Path, extractor_sha256: str, settings: Mapping[str, Any],
                 compute: Callable[[], FeatureStats]) -> FeatureStats:
    """Statistics from ``cache_dir/<stats_cache_key(...)>.npz`` if that file exists and its recorded key inputs
    match, else ``compute()``, saved there (atomically) with ``meta["cache"] = {extractor_sha256, settings}``.

    A file whose recorded inputs differ (edited, or from another version) is recomputed and replaced, with a
    warning.

    Raises:
        TypeError: ``compute`` did not return a :class:`FeatureStats`, or settings that are not JSON data.
    """
    key = stats_cache_key(extractor_sha256, settings)
    expected = {"extractor_sha256": str(extractor_sha256), "settings": json.loads(_canonical_json(dict(settings)))}
    path = Path(cache_dir) / f"{key}.npz"
    if path.is_file():
        stats = FeatureStats.load(path)
        if _canonical_json(stats.meta.get("cache")) == _canonical_json(expected):
            return stats
        warnings.warn(f"cached statistics {str(path)!r} were computed for other settings; recomputing",
                      RuntimeWarning, stacklevel=2)
    stats = compute()
    if not isinstance(stats, FeatureStats):
        raise TypeError(f"compute() must return a FeatureStats, got {type(stats).__name__}")
    stats = FeatureStats(mu=stats.mu, sigma=stats.sigma, n=stats.n, meta={**stats.meta, "cache": expected})
    stats.save(path)
    return stats


def frechet_report(real: FeatureStats, fake: FeatureStats, *, metric: str, warn_below: int,
                   comparable_min: int, standard: str) -> dict[str, Any]:
    """The Frechet distance between two statistics with the facts needed to read it.

    Returns ``{metric: float, "n_real", "n_fake", "extractor", "extractor_sha256", "comparable", "warnings"}``:
    ``comparable`` is False when either set has fewer than ``comparable_min`` samples (the estimate's bias
    dominates, so the number must not be compared with published ones); ``warnings`` lists, and
    :func:`warnings.warn` also emits, one line per set below ``warn_below`` samples (the estimator is biased
    upward at small N, Chong & Forsyth 2020). ``standard`` describes the reference protocol for the message.

    Raises:
        ValueError: the two statistics come from different extractors (sha256) or different protocol settings
            (the message lists the differing keys), or have different dimensions.
    """
    for which, s in (("real", real), ("fake", fake)):
        if not isinstance(s, FeatureStats):
            raise TypeError(f"{which} must be a FeatureStats, got {type(s).__name__}")
    sha_r, sha_f = real.meta.get("extractor_sha256"), fake.meta.get("extractor_sha256")
    if sha_r and sha_f and sha_r != sha_f:
        raise ValueError(f"real and fake statistics come from different extractors ({real.meta.get('extractor')} "
                         f"sha256 {sha_r[:12]} vs {fake.meta.get('extractor')} sha256 {sha_f[:12]}); a "
                         f"{metric.upper()} across extractors is meaningless: recompute one set")
    set_r, set_f = real.meta.get("settings"), fake.meta.get("settings")
    if isinstance(set_r, dict) and isinstance(set_f, dict):
        ignored = {"warn_below", "comparable_min"}
        differ = sorted(k for k in set(set_r) & set(set_f) - ignored if set_r[k] != set_f[k])
        if differ:
            detail = ", ".join(f"{k}: {set_r[k]!r} vs {set_f[k]!r}" for k in differ)
            raise ValueError(f"real and fake statistics were computed with different settings ({detail}); "
                             "recompute one set with the other's settings")
    value = frechet_distance(real.mu, real.sigma, fake.mu, fake.sigma)
    notes = []
    for which, s in (("real", real), ("fake", fake)):
        if s.n < warn_below:
            notes.append(f"{metric.upper()} is biased upward at N={s.n} ({which} set); {standard}")
    for note in notes:
        warnings.warn(note, UserWarning, stacklevel=3)
    return {
        metric: value,
        "n_real": real.n,
        "n_fake": fake.n,
        "extractor": real.meta.get("extractor", fake.meta.get("extractor")),
        "extractor_sha256": sha_r or sha_f,
        "comparable": min(real.n, fake.n) >= comparable_min,
        "warnings": notes,
    }


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 hex digest of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def module_sha256(module: nn.Module) -> str:
    """sha256 of a module's state dict: each entry's name, dtype, shape and raw bytes, in key order.

    Two modules with equal weights (and buffers) get the same hash whatever their device; any weight change
    changes it. For an extractor that has no file to hash.
    """
    h = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def extractor_identity(extractor: Any) -> tuple[str, str]:
    """``(name, sha256)`` of a feature extractor: its ``name`` attribute (else its class name) and its ``sha256``
    attribute, else :func:`module_sha256` of it when it is an ``nn.Module``.

    Raises:
        ValueError: no ``sha256`` attribute and not an ``nn.Module`` (set ``extractor.sha256`` to identify it).
    """
    name = getattr(extractor, "name", None) or type(extractor).__name__
    sha = getattr(extractor, "sha256", None)
    if sha is None and isinstance(extractor, nn.Module):
        sha = module_sha256(extractor)
    if not sha:
        raise ValueError(f"cannot identify the extractor {name!r}: it has no sha256 attribute and is not an "
                         "nn.Module; set extractor.sha256 (e.g. the weights file's hash) so statistics can be "
                         "cached and compared")
    return str(name), str(sha)
