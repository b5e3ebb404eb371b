"""Host-side launch configuration of the Gluon attention kernel: tiles, layouts, splits.

Everything here is plain Python: it runs the same on a ROCm machine (before a launch) and
on a CPU machine (ahead-of-time compiles in tests), so what is compiled and inspected is
exactly what would be launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from triton.experimental.gluon import language as gl

from tokenspeed_kernel.kit import next_pow2
from tokenspeed_kernel_amd._arch import ArchConfig
from tokenspeed_kernel_amd.ops.attention._kernel import MODE_DECODE, MODE_EXTEND, MODE_PREFILL

__all__ = [
    "HEAD_DIMS",
    "MAX_GROUP",
    "MAX_SPLITS",
    "PAGE_SIZES",
    "AttentionConfig",
    "attention_config",
    "decode_splits",
]

HEAD_DIMS = (64, 128)
PAGE_SIZES = (1, 8, 16, 32, 64, 128, 256)
MAX_GROUP = 64  # GQA rows packed per program (times q_len for speculative decode)
MAX_SPLITS = 16
_MODES = {"prefill": MODE_PREFILL.value, "extend": MODE_EXTEND.value, "decode": MODE_DECODE.value}


@dataclass(frozen=True)
class AttentionConfig:
    """One compile of :func:`attention_kernel`: its constexprs and launch options."""

    constexprs: dict[str, Any]
    num_warps: int
    block_m: int
    block_n: int
    splits: int


def _load_layout(cols: int, num_warps: int) -> gl.BlockedLayout:
    """Row-major tile loads, 16 bytes (8 x 16-bit) per lane along the head dim."""
    lanes_d = min(64, cols // 8)
    return gl.BlockedLayout([1, 8], [64 // lanes_d, lanes_d], [num_warps, 1], [1, 0])


def _smem_layout(arch: ArchConfig, rows: int, cols: int):
    """K/V staging in LDS: XOR swizzle (gfx942) or row padding (gfx950, whose LDS has
    room and whose wide ``ds_read`` prefers linear rows), both conflict-free for the
    transposed and direct MFMA operand reads."""
    if arch.padded_lds:
        return gl.PaddedSharedLayout.with_identity_for([[cols, 8]], [rows, cols], [1, 0])
    return gl.SwizzledSharedLayout(8, 1, 8 if cols >= 64 else 4, [1, 0])


def decode_splits(arch: ArchConfig, batch: int, num_kv_heads: int, visible_keys: int, block_n: int = 64) -> int:
    """Key-range splits for decode: enough programs to fill the CUs twice, at least two
    tiles per split, a power of two up to :data:`MAX_SPLITS`."""
    programs = max(1, batch * num_kv_heads)
    want = max(1, (2 * arch.num_cus) // programs)
    tiles = max(1, -(-visible_keys // block_n))
    splits = 1
    while splits * 2 <= min(want, MAX_SPLITS, max(1, tiles // 2)):
        splits *= 2
    return splits


def attention_config(
    arch: ArchConfig,
    *,
    regime: str,
    head_dim: int,
    head_dim_v: int,
    group: int,
    num_kv_heads: int,
    q_len: int = 1,
    page_size: int = 1,
    causal: bool = True,
    window: bool = False,
    sinks: bool = False,
    cap: bool = False,
    kv_scales: bool = False,
    lse: bool = False,
    splits: int = 1,
) -> AttentionConfig:
    """The kernel configuration for a call (see :mod:`._kernel` for the design)."""
    mode = _MODES[regime]
    if mode == MODE_DECODE.value:
        block_m = max(16, next_pow2(group * q_len))
        num_warps = 4
        warps = [1, 4]  # 16-64 rows: warps split the key / head-dim columns
    else:
        block_m = max(128, group)
        num_warps = 8  # 16 query rows per warp: no spills at d128 (4 warps x 32 rows spill SGPRs)
        warps = [8, 1]
    block_n = 64
    mma = gl.amd.AMDMFMALayout(
        version=arch.mfma_version, instr_shape=[16, 16, arch.mfma_k], transposed=True, warps_per_cta=warps
    )
    constexprs = {
        "HEAD_DIM": head_dim,
        "HEAD_DIM_V": head_dim_v,
        "GROUP": group,
        "NUM_KV_HEADS": num_kv_heads,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "MODE": mode,
        "Q_LEN": q_len if mode == MODE_DECODE.value else 1,
        "PAGE_SIZE": page_size if mode != MODE_PREFILL.value else 1,
        "CAUSAL": causal,
        "HAS_WINDOW": window,
        "HAS_SINKS": sinks,
        "HAS_CAP": cap,
        "KV_SCALES": kv_scales,
        "WRITE_LSE": lse,
        "SPLITS": splits,
        "MMA": mma,
        "K_WIDTH": arch.k_width,
        "LOAD_Q": _load_layout(head_dim, num_warps),
        "LOAD_K": _load_layout(head_dim, num_warps),
        "LOAD_V": _load_layout(head_dim_v, num_warps),
        "K_SMEM": _smem_layout(arch, block_n, head_dim),
        "V_SMEM": _smem_layout(arch, block_n, head_dim_v),
    }
    return AttentionConfig(constexprs, num_warps, block_m, block_n, splits)


def combine_constexprs(*, num_q_heads: int, head_dim_v: int, splits: int, sinks: bool, kv_scales: bool, lse: bool):
    """Constexprs of :func:`combine_kernel` (one warp per (token, head))."""
    layout = gl.BlockedLayout([1, max(1, head_dim_v // 64)], [1, 64], [1, 1], [1, 0])
    return {
        "NUM_Q_HEADS": num_q_heads,
        "HEAD_DIM_V": head_dim_v,
        "SPLITS": splits,
        "HAS_SINKS": sinks,
        "KV_SCALES": kv_scales,
        "WRITE_LSE": lse,
        "LAYOUT": layout,
    }
