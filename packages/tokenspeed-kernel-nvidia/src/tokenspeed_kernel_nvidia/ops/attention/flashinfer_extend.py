"""FlashInfer chunked prefill against the paged cache (``attention.extend``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel.registry import register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_CAPABILITIES,
    FLASHINFER_FEATURES,
    FLASHINFER_HEAD_DIMS,
    KV_DTYPES,
    OPT_IN,
    PAGE_SIZES,
    Q_DTYPES,
    VENDORS,
    same_head_dims,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import flashinfer_missing
from tokenspeed_kernel_nvidia.ops.attention._flashinfer_prefill import extend_call, run_paged_prefill


@register_kernel(
    "attention.extend",
    name="flashinfer_extend",
    solution="flashinfer",
    vendors=VENDORS,
    capabilities=FLASHINFER_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": FLASHINFER_HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*FLASHINFER_FEATURES, "non_causal", "fp8_kv"),
    priority=OPT_IN,
    predicate=same_head_dims,
    available=flashinfer_missing,
)
def flashinfer_extend(args: ExtendArgs) -> None:
    """FlashInfer paged prefill (bottom-right causal) over the NHD cache, one plan per
    batch layout."""
    run_paged_prefill(extend_call(args))
