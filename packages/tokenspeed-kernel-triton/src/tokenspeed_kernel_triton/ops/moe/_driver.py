"""The host side shared by the Triton MoE kernels: permutation, two layers, combine.

:func:`run_moe` is the whole ``moe.apply`` for any grouped-GEMM implementation: it sorts the
pairs by expert (:mod:`._routing`), calls a :data:`Layer` twice (w13 with the activation, then
w2 with the routing weight) and sums each token's rows with :func:`._gemm.combine_kernel`
(``combine="reduce"``, the default: deterministic) or lets the w2 layer add them atomically
into a float32 ``[T, H]`` buffer (``combine="atomic"``: one launch fewer, no ``[P, H]``
round trip; the buffer is zeroed and cast to x's dtype by stream-ordered torch ops).
The layers differ by kernel (in-register decode in :mod:`.fused`, ``tl.dot_scaled`` in
:mod:`.fused_mx`); everything else, including the CUDA-graph capturability (no step reads a
device value on the host), is here once. :func:`bind_moe` is the same pipeline bound once for
a token count (``MoEPlan``'s ``bind`` hook), from each kernel's :class:`LayerLaunches`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tokenspeed_kernel.kit import cdiv, next_pow2
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs, Weight
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton._runners import Built, bind_runner
from tokenspeed_kernel_triton.ops.moe._config import Tile
from tokenspeed_kernel_triton.ops.moe._gemm import combine_kernel
from tokenspeed_kernel_triton.ops.moe._routing import Routing, align_launch, sort_by_expert

__all__ = [
    "COMBINES",
    "Layer",
    "LayerLaunches",
    "Runner",
    "bind_call",
    "bind_moe",
    "call_inputs",
    "combine",
    "combine_launch",
    "layer2_tile",
    "layer_output",
    "moe_launches",
    "run_moe",
    "runner_key",
    "with_inputs",
]

Runner = Callable[[MoEApplyArgs], None]  # what a bind hook returns (``MoEPlan``)

COMBINES = ("reduce", "atomic")  # run_moe(combine=...): the deterministic kernel, or fused atomics


class Layer(Protocol):
    """One grouped GEMM layer over the sorted pairs.

    ``gated`` (w13): ``a`` is x ``[T, k]``; returns the activated intermediate
    ``[tiles_bound * BLOCK_M, n]`` in a's dtype, rows at sorted positions. Otherwise (w2):
    ``a`` is that intermediate; returns float32 ``[S, P, n]``: ``S`` split-K partial rows per
    pair (``S = 1`` without split-K), routing weight applied, bias in split 0.

    A layer that supports the fused combine also accepts ``combine_into`` (only passed for w2
    with ``combine="atomic"``): a zeroed float32 ``[T, n]`` buffer; the layer atomically adds
    each pair's weighted row (plus bias) into row ``pair // top_k`` and returns it.
    """

    def __call__(
        self,
        a: torch.Tensor,
        op: Any,
        bias: torch.Tensor | None,
        routing: Routing,
        weights: torch.Tensor,
        *,
        n: int,
        k: int,
        top_k: int,
        tile: Tile,
        gated: bool,
        activation: str,
    ) -> torch.Tensor: ...


def layer_output(
    a: torch.Tensor, routing: Routing, n: int, tile: Tile, *, gated: bool, splits: int = 1
) -> torch.Tensor:
    """An uninitialized layer output: the intermediate ``[tiles_bound * BLOCK_M, n]`` (a's
    dtype) when ``gated``, else float32 ``[splits, P, n]``."""
    if gated:
        return torch.empty((routing.tiles_bound * tile.block_m, n), dtype=a.dtype, device=a.device)
    return torch.empty((splits, routing.num_pairs, n), dtype=torch.float32, device=a.device)


def combine_launch(
    y: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None, out: torch.Tensor
) -> Launch:
    """The launch of :func:`combine` (argument positions: ``topk_ids`` 1, ``out`` 3)."""
    num_tokens, top_k = topk_ids.shape
    hidden = y.shape[-1]
    block_h = min(1024, next_pow2(hidden))
    return Launch(
        combine_kernel,
        (num_tokens, cdiv(hidden, block_h)),
        (
            y,
            topk_ids,
            y if expert_map is None else expert_map,
            out,
            hidden,
            out.stride(0),
            y.stride(0),
        ),
        dict(TOP_K=top_k, HAS_MAP=expert_map is not None, BLOCK_H=block_h, SPLITS=y.shape[0], num_warps=4),
    )


def combine(y: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out[t] = sum over j, s of y[s, t * k + j]`` (float32 ``y`` ``[S, P, H]``), skipping
    pairs mapped to -1; a fixed order, so bit-reproducible."""
    combine_launch(y, topk_ids, expert_map, out)()


