"""ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for Text-to-Image
Generation", NeurIPS 2023), registered as ``"imagereward"``; rebuilt on transformers' BLIP modules.

Architecture (read from THUDM/ImageReward: ImageReward/ImageReward.py, models/BLIP/blip_pretrain.py, blip.py,
med.py, vit.py):

* image: BLIP's ViT-L/16 at 224 px (24 blocks, width 1024, 16 heads, pre-norm, LayerNorm eps 1e-6, final
  norm; all 197 output tokens are kept) -> transformers :class:`~transformers.BlipVisionModel`;
* text: BLIP's "MED" BERT-base encoder (12 layers, width 768, no token-type embeddings, no pooler) with a
  cross-attention block in every layer attending to the image tokens -> :class:`~transformers.BlipTextModel`
  built with cross-attention (``is_decoder=True`` in its config) and run bidirectionally (``is_decoder=False``
  at call time), which is BLIP's ``mode='multimodal'``;
* the prompt is tokenised by ``bert-base-uncased`` with BLIP's added specials (``[DEC]`` as bos, ``[ENC]``),
  padded / truncated to 35 tokens. ImageReward keeps the ``[CLS]`` token first (its ``score``,
  ``inference_rank`` and the ReFL ``score_gard`` paths never substitute ``[ENC]``, unlike BLIP's ITM head), and
  so does genrl;
* the output at position 0 goes through a linear MLP 768-1024-128-64-16-1 (dropout 0.2, 0.2, 0.1 between the
  first layers, no activations), and the score is z-scored with the constants of ImageReward.py:
  ``reward = (raw - 0.16717362830052426) / 1.0333394966054072``.

Preprocessing is the reference's ``Resize(224, bicubic) + CenterCrop(224) + CLIP mean/std`` done in torch by
:func:`~genrl.rewards.preprocess.clip_preprocess` (antialiased bicubic, so about one uint8 step from the PIL
path), which keeps the graph: the reward is differentiable (ImageReward's ReFL uses its gradient).

Weights (local only, nothing is downloaded; the reference silently fetches the tokenizer from the hub,
zai-org/ImageReward#28, #113)::

    <path>/ImageReward.pt              the original checkpoint (BLIP key names), THUDM/ImageReward on the hub
    <path>/med_config.json             the BERT config of the text encoder, same repository
    <path>/bert-base-uncased/vocab.txt a local bert-base-uncased tokenizer folder (or pass tokenizer_path=)

:func:`convert_state_dict` maps the original keys onto the transformers modules, and the model is loaded
with ``strict=True``, so a checkpoint that does not match fails with the offending keys named (the reference
loads with ``strict=False`` and would silently score with random weights). For tests,
:func:`genrl.testing.rewards.build_tiny_imagereward` writes a tiny random instance in the same layout.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from genrl.rewards.image import FramePolicy, ImageRewardModel
from genrl.rewards.preprocess import CLIP_MEAN, CLIP_STD, clip_preprocess
from genrl.rewards.registry import register_reward

__all__ = ["ImageRewardBLIP", "ImageRewardHead", "CheckpointMismatchError", "convert_state_dict", "original_key",
           "IMAGEREWARD_MEAN", "IMAGEREWARD_STD", "CHECKPOINT_FILE", "MED_CONFIG_FILE", "TOKENIZER_DIR"]

#: z-scoring constants of ImageReward.py (the raw head output's mean and std over the authors' reference set).
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
CHECKPOINT_FILE = "ImageReward.pt"
MED_CONFIG_FILE = "med_config.json"
TOKENIZER_DIR = "bert-base-uncased"
#: text length of the reference tokenizer call (padding="max_length", truncation=True, max_length=35).
MAX_TEXT_TOKENS = 35
#: BLIP's ViT-B/16 and ViT-L/16 both use 64-wide attention heads; the checkpoint does not store the head count.
VISION_HEAD_DIM = 64

# Original ImageReward.pt keys (left) -> genrl module keys (right); {n} is a block index, {p} weight / bias.
# Text-encoder names are identical in BLIP's med.py and transformers' BlipText, so they only change prefix.
_RULES: tuple[tuple[str, str], ...] = (
    ("blip.visual_encoder.cls_token", "vision.embeddings.class_embedding"),
    ("blip.visual_encoder.pos_embed", "vision.embeddings.position_embedding"),
    ("blip.visual_encoder.patch_embed.proj.{p}", "vision.embeddings.patch_embedding.{p}"),
    ("blip.visual_encoder.blocks.{n}.norm1.{p}", "vision.encoder.layers.{n}.layer_norm1.{p}"),
    ("blip.visual_encoder.blocks.{n}.attn.qkv.{p}", "vision.encoder.layers.{n}.self_attn.qkv.{p}"),
    ("blip.visual_encoder.blocks.{n}.attn.proj.{p}", "vision.encoder.layers.{n}.self_attn.projection.{p}"),
    ("blip.visual_encoder.blocks.{n}.norm2.{p}", "vision.encoder.layers.{n}.layer_norm2.{p}"),
    ("blip.visual_encoder.blocks.{n}.mlp.fc1.{p}", "vision.encoder.layers.{n}.mlp.fc1.{p}"),
    ("blip.visual_encoder.blocks.{n}.mlp.fc2.{p}", "vision.encoder.layers.{n}.mlp.fc2.{p}"),
    ("blip.visual_encoder.norm.{p}", "vision.post_layernorm.{p}"),
    ("blip.text_encoder.{rest}", "text.{rest}"),
    ("mlp.layers.{n}.{p}", "head.layers.{n}.{p}"),
)
#: keys of the original checkpoint that scoring does not use: BLIP_Pretrain's contrastive projections and the
#: text embeddings' position-id buffer (persistent in med.py, a non-persistent buffer in transformers).
IGNORED_KEYS = frozenset({
    "blip.vision_proj.weight", "blip.vision_proj.bias", "blip.text_proj.weight", "blip.text_proj.bias",
    "blip.text_encoder.embeddings.position_ids",
})
_FIELDS = {"n": r"(?P<n>\d+)", "p": r"(?P<p>weight|bias)", "rest": r"(?P<rest>.+)"}


class CheckpointMismatchError(KeyError, ValueError):
    """An ImageReward checkpoint whose keys do not fit the model (a KeyError and a ValueError); the message names
    the keys in the checkpoint's original naming."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _compile(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{\w+\})", template)
    return re.compile("".join(_FIELDS[s[1:-1]] if s.startswith("{") else re.escape(s) for s in parts if s) + "$")


