"""Frechet Video Distance (Unterthiner et al. 2018) on Kinetics-400 I3D features.

Protocol (StyleGAN-V, Skorokhodov et al. 2022; VideoGPT / TATS for the state-dict model): clips of 16
consecutive frames, each frame resized to 224 x 224, the 400-d pre-softmax logits of the Kinetics-400 I3D of
Carreira & Zisserman 2017 as features, float64 mean and covariance, the Frechet distance of
:func:`genrl.eval.frechet.frechet_distance`; the reference sample size is 2048 clips per set.

Two interchangeable weights files (nothing is downloaded; :func:`load_i3d` takes a local path):

- ``i3d_pretrained_400.pt`` (VideoGPT / TATS, 50.9 MB): a state dict for :class:`InceptionI3d` (the module and
  key names of piergiaj/pytorch-i3d). Frames are resized (shortest side, bilinear, centre crop) and scaled to
  [-1, 1] here, as VideoGPT's FVD code does.
- ``i3d_torchscript.pt`` (StyleGAN-V, about 50 MB): TorchScript; called as StyleGAN-V calls it, on uint8
  clips ``[B, 3, T, H, W]`` with ``rescale=True, resize=True, return_features=True`` (the model scales and
  resizes to 224 itself).

The two files give close but not identical numbers (different weights ports and resizing); a report always
names the extractor and its sha256, and :func:`fvd` refuses to compare statistics of different extractors.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genrl.eval.frechet import FeatureStats, extractor_identity, file_sha256, frechet_report, module_sha256

__all__ = ["InceptionI3d", "I3DExtractor", "load_i3d", "FVDSettings", "video_clips", "video_feature_stats",
           "fvd", "I3D_FILES"]

#: where the I3D weights come from (for error messages; genrl never downloads them)
I3D_FILES = (
    "i3d_pretrained_400.pt (the Kinetics-400 I3D state dict of VideoGPT / TATS, 50.9 MB; see "
    "github.com/wilson1yan/VideoGPT) or StyleGAN-V's i3d_torchscript.pt (TorchScript, about 50 MB; see "
    "github.com/universome/stylegan-v, src/metrics/frechet_video_distance.py)"
)

#: Inception blocks of I3D in order: name and output channels of (b0, b1a, b1b, b2a, b2b, b3b)
#: (Carreira & Zisserman 2017, Fig. 3; Szegedy et al. 2015 Table 1, inflated to 3-D)
_MIXED: dict[str, tuple[int, int, int, int, int, int]] = {
    "Mixed_3b": (64, 96, 128, 16, 32, 32),
    "Mixed_3c": (128, 128, 192, 32, 96, 64),
    "Mixed_4b": (192, 96, 208, 16, 48, 64),
    "Mixed_4c": (160, 112, 224, 24, 64, 64),
    "Mixed_4d": (128, 128, 256, 24, 64, 64),
    "Mixed_4e": (112, 144, 288, 32, 64, 64),
    "Mixed_4f": (256, 160, 320, 32, 128, 128),
    "Mixed_5b": (256, 160, 320, 32, 128, 128),
    "Mixed_5c": (384, 192, 384, 48, 128, 128),
}


def _same_pad(sizes: Sequence[int], kernel: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """TensorFlow "SAME" padding as ``F.pad`` wants it for [B, C, T, H, W]: (w_front, w_back, h_f, h_b, t_f, t_b).

    Per axis the total is ``max(k - s, 0)`` when the size is divisible by the stride, else
    ``max(k - size % s, 0)``; the smaller half goes in front (output size ``ceil(size / s)``)."""
    pads: list[int] = []
    for n, k, s in zip(reversed(sizes), reversed(kernel), reversed(stride)):
        total = max(k - s, 0) if n % s == 0 else max(k - n % s, 0)
        pads += [total // 2, total - total // 2]
    return tuple(pads)


class Unit3D(nn.Module):
    """Conv3d (no bias, TF "same" padding computed per input) + BatchNorm3d + ReLU: I3D's basic unit.

    Submodules ``conv3d`` and ``bn`` (the key names of piergiaj/pytorch-i3d). The logits layer is a Unit3D
    with a bias, no batch norm and no activation.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: Sequence[int] = (1, 1, 1),
                 stride: Sequence[int] = (1, 1, 1), batch_norm: bool = True, activation: bool = True,
                 bias: bool = False, bn_eps: float = 1e-5) -> None:
        super().__init__()
        self.kernel, self.stride, self.activation = tuple(kernel), tuple(stride), activation
        self.conv3d = nn.Conv3d(in_channels, out_channels, self.kernel, self.stride, padding=0, bias=bias)
        if batch_norm:
            self.bn = nn.BatchNorm3d(out_channels, eps=bn_eps, momentum=0.01)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv3d(F.pad(x, _same_pad(x.shape[2:], self.kernel, self.stride)))
        if hasattr(self, "bn"):
            x = self.bn(x)
        return F.relu(x) if self.activation else x


