"""An example out-of-tree tokenspeed-kernel plugin.

It registers one kernel for ``attention.decode``: gather each sequence's pages into a
contiguous K/V and call ``torch.nn.functional.scaled_dot_product_attention`` with a
boolean mask. It serves only what that can do (one query per sequence, no sinks, no logit
cap, no LSE, no fp8 cache) and says so in its metadata, so ``explain`` shows why it is
passed over for other requests. Priority ``PLUGIN`` makes it win where it can serve. It
reads the sequence lengths on the host, so it declares ``graph_safe=False``: a request
marked ``capturable`` (CUDA-graph capture) passes it over.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.registry import Priority, register_kernel


def _one_query_per_sequence(request) -> str | None:
    q_len = request.shape("q_len")
    return None if q_len in (None, 1) else f"q_len={q_len}: serves one query per sequence only"


def register() -> None:
    """Entry point of the ``tokenspeed_kernel.backends`` group."""
    register_kernel(
        "attention.decode",
        name="example_sdpa_decode",
        solution="torch",
        vendors=("cuda", "rocm", "cpu"),
        dtypes={
            "q": (torch.bfloat16, torch.float16, torch.float32),
            "kv": (torch.bfloat16, torch.float16, torch.float32),
        },
        features=("sliding_window",),
        priority=Priority.PLUGIN,
        predicate=_one_query_per_sequence,
        graph_safe=False,  # sdpa_decode reads cache_seqlens on the host
    )(sdpa_decode)


def sdpa_decode(args: DecodeArgs) -> None:
    """Paged decode by gather + SDPA (the example plugin's kernel)."""
    num_q_heads = args.q.shape[2]
    _, page_size, num_kv_heads, _ = args.k_cache.shape
    group = num_q_heads // num_kv_heads
    lengths = args.cache_seqlens.tolist()  # a host sync: fine for an example, not for a real kernel
    for b, length in enumerate(lengths):
        pages = args.page_table[b, : (length + page_size - 1) // page_size].long()
        k = args.k_cache[pages].flatten(0, 1)[:length].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = args.v_cache[pages].flatten(0, 1)[:length].repeat_interleave(group, dim=1)
        pos = torch.arange(length, device=k.device)
        mask = torch.ones(length, dtype=torch.bool, device=k.device)
        if args.window_left >= 0:
            mask = (length - 1 - pos) <= args.window_left
        out = F.scaled_dot_product_attention(
            args.q[b, 0].unsqueeze(1),  # [Hq, 1, D]
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask.view(1, 1, length),
            scale=args.softmax_scale,
        )
        args.out[b, 0] = out.squeeze(1)
