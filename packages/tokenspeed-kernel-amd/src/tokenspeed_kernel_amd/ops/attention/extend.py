"""Gluon chunked prefill against a paged KV cache (``attention.extend``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_amd.ops.attention._common import (
    ARCHS,
    CAPABILITIES,
    FEATURES,
    HEAD_DIMS,
    KV_DTYPES,
    PAGE_SIZES,
    Q_DTYPES,
    VENDORS,
    supported,
)
from tokenspeed_kernel_amd.ops.attention._launch import launch


@register_kernel(
    "attention.extend",
    name="amd_gluon_extend",
    solution="gluon",
    vendors=VENDORS,
    archs=ARCHS,
    capabilities=CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*FEATURES, "non_causal", "fp8_kv", "strided_kv"),
    priority=Priority.PERFORMANT,
    predicate=supported,
)
def amd_gluon_extend(args: ExtendArgs) -> None:
    """Chunked prefill on MFMA through the page table: the prefill tiles over a paged cache."""
    launch(
        regime="extend",
        q=args.q,
        k=args.k_cache,
        v=args.v_cache,
        out=args.out,
        lse=args.lse,
        sinks=args.sinks,
        k_scale=args.k_scale,
        v_scale=args.v_scale,
        page_table=args.page_table,
        cu_seqlens_q=args.cu_seqlens_q,
        cu_seqlens_k=None,
        cache_seqlens=args.cache_seqlens,
        batch=args.cu_seqlens_q.numel() - 1,
        max_q=args.max_seqlen_q,
        max_k=args.max_seqlen_k,
        q_len=1,
        causal=args.causal,
        softmax_scale=args.softmax_scale,
        window_left=args.window_left,
        logit_cap=args.logit_cap,
    )
