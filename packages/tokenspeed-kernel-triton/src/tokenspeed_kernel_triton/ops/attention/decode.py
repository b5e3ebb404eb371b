"""Triton paged decode with split-KV (``attention.decode``), speculative tokens included."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton.ops.attention._common import (
    COMMON_FEATURES,
    HEAD_DIMS,
    KV_DTYPES,
    PAGE_SIZES,
    Q_DTYPES,
    VENDOR_CAPABILITIES,
    VENDORS,
    head_dim_v_and_group_fit,
)
from tokenspeed_kernel_triton.ops.attention._launch import launch, num_splits


@register_kernel(
    "attention.decode",
    name="triton_decode",
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*COMMON_FEATURES, "fp8_kv", "spec_decode", "strided_kv"),
    priority=Priority.PORTABLE,
    predicate=head_dim_v_and_group_fit,
)
def triton_decode(args: DecodeArgs) -> None:
    """Paged decode: one program per (sequence, KV head, key split) serving the whole GQA
    group; partials merged by a combine kernel when the key range is split."""
    batch, q_len, num_q_heads, head_dim = args.q.shape
    num_kv_heads = args.k_cache.shape[2]
    window = args.window_left
    visible = args.max_seqlen_k if window < 0 else min(args.max_seqlen_k, window + q_len)
    launch(
        q=args.q.view(batch * q_len, num_q_heads, head_dim),
        k=args.k_cache,
        v=args.v_cache,
        out=args.out.view(batch * q_len, num_q_heads, args.out.shape[-1]),
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
        q_len_uniform=q_len,
        causal=True,
        softmax_scale=args.softmax_scale,
        window_left=window,
        logit_cap=args.logit_cap,
        splits=num_splits(batch, num_kv_heads, visible, args.q.device),
        regime="decode",
    )
