"""Every bad input raises TypeError/ValueError naming the argument, before any launch."""

import dataclasses

import pytest
import torch
from support.strided_q import row_strided

from tokenspeed_kernel.ops._checks import clear_call_tables
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools.cases import attention as cases

PREFILL = cases.AttentionCase("attention.prefill", (5, 9), (5, 12), 4, 2, 16, dtype=torch.float32)
EXTEND = cases.AttentionCase("attention.extend", (3, 4), (10, 4), 4, 2, 16, page_size=4, dtype=torch.float32)
DECODE = cases.AttentionCase("attention.decode", (1, 1), (10, 7), 4, 2, 16, page_size=4, dtype=torch.float32)
FP8 = cases.AttentionCase(
    "attention.decode", (1, 1), (10, 7), 4, 2, 16, page_size=4, dtype=torch.float32, kv_dtype=torch.float8_e4m3fn
)


def _bad(case, exc, match, **changes):
    """The changed call raises the same error cold (nothing remembered) and right after
    the valid call with the same shapes was remembered by the op's call-key table."""
    inputs = cases.make_inputs(case)
    bad = dict(inputs)
    for key, fn in changes.items():
        bad[key] = fn(inputs[key]) if callable(fn) else fn
    messages = []
    for warm in (False, True):
        clear_call_tables()
        if warm:
            cases.call(case, inputs, override=None)
        with pytest.raises(exc, match=match) as info:
            cases.call(case, bad, override=None)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


