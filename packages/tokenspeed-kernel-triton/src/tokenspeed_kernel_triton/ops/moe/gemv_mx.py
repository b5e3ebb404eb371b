"""Triton MoE for tiny batches with MXFP4 weights: ``triton_moe_gemv_mx`` (opt-in).

At ``T <= 8`` tokens every (token, expert) pair is a matrix-vector product bound by the
weight bytes, so the grouped-GEMM kernels (16-row MMA tiles, mostly padding; a permutation
and a combine launch) are replaced by two GEMV launches, with no permutation, no tensor
cores (no ``tl.dot``) and no host sync (every grid is a function of ``T``, ``top_k``, ``I``,
``H``: CUDA-graph capturable):

1. :func:`gemv_w13_kernel`, grid ``(T * top_k, cdiv(I, BLOCK_N))``, axis 0 (the pair) the
   fastest: one program streams ``BLOCK_N`` gate rows and the matching ``BLOCK_N`` up rows of
   the pair's expert (``expert_map`` applied; a pair mapped to -1 returns at once), adds the
   bias, applies the activation (:func:`._gemm.activate`) and stores the intermediate
   ``[T * top_k, I]`` rounded to x's dtype (as ``triton_fused_moe`` rounds it).
2. :func:`gemv_w2_kernel`, grid ``(T, cdiv(H, BLOCK_N))``: one program streams ``BLOCK_N``
   rows of w2 for **all** ``top_k`` experts of its token at once (a ``[KP, BLOCK_N, ...]``
   tile, ``KP`` = top_k rounded up to a power of two), adds each expert's bias, multiplies by
   the routing weights and sums the choices in registers: the combine is fused, there are no
   atomics and the result is deterministic (bit-identical run to run).

**Decode.** The packed bytes are read in the public layout (``[E, N, K/2]``, low nibble =
even k), ``BLOCK_K`` values (``BLOCK_K / 2`` contiguous bytes) per row and step, as a
``[rows, BLOCK_K/32, 16]`` tile: one E8M0 scale per 16 bytes. A nibble ``c`` becomes the fp16
bit pattern ``(c & 7) << 9 | (c & 8) << 12``, which is exactly ``e2m1(c) * 2**-14`` (the
subnormal codes 0 and 0.5 land on fp16 subnormals, which the fp16 → fp32 conversion keeps):
three integer operations and one conversion per value, no table and no select. The products
with the activation (fp32, split into even/odd k to match the nibbles) are summed over each
32-value group first and the group sum is multiplied by ``2**(s - 127)`` (``s = 255``: NaN),
so the scale costs one multiply per 32 values; ``2**14`` is applied once at the end.

**Duplicates.** Each pair reads its expert's weight, so an expert chosen by several tokens
is requested once per pair. With ``T <= 8`` and 128 experts that is rare (T = 8, top-4:
about 29 of 32 pairs hit distinct experts under uniform routing), and because the pair is
the fastest grid axis, programs reading the same rows of the same expert run side by side
and the repeats are served by L2 rather than DRAM (not measured).

**Tiles** (:data:`TILES`, per vendor and token count): the best of an 8-tile H100 sweep
(2026-11-23, ``ci/device/moe_decode_sweep.py``, routing included): ``T <= 2`` 8 gate + 8 up
rows x 256 K values per step and layer 2 ``KP`` x 4 rows x 256 (T = 1: 4 x 360 = 1440 and
720 programs), ``T = 3..8`` 16 + 16 rows x 128 and ``KP`` x 8 x 128, all with 4 warps. Against
the first, untuned tile (32 rows x 256, ``KP`` x 16 x 256) that is 1.22x at T = 1, 1.11x at
T = 2, 1.13x at T = 4 and 8. ROCm uses the same rows, unmeasured.

**Gating.** ``Priority.PORTABLE + 20``, above ``triton_fused_moe_mx``: on an H100 its numerics
pass (6/6 against float64, plan and CUDA-graph replay equal to eager) and, with the swept
tiles, it is 1.24-1.37x faster than ``triton_fused_moe_mx`` at T = 1, 2, 4, 8 (T = 1: 55.6-59.1
µs with routing; docs/history.md, "MoE decode (T <= 8)"). The predicate
rejects ``T > 8`` (the request's ``num_tokens_bucket``, the next power of two >= T, so
``bucket <= 8`` is exactly ``T <= 8``); ``moe_plan`` selects per token bucket, so a plan runs
it for ``T <= 8`` and the grouped GEMM above. Called directly with more than 8 tokens (an
``override`` plan) it hands the call to ``triton_fused_moe``'s functional path. No ``prepare``
hook: the public layout is what the kernel reads. Runs under the Triton interpreter (CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv, next_pow2, vendor_of
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_triton._launcher import jit_launch
from tokenspeed_kernel_triton.ops.moe._common import ACT_DTYPES, VENDOR_CAPABILITIES, VENDORS
from tokenspeed_kernel_triton.ops.moe._gemm import activate

__all__ = [
    "FEATURES",
    "GEMV_REGISTRATION",
    "MAX_TOKENS",
    "TILES",
    "GemvTile",
    "gemv_moe",
    "gemv_predicate",
    "gemv_w2_kernel",
    "gemv_w13_kernel",
    "pick_gemv_tiles",
    "triton_moe_gemv_mx",
    "w2_block_n",
]

MAX_TOKENS = 8  # above this the weight of an expert is worth reusing across tokens (GEMM)


@dataclass(frozen=True)
class GemvTile:
    """One GEMV launch configuration. ``block_n`` rows (layer 1: gate rows, plus as many up
    rows; layer 2: rows per choice), ``block_k`` K values per step (a multiple of 32 and a
    power of two), ``num_warps``."""

    block_n: int
    block_k: int
    num_warps: int


@dataclass(frozen=True)
class GemvTiles:
    """The tiles for calls of up to ``max_tokens`` tokens. Layer 2 holds ``w2_rows`` rows of
    w2 per program and K step in total, over the ``KP`` (top-k rounded up to a power of two)
    choices: :func:`w2_block_n` rows each."""

    max_tokens: int
    w13: GemvTile
    w2_rows: int
    w2_block_k: int
    w2_warps: int


# Per vendor, ascending ``max_tokens`` (the last row serves up to MAX_TOKENS); the interpreter
# ("cpu") uses the NVIDIA rows. NVIDIA: the best of an H100 sweep; ROCm: a copy, never
# measured (see the module docstring).
_NVIDIA_TILES = (GemvTiles(2, GemvTile(8, 256, 4), 16, 256, 4), GemvTiles(MAX_TOKENS, GemvTile(16, 128, 4), 32, 128, 4))
TILES: dict[str, tuple[GemvTiles, ...]] = {"cuda": _NVIDIA_TILES, "rocm": _NVIDIA_TILES}


def w2_block_n(top_k: int, w2_rows: int) -> int:
    """Layer-2 rows per choice: ``w2_rows`` over the padded top-k, at least 4."""
    return max(4, w2_rows // next_pow2(top_k))


def pick_gemv_tiles(vendor: str, top_k: int, num_tokens: int) -> tuple[GemvTile, GemvTile]:
    """The (layer 1, layer 2) tiles for ``vendor`` (``"cpu"`` = the NVIDIA rows) and
    ``num_tokens`` (counts above the last row use it), layer 2's rows resolved for ``top_k``."""
    rows = TILES["rocm" if vendor == "rocm" else "cuda"]
    row = next((r for r in rows if num_tokens <= r.max_tokens), rows[-1])
    return row.w13, GemvTile(w2_block_n(top_k, row.w2_rows), row.w2_block_k, row.w2_warps)


