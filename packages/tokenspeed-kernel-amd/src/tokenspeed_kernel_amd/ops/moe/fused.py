"""Gluon MXFP4 MoE (``moe.apply``): warp-decode GEMVs for tiny batches, grouped GEMM otherwise.

Regimes (chosen per call on the host from the token count, see :mod:`._config`):

- warp decode (``T <= GEMV_MAX_TOKENS``): two launches, no permutation. Layer 1 reads the
  routing in-kernel (ids, expert map) and runs the gate/up GEMVs + bias + activation for one
  (token, choice) pair per program row; layer 2 runs the ``top_k`` down-projection GEMVs of
  one token, weights and sums them in choice order (deterministic, no combine launch).
- grouped GEMM: pairs sorted by expert with torch ops (:mod:`._routing`), layer-1 GEMM with
  bias + activation epilogue, layer-2 GEMM with bias + routing-weight epilogue, then the
  per-token sum of the ``top_k`` rows.

MXFP4 is dequantized in registers to x's dtype on both gfx942 and gfx950 (bf16/fp16 MFMA).
Weights planned through ``moe_plan`` are in the halves byte order (:mod:`._prepare`); the
functional path reads the public order.

``activation_quant="mxfp8"`` (feature ``mxfp8_act``) is served here by quantize-dequantize on
the 16-bit path, on both archs: x is fake-quantized once by :func:`._mxfp8.mxfp8_quant_kernel`
(values exact in bf16/fp16) and layer 1 fake-quantizes its activated output in registers
(``QUANT_OUT``), so both GEMMs multiply exactly the MXFP8 values of the contract. On gfx950
the scaled-MFMA kernel (:mod:`.fused_scaled`) outranks this one for that feature.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_amd._arch import arch_config, device_arch
from tokenspeed_kernel_amd.ops.moe._config import gemm_config, gemv2_config, gemv13_config, quant_config, use_gemv
from tokenspeed_kernel_amd.ops.moe._kernels import moe_gemm_kernel, moe_gemv2_kernel, moe_gemv13_kernel
from tokenspeed_kernel_amd.ops.moe._mxfp8 import mxfp8_quant_kernel
from tokenspeed_kernel_amd.ops.moe._prepare import PreparedMoE, prepare_moe
from tokenspeed_kernel_amd.ops.moe._routing import sort_pairs

__all__ = ["amd_gluon_moe_mxfp4", "check_args", "moe_mxfp4", "quantize_x"]

MAX_EXPERTS = 1024


def _supported(request: Request) -> str | None:
    """Predicate: MXFP4 weights only, K dims multiples of 64 (one 32-byte group per step)."""
    if "mxfp4" not in request.features:
        return "only MXFP4 weights (uint8 storage)"
    for key in ("hidden", "intermediate"):
        value = request.shape(key)
        if value is not None and value % 64:
            return f"{key}={value} is not a multiple of 64"
    experts = request.shape("num_experts")
    if experts is not None and experts > MAX_EXPERTS:
        return f"num_experts={experts} exceeds {MAX_EXPERTS}"
    return None


def check_args(args: MoEApplyArgs) -> tuple[int, int, int]:
    """Guards for direct calls beyond the core's validation. Returns ``(E, H, I)``."""
    if not isinstance(args.w13, MXFP4Weight) or not isinstance(args.w2, MXFP4Weight):
        raise TypeError("w13/w2: the AMD Gluon MoE kernel takes MXFP4Weight weights")
    num_experts, two_i, hidden = args.w13.shape
    inter = args.w2.shape[-1]
    if hidden % 64 or inter % 64 or two_i != 2 * inter:
        raise ValueError(f"w13/w2: hidden ({hidden}) and intermediate ({inter}) must be multiples of 64")
    if args.x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"x: dtype must be bfloat16 or float16, got {args.x.dtype}")
    return num_experts, hidden, inter


