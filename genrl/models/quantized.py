"""Low-precision rollout copies of a policy's transformer: layer policy, quantized Linears and the in-place refresh.

Sol-RL (Li, Chen, Xue et al. 2026, "FP4 Explore, BF16 Train", arXiv 2604.06916) previews many candidate samples with
a low-precision copy of the policy and trains on full-precision regenerations of a few of them. This module builds
that copy and keeps it equal to the live weights (docs/methods/sol_rl.md):

* :class:`RolloutPrecision` says how: a format, which Linear layers it applies to (the layer policy: by name and by
  size) and whether the copy is compiled.
* :func:`build_rollout_module` makes the copy: the live transformer deep-copied, each peft LoRA layer merged into a
  plain Linear (W0 + s B A), every eligible Linear replaced by a :class:`QuantizedLinear` (or, for the hardware FP8 /
  NVFP4 formats, quantized by torchao), and returns a :class:`LayerReport` (replaced / kept layers with the reason).
* :func:`refresh_rollout_module` re-quantizes the copy from the live weights after an optimizer step **in place**:
  every parameter keeps its object and its storage (a compiled graph or a CUDA graph of the copy stays valid; never
  rebinding is what pytorch/pytorch#120958 requires), and the result is bitwise what a fresh build from the same
  weights gives. LoRA deltas are always merged into the high-precision weight first and the sum quantized: adding a
  delta to quantized storage would drift.

Formats (``RolloutPrecision.format``):

==============  ===========================================================  ============================
format          what a Linear computes                                       runs on
==============  ===========================================================  ============================
``fp32``        float32 weight and matmul (the reference)                    any device
``bf16``        bfloat16 weight and matmul (AMX / tensor cores)               any device; 2x on AMX CPUs
``fp16``        float16 weight and matmul                                    GPU
``fp64``        float64 (a reference for tests)                              any device
``fake_fp8``    E4M3 row-wise (or tensor-wise) weight; per-token E4M3         any device (simulation)
                activations; float32 matmul of the dequantized values
``fake_nvfp4``  NVFP4 weight and activations (E2M1, blocks of 16, E4M3        any device (simulation)
                block scales, float32 tensor scale)
``fake_mxfp4``  MXFP4 weight and activations (E2M1, blocks of 32, E8M0)       any device (simulation)
``fake_mxfp8``  MXFP8 weight and activations (E4M3, blocks of 32, E8M0)       any device (simulation)
``fp8``         torchao Float8 dynamic activation + weight (row-wise)         CUDA, compute capability 8.9+
``nvfp4``       torchao NVFP4 dynamic activation + weight                     CUDA, compute capability 10.x
==============  ===========================================================  ============================

The simulated formats use the quantizers of :mod:`genrl.models.precision` (equal to torchao's reference
quantizers); they reproduce the formats' rounding error, not their speed. The ``bf16`` copy is the one that is
really faster on a CPU with AMX (measured in benchmarks/RESULTS.md; int8 dynamic quantization was slower there).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from genrl.models.precision import MX_BLOCK, NVFP4_BLOCK, fake_fp8, fake_mx, fake_nvfp4

logger = logging.getLogger(__name__)

__all__ = ["CAST_FORMATS", "DEFAULT_SKIP", "FAKE_FORMATS", "HARDWARE_FORMATS", "LayerReport", "QuantizedLinear",
           "RolloutPrecision", "build_rollout_module", "effective_linear", "refresh_rollout_module"]

CAST_FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
FAKE_FORMATS = ("fake_fp8", "fake_nvfp4", "fake_mxfp4", "fake_mxfp8")
HARDWARE_FORMATS = ("fp8", "nvfp4")

#: Name fragments (case-insensitive) of the modules kept in the live precision by default: embedders (patch, time,
#: text, position), the adaLN modulation, norms and the final projection (Sol-RL's and torchao's FLUX policies).
DEFAULT_SKIP = ("embed", "time", "t_block", "text_proj", "pooled_proj", "caption_proj", "context_embedder", "norm",
                "ada_ln", "adaln", "modulation", "final_layer", "proj_out")

# the block length a format quantizes along a Linear's input dim (its in_features must be a multiple)
_BLOCK = {"fake_nvfp4": NVFP4_BLOCK, "nvfp4": NVFP4_BLOCK, "fake_mxfp4": MX_BLOCK, "fake_mxfp8": MX_BLOCK,
          "fp8": 16}


@dataclass
class RolloutPrecision:
    """Precision of a rollout copy and its layer policy.

    Attributes:
        format: one of ``fp32``, ``bf16``, ``fp16``, ``fake_fp8``, ``fake_nvfp4``, ``fake_mxfp4``, ``fake_mxfp8``,
            ``fp8``, ``nvfp4`` (module docstring's table).
        skip: name fragments (case-insensitive substrings of a module's qualified name) of Linear layers kept in the
            live precision; None: :data:`DEFAULT_SKIP`; ``[]``: every Linear is eligible. Cast formats cast the
            whole copy and keep nothing (a non-empty ``skip`` is an error there).
        min_dim: Linear layers with ``max(in_features, out_features) <= min_dim`` are kept (Sol-RL: 2240 for SANA,
            2432 for SD3.5-L, 1000 for FLUX); 0 keeps none for size.
        activations: simulated formats also fake-quantize each Linear's input (W and A, as the hardware kernels do);
            False: weight-only.
        granularity: FP8 scale granularity, ``"row"`` (one scale per output row / token) or ``"tensor"``.
        compile: ``torch.compile`` the copy (default options), whatever the policy's own compile setting; a refresh
            never recompiles it.

    Raises:
        ValueError: an unknown format or granularity, a negative ``min_dim``, a non-empty ``skip`` (or ``min_dim``)
            with a cast format.
    """

    format: str = "bf16"
    skip: list[str] | None = None
    min_dim: int = 0
    activations: bool = True
    granularity: str = "row"
    compile: bool = False

    def __post_init__(self) -> None:
        known = (*CAST_FORMATS, *FAKE_FORMATS, *HARDWARE_FORMATS)
        if self.format not in known:
            raise ValueError(f"rollout precision format {self.format!r} is unknown; use one of {list(known)} (fake_* "
                             f"run anywhere, fp8 needs CUDA compute capability >= 8.9, nvfp4 needs 10.x)")
        if self.granularity not in ("row", "tensor"):
            raise ValueError(f"granularity must be 'row' or 'tensor', got {self.granularity!r}")
        if self.min_dim < 0:
            raise ValueError(f"min_dim must be >= 0, got {self.min_dim}")
        if self.format in CAST_FORMATS and self.min_dim:
            raise ValueError(f"rollout precision {self.format!r} casts the whole copy; min_dim {self.min_dim} would "
                             f"keep nothing; leave it 0, or use a simulated / hardware format")

        if self.format in CAST_FORMATS and self.skip:
            raise ValueError(f"rollout precision {self.format!r} casts the whole copy (its activations too), so it "
                             f"cannot keep layers {self.skip} in float32; leave skip unset (or []) for a cast format, "
                             f"or use a simulated / hardware format, whose layer policy keeps them")

    @property
    def skip_fragments(self) -> tuple[str, ...]:
        """The effective skip fragments, lower case: none for a cast format, :data:`DEFAULT_SKIP` when unset."""
        if self.format in CAST_FORMATS:
            return ()
        return tuple(s.lower() for s in (DEFAULT_SKIP if self.skip is None else self.skip))

    def eligible(self, name: str, linear: nn.Linear) -> tuple[bool, str]:
        """Whether the Linear ``name`` is quantized, and the reason when it is not."""
        low = name.lower()
        hit = next((s for s in self.skip_fragments if s in low), None)
        if hit is not None:
            return False, f"name matches {hit!r}"
        if max(linear.in_features, linear.out_features) <= self.min_dim:
            return False, f"max(in, out) = {max(linear.in_features, linear.out_features)} <= min_dim {self.min_dim}"
        block = _BLOCK.get(self.format)
        if block is not None and (linear.in_features % block or (self.format == "fp8" and linear.out_features % 16)):
            return False, f"in_features {linear.in_features} not a multiple of the {self.format} block {block}"
        return True, ""


@dataclass
class LayerReport:
    """Which Linear layers a rollout copy quantized (``replaced``) and which it kept (``kept``: name -> reason)."""

    format: str
    replaced: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"rollout copy in {self.format}: {len(self.replaced)} Linear layers quantized, {len(self.kept)} kept"]
        lines += [f"  kept {n}: {why}" for n, why in self.kept.items()]
        return "\n".join(lines)


def _fake_weight(w: torch.Tensor, fmt: str, granularity: str) -> torch.Tensor:
    """Fake-quantized weight [out, in] (float32 in, float32 out)."""
    if fmt == "fake_fp8":
        return fake_fp8(w, granularity)
    if fmt == "fake_nvfp4":
        return fake_nvfp4(w)
    return fake_mx(w, "fp4" if fmt == "fake_mxfp4" else "fp8")


class QuantizedLinear(nn.Module):
    """A Linear of a rollout copy in a cast or simulated low-precision format (see the module docstring).

    ``weight`` holds the format's values: the cast weight (cast formats) or the dequantized fake-quantized weight in
    float32 (simulated formats: every value lies on the format's grid times its scales). The forward casts the input
    [..., in_features] to the weight's dtype, fake-quantizes it (simulated formats with ``activations``; FP8 per
    token row, NVFP4 / MX per block along the features), multiplies and returns the input's dtype.

    Args:
        linear: the high-precision Linear (its weight and bias are quantized; it is not kept).
        fmt: a cast or simulated format name. granularity: FP8 scale granularity. activations: quantize inputs.
    """

    def __init__(self, linear: nn.Linear, fmt: str, granularity: str = "row", activations: bool = True) -> None:
        super().__init__()
        if fmt not in CAST_FORMATS and fmt not in FAKE_FORMATS:
            raise ValueError(f"QuantizedLinear format {fmt!r}: use a cast format {list(CAST_FORMATS)} or a simulated "
                             f"one {list(FAKE_FORMATS)}")
        self.fmt, self.granularity, self.activations = fmt, granularity, activations
        self.in_features, self.out_features = linear.in_features, linear.out_features
        dtype = CAST_FORMATS.get(fmt, torch.float32)
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty(linear.out_features, linear.in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(
            torch.empty(linear.out_features, dtype=dtype, device=device), requires_grad=False)
        self.refresh(linear.weight, linear.bias)

    def quantize_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The format's weight for a high-precision ``weight`` [out, in] (a new tensor, the parameter's dtype)."""
        if self.fmt in CAST_FORMATS:
            return weight.detach().to(self.weight.dtype)
        return _fake_weight(weight.detach().float(), self.fmt, self.granularity)

    @torch.no_grad()
    def refresh(self, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
        """Re-quantize from a high-precision ``weight`` [out, in] (and ``bias`` [out]) in place: the parameters keep
        their objects and storage. Returns max |new - old| of the stored weight (0.0 when unchanged).

        Raises:
            ValueError: a shape mismatch, or a bias given to a layer without one (or the reverse).
        """
        if tuple(weight.shape) != tuple(self.weight.shape):
            raise ValueError(f"refresh with a weight of shape {tuple(weight.shape)}; this layer is "
                             f"{tuple(self.weight.shape)}")
        if (bias is None) != (self.bias is None):
            raise ValueError("refresh: the bias of the live layer and of the rollout copy disagree")
        new = self.quantize_weight(weight).to(self.weight.device)
        delta = float((new.float() - self.weight.float()).abs().max()) if self.weight.numel() else 0.0
        self.weight.copy_(new)
        if bias is not None:
            self.bias.copy_(bias.detach())
        return delta

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the format's kernel sees it (dtype of the weight)."""
        x = x.to(self.weight.dtype)
        if self.fmt in CAST_FORMATS or not self.activations:
            return x
        if self.fmt == "fake_fp8":
            return fake_fp8(x, self.granularity)
        if self.fmt == "fake_nvfp4":
            return fake_nvfp4(x)
        return fake_mx(x, "fp4" if self.fmt == "fake_mxfp4" else "fp8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.quantize_input(x), self.weight, self.bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, "
                f"activations={self.activations}")


def _is_lora_layer(module: nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "get_delta_weight") and hasattr(module, "lora_A")


def effective_linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight [out, in] and bias [out] a Linear computes with, detached: for a peft LoRA layer the merged
    ``W0 + sum over active adapters of s B A`` (peft's ``get_delta_weight``; W0 alone when the adapters are disabled
    or already merged); for a plain Linear its own. Sharded (FSDP2 ``DTensor``) tensors are gathered whole (a
    collective). Raises TypeError for a module that is neither."""
    from genrl.models.sharding import full_tensor

    def whole(t):
        return None if t is None else (full_tensor(t).to(t.device) if type(t).__name__ == "DTensor" else t.detach())

    if _is_lora_layer(module):
        base = module.base_layer
        w = whole(base.weight)
        if not module.disable_adapters and not module.merged:
            for name in module.active_adapters:
                if name in module.lora_A:
                    w = w + whole(module.get_delta_weight(name)).to(w.dtype)
        return w, whole(base.bias)
    if isinstance(module, nn.Linear):
        return whole(module.weight), whole(module.bias)
    raise TypeError(f"expected a Linear or a peft LoRA Linear, got {type(module).__name__}")


def _merge_lora(module: nn.Module) -> nn.Module:
    """Replace every peft LoRA layer of ``module`` (in place) by a plain Linear holding the merged weight."""
    for name, child in list(module.named_children()):
        if _is_lora_layer(child):
            w, b = effective_linear(child)
            lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w)
                if b is not None:
                    lin.bias.copy_(b)
            setattr(module, name, lin)
        else:
            _merge_lora(child)
    for attr in ("_hf_peft_config_loaded", "peft_config"):  # the copy carries no adapter any more
        if attr in vars(module):
            delattr(module, attr)
    return module


def _set_child(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


def _torchao_config(precision: RolloutPrecision):
    """torchao's quantization config of a hardware format; raises RuntimeError naming what is missing."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"rollout precision {precision.format!r} runs torchao's hardware kernels and needs a CUDA "
                           f"GPU; on this machine use 'bf16' (faster than float32 on AMX CPUs only; else 'fp32') "
                           f"or a simulated format ('fake_fp8', 'fake_nvfp4', 'fake_mxfp4', 'fake_mxfp8')")
    cc = torch.cuda.get_device_capability()
    if precision.format == "fp8":
        if cc < (8, 9):
            raise RuntimeError(f"rollout precision 'fp8' needs compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                               f"this GPU has {cc}; use 'bf16' or 'fake_fp8'")
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

        gran = PerRow() if precision.granularity == "row" else PerTensor()
        # set_inductor_config=False: torchao's default rewrites inductor's global settings (coordinate-descent
        # tuning among them) for every later compile in the process; on one H200 that made the first compiled call
        # of a Wan2.1-1.3B fp8 copy take 188 s instead of about 12 s for a 1.4% faster forward (RESULTS.md, "GPU
        # suite"), and it would change how the trained model compiles too
        return Float8DynamicActivationFloat8WeightConfig(granularity=gran, set_inductor_config=False)
    if cc[0] != 10:
        raise RuntimeError(f"rollout precision 'nvfp4' needs a Blackwell datacenter GPU (compute capability 10.x); "
                           f"this GPU has {cc}; use 'fp8' on Hopper or 'fake_nvfp4' to study its error")
    from torchao.prototype.mx_formats import NVFP4DynamicActivationNVFP4WeightConfig

    return NVFP4DynamicActivationNVFP4WeightConfig()


def _warn_slow_cpu_cast(live: nn.Module, precision: RolloutPrecision) -> None:
    """Warn when a bf16 / fp16 copy will run on a CPU without AMX: there its matmuls are emulated and slower than
    float32 (measured 20x slower on an AVX2-only CPU at 8192x128x512; 1.8x faster on an AMX CPU)."""
    if precision.format not in ("bf16", "fp16"):
        return
    param = next(live.parameters(), None)
    if param is None or param.device.type != "cpu":
        return
    capability = str(torch.backends.cpu.get_cpu_capability())
    if "AMX" not in capability.upper():
        logger.warning("rollout precision %r on a CPU without AMX units (torch reports %s): %s matmuls are slower "
                       "than float32 here, so the preview copy costs more than the policy; use format 'fp32' on "
                       "this machine (or a GPU)", precision.format, capability, precision.format)


def build_rollout_module(live: nn.Module, precision: RolloutPrecision) -> tuple[nn.Module, LayerReport]:
    """A rollout copy of ``live`` (a transformer, LoRA adapters included) in ``precision``.

    The copy has no gradients, is in eval mode and has the live module's structure except that LoRA layers are
    merged Linears. Cast formats (``bf16``, ``fp16``, ``fp32``) cast the whole copy, so its activations flow in that
    dtype (as a diffusers ``.to(dtype)``; the layer policy keeps nothing there); simulated formats replace
    the eligible Linears by :class:`QuantizedLinear` and leave the rest in the live dtype; ``fp8`` / ``nvfp4``
    quantize the eligible Linears with torchao. A sharded live module must be gathered first (the
    rollout copy is never built from shards).

    Returns:
        (copy, report). Raises RuntimeError for a hardware format the machine lacks (see :class:`RolloutPrecision`).
    """
    _warn_slow_cpu_cast(live, precision)
    module = _merge_lora(copy.deepcopy(live)).requires_grad_(False).eval()
    report = LayerReport(precision.format)
    chosen = []
    for name, child in module.named_modules():
        if isinstance(child, nn.Linear):
            ok, why = precision.eligible(name, child)
            if ok:
                chosen.append(name)
            else:
                report.kept[name] = why
    report.replaced = chosen
    if precision.format in HARDWARE_FORMATS:
        from torchao.quantization import quantize_

        config = _torchao_config(precision)
        names = set(chosen)
        quantize_(module, config, filter_fn=lambda m, fqn: fqn in names)
    elif precision.format in CAST_FORMATS:
        # the whole copy in the cast dtype, its activations too: that is where the speed is
        module.to(CAST_FORMATS[precision.format])
    else:
        for name in chosen:
            _set_child(module, name, QuantizedLinear(module.get_submodule(name), precision.format,
                                                     precision.granularity, precision.activations))
    if precision.compile:
        module.compile()
    return module, report


@torch.no_grad()
def _refresh_hardware(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None,
                      precision: RolloutPrecision) -> float:
    """Re-quantize a torchao-quantized Linear in place: quantize a throwaway Linear with the same config and copy its
    quantized weight into the existing one (torchao tensors implement ``copy_`` for equal metadata)."""
    from torchao.quantization import quantize_

    tmp = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    tmp.weight.copy_(weight)
    quantize_(tmp, _torchao_config(precision))
    before = linear.weight.dequantize().float() if hasattr(linear.weight, "dequantize") else None
    linear.weight.copy_(tmp.weight)
    if bias is not None:
        linear.bias.copy_(bias)
    if before is None:
        return float("nan")
    return float((linear.weight.dequantize().float() - before).abs().max())


@torch.no_grad()
def refresh_rollout_module(module: nn.Module, live: nn.Module, precision: RolloutPrecision) -> dict[str, float]:
    """Make the rollout copy ``module`` (from :func:`build_rollout_module`) equal to what a fresh build from ``live``
    would give, in place (parameters keep their objects and storage; nothing is recompiled).

    Every Linear of the copy is re-quantized from the live layer's effective weight (LoRA merged,
    :func:`effective_linear`); every other parameter and buffer is copied by name (cast to the copy's dtype).

    Returns:
        ``{"seconds": wall time, "max_weight_change": max |new - old| over the quantized / cast Linear weights}``.
    Raises:
        KeyError: ``live`` lacks a layer or tensor of the copy (the copy belongs to another module).
    """
    start = time.perf_counter()
    inner = getattr(module, "_orig_mod", module)
    live_modules = dict(live.named_modules())
    done: set[str] = set()
    change = 0.0
    hardware = _hardware_names(inner) if precision.format in HARDWARE_FORMATS else set()
    for name, child in inner.named_modules():
        if not isinstance(child, nn.Linear | QuantizedLinear):
            continue
        src = live_modules.get(name)
        if src is None or not (isinstance(src, nn.Linear) or _is_lora_layer(src)):
            raise KeyError(f"the live module has no Linear {name!r}: the rollout copy belongs to another module")
        w, b = effective_linear(src)
        if isinstance(child, QuantizedLinear):
            change = max(change, child.refresh(w, b))
        elif name in hardware:
            change = max(change, _refresh_hardware(child, w, b, precision))
        else:
            change = max(change, float((w.to(child.weight.dtype).float() - child.weight.float()).abs().max()))
            child.weight.copy_(w)
            if b is not None:
                child.bias.copy_(b)
        done.update(f"{name}.{p}" if name else p for p in ("weight", "bias"))
    tensors = {**dict(live.named_parameters()), **dict(live.named_buffers())}
    for name, t in [*inner.named_parameters(), *inner.named_buffers()]:
        if name in done:
            continue
        key = name if name in tensors else _base_layer_name(name)
        if key not in tensors:
            raise KeyError(f"the live module has no tensor {name!r}: the rollout copy belongs to another module")
        s = tensors[key]
        t.copy_(s.full_tensor() if type(s).__name__ == "DTensor" else s.detach())
    return {"seconds": time.perf_counter() - start, "max_weight_change": change}


def _base_layer_name(name: str) -> str:
    """``a.b.weight`` -> ``a.b.base_layer.weight`` (where a peft LoRA layer keeps the tensor in the live module)."""
    head, _, leaf = name.rpartition(".")
    return f"{head}.base_layer.{leaf}" if head else name


def _hardware_names(module: nn.Module) -> set[str]:
    """Names of the Linears whose weight is a torchao quantized tensor (a subclass, not a plain tensor)."""
    return {n for n, m in module.named_modules()
            if isinstance(m, nn.Linear) and type(m.weight.data) not in (torch.Tensor, nn.Parameter)}
