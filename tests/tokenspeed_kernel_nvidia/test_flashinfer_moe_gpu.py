"""GPU numerics of ``flashinfer_cutlass_moe`` against the float64 MoE of ``support.naive_moe``.

Runs only with a CUDA device whose architecture FlashInfer builds a CUTLASS MoE module for
and flashinfer-python installed (skips with the printed reason otherwise). The first call
JIT-compiles FlashInfer's CUTLASS MoE module for the device (more than 35 minutes on 16
cores, unless a matching flashinfer-jit-cache or the prebuilt module is installed). GPT-OSS-like small shapes: bf16
(and fp16, at GPT-OSS's 2880 width) weights, every activation (swiglu_oai with its clamp), biases (a float32 w2 bias), top-4,
an expert map with -1 entries; the functional path and a plan. Output poisoned with NaN
so an unwritten row fails. Passed 27/27 on the H100 (2026-11-24) with the prebuilt module of
``ci/device/flashinfer_moe_prebuild.py``; the plan test's first call runs under FlashInfer's
autotuner.
"""

import importlib.util

import pytest
import torch
from support.naive_moe import naive_moe

from tokenspeed_kernel.ops.moe import moe_apply, moe_plan

KERNEL = "flashinfer_cutlass_moe"
BUILT_FOR = {(8, 9), (9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)}


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer-python not installed"
    cap = torch.cuda.get_device_capability()
    if cap not in BUILT_FOR:
        return f"sm_{cap[0]}{cap[1]}: FlashInfer builds no CUTLASS MoE module for it"
    return None


SKIP = _skip_reason()
if SKIP:
    print(f"test_flashinfer_moe_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")


def _problem(t, e, h, i, k, seed=0, dt=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, generator=gen, device="cuda").to(dt)
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5).to(dt)
    w2 = (torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5).to(dt)
    b13 = (0.5 * torch.randn(e, 2 * i, generator=gen, device="cuda")).to(dt)
    b2 = 0.5 * torch.randn(e, h, generator=gen, device="cuda")
    scores = torch.randn(t, e, generator=gen, device="cuda")
    wts, ids = scores.softmax(-1).topk(k, dim=-1)
    wts = wts / wts.sum(-1, keepdim=True)
    return x, w13, w2, b13, b2, wts.float().contiguous(), ids.to(torch.int32).contiguous()


def _check(out, ref):
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref.double().to(out.device), atol=4e-2, rtol=4e-2)


@pytest.mark.parametrize("t", [1, 7, 64, 300])
@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True])
def test_functional_matches_reference(t, activation, bias):
    x, w13, w2, b13, b2, wts, ids = _problem(t, 16, 256, 128, 4)
    _run_and_check(x, w13, w2, b13 if bias else None, b2 if bias else None, wts, ids, activation)


@pytest.mark.parametrize("t", [5, 129])
def test_fp16_and_gpt_oss_hidden(t):
    # fp16 weights and activations; GPT-OSS's hidden/intermediate 2880 (a multiple of 8, not of 64)
    x, w13, w2, b13, b2, wts, ids = _problem(t, 8, 2880, 2880, 4, seed=t, dt=torch.float16)
    _run_and_check(x, w13, w2, b13, b2, wts, ids, "swiglu_oai")


def _run_and_check(x, w13, w2, b13, b2, wts, ids, activation):
    out = torch.full_like(x, float("nan"))
    moe_apply(x, w13, w2, wts, ids, activation=activation, w13_bias=b13, w2_bias=b2, out=out, override=KERNEL)
    _check(out, naive_moe(x, w13, w2, wts, ids, activation=activation, w13_bias=b13, w2_bias=b2))


def test_expert_map_and_plan():
    x, w13, w2, b13, b2, wts, _ = _problem(33, 8, 256, 128, 4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.stack([torch.randperm(16, generator=gen, device="cuda")[:4] for _ in range(33)]).to(torch.int32)
    emap = torch.full((16,), -1, dtype=torch.int32, device="cuda")
    emap[torch.arange(0, 16, 2, device="cuda")] = torch.arange(8, dtype=torch.int32, device="cuda")
    ref = naive_moe(x, w13, w2, wts, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap)
    plan = moe_plan(
        w13,
        w2,
        x_dtype=torch.bfloat16,
        top_k=4,
        activation="swiglu_oai",
        w13_bias=b13,
        w2_bias=b2,
        expert_map=emap,
        override=KERNEL,
    )
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        plan.apply(x, wts, ids, out=out)
        _check(out, ref)
    out = moe_apply(
        x, w13, w2, wts, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap, override=KERNEL
    )
    _check(out, ref)
