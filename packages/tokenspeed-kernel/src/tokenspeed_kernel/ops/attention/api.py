"""Public attention operators: ``mha_prefill``, ``mha_extend_with_kvcache``, ``mha_decode_with_kvcache``.

Each is an :class:`~tokenspeed_kernel.ops._operator.Operator` (``PREFILL``, ``EXTEND``,
``DECODE``) whose call path validates the arguments on the host (``TypeError``/``ValueError``
naming the argument; the checks are in :mod:`._validate`), remembers the call's plan
(:class:`PrefillCall`, :class:`ExtendCall`, :class:`DecodeCall`: head geometry, resolved
scale, output shapes, the selector request) per call key, and runs it: selection, outputs,
the typed arguments of :mod:`tokenspeed_kernel.ops.attention.args`, the kernel. Under
``torch.compile`` the plan traces the ``torch.ops.tokenspeed_kernel.*`` custom op instead.
``mha_decode_plan`` (:mod:`.plan`) runs a :class:`DecodeCall` with its kernel selected once.
Semantics shared by all three are spelled out in :mod:`tokenspeed_kernel.ops.attention.args`
and docs/api.md.

Capture signatures (``TOKENSPEED_KERNEL_CAPTURE``) use the field names of
``tokenspeed_kernel.tools.cases.attention.AttentionCase`` plus ``batch``, ``total_q``,
``total_k`` (prefill), ``max_seqlen_q`` and ``max_seqlen_k``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import at_least, call_key, kv_align, pow2_bucket
from tokenspeed_kernel.ops._dispatch import dispatch
from tokenspeed_kernel.ops._operator import Operator, Plan
from tokenspeed_kernel.ops.attention import _custom_ops  # noqa: F401  (defines torch.ops.tokenspeed_kernel.mha_*)
from tokenspeed_kernel.ops.attention._validate import (
    attention_request,
    attention_signature,
    cache_layout,
    check_decode_call,
    check_extend,
    check_prefill,
    debug_check_cu_seqlens,
    debug_check_pages,
    kernel_window,
    kv_scales,
    q_layout,
)
from tokenspeed_kernel.ops.attention.args import DecodeArgs, ExtendArgs, Heads, PrefillArgs
from tokenspeed_kernel.registry import Request

__all__ = [
    "DECODE",
    "EXTEND",
    "PREFILL",
    "DecodeCall",
    "ExtendCall",
    "PrefillCall",
    "attention_request",
    "mha_decode_with_kvcache",
    "mha_extend_with_kvcache",
    "mha_prefill",
]


def traced_result(result: torch.Tensor, lse: torch.Tensor, out: torch.Tensor | None, return_lse: bool) -> Any:
    """The public result of an attention custom op's ``(out, lse)``, written into ``out`` when given."""
    if out is not None:
        result = out.copy_(result)
    return (result, lse) if return_lse else result


