"""Public KV-store operator: ``store_kvcache``, the ``kvcache.store`` :class:`Operator` and the
plan of one call (:class:`StoreCall`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import call_key, dtype_name
from tokenspeed_kernel.ops._dispatch import dispatch
from tokenspeed_kernel.ops._operator import Operator, Plan
from tokenspeed_kernel.ops.attention._validate import cache_layout, kv_scales
from tokenspeed_kernel.ops.kvcache import _custom_ops  # noqa: F401  (defines torch.ops.tokenspeed_kernel.store_kvcache)
from tokenspeed_kernel.ops.kvcache._validate import check_store, store_request
from tokenspeed_kernel.ops.kvcache.args import StoreArgs
from tokenspeed_kernel.registry import Request

__all__ = ["STORE", "StoreCall", "store_kvcache", "store_request"]


@dataclass(slots=True, eq=False)
class StoreCall(Plan):
    """What the checks of a ``store_kvcache`` call derived.

    Attributes:
        request: the selector request (None while tracing: the custom op selects when it runs).
        device: the tensors' device.
        fp8: the cache is float8_e4m3fn (the call's scales become float32 ``[1]`` tensors).
        num_tokens: rows to store (0: nothing is launched).
        num_slots: ``num_pages * page_size``, the slots the cache holds.
        host_slots: ``slot_mapping`` is on the host, so its range is checked on every call.
        signature: builds the capture signature (``TOKENSPEED_KERNEL_CAPTURE``) when asked.
    """

    request: Request | None
    device: torch.device
    fp8: bool
    num_tokens: int
    num_slots: int
    host_slots: bool
    signature: Callable[[], dict[str, Any]]

    @staticmethod
    def key(
        k: object,
        v: object,
        k_cache: object,
        v_cache: object,
        slot_mapping: object,
        k_scale: object,
        v_scale: object,
        override: object,
    ) -> Hashable | None:
        return call_key((k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale), (override,))

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> StoreCall:
        check_store(*call)
        k, v, k_cache, v_cache, slot_mapping = call[:5]
        num_tokens, num_kv_heads, head_dim = k.shape
        num_pages, page_size = k_cache.shape[:2]
        request: Request | None = None
        signature: Callable[[], dict[str, Any]] = dict  # while tracing: none
        if not compiling:
            strided, align = cache_layout(k_cache, v_cache)
            request = store_request(
                kv_dtype=k.dtype,
                cache_dtype=k_cache.dtype,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                head_dim_v=v.shape[2],
                page_size=page_size,
                strided_kv=strided,
                kv_align=align,
                # the call key holds k's and v's strides, which fix this
                strided_rows=not (k.is_contiguous() and v.is_contiguous()),
            )
            signature = functools.partial(
                dict,
                num_tokens=num_tokens,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                head_dim_v=v.shape[2],
                page_size=page_size,
                num_pages=num_pages,
                dtype=dtype_name(k.dtype),
                kv_dtype=dtype_name(k_cache.dtype),
            )
        return cls(
            request,
            k.device,
            k_cache.dtype == torch.float8_e4m3fn,
            num_tokens,
            num_pages * page_size,
            slot_mapping.device.type == "cpu",
            signature,
        )

    def run(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float | torch.Tensor | None,
        v_scale: float | torch.Tensor | None,
        override: str | None,
    ) -> None:
        ks, vs = kv_scales(self.fp8, k_scale, v_scale, k)
        # Slots on the host are checked on every call (no device sync), elsewhere under debug:
        # a call that raises has written nothing.
        if (self.host_slots or config.debug()) and slot_mapping.numel() and int(slot_mapping.max()) >= self.num_slots:
            raise ValueError(
                f"slot_mapping holds slot {int(slot_mapping.max())} but the cache has {self.num_slots} slots"
                + ("" if self.host_slots else " (TOKENSPEED_KERNEL_DEBUG check)")
            )
        assert self.request is not None
        spec = dispatch(self.request, self.device, override, self.signature)
        if self.num_tokens:
            spec.fn(StoreArgs(k, v, k_cache, v_cache, slot_mapping, ks, vs))

    def trace(self, *call: Any) -> None:
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, override = call
        ks, vs = kv_scales(self.fp8, k_scale, v_scale, k)
        torch.ops.tokenspeed_kernel.store_kvcache(k, v, k_cache, v_cache, slot_mapping, ks, vs, override)


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
            Each contiguous, or row-strided: rows ``[Hkv, D]`` contiguous within themselves
            with a row stride of their own (a fused qkv projection's k and v; request
            feature ``strided_rows``, which the kernels that read them so claim).
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
