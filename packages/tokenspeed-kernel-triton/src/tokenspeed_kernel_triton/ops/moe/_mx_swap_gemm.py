"""The grouped MXFP4 expert GEMM with the weight as the MMA's left operand (GPU; tests run it
under the Triton interpreter).

:func:`moe_mx_swap_gemm_kernel` computes the tiles of :func:`._mx_gemm.moe_mx_gemm_kernel`
(``BLOCK_M`` sorted rows of one expert x ``BLOCK_N`` output columns; tiles, rows and epilogue
are the shared helpers of :mod:`._gemm`) as the transposed product: ``acc [BLOCK_N, BLOCK_M]
= W_tile [BLOCK_N, 128] @ A_tile.T`` per K step of 128 values, so the decoded weight is
``tl.dot``'s left operand (Hopper's wgmma reads that one from registers; the activations,
its right operand, come from shared memory), tokens are the MMA's N (16 and up), and the
epilogue stores ``acc.T``. The weight is decoded in registers by integer masks and shifts
and one packed bf16 multiply per two values (no lookup table, no layout conversion): the
plan stores it so that the load already lands in the MMA operand's register layout.

**Weight words** (:func:`.fused_mx_swap.swap_words`), int32 ``[E, S, N, 16]``, ``S =
ceil(K / 128)`` steps (K padded with zero codes): row ``n``'s 64 bytes of step ``s`` as 16
words ``w = 4 q + i`` (``q`` = the thread's lane in its quad, ``i`` = the 32-value group of the
step). Word ``(q, i)`` holds 4 slots ``t = 2 tj + h``, slot ``t`` is the public byte
``b = 8 (2 i + tj) + q + 4 h`` of the step (values ``k = 2 b`` in its low nibble and
``2 b + 1`` in its high nibble): exactly the 8 values that thread ``q`` of a wgmma A
fragment holds for row ``n`` in the K slices ``2 i`` and ``2 i + 1``. Bits of slot ``t``
(a nibble = sign ``s`` and magnitude ``m``, 3 bits; ``L`` low, ``H`` high nibble):

- ``t = 0, 1, 2`` (``d = 3 t``): ``sL`` at bit ``15 - d``, ``mL`` at bits ``8..6`` minus ``d``,
  ``sH`` at ``31 - d``, ``mH`` at ``24..22`` minus ``d``: ``(word << d) & 0x81C081C0`` places
  both values as bf16x2 bit patterns ``sign | m << 6`` (``value * 2**-126``; ``m = 1`` is the
  subnormal ``2**-127``);
- ``t = 3``: ``mL`` bit 2 at 13, bits 1-0 at 11-10, ``sL`` at 14; ``mH`` bit 2 at 29, bits 1-0 at
  27-26, ``sH`` at 30 (three shifts).

**Scale words** (int32 ``[E, S, N]``): the E8M0 scales of step ``s``'s 4 groups, byte ``i`` =
group ``4 s + i`` (padding groups 127). One packed multiply ``mul.rn.bf16x2`` by ``2 ** (e - 1)``
turns a placed pair into its scaled values when every scale is at most 128 (``BIG_SCALES``
off; the plan checks once); otherwise (``BIG_SCALES``) two: by ``2 ** 126``, then by the
scale (byte 0 as the subnormal ``2 ** -127``, 255 as NaN).

Split-K (``SPLIT``): program ``(p, s)`` walks the steps ``[s * step_split, (s + 1) *
step_split)``; the outputs are those of the ``tl.dot_scaled`` kernel (layer 1 raw gate/up
partials for :func:`._mx_gemm.split_finish_kernel`, layer 2 per-split rows).

Under the interpreter (``INTERPRET``) the placed halves are widened to float32 (a bf16 bit
pattern shifted left by 16 is the float32 of the same value) and multiplied there, and the
dot runs in float32; everything else (words, shifts, masks, layout) is the GPU code.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernel_triton.ops.moe._gemm import epilogue, program_tile, tile_block

__all__ = ["STEP_K", "WORDS_PER_ROW", "moe_mx_swap_gemm_kernel", "swap_tile"]

STEP_K = 128  # K values per step (one weight row's 64 bytes, 4 E8M0 groups)
WORDS_PER_ROW = 16  # int32 words per weight row and step

_PLACE = tl.constexpr(0x81C081C0 - (1 << 32))  # both halves' sign bit and magnitude bits 8..6
_SIGNS3 = tl.constexpr(0x80008000 - (1 << 32))  # slot 3: the signs, from bits 14 and 30
_HIGH = tl.constexpr(-(1 << 16))  # 0xFFFF0000: a bf16x2's high half
_BIAS = tl.constexpr(0x7E807E80)  # 2**126 in both halves
_NAN = tl.constexpr(0x7FC0)  # bf16 NaN
_SUBNORMAL = tl.constexpr(0x0040)  # bf16 2**-127


@triton.jit
def _mul_bf16x2(x, m):
    """Packed bf16 product of two int32 tensors of bf16x2 bit patterns (round to nearest)."""
    return tl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x, m], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _multipliers(sw, BIG_SCALES: tl.constexpr):
    """Scale words int32 ``[BN, 1, 1]`` → the bf16x2 multiplier of each group, int32
    ``[BN, 1, 4]``: ``2 ** (e - 1)`` (exponent field ``e + 126``), or with ``BIG_SCALES`` the
    scale ``2 ** (e - 127)`` itself (``e << 7``; 0 → subnormal, 255 → NaN)."""
    even = tl.join(sw & 0xFF, (sw >> 16) & 0xFF)  # groups 0, 2
    odd = tl.join((sw >> 8) & 0xFF, (sw >> 24) & 0xFF)  # groups 1, 3
    e = tl.reshape(tl.join(even, odd), (sw.shape[0], 1, 4))  # [..., j, g & 1] with g = 2 j + (g & 1)
    if BIG_SCALES:
        bits = tl.where(e == 0, _SUBNORMAL, tl.where(e == 255, _NAN, e << 7))
        return bits | (bits << 16)
    return e * 0x00800080 + 126 * 0x00800080


@triton.jit
def _values(placed, m, BIG_SCALES: tl.constexpr, INTERPRET: tl.constexpr):
    """Placed bf16x2 patterns times their multiplier → ``[..., 2]`` (low, high nibble's value):
    bf16 on a GPU, float32 under the interpreter."""
    if INTERPRET:
        lo = (placed << 16).to(tl.float32, bitcast=True)
        hi = (placed & _HIGH).to(tl.float32, bitcast=True)
        if BIG_SCALES:  # 2**126 first: the scale may be as small as 2**-127
            lo = lo * 8.507059173023462e37
            hi = hi * 8.507059173023462e37
        lo = lo * (m << 16).to(tl.float32, bitcast=True)
        hi = hi * (m & _HIGH).to(tl.float32, bitcast=True)
    else:
        if BIG_SCALES:
            placed = _mul_bf16x2(placed, _BIAS)
        r = _mul_bf16x2(placed, m)
        lo = r.to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (r >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _decode(words, sw, BLOCK_N: tl.constexpr, BIG_SCALES: tl.constexpr, INTERPRET: tl.constexpr):
    """One step of ``BLOCK_N`` weight rows: words int32 ``[BLOCK_N, 4, 4]`` (``[n, q, i]``) and
    scale words ``[BLOCK_N, 1, 1]`` → the values ``[BLOCK_N, 128]`` in K order."""
    m = _multipliers(sw, BIG_SCALES)
    s0 = _values(words & _PLACE, m, BIG_SCALES, INTERPRET)
    s1 = _values((words << 3) & _PLACE, m, BIG_SCALES, INTERPRET)
    s2 = _values((words << 6) & _PLACE, m, BIG_SCALES, INTERPRET)
    p3 = ((words >> 4) & 0x00C000C0) | ((words >> 5) & 0x01000100) | ((words << 1) & _SIGNS3)
    s3 = _values(p3, m, BIG_SCALES, INTERPRET)
    x = tl.join(tl.join(s0, s1), tl.join(s2, s3))  # [n, q, i, nibble, h, tj]: slot t = 2 tj + h
    x = tl.permute(x, (0, 2, 5, 4, 1, 3))  # [n, i, tj, h, q, nibble]: k = 32 i + 16 tj + 8 h + 2 q + nibble
    return tl.reshape(x, (BLOCK_N, 128))


@triton.jit
def _step_dot(acc, a_t, w_ptr, s_ptr, w_mask, s_mask, BLOCK_N: tl.constexpr, BIG_SCALES: tl.constexpr,
              INTERPRET: tl.constexpr):  # fmt: skip
    """``acc + W_step @ a_t`` for one step's weight rows (``w_ptr`` ``[BLOCK_N, 4, 4]``,
    ``s_ptr`` ``[BLOCK_N, 1, 1]``)."""
    words = tl.load(w_ptr, mask=w_mask, other=0)
    sw = tl.load(s_ptr, mask=s_mask, other=0x7F7F7F7F)
    w = _decode(words, sw, BLOCK_N, BIG_SCALES, INTERPRET)
    if INTERPRET:
        return tl.dot(w, a_t, acc, input_precision="ieee")
    return tl.dot(w, a_t, acc)


@triton.jit
def swap_tile(
    A, W, S, Bias, Out, TopkWeights, expert, slots, pairs, m_ok, a_rows, offs_n, n_ok,
    N, K, s_lo, s_hi, split,
    stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om, stride_os,
    GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BIG_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
    K_STAGES: tl.constexpr, a_row0=0, A_TMA: tl.constexpr = False,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile of ``expert`` (rows: ``slots``, ``pairs``,
    ``m_ok``, ``a_rows`` of :func:`._gemm.slot_rows`; columns ``offs_n`` / ``n_ok``) over the
    K steps ``[s_lo, s_hi)``, stored: raw gate | up partials at ``split`` (GATED with SPLIT),
    else through :func:`._gemm.epilogue` (bias only in split 0). ``K_STAGES``: the K loop's
    ``tl.range`` pipeline depth (None: the launch's ``num_stages``). ``A_TMA`` (layer 2 only,
    opt-in): ``A`` is a TMA descriptor of the intermediate with ``[BLOCK_M, 128]`` blocks and the
    tile's activations are its rows ``[a_row0, a_row0 + BLOCK_M)`` (contiguous slots; padding
    slots' rows are read as they are and their output rows are not stored; K past the end reads
    zeros). Arguments as :func:`moe_mx_swap_gemm_kernel`'s."""
    rows = offs_n.to(tl.int64)
    word = tl.arange(0, 4)[:, None] * 4 + tl.arange(0, 4)[None, :]  # [q, i] → 4 q + i
    w_ptr = W + expert * stride_we + (rows * 16)[:, None, None] + word[None, :, :]
    s_ptr = S + expert * stride_se + rows[:, None, None]
    w_mask = n_ok[:, None, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in tl.range(s_lo, s_hi, num_stages=K_STAGES):
        if A_TMA:
            a = A.load([a_row0, step * 128])
        else:
            offs_k = step * 128 + tl.arange(0, 128)
            a = tl.load(A + a_rows[:, None] + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
        a_t = tl.trans(a)
        w_step = w_ptr + step * stride_ws
        s_step = s_ptr + step * stride_ss
        acc = _step_dot(acc, a_t, w_step, s_step, w_mask, w_mask, BLOCK_N, BIG_SCALES, INTERPRET)
        if GATED:
            acc_up = _step_dot(acc_up, a_t, w_step + N * 16, s_step + N, w_mask, w_mask, BLOCK_N, BIG_SCALES, INTERPRET)
    out = tl.trans(acc)
    if GATED and SPLIT:  # raw partial sums: split_finish_kernel adds the bias, applies the activation
        up = tl.trans(acc_up)
        out_ptr = Out + split * stride_os + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        tl.store(out_ptr, out, mask=mask)
        tl.store(out_ptr + N, up, mask=mask)
    else:
        if GATED:
            up = tl.trans(acc_up)
        else:
            up = out
        epilogue(
            out,
            up,
            Bias,
            Out + split * stride_os,
            TopkWeights,
            expert,
            offs_n,
            n_ok,
            n_ok & (split == 0),
            slots,
            pairs,
            m_ok,
            N,
            stride_be,
            stride_om,
            GATED,
            ACTIVATION,
            HAS_BIAS,
        )


@triton.jit
def moe_mx_swap_gemm_kernel(
    A, W, S, Bias, Out, SortedIds, TileExpert, NumTiles, TopkWeights,
    num_pairs, N, K, tiles_bound, step_split,
    stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om, stride_os,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr,
    BIG_SCALES: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Program ``(tile x column block, split)``: one ``[BLOCK_M, BLOCK_N]`` output tile of one
    expert over the split's steps (see the module docstring).

    A: bf16, x ``[T, K]`` gathered by pair (GATED) or the intermediate ``[rows, K]`` (row stride
    ``stride_am``). W: int32 words ``[E, S, rows, 16]`` (rows ``2N`` for w13: gate ``n``, up
    ``N + n``; strides ``stride_we``, ``stride_ws``, row stride 16); S: int32 scale words
    ``[E, S, rows]`` (strides ``stride_se``, ``stride_ss``, row stride 1). Out and the epilogue:
    as :func:`._mx_gemm.moe_mx_gemm_kernel` (GATED: the intermediate ``[tiles_bound * BLOCK_M,
    N]`` at sorted rows, or with SPLIT float32 raw partials ``[S, rows, 2N]``; else float32
    ``[S, P, N]`` at pair rows times the routing weight)."""
    pid_m, pid_n, used = program_tile(NumTiles, N, tiles_bound, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    if not used:
        return
    expert, slots, pairs, m_ok, a_rows, offs_n, n_ok = tile_block(
        SortedIds, TileExpert, pid_m, pid_n, num_pairs, N, stride_am, TOP_K, GATED, BLOCK_M, BLOCK_N
    )
    steps = tl.cdiv(K, 128)
    if SPLIT:
        s_lo = split * step_split
        s_hi = tl.minimum(s_lo + step_split, steps)
    else:
        s_lo = 0
        s_hi = steps
    swap_tile(
        A, W, S, Bias, Out, TopkWeights, expert, slots, pairs, m_ok, a_rows, offs_n, n_ok,
        N, K, s_lo, s_hi, split,
        stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om, stride_os,
        GATED, ACTIVATION, HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT, BIG_SCALES, INTERPRET, None,
    )  # fmt: skip
