"""Numerics tolerances per operator family and precision, and the comparison itself.

A result passes when it has no NaN, its relative L2 error ``‖out − ref‖ / ‖ref‖`` is within
``rel_l2`` and its largest absolute error is within ``max_abs · (1 + max|ref|)``. The largest
elementwise relative error ``max |out − ref| / (|ref| + max_abs)`` is reported too (it
explains a failure; it does not decide one, since it is unbounded near zeros). The
reference is the float64 ground truth; the tolerance is chosen by the lowest precision the
kernel may compute in: the activation dtype, or the weight/KV format when that is coarser.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TOLERANCES", "Comparison", "Tolerance", "compare", "tolerance_for"]


@dataclass(frozen=True)
class Tolerance:
    """``rel_l2``: bound of ``‖out − ref‖ / ‖ref‖``; ``max_abs``: bound of the largest absolute
    error, in units of ``1 + max|ref|`` (an atol that scales with the output's magnitude)."""

    rel_l2: float
    max_abs: float

    def describe(self) -> str:
        return f"rel_l2<={self.rel_l2:g} max_abs<={self.max_abs:g}*(1+|ref|max)"


# (family, precision) -> tolerance. Precision keys: fp32, fp16, bf16, fp8 (KV cache or
# weights), mxfp4 (weights), act8 (activations quantized to 8 bits: activation_quant).
TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("attention", "fp32"): Tolerance(1e-5, 1e-4),
    ("attention", "fp16"): Tolerance(2e-3, 5e-3),
    ("attention", "bf16"): Tolerance(1e-2, 3e-2),
    ("attention", "fp8"): Tolerance(2e-2, 6e-2),
    ("kvcache", "fp32"): Tolerance(0.0, 0.0),
    ("kvcache", "fp16"): Tolerance(0.0, 0.0),
    ("kvcache", "bf16"): Tolerance(0.0, 0.0),
    ("kvcache", "fp8"): Tolerance(0.0, 0.0),
    ("moe", "fp32"): Tolerance(1e-5, 1e-4),
    ("moe", "fp16"): Tolerance(3e-3, 1e-2),
    ("moe", "bf16"): Tolerance(1.5e-2, 4e-2),
    ("moe", "fp8"): Tolerance(3e-2, 8e-2),
    ("moe", "mxfp4"): Tolerance(3e-2, 8e-2),
    # Activations quantized on the fly to 8 bits (activation_quant="fp8"/"mxfp8", 3 mantissa
    # bits): a kernel that keeps the intermediate in x's dtype and the float64 reference
    # quantize values that differ by one bf16/fp16 rounding, and each value that lies that
    # close to an e4m3 rounding midpoint lands one e4m3 step (up to 12.5%) away. Measured on
    # such a kernel at T = 1 over 80 seeds (2026-11-23): worst rel_l2 7.4% (bf16), while a
    # wrong scale or a dropped term is off by 50% or more.
    ("moe", "act8"): Tolerance(1e-1, 2.5e-1),
}

_PRECISION = {torch.float32: "fp32", torch.float64: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def tolerance_for(case: Any) -> Tolerance:
    """The tolerance of a case: its family and its coarsest precision."""
    family = case.op.split(".")[0]
    precision = _PRECISION[case.dtype]
    coarse = getattr(case, "kv_dtype", None) == torch.float8_e4m3fn or getattr(case, "weight_format", "").startswith(
        "fp8"
    )
    if coarse and family != "kvcache":
        precision = "fp8"
    if getattr(case, "weight_format", "") == "mxfp4":
        precision = "mxfp4"
    if getattr(case, "activation_quant", None) is not None:
        precision = "act8"
    return TOLERANCES[(family, precision)]


@dataclass(frozen=True)
class Comparison:
    """The errors of one output against its reference, and the verdict (NaN never passes)."""

    max_abs: float
    rel_l2: float
    has_nan: bool
    passed: bool
    max_rel: float = 0.0


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> Comparison:
    """Compare ``out`` with the float64 ``ref`` (any dtype; fp8 and ints are widened)."""
    got = out.detach().to(torch.float64)
    want = ref.detach().to(torch.float64)
    if got.shape != want.shape:
        raise ValueError(f"output shape {list(got.shape)} differs from the reference's {list(want.shape)}")
    has_nan = bool(torch.isnan(got).any())
    diff = (got - want).nan_to_num(nan=float("inf"))
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    ref_norm = float(want.norm())
    rel_l2 = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    max_rel = float((diff.abs() / (want.abs() + max(tol.max_abs, 1e-12))).max()) if diff.numel() else 0.0
    scale = 1.0 + (float(want.abs().max()) if want.numel() else 0.0)
    passed = not has_nan and rel_l2 <= tol.rel_l2 and max_abs <= tol.max_abs * scale
    return Comparison(max_abs, rel_l2, has_nan, passed, max_rel)