class MaxPool3dSame(nn.Module):
    """Max pooling with TF "same" padding; pads with zeros as the reference port does (its inputs follow a
    ReLU, so zeros never win over real values and the result equals TF's -inf padding)."""

    def __init__(self, kernel: Sequence[int], stride: Sequence[int]) -> None:
        super().__init__()
        self.kernel, self.stride = tuple(kernel), tuple(stride)

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool3d(F.pad(x, _same_pad(x.shape[2:], self.kernel, self.stride)), self.kernel, self.stride)


class InceptionModule(nn.Module):
    """An inflated Inception block: 1x1 | 1x1 -> 3x3x3 | 1x1 -> 3x3x3 | 3x3x3 max-pool -> 1x1, concatenated
    along channels (submodules ``b0, b1a, b1b, b2a, b2b, b3a, b3b``)."""

    def __init__(self, in_channels: int, out: Sequence[int], bn_eps: float) -> None:
        super().__init__()
        self.b0 = Unit3D(in_channels, out[0], bn_eps=bn_eps)
        self.b1a = Unit3D(in_channels, out[1], bn_eps=bn_eps)
        self.b1b = Unit3D(out[1], out[2], (3, 3, 3), bn_eps=bn_eps)
        self.b2a = Unit3D(in_channels, out[3], bn_eps=bn_eps)
        self.b2b = Unit3D(out[3], out[4], (3, 3, 3), bn_eps=bn_eps)
        self.b3a = MaxPool3dSame((3, 3, 3), (1, 1, 1))
        self.b3b = Unit3D(in_channels, out[5], bn_eps=bn_eps)
        self.out_channels = out[0] + out[2] + out[4] + out[5]

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.b0(x), self.b1b(self.b1a(x)), self.b2b(self.b2a(x)), self.b3b(self.b3a(x))], dim=1)


