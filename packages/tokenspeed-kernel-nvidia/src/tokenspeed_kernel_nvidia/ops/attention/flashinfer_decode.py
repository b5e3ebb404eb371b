"""FlashInfer paged decode (``attention.decode``), speculative tokens included.

Runs FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on its tensor-core (FA2) path with
the NHD cache layout. The wrapper is built in CUDA-graph mode: its CSR index buffers have
fixed addresses, :func:`plan` rewrites them in place, and ``run`` can be captured. Plan
outside capture, run inside (docs/nvidia.md has the recipe). :func:`plan` is registered as
the kernel's ``prepare_layout`` hook, so engines reach it through the public plan step
(``tokenspeed_kernel.mha_decode_plan`` / ``DecodePlan.update``), never by this module's name.

A call with ``sinks`` runs instead on FlashInfer's ``BatchAttentionWithAttentionSinkWrapper``
(the paged-prefill kernels with the ``AttentionSink`` variant, FA3 on sm_90 for bf16/fp16
caches, else FA2), one query row per token (``qo_indptr = arange(batch + 1) * q_len``, causal,
so speculative tokens are bottom-right aligned), in CUDA-graph mode with the same fixed CSR
buffers, planned by the same hook. The decode wrapper's ``run(..., sinks=)`` forwards sinks
only to the trtllm-gen backend: on FA2 it ignored them.

Scale handling: an fp8 cache's ``k_scale`` is folded into ``q`` on the device (no host
read), ``v_scale`` multiplies the output; the decode wrapper's base-2 LSE is converted to
natural log (the sink wrapper is asked for ``lse_base="ln"``).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_FEATURES,
    FLASHINFER_HEAD_DIMS,
    KV_DTYPES,
    PAGE_SIZES,
    Q_DTYPES,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import (
    LN2,
    SINKS_WITH_LOGIT_CAP,
    PlanCache,
    PlanEntry,
    flashinfer,
    flashinfer_registration,
    layout_token,
    make_sink_wrapper,
    workspace,
    wrapper_route,
)
from tokenspeed_kernel_nvidia.ops.attention._paged import allocate_csr, paged_to_csr

__all__ = ["flashinfer_decode", "plan"]

BACKEND = "fa2"
_cache = PlanCache("flashinfer_decode")


def _key(args: DecodeArgs) -> tuple:
    batch, q_len, num_q_heads, head_dim = args.q.shape
    _, page_size, num_kv_heads, _ = args.k_cache.shape
    return (
        args.q.device,
        batch,
        q_len,
        args.page_table.shape[1],
        num_q_heads,
        num_kv_heads,
        head_dim,
        args.v_cache.shape[-1],
        page_size,
        args.q.dtype,
        args.k_cache.dtype,
        args.window_left,
        float(args.logit_cap),
        float(args.softmax_scale),
        wrapper_route(args.sinks, "decode"),
    )


def _sink_entry(args: DecodeArgs) -> PlanEntry:
    """The sink route: a paged-prefill sink wrapper in CUDA-graph mode, one causal query
    row per decode token."""
    batch, q_len, num_q_heads, head_dim = args.q.shape
    _, page_size, num_kv_heads, _ = args.k_cache.shape
    head_dim_vo = args.v_cache.shape[-1]

    def make() -> PlanEntry:
        csr = allocate_csr(batch, args.page_table.shape[1], args.q.device)
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=args.q.device) * q_len
        wrapper = make_sink_wrapper(
            args.q.device,
            q_dtype=args.q.dtype,
            kv_dtype=args.k_cache.dtype,
            head_dim_qk=head_dim,
            head_dim_vo=head_dim_vo,
            window_left=args.window_left,
            use_cuda_graph=True,
            qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=csr.indptr,
            paged_kv_indices_buf=csr.indices,
            paged_kv_last_page_len_buf=csr.last_page_len,
        )
        return PlanEntry(wrapper, (csr, qo_indptr))

    def do_plan(entry: PlanEntry) -> None:
        csr, qo_indptr = entry.buffers
        paged_to_csr(args.page_table, args.cache_seqlens, page_size, out=csr)
        entry.wrapper.plan(
            qo_indptr,
            *csr.plan_args(num_q_heads, num_kv_heads, head_dim, page_size),
            head_dim_vo=head_dim_vo,
            causal=True,  # q_len > 1: the speculative tokens are the last positions
            sm_scale=args.softmax_scale,
            window_left=args.window_left,
            q_data_type=args.q.dtype,
            kv_data_type=args.k_cache.dtype,
            o_data_type=args.out.dtype,
        )

    return _cache.get(_key(args), make, layout_token(args.page_table, args.cache_seqlens), do_plan)


def _entry(args: DecodeArgs) -> PlanEntry:
    if args.sinks is not None:
        if args.logit_cap > 0:  # the predicate rejects it; a direct call must not compute it wrong
            raise ValueError(SINKS_WITH_LOGIT_CAP)
        return _sink_entry(args)
    batch, q_len, num_q_heads, head_dim = args.q.shape
    _, page_size, num_kv_heads, _ = args.k_cache.shape

    def make() -> PlanEntry:
        csr = allocate_csr(batch, args.page_table.shape[1], args.q.device)
        wrapper = flashinfer().BatchDecodeWithPagedKVCacheWrapper(
            workspace(args.q.device),
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=csr.indptr,
            paged_kv_indices_buffer=csr.indices,
            paged_kv_last_page_len_buffer=csr.last_page_len,
            backend=BACKEND,
        )
        return PlanEntry(wrapper, csr)

    def do_plan(entry: PlanEntry) -> None:
        csr = paged_to_csr(args.page_table, args.cache_seqlens, page_size, out=entry.buffers)
        entry.wrapper.plan(
            *csr.plan_args(num_q_heads, num_kv_heads, head_dim, page_size),
            window_left=args.window_left,
            logits_soft_cap=args.logit_cap if args.logit_cap > 0 else None,
            q_data_type=args.q.dtype,
            kv_data_type=args.k_cache.dtype,
            o_data_type=args.out.dtype,
            sm_scale=args.softmax_scale,
            q_len_per_req=q_len,
        )

    return _cache.get(_key(args), make, layout_token(args.page_table, args.cache_seqlens), do_plan)


def plan(args: DecodeArgs) -> None:
    """The ``prepare_layout`` hook: plan (outside CUDA-graph capture) for ``args``'s batch
    layout without running.

    Reads ``q``/``out`` for shape, dtype and device only (the plan step passes placeholders)
    and ``page_table``/``cache_seqlens`` for the layout. ``DecodePlan.update()`` calls it after
    the engine updated those tensors in place and before it replays a graph that captured
    :func:`flashinfer_decode` on the same tensors; a layout already planned costs nothing."""
    _entry(args)


@register_kernel(
    "attention.decode",
    name="flashinfer_decode",
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": FLASHINFER_HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*FLASHINFER_FEATURES, "fp8_kv", "spec_decode"),
    prepare_layout=plan,
    **flashinfer_registration(graph_safe=True),  # run is capturable once planned outside capture
)
def flashinfer_decode(args: DecodeArgs) -> None:
    """FlashInfer batch decode over the paged NHD cache (FA2 tensor-core path; the
    attention-sink wrapper when ``sinks`` is given), one plan per batch layout, CUDA-graph
    capturable after planning."""
    batch, q_len, num_q_heads, head_dim = args.q.shape
    entry = _entry(args)
    q = args.q.reshape(batch * q_len, num_q_heads, head_dim)
    if args.k_scale is not None:
        q = (q.float() * args.k_scale).to(q.dtype)
    out = args.out.view(batch * q_len, num_q_heads, -1)
    lse = None if args.lse is None else args.lse.view(batch * q_len, num_q_heads)
    if args.sinks is not None:
        # the sink variant's extra arguments, positionally: "sink" then "sm_scale"
        entry.wrapper.run(
            q,
            (args.k_cache, args.v_cache),
            args.sinks,
            float(args.softmax_scale),
            out=out,
            lse=lse,
            return_lse=lse is not None,
            lse_base="ln",
        )
    else:
        entry.wrapper.run(q, (args.k_cache, args.v_cache), out=out, lse=lse, return_lse=lse is not None)
        if lse is not None:
            lse.mul_(LN2)
    if args.v_scale is not None:
        out.mul_(args.v_scale)
