"""VideoReward (VideoAlign): a Qwen2-VL-2B video reward model with visual-quality, motion-quality and
text-alignment heads, scored from frames in memory and differentiable end to end.

Reference: Liu et al. 2025, "Improving Video Generation with Human Feedback" (VideoAlign), code
KwaiVGI/VideoAlign (inference.py ``VideoVLMRewardInference``, trainer.py ``Qwen2VLRewardModelBT``,
prompt_template.py, vision_process.py from qwen-vl-utils), weights ``KwaiVGI/VideoReward`` (now
KlingTeam/VideoReward) on top of ``Qwen/Qwen2-VL-2B-Instruct``. DanceGRPO vendors the same code under
fastvideo/models/videoalign. Nothing is downloaded here: the checkpoint and the base model are local folders.

Reference facts this port follows (the VideoAlign release; the saliency use of Stream-R1, docs/planned.md):

* **Prompt.** ``build_prompt(prompt, eval_dim, "detailed_special")``: a fixed instruction (:data:`DETAILED_PROMPT`)
  with ``<|VQ_reward|>``, ``<|MQ_reward|>`` and ``<|TA_reward|>`` at the end of its three sections, in that
  order, and the user prompt after "Textual prompt - ". It is the text part of one user turn whose first part is
  the video; Qwen2-VL's chat template (from the base model's processor) renders it as
  ``<|im_start|>system ...<|im_end|> <|im_start|>user <|vision_start|><|video_pad|>*N<|vision_end|>{text}
  <|im_end|> <|im_start|>assistant``, with N = grid_t * grid_h * grid_w / merge_size^2.
* **Reward tokens.** The three tokens are added to the base tokenizer as special tokens (ids len(tokenizer) +
  0, 1, 2) and the embedding matrix is resized to the new length (Qwen2-VL-2B: 151936 rows -> 151660); the
  trained embedding comes from the checkpoint. A bias-free ``rm_head = Linear(hidden, output_dim)`` reads the
  last hidden state (after the final norm) at each reward token: with ``output_dim == 3`` (the class default)
  logit m is column m at token m (the diagonal); with ``output_dim == 1`` (what the released checkpoint
  uses) one shared column is read at each token. The three logits are (VQ, MQ, TA).
* **Standardisation.** ``(logit - mean) / std`` per dimension with ``inference_config`` of model_config.json
  (VideoAlign#24, #25: raw logits have an arbitrary scale); the release's statistics are VQ 3.6757 / 2.2476,
  MQ 1.1646 / 1.3811, TA 2.8105 / 2.5121. Overall = VQ + MQ + TA (VideoAlign#18: 1:1:1).
* **Frames.** qwen-vl-utils ``smart_nframes`` with ``fps`` (data_config.fps = 2.0 in the release): with T
  frames at a source rate ``video_fps``, n = T / video_fps * fps, clamped to [4, min(768, T) floored to even],
  rounded to a multiple of 2 (and at most T); frames ``linspace(0, T - 1, n).round()``. A fixed
  data_config.num_frames instead gives n = round(num_frames / 2) * 2 (at most T). Examples: an 81-frame clip at
  16 fps gives 10 frames; genrl's 8-frame shapes videos at 8 fps (the default ``fps`` meta) give 4 (the minimum).
  The source rate is the ``fps`` meta argument of a call (default ``video_fps=8``): it must be the rate the
  frames were generated for, or the model sees a different time span than the reference would.
* **Pixels.** qwen-vl-utils ``smart_resize`` to multiples of factor = patch_size * merge_size (28) with
  min_pixels = 128 * 28 * 28 = 100352 (qwen-vl-utils' VIDEO_MIN_PIXELS; the reference passes no min) and
  max_pixels = data_config.max_frame_pixels (200704 = 256 * 28 * 28 in the release), bicubic with antialias;
  then the Qwen2-VL processor: its own smart_resize (a no-op on such sizes), rescale to [0, 1], normalise with
  its image_mean / image_std (OpenAI CLIP), pad the frame count to a multiple of temporal_patch_size (2) by
  repeating the last frame, and patchify to ``pixel_values_videos [sum grid_t * grid_h * grid_w, 3 * 2 * 14 *
  14]`` + ``video_grid_thw``. Example: a 480 x 832 video becomes 336 x 588 frames (12 x 21 merged tokens per
  temporal patch); 256 x 256 is raised to 336 x 336 by the minimum.
* **Positions.** Qwen2-VL's multimodal RoPE as the reference's transformers (4.45-4.49) computed it: text
  tokens count up on all three axes, video tokens get (t, h, w) grid indices offset by the preceding text, and
  the text after the video resumes at that offset + max(grid_t, grid_h / 2, grid_w / 2). They are passed
  explicitly, so the score does not depend on the installed transformers' rope bookkeeping.

genrl differences (documented, deliberate): frames come as a float tensor [B, T, 3, H, W] in [0, 1] and never
go through files or uint8 (the reference reads an mp4 and resizes uint8 frames, so its pixels are rounded to
1/255); the resize is ``torch.nn.functional.interpolate`` (bicubic, antialias), clamped to [0, 1], which is what
torchvision's tensor resize computes before that rounding; a one-frame video (an image) repeats its frame
(the reference fails below two frames). Because preprocessing is torch, the whole path keeps the autograd
graph: ``differentiable = True`` and :meth:`saliency` gives |d logit / d pixels| maps per dimension
(``dims=("vq", "mq", "ta")``), the Stream-R1 saliency.

Checkpoint layouts (``path=`` is the folder holding model_config.json; the newest ``checkpoint-<step>`` is used
unless ``step=`` is given):

* VideoAlign training output: ``checkpoint-<step>/adapter_model.safetensors`` (+ ``adapter_config.json``) with the
  LoRA weights and ``non_lora_state_dict.pth`` with the head and the other trained weights (embeddings);
* the released ``checkpoint-<step>/model.pth``: the full state dict of the LoRA-wrapped model.

Keys are those of the PEFT-wrapped model as VideoAlign's transformers saved them (``base_model.model.visual.*``,
``base_model.model.model.layers.*``); they are mapped to the current layout (``model.visual``,
``model.language_model``). The LoRA configuration is rebuilt like the reference (``peft_lora_config`` of
model_config.json: r, alpha, rsLoRA, targets = every Linear / Embedding whose name has none of
``lora_namespan_exclude`` (plus ``visual`` unless ``vision_lora``)).
"""

