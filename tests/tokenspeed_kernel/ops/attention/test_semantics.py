"""Attention semantics against the independent float64 implementation in tests/support.

Every awkward case (ragged lengths, partial pages, page sizes 1..64, GQA/MQA, windows incl.
0, sinks, logit cap, LSE, Dv != D, non-causal, speculative decode, fp8 KV) in every
activation dtype, through the public API with the reference kernel forced, outputs
poisoned with NaN first. The float64 ground truth of the tools is checked the same way.
"""

import pytest
import torch
from support.naive_attention import naive_decode, naive_extend, naive_prefill

from tokenspeed_kernel.tools.cases import attention as cases

NAIVE = {"attention.prefill": naive_prefill, "attention.extend": naive_extend, "attention.decode": naive_decode}
REFERENCE = {
    "attention.prefill": "torch_prefill",
    "attention.extend": "torch_extend",
    "attention.decode": "torch_decode",
}
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_SKIP = ("max_seqlen_q", "max_seqlen_k", "return_lse", "causal")

CASES = [
    pytest.param(case, dtype, id=f"{case.op}-{case.name}-{str(dtype)[6:]}")
    for op in NAIVE
    for dtype in TOL
    for case in cases.awkward_cases(op, dtype)
]


def _naive(case, inputs):
    kwargs = {k: v for k, v in inputs.items() if k not in _SKIP}
    if case.op != "attention.decode":
        kwargs["causal"] = case.causal
    return NAIVE[case.op](**kwargs)


@pytest.mark.parametrize(("case", "dtype"), CASES)
def test_public_api_matches_naive_float64(case, dtype):
    inputs = cases.make_inputs(case, seed=hash(case.name) % 1000)
    expected_out, expected_lse = _naive(case, inputs)
    poisoned = torch.full(expected_out.shape, float("nan"), dtype=dtype)
    result = cases.call(case, inputs, override=REFERENCE[case.op], out=poisoned)
    out, lse = result if case.return_lse else (result, None)
    assert out is poisoned
    tol = TOL[dtype]
    scale = expected_out.abs().max().item() + 1
    assert not torch.isnan(out).any(), "some output element was never written"
    torch.testing.assert_close(out.double(), expected_out, atol=tol * scale, rtol=tol)
    if case.return_lse:
        assert lse.dtype == torch.float32 and lse.shape == expected_lse.shape
        torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("op", list(NAIVE))
def test_tools_ground_truth_matches_naive(op):
    for case in cases.awkward_cases(op, torch.float32):
        inputs = cases.make_inputs(case, seed=3)
        out, lse = cases.reference(case, inputs)
        expected_out, expected_lse = _naive(case, inputs)
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, expected_out, atol=1e-12, rtol=1e-12)
        if case.return_lse:
            torch.testing.assert_close(lse, expected_lse, atol=1e-12, rtol=1e-12)


def _decode_inputs(seqlens, q_len=1, heads=(4, 2), dim=16, page=4, dtype=torch.float32):
    case = cases.AttentionCase(
        "attention.decode", (q_len,) * len(seqlens), tuple(seqlens), *heads, dim, page_size=page, dtype=dtype
    )
    return case, cases.make_inputs(case, seed=11)


def test_decode_equals_last_row_of_prefill_over_the_same_tokens():
    """Decode of the last token == prefill of the whole sequence, at the last row."""
    case, inputs = _decode_inputs([13])
    out = cases.call(case, inputs, override="torch_decode")
    length, page = 13, case.page_size
    rows = [inputs["k_cache"][int(inputs["page_table"][0, j // page]), j % page] for j in range(length)]
    k = torch.stack(rows)
    v = torch.stack([inputs["v_cache"][int(inputs["page_table"][0, j // page]), j % page] for j in range(length)])
    q = torch.cat([torch.randn(length - 1, *inputs["q"].shape[1:]), inputs["q"]])
    cu = torch.tensor([0, length], dtype=torch.int32)
    from tokenspeed_kernel import mha_prefill

    full = mha_prefill(q, k, v, cu, cu, length, length, override="torch_prefill")
    torch.testing.assert_close(out[0], full[-1], atol=1e-6, rtol=1e-6)


def test_window_zero_sees_only_its_own_key():
    """With window_left=0 (causal) each query attends only to its own key: out == v of that row."""
    case = cases.AttentionCase("attention.prefill", (6,), (6,), 2, 1, 8, dtype=torch.float32, window_left=0)
    inputs = cases.make_inputs(case)
    out, lse = cases.call(case, {**inputs, "return_lse": True}, override="torch_prefill")
    torch.testing.assert_close(out, inputs["v"].expand(-1, 2, -1), atol=1e-6, rtol=1e-6)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_rows_that_see_no_key(with_sinks):
    """Empty sequences and rows without visible keys: out 0; lse -inf, or the sink's logit
    when there is a sink. Causal queries placed before the first key (Lq > Lk) see nothing."""
    heads, dim = 4, 8
    q = torch.randn(9, heads, dim)
    k, v = torch.randn(2, 2, dim), torch.randn(2, 2, dim)
    cu_q = torch.tensor([0, 0, 4, 9], dtype=torch.int32)  # sequence 0 empty, 1 has no keys, 2 has Lq=5 > Lk=2
    cu_k = torch.tensor([0, 0, 0, 2], dtype=torch.int32)
    sinks = torch.randn(heads) if with_sinks else None
    out = torch.full((9, heads, dim), float("nan"))
    from tokenspeed_kernel import mha_prefill

    got, lse = mha_prefill(q, k, v, cu_q, cu_k, 5, 2, sinks=sinks, return_lse=True, out=out, override="torch_prefill")
    expected_out, expected_lse = naive_prefill(q, k, v, cu_q, cu_k, sinks=sinks)
    blind = [0, 1, 2, 3, 4, 5, 6]  # sequence 1 (no keys) and the first 3 queries of sequence 2
    assert torch.equal(got[blind], torch.zeros(len(blind), heads, dim))
    want_blind = sinks.expand(len(blind), -1) if with_sinks else torch.full((len(blind), heads), float("-inf"))
    torch.testing.assert_close(lse[blind], want_blind)
    torch.testing.assert_close(got.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_fp8_scale_as_float_or_tensor_agree():
    case = cases.awkward_cases("attention.decode", torch.float32)[3]
    assert case.kv_dtype == torch.float8_e4m3fn
    inputs = cases.make_inputs(case)
    as_float = cases.call(case, inputs, override="torch_decode")
    tensors = {"k_scale": torch.tensor([inputs["k_scale"]]), "v_scale": torch.tensor(inputs["v_scale"])}
    as_tensor = cases.call(case, {**inputs, **tensors}, override="torch_decode")
    torch.testing.assert_close(as_float, as_tensor, atol=0, rtol=0)
    doubled = cases.call(case, {**inputs, "v_scale": 2 * inputs["v_scale"]}, override="torch_decode")
    torch.testing.assert_close(doubled, 2 * as_float)


def test_softmax_scale_and_3d_vs_4d_decode_agree():
    case, inputs = _decode_inputs([9, 20])
    out3 = cases.call(case, {**inputs, "softmax_scale": 0.3}, override="torch_decode")
    out4 = cases.call(case, {**inputs, "q": inputs["q"].unsqueeze(1), "softmax_scale": 0.3}, override="torch_decode")
    torch.testing.assert_close(out3, out4.squeeze(1))
    default = cases.call(case, inputs, override="torch_decode")
    assert not torch.allclose(default, out3)