def layer2_tile(tile: Tile, w2_tile: Tile | None) -> Tile:
    """Layer 2's tile: ``w2_tile``, else ``tile`` (both layers'). ``ValueError`` when ``w2_tile``
    has other token rows (``block_m``) than ``tile``: both layers walk the permutation's tiles."""
    if w2_tile is None:
        return tile
    if not isinstance(w2_tile, Tile):
        raise TypeError(f"w2_tile must be a Tile or None, got {type(w2_tile).__name__}")
    if w2_tile.block_m != tile.block_m:
        raise ValueError(f"w2_tile.block_m must be layer 1's block_m = {tile.block_m}, got {w2_tile}")
    return w2_tile


def run_moe(
    args: MoEApplyArgs,
    w13: Any,
    w2: Any,
    tile: Tile,
    layer: Layer,
    combine_mode: str = "reduce",
    w2_tile: Tile | None = None,
) -> None:
    """The whole ``moe.apply`` (writes ``args.out``): permutation for ``tile.block_m``-row
    tiles, ``layer`` on ``w13`` with ``tile`` then on ``w2`` with ``w2_tile`` (None: ``tile``;
    :func:`layer2_tile`) (operands as ``layer`` reads them), combine (``combine_mode`` in
    :data:`COMBINES`; ``"atomic"`` needs a layer with ``combine_into``)."""
    if combine_mode not in COMBINES:
        raise ValueError(f"combine_mode must be one of {COMBINES}, got {combine_mode!r}")
    second = layer2_tile(tile, w2_tile)
    x, ids = args.x, args.topk_ids
    hidden = x.shape[1]
    top_k = ids.shape[1]
    inter = args.w2.shape[-1]
    routing = sort_by_expert(ids, args.expert_map, args.w13.shape[0], tile.block_m)
    h = layer(
        x,
        w13,
        args.w13_bias,
        routing,
        args.topk_weights,
        n=inter,
        k=hidden,
        top_k=top_k,
        tile=tile,
        gated=True,
        activation=args.activation,
    )
    w2_layer = dict(n=hidden, k=inter, top_k=top_k, tile=second, gated=False, activation=args.activation)
    if combine_mode == "atomic":
        acc = torch.zeros((x.shape[0], hidden), dtype=torch.float32, device=x.device)  # a memset in the stream
        layer(h, w2, args.w2_bias, routing, args.topk_weights, **w2_layer, combine_into=acc)
        args.out.copy_(acc)
        return
    y = layer(h, w2, args.w2_bias, routing, args.topk_weights, **w2_layer)
    combine(y, ids, args.expert_map, args.out)


class LayerLaunches(Protocol):
    """One grouped GEMM layer as data: its output (allocated, uninitialized; what a
    :class:`Layer` returns) and its launches in order. The first launch takes ``a`` at
    argument position 0 and ``weights`` at 8; the others read only buffers of the layer."""

    def __call__(
        self,
        a: torch.Tensor,
        op: Any,
        bias: torch.Tensor | None,
        routing: Routing,
        weights: torch.Tensor,
        *,
        n: int,
        k: int,
        top_k: int,
        tile: Tile,
        gated: bool,
        activation: str,
    ) -> tuple[torch.Tensor, tuple[Launch, ...]]: ...


def _pipeline(args: MoEApplyArgs, w13: Any, w2: Any, tile: Tile, layer: LayerLaunches, w2_tile: Tile | None):
    """:func:`run_moe`'s (``combine="reduce"``) buffers and launches as data: (routing, the
    permutation's launch, the intermediate, layer 1's launches, the w2 rows, layer 2's
    launches, the combine's launch)."""
    top_k = args.topk_ids.shape[1]
    hidden, inter = args.x.shape[1], args.w2.shape[-1]
    w2_tile = layer2_tile(tile, w2_tile)
    routing, align = align_launch(args.topk_ids, args.expert_map, args.w13.shape[0], tile.block_m)
    common = dict(top_k=top_k, activation=args.activation)
    h, first = layer(
        args.x, w13, args.w13_bias, routing, args.topk_weights, n=inter, k=hidden, tile=tile, gated=True, **common
    )
    y, second = layer(
        h, w2, args.w2_bias, routing, args.topk_weights, n=hidden, k=inter, tile=w2_tile, gated=False, **common
    )
    total = combine_launch(y, args.topk_ids, args.expert_map, args.out)
    return routing, align, h, first, y, second, total


def moe_launches(
    args: MoEApplyArgs, w13: Any, w2: Any, tile: Tile, layer: LayerLaunches, w2_tile: Tile | None = None
) -> Built:
    """:func:`run_moe` (``combine="reduce"``, ``w2_tile`` as there) for ``args`` as a runner
    cache's build (``tokenspeed_kernel_triton._runners``): its launches in order, the
    permutation buffers and layer outputs as scratch (allocated afresh per call), nothing kept."""
    routing, align, h, first, y, second, total = _pipeline(args, w13, w2, tile, layer, w2_tile)
    buffers = (routing.sorted_ids, routing.tile_expert, routing.num_tiles, routing.tile_span, routing.work_counters)
    return [align, *first, *second, total], (*buffers, h, y), ()


