"""Gluon dense causal prefill for Hopper after FlashAttention-3 (``attention.prefill``, sm_90 only).

See :mod:`._gluon_prefill_fa3_kernel` for the kernel (warp-specialized: a one-warp TMA
producer and two ping-ponging consumer warpgroups on ``wgmma`` with intra-warpgroup overlap;
persistent, heaviest tiles first). This module holds the launch configuration (data), the
schedule arithmetic the kernel performs (mirrored in plain Python for the CPU tests), the
grid, and the registration.

Per-head tiles, not GQA packing: a work tile is 128 consecutive tokens of one query head.
For dense causal attention packing saves no K/V traffic per query row (a tile of 16 tokens
x 8 heads reads the same keys as one of 128 tokens x 1 head, for the same 128 rows), while
per-head tiles keep the causal diagonal square (at most two masked key tiles per tile),
load Q as one 2-D TMA box, and give the sink one value per tile; the 8 heads of a KV head
are adjacent in the tile order, so their K/V reads share L2.

Ranked at ``Priority.PERFORMANT``: first for causal unwindowed prefill where FA4
(``fa4_prefill_sm90``, an opt-in bundle ranked above it) is not installed. Its first GPU run
(H200, 2026-11-27, ci/device/verify_pending.sh fa3g): float64 numerics passed (GPU tests, ``check
--preset awkward`` 4/4 served cases, every sweep configuration), and at GPT-OSS-120B's shape
(64/8 heads, bf16, causal, sinks) S = 8192 took 1.268 ms (434 TFLOP/s; 1.277 without sinks)
and B = 4 x 4096 1.324 ms (415 TFLOP/s): 1.21x / 1.17x ``triton_prefill``, 0.96x / 0.95x cuDNN
SDPA (no sinks), 0.82x / 0.86x FA4. Head dim 128: 595 / 541 TFLOP/s, 2.3x ``triton_prefill``.
With the ping-pong hand-off off (``-free`` in the sweep) it is 0.3-2% slower.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tokenspeed_kernel.kit import cdiv, equal_head_dims, sm_count
from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import Q_DTYPES, VENDORS, head_tile_descriptor
from tokenspeed_kernel_triton._launcher import jit_launch

__all__ = [
    "BLOCK_M",
    "HALF",
    "Fa3Config",
    "fa3_config",
    "gluon_prefill_fa3",
    "grid",
    "key_tiles",
    "launch",
    "tile_order",
]

HEAD_DIMS = (64, 128)
HALF = 64  # query rows per consumer warpgroup (one m64 wgmma row block)
BLOCK_M = 2 * HALF  # query tokens per work tile (two consumer warpgroups)
FEATURES = ("sinks", "return_lse")
_ALIGN = 16  # TMA: 16-byte aligned bases (q, k, v) and row strides


@dataclass(frozen=True, eq=True)
class Fa3Config:
    """Compile-time choices of one launch (also the AOT test's grid).

    ``block_n`` keys per K/V tile; ``stages`` K/V buffers in the TMA ring; the register
    split of the warp specialization: ``maxnreg`` per thread at launch over 12 warps
    (two consumer warpgroups + the producer's, padded to a warpgroup), then
    ``consumer_regs`` for each consumer warpgroup and ``producer_regs`` for the producer
    (``2 * consumer + producer <= 3 * maxnreg``); ``pingpong``: the consumer warpgroups
    issue their wgmma rounds alternately (FA3's schedule) or freely.
    """

    head_dim: int
    block_n: int = 128
    stages: int = 2
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168
    pingpong: bool = True

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        """Explicit shared memory: two Q halves + the K and V rings (barriers come on top)."""
        return elem_bytes * self.head_dim * (BLOCK_M + 2 * self.stages * self.block_n)

    @property
    def tag(self) -> str:
        tag = f"d{self.head_dim}-n{self.block_n}-st{self.stages}-r{self.consumer_regs}.{self.producer_regs}"
        return tag + ("" if self.pingpong else "-free")

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


# D = 64: 3 stages (112 KiB); D = 128: 2 stages (160 KiB: a third would not fit in 227 KiB).
_CONFIGS = {64: Fa3Config(64, block_n=128, stages=3), 128: Fa3Config(128, block_n=128, stages=2)}


def fa3_config(head_dim: int) -> Fa3Config:
    """The launch configuration for a head dim (metadata as data)."""
    return _CONFIGS[head_dim]


def tile_order(t: int, n_m: int, batch: int, num_q_heads: int) -> tuple[int, int, int]:
    """Work tile ``t`` -> ``(m_block, sequence, head)``, what the kernel's ``_tile`` computes:
    the last query blocks (the most keys under a causal mask) first, then sequence, then
    head (the heads of one KV head adjacent)."""
    per_block = batch * num_q_heads
    m_rev, rest = divmod(t, per_block)
    b, head = divmod(rest, num_q_heads)
    return n_m - 1 - m_rev, b, head


def key_tiles(len_q: int, len_k: int, m0: int, wg: int, block_n: int) -> tuple[int, int]:
    """``(n_kv, n_masked)`` of the tile starting at token ``m0`` for consumer warpgroup ``wg``:
    ``n_kv`` key tiles ``[j * block_n, ...)``, ``j = n_kv - 1 .. 0`` in visiting order
    (both warpgroups visit the same ones), of which the first ``n_masked`` need the mask for
    this warpgroup's rows (bottom-right causal: token ``i`` sits at ``len_k - len_q + i``)."""
    last = len_k - len_q + min(m0 + BLOCK_M, len_q)
    n_kv = cdiv(min(max(last, 0), len_k), block_n)
    p0 = len_k - len_q + m0 + wg * HALF
    return n_kv, n_kv - min(max(p0 + 1, 0) // block_n, n_kv)


def grid(max_seqlen_q: int, batch: int, num_q_heads: int, sms: int) -> tuple[int, int]:
    """``(programs, n_m)``: the persistent grid (at most one program per SM) over
    ``n_m * batch * num_q_heads`` work tiles, ``n_m = cdiv(max_seqlen_q, BLOCK_M)``."""
    n_m = max(cdiv(max_seqlen_q, BLOCK_M), 1)
    return max(min(n_m * batch * num_q_heads, sms), 1), n_m


def _supported(request: Request) -> str | None:
    return equal_head_dims(request)


def _check_call(args: PrefillArgs) -> None:
    if not args.causal:
        raise ValueError("gluon_prefill_fa3_sm90 serves causal prefill only (causal=False)")
    if args.window_left >= 0:
        raise ValueError(f"gluon_prefill_fa3_sm90 has no sliding window (window_left={args.window_left})")
    if args.logit_cap > 0:
        raise ValueError(f"gluon_prefill_fa3_sm90 has no logit cap (logit_cap={args.logit_cap})")
    if not args.softmax_scale > 0:
        # the kernel takes the row max of the raw scores (one FFMA per score after it)
        raise ValueError(f"gluon_prefill_fa3_sm90 needs softmax_scale > 0 (got {args.softmax_scale})")
    for name in ("q", "k", "v"):  # TMA operands (out is written with plain stores)
        if getattr(args, name).data_ptr() % _ALIGN:
            raise ValueError(f"gluon_prefill_fa3_sm90 needs {name} {_ALIGN}-byte aligned (TMA)")


@register_kernel(
    "attention.prefill",
    name="gluon_prefill_fa3_sm90",
    solution="gluon",
    vendors=VENDORS,
    archs=("sm_90",),
    capabilities=("tma", "wgmma"),
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS},
    features=FEATURES,
    # Measured faster than triton_prefill (PORTABLE) wherever it serves (module docstring).
    priority=Priority.PERFORMANT,
    predicate=_supported,
)
def gluon_prefill_fa3(args: PrefillArgs) -> None:
    """Gluon Hopper dense causal prefill (FlashAttention-3 design): warp-specialized TMA
    producer, two ping-pong wgmma consumer warpgroups, persistent heaviest-first grid.

    q ``[total_q, Hq, D]``, k/v ``[total_k, Hkv, D]`` (bf16/fp16, contiguous, q/k/v
    16-byte aligned for TMA), D 64 or 128, causal (bottom-right), no window or cap; sinks float32 ``[Hq]``
    optional; writes ``args.out`` ``[total_q, Hq, D]`` and ``args.lse`` (float32
    ``[total_q, Hq]``) when given.
    """
    launch(args)


def launch(args: PrefillArgs, cfg: Fa3Config | None = None) -> None:
    """Launch the kernel with ``cfg`` (default :func:`fa3_config`); the device sweep script
    passes alternatives to time them in the same run."""
    from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_fa3_kernel import prefill_fa3_kernel

    _check_call(args)
    total_q, num_q_heads, head_dim = args.q.shape
    num_kv_heads = args.k.shape[1]
    batch = args.cu_seqlens_q.shape[0] - 1
    if total_q == 0 or batch == 0:
        return
    cfg = cfg or fa3_config(head_dim)
    q_smem, kv_smem, s_mma, o_mma = cfg.layouts
    programs, n_m = grid(args.max_seqlen_q, batch, num_q_heads, sm_count(args.q.device))
    dummy = args.cu_seqlens_q  # never read when the flag is off
    jit_launch(
        prefill_fa3_kernel,
        (programs,),
        head_tile_descriptor(args.q, HALF, q_smem),
        head_tile_descriptor(args.k, cfg.block_n, kv_smem),
        head_tile_descriptor(args.v, cfg.block_n, kv_smem),
        args.out,
        args.lse if args.lse is not None else dummy,
        args.sinks if args.sinks is not None else dummy,
        args.cu_seqlens_q,
        args.cu_seqlens_k,
        float(args.softmax_scale),
        n_m,
        batch,
        HQ=num_q_heads,
        G=num_q_heads // num_kv_heads,
        D=head_dim,
        HALF=HALF,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        HAS_SINKS=args.sinks is not None,
        HAS_LSE=args.lse is not None,
        S_MMA=s_mma,
        O_MMA=o_mma,
        CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs,
        PINGPONG=cfg.pingpong,
        num_warps=4,
        maxnreg=cfg.maxnreg,
    )