# ---------------------------------------------------------------- kernels


@triton.jit
def _e8m0(s):
    """int32 E8M0 exponents → float32 ``2 ** (s - 127)``; 255 is NaN, 0 flushes to 0."""
    return tl.where(s == 255, float("nan"), (s << 23).to(tl.float32, bitcast=True))


@triton.jit
def _group_sums(packed, a_even, a_odd, AXIS: tl.constexpr):
    """``sum_j e2m1(lo_j) * a_even_j + e2m1(hi_j) * a_odd_j`` over the 16 bytes of each
    32-value group (``AXIS``, the last one), times ``2 ** -14``.

    packed: int32 bytes ``[..., G, 16]`` (low nibble = even k); a_even/a_odd: float32
    activations at the even/odd k of each group, broadcastable to packed's shape. A nibble
    ``c`` as the fp16 bit pattern ``(c & 7) << 9 | (c & 8) << 12`` is ``e2m1(c) * 2**-14``
    exactly (codes 0 and 1 are fp16 subnormals)."""
    lo = ((packed << 9) & 0x0E00) | ((packed << 12) & 0x8000)
    hi = ((packed << 5) & 0x0E00) | ((packed << 8) & 0x8000)
    w_lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    w_hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.sum(w_lo * a_even + w_hi * a_odd, axis=AXIS)


