"""Tile parameters of the grouped expert GEMMs: a small table, chosen by rows per expert.

The regime is read from ``rows = T * top_k / E_local``, the mean number of rows each local
expert multiplies (the host knows it without a sync):

- decode (``rows <= 4``): weight-bandwidth bound. The smallest MMA tile in M (16 rows,
  mostly padding, which costs no memory traffic) and narrow N tiles, so that one expert's
  weight is spread over many programs and every SM streams weights; long K steps.
- small / medium (``rows <= 16 / 48``): still mostly bandwidth bound, more rows per tile.
- prefill: a classic grouped GEMM tile (128 x 128, 8 warps, on NVIDIA).

AMD (``rocm``) gets smaller N/K tiles and two stages: the layer-1 program holds two weight
tiles (gate and up) and gfx942 has 64 KiB of shared memory (LDS) per workgroup.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Tile", "pick_tile"]


@dataclass(frozen=True)
class Tile:
    """One GEMM tile configuration (the same for both layers)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (vendor, weights, max rows per expert, tile); the first matching row whose bound is >= rows
# wins. "mx" = MXFP4 (its K step is always one 64-value group: block_k is not used),
# "dense" = x's dtype or fp8. NVIDIA rows from the H100 sweep in docs/benchmarks.md.
_TABLE: tuple[tuple[str, str, float, Tile], ...] = (
    ("cuda", "dense", 4, Tile(16, 32, 128, 1, 4, 4)),
    ("cuda", "dense", 16, Tile(32, 64, 128, 4, 4, 4)),
    ("cuda", "dense", 48, Tile(64, 64, 64, 8, 4, 4)),
    ("cuda", "dense", float("inf"), Tile(128, 128, 64, 8, 8, 3)),
    ("cuda", "mx", 4, Tile(16, 32, 64, 1, 4, 4)),
    ("cuda", "mx", 16, Tile(32, 64, 64, 4, 4, 4)),
    ("cuda", "mx", 48, Tile(64, 64, 64, 8, 4, 4)),
    ("cuda", "mx", float("inf"), Tile(128, 128, 64, 8, 8, 3)),
    ("rocm", "dense", 4, Tile(16, 32, 128, 1, 4, 2)),
    ("rocm", "dense", 16, Tile(16, 64, 64, 1, 4, 2)),
    ("rocm", "dense", 48, Tile(32, 64, 64, 4, 4, 2)),
    ("rocm", "dense", float("inf"), Tile(64, 64, 64, 8, 4, 2)),
    ("rocm", "mx", 4, Tile(16, 32, 64, 1, 4, 2)),
    ("rocm", "mx", float("inf"), Tile(64, 64, 64, 8, 4, 2)),
)


def _keys(vendor: str, weight_format: str) -> tuple[str, str]:
    return ("rocm" if vendor == "rocm" else "cuda", "mx" if weight_format == "mxfp4" else "dense")


def pick_tile(num_pairs: int, num_experts: int, vendor: str, weight_format: str = "plain") -> Tile:
    """The tile for ``num_pairs = T * top_k`` rows over ``num_experts`` local experts on
    ``vendor`` (``"cpu"``, i.e. the interpreter, uses the NVIDIA table) for weights of
    ``weight_format`` (``"mxfp4"`` or anything else)."""
    table, kind = _keys(vendor, weight_format)
    rows = num_pairs / max(num_experts, 1)
    return next(tile for v, w, bound, tile in _TABLE if (v, w) == (table, kind) and rows <= bound)


def tiles_for(vendor: str, weight_format: str = "plain") -> tuple[Tile, ...]:
    """Every tile ``vendor`` can choose for ``weight_format`` (the ahead-of-time compile sweep)."""
    table, kind = _keys(vendor, weight_format)
    return tuple(tile for v, w, _, tile in _TABLE if (v, w) == (table, kind))
