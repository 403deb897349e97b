"""OCR reward ``"ocr"``: does the image show the text the prompt quotes? (Flow-GRPO's text-rendering reward;
docs/rewards.md, The zoo.)

Target text: the text between the first pair of double quotes of the prompt (``'a sign that says "Hello
World"'`` -> ``Hello World``; typographic quotes ``“...”`` are accepted when there are no ASCII ones), or
the per-sample meta ``target`` when given (``reward(pixels, prompts, target=["Hello World", None, ...])``;
None entries fall back to the prompt).

Score of one image (after Flow-GRPO's flow_grpo/ocr.py, ``OcrScorer.__call__``):

1. PP-OCR reads the image (detector + recogniser, no angle classifier, lines with recognition confidence below
   ``text_score`` dropped); the recognised lines are joined in reading order (top to bottom, left to right);
2. recognised text and target lose their whitespace and are lower-cased;
3. ``d = 0`` if the target occurs inside the recognised text, else the Levenshtein distance between the two
   strings; ``d = min(d, n)`` with ``n = len(target)``;
4. ``reward = 1 - d / n``, in [0, 1] (1: the text is there; 0: nothing like it, or no text at all).

Videos: :class:`~genrl.rewards.image.ImageRewardModel` scores frames chosen by the frame policy and averages
them. Flow-GRPO's video OCR scores every 4th frame: ``kwargs: {frames: {frames: stride, stride: 4}}``.

Differences from the reference, on purpose:

* a prompt without a quoted target (or an empty one) is NaN and invalid (the reference crashes on
  ``split('"')[1]`` or divides by zero), so such samples are excluded from the statistics, not scored 0;
* an OCR engine exception on an image is NaN and invalid and logged (the reference prints it and gives 0);
* all whitespace is removed (the reference removes spaces only);
* the engine is `rapidocr-onnxruntime <https://pypi.org/project/rapidocr-onnxruntime/>`_ 1.4.x, the ONNX port
  of PaddleOCR: its wheel ships the PP-OCRv4 detector and recogniser (about 16 MB), so nothing is downloaded
  and the reward runs on the CPU without weights to place. The reference runs ``paddleocr`` (PP-OCRv4 too by
  default in PaddleOCR 2.7+; detector resizing defaults differ slightly: pass ``engine_kwargs`` to change
  them). Frames are handed to the engine in BGR order, the OpenCV convention it expects (the reference hands
  RGB arrays to PaddleOCR, which also expects BGR).

Not differentiable: frames are quantised to uint8 (``round(x * 255)``) for the engine.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from genrl.rewards.image import FramePolicy, ImageRewardModel
from genrl.rewards.registry import register_reward

__all__ = ["OCRReward", "extract_target", "normalize_text", "ocr_reward_from_text"]

logger = logging.getLogger(__name__)

_ASCII_QUOTED = re.compile(r'"([^"]*)"')
_CURLY_QUOTED = re.compile(r"\u201c([^\u201d]*)\u201d")
_INSTALL = "pip install 'rapidocr-onnxruntime>=1.4,<1.5' rapidfuzz"


def extract_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes of ``prompt`` (ASCII ``"..."``, else typographic
    ``“...”``), or None when there is no complete pair. The quoted text may be empty (``'""'`` -> ``''``)."""
    m = _ASCII_QUOTED.search(prompt) or _CURLY_QUOTED.search(prompt)
    return m.group(1) if m else None


def normalize_text(text: str) -> str:
    """Remove all whitespace and lower-case (how recognised text and target are compared)."""
    return "".join(text.split()).lower()


