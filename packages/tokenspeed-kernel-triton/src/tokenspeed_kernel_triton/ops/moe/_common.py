"""Registration metadata and small helpers shared by the Triton MoE kernels (data, not branches).

Power-of-two rounding, the vendor of a device and the activation codes come from
:mod:`tokenspeed_kernel.kit`."""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Under the Triton interpreter the kernels run on CPU tensors, so they serve the CPU
# platform too (and outrank the reference there: tests and `check` exercise them).
VENDORS = ("cuda", "rocm", "cpu") if INTERPRET else ("cuda", "rocm")
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_DTYPES = (*ACT_DTYPES, torch.float8_e4m3fn, torch.uint8)
MAX_EXPERTS = 1024  # the routing kernels hold one histogram bin per expert in registers


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` for ``tl.dot``: exact fp32 products for fp32 operands, the
    default for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else None
