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

NumPy >= 2.4 refuses ``int()`` of a one-element array, which Triton 3.6's interpreter uses for
a runtime scalar as a Python index (``range(0, n, BLOCK)`` in a kernel fails with "only
0-dimensional arrays can be converted to Python scalars"; triton-lang/triton#9171, fixed after
3.6). While the interpreter is on, :func:`_mend_scalar_index` gives the interpreter's tensors
an ``__index__`` that reads the one element.
"""

from __future__ import annotations

import operator

import torch

from tokenspeed_kernel.config import interpreter_enabled
from tokenspeed_kernel.platform import INTERPRETER_CAPABILITY

__all__ = ["VENDORS", "VENDOR_CAPABILITIES", "interpreted"]

VENDORS = ("cuda", "rocm", "cpu")
# The CPU serves these kernels only under Triton's interpreter; a GPU needs nothing more.
VENDOR_CAPABILITIES = {"cpu": (INTERPRETER_CAPABILITY,)}


def interpreted(device: torch.device) -> bool:
    """The ``INTERPRET`` constexpr of a launch whose tensors are on ``device``: True on the CPU
    (Triton's interpreter is the only thing that runs a kernel there), False on a GPU."""
    return device.type == "cpu"


def _scalar_index(self) -> int:
    """``__index__`` of an interpreted scalar: its one element (any other size raises)."""
    return operator.index(self.handle.data.item())


def _mend_scalar_index() -> bool:
    """Wrap the interpreter's per-call patching of ``tl.tensor`` so that ``__index__`` reads a
    scalar's one element (the interpreter restores both patches after the call, newest first).
    Returns whether it was applied: Triton versions without that hook are left alone."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_tokenspeed_mended", False):
        return patch is not None

    def _patch_lang_tensor(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    _patch_lang_tensor._tokenspeed_mended = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


if interpreter_enabled():
    _mend_scalar_index()
