"""Triton fused MoE with the MXFP4 weight as the MMA's left operand: ``triton_fused_moe_mx_swap``.

The five launches of :mod:`.fused_mx` (permutation, w13 GEMM + bias + activation, w2 GEMM +
bias + routing weight, combine; host driver :func:`._driver.run_moe`, split-K and its finish
kernel from :func:`.fused_mx.split_layer`), with :func:`._mx_swap_gemm.moe_mx_swap_gemm_kernel`
as the grouped GEMM: it computes each output tile transposed (weight rows x tokens), decodes
E2M1 itself with masks, shifts and packed bf16 multiplies, and hands the decoded weight to
``tl.dot`` as its left operand. MXFP4 weights and bf16 activations only.

Why (sm_90, Triton 3.6; AOT inspection in ``test_aot_compile_moe.py``): Triton already lowers
``triton_fused_moe_mx``'s ``tl.dot_scaled`` to a wgmma whose A operand is the upcast weight in
registers (it transposes the product itself), so operand placement is not what costs. Its
main loop spends ~9 SASS instructions per weight value: the packed bytes are read from shared
memory one byte at a time, the e2m1 lookup is a chain of byte permutes, the scales take a
layout conversion through shared memory with barriers and are loaded synchronously each step,
and the scale is applied by scalar bf16 multiplies. Here the plan stores each weight row so a
thread's 16 bytes of a step are contiguous and already in wgmma's A-fragment order (two 16-byte
shared loads per row), bit-arranged so that masks and shifts place each pair of values as a
bf16x2 pattern (:mod:`._mx_swap_gemm`), with the 4 scales of a step in one pipelined word.

- **Prepared weights** (:func:`prepare_moe_mx_swap`, the plan hook): int32 words ``[E, S, N,
  16]`` and scale words ``[E, S, N]`` (``S = ceil(K / 128)``; K padded with zero codes and
  scale 127): ``128 * S / K`` times the MXFP4 bytes (1.022 at K = 2880; at most 1.05 for any
  K >= 1920). The plan also reads, once, whether some scale exceeds 128 (``2**1``); if none
  does (as in trained weights) one packed multiply per two values suffices. The functional
  path (no plan) repacks on every call with torch operations (no host sync) and always takes
  the two-multiply decode.
- **Gating**: ``Priority.PERFORMANT``, above ``triton_fused_moe_mx`` and
  ``triton_moe_gemv_mx`` and below ``gluon_moe_mma_sm90`` (T <= 8) except in the 8-token
  bucket (``rank_when``: T = 5..8, first there), sm_90 only (inline PTX ``mul.rn.bf16x2``;
  tiles sized for wgmma). On an H100 (2026-11-27, ``bench moe.apply --preset gpt-oss-120b``
  through plans, docs/benchmarks.md), with the tiles of the sweep that day: 45.0 / 169.5 /
  546.1 / 748.0 µs / 2.65 ms at T = 1 / 8 / 64 / 512 / 4096, against OpenAI's ``matmul_ogs``
  (routing included) 1.80x / 1.29x / 1.17x / 1.30x / 0.88x; 1.6-2.4x ``triton_fused_moe_mx``;
  at T = 8 faster than ``gluon_moe_mma_sm90`` (184.5 vs 192.7 µs in one run with the earlier
  tile, 169.5 µs with today's), at T = 1 slower (48.8 vs 38.3 µs).
  Registered for sm_90 only, so never selected for CPU tensors (the interpreter); the tests
  run its kernel there directly (float32 decode path).
- **Tiles**: ``_config``'s ``mx_swap`` rows, layer 2's own where its row has one
  (``_config._W2_TILES``: 16 x 128 up to 4 rows per expert, layer 1 16 x 64; H200, T = 64:
  514.4 vs 528.8 µs with the shared tile, bitwise the same), same token rows in both layers.
  ``tile`` / ``w2_tile`` override them (:func:`fused_moe_mx_swap`).
- **Bound runs** (``bind`` hook :func:`bind_fused_moe_mx_swap`): :func:`.fused_mx.bind_layers`
  with this kernel's GEMM launch, on the plan's :class:`PreparedSwap` weights only, up to
  :data:`.fused.BIND_MAX_TOKENS` tokens and without ``activation_quant`` (else None: the
  registered function serves).
- **Without a plan** (functional ``moe_apply``) the registered kernel runs
  ``triton_fused_moe_mx``'s layers on the public layout: repacking every call would cost more
  than the swapped loop saves. :func:`fused_moe_mx_swap` itself repacks per call with torch
  operations (no host sync), which its tests and the CUDA-graph test use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv, vendor_of
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton.ops.moe._common import interpreted
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile
from tokenspeed_kernel_triton.ops.moe._driver import layer2_tile
from tokenspeed_kernel_triton.ops.moe._mx_swap_gemm import STEP_K, WORDS_PER_ROW, moe_mx_swap_gemm_kernel
from tokenspeed_kernel_triton.ops.moe._routing import Routing
from tokenspeed_kernel_triton.ops.moe.fused import BIND_MAX_TOKENS
from tokenspeed_kernel_triton.ops.moe.fused_mx import (
    MX_REGISTRATION,
    Runner,
    bind_layers,
    fused_moe_mx,
    mxfp4_predicate,
    run_layers,
    split_layer,
)

__all__ = [
    "SLOT_BITS",
    "SWAP_REGISTRATION",
    "PreparedSwap",
    "SwapOperand",
    "bind_fused_moe_mx_swap",
    "bindable_swap",
    "checked_swap_tile",
    "fused_moe_mx_swap",
    "prepare_moe_mx_swap",
    "swap_constexprs",
    "swap_operand",
    "swap_predicate",
    "swap_scales",
    "swap_strides",
    "swap_tensors",
    "swap_words",
    "triton_fused_moe_mx_swap",
]

NAME = "triton_fused_moe_mx_swap"
BIG_SCALE = 128  # E8M0 scales above this (2**1) need the two-multiply decode
# Destination bit in the int32 word of each bit of a slot's byte (bits 0-3: the low nibble's
# magnitude (0-2) and sign (3), bits 4-7: the high nibble's), per slot t = 0..3 (see
# :mod:`._mx_swap_gemm`: slots 0-2 are the placed bf16x2 pattern shifted right by 3 t).
SLOT_BITS: tuple[tuple[int, ...], ...] = (
    *(tuple(b - 3 * t for b in (6, 7, 8, 15, 22, 23, 24, 31)) for t in range(3)),
    (10, 11, 13, 14, 26, 27, 29, 30),
)


def _word_bytes(device: torch.device) -> torch.Tensor:
    """The public byte (of a step's 64) in word ``4 q + i``, slot ``t = 2 tj + h``:
    ``b = 8 (2 i + tj) + q + 4 h``, int64 ``[64]`` word-major. Built by device ops (no host
    copy: the functional path may run under CUDA-graph capture)."""
    q = torch.arange(4, device=device).view(4, 1, 1)
    i = torch.arange(4, device=device).view(1, 4, 1)
    t = torch.arange(4, device=device).view(1, 1, 4)
    return (16 * i + 8 * (t >> 1) + q + 4 * (t & 1)).flatten()


def _slot_bits(device: torch.device) -> torch.Tensor:
    """:data:`SLOT_BITS` as an int64 ``[4, 8]`` tensor, built by device ops."""
    bit = torch.arange(8, device=device)
    low, high = bit % 4, bit // 4
    t = torch.arange(4, device=device).view(4, 1)
    placed = torch.where(low < 3, low + 6, 15) + 16 * high - 3 * t
    last = low + 10 + (low >= 2).long() + 16 * high
    return torch.where(t < 3, placed, last)


@dataclass(frozen=True)
class SwapOperand:
    """An MXFP4 weight ``[E, N, K]`` as :func:`._mx_swap_gemm.moe_mx_swap_gemm_kernel` reads it.

    Attributes:
        words: int32 ``[E, S, N, 16]``, contiguous (:func:`swap_words`).
        scales: int32 ``[E, S, N]``, contiguous (:func:`swap_scales`).
        big_scales: some scale may exceed ``2**1`` (the two-multiply decode).
    """

    words: torch.Tensor
    scales: torch.Tensor
    big_scales: bool


@dataclass(frozen=True)
class PreparedSwap:
    """What :func:`prepare_moe_mx_swap` makes of the weights for :meth:`MoEPlan.apply`."""

    w13: SwapOperand
    w2: SwapOperand


def swap_words(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes uint8 ``[E, N, K/2]`` (low nibble = even k) → int32 words ``[E, S, N, 16]``
    (module docstring of :mod:`._mx_swap_gemm`); K is padded to ``128 S`` with zero codes.
    One expert at a time (int64 temporaries of ~24 bytes per weight byte); device operations
    only, no host sync."""
    e, n, half_k = packed.shape
    steps = cdiv(2 * half_k, STEP_K)
    order = _word_bytes(packed.device)
    dest = _slot_bits(packed.device).repeat(WORDS_PER_ROW, 1)  # [64 slots, 8 bits]
    words = torch.empty((e, steps, n, WORDS_PER_ROW), dtype=torch.int32, device=packed.device)
    for expert in range(e):
        rows = torch.nn.functional.pad(packed[expert], (0, steps * STEP_K // 2 - half_k)).view(n, steps, STEP_K // 2)
        slots = rows[..., order].long()  # [n, S, 64]: word-major (4 q + i), then slot
        bits = torch.zeros_like(slots)
        for b in range(8):  # every destination is distinct: OR = sum
            bits |= ((slots >> b) & 1) << dest[:, b]
        word = bits.view(n, steps, WORDS_PER_ROW, 4).sum(-1)
        words[expert] = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32).transpose(0, 1)
    return words


def swap_scales(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales uint8 ``[E, N, K/32]`` → int32 ``[E, S, N]``: byte ``i`` (little-endian) of
    word ``[e, s, n]`` is group ``4 s + i``; groups past K hold 127."""
    groups = scales.shape[-1]
    steps = cdiv(groups * 32, STEP_K)
    padded = torch.nn.functional.pad(scales, (0, 4 * steps - groups), value=127).contiguous()
    return padded.view(torch.int32).transpose(1, 2).contiguous()


def swap_operand(w: MXFP4Weight, *, check_scales: bool = False) -> SwapOperand:
    """The kernel's operand for ``w``. ``check_scales``: read (one host sync) whether a scale
    exceeds 128; otherwise assume it may (the two-multiply decode, always correct)."""
    if not isinstance(w, MXFP4Weight):
        raise TypeError(f"triton_fused_moe_mx_swap takes MXFP4 weights only, got {type(w).__name__}")
    big = bool((w.scales > BIG_SCALE).any()) if check_scales else True
    return SwapOperand(swap_words(w.packed), swap_scales(w.scales), big)


def prepare_moe_mx_swap(
    *, w13: MXFP4Weight, w2: MXFP4Weight, w13_bias=None, w2_bias=None, expert_map=None
) -> PreparedSwap:
    """Plan hook: both weights repacked (:func:`swap_operand`, scales checked once). Inputs are
    untouched."""
    return PreparedSwap(swap_operand(w13, check_scales=True), swap_operand(w2, check_scales=True))


def swap_tensors(
    a: torch.Tensor,
    op: SwapOperand,
    bias: torch.Tensor | None,
    routing: Routing,
    weights: torch.Tensor,
    out: torch.Tensor,
) -> tuple:
    """The arguments both swapped GEMMs take first (``A`` ... ``TopkWeights``: ``a`` at position
    0, ``weights`` at 8)."""
    bias_arg = op.words if bias is None else bias
    return (a, op.words, op.scales, bias_arg, out, routing.sorted_ids, routing.tile_expert, routing.num_tiles, weights)


def swap_strides(a: torch.Tensor, op: SwapOperand, bias: torch.Tensor | None, out: torch.Tensor) -> tuple:
    """``stride_am`` ... ``stride_om`` of both swapped GEMMs."""
    bias_stride = 0 if bias is None else bias.stride(0)
    return (a.stride(0), *op.words.stride()[:2], *op.scales.stride()[:2], bias_stride, out.stride(-2))


def swap_constexprs(
    a: torch.Tensor, op: SwapOperand, bias: torch.Tensor | None, *, top_k: int, tile: Tile, gated: bool, activation: str
) -> dict:
    """The constexprs and launch options both swapped GEMMs take."""
    return dict(
        TOP_K=top_k,
        GATED=gated,
        ACTIVATION=ACTIVATION_CODES[activation],
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BIG_SCALES=op.big_scales,
        INTERPRET=interpreted(a.device),
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def _swap_launch(
    a: torch.Tensor,
    op: SwapOperand,
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
    """The :class:`.fused_mx.GemmLaunch` of :func:`._mx_swap_gemm.moe_mx_swap_gemm_kernel`."""
    return Launch(
        moe_mx_swap_gemm_kernel,
        (routing.tiles_bound * cdiv(n, tile.block_n), splits),
        (
            *swap_tensors(a, op, bias, routing, weights, out),
            routing.num_pairs,
            n,
            k,
            routing.tiles_bound,
            k_split // STEP_K,
            *swap_strides(a, op, bias, out),
            out.stride(0) if out.dim() == 3 else 0,
        ),
        dict(
            swap_constexprs(a, op, bias, top_k=top_k, tile=tile, gated=gated, activation=activation),
            GROUP_M=tile.group_m,
            SPLIT=splits > 1,
        ),
    )


_swap_gemm = functools.partial(split_layer, gemm=_swap_launch)  # one layer (a _driver.Layer)


def checked_swap_tile(
    args: MoEApplyArgs, tile: Tile | None, pick: Callable[..., Tile], kernel: str, layer: int = 1
) -> Tile:
    """``tile``, else ``pick``'s (:func:`._config.pick_tile`) layer-``layer`` tile from the
    ``mxfp4_swap`` table; its ``block_k`` must be the swapped GEMM's step (``kernel`` names the
    caller in the error)."""
    if tile is not None and not isinstance(tile, Tile):
        raise TypeError(f"{kernel}: tile must be a Tile or None, got {type(tile).__name__}")
    tile = tile or pick(args.topk_ids.numel(), args.w13.shape[0], vendor_of(args.x.device), "mxfp4_swap", layer=layer)
    if tile.block_k != STEP_K:
        raise ValueError(f"{kernel} steps K by {STEP_K}: tile.block_k must be {STEP_K}, got {tile}")
    return tile


def _swap_tiles(args: MoEApplyArgs, tile: Tile | None, w2_tile: Tile | None) -> tuple[Tile, Tile]:
    """Both layers' tiles (:func:`checked_swap_tile` with this module's ``pick_tile``: the tile
    sweeps replace it): ``tile`` else the table's; layer 2 ``w2_tile``, else ``tile`` when given
    (both layers), else the table's layer-2 tile (its row's :data:`._config._W2_TILES` entry).
    ``ValueError`` before any launch when layer 2's ``block_m`` differs from layer 1's."""
    first = checked_swap_tile(args, tile, pick_tile, NAME)
    given = w2_tile if w2_tile is not None else tile
    second = checked_swap_tile(args, None if given is None else layer2_tile(first, given), pick_tile, NAME, layer=2)
    return first, layer2_tile(first, second)


def bindable_swap(args: MoEApplyArgs) -> PreparedSwap | None:
    """The plan's :class:`PreparedSwap` weights when a bound runner may serve ``args`` (up to
    :data:`.fused.BIND_MAX_TOKENS` tokens, no ``activation_quant``), else None."""
    prepared = args.prepared
    if (
        not isinstance(prepared, PreparedSwap)
        or args.topk_ids.shape[0] > BIND_MAX_TOKENS
        or args.activation_quant is not None
    ):
        return None
    return prepared


def fused_moe_mx_swap(
    args: MoEApplyArgs, tile: Tile | None = None, splits: int | None = None, w2_tile: Tile | None = None
) -> None:
    """Run the MoE for ``args`` (writes ``args.out``); ``tile`` overrides the ``mxfp4_swap``
    table for both layers and ``w2_tile`` for layer 2 (same ``block_m`` as layer 1's; every
    ``block_k`` must be 128; :func:`_swap_tiles`), ``splits`` the split-K rule (both layers)."""
    first, second = _swap_tiles(args, tile, w2_tile)
    prepared = args.prepared if isinstance(args.prepared, PreparedSwap) else None
    ops = prepared or PreparedSwap(swap_operand(args.w13), swap_operand(args.w2))
    run_layers(args, ops, first, _swap_gemm, splits, second)


def bind_fused_moe_mx_swap(
    args: MoEApplyArgs, tile: Tile | None = None, splits: int | None = None, w2_tile: Tile | None = None
) -> Runner | None:
    """The ``bind`` hook (``MoEPlan``): :func:`.fused_mx.bind_layers` of :func:`fused_moe_mx_swap`
    on the plan's :class:`PreparedSwap` weights (``tile``, ``splits`` and ``w2_tile`` as there).
    None (``fn`` serves) without them (``fn`` then runs ``triton_fused_moe_mx``'s layers), above
    :data:`.fused.BIND_MAX_TOKENS` tokens and with ``activation_quant``."""
    prepared = bindable_swap(args)
    if prepared is None:
        return None
    first, second = _swap_tiles(args, tile, w2_tile)
    return bind_layers(args, prepared, first, _swap_launch, splits, second)


swap_predicate = mxfp4_predicate("MXFP4 weights only (in-register E2M1 decode)")


# Registration metadata (data). PERFORMANT: on an H100 it passed float64 checks and was faster
# than triton_fused_moe_mx at every T measured, and than gluon_moe_mma_sm90 (PERFORMANT + 10)
# at T = 8 (module docstring): first in the 8-token bucket; its tiles: _config.py's sweep rows.
SWAP_REGISTRATION = {
    "solution": "triton",
    "vendors": ("cuda",),
    "archs": ("sm_90",),
    "capabilities": ("bf16", "wgmma"),
    "dtypes": {"x": (torch.bfloat16,), "weight": (torch.uint8,)},
    "features": MX_REGISTRATION["features"],
    "priority": Priority.PERFORMANT,
    "rank_when": ({"num_tokens_bucket": (8,)}, Priority.PERFORMANT + 20),
    "predicate": swap_predicate,
    "prepare": prepare_moe_mx_swap,
    "bind": bind_fused_moe_mx_swap,
}


@register_kernel("moe.apply", name=NAME, **SWAP_REGISTRATION)
def triton_fused_moe_mx_swap(args: MoEApplyArgs) -> None:
    """Grouped-GEMM MoE, MXFP4 weight decoded in registers as the wgmma A operand (sm_90),
    from the plan's repacked weights; without them, ``triton_fused_moe_mx``'s layers."""
    if isinstance(args.prepared, PreparedSwap):
        fused_moe_mx_swap(args)
    else:
        fused_moe_mx(args)
