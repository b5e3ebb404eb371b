"""FlashInfer ragged prefill over contiguous q/k/v (``attention.prefill``)."""

from __future__ import annotations

from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_FEATURES,
    FLASHINFER_HEAD_DIMS,
    Q_DTYPES,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import flashinfer_registration
from tokenspeed_kernel_nvidia.ops.attention._flashinfer_prefill import prefill_call, run_paged_prefill

# Request max_seqlen_q_bucket values (the longest query length rounded up to a power of two)
# where this kernel ranks first, for unwindowed calls at head dim 64. H100 length sweep
# (docs/benchmarks.md, "Prefill by length"): 8-16% faster than triton_prefill from 2048 tokens
# up (16384 measured; with or without sinks, causal or not, batched or ragged); at 1024 it
# depends on the batch (B=1 7% faster, B=8 2% slower) and at 512 it is 16% slower.
FIRST_FROM_LENGTH = 2048
FIRST_AT_LENGTHS = tuple(1 << n for n in range(FIRST_FROM_LENGTH.bit_length() - 1, 21))


@register_kernel(
    "attention.prefill",
    name="flashinfer_prefill",
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": FLASHINFER_HEAD_DIMS},
    features=(*FLASHINFER_FEATURES, "non_causal"),
    # not graph-safe: plans per cu_seqlens layout on the host; wrapper not in graph mode
    **flashinfer_registration(graph_safe=False),
    rank_when=(
        {"max_seqlen_q_bucket": FIRST_AT_LENGTHS, "head_dim": (64,), "window_left": (None,)},
        Priority.PERFORMANT,
    ),
)
def flashinfer_prefill(args: PrefillArgs) -> None:
    """FlashInfer prefill: contiguous K/V served as a page-size-1 paged cache (so sinks
    work), bottom-right causal, one plan per ``cu_seqlens`` layout."""
    run_paged_prefill(prefill_call(args))
