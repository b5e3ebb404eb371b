"""GPU numerics of ``gluon_moe_mma_sm90`` (tensor-core MXFP4 MoE decode) against the
independent float64 MoE of ``support.naive_moe``.

Runs only on an sm_90 GPU (skips with the reason otherwise): T in {1, 2, 5, 8}, every
activation, biases on and off, bf16 and fp16 activations, top-2 / top-3 (a padded choice
warp) / top-4, an expert map with -1 entries, intermediate sizes that are not a multiple of
16 rows per block (I = 96: three 32-column blocks, the last MMA row block half masked ...),
activations far outside fp16's range (the per-token power of two), outputs poisoned with
NaN; GPT-OSS's H = I = 2880 (90 groups: split-K with a masked last step); a CUDA-graph
replay equal to the eager call.
"""

import pytest
import torch
from support.gpu import sm90_skip_reason
from support.naive_moe import naive_moe, naive_topk

from tokenspeed_kernel.ops.moe import moe_apply
from tokenspeed_kernel.quant import MXFP4Weight, quantize_mxfp4

KERNEL = "gluon_moe_mma_sm90"

SKIP = sm90_skip_reason()
if SKIP:
    print(f"test_gluon_moe_mma_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _mx(w: torch.Tensor) -> MXFP4Weight:
    parts = [quantize_mxfp4(p) for p in w]
    return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scales for p in parts]))


def _problem(t, e, h, i, dtype=torch.bfloat16, seed=0, x_scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (x_scale * torch.randn(t, h, generator=gen, device="cuda")).to(dtype)
    w13 = _mx(torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5)
    w2 = _mx(torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5)
    b13 = (0.5 * torch.randn(e, 2 * i, generator=gen, device="cuda")).to(dtype)
    b2 = 0.5 * torch.randn(e, h, generator=gen, device="cuda")  # float32 bias
    logits = 2 * torch.randn(t, e, generator=gen, device="cuda")
    return x, w13, w2, b13, b2, logits


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-12))


def _run(x, w13, w2, tw, ti, **kw):
    out = torch.full_like(x, float("nan"))
    moe_apply(x, w13, w2, tw, ti, out=out, override=KERNEL, **kw)
    ref = naive_moe(x, w13, w2, tw, ti, **kw)
    assert not out.isnan().any()
    return _rel(out, ref)


@pytest.mark.parametrize("t", [1, 2, 5, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(t, activation, bias):
    x, w13, w2, b13, b2, logits = _problem(t, 8, 64, 96)
    tw, ti = naive_topk(logits, 4)
    kw = dict(activation=activation, w13_bias=b13 if bias else None, w2_bias=b2 if bias else None)
    assert _run(x, w13, w2, tw.float(), ti.int(), **kw) < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("top_k", [2, 3])
def test_dtypes_top_k(dtype, top_k):
    x, w13, w2, b13, b2, logits = _problem(5, 8, 96, 160, dtype=dtype, seed=top_k)
    tw, ti = naive_topk(logits, top_k)
    assert _run(x, w13, w2, tw.float(), ti.int(), activation="swiglu_oai", w13_bias=b13, w2_bias=b2) < 2e-2


@pytest.mark.parametrize("x_scale", [3e5, 1e-6])
def test_activation_range(x_scale):
    """bf16 activations above fp16's 65504 and deep in its subnormals: the per-token power
    of two keeps both exact to fp16's 11 bits."""
    x, w13, w2, _, _, logits = _problem(3, 8, 64, 96, seed=5, x_scale=x_scale)
    tw, ti = naive_topk(logits, 4)
    assert _run(x, w13, w2, tw.float(), ti.int(), activation="silu") < 2e-2


def test_expert_map_with_remote_experts():
    x, w13, w2, b13, b2, _ = _problem(8, 4, 64, 96)  # 4 local experts of 8 global
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(8, 8, generator=gen, device="cuda")
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32, device="cuda")
    tw, ti = naive_topk(logits, 4)
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap)
    assert _run(x, w13, w2, tw.float(), ti.int(), **kw) < 2e-2


@pytest.mark.parametrize("t", [1, 8])
def test_gpt_oss_k(t):
    x, w13, w2, b13, b2, logits = _problem(t, 4, 2880, 2880, seed=3)
    tw, ti = naive_topk(logits, 4)
    assert _run(x, w13, w2, tw.float(), ti.int(), activation="swiglu_oai", w13_bias=b13, w2_bias=b2) < 2e-2


def test_cuda_graph_replay_matches_eager():
    x, w13, w2, b13, b2, logits = _problem(2, 8, 64, 96)
    tw, ti = naive_topk(logits, 4)
    tw, ti = tw.float(), ti.int()
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    eager = moe_apply(x, w13, w2, tw, ti, override=KERNEL, **kw)
    out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm (compile) outside the capture
        moe_apply(x, w13, w2, tw, ti, out=out, override=KERNEL, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_apply(x, w13, w2, tw, ti, out=out, override=KERNEL, **kw)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # deterministic: no atomics
