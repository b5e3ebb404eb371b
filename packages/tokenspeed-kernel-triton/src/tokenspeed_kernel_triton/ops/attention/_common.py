"""Registration metadata shared by the Triton attention kernels (data, not branches)."""

from __future__ import annotations

import torch

from tokenspeed_kernel.registry import Request
from tokenspeed_kernel_triton._interpreter import VENDOR_CAPABILITIES, VENDORS

# VENDORS / VENDOR_CAPABILITIES: the GPUs, and the CPU under Triton's interpreter (where they
# outrank the reference: tests and `check` exercise them); see _interpreter.py.
__all__ = [
    "COMMON_FEATURES",
    "HEAD_DIMS",
    "KV_DTYPES",
    "PAGE_SIZES",
    "Q_DTYPES",
    "VENDORS",
    "VENDOR_CAPABILITIES",
    "head_dim_v_and_group_fit",
]
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_DTYPES = (*Q_DTYPES, torch.float8_e4m3fn)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
PAGE_SIZES = tuple(2**i for i in range(9))  # 1 .. 256
COMMON_FEATURES = ("sinks", "sliding_window", "logit_cap", "return_lse", "strided_q")


def head_dim_v_and_group_fit(request: Request) -> str | None:
    """Predicate: the v head dim is one of :data:`HEAD_DIMS` (the registration's shape rule
    checks ``head_dim``; q/k and v may differ) and the GQA group is at most 64 query heads
    per KV head (the rows one program holds)."""
    dv = request.shape("head_dim_v")
    if dv is not None and dv not in HEAD_DIMS:
        return f"head_dim_v={dv} not in {HEAD_DIMS}"
    group = (request.shape("num_q_heads") or 1) // (request.shape("num_kv_heads") or 1)
    if group > 64:
        return f"GQA group of {group} query heads per KV head exceeds 64"
    return None
