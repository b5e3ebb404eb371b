"""Strided paged caches: engines' cache views (vLLM's interleaved K|V rows, HND, a stacked
K/V pool) are read and written in place, with the same numbers as a contiguous copy; a
kernel that cannot serve some strides is rejected by the selector with its reason; bad
layouts are refused before anything is launched or written."""

import pytest
import torch

from tokenspeed_kernel import (
    attention_request,
    explain,
    last_kernel,
    mha_decode_plan,
    mha_decode_with_kvcache,
    mha_extend_with_kvcache,
    store_kvcache,
)
from tokenspeed_kernel.ops._checks import kv_align
from tokenspeed_kernel.ops.attention.args import Heads
from tokenspeed_kernel.platform import Platform, platform_for
from tokenspeed_kernel.registry import Priority, kernels
from tokenspeed_kernel.tools.cases import attention as cases

# Where the every-kernel tests put their tensors (and ask the selector for): the GPU when
# torch sees one, else the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGED = ("attention.extend", "attention.decode", "kvcache.store")
STRIDED = ("hnd", "vllm", "stacked")


def _runnable(op: str) -> list[str]:
    """The kernels of ``op`` that claim strided caches and serve tensors on ``DEVICE`` (the
    reference everywhere; Triton under the interpreter or compiled; vendor kernels)."""
    names = []
    selection = explain(cases.request(_case(op, "vllm")), platform=platform_for(DEVICE))
    for spec in kernels(op):
        reasons = [r for c in selection.candidates if c.spec is spec for r in c.reasons]
        if not reasons:
            names.append(spec.name)
    return names


def _case(op: str, layout: str, dtype=torch.float32, kv_dtype=None) -> cases.AttentionCase:
    q_lens = {"attention.extend": (7, 1, 12), "attention.decode": (1, 1, 1), "kvcache.store": (5, 1, 9)}[op]
    return cases.AttentionCase(
        op,
        q_lens,
        (30, 9, 12),
        8,
        2,
        32,
        page_size=4,
        dtype=dtype,
        kv_dtype=kv_dtype,
        window_left=-1 if op == "kvcache.store" else 10,
        sinks=op != "kvcache.store",
        name=f"strided_{layout}",
        cache_layout=layout,
    )


def _contiguous(inputs: dict) -> dict:
    return {**inputs, "k_cache": inputs["k_cache"].contiguous(), "v_cache": inputs["v_cache"].contiguous()}


@pytest.mark.parametrize("layout", STRIDED)
@pytest.mark.parametrize("op", PAGED)
def test_every_strided_kernel_matches_its_contiguous_copy_and_the_reference(op, layout):
    """Every kernel that claims ``strided_kv`` gives the same bits on the view as on a
    contiguous copy, and float64-reference numbers; the store writes through the view."""
    case = _case(op, layout)
    names = _runnable(op)
    assert "torch_" + op.split(".")[1].replace("store", "store_kvcache") in names
    for name in names:
        inputs = cases.make_inputs(case, DEVICE, seed=11)
        assert not inputs["k_cache"].is_contiguous()
        flat = _contiguous(inputs)
        if op == "kvcache.store":
            base = inputs["k_cache"]._base  # the engine's own tensor, written through the view
            before = base.clone()
            k_view, v_view = cases.call(case, inputs, override=name)
            k_flat, v_flat = cases.call(case, flat, override=name)
            expected_k, expected_v = cases.reference(case, _contiguous(cases.make_inputs(case, DEVICE, seed=11)))
            assert torch.equal(k_view, k_flat) and torch.equal(v_view, v_flat), name
            assert torch.equal(k_view, expected_k) and torch.equal(v_view, expected_v), name
            untouched = torch.ones_like(base, dtype=torch.bool)
            for view in (k_view, v_view):  # every element outside the two views is as it was
                untouched.view(-1)[_offsets(view)] = False
            assert torch.equal(base[untouched].view(torch.uint8), before[untouched].view(torch.uint8)), name
            continue
        out_view = cases.call(case, inputs, override=name)
        assert last_kernel() == name
        out_flat = cases.call(case, flat, override=name)
        assert torch.equal(out_view, out_flat), name
        expected, _ = cases.reference(case, flat)
        torch.testing.assert_close(out_view.double(), expected, atol=2e-5, rtol=2e-5)


