"""Gluon paged extend for Hopper after FlashAttention-3 (``attention.extend``, sm_90 only).

See :mod:`._gluon_extend_fa3_kernel` for the kernel: the dense FA3-style prefill's
warp-specialized design (one-warp TMA producer, two consumer warpgroups on ``wgmma``,
persistent heaviest-first grid) reading K/V from a paged cache by TMA, one box per page,
with the page ids fetched one key tile ahead. This module holds the schedule and page
arithmetic the kernel performs (mirrored in plain Python for the CPU tests), the call
checks, the descriptors, the launch and the registration.

How pages reach shared memory: TMA (``cp.async.bulk.tensor``) boxes ``[1, 1, BOX, D]`` of a
4-D view ``[num_pages, Hkv, P, D]`` of each cache (``BOX = min(P, BLOCK_N)``), so a strided
view (HND, vLLM's interleaved K|V rows, a stacked pool) is read through its own strides
with no gather arithmetic per row. At P = 16 and D = 64 a 128-key tile is 8 boxes of 2 KiB
per operand, 16 copies per step for one thread against ~2000 cycles of consumer math per
step, and one transaction-count ``expect`` per tile. ``cp.async`` gathers (FA3's paged
path) would need a 4-warp producer with per-row addressing and more registers; Blackwell's
TMA gather4 is not on sm_90. The price: a box is one 128-byte swizzle row wide (64
columns; D = 128 takes two per page) and must be whole 1 KiB swizzle atoms (8 rows: P >= 8),
and the strides must be 16-byte multiples (``kv_align`` 16).

Registered ``Priority.OPT_IN``: compiled and inspected ahead of time for sm_90a, not yet
run on a GPU. It does not serve: non-causal extend, logit caps, fp8 caches, head dims
other than 64/128, unequal q/v head dims, pages of fewer than 8 tokens, strided
caches whose strides or base are not 16-byte multiples, a row-strided q whose row stride or
base is not (``q_align`` below 16).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import cdiv, equal_head_dims, sm_count
from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    PAGE_SIZES,
    Q_DTYPES,
    TMA_ALIGN,
    VENDORS,
    attention_call_key,
    check_tma_q,
    head_tile_descriptor,
    never_read,
    planned_runner,
    written_and_sinks,
)
from tokenspeed_kernel_nvidia.ops.attention._tile_list import lists_tiles, walk
from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill_fa3 import (
    BLOCK_M,
    HALF,
    NO_WINDOW,
    TWO_CONSUMER_CONFIGS,
    Fa3Config,
    dirty,
    edge,
    grid,
    key_band,
)
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache, bind_runner, by_fields, derive_descriptor, run_fresh

__all__ = [
    "BLOCK_M",
    "NO_WINDOW",
    "ExtendPlan",
    "box_rows",
    "dirty",
    "gluon_extend_fa3",
    "key_band",
    "launch",
    "masked",
    "page_boxes",
    "supported_page",
]

HEAD_DIMS = (64, 128)
_SWIZZLE_ATOM = 1024  # bytes: a 128-byte-swizzled box must start on this boundary
_ALIGN = TMA_ALIGN  # TMA: 16-byte aligned bases and strides
SWIZZLE_COLS = 64  # bf16/fp16 columns of one 128-byte swizzle row: a box's width


def box_rows(page_size: int, block_n: int) -> int:
    """Rows of one TMA box: a whole page, or ``block_n`` rows of a page larger than a tile."""
    return min(page_size, block_n)


def supported_page(page_size: int, elem_bytes: int = 2, block_n: int = 128) -> bool:
    """Whether a page size composes a key tile of whole swizzle atoms: a power of two whose
    box (``box_rows`` rows of one 128-byte swizzle row) is a multiple of the 1 KiB atom
    (8 rows), at any head dim (a D = 128 row takes two boxes)."""
    rows = box_rows(page_size, block_n)
    return page_size in PAGE_SIZES and (rows * SWIZZLE_COLS * elem_bytes) % _SWIZZLE_ATOM == 0


# The band and the edge-tile test are the dense windowed prefill's (one definition, both kernels'
# ``_tile`` / ``_edge``): ``key_band(len_q, len_k, m0, block_n, window)``, ``masked(j, first,
# last, block_n, window)``.
# The dirty-tile rule (``dirty(j, p0, block_n, window)``: V cleaned before ``P·V``) is the
# dense kernel's too.
masked = edge


def page_boxes(j: int, block_n: int, page_size: int, len_k: int, max_pages: int) -> list[tuple[int | None, int]]:
    """The TMA boxes of key tile ``j``: ``(page_column, token)`` per box, ``page_column`` the
    page-table column (None: past the sequence's pages, the box gets the out-of-bounds page
    and is zero-filled) and ``token`` the first row of the page it reads."""
    rows = box_rows(page_size, block_n)
    out: list[tuple[int | None, int]] = []
    for r in range(block_n // rows):
        key = j * block_n + r * rows
        col = key // page_size
        ok = 0 <= col < min(cdiv(len_k, page_size), max_pages)
        out.append((col if ok else None, key % page_size))
    return out


def _supported(request: Request) -> str | None:
    why = equal_head_dims(request)
    if why:
        return why
    return None


def _aligned(t: torch.Tensor) -> bool:
    size = t.element_size()
    return t.data_ptr() % _ALIGN == 0 and all((s * size) % _ALIGN == 0 for s in t.stride()[:-1])


def _check_call(args: ExtendArgs) -> None:
    """What the request cannot express, checked before any launch (ValueError)."""
    if not args.causal:
        raise ValueError("gluon_extend_fa3_sm90 serves causal extend only (causal=False)")
    if args.logit_cap > 0:
        raise ValueError(f"gluon_extend_fa3_sm90 has no logit cap (logit_cap={args.logit_cap})")
    if not args.softmax_scale > 0:
        raise ValueError(f"gluon_extend_fa3_sm90 needs softmax_scale > 0 (got {args.softmax_scale})")
    if args.k_cache.dtype != args.q.dtype:
        raise ValueError(f"gluon_extend_fa3_sm90 needs the cache in q's dtype (k_cache is {args.k_cache.dtype})")
    page_size = args.k_cache.shape[1]
    if not supported_page(page_size, args.q.element_size()):
        raise ValueError(f"gluon_extend_fa3_sm90 cannot tile page_size {page_size} (TMA boxes of 8+ rows)")
    _check_addresses(args)


def _check_addresses(args: ExtendArgs) -> None:
    """What differs between calls of one key (the tensors' addresses; the caches' strides too,
    which a functional call's key does not fix), checked per call."""
    if args.q.data_ptr() % _ALIGN:
        raise ValueError(f"gluon_extend_fa3_sm90 needs q {_ALIGN}-byte aligned (TMA)")
    for name in ("k_cache", "v_cache"):
        if not _aligned(getattr(args, name)):
            raise ValueError(f"gluon_extend_fa3_sm90 needs {name}'s base and strides {_ALIGN}-byte multiples (TMA)")


@dataclass(frozen=True)
class ExtendPlan:
    """Host facts of one launch: the configuration (the dense kernel's ``Fa3Config``: tile,
    ring, register split and its variants ``exp2_poly``, ``rescale_threshold``,
    ``pv_overlap``, which the shared consumer applies here too; two consumer warpgroups
    only), the box rows and the layouts."""

    cfg: Fa3Config
    box: int
    page_size: int

    def __post_init__(self) -> None:
        if self.cfg.consumers != 2:
            raise ValueError(
                f"ExtendPlan: the paged extend runs two consumer warpgroups (consumers={self.cfg.consumers})"
            )
        if self.cfg.window:
            raise ValueError("ExtendPlan: the paged extend always runs the key band (its window is a runtime value)")
        if not self.cfg.clean_v:
            raise ValueError("ExtendPlan: the paged extend always cleans V on dirty tiles (stale cache slots)")

    @functools.cached_property
    def key(self) -> tuple:
        """What tells this build from another in a runner key: the configuration's tag (its
        every field, the variants included), the box rows and the page size."""
        return (self.cfg.tag, self.box, self.page_size)

    @functools.cached_property
    def layouts(self):
        """(Q_SMEM, KV_SMEM, S_MMA, O_MMA, BOX_SMEM, CLEAN): the dense kernel's layouts, the
        NVMMA layout of a ``[1, 1, box, D]`` TMA box (the same 128-byte swizzle), and the
        4-warp blocked layout of a ``[HALF, D]`` half V tile (16-byte vectors:
        ``Fa3Config.clean_layout``, the dense kernel's too)."""
        from triton.experimental.gluon import language as gl

        q_smem, kv_smem, s_mma, o_mma = self.cfg.layouts
        box_smem = gl.NVMMASharedLayout.get_default_for([1, 1, self.box, SWIZZLE_COLS], gl.bfloat16)
        return q_smem, kv_smem, s_mma, o_mma, box_smem, self.cfg.clean_layout

    def constexprs(self, num_q_heads: int, num_kv_heads: int, sinks: bool, lse: bool) -> dict:
        """The kernel's compile-time arguments (the launcher and the AOT compile pass the
        same): the dense kernel's (``Fa3Config.constexprs``, ``CLEAN`` included) and the paged ones."""
        _, kv_smem, *_ = self.layouts
        return {
            "HQ": num_q_heads,
            "G": num_q_heads // num_kv_heads,
            "D": self.cfg.head_dim,
            "PAGE": self.page_size,
            "BOX": self.box,
            "HAS_SINKS": sinks,
            "HAS_LSE": lse,
            "KV_SMEM": kv_smem,
            # the dense kernel's switch for the band (always on here: PAGED)
            **{k: v for k, v in self.cfg.constexprs().items() if k != "WINDOW"},
        }


@functools.cache
def extend_plan(head_dim: int, page_size: int, **variant) -> ExtendPlan:
    """The launch configuration: the dense kernel's two-consumer tile and ring
    (:data:`~tokenspeed_kernel_nvidia.ops.attention.gluon_prefill_fa3.TWO_CONSUMER_CONFIGS`) with
    the registers split 232 / 40 (``2 x 232 + 40 = 3 x 168``): the producer's page-id
    extraction spills at 24 registers (P = 8: 24 bytes), the D = 128 consumers at 224
    (64 bytes); ptxas reports no spills at 232 / 40 (tests/tokenspeed_kernel_nvidia/test_aot_extend_fa3.py).
    ``variant``: ``Fa3Config`` fields to change (``pv_overlap=True``, ``exp2_poly=1``,
    ``rescale_threshold=8.0``; off by default; ``consumers`` other than 2 is a ValueError)."""
    cfg = dataclasses.replace(TWO_CONSUMER_CONFIGS[head_dim], **({"consumer_regs": 232, "producer_regs": 40} | variant))
    return ExtendPlan(cfg, box_rows(page_size, cfg.block_n), page_size)


def _cache_descriptor(cache: torch.Tensor, box: int, layout):
    """A TMA descriptor over ``cache [num_pages, P, Hkv, D]`` (any strides, stride 1 in D)
    viewed ``[num_pages, Hkv, P, D]``, box ``[1, 1, box, 64]`` (one 128-byte swizzle row; a
    D = 128 row takes two boxes)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    pages, page_size, heads, dim = cache.shape
    sp, st, sh, _ = cache.stride()
    return TensorDescriptor(cache, [pages, heads, page_size, dim], [sp, sh, st, 1], [1, 1, box, SWIZZLE_COLS], layout)


@register_kernel(
    "attention.extend",
    name="gluon_extend_fa3_sm90",
    solution="gluon",
    vendors=VENDORS,
    archs=("sm_90",),
    capabilities=("tma", "wgmma"),
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    # Page sizes whose boxes are whole 1 KiB swizzle atoms (8 rows of 128 bytes): 8 .. 256.
    # A row-strided q (strided_q) too: its TMA descriptor has q's row stride, which with q's
    # base must be a 16-byte multiple (q_align 16).
    shapes={
        "head_dim": HEAD_DIMS,
        "head_dim_v": HEAD_DIMS,
        "page_size": PAGE_SIZES[3:],
        "kv_align": (TMA_ALIGN,),
        "q_align": (TMA_ALIGN,),
    },
    features=("sinks", "sliding_window", "return_lse", "strided_kv", "strided_q"),
    # First for unwindowed extend at head dim 64, where it was measured faster than
    # triton_extend (H200, 2026-11-28, `bench attention.extend --preset extend-lengths`: 2.7x at
    # 16 new tokens on a 6144-token prefix, 1.6x at 1024-2048, 1.5x at 4 x 512; on a ragged
    # 1024/300/37/2 batch 0.97x, 1.48x since the tile list); slower with GPT-OSS's 128-token
    # window (59.8 vs 41.4 us at 2048 on 6144), so windowed calls keep triton_extend. At D = 128
    # (`--preset extend-lengths-d128`, H200, 2026-11-28) 2.2-3.4x triton_extend at every length,
    # 2.1x on the ragged batch: first there too.
    priority=Priority.OPT_IN,
    rank_when=({"window_left": (None,), "head_dim": (64, 128)}, Priority.PERFORMANT),
    predicate=_supported,
    step_runner=lambda args: _planned(args),
)
def gluon_extend_fa3(args: ExtendArgs) -> None:
    """Gluon Hopper paged extend (FlashAttention-3 design): one-warp TMA producer reading
    the cache page by page, two ping-pong wgmma consumer warpgroups, persistent grid.

    q ``[total_q, Hq, D]`` (bf16/fp16, 16-byte aligned; contiguous or row-strided,
    ``strided_q``, its row stride a 16-byte multiple), k_cache/v_cache ``[num_pages, P,
    Hkv, D]`` in q's dtype (strided views allowed: stride 1 in D, the other strides and the
    base 16-byte multiples), page_table int32 ``[batch, max_pages]``, cache_seqlens int32
    ``[batch]`` (including the chunk), D 64 or 128, causal (query ``t`` at
    ``cache_seqlens[b] - len_q + t``), optional window and sinks (float32 ``[Hq]``); writes
    ``args.out`` ``[total_q, Hq, D]`` and ``args.lse`` (float32 ``[total_q, Hq]``) when given.
    A functional call runs the runner bound for its :func:`_runner_key`
    (``tokenspeed_kernel_triton._runners``): every tensor passed per run, the Q and cache TMA
    descriptors derived per run from the run's q and caches.
    """
    _check_call(args)
    _RUNNERS(args)


def launch(args: ExtendArgs, plan: ExtendPlan | None = None) -> None:
    """Check and launch once, uncached (``plan`` defaults to :func:`extend_plan`; one for
    another head dim or page size is a ValueError, before any launch)."""
    _check_call(args)
    run_fresh(functools.partial(_launches, plan=plan), args)


def _launches(args: ExtendArgs, plan: ExtendPlan | None = None) -> Built:
    """The launches of ``args`` (none for an empty batch), nothing kept, and the Q and K/V
    cache descriptors derived from q and the caches. A batch of several sequences whose
    longest has several query blocks first lists the work tiles that hold queries
    (:mod:`._tile_list`, its buffer the one scratch), and the kernel deals out only those
    (``TILE_LIST``): in a ragged batch the static walk over every tile handed the heavy
    tiles to a few programs."""
    from tokenspeed_kernel_nvidia.ops.attention._gluon_extend_fa3_kernel import extend_fa3_kernel

    total_q, num_q_heads, head_dim = args.q.shape
    num_pages, page_size, num_kv_heads, _ = args.k_cache.shape
    batch = args.cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return (), (), ()
    plan = plan or extend_plan(head_dim, page_size)
    if (plan.cfg.head_dim, plan.page_size) != (head_dim, page_size):
        raise ValueError(
            f"gluon_extend_fa3_sm90: plan is for head_dim {plan.cfg.head_dim}, page_size {plan.page_size}; "
            f"the call has {head_dim}, {page_size}"
        )
    # q's row stride is fixed by the runner key (its base is checked per run: _check_addresses)
    check_tma_q("gluon_extend_fa3_sm90", args.q)
    q_smem, _, _, _, box_smem, _ = plan.layouts
    programs, n_m = grid(args.max_seqlen_q, batch, num_q_heads, sm_count(args.q.device))
    table = args.page_table
    tiles = walk(args.cu_seqlens_q, total_q, args.max_seqlen_q, n_m, num_q_heads, plan.cfg.block_m)
    descriptors = (
        derive_descriptor(head_tile_descriptor, args.q, HALF, q_smem),
        derive_descriptor(_cache_descriptor, args.k_cache, plan.box, box_smem),
        derive_descriptor(_cache_descriptor, args.v_cache, plan.box, box_smem),
    )
    launch = Launch(
        extend_fa3_kernel,
        (programs,),
        (
            *(d.value for d in descriptors),
            *written_and_sinks(args),
            args.cu_seqlens_q,
            args.cache_seqlens,
            table,
            table.stride(0),
            table.shape[1],
            num_pages,
            float(args.softmax_scale),
            args.window_left if args.window_left >= 0 else NO_WINDOW,
            n_m,
            batch,
            tiles.tiles,
        ),
        dict(
            **plan.constexprs(num_q_heads, num_kv_heads, args.sinks is not None, args.lse is not None),
            TILE_LIST=tiles.listed,
            num_warps=4,
            maxnreg=plan.cfg.maxnreg,
        ),
    )
    return [*tiles.before, launch], tiles.scratch, (never_read(args.q.device),), descriptors


def _runner_key(args: ExtendArgs) -> tuple:
    """:func:`~tokenspeed_kernel_nvidia.ops.attention._common.attention_call_key` of q and the
    caches, the page table's shape and row stride (launch scalars), the build the runner binds
    (:func:`extend_plan`'s key: a variant is another build; before 2026-11-28 (third session)
    the key left it out, so a test that patched :func:`extend_plan` after a default call of the
    same shapes ran the default runner) and the persistent grid
    (program and query-block counts, which follow ``max_seqlen_q``; not ``max_seqlen_k``,
    which the launch does not read) and whether the launch lists its tiles."""
    q, table = args.q, args.page_table
    batch = args.cu_seqlens_q.shape[0] - 1
    programs, n_m = grid(args.max_seqlen_q, batch, q.shape[1], sm_count(q.device))
    return (
        attention_call_key(args, args.k_cache, args.v_cache),
        table.shape,
        table.stride(0),
        extend_plan(q.shape[2], args.k_cache.shape[1]).key,
        programs,
        n_m,
        lists_tiles(q.shape[0], args.max_seqlen_q, batch, n_m, BLOCK_M),
    )


# What varies per run: every tensor of a functional call.
_CALL_INPUTS = by_fields(
    "q", "k_cache", "v_cache", "page_table", "cu_seqlens_q", "cache_seqlens", "sinks", "out", "lse"
)
_RUNNERS = RunnerCache(
    "gluon_extend_fa3_sm90", _runner_key, lambda args: bind_runner(_launches, args, *_CALL_INPUTS), launch
)


def _check_bases(args: ExtendArgs) -> None:
    """A plan's run: the TMA operands' base addresses, at once (their strides are the plan's
    layout, checked with its first run's); one off names itself (:func:`_check_addresses`)."""
    if (args.q.data_ptr() | args.k_cache.data_ptr() | args.v_cache.data_ptr()) % _ALIGN:
        _check_addresses(args)


def _planned(args: ExtendArgs) -> Callable[[ExtendArgs], None]:
    """The ``step_runner`` hook (the core's ``ExtendPlan``): the runner of the plan's key (its runs
    skip the key and the checks the layout fixes; the base addresses are checked per run)."""
    _check_call(args)
    return planned_runner(_check_bases, _RUNNERS.runner(args))
