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


# Opt-in at every length (no rank_when), from the H100 runs of docs/history.md ("Prefill by
# length"): the kernel alone is 8-17% faster than triton_prefill from ~2048 tokens up, but each
# new batch layout costs a FlashInfer plan: 0.3-3 ms of host work behind a device-to-host sync.
# With a plan per call it is slower everywhere (0.05-0.89x); planned once per step and shared
# by GPT-OSS's 18 full-attention layers it wins only from 8192 tokens (1.04-1.10x) and loses at
# 2048-4096 tokens and on batched or mixed prefills (0.67-0.98x); and its first call at a new
# variant is a ~2-minute JIT build. Reach it with override= or TOKENSPEED_KERNEL_OVERRIDE.
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