class InceptionI3d(nn.Module):
    """The Kinetics-400 Inflated 3D ConvNet (I3D, RGB stream) of Carreira & Zisserman 2017 ("Quo Vadis, Action
    Recognition?"), with the module and state-dict key names of piergiaj/pytorch-i3d, so VideoGPT / TATS's
    ``i3d_pretrained_400.pt`` loads with ``strict=True`` (``Conv3d_1a_7x7.conv3d.weight``,
    ``Mixed_3b.b1b.bn.running_mean``, ``logits.conv3d.bias``, ...; 344 entries at width 1).

    Layers: Conv3d_1a_7x7 (stride 2) - MaxPool3d_2a_3x3 - Conv3d_2b_1x1 - Conv3d_2c_3x3 - MaxPool3d_3a_3x3 -
    Mixed_3b, 3c - MaxPool3d_4a_3x3 - Mixed_4b..4f - MaxPool3d_5a_2x2 - Mixed_5b, 5c - average pool (2, 7, 7)
    - logits (1x1x1 conv with bias). Every convolution and max-pool pads like TensorFlow's "SAME".

    Args:
        num_classes: logits size (400 for Kinetics-400).
        width: channel multiplier, each count ``max(1, round(c * width))``. 1.0 is the real network;
            e.g. 0.125 is a small I3D-shaped random extractor for tests (same layers and key names).
        in_channels: input channels (3, RGB).
        bn_eps: BatchNorm epsilon. 1e-5 is what VideoGPT / TATS (and so their published FVDs) run
            ``i3d_pretrained_400.pt`` with; piergiaj's port and the TF original use 1e-3. No effect on keys.
    Input: float [B, 3, T, H, W] in [-1, 1] (16 x 224 x 224 in the FVD protocol).
    Output: float [B, num_classes], the logits averaged over the remaining time (and space) positions. At
        16 x 224 x 224 the average pool's window covers the final 2 x 7 x 7 map exactly, as in the reference;
        smaller inputs pool over the whole (smaller) map, larger ones average the pooled positions.
    No dropout: this module extracts features (the reference's dropout is inactive in eval mode).
    Raises:
        ValueError: bad num_classes / width, or an input that is not [B, in_channels, T, H, W].
    """

    def __init__(self, num_classes: int = 400, width: float = 1.0, in_channels: int = 3,
                 bn_eps: float = 1e-5) -> None:
        super().__init__()
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
        if not (isinstance(width, (int, float)) and math.isfinite(width) and width > 0):
            raise ValueError(f"width must be a positive number (1.0 = the real I3D), got {width!r}")
        self.num_classes, self.width, self.in_channels = int(num_classes), float(width), int(in_channels)

        def c(n: int) -> int:
            return max(1, int(round(n * self.width)))

        self.Conv3d_1a_7x7 = Unit3D(in_channels, c(64), (7, 7, 7), (2, 2, 2), bn_eps=bn_eps)
        self.MaxPool3d_2a_3x3 = MaxPool3dSame((1, 3, 3), (1, 2, 2))
        self.Conv3d_2b_1x1 = Unit3D(c(64), c(64), bn_eps=bn_eps)
        self.Conv3d_2c_3x3 = Unit3D(c(64), c(192), (3, 3, 3), bn_eps=bn_eps)
        self.MaxPool3d_3a_3x3 = MaxPool3dSame((1, 3, 3), (1, 2, 2))
        channels = c(192)
        for name, out in _MIXED.items():
            if name == "Mixed_4b":
                self.MaxPool3d_4a_3x3 = MaxPool3dSame((3, 3, 3), (2, 2, 2))
            if name == "Mixed_5b":
                self.MaxPool3d_5a_2x2 = MaxPool3dSame((2, 2, 2), (2, 2, 2))
            block = InceptionModule(channels, [c(o) for o in out], bn_eps)
            setattr(self, name, block)
            channels = block.out_channels
        self.logits = Unit3D(channels, self.num_classes, batch_norm=False, activation=False, bias=True)
        self.feature_channels = channels
        self._init_weights()
        self._endpoints = ["Conv3d_1a_7x7", "MaxPool3d_2a_3x3", "Conv3d_2b_1x1", "Conv3d_2c_3x3",
                           "MaxPool3d_3a_3x3", "Mixed_3b", "Mixed_3c", "MaxPool3d_4a_3x3", "Mixed_4b", "Mixed_4c",
                           "Mixed_4d", "Mixed_4e", "Mixed_4f", "MaxPool3d_5a_2x2", "Mixed_5b", "Mixed_5c"]

    def _init_weights(self) -> None:
        """He-normal convolutions (fan-in, ReLU gain) and a 1 / sqrt(fan-in) logits layer with zero bias, so a
        random (untrained) I3D keeps its activations at unit scale through all 57 units and gives features
        that vary with the input; pretrained weights replace all of this."""
        for name, module in self.named_modules():
            if isinstance(module, nn.Conv3d):
                if name.startswith("logits"):
                    nn.init.normal_(module.weight, std=module.weight[0].numel() ** -0.5)
                else:
                    nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 5 or x.shape[1] != self.in_channels:
            raise ValueError(f"InceptionI3d expects float [B, {self.in_channels}, T, H, W] in [-1, 1], got shape "
                             f"{tuple(x.shape)} (for [B, T, C, H, W] clips use x.permute(0, 2, 1, 3, 4))")
        for name in self._endpoints:
            x = getattr(self, name)(x)
        window = (min(2, x.shape[2]), min(7, x.shape[3]), min(7, x.shape[4]))
        x = self.logits(F.avg_pool3d(x, window, stride=1))
        return x.mean(dim=(2, 3, 4))


def _check_clips(clips: Tensor) -> None:
    if not isinstance(clips, Tensor) or clips.ndim != 5 or clips.shape[2] != 3:
        shape = tuple(clips.shape) if isinstance(clips, Tensor) else type(clips).__name__
        raise ValueError(f"clips must be uint8 [B, T, 3, H, W], got {shape}")
    if clips.dtype != torch.uint8:
        raise TypeError(f"clips must be uint8 in [0, 255], got {clips.dtype}; convert genrl pixels with "
                        "(x.clamp(0, 1) * 255).round().to(torch.uint8)")


