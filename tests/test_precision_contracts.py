"""Contracts of the simulated low-precision formats, checked on tiny hand-computed inputs (issue 51: mutation
survivors of genrl/models/precision.py (the fake fp8 / NVFP4 / MX quantizers, the E2M1 grid, SQNR)).

* ``e2m1_grid`` / ``nvfp4_quantize``'s unit tensor scale are float32 whatever torch's default dtype;
* ``fake_fp8``: the 0-d / 1-d / 3-d rules of ``granularity``, the finite amax (non-finite values ignored), a
  calibrated amax of any float dtype or device used as float32 on ``x``'s device, float32 arithmetic for float16 ``x``;
* ``nvfp4_quantize``: float32 results for any input dtype, 1-d inputs, the unit tensor scale of an all-zero tensor,
  outputs on ``x``'s device (meta);
* ``mx_quantize`` / ``fake_mx``: the default element, the ``block`` argument (1 allowed, 0 / -1 / floats refused),
  the E8M0 exponent floor 2^-127 (all-zero and tiny blocks), MXFP8's negative saturation before the E4M3 cast;
* ``fake_mx`` / ``fake_nvfp4`` keep ``x``'s dtype; ``sqnr_db`` accumulates in float64 and its zero cases.
* the documented non-finite cases of ``nvfp4_quantize`` (inf, NaN) and ``round_e2m1``'s float8 refusal.
"""

from __future__ import annotations

import math

import pytest
import torch

from genrl.models import precision
from genrl.models.precision import (
    E4M3_MAX,
    e2m1_grid,
    fake_fp8,
    fake_mx,
    fake_nvfp4,
    mx_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
    sqnr_db,
)


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3).to(dtype)


# ------------------------------------------------------------------------------------------------ dtypes


def test_float32_outputs_under_a_float64_default_dtype():
    """e2m1_grid is float32 [8] and nvfp4_quantize's unit tensor scale (tensor_scale=False) a float32 0-d tensor even
    when torch's default dtype is float64 (their dtypes are given, not inherited from the default)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        g = e2m1_grid()
        _, s, t = nvfp4_quantize(torch.ones(1, 16, dtype=torch.float32), tensor_scale=False)
    finally:
        torch.set_default_dtype(prev)
    assert g.dtype == torch.float32 and g.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert t.dtype == torch.float32 and t.dim() == 0 and t.item() == 1.0
    assert s.dtype == torch.float8_e4m3fn


def test_quantizers_compute_in_float32_for_any_input_dtype():
    """nvfp4_quantize / mx_quantize / nvfp4_dequantize compute in float32: float64 and bfloat16 inputs give float32
    values and scales, equal to those of the input cast to float32 first."""
    for dt in (torch.float64, torch.bfloat16):
        x = _rand(2, 32, seed=1, dtype=dt)
        v, s, t = nvfp4_quantize(x)
        v32, s32, t32 = nvfp4_quantize(x.to(torch.float32))
        assert v.dtype == torch.float32 and t.dtype == torch.float32
        assert torch.equal(v, v32) and torch.equal(s.float(), s32.float()) and torch.equal(t, t32)
        deq = nvfp4_dequantize(v.to(dt), s, t)
        assert deq.dtype == torch.float32
        assert torch.equal(deq, nvfp4_dequantize(v32, s32, t32))
        for element in ("fp4", "fp8"):
            p, sc = mx_quantize(x, element)
            p32, sc32 = mx_quantize(x.to(torch.float32), element)
            assert p.dtype == torch.float32 and sc.dtype == torch.float32
            assert torch.equal(p, p32) and torch.equal(sc, sc32)


def test_fake_mx_and_fake_nvfp4_keep_the_input_dtype():
    """fake_mx / fake_nvfp4 return x's dtype (float16 here): the float32 round trip cast back to float16."""
    x = _rand(2, 32, seed=2, dtype=torch.float16)
    for element in ("fp4", "fp8"):
        out = fake_mx(x, element)
        assert out.dtype == torch.float16
        assert torch.equal(out, fake_mx(x.float(), element).half())
    out = fake_nvfp4(x)
    assert out.dtype == torch.float16
    assert torch.equal(out, fake_nvfp4(x.float()).half())


