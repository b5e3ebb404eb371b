"""From a validated call to a kernel: select for the tensors' device, record the shape.

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

__all__ = ["capture_signature", "dispatch"]

_captured: set[str] = set()
_last = threading.local()


def last_kernel() -> str | None:
    """The kernel the last public call on this thread was dispatched to (tools, debugging)."""
    return getattr(_last, "name", None)


def last_request() -> Request | None:
    """The request of the last public call on this thread (tools, tests)."""
    return getattr(_last, "request", None)


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
    (built lazily by ``signature()``) when capture is on."""
    spec = select(request, platform_for(device), override)
    _last.name, _last.request = spec.name, request
    if config.capture_path() is not None:
        capture_signature(request.op, spec.name, signature())
    return spec
