"""genrl.models.precision: simulated FP4 E2M1 / FP8 E4M3 / NVFP4 / MXFP4 / MXFP8 formats (CPU, seeded)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from genrl.models import precision
from genrl.models.precision import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_grid,
    fake_fp8,
    fake_mx,
    fake_nvfp4,
    mx_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    round_e2m1,
    sqnr_db,
)

INF, NAN = math.inf, math.nan


@pytest.fixture(scope="module")
def weights() -> torch.Tensor:
    """A Linear weight [out 256, in 512] ~ N(0, 0.02^2), float32."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(256, 512, generator=g) * 0.02


def _signed_grid() -> torch.Tensor:
    g = e2m1_grid().to(torch.float64)
    return torch.cat([-g.flip(0), g])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


# ------------------------------------------------------------------------------------------------ E2M1


def test_e2m1_grid_values():
    g = e2m1_grid()
    assert g.dtype == torch.float32
    assert g.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    # from the encoding: 1 sign, 2 exponent (bias 1), 1 mantissa bit; exponent 0 is subnormal
    decoded = [(m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)) for e in range(4) for m in range(2)]
    assert g.tolist() == decoded
    assert E2M1_MAX == g.max().item() == 6.0


@pytest.mark.parametrize("x, expected", [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
                                         (5.0, 4.0), (0.26, 0.5), (2.51, 3.0), (5.01, 6.0), (4.99, 4.0), (6.0, 6.0),
                                         (7.0, 6.0), (100.0, 6.0), (INF, 6.0), (1e30, 6.0)])
def test_round_e2m1_ties_to_even_and_saturation(x, expected):
    out = round_e2m1(torch.tensor([x, -x]))
    assert out.tolist() == [expected, -expected]


def test_round_e2m1_nan_signed_zero_dtype_shape():
    out = round_e2m1(torch.tensor([NAN, -0.1, -0.0, 0.1]))
    assert math.isnan(out[0].item())
    assert out[1:].tolist() == [0.0, 0.0, 0.0]
    assert torch.signbit(out[1:]).tolist() == [True, True, False]
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        x = torch.tensor([[0.3, 5.0, -2.6], [7.0, 0.74, -1.25]], dtype=dtype)
        out = round_e2m1(x)
        assert out.dtype == dtype and out.shape == x.shape
        assert out.tolist() == [[0.5, 4.0, -3.0], [6.0, 0.5, -1.0]]
    with pytest.raises(TypeError, match="floating-point"):
        round_e2m1(torch.tensor([1, 2]))


def test_round_e2m1_random_is_nearest_grid_value():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.empty(4096).uniform_(-7.5, 7.5, generator=g),
                   torch.randn(1024, generator=g) * 0.3])
    q = round_e2m1(x).to(torch.float64)
    grid = _signed_grid()
    assert torch.isin(q, grid).all()
    dist = (x.to(torch.float64)[:, None] - grid[None, :]).abs()
    assert torch.equal((x.to(torch.float64) - q).abs(), dist.min(dim=1).values)


# ------------------------------------------------------------------------------------------------ NVFP4