# ------------------------------------------------------------------------------------------------ FP8


def test_fake_fp8_granularity_on_0d_1d_and_3d_tensors():
    """'row' needs at least 1 dim (0-d: ValueError), 'tensor' accepts a 0-d tensor; a 1-d 'row' tensor is one row;
    a 3-d tensor has one amax per row along the LAST dim. Values: s * e4m3(x / s), s = amax / 448."""
    with pytest.raises(ValueError, match="0-d"):
        fake_fp8(torch.tensor(3.0), "row")
    assert fake_fp8(torch.tensor(3.0), "tensor").item() == pytest.approx(3.0, rel=1e-6)
    # amax 3: x / s = 448, -149.33 (-> -144, spacing 16 on [128, 256)), 74.67 (-> 72, spacing 8 on [64, 128))
    out = fake_fp8(torch.tensor([3.0, -1.0, 0.5]), "row")
    s = 3.0 / 448.0
    assert out.tolist() == pytest.approx([448 * s, -144 * s, 72 * s], rel=1e-6)
    x = torch.tensor([[[1.0, 0.3, -0.1], [100.0, 0.0, 0.0]], [[0.0, 2.0, 0.0], [0.5, 0.5, -7.0]]])
    out3 = fake_fp8(x, "row")
    for i in range(2):
        for j in range(2):
            assert torch.equal(out3[i, j], fake_fp8(x[i, j], "tensor"))
    # row [1, 0.3, -0.1]: amax 1, 0.3 * 448 = 134.4 -> 128, -0.1 * 448 = -44.8 -> -44 (spacing 4 on [32, 64))
    assert out3[0, 0].tolist() == pytest.approx([1.0, 128 / 448, -44 / 448], rel=1e-6)


def test_fake_fp8_amax_ignores_non_finite_values():
    """Without a given amax the scale comes from the finite values only: +inf saturates to +448 s = the finite amax."""
    out = fake_fp8(torch.tensor([[math.inf, 0.5, -0.25], [-math.inf, 0.0, 0.0]]), "row")
    assert out[0].tolist() == pytest.approx([0.5, 0.5, -0.25], rel=1e-6)
    assert out[1].tolist() == [0.0, 0.0, 0.0]  # amax 0 row: zeros (the -inf too)


def test_fake_fp8_calibrated_amax_is_float32_on_x_device():
    """A calibrated amax tensor is used as float32 whatever its dtype (a bfloat16 3.0 gives exactly the float 3.0's
    result, whose top element is 3.0 itself) and is moved to x's device (CPU amax rows for a meta x)."""
    x = torch.tensor([[3.0, -1.0, 0.5]])
    ref = fake_fp8(x, "row", amax=3.0)
    assert ref[0, 0].item() == pytest.approx(3.0, rel=1e-6)
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        assert torch.equal(fake_fp8(x, "row", amax=torch.tensor(3.0, dtype=dt)), ref)
        assert torch.equal(fake_fp8(x, "row", amax=torch.tensor([[3.0]], dtype=dt)), ref)
    out = fake_fp8(torch.empty(2, 8, device="meta"), "row", amax=torch.full((2, 1), 2.0))
    assert out.device.type == "meta" and out.shape == (2, 8)


def test_fake_fp8_float16_input_is_computed_in_float32():
    """float16 x is scaled in float32 (a float16 scale amax / 448 would be a coarse float16 subnormal for small
    weights): the result is the float32 result cast to float16, within float16 rounding of the float64 formula."""
    x = torch.tensor([[1.0e-4, 3.0e-5, -5.0e-5, 7.0e-6]], dtype=torch.float16)
    out = fake_fp8(x, "row")
    assert out.dtype == torch.float16
    assert torch.equal(out, fake_fp8(x.float(), "row").half())
    assert out[0, 0].item() == x[0, 0].item()  # the amax element maps onto itself (x / s = 448 exactly)
    x64 = x.double()
    s = x64.abs().amax() / E4M3_MAX
    ref = (x64 / s).float().to(torch.float8_e4m3fn).double() * s
    assert torch.allclose(out.double(), ref, rtol=2.0**-10, atol=2.0**-24)  # float16: 11 bits, subnormal step 2^-24