_FORWARD = tuple((_compile(src), dst) for src, dst in _RULES)
_BACKWARD = tuple((_compile(dst), src) for src, dst in _RULES)


def _apply(key: str, rules: tuple[tuple[re.Pattern[str], str], ...]) -> str | None:
    for pattern, template in rules:
        m = pattern.match(key)
        if m:
            return template.format(**m.groupdict())
    return None


def original_key(key: str) -> str:
    """The original ImageReward.pt name of a genrl module key (the inverse of :func:`convert_state_dict`'s
    renaming); the key itself if no rule applies."""
    return _apply(key, _BACKWARD) or key


def convert_state_dict(state: dict[str, Tensor], expected: set[str] | None = None) -> dict[str, Tensor]:
    """Rename an original ImageReward checkpoint (BLIP / timm key names) to the keys of :class:`ImageRewardBLIP`.

    Args:
        state: the state dict of ``ImageReward.pt`` (``blip.visual_encoder.*``, ``blip.text_encoder.*``,
            ``mlp.layers.*``; :data:`IGNORED_KEYS` are dropped).
        expected: the target module's state-dict keys; when given, the result must match them exactly.
    Returns:
        the same tensors under ``vision.*`` (BlipVisionModel), ``text.*`` (BlipTextModel), ``head.layers.*``.
    Raises:
        CheckpointMismatchError (a KeyError and ValueError): a key no rule maps, a key the target does not
            have, or a target key the checkpoint lacks; the message names them in the checkpoint's original
            naming (a renamed or truncated file fails here instead of scoring with random weights).
    """
    out: dict[str, Tensor] = {}
    unknown: list[str] = []
    for key, value in state.items():
        if key in IGNORED_KEYS:
            continue
        new = _apply(key, _FORWARD)
        if new is None:
            unknown.append(key)
        else:
            out[new] = value
    if expected is not None:
        unknown += [original_key(k) for k in out if k not in expected]
        missing = sorted(original_key(k) for k in expected - set(out))
    else:
        missing = []
    if unknown or missing:
        lines = []
        if unknown:
            lines.append(f"unexpected key(s) in {CHECKPOINT_FILE}: {', '.join(sorted(unknown))}")
        if missing:
            lines.append(f"missing key(s) in {CHECKPOINT_FILE}: {', '.join(missing)}")
        raise CheckpointMismatchError(
            "ImageReward checkpoint does not match the BLIP ViT + MED text encoder + MLP layout; " + "; ".join(lines))
    return out


