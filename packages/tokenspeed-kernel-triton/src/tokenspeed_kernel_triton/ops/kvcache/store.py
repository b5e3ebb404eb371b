"""Triton KV store (``kvcache.store``): one program per token writes its K and V rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.kit import next_pow2
from tokenspeed_kernel.ops.kvcache.args import StoreArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton._interpreter import interpreted
from tokenspeed_kernel_triton._launcher import jit_launch
from tokenspeed_kernel_triton.ops.attention._common import PAGE_SIZES, Q_DTYPES, VENDOR_CAPABILITIES, VENDORS

FP8_MAX = 448.0


@triton.jit
def _round_e4m3(x):
    """Round fp32 to the nearest e4m3 value (ties to even) in fp32 arithmetic. Used under
    the interpreter only, whose fp32->fp8 cast drops the carry into the exponent. Signed
    zeros are kept (-1e-6 and -0.0 round to -0.0), as torch's and the GPU's conversions do."""
    mag = tl.abs(x)
    exp = tl.maximum(tl.floor(tl.log2(tl.maximum(mag, 1e-30))), -6.0)
    step = tl.exp2(exp - 3.0)
    v = mag / step
    r = tl.floor(v)
    frac = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)
    # The sign comes from x's sign bit, as a multiply: ``-r`` is ``0 - r`` in Triton, which
    # is +0.0 for r == 0, so a tiny negative value (or -0.0) lost its sign here while the
    # GPU's cvt keeps it (-0.0 is e4m3 0x80). A select + multiply: no branch.
    sign = tl.where(x.to(tl.int32, bitcast=True) < 0, -1.0, 1.0)
    return sign * (r * step)


@triton.jit
def _store_one(
    Src, Cache, Scale, token, page, offset, stride_st, stride_sh, stride_cp, stride_ct, stride_ch, num_heads,
    DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < DIM)
    rows = tl.load(Src + token * stride_st + h[:, None] * stride_sh + d[None, :], mask=mask)
    dst = Cache + page.to(tl.int64) * stride_cp + offset * stride_ct + h[:, None] * stride_ch + d[None, :]
    if FP8:
        scaled = rows.to(tl.float32) / tl.load(Scale)
        rows = tl.clamp(scaled, -448.0, 448.0)
        if INTERPRET:
            rows = _round_e4m3(rows)
        # NaN stays NaN (e4m3fn 0x7F), as in the reference: the clamp and some backends'
        # saturating casts would turn it into a finite value. ±inf saturate to ±448 above.
        bits = rows.to(Cache.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        bits = tl.where(scaled != scaled, tl.full((BLOCK_H, BLOCK_D), 0x7F, tl.uint8), bits)
        tl.store(dst, bits.to(Cache.dtype.element_ty, bitcast=True), mask=mask)
    else:
        tl.store(dst, rows.to(Cache.dtype.element_ty), mask=mask)


@triton.jit
def _store_rows(
    K, V, KCache, VCache, Slots, KScale, VScale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    num_heads, PAGE_SIZE: tl.constexpr, DIM_K: tl.constexpr, DIM_V: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Program (token, 0) writes the token's K rows, (token, 1) its V rows: one launch."""
    token = tl.program_id(0)
    slot = tl.load(Slots + token)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    if tl.program_id(1) == 0:
        _store_one(
            K,
            KCache,
            KScale,
            token,
            page,
            offset,
            stride_kt,
            stride_kh,
            stride_kcp,
            stride_kct,
            stride_kch,
            num_heads,
            DIM_K,
            BLOCK_H,
            BLOCK_D,
            FP8,
            INTERPRET,
        )
    else:
        _store_one(
            V,
            VCache,
            VScale,
            token,
            page,
            offset,
            stride_vt,
            stride_vh,
            stride_vcp,
            stride_vct,
            stride_vch,
            num_heads,
            DIM_V,
            BLOCK_H,
            BLOCK_D,
            FP8,
            INTERPRET,
        )


@register_kernel(
    "kvcache.store",
    name="triton_store_kvcache",
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"kv": Q_DTYPES, "cache": (*Q_DTYPES, torch.float8_e4m3fn)},
    shapes={"page_size": PAGE_SIZES},
    # any cache strides (the head dim has stride 1); k and v read through their row and head
    # strides: row-strided k/v (a fused qkv's) too
    features=("fp8_kv", "strided_kv", "strided_rows"),
    priority=Priority.PORTABLE,
)
def triton_store_kvcache(args: StoreArgs) -> None:
    """Scatter K/V rows to their slots in one launch; negative slots are skipped in the
    kernel (no sync)."""
    k, v, kc, vc = args.k, args.v, args.k_cache, args.v_cache
    num_tokens, num_heads, dim_k = k.shape
    dim_v = v.shape[2]
    # Without fp8 the scale pointers are never read: k stands in (no allocation per call).
    jit_launch(
        _store_rows,
        (num_tokens, 2),
        k,
        v,
        kc,
        vc,
        args.slot_mapping,
        args.k_scale if args.k_scale is not None else k,
        args.v_scale if args.v_scale is not None else k,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        num_heads,
        PAGE_SIZE=kc.shape[1],
        DIM_K=dim_k,
        DIM_V=dim_v,
        BLOCK_H=next_pow2(num_heads),
        BLOCK_D=next_pow2(max(dim_k, dim_v)),
        FP8=kc.dtype == torch.float8_e4m3fn,
        INTERPRET=interpreted(k.device),
        num_warps=1,
    )
