"""Registration metadata shared by the Gluon attention kernels (data, not branches)."""

from __future__ import annotations

import torch

from tokenspeed_kernel.kit import equal_head_dims
from tokenspeed_kernel.registry import Request
from tokenspeed_kernel_amd.ops.attention._config import HEAD_DIMS, MAX_GROUP, PAGE_SIZES

__all__ = [
    "ARCHS",
    "CAPABILITIES",
    "FEATURES",
    "HEAD_DIMS",
    "KV_DTYPES",
    "PAGE_SIZES",
    "Q_DTYPES",
    "VENDORS",
    "supported",
]

VENDORS = ("rocm",)
ARCHS = ("gfx942", "gfx950")
CAPABILITIES = ("mfma",)
Q_DTYPES = (torch.bfloat16, torch.float16)
KV_DTYPES = (*Q_DTYPES, torch.float8_e4m3fn)
FEATURES = ("sinks", "sliding_window", "logit_cap", "return_lse")

# A NaN/inf in a V row a query cannot see may reach it: zeroing non-finite V before P.V made the
# gfx950 extend build spill 2 SGPRs against the zero-spill budget, so it was withdrawn
# (docs/api.md); declared at registration (the edge-input tests report the leak, not fail it).
UNSEEN_SAFE = False


def supported(request: Request) -> str | None:
    """Predicate: what the tiles assume beyond the metadata (head dims equal, power-of-two
    GQA group that fits the packed rows, a 16-bit cache in q's dtype)."""
    why = equal_head_dims(request)
    if why:
        return why
    group = (request.shape("num_q_heads") or 1) // (request.shape("num_kv_heads") or 1)
    rows = group * (request.shape("q_len") or 1)
    if group & (group - 1) or rows > MAX_GROUP:
        return f"GQA group {group} x q_len must be a power of two with at most {MAX_GROUP} packed rows, got {rows}"
    kv, q = request.dtype("kv"), request.dtype("q")
    if kv is not None and q is not None and kv != torch.float8_e4m3fn and kv != q:
        return f"kv dtype {kv} must equal q dtype {q} (or be float8_e4m3fn)"
    return None
