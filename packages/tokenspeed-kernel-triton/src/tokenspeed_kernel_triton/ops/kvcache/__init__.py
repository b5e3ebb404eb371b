"""Triton kvcache kernels (registered on import)."""