def _offsets(view: torch.Tensor) -> torch.Tensor:
    """Flat storage offsets (from the base's start) of every element of ``view``."""
    index = torch.zeros((), dtype=torch.int64, device=view.device)
    for size, stride in zip(view.shape, view.stride()):
        index = index.unsqueeze(-1) + torch.arange(size, device=view.device) * stride
    return (index + view.storage_offset()).flatten()


def test_fp8_strided_cache_matches_the_reference():
    case = _case("attention.decode", "vllm", kv_dtype=torch.float8_e4m3fn)
    inputs = cases.make_inputs(case, DEVICE, seed=3)
    expected, _ = cases.reference(case, _contiguous(inputs))
    for name in _runnable("attention.decode"):
        out = cases.call(case, inputs, override=name)
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_decode_plan_takes_a_strided_cache():
    case = _case("attention.decode", "vllm")
    inputs = cases.make_inputs(case, seed=5)
    plan = mha_decode_plan(
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["page_table"],
        inputs["cache_seqlens"],
        inputs["max_seqlen_k"],
        num_q_heads=8,
        window_left=10,
        sinks=inputs["sinks"],
    )
    assert "strided_kv" in plan.request.features and plan.request.shape("kv_align") == 16
    expected = mha_decode_with_kvcache(**_contiguous(inputs), override=plan.kernel)
    assert torch.equal(plan.run(inputs["q"]), expected)


def test_the_request_carries_the_layout():
    """Contiguous caches: no ``strided_kv`` and no ``kv_align`` (their alignment follows from
    head dim and dtype); a strided view: both, the alignment from offsets and strides."""
    contiguous = cases.request(_case("attention.decode", "nhd"))
    assert "strided_kv" not in contiguous.features and contiguous.shape("kv_align") is None
    strided = cases.request(_case("attention.decode", "vllm"))
    assert "strided_kv" in strided.features and strided.shape("kv_align") == 16
    base = torch.empty(4, 2, 8, 2 * 32 + 1)  # rows of 65 floats: 4-byte aligned strides
    assert kv_align(base.transpose(1, 2)[..., :32], base.transpose(1, 2)[..., 33:]) == 4
    assert kv_align(base[..., 2:34]) == 4
    assert kv_align(torch.empty(4, 8, 2, 64)[1:]) == 16


def test_a_kernel_without_strided_kv_is_rejected_with_its_reason(temp_kernels):
    """A contiguous-only kernel at the top priority serves contiguous caches but is passed
    over, with the reason shown by explain, for a strided view; forcing it raises."""
    temp_kernels(
        "attention.decode",
        name="contiguous_only",
        priority=Priority.PLUGIN,
        vendors=("cpu",),
        features=("sinks", "sliding_window"),
    )
    case = _case("attention.decode", "vllm")
    inputs = cases.make_inputs(case, seed=1)
    cases.call(case, _contiguous(inputs))
    assert last_kernel() == "contiguous_only"
    out = cases.call(case, inputs)  # same shapes, other strides: not the remembered call
    assert last_kernel() == "torch_decode"
    expected, _ = cases.reference(case, _contiguous(inputs))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    table = str(explain(cases.request(case)))
    assert "REJECTED contiguous_only" in table and "does not support {strided_kv}" in table
    with pytest.raises(ValueError, match=r"override 'contiguous_only' cannot serve .*strided_kv"):
        cases.call(case, inputs, override="contiguous_only")


