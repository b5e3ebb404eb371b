"""Gluon paged extend (chunked prefill) for Hopper after FlashAttention-3: the kernel.

New query tokens attend to a paged KV cache that already holds their prefix and themselves
(query ``t`` of sequence ``b`` sits at position ``cache_seqlens[b] - len_q + t``; causal,
optional sliding window, optional sinks). The design is the dense FA3-style prefill's
(:mod:`._gluon_prefill_fa3_kernel`): persistent grid over per-head work tiles of
``BLOCK_M = 2 x HALF`` query tokens, heaviest first; warp specialization into a one-warp TMA
producer and two consumer warpgroups on ``wgmma`` (intra-warpgroup overlap of the softmax
with ``P·V``, optional ping-pong between the warpgroups). What differs:

- **K/V pages by TMA, one box per page.** The caches are viewed as 4-D tensors
  ``[num_pages, Hkv, P, D]`` with their own strides (contiguous NHD, HND, vLLM's interleaved
  rows, one half of a stacked pool: any 16-byte multiple strides), box ``[1, 1, BOX, D]``
  with ``BOX = min(P, BLOCK_N)``. A ``[BLOCK_N, D]`` key tile is ``BLOCK_N // BOX`` boxes
  written to consecutive row blocks of one 128-byte-swizzled ring slot (the swizzle is a
  function of the shared address and every box starts on a 1024-byte boundary, so the
  boxes compose exactly the tile a single 2-D box would have written); one ``expect`` of the
  whole tile's bytes per K or V tile. Pages past a sequence's last page get the coordinate
  ``num_pages`` (out of bounds: the TMA unit zero-fills the box and still counts its bytes).
- **Page ids one tile ahead.** The producer loads the ``BLOCK_N // BOX`` page-table entries
  of the next key tile (one vector load) before it issues the copies of the current one.
- **Key tiles aligned to BLOCK_N** (the boxes must start on page boundaries): the band of
  a work tile is ``[lo // BLOCK_N, cdiv(hi, BLOCK_N))`` key tiles, ``lo = max(p0 - W, 0)``,
  ``hi`` the last real row's position + 1, visited from the diagonal down.
- **Unseen values never leak.** A tile some row of the work tile masks (diagonal, window
  edge, the stale tail of the last page) may hold NaN/inf in keys or values no row may
  see; scores are masked by selection, and before ``P·V`` each consumer warpgroup zeroes
  the non-finite values of its half of the V tile in shared memory, then both meet on a
  barrier (``v_clean``): 0 x NaN never reaches the accumulator (docs/api.md).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_fa3_kernel import _pass_turn, _wait_turn
from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_kernel import LN2, LOG2E, softmax_epilogue


@gluon.jit
def _tile(t, n_m, batch, cu_q_ptr, seqlens_ptr, window, HQ: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work tile ``t`` (heaviest-first order of the dense kernel: query block
    ``n_m - 1 - t // (batch * HQ)``, then sequence, then head). Returns ``(valid, b, head,
    q_begin, m0, len_q, len_k, p0, j_lo, n_kv)``: ``p0`` the position of the tile's first
    row, ``n_kv`` key tiles ``j_lo .. j_lo + n_kv - 1`` (the band; :func:`key_band` in the
    launcher mirrors it)."""
    per_block = batch * HQ
    m_rev = t // per_block
    rest = t - m_rev * per_block
    b = rest // HQ
    head = rest - b * HQ
    m0 = (n_m - 1 - m_rev) * BLOCK_M
    q_begin = gl.load(cu_q_ptr + b)
    len_q = gl.load(cu_q_ptr + b + 1) - q_begin
    len_k = gl.load(seqlens_ptr + b)
    valid = m0 < len_q
    p0 = len_k - len_q + m0
    hi = len_k - len_q + gl.minimum(m0 + BLOCK_M, len_q)  # last real row's position + 1
    j_lo = gl.maximum(p0 - window, 0) // BLOCK_N
    j_hi = gl.cdiv(gl.minimum(gl.maximum(hi, 0), len_k), BLOCK_N)
    n_kv = gl.maximum(j_hi - j_lo, 0)
    return valid, b, head, q_begin, m0, len_q, len_k, p0, j_lo, n_kv


