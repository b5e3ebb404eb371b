"""Triton chunked prefill against the paged cache (``attention.extend``)."""

from __future__ import annotations

import functools

from tokenspeed_kernel.ops.attention.args import ExtendArgs
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
from tokenspeed_kernel_triton.ops.attention._launch import planned, runner_cache

# Functional calls' runners by key (shapes, strides, options, the query rows' bound).
_RUNNERS = runner_cache("triton_extend", "prefill", lambda rows: 1)


@register_kernel(
    "attention.extend",
    name="triton_extend",
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": KV_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "page_size": PAGE_SIZES},
    features=(*COMMON_FEATURES, "non_causal", "fp8_kv", "strided_kv"),
    priority=Priority.PORTABLE,
    predicate=head_dim_v_and_group_fit,
    step_runner=functools.partial(planned, _RUNNERS),
)
def triton_extend(args: ExtendArgs) -> None:
    """Chunked prefill: the prefill tiles, keys gathered through the page table."""
    _RUNNERS(query_rows(args))
