"""The Operator objects (ops/_operator.py): one per operator, each complete, one call path."""

import dataclasses
import gc
import inspect
import weakref

import pytest
import torch

import tokenspeed_kernel
from tokenspeed_kernel import store_kvcache
from tokenspeed_kernel.operators import OPERATORS
from tokenspeed_kernel.ops import _checks, _operator
from tokenspeed_kernel.ops._operator import Operator, Plan, operator, operators
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools.cases import attention as cases

pytestmark = pytest.mark.usefixtures("only_reference")


def test_every_operator_is_defined_once_and_in_schema_order():
    assert [op.name for op in operators()] == list(OPERATORS)
    for op in operators():
        assert operator(op.name) is op and op.schema is OPERATORS[op.name]


@pytest.mark.parametrize("name", list(OPERATORS))
def test_an_operator_names_its_args_reference_kernel_custom_op_and_plan(name):
    op = operator(name)
    assert dataclasses.is_dataclass(op.args)
    reference = op.reference_kernel()
    assert reference.op == name and Priority.band(reference.priority) == Priority.REFERENCE
    assert hasattr(torch.ops.tokenspeed_kernel, op.custom_op) == op.traceable
    assert issubclass(op.plan, Plan)
    for method in ("key", "check", "run", "trace"):
        assert getattr(op.plan, method) is not getattr(Plan, method, None), f"{op.plan.__name__}.{method}"
    if not op.traceable:  # no custom op: tracing raises, saying why
        with pytest.raises(RuntimeError, match="cannot be traced by torch.compile"):
            op.plan.trace(object.__new__(op.plan))


def test_only_the_expert_parallel_exchange_is_not_traceable():
    assert {op.name for op in operators() if not op.traceable} == {"moe.dispatch", "moe.combine"}


@pytest.mark.parametrize("name", list(OPERATORS))
def test_the_public_function_forwards_its_parameters_in_order_to_the_plan(name):
    """The call path passes the public arguments positionally: key, run and the public
    function must list the same parameters in the same order."""
    op = operator(name)
    public = getattr(tokenspeed_kernel, op.custom_op)
    params = list(inspect.signature(public).parameters)
    assert list(inspect.signature(op.plan.key).parameters) == params
    assert list(inspect.signature(op.plan.run).parameters)[1:] == params  # after self


def test_moe_plan_apply_forwards_the_plan_then_its_parameters():
    from tokenspeed_kernel.ops.moe.plan import MoEPlan, PlanApplyCall

    apply = ["plan", *list(inspect.signature(MoEPlan.apply).parameters)[1:]]
    assert list(inspect.signature(PlanApplyCall.key).parameters) == apply
    assert list(inspect.signature(PlanApplyCall.run).parameters)[1:] == apply


def test_unknown_and_duplicate_operators_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown operator 'attention.prefil'"):
        operator("attention.prefil")
    with pytest.raises(ValueError, match="known operators: attention.prefill"):
        Operator("attention.prefil", object, "x", "x", Plan)
    store = operator("kvcache.store")
    with pytest.raises(ValueError, match="operator 'kvcache.store' is defined twice"):
        Operator("kvcache.store", store.args, store.reference, store.custom_op, store.plan)
    # Each operator names a custom op that exists.
    monkeypatch.delitem(_operator._BY_NAME, "kvcache.store")
    with pytest.raises(ValueError, match=r"no custom op torch.ops.tokenspeed_kernel.store_kv is defined"):
        Operator("kvcache.store", store.args, store.reference, "store_kv", store.plan)


def test_a_call_is_checked_once_per_key_then_served_by_its_plan(monkeypatch):
    store = operator("kvcache.store")
    checks = []
    real = store.plan.check

    def counted(*args):
        checks.append(args[0])
        return real(*args)

    # The call path uses the hook the Operator took from its plan class: swap that one.
    monkeypatch.setattr(store, "_check", counted)
    try:
        _checks.clear_call_tables()
        case = cases.awkward_cases("kvcache.store", torch.float32)[0]
        inputs = cases.make_inputs(case)
        for _ in range(3):
            cases.call(case, inputs)
        assert checks == [False] and len(store.plans) == 1
        (plan,) = store.plans.values()
        assert isinstance(plan, store.plan) and plan.request.op == "kvcache.store"
        # Not remembered: a call whose key cannot be built is checked in full every time.
        param = torch.nn.Parameter(inputs["k"].clone(), requires_grad=False)
        args = [inputs[k] for k in ("v", "k_cache", "v_cache", "slot_mapping")]
        store_kvcache(param, *args)
        store_kvcache(param, *args)
        assert checks == [False, False, False] and len(store.plans) == 1
    finally:
        _checks.clear_call_tables()


def test_user_held_plans_run_the_operators_plans_and_keep_nothing_alive():
    from tokenspeed_kernel import mha_decode_plan, moe_plan
    from tokenspeed_kernel.ops.attention.api import DecodeCall
    from tokenspeed_kernel.ops.moe import plan as moe_plan_module
    from tokenspeed_kernel.tools.cases import moe as moe_cases

    case = moe_cases.MoECase("moe.apply", 3, 64, 32, 8, 2, torch.float32)
    d = moe_cases.make_inputs(case, seed=0)
    plan = moe_plan(d["w13"], d["w2"], x_dtype=torch.float32, top_k=2)
    calls = moe_plan_module._PLAN_APPLY.plans
    calls.clear()
    plan.apply(d["x"], d["topk_weights"], d["topk_ids"])
    (call,) = calls.values()
    assert isinstance(call, moe_plan_module.PlanApplyCall) and call.num_tokens == 3
    ref = weakref.ref(plan)
    del plan
    gc.collect()
    assert ref() is None, "the plan cache must not keep a MoEPlan (or its prepared weights) alive"

    decode = cases.AttentionCase("attention.decode", (1, 1), (10, 7), 4, 2, 16, page_size=4, dtype=torch.float32)
    inputs = cases.make_inputs(decode)
    args = {k: inputs[k] for k in ("k_cache", "v_cache", "page_table", "cache_seqlens")}
    dplan = mha_decode_plan(**args, max_seqlen_k=inputs["max_seqlen_k"], num_q_heads=4)
    assert isinstance(dplan._call4, DecodeCall) and dplan._call4.request is dplan.request
    torch.testing.assert_close(dplan.run(inputs["q"]), cases.call(decode, inputs), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("q_len", [1, 3])
def test_a_decode_plan_traces_its_decode_call_under_torch_compile(q_len):
    """DecodePlan.run under torch.compile goes through DecodeCall.trace (the decode custom op,
    the plan's kernel as override): one graph, the eager result."""
    from tokenspeed_kernel import mha_decode_plan

    decode = cases.AttentionCase(
        "attention.decode", (q_len, q_len), (10, 7), 4, 2, 16, page_size=4, dtype=torch.float32
    )
    inputs = cases.make_inputs(decode)
    args = {k: inputs[k] for k in ("k_cache", "v_cache", "page_table", "cache_seqlens")}
    plan = mha_decode_plan(**args, max_seqlen_k=inputs["max_seqlen_k"], num_q_heads=4, q_len=q_len, return_lse=True)
    want_out, want_lse = plan.run(inputs["q"])
    torch._dynamo.reset()
    out, lse = torch.compile(lambda q: plan.run(q), backend="eager", fullgraph=True)(inputs["q"])
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