def test_nvfp4_values_on_grid_and_scales(weights):
    v, s, t = nvfp4_quantize(weights)
    assert v.dtype == torch.float32 and v.shape == weights.shape
    assert s.dtype == torch.float8_e4m3fn and s.shape == (256, 512 // 16)
    assert t.dtype == torch.float32 and t.dim() == 0
    assert t.item() == (weights.abs().amax() / (448.0 * 6.0)).item()
    # the largest block's scale sits at the top of the E4M3 range
    assert s.to(torch.float32).max().item() == E4M3_MAX
    assert v.abs().max().item() == 6.0
    grid = _signed_grid()
    assert torch.isin(v.to(torch.float64), grid).all()
    total = (s.to(torch.float32) * t)[..., None]  # [256, 32, 1]
    deq = fake_nvfp4(weights)
    recovered = deq.reshape(256, 32, 16) / total
    assert torch.isin(recovered.to(torch.float64), grid).all()
    assert recovered.abs().max().item() <= 6.0
    assert torch.equal(recovered.reshape(256, 512), v)
    assert torch.equal(deq, nvfp4_dequantize(v, s, t))
    # per-element error is at most one block total scale (half the widest grid step, 2, times the scale)
    err = (deq - weights).reshape(256, 32, 16).abs()
    assert (err <= total).all()


def test_nvfp4_idempotent(weights):
    once = fake_nvfp4(weights)
    assert torch.equal(fake_nvfp4(once), once)
    once_nt = fake_nvfp4(weights, tensor_scale=False)
    assert torch.equal(fake_nvfp4(once_nt, tensor_scale=False), once_nt)


def test_nvfp4_zero_block_and_zero_tensor(weights):
    x = weights.clone()
    x[3, 32:48] = 0.0
    v, s, t = nvfp4_quantize(x)
    assert s[3, 2].to(torch.float32).item() == 0.0
    out = fake_nvfp4(x)
    assert torch.isfinite(out).all()
    assert (out[3, 32:48] == 0).all()
    assert torch.equal(out[3, :32], fake_nvfp4(weights)[3, :32])
    for ts in (True, False):
        z = fake_nvfp4(torch.zeros(4, 32), tensor_scale=ts)
        assert torch.equal(z, torch.zeros(4, 32))


def test_nvfp4_block_scale_saturates_without_tensor_scale():
    # without the tensor scale, a block scale above 448 is clamped (not cast to NaN) and its elements saturate at 6
    x = torch.full((2, 16), 1e4)
    x[1] = -1e4
    out = fake_nvfp4(x, tensor_scale=False)
    assert out.tolist() == [[6.0 * 448.0] * 16, [-6.0 * 448.0] * 16]
    # a tiny non-zero block keeps a normal E4M3 block scale (2^-6) instead of flushing to zero
    tiny = torch.full((1, 16), 1e-4)
    v, s, _ = nvfp4_quantize(tiny, tensor_scale=False)
    assert s.to(torch.float32).item() == 2.0**-6
    assert fake_nvfp4(tiny, tensor_scale=False).tolist() == [[0.0] * 16]  # 1e-4 / 2^-6 = 0.0064 rounds to 0


def test_nvfp4_sqnr_tensor_scale_helps(weights):
    with_ts = sqnr_db(weights, fake_nvfp4(weights, tensor_scale=True))
    without = sqnr_db(weights, fake_nvfp4(weights, tensor_scale=False))
    # measured (this seed): 20.4 dB with, 17.7 dB without the per-tensor scale
    assert 19.5 <= with_ts <= 21.5
    assert 16.7 <= without <= 18.7
    assert with_ts > without + 1.5


@pytest.mark.parametrize("tensor_scale", [True, False])
def test_nvfp4_matches_torchao_bitwise(weights, tensor_scale):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    pts = per_tensor_amax_to_scale(weights.abs().amax()) if tensor_scale else None
    ref_t = NVFP4Tensor.to_nvfp4(weights, per_tensor_scale=pts)
    ref = ref_t.dequantize(torch.float32)
    v, s, t = nvfp4_quantize(weights, tensor_scale=tensor_scale)
    assert torch.equal(_bits(fake_nvfp4(weights, tensor_scale=tensor_scale)), _bits(ref))
    assert torch.equal(s.view(torch.uint8), ref_t.scale.view(torch.uint8))
    if tensor_scale:
        assert torch.equal(_bits(t), _bits(pts))
    # also with a zero block (torchao keeps a 2^-6 scale there, this module 0: the dequantized values agree)
    x = weights.clone()
    x[5, 64:80] = 0.0
    pts = per_tensor_amax_to_scale(x.abs().amax()) if tensor_scale else None
    ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).dequantize(torch.float32)
    assert torch.equal(fake_nvfp4(x, tensor_scale=tensor_scale), ref)


def test_nvfp4_shape_errors():
    with pytest.raises(ValueError, match=re.escape("(3, 20)")):
        nvfp4_quantize(torch.zeros(3, 20))
    with pytest.raises(ValueError, match=re.escape("(8,)")):
        fake_nvfp4(torch.zeros(8))
    with pytest.raises(ValueError, match="block_scale"):
        nvfp4_dequantize(torch.zeros(2, 32), torch.zeros(2, 3), 1.0)


# ------------------------------------------------------------------------------------------------ MX


