"""The grouped expert GEMM with a ``tl.dot_scaled`` MXFP4 main loop (GPU only).

:func:`moe_mx_gemm_kernel` computes the same tiles as :func:`._gemm.moe_gemm_kernel` (one
``BLOCK_M`` tile of sorted rows of one expert x ``BLOCK_N`` output columns; tiles, rows and
epilogue are the shared helpers of :mod:`._gemm`), but hands the weight to Triton as stored:
per K step of ``BLOCK_K`` values it loads

- A: ``[BLOCK_M, BLOCK_K]`` activations (bf16), gathered rows of x (layer 1) or the sorted
  intermediate (layer 2);
- W: ``[BLOCK_K/2, BLOCK_N]`` uint8, two E2M1 codes per byte along K (low nibble = even k),
  read from MXFP4 ``packed [E, N, K/2]``: the public byte order, which is ``dot_scaled``'s
  k-packing, so nothing is repacked; each weight row contributes ``BLOCK_K/2`` contiguous,
  16-byte aligned bytes (``K % 32 == 0``);
- S: ``[BLOCK_N, BLOCK_K/32]`` uint8 E8M0 scales, through strides: the public ``[E, N, K/32]``
  (functional path) or the plan's N-contiguous ``[E, K/32, N]`` (vector loads that can be
  pipelined; a public row has ``K/32`` bytes, rarely 4-byte aligned, so its scale loads are
  byte loads),

and calls ``tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc)``; Triton lowers it to its own
e2m1 -> bf16 conversion + wgmma on Hopper (mfma on CDNA3, scaled MFMA on gfx950).

Split-K (``SPLIT``): program ``(p, s)`` walks K values ``[s * k_split, (s + 1) * k_split)``.
Layer 1 then stores its raw gate/up partial sums, float32 ``[S, rows, 2N]`` (split stride
``stride_os``), and :func:`split_finish_kernel` sums the splits and applies bias and
activation; layer 2 applies bias (split 0 only) and routing weight per split into float32
``[S, P, N]``, which the combine sums. Every split stores (an empty K range stores zeros),
so the partial buffers need no initialization.

The Triton 3.6 interpreter cannot run ``tl.dot_scaled``: these kernels are compiled ahead of
time in the CPU tests and run only on GPUs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernel_triton.ops.moe._gemm import epilogue, program_tile, tile_block, tile_rows

__all__ = ["moe_mx_gemm_kernel", "split_finish_kernel"]


@triton.jit
def _mx_step(acc, a, w_rows, s_rows, n_ok, k0, K, stride_wk, stride_sk,
             A_FMT: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """``acc + a @ W[rows, k0:k0+BLOCK_K].T``: ``w_rows``/``s_rows`` point at the tile's weight
    rows (``[BLOCK_N]`` pointers into packed bytes and scales)."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w_mask = n_ok[None, :]
    s_mask = n_ok[:, None]
    if not EVEN_K:
        w_mask = w_mask & (kb < K // 2)[:, None]
        s_mask = s_mask & (ks < K // 32)[None, :]
    w = tl.load(w_rows[None, :] + kb[:, None] * stride_wk, mask=w_mask, other=0)
    s = tl.load(s_rows[:, None] + ks[None, :] * stride_sk, mask=s_mask, other=127)
    return tl.dot_scaled(a, None, A_FMT, w, s, "e2m1", acc)


@triton.jit
def moe_mx_gemm_kernel(
    A, W, S, Bias, Out, SortedIds, TileExpert, NumTiles, TopkWeights,
    num_pairs, N, K, tiles_bound, k_split,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_om, stride_os,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT: tl.constexpr, A_FMT: tl.constexpr,
):  # fmt: skip
    """Program ``(tile x column block, split)``: one ``[BLOCK_M, BLOCK_N]`` output tile of one
    expert over the split's K range (see the module docstring).

    GATED: A = x ``[T, K]`` (bf16) gathered by pair, W/S = w13 (``2N`` logical rows: gate rows
    ``n``, up rows ``N + n``), Out = the intermediate ``[tiles_bound * BLOCK_M, N]`` at sorted
    rows, or with SPLIT float32 ``[S, tiles_bound * BLOCK_M, 2N]`` raw partials. Otherwise A =
    the intermediate, W/S = w2 ``[E, N, K]``, Out = float32 ``[S, P, N]`` at pair rows, times
    ``TopkWeights[pair]``. ``EVEN_K``: ``K % BLOCK_K == 0`` (and ``k_split`` is a multiple of
    ``BLOCK_K``)."""
    pid_m, pid_n, used = program_tile(NumTiles, N, tiles_bound, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    if not used:
        return
    expert, slots, pairs, m_ok, a_rows, offs_n, n_ok = tile_block(
        SortedIds, TileExpert, pid_m, pid_n, num_pairs, N, stride_am, TOP_K, GATED, BLOCK_M, BLOCK_N
    )
    w_rows = W + expert * stride_we + offs_n.to(tl.int64) * stride_wn
    s_rows = S + expert * stride_se + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT:
        k_lo = split * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
    else:
        k_lo = 0
        k_hi = K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a_mask = m_ok[:, None]
        if not EVEN_K:
            a_mask = a_mask & (offs_k[None, :] < K)
        a = tl.load(A + a_rows[:, None] + offs_k[None, :], mask=a_mask, other=0.0)
        acc = _mx_step(acc, a, w_rows, s_rows, n_ok, k0, K, stride_wk, stride_sk, A_FMT, BLOCK_K, EVEN_K)
        if GATED:
            acc_up = _mx_step(
                acc_up,
                a,
                w_rows + N * stride_wn,
                s_rows + N * stride_sn,
                n_ok,
                k0,
                K,
                stride_wk,
                stride_sk,
                A_FMT,
                BLOCK_K,
                EVEN_K,
            )
    if GATED and SPLIT:  # raw partial sums: split_finish_kernel adds the bias, applies the activation
        out_ptr = Out + split * stride_os + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(out_ptr, acc, mask=mask)
        tl.store(out_ptr + N, acc_up, mask=mask)
    else:
        if not GATED:
            acc_up = acc
        epilogue(
            acc,
            acc_up,
            Bias,
            Out + split * stride_os,
            TopkWeights,
            expert,
            offs_n,
            n_ok,
            n_ok & (split == 0),
            slots,
            pairs,
            m_ok,
            N,
            stride_be,
            stride_om,
            GATED,
            ACTIVATION,
            HAS_BIAS,
        )


@triton.jit
def split_finish_kernel(
    Partial, Bias, Out, SortedIds, TileExpert, NumTiles,
    num_pairs, N, stride_ps, stride_pm, stride_be, stride_om,
    SPLITS: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Layer 1 after split-K: Out ``[tiles_bound * BLOCK_M, N]`` (x's dtype) row ``slot`` =
    act(sum_s gate + bias, sum_s up + bias) from float32 ``Partial [SPLITS, rows, 2N]``
    (gate at columns ``n``, up at ``N + n``), splits summed in order (deterministic).
    Program ``(tile, column block)``; unused tiles and padding rows are skipped."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m >= tl.load(NumTiles):
        return
    expert, slots, pairs, m_ok, _ = tile_rows(SortedIds, TileExpert, pid_m, num_pairs, 0, 1, True, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    mask = m_ok[:, None] & n_ok[None, :]
    ptr = Partial + slots[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        gate += tl.load(ptr + s * stride_ps, mask=mask, other=0.0)
        up += tl.load(ptr + s * stride_ps + N, mask=mask, other=0.0)
    epilogue(
        gate,
        up,
        Bias,
        Out,
        Out,
        expert,
        offs_n,
        n_ok,
        n_ok,
        slots,
        pairs,
        m_ok,
        N,
        stride_be,
        stride_om,
        True,
        ACTIVATION,
        HAS_BIAS,
    )
