"""Gluon paged decode with split-KV and sinks (``attention.decode``), speculative tokens included."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import DecodeArgs
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
    unseen_safe=UNSEEN_SAFE,
)
def amd_gluon_decode(args: DecodeArgs) -> None:
    """Paged decode on MFMA: one program per (sequence, KV head, key split) serving the whole
    GQA group x q_len rows; splits merged (with the sink) by a combine kernel."""
    launch(query_rows(args), regime="decode")