@pytest.mark.parametrize("element, emax, elem_max", [("fp4", 2, 6.0), ("fp8", 8, 448.0)])
def test_mx_scales_are_floor_powers_of_two(weights, element, emax, elem_max):
    p, scale = mx_quantize(weights, element)
    assert scale.dtype == torch.float32 and scale.shape == (256, 512 // 32)
    mantissa, _ = torch.frexp(scale)
    assert (mantissa == 0.5).all()  # exact powers of two
    amax = weights.reshape(256, 16, 32).abs().amax(-1)
    ratio = amax / scale  # X = 2^(floor(log2 amax) - emax)  <=>  amax / X in [2^emax, 2^(emax + 1))
    assert (ratio >= 2.0**emax).all() and (ratio < 2.0 ** (emax + 1)).all()
    assert p.abs().max().item() <= elem_max
    if element == "fp4":
        assert torch.isin(p.to(torch.float64), _signed_grid()).all()
    else:
        assert torch.equal(p.to(torch.float8_e4m3fn).to(torch.float32), p)
    deq = fake_mx(weights, element)
    assert torch.equal(deq, (p.reshape(256, 16, 32) * scale[..., None]).reshape(256, 512))


def test_mx_sqnr(weights):
    fp4 = sqnr_db(weights, fake_mx(weights, "fp4"))
    fp8 = sqnr_db(weights, fake_mx(weights, "fp8"))
    # measured (this seed): MXFP4 18.8 dB, MXFP8 30.6 dB
    assert 17.8 <= fp4 <= 19.8
    assert 29.6 <= fp8 <= 31.6
    # NVFP4 (16-element blocks, E4M3 scales) is finer than MXFP4 (32-element blocks, power-of-two scales)
    assert sqnr_db(weights, fake_nvfp4(weights)) > fp4


def test_mx_zero_block_saturation_and_errors():
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.linspace(-1.0, 1.0, 32)
    for element in ("fp4", "fp8"):
        out = fake_mx(x, element)
        assert torch.isfinite(out).all()
        assert (out[0] == 0).all() and (out[1, :32] == 0).all()
    # amax 7.5 -> X = 2^(2 - 2) = 1; 7.5 saturates to 6 (MXFP4); amax 500 -> X = 2^(8 - 8); 500 -> 448 (MXFP8)
    assert fake_mx(torch.full((1, 32), -7.5), "fp4").tolist() == [[-6.0] * 32]
    assert fake_mx(torch.full((1, 32), 500.0), "fp8").tolist() == [[448.0] * 32]
    with pytest.raises(ValueError, match=re.escape("(4, 48)")):
        fake_mx(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="element"):
        fake_mx(torch.zeros(4, 32), element="fp6")


@pytest.mark.parametrize("element", ["fp4", "fp8"])
def test_mx_matches_torchao_bitwise(weights, element):
    pytest.importorskip("torchao")
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    dtype = torch.float4_e2m1fn_x2 if element == "fp4" else torch.float8_e4m3fn
    ref_t = MXTensor.to_mx(weights, dtype, 32)
    ref = ref_t.dequantize(torch.float32)
    assert torch.equal(_bits(fake_mx(weights, element)), _bits(ref))
    _, scale = mx_quantize(weights, element)
    assert torch.equal(scale, ref_t.scale.view(torch.uint8).to(torch.int32).sub(127).to(torch.float32).exp2())


# ------------------------------------------------------------------------------------------------ FP8 E4M3


def test_fp8_relative_error_in_normal_range(weights):
    out = fake_fp8(weights, "row")
    s = weights.abs().amax(-1, keepdim=True) / E4M3_MAX
    normal = (weights / s).abs() >= 2.0**-6
    assert normal.float().mean() > 0.99
    rel = ((out - weights).abs() / weights.abs())[normal]
    assert rel.max().item() <= 2.0**-4
    # with s = 1 the result is exactly the E4M3 value (round to nearest even) over magnitudes 2^-6 .. 448
    g = torch.Generator().manual_seed(1)
    x = torch.exp2(torch.empty(4096).uniform_(-6.0, math.log2(448.0), generator=g))
    x = x * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    out = fake_fp8(x, "tensor", amax=E4M3_MAX)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).to(torch.float32))
    assert ((out - x).abs() / x.abs()).max().item() <= 2.0**-4


