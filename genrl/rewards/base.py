"""The reward protocol every genrl reward implements (docs/rewards.md, The protocol).

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
from collections.abc import Sequence
from pathlib import Path
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
    #: files a local weights folder must hold, ``{relative path: what it is}`` (empty: no weights); the
    #: manifest check (``genrl rewards check``) and :meth:`require_weights` read it.
    weight_files: ClassVar[dict[str, str]] = {}
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

    @classmethod
    def missing_weights(cls, path: str | Path | None, **kwargs: Any) -> list[str]:
        """The entries of :attr:`weight_files` absent under ``path`` (all of them when ``path`` is None or not
        a folder); empty for rewards without weights. ``kwargs`` are the reward's constructor arguments from
        its config (a reward whose files may live elsewhere, e.g. VideoAlign's ``base_model``, overrides this)."""
        if not cls.weight_files:
            return []
        folder = Path(path).expanduser() if path is not None else None
        if folder is None or not folder.is_dir():
            return list(cls.weight_files)
        return [f for f in cls.weight_files if not any(folder.glob(f))]

    @classmethod
    def require_weights(cls, path: str | Path | None) -> Path:
        """Check a local weights folder before loading anything; returns it resolved.

        Raises:
            FileNotFoundError: ``path`` is None, missing, or lacks files; the message lists every expected file
                with what it is, and marks the missing ones.
        """
        label = f"reward {cls.name!r}" if cls.name else cls.__name__
        missing = cls.missing_weights(path)
        if not missing:
            return Path(path).expanduser()
        layout = "\n".join(f"  {'MISSING ' if f in missing else 'ok      '}{f}  ({what})"
                           for f, what in cls.weight_files.items())
        where = "no path given (set path: in the reward's config)" if path is None else (
            f"{str(path)!r} is not a folder" if not Path(path).expanduser().is_dir() else f"{str(path)!r}")
        raise FileNotFoundError(f"{label}: weights not found: {where}; expected a local folder with:\n{layout}\n"
                                f"nothing is downloaded: place these files there (see genrl/rewards/README.md)")

    def saliency(
        self, pixels: Tensor, prompts: list[str], dims: Sequence[str] | None = None,
        out_shape: tuple[int, int, int] | None = None, **meta: Any,
    ) -> dict[str, Tensor]:
        """Per-pixel input-gradient maps of differentiable rewards (Stream-R1's saliency, docs/planned.md):
        for each output key m, ``S_m = || d sum_b out[m][b] / d pixels ||_2`` over the channel axis.

        Args:
            pixels: float [B, T, C, H, W] in [0, 1]; prompts: B strings.
            dims: output keys to differentiate (default: the main key ``"reward"``).
            out_shape: optional (F, H', W'): each map is resized trilinearly to it (e.g. the latent grid).
        Returns:
            ``{key: float32 [B, T, H, W]}`` (or [B, F, H', W']), non-negative; the reward's own parameters get
            no gradient.

        Raises:
            NotImplementedError: the reward is not differentiable (names the reward).
            KeyError: a key of ``dims`` is not an output of the reward.
        """
        if not self.differentiable:
            raise NotImplementedError(
                f"{self._label()} is not differentiable, so it has no saliency; use a differentiable reward "
                f"(differentiable=True) for reward-gradient methods"
            )
        dims = list(dims) if dims is not None else ["reward"]
        x = pixels.detach().clone().requires_grad_(True)
        maps: dict[str, Tensor] = {}
        with torch.enable_grad():
            out = self(x, prompts, **meta)
            for i, key in enumerate(dims):
                if key not in out or key == "valid":
                    raise KeyError(f"{self._label()} has no output {key!r}; outputs: {', '.join(out)}")
                (grad,) = torch.autograd.grad(out[key].nansum(), x, allow_unused=True,
                                              retain_graph=i < len(dims) - 1)
                grad = torch.zeros_like(x) if grad is None else grad
                m = grad.float().norm(dim=2)  # [B, T, H, W]
                if out_shape is not None:
                    m = torch.nn.functional.interpolate(m.unsqueeze(1), size=tuple(out_shape), mode="trilinear",
                                                        align_corners=False).squeeze(1)
                maps[key] = m.detach()
        return maps

    def extra_repr(self) -> str:
        return f"name={self.name!r}, differentiable={self.differentiable}, scale={self.scale}, shift={self.shift}"
