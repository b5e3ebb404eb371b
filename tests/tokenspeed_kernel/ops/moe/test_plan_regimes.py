"""moe_plan token-count regimes: one selection per bucket, merged ranges, each kernel prepared
once, MoEPlan.apply running the kernel of the call's token count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenspeed_kernel import last_kernel, moe_apply, moe_plan, registry
from tokenspeed_kernel.operators import operator_schema
from tokenspeed_kernel.ops.moe import plan as plan_module
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.selector import NoKernelFoundError
from tokenspeed_kernel.tools.cases import moe as cases

REFERENCE = "torch_moe"
SMALL, LARGE = "test_regime_small", "test_regime_large"
FEATURES = operator_schema("moe.apply").features


@pytest.fixture
def two_regimes():
    """SMALL serves T <= 8 and outranks LARGE, which serves any T; both have a prepare hook
    and run the reference kernel. Records hook calls and which kernel ran with what."""
    calls = {"prepare": [], "run": []}

    def make(name: str):
        def prepare(*, w13, w2, w13_bias, w2_bias, expert_map):
            calls["prepare"].append(name)
            return name

        def kernel(args):
            calls["run"].append((name, args.prepared, args.x.shape[0]))
            registry.get_kernel(REFERENCE).fn(args)

        return prepare, kernel

    def small_only(request):
        bucket = request.shape("num_tokens_bucket")
        return None if bucket is None or bucket <= 8 else f"num_tokens_bucket={bucket} > 8"

    for name, priority, predicate in ((SMALL, Priority.PLUGIN + 2, small_only), (LARGE, Priority.PLUGIN + 1, None)):
        prepare, kernel = make(name)
        registry.register_kernel(
            "moe.apply",
            name=name,
            solution="test",
            vendors=("cpu",),
            features=FEATURES,
            priority=priority,
            predicate=predicate,
            prepare=prepare,
        )(kernel)
    yield calls
    registry.unregister_kernel(SMALL)
    registry.unregister_kernel(LARGE)


CASE = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, bias=True)


def _plan(**kw):
    d = cases.make_inputs(CASE, seed=0)
    weights = {k: d[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
    return moe_plan(**weights, x_dtype=torch.float32, top_k=2, activation="silu", **kw), weights


def test_plan_has_a_small_and_a_large_regime_each_prepared_once(two_regimes) -> None:
    plan, _ = _plan()
    assert [(r.max_tokens, r.spec.name, r.prepared) for r in plan.regimes] == [(8, SMALL, SMALL), (None, LARGE, LARGE)]
    assert sorted(two_regimes["prepare"]) == [LARGE, SMALL]
    assert plan.kernel == LARGE and plan.prepared == LARGE  # the large-T regime names the plan
    assert plan.regimes[0].request.shape("num_tokens_bucket") == 8
    assert [plan.kernel_for(t) for t in (0, 1, 8, 9, 4096, 10**6)] == [SMALL, SMALL, SMALL, LARGE, LARGE, LARGE]


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 33])
def test_apply_runs_the_regime_kernel_with_its_prepared_weights(two_regimes, num_tokens: int) -> None:
    plan, weights = _plan()
    step = cases.make_inputs(dataclasses.replace(CASE, num_tokens=num_tokens), seed=num_tokens)
    got = plan.apply(step["x"], step["topk_weights"], step["topk_ids"])
    want = moe_apply(
        step["x"],
        **weights,
        topk_weights=step["topk_weights"],
        topk_ids=step["topk_ids"],
        activation="silu",
        override=REFERENCE,
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    expected = SMALL if num_tokens <= 8 else LARGE
    assert two_regimes["run"] == [(expected, expected, num_tokens)]
    plan.apply(step["x"], step["topk_weights"], step["topk_ids"])
    assert last_kernel() == expected and two_regimes["run"][-1][0] == expected
    # The functional call at the same T picks the same kernel.
    moe_apply(step["x"], **weights, topk_weights=step["topk_weights"], topk_ids=step["topk_ids"], activation="silu")
    assert two_regimes["run"][-1][0] == expected


def test_override_gives_one_regime(two_regimes) -> None:
    plan, _ = _plan(override=SMALL)
    assert [(r.max_tokens, r.spec.name) for r in plan.regimes] == [(None, SMALL)]
    assert plan.kernel == SMALL and plan.kernel_for(1) == plan.kernel_for(1000) == SMALL
    assert two_regimes["prepare"] == [SMALL]


def test_a_bucket_nothing_serves_falls_back_to_the_unbucketed_choice(two_regimes, monkeypatch) -> None:
    real = plan_module.select

    def select(request, platform=None, override=None):
        if request.shape("num_tokens_bucket") == 16:
            raise NoKernelFoundError.__new__(NoKernelFoundError)
        return real(request, platform, override)

    monkeypatch.setattr(plan_module, "select", select)
    plan, _ = _plan()
    # Unbucketed, SMALL's predicate passes (no bucket): bucket 16 falls back to SMALL and
    # joins the first range.
    assert [(r.max_tokens, r.spec.name) for r in plan.regimes] == [(16, SMALL), (None, LARGE)]
