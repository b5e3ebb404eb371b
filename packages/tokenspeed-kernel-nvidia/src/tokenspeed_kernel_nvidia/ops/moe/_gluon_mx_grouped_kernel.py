"""PROTOTYPE (not registered): the MoE's layer-2 grouped GEMM with MXFP4 weights on Hopper,
warp-specialized in Gluon (issue 21: the T = 4096 prefill, 363 -> ~415 TFLOP/s).

``out[pair(row), n] = sum_k X[row, k] * W2[e, n, k]`` for every work item (128-row tile of
one expert's sorted intermediate rows x 128 weight rows), computed transposed as the Triton
swapped kernel does (:mod:`tokenspeed_kernel_triton.ops.moe._mx_swap_gemm`): ``acc[n, row] +=
W[n, k] · X[row, k]ᵀ`` with the decoded weight as wgmma's register A operand and the
activation tile as its shared-memory B operand (K-major, the ``permute`` view of the TMA box).

Design (what differs from the Triton kernel: the decode no longer sits in the MMA issuer's
instruction stream alone; two warpgroups alternate):

- **Work list**: items ``tile * num_n + nb`` over ``num_tiles[0] * ceil(N / 128)``, program
  ``pid`` takes ``pid, pid + grid, ...`` (static; the n-blocks of one activation tile are
  neighbours, so the tile stays in L2, and one expert's tiles are neighbours, so its 4 MB of
  words do too).
- **Producer** (1 warp, ``PRODUCER_REGS`` after ``setmaxnreg``): per K step of 128 values,
  three TMA copies into ring slot ``it % STAGES`` on one ``ready`` barrier (transaction
  count): the activation box ``[128 rows, 128 k]`` bf16 (32 KB, 128-byte swizzle), the weight
  words ``[128 rows, 16]`` int32 (8 KB, the prepared ``[E, S, N, 16]`` words seen as
  ``[E * S * N, 16]``: no repack, the 64-byte rows are TMA-legal as they are) and the scale
  words ``[1, 128]`` int32 (the prepared ``[E, S, N]`` seen as ``[E * S, N]``). K past the
  end reads zeros (TMA fill); weight rows past ``N`` of an expert read the next step's rows
  (finite, never stored); the ring slot is freed by an ``empty`` barrier that both consumer
  warpgroups arrive on.
- **Consumers** (2 warpgroups, ``CONSUMER_REGS`` each): warpgroup ``w`` owns weight rows
  ``[64 w, 64 w + 64)`` of the item (one ``m64`` wgmma row block, ``n = 128`` tokens): per step
  it loads its 64 rows' words (two 16-byte shared loads per thread, conflict-free: a warp
  reads 512 contiguous bytes) and scale words, decodes them (masks, shifts, one
  ``mul.rn.bf16x2`` per pair: the Triton kernel's bit plan) straight into the
  ``DotOperandLayout`` of wgmma's A (the linear layout of the words is chosen so that the
  join/permute/reshape of the decode is a register renaming; see :data:`WORD_BASES`), and
  issues ``wgmma`` asynchronously; ``warpgroup_mma_wait(1)`` keeps one step's MMA in flight
  while the next step decodes, then frees the previous slot. ``PINGPONG``: the two
  warpgroups hand an mbarrier turn back and forth around each issue (FA3's scheme,
  :func:`._gluon_fa3_common._wait_turn`), so one decodes while the other's MMAs run.
- **Epilogue**: the fp32 accumulator ``[64 n, 128 rows]`` stored straight from the MMA layout
  to ``out[pair, n]`` (pairs from ``sorted_ids``; padding slots and ``n >= N`` masked). No
  routing weight, no bias: the combine applies them.

Ring depth ``STAGES`` (default 4): 40.5 KB per stage (32 KB activations + 8 KB words + 512
B scales), 162 KB for 4 (5 = 203 KB also fits in the H200's 227 KB).

Register budget (``maxnreg`` 168 at launch for 3 warpgroups = 504 per thread-slot): consumers
240 each (accumulator 64, two steps' A fragments 2 x 32, words 8, scales and addresses), the
producer 24: ``2 x 240 + 24 <= 3 x 168``.

What the lead should look at first on a GPU: (1) the ``moe_grouped`` AOT row (spills, the
consumer's SASS for ``STS``/``LDS`` beyond the word and scale loads: a non-trivial
``convert_layout`` of the decoded tile would show up there); (2) correctness on the awkward
expert sizes (``tests/tokenspeed_kernel_nvidia/test_gluon_mx_grouped.py``); (3) time against
the shipped layer 2 at T = 4096 (``ci/device/mxp_sweep.py --gluon-w2``), then ``STAGES``,
``PINGPONG`` off/on and the epilogue (a transposed store through shared memory or TMA store
is the next lever if the uncoalesced 32-byte stores show in the profile).
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

__all__ = [
    "BLOCK_M",
    "BLOCK_N",
    "HALF_N",
    "STEP_K",
    "WORD_BASES",
    "a_layout",
    "acc_layout",
    "mx_grouped_w2_kernel",
    "word_layout",
]

BLOCK_M = 128  # activation rows (tokens) per work item: wgmma's N
BLOCK_N = 128  # weight rows per work item: two m64 row blocks, one per consumer warpgroup
HALF_N = 64  # weight rows per consumer warpgroup
STEP_K = 128  # K values per step (one weight row's 16 words)

# The consumer's words [64 rows, 4 q, 4 i] (word 4 q + i of a row): thread (warp wp, lane
# 4 g + q) holds rows 16 wp + g and + 8, words 4 q .. 4 q + 3: the rows and K quads of
# wgmma's A fragment (m64 k16, k_width 2). Bases as (row, q, i) offsets.
WORD_BASES = {
    "reg": [[0, 0, 1], [0, 0, 2], [8, 0, 0]],
    "lane": [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    "warp": [[16, 0, 0], [32, 0, 0]],
}

_PLACE = gl.constexpr(0x81C081C0 - (1 << 32))  # both halves' sign bit and magnitude bits 8..6
_SIGNS3 = gl.constexpr(0x80008000 - (1 << 32))  # slot 3: the signs, from bits 14 and 30
_BIAS = gl.constexpr(0x7E807E80)  # 2**126 in both halves
_NAN = gl.constexpr(0x7FC0)  # bf16 NaN
_SUBNORMAL = gl.constexpr(0x0040)  # bf16 2**-127


def word_layout() -> gl.DistributedLinearLayout:
    """:data:`WORD_BASES` as the Gluon layout of a consumer's words ``[64, 4, 4]``."""
    return gl.DistributedLinearLayout(
        reg_bases=WORD_BASES["reg"],
        lane_bases=WORD_BASES["lane"],
        warp_bases=WORD_BASES["warp"],
        block_bases=[],
        shape=[HALF_N, 4, 4],
    )


