"""Gluon MXFP4 x MXFP8 MoE for gfx950 (``moe.apply`` with ``activation_quant="mxfp8"``).

The only kernel here that uses the CDNA4 scaled MFMA (``v_mfma_scale_f32_16x16x128_f8f6f4``):
with the activations quantized to MXFP8 as the contract says, both GEMM operands are MX
formats, so the e2m1 weight bytes and their E8M0 scales feed the matrix core unchanged.

Regimes (per call, from the token count):

- ``T <= GEMV_MAX_TOKENS``: the warp-decode GEMVs of :mod:`.fused` with quantize-dequantize
  in registers (vector ALU, no MFMA to gain at M = 1).
- otherwise: x → e4m3 codes + E8M0 scales once (:func:`.fused.quantize_x`), expert-sorted
  routing (:mod:`._routing`), layer-1 scaled GEMM whose epilogue writes the activated
  intermediate as MXFP8 (codes + scales, sorted positions), layer-2 scaled GEMM with bias and
  routing weight, torch sum over top-k (:mod:`._scaled_gemm`).

Reads the PUBLIC MXFP4 byte order (what the instruction expects), so it has no ``prepare``
hook: a plan keeps the caller's weights. gfx942 has no scaled MFMA (and its fp8 is the fnuz
flavour): there ``amd_gluon_moe_mxfp4`` serves the feature by quantize-dequantize.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_amd.ops.moe._config import scaled_gemm_config, use_gemv
from tokenspeed_kernel_amd.ops.moe._routing import sort_pairs
from tokenspeed_kernel_amd.ops.moe._scaled_gemm import moe_scaled_gemm_kernel
from tokenspeed_kernel_amd.ops.moe.fused import _supported, check_args, moe_mxfp4, quantize_x

__all__ = ["amd_gluon_moe_mxfp4_scaled", "moe_mxfp4_scaled"]


def _supported_scaled(request: Request) -> str | None:
    """Predicate: only requests with MXFP8 activations (else the 16-bit kernel is exact and
    this one would quantize what the caller did not ask to quantize), and the MXFP4 limits."""
    if "mxfp8_act" not in request.features:
        return "serves only activation_quant='mxfp8' (the scaled MFMA needs MX activations)"
    return _supported(request)


def moe_mxfp4_scaled(args: MoEApplyArgs, *, force_gemm: bool = False) -> None:
    """Run the MoE for ``args`` (``activation_quant="mxfp8"``; writes ``args.out``)."""
    num_experts, hidden, inter = check_args(args)
    if args.activation_quant != "mxfp8":
        raise ValueError("activation_quant: the scaled-MFMA kernel needs activation_quant='mxfp8'")
    ids = args.topk_ids.to(torch.int32).contiguous()
    num_tokens, top_k = ids.shape
    if use_gemv(num_tokens) and not force_gemm:
        moe_mxfp4(args)
        return
    x = args.x
    xq, xs = quantize_x(x, fake=False)
    act = ACTIVATION_CODES[args.activation]
    has_bias = args.w13_bias is not None or args.w2_bias is not None
    b13 = args.w13_bias if args.w13_bias is not None else torch.zeros((num_experts, 2 * inter), device=x.device)
    b2 = args.w2_bias if args.w2_bias is not None else torch.zeros((num_experts, hidden), device=x.device)
    w13, s13, w2, s2 = args.w13.packed, args.w13.scales, args.w2.packed, args.w2.scales
    routing = sort_pairs(ids, args.expert_map, num_experts, 32)
    num_pairs = num_tokens * top_k
    hq = torch.empty((num_pairs, inter), dtype=torch.uint8, device=x.device)
    hs = torch.empty((num_pairs, inter // 32), dtype=torch.uint8, device=x.device)
    y = torch.zeros((num_pairs, hidden), dtype=torch.float32, device=x.device)
    weights = args.topk_weights.contiguous()
    tiles = (routing.sorted_pairs, routing.tile_expert, routing.tile_row, routing.tile_rows, weights)
    c1 = scaled_gemm_config(
        n=inter, k=hidden, top_k=top_k, gated=True, activation=act, bias=has_bias, rows_sorted=False
    )
    moe_scaled_gemm_kernel[(routing.num_tiles, cdiv(inter, c1.block_n))](
        xq,
        xs,
        w13,
        s13,
        b13,
        *tiles,
        hq,
        hs,
        xq.stride(0),
        xs.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        b13.stride(0),
        hq.stride(0),
        hs.stride(0),
        num_warps=c1.num_warps,
        **c1.constexprs,
    )
    c2 = scaled_gemm_config(
        n=hidden, k=inter, top_k=top_k, gated=False, activation=act, bias=has_bias, rows_sorted=True
    )
    moe_scaled_gemm_kernel[(routing.num_tiles, cdiv(hidden, c2.block_n))](
        hq,
        hs,
        w2,
        s2,
        b2,
        *tiles,
        y,
        hs,
        hq.stride(0),
        hs.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        b2.stride(0),
        y.stride(0),
        hs.stride(0),
        num_warps=c2.num_warps,
        **c2.constexprs,
    )
    args.out.copy_(y.view(num_tokens, top_k, hidden).sum(dim=1))


@register_kernel(
    "moe.apply",
    name="amd_gluon_moe_mxfp4_scaled",
    solution="gluon",
    vendors=("rocm",),
    archs=("gfx950",),
    capabilities=("scaled_mfma",),
    dtypes={"x": (torch.bfloat16, torch.float16), "weight": (torch.uint8,)},
    features=("silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4", "mxfp8_act"),
    priority=Priority.PERFORMANT + 10,
    predicate=_supported_scaled,
)
def amd_gluon_moe_mxfp4_scaled(args: MoEApplyArgs) -> None:
    """MXFP4 weights x MXFP8 activations on gfx950: scaled-MFMA grouped GEMM for T > 8,
    quantize-dequantize warp-decode GEMVs below."""
    moe_mxfp4_scaled(args)
