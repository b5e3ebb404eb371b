"""The step plans (``mha_extend_plan``, ``mha_prefill_plan``, ``mha_decode_step_plan``): one
step's call checked and the
kernel selected once, every layer run against float64 and bitwise against the functional call;
runs of another layout checked in full (the functional call's errors) or refused; the quick
path touches neither the call key nor the selector."""

import dataclasses
import math

import pytest
import torch

from tokenspeed_kernel import (
    DecodeStepPlan,
    ExtendPlan,
    PrefillPlan,
    last_kernel,
    mha_decode_step_plan,
    mha_decode_with_kvcache,
    mha_extend_plan,
    mha_extend_with_kvcache,
    mha_prefill,
    mha_prefill_plan,
)
from tokenspeed_kernel.ops import _operator
from tokenspeed_kernel.ops.attention import api
from tokenspeed_kernel.tools.cases import attention as cases

pytestmark = pytest.mark.usefixtures("only_reference")

# 4 ragged chunks (one empty) on partial pages of 4, 6 q / 2 KV heads of dim 16, window 5, sinks
CASE = cases.AttentionCase(
    "attention.extend", (5, 0, 3, 9), (13, 7, 3, 22), 6, 2, 16, page_size=4, dtype=torch.float32, window_left=5,
    sinks=True,
)  # fmt: skip
PER_LAYER = ("q", "k_cache", "v_cache", "sinks")
# 3 ragged sequences whose keys outnumber their queries (a prefix), 6 q / 3 KV heads, window 4, sinks
PREFILL = cases.AttentionCase(
    "attention.prefill", (7, 1, 12), (9, 30, 12), 6, 3, 16, dtype=torch.float32, window_left=4, sinks=True
)
PREFILL_LAYER = ("q", "k", "v", "sinks")


def _layers(n: int, case=CASE, per_layer=PER_LAYER) -> list[dict]:
    """``n`` layers of one step: the same tables (layer 0's), each layer its own ``per_layer``
    tensors (q, keys or caches, sinks)."""
    first = cases.make_inputs(case, seed=0)
    return [first] + [
        {**first, **{k: v for k, v in cases.make_inputs(case, seed=s).items() if k in per_layer}} for s in range(1, n)
    ]


def _plan(inputs: dict, **kw) -> ExtendPlan:
    return mha_extend_plan(**{**inputs, **kw})


def _run(plan: ExtendPlan, inputs: dict, **kw):
    return plan.run(*(inputs[name] for name in PER_LAYER[:3]), sinks=inputs["sinks"], **kw)


# (case, its per-layer tensors, the plan step, the functional call, the reference kernel)
STEPS = {
    "extend": (CASE, PER_LAYER, mha_extend_plan, mha_extend_with_kvcache, "torch_extend"),
    "prefill": (PREFILL, PREFILL_LAYER, mha_prefill_plan, mha_prefill, "torch_prefill"),
}


@pytest.mark.parametrize("step", STEPS)
def test_every_layer_runs_as_the_functional_call_and_matches_float64(step):
    case, per_layer, make_plan, call, kernel = STEPS[step]
    layers = _layers(3, case, per_layer)
    plan = make_plan(**layers[0])
    assert isinstance(plan, ExtendPlan if step == "extend" else PrefillPlan) and plan.kernel == kernel
    assert plan.total_q == sum(case.seqlens_q) and plan.window_left == case.window_left
    assert plan.softmax_scale == pytest.approx(1 / math.sqrt(16))
    for inputs in layers:
        out = torch.full((plan.total_q, 6, 16), math.nan)  # poisoned: every row must be written
        got = plan.run(*(inputs[k] for k in per_layer[:3]), sinks=inputs["sinks"], out=out)
        assert got is out and last_kernel() == kernel
        want, _ = cases.reference(case, inputs)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, call(**inputs))
    assert getattr(plan, "page_size", 4) == 4 and getattr(plan, "total_k", 51) == 51


