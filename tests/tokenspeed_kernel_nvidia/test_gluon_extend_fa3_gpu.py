"""GPU numerics of ``gluon_extend_fa3_sm90`` against the float64 reference.

Runs only on an sm_90 GPU (skips with the reason otherwise): ragged batches whose chunks and
caches are not multiples of the 128-token tile or the page (partial last pages), prefix 0
(the chunk is the whole cache), one-token chunks, GPT-OSS's heads with sinks and the
128-token window, D 128, fp16, LSE, pages of 8 and 256 tokens, and every strided cache
layout of the case builder (HND, vLLM's interleaved rows, a stacked pool with NaN padding),
a row-strided q (a fused qkv's q, NaN past each row's q: ``strided_q``). Outputs are poisoned with NaN so an unwritten row fails; unused cache slots hold garbage.
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
# A row-strided q (a fused qkv's q: rows of (Hq + 2 Hkv) D elements, NaN past each row's q),
# read in place through the q descriptor's row stride: with vLLM's cache views, as vLLM hands
# both over, GPT-OSS's heads, the window, D 128 and fp16.
STRIDED_Q_CASES = [
    cases.AttentionCase(
        "attention.extend", RAGGED_Q, RAGGED_K, 16, 2, 64, sinks=True, return_lse=True, cache_layout="vllm",
        strided_q=True, name="ragged-vllm-strided-q",
    ),
    cases.AttentionCase(
        "attention.extend", (200, 70), (2248, 70), 64, 8, 64, sinks=True, cache_layout="vllm", strided_q=True,
        name="gpt-oss-vllm-strided-q",
    ),
    cases.AttentionCase(
        "attention.extend", RAGGED_Q, RAGGED_K, 16, 2, 64, window_left=127, sinks=True, strided_q=True,
        name="win127-strided-q",
    ),
    cases.AttentionCase(
        "attention.extend", RAGGED_Q, RAGGED_K, 16, 4, 128, return_lse=True, strided_q=True, name="d128-strided-q"
    ),
    cases.AttentionCase(
        "attention.extend", (130, 3), (400, 600), 8, 8, 64, dtype=torch.float16, page_size=8, strided_q=True,
        name="fp16-p8-strided-q",
    ),
]  # fmt: skip


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


@pytest.mark.parametrize("case", STRIDED_Q_CASES, ids=lambda c: c.name)
def test_a_row_strided_q_is_read_in_place(case):
    """The float64 reference (:func:`_check`), and the bits of the same call with q made
    contiguous: the request asks for ``strided_q`` (``q_align`` 16), no copy is taken."""
    _skip()
    from tokenspeed_kernel.ops._dispatch import last_request

    inputs = _check(case)
    assert "strided_q" in last_request().features and last_request().shape("q_align") == 16
    q = inputs["q"]
    assert q.stride(0) == (case.num_q_heads + 2 * case.num_kv_heads) * case.head_dim
    strided = cases.call(case, inputs, override=KERNEL)
    flat = cases.call(case, {**inputs, "q": q.contiguous()}, override=KERNEL)
    for got, want in zip(*((r if isinstance(r, tuple) else (r,)) for r in (strided, flat)), strict=True):
        assert torch.equal(got, want)


def test_a_q_row_stride_tma_cannot_take_is_passed_over():
    """Rows 4 bf16 elements wider than Hq D (an 8-byte, not 16-byte, multiple): ``q_align`` 8,
    which the kernel does not list; forcing it raises before any launch naming the shape
    key, and the selector's own choice serves the call in place."""
    _skip()
    from support.strided_q import row_strided

    from tokenspeed_kernel import KernelOverrideError, last_kernel

    case = CASES[0]
    inputs = cases.make_inputs(case, device="cuda", seed=11)
    ref, _ = cases.reference(case, inputs)
    odd = {**inputs, "q": row_strided(inputs["q"], 4)}
    with pytest.raises(KernelOverrideError, match="q_align=8"):
        cases.call(case, odd, override=KERNEL)
    res = cases.call(case, odd)
    assert last_kernel() != KERNEL
    assert _rel(res[0] if isinstance(res, tuple) else res, ref) < 2e-2


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
    return inputs


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
