"""Gluon MXFP4 MoE kernels: warp-decode GEMVs (tiny batches) and grouped GEMMs (medium batches).

MXFP4 bytes are read 32 at a time: one 64-value K group of one weight row. In the planned
"halves" order (:func:`..._prepare.to_halves`) byte ``j`` of group ``g`` holds value
``64g + j`` in its low nibble and ``64g + 32 + j`` in its high nibble, so the low nibbles
of the 32 bytes are exactly E8M0 block ``2g`` and the high nibbles block ``2g + 1``: each
half is scaled by ONE scale and no register shuffle is needed. With the standard order
(``HALVES=False``, the functional path without a plan) the low nibbles are the even values
and the kernels index the activations and scales accordingly.

E2M1 codes are decoded to fp32 with integer ops (sign, 2-bit exponent, 1-bit mantissa)
and scaled by ``2 ** (s - 127)`` built from the scale's bits; the products run in fp32
(GEMV) or on bf16/fp16 MFMA after staging the dequantized tile in LDS (GEMM).

Activation codes: 0 silu, 1 gelu (erf), 2 swiglu_oai.

``QUANT_OUT`` (``activation_quant="mxfp8"`` on the 16-bit path): layer 1 fake-quantizes its
activated output to MXFP8 (:func:`._mxfp8.fake_quantize`, blocks of 32 columns, which never
straddle a program's columns) before storing it, so layer 2 multiplies the quantized
intermediate; x is fake-quantized beforehand by :func:`._mxfp8.mxfp8_quant_kernel`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tokenspeed_kernel_amd.ops.moe._mxfp8 import fake_quantize


@gluon.jit
def _e2m1(code):
    """E2M1 codes (int32, 0..15) → fp32 values."""
    mag = code & 7
    exp = mag >> 1
    bits = ((exp + 126) << 23) | ((mag & 1) << 22)
    big = bits.to(gl.float32, bitcast=True)
    val = gl.where(exp == 0, (mag & 1).to(gl.float32) * 0.5, big)
    return gl.where((code & 8) != 0, -val, val)


@gluon.jit
def _e8m0(s):
    """E8M0 scale bytes → fp32 ``2 ** (s - 127)`` (0 → 0, negligible against 2**-127)."""
    return (s.to(gl.int32) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _activate(gate, up, ACTIVATION: gl.constexpr):
    if ACTIVATION == 0:
        return gate / (1.0 + gl.exp(-gate)) * up
    elif ACTIVATION == 1:
        return 0.5 * gate * (1.0 + gl.erf(gate * 0.7071067811865476)) * up
    else:
        g = gl.minimum(gate, 7.0)
        u = gl.minimum(gl.maximum(up, -7.0), 7.0)
        return g / (1.0 + gl.exp(-1.702 * g)) * (u + 1.0)


@gluon.jit
def _local_expert(ExpertMap, e, HAS_MAP: gl.constexpr):
    if HAS_MAP:
        e = gl.load(ExpertMap + e)
    return e


@gluon.jit
def _gemv_rows(
    X,
    x_row,
    W,
    S,
    e,
    rows,
    row_ok,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: gl.constexpr,
    HALVES: gl.constexpr,
    L3: gl.constexpr,
    BLOCK_G: gl.constexpr,
    BLOCK: gl.constexpr,
):
    """fp32 ``sum_k x[k] * w[e, rows, k]`` for MXFP4 rows (``K % 64 == 0``); ``rows`` in
    ``SliceLayout(1, SliceLayout(2, L3))``."""
    LNG: gl.constexpr = gl.SliceLayout(2, L3)
    LGJ: gl.constexpr = gl.SliceLayout(0, L3)
    g = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, LNG))
    gx = gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, LGJ))
    j = gl.arange(0, 32, layout=gl.SliceLayout(0, LGJ))
    jb = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    w_row = W + e.to(gl.int64) * stride_we + rows.to(gl.int64) * stride_wn
    s_row = S + e.to(gl.int64) * stride_se + rows.to(gl.int64) * stride_sn
    acc = gl.zeros([BLOCK], gl.float32, layout=gl.SliceLayout(1, LNG))
    for g0 in range(0, K // 64, BLOCK_G):
        gg = g0 + g
        g_ok = gg < K // 64
        m2 = row_ok[:, None] & g_ok[None, :]
        byte = gl.load(
            w_row[:, None, None] + (gg * 32)[None, :, None] + jb[None, None, :], mask=m2[:, :, None], other=0
        ).to(gl.int32)
        s_lo = _e8m0(gl.load(s_row[:, None] + 2 * gg[None, :], mask=m2, other=0))
        s_hi = _e8m0(gl.load(s_row[:, None] + 2 * gg[None, :] + 1, mask=m2, other=0))
        ggx = g0 + gx
        x_ok = (ggx < K // 64)[:, None]
        if HALVES:
            x_lo = gl.load(X + x_row + (ggx * 64)[:, None] + j[None, :], mask=x_ok, other=0.0).to(gl.float32)
            x_hi = gl.load(X + x_row + (ggx * 64 + 32)[:, None] + j[None, :], mask=x_ok, other=0.0).to(gl.float32)
            lo = gl.sum(_e2m1(byte & 15) * x_lo[None, :, :], axis=2)
            hi = gl.sum(_e2m1(byte >> 4) * x_hi[None, :, :], axis=2)
            acc += gl.sum(lo * s_lo + hi * s_hi, axis=1)
        else:
            x_lo = gl.load(X + x_row + (ggx * 64)[:, None] + 2 * j[None, :], mask=x_ok, other=0.0).to(gl.float32)
            x_hi = gl.load(X + x_row + (ggx * 64 + 1)[:, None] + 2 * j[None, :], mask=x_ok, other=0.0).to(gl.float32)
            pair = _e2m1(byte & 15) * x_lo[None, :, :] + _e2m1(byte >> 4) * x_hi[None, :, :]
            first = gl.sum(gl.where((jb < 16)[None, None, :], pair, 0.0), axis=2)
            second = gl.sum(gl.where((jb >= 16)[None, None, :], pair, 0.0), axis=2)
            acc += gl.sum(first * s_lo + second * s_hi, axis=1)
    return acc


@gluon.jit
def moe_gemv13_kernel(
    X, W, S, Bias, Ids, ExpertMap, A,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_at,
    HIDDEN: gl.constexpr, INTER: gl.constexpr, TOP_K: gl.constexpr, ACTIVATION: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_MAP: gl.constexpr, HALVES: gl.constexpr, BLOCK_I: gl.constexpr,
    BLOCK_G: gl.constexpr, L3: gl.constexpr, QUANT_OUT: gl.constexpr,
):  # fmt: skip
    """Warp-decode layer 1 for one (token, choice) pair and ``BLOCK_I`` intermediate columns:
    routing read in-kernel (``Ids`` int32 ``[T*k]``, optional ``ExpertMap``), gate and up GEMVs
    over ``w13`` MXFP4 ``[E, 2I, H/2]`` bytes + ``[E, 2I, H/32]`` scales, bias, activation →
    ``A`` float32 ``[T*k, I]`` (zeros for a pair whose expert is not on this rank)."""
    pair = gl.program_id(0)
    pid = gl.program_id(1)
    LROW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    e = _local_expert(ExpertMap, gl.load(Ids + pair), HAS_MAP)
    cols = pid * BLOCK_I + gl.arange(0, BLOCK_I, layout=LROW)
    ok = (cols < INTER) & (e >= 0)
    e = gl.maximum(e, 0)
    x_row = (pair // TOP_K).to(gl.int64) * stride_xt
    gate = _gemv_rows(
        X, x_row, W, S, e, cols, ok, stride_we, stride_wn, stride_se, stride_sn, HIDDEN, HALVES, L3, BLOCK_G, BLOCK_I
    )
    up = _gemv_rows(
        X,
        x_row,
        W,
        S,
        e,
        cols + INTER,
        ok,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        HIDDEN,
        HALVES,
        L3,
        BLOCK_G,
        BLOCK_I,
    )
    if HAS_BIAS:
        gate += gl.load(Bias + e.to(gl.int64) * stride_be + cols, mask=ok, other=0.0).to(gl.float32)
        up += gl.load(Bias + e.to(gl.int64) * stride_be + INTER + cols, mask=ok, other=0.0).to(gl.float32)
    act = gl.where(ok, _activate(gate, up, ACTIVATION), 0.0)
    if QUANT_OUT:  # BLOCK_I == 32: the program's columns are exactly one MX block
        act = fake_quantize(act, gl.max(gl.abs(act), axis=0))
    gl.store(A + pair.to(gl.int64) * stride_at + cols, act, mask=cols < INTER)


@gluon.jit
def moe_gemv2_kernel(
    A, W, S, Bias, Ids, Weights, ExpertMap, Out,
    stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ot,
    HIDDEN: gl.constexpr, INTER: gl.constexpr, TOP_K: gl.constexpr, HAS_BIAS: gl.constexpr,
    HAS_MAP: gl.constexpr, HALVES: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_G: gl.constexpr, L3: gl.constexpr,
):  # fmt: skip
    """Warp-decode layer 2 and combine for one token and ``BLOCK_H`` output columns: the
    ``TOP_K`` expert GEMVs over ``w2`` MXFP4 ``[E, H, I/2]`` (+ bias), weighted by the routing
    weights and summed in choice order (deterministic, no atomics) → ``Out`` ``[T, H]``."""
    t = gl.program_id(0)
    pid = gl.program_id(1)
    LROW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, L3))
    cols = pid * BLOCK_H + gl.arange(0, BLOCK_H, layout=LROW)
    acc = gl.zeros([BLOCK_H], gl.float32, layout=LROW)
    for jk in gl.static_range(TOP_K):
        pair = t * TOP_K + jk
        e = _local_expert(ExpertMap, gl.load(Ids + pair), HAS_MAP)
        ok = (cols < HIDDEN) & (e >= 0)
        e = gl.maximum(e, 0)
        y = _gemv_rows(
            A,
            pair.to(gl.int64) * stride_at,
            W,
            S,
            e,
            cols,
            ok,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            INTER,
            HALVES,
            L3,
            BLOCK_G,
            BLOCK_H,
        )
        if HAS_BIAS:
            y += gl.load(Bias + e.to(gl.int64) * stride_be + cols, mask=ok, other=0.0).to(gl.float32)
        acc += gl.where(ok, y * gl.load(Weights + pair), 0.0)
    gl.store(Out + t.to(gl.int64) * stride_ot + cols, acc.to(Out.dtype.element_ty), mask=cols < HIDDEN)


@gluon.jit
def block_amax(v, cols, BLOCK_N: gl.constexpr):
    """``max |v|`` over each row's 32-column block (``cols`` = column in the tile, in
    ``SliceLayout(0, v's layout)``), broadcast back to ``v``'s shape."""
    amax = gl.zeros_like(v)
    for b in gl.static_range(BLOCK_N // 32):
        inb = (cols >= b * 32) & (cols < b * 32 + 32)
        m = gl.max(gl.where(inb[None, :], gl.abs(v), 0.0), axis=1)
        amax = gl.where(inb[None, :], m[:, None], amax)
    return amax


@gluon.jit
def _dequant_group(W, S, w_rows, s_rows, n_ok, gidx, jb, HALVES: gl.constexpr):
    """One 64-value K group of MXFP4 rows → (first 32 columns, last 32 columns) fp32, in the
    kernel's K order (halves: values j / 32+j; standard: even / odd values)."""
    byte = gl.load(w_rows[:, None] + gidx * 32 + jb[None, :], mask=n_ok[:, None], other=0).to(gl.int32)
    s0 = _e8m0(gl.load(s_rows + 2 * gidx, mask=n_ok, other=0))
    s1 = _e8m0(gl.load(s_rows + 2 * gidx + 1, mask=n_ok, other=0))
    lo = _e2m1(byte & 15)
    hi = _e2m1(byte >> 4)
    if HALVES:
        lo = lo * s0[:, None]
        hi = hi * s1[:, None]
    else:
        scale = gl.where((jb < 16)[None, :], s0[:, None], s1[:, None])
        lo = lo * scale
        hi = hi * scale
    return lo, hi


@gluon.jit
def moe_gemm_kernel(
    Act, W, S, Bias, SortedPairs, TileExpert, TileRow, TileRows, Weights, ExpertMap, Out,
    stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_ot,
    N: gl.constexpr, K: gl.constexpr, TOP_K: gl.constexpr, GATED: gl.constexpr, ACTIVATION: gl.constexpr,
    HAS_BIAS: gl.constexpr, HALVES: gl.constexpr, ROWS_SORTED: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MMA: gl.constexpr, K_WIDTH: gl.constexpr,
    LOAD_A: gl.constexpr, LOAD_B: gl.constexpr, B_SMEM: gl.constexpr, QUANT_OUT: gl.constexpr,
):  # fmt: skip
    """Grouped GEMM over expert-sorted rows. Program ``(tile, n)``: expert ``TileExpert[tile]``
    (``>= E`` or a padded tile: nothing to do), ``TileRows[tile]`` rows starting at sorted
    position ``TileRow[tile]``. A rows: ``Act[pair // TOP_K]`` (layer 1, x) or ``Act[position]``
    (layer 2, ``ROWS_SORTED``). B: MXFP4 ``[E, N(*2 if GATED), K/2]`` dequantized per 64-wide
    K step into LDS, read back as the MFMA operand; the next step's bytes and A rows are
    loaded before this step's MFMAs (register double buffer).

    GATED (layer 1): gate and up accumulators, bias, activation → ``Out[position, n]`` in
    Act's dtype. Otherwise (layer 2): bias, times the pair's routing weight → ``Out[pair, n]``
    float32 (the combine sums each token's ``TOP_K`` rows)."""
    tile = gl.program_id(0)
    pid_n = gl.program_id(1)
    e = gl.load(TileExpert + tile)
    nrows = gl.load(TileRows + tile)
    row0 = gl.load(TileRow + tile)
    dtype: gl.constexpr = Act.dtype.element_ty
    DOT_A: gl.constexpr = gl.DotOperandLayout(0, MMA, K_WIDTH)
    DOT_B: gl.constexpr = gl.DotOperandLayout(1, MMA, K_WIDTH)

    ra = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD_A))
    ca = gl.arange(0, 64, layout=gl.SliceLayout(0, LOAD_A))
    a_ok = ra < nrows
    pos = row0 + ra
    if ROWS_SORTED:
        a_rows = pos.to(gl.int64) * stride_at
    else:
        pairs = gl.load(SortedPairs + pos, mask=a_ok, other=0)
        a_rows = (pairs // TOP_K).to(gl.int64) * stride_at
    if HALVES:
        a_cols = ca
    else:
        a_cols = gl.where(ca < 32, 2 * ca, 2 * (ca - 32) + 1)

    rn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_B))
    jb = gl.arange(0, 32, layout=gl.SliceLayout(0, LOAD_B))
    n_ok = (rn < N) & (nrows > 0)
    e64 = e.to(gl.int64)
    g_rows = W + e64 * stride_we + rn.to(gl.int64) * stride_wn
    g_srows = S + e64 * stride_se + rn.to(gl.int64) * stride_sn
    u_rows = g_rows + N * stride_wn
    u_srows = g_srows + N * stride_sn

    gate_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, 64], B_SMEM)
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)
    if GATED:
        up_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, 64], B_SMEM)
        acc_up = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA)

    a_next = gl.load(Act + a_rows[:, None] + a_cols[None, :], mask=a_ok[:, None], other=0.0)
    g_lo, g_hi = _dequant_group(W, S, g_rows, g_srows, n_ok, 0, jb, HALVES)
    if GATED:
        u_lo, u_hi = _dequant_group(W, S, u_rows, u_srows, n_ok, 0, jb, HALVES)
    for g in range(0, K // 64):
        gate_smem.slice(0, 32, dim=1).store(g_lo.to(dtype))
        gate_smem.slice(32, 32, dim=1).store(g_hi.to(dtype))
        if GATED:
            up_smem.slice(0, 32, dim=1).store(u_lo.to(dtype))
            up_smem.slice(32, 32, dim=1).store(u_hi.to(dtype))
        a_cur = gl.convert_layout(a_next, DOT_A)
        nxt = (g + 1) < K // 64
        a_next = gl.load(Act + a_rows[:, None] + (g + 1) * 64 + a_cols[None, :], mask=a_ok[:, None] & nxt, other=0.0)
        g_lo, g_hi = _dequant_group(W, S, g_rows, g_srows, n_ok & nxt, g + 1, jb, HALVES)
        if GATED:
            u_lo, u_hi = _dequant_group(W, S, u_rows, u_srows, n_ok & nxt, g + 1, jb, HALVES)
        acc = gl.amd.cdna3.mfma(a_cur, gate_smem.permute([1, 0]).load(DOT_B), acc)
        if GATED:
            acc_up = gl.amd.cdna3.mfma(a_cur, up_smem.permute([1, 0]).load(DOT_B), acc_up)

    ro = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    co = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
    o_ok = (ro < nrows)[:, None] & (co < N)[None, :]
    if HAS_BIAS:
        acc += gl.load(Bias + e64 * stride_be + co, mask=co < N, other=0.0).to(gl.float32)[None, :]
        if GATED:
            acc_up += gl.load(Bias + e64 * stride_be + N + co, mask=co < N, other=0.0).to(gl.float32)[None, :]
    opos = row0 + ro
    if GATED:
        res = _activate(acc, acc_up, ACTIVATION)
        if QUANT_OUT:
            res = fake_quantize(res, block_amax(res, co - pid_n * BLOCK_N, BLOCK_N))
        gl.store(Out + opos.to(gl.int64)[:, None] * stride_ot + co[None, :], res.to(Out.dtype.element_ty), mask=o_ok)
    else:
        opair = gl.load(SortedPairs + opos, mask=ro < nrows, other=0)
        w = gl.load(Weights + opair, mask=ro < nrows, other=0.0)
        gl.store(Out + opair.to(gl.int64)[:, None] * stride_ot + co[None, :], acc * w[:, None], mask=o_ok)