PREFILL_BAD = [
    ("q", TypeError, "q must be a torch.Tensor", [1, 2]),
    ("q", ValueError, "q must be 3-D", lambda t: t[0]),
    ("q", TypeError, r"q must have dtype in \{bfloat16, float16, float32\}", lambda t: t.to(torch.int32)),
    ("k", TypeError, "k must have dtype in", lambda t: t.half()),
    ("v", ValueError, "v has 10 rows but k has 17", lambda t: t[:10]),
    ("q", ValueError, r"query heads of q \(3\) must be a multiple", lambda t: t[:, :3].contiguous()),
    ("k", ValueError, "k head dim 8 must equal q head dim 16", lambda t: t[..., :8].contiguous()),
    ("q", ValueError, "q must be contiguous", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
    ("cu_seqlens_q", TypeError, "cu_seqlens_q must have dtype in {int32}", lambda t: t.long()),
    ("cu_seqlens_k", ValueError, r"cu_seqlens_k must have shape \[3\]", lambda t: t[:2]),
    ("max_seqlen_q", TypeError, "max_seqlen_q must be an int", 5.0),
    ("max_seqlen_k", ValueError, "max_seqlen_k must be >= 0", -1),
    ("window_left", ValueError, "window_left must be >= -1", -2),
    ("logit_cap", ValueError, "logit_cap must be >= 0", -1.0),
    ("softmax_scale", ValueError, "softmax_scale must be > 0", 0.0),
    ("sinks", TypeError, "sinks must have dtype in {float32}", torch.zeros(4, dtype=torch.float16)),
    ("sinks", ValueError, r"sinks must have shape \[4\]", torch.zeros(3)),
    ("causal", TypeError, "causal must be a bool", 1),
    ("return_lse", TypeError, "return_lse must be a bool", "yes"),
]


@pytest.mark.parametrize(
    ("arg", "exc", "match", "change"), PREFILL_BAD, ids=[f"{a}-{m[:20]}" for a, _, m, _ in PREFILL_BAD]
)
def test_prefill_rejects(arg, exc, match, change):
    _bad(PREFILL, exc, match, **{arg: change})


def test_prefill_rejects_bad_out_and_override():
    inputs = cases.make_inputs(PREFILL)
    with pytest.raises(ValueError, match=r"out must have shape \[14, 4, 16\]"):
        cases.call(PREFILL, inputs, out=torch.empty(14, 4, 8))
    with pytest.raises(TypeError, match="out must have dtype in {float32}"):
        cases.call(PREFILL, inputs, out=torch.empty(14, 4, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="override must be a kernel name"):
        cases.call(PREFILL, inputs, override=3)
    with pytest.raises(ValueError, match="is not a kernel registered for attention.prefill"):
        cases.call(PREFILL, inputs, override="no_such_kernel")


PAGED_BAD = [
    ("k_cache", ValueError, "k_cache must be 4-D", lambda t: t[0]),
    ("v_cache", TypeError, "v_cache dtype float16 must equal k_cache dtype float32", lambda t: t.half()),
    ("q", TypeError, "k_cache dtype float32 must equal q dtype float16", lambda t: t.half()),
    ("v_cache", ValueError, "v_cache .* must match k_cache", lambda t: t[:, :2].contiguous()),
    ("page_table", TypeError, "page_table must have dtype in {int32}", lambda t: t.long()),
    ("page_table", ValueError, r"page_table must have shape \[2, \*\]", lambda t: t[:1]),
    ("cache_seqlens", ValueError, r"cache_seqlens must have shape \[2\]", lambda t: t[:1]),
    ("k_scale", ValueError, "k_scale/v_scale apply to a float8_e4m3fn cache only", 1.0),
]


@pytest.mark.parametrize("case", [EXTEND, DECODE], ids=["extend", "decode"])
@pytest.mark.parametrize(
    ("arg", "exc", "match", "change"), PAGED_BAD, ids=[a + "-" + m[:18] for a, _, m, _ in PAGED_BAD]
)
def test_paged_rejects(case, arg, exc, match, change):
    _bad(case, exc, match, **{arg: change})


def test_decode_specific_rejections():
    _bad(DECODE, ValueError, "q must be 3-D or 4-D", q=lambda t: t[0])
    _bad(DECODE, ValueError, "max_seqlen_k must be >= 1", max_seqlen_k=0)
    _bad(FP8, ValueError, "k_scale and v_scale are required", k_scale=None)
    _bad(FP8, ValueError, "k_scale must be a float or a one-element float32 tensor", k_scale=torch.ones(2))
    _bad(FP8, ValueError, "v_scale must be > 0", v_scale=-1.0)


def _meta(t):
    return torch.empty_like(t, device="meta")


@pytest.mark.parametrize("arg", ["k", "v", "cu_seqlens_q", "cu_seqlens_k", "sinks"])
def test_prefill_rejects_tensors_on_another_device(arg):
    change = torch.zeros(4, device="meta") if arg == "sinks" else _meta
    _bad(PREFILL, ValueError, f"{arg} is on meta but q is on cpu", **{arg: change})


@pytest.mark.parametrize("case", [EXTEND, DECODE], ids=["extend", "decode"])
@pytest.mark.parametrize("arg", ["k_cache", "v_cache", "page_table", "cache_seqlens"])
def test_paged_rejects_tensors_on_another_device(case, arg):
    _bad(case, ValueError, f"{arg} is on meta but q is on cpu", **{arg: _meta})


def test_rejects_out_and_scales_on_another_device():
    inputs = cases.make_inputs(PREFILL)
    with pytest.raises(ValueError, match="out is on meta but q is on cpu"):
        cases.call(PREFILL, inputs, out=torch.empty(14, 4, 16, device="meta"))
    _bad(FP8, ValueError, "k_scale is on meta but q is on cpu", k_scale=torch.ones(1, device="meta"))


def test_extend_rejects_mismatched_batch():
    _bad(
        EXTEND,
        ValueError,
        r"page_table must have shape \[3, \*\]",
        cu_seqlens_q=torch.tensor([0, 3, 5, 7], dtype=torch.int32),
    )
    _bad(
        EXTEND,
        ValueError,
        r"cu_seqlens_q must hold batch \+ 1 >= 1 entries",
        cu_seqlens_q=torch.zeros(0, dtype=torch.int32),
    )


def test_debug_mode_checks_values(debug):
    _bad(PREFILL, ValueError, "cu_seqlens_q must start at 0 and end at 14", cu_seqlens_q=lambda t: t + 1)
    _bad(PREFILL, ValueError, "max_seqlen_k=3 is below the longest sequence", max_seqlen_k=3)
    _bad(EXTEND, ValueError, r"page_table\[0\] uses page ids outside", page_table=lambda t: t * 0 + 999)
    _bad(
        DECODE,
        ValueError,
        r"cache_seqlens\[1\]=40 needs 10 pages but page_table has 4 columns",
        cache_seqlens=torch.tensor([10, 40], dtype=torch.int32),
        max_seqlen_k=40,
    )
    _bad(DECODE, ValueError, "exceeds max_seqlen_k", max_seqlen_k=8)


def test_debug_mode_checks_lengths(debug):
    bad_cu = torch.tensor([0, 15, 14], dtype=torch.int32)
    _bad(PREFILL, ValueError, "cu_seqlens_q must be non-decreasing", cu_seqlens_q=bad_cu, max_seqlen_q=15)
    _bad(PREFILL, ValueError, "cu_seqlens_k must start at 0 and end at 17", cu_seqlens_k=lambda t: t * 2)
    _bad(
        PREFILL,
        ValueError,
        "causal prefill needs every query length <= its key length",
        cu_seqlens_k=torch.tensor([0, 4, 17], dtype=torch.int32),
        max_seqlen_k=13,
    )
    _bad(EXTEND, ValueError, "max_seqlen_q=3 is below the longest sequence in cu_seqlens_q", max_seqlen_q=3)
    _bad(
        EXTEND,
        ValueError,
        r"cache_seqlens\[1\]=3 is below the 4 new tokens of sequence 1",
        cache_seqlens=torch.tensor([10, 3], dtype=torch.int32),
    )
    spec = cases.AttentionCase("attention.decode", (3, 3), (10, 7), 4, 2, 16, page_size=4, dtype=torch.float32)
    _bad(spec, ValueError, r"cache_seqlens\[0\]=2 is below the 3 new tokens", cache_seqlens=lambda t: t * 0 + 2)


def test_debug_mode_accepts_valid_inputs(debug):
    for case in (PREFILL, EXTEND, DECODE, FP8):
        inputs = cases.make_inputs(case)
        out = cases.call(case, inputs, override="torch_" + case.op.split(".")[1])
        assert torch.isfinite(out).all()


def test_debug_checks_are_off_by_default():
    # Garbage page ids pass host validation (reading them would need a sync) ...
    inputs = cases.make_inputs(DECODE)
    inputs["page_table"] = inputs["page_table"] * 0 + 999
    with pytest.raises(IndexError):  # ... and only the reference kernel's own indexing notices.
        cases.call(DECODE, inputs, override="torch_decode")


# --- row-strided q (strided_q) -------------------------------------------------------------


@pytest.mark.parametrize("op", ["attention.prefill", "attention.extend", "attention.decode"])
def test_row_strided_q_is_served_in_place_and_other_layouts_are_refused(op, only_reference):
    """A 3-D q whose rows ``[Hq, D]`` have a row stride of their own (a view of a fused qkv
    projection) is accepted, asks for ``strided_q`` and gives the contiguous q's result; any
    other non-contiguous q is a ``ValueError`` naming q and the layout it must have."""
    from tokenspeed_kernel import last_kernel, registry

    case = cases.AttentionCase(op, (1, 1) if op == "attention.decode" else (5, 9), (6, 13), 4, 2, 16,
                               dtype=torch.float32, sinks=True)  # fmt: skip
    inputs = cases.make_inputs(case, seed=3)
    strided = {**inputs, "q": row_strided(inputs["q"], 40)}
    assert (
        not strided["q"].is_contiguous()
        and "strided_q" in cases.request(dataclasses.replace(case, strided_q=True)).features
    )
    want = cases.call(case, inputs)
    assert torch.equal(cases.call(case, strided), want)
    assert "strided_q" in registry.get_kernel(last_kernel()).features
    heads_apart = inputs["q"].transpose(0, 1).contiguous().transpose(0, 1)
    with pytest.raises(ValueError, match=r"q must be contiguous, or rows \[Hq, D\] with a row stride of their own"):
        cases.call(case, {**inputs, "q": heads_apart})


def test_a_4d_decode_q_must_stay_contiguous(only_reference):
    case = cases.AttentionCase("attention.decode", (2, 2), (6, 13), 4, 2, 16, dtype=torch.float32)
    inputs = cases.make_inputs(case, seed=1)
    q = inputs["q"]
    wider = torch.full((*q.shape[:-1], 20), float("nan"))
    wider[..., :16] = q
    with pytest.raises(ValueError, match="q must be contiguous"):
        cases.call(case, {**inputs, "q": wider[..., :16]})


def _strided_case(op: str) -> cases.AttentionCase:
    lens_q = (1, 1) if op == "attention.decode" else (5, 9)
    return cases.AttentionCase(op, lens_q, (6, 13), 4, 2, 16, dtype=torch.float32, sinks=True, strided_q=True)


@pytest.mark.parametrize("op", ["attention.extend", "attention.decode"])
def test_a_row_strided_qs_alignment_reaches_the_request(op, only_reference):
    """Extend and decode: a row-strided q's request carries ``q_align``, the largest power of
    two <= 16 dividing its byte offset and row stride (as ``kv_align`` a strided cache's): 16
    for a fused qkv's q, less for rows of another width or a q that starts an element in; a
    contiguous q's request has neither ``strided_q`` nor ``q_align``. The case tools describe
    the call's own request, and every layout gives the contiguous q's result."""
    from tokenspeed_kernel.ops._dispatch import last_request

    case = _strided_case(op)
    inputs = cases.make_inputs(case, seed=2)
    want = cases.call(case, inputs)
    assert last_request() == cases.request(case) and last_request().shape("q_align") == 16
    plain = dataclasses.replace(case, strided_q=False)
    assert torch.equal(cases.call(plain, {**inputs, "q": inputs["q"].contiguous()}), want)
    assert last_request() == cases.request(plain)
    assert last_request().shape("q_align") is None and "strided_q" not in last_request().features
    # float32 (4-byte) elements, rows of 4 x 16: a row stride of 66 elements is 264 bytes (8
    # dividing), 68 is 272 (16); one element in is 4 bytes off
    for extra, offset, align in ((2, 0, 8), (4, 0, 16), (4, 1, 4)):
        q = row_strided(inputs["q"].contiguous(), extra, offset)
        # (the reference's matmuls may block an unaligned float32 q differently: not bitwise)
        torch.testing.assert_close(cases.call(case, {**inputs, "q": q}), want, atol=1e-6, rtol=1e-6)
        assert last_request().shape("q_align") == align and "strided_q" in last_request().features


@pytest.mark.parametrize("op", ["attention.extend", "attention.decode"])
def test_a_kernel_that_needs_an_aligned_q_is_passed_over(op, temp_kernels):
    """A TMA-style kernel (``strided_q`` with ``q_align`` 16) at the top priority serves a fused
    qkv's q and is passed over, with its reason, for a row stride that is not a 16-byte
    multiple (the reference serves it); forcing it raises before any launch."""
    from tokenspeed_kernel import explain, last_kernel
    from tokenspeed_kernel.ops._dispatch import last_request

    aligned_q = temp_kernels(
        op, name="aligned_q", priority=Priority.PLUGIN, vendors=("cpu",),
        features=("sinks", "strided_q"), shapes={"q_align": (16,)},
    )  # fmt: skip
    case = _strided_case(op)
    inputs = cases.make_inputs(case, seed=4)
    cases.call(case, inputs)
    assert last_kernel() == "aligned_q" and len(aligned_q.calls) == 1
    odd = {**inputs, "q": row_strided(inputs["q"].contiguous(), 2)}
    cases.call(case, odd)
    assert last_kernel().startswith("torch_") and len(aligned_q.calls) == 1
    table = str(explain(last_request()))
    assert "REJECTED aligned_q" in table and "q_align=8 not in {16}" in table
    with pytest.raises(ValueError, match=r"override 'aligned_q' cannot serve .*q_align=8"):
        cases.call(case, odd, override="aligned_q")
    assert len(aligned_q.calls) == 1


def test_fresh_copies_keep_a_row_strided_q_and_strided_caches(only_reference):
    """``check`` and ``bench`` call each kernel on fresh copies of a case's inputs: a copy of a
    row-strided q or of vLLM's interleaved K|V views keeps its strides, offset and the NaN
    between its rows (``Tensor.clone`` would make it contiguous, and the call another request)."""
    from tokenspeed_kernel.ops._dispatch import last_request
    from tokenspeed_kernel.tools.cases import fresh_copies

    case = dataclasses.replace(_strided_case("attention.extend"), cache_layout="vllm")
    inputs = cases.make_inputs(case, seed=5)
    fresh = fresh_copies(inputs)
    for name in ("q", "k_cache", "v_cache"):
        a, b = inputs[name], fresh[name]
        assert not b.is_contiguous() and b.stride() == a.stride() and b.data_ptr() % 16 == a.data_ptr() % 16
        assert b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
        assert torch.equal(b, a) or torch.equal(b.nan_to_num(), a.nan_to_num())
    row = fresh["q"].as_strided((fresh["q"].stride(0),), (1,))  # one whole row of the buffer
    assert torch.isnan(row[case.num_q_heads * case.head_dim :]).all()
    assert torch.equal(cases.call(case, fresh), cases.call(case, inputs))
    assert last_request() == cases.request(case) and {"strided_q", "strided_kv"} <= last_request().features
