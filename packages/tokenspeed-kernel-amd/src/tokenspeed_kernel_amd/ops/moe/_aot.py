"""The MoE configuration grid compiled ahead of time: GPT-OSS-120B shapes (H = I = 2880,
top-4 of 128, swiglu_oai, biases), both MXFP4 byte orders, bf16 and fp16 activations."""

from __future__ import annotations

from tokenspeed_kernel_amd._arch import arch_config
from tokenspeed_kernel_amd.aot import CompileReport, compile_kernel
from tokenspeed_kernel_amd.ops.moe._config import gemm_config, gemv2_config, gemv13_config
from tokenspeed_kernel_amd.ops.moe._kernels import moe_gemm_kernel, moe_gemv2_kernel, moe_gemv13_kernel

__all__ = ["compile_gemm", "compile_gemv2", "compile_gemv13", "moe_reports"]

HIDDEN = INTER = 2880
TOP_K = 4
_STRIDES = ("stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be")


def compile_gemv13(arch: str, *, act: str = "*bf16", halves: bool = True, activation: int = 2) -> CompileReport:
    cfg = gemv13_config(hidden=HIDDEN, inter=INTER, top_k=TOP_K, activation=activation, bias=True, expert_map=True,
                        halves=halves)  # fmt: skip
    types = {"X": act, "W": "*u8", "S": "*u8", "Bias": "*fp32", "Ids": "*i32", "ExpertMap": "*i32", "A": "*fp32",
             "stride_xt": "i32", "stride_at": "i32", **dict.fromkeys(_STRIDES, "i32")}  # fmt: skip
    name = f"moe_gemv13[{act[1:]} {'halves' if halves else 'standard'} act{activation}]"
    return compile_kernel(moe_gemv13_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def compile_gemv2(arch: str, *, act: str = "*bf16", halves: bool = True) -> CompileReport:
    cfg = gemv2_config(hidden=HIDDEN, inter=INTER, top_k=TOP_K, bias=True, expert_map=True, halves=halves)
    types = {"A": "*fp32", "W": "*u8", "S": "*u8", "Bias": "*fp32", "Ids": "*i32", "Weights": "*fp32",
             "ExpertMap": "*i32", "Out": act, "stride_at": "i32", "stride_ot": "i32",
             **dict.fromkeys(_STRIDES, "i32")}  # fmt: skip
    name = f"moe_gemv2[{act[1:]} {'halves' if halves else 'standard'}]"
    return compile_kernel(moe_gemv2_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def compile_gemm(arch: str, *, gated: bool, act: str = "*bf16", halves: bool = True) -> CompileReport:
    cfg = gemm_config(arch_config(arch), n=INTER if gated else HIDDEN, k=HIDDEN if gated else INTER, top_k=TOP_K,
                      gated=gated, activation=2, bias=True, halves=halves, rows_sorted=not gated)  # fmt: skip
    types = {"Act": act, "W": "*u8", "S": "*u8", "Bias": "*fp32", "SortedPairs": "*i32", "TileExpert": "*i32",
             "TileRow": "*i32", "TileRows": "*i32", "Weights": "*fp32", "ExpertMap": "*i32",
             "Out": act if gated else "*fp32", "stride_at": "i32", "stride_ot": "i32",
             **dict.fromkeys(_STRIDES, "i32")}  # fmt: skip
    name = f"moe_gemm[{'w13' if gated else 'w2'} {act[1:]} {'halves' if halves else 'standard'}]"
    return compile_kernel(moe_gemm_kernel, types, cfg.constexprs, arch, num_warps=cfg.num_warps, name=name)


def moe_reports(arch: str) -> list[CompileReport]:
    return [
        compile_gemv13(arch),
        compile_gemv13(arch, halves=False, activation=0),
        compile_gemv2(arch),
        compile_gemv2(arch, act="*fp16", halves=False),
        compile_gemm(arch, gated=True),
        compile_gemm(arch, gated=False),
        compile_gemm(arch, gated=True, act="*fp16", halves=False),
    ]
