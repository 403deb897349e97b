"""Sigma schedules for sampling, the timestep shift, and training-time sigma samplers.

sigma in [0, 1] (0 = data, 1 = noise); diffusers models take timestep = 1000 * sigma.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import torch

__all__ = [
    "NUM_TRAIN_TIMESTEPS",
    "shift_sigmas",
    "sigma_schedule",
    "sigmas_to_timesteps",
    "timesteps_to_sigmas",
    "TimestepSampler",
]

NUM_TRAIN_TIMESTEPS = 1000
"""diffusers' timestep scale: timestep = 1000 * sigma."""

_S = TypeVar("_S", float, torch.Tensor)


def _check_shift(shift: float) -> float:
    if isinstance(shift, bool) or not isinstance(shift, (int, float)):
        raise TypeError(f"shift must be a python float, got {type(shift).__name__}")
    if not (math.isfinite(shift) and shift > 0):
        raise ValueError(f"shift must be a finite number > 0, got {shift}")
    return float(shift)


def shift_sigmas(sigma: _S, shift: float) -> _S:
    """Apply the timestep shift ``sigma' = s * sigma / (1 + (s - 1) * sigma)``.

    The map is monotone on [0, 1] and fixes 0 and 1 exactly. ``shift > 1`` moves mass towards noise
    (used for high resolutions / long videos: SD3 uses 3.0, Wan 5.0 at 720p), ``shift < 1`` towards
    data, ``shift == 1`` is the identity (exactly). Shifts compose multiplicatively:
    ``shift_sigmas(shift_sigmas(x, a), b) == shift_sigmas(x, a * b)``.

    Args:
        sigma: noise level(s) in [0, 1]: a python float or a tensor of any shape. Float tensors
            keep their dtype; integer tensors are converted to float32.
        shift: the shift factor s, a finite python float > 0.

    Returns:
        The shifted sigma, a python float for a float input, else a tensor of the input's shape.

    Raises:
        ValueError: ``shift`` is not finite or not > 0.
        TypeError: ``shift`` is not a number.

    Source: Esser et al. 2024, SD3, §5.3.2 "resolution-dependent shifting of timestep schedules"
    (t_m = sqrt(m/n) t_n / (1 + (sqrt(m/n) - 1) t_n), with s = sqrt(m/n)).
    """
    s = _check_shift(shift)
    if isinstance(sigma, torch.Tensor) and not sigma.is_floating_point():
        sigma = sigma.to(torch.float32)
    if s == 1.0:
        return sigma.clone() if isinstance(sigma, torch.Tensor) else float(sigma)
    # s * sigma / (1 + (s - 1) * sigma), written so that sigma = 0 and 1 map to exactly 0 and 1
    scaled = s * sigma
    return scaled / (scaled + (1 - sigma))


