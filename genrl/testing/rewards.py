"""Tiny random reward models in their real on-disk layouts, so that tests go through the real loading code.

Each ``build_tiny_<reward>(folder, seed=0, ...)`` writes a tiny random model of that reward's architecture in exactly
the layout its ``path=`` expects and returns the folder; :func:`build_tiny` picks the builder from a registered reward
name or class (``build_tiny("clipscore", folder)``). Same ``seed`` (and arguments), same files. Moved here from the
reward classes' ``build_tiny`` classmethods and the ``build_tiny`` functions of ``genrl.rewards.image_reward`` /
``genrl.rewards.videoalign``: test fixtures are not part of the reward layer.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from genrl.rewards.base import RewardModel
from genrl.rewards.clip_rewards import (
    AESTHETIC_HEAD_FILE,
    HPS_FILE,
    OPEN_CLIP_CONFIG_FILE,
    AestheticMLP,
    build_open_clip,
)
from genrl.rewards.image_reward import CHECKPOINT_FILE, MED_CONFIG_FILE, TOKENIZER_DIR
from genrl.rewards.preprocess import CLIP_MEAN, CLIP_STD
from genrl.rewards.videoalign import DETAILED_PROMPT, REWARD_TOKENS, current_to_legacy_key, lora_target_names

__all__ = ["build_tiny", "TINY_BUILDERS", "tiny_clip_tokenizer", "tiny_hf_clip_config", "write_tiny_hf_clip",
           "build_tiny_hf_clip", "build_tiny_aesthetic", "TINY_OPEN_CLIP_CFG", "build_tiny_hpsv2",
           "build_tiny_imagereward", "TINY_VIDEOALIGN_STATS", "build_tiny_videoalign"]


# ------------------------------------------------------------------------------------------------- CLIP family
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte-level BPE alphabet: printable bytes map to themselves, the rest to code points >= 256."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), 256))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def tiny_clip_tokenizer():
    """A CLIP tokenizer (transformers ``CLIPTokenizer``) with a byte-level vocabulary and no merges (514 ids:
    256 bytes, 256 word-final bytes, ``<|startoftext|>``, ``<|endoftext|>``): the same tokenizer class and file
    layout as real CLIP folders, without any download."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[])


def tiny_hf_clip_config(vocab_size: int, bos: int, eos: int, pad: int, image_size: int = 32,
                         projection_dim: int = 16):
    from transformers import CLIPConfig

    text = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=77, bos_token_id=bos, eos_token_id=eos,
                pad_token_id=pad)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=image_size, patch_size=8)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)


def write_tiny_hf_clip(folder: Path, seed: int, with_tokenizer: bool = True, vision_only: bool = False) -> None:
    """Save a tiny random transformers CLIP (config.json, model.safetensors, preprocessor_config.json and,
    with ``with_tokenizer``, tokenizer.json / tokenizer_config.json) to ``folder``."""
    from transformers import CLIPImageProcessor, CLIPModel, CLIPVisionModelWithProjection

    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_clip_tokenizer()
    cfg = tiny_hf_clip_config(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if vision_only:
            vcfg = cfg.vision_config
            vcfg.projection_dim = cfg.projection_dim
            model = CLIPVisionModelWithProjection(vcfg)
        else:
            model = CLIPModel(cfg)
    model.save_pretrained(folder)
    size = cfg.vision_config.image_size
    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size},
                       image_mean=list(CLIP_MEAN), image_std=list(CLIP_STD)).save_pretrained(folder)
    if with_tokenizer:
        tok.save_pretrained(folder)


def build_tiny_hf_clip(folder: str | Path, seed: int = 0) -> Path:
    """CLIPScore / PickScore: write a tiny random CLIPModel (2 layers, width 32, 32 px images, 16-d projection,
    77 text positions) with a byte-level CLIP tokenizer to ``folder`` in the layout ``path=`` expects; returns the
    folder."""
    folder = Path(folder)
    write_tiny_hf_clip(folder, seed)
    return folder


def build_tiny_aesthetic(folder: str | Path, seed: int = 0, vision_only: bool = False) -> Path:
    """AestheticReward: write a tiny random CLIP (16-d projection; ``vision_only``: a CLIPVisionModelWithProjection) to
    ``folder/clip`` and a random 16-1024-128-64-16-1 :class:`AestheticMLP` state dict next to it;
    returns the folder."""
    folder = Path(folder)
    write_tiny_hf_clip(folder / "clip", seed, with_tokenizer=False, vision_only=vision_only)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        mlp = AestheticMLP(16)
    torch.save(mlp.state_dict(), folder / AESTHETIC_HEAD_FILE)
    return folder


