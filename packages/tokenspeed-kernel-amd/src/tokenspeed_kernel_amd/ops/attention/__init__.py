"""Gluon attention kernels: prefill, extend, paged decode (registered on import)."""

from tokenspeed_kernel_amd.ops.attention import decode, extend, prefill  # noqa: F401
