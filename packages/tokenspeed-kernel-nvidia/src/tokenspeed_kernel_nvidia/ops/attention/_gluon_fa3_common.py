"""The FlashAttention-3-style Hopper attention pipeline that the dense causal prefill
(:mod:`._gluon_prefill_fa3_kernel`, ``gluon_prefill_fa3_sm90``) and the paged extend
(:mod:`._gluon_extend_fa3_kernel`, ``gluon_extend_fa3_sm90``) share: the work-tile order,
the shared buffers and barriers, the one-warp TMA producer and the consumer warpgroups with
their online softmax, intra-warpgroup overlap and ping-pong. A fix to the softmax, the
ping-pong or the overlap protocol lands here once, for both kernels.

What the two kernels differ in is a constexpr ``PAGED`` (off: dense ``[total_k, Hkv * D]``
K/V read as one 2-D TMA box per key tile, keys bottom-right aligned to ``cu_seqlens_k``;
on: the paged cache read one 4-D box per page with the page ids one tile ahead, keys at the
positions of the cache (prefix included) with an optional window, key tiles aligned to
``BLOCK_N`` within the band). The dense kernel's constexpr ``WINDOW`` (its sliding-window
build) takes the paged path's key band, window mask and tile walk while keeping the dense
K/V reads. Everything else is one code path; the variants (``EXP2_POLY``,
``RESCALE_THRESHOLD``, ``PV_OVERLAP``: see ``Fa3Config``) apply to both.

Unseen values never leak (docs/api.md), in every build: scores are masked by selection, and
on a dirty key tile (one holding a key that some row of the work tile may not see: past the
first row's diagonal, which takes every key past the sequence (stale cache slots, or the
dense view's next sequence), or before the last row's window edge) the consumer warpgroups
zero the non-finite values of the V tile in shared memory before ``P·V``, each its share of
the rows (:func:`_clean_v`), and meet on the ``clean`` barrier (a masked P is 0, but 0 x NaN
is NaN inside ``wgmma``). Every warpgroup takes the dirty tiles from the work tile's first
row (and last, for the window), never its own rows, so they agree on the barrier's phase.
The dense kernel's ``CLEAN`` None (``Fa3Config.clean_v`` off) leaves the cleaning out: the
build before the cleaning, byte for byte, as ``ci/device/fa3_sweep.py --clean-ab``'s timing
reference only.

Folded so that the shipped kernels' SASS stayed byte-identical (every configuration of
both AOT grids). What stays in the kernel modules, or inline here, does so because ptxas
schedules by PTX basic blocks and every inlined ``@gluon.jit`` call opens a debug-info scope
whose start gets a PTX label, which ptxas treats as a block boundary: a helper for the
shared buffers and barriers (the kernels' prologue), for the dense producer's copies, around
the softmax call, or ``_exp2`` on the extend's default path each moved instructions in some
configurations (same arithmetic, another schedule). The same effect is what ``PV_OVERLAP``
uses on purpose.

The runtime arguments travel as tuples (one per partition, flattened by
``gl.warp_specialize`` in their order); arguments a kernel does not have are constexpr
placeholders (0 or None), which add no captures.
"""

from __future__ import annotations

import struct

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_kernel import LN2, LOG2E, softmax_epilogue
from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill_fa3 import EXP2_FLOOR, EXP2_PACK, EXP2_POLY


def _f32_hex(x: float) -> str:
    """A float32 immediate in PTX syntax (``0f`` + the 8 hex digits of its bits)."""
    return f"0f{struct.unpack('<I', struct.pack('<f', x))[0]:08X}"


