"""Registration metadata and small helpers shared by the Triton MoE kernels (data, not branches).

Power-of-two rounding, the vendor of a device and the activation codes come from
:mod:`tokenspeed_kernel.kit`."""

from __future__ import annotations

import torch

from tokenspeed_kernel_triton._interpreter import VENDOR_CAPABILITIES, VENDORS, interpreted

# VENDORS / VENDOR_CAPABILITIES: the GPUs, and the CPU under Triton's interpreter (where they
# outrank the reference: tests and `check` exercise them); interpreted(device): the INTERPRET
# constexpr of a launch. See _interpreter.py.
__all__ = [
    "ACT_DTYPES",
    "MAX_EXPERTS",
    "VENDORS",
    "VENDOR_CAPABILITIES",
    "WEIGHT_DTYPES",
    "dot_precision",
    "interpreted",
]
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_DTYPES = (*ACT_DTYPES, torch.float8_e4m3fn, torch.uint8)
MAX_EXPERTS = 1024  # the routing kernels hold one histogram bin per expert in registers


def dot_precision(dtype: torch.dtype) -> str | None:
    """``input_precision`` for ``tl.dot``: exact fp32 products for fp32 operands, the
    default for 16-bit operands."""
    return "ieee" if dtype == torch.float32 else None
