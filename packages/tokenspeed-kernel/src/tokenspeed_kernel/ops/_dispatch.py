"""From a validated call to a kernel: select for the tensors' device, record the shape.

``dispatch`` also guards CUDA-graph capture: a kernel registered ``graph_safe=False`` called
while the current CUDA stream is capturing raises ``RuntimeError`` before it launches
(selection itself is not changed by capture: request ``capturable`` kernels explicitly,
e.g. ``mha_decode_plan(..., capturable=True)``). ``last_kernel()`` names the kernel of the
last public call on this thread.

Shape capture (``TOKENSPEED_KERNEL_CAPTURE=FILE``): each public call appends one JSON line
``{"op", "kernel", "signature"}`` per distinct signature, where the signature holds shapes,
dtypes and options, never data. ``tokenspeed-kernel bench --replay FILE`` reads it back.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import select

__all__ = ["capture_signature", "check_capturable", "dispatch", "is_capturing", "last_kernel", "record"]

_captured: set[str] = set()
_last = threading.local()


def last_kernel() -> str | None:
    """The name of the kernel that served the last public call on this thread (functional
    operators and ``DecodePlan.run``), or None before any call. Public as
    ``tokenspeed_kernel.last_kernel``."""
    return getattr(_last, "name", None)


def last_request() -> Request | None:
    """The request of the last public call on this thread (tools, tests)."""
    return getattr(_last, "request", None)


def record(spec: KernelSpec, request: Request) -> None:
    """Remember ``spec`` as the kernel of this thread's last call (plans call it on each run)."""
    _last.name, _last.request = spec.name, request


def is_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False on a torch build or a
    machine without CUDA)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):  # a CPU-only build has no CUDA runtime to ask
        return False


def check_capturable(spec: KernelSpec) -> None:
    """``RuntimeError`` when ``spec`` is not graph-safe and the stream is capturing; free for
    graph-safe kernels (the capture state is only read for the others)."""
    if not spec.graph_safe and is_capturing():
        raise RuntimeError(
            f"kernel {spec.name!r} ({spec.op}) is not graph-safe: it synchronizes with the host and "
            "cannot be captured in a CUDA graph. Run it eagerly, or select a graph-safe kernel "
            "(mha_decode_plan(..., capturable=True), explain(..., capturable=True))"
        )


_capture_lock = threading.Lock()


def capture_signature(op: str, kernel: str, signature: dict[str, Any]) -> None:
    """Append ``signature`` to the capture file unless this exact one was written already."""
    path = config.capture_path()
    if path is None:
        return
    line = json.dumps({"op": op, "kernel": kernel, "signature": signature}, sort_keys=True)
    with _capture_lock:
        if line in _captured:
            return
        _captured.add(line)
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def dispatch(
    request: Request,
    device: torch.device,
    override: str | None,
    signature: Callable[[], dict[str, Any]],
) -> KernelSpec:
    """The kernel for ``request`` on ``device``'s platform; records the call's signature
    (built lazily by ``signature()``) when capture is on. ``RuntimeError`` when the kernel
    is not graph-safe and the stream is capturing."""
    spec = select(request, platform_for(device), override)
    check_capturable(spec)
    record(spec, request)
    if config.capture_path() is not None:
        capture_signature(request.op, spec.name, signature())
    return spec
