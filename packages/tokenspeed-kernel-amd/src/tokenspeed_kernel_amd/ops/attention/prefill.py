"""Gluon ragged-batch prefill with sinks and sliding windows (``attention.prefill``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.ops.attention.rows import query_rows
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_amd.ops.attention._common import (
    ARCHS,
    CAPABILITIES,
    FEATURES,
    HEAD_DIMS,
    Q_DTYPES,
    UNSEEN_SAFE,
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
    unseen_safe=UNSEEN_SAFE,
)
def amd_gluon_prefill(args: PrefillArgs) -> None:
    """FlashAttention-style prefill on MFMA: 128 packed (token, GQA head) rows per program,
    only the key tiles inside the causal window visited."""
    launch(query_rows(args), regime="prefill")
