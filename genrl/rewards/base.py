"""The reward protocol every genrl reward implements (DESIGN.md section 3, research/rewards_eval.md 5.1).

A reward is a ``torch.nn.Module`` called as::

    out = reward(pixels, prompts, **meta)   # pixels float [B, T, C, H, W] in [0, 1], len(prompts) == B

and returns ``dict[str, Tensor[B]]``: the float32 main key ``"reward"`` (after the instance's affine
``scale * raw + shift``), any further named float32 keys (``dimensions``), and a bool ``"valid"``.

Failures are NaN, never 0: a sample whose pixels contain NaN / inf, or whose main score is NaN, gets
``valid = False`` and keeps NaN in every key, so statistics can exclude it instead of learning from a fake
zero. Other keys may be NaN by design where an attribute does not apply to a sample (each reward documents
which); that does not make the sample invalid.

Subclasses implement :meth:`RewardModel.score` only; the protocol (input checks, no-grad for
non-differentiable rewards, NaN / valid handling, scale / shift) lives in :meth:`RewardModel.forward`,
which ``__call__`` runs.
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["RewardModel", "RANGE_TOLERANCE"]

#: How far outside [0, 1] pixel values may lie (float rounding of decoders) before the input is rejected.
RANGE_TOLERANCE = 1e-3


class RewardModel(torch.nn.Module, metaclass=abc.ABCMeta):
    """Base class of genrl rewards.

    Class attributes (set by subclasses):
        name: registry name (set by :func:`genrl.rewards.register_reward`).
        differentiable: True only if the whole path from pixels to the score keeps the autograd graph;
            then :meth:`saliency` works and ``forward`` runs with grad enabled. False rewards run under
            ``torch.no_grad()``.
        dimensions: the float output keys ``score`` returns, ``"reward"`` first.
        higher_is_better: direction of the main key.
        channels: accepted channel counts C.

    Args:
        scale, shift: affine applied to the main key: ``reward = scale * raw + shift`` (replaces the
            hard-coded divisors of reference code, e.g. PickScore / 26). Other keys are left raw.

    Raises:
        ValueError: non-finite ``scale`` or ``shift``.
    """

    name: ClassVar[str] = ""
    differentiable: ClassVar[bool] = False
    dimensions: ClassVar[tuple[str, ...]] = ("reward",)
    higher_is_better: ClassVar[bool] = True
    channels: ClassVar[tuple[int, ...]] = (1, 3)

    def __init__(self, scale: float = 1.0, shift: float = 0.0) -> None:
        super().__init__()
        if not (math.isfinite(scale) and math.isfinite(shift)):
            raise ValueError(f"{self._label()}: scale and shift must be finite, got scale={scale}, shift={shift}")
        self.scale = float(scale)
        self.shift = float(shift)

    def _label(self) -> str:
        return f"reward {self.name!r}" if self.name else type(self).__name__

    # ------------------------------------------------------------------ to implement
    @abc.abstractmethod
    def score(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        """Score a validated batch.

        Args:
            pixels: float ``[B, T, C, H, W]``, finite values in [0, 1] (rows with NaN / inf may occur: they
                are masked afterwards, so they only need not crash).
            prompts: B strings.
            **meta: reward-specific extras.

        Returns:
            ``{"reward": float [B], <other dimensions>: float [B], optionally "valid": bool [B]}`` on the
            input's device. ``"reward"`` is the raw score (before scale / shift).
        """

    # ------------------------------------------------------------------ protocol
    def validate(self, pixels: Tensor, prompts: list[str]) -> None:
        """Check the input contract.

        Raises:
            TypeError: pixels not a tensor, or prompts not a list / tuple of strings.
            ValueError: wrong rank, channel count, dtype, value range (beyond ``RANGE_TOLERANCE``; NaN is
                allowed and handled as invalid), or ``len(prompts) != B``. Messages name the offending
                shape / value and the fix.
        """
        who = self._label()
        if not isinstance(pixels, Tensor):
            raise TypeError(f"{who}: pixels must be a torch.Tensor [B, T, C, H, W] in [0, 1], got {type(pixels)}")
        shape = tuple(pixels.shape)
        if pixels.ndim != 5:
            hint = " For images add a frame axis: pixels.unsqueeze(1)." if pixels.ndim == 4 else ""
            raise ValueError(f"{who}: pixels must be [B, T, C, H, W] (rank 5), got shape {shape}.{hint}")
        if shape[2] not in self.channels:
            hint = ""
            if shape[1] in self.channels:
                hint = " It looks like [B, C, T, H, W]: use pixels.permute(0, 2, 1, 3, 4)."
            raise ValueError(
                f"{who}: pixels must be [B, T, C, H, W] with C in {self.channels}, got C={shape[2]} "
                f"in shape {shape}.{hint}"
            )
        if not pixels.is_floating_point():
            raise ValueError(
                f"{who}: pixels must be a float tensor in [0, 1], got dtype {pixels.dtype}; "
                f"for uint8 frames use pixels.float() / 255"
            )
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
            raise TypeError(f"{who}: prompts must be a list of strings, got {type(prompts).__name__}")
        if len(prompts) != shape[0]:
            raise ValueError(f"{who}: got {len(prompts)} prompts for a batch of {shape[0]} videos (shape {shape})")
        if pixels.numel() == 0:
            return
        with torch.no_grad():
            finite = torch.isfinite(pixels)
            if finite.any():
                lo = float(pixels[finite].min())
                hi = float(pixels[finite].max())
                if lo < -RANGE_TOLERANCE or hi > 1 + RANGE_TOLERANCE:
                    if lo < -RANGE_TOLERANCE and lo >= -1 - RANGE_TOLERANCE and hi <= 1 + RANGE_TOLERANCE:
                        fix = "they look like [-1, 1]: use (pixels + 1) / 2"
                    elif hi > 1.5 and hi <= 255 + RANGE_TOLERANCE and lo >= -RANGE_TOLERANCE:
                        fix = "they look like [0, 255]: use pixels / 255"
                    else:
                        fix = "clamp or rescale them to [0, 1]"
                    raise ValueError(f"{who}: pixel values must be in [0, 1], got min {lo:.4g}, max {hi:.4g}; {fix}")

    def forward(self, pixels: Tensor, prompts: list[str], **meta: Any) -> dict[str, Tensor]:
        """Validate, score, apply ``scale`` / ``shift`` to ``"reward"``, and attach ``"valid"``.

        Args:
            pixels: float ``[B, T, C, H, W]`` in [0, 1] (an image is T = 1), any device.
            prompts: B strings.
            **meta: passed to :meth:`score`.

        Returns:
            ``dict[str, Tensor[B]]``: float32 ``"reward"`` and the other ``dimensions``, bool ``"valid"``.
            Samples with non-finite pixels or a NaN main score are NaN in every float key and invalid.

        Raises:
            TypeError, ValueError: see :meth:`validate`.
            RuntimeError: ``score`` broke the output contract (a bug in the reward).
        """
        self.validate(pixels, prompts)
        prompts = list(prompts)
        b = pixels.shape[0]
        with torch.no_grad():
            bad_pixels = ~torch.isfinite(pixels.detach()).reshape(b, -1).all(dim=1)
        ctx = contextlib.nullcontext() if self.differentiable else torch.no_grad()
        with ctx:
            raw = self.score(pixels, prompts, **meta)
        if not isinstance(raw, dict) or "reward" not in raw:
            raise RuntimeError(f"{self._label()}: score() must return a dict with a 'reward' key, got {type(raw)}")
        out: dict[str, Tensor] = {}
        sub_valid = raw.get("valid")
        for key, value in raw.items():
            if key == "valid":
                continue
            if not isinstance(value, Tensor) or tuple(value.shape) != (b,):
                got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise RuntimeError(f"{self._label()}: score()[{key!r}] must be a tensor of shape ({b},), got {got}")
            out[key] = value.float()
        out["reward"] = out["reward"] * self.scale + self.shift
        bad = bad_pixels.to(out["reward"].device)
        nan = torch.full((), float("nan"), device=bad.device)
        for key in out:
            out[key] = torch.where(bad, nan, out[key])
        valid = torch.isfinite(out["reward"].detach()) & ~bad
        if sub_valid is not None:
            valid = valid & sub_valid.to(device=valid.device, dtype=torch.bool)
            out["reward"] = torch.where(valid, out["reward"], nan)
        out["valid"] = valid
        return out

    def saliency(self, pixels: Tensor, prompts: list[str], key: str = "reward", **meta: Any) -> Tensor:
        """Gradient of ``sum(out[key])`` with respect to the pixels (per-sample d reward / d pixels).

        Returns:
            float tensor shaped like ``pixels``.

        Raises:
            NotImplementedError: the reward is not differentiable (names the reward).
            KeyError: ``key`` is not an output of the reward.
        """
        if not self.differentiable:
            raise NotImplementedError(
                f"{self._label()} is not differentiable, so it has no saliency; use a differentiable reward "
                f"(differentiable=True) for reward-gradient methods"
            )
        x = pixels.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            out = self(x, prompts, **meta)
            if key not in out:
                raise KeyError(f"{self._label()} has no output {key!r}; outputs: {', '.join(out)}")
            (grad,) = torch.autograd.grad(out[key].nansum(), x, allow_unused=True)
        return torch.zeros_like(x) if grad is None else grad

    def extra_repr(self) -> str:
        return f"name={self.name!r}, differentiable={self.differentiable}, scale={self.scale}, shift={self.shift}"
