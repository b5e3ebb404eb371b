"""Gluon paged split-KV decode for Hopper (``attention.decode``, sm_90 only).

See :mod:`._gluon_decode_kernel` for the kernel. This module chooses the layouts and the
split count, owns the float32 split workspace, and registers the kernel. The kernel uses
``cp.async`` + ``mma.sync`` (which also run on Ampere), but its tile/stage choices were
made for Hopper's shared memory and bandwidth and it is only verified there, so it is
registered for ``sm_90`` alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import cdiv, equal_head_dims, fill_splits, next_pow2, sm_count
from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia._workspace import workspace
from tokenspeed_kernel_nvidia.ops.attention._common import PAGE_SIZES, Q_DTYPES, VENDORS, row_stride
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache, bind_runner, by_fields, run_fresh

__all__ = ["GluonDecodeConfig", "decode_config", "gluon_decode"]

HEAD_DIMS = (64, 128)
# Request batch_bucket values (batch rounded up to a power of two) where this kernel ranks
# first: every bucket measured on the H100 (docs/history.md, "Gluon decode ranked first"),
# where it is 1-30% faster than triton_decode (B=64 ctx 8192 374.8 vs 377.7 µs, B=1 15.2 vs
# 18.4); above 512 nothing was measured.
FIRST_AT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BLOCK_M = 16  # MMA rows: the GQA group is padded to 16
NO_WINDOW = 2**30


@dataclass(frozen=True, eq=True)
class GluonDecodeConfig:
    """Compile-time choices of one launch (also the AOT test's grid)."""

    head_dim: int
    page_size: int
    block_n: int = 64
    stages: int = 3
    num_warps: int = 4
    # Up to this many splits, the last split program of each (sequence, KV head) merges them
    # (one launch; :mod:`._gluon_decode_kernel`); above it, a second combine launch does.
    # H100, 2026-11-23 (docs/history.md, "Gluon decode split count"): the in-kernel
    # merge is a serial loop over the splits, 0.3-1.1 µs faster at 1-8 splits (window-128
    # decode 9.4 -> 8.7 µs, B=256 ctx 2048 400.9 -> 392.5 µs) and slower at 16 and more
    # (B=1 ctx 8192, 32 splits: 15.3 -> 22.2 µs). 0: never.
    fused_max_splits: int = 8

    @functools.cached_property
    def layouts(self):
        """(LOAD, SMEM, MMA) layouts: 16-byte vectors along D for the gathers, a swizzled
        shared layout for conflict-free ldmatrix, mma v2 with the 4 warps along N."""
        from triton.experimental.gluon import language as gl

        tpw_d = min(self.head_dim // 8, 32)
        load = gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d], [self.num_warps, 1], [1, 0])
        smem = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, self.num_warps], instr_shape=[16, 8])
        return load, smem, mma


# Grids (programs = batch x KV heads x splits) that run faster with a 2-stage ring than a
# 3-stage one. H100, 2026-11-23 (docs/history.md, "Gluon decode ranked first"; GPT-OSS
# shapes, one split each): 512 programs (B=64 ctx 8192) 376.8 vs 388.0 µs, window-128 14.4 vs
# 15.2; 1024 (B=128 ctx 8192) 759.2 vs 768.9; but 2048 (B=256 ctx 2048) 405.9 vs 393.2, and
# at the small batches' 40-320 split programs 0.4-1.8% slower.
TWO_STAGE_PROGRAMS = (512, 1024)


def decode_config(head_dim: int, page_size: int, programs: int = 0) -> GluonDecodeConfig:
    """The launch configuration; ``programs`` (the grid size, once the split count is known)
    picks the ring depth: 2 stages within :data:`TWO_STAGE_PROGRAMS`, else 3. The tile
    (``block_n``, which the split count depends on) does not depend on it."""
    lo, hi = TWO_STAGE_PROGRAMS
    return _config(head_dim, page_size, 2 if lo <= programs <= hi else 3)


@functools.cache
def _config(head_dim: int, page_size: int, stages: int) -> GluonDecodeConfig:
    return GluonDecodeConfig(head_dim, page_size, block_n=64 if head_dim <= 64 else 32, stages=stages)


def num_splits(batch: int, num_kv_heads: int, visible: int, num_sms: int, block_n: int) -> int:
    """Enough programs to cover the SMs about twice; splits of at least 2 tiles, or of 1 tile
    when the span is at most 4 tiles (a sliding window); never an empty split (the kernel
    rounds each split up to whole tiles, so the count is trimmed to what the tiles fill).

    H100 sweeps (2026-11-23, ``ci/device/decode_splits_sweep.py``, graph replay, sinks):
    B = 1 ctx 2048, 16 splits of 2 tiles 10.7-10.9 µs against 11.8-11.9 for 8 of 4 tiles;
    ctx 8192, 32 splits 15.3-15.4 µs (33, one of them empty, 15.8); window 128 (3 tiles),
    3 splits 9.1 µs against 9.6 for 2 and 10.3 for 1."""
    tiles = max(1, cdiv(visible, block_n))
    least = 1 if tiles <= 4 else 2
    splits = fill_splits(batch * num_kv_heads, num_sms, most=min(cdiv(tiles, least), 64))
    return int(cdiv(tiles, cdiv(tiles, splits)))


