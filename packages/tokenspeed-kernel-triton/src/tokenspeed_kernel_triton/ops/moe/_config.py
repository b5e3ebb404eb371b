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

The ``tl.dot_scaled`` MXFP4 kernel (:mod:`.fused_mx`, weights ``"mxfp4_dot"``) has its own
rows: its K step is ``block_k`` values (128: 64 bytes per weight row, 4 E8M0 scales), and
in the decode regime its K loop may be split (:func:`split_k`) so that a few experts'
weights are streamed by enough programs to fill the GPU. The swapped MXFP4 kernel
(:mod:`.fused_mx_swap`, ``"mxfp4_swap"``, NVIDIA only) has rows of its own too: there
``block_n`` counts weight rows (the MMA's M) and ``block_m`` token rows (its N), and
``block_k`` is always its step of 128. A row may give layer 2 (w2) a tile of its own
(:data:`_W2_TILES`, ``pick_tile(..., layer=2)``), with layer 1's ``block_m``: both layers walk
the one permutation's token tiles; only the swapped kernel reads it. Its persistent form
(:mod:`.fused_mx_swap_persistent`) takes the layer-1 tiles for both layers and a
:class:`Schedule` of its own (:func:`pick_schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = [
    "LAYERS",
    "MAX_SPLITS",
    "MIN_SPLIT_STEPS",
    "SMEM_BUDGET",
    "SPLIT_PROGRAMS_PER_SM",
    "Schedule",
    "Tile",
    "fit_shared",
    "pick_schedule",
    "pick_tile",
    "schedules_for",
    "split_k",
    "staged_bytes",
    "tiles_for",
]


@dataclass(frozen=True)
class Tile:
    """One GEMM tile configuration (both layers', unless :data:`_W2_TILES` gives layer 2 its own)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (vendor, weights, max rows per expert, tile); the first matching row whose bound is >= rows
# wins. "mx" = MXFP4 (its K step is always one 64-value group: block_k is not used),
# "dense" = x's dtype or fp8. NVIDIA rows from the H100 sweep in docs/history.md.
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
    # tl.dot_scaled (bf16 x e2m1): the H100 sweep at GPT-OSS shapes (docs/history.md,
    # 2026-11-23; ci/device/tiles_sweep.py re-measures): 16 x 64 wins every decode T (T=1 74 vs 94 us
    # for 16 x 32, T=8 375 vs 546, T=64 1302 vs 2000); 64 x 64 at T=512, 128 x 128 at 4096.
    ("cuda", "mx_dot", 4, Tile(16, 64, 128, 1, 4, 3)),
    ("cuda", "mx_dot", 16, Tile(16, 64, 128, 1, 4, 3)),
    ("cuda", "mx_dot", 48, Tile(64, 64, 128, 8, 4, 3)),
    ("cuda", "mx_dot", float("inf"), Tile(128, 128, 128, 8, 8, 3)),
    ("rocm", "mx_dot", 4, Tile(16, 32, 128, 1, 4, 2)),
    ("rocm", "mx_dot", float("inf"), Tile(64, 64, 128, 8, 4, 2)),
    # The swapped MXFP4 kernel (:mod:`.fused_mx_swap`, weights "mxfp4_swap", sm_90 only):
    # block_m = token rows (wgmma N), block_n = weight rows (wgmma M: 64 per warpgroup),
    # block_k is its fixed step of 128. H100 sweep of 2026-11-27 (docs/history.md, "MXFP4 swap
    # tiles"): 64 weight rows on one warpgroup up to 4 rows per expert (1.04-1.08x the first
    # starting point at T=1/8/64), 32 tokens x 128 weight rows on one warpgroup at 16 (T=512:
    # 735 vs 1145 us); the 48- and 96-row bounds are untimed starting points (64 x 256 spills
    # with 3 stages and 128 x 256 always: ptxas -v, test_aot_compile_moe.py).
    ("cuda", "mx_swap", 4, Tile(16, 64, 128, 1, 4, 4)),
    ("cuda", "mx_swap", 16, Tile(32, 128, 128, 8, 4, 4)),
    ("cuda", "mx_swap", 48, Tile(32, 128, 128, 8, 4, 4)),
    ("cuda", "mx_swap", 96, Tile(64, 128, 128, 8, 8, 3)),
    ("cuda", "mx_swap", float("inf"), Tile(128, 128, 128, 8, 8, 3)),
)

# Layer 2's own tile, by its row's (vendor, weights, bound) in _TABLE; a row not here runs both
# layers on its tile. Same block_m as the row (the permutation's token tiles serve both layers).
# Only the swapped kernel (fused_mx_swap) reads layer 2's tile, so only "mx_swap" rows may have
# one (test_moe_mx_swap.py checks); its persistent form runs both layers on the row's tile.
_W2_TILES: dict[tuple[str, str, float], Tile] = {
    # H200, 2026-11-28 (ci/device/mxp_sweep.py --group levers, variant t64-w2n128,
    # docs/results/2026-11-28-h200-mxlever.json): T = 64 of GPT-OSS-120B (2 rows per expert)
    # 514.4 vs 528.8 us with layer 2 on 128 weight rows instead of 64, bitwise the same output.
    ("cuda", "mx_swap", 4): Tile(16, 128, 128, 1, 4, 4),
}

# Shared memory a tile may stage (bytes): the table's rows are sized for 16-bit activations;
# float32 x doubles the staged bytes, so a row is shrunk (fewer stages, then a shorter K
# step) until it fits. H100: 227 KiB per block, some kept for the epilogue; gfx942: 64 KiB.
SMEM_BUDGET = {"cuda": 200 * 1024, "rocm": 64 * 1024}


def staged_bytes(tile: Tile, elem_bytes: int) -> int:
    """Shared memory of the layer-1 main loop: ``num_stages - 1`` buffered K steps of the x
    tile and the two weight tiles (gate and up), in the activations' element size (the
    weights are converted to it; MXFP4/fp8 weights stage fewer bytes, so this bounds them)."""
    return (tile.num_stages - 1) * (tile.block_m + 2 * tile.block_n) * tile.block_k * elem_bytes


def fit_shared(tile: Tile, elem_bytes: int, vendor: str) -> Tile:
    """``tile`` shrunk until :func:`staged_bytes` fits ``SMEM_BUDGET``: stages down to 2,
    then the K step down to 16; unchanged when it fits (every 16-bit row of the table)."""
    budget = SMEM_BUDGET["rocm" if vendor == "rocm" else "cuda"]
    while staged_bytes(tile, elem_bytes) > budget and tile.num_stages > 2:
        tile = replace(tile, num_stages=tile.num_stages - 1)
    while staged_bytes(tile, elem_bytes) > budget and tile.block_k > 16:
        tile = replace(tile, block_k=tile.block_k // 2)
    return tile


# Split-K (the dot_scaled kernel only): split while the grid has fewer than
# SPLIT_PROGRAMS_PER_SM programs per SM, each split keeping >= MIN_SPLIT_STEPS K steps.
SPLIT_PROGRAMS_PER_SM = 8
MIN_SPLIT_STEPS = 4
MAX_SPLITS = 8


_KINDS = {"mxfp4": "mx", "mxfp4_dot": "mx_dot", "mxfp4_swap": "mx_swap"}
# Kinds whose rows are sized for their own staging (packed weights, fixed K step): not shrunk by
# fit_shared, whose estimate stages weights at the activations' element size.
_OWN_STAGING = frozenset({"mx_swap"})


def _keys(vendor: str, weight_format: str) -> tuple[str, str]:
    return ("rocm" if vendor == "rocm" else "cuda", _KINDS.get(weight_format, "dense"))


LAYERS = (1, 2)  # pick_tile(layer=...): w13 (and the permutation's token tiles), w2


def pick_tile(
    num_pairs: int, num_experts: int, vendor: str, weight_format: str = "plain", elem_bytes: int = 2, layer: int = 1
) -> Tile:
    """The tile for ``num_pairs = T * top_k`` rows over ``num_experts`` local experts on
    ``vendor`` (``"cpu"``, i.e. the interpreter, uses the NVIDIA table) for weights of
    ``weight_format`` (``"mxfp4"``, ``"mxfp4_dot"`` for the dot_scaled kernel, ``"mxfp4_swap"``
    for the swapped kernel (NVIDIA rows only), or anything else) and activations of
    ``elem_bytes`` bytes (:func:`fit_shared`, except for ``"mxfp4_swap"``). ``layer`` 2: the
    row's layer-2 tile where :data:`_W2_TILES` has one (same ``block_m``), else the row's."""
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    table, kind = _keys(vendor, weight_format)
    rows = num_pairs / max(num_experts, 1)
    key, tile = next(((v, w, bound), tile) for v, w, bound, tile in _TABLE if (v, w) == (table, kind) and rows <= bound)
    tile = _W2_TILES.get(key, tile) if layer == 2 else tile
    return tile if kind in _OWN_STAGING else fit_shared(tile, elem_bytes, table)


def tiles_for(vendor: str, weight_format: str = "plain", *, w2: bool = True) -> tuple[Tile, ...]:
    """Every tile ``vendor`` can choose for ``weight_format`` (the ahead-of-time compile sweep),
    each row's layer-2 tile (:data:`_W2_TILES`) after its own unless ``w2`` is False (kernels
    that run both layers on the row's tile: the persistent swapped GEMM)."""
    table, kind = _keys(vendor, weight_format)
    rows = [
        (tile, _W2_TILES.get((v, w, bound)) if w2 else None) for v, w, bound, tile in _TABLE if (v, w) == (table, kind)
    ]
    return tuple(t for pair in rows for t in pair if t is not None)


def split_k(programs: int, k_steps: int, num_sms: int) -> int:
    """K splits (a power of two, 1 = none) for a grid of ``programs`` tiles x column blocks
    whose K loop has ``k_steps`` steps, on ``num_sms`` SMs: double while the grid has fewer
    than ``SPLIT_PROGRAMS_PER_SM * num_sms`` programs, every split keeps at least
    ``MIN_SPLIT_STEPS`` steps and there are at most ``MAX_SPLITS``. A pure function of
    shapes, decided on the host: no device value is read (CUDA-graph capturable)."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and programs * splits < SPLIT_PROGRAMS_PER_SM * num_sms
        and -(-k_steps // (2 * splits)) >= MIN_SPLIT_STEPS
    ):
        splits *= 2
    return splits


@dataclass(frozen=True)
class Schedule:
    """How the persistent swapped GEMM (:mod:`._mx_swap_persistent`) walks its work list.

    Attributes:
        programs_per_sm: programs per multiprocessor (the grid, capped at the work items).
        tail_m: 0, or the rows (a power of two, at least 16, below the tile's ``block_m``) of
            the smaller tile an expert's last token tile is computed with when it holds no
            more real rows than that.
        dynamic: items taken from a counter as programs free up, else a fixed stride.
        programs: the grid exactly, ignoring ``programs_per_sm`` (tests), or None.
        w2_tma: layer 2's full token tiles read their activations (contiguous rows of the
            intermediate) by TMA through a descriptor instead of per-thread ``cp.async`` (tails
            keep those). :func:`pick_schedule` chooses it above 48 rows per expert (measured at
            T = 4096, ``ci/device/mxp_sweep.py`` variant ``p-w2tma``).
    """

    programs_per_sm: int = 1
    tail_m: int = 0
    dynamic: bool = True
    programs: int | None = None
    w2_tma: bool = False


# The persistent swapped GEMM's schedules, by rows per expert like the "mx_swap" tiles; the first
# row whose bound is >= rows wins. Untimed starting points (branch mxp, 2026-11-27): as many
# programs per SM as fit at once at the table's tile for that bound (registers and shared memory
# of the sm_90a compiles, test_aot_compile_moe.py: 3 of the 16 x 64 tile, 2 of 32 x 128, 1 of
# the 8-warp tiles), so the persistent grid keeps the occupancy the one-tile grid had; tails
# only where the two tile forms compile without spills (64- and 128-row tiles); the dynamic
# counter only with tails, whose items cost unequal times (its atomic's result is broadcast
# through shared memory behind a barrier: a wait per item that equal items need not pay).
# ci/device/mxp_sweep.py times the others.
_SCHEDULES: tuple[tuple[float, Schedule], ...] = (
    (4, Schedule(programs_per_sm=3, tail_m=0, dynamic=False)),
    (48, Schedule(programs_per_sm=2, tail_m=0, dynamic=False)),
    # layer 2 by TMA from 48 rows per expert: H200, 2026-11-28 (mxp_sweep.py --group levers,
    # variant p-w2tma): T = 4096 2244.6 vs 2309.5 us, bitwise the pointer loads' output
    (float("inf"), Schedule(programs_per_sm=1, tail_m=32, dynamic=True, w2_tma=True)),
)


def pick_schedule(num_pairs: int, num_experts: int, tile: Tile) -> Schedule:
    """The persistent swapped GEMM's schedule for ``num_pairs = T * top_k`` rows over
    ``num_experts`` local experts with ``tile`` (a tail no smaller than the tile is dropped)."""
    rows = num_pairs / max(num_experts, 1)
    return _fitted(next(s for bound, s in _SCHEDULES if rows <= bound), tile)


def _fitted(schedule: Schedule, tile: Tile) -> Schedule:
    return schedule if schedule.tail_m < tile.block_m else replace(schedule, tail_m=0)


def schedules_for(tile: Tile) -> tuple[Schedule, ...]:
    """Every schedule :func:`pick_schedule` can give with ``tile`` (the ahead-of-time compile sweep)."""
    return tuple(dict.fromkeys(_fitted(s, tile) for _, s in _SCHEDULES))
