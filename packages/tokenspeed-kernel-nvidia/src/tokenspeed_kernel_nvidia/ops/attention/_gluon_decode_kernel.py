"""Gluon (Triton's explicit-layout dialect) paged split-KV decode for Hopper: the kernels.

Grid ``(batch, Hkv, splits)``; one program serves the whole GQA group of a KV head (its
``G`` query heads padded to 16 MMA rows), so each K/V tile is read once per KV head. Key
tiles of ``BLOCK_N`` keys are gathered page by page from the NHD cache with 16-byte
``cp.async`` copies into a ``STAGES``-deep shared-memory ring (``commit_group`` /
``wait_group`` keep ``STAGES - 1`` tiles in flight while the current one is consumed);
``q·kᵀ`` and ``p·v`` run on the tensor cores (``mma.sync`` m16n8k16) from shared memory.
Each split writes its normalized partial output and its natural-log LSE to a float32
workspace; the splits are then merged, with the sink added to the denominator, either by
:func:`combine_kernel` (a second launch) or, with ``FUSED``, by the last split program of
each (sequence, KV head) to finish: it counts itself in with a ``gpu``-scope acq_rel atomic
after a CTA barrier (the release orders the whole CTA's partial stores, the semaphore
pattern of split-K GEMMs), reads the other splits' partials past L1 (``.cg``), writes the
output and resets the counter to 0 for the next call (or graph replay).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _row_offsets(page, slot, kv_head, offs_d, stride_p, stride_t, stride_h):
    """Element offsets ``[BLOCK_N, D]`` of one KV head's rows in a (possibly strided) cache.
    The registration admits only 16-byte aligned caches (``kv_align`` 16), so every row
    starts on a multiple of 8 elements: the copies stay 16 bytes wide."""
    row = page * stride_p + slot * stride_t + kv_head * stride_h
    offs = gl.expand_dims(row, 1) + gl.expand_dims(offs_d, 0)
    return gl.max_contiguous(gl.multiple_of(offs, [1, 8]), [1, 8])


@gluon.jit
def _issue_tile(
    k_smem,
    v_smem,
    k_ptr,
    v_ptr,
    pt_row_ptr,
    kv_head,
    tile_start,
    kv_end,
    k_stride_p,
    k_stride_t,
    k_stride_h,
    v_stride_p,
    v_stride_t,
    v_stride_h,
    PAGE: gl.constexpr,
    D: gl.constexpr,
    BLOCK_N: gl.constexpr,
    LOAD: gl.constexpr,
):
    """Gather keys ``[tile_start, tile_start + BLOCK_N)`` (masked at ``kv_end``) of one KV
    head into the given shared-memory slots with cp.async (masked rows are zero-filled)."""
    offs_n = tile_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    valid = offs_n < kv_end
    page = gl.load(pt_row_ptr + offs_n // PAGE, mask=valid, other=0).to(gl.int64)
    slot = offs_n % PAGE
    k_offs = _row_offsets(page, slot, kv_head, offs_d, k_stride_p, k_stride_t, k_stride_h)
    v_offs = _row_offsets(page, slot, kv_head, offs_d, v_stride_p, v_stride_t, v_stride_h)
    mask = gl.expand_dims(valid, 1)
    async_copy.async_copy_global_to_shared(k_smem, k_ptr + k_offs, mask=mask)
    async_copy.async_copy_global_to_shared(v_smem, v_ptr + v_offs, mask=mask)


@gluon.jit
def _combine_group(
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    out_ptr,
    lse_ptr,
    b,
    kv_head,
    HQ: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    SPLITS: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    LOAD: gl.constexpr,
):
    """Merge the ``SPLITS`` partials of the ``G`` query heads of one KV head (rows padded to
    16) into ``out`` (and ``lse``); the sink joins the denominator. Partials are read with
    ``.cg`` (L2, not this SM's L1): other programs wrote them during this launch."""
    rows_m = gl.arange(0, 16, layout=gl.SliceLayout(1, LOAD))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    row_ok = rows_m < G
    heads = kv_head * G + rows_m
    base = (b * HQ + heads) * SPLITS
    m = gl.full([16], float("-inf"), gl.float32, layout=gl.SliceLayout(1, LOAD))
    for s in range(SPLITS):
        m = gl.maximum(m, gl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
    if HAS_SINKS:
        sink = gl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf")).to(gl.float32)
        m = gl.maximum(m, sink)
    m_safe = gl.where(m == float("-inf"), 0.0, m)
    denom = gl.zeros([16], gl.float32, layout=gl.SliceLayout(1, LOAD))
    acc = gl.zeros([16, D], gl.float32, layout=LOAD)
    mask2 = gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < D, 0)
    for s in range(SPLITS):
        w = gl.exp(gl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_safe)
        denom += w
        offs = gl.expand_dims((base + s) * D, 1) + gl.expand_dims(cols, 0)
        part = gl.load(part_out_ptr + offs, mask=mask2, other=0.0, cache_modifier=".cg")
        acc += part * gl.expand_dims(w, 1)
    if HAS_SINKS:
        denom += gl.exp(sink - m_safe)
    safe = gl.where(denom > 0.0, denom, 1.0)
    out = acc / gl.expand_dims(safe, 1)
    o_offs = gl.expand_dims((b * HQ + heads) * D, 1) + gl.expand_dims(cols, 0)
    gl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask2)
    if HAS_LSE:
        gl.store(lse_ptr + b * HQ + heads, gl.where(denom > 0.0, m_safe + gl.log(safe), float("-inf")), mask=row_ok)


