"""Host-side validation of ``store_kvcache``, and its selector request.

Everything here reads only metadata (shapes, dtypes, devices, layouts); the slot range check,
which reads ``slot_mapping``, runs per call in :mod:`.plan` (on the host for host slots, under
``TOKENSPEED_KERNEL_DEBUG`` for device slots).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.ops._checks import (
    ACT_DTYPES,
    check_override,
    check_paged_layout,
    check_same_device,
    check_tensor,
    dtype_name,
)
from tokenspeed_kernel.ops.attention._validate import KV_CACHE_DTYPES, check_kv_scales, check_rows
from tokenspeed_kernel.registry import Request

__all__ = ["check_store", "store_request"]


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
    strided_rows: bool = False,
) -> Request:
    """The selector request of a ``store_kvcache`` call, built from plain shapes (public):
    ``kv_dtype`` of the new k/v rows, ``cache_dtype`` of the paged cache (feature ``fp8_kv``
    for float8_e4m3fn), ``Hkv``, ``D``, ``Dv``, ``P``; ``capturable`` admits only kernels
    that can be captured in a CUDA graph; ``strided_kv``: the caches are strided views
    (feature ``strided_kv``); ``kv_align``: their byte alignment (shape key, given by the
    public call for strided caches only); ``strided_rows``: k or v is row-strided, rows
    ``[Hkv, D]`` with a row stride of their own (a fused qkv projection's k and v; feature
    ``strided_rows``)."""
    shapes = [("head_dim", head_dim), ("head_dim_v", head_dim_v), ("num_kv_heads", num_kv_heads)]
    shapes += [("page_size", page_size)] + ([("kv_align", kv_align)] if kv_align is not None else [])
    flags = (
        ("fp8_kv", cache_dtype == torch.float8_e4m3fn),
        ("strided_kv", strided_kv),
        ("strided_rows", strided_rows),
    )
    return Request(
        "kvcache.store",
        (("cache", cache_dtype), ("kv", kv_dtype)),
        tuple(sorted(shapes)),
        frozenset(name for name, on in flags if on),
        capturable,
    )


def check_store(
    k: object,
    v: object,
    k_cache: object,
    v_cache: object,
    slot_mapping: object,
    k_scale: object,
    v_scale: object,
    override: object,
) -> None:
    """Every host check of ``store_kvcache``, in order."""
    k = check_tensor("k", k, ndim=3, dtypes=ACT_DTYPES, contiguous=False)
    if k.shape[1] == 0 or k.shape[2] == 0:
        raise ValueError(f"k must have at least one KV head and a head dim >= 1, got shape {list(k.shape)}")
    check_rows("k", k, "Hkv")
    v = check_tensor("v", v, ndim=3, dtypes=(k.dtype,), shape=(k.shape[0], k.shape[1], None), contiguous=False)
    if v.shape[2] == 0:
        raise ValueError(f"v must have a head dim >= 1, got shape {list(v.shape)}")
    check_rows("v", v, "Hkv", "Dv")
    k_cache = check_tensor(
        "k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES, shape=(None, None, k.shape[1], k.shape[2]), contiguous=False
    )
    v_cache = check_tensor(
        "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), shape=(*k_cache.shape[:3], v.shape[2]), contiguous=False
    )
    check_paged_layout("k_cache", k_cache)
    check_paged_layout("v_cache", v_cache)
    slot_mapping = check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64,), shape=(k.shape[0],))
    check_same_device("k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if k_cache.dtype not in (k.dtype, torch.float8_e4m3fn):
        raise TypeError(
            f"k_cache dtype {dtype_name(k_cache.dtype)} must equal k dtype {dtype_name(k.dtype)} (or be float8_e4m3fn)"
        )
    check_kv_scales(k_cache.dtype, k_scale, v_scale, k)
    check_override(override)
