"""The swapped MXFP4 MoE with persistent grouped GEMMs: ``triton_fused_moe_mx_swap_persistent``
(opt-in, sm_90; **not yet run on a GPU**).

:mod:`.fused_mx_swap`'s pipeline (permutation, w13 GEMM + bias + activation, w2 GEMM + bias +
routing weight, combine) on the same repacked weights (:func:`.fused_mx_swap.prepare_moe_mx_swap`:
the plan hook is shared), with :func:`._mx_swap_persistent.moe_mx_swap_persistent_kernel` as
both grouped GEMMs: ``programs_per_sm x`` the SM count programs (capped at the work items)
walk the permutation's work list of (expert, token tile, weight tile) items, weight-tile-major
within an expert, statically or from a counter, with an expert's last token tile computed at
``tail_m`` rows when it is that small (:class:`._config.Schedule`, :func:`._config.pick_schedule`).
The tile code, decode, rounding points and epilogues are the swapped kernel's
(:func:`._mx_swap_gemm.swap_tile`): each output element is the same K loop over the same
products (no split-K), so the outputs match the swapped kernel's (a tail tile's MMA is
narrower, which may reorder nothing within an element's sum but is not promised bitwise).

Why (issue 21): at T = 4096 the swapped kernel runs at 0.88x OpenAI's ``matmul_ogs`` (H100,
2026-11-27). The persistent grid keeps one 128 x 128 program per SM over ~4400 items per layer
instead of ~5900 programs (a third of them empty past the used tiles), loads each item's
coordinates one item ahead, and the tail tiles cut the MMA work of experts with a few rows in
their last tile (1.48x the useful work at T = 4096 with 128-row tiles).

- **Gating**: ``Priority.OPT_IN`` (chosen only by an override) except for token buckets from
  :data:`RANKED_FROM_TOKENS` up (``rank_when``, above the swapped kernel), where
  ``ci/device/mxp_sweep.py`` measured it faster (1.14x at T = 4096 on an H200; 0.90-0.96x at
  T = 64-1024). Every schedule passed against float64 there and was bitwise equal to the
  swapped kernel. Registered for sm_90 only (the swapped kernel's inline PTX); its CPU tests
  run the kernel under the interpreter directly.
- **Without a plan** the registered kernel runs ``triton_fused_moe_mx``'s layers, as the
  swapped kernel does; :func:`fused_moe_mx_swap_persistent` itself repacks per call.
- **Bound runs**: :func:`bind_fused_moe_mx_swap_persistent`, the swapped kernel's rules
  (:func:`.fused_mx_swap.bindable_swap`).
- ``Schedule.w2_tma``: layer 2's full token tiles read the intermediate by TMA
  (:mod:`._mx_swap_persistent`); the table's schedule above 48 rows per expert since the
  ``ci/device/mxp_sweep.py --group levers`` run of 2026-11-28 (H200, T = 4096: 2244.6 vs
  2309.5 µs, bitwise the pointer loads' output). The intermediate's rows are ``N`` bf16 values, a multiple of 32
  (MXFP4's K groups): always 16-byte aligned, as TMA needs.
"""

from __future__ import annotations

import functools

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from tokenspeed_kernel.kit import cdiv, sm_count
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_triton._launcher import Launch
from tokenspeed_kernel_triton.ops.moe._config import Schedule, Tile, pick_schedule, pick_tile
from tokenspeed_kernel_triton.ops.moe._mx_swap_gemm import STEP_K
from tokenspeed_kernel_triton.ops.moe._mx_swap_persistent import moe_mx_swap_persistent_kernel
from tokenspeed_kernel_triton.ops.moe._routing import Routing
from tokenspeed_kernel_triton.ops.moe.fused_mx import (
    DEFAULT_SMS,
    Runner,
    bind_layers,
    fused_moe_mx,
    run_layers,
    split_layer,
)
from tokenspeed_kernel_triton.ops.moe.fused_mx_swap import (
    SWAP_REGISTRATION,
    PreparedSwap,
    SwapOperand,
    bindable_swap,
    checked_swap_tile,
    swap_constexprs,
    swap_operand,
    swap_strides,
    swap_tensors,
)

__all__ = [
    "PERSISTENT_REGISTRATION",
    "RANKED_FROM_TOKENS",
    "bind_fused_moe_mx_swap_persistent",
    "check_schedule",
    "fused_moe_mx_swap_persistent",
    "persistent_grid",
    "triton_fused_moe_mx_swap_persistent",
]

NAME = "triton_fused_moe_mx_swap_persistent"


def check_schedule(schedule: Schedule, tile: Tile) -> None:
    """``ValueError`` naming the field when ``schedule`` cannot run with ``tile``."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule must be a Schedule, got {type(schedule).__name__}")
    tail = schedule.tail_m
    if tail and (tail < 16 or tail >= tile.block_m or tail & (tail - 1)):
        raise ValueError(f"schedule.tail_m must be 0 or a power of two in [16, block_m = {tile.block_m}), got {tail}")
    if schedule.programs_per_sm < 1:
        raise ValueError(f"schedule.programs_per_sm must be >= 1, got {schedule.programs_per_sm}")
    if schedule.programs is not None and schedule.programs < 1:
        raise ValueError(f"schedule.programs must be None or >= 1, got {schedule.programs}")


def persistent_grid(routing: Routing, n: int, tile: Tile, schedule: Schedule, device: torch.device) -> int:
    """Programs of one layer: ``schedule.programs``, else ``programs_per_sm`` x the SM count;
    at most the layer's work items bound (``tiles_bound x cdiv(n, block_n)``). Host shapes only."""
    wanted = schedule.programs or schedule.programs_per_sm * sm_count(device, default=DEFAULT_SMS)
    return max(1, min(wanted, routing.tiles_bound * cdiv(n, tile.block_n)))


