"""Inputs of the layer-2 grouped GEMM prototype (``gluon_mx_grouped``) on awkward expert sizes,
and its float64 reference: shared by the CPU emulation test and the sm_90 GPU test."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel.quant import dequantize_mxfp4, quantize_mxfp4
from tokenspeed_kernel_triton.ops.moe.fused_mx_swap import swap_operand

TILE = 128
# rows per expert: empty, one, one short of a tile, a tile, one past (two tiles)
AWKWARD_ROWS = (0, 1, 127, 128, 129)


@dataclass(frozen=True)
class GroupedCase:
    """x bf16 ``[tiles * 128, K]`` (sorted rows, padding rows random: the kernel must not
    store them); words / scales / big: the prepared W2 (``swap_operand``); w64 float64 ``[E,
    N, K]`` (dequantized); sorted_ids, tile_expert int32; num_tiles; num_pairs."""

    x: torch.Tensor
    words: torch.Tensor
    scales: torch.Tensor
    big: bool
    w64: torch.Tensor
    sorted_ids: torch.Tensor
    tile_expert: torch.Tensor
    num_tiles: int
    num_pairs: int


def grouped_case(n: int, k: int, rows=AWKWARD_ROWS, seed: int = 0, device: str = "cpu") -> GroupedCase:
    """One expert per entry of ``rows`` (that many pairs, in a shuffled pair order), W2 ``[E,
    n, k]`` quantized to MXFP4 on the CPU, everything moved to ``device`` at the end."""
    g = torch.Generator().manual_seed(seed)
    e = len(rows)
    w = quantize_mxfp4(torch.randn(e, n, k, generator=g) * 0.1)
    op = swap_operand(w, check_scales=True)
    num_pairs = sum(rows)
    perm = torch.randperm(num_pairs, generator=g).to(torch.int32)
    ids, experts, start = [], [], 0
    for expert, count in enumerate(rows):
        tiles = -(-count // TILE)
        block = torch.full((tiles * TILE,), num_pairs, dtype=torch.int32)
        block[:count] = perm[start : start + count]
        start += count
        ids.append(block)
        experts += [expert] * tiles
    sorted_ids = torch.cat(ids)
    x = (torch.randn(sorted_ids.numel(), k, generator=g)).to(torch.bfloat16)
    return GroupedCase(
        x.to(device),
        op.words.to(device),
        op.scales.to(device),
        op.big_scales,
        dequantize_mxfp4(w, torch.float64),
        sorted_ids.to(device),
        torch.tensor(experts, dtype=torch.int32).to(device),
        len(experts),
        num_pairs,
    )


def grouped_reference(case: GroupedCase) -> torch.Tensor:
    """float64 ``[num_pairs, N]``: each pair's row of x times its expert's dequantized W2ᵀ."""
    out = torch.zeros(case.num_pairs, case.w64.shape[1], dtype=torch.float64)
    ids = case.sorted_ids.cpu().long()
    experts = case.tile_expert.cpu()
    x = case.x.cpu().double()
    for tile in range(case.num_tiles):
        rows = slice(tile * TILE, (tile + 1) * TILE)
        ok = ids[rows] < case.num_pairs
        out[ids[rows][ok]] = x[rows][ok] @ case.w64[int(experts[tile])].T
    return out