def test_fp8_overflow_saturates_never_nan():
    x = torch.tensor([[0.5, 1.0, 1e3, -1e6, INF, -INF]])
    s = torch.tensor(1.0) / E4M3_MAX
    out = fake_fp8(x, "row", amax=1.0)
    top = (E4M3_MAX * s).item()
    assert out[0, 2:].tolist() == [top, -top, top, -top]
    assert out[0, :2].tolist() == [(torch.tensor(224.0) * s).item(), top]
    # dynamic amax ignores the infinities, which then saturate at +-448 s
    y = torch.tensor([[0.5, -2.0, INF, -INF], [NAN, 1.0, 0.0, -1.0]])
    out = fake_fp8(y, "row")
    s = torch.tensor(2.0) / E4M3_MAX
    assert out[0].tolist() == [0.5, -2.0, (E4M3_MAX * s).item(), -(E4M3_MAX * s).item()]
    assert math.isnan(out[1, 0].item()) and out[1, 1:].tolist() == [1.0, 0.0, -1.0]  # NaN stays NaN, nothing else


def test_e4m3_casts_only_see_in_range_values(monkeypatch, weights):
    """Every E4M3 cast is given values already clamped to +-448 (torch <= 2.11 eager casts turned overflow into NaN,
    later ones saturate; the results must not depend on which)."""
    real = precision._to_e4m3
    calls = []

    def strict(x):
        assert not (x.abs() > E4M3_MAX).any(), f"E4M3 cast of out-of-range values (max {x.abs().max().item()})"
        calls.append(x.numel())
        return real(x)

    monkeypatch.setattr(precision, "_to_e4m3", strict)
    fake_fp8(torch.tensor([[1.0, 1e3, -1e6, INF, -INF]]), "row", amax=1.0)
    fake_fp8(weights, "tensor", amax=0.01)
    fake_mx(torch.full((2, 32), 500.0), "fp8")
    fake_nvfp4(weights * 1e5, tensor_scale=False)
    fake_nvfp4(weights, tensor_scale=True)
    assert len(calls) >= 5


def test_fp8_zero_rows_and_errors():
    x = torch.zeros(3, 8)
    x[1] = torch.linspace(-1.0, 1.0, 8)
    out = fake_fp8(x, "row")
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert torch.equal(fake_fp8(torch.zeros(2, 5), "tensor"), torch.zeros(2, 5))
    assert fake_fp8(x.to(torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="granularity"):
        fake_fp8(x, "column")
    with pytest.raises(TypeError):
        fake_fp8(torch.ones(2, 2, dtype=torch.int64))


def test_fp8_sqnr_and_per_row_vs_per_tensor(weights):
    # measured (this seed): 31.6 dB per row, 31.5 dB per tensor
    assert sqnr_db(weights, fake_fp8(weights, "row")) >= 30.6
    assert sqnr_db(weights, fake_fp8(weights, "tensor")) >= 30.5
    g = torch.Generator().manual_seed(2)
    scales = torch.tensor([1.0, 1e-2, 1e-5, 1e-7])[:, None]
    x = torch.randn(4, 512, generator=g) * scales
    row, tensor = fake_fp8(x, "row"), fake_fp8(x, "tensor")
    for i in range(4):  # per-row scaling: each row alone, whatever its magnitude
        assert torch.equal(row[i], fake_fp8(x[i : i + 1], "tensor")[0])
        assert sqnr_db(x[i], row[i]) >= 30.0
    assert sqnr_db(x[0], tensor[0]) >= 30.0  # the row that sets the per-tensor amax is unaffected
    assert sqnr_db(x[2], tensor[2]) < 10.0  # 1e-5 rows fall into E4M3's last subnormals under the tensor's scale
    assert (tensor[3] == 0).all()  # 1e-7 rows underflow to zero


# ------------------------------------------------------------------------------------------------ SQNR


def test_sqnr_db():
    ref = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    assert sqnr_db(ref, torch.tensor([0.9, 0.0, 0.0], dtype=torch.float64)) == pytest.approx(20.0, abs=1e-9)
    assert sqnr_db(ref, torch.tensor([1.0, 0.1, 0.0], dtype=torch.float64)) == pytest.approx(20.0, abs=1e-9)
    assert sqnr_db(ref, ref.clone()) == math.inf
    with pytest.raises(ValueError, match="shapes"):
        sqnr_db(ref, torch.zeros(4))
