"""moe_plan: selects once, calls the kernel's prepare hook once, and plan.apply equals moe_apply."""

import dataclasses
import json

import pytest
import torch

from tokenspeed_kernel import MoEPlan, moe_apply, moe_plan, moe_topk, registry
from tokenspeed_kernel.operators import operator_schema
from tokenspeed_kernel.ops.moe import api
from tokenspeed_kernel.ops.moe import plan as plan_module
from tokenspeed_kernel.tools.cases import moe as cases

APPLY = "torch_moe"
PREPARED_KERNEL = "test_moe_with_prepare"
ALL_FEATURES = operator_schema("moe.apply").features


@dataclasses.dataclass
class _Prepared:
    """What the test kernel's prepare hook makes: transposed dense copies of the weights."""

    w13_t: torch.Tensor
    w2_t: torch.Tensor


@pytest.fixture
def prepared_kernel():
    """A kernel with a ``prepare`` hook, counting its calls; unregistered afterwards."""
    calls = {"prepare": 0, "run": []}

    def prepare(*, w13, w2, w13_bias, w2_bias, expert_map):
        calls["prepare"] += 1
        calls["prepare_kwargs"] = {"w13_bias": w13_bias, "w2_bias": w2_bias, "expert_map": expert_map}
        return _Prepared(w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous())

    def kernel(args):
        calls["run"].append(args.prepared)
        reference = registry.get_kernel(APPLY).fn
        if args.prepared is not None:  # run on the prepared (transposed back) weights
            args = dataclasses.replace(
                args, w13=args.prepared.w13_t.transpose(1, 2), w2=args.prepared.w2_t.transpose(1, 2)
            )
        reference(args)

    registry.register_kernel(
        "moe.apply",
        name=PREPARED_KERNEL,
        solution="test",
        vendors=("cpu",),
        features=ALL_FEATURES,
        prepare=prepare,
    )(kernel)
    yield calls
    registry.unregister_kernel(PREPARED_KERNEL)


@pytest.fixture
def count_dispatch(monkeypatch):
    """Counts kernel selections made by moe_plan (``plan``) and by moe_apply (``api``)."""
    counts = {"plan": 0, "api": 0}

    def wrap(module, attr, key):
        original = getattr(module, attr)

        def counted(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)

    wrap(plan_module, "select", "plan")
    wrap(api, "dispatch", "api")
    return counts


