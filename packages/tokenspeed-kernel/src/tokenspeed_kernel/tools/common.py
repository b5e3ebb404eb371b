"""Argument checks and output shared by the tools (check, bench, profile, overhead) and the CLI.

Each check raises ``ValueError`` with one line naming the bad value and what would be
accepted; the CLI turns that into exit code 2 and one line on stderr.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from tokenspeed_kernel import registry

__all__ = ["available_devices", "named_kernels", "resolve_device", "write_json"]

# Device types the tools can run on (what torch.device accepts is wider: mps, xpu, meta, ...).
_TOOL_DEVICE_TYPES = ("cpu", "cuda")


def available_devices() -> list[str]:
    """The devices the tools can use here: ``cpu``, then ``cuda:0`` ... when torch sees a GPU
    (on a ROCm build of torch too: its GPUs are ``cuda`` devices to torch)."""
    gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["cpu", *gpus]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` the tools can run on; ``None``: ``cuda`` when a GPU is
    available, else ``cpu``.

    Raises ``ValueError`` (one line: the device and the ones available here) for a string torch
    does not parse, a device type the tools do not run on, or a GPU this torch build or
    machine does not have.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"unknown device {str(device)!r}; available here: {here}") from None
    if dev.type not in _TOOL_DEVICE_TYPES:
        raise ValueError(f"device {str(device)!r}: the tools run on cpu or cuda only; available here: {here}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no GPU support" if not _gpu_build() else "torch sees no GPU on this machine"
            raise ValueError(f"device {str(device)!r} is not available ({why}); available here: {here}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r} is not available; available here: {here}")
    return dev


def _gpu_build() -> bool:
    return bool(getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None))


def named_kernels(op: str, names: list[str]) -> list[str]:
    """``names`` after checking each is a kernel registered for ``op``.

    Raises ``ValueError`` (one line) for a name that is not registered, or registered for
    another operator, listing ``op``'s kernels.
    """
    mine = [spec.name for spec in registry.kernels(op)]
    for name in names:
        if name in mine:
            continue
        other = registry.kernel_op(name)
        where = (
            f"kernel {name!r} is registered for {other}, not {op}"
            if other
            else f"no kernel named {name!r} is registered"
        )
        raise ValueError(f"{where}; {op} kernels: {', '.join(mine) or 'none'}")
    return names


def _finite(value: Any) -> Any:
    """NaN/inf floats as None (strict JSON has no NaN), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str, data: Any) -> None:
    """Write ``data`` to ``path`` as indented JSON (non-finite floats become ``null``)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_finite(data), f, indent=2)
        f.write("\n")
