"""FlashInfer ragged prefill over contiguous q/k/v (``attention.prefill``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_CAPABILITIES,
    FLASHINFER_FEATURES,
    FLASHINFER_HEAD_DIMS,
    OPT_IN,
    Q_DTYPES,
    VENDORS,
    same_head_dims,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import flashinfer_missing
from tokenspeed_kernel_nvidia.ops.attention._flashinfer_prefill import prefill_call, run_paged_prefill


@register_kernel(
    "attention.prefill",
    name="flashinfer_prefill",
    solution="flashinfer",
    vendors=VENDORS,
    capabilities=FLASHINFER_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": FLASHINFER_HEAD_DIMS},
    features=(*FLASHINFER_FEATURES, "non_causal"),
    priority=OPT_IN,
    predicate=same_head_dims,
    available=flashinfer_missing,
)
def flashinfer_prefill(args: PrefillArgs) -> None:
    """FlashInfer prefill: contiguous K/V served as a page-size-1 paged cache (so sinks
    work), bottom-right causal, one plan per ``cu_seqlens`` layout."""
    run_paged_prefill(prefill_call(args))
