"""Public attention operators: ``mha_prefill``, ``mha_extend_with_kvcache``, ``mha_decode_with_kvcache``.

Each validates its arguments on the host (``TypeError``/``ValueError`` naming the argument),
allocates the outputs, builds a :class:`~tokenspeed_kernel.registry.Request` and the typed
arguments of :mod:`tokenspeed_kernel.ops.attention.args`, and calls the selected kernel.
Under ``torch.compile`` they route through the ``torch.ops.tokenspeed_kernel.*`` custom ops.
Semantics shared by all three are spelled out in :mod:`tokenspeed_kernel.ops.attention.args`
and docs/api.md.

Capture signatures (``TOKENSPEED_KERNEL_CAPTURE``) use the field names of
``tokenspeed_kernel.tools.cases.attention.AttentionCase`` plus ``batch``, ``total_q``,
``total_k`` (prefill), ``max_seqlen_q`` and ``max_seqlen_k``.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import (
    ACT_DTYPES,
    at_least,
    call_key,
    call_table,
    check_same_device,
    check_tensor,
    dtype_name,
    pow2_bucket,
    remember,
)
from tokenspeed_kernel.ops._dispatch import dispatch
from tokenspeed_kernel.ops.attention import _custom_ops  # noqa: F401  (defines torch.ops.tokenspeed_kernel.mha_*)
from tokenspeed_kernel.ops.attention._validate import (
    cache_layout,
    check_cu_seqlens,
    check_decode,
    check_heads,
    check_options,
    check_out,
    check_paged_cache,
    check_ragged,
    debug_check_cu_seqlens,
    debug_check_pages,
    kv_scales,
)
from tokenspeed_kernel.ops.attention.args import DecodeArgs, ExtendArgs, Heads, PrefillArgs
from tokenspeed_kernel.registry import Request

__all__ = ["attention_request", "mha_decode_with_kvcache", "mha_extend_with_kvcache", "mha_prefill"]


def attention_request(
    op: str,
    *,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: Heads,
    causal: bool = True,
    window_left: int = -1,
    sinks: bool = False,
    logit_cap: float = 0.0,
    return_lse: bool = False,
    page_size: int | None = None,
    q_len: int | None = None,
    capturable: bool = False,
    batch: int | None = None,
    max_seqlen_q: int | None = None,
    strided_kv: bool = False,
    kv_align: int | None = None,
) -> Request:
    """The selector request of an attention call, built from plain shapes (public: ask
    ``select``/``explain`` which kernel would serve a model's calls before making them).

    Args:
        op: ``"attention.prefill"``, ``"attention.extend"`` or ``"attention.decode"``.
        q_dtype: the activation dtype. kv_dtype: k/v (prefill) or cache dtype.
        heads: head counts and dims (:class:`~tokenspeed_kernel.ops.attention.args.Heads`).
        causal, window_left, sinks (whether a sinks tensor is passed), logit_cap,
            return_lse: as in the public call (decode is always causal).
        page_size: the cache's page size (extend, decode). q_len: queries per sequence
            (decode; 1 unless speculative).
        capturable: only kernels that can be captured in a CUDA graph may serve it.
        batch: sequences in the batch (decode): adds ``batch_bucket``, the next power of
            two >= ``batch``, which kernels may be ranked by (``rank_when``).
        max_seqlen_q: the longest query length (prefill): adds ``max_seqlen_q_bucket``, the
            next power of two >= ``max_seqlen_q``, which kernels may be ranked by.
        strided_kv: the paged caches are strided views, not contiguous (extend, decode).
        kv_align: the strided caches' byte alignment, a power of two <= 16 (see
            ``tokenspeed_kernel.ops._checks.kv_align``); the public call gives it with
            ``strided_kv`` only.

    Features: ``non_causal``, ``sliding_window``, ``sinks``, ``logit_cap``, ``return_lse``,
    ``fp8_kv`` (an fp8 cache), ``spec_decode`` (``q_len > 1``), ``strided_kv``. Shapes: head
    dims, head counts, ``window_left`` when windowed, and ``page_size`` / ``kv_align`` /
    ``q_len`` where the operator has them, ``batch_bucket`` / ``max_seqlen_q_bucket`` when ``batch`` / ``max_seqlen_q`` is
    given. It is exactly the request the public call builds for the same arguments.
    """
    flags = (
        ("non_causal", not causal),
        ("sliding_window", window_left >= 0),
        ("sinks", sinks),
        ("logit_cap", logit_cap > 0),
        ("return_lse", return_lse),
        ("fp8_kv", kv_dtype == torch.float8_e4m3fn),
        ("spec_decode", q_len is not None and q_len > 1),
        ("strided_kv", strided_kv),
    )
    shapes = [
        ("head_dim", heads.head_dim),
        ("head_dim_v", heads.head_dim_v),
        ("num_kv_heads", heads.num_kv_heads),
        ("num_q_heads", heads.num_q_heads),
    ]
    optional = (("page_size", page_size), ("kv_align", kv_align), ("q_len", q_len))
    shapes += [(key, value) for key, value in optional if value is not None]
    if window_left >= 0:
        shapes.append(("window_left", window_left))
    if batch is not None:
        shapes.append(("batch_bucket", pow2_bucket(batch)))
    if max_seqlen_q is not None:
        shapes.append(("max_seqlen_q_bucket", pow2_bucket(max_seqlen_q)))
    return Request(
        op,
        (("kv", kv_dtype), ("q", q_dtype)),
        tuple(sorted(shapes)),
        frozenset(name for name, on in flags if on),
        capturable,
    )


def _signature(q: torch.Tensor, kv_dtype: torch.dtype, heads: Heads, **options) -> dict:
    return {
        "num_q_heads": heads.num_q_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
        "head_dim_v": heads.head_dim_v,
        "dtype": dtype_name(q.dtype),
        "kv_dtype": dtype_name(kv_dtype),
        **options,
    }


def _result(out: torch.Tensor, lse: torch.Tensor | None, return_lse: bool):
    return (out, lse) if return_lse else out


def _kernel_window(window_left: int, max_keys: int) -> int:
    """The window a kernel receives: ``window_left`` capped at ``max_keys``, the most keys a
    sequence can hold (prefill: ``total_k``; paged: page-table columns x page size). A query
    never sits ``max_keys`` or more positions after a key it could see, so the cap changes no
    result; it keeps ``position - window_left`` inside int32 in the kernels."""
    return min(window_left, max_keys)


@dataclass(frozen=True, slots=True)
class _Checked:
    """What the full checks of one call derived, remembered per call key (see
    :mod:`tokenspeed_kernel.ops._checks`): head geometry, the resolved softmax scale, the
    selector request (None while tracing: the custom op selects when it runs), the page
    size and whether the cache is fp8 (paged ops), queries per sequence (decode)."""

    heads: Heads
    scale: float
    request: Request | None
    page_size: int = 0
    fp8: bool = False
    q_len: int = 1


# Per-op tables: call key -> _Checked (bounded; see ops/_checks.remember).
_PREFILL_CALLS: dict[Hashable, _Checked] = call_table()
_EXTEND_CALLS: dict[Hashable, _Checked] = call_table()
_DECODE_CALLS: dict[Hashable, _Checked] = call_table()


def _checked(
    op: str,
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    heads: Heads,
    scale: float,
    out: object,
    out_shape: tuple[int, ...],
    *,
    compiling: bool,
    causal: bool = True,
    window_left: int,
    sinks: torch.Tensor | None,
    logit_cap: float,
    return_lse: bool,
    page_size: int = 0,
    q_len: int | None = None,
    batch: int | None = None,
    max_seqlen_q: int | None = None,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> _Checked:
    """The check every attention operator's full checks end with (``out`` against
    ``out_shape``), then the facts its call key remembers: the derived ``heads``/``scale``,
    the selector request of ``op`` (None while tracing: the custom op selects when it runs;
    ``caches``: the paged K/V whose layout it carries), the page size (0 for prefill),
    whether the cache is fp8, ``q_len`` (decode)."""
    check_out(out, out_shape, q)
    request = None
    if not compiling:
        strided, align = (False, None) if caches is None else cache_layout(*caches)
        request = attention_request(
            op,
            q_dtype=q.dtype,
            kv_dtype=kv_dtype,
            heads=heads,
            causal=causal,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=logit_cap,
            return_lse=return_lse,
            page_size=page_size or None,
            q_len=q_len,
            batch=batch,
            max_seqlen_q=max_seqlen_q,
            strided_kv=strided,
            kv_align=align,
        )
    return _Checked(heads, scale, request, page_size, kv_dtype == torch.float8_e4m3fn, q_len or 1)


def _check_ragged_rest(
    op: str,
    q: torch.Tensor,
    kv_dtype: torch.dtype,
    heads: Heads,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool,
    softmax_scale: float | None,
    window_left: int,
    sinks: torch.Tensor | None,
    logit_cap: float,
    return_lse: bool,
    out: torch.Tensor | None,
    override: str | None,
    compiling: bool,
    page_size: int = 0,
    caches: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> _Checked:
    """The checks :func:`mha_prefill` and :func:`mha_extend_with_kvcache` end with, after
    their tensors: host bounds and ``causal``, the options, ``out`` ``[total_q, Hq, Dv]``;
    then :func:`_checked`'s facts (prefill's request carries ``max_seqlen_q_bucket``)."""
    check_ragged(max_seqlen_q, max_seqlen_k, causal)
    scale = check_options(
        q,
        heads,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    return _checked(
        op,
        q,
        kv_dtype,
        heads,
        scale,
        out,
        (q.shape[0], heads.num_q_heads, heads.head_dim_v),
        compiling=compiling,
        causal=causal,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        return_lse=return_lse,
        page_size=page_size,
        max_seqlen_q=max_seqlen_q if op == "attention.prefill" else None,
        caches=caches,
    )


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
):
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
    compiling = torch.compiler.is_compiling()
    lengths_ok = at_least(max_seqlen_q, 0) and at_least(max_seqlen_k, 0)
    # The request's max_seqlen_q_bucket is part of the key (the length itself varies per call).
    key = call_key(
        compiling,
        (q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out),
        (
            causal,
            softmax_scale,
            window_left,
            logit_cap,
            return_lse,
            override,
            pow2_bucket(max_seqlen_q) if lengths_ok else -1,
        ),
    )
    checked = _PREFILL_CALLS.get(key)
    if checked is None or not lengths_ok:
        checked = _check_prefill(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            softmax_scale=softmax_scale,
            window_left=window_left,
            sinks=sinks,
            logit_cap=logit_cap,
            return_lse=return_lse,
            out=out,
            override=override,
            compiling=compiling,
        )
        remember(_PREFILL_CALLS, key, checked)
    heads, scale = checked.heads, checked.scale
    total_q = q.shape[0]

    if compiling:
        result, lse = torch.ops.tokenspeed_kernel.mha_prefill(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            causal,
            scale,
            window_left,
            sinks,
            float(logit_cap),
            return_lse,
            override,
        )
        if out is not None:
            result = out.copy_(result)
        return _result(result, lse, return_lse)

    if config.debug():
        q_lens = debug_check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q")
        k_lens = debug_check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
        if causal and any(lq > lk for lq, lk in zip(q_lens, k_lens)):
            raise ValueError(
                "causal prefill needs every query length <= its key length (TOKENSPEED_KERNEL_DEBUG check)"
            )
    assert checked.request is not None
    spec = dispatch(
        checked.request,
        q.device,
        override,
        lambda: _signature(
            q,
            k.dtype,
            heads,
            batch=cu_seqlens_q.shape[0] - 1,
            total_q=total_q,
            total_k=k.shape[0],
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            causal=causal,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=float(logit_cap),
            return_lse=return_lse,
        ),
    )
    if out is None:
        out = q.new_empty((total_q, heads.num_q_heads, heads.head_dim_v))
    lse = torch.empty((total_q, heads.num_q_heads), dtype=torch.float32, device=q.device) if return_lse else None
    if not total_q:  # no queries (an empty batch): nothing to compute, nothing launched
        return _result(out, lse, return_lse)
    # Kernels get bounds no looser than the tensors: a sequence holds at most total_q
    # queries and total_k keys (grids sized by max_seqlen_q stay real; see docs/api.md).
    spec.fn(
        PrefillArgs(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            min(max_seqlen_q, total_q),
            min(max_seqlen_k, k.shape[0]),
            causal,
            scale,
            _kernel_window(window_left, k.shape[0]),
            sinks,
            float(logit_cap),
            out,
            lse,
        )
    )
    return _result(out, lse, return_lse)


def _check_prefill(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    causal,
    softmax_scale,
    window_left,
    sinks,
    logit_cap,
    return_lse,
    out,
    override,
    compiling: bool,
) -> _Checked:
    """Every host check of :func:`mha_prefill`, in order; the facts they derive."""
    check_tensor("q", q, ndim=3, dtypes=ACT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,))
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} rows but k has {k.shape[0]}")
    check_same_device("q", q, k=k, v=v)
    heads = check_heads("q", q, "k", k, "v", v)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0] - 1, q)
    return _check_ragged_rest(
        "attention.prefill",
        q,
        k.dtype,
        heads,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        return_lse=return_lse,
        out=out,
        override=override,
        compiling=compiling,
    )


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
):
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
    compiling = torch.compiler.is_compiling()
    key = call_key(
        compiling,
        (q, k_cache, v_cache, page_table, cu_seqlens_q, cache_seqlens, sinks, k_scale, v_scale, out),
        (causal, softmax_scale, window_left, logit_cap, return_lse, override),
    )
    checked = _EXTEND_CALLS.get(key)
    if checked is None or not (at_least(max_seqlen_q, 0) and at_least(max_seqlen_k, 0)):
        checked = _check_extend(
            q,
            k_cache,
            v_cache,
            page_table,
            cu_seqlens_q,
            cache_seqlens,
            max_seqlen_q,
            max_seqlen_k,
            causal=causal,
            softmax_scale=softmax_scale,
            window_left=window_left,
            sinks=sinks,
            logit_cap=logit_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            return_lse=return_lse,
            out=out,
            override=override,
            compiling=compiling,
        )
        remember(_EXTEND_CALLS, key, checked)
    heads, scale, page_size = checked.heads, checked.scale, checked.page_size
    ks, vs = kv_scales(checked.fp8, k_scale, v_scale, q)
    batch = cu_seqlens_q.shape[0] - 1
    total_q = q.shape[0]

    if compiling:
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
            scale,
            window_left,
            sinks,
            float(logit_cap),
            ks,
            vs,
            return_lse,
            override,
        )
        if out is not None:
            result = out.copy_(result)
        return _result(result, lse, return_lse)

    if config.debug():
        q_lens = debug_check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q")
        debug_check_pages(page_table, cache_seqlens, q_lens, page_size, k_cache.shape[0], max_seqlen_k)
    assert checked.request is not None
    spec = dispatch(
        checked.request,
        q.device,
        override,
        lambda: _signature(
            q,
            k_cache.dtype,
            heads,
            batch=batch,
            total_q=total_q,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            page_size=page_size,
            causal=causal,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=float(logit_cap),
            return_lse=return_lse,
        ),
    )
    if out is None:
        out = q.new_empty((total_q, heads.num_q_heads, heads.head_dim_v))
    lse = torch.empty((total_q, heads.num_q_heads), dtype=torch.float32, device=q.device) if return_lse else None
    if not total_q:  # no queries (an empty batch): nothing to compute, nothing launched
        return _result(out, lse, return_lse)
    spec.fn(
        ExtendArgs(
            q,
            k_cache,
            v_cache,
            page_table,
            cu_seqlens_q,
            cache_seqlens,
            min(max_seqlen_q, total_q),  # a chunk holds at most total_q queries
            max_seqlen_k,
            causal,
            scale,
            _kernel_window(window_left, page_table.shape[1] * page_size),
            sinks,
            float(logit_cap),
            ks,
            vs,
            out,
            lse,
        )
    )
    return _result(out, lse, return_lse)


def _check_extend(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    cache_seqlens,
    max_seqlen_q,
    max_seqlen_k,
    *,
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
    compiling: bool,
) -> _Checked:
    """Every host check of :func:`mha_extend_with_kvcache`, in order; the facts they derive."""
    check_tensor("q", q, ndim=3, dtypes=ACT_DTYPES)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    batch = cu_seqlens_q.shape[0] - 1
    heads, page_size, _, _ = check_paged_cache(q, k_cache, v_cache, page_table, cache_seqlens, k_scale, v_scale, batch)
    return _check_ragged_rest(
        "attention.extend",
        q,
        k_cache.dtype,
        heads,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        return_lse=return_lse,
        out=out,
        override=override,
        compiling=compiling,
        page_size=page_size,
        caches=(k_cache, v_cache),
    )


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
):
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
    compiling = torch.compiler.is_compiling()
    key = call_key(
        compiling,
        (q, k_cache, v_cache, page_table, cache_seqlens, sinks, k_scale, v_scale, out),
        (softmax_scale, window_left, logit_cap, return_lse, override),
    )
    checked = _DECODE_CALLS.get(key)
    if checked is None or not at_least(max_seqlen_k, checked.q_len):
        checked = _check_decode_call(
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            max_seqlen_k,
            softmax_scale=softmax_scale,
            window_left=window_left,
            sinks=sinks,
            logit_cap=logit_cap,
            k_scale=k_scale,
            v_scale=v_scale,
            return_lse=return_lse,
            out=out,
            override=override,
            compiling=compiling,
        )
        remember(_DECODE_CALLS, key, checked)
    heads, scale, page_size, q_len = checked.heads, checked.scale, checked.page_size, checked.q_len
    ks, vs = kv_scales(checked.fp8, k_scale, v_scale, q)
    batch = q.shape[0]
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    out_shape = (*q.shape[:-1], heads.head_dim_v)

    if compiling:
        result, lse = torch.ops.tokenspeed_kernel.mha_decode_with_kvcache(
            q,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            max_seqlen_k,
            scale,
            window_left,
            sinks,
            float(logit_cap),
            ks,
            vs,
            return_lse,
            override,
        )
        if out is not None:
            result = out.copy_(result)
        return _result(result, lse, return_lse)

    if config.debug():
        debug_check_pages(page_table, cache_seqlens, [q_len] * batch, page_size, k_cache.shape[0], max_seqlen_k)
    assert checked.request is not None
    spec = dispatch(
        checked.request,
        q.device,
        override,
        lambda: _signature(
            q,
            k_cache.dtype,
            heads,
            batch=batch,
            q_len=q_len,
            max_seqlen_k=max_seqlen_k,
            page_size=page_size,
            window_left=window_left,
            sinks=sinks is not None,
            logit_cap=float(logit_cap),
            return_lse=return_lse,
        ),
    )
    if out is None:
        out = q.new_empty(out_shape)
    lse = torch.empty((batch * q_len, heads.num_q_heads), dtype=torch.float32, device=q.device) if return_lse else None
    if not batch:  # a step without decodes: nothing to compute, nothing launched
        return _result(out, lse, return_lse)
    spec.fn(
        DecodeArgs(
            q4,
            k_cache,
            v_cache,
            page_table,
            cache_seqlens,
            max_seqlen_k,
            scale,
            _kernel_window(window_left, page_table.shape[1] * page_size),
            sinks,
            float(logit_cap),
            ks,
            vs,
            out.view(batch, q_len, heads.num_q_heads, heads.head_dim_v),
            None if lse is None else lse.view(batch, q_len, heads.num_q_heads),
        )
    )
    return _result(out, lse, return_lse)


def _check_decode_call(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    max_seqlen_k,
    *,
    softmax_scale,
    window_left,
    sinks,
    logit_cap,
    k_scale,
    v_scale,
    return_lse,
    out,
    override,
    compiling: bool,
) -> _Checked:
    """Every host check of :func:`mha_decode_with_kvcache`, in order; the facts they derive."""
    check_tensor("q", q, ndim=(3, 4), dtypes=ACT_DTYPES)
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    q_len = q4.shape[1]
    if q_len < 1:
        raise ValueError(f"q must hold at least one query per sequence, got shape {list(q.shape)}")
    heads, page_size, _, _, scale = check_decode(
        q4,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        q_len=q_len,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    return _checked(
        "attention.decode",
        q,
        k_cache.dtype,
        heads,
        scale,
        out,
        (*q.shape[:-1], heads.head_dim_v),
        compiling=compiling,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        return_lse=return_lse,
        page_size=page_size,
        q_len=q_len,
        batch=q4.shape[0],
        caches=(k_cache, v_cache),
    )