def _outputs(
    plan: PrefillCall | ExtendCall | DecodeCall, q: torch.Tensor, out: torch.Tensor | None, return_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A call's outputs: ``out`` (allocated in the plan's public shape when None) and lse (the
    plan's public shape, float32) when asked for."""
    if out is None:
        out = q.new_empty(*plan.out_shape)
    return out, torch.empty(*plan.lse_shape, dtype=torch.float32, device=plan.device) if return_lse else None


def _facts(
    compiling: bool,
    op: str,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: Heads,
    *,
    window_left: int,
    sinks: bool,
    logit_cap: float,
    return_lse: bool,
    batch: int,
    causal: bool | None = None,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
    page_size: int | None = None,
    q_len: int | None = None,
    capturable: bool = False,
    max_seqlen_q: int | None = None,
    total_q: int | None = None,
    total_k: int | None = None,
    kv_prefix: bool | None = None,
    unaligned_qkv: bool = False,
    strided_q: bool = False,
    q_align: int | None = None,
) -> tuple[Request | None, Callable[..., dict[str, Any]]]:
    """The selector request of an attention call with these checked facts, and what builds its
    capture signature (given the per-call lengths: ``signature(max_seqlen_k=...)``); none while tracing (``compiling``: the custom op
    selects when it runs). ``causal`` None: decode (always causal; its request carries
    ``batch_bucket`` and ``q_len``); ``caches``: the paged K/V whose layout the request
    carries; ``max_seqlen_q``: prefill's and extend's length bucket; ``kv_prefix``: prefill's (keys may
    outnumber queries: ``cu_seqlens_k`` is not ``cu_seqlens_q``)."""
    if compiling:
        return None, dict
    strided, align = (False, None) if caches is None else cache_layout(*caches)
    request = attention_request(
        op,
        q_dtype=q_dtype,
        kv_dtype=kv_dtype,
        heads=heads,
        causal=True if causal is None else causal,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        return_lse=return_lse,
        page_size=page_size,
        q_len=q_len,
        capturable=capturable,
        batch=batch if causal is None else None,
        max_seqlen_q=max_seqlen_q,
        strided_kv=strided,
        kv_align=align,
        kv_prefix=kv_prefix,
        unaligned_qkv=unaligned_qkv,
        strided_q=strided_q,
        q_align=q_align,
    )
    own = (("total_q", total_q), ("total_k", total_k), ("q_len", q_len), ("page_size", page_size), ("causal", causal))
    signature = functools.partial(
        attention_signature,
        q_dtype,
        kv_dtype,
        heads,
        batch=batch,
        **{name: value for name, value in own if value is not None},
        window_left=window_left,
        sinks=sinks,
        logit_cap=float(logit_cap),
        return_lse=return_lse,
    )
    return request, signature


def _q_facts(compiling: bool, q: torch.Tensor) -> dict[str, Any]:
    """The request's facts of a checked extend or decode q (:func:`q_layout`): ``strided_q``
    and, for a row-strided q, ``q_align``; none while tracing (no request is built)."""
    if compiling:
        return {}
    strided, align = q_layout(q)
    return {"strided_q": strided, "q_align": align}


@dataclass(slots=True, eq=False)
class PrefillCall(Plan):
    """What the checks of an ``mha_prefill`` call derived (see :mod:`tokenspeed_kernel.ops._operator`).

    Attributes:
        request: the selector request (None while tracing: the custom op selects when it runs).
        device: q's device.
        heads: head counts and dims. scale: the resolved softmax scale.
        window: the window the kernel receives (``kernel_window``). logit_cap: as a float.
        total_q, total_k: query and key rows (``total_q = 0``: nothing is launched).
        out_shape: ``[total_q, Hq, Dv]``. lse_shape: ``[total_q, Hq]``.
        signature: builds the capture signature from the per-call lengths (``TOKENSPEED_KERNEL_CAPTURE``).
    """

    request: Request | None
    device: torch.device
    heads: Heads
    scale: float
    window: int
    logit_cap: float
    total_q: int
    total_k: int
    out_shape: tuple[int, int, int]
    lse_shape: tuple[int, int]
    signature: Callable[..., dict[str, Any]]

    @staticmethod
    def key(
        q: object,
        k: object,
        v: object,
        cu_seqlens_q: object,
        cu_seqlens_k: object,
        max_seqlen_q: object,
        max_seqlen_k: object,
        causal: object,
        softmax_scale: object,
        window_left: object,
        sinks: object,
        logit_cap: object,
        return_lse: object,
        out: object,
        override: object,
    ) -> Hashable | None:
        # The lengths vary per call: checked here, and only their request bucket is keyed; so is
        # whether one lengths tensor serves queries and keys (the request's kv_prefix).
        if not (at_least(max_seqlen_q, 0) and at_least(max_seqlen_k, 0)):
            return None
        return call_key(
            (q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out),
            (
                causal,
                softmax_scale,
                window_left,
                logit_cap,
                return_lse,
                override,
                pow2_bucket(max_seqlen_q),  # type: ignore[arg-type]
                cu_seqlens_k is cu_seqlens_q,
            ),
        )

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> PrefillCall:
        heads, scale = check_prefill(*call)
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, _, causal, _, window_left, sinks, logit_cap, return_lse = (
            call[:13]
        )
        total_q, total_k = q.shape[0], k.shape[0]
        request, signature = _facts(
            compiling,
            "attention.prefill",
            q.dtype,
            k.dtype,
            heads,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=logit_cap,
            return_lse=return_lse,
            batch=cu_seqlens_q.shape[0] - 1,
            causal=causal,
            max_seqlen_q=max_seqlen_q,
            total_q=total_q,
            total_k=total_k,
            kv_prefix=cu_seqlens_k is not cu_seqlens_q,
            # the call key holds q/k/v's storage offsets and strides, which fix this (the
            # storage itself 16-byte aligned, as every torch allocator returns it)
            unaligned_qkv=not compiling and kv_align(q, k, v) < 16,
            strided_q=not q.is_contiguous(),
        )
        return cls(
            request,
            q.device,
            heads,
            scale,
            kernel_window(window_left, total_k),
            float(logit_cap),
            total_q,
            total_k,
            (total_q, heads.num_q_heads, heads.head_dim_v),
            (total_q, heads.num_q_heads),
            signature,
        )

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        softmax_scale: float | None,
        window_left: int,
        sinks: torch.Tensor | None,
        logit_cap: float,
        return_lse: bool,
        out: torch.Tensor | None,
        override: str | None,
    ) -> Any:
        if config.debug():
            q_lens = debug_check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, self.total_q, max_seqlen_q, "max_seqlen_q")
            k_lens = debug_check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, self.total_k, max_seqlen_k, "max_seqlen_k")
            if causal and any(lq > lk for lq, lk in zip(q_lens, k_lens)):
                raise ValueError(
                    "causal prefill needs every query length <= its key length (TOKENSPEED_KERNEL_DEBUG check)"
                )
        assert self.request is not None
        spec = dispatch(
            self.request,
            self.device,
            override,
            lambda: self.signature(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        )
        out, lse = _outputs(self, q, out, return_lse)
        if self.total_q:  # no queries (an empty batch): nothing to compute, nothing launched
            # Kernels get bounds no looser than the tensors: a sequence holds at most total_q
            # queries and total_k keys (grids sized by max_seqlen_q stay real; see docs/api.md).
            spec.fn(
                PrefillArgs(
                    q,
                    k,
                    v,
                    cu_seqlens_q,
                    cu_seqlens_k,
                    min(max_seqlen_q, self.total_q),
                    min(max_seqlen_k, self.total_k),
                    causal,
                    self.scale,
                    self.window,
                    sinks,
                    self.logit_cap,
                    out,
                    lse,
                )
            )
        return (out, lse) if return_lse else out

    def trace(self, *call: Any) -> Any:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, _, window_left, sinks = call[:11]
        logit_cap, return_lse, out, override = call[11:]
        result, lse = torch.ops.tokenspeed_kernel.mha_prefill(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            self.scale,
            window_left,
            sinks,
            float(logit_cap),
            return_lse,
            override,
        )
        return traced_result(result, lse, out, return_lse)


PREFILL = Operator("attention.prefill", PrefillArgs, "torch_prefill", "mha_prefill", PrefillCall)


def mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    override: str | None = None,
) -> Any:
    """Attention over a ragged batch of contiguous sequences.

    Args:
        q: ``[total_q, Hq, D]`` bf16/fp16/fp32; sequence ``b`` owns rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k: ``[total_k, Hkv, D]``, q's dtype. v: ``[total_k, Hkv, Dv]``, q's dtype.
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` prefix sums starting at 0.
        max_seqlen_q, max_seqlen_k: host ints bounding the query / key lengths.
        causal: bottom-right aligned (a sequence's queries are its last positions).
        softmax_scale: default ``1/sqrt(D)``. window_left: ``-1`` = no window.
        sinks: float32 ``[Hq]`` or None. logit_cap: ``0`` = none.
        return_lse: also return float32 ``[total_q, Hq]`` log-sum-exp (sink included).
        out: optional ``[total_q, Hq, Dv]`` output in q's dtype.
        override: force a kernel by name.

    Returns:
        ``out [total_q, Hq, Dv]`` in q's dtype, or ``(out, lse)``.
    """
    return PREFILL.call(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        window_left,
        sinks,
        logit_cap,
        return_lse,
        out,
        override,
    )


