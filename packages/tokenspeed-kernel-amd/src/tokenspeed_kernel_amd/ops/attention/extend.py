"""Gluon chunked prefill against a paged KV cache (``attention.extend``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel.ops.attention.rows import query_rows
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_amd.ops.attention._common import (
    ARCHS,
    CAPABILITIES,
    FEATURES,
    HEAD_DIMS,
    KV_DTYPES,
    PAGE_SIZES,
    Q_DTYPES,
    UNSEEN_SAFE,
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
    unseen_safe=UNSEEN_SAFE,
)
def amd_gluon_extend(args: ExtendArgs) -> None:
    """Chunked prefill on MFMA through the page table: the prefill tiles over a paged cache."""
    launch(query_rows(args), regime="extend")
