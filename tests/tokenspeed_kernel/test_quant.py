"""MXFP4 / FP8 weight containers: layout, exact round trips, error bounds, validation."""

import math

import pytest
import torch
from support.memory import PeakTracker
from support.naive_moe import decode_e2m1, decode_fp8, decode_mxfp4

from tokenspeed_kernel import quant
from tokenspeed_kernel.quant import (
    E2M1_VALUES,
    FP8Weight,
    MXFP4Weight,
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
)

# ---------------------------------------------------------------- quantize_mxfp4 memory

# GPT-OSS-120B expert stacks: w13 [E, 2I, H] and w2 [E, H, I] (E = 128, H = I = 2880). On the
# meta device (support.memory.PeakTracker counts the bytes of every tensor the ops create).
GPT_OSS_STACKS = [(128, 5760, 2880), (128, 2880, 2880)]


def _peak_ratio(w: torch.Tensor) -> float:
    with PeakTracker(w) as tracker:
        out = quantize_mxfp4(w)
    assert out.packed.shape == (*w.shape[:-1], w.shape[-1] // 2)
    return tracker.peak / (w.numel() * w.element_size())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [*GPT_OSS_STACKS, (3, 40, 96), (64, 64)])
def test_quantize_mxfp4_extra_memory_within_the_input_size(shape, dtype):
    assert _peak_ratio(torch.empty(shape, dtype=dtype, device="meta")) <= 1.0


def test_quantize_mxfp4_single_row_is_bounded_by_its_working_set():
    """A row is never split: a tiny input (two rows of 64 values, 512 bytes) may use one row's
    working set."""
    w = torch.empty(2, 64, device="meta")
    assert _peak_ratio(w) * w.numel() * 4 <= 64 * quant.MXFP4_QUANT_BYTES_PER_VALUE


def test_quantize_mxfp4_extra_memory_bound_holds_for_a_non_contiguous_stack():
    w = torch.empty(5760, 128, 2880, device="meta").transpose(0, 1)  # [E, N, K], not flattenable
    assert _peak_ratio(w) <= 1.0


def test_peak_tracker_sees_the_unchunked_working_set(monkeypatch):
    """The tracker is not blind: one chunk for the whole GPT-OSS w13 stack (what quantize_mxfp4
    did before chunking: 63 GiB asked for 8.5 GB on an H100) is ~10x the input."""
    monkeypatch.setattr(quant, "MXFP4_QUANT_BYTES_PER_VALUE", 1)
    assert _peak_ratio(torch.empty(GPT_OSS_STACKS[0], device="meta")) > 8.0


@pytest.mark.parametrize("bytes_per_value", [10**9, quant.MXFP4_QUANT_BYTES_PER_VALUE, 1])
def test_quantize_mxfp4_result_does_not_depend_on_chunking(monkeypatch, bytes_per_value):
    """One row per chunk, the default chunks and a single chunk give the same bytes, also for a
    non-contiguous input (quantized one [N, K] matrix at a time)."""
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(7, 3, 9, 96, generator=gen) * 4).transpose(0, 1)
    expected = quantize_mxfp4(w.contiguous())
    monkeypatch.setattr(quant, "MXFP4_QUANT_BYTES_PER_VALUE", bytes_per_value)
    for got in (quantize_mxfp4(w), quantize_mxfp4(w.contiguous().bfloat16().float())):
        assert got.packed.is_contiguous() and got.scales.is_contiguous()
    got = quantize_mxfp4(w)
    assert torch.equal(got.packed, expected.packed) and torch.equal(got.scales, expected.scales)


# ---------------------------------------------------------------- MXFP4 layout


def test_e2m1_table_matches_bit_layout():
    assert [decode_e2m1(c) for c in range(8)] == list(E2M1_VALUES)
    assert [decode_e2m1(c | 8) for c in range(1, 8)] == [-v for v in E2M1_VALUES[1:]]


def test_mxfp4_low_nibble_holds_the_even_element():
    # codes: element 0 = 0b0010 (1.0), element 1 = 0b1101 (-3.0), the rest 0b0001 (0.5)
    packed = torch.full((1, 16), 0x11, dtype=torch.uint8)
    packed[0, 0] = 0b1101_0010
    scales = torch.tensor([[127]], dtype=torch.uint8)  # 2**0
    w = MXFP4Weight(packed, scales)
    dense = w.dequantize()
    assert w.shape == (1, 32)
    assert dense[0, 0].item() == 1.0
    assert dense[0, 1].item() == -3.0
    assert torch.all(dense[0, 2:] == 0.5)


