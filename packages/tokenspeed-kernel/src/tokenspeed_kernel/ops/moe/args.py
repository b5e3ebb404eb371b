"""Typed argument objects: what a MoE kernel receives (``moe.topk``, ``moe.apply``, and the
expert-parallel exchange ``moe.dispatch`` / ``moe.combine``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight

__all__ = [
    "ACTIVATIONS",
    "ACTIVATION_QUANTS",
    "ACTIVATION_QUANT_WEIGHTS",
    "ExchangeBuffers",
    "ExchangeRoute",
    "MoEApplyArgs",
    "MoECombineArgs",
    "MoEDispatchArgs",
    "MoEDispatchHandle",
    "MoEDispatched",
    "TopKArgs",
    "Weight",
]

Weight = torch.Tensor | MXFP4Weight | FP8Weight

ACTIVATIONS = ("silu", "gelu", "swiglu_oai")

# ``activation_quant`` values and the request feature each one adds. "mxfp8": every expert
# GEMM's A operand (x for w13, the activated intermediate for w2) is quantized on the fly
# by :func:`tokenspeed_kernel.quant.quantize_mxfp8` (e4m3 + E8M0 per 32 values along K)
# and the GEMM multiplies the dequantized values. Only with MXFP4 weights. "fp8": the same A
# operands quantized per token (per token and 128-value K group for 128x128 block-scaled
# weights) by :func:`tokenspeed_kernel.quant.quantize_fp8_per_token` (e4m3 + a power-of-two
# float32 scale), so the GEMM runs fp8 x fp8. Only with FP8 weights.
ACTIVATION_QUANTS = {"mxfp8": "mxfp8_act", "fp8": "fp8_act"}
# The weight formats each activation_quant value needs.
ACTIVATION_QUANT_WEIGHTS = {"mxfp8": ("mxfp4",), "fp8": ("fp8_per_tensor", "fp8_per_channel", "fp8_block")}


@dataclass(slots=True)
class TopKArgs:
    """Router scoring and top-k (``moe.topk``).

    Attributes:
        router_logits: ``[T, E]``, bf16/fp16/fp32.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (softmax over all E, then top-k) or ``"sigmoid"``
            (sigmoid per expert, then top-k).
        renormalize: divide the k chosen weights by their sum.
        topk_weights: float32 ``[T, top_k]`` to be written.
        topk_ids: int32 ``[T, top_k]`` to be written (descending weight; ties: lower id).
    """

    router_logits: torch.Tensor
    top_k: int
    scoring: str
    renormalize: bool
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


@dataclass(slots=True)
class MoEApplyArgs:
    """Expert computation and weighted combine (``moe.apply``).

    For each token ``t`` and choice ``j``: ``e = topk_ids[t, j]`` (a global id; with
    ``expert_map`` the local id is ``expert_map[e]`` and ``-1`` contributes nothing),
    ``h = x[t] @ w13[e].T (+ w13_bias[e])``, ``gate, up = h[:I], h[I:]``,
    ``a = act(gate, up)``, ``y = a @ w2[e].T (+ w2_bias[e])``, and
    ``out[t] = sum_j topk_weights[t, j] * y``.

    Activations: ``silu``: ``silu(gate) * up``; ``gelu``: ``gelu(gate) * up`` (tanh-free
    erf GELU); ``swiglu_oai``: ``gate = min(gate, 7)``, ``up = clamp(up, -7, 7)``,
    ``gate * sigmoid(1.702 * gate) * (up + 1)``.

    Attributes:
        x: ``[T, H]``, bf16/fp16/fp32.
        w13: ``[E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up): a tensor in x's dtype,
            an :class:`MXFP4Weight` or an :class:`FP8Weight` of that logical shape.
        w2: ``[E, H, I]``, same kinds as ``w13``.
        topk_weights: float32 ``[T, k]``. topk_ids: int32 ``[T, k]``.
        activation: one of :data:`ACTIVATIONS`.
        w13_bias: ``[E, 2I]`` or None; w2_bias: ``[E, H]`` or None (x's dtype or float32).
        expert_map: int32 ``[E_global]`` or None.
        out: ``[T, H]`` in x's dtype, to be written.
        prepared: what the kernel's ``prepare`` hook made of the weights through
            ``moe_plan`` (e.g. repacked MXFP4), or None on the functional path.
        activation_quant: None (the GEMMs read x and the intermediate as they are) or
            ``"mxfp8"``: before each expert GEMM its A operand, ``x [T, H]`` for ``w13`` and
            the activated intermediate ``a [*, I]`` for ``w2``, is replaced by
            ``fake_quantize_mxfp8(A)`` (:mod:`tokenspeed_kernel.quant`: float8_e4m3fn values,
            one E8M0 scale per 32 consecutive values along K = H or I). Only with MXFP4
            weights (then ``H % 32 == I % 32 == 0``). Kernels see it as the request feature
            ``"mxfp8_act"``. Or ``"fp8"`` (FP8 weights only): the A operands are replaced by
            ``fake_quantize_fp8_per_token(A, 128 if block-scaled weights else None)``;
            request feature ``"fp8_act"``.
    """

    x: torch.Tensor
    w13: Weight
    w2: Weight
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: str
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    expert_map: torch.Tensor | None
    out: torch.Tensor
    prepared: Any = None
    activation_quant: str | None = None


# --- expert parallelism (moe.dispatch / moe.combine) ------------------------------------------
#
# The exchange layout, shared by every dispatch and combine kernel. A group of W ranks; each rank
# holds some of the E global experts (``owner[e]`` is the rank holding expert e). Rank s sends
# token t to rank r once when any of t's k experts is held by r, however many of them r holds
# (one row per (token, rank), not per (token, choice): top-4 over 2 ranks sends each token at
# most twice). Every rank's receive buffers have W blocks of C rows (C, the capacity, is at
# least every rank's token count): block s holds the rows rank s sent, in s's token order, then
# padding. Each row carries its token's whole ``topk_ids``/``topk_weights`` rows (global ids), so
# ``moe_apply`` with the receiving rank's expert map computes exactly the weighted sum over the
# choices that rank holds; padding rows carry the id E and weight 0.


@dataclass(eq=False)
class ExchangeBuffers:
    """Device buffers of the exchange kernels, kept from one step to the next: a plan holds one
    for all its steps (allocated by the first dispatch and combine that need them, then reused;
    CUDA-graph replays write the same memory), a functional ``moe_dispatch`` makes a fresh one
    per call. Only the layout of :mod:`tokenspeed_kernel.ops.moe.ep_wire` writes them (its
    functions allocate and view them).

    Attributes:
        send: None, or uint8 ``[W * C + 1, R]`` (``R``: the wire row's bytes): the wire rows a
            padded dispatch sends, block r the rows for rank r; the last row takes the writes of
            the (token, rank) pairs that are not sent. Zeros when allocated; padding rows keep
            what an earlier step left (the activations of an earlier ``x``).
        send_x: None, or ``[W * C + 1, H]`` in x's dtype: the activations a padded dispatch
            sends in a collective of their own (large exchanges; ``ep_wire``), laid out as ``send``.
        recv: None, or flat uint8 ``[N]``: the dispatch receives its ``W * C`` wire rows in the
            first ``W * C * R`` bytes; the combine receives the rows coming back in the last
            ``(W * C + 1) * H * s`` bytes (``s``: x's itemsize) as ``[W * C + 1, H]`` whose last
            row stays zero: no kernel writes the last ``H * s`` bytes.
    """

    send: torch.Tensor | None = None
    send_x: torch.Tensor | None = None
    recv: torch.Tensor | None = None


@dataclass(slots=True)
class ExchangeRoute:
    """Where one rank's tokens went: what a combine needs to bring their rows back.

    Attributes:
        world_size: W, the group's size. rank: this rank's index in the group.
        capacity: C, rows per block (the receive buffers hold ``W * C`` rows).
        slots: int64 ``[T, W]`` on x's device, column-major (strides ``(1, T)``: ``slots.t()``
            is a contiguous ``[W, T]``): ``slots[t, r] = r * C + i`` when token t went to rank
            r as the ``i``-th row of its block there, else ``W * C`` (not sent).
        counts: ``(sent, received)``, host ints per rank: the rows this rank sent to and received
            from each rank, when the dispatch kernel moved only the valid rows (an exact
            all-to-all-v; the combine then moves them back the same way); None when it moved
            whole blocks of C rows (padding included).
        buffers: the :class:`ExchangeBuffers` of the dispatch (its plan's, or the call's own):
            the combine receives the rows coming back in ``buffers.recv``.
    """

    world_size: int
    rank: int
    capacity: int
    slots: torch.Tensor
    counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    buffers: ExchangeBuffers = field(default_factory=ExchangeBuffers)


@dataclass(slots=True)
class MoEDispatchArgs:
    """The token exchange of expert parallelism on one rank (``moe.dispatch``; the layout is in
    the comment above :class:`ExchangeRoute`). Every rank of the group launches its kernel with
    the same W, C, E, k, H and dtype; the kernel runs the collectives of the exchange on
    ``group`` (torch.distributed only: no transport of its own).

    Attributes:
        x: ``[T, H]`` bf16/fp16/fp32, contiguous: this rank's tokens (``0 <= T <= C``).
        topk_ids: int32 ``[T, k]``, global expert ids in ``[0, E)``. topk_weights: float32 ``[T, k]``.
        group: the ``torch.distributed.ProcessGroup`` of the W ranks.
        rank: this rank's index in ``group``. world_size: W.
        owner: int64 ``[E]`` on x's device: the rank holding each global expert.
        capacity: C, rows per block.
        recv_x: ``[W * C, H]`` in x's dtype, to be written: block s's first rows are the rows
            rank s sent, in its token order; padding rows hold any values (the padded kernels:
            rows of this or an earlier step's x, or zeros; finite when every x was).
        recv_topk_ids: int32 ``[W * C, k]``, to be written: each row's ``topk_ids`` row as sent;
            padding rows E.
        recv_topk_weights: float32 ``[W * C, k]``, to be written: each row's ``topk_weights``
            row as sent; padding rows 0.
        slots: int64 ``[T, W]``, column-major (``slots.t()`` is contiguous), to be written:
            see :class:`ExchangeRoute`.
        counts: None, or set by a kernel that moved only the valid rows: ``(sent, received)``
            (:class:`ExchangeRoute`).
        buffers: the :class:`ExchangeBuffers` this kernel may use (kept across a plan's steps).
    """

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    group: Any
    rank: int
    world_size: int
    owner: torch.Tensor
    capacity: int
    recv_x: torch.Tensor
    recv_topk_ids: torch.Tensor
    recv_topk_weights: torch.Tensor
    slots: torch.Tensor
    counts: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    buffers: ExchangeBuffers = field(default_factory=ExchangeBuffers)


@dataclass(slots=True)
class MoECombineArgs:
    """The way back (``moe.combine``): each rank returns the rows it computed to the ranks they
    came from, and each rank sums its tokens' rows.

    Attributes:
        y: ``[W * C, H]`` in x's dtype, contiguous: one output row per received row (the
            weighted sum over the receiving rank's experts, as ``moe_apply`` writes it);
            padding rows are never read.
        route: the dispatch's :class:`ExchangeRoute` on this rank.
        group: the ``torch.distributed.ProcessGroup`` of the dispatch.
        out: ``[T, H]`` in x's dtype, to be written: ``out[t]`` is the sum over the ranks r that
            t went to, in rank order and in float32, of the row r computed for t.
    """

    y: torch.Tensor
    route: ExchangeRoute
    group: Any
    out: torch.Tensor


@dataclass(eq=False)
class MoEDispatchHandle:
    """One dispatch, as ``moe_combine`` needs it: valid for exactly one combine.

    Attributes:
        route: where this rank's tokens went (:class:`ExchangeRoute`).
        group: the dispatch's process group.
        num_tokens: T, this rank's tokens (the combine's output rows).
        hidden: H. dtype: x's dtype. device: x's device.
        kernel: the name of the dispatch kernel that moved the rows.
        step: the dispatch's number: per group for ``moe_dispatch`` (1, 2, ... on every rank
            alike), per plan for a plan's ``dispatch``.
        plan: the plan's id for a plan's dispatch, 0 for ``moe_dispatch``.
        combined: set once the combine has consumed the handle; a second combine raises.
    """

    route: ExchangeRoute
    group: Any
    num_tokens: int
    hidden: int
    dtype: torch.dtype
    device: torch.device
    kernel: str
    step: int
    plan: int = 0
    combined: bool = False

    @property
    def num_rows(self) -> int:
        """``W * C``: the rows a dispatch delivered to each rank (the combine's ``y`` rows)."""
        return self.route.world_size * self.route.capacity


@dataclass(frozen=True, eq=False)
class MoEDispatched:
    """What a dispatch delivered to this rank: the rows of the tokens routed to its experts,
    laid out for ``moe_apply`` (``W`` ranks, capacity ``C``, ``E`` global experts).

    ``y = moe_apply(d.x, w13, w2, d.topk_weights, d.topk_ids, expert_map=d.expert_map, ...)``
    computes, for every row, the weighted sum over the choices this rank holds; then
    ``moe_combine(y, d.handle)`` brings each token's rows back to its rank and sums them.

    Attributes:
        x: ``[W * C, H]`` in the dispatched dtype: block s (rows ``[s*C, (s+1)*C)``) holds the
            tokens rank s routed here, in s's token order, then padding rows.
        topk_weights: float32 ``[W * C, k]``: each row's token's ``topk_weights`` row; 0 on
            padding rows.
        topk_ids: int32 ``[W * C, k]``: each row's token's ``topk_ids`` row (global ids, the
            choices held elsewhere included); ``E`` on padding rows.
        expert_map: int32 ``[E + 1]``: this rank's ``expert_map`` with ``-1`` appended for the
            padding id ``E``, so ``moe_apply`` skips the choices held elsewhere and the padding.
        handle: the :class:`MoEDispatchHandle` for ``moe_combine``.
    """

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    expert_map: torch.Tensor
    handle: MoEDispatchHandle
