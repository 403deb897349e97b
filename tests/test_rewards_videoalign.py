"""VideoReward (VideoAlign) through the real loading and scoring path, on tiny random checkpoints."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from genrl.rewards import available_rewards, build_reward
from genrl.rewards.videoalign import VideoAlignReward, build_prompt, mrope_position_ids
from genrl.testing.rewards import TINY_VIDEOALIGN_STATS as TINY_STATS
from genrl.testing.rewards import build_tiny_videoalign as build_tiny

PROMPTS = ["a red circle moving left", "a blue square staying still"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("videoalign") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def reward(tiny):
    return build_reward("videoalign", path=tiny, base_model=f"{tiny}/Qwen2-VL-2B-Instruct")


def _video(b=2, t=8, h=16, w=16, seed=0):
    return torch.rand(b, t, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _raw_logits(reward, pixels, prompts, **meta):
    """Raw (VQ, MQ, TA) logits read off the head with a forward hook."""
    seen = []
    handle = reward._head.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    try:
        out = reward(pixels, prompts, **meta)
    finally:
        handle.remove()
    (head,) = seen  # [B, 3 tokens, output_dim]
    raw = head.diagonal(dim1=1, dim2=2) if head.shape[-1] == 3 else head[..., 0]
    return out, raw.float()


# ------------------------------------------------------------------------------------------------ reference maths
def _ref_nframes(total, video_fps, fps):
    """qwen-vl-utils smart_nframes (fps branch), written out from the reference."""
    min_frames = math.ceil(4 / 2) * 2
    max_frames = math.floor(min(768, total) / 2) * 2
    n = total / video_fps * fps
    n = min(max(n, min_frames), max_frames)
    n = round(n / 2) * 2
    return min(n, total)


def _ref_resize(h, w, factor, min_pixels, max_pixels):
    """qwen-vl-utils smart_resize."""
    hb, wb = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


# -------------------------------------------------------------------------------------------------------- tests
def test_registered_and_scores(reward):
    assert "videoalign" in available_rewards()
    assert isinstance(reward, VideoAlignReward) and reward.differentiable
    assert reward.output_dim == 1 and reward.standardized
    out = reward(_video(), PROMPTS)
    assert set(out) == {"reward", "vq", "mq", "ta", "valid"}
    for key in ("reward", "vq", "mq", "ta"):
        assert out[key].shape == (2,) and out[key].dtype == torch.float32 and torch.isfinite(out[key]).all()
    assert out["valid"].all()
    assert not any(p.requires_grad for p in reward.parameters())


def test_standardisation_and_combination(reward):
    x = _video(seed=1)
    out, raw = _raw_logits(reward, x, PROMPTS)
    means = torch.tensor([TINY_STATS[f"{k}_mean"] for k in ("VQ", "MQ", "TA")])
    stds = torch.tensor([TINY_STATS[f"{k}_std"] for k in ("VQ", "MQ", "TA")])
    z = (raw - means) / stds
    for i, key in enumerate(("vq", "mq", "ta")):
        torch.testing.assert_close(out[key], z[:, i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["reward"], z.sum(1), rtol=1e-5, atol=1e-5)
    assert reward.stats["ta"] == (TINY_STATS["TA_mean"], TINY_STATS["TA_std"])


def test_weights_scale_and_raw_option(tiny):
    x = _video(seed=2)
    plain = build_reward("videoalign", path=tiny, standardize=False, weights={"ta": 1.0}, scale=2.0, shift=1.0)
    out, raw = _raw_logits(plain, x, PROMPTS)
    torch.testing.assert_close(out["vq"], raw[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["reward"], 2.0 * raw[:, 2] + 1.0, rtol=1e-5, atol=1e-5)


def test_prompt_changes_ta_only(reward):
    """The prompt comes after the VQ and MQ tokens, so (causal attention) only TA can depend on it."""
    x = _video(b=1, seed=3).expand(2, -1, -1, -1, -1)
    out = reward(x, ["a red circle moving left", "a green triangle moving up then down quickly"])
    assert abs(float(out["ta"][0] - out["ta"][1])) > 1e-4
    torch.testing.assert_close(out["vq"][0], out["vq"][1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["mq"][0], out["mq"][1], rtol=1e-5, atol=1e-5)
    # pixels matter too
    other = reward(_video(b=1, seed=4), [PROMPTS[0]])
    assert abs(float(other["vq"][0] - out["vq"][0])) > 1e-4


def test_reload_and_layouts_identical(tiny, reward, tmp_path):
    x = _video(seed=5)
    ref = reward(x, PROMPTS)
    again = build_reward("videoalign", path=tiny)  # default base model location
    full = build_reward("videoalign", path=build_tiny(tmp_path / "full", seed=0, layout="full"))
    for other in (again, full):
        out = other(x, PROMPTS)
        for key in ("reward", "vq", "mq", "ta"):
            torch.testing.assert_close(out[key], ref[key], rtol=0, atol=1e-6)


def test_output_dim_3_reads_the_diagonal(tmp_path):
    r3 = build_reward("videoalign", path=build_tiny(tmp_path / "d3", seed=1, output_dim=3))
    assert r3.output_dim == 3
    out, raw = _raw_logits(r3, _video(seed=6), PROMPTS)
    torch.testing.assert_close(out["mq"], (raw[:, 1] - TINY_STATS["MQ_mean"]) / TINY_STATS["MQ_std"],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,h,w,fps", [(8, 16, 16, 8.0), (16, 30, 50, 4.0), (5, 8, 8, 30.0), (3, 12, 6, 8.0),
                                       (40, 4, 4, 8.0), (24, 64, 20, 2.0)])
def test_preprocess_matches_reference_formulas(reward, t, h, w, fps):
    factor, lo, hi = 4, 8 * 8, 24 * 24  # tiny: patch 2 x merge 2; model_config.json frame pixels
    assert (reward.factor, reward.min_pixels, reward.max_pixels) == (factor, lo, hi)
    n = _ref_nframes(t, fps, 2.0)
    frames = torch.linspace(0, t - 1, n).round().long().tolist()
    rh, rw = _ref_resize(h, w, factor, lo, hi)
    gt, gh, gw = math.ceil(n / 2), rh // 2, rw // 2
    vin = reward.preprocess(torch.rand(2, t, 3, h, w), video_fps=fps)
    assert vin.frames == frames and vin.size == (rh, rw)
    assert vin.grid_thw.tolist() == [[gt, gh, gw]] * 2
    assert tuple(vin.pixel_values.shape) == (2 * gt * gh * gw, 3 * 2 * 2 * 2)


def test_one_frame_repeats(reward):
    vin = reward.preprocess(torch.rand(1, 1, 3, 16, 16))
    assert vin.frames == [0] and vin.grid_thw.tolist() == [[1, 8, 8]]
    assert torch.isfinite(reward(torch.rand(1, 1, 3, 16, 16), ["x"])["reward"]).all()


def test_matches_transformers_processor_and_model(reward):
    """Same frames through the Qwen2-VL processor (chat template, token expansion, rescale, normalise, patchify)
    and the model's own M-RoPE give the same inputs and logits (here grid_t <= grid_h / 2, where transformers'
    rope offsets agree with the reference's)."""
    x = _video(seed=7)
    vin = reward.preprocess(x)
    frames = x[:, vin.frames]
    assert tuple(frames.shape[-2:]) == vin.size  # 16 x 16 needs no resize
    convs = [[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": build_prompt(p)}]}]
             for p in PROMPTS]
    texts = reward.processor.apply_chat_template(convs, tokenize=False, add_generation_prompt=True)
    reward.tokenizer.padding_side = "right"
    batch = reward.processor(text=texts, videos=[f * 255 for f in frames], padding=True, return_tensors="pt",
                             videos_kwargs={"do_rescale": True, "cap_pixels_per_frame": False})
    torch.testing.assert_close(batch["pixel_values_videos"], vin.pixel_values, rtol=1e-5, atol=1e-5)
    assert torch.equal(batch["video_grid_thw"], vin.grid_thw)
    ids, mask = reward.encode_text(PROMPTS, int(vin.grid_thw[0].prod()) // 4)
    assert torch.equal(batch["input_ids"], ids) and torch.equal(batch["attention_mask"], mask)
    with torch.no_grad():
        hs = reward._qwen(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          pixel_values_videos=batch["pixel_values_videos"], video_grid_thw=batch["video_grid_thw"],
                          mm_token_type_ids=batch["mm_token_type_ids"], use_cache=False).last_hidden_state
        logits = reward._head(hs)  # reference pooling: the three reward tokens in sequence order
        special = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
        for tid in reward.reward_token_ids:
            special |= batch["input_ids"] == tid
        ref = logits[special].view(2, 3, -1)[..., 0]
        mine = reward.logits(x, PROMPTS)
    torch.testing.assert_close(mine, ref.float(), rtol=1e-5, atol=1e-5)


def test_mrope_positions_follow_the_reference():
    # 2 text tokens, a video with grid (t=3, h=2, w=2) after merge 2 (raw 3 x 4 x 4), 2 text tokens, 1 pad
    v = 9
    ids = torch.tensor([[1, 2] + [v] * 12 + [3, 4, 0]])
    mask = torch.tensor([[1] * 16 + [0]])
    pos = mrope_position_ids(ids, mask, torch.tensor([[3, 4, 4]]), v, 2)
    assert pos[:, 0, :2].tolist() == [[0, 1]] * 3
    video = pos[:, 0, 2:14]
    assert video[0].tolist() == [2] * 4 + [3] * 4 + [4] * 4  # t
    assert video[1].tolist() == [2, 2, 3, 3] * 3  # h
    assert video[2].tolist() == [2, 3, 2, 3] * 3  # w
    assert pos[:, 0, 14:16].tolist() == [[5, 6]] * 3  # offset 2 + max(t, h, w) = 5
    assert pos[:, 0, 16].tolist() == [1, 1, 1]


def test_saliency_reaches_sampled_frames(reward):
    x = _video(seed=8)
    maps = reward.saliency(x, PROMPTS, dims=("vq", "mq", "ta"), fps=8)
    assert set(maps) == {"vq", "mq", "ta"}
    sampled = reward.preprocess(x).frames  # [0, 2, 5, 7]
    skipped = [i for i in range(8) if i not in sampled]
    for m in maps.values():
        assert m.shape == (2, 8, 16, 16) and torch.isfinite(m).all()
        assert (m[:, sampled].flatten(1).amax(1) > 0).all()
        assert (m[:, skipped] == 0).all()


def test_fps_per_video(reward):
    x = _video(seed=9)
    both = reward(x, PROMPTS, fps=[8, 2])
    first = reward(x[:1], PROMPTS[:1], fps=8)
    second = reward(x[1:], PROMPTS[1:], fps=2.0)
    torch.testing.assert_close(both["reward"], torch.cat([first["reward"], second["reward"]]), rtol=1e-5, atol=1e-5)
    assert reward.preprocess(x, video_fps=2).frames == list(range(8))  # 8 frames at 2 fps: all of them


def test_nan_video_is_invalid_alone(reward):
    x = _video(seed=10)
    x[0, 3, 0, 2, 2] = float("nan")
    out = reward(x, PROMPTS)
    assert out["valid"].tolist() == [False, True] and torch.isnan(out["reward"][0])
    alone = reward(x[1:], PROMPTS[1:])
    torch.testing.assert_close(out["reward"][1:], alone["reward"], rtol=1e-5, atol=1e-5)


def test_prompt_with_reward_token_is_rejected(reward):
    with pytest.raises(ValueError, match="must not contain"):
        reward(_video(b=1), ["sneaky <|TA_reward|>"])


@pytest.mark.parametrize("victim,name", [
    ("model_config.json", "model_config.json"),
    ("checkpoint-2/adapter_model.safetensors", "adapter_model.safetensors"),
    ("checkpoint-2/non_lora_state_dict.pth", "non_lora_state_dict.pth"),
    ("Qwen2-VL-2B-Instruct", "Qwen2-VL-2B-Instruct"),
    ("Qwen2-VL-2B-Instruct/config.json", "config.json"),
])
def test_missing_files_are_named(tiny, tmp_path, victim, name):
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny, copy)
    target = copy / victim
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(FileNotFoundError, match=name):
        build_reward("videoalign", path=str(copy))


def test_missing_base_model_argument_and_path(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="base model folder"):
        build_reward("videoalign", path=tiny, base_model=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="not a folder"):
        build_reward("videoalign", path=str(tmp_path / "nowhere"))


def test_encode_text_repeated_prompts_match_distinct_encoding(reward):
    """A group of repeated prompts (GRPO) encodes each row exactly as the prompt alone, in the input order."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    ids, mask = reward.encode_text(prompts, 5)
    for i, p in enumerate(prompts):
        one_ids, one_mask = reward.encode_text([p], 5)
        n = one_ids.shape[1]
        assert torch.equal(ids[i, :n], one_ids[0]) and torch.equal(mask[i, :n], one_mask[0])
        assert not mask[i, n:].any()
