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
