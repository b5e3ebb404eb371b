"""Triton ragged-batch prefill (``attention.prefill``): FlashAttention-2 over contiguous K/V."""

from __future__ import annotations

import functools

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.ops.attention.rows import query_rows
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton.ops.attention._common import (
    COMMON_FEATURES,
    HEAD_DIMS,
    Q_DTYPES,
    VENDOR_CAPABILITIES,
    VENDORS,
    head_dim_v_and_group_fit,
)
from tokenspeed_kernel_triton.ops.attention._launch import planned, runner_cache

# Functional calls' runners by key (shapes, strides, options, the query rows' bound).
_RUNNERS = runner_cache("triton_prefill", "prefill", lambda rows: 1)


@register_kernel(
    "attention.prefill",
    name="triton_prefill",
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": HEAD_DIMS},
    # unaligned_qkv: Triton specializes on 16-byte divisibility and compiles a variant without it
    features=(*COMMON_FEATURES, "non_causal", "unaligned_qkv"),
    priority=Priority.PORTABLE,
    predicate=head_dim_v_and_group_fit,
    step_runner=functools.partial(planned, _RUNNERS),
)
def triton_prefill(args: PrefillArgs) -> None:
    """Ragged prefill: one program per (128 query rows of a GQA group, KV head); in-window tiles only."""
    _RUNNERS(query_rows(args))
