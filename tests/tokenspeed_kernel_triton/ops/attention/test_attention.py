"""Triton attention kernels against the independent float64 attention of tests/support.

On a machine without a GPU these run under TRITON_INTERPRET=1 on CPU tensors (set by
tests/conftest.py), where the Triton kernels serve the CPU platform and win selection: the
tests call the public API with no override and assert the Triton kernel ran.
"""

import pytest
import torch
from support.naive_attention import NAIVE, check_case, naive_for_case

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases

KERNEL = {
    "attention.prefill": "triton_prefill",
    "attention.extend": "triton_extend",
    "attention.decode": "triton_decode",
}
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [
    pytest.param(case, id=f"{case.op}-{case.name}-{str(dtype)[6:]}")
    for op in NAIVE
    for dtype in TOL
    for case in cases.awkward_cases(op, dtype)
]

EXTRA = [
    # head dim 80 (padded to 128 with masking), 96, 256; GQA 3 (padded group); page 256; MQA 16:1
    cases.AttentionCase("attention.prefill", (33, 7), (33, 20), 6, 2, 80, dtype=torch.bfloat16, sinks=True, name="d80_gqa3"),
    cases.AttentionCase("attention.extend", (9,), (300,), 4, 4, 96, page_size=256, dtype=torch.float16, window_left=40, name="d96_page256"),
    cases.AttentionCase("attention.decode", (2, 2), (70, 3), 16, 1, 256, page_size=2, dtype=torch.bfloat16, sinks=True, return_lse=True, name="d256_mqa16_spec2"),
    cases.AttentionCase("attention.decode", (1,) * 2, (700, 1000), 8, 2, 64, page_size=32, dtype=torch.bfloat16, sinks=True, return_lse=True, logit_cap=30.0, name="long_splitkv"),
]  # fmt: skip


def _naive(case, inputs):
    return naive_for_case(case, inputs)


@pytest.mark.parametrize("case", CASES + [pytest.param(c, id=f"{c.op}-{c.name}") for c in EXTRA])
def test_triton_attention_matches_naive(case):
    inputs = cases.make_inputs(case, DEVICE, seed=len(case.name))
    check_case(case, inputs, kernel=KERNEL[case.op], tol=TOL[case.dtype], device=DEVICE)


def test_decode_splits_the_key_range_for_a_small_batch():
    from tokenspeed_kernel_triton.ops.attention._launch import MIN_SPLIT_KEYS, num_splits

    assert num_splits(1, 8, 8192, torch.device("cpu")) == 1  # CPU: one "SM"
    if torch.cuda.is_available():
        assert num_splits(1, 8, 8192, torch.device("cuda")) > 1
        assert num_splits(256, 8, 2048, torch.device("cuda")) == 1
    assert num_splits(1, 1, MIN_SPLIT_KEYS - 1, torch.device("cpu")) == 1


@pytest.mark.parametrize("op", ["attention.prefill", "attention.decode"])
def test_rescale_when_the_max_grows_in_later_tiles(op):
    """Keys whose logits grow along the sequence (by far more than 2^8) make the running max
    move in later key tiles and across decode splits: the rescale of acc and l must follow."""
    if op == "attention.prefill":
        case = cases.AttentionCase(
            op, (150,), (150,), 4, 2, 64, dtype=torch.float16, sinks=True, return_lse=True, name="ramp"
        )
    else:
        case = cases.AttentionCase(
            op, (1, 1), (300, 170), 4, 2, 64, page_size=16, dtype=torch.float16, return_lse=True, name="ramp"
        )
    inputs = cases.make_inputs(case, DEVICE, seed=5)
    key = "k" if op == "attention.prefill" else "k_cache"
    k = inputs[key].float()
    ramp = torch.linspace(0.2, 6.0, k.shape[0], device=k.device).view(-1, *([1] * (k.dim() - 1)))
    inputs[key] = (k * ramp).to(case.dtype)
    expected_out, expected_lse = _naive(case, inputs)
    out, lse = cases.call(case, inputs)
    assert last_kernel() == KERNEL[op]
    torch.testing.assert_close(
        out.double().cpu(), expected_out, atol=3e-3 * (float(expected_out.abs().max()) + 1), rtol=3e-3
    )
    torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-3, rtol=2e-3)


def test_decode_plan_runs_a_row_strided_q_in_place():
    """``mha_decode_plan(..., q_row_stride=...)`` with ``triton_decode``: a fused qkv's q (NaN
    past each row's q) run in place gives the functional call's bits and float64's values."""
    import dataclasses

    from tokenspeed_kernel import mha_decode_plan, mha_decode_with_kvcache

    case = cases.AttentionCase(
        "attention.decode", (1,) * 3, (37, 5, 70), 8, 2, 64, page_size=16, dtype=torch.bfloat16, sinks=True,
        window_left=40, name="strided_plan",
    )  # fmt: skip
    case = dataclasses.replace(case, strided_q=True)
    inputs = cases.make_inputs(case, DEVICE, seed=2)
    q = inputs["q"]
    assert q.stride(0) == (8 + 2 * 2) * 64
    plan = mha_decode_plan(
        inputs["k_cache"], inputs["v_cache"], inputs["page_table"], inputs["cache_seqlens"], inputs["max_seqlen_k"],
        num_q_heads=8, q_dtype=q.dtype, window_left=40, sinks=inputs["sinks"], q_row_stride=q.stride(0),
    )  # fmt: skip
    assert plan.kernel == "triton_decode" and "strided_q" in plan.request.features
    want = mha_decode_with_kvcache(**inputs)
    out = torch.full_like(want, float("nan"))
    plan.run(q, out=out)
    assert last_kernel() == "triton_decode"
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(plan.run(q), want, rtol=0, atol=0)
    expected, _ = naive_for_case(case, inputs)
    scale = float(expected.abs().max()) + 1.0
    torch.testing.assert_close(out.double().cpu(), expected, atol=TOL[case.dtype] * scale, rtol=TOL[case.dtype])