# The plan cache of mha_prefill (call key -> PrefillCall).
_PREFILL_CALLS = PREFILL.plans


@dataclass(slots=True, eq=False)
class ExtendCall(Plan):
    """What the checks of an ``mha_extend_with_kvcache`` call derived.

    Attributes:
        request, device, heads, scale, window, logit_cap, out_shape, lse_shape, signature:
            as in :class:`PrefillCall` (the window capped at the page table's keys).
        fp8: the cache is float8_e4m3fn (the call's scales become float32 ``[1]`` tensors).
        page_size: ``P``. num_pages: the cache's pages. total_q: query rows.
    """

    request: Request | None
    device: torch.device
    heads: Heads
    scale: float
    window: int
    logit_cap: float
    fp8: bool
    page_size: int
    num_pages: int
    total_q: int
    out_shape: tuple[int, int, int]
    lse_shape: tuple[int, int]
    signature: Callable[..., dict[str, Any]]

    @staticmethod
    def key(
        q: object,
        k_cache: object,
        v_cache: object,
        page_table: object,
        cu_seqlens_q: object,
        cache_seqlens: object,
        max_seqlen_q: object,
        max_seqlen_k: object,
        causal: object,
        softmax_scale: object,
        window_left: object,
        sinks: object,
        logit_cap: object,
        k_scale: object,
        v_scale: object,
        return_lse: object,
        out: object,
        override: object,
    ) -> Hashable | None:
        if not (at_least(max_seqlen_q, 0) and at_least(max_seqlen_k, 0)):  # per call, not keyed
            return None
        return call_key(
            (q, k_cache, v_cache, page_table, cu_seqlens_q, cache_seqlens, sinks, k_scale, v_scale, out),
            (causal, softmax_scale, window_left, logit_cap, return_lse, override, pow2_bucket(max_seqlen_q)),  # type: ignore[arg-type]
        )

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> ExtendCall:
        heads, page_size, scale = check_extend(*call)
        q, k_cache, v_cache, page_table, cu_seqlens_q, _, max_seqlen_q, _, causal, _, window_left, sinks, logit_cap = (
            call[:13]
        )
        return_lse = call[15]
        total_q = q.shape[0]
        request, signature = _facts(
            compiling,
            "attention.extend",
            q.dtype,
            k_cache.dtype,
            heads,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=logit_cap,
            return_lse=return_lse,
            batch=cu_seqlens_q.shape[0] - 1,
            causal=causal,
            caches=(k_cache, v_cache),
            page_size=page_size,
            max_seqlen_q=max_seqlen_q,
            total_q=total_q,
            # the call key holds q's storage offset and strides, which fix both
            **_q_facts(compiling, q),
        )
        return cls(
            request,
            q.device,
            heads,
            scale,
            kernel_window(window_left, page_table.shape[1] * page_size),
            float(logit_cap),
            k_cache.dtype == torch.float8_e4m3fn,
            page_size,
            k_cache.shape[0],
            total_q,
            (total_q, heads.num_q_heads, heads.head_dim_v),
            (total_q, heads.num_q_heads),
            signature,
        )

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cache_seqlens: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        causal: bool,
        softmax_scale: float | None,
        window_left: int,
        sinks: torch.Tensor | None,
        logit_cap: float,
        k_scale: float | torch.Tensor | None,
        v_scale: float | torch.Tensor | None,
        return_lse: bool,
        out: torch.Tensor | None,
        override: str | None,
    ) -> Any:
        ks, vs = kv_scales(self.fp8, k_scale, v_scale, q)
        if config.debug():
            q_lens = debug_check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, self.total_q, max_seqlen_q, "max_seqlen_q")
            debug_check_pages(page_table, cache_seqlens, q_lens, self.page_size, self.num_pages, max_seqlen_k)
        assert self.request is not None
        spec = dispatch(
            self.request,
            self.device,
            override,
            lambda: self.signature(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k),
        )
        out, lse = _outputs(self, q, out, return_lse)
        if self.total_q:  # no queries (an empty batch): nothing to compute, nothing launched
            spec.fn(
                ExtendArgs(
                    q,
                    k_cache,
                    v_cache,
                    page_table,
                    cu_seqlens_q,
                    cache_seqlens,
                    min(max_seqlen_q, self.total_q),  # a chunk holds at most total_q queries
                    max_seqlen_k,
                    causal,
                    self.scale,
                    self.window,
                    sinks,
                    self.logit_cap,
                    ks,
                    vs,
                    out,
                    lse,
                )
            )
        return (out, lse) if return_lse else out

    def trace(self, *call: Any) -> Any:
        q, k_cache, v_cache, page_table, cu_seqlens_q, cache_seqlens, max_seqlen_q, max_seqlen_k, causal = call[:9]
        _, window_left, sinks, logit_cap, k_scale, v_scale, return_lse, out, override = call[9:]
        ks, vs = kv_scales(self.fp8, k_scale, v_scale, q)
        result, lse = torch.ops.tokenspeed_kernel.mha_extend_with_kvcache(
            q,
            k_cache,
            v_cache,
            page_table,
            cu_seqlens_q,
            cache_seqlens,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            self.scale,
            window_left,
            sinks,
            float(logit_cap),
            ks,
            vs,
            return_lse,
            override,
        )
        return traced_result(result, lse, out, return_lse)


