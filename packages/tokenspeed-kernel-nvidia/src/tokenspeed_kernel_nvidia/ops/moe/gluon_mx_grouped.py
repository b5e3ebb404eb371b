"""PROTOTYPE host side of :mod:`._gluon_mx_grouped_kernel` (layer 2 of the MXFP4 MoE on sm_90,
warp-specialized Gluon; not registered, reached only by calling :func:`launch_w2_grouped`).

Inputs are the shipped Triton path's own: the prepared weight
(:class:`tokenspeed_kernel_triton.ops.moe.fused_mx_swap.SwapOperand`: words int32 ``[E, S, N,
16]``, scale words int32 ``[E, S, N]``, no repack: TMA reads the words as ``[E * S * N, 16]``
rows of 64 bytes and the scales as ``[E * S, N]``, which needs ``N % 4 == 0``: 16-byte row
pitch) and the permutation (:class:`tokenspeed_kernel_triton.ops.moe._routing.Routing` built
with ``block_m = 128``) with the sorted intermediate whose tile ``t`` is rows ``[128 t, 128 t +
128)``.

:func:`emulate_w2_grouped` computes on the CPU what the kernel computes (the same work list,
the weight decoded from the same words with the same masks and shifts, bf16 values, float32
sums), for tests against a float64 reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import cdiv

__all__ = [
    "GroupedW2Config",
    "check_w2_grouped",
    "decode_swap_words",
    "emulate_w2_grouped",
    "launch_w2_grouped",
    "shared_layouts",
]

TILE = 128  # activation rows per tile and weight rows per work item (the kernel's BLOCK_M, BLOCK_N)


@dataclass(frozen=True)
class GroupedW2Config:
    """Launch options: ``stages`` ring depth (40.5 KB each), ``pingpong`` the consumer turn
    hand-off, the ``setmaxnreg`` split (``2 * consumer_regs + producer_regs <= 3 * maxnreg``,
    ``3 * 128 * maxnreg <= 65536``)."""

    stages: int = 4
    pingpong: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168

    def __post_init__(self) -> None:
        if not 2 <= self.stages <= 5:
            raise ValueError(f"GroupedW2Config.stages={self.stages}: 2..5 fit in shared memory")
        if 3 * 128 * self.maxnreg > 65536:
            raise ValueError(f"GroupedW2Config.maxnreg={self.maxnreg} x 384 threads exceeds 65536 registers")
        if 2 * self.consumer_regs + self.producer_regs > 3 * self.maxnreg:
            raise ValueError(
                f"GroupedW2Config: 2 x consumer_regs={self.consumer_regs} + producer_regs={self.producer_regs} "
                f"exceeds 3 x maxnreg={self.maxnreg}"
            )

    @property
    def tag(self) -> str:
        return f"s{self.stages}{'p' if self.pingpong else ''}-r{self.consumer_regs}.{self.producer_regs}.{self.maxnreg}"

    def constexprs(self, big_scales: bool) -> dict:
        """The kernel's constexpr arguments (layouts included)."""
        from tokenspeed_kernel_nvidia.ops.moe._gluon_mx_grouped_kernel import a_layout, acc_layout, word_layout

        return {
            "STAGES": self.stages,
            "WL": word_layout(),
            "AL": a_layout(),
            "ACC": acc_layout(),
            "BIG_SCALES": big_scales,
            "PINGPONG": self.pingpong,
            "CONSUMER_REGS": self.consumer_regs,
            "PRODUCER_REGS": self.producer_regs,
        }


def shared_layouts():
    """(activations, words, scales) NVMMA shared layouts of the three TMA boxes: ``[128, 128]``
    bf16 with the 128-byte swizzle, ``[128, 16]`` and ``[1, 128]`` int32 unswizzled (the words'
    reads are conflict-free without it: a warp reads 512 contiguous bytes)."""
    from triton.experimental.gluon import language as gl

    plain = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return gl.NVMMASharedLayout.get_default_for([TILE, TILE], gl.bfloat16), plain, plain


