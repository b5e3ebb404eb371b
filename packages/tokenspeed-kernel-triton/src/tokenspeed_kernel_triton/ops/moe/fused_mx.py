"""Triton fused MoE with a ``tl.dot_scaled`` MXFP4 main loop: ``triton_fused_moe_mx``.

Same five launches as :mod:`.fused` (permutation, w13 GEMM + bias + activation, w2 GEMM +
bias + routing weight, combine; host driver :func:`._driver.run_moe`), but the grouped GEMMs
are :func:`._mx_gemm.moe_mx_gemm_kernel`, which gives the MXFP4 weight to ``tl.dot_scaled``
instead of decoding E2M1 with integer arithmetic. MXFP4 weights and bf16 activations only.

- **Layout.** The packed bytes are used in the public order (``[E, N, K/2]``, low nibble =
  even k): it is ``dot_scaled``'s k-packing, and a ``[BLOCK_K/2, BLOCK_N]`` tile is
  ``BLOCK_N`` runs of ``BLOCK_K/2`` contiguous, 16-byte aligned bytes (also a valid TMA box),
  so the plan does not copy them. The plan hook (:func:`prepare_moe_mx`) only lays the E8M0
  scales out N-contiguous (``[E, K/32, N]``, N padded to 16), so that a step's
  ``[BLOCK_N, BLOCK_K/32]`` scale tile is ``BLOCK_K/32`` aligned vector loads (pipelined)
  rather than byte loads of ``K/32``-byte rows. The functional path reads the public scales.
- **Split-K** in the decode regime: :func:`._config.split_k` (host, from shapes only) splits
  K when the grid is small; layer 1 then goes through a float32 partial buffer and
  :func:`._mx_gemm.split_finish_kernel`, layer 2 writes per-split rows the combine sums.
  Every launch size is a function of shapes: CUDA-graph capturable.
- **Launches as data.** :func:`split_launches` builds a layer's launches (the GEMM from a
  kernel's :class:`GemmLaunch` builder, the finish kernel when split) as
  :class:`~tokenspeed_kernel_triton._launcher.Launch` objects, once for both paths:
  :func:`split_layer` runs them (the functional path), :func:`bind_layers` binds them.
- **Bound runs** (``bind`` hook :func:`bind_fused_moe_mx`, ``MoEPlan``'s "Bound runs"): up to
  :data:`.fused.BIND_MAX_TOKENS` tokens a plan binds the four launches (five when layer 1 is
  split) once per token count, tile and K splits decided then, the permutation buffers,
  split partials, intermediate and w2 rows kept as the runner's workspaces; a call only
  launches with its x, topk_weights, topk_ids and out. Above that count and with
  ``activation_quant`` the function serves.
- **Gating.** Ranked above ``triton_fused_moe`` for MXFP4 weights: on an H100 its GPU
  numerics pass and it is 1.21-1.44x faster at every T from 1 to 4096
  (docs/history.md, 2026-11-23). Registered for GPUs only: Triton's
  interpreter (the CPU) cannot run ``tl.dot_scaled``. ROCm is allowed but never measured: the
  kernel compiles for gfx942 (Triton emulates ``dot_scaled`` with bf16 MFMA) and gfx950
  (``test_aot_compile_moe.py``), and the AMD Gluon MoE kernels outrank it there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv, sm_count, vendor_of
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile, split_k
from tokenspeed_kernel_triton.ops.moe._driver import Layer, Runner, bind_moe, layer_output, run_moe
from tokenspeed_kernel_triton.ops.moe._mx_gemm import moe_mx_gemm_kernel, split_finish_kernel
from tokenspeed_kernel_triton.ops.moe._routing import Routing
from tokenspeed_kernel_triton.ops.moe.fused import BIND_MAX_TOKENS, experts_predicate

__all__ = [
    "MX_REGISTRATION",
    "GemmLaunch",
    "MxOperand",
    "PreparedMx",
    "Runner",
    "bind_fused_moe_mx",
    "bind_layers",
    "dot_scaled_missing",
    "fused_moe_mx",
    "mx_operand",
    "mx_predicate",
    "mxfp4_predicate",
    "n_contiguous_scales",
    "plan_splits",
    "prepare_moe_mx",
    "run_layers",
    "sm_count",
    "split_launches",
    "split_layer",
    "split_size",
    "triton_fused_moe_mx",
]

A_FORMATS = {torch.bfloat16: "bf16"}  # dot_scaled's lhs format per activation dtype
SCALE_ROW_ALIGN = 16  # bytes: the plan pads N of the N-contiguous scales to this
FINISH_BLOCK_N = 128  # columns per program of split_finish_kernel
DEFAULT_SMS = 132  # SM count assumed off-GPU (an H100), only for the split rule


@dataclass(frozen=True)
class MxOperand:
    """An MXFP4 weight as :func:`._mx_gemm.moe_mx_gemm_kernel` reads it.

    Attributes:
        packed: uint8 ``[E, N, K/2]``, the public byte order (the weight's own tensor).
        scales: uint8 E8M0 scales of logical shape ``[E, N, K/32]``, any strides: the public
            tensor, or the plan's N-contiguous one (:func:`n_contiguous_scales`).
    """

    packed: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class PreparedMx:
    """What :func:`prepare_moe_mx` makes of the weights for :meth:`MoEPlan.apply`."""

    w13: MxOperand
    w2: MxOperand


def n_contiguous_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales uint8 ``[E, N, G]`` → the same values as an ``[E, N, G]`` view of storage
    ``[E, G, N_pad]`` (N-contiguous, ``N_pad`` = N rounded up to 16, padding 127 = 1.0), so
    each K group's scales of consecutive rows are one aligned vector."""
    e, n, g = scales.shape
    n_pad = -(-n // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN
    storage = torch.full((e, g, n_pad), 127, dtype=torch.uint8, device=scales.device)
    storage[..., :n] = scales.transpose(1, 2)
    return storage[..., :n].transpose(1, 2)


def mx_operand(w: MXFP4Weight, *, plan: bool = False) -> MxOperand:
    """The kernel's view of ``w``: public bytes; scales public, or N-contiguous (``plan``)."""
    if not isinstance(w, MXFP4Weight):
        raise TypeError(f"triton_fused_moe_mx takes MXFP4 weights only, got {type(w).__name__}")
    return MxOperand(w.packed, n_contiguous_scales(w.scales) if plan else w.scales)


def prepare_moe_mx(*, w13: MXFP4Weight, w2: MXFP4Weight, w13_bias=None, w2_bias=None, expert_map=None) -> PreparedMx:
    """Plan hook: N-contiguous copies of the scales (1/16 of the packed bytes); the packed
    bytes are used as given. Inputs are untouched."""
    return PreparedMx(mx_operand(w13, plan=True), mx_operand(w2, plan=True))


def plan_splits(routing: Routing, n: int, k: int, tile: Tile, num_sms: int) -> int:
    """K splits of one layer: :func:`._config.split_k` over the layer's grid."""
    programs = routing.tiles_bound * cdiv(n, tile.block_n)
    return split_k(programs, cdiv(k, tile.block_k), num_sms)


def split_size(k: int, block_k: int, splits: int) -> int:
    """K values per split (a multiple of ``block_k``): split s walks ``[s * size, (s + 1) * size)``
    clipped to K; trailing splits may be empty (they store zeros)."""
    return cdiv(cdiv(k, block_k), splits) * block_k


class GemmLaunch(Protocol):
    """Builds one layer's grouped-GEMM :class:`Launch` into ``out`` (``splits`` K splits of
    ``k_split`` values; argument positions: ``a`` 0, ``weights`` 8)."""

    def __call__(
        self,
        a: torch.Tensor,
        op: Any,
        bias: torch.Tensor | None,
        routing: Routing,
        weights: torch.Tensor,
        out: torch.Tensor,
        *,
        n: int,
        k: int,
        top_k: int,
        tile: Tile,
        gated: bool,
        activation: str,
        splits: int,
        k_split: int,
    ) -> Launch: ...


def split_launches(
    gemm: GemmLaunch,
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
    splits: int | None = None,
) -> tuple[torch.Tensor, tuple[Launch, ...]]:
    """One layer of a grouped GEMM with ``splits`` K splits (None: :func:`plan_splits`), as data:
    its output (uninitialized) and its launches in order. The GEMM's launch comes from
    ``gemm`` into a buffer allocated here (``k_split`` from :func:`split_size`); after a split
    layer 1 (float32 raw gate | up partials ``[splits, tiles_bound * block_m, 2n]``) a second
    launch of :func:`._mx_gemm.split_finish_kernel` sums the splits, adds the bias and applies
    the activation into the intermediate (it reads only those buffers and the plan's bias)."""
    if splits is None:
        splits = plan_splits(routing, n, k, tile, sm_count(a.device, default=DEFAULT_SMS))
    partial = gated and splits > 1
    if partial:  # raw gate | up sums per split
        out = torch.empty((splits, routing.tiles_bound * tile.block_m, 2 * n), dtype=torch.float32, device=a.device)
    else:
        out = layer_output(a, routing, n, tile, gated=gated, splits=splits)
    launch = gemm(
        a,
        op,
        bias,
        routing,
        weights,
        out,
        n=n,
        k=k,
        top_k=top_k,
        tile=tile,
        gated=gated,
        activation=activation,
        splits=splits,
        k_split=split_size(k, tile.block_k, splits),
    )
    if not partial:
        return out, (launch,)
    h = layer_output(a, routing, n, tile, gated=True)
    finish = Launch(
        split_finish_kernel,
        (routing.tiles_bound, cdiv(n, FINISH_BLOCK_N)),
        (
            out,
            out if bias is None else bias,
            h,
            routing.sorted_ids,
            routing.tile_expert,
            routing.num_tiles,
            routing.num_pairs,
            n,
            out.stride(0),
            out.stride(1),
            0 if bias is None else bias.stride(0),
            h.stride(0),
        ),
        dict(
            SPLITS=splits,
            ACTIVATION=ACTIVATION_CODES[activation],
            HAS_BIAS=bias is not None,
            BLOCK_M=tile.block_m,
            BLOCK_N=FINISH_BLOCK_N,
            num_warps=4,
        ),
    )
    return h, (launch, finish)


def split_layer(
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
    splits: int | None = None,
    gemm: GemmLaunch,
) -> torch.Tensor:
    """One layer (a :class:`._driver.Layer` once ``gemm`` is given): :func:`split_launches`,
    launched; returns the layer's output."""
    out, launches = split_launches(
        gemm,
        a,
        op,
        bias,
        routing,
        weights,
        n=n,
        k=k,
        top_k=top_k,
        tile=tile,
        gated=gated,
        activation=activation,
        splits=splits,
    )
    for launch in launches:
        launch()
    return out


def _mx_launch(
    a: torch.Tensor,
    op: MxOperand,
    bias: torch.Tensor | None,
    routing: Routing,
    weights: torch.Tensor,
    out: torch.Tensor,
    *,
    n: int,
    k: int,
    top_k: int,
    tile: Tile,
    gated: bool,
    activation: str,
    splits: int,
    k_split: int,
) -> Launch:
    """The :class:`GemmLaunch` of :func:`._mx_gemm.moe_mx_gemm_kernel`."""
    return Launch(
        moe_mx_gemm_kernel,
        (routing.tiles_bound * cdiv(n, tile.block_n), splits),
        (
            a,
            op.packed,
            op.scales,
            op.packed if bias is None else bias,
            out,
            routing.sorted_ids,
            routing.tile_expert,
            routing.num_tiles,
            weights,
            routing.num_pairs,
            n,
            k,
            routing.tiles_bound,
            k_split,
            a.stride(0),
            *op.packed.stride(),
            *op.scales.stride(),
            0 if bias is None else bias.stride(0),
            out.stride(-2),
            out.stride(0) if out.dim() == 3 else 0,
        ),
        dict(
            TOP_K=top_k,
            GATED=gated,
            ACTIVATION=ACTIVATION_CODES[activation],
            HAS_BIAS=bias is not None,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m,
            EVEN_K=k % tile.block_k == 0,
            SPLIT=splits > 1,
            A_FMT=A_FORMATS[a.dtype],
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        ),
    )


_mx_gemm = functools.partial(split_layer, gemm=_mx_launch)  # one layer (a _driver.Layer)


def _mx_tile(args: MoEApplyArgs) -> Tile:
    return pick_tile(args.topk_ids.numel(), args.w13.shape[0], vendor_of(args.x.device), "mxfp4_dot")


def _mx_operands(args: MoEApplyArgs) -> PreparedMx:
    """The plan's prepared operands, or the public weights as the kernel reads them."""
    prepared = args.prepared if isinstance(args.prepared, PreparedMx) else None
    return prepared or PreparedMx(mx_operand(args.w13), mx_operand(args.w2))


def fused_moe_mx(args: MoEApplyArgs, tile: Tile | None = None, splits: int | None = None) -> None:
    """Run the MoE for ``args`` (writes ``args.out``); ``tile`` overrides the ``mxfp4_dot``
    table, ``splits`` the split-K rule (both layers)."""
    run_layers(args, _mx_operands(args), tile or _mx_tile(args), _mx_gemm, splits)


def run_layers(
    args: MoEApplyArgs, ops: Any, tile: Tile, layer: Layer, splits: int | None, w2_tile: Tile | None = None
) -> None:
    """:func:`._driver.run_moe` on the operands ``ops.w13`` / ``ops.w2`` with ``layer``, its K
    splits forced to ``splits`` unless None (the rule); layer 2 on ``w2_tile`` (None: ``tile``,
    :func:`._driver.layer2_tile`)."""
    layer = layer if splits is None else functools.partial(layer, splits=splits)
    run_moe(args, ops.w13, ops.w2, tile, layer, w2_tile=w2_tile)


def bind_layers(
    args: MoEApplyArgs,
    ops: Any,
    tile: Tile,
    gemm: GemmLaunch,
    splits: int | None = None,
    w2_tile: Tile | None = None,
) -> Runner:
    """The runner of :func:`run_layers` with ``split_layer(gemm=gemm)`` for ``args``' token
    count (``MoEPlan``'s ``bind``): :func:`._driver.bind_moe` over :func:`split_launches`, K
    splits decided here, once (split partials among the workspaces); layer 2 on ``w2_tile``
    (None: ``tile``)."""
    return bind_moe(args, ops.w13, ops.w2, tile, functools.partial(split_launches, gemm, splits=splits), w2_tile)


def bind_fused_moe_mx(args: MoEApplyArgs, tile: Tile | None = None, splits: int | None = None) -> Runner | None:
    """The ``bind`` hook (``MoEPlan``): :func:`bind_layers` of :func:`fused_moe_mx` (``tile``
    and ``splits`` as there). None (``fn`` serves) above :data:`.fused.BIND_MAX_TOKENS` tokens
    and with ``activation_quant``."""
    if args.topk_ids.shape[0] > BIND_MAX_TOKENS or args.activation_quant is not None:
        return None
    return bind_layers(args, _mx_operands(args), tile or _mx_tile(args), _mx_launch, splits)


def dot_scaled_missing() -> str | None:
    """``available`` hook: why ``tl.dot_scaled`` cannot run here, else None."""
    if not hasattr(tl, "dot_scaled"):
        return f"triton {triton.__version__} has no tl.dot_scaled"
    return None


def mxfp4_predicate(reason: str) -> Callable[[Request], str | None]:
    """A predicate for MXFP4 weights only (``reason`` when the request has others) within the
    expert bound of the permutation."""

    def predicate(request: Request) -> str | None:
        return experts_predicate(request) if "mxfp4" in request.features else reason

    return predicate


mx_predicate = mxfp4_predicate("MXFP4 weights only (tl.dot_scaled e2m1 main loop)")


# Registration metadata (data). Above triton_fused_moe: measured correct and faster (H100).
MX_REGISTRATION = {
    "solution": "triton",
    # GPUs only: Triton's interpreter (the CPU) cannot run tl.dot_scaled.
    "vendors": ("cuda", "rocm"),
    "capabilities": ("bf16",),
    "dtypes": {"x": tuple(A_FORMATS), "weight": (torch.uint8,)},
    "features": ("silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4"),
    "priority": Priority.PORTABLE + 10,
    "predicate": mx_predicate,
    "available": dot_scaled_missing,
    "prepare": prepare_moe_mx,
    "bind": bind_fused_moe_mx,
}


@register_kernel("moe.apply", name="triton_fused_moe_mx", **MX_REGISTRATION)
def triton_fused_moe_mx(args: MoEApplyArgs) -> None:
    """Grouped-GEMM MoE with a tl.dot_scaled MXFP4 main loop and split-K decode (GPU only)."""
    fused_moe_mx(args)
