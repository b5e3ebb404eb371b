"""GPU numerics of ``gluon_moe_decode_mx_sm90`` (and its fused-routing entry) against the
independent float64 MoE of ``support.naive_moe``.

Runs only on an sm_90 GPU (skips with the reason otherwise): T in {1, 2, 5, 8}, every
activation, biases on and off, top-2 and top-4, an expert map with -1 entries, outputs
poisoned with NaN so an unwritten row fails; the fused routing (softmax / sigmoid,
renormalize on / off) against ``naive_topk``; a CUDA-graph replay equal to the eager call.
Small shapes (E = 8, H = 64, I = 96: three K steps are not needed to cover the masked group
lanes) plus one H = I = 2880 shape with 4 experts (GPT-OSS's K: 90 groups, masked last step).
"""

import pytest
import torch
from support.gpu import sm90_skip_reason
from support.naive_moe import naive_moe, naive_topk

from tokenspeed_kernel.ops.moe import moe_apply
from tokenspeed_kernel.quant import MXFP4Weight, quantize_mxfp4

KERNEL = "gluon_moe_decode_mx_sm90"


SKIP = sm90_skip_reason()
if SKIP:
    print(f"test_gluon_moe_decode_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _mx(w: torch.Tensor) -> MXFP4Weight:
    parts = [quantize_mxfp4(p) for p in w]
    return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scales for p in parts]))


def _problem(t, e, h, i, k, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, generator=gen, device="cuda").to(dtype)
    w13 = _mx(torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5)
    w2 = _mx(torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5)
    b13 = (0.5 * torch.randn(e, 2 * i, generator=gen, device="cuda")).to(dtype)
    b2 = 0.5 * torch.randn(e, h, generator=gen, device="cuda")  # float32 bias
    logits = 2 * torch.randn(t, e, generator=gen, device="cuda")
    return x, w13, w2, b13, b2, logits


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-12))


def _tol(dtype):
    return 2e-2 if dtype != torch.float32 else 1e-4


@pytest.mark.parametrize("t", [1, 2, 5, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(t, activation, bias):
    x, w13, w2, b13, b2, logits = _problem(t, 8, 64, 96, 4)
    tw, ti = naive_topk(logits, 4)
    tw, ti = tw.float(), ti.int()
    out = torch.full_like(x, float("nan"))
    kw = dict(activation=activation, w13_bias=b13 if bias else None, w2_bias=b2 if bias else None)
    moe_apply(x, w13, w2, tw, ti, out=out, override=KERNEL, **kw)
    ref = naive_moe(x, w13, w2, tw, ti, **kw)
    assert not out.isnan().any()
    assert _rel(out, ref) < _tol(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dtypes_top2(dtype):
    x, w13, w2, b13, b2, logits = _problem(5, 8, 64, 96, 2, dtype=dtype)
    tw, ti = naive_topk(logits, 2)
    out = torch.full_like(x, float("nan"))
    moe_apply(x, w13, w2, tw.float(), ti.int(), activation="swiglu_oai", w13_bias=b13, w2_bias=b2, out=out,
              override=KERNEL)  # fmt: skip
    ref = naive_moe(x, w13, w2, tw.float(), ti.int(), activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    assert _rel(out, ref) < _tol(dtype)


def test_expert_map_with_remote_experts():
    x, w13, w2, b13, b2, logits = _problem(8, 4, 64, 96, 4)  # 4 local experts of 8 global
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(8, 8, generator=gen, device="cuda")
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32, device="cuda")
    tw, ti = naive_topk(logits, 4)
    out = torch.full_like(x, float("nan"))
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap)
    moe_apply(x, w13, w2, tw.float(), ti.int(), out=out, override=KERNEL, **kw)
    ref = naive_moe(x, w13, w2, tw.float(), ti.int(), **kw)
    assert not out.isnan().any()
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("t", [1, 8])
def test_gpt_oss_k(t):
    x, w13, w2, b13, b2, logits = _problem(t, 4, 2880, 2880, 4, seed=3)
    tw, ti = naive_topk(logits, 4)
    out = torch.full_like(x, float("nan"))
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    moe_apply(x, w13, w2, tw.float(), ti.int(), out=out, override=KERNEL, **kw)
    assert _rel(out, naive_moe(x, w13, w2, tw.float(), ti.int(), **kw)) < 2e-2


@pytest.mark.parametrize("scoring,renorm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_routing(scoring, renorm, t):
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits

    x, w13, w2, b13, b2, logits = _problem(t, 8, 64, 96, 4)
    out = torch.full_like(x, float("nan"))
    out, tw, ti = moe_decode_from_logits(x, logits, w13, w2, 4, scoring=scoring, renormalize=renorm,
                                         w13_bias=b13, w2_bias=b2, out=out)  # fmt: skip
    rw, ri = naive_topk(logits, 4, scoring=scoring, renormalize=renorm)
    assert torch.equal(ti.long().cpu(), ri.cpu())
    torch.testing.assert_close(tw.double(), rw, rtol=1e-5, atol=1e-6)
    ref = naive_moe(x, w13, w2, rw.float(), ri.int(), activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    assert _rel(out, ref) < 2e-2


def test_cuda_graph_replay_matches_eager():
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits

    x, w13, w2, b13, b2, logits = _problem(2, 8, 64, 96, 4)
    tw, ti = naive_topk(logits, 4)
    tw, ti = tw.float(), ti.int()
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    eager = moe_apply(x, w13, w2, tw, ti, override=KERNEL, **kw)
    fused_eager = moe_decode_from_logits(x, logits, w13, w2, 4, **kw)[0].clone()
    out = torch.full_like(x, float("nan"))
    fused_out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm (compile) outside the capture
        moe_apply(x, w13, w2, tw, ti, out=out, override=KERNEL, **kw)
        moe_decode_from_logits(x, logits, w13, w2, 4, out=fused_out, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_apply(x, w13, w2, tw, ti, out=out, override=KERNEL, **kw)
        moe_decode_from_logits(x, logits, w13, w2, 4, out=fused_out, **kw)
    out.fill_(float("nan"))
    fused_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # deterministic: no atomics
    assert torch.equal(fused_out, fused_eager)
