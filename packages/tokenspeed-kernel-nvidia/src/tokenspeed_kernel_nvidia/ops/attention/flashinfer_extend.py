"""FlashInfer chunked prefill against the paged cache (``attention.extend``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_FEATURES,
    FLASHINFER_HEAD_DIMS,
    KV_DTYPES,
    PAGE_SIZES,
    Q_DTYPES,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import flashinfer_registration
from tokenspeed_kernel_nvidia.ops.attention._flashinfer_prefill import extend_call, run_paged_prefill


@register_kernel(
    "attention.extend",
    name="flashinfer_extend",
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": FLASHINFER_HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*FLASHINFER_FEATURES, "non_causal", "fp8_kv"),
    # not graph-safe: plans per cu_seqlens/lengths layout on the host; wrapper not in graph mode
    **flashinfer_registration(graph_safe=False),
)
def flashinfer_extend(args: ExtendArgs) -> None:
    """FlashInfer paged prefill (bottom-right causal) over the NHD cache, one plan per
    batch layout."""
    run_paged_prefill(extend_call(args))
