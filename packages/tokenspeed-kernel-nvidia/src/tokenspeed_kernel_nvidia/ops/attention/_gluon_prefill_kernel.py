"""Gluon (Triton's explicit-layout dialect) sliding-window causal prefill for Hopper: the kernel.

Grid ``(q_tiles, Hkv, batch)``. A program owns ``BLOCK_T`` consecutive query tokens of one
sequence and the whole GQA group of one KV head: ``BLOCK_M = BLOCK_T * G_PAD = 128`` MMA rows,
row ``r`` = token ``r // G_PAD``, query head ``kv_head * G + r % G_PAD`` (heads past ``G`` are
zero padding, never stored). So each K/V tile it loads serves every query head of the group.

Band visiting: the tile's queries sit at positions ``p0 .. p1`` (bottom-right aligned), so the
only keys any row can see are ``[lo, hi) = [max(p0 - W, 0), min(p1 + 1, Lk))`` (``W`` =
``window_left``). The kernel walks exactly ``cdiv(hi - lo, BLOCK_N)`` key tiles starting at
``lo`` — cost follows the window, never the context. A tile is masked only when some row
could see less than all of it (``start < p1 - W`` at the window's left edge, or
``start + BLOCK_N - 1 > p0`` across the diagonal); the middle tiles skip the mask arithmetic.

Data movement: K/V tiles ``[BLOCK_N, D]`` arrive by TMA (``cp.async.bulk.tensor``) from a
2-D view ``[total_k, Hkv * D]`` of the ragged K/V (row = key token, columns ``kv_head * D ..``)
into a ``STAGES``-deep ring of NVMMA-swizzled shared buffers, one ``mbarrier`` per buffer and
operand (K and V separately, so ``q·kᵀ`` starts while V is still in flight). Tiles running
past the key tensor are zero-filled by the TMA unit; keys of a neighbouring sequence are
excluded by the mask. Q is loaded once with 16-byte vector loads (through its row stride
``Q_ROW``, so a row-strided q is read in place), staged in NVMMA shared
memory, and both products run on ``wgmma``: ``S = Q·Kᵀ`` (A and B from shared memory,
``[128, D] x [D, BLOCK_N]``) and ``O += P·V`` (P from registers in the wgmma A-operand
layout, V from shared memory). Online softmax in base 2 with fp32 statistics; the sink joins
the denominator once in the epilogue.

The persistent build (:func:`prefill_window_persistent_kernel`, opt-in) runs the same tiles
with the same per-tile helpers on a grid of resident programs, each walking the tiled grid's
programs as work items with its K/V ring running across them and the next item's Q tile
double-buffered.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row, col):
    """Start the TMA copies of one K and one V tile (``[BLOCK_N, D]`` at ``[row, col]``)."""
    mbarrier.expect(k_bar, k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], k_bar, k_smem)
    mbarrier.expect(v_bar, v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], v_bar, v_smem)


@gluon.jit
def _refill(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, slot, nxt, num_tiles, row0, col):
    """Start key tile ``nxt``'s copies into ring ``slot`` (tile ``i`` of the band starts at row
    ``row0 + i * BLOCK_N``), unless the band has no such tile."""
    if nxt < num_tiles:
        block_n: gl.constexpr = k_desc.block_type.shape[0]
        _issue_kv(
            k_desc,
            v_desc,
            k_smem.index(slot),
            v_smem.index(slot),
            k_bars.index(slot),
            v_bars.index(slot),
            row0 + nxt * block_n,
            col,
        )


@gluon.jit
def softmax_epilogue(m_i, l_i, sink, HAS_SINKS: gl.constexpr):
    """Close an online softmax (running max ``m_i`` and sum ``l_i`` of ``exp2(s - m)``, base 2,
    fp32 per row): the sink logit ``sink`` (base-2 units, a row tensor or scalar; ignored
    without ``HAS_SINKS``) joins the denominator once. Returns ``(m_use, l_fin, has, inv)``:
    the finite max, the final sum, whether the row has any weight, and the factor that turns
    the accumulator into the output (0 for a row that saw nothing and has no sink);
    ``lse = (m_use + log2(l_fin)) * ln 2`` where ``has``."""
    if HAS_SINKS:
        m_fin = gl.maximum(m_i, sink)
        m_use = gl.where(m_fin == float("-inf"), 0.0, m_fin)
        scale_old = gl.exp2(m_i - m_use)
        l_fin = l_i * scale_old + gl.exp2(sink - m_use)
    else:
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        scale_old = 1.0
        l_fin = l_i
    has = l_fin > 0.0
    inv = gl.where(has, scale_old / gl.where(has, l_fin, 1.0), 0.0)
    return m_use, l_fin, has, inv


@gluon.jit
def _tile_softmax(
    s, m_i, l_i, acc, start, p0, p1, window_left, row_pos, s_cols, sm_scale, logit_cap, qk_scale,
    HAS_CAP: gl.constexpr, BLOCK_N: gl.constexpr, O_MMA: gl.constexpr,
):  # fmt: skip
    """One key tile's online-softmax step on its raw scores ``s [BLOCK_M, BLOCK_N]`` (fp32, the
    ``S`` wgmma layout) at key position ``start``: cap or scale into base-2 units, the band mask
    on boundary tiles only, the running max/sum update and the accumulator's rescale. Returns
    ``(p, m_i, l_i, acc, edge)``: ``p = exp2(s - m)`` (fp32), the new statistics, ``acc``
    rescaled, and whether the tile was a boundary tile (its V must be cleaned)."""
    if HAS_CAP:
        x = s * (sm_scale / logit_cap)
        e2 = gl.exp2(x * (2.0 * LOG2E))
        s = logit_cap * (1.0 - 2.0 / (e2 + 1.0)) * LOG2E  # cap * tanh(x), in log2 units
    else:
        s = s * qk_scale
    # Boundary tiles only: keep key j for row position p iff 0 <= p - j <= window_left
    # (one unsigned compare covers the causal and the window bound).
    edge = (start < p1 - window_left) | (start + BLOCK_N - 1 > p0)
    if edge:
        dist = gl.expand_dims(row_pos - start, 1) - gl.expand_dims(s_cols, 0)
        s = gl.where(dist.to(gl.uint32, bitcast=True) <= window_left.to(gl.uint32), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing in a tile
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, O_MMA)), 1)
    return p, m_new, l_i, acc, edge


@gluon.jit
def _clean_v(v_buf, edge, IO: gl.constexpr):
    """A boundary tile holds keys some row cannot see (causally later, before its window, the
    next sequence's): their p is 0, but 0 * NaN is NaN in the product. Masking is by
    selection: non-finite V values are zeroed in shared memory first (a NaN/inf a row can see
    is then unspecified, as docs/api.md allows). Middle tiles are seen by every row and are
    not touched."""
    if edge:
        v_reg = v_buf.load(IO)
        v_reg = gl.where(gl.abs(v_reg) < float("inf"), v_reg, gl.zeros_like(v_reg))
        v_buf.store(v_reg)
        fence_async_shared()  # the generic-proxy stores visible to wgmma (async proxy)
        gl.thread_barrier()


@gluon.jit
def _tile_pv(
    s, m_i, l_i, acc, start, slot, phase, p0, p1, window_left, row_pos, s_cols, sm_scale, logit_cap, qk_scale,
    v_smem, v_bars, HAS_CAP: gl.constexpr, BLOCK_N: gl.constexpr, IO: gl.constexpr, O_MMA: gl.constexpr,
):  # fmt: skip
    """A key tile's work after its scores ``s``, written once for every loop: the online-softmax
    step (:func:`_tile_softmax`, the tile at key position ``start``), the wait for its V tile
    in ring ``slot`` (barrier ``phase``), the cleaning of a boundary tile's V
    (:func:`_clean_v`) and the asynchronous ``O += P·V`` (P from registers in the wgmma
    A-operand layout). Returns ``(acc_tok, m_i, l_i)``: the product in flight (the caller
    waits on it with its own dependencies) and the new statistics."""
    p, m_i, l_i, acc, edge = _tile_softmax(
        s, m_i, l_i, acc, start, p0, p1, window_left, row_pos, s_cols, sm_scale, logit_cap, qk_scale,
        HAS_CAP, BLOCK_N, O_MMA,
    )  # fmt: skip
    mbarrier.wait(v_bars.index(slot), phase)
    _clean_v(v_smem.index(slot), edge, IO)
    p_op = gl.convert_layout(p.to(v_smem.dtype), gl.DotOperandLayout(operand_index=0, parent=O_MMA, k_width=2))
    acc_tok = warpgroup_mma(p_op, v_smem.index(slot), acc, is_async=True)
    return acc_tok, m_i, l_i


@gluon.jit
def _band(len_q, len_k, t0, window_left, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr):
    """The band of query tokens ``t0 .. t0 + BLOCK_T`` of a sequence (``t0 < len_q``): the
    positions ``p0 .. p1`` of its first and last real query (bottom-right aligned), the first
    key ``lo`` any of them sees and the count of ``BLOCK_N``-key tiles from ``lo`` to the last
    key ``p1`` sees."""
    p0 = len_k - len_q + t0
    p1 = p0 + gl.minimum(BLOCK_T, len_q - t0) - 1
    lo = gl.maximum(p0 - window_left, 0)
    hi = gl.minimum(p1 + 1, len_k)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)
    return p0, p1, lo, num_tiles


@gluon.jit
def _q_rows(
    q_begin, t0, len_q, kv_head, HQ: gl.constexpr, G: gl.constexpr, G_PAD: gl.constexpr, D: gl.constexpr,
    BLOCK_M: gl.constexpr, IO: gl.constexpr, Q_ROW: gl.constexpr,
):  # fmt: skip
    """The ``[BLOCK_M, D]`` rows (token ``t0 + r // G_PAD``, query head ``kv_head * G + r %
    G_PAD``) of a tile in the ``IO`` layout: ``(io_ok, io_off, io_offs, io_mask, q_offs)`` =
    which rows are real (a token of the sequence, a head of the group), each row's element
    offset in o (q's rows are o's when ``Q_ROW == HQ * D``), the ``[BLOCK_M, D]`` offsets in o
    and their mask, and the offsets in q (through its row stride ``Q_ROW``)."""
    io_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, IO))
    io_cols = gl.arange(0, D, layout=gl.SliceLayout(0, IO))
    io_tok = t0 + io_rows // G_PAD
    io_g = io_rows % G_PAD
    io_ok = (io_tok < len_q) & (io_g < G)
    io_off = ((q_begin + io_tok).to(gl.int64) * HQ + kv_head * G + io_g) * D
    io_offs = gl.expand_dims(io_off, 1) + gl.expand_dims(io_cols, 0)
    io_mask = gl.expand_dims(io_ok, 1) & gl.expand_dims(io_cols < D, 0)
    if Q_ROW == HQ * D:
        q_offs = io_offs  # q's rows are out's
    else:  # a row-strided q: token t's row starts t * Q_ROW elements in
        q_off = (q_begin + io_tok).to(gl.int64) * Q_ROW + (kv_head * G + io_g) * D
        q_offs = gl.expand_dims(q_off, 1) + gl.expand_dims(io_cols, 0)
    return io_ok, io_off, io_offs, io_mask, q_offs


@gluon.jit
def _finish(
    acc, m_i, l_i, s_rows, kv_head, sinks_ptr, o_ptr, lse_ptr, io_ok, io_off, io_offs, io_mask, stage,
    G: gl.constexpr, G_PAD: gl.constexpr, D: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_LSE: gl.constexpr,
    IO: gl.constexpr, O_MMA: gl.constexpr, STAGED: gl.constexpr,
):  # fmt: skip
    """A tile's epilogue: the sink joins the denominator (:func:`softmax_epilogue`), the
    accumulator becomes the output, stored to the real rows of o (``io_offs`` / ``io_mask``
    of :func:`_q_rows`) with the natural-log LSE when ``HAS_LSE``. The output changes layout
    (wgmma accumulator -> ``IO``'s 16-byte rows) through shared memory: the compiler's scratch,
    or with ``STAGED`` the ``[BLOCK_M, D]`` buffer ``stage`` (the tile's own Q buffer, done
    with; the persistent build, whose ring and Q buffers stay allocated, needs no scratch)."""
    sink = 0.0
    if HAS_SINKS:
        head = kv_head * G + gl.minimum(s_rows % G_PAD, G - 1)
        sink = gl.load(sinks_ptr + head) * LOG2E
    m_use, l_fin, has, inv = softmax_epilogue(m_i, l_i, sink, HAS_SINKS)
    out = acc * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, O_MMA)), 1)
    if STAGED:
        gl.thread_barrier()  # every warp's Q·Kᵀ is done with the buffer
        stage.store(out.to(o_ptr.dtype.element_ty))
        gl.thread_barrier()
        out = stage.load(IO)
    else:
        out = gl.convert_layout(out.to(o_ptr.dtype.element_ty), IO)
    gl.store(o_ptr + io_offs, out, mask=io_mask)
    if HAS_LSE:
        lse = gl.where(has, (m_use + gl.log2(gl.where(has, l_fin, 1.0))) * LN2, float("-inf"))
        lse = gl.convert_layout(lse, gl.SliceLayout(1, IO))
        gl.store(lse_ptr + io_off // D, lse, mask=io_ok)


@gluon.jit
def _kv_ring(k_desc, STAGES: gl.constexpr):
    """The K/V ring: ``STAGES`` K and V buffers of one TMA box (``[BLOCK_N, D]``, the
    descriptor's NVMMA layout) and one initialized ``mbarrier`` per buffer and operand."""
    dtype: gl.constexpr = k_desc.dtype
    box: gl.constexpr = k_desc.block_type.shape
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, box[0], box[1]], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, box[0], box[1]], k_desc.layout)
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(st), count=1)
        mbarrier.init(v_bars.index(st), count=1)
    fence_async_shared()  # barrier inits visible to the TMA unit
    return k_smem, v_smem, k_bars, v_bars