def _resize_center_crop(frames: Tensor, size: int) -> Tensor:
    """VideoGPT's FVD resize: shortest side to ``size`` (bilinear, align_corners=False, no antialias; the long
    side ``ceil(long * size / short)``), then a centre crop at ``(long - size) // 2``. float [N, C, H, W]."""
    h, w = frames.shape[-2:]
    if (h, w) != (size, size):
        scale = size / min(h, w)
        target = (size, math.ceil(w * scale)) if h <= w else (math.ceil(h * scale), size)
        frames = F.interpolate(frames, size=target, mode="bilinear", align_corners=False)
        h, w = frames.shape[-2:]
        top, left = (h - size) // 2, (w - size) // 2
        frames = frames[..., top : top + size, left : left + size]
    return frames


class I3DExtractor:
    """FVD features from an I3D: uint8 clips ``[B, T, 3, H, W]`` -> float64 ``[B, D]`` on the CPU.

    ``kind="state_dict"`` (an :class:`InceptionI3d`): frames to [0, 1], resized to ``resolution`` squared
    (shortest side bilinear + centre crop, VideoGPT's preprocessing), scaled to [-1, 1], ``[B, 3, T, H, W]``.
    ``kind="torchscript"`` (StyleGAN-V's file): clips go in as uint8 ``[B, 3, T, H, W]`` at their own size and
    the model is called ``model(x, rescale=True, resize=True, return_features=True)``, exactly as StyleGAN-V's
    metric does; it always works at 224, so ``resolution`` must be 224.

    Attributes:
        name: ``"i3d_state_dict"`` / ``"i3d_torchscript"`` (or the name given).
        sha256: of the weights file; for an in-memory model, of its state dict (:func:`module_sha256`).
        feature_dim: D (400 for the Kinetics-400 models).
        resolution: default frame side; batch_size: clips per forward pass; device; source: the file or None.
    Use :func:`load_i3d` for files and :meth:`from_module` for an in-memory :class:`InceptionI3d`.
    """

    def __init__(self, model: nn.Module | Any, kind: str, name: str, sha256: str, feature_dim: int,
                 resolution: int = 224, batch_size: int = 8, device: str | torch.device = "cpu",
                 source: str | None = None) -> None:
        if kind not in ("state_dict", "torchscript"):
            raise ValueError(f"kind must be 'state_dict' or 'torchscript', got {kind!r}")
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        for param in self.model.parameters():  # (ScriptModules have no requires_grad_)
            param.requires_grad_(False)
        self.kind, self.name, self.sha256 = kind, name, sha256
        self.feature_dim, self.resolution, self.batch_size = int(feature_dim), int(resolution), int(batch_size)
        self.source = source

    @classmethod
    def from_module(cls, model: InceptionI3d, name: str = "i3d_state_dict", resolution: int = 224,
                    batch_size: int = 8, device: str | torch.device = "cpu") -> I3DExtractor:
        """Wrap an in-memory :class:`InceptionI3d` (e.g. a small random one); sha256 of its state dict."""
        if not isinstance(model, InceptionI3d):
            raise TypeError(f"model must be an InceptionI3d, got {type(model).__name__}")
        return cls(model, "state_dict", name, module_sha256(model), model.num_classes, resolution=resolution,
                   batch_size=batch_size, device=device)

    def preprocess(self, clips: Tensor, resolution: int | None = None) -> Tensor:
        """State-dict path input: uint8 [B, T, 3, H, W] -> float32 [B, 3, T, r, r] in [-1, 1]."""
        _check_clips(clips)
        r = self.resolution if resolution is None else int(resolution)
        b, t = clips.shape[:2]
        x = clips.reshape(b * t, *clips.shape[2:]).float().div_(255.0)
        x = _resize_center_crop(x, r)
        x = x.reshape(b, t, 3, r, r).permute(0, 2, 1, 3, 4)
        return (x * 2.0 - 1.0).contiguous()

    @torch.no_grad()
    def __call__(self, clips: Tensor, resolution: int | None = None) -> Tensor:
        """Features of uint8 clips [B, T, 3, H, W]: float64 [B, D] on the CPU, in batches of ``batch_size``.

        Raises:
            ValueError / TypeError: clips not uint8 [B, T, 3, H, W]; a resolution other than 224 for TorchScript.
        """
        _check_clips(clips)
        if self.kind == "torchscript" and resolution not in (None, 224):
            raise ValueError(f"the TorchScript I3D resizes to 224 itself; resolution={resolution} is not "
                             "possible with it (use 224, or the state-dict I3D for other sizes)")
        out = []
        for start in range(0, clips.shape[0], self.batch_size):
            chunk = clips[start : start + self.batch_size]
            if self.kind == "torchscript":
                x = chunk.permute(0, 2, 1, 3, 4).contiguous().to(self.device)  # uint8 [B, 3, T, H, W]
                feats = self.model(x, rescale=True, resize=True, return_features=True)
                if isinstance(feats, (tuple, list)):
                    feats = feats[0]
            else:
                feats = self.model(self.preprocess(chunk, resolution).to(self.device))
            out.append(feats.reshape(chunk.shape[0], -1).double().cpu())
        return torch.cat(out)

    def __repr__(self) -> str:
        return (f"I3DExtractor(name={self.name!r}, kind={self.kind!r}, sha256={self.sha256[:12]}..., "
                f"feature_dim={self.feature_dim}, source={self.source!r})")


