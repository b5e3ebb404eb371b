"""Gluon ragged-batch prefill with sinks and sliding windows (``attention.prefill``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_amd.ops.attention._common import (
    ARCHS,
    CAPABILITIES,
    FEATURES,
    HEAD_DIMS,
    Q_DTYPES,
    VENDORS,
    supported,
)
from tokenspeed_kernel_amd.ops.attention._launch import launch


@register_kernel(
    "attention.prefill",
    name="amd_gluon_prefill",
    solution="gluon",
    vendors=VENDORS,
    archs=ARCHS,
    capabilities=CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS},
    features=(*FEATURES, "non_causal"),
    priority=Priority.PERFORMANT,
    predicate=supported,
)
def amd_gluon_prefill(args: PrefillArgs) -> None:
    """FlashAttention-style prefill on MFMA: 128 packed (token, GQA head) rows per program,
    only the key tiles inside the causal window visited."""
    launch(
        regime="prefill",
        q=args.q,
        k=args.k,
        v=args.v,
        out=args.out,
        lse=args.lse,
        sinks=args.sinks,
        k_scale=None,
        v_scale=None,
        page_table=None,
        cu_seqlens_q=args.cu_seqlens_q,
        cu_seqlens_k=args.cu_seqlens_k,
        cache_seqlens=None,
        batch=args.cu_seqlens_q.numel() - 1,
        max_q=args.max_seqlen_q,
        max_k=args.max_seqlen_k,
        q_len=1,
        causal=args.causal,
        softmax_scale=args.softmax_scale,
        window_left=args.window_left,
        logit_cap=args.logit_cap,
    )
