"""Host side of the Triton attention kernel: tile choice, grids, split-KV workspace.

Tile parameters come from :data:`TILES` (data, keyed by operator regime), documented here:

- ``rows``: query rows per program (``BLOCK_T`` tokens × ``G_PAD`` heads of a GQA group).
  128 for prefill/extend (MMA-friendly M, one K/V tile feeds 128 rows); for decode the
  smallest power of two ≥ 16 that holds ``q_len × G_PAD`` (decode is bandwidth-bound:
  more rows only waste registers).
- ``block_n``: keys per iteration (64; 32 when the head dim is 256 to bound registers).
- ``num_warps`` / ``num_stages``: measured per regime (see the table's comment); a
  narrow sliding window (``window_left <= NARROW_WINDOW``) uses a shorter prefill tile.
- Decode splits the key range (flash-decoding) when ``batch × Hkv`` programs cannot fill
  the device: enough splits for about two programs per SM, each covering at least
  ``MIN_SPLIT_KEYS`` keys, at most ``MAX_SPLITS``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel.kit import cdiv, fill_splits, next_pow2, sm_count, vendor_of
from tokenspeed_kernel.ops.attention.rows import QueryRows, query_rows
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache, bind_runner, by_fields, run_fresh
from tokenspeed_kernel_triton.ops.attention._kernel import attention_kernel, combine_kernel

MIN_SPLIT_KEYS = 256
MAX_SPLITS = 64


@dataclass(frozen=True)
class Tile:
    rows: int
    block_n: int
    num_warps: int
    num_stages: int


# CUDA rows. Measured on an H100 (a tile sweep, 2026-11-22, docs/history.md; GPT-OSS
# shapes, D=64, three device runs): causal prefill S=8192 with (128, 64, 4, 3): 1441, 1454,
# 1446 us (~380 TFLOP/s, stable); (128, 64, 8, 3) measured 1369 us once, then 1827 us after an
# unrelated change to the mask code (register pressure at 8 warps makes it fragile): not
# chosen; (128, 128, 8, 2) 1834 us. Window-128 prefill: (64, 32, 4, 2) 122-136 us vs 145-160
# us for (64, 16, 4, 2) / (128, 32, 8, 2) and 188 us for (128, 32, 4, 2). Decode B=64 ctx
# 8192 2.73 TB/s of KV with (16, 64, 4, 3). The d256 rows bound registers. The d128 rows
# repeat the d64 rows and a narrow window at d256 takes the d256 prefill tile (the table was
# keyed by regime and "head dim > 128" only when these were measured): the launches are the
# same as before the table was keyed by vendor. The ``TILES`` alias below is this dict
# (ci/device/tiles_sweep.py re-measures the rows; it replaces ``_tile`` while a variant runs).
CUDA_TILES: dict[str, Tile] = {
    "prefill": Tile(rows=128, block_n=64, num_warps=4, num_stages=3),
    "prefill_d128": Tile(rows=128, block_n=64, num_warps=4, num_stages=3),
    "prefill_d256": Tile(rows=64, block_n=32, num_warps=8, num_stages=2),
    "prefill_window": Tile(rows=64, block_n=32, num_warps=4, num_stages=2),
    "prefill_window_d128": Tile(rows=64, block_n=32, num_warps=4, num_stages=2),
    "prefill_window_d256": Tile(rows=64, block_n=32, num_warps=8, num_stages=2),
    "decode": Tile(rows=16, block_n=64, num_warps=4, num_stages=3),
    "decode_d128": Tile(rows=16, block_n=64, num_warps=4, num_stages=3),
    "decode_d256": Tile(rows=16, block_n=32, num_warps=4, num_stages=2),
}
TILES = CUDA_TILES

# ROCm rows: COMPILE-ONLY choices, never run or timed on AMD hardware. For each key, the
# largest tile (rows x block_n first, then more stages, then fewer warps) whose ahead-of-time
# compile for both gfx942 and gfx950 has zero spilled registers (VGPR + SGPR spill counts,
# no scratch) and fits LDS (64 KiB on gfx942, 160 KiB on gfx950), over the configurations of
# the CI compile grid that use that key. Reproduce with
# ``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton --tiles hip:gfx942 hip:gfx950`` (prints the spill
# counts and LDS bytes of every candidate it tries, in order). Numbers per row (gfx942 /
# gfx950: VGPRs incl. AGPRs, spills, LDS bytes; worst configuration of the key). Rows marked
# SPILLS do not meet the zero-spill goal yet (the sweep ran out of time or found no fit); the
# AOT test bounds their spills so they cannot get worse (ROCM_KNOWN_SPILLS there).
ROCM_TILES: dict[str, Tile] = {
    # zero spills: gfx942 184 VGPRs, 0 spills, 16 KiB LDS / gfx950 243, 0, 32 KiB. Was 4 warps until
    # masked tiles zeroed non-finite V (issue 27): gfx950 then spilled 16 at 4 warps (333 VGPRs).
    "prefill": Tile(rows=128, block_n=64, num_warps=8, num_stages=2),
    # zero spills (swept again after issue 27's V masking, which made 128x32 w4 spill 21 on gfx950):
    # gfx942 239 VGPRs, 0, 32 KiB / gfx950 244, 0, 32 KiB
    "prefill_d128": Tile(rows=128, block_n=32, num_warps=8, num_stages=2),
    # zero spills (provisional pick, not swept for larger): gfx942 184, 0, 32 KiB / gfx950 186, 0, 32 KiB
    "prefill_d256": Tile(rows=64, block_n=16, num_warps=8, num_stages=2),
    # SPILLS, no zero-spill candidate: the fp8 paged extend configuration spills 6-12 SGPRs (to
    # VGPR lanes, no scratch) at every tile tried down to 32 x 32 (106 SGPRs in use: scalar
    # state, not the tile); 16 x 32 is spill-free but a quarter of the rows per K/V load, so the
    # row stays. gfx942 168 VGPRs, 13 spills, 8 KiB / gfx950 196, 13, 12 KiB (issue 27's V masking).
    "prefill_window": Tile(rows=64, block_n=32, num_warps=4, num_stages=2),
    # zero spills (swept 128..16 rows x 64/32 keys x 4/8 warps; every larger tile spills 6-27 on one
    # chip): gfx942 140 VGPRs, 0, 8 KiB / gfx950 176, 0, 16 KiB
    "prefill_window_d128": Tile(rows=16, block_n=32, num_warps=4, num_stages=2),
    # zero spills (provisional pick, not swept for larger): gfx942 190, 0, 32 KiB / gfx950 186, 0, 32 KiB
    "prefill_window_d256": Tile(rows=64, block_n=16, num_warps=8, num_stages=2),
    # zero spills: gfx942 136 VGPRs, 0 spills, 4 KiB / gfx950 128, 0, 8 KiB ((16, 64, *) spill 16-18)
    "decode": Tile(rows=16, block_n=32, num_warps=4, num_stages=2),
    # SPILLS on gfx942: 248 VGPRs, 2 spills, 8 KiB / gfx950 244, 0, 8 KiB. (16, 64, 8, 2) is
    # the reverse (gfx942 229 VGPRs 0 spills; gfx950 1 spill): no candidate fits both yet.
    "decode_d128": Tile(rows=16, block_n=32, num_warps=4, num_stages=2),
    # zero spills: gfx942 158 VGPRs, 0 spills, 8 KiB / gfx950 148, 0, 16 KiB (every larger one spills 7-1384)
    "decode_d256": Tile(rows=16, block_n=16, num_warps=8, num_stages=2),
}

# The table: vendor -> key -> tile; the interpreter ("cpu") uses the CUDA rows.
VENDOR_TILES: dict[str, dict[str, Tile]] = {"cuda": CUDA_TILES, "rocm": ROCM_TILES, "cpu": CUDA_TILES}
# Head dims are bucketed to the next power of two in [64, 256] (80/96 -> 128, 16/32 -> 64).
HEAD_DIM_SUFFIX = {64: "", 128: "_d128", 256: "_d256"}
# A window at most this wide makes prefill tiles short: the narrow tile wins there.
NARROW_WINDOW = 512


def tile_key(regime: str, head_dim: int, window: bool = False) -> str:
    """The table key of a call: ``regime`` (``"prefill"`` also serves extend, ``"decode"``),
    ``_window`` for a narrow-window prefill, then the head-dim bucket's suffix."""
    bucket = min(max(next_pow2(head_dim), 64), 256)
    return f"{regime}{'_window' * (regime == 'prefill' and window)}{HEAD_DIM_SUFFIX[bucket]}"


