"""Gluon MoE kernels: MXFP4 warp-decode and grouped GEMM, and the gfx950 MXFP4 x MXFP8
scaled-MFMA GEMM (registered on import)."""

from tokenspeed_kernel_amd.ops.moe import fused, fused_scaled  # noqa: F401
