"""Triton paged decode with split-KV (``attention.decode``), speculative tokens included."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.ops.attention.rows import query_rows
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
    rows = query_rows(args)
    splits = num_splits(rows.batch, args.k_cache.shape[2], rows.visible_keys, args.q.device)
    launch(rows, splits=splits, regime="decode")
