"""The MoE operators under torch.compile (through the tokenspeed_kernel custom ops) equal eager."""

import pytest
import torch

from tokenspeed_kernel import moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.ops.moe import _custom_ops
from tokenspeed_kernel.tools.cases import moe as cases

APPLY = "torch_moe"
TOPK = "torch_moe_topk"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_custom_ops_are_registered():
    for name in ("moe_topk", "moe_apply", "moe_plan_apply"):
        assert hasattr(torch.ops.tokenspeed_kernel, name), name


def test_opcheck_moe_topk():
    logits = torch.randn(5, 8)
    torch.library.opcheck(torch.ops.tokenspeed_kernel.moe_topk.default, (logits, 2, "softmax", True, TOPK))


@pytest.mark.parametrize("weight_format", ["plain", "mxfp4", "fp8_block"])
def test_opcheck_moe_apply(weight_format):
    hidden = 256 if weight_format == "fp8_block" else 64
    case = cases.MoECase("moe.apply", 5, hidden, 32, 8, 2, torch.float32, weight_format=weight_format, bias=True)
    d = cases.make_inputs(case, seed=1)
    a13, b13, fmt = _custom_ops.flatten_weight(d["w13"])
    a2, b2, _ = _custom_ops.flatten_weight(d["w2"])
    args = (
        x := d["x"],
        a13,
        b13,
        a2,
        b2,
        fmt,
        d["topk_weights"],
        d["topk_ids"],
        "silu",
        d["w13_bias"],
        d["w2_bias"],
        None,
        APPLY,
    )
    # opcheck's schema test multiplies inputs, which CPU torch cannot do for float8 tensors.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if fmt.startswith("fp8") else "ALL"
    torch.library.opcheck(torch.ops.tokenspeed_kernel.moe_apply.default, args, test_utils=utils)
    assert x.shape == (5, hidden)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_compiled_moe_topk_equals_eager(scoring):
    logits = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))

    def fn(lg):
        w, ids = moe_topk(lg, 4, scoring=scoring, override=TOPK)
        return w * 2, ids

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got_w, got_ids = compiled(logits)
    want_w, want_ids = fn(logits)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)


@pytest.mark.parametrize(
    "case",
    [
        cases.MoECase("moe.apply", 6, 64, 32, 8, 2, torch.float32, bias=True),
        cases.MoECase(
            "moe.apply",
            5,
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
        cases.MoECase("moe.apply", 3, 64, 32, 8, 2, torch.float16, weight_format="fp8_per_channel", activation="gelu"),
    ],
    ids=lambda c: c.describe(),
)
def test_compiled_moe_apply_equals_eager(case):
    d = cases.make_inputs(case, seed=2)

    def fn(x, topk_weights, topk_ids):
        y = moe_apply(
            x,
            d["w13"],
            d["w2"],
            topk_weights,
            topk_ids,
            activation=case.activation,
            w13_bias=d["w13_bias"],
            w2_bias=d["w2_bias"],
            expert_map=d["expert_map"],
            override=APPLY,
        )
        return y + 1

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = compiled(d["x"], d["topk_weights"], d["topk_ids"])
    assert torch.equal(got, fn(d["x"], d["topk_weights"], d["topk_ids"]))


def test_compiled_moe_apply_with_out_and_topk_pipeline():
    case = cases.MoECase("moe.apply", 4, 64, 32, 8, 2, torch.float32)
    d = cases.make_inputs(case, seed=3)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))

    def fn(x, lg, out):
        w, ids = moe_topk(lg, 2, override=TOPK)
        return moe_apply(x, d["w13"], d["w2"], w, ids, out=out, override=APPLY)

    out_c = torch.full_like(d["x"], float("nan"))
    out_e = torch.full_like(d["x"], float("nan"))
    got = torch.compile(fn, backend="aot_eager")(d["x"], logits, out_c)
    want = fn(d["x"], logits, out_e)
    assert torch.equal(got, want) and torch.equal(out_c, want)


def test_compiled_plan_apply_equals_eager():
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.bfloat16, weight_format="mxfp4", bias=True)
    d = cases.make_inputs(case, seed=4)
    plan = moe_plan(
        d["w13"], d["w2"], x_dtype=torch.bfloat16, top_k=2, w13_bias=d["w13_bias"], w2_bias=d["w2_bias"], override=APPLY
    )

    def fn(x, topk_weights, topk_ids):
        return plan.apply(x, topk_weights, topk_ids)

    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(d["x"], d["topk_weights"], d["topk_ids"])
    assert torch.equal(got, fn(d["x"], d["topk_weights"], d["topk_ids"]))
