"""Gluon (Triton's explicit-layout dialect) dense causal prefill for Hopper, after FlashAttention-3.

Persistent grid: program ``pid`` takes work tiles ``pid, pid + nprog, ...`` of the list
ordered heaviest first (see :func:`_tile`). A work tile is ``BLOCK_M = 2 x HALF`` consecutive
query tokens of one sequence and ONE query head (per-head tiles, not GQA packing: the causal
diagonal of a square 128 x 128 tile is exact, Q arrives as one 2-D TMA box, and the eight
query heads of a KV head are neighbours in the tile order so their K/V reads hit L2).

Warp specialization (``gl.warp_specialize``), ``NUM_WG + 1`` partitions:

- the producer (one warp, few registers): TMA copies of the Q halves and of the K/V tiles
  (``[BLOCK_N, D]`` boxes of the ``[total_k, Hkv * D]`` views) into a ``STAGES``-deep ring;
  ``k_ready``/``v_ready`` (transaction-count) and ``k_empty``/``v_empty`` barriers per stage,
  ``q_ready``/``q_empty`` per consumer;
- ``NUM_WG`` (2, or 3 as FA3 does at head dim 64) consumer warpgroups (the default partition
  and 4-warp workers, same function): each owns ``HALF = 64`` rows of the ``NUM_WG * 64``-row
  tile (one ``m64`` wgmma row block) and runs ``S = Q·Kᵀ`` (both operands in shared memory)
  and ``O += P·V`` (P from registers) on ``wgmma``.

Inside a warpgroup (intra-warpgroup overlap): step ``i`` issues ``S_i = Q·K_iᵀ`` and
``O += P_{i-1}·V_{i-1}`` asynchronously, waits for ``S_i`` only (``wait(1)``), does the
softmax of ``S_i`` while the tensor cores still run ``P_{i-1}·V_{i-1}``, then waits for that
and rescales ``O``. Between the two warpgroups (ping-pong): an mbarrier hand-off per issue
round (``turn``) makes them issue their wgmma rounds in turn (round robin), so one warpgroup's
softmax runs under the others' matmuls (FlashAttention-3 orders this with named barriers, which
Gluon does not expose; the mbarrier hand-off is a scheduling hint only, no data depends on it).

Key tiles are visited from the diagonal down (the masked tiles first); only tiles that
cross some row's diagonal (``start + BLOCK_N - 1 > p0`` for the warpgroup's first row
position ``p0``) evaluate the mask; positions are bottom-right aligned
(``Lk - Lq + i``), so rows with a negative position see nothing. Online softmax in base 2
with fp32 statistics; the sink joins the denominator once in the epilogue.

Variants (constexpr switches, see ``Fa3Config``): ``EXP2_POLY`` of every 8 exponentials on
the FMA pipe (:func:`_exp2`); ``RESCALE_THRESHOLD > 0``: a row's max moves only when a tile
raises it by more than the threshold, and ``O *= alpha`` is skipped when no row of the
warpgroup moved; ``PV_OVERLAP``: an mbarrier wait that passes at once between the softmax and
the ``P·V`` wait, so that ptxas keeps that wait after the softmax (otherwise it hoists it to
the top of the softmax's basic block and the intra-warpgroup overlap above does not happen).
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
def _tile(t, n_m, batch, cu_q_ptr, cu_k_ptr, HQ: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Work tile ``t`` of the heaviest-first order: query block ``n_m - 1 - t // (batch * HQ)``
    (the last blocks of the sequences, which see the most keys, come first), then sequence,
    then query head (the heads of one KV head adjacent). Returns ``(valid, head, q_begin,
    k_begin, m0, len_q, len_k, n_kv)``: ``m0`` the tile's first token, ``n_kv`` the key
    tiles its last real row sees (bottom-right aligned causal)."""
    per_block = batch * HQ
    m_rev = t // per_block
    rest = t - m_rev * per_block
    b = rest // HQ
    head = rest - b * HQ
    m0 = (n_m - 1 - m_rev) * BLOCK_M
    q_begin = gl.load(cu_q_ptr + b)
    len_q = gl.load(cu_q_ptr + b + 1) - q_begin
    k_begin = gl.load(cu_k_ptr + b)
    len_k = gl.load(cu_k_ptr + b + 1) - k_begin
    valid = m0 < len_q
    last = len_k - len_q + gl.minimum(m0 + BLOCK_M, len_q)  # last real row's position + 1
    n_kv = gl.cdiv(gl.minimum(gl.maximum(last, 0), len_k), BLOCK_N)
    return valid, head, q_begin, k_begin, m0, len_q, len_k, n_kv


@gluon.jit
def _producer(
    args,
    HQ: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    NUM_WG: gl.constexpr,
):
    """One warp: TMA copies of each tile's ``NUM_WG`` Q halves, then its K/V tiles from the
    diagonal down, each into the ring slot the consumers released. ``args``: its runtime
    arguments as one tuple (descriptors, shared buffers, barriers, pointers, scalars)."""
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, cu_k_ptr, n_m, batch, total = args
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, _turn = bars
    it = 0
    n_done = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, head, q_begin, k_begin, m0, _len_q, _len_k, n_kv = _tile(
            t, n_m, batch, cu_q_ptr, cu_k_ptr, HQ, NUM_WG * HALF, BLOCK_N
        )
        if valid:
            for w in gl.static_range(NUM_WG):
                mbarrier.wait(q_empty.index(w), (n_done & 1) ^ 1)
                mbarrier.expect(q_ready.index(w), q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(
                    q_desc, [q_begin + m0 + w * HALF, head * D], q_ready.index(w), q_smem.index(w)
                )
            n_done += 1
            col = (head // G) * D
            for i in range(n_kv):
                row = k_begin + (n_kv - 1 - i) * BLOCK_N
                slot = it % STAGES
                phase = ((it // STAGES) & 1) ^ 1
                mbarrier.wait(k_empty.index(slot), phase)
                mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [row, col], k_ready.index(slot), k_smem.index(slot))
                mbarrier.wait(v_empty.index(slot), phase)
                mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(v_desc, [row, col], v_ready.index(slot), v_smem.index(slot))
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


@gluon.jit
def _softmax_step(
    s,
    m_i,
    l_i,
    row_pos,
    cols,
    start,
    qk_scale,
    masked,
    dtype: gl.constexpr,
    p_layout: gl.constexpr,
    EXP2_POLY: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr,
):
    """One online-softmax step on the raw scores ``s [HALF, BLOCK_N]`` (fp32): mask (only
    when ``masked``: keys past a row's position), running max ``m_i`` in scaled base-2
    units, ``p = exp2(s * qk_scale - m)``. Returns ``(p, alpha, m_new, l_new, moved)`` with
    ``p`` already in the input dtype and the wgmma A-operand layout (half the registers of
    fp32); ``moved``: whether some row's max moved (always 1 without ``RESCALE_THRESHOLD``;
    with it, a row keeps its max unless this tile raises it by more than the threshold)."""
    if masked:
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
    p = _exp2(s * qk_scale - gl.expand_dims(m_use, 1), EXP2_POLY)
    l_new = l_i * alpha + gl.sum(p, axis=1)
    return gl.convert_layout(p.to(dtype), p_layout), alpha, m_new, l_new, moved


@gluon.jit
def _consumer(
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
):
    """One warpgroup: rows ``[m0 + WG * HALF, + HALF)`` of every tile of this program.
    ``common``: the runtime arguments all consumers share (shared buffers, barriers, pointers,
    scalars), one tuple so each partition passes it whole."""
    q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, cu_k_ptr, sm_scale, n_m, batch, total = common
    q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn = bars
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
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        valid, head, q_begin, _k_begin, m0, len_q, len_k, n_kv = _tile(
            t, n_m, batch, cu_q_ptr, cu_k_ptr, HQ, NUM_WG * HALF, BLOCK_N
        )
        if valid:
            r0 = m0 + WG * HALF  # this warpgroup's first token
            p0 = len_k - len_q + r0  # ... and its position
            row_pos = p0 + rows
            # key tiles every row sees in full: [0, (p0 + 1) // BLOCK_N); the rest are masked
            n_masked = n_kv - gl.minimum(gl.maximum(p0 + 1, 0) // BLOCK_N, n_kv)
            m_i = gl.full([HALF], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_MMA))
            l_i = gl.zeros([HALF], gl.float32, layout=gl.SliceLayout(1, S_MMA))
            acc = gl.zeros([HALF, D], gl.float32, layout=O_MMA)
            mbarrier.wait(q_ready.index(WG), n_done & 1)
            n_done += 1
            if n_kv > 0:
                # ---- step 0: S_0 = Q·K_0ᵀ alone
                slot = it % STAGES
                mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                _wait_turn(turn, rnd, WG, PINGPONG)
                s_tok = warpgroup_mma(my_q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                _pass_turn(turn, WG, NUM_WG, PINGPONG)
                rnd += 1
                s = warpgroup_mma_wait(0, deps=[s_tok])
                mbarrier.arrive(k_empty.index(slot), count=1)
                start = (n_kv - 1) * BLOCK_N
                p, _alpha0, m_i, l_i, _moved0 = _softmax_step(
                    s, m_i, l_i, row_pos, cols, start, qk_scale, n_masked > 0, dtype, p_layout, EXP2_POLY,
                    RESCALE_THRESHOLD,
                )  # fmt: skip
                # ---- steps 1 ..: S_i = Q·K_iᵀ and O += P_{i-1}·V_{i-1} in flight together
                for i in range(1, n_kv):
                    prev = slot
                    it += 1
                    slot = it % STAGES
                    mbarrier.wait(k_ready.index(slot), (it // STAGES) & 1)
                    mbarrier.wait(v_ready.index(prev), ((it - 1) // STAGES) & 1)
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
                    start = (n_kv - 1 - i) * BLOCK_N
                    p, alpha_i, m_i, l_i, moved = _softmax_step(
                        s, m_i, l_i, row_pos, cols, start, qk_scale, i < n_masked, dtype, p_layout, EXP2_POLY,
                        RESCALE_THRESHOLD,
                    )  # fmt: skip
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


# n_m and batch are never specialized: 1 would become a constexpr (one more compile per such
# call shape) for no gain in this kernel.
@gluon.jit(do_not_specialize=["n_m", "batch"])
def prefill_fa3_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_ptr,
    lse_ptr,
    sinks_ptr,
    cu_q_ptr,
    cu_k_ptr,
    sm_scale,
    n_m,
    batch,
    HQ: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    HALF: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_SINKS: gl.constexpr,
    HAS_LSE: gl.constexpr,
    S_MMA: gl.constexpr,
    O_MMA: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr,
    NUM_WG: gl.constexpr,
    EXP2_POLY: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
):
    """Dense causal attention, persistent over ``n_m * batch * HQ`` work tiles.

    q_desc: TMA descriptor over q ``[total_q, HQ * D]`` (bf16/fp16), box ``[HALF, D]``;
    k_desc / v_desc: over k / v ``[total_k, HQ // G * D]``, box ``[BLOCK_N, D]``;
    o: ``[total_q, HQ, D]`` in q's dtype; lse float32 ``[total_q, HQ]`` (natural log, sink
    included; written when ``HAS_LSE``); sinks float32 ``[HQ]``; cu_q / cu_k int32
    ``[batch + 1]``; ``n_m = cdiv(max_seqlen_q, NUM_WG * HALF)``. Launch with ``num_warps=4``
    (consumer 0) and a grid of at most the number of SMs. ``PINGPONG``: the hand-off that
    makes the ``NUM_WG`` (2 or 3) consumer warpgroups issue their wgmma rounds in turn (off:
    each issues as soon as its data is there); ``EXP2_POLY``, ``RESCALE_THRESHOLD``,
    ``PV_OVERLAP``: see ``Fa3Config``.
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, HALF, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(st), count=1)
        mbarrier.init(v_ready.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=NUM_WG)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(st), count=NUM_WG)
    fence_async_shared()  # the barrier inits visible to the TMA unit (async proxy)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn)
    total = n_m * batch * HQ
    # the consumer warpgroups run the same function on their own rows (WG 0 .. NUM_WG - 1)
    common = (q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, cu_k_ptr, sm_scale, n_m, batch, total)
    prod = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, cu_k_ptr, n_m, batch, total)
    if NUM_WG == 2:
        gl.warp_specialize(
            [
                (_consumer, (common, 0, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                             NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP)),
                (_consumer, (common, 1, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                             NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP)),
                (_producer, (prod, HQ, G, D, HALF, BLOCK_N, STAGES, NUM_WG)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (common, 0, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                             NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP)),
                (_consumer, (common, 1, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                             NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP)),
                (_consumer, (common, 2, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                             NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP)),
                (_producer, (prod, HQ, G, D, HALF, BLOCK_N, STAGES, NUM_WG)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
