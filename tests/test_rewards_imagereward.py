"""ImageReward ("imagereward"): tiny random weights in the real on-disk layout, loaded through the same checks,
key converter and scoring path as the real checkpoint; an independent functional forward written from BLIP's
vit.py / med.py semantics on the ORIGINAL key names checks the converter."""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from genrl.rewards import build_reward
from genrl.rewards.image_reward import (
    CHECKPOINT_FILE,
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    MED_CONFIG_FILE,
    TOKENIZER_DIR,
    ImageRewardBLIP,
    convert_state_dict,
    original_key,
)
from genrl.testing.rewards import build_tiny_imagereward

PROMPTS = ["a photo of a cat", "a red car in the city at sunset"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_imagereward(tmp_path_factory.mktemp("imagereward"), seed=0)


@pytest.fixture(scope="module")
def reward(tiny_folder):
    return build_reward("imagereward", path=str(tiny_folder))


def _pixels(b=2, t=3, h=40, w=56, seed=0):
    return torch.rand(b, t, 3, h, w, generator=torch.Generator().manual_seed(seed))


def _copy(tiny_folder, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_folder, dst)
    return dst


def test_scores_video_batch(reward):
    out = reward(_pixels(), PROMPTS)
    assert set(out) == {"reward", "raw", "valid"}
    assert out["reward"].shape == (2,) and out["reward"].dtype == torch.float32
    assert torch.isfinite(out["reward"]).all() and out["valid"].all()
    assert torch.allclose(out["reward"], (out["raw"] - IMAGEREWARD_MEAN) / IMAGEREWARD_STD, atol=1e-6)
    assert reward.differentiable and reward.image_size == 32 and not reward.training
    reward.train()
    assert not any(m.training for m in (reward.vision, reward.text, reward.head))  # dropout stays off
    assert torch.equal(reward(_pixels(), PROMPTS)["reward"], out["reward"])
    reward.eval()


def test_prompt_changes_score_and_nan_is_invalid(reward):
    x = _pixels()
    a = reward(x, PROMPTS)["reward"]
    b = reward(x, PROMPTS[::-1])["reward"]
    assert (a - b).abs().min() > 1e-4
    x[1, 0, 0, 0, 0] = float("nan")
    out = reward(x, PROMPTS)
    assert out["valid"].tolist() == [True, False] and math.isnan(out["reward"][1])


def test_reload_is_identical(tiny_folder, reward, tmp_path):
    x = _pixels(seed=1)
    again = ImageRewardBLIP(path=tiny_folder)
    assert torch.equal(reward(x, PROMPTS)["reward"], again(x, PROMPTS)["reward"])
    rebuilt = ImageRewardBLIP(path=build_tiny_imagereward(tmp_path / "rebuilt", seed=0))  # seeded
    assert torch.equal(reward(x, PROMPTS)["reward"], rebuilt(x, PROMPTS)["reward"])


def test_gradient_reaches_pixels(reward):
    x = _pixels(t=2)
    maps = reward.saliency(x, PROMPTS)["reward"]
    assert maps.shape == (2, 2, 40, 56) and torch.isfinite(maps).all()
    assert (maps.flatten(1).sum(1) > 0).all()
    assert all(p.grad is None for p in reward.parameters())


def test_tokenizer_matches_blip_init(reward):
    ids, mask = reward.tokenize(["A Photo of a CAT"])
    tok = reward.tokenizer
    assert ids.shape == (1, 35) and mask.shape == (1, 35)
    assert ids[0, 0] == tok.cls_token_id  # ImageReward keeps [CLS] first (no [ENC] substitution)
    assert ids[0, 1:5].tolist() == tok.convert_tokens_to_ids(["a", "photo", "of", "a"])  # lower-cased
    n = reward.text.config.vocab_size
    assert tok.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [n - 2, n - 1] and tok.bos_token == "[DEC]"


def test_score_equals_manual_forward_through_converted_modules(reward):
    x = _pixels(b=2, t=2)
    out = reward(x, PROMPTS)
    per_frame = []
    with torch.no_grad():
        for t in range(2):
            pv = reward.preprocess(x[:, t])
            ids, mask = reward.tokenize(PROMPTS)
            img = reward.vision(pixel_values=pv).last_hidden_state
            txt = reward.text(input_ids=ids, attention_mask=mask, encoder_hidden_states=img).last_hidden_state
            per_frame.append((reward.head(txt[:, 0]).squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
    assert torch.allclose(out["reward"], torch.stack(per_frame, 1).mean(1), atol=1e-5, rtol=0)


def _reference_forward(sd, pixel_values, ids, mask, v_heads, t_heads):
    """BLIP ViT (timm names, LayerNorm eps 1e-6) + med.py BERT (-10000 padding mask, cross-attention in every
    layer) + ImageReward's MLP, written from the original checkpoint's key names only."""

    def ln(x, p, eps):
        return F.layer_norm(x, x.shape[-1:], sd[p + ".weight"], sd[p + ".bias"], eps)

    def lin(x, p):
        return F.linear(x, sd[p + ".weight"], sd[p + ".bias"])

    def attend(q, k, v, heads, bias=None):
        b, n, d = q.shape
        q, k, v = (z.reshape(b, z.shape[1], heads, d // heads).transpose(1, 2) for z in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(d // heads)
        if bias is not None:
            s = s + bias
        return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)

    vp = "blip.visual_encoder."
    w = sd[vp + "patch_embed.proj.weight"]
    x = F.conv2d(pixel_values, w, sd[vp + "patch_embed.proj.bias"], stride=w.shape[-1]).flatten(2).transpose(1, 2)
    x = torch.cat([sd[vp + "cls_token"].expand(x.shape[0], -1, -1), x], 1) + sd[vp + "pos_embed"]
    n_blocks = len({k.split(".")[3] for k in sd if k.startswith(vp + "blocks.")})
    for i in range(n_blocks):
        p = f"{vp}blocks.{i}."
        h = ln(x, p + "norm1", 1e-6)
        q, k, v = lin(h, p + "attn.qkv").chunk(3, dim=-1)
        x = x + lin(attend(q, k, v, v_heads), p + "attn.proj")
        x = x + lin(F.gelu(lin(ln(x, p + "norm2", 1e-6), p + "mlp.fc1")), p + "mlp.fc2")
    img = ln(x, vp + "norm", 1e-6)

    tp = "blip.text_encoder."
    h = sd[tp + "embeddings.word_embeddings.weight"][ids]
    h = h + sd[tp + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = ln(h, tp + "embeddings.LayerNorm", 1e-12)
    bias = (1.0 - mask[:, None, None, :].float()) * -10000.0
    n_layers = len({k.split(".")[4] for k in sd if k.startswith(tp + "encoder.layer.")})
    for i in range(n_layers):
        p = f"{tp}encoder.layer.{i}."
        a = attend(lin(h, p + "attention.self.query"), lin(h, p + "attention.self.key"),
                   lin(h, p + "attention.self.value"), t_heads, bias)
        h = ln(lin(a, p + "attention.output.dense") + h, p + "attention.output.LayerNorm", 1e-12)
        a = attend(lin(h, p + "crossattention.self.query"), lin(img, p + "crossattention.self.key"),
                   lin(img, p + "crossattention.self.value"), t_heads)
        h = ln(lin(a, p + "crossattention.output.dense") + h, p + "crossattention.output.LayerNorm", 1e-12)
        f = lin(F.gelu(lin(h, p + "intermediate.dense")), p + "output.dense")
        h = ln(f + h, p + "output.LayerNorm", 1e-12)
    y = h[:, 0]
    for i in (0, 2, 4, 6, 7):
        y = lin(y, f"mlp.layers.{i}")
    return y.squeeze(-1)


def test_converter_matches_independent_reference_forward(tiny_folder, reward):
    sd = torch.load(tiny_folder / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    images = _pixels(b=2, t=1, h=48, w=36, seed=3)[:, 0]
    pv = reward.preprocess(images)
    ids, mask = reward.tokenize(PROMPTS)
    assert mask[0].sum() < mask[1].sum() < 35  # both prompts padded, of different lengths
    with torch.no_grad():
        ref = _reference_forward(sd, pv, ids, mask, v_heads=2, t_heads=2)
        got = reward.score_images(images, PROMPTS)
    assert torch.allclose(got["raw"], ref, atol=1e-5, rtol=0)
    assert torch.allclose(got["reward"], (ref - IMAGEREWARD_MEAN) / IMAGEREWARD_STD, atol=1e-5, rtol=0)


def test_converter_is_strict(tiny_folder, tmp_path):
    sd = torch.load(tiny_folder / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
    key = "blip.visual_encoder.blocks.1.attn.qkv.weight"
    assert original_key("vision.encoder.layers.1.self_attn.qkv.weight") == key
    folder = _copy(tiny_folder, tmp_path)

    renamed = dict(sd)
    renamed["blip.visual_encoder.blocks.1.attn.qkv_x.weight"] = renamed.pop(key)
    torch.save(renamed, folder / CHECKPOINT_FILE)
    with pytest.raises(KeyError, match=r"qkv_x\.weight.*missing key\(s\).*blocks\.1\.attn\.qkv\.weight"):
        ImageRewardBLIP(path=folder)

    missing = dict(sd)
    del missing["blip.text_encoder.encoder.layer.1.crossattention.self.key.bias"]
    torch.save(missing, folder / CHECKPOINT_FILE)
    with pytest.raises(KeyError, match=r"crossattention\.self\.key\.bias"):
        ImageRewardBLIP(path=folder)

    extra_block = dict(sd)  # a key in rule form but absent from the model: a third ViT block
    extra_block["blip.visual_encoder.blocks.2.norm1.weight"] = torch.ones(128)
    with pytest.raises(KeyError, match=r"unexpected key\(s\).*blocks\.2\.norm1\.weight"):
        convert_state_dict(extra_block, expected={k for k in ImageRewardBLIP(path=tiny_folder).state_dict()})
    with pytest.raises(KeyError, match="foo.bar"):
        convert_state_dict({**sd, "foo.bar": torch.zeros(1)})


@pytest.mark.parametrize("remove", [None, CHECKPOINT_FILE, MED_CONFIG_FILE, TOKENIZER_DIR])
def test_missing_files_are_named(tiny_folder, tmp_path, remove):
    if remove is None:
        with pytest.raises(FileNotFoundError, match=r"(?s)not a folder.*ImageReward\.pt.*med_config\.json"):
            build_reward("imagereward", path=str(tmp_path / "nowhere"))
        with pytest.raises(FileNotFoundError, match="no path given"):
            ImageRewardBLIP(path=None)
        return
    folder = _copy(tiny_folder, tmp_path)
    target = folder / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    expected = "bert-base-uncased/vocab.txt" if remove == TOKENIZER_DIR else remove
    with pytest.raises(FileNotFoundError, match="MISSING " + re.escape(expected)):
        ImageRewardBLIP(path=folder)


def test_tokenizer_path_elsewhere(tiny_folder, reward, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    tok = tmp_path / "tok"
    shutil.move(str(folder / TOKENIZER_DIR), tok)
    moved = ImageRewardBLIP(path=folder, tokenizer_path=tok)
    x = _pixels(t=1)
    assert torch.equal(moved(x, PROMPTS)["reward"], reward(x, PROMPTS)["reward"])
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        ImageRewardBLIP(path=folder, tokenizer_path=tmp_path / "absent")
