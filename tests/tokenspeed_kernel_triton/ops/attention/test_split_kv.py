"""Split-KV decode (flash-decoding: per-split partials + ``combine_kernel``) under the interpreter.

On the CPU ``num_splits`` always answers 1 (one "SM"), so the public decode never splits
there; these tests force the split count the decode launcher uses, so the split ranges, the
partial outputs, empty splits and the combine (sink, ``v_scale``, LSE) run against the
float64 reference on every feature the decode serves.
"""

import pytest
import torch
from support.naive_attention import naive_decode

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.attention import decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}
FP8 = torch.float8_e4m3fn


def _case(name, seqlens_k, q_len=1, hq=8, hkv=2, d=64, **kw):
    return cases.AttentionCase("attention.decode", (q_len,) * len(seqlens_k), seqlens_k, hq, hkv, d, name=name, **kw)


SPLIT_CASES = [
    # ragged lengths incl. 1 (most splits empty), sinks folded in by the combine, LSE
    _case("ragged_sinks_lse", (1, 70, 333, 600), sinks=True, return_lse=True, page_size=16),
    # fp8 KV: k_scale in the split kernels, v_scale applied by the combine
    _case("fp8_scales", (300, 513), kv_dtype=FP8, sinks=True, return_lse=True, page_size=32),
    # window: the split ranges cover only the visible keys
    _case("window", (500, 129), window_left=100, sinks=True, return_lse=True, page_size=8),
    # speculative q_len 3: causal among the new tokens, across splits
    _case("spec_q3_cap", (400, 257), q_len=3, logit_cap=20.0, return_lse=True, page_size=64),
    # padded GQA group (3), padded head dim 80 (BLOCK_DV 128 in the combine), page 128
    _case("gqa3_d80_page128", (260, 700), hq=6, hkv=2, d=80, sinks=True, page_size=128),
    # Dv != D, MQA, page 256
    cases.AttentionCase(
        "attention.decode", (1, 1), (450, 90), 8, 1, 64, 32, page_size=256, return_lse=True, name="mqa_dv32_page256"
    ),
]


def _expected(inputs):
    kwargs = {k: v for k, v in inputs.items() if k not in ("max_seqlen_k", "return_lse")}
    return naive_decode(**kwargs)


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.name)
def test_forced_splits_match_naive(monkeypatch, case, dtype, splits):
    case = cases.AttentionCase(**{**case.__dict__, "dtype": dtype})
    seen = []

    def forced(batch, num_kv_heads, max_keys, device):
        seen.append(splits)
        return splits

    monkeypatch.setattr(decode, "num_splits", forced)
    inputs = cases.make_inputs(case, DEVICE, seed=splits)
    expected_out, expected_lse = _expected(inputs)
    poisoned = torch.full(expected_out.shape, float("nan"), dtype=dtype, device=DEVICE)
    result = cases.call(case, inputs, out=poisoned)
    # The runner cache's key reads the split count, and a bind reads it again.
    assert last_kernel() == "triton_decode" and seen and set(seen) == {splits}, (last_kernel(), seen)
    out, lse = result if case.return_lse else (result, None)
    assert not torch.isnan(out).any(), "an output element was never written"
    tol = TOL[dtype]
    scale = float(expected_out.abs().max()) + 1.0
    torch.testing.assert_close(out.double().cpu(), expected_out, atol=tol * scale, rtol=tol)
    if case.return_lse:
        torch.testing.assert_close(lse.double().cpu(), expected_lse, atol=2e-3, rtol=2e-3)


def test_split_and_unsplit_agree(monkeypatch):
    """Same inputs, 1 vs 4 splits: the combine reproduces the one-pass result to rounding."""
    case = SPLIT_CASES[0]
    inputs = cases.make_inputs(case, DEVICE, seed=1)
    results = []
    for splits in (1, 4):
        monkeypatch.setattr(decode, "num_splits", lambda *a, s=splits: s)
        results.append(cases.call(case, inputs))
    (o1, l1), (o4, l4) = results
    torch.testing.assert_close(o4.double(), o1.double(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(l4, l1, atol=1e-4, rtol=1e-4)
