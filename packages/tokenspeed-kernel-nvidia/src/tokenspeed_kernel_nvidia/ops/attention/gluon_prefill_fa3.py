"""Gluon dense causal prefill for Hopper after FlashAttention-3 (``attention.prefill``, sm_90 only),
with or without a sliding window.

See :mod:`._gluon_prefill_fa3_kernel` for the kernel (warp-specialized: a one-warp TMA
producer and two or three ping-ponging consumer warpgroups on ``wgmma`` with intra-warpgroup overlap;
persistent, heaviest tiles first). This module holds the launch configuration (data), the
schedule arithmetic the kernel performs (mirrored in plain Python for the CPU tests), the
grid, and the registration.

Per-head tiles, not GQA packing: a work tile is 64 tokens per consumer warpgroup (192 at
head dim 64, 128 at 128) of one query head.
For dense causal attention packing saves no K/V traffic per query row (a tile of 16 tokens
x 8 heads reads the same keys as one of 128 tokens x 1 head, for the same 128 rows), while
per-head tiles keep the causal diagonal square (at most two masked key tiles per tile),
load Q as one 2-D TMA box, and give the sink one value per tile; the 8 heads of a KV head
are adjacent in the tile order, so their K/V reads share L2.

Ranked at ``Priority.PERFORMANT`` from the 2048-query bucket (:data:`RANKED_FROM_QUERIES`),
``OPT_IN`` below: first for causal unwindowed prefill of 2048+ queries where FA4
(``fa4_prefill_sm90``, an opt-in bundle ranked above it) is not installed. Since 2026-11-28
head dim 64 runs three consumer warpgroups (H200: 472 / 416 TFLOP/s at S = 8192 / 4 x 4096
with sinks and the V cleaning, against 412 / 390 with two; docs/nvidia.md). Its first GPU run
(H200, 2026-11-27, ci/device/verify_pending.sh fa3g): float64 numerics passed (GPU tests, ``check
--preset awkward`` 4/4 served cases, every sweep configuration), and at GPT-OSS-120B's shape
(64/8 heads, bf16, causal, sinks) S = 8192 took 1.268 ms (434 TFLOP/s; 1.277 without sinks)
and B = 4 x 4096 1.324 ms (415 TFLOP/s): 1.21x / 1.17x ``triton_prefill``, 0.96x / 0.95x cuDNN
SDPA (no sinks), 0.82x / 0.86x FA4. Head dim 128: 595 / 541 TFLOP/s, 2.3x ``triton_prefill``.
With the ping-pong hand-off off (``-free`` in the sweep) it is 0.3-2% slower.

``gluon_prefill_fa3_window_sm90`` is the same kernel built with a sliding window
(``Fa3Config.window``, :func:`fa3_window_config`): each work tile visits only its key band
(:func:`key_band`) in 64-key tiles, masking the band's edge tiles (:func:`edge`). A separate
registration at ``Priority.OPT_IN``: correct on an H200 (2026-11-28) but 0.61x
``gluon_prefill_window_sm90`` at window 127 (197.7 vs 120.5 us at S = 8192), which stays first.

Both builds clean V on dirty key tiles (2026-11-28; :func:`dirty`, ``Fa3Config.clean_v``):
before, a NaN/inf key or value that a query cannot see (causally later, outside its window, or
the next sequence's rows that a sequence's last key tile reads in the dense view) reached it
through ``0 x NaN`` inside ``wgmma``, against docs/api.md. Found on an H200 by
``test_edge_inputs.py``'s GPT-OSS-layout case (window 5, the windowed build); the causal
unwindowed case, which the ranked build serves, was not in that list then. Cost of the
cleaning: 4.6-7.0 % (H200, two-warpgroup build, ``fa3_sweep.py --clean-ab``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import cdiv, equal_head_dims, sm_count
from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    Q_DTYPES,
    TMA_ALIGN,
    VENDORS,
    attention_call_key,
    check_tma_q,
    fa3_head_constexprs,
    head_tile_descriptor,
    never_read,
    planned_runner,
    written_and_sinks,
)
from tokenspeed_kernel_nvidia.ops.attention._tile_list import lists_tiles, walk
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache, bind_runner, by_fields, derive_descriptor, run_fresh

__all__ = [
    "BLOCK_M",
    "EXP2_POLY",
    "HALF",
    "NO_WINDOW",
    "TWO_CONSUMER_CONFIGS",
    "WIDE",
    "Fa3Config",
    "dirty",
    "edge",
    "exp2_fma_reference",
    "fa3_config",
    "fa3_variant",
    "fa3_window_config",
    "gluon_prefill_fa3",
    "gluon_prefill_fa3_window",
    "grid",
    "key_band",
    "key_tiles",
    "launch",
    "tile_order",
]

HEAD_DIMS = (64, 128)
HALF = 64  # query rows per consumer warpgroup (one m64 wgmma row block)
BLOCK_M = 2 * HALF  # query tokens per work tile (two consumer warpgroups; Fa3Config.block_m in general)
# strided_q: q's TMA descriptor has q's own row stride (a fused qkv's q read in place); a q
# whose row stride or base is not a 16-byte multiple asks for unaligned_qkv, which both omit
FEATURES = ("sinks", "return_lse", "strided_q")
WINDOW_FEATURES = ("sinks", "sliding_window", "return_lse", "strided_q")
NO_WINDOW = 2**30  # the kernel's window without one (keys never sit that far back)
_ALIGN = TMA_ALIGN  # TMA: 16-byte aligned bases (q, k, v) and row strides


@dataclass(frozen=True, eq=True)
class Fa3Config:
    """Compile-time choices of one launch (also the AOT test's grid).

    ``block_n`` keys per K/V tile; ``stages`` K/V buffers in the TMA ring; the register
    split of the warp specialization: ``maxnreg`` per thread at launch over
    ``4 * (consumers + 1)`` warps (the consumer warpgroups + the producer's, padded to a
    warpgroup), then ``consumer_regs`` for each consumer warpgroup and ``producer_regs`` for
    the producer (``consumers * consumer + producer <= (consumers + 1) * maxnreg``);
    ``pingpong``: the consumer warpgroups issue their wgmma rounds in turn (FA3's schedule)
    or freely.

    Variants (off by default; ci/device/fa3_sweep.py times them):

    - ``consumers``: consumer warpgroups of 64 query rows each, so a work tile holds
      ``64 * consumers`` tokens (3: FA3's choice at head dim 64; needs ``maxnreg = 128`` and
      ``consumer_regs <= 160``, see :data:`WIDE`);
    - ``exp2_poly``: of every 8 exponentials of a score tile, this many run on the FMA pipe
      (Cody-Waite split + the degree-3 polynomial :data:`EXP2_POLY`) instead of MUFU.EX2,
      whose 16 lanes per SM bound the softmax at head dim 64;
    - ``rescale_threshold``: a positive value (base-2 units) keeps a row's running max until
      a tile raises it by more than this (one warpgroup-wide vote per tile skips ``O *=
      alpha`` when no row needs it); exact, since the sum and the output use the same max,
      and ``exp2(s - m) <= 2**threshold`` stays far from overflow;
    - ``pv_overlap``: the softmax of key tile ``i`` runs under the ``P·V`` product of tile
      ``i - 1`` in the SASS too. Without it ptxas hoists the ``P·V`` wait to the top of the
      softmax's basic block (the PTX asks for it after the softmax); with it an mbarrier wait
      that passes at once (``V_{i-1}`` is still held) ends that block, and the wait stays
      after the exponentials (the new P is packed after it). Same arithmetic, same order.

    ``window``: the sliding-window build (``gluon_prefill_fa3_window_sm90``): each work tile
    visits only its key band (:func:`key_band`) and masks the band's edge tiles
    (:func:`edge`) with the window compare; off, the causal-only code is unchanged (its SASS
    is byte-identical to the build before the switch existed).

    ``clean_v``: on (always, in every shipped build) each consumer warpgroup zeroes the
    non-finite values of its share of a V tile some row of the work tile masks (:func:`dirty`)
    before ``P·V``, so a NaN/inf key or value a query cannot see never reaches it (docs/api.md;
    0 x NaN is NaN inside ``wgmma``). Off: the kernel before that fix, which leaks such values;
    for ``ci/device/fa3_sweep.py --clean-ab`` only (the cleaning's cost measured in one call).
    """

    head_dim: int
    block_n: int = 128
    stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168
    pingpong: bool = True
    consumers: int = 2
    exp2_poly: int = 0
    rescale_threshold: float = 0.0
    pv_overlap: bool = False
    window: bool = False
    clean_v: bool = True

    def __post_init__(self) -> None:
        if self.consumers not in (2, 3):
            raise ValueError(f"Fa3Config.consumers must be 2 or 3 (got {self.consumers})")
        if not 0 <= self.exp2_poly <= EXP2_PACK:
            raise ValueError(f"Fa3Config.exp2_poly must be in [0, {EXP2_PACK}] (got {self.exp2_poly})")
        if self.rescale_threshold < 0 or self.rescale_threshold > 32:
            raise ValueError(f"Fa3Config.rescale_threshold must be in [0, 32] (got {self.rescale_threshold})")
        warpgroups = self.consumers + 1
        if warpgroups * 128 * self.maxnreg > 65536:
            raise ValueError(f"Fa3Config.maxnreg={self.maxnreg} x {warpgroups * 128} threads exceeds 65536 registers")
        if self.consumers * self.consumer_regs + self.producer_regs > warpgroups * self.maxnreg:
            raise ValueError(
                f"Fa3Config: {self.consumers} x consumer_regs={self.consumer_regs} + producer_regs="
                f"{self.producer_regs} exceeds {warpgroups} x maxnreg={self.maxnreg}"
            )

    @property
    def block_m(self) -> int:
        """Query tokens per work tile: one 64-row half per consumer warpgroup."""
        return self.consumers * HALF

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        """Explicit shared memory: the Q halves + the K and V rings (barriers come on top)."""
        return elem_bytes * self.head_dim * (self.block_m + 2 * self.stages * self.block_n)

    @property
    def tag(self) -> str:
        tag = f"d{self.head_dim}-n{self.block_n}-st{self.stages}-r{self.consumer_regs}.{self.producer_regs}"
        tag += "" if self.pingpong else "-free"
        tag += "" if self.consumers == 2 else f"-wg{self.consumers}"
        tag += f"-ex{self.exp2_poly}" if self.exp2_poly else ""
        tag += "-ov" if self.pv_overlap else ""
        tag += "-sw" if self.window else ""
        tag += "" if self.clean_v else "-nocl"
        return tag + (f"-lz{self.rescale_threshold:g}" if self.rescale_threshold else "")

    @functools.cached_property
    def layouts(self):
        """(Q_SMEM, KV_SMEM, S_MMA, O_MMA): 128-byte-swizzled NVMMA shared layouts of the Q
        half ``[64, D]`` and K/V tile ``[block_n, D]`` (also the TMA boxes); wgmma (v3)
        accumulators of one warpgroup for ``S [64, block_n]`` and ``O [64, D]``."""
        from triton.experimental.gluon import language as gl

        q_smem = gl.NVMMASharedLayout.get_default_for([HALF, self.head_dim], gl.bfloat16)
        kv_smem = gl.NVMMASharedLayout.get_default_for([self.block_n, self.head_dim], gl.bfloat16)
        s_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, self.block_n, 16])
        o_mma = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, self.head_dim, 16])
        return q_smem, kv_smem, s_mma, o_mma

    @functools.cached_property
    def clean_layout(self):
        """CLEAN: the 4-warp blocked layout in which a consumer warpgroup zeroes the
        non-finite values of its rows of a V tile (16-byte vectors along D; it covers 16
        rows at D 64, 8 at D 128, so any share of ``block_n // 4`` or more rows fits)."""
        from triton.experimental.gluon import language as gl

        tpw_d = self.head_dim // 8
        return gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d] if tpw_d <= 32 else [1, 32], [4, 1], [1, 0])

    def constexprs(self) -> dict:
        """The kernel's compile-time arguments that this configuration sets (the launcher and
        the AOT compile pass the same)."""
        _, _, s_mma, o_mma = self.layouts
        return {
            "HALF": HALF,
            "BLOCK_N": self.block_n,
            "STAGES": self.stages,
            "S_MMA": s_mma,
            "O_MMA": o_mma,
            "CLEAN": self.clean_layout if self.clean_v else None,  # None: no V cleaning (fa3_sweep's A/B only)
            "CONSUMER_REGS": self.consumer_regs,
            "PRODUCER_REGS": self.producer_regs,
            "PINGPONG": self.pingpong,
            "NUM_WG": self.consumers,
            "EXP2_POLY": self.exp2_poly,
            "RESCALE_THRESHOLD": float(self.rescale_threshold),
            "PV_OVERLAP": self.pv_overlap,
            "WINDOW": self.window,
        }


# exp2 on the FMA pipe (``Fa3Config.exp2_poly``): x = j + f with j = round(x) (the 1.5 * 2**23
# shifter), f in [-1/2, 1/2]; 2**f by this degree-3 polynomial (Horner, constant term first):
# the relative-error minimax on [-1/2, 1/2] with p(0) = 1 exactly (a linear program on a grid;
# max relative error 1.0e-4, bf16 P keeps 8 bits); 2**j by adding j << 23 to the bits. x is
# clamped at -127 first: there f = 0, p = 1.0 and the bits come out as +0.0 exactly (masked
# scores give 0, as on MUFU), and no x >= -127 can borrow into the sign bit.
EXP2_POLY = (1.0, 0.6932829022407532, 0.2422109693288803, 0.055009059607982635)
EXP2_PACK = 8  # exponentials per inline-asm block: the first exp2_poly on FMA, the rest on MUFU
EXP2_FLOOR = -127.0
_SHIFTER = 12582912.0  # 1.5 * 2**23: x + it rounds x to an integer held in the low mantissa bits

# Three 64-row consumer warpgroups at D = 64 (16 warps: 128 registers each at launch, 160 per
# consumer thread after setmaxnreg: 3 x 160 + 24 <= 4 x 128).
WIDE = {"consumers": 3, "consumer_regs": 160, "producer_regs": 24, "maxnreg": 128}


def fa3_variant(head_dim: int, wide: bool = False, **kw) -> Fa3Config:
    """A configuration from keywords, as the device sweep and the GPU tests name them:
    ``wide`` adds :data:`WIDE` (three consumer warpgroups), the rest are ``Fa3Config`` fields."""
    return Fa3Config(head_dim, **kw, **(WIDE if wide else {}))


def exp2_fma_reference(x: torch.Tensor) -> torch.Tensor:
    """float32 model of the FMA-pipe exp2 (the kernel's instruction sequence, each step
    rounded to float32; the FMA steps rounded once): ``x`` float32, any shape."""
    x = torch.clamp(x.float(), min=EXP2_FLOOR)
    t = x + _SHIFTER
    f = x - (t - _SHIFTER)
    p = torch.full_like(f, EXP2_POLY[3])
    for c in EXP2_POLY[2::-1]:
        p = (p.double() * f.double() + c).float()
    # the integer held in t's low bits moved to the exponent field, added to p's bits (mod 2**32)
    bits = (p.view(torch.int32).long() + (t.view(torch.int32).long() << 23)) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).int().view(torch.float32)


# D = 64: 3 stages (112 KiB); D = 128: 2 stages (160 KiB: a third would not fit in 227 KiB).
# D = 64 ships three consumer warpgroups (192-row work tiles, WIDE): measured faster than two on
# an H200 with the V cleaning in (2026-11-28, fa3_sweep.py --variants: 476 vs 412 TFLOP/s at
# S = 8192 with sinks, 401 vs 390 at B = 4 x 4096). D = 128 keeps two (three do not fit its
# registers).
# Head dim 128 keeps a row's max until a tile raises it by more than 2**8 (the lazy rescale):
# 1.06x / 1.00x and 1.05x / 1.04x the same build without it at S = 8192 / 4 x 4096 in two H200
# runs (2026-11-28, ci/device/fa3_sweep.py --variants --head-dim 128); at head dim 64 it was
# within 2 %, and is not shipped there.
_CONFIGS = {
    64: Fa3Config(64, block_n=128, stages=3, **WIDE),
    128: Fa3Config(128, block_n=128, stages=2, rescale_threshold=8.0),
}
# The paged extend's base: two consumer warpgroups at both head dims (its boxes-per-page
# producer and register split were built and measured for two: gluon_extend_fa3), every
# rescale eager (the lazy one was not measured on the extend).
TWO_CONSUMER_CONFIGS = {64: Fa3Config(64, block_n=128, stages=3), 128: Fa3Config(128, block_n=128, stages=2)}


# The windowed build: 64-key tiles (a 128-token tile's band at window 127 is 4 steps of 64
# keys instead of 2 of 128, the same keys: the first S = Q·Kᵀ and the last P·V, which
# nothing overlaps, are a quarter of the tile's products instead of half); the ring holds a
# whole band at D 64 (4 stages: 80 KiB with Q), 3 tiles at D 128 (128 KiB).
_WINDOW_CONFIGS = {
    64: Fa3Config(64, block_n=64, stages=4, window=True),
    128: Fa3Config(128, block_n=64, stages=3, window=True),
}


def fa3_config(head_dim: int) -> Fa3Config:
    """The launch configuration for a head dim (metadata as data)."""
    return _CONFIGS[head_dim]


def fa3_window_config(head_dim: int) -> Fa3Config:
    """The sliding-window launch configuration for a head dim (metadata as data)."""
    return _WINDOW_CONFIGS[head_dim]


def tile_order(t: int, n_m: int, batch: int, num_q_heads: int) -> tuple[int, int, int]:
    """Work tile ``t`` -> ``(m_block, sequence, head)``, what the kernel's ``_tile`` computes:
    the last query blocks (the most keys under a causal mask) first, then sequence, then
    head (the heads of one KV head adjacent)."""
    per_block = batch * num_q_heads
    m_rev, rest = divmod(t, per_block)
    b, head = divmod(rest, num_q_heads)
    return n_m - 1 - m_rev, b, head


def key_tiles(len_q: int, len_k: int, m0: int, wg: int, block_n: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """``(n_kv, n_masked)`` of the ``block_m``-token tile starting at token ``m0`` for consumer
    warpgroup ``wg``: ``n_kv`` key tiles ``[j * block_n, ...)``, ``j = n_kv - 1 .. 0`` in
    visiting order (every warpgroup visits the same ones), of which the first ``n_masked``
    need the mask for this warpgroup's rows (bottom-right causal: token ``i`` sits at
    ``len_k - len_q + i``)."""
    last = len_k - len_q + min(m0 + block_m, len_q)
    n_kv = cdiv(min(max(last, 0), len_k), block_n)
    p0 = len_k - len_q + m0 + wg * HALF
    return n_kv, n_kv - min(max(p0 + 1, 0) // block_n, n_kv)


def key_band(
    len_q: int, len_k: int, m0: int, block_n: int, window: int = NO_WINDOW, block_m: int = BLOCK_M
) -> tuple[int, int]:
    """``(j_lo, n_kv)`` of the ``block_m``-token work tile starting at query ``m0`` with a
    window (what the kernel's ``_tile`` computes when paged or windowed): key tiles ``j_lo ..
    j_lo + n_kv - 1`` (``[j * block_n, + block_n)``), from the window's left edge of the
    first row (``max(p0 - window, 0)``, aligned down) to the tile holding the last real
    row's position (bottom-right: query ``t`` sits at ``len_k - len_q + t``), visited from
    the last down; every warpgroup of the tile visits the same ones."""
    p0 = len_k - len_q + m0
    hi = len_k - len_q + min(m0 + block_m, len_q)
    j_lo = max(p0 - window, 0) // block_n
    j_hi = cdiv(min(max(hi, 0), len_k), block_n)
    return j_lo, max(j_hi - j_lo, 0)


def edge(j: int, first: int, last: int, block_n: int, window: int = NO_WINDOW) -> bool:
    """Whether key tile ``j`` needs the mask for rows at positions ``first .. last`` (the
    kernel's ``_edge``): it crosses the first row's diagonal or the last row's window edge."""
    start = j * block_n
    return start + block_n - 1 > first or start < last - window


def dirty(j: int, p0: int, block_n: int, window: int = NO_WINDOW, block_m: int = BLOCK_M) -> bool:
    """Whether key tile ``j`` holds a key that some row of the ``block_m``-row work tile whose
    first row sits at position ``p0`` may not see (every warpgroup of the tile agrees: they
    meet on a barrier), so its V tile is cleaned of non-finite values before ``P·V``: the
    tile crosses the first row's diagonal (which also takes keys past the sequence: they sit
    past every row's position) or the last row's window edge. The causal-only build's
    dense walk (``j = n_kv - 1 .. 0``) finds these as the first ``key_tiles(.., wg=0)[1]``."""
    return edge(j, p0, p0 + block_m - 1, block_n, window)


def grid(max_seqlen_q: int, batch: int, num_q_heads: int, sms: int, block_m: int = BLOCK_M) -> tuple[int, int]:
    """``(programs, n_m)``: the persistent grid (at most one program per SM) over
    ``n_m * batch * num_q_heads`` work tiles of ``block_m`` tokens, ``n_m = cdiv(max_seqlen_q,
    block_m)``."""
    n_m = max(cdiv(max_seqlen_q, block_m), 1)
    return max(min(n_m * batch * num_q_heads, sms), 1), n_m


def _supported(request: Request) -> str | None:
    return equal_head_dims(request)


def _windowed(request: Request) -> str | None:
    why = equal_head_dims(request)
    if why:
        return why
    if request.shape("window_left") is None:
        return "serves windowed calls only (gluon_prefill_fa3_sm90 serves unwindowed ones)"
    return None


def _check_call(args: PrefillArgs, cfg: Fa3Config) -> None:
    """What the call cannot ask of a build with or without the window (ValueError)."""
    name = "gluon_prefill_fa3_window_sm90" if cfg.window else "gluon_prefill_fa3_sm90"
    if not args.causal:
        raise ValueError(f"{name} serves causal prefill only (causal=False)")
    if (args.window_left >= 0) != cfg.window:
        raise ValueError(
            f"{name} is the {'windowed' if cfg.window else 'unwindowed'} build (window_left={args.window_left})"
        )
    if args.logit_cap > 0:
        raise ValueError(f"{name} has no logit cap (logit_cap={args.logit_cap})")
    if not args.softmax_scale > 0:
        # the kernel takes the row max of the raw scores (one FFMA per score after it)
        raise ValueError(f"{name} needs softmax_scale > 0 (got {args.softmax_scale})")
    _check_addresses(args, name)


def _check_addresses(args: PrefillArgs, name: str) -> None:
    """What differs between calls of one key (the tensors' addresses), checked per run: the
    TMA operands' (out is written with plain stores) at once, then the one off named."""
    if not (args.q.data_ptr() | args.k.data_ptr() | args.v.data_ptr()) % _ALIGN:
        return
    for operand in ("q", "k", "v"):
        if getattr(args, operand).data_ptr() % _ALIGN:
            raise ValueError(f"{name} needs {operand} {_ALIGN}-byte aligned (TMA)")


def _planned(args: PrefillArgs, windowed: bool) -> Callable[[PrefillArgs], None]:
    """The ``step_runner`` hook of a build (the core's ``PrefillPlan``): the runner of the plan's key,
    the addresses checked per run."""
    cfg = _config(args.q.shape[2], windowed)
    _check_call(args, cfg)
    cache, name = (
        (_WINDOW_RUNNERS, "gluon_prefill_fa3_window_sm90") if windowed else (_RUNNERS, "gluon_prefill_fa3_sm90")
    )
    return planned_runner(functools.partial(_check_addresses, name=name), cache.runner(args))


# What both builds' registrations share (metadata as data).
# H200, 2026-11-28, `bench attention.prefill --preset prefill-lengths` (D = 64, sinks, the
# three-consumer build): faster than triton_prefill at every case from 2048 queries (1.13x at
# B = 1 x 2048, 1.11x at 8 x 2048, 1.25x at 4096, 1.27x at 8192, 1.24x at 16384, 1.17x at 4 x
# 4096, 1.15x on a ragged 8192/2000/300/37 batch); slower at 512 (0.73x) and at 8 x 1024 (0.91x,
# 1.05x at 1 x 1024). D = 128 (`--preset prefill-lengths-d128`, H200, 2026-11-28): faster at
# every length timed, 1.93x at 512, 2.22x at 1024, 2.31x at 8 x 1024, 2.3-2.4x from 2048: first
# from the 512 bucket there (shorter prefills are unmeasured at D = 128).
RANKED_FROM_QUERIES = 2048
RANKED_FROM_QUERIES_D128 = 512
_RANKS = (  # the first rule that holds ranks the kernel (registry: rank_when)
    (
        {"head_dim": (128,), "max_seqlen_q_bucket": tuple(RANKED_FROM_QUERIES_D128 << i for i in range(10))},
        Priority.PERFORMANT,
    ),
    ({"max_seqlen_q_bucket": tuple(RANKED_FROM_QUERIES << i for i in range(8))}, Priority.PERFORMANT),
)
_META = {
    "solution": "gluon",
    "vendors": VENDORS,
    "archs": ("sm_90",),
    "capabilities": ("tma", "wgmma"),
    "dtypes": {"q": Q_DTYPES, "kv": Q_DTYPES},
    "shapes": {"head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS},
}


@register_kernel(
    "attention.prefill",
    name="gluon_prefill_fa3_sm90",
    **_META,
    features=FEATURES,
    # First from RANKED_FROM_QUERIES queries up (the request's max_seqlen_q_bucket; at D = 128
    # from RANKED_FROM_QUERIES_D128), where it was measured faster than triton_prefill
    # (PORTABLE); below that triton_prefill stays first.
    priority=Priority.OPT_IN,
    rank_when=_RANKS,
    predicate=_supported,
    step_runner=functools.partial(_planned, windowed=False),
)
def gluon_prefill_fa3(args: PrefillArgs) -> None:
    """Gluon Hopper dense causal prefill (FlashAttention-3 design): warp-specialized TMA
    producer, two ping-pong wgmma consumer warpgroups, persistent heaviest-first grid.

    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]`` (bf16/fp16, contiguous, q/k/v
    16-byte aligned for TMA; q may be row-strided, ``strided_q``, its row stride a 16-byte
    multiple), D 64 or 128, causal (bottom-right), no window or cap; sinks float32 ``[Hq]``
    optional; writes ``args.out`` ``[total_q, Hq, D]`` and ``args.lse`` (float32
    ``[total_q, Hq]``) when given. A NaN/inf key or value a query cannot see (causally
    later, another sequence's) never reaches it: scores masked by selection, V cleaned on
    dirty tiles. A functional call runs the runner bound for its :func:`_runner_key` (``tokenspeed_kernel_triton._runners``): every tensor passed per run,
    the Q/K/V TMA descriptors derived per run from the run's q, k and v.
    """
    _check_call(args, _config(args.q.shape[2], windowed=False))
    _RUNNERS(args)


@register_kernel(
    "attention.prefill",
    name="gluon_prefill_fa3_window_sm90",
    **_META,
    features=WINDOW_FEATURES,
    # Correct on an H200 but 0.61x gluon_prefill_window_sm90 at window 127 (2026-11-28), which
    # stays first there by its rank_when.
    priority=Priority.OPT_IN,
    predicate=_windowed,
    step_runner=functools.partial(_planned, windowed=True),
)
def gluon_prefill_fa3_window(args: PrefillArgs) -> None:
    """The same kernel built with a sliding window (:func:`fa3_window_config`): each work
    tile visits only its key band, from the window's left edge of its first row (aligned
    down to a 64-key tile) to its diagonal, and masks the band's edge tiles only.

    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]`` (bf16/fp16, contiguous, q/k/v 16-byte
    aligned for TMA; q may be row-strided, its row stride a 16-byte multiple), D 64 or 128,
    causal (bottom-right) with ``window_left >= 0`` (query at
    position ``p`` sees keys ``p - window_left .. p``), no cap; sinks float32 ``[Hq]``
    optional; writes ``args.out`` ``[total_q, Hq, D]`` and ``args.lse`` (float32 ``[total_q,
    Hq]``) when given. K/V rows outside a query's window but inside its band tiles are read
    and masked by selection, their V cleaned of non-finite values on dirty tiles (a NaN/inf a
    query cannot see never reaches it). A functional call runs
    the runner bound for its :func:`_runner_key` (the window is part of it: a runner binds its
    window as a launch scalar), as :func:`gluon_prefill_fa3` does.
    """
    _check_call(args, _config(args.q.shape[2], windowed=True))
    _WINDOW_RUNNERS(args)


def _config(head_dim: int, windowed: bool) -> Fa3Config:
    """The shipped configuration of the build with or without the window for ``head_dim``
    (ValueError for another head dim, before any launch)."""
    table = _WINDOW_CONFIGS if windowed else _CONFIGS
    if head_dim not in table:
        raise ValueError(f"gluon_prefill_fa3: head_dim {head_dim} not in {sorted(table)}")
    return table[head_dim]


def launch(args: PrefillArgs, cfg: Fa3Config | None = None, *, windowed: bool = False) -> None:
    """Check and launch once, uncached, with ``cfg`` (default :func:`fa3_config`, or
    :func:`fa3_window_config` when ``windowed``); the device sweep script passes alternatives
    to time them in the same run. A windowed call needs a ``window`` build, an unwindowed one
    a build without it (ValueError otherwise)."""
    cfg = cfg or _config(args.q.shape[2], windowed)
    _check_call(args, cfg)
    run_fresh(functools.partial(_launches, cfg=cfg), args)


def _window(args: PrefillArgs) -> int:
    """The kernel's runtime window argument: ``window_left`` (capped at :data:`NO_WINDOW`), or
    :data:`NO_WINDOW` without one (the unwindowed build never reads it)."""
    return min(args.window_left, NO_WINDOW) if args.window_left >= 0 else NO_WINDOW


def _launches(args: PrefillArgs, cfg: Fa3Config) -> Built:
    """The launches of ``args`` with ``cfg`` (none for an empty batch), nothing kept, and the
    Q/K/V descriptors derived from q, k and v; a ragged batch lists its tiles that hold
    queries first (:func:`._tile_list.walk`, the list the one scratch), as the paged extend
    does."""
    from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_fa3_kernel import prefill_fa3_kernel

    total_q, num_q_heads, _ = args.q.shape
    num_kv_heads = args.k.shape[1]
    batch = args.cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return (), (), ()
    # q's row stride is fixed by the runner key (its base is checked per run: _check_addresses)
    check_tma_q("gluon_prefill_fa3_window_sm90" if cfg.window else "gluon_prefill_fa3_sm90", args.q)
    q_smem, kv_smem, _, _ = cfg.layouts
    programs, n_m = grid(args.max_seqlen_q, batch, num_q_heads, sm_count(args.q.device), cfg.block_m)
    tiles = walk(args.cu_seqlens_q, total_q, args.max_seqlen_q, n_m, num_q_heads, cfg.block_m)
    descriptors = (
        derive_descriptor(head_tile_descriptor, args.q, HALF, q_smem),
        derive_descriptor(head_tile_descriptor, args.k, cfg.block_n, kv_smem),
        derive_descriptor(head_tile_descriptor, args.v, cfg.block_n, kv_smem),
    )
    launch = Launch(
        prefill_fa3_kernel,
        (programs,),
        (
            *(d.value for d in descriptors),
            *written_and_sinks(args),
            args.cu_seqlens_q,
            args.cu_seqlens_k,
            float(args.softmax_scale),
            n_m,
            batch,
            _window(args),
            tiles.tiles,
        ),
        dict(
            **fa3_head_constexprs(args, num_kv_heads),
            **cfg.constexprs(),
            TILE_LIST=tiles.listed,
            num_warps=4,
            maxnreg=cfg.maxnreg,
        ),
    )
    return [*tiles.before, launch], tiles.scratch, (never_read(args.q.device),), descriptors


def _runner_key(args: PrefillArgs) -> tuple:
    """:func:`~tokenspeed_kernel_nvidia.ops.attention._common.attention_call_key` (with the
    window, a launch scalar) and the persistent grid of the call's build (its program count
    and query-block count ``n_m``, which follow ``max_seqlen_q``; calls with the same ones
    share a runner) and whether the launch lists its tiles. Called after the build's check:
    ``window_left >= 0`` names the build."""
    batch = args.cu_seqlens_q.shape[0] - 1
    block_m = _config(args.q.shape[2], args.window_left >= 0).block_m
    programs, n_m = grid(args.max_seqlen_q, batch, args.q.shape[1], sm_count(args.q.device), block_m)
    listed = lists_tiles(args.q.shape[0], args.max_seqlen_q, batch, n_m, block_m)
    return attention_call_key(args, args.k, args.v), programs, n_m, listed


def _runner_cache(name: str, windowed: bool) -> RunnerCache[PrefillArgs]:
    """The functional calls' runners of one build (its shipped configuration per head dim)."""

    def bind(args: PrefillArgs):
        build = functools.partial(_launches, cfg=_config(args.q.shape[2], windowed))
        return bind_runner(build, args, *_CALL_INPUTS)

    return RunnerCache(name, _runner_key, bind, functools.partial(launch, windowed=windowed))


# What varies per run: every tensor of a functional call.
_CALL_INPUTS = by_fields("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "sinks", "out", "lse")
_RUNNERS = _runner_cache("gluon_prefill_fa3_sm90", windowed=False)
_WINDOW_RUNNERS = _runner_cache("gluon_prefill_fa3_window_sm90", windowed=True)