# ------------------------------------------------------------------------------------------------ NVFP4


def test_nvfp4_quantize_1d_and_0d_inputs():
    """A 1-d tensor of 16 values is one block (block scale 6 / 6 = 1 without tensor scale: the E2M1 values come back
    as they are); a 0-d tensor is a ValueError naming its shape."""
    x = torch.tensor([6.0, 3.0, -1.5, 0.5, 0.0, -4.0, 2.0, 1.0] + [0.0] * 8)
    v, s, t = nvfp4_quantize(x, tensor_scale=False)
    assert torch.equal(v, x) and s.float().tolist() == [1.0] and t.item() == 1.0
    assert torch.equal(fake_nvfp4(x, tensor_scale=False), x)
    assert torch.equal(nvfp4_dequantize(v, s, t), x)
    with pytest.raises(ValueError, match=r"\(\)"):
        nvfp4_quantize(torch.tensor(1.0))


def test_nvfp4_all_zero_tensor_has_unit_tensor_scale():
    """An all-zero tensor gets tensor scale exactly 1.0 (the documented 'amax 0 -> 1.0'; the scale stays > 0), zero
    block scales and zero values."""
    v, s, t = nvfp4_quantize(torch.zeros(2, 32))
    assert t.dtype == torch.float32 and t.item() == 1.0
    assert (s.float() == 0).all() and (v == 0).all()


def test_nvfp4_non_finite_inputs_and_float8_round_e2m1_as_documented():
    """The documented non-finite cases: an infinite element makes the tensor scale inf, its value NaN, every other
    value 0 and the dequantized tensor all NaN; a NaN element stays NaN in its place and leaves the others finite;
    round_e2m1 refuses a float8 input (torch cannot promote float8)."""
    x = _rand(2, 32)
    x[0, 3] = float("inf")
    v, s, t = nvfp4_quantize(x)
    assert math.isinf(t.item()) and v.isnan().sum().item() == 1 and v[0, 3].isnan()
    assert (v.nan_to_num() == 0).all() and nvfp4_dequantize(v, s, t).isnan().all()
    x = _rand(2, 32)
    x[1, 5] = float("nan")
    v, _, _ = nvfp4_quantize(x)
    assert v.isnan().sum().item() == 1 and v[1, 5].isnan()
    with pytest.raises(RuntimeError, match="Float8"):
        precision.round_e2m1(torch.ones(3).to(torch.float8_e4m3fn))


