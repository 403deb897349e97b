"""CLIP-family rewards (clipscore, pickscore, aesthetic, hpsv2) on tiny random models written by
genrl.testing.rewards.build_tiny and loaded through the real ``path=`` loading code (offline; no downloads)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from genrl.rewards.clip_rewards import (
    AESTHETIC_HEAD_FILE,
    HPS_FILE,
    AestheticMLP,
    AestheticReward,
    CLIPScoreReward,
    HPSv2Reward,
    PickScoreReward,
)
from genrl.rewards.preprocess import clip_preprocess
from genrl.rewards.registry import build_reward, get_reward_class
from genrl.testing.rewards import build_tiny

CLASSES = {"clipscore": CLIPScoreReward, "pickscore": PickScoreReward, "aesthetic": AestheticReward,
           "hpsv2": HPSv2Reward}
#: the key that must react to the prompt and carry a gradient (clipscore's reward is clipped at 0, so a random
#: tiny model with a negative cosine has zero reward and zero gradient: its raw cosine is checked instead)
TEXT_KEY = {"clipscore": "cosine", "pickscore": "reward", "aesthetic": None, "hpsv2": "reward"}
#: (a weights file to delete, the weight_files entry the error must name)
MAIN_FILE = {"clipscore": ("model.safetensors", "model*.safetensors"),
             "pickscore": ("model.safetensors", "model*.safetensors"),
             "aesthetic": ("clip/model.safetensors", "clip/model*.safetensors"), "hpsv2": (HPS_FILE, HPS_FILE)}
PROMPTS = ["a red circle moving left", "a blue square"]


def _needs(name):
    if name == "hpsv2":
        pytest.importorskip("open_clip")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> folder of a tiny model (built lazily, once per module)."""
    cache = {}

    def get(name):
        _needs(name)
        if name not in cache:
            cache[name] = build_tiny(name, tmp_path_factory.mktemp(name), seed=0)
        return cache[name]

    return get


def _video(b=2, t=3, h=40, w=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, t, 3, h, w, generator=g)


@pytest.mark.parametrize("name", list(CLASSES))
def test_scores_video_batches_through_the_registry(name, folders):
    reward = build_reward(name, path=str(folders(name)))
    assert isinstance(reward, CLASSES[name]) and get_reward_class(name) is CLASSES[name]
    assert reward.differentiable and set(reward.weight_files) and all(reward.weight_files.values())
    video = _video()
    out = reward(video, PROMPTS)
    assert set(out) == set(reward.dimensions) | {"valid"}
    for key in reward.dimensions:
        assert out[key].shape == (2,) and out[key].dtype == torch.float32 and torch.isfinite(out[key]).all(), key
    assert out["valid"].all()
    # the scorer is frozen and stays in eval mode even when a parent switches to train mode
    assert not any(p.requires_grad for p in reward.parameters())
    reward.train()
    assert all(not m.training for m in reward.clip.modules())
    again = reward(video, PROMPTS)
    assert torch.equal(out["reward"], again["reward"])


@pytest.mark.parametrize("name", list(CLASSES))
def test_text_matters_where_it_should(name, folders):
    reward = build_reward(name, path=folders(name))
    video = _video(b=1).expand(2, -1, -1, -1, -1)  # the same video twice
    out = reward(video, ["a red circle", "a green triangle moving up quickly"])
    key = TEXT_KEY[name]
    if key is None:  # aesthetic: prompt-agnostic
        assert torch.allclose(out["reward"][0], out["reward"][1], atol=1e-6)
    else:
        assert (out[key][0] - out[key][1]).abs() > 1e-4


@pytest.mark.parametrize("name", list(CLASSES))
def test_gradient_reaches_the_pixels(name, folders):
    reward = build_reward(name, path=folders(name))
    video = _video(t=2, h=36, w=44)
    key = TEXT_KEY[name] or "reward"
    sal = reward.saliency(video, PROMPTS, dims=[key])[key]
    assert sal.shape == (2, 2, 36, 44)
    assert torch.isfinite(sal).all() and (sal.flatten(1).sum(1) > 0).all()
    assert all(p.grad is None for p in reward.parameters())


@pytest.mark.parametrize("name", list(CLASSES))
def test_reload_and_chunking_give_identical_scores(name, folders):
    video = _video(t=3)
    a = build_reward(name, path=folders(name))(video, PROMPTS)
    b = build_reward(name, path=folders(name), max_batch=2)(video, PROMPTS)  # 6 frames in chunks of 2
    for key in a:
        if key != "valid":
            assert torch.allclose(a[key], b[key], atol=1e-5, rtol=1e-5), key
    c = build_reward(name, path=folders(name))(video, PROMPTS)
    assert all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", list(CLASSES))
def test_missing_folder_or_file_names_the_file(name, folders, tmp_path):
    _needs(name)
    with pytest.raises(FileNotFoundError, match=re.escape(MAIN_FILE[name][1])):
        build_reward(name, path=str(tmp_path / "absent"))
    with pytest.raises(FileNotFoundError, match="no path given"):
        build_reward(name)
    folder = build_tiny(name, tmp_path / "w")
    (folder / MAIN_FILE[name][0]).unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"MISSING {MAIN_FILE[name][1]}")):
        build_reward(name, path=folder)