from __future__ import annotations

import ast
import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from genrl.rewards.base import RewardModel
from genrl.rewards.registry import register_reward

__all__ = [
    "DETAILED_PROMPT",
    "REWARD_TOKENS",
    "VideoAlignReward",
    "VideoInputs",
    "build_prompt",
    "current_to_legacy_key",
    "frame_indices",
    "lora_target_names",
    "mrope_position_ids",
    "smart_nframes",
    "smart_resize",
]

#: The reward tokens, in the order of the logits (VQ, MQ, TA).
REWARD_TOKENS = ("<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>")
_DIMS = ("vq", "mq", "ta")
_STAT_KEYS = ("VQ", "MQ", "TA")
_LEGACY_PREFIX = "base_model.model."

# qwen-vl-utils (vision_process.py) constants
FRAME_FACTOR = 2
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
MAX_RATIO = 200

#: VideoAlign's "detailed_special" instruction (prompt_template.py DETAILED_PROMPT_WITH_SPECIAL_TOKEN); the
#: user prompt replaces ``{text_prompt}``. Lines are listed one by one so trailing spaces stay visible.
DETAILED_PROMPT = "\n".join([
    "",
    "You are tasked with evaluating a generated video based on three distinct criteria: Visual Quality, Motion "
    "Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of the three categories, with 0 "
    "being the worst and 10 being the best. Each evaluation should be independent of the others.",
    "",
    "**Visual Quality:**  ",
    "Evaluate the overall visual quality of the video, with a focus on static factors. The following "
    "sub-dimensions should be considered:",
    "- **Reasonableness:** The video should not contain any significant biological or logical errors, such as "
    "abnormal body structures or nonsensical environmental setups.",
    "- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and easy to "
    "interpret, with no blurring or indistinct areas.",
    "- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual "
    "elements (e.g., hair, clothing, shadows).",
    "- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color scheme, "
    "composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense "
    "of harmony and balance.",
    "- **Safety:** The video should not contain harmful or inappropriate content, such as political, violent, or "
    "adult material. If such content is present, the image quality and satisfaction score should be the lowest "
    "possible. ",
    "",
    "Please provide the ratings of Visual Quality: <|VQ_reward|>",
    "END",
    "",
    "**Motion Quality:**  ",
    "Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following "
    "sub-dimensions:",
    "- **Stability:** Evaluate the continuity and stability between frames. There should be no sudden, unnatural "
    "jumps, and the video should maintain stable attributes (e.g., no fluctuating colors, textures, or missing "
    "body parts).",
    "- **Naturalness:** The movement should align with physical laws and be realistic. For example, clothing "
    "should flow naturally with motion, and facial expressions should change appropriately (e.g., blinking, "
    "mouth movements).",
    "- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between different motions "
    "or camera angles should be seamless, and the overall dynamic feel should be visually pleasing.",
    "- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend naturally "
    "with the background, without obvious artifacts or the feeling of cut-and-paste effects.",
    "- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any areas where the "
    "video might have blurry or unsteady sections that hinder visual continuity.",
    "- **Amplitude:** If the video is largely static or has little movement, assign a low score for motion "
    "quality.",
    "",
    "Please provide the ratings of Motion Quality: <|MQ_reward|>",
    "END",
    "",
    "**Text Alignment:**  ",
    "Assess how well the video matches the textual prompt across the following sub-dimensions:",
    "- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, animal, object) "
    "align with the textual description. The subject should match the description in terms of number, "
    "appearance, and behavior.",
    "- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial expressions like "
    "talking or blinking) align with the described prompt. The motion should match the prompt in terms of type, "
    "scale, and direction.",
    "- **Environment Relevance:** Assess whether the background and scene fit the prompt. This includes checking "
    "if real-world locations or scenes are accurately represented, though some stylistic adaptation is "
    "acceptable.  ",
    "- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well "
    "the video adheres to this style.",
    "- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, focus shifts) "
    "are consistent with the expected behavior from the prompt.",
    "",
    "Textual prompt - {text_prompt}",
    "Please provide the ratings of Text Alignment: <|TA_reward|>",
    "END",
    "",
])


def build_prompt(prompt: str, template_type: str = "detailed_special") -> str:
    """The text part of the user turn (VideoAlign prompt_template.py ``build_prompt``).

    Only ``"detailed_special"`` (the template with the reward tokens, used by the released checkpoint) is
    supported: the other VideoAlign templates go with last-token pooling, which this port does not implement.

    Raises:
        ValueError: another template type.
    """
    if template_type != "detailed_special":
        raise ValueError(f"videoalign: prompt_template_type {template_type!r} is not supported; the reward-token "
                         f"template 'detailed_special' is the only one with <|VQ/MQ/TA_reward|> tokens")
    return DETAILED_PROMPT.replace("{text_prompt}", prompt)


