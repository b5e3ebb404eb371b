"""Triton attention kernels (registered on import)."""
