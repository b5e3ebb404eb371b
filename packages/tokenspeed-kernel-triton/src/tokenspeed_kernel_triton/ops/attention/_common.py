"""Registration metadata shared by the Triton attention kernels (data, not branches)."""

from __future__ import annotations

import os

import torch

# Under the Triton interpreter the kernels run on CPU tensors, so they serve the CPU
# platform too (and outrank the reference there: tests and `check` exercise them).
VENDORS = ("cuda", "rocm", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda", "rocm")
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KV_DTYPES = (*Q_DTYPES, torch.float8_e4m3fn)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)
PAGE_SIZES = tuple(2**i for i in range(9))  # 1 .. 256
COMMON_FEATURES = ("sinks", "sliding_window", "logit_cap", "return_lse")


def same_head_dims(request) -> str | None:
    """Predicate: the tiles assume the q/k and v head dims are both supported sizes."""
    dv = request.shape("head_dim_v")
    if dv is not None and dv not in HEAD_DIMS:
        return f"head_dim_v={dv} not in {HEAD_DIMS}"
    group = (request.shape("num_q_heads") or 1) // (request.shape("num_kv_heads") or 1)
    if group > 64:
        return f"GQA group of {group} query heads per KV head exceeds 64"
    return None


def vendor_of(device: torch.device) -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"`` (the interpreter) for a tensor's device; the same
    rule as the MoE's ``vendor_of`` (a ROCm build of torch reports ``device.type == "cuda"``)."""
    if device.type == "cpu":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"