def test_return_lse_gives_the_functional_calls_pair():
    inputs = _layers(1)[0]
    plan = _plan(inputs, return_lse=True)
    out, lse = _run(plan, inputs)
    want_out, want_lse = mha_extend_with_kvcache(**{**inputs, "return_lse": True})
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and lse.shape == (17, 6)


def test_the_quick_run_neither_checks_keys_nor_selects(monkeypatch):
    """After planning, a run of the plan's layout takes no call key, no plan-cache entry and no
    selection: the functional path's pieces are made to fail, and the run still serves."""
    layers = _layers(2)
    plan = _plan(layers[0])
    cached = len(api.EXTEND.plans)

    def boom(*args, **kwargs):
        raise AssertionError("the quick run took the functional path")

    monkeypatch.setattr(api.ExtendCall, "check", classmethod(boom))
    monkeypatch.setattr(_operator.Calls, "call", boom)
    monkeypatch.setattr(api, "dispatch", boom)
    got = _run(plan, layers[1])
    monkeypatch.undo()
    assert len(api.EXTEND.plans) == cached
    assert torch.equal(got, mha_extend_with_kvcache(**layers[1]))


def test_planning_raises_what_the_call_raises():
    inputs = _layers(1)[0]
    for bad, error, words in (
        ({"page_table": inputs["page_table"].long()}, TypeError, "page_table"),
        ({"sinks": inputs["sinks"][:3]}, ValueError, "sinks"),
        ({"max_seqlen_q": -1}, ValueError, "max_seqlen_q"),
    ):
        with pytest.raises(error, match=words):
            mha_extend_with_kvcache(**{**inputs, **bad})
        with pytest.raises(error, match=words):
            _plan(inputs, **bad)


def test_a_run_of_another_layout_is_checked_in_full_or_refused():
    inputs = _layers(1)[0]
    plan = _plan(inputs)
    q, k_cache, v_cache, sinks = (inputs[name] for name in PER_LAYER)
    with pytest.raises(TypeError, match="q must have dtype"):
        plan.run(q.double(), k_cache, v_cache, sinks=sinks)
    with pytest.raises(ValueError, match="sinks must have shape"):
        plan.run(q, k_cache, v_cache, sinks=sinks[:2])
    with pytest.raises(ValueError, match="out must have shape"):
        plan.run(q, k_cache, v_cache, sinks=sinks, out=torch.empty(3, 6, 16))
    with pytest.raises(ValueError, match="make a plan"):  # no sinks: another selection request
        plan.run(q, k_cache, v_cache)
    with pytest.raises(ValueError, match="make a plan"):  # rows the plan's tables do not describe
        plan.run(torch.cat([q, q[:1]]), k_cache, v_cache, sinks=sinks)
    # the same request through a copy at another address: checked in full, then served
    moved = q.clone()
    assert torch.equal(plan.run(moved, k_cache, v_cache, sinks=sinks), mha_extend_with_kvcache(**inputs))


def test_a_strided_cache_view_is_a_layout_of_its_own():
    """A plan made on contiguous caches refuses a strided view of another cache (the request's
    ``strided_kv``), and a plan made on the strided view serves it as the call does."""
    inputs = _layers(1)[0]
    plan = _plan(inputs)
    k_cache, v_cache = cases.lay_out_caches(inputs["k_cache"], inputs["v_cache"], "hnd")
    strided = {**inputs, "k_cache": k_cache, "v_cache": v_cache}
    with pytest.raises(ValueError, match="make a plan"):
        _run(plan, strided)
    assert torch.equal(_run(_plan(strided), strided), mha_extend_with_kvcache(**strided))


def test_debug_mode_checks_the_tables_on_every_run(debug):
    """TOKENSPEED_KERNEL_DEBUG: a run takes the functional path, whose value checks read the
    tables (rewritten in place between runs, as an engine would)."""
    inputs = _layers(1)[0]
    plan = _plan(inputs)
    assert torch.equal(_run(plan, inputs), mha_extend_with_kvcache(**inputs))
    inputs["cu_seqlens_q"][-1] += 1  # the plan's own table, now past total_q
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        _run(plan, inputs)


