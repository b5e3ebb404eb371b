"""The Triton fused MoE on the issue's tiny shapes (E=8, top-2, H=64, I=32, T in {1, 5, 33})
for EVERY weight format x activation, with and without bias + expert map, under the
interpreter against the float64 ``support.naive_moe`` (``awkward_cases`` covers each option
once; this is the cross product). fp8 128x128 blocks need H > 128, so that format runs at
H = 256. MXFP4 runs both the functional path and the plan's repacked weights.
"""

import pytest
import torch
from support.naive_moe import naive_moe

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.ops.moe import moe_plan
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases.moe import WEIGHT_FORMATS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
KERNEL = "triton_fused_moe"


def _check(out, ref, dtype):
    assert not torch.isnan(out).any(), "an output element was never written"
    err = float((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-30))
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"


def _case(fmt, activation, tokens, extras, dtype=torch.bfloat16):
    return cases.MoECase(
        "moe.apply",
        tokens,
        256 if fmt == "fp8_block" else 64,
        32,
        8,
        2,
        dtype,
        weight_format=fmt,
        activation=activation,
        bias=extras,
        expert_map=extras,
        name=f"{fmt}-{activation}-t{tokens}{'-bias-map' if extras else ''}",
    )


MATRIX = [
    pytest.param(_case(fmt, act, t, extras), id=f"{fmt}-{act}-t{t}{'-bias-map' if extras else ''}")
    for fmt in WEIGHT_FORMATS
    for act in ACTIVATIONS
    for t in (1, 5, 33)
    for extras in (False, True)
]


@pytest.mark.parametrize("case", MATRIX)
def test_every_format_activation_bias_map(case):
    inputs = cases.make_inputs(case, DEVICE, seed=case.num_tokens)
    expected = naive_moe(**inputs)
    # override: on a GPU, MXFP4 + bf16 may select triton_fused_moe_mx (tested in test_moe_mx.py)
    out = cases.call(case, inputs, override=KERNEL, out=torch.full_like(inputs["x"], float("nan")))
    assert last_kernel() == KERNEL
    _check(out, expected, case.dtype)
    if case.weight_format == "mxfp4" and case.num_tokens != 5:
        weights = {k: inputs[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
        plan = moe_plan(**weights, x_dtype=case.dtype, top_k=case.top_k, activation=case.activation, override=KERNEL)
        assert plan.kernel == KERNEL
        _check(plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"]), expected, case.dtype)


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS)
def test_every_format_in_fp16(fmt):
    case = _case(fmt, "swiglu_oai", 33, True, dtype=torch.float16)
    inputs = cases.make_inputs(case, DEVICE, seed=2)
    out = cases.call(case, inputs, override=KERNEL)
    assert last_kernel() == KERNEL
    _check(out, naive_moe(**inputs), case.dtype)


FP8_FORMATS = tuple(f for f in WEIGHT_FORMATS if f.startswith("fp8"))


@pytest.mark.parametrize("tokens", [1, 5, 33])
@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("extras", [False, True])
def test_fp8_activations_every_fp8_format(fmt, tokens, extras):
    """activation_quant="fp8" (per-token fp8 activations, fp8 x fp8 GEMMs) for every fp8 weight
    granularity against the float64 MoE of the same activation quantization."""
    import dataclasses

    case = dataclasses.replace(_case(fmt, "silu", tokens, extras), activation_quant="fp8")
    inputs = cases.make_inputs(case, DEVICE, seed=case.num_tokens)
    expected = naive_moe(**inputs)
    out = cases.call(case, inputs, override=KERNEL, out=torch.full_like(inputs["x"], float("nan")))
    assert last_kernel() == KERNEL
    assert not torch.isnan(out).any()
    err = float((out.double().cpu() - expected.cpu()).norm() / expected.cpu().norm())
    assert err < 3e-2, err
