"""FlashInfer ragged prefill over contiguous q/k/v (``attention.prefill``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_FEATURES,
    FLASHINFER_HEAD_DIMS,
    Q_DTYPES,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import flashinfer_registration
from tokenspeed_kernel_nvidia.ops.attention._flashinfer_prefill import prefill_call, run_paged_prefill


@register_kernel(
    "attention.prefill",
    name="flashinfer_prefill",
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": FLASHINFER_HEAD_DIMS},
    features=(*FLASHINFER_FEATURES, "non_causal"),
    # not graph-safe: plans per cu_seqlens layout on the host; wrapper not in graph mode
    **flashinfer_registration(graph_safe=False),
)
def flashinfer_prefill(args: PrefillArgs) -> None:
    """FlashInfer prefill: contiguous K/V served as a page-size-1 paged cache (so sinks
    work), bottom-right causal, one plan per ``cu_seqlens`` layout."""
    run_paged_prefill(prefill_call(args))