def sigma_schedule(
    num_steps: int,
    shift: float = 1.0,
    sigma_max: float = 1.0,
    sigma_min: float = 0.0,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Sampling schedule: ``num_steps + 1`` descending sigmas ending at exactly 0.

    ``linspace(sigma_max, sigma_min, num_steps + 1)`` is shifted with `shift_sigmas`, then the last
    entry is set to exactly 0.0, so the final step always lands on clean data. With the default
    ``sigma_min = 0`` that entry is already 0; with ``sigma_min > 0`` the grid is spaced as if it
    ended at sigma_min and the final step jumps from ``shift(grid[-2])`` to 0. Step i goes from
    ``sigmas[i]`` to ``sigmas[i + 1]`` (num_steps model evaluations).

    Args:
        num_steps: number of sampling steps, an int >= 1.
        shift: timestep shift s > 0 (1 = none).
        sigma_max: the unshifted starting sigma, in (sigma_min, 1].
        sigma_min: the unshifted lower end of the grid, in [0, sigma_max).
        device: device of the result (default CPU).

    Returns:
        Tensor [num_steps + 1], float64, strictly decreasing, ``[0] = shift(sigma_max)``, ``[-1] = 0.0``.

    Raises:
        ValueError: ``num_steps < 1``, ``shift <= 0``, or not ``0 <= sigma_min < sigma_max <= 1``.

    Source: Euler sampling grid of Esser et al. 2024 (SD3) / diffusers FlowMatchEulerDiscreteScheduler,
    with the SD3 §5.3.2 shift.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    _check_shift(shift)
    if not 0.0 <= sigma_min < sigma_max <= 1.0:
        raise ValueError(
            f"need 0 <= sigma_min < sigma_max <= 1, got sigma_min={sigma_min}, sigma_max={sigma_max}"
        )
    grid = torch.linspace(sigma_max, sigma_min, num_steps + 1, dtype=torch.float64, device=device)
    sigmas = shift_sigmas(grid, shift)
    sigmas[-1] = 0.0
    return sigmas


def sigmas_to_timesteps(sigmas: _S) -> _S:
    """Convert sigma in [0, 1] to diffusers' timestep in [0, 1000]: ``timestep = 1000 * sigma``.

    Args:
        sigmas: a python float or a tensor (any shape; dtype kept, integer tensors become float32).

    Returns:
        The timesteps, same type / shape as the input.

    Source: diffusers FlowMatchEulerDiscreteScheduler (num_train_timesteps = 1000), used by SD3,
    FLUX, Wan and SANA transformers.
    """
    if isinstance(sigmas, torch.Tensor) and not sigmas.is_floating_point():
        sigmas = sigmas.to(torch.float32)
    return sigmas * NUM_TRAIN_TIMESTEPS


def timesteps_to_sigmas(timesteps: _S) -> _S:
    """Inverse of `sigmas_to_timesteps`: ``sigma = timestep / 1000``.

    Args:
        timesteps: a python float or a tensor in [0, 1000] (dtype kept, integers become float32).

    Returns:
        sigma in [0, 1], same type / shape as the input.

    Source: diffusers FlowMatchEulerDiscreteScheduler convention.
    """
    if isinstance(timesteps, torch.Tensor) and not timesteps.is_floating_point():
        timesteps = timesteps.to(torch.float32)
    return timesteps / NUM_TRAIN_TIMESTEPS


SamplerKind = Literal["uniform", "logit_normal", "shifted", "clamped"]
_KINDS: tuple[str, ...] = ("uniform", "logit_normal", "shifted", "clamped")


@dataclass(frozen=True)
class TimestepSampler:
    """Training-time sampler of sigma (the flow-matching time), one draw per element of ``shape``.

    A draw is made in three stages:

    1. a base value u in [0, 1]:
       * ``"uniform"``, ``"shifted"``, ``"clamped"``: u ~ U[0, 1);
       * ``"logit_normal"``: u = sigmoid(n), n ~ N(logit_mean, logit_std^2)
         (Esser et al. 2024, SD3, §3.1 eq. 19; mean 0 / std 1 are the SD3 defaults);
    2. if ``shift != 1``: u = shift(u) with ``sigma' = s u / (1 + (s - 1) u)`` (SD3 §5.3.2), for
       every kind; ``"shifted"`` names this choice in configs (uniform + shift);
    3. mapped affinely into the allowed range: sigma = sigma_min + (sigma_max - sigma_min) * u
       (then clamped to [sigma_min, sigma_max] against round-off). With the default range [0, 1]
       this is the identity. ``"clamped"`` is uniform on [sigma_min, sigma_max], the timestep
       range restriction of DMD-style distillation (Yin et al. 2024); it equals ``"uniform"`` with
       the same range and exists so configs can say what they mean.

    Fields:
        kind: one of "uniform", "logit_normal", "shifted", "clamped".
        logit_mean: mean of the normal before the sigmoid (logit_normal only).
        logit_std: std of that normal, > 0.
        shift: timestep shift s > 0 (1 = none).
        sigma_min, sigma_max: output range, 0 <= sigma_min < sigma_max <= 1.

    Raises (at construction):
        ValueError: unknown kind, logit_std <= 0 or not finite, shift <= 0 or not finite,
            sigma_min >= sigma_max, or a range bound outside [0, 1]; the message names the value.
    """

    kind: SamplerKind = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    sigma_min: float = 0.0
    sigma_max: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"TimestepSampler.kind must be one of {_KINDS}, got {self.kind!r}")
        if not math.isfinite(self.logit_mean):
            raise ValueError(f"TimestepSampler.logit_mean must be finite, got {self.logit_mean}")
        if not (math.isfinite(self.logit_std) and self.logit_std > 0):
            raise ValueError(f"TimestepSampler.logit_std must be a finite number > 0, got {self.logit_std}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"TimestepSampler.shift must be a finite number > 0, got {self.shift}")
        for name in ("sigma_min", "sigma_max"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"TimestepSampler.{name} must lie in [0, 1], got {value}")
        if not self.sigma_min < self.sigma_max:
            raise ValueError(
                f"TimestepSampler needs sigma_min < sigma_max, got sigma_min={self.sigma_min}, "
                f"sigma_max={self.sigma_max}"
            )

    def __call__(
        self,
        shape: int | Sequence[int] | torch.Size,
        generator: torch.Generator | None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Draw sigmas.

        Args:
            shape: output shape, e.g. ``B`` for one sigma per sample or ``(B, T)`` per frame.
            generator: the source of randomness. Draws are made on the generator's device and
                then moved to ``device``, so a given generator state yields the same sigmas for
                any target device. ``None`` uses torch's global RNG (interactive use only; library
                code always passes a generator: docs/architecture.md, Seeds and noise addressing).
            device: device of the result (default: the generator's device, or CPU).

        Returns:
            float32 tensor of ``shape`` with values in [sigma_min, sigma_max].
        """
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        draw_device = generator.device if generator is not None else (device or "cpu")
        kw = dict(generator=generator, device=draw_device, dtype=torch.float32)
        if self.kind == "logit_normal":
            u = torch.sigmoid(torch.randn(shape, **kw) * self.logit_std + self.logit_mean)
        else:
            u = torch.rand(shape, **kw)
        if self.shift != 1.0:
            u = shift_sigmas(u, self.shift)
        sigma = self.sigma_min + (self.sigma_max - self.sigma_min) * u
        sigma = sigma.clamp(self.sigma_min, self.sigma_max)
        return sigma.to(device) if device is not None else sigma
