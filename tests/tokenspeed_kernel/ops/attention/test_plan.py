"""The decode plan step (``mha_decode_plan``), ``graph_safe`` metadata and capture guards,
public request builders and ``last_kernel``: select once, call the layout hook with the
plan's tensors, reject or refuse non-capturable kernels with a reason in words."""

import dataclasses

import pytest
import torch

import tokenspeed_kernel
from tokenspeed_kernel import (
    DecodePlan,
    Heads,
    KernelOverrideError,
    NoKernelFoundError,
    Priority,
    attention_request,
    explain,
    last_kernel,
    mha_decode_plan,
    mha_decode_with_kvcache,
    registry,
    select,
    store_kvcache,
    store_request,
)
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.ops import _dispatch
from tokenspeed_kernel.ops.attention import api
from tokenspeed_kernel.ops.attention import plan as plan_module
from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.selector import NOT_GRAPH_SAFE
from tokenspeed_kernel.tools.cases import attention as cases

pytestmark = pytest.mark.usefixtures("only_reference")

# 3 sequences of 10/7/3 tokens, page size 4, 4 q / 2 KV heads of dim 16, window 4, sinks
CASE = cases.AttentionCase(
    "attention.decode", (1, 1, 1), (10, 7, 3), 4, 2, 16, page_size=4, dtype=torch.float32, window_left=4, sinks=True
)
FEATURES = ("sinks", "sliding_window", "logit_cap", "return_lse", "fp8_kv", "spec_decode")


@pytest.fixture
def inputs():
    return cases.make_inputs(CASE)


def _plan(inputs, **kw) -> DecodePlan:
    kw = {"num_q_heads": CASE.num_q_heads, "window_left": inputs["window_left"], "sinks": inputs["sinks"], **kw}
    return mha_decode_plan(
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["page_table"],
        inputs["cache_seqlens"],
        inputs["max_seqlen_k"],
        **kw,
    )


def _capturing(monkeypatch, on: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)


def _recording_hook():
    calls: list[DecodeArgs] = []

    def prepare_layout(args: DecodeArgs) -> None:
        calls.append(args)

    return prepare_layout, calls


# ----------------------------------------------------------------------------- the plan step


