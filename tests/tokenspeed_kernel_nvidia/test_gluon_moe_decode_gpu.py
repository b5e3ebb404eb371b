"""GPU numerics of the two Gluon MXFP4 MoE decode kernels, ``gluon_moe_decode_mx_sm90``
(float32 FMAs, and its fused-routing entry) and ``gluon_moe_mma_sm90`` (mma.sync dots),
against the independent float64 MoE of ``support.naive_moe``.

Runs only on an sm_90 GPU (skips with the reason otherwise): T in {1, 2, 5, 8}, every
activation, biases on and off, fp16 x (and float32 x for the FMA kernel, which alone serves
it), top-2 / top-3 (a padded choice) / top-4, an expert map with -1 entries, activations far
outside fp16's range (3e5, 1e-6: the MMA kernel's per-token power of two), outputs poisoned
with NaN so an unwritten row fails; the fused routing (softmax / sigmoid, renormalize on /
off) against ``naive_topk``; a CUDA-graph replay equal to the eager call. Small shapes
(E = 8, H = 64 or 96, I = 96 or 160) plus one H = I = 2880 shape with 4 experts (GPT-OSS's
K: 90 groups, a masked last step).
"""

import pytest
import torch
from support.gpu import sm90_skip_reason
from support.gpu_moe import moe_problem, rel_err
from support.naive_moe import naive_moe, naive_topk

from tokenspeed_kernel.ops.moe import moe_apply

FMA = "gluon_moe_decode_mx_sm90"
MMA = "gluon_moe_mma_sm90"
KERNELS = (FMA, MMA)

SKIP = sm90_skip_reason()
if SKIP:
    print(f"test_gluon_moe_decode_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _tol(dtype):
    return 2e-2 if dtype != torch.float32 else 1e-4


def _err(kernel, x, w13, w2, tw, ti, **kw):
    """Relative error of ``kernel`` against float64 on a NaN-poisoned output (no NaN left)."""
    out = torch.full_like(x, float("nan"))
    moe_apply(x, w13, w2, tw, ti, out=out, override=kernel, **kw)
    assert not out.isnan().any()
    return rel_err(out, naive_moe(x, w13, w2, tw, ti, **kw))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("t", [1, 2, 5, 8])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_float64(kernel, t, activation, bias):
    x, w13, w2, b13, b2, logits = moe_problem(t, 8, 64, 96)
    tw, ti = naive_topk(logits, 4)
    kw = dict(activation=activation, w13_bias=b13 if bias else None, w2_bias=b2 if bias else None)
    assert _err(kernel, x, w13, w2, tw.float(), ti.int(), **kw) < _tol(x.dtype)


@pytest.mark.parametrize(
    ("kernel", "dtype"), [(FMA, torch.float16), (FMA, torch.float32), (MMA, torch.float16), (MMA, torch.bfloat16)]
)
@pytest.mark.parametrize("top_k", [2, 3])
def test_dtypes_top_k(kernel, dtype, top_k):
    x, w13, w2, b13, b2, logits = moe_problem(5, 8, 96, 160, dtype=dtype, seed=top_k)
    tw, ti = naive_topk(logits, top_k)
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    assert _err(kernel, x, w13, w2, tw.float(), ti.int(), **kw) < _tol(dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("x_scale", [3e5, 1e-6])
def test_activation_range(kernel, x_scale):
    """bf16 activations above fp16's 65504 and deep in its subnormals."""
    x, w13, w2, _, _, logits = moe_problem(3, 8, 64, 96, seed=5, x_scale=x_scale)
    tw, ti = naive_topk(logits, 4)
    assert _err(kernel, x, w13, w2, tw.float(), ti.int(), activation="silu") < 2e-2


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("layer", [1, 2])
def test_nan_scale_poisons_only_its_tokens(kernel, layer):
    """An E8M0 scale byte 255 (NaN) in one expert: the tokens routed to it come out NaN (as
    in the float64 reference), every other token stays finite and correct."""
    x, w13, w2, b13, b2, logits = moe_problem(6, 8, 64, 96, seed=11)
    tw, ti = naive_topk(logits, 2)
    tw, ti = tw.float(), ti.int()
    bad = int(ti[0, 0])
    (w13 if layer == 1 else w2).scales[bad, 5, 1] = 255
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    out = torch.full_like(x, float("nan"))
    moe_apply(x, w13, w2, tw, ti, out=out, override=kernel, **kw)
    ref = naive_moe(x, w13, w2, tw, ti, **kw)
    hit = (ti == bad).any(dim=1).cpu()
    nan_rows = out.isnan().any(dim=1).cpu()
    assert hit[0] and torch.equal(nan_rows, ref.isnan().any(dim=1).cpu())
    assert torch.equal(nan_rows, hit) if layer == 1 else bool(nan_rows[hit].all())
    assert rel_err(out[~hit], ref[~hit]) < 2e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_expert_map_with_remote_experts(kernel):
    x, w13, w2, b13, b2, _ = moe_problem(8, 4, 64, 96)  # 4 local experts of 8 global
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(8, 8, generator=gen, device="cuda")
    emap = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32, device="cuda")
    tw, ti = naive_topk(logits, 4)
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap)
    assert _err(kernel, x, w13, w2, tw.float(), ti.int(), **kw) < 2e-2


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("t", [1, 8])
def test_gpt_oss_k(kernel, t):
    x, w13, w2, b13, b2, logits = moe_problem(t, 4, 2880, 2880, seed=3)
    tw, ti = naive_topk(logits, 4)
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    assert _err(kernel, x, w13, w2, tw.float(), ti.int(), **kw) < 2e-2


