"""Helpers the Gluon MoE decode launchers share: power-of-two rounding, persistent
workspaces (stable addresses for CUDA-graph replay), MXFP4 weights as int32 words."""

from __future__ import annotations

import torch

from tokenspeed_kernel.quant import MXFP4Weight

_workspace: dict[tuple, torch.Tensor] = {}


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def workspace(device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A persistent buffer per (device, name, shape, dtype): allocated once, then reused."""
    key = (device, name, shape, dtype)
    buf = _workspace.get(key)
    if buf is None:
        buf = _workspace[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def words(w: MXFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed bytes as int32 words (a view; 8 E2M1 codes each, low nibble first) and the
    E8M0 scales, both contiguous."""
    packed = w.packed if w.packed.is_contiguous() else w.packed.contiguous()
    scales = w.scales if w.scales.is_contiguous() else w.scales.contiguous()
    return packed.view(torch.int32), scales