def _persistent_launch(
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
    schedule: Schedule,
) -> Launch:
    """The :class:`.fused_mx.GemmLaunch` of :func:`._mx_swap_persistent.moe_mx_swap_persistent_kernel`
    (``splits`` must be 1; argument positions: ``a`` 0, ``weights`` 8). With ``schedule.w2_tma``,
    layer 2 also gets a TMA descriptor of ``a`` (the intermediate, ``[block_m, 128]`` blocks: a
    keyword argument, so the launch takes Triton's own path)."""
    if splits != 1:
        raise ValueError(f"{NAME} does not split K: splits must be 1, got {splits}")
    tma = {}
    if schedule.w2_tma and not gated:
        tma = dict(A_TMA=True, A_desc=TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [tile.block_m, STEP_K]))
    return Launch(
        moe_mx_swap_persistent_kernel,
        (persistent_grid(routing, n, tile, schedule, a.device),),
        (
            *swap_tensors(a, op, bias, routing, weights, out),
            routing.tile_span,
            routing.work_counters,
            routing.num_pairs,
            n,
            k,
            routing.tiles_bound,
            *swap_strides(a, op, bias, out),
        ),
        dict(
            swap_constexprs(a, op, bias, top_k=top_k, tile=tile, gated=gated, activation=activation),
            TAIL_M=schedule.tail_m,
            DYNAMIC=schedule.dynamic,
            K_STAGES=tile.num_stages,
            **tma,
        ),
    )


def _plan(
    args: MoEApplyArgs, tile: Tile | None, schedule: Schedule | None, splits: int | None
) -> tuple[Tile, Schedule]:
    """``tile`` and ``schedule``, else this module's ``pick_tile`` / ``pick_schedule`` (the
    device sweep replaces them), checked; ``splits`` must be None or 1 (no split-K). One tile for
    both layers: the table's layer-1 tile, not its layer-2 override (``_config._W2_TILES``, the
    swapped kernel's): ``schedule.programs_per_sm`` is sized for the occupancy of that one tile
    (the work list itself would take another ``block_n`` for layer 2; untimed)."""
    if splits not in (None, 1):
        raise ValueError(f"{NAME} does not split K: splits must be None or 1, got {splits}")
    tile = checked_swap_tile(args, tile, pick_tile, NAME)
    schedule = schedule or pick_schedule(args.topk_ids.numel(), args.w13.shape[0], tile)
    check_schedule(schedule, tile)
    return tile, schedule


def fused_moe_mx_swap_persistent(
    args: MoEApplyArgs, tile: Tile | None = None, splits: int | None = None, schedule: Schedule | None = None
) -> None:
    """Run the MoE for ``args`` (writes ``args.out``) with the persistent GEMMs: ``tile``
    overrides the ``mxfp4_swap`` table (``block_k`` 128), ``schedule`` :func:`._config.pick_schedule`;
    ``splits`` (the other MXFP4 kernels' K splits) must be None or 1. Weights: the plan's
    :class:`.fused_mx_swap.PreparedSwap`, else repacked here (device ops, no host sync)."""
    tile, schedule = _plan(args, tile, schedule, splits)
    prepared = args.prepared if isinstance(args.prepared, PreparedSwap) else None
    ops = prepared or PreparedSwap(swap_operand(args.w13), swap_operand(args.w2))
    layer = functools.partial(split_layer, gemm=functools.partial(_persistent_launch, schedule=schedule))
    run_layers(args, ops, tile, layer, 1)


def bind_fused_moe_mx_swap_persistent(
    args: MoEApplyArgs, tile: Tile | None = None, splits: int | None = None, schedule: Schedule | None = None
) -> Runner | None:
    """The ``bind`` hook (``MoEPlan``): the bound runner of :func:`fused_moe_mx_swap_persistent`
    on the plan's weights (arguments as there), or None (``fn`` serves) where
    :func:`.fused_mx_swap.bindable_swap` says so."""
    prepared = bindable_swap(args)
    if prepared is None:
        return None
    tile, schedule = _plan(args, tile, schedule, splits)
    return bind_layers(args, prepared, tile, functools.partial(_persistent_launch, schedule=schedule), 1)


# Registration metadata (data): the swapped kernel's, opt-in except from T = 4096 tokens, where
# it measured faster (ci/device/mxp_sweep.py, H200, 2026-11-27, GPT-OSS-120B layer, us per
# call): T = 4096 2302 vs triton_fused_moe_mx_swap 2631 (matmul_ogs+sort 2332); slower at
# T = 1024 (1136 vs 1084), 512 (772 vs 739) and 64 (588 vs 530). Larger buckets carry more items
# per program and were not timed; 2048 was not timed either, so it stays with the swapped kernel.
RANKED_FROM_TOKENS = 4096
PERSISTENT_REGISTRATION = {
    **SWAP_REGISTRATION,
    "priority": Priority.OPT_IN,
    "rank_when": (
        {"num_tokens_bucket": tuple(RANKED_FROM_TOKENS << i for i in range(6))},
        Priority.PERFORMANT + 5,
    ),
    "bind": bind_fused_moe_mx_swap_persistent,
}


@register_kernel("moe.apply", name=NAME, **PERSISTENT_REGISTRATION)
def triton_fused_moe_mx_swap_persistent(args: MoEApplyArgs) -> None:
    """The swapped MXFP4 MoE with persistent grouped GEMMs (sm_90) from the plan's repacked
    weights; without them, ``triton_fused_moe_mx``'s layers."""
    if isinstance(args.prepared, PreparedSwap):
        fused_moe_mx_swap_persistent(args)
    else:
        fused_moe_mx(args)