def test_an_alignment_bound_is_a_rejection_reason(temp_kernels):
    """A kernel registered with ``kv_align`` (16,) (16-byte copies) serves aligned strided
    caches and is rejected, by reason, for a view with 4-byte strides."""
    temp_kernels(
        "attention.decode",
        name="aligned_only",
        priority=Priority.PLUGIN,
        vendors=("cpu",),
        shapes={"kv_align": (16,)},
        features=("strided_kv",),
    )
    heads = Heads(8, 2, 32, 32)
    aligned = attention_request(
        "attention.decode",
        q_dtype=torch.float32,
        kv_dtype=torch.float32,
        heads=heads,
        page_size=8,
        strided_kv=True,
        kv_align=16,
    )
    odd = attention_request(
        "attention.decode",
        q_dtype=torch.float32,
        kv_dtype=torch.float32,
        heads=heads,
        page_size=8,
        strided_kv=True,
        kv_align=4,
    )
    cpu = Platform("cpu", "cpu", "CPU", 2, 0)
    assert explain(aligned, platform=cpu).winner.name == "aligned_only"
    selection = explain(odd, platform=cpu)
    assert selection.winner.name == "torch_decode"
    assert "kv_align=4 not in {16}" in str(selection)
    base = torch.randn(6, 2, 8, 2 * 32 + 1)  # a real 4-byte aligned view runs on the reference
    k, v = base.transpose(1, 2)[..., :32], base.transpose(1, 2)[..., 33:]
    q = torch.randn(2, 8, 32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    mha_decode_with_kvcache(q, k, v, table, torch.tensor([9, 16], dtype=torch.int32), 16)
    assert last_kernel() == "torch_decode"


BAD_LAYOUTS = [
    ("k_cache", "k_cache must have stride 1 in its last", lambda k, v: (k.transpose(2, 3).contiguous().transpose(2, 3), v)),
    ("v_cache", "v_cache must have stride 1 in its last", lambda k, v: (k, v.transpose(2, 3).contiguous().transpose(2, 3))),
    ("v_cache", r"v_cache .* must match k_cache .* in \[num_pages, page_size, Hkv\]", lambda k, v: (k, v[:, :2])),
    ("v_cache", "v_cache is on meta but q is on cpu", lambda k, v: (k, torch.empty_like(v, device="meta"))),
]  # fmt: skip


@pytest.mark.parametrize(("arg", "match", "change"), BAD_LAYOUTS, ids=[b[1][:30] for b in BAD_LAYOUTS])
@pytest.mark.parametrize("op", ["attention.extend", "attention.decode"])
def test_bad_cache_layouts_are_refused(op, arg, match, change, cold_and_warm):
    case = _case(op, "vllm")
    inputs = cases.make_inputs(case, seed=2)
    k, v = change(inputs["k_cache"], inputs["v_cache"])
    bad = {**inputs, "k_cache": k, "v_cache": v}
    cold_and_warm(lambda: cases.call(case, inputs), lambda: cases.call(case, bad), ValueError, match)


def test_bad_store_layout_writes_nothing():
    case = _case("kvcache.store", "vllm")
    inputs = cases.make_inputs(case, seed=4)
    base = inputs["k_cache"]._base
    before = base.clone()
    bad_v = inputs["v_cache"][:, :, :1]  # one KV head instead of two
    with pytest.raises(ValueError, match=r"v_cache must have shape \[17, 4, 2, 32\]"):
        store_kvcache(inputs["k"], inputs["v"], inputs["k_cache"], bad_v, inputs["slot_mapping"])
    with pytest.raises(ValueError, match="k_cache must have stride 1 in its last"):
        store_kvcache(
            inputs["k"],
            inputs["v"],
            inputs["k_cache"].transpose(2, 3).contiguous().transpose(2, 3),
            inputs["v_cache"],
            inputs["slot_mapping"],
        )
    assert torch.equal(base, before)


def test_extend_on_an_interleaved_cache_after_a_store():
    """The engine pattern: store a chunk's K/V through the views, then attend over them."""
    case = _case("attention.extend", "vllm")
    inputs = cases.make_inputs(case, seed=8)
    total_q = inputs["q"].shape[0]
    k_new = torch.randn(total_q, 2, 32)
    v_new = torch.randn(total_q, 2, 32)
    lengths, table, page = inputs["cache_seqlens"].tolist(), inputs["page_table"], case.page_size
    slots = []
    for b, (new, length) in enumerate(zip(case.seqlens_q, lengths)):
        slots += [int(table[b, pos // page]) * page + pos % page for pos in range(length - new, length)]
    store_kvcache(k_new, v_new, inputs["k_cache"], inputs["v_cache"], torch.tensor(slots))
    out = mha_extend_with_kvcache(**{k: v for k, v in inputs.items()})
    expected, _ = cases.reference(case, _contiguous(inputs))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