def _is_torchscript(path: Path) -> bool:
    """TorchScript archives hold ``code/`` and ``constants.pkl``; ``torch.save`` archives hold ``data.pkl`` only."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("/constants.pkl") or "/code/" in n for n in z.namelist())


def load_i3d(path: str | Path, device: str | torch.device = "cpu", batch_size: int = 8, resolution: int = 224,
             bn_eps: float = 1e-5) -> I3DExtractor:
    """Load a Kinetics-400 I3D from a local file, choosing by what the file is.

    A TorchScript archive (StyleGAN-V's ``i3d_torchscript.pt``) is loaded with ``torch.jit.load``; anything else
    must be a state dict for :class:`InceptionI3d` (VideoGPT / TATS's ``i3d_pretrained_400.pt``; a
    ``module.`` prefix from DataParallel is stripped), loaded with ``weights_only=True`` and ``strict=True``;
    its width and class count are read from the weights (``Conv3d_1a_7x7`` and ``logits``).
    Nothing is downloaded.

    Args:
        path: the weights file. device: where the model runs. batch_size: clips per forward pass.
        resolution: frame side for the state-dict model (224 in the protocol). bn_eps: see :class:`InceptionI3d`.
    Raises:
        FileNotFoundError: no file at ``path`` (the message says which files work and where they come from).
        ValueError: a state dict that does not fit :class:`InceptionI3d` (the message lists key mismatches).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no I3D weights at {str(path)!r}. genrl downloads nothing: put {I3D_FILES} there "
                                "and pass its path")
    sha = file_sha256(path)
    if _is_torchscript(path):
        model = torch.jit.load(str(path), map_location="cpu")
        return I3DExtractor(model, "torchscript", "i3d_torchscript", sha, 400, resolution=224,
                            batch_size=batch_size, device=device, source=str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or "Conv3d_1a_7x7.conv3d.weight" not in {k.removeprefix("module.") for k in state}:
        raise ValueError(f"{str(path)!r} is neither TorchScript nor an InceptionI3d state dict (no "
                         f"'Conv3d_1a_7x7.conv3d.weight'); expected {I3D_FILES}")
    state = {k.removeprefix("module."): v for k, v in state.items()}
    width = state["Conv3d_1a_7x7.conv3d.weight"].shape[0] / 64
    num_classes = state["logits.conv3d.weight"].shape[0] if "logits.conv3d.weight" in state else 400
    model = InceptionI3d(num_classes=num_classes, width=width, bn_eps=bn_eps)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{str(path)!r} does not match InceptionI3d(num_classes={num_classes}, width={width:g}): "
                         f"{err}") from None
    return I3DExtractor(model, "state_dict", "i3d_state_dict", sha, num_classes, resolution=resolution,
                        batch_size=batch_size, device=device, source=str(path))