def test_mxfp4_e8m0_scales_apply_per_32_values():
    packed = torch.full((2, 32), 0x22, dtype=torch.uint8)  # every value 1.0 (64 per row)
    scales = torch.tensor([[127 + 3, 127 - 5], [0, 254]], dtype=torch.uint8)
    dense = dequantize_mxfp4(MXFP4Weight(packed, scales), torch.float64)
    assert torch.all(dense[0, :32] == 8.0) and torch.all(dense[0, 32:] == 2.0**-5)
    assert torch.all(dense[1, :32] == 2.0**-127) and torch.all(dense[1, 32:] == 2.0**127)


def test_mxfp4_scale_255_is_nan():
    w = MXFP4Weight(torch.full((1, 16), 0x22, dtype=torch.uint8), torch.tensor([[255]], dtype=torch.uint8))
    assert torch.isnan(w.dequantize()).all()


def test_mxfp4_dequantize_matches_independent_decoder():
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 5, 48), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 3), generator=gen, dtype=torch.uint8)
    w = MXFP4Weight(packed, scales)
    torch.testing.assert_close(w.dequantize(torch.float64), decode_mxfp4(packed, scales), rtol=0, atol=0)


# ---------------------------------------------------------------- MXFP4 quantization


def _representable_mxfp4(shape, gen):
    """Random values that are exactly representable: E2M1 value x 2**e per 32-block."""
    codes = torch.randint(0, 16, shape, generator=gen)
    values = torch.tensor([decode_e2m1(c) for c in range(16)], dtype=torch.float64)[codes]
    # Force each block's amax into [4, 6] so the shared exponent is the block's own.
    values.view(*shape[:-1], -1, 32)[..., 0] = 6.0
    exps = torch.randint(-10, 10, (*shape[:-1], shape[-1] // 32), generator=gen).double()
    return values * torch.exp2(exps).repeat_interleave(32, dim=-1)


def test_mxfp4_round_trip_is_exact_for_representable_values():
    w = _representable_mxfp4((4, 6, 64), torch.Generator().manual_seed(2))
    q = quantize_mxfp4(w.float())
    torch.testing.assert_close(q.dequantize(torch.float64), w, rtol=0, atol=0)
    assert q.packed.shape == (4, 6, 32) and q.scales.shape == (4, 6, 2)


def test_mxfp4_quantize_error_bound():
    w = torch.randn(8, 16, 128, generator=torch.Generator().manual_seed(3))
    back = quantize_mxfp4(w).dequantize()
    blocks = w.unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.floor(torch.log2(blocks.abs().amax(-1, keepdim=True))) - 2)
    err = (back.unflatten(-1, (-1, 32)) - blocks).abs()
    in_range = blocks.abs() <= 6 * scale
    # Largest gap of the E2M1 grid is 2 (4 -> 6): half of it in range; clipped values lose < 2.
    assert torch.all(err[in_range] <= 1.0 * scale.expand_as(err)[in_range] + 1e-7)
    assert torch.all(err <= 2.0 * scale + 1e-7)
    assert (back - w).abs().mean() < 0.15 * w.abs().mean()  # ~11% for Gaussian blocks


def test_mxfp4_quantize_rounds_ties_to_even():
    # 1.25 lies between 1.0 (code 2, even) and 1.5 (code 3): goes to 1.0; 5.0 between 4 and 6 -> 4.
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = 6.0, 1.25, 5.0
    back = quantize_mxfp4(w).dequantize()
    assert back[0, :3].tolist() == [6.0, 1.0, 4.0]


def test_mxfp4_zero_block_dequantizes_to_zero():
    assert torch.all(quantize_mxfp4(torch.zeros(2, 64)).dequantize() == 0)


# ---------------------------------------------------------------- FP8


@pytest.mark.parametrize(
    ("granularity", "scale_shape", "fmt"),
    [
        ("tensor", (3, 1, 1), "fp8_per_tensor"),
        ("channel", (3, 200, 1), "fp8_per_channel"),
        ("block", (3, 2, 3), "fp8_block"),
    ],
)
def test_fp8_granularity_from_scale_shape(granularity, scale_shape, fmt):
    w = torch.randn(3, 200, 300, generator=torch.Generator().manual_seed(4))
    q = quantize_fp8(w, granularity)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float32
    assert tuple(q.scale.shape) == scale_shape
    assert q.granularity == granularity and q.format == fmt
    back = q.dequantize(torch.float64)
    torch.testing.assert_close(back, decode_fp8(q.data, q.scale), rtol=0, atol=0)
    # e4m3: 3 mantissa bits -> relative rounding error <= 2**-4, plus a subnormal floor.
    expanded = decode_fp8(torch.ones_like(q.data), q.scale)
    assert torch.all((back - w.double()).abs() <= w.double().abs() * 2.0**-4 + expanded * 2.0**-9)


def test_fp8_round_trip_exact_for_representable_values():
    gen = torch.Generator().manual_seed(5)
    data = (torch.randn(2, 64, 96, generator=gen) * 50).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.5, 0.25]).view(2, 1, 1)
    w = FP8Weight(data, scale)
    exact = data.double() * scale.double()
    torch.testing.assert_close(dequantize_fp8(w, torch.float64), exact, rtol=0, atol=0)
    # Re-quantizing per tensor with amax scaling reproduces the same real values when the
    # amax is exactly 448 * scale.
    data[:, 0, 0] = 448.0
    back = quantize_fp8(FP8Weight(data, scale).dequantize(), "tensor").dequantize(torch.float64)
    torch.testing.assert_close(back, data.double() * scale.double(), rtol=0, atol=0)