def acc_layout() -> gl.NVMMADistributedLayout:
    """The consumer's fp32 accumulator ``[64, BLOCK_M]`` (wgmma v3, 4 warps stacked on rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])


def a_layout() -> gl.DotOperandLayout:
    """wgmma's register A operand ``[64, STEP_K]`` bf16 over :func:`acc_layout`."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_layout(), k_width=2)


@gluon.jit
def _mul_bf16x2(x, m):
    """Packed bf16 product of two int32 tensors of bf16x2 bit patterns (round to nearest)."""
    return gl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x, m], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _values(placed, m, BIG_SCALES: gl.constexpr):
    """Placed bf16x2 patterns times their multiplier -> ``[..., 2]`` bf16 (low, high nibble)."""
    if BIG_SCALES:
        placed = _mul_bf16x2(placed, _BIAS)
    r = _mul_bf16x2(placed, m)
    lo = r.to(gl.int16).to(gl.bfloat16, bitcast=True)
    hi = (r >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.join(lo, hi)


@gluon.jit
def _decode(words, sw, WL: gl.constexpr, AL: gl.constexpr, BIG_SCALES: gl.constexpr):
    """Words int32 ``[64, 4 q, 4 i]`` (layout ``WL``) and scale words int32 ``[64]`` -> the
    step's weight values bf16 ``[64, 128]`` in K order, layout ``AL`` (wgmma's A)."""
    gi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, WL)))
    shift = gl.expand_dims(gl.expand_dims(gi * 8, 0), 0)  # [1, 1, 4]: group i's byte
    sw3 = gl.expand_dims(gl.expand_dims(sw, 1), 2)  # [64, 1, 1]
    e = (sw3 >> shift) & 0xFF  # [64, 1, 4]
    if BIG_SCALES:
        bits = gl.where(e == 0, _SUBNORMAL, gl.where(e == 255, _NAN, e << 7))
        m = bits | (bits << 16)
    else:
        m = e * 0x00800080 + 126 * 0x00800080
    s0 = _values(words & _PLACE, m, BIG_SCALES)
    s1 = _values((words << 3) & _PLACE, m, BIG_SCALES)
    s2 = _values((words << 6) & _PLACE, m, BIG_SCALES)
    p3 = ((words >> 4) & 0x00C000C0) | ((words >> 5) & 0x01000100) | ((words << 1) & _SIGNS3)
    s3 = _values(p3, m, BIG_SCALES)
    x = gl.join(gl.join(s0, s1), gl.join(s2, s3))  # [n, q, i, nibble, h, tj]: slot t = 2 tj + h
    x = gl.permute(x, (0, 2, 5, 4, 1, 3))  # [n, i, tj, h, q, nibble]: k = 32 i + 16 tj + 8 h + 2 q + nibble
    return gl.convert_layout(gl.reshape(x, (64, 128)), AL)


