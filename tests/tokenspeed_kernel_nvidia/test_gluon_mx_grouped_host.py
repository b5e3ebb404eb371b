"""The layer-2 grouped GEMM prototype (``gluon_mx_grouped``) on the CPU: its emulation (the
kernel's decode of the prepared words and its work list) against float64 on awkward expert
sizes, and the launcher's argument checks."""

import pytest
import torch
from support.mx_grouped import grouped_case, grouped_reference

from tokenspeed_kernel.quant import quantize_mxfp4
from tokenspeed_kernel_nvidia.ops.moe.gluon_mx_grouped import (
    GroupedW2Config,
    check_w2_grouped,
    decode_swap_words,
    emulate_w2_grouped,
)
from tokenspeed_kernel_triton.ops.moe.fused_mx_swap import swap_operand


@pytest.mark.parametrize(("n", "k"), [(96, 160), (136, 384)])
def test_emulation_matches_float64(n, k):
    case = grouped_case(n, k)
    got = emulate_w2_grouped(case.x, case.words, case.scales, case.sorted_ids, case.tile_expert, case.num_tiles,
                             case.num_pairs)  # fmt: skip
    ref = grouped_reference(case)
    assert got.shape == ref.shape == (1 + 127 + 128 + 129, n)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def test_decode_is_dequantize_exactly():
    """Every E2M1 code and the extreme scales (0 -> 2**-127, 254, 255 -> NaN) decode to the
    public dequantization, padding K to zeros."""
    w = quantize_mxfp4(torch.randn(2, 8, 160))
    w.scales[0, 0, 0] = 0
    w.scales[0, 1, 1] = 254
    w.scales[1, 2, 3] = 255
    op = swap_operand(w)
    from tokenspeed_kernel.quant import dequantize_mxfp4

    got = decode_swap_words(op.words, op.scales)
    ref = dequantize_mxfp4(w, torch.float32)
    assert got.shape == (2, 8, 256)
    torch.testing.assert_close(got[..., :160], ref, equal_nan=True, rtol=0, atol=0)
    assert not got[..., 160:].any()


def test_checks_name_the_argument():
    case = grouped_case(96, 160, rows=(1,))
    out = torch.empty(case.num_pairs, 96)
    args = [case.x, case.words, case.scales, case.sorted_ids, case.tile_expert, torch.ones(1, dtype=torch.int32), out]
    check_w2_grouped(*args)
    with pytest.raises(TypeError, match="x must"):
        check_w2_grouped(case.x.float(), *args[1:])
    with pytest.raises(ValueError, match="out must"):
        check_w2_grouped(*args[:6], out.double())
    with pytest.raises(ValueError, match="tile_expert"):
        check_w2_grouped(*args[:4], case.tile_expert.long(), *args[5:])
    with pytest.raises(ValueError, match="stages"):
        GroupedW2Config(stages=6)
    with pytest.raises(ValueError, match="exceeds 3 x maxnreg"):
        GroupedW2Config(consumer_regs=248, maxnreg=168)