def _inputs(case, seed):
    d = cases.make_inputs(case, seed=seed)
    weights = {k: d[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
    return d, weights


def test_plan_selects_once_and_prepares_once(prepared_kernel, count_dispatch):
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, bias=True, expert_map=True)
    d, weights = _inputs(case, 0)
    plan = moe_plan(**weights, x_dtype=torch.float32, top_k=2, activation="silu", override=PREPARED_KERNEL)
    assert isinstance(plan, MoEPlan) and plan.kernel == PREPARED_KERNEL and plan.spec.name == PREPARED_KERNEL
    assert prepared_kernel["prepare"] == 1 and isinstance(plan.prepared, _Prepared)
    assert prepared_kernel["prepare_kwargs"]["expert_map"] is d["expert_map"]
    assert plan.request.shape("num_tokens_bucket") is None
    assert {"silu", "bias", "expert_map"} <= plan.request.features
    for num_tokens, seed in ((5, 0), (1, 1), (17, 2)):
        step = cases.make_inputs(dataclasses.replace(case, num_tokens=num_tokens), seed=seed)
        got = plan.apply(step["x"], step["topk_weights"], step["topk_ids"])
        want = moe_apply(
            step["x"], **weights, topk_weights=step["topk_weights"], topk_ids=step["topk_ids"], override=APPLY
        )
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert prepared_kernel["prepare"] == 1
    assert count_dispatch["plan"] == 1
    assert count_dispatch["api"] == 3  # only the functional comparisons dispatched
    assert len(prepared_kernel["run"]) == 3 and all(p is plan.prepared for p in prepared_kernel["run"])


def test_functional_path_passes_no_prepared(prepared_kernel):
    case = cases.MoECase("moe.apply", 3, 64, 32, 8, 2, torch.float32)
    d, _ = _inputs(case, 3)
    moe_apply(**d, override=PREPARED_KERNEL)
    assert prepared_kernel["run"] == [None] and prepared_kernel["prepare"] == 0


@pytest.mark.parametrize(
    "case",
    [
        cases.MoECase(
            "moe.apply",
            9,
            64,
            32,
            8,
            2,
            torch.bfloat16,
            weight_format="mxfp4",
            activation="swiglu_oai",
            bias=True,
            expert_map=True,
        ),
        cases.MoECase("moe.apply", 4, 64, 32, 8, 2, torch.float16, weight_format="fp8_per_channel", activation="gelu"),
        cases.MoECase("moe.apply", 6, 64, 32, 8, 3, torch.float32),
    ],
    ids=lambda c: c.describe(),
)
def test_plan_apply_equals_moe_apply_with_reference(case):
    d, weights = _inputs(case, 5)
    plan = moe_plan(**weights, x_dtype=case.dtype, top_k=case.top_k, activation=case.activation, override=APPLY)
    assert plan.kernel == APPLY and plan.prepared is None  # the reference kernel has no hook
    out = torch.full_like(d["x"], float("nan"))
    got = plan.apply(d["x"], d["topk_weights"], d["topk_ids"], out=out)
    assert got is out
    assert torch.equal(got, moe_apply(**d, override=APPLY))


def test_plan_is_frozen_and_validates_calls():
    case = cases.MoECase("moe.apply", 4, 64, 32, 8, 2, torch.float32)
    d, weights = _inputs(case, 6)
    plan = moe_plan(**weights, x_dtype=torch.float32, top_k=2, override=APPLY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kernel = "other"
    with pytest.raises(TypeError, match="plan's dtype"):
        plan.apply(d["x"].half(), d["topk_weights"], d["topk_ids"])
    with pytest.raises(ValueError, match="plan's top_k"):
        plan.apply(d["x"], d["topk_weights"][:, :1].contiguous(), d["topk_ids"][:, :1].contiguous())
    with pytest.raises(ValueError, match="x must have shape"):
        plan.apply(d["x"][:, :32].contiguous(), d["topk_weights"], d["topk_ids"])
    with pytest.raises(ValueError, match="out must have shape"):
        plan.apply(d["x"], d["topk_weights"], d["topk_ids"], out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="x is on meta"):
        plan.apply(torch.empty(4, 64, device="meta"), d["topk_weights"], d["topk_ids"])
    empty = plan.apply(d["x"][:0], d["topk_weights"][:0], d["topk_ids"][:0])
    assert empty.shape == (0, 64)


def test_capture_records_functional_and_plan_calls(env, tmp_path):
    path = tmp_path / "capture.jsonl"
    env("TOKENSPEED_KERNEL_CAPTURE", str(path))
    case = cases.MoECase("moe.apply", 13, 64, 32, 8, 3, torch.float32, activation="gelu", bias=True, expert_map=True)
    d, weights = _inputs(case, 9)
    moe_apply(**d, override=APPLY)
    plan = moe_plan(**weights, x_dtype=torch.float32, top_k=3, activation="gelu", override=APPLY)
    plan.apply(d["x"][:11].contiguous(), d["topk_weights"][:11].contiguous(), d["topk_ids"][:11].contiguous())
    moe_topk(torch.randn(13, 8), 3, scoring="sigmoid", override="torch_moe_topk")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["op"], r["kernel"], r["signature"]["num_tokens"]) for r in lines] == [
        ("moe.apply", APPLY, 13),
        ("moe.apply", APPLY, 11),
        ("moe.topk", "torch_moe_topk", 13),
    ]
    fields = {f.name for f in dataclasses.fields(cases.MoECase)}
    for r in lines:  # a signature rebuilds the MoECase that replays it
        sig = dict(r["signature"])
        sig.pop("num_local_experts", None)
        assert set(sig) <= fields
        sig["dtype"] = getattr(torch, sig["dtype"])
        sizes = {"hidden": 0, "intermediate": 0} if r["op"] == "moe.topk" else {}
        assert cases.MoECase(op=r["op"], **sizes, **sig).num_experts == 8
    assert lines[0]["signature"]["num_local_experts"] == 4 and lines[0]["signature"]["expert_map"] is True


