"""Triton fused MoE (``moe.apply``): permutation, two grouped GEMMs, combine; four launches.

1. :func:`._routing.sort_by_expert`: pairs grouped by local expert, tile-padded, on the device.
2. layer-1 grouped GEMM (``w13``) with bias and activation in the epilogue → intermediate.
3. layer-2 grouped GEMM (``w2``) with bias and routing weight in the epilogue → float32 rows.
4. :func:`._gemm.combine_kernel`: each token's rows summed in choice order. The combine is
   deterministic by construction (no atomics): the same inputs give bit-identical outputs.

No step reads a device value on the host, so a call can be captured in a CUDA graph. The
tile (decode vs prefill regime) is picked on the host from ``T * top_k / E`` (see
:mod:`._config`). Weights: x's dtype, fp8 e4m3 (per tensor / channel / 128x128 block) or
MXFP4, all dequantized in registers (weight-only: the MMAs run in x's dtype). The plan hook
:func:`prepare_moe` reorders MXFP4 bytes so that a 32-byte chunk decodes into two contiguous
32-value K tiles (no register shuffle; the functional path reads the standard layout with
even/odd-strided activation tiles instead) and stores the scales N-contiguous.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv, next_pow2, vendor_of
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs, Weight
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_triton._launcher import Launch, jit_launch
from tokenspeed_kernel_triton._runners import Built, RunnerCache
from tokenspeed_kernel_triton.ops.moe._common import (
    ACT_DTYPES,
    MAX_EXPERTS,
    VENDOR_CAPABILITIES,
    VENDORS,
    WEIGHT_DTYPES,
    dot_precision,
    interpreted,
)
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile
from tokenspeed_kernel_triton.ops.moe._driver import (
    Runner,
    bind_call,
    bind_moe,
    layer_output,
    moe_launches,
    run_moe,
    runner_key,
)
from tokenspeed_kernel_triton.ops.moe._gemm import FP8_BLOCK, FP8_ROW, MXFP4, PLAIN, fp8_quant_kernel, moe_gemm_kernel
from tokenspeed_kernel_triton.ops.moe._routing import Routing

__all__ = [
    "BIND_MAX_TOKENS",
    "FEATURES",
    "Operand",
    "PreparedMoE",
    "bind_fused_moe",
    "experts_predicate",
    "fused_moe",
    "prepare_moe",
    "triton_fused_moe",
]


@dataclass(frozen=True)
class Operand:
    """A weight as the GEMM kernel reads it.

    Attributes:
        data: ``[E, N, K]`` values (x's dtype or float8_e4m3fn), or MXFP4 ``packed`` uint8
            ``[E, N, K/2]``; last-dim contiguous.
        scale: float32 fp8 scales (``[E, 1, 1]``, ``[E, N, 1]``, ``[E, N/128, K/128]``), uint8
            E8M0 MXFP4 scales of logical shape ``[E, N, K/32]`` (any strides), or None.
        fmt: ``PLAIN``, ``FP8_ROW``, ``FP8_BLOCK`` or ``MXFP4`` (see :mod:`._gemm`).
        scale_strides: element strides of ``scale`` along (E, N, K); zeros when unused.
        mx_halves: MXFP4 only: ``data`` is in the planned "halves" byte order (within each
            64-value K group, byte j holds value j in its low nibble and value 32 + j in its
            high nibble) instead of the standard one (values 2j and 2j + 1).
        mx_words: MXFP4 only: ``scale`` is the planned int32 ``[E, ceil(K/128), N]``: byte j
            (little-endian) of word ``[e, b, n]`` is the E8M0 scale of values
            ``[128 b + 32 j, 128 b + 32 j + 32)`` of row n (127 past the end).
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    fmt: int
    scale_strides: tuple[int, int, int]
    mx_halves: bool = False
    mx_words: bool = False


@dataclass(frozen=True)
class PreparedMoE:
    """What :func:`prepare_moe` makes of the weights for :meth:`MoEPlan.apply`."""

    w13: Operand
    w2: Operand


def _to_halves(packed: torch.Tensor) -> torch.Tensor:
    """Standard MXFP4 bytes ``[E, N, K/2]`` (``K % 64 == 0``) → the "halves" order, one
    expert at a time (bounded temporary memory)."""
    out = torch.empty_like(packed)
    for e in range(packed.shape[0]):
        codes = torch.stack([packed[e] & 15, packed[e] >> 4], dim=-1).reshape(packed.shape[1], -1, 64)
        out[e] = (codes[..., :32] | (codes[..., 32:] << 4)).reshape(packed.shape[1], -1)
    return out


def _scale_words(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales uint8 ``[E, N, G]`` → int32 ``[E, ceil(G/4), N]``, 4 scales per word."""
    e, n, g = scales.shape
    padded = torch.full((e, n, -(-g // 4) * 4), 127, dtype=torch.uint8, device=scales.device)
    padded[..., :g] = scales
    words = padded.view(e, n, -1, 4).permute(0, 2, 1, 3).contiguous()
    return words.view(torch.int32).view(e, -1, n)


def _operand(w: Weight, *, repack: bool = False) -> Operand:
    if isinstance(w, MXFP4Weight):
        if not repack:
            return Operand(w.packed, w.scales, MXFP4, tuple(w.scales.stride()))
        if w.shape[-1] % 64:
            return Operand(w.packed, w.scales, MXFP4, tuple(w.scales.stride()))
        words = _scale_words(w.scales)
        return Operand(
            _to_halves(w.packed), words, MXFP4, (words.stride(0), words.stride(2), words.stride(1)), True, True
        )
    if isinstance(w, FP8Weight):
        granularity = w.granularity
        if granularity == "block":
            return Operand(w.data, w.scale, FP8_BLOCK, tuple(w.scale.stride()))
        stride_sn = 0 if granularity == "tensor" else w.scale.stride(1)
        return Operand(w.data, w.scale, FP8_ROW, (w.scale.stride(0), stride_sn, 0))
    return Operand(w, None, PLAIN, (0, 0, 0))


def prepare_moe(*, w13: Weight, w2: Weight, w13_bias=None, w2_bias=None, expert_map=None) -> PreparedMoE:
    """Plan hook: the weights as the kernel loads them fastest. MXFP4 (when ``K % 64 == 0``):
    bytes in the "halves" order, so each 32-byte row chunk decodes into two contiguous
    32-value K tiles with no register shuffle, and scales packed 4 to an int32 word per row
    and 128-value K step, so that the scale loads are wide enough to be pipelined. Other
    formats are used as given. Allocates the repacked copies; inputs are untouched."""
    return PreparedMoE(_operand(w13, repack=True), _operand(w2, repack=True))


def quantize_fp8_rows(a: torch.Tensor, group: int, routing: Routing | None = None):
    """``a [R, K]`` → (float8_e4m3fn ``[R, K]``, float32 scales ``[R, G]``) by
    :func:`._gemm.fp8_quant_kernel`: per row (``group=0``, ``G = 1``) or per row and
    ``group``-value K group. With ``routing`` the rows are sorted slots and padding slots are
    skipped (their outputs are left uninitialized; the GEMM never reads them)."""
    rows, k = a.shape
    groups = 1 if group == 0 else cdiv(k, group)
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty((rows, groups), dtype=torch.float32, device=a.device)
    if rows:
        ids = routing.sorted_ids if routing is not None else s
        jit_launch(
            fp8_quant_kernel,
            (rows, groups),
            a,
            q,
            s,
            ids,
            0 if routing is None else routing.num_pairs,
            k,
            a.stride(0),
            q.stride(0),
            s.stride(0),
            GROUP=group,
            BLOCK=group or min(1024, next_pow2(k)),
            HAS_IDS=routing is not None,
            INTERPRET=interpreted(a.device),
            num_warps=4,
        )
    return q, s


def _gemm_launch(
    a,
    op: Operand,
    bias,
    routing: Routing,
    weights,
    out,
    a_scale=None,
    *,
    n,
    k,
    top_k,
    tile: Tile,
    gated,
    activation,
    atomic=False,
) -> Launch:
    """The launch of one grouped GEMM layer into ``out`` (argument positions: ``a`` 0,
    ``weights`` 8); ``a_scale``: float32 per-row (group) scales of an fp8 ``a``."""
    mx = op.fmt == MXFP4
    block_k = 64 if mx else tile.block_k  # MXFP4 steps over 64-value groups
    grid = (routing.tiles_bound * cdiv(n, tile.block_n),)
    fp8_act = a_scale is not None
    return Launch(
        moe_gemm_kernel,
        grid,
        (
            a,
            op.data,
            op.data if op.scale is None else op.scale,
            op.data if bias is None else bias,
            out,
            routing.sorted_ids,
            routing.tile_expert,
            routing.num_tiles,
            weights,
            out if a_scale is None else a_scale,
            routing.num_pairs,
            n,
            k,
            routing.tiles_bound,
            a.stride(0),
            op.data.stride(0),
            op.data.stride(1),
            op.data.stride(2),
            *op.scale_strides,
            0 if bias is None else bias.stride(0),
            out.stride(-2),
            *((0, 0) if a_scale is None else a_scale.stride()),
        ),
        dict(
            TOP_K=top_k,
            FORMAT=op.fmt,
            GATED=gated,
            ACTIVATION=ACTIVATION_CODES[activation],
            HAS_BIAS=bias is not None,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=block_k,
            GROUP_M=tile.group_m,
            EVEN_K=k % (128 if op.mx_words else 64 if mx else block_k) == 0,
            INTERPRET=interpreted(a.device),
            DOT_PREC=None if fp8_act else dot_precision(a.dtype),
            MX_HALVES=op.mx_halves,
            MX_BF16=mx and a.dtype == torch.bfloat16,
            MX_WORDS=op.mx_words,
            ATOMIC=atomic,
            A_FP8=fp8_act,
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        ),
    )


def _gemm(
    a,
    op: Operand,
    bias,
    routing: Routing,
    weights,
    *,
    n,
    k,
    top_k,
    tile: Tile,
    gated,
    activation,
    combine_into=None,
    fp8_act=False,
):
    """One grouped GEMM layer (a :data:`Layer`): the intermediate ``[tiles * BLOCK_M, n]`` in
    a's dtype (``gated``) or float32 rows ``[1, P, n]`` (one split); with ``combine_into``
    (w2, ``combine="atomic"``) the weighted rows are atomically added into it instead.
    ``fp8_act`` (FP8 weights): ``a`` is quantized per token (per 128-value K group for block
    scales) first and the main loop runs fp8 x fp8."""
    out = layer_output(a, routing, n, tile, gated=gated) if combine_into is None else combine_into
    a_scale = None
    if fp8_act:
        if op.fmt not in (FP8_ROW, FP8_BLOCK):
            raise ValueError("activation_quant='fp8' needs FP8 weights")
        a, a_scale = quantize_fp8_rows(a, 128 if op.fmt == FP8_BLOCK else 0, None if gated else routing)
    _gemm_launch(
        a,
        op,
        bias,
        routing,
        weights,
        out,
        a_scale,
        n=n,
        k=k,
        top_k=top_k,
        tile=tile,
        gated=gated,
        activation=activation,
        atomic=combine_into is not None,
    )()
    return out


def _operands(args: MoEApplyArgs) -> PreparedMoE:
    """The plan's prepared operands, or the public weights as the kernel reads them."""
    prepared = args.prepared if isinstance(args.prepared, PreparedMoE) else None
    return prepared or PreparedMoE(_operand(args.w13), _operand(args.w2))


def _tile(args: MoEApplyArgs, ops: PreparedMoE) -> Tile:
    weights = "mxfp4" if ops.w13.fmt == MXFP4 else "plain"
    return pick_tile(args.topk_ids.numel(), args.w13.shape[0], vendor_of(args.x.device), weights, args.x.element_size())


def fused_moe(args: MoEApplyArgs, tile: Tile | None = None, combine: str = "reduce") -> None:
    """Run the four launches for ``args`` (writes ``args.out``); ``tile`` overrides the table.
    ``combine``: ``"reduce"`` (default: the deterministic combine kernel) or ``"atomic"`` (the
    weighted combine fused into the w2 epilogue with float32 atomics; both timed on an H100 in
    docs/history.md, "fp8 activations and the two combine modes")."""
    ops = _operands(args)
    tile = tile or _tile(args, ops)
    layer = functools.partial(_gemm, fp8_act=True) if args.activation_quant == "fp8" else _gemm
    run_moe(args, ops.w13, ops.w2, tile, layer, combine)


# Plan runs are bound up to this many tokens (decode and small batches, where the host time of
# four launches is most of a call); above it ``fn`` serves, as the workspaces a runner keeps
# grow with T (the w2 rows alone are T * top_k * H float32).
BIND_MAX_TOKENS = 64


def _gemm_launches(a, op: Operand, bias, routing: Routing, weights, *, n, k, top_k, tile: Tile, gated, activation):
    """One layer as data (a :class:`._driver.LayerLaunches`): its output and its one launch."""
    out = layer_output(a, routing, n, tile, gated=gated)
    launch = _gemm_launch(
        a, op, bias, routing, weights, out, n=n, k=k, top_k=top_k, tile=tile, gated=gated, activation=activation
    )
    return out, (launch,)


def bind_fused_moe(args: MoEApplyArgs) -> Runner | None:
    """The ``bind`` hook (``MoEPlan``): the four launches of :func:`fused_moe` for this token
    count, bound once by :func:`._driver.bind_moe` (the permutation buffers, the intermediate
    and the w2 rows as workspaces); a call then launches with its x, routing and out. None
    (``fn`` serves) above :data:`BIND_MAX_TOKENS` tokens and with ``activation_quant`` (a
    quantization launch)."""
    if args.topk_ids.shape[0] > BIND_MAX_TOKENS or args.activation_quant is not None:
        return None
    ops = _operands(args)
    return bind_moe(args, ops.w13, ops.w2, _tile(args, ops), _gemm_launches)


# --- functional calls: one runner per key (``_driver.runner_key``), every tensor of the call
# passed per run (``_driver.bind_call``); a plan's calls (``prepared`` set) never use it.


def _build(args: MoEApplyArgs) -> Built:
    ops = _operands(args)
    return moe_launches(args, ops.w13, ops.w2, _tile(args, ops), _gemm_launches)


# Functional calls' runners, by the MoE runner key (repeating across layers and steps).
_RUNNERS = RunnerCache("triton_fused_moe", runner_key, functools.partial(bind_call, _build), fused_moe)


FEATURES = (
    "silu",
    "gelu",
    "swiglu_oai",
    "bias",
    "expert_map",
    "mxfp4",
    "fp8_per_tensor",
    "fp8_per_channel",
    "fp8_block",
    "fp8_act",
)


def experts_predicate(request: Request) -> str | None:
    """Reject more local experts than the permutation's histogram holds."""
    experts = request.shape("num_experts")
    if experts is not None and experts > MAX_EXPERTS:
        return f"num_experts={experts} exceeds {MAX_EXPERTS} (the permutation keeps one histogram bin per expert)"
    return None


@register_kernel(
    "moe.apply",
    name="triton_fused_moe",
    solution="triton",
    vendors=VENDORS,
    vendor_capabilities=VENDOR_CAPABILITIES,
    dtypes={"x": ACT_DTYPES, "weight": WEIGHT_DTYPES},
    features=FEATURES,
    priority=Priority.PORTABLE,
    predicate=experts_predicate,
    prepare=prepare_moe,
    bind=bind_fused_moe,
)
def triton_fused_moe(args: MoEApplyArgs) -> None:
    """Grouped-GEMM MoE: device-side permutation, w13 GEMM + bias + activation, w2 GEMM + bias
    + routing weight, deterministic combine; decode/prefill tiles chosen by rows per expert.
    A functional call (no ``prepared`` weights, no activation quantization) runs the runner
    cached for its key (:data:`_RUNNERS`), every tensor passed per run."""
    if args.prepared is None and args.activation_quant is None:
        _RUNNERS(args)
    else:
        fused_moe(args)
