"""Public KV-store operator: ``store_kvcache``, the ``kvcache.store`` :class:`Operator`."""

from __future__ import annotations

import torch

from tokenspeed_kernel.ops._operator import Operator
from tokenspeed_kernel.ops.kvcache import _custom_ops  # noqa: F401  (defines torch.ops.tokenspeed_kernel.store_kvcache)
from tokenspeed_kernel.ops.kvcache._validate import store_request
from tokenspeed_kernel.ops.kvcache.args import StoreArgs
from tokenspeed_kernel.ops.kvcache.plan import StoreCall

__all__ = ["STORE", "store_kvcache", "store_request"]

STORE = Operator("kvcache.store", StoreArgs, "torch_store_kvcache", "store_kvcache", StoreCall)


def store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    override: str | None = None,
) -> None:
    """Write new K/V rows into a paged cache, in place.

    Args:
        k: ``[num_tokens, Hkv, D]`` bf16/fp16/fp32. v: ``[num_tokens, Hkv, Dv]``, k's dtype.
        k_cache: ``[num_pages, page_size, Hkv, D]``, k's dtype or float8_e4m3fn; any
            page/token/head strides, stride 1 in the head dim: a strided view of an engine's
            cache is written in place.
        v_cache: ``[num_pages, page_size, Hkv, Dv]``, k_cache's dtype, same layout rules.
        slot_mapping: int64 ``[num_tokens]``; slot = page * page_size + offset; a negative
            slot is padding and is skipped.
        k_scale, v_scale: required for an fp8 cache (float or one-element float32 tensor);
            the cache stores ``value / scale`` saturated to the fp8 range.
        override: force a kernel by name (e.g. ``"torch_store_kvcache"``).
    """
    STORE.call(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, override)
