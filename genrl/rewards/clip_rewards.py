"""CLIP-family image rewards: CLIPScore, PickScore, the LAION aesthetic predictor v2 and HPSv2.1.

All four are differentiable :class:`~genrl.rewards.image.ImageRewardModel` subclasses (videos are scored
frame-wise through the instance's :class:`~genrl.rewards.image.FramePolicy`). They load **only** from a local
folder given as ``path=`` (``local_files_only=True``; nothing is ever downloaded, no hub ids); a missing
folder or file raises ``FileNotFoundError`` listing every expected file (:meth:`RewardModel.require_weights`).
Preprocessing (shortest side to the model's input size with antialiased bicubic, centre crop, CLIP
normalisation) is done in torch by :func:`~genrl.rewards.preprocess.clip_preprocess`, so gradients reach the
input pixels (docs/rewards.md, The protocol). The reward's own networks are frozen (``requires_grad=False``)
and stay in eval mode even if a parent module is put in train mode.

Tests write a tiny random model of each architecture, in the exact layout ``path=`` expects, with
:mod:`genrl.testing.rewards` (``build_tiny("clipscore", folder)``), so they go through the real loading code.

Sources: Radford et al. 2021 (CLIP); Hessel et al. 2021 (CLIPScore); Kirstain et al. 2023 (Pick-a-Pic /
PickScore); Wu et al. 2023 (Human Preference Score v2); the LAION improved aesthetic predictor
(github.com/christophschuhmann/improved-aesthetic-predictor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrl.rewards.image import FramePolicy, ImageRewardModel
from genrl.rewards.image_reward import ImageRewardHead
from genrl.rewards.preprocess import CLIP_MEAN, CLIP_STD, clip_preprocess
from genrl.rewards.registry import register_reward

__all__ = ["CLIPScoreReward", "PickScoreReward", "AestheticReward", "AestheticMLP", "HPSv2Reward",
           "as_dtype", "freeze", "preprocessor_norm", "projected_embedding", "build_open_clip"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

#: the published LAION aesthetic head (ViT-L/14 embeddings, MSE-trained linear MLP)
AESTHETIC_HEAD_FILE = "sac+logos+ava1-l14-linearMSE.pth"
#: the HPSv2.1 checkpoint (full open_clip ViT-H-14 weights)
HPS_FILE = "HPS_v2.1_compressed.pt"
#: optional architecture file next to the HPS checkpoint (open_clip's local-dir convention); absent: ViT-H-14
OPEN_CLIP_CONFIG_FILE = "open_clip_config.json"


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a dtype or its name (``"float32"`` / ``"fp32"``, ``"bfloat16"`` / ``"bf16"``,
    ``"float16"`` / ``"fp16"``).

    Raises:
        ValueError: an unknown name (lists the known ones).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}") from None


def projected_embedding(out: Any) -> Tensor:
    """The projected embedding from a transformers CLIP call: a tensor (transformers 4), ``image_embeds`` /
    ``text_embeds`` (``*WithProjection`` models) or ``pooler_output`` (transformers 5 ``get_*_features``)."""
    if isinstance(out, Tensor):
        return out
    for attr in ("image_embeds", "text_embeds", "pooler_output"):
        value = getattr(out, attr, None)
        if isinstance(value, Tensor):
            return value
    raise RuntimeError(f"cannot find a projected embedding in {type(out).__name__}")


def _cosine(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise cosine similarity in float32: [N, D] x [N, D] -> [N]."""
    return (F.normalize(a.float(), dim=-1) * F.normalize(b.float(), dim=-1)).sum(-1)


def _unique(prompts: list[str]) -> tuple[list[str], Tensor]:
    """Distinct prompts (order kept) and, for each input prompt, its index among them."""
    uniq = list(dict.fromkeys(prompts))
    pos = {p: i for i, p in enumerate(uniq)}
    return uniq, torch.tensor([pos[p] for p in prompts], dtype=torch.long)


