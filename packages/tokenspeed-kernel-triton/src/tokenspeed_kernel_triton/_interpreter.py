"""Where the Triton kernels run: compiled on CUDA and ROCm GPUs, and on CPU tensors under
Triton's interpreter. Registration data and the per-launch ``INTERPRET`` constexpr.

What is registered never depends on the environment: every kernel that can run under the
interpreter lists the CPU among its vendors and requires the CPU platform's
``triton_interpreter`` capability there (:data:`VENDOR_CAPABILITIES`), which the core reports
while ``TRITON_INTERPRET`` turns the interpreter on (``tokenspeed_kernel.platform``). Without
it, ``explain`` on a CPU says "platform lacks capabilities {triton_interpreter}".

A kernel's ``INTERPRET`` constexpr (bf16 operands up-cast for the interpreter's ``tl.dot``,
its fp8 rounding) follows the device of the launch's tensors (:func:`interpreted`): only the
interpreter runs kernels on CPU tensors, and a GPU launch is never flagged interpreted.
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.platform import INTERPRETER_CAPABILITY

__all__ = ["VENDORS", "VENDOR_CAPABILITIES", "interpreted"]

VENDORS = ("cuda", "rocm", "cpu")
# The CPU serves these kernels only under Triton's interpreter; a GPU needs nothing more.
VENDOR_CAPABILITIES = {"cpu": (INTERPRETER_CAPABILITY,)}


def interpreted(device: torch.device) -> bool:
    """The ``INTERPRET`` constexpr of a launch whose tensors are on ``device``: True on the CPU
    (Triton's interpreter is the only thing that runs a kernel there), False on a GPU."""
    return device.type == "cpu"