def test_override_names_the_plans_kernel(temp_kernels):
    fn = temp_kernels(
        "attention.extend", name="fake_extend", priority=1, vendors=("cpu",), features={"sinks", "sliding_window"}
    )
    inputs = _layers(1)[0]
    assert _plan(inputs, override="torch_extend").kernel == "torch_extend"
    plan = _plan(inputs, override="fake_extend")
    _run(plan, inputs)
    assert plan.kernel == "fake_extend" and last_kernel() == "fake_extend" and len(fn.calls) == 1
    assert fn.calls[0].page_table is inputs["page_table"] and fn.calls[0].max_seqlen_q == 9


# --- mha_prefill_plan: another layout ---------------------------------------------------


def test_a_prefill_plan_checks_or_refuses_another_layout():
    inputs = _layers(1, PREFILL, PREFILL_LAYER)[0]
    plan = mha_prefill_plan(**{**inputs, "return_lse": True})
    q, k, v, sinks = (inputs[name] for name in PREFILL_LAYER)
    out, lse = plan.run(q, k, v, sinks=sinks)
    want_out, want_lse = mha_prefill(**{**inputs, "return_lse": True})
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="v must be contiguous"):
        plan.run(q, k, v[:, :2], sinks=sinks)
    # a row past the lengths' keys: checked in full, the same selection: served as the call
    k2, v2 = torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
    got, _ = plan.run(q, k2, v2, sinks=sinks)
    assert torch.equal(got, mha_prefill(**{**inputs, "k": k2, "v": v2}))
    with pytest.raises(ValueError, match="make a plan"):  # no sinks
        plan.run(q, k, v)
    with pytest.raises(TypeError, match="q must have dtype"):
        mha_prefill_plan(**{**inputs, "q": q.double()})


# --- mha_decode_step_plan ------------------------------------------------------------------

# 3 sequences of awkward lengths on pages of 4, 4 q / 2 KV heads, window 4, sinks; q_len 1 and 3
DECODE = cases.AttentionCase(
    "attention.decode", (1, 1, 1), (10, 7, 3), 4, 2, 16, page_size=4, dtype=torch.float32, window_left=4, sinks=True
)
DECODE_SPEC = dataclasses.replace(DECODE, seqlens_q=(3, 3, 3), return_lse=True)


@pytest.mark.parametrize("case", [DECODE, DECODE_SPEC], ids=["q_len1", "q_len3_lse"])
def test_a_decode_step_plan_runs_every_layer_as_the_call(case):
    """Every layer its own q, caches and sinks over one step's tables (the eager decode an
    engine runs between its CUDA graphs), as ``mha_decode_with_kvcache`` and float64 say."""
    layers = _layers(3, case, PER_LAYER)
    plan = mha_decode_step_plan(**layers[0])
    assert isinstance(plan, DecodeStepPlan) and plan.kernel == "torch_decode"
    assert (plan.batch, plan.q_len, plan.page_size) == (3, case.seqlens_q[0], 4)
    for inputs in layers:
        out = torch.full_like(inputs["q"], math.nan)
        got = plan.run(inputs["q"], inputs["k_cache"], inputs["v_cache"], sinks=inputs["sinks"], out=out)
        want = mha_decode_with_kvcache(**inputs)
        pairs = list(zip(got, want)) if case.return_lse else [(got, want)]
        assert pairs[0][0] is out and last_kernel() == "torch_decode"
        for a, b in pairs:
            assert torch.equal(a, b)
        ref, _ = cases.reference(case, inputs)
        torch.testing.assert_close(pairs[0][0].double(), ref, rtol=1e-5, atol=1e-5)