EXTEND = Operator("attention.extend", ExtendArgs, "torch_extend", "mha_extend_with_kvcache", ExtendCall)


def mha_extend_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    override: str | None = None,
) -> Any:
    """Chunked prefill / prefix reuse against a paged KV cache.

    Args:
        q: ``[total_q, Hq, D]`` bf16/fp16/fp32; the chunk of sequence ``b`` is rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and sits at the END of the sequence.
        k_cache: ``[num_pages, page_size, Hkv, D]``, q's dtype or float8_e4m3fn; any
            page/token/head strides (a strided view of an engine's cache is served in place,
            never copied), stride 1 in the head dim.
        v_cache: ``[num_pages, page_size, Hkv, Dv]``, k_cache's dtype, same rules.
        page_table: int32 ``[batch, max_pages_per_seq]``: token ``j`` of sequence ``b`` is at
            ``cache[page_table[b, j // page_size], j % page_size]``.
        cu_seqlens_q: int32 ``[batch + 1]``.
        cache_seqlens: int32 ``[batch]``, tokens in the cache INCLUDING this chunk (store the
            chunk's K/V with ``store_kvcache`` first).
        max_seqlen_q, max_seqlen_k: host bounds of chunk and cache lengths.
        k_scale, v_scale: required for an fp8 cache (float or one-element float32 tensor).
        Other options as in :func:`mha_prefill`.

    Returns:
        ``out [total_q, Hq, Dv]`` in q's dtype, or ``(out, lse)`` with lse float32 ``[total_q, Hq]``.
    """
    return EXTEND.call(
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        cache_seqlens,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        window_left,
        sinks,
        logit_cap,
        k_scale,
        v_scale,
        return_lse,
        out,
        override,
    )


