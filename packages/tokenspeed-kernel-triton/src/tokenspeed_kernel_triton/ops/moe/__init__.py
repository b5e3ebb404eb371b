"""Triton MoE kernels: router top-k and the fused expert computation (registered on import)."""

from tokenspeed_kernel_triton.ops.moe import fused, topk  # noqa: F401