def test_nvfp4_quantize_outputs_on_x_device():
    """nvfp4_quantize returns values, block scales and the tensor scale on x's device, the unit scale of
    tensor_scale=False included (checked with meta tensors)."""
    for ts in (True, False):
        v, s, t = nvfp4_quantize(torch.empty(2, 32, device="meta"), tensor_scale=ts)
        assert v.device.type == s.device.type == t.device.type == "meta"
        assert t.dtype == torch.float32 and t.dim() == 0 and tuple(s.shape) == (2, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device (CUDA)")
def test_nvfp4_dequantize_moves_tensor_scale_to_values_device():
    """A tensor scale on another device than the values (a CUDA 0-d scale, CPU values) is moved to the values'."""
    x = _rand(2, 32, seed=3)
    v, s, t = nvfp4_quantize(x)
    out = nvfp4_dequantize(v, s, t.cuda())
    assert out.device.type == "cpu" and torch.equal(out, nvfp4_dequantize(v, s, t))


# ------------------------------------------------------------------------------------------------ MX


def test_mx_default_element_is_fp4_and_block_argument_is_used():
    """mx_quantize's default element is "fp4"; fake_mx passes its block on (K = 16 with block 16: one block, amax 5,
    X = 2^(2 - 2) = 1, 5 -> 4 (tie to even), 1 -> 1)."""
    x = _rand(2, 64, seed=4)
    p, sc = mx_quantize(x)
    p4, sc4 = mx_quantize(x, "fp4")
    assert torch.equal(p, p4) and torch.equal(sc, sc4)
    row = torch.tensor([[5.0, 1.0] + [0.0] * 14])
    assert fake_mx(row, "fp4", block=16)[0, :3].tolist() == [4.0, 1.0, 0.0]
    x32 = torch.tensor([[5.0] + [0.0] * 15 + [0.75] + [0.0] * 15])
    # two blocks of 16: the second (amax 0.75, X = 2^(-1 - 2) = 1/8, 0.75 / X = 6) is kept exactly
    assert fake_mx(x32, "fp4", block=16)[0, [0, 16]].tolist() == [4.0, 0.75]


def test_mx_block_argument_validation():
    """block = 1 is valid (one scale per element: 3 -> X 1/2, P 6; -0.75 -> X 1/8, P -6; 0 -> X 2^-127; 5 -> X 1,
    P 4); block 0, negative or not an int is a ValueError."""
    p, sc = mx_quantize(torch.tensor([[3.0, -0.75, 0.0, 5.0]]), "fp4", block=1)
    assert p.tolist() == [[6.0, -6.0, 0.0, 4.0]]
    assert sc.tolist() == [[0.5, 0.125, 2.0**-127, 1.0]]
    for bad in (0, -1, -32, 2.0, 32.0):
        with pytest.raises(ValueError, match="block must be a positive int"):
            mx_quantize(torch.zeros(1, 32), "fp4", block=bad)


def test_mx_scale_exponent_floor_is_e8m0_min():
    """The E8M0 exponent is clamped below at -127: an all-zero block gets X = 2^-127 and a tiny block (amax 2^-140,
    floor exponent -140 - emax) gets X = 2^-127 too, its elements then rounding to 0."""
    for element in ("fp4", "fp8"):
        p, sc = mx_quantize(torch.zeros(2, 32), element)
        assert sc.tolist() == [[2.0**-127], [2.0**-127]] and (p == 0).all()
        p, sc = mx_quantize(torch.full((1, 32), 2.0**-140), element)
        assert sc.tolist() == [[2.0**-127]]
        assert (p == 0).all()


def test_mxfp8_negative_overflow_is_clamped_before_the_cast(monkeypatch):
    """MXFP8 clamps V / X to [-448, 448] before the E4M3 cast on both sides (a block of -500: X = 2^(8 - 8) = 1, the
    elements saturate at -448), so no out-of-range value reaches the cast."""
    real = precision._to_e4m3

    def strict(x):
        assert not (x.abs() > E4M3_MAX).any(), f"E4M3 cast of out-of-range values (max {x.abs().max().item()})"
        return real(x)

    monkeypatch.setattr(precision, "_to_e4m3", strict)
    p, sc = mx_quantize(torch.full((1, 32), -500.0), "fp8")
    assert sc.tolist() == [[1.0]] and (p == -E4M3_MAX).all()
    assert (fake_mx(torch.full((2, 32), -500.0), "fp8") == -E4M3_MAX).all()


# ------------------------------------------------------------------------------------------------ SQNR


def test_sqnr_db_zero_cases_and_float64_accumulation():
    """sqnr_db: both all zero -> NaN; reference all zero, approx not -> -inf; a float16 reference is squared in
    float64 (300^2 overflows float16): [300, 0] vs [299, 0] is 10 log10(90000 / 1)."""
    z = torch.zeros(3)
    assert math.isnan(sqnr_db(z, z.clone()))
    assert sqnr_db(z, torch.tensor([0.0, 1.0, 0.0])) == -math.inf
    ref = torch.tensor([300.0, 0.0], dtype=torch.float16)
    approx = torch.tensor([299.0, 0.0], dtype=torch.float16)
    assert sqnr_db(ref, approx) == pytest.approx(10.0 * math.log10(90000.0), abs=1e-9)
