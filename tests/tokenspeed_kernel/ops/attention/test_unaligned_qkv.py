"""Misaligned q/k/v: a contiguous operand whose address (or a row stride) is not a multiple
of 16 bytes is a valid call. The request carries ``unaligned_qkv``; a kernel that needs
aligned operands (TMA, 16-byte vectors) leaves the feature out and is passed over, with its
reason, for the next kernel, instead of raising after it was chosen."""

import pytest
import torch

from tokenspeed_kernel import explain, last_kernel, mha_prefill
from tokenspeed_kernel.ops.attention import api
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools import cases as all_cases
from tokenspeed_kernel.tools.cases import attention as cases


def _case(misaligned: bool) -> cases.AttentionCase:
    return cases.AttentionCase(
        "attention.prefill", (5, 12), (5, 12), 4, 2, 16, dtype=torch.float32, sinks=True, misaligned=misaligned
    )


_POSITIONAL = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def _request(inputs: dict):
    """The request the public call builds for ``inputs`` (its checks, no launch)."""
    call = (
        *(inputs[name] for name in _POSITIONAL),
        inputs["causal"],
        None,
        -1,
        inputs["sinks"],
        0.0,
        False,
        None,
        None,
    )
    return api.PrefillCall.check(False, *call).request


@pytest.mark.parametrize("misaligned", [False, True])
def test_the_request_says_whether_q_k_v_are_aligned(misaligned):
    case = _case(misaligned)
    inputs = cases.make_inputs(case, seed=1)
    assert (inputs["q"].data_ptr() % 16 != 0) == misaligned
    request = _request(inputs)
    assert ("unaligned_qkv" in request.features) == misaligned
    assert request == cases.request(case)  # the case tools describe the same call


def test_one_misaligned_operand_is_enough_and_row_strides_count():
    inputs = cases.make_inputs(_case(False), seed=1)
    buf = torch.empty(inputs["v"].numel() + 1)
    v = buf[1:].view(inputs["v"].shape).copy_(inputs["v"])
    assert "unaligned_qkv" in _request({**inputs, "v": v}).features
    # rows of 6 floats (24 bytes): aligned start, 8-byte row stride
    q = torch.randn(17, 4, 6)
    k, v = torch.randn(17, 2, 6), torch.randn(17, 2, 6)
    assert "unaligned_qkv" in _request({**inputs, "q": q, "k": k, "v": v}).features


def test_copies_keep_the_misalignment():
    inputs = cases.make_inputs(_case(True), seed=1)
    fresh = all_cases.fresh_copies(inputs)
    for name in ("q", "k", "v"):
        assert fresh[name].data_ptr() % 16 == inputs[name].data_ptr() % 16 != 0
        assert fresh[name].data_ptr() != inputs[name].data_ptr() and torch.equal(fresh[name], inputs[name])


def test_a_kernel_that_needs_aligned_operands_is_passed_over(temp_kernels):
    """An aligned-only kernel at the top priority serves the aligned call, is passed over with
    its reason for the misaligned one (the reference serves it, matching float64), and
    forcing it raises before any launch."""
    aligned_only = temp_kernels(
        "attention.prefill",
        name="aligned_only",
        priority=Priority.PLUGIN,
        vendors=("cpu",),
        features=("sinks",),
    )
    case = _case(True)
    inputs = cases.make_inputs(case, seed=2)
    aligned = {**inputs, **{n: inputs[n].clone() for n in ("q", "k", "v")}}
    cases.call(_case(False), aligned)
    assert last_kernel() == "aligned_only" and len(aligned_only.calls) == 1
    out = cases.call(case, inputs)
    assert last_kernel() == "torch_prefill" and len(aligned_only.calls) == 1
    expected, _ = cases.reference(case, inputs)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    table = str(explain(cases.request(case)))
    assert "REJECTED aligned_only" in table and "does not support {unaligned_qkv}" in table
    with pytest.raises(ValueError, match=r"override 'aligned_only' cannot serve .*unaligned_qkv"):
        mha_prefill(*(inputs[name] for name in _POSITIONAL), sinks=inputs["sinks"], override="aligned_only")
    assert len(aligned_only.calls) == 1
