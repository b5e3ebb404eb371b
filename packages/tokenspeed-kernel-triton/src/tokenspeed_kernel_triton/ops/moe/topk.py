"""Triton router top-k (``moe.topk``): scoring, selection and renormalization in one kernel."""

from __future__ import annotations

import triton
import triton.language as tl

from tokenspeed_kernel.kit import cdiv, next_pow2
from tokenspeed_kernel.ops.moe.args import TopKArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton._launcher import jit_launch
from tokenspeed_kernel_triton.ops.moe._common import ACT_DTYPES, MAX_EXPERTS, VENDOR_CAPABILITIES, VENDORS

__all__ = ["topk_kernel", "triton_moe_topk"]


@triton.jit
def topk_kernel(
    Logits, Weights, Ids,
    num_tokens, num_experts, stride_lt,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``BLOCK_T`` tokens per program. Logits ``[T, E]`` (row stride ``stride_lt``) → float32
    Weights ``[T, TOP_K]`` and int32 Ids ``[T, TOP_K]``, descending score, ties → lower id;
    a padding row (a NaN or +inf logit, or all -inf) gets ids ``0..TOP_K-1`` and weight 0."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens
    col_ok = cols < num_experts
    x = tl.load(
        Logits + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
        mask=row_ok[:, None] & col_ok[None, :],
        other=float("-inf"),
    ).to(tl.float32)
    # Padding rows (docs/api.md): a NaN or +inf logit, or every logit -inf. They are scored
    # as all-zero logits (ties: ids 0..k-1) and get weight 0 below.
    is_nan = x != x
    row_max = tl.max(tl.where(is_nan, float("-inf"), x), axis=1)  # masked columns hold -inf
    pad = (tl.max(is_nan.to(tl.int32), axis=1) > 0) | (row_max == float("inf")) | (row_max == float("-inf"))
    x = tl.where(row_ok[:, None] & ~pad[:, None], x, 0.0)  # rows past the end: finite, never stored
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = x - tl.max(x, axis=1)[:, None]
        e = tl.exp(x)
        scores = e / tl.sum(e, axis=1)[:, None]
    scores = tl.where(col_ok[None, :], scores, -1.0)
    ks = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    chosen_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(scores, axis=1)
        idx = tl.min(tl.where(scores == best[:, None], cols[None, :], BLOCK_E), axis=1)
        chosen_w = tl.where(ks[None, :] == j, best[:, None], chosen_w)
        chosen_i = tl.where(ks[None, :] == j, idx[:, None], chosen_i)
        scores = tl.where(cols[None, :] == idx[:, None], -2.0, scores)
    if RENORMALIZE:
        total = tl.sum(chosen_w, axis=1)
        chosen_w = chosen_w / tl.where(total > 0, total, 1.0)[:, None]  # all-zero weights stay 0
    chosen_w = tl.where(pad[:, None], 0.0, chosen_w)
    out_mask = row_ok[:, None] & (ks[None, :] < TOP_K)
    offs = rows[:, None].to(tl.int64) * TOP_K + ks[None, :]
    tl.store(Weights + offs, chosen_w, mask=out_mask)
    tl.store(Ids + offs, chosen_i, mask=out_mask)


def _predicate(request) -> str | None:
    num_experts = request.shape("num_experts")
    if num_experts is not None and num_experts > MAX_EXPERTS:
        return f"num_experts={num_experts} exceeds {MAX_EXPERTS} (one register row per token)"
    return None


@register_kernel(
    "moe.topk",
    name="triton_moe_topk",
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"logits": ACT_DTYPES},
    features=("softmax", "sigmoid", "renormalize"),
    priority=Priority.PORTABLE,
    predicate=_predicate,
)
def triton_moe_topk(args: TopKArgs) -> None:
    """Fused router top-k: softmax/sigmoid scores, k rounds of argmax (ties → lower id), renormalize."""
    logits = args.router_logits
    num_tokens, num_experts = logits.shape
    block_e = max(next_pow2(num_experts), 2)
    block_k = max(next_pow2(args.top_k), 2)
    # Decode batches (a few tokens) get a tile of their own size on one warp: every
    # reduction of the k rounds stays in shuffles, no shared-memory round trip.
    block_t = max(1, min(16, 4096 // block_e, next_pow2(num_tokens)))
    tile = block_t * block_e
    num_warps = 1 if tile <= 512 else (4 if block_e >= 256 else 2)
    jit_launch(
        topk_kernel,
        (cdiv(num_tokens, block_t),),
        logits,
        args.topk_weights,
        args.topk_ids,
        num_tokens,
        num_experts,
        logits.stride(0),
        TOP_K=args.top_k,
        SIGMOID=args.scoring == "sigmoid",
        RENORMALIZE=args.renormalize,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
