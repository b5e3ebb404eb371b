"""The MoE configuration grid compiled ahead of time: GPT-OSS-120B shapes (H = I = 2880,
top-4 of 128, swiglu_oai, biases), both MXFP4 byte orders, bf16 and fp16 activations; for
``activation_quant="mxfp8"`` the quantize-dequantize variants (both archs), the x quantizer,
and on gfx950 the scaled-MFMA grouped GEMMs."""

from __future__ import annotations

from tokenspeed_kernel_amd._arch import arch_config
from tokenspeed_kernel_amd.ops.moe._config import (
    gemm_config,
    gemv2_config,
    gemv13_config,
    quant_config,
    scaled_gemm_config,
)
from tokenspeed_kernel_amd.ops.moe._kernels import moe_gemm_kernel, moe_gemv2_kernel, moe_gemv13_kernel
from tokenspeed_kernel_amd.ops.moe._mxfp8 import mxfp8_quant_kernel
from tokenspeed_kernel_amd.ops.moe._scaled_gemm import moe_scaled_gemm_kernel
from tokenspeed_kernel_dev.aot_amd import CompileReport, compile_kernel

__all__ = [
    "compile_gemm",
    "compile_gemv2",
    "compile_gemv13",
    "compile_quant",
    "compile_scaled_gemm",
    "moe_reports",
]

HIDDEN = INTER = 2880
TOP_K = 4
_STRIDES = ("stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be")


def compile_gemv13(
    arch: str, *, act: str = "*bf16", halves: bool = True, activation: int = 2, quant_out: bool = False
) -> CompileReport:
    cfg = gemv13_config(
        hidden=HIDDEN,
        inter=INTER,
        top_k=TOP_K,
        activation=activation,
        bias=True,
        expert_map=True,
        halves=halves,
        quant_out=quant_out,
    )
    types = {
        "X": act,
        "W": "*u8",
        "S": "*u8",
        "Bias": "*fp32",
        "Ids": "*i32",
        "ExpertMap": "*i32",
        "A": "*fp32",
        "stride_xt": "i32",
        "stride_at": "i32",
        **dict.fromkeys(_STRIDES, "i32"),
    }
    name = f"moe_gemv13[{act[1:]} {'halves' if halves else 'standard'} act{activation}{' mxfp8' if quant_out else ''}]"
    return compile_kernel(moe_gemv13_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def compile_gemv2(arch: str, *, act: str = "*bf16", halves: bool = True) -> CompileReport:
    cfg = gemv2_config(hidden=HIDDEN, inter=INTER, top_k=TOP_K, bias=True, expert_map=True, halves=halves)
    types = {
        "A": "*fp32",
        "W": "*u8",
        "S": "*u8",
        "Bias": "*fp32",
        "Ids": "*i32",
        "Weights": "*fp32",
        "ExpertMap": "*i32",
        "Out": act,
        "stride_at": "i32",
        "stride_ot": "i32",
        **dict.fromkeys(_STRIDES, "i32"),
    }
    name = f"moe_gemv2[{act[1:]} {'halves' if halves else 'standard'}]"
    return compile_kernel(moe_gemv2_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def compile_gemm(
    arch: str, *, gated: bool, act: str = "*bf16", halves: bool = True, quant_out: bool = False
) -> CompileReport:
    cfg = gemm_config(
        arch_config(arch),
        n=INTER if gated else HIDDEN,
        k=HIDDEN if gated else INTER,
        top_k=TOP_K,
        gated=gated,
        activation=2,
        bias=True,
        halves=halves,
        rows_sorted=not gated,
        quant_out=quant_out,
    )
    types = {
        "Act": act,
        "W": "*u8",
        "S": "*u8",
        "Bias": "*fp32",
        "SortedPairs": "*i32",
        "TileExpert": "*i32",
        "TileRow": "*i32",
        "TileRows": "*i32",
        "Weights": "*fp32",
        "ExpertMap": "*i32",
        "Out": act if gated else "*fp32",
        "stride_at": "i32",
        "stride_ot": "i32",
        **dict.fromkeys(_STRIDES, "i32"),
    }
    name = f"moe_gemm[{'w13' if gated else 'w2'} {act[1:]} {'halves' if halves else 'standard'}"
    name += " mxfp8]" if quant_out else "]"
    return compile_kernel(moe_gemm_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def compile_quant(arch: str, *, fake: bool, act: str = "*bf16") -> CompileReport:
    cfg = quant_config(fake=fake)
    types = {
        "X": act,
        "Q": act if fake else "*u8",
        "Scales": "*u8",
        "num_rows": "i32",
        "stride_xt": "i32",
        "stride_qt": "i32",
        "stride_st": "i32",
    }
    name = f"mxfp8_quant[{act[1:]} {'fake' if fake else 'codes'}]"
    return compile_kernel(mxfp8_quant_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def compile_scaled_gemm(arch: str, *, gated: bool) -> CompileReport:
    """The gfx950 MXFP8 x MXFP4 grouped GEMM (layer 1: gated, MXFP8 epilogue; layer 2: fp32)."""
    cfg = scaled_gemm_config(
        n=INTER if gated else HIDDEN,
        k=HIDDEN if gated else INTER,
        top_k=TOP_K,
        gated=gated,
        activation=2,
        bias=True,
        rows_sorted=not gated,
    )
    types = {
        "Act": "*u8",
        "ActScale": "*u8",
        "W": "*u8",
        "S": "*u8",
        "Bias": "*fp32",
        "SortedPairs": "*i32",
        "TileExpert": "*i32",
        "TileRow": "*i32",
        "TileRows": "*i32",
        "Weights": "*fp32",
        "Out": "*u8" if gated else "*fp32",
        "OutScale": "*u8",
        "stride_at": "i32",
        "stride_as": "i32",
        "stride_ot": "i32",
        "stride_os": "i32",
        **dict.fromkeys(_STRIDES, "i32"),
    }
    name = f"moe_scaled_gemm[{'w13' if gated else 'w2'} e4m3 x e2m1]"
    return compile_kernel(moe_scaled_gemm_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def moe_reports(arch: str) -> list[CompileReport]:
    scaled = []
    if arch_config(arch).scaled_mfma:  # amd_gluon_moe_mxfp4_scaled (gfx950 only)
        scaled = [
            compile_quant(arch, fake=False),
            compile_scaled_gemm(arch, gated=True),
            compile_scaled_gemm(arch, gated=False),
        ]
    return [
        compile_gemv13(arch),
        compile_gemv13(arch, halves=False, activation=0),
        compile_gemv2(arch),
        compile_gemv2(arch, act="*fp16", halves=False),
        compile_gemm(arch, gated=True),
        compile_gemm(arch, gated=False),
        compile_gemm(arch, gated=True, act="*fp16", halves=False),
        # activation_quant="mxfp8" by quantize-dequantize (amd_gluon_moe_mxfp4, both archs)
        compile_quant(arch, fake=True),
        compile_gemv13(arch, halves=False, quant_out=True),
        compile_gemm(arch, gated=True, quant_out=True),
        *scaled,
    ]
