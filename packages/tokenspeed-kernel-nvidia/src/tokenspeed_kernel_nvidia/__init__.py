"""NVIDIA kernels for tokenspeed-kernel: FlashInfer-backed attention and Gluon Hopper kernels.

``register()`` is the ``tokenspeed_kernel.backends`` entry point: it imports the kernel
modules, whose ``@register_kernel`` decorators record them. Importing this package never
imports flashinfer: FlashInfer kernels import it lazily on their first call and report
"flashinfer-python not installed" through their ``available`` hook when it is missing.
"""

from __future__ import annotations

import importlib

_KERNEL_MODULES = ("tokenspeed_kernel_nvidia.ops.attention", "tokenspeed_kernel_nvidia.ops.moe")


def register() -> None:
    """Import every kernel module (each registers its kernels on import)."""
    for name in _KERNEL_MODULES:
        importlib.import_module(name)
