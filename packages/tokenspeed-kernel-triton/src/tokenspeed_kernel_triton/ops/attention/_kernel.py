"""The Triton attention kernel shared by prefill, extend and decode, and its split combine.

One program owns a tile of ``BLOCK_T`` query tokens of one sequence × all ``G = Hq / Hkv``
query heads of one KV head (rows ``t * G_PAD + g``), so every K/V tile it loads serves the
whole GQA group. It walks the keys its rows can see — ``[lo, hi)`` from the causal bound and
the window, so tiles wholly outside are never visited and cost follows the window — with
the FlashAttention-2 online softmax in base 2. Keys come from a contiguous ragged batch
(prefill) or through the page table (extend, decode). With ``NUM_SPLITS > 1`` (decode with
few sequences) the key range is cut into splits processed by separate programs that write
normalized partial outputs and their log-sum-exp; :func:`combine_kernel` merges them and
folds in the sink. With one split the sink is folded in directly.

fp8 caches are up-cast to the query dtype in registers; ``k_scale`` joins the softmax scale
and ``v_scale`` multiplies the output. Under the Triton interpreter (``INTERPRET``), bf16 is
carried as uint16 and ``tl.dot`` on it is wrong, so operands are up-cast to fp32 first.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    # tanh(x) = 1 - 2 / (exp(2x) + 1); exact enough in fp32 and portable across backends.
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def _tile(
    q, acc, l_i, m_i, start_n, my_hi, b, kvh, k_start, K, V, PageTable, stride_pt,
    stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, offs_d, offs_dv, pos, row_ok,
    qk_scale, logit_cap, window_left,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CAP: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, MASKED: tl.constexpr, CHECK_N: tl.constexpr,
):  # fmt: skip
    """One key tile of the online softmax; ``MASKED`` tiles apply bounds, causal and window masks."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < my_hi
    if PAGED:
        if MASKED:
            page = tl.load(PageTable + b * stride_pt + offs_n // PAGE_SIZE, mask=n_ok, other=0)
        else:
            page = tl.load(PageTable + b * stride_pt + offs_n // PAGE_SIZE)
        page = page.to(tl.int64)
        k_rows = page * stride_kp + (offs_n % PAGE_SIZE) * stride_kt
        v_rows = page * stride_vp + (offs_n % PAGE_SIZE) * stride_vt
    else:
        k_rows = (k_start + offs_n).to(tl.int64) * stride_kt
        v_rows = (k_start + offs_n).to(tl.int64) * stride_vt
    k_mask = offs_d[None, :] < HEAD_DIM
    v_mask = offs_dv[None, :] < HEAD_DIM_V
    if MASKED:
        k_mask = k_mask & n_ok[:, None]
        v_mask = v_mask & n_ok[:, None]
    k = tl.load(K + k_rows[:, None] + kvh * stride_kh + offs_d[None, :], mask=k_mask, other=0.0)
    v = tl.load(V + v_rows[:, None] + kvh * stride_vh + offs_dv[None, :], mask=v_mask, other=0.0)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    if MASKED:
        # Some row may not see some key of this tile (window edge, causal diagonal), and
        # such a key may hold NaN/inf (a stale cache slot): its probability is 0 for that
        # row, but 0 * NaN is NaN. Masking is by selection: non-finite values are zeroed
        # (K needs nothing: its logits are replaced by -inf below). Middle tiles are seen
        # by every row and keep their values.
        v = tl.where(tl.abs(v) < float("inf"), v, 0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if HAS_CAP:
        s = logit_cap * _tanh(s * (qk_scale / logit_cap))
        s = s * 1.4426950408889634
    else:
        s = s * (qk_scale * 1.4426950408889634)
    if MASKED:
        # Rows past the sequence or the group (row_ok false) are never stored and see finite
        # logits, so they need no mask. Under causal masking without splits, j <= pos already
        # keeps j inside the key range (CHECK_N false): two fewer operations per logit.
        delta = pos[:, None] - offs_n[None, :]
        if CAUSAL:
            visible = delta >= 0
            if HAS_WINDOW:
                visible = visible & (delta <= window_left)
            if CHECK_N:
                visible = visible & n_ok[None, :]
        elif HAS_WINDOW:
            visible = (delta <= window_left) & n_ok[None, :]
        else:
            visible = n_ok[None, :] & (delta == delta)
        s = tl.where(visible, s, float("-inf"))
    # Unconditional rescale of acc. A lazy variant (move the max only when it grows by > 2^8,
    # in a scalar `if`) was measured on an H100: window-128 prefill 2.5% faster but causal
    # prefill 17-53% slower (a branch on acc between two wgmma's serializes them): not kept.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if INTERPRET:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def attention_kernel(
    Q, K, V, Out, Lse, PartOut, PartLse,
    Sinks, KScale, VScale, PageTable, CuSeqlensQ, CuSeqlensK, CacheSeqlens,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh,
    stride_vp, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    num_q_heads, q_len_uniform, sm_scale, logit_cap, window_left,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, UNIFORM_Q: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_SCALES: tl.constexpr,
    WRITE_LSE: tl.constexpr, NUM_SPLITS: tl.constexpr, Q_BLOCKS: tl.constexpr,
    INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr, CHECK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b = pid // Q_BLOCKS
    tok_start = (pid % Q_BLOCKS) * BLOCK_T

    if UNIFORM_Q:
        q_start = b * q_len_uniform
        q_count = q_len_uniform
    else:
        q_start = tl.load(CuSeqlensQ + b)
        q_count = tl.load(CuSeqlensQ + b + 1) - q_start
    if tok_start >= q_count:
        return
    if PAGED:
        k_len = tl.load(CacheSeqlens + b)
        k_start = 0
    else:
        k_start = tl.load(CuSeqlensK + b)
        k_len = tl.load(CuSeqlensK + b + 1) - k_start

    rows = tl.arange(0, BLOCK_T * G_PAD)
    t = tok_start + rows // G_PAD
    g = rows % G_PAD
    row_ok = (t < q_count) & (g < G)
    head = kvh * G + g
    pos = k_len - q_count + t  # absolute position of each query row (bottom-right)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = Q + (q_start + t)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    # Keys this tile can see, then this split's share (aligned to BLOCK_N).
    last_t = tl.minimum(tok_start + BLOCK_T, q_count) - 1
    pos_lo = k_len - q_count + tok_start
    pos_hi = k_len - q_count + last_t
    hi = tl.minimum(pos_hi + 1, k_len) if CAUSAL else k_len
    lo = tl.maximum(pos_lo - window_left, 0) if HAS_WINDOW else 0
    lo = (lo // BLOCK_N) * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    my_lo = lo + split * chunk
    my_hi = tl.minimum(hi, my_lo + chunk)

    qk_scale = sm_scale
    if HAS_SCALES:
        qk_scale = qk_scale * tl.load(KScale)
    m_i = tl.full([BLOCK_T * G_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_T * G_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_T * G_PAD, BLOCK_DV], dtype=tl.float32)
    if INTERPRET:
        q = q.to(tl.float32)

    # Three stretches of key tiles: masked at the window's left edge, unmasked in the middle
    # (every row sees every key: no mask arithmetic, no bounds checks), masked at the causal
    # diagonal / range end. Boundaries are BLOCK_N-aligned because my_lo is.
    if HAS_WINDOW:
        full_lo = tl.cdiv(tl.maximum(pos_hi - window_left, 0), BLOCK_N) * BLOCK_N
    else:
        full_lo = my_lo
    if CAUSAL:
        full_hi = ((pos_lo + 1) // BLOCK_N) * BLOCK_N
    else:
        full_hi = my_lo + ((my_hi - my_lo) // BLOCK_N) * BLOCK_N
    b_lo = tl.minimum(tl.maximum(full_lo, my_lo), my_hi)
    b_hi = tl.minimum(tl.maximum(full_hi, b_lo), my_hi)
    bounds = (my_lo, b_lo, b_hi, my_hi)
    for stretch in tl.static_range(3):  # masked left edge, unmasked middle, masked right edge
        for start_n in range(bounds[stretch], bounds[stretch + 1], BLOCK_N):
            acc, l_i, m_i = _tile(
                q,
                acc,
                l_i,
                m_i,
                start_n,
                my_hi,
                b,
                kvh,
                k_start,
                K,
                V,
                PageTable,
                stride_pt,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                offs_d,
                offs_dv,
                pos,
                row_ok,
                qk_scale,
                logit_cap,
                window_left,
                HEAD_DIM,
                HEAD_DIM_V,
                BLOCK_N,
                PAGE_SIZE,
                PAGED,
                CAUSAL,
                HAS_WINDOW,
                HAS_CAP,
                INTERPRET,
                DOT_PREC,
                stretch != 1,
                CHECK_N,
            )

    if NUM_SPLITS == 1:
        if HAS_SINKS:
            sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            m_fs = tl.where(m_f == float("-inf"), 0.0, m_f)
            scale_old = tl.exp2(m_i - m_fs)
            l_i = l_i * scale_old + tl.exp2(sink - m_fs)
            acc = acc * scale_old[:, None]
            m_i = m_fs
        else:
            m_i = tl.where(m_i == float("-inf"), 0.0, m_i)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if HAS_SCALES:
            out = out * tl.load(VScale)
        o_ptrs = Out + (q_start + t)[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
        if WRITE_LSE:
            lse = tl.where(l_i > 0, (m_i + tl.log2(l_i)) / 1.4426950408889634, float("-inf"))
            tl.store(Lse + (q_start + t) * num_q_heads + head, lse, mask=row_ok)
    else:
        # Partials: normalized output and base-2 log-sum-exp of this split (-inf if empty).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        lse2 = tl.where(l_i > 0, m_i + tl.log2(l_i), float("-inf"))
        row = (q_start + t) * num_q_heads + head
        tl.store(
            PartOut + (row * NUM_SPLITS + split)[:, None] * BLOCK_DV + offs_dv[None, :],
            out,
            mask=row_ok[:, None],
        )
        tl.store(PartLse + row * NUM_SPLITS + split, lse2, mask=row_ok)


@triton.jit
def combine_kernel(
    PartOut, PartLse, Out, Lse, Sinks, VScale,
    stride_ot, stride_oh, num_q_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_SCALES: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Merge the split partials of one (query token, head) row, folding in the sink."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token * num_q_heads + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < NUM_SPLITS
    lse2 = tl.load(PartLse + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse2, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse2 - m_safe)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom = denom + tl.exp2(sink - m_safe)
    parts = tl.load(
        PartOut + (row * NUM_SPLITS + offs_s)[:, None] * BLOCK_DV + offs_dv[None, :], mask=s_ok[:, None], other=0.0
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    if HAS_SCALES:
        out = out * tl.load(VScale)
    tl.store(
        Out + token * stride_ot + head * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=offs_dv < HEAD_DIM_V
    )
    if WRITE_LSE:
        lse = tl.where(denom > 0, (m_safe + tl.log2(denom)) / 1.4426950408889634, float("-inf"))
        tl.store(Lse + row, lse)