def _group_fits(request: Request) -> str | None:
    why = equal_head_dims(request)
    if why:
        return why
    hq, hkv = request.shape("num_q_heads"), request.shape("num_kv_heads")
    if hq and hkv and hq // hkv > BLOCK_M:
        return f"GQA group of {hq // hkv} query heads exceeds the {BLOCK_M} MMA rows"
    q_len = request.shape("q_len")
    if q_len is not None and q_len != 1:
        return "q_len > 1 (speculative decode) not supported"
    return None


def _partials(device: torch.device, batch: int, heads: int, splits: int, head_dim: int):
    """The float32 split partials: out ``[B, HQ, SPLITS, D]`` and lse ``[B, HQ, SPLITS]``."""
    return (
        workspace(device, "decode_part_out", (batch, heads, splits, head_dim), torch.float32),
        workspace(device, "decode_part_lse", (batch, heads, splits), torch.float32),
    )


def _split_count(args: DecodeArgs) -> int:
    """The key-range split count of a call (:func:`num_splits` over the keys it can see; the
    tile does not depend on the ring depth): what :func:`_launches` binds and
    :func:`_runner_key` keys, from one computation."""
    batch, _, _, head_dim = args.q.shape
    _, page_size, num_kv_heads, _ = args.k_cache.shape
    visible = args.max_seqlen_k if args.window_left < 0 else min(args.max_seqlen_k, args.window_left + 1)
    return num_splits(batch, num_kv_heads, visible, sm_count(args.q.device), decode_config(head_dim, page_size).block_n)


def _launches(args: DecodeArgs) -> Built:
    """The launches of ``args`` (the decode, then the merge when it is not fused), no scratch,
    and the workspaces they use: configuration, split count, strides and constexprs worked out here.
    ``args`` may hold a plan's placeholders for q/out/lse: only their shapes, dtypes and
    device are read."""
    from tokenspeed_kernel_nvidia.ops.attention._gluon_decode_kernel import combine_kernel, decode_kernel

    batch, _, num_q_heads, head_dim = args.q.shape
    _, page_size, num_kv_heads, _ = args.k_cache.shape
    device = args.q.device
    window = args.window_left if args.window_left >= 0 else NO_WINDOW
    splits = _split_count(args)
    cfg = decode_config(head_dim, page_size, batch * num_kv_heads * splits)
    part_out, part_lse = _partials(device, batch, num_q_heads, splits, head_dim)
    load, smem, mma = cfg.layouts
    fused = splits <= cfg.fused_max_splits
    # The fused merge's per-(sequence, KV head) arrival counters: zeroed once, and reset to
    # 0 by the program that merges, so every call (and graph replay) starts from 0. Without
    # the fused merge the kernel never dereferences them. Absent operands get a placeholder
    # pointer the kernel never dereferences (a workspace).
    count = workspace(device, "decode_count", (batch * num_kv_heads,), torch.int32, zero=True)
    sinks = args.sinks if args.sinks is not None else part_lse
    lse = args.lse if args.lse is not None else part_lse
    scalars = (
        args.page_table.stride(0),
        *args.k_cache.stride()[:3],
        *args.v_cache.stride()[:3],
        float(args.softmax_scale),
        float(args.logit_cap) or 1.0,
        window,
    )
    constexprs = dict(
        HQ=num_q_heads,
        HKV=num_kv_heads,
        G=num_q_heads // num_kv_heads,
        D=head_dim,
        PAGE=page_size,
        SPLITS=splits,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        HAS_CAP=args.logit_cap > 0,
        LOAD=load,
        SMEM=smem,
        MMA=mma,
        FUSED=fused,
        HAS_SINKS=args.sinks is not None,
        HAS_LSE=args.lse is not None,
        # q's row stride (a row-strided q, strided_q), HQ * D for a contiguous q; a plan's
        # placeholder q carries its runs' row stride (mha_decode_plan's q_row_stride), or
        # none (a broadcast view: HQ * D) where its runs' q is contiguous
        Q_ROW=row_stride(args.q),
        num_warps=cfg.num_warps,
    )
    tables = (args.k_cache, args.v_cache, args.page_table, args.cache_seqlens, part_out, part_lse, sinks)
    launches = [
        Launch(
            decode_kernel, (batch, num_kv_heads, splits), (args.q, *tables, args.out, lse, count, *scalars), constexprs
        )
    ]
    if not fused:
        combine = dict(
            HQ=num_q_heads,
            D=head_dim,
            SPLITS=splits,
            SPLITS_P2=next_pow2(splits),
            HAS_SINKS=args.sinks is not None,
            HAS_LSE=args.lse is not None,
            num_warps=2,
        )
        launches.append(
            Launch(combine_kernel, (batch, num_q_heads), (part_out, part_lse, sinks, args.out, lse), combine)
        )
    return launches, (), (part_out, part_lse, count)


