"""``torch.ops.tokenspeed_kernel.store_kvcache``: the KV store as a torch.library custom op
(it mutates the two caches in place; the fake implementation does nothing)."""

from __future__ import annotations

import torch


@torch.library.custom_op("tokenspeed_kernel::store_kvcache", mutates_args=("k_cache", "v_cache"))
def _store_kvcache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    override: str | None,
) -> None:
    from tokenspeed_kernel.ops.kvcache.api import store_kvcache

    store_kvcache(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, override=override)


@_store_kvcache.register_fake
def _(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    override: str | None,
) -> None:
    return None
