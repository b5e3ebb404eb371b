"""Per-architecture facts the kernels are tuned by (data, not branches).

CDNA3 (gfx942: MI300X/MI325X) and CDNA4 (gfx950: MI355X) differ in what matters here:
the 16-bit MFMA K depth (16 vs 32 per instruction), the LDS size (64 KiB vs 160 KiB), the
fp8 flavour (fnuz vs OCP e4m3) and the scaled MFMA (``v_mfma_scale_*``, gfx950 only).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["ARCHS", "ArchConfig", "arch_config", "device_arch"]


@dataclass(frozen=True)
class ArchConfig:
    """What a kernel needs to know about one architecture.

    Attributes:
        arch: ``"gfx942"`` or ``"gfx950"``.
        mfma_version: the ``AMDMFMALayout`` version (3: CDNA3, 4: CDNA4).
        mfma_k: K depth of the 16x16 bf16/fp16 MFMA (``v_mfma_f32_16x16x{16,32}_bf16``).
        k_width: 16-bit elements per lane per MFMA operand (the dot-operand ``k_width``).
        lds_bytes: LDS per workgroup.
        padded_lds: stage tiles in LDS with padding (gfx950) instead of XOR swizzling (gfx942).
        scaled_mfma: has ``v_mfma_scale_f32_*_f8f6f4`` (MX formats in the matrix core).
        num_cus: compute units of the flagship part (used for split heuristics).
    """

    arch: str
    mfma_version: int
    mfma_k: int
    k_width: int
    lds_bytes: int
    padded_lds: bool
    scaled_mfma: bool
    num_cus: int


ARCHS: dict[str, ArchConfig] = {
    "gfx942": ArchConfig("gfx942", 3, 16, 4, 64 * 1024, False, False, 304),
    "gfx950": ArchConfig("gfx950", 4, 32, 8, 160 * 1024, True, True, 256),
}


def arch_config(arch: str) -> ArchConfig:
    """The table row of ``arch``; ``ValueError`` for an architecture these kernels do not target."""
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"tokenspeed-kernel-amd targets {', '.join(ARCHS)}; got arch {arch!r}") from None


@functools.cache
def device_arch(index: int) -> str:
    """The ``gfxNNN`` name of ROCm device ``index`` (``gcnArchName`` without feature flags)."""
    return str(torch.cuda.get_device_properties(index).gcnArchName).split(":")[0]