@gluon.jit
def _producer(args, STAGES: gl.constexpr):
    """One warp: the TMA copies of every step of every item of this program (see the module
    docstring). ``args``: the kernel's runtime arguments and buffers, one tuple."""
    x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, _turn, _out, _ids, tile_expert_ptr, \
        num_tiles_ptr, _num_pairs, N, steps = args  # fmt: skip
    num_n = gl.cdiv(N, 128)
    total = gl.load(num_tiles_ptr) * num_n
    NBYTES: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
    it = 0
    for item in range(gl.program_id(0), total, gl.num_programs(0)):
        tile = item // num_n
        nb = item - tile * num_n
        expert = gl.load(tile_expert_ptr + tile)
        w_row = expert * steps * N + nb * 128
        for s in range(steps):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, NBYTES)
            tma.async_copy_global_to_shared(x_desc, [tile * 128, s * 128], bar, x_smem.index(slot))
            tma.async_copy_global_to_shared(w_desc, [w_row + s * N, 0], bar, w_smem.index(slot))
            tma.async_copy_global_to_shared(s_desc, [expert * steps + s, nb * 128], bar, s_smem.index(slot))
            it += 1


@gluon.jit
def _consumer(
    args,
    WG: gl.constexpr,
    STAGES: gl.constexpr,
    WL: gl.constexpr,
    AL: gl.constexpr,
    ACC: gl.constexpr,
    BIG_SCALES: gl.constexpr,
    PINGPONG: gl.constexpr,
):
    """Warpgroup ``WG``: weight rows ``[64 WG, + 64)`` of every item (see the module docstring)."""
    _x_desc, _w_desc, _s_desc, x_smem, w_smem, s_smem, ready, empty, turn, out_ptr, ids_ptr, _tile_expert_ptr, \
        num_tiles_ptr, num_pairs, N, steps = args  # fmt: skip
    num_n = gl.cdiv(N, 128)
    total = gl.load(num_tiles_ptr) * num_n
    SL: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, WL))
    rows = gl.arange(0, 64, layout=gl.SliceLayout(1, ACC))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, ACC))
    zero = gl.zeros([64, 128], gl.float32, layout=ACC)
    it = 0
    rnd = 0
    for item in range(gl.program_id(0), total, gl.num_programs(0)):
        tile = item // num_n
        nb = item - tile * num_n
        acc = zero
        a_prev = gl.zeros([64, 128], gl.bfloat16, layout=AL)
        for s in range(steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            words = w_smem.index(slot).reshape([128, 4, 4]).slice(64 * WG, 64).load(WL)
            sw = s_smem.index(slot).reshape([128]).slice(64 * WG, 64).load(SL)
            a = _decode(words, sw, WL, AL, BIG_SCALES)
            if PINGPONG:
                if WG == 0:
                    mbarrier.wait(turn.index(0), (rnd & 1) ^ 1)
                else:
                    mbarrier.wait(turn.index(WG), rnd & 1)
            acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, use_acc=s > 0, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index((WG + 1) % 2), count=1)
            rnd += 1
            # one step in flight: the previous step's MMA (and its A registers, its slot) is done
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])
            a_prev = a
            if s > 0:
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
            it += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        # epilogue: rows n of the weight, columns the tile's slots -> out[pair, n]
        pairs = gl.load(ids_ptr + tile * 128 + cols)
        n = nb * 128 + 64 * WG + rows
        ptrs = out_ptr + gl.expand_dims(pairs.to(gl.int64) * N, 0) + gl.expand_dims(n, 1)
        mask = gl.expand_dims(pairs < num_pairs, 0) & gl.expand_dims(n < N, 1)
        gl.store(ptrs, acc, mask=mask)