def preprocessor_norm(folder: Path) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Normalisation constants from ``preprocessor_config.json`` if the folder has one, else OpenAI CLIP's."""
    cfg_file = folder / "preprocessor_config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        return tuple(cfg.get("image_mean", CLIP_MEAN)), tuple(cfg.get("image_std", CLIP_STD))
    return CLIP_MEAN, CLIP_STD


def freeze(module: nn.Module) -> nn.Module:
    """``module`` in eval mode with ``requires_grad=False`` (returned for chaining)."""
    module.eval()
    module.requires_grad_(False)
    return module


class _FrozenImageReward(ImageRewardModel):
    """Shared plumbing: the weights folder checked before anything loads (:attr:`path`), frozen sub-networks
    kept in eval mode, device / dtype of the weights.

    Raises:
        FileNotFoundError: ``path`` missing or lacking a file of :attr:`weight_files` (checked first).
    """

    differentiable: ClassVar[bool] = True
    _frozen: tuple[str, ...] = ()

    def __init__(self, path: str | Path | None, scale: float = 1.0, shift: float = 0.0,
                 frames: FramePolicy | dict | None = None, max_batch: int = 32) -> None:
        folder = type(self).require_weights(path)
        super().__init__(scale=scale, shift=shift, frames=frames, max_batch=max_batch)
        self.path = str(folder)

    def train(self, mode: bool = True) -> _FrozenImageReward:
        super().train(mode)
        for name in self._frozen:
            getattr(self, name).eval()  # dropout / norms of the scorer never switch to training behaviour
        return self

    def _param(self) -> Tensor:
        return next(getattr(self, self._frozen[0]).parameters())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, path={self.path!r}"


class _HFClipReward(_FrozenImageReward):
    """A transformers ``CLIPModel`` + ``CLIPTokenizer`` loaded from one local folder."""

    weight_files: ClassVar[dict[str, str]] = {
        "config.json": "transformers CLIPModel config",
        "model*.safetensors": "CLIPModel weights (model.safetensors, or shards + model.safetensors.index.json)",
        "tokenizer.json": "CLIP tokenizer (save_pretrained layout, with tokenizer_config.json)",
    }
    _frozen = ("clip",)

    def __init__(self, path: str | Path | None = None, scale: float = 1.0, shift: float = 0.0,
                 frames: FramePolicy | dict | None = None, max_batch: int = 32,
                 dtype: str | torch.dtype = "float32") -> None:
        super().__init__(path, scale=scale, shift=shift, frames=frames, max_batch=max_batch)
        folder = Path(self.path)
        from transformers import CLIPModel, CLIPTokenizer

        self.clip = freeze(CLIPModel.from_pretrained(folder, local_files_only=True, dtype=as_dtype(dtype)))
        self.tokenizer = CLIPTokenizer.from_pretrained(folder, local_files_only=True)
        self.image_size = int(self.clip.config.vision_config.image_size)
        self.max_length = int(self.clip.config.text_config.max_position_embeddings)
        self.mean, self.std = preprocessor_norm(folder)

    def _cosines(self, images: Tensor, prompts: list[str]) -> Tensor:
        """cos(image embedding, text embedding) per image, float32 [N]; the graph reaches ``images``."""
        p = self._param()
        x = clip_preprocess(images.float(), size=self.image_size, mean=self.mean, std=self.std)
        img = projected_embedding(self.clip.get_image_features(pixel_values=x.to(device=p.device, dtype=p.dtype)))
        uniq, index = _unique(prompts)
        with torch.no_grad():
            tok = self.tokenizer(uniq, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
            txt = projected_embedding(self.clip.get_text_features(input_ids=tok["input_ids"].to(p.device),
                                                         attention_mask=tok["attention_mask"].to(p.device)))
        return _cosine(img, txt[index.to(p.device)]).to(images.device)


@register_reward("clipscore")
class CLIPScoreReward(_HFClipReward):
    """CLIPScore (Hessel et al. 2021) on a CLIP model (Radford et al. 2021) from a local transformers folder.

    ``reward = w * max(cos(E_img, E_txt), 0)``, E the projected CLIP embeddings. With the default ``w = 100``
    (torchmetrics ``CLIPScore``; ViT-L/14 gives about 20-40); the paper uses ViT-B/32 with ``w = 2.5``
    (about 0.5-1). Text is truncated at the model's max positions (77 tokens).

    Keys (per video, mean over the scored frames): ``"reward"`` float [B] (raw score above, before the
    instance's ``scale`` / ``shift``), ``"cosine"`` float [B] in [-1, 1] (the unclipped cosine; it keeps a
    gradient where the clip at 0 would cut it).

    Weights (``path=``): a ``save_pretrained`` folder of ``transformers.CLIPModel`` with its tokenizer, e.g. a
    local copy of openai/clip-vit-large-patch14: ``config.json``, ``model.safetensors``, ``tokenizer.json``
    (+ ``tokenizer_config.json``); ``preprocessor_config.json`` is optional (its image_mean / image_std are
    used; default OpenAI CLIP's). The input size is the vision config's ``image_size``.

    Args:
        path: the local folder. w: the CLIPScore weight. scale, shift, frames, max_batch: see
        :class:`~genrl.rewards.image.ImageRewardModel`. dtype: weights dtype (float32, bfloat16, float16).
    Input: pixels float [B, T, 3, H, W] in [0, 1], B prompts. Differentiable: gradients reach the pixels.
    Raises:
        FileNotFoundError: ``path`` missing or lacking a file (the message lists the expected layout).
        ValueError: a bad dtype, scale or frame policy; at call, the protocol's input checks.
    """

    dimensions: ClassVar[tuple[str, ...]] = ("reward", "cosine")

    def __init__(self, path: str | Path | None = None, w: float = 100.0, scale: float = 1.0, shift: float = 0.0,
                 frames: FramePolicy | dict | None = None, max_batch: int = 32,
                 dtype: str | torch.dtype = "float32") -> None:
        super().__init__(path=path, scale=scale, shift=shift, frames=frames, max_batch=max_batch, dtype=dtype)
        self.w = float(w)

    def score_images(self, images: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        cos = self._cosines(images, prompts)
        return {"reward": self.w * cos.clamp(min=0), "cosine": cos}


@register_reward("pickscore")
class PickScoreReward(_HFClipReward):
    """PickScore_v1 (Kirstain et al. 2023, Pick-a-Pic): a CLIP ViT-H/14 fine-tuned on human preferences.

    ``reward = logit_scale.exp() * cos(E_img, E_txt)`` (the model's learnt temperature, about 100), about
    18-24 for real weights on reasonable images. Flow-GRPO divides it by 26 to bring it near [0, 1]: use
    ``scale=1/26`` (about 0.0385) for that setting (flow_grpo#100: not part of the paper); DanceGRPO uses the
    raw cosine, available as the ``"cosine"`` key.

    Keys: ``"reward"`` float [B] (raw score above, before ``scale`` / ``shift``), ``"cosine"`` float [B] in
    [-1, 1]. Per video, mean over the scored frames.

    Weights (``path=``): a local copy of yuvalkirstain/PickScore_v1 (``config.json``, ``model.safetensors``)
    plus the CLIP-H tokenizer files ``tokenizer.json`` / ``tokenizer_config.json``: PickScore's reference code
    takes its processor from laion/CLIP-ViT-H-14-laion2B-s32B-b79K, so copy those files into the same folder
    if your copy lacks them. Preprocessing: shortest side to 224 (bicubic, antialiased), centre crop,
    OpenAI CLIP mean / std; text truncated at 77 tokens.

    Args: as :class:`CLIPScoreReward` without ``w``.
    Raises:
        FileNotFoundError: ``path`` missing or lacking a file (the message lists the expected layout).
        ValueError: a bad dtype, scale or frame policy; at call, the protocol's input checks.
    """

    dimensions: ClassVar[tuple[str, ...]] = ("reward", "cosine")

    def score_images(self, images: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        cos = self._cosines(images, prompts)
        return {"reward": self.clip.logit_scale.detach().float().exp().to(cos.device) * cos, "cosine": cos}


class AestheticMLP(ImageRewardHead):
    """The LAION improved aesthetic predictor head: ``input_size``-1024-128-64-16-1 linear layers with dropout
    (0.2, 0.2, 0.1) after the first three and no activations (the same architecture as ImageReward's head,
    :class:`~genrl.rewards.image_reward.ImageRewardHead`). The state-dict keys (``layers.0``, ``layers.2``,
    ``layers.4``, ``layers.6``, ``layers.7``) are those of the published ``sac+logos+ava1-l14-linearMSE.pth``,
    which loads with ``strict=True`` (``input_size=768``, CLIP ViT-L/14). Maps float [N, input_size] ->
    float [N, 1]."""

    def __init__(self, input_size: int = 768) -> None:
        super().__init__((int(input_size), 1024, 128, 64, 16))
        self.input_size = int(input_size)


@register_reward("aesthetic")
class AestheticReward(_FrozenImageReward):
    """LAION improved aesthetic predictor v2 (christophschuhmann/improved-aesthetic-predictor): the CLIP
    ViT-L/14 image embedding (Radford et al. 2021), L2-normalised, through :class:`AestheticMLP`.

    ``reward`` float [B]: the predicted aesthetic rating, raw (before ``scale`` / ``shift``), about 1-10 and
    usually 4-7 for real weights (mean over the scored frames). Prompt-agnostic: prompts are ignored. This is
    the v2 MLP of DDPO / AlignProp / VADER / Flow-GRPO, not VBench's v1 linear head.

    Weights (``path=``)::

        path/
          clip/config.json                    transformers CLIPModel (or CLIPVisionModelWithProjection) config
          clip/model.safetensors              e.g. a local copy of openai/clip-vit-large-patch14
          sac+logos+ava1-l14-linearMSE.pth    the MLP state dict (torch.save of an OrderedDict)

    (a symlink ``clip -> /your/clip-vit-large-patch14`` works). ``clip/preprocessor_config.json`` is optional.

    Args:
        path: the local folder. scale, shift, frames, max_batch: see ImageRewardModel. dtype: CLIP weights
        dtype (the MLP runs in float32).
    Raises:
        FileNotFoundError: ``path`` missing or lacking a file (the message lists the expected layout).
        ValueError: the MLP's input size differs from the CLIP projection size, or a bad dtype.
        RuntimeError: the .pth does not match the MLP architecture (key / shape mismatch).
    """

    weight_files: ClassVar[dict[str, str]] = {
        "clip/config.json": "transformers CLIP ViT-L/14 config (CLIPModel or CLIPVisionModelWithProjection)",
        "clip/model*.safetensors": "CLIP ViT-L/14 weights, e.g. from openai/clip-vit-large-patch14",
        AESTHETIC_HEAD_FILE: "LAION aesthetic MLP v2 state dict (improved-aesthetic-predictor)",
    }
    dimensions: ClassVar[tuple[str, ...]] = ("reward",)
    _frozen = ("clip", "mlp")

    def __init__(self, path: str | Path | None = None, scale: float = 1.0, shift: float = 0.0,
                 frames: FramePolicy | dict | None = None, max_batch: int = 32,
                 dtype: str | torch.dtype = "float32") -> None:
        super().__init__(path, scale=scale, shift=shift, frames=frames, max_batch=max_batch)
        folder = Path(self.path)
        from transformers import CLIPModel, CLIPVisionModelWithProjection

        clip_dir = folder / "clip"
        model_type = json.loads((clip_dir / "config.json").read_text()).get("model_type", "clip")
        if model_type == "clip":
            clip = CLIPModel.from_pretrained(clip_dir, local_files_only=True, dtype=as_dtype(dtype))
            vision_cfg, proj_dim, self._vision_only = clip.config.vision_config, clip.config.projection_dim, False
        elif model_type == "clip_vision_model":
            clip = CLIPVisionModelWithProjection.from_pretrained(clip_dir, local_files_only=True,
                                                                 dtype=as_dtype(dtype))
            vision_cfg, proj_dim, self._vision_only = clip.config, clip.config.projection_dim, True
        else:
            raise ValueError(f"reward 'aesthetic': {clip_dir / 'config.json'} has model_type {model_type!r}; "
                             f"expected a CLIP model ('clip' or 'clip_vision_model')")
        self.clip = freeze(clip)
        self.image_size = int(vision_cfg.image_size)
        self.mean, self.std = preprocessor_norm(clip_dir)
        state = torch.load(folder / AESTHETIC_HEAD_FILE, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        first = state.get("layers.0.weight") if isinstance(state, dict) else None
        if first is None:
            found = list(state)[:8] if isinstance(state, dict) else type(state).__name__
            raise RuntimeError(f"reward 'aesthetic': {folder / AESTHETIC_HEAD_FILE} is not the aesthetic MLP state "
                               f"dict (no 'layers.0.weight'; found {found})")
        if first.shape[1] != proj_dim:
            raise ValueError(f"reward 'aesthetic': the MLP takes {first.shape[1]}-d embeddings but the CLIP in "
                             f"{clip_dir} projects to {proj_dim}-d; the head needs CLIP ViT-L/14 (768-d)")
        mlp = AestheticMLP(first.shape[1])
        mlp.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        self.mlp = freeze(mlp)

    def score_images(self, images: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        p = self._param()
        x = clip_preprocess(images.float(), size=self.image_size, mean=self.mean, std=self.std)
        x = x.to(device=p.device, dtype=p.dtype)
        out = self.clip(pixel_values=x) if self._vision_only else self.clip.get_image_features(pixel_values=x)
        emb = F.normalize(projected_embedding(out).float(), dim=-1)
        return {"reward": self.mlp(emb).squeeze(-1).to(images.device)}


def _import_open_clip():
    try:
        import open_clip
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reward 'hpsv2' needs open_clip: pip install open_clip_torch") from e
    return open_clip


def build_open_clip(cfg: dict[str, Any]):
    """A random-init open_clip ``CLIP`` from a model_cfg dict (plain ViT / text transformer towers only)."""
    open_clip = _import_open_clip()
    unsupported = [k for k in ("custom_text", "multimodal_cfg") if cfg.get(k)]
    unsupported += [k for k in ("timm_model_name", "hf_model_name")
                    if cfg.get("vision_cfg", {}).get(k) or cfg.get("text_cfg", {}).get(k)]
    if unsupported:
        raise ValueError(f"reward 'hpsv2': only plain open_clip CLIP architectures are supported, the config sets "
                         f"{unsupported}")
    return open_clip.model.CLIP(embed_dim=cfg["embed_dim"], vision_cfg=dict(cfg["vision_cfg"]),
                                text_cfg=dict(cfg["text_cfg"]), quick_gelu=bool(cfg.get("quick_gelu", False)))


@register_reward("hpsv2")
class HPSv2Reward(_FrozenImageReward):
    """Human Preference Score v2.1 (Wu et al. 2023): an open_clip CLIP ViT-H-14 (Radford et al. 2021)
    fine-tuned on HPDv2.

    ``reward = cos(E_img, E_txt)`` of the normalised open_clip embeddings (the diagonal of HPSv2's
    ``image_features @ text_features.T``), about 0.2-0.35 for real weights; ``"score_x100"`` is the same
    ×100 (the scale of HPSv2's tables). Raw, before ``scale`` / ``shift``; mean over the scored frames.

    Weights (``path=``): a folder with ``HPS_v2.1_compressed.pt`` from xswu/HPSv2 (the full ViT-H-14 weights:
    a dict with ``"state_dict"`` or a bare state dict; a DDP ``module.`` prefix is stripped). The laion
    ViT-H-14 base weights are not needed. The architecture is open_clip's bundled ``"ViT-H-14"`` config built
    with no pretrained weights (nothing is downloaded), unless ``arch`` is given or the folder holds an
    ``open_clip_config.json`` (open_clip's local-dir format, ``{"model_cfg": {...}}``; the tiny test model of
    ``genrl.testing.rewards`` has one). Text goes through open_clip's own BPE tokenizer, whose vocabulary ships
    inside open_clip (the ``hpsv2`` wheel lacks it, tgxs002/HPSv2#30), truncated at the context length (77).
    Preprocessing: shortest side to the model's image size (224), centre crop, OpenAI CLIP mean / std.

    Args:
        path: the local folder. arch: an open_clip model name or model_cfg dict (default: the folder's
        open_clip_config.json, else "ViT-H-14"). scale, shift, frames, max_batch: see ImageRewardModel.
        dtype: weights dtype. weights_only: torch.load's safe mode (set False only for a trusted checkpoint that
        pickles more than tensors).
    Raises:
        FileNotFoundError: ``path`` missing or lacking the checkpoint (the message lists the expected layout).
        ImportError: open_clip is not installed (pip install open_clip_torch).
        ValueError: an unknown architecture or an unsupported (non-CLIP) config.
        RuntimeError: the checkpoint does not match the architecture (lists missing / unexpected keys).
    """

    weight_files: ClassVar[dict[str, str]] = {
        HPS_FILE: "HPSv2.1 checkpoint from xswu/HPSv2: full open_clip ViT-H-14 weights (dict with 'state_dict' "
                  "or a bare state dict)",
    }
    dimensions: ClassVar[tuple[str, ...]] = ("reward", "score_x100")
    _frozen = ("clip",)

    def __init__(self, path: str | Path | None = None, arch: str | dict | None = None, scale: float = 1.0,
                 shift: float = 0.0, frames: FramePolicy | dict | None = None, max_batch: int = 32,
                 dtype: str | torch.dtype = "float32", weights_only: bool = True) -> None:
        super().__init__(path, scale=scale, shift=shift, frames=frames, max_batch=max_batch)
        folder = Path(self.path)
        open_clip = _import_open_clip()
        if arch is None:
            cfg_file = folder / OPEN_CLIP_CONFIG_FILE
            arch = json.loads(cfg_file.read_text()) if cfg_file.is_file() else "ViT-H-14"
        if isinstance(arch, str):
            self.arch = arch
            cfg = open_clip.get_model_config(arch)
            if cfg is None:
                raise ValueError(f"reward 'hpsv2': unknown open_clip architecture {arch!r} (real HPSv2 weights are "
                                 f"'ViT-H-14')")
        else:
            self.arch = "custom"
            cfg = arch
        cfg = dict(cfg.get("model_cfg", cfg))
        model = build_open_clip(cfg)
        ckpt = torch.load(folder / HPS_FILE, map_location="cpu", weights_only=weights_only)
        state = ckpt["state_dict"] if isinstance(ckpt, dict) and "state_dict" in ckpt else ckpt
        if not isinstance(state, dict):
            raise RuntimeError(f"reward 'hpsv2': {folder / HPS_FILE} holds {type(state).__name__}, not a state dict")
        state = {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise RuntimeError(
                f"reward 'hpsv2': {folder / HPS_FILE} does not match the {self.arch!r} architecture: "
                f"{len(missing)} missing keys {missing[:5]}, {len(unexpected)} unexpected keys {unexpected[:5]}")
        self.clip = freeze(model.to(as_dtype(dtype)))
        self.tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=model.context_length)
        if model.vocab_size < len(self.tokenizer.encoder):
            raise ValueError(f"reward 'hpsv2': the text tower has {model.vocab_size} tokens but open_clip's BPE "
                             f"tokenizer needs {len(self.tokenizer.encoder)}")
        size = cfg["vision_cfg"].get("image_size", 224)
        self.image_size = int(size if isinstance(size, int) else size[0])
        pre = cfg.get("preprocess_cfg", {})
        self.mean = tuple(pre.get("mean", CLIP_MEAN))
        self.std = tuple(pre.get("std", CLIP_STD))

    def score_images(self, images: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        p = self._param()
        x = clip_preprocess(images.float(), size=self.image_size, mean=self.mean, std=self.std)
        img = self.clip.encode_image(x.to(device=p.device, dtype=p.dtype))
        uniq, index = _unique(prompts)
        with torch.no_grad():
            txt = self.clip.encode_text(self.tokenizer(uniq).to(p.device))
        cos = _cosine(img, txt[index.to(p.device)]).to(images.device)
        return {"reward": cos, "score_x100": 100.0 * cos}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, arch={self.arch!r}"