def _fresh(args: DecodeArgs) -> None:
    """One call, bound afresh and launched through ``jit_launch`` (the uncached path)."""
    run_fresh(_launches, args)


# What varies per run: a plan's q, out and lse; a functional call's every tensor.
_PLAN_INPUTS = by_fields("q", "out", "lse")
_CALL_INPUTS = by_fields("q", "k_cache", "v_cache", "page_table", "cache_seqlens", "sinks", "out", "lse")


def bind_decode(args: DecodeArgs) -> Callable[[DecodeArgs], None]:
    """The ``bind`` hook (``DecodePlan``): the launches of the plan's calls bound once; a run
    launches them with its q, out and lse (the plan's caches, tables and sinks bound).
    ``args`` holds the plan's placeholders for q/out/lse; q's has the runs' strides (a plan
    made with ``q_row_stride``: the strided build, ``Q_ROW`` its row stride)."""
    keep = (args.k_cache, args.v_cache, args.page_table, args.cache_seqlens, args.sinks)
    return bind_runner(_launches, args, *_PLAN_INPUTS, keep=keep)


def _bind_call(args: DecodeArgs) -> Callable[[DecodeArgs], None]:
    """A functional call's runner (:data:`_RUNNERS`): every tensor of the call (q, caches,
    page table, lengths, sinks, out, lse) passed per run; the workspaces bound."""
    return bind_runner(_launches, args, *_CALL_INPUTS)


def _runner_key(args: DecodeArgs) -> tuple:
    """What :func:`_launches` reads of a call besides the tensors' addresses: shapes,
    strides, dtypes and device of every tensor (q's strides: its row stride is the kernel's
    ``Q_ROW``), the scalars, and the split count (not
    ``max_seqlen_k`` itself, which grows every decode step). A tensor's dtype or alignment
    that differs from the bound runner's first launch takes that launch's checked path."""
    q, k, v, table = args.q, args.k_cache, args.v_cache, args.page_table
    splits = _split_count(args)
    sinks, lse = args.sinks, args.lse
    return (
        q.shape,
        q.stride(),
        q.dtype,
        q.device,
        k.shape,
        k.dtype,
        k.stride(),
        v.stride(),
        table.stride(0),
        splits,
        args.window_left,
        args.softmax_scale,
        args.logit_cap,
        None if sinks is None else sinks.dtype,
        None if lse is None else lse.dtype,
    )


# Functional calls' runners, by _runner_key (the keys repeat across layers and steps).
_RUNNERS = RunnerCache("gluon_decode_sm90", _runner_key, _bind_call, _fresh)


@register_kernel(
    "attention.decode",
    name="gluon_decode_sm90",
    solution="gluon",
    vendors=VENDORS,
    archs=("sm_90",),
    capabilities=("cp_async",),
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    # Strided caches too, when 16-byte aligned (the cp.async copies are 16 bytes wide).
    shapes={"head_dim": HEAD_DIMS, "page_size": PAGE_SIZES, "kv_align": (16,)},
    # strided_q: a row-strided q (a fused qkv's q) read in place, at any alignment (q is
    # loaded with plain loads, through its row stride: Q_ROW)
    features=("sinks", "sliding_window", "logit_cap", "return_lse", "strided_kv", "strided_q"),
    priority=Priority.OPT_IN,
    # First where it was measured faster, at GPT-OSS's head dim (FIRST_AT_BATCHES).
    rank_when=({"batch_bucket": FIRST_AT_BATCHES, "head_dim": (64,)}, Priority.PERFORMANT),
    predicate=_group_fits,
    bind=bind_decode,
    # A step plan's runs: the functional runner of the step's key (every tensor per run).
    step_runner=_RUNNERS.runner,
)
def gluon_decode(args: DecodeArgs) -> None:
    """Gluon Hopper decode: cp.async multi-stage gather of paged K/V, GQA group on
    mma.sync, split-KV with a combine that adds the sink. A 3-D q may be row-strided (a
    fused qkv's q, ``strided_q``): it is read in place through its row stride. A plan binds it
    once (:func:`bind_decode`; a row-strided q's plan, ``q_row_stride``, for its row stride); a functional call runs the runner bound for its
    :func:`_runner_key` (``tokenspeed_kernel_triton._runners``), every tensor passed per run,
    and a step plan that runner directly (``step_runner``: the key looked up once per step)."""
    _RUNNERS(args)