@pytest.mark.parametrize("scoring,renorm", [("softmax", True), ("softmax", False), ("sigmoid", True)])
@pytest.mark.parametrize("t", [1, 5])
def test_fused_routing(scoring, renorm, t):
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits

    x, w13, w2, b13, b2, logits = moe_problem(t, 8, 64, 96)
    out = torch.full_like(x, float("nan"))
    out, tw, ti = moe_decode_from_logits(
        x, logits, w13, w2, 4, scoring=scoring, renormalize=renorm, w13_bias=b13, w2_bias=b2, out=out
    )
    rw, ri = naive_topk(logits, 4, scoring=scoring, renormalize=renorm)
    assert torch.equal(ti.long().cpu(), ri.cpu())
    torch.testing.assert_close(tw.double(), rw, rtol=1e-5, atol=1e-6)
    ref = naive_moe(x, w13, w2, rw.float(), ri.int(), activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("t", [2, 5])  # T = 5: the MMA kernel's TMA-staged layer 1 (a descriptor per call)
def test_cuda_graph_replay_matches_eager(kernel, t):
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits

    fused = kernel == FMA  # the fused-routing entry belongs to the FMA kernel
    x, w13, w2, b13, b2, logits = moe_problem(t, 8, 64, 96)
    tw, ti = naive_topk(logits, 4)
    tw, ti = tw.float(), ti.int()
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    eager = moe_apply(x, w13, w2, tw, ti, override=kernel, **kw)
    fused_eager = moe_decode_from_logits(x, logits, w13, w2, 4, **kw)[0].clone() if fused else None
    out = torch.full_like(x, float("nan"))
    fused_out = torch.full_like(x, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm (compile) outside the capture
        moe_apply(x, w13, w2, tw, ti, out=out, override=kernel, **kw)
        if fused:
            moe_decode_from_logits(x, logits, w13, w2, 4, out=fused_out, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_apply(x, w13, w2, tw, ti, out=out, override=kernel, **kw)
        if fused:
            moe_decode_from_logits(x, logits, w13, w2, 4, out=fused_out, **kw)
    out.fill_(float("nan"))
    fused_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)  # deterministic: no atomics
    if fused:
        assert torch.equal(fused_out, fused_eager)


TMA_CONFIGS = {
    "l1": dict(ks2=4, prefetch=True, l2_hint=True, tma1=True),  # 4 stages, 8 groups per step
    "l1-ks8-2st": dict(ks1=8, u1=1, tma1=True, stages1=2),
    "l1-ks2-6st": dict(ks1=2, u1=2, tma1=True, stages1=6),  # 4 groups per step: a 64-byte box row
    "l1l2": dict(ks2=4, prefetch=True, l2_hint=True, tma1=True, tma2=True),
    "l2-ks2-2st": dict(ks2=2, u2=2, tma2=True, stages2=2),
    "l2-ks8u1": dict(ks2=8, u2=1, tma2=True, stages2=3),
}


@pytest.mark.parametrize("name", list(TMA_CONFIGS))
@pytest.mark.parametrize(
    ("t", "h", "i", "top_k", "emap"),
    [(1, 64, 96, 4, False), (3, 64, 96, 3, False), (5, 96, 160, 4, True), (2, 2880, 2880, 4, False)],
)
def test_tma_layers_match_float64(name, t, h, i, top_k, emap):
    """Layers staged by TMA (``tma1`` / ``tma2``, opt-in): H = 64 (2 groups: fewer steps than
    stages, a zero-filled box tail), top-3 (a padded choice in layer 2), 96 with an expert
    map (remote choices: no copy, a plain barrier arrival), and GPT-OSS's 2880 (90 groups:
    a partial last step); NaN-poisoned output."""
    from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_mma as gm

    fields = TMA_CONFIGS[name]
    x, w13, w2, b13, b2, logits = moe_problem(t, 4, h, i, seed=t)  # 4 local experts
    em = None
    if emap:  # 8 global experts, the odd ones on another rank
        logits = torch.randn(t, 8, generator=torch.Generator(device="cuda").manual_seed(t), device="cuda")
        em = torch.tensor([0, -1, 1, -1, 2, -1, 3, -1], dtype=torch.int32, device="cuda")
    tw, ti = naive_topk(logits, top_k)
    tw, ti = tw.float().contiguous(), ti.int().contiguous()
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=em)
    out = torch.full_like(x, float("nan"))
    gm.launch(x, w13, w2, b13, b2, em, out, ti, tw, top_k, "swiglu_oai", gm.GluonMoEMMAConfig(**fields))
    ref = naive_moe(x, w13, w2, tw, ti, **kw)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 2e-2


def test_shipped_tma_config_falls_back_on_unaligned_weights():
    """T = 5 (bucket 8) ships a TMA-staged layer 1, which needs 16-byte aligned weight words:
    w13's packed bytes taken from a buffer at a 4-byte offset (still word-aligned) are served
    by the register layer 1 through the public call, correct against float64; the same
    weights with an explicit TMA configuration are a ValueError naming w13."""
    from tokenspeed_kernel.quant import MXFP4Weight
    from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_mma as gm

    assert gm.mma_config(5).tma1
    x, w13, w2, b13, b2, logits = moe_problem(5, 8, 64, 96, seed=11)
    buf = torch.empty(w13.packed.numel() + 4, dtype=torch.uint8, device="cuda")
    packed = buf[4:].view(w13.packed.shape)
    packed.copy_(w13.packed)
    assert packed.data_ptr() % 16 == 4
    w13 = MXFP4Weight(packed, w13.scales)
    tw, ti = naive_topk(logits, 4)
    tw, ti = tw.float().contiguous(), ti.int().contiguous()
    assert _err(MMA, x, w13, w2, tw, ti, activation="swiglu_oai", w13_bias=b13, w2_bias=b2) < 2e-2
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="w13's packed words 16-byte aligned"):
        gm.launch(x, w13, w2, b13, b2, None, out, ti, tw, 4, "swiglu_oai", gm.mma_config(5))