@gluon.jit
def decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seqlens_ptr,
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    out_ptr,
    lse_ptr,
    count_ptr,
    pt_stride,
    k_stride_p,
    k_stride_t,
    k_stride_h,
    v_stride_p,
    v_stride_t,
    v_stride_h,
    sm_scale,
    logit_cap,
    window_left,
    HQ: gl.constexpr,
    HKV: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    PAGE: gl.constexpr,
    SPLITS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_CAP: gl.constexpr,
    LOAD: gl.constexpr,
    SMEM: gl.constexpr,
    MMA: gl.constexpr,
    FUSED: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    Q_ROW: gl.constexpr,
):
    """Partial attention of one (sequence, KV head, split); with ``FUSED`` the last split
    of the (sequence, KV head) to finish also merges them into ``out``.

    q: ``[B, HQ, D]``, each sequence's row of ``HQ * D`` values contiguous, ``Q_ROW`` elements
    from one row to the next (``HQ * D``: contiguous, the build of every contiguous q; more: a
    row-strided q, ``strided_q``); k/v: ``[pages, PAGE, HKV, D]`` with element strides
    ``(k|v)_stride_(p|t|h)`` (any, 16-byte multiples) and 1; page_table int32 ``[B, pt_stride]``;
    seqlens int32 ``[B]``; part_out float32 ``[B, HQ, SPLITS, D]``; part_lse float32
    ``[B, HQ, SPLITS]`` (``-inf`` for an empty split). ``FUSED`` only: sinks float32
    ``[HQ]`` (``HAS_SINKS``), out ``[B, HQ, D]`` in q's dtype, lse float32 ``[B, HQ]``
    (``HAS_LSE``), count int32 ``[B * HKV]``, all 0 between calls.
    """
    BLOCK_M: gl.constexpr = 16
    b = gl.program_id(0)
    kv_head = gl.program_id(1)
    split = gl.program_id(2)
    dtype: gl.constexpr = k_ptr.dtype.element_ty

    seqlen = gl.load(seqlens_ptr + b)
    kv_begin = gl.maximum(seqlen - 1 - window_left, 0)  # window_left = 2**30 without a window
    span = seqlen - kv_begin
    per_split = gl.cdiv(gl.cdiv(span, SPLITS), BLOCK_N) * BLOCK_N
    start = kv_begin + split * per_split
    end = gl.minimum(start + per_split, seqlen)
    num_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)

    # Query rows of the group (padded to 16), staged in the A-operand layout.
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, LOAD))
    q_rows = kv_head * G + offs_m
    if Q_ROW == HQ * D:
        q_offs = (b * HQ + gl.expand_dims(q_rows, 1)) * D + gl.expand_dims(offs_d, 0)
    else:  # a row-strided q: sequence b's row starts b * Q_ROW elements in
        q_offs = b.to(gl.int64) * Q_ROW + gl.expand_dims(q_rows * D, 1) + gl.expand_dims(offs_d, 0)
    q_mask = gl.expand_dims(offs_m < G, 1) & gl.expand_dims(offs_d < D, 0)
    q = gl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    q = gl.convert_layout(q, a_layout)

    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], SMEM)
    pt_row_ptr = page_table_ptr + b.to(gl.int64) * pt_stride

    for st in gl.static_range(STAGES - 1):
        _issue_tile(
            k_smem.index(st),
            v_smem.index(st),
            k_ptr,
            v_ptr,
            pt_row_ptr,
            kv_head,
            start + st * BLOCK_N,
            end,
            k_stride_p,
            k_stride_t,
            k_stride_h,
            v_stride_p,
            v_stride_t,
            v_stride_h,
            PAGE,
            D,
            BLOCK_N,
            LOAD,
        )
        async_copy.commit_group()

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=MMA)
    qk_scale = sm_scale * LOG2E
    offs_key = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))

    for t in range(num_tiles):
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        nxt = t + STAGES - 1
        slot_n = nxt % STAGES
        _issue_tile(
            k_smem.index(slot_n),
            v_smem.index(slot_n),
            k_ptr,
            v_ptr,
            pt_row_ptr,
            kv_head,
            start + nxt * BLOCK_N,
            end,
            k_stride_p,
            k_stride_t,
            k_stride_h,
            v_stride_p,
            v_stride_t,
            v_stride_h,
            PAGE,
            D,
            BLOCK_N,
            LOAD,
        )
        async_copy.commit_group()

        slot = t % STAGES
        k_t = k_smem.index(slot).permute((1, 0)).load(b_layout)  # [D, BLOCK_N]
        sc = mma_v2(q, k_t, gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=MMA))
        if HAS_CAP:
            x = sc * (sm_scale / logit_cap)
            e2 = gl.exp2(x * (2.0 * LOG2E))
            sc = logit_cap * (1.0 - 2.0 / (e2 + 1.0)) * LOG2E  # cap * tanh(x), in log2 units
        else:
            sc = sc * qk_scale
        key = start + t * BLOCK_N + offs_key
        sc = gl.where(gl.expand_dims(key < end, 0), sc, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sc, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(sc - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(alpha, 1)
        v_t = v_smem.index(slot).load(b_layout)  # [BLOCK_N, D]
        acc = mma_v2(gl.convert_layout(p.to(dtype), a_layout), v_t, acc)
        m_i = m_new
    async_copy.wait_group(0)

    has = l_i > 0.0
    out = acc / gl.expand_dims(gl.where(has, l_i, 1.0), 1)
    lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) / LOG2E, float("-inf"))
    rows = kv_head * G + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, MMA))
    row_ok = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA)) < G
    base = (b * HQ + rows) * SPLITS + split
    gl.store(part_lse_ptr + base, lse, mask=row_ok)
    o_offs = gl.expand_dims(base * D, 1) + gl.expand_dims(cols, 0)
    gl.store(part_out_ptr + o_offs, out, mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < D, 0))
    if FUSED:
        gl.thread_barrier()  # every thread's partial stores precede the release below
        counter = count_ptr + b * HKV + kv_head
        if gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
            _combine_group(
                part_out_ptr,
                part_lse_ptr,
                sinks_ptr,
                out_ptr,
                lse_ptr,
                b,
                kv_head,
                HQ,
                G,
                D,
                SPLITS,
                HAS_SINKS,
                HAS_LSE,
                LOAD,
            )
            gl.store(counter, 0)


@triton.jit
def combine_kernel(
    part_out_ptr,
    part_lse_ptr,
    sinks_ptr,
    out_ptr,
    lse_ptr,
    HQ: tl.constexpr,
    D: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """Merge the splits of one (sequence, query head); the sink joins the denominator."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    base = (b * HQ + h) * SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    denom = tl.sum(w, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - m_safe)
    parts = tl.load(
        part_out_ptr + (base + offs_s[:, None]) * D + offs_d[None, :], mask=offs_s[:, None] < SPLITS, other=0.0
    )
    safe = tl.where(denom > 0.0, denom, 1.0)
    out = tl.sum(parts * w[:, None], 0) / safe
    tl.store(out_ptr + (b * HQ + h) * D + offs_d, out.to(out_ptr.dtype.element_ty))
    if HAS_LSE:
        tl.store(lse_ptr + b * HQ + h, tl.where(denom > 0.0, m_safe + tl.log(safe), float("-inf")))
