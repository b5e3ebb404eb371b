"""Reference KV-store kernel in plain PyTorch."""

from __future__ import annotations

import torch

from tokenspeed_kernel.ops.kvcache.args import StoreArgs
from tokenspeed_kernel.registry import Priority, register_kernel

FP8_MAX = 448.0
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _encode(rows: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Rows converted to the cache's dtype (fp8: divided by the scale, saturated to ±448;
    ±inf saturate too, NaN stays NaN, as torch's cast keeps it)."""
    if cache.dtype == torch.float8_e4m3fn:
        assert scale is not None, "store_kvcache gives an fp8 cache its scales (ops/kvcache/api.py)"
        return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)
    return rows.to(cache.dtype)


@register_kernel(
    "kvcache.store",
    name="torch_store_kvcache",
    solution="torch",
    dtypes={"kv": _DTYPES, "cache": (*_DTYPES, torch.float8_e4m3fn)},
    features=("fp8_kv", "strided_kv", "strided_rows"),
    priority=Priority.REFERENCE,
    graph_safe=False,  # boolean-mask indexing has a data-dependent shape (a host sync)
)
def torch_store_kvcache(args: StoreArgs) -> None:
    """Scatter K/V rows to their slots (negative slots skipped) with index_put. Every slot
    is range-checked before anything is written (an out-of-range slot raises ValueError
    and leaves both caches untouched)."""
    valid = args.slot_mapping >= 0
    slots = args.slot_mapping[valid]
    num_slots = args.k_cache.shape[0] * args.k_cache.shape[1]
    if slots.numel() and int(slots.max()) >= num_slots:  # already synchronizing (boolean mask)
        raise ValueError(f"slot_mapping holds slot {int(slots.max())} but the cache has {num_slots} slots")
    page_size = args.k_cache.shape[1]
    pages, offsets = slots // page_size, slots % page_size  # (page, offset) indexing writes through strided views
    for rows, cache, scale in ((args.k, args.k_cache, args.k_scale), (args.v, args.v_cache, args.v_scale)):
        cache.index_put_((pages, offsets), _encode(rows[valid], cache, scale))