def quantize_x(x: torch.Tensor, *, fake: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """MXFP8 of ``x [T, K]`` (``K % 32 == 0``) by :func:`._mxfp8.mxfp8_quant_kernel`:
    ``fake=True`` → (dequantized values in x's dtype ``[T, K]``, None); ``fake=False`` →
    (uint8 e4m3 codes ``[T, K]``, uint8 E8M0 scales ``[T, K/32]``)."""
    num_rows, k = x.shape
    cfg = quant_config(fake=fake)
    q = torch.empty_like(x) if fake else torch.empty((num_rows, k), dtype=torch.uint8, device=x.device)
    scales = None if fake else torch.empty((num_rows, k // 32), dtype=torch.uint8, device=x.device)
    dummy = q if scales is None else scales
    mxfp8_quant_kernel[(cdiv(num_rows, cfg.block), k // 32)](
        x, q, dummy, num_rows, x.stride(0), q.stride(0), dummy.stride(0), num_warps=cfg.num_warps, **cfg.constexprs
    )
    return q, scales


def moe_mxfp4(args: MoEApplyArgs, *, force_gemm: bool = False) -> None:
    """Run the MoE for ``args`` (writes ``args.out``)."""
    num_experts, hidden, inter = check_args(args)
    quant = args.activation_quant == "mxfp8"
    x = quantize_x(args.x, fake=True)[0] if quant else args.x
    ids = args.topk_ids.to(torch.int32).contiguous()
    num_tokens, top_k = ids.shape
    prepared = args.prepared if isinstance(args.prepared, PreparedMoE) else None
    if prepared is not None:
        w13, s13, w2, s2, halves = (
            prepared.w13_packed,
            prepared.w13_scales,
            prepared.w2_packed,
            prepared.w2_scales,
            True,
        )
    else:
        w13, s13, w2, s2, halves = args.w13.packed, args.w13.scales, args.w2.packed, args.w2.scales, False
    act = ACTIVATION_CODES[args.activation]
    has_bias = args.w13_bias is not None or args.w2_bias is not None
    b13 = args.w13_bias if args.w13_bias is not None else torch.zeros((num_experts, 2 * inter), device=x.device)
    b2 = args.w2_bias if args.w2_bias is not None else torch.zeros((num_experts, hidden), device=x.device)
    emap = ids if args.expert_map is None else args.expert_map
    weights = args.topk_weights.contiguous()
    strides13 = (w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), b13.stride(0))
    strides2 = (w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), b2.stride(0))
    if use_gemv(num_tokens) and not force_gemm:
        a = torch.empty((num_tokens * top_k, inter), dtype=torch.float32, device=x.device)
        c1 = gemv13_config(
            hidden=hidden,
            inter=inter,
            top_k=top_k,
            activation=act,
            bias=has_bias,
            expert_map=args.expert_map is not None,
            halves=halves,
            quant_out=quant,
        )
        moe_gemv13_kernel[(num_tokens * top_k, cdiv(inter, c1.block))](
            x,
            w13,
            s13,
            b13,
            ids,
            emap,
            a,
            x.stride(0),
            *strides13,
            a.stride(0),
            num_warps=c1.num_warps,
            **c1.constexprs,
        )
        c2 = gemv2_config(
            hidden=hidden,
            inter=inter,
            top_k=top_k,
            bias=has_bias,
            expert_map=args.expert_map is not None,
            halves=halves,
        )
        moe_gemv2_kernel[(num_tokens, cdiv(hidden, c2.block))](
            a,
            w2,
            s2,
            b2,
            ids,
            weights,
            emap,
            args.out,
            a.stride(0),
            *strides2,
            args.out.stride(0),
            num_warps=c2.num_warps,
            **c2.constexprs,
        )
        return
    arch = arch_config(device_arch(x.device.index or 0))
    block_m = 32
    routing = sort_pairs(ids, args.expert_map, num_experts, block_m)
    num_pairs = num_tokens * top_k
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.zeros((num_pairs, hidden), dtype=torch.float32, device=x.device)
    tiles = (routing.sorted_pairs, routing.tile_expert, routing.tile_row, routing.tile_rows, weights, emap)
    c1 = gemm_config(
        arch,
        n=inter,
        k=hidden,
        top_k=top_k,
        gated=True,
        activation=act,
        bias=has_bias,
        halves=halves,
        rows_sorted=False,
        block_m=block_m,
        quant_out=quant,
    )
    moe_gemm_kernel[(routing.num_tiles, cdiv(inter, c1.block_n))](
        x,
        w13,
        s13,
        b13,
        *tiles,
        h,
        x.stride(0),
        *strides13,
        h.stride(0),
        num_warps=c1.num_warps,
        **c1.constexprs,
    )
    c2 = gemm_config(
        arch,
        n=hidden,
        k=inter,
        top_k=top_k,
        gated=False,
        activation=act,
        bias=has_bias,
        halves=halves,
        rows_sorted=True,
        block_m=block_m,
    )
    moe_gemm_kernel[(routing.num_tiles, cdiv(hidden, c2.block_n))](
        h,
        w2,
        s2,
        b2,
        *tiles,
        y,
        h.stride(0),
        *strides2,
        y.stride(0),
        num_warps=c2.num_warps,
        **c2.constexprs,
    )
    args.out.copy_(y.view(num_tokens, top_k, hidden).sum(dim=1))


@register_kernel(
    "moe.apply",
    name="amd_gluon_moe_mxfp4",
    solution="gluon",
    vendors=("rocm",),
    archs=("gfx942", "gfx950"),
    capabilities=("mfma",),
    dtypes={"x": (torch.bfloat16, torch.float16), "weight": (torch.uint8,)},
    features=("silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4", "mxfp8_act"),
    priority=Priority.PERFORMANT,
    predicate=_supported,
    prepare=prepare_moe,
)
def amd_gluon_moe_mxfp4(args: MoEApplyArgs) -> None:
    """MXFP4 MoE on CDNA: fused-routing warp-decode GEMVs for T <= 8, expert-sorted grouped
    GEMM (dequantize to bf16/fp16 in registers, MFMA) above; ``activation_quant="mxfp8"`` by
    quantize-dequantize in registers on the same path."""
    moe_mxfp4(args)
