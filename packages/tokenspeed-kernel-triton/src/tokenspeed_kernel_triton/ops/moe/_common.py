"""Registration metadata and small helpers shared by the Triton MoE kernels (data, not branches)."""

from __future__ import annotations

import os

import torch

from tokenspeed_kernel_triton._host import next_pow2  # noqa: F401  (re-exported for the MoE modules)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the Triton interpreter the kernels run on CPU tensors, so they serve the CPU
# platform too (and outrank the reference there: tests and `check` exercise them).
VENDORS = ("cuda", "rocm", "cpu") if INTERPRET else ("cuda", "rocm")
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_DTYPES = (*ACT_DTYPES, torch.float8_e4m3fn, torch.uint8)
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
MAX_EXPERTS = 1024  # the routing kernels hold one histogram bin per expert in registers


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` for ``tl.dot``: exact fp32 products for fp32 operands, the
    default for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else None


def vendor_of(device: torch.device) -> str:
    """``"cuda"``, ``"rocm"`` or ``"cpu"`` (the interpreter) for a tensor's device."""
    if device.type == "cpu":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"