class ImageRewardHead(nn.Module):
    """ImageReward's linear MLP ``d-1024-128-64-16-1`` (no activations; dropout 0.2, 0.2, 0.1 after the first
    three layers, identity in eval mode). The layer indices 0, 2, 4, 6, 7 match the checkpoint's
    ``mlp.layers.*``; widths are read from the checkpoint, so the tiny test model
    (:func:`genrl.testing.rewards.build_tiny_imagereward`) can shrink them.

    Maps float [N, d] -> float [N, 1].
    """

    def __init__(self, widths: tuple[int, int, int, int, int]) -> None:
        super().__init__()
        d, h1, h2, h3, h4 = widths
        self.layers = nn.Sequential(
            nn.Linear(d, h1), nn.Dropout(0.2), nn.Linear(h1, h2), nn.Dropout(0.2), nn.Linear(h2, h3),
            nn.Dropout(0.1), nn.Linear(h3, h4), nn.Linear(h4, 1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"reward 'imagereward': {path} is not valid JSON ({err})") from None


def _load_checkpoint(path: Path) -> dict[str, Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and len(state) == 1 and next(iter(state)) in ("state_dict", "model"):
        state = next(iter(state.values()))
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"reward 'imagereward': {path} is not a state dict of tensors")
    return state


def _vision_config(state: dict[str, Tensor], who: str):
    """BlipVisionConfig of the checkpoint's ViT: sizes from tensor shapes, heads from the 64-wide head rule."""
    from transformers import BlipVisionConfig

    need = ["blip.visual_encoder.pos_embed", "blip.visual_encoder.patch_embed.proj.weight",
            "blip.visual_encoder.blocks.0.mlp.fc1.weight"]
    absent = [k for k in need if k not in state]
    if absent:
        raise CheckpointMismatchError(f"{who}: missing key(s) in {CHECKPOINT_FILE}: {', '.join(absent)}")
    width, _, patch, _ = state["blip.visual_encoder.patch_embed.proj.weight"].shape
    tokens = state["blip.visual_encoder.pos_embed"].shape[1] - 1
    side = round(tokens**0.5)
    if side * side != tokens:
        raise ValueError(f"{who}: pos_embed has {tokens} patch positions, not a square grid")
    depth = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"blip\.visual_encoder\.blocks\.(\d+)\.", k)))
    if width % VISION_HEAD_DIM:
        raise ValueError(f"{who}: ViT width {width} is not a multiple of BLIP's head width {VISION_HEAD_DIM}")
    return BlipVisionConfig(
        hidden_size=width, intermediate_size=state["blip.visual_encoder.blocks.0.mlp.fc1.weight"].shape[0],
        num_hidden_layers=depth, num_attention_heads=width // VISION_HEAD_DIM, image_size=side * patch,
        patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-6, attention_dropout=0.0,
    )


def _text_config(med: dict[str, Any], encoder_width: int, who: str):
    """BlipTextConfig from BLIP's med_config.json (a BertConfig); the cross-attention width is the ViT's,
    as BLIP_Pretrain overrides ``encoder_width`` with the vision width (the file says 768 for ViT-L)."""
    from transformers import BlipTextConfig

    if not med.get("add_cross_attention", False):
        raise ValueError(f"{who}: {MED_CONFIG_FILE} must set add_cross_attention: true (BLIP's MED encoder)")
    if med.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{who}: only absolute position embeddings are supported, {MED_CONFIG_FILE} has "
                         f"{med['position_embedding_type']!r}")
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "max_position_embeddings")
    absent = [k for k in keys if k not in med]
    if absent:
        raise ValueError(f"{who}: {MED_CONFIG_FILE} lacks {', '.join(absent)}")
    cfg = BlipTextConfig(
        **{k: med[k] for k in keys}, hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12), pad_token_id=med.get("pad_token_id", 0),
        encoder_hidden_size=encoder_width, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        is_decoder=True, bos_token_id=None, eos_token_id=None, sep_token_id=None,
    )
    cfg._attn_implementation = "eager"  # BlipText adds the mask to its scores: it needs the additive float mask
    return cfg


