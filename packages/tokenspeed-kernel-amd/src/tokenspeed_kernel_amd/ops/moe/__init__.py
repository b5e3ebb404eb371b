"""Gluon MoE kernels: MXFP4 warp-decode and grouped GEMM (registered on import)."""

from tokenspeed_kernel_amd.ops.moe import fused  # noqa: F401
