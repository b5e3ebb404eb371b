"""Numerics of the Gluon kernels on a ROCm GPU against independent float64 computations
(tests/support). Skipped, with the reason printed, on machines without one: this project
has not yet run them on AMD hardware (see docs/amd.md)."""

from __future__ import annotations

import pytest
import torch
from support.naive_attention import naive_decode, naive_prefill
from support.naive_moe import naive_moe

import tokenspeed_kernel as tk
from tokenspeed_kernel.quant import quantize_mxfp4

ROCM = torch.cuda.is_available() and bool(getattr(torch.version, "hip", None))
pytestmark = pytest.mark.skipif(not ROCM, reason="no ROCm GPU: AMD kernel numerics need gfx942/gfx950 hardware")


@pytest.fixture(autouse=True)
def _announce():
    if not ROCM:
        pytest.skip("no ROCm GPU: AMD kernel numerics need gfx942/gfx950 hardware")


def _paged(lengths, page_size, num_kv_heads, head_dim, dtype, gen):
    pages = [-(-n // page_size) for n in lengths]
    total = sum(pages) + 3
    perm = torch.randperm(total, generator=gen)
    table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at : at + p]
        at += p
    k = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, page_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k, v, table


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("window", [-1, 128])
@pytest.mark.parametrize("lengths", [[1, 300, 5000], [70]])
def test_decode_matches_float64(page_size, window, lengths):
    gen = torch.Generator().manual_seed(0)
    k, v, table = _paged(lengths, page_size, 8, 64, torch.bfloat16, gen)
    q = torch.randn(len(lengths), 64, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(64, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    dev = "cuda"
    out = torch.full_like(q, float("nan"), device=dev)
    got, lse = tk.mha_decode_with_kvcache(
        q.to(dev),
        k.to(dev),
        v.to(dev),
        table.to(dev),
        seqlens.to(dev),
        max(lengths),
        window_left=window,
        sinks=sinks.to(dev),
        return_lse=True,
        out=out,
        override="amd_gluon_decode",
    )
    ref, ref_lse = naive_decode(q, k, v, table, seqlens, window_left=window, sinks=sinks)
    torch.testing.assert_close(got.cpu().double(), ref.double(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu().double().flatten(), ref_lse.double().flatten(), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("window", [-1, 128])
def test_prefill_matches_float64(window):
    gen = torch.Generator().manual_seed(1)
    lens_q, lens_k = [7, 200], [7, 333]
    cu_q = torch.tensor([0, 7, 207], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 340], dtype=torch.int32)
    q = torch.randn(207, 64, 64, generator=gen).to(torch.bfloat16)
    k = torch.randn(340, 8, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(340, 8, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(64, generator=gen)
    dev = "cuda"
    got = tk.mha_prefill(
        q.to(dev),
        k.to(dev),
        v.to(dev),
        cu_q.to(dev),
        cu_k.to(dev),
        max(lens_q),
        max(lens_k),
        window_left=window,
        sinks=sinks.to(dev),
        override="amd_gluon_prefill",
    )
    ref, _ = naive_prefill(q, k, v, cu_q, cu_k, window_left=window, sinks=sinks)
    torch.testing.assert_close(got.cpu().double(), ref.double(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("planned", [False, True])
def test_moe_mxfp4_matches_float64(num_tokens, planned):
    gen = torch.Generator().manual_seed(2)
    experts, hidden, inter, top_k = 8, 256, 192, 2
    w13 = quantize_mxfp4(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1)
    w2 = quantize_mxfp4(torch.randn(experts, hidden, inter, generator=gen) * 0.1)
    b13 = torch.randn(experts, 2 * inter, generator=gen) * 0.1
    b2 = torch.randn(experts, hidden, generator=gen) * 0.1
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, experts, generator=gen)
    weights, ids = tk.moe_topk(logits, top_k)
    dev = "cuda"

    def to(w):
        return type(w)(w.packed.to(dev), w.scales.to(dev))

    args = dict(activation="swiglu_oai", w13_bias=b13.to(dev), w2_bias=b2.to(dev))
    if planned:
        plan = tk.moe_plan(to(w13), to(w2), x_dtype=torch.bfloat16, top_k=top_k, override="amd_gluon_moe_mxfp4", **args)
        got = plan.apply(x.to(dev), weights.to(dev), ids.to(dev))
    else:
        got = tk.moe_apply(
            x.to(dev), to(w13), to(w2), weights.to(dev), ids.to(dev), override="amd_gluon_moe_mxfp4", **args
        )
    ref = naive_moe(x, w13, w2, weights, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(got.cpu().double(), ref.double(), atol=3e-2, rtol=3e-2)


def _gfx950() -> bool:
    return ROCM and str(torch.cuda.get_device_properties(0).gcnArchName).startswith("gfx950")


@pytest.mark.parametrize("fake", [False, True])
def test_mxfp8_quantizer_is_bit_exact(fake):
    """The in-kernel MXFP8 rule equals tokenspeed_kernel.quant.quantize_mxfp8 bit for bit
    (normal-range data: blocks with amax < 2**-118 may flush on the device)."""
    from tokenspeed_kernel.quant import fake_quantize_mxfp8, quantize_mxfp8
    from tokenspeed_kernel_amd.ops.moe.fused import quantize_x

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(67, 256, generator=gen) * torch.logspace(-20, 20, 67, base=2.0)[:, None]).to(torch.bfloat16)
    x[5, :32] = 0.0
    x[6, 3] = 448.0 * 2**10  # saturation in its block
    q, scales = quantize_x(x.to("cuda"), fake=fake)
    if fake:
        assert torch.equal(q.cpu(), fake_quantize_mxfp8(x))
    else:
        data, ref_scales = quantize_mxfp8(x)
        assert torch.equal(scales.cpu(), ref_scales)
        assert torch.equal(q.cpu(), data.view(torch.uint8))


@pytest.mark.parametrize("num_tokens", [5, 64])
@pytest.mark.parametrize("planned", [False, True])
@pytest.mark.parametrize("kernel", ["amd_gluon_moe_mxfp4", "amd_gluon_moe_mxfp4_scaled"])
def test_moe_mxfp8_activations_match_float64(num_tokens, planned, kernel):
    if kernel.endswith("_scaled") and not _gfx950():
        pytest.skip("the scaled-MFMA kernel needs gfx950")
    gen = torch.Generator().manual_seed(4)
    experts, hidden, inter, top_k = 8, 256, 192, 2  # I = 192: a masked K tail on the scaled GEMM
    w13 = quantize_mxfp4(torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1)
    w2 = quantize_mxfp4(torch.randn(experts, hidden, inter, generator=gen) * 0.1)
    b13 = torch.randn(experts, 2 * inter, generator=gen) * 0.1
    b2 = torch.randn(experts, hidden, generator=gen) * 0.1
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16)
    weights, ids = tk.moe_topk(torch.randn(num_tokens, experts, generator=gen), top_k)
    dev = "cuda"

    def to(w):
        return type(w)(w.packed.to(dev), w.scales.to(dev))

    args = dict(activation="swiglu_oai", w13_bias=b13.to(dev), w2_bias=b2.to(dev), activation_quant="mxfp8")
    if planned:
        plan = tk.moe_plan(to(w13), to(w2), x_dtype=torch.bfloat16, top_k=top_k, override=kernel, **args)
        got = plan.apply(x.to(dev), weights.to(dev), ids.to(dev))
    else:
        got = tk.moe_apply(x.to(dev), to(w13), to(w2), weights.to(dev), ids.to(dev), override=kernel, **args)
    ref = naive_moe(
        x, w13, w2, weights, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2, activation_quant="mxfp8"
    )
    # a value within fp32 accumulation error of an e4m3 rounding boundary may round the other way
    torch.testing.assert_close(got.cpu().double(), ref.double(), atol=5e-2, rtol=5e-2)
