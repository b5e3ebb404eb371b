"""Gluon paged decode with split-KV and sinks (``attention.decode``), speculative tokens included."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import DecodeArgs
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
    "attention.decode",
    name="amd_gluon_decode",
    solution="gluon",
    vendors=VENDORS,
    archs=ARCHS,
    capabilities=CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "head_dim_v": HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*FEATURES, "fp8_kv", "spec_decode", "strided_kv"),
    priority=Priority.PERFORMANT,
    predicate=supported,
)
def amd_gluon_decode(args: DecodeArgs) -> None:
    """Paged decode on MFMA: one program per (sequence, KV head, key split) serving the whole
    GQA group x q_len rows; splits merged (with the sink) by a combine kernel."""
    batch, q_len, num_q_heads, head_dim = args.q.shape
    launch(
        regime="decode",
        q=args.q.view(batch * q_len, num_q_heads, head_dim),
        k=args.k_cache,
        v=args.v_cache,
        out=args.out.view(batch * q_len, num_q_heads, -1),
        lse=None if args.lse is None else args.lse.view(batch * q_len, num_q_heads),
        sinks=args.sinks,
        k_scale=args.k_scale,
        v_scale=args.v_scale,
        page_table=args.page_table,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        cache_seqlens=args.cache_seqlens,
        batch=batch,
        max_q=q_len,
        max_k=args.max_seqlen_k,
        q_len=q_len,
        causal=True,
        softmax_scale=args.softmax_scale,
        window_left=args.window_left,
        logit_cap=args.logit_cap,
    )
