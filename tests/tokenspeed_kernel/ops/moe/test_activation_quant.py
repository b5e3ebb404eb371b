"""``moe_apply(..., activation_quant="mxfp8")``: the reference against an independent float64
computation (tests/support/naive_moe.py, its own MXFP8 rounding), the plan path, argument
validation, the request feature that kernels must declare, and capture/replay."""

import json

import pytest
import torch
from support.naive_moe import naive_fake_mxfp8, naive_moe

from tokenspeed_kernel import config, moe_apply, moe_plan
from tokenspeed_kernel.ops import _dispatch
from tokenspeed_kernel.ops.moe._validate import WeightInfo, apply_request
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.quant import fake_quantize_mxfp8, quantize_mxfp4
from tokenspeed_kernel.selector import KernelOverrideError, explain
from tokenspeed_kernel.tools.capture import read_capture
from tokenspeed_kernel.tools.cases import moe as cases

APPLY = "torch_moe"


def _case(t=9, dtype=torch.bfloat16, **kw):
    base = dict(weight_format="mxfp4", activation="swiglu_oai", bias=True, activation_quant="mxfp8")
    return cases.MoECase("moe.apply", t, 64, 64, 8, 2, dtype, **{**base, **kw})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("expert_map", [False, True])
def test_reference_matches_naive_float64(dtype, expert_map):
    case = _case(dtype=dtype, expert_map=expert_map)
    inputs = cases.make_inputs(case, seed=5)
    assert inputs["activation_quant"] == "mxfp8"
    out = moe_apply(**inputs, override=APPLY)
    expected = naive_moe(**inputs)
    tol = {"atol": 3e-2, "rtol": 1.6e-2} if dtype == torch.bfloat16 else {"atol": 2e-4, "rtol": 2e-4}
    torch.testing.assert_close(out.double(), expected, **tol)
    # the quantization is visible: it differs from the unquantized result beyond rounding
    plain = naive_moe(**{**inputs, "activation_quant": None})
    assert (plain - expected).abs().max() > 2 * tol["atol"]
    # the tools' float64 ground truth quantizes by the same rule
    torch.testing.assert_close(cases.reference(case, inputs)[0], expected, atol=1e-10, rtol=1e-10)


def test_quantizes_x_before_w13_and_the_intermediate_before_w2():
    """One expert, identity-like weights: the output is the double fake-quantization."""
    h = 64
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(0)) * 3
    eye = torch.eye(h)
    w13 = quantize_mxfp4(torch.cat([eye * 4, eye * 4]).unsqueeze(0))  # gate = up = 4 x
    w2 = quantize_mxfp4(eye.unsqueeze(0) * 0.5)
    ids, wts = torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    out = moe_apply(x, w13, w2, wts, ids, activation="silu", activation_quant="mxfp8", override=APPLY)
    xq = naive_fake_mxfp8(x.double())
    a = torch.nn.functional.silu(4 * xq) * (4 * xq)
    torch.testing.assert_close(out.double(), 0.5 * naive_fake_mxfp8(a), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, moe_apply(x, w13, w2, wts, ids, activation="silu", override=APPLY))
    assert torch.equal(fake_quantize_mxfp8(x.double()), xq)


def test_plan_carries_activation_quant():
    case = _case(t=5)
    inputs = cases.make_inputs(case, seed=2)
    plan = moe_plan(
        inputs["w13"],
        inputs["w2"],
        x_dtype=case.dtype,
        top_k=2,
        activation="swiglu_oai",
        w13_bias=inputs["w13_bias"],
        w2_bias=inputs["w2_bias"],
        activation_quant="mxfp8",
        override=APPLY,
    )
    assert plan.activation_quant == "mxfp8" and "mxfp8_act" in plan.request.features
    got = plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"])
    assert torch.equal(got, moe_apply(**inputs, override=APPLY))


@pytest.mark.parametrize(
    "change, exc, match",
    [
        ({"activation_quant": "mxfp4"}, ValueError, "activation_quant must be one of 'mxfp8'"),
        ({"activation_quant": "MXFP8"}, ValueError, "activation_quant must be one of"),
        ({"activation_quant": 8}, TypeError, "activation_quant must be a str or None"),
    ],
)
def test_bad_values_are_rejected(change, exc, match):
    inputs = cases.make_inputs(_case(t=3), seed=0)
    with pytest.raises(exc, match=match):
        moe_apply(**{**inputs, **change}, override=APPLY)


@pytest.mark.parametrize("weight_format", ["plain", "fp8_per_channel"])
def test_needs_mxfp4_weights(weight_format):
    case = cases.MoECase("moe.apply", 3, 64, 32, 8, 2, torch.float32, weight_format=weight_format)
    inputs = cases.make_inputs(case, seed=0)
    with pytest.raises(ValueError, match="activation_quant='mxfp8' needs MXFP4 weights"):
        moe_apply(**inputs, activation_quant="mxfp8", override=APPLY)
    with pytest.raises(ValueError, match="activation_quant='mxfp8' needs MXFP4 weights"):
        moe_plan(inputs["w13"], inputs["w2"], x_dtype=torch.float32, top_k=2, activation_quant="mxfp8")
    with pytest.raises(ValueError, match="activation_quant"):
        cases.MoECase("moe.apply", 3, 64, 32, 8, 2, weight_format=weight_format, activation_quant="mxfp8")


