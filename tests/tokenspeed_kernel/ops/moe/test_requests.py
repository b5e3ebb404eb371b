"""The public MoE request builders give exactly the requests the public calls make."""

import pytest
import torch

from tokenspeed_kernel import moe_apply, moe_apply_request, moe_plan, moe_topk, moe_topk_request
from tokenspeed_kernel.ops._dispatch import last_request
from tokenspeed_kernel.quant import quantize_mxfp4


def _weights(e, h, i, fmt, dtype):
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.1
    w2 = torch.randn(e, h, i, generator=gen) * 0.1
    if fmt == "mxfp4":
        return quantize_mxfp4(w13), quantize_mxfp4(w2)
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize("fmt", ["plain", "mxfp4"])
@pytest.mark.parametrize("bias,with_map", [(False, False), (True, True)])
def test_moe_apply_request_matches_the_call(fmt, bias, with_map):
    e, h, i, k, t, dtype = 4, 64, 32, 2, 5, torch.bfloat16
    w13, w2 = _weights(e, h, i, fmt, dtype)
    x = torch.randn(t, h).to(dtype)
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    weights = torch.full((t, k), 0.5)
    b13 = torch.zeros(e, 2 * i) if bias else None
    b2 = torch.zeros(e, h) if bias else None
    emap = torch.arange(e, dtype=torch.int32) if with_map else None
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap)
    moe_apply(x, w13, w2, weights, ids, override="torch_moe", **kw)
    built = moe_apply_request(
        x_dtype=dtype,
        num_experts=e,
        top_k=k,
        hidden=h,
        intermediate=i,
        weight_format=fmt,
        activation="swiglu_oai",
        bias=bias,
        expert_map=with_map,
        num_tokens=t,
    )
    assert built == last_request()
    plan = moe_plan(w13, w2, x_dtype=dtype, top_k=k, override="torch_moe", **kw)
    assert plan.request == moe_apply_request(
        x_dtype=dtype,
        num_experts=e,
        top_k=k,
        hidden=h,
        intermediate=i,
        weight_format=fmt,
        activation="swiglu_oai",
        bias=bias,
        expert_map=with_map,
    )


@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("sigmoid", False)])
def test_moe_topk_request_matches_the_call(scoring, renormalize):
    logits = torch.randn(3, 8)
    moe_topk(logits, 2, scoring=scoring, renormalize=renormalize, override="torch_moe_topk")
    built = moe_topk_request(
        logits_dtype=torch.float32, num_experts=8, top_k=2, scoring=scoring, renormalize=renormalize
    )
    assert built == last_request()


def test_builders_name_bad_arguments():
    with pytest.raises(ValueError, match="weight_format"):
        moe_apply_request(
            x_dtype=torch.bfloat16, num_experts=4, top_k=2, hidden=64, intermediate=32, weight_format="int4"
        )
    with pytest.raises(ValueError, match="scoring"):
        moe_topk_request(logits_dtype=torch.float32, num_experts=8, top_k=2, scoring="relu")
