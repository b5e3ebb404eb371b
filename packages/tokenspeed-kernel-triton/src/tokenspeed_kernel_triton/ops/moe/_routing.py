"""Token permutation by expert, on the device, without a host sync (CUDA-graph capturable).

One launch of :func:`align_kernel`, one program per local expert. Each program builds the
histogram of local expert ids over all ``P = T * top_k`` (token, choice) pairs, turns it into
tile-padded offsets with a prefix sum, then writes its own expert's pairs in ascending pair
order (stable, hence deterministic), fills its padding slots with the sentinel ``P`` and
records which expert owns each of its ``BLOCK_M``-row tiles. Program 0 also writes the total
number of tiles. Pairs whose expert maps to ``-1`` (expert parallelism) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.kit import next_pow2
from tokenspeed_kernel_triton._launcher import Launch

__all__ = ["Routing", "align_kernel", "align_launch", "max_tiles", "sort_by_expert"]


@triton.jit
def align_kernel(
    Ids, ExpertMap, SortedIds, TileExpert, NumTiles, TileSpan, WorkCounters,
    num_pairs, tiles_bound,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Ids int32 ``[P]`` (global expert per pair), ExpertMap int32 ``[E_global]`` → SortedIds
    int32 ``[>= padded P]`` (pair ids grouped by local expert, each group padded to BLOCK_M
    with ``P``), TileExpert int32 ``[>= tiles]``, NumTiles int32 ``[1]``, TileSpan int32
    ``[3, tiles_bound]`` (row stride ``tiles_bound``; per used tile: its expert's first tile,
    tile count and pair count), WorkCounters int32 ``[2]`` (zeroed)."""
    expert = tl.program_id(0)
    hist = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        ok = offs < num_pairs
        ids = tl.load(Ids + offs, mask=ok, other=-1)
        if HAS_MAP:
            ids = tl.load(ExpertMap + ids, mask=ok, other=-1)
        hist += tl.histogram(ids, BLOCK_E, mask=ok & (ids >= 0))
    padded = (hist + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    bins = tl.arange(0, BLOCK_E)
    mine = bins == expert
    start_row = tl.sum(tl.where(mine, ends - padded, 0))
    count = tl.sum(tl.where(mine, hist, 0))
    my_padded = tl.sum(tl.where(mine, padded, 0))
    if expert == 0:
        tl.store(NumTiles, tl.sum(padded) // BLOCK_M)
        tl.store(WorkCounters + tl.arange(0, 2), tl.zeros((2,), dtype=tl.int32))
    if count > 0:
        seen = 0
        for start in range(0, num_pairs, BLOCK_P):
            offs = start + tl.arange(0, BLOCK_P)
            ok = offs < num_pairs
            ids = tl.load(Ids + offs, mask=ok, other=-1)
            if HAS_MAP:
                ids = tl.load(ExpertMap + ids, mask=ok, other=-1)
            hit = ok & (ids == expert)
            rank = tl.cumsum(hit.to(tl.int32), 0) - 1
            tl.store(SortedIds + start_row + seen + rank, offs, mask=hit)
            seen += tl.sum(hit.to(tl.int32))
        pad = count + tl.arange(0, BLOCK_M)
        tl.store(SortedIds + start_row + pad, num_pairs, mask=pad < my_padded)
        first_tile = start_row // BLOCK_M
        my_tiles = my_padded // BLOCK_M
        for t in range(0, my_tiles, BLOCK_P):
            tiles = t + tl.arange(0, BLOCK_P)
            mine_t = tiles < my_tiles
            tl.store(TileExpert + first_tile + tiles, expert, mask=mine_t)
            tl.store(TileSpan + first_tile + tiles, first_tile, mask=mine_t)
            tl.store(TileSpan + tiles_bound + first_tile + tiles, my_tiles, mask=mine_t)
            tl.store(TileSpan + 2 * tiles_bound + first_tile + tiles, count, mask=mine_t)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the padded tile count known on the host: each non-empty expert
    wastes less than one tile, and at most ``min(E, P)`` experts are non-empty."""
    return num_pairs // block_m + min(num_experts, num_pairs)


@dataclass(frozen=True)
class Routing:
    """The permutation of one call.

    Attributes:
        sorted_ids: int32 ``[tiles_bound * block_m]``: pair ids ``t * top_k + j`` grouped by
            local expert; slots past a group's end hold ``num_pairs``; entries past the last
            used tile are never written (the GEMMs stop at ``num_tiles``).
        tile_expert: int32 ``[tiles_bound]``: the local expert of each used tile.
        num_tiles: int32 ``[1]``: tiles in use (device scalar, read by the GEMMs).
        tiles_bound: host upper bound of ``num_tiles`` (grid size).
        num_pairs: ``T * top_k``.
        tile_span: int32 ``[3, tiles_bound]``: for each used tile, its expert's first tile,
            number of tiles and number of pairs (the persistent GEMM's work list); columns past
            ``num_tiles`` are never written.
        work_counters: int32 ``[2]``, zeroed by the permutation: the persistent GEMM's dynamic
            work counters (layer 1, layer 2).
    """

    sorted_ids: torch.Tensor
    tile_expert: torch.Tensor
    num_tiles: torch.Tensor
    tiles_bound: int
    num_pairs: int
    tile_span: torch.Tensor
    work_counters: torch.Tensor


def align_launch(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int
) -> tuple[Routing, Launch]:
    """The permutation's buffers (uninitialized) and the launch of :func:`align_kernel` that
    fills them from ``topk_ids`` (int32 ``[T, k]``, contiguous; argument position 0)."""
    num_pairs = topk_ids.numel()
    bound = max_tiles(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(bound * block_m, dtype=torch.int32, device=device)
    tile_expert = torch.empty(bound, dtype=torch.int32, device=device)
    num_tiles = torch.empty(1, dtype=torch.int32, device=device)
    tile_span = torch.empty((3, bound), dtype=torch.int32, device=device)
    work_counters = torch.empty(2, dtype=torch.int32, device=device)
    block_p = min(1024, max(next_pow2(num_pairs), 16))
    launch = Launch(
        align_kernel,
        (num_experts,),
        (
            topk_ids,
            sorted_ids if expert_map is None else expert_map,
            sorted_ids,
            tile_expert,
            num_tiles,
            tile_span,
            work_counters,
            num_pairs,
            bound,
        ),
        dict(
            HAS_MAP=expert_map is not None,
            BLOCK_M=block_m,
            BLOCK_E=max(next_pow2(num_experts), 2),
            BLOCK_P=block_p,
            num_warps=4,
        ),
    )
    return Routing(sorted_ids, tile_expert, num_tiles, bound, num_pairs, tile_span, work_counters), launch


def sort_by_expert(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int) -> Routing:
    """Group the pairs of ``topk_ids`` (int32 ``[T, k]``) by local expert in one launch."""
    routing, launch = align_launch(topk_ids, expert_map, num_experts, block_m)
    launch()
    return routing