def _request(activation_quant):
    info = WeightInfo(128, 2880, 2880, "mxfp4", torch.uint8, 128)
    return apply_request(
        info,
        x_dtype=torch.bfloat16,
        top_k=4,
        num_tokens=64,
        activation="swiglu_oai",
        has_bias=True,
        has_map=False,
        activation_quant=activation_quant,
    )


def test_request_feature_rejects_kernels_that_do_not_declare_it(temp_kernels):
    temp_kernels("moe.apply", name="no_mx8", vendors=("cpu",), features=("swiglu_oai", "bias", "mxfp4"), priority=300)
    temp_kernels(
        "moe.apply", name="mx8", vendors=("cpu",), features=("swiglu_oai", "bias", "mxfp4", "mxfp8_act"), priority=200
    )
    assert "mxfp8_act" in _request("mxfp8").features and "mxfp8_act" not in _request(None).features
    cpu = platform_from_arch("cpu")
    sel = explain(_request("mxfp8"), platform=cpu)
    assert sel.winner.name == "mx8"
    reasons = {c.spec.name: c.reasons for c in sel.candidates}
    assert reasons["no_mx8"] == ("does not support {mxfp8_act}",)
    assert explain(_request(None), platform=cpu).winner.name == "no_mx8"
    inputs = cases.make_inputs(_case(t=3), seed=0)
    with pytest.raises(KernelOverrideError, match="mxfp8_act"):
        moe_apply(**inputs, override="no_mx8")


@pytest.mark.usefixtures("only_reference")
def test_capture_records_and_replays_activation_quant(tmp_path, monkeypatch):
    path = tmp_path / "shapes.jsonl"
    monkeypatch.setenv(config.CAPTURE_ENV, str(path))
    config.refresh()
    _dispatch._captured.clear()
    try:
        case = _case(t=4, dtype=torch.float32)
        moe_apply(**cases.make_inputs(case, seed=0))
        moe_apply(**{**cases.make_inputs(case, seed=0), "activation_quant": None})
    finally:
        monkeypatch.delenv(config.CAPTURE_ENV)
        config.refresh()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["signature"].get("activation_quant") for line in lines] == ["mxfp8", None]
    replayed = read_capture(str(path))
    assert replayed[0].activation_quant == "mxfp8" and replayed[1].activation_quant is None
    assert cases.request(replayed[0]) == cases.request(case)
    assert "+mxfp8_act" in case.describe()


def test_custom_op_carries_activation_quant():
    from tokenspeed_kernel.ops.moe import _custom_ops

    inputs = cases.make_inputs(_case(t=3, dtype=torch.float32), seed=1)
    a13, b13, fmt = _custom_ops.flatten_weight(inputs["w13"])
    a2, b2, _ = _custom_ops.flatten_weight(inputs["w2"])
    args = (
        inputs["x"],
        a13,
        b13,
        a2,
        b2,
        fmt,
        inputs["topk_weights"],
        inputs["topk_ids"],
        "swiglu_oai",
        inputs["w13_bias"],
        inputs["w2_bias"],
        None,
        APPLY,
        "mxfp8",
    )
    torch.library.opcheck(torch.ops.tokenspeed_kernel.moe_apply.default, args)
    got = torch.ops.tokenspeed_kernel.moe_apply(*args)
    assert torch.equal(got, moe_apply(**inputs, override=APPLY))


def test_fp8_activations_reference_and_validation():
    """activation_quant="fp8": FP8 weights only (ValueError naming the argument otherwise), the
    reference equals the independent float64 MoE of the same per-token rounding, and the
    request carries the feature "fp8_act"."""
    fp8 = [c for c in cases.awkward_cases("moe.apply") if c.activation_quant == "fp8"]
    assert {c.weight_format for c in fp8} == {"fp8_per_tensor", "fp8_per_channel", "fp8_block"}
    for case in fp8:
        inputs = cases.make_inputs(case, seed=3)
        assert "fp8_act" in cases.request(case).features
        torch.testing.assert_close(cases.reference(case, inputs)[0], naive_moe(**inputs), atol=1e-10, rtol=1e-10)
        out = moe_apply(**inputs, override=APPLY)
        torch.testing.assert_close(out.double(), naive_moe(**inputs), atol=3e-2, rtol=1.6e-2)
    plain = cases.make_inputs(cases.MoECase("moe.apply", 3, 64, 32, 8, 2, torch.bfloat16), seed=1)
    with pytest.raises(ValueError, match="activation_quant='fp8' needs FP8 weights"):
        moe_apply(**plain, activation_quant="fp8", override=APPLY)
    mx = cases.make_inputs(_case(t=3), seed=1)
    with pytest.raises(ValueError, match="activation_quant='fp8' needs FP8 weights"):
        moe_apply(**{**mx, "activation_quant": "fp8"}, override=APPLY)
    with pytest.raises(ValueError, match="activation_quant"):
        cases.MoECase("moe.apply", 3, 64, 32, 8, 2, torch.bfloat16, weight_format="mxfp4", activation_quant="fp8")
