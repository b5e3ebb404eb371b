"""The attention and KV-store operators under torch.compile (through the tokenspeed_kernel
custom ops) equal eager, with the reference backend forced."""

import pytest
import torch

from tokenspeed_kernel import store_kvcache
from tokenspeed_kernel.tools.cases import attention as cases

REFERENCE = {
    "attention.prefill": "torch_prefill",
    "attention.extend": "torch_extend",
    "attention.decode": "torch_decode",
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_custom_ops_are_registered():
    for name in ("mha_prefill", "mha_extend_with_kvcache", "mha_decode_with_kvcache", "store_kvcache"):
        assert hasattr(torch.ops.tokenspeed_kernel, name), name


@pytest.mark.parametrize(
    "case",
    [
        cases.awkward_cases("attention.prefill", torch.float32)[1],
        cases.awkward_cases("attention.extend", torch.float32)[0],
        cases.awkward_cases("attention.decode", torch.float32)[0],
        cases.awkward_cases("attention.decode", torch.bfloat16)[2],
        cases.awkward_cases("attention.decode", torch.float32)[3],
    ],
    ids=lambda c: f"{c.op}-{c.name}",
)
def test_compiled_attention_equals_eager(case):
    inputs = cases.make_inputs(case, seed=5)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    options = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}

    def fn(**t):
        result = cases.call(case, {**t, **options}, override=REFERENCE[case.op])
        out, lse = result if case.return_lse else (result, None)
        return (out * 2, lse) if lse is not None else out * 2

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got, want = compiled(**tensors), fn(**tensors)
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_compiled_store_then_decode_equals_eager():
    store = cases.awkward_cases("kvcache.store", torch.float32)[0]
    inputs = cases.make_inputs(store, seed=6)

    def fn(k, v, k_cache, v_cache, slot_mapping):
        store_kvcache(k, v, k_cache, v_cache, slot_mapping)
        return k_cache.sum() + v_cache.sum()

    eager_k, eager_v = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    want = fn(inputs["k"], inputs["v"], eager_k, eager_v, inputs["slot_mapping"])
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(
        inputs["k"], inputs["v"], inputs["k_cache"], inputs["v_cache"], inputs["slot_mapping"]
    )
    torch.testing.assert_close(got, want)
    assert torch.equal(inputs["k_cache"], eager_k) and torch.equal(inputs["v_cache"], eager_v)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_store_then_decode_equals_eager():
    """The default (inductor) backend: the mutating store and the decode in one graph."""
    decode = cases.awkward_cases("attention.decode", torch.float32)[0]
    d = cases.make_inputs(decode, seed=8)
    page = decode.page_size
    # overwrite the last token of every sequence through store_kvcache, then decode over it
    last = [int(d["page_table"][b, (n - 1) // page]) * page + (n - 1) % page for b, n in enumerate(decode.seqlens_k)]
    slots = torch.tensor(last, dtype=torch.int64)
    new_k = torch.randn(decode.batch, decode.num_kv_heads, decode.head_dim)
    new_v = torch.randn(decode.batch, decode.num_kv_heads, decode.dv)
    options = {k: v for k, v in d.items() if not isinstance(v, torch.Tensor)}

    def fn(q, k_cache, v_cache, page_table, cache_seqlens, sinks):
        store_kvcache(new_k, new_v, k_cache, v_cache, slots, override="torch_store_kvcache")
        inputs = {**options, "q": q, "k_cache": k_cache, "v_cache": v_cache, "page_table": page_table}
        out, lse = cases.call(decode, {**inputs, "cache_seqlens": cache_seqlens, "sinks": sinks}, "torch_decode")
        return out * 2 + 1, lse

    tensors = [d[name] for name in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "sinks")]
    eager_tensors = [t.clone() for t in tensors]
    got = torch.compile(fn, fullgraph=True)(*tensors)
    want = fn(*eager_tensors)
    torch.testing.assert_close(got, want)
    assert torch.equal(tensors[1], eager_tensors[1]) and torch.equal(tensors[2], eager_tensors[2])


def test_opcheck_decode():
    case = cases.awkward_cases("attention.decode", torch.float32)[0]
    d = cases.make_inputs(case, seed=7)
    args = (
        d["q"],
        d["k_cache"],
        d["v_cache"],
        d["page_table"],
        d["cache_seqlens"],
        d["max_seqlen_k"],
        0.25,
        -1,
        d["sinks"],
        0.0,
        None,
        None,
        True,
        "torch_decode",
    )
    torch.library.opcheck(torch.ops.tokenspeed_kernel.mha_decode_with_kvcache.default, args)


def _opcheck_args(case, inputs, kernel):
    """The custom op's positional arguments for one case (fp8 scales as float32 [1] tensors)."""
    d = dict(inputs)
    scales = [torch.tensor([float(d[name])]) if d.get(name) is not None else None for name in ("k_scale", "v_scale")]
    if case.op == "kvcache.store":
        return (d["k"], d["v"], d["k_cache"], d["v_cache"], d["slot_mapping"], *scales, kernel)
    options = (case.causal, 0.25, case.window_left, d.get("sinks"), case.logit_cap)
    if case.op == "attention.prefill":
        tensors = (d["q"], d["k"], d["v"], d["cu_seqlens_q"], d["cu_seqlens_k"], d["max_seqlen_q"], d["max_seqlen_k"])
        return (*tensors, *options, case.return_lse, kernel)
    tensors = (d["q"], d["k_cache"], d["v_cache"], d["page_table"], d["cu_seqlens_q"], d["cache_seqlens"])
    return (*tensors, d["max_seqlen_q"], d["max_seqlen_k"], *options, *scales, case.return_lse, kernel)


@pytest.mark.parametrize(
    ("op", "index"),
    [
        ("attention.prefill", 1),
        ("attention.extend", 0),
        ("attention.extend", 2),
        ("kvcache.store", 0),
        ("kvcache.store", 2),
    ],
    ids=str,
)
def test_opcheck_prefill_extend_store(op, index):
    """The fake (meta) implementations agree with the real ones: shapes, dtypes, mutation."""
    case = cases.awkward_cases(op, torch.float32)[index]
    inputs = cases.make_inputs(case, seed=7)
    kernel = "torch_store_kvcache" if op == "kvcache.store" else REFERENCE[op]
    name = {"attention.prefill": "mha_prefill", "attention.extend": "mha_extend_with_kvcache"}.get(op, "store_kvcache")
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if case.kv_dtype == torch.float8_e4m3fn:  # the schema check compares fp8 tensors with ops CPU lacks for fp8
        utils = utils[1:]
    op_overload = getattr(torch.ops.tokenspeed_kernel, name).default
    torch.library.opcheck(op_overload, _opcheck_args(case, inputs, kernel), test_utils=utils)
