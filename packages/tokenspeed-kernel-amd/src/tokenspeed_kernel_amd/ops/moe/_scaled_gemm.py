"""gfx950 grouped GEMM on the scaled MFMA: MXFP8 (e4m3) activations x MXFP4 (e2m1) weights.

``v_mfma_scale_f32_16x16x128_f8f6f4`` multiplies e4m3 A and e2m1 B with one E8M0 scale per 32
values along K on each side (``gl.amd.cdna4.mfma_scaled``), so nothing is dequantized: the
weight bytes and scales go to the matrix core as stored.

Layouts. ``MMA = AMDMFMALayout(4, [16, 16, 128], transposed, warps [2, 2])``; operands in
``DotOperandLayout(op, MMA, k_width=16)``; scales in ``get_mfma_scale_layout``. B is the
PUBLIC MXFP4 byte order (low nibble = even K index, what the instruction expects), read as
``[BLOCK_K/2, BLOCK_N]`` bytes from ``W [E, N, K/2]``; its scales ``[BLOCK_N, BLOCK_K/32]``
from ``S [E, N, K/32]`` as they are. A is uint8 e4m3 codes ``[rows, K]`` + uint8 scales
``[rows, K/32]``. ``K`` need not be a multiple of ``BLOCK_K``: the tail is masked to zeros.
Per K step the next step's A, B and scales are loaded before this step's MFMAs.

Layer 1 (``GATED``): gate and up accumulators, bias, activation, then the epilogue quantizes
the activated tile to MXFP8 (blocks of 32 columns inside the tile) and writes codes + scales,
which are layer 2's A. Layer 2: bias, routing weight, fp32 rows for the top-k sum.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tokenspeed_kernel_amd.ops.moe._kernels import _activate, block_amax
from tokenspeed_kernel_amd.ops.moe._mxfp8 import _pow2, e4m3_code, e4m3_round, mx_exponent

__all__ = ["moe_scaled_gemm_kernel"]


@gluon.jit
def _act_rows(SortedPairs, row0, nrows, stride, BLOCK_M: gl.constexpr, TOP_K: gl.constexpr,
              ROWS_SORTED: gl.constexpr, LAYOUT: gl.constexpr):  # fmt: skip
    """Row offsets (int64, in units of ``stride``) of the tile's A rows and their mask."""
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAYOUT))
    ok = r < nrows
    if ROWS_SORTED:
        rows = (row0 + r).to(gl.int64) * stride
    else:
        pairs = gl.load(SortedPairs + row0 + r, mask=ok, other=0)
        rows = (pairs // TOP_K).to(gl.int64) * stride
    return rows, ok


@gluon.jit
def _load_b(W, S, w_rows, s_rows, n_ok, live, k0, kb, ks, K: gl.constexpr, BLOCK_K: gl.constexpr):
    """e2m1 bytes ``[BLOCK_K/2, BLOCK_N]`` and E8M0 scales ``[BLOCK_N, BLOCK_K/32]`` of one K step
    (``live``: the tile has rows; padding tiles name expert E and must not read)."""
    kbyte = k0 // 2 + kb
    b = gl.load(w_rows[None, :] + kbyte[:, None], mask=n_ok[None, :] & (kbyte < K // 2)[:, None], other=0)
    kscale = k0 // 32 + ks
    s = gl.load(s_rows[:, None] + kscale[None, :], mask=live & (kscale < K // 32)[None, :], other=0)
    return b, s


@gluon.jit
def moe_scaled_gemm_kernel(
    Act, ActScale, W, S, Bias, SortedPairs, TileExpert, TileRow, TileRows, Weights, Out, OutScale,
    stride_at, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ot, stride_os,
    N: gl.constexpr, K: gl.constexpr, TOP_K: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
    HAS_BIAS: gl.constexpr, ROWS_SORTED: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr, MMA: gl.constexpr, LOAD_A: gl.constexpr, LOAD_B: gl.constexpr,
):  # fmt: skip
    """Program ``(tile, n)`` of the expert-sorted grouped GEMM (tiles as in ``moe_gemm_kernel``).

    ``Act`` uint8 e4m3 ``[rows, K]`` with ``ActScale`` uint8 ``[rows, K/32]``: x's rows
    (``Act[pair // TOP_K]``, layer 1) or the sorted intermediate (``Act[position]``, layer 2,
    ``ROWS_SORTED``). ``W`` uint8 MXFP4 ``[E, N(*2 if GATED), K/2]`` (public order), ``S``
    uint8 ``[E, N(*2), K/32]``. GATED: ``Out`` uint8 e4m3 ``[P, N]`` + ``OutScale`` uint8
    ``[P, N/32]`` at sorted positions; else ``Out`` float32 ``[P, N]`` at pair ids."""
    tile = gl.program_id(0)
    pid_n = gl.program_id(1)
    e = gl.load(TileExpert + tile)
    nrows = gl.load(TileRows + tile)
    row0 = gl.load(TileRow + tile)
    DOT_A: gl.constexpr = gl.DotOperandLayout(0, MMA, 16)
    DOT_B: gl.constexpr = gl.DotOperandLayout(1, MMA, 16)
    SCALE_A: gl.constexpr = gl.amd.cdna4.get_mfma_scale_layout(DOT_A, [BLOCK_M, BLOCK_K // 32])
    SCALE_B: gl.constexpr = gl.amd.cdna4.get_mfma_scale_layout(DOT_B, [BLOCK_N, BLOCK_K // 32])

    a_rows, a_ok = _act_rows(SortedPairs, row0, nrows, stride_at, BLOCK_M, TOP_K, ROWS_SORTED, LOAD_A)
    as_rows, as_ok = _act_rows(SortedPairs, row0, nrows, stride_as, BLOCK_M, TOP_K, ROWS_SORTED, SCALE_A)
    ka = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, LOAD_A))
    ksa = gl.arange(0, BLOCK_K // 32, layout=gl.SliceLayout(0, SCALE_A))

    e64 = e.to(gl.int64)
    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, LOAD_B))
    live = nrows > 0
    n_ok = (rn < N) & live
    kb = gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(1, LOAD_B))
    g_rows = W + e64 * stride_we + rn.to(gl.int64) * stride_wn
    rns = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_B))
    rns = gl.minimum(rns, N - 1)  # scale rows past N are never used: clamp instead of masking
    ksb = gl.arange(0, BLOCK_K // 32, layout=gl.SliceLayout(0, SCALE_B))
    g_srows = S + e64 * stride_se + rns.to(gl.int64) * stride_sn
    u_rows = g_rows + N * stride_wn
    u_srows = g_srows + N * stride_sn

    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)
    if GATED:
        acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)

    a = gl.load(Act + a_rows[:, None] + ka[None, :], mask=a_ok[:, None] & (ka < K)[None, :], other=0)
    a_s = gl.load(ActScale + as_rows[:, None] + ksa[None, :], mask=as_ok[:, None] & (ksa < K // 32)[None, :], other=0)
    g, g_s = _load_b(W, S, g_rows, g_srows, n_ok, live, 0, kb, ksb, K, BLOCK_K)
    if GATED:
        u, u_s = _load_b(W, S, u_rows, u_srows, n_ok, live, 0, kb, ksb, K, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        a_cur = gl.convert_layout(a, DOT_A)
        a_s_cur = a_s
        g_cur = gl.convert_layout(g, DOT_B)
        g_s_cur = g_s
        if GATED:
            u_cur = gl.convert_layout(u, DOT_B)
            u_s_cur = u_s
        k1 = k0 + BLOCK_K
        a = gl.load(Act + a_rows[:, None] + (k1 + ka)[None, :], mask=a_ok[:, None] & (k1 + ka < K)[None, :], other=0)
        a_s = gl.load(
            ActScale + as_rows[:, None] + (k1 // 32 + ksa)[None, :],
            mask=as_ok[:, None] & (k1 // 32 + ksa < K // 32)[None, :],
            other=0,
        )
        g, g_s = _load_b(W, S, g_rows, g_srows, n_ok, live, k1, kb, ksb, K, BLOCK_K)
        if GATED:
            u, u_s = _load_b(W, S, u_rows, u_srows, n_ok, live, k1, kb, ksb, K, BLOCK_K)
        acc = gl.amd.cdna4.mfma_scaled(a_cur, a_s_cur, "e4m3", g_cur, g_s_cur, "e2m1", acc)
        if GATED:
            acc_up = gl.amd.cdna4.mfma_scaled(a_cur, a_s_cur, "e4m3", u_cur, u_s_cur, "e2m1", acc_up)

    ro = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    cl = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    co = pid_n * BLOCK_N + cl
    o_ok = (ro < nrows)[:, None] & (co < N)[None, :]
    if HAS_BIAS:
        acc += gl.load(Bias + e64 * stride_be + co, mask=co < N, other=0.0).to(gl.float32)[None, :]
        if GATED:
            acc_up += gl.load(Bias + e64 * stride_be + N + co, mask=co < N, other=0.0).to(gl.float32)[None, :]
    opos = row0 + ro
    if GATED:
        res = _activate(acc, acc_up, ACTIVATION)
        ex = mx_exponent(block_amax(res, cl, BLOCK_N))
        codes = e4m3_code(e4m3_round(res * _pow2(-ex)))
        gl.store(Out + opos.to(gl.int64)[:, None] * stride_ot + co[None, :], codes.to(gl.uint8), mask=o_ok)
        srow = OutScale + opos.to(gl.int64) * stride_os + pid_n * (BLOCK_N // 32)
        for b in gl.static_range(BLOCK_N // 32):
            eb = gl.max(gl.where((cl == b * 32)[None, :], ex, -1000), axis=1)
            gl.store(srow + b, (eb + 127).to(gl.uint8), mask=(ro < nrows) & (pid_n * BLOCK_N + b * 32 < N))
    else:
        opair = gl.load(SortedPairs + opos, mask=ro < nrows, other=0)
        w = gl.load(Weights + opair, mask=ro < nrows, other=0.0)
        gl.store(Out + opair.to(gl.int64)[:, None] * stride_ot + co[None, :], acc * w[:, None], mask=o_ok)