@gluon.jit
def _scores(q_smem, k_smem, k_bars, slot, phase, s_zero):
    """``S = Q·Kᵀ`` of the K tile in ring ``slot`` (barrier ``phase``), waited: fp32 in
    ``s_zero``'s layout."""
    mbarrier.wait(k_bars.index(slot), phase)
    s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(0, deps=[s_tok, q_smem, k_smem.index(slot)])
    return s


# window_left is never specialized: the JIT would turn window_left=1 into a constexpr (and
# compile one kernel per such value); the mask needs it as a runtime i32.
@gluon.jit(do_not_specialize=["window_left"])
def prefill_window_kernel(
    q_ptr,
    o_ptr,
    lse_ptr,
    sinks_ptr,
    k_desc,
    v_desc,
    cu_q_ptr,
    cu_k_ptr,
    sm_scale,
    logit_cap,
    window_left,
    HQ: gl.constexpr,
    HKV: gl.constexpr,
    G: gl.constexpr,
    G_PAD: gl.constexpr,
    D: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    QK_AHEAD: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_CAP: gl.constexpr,
    HAS_LSE: gl.constexpr,
    IO: gl.constexpr,
    Q_SMEM: gl.constexpr,
    S_MMA: gl.constexpr,
    O_MMA: gl.constexpr,
    Q_ROW: gl.constexpr,
):
    """Sliding-window causal attention of ``BLOCK_T`` tokens x one GQA group.

    q / o: ``[total_q, HQ, D]`` bf16/fp16; o contiguous, q's rows of ``HQ * D`` values
    contiguous, ``Q_ROW`` elements from one token's row to the next (``HQ * D``: contiguous,
    the build of every contiguous q; more: a row-strided q, ``strided_q``); lse float32 ``[total_q, HQ]``
    (natural log, sink included; written when ``HAS_LSE``); sinks float32 ``[HQ]``;
    k_desc / v_desc: TMA descriptors over ``[total_k, HKV * D]`` views of k / v with block
    ``[BLOCK_N, D]``; cu_q / cu_k int32 ``[batch + 1]``. ``window_left >= 0``. ``QK_AHEAD``:
    tile ``i + 1``'s ``Q·Kᵀ`` is issued before tile ``i``'s softmax (and waited with its P·V).
    """
    BLOCK_M: gl.constexpr = BLOCK_T * G_PAD
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    tile = gl.program_id(0)
    kv_head = gl.program_id(1)
    b = gl.program_id(2)

    q_begin = gl.load(cu_q_ptr + b)
    len_q = gl.load(cu_q_ptr + b + 1) - q_begin
    t0 = tile * BLOCK_T
    if t0 >= len_q:
        return
    k_begin = gl.load(cu_k_ptr + b)
    len_k = gl.load(cu_k_ptr + b + 1) - k_begin

    # Positions of the tile's first and last real query, and the band of keys they see.
    p0, p1, lo, num_tiles = _band(len_q, len_k, t0, window_left, BLOCK_T, BLOCK_N)

    # ---- K/V ring and its barriers; the prologue starts up to STAGES tile copies first.
    k_smem, v_smem, k_bars, v_bars = _kv_ring(k_desc, STAGES)
    col = kv_head * D
    for st in gl.static_range(STAGES):
        if st < num_tiles:
            _issue_kv(
                k_desc,
                v_desc,
                k_smem.index(st),
                v_smem.index(st),
                k_bars.index(st),
                v_bars.index(st),
                k_begin + lo + st * BLOCK_N,
                col,
            )

    # ---- Q: [BLOCK_M, D] rows (token, head) -> NVMMA shared, once, while the first K/V
    # tiles are in flight.
    io_ok, io_off, io_offs, io_mask, q_offs = _q_rows(q_begin, t0, len_q, kv_head, HQ, G, G_PAD, D, BLOCK_M, IO, Q_ROW)
    q = gl.load(q_ptr + q_offs, mask=io_mask, other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], Q_SMEM, q)
    fence_async_shared()  # the Q tile visible to wgmma (async proxy)

    # ---- Main loop over the band.
    s_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_MMA))
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))
    row_pos = p0 + s_rows // G_PAD  # absolute position of each row's query
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_MMA))
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_MMA)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_MMA)
    qk_scale = sm_scale * LOG2E

    if QK_AHEAD:
        # Tile 0's scores first; then each step issues the next tile's Q·Kᵀ before this
        # tile's softmax, and one wait resolves both it and this tile's P·V.
        if num_tiles > 0:
            s = _scores(q_smem, k_smem, k_bars, 0, 0, s_zero)
            for i in range(num_tiles - 1):
                slot = i % STAGES
                nslot = (i + 1) % STAGES
                mbarrier.wait(k_bars.index(nslot), ((i + 1) // STAGES) & 1)
                n_tok = warpgroup_mma(q_smem, k_smem.index(nslot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                acc_tok, m_i, l_i = _tile_pv(
                    s, m_i, l_i, acc, lo + i * BLOCK_N, slot, (i // STAGES) & 1, p0, p1, window_left, row_pos, s_cols,
                    sm_scale, logit_cap, qk_scale, v_smem, v_bars, HAS_CAP, BLOCK_N, IO, O_MMA,
                )  # fmt: skip
                acc, s, _, _ = warpgroup_mma_wait(0, deps=[acc_tok, n_tok, v_smem.index(slot), k_smem.index(nslot)])
                gl.thread_barrier()  # every warp is done with this slot: refill it
                _refill(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, slot, i + STAGES, num_tiles, k_begin + lo, col)
            last = num_tiles - 1
            slot = last % STAGES
            acc_tok, m_i, l_i = _tile_pv(
                s, m_i, l_i, acc, lo + last * BLOCK_N, slot, (last // STAGES) & 1, p0, p1, window_left, row_pos,
                s_cols, sm_scale, logit_cap, qk_scale, v_smem, v_bars, HAS_CAP, BLOCK_N, IO, O_MMA,
            )  # fmt: skip
            acc, _ = warpgroup_mma_wait(0, deps=[acc_tok, v_smem.index(slot)])
    else:
        for i in range(num_tiles):
            slot = i % STAGES
            phase = (i // STAGES) & 1
            s = _scores(q_smem, k_smem, k_bars, slot, phase, s_zero)
            acc_tok, m_i, l_i = _tile_pv(
                s, m_i, l_i, acc, lo + i * BLOCK_N, slot, phase, p0, p1, window_left, row_pos, s_cols, sm_scale,
                logit_cap, qk_scale, v_smem, v_bars, HAS_CAP, BLOCK_N, IO, O_MMA,
            )  # fmt: skip
            acc, _ = warpgroup_mma_wait(0, deps=[acc_tok, v_smem.index(slot)])

            # Every warp is done with this slot: refill it with the tile STAGES ahead.
            gl.thread_barrier()
            _refill(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, slot, i + STAGES, num_tiles, k_begin + lo, col)

    for st in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(st))
        mbarrier.invalidate(v_bars.index(st))

    # ---- Epilogue: the sink joins the denominator; natural-log LSE; store the group's rows.
    _finish(
        acc, m_i, l_i, s_rows, kv_head, sinks_ptr, o_ptr, lse_ptr, io_ok, io_off, io_offs, io_mask, q_smem,
        G, G_PAD, D, HAS_SINKS, HAS_LSE, IO, O_MMA, False,
    )  # fmt: skip


# ---- The persistent build: one program per resident slot walks work items.


@gluon.jit
def _item_band(
    item, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left,
    HKV: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Work item ``item`` of the persistent build, in the order of the tiled build's grid
    (query tile fastest, then KV head, then sequence: neighbouring items share most of their
    key band). Returns ``(live, kv_head, q_begin, len_q, t0, k_begin, p0, p1, lo, n)``:
    whether the item holds a query token (an item past ``num_items`` or past its sequence's
    length does not), its KV head, its sequence's first query row and length, its first
    token, the sequence's first key row, the band (:func:`_band`) and its key tile count
    (0 for an item that is not live)."""
    it = gl.minimum(item, num_items - 1)  # an item past the end reads the last one's tables
    tile = it % q_tiles
    rest = it // q_tiles
    kv_head = rest % HKV
    b = rest // HKV
    q_begin = gl.load(cu_q_ptr + b)
    len_q = gl.load(cu_q_ptr + b + 1) - q_begin
    k_begin = gl.load(cu_k_ptr + b)
    len_k = gl.load(cu_k_ptr + b + 1) - k_begin
    t0 = tile * BLOCK_T
    live = (item < num_items) & (t0 < len_q)
    p0, p1, lo, num_tiles = _band(len_q, len_k, t0, window_left, BLOCK_T, BLOCK_N)
    n = gl.where(live, num_tiles, 0)
    return live, kv_head, q_begin, len_q, t0, k_begin, p0, p1, lo, n


@gluon.jit
def _produce(
    k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, slot, item, tile, n, row0, col, step, num_items, q_tiles,
    cu_q_ptr, cu_k_ptr, window_left, HKV: gl.constexpr, BLOCK_T: gl.constexpr, D: gl.constexpr,
):  # fmt: skip
    """The producer of the persistent ring: start the copies of the next key tile of the
    program's stream (every key tile of its items, in order) into ring ``slot``. The cursor
    ``(item, tile, n, row0, col)``: the item being produced, its next tile, its tile count,
    its band's first key row and its K/V column; past its last tile the cursor moves on by
    ``step`` items to the next item with a tile (the next item's tiles start while the
    program still works on this one). Returns the advanced cursor; nothing is issued once the
    program's items are exhausted."""
    block_n: gl.constexpr = k_desc.block_type.shape[0]
    while (tile >= n) & (item < num_items):
        item += step
        _live, kv_head, _qb, _lq, _t0, k_begin, _p0, _p1, lo, n = _item_band(
            item, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left, HKV, BLOCK_T, block_n
        )
        tile = 0
        row0 = k_begin + lo
        col = kv_head * D
    if tile < n:
        _issue_kv(
            k_desc,
            v_desc,
            k_smem.index(slot),
            v_smem.index(slot),
            k_bars.index(slot),
            v_bars.index(slot),
            row0 + tile * block_n,
            col,
        )
        tile += 1
    return item, tile, n, row0, col


@gluon.jit
def _prefetch_q(
    q_ptr, q_dst, item, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left, HQ: gl.constexpr, HKV: gl.constexpr,
    G: gl.constexpr, G_PAD: gl.constexpr, D: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_N: gl.constexpr,
    IO: gl.constexpr, Q_ROW: gl.constexpr,
):  # fmt: skip
    """Start the copy of work item ``item``'s Q tile ``[BLOCK_T * G_PAD, D]`` into ``q_dst``
    (``cp.async``, 16-byte vectors; rows that are no query of the item are zero-filled, all of
    them for an item that is not live) and commit it as one async group."""
    live, kv_head, q_begin, len_q, t0, _kb, _p0, _p1, _lo, _n = _item_band(
        item, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left, HKV, BLOCK_T, BLOCK_N
    )
    _ok, _off, _offs, io_mask, q_offs = _q_rows(
        q_begin, t0, len_q, kv_head, HQ, G, G_PAD, D, BLOCK_T * G_PAD, IO, Q_ROW
    )
    async_copy.async_copy_global_to_shared(q_dst, q_ptr + q_offs, mask=io_mask & live)
    async_copy.commit_group()


@gluon.jit(do_not_specialize=["window_left", "q_tiles", "num_items"])
def prefill_window_persistent_kernel(
    q_ptr,
    o_ptr,
    lse_ptr,
    sinks_ptr,
    k_desc,
    v_desc,
    cu_q_ptr,
    cu_k_ptr,
    sm_scale,
    logit_cap,
    window_left,
    q_tiles,
    num_items,
    HQ: gl.constexpr,
    HKV: gl.constexpr,
    G: gl.constexpr,
    G_PAD: gl.constexpr,
    D: gl.constexpr,
    BLOCK_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_CAP: gl.constexpr,
    HAS_LSE: gl.constexpr,
    IO: gl.constexpr,
    Q_SMEM: gl.constexpr,
    S_MMA: gl.constexpr,
    O_MMA: gl.constexpr,
    Q_ROW: gl.constexpr,
):
    """:func:`prefill_window_kernel`'s attention (the same tensors, band, masks, softmax and
    epilogue per ``BLOCK_T`` tokens x one GQA group) on a persistent grid ``(programs,)``:
    program ``p`` works items ``p, p + programs, ...`` of the ``num_items = q_tiles * HKV *
    batch`` items (:func:`_item_band`; ``q_tiles`` = query tiles of the longest sequence).

    The K/V ring runs across items: the producer (:func:`_produce`) keeps ``STAGES`` key
    tiles of the program's stream in flight, so the first tiles of item ``i + 1`` load while
    item ``i`` finishes; the ring's barrier phases follow the stream's tile count ``g``. Q is
    double-buffered: item ``i + 1``'s Q tile is copied (``cp.async``) while item ``i`` runs.
    """
    BLOCK_M: gl.constexpr = BLOCK_T * G_PAD
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    pid = gl.program_id(0)
    step = gl.num_programs(0)

    k_smem, v_smem, k_bars, v_bars = _kv_ring(k_desc, STAGES)
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], Q_SMEM)

    # ---- The producer's cursor before the program's first item; the first STAGES tiles.
    p_item = pid - step
    p_tile = 0
    p_n = 0
    p_row0 = 0
    p_col = 0
    for st in gl.static_range(STAGES):
        p_item, p_tile, p_n, p_row0, p_col = _produce(
            k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, st, p_item, p_tile, p_n, p_row0, p_col, step,
            num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left, HKV, BLOCK_T, D,
        )  # fmt: skip
    _prefetch_q(
        q_ptr, q_smem.index(0), pid, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left,
        HQ, HKV, G, G_PAD, D, BLOCK_T, BLOCK_N, IO, Q_ROW,
    )  # fmt: skip

    s_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_MMA))
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_MMA))
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_MMA)
    qk_scale = sm_scale * LOG2E
    g = 0  # key tiles of the stream consumed so far
    buf = 0  # this item's Q buffer
    for item in range(pid, num_items, step):
        live, kv_head, q_begin, len_q, t0, _kb, p0, p1, lo, n = _item_band(
            item, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left, HKV, BLOCK_T, BLOCK_N
        )
        # Every warp is done with the other Q buffer (the last item's): item + step's Q goes
        # there; then this item's Q (committed one group earlier) has landed.
        gl.thread_barrier()
        _prefetch_q(
            q_ptr, q_smem.index(1 - buf), item + step, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left,
            HQ, HKV, G, G_PAD, D, BLOCK_T, BLOCK_N, IO, Q_ROW,
        )  # fmt: skip
        async_copy.wait_group(1)
        fence_async_shared()  # the cp.async writes (generic proxy) visible to wgmma
        gl.thread_barrier()
        if live:
            q_cur = q_smem.index(buf)
            row_pos = p0 + s_rows // G_PAD
            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_MMA))
            acc = gl.zeros([BLOCK_M, D], gl.float32, layout=O_MMA)
            for j in range(n):
                slot = g % STAGES
                s = _scores(q_cur, k_smem, k_bars, slot, (g // STAGES) & 1, s_zero)
                acc_tok, m_i, l_i = _tile_pv(
                    s, m_i, l_i, acc, lo + j * BLOCK_N, slot, (g // STAGES) & 1, p0, p1, window_left, row_pos,
                    s_cols, sm_scale, logit_cap, qk_scale, v_smem, v_bars, HAS_CAP, BLOCK_N, IO, O_MMA,
                )  # fmt: skip
                acc, _ = warpgroup_mma_wait(0, deps=[acc_tok, v_smem.index(slot)])
                # Every warp is done with this slot: refill it with the stream's tile STAGES on.
                gl.thread_barrier()
                p_item, p_tile, p_n, p_row0, p_col = _produce(
                    k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, slot, p_item, p_tile, p_n, p_row0, p_col,
                    step, num_items, q_tiles, cu_q_ptr, cu_k_ptr, window_left, HKV, BLOCK_T, D,
                )  # fmt: skip
                g += 1
            io_ok, io_off, io_offs, io_mask, _q_offs = _q_rows(
                q_begin, t0, len_q, kv_head, HQ, G, G_PAD, D, BLOCK_M, IO, Q_ROW
            )
            _finish(
                acc, m_i, l_i, s_rows, kv_head, sinks_ptr, o_ptr, lse_ptr, io_ok, io_off, io_offs, io_mask, q_cur,
                G, G_PAD, D, HAS_SINKS, HAS_LSE, IO, O_MMA, True,
            )  # fmt: skip
        buf = 1 - buf

    async_copy.wait_group(0)  # the last (empty) prefetch
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(st))
        mbarrier.invalidate(v_bars.index(st))
