"""Reference attention kernels in plain PyTorch: ground truth, and the default on any device.

One routine, :func:`_attend`, computes attention for one sequence given the absolute
positions of its queries; the three kernels only gather that sequence's q/k/v (from the
ragged batch or from the pages) and write the result. Arithmetic is float32 for
16-bit and 32-bit inputs and float64 for float64 inputs (the check tool's ground truth).
These kernels read sequence lengths on the host, so they synchronize; they are for
correctness, not speed, and are registered ``graph_safe=False`` (not CUDA-graph capturable).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tokenspeed_kernel.ops.attention.args import DecodeArgs, ExtendArgs, PrefillArgs
from tokenspeed_kernel.registry import Priority, register_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_KV_DTYPES = (*_DTYPES, torch.float8_e4m3fn)
_COMMON = ("sinks", "sliding_window", "logit_cap", "return_lse", "strided_q")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# The queries of one sequence are attended in blocks whose logits, ``[Hq, block, Lk]``, hold
# at most this many elements (1 GiB in float64), so the float64 ground truth of a long prefill
# fits a GPU: one 8192-token sequence with 64 heads would otherwise build 32 GiB logits several
# times over. Every query row is independent, so blocking changes no result.
_MAX_LOGITS = 2**27


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence (shapes as in :func:`_attend_block`), queries in blocks of
    at most :data:`_MAX_LOGITS` logits."""
    num_q, num_q_heads = q.shape[0], q.shape[1]
    block = max(1, _MAX_LOGITS // max(1, num_q_heads * k.shape[0]))
    if num_q <= block:
        return _attend_block(q, k, v, q_pos, **options)
    parts = [_attend_block(q[i : i + block], k, v, q_pos[i : i + block], **options) for i in range(0, num_q, block)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def _attend_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window_left: int,
    sinks: torch.Tensor | None,
    logit_cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one sequence.

    ``q [Lq, Hq, D]``, ``k [Lk, Hkv, D]``, ``v [Lk, Hkv, Dv]`` in the compute dtype;
    ``q_pos`` int64 ``[Lq]`` absolute positions of the queries (keys sit at ``0..Lk-1``).
    Returns ``out [Lq, Hq, Dv]`` and ``lse [Lq, Hq]`` in the compute dtype.
    """
    num_q, num_q_heads, head_dim = q.shape
    num_k, num_kv_heads, head_dim_v = v.shape
    group = num_q_heads // num_kv_heads
    qg = q.view(num_q, num_kv_heads, group, head_dim)
    logits = torch.einsum("qhgd,khd->hgqk", qg, k) * scale  # [Hkv, G, Lq, Lk]
    if logit_cap > 0:
        logits = logit_cap * torch.tanh(logits / logit_cap)
    k_pos = torch.arange(num_k, device=q.device)
    visible = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device)
    if causal:
        visible &= k_pos[None, :] <= q_pos[:, None]
    if window_left >= 0:
        visible &= (q_pos[:, None] - k_pos[None, :]) <= window_left
    logits = logits.masked_fill(~visible, float("-inf"))
    # [Hkv, G, Lq]; a sequence without keys has an all -inf row maximum (amax rejects empty dims)
    row_max = logits.amax(dim=-1) if num_k else logits.new_full(logits.shape[:-1], float("-inf"))
    if sinks is not None:
        sink = sinks.to(logits.dtype).view(num_kv_heads, group, 1).expand_as(row_max)
        row_max = torch.maximum(row_max, sink)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    probs = torch.exp(logits - safe_max.unsqueeze(-1))
    denom = probs.sum(dim=-1)
    if sinks is not None:
        denom = denom + torch.exp(sink - safe_max)
    safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))  # a row that sees nothing: out 0
    # Masking is by selection, never by a zero weight: 0 * NaN is NaN, and a NaN or inf
    # value of a key no query sees (outside its window, causally later) must not reach
    # it. Non-finite values are zeroed for the product; a query that does see one gets NaN
    # in that column (the rule of docs/api.md), whatever its probability.
    bad_v = ~torch.isfinite(v)  # [Lk, Hkv, Dv]
    seen_bad = None
    if bool(bad_v.any()):  # the reference synchronizes anyway
        seen_bad = torch.einsum("qk,khd->qhd", visible.to(v.dtype), bad_v.to(v.dtype)) > 0  # [Lq, Hkv, Dv]
        v = v.masked_fill(bad_v, 0.0)
    out = torch.einsum("hgqk,khd->qhgd", probs, v) / safe_denom.permute(2, 0, 1).unsqueeze(-1)
    if seen_bad is not None:
        out = out.masked_fill(seen_bad.unsqueeze(2), float("nan"))
    lse = torch.where(denom > 0, torch.log(denom) + safe_max, torch.full_like(denom, float("-inf")))
    return out.reshape(num_q, num_q_heads, head_dim_v), lse.permute(2, 0, 1).reshape(num_q, num_q_heads)


def _gather_pages(
    cache: torch.Tensor, pages: torch.Tensor, length: int, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``0..length-1`` of one sequence from a paged cache, dequantized to ``dtype``."""
    page_size = cache.shape[1]
    used = pages[: math.ceil(length / page_size)].long()
    rows = cache[used].flatten(0, 1)[:length].to(dtype)
    return rows * scale.to(dtype) if scale is not None else rows


def _write(
    out: torch.Tensor, lse: torch.Tensor | None, rows: slice | int, o: torch.Tensor, o_lse: torch.Tensor
) -> None:
    out[rows] = o.to(out.dtype)
    if lse is not None:
        lse[rows] = o_lse.to(lse.dtype)


@register_kernel(
    "attention.prefill",
    name="torch_prefill",
    solution="torch",
    dtypes={"q": _DTYPES, "kv": _DTYPES},
    features=(*_COMMON, "non_causal", "unaligned_qkv"),
    priority=Priority.REFERENCE,
    graph_safe=False,  # reads the lengths on the host (.tolist())
)
def torch_prefill(args: PrefillArgs) -> None:
    """Ragged-batch attention, one sequence at a time, in plain PyTorch."""
    dtype = _compute_dtype(args.q.dtype)
    cu_q = args.cu_seqlens_q.tolist()
    cu_k = args.cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q = args.q[cu_q[b] : cu_q[b + 1]].to(dtype)
        k = args.k[cu_k[b] : cu_k[b + 1]].to(dtype)
        v = args.v[cu_k[b] : cu_k[b + 1]].to(dtype)
        num_q, num_k = q.shape[0], k.shape[0]
        q_pos = torch.arange(num_k - num_q, num_k, device=q.device)
        o, lse_b = _attend(
            q,
            k,
            v,
            q_pos,
            causal=args.causal,
            scale=args.softmax_scale,
            window_left=args.window_left,
            sinks=args.sinks,
            logit_cap=args.logit_cap,
        )
        _write(args.out, args.lse, slice(cu_q[b], cu_q[b + 1]), o, lse_b)


@register_kernel(
    "attention.extend",
    name="torch_extend",
    solution="torch",
    dtypes={"q": _DTYPES, "kv": _KV_DTYPES},
    features=(*_COMMON, "non_causal", "fp8_kv", "strided_kv"),
    priority=Priority.REFERENCE,
    graph_safe=False,  # reads the lengths on the host (.tolist())
)
def torch_extend(args: ExtendArgs) -> None:
    """Chunked prefill against the paged cache, one sequence at a time, in plain PyTorch."""
    dtype = _compute_dtype(args.q.dtype)
    cu_q = args.cu_seqlens_q.tolist()
    lengths = args.cache_seqlens.tolist()
    for b, length in enumerate(lengths):
        q = args.q[cu_q[b] : cu_q[b + 1]].to(dtype)
        k = _gather_pages(args.k_cache, args.page_table[b], length, args.k_scale, dtype)
        v = _gather_pages(args.v_cache, args.page_table[b], length, args.v_scale, dtype)
        q_pos = torch.arange(length - q.shape[0], length, device=q.device)
        o, lse_b = _attend(
            q,
            k,
            v,
            q_pos,
            causal=args.causal,
            scale=args.softmax_scale,
            window_left=args.window_left,
            sinks=args.sinks,
            logit_cap=args.logit_cap,
        )
        _write(args.out, args.lse, slice(cu_q[b], cu_q[b + 1]), o, lse_b)


@register_kernel(
    "attention.decode",
    name="torch_decode",
    solution="torch",
    dtypes={"q": _DTYPES, "kv": _KV_DTYPES},
    features=(*_COMMON, "fp8_kv", "spec_decode", "strided_kv"),
    priority=Priority.REFERENCE,
    graph_safe=False,  # reads the lengths on the host (.tolist())
)
def torch_decode(args: DecodeArgs) -> None:
    """Paged decode (speculative tokens included), one sequence at a time, in plain PyTorch."""
    dtype = _compute_dtype(args.q.dtype)
    q_len = args.q.shape[1]
    for b, length in enumerate(args.cache_seqlens.tolist()):
        k = _gather_pages(args.k_cache, args.page_table[b], length, args.k_scale, dtype)
        v = _gather_pages(args.v_cache, args.page_table[b], length, args.v_scale, dtype)
        q_pos = torch.arange(length - q_len, length, device=args.q.device)
        o, lse_b = _attend(
            args.q[b].to(dtype),
            k,
            v,
            q_pos,
            causal=True,
            scale=args.softmax_scale,
            window_left=args.window_left,
            sinks=args.sinks,
            logit_cap=args.logit_cap,
        )
        _write(args.out, args.lse, b, o, lse_b)
