"""Gluon kernels for AMD Instinct GPUs (CDNA3 gfx942, CDNA4 gfx950) for tokenspeed-kernel.

``register()`` is the ``tokenspeed_kernel.backends`` entry point: it imports the kernel
modules, whose ``@register_kernel`` decorators record them. Kernels mirror the core's
``ops/<family>`` layout, one module per kernel. Importing this package never needs a GPU:
the kernels are Gluon functions compiled on first launch (or ahead of time, see
``ci/tokenspeed_kernel_dev/aot_amd.py``).
"""

from __future__ import annotations

import importlib

_KERNEL_MODULES = (
    "tokenspeed_kernel_amd.ops.attention",
    "tokenspeed_kernel_amd.ops.moe",
)


def register() -> None:
    """Import every kernel module (each registers its kernels on import)."""
    for name in _KERNEL_MODULES:
        importlib.import_module(name)