def _exp2_asm_text(n_poly: int) -> str:
    """PTX for :data:`EXP2_PACK` exponentials (outputs ``$0..``, inputs after them): the
    first ``n_poly`` on the FMA pipe (clamp, round by the shifter, Horner, exponent add:
    :func:`gluon_prefill_fa3.exp2_fma_reference` models it), the rest on MUFU.EX2."""
    shifter, floor = _f32_hex(12582912.0), _f32_hex(EXP2_FLOOR)
    c0, c1, c2, c3 = (_f32_hex(c) for c in EXP2_POLY)
    lines = ["{", ".reg .f32 x, t, f, p;", ".reg .b32 tb, pb;"]
    for i in range(EXP2_PACK):
        out, arg = f"${i}", f"${i + EXP2_PACK}"
        if i >= n_poly:
            lines.append(f"ex2.approx.ftz.f32 {out}, {arg};")
            continue
        lines += [
            f"max.ftz.f32 x, {arg}, {floor};",
            f"add.rn.ftz.f32 t, x, {shifter};",
            f"sub.rn.ftz.f32 f, t, {shifter};",
            "sub.rn.ftz.f32 f, x, f;",
            f"fma.rn.ftz.f32 p, f, {c3}, {c2};",
            f"fma.rn.ftz.f32 p, p, f, {c1};",
            f"fma.rn.ftz.f32 p, p, f, {c0};",
            "mov.b32 tb, t;",
            "mov.b32 pb, p;",
            "shl.b32 tb, tb, 23;",
            "add.s32 pb, pb, tb;",
            f"mov.b32 {out}, pb;",
        ]
    return "\n".join([*lines, "}"])


# The inline-asm text of each split (index: exponentials on FMA out of EXP2_PACK).
_EXP2_ASM = tuple(gl.constexpr(_exp2_asm_text(n)) for n in range(EXP2_PACK + 1))


@gluon.constexpr_function
def _exp2_asm(n_poly):
    return _EXP2_ASM[int(n_poly)]


_EXP2_PACK = gl.constexpr(EXP2_PACK)
_EXP2_CONSTRAINTS = gl.constexpr(",".join(["=f"] * EXP2_PACK + ["f"] * EXP2_PACK))


@gluon.jit
def _exp2(x, EXP2_POLY: gl.constexpr):
    """``exp2(x)`` of a float32 tensor: MUFU.EX2 for all (``EXP2_POLY == 0``) or, of every
    :data:`EXP2_PACK` values a thread holds, ``EXP2_POLY`` on the FMA pipe."""
    if EXP2_POLY == 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(
            _exp2_asm(EXP2_POLY), _EXP2_CONSTRAINTS, [x], dtype=gl.float32, is_pure=True, pack=_EXP2_PACK
        )


@gluon.jit
def _tile_at(i, tiles_ptr, TILE_LIST: gl.constexpr):
    """The ``i``-th work tile of a program's walk: ``i`` itself, or with ``TILE_LIST`` the
    ``i``-th entry of the list a pre-pass wrote (``tiles_ptr[1 + i]``: the work tiles that
    hold queries, in the same heaviest-first order; :mod:`._tile_list`)."""
    if TILE_LIST:
        t = gl.load(tiles_ptr + 1 + i)
    else:
        t = i
    return t


@gluon.jit
def _tile(
    t,
    n_m,
    batch,
    cu_q_ptr,
    k_ptr,
    window,
    HQ: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    PAGED: gl.constexpr,
    WINDOW: gl.constexpr,
):
    """Work tile ``t`` of the heaviest-first order: query block ``n_m - 1 - t // (batch * HQ)``
    (the last blocks of the sequences, which see the most keys, come first), then sequence,
    then query head (the heads of one KV head adjacent). Returns ``(valid, b, head, q_begin,
    k_begin, m0, len_q, len_k, p0, j_lo, n_kv)``: ``m0`` the tile's first token, ``p0`` its
    position, key tiles ``j_lo .. j_lo + n_kv - 1`` (those its last real row sees).

    Dense (``k_ptr`` = cu_seqlens_k): keys ``[k_begin, + len_k)``, bottom-right aligned
    causal, ``j_lo = 0`` (``p0`` is not computed: 0). Paged (``k_ptr`` = cache_seqlens,
    ``k_begin = 0``) or dense with ``WINDOW``: the band from the window's left edge of the
    first row (``max(p0 - window, 0)``, aligned down) to the last real row's position
    (:func:`gluon_prefill_fa3.key_band` mirrors it)."""
    per_block = batch * HQ
    m_rev = t // per_block
    rest = t - m_rev * per_block
    b = rest // HQ
    head = rest - b * HQ
    m0 = (n_m - 1 - m_rev) * BLOCK_M
    q_begin = gl.load(cu_q_ptr + b)
    len_q = gl.load(cu_q_ptr + b + 1) - q_begin
    if PAGED:
        k_begin = 0
        len_k = gl.load(k_ptr + b)
    else:
        k_begin = gl.load(k_ptr + b)
        len_k = gl.load(k_ptr + b + 1) - k_begin
    valid = m0 < len_q
    if PAGED or WINDOW:
        p0 = len_k - len_q + m0
        hi = len_k - len_q + gl.minimum(m0 + BLOCK_M, len_q)  # last real row's position + 1
        j_lo = gl.maximum(p0 - window, 0) // BLOCK_N
        j_hi = gl.cdiv(gl.minimum(gl.maximum(hi, 0), len_k), BLOCK_N)
        n_kv = gl.maximum(j_hi - j_lo, 0)
    else:
        last = len_k - len_q + gl.minimum(m0 + BLOCK_M, len_q)  # last real row's position + 1
        n_kv = gl.cdiv(gl.minimum(gl.maximum(last, 0), len_k), BLOCK_N)
        p0 = 0
        j_lo = 0
    return valid, b, head, q_begin, k_begin, m0, len_q, len_k, p0, j_lo, n_kv


