"""The Operator objects (ops/_operator.py): one per operator, each complete, one call path."""

import dataclasses

import pytest
import torch

from tokenspeed_kernel import store_kvcache
from tokenspeed_kernel.operators import OPERATORS
from tokenspeed_kernel.ops import _checks
from tokenspeed_kernel.ops._operator import Operator, Plan, operator, operators
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools.cases import attention as cases

pytestmark = pytest.mark.usefixtures("only_reference")


# Operators migrated to the Operator object so far (all of OPERATORS once issue 28 section 2 is done).
DEFINED = [op.name for op in operators()]


def test_every_operator_is_defined_once_and_in_schema_order():
    assert DEFINED == [name for name in OPERATORS if name in DEFINED]
    for op in operators():
        assert operator(op.name) is op and op.schema is OPERATORS[op.name]


@pytest.mark.parametrize("name", DEFINED)
def test_an_operator_names_its_args_reference_kernel_custom_op_and_plan(name):
    op = operator(name)
    assert dataclasses.is_dataclass(op.args)
    reference = op.reference_kernel()
    assert reference.op == name and Priority.band(reference.priority) == Priority.REFERENCE
    assert hasattr(torch.ops.tokenspeed_kernel, op.custom_op)
    assert issubclass(op.plan, Plan)
    for method in ("key", "check", "run", "trace"):
        assert getattr(op.plan, method) is not getattr(Plan, method, None), f"{op.plan.__name__}.{method}"


def test_unknown_and_duplicate_operators_are_refused():
    with pytest.raises(ValueError, match="unknown operator 'attention.prefil'"):
        operator("attention.prefil")
    with pytest.raises(ValueError, match="known operators: attention.prefill"):
        Operator("attention.prefil", object, "x", "x", Plan)
    store = operator("kvcache.store")
    with pytest.raises(ValueError, match="operator 'kvcache.store' is defined twice"):
        Operator("kvcache.store", store.args, store.reference, store.custom_op, store.plan)


def test_a_call_is_checked_once_per_key_then_served_by_its_plan():
    store = operator("kvcache.store")
    checks = []
    real = store.plan.check

    def counted(*args):
        checks.append(args[0])
        return real(*args)

    # The call path uses the hook the Operator took from its plan class: swap that one.
    object.__setattr__(store, "_check", counted)
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
        object.__setattr__(store, "_check", real)
        _checks.clear_call_tables()