@dataclass(slots=True, eq=False)
class DecodeCall(Plan):
    """What the checks of an ``mha_decode_with_kvcache`` call derived; also what a
    :class:`~tokenspeed_kernel.ops.attention.plan.DecodePlan` runs (:meth:`launch`, with its
    kernel selected once).

    Attributes:
        request, device, heads, scale, window, logit_cap, fp8, page_size, num_pages,
            signature: as in :class:`ExtendCall` (``signature(max_seqlen_k=...)``).
        batch: sequences (0: nothing is launched). q_len: queries per sequence.
        q4: ``[batch, q_len, Hq, D]``, the 4-D view kernels receive of a 3-D q; None when
            q is 4-D already.
        out_shape: q's shape with ``Dv`` last (the public out). out4: ``[batch, q_len, Hq, Dv]``.
        lse_shape: ``[batch * q_len, Hq]`` (the public lse). lse3: ``[batch, q_len, Hq]``.
    """

    request: Request | None
    device: torch.device
    heads: Heads
    scale: float
    window: int
    logit_cap: float
    fp8: bool
    page_size: int
    num_pages: int
    batch: int
    q_len: int
    q4: tuple[int, int, int, int] | None
    out_shape: tuple[int, ...]
    out4: tuple[int, int, int, int]
    lse_shape: tuple[int, int]
    lse3: tuple[int, int, int]
    signature: Callable[..., dict[str, Any]]

    @classmethod
    def make(
        cls,
        q_dtype: torch.dtype,
        device: torch.device,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        heads: Heads,
        page_size: int,
        scale: float,
        *,
        window_left: int,
        sinks: bool,
        logit_cap: float,
        return_lse: bool,
        q_len: int,
        q_dims: int,
        capturable: bool = False,
        compiling: bool = False,
        strided_q: bool = False,
        q_align: int | None = None,
    ) -> DecodeCall:
        """The plan of a decode over these checked caches and tables, of a q of ``q_dims``
        (3 or 4) dimensions (``sinks``: whether a sinks tensor is passed; ``capturable``: as
        the request asks; ``compiling``: while tracing, without request and signature;
        ``strided_q``/``q_align``: a row-strided 3-D q's layout, :func:`_q_facts`)."""
        batch = page_table.shape[0]
        request, signature = _facts(
            compiling,
            "attention.decode",
            q_dtype,
            k_cache.dtype,
            heads,
            window_left=window_left,
            sinks=sinks,
            logit_cap=logit_cap,
            return_lse=return_lse,
            batch=batch,
            caches=(k_cache, v_cache),
            page_size=page_size,
            q_len=q_len,
            capturable=capturable,
            strided_q=strided_q,
            q_align=q_align,
        )
        q4 = (batch, q_len, heads.num_q_heads, heads.head_dim)
        out4 = (batch, q_len, heads.num_q_heads, heads.head_dim_v)
        return cls(
            request,
            device,
            heads,
            scale,
            kernel_window(window_left, page_table.shape[1] * page_size),
            float(logit_cap),
            k_cache.dtype == torch.float8_e4m3fn,
            page_size,
            k_cache.shape[0],
            batch,
            q_len,
            q4 if q_dims == 3 else None,
            out4 if q_dims == 4 else (batch, heads.num_q_heads, heads.head_dim_v),
            out4,
            (batch * q_len, heads.num_q_heads),
            (batch, q_len, heads.num_q_heads),
            signature,
        )

    @staticmethod
    def key(
        q: torch.Tensor,
        k_cache: object,
        v_cache: object,
        page_table: object,
        cache_seqlens: object,
        max_seqlen_k: object,
        softmax_scale: object,
        window_left: object,
        sinks: object,
        logit_cap: object,
        k_scale: object,
        v_scale: object,
        return_lse: object,
        out: object,
        override: object,
    ) -> Hashable | None:
        key = call_key(
            (q, k_cache, v_cache, page_table, cache_seqlens, sinks, k_scale, v_scale, out),
            (softmax_scale, window_left, logit_cap, return_lse, override),
        )
        # max_seqlen_k varies per call: it must be a plain int >= q_len (else the full checks raise).
        if key is None or not at_least(max_seqlen_k, q.shape[1] if q.dim() == 4 else 1):
            return None
        return key

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> DecodeCall:
        heads, page_size, scale, q_len = check_decode_call(*call)
        q, k_cache, v_cache, page_table, _, _, _, window_left, sinks, logit_cap, _, _, return_lse = call[:13]
        return cls.make(
            q.dtype,
            q.device,
            k_cache,
            v_cache,
            page_table,
            heads,
            page_size,
            scale,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=logit_cap,
            return_lse=return_lse,
            q_len=q_len,
            q_dims=q.dim(),
            compiling=compiling,
            **_q_facts(compiling, q),
        )

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        max_seqlen_k: int,
        softmax_scale: float | None,
        window_left: int,
        sinks: torch.Tensor | None,
        logit_cap: float,
        k_scale: float | torch.Tensor | None,
        v_scale: float | torch.Tensor | None,
        return_lse: bool,
        out: torch.Tensor | None,
        override: str | None,
    ) -> Any:
        ks, vs = kv_scales(self.fp8, k_scale, v_scale, q)
        if config.debug():
            self.debug_check(page_table, cache_seqlens, max_seqlen_k)
        assert self.request is not None
        spec = dispatch(self.request, self.device, override, lambda: self.signature(max_seqlen_k=max_seqlen_k))
        return self.launch(
            spec.fn, q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_k, sinks, ks, vs, return_lse, out
        )

    def debug_check(self, page_table: torch.Tensor, cache_seqlens: torch.Tensor, max_seqlen_k: int) -> None:
        """The ``TOKENSPEED_KERNEL_DEBUG`` value checks of the tables (a device sync)."""
        debug_check_pages(
            page_table, cache_seqlens, [self.q_len] * self.batch, self.page_size, self.num_pages, max_seqlen_k
        )

    def launch(
        self,
        run: Callable[[DecodeArgs], None],
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        cache_seqlens: torch.Tensor,
        max_seqlen_k: int,
        sinks: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        return_lse: bool,
        out: torch.Tensor | None,
    ) -> Any:
        """Allocate the outputs, build the kernel's :class:`DecodeArgs` and ``run`` them (the
        selected kernel's ``fn``, or a plan's bound runner); the public result. ``k_scale``
        and ``v_scale`` are the float32 ``[1]`` tensors of an fp8 cache (or None)."""
        out, lse = _outputs(self, q, out, return_lse)
        if self.batch:  # a step without decodes: nothing to compute, nothing launched
            q4 = self.q4
            run(
                DecodeArgs(
                    q if q4 is None else q.view(*q4),
                    k_cache,
                    v_cache,
                    page_table,
                    cache_seqlens,
                    max_seqlen_k,
                    self.scale,
                    self.window,
                    sinks,
                    self.logit_cap,
                    k_scale,
                    v_scale,
                    out if q4 is None else out.view(*self.out4),
                    None if lse is None else lse.view(*self.lse3),
                )
            )
        return (out, lse) if return_lse else out

    def trace(self, *call: Any) -> Any:
        q, k_cache, v_cache, page_table, cache_seqlens, max_seqlen_k, _, window_left, sinks, logit_cap = call[:10]
        k_scale, v_scale, return_lse, out, override = call[10:]
        ks, vs = kv_scales(self.fp8, k_scale, v_scale, q)
        result, lse = torch.ops.tokenspeed_kernel.mha_decode_with_kvcache(
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            max_seqlen_k,
            self.scale,
            window_left,
            sinks,
            float(logit_cap),
            ks,
            vs,
            return_lse,
            override,
        )
        return traced_result(result, lse, out, return_lse)


