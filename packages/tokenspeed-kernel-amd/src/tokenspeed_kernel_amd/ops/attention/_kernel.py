"""The Gluon attention kernel shared by prefill, extend and paged decode, and the split combine.

One program owns ``BLOCK_M`` rows = ``BLOCK_M // GROUP`` query tokens x the ``GROUP`` query
heads of one KV head (GQA packing: every K/V tile loaded is used by the whole group), for
one sequence and one slice of its key range (split-KV, decode only). Per key tile of
``BLOCK_N`` keys:

1. the tile's K and V rows are gathered from global memory into registers (through the
   page table when paged) one tile AHEAD of the compute (software pipeline: the loads of
   tile i+1 are in flight while tile i runs on the matrix cores);
2. K and V are staged in LDS (layout chosen per arch by the host: XOR-swizzled on gfx942,
   padded on gfx950) and read back as MFMA operands (K transposed by the LDS read);
3. ``S = Q K^T`` and ``O += P V`` run on ``v_mfma_f32_16x16x{16,32}_{bf16,f16}``; the
   online softmax runs in fp32 in the MFMA accumulator layout, in base 2.

Only the key tiles a block can see are visited: ``[first_pos - window_left, last_pos]``
with causal masking and a window, split evenly among ``SPLITS`` programs. Sinks join the
final denominator; with ``SPLITS > 1`` the partial results (normalized output, log2-sum-exp)
go to a workspace and :func:`combine_kernel` merges them with the sink.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# MODE values: how the sequence bounds and K/V addresses are found.
MODE_PREFILL = gl.constexpr(0)  # ragged q and k by cu_seqlens, contiguous K/V [tokens, Hkv, D]
MODE_EXTEND = gl.constexpr(1)  # ragged q by cu_seqlens, paged K/V, cache_seqlens
MODE_DECODE = gl.constexpr(2)  # uniform q_len per sequence, paged K/V, cache_seqlens

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _kv_rows(
    PageTable, b, stride_pt, k_start, cols, ok, stride_p, stride_t, PAGED: gl.constexpr, PAGE_SIZE: gl.constexpr
):
    """Element offsets (int64) of the key rows ``cols`` of sequence ``b``."""
    if PAGED:
        page = gl.load(PageTable + b * stride_pt + cols // PAGE_SIZE, mask=ok, other=0)
        rows = page.to(gl.int64) * stride_p + (cols % PAGE_SIZE).to(gl.int64) * stride_t
    else:
        rows = (k_start + cols).to(gl.int64) * stride_t
    return rows


@gluon.jit
def attention_kernel(
    Q, K, V, Out, Lse, PartOut, PartLse, Sinks, KScale, VScale, PageTable, CuSeqlensQ, CuSeqlensK, CacheSeqlens,
    stride_qt, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_ot, stride_pt, num_tokens,
    sm_scale, logit_cap, window_left,
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, GROUP: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, MODE: gl.constexpr, Q_LEN: gl.constexpr,
    PAGE_SIZE: gl.constexpr, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
    HAS_CAP: gl.constexpr, KV_SCALES: gl.constexpr, WRITE_LSE: gl.constexpr, SPLITS: gl.constexpr,
    MMA: gl.constexpr, K_WIDTH: gl.constexpr, LOAD_Q: gl.constexpr, LOAD_K: gl.constexpr,
    LOAD_V: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr,
):  # fmt: skip
    PAGED: gl.constexpr = MODE != MODE_PREFILL
    TOKENS: gl.constexpr = BLOCK_M // GROUP
    ROW: gl.constexpr = gl.SliceLayout(1, MMA)
    COL: gl.constexpr = gl.SliceLayout(0, MMA)
    DOT_A: gl.constexpr = gl.DotOperandLayout(0, MMA, K_WIDTH)
    DOT_B: gl.constexpr = gl.DotOperandLayout(1, MMA, K_WIDTH)
    dtype: gl.constexpr = Q.dtype.element_ty

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    split = gl.program_id(2)
    b = pid_bh // NUM_KV_HEADS
    kvh = pid_bh % NUM_KV_HEADS

    k_start = 0
    if MODE == MODE_DECODE:
        q_start = b * Q_LEN
        q_len = Q_LEN
        k_len = gl.load(CacheSeqlens + b)
    else:
        q_start = gl.load(CuSeqlensQ + b)
        q_len = gl.load(CuSeqlensQ + b + 1) - q_start
        if MODE == MODE_PREFILL:
            k_start = gl.load(CuSeqlensK + b)
            k_len = gl.load(CuSeqlensK + b + 1) - k_start
        else:
            k_len = gl.load(CacheSeqlens + b)
    offset = k_len - q_len  # absolute position of query token 0
    tok0 = pid_m * TOKENS

    # The key range this block can see, then this program's slice of it.
    last_tok = gl.minimum(tok0 + TOKENS, q_len) - 1
    hi = k_len
    if CAUSAL:
        hi = gl.minimum(offset + last_tok + 1, k_len)
    lo = 0
    if HAS_WINDOW:
        lo = gl.maximum(offset + tok0 - window_left, 0)
    hi = gl.where(tok0 < q_len, hi, lo)
    if SPLITS > 1:
        per_split = gl.cdiv(gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N), SPLITS) * BLOCK_N
        lo = lo + split * per_split
        hi = gl.minimum(hi, lo + per_split)

    # Q rows: (token, head within the group), loaded once.
    rq = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD_Q))
    dq = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_Q))
    tq = tok0 + rq // GROUP
    hq = kvh * GROUP + rq % GROUP
    q_off = (q_start + tq).to(gl.int64) * stride_qt + hq * HEAD_DIM
    q = gl.load(Q + q_off[:, None] + dq[None, :], mask=(tq < q_len)[:, None], other=0.0)
    q = gl.convert_layout(q, DOT_A)

    rows = gl.arange(0, BLOCK_M, layout=ROW)
    q_pos = offset + tok0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    qk_scale = sm_scale
    if KV_SCALES:
        qk_scale = qk_scale * gl.load(KScale)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], K_SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM_V], V_SMEM)
    nk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_K))
    dk = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_K))
    nv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_V))
    dv = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, LOAD_V))
    ncol = gl.arange(0, BLOCK_N, layout=COL)

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=ROW)
    acc = gl.zeros([BLOCK_M, HEAD_DIM_V], gl.float32, layout=MMA)

    # Prologue of the software pipeline: the first tile's K/V in registers.
    ck = lo + nk
    okk = ck < hi
    k_rows = _kv_rows(PageTable, b, stride_pt, k_start, ck, okk, stride_kp, stride_kt, PAGED, PAGE_SIZE)
    k_next = gl.load(K + k_rows[:, None] + kvh * stride_kh + dk[None, :], mask=okk[:, None], other=0.0)
    cv = lo + nv
    okv = cv < hi
    v_rows = _kv_rows(PageTable, b, stride_pt, k_start, cv, okv, stride_vp, stride_vt, PAGED, PAGE_SIZE)
    v_next = gl.load(V + v_rows[:, None] + kvh * stride_vh + dv[None, :], mask=okv[:, None], other=0.0)

    for start in range(lo, hi, BLOCK_N):
        k_smem.store(k_next.to(dtype))
        v_smem.store(v_next.to(dtype))
        # Issue the next tile's loads before this tile's math (masked off past the range).
        ck = start + BLOCK_N + nk
        okk = ck < hi
        k_rows = _kv_rows(PageTable, b, stride_pt, k_start, ck, okk, stride_kp, stride_kt, PAGED, PAGE_SIZE)
        k_next = gl.load(K + k_rows[:, None] + kvh * stride_kh + dk[None, :], mask=okk[:, None], other=0.0)
        cv = start + BLOCK_N + nv
        okv = cv < hi
        v_rows = _kv_rows(PageTable, b, stride_pt, k_start, cv, okv, stride_vp, stride_vt, PAGED, PAGE_SIZE)
        v_next = gl.load(V + v_rows[:, None] + kvh * stride_vh + dv[None, :], mask=okv[:, None], other=0.0)

        kt = k_smem.permute([1, 0]).load(DOT_B)
        s = gl.amd.cdna3.mfma(q, kt, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA))
        s = s * qk_scale
        if HAS_CAP:
            # cap * tanh(s / cap), tanh through exp2 (saturates correctly at +-inf)
            e = gl.exp2((2.0 * LOG2E / logit_cap) * s)
            s = logit_cap * (1.0 - 2.0 / (e + 1.0))
        s = s * LOG2E
        kpos = start + ncol
        ok = (kpos < hi)[None, :] & (q_pos >= 0)[:, None]
        if CAUSAL:
            ok = ok & (kpos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            ok = ok & (q_pos[:, None] - kpos[None, :] <= window_left)
        s = gl.where(ok, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        vt = v_smem.load(DOT_B)
        acc = gl.amd.cdna3.mfma(gl.convert_layout(p.to(dtype), DOT_A), vt, acc)
        m_i = m_new

    dcol = gl.arange(0, HEAD_DIM_V, layout=COL)
    t_abs = q_start + tok0 + rows // GROUP
    row_ok = (tok0 + rows // GROUP) < q_len
    if SPLITS == 1:
        m_f = m_i
        l_f = l_i
        if HAS_SINKS:
            sink = gl.load(Sinks + heads) * LOG2E
            m_f = gl.maximum(m_i, sink)
            l_f = l_i * gl.exp2(gl.where(m_i == float("-inf"), float("-inf"), m_i - m_f)) + gl.exp2(sink - m_f)
            norm = gl.where(l_f > 0, gl.exp2(gl.where(m_i == float("-inf"), float("-inf"), m_i - m_f)) / l_f, 0.0)
        else:
            norm = gl.where(l_f > 0, 1.0 / l_f, 0.0)
        if KV_SCALES:
            norm = norm * gl.load(VScale)
        o = acc * norm[:, None]
        o_off = t_abs.to(gl.int64) * stride_ot + heads * HEAD_DIM_V
        gl.store(Out + o_off[:, None] + dcol[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            lse = gl.where(l_f > 0, (m_f + gl.log2(l_f)) / LOG2E, float("-inf"))
            gl.store(Lse + t_abs.to(gl.int64) * (NUM_KV_HEADS * GROUP) + heads, lse, mask=row_ok)
    else:
        o = acc * gl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]
        part = (split * num_tokens + t_abs).to(gl.int64) * (NUM_KV_HEADS * GROUP) + heads
        gl.store(PartOut + part[:, None] * HEAD_DIM_V + dcol[None, :], o, mask=row_ok[:, None])
        gl.store(PartLse + part, gl.where(l_i > 0, m_i + gl.log2(l_i), float("-inf")), mask=row_ok)


@gluon.jit
def combine_kernel(
    PartOut, PartLse, Out, Lse, Sinks, VScale, stride_ot, num_tokens,
    NUM_Q_HEADS: gl.constexpr, HEAD_DIM_V: gl.constexpr, SPLITS: gl.constexpr, HAS_SINKS: gl.constexpr,
    KV_SCALES: gl.constexpr, WRITE_LSE: gl.constexpr, LAYOUT: gl.constexpr,
):  # fmt: skip
    """Merge ``SPLITS`` partial results of one (token, head): ``PartOut`` float32
    ``[SPLITS, tokens, Hq, Dv]`` normalized per split, ``PartLse`` float32 ``[SPLITS, tokens, Hq]``
    in base 2 (-inf for an empty split); the sink joins the denominator."""
    t = gl.program_id(0)
    h = gl.program_id(1)
    sp = gl.arange(0, SPLITS, layout=gl.SliceLayout(1, LAYOUT))
    d = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, LAYOUT))
    row = (sp * num_tokens + t).to(gl.int64) * NUM_Q_HEADS + h
    lse = gl.load(PartLse + row)
    m = gl.max(lse, axis=0)
    if HAS_SINKS:
        sink = gl.load(Sinks + h) * LOG2E
        m = gl.maximum(m, sink)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    w = gl.exp2(lse - m_safe)
    denom = gl.sum(w, axis=0)
    if HAS_SINKS:
        denom = denom + gl.exp2(sink - m_safe)
    parts = gl.load(PartOut + row[:, None] * HEAD_DIM_V + d[None, :])
    o = gl.sum(parts * w[:, None], axis=0)
    o = o * gl.where(denom > 0, 1.0 / denom, 0.0)
    if KV_SCALES:
        o = o * gl.load(VScale)
    gl.store(Out + t.to(gl.int64) * stride_ot + h * HEAD_DIM_V + d, o.to(Out.dtype.element_ty))
    if WRITE_LSE:
        gl.store(
            Lse + t.to(gl.int64) * NUM_Q_HEADS + h,
            gl.where(denom > 0, (m_safe + gl.log2(denom)) / LOG2E, float("-inf")),
        )