#: the architecture of :func:`build_tiny_hpsv2` (open_clip model_cfg; vocab 49408 = open_clip's BPE)
TINY_OPEN_CLIP_CFG: dict[str, Any] = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def build_tiny_hpsv2(folder: str | Path, seed: int = 0, model_cfg: dict | None = None) -> Path:
    """HPSv2Reward: write a tiny random open_clip CLIP (``model_cfg``, default :data:`TINY_OPEN_CLIP_CFG`: 2-layer
    towers, width 32, 32 px, 16-d embeddings, open_clip's 49408-token vocabulary) to ``folder`` as
    ``HPS_v2.1_compressed.pt`` (``{"state_dict": ...}``) plus ``open_clip_config.json``; returns the folder.
    Real HPSv2.1 weights use the "ViT-H-14" architecture instead."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(model_cfg or TINY_OPEN_CLIP_CFG)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_open_clip(cfg)
    torch.save({"state_dict": model.state_dict()}, folder / HPS_FILE)
    (folder / OPEN_CLIP_CONFIG_FILE).write_text(json.dumps({"model_cfg": cfg}, indent=2))
    return folder


# ------------------------------------------------------------------------------------------------- ImageReward
_TINY_WORDS = ("a an the of in on with and photo picture painting cat dog horse car tree house red green blue "
               "white black big small sunset mountain city beach portrait astronaut , .").split()


def build_tiny_imagereward(folder: str | Path, seed: int = 0, vision_width: int = 128, text_width: int = 64,
                           layers: int = 2, image_size: int = 32, patch_size: int = 8) -> Path:
    """Write a tiny random ImageReward in the real on-disk layout (see
    :class:`~genrl.rewards.image_reward.ImageRewardBLIP`).

    ``ImageReward.pt`` holds a state dict in the ORIGINAL BLIP key naming (including the unused
    ``vision_proj`` / ``text_proj`` and ``position_ids`` of the real file); ``med_config.json`` is a BertConfig
    in BLIP's format (``encoder_width`` 768 as in the real file, overridden by the ViT width at load);
    ``bert-base-uncased/`` is a WordPiece tokenizer over a small vocabulary (vocab.txt, tokenizer.json,
    tokenizer_config.json). Loading it goes through the same checks, converter and scoring path as real weights.

    Args:
        folder: created if needed. seed: weights are a pure function of it.
        vision_width: ViT width (a multiple of 64: BLIP's head width); text_width: BERT width (2 heads).
        layers: blocks of both encoders. image_size / patch_size: the ViT input (preprocessing follows it).
    Returns:
        the folder.
    """
    from transformers import BertTokenizer

    folder = Path(folder)
    (folder / TOKENIZER_DIR).mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(d: int) -> tuple[Tensor, Tensor]:
        return 1.0 + rnd(d, std=0.1), rnd(d, std=0.1)

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + _TINY_WORDS + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab_size = len(vocab) + 2  # + [DEC], [ENC], as the real 30522 + 2 = 30524
    max_pos = 64
    state: dict[str, Tensor] = {}
    v, t, inter_v, inter_t = vision_width, text_width, 2 * vision_width, 2 * text_width
    pre = "blip.visual_encoder."
    state[pre + "cls_token"] = rnd(1, 1, v)
    state[pre + "pos_embed"] = rnd(1, (image_size // patch_size) ** 2 + 1, v)
    state[pre + "patch_embed.proj.weight"] = rnd(v, 3, patch_size, patch_size, std=0.1)
    state[pre + "patch_embed.proj.bias"] = rnd(v)
    for n in range(layers):
        b = f"{pre}blocks.{n}."
        for name, (i, o) in {"attn.qkv": (v, 3 * v), "attn.proj": (v, v), "mlp.fc1": (v, inter_v),
                             "mlp.fc2": (inter_v, v)}.items():
            state[b + name + ".weight"], state[b + name + ".bias"] = rnd(o, i, std=i**-0.5), rnd(o)
        for name in ("norm1", "norm2"):
            state[b + name + ".weight"], state[b + name + ".bias"] = norm(v)
    state[pre + "norm.weight"], state[pre + "norm.bias"] = norm(v)

    pre = "blip.text_encoder."
    state[pre + "embeddings.word_embeddings.weight"] = rnd(vocab_size, t, std=0.5)
    state[pre + "embeddings.position_embeddings.weight"] = rnd(max_pos, t, std=0.5)
    state[pre + "embeddings.position_ids"] = torch.arange(max_pos).unsqueeze(0)
    state[pre + "embeddings.LayerNorm.weight"], state[pre + "embeddings.LayerNorm.bias"] = norm(t)
    for n in range(layers):
        b = f"{pre}encoder.layer.{n}."
        for att, kv_in in (("attention", t), ("crossattention", v)):
            for name, i in (("self.query", t), ("self.key", kv_in), ("self.value", kv_in), ("output.dense", t)):
                state[f"{b}{att}.{name}.weight"], state[f"{b}{att}.{name}.bias"] = rnd(t, i, std=i**-0.5), rnd(t)
            state[f"{b}{att}.output.LayerNorm.weight"], state[f"{b}{att}.output.LayerNorm.bias"] = norm(t)
        for name, (i, o) in {"intermediate.dense": (t, inter_t), "output.dense": (inter_t, t)}.items():
            state[b + name + ".weight"], state[b + name + ".bias"] = rnd(o, i, std=i**-0.5), rnd(o)
        state[b + "output.LayerNorm.weight"], state[b + "output.LayerNorm.bias"] = norm(t)
    state["blip.vision_proj.weight"], state["blip.vision_proj.bias"] = rnd(16, v), rnd(16)
    state["blip.text_proj.weight"], state["blip.text_proj.bias"] = rnd(16, t), rnd(16)
    widths = (t, 32, 16, 8, 4, 1)
    for idx, (i, o) in zip((0, 2, 4, 6, 7), zip(widths[:-1], widths[1:])):
        state[f"mlp.layers.{idx}.weight"], state[f"mlp.layers.{idx}.bias"] = rnd(o, i, std=i**-0.5), rnd(o, std=0.1)
    torch.save(state, folder / CHECKPOINT_FILE)

    med = {
        "architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1, "hidden_size": t, "initializer_range": 0.02, "intermediate_size": inter_t,
        "layer_norm_eps": 1e-12, "max_position_embeddings": max_pos, "model_type": "bert",
        "num_attention_heads": 2, "num_hidden_layers": layers, "pad_token_id": 0, "type_vocab_size": 2,
        "vocab_size": vocab_size, "encoder_width": 768, "add_cross_attention": True,
    }
    (folder / MED_CONFIG_FILE).write_text(json.dumps(med, indent=2) + "\n")

    tok_dir = folder / TOKENIZER_DIR
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True).save_pretrained(str(tok_dir))
    (tok_dir / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return folder


# ------------------------------------------------------------------------------------------------- VideoAlign
_QWEN2VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
_QWEN2VL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                     "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                     "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
#: statistics written into the tiny VideoAlign model_config.json
TINY_VIDEOALIGN_STATS = {"VQ_mean": 0.25, "VQ_std": 2.0, "MQ_mean": -0.5, "MQ_std": 0.5, "TA_mean": 1.5, "TA_std": 4.0}


def build_tiny_videoalign(folder: str | Path, seed: int = 0, output_dim: int = 1, layout: str = "lora",
                         step: int = 2, hidden_size: int = 32) -> str:
    """Write a tiny random VideoReward in the released on-disk layout; returns ``folder``.

    ``folder/Qwen2-VL-2B-Instruct/`` is a 2-layer Qwen2-VL (hidden ``hidden_size``, a 1-block vision tower with
    2-pixel patches, merge 2: factor 4) saved with the Qwen2-VL-2B file set (config.json, model.safetensors
    with the pre-4.50 key names, a byte-level BPE tokenizer.json with the Qwen2-VL control tokens,
    preprocessor_config.json, chat_template.json). ``folder/model_config.json`` carries the VideoAlign sections
    (fps 2, frame pixels in [64, 576], LoRA r 4, the :data:`TINY_VIDEOALIGN_STATS` statistics) and
    ``folder/checkpoint-<step>/`` either the LoRA layout (``layout="lora"``: adapter_model.safetensors +
    adapter_config.json written by PEFT, non_lora_state_dict.pth with the head and the resized embedding) or
    the released one (``layout="full"``: model.pth). Keys use the legacy (transformers < 4.50) names, like
    VideoAlign's checkpoints. Same ``seed`` (and arguments), same files.
    """
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    if layout not in ("lora", "full"):
        raise ValueError(f"layout must be 'lora' or 'full', got {layout!r}")
    root = Path(folder)
    base = root / "Qwen2-VL-2B-Instruct"
    ckpt = root / f"checkpoint-{step}"
    base.mkdir(parents=True, exist_ok=True)
    ckpt.mkdir(parents=True, exist_ok=True)

    # tokenizer: byte-level BPE trained on the instruction (any text encodes; the template stays short)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(_QWEN2VL_SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([DETAILED_PROMPT, _QWEN2VL_CHAT_TEMPLATE, "You are a helpful assistant."], trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  model_max_length=32768)
    tok.save_pretrained(base)
    ids = {t: bpe.token_to_id(t) for t in _QWEN2VL_SPECIALS}
    (base / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 16, "max_pixels": 64 * 64, "patch_size": 2, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}, indent=2))
    (base / "chat_template.json").write_text(json.dumps({"chat_template": _QWEN2VL_CHAT_TEMPLATE}, indent=2))

    torch.manual_seed(seed)
    vocab = len(tok) + 7  # like Qwen2-VL-2B: the embedding has more rows than the tokenizer
    heads = 4
    cfg = Qwen2VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=hidden_size, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(base)
    weights = load_file(str(base / "model.safetensors"))
    save_file({current_to_legacy_key(k): v.contiguous() for k, v in weights.items()}, str(base / "model.safetensors"),
              metadata={"format": "pt"})

    # the VideoAlign model: reward tokens, resized embedding, head, LoRA
    tok.add_tokens(list(REWARD_TOKENS), special_tokens=True)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.rm_head = torch.nn.Linear(hidden_size, output_dim, bias=False)
    with torch.no_grad():
        model.model.language_model.embed_tokens.weight[-3:].normal_(0.0, 1.0)
        model.rm_head.weight.normal_(0.0, 1.0)
    exclude = ["lm_head", "rm_head", "embed_tokens"]
    lora_cfg = LoraConfig(target_modules=lora_target_names(model, exclude + ["visual"]), r=4, lora_alpha=8,
                          lora_dropout=0.05, bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, lora_cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    if layout == "lora":
        peft_model.save_pretrained(ckpt)
        lora = load_file(str(ckpt / "adapter_model.safetensors"))
        save_file({current_to_legacy_key(k): v.contiguous() for k, v in lora.items()},
                  str(ckpt / "adapter_model.safetensors"), metadata={"format": "pt"})
        non_lora = {current_to_legacy_key(k): v.detach().clone() for k, v in peft_model.state_dict().items()
                    if "rm_head" in k or "embed_tokens" in k}
        torch.save(non_lora, ckpt / "non_lora_state_dict.pth")
    else:
        full = {current_to_legacy_key(k): v.detach().clone() for k, v in peft_model.state_dict().items()}
        torch.save(full, ckpt / "model.pth")

    (root / "model_config.json").write_text(json.dumps({
        "data_config": {"meta_data": "/path/to/dataset/meta_data.csv", "data_dir": "/path/to/dataset",
                        "max_frame_pixels": 24 * 24, "min_frame_pixels": 8 * 8, "num_frames": None, "fps": 2.0,
                        "eval_dim": ["VQ", "MQ", "TA"], "prompt_template_type": "detailed_special",
                        "sample_type": "uniform"},
        "model_config": {"model_name_or_path": "./Qwen2-VL-2B-Instruct", "output_dim": output_dim,
                         "use_special_tokens": True, "reward_token": "special", "loss_type": "btt"},
        "peft_lora_config": {"lora_enable": True, "vision_lora": False, "lora_r": 4, "lora_alpha": 8,
                             "lora_dropout": 0.05, "lora_target_modules": None, "lora_namespan_exclude": exclude,
                             "lora_modules_to_save": None, "lora_task_type": "CAUSAL_LM", "use_rslora": False,
                             "num_lora_modules": -1},
        "inference_config": dict(TINY_VIDEOALIGN_STATS),
    }, indent=2))
    return str(root)


# ------------------------------------------------------------------------------------------------- by name
#: registered reward name -> its tiny builder
TINY_BUILDERS: dict[str, Callable[..., Any]] = {
    "clipscore": build_tiny_hf_clip,
    "pickscore": build_tiny_hf_clip,
    "aesthetic": build_tiny_aesthetic,
    "hpsv2": build_tiny_hpsv2,
    "imagereward": build_tiny_imagereward,
    "videoalign": build_tiny_videoalign,
}


def build_tiny(reward: str | type[RewardModel], folder: str | Path, seed: int = 0, **kwargs: Any):
    """Write the tiny model of ``reward`` (a registered name or a reward class) to ``folder``; returns the folder.

    Raises:
        KeyError: no tiny builder for that reward (lists the rewards that have one).
    """
    name = reward if isinstance(reward, str) else getattr(reward, "name", reward.__name__)
    if name not in TINY_BUILDERS:
        raise KeyError(f"no tiny builder for reward {name!r}; builders: {', '.join(TINY_BUILDERS)}")
    return TINY_BUILDERS[name](folder, seed=seed, **kwargs)
