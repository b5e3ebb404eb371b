"""The paged FlashInfer prefill wrapper behind ``flashinfer_extend`` and ``flashinfer_prefill``.

``BatchPrefillWithPagedKVCacheWrapper`` takes ``qo_indptr`` (our ``cu_seqlens_q``) and CSR
page lists; its causal mask is bottom-right aligned (a chunk's queries are the last
positions), as our contract says. Contiguous prefill K/V is served as a cache of page size
1 (``[total_k, 1, Hkv, D]`` views, page ``i`` = row ``i``), so the sink-capable paged
kernels serve ``mha_prefill`` too. LSE is requested in natural log.

A call with ``sinks`` runs on FlashInfer's ``BatchAttentionWithAttentionSinkWrapper``
(:func:`~tokenspeed_kernel_nvidia.ops.attention._flashinfer.make_sink_wrapper`), planned the
same way and run with ``(sinks, sm_scale)`` as its variant's extra arguments; the plain
wrapper's ``run(..., sinks=)`` ignores sinks on FA2/FA3. Calls without sinks keep the plain
wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel_nvidia.ops.attention._flashinfer import (
    SINKS_WITH_LOGIT_CAP,
    PlanCache,
    PlanEntry,
    flashinfer,
    layout_token,
    make_sink_wrapper,
    workspace,
    wrapper_route,
)
from tokenspeed_kernel_nvidia.ops.attention._paged import CsrPages, paged_to_csr

__all__ = ["PagedPrefillCall", "run_paged_prefill"]

BACKEND = "auto"  # FlashInfer picks FA3 on sm_90 where the variant allows it, else FA2
_cache = PlanCache("flashinfer_prefill")


@dataclass(frozen=True, slots=True)
class PagedPrefillCall:
    """One paged-prefill call in FlashInfer's terms.

    Attributes:
        q: ``[total_q, Hq, D]``. k_cache / v_cache: ``[num_pages, P, Hkv, D/Dv]`` (NHD).
        qo_indptr: int32 ``[batch + 1]`` (cu_seqlens_q).
        csr: a function building the CSR page lists (run at plan time only).
        layout: the tensors whose contents decide the plan (see ``layout_token``).
        out: ``[total_q, Hq, Dv]``; lse: float32 ``[total_q, Hq]`` or None.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    csr: object
    layout: tuple
    causal: bool
    softmax_scale: float
    window_left: int
    logit_cap: float
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None


def _key(call: PagedPrefillCall) -> tuple:
    _, num_q_heads, head_dim = call.q.shape
    _, page_size, num_kv_heads, _ = call.k_cache.shape
    return (
        call.q.device,
        call.qo_indptr.shape[0],
        num_q_heads,
        num_kv_heads,
        head_dim,
        call.v_cache.shape[-1],
        page_size,
        call.q.dtype,
        call.k_cache.dtype,
        call.causal,
        call.window_left,
        float(call.logit_cap),
        float(call.softmax_scale),
        wrapper_route(call.sinks, "plain"),
    )


def run_paged_prefill(call: PagedPrefillCall) -> None:
    """Plan (when the layout changed) and run one paged prefill, writing ``call.out``/``lse``."""
    _, num_q_heads, head_dim = call.q.shape
    _, page_size, num_kv_heads, _ = call.k_cache.shape

    sinks = call.sinks is not None
    if sinks and call.logit_cap > 0:  # the predicate rejects it; a direct call must not compute it wrong
        raise ValueError(SINKS_WITH_LOGIT_CAP)

    def make() -> PlanEntry:
        if sinks:
            wrapper = make_sink_wrapper(
                call.q.device,
                q_dtype=call.q.dtype,
                kv_dtype=call.k_cache.dtype,
                head_dim_qk=head_dim,
                head_dim_vo=call.v_cache.shape[-1],
                window_left=call.window_left,
            )
        else:
            wrapper = flashinfer().BatchPrefillWithPagedKVCacheWrapper(workspace(call.q.device), "NHD", backend=BACKEND)
        return PlanEntry(wrapper, None)

    def do_plan(entry: PlanEntry) -> None:
        csr: CsrPages = call.csr()
        entry.buffers = csr  # keep the planned index tensors alive for the runs
        options = {} if sinks else {"logits_soft_cap": call.logit_cap if call.logit_cap > 0 else None}
        entry.wrapper.plan(
            call.qo_indptr,
            *csr.plan_args(num_q_heads, num_kv_heads, head_dim, page_size),
            head_dim_vo=call.v_cache.shape[-1],
            causal=call.causal,
            sm_scale=call.softmax_scale,
            window_left=call.window_left,
            q_data_type=call.q.dtype,
            kv_data_type=call.k_cache.dtype,
            o_data_type=call.out.dtype,
            **options,
        )

    entry = _cache.get(_key(call), make, call.layout, do_plan)
    q = call.q
    if call.k_scale is not None:
        q = (q.float() * call.k_scale).to(q.dtype)
    # The sink variant's extra arguments, positionally: tensor "sink" (float32 [Hq]), then
    # scalar "sm_scale" (FlashInfer's prepare_jit_additional_args consumes them in that order).
    extra = (call.sinks, float(call.softmax_scale)) if sinks else ()
    entry.wrapper.run(
        q,
        (call.k_cache, call.v_cache),
        *extra,
        out=call.out,
        lse=call.lse,
        return_lse=call.lse is not None,
        lse_base="ln",  # natural log; with sinks the variant's LSE includes the sink
    )
    if call.v_scale is not None:
        call.out.mul_(call.v_scale)


def extend_call(args) -> PagedPrefillCall:
    """The paged call of an :class:`~tokenspeed_kernel.ops.attention.args.ExtendArgs`."""
    page_size = args.k_cache.shape[1]
    return PagedPrefillCall(
        q=args.q,
        k_cache=args.k_cache,
        v_cache=args.v_cache,
        qo_indptr=args.cu_seqlens_q,
        csr=lambda: paged_to_csr(args.page_table, args.cache_seqlens, page_size),
        layout=layout_token(args.cu_seqlens_q, args.page_table, args.cache_seqlens),
        causal=args.causal,
        softmax_scale=args.softmax_scale,
        window_left=args.window_left,
        logit_cap=args.logit_cap,
        sinks=args.sinks,
        k_scale=args.k_scale,
        v_scale=args.v_scale,
        out=args.out,
        lse=args.lse,
    )


def prefill_call(args) -> PagedPrefillCall:
    """The page-size-1 paged call of a :class:`~tokenspeed_kernel.ops.attention.args.PrefillArgs`."""
    total_k = args.k.shape[0]
    batch = args.cu_seqlens_k.shape[0] - 1

    def csr() -> CsrPages:
        device = args.k.device
        lengths = args.cu_seqlens_k[1:] - args.cu_seqlens_k[:-1]
        return CsrPages(
            indptr=args.cu_seqlens_k.to(torch.int32),
            indices=torch.arange(max(total_k, 1), dtype=torch.int32, device=device),
            last_page_len=(lengths > 0).to(torch.int32).reshape(batch),
        )

    return PagedPrefillCall(
        q=args.q,
        k_cache=args.k.unsqueeze(1),
        v_cache=args.v.unsqueeze(1),
        qo_indptr=args.cu_seqlens_q,
        csr=csr,
        layout=layout_token(args.cu_seqlens_q, args.cu_seqlens_k),
        causal=args.causal,
        softmax_scale=args.softmax_scale,
        window_left=args.window_left,
        logit_cap=args.logit_cap,
        sinks=args.sinks,
        k_scale=None,
        v_scale=None,
        out=args.out,
        lse=args.lse,
    )