def ocr_reward_from_text(recognized: str, target: str) -> tuple[float, int]:
    """``(reward, clipped distance)`` of recognised text against a target (both normalised here).

    ``d = 0`` if the normalised target occurs in the normalised recognised text, else their Levenshtein
    distance, clipped to ``n = len(target)``; ``reward = 1 - d / n``.

    Raises:
        ValueError: the normalised target is empty (the reward is undefined).
    """
    from rapidfuzz.distance import Levenshtein

    rec, tgt = normalize_text(recognized), normalize_text(target)
    n = len(tgt)
    if n == 0:
        raise ValueError("the OCR target text is empty after removing whitespace")
    d = 0 if tgt in rec else int(Levenshtein.distance(rec, tgt))
    d = min(d, n)
    return 1.0 - d / n, d


@register_reward("ocr")
class OCRReward(ImageRewardModel):
    """Text-rendering reward: 1 - normalised edit distance between the OCR'd text and the quoted target (see
    the module docstring for the exact rule, sources and differences from Flow-GRPO).

    Args:
        scale, shift: affine on ``"reward"``.
        frames: frame policy for videos (:class:`~genrl.rewards.image.FramePolicy` or its fields as a dict);
            Flow-GRPO's video OCR is ``{frames: stride, stride: 4}``. Default: every frame, mean.
        max_batch: images per :meth:`score_images` call (the engine reads them one at a time).
        text_score: recognised lines with confidence below this are dropped (PaddleOCR's ``drop_score``,
            0.5 in both PaddleOCR and RapidOCR).
        use_cls: run the 180-degree text-direction classifier (Flow-GRPO: off).
        num_threads: ONNX Runtime intra-op threads (None: ONNX Runtime's default, every core).
        engine_kwargs: further ``RapidOCR(**kwargs)`` options, e.g. ``{"det_limit_side_len": 960}``.

    Call: ``reward(pixels float [B, T, 3, H, W] in [0, 1], prompts: list[str], target=None)`` ->
    ``{"reward": float32 [B] in [0, 1], "edit_distance": float32 [B] (clipped distance, mean over scored
    frames), "valid": bool [B]}``. A sample is NaN and invalid when it has no target (no quoted text in the
    prompt and no meta ``target``), an empty target, or the engine raised on one of its frames (logged).

    Raises:
        ImportError: rapidocr-onnxruntime or rapidfuzz is not installed (names the pip command).
        ValueError: a bad frame policy or ``max_batch``; at call, the protocol's input checks (rank 5, C = 3,
            float in [0, 1], one prompt per video) and a meta ``target`` whose length is not B.
    """

    differentiable = False
    dimensions: ClassVar[tuple[str, ...]] = ("reward", "edit_distance")
    higher_is_better = True
    channels: ClassVar[tuple[int, ...]] = (3,)
    #: nothing to place: the PP-OCRv4 ONNX models ship inside the rapidocr-onnxruntime wheel.
    weight_files: ClassVar[dict[str, str]] = {}

    def __init__(
        self,
        scale: float = 1.0,
        shift: float = 0.0,
        frames: FramePolicy | dict | None = None,
        max_batch: int = 32,
        text_score: float = 0.5,
        use_cls: bool = False,
        num_threads: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(scale=scale, shift=shift, frames=frames, max_batch=max_batch)
        try:
            import rapidfuzz  # noqa: F401  (checked here, used in ocr_reward_from_text)
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:
            raise ImportError(f"the 'ocr' reward needs rapidocr-onnxruntime 1.4.x and rapidfuzz: {_INSTALL}") from exc
        if not 0.0 <= text_score <= 1.0:
            raise ValueError(f"text_score must be in [0, 1], got {text_score}")
        opts: dict[str, Any] = {"text_score": float(text_score), "use_cls": bool(use_cls)}
        if num_threads is not None:
            if num_threads < 1:
                raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
            opts.update(intra_op_num_threads=int(num_threads), inter_op_num_threads=1)
        self._engine_kwargs = dict(engine_kwargs or {})
        opts.update(self._engine_kwargs)
        self.text_score = float(text_score)
        self.use_cls = bool(use_cls)
        # a plain attribute, not a submodule: ONNX sessions are not torch state
        self._engine = RapidOCR(**opts)

    @property
    def version(self) -> str:
        """Engine name and version, e.g. ``"rapidocr-onnxruntime 1.4.4"`` (reported by the reward server)."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"rapidocr-onnxruntime {version('rapidocr-onnxruntime')}"
        except PackageNotFoundError:  # pragma: no cover - imported from a source tree
            return "rapidocr-onnxruntime"

    def bundled_weights(self) -> list[Path]:
        """The ONNX model files the engine loads (det, rec, and cls when ``use_cls``): the package's own unless
        ``engine_kwargs`` names others. The reward server hashes them for ``/info``."""
        import rapidocr_onnxruntime
        import yaml

        pkg = Path(rapidocr_onnxruntime.__file__).parent
        cfg = yaml.safe_load((pkg / "config.yaml").read_text())
        parts = ("Det", "Rec", "Cls") if self.use_cls else ("Det", "Rec")
        files = []
        for part in parts:
            given = self._engine_kwargs.get(f"{part.lower()}_model_path")
            files.append(Path(given) if given else pkg / cfg[part]["model_path"])
        return files

    def read_text(self, image_bgr) -> str:
        """The recognised lines of one uint8 [H, W, 3] BGR array joined in reading order ('' if none).

        Raises:
            whatever the engine raises (callers turn it into an invalid sample).
        """
        result, _ = self._engine(image_bgr, use_cls=self.use_cls)
        if not result:
            return ""
        return "".join(str(line[1]) for line in result if float(line[2]) >= self.text_score)

    def _targets(self, prompts: list[str], target: Sequence[str | None] | str | None) -> list[str | None]:
        n = len(prompts)
        if target is None:
            given: list[str | None] = [None] * n
        elif isinstance(target, str):
            given = [target] * n
        else:
            given = list(target)
            if len(given) != n:
                raise ValueError(f"reward 'ocr': meta target has {len(given)} entries for {n} images")
            for t in given:
                if t is not None and not isinstance(t, str):
                    raise TypeError(f"reward 'ocr': meta target entries must be strings or None, got {type(t)}")
        return [t if t is not None else extract_target(p) for t, p in zip(given, prompts)]

    def score_images(
        self, images: Tensor, prompts: list[str], target: Sequence[str | None] | str | None = None, **meta: Any
    ) -> dict[str, Tensor]:
        """OCR-score N images.

        Args:
            images: float [N, 3, H, W] in [0, 1] (non-finite values are zeroed; :meth:`forward` marks such
                samples invalid anyway).
            prompts: N strings (the target is their quoted text unless ``target`` gives it).
            target: optional N target strings (or None entries), or one string for all.
        Returns:
            ``{"reward": float [N], "edit_distance": float [N], "valid": bool [N]}`` on ``images.device``.
        """
        n = images.shape[0]
        targets = self._targets(prompts, target)
        u8 = torch.nan_to_num(images.detach().float(), nan=0.0).clamp(0, 1).mul(255).round().to(torch.uint8)
        bgr = u8.flip(1).permute(0, 2, 3, 1).contiguous().cpu().numpy()  # RGB -> BGR, [N, H, W, 3]
        reward = torch.full((n,), float("nan"))
        dist = torch.full((n,), float("nan"))
        valid = torch.zeros(n, dtype=torch.bool)
        for i, tgt in enumerate(targets):
            if tgt is None or not normalize_text(tgt):
                continue
            try:
                text = self.read_text(bgr[i])
            except Exception as exc:  # an engine failure is an invalid sample, never a fake score
                logger.warning("reward 'ocr': the OCR engine failed on an image (%dx%d); marking it invalid: %s: %s",
                               bgr.shape[2], bgr.shape[1], type(exc).__name__, exc)
                continue
            r, d = ocr_reward_from_text(text, tgt)
            reward[i], dist[i], valid[i] = r, float(d), True
        dev = images.device
        return {"reward": reward.to(dev), "edit_distance": dist.to(dev), "valid": valid.to(dev)}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, frames={self.frame_policy}, text_score={self.text_score}"