def test_clipscore_matches_the_closed_form(folders):
    """reward = w * max(cos, 0) with the embeddings of CLIPModel.get_image_features / get_text_features on the
    same torch-preprocessed tensor."""
    from transformers import CLIPModel, CLIPTokenizer

    folder = folders("clipscore")
    reward = build_reward("clipscore", path=folder, w=2.5)
    model = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    tok = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
    video = _video(b=3, t=1, h=50, w=30, seed=3)
    prompts = ["a red circle", "a blue square moving left", "a red circle"]

    def emb(out):
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    with torch.no_grad():
        x = clip_preprocess(video[:, 0], size=model.config.vision_config.image_size)
        img = emb(model.get_image_features(pixel_values=x))
        t = tok(prompts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        txt = emb(model.get_text_features(input_ids=t["input_ids"], attention_mask=t["attention_mask"]))
        cos = F.cosine_similarity(img, txt, dim=-1)
    out = reward(video, prompts)
    assert torch.allclose(out["cosine"], cos, atol=1e-5)
    assert torch.allclose(out["reward"], 2.5 * cos.clamp(min=0), atol=1e-5)
    # the default weight is torchmetrics' 100, and scale / shift act on the main key only
    out100 = build_reward("clipscore", path=folder, scale=0.5, shift=1.0)(video, prompts)
    assert torch.allclose(out100["reward"], 0.5 * 100 * cos.clamp(min=0) + 1.0, atol=1e-4)
    # prompts longer than the 77 text positions are truncated, not rejected
    assert reward(video[:1], ["red " * 200])["valid"].all()


def test_pickscore_is_logit_scale_times_cosine(folders):
    reward = build_reward("pickscore", path=folders("pickscore"), scale=1 / 26)  # Flow-GRPO's setting
    out = reward(_video(), PROMPTS)
    expected = reward.clip.logit_scale.exp() * out["cosine"] / 26
    assert torch.allclose(out["reward"], expected, atol=1e-6)


def test_aesthetic_head_layout_and_vision_only_clip(tmp_path):
    """The MLP's state-dict keys are those of the published sac+logos+ava1-l14-linearMSE.pth (768-d input);
    a CLIPVisionModelWithProjection folder works like a full CLIPModel."""
    sd = AestheticMLP(768).state_dict()
    assert [(k, tuple(v.shape)) for k, v in sd.items()] == [
        ("layers.0.weight", (1024, 768)), ("layers.0.bias", (1024,)), ("layers.2.weight", (128, 1024)),
        ("layers.2.bias", (128,)), ("layers.4.weight", (64, 128)), ("layers.4.bias", (64,)),
        ("layers.6.weight", (16, 64)), ("layers.6.bias", (16,)), ("layers.7.weight", (1, 16)),
        ("layers.7.bias", (1,))]
    from transformers import CLIPModel, CLIPVisionModelWithProjection

    full = build_tiny(AestheticReward, tmp_path / "full", seed=1)
    vis = build_tiny(AestheticReward, tmp_path / "vis", seed=1, vision_only=True)
    # put the full model's vision tower + projection into the vision-only folder
    clip = CLIPModel.from_pretrained(full / "clip", local_files_only=True)
    tower = CLIPVisionModelWithProjection.from_pretrained(vis / "clip", local_files_only=True)
    tower.load_state_dict({k: v for k, v in clip.state_dict().items()
                           if k.startswith(("vision_model.", "visual_projection."))}, strict=True)
    tower.save_pretrained(vis / "clip")
    shutil.copy(full / AESTHETIC_HEAD_FILE, vis / AESTHETIC_HEAD_FILE)
    video = _video()
    a, b = build_reward("aesthetic", path=full)(video, PROMPTS), build_reward("aesthetic", path=vis)(video, PROMPTS)
    assert b["valid"].all() and torch.isfinite(b["reward"]).all()
    assert torch.allclose(a["reward"], b["reward"], atol=1e-6)
    torch.save(AestheticMLP(32).state_dict(), full / AESTHETIC_HEAD_FILE)  # head of the wrong CLIP size
    with pytest.raises(ValueError, match="768"):
        build_reward("aesthetic", path=full)


def test_hpsv2_checkpoint_formats(folders, tmp_path):
    """A bare state dict with a DDP 'module.' prefix loads like the {'state_dict': ...} file; a checkpoint of
    another architecture fails with the key lists."""
    pytest.importorskip("open_clip")

    src = folders("hpsv2")
    video = _video()
    ref = build_reward("hpsv2", path=src)(video, PROMPTS)
    assert torch.allclose(ref["score_x100"], 100 * ref["reward"])
    bare = tmp_path / "bare"
    shutil.copytree(src, bare)
    sd = torch.load(src / HPS_FILE, weights_only=True)["state_dict"]
    torch.save({f"module.{k}": v.half() for k, v in sd.items()}, bare / HPS_FILE)  # fp16 like the real file
    out = build_reward("hpsv2", path=bare)(video, PROMPTS)
    assert torch.allclose(out["reward"], ref["reward"], atol=2e-3)
    torch.save({k: v for k, v in sd.items() if not k.startswith("ln_final")}, bare / HPS_FILE)
    with pytest.raises(RuntimeError, match="missing keys"):
        build_reward("hpsv2", path=bare)
    with pytest.raises(ValueError, match="unknown open_clip architecture"):
        build_reward("hpsv2", path=src, arch="No-Such-Model")
    # prompts longer than the context are truncated by open_clip's tokenizer
    assert build_reward("hpsv2", path=src)(video, ["red " * 200, "blue"])["valid"].all()
