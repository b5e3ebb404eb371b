"""NVIDIA MoE kernels (registered on import): the Gluon MXFP4 decode for T <= 8 and
FlashInfer's CUTLASS fused MoE (opt-in; flashinfer imported on first call only)."""

from tokenspeed_kernel_nvidia.ops.moe import flashinfer_cutlass_moe, gluon_moe_decode, gluon_moe_mma  # noqa: F401
