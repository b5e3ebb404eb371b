"""Typed argument object of ``kvcache.store``: what a KV-store kernel receives."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StoreArgs"]


@dataclass(slots=True)
class StoreArgs:
    """Write new K/V rows into a paged cache (``kvcache.store``).

    Attributes:
        k: ``[num_tokens, Hkv, D]``, bf16/fp16/fp32; contiguous, or (a call asking for
            ``strided_rows``) rows ``[Hkv, D]`` with a row stride of their own: address it
            through ``k.stride(0)`` (a kernel that needs it contiguous omits the feature).
        v: ``[num_tokens, Hkv, Dv]``, k's dtype; the same layout rules (its own row stride).
        k_cache: ``[num_pages, P, Hkv, D]``, k's dtype or float8_e4m3fn; written in place,
            possibly a strided view (any page/token/head strides, stride 1 in the head dim;
            kernels without the ``strided_kv`` feature get contiguous caches only).
        v_cache: ``[num_pages, P, Hkv, Dv]``, k_cache's dtype; written in place; its strides
            may differ from k_cache's.
        slot_mapping: int64 ``[num_tokens]``; token ``t`` goes to page ``slot // P``, offset
            ``slot % P``; a negative slot means padding and is skipped.
        k_scale / v_scale: float32 ``[1]`` for an fp8 cache (stored = value / scale,
            saturated to the fp8 range), else None.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
