"""``gluon_moe_mma_sm90``'s two layers with their weights staged by TMA (configs ``tma1``,
``tma2``).

Same inputs, outputs and numerics as ``w13_mma_kernel`` in :mod:`._gluon_moe_mma_kernel`
(the decode, the two MMAs per MX group, the E8M0 scales, the activation and the fp16
intermediate in pair order are the same helpers); only the weight words travel differently.
The H100 profile of the register-loaded kernel (docs/history.md, MoE decode §7) shows it
waiting on loads with ~11 warps per SM and 161 registers: the bytes in flight cost
registers. Here they cost shared memory instead:

- **Ring.** Per K step, TMA copies two ``[32 rows, BW]`` int32 boxes (the program's 32 gate
  rows and 32 up rows, ``BW = 4 * KS * U`` words = ``KS * U`` MX groups) into a
  ``STAGES``-deep ring of 128-byte-swizzled buffers, one ``mbarrier`` per stage; the copy
  for step ``i + STAGES`` is issued as soon as every warp has read step ``i``. Groups past
  K are zero-filled by TMA (code 0 adds nothing); their scales and activations are masked.
- **Registers.** Each 8-row slice of a box is read with ``BlockedLayout([1, 1], [8, 4],
  [1, KS], [1, 0])``: lane ``(g, c)`` gets word ``c`` of one group of row ``g``, warps split
  the groups, register repeats are the ``U`` group slots (group ``u * KS + ks`` of the step).
  The swizzle places the 8 rows of a word column in 8 different 16-byte chunks, so the
  reads are free of bank conflicts. Slices ``0, 8, 16, 24`` are rows ``g``, ``g + 8`` of the
  two 16-row MMA blocks.

Layer 2 (``w2_mma_tma_kernel``) does the same per choice: one ``[16, BW]`` box of each live
choice's expert per step into ``[STAGES, KP * 16, BW]``, read as ``[KP, 8, BW]`` slices
with warps ``[KP, 1, KS]`` (each choice's warps read its own box).

On an H100 (2026-11-23, docs/history.md, MoE decode §8) both match float64. Layer 1
with a 2-deep ring is 9-10% faster than the register kernel at T = 4 and 8 (more programs
than one wave holds) and ships there; at T = 1 and 2 it is 2-7% slower. Layer 2 is 1.3-2x
slower at every T and ships nowhere (``GluonMoEMMAConfig(tma2=True)`` keeps it reachable).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_decode_kernel import _activate
from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_mma_kernel import (
    _choice_expert,
    _choice_term,
    _exponent,
    _group_dot,
    _load4,
    _nan_if_seen,
    _pair_start,
    _pow2,
    _scale_bits,
    _unscale,
    _w2_math,
    _x_operand,
)


@gluon.jit
def _issue(desc, g_smem, u_smem, bar, row_gate, row_up, col):
    """Start the TMA copies of one step's gate and up boxes (``[32, BW]`` at ``col``)."""
    mbarrier.expect(bar, 2 * desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row_gate, col], bar, g_smem)
    tma.async_copy_global_to_shared(desc, [row_up, col], bar, u_smem)


@gluon.jit
def _block_dot(
    acc_lo,
    acc_hi,
    seen_lo,
    seen_hi,
    box,
    r0: gl.constexpr,
    s_row,
    grp,
    ok,
    b,
    B8: gl.constexpr,
    KG: gl.constexpr,
    NORMALIZE: gl.constexpr,
):
    """One 16-row MMA block of a step: rows ``r0 + g`` (lo) and ``r0 + 8 + g`` (hi) of the
    shared ``box``, their E8M0 scales at ``s_row`` (row ``r0 + g``'s), accumulated."""
    w_lo = box.slice(r0, 8, dim=0).load(B8)
    w_hi = box.slice(r0 + 8, 8, dim=0).load(B8)
    s_lo = gl.load(s_row + grp, mask=ok, other=127)
    s_hi = gl.load(s_row + 8 * KG + grp, mask=ok, other=127)
    d_lo, d_hi = _group_dot(w_lo, w_hi, b[0], b[1], b[2], b[3], NORMALIZE)
    f, seen_lo = _scale_bits(s_lo, seen_lo)
    acc_lo += d_lo * f
    f, seen_hi = _scale_bits(s_hi, seen_hi)
    acc_hi += d_hi * f
    return acc_lo, acc_hi, seen_lo, seen_hi


