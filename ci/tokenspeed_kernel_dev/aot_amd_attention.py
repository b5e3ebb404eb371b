"""The attention configuration grid compiled ahead of time (tests and ``python -m tokenspeed_kernel_dev.aot_amd``).

Each entry is a configuration the launch code (:mod:`._launch`) can choose for the shapes
the kernels are registered for: regimes, head dims, page sizes, KV dtypes, split counts,
speculative q_len, and the GPT-OSS feature set (sinks + sliding window + lse).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel_amd._arch import arch_config
from tokenspeed_kernel_amd.ops.attention._config import attention_config, combine_constexprs
from tokenspeed_kernel_amd.ops.attention._kernel import attention_kernel, combine_kernel
from tokenspeed_kernel_dev.aot_amd import CompileReport, compile_kernel, pointer_type

__all__ = ["AOT_CONFIGS", "AotAttention", "attention_reports", "compile_attention", "compile_combine"]


@dataclass(frozen=True)
class AotAttention:
    regime: str
    head_dim: int
    kv_dtype: torch.dtype = torch.bfloat16
    q_dtype: torch.dtype = torch.bfloat16
    group: int = 8
    page_size: int = 16
    q_len: int = 1
    splits: int = 1
    gpt_oss: bool = True  # sinks + sliding window + lse; else logit cap, no window

    @property
    def name(self) -> str:
        kv = "fp8" if self.kv_dtype == torch.float8_e4m3fn else str(self.kv_dtype).removeprefix("torch.")
        feats = "sinks+window+lse" if self.gpt_oss else "cap"
        return (
            f"attention[{self.regime} d{self.head_dim} q={str(self.q_dtype).removeprefix('torch.')} kv={kv} "
            f"g{self.group} p{self.page_size} q_len{self.q_len} s{self.splits} {feats}]"
        )


AOT_CONFIGS: tuple[AotAttention, ...] = (
    # decode: GPT-OSS (d64, group 8), d128, page sizes, fp8 KV, split-KV, speculative q_len
    AotAttention("decode", 64),
    AotAttention("decode", 64, splits=8),
    AotAttention("decode", 64, kv_dtype=torch.float8_e4m3fn, splits=4),
    AotAttention("decode", 64, page_size=1),
    AotAttention("decode", 128, page_size=64, splits=16),
    AotAttention("decode", 128, group=4, q_len=4, gpt_oss=False),
    AotAttention("decode", 64, q_dtype=torch.float16, kv_dtype=torch.float16, page_size=256),
    # prefill / extend
    AotAttention("prefill", 64),
    AotAttention("prefill", 128, group=1, gpt_oss=False),
    AotAttention("extend", 64, page_size=16),
    AotAttention("extend", 128, kv_dtype=torch.float8_e4m3fn, page_size=64),
)


def compile_attention(cfg: AotAttention, arch: str) -> CompileReport:
    """Compile the attention kernel for one configuration."""
    launch = attention_config(
        arch_config(arch),
        regime=cfg.regime,
        head_dim=cfg.head_dim,
        head_dim_v=cfg.head_dim,
        group=cfg.group,
        num_kv_heads=8,
        q_len=cfg.q_len,
        page_size=cfg.page_size,
        window=cfg.gpt_oss,
        sinks=cfg.gpt_oss,
        lse=cfg.gpt_oss,
        cap=not cfg.gpt_oss,
        kv_scales=cfg.kv_dtype == torch.float8_e4m3fn,
        splits=cfg.splits,
    )
    q, kv = pointer_type(cfg.q_dtype), pointer_type(cfg.kv_dtype)
    types = {
        "Q": q,
        "K": kv,
        "V": kv,
        "Out": q,
        "Lse": "*fp32",
        "PartOut": "*fp32",
        "PartLse": "*fp32",
        "Sinks": "*fp32",
        "KScale": "*fp32",
        "VScale": "*fp32",
        "PageTable": "*i32",
        "CuSeqlensQ": "*i32",
        "CuSeqlensK": "*i32",
        "CacheSeqlens": "*i32",
        "stride_qt": "i32",
        "stride_kp": "i32",
        "stride_kt": "i32",
        "stride_kh": "i32",
        "stride_vp": "i32",
        "stride_vt": "i32",
        "stride_vh": "i32",
        "stride_ot": "i32",
        "stride_pt": "i32",
        "num_tokens": "i32",
        "sm_scale": "fp32",
        "logit_cap": "fp32",
        "window_left": "i32",
    }
    return compile_kernel(attention_kernel, types, launch.constexprs, arch, num_warps=launch.num_warps, name=cfg.name)


def compile_combine(arch: str, head_dim_v: int = 64, splits: int = 8) -> CompileReport:
    consts = combine_constexprs(
        num_q_heads=64, head_dim_v=head_dim_v, splits=splits, sinks=True, kv_scales=True, lse=True
    )
    types = {
        "PartOut": "*fp32",
        "PartLse": "*fp32",
        "Out": "*bf16",
        "Lse": "*fp32",
        "Sinks": "*fp32",
        "VScale": "*fp32",
        "stride_ot": "i32",
        "num_tokens": "i32",
    }
    return compile_kernel(combine_kernel, types, consts, arch, num_warps=1, name=f"combine[d{head_dim_v} s{splits}]")


def attention_reports(arch: str) -> list[CompileReport]:
    return [compile_attention(cfg, arch) for cfg in AOT_CONFIGS] + [compile_combine(arch)]