@gluon.jit
def _edge(j, first, last, window, BLOCK_N: gl.constexpr):
    """Whether key tile ``j`` needs the mask for rows at positions ``first .. last``: it
    crosses the diagonal of the first row or the window's left edge of the last one."""
    start = j * BLOCK_N
    return (start + BLOCK_N - 1 > first) | (start < last - window)


@gluon.jit
def _page_ids(table_ptr, row, j, n_pages, max_pages, num_pages, boxes, BLOCK_N: gl.constexpr, BOX: gl.constexpr,
              PAGE: gl.constexpr):  # fmt: skip
    """The page ids of key tile ``j``'s boxes (``boxes = arange(BLOCK_N // BOX)``); a box past
    the sequence's ``n_pages`` pages (or the table's width) gets ``num_pages`` (zero-filled)."""
    idx = (j * BLOCK_N + boxes * BOX) // PAGE
    ok = (idx >= 0) & (idx < n_pages) & (idx < max_pages)
    ids = gl.load(table_ptr + row + idx, mask=ok, other=0)
    return gl.where(ok, ids, num_pages)


@gluon.jit
def _issue_pages(desc, smem, bar, ids, boxes, j, kv_head, BLOCK_N: gl.constexpr, BOX: gl.constexpr,
                 PAGE: gl.constexpr, D: gl.constexpr):  # fmt: skip
    """One key tile into ring slot ``smem [BLOCK_N, D]``: an ``expect`` of its bytes, then
    per page (or per ``BOX`` rows of a larger page) one ``[1, 1, BOX, SWZ]`` TMA box per
    ``SWZ``-column block (the 128-byte swizzle's width: the slot holds ``D // SWZ`` such
    column blocks one after the other, each ``[BLOCK_N, SWZ]``)."""
    SWZ: gl.constexpr = desc.block_type.shape[3]
    mbarrier.expect(bar, BLOCK_N * D * desc.dtype.primitive_bitwidth // 8)
    for r in gl.static_range(BLOCK_N // BOX):
        page = gl.sum(gl.where(boxes == r, ids, 0), axis=0)
        tok = (j * BLOCK_N + r * BOX) % PAGE
        for c in gl.static_range(D // SWZ):
            block = smem if D == SWZ else smem.slice(c * SWZ, SWZ, dim=1)
            dst = block.slice(r * BOX, BOX)._reinterpret(desc.dtype, [1, 1, BOX, SWZ], desc.layout)
            tma.async_copy_global_to_shared(desc, [page, kv_head, tok, c * SWZ], bar, dst)


@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    bars,
    cu_q_ptr,
    seqlens_ptr,
    table_ptr,
    table_stride,
    max_pages,
    num_pages,
    window,
    n_m,
    batch,
    total,
    HQ: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: TMA copies of each tile's two Q halves, then its K/V tiles from the
    diagonal down, page by page, each into the ring slot the consumers released; the page
    ids of key tile ``i + 1`` are loaded while tile ``i`` is issued."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, _turn, _clean = bars
    ids_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    boxes = gl.arange(0, BLOCK_N // BOX, layout=ids_layout)
    it = 0
    n_done = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, b, head, q_begin, m0, _len_q, len_k, _p0, j_lo, n_kv = _tile(
            t, n_m, batch, cu_q_ptr, seqlens_ptr, window, HQ, 2 * HALF, BLOCK_N
        )
        if valid:
            for w in gl.static_range(2):
                mbarrier.wait(q_empty.index(w), (n_done & 1) ^ 1)
                mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    q_desc, [q_begin + m0 + w * HALF, head * D], q_ready.index(w), q_smem.index(w)
                )
            n_done += 1
            kv_head = head // G
            row = b.to(gl.int64) * table_stride
            n_pages = gl.cdiv(len_k, PAGE)
            j = j_lo + n_kv - 1
            ids = _page_ids(table_ptr, row, j, n_pages, max_pages, num_pages, boxes, BLOCK_N, BOX, PAGE)
            for _i in range(n_kv):
                nxt = _page_ids(table_ptr, row, j - 1, n_pages, max_pages, num_pages, boxes, BLOCK_N, BOX, PAGE)
                slot = it % STAGES
                phase = ((it // STAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(slot), phase)
                _issue_pages(k_desc, k_smem.index(slot), k_ready.index(slot), ids, boxes, j, kv_head, BLOCK_N, BOX,
                             PAGE, D)  # fmt: skip
                mbarrier.wait(v_empty.index(slot), phase)
                _issue_pages(v_desc, v_smem.index(slot), v_ready.index(slot), ids, boxes, j, kv_head, BLOCK_N, BOX,
                             PAGE, D)  # fmt: skip
                ids = nxt
                j -= 1
                it += 1


@gluon.jit
def _clean_v(v_tile, dirty, clean, n_dirty, WG: gl.constexpr, HALF: gl.constexpr, CLEAN: gl.constexpr):
    """On a tile some row masks (``dirty``): zero the non-finite values of this warpgroup's
    half of the V tile ``v_tile [2 * HALF, D]`` in shared memory, then wait until the other
    warpgroup has cleaned its half (``clean``: one arrival per warpgroup per dirty tile).
    Returns the dirty-tile count (the barrier's phase)."""
    if dirty:
        half = v_tile.slice(WG * HALF, HALF)
        x = half.load(CLEAN)
        half.store(gl.where(gl.abs(x) < float("inf"), x, gl.zeros_like(x)))
        fence_async_shared()  # the generic-proxy stores visible to wgmma (async proxy)
        gl.thread_barrier()  # every thread of the warpgroup has stored before the arrival
        mbarrier.arrive(clean, count=1)
        mbarrier.wait(clean, n_dirty & 1)
        n_dirty += 1
    return n_dirty


@gluon.jit
def _softmax_step(s, m_i, l_i, row_pos, cols, start, qk_scale, window, masked, dtype: gl.constexpr,
                  p_layout: gl.constexpr):  # fmt: skip
    """One online-softmax step on raw scores ``s [HALF, BLOCK_N]`` (fp32): on masked tiles keep
    key ``start + c`` for row position ``p`` iff ``0 <= p - start - c <= window`` (one
    unsigned compare, by selection); running max in scaled base-2 units. Returns ``(p, alpha,
    m_new, l_new)``, ``p`` in the input dtype and the wgmma A-operand layout."""
    if masked:
        dist = gl.expand_dims(row_pos - start, 1) - gl.expand_dims(cols, 0)
        s = gl.where(dist.to(gl.uint32, bitcast=True) <= window.to(gl.uint32), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing yet
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_new


@gluon.jit
def _consumer(
    q_smem,
    k_smem,
    v_smem,
    bars,
    o_ptr,
    lse_ptr,
    sinks_ptr,
    cu_q_ptr,
    seqlens_ptr,
    sm_scale,
    window,
    n_m,
    batch,
    total,
    WG: gl.constexpr,
    HQ: gl.constexpr,
    D: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    S_MMA: gl.constexpr,
    O_MMA: gl.constexpr,
    CLEAN: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """One warpgroup: rows ``[m0 + WG * HALF, + HALF)`` of every tile of this program."""
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, clean = bars
    dtype: gl.constexpr = o_ptr.dtype.element_ty
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2)
    qk_scale = sm_scale * LOG2E
    my_q = q_smem.index(WG)
    rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, S_MMA))
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=S_MMA)
    o_rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, O_MMA))
    o_cols = gl.arange(0, D, layout=gl.SliceLayout(0, O_MMA))
    it = 0  # K/V ring position (shared order with the producer)
    rnd = 0  # wgmma issue rounds (ping-pong hand-off)
    n_done = 0
    n_dirty = 0  # dirty V tiles cleaned (the clean barrier's phase)
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, _b, head, q_begin, m0, len_q, _len_k, p0, j_lo, n_kv = _tile(
            t, n_m, batch, cu_q_ptr, seqlens_ptr, window, HQ, 2 * HALF, BLOCK_N
        )
        if valid:
            r0 = m0 + WG * HALF  # this warpgroup's first token
            my_p0 = p0 + WG * HALF  # ... and its position
            row_pos = my_p0 + rows
            tile_last = p0 + 2 * HALF - 1  # the work tile's last row position (dirty tiles)
            m_i = gl.full([HALF], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))
            l_i = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_MMA))
            acc = gl.zeros([HALF, D], gl.float32, layout=O_MMA)
            mbarrier.wait(q_ready.index(WG), n_done & 1)
            n_done += 1
            if n_kv > 0:
                # ---- step 0: S_0 = Q·K_0ᵀ alone (the diagonal tile, j = j_lo + n_kv - 1)
                j = j_lo + n_kv - 1
                slot = it % STAGES
                mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                _wait_turn(turn, rnd, WG, PINGPONG)
                s_tok = warpgroup_mma(my_q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                _pass_turn(turn, WG, 2, PINGPONG)  # two consumer warpgroups
                rnd += 1
                s = warpgroup_mma_wait(0, deps=[s_tok])
                mbarrier.arrive(k_empty.index(slot), count=1)
                masked = _edge(j, my_p0, my_p0 + HALF - 1, window, BLOCK_N)
                p, _alpha0, m_i, l_i = _softmax_step(
                    s, m_i, l_i, row_pos, cols, j * BLOCK_N, qk_scale, window, masked, dtype, p_layout
                )
                dirty = _edge(j, p0, tile_last, window, BLOCK_N)
                # ---- steps 1 ..: S_i = Q·K_iᵀ and O += P_{i-1}·V_{i-1} in flight together
                for _i in range(1, n_kv):
                    prev = slot
                    it += 1
                    j -= 1
                    slot = it % STAGES
                    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                    mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
                    n_dirty = _clean_v(v_smem.index(prev), dirty, clean, n_dirty, WG, HALF, CLEAN)
                    _wait_turn(turn, rnd, WG, PINGPONG)
                    s_tok = warpgroup_mma(
                        my_q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
                    )
                    p_prev = p
                    o_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
                    _pass_turn(turn, WG, 2, PINGPONG)  # two consumer warpgroups
                    rnd += 1
                    s = warpgroup_mma_wait(1, deps=[s_tok])
                    mbarrier.arrive(k_empty.index(slot), count=1)
                    masked = _edge(j, my_p0, my_p0 + HALF - 1, window, BLOCK_N)
                    p, alpha_i, m_i, l_i = _softmax_step(
                        s, m_i, l_i, row_pos, cols, j * BLOCK_N, qk_scale, window, masked, dtype, p_layout
                    )
                    dirty = _edge(j, p0, tile_last, window, BLOCK_N)
                    # p_prev (the A operand in registers) stays live until its product retires
                    acc, _p_done = warpgroup_mma_wait(0, deps=[o_tok, p_prev])
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    acc = acc * gl.expand_dims(gl.convert_layout(alpha_i, gl.SliceLayout(1, O_MMA)), 1)
                # Q is no longer read: the producer may load the next tile's half.
                mbarrier.arrive(q_empty.index(WG), count=1)
                # ---- last: O += P·V of the last key tile
                mbarrier.wait(v_ready.index(slot), (it // STAGES) & 1)
                n_dirty = _clean_v(v_smem.index(slot), dirty, clean, n_dirty, WG, HALF, CLEAN)
                _wait_turn(turn, rnd, WG, PINGPONG)
                o_tok = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
                _pass_turn(turn, WG, 2, PINGPONG)  # two consumer warpgroups
                rnd += 1
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                mbarrier.arrive(v_empty.index(slot), count=1)
                it += 1
            else:
                mbarrier.arrive(q_empty.index(WG), count=1)

            # ---- epilogue: the sink joins the denominator; natural-log LSE; masked stores
            sink = 0.0
            if HAS_SINKS:
                sink = gl.load(sinks_ptr + head) * LOG2E
            m_use, l_fin, has, inv = softmax_epilogue(m_i, l_i, sink, HAS_SINKS)
            out = (acc * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, O_MMA)), 1)).to(dtype)
            tok = r0 + o_rows
            off = ((q_begin + tok).to(gl.int64) * HQ + head) * D
            offs = gl.expand_dims(off, 1) + gl.expand_dims(o_cols, 0)
            ok = gl.expand_dims(tok < len_q, 1) & gl.expand_dims(o_cols < D, 0)
            gl.store(o_ptr + offs, out, mask=ok)
            if HAS_LSE:
                lse = gl.where(has, (m_use + gl.log2(gl.where(has, l_fin, 1.0))) * LN2, float("-inf"))
                l_tok = r0 + rows
                gl.store(lse_ptr + (q_begin + l_tok).to(gl.int64) * HQ + head, lse, mask=l_tok < len_q)


