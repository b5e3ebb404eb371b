"""Triton paged decode with split-KV (``attention.decode``), speculative tokens included."""

from __future__ import annotations

import functools

from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.ops.attention.rows import QueryRows, query_rows
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
from tokenspeed_kernel_triton.ops.attention._launch import num_splits, planned, runner_cache


def _splits(rows: QueryRows) -> int:
    return num_splits(rows.batch, rows.k.shape[2], rows.visible_keys, rows.q.device)


# Functional calls' runners by key (the split count keyed, not the growing max_seqlen_k).
_RUNNERS = runner_cache("triton_decode", "decode", _splits)


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
    step_runner=functools.partial(planned, _RUNNERS),
)
def triton_decode(args: DecodeArgs) -> None:
    """Paged decode: one program per (sequence, KV head, key split) serving the whole GQA
    group; partials merged by a combine kernel when the key range is split. Launched by the
    runner cached for the call's key (``_launch.runner_cache``), every tensor passed per run."""
    _RUNNERS(query_rows(args))