@dataclass(frozen=True)
class FVDSettings:
    """The FVD protocol (defaults: StyleGAN-V's, 2048 clips of 16 frames at 224 px).

    Attributes:
        num_frames: frames per clip (16).
        resolution: frame side fed to the state-dict I3D (224; settable, e.g. small for tests).
        stride: frame step inside a clip (1 = consecutive frames; StyleGAN-V's ``subsample_factor``).
        clips_per_video: clips taken per video: an int k (the first k non-overlapping windows, fewer if the
            video is shorter) or ``"all"`` (every non-overlapping window).
        min_frames: videos with fewer (strided) frames than this are refused; from ``min_frames`` up to
            ``num_frames`` one clip is made by repeating the last frame (recorded in the statistics' meta).
        warn_below: a set smaller than this gets a bias warning (2048, the protocol's N).
        comparable_min: a set smaller than this makes the result non-comparable (256).
    Raises:
        ValueError: non-positive values, min_frames > num_frames, or a bad clips_per_video.
    """

    num_frames: int = 16
    resolution: int = 224
    stride: int = 1
    clips_per_video: int | str = 1
    min_frames: int = 10
    warn_below: int = 2048
    comparable_min: int = 256

    def __post_init__(self) -> None:
        for name in ("num_frames", "resolution", "stride", "min_frames", "warn_below", "comparable_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FVDSettings.{name} must be a positive int, got {v!r}")
        if self.min_frames > self.num_frames:
            raise ValueError(f"FVDSettings.min_frames={self.min_frames} exceeds num_frames={self.num_frames}")
        cpv = self.clips_per_video
        if cpv != "all" and (isinstance(cpv, bool) or not isinstance(cpv, int) or cpv < 1):
            raise ValueError(f"FVDSettings.clips_per_video must be a positive int or 'all', got {cpv!r}")

    def as_dict(self) -> dict[str, Any]:
        """The settings as plain JSON data (for statistics meta and cache keys)."""
        return asdict(self)


def _as_uint8_video(frames: Tensor) -> Tensor:
    if not isinstance(frames, Tensor) or frames.ndim != 4 or frames.shape[1] != 3:
        shape = tuple(frames.shape) if isinstance(frames, Tensor) else type(frames).__name__
        hint = " (channels-last? use frames.permute(0, 3, 1, 2))" if isinstance(frames, Tensor) and \
            frames.ndim == 4 and frames.shape[-1] == 3 else ""
        raise ValueError(f"a video must be [T, 3, H, W] (uint8, or float in [0, 1]), got {shape}{hint}")
    if frames.dtype == torch.uint8:
        return frames
    if frames.is_floating_point():
        lo, hi = float(frames.min()), float(frames.max())
        if not (lo >= 0.0 and hi <= 1.0):
            raise ValueError(f"float video frames must be in [0, 1] (genrl pixels), got range [{lo:g}, {hi:g}]")
        return (frames * 255.0).round().to(torch.uint8)
    raise TypeError(f"video frames must be uint8 or float in [0, 1], got {frames.dtype}")


def _clips(frames: Tensor, settings: FVDSettings) -> tuple[list[Tensor], int]:
    """The clips of one video and how many frames were padded."""
    frames = _as_uint8_video(frames)
    t = int(frames.shape[0])
    seq = frames[:: settings.stride]
    n = int(seq.shape[0])
    nf = settings.num_frames
    if n < settings.min_frames:
        need = (settings.min_frames - 1) * settings.stride + 1
        raise ValueError(f"a video of {t} frames is too short for FVD: at stride {settings.stride} it gives {n} "
                         f"frames, fewer than min_frames={settings.min_frames} (the protocol uses {nf}-frame "
                         f"clips). Generate or read at least {need} frames (better "
                         f"{(nf - 1) * settings.stride + 1}), or drop this video")
    if n < nf:
        pad = nf - n
        return [torch.cat([seq, seq[-1:].expand(pad, *seq.shape[1:])])], pad
    windows = n // nf
    k = windows if settings.clips_per_video == "all" else min(int(settings.clips_per_video), windows)
    return [seq[i * nf : (i + 1) * nf] for i in range(k)], 0


