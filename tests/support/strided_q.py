"""A row-strided q, as a fused qkv projection hands it over (request feature ``strided_q``)."""

from __future__ import annotations

import torch

__all__ = ["row_strided"]


def row_strided(q: torch.Tensor, extra: int, offset: int = 0) -> torch.Tensor:
    """``q [rows, Hq, D]``'s values in rows ``extra`` elements wider than ``Hq * D`` (a fused
    qkv projection's q: row stride ``Hq * D + extra``), the first row ``offset`` elements into
    a fresh buffer (16-byte aligned, as torch allocates); every other element of the buffer is
    NaN, so a kernel that reads past a row's q fails a float64 comparison."""
    rows, heads, dim = q.shape
    width = heads * dim + extra
    buf = torch.full((offset + rows * width,), float("nan"), dtype=q.dtype, device=q.device)
    view = buf[offset:].view(rows, width)[:, : heads * dim].view(rows, heads, dim)
    view.copy_(q)
    return view
