"""Public KV-store operator: ``store_kvcache``."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import (
    ACT_DTYPES,
    call_key,
    call_table,
    check_override,
    check_paged_layout,
    check_same_device,
    check_tensor,
    dtype_name,
    remember,
)
from tokenspeed_kernel.ops._dispatch import dispatch
from tokenspeed_kernel.ops.attention._validate import KV_CACHE_DTYPES, cache_layout, check_kv_scales, kv_scales
from tokenspeed_kernel.ops.kvcache import _custom_ops  # noqa: F401  (defines torch.ops.tokenspeed_kernel.store_kvcache)
from tokenspeed_kernel.ops.kvcache.args import StoreArgs
from tokenspeed_kernel.registry import Request

__all__ = ["store_kvcache", "store_request"]


def store_request(
    *,
    kv_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    head_dim_v: int,
    page_size: int,
    capturable: bool = False,
    strided_kv: bool = False,
    kv_align: int | None = None,
) -> Request:
    """The selector request of a ``store_kvcache`` call, built from plain shapes (public):
    ``kv_dtype`` of the new k/v rows, ``cache_dtype`` of the paged cache (feature ``fp8_kv``
    for float8_e4m3fn), ``Hkv``, ``D``, ``Dv``, ``P``; ``capturable`` admits only kernels
    that can be captured in a CUDA graph; ``strided_kv``: the caches are strided views
    (feature ``strided_kv``); ``kv_align``: their byte alignment (shape key, given by the
    public call for strided caches only)."""
    shapes = [("head_dim", head_dim), ("head_dim_v", head_dim_v), ("num_kv_heads", num_kv_heads)]
    shapes += [("page_size", page_size)] + ([("kv_align", kv_align)] if kv_align is not None else [])
    flags = (("fp8_kv", cache_dtype == torch.float8_e4m3fn), ("strided_kv", strided_kv))
    return Request(
        "kvcache.store",
        (("cache", cache_dtype), ("kv", kv_dtype)),
        tuple(sorted(shapes)),
        frozenset(name for name, on in flags if on),
        capturable,
    )


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
    compiling = torch.compiler.is_compiling()
    key = call_key(compiling, (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale), (override,))
    request = _STORE_CALLS.get(key)
    if request is None:  # a call not seen yet (or not keyable): every check, in full
        request = remember(
            _STORE_CALLS, key, _check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, override, compiling)
        )
    ks, vs = kv_scales(k_cache.dtype == torch.float8_e4m3fn, k_scale, v_scale, k)
    if compiling:
        torch.ops.tokenspeed_kernel.store_kvcache(k, v, k_cache, v_cache, slot_mapping, ks, vs, override)
        return

    num_slots = k_cache.shape[0] * k_cache.shape[1]
    # Slots on the host are checked on every call (no device sync), elsewhere under debug:
    # a call that raises has written nothing.
    host = slot_mapping.device.type == "cpu"
    if (host or config.debug()) and slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise ValueError(
            f"slot_mapping holds slot {int(slot_mapping.max())} but the cache has {num_slots} slots"
            + ("" if host else " (TOKENSPEED_KERNEL_DEBUG check)")
        )
    page_size = k_cache.shape[1]
    assert request is not None
    spec = dispatch(
        request,
        k.device,
        override,
        lambda: {
            "num_tokens": k.shape[0],
            "num_kv_heads": k.shape[1],
            "head_dim": k.shape[2],
            "head_dim_v": v.shape[2],
            "page_size": page_size,
            "num_pages": k_cache.shape[0],
            "dtype": dtype_name(k.dtype),
            "kv_dtype": dtype_name(k_cache.dtype),
        },
    )
    if k.shape[0]:
        spec.fn(StoreArgs(k, v, k_cache, v_cache, slot_mapping, ks, vs))


# Call key -> the selector request of a call that passed every check (see ops/_checks.py).
_STORE_CALLS: dict[Hashable, Request | None] = call_table()  # None: never stored (no key while tracing)


def _check_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    override: str | None,
    compiling: bool,
) -> Request | None:
    """Every host check of :func:`store_kvcache`, in order; the call's selector request
    (None while tracing: the custom op selects when it runs)."""
    check_tensor("k", k, ndim=3, dtypes=ACT_DTYPES)
    if k.shape[1] == 0 or k.shape[2] == 0:
        raise ValueError(f"k must have at least one KV head and a head dim >= 1, got shape {list(k.shape)}")
    check_tensor("v", v, ndim=3, dtypes=(k.dtype,), shape=(k.shape[0], k.shape[1], None))
    if v.shape[2] == 0:
        raise ValueError(f"v must have a head dim >= 1, got shape {list(v.shape)}")
    check_tensor(
        "k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES, shape=(None, None, k.shape[1], k.shape[2]), contiguous=False
    )
    check_tensor(
        "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=(*k_cache.shape[:3], v.shape[2]), contiguous=False
    )
    check_paged_layout("k_cache", k_cache)
    check_paged_layout("v_cache", v_cache)
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), shape=(k.shape[0],))
    check_same_device("k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k_cache.dtype not in (k.dtype, torch.float8_e4m3fn):
        raise TypeError(
            f"k_cache dtype {dtype_name(k_cache.dtype)} must equal k dtype {dtype_name(k.dtype)} (or be float8_e4m3fn)"
        )
    check_kv_scales(k_cache.dtype, k_scale, v_scale, k)
    check_override(override)
    if compiling:
        return None
    strided, align = cache_layout(k_cache, v_cache)
    return store_request(
        kv_dtype=k.dtype,
        cache_dtype=k_cache.dtype,
        num_kv_heads=k.shape[1],
        head_dim=k.shape[2],
        head_dim_v=v.shape[2],
        page_size=k_cache.shape[1],
        strided_kv=strided,
        kv_align=align,
    )