def test_plan_run_equals_the_functional_call_and_names_its_kernel(inputs):
    plan = _plan(inputs)
    assert plan.kernel == "torch_decode" and not plan.has_layout_hook
    assert (plan.batch, plan.q_len, plan.page_size) == (3, 1, 4)
    assert plan.heads == Heads(4, 2, 16, 16) and plan.q_dtype == torch.float32
    got = plan.run(inputs["q"])
    assert last_kernel() == "torch_decode"
    want = mha_decode_with_kvcache(**inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    out = torch.full_like(got, float("nan"))
    assert plan.run(inputs["q"].unsqueeze(1), out=out.unsqueeze(1)).shape == (3, 1, 4, 16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_plan_with_return_lse(inputs):
    plan = _plan(inputs, return_lse=True)
    out, lse = plan.run(inputs["q"])
    want_out, want_lse = mha_decode_with_kvcache(**{**inputs, "return_lse": True})
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_plan_selects_once_and_runs_never_select(inputs, monkeypatch):
    selections = []
    real_select = plan_module.select
    monkeypatch.setattr(plan_module, "select", lambda *a, **k: selections.append(a) or real_select(*a, **k))
    plan = _plan(inputs)

    def no_dispatch(*args, **kwargs):
        raise AssertionError("DecodePlan.run must not select")

    monkeypatch.setattr(api, "dispatch", no_dispatch)
    monkeypatch.setattr(_dispatch, "select", no_dispatch)
    for _ in range(3):
        plan.run(inputs["q"])
        plan.update()
    assert len(selections) == 1


def test_override_is_respected(inputs, temp_kernels):
    fast = temp_kernels(
        "attention.decode", name="fake_fast_decode", vendors=("cpu",), features=FEATURES, priority=Priority.PLUGIN
    )
    assert _plan(inputs).kernel == "fake_fast_decode"
    plan = _plan(inputs, override="torch_decode")
    assert plan.kernel == "torch_decode"
    plan.run(inputs["q"])
    assert fast.calls == [] and last_kernel() == "torch_decode"
    with pytest.raises(KernelOverrideError, match="not a kernel registered"):
        _plan(inputs, override="nope")


def test_layout_hook_gets_the_plan_tensors_at_plan_and_update_never_at_run(inputs, temp_kernels):
    hook, calls = _recording_hook()
    fn = temp_kernels(
        "attention.decode",
        name="fake_planned_decode",
        vendors=("cpu",),
        features=FEATURES,
        priority=Priority.PLUGIN,
        prepare_layout=hook,
    )
    plan = _plan(inputs, softmax_scale=0.5, logit_cap=3.0)
    assert plan.kernel == "fake_planned_decode" and plan.has_layout_hook
    assert len(calls) == 1
    args = calls[0]
    assert args.page_table is inputs["page_table"] and args.cache_seqlens is inputs["cache_seqlens"]
    assert args.k_cache is inputs["k_cache"] and args.v_cache is inputs["v_cache"] and args.sinks is inputs["sinks"]
    assert (args.max_seqlen_k, args.window_left, args.softmax_scale, args.logit_cap) == (10, 4, 0.5, 3.0)
    assert args.k_scale is None and args.v_scale is None and args.lse is None
    # q/out are placeholders: the run's shape, dtype and device, one element of memory
    assert args.q.shape == (3, 1, 4, 16) and args.q.dtype == torch.float32 and args.q.device.type == "cpu"
    assert args.out.shape == (3, 1, 4, 16) and args.out.dtype == torch.float32
    assert args.q.untyped_storage().nbytes() == 4

    inputs["cache_seqlens"].add_(1)  # the engine advances lengths in place, then re-plans
    plan.update()
    assert len(calls) == 2 and calls[1].cache_seqlens is inputs["cache_seqlens"]
    plan.run(inputs["q"])
    plan.run(inputs["q"])
    assert len(calls) == 2 and len(fn.calls) == 2
    run_args = fn.calls[0]
    assert run_args.page_table is args.page_table and run_args.cache_seqlens is args.cache_seqlens
    assert run_args.q.shape == args.q.shape and run_args.out.shape == args.out.shape
    assert (run_args.softmax_scale, run_args.window_left, run_args.logit_cap) == (0.5, 4, 3.0)
    assert last_kernel() == "fake_planned_decode"


def test_update_refuses_capture(inputs, monkeypatch):
    plan = _plan(inputs)
    _capturing(monkeypatch)
    with pytest.raises(RuntimeError, match=r"update\(\) \(torch_decode\) must run outside CUDA-graph capture"):
        plan.update()


def test_plan_validates(inputs):
    plan = _plan(inputs)
    with pytest.raises(ValueError, match=r"q must have shape \[3, 1, 4, 16\] or \[3, 4, 16\] for this plan"):
        plan.run(inputs["q"][:2])
    with pytest.raises(TypeError, match=r"q must have dtype in \{float32\}, got bfloat16"):
        plan.run(inputs["q"].bfloat16())
    with pytest.raises(ValueError, match=r"out must have shape \[3, 4, 16\]"):
        plan.run(inputs["q"], out=torch.empty(3, 4, 8))
    # The quick path of a run (no out) hands anything unusual to the checked one.
    with pytest.raises(ValueError, match="q must be contiguous"):
        plan.run(torch.randn(3, 16, 4).transpose(1, 2))
    with pytest.raises(ValueError, match="q is on meta but the plan's caches are on cpu"):
        plan.run(torch.empty(3, 4, 16, device="meta"))
    with pytest.raises(TypeError, match="q_dtype is required for a float8_e4m3fn cache"):
        mha_decode_plan(
            inputs["k_cache"].to(torch.float8_e4m3fn),
            inputs["v_cache"].to(torch.float8_e4m3fn),
            inputs["page_table"],
            inputs["cache_seqlens"],
            10,
            num_q_heads=4,
            k_scale=1.0,
            v_scale=1.0,
        )
    with pytest.raises(ValueError, match="query heads of q"):
        _plan(inputs, num_q_heads=3)
    with pytest.raises(TypeError, match="capturable must be a bool"):
        _plan(inputs, capturable=1)
    with pytest.raises(TypeError, match="page_table must have dtype in {int32}"):
        _plan(inputs | {"page_table": inputs["page_table"].long()})


# ----------------------------------------------------------------------------- row-strided q

STRIDED = dataclasses.replace(CASE, strided_q=True)  # q: the first Hq * D columns of [3, (4 + 2 * 2) * 16], NaN after
ROW = (4 + 2 * 2) * 16


def test_row_strided_plan_runs_a_fused_qkv_q_in_place_as_the_call_does():
    """``q_row_stride``: the plan selects with the functional call's request for such a q
    (``strided_q``, ``q_align``), its hooks see the runs' strides, and runs read q in place
    (the NaN after each row never reaches the output) to the call's bits and float64's."""
    from support.naive_attention import naive_for_case

    inputs = cases.make_inputs(STRIDED)
    q = inputs["q"]
    assert q.stride() == (ROW, 16, 1)
    plan = _plan(inputs, q_row_stride=ROW)
    assert plan.q_row_stride == ROW and plan.kernel == "torch_decode"
    want = mha_decode_with_kvcache(**inputs)
    assert plan.request == _dispatch.last_request()  # what the call selected with
    assert "strided_q" in plan.request.features and plan.request.shape("q_align") == 16
    assert plan._layout_args.q.shape == (3, 1, 4, 16) and plan._layout_args.q.stride()[0] == ROW
    for _ in range(2):  # the quick path; then into out (the checked path)
        got = plan.run(q)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    out = torch.full_like(want, float("nan"))
    assert plan.run(q, out=out) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    expected, _ = naive_for_case(STRIDED, inputs)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_row_strided_plan_refuses_other_layouts_and_bad_strides():
    inputs = cases.make_inputs(STRIDED)
    q = inputs["q"]
    plan = _plan(inputs, q_row_stride=ROW)
    expected = r"q must be \[batch, Hq, D\] with strides \(128, 16, 1\) for this plan \(made with q_row_stride=128\)"
    with pytest.raises(ValueError, match=expected + r", got strides \(64, 16, 1\)"):
        plan.run(q.contiguous())
    with pytest.raises(ValueError, match=expected + r", got strides \(128, 64, 16, 1\)"):
        plan.run(q.unsqueeze(1))
    wider = torch.zeros(3, ROW + 16)[:, :64].view(3, 4, 16)
    with pytest.raises(ValueError, match=expected + r", got strides \(144, 16, 1\)"):
        plan.run(wider)
    # A contiguous plan names the plan a row-strided q needs.
    with pytest.raises(ValueError, match=r"q must be contiguous for this plan .*q_row_stride=q.stride\(0\)"):
        _plan(inputs).run(q)
    with pytest.raises(ValueError, match="q_row_stride must be >= 64, got 63"):
        _plan(inputs, q_row_stride=63)
    with pytest.raises(TypeError, match="q_row_stride must be an int, got float"):
        _plan(inputs, q_row_stride=128.0)
    with pytest.raises(ValueError, match=r"q_row_stride applies to a 3-D q \[batch, Hq, D\] \(q_len 1\), got q_len 2"):
        _plan(inputs, q_row_stride=ROW, q_len=2)
    # Hq * D is a contiguous q's row: the plan is a contiguous one.
    dense = _plan(inputs, q_row_stride=64)
    assert dense.q_row_stride is None and "strided_q" not in dense.request.features
    torch.testing.assert_close(dense.run(q.contiguous()), plan.run(q), rtol=0, atol=0)


def test_row_strided_plan_never_selects_a_kernel_without_strided_q(temp_kernels):
    inputs = cases.make_inputs(STRIDED)
    temp_kernels(
        "attention.decode", name="fake_dense_decode", vendors=("cpu",), features=FEATURES, priority=Priority.PLUGIN
    )
    assert _plan(inputs).kernel == "fake_dense_decode"
    assert _plan(inputs, q_row_stride=ROW).kernel == "torch_decode"
    with pytest.raises(KernelOverrideError, match="strided_q"):
        _plan(inputs, q_row_stride=ROW, override="fake_dense_decode")


def test_row_strided_plan_checks_the_address_for_a_kernel_that_lists_q_align(temp_kernels):
    """A kernel that reads q by 16-byte copies (``q_align`` ``(16,)``): the plan assumed a
    16-byte aligned base; a run's q that is not is refused on both run paths."""
    hook, calls = _recording_hook()
    fn = temp_kernels(
        "attention.decode",
        name="fake_tma_decode",
        vendors=("cpu",),
        features=(*FEATURES, "strided_q"),
        shapes={"q_align": (16,)},
        priority=Priority.PLUGIN,
        prepare_layout=hook,
    )
    inputs = cases.make_inputs(STRIDED)
    plan = _plan(inputs, q_row_stride=ROW)
    assert plan.kernel == "fake_tma_decode"
    # The hook's placeholder q has the runs' layout: the 4-D view a run's q is passed as.
    assert calls[0].q.stride() == inputs["q"].view(3, 1, 4, 16).stride() == (ROW, 64, 16, 1)
    plan.run(inputs["q"])
    assert fn.calls[-1].q.data_ptr() == inputs["q"].data_ptr()  # in place, no copy
    shifted = torch.zeros(3 * ROW + 4)[4:].view(3, ROW)[:, :64].view(3, 4, 16)  # 16 bytes + 16: aligned
    plan.run(shifted)
    odd = torch.zeros(3 * ROW + 1)[1:].view(3, ROW)[:, :64].view(3, 4, 16)  # 4 bytes past a boundary
    for out in (None, torch.empty(3, 4, 16)):
        with pytest.raises(ValueError, match=r"q's address must be a multiple of 16 bytes for this plan's kernel"):
            plan.run(odd, out=out)
    assert len(fn.calls) == 2


# ----------------------------------------------------------------------------- graph safety


def test_metadata_default_and_reference_audit():
    spec = registry.get_kernel("torch_decode")
    assert not spec.graph_safe and "graph_safe=no" in spec.summary()
    for name in ("torch_prefill", "torch_extend", "torch_decode", "torch_store_kvcache"):
        assert registry.get_kernel(name).graph_safe is False, name
    assert registry.get_kernel("torch_moe_topk").graph_safe  # softmax, sort, copy: no host read


def test_bind_hook_is_called_once_after_the_layout_hook_and_its_runner_serves_every_run(inputs, temp_kernels):
    """A kernel's ``bind`` hook: called once per plan (after ``prepare_layout``), with the
    placeholder arguments; its runner, not ``fn``, gets each run's arguments (the run's q and
    out, the plan's caches), and ``update`` does not bind again. The functional call still
    goes to ``fn``."""
    events: list[str] = []
    runs: list[DecodeArgs] = []
    reference = registry.get_kernel("torch_decode").fn

    def bind(args: DecodeArgs):
        events.append("bind")
        assert args.q.shape == (3, 1, 4, 16) and args.page_table is inputs["page_table"]

        def run(run_args: DecodeArgs) -> None:
            runs.append(run_args)
            reference(run_args)

        return run

    fn = temp_kernels(
        "attention.decode",
        name="fake_bound_decode",
        vendors=("cpu",),
        features=FEATURES,
        priority=Priority.PLUGIN,
        prepare_layout=lambda args: events.append("layout"),
        bind=bind,
    )
    plan = _plan(inputs)
    assert plan.kernel == "fake_bound_decode" and events == ["layout", "bind"]
    assert "hooks=prepare_layout,bind" in registry.get_kernel("fake_bound_decode").summary()
    want = mha_decode_with_kvcache(**inputs, override="torch_decode")
    for _ in range(2):
        q = inputs["q"].clone()
        got = plan.run(q)
        assert runs[-1].q.data_ptr() == q.data_ptr() and runs[-1].k_cache is inputs["k_cache"]
        assert runs[-1].out.data_ptr() == got.data_ptr()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        plan.update()
    assert len(runs) == 2 and events == ["layout", "bind", "layout", "layout"] and fn.calls == []
    mha_decode_with_kvcache(**inputs)  # the functional path calls fn, never the runner
    assert len(fn.calls) == 1 and len(runs) == 2


def test_bind_hook_needs_a_plan_that_binds(temp_kernels):
    with pytest.raises(
        ValueError, match=r"moe.topk has no plan that binds a run, so bind would never be called.*decode, moe.apply"
    ):
        temp_kernels("moe.topk", name="fake_bad_bind", bind=lambda args: lambda run_args: None)


def test_reference_moe_is_not_graph_safe():
    assert registry.get_kernel("torch_moe").graph_safe is False


def test_registration_checks_the_new_metadata(temp_kernels):
    fn = temp_kernels("attention.decode", name="fake_default", vendors=("cpu",))
    assert registry.get_kernel("fake_default").graph_safe is True and fn.calls == []
    with pytest.raises(TypeError, match="graph_safe must be a bool"):
        temp_kernels("attention.decode", name="fake_bad", graph_safe="no")
    with pytest.raises(ValueError, match=r"moe.topk has no layout plan step.*attention.decode"):
        temp_kernels("moe.topk", name="fake_bad2", prepare_layout=lambda args: None)


def test_capturable_request_rejects_with_a_reason(inputs, temp_kernels):
    request = attention_request(
        "attention.decode",
        q_dtype=torch.float32,
        kv_dtype=torch.float32,
        heads=Heads(4, 2, 16, 16),
        window_left=4,
        sinks=True,
        page_size=4,
        q_len=1,
        capturable=True,
    )
    selection = explain(request)
    reasons = {c.spec.name: c.reasons for c in selection.candidates}
    assert reasons["torch_decode"] == (NOT_GRAPH_SAFE,) and selection.winner is None
    assert "synchronizes with the host; cannot be captured in a CUDA graph" in selection.table()
    assert "features=sinks,sliding_window capturable" in selection.table()
    assert "[not graph-safe]" in explain(request.op, dtypes={"q": torch.float32}).table()
    with pytest.raises(NoKernelFoundError, match="synchronizes with the host"):
        _plan(inputs, capturable=True)
    with pytest.raises(KernelOverrideError, match=r"override 'torch_decode' cannot serve .*synchronizes with the host"):
        _plan(inputs, capturable=True, override="torch_decode")
    temp_kernels(
        "attention.decode", name="fake_capturable", vendors=("cpu",), features=FEATURES, priority=Priority.REFERENCE + 1
    )
    assert _plan(inputs, capturable=True).kernel == "fake_capturable"
    assert _plan(inputs).kernel == "fake_capturable"  # ranking unchanged without capture
    temp_kernels(
        "attention.decode",
        name="fake_syncing",
        vendors=("cpu",),
        features=FEATURES,
        priority=Priority.PLUGIN,
        graph_safe=False,
    )
    assert _plan(inputs).kernel == "fake_syncing"
    assert _plan(inputs, capturable=True).kernel == "fake_capturable"


def test_capturing_with_a_non_graph_safe_kernel_raises_before_launch(inputs, temp_kernels, monkeypatch):
    syncing = temp_kernels(
        "attention.decode",
        name="fake_syncing",
        vendors=("cpu",),
        features=FEATURES,
        priority=Priority.PLUGIN,
        graph_safe=False,
    )
    safe = temp_kernels(
        "attention.decode", name="fake_safe", vendors=("cpu",), features=FEATURES, priority=Priority.REFERENCE + 1
    )
    plan = _plan(inputs)
    _capturing(monkeypatch)
    match = r"kernel 'fake_syncing' \(attention.decode\) is not graph-safe: it synchronizes with the host"
    with pytest.raises(RuntimeError, match=match):
        mha_decode_with_kvcache(**inputs)
    with pytest.raises(RuntimeError, match=match):
        plan.run(inputs["q"])
    assert syncing.calls == []
    mha_decode_with_kvcache(**inputs, override="fake_safe")  # graph-safe kernels launch
    assert len(safe.calls) == 1 and last_kernel() == "fake_safe"
    k = torch.randn(2, 2, 16)
    with pytest.raises(RuntimeError, match="'torch_store_kvcache'"):
        store_kvcache(k, k, inputs["k_cache"], inputs["v_cache"], torch.tensor([0, 1]))
    _capturing(monkeypatch, on=False)
    plan.run(inputs["q"])
    assert len(syncing.calls) == 1


def test_is_capturing_on_a_build_without_cuda(monkeypatch):
    def broken():
        raise RuntimeError("Tried to instantiate dummy base class _cuda_isCurrentStreamCapturing")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", broken)
    assert _dispatch.is_capturing() is False


# ----------------------------------------------------------------------------- which kernel


def test_public_request_builders_match_the_calls(inputs):
    mha_decode_with_kvcache(**inputs)
    built = attention_request(
        "attention.decode",
        q_dtype=torch.float32,
        kv_dtype=torch.float32,
        heads=Heads(4, 2, 16, 16),
        window_left=4,
        sinks=True,
        page_size=4,
        q_len=1,
        batch=inputs["q"].shape[0],
    )
    assert built == _dispatch.last_request() == cases.request(CASE)  # the bench/check cases' request too
    assert built.shape("batch_bucket") == 4  # 3 sequences
    assert _plan(inputs).request == built  # mha_decode_plan selects with the same batch bucket
    assert select(built, tokenspeed_kernel.platform_for(inputs["q"].device)).name == last_kernel() == "torch_decode"
    k = torch.randn(2, 2, 16)
    store_kvcache(k, k, inputs["k_cache"], inputs["v_cache"], torch.tensor([0, 1]))
    store = store_request(
        kv_dtype=torch.float32, cache_dtype=torch.float32, num_kv_heads=2, head_dim=16, head_dim_v=16, page_size=4
    )
    assert store == _dispatch.last_request() and last_kernel() == "torch_store_kvcache"
    assert explain(store).winner.name == "torch_store_kvcache"
    assert explain(store_request(**{**_kw(store), "capturable": True})).winner is None


def _kw(request):
    shapes = dict(request.shapes)
    return {
        "kv_dtype": request.dtype("kv"),
        "cache_dtype": request.dtype("cache"),
        "num_kv_heads": shapes["num_kv_heads"],
        "head_dim": shapes["head_dim"],
        "head_dim_v": shapes["head_dim_v"],
        "page_size": shapes["page_size"],
    }


def test_cli_surfaces_graph_safety(capsys):
    assert main(["list", "attention.decode"]) == 0
    assert "torch_decode [torch, backend=reference" in (out := capsys.readouterr().out) and "graph_safe=no" in out
    argv = ["explain", "attention.decode", "--dtype", "bf16", "--head-dim", "64", "--shape", "page_size=16"]
    assert main([*argv, "--capturable"]) == 0
    out = capsys.readouterr().out
    assert "capturable" in out and f"torch_decode                     torch      reference(0): {NOT_GRAPH_SAFE}" in out
    assert main(["explain", "attention.decode", "--case", "0", "--capturable"]) == 0
    assert NOT_GRAPH_SAFE in capsys.readouterr().out


def test_plan_run_under_torch_compile(inputs):
    """Under torch.compile the run goes through the custom op with the plan's kernel."""
    torch._dynamo.reset()
    try:
        plan = _plan(inputs, return_lse=True)
        compiled = torch.compile(lambda q: plan.run(q), backend="aot_eager", fullgraph=True)
        out, lse = compiled(inputs["q"])
        want_out, want_lse = plan.run(inputs["q"])
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()


def test_prefill_request_carries_the_length_bucket_of_each_call():
    """``max_seqlen_q`` changes per call while the tensors stay the same: the remembered
    checks are keyed on its power-of-two bucket, so each call selects for its own length."""
    case = cases.AttentionCase("attention.prefill", (5, 3), (5, 3), 4, 2, 16, dtype=torch.float32, sinks=True)
    inputs = cases.make_inputs(case)
    args = [inputs[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    buckets = []
    for max_seqlen_q in (5, 9, 5, 40):  # a host bound: any value >= the longest sequence
        tokenspeed_kernel.mha_prefill(*args, max_seqlen_q, 5, sinks=inputs["sinks"])
        buckets.append(_dispatch.last_request().shape("max_seqlen_q_bucket"))
    assert buckets == [8, 16, 8, 64]
    heads = Heads(4, 2, 16, 16)
    built = attention_request(
        "attention.prefill",
        q_dtype=torch.float32,
        kv_dtype=torch.float32,
        heads=heads,
        sinks=True,
        max_seqlen_q=5,
        kv_prefix=False,  # one lengths tensor for queries and keys (make_inputs, equal lengths)
    )
    assert built == cases.request(case)  # what check/bench select with
    tokenspeed_kernel.mha_prefill(*args, 5, 5, sinks=inputs["sinks"])
    assert _dispatch.last_request() == built


def test_prefill_request_says_whether_keys_may_outnumber_queries():
    """``kv_prefix``: 0 when ``cu_seqlens_k`` is ``cu_seqlens_q`` itself, 1 for a second tensor
    (even with equal values: the host cannot tell without reading the device); the remembered
    checks are keyed on it, so a plan made for one never serves the other."""
    case = cases.AttentionCase("attention.prefill", (5, 3), (5, 3), 4, 2, 16, dtype=torch.float32)
    inputs = cases.make_inputs(case)
    q, k, v, cu = (inputs[n] for n in ("q", "k", "v", "cu_seqlens_q"))
    seen = []
    for cu_k in (cu, cu.clone(), cu):
        tokenspeed_kernel.mha_prefill(q, k, v, cu, cu_k, 5, 5)
        seen.append(_dispatch.last_request().shape("kv_prefix"))
    assert seen == [0, 1, 0]
    heads = Heads(4, 2, 16, 16)
    plain = attention_request("attention.prefill", q_dtype=torch.float32, kv_dtype=torch.float32, heads=heads)
    assert plain.shape("kv_prefix") is None  # left out: every prefill kernel serves it


def test_attention_request_carries_the_window_only_when_windowed():
    heads = Heads(8, 2, 64, 64)
    windowed = attention_request(
        "attention.prefill", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, heads=heads, window_left=127
    )
    assert windowed.shape("window_left") == 127 and "sliding_window" in windowed.features
    dense = attention_request("attention.prefill", q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, heads=heads)
    assert dense.shape("window_left") is None and "sliding_window" not in dense.features
