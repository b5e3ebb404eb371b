"""The grouped expert GEMM (both layers) and the combine, as Triton kernels.

:func:`moe_gemm_kernel` multiplies the permuted rows of one ``BLOCK_M`` tile, all routed to
one local expert (see :mod:`._routing`), by that expert's weight, ``BLOCK_N`` output
columns per program:

- layer 1 (``GATED``): rows gathered from ``x`` (row ``pair // TOP_K``), two accumulators for
  the gate rows ``[n, n + BLOCK_N)`` and the up rows ``I + [n, n + BLOCK_N)`` of ``w13``; the
  epilogue adds the bias, applies the activation and stores the tile at its permuted rows of
  the intermediate ``[tiles * BLOCK_M, I]`` (x's dtype).
- layer 2: rows read in place from the intermediate; the epilogue adds the bias, multiplies
  by the routing weight and stores float32 rows ``y[pair]`` of ``[P, H]``.

:func:`combine_kernel` then sums each token's ``top_k`` rows in a fixed order (deterministic;
no atomics) into ``out``. The alternative (``ATOMIC``, the driver's ``combine="atomic"``)
fuses the combine into the layer-2 epilogue: each weighted tile is ``tl.atomic_add``-ed
(relaxed) into a float32 ``[T, H]`` buffer at row ``pair // TOP_K``; the sum order of a
token's ``top_k`` rows then varies from run to run (not bit-reproducible on a GPU).

Weight formats (``FORMAT``), all dequantized in registers inside the K loop, the MMA run in
x's dtype with float32 accumulation (weight-only quantization; activations are not quantized):

- ``PLAIN`` (0): x's dtype.
- ``FP8_ROW`` (1): float8_e4m3fn with one float32 scale per output row (per-channel, or
  per-tensor with a zero row stride); the scale multiplies the accumulator in the epilogue.
- ``FP8_BLOCK`` (2): 128x128 scale blocks; each K step (``BLOCK_K`` divides 128) lies in one
  block column, so the step's partial product is scaled by its row of block scales.
- ``MXFP4`` (3): K is walked in groups of 64 values (32 bytes per weight row). With bf16
  activations each nibble and its E8M0 scale are turned into a bf16 bit pattern by integer
  arithmetic alone (:func:`_mx_decode`); fp16/fp32 decode through float32. The low and high
  nibbles feed two MMAs of K = 32: with the planned "halves" byte order (``MX_HALVES``) they
  hold K columns ``[0, 32)`` and ``[32, 64)`` of the group and the activation tiles are
  contiguous; with the standard order (even/odd values) the activation tiles are read with
  stride 2. The standard byte scales ``[E, N, K/32]`` are loaded one byte per row and group
  (too narrow to be pipelined); the planned ``MX_WORDS`` layout packs the 4 scales of a row
  for one 128-value K step into an int32 word (``[E, K/128, N]``), a pipelined load.

Under the interpreter (``INTERPRET``) both operands of ``tl.dot`` are up-cast to float32:
the interpreter carries bf16 as raw 16-bit integers and its ``tl.dot`` on them is wrong.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "FP8_BLOCK",
    "FP8_ROW",
    "MXFP4",
    "PLAIN",
    "activate",
    "combine_kernel",
    "epilogue",
    "moe_gemm_kernel",
    "program_tile",
    "slot_rows",
    "tile_block",
    "tile_coords",
    "tile_rows",
]

PLAIN, FP8_ROW, FP8_BLOCK, MXFP4 = 0, 1, 2, 3


@triton.jit
def _e2m1(code):
    """int32 E2M1 codes (0..15) → float32 values: sign bit 3, exponent bits 2-1, mantissa bit 0."""
    mag = code & 7
    # Normal codes (exponent >= 1): float32 exponent field e + 126, top mantissa bit m.
    bits = (mag << 22) + (126 << 23)
    value = tl.where(mag < 2, mag.to(tl.float32) * 0.5, bits.to(tl.float32, bitcast=True))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _mx_decode(code, s, BF16: tl.constexpr):
    """E2M1 codes (int32 0..15) times ``2 ** (s - 127)`` (E8M0 ``s``, int32, broadcastable).

    BF16: the bf16 bit pattern is built directly (no float math): a normal code (exponent
    e >= 1, mantissa m) scaled by 2**(s-127) has bf16 exponent field ``e + s - 1`` and top
    mantissa bit m, i.e. ``(code & 7) << 6`` plus ``(s - 1) << 7``; code 1 (0.5) is ``(s - 1) << 7``
    and code 0 is zero. ``s == 0`` (2**-127) flushes to zero, ``s == 255`` gives NaN.
    Otherwise float32 values (fp16 / fp32 activations)."""
    if BF16:
        mag = code & 7
        base = (s - 1) << 7
        bits = tl.where(mag >= 2, (mag << 6) + base, tl.where(mag == 1, base, 0)) | ((code & 8) << 12)
        bits = tl.where(s == 0, 0, tl.where(s == 255, 0x7FC0, bits))
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        scale = tl.where(s == 255, float("nan"), (s << 23).to(tl.float32, bitcast=True))
        return _e2m1(code) * scale


@triton.jit
def _mx_load_a(A, a_rows, m_ok, kg, K, HALVES: tl.constexpr, EVEN: tl.constexpr, INTERPRET: tl.constexpr):
    """The two 32-column A tiles matching the low and high nibbles of one 64-value K group:
    ``[kg, kg + 32)`` and ``[kg + 32, kg + 64)`` (HALVES), else the even and odd columns."""
    j = tl.arange(0, 32)
    if HALVES:
        k_lo = kg + j
        k_hi = k_lo + 32
    else:
        k_lo = kg + 2 * j
        k_hi = k_lo + 1
    if EVEN:
        a_lo = tl.load(A + a_rows[:, None] + k_lo[None, :], mask=m_ok[:, None], other=0.0)
        a_hi = tl.load(A + a_rows[:, None] + k_hi[None, :], mask=m_ok[:, None], other=0.0)
    else:
        a_lo = tl.load(A + a_rows[:, None] + k_lo[None, :], mask=m_ok[:, None] & (k_lo[None, :] < K), other=0.0)
        a_hi = tl.load(A + a_rows[:, None] + k_hi[None, :], mask=m_ok[:, None] & (k_hi[None, :] < K), other=0.0)
    if INTERPRET:
        a_lo = a_lo.to(tl.float32)
        a_hi = a_hi.to(tl.float32)
    return a_lo, a_hi


@triton.jit
def _mx_scales(S, expert, rows, row_ok, kg, K, stride_se, stride_sn, stride_sk, EVEN: tl.constexpr):
    """The two E8M0 scales (int32 ``[BLOCK_N]``) of the 64-value group at ``kg``, from byte
    scales ``[E, N, K/32]`` (any strides). One byte per row: these loads are not pipelined."""
    s_ptr = S + expert * stride_se + rows.to(tl.int64) * stride_sn + (kg // 32) * stride_sk
    if EVEN:
        s0 = tl.load(s_ptr, mask=row_ok, other=127).to(tl.int32)
        s1 = tl.load(s_ptr + stride_sk, mask=row_ok, other=127).to(tl.int32)
    else:
        s0 = tl.load(s_ptr, mask=row_ok & (kg // 32 < K // 32), other=127).to(tl.int32)
        s1 = tl.load(s_ptr + stride_sk, mask=row_ok & (kg // 32 + 1 < K // 32), other=127).to(tl.int32)
    return s0, s1


@triton.jit
def _mx_dot(
    acc, a_lo, a_hi, W, s0, s1, expert, rows, row_ok, kg, K, stride_we, stride_wn, stride_wk,
    HALVES: tl.constexpr, EVEN: tl.constexpr, BF16: tl.constexpr, INTERPRET: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """``acc`` plus one 64-value K group of MXFP4 weight rows ``rows``: 32 packed bytes per
    row decoded in registers with the group's two scales ``s0``/``s1`` (int32 ``[BLOCK_N]``),
    two MMAs of K = 32."""
    j = tl.arange(0, 32)
    byte = kg // 2 + j
    w_ptr = W + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn + byte[None, :] * stride_wk
    if EVEN:
        packed = tl.load(w_ptr, mask=row_ok[:, None], other=0).to(tl.int32)
    else:
        packed = tl.load(w_ptr, mask=row_ok[:, None] & (byte[None, :] < K // 2), other=0).to(tl.int32)
    if HALVES:
        s_lo = s0[:, None]
        s_hi = s1[:, None]
    else:
        s_lo = tl.where(j[None, :] < 16, s0[:, None], s1[:, None])
        s_hi = s_lo
    w_lo = _mx_decode(packed & 15, s_lo, BF16)
    w_hi = _mx_decode(packed >> 4, s_hi, BF16)
    if INTERPRET:
        w_lo = w_lo.to(tl.float32)
        w_hi = w_hi.to(tl.float32)
    else:
        w_lo = w_lo.to(a_lo.dtype)
        w_hi = w_hi.to(a_lo.dtype)
    acc = tl.dot(a_lo, tl.trans(w_lo), acc, input_precision=DOT_PREC)
    return tl.dot(a_hi, tl.trans(w_hi), acc, input_precision=DOT_PREC)


@triton.jit
def _load_weight(
    W, S, expert, rows, row_ok, k0, K,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """A ``[BLOCK_N, BLOCK_K]`` weight tile (x's dtype or fp8, as stored) of rows ``rows`` and
    columns ``[k0, k0 + BLOCK_K)``."""
    w_base = W + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None]
    if not EVEN_K:
        mask = mask & (offs_k[None, :] < K)
    return tl.load(w_base + offs_k[None, :] * stride_wk, mask=mask, other=0.0)


@triton.jit
def _dot_step(acc, a, w, S, expert, rows, row_ok, k0, stride_se, stride_sn, stride_sk, a_s,
              FORMAT: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr,
              A_FP8: tl.constexpr):  # fmt: skip
    """``acc + a @ w.T`` (with the K step's block scales for FP8_BLOCK, times the activation
    scales ``a_s`` ``[BLOCK_M]`` of the step's K group when ``A_FP8``)."""
    if INTERPRET:
        w = w.to(tl.float32)
    else:
        w = w.to(a.dtype)
    if FORMAT == 2:
        s_ptr = S + expert * stride_se + (rows // 128).to(tl.int64) * stride_sn + (k0 // 128) * stride_sk
        s = tl.load(s_ptr, mask=row_ok, other=0.0)
        if A_FP8:
            return acc + tl.dot(a, tl.trans(w), input_precision=DOT_PREC) * (a_s[:, None] * s[None, :])
        return acc + tl.dot(a, tl.trans(w), input_precision=DOT_PREC) * s[None, :]
    else:
        return tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)


@triton.jit
def _row_scale(acc, S, expert, rows, row_ok, stride_se, stride_sn, FORMAT: tl.constexpr):
    if FORMAT == 1:
        s = tl.load(S + expert * stride_se + rows.to(tl.int64) * stride_sn, mask=row_ok, other=0.0)
        acc = acc * s[None, :]
    return acc


@triton.jit
def tile_coords(pid, N, tiles_bound, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile, column block) of program ``pid``: ``GROUP_M`` consecutive tiles walk the column
    blocks together, so a weight tile is reused from L2 by the tiles of one expert."""
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    rows_in_group = tl.minimum(tiles_bound - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % rows_in_group
    pid_n = (pid % group) // rows_in_group
    return pid_m, pid_n


@triton.jit
def tile_rows(SortedIds, TileExpert, pid_m, num_pairs, stride_am, TOP_K: tl.constexpr, GATED: tl.constexpr,
              BLOCK_M: tl.constexpr):  # fmt: skip
    """The rows of tile ``pid_m`` (a used tile): its expert (int64), its slots (positions in
    the sorted order, int32 ``[BLOCK_M]``), their pair ids (``num_pairs`` on padding slots),
    the row mask, and the A row offsets (int64, elements): x's row ``pair // TOP_K`` for
    layer 1 (GATED), the intermediate's row ``slot`` for layer 2."""
    expert = tl.load(TileExpert + pid_m).to(tl.int64)
    slots, pairs, m_ok, a_rows = slot_rows(SortedIds, pid_m * BLOCK_M, num_pairs, stride_am, TOP_K, GATED, BLOCK_M)
    return expert, slots, pairs, m_ok, a_rows


@triton.jit
def slot_rows(SortedIds, first_slot, num_pairs, stride_am, TOP_K: tl.constexpr, GATED: tl.constexpr,
              ROWS: tl.constexpr):  # fmt: skip
    """The ``ROWS`` sorted slots from ``first_slot`` (int32 ``[ROWS]``), their pair ids
    (``num_pairs`` on padding slots), the row mask, and the A row offsets (int64, elements):
    x's row ``pair // TOP_K`` for layer 1 (GATED), the intermediate's row ``slot`` for layer 2."""
    slots = first_slot + tl.arange(0, ROWS)
    pairs = tl.load(SortedIds + slots)
    m_ok = pairs < num_pairs
    if GATED:
        a_rows = (pairs // TOP_K).to(tl.int64) * stride_am
    else:
        a_rows = slots.to(tl.int64) * stride_am
    return slots, pairs, m_ok, a_rows


@triton.jit
def program_tile(NumTiles, N, tiles_bound, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n, used)`` of this program (axis 0, :func:`tile_coords`): ``used`` is
    False past the tiles in use (``NumTiles``: the program returns at once)."""
    pid_m, pid_n = tile_coords(tl.program_id(0), N, tiles_bound, BLOCK_N, GROUP_M)
    return pid_m, pid_n, pid_m < tl.load(NumTiles)


@triton.jit
def tile_block(SortedIds, TileExpert, pid_m, pid_n, num_pairs, N, stride_am, TOP_K: tl.constexpr,
               GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """:func:`tile_rows` of tile ``pid_m`` and the output columns of column block ``pid_n``:
    ``(expert, slots, pairs, m_ok, a_rows, offs_n, n_ok)``, ``offs_n`` int32 ``[BLOCK_N]`` and
    ``n_ok = offs_n < N``."""
    expert, slots, pairs, m_ok, a_rows = tile_rows(
        SortedIds, TileExpert, pid_m, num_pairs, stride_am, TOP_K, GATED, BLOCK_M
    )
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, slots, pairs, m_ok, a_rows, offs_n, offs_n < N


@triton.jit
def activate(gate, up, ACTIVATION: tl.constexpr):
    """``act(gate) * up`` in float32: silu (0), erf-gelu (1), or swiglu_oai (2: gate clamped
    to <= 7, up to [-7, 7], ``gate * sigmoid(1.702 gate) * (up + 1)``)."""
    if ACTIVATION == 0:  # silu
        act = gate / (1.0 + tl.exp(-gate)) * up
    elif ACTIVATION == 1:  # gelu (erf)
        act = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    else:  # swiglu_oai
        gate = tl.minimum(gate, 7.0)
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        act = gate / (1.0 + tl.exp(-1.702 * gate)) * (up + 1.0)
    return act


@triton.jit
def epilogue(
    acc, acc_up, Bias, Out, TopkWeights, expert, offs_n, n_ok, bias_mask, slots, pairs, m_ok, N,
    stride_be, stride_om, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """Finish a float32 ``[BLOCK_M, BLOCK_N]`` tile of columns ``offs_n`` and store it.

    GATED: ``acc``/``acc_up`` are the gate and up products; the bias (``Bias[expert, n]`` and
    ``Bias[expert, N + n]`` where ``bias_mask``) is added, the activation applied, and the tile
    stored in Out's dtype at rows ``slots`` (the intermediate). Otherwise ``acc`` (``acc_up``
    unused) gets the bias, is multiplied by ``TopkWeights[pair]`` and stored (float32) at rows
    ``pairs``. Rows outside ``m_ok`` and columns outside ``n_ok`` are not stored."""
    if HAS_BIAS:
        acc += tl.load(Bias + expert * stride_be + offs_n, mask=bias_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        up = acc_up
        if HAS_BIAS:
            up += tl.load(Bias + expert * stride_be + (offs_n + N), mask=bias_mask, other=0.0).to(tl.float32)[None, :]
        act = activate(acc, up, ACTIVATION)
        out_ptr = Out + slots[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptr, act.to(Out.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        weight = tl.load(TopkWeights + pairs, mask=m_ok, other=0.0)
        out_ptr = Out + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptr, acc * weight[:, None], mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_gemm_kernel(
    A, W, S, Bias, Out, SortedIds, TileExpert, NumTiles, TopkWeights, AS,
    num_pairs, N, K, tiles_bound,
    stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_om,
    stride_asm, stride_ask,
    TOP_K: tl.constexpr, FORMAT: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INTERPRET: tl.constexpr, DOT_PREC: tl.constexpr,
    MX_HALVES: tl.constexpr, MX_BF16: tl.constexpr, MX_WORDS: tl.constexpr, ATOMIC: tl.constexpr,
    A_FP8: tl.constexpr,
):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` output tile of one expert (see the module docstring).

    GATED: A = x ``[T, K]`` gathered by pair, W = w13 ``[E, 2N, K]`` (logical), Out = the
    intermediate ``[tiles_bound * BLOCK_M, N]`` at permuted rows. Otherwise: A = the
    intermediate, W = w2 ``[E, N, K]``, Out = float32 ``[P, N]`` at pair rows, times
    ``TopkWeights[pair]``. ``ATOMIC`` (layer 2 only): the fused combine, Out = float32
    ``[T, N]`` (zeroed by the host) and the weighted tile is atomically added at rows
    ``pair // TOP_K`` instead of stored at rows ``pair``. ``A_FP8``: A is fp8 with float32
    scales ``AS`` (row stride ``stride_asm``, K-group stride ``stride_ask``; FP8 formats only).
    """
    pid_m, pid_n, used = program_tile(NumTiles, N, tiles_bound, BLOCK_N, GROUP_M)
    if not used:
        return
    expert, slots, pairs, m_ok, a_rows, offs_n, n_ok = tile_block(
        SortedIds, TileExpert, pid_m, pid_n, num_pairs, N, stride_am, TOP_K, GATED, BLOCK_M, BLOCK_N
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up_rows = offs_n + N
    if FORMAT == 3:
        if MX_WORDS:
            # Planned layout: K steps of 128 values; the 4 scales of a row for one step are one
            # int32 word (scales [E, K/128, N] words), a load wide enough to be pipelined.
            # EVEN_K here means K % 128 == 0; else the masks of the two 64-value halves of a
            # step cover the end of K.
            for k0 in range(0, K, 128):
                w_ptr = S + expert * stride_se + (k0 // 128) * stride_sk
                words = tl.load(w_ptr + offs_n.to(tl.int64) * stride_sn, mask=n_ok, other=0x7F7F7F7F)
                if GATED:
                    words_up = tl.load(w_ptr + up_rows.to(tl.int64) * stride_sn, mask=n_ok, other=0x7F7F7F7F)
                for g in tl.static_range(2):
                    kg = k0 + 64 * g
                    a_lo, a_hi = _mx_load_a(A, a_rows, m_ok, kg, K, MX_HALVES, EVEN_K, INTERPRET)
                    acc = _mx_dot(
                        acc,
                        a_lo,
                        a_hi,
                        W,
                        (words >> (16 * g)) & 255,
                        (words >> (16 * g + 8)) & 255,
                        expert,
                        offs_n,
                        n_ok,
                        kg,
                        K,
                        stride_we,
                        stride_wn,
                        stride_wk,
                        MX_HALVES,
                        EVEN_K,
                        MX_BF16,
                        INTERPRET,
                        DOT_PREC,
                    )
                    if GATED:
                        acc_up = _mx_dot(
                            acc_up,
                            a_lo,
                            a_hi,
                            W,
                            (words_up >> (16 * g)) & 255,
                            (words_up >> (16 * g + 8)) & 255,
                            expert,
                            up_rows,
                            n_ok,
                            kg,
                            K,
                            stride_we,
                            stride_wn,
                            stride_wk,
                            MX_HALVES,
                            EVEN_K,
                            MX_BF16,
                            INTERPRET,
                            DOT_PREC,
                        )
        else:
            # Standard layout: one 64-value group per step; EVEN_K here means K % 64 == 0.
            for kg in range(0, K, 64):
                a_lo, a_hi = _mx_load_a(A, a_rows, m_ok, kg, K, MX_HALVES, EVEN_K, INTERPRET)
                s0, s1 = _mx_scales(S, expert, offs_n, n_ok, kg, K, stride_se, stride_sn, stride_sk, EVEN_K)
                acc = _mx_dot(
                    acc,
                    a_lo,
                    a_hi,
                    W,
                    s0,
                    s1,
                    expert,
                    offs_n,
                    n_ok,
                    kg,
                    K,
                    stride_we,
                    stride_wn,
                    stride_wk,
                    MX_HALVES,
                    EVEN_K,
                    MX_BF16,
                    INTERPRET,
                    DOT_PREC,
                )
                if GATED:
                    s0, s1 = _mx_scales(S, expert, up_rows, n_ok, kg, K, stride_se, stride_sn, stride_sk, EVEN_K)
                    acc_up = _mx_dot(
                        acc_up,
                        a_lo,
                        a_hi,
                        W,
                        s0,
                        s1,
                        expert,
                        up_rows,
                        n_ok,
                        kg,
                        K,
                        stride_we,
                        stride_wn,
                        stride_wk,
                        MX_HALVES,
                        EVEN_K,
                        MX_BF16,
                        INTERPRET,
                        DOT_PREC,
                    )
    else:
        if A_FP8:  # activation scale rows: x's token (layer 1) or the intermediate's slot
            if GATED:
                as_rows = (pairs // TOP_K).to(tl.int64) * stride_asm
            else:
                as_rows = slots.to(tl.int64) * stride_asm
        for k0 in range(0, K, BLOCK_K):
            if A_FP8 and FORMAT == 2:
                a_s = tl.load(AS + as_rows + (k0 // 128) * stride_ask, mask=m_ok, other=0.0)
            else:
                a_s = m_ok  # unused
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a_mask = m_ok[:, None]
            if not EVEN_K:
                a_mask = a_mask & (offs_k[None, :] < K)
            a = tl.load(A + a_rows[:, None] + offs_k[None, :], mask=a_mask, other=0.0)
            if INTERPRET:
                a = a.to(tl.float32)
            w = _load_weight(
                W,
                S,
                expert,
                offs_n,
                n_ok,
                k0,
                K,
                stride_we,
                stride_wn,
                stride_wk,
                stride_se,
                stride_sn,
                stride_sk,
                BLOCK_N,
                BLOCK_K,
                EVEN_K,
            )
            acc = _dot_step(
                acc,
                a,
                w,
                S,
                expert,
                offs_n,
                n_ok,
                k0,
                stride_se,
                stride_sn,
                stride_sk,
                a_s,
                FORMAT,
                INTERPRET,
                DOT_PREC,
                A_FP8,
            )
            if GATED:
                w_up = _load_weight(
                    W,
                    S,
                    expert,
                    up_rows,
                    n_ok,
                    k0,
                    K,
                    stride_we,
                    stride_wn,
                    stride_wk,
                    stride_se,
                    stride_sn,
                    stride_sk,
                    BLOCK_N,
                    BLOCK_K,
                    EVEN_K,
                )
                acc_up = _dot_step(
                    acc_up,
                    a,
                    w_up,
                    S,
                    expert,
                    up_rows,
                    n_ok,
                    k0,
                    stride_se,
                    stride_sn,
                    stride_sk,
                    a_s,
                    FORMAT,
                    INTERPRET,
                    DOT_PREC,
                    A_FP8,
                )
        if A_FP8 and FORMAT == 1:  # per-token activation scale, in the epilogue
            a_s = tl.load(AS + as_rows, mask=m_ok, other=0.0)
            acc = acc * a_s[:, None]
            if GATED:
                acc_up = acc_up * a_s[:, None]
    acc = _row_scale(acc, S, expert, offs_n, n_ok, stride_se, stride_sn, FORMAT)
    if GATED:
        acc_up = _row_scale(acc_up, S, expert, up_rows, n_ok, stride_se, stride_sn, FORMAT)
    else:
        acc_up = acc
    if ATOMIC and not GATED:
        # Fused combine: Out is float32 [T, N]; row pair // TOP_K gets the weighted tile added.
        if HAS_BIAS:
            acc += tl.load(Bias + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        weight = tl.load(TopkWeights + pairs, mask=m_ok, other=0.0)
        out_ptr = Out + (pairs // TOP_K)[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.atomic_add(out_ptr, acc * weight[:, None], mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")
    else:
        epilogue(
            acc,
            acc_up,
            Bias,
            Out,
            TopkWeights,
            expert,
            offs_n,
            n_ok,
            n_ok,
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
def combine_kernel(
    Y, Ids, ExpertMap, Out, H, stride_ot, stride_ys,
    TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Out ``[T, H]`` row t = sum over split s and choice j of float32 Y ``[SPLITS, P, H]``
    (split stride ``stride_ys``) row ``t * TOP_K + j``, in (j, s) order, skipping pairs whose
    expert maps to -1 (their Y rows were never written). ``SPLITS > 1``: the layer-2 GEMM
    ran split-K and each split wrote its partial rows (bias in split 0 only)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(Ids + t * TOP_K + j)
        if HAS_MAP:
            expert = tl.load(ExpertMap + expert)
        for s in tl.static_range(SPLITS):
            acc += tl.load(Y + s * stride_ys + (t * TOP_K + j) * H + offs, mask=h_ok & (expert >= 0), other=0.0)
    tl.store(Out + t * stride_ot + offs, acc.to(Out.dtype.element_ty), mask=h_ok)


@triton.jit
def _round_e4m3(v):
    """float32 ``v`` (``|v| <= 448``) rounded to the nearest e4m3 value, ties to even, still
    float32: the quantum is ``2**(max(exponent, -6) - 3)``, and ``y + 1.5 * 2**23 - 1.5 * 2**23``
    rounds ``y = |v| / quantum`` (< 16, exact) to an integer, half to even."""
    mag = tl.abs(v)
    exp = ((mag.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    q_exp = tl.maximum(exp, -6) - 3
    quantum = ((q_exp + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - q_exp) << 23).to(tl.float32, bitcast=True)
    y = mag * inv
    r = (y + 12582912.0) - 12582912.0
    return tl.where(v < 0, -r * quantum, r * quantum)


@triton.jit
def fp8_quant_kernel(
    X, Q, S, SortedIds, num_pairs, K, stride_xm, stride_qm, stride_sm,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, HAS_IDS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Per-token dynamic fp8: row ``program_id(0)`` of X (any float dtype), K group
    ``program_id(1)`` (``GROUP`` values; 0 = the whole row) → float8_e4m3fn Q and one float32
    scale ``S[row, group]``, the rule of :func:`tokenspeed_kernel.quant.quantize_fp8_per_token`:
    the scale is ``2**e``, the smallest power of two with ``amax <= 448 * 2**e`` (read off
    amax's float32 bits; clamped to [-100, 126]), so ``v * 2**-e`` is exact and the fp8
    conversion (round to nearest even) is the only rounding. ``HAS_IDS``: rows are sorted
    slots of the intermediate; a padding slot (``SortedIds[row] >= num_pairs``) is skipped.
    Under the interpreter, whose float32 -> fp8 conversion does not round to nearest, the
    rounding is done first in float32 arithmetic (:func:`_round_e4m3`)."""
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    if HAS_IDS:
        if tl.load(SortedIds + row) >= num_pairs:
            return
    if GROUP == 0:
        k_lo = 0
        k_hi = K
    else:
        k_lo = group * GROUP
        k_hi = tl.minimum(k_lo + GROUP, K)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK):
        v = tl.load(X + row * stride_xm + k0 + offs, mask=k0 + offs < k_hi, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    bits = tl.max(amax, axis=0).to(tl.int32, bitcast=True)
    # amax = (1 + f) 2**(E - 127): e = E - 135, plus one when 1 + f > 1.75 (448 = 1.75 * 2**8).
    e = ((bits >> 23) & 255) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -100), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    for k0 in range(k_lo, k_hi, BLOCK):
        mask = k0 + offs < k_hi
        v = tl.load(X + row * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v * inv, -448.0), 448.0)
        if INTERPRET:
            q = _round_e4m3(q)
        tl.store(Q + row * stride_qm + k0 + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + row * stride_sm + group, scale)