def test_fp8_block_scale_expansion_on_ragged_edges():
    data = torch.ones(1, 130, 129, dtype=torch.float8_e4m3fn)
    scale = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    dense = FP8Weight(data, scale).dequantize()
    assert dense[0, 0, 0] == 1 and dense[0, 0, 128] == 2 and dense[0, 129, 0] == 3 and dense[0, 129, 128] == 4
    assert dense[0, 127, 127] == 1 and dense[0, 128, 127] == 3


# ---------------------------------------------------------------- validation


def test_mxfp4_rejects_bad_dtypes_and_shapes():
    with pytest.raises(TypeError, match="uint8"):
        MXFP4Weight(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        MXFP4Weight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.float32))
    with pytest.raises(ValueError, match="scales must have shape"):
        MXFP4Weight(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scales must have shape"):  # K = 20 is not a multiple of 32
        MXFP4Weight(torch.zeros(2, 10, dtype=torch.uint8), torch.zeros(2, 0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))


def test_fp8_rejects_bad_dtypes_and_shapes():
    data = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        FP8Weight(torch.zeros(2, 4, 8), torch.ones(2, 1, 1))
    with pytest.raises(TypeError, match="float32"):
        FP8Weight(data, torch.ones(2, 1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="rank"):
        FP8Weight(data, torch.ones(2, 1))
    with pytest.raises(ValueError, match="leading dims"):
        FP8Weight(data, torch.ones(3, 1, 1))
    with pytest.raises(ValueError, match="matches no granularity"):
        FP8Weight(data, torch.ones(2, 3, 1))
    with pytest.raises(ValueError, match="granularity"):
        quantize_fp8(torch.randn(4, 8), "row")


def test_containers_are_frozen():
    w = quantize_mxfp4(torch.randn(2, 32))
    with pytest.raises(AttributeError):
        w.packed = w.packed
    assert math.prod(w.shape) == 64


# ---------------------------------------------------------------- MXFP8 activations (rule)


def _mx8(values, dtype=torch.float64):
    from tokenspeed_kernel.quant import quantize_mxfp8

    return quantize_mxfp8(torch.tensor(values, dtype=dtype).reshape(1, -1))


def _block(*head, fill=0.0):
    """A 32-value block starting with ``head``, padded with ``fill``."""
    return list(head) + [fill] * (32 - len(head))


def test_mxfp8_matches_independent_nearest_value_search():
    from support.naive_moe import naive_fake_mxfp8

    from tokenspeed_kernel.quant import dequantize_mxfp8, fake_quantize_mxfp8, quantize_mxfp8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=gen, dtype=torch.float64) * torch.logspace(-30, 30, 6, base=2.0)[:, None]
    x[2, 40] = 1e4  # one outlier: its block's other values lose precision
    data, scales = quantize_mxfp8(x)
    assert data.dtype == torch.float8_e4m3fn and scales.dtype == torch.uint8 and scales.shape == (6, 4)
    expected = naive_fake_mxfp8(x)
    torch.testing.assert_close(dequantize_mxfp8(data, scales, torch.float64), expected, rtol=0, atol=0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.clamp(-6e4, 6e4).to(dtype)
        got = fake_quantize_mxfp8(xd, torch.float64)
        torch.testing.assert_close(got, naive_fake_mxfp8(xd.double()), rtol=0, atol=0)
    # relative error per value of a normal e4m3 element: at most half a quantum, 2**-4
    big = x.abs() >= x.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, -1) * 2**-6
    rel = ((expected - x).abs() / x.abs())[
        big & (x.abs() < 448 * 2.0 ** (scales.double() - 127).repeat_interleave(32, -1))
    ]
    assert rel.max() <= 2**-4


def test_mxfp8_zero_block_gets_the_smallest_scale():
    data, scales = _mx8(_block() + _block(-0.0))
    assert scales.tolist() == [[0, 0]]
    assert torch.equal(data.double(), torch.zeros(1, 64, dtype=torch.float64))
    assert torch.signbit(data[0, 32].double())  # -0.0 keeps its sign


@pytest.mark.parametrize("k", [-20, 0, 3, 8, 100])
def test_mxfp8_amax_at_a_power_of_two(k):
    data, scales = _mx8(_block(2.0**k, -(2.0**k) * 0.75, 2.0**k / 256))
    assert int(scales[0, 0]) == k - 8 + 127  # floor(log2(2^k)) - emax(8)
    assert data[0, :3].double().tolist() == [256.0, -192.0, 1.0]


def test_mxfp8_just_below_a_power_of_two_saturates():
    # amax = 2^4 (1 - 2^-10): floor(log2) = 3, scaled amax 511.5 -> saturates at 448
    data, scales = _mx8(_block(16.0 * (1 - 2**-10), -15.0, 14.5))
    assert int(scales[0, 0]) == 3 - 8 + 127
    assert data[0, :3].double().tolist() == [448.0, -448.0, 448.0]  # 480, 464 -> 448 as well


def test_mxfp8_rounds_to_nearest_even_and_keeps_signs():
    # amax 256 -> e = 0: values are rounded as they are
    head = (256.0, 1.0625, -1.1875, 1.0624, -(2.0**-10), 3 * 2.0**-10, -5 * 2.0**-10, 17.0, -19.0)
    data, scales = _mx8(_block(*head))
    assert int(scales[0, 0]) == 127
    # 1.0625 tie -> 1.0 (even); -1.1875 tie -> -1.25; 2^-10 tie -> -0.0; 3*2^-10 -> 2^-8 (even
    # subnormal code 2); -5*2^-10 -> -3*2^-9... tie between 2*2^-9 and 3*2^-9 -> even code 2;
    # 17 tie between 16 and 18 -> 16; -19 tie between 18 and 20 -> -20
    want = [256.0, 1.0, -1.25, 1.0, -0.0, 2.0**-8, -(2.0**-8), 16.0, -20.0]
    assert data[0, : len(head)].double().tolist() == want


def test_mxfp8_scale_clamps_and_nan_blocks():
    from tokenspeed_kernel.quant import dequantize_mxfp8

    tiny = _block(2.0**-130, -(2.0**-131), 2.0**-140)
    data, scales = _mx8(tiny + _block(float("nan"), 1.0) + _block(float("inf")))
    assert scales.tolist() == [[0, 255, 255]]  # e = -138 clamps to -127 (scale byte 0)
    # 2^-130 / 2^-127 = 0.125; 2^-140 / 2^-127 = 2^-13 is below e4m3's smallest subnormal
    assert data[0, :3].double().tolist() == [0.125, -0.0625, 0.0]
    assert torch.isnan(data[0, 32:].double()).all()
    out = dequantize_mxfp8(data, scales, torch.float64)
    assert out[0, :2].tolist() == [2.0**-130, -(2.0**-131)] and torch.isnan(out[0, 32:]).all()


def test_mxfp8_rejects_a_ragged_last_dim():
    from tokenspeed_kernel.quant import quantize_mxfp8

    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(torch.zeros(2, 48))


def test_pow2_is_exact_from_its_bits():
    """The quantizers' powers of two are built from bits, not torch.pow/ldexp (inexact in float64
    on an H100 for negative exponents: the per-token fp8 reference then rounded 0.78125 up)."""
    from tokenspeed_kernel.quant import _pow2

    exps = torch.arange(-1022, 1024)
    assert _pow2(exps).tolist() == [math.ldexp(1.0, e) for e in exps.tolist()]
    assert _pow2(exps.to(torch.int32)).dtype == torch.float64
