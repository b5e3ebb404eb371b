"""The reference attention attends long query runs in blocks (so the float64 ground truth of
a serving-size prefill fits a GPU); blocking must not change a result."""

import pytest
import torch

from tokenspeed_kernel.reference import attention as reference_attention
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase


@pytest.mark.parametrize(
    ("op", "seqlens_q", "seqlens_k", "options"),
    [
        ("attention.prefill", (37, 5), (37, 5), {"sinks": True, "window_left": 9}),
        ("attention.prefill", (29,), (29,), {"causal": False, "logit_cap": 5.0}),
        ("attention.extend", (13, 7), (40, 7), {"sinks": True, "return_lse": True}),
        ("attention.decode", (4, 4), (30, 11), {"sinks": True, "window_left": 6}),
    ],
)
def test_blocked_queries_give_the_unblocked_result(monkeypatch, op, seqlens_q, seqlens_k, options):
    case = AttentionCase(op, seqlens_q, seqlens_k, 4, 2, 16, page_size=8, dtype=torch.float32, **options)
    inputs = cases.make_inputs(case, "cpu", seed=5)
    whole, whole_lse = cases.reference(case, inputs)
    blocks = []
    real_block = reference_attention._attend_block

    def counting(q, *args, **kwargs):
        blocks.append(q.shape[0])
        return real_block(q, *args, **kwargs)

    # 3 query rows per block for the longest sequence (shorter ones get more rows: the cap is on logits)
    monkeypatch.setattr(reference_attention, "_MAX_LOGITS", 3 * case.num_q_heads * max(seqlens_k))
    monkeypatch.setattr(reference_attention, "_attend_block", counting)
    split, split_lse = cases.reference(case, inputs)
    assert 3 in blocks and len(blocks) > len(seqlens_q)
    assert whole.dtype == torch.float64 and not whole.isnan().any()
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)
    if whole_lse is not None:
        torch.testing.assert_close(split_lse, whole_lse, rtol=1e-12, atol=1e-12)