def _load_tokenizer(folder: Path, vocab_size: int, who: str):
    """bert-base-uncased from a local folder plus BLIP's specials ([DEC] as bos, [ENC]), as blip.init_tokenizer."""
    from transformers import BertTokenizer

    if not folder.is_dir() or not any((folder / f).is_file() for f in ("vocab.txt", "tokenizer.json")):
        raise FileNotFoundError(
            f"{who}: tokenizer not found: {str(folder)!r} must be a local bert-base-uncased tokenizer folder "
            f"(vocab.txt or tokenizer.json); the reference downloads it, genrl does not")
    tok = BertTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.add_special_tokens({"bos_token": "[DEC]"})
    tok.add_tokens(["[ENC]"], special_tokens=True)
    if len(tok) > vocab_size:
        raise ValueError(f"{who}: the tokenizer in {str(folder)!r} has {len(tok)} tokens with [DEC] / [ENC], "
                         f"more than the text encoder's vocab_size {vocab_size}; wrong tokenizer folder?")
    return tok


@register_reward("imagereward")
class ImageRewardBLIP(ImageRewardModel):
    """ImageReward v1.0 (Xu et al. 2023) as a genrl reward: a text-conditioned human-preference score.

    Per image: ``reward = (MLP(MED(tokens, ViT(preprocess(image)))[:, 0]) - 0.1672) / 1.0333`` (see the module
    docstring for the architecture and source). Videos are scored frame-wise by the frame policy (default: all
    frames, mean).

    Args:
        path: local folder with ``ImageReward.pt``, ``med_config.json`` and ``bert-base-uncased/`` (see
            :attr:`weight_files`); nothing is downloaded.
        tokenizer_path: a bert-base-uncased tokenizer folder elsewhere (default ``<path>/bert-base-uncased``).
        scale, shift: affine on the main key (:class:`~genrl.rewards.base.RewardModel`).
        frames, max_batch: frame policy and images per forward (:class:`~genrl.rewards.image.ImageRewardModel`).
        dtype: compute dtype of the ViT and text encoder (``"float32"``, ``"bfloat16"``, ``"float16"`` or a
            torch dtype); the head and the z-scoring run in float32.

    Output keys (float32 [B], plus ``"valid"``):
        ``"reward"``: the z-scored ImageReward score; about 98% of real generations lie in [-2, 2] and negative
        values are normal (zai-org/ImageReward#7, #102). ``"raw"``: the head output before z-scoring.

    Input: pixels float [B, T, 3, H, W] in [0, 1], any H, W (shortest side resized to 224 then centre-cropped);
    prompts longer than 35 tokens are truncated as in the reference.

    Raises:
        FileNotFoundError: ``path`` missing or lacking a file (every expected file is listed, missing ones
            marked), or the tokenizer folder missing.
        CheckpointMismatchError (a KeyError and ValueError): the checkpoint does not match the architecture
            (keys named in the original naming, see :func:`convert_state_dict`).
        ValueError: an invalid ``med_config.json``, a tokenizer larger than the vocabulary, an unknown dtype, or
            the frame-policy / ``max_batch`` checks of the base class.
    """

    weight_files: ClassVar[dict[str, str]] = {
        CHECKPOINT_FILE: "ImageReward v1.0 checkpoint with the original BLIP key names (THUDM/ImageReward, 1.79 GB)",
        MED_CONFIG_FILE: "BERT config of BLIP's text encoder (THUDM/ImageReward)",
        f"{TOKENIZER_DIR}/vocab.txt": "bert-base-uncased tokenizer folder (google-bert/bert-base-uncased: vocab.txt, "
                                      "tokenizer_config.json, tokenizer.json)",
    }
    differentiable: ClassVar[bool] = True
    dimensions: ClassVar[tuple[str, ...]] = ("reward", "raw")
    higher_is_better: ClassVar[bool] = True

    def __init__(self, path: str | Path | None = None, tokenizer_path: str | Path | None = None,
                 scale: float = 1.0, shift: float = 0.0, frames: FramePolicy | dict | None = None,
                 max_batch: int = 16, dtype: str | torch.dtype = "float32") -> None:
        super().__init__(scale=scale, shift=shift, frames=frames, max_batch=max_batch)
        from transformers import BlipTextModel, BlipVisionModel

        who = self._label()
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        compute_dtype = dtype if isinstance(dtype, torch.dtype) else dtypes.get(str(dtype).replace("torch.", ""))
        if compute_dtype not in dtypes.values():
            raise ValueError(f"{who}: dtype must be one of {', '.join(dtypes)}, got {dtype!r}")
        if tokenizer_path is None:
            folder = self.require_weights(path)
            tok_folder = folder / TOKENIZER_DIR
        else:
            missing = [f for f in self.missing_weights(path) if not f.startswith(TOKENIZER_DIR)]
            if missing or path is None:
                self.require_weights(path)  # raises with the full listing
            folder = Path(path).expanduser()
            tok_folder = Path(tokenizer_path).expanduser()

        state = _load_checkpoint(folder / CHECKPOINT_FILE)
        vision_cfg = _vision_config(state, who)
        text_cfg = _text_config(_read_json(folder / MED_CONFIG_FILE), vision_cfg.hidden_size, who)
        self.tokenizer = _load_tokenizer(tok_folder, text_cfg.vocab_size, who)

        widths = []
        for i in (0, 2, 4, 6, 7):
            w = state.get(f"mlp.layers.{i}.weight")
            if w is None:
                raise CheckpointMismatchError(
                    f"{who}: missing key(s) in {CHECKPOINT_FILE}: mlp.layers.{i}.weight")
            widths.append(w.shape[1])
        if widths[0] != text_cfg.hidden_size:
            raise ValueError(f"{who}: the head takes {widths[0]} features but the text encoder is "
                             f"{text_cfg.hidden_size} wide ({MED_CONFIG_FILE} does not match {CHECKPOINT_FILE})")

        try:  # every parameter is overwritten by the strict load below: skip the random init (4 s on CPU)
            from transformers.initialization import no_init_weights
        except ImportError:  # pragma: no cover - older transformers
            no_init_weights = contextlib.nullcontext
        with no_init_weights():
            self.vision = BlipVisionModel(vision_cfg)
            self.text = BlipTextModel(text_cfg, add_pooling_layer=False)
        self.head = ImageRewardHead(tuple(widths))
        converted = convert_state_dict(state, expected=set(self.state_dict()))
        self.load_state_dict(converted, strict=True)
        self.vision.to(compute_dtype)
        self.text.to(compute_dtype)
        self.path = str(folder)
        self.image_size = int(vision_cfg.image_size)
        self.max_length = MAX_TEXT_TOKENS
        self.reward_mean = IMAGEREWARD_MEAN
        self.reward_std = IMAGEREWARD_STD
        self.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True) -> ImageRewardBLIP:
        """Keeps the scorer in eval mode (dropout of the head and encoders stays off) whatever ``mode`` is."""
        super().train(mode)
        for module in (self.vision, self.text, self.head):
            module.eval()
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, path={self.path!r}, image_size={self.image_size}"

    # ------------------------------------------------------------------ pieces (also used by the tests)
    def preprocess(self, images: Tensor) -> Tensor:
        """float [N, 3, H, W] in [0, 1] -> [N, 3, 224, 224] normalised (bicubic shortest side, centre crop,
        CLIP mean / std), differentiable."""
        return clip_preprocess(images, size=self.image_size, mean=CLIP_MEAN, std=CLIP_STD)

    def tokenize(self, prompts: list[str], device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """input_ids and attention_mask, int64 [N, 35] ([CLS] first, padded / truncated as the reference)."""
        enc = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=self.max_length,
                             return_tensors="pt")
        return enc["input_ids"].to(device), enc["attention_mask"].to(device)

    def raw_score(self, pixel_values: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Head output float32 [N] from preprocessed pixels [N, 3, 224, 224] and tokens [N, L]."""
        dtype = self.vision.embeddings.patch_embedding.weight.dtype
        image_embeds = self.vision(pixel_values=pixel_values.to(dtype)).last_hidden_state  # [N, 1 + P, Dv]
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_embeds,
                         is_decoder=False).last_hidden_state  # [N, L, Dt]
        return self.head(text[:, 0, :].float()).squeeze(-1)

    def score_images(self, images: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        """``{"reward": z-scored [N], "raw": head output [N]}`` for images float [N, 3, H, W] in [0, 1]."""
        device = self.vision.embeddings.patch_embedding.weight.device
        ids, mask = self.tokenize(prompts, device)
        raw = self.raw_score(self.preprocess(images.to(device=device, dtype=torch.float32)), ids, mask)
        return {"reward": (raw - self.reward_mean) / self.reward_std, "raw": raw}