@triton.jit
def gemv_w13_kernel(
    X, W, S, Bias, Hid, Ids, ExpertMap,
    N, K,
    stride_xt, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_ht,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 1 of one pair (program axis 0) for ``BLOCK_N`` intermediate columns (axis 1).

    X: x ``[T, K]``; W: w13 packed uint8 ``[E, 2N, K/2]``; S: E8M0 scales ``[E, 2N, K/32]``;
    Bias: ``[E, 2N]``; Hid: ``[T * TOP_K, N]`` (x's dtype), row = pair; Ids: int32 ``[T * TOP_K]``.
    ``EVEN_K``: ``K % BLOCK_K == 0`` (else the 32-value groups past K are masked)."""
    pair = tl.program_id(0)
    expert = tl.load(Ids + pair)
    if HAS_MAP:
        expert = tl.load(ExpertMap + expert)
    if expert < 0:  # not on this rank: layer 2 masks this pair, the row is never read
        return
    G: tl.constexpr = BLOCK_K // 32
    token = pair // TOP_K
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    groups = tl.arange(0, G)
    j = tl.arange(0, 16)
    e64 = expert.to(tl.int64)
    w_gate = W + e64 * stride_we + rows.to(tl.int64)[:, None, None] * stride_wn  # [BLOCK_N, 1, 1]
    w_up = w_gate + N * stride_wn
    s_gate = S + e64 * stride_se + rows.to(tl.int64)[:, None] * stride_sn  # [BLOCK_N, 1]
    s_up = s_gate + N * stride_sn
    x_row = X + token.to(tl.int64) * stride_xt
    acc_g = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, G), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        grp = k0 // 32 + groups  # [G] global group index
        byte = (grp[:, None] * 16 + j[None, :]) * stride_wk  # [G, 16]
        xk = grp[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
        if EVEN_K:
            w_mask = row_ok[:, None, None]
            s_mask = row_ok[:, None]
            xv = tl.load(x_row + xk)
        else:
            g_ok = grp < K // 32
            w_mask = row_ok[:, None, None] & g_ok[None, :, None]
            s_mask = row_ok[:, None] & g_ok[None, :]
            xv = tl.load(x_row + xk, mask=g_ok[:, None], other=0.0)
        pg = tl.load(w_gate + byte[None, :, :], mask=w_mask, other=0).to(tl.int32)
        pu = tl.load(w_up + byte[None, :, :], mask=w_mask, other=0).to(tl.int32)
        sg = tl.load(s_gate + grp[None, :] * stride_sk, mask=s_mask, other=127).to(tl.int32)
        su = tl.load(s_up + grp[None, :] * stride_sk, mask=s_mask, other=127).to(tl.int32)
        x_even, x_odd = tl.split(tl.reshape(xv.to(tl.float32), (G, 16, 2)))
        acc_g += _group_sums(pg, x_even[None, :, :], x_odd[None, :, :], 2) * _e8m0(sg)
        acc_u += _group_sums(pu, x_even[None, :, :], x_odd[None, :, :], 2) * _e8m0(su)
    gate = tl.sum(acc_g, axis=1) * 16384.0
    up = tl.sum(acc_u, axis=1) * 16384.0
    if HAS_BIAS:
        b_row = Bias + e64 * stride_be
        gate += tl.load(b_row + rows, mask=row_ok, other=0.0).to(tl.float32)
        up += tl.load(b_row + N + rows, mask=row_ok, other=0.0).to(tl.float32)
    act = activate(gate, up, ACTIVATION)
    tl.store(Hid + pair.to(tl.int64) * stride_ht + rows, act.to(Hid.dtype.element_ty), mask=row_ok)


@triton.jit
def gemv_w2_kernel(
    Hid, W, S, Bias, Out, Ids, ExpertMap, TopkWeights,
    N, K,
    stride_ht, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_ot,
    TOP_K: tl.constexpr, KP: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 2 and the combine of one token (program axis 0) for ``BLOCK_N`` output columns.

    Hid: the intermediate ``[T * TOP_K, K]``; W: w2 packed ``[E, N, K/2]``; S: ``[E, N, K/32]``;
    Bias: ``[E, N]``; Out: ``[T, N]`` (x's dtype) = ``sum_j w_j * (h_j @ w2[e_j].T + b[e_j])``
    in float32, the ``TOP_K`` choices held as a ``KP``-row tile and summed in registers."""
    token = tl.program_id(0).to(tl.int64)
    G: tl.constexpr = BLOCK_K // 32
    choice = tl.arange(0, KP)
    c_ok = choice < TOP_K
    pairs = token * TOP_K + choice  # [KP]
    experts = tl.load(Ids + pairs, mask=c_ok, other=-1)
    if HAS_MAP:
        experts = tl.load(ExpertMap + experts, mask=c_ok, other=-1)
    live = c_ok & (experts >= 0)
    e64 = tl.where(live, experts, 0).to(tl.int64)
    weight = tl.load(TopkWeights + pairs, mask=live, other=0.0)  # [KP]
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    groups = tl.arange(0, G)
    j = tl.arange(0, 16)
    ok2 = live[:, None] & row_ok[None, :]  # [KP, BLOCK_N]
    w_base = W + e64[:, None, None, None] * stride_we + rows.to(tl.int64)[None, :, None, None] * stride_wn
    s_base = S + e64[:, None, None] * stride_se + rows.to(tl.int64)[None, :, None] * stride_sn
    h_base = Hid + pairs[:, None, None] * stride_ht  # [KP, 1, 1]
    acc = tl.zeros((KP, BLOCK_N, G), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        grp = k0 // 32 + groups
        byte = (grp[:, None] * 16 + j[None, :]) * stride_wk  # [G, 16]
        hk = grp[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
        if EVEN_K:
            w_mask = ok2[:, :, None, None]
            s_mask = ok2[:, :, None]
            h_mask = live[:, None, None]
        else:
            g_ok = grp < K // 32
            w_mask = ok2[:, :, None, None] & g_ok[None, None, :, None]
            s_mask = ok2[:, :, None] & g_ok[None, None, :]
            h_mask = live[:, None, None] & g_ok[None, :, None]
        packed = tl.load(w_base + byte[None, None, :, :], mask=w_mask, other=0).to(tl.int32)
        s = tl.load(s_base + grp[None, None, :] * stride_sk, mask=s_mask, other=127).to(tl.int32)
        hv = tl.load(h_base + hk[None, :, :], mask=h_mask, other=0.0).to(tl.float32)  # [KP, G, 32]
        h_even, h_odd = tl.split(tl.reshape(hv, (KP, G, 16, 2)))
        acc += _group_sums(packed, h_even[:, None, :, :], h_odd[:, None, :, :], 3) * _e8m0(s)
    y = tl.sum(acc, axis=2) * 16384.0  # [KP, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(Bias + e64[:, None] * stride_be + rows[None, :], mask=ok2, other=0.0).to(tl.float32)
    y = tl.where(live[:, None], y, 0.0)  # a remote choice contributes nothing (not even 0 * NaN)
    out = tl.sum(y * weight[:, None], axis=0)
    tl.store(Out + token * stride_ot + rows, out.to(Out.dtype.element_ty), mask=row_ok)


# ---------------------------------------------------------------- host


def gemv_moe(args: MoEApplyArgs, tiles: tuple[GemvTile, GemvTile] | None = None) -> None:
    """The two launches for ``args`` (writes ``args.out``); ``tiles`` overrides the table
    (layer 2's ``block_n`` is rows per choice). Any T works; the registration limits it to 8."""
    x, ids, w13, w2 = args.x, args.topk_ids, args.w13, args.w2
    if not isinstance(w13, MXFP4Weight) or not isinstance(w2, MXFP4Weight):
        raise TypeError("triton_moe_gemv_mx takes MXFP4 weights only")
    num_tokens, top_k = ids.shape
    hidden, inter = x.shape[1], w2.shape[-1]
    t13, t2 = tiles or pick_gemv_tiles(vendor_of(x.device), top_k, num_tokens)
    hid = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    emap = args.expert_map
    b13, b2 = args.w13_bias, args.w2_bias
    p13, s13, p2, s2 = w13.packed, w13.scales, w2.packed, w2.scales
    jit_launch(
        gemv_w13_kernel,
        (num_tokens * top_k, cdiv(inter, t13.block_n)),
        x,
        p13,
        s13,
        x if b13 is None else b13,
        hid,
        ids,
        ids if emap is None else emap,
        inter,
        hidden,
        x.stride(0),
        *p13.stride(),
        *s13.stride(),
        0 if b13 is None else b13.stride(0),
        hid.stride(0),
        TOP_K=top_k,
        HAS_MAP=emap is not None,
        HAS_BIAS=b13 is not None,
        ACTIVATION=ACTIVATION_CODES[args.activation],
        BLOCK_N=t13.block_n,
        BLOCK_K=t13.block_k,
        EVEN_K=hidden % t13.block_k == 0,
        num_warps=t13.num_warps,
    )
    jit_launch(
        gemv_w2_kernel,
        (num_tokens, cdiv(hidden, t2.block_n)),
        hid,
        p2,
        s2,
        x if b2 is None else b2,
        args.out,
        ids,
        ids if emap is None else emap,
        args.topk_weights,
        hidden,
        inter,
        hid.stride(0),
        *p2.stride(),
        *s2.stride(),
        0 if b2 is None else b2.stride(0),
        args.out.stride(0),
        TOP_K=top_k,
        KP=next_pow2(top_k),
        HAS_MAP=emap is not None,
        HAS_BIAS=b2 is not None,
        BLOCK_N=t2.block_n,
        BLOCK_K=t2.block_k,
        EVEN_K=inter % t2.block_k == 0,
        num_warps=t2.num_warps,
    )


FEATURES = ("silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4")


def gemv_predicate(request: Request) -> str | None:
    """MXFP4 weights only; at most ``MAX_TOKENS`` tokens (read from ``num_tokens_bucket``,
    the next power of two >= T, so ``bucket <= 8`` iff ``T <= 8``; a plan has no bucket)."""
    if "mxfp4" not in request.features:
        return "MXFP4 weights only (E2M1 GEMV decode)"
    bucket = request.shape("num_tokens_bucket")
    if bucket is not None and bucket > MAX_TOKENS:
        return f"num_tokens_bucket={bucket} > {MAX_TOKENS}: the GEMV MoE serves T <= {MAX_TOKENS} tokens"
    return None


# Registration metadata (data). Above triton_fused_moe_mx (PORTABLE + 10) for T <= 8: measured
# correct and faster on an H100.
GEMV_REGISTRATION = {
    "solution": "triton",
    "vendors": VENDORS,
    "vendor_capabilities": VENDOR_CAPABILITIES,
    "dtypes": {"x": ACT_DTYPES, "weight": (torch.uint8,)},
    "features": FEATURES,
    "priority": Priority.PORTABLE + 20,
    "predicate": gemv_predicate,
}


@register_kernel("moe.apply", name="triton_moe_gemv_mx", **GEMV_REGISTRATION)
def triton_moe_gemv_mx(args: MoEApplyArgs) -> None:
    """MXFP4 MoE for T <= 8: two GEMV launches (w13 + bias + activation; w2 + bias + routing
    weight + combine), in-register E2M1 decode, no permutation, no tensor cores."""
    if args.topk_ids.shape[0] > MAX_TOKENS:  # a plan (selected without T) called with more tokens
        from tokenspeed_kernel_triton.ops.moe.fused import fused_moe

        fused_moe(args)
        return
    gemv_moe(args)