@pytest.mark.parametrize("emap", [False, True])
def test_plan_runs_bound_per_token_count(emap):
    """MoEPlan binds the MMA kernel's two launches once per token count (TMA descriptors
    built once): fresh x and routing every call, outputs poisoned, x rows sometimes 2 bytes
    off alignment; each call matches float64 and equals the functional call bit for bit."""
    from tokenspeed_kernel.ops.moe import moe_plan

    x, w13, w2, b13, b2, _ = moe_problem(8, 8, 64, 96)
    kw = dict(activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    if emap:
        kw["expert_map"] = torch.tensor([0, -1, 1, 2, -1, 3, 4, 5], dtype=torch.int32, device="cuda")
        w13 = type(w13)(w13.packed[:6], w13.scales[:6])
        w2 = type(w2)(w2.packed[:6], w2.scales[:6])
        kw["w13_bias"], kw["w2_bias"] = b13[:6], b2[:6]
    plan = moe_plan(w13, w2, x_dtype=x.dtype, top_k=4, override=MMA, **kw)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for step, t in enumerate((1, 5, 1, 8, 5)):
        buf = torch.randn(t * 64 + 1, generator=gen, device="cuda").to(x.dtype)
        xt = buf[step % 2 :][: t * 64].view(t, 64)  # odd steps: rows 2 bytes off 4-byte alignment
        tw, ti = naive_topk(torch.randn(t, 8, generator=gen, device="cuda"), 4)
        tw, ti = tw.float(), ti.int()
        out = torch.full_like(xt, float("nan"))
        plan.apply(xt, tw, ti, out=out)
        assert not out.isnan().any()
        assert rel_err(out, naive_moe(xt, w13, w2, tw, ti, **kw)) < 2e-2
        assert torch.equal(out, moe_apply(xt, w13, w2, tw, ti, override=MMA, **kw))
    assert set(plan.runners) == {1, 5, 8} and all(run is not None for run in plan.runners.values())
