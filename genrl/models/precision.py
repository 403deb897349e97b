"""Simulated ("fake") low-precision number formats for a quantized copy of a generator's weights (Sol-RL rollouts).

Each ``fake_*`` function maps a floating-point tensor to the nearest values that a low-precision format can hold and
returns them in the input's dtype and shape: the quantization error of the format, without its storage or its
kernels. Pure torch; runs on CPU (and on any device torch runs on). The formats:

* FP8 E4M3 (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"; torch.float8_e4m3fn): 1 sign, 4 exponent,
  3 mantissa bits, bias 7, no infinities, largest finite 448 (:data:`E4M3_MAX`), smallest normal 2^-6, smallest
  subnormal 2^-9. :func:`fake_fp8` scales by a per-row or per-tensor amax.
* FP4 E2M1 (the element of OCP MX v1.0 section 5.3.3 and of NVFP4): 1 sign, 2 exponent, 1 mantissa bit, bias 1;
  the non-negative values are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (:func:`e2m1_grid`, :data:`E2M1_MAX`). :func:`round_e2m1`.
* NVFP4 (NVIDIA, Blackwell): E2M1 elements in blocks of 16 along the last dim, one E4M3 scale per block and one
  float32 scale per tensor (amax / (448 * 6), so the largest block scale lands at the top of the E4M3 range).
  :func:`nvfp4_quantize`, :func:`nvfp4_dequantize`, :func:`fake_nvfp4`.
* MXFP4 / MXFP8 (OCP Microscaling Formats (MX) Specification v1.0, 2023): E2M1 or E4M3 elements in blocks of 32
  along the last dim sharing one power-of-two E8M0 scale X = 2^(floor(log2(amax)) - emax) (section 6.3).
  :func:`mx_quantize`, :func:`fake_mx`.

All rounding is round-to-nearest, ties to even, and every conversion saturates at the element format's largest
finite value (the MX spec's and NVIDIA's conversion rule); nothing here relies on what torch's float8 cast does with
an out-of-range value. :func:`sqnr_db` measures the result.
"""

from __future__ import annotations

import math

import torch

__all__ = ["E2M1_MAX", "E4M3_MAX", "E4M3_MIN_NORMAL", "NVFP4_BLOCK", "MX_BLOCK", "e2m1_grid", "round_e2m1",
           "fake_fp8", "nvfp4_quantize", "nvfp4_dequantize", "fake_nvfp4", "mx_quantize", "fake_mx", "sqnr_db"]

#: Largest finite FP4 E2M1 value (0b0111 = 1.5 * 2^2).
E2M1_MAX = 6.0
#: Largest finite FP8 E4M3 value (torch.float8_e4m3fn: 0b0_1111_110 = 1.75 * 2^8; the all-ones code is NaN).
E4M3_MAX = 448.0
#: Smallest normal FP8 E4M3 value (2^-6); NVFP4 block scales of non-zero blocks are kept at or above it.
E4M3_MIN_NORMAL = 2.0**-6
#: NVFP4 block length (elements sharing one E4M3 scale).
NVFP4_BLOCK = 16
#: OCP MX block length k (section 5: k = 32 for every MX-compliant format).
MX_BLOCK = 32

# emax: exponent of the largest power of two the element format holds (OCP MX v1.0 table 1): E2M1 4 = 2^2,
# E4M3 256 = 2^8.
_MX_ELEMENTS = {"fp4": (2, E2M1_MAX), "fp8": (8, E4M3_MAX)}
# E8M0 (OCP MX v1.0 section 5.4.1): unsigned exponent, bias 127, exponents -127..127 (255 is NaN).
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


