"""Portable Triton kernels for tokenspeed-kernel.

``register()`` is the ``tokenspeed_kernel.backends`` entry point: it imports the kernel
modules, whose ``@register_kernel`` decorators record them. Kernels mirror the core's
``ops/<family>`` layout, one module per kernel.
"""

from __future__ import annotations

import importlib

_KERNEL_MODULES = (
    "tokenspeed_kernel_triton.ops.attention",
    "tokenspeed_kernel_triton.ops.kvcache",
    "tokenspeed_kernel_triton.ops.moe",
)


def register() -> None:
    """Import every kernel module (each registers its kernels on import)."""
    for name in _KERNEL_MODULES:
        importlib.import_module(name)