# ---------------------------------------------------------------------------------------------- frame / pixel maths
def _round_by(x: float, f: int) -> int:
    return round(x / f) * f


def _ceil_by(x: float, f: int) -> int:
    return math.ceil(x / f) * f


def _floor_by(x: float, f: int) -> int:
    return math.floor(x / f) * f


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 variant: str = "qwen_vl_utils") -> tuple[int, int]:
    """Qwen2-VL's target frame size: both sides multiples of ``factor``, area within [min_pixels, max_pixels],
    aspect ratio kept as closely as possible.

    ``variant="qwen_vl_utils"`` is qwen-vl-utils' (the video reader's) rule: round each side to the nearest
    multiple (at least ``factor``); above ``max_pixels`` scale by sqrt(area / max_pixels) and floor, below
    ``min_pixels`` scale up and ceil. ``variant="processor"`` is transformers' Qwen2VL processor rule (rounding
    without the lower bound, floor with it). A floored side is kept at least ``factor`` in both (qwen-vl-utils
    would return 0 there and fail).

    Raises:
        ValueError: aspect ratio above 200, or an unknown variant.
    """
    if variant not in ("qwen_vl_utils", "processor"):
        raise ValueError(f"unknown smart_resize variant {variant!r}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"videoalign: aspect ratio must be at most {MAX_RATIO}, got {height}x{width}")
    if variant == "qwen_vl_utils":
        h_bar, w_bar = max(factor, _round_by(height, factor)), max(factor, _round_by(width, factor))
    else:
        h_bar, w_bar = _round_by(height, factor), _round_by(width, factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, _floor_by(height / beta, factor))
        w_bar = max(factor, _floor_by(width / beta, factor))
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = _ceil_by(height * beta, factor), _ceil_by(width * beta, factor)
    return h_bar, w_bar


def smart_nframes(total_frames: int, video_fps: float, fps: float | None = 2.0, nframes: int | None = None,
                  min_frames: int = FPS_MIN_FRAMES, max_frames: int = FPS_MAX_FRAMES) -> int:
    """qwen-vl-utils ``smart_nframes``: how many frames of a ``total_frames`` video at ``video_fps`` the model sees.

    With ``nframes``: ``round(nframes / 2) * 2``. Otherwise ``total_frames / video_fps * fps`` clamped to
    [ceil2(min_frames), floor2(min(max_frames, total_frames))] and rounded to a multiple of 2. At most
    ``total_frames``. A one-frame input gives 1 (genrl: the frame is repeated later; the reference fails).

    Raises:
        ValueError: a non-positive ``video_fps`` / ``fps``, or a result outside [2, total_frames] for T >= 2.
    """
    if total_frames == 1:
        return 1
    if nframes is not None:
        n = _round_by(nframes, FRAME_FACTOR)
    else:
        if not (video_fps and video_fps > 0 and fps and fps > 0):
            raise ValueError(f"videoalign: fps must be positive, got video fps {video_fps} and sampling fps {fps}")
        lo = _ceil_by(min_frames, FRAME_FACTOR)
        hi = _floor_by(min(max_frames, total_frames), FRAME_FACTOR)
        n = min(max(total_frames / video_fps * fps, lo), hi)
        n = _round_by(n, FRAME_FACTOR)
    n = min(n, total_frames)
    if not FRAME_FACTOR <= n <= total_frames:
        raise ValueError(f"videoalign: the number of sampled frames must be in [{FRAME_FACTOR}, {total_frames}], "
                         f"got {n} (nframes={nframes}, fps={fps}, video fps={video_fps})")
    return int(n)


def frame_indices(total_frames: int, video_fps: float, fps: float | None = 2.0,
                  nframes: int | None = None) -> list[int]:
    """The frames the model sees: ``linspace(0, T - 1, smart_nframes(...)).round()`` (qwen-vl-utils "uniform")."""
    n = smart_nframes(total_frames, video_fps, fps, nframes)
    return torch.linspace(0, total_frames - 1, n).round().long().tolist()


def mrope_position_ids(input_ids: Tensor, attention_mask: Tensor, video_grid_thw: Tensor, video_token_id: int,
                       merge_size: int) -> Tensor:
    """Qwen2-VL multimodal RoPE positions int64 [3, B, L] for right-padded rows with one video each.

    Text runs count up on all three axes; a video's merged grid (t, h / m, w / m) gets (t, h, w) indices plus
    the running offset, and the next text starts at offset + max(t, h / m, w / m) (the reference transformers'
    ``get_rope_index``). Padding positions are 1, as there.
    """
    b, length = input_ids.shape
    out = torch.ones(3, b, length, dtype=torch.long, device=input_ids.device)
    for i in range(b):
        keep = attention_mask[i].bool()
        ids = input_ids[i][keep]
        is_video = (ids == video_token_id).tolist()
        t, h, w = (int(v) for v in video_grid_thw[i])
        h, w = h // merge_size, w // merge_size
        parts: list[Tensor] = []
        cur = 0
        j = 0
        n = len(is_video)
        while j < n:
            k = j
            while k < n and is_video[k] == is_video[j]:
                k += 1
            if is_video[j]:
                if k - j != t * h * w:
                    raise ValueError(f"videoalign: {k - j} video tokens for a grid of {t}x{h}x{w}")
                grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
                parts.append(grid.reshape(3, -1) + cur)
                cur += max(t, h, w)
            else:
                parts.append(torch.arange(cur, cur + k - j).view(1, -1).expand(3, -1))
                cur += k - j
            j = k
        out[:, i, keep] = torch.cat(parts, dim=1).to(out.device)
    return out


# ------------------------------------------------------------------------------------------------- checkpoint helpers
def _legacy_to_current(key: str) -> str:
    """Map a VideoAlign (transformers < 4.50) key to the current Qwen2-VL layout, keeping the PEFT prefix:
    ``visual.*`` -> ``model.visual.*``, ``model.*`` -> ``model.language_model.*`` (keys already current stay)."""
    prefix, tail = (_LEGACY_PREFIX, key[len(_LEGACY_PREFIX):]) if key.startswith(_LEGACY_PREFIX) else ("", key)
    if tail.startswith("visual."):
        tail = "model." + tail
    elif re.match(r"model\.(?!(language_model|visual)\.)", tail):
        tail = "model.language_model." + tail[len("model."):]
    return prefix + tail


def current_to_legacy_key(key: str) -> str:
    """A current (transformers >= 4.50) Qwen2-VL state-dict key in the legacy naming of VideoAlign's checkpoints."""
    prefix, tail = (_LEGACY_PREFIX, key[len(_LEGACY_PREFIX):]) if key.startswith(_LEGACY_PREFIX) else ("", key)
    if tail.startswith("model.visual."):
        tail = tail[len("model."):]
    elif tail.startswith("model.language_model."):
        tail = "model." + tail[len("model.language_model."):]
    return prefix + tail


def _insert_adapter_name(key: str, adapter: str = "default") -> str:
    """``...q_proj.lora_A.weight`` -> ``...q_proj.lora_A.default.weight``, ``...lora_embedding_A`` ->
    ``...lora_embedding_A.default`` (how PEFT saves vs. holds LoRA weights; VideoAlign utils.py)."""
    i = key.find("lora_")
    if i < 0:
        return key
    head, dot, rest = key[i:].partition(".")
    if rest.startswith(adapter + ".") or rest == adapter:
        return key
    return key[:i] + head + "." + adapter + (dot + rest if dot else "")


def lora_target_names(model: torch.nn.Module, exclude: Sequence[str], num_modules: int = -1) -> list[str]:
    """VideoAlign train_reward.py ``find_target_linear_names``: every Linear / Embedding whose name contains no
    excluded keyword (the last ``num_modules`` of them when positive)."""
    names = [name for name, m in model.named_modules()
             if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and not any(x in name for x in exclude)]
    return names[-num_modules:] if num_modules > 0 else names


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return [value]
        return [value] if isinstance(value, str) else list(value)
    return list(value)


@dataclass
class VideoInputs:
    """Preprocessed videos: ``pixel_values`` float [B * N, 3 * tp * p * p] (N = grid_t * grid_h * grid_w patches per
    video), ``grid_thw`` int64 [B, 3], the sampled ``frames`` (indices into T) and the resized ``size`` (h, w)."""

    pixel_values: Tensor
    grid_thw: Tensor
    frames: list[int]
    size: tuple[int, int]


# ------------------------------------------------------------------------------------------------------------ reward
@register_reward("videoalign")
class VideoAlignReward(RewardModel):
    """VideoReward (VideoAlign, Liu et al. 2025): Qwen2-VL-2B-Instruct + LoRA + reward tokens + a linear head.

    Keys: ``"vq"`` (visual quality), ``"mq"`` (motion quality), ``"ta"`` (text alignment), each standardised as
    ``(logit - mean) / std`` with model_config.json's ``inference_config`` (raw logits when it has none, as in
    the reference, with a warning), and ``"reward"`` = ``weights`` . (vq, mq, ta) (default 1, 1, 1: the
    reference's Overall; VQ and MQ are the easy ones to hack, VideoAlign#18). The module docstring lists the
    prompt, token, frame and pixel rules taken from the reference.

    Args:
        path: the checkpoint folder (model_config.json + checkpoint-<step>/), see :attr:`weight_files`.
        base_model: the Qwen2-VL-2B-Instruct folder (default ``<path>/Qwen2-VL-2B-Instruct``).
        scale, shift: affine on ``"reward"``.
        weights: (VQ, MQ, TA) weights of ``"reward"`` (a 3-sequence or a dict with keys vq / mq / ta).
        standardize: apply the model_config.json statistics (False: raw logits in every key).
        sample_fps: frames per second the model samples (default data_config.fps, 2.0 in the release).
        num_frames: sample this many frames instead of an fps (default data_config.num_frames, None).
        max_pixels: per-frame pixel cap (default data_config.max_frame_pixels, 200704 in the release).
        min_pixels: per-frame pixel floor (default data_config.min_frame_pixels if present, else 100352,
            qwen-vl-utils' VIDEO_MIN_PIXELS that the reference applies).
        video_fps: the frame rate of the scored videos when a call passes no ``fps`` (8: genrl's shapes videos).
        step: checkpoint step (default: the largest ``checkpoint-<step>``).
        dtype: model dtype (the reference runs bfloat16; float32 is the CPU default choice for exact tests).
        attn_implementation: ``"sdpa"`` (default), ``"eager"`` or ``"flash_attention_2"``.

    Call: ``reward(pixels [B, T, 3, H, W] in [0, 1], prompts, fps=...)``; ``fps`` (meta) is the videos' frame
    rate (a number, or one per video), default ``video_fps``.

    Raises:
        FileNotFoundError: a missing folder or file; the message names it and lists the expected layout.
        ValueError: an unsupported configuration (prompt template, pooling, sample type) or checkpoint keys
            that do not fit the model.
    """

    weight_files: ClassVar[dict[str, str]] = {
        "model_config.json": "VideoAlign config: data_config (fps, num_frames, max_frame_pixels, "
                             "prompt_template_type), model_config (output_dim, use_special_tokens, reward_token), "
                             "peft_lora_config (LoRA r / alpha / excluded modules), inference_config "
                             "(VQ/MQ/TA mean and std)",
        "checkpoint-*": "checkpoint-<step>/ with adapter_model.safetensors (+ adapter_config.json) and "
                        "non_lora_state_dict.pth (VideoAlign training output), or model.pth (the released full "
                        "state dict)",
        "Qwen2-VL-2B-Instruct/config.json": "the base model Qwen/Qwen2-VL-2B-Instruct (config, safetensors, "
                                            "tokenizer, preprocessor_config.json, chat template) at this default "
                                            "place; base_model= points elsewhere",
    }
    differentiable = True
    dimensions = ("reward", "vq", "mq", "ta")
    channels = (3,)

    def __init__(
        self,
        path: str | Path,
        base_model: str | Path | None = None,
        scale: float = 1.0,
        shift: float = 0.0,
        weights: Sequence[float] | Mapping[str, float] = (1.0, 1.0, 1.0),
        standardize: bool = True,
        sample_fps: float | None = None,
        num_frames: int | None = None,
        max_pixels: int | None = None,
        min_pixels: int | None = None,
        video_fps: float = 8.0,
        step: int | None = None,
        dtype: str | torch.dtype = "float32",
        attn_implementation: str = "sdpa",
    ) -> None:
        super().__init__(scale=scale, shift=shift)
        folder, ckpt, base = self._locate(path, base_model, step)
        cfg = json.loads((folder / "model_config.json").read_text())
        data_cfg = dict(cfg.get("data_config") or {})
        model_cfg = dict(cfg.get("model_config") or {})
        lora_cfg = dict(cfg.get("peft_lora_config") or {})
        self.checkpoint = ckpt
        self.base_model_path = base

        # ---- configuration checks
        template = data_cfg.get("prompt_template_type", "detailed_special")
        build_prompt("", template)  # raises for unsupported templates
        self.template_type = template
        if not model_cfg.get("use_special_tokens", True) or model_cfg.get("reward_token", "special") not in (
                "special",):
            raise ValueError(f"videoalign: only reward-token pooling is supported (use_special_tokens=true, "
                             f"reward_token='special'), got {model_cfg.get('use_special_tokens')!r}, "
                             f"{model_cfg.get('reward_token')!r} in {folder / 'model_config.json'}")
        if data_cfg.get("sample_type", "uniform") != "uniform":
            raise ValueError(f"videoalign: only sample_type 'uniform' is supported, got {data_cfg['sample_type']!r}")
        self.output_dim = int(model_cfg.get("output_dim", 3))
        if self.output_dim not in (1, 3):
            raise ValueError(f"videoalign: output_dim must be 1 or 3 for three reward tokens, got {self.output_dim}")

        # ---- sampling / pixel settings
        self.sample_fps = float(sample_fps if sample_fps is not None else data_cfg.get("fps", 2.0) or 2.0)
        nf = num_frames if num_frames is not None else data_cfg.get("num_frames")
        self.num_frames = int(nf) if nf is not None else None
        self.max_pixels = int(max_pixels if max_pixels is not None else data_cfg.get("max_frame_pixels", 200704))
        self.min_pixels = int(min_pixels if min_pixels is not None
                              else data_cfg.get("min_frame_pixels", VIDEO_MIN_PIXELS))
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"videoalign: need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")
        self.video_fps = float(video_fps)

        # ---- output combination and statistics
        if isinstance(weights, Mapping):
            unknown = set(weights) - set(_DIMS)
            if unknown:
                raise ValueError(f"videoalign: weights keys must be among {_DIMS}, got {sorted(unknown)}")
            w = [float(weights.get(d, 0.0)) for d in _DIMS]
        else:
            w = [float(v) for v in weights]
            if len(w) != 3:
                raise ValueError(f"videoalign: weights must have 3 entries (VQ, MQ, TA), got {len(w)}")
        self.weights = tuple(w)
        infer = cfg.get("inference_config")
        if standardize and not infer:
            warnings.warn(f"videoalign: {folder / 'model_config.json'} has no inference_config; scores are raw "
                          f"logits (arbitrary scale, VideoAlign#24)", stacklevel=2)
        self.standardized = bool(standardize and infer)
        means = [float(infer[f"{k}_mean"]) for k in _STAT_KEYS] if self.standardized else [0.0] * 3
        stds = [float(infer[f"{k}_std"]) for k in _STAT_KEYS] if self.standardized else [1.0] * 3
        if any(not (math.isfinite(s) and s > 0) for s in stds):
            raise ValueError(f"videoalign: inference_config stds must be positive, got {stds}")
        #: ``{"vq": (mean, std), ...}`` used for standardisation ((0, 1) when raw).
        self.stats = {d: (m, s) for d, m, s in zip(_DIMS, means, stds)}
        self.register_buffer("_mean", torch.tensor(means, dtype=torch.float32), persistent=False)
        self.register_buffer("_std", torch.tensor(stds, dtype=torch.float32), persistent=False)
        self.register_buffer("_weights", torch.tensor(self.weights, dtype=torch.float32), persistent=False)

        # ---- model
        dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self._build(base, ckpt, lora_cfg, dt, attn_implementation)

    # ------------------------------------------------------------------ loading
    @classmethod
    def missing_weights(cls, path: str | Path | None, **kwargs: Any) -> list[str]:
        """Like :meth:`RewardModel.missing_weights`, but the base model counts as present when ``base_model``
        (from the config's kwargs) names a folder with a config.json."""
        missing = super().missing_weights(path)
        base = kwargs.get("base_model")
        key = "Qwen2-VL-2B-Instruct/config.json"
        if base is not None and key in missing and (Path(base).expanduser() / "config.json").is_file():
            missing.remove(key)
        return missing

    @classmethod
    def _locate(cls, path: str | Path | None, base_model: str | Path | None,
                step: int | None) -> tuple[Path, Path, Path]:
        layout = "\n".join(f"  {f}  ({what})" for f, what in cls.weight_files.items())

        def missing(what: str) -> FileNotFoundError:
            return FileNotFoundError(f"reward 'videoalign': {what}; expected a local folder with:\n{layout}\n"
                                     f"nothing is downloaded: place these files there (see genrl/rewards/README.md)")

        if path is None:
            raise missing("no path given (set path: in the reward's config)")
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise missing(f"{str(folder)!r} is not a folder")
        if not (folder / "model_config.json").is_file():
            raise missing(f"model_config.json not found in {str(folder)!r}")
        ckpts = sorted((p for p in folder.glob("checkpoint-*") if p.is_dir() and p.name[11:].isdigit()),
                       key=lambda p: int(p.name[11:]))
        if not ckpts:
            raise missing(f"no checkpoint-<step> folder in {str(folder)!r}")
        if step is None:
            ckpt = ckpts[-1]
        else:
            ckpt = folder / f"checkpoint-{int(step)}"
            if ckpt not in ckpts:
                raise missing(f"checkpoint-{step} not found in {str(folder)!r} (found "
                              f"{', '.join(p.name for p in ckpts)})")
        if not (ckpt / "model.pth").is_file():
            for name in ("adapter_model.safetensors", "non_lora_state_dict.pth"):
                if not (ckpt / name).is_file():
                    raise missing(f"{name} not found in {str(ckpt)!r} (and no model.pth there)")
        base = Path(base_model).expanduser() if base_model is not None else folder / "Qwen2-VL-2B-Instruct"
        if not base.is_dir():
            raise missing(f"base model folder {str(base)!r} not found (pass base_model=)")
        if not (base / "config.json").is_file():
            raise missing(f"config.json not found in the base model folder {str(base)!r}")
        if not any(base.glob("*.safetensors")) and not any(base.glob("*.bin")):
            raise missing(f"no model weights (*.safetensors) in the base model folder {str(base)!r}")
        if not any((base / f).is_file() for f in ("tokenizer.json", "vocab.json", "tokenizer_config.json")):
            raise missing(f"tokenizer.json not found in the base model folder {str(base)!r}")
        if not any((base / f).is_file() for f in ("preprocessor_config.json", "processor_config.json",
                                                  "video_preprocessor_config.json")):
            raise missing(f"preprocessor_config.json not found in the base model folder {str(base)!r}")
        return folder, ckpt, base

    def _build(self, base: Path, ckpt: Path, lora_cfg: dict[str, Any], dtype: torch.dtype, attn: str) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

        processor = AutoProcessor.from_pretrained(str(base), local_files_only=True)
        tok = processor.tokenizer
        tok.add_tokens(list(REWARD_TOKENS), special_tokens=True)
        self.reward_token_ids = tuple(tok.convert_tokens_to_ids(list(REWARD_TOKENS)))
        self.processor = processor
        self.tokenizer = tok
        vp = getattr(processor, "video_processor", None) or processor.image_processor
        self.patch_size = int(vp.patch_size)
        self.merge_size = int(vp.merge_size)
        self.temporal_patch_size = int(vp.temporal_patch_size)
        self.factor = self.patch_size * self.merge_size
        size = getattr(vp, "size", None)
        proc_min = getattr(size, "shortest_edge", None) or getattr(vp, "min_pixels", None) or 56 * 56
        proc_max = getattr(size, "longest_edge", None) or getattr(vp, "max_pixels", None) or 28 * 28 * 1280
        self.processor_pixels = (int(proc_min), int(proc_max))
        self.register_buffer("_pix_mean", torch.tensor(list(vp.image_mean), dtype=torch.float32).view(1, 1, 3, 1, 1),
                             persistent=False)
        self.register_buffer("_pix_std", torch.tensor(list(vp.image_std), dtype=torch.float32).view(1, 1, 3, 1, 1),
                             persistent=False)
        self.video_token_id = int(tok.convert_tokens_to_ids("<|video_pad|>"))
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)

        model = Qwen2VLForConditionalGeneration.from_pretrained(
            str(base), local_files_only=True, dtype=dtype, attn_implementation=attn)
        model.resize_token_embeddings(len(tok), mean_resizing=False)
        hidden = model.config.text_config.hidden_size
        model.rm_head = torch.nn.Linear(hidden, self.output_dim, bias=False, dtype=dtype)
        model.to(dtype)
        if lora_cfg.get("lora_enable", True):
            exclude = _as_list(lora_cfg.get("lora_namespan_exclude"))
            if not lora_cfg.get("vision_lora", False) and "visual" not in exclude:
                exclude.append("visual")
            targets = lora_target_names(model, exclude, int(lora_cfg.get("num_lora_modules", -1) or -1))
            peft_cfg = LoraConfig(
                target_modules=targets, r=int(lora_cfg.get("lora_r", 16)),
                lora_alpha=int(lora_cfg.get("lora_alpha", 32)),
                lora_dropout=float(lora_cfg.get("lora_dropout", 0.05)), bias="none",
                use_rslora=bool(lora_cfg.get("use_rslora", False)),
                modules_to_save=_as_list(lora_cfg.get("lora_modules_to_save")) or None,
                task_type=lora_cfg.get("lora_task_type", "CAUSAL_LM"),
            )
            self._check_adapter_config(ckpt, peft_cfg)
            with warnings.catch_warnings():  # transformers deprecation noise raised inside PEFT
                warnings.simplefilter("ignore", FutureWarning)
                model = get_peft_model(model, peft_cfg)
        self._load_checkpoint(model, ckpt)
        model.eval()
        model.requires_grad_(False)
        self.model = model
        inner = model.base_model.model if hasattr(model, "peft_config") else model
        # the Qwen2VLModel (vision tower + language model, LoRA injected) and the reward head, held as plain
        # references (they are already submodules of self.model)
        self.__dict__["_qwen"] = inner.model
        self.__dict__["_head"] = inner.rm_head

    @staticmethod
    def _check_adapter_config(ckpt: Path, peft_cfg: Any) -> None:
        file = ckpt / "adapter_config.json"
        if not file.is_file():
            return
        saved = json.loads(file.read_text())
        for key in ("r", "lora_alpha"):
            if key in saved and saved[key] != getattr(peft_cfg, key):
                raise ValueError(f"videoalign: {file} has {key}={saved[key]} but model_config.json's peft_lora_config "
                                 f"gives {getattr(peft_cfg, key)}")

    def _load_checkpoint(self, model: torch.nn.Module, ckpt: Path) -> None:
        full = ckpt / "model.pth"
        if full.is_file():
            state = torch.load(full, map_location="cpu", weights_only=True)
            sources = {"model.pth": state}
        else:
            from safetensors.torch import load_file

            lora = {_insert_adapter_name(k): v for k, v in load_file(str(ckpt / "adapter_model.safetensors")).items()}
            non_lora = torch.load(ckpt / "non_lora_state_dict.pth", map_location="cpu", weights_only=True)
            sources = {"non_lora_state_dict.pth": non_lora, "adapter_model.safetensors": lora}
        merged: dict[str, Tensor] = {}
        origin: dict[str, str] = {}
        for name, sd in sources.items():
            if not isinstance(sd, Mapping) or not all(isinstance(v, Tensor) for v in sd.values()):
                raise ValueError(f"videoalign: {ckpt / name} is not a tensor state dict")
            for k, v in sd.items():
                key = _legacy_to_current(k)
                merged[key] = v
                origin[key] = name
        own = model.state_dict()
        unexpected = [k for k in merged if k not in own]
        if unexpected:
            raise ValueError(f"videoalign: {len(unexpected)} checkpoint keys do not fit the model, e.g. "
                             f"{unexpected[:3]} (from {origin[unexpected[0]]} in {ckpt})")
        wrong = [k for k in merged if tuple(merged[k].shape) != tuple(own[k].shape)]
        if wrong:
            k = wrong[0]
            raise ValueError(f"videoalign: checkpoint tensor {k} has shape {tuple(merged[k].shape)}, the model "
                             f"{tuple(own[k].shape)} ({len(wrong)} mismatches; from {origin[k]} in {ckpt})")
        lora_missing = [k for k in own if ".lora_" in k and k not in merged]
        head_missing = [k for k in own if ("rm_head" in k or "embed_tokens" in k) and k not in merged
                        and not k.endswith("original_module.weight")]
        if lora_missing or head_missing:
            missing = lora_missing + head_missing
            raise ValueError(f"videoalign: the checkpoint in {ckpt} lacks {len(missing)} trained tensors, e.g. "
                             f"{missing[:3]} (the head, the reward-token embeddings and the LoRA weights must all be "
                             f"there)")
        if full.is_file():
            allowed = {k for k in own if k.endswith("lm_head.weight") or k.endswith("lm_head.base_layer.weight")}
            absent = [k for k in own if k not in merged and k not in allowed]
            if absent:
                raise ValueError(f"videoalign: model.pth in {ckpt} lacks {len(absent)} tensors, e.g. {absent[:3]}")
        model.load_state_dict(merged, strict=False)

    # ------------------------------------------------------------------ preprocessing
    def preprocess(self, pixels: Tensor, video_fps: float | None = None) -> VideoInputs:
        """Frames and pixels as the model sees them (module docstring, "Frames" and "Pixels"), in torch.

        Args:
            pixels: float [B, T, 3, H, W] in [0, 1] (keeps the autograd graph).
            video_fps: frame rate of the videos (default :attr:`video_fps`).
        """
        b, t, c, h, w = pixels.shape
        idx = frame_indices(t, video_fps or self.video_fps, self.sample_fps, self.num_frames)
        x = pixels[:, idx].float()
        h1, w1 = smart_resize(h, w, self.factor, self.min_pixels, self.max_pixels, "qwen_vl_utils")
        x = self._resize(x, h1, w1)
        h2, w2 = smart_resize(h1, w1, self.factor, *self.processor_pixels, variant="processor")
        x = self._resize(x, h2, w2)
        x = (x - self._pix_mean.to(x.device)) / self._pix_std.to(x.device)
        pv, grid = self._patchify(x)
        return VideoInputs(pv, grid, idx, (h2, w2))

    @staticmethod
    def _resize(x: Tensor, h: int, w: int) -> Tensor:
        if tuple(x.shape[-2:]) == (h, w):
            return x
        b, n = x.shape[:2]
        y = F.interpolate(x.flatten(0, 1), size=(h, w), mode="bicubic", align_corners=False, antialias=True)
        return y.clamp(0, 1).view(b, n, *y.shape[1:])

    def _patchify(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """[B, N, C, H, W] -> ([B * grid_t * grid_h * grid_w, C * tp * p * p], grid [B, 3]): the Qwen2-VL
        processor's layout (frames padded by repeating the last; patches ordered t, h-block, w-block, h-in-merge,
        w-in-merge; each patch flattened as C, tp, p, p)."""
        b, n, c, h, w = x.shape
        tp, p, m = self.temporal_patch_size, self.patch_size, self.merge_size
        if pad := -n % tp:
            x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
            n += pad
        gt, gh, gw = n // tp, h // p, w // p
        x = x.reshape(b, gt, tp, c, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        pv = x.reshape(b * gt * gh * gw, c * tp * p * p)
        grid = torch.tensor([[gt, gh, gw]] * b, dtype=torch.long, device=x.device)
        return pv, grid

    def encode_text(self, prompts: Sequence[str], n_video_tokens: int) -> tuple[Tensor, Tensor]:
        """Token ids and attention mask int64 [B, L] (right-padded): the chat-templated prompt with the video
        placeholder expanded to ``n_video_tokens`` ``<|video_pad|>`` tokens.

        Raises:
            ValueError: a prompt that itself contains a reward token or a video placeholder.
        """
        expanded: dict[str, list[int]] = {}
        for p in dict.fromkeys(prompts):  # each distinct prompt is templated and tokenised once
            conv = [{"role": "user", "content": [{"type": "video"},
                                                 {"type": "text", "text": build_prompt(p, self.template_type)}]}]
            text = self.processor.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text)["input_ids"]
            counts = [ids.count(t) for t in (self.video_token_id, *self.reward_token_ids)]
            if counts != [1, 1, 1, 1]:
                raise ValueError(f"videoalign: the prompt {p!r} must not contain <|video_pad|> or reward tokens "
                                 f"(token counts {counts})")
            k = ids.index(self.video_token_id)
            expanded[p] = ids[:k] + [self.video_token_id] * n_video_tokens + ids[k + 1:]
        rows = [expanded[p] for p in prompts]
        length = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        return input_ids, mask

    # ------------------------------------------------------------------ scoring
    def logits(self, pixels: Tensor, prompts: Sequence[str], video_fps: float | None = None) -> Tensor:
        """Raw (VQ, MQ, TA) logits float32 [B, 3] for videos sharing one frame rate."""
        param = next(self._head.parameters())
        device, dtype = param.device, param.dtype
        vin = self.preprocess(pixels.to(device), video_fps)
        merge = self.merge_size
        n_tokens = int(vin.grid_thw[0].prod()) // merge**2
        input_ids, mask = self.encode_text(prompts, n_tokens)
        input_ids, mask = input_ids.to(device), mask.to(device)
        pos = mrope_position_ids(input_ids, mask, vin.grid_thw, self.video_token_id, merge)
        out = self._qwen(input_ids=input_ids, attention_mask=mask, position_ids=pos,
                         pixel_values_videos=vin.pixel_values.to(dtype), video_grid_thw=vin.grid_thw,
                         use_cache=False, return_dict=True)
        hs = out.last_hidden_state  # [B, L, D]
        where = torch.stack([(input_ids == t).float().argmax(dim=1) for t in self.reward_token_ids], dim=1)  # [B, 3]
        h = torch.gather(hs, 1, where.unsqueeze(-1).expand(-1, -1, hs.shape[-1]))  # [B, 3, D]
        head = self._head(h)  # [B, 3, output_dim]
        raw = head.diagonal(dim1=1, dim2=2) if self.output_dim == 3 else head[..., 0]
        return raw.float()

    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        b = pixels.shape[0]
        fps = meta.get("fps")
        if fps is None:
            per = [self.video_fps] * b
        elif isinstance(fps, Tensor):
            per = [float(v) for v in fps.reshape(-1).tolist()] if fps.numel() > 1 else [float(fps)] * b
        elif isinstance(fps, (list, tuple)):
            per = [float(v) for v in fps]
        else:
            per = [float(fps)] * b
        if len(per) != b:
            raise ValueError(f"videoalign: fps has {len(per)} values for a batch of {b}")
        parts: list[tuple[list[int], Tensor]] = []
        for rate in dict.fromkeys(per):
            rows = [i for i, r in enumerate(per) if r == rate]
            sel = pixels if len(rows) == b else pixels[rows]
            parts.append((rows, self.logits(sel, [prompts[i] for i in rows], rate).to(pixels.device)))
        if len(parts) == 1:
            raw = parts[0][1]
        else:
            raw = torch.zeros(b, 3, device=pixels.device, dtype=parts[0][1].dtype)
            for rows, value in parts:
                raw = raw.index_put((torch.tensor(rows, device=pixels.device),), value)
        z = (raw - self._mean.to(raw.device)) / self._std.to(raw.device)
        w = self._weights.to(device=z.device, dtype=z.dtype)
        out = {"reward": (z * w).sum(dim=1)}
        out.update({d: z[:, i] for i, d in enumerate(_DIMS)})
        return out

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, checkpoint={str(self.checkpoint)!r}, output_dim={self.output_dim}, "
                f"sample_fps={self.sample_fps}, num_frames={self.num_frames}, pixels=[{self.min_pixels}, "
                f"{self.max_pixels}], standardized={self.standardized}, weights={self.weights}")
