"""Persistent scratch buffers of the NVIDIA kernels: allocated once per (device, name,
shape, dtype), then reused, so a CUDA graph captured over a call keeps valid addresses."""

from __future__ import annotations

import torch

_buffers: dict[tuple, torch.Tensor] = {}


def workspace(
    device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype, zero: bool = False
) -> torch.Tensor:
    """The buffer for (device, name, shape, dtype), allocated with ``torch.empty`` on first use
    (``torch.zeros`` with ``zero``: for counters the kernels return to 0 themselves)."""
    key = (device, name, shape, dtype)
    buf = _buffers.get(key)
    if buf is None:
        buf = _buffers[key] = (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
    return buf
