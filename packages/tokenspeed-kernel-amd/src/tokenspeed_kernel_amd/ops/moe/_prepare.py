"""The ``moe_plan`` hook: MXFP4 weights pre-shuffled into the byte order the kernels read best.

"Halves" order, per weight row and 64-value K group ``g``: byte ``j`` (0..31) holds value
``64g + j`` in its low nibble and ``64g + 32 + j`` in its high nibble. The low nibbles of a
group's 32 bytes are then exactly E8M0 block ``2g`` (one scale) and the high nibbles block
``2g + 1``: the GEMV multiplies each half by one scale and the GEMM stores each half as a
contiguous 32-column LDS slice, with no register shuffle and contiguous activation loads.
Scales keep the public ``[E, N, K/32]`` layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel.quant import MXFP4Weight

__all__ = ["PreparedMoE", "from_halves", "prepare_moe", "to_halves"]


@dataclass(frozen=True)
class PreparedMoE:
    """What :func:`prepare_moe` makes of the weights: halves-ordered bytes, public scales.

    Attributes:
        w13_packed: uint8 ``[E, 2I, H/2]`` (halves order). w13_scales: uint8 ``[E, 2I, H/32]``.
        w2_packed: uint8 ``[E, H, I/2]`` (halves order). w2_scales: uint8 ``[E, H, I/32]``.
    """

    w13_packed: torch.Tensor
    w13_scales: torch.Tensor
    w2_packed: torch.Tensor
    w2_scales: torch.Tensor


def to_halves(packed: torch.Tensor) -> torch.Tensor:
    """Standard MXFP4 bytes ``[E, N, K/2]`` (``K % 64 == 0``) → halves order, one expert at a
    time (bounded temporary memory). The input is untouched."""
    if packed.shape[-1] % 32:
        raise ValueError(f"packed: K ({packed.shape[-1] * 2}) must be a multiple of 64 for the halves order")
    out = torch.empty_like(packed)
    for e in range(packed.shape[0]):
        codes = torch.stack([packed[e] & 15, packed[e] >> 4], dim=-1).reshape(packed.shape[1], -1, 64)
        out[e] = (codes[..., :32] | (codes[..., 32:] << 4)).reshape(packed.shape[1], -1)
    return out


def from_halves(halves: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_halves` (tests, debugging)."""
    out = torch.empty_like(halves)
    for e in range(halves.shape[0]):
        groups = halves[e].reshape(halves.shape[1], -1, 32)
        codes = torch.cat([groups & 15, groups >> 4], dim=-1)  # [N, G, 64] values in order
        pairs = codes.reshape(halves.shape[1], -1, 2)
        out[e] = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(halves.shape[1], -1)
    return out


def prepare_moe(*, w13, w2, w13_bias=None, w2_bias=None, expert_map=None) -> PreparedMoE:
    """Plan hook (``KernelSpec.prepare``): MXFP4 ``w13``/``w2`` → :class:`PreparedMoE`.
    Allocates the reordered copies on the weights' device; inputs are untouched."""
    if not isinstance(w13, MXFP4Weight) or not isinstance(w2, MXFP4Weight):
        raise TypeError("w13/w2: the AMD Gluon MoE kernels take MXFP4Weight weights")
    return PreparedMoE(to_halves(w13.packed), w13.scales, to_halves(w2.packed), w2.scales)