@gluon.jit
def _column(acc, seen, unscale):
    """[8, BW] partial dots -> [8]: the sum over groups and warps (a quad's 4 lanes hold the
    same D value: a quarter each), NaN where a scale of the row was 255."""
    return _nan_if_seen(gl.sum(acc, axis=1) * (0.25 * unscale), gl.max(seen, axis=1))


@gluon.jit
def _act_block(gate, up, b_row, cols, HAS_BIAS: gl.constexpr, N: gl.constexpr, ACTIVATION: gl.constexpr):
    """act(gate + bias) * (up + bias) of 8 columns ``cols`` (float32 [8])."""
    if HAS_BIAS:
        gate += gl.load(b_row + cols).to(gl.float32)
        up += gl.load(b_row + N + cols).to(gl.float32)
    return _activate(gate, up, ACTIVATION)


@gluon.jit
def _store_block(h_row, a, h_scale, blk, q: gl.constexpr, r):
    """Store 8 activations (columns ``q * 8 + r`` of the program's 32) in fp16 at their
    pair positions: 8-blocks keep their place, inside one ``j + 4 h -> 2 j + h``, as in
    ``w13_mma_kernel``."""
    pos = blk * 32 + q * 8 + (r % 4) * 2 + r // 4
    gl.store(h_row + pos, (a * h_scale).to(gl.float16))


