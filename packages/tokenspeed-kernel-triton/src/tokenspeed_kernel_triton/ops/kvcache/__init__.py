"""Triton KV-cache kernels (registered on import)."""

from tokenspeed_kernel_triton.ops.kvcache import store  # noqa: F401