@gluon.jit(do_not_specialize=["num_pairs", "steps"])
def mx_grouped_w2_kernel(
    x_desc,
    w_desc,
    s_desc,
    out_ptr,
    ids_ptr,
    tile_expert_ptr,
    num_tiles_ptr,
    num_pairs,
    N,
    steps,
    STAGES: gl.constexpr,
    WL: gl.constexpr,
    AL: gl.constexpr,
    ACC: gl.constexpr,
    BIG_SCALES: gl.constexpr,
    PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """Persistent layer-2 grouped GEMM (module docstring). Launch with ``num_warps=4``
    (consumer 0), ``maxnreg`` (``3 * maxnreg >= 2 * CONSUMER_REGS + PRODUCER_REGS``) and at
    most one program per SM.

    x_desc: TMA descriptor over the sorted intermediate bf16 ``[tiles_bound * 128, K]`` (tile
    ``t``'s rows ``[128 t, 128 t + 128)``), box ``[128, 128]``; w_desc: over the prepared words
    int32 ``[E * S * N, 16]``, box ``[128, 16]``; s_desc: over the prepared scale words int32
    ``[E * S, N]``, box ``[1, 128]``. out: float32 ``[num_pairs, N]`` (pair rows, unweighted);
    ids: sorted pair ids int32 ``[tiles_bound * 128]`` (padding ``>= num_pairs``); tile_expert
    int32 ``[tiles_bound]``; num_tiles int32 ``[1]``; ``steps = S = ceil(K / 128)``."""
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 128, 128], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 128, 16], w_desc.layout)
    s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 1, 128], s_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for st in gl.static_range(STAGES):
        mbarrier.init(ready.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)  # one arrival per consumer warpgroup
    for w in gl.static_range(2):
        mbarrier.init(turn.index(w), count=1)
    fence_async_shared()
    args = (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, turn, out_ptr, ids_ptr, tile_expert_ptr,
            num_tiles_ptr, num_pairs, N, steps)  # fmt: skip
    gl.warp_specialize(
        [
            (_consumer, (args, 0, STAGES, WL, AL, ACC, BIG_SCALES, PINGPONG)),
            (_consumer, (args, 1, STAGES, WL, AL, ACC, BIG_SCALES, PINGPONG)),
            (_producer, (args, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
