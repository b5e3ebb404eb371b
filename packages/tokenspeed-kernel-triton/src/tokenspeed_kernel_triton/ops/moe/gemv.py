"""Triton MoE for tiny batches as two GEMV launches: ``triton_moe_gemv_mx`` (MXFP4 weights) and
the opt-in ``triton_moe_gemv`` (bf16/fp16/fp32 weights in x's dtype).

At ``T <= 8`` tokens every (token, expert) pair is a matrix-vector product bound by the
weight bytes, so the grouped-GEMM kernels (16-row MMA tiles, mostly padding; a permutation
and a combine launch) are replaced by two GEMV launches, with no permutation, no tensor
cores (no ``tl.dot``) and no host sync (every grid is a function of ``T``, ``top_k``, ``I``,
``H``: CUDA-graph capturable). One pair of kernels serves both weight formats; the
constexpr ``MX`` picks the inner loop (:func:`_w13_mx` / :func:`_w13_plain`,
:func:`_w2_mx` / :func:`_w2_plain`), the rest (routing, expert map, bias, activation,
routing weight, combine) is shared:

1. :func:`gemv_w13_kernel`, grid ``(T * top_k, cdiv(I, BLOCK_N))``, axis 0 (the pair) the
   fastest: one program streams ``BLOCK_N`` gate rows and the matching ``BLOCK_N`` up rows of
   the pair's expert (``expert_map`` applied; a pair mapped to -1 returns at once), adds the
   bias, applies the activation (:func:`._gemm.activate`) and stores the intermediate
   ``[T * top_k, I]`` rounded to x's dtype (as ``triton_fused_moe`` rounds it).
2. :func:`gemv_w2_kernel`, grid ``(T, cdiv(H, BLOCK_N))``: one program streams ``BLOCK_N``
   rows of w2 for **all** ``top_k`` experts of its token at once (a ``[KP, BLOCK_N, ...]``
   tile, ``KP`` = top_k rounded up to a power of two), adds each expert's bias, multiplies by
   the routing weights and sums the choices in registers: the combine is fused, there are no
   atomics and no zeroing, and the result is deterministic (bit-identical run to run).

**MXFP4 decode.** The packed bytes are read in the public layout (``[E, N, K/2]``, low
nibble = even k), ``BLOCK_K`` values (``BLOCK_K / 2`` contiguous bytes) per row and step, as a
``[rows, BLOCK_K/32, 16]`` tile: one E8M0 scale per 16 bytes. A nibble ``c`` becomes the fp16
bit pattern ``(c & 7) << 9 | (c & 8) << 12``, which is exactly ``e2m1(c) * 2**-14`` (the
subnormal codes 0 and 0.5 land on fp16 subnormals, which the fp16 → fp32 conversion keeps):
three integer operations and one conversion per value, no table and no select. The products
with the activation (fp32, split into even/odd k to match the nibbles) are summed over each
32-value group first and the group sum is multiplied by ``2**(s - 127)`` (``s = 255``: NaN),
so the scale costs one multiply per 32 values; ``2**14`` is applied once at the end.

**16/32-bit weights.** A K step loads a ``[BLOCK_N, BLOCK_K]`` tile of each matrix (rows
contiguous in K: vector loads), converts it to float32 and accumulates the products with the
activation elementwise in a float32 ``[BLOCK_N, BLOCK_K]`` (layer 2: ``[KP, BLOCK_N,
BLOCK_K]``) register tile; the K reduction happens once, after the loop. K tails are masked
per value (any ``H``, ``I``).

**Duplicates.** Each pair reads its expert's weight, so an expert chosen by several tokens
is requested once per pair. With ``T <= 8`` and 128 experts that is rare (T = 8, top-4:
about 29 of 32 pairs hit distinct experts under uniform routing), and because the pair is
the fastest grid axis, programs reading the same rows of the same expert run side by side
and the repeats are served by L2 rather than DRAM (not measured).

**Token limit** (:data:`MAX_TOKENS` = 8, both formats). The grouped GEMM reads each expert
that was hit once; the GEMV reads it once per pair that chose it. Under uniform routing over
128 experts (top-4) the pairs per distinct expert are 1.00 at T = 1, 1.05 at T = 4, 1.11 at
T = 8, 1.26 at T = 16 and 1.57 at T = 32: up to 8 tokens the extra requests are few (and may
hit L2, above), from 16 on they add a quarter or more to the bytes, which the grouped GEMM
(``triton_fused_moe``: 91% of copy bandwidth at T = 8 with bf16 weights on an H200) does
not pay. Layer 2's ``[KP, BLOCK_N, BLOCK_K]`` tile and the
``[T * top_k, I]`` intermediate do not grow with the limit. Above it a plan runs the grouped
GEMM (the predicate), and a call with more tokens (an ``override`` plan) is handed to
``triton_fused_moe``.

**Tiles** (:data:`TILES`, per weight format, vendor and token count). MXFP4: the best of an
8-tile H100 sweep (2026-11-23, ``ci/device/moe_decode_sweep.py``, routing included): ``T <= 2``
8 gate + 8 up rows x 256 K values per step and layer 2 ``KP`` x 4 rows x 256 (T = 1: 4 x 360
= 1440 and 720 programs), ``T = 3..8`` 16 + 16 rows x 128 and ``KP`` x 8 x 128, all with 4
warps. Against the first, untuned tile (32 rows x 256, ``KP`` x 16 x 256) that is 1.22x at
T = 1, 1.11x at T = 2, 1.13x at T = 4 and 8. 16/32-bit weights: the same rows and K values
per step (four times the bytes per step: 8 KiB per layer-1 program and step in bf16), never
measured (``moe_decode_sweep.py --sections gemv16`` sweeps them). ROCm uses the NVIDIA rows,
unmeasured.

**Gating.** ``triton_moe_gemv_mx``: ``Priority.PORTABLE + 20``, above ``triton_fused_moe_mx``:
on an H100 its numerics pass (6/6 against float64, plan and CUDA-graph replay equal to eager)
and, with the swept tiles, it is 1.24-1.37x faster than ``triton_fused_moe_mx`` at T = 1, 2, 4,
8 (T = 1: 55.6-59.1 µs with routing; docs/history.md, "MoE decode (T <= 8)").
``triton_moe_gemv``: ``Priority.OPT_IN + 10`` (opt-in: built and tested under the interpreter,
never run on a GPU; it serves a call when an ``override`` names it or no portable kernel
does), to be re-ranked per token bucket (``rank_when``) where a GPU measures it faster than
``triton_fused_moe``. Both predicates reject ``T > 8`` (the request's ``num_tokens_bucket``,
the next power of two >= T, so ``bucket <= 8`` is exactly ``T <= 8``); ``moe_plan`` selects
per token bucket, so a plan runs them for ``T <= 8`` and the grouped GEMM above.

**Host paths.** No ``prepare`` hook: the public layout is what the kernels read. A plan binds
both launches once per token count (:func:`bind_gemv`: the intermediate as the runner's
workspace, weights, biases and map bound; a call launches layer 1 with its x and routing ids
and layer 2 with its routing and out). A functional call runs the runner of its key
(:data:`_RUNNERS`, one cache per registration, ``tokenspeed_kernel_triton._runners``: every
tensor passed per run, the intermediate allocated per run). Under the Triton interpreter both
take ``jit_launch`` with the full arguments (CPU tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv, next_pow2, vendor_of
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache
from tokenspeed_kernel_triton.ops.moe import fused
from tokenspeed_kernel_triton.ops.moe._common import ACT_DTYPES, VENDOR_CAPABILITIES, VENDORS
from tokenspeed_kernel_triton.ops.moe._driver import Runner, bind_call, runner_key
from tokenspeed_kernel_triton.ops.moe._gemm import activate

__all__ = [
    "FEATURES",
    "GEMV_REGISTRATION",
    "MAX_TOKENS",
    "PLAIN_FEATURES",
    "PLAIN_REGISTRATION",
    "TILES",
    "GemvTile",
    "GemvTiles",
    "bind_gemv",
    "gemv_launches",
    "gemv_moe",
    "gemv_predicate",
    "gemv_w2_kernel",
    "gemv_w13_kernel",
    "pick_gemv_tiles",
    "plain_gemv_predicate",
    "triton_moe_gemv",
    "triton_moe_gemv_mx",
    "w2_block_n",
]

MAX_TOKENS = 8  # above this the weight of an expert is worth reusing across tokens (GEMM)


@dataclass(frozen=True)
class GemvTile:
    """One GEMV launch configuration. ``block_n`` rows (layer 1: gate rows, plus as many up
    rows; layer 2: rows per choice), ``block_k`` K values per step (a power of two; a multiple
    of 32 for MXFP4), ``num_warps``."""

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


# Per weight format ("mxfp4", "plain"), then vendor, ascending ``max_tokens`` (the last row
# serves up to MAX_TOKENS); the interpreter ("cpu") uses the NVIDIA rows. MXFP4 NVIDIA: the
# best of an H100 sweep; plain: the same rows, never measured; ROCm: copies, never measured
# (see the module docstring).
_NVIDIA_TILES = (GemvTiles(2, GemvTile(8, 256, 4), 16, 256, 4), GemvTiles(MAX_TOKENS, GemvTile(16, 128, 4), 32, 128, 4))
_PLAIN_TILES = (GemvTiles(2, GemvTile(8, 256, 4), 16, 256, 4), GemvTiles(MAX_TOKENS, GemvTile(16, 128, 4), 32, 128, 4))
TILES: dict[str, dict[str, tuple[GemvTiles, ...]]] = {
    "mxfp4": {"cuda": _NVIDIA_TILES, "rocm": _NVIDIA_TILES},
    "plain": {"cuda": _PLAIN_TILES, "rocm": _PLAIN_TILES},
}


def w2_block_n(top_k: int, w2_rows: int) -> int:
    """Layer-2 rows per choice: ``w2_rows`` over the padded top-k, at least 4."""
    return max(4, w2_rows // next_pow2(top_k))


def pick_gemv_tiles(vendor: str, top_k: int, num_tokens: int, weights: str = "mxfp4") -> tuple[GemvTile, GemvTile]:
    """The (layer 1, layer 2) tiles for ``weights`` (``"mxfp4"`` or ``"plain"``), ``vendor``
    (``"cpu"`` = the NVIDIA rows) and ``num_tokens`` (counts above the last row use it), layer
    2's rows resolved for ``top_k``."""
    rows = TILES[weights]["rocm" if vendor == "rocm" else "cuda"]
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
def _w13_mx(
    x_row, w_gate, w_up, s_gate, s_up, row_ok, K, stride_wk, stride_sk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 1's MXFP4 main loop: ``(gate, up)`` float32 ``[BLOCK_N]``, the rows' dot products
    with x. w_gate/w_up: ``[BLOCK_N, 1, 1]`` pointers to each row's first packed byte;
    s_gate/s_up: ``[BLOCK_N, 1]`` pointers to each row's first scale; x_row: x's row."""
    G: tl.constexpr = BLOCK_K // 32
    groups = tl.arange(0, G)
    j = tl.arange(0, 16)
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
    return tl.sum(acc_g, axis=1) * 16384.0, tl.sum(acc_u, axis=1) * 16384.0


@triton.jit
def _w13_plain(
    x_row, w_gate, w_up, row_ok, K, stride_wk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 1's main loop for weights in x's dtype: ``(gate, up)`` float32 ``[BLOCK_N]``.
    w_gate/w_up: ``[BLOCK_N, 1]`` pointers to each row's first value; x_row: x's row. The
    products accumulate elementwise in float32 and are reduced over K once, at the end."""
    cols = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + cols
        if EVEN_K:
            w_mask = row_ok[:, None]
            xv = tl.load(x_row + ks)
        else:
            k_ok = ks < K
            w_mask = row_ok[:, None] & k_ok[None, :]
            xv = tl.load(x_row + ks, mask=k_ok, other=0.0)
        wg = tl.load(w_gate + ks[None, :] * stride_wk, mask=w_mask, other=0.0)
        wu = tl.load(w_up + ks[None, :] * stride_wk, mask=w_mask, other=0.0)
        xf = xv.to(tl.float32)[None, :]
        acc_g += wg.to(tl.float32) * xf
        acc_u += wu.to(tl.float32) * xf
    return tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)


@triton.jit
def gemv_w13_kernel(
    X, W, S, Bias, Hid, Ids, ExpertMap,
    N, K,
    stride_xt, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_ht,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    MX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 1 of one pair (program axis 0) for ``BLOCK_N`` intermediate columns (axis 1).

    X: x ``[T, K]``; W: w13 ``[E, 2N, K]`` in x's dtype, or (``MX``) packed uint8
    ``[E, 2N, K/2]`` with E8M0 scales S ``[E, 2N, K/32]`` (otherwise S is unused);
    Bias: ``[E, 2N]``; Hid: ``[T * TOP_K, N]`` (x's dtype), row = pair; Ids: int32
    ``[T * TOP_K]``. ``EVEN_K``: ``K % BLOCK_K == 0`` (else the values past K are masked: per
    32-value group for MXFP4, per value otherwise)."""
    pair = tl.program_id(0)
    expert = tl.load(Ids + pair)
    if HAS_MAP:
        expert = tl.load(ExpertMap + expert)
    if expert < 0:  # not on this rank: layer 2 masks this pair, the row is never read
        return
    token = pair // TOP_K
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    e64 = expert.to(tl.int64)
    w_gate = W + e64 * stride_we + rows.to(tl.int64) * stride_wn  # [BLOCK_N]
    w_up = w_gate + N * stride_wn
    x_row = X + token.to(tl.int64) * stride_xt
    if MX:
        s_gate = S + e64 * stride_se + rows.to(tl.int64)[:, None] * stride_sn  # [BLOCK_N, 1]
        gate, up = _w13_mx(
            x_row, w_gate[:, None, None], w_up[:, None, None], s_gate, s_gate + N * stride_sn, row_ok, K,
            stride_wk, stride_sk, BLOCK_N, BLOCK_K, EVEN_K,
        )  # fmt: skip
    else:
        gate, up = _w13_plain(x_row, w_gate[:, None], w_up[:, None], row_ok, K, stride_wk, BLOCK_N, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        b_row = Bias + e64 * stride_be
        gate += tl.load(b_row + rows, mask=row_ok, other=0.0).to(tl.float32)
        up += tl.load(b_row + N + rows, mask=row_ok, other=0.0).to(tl.float32)
    act = activate(gate, up, ACTIVATION)
    tl.store(Hid + pair.to(tl.int64) * stride_ht + rows, act.to(Hid.dtype.element_ty), mask=row_ok)


@triton.jit
def _w2_mx(
    h_rows, w_rows, s_rows, ok2, live, K, stride_wk, stride_sk,
    KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 2's MXFP4 main loop: float32 ``[KP, BLOCK_N]``, each choice's rows' dot products
    with its intermediate row. h_rows: ``[KP, 1, 1]`` pointers to the choices' intermediate
    rows; w_rows: ``[KP, BLOCK_N, 1, 1]`` to the rows' first packed byte; s_rows: ``[KP,
    BLOCK_N, 1]`` to their first scale; ok2: ``[KP, BLOCK_N]`` live choice and row; live:
    ``[KP]``."""
    G: tl.constexpr = BLOCK_K // 32
    groups = tl.arange(0, G)
    j = tl.arange(0, 16)
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
        packed = tl.load(w_rows + byte[None, None, :, :], mask=w_mask, other=0).to(tl.int32)
        s = tl.load(s_rows + grp[None, None, :] * stride_sk, mask=s_mask, other=127).to(tl.int32)
        hv = tl.load(h_rows + hk[None, :, :], mask=h_mask, other=0.0).to(tl.float32)  # [KP, G, 32]
        h_even, h_odd = tl.split(tl.reshape(hv, (KP, G, 16, 2)))
        acc += _group_sums(packed, h_even[:, None, :, :], h_odd[:, None, :, :], 3) * _e8m0(s)
    return tl.sum(acc, axis=2) * 16384.0


@triton.jit
def _w2_plain(
    h_rows, w_rows, ok2, live, K, stride_wk,
    KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 2's main loop for weights in x's dtype: float32 ``[KP, BLOCK_N]``. h_rows:
    ``[KP, 1]`` pointers to the choices' intermediate rows; w_rows: ``[KP, BLOCK_N, 1]`` to the
    rows' first value; ok2: ``[KP, BLOCK_N]``; live: ``[KP]``. Elementwise float32 products,
    reduced over K once, at the end."""
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((KP, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + cols
        if EVEN_K:
            w_mask = ok2[:, :, None]
            h_mask = live[:, None]
        else:
            k_ok = ks < K
            w_mask = ok2[:, :, None] & k_ok[None, None, :]
            h_mask = live[:, None] & k_ok[None, :]
        w = tl.load(w_rows + ks[None, None, :] * stride_wk, mask=w_mask, other=0.0).to(tl.float32)
        hv = tl.load(h_rows + ks[None, :], mask=h_mask, other=0.0).to(tl.float32)  # [KP, BLOCK_K]
        acc += w * hv[:, None, :]
    return tl.sum(acc, axis=2)


@triton.jit
def gemv_w2_kernel(
    Hid, W, S, Bias, Out, Ids, ExpertMap, TopkWeights,
    N, K,
    stride_ht, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_ot,
    TOP_K: tl.constexpr, KP: tl.constexpr, HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    MX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Layer 2 and the combine of one token (program axis 0) for ``BLOCK_N`` output columns.

    Hid: the intermediate ``[T * TOP_K, K]``; W: w2 ``[E, N, K]`` in x's dtype, or (``MX``)
    packed ``[E, N, K/2]`` with scales S ``[E, N, K/32]``; Bias: ``[E, N]``; Out: ``[T, N]``
    (x's dtype) = ``sum_j w_j * (h_j @ w2[e_j].T + b[e_j])`` in float32, the ``TOP_K``
    choices held as a ``KP``-row tile and summed in registers."""
    token = tl.program_id(0).to(tl.int64)
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
    ok2 = live[:, None] & row_ok[None, :]  # [KP, BLOCK_N]
    w_rows = W + e64[:, None] * stride_we + rows.to(tl.int64)[None, :] * stride_wn  # [KP, BLOCK_N]
    h_rows = Hid + pairs * stride_ht  # [KP]
    if MX:
        s_rows = S + e64[:, None, None] * stride_se + rows.to(tl.int64)[None, :, None] * stride_sn
        y = _w2_mx(
            h_rows[:, None, None], w_rows[:, :, None, None], s_rows, ok2, live, K, stride_wk, stride_sk,
            KP, BLOCK_N, BLOCK_K, EVEN_K,
        )  # fmt: skip
    else:
        y = _w2_plain(h_rows[:, None], w_rows[:, :, None], ok2, live, K, stride_wk, KP, BLOCK_N, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        y += tl.load(Bias + e64[:, None] * stride_be + rows[None, :], mask=ok2, other=0.0).to(tl.float32)
    y = tl.where(live[:, None], y, 0.0)  # a remote choice contributes nothing (not even 0 * NaN)
    out = tl.sum(y * weight[:, None], axis=0)
    tl.store(Out + token * stride_ot + rows, out.to(Out.dtype.element_ty), mask=row_ok)


# ---------------------------------------------------------------- host


def _operand(w) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values, scales)`` of a weight as the kernels read it: MXFP4 ``(packed, scales)``, a
    tensor in x's dtype ``(w, None)``; TypeError for FP8 weights (no GEMV path)."""
    if isinstance(w, MXFP4Weight):
        return w.packed, w.scales
    if isinstance(w, FP8Weight):
        raise TypeError("the GEMV MoE takes MXFP4 weights or weights in x's dtype, not FP8Weight")
    return w, None


def gemv_launches(
    args: MoEApplyArgs, hid: torch.Tensor, tiles: tuple[GemvTile, GemvTile] | None = None
) -> tuple[Launch, Launch]:
    """The two launches of ``args`` (layer 1 writes ``hid``, the intermediate ``[T * top_k,
    I]`` in x's dtype; layer 2 writes ``args.out``), ``tiles`` overriding the table (layer 2's
    ``block_n`` is rows per choice). Tensor argument positions: layer 1 ``x`` 0, ``topk_ids``
    5; layer 2 ``out`` 4, ``topk_ids`` 5, ``topk_weights`` 7 (what :func:`bind_gemv` varies).
    An absent bias, map or scale tensor is replaced by the w13 values (never read)."""
    x, ids, out = args.x, args.topk_ids, args.out
    v13, s13 = _operand(args.w13)
    v2, s2 = _operand(args.w2)
    mx = s13 is not None
    num_tokens, top_k = ids.shape
    hidden, inter = x.shape[1], args.w2.shape[-1]
    t13, t2 = tiles or pick_gemv_tiles(vendor_of(x.device), top_k, num_tokens, "mxfp4" if mx else "plain")
    emap = args.expert_map
    stub = v13  # the placeholder of an absent tensor: the plan's own weight, never read
    map_arg = stub if emap is None else emap
    p13, strides13 = _weight_args(v13, s13, args.w13_bias, stub)
    p2, strides2 = _weight_args(v2, s2, args.w2_bias, stub)
    flags = dict(TOP_K=top_k, HAS_MAP=emap is not None, MX=mx)
    layer1 = Launch(
        gemv_w13_kernel,
        (num_tokens * top_k, cdiv(inter, t13.block_n)),
        (x, *p13, hid, ids, map_arg, inter, hidden, x.stride(0), *strides13, hid.stride(0)),
        dict(
            HAS_BIAS=args.w13_bias is not None,
            ACTIVATION=ACTIVATION_CODES[args.activation],
            **flags,
            **_tile_meta(t13, hidden),
        ),
    )
    layer2 = Launch(
        gemv_w2_kernel,
        (num_tokens, cdiv(hidden, t2.block_n)),
        (hid, *p2, out, ids, map_arg, args.topk_weights, hidden, inter, hid.stride(0), *strides2, out.stride(0)),
        dict(KP=next_pow2(top_k), HAS_BIAS=args.w2_bias is not None, **flags, **_tile_meta(t2, inter)),
    )
    return layer1, layer2


def _weight_args(values: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None, stub: torch.Tensor):
    """A layer's weight arguments: the (values, scales, bias) pointers, ``stub`` for an absent
    one, and their strides (the values' three, the scales' three or zeros, the bias' row)."""
    pointers = (values, stub if scales is None else scales, stub if bias is None else bias)
    strides = (
        *values.stride(),
        *((0, 0, 0) if scales is None else scales.stride()),
        0 if bias is None else bias.stride(0),
    )
    return pointers, strides


def _tile_meta(tile: GemvTile, k: int) -> dict:
    """A layer's tile constexprs and warps for reduction length ``k``."""
    return dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, EVEN_K=k % tile.block_k == 0, num_warps=tile.num_warps)


def _intermediate(args: MoEApplyArgs) -> torch.Tensor:
    """An uninitialized intermediate ``[T * top_k, I]`` in x's dtype."""
    x = args.x
    return torch.empty((args.topk_ids.numel(), args.w2.shape[-1]), dtype=x.dtype, device=x.device)


def gemv_moe(args: MoEApplyArgs, tiles: tuple[GemvTile, GemvTile] | None = None) -> None:
    """The two launches for ``args`` (writes ``args.out``), uncached; ``tiles`` overrides the
    table (layer 2's ``block_n`` is rows per choice). Any T works; the registrations limit it
    to :data:`MAX_TOKENS`."""
    for launch in gemv_launches(args, _intermediate(args), tiles):
        launch()


def _build(args: MoEApplyArgs) -> Built:
    """A functional runner's build: both launches, the intermediate as scratch, nothing kept."""
    hid = _intermediate(args)
    return gemv_launches(args, hid), (hid,), ()


# Functional calls' runners per registration, by the MoE runner key (repeating across layers
# and steps).
_RUNNERS = {
    name: RunnerCache(name, runner_key, functools.partial(bind_call, _build), gemv_moe)
    for name in ("triton_moe_gemv_mx", "triton_moe_gemv")
}


def _gemv(args: MoEApplyArgs, runners: RunnerCache[MoEApplyArgs]) -> None:
    """Both registrations' function: a functional call through its runner (``runners``, the
    registration's in :data:`_RUNNERS`); a call with more than :data:`MAX_TOKENS` tokens (a
    plan made with ``override``, selected without T) is handed to ``triton_fused_moe``."""
    if args.topk_ids.shape[0] > MAX_TOKENS:
        fused.triton_fused_moe(args)
        return
    runners(args)


def bind_gemv(args: MoEApplyArgs) -> Runner | None:
    """The ``bind`` hook (``MoEPlan``): both launches of this token count bound once, the
    intermediate the runner's workspace and the plan's weights, biases and map bound; a call
    launches layer 1 with its x and ids, layer 2 with its ids, weights and out. Above
    :data:`MAX_TOKENS` tokens, ``triton_fused_moe``'s bind (its runner, or None: ``fn``)."""
    if args.topk_ids.shape[0] > MAX_TOKENS:
        return fused.bind_fused_moe(args)
    layer1, layer2 = gemv_launches(args, _intermediate(args))
    first, second = layer1.bound(0, 5), layer2.bound(4, 5, 7)

    def run(a: MoEApplyArgs) -> None:
        first(a.x, a.topk_ids)
        second(a.out, a.topk_ids, a.topk_weights)

    return run


def _token_limit(request: Request) -> str | None:
    """``num_tokens_bucket`` above :data:`MAX_TOKENS` (the next power of two >= T, so
    ``bucket <= 8`` iff ``T <= 8``; a plan has no bucket), with the reason."""
    bucket = request.shape("num_tokens_bucket")
    if bucket is not None and bucket > MAX_TOKENS:
        return f"num_tokens_bucket={bucket} > {MAX_TOKENS}: the GEMV MoE serves T <= {MAX_TOKENS} tokens"
    return None


FEATURES = ("silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4")
PLAIN_FEATURES = ("silu", "gelu", "swiglu_oai", "bias", "expert_map")


def gemv_predicate(request: Request) -> str | None:
    """MXFP4 weights only; at most ``MAX_TOKENS`` tokens."""
    if "mxfp4" not in request.features:
        return "MXFP4 weights only (E2M1 GEMV decode)"
    return _token_limit(request)


def plain_gemv_predicate(request: Request) -> str | None:
    """At most ``MAX_TOKENS`` tokens (the weight formats are the registration's dtypes and
    features: weights in x's dtype, no quantized format)."""
    return _token_limit(request)


# Registration metadata (data). MXFP4: above triton_fused_moe_mx (PORTABLE + 10) for T <= 8,
# measured correct and faster on an H100. Plain: opt-in until a GPU measures it.
GEMV_REGISTRATION = {
    "solution": "triton",
    "vendors": VENDORS,
    "vendor_capabilities": VENDOR_CAPABILITIES,
    "dtypes": {"x": ACT_DTYPES, "weight": (torch.uint8,)},
    "features": FEATURES,
    "priority": Priority.PORTABLE + 20,
    "predicate": gemv_predicate,
    "bind": bind_gemv,
}
PLAIN_REGISTRATION = {
    **GEMV_REGISTRATION,
    "dtypes": {"x": ACT_DTYPES, "weight": ACT_DTYPES},
    "features": PLAIN_FEATURES,
    "priority": Priority.OPT_IN + 10,
    # First at 1 and 2 tokens, just above triton_fused_moe (PORTABLE): H200, 2026-11-28 (bench
    # --preset moe-decode-bf16, GPT-OSS layer): 59.3 vs 63.6 us at T=1, 111.9 vs 112.2 at T=2 in
    # two launches instead of four; 0.99x / 0.97x at T=4 / 8, so opt-in there.
    "rank_when": ({"num_tokens_bucket": (1, 2)}, Priority.PORTABLE + 20),
    "predicate": plain_gemv_predicate,
}


@register_kernel("moe.apply", name="triton_moe_gemv_mx", **GEMV_REGISTRATION)
def triton_moe_gemv_mx(args: MoEApplyArgs) -> None:
    """MXFP4 MoE for T <= 8: two GEMV launches (w13 + bias + activation; w2 + bias + routing
    weight + combine), in-register E2M1 decode, no permutation, no tensor cores."""
    _gemv(args, _RUNNERS["triton_moe_gemv_mx"])


@register_kernel("moe.apply", name="triton_moe_gemv", **PLAIN_REGISTRATION)
def triton_moe_gemv(args: MoEApplyArgs) -> None:
    """bf16/fp16/fp32-weight MoE for T <= 8: two GEMV launches (w13 + bias + activation;
    w2 + bias + routing weight + combine), no permutation, no tensor cores (opt-in)."""
    _gemv(args, _RUNNERS["triton_moe_gemv"])
