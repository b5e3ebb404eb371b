"""NVIDIA MoE kernels: the Gluon MXFP4 decode for T <= 8 (registered on import)."""

from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_decode  # noqa: F401
