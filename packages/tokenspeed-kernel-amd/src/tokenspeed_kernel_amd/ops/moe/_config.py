"""Host-side configuration of the MXFP4 MoE kernels: regime, tiles, layouts (plain Python)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from triton.experimental.gluon import language as gl

from tokenspeed_kernel_amd._arch import ArchConfig

__all__ = [
    "GEMV_MAX_TOKENS",
    "GemmConfig",
    "GemvConfig",
    "gemm_config",
    "gemv2_config",
    "gemv13_config",
    "quant_config",
    "scaled_gemm_config",
    "use_gemv",
]

# Up to this many tokens the warp-decode GEMVs win: every weight byte is read once per
# (token, choice) pair anyway, and the GEMM's padding to BLOCK_M rows per expert is waste.
GEMV_MAX_TOKENS = 8


def use_gemv(num_tokens: int) -> bool:
    """The warp-decode path for tiny batches, the grouped GEMM otherwise."""
    return num_tokens <= GEMV_MAX_TOKENS


@dataclass(frozen=True)
class GemvConfig:
    constexprs: dict[str, Any]
    num_warps: int
    block: int


@dataclass(frozen=True)
class GemmConfig:
    constexprs: dict[str, Any]
    num_warps: int
    block_m: int
    block_n: int


def _gemv_layout(num_warps: int) -> gl.BlockedLayout:
    """[rows, 64-value groups, 32 bytes]: a lane reads 16 contiguous bytes, two lanes one
    group's 32 bytes, eight lanes eight groups, four rows per warp."""
    return gl.BlockedLayout([1, 1, 16], [4, 8, 2], [num_warps, 1, 1], [2, 1, 0])


def gemv13_config(
    *,
    hidden: int,
    inter: int,
    top_k: int,
    activation: int,
    bias: bool,
    expert_map: bool,
    halves: bool,
    quant_out: bool = False,
) -> GemvConfig:
    num_warps = 4
    block = 32
    return GemvConfig(
        {
            "HIDDEN": hidden,
            "INTER": inter,
            "TOP_K": top_k,
            "ACTIVATION": activation,
            "HAS_BIAS": bias,
            "HAS_MAP": expert_map,
            "HALVES": halves,
            "BLOCK_I": block,
            "BLOCK_G": 8,
            "L3": _gemv_layout(num_warps),
            "QUANT_OUT": quant_out,
        },
        num_warps,
        block,
    )


def gemv2_config(*, hidden: int, inter: int, top_k: int, bias: bool, expert_map: bool, halves: bool) -> GemvConfig:
    num_warps = 4
    block = 16
    return GemvConfig(
        {
            "HIDDEN": hidden,
            "INTER": inter,
            "TOP_K": top_k,
            "HAS_BIAS": bias,
            "HAS_MAP": expert_map,
            "HALVES": halves,
            "BLOCK_H": block,
            "BLOCK_G": 8,
            "L3": _gemv_layout(num_warps),
        },
        num_warps,
        block,
    )


def gemm_config(
    arch: ArchConfig,
    *,
    n: int,
    k: int,
    top_k: int,
    gated: bool,
    activation: int,
    bias: bool,
    halves: bool,
    rows_sorted: bool,
    block_m: int = 32,
    quant_out: bool = False,
) -> GemmConfig:
    num_warps = 4
    block_n = 64
    mma = gl.amd.AMDMFMALayout(
        version=arch.mfma_version, instr_shape=[16, 16, arch.mfma_k], transposed=True, warps_per_cta=[2, 2]
    )
    if arch.padded_lds:
        smem = gl.PaddedSharedLayout.with_identity_for([[64, 8]], [block_n, 64], [1, 0])
    else:
        smem = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    return GemmConfig(
        {
            "N": n,
            "K": k,
            "TOP_K": top_k,
            "GATED": gated,
            "ACTIVATION": activation,
            "HAS_BIAS": bias,
            "HALVES": halves,
            "ROWS_SORTED": rows_sorted,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "MMA": mma,
            "K_WIDTH": arch.k_width,
            "LOAD_A": gl.BlockedLayout([1, 8], [8, 8], [num_warps, 1], [1, 0]),
            "LOAD_B": gl.BlockedLayout([1, 8], [16, 4], [num_warps, 1], [1, 0]),
            "B_SMEM": smem,
            "QUANT_OUT": quant_out,
        },
        num_warps,
        block_m,
        block_n,
    )


def quant_config(*, fake: bool) -> GemvConfig:
    """The MXFP8 quantization of x: 64 rows x one 32-value block per program (8 values/lane)."""
    num_warps = 4
    layout = gl.BlockedLayout([1, 8], [16, 4], [num_warps, 1], [1, 0])
    return GemvConfig({"BLOCK_R": 64, "FAKE": fake, "LAYOUT": layout}, num_warps, 64)


def scaled_gemm_config(
    *, n: int, k: int, top_k: int, gated: bool, activation: int, bias: bool, rows_sorted: bool, block_m: int = 32
) -> GemmConfig:
    """gfx950 scaled-MFMA grouped GEMM: ``block_m`` x 64 x 128 tiles, 4 warps ``[2, 2]`` on
    ``v_mfma_scale_f32_16x16x128_f8f6f4``. A rows load as 16 contiguous bytes per lane; the
    weight tile loads K-contiguous (16 bytes per lane) as ``[64 K-bytes, 64 N]``."""
    num_warps = 4
    mma = gl.amd.AMDMFMALayout(version=4, instr_shape=[16, 16, 128], transposed=True, warps_per_cta=[2, 2])
    return GemmConfig(
        {
            "N": n,
            "K": k,
            "TOP_K": top_k,
            "GATED": gated,
            "ACTIVATION": activation,
            "HAS_BIAS": bias,
            "ROWS_SORTED": rows_sorted,
            "BLOCK_M": block_m,
            "BLOCK_N": 64,
            "BLOCK_K": 128,
            "MMA": mma,
            "LOAD_A": gl.BlockedLayout([1, 16], [8, 8], [num_warps, 1], [1, 0]),
            "LOAD_B": gl.BlockedLayout([16, 1], [4, 16], [1, num_warps], [0, 1]),
        },
        num_warps,
        block_m,
        64,
    )