def video_clips(frames: Tensor, settings: FVDSettings | None = None) -> list[Tensor]:
    """Cut one video into FVD clips.

    The video is strided (``frames[::stride]``) and cut into non-overlapping windows of ``num_frames`` from
    the start: the first ``clips_per_video`` of them (or all). A video whose strided length L is in
    ``[min_frames, num_frames)`` gives one clip padded by repeating its last frame (StyleGAN-V instead drops
    videos shorter than 16 frames; :func:`video_feature_stats` records the padding in the meta).

    Args:
        frames: uint8 [T, 3, H, W] in [0, 255], or float [T, 3, H, W] in [0, 1] (rounded to uint8).
        settings: the protocol (default :class:`FVDSettings`).
    Returns:
        list of uint8 [num_frames, 3, H, W] clips (views where possible).
    Raises:
        ValueError: L < min_frames (the message gives the video length and the fix), or a bad shape / range.
        TypeError: frames neither uint8 nor float.
    """
    return _clips(frames, settings or FVDSettings())[0]


def video_feature_stats(extractor: I3DExtractor | Any, videos: Iterable[Tensor],
                        settings: FVDSettings | None = None, progress: bool = True) -> FeatureStats:
    """I3D feature statistics of a set of videos under the FVD protocol.

    Each video is cut by :func:`video_clips`; clips are batched (``extractor.batch_size``, default 8; a batch
    is flushed when the frame size changes) and passed to ``extractor`` (an :class:`I3DExtractor` is given
    ``resolution=settings.resolution``; any other callable mapping uint8 [B, T, 3, H, W] to [B, D] also works
    and must carry ``name`` / ``sha256`` or be an ``nn.Module``).

    Returns:
        :class:`FeatureStats` over all clips, meta ``{"extractor", "extractor_sha256", "settings", "n_clips",
        "n_videos", "n_padded_videos"}``.
    Raises:
        ValueError: fewer than 2 clips in all, a video under ``min_frames``, or malformed videos.
    """
    from tqdm.auto import tqdm

    settings = settings or FVDSettings()
    name, sha = extractor_identity(extractor)
    batch_size = int(getattr(extractor, "batch_size", 8))
    kwargs = {"resolution": settings.resolution} if isinstance(extractor, I3DExtractor) else {}
    feats: list[Tensor] = []
    batch: list[Tensor] = []
    n_videos = n_padded = 0

    def flush() -> None:
        out = extractor(torch.stack(batch), **kwargs)
        feats.append(torch.as_tensor(out).detach().reshape(len(batch), -1).double().cpu())
        batch.clear()

    for video in tqdm(videos, desc=f"FVD features ({name})", unit="video", disable=not progress):
        clips, pad = _clips(video, settings)
        n_videos += 1
        n_padded += pad > 0
        for clip in clips:
            if batch and (clip.shape != batch[0].shape or len(batch) >= batch_size):
                flush()
            batch.append(clip)
    if batch:
        flush()
    if not feats:
        raise ValueError("no videos were given; FVD needs at least 2 clips per set")
    features = torch.cat(feats)
    meta = {"extractor": name, "extractor_sha256": sha, "settings": settings.as_dict(),
            "n_clips": int(features.shape[0]), "n_videos": n_videos, "n_padded_videos": int(n_padded)}
    return FeatureStats.from_features(features, meta)


def fvd(real: FeatureStats, fake: FeatureStats, warn_below: int | None = None,
        comparable_min: int | None = None) -> dict[str, Any]:
    """FVD between real and generated clip statistics (:func:`video_feature_stats`).

    Returns ``{"fvd", "n_real", "n_fake", "extractor", "extractor_sha256", "comparable", "warnings"}``
    (see :func:`genrl.eval.frechet.frechet_report`). ``warn_below`` / ``comparable_min`` default to the
    values in ``real``'s settings, else :class:`FVDSettings`'s (2048 / 256): below 2048 clips a set gets
    "FVD is biased upward at N=...; the standard protocol uses 2048 clips" (also as a Python warning), below
    256 the result is marked non-comparable.

    Raises:
        ValueError: different extractors or protocol settings for the two sets.
    """
    saved = real.meta.get("settings") if isinstance(real.meta.get("settings"), dict) else {}
    default = FVDSettings()
    return frechet_report(
        real, fake, metric="fvd",
        warn_below=int(warn_below if warn_below is not None else saved.get("warn_below", default.warn_below)),
        comparable_min=int(comparable_min if comparable_min is not None
                           else saved.get("comparable_min", default.comparable_min)),
        standard="the standard protocol uses 2048 clips",
    )