def bind_moe(
    args: MoEApplyArgs, w13: Any, w2: Any, tile: Tile, layer: LayerLaunches, w2_tile: Tile | None = None
) -> Runner:
    """:func:`run_moe` (``combine="reduce"``, ``w2_tile`` as there) bound once for ``args``'
    token count: the permutation, both layers' launches from ``layer`` and the combine, with
    the permutation buffers and the layers' outputs as the runner's workspaces. A call of the
    runner launches with its x, topk_weights, topk_ids and out (same shapes, dtypes and device)."""
    _, align, _, first, _, second, combined = _pipeline(args, w13, w2, tile, layer, w2_tile)
    sort, w13_gemm, w2_gemm = align.bound(0), first[0].bound(0, 8), second[0].bound(8)
    after13, after2 = tuple(x.bound() for x in first[1:]), tuple(x.bound() for x in second[1:])  # split-K finish
    total = combined.bound(1, 3)

    def run(a: MoEApplyArgs) -> None:
        sort(a.topk_ids)
        w13_gemm(a.x, a.topk_weights)
        for launch in after13:
            launch()
        w2_gemm(a.topk_weights)
        for launch in after2:
            launch()
        total(a.topk_ids, a.out)

    return run


# --- functional calls: one runner per key, every tensor of the call passed per run ----------
#
# ``moe_apply`` hands the kernel its weights on every call (``prepared`` None: the public
# layout, nothing repacked), so a functional runner binds no weight: x, routing, out, the
# weights' tensors, biases and map all vary per run, and the kernel's scratch buffers
# (permutation buffers, layer outputs, the GEMV intermediate) are allocated per run as an
# uncached call allocates them (no workspace shared between calls or streams). A plan's calls
# with ``prepared`` weights never use it.

# A weight container's tensors, by field (a plain tensor is its own one tensor).
_WEIGHT_FIELDS: dict[type, tuple[str, ...]] = {MXFP4Weight: ("packed", "scales"), FP8Weight: ("data", "scale")}
_CALL_FIELDS = ("x", "topk_weights", "topk_ids", "out", "w13_bias", "w2_bias", "expert_map")
_call_fields = operator.attrgetter(*_CALL_FIELDS)


def _weight_tensors(w: Weight) -> tuple:
    fields = _WEIGHT_FIELDS.get(type(w))
    return (w,) if fields is None else tuple(getattr(w, name) for name in fields)


def _with_weight(w: Weight, tensors: tuple) -> Weight:
    fields = _WEIGHT_FIELDS.get(type(w))
    return tensors[0] if fields is None else dataclasses.replace(w, **dict(zip(fields, tensors)))


def call_inputs(a: MoEApplyArgs) -> tuple:
    """Every tensor of a functional call: x, routing, out, biases, map, then the weights'."""
    return (*_call_fields(a), *_weight_tensors(a.w13), *_weight_tensors(a.w2))


def with_inputs(a: MoEApplyArgs, tensors: tuple) -> MoEApplyArgs:
    """``a`` with :func:`call_inputs`'s tensors replaced by ``tensors`` (same order)."""
    n, n13 = len(_CALL_FIELDS), len(_weight_tensors(a.w13))
    w13, w2 = _with_weight(a.w13, tensors[n : n + n13]), _with_weight(a.w2, tensors[n + n13 :])
    return dataclasses.replace(a, **dict(zip(_CALL_FIELDS, tensors[:n])), w13=w13, w2=w2)


def _facts(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


def runner_key(a: MoEApplyArgs) -> tuple:
    """What a Triton MoE kernel's launch building reads of a functional call besides the
    tensors' addresses (the key contract of ``tokenspeed_kernel_triton._runners``): x's shape,
    strides, dtype and device (the tile, the grids), the routing's shapes and strides, out's
    strides, the activation, each weight's kind and its tensors' shapes, strides and dtypes
    (format, operand strides, fp8 granularity), and the biases' and map's (presence, strides).
    Both layers' tiles (``_config.pick_tile`` with ``layer`` 1 and 2: layer 2 may have its own)
    are functions of keyed facts only (the pair count ``topk_ids.numel()``, w13's expert count,
    the device's vendor, the weights' format and x's element size), so a runner never serves
    another call's tiles; code that swaps the table or ``pick_tile`` at run time calls
    ``_runners.clear_runners`` (module docstring there). A plan's bound runners (``MoEPlan``)
    are per token count of one plan: the same facts."""
    x = a.x
    return (
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        a.topk_ids.shape,
        a.topk_ids.stride(),
        a.topk_weights.stride(),
        a.out.stride(),
        a.activation,
        type(a.w13),
        *map(_facts, _weight_tensors(a.w13)),
        type(a.w2),
        *map(_facts, _weight_tensors(a.w2)),
        _facts(a.w13_bias),
        _facts(a.w2_bias),
        _facts(a.expert_map),
    )


def bind_call(build: Callable[[MoEApplyArgs], Built], args: MoEApplyArgs) -> Runner:
    """The functional runner of ``build``'s launches for calls with ``args``' key: every
    tensor of :func:`call_inputs` passed per run, ``build``'s scratch allocated per run."""
    return bind_runner(build, args, call_inputs, with_inputs)