def check_w2_grouped(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, sorted_ids: torch.Tensor,
                     tile_expert: torch.Tensor, num_tiles: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
    """ValueError/TypeError naming the argument for anything the kernel cannot take (shapes of
    :func:`launch_w2_grouped`)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1:
        raise TypeError(f"x must be a row-major bf16 [rows, K] tensor, got {x.dtype} {tuple(x.shape)}")
    if words.dtype != torch.int32 or words.dim() != 4 or words.shape[3] != 16 or not words.is_contiguous():
        raise ValueError(f"words must be contiguous int32 [E, S, N, 16], got {words.dtype} {tuple(words.shape)}")
    e, s, n, _ = words.shape
    if scales.dtype != torch.int32 or tuple(scales.shape) != (e, s, n) or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous int32 {(e, s, n)}, got {scales.dtype} {tuple(scales.shape)}")
    if n % 4:
        raise ValueError(f"words: N={n} must be a multiple of 4 (the scale rows' TMA pitch)")
    if cdiv(x.shape[1], TILE) != s or (x.shape[1] * 2) % 16:
        raise ValueError(f"x: K={x.shape[1]} must give S={s} steps of 128 and a 16-byte row pitch")
    if x.shape[0] % TILE:
        raise ValueError(f"x: rows={x.shape[0]} must be whole 128-row tiles")
    tiles = x.shape[0] // TILE
    for name, t, size in (("sorted_ids", sorted_ids, tiles * TILE), ("tile_expert", tile_expert, tiles),
                          ("num_tiles", num_tiles, 1)):  # fmt: skip
        if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < size:
            raise ValueError(f"{name} must be int32 [>= {size}], got {t.dtype} {tuple(t.shape)}")
    if out.dtype != torch.float32 or out.dim() != 2 or out.shape[1] != n or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [pairs, {n}], got {out.dtype} {tuple(out.shape)}")


def launch_w2_grouped(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, big_scales: bool,
                      sorted_ids: torch.Tensor, tile_expert: torch.Tensor, num_tiles: torch.Tensor,
                      out: torch.Tensor, cfg: GroupedW2Config | None = None, programs: int | None = None) -> None:  # fmt: skip
    """``out[p, n] = sum_k x[slot(p), k] * W2[e, n, k]`` for every pair ``p < out.shape[0]``
    in a used tile (sm_90 GPU; other rows of ``out`` untouched).

    x: bf16 ``[tiles_bound * 128, K]`` (sorted intermediate; tile ``t`` = rows ``[128 t, +128)``);
    words / scales / big_scales: a ``SwapOperand``'s fields (int32 ``[E, S, N, 16]`` / ``[E, S,
    N]``); sorted_ids int32 ``[>= tiles_bound * 128]`` (pair per slot, ``>= out.shape[0]`` for
    padding), tile_expert int32 ``[>= tiles_bound]``, num_tiles int32 ``[1]`` (a ``Routing`` at
    ``block_m = 128``); out float32 ``[pairs, N]``. ``programs``: the persistent grid (default
    the SM count)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tokenspeed_kernel_nvidia.ops.moe._gluon_mx_grouped_kernel import mx_grouped_w2_kernel

    check_w2_grouped(x, words, scales, sorted_ids, tile_expert, num_tiles, out)
    cfg = cfg or GroupedW2Config()
    e, s, n, _ = words.shape
    x_l, w_l, s_l = shared_layouts()
    x_desc = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [TILE, TILE], x_l)
    w_flat = words.view(e * s * n, 16)
    w_desc = TensorDescriptor(w_flat, list(w_flat.shape), [16, 1], [TILE, 16], w_l)
    s_flat = scales.view(e * s, n)
    s_desc = TensorDescriptor(s_flat, list(s_flat.shape), [n, 1], [1, TILE], s_l)
    grid = programs or torch.cuda.get_device_properties(x.device).multi_processor_count
    mx_grouped_w2_kernel[(grid,)](
        x_desc, w_desc, s_desc, out, sorted_ids, tile_expert, num_tiles, out.shape[0], n, s,
        **cfg.constexprs(big_scales), num_warps=4, maxnreg=cfg.maxnreg,
    )  # fmt: skip


_PLACE = 0x81C081C0
_HIGH_BIAS = 2.0**126


def _as_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> the float32 of each pattern."""
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _placed_floats(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 bf16x2 patterns (32-bit) -> their two halves as float32 (low, high)."""
    return _as_f32((p & 0xFFFF) << 16), _as_f32(p & 0xFFFF0000)


def decode_swap_words(words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's decode on the CPU: words int32 ``[E, S, N, 16]`` and scale words int32
    ``[E, S, N]`` -> float32 ``[E, N, 128 S]`` (K order; padding K zeros), each value rounded
    to bf16 as the kernel's packed multiply leaves it. Same masks and shifts as
    ``_gluon_mx_grouped_kernel._decode``; the scale ``2 ** (e - 127)`` (0 -> ``2 ** -127``,
    255 -> NaN) applied in float32 to the placed ``value * 2 ** -126``."""
    e_, s_, n_, _ = words.shape
    w = (words.to(torch.int64) & 0xFFFFFFFF).view(e_, s_, n_, 4, 4)  # [.., q, i]
    group = torch.arange(4, device=words.device).view(1, 1, 1, 1, 4)
    ex = ((scales.to(torch.int64) & 0xFFFFFFFF).view(e_, s_, n_, 1, 1) >> (8 * group)) & 0xFF  # [.., 1, i]
    scale = torch.where(ex == 255, float("nan"), torch.exp2(ex.to(torch.float32) - 127.0))
    mask = 0xFFFFFFFF
    slots = (
        w & _PLACE,
        (w << 3) & mask & _PLACE,
        (w << 6) & mask & _PLACE,
        ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000),
    )
    vals = []
    for p in slots:
        lo, hi = _placed_floats(p)
        vals.append(torch.stack([lo, hi], -1) * _HIGH_BIAS * scale.unsqueeze(-1))  # [.., q, i, nibble]
    x = torch.stack(vals, -1).view(e_, s_, n_, 4, 4, 2, 2, 2)  # [.., q, i, nibble, tj, h]: t = 2 tj + h
    x = x.permute(0, 2, 1, 4, 6, 7, 3, 5)  # [e, n, s, i, tj, h, q, nibble]
    return x.reshape(e_, n_, s_ * 128).to(torch.bfloat16).to(torch.float32)


def emulate_w2_grouped(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, sorted_ids: torch.Tensor,
                       tile_expert: torch.Tensor, num_tiles: int, num_pairs: int) -> torch.Tensor:  # fmt: skip
    """What :func:`launch_w2_grouped` writes, on the CPU: float32 ``[num_pairs, N]`` (rows of
    pairs in no used tile stay 0). Arguments as there (``num_tiles`` a Python int)."""
    w = decode_swap_words(words, scales)
    k = x.shape[1]
    out = torch.zeros(num_pairs, words.shape[2], dtype=torch.float32)
    for tile in range(num_tiles):
        rows = slice(tile * TILE, (tile + 1) * TILE)
        acc = w[int(tile_expert[tile]), :, :k] @ x[rows].to(torch.float32).T  # [N, 128]: the kernel's acc
        pairs = sorted_ids[rows].long()
        ok = pairs < num_pairs
        out[pairs[ok]] = acc.T[ok]
    return out
