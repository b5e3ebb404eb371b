"""GPU numerics of ``gluon_extend_fa3_sm90`` against the float64 reference.

Runs only on an sm_90 GPU (skips with the reason otherwise): ragged batches whose chunks and
caches are not multiples of the 128-token tile or the page (partial last pages), prefix 0
(the chunk is the whole cache), one-token chunks, GPT-OSS's heads with sinks and the
128-token window, D 128, fp16, LSE, pages of 8 and 256 tokens, and every strided cache
layout of the case builder (HND, vLLM's interleaved rows, a stacked pool with NaN padding).
Outputs are poisoned with NaN so an unwritten row fails; unused cache slots hold garbage.
"""

import pytest
import torch
from support.gpu import sm90_skip_reason

from tokenspeed_kernel.tools import cases

KERNEL = "gluon_extend_fa3_sm90"
RAGGED_Q = (1, 37, 129, 300)
RAGGED_K = (1, 37, 1000, 457)  # the second is prefix 0, the first a one-token cache
CASES = [
    cases.AttentionCase("attention.extend", RAGGED_Q, RAGGED_K, 16, 2, 64, sinks=True, return_lse=True, name="ragged"),
    cases.AttentionCase("attention.extend", RAGGED_Q, RAGGED_K, 16, 2, 64, window_left=127, sinks=True, name="win127"),
    cases.AttentionCase("attention.extend", (5, 300), (77, 301), 16, 2, 64, window_left=4, name="win4"),
    cases.AttentionCase("attention.extend", (200, 70), (2248, 70), 64, 8, 64, sinks=True, name="gpt-oss"),
    cases.AttentionCase("attention.extend", RAGGED_Q, RAGGED_K, 16, 4, 128, return_lse=True, name="d128"),
    cases.AttentionCase(
        "attention.extend", (130, 3), (400, 600), 8, 8, 64, dtype=torch.float16, page_size=8, name="fp16-p8"
    ),
    cases.AttentionCase("attention.extend", (260, 17), (900, 17), 16, 2, 64, page_size=256, sinks=True, name="p256"),
    *(
        cases.AttentionCase(
            "attention.extend", RAGGED_Q, RAGGED_K, 16, 2, 64, sinks=True, cache_layout=layout, name=layout
        )
        for layout in ("hnd", "vllm", "stacked")
    ),
    cases.AttentionCase("attention.extend", (300, 9), (700, 200), 16, 2, 128, cache_layout="vllm", name="d128-vllm"),
]


def _skip():
    reason = sm90_skip_reason()
    if reason:
        print(f"SKIP {KERNEL}: {reason}")
        pytest.skip(reason)


def _rel(out, ref):
    return float((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64(case):
    _skip()
    _check(case)


# The dense kernel's variants, which the shared consumer gives the extend (opt-in, off by
# default): on the ragged windowed case (masked, dirty and full tiles) and at D 128.
VARIANTS = {"ov": {"pv_overlap": True}, "ex1": {"exp2_poly": 1}, "lz8": {"rescale_threshold": 8.0}}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=lambda c: c.name)
def test_variants_match_float64(case, variant, monkeypatch):
    _skip()
    from tokenspeed_kernel_nvidia.ops.attention import gluon_extend_fa3 as ext

    plan = ext.extend_plan
    monkeypatch.setattr(ext, "extend_plan", lambda d, p: plan(d, p, **VARIANTS[variant]))
    _check(case)


def _check(case):
    inputs = cases.make_inputs(case, device="cuda", seed=len(case.name))
    ref, ref_lse = cases.reference(case, inputs)
    q = inputs["q"]
    out = torch.full((q.shape[0], case.num_q_heads, case.dv), float("nan"), dtype=q.dtype, device="cuda")
    res = cases.call(case, inputs, override=KERNEL, out=out)
    got = res[0] if isinstance(res, tuple) else res
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), f"{case.describe()}: rows left unwritten"
    tol = 2e-2 if case.dtype == torch.bfloat16 else 5e-3
    assert _rel(out, ref) < tol, case.describe()
    if case.return_lse:
        torch.testing.assert_close(res[1].double().cpu(), ref_lse.cpu(), atol=1e-3, rtol=1e-3)
    print(f"{KERNEL} {case.describe()}: rel {_rel(out, ref):.2e}")


def test_unseen_nan_in_stale_slots_changes_nothing():
    """Every slot that holds no key (stale pages, the tails of last pages) set to NaN: the
    output and LSE keep every bit (masking by selection, V cleaned on masked tiles)."""
    _skip()
    case = cases.AttentionCase(
        "attention.extend", (129, 40), (300, 75), 16, 2, 64, window_left=70, sinks=True, return_lse=True, name="nan"
    )
    inputs = cases.make_inputs(case, device="cuda", seed=3)
    out, lse = cases.call(case, inputs, override=KERNEL)
    table = inputs["page_table"].cpu()
    live = torch.zeros(inputs["k_cache"].shape[0] * case.page_size, dtype=torch.bool)
    for b, lk in enumerate(case.seqlens_k):
        for j in range(lk):
            live[int(table[b, j // case.page_size]) * case.page_size + j % case.page_size] = True
    bad = dict(inputs)
    for name in ("k_cache", "v_cache"):
        cache = inputs[name].clone()
        cache.view(-1, *cache.shape[2:])[(~live).cuda()] = float("nan")
        bad[name] = cache
    bad_out, bad_lse = cases.call(case, bad, override=KERNEL)
    assert torch.equal(bad_out, out) and torch.equal(bad_lse, lse)