DECODE = Operator("attention.decode", DecodeArgs, "torch_decode", "mha_decode_with_kvcache", DecodeCall)


def mha_decode_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int,
    *,
    softmax_scale: float | None = None,
    window_left: int = -1,
    sinks: torch.Tensor | None = None,
    logit_cap: float = 0.0,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    override: str | None = None,
) -> Any:
    """Decode against a paged KV cache.

    Args:
        q: ``[batch, Hq, D]`` (one new token per sequence) or ``[batch, q_len, Hq, D]``
            (speculative tokens: the last ``q_len`` positions, causal among themselves);
            bf16/fp16/fp32.
        k_cache, v_cache, page_table, k_scale, v_scale: as in :func:`mha_extend_with_kvcache`.
        cache_seqlens: int32 ``[batch]``, tokens in the cache INCLUDING the new ones.
        max_seqlen_k: host bound of ``cache_seqlens``.
        Other options as in :func:`mha_prefill`.

    Returns:
        ``out`` shaped like q with ``Dv`` last, in q's dtype; or ``(out, lse)`` with lse
        float32 ``[batch * q_len, Hq]``.
    """
    return DECODE.call(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        softmax_scale,
        window_left,
        sinks,
        logit_cap,
        k_scale,
        v_scale,
        return_lse,
        out,
        override,
    )
