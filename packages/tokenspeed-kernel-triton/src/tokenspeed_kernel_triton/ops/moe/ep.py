"""Triton kernels of the expert-parallel exchange: ``triton_moe_dispatch`` (``moe.dispatch``) and
``triton_moe_combine`` (``moe.combine``).

They move the same wire rows over the same collectives as the core's
``torch_moe_dispatch_padded`` / ``torch_moe_combine`` (``tokenspeed_kernel.ops.moe.ep_wire``:
layout, buffers and the ``all_to_all_single`` calls) and deliver the same bits; what they
replace is the torch ops around the collectives:

- dispatch: routing in one launch (one program per destination rank scans its tokens:
  ``slots`` and, for every send row, the token it carries or -1 for padding), the send rows in
  one (a program per send row copies its token's activations, ids and weights; padding rows
  get the ids E and weights 0), the collective(s), and the copy out in one: 3 launches where
  the torch kernel makes 15.
- combine: the collective (``exchange_back``), then one launch that reads each token's W rows
  back, adds them in float32 in rank order and rounds once: 1 launch where the torch kernel
  makes 2 (W = 2) or W + 1, and no ``[W, T, H]`` intermediate.

Graph-safe: no host synchronization. Rows are copied as 8-byte integers where they allow it
(``ep_wire.wide``), so the copies are bit-exact.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.kit import next_pow2
from tokenspeed_kernel.ops.moe.args import MoECombineArgs, MoEDispatchArgs
from tokenspeed_kernel.ops.moe.ep_wire import exchange_back, exchange_wire, send_wire, wide
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton._launcher import jit_launch
from tokenspeed_kernel_triton.ops.moe._common import ACT_DTYPES, VENDOR_CAPABILITIES, VENDORS, interpreted

__all__ = ["triton_moe_combine", "triton_moe_dispatch"]

# Opt-in until timed on GPUs; above the core's torch_moe_dispatch_padded (Priority.OPT_IN).
_register = functools.partial(
    register_kernel,
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"x": ACT_DTYPES},
    priority=Priority.OPT_IN + 10,
)

_BLOCK_T = 1024  # tokens per step of a routing program's scan
_BLOCK_H = 1024  # row elements per step of a copy (8-byte elements: 8 KiB; GPT-OSS rows are 720)


@triton.jit
def ep_route_kernel(
    Owner, Ids, SlotsT, RowToken,
    num_tokens, capacity,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program r: rank r's tokens. Owner int64 ``[E]``, Ids int32 ``[T, TOP_K]`` → SlotsT
    int64 ``[W, T]`` (``r * C + i`` for the i-th token sent to r, ``W * C`` if not sent) and
    RowToken int32 ``[W * C]`` (the token of each send row, -1 for padding)."""
    r = tl.program_id(0)
    rows = tl.num_programs(0) * capacity
    base = r * capacity
    ks = tl.arange(0, BLOCK_K)
    count = tl.full((), 0, tl.int32)
    for start in range(0, num_tokens, BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        mask = t_ok[:, None] & (ks[None, :] < TOP_K)
        ids = tl.load(Ids + t[:, None].to(tl.int64) * TOP_K + ks[None, :], mask=mask, other=0)
        owner = tl.load(Owner + ids, mask=mask, other=-1)
        sent = (tl.max((owner == r).to(tl.int32), axis=1) > 0) & t_ok
        row = count + tl.cumsum(sent.to(tl.int32), axis=0) - 1
        slot = tl.where(sent, base + row, rows)
        tl.store(SlotsT + r.to(tl.int64) * num_tokens + t, slot.to(tl.int64), mask=t_ok)
        tl.store(RowToken + base + row, t, mask=sent)
        count += tl.sum(sent.to(tl.int32), axis=0)
    for start in range(0, capacity, BLOCK_T):
        i = start + tl.arange(0, BLOCK_T)
        tl.store(RowToken + base + i, tl.full((BLOCK_T,), -1, tl.int32), mask=(i >= count) & (i < capacity))


@triton.jit
def ep_pack_kernel(
    X, Ids, Weights, RowToken, Act, Meta,
    row_elems, stride_act, stride_meta, pad_id,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program i: send row i. X ``[T, row_elems]`` (integers: the activations' bits), Ids
    int32 / Weights int32 (float32 bits) ``[T, TOP_K]`` → Act row i (stride ``stride_act``)
    and Meta row i (int32, stride ``stride_meta``: TOP_K ids then TOP_K weights). A padding
    row (token -1) gets the ids ``pad_id`` and weights 0; its activations stay as they were."""
    i = tl.program_id(0).to(tl.int64)
    t = tl.load(RowToken + i).to(tl.int64)
    valid = t >= 0
    for start in range(0, row_elems, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        m = (cols < row_elems) & valid
        tl.store(Act + i * stride_act + cols, tl.load(X + t * row_elems + cols, mask=m), mask=m)
    ks = tl.arange(0, BLOCK_K)
    km = ks < TOP_K
    ids = tl.load(Ids + t * TOP_K + ks, mask=km & valid, other=pad_id)
    weights = tl.load(Weights + t * TOP_K + ks, mask=km & valid, other=0)
    tl.store(Meta + i * stride_meta + ks, ids, mask=km)
    tl.store(Meta + i * stride_meta + TOP_K + ks, weights, mask=km)


@triton.jit
def ep_unpack_kernel(
    Act, Meta, RecvX, RecvIds, RecvWeights,
    row_elems, stride_act, stride_meta,
    COPY_ACT: tl.constexpr, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program i: received row i. Meta row i (int32: ids, weights' bits) → RecvIds /
    RecvWeights (int32 ``[rows, TOP_K]``); with COPY_ACT, Act row i → RecvX ``[rows, row_elems]``."""
    i = tl.program_id(0).to(tl.int64)
    if COPY_ACT:
        for start in range(0, row_elems, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            m = cols < row_elems
            tl.store(RecvX + i * row_elems + cols, tl.load(Act + i * stride_act + cols, mask=m), mask=m)
    ks = tl.arange(0, BLOCK_K)
    km = ks < TOP_K
    tl.store(RecvIds + i * TOP_K + ks, tl.load(Meta + i * stride_meta + ks, mask=km), mask=km)
    tl.store(RecvWeights + i * TOP_K + ks, tl.load(Meta + i * stride_meta + TOP_K + ks, mask=km), mask=km)


@triton.jit
def _to_bf16_rne(acc):
    """float32 → bfloat16 bits, round to nearest even (NaN → 0x7FC0), as PyTorch's CPU cast:
    integer arithmetic, so Triton's interpreter (whose cast truncates) rounds like the GPU."""
    bits = acc.to(tl.uint32, bitcast=True)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    return tl.where(acc != acc, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def ep_combine_kernel(
    Back, SlotsT, Out,
    num_tokens, hidden,
    WORLD: tl.constexpr, BLOCK_H: tl.constexpr, MANUAL_BF16: tl.constexpr,
):  # fmt: skip
    """Program (t, h): token t's columns ``[h * BLOCK_H, ...)``. Back ``[W * C + 1, H]`` (the
    rows that came back, the last zero), SlotsT int64 ``[W, T]`` → Out ``[T, H]``: the rows
    ``Back[SlotsT[r, t]]`` added in float32 in rank order, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < hidden
    slot = tl.load(SlotsT + t)
    acc = tl.load(Back + slot * hidden + cols, mask=m).to(tl.float32)
    for r in tl.static_range(1, WORLD):
        slot = tl.load(SlotsT + r * num_tokens + t)
        acc += tl.load(Back + slot * hidden + cols, mask=m).to(tl.float32)
    if MANUAL_BF16:
        out = _to_bf16_rne(acc)
    else:
        out = acc.to(Out.dtype.element_ty)
    tl.store(Out + t * hidden + cols, out, mask=m)


def _copy_block(row_elems: int) -> int:
    return max(16, min(_BLOCK_H, next_pow2(row_elems)))


@_register("moe.dispatch", name="triton_moe_dispatch")
def triton_moe_dispatch(args: MoEDispatchArgs) -> None:
    """Padded dispatch (``ep_wire``'s wire rows, no host sync) with Triton routing, packing and
    unpacking: 3 launches around the collective(s)."""
    world, capacity = args.world_size, args.capacity
    num_tokens, top_k = args.topk_ids.shape
    rows = world * capacity
    device = args.x.device
    row_token = torch.empty(rows, dtype=torch.int32, device=device)
    block_k = max(2, next_pow2(top_k))
    jit_launch(
        ep_route_kernel,
        (world,),
        args.owner,
        args.topk_ids,
        args.slots.t(),
        row_token,
        num_tokens,
        capacity,
        TOP_K=top_k,
        BLOCK_T=min(_BLOCK_T, max(16, next_pow2(num_tokens))),
        BLOCK_K=block_k,
    )
    layout, send, send_x = send_wire(args)
    act, x = wide(send_x, args.x)
    meta = layout.ids(send)  # int32 [rows + 1, k] view; the weights' bits follow each row's ids
    row_elems = x.shape[1]
    jit_launch(
        ep_pack_kernel,
        (rows,),
        x,
        args.topk_ids,
        args.topk_weights.view(torch.int32),
        row_token,
        act,
        meta,
        row_elems,
        act.stride(0),
        meta.stride(0),
        args.owner.shape[0],
        TOP_K=top_k,
        BLOCK_H=_copy_block(row_elems),
        BLOCK_K=block_k,
    )
    recv = exchange_wire(args, layout, send, send_x)
    recv_meta = layout.ids(recv)
    if layout.packed:
        recv_x, recv_act = wide(args.recv_x, layout.act(recv))
    else:
        recv_x = recv_act = args.recv_x  # delivered by its own collective
    jit_launch(
        ep_unpack_kernel,
        (rows,),
        recv_act,
        recv_meta,
        recv_x,
        args.recv_topk_ids,
        args.recv_topk_weights.view(torch.int32),
        recv_x.shape[1],
        recv_act.stride(0),
        recv_meta.stride(0),
        COPY_ACT=layout.packed,
        TOP_K=top_k,
        BLOCK_H=_copy_block(recv_x.shape[1]),
        BLOCK_K=block_k,
    )


@_register("moe.combine", name="triton_moe_combine")
def triton_moe_combine(args: MoECombineArgs) -> None:
    """Combine: the collective (``ep_wire.exchange_back``), then one launch summing each token's
    W rows in float32 in rank order."""
    back = exchange_back(args)
    num_tokens, hidden = args.out.shape
    if num_tokens == 0:
        return
    block_h = max(16, min(1024, next_pow2(hidden)))
    jit_launch(
        ep_combine_kernel,
        (num_tokens, triton.cdiv(hidden, block_h)),
        back,
        args.route.slots.t(),
        args.out,
        num_tokens,
        hidden,
        WORLD=args.route.world_size,
        BLOCK_H=block_h,
        MANUAL_BF16=interpreted(back.device) and back.dtype == torch.bfloat16,
    )