def _check_float(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """``x`` [..., K] as float32 [..., K / block, block]; ValueError naming the shape if K is not a multiple."""
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"{what} quantizes blocks of {block} along the last dim, whose length must be a multiple "
                         f"of {block}; got a tensor of shape {tuple(x.shape)}")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x``, already clamped to [-448, 448] (or NaN), cast to float8_e4m3fn (round to nearest even). Every
    E4M3 cast of this module goes through here: callers saturate first, since torch's own cast of an out-of-range
    value changed across versions (eager casts up to torch 2.11 gave NaN, later ones saturate)."""
    return x.to(torch.float8_e4m3fn)


def e2m1_grid() -> torch.Tensor:
    """The 8 non-negative FP4 E2M1 values, ascending: float32 [8] = [0, 0.5, 1, 1.5, 2, 3, 4, 6].

    Codes 0b000..0b111 (exponent bits ee, mantissa bit m, bias 1): ee = 0 is subnormal, m * 0.5; otherwise
    2^(ee - 1) * (1 + m / 2). OCP MX v1.0 section 5.3.3.
    """
    return torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (already scaled) to the nearest signed FP4 E2M1 value, ties to even, saturating at +-6.

    Args:
        x: a float16 / bfloat16 / float32 / float64 tensor, any shape (float8 inputs raise torch's RuntimeError:
            torch does not promote float8 types).

    Returns:
        A tensor of ``x``'s dtype and shape whose values are in {0, +-0.5, +-1, +-1.5, +-2, +-3, +-4, +-6}.
        Ties go to the value with an even mantissa bit (0, 1, 2, 4): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
        1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (IEEE 754 roundTiesToEven). |x| > 6, +-inf included, gives +-6
        (OCP MX v1.0 section 5.3.3: FP4 has no inf / NaN and conversions saturate). NaN stays NaN. The sign is kept,
        so a negative value that rounds to zero gives -0.0 (a zero).

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
    """
    _check_float(x)
    work = torch.promote_types(x.dtype, torch.float32)
    a = x.to(work).abs().clamp(max=E2M1_MAX)
    # spacing of the grid around a: 0.5 on [0, 2) (subnormals and the first binade), 1 on [2, 4), 2 on [4, 6].
    # a / step is exact (power-of-two step) and torch.round rounds half to even; an even multiple of the step is
    # exactly a value with an even mantissa bit, so this is roundTiesToEven on the E2M1 grid.
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    q = torch.round(a / step) * step
    return torch.copysign(q, x.to(work)).to(x.dtype)


def fake_fp8(x: torch.Tensor, granularity: str = "row", amax: torch.Tensor | float | None = None) -> torch.Tensor:
    """Fake FP8 E4M3 quantization with an amax scale (Micikevicius et al. 2022): ``q(x / s) * s``, ``s = amax / 448``.

    Args:
        x: floating-point tensor [..., K] (at least 1-d for ``"row"``).
        granularity: ``"row"``: one scale per row (amax over the last dim, per output channel of a Linear weight
            [out, in]); ``"tensor"``: one scale for the whole tensor.
        amax: optional calibrated amax instead of the one of ``x`` (a float, or a tensor broadcastable to
            ``x.shape[:-1] + (1,)`` for ``"row"`` / a scalar for ``"tensor"``), e.g. from a delayed-scaling
            history; values of ``x`` beyond it saturate. When None, the amax of the finite values of ``x``.

    Returns:
        A tensor of ``x``'s dtype and shape: ``s * e4m3(clamp(x / s, -448, 448))``, the E4M3 cast rounding to
        nearest even. Values whose |x / s| exceeds 448, +-inf included, give +-448 * s (saturation is done by the
        explicit clamp, not by the cast). Rows (or a tensor) with amax 0 give zeros; NaN stays NaN; nothing else
        gives NaN. For |x / s| in the normal range [2^-6, 448] the relative error is at most 2^-4.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: unknown ``granularity``, or ``"row"`` on a 0-d tensor.
    """
    _check_float(x)
    if granularity not in ("row", "tensor"):
        raise ValueError(f"granularity must be 'row' or 'tensor', got {granularity!r}")
    if granularity == "row" and x.dim() == 0:
        raise ValueError("granularity='row' needs a tensor of at least 1 dim, got a 0-d tensor")
    xf = x.to(torch.float32)
    if amax is None:
        finite_abs = torch.where(torch.isfinite(xf), xf.abs(), 0.0)
        amax_t = finite_abs.amax(dim=-1, keepdim=True) if granularity == "row" else finite_abs.amax()
    else:
        amax_t = torch.as_tensor(amax, dtype=torch.float32, device=xf.device).abs()
    scale = amax_t / E4M3_MAX
    safe = torch.where(scale > 0, scale, 1.0)  # amax 0: x is 0 there (or amax was given as 0: saturate to 0)
    scaled = torch.clamp(xf / safe, -E4M3_MAX, E4M3_MAX)
    q = _to_e4m3(scaled).to(torch.float32)
    return (q * scale).to(x.dtype)