def _tile(regime: str, head_dim: int, window: bool = False, vendor: str = "cuda") -> Tile:
    return VENDOR_TILES[vendor][tile_key(regime, head_dim, window)]


def num_splits(batch: int, num_kv_heads: int, max_keys: int, device: torch.device) -> int:
    """Key-range splits for decode: fill ~2 programs per SM (one "SM" off the GPU), at least
    MIN_SPLIT_KEYS keys each, at most MAX_SPLITS."""
    return fill_splits(batch * num_kv_heads, sm_count(device), most=min(max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


@dataclass(frozen=True)
class KernelConfig:
    """Everything that specializes one compiled attention kernel: its constexprs, launch
    options and grid shape per sequence. Built by :func:`kernel_config` from the call's
    facts; the ahead-of-time compile tests build the same objects without a GPU."""

    constexprs: dict
    num_warps: int
    num_stages: int
    q_blocks: int


def kernel_config(
    *,
    q_dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    max_q: int,
    page_size: int | None,
    uniform_q: bool,
    causal: bool,
    window: bool,
    sinks: bool,
    narrow_window: bool = False,
    cap: bool,
    scales: bool,
    lse: bool,
    splits: int,
    regime: str,
    vendor: str = "cuda",
    tile: Tile | None = None,
) -> KernelConfig:
    """The tile choice of :data:`VENDOR_TILES` applied to one call (see the module docstring);
    ``tile`` overrides the table (the ahead-of-time candidate sweep). ``vendor`` is
    ``kit.vendor_of`` of the call's device: ``"cpu"`` is Triton's interpreter (the CUDA rows,
    and the ``INTERPRET`` constexpr on)."""
    group = num_q_heads // num_kv_heads
    g_pad = next_pow2(group)
    tile = tile or _tile(regime, head_dim, window=narrow_window, vendor=vendor)
    if regime == "decode":
        rows = max(16, next_pow2(max(max_q, 1)) * g_pad)
    else:
        rows = max(tile.rows, g_pad)
    block_t = max(1, rows // g_pad)
    q_blocks = cdiv(max(max_q, 1), block_t)
    constexprs = {
        "G": group,
        "G_PAD": g_pad,
        "BLOCK_T": block_t,
        "BLOCK_N": tile.block_n,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "BLOCK_D": max(16, next_pow2(head_dim)),
        "BLOCK_DV": max(16, next_pow2(head_dim_v)),
        "PAGE_SIZE": page_size or 1,
        "PAGED": page_size is not None,
        "UNIFORM_Q": uniform_q,
        "CAUSAL": causal,
        "HAS_WINDOW": window,
        "HAS_SINKS": sinks,
        "HAS_CAP": cap,
        "HAS_SCALES": scales,
        "WRITE_LSE": lse,
        "NUM_SPLITS": splits,
        "Q_BLOCKS": q_blocks,
        "INTERPRET": vendor == "cpu",  # only Triton's interpreter runs kernels on CPU tensors
        "DOT_PREC": "ieee" if q_dtype == torch.float32 else None,  # 16-bit operands: the default
        "CHECK_N": not causal or splits > 1,  # masked tiles test j < range end (see _kernel._tile)
    }
    return KernelConfig(constexprs, tile.num_warps, tile.num_stages, q_blocks)


def build(rows: QueryRows, *, splits: int, regime: str) -> Built:
    """The launches of the attention kernel (and the combine when ``splits > 1``) over ``rows``
    (:func:`tokenspeed_kernel.ops.attention.rows.query_rows` of the call's arguments), the
    scratch buffers they use (the split partials) and the placeholder they keep (a float32
    ``[1]`` tensor in the place of each absent optional tensor, never read): ``q``
    ``[total_q, Hq, D]``, ``out`` ``[total_q, Hq, Dv]``, ``lse`` float32 ``[total_q, Hq]`` or
    None; ``k``/``v`` ``[total_k, Hkv, D]`` (contiguous batch, no ``page_table``) or caches
    ``[pages, P, Hkv, D]``; no ``cu_seqlens_q``: every sequence has ``q_len`` queries stored
    back to back (decode). ``regime``: ``"prefill"`` (also extend) or ``"decode"``, the tile
    table's row; ``splits``: key-range splits (decode, :func:`num_splits`), else 1. No
    launches for an empty batch.
    """
    q, k, v, out, lse, sinks = rows.q, rows.k, rows.v, rows.out, rows.lse, rows.sinks
    k_scale, v_scale, page_table = rows.k_scale, rows.v_scale, rows.page_table
    cu_seqlens_q, cu_seqlens_k, cache_seqlens = rows.cu_seqlens_q, rows.cu_seqlens_k, rows.cache_seqlens
    window_left, logit_cap = rows.window_left, rows.logit_cap
    total_q, num_q_heads, head_dim = q.shape
    if total_q == 0 or rows.batch == 0:  # an empty batch: nothing to launch
        return [], (), ()
    max_q = min(rows.max_q, total_q)  # the grid follows real rows, not a loose bound
    paged = page_table is not None
    cfg = kernel_config(
        q_dtype=q.dtype,
        num_q_heads=num_q_heads,
        num_kv_heads=k.shape[-2],
        head_dim=head_dim,
        head_dim_v=v.shape[-1],
        max_q=max_q,
        page_size=k.shape[1] if paged else None,
        uniform_q=cu_seqlens_q is None,
        causal=rows.causal,
        window=window_left >= 0,
        narrow_window=0 <= window_left <= NARROW_WINDOW,
        sinks=sinks is not None,
        cap=logit_cap > 0,
        scales=k_scale is not None,
        lse=lse is not None,
        splits=splits,
        regime=regime,
        vendor=vendor_of(q.device),
    )
    block_dv = cfg.constexprs["BLOCK_DV"]
    dummy = q.new_empty(1, dtype=torch.float32)
    scratch: tuple[torch.Tensor, ...] = ()
    if splits > 1:
        part_out = torch.empty((total_q * num_q_heads * splits, block_dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((total_q * num_q_heads * splits,), dtype=torch.float32, device=q.device)
        scratch = (part_out, part_lse)
    else:
        part_out = part_lse = dummy
    grid = (rows.batch * cfg.q_blocks, k.shape[-2], splits)
    launches = [
        Launch(
            attention_kernel,
            grid,
            (
                q,
                k,
                v,
                out,
                lse if lse is not None else dummy,
                part_out,
                part_lse,
                sinks if sinks is not None else dummy,
                k_scale if k_scale is not None else dummy,
                v_scale if v_scale is not None else dummy,
                page_table if paged else dummy,
                cu_seqlens_q if cu_seqlens_q is not None else dummy,
                cu_seqlens_k if cu_seqlens_k is not None else dummy,
                cache_seqlens if cache_seqlens is not None else dummy,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1) if paged else k.stride(0),
                k.stride(-2),
                v.stride(0),
                v.stride(1) if paged else v.stride(0),
                v.stride(-2),
                out.stride(0),
                out.stride(1),
                page_table.stride(0) if paged else 0,
                num_q_heads,
                rows.q_len,
                rows.softmax_scale,
                logit_cap if logit_cap > 0 else 1.0,
                window_left,
            ),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.constexprs),
        )
    ]
    if splits > 1:
        launches.append(
            Launch(
                combine_kernel,
                (total_q, num_q_heads),
                (
                    part_out,
                    part_lse,
                    out,
                    lse if lse is not None else dummy,
                    sinks if sinks is not None else dummy,
                    v_scale if v_scale is not None else dummy,
                    out.stride(0),
                    out.stride(1),
                    num_q_heads,
                ),
                dict(
                    NUM_SPLITS=splits,
                    SPLITS_PAD=next_pow2(splits),
                    HEAD_DIM_V=v.shape[-1],
                    BLOCK_DV=block_dv,
                    HAS_SINKS=sinks is not None,
                    HAS_SCALES=v_scale is not None,
                    WRITE_LSE=lse is not None,
                    num_warps=1,
                ),
            )
        )
    return launches, scratch, (dummy,)


def launch(rows: QueryRows, *, splits: int, regime: str) -> None:
    """Launch :func:`build`'s launches for ``rows`` once (the uncached call)."""
    run_fresh(functools.partial(build, splits=splits, regime=regime), rows)


# The tensors of a call's rows that vary per run, in QueryRows' field order.
_ROW_INPUTS = by_fields(
    "q", "k", "v", "out", "lse", "sinks", "k_scale", "v_scale", "page_table", "cu_seqlens_q", "cu_seqlens_k",
    "cache_seqlens",
)  # fmt: skip


def _rows_key(rows: QueryRows, splits: int) -> tuple:
    """What :func:`build` reads of ``rows`` besides the tensors' addresses (the runner-cache key
    contract of ``tokenspeed_kernel_triton._runners``): shapes, strides, dtypes and device of
    q, k and v, out's strides, the page table's row stride, which optional tensors are present,
    the batch, the query rows' bound (the query-tile count and grid follow it; not the key
    bound, which only bounds the work), the options and the split count. The dtypes of out,
    lse, sinks, scales and tables are fixed by the operators' contracts (and checked per
    launch by ``BoundLaunch``)."""
    q, k, v, table = rows.q, rows.k, rows.v, rows.page_table
    return (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        k.shape,
        k.stride(),
        k.dtype,
        v.shape,
        v.stride(),
        rows.out.stride(),
        None if table is None else table.stride(0),
        rows.lse is None,
        rows.sinks is None,
        rows.k_scale is None,
        rows.v_scale is None,
        rows.cu_seqlens_q is None,
        rows.cu_seqlens_k is None,
        rows.cache_seqlens is None,
        rows.batch,
        rows.max_q,
        rows.q_len,
        rows.causal,
        rows.softmax_scale,
        rows.window_left,
        rows.logit_cap,
        splits,
    )


def planned(cache: RunnerCache[QueryRows], args: Any) -> Callable[[Any], None]:
    """The ``step_runner`` hook of a kernel whose calls ``cache`` serves (the core's step plans:
    ``PrefillPlan``, ``ExtendPlan``, ``DecodeStepPlan``): the runner of the plan's key
    (``RunnerCache.runner``), on each run's query rows (``functools.partial(planned, _RUNNERS)``
    at registration)."""
    run = cache.runner(query_rows(args))
    return lambda run_args: run(query_rows(run_args))


def runner_cache(name: str, regime: str, splits_of: Callable[[QueryRows], int]) -> RunnerCache[QueryRows]:
    """The functional calls' runner cache of one attention kernel (``regime`` as in
    :func:`build`; ``splits_of(rows)`` its split count): ``cache(rows)`` launches the runner
    bound for the rows' key, every tensor of the rows passed per run."""

    def key(rows: QueryRows) -> tuple:
        return _rows_key(rows, splits_of(rows))

    def bind(rows: QueryRows) -> Callable[[QueryRows], None]:
        return bind_runner(functools.partial(build, splits=splits_of(rows), regime=regime), rows, *_ROW_INPUTS)

    def fresh(rows: QueryRows) -> None:
        launch(rows, splits=splits_of(rows), regime=regime)

    return RunnerCache(name, key, bind, fresh)
