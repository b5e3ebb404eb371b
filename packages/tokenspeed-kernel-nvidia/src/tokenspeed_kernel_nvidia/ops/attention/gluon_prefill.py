"""Gluon sliding-window causal prefill for Hopper (``attention.prefill``, sm_90 only).

See :mod:`._gluon_prefill_kernel` for the kernel (TMA + mbarrier ring, ``wgmma`` for both
products, only the diagonal band of key tiles visited). This module holds the launch
configuration (data), the tile-range arithmetic the kernel performs (mirrored in plain
Python for the CPU tests), the grid, and the registration.

Registered opt-in, ranked first at GPT-OSS's window (127) and head dim 64 (``rank_when``),
where it was measured faster than ``triton_prefill`` (H100, docs/history.md; H200 2026-11-28: 120.5 us
at S = 8192 with sinks, 1.02x ``triton_prefill``, 1.50x flex_attention).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

from tokenspeed_kernel.kit import cdiv, equal_head_dims, next_pow2, sm_count
from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    Q_DTYPES,
    VENDORS,
    attention_call_key,
    head_tile_descriptor,
    never_read,
    row_stride,
    written_and_sinks,
)
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache, bind_runner, by_fields, derive_descriptor, run_fresh

__all__ = [
    "MAX_WINDOW",
    "GluonPrefillConfig",
    "band_tiles",
    "gluon_prefill_window",
    "grid",
    "launch",
    "persistent_grid",
    "prefill_config",
    "window_variants",
]

HEAD_DIMS = (64, 128)
BLOCK_M = 128  # wgmma rows per program (the shipped tile): BLOCK_T tokens x G_PAD query heads
MAX_GROUP = 16  # keeps BLOCK_T >= 8 tokens per program
# Beyond this the band is long enough that the dense prefill's tiles are the better fit. The
# request carries no window size (only the ``sliding_window`` feature), so this is checked
# at call time and documented; the kernel itself is correct for any window.
MAX_WINDOW = 1024
# Hopper's per-SM budget the persistent build's programs must share: registers, shared memory
# (sm_90: 228 KiB per SM, 1 KiB of it reserved per resident program).
REGS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
_SMEM_RESERVED = 1024


@dataclass(frozen=True, eq=True)
class GluonPrefillConfig:
    """Compile-time choices of one launch (also the AOT test's grid).

    ``group_pad`` query heads x ``block_t`` tokens = ``block_m`` rows (128; 256 an opt-in
    variant: twice the tokens per K/V tile); ``block_n`` keys per tile; ``stages`` K/V buffers
    in the TMA ring; ``num_warps`` 4 or 8 (one or two warpgroups over the rows). ``qk_ahead``
    (opt-in variant): the next key tile's ``Q·Kᵀ`` is issued before this tile's softmax, so the
    tensor cores work through it while the warps compute the softmax (FlashAttention-3's
    intra-warpgroup overlap; one more ``[block_m, block_n]`` fp32 tile in registers).
    ``maxnreg`` (opt-in variant): a cap on registers per thread at compile time (more programs
    per SM when registers are the limit), None for the compiler's choice. ``persistent``
    (opt-in variant): 0 for the tiled grid (one program per query tile and KV head), else the
    persistent build with this many programs per SM (``prefill_window_persistent_kernel``:
    each walks work items and loads the next item's Q and first K/V tiles while it finishes
    the current one; not with ``qk_ahead``). Its programs must all be resident at once, so
    the registers are capped to fit them (:attr:`register_cap`, unless ``maxnreg`` says) and
    their shared memory must fit an SM.
    """

    head_dim: int
    group_pad: int
    block_n: int = 64
    stages: int = 3
    num_warps: int = 4
    block_m: int = BLOCK_M
    qk_ahead: bool = False
    maxnreg: int | None = None
    persistent: int = 0

    def __post_init__(self) -> None:
        if self.persistent < 0:
            raise ValueError(f"persistent must be >= 0 programs per SM, got {self.persistent}")
        if self.persistent and self.qk_ahead:
            raise ValueError("persistent and qk_ahead: the persistent build has no Q·Kᵀ-ahead loop")
        if self.persistent * (self.shared_bytes() + _SMEM_RESERVED) > SMEM_PER_SM:
            raise ValueError(
                f"persistent={self.persistent} programs of {self.shared_bytes()} bytes of shared memory "
                f"do not fit an SM ({SMEM_PER_SM} bytes)"
            )

    @property
    def register_cap(self) -> int | None:
        """The ``maxnreg`` the build compiles with: ``maxnreg`` when given; for the persistent
        build, the most registers per thread (a multiple of 8, the allocation unit) that let
        ``persistent`` programs share an SM's register file; else None (the compiler's choice,
        also when the file would allow the most a thread can have, 255)."""
        if self.maxnreg or not self.persistent:
            return self.maxnreg
        cap = REGS_PER_SM // (self.persistent * self.num_warps * 32) // 8 * 8
        return cap if cap < 255 else None

    @property
    def block_t(self) -> int:
        return self.block_m // self.group_pad

    @property
    def tag(self) -> str:
        """A short name of the configuration (sweep rows)."""
        extra = ("-ahead" if self.qk_ahead else "") + (f"-r{self.maxnreg}" if self.maxnreg else "")
        extra += f"-p{self.persistent}" if self.persistent else ""
        return f"m{self.block_m}-n{self.block_n}-s{self.stages}-w{self.num_warps}{extra}"

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        """Explicit shared memory: Q tile (two in the persistent build) + K/V ring (+ barriers);
        scratch comes on top."""
        q_tiles = 2 if self.persistent else 1
        return elem_bytes * (q_tiles * self.block_m * self.head_dim + 2 * self.stages * self.block_n * self.head_dim)

    @functools.cached_property
    def layouts(self):
        """(IO, Q_SMEM, KV_SMEM, S_MMA, O_MMA): 16-byte vectors along D for the Q load and
        the output store; 128-byte-swizzled NVMMA shared layouts for the wgmma operands (and
        the TMA boxes); wgmma (v3) accumulators for ``S [128, block_n]`` and ``O [128, D]``."""
        from triton.experimental.gluon import language as gl

        tpw_d = min(self.head_dim // 8, 32)
        io = gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d], [self.num_warps, 1], [1, 0])
        q_smem = gl.NVMMASharedLayout.get_default_for([self.block_m, self.head_dim], gl.bfloat16)
        kv_smem = gl.NVMMASharedLayout.get_default_for([self.block_n, self.head_dim], gl.bfloat16)
        warps = [self.num_warps, 1]
        s_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, self.block_n, 16])
        o_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, self.head_dim, 16])
        return io, q_smem, kv_smem, s_mma, o_mma


@functools.cache
def prefill_config(head_dim: int, group: int) -> GluonPrefillConfig:
    """The launch configuration for a head dim and GQA group size (metadata as data)."""
    group_pad = next_pow2(group)
    if head_dim <= 64 and group_pad <= 8:
        # 64 rows (8+ tokens x the group) on one warpgroup, 32-key tiles, a 2-deep ring: 24 KiB;
        # at GPT-OSS's window 127 with sinks 100.1 vs 120.1 us (S = 8192) and 191 vs 232 us
        # (4 x 4096) for the 128 x 64 tiles on two warpgroups it replaced (H200, 2026-11-28,
        # docs/history.md, "fourth session"; fa3_sweep.py --window 127 --classic). Registers
        # capped at 80 (the compiler's choice is 90: five programs per SM; 80 fit six, no
        # spills): 96.1 vs 99.3 us and 183.2 vs 190.8 us (H200, fifth session, same sweep)
        return replace(_one_warpgroup(head_dim, group_pad), maxnreg=80)
    if head_dim <= 64:  # a group of 16: 128 rows keep 8 tokens per program
        return _two_warpgroups_d64(group_pad)
    return GluonPrefillConfig(head_dim=head_dim, group_pad=group_pad, block_n=64, stages=2, num_warps=8)


def _one_warpgroup(head_dim: int, group_pad: int) -> GluonPrefillConfig:
    # 64-row tiles on one warpgroup, 32-key tiles, a 2-deep ring: D = 64's configuration
    # since 2026-11-28 (groups up to 8), and the base of window_variants' neighbourhood
    return GluonPrefillConfig(head_dim=head_dim, group_pad=group_pad, block_n=32, stages=2, num_warps=4, block_m=64)


def _two_warpgroups_d64(group_pad: int) -> GluonPrefillConfig:
    # 128 x 64 tiles on two warpgroups, 3 stages (H100, 2026-11-23: 8 warps 115.5 vs 119.5 us
    # for 4 at S = 8192): D = 64's configuration until 2026-11-28, still for groups of 16
    return GluonPrefillConfig(head_dim=64, group_pad=group_pad, block_n=64, stages=3, num_warps=8)


def window_variants(head_dim: int, group: int) -> list[GluonPrefillConfig]:
    """The opt-in configurations ``ci/device/fa3_sweep.py --window W --classic`` times next to
    :func:`prefill_config`'s (and the GPU tests check on awkward shapes). The sweeps of
    2026-11-28 (H200, docs/history.md) chose 64-row tiles on one warpgroup with 32-key tiles and
    a 2-deep ring at D = 64 (more programs resident per SM, and an 8-token band of 135 keys read
    in 160 rather than 192); 256-row tiles, the next tile's ``Q·Kᵀ`` issued ahead of the
    softmax at 128 rows and 128-key tiles lost; the chosen tiles are capped at 80 registers
    since the fifth session (six programs of 128 threads per SM instead of five; 72 spills).
    These are the configuration it replaced, the chosen tiles without the cap (the compiler's
    90 registers) and their neighbourhood, and, second and third (timed first), the chosen
    tiles on the persistent build with five and six programs per SM (registers capped at 96 /
    80; its two Q buffers and ring take 32 KiB: six fit; 0.90x / 0.91x the tiled build in the
    fifth session's sweep)."""
    base = prefill_config(head_dim, group)
    old = _two_warpgroups_d64(base.group_pad) if head_dim <= 64 else replace(base, stages=3)
    small = _one_warpgroup(head_dim, base.group_pad)
    return [
        old,
        replace(small, persistent=5),
        replace(small, persistent=6),
        replace(small, stages=3),
        replace(small, stages=4),
        replace(small, qk_ahead=True),
        replace(small, block_n=16, stages=4),
        replace(old, block_n=32, stages=4),
        small,
    ]


def grid(max_seqlen_q: int, num_kv_heads: int, batch: int, block_t: int) -> tuple[int, int, int]:
    """``(q_tiles, Hkv, batch)``: programs past a sequence's length exit at once."""
    return (max(cdiv(max_seqlen_q, block_t), 1), num_kv_heads, batch)


def persistent_grid(tiled: tuple[int, int, int], programs_per_sm: int, num_sms: int) -> tuple[int, int]:
    """The persistent build's ``(programs, items)``: the items are the tiled grid's programs
    (``tiled`` = :func:`grid`; query tile fastest, then KV head, then sequence), the programs as
    many as fit the SMs (``programs_per_sm`` each), never more than the items. Program ``p``
    works items ``p, p + programs, ...``: at any time the resident programs hold neighbouring
    query tiles of a head, whose key bands overlap (shared K/V rows in L2)."""
    items = tiled[0] * tiled[1] * tiled[2]
    return max(min(items, programs_per_sm * num_sms), 1), items


def band_tiles(len_q: int, len_k: int, tile: int, block_t: int, block_n: int, window_left: int):
    """The key tiles program ``tile`` of a sequence visits (what the kernel computes).

    Returns ``[(start, masked), ...]``: key tile ``[start, start + block_n)`` (positions in
    the sequence) and whether it needs the mask; ``[]`` for a program past ``len_q``.
    """
    t0 = tile * block_t
    if t0 >= len_q:
        return []
    p0 = len_k - len_q + t0
    p1 = p0 + min(block_t, len_q - t0) - 1
    lo = max(p0 - window_left, 0)
    hi = min(p1 + 1, len_k)
    count = -(-max(hi - lo, 0) // block_n)
    tiles = []
    for i in range(count):
        start = lo + i * block_n
        tiles.append((start, start < p1 - window_left or start + block_n - 1 > p0))
    return tiles


def _supported(request: Request) -> str | None:
    if "sliding_window" not in request.features:
        return "no sliding window (window_left < 0): use the dense prefill"
    window = request.shape("window_left")
    if window is not None and window > MAX_WINDOW:
        return f"window_left={window} > {MAX_WINDOW}: a band this wide is the dense prefill's job"
    why = equal_head_dims(request)
    if why:
        return why
    hq, hkv = request.shape("num_q_heads"), request.shape("num_kv_heads")
    if hq and hkv and hq // hkv > MAX_GROUP:
        return f"GQA group of {hq // hkv} query heads exceeds {MAX_GROUP} (fewer than 8 tokens per 128-row tile)"
    return None


def _check_call(args: PrefillArgs) -> None:
    if not args.causal:
        raise ValueError("gluon_prefill_window_sm90 serves causal prefill only")
    if not 0 <= args.window_left <= MAX_WINDOW:
        raise ValueError(
            f"gluon_prefill_window_sm90 serves 0 <= window_left <= {MAX_WINDOW} (got {args.window_left}); "
            "use the dense prefill"
        )


@register_kernel(
    "attention.prefill",
    name="gluon_prefill_window_sm90",
    solution="gluon",
    vendors=VENDORS,
    archs=("sm_90",),
    capabilities=("tma", "wgmma"),
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": HEAD_DIMS},
    # strided_q: q (loaded with plain loads, through its row stride) may be a fused qkv's q;
    # k/v are read by TMA, so unaligned_qkv stays out
    features=("sinks", "sliding_window", "logit_cap", "return_lse", "strided_q"),
    priority=Priority.OPT_IN,
    # First at GPT-OSS's 128-token window and head dim 64, where it was measured faster than
    # triton_prefill on the H100 (docs/history.md, "Prefill: does the selector pick the fastest?").
    rank_when=({"window_left": (127,), "head_dim": (64,)}, Priority.PERFORMANT),
    predicate=_supported,
    step_runner=lambda args: _planned(args),
)
def gluon_prefill_window(args: PrefillArgs) -> None:
    """Gluon Hopper sliding-window causal prefill: TMA K/V ring, wgmma, band-only tiles.

    q ``[total_q, Hq, D]`` (contiguous or row-strided: ``strided_q``), k/v ``[total_k, Hkv,
    D]`` (bf16/fp16, contiguous), D 64 or 128, ``0 <= window_left <= MAX_WINDOW``; writes ``args.out`` and ``args.lse`` when given.
    A functional call runs the runner bound for its :func:`_runner_key`
    (``tokenspeed_kernel_triton._runners``): every tensor passed per run, the K/V TMA
    descriptors derived per run from the run's k and v.
    """
    _check_call(args)
    _RUNNERS(args)


def launch(args: PrefillArgs, cfg: GluonPrefillConfig | None = None) -> None:
    """Check and launch once, uncached, with ``cfg`` (default :func:`prefill_config`); the
    device script passes alternatives (e.g. 8 warps for D=64) to time them in the same run."""
    _check_call(args)
    run_fresh(functools.partial(_launches, cfg=cfg), args)


def _launches(args: PrefillArgs, cfg: GluonPrefillConfig | None = None) -> Built:
    """The launch of ``args`` (none for an empty batch), no scratch, nothing kept, and the
    K/V descriptors derived from k and v."""
    from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_kernel import (
        prefill_window_kernel,
        prefill_window_persistent_kernel,
    )

    total_q, num_q_heads, head_dim = args.q.shape
    num_kv_heads = args.k.shape[1]
    batch = args.cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return (), (), ()
    group = num_q_heads // num_kv_heads
    cfg = cfg or prefill_config(head_dim, group)
    if cfg.persistent and not _q_copyable(args.q):  # the tiled build: same tiles, same numbers
        cfg = replace(cfg, persistent=0)
    io, q_smem, kv_smem, s_mma, o_mma = cfg.layouts
    k_desc = derive_descriptor(head_tile_descriptor, args.k, cfg.block_n, kv_smem)
    v_desc = derive_descriptor(head_tile_descriptor, args.v, cfg.block_n, kv_smem)
    constexprs = dict(
        HQ=num_q_heads,
        HKV=num_kv_heads,
        G=group,
        G_PAD=cfg.group_pad,
        D=head_dim,
        BLOCK_T=cfg.block_t,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        QK_AHEAD=cfg.qk_ahead,
        HAS_SINKS=args.sinks is not None,
        HAS_CAP=args.logit_cap > 0,
        HAS_LSE=args.lse is not None,
        IO=io,
        Q_SMEM=q_smem,
        S_MMA=s_mma,
        O_MMA=o_mma,
        Q_ROW=row_stride(args.q),  # HQ * D, or a row-strided q's row stride (strided_q)
        num_warps=cfg.num_warps,
        **({"maxnreg": cfg.register_cap} if cfg.register_cap else {}),
    )
    tensors = (
        args.q,
        *written_and_sinks(args),
        k_desc.value,
        v_desc.value,
        args.cu_seqlens_q,
        args.cu_seqlens_k,
    )
    scalars = (float(args.softmax_scale), float(args.logit_cap) or 1.0, int(args.window_left))
    tiled = grid(args.max_seqlen_q, num_kv_heads, batch, cfg.block_t)
    if cfg.persistent:  # (programs,) walking the tiled grid's items; no Q·Kᵀ-ahead loop
        programs, items = persistent_grid(tiled, cfg.persistent, sm_count(args.q.device))
        del constexprs["QK_AHEAD"]
        launch = Launch(
            prefill_window_persistent_kernel, (programs,), (*tensors, *scalars, tiled[0], items), constexprs
        )
    else:
        launch = Launch(prefill_window_kernel, tiled, (*tensors, *scalars), constexprs)
    return [launch], (), (never_read(args.q.device),), (k_desc, v_desc)


def _q_copyable(q) -> bool:
    """Whether the persistent build's ``cp.async`` can copy q's rows (4 bytes at least: a
    16-byte aligned base, the JIT's alignment hint, and an even row stride); else the
    launcher runs the tiled build, whose plain loads take any q."""
    return q.data_ptr() % 16 == 0 and row_stride(q) % 2 == 0


def _runner_key(args: PrefillArgs) -> tuple:
    """:func:`~tokenspeed_kernel_nvidia.ops.attention._common.attention_call_key` and the grid
    (the query-tile count follows ``max_seqlen_q``; calls with the same count share a runner);
    for a persistent configuration also whether q takes its build (:func:`_q_copyable`)."""
    head_dim, num_kv_heads = args.q.shape[2], args.k.shape[1]
    cfg = prefill_config(head_dim, args.q.shape[1] // num_kv_heads)
    batch = args.cu_seqlens_q.shape[0] - 1
    key = attention_call_key(args, args.k, args.v), grid(args.max_seqlen_q, num_kv_heads, batch, cfg.block_t)
    return (*key, _q_copyable(args.q)) if cfg.persistent else key


# What varies per run: every tensor of a functional call.
_CALL_INPUTS = by_fields("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "sinks", "out", "lse")
_RUNNERS = RunnerCache(
    "gluon_prefill_window_sm90", _runner_key, lambda args: bind_runner(_launches, args, *_CALL_INPUTS), launch
)


def _planned(args: PrefillArgs) -> Callable[[PrefillArgs], None]:
    """The ``step_runner`` hook (the core's ``PrefillPlan``): the runner of the plan's key (nothing of
    the call's checks depends on an address)."""
    _check_call(args)
    return _RUNNERS.runner(args)
