"""Triton KV store against the naive float64 store (bit-exact), negative slots skipped."""

import pytest
import torch
from support.naive_attention import naive_store

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("index", range(3))
def test_triton_store_is_exact(dtype, index):
    case = cases.awkward_cases("kvcache.store", dtype)[index]
    inputs = cases.make_inputs(case, DEVICE, seed=index)
    expected_k, expected_v = naive_store(**inputs)
    k_cache, v_cache = cases.call(case, inputs)
    assert last_kernel() == "triton_store_kvcache"
    assert torch.equal(k_cache.cpu().view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), expected_v.view(torch.uint8))


def test_fp8_store_keeps_the_sign_of_values_that_round_to_zero():
    # Tiny negatives (and -0.0) round to -0.0 in e4m3 (0x80), as torch's conversion (and the
    # GPU's cvt) give; the interpreter's rounding helper once returned +0.0 for them.
    from tokenspeed_kernel_triton.ops.kvcache.store import _store_rows

    values = [-1e-6, -1e-4, -9e-4, -0.0, 0.0, 1e-6, -3e-3, -7.84, -500.0, 500.0, -(2.0**-10), -(2.0**-9)]
    src = torch.tensor(values, dtype=torch.float32).view(1, 1, -1)
    dim = src.shape[-1]
    block_d = 1 << (dim - 1).bit_length()
    cache = torch.full((1, 1, 1, dim), 0.5, dtype=torch.float32).to(torch.float8_e4m3fn).to(DEVICE)
    scale = torch.ones(1, device=DEVICE)
    src = src.to(DEVICE)
    _store_rows[(1, 1)](  # the K half only: program (0, 0)
        src,
        src,
        cache,
        cache,
        torch.zeros(1, dtype=torch.int64, device=DEVICE),
        scale,
        scale,
        dim,
        dim,
        dim,
        dim,
        dim,
        dim,
        dim,
        dim,
        dim,
        dim,
        1,
        PAGE_SIZE=1,
        DIM_K=dim,
        DIM_V=dim,
        BLOCK_H=1,
        BLOCK_D=block_d,
        FP8=True,
        INTERPRET=DEVICE == "cpu",
        num_warps=1,
    )
    expected = src.cpu().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten()
    got = cache.cpu().flatten()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (got, expected)
    assert torch.signbit(got.float()).tolist() == torch.signbit(expected.float()).tolist()
    assert got.view(torch.uint8)[:4].tolist() == [0x80] * 4
