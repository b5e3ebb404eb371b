"""Gluon (Triton's explicit-layout dialect) dense causal prefill for Hopper, after FlashAttention-3.

Persistent grid: program ``pid`` takes work tiles ``pid, pid + nprog, ...`` of the list
ordered heaviest first (see :func:`._gluon_fa3_common._tile`). A work tile is ``BLOCK_M = 2 x HALF`` consecutive
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

Unseen NaN/inf never leaks (docs/api.md): scores are masked by selection, and the V tiles
of the dirty key tiles (those holding a key some row of the WORK tile cannot see: the first
``n_unclean`` of the walk, the key tiles crossing the work tile's first row's diagonal;
they include every key past the sequence, the next sequence's rows of the dense view, which
sit past every row's position) are cleaned of non-finite values in shared memory before
``P·V``, each consumer warpgroup its share of the rows, all meeting on the ``clean``
mbarrier (a masked P is 0, but 0 x NaN is NaN inside ``wgmma``). With ``WINDOW`` the dirty
tiles are the paged extend's (``_edge`` of the work tile's first and last rows). Until
2026-11-28 this kernel did not clean V (the paged extend did): NaN leaked to rows that cannot
see it. On 128-row work tiles with ``Lk = Lq`` one key tile per work tile is dirty (the
diagonal); two when ``Lk - Lq`` is not a multiple of 128.

Variants (constexpr switches, see ``Fa3Config``): ``EXP2_POLY`` of every 8 exponentials on
the FMA pipe (:func:`._gluon_fa3_common._exp2`); ``RESCALE_THRESHOLD > 0``: a row's max moves only when a tile
raises it by more than the threshold, and ``O *= alpha`` is skipped when no row of the
warpgroup moved; ``PV_OVERLAP``: an mbarrier wait that passes at once between the softmax and
the ``P·V`` wait, so that ptxas keeps that wait after the softmax (otherwise it hoists it to
the top of the softmax's basic block and the intra-warpgroup overlap above does not happen).

``WINDOW`` (the sliding-window build): each tile visits only its key band, from the window's
left edge of its first row (aligned down to ``BLOCK_N``) to its diagonal, and masks the band's
edge tiles with the window compare (the paged path's band and mask); off, none of that code
is emitted (the causal-only SASS is byte-identical to the build before the switch).

The producer, the consumers and their helpers live in :mod:`._gluon_fa3_common`, shared with
the paged extend (``PAGED`` off here); this module holds the kernel: its shared buffers and
barriers (inline: see that module on why) and the warp specialization. ``CLEAN`` None
(``Fa3Config.clean_v`` off, ``ci/device/fa3_sweep.py --clean-ab`` only) builds the kernel
without the cleaning and its barrier: byte-identical to the build before the fix.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from tokenspeed_kernel_nvidia.ops.attention._gluon_fa3_common import (  # noqa: F401  (_exp2_asm_text, _f32_hex: tests)
    _exp2_asm_text,
    _f32_hex,
    consumer,
    producer,
)


# n_m and batch are never specialized: 1 would become a constexpr (one more compile per such
# call shape) for no gain in this kernel.
@gluon.jit(do_not_specialize=["n_m", "batch", "window"])
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
    window,
    tiles_ptr,
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
    CLEAN: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr,
    NUM_WG: gl.constexpr,
    EXP2_POLY: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    WINDOW: gl.constexpr,
    TILE_LIST: gl.constexpr = False,
):
    """Dense causal attention, persistent over ``n_m * batch * HQ`` work tiles (with
    ``TILE_LIST``: over the ``tiles_ptr[0]`` of them that hold queries, listed in
    ``tiles_ptr[1:]`` by :mod:`._tile_list`'s pre-pass; else ``tiles_ptr`` is never read).

    q_desc: TMA descriptor over q ``[total_q, HQ * D]`` (bf16/fp16), box ``[HALF, D]``;
    k_desc / v_desc: over k / v ``[total_k, HQ // G * D]``, box ``[BLOCK_N, D]``;
    o: ``[total_q, HQ, D]`` in q's dtype; lse float32 ``[total_q, HQ]`` (natural log, sink
    included; written when ``HAS_LSE``); sinks float32 ``[HQ]``; cu_q / cu_k int32
    ``[batch + 1]``; ``n_m = cdiv(max_seqlen_q, NUM_WG * HALF)``. Launch with ``num_warps=4``
    (consumer 0) and a grid of at most the number of SMs. ``PINGPONG``: the hand-off that
    makes the ``NUM_WG`` (2 or 3) consumer warpgroups issue their wgmma rounds in turn (off:
    each issues as soon as its data is there); ``EXP2_POLY``, ``RESCALE_THRESHOLD``,
    ``PV_OVERLAP``: see ``Fa3Config``. ``window``: ``window_left`` (a query at position ``p``
    sees keys ``p - window .. p``), read only when ``WINDOW``. ``CLEAN``: the 4-warp blocked
    layout of a consumer warpgroup's share of a V tile (``Fa3Config.clean_layout``), in which
    it zeroes non-finite values on dirty tiles (None: no cleaning; a timing reference only).
    """
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, HALF, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    if CLEAN is not None:  # V cleaning (always, but in fa3_sweep's A/B reference without it)
        clean = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(w), count=1)
        mbarrier.init(q_empty.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    if CLEAN is not None:
        mbarrier.init(clean.index(0), count=NUM_WG)  # one arrival per consumer warpgroup per dirty V tile
    for st in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(st), count=1)
        mbarrier.init(v_ready.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=NUM_WG)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(st), count=NUM_WG)
    fence_async_shared()  # the barrier inits visible to the TMA unit (async proxy)
    # (inline, not a shared helper: its inlined scope adds PTX labels that change ptxas's schedule)
    if CLEAN is not None:
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, clean.index(0))
    else:
        bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, 0)
    if TILE_LIST:
        total = gl.load(tiles_ptr)
    else:
        total = n_m * batch * HQ
    # the consumer warpgroups run the same function on their own rows (WG 0 .. NUM_WG - 1);
    # no page table (0s): the shared pipeline's dense path; the window (a placeholder 0
    # without WINDOW: the argument is then never read)
    win = window if WINDOW else 0
    common = (q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, cu_k_ptr, sm_scale, win, n_m, batch,
              total, tiles_ptr)  # fmt: skip
    prod = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, cu_k_ptr, 0, 0, 0, 0, win, n_m, batch,
            total, tiles_ptr)  # fmt: skip
    if NUM_WG == 2:
        gl.warp_specialize(
            [
                (consumer, (common, 0, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                            NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, False, CLEAN, WINDOW, TILE_LIST)),
                (consumer, (common, 1, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                            NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, False, CLEAN, WINDOW, TILE_LIST)),
                (producer, (prod, HQ, G, D, HALF, BLOCK_N, STAGES, NUM_WG, False, 0, 0, WINDOW, TILE_LIST)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (consumer, (common, 0, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                            NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, False, CLEAN, WINDOW, TILE_LIST)),
                (consumer, (common, 1, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                            NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, False, CLEAN, WINDOW, TILE_LIST)),
                (consumer, (common, 2, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG,
                            NUM_WG, EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, False, CLEAN, WINDOW, TILE_LIST)),
                (producer, (prod, HQ, G, D, HALF, BLOCK_N, STAGES, NUM_WG, False, 0, 0, WINDOW, TILE_LIST)),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