def test_a_decode_step_plan_refuses_another_batch_and_asks_the_step_runner_once(temp_kernels):
    """Another batch fails the call's own checks, no sinks asks for another selection; a
    kernel's ``step_runner`` is asked once (the first run's arguments) and serves every run,
    its ``bind`` hook (``DecodePlan``'s contract: the plan's own caches) is never called."""
    bound, asked, runs = [], [], []
    fn = temp_kernels(
        "attention.decode", name="t_decode_bind", priority=1, vendors=("cpu",),
        features={"sinks", "sliding_window"}, bind=lambda args: bound.append(args) or (lambda a: None),
        step_runner=lambda args: asked.append(args) or runs.append,
    )  # fmt: skip
    layers = _layers(2, DECODE, PER_LAYER)
    plan = mha_decode_step_plan(**layers[0], override="t_decode_bind")
    for inputs in layers:
        plan.run(inputs["q"], inputs["k_cache"], inputs["v_cache"], sinks=inputs["sinks"])
    assert bound == [] and fn.calls == [] and len(asked) == 1 and len(runs) == 2
    assert runs[1].k_cache is layers[1]["k_cache"] and runs[1].q.shape == (3, 1, 4, 16)
    q = layers[0]["q"]
    with pytest.raises(ValueError, match=r"page_table must have shape \[2, \*\]"):  # the call's own check
        plan.run(q[:2], layers[0]["k_cache"], layers[0]["v_cache"], sinks=layers[0]["sinks"])
    with pytest.raises(ValueError, match="make a plan"):  # no sinks: another selection
        plan.run(q, layers[0]["k_cache"], layers[0]["v_cache"])


def test_a_plan_made_with_an_unkeyed_argument_checks_every_run_in_full():
    """Sinks given as a ``torch.nn.Parameter`` (a tensor subclass no call key stands for): the
    plan has no layout to compare, so every run is the functional call, checked in full (a
    float64 q raises as the call does; before, such a plan let it through unchecked), and a
    good run gives the call's result."""
    inputs = _layers(1)[0]
    sinks = torch.nn.Parameter(inputs["sinks"].clone(), requires_grad=False)
    plan = _plan(inputs, sinks=sinks)
    q, k_cache, v_cache = (inputs[name] for name in PER_LAYER[:3])
    with pytest.raises(TypeError, match="q must have dtype"):
        plan.run(q.double(), k_cache, v_cache, sinks=sinks)
    with pytest.raises(ValueError, match="make a plan"):
        plan.run(torch.cat([q, q[:1]]), k_cache, v_cache, sinks=sinks)
    assert torch.equal(plan.run(q, k_cache, v_cache, sinks=sinks), mha_extend_with_kvcache(**inputs))


@pytest.mark.parametrize(
    "change",
    ["dtype", "shape", "stride", "offset", "device_type", "sinks_none", "scale_type", "scale_value", "subclass"],
)
def test_the_quick_layout_check_reads_what_the_call_key_reads(change):
    """``_same_layout`` (the quick runs' check) agrees with comparing ``arg_key``s: equal for
    the plan's own layer at another address, unequal for each thing the key reads."""
    from tokenspeed_kernel.ops.attention.step_plan import _layout, _same_layout

    q = torch.randn(6, 4, 8)
    k = torch.randn(3, 4, 2, 8)
    layer = (q, k, k.clone(), torch.randn(4), 0.5, None)
    layout = _layout(layer)
    moved = (q.clone(), k.clone(), k.clone(), torch.randn(4), 0.5, None)
    assert _same_layout(moved, layout) and _layout(moved) == layout
    storage = torch.randn(2 * q.numel())
    other = {
        "dtype": (q.double(), *layer[1:]),
        "shape": (q[:5], *layer[1:]),
        "stride": (q.transpose(0, 1).contiguous().transpose(0, 1), *layer[1:]),
        "offset": (storage[1 : 1 + q.numel()].view(q.shape), *layer[1:]),
        "device_type": (q.to("meta"), *layer[1:]),
        "sinks_none": (*layer[:3], None, *layer[4:]),
        "scale_type": (*layer[:4], 1, None),
        "scale_value": (*layer[:4], 0.25, None),
        "subclass": (torch.nn.Parameter(q.clone(), requires_grad=False), *layer[1:]),
    }[change]
    assert not _same_layout(other, layout)
    key = _layout(other)
    assert key is None or key != layout, "the call key tells it too"