@gluon.jit
def _edge(j, first, last, window, BLOCK_N: gl.constexpr):
    """Paged or windowed: whether key tile ``j`` needs the mask for rows at positions ``first .. last``:
    it crosses the diagonal of the first row or the window's left edge of the last one."""
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
def producer(
    args,
    HQ: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_WG: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE: gl.constexpr,
    BOX: gl.constexpr,
    WINDOW: gl.constexpr,
    TILE_LIST: gl.constexpr = False,
):
    """One warp: TMA copies of each tile's ``NUM_WG`` Q halves, then its K/V tiles from the
    diagonal down, each into the ring slot the consumers released (paged: page by page, the
    page ids of key tile ``i + 1`` loaded while tile ``i`` is issued). ``args``: ``(q_desc,
    k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, k_ptr, table_ptr, table_stride,
    max_pages, num_pages, window, n_m, batch, total, tiles_ptr)``, the page-table entries placeholders
    (0) when dense, the window too unless ``WINDOW`` (dense: the key band from ``j_lo``);
    ``TILE_LIST``: the work tiles are ``tiles_ptr[1 .. total]`` (see :func:`_tile_at`)."""
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, k_ptr, table_ptr, table_stride, max_pages, \
        num_pages, window, n_m, batch, total, tiles_ptr = args  # fmt: skip
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, _turn, _clean = bars
    descs = (k_desc, v_desc)
    rings = (k_smem, v_smem)
    ready = (k_ready, v_ready)
    empty = (k_empty, v_empty)
    if PAGED:
        ids_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        boxes = gl.arange(0, BLOCK_N // BOX, layout=ids_layout)
    else:
        boxes = 0
    it = 0
    n_done = 0
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, b, head, q_begin, k_begin, m0, _len_q, len_k, _p0, j_lo, n_kv = _tile(
            _tile_at(i, tiles_ptr, TILE_LIST), n_m, batch, cu_q_ptr, k_ptr, window, HQ, NUM_WG * HALF, BLOCK_N, PAGED,
            WINDOW)  # fmt: skip
        if valid:
            for w in gl.static_range(NUM_WG):
                mbarrier.wait(q_empty.index(w), (n_done & 1) ^ 1)
                mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    q_desc, [q_begin + m0 + w * HALF, head * D], q_ready.index(w), q_smem.index(w)
                )
            n_done += 1
            if PAGED:
                kv_head = head // G
                row = b.to(gl.int64) * table_stride
                n_pages = gl.cdiv(len_k, PAGE)
                j = j_lo + n_kv - 1
                ids = _page_ids(table_ptr, row, j, n_pages, max_pages, num_pages, boxes, BLOCK_N, BOX, PAGE)
                col = 0
            else:
                col = (head // G) * D
                kv_head = 0
                j = 0
                ids = 0
            for i in range(n_kv):
                if PAGED:
                    nxt = _page_ids(table_ptr, row, j - 1, n_pages, max_pages, num_pages, boxes, BLOCK_N, BOX, PAGE)
                elif WINDOW:
                    row = k_begin + (j_lo + n_kv - 1 - i) * BLOCK_N
                else:
                    row = k_begin + (n_kv - 1 - i) * BLOCK_N
                slot = it % STAGES
                phase = ((it // STAGES) & 1) ^ 1
                # K, then V (unrolled); the dense copies stay inline: a helper's inlined scope
                # adds PTX labels, which split ptxas's basic blocks and would change the SASS
                for o in gl.static_range(2):
                    desc = descs[o]
                    mbarrier.wait(empty[o].index(slot), phase)
                    if PAGED:
                        _issue_pages(desc, rings[o].index(slot), ready[o].index(slot), ids, boxes, j, kv_head, BLOCK_N,
                                     BOX, PAGE, D)  # fmt: skip
                    else:
                        mbarrier.expect(ready[o].index(slot), desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(desc, [row, col], ready[o].index(slot), rings[o].index(slot))
                if PAGED:
                    ids = nxt
                    j -= 1
                it += 1


@gluon.jit
def _wait_turn(turn, rnd, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong (round robin over the consumer warpgroups): before its issue round ``rnd``,
    warpgroup ``WG`` waits until the previous one has issued its round ``rnd - 1`` (warpgroup
    0, after the last one) or ``rnd`` (the others). mbarriers start in phase 0, and waiting on
    parity 1 of a fresh barrier passes: warpgroup 0 goes first. The rounds stay in lock step
    (no warpgroup gets two rounds ahead), so one parity bit tells the phases apart."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(0), (rnd & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(WG), rnd & 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, NUM_WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: warpgroup ``WG`` has issued its wgmma round; the next one may issue."""
    if PINGPONG:
        mbarrier.arrive(turn.index((WG + 1) % NUM_WG), count=1)


@gluon.constexpr_function
def _clean_shares(num_wg):
    """The row shares a V tile is cleaned in: ``num_wg`` rounded up to a power of two (a
    share's rows must be one), dealt round robin to the consumer warpgroups."""
    return 1 << (int(num_wg) - 1).bit_length()


@gluon.jit
def _clean_v(v_tile, dirty, clean, n_dirty, WG: gl.constexpr, NUM_WG: gl.constexpr, BLOCK_N: gl.constexpr,
             CLEAN: gl.constexpr):  # fmt: skip
    """On a tile some row of the work tile masks (``dirty``): zero the non-finite values of
    this warpgroup's rows of the V tile ``v_tile [BLOCK_N, D]`` in shared memory (shares of
    ``BLOCK_N / _clean_shares(NUM_WG)`` rows, share ``c`` to warpgroup ``c % NUM_WG``: with
    two warpgroups, one half each), then wait until every warpgroup has cleaned its rows
    (``clean``: one arrival per warpgroup per dirty tile, so they must all agree on which
    tiles are dirty). Returns the dirty-tile count (the barrier's phase)."""
    if dirty:
        ROWS: gl.constexpr = BLOCK_N // _clean_shares(NUM_WG)
        for c in gl.static_range(BLOCK_N // ROWS):
            if c % NUM_WG == WG:
                part = v_tile.slice(c * ROWS, ROWS)
                x = part.load(CLEAN)
                part.store(gl.where(gl.abs(x) < float("inf"), x, gl.zeros_like(x)))
        fence_async_shared()  # the generic-proxy stores visible to wgmma (async proxy)
        gl.thread_barrier()  # every thread of the warpgroup has stored before the arrival
        mbarrier.arrive(clean, count=1)
        mbarrier.wait(clean, n_dirty & 1)
        n_dirty += 1
    return n_dirty


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    row_pos,
    cols,
    start,
    qk_scale,
    window,
    masked,
    dtype: gl.constexpr,
    p_layout: gl.constexpr,
    EXP2_POLY: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr,
    PAGED: gl.constexpr,
    BAND: gl.constexpr,
):
    """One online-softmax step on the raw scores ``s [HALF, BLOCK_N]`` (fp32) of keys
    ``start + c``: mask (only when ``masked``; by selection: dense, keys past a row's
    position; ``BAND`` (paged or windowed), keep iff ``0 <= p - start - c <= window``, one
    unsigned compare),
    running max ``m_i`` in scaled base-2 units, ``p = exp2(s * qk_scale - m)``. Returns
    ``(p, alpha, m_new, l_new, moved)`` with ``p`` already in the input dtype and the wgmma
    A-operand layout (half the registers of fp32); ``moved``: whether some row's max moved
    (always 1 without ``RESCALE_THRESHOLD``; with it, a row keeps its max unless this tile
    raises it by more than the threshold)."""
    if masked:
        if BAND:
            dist = gl.expand_dims(row_pos - start, 1) - gl.expand_dims(cols, 0)
            s = gl.where(dist.to(gl.uint32, bitcast=True) <= window.to(gl.uint32), s, float("-inf"))
        else:
            keep = gl.expand_dims(cols + start, 0) <= gl.expand_dims(row_pos, 1)
            s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    moved = 1
    if RESCALE_THRESHOLD > 0:
        grow = m_new > m_i + RESCALE_THRESHOLD  # -inf + t stays -inf: a first key always moves it
        m_new = gl.where(grow, m_new, m_i)
        moved = gl.max(grow.to(gl.int32), axis=0)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row may see nothing yet
    alpha = gl.exp2(m_i - m_use)
    if PAGED and EXP2_POLY == 0:
        # gl.exp2 itself: the extend's SASS as built before the fold (an inlined _exp2 scope
        # adds PTX labels, which split ptxas's basic blocks: other schedule, same arithmetic)
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    else:
        p = _exp2(s * qk_scale - gl.expand_dims(m_use, 1), EXP2_POLY)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_new, moved


@gluon.jit
def consumer(
    common,
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
    PINGPONG: gl.constexpr,
    NUM_WG: gl.constexpr,
    EXP2_POLY: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    PAGED: gl.constexpr,
    CLEAN: gl.constexpr,
    WINDOW: gl.constexpr,
    TILE_LIST: gl.constexpr = False,
):
    """One warpgroup: rows ``[m0 + WG * HALF, + HALF)`` of every tile of this program.
    ``common``: the runtime arguments all consumers share, ``(q_smem, k_smem, v_smem, bars,
    o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, k_ptr, sm_scale, window, n_m, batch, total, tiles_ptr)`` (the
    window a placeholder 0 when dense without ``WINDOW``), one tuple so each partition passes
    it whole. ``CLEAN``: the 4-warp blocked layout in which the V tile's share is cleaned on
    dirty tiles (None: no cleaning, the dense kernel's timing reference only). ``WINDOW``
    (dense): the paged path's key band, window mask and tile walk."""
    q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, k_ptr, sm_scale, window, n_m, batch, \
        total, tiles_ptr = common  # fmt: skip
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
    for i in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, _b, head, q_begin, _k_begin, m0, len_q, len_k, p0, j_lo, n_kv = _tile(
            _tile_at(i, tiles_ptr, TILE_LIST), n_m, batch, cu_q_ptr, k_ptr, window, HQ, NUM_WG * HALF, BLOCK_N, PAGED,
            WINDOW)  # fmt: skip
        if valid:
            r0 = m0 + WG * HALF  # this warpgroup's first token
            if PAGED or WINDOW:
                my_p0 = p0 + WG * HALF  # ... and its position
                row_pos = my_p0 + rows
                tile_last = p0 + NUM_WG * HALF - 1  # the work tile's last row position (dirty tiles)
                n_masked = 0
                n_unclean = 0
            else:
                my_p0 = len_k - len_q + r0  # ... and its position
                row_pos = my_p0 + rows
                # key tiles every row sees in full: [0, (p0 + 1) // BLOCK_N); the rest are masked
                n_masked = n_kv - gl.minimum(gl.maximum(my_p0 + 1, 0) // BLOCK_N, n_kv)
                # ... and those the work tile's first row masks (every warpgroup the same): the
                # dirty ones, V cleaned (they hold every key past the sequence, the next one's rows)
                n_unclean = n_kv - gl.minimum(gl.maximum(len_k - len_q + m0 + 1, 0) // BLOCK_N, n_kv)
                tile_last = 0
            m_i = gl.full([HALF], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))
            l_i = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_MMA))
            acc = gl.zeros([HALF, D], gl.float32, layout=O_MMA)
            mbarrier.wait(q_ready.index(WG), n_done & 1)
            n_done += 1
            if n_kv > 0:
                # ---- step 0: S_0 = Q·K_0ᵀ alone (the diagonal tile, j = j_lo + n_kv - 1)
                if PAGED or WINDOW:
                    j = j_lo + n_kv - 1
                else:
                    j = 0
                slot = it % STAGES
                mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                _wait_turn(turn, rnd, WG, PINGPONG)
                s_tok = warpgroup_mma(my_q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                _pass_turn(turn, WG, NUM_WG, PINGPONG)
                rnd += 1
                s = warpgroup_mma_wait(0, deps=[s_tok])
                mbarrier.arrive(k_empty.index(slot), count=1)
                if PAGED or WINDOW:
                    masked = _edge(j, my_p0, my_p0 + HALF - 1, window, BLOCK_N)
                    start = j * BLOCK_N
                else:
                    start = (n_kv - 1) * BLOCK_N
                    masked = n_masked > 0
                p, _alpha0, m_i, l_i, _moved0 = _softmax_step(
                    s, m_i, l_i, row_pos, cols, start, qk_scale, window, masked, dtype, p_layout, EXP2_POLY,
                    RESCALE_THRESHOLD, PAGED, PAGED or WINDOW,
                )  # fmt: skip
                if PAGED or WINDOW:
                    dirty = _edge(j, p0, tile_last, window, BLOCK_N)
                else:
                    dirty = n_unclean > 0
                # ---- steps 1 ..: S_i = Q·K_iᵀ and O += P_{i-1}·V_{i-1} in flight together
                for i in range(1, n_kv):
                    prev = slot
                    it += 1
                    if PAGED or WINDOW:
                        j -= 1
                    slot = it % STAGES
                    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                    mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
                    if CLEAN is not None:
                        n_dirty = _clean_v(v_smem.index(prev), dirty, clean, n_dirty, WG, NUM_WG, BLOCK_N, CLEAN)
                    _wait_turn(turn, rnd, WG, PINGPONG)
                    s_tok = warpgroup_mma(
                        my_q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True
                    )
                    p_prev = p
                    o_tok = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
                    _pass_turn(turn, WG, NUM_WG, PINGPONG)
                    rnd += 1
                    s = warpgroup_mma_wait(1, deps=[s_tok])
                    mbarrier.arrive(k_empty.index(slot), count=1)
                    if PAGED or WINDOW:
                        masked = _edge(j, my_p0, my_p0 + HALF - 1, window, BLOCK_N)
                        start = j * BLOCK_N
                    else:
                        start = (n_kv - 1 - i) * BLOCK_N
                        masked = i < n_masked
                    p, alpha_i, m_i, l_i, moved = _softmax_step(
                        s, m_i, l_i, row_pos, cols, start, qk_scale, window, masked, dtype, p_layout, EXP2_POLY,
                        RESCALE_THRESHOLD, PAGED, PAGED or WINDOW,
                    )  # fmt: skip
                    if PAGED or WINDOW:
                        dirty = _edge(j, p0, tile_last, window, BLOCK_N)
                    else:
                        dirty = i < n_unclean
                    if PV_OVERLAP:
                        # Passes at once (V_{i-1} is released only below) but ends the softmax's
                        # basic block: ptxas, which hoists the P·V wait to the top of its block,
                        # leaves it after the softmax (and packs the new P after the wait).
                        mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
                    # p_prev (the A operand in registers) stays live until its product retires
                    acc, _p_done = warpgroup_mma_wait(0, deps=[o_tok, p_prev])
                    mbarrier.arrive(v_empty.index(prev), count=1)
                    if moved > 0:  # always, unless RESCALE_THRESHOLD (then: some row's max moved)
                        acc = acc * gl.expand_dims(gl.convert_layout(alpha_i, gl.SliceLayout(1, O_MMA)), 1)
                # Q is no longer read: the producer may load the next tile's half.
                mbarrier.arrive(q_empty.index(WG), count=1)
                # ---- last: O += P·V of the last key tile
                mbarrier.wait(v_ready.index(slot), (it // STAGES) & 1)
                if CLEAN is not None:
                    n_dirty = _clean_v(v_smem.index(slot), dirty, clean, n_dirty, WG, NUM_WG, BLOCK_N, CLEAN)
                _wait_turn(turn, rnd, WG, PINGPONG)
                o_tok = warpgroup_mma(p, v_smem.index(slot), acc, is_async=True)
                _pass_turn(turn, WG, NUM_WG, PINGPONG)
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