def test_plan_apply_records_its_kernel_and_refuses_capture_when_not_graph_safe(monkeypatch):
    from tokenspeed_kernel import last_kernel

    case = cases.MoECase("moe.apply", 4, 64, 32, 8, 2, torch.float32)
    d, weights = _inputs(case, 7)
    plan = moe_plan(**weights, x_dtype=case.dtype, top_k=case.top_k, activation=case.activation, override=APPLY)
    plan.apply(d["x"], d["topk_weights"], d["topk_ids"])
    assert last_kernel() == APPLY
    # The reference MoE reads expert counts on the host: under capture it must refuse, not launch.
    assert registry.get_kernel(APPLY).graph_safe is False
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="not graph-safe"):
        plan.apply(d["x"], d["topk_weights"], d["topk_ids"])


BOUND_KERNEL = "test_moe_with_bind"


@pytest.fixture
def bound_kernel():
    """A kernel with a ``bind`` hook that declines 3-token calls; counts binds and runs."""
    events = []
    reference = registry.get_kernel(APPLY).fn

    def bind(args):
        count = args.x.shape[0]
        events.append(("bind", count))
        if count == 3:
            return None

        def run(a):
            assert a.x.shape[0] == count
            events.append(("run", count))
            reference(a)

        return run

    def kernel(args):
        events.append(("fn", args.x.shape[0]))
        reference(args)

    registry.register_kernel(
        "moe.apply", name=BOUND_KERNEL, solution="test", vendors=("cpu",), features=ALL_FEATURES, bind=bind
    )(kernel)
    yield events
    registry.unregister_kernel(BOUND_KERNEL)


def test_plan_binds_once_per_token_count(bound_kernel, monkeypatch):
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, bias=True, expert_map=True)
    d, weights = _inputs(case, 0)
    plan = moe_plan(**weights, x_dtype=torch.float32, top_k=2, activation="silu", override=BOUND_KERNEL)
    for num_tokens, seed in ((5, 0), (5, 1), (3, 2), (3, 3), (2, 4), (5, 5)):
        step = cases.make_inputs(dataclasses.replace(case, num_tokens=num_tokens), seed=seed)
        out = torch.full_like(step["x"], float("nan"))
        got = plan.apply(step["x"], step["topk_weights"], step["topk_ids"], out=out)
        want = moe_apply(
            step["x"], **weights, topk_weights=step["topk_weights"], topk_ids=step["topk_ids"], override=APPLY
        )
        assert got is out
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert bound_kernel == [
        ("bind", 5),
        ("run", 5),
        ("run", 5),
        ("bind", 3),
        ("fn", 3),
        ("fn", 3),
        ("bind", 2),
        ("run", 2),
        ("run", 5),
    ]
    assert set(plan.runners) == {5, 3, 2} and plan.runners[3] is None
    bound_kernel.clear()
    moe_apply(**d, override=BOUND_KERNEL)  # the functional path never binds
    assert bound_kernel == [("fn", 5)]


def test_plan_does_not_bind_while_capturing_or_past_the_limit(bound_kernel, monkeypatch):
    case = cases.MoECase("moe.apply", 4, 64, 32, 8, 2, torch.float32)
    d, weights = _inputs(case, 1)
    plan = moe_plan(**weights, x_dtype=torch.float32, top_k=2, override=BOUND_KERNEL)
    monkeypatch.setattr(plan_module, "is_capturing", lambda: True)
    plan.apply(d["x"], d["topk_weights"], d["topk_ids"])
    assert bound_kernel == [("fn", 4)] and plan.runners == {}  # binds later, eagerly
    monkeypatch.setattr(plan_module, "is_capturing", lambda: False)
    monkeypatch.setattr(plan_module, "BIND_MAX_COUNTS", 0)
    plan.apply(d["x"], d["topk_weights"], d["topk_ids"])
    assert bound_kernel == [("fn", 4), ("fn", 4)] and plan.runners == {}
    monkeypatch.setattr(plan_module, "BIND_MAX_COUNTS", 1)
    plan.apply(d["x"], d["topk_weights"], d["topk_ids"])
    plan.apply(d["x"], d["topk_weights"], d["topk_ids"])
    assert bound_kernel[2:] == [("bind", 4), ("run", 4), ("run", 4)] and set(plan.runners) == {4}
