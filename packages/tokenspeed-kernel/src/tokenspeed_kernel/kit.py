"""A public kit for kernel wheels: the small host-side helpers every backend needs.

Backend wheels (the bundled ones and out-of-tree plugins) import these instead of keeping
their own copies. Everything here is plain Python over torch: integer rounding, the
multiprocessor count and vendor tag of a device (host queries), the split heuristic that
fills a device with programs, a predicate shared by attention kernels, and the activation codes the MoE kernels are compiled with.
Nothing here launches, synchronizes with a device or names a backend.

``cdiv`` and ``next_pow2`` are plain-int arithmetic on purpose: a kernel language's own
host-side ``cdiv``/``next_power_of_2`` may be a compile-time function object whose host
call costs microseconds (argument unwrapping) against tens of nanoseconds here. Kernel
bodies keep their language's ``cdiv``.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

from tokenspeed_kernel.platform import Vendor
from tokenspeed_kernel.registry import Request

__all__ = ["ACTIVATION_CODES", "cdiv", "equal_head_dims", "fill_splits", "next_pow2", "sm_count", "vendor_of"]

# The ``ACTIVATION`` constexpr of the MoE kernels: the activation features of ``moe.apply``
# (operators.py) as the small ints the kernels branch on. Read-only: the kernels hard-code
# these values, so a wheel cannot renumber them for the others.
ACTIVATION_CODES = MappingProxyType({"silu": 0, "gelu": 1, "swiglu_oai": 2})


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for Python ints.

    Args:
        a: the dividend (any int).
        b: the divisor, ``> 0`` (0 raises ``ZeroDivisionError``).
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n``; 1 for ``n <= 1``.

    Args:
        n: an int (or anything ``int()`` accepts, e.g. a 0-d integer tensor's value).
    """
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device, *, default: int = 1) -> int:
    """Multiprocessors of a GPU device: streaming multiprocessors on CUDA, compute units on
    ROCm. A host query, made once per device index and cached.

    Args:
        device: the device; ``device.type == "cuda"`` (CUDA or ROCm builds of torch) is
            queried, a device without an index means the current device.
        default: the answer for any other device type (the CPU, where kernels run under
            an interpreter), where a split heuristic still needs a number.
    """
    if device.type != "cuda":
        return default
    return _multiprocessors(torch.cuda.current_device() if device.index is None else device.index)


def vendor_of(device: torch.device) -> Vendor:
    """The platform vendor tag that serves tensors on ``device``: ``"cpu"`` for the CPU (kernels
    under an interpreter), otherwise the GPU vendor of this torch build: ``"rocm"`` when torch
    was built for HIP (a ROCm build reports ``device.type == "cuda"`` too), else ``"cuda"``.
    The tags are those of :class:`tokenspeed_kernel.platform.Platform`.

    Args:
        device: the device of a call's tensors.
    """
    if device.type == "cpu":
        return "cpu"
    return "rocm" if getattr(torch.version, "hip", None) else "cuda"


def fill_splits(programs: int, num_sms: int, *, most: int, per_sm: int = 2) -> int:
    """How many parts to split each of ``programs`` independent programs into (split-K,
    split-KV) so that the grid holds about ``per_sm`` programs per multiprocessor:
    ``cdiv(per_sm * num_sms, programs)``, clamped to ``[1, most]``.

    Args:
        programs: programs of the unsplit grid (e.g. batch x KV heads); below 1 counts as 1.
        num_sms: multiprocessors of the device (:func:`sm_count`).
        most: the largest split count the caller allows (its own cap, e.g. "every split
            keeps at least N keys" or a kernel's maximum); below 1 counts as 1.
        per_sm: programs per multiprocessor to aim for.
    """
    return max(1, min(cdiv(per_sm * num_sms, max(programs, 1)), most))


def equal_head_dims(request: Request) -> str | None:
    """A registration predicate: the q/k and v head dims of an attention request are equal
    (kernels built for one head dim). Sizes are left to the registration's shape rule; a
    request that leaves either out passes.

    Args:
        request: the selector's request (``head_dim``, ``head_dim_v`` shape keys).

    Returns:
        None when equal, else the reason in words.
    """
    d, dv = request.shape("head_dim"), request.shape("head_dim_v")
    if d is not None and dv is not None and d != dv:
        return f"head_dim_v={dv} differs from head_dim={d}"
    return None