# n_m, batch, window and the table sizes are never specialized: a value of 1 would become a
# constexpr (one more compile per such call) for no gain.
@gluon.jit(do_not_specialize=["table_stride", "max_pages", "num_pages", "window", "n_m", "batch"])
def extend_fa3_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_ptr,
    lse_ptr,
    sinks_ptr,
    cu_q_ptr,
    seqlens_ptr,
    table_ptr,
    table_stride,
    max_pages,
    num_pages,
    sm_scale,
    window,
    n_m,
    batch,
    HQ: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGE: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    S_MMA: gl.constexpr,
    O_MMA: gl.constexpr,
    KV_SMEM: gl.constexpr,
    CLEAN: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """Paged causal extend, persistent over ``n_m * batch * HQ`` work tiles.

    q_desc: TMA descriptor over q ``[total_q, HQ * D]`` (bf16/fp16), box ``[HALF, D]``;
    k_desc / v_desc: over the caches viewed ``[num_pages, HQ // G, PAGE, D]`` (any 16-byte
    multiple strides), box ``[1, 1, BOX, D]``; o ``[total_q, HQ, D]`` in q's dtype; lse
    float32 ``[total_q, HQ]`` (natural log, sink included; written when ``HAS_LSE``); sinks
    float32 ``[HQ]``; cu_q int32 ``[batch + 1]``; seqlens int32 ``[batch]`` (cache tokens
    including the chunk); table int32 ``[batch, max_pages]`` with row stride
    ``table_stride``; ``num_pages`` the caches' page count; ``window`` = ``window_left`` or
    a large value (2**30) for none; ``n_m = cdiv(max_seqlen_q, 2 * HALF)``. ``KV_SMEM``: the
    NVMMA layout of a ``[BLOCK_N, D]`` ring slot; ``CLEAN``: a 4-warp blocked layout of a
    ``[HALF, D]`` half tile. Launch with ``num_warps=4`` and at most one program per SM.
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], KV_SMEM)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    clean = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    mbarrier.init(clean.index(0), count=2)  # one arrival per consumer warpgroup
    for st in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(st), count=1)
        mbarrier.init(v_ready.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=2)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(st), count=2)
    fence_async_shared()  # the barrier inits visible to the TMA unit (async proxy)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, clean.index(0))
    total = n_m * batch * HQ
    gl.warp_specialize(
        [
            (
                _consumer,
                (q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, seqlens_ptr, sm_scale, window,
                 n_m, batch, total, 0, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, CLEAN,
                 PINGPONG),
            ),
            (
                _consumer,
                (q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, seqlens_ptr, sm_scale, window,
                 n_m, batch, total, 1, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, CLEAN,
                 PINGPONG),
            ),
            (
                _producer,
                (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, seqlens_ptr, table_ptr,
                 table_stride, max_pages, num_pages, window, n_m, batch, total, HQ, G, D, HALF, BLOCK_N, PAGE, BOX,
                 STAGES),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip
