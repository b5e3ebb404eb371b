"""Gluon paged extend (chunked prefill) for Hopper after FlashAttention-3: the kernel.

New query tokens attend to a paged KV cache that already holds their prefix and themselves
(query ``t`` of sequence ``b`` sits at position ``cache_seqlens[b] - len_q + t``; causal,
optional sliding window, optional sinks). The design and the code are the dense FA3-style
prefill's (:mod:`._gluon_prefill_fa3_kernel`; the producer and consumers of
:mod:`._gluon_fa3_common` with ``PAGED`` on, and so its variants ``EXP2_POLY``,
``RESCALE_THRESHOLD``, ``PV_OVERLAP`` too): persistent grid over per-head work tiles of
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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from tokenspeed_kernel_nvidia.ops.attention._gluon_fa3_common import consumer, producer


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
    tiles_ptr,
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
    NUM_WG: gl.constexpr,
    EXP2_POLY: gl.constexpr,
    RESCALE_THRESHOLD: gl.constexpr,
    PV_OVERLAP: gl.constexpr,
    TILE_LIST: gl.constexpr = False,
):
    """Paged causal extend, persistent over ``n_m * batch * HQ`` work tiles (with
    ``TILE_LIST``: over the ``tiles_ptr[0]`` of them that hold queries, listed in
    ``tiles_ptr[1:]`` by :mod:`._tile_list`'s pre-pass, so that a ragged batch's empty tiles
    take no program's turn; else ``tiles_ptr`` is never read).

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
    ``NUM_WG`` must be 2 (the V cleaning splits a V tile in two halves); ``EXP2_POLY``,
    ``RESCALE_THRESHOLD``, ``PV_OVERLAP``: the dense kernel's variants (see ``Fa3Config``),
    which the shared consumer applies here too.
    """
    gl.static_assert(NUM_WG == 2, "extend_fa3_kernel: two consumer warpgroups (NUM_WG == 2)")
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
    # (inline, not a shared helper: its inlined scope adds PTX labels that change ptxas's schedule)
    bars = (q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn, clean.index(0))
    if TILE_LIST:
        total = gl.load(tiles_ptr)
    else:
        total = n_m * batch * HQ
    common = (q_smem, k_smem, v_smem, bars, o_ptr, lse_ptr, sinks_ptr, cu_q_ptr, seqlens_ptr, sm_scale, window, n_m,
              batch, total, tiles_ptr)  # fmt: skip
    prod = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, bars, cu_q_ptr, seqlens_ptr, table_ptr, table_stride,
            max_pages, num_pages, window, n_m, batch, total, tiles_ptr)  # fmt: skip
    gl.warp_specialize(
        [
            (consumer, (common, 0, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG, NUM_WG,
                        EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, True, CLEAN, False, TILE_LIST)),
            (consumer, (common, 1, HQ, D, HALF, BLOCK_N, STAGES, HAS_SINKS, HAS_LSE, S_MMA, O_MMA, PINGPONG, NUM_WG,
                        EXP2_POLY, RESCALE_THRESHOLD, PV_OVERLAP, True, CLEAN, False, TILE_LIST)),
            (producer, (prod, HQ, G, D, HALF, BLOCK_N, STAGES, NUM_WG, True, PAGE, BOX, False, TILE_LIST)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip
