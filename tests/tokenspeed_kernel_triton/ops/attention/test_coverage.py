"""Contract points of the Triton attention issue that the awkward cases touch only once or not
at all, under the interpreter against the float64 reference:

- every head dim (64, 128, 256 and the padded 80, 96) on each of prefill, extend and decode,
  in bf16 and fp16;
- every power-of-two page size 1..256 on extend, decode (fp8 KV included) and the KV store
  (bit-exact, negative slots skipped);
- sliding windows skip the key tiles wholly outside the window: those keys are poisoned with
  NaN after the expected result is computed, so a kernel that visited them would return NaN.
"""

import os

import pytest
import torch
from support.naive_attention import NAIVE, check_case, naive_for_case, naive_store

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL = {
    "attention.prefill": "triton_prefill",
    "attention.extend": "triton_extend",
    "attention.decode": "triton_decode",
}
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
FP8 = torch.float8_e4m3fn
PAGE_SIZES = [2**i for i in range(9)]


def _naive(case, inputs):
    return naive_for_case(case, inputs)


def _run_and_check(case, inputs, expected=None):
    check_case(case, inputs, kernel=KERNEL[case.op], tol=TOL[case.dtype], device=DEVICE, expected=expected)


def _head_dim_case(op, head_dim, dtype):
    if op == "attention.prefill":
        return cases.AttentionCase(
            op, (3, 20), (3, 20), 8, 2, head_dim, dtype=dtype, sinks=True, return_lse=True, name=f"prefill_d{head_dim}"
        )
    if op == "attention.extend":
        return cases.AttentionCase(
            op,
            (5, 9),
            (40, 9),
            8,
            2,
            head_dim,
            page_size=16,
            dtype=dtype,
            window_left=20,
            return_lse=True,
            name=f"extend_d{head_dim}",
        )
    return cases.AttentionCase(
        op,
        (2, 2),
        (2, 45),
        8,
        2,
        head_dim,
        page_size=8,
        dtype=dtype,
        sinks=True,
        logit_cap=30.0,
        return_lse=True,
        name=f"decode_d{head_dim}",
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("op", list(NAIVE))
def test_every_head_dim_on_every_op(op, head_dim, dtype):
    case = _head_dim_case(op, head_dim, dtype)
    _run_and_check(case, cases.make_inputs(case, DEVICE, seed=head_dim))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("op", ["attention.extend", "attention.decode"])
def test_every_page_size(op, page_size):
    """Lengths straddle page boundaries (partial last pages); decode also reads an fp8 cache."""
    n = page_size + 3
    if op == "attention.extend":
        case = cases.AttentionCase(
            op,
            (4, 1),
            (n, 2 * n),
            4,
            1,
            64,
            page_size=page_size,
            dtype=torch.float16,
            sinks=True,
            name=f"extend_p{page_size}",
        )
    else:
        case = cases.AttentionCase(
            op,
            (1, 1, 1),
            (1, n, 2 * n),
            4,
            2,
            64,
            page_size=page_size,
            dtype=torch.bfloat16,
            kv_dtype=FP8,
            return_lse=True,
            name=f"decode_fp8_p{page_size}",
        )
    _run_and_check(case, cases.make_inputs(case, DEVICE, seed=page_size))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, FP8], ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_store_every_page_size_skips_negative_slots(page_size, cache_dtype):
    src = torch.float16 if cache_dtype == torch.float16 else torch.bfloat16
    case = cases.AttentionCase(
        "kvcache.store",
        (3, page_size + 1),
        (page_size + 5, 2 * page_size + 1),
        2,
        2,
        64,
        page_size=page_size,
        dtype=src,
        kv_dtype=None if cache_dtype == src else cache_dtype,
    )
    inputs = cases.make_inputs(case, DEVICE, seed=page_size)
    assert (inputs["slot_mapping"] < 0).any(), "the case must hold padding rows"
    before_k = inputs["k_cache"].clone()
    expected_k, expected_v = naive_store(**inputs)
    k_cache, v_cache = cases.call(case, inputs)
    assert last_kernel() == "triton_store_kvcache"
    for got, want in ((k_cache.cpu(), expected_k), (v_cache.cpu(), expected_v)):
        if cache_dtype == FP8 and INTERPRET:
            # Under the interpreter the store rounds to e4m3 in fp32 first (store._round_e4m3),
            # and its negation of a zero gives +0: a negative value that rounds to zero is
            # stored as +0 where the GPU's conversion stores -0. Equal values, other bits.
            assert torch.equal(got.float(), want.float())
        else:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(k_cache.view(torch.uint8), before_k.view(torch.uint8))


# ------------------------------------------------------------------ window tile skipping

WINDOW = 24
FAR = 128  # keys more than this far left of the window are in no tile a kernel may visit


def _poison_far_keys(case, inputs):
    """NaN into K and V at every key position that lies more than FAR keys left of the first
    key any query of its sequence can see (bottom-right aligned, window ``WINDOW``)."""
    nan = float("nan")
    for b, (lq, lk) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
        first_visible = max(0, lk - lq - WINDOW)
        far = list(range(0, max(0, first_visible - FAR)))
        if case.op == "attention.prefill":
            start = int(inputs["cu_seqlens_k"][b])
            for name in ("k", "v"):
                inputs[name][start : start + len(far)] = nan
        else:
            size = case.page_size
            for pos in far:
                page = int(inputs["page_table"][b, pos // size])
                inputs["k_cache"][page, pos % size] = nan
                inputs["v_cache"][page, pos % size] = nan
    return inputs


WINDOW_CASES = [
    cases.AttentionCase("attention.prefill", (20, 7), (700, 400), 8, 2, 64, dtype=torch.bfloat16,
                        window_left=WINDOW, sinks=True, return_lse=True, name="prefill_window"),
    cases.AttentionCase("attention.extend", (9, 30), (600, 450), 8, 1, 64, page_size=16, dtype=torch.float16,
                        window_left=WINDOW, return_lse=True, name="extend_window"),
    cases.AttentionCase("attention.decode", (1, 1), (900, 300), 8, 2, 64, page_size=32, dtype=torch.bfloat16,
                        window_left=WINDOW, sinks=True, return_lse=True, name="decode_window"),
    cases.AttentionCase("attention.decode", (4, 4), (640, 520), 8, 2, 64, page_size=8, dtype=torch.bfloat16,
                        window_left=WINDOW, name="decode_window_spec4"),
]  # fmt: skip


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: c.name)
def test_window_never_touches_tiles_outside_it(case):
    inputs = cases.make_inputs(case, DEVICE, seed=7)
    expected = _naive(case, inputs)  # before poisoning
    _run_and_check(case, _poison_far_keys(case, inputs), expected)


@pytest.mark.parametrize("splits", [2, 5])
def test_window_split_decode_never_touches_tiles_outside_it(monkeypatch, splits):
    from tokenspeed_kernel_triton.ops.attention import decode

    monkeypatch.setattr(decode, "num_splits", lambda *a: splits)
    case = WINDOW_CASES[2]
    inputs = cases.make_inputs(case, DEVICE, seed=3)
    expected = _naive(case, inputs)
    _run_and_check(case, _poison_far_keys(case, inputs), expected)