@gluon.jit
def w13_mma_tma_kernel(
    x_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    hid_ptr,
    hs_ptr,
    ids_ptr,
    emap_ptr,
    stride_xt,
    stride_be,
    N: gl.constexpr,
    KG: gl.constexpr,
    TOP_K: gl.constexpr,
    HAS_MAP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ACTIVATION: gl.constexpr,
    X_F16: gl.constexpr,
    KS: gl.constexpr,
    U: gl.constexpr,
    STAGES: gl.constexpr,
    XL: gl.constexpr,
    HP: gl.constexpr,
    NORMALIZE: gl.constexpr,
):
    """Layer 1 of one (token, choice) pair (axis 0) for 32 intermediate columns (axis 1).

    x ``[T, H]`` bf16/fp16 (rows contiguous); ``w_desc``: TMA descriptor over w13's int32
    words viewed as ``[E * 2N, H / 8]``, box ``[32, 4 * KS * U]``, 128-byte swizzle; s: E8M0
    ``[E, 2N, H/32]``; b ``[E, 2N]``; ids int32 ``[T * TOP_K]``; emap int32 ``[E_global]``.
    Writes hid fp16 ``[T * TOP_K, N]`` (pair order, scaled) and hs float32
    ``[T * TOP_K, N / 32]`` exactly as ``w13_mma_kernel`` does. ``KS`` warps."""
    BW: gl.constexpr = 4 * KS * U
    STEP: gl.constexpr = KS * U  # MX groups per K step
    NSTEP: gl.constexpr = (KG + STEP - 1) // STEP
    B8: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [1, KS], [1, 0])
    ROWS: gl.constexpr = gl.SliceLayout(1, B8)
    pair = gl.program_id(0)
    blk = gl.program_id(1)
    x_row, e_x, expert = _pair_start(x_ptr, ids_ptr, emap_ptr, stride_xt, pair, TOP_K, HAS_MAP, X_F16, KG, HP, XL)
    if expert < 0:  # not on this rank: layer 2 masks the pair
        return

    # ---- the ring; the prologue starts the first STAGES steps' copies
    row_gate = expert * (2 * N) + blk * 32
    row_up = row_gate + N
    g_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 32, BW], w_desc.layout)
    u_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 32, BW], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=1)
    fence_async_shared()  # barrier inits visible to the TMA unit
    for st in gl.static_range(STAGES):
        if st < NSTEP:
            _issue(w_desc, g_smem.index(st), u_smem.index(st), bars.index(st), row_gate, row_up, st * BW)

    # ---- per-lane indices: row g, word column (group slot u * KS + ks, word c)
    g = gl.expand_dims(gl.arange(0, 8, layout=ROWS), 1)  # [8, 1]
    col = gl.expand_dims(gl.arange(0, BW, layout=gl.SliceLayout(0, B8)), 0)  # [1, BW]
    slot = col // 4
    c = col % 4
    e64 = expert.to(gl.int64)
    s_gate = s_ptr + e64 * (2 * N * KG) + (blk * 32 + g).to(gl.int64) * KG  # [8, 1], row g
    s_up = s_gate + N * KG
    x4 = x_row.to(gl.pointer_type(gl.int32)) + c * 4 + g * 0  # [8, BW]
    x_scale = gl.full([8, BW], 1.0, gl.float32, layout=B8) * _pow2(-e_x)
    zero = gl.zeros([8, BW], gl.float32, layout=B8)
    none = gl.zeros([8, BW], gl.int32, layout=B8)
    # gate / up x block 0 / 1 x lo / hi
    ag0l, ag0h, ag1l, ag1h, au0l, au0h, au1l, au1h = zero, zero, zero, zero, zero, zero, zero, zero
    sg0l, sg0h, sg1l, sg1h, su0l, su0h, su1l, su1h = none, none, none, none, none, none, none, none

    for i in range(NSTEP):
        stage = i % STAGES
        grp = i * STEP + slot  # [1, BW]
        ok = grp < KG
        p0, p1, p2, p3 = _load4(x4 + grp * 16, ok, True)
        b = _x_operand(p0, p1, p2, p3, x_scale, X_F16)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        gbox = g_smem.index(stage)
        ubox = u_smem.index(stage)
        ag0l, ag0h, sg0l, sg0h = _block_dot(ag0l, ag0h, sg0l, sg0h, gbox, 0, s_gate, grp, ok, b, B8, KG, NORMALIZE)
        ag1l, ag1h, sg1l, sg1h = _block_dot(
            ag1l, ag1h, sg1l, sg1h, gbox, 16, s_gate + 16 * KG, grp, ok, b, B8, KG, NORMALIZE
        )
        au0l, au0h, su0l, su0h = _block_dot(au0l, au0h, su0l, su0h, ubox, 0, s_up, grp, ok, b, B8, KG, NORMALIZE)
        au1l, au1h, su1l, su1h = _block_dot(
            au1l, au1h, su1l, su1h, ubox, 16, s_up + 16 * KG, grp, ok, b, B8, KG, NORMALIZE
        )
        # Every warp has read this stage: refill it with the step STAGES ahead.
        gl.thread_barrier()
        if i + STAGES < NSTEP:
            _issue(w_desc, gbox, ubox, bars.index(stage), row_gate, row_up, (i + STAGES) * BW)
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))

    # ---- epilogue: columns blk * 32 + 8 q + g, q = 2 bb + h (bb: MMA block, h: lo / hi)
    unscale = _unscale(NORMALIZE) * _pow2(e_x)
    r = gl.arange(0, 8, layout=ROWS)
    b_row = b_ptr + e64 * stride_be
    c0 = blk * 32 + r
    a0 = _act_block(_column(ag0l, sg0l, unscale), _column(au0l, su0l, unscale), b_row, c0, HAS_BIAS, N, ACTIVATION)
    a1 = _act_block(_column(ag0h, sg0h, unscale), _column(au0h, su0h, unscale), b_row, c0 + 8, HAS_BIAS, N, ACTIVATION)
    a2 = _act_block(_column(ag1l, sg1l, unscale), _column(au1l, su1l, unscale), b_row, c0 + 16, HAS_BIAS, N, ACTIVATION)
    a3 = _act_block(_column(ag1h, sg1h, unscale), _column(au1h, su1h, unscale), b_row, c0 + 24, HAS_BIAS, N, ACTIVATION)
    amax = gl.maximum(
        gl.maximum(gl.max(gl.abs(a0), axis=0), gl.max(gl.abs(a1), axis=0)),
        gl.maximum(gl.max(gl.abs(a2), axis=0), gl.max(gl.abs(a3), axis=0)),
    )
    e_h = _exponent(amax)
    h_scale = _pow2(-e_h)
    h_row = hid_ptr + pair.to(gl.int64) * N
    _store_block(h_row, a0, h_scale, blk, 0, r)
    _store_block(h_row, a1, h_scale, blk, 1, r)
    _store_block(h_row, a2, h_scale, blk, 2, r)
    _store_block(h_row, a3, h_scale, blk, 3, r)
    gl.store(hs_ptr + pair.to(gl.int64) * (N // 32) + blk, _pow2(e_h))


@gluon.jit
def _issue_w2(
    desc,
    ring,
    bar,
    ids_ptr,
    emap_ptr,
    token,
    stage,
    row0,
    col,
    N: gl.constexpr,
    TOP_K: gl.constexpr,
    KP: gl.constexpr,
    HAS_MAP: gl.constexpr,
):
    """Start one step's copies: the ``[16, BW]`` box at ``[e_c * N + row0, col]`` of every
    live choice ``c`` into rows ``16 c ..`` of ``ring[stage]``. The stage's barrier counts ``TOP_K``
    arrivals: a live choice arrives with its bytes to expect, a remote one (no copy) plainly."""
    for ch in gl.static_range(TOP_K):
        e = _choice_expert(ids_ptr, emap_ptr, token * TOP_K + ch, HAS_MAP)
        on = e >= 0
        mbarrier.expect(bar, desc.block_type.nbytes, pred=on)
        mbarrier.arrive(bar, pred=e < 0)
        tma.async_copy_global_to_shared(
            desc, [gl.maximum(e, 0) * N + row0, col], bar, ring.index(stage).slice(ch * 16, 16, dim=0), pred=on
        )


@gluon.jit
def w2_mma_tma_kernel(
    hid_ptr,
    hs_ptr,
    w_desc,
    s_ptr,
    b_ptr,
    out_ptr,
    ids_ptr,
    tw_ptr,
    emap_ptr,
    stride_be,
    stride_ot,
    N: gl.constexpr,
    KG: gl.constexpr,
    TOP_K: gl.constexpr,
    KP: gl.constexpr,
    KS: gl.constexpr,
    U: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_MAP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    NORMALIZE: gl.constexpr,
):
    """Layer 2 and the combine of one token (axis 1) for 16 output columns (axis 0), as
    ``w2_mma_kernel`` with ``R = 1``; ``w_desc``: TMA descriptor over w2's int32 words
    viewed as ``[E * N, I / 8]``, box ``[16, 4 * KS * U]``. ``KP * KS`` warps."""
    BW: gl.constexpr = 4 * KS * U
    STEP: gl.constexpr = KS * U
    NSTEP: gl.constexpr = (KG + STEP - 1) // STEP
    B3: gl.constexpr = gl.BlockedLayout([1, 1, 1], [1, 8, 4], [KP, 1, KS], [2, 1, 0])
    blk = gl.program_id(0)
    token = gl.program_id(1).to(gl.int64)
    row0 = blk * 16

    ring = gl.allocate_shared_memory(gl.int32, [STAGES, KP * 16, BW], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(bars.index(st), count=TOP_K)
    fence_async_shared()
    for st in gl.static_range(STAGES):
        if st < NSTEP:
            _issue_w2(w_desc, ring, bars.index(st), ids_ptr, emap_ptr, token, st, row0, st * BW, N, TOP_K, KP, HAS_MAP)

    ch = gl.expand_dims(gl.expand_dims(gl.arange(0, KP, layout=gl.SliceLayout(1, gl.SliceLayout(2, B3))), 1), 2)
    g = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, B3))), 0), 2)
    col = gl.expand_dims(gl.expand_dims(gl.arange(0, BW, layout=gl.SliceLayout(0, gl.SliceLayout(1, B3))), 0), 1)
    slot = col // 4
    c = col % 4
    pairs = token * TOP_K + ch  # [KP, 1, 1]
    c_ok = ch < TOP_K
    experts = gl.load(ids_ptr + pairs, mask=c_ok, other=-1)
    if HAS_MAP:
        experts = gl.load(emap_ptr + experts, mask=c_ok & (experts >= 0), other=-1)
    live = c_ok & (experts >= 0)
    weight = gl.load(tw_ptr + pairs, mask=live, other=0.0)
    e64 = gl.where(live, experts, 0).to(gl.int64)
    rows = row0 + g  # [1, 8, 1]
    s_lo = s_ptr + e64 * (N * KG) + rows.to(gl.int64) * KG  # [KP, 8, 1]
    h4 = hid_ptr.to(gl.pointer_type(gl.int32)) + pairs * (KG * 16) + c * 4 + g * 0  # [KP, 8, BW]
    hs_row = hs_ptr + pairs * KG
    acc_lo = gl.zeros([KP, 8, BW], gl.float32, layout=B3)
    acc_hi = gl.zeros([KP, 8, BW], gl.float32, layout=B3)
    seen_lo = gl.zeros([KP, 8, BW], gl.int32, layout=B3)
    seen_hi = gl.zeros([KP, 8, BW], gl.int32, layout=B3)

    for i in range(NSTEP):
        stage = i % STAGES
        grp = i * STEP + slot  # [1, 1, BW]
        ok = live & (grp < KG)
        b0, b1, b2, b3 = _load4(h4 + grp * 16, ok, True)
        hs = gl.load(hs_row + grp + g * 0, mask=ok, other=0.0)
        s_l = gl.load(s_lo + grp, mask=ok, other=127)
        s_h = gl.load(s_lo + 8 * KG + grp, mask=ok, other=127)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        boxes = ring.index(stage).reshape([KP, 16, BW])
        w_l = boxes.slice(0, 8, dim=1).load(B3)
        w_h = boxes.slice(8, 8, dim=1).load(B3)
        ops = (w_l, w_h, s_l, s_h, b0, b1, b2, b3, hs)
        acc_lo, acc_hi, seen_lo, seen_hi = _w2_math(acc_lo, acc_hi, seen_lo, seen_hi, ops, NORMALIZE)
        gl.thread_barrier()  # every warp has read this stage: refill it
        if i + STAGES < NSTEP:
            _issue_w2(
                w_desc,
                ring,
                bars.index(stage),
                ids_ptr,
                emap_ptr,
                token,
                stage,
                row0,
                (i + STAGES) * BW,
                N,
                TOP_K,
                KP,
                HAS_MAP,
            )
    for st in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(st))

    # As w2_mma_kernel, the bias at word column 0; a remote or padded choice adds nothing
    # (its box was never copied).
    first = col == 0
    bias = b_ptr + e64 * stride_be + rows + col * 0
    acc_lo = _choice_term(acc_lo, seen_lo, bias, first, live, weight, HAS_BIAS, NORMALIZE)
    acc_hi = _choice_term(acc_hi, seen_hi, bias + 8, first, live, weight, HAS_BIAS, NORMALIZE)
    y_lo = gl.sum(gl.sum(acc_lo, axis=2), axis=0) * 0.25  # [8]
    y_hi = gl.sum(gl.sum(acc_hi, axis=2), axis=0) * 0.25
    r_out = row0 + gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, B3)))
    o_row = out_ptr + token * stride_ot
    gl.store(o_row + r_out, y_lo.to(out_ptr.dtype.element_ty))
    gl.store(o_row + r_out + 8, y_hi.to(out_ptr.dtype.element_ty))
