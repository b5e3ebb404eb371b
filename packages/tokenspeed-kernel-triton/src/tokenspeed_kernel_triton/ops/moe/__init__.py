"""Triton moe kernels (registered on import)."""
