"""The swapped MXFP4 grouped GEMM as a persistent kernel (GPU; tests run it under the Triton
interpreter).

:func:`moe_mx_swap_persistent_kernel` computes the tiles of
:func:`._mx_swap_gemm.moe_mx_swap_gemm_kernel` with the same code (:func:`._mx_swap_gemm.swap_tile`:
words, decode, ``tl.dot`` with the weight as the left operand, epilogue), but a fixed grid of
programs (a multiple of the SM count) walks a work list instead of one program per tile.

**Work list.** Built by the permutation (:func:`._routing.align_kernel`), on the device, no
host sync: ``TileExpert`` and ``TileSpan`` give each used token tile its expert and that
expert's first tile, tile count and pair count. With ``num_n = cdiv(N, BLOCK_N)`` weight tiles
per layer, expert ``e`` (tiles ``[f, f + c)``) owns items ``[f * num_n, (f + c) * num_n)``, in
weight-tile-major order: item ``f * num_n + n * c + j`` is (token tile ``f + j``, weight tile
``n``). The ``c`` items that read weight tile ``(e, n)`` are consecutive, so they run at the
same time (one read from HBM, the rest from L2), and a token tile's activations are read by
the ``num_n`` items of the expert's window. An item's coordinates take one round of loads:
``t = item // num_n`` is a tile of the same expert.

**Schedules** (``DYNAMIC``): static, program ``p`` takes items ``p, p + P, p + 2P, ...`` (``P``
the grid size); or dynamic, program ``p`` takes item ``p``, then each next one from a counter
(``WorkCounters[layer]``, zeroed by the permutation: graph-safe) plus ``P``: items still start
in order, whichever program is free, so items of unequal cost (tails) balance. Either way a
program knows its next item, and has loaded its coordinates, one item ahead. (Triton 3.6's
``tl.range(..., flatten=True)`` on the item loop was tried: it fuses a single inner loop only,
not the two of the tail form, and at 128 x 128 it pipelined no load and spilled 128 bytes for
sm_90a; so was one loop over (item, K step) written out, with the epilogue under ``if`` at the
last step: 592 / 1872 bytes of spills at 128 x 128 and most loads synchronous. Neither is
offered; several programs per SM overlap one program's item boundary with another's K loop.)

**Tail tiles** (``TAIL_M``, 0 = off): an expert's last tile with at most ``TAIL_M`` real rows
is computed as a ``TAIL_M``-row tile (its first ``TAIL_M`` slots): wgmma's N, the tokens, is
``TAIL_M`` instead of ``BLOCK_M``. At GPT-OSS's T = 4096 (about 128 ± 11 rows per expert, 128-row
tiles) about half the experts end in a tile of a few rows, which the fixed tile pads to 128:
1.48x the useful MMA work. The weight decode, per weight tile, is the same either way.

The K loop of both row counts is ``tl.range(0, steps, num_stages=K_STAGES)`` (software
pipelining of every load of the step: activations, words, scale words). No split-K: the
persistent grid is for the token counts where the plain grid already fills the GPU. On sm_90a
(Triton 3.6) the loop keeps up to 8 wgmma groups in flight across steps (``wgmma.wait_group``
after each, ``0`` only after the loop) and Triton's other loop options change nothing or spill
(``warp_specialize``, ``disallow_acc_multi_buffer``, ``flatten``: the same SASS;
``loop_unroll_factor=2``: spills at the 128 x 128 tile; ci/device/README.md, item s).

**Layer-2 TMA loads** (``A_TMA``, :attr:`._config.Schedule.w2_tma`, chosen above 48 rows per expert): layer 2's
activations of a full token tile are ``BLOCK_M`` consecutive rows of the intermediate, so they
can come by one TMA load per step (``A_desc``, a host descriptor with ``[BLOCK_M, 128]`` blocks)
instead of per-thread ``cp.async`` copies; a padding slot's row is read as it is (its output row
is never stored), K past the end reads zeros. Tails keep the pointer loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernel_triton.ops.moe._gemm import slot_rows
from tokenspeed_kernel_triton.ops.moe._mx_swap_gemm import swap_tile

__all__ = ["moe_mx_swap_persistent_kernel"]


@triton.jit
def _rows_tile(
    A, W, S, Bias, Out, SortedIds, TopkWeights, expert, first_slot, offs_n, n_ok,
    num_pairs, N, K, stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, K_STAGES: tl.constexpr, BIG_SCALES: tl.constexpr,
    INTERPRET: tl.constexpr, A_TMA: tl.constexpr,
):  # fmt: skip
    """The ``[ROWS, BLOCK_N]`` tile of slots ``[first_slot, first_slot + ROWS)``, all K steps
    (``A_TMA``: ``A`` is the intermediate's TMA descriptor, :func:`._mx_swap_gemm.swap_tile`)."""
    slots, pairs, m_ok, a_rows = slot_rows(SortedIds, first_slot, num_pairs, stride_am, TOP_K, GATED, ROWS)
    swap_tile(
        A, W, S, Bias, Out, TopkWeights, expert, slots, pairs, m_ok, a_rows, offs_n, n_ok,
        N, K, 0, tl.cdiv(K, 128), 0,
        stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om, 0,
        GATED, ACTIVATION, HAS_BIAS, ROWS, BLOCK_N, False, BIG_SCALES, INTERPRET, K_STAGES, first_slot, A_TMA,
    )  # fmt: skip


@triton.jit
def _coordinates(TileExpert, TileSpan, item, total, num_n, tiles_bound):
    """The work list's entry of ``item`` (when ``item < total``): its expert (int64), and that
    expert's first tile, tile count and pair count (int32). ``t = item // num_n`` is a tile of
    the item's expert."""
    t = item // num_n
    ok = item < total
    expert = tl.load(TileExpert + t, mask=ok, other=0).to(tl.int64)
    first = tl.load(TileSpan + t, mask=ok, other=0)
    tiles = tl.load(TileSpan + tiles_bound + t, mask=ok, other=1)
    count = tl.load(TileSpan + 2 * tiles_bound + t, mask=ok, other=0)
    return expert, first, tiles, count


@triton.jit
def _work_item(
    item, expert, first, tiles, count, num_n, A, A_full, W, S, Bias, Out, SortedIds, TopkWeights,
    num_pairs, N, K, stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_M: tl.constexpr, K_STAGES: tl.constexpr,
    BIG_SCALES: tl.constexpr, INTERPRET: tl.constexpr, A_TMA: tl.constexpr,
):  # fmt: skip
    """Work item ``item`` of ``expert`` (tiles ``[first, first + tiles)``, ``count`` pairs): its
    token tile ``first + j`` and weight tile ``n`` (module docstring), computed as a ``TAIL_M``-row
    tile when the token tile holds no more real rows than that. ``A_full``: what a full tile reads
    its activations from (``A``, or with ``A_TMA`` the intermediate's TMA descriptor; tails read
    ``A``)."""
    local = item - first * num_n
    j = local % tiles
    offs_n = (local // tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    first_slot = (first + j) * BLOCK_M
    if TAIL_M > 0 and count - j * BLOCK_M <= TAIL_M:
        _rows_tile(
            A, W, S, Bias, Out, SortedIds, TopkWeights, expert, first_slot, offs_n, n_ok,
            num_pairs, N, K, stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om,
            TOP_K, GATED, ACTIVATION, HAS_BIAS, TAIL_M, BLOCK_N, K_STAGES, BIG_SCALES, INTERPRET, False,
        )  # fmt: skip
    else:
        _rows_tile(
            A_full, W, S, Bias, Out, SortedIds, TopkWeights, expert, first_slot, offs_n, n_ok,
            num_pairs, N, K, stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om,
            TOP_K, GATED, ACTIVATION, HAS_BIAS, BLOCK_M, BLOCK_N, K_STAGES, BIG_SCALES, INTERPRET, A_TMA,
        )  # fmt: skip


@triton.jit
def _next_item(counter, taken, programs, DYNAMIC: tl.constexpr):
    """The item a program takes after ``taken``: ``taken + P`` (static), or the counter's next
    value plus ``P`` (DYNAMIC; the first ``P`` items are the programs' own)."""
    if DYNAMIC:
        return tl.atomic_add(counter, 1, sem="relaxed") + programs
    return taken + programs


@triton.jit
def moe_mx_swap_persistent_kernel(
    A, W, S, Bias, Out, SortedIds, TileExpert, NumTiles, TopkWeights, TileSpan, WorkCounters,
    num_pairs, N, K, tiles_bound,
    stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om,
    TOP_K: tl.constexpr, GATED: tl.constexpr, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_M: tl.constexpr, DYNAMIC: tl.constexpr,
    K_STAGES: tl.constexpr, BIG_SCALES: tl.constexpr, INTERPRET: tl.constexpr, A_TMA: tl.constexpr = False,
    A_desc=None,
):  # fmt: skip
    """Every work item of one layer (module docstring) over a grid of ``P`` programs (axis 0).

    Tensors as :func:`._mx_swap_gemm.moe_mx_swap_gemm_kernel`'s without split-K (GATED: Out is
    the intermediate ``[tiles_bound * BLOCK_M, N]`` at sorted rows; else float32 ``[P, N]`` at
    pair rows times the routing weight), plus TileSpan int32 ``[3, tiles_bound]`` and
    WorkCounters int32 ``[2]`` (:class:`._routing.Routing`; layer 1 counts in
    ``WorkCounters[0]``, layer 2 in ``WorkCounters[1]``). ``TAIL_M``: 0, or a power of two in
    ``[16, BLOCK_M)``. Each program knows its next item (and has loaded its coordinates) one
    item ahead, so the counter's atomic and the work list's loads wait behind a whole item.
    ``A_TMA`` (layer 2 only, opt-in): full token tiles read their activations through ``A_desc``,
    a TMA descriptor of the intermediate with ``[BLOCK_M, 128]`` blocks (tails read ``A``)."""
    num_n = tl.cdiv(N, BLOCK_N)
    total = tl.load(NumTiles) * num_n
    programs = tl.num_programs(0)
    if GATED:
        counter = WorkCounters
    else:
        counter = WorkCounters + 1
    if A_TMA:
        a_full = A_desc
    else:
        a_full = A
    item = tl.program_id(0)
    expert, first, tiles, count = _coordinates(TileExpert, TileSpan, item, total, num_n, tiles_bound)
    upcoming = _next_item(counter, item, programs, DYNAMIC)
    while item < total:
        after = _next_item(counter, upcoming, programs, DYNAMIC)
        next_expert, next_first, next_tiles, next_count = _coordinates(
            TileExpert, TileSpan, upcoming, total, num_n, tiles_bound
        )
        _work_item(
            item, expert, first, tiles, count, num_n, A, a_full, W, S, Bias, Out, SortedIds, TopkWeights,
            num_pairs, N, K, stride_am, stride_we, stride_ws, stride_se, stride_ss, stride_be, stride_om,
            TOP_K, GATED, ACTIVATION, HAS_BIAS, BLOCK_M, BLOCK_N, TAIL_M, K_STAGES, BIG_SCALES, INTERPRET, A_TMA,
        )  # fmt: skip
        item = upcoming
        expert, first, tiles, count = next_expert, next_first, next_tiles, next_count
        upcoming = after