def nvfp4_quantize(x: torch.Tensor, tensor_scale: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to NVFP4: E2M1 elements, one E4M3 scale per block of 16 along the last dim, a float32 tensor
    scale (NVIDIA's NVFP4 format, Blackwell tensor cores; two-level scaling).

    With amax the largest |x| of the tensor and b the largest |x| of a block:

    * tensor scale ``t = amax / (448 * 6)`` (``tensor_scale=True``; 1.0 if amax is 0) or ``t = 1.0``;
    * block scale ``s = e4m3(clamp(b / 6 / t, 2^-6, 448))`` for b > 0, and 0 for an all-zero block (a block scale
      is never an E4M3 subnormal, so a tiny non-zero block is not flushed to zero);
    * elements ``e = round_e2m1(x * ((1 / t) / s))`` (saturating at +-6; 0 in an all-zero block), so that
      ``x ~= e * s * t``. The element scaling multiplies by the per-block encode scale 1 / (s t), as NVIDIA's
      kernels do (torchao's reference quantizer gives bit-identical results).

    Args:
        x: float32 / bfloat16 / float16 / float64 tensor [..., K], K a multiple of 16; computed in float32;
            expected finite (an infinite value makes the tensor scale inf: its value is NaN, every other value
            0, and the dequantized tensor all NaN; a NaN element stays NaN in place, the others are unaffected).
        tensor_scale: use the per-tensor float32 scale (True) or block scales only (t = 1; the block scale then has
            to carry the tensor's magnitude, and small weights land on the coarse low end of E4M3).

    Returns:
        ``(values, block_scale, tensor_scale)``: values float32 [..., K] on the signed E2M1 grid (|values| <= 6);
        block_scale float8_e4m3fn [..., K / 16], in [2^-6, 448] or 0; tensor_scale float32 0-d tensor > 0.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: ``x`` is 0-d or its last dim is not a multiple of 16 (the message names the shape).
    """
    _check_float(x)
    xb = _blocks(x, NVFP4_BLOCK, "NVFP4")  # [..., K/16, 16] float32
    if tensor_scale:
        amax = xb.abs().amax()
        t = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), 1.0)
    else:
        t = torch.ones((), dtype=torch.float32, device=xb.device)
    block_amax = xb.abs().amax(dim=-1)  # [..., K/16]
    s32 = _to_e4m3(torch.clamp(block_amax / E2M1_MAX / t, E4M3_MIN_NORMAL, E4M3_MAX)).to(torch.float32)
    s32 = torch.where(block_amax > 0, s32, 0.0)
    encode = torch.where(s32 > 0, (1.0 / t) / torch.where(s32 > 0, s32, 1.0), 0.0)
    values = round_e2m1(xb * encode.unsqueeze(-1)).reshape(x.shape)
    return values, _to_e4m3(s32), t


def nvfp4_dequantize(values: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor | float
                     ) -> torch.Tensor:
    """Inverse of :func:`nvfp4_quantize`: ``values * (tensor_scale * block_scale)`` per block of 16.

    Args:
        values: float tensor [..., K] (E2M1 values), K a multiple of 16.
        block_scale: tensor [..., K / 16] (float8_e4m3fn, or any float dtype).
        tensor_scale: float32 scalar (0-d tensor or float).

    Returns:
        float32 tensor [..., K].

    Raises:
        ValueError: K is not a multiple of 16, or ``block_scale``'s shape is not ``values.shape[:-1] + (K / 16,)``.
    """
    vb = _blocks(values, NVFP4_BLOCK, "NVFP4")
    if tuple(block_scale.shape) != tuple(vb.shape[:-1]):
        raise ValueError(f"block_scale of shape {tuple(block_scale.shape)} does not match values of shape "
                         f"{tuple(values.shape)} (expected {tuple(vb.shape[:-1])})")
    t = torch.as_tensor(tensor_scale, dtype=torch.float32, device=vb.device)
    scale = t * block_scale.to(torch.float32)
    return (vb * scale.unsqueeze(-1)).reshape(values.shape)


def fake_nvfp4(x: torch.Tensor, tensor_scale: bool = True) -> torch.Tensor:
    """``nvfp4_dequantize(*nvfp4_quantize(x, tensor_scale))`` in ``x``'s dtype and shape (see :func:`nvfp4_quantize`
    for the format, the arguments and the errors raised). Idempotent: fake_nvfp4(fake_nvfp4(x)) == fake_nvfp4(x)."""
    return nvfp4_dequantize(*nvfp4_quantize(x, tensor_scale)).to(x.dtype)


def mx_quantize(x: torch.Tensor, element: str = "fp4", block: int = MX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to an MX format (OCP Microscaling Formats (MX) Specification v1.0, 2023): blocks of ``block``
    elements along the last dim sharing one E8M0 (power-of-two) scale.

    Per block with amax b (section 6.3): ``X = 2^(floor(log2(b)) - emax)`` (emax 2 for FP4 E2M1, 8 for FP8 E4M3),
    the exponent clamped to E8M0's [-127, 127] (an all-zero block gets 2^-127); elements ``P_i = quantize(V_i / X)``,
    rounding to nearest even and saturating at the element's largest value (6 for E2M1, 448 for E4M3). As the spec
    notes, the block's largest element can round down to the saturated value (floor scale).

    Args:
        x: float tensor [..., K], K a multiple of ``block``; computed in float32; expected finite (a non-finite
            value makes its block NaN).
        element: ``"fp4"`` (MXFP4, E2M1 elements) or ``"fp8"`` (MXFP8, E4M3 elements).
        block: block length (32 in the spec).

    Returns:
        ``(elements, scale)``: elements float32 [..., K], on the E2M1 grid (|e| <= 6) or E4M3 values (|e| <= 448);
        scale float32 [..., K / block], exact powers of two in [2^-127, 2^127]. ``elements * scale`` per block is
        the dequantized tensor.

    Raises:
        TypeError: ``x`` is not a floating-point tensor.
        ValueError: unknown ``element``, ``block`` < 1, or a last dim not a multiple of ``block`` (names the shape).
    """
    _check_float(x)
    if element not in _MX_ELEMENTS:
        raise ValueError(f"element must be one of {sorted(_MX_ELEMENTS)}, got {element!r}")
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    emax, elem_max = _MX_ELEMENTS[element]
    xb = _blocks(x, block, f"MX{element.upper()}")
    b = xb.abs().amax(dim=-1, keepdim=True)
    # floor(log2(b)) exactly: frexp gives b = m * 2^e with m in [0.5, 1), so floor(log2(b)) = e - 1.
    _, e = torch.frexp(b)
    exp = torch.where(b > 0, e - 1 - emax, _E8M0_MIN_EXP).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    scale = torch.ldexp(torch.ones_like(b), exp)
    scale = torch.where(torch.isfinite(b), scale, math.nan)
    p = torch.clamp(xb / scale, -elem_max, elem_max)
    if element == "fp4":
        p = round_e2m1(p)
    else:
        p = _to_e4m3(p).to(torch.float32)
    return p.reshape(x.shape), scale.squeeze(-1)


def fake_mx(x: torch.Tensor, element: str = "fp4", block: int = MX_BLOCK) -> torch.Tensor:
    """MXFP4 / MXFP8 round trip of ``x`` (see :func:`mx_quantize` for the format, the arguments and the errors raised):
    elements times their block's power-of-two scale, in ``x``'s dtype and shape."""
    p, scale = mx_quantize(x, element, block)
    pb = p.reshape(*p.shape[:-1], p.shape[-1] // block, block)
    return (pb * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: ``10 log10(sum(reference^2) / sum((reference - approx)^2))``,
    accumulated in float64.

    Args:
        reference, approx: tensors of the same shape (any real dtype).

    Returns:
        A float; +inf if ``approx == reference`` everywhere (and the reference is not all zero), -inf if the
        reference is all zero and ``approx`` is not, NaN if both are all zero.

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(reference.shape) != tuple(approx.shape):
        raise ValueError(f"reference and approx shapes differ: {tuple(reference.shape)} vs {tuple(approx.shape)}")
    ref = reference.to(torch.float64)
    signal = float(ref.square().sum())
    noise = float((ref - approx.to(torch.float64)).square().sum())
    if noise == 0.0:
        return math.inf if signal > 0 else math.nan
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)
