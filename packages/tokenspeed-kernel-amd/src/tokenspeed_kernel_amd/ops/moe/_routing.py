"""Expert-sorted routing for the grouped GEMM, in plain torch ops (no host sync).

Pairs ``(token, choice)`` are sorted by local expert (pairs whose expert is not on this
rank sort last and are never visited); each expert's run is cut into ``block_m``-row tiles.
The grid is an upper bound computed on the host, ``cdiv(P, block_m) + min(E, P)`` tiles;
tiles past the last expert have ``rows = 0`` and exit at once. Nothing is read back to the
host, so the call can be captured in a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Routing", "local_ids", "sort_pairs"]


@dataclass(frozen=True)
class Routing:
    """Attributes:
    sorted_pairs: int32 ``[P]`` pair ids (``t * k + j``) by local expert, stable.
    tile_expert: int32 ``[tiles]`` local expert of each tile (``E`` past the end).
    tile_row: int32 ``[tiles]`` first sorted position of each tile.
    tile_rows: int32 ``[tiles]`` rows in each tile (0 for padding tiles).
    num_tiles: the grid bound (host int).
    """

    sorted_pairs: torch.Tensor
    tile_expert: torch.Tensor
    tile_row: torch.Tensor
    tile_rows: torch.Tensor
    num_tiles: int


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[P]`` local expert per pair (``-1``: not on this rank)."""
    ids = topk_ids.reshape(-1).long()
    return ids if expert_map is None else expert_map.long()[ids]


def sort_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int) -> Routing:
    """Sort pairs by local expert and tile them (see the module docstring)."""
    local = local_ids(topk_ids, expert_map)
    num_pairs = local.numel()
    key = torch.where(local >= 0, local, torch.full_like(local, num_experts))
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    num_tiles = -(-num_pairs // block_m) + min(num_experts, num_pairs)
    t = torch.arange(num_tiles, device=local.device)
    expert = torch.searchsorted(tile_end, t, right=True)
    valid = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first_tile = tile_end[e] - tiles[e]
    row = pair_start[e] + (t - first_tile) * block_m
    rows = torch.where(valid, (counts[e] - (t - first_tile) * block_m).clamp(0, block_m), torch.zeros_like(t))
    return Routing(
        order.to(torch.int32),
        expert.to(torch.int32),
        torch.where(valid, row, torch.zeros_like(row)).to(torch.int32),
        rows.to(torch.int32),
        num_tiles,
    )
