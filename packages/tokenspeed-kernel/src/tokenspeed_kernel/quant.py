"""Quantized weight containers and their reference (de)quantizers.

Two formats, both quantized along the LAST axis (the reduction axis of ``x @ w.T``: ``H``
for ``w13 [E, 2I, H]``, ``I`` for ``w2 [E, H, I]``):

:class:`MXFP4Weight` (OCP Microscaling MXFP4)
    ``packed`` uint8 ``[..., N, K // 2]``: two E2M1 codes per byte, the LOW nibble holds the
    even element ``2i`` and the high nibble ``2i + 1``. An E2M1 code is sign (bit 3) and a
    magnitude index (bits 0-2) into ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``.
    ``scales`` uint8 ``[..., N, K // 32]``: one E8M0 scale per 32 consecutive values,
    value ``2 ** (s - 127)`` (255 is NaN). ``K`` must be a multiple of 32.

:class:`FP8Weight` (float8_e4m3fn with float32 scales, real = stored * scale)
    ``data`` float8_e4m3fn ``[..., N, K]`` and ``scale`` float32 whose shape states the
    granularity: ``[..., 1, 1]`` per tensor (one per expert matrix), ``[..., N, 1]`` per
    output channel, ``[..., ceil(N/128), ceil(K/128)]`` per 128x128 block.

Both are frozen dataclasses of tensors; kernels may keep repacked copies through a plan
(:func:`tokenspeed_kernel.moe_plan`) but the public layout above is the contract.

MXFP8 activations (``moe_apply(..., activation_quant="mxfp8")``) are not stored by callers:
:func:`quantize_mxfp8` is the one reference definition of how a GEMM operand is quantized
on the fly (float8_e4m3fn values, one E8M0 scale per 32 values along the last axis; the
rule is in its docstring), :func:`fake_quantize_mxfp8` the value a kernel then multiplies.
Likewise for per-token dynamic fp8 activations (``activation_quant="fp8"``, FP8 weights):
:func:`quantize_fp8_per_token` (one power-of-two float32 scale per row, or per row and
128-value K group for 128x128 block-scaled weights) and :func:`fake_quantize_fp8_per_token`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "E2M1_VALUES",
    "FP8_E4M3_MAX",
    "FP8_GRANULARITIES",
    "MXFP4_QUANT_BYTES_PER_VALUE",
    "MXFP8_BLOCK",
    "FP8Weight",
    "MXFP4Weight",
    "QuantizedWeight",
    "dequantize_fp8",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "fake_quantize_fp8_per_token",
    "fake_quantize_mxfp8",
    "quantize_fp8",
    "quantize_fp8_per_token",
    "quantize_mxfp4",
    "quantize_mxfp8",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_BLOCK = 32
FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128
FP8_GRANULARITIES = ("tensor", "channel", "block")
MXFP8_BLOCK = 32
E4M3_EMAX = 8  # floor(log2(448)): the largest exponent of a finite float8_e4m3fn
E4M3_MIN_EXP = -6  # the smallest normal exponent; below it the quantum is 2**-9
E8M0_MIN_EXP, E8M0_MAX_EXP, E8M0_NAN = -127, 127, 255
FP8_ACT_MIN_EXP, FP8_ACT_MAX_EXP = -100, 126  # the exponent range of per-token fp8 scales


@dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4 weight of logical shape ``[..., N, K]`` (see the module docstring)."""

    packed: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise TypeError(
                f"MXFP4Weight: packed and scales must be uint8, got {self.packed.dtype} and {self.scales.dtype}"
            )
        k = self.packed.shape[-1] * 2
        expected = (*self.packed.shape[:-1], k // MXFP4_BLOCK)
        if k % MXFP4_BLOCK or tuple(self.scales.shape) != expected:
            raise ValueError(
                f"MXFP4Weight: scales must have shape {expected} for packed {tuple(self.packed.shape)} "
                f"(one scale per {MXFP4_BLOCK} values), got {tuple(self.scales.shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (dequantized) shape."""
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def format(self) -> str:
        return "mxfp4"

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self, dtype)


@dataclass(frozen=True)
class FP8Weight:
    """An fp8 e4m3 weight of shape ``[..., N, K]`` with float32 scales (see module docstring)."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8Weight: data must be float8_e4m3fn, got {self.data.dtype}")
        if self.scale.dtype != torch.float32:
            raise TypeError(f"FP8Weight: scale must be float32, got {self.scale.dtype}")
        if self.data.dim() < 2 or self.scale.dim() != self.data.dim():
            raise ValueError(
                f"FP8Weight: scale must have the rank of data ({self.data.dim()}), got shape {tuple(self.scale.shape)}"
            )
        _ = self.granularity  # raises for a shape that matches no granularity

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def granularity(self) -> str:
        """``"tensor"``, ``"channel"`` or ``"block"``, read from the scale's shape."""
        *lead, n, k = self.data.shape
        s_lead, s_n, s_k = tuple(self.scale.shape[:-2]), self.scale.shape[-2], self.scale.shape[-1]
        if s_lead != tuple(lead):
            raise ValueError(f"FP8Weight: scale leading dims {s_lead} must equal data's {tuple(lead)}")
        if (s_n, s_k) == (1, 1):
            return "tensor"
        if (s_n, s_k) == (n, 1):
            return "channel"
        if (s_n, s_k) == (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)):
            return "block"
        raise ValueError(
            f"FP8Weight: scale shape {tuple(self.scale.shape)} matches no granularity for data "
            f"{tuple(self.data.shape)}: expected [..., 1, 1], [..., {n}, 1] or "
            f"[..., {math.ceil(n / FP8_BLOCK)}, {math.ceil(k / FP8_BLOCK)}]"
        )

    @property
    def format(self) -> str:
        return f"fp8_per_{self.granularity}" if self.granularity != "block" else "fp8_block"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self, dtype)


QuantizedWeight = MXFP4Weight | FP8Weight


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exp`` in float64, exactly, for an integer tensor ``exp`` in ``[-1022, 1023]``,
    built from its bits. torch.ldexp and torch.pow(2.0, e) are not exact on every device (on an
    H100, ``pow(2.0, -4.0)`` in float64 is 0.06249999999999999), and these references must
    give the same bytes on any device."""
    return ((exp.to(torch.int64) + 1023) << 52).view(torch.float64)


def _e2m1_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    mags = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def dequantize_mxfp4(weight: MXFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values of an MXFP4 weight, ``[..., N, K]`` in ``dtype`` (computed in float32
    unless ``dtype`` is float64)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    packed = weight.packed
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    values = _e2m1_table(packed.device, compute)[codes.long()]
    scales = _pow2(weight.scales.to(torch.int64) - 127).to(compute)  # exact: 2**-127 is a float32 subnormal
    scales = torch.where(weight.scales == 255, torch.full_like(scales, float("nan")), scales)
    values = values.unflatten(-1, (-1, MXFP4_BLOCK)) * scales.unsqueeze(-1)
    return values.flatten(-2).to(dtype)


# Working set of one quantize_mxfp4 chunk, in bytes per input value: measured 41.4 for float32,
# bfloat16 and float16 inputs (the [values, 8] float32 distance table dominates), with margin.
# Chunks are sized so that this times the chunk plus the outputs stays within the input's own
# bytes (tests/tokenspeed_kernel/test_quant.py bounds the peak).
MXFP4_QUANT_BYTES_PER_VALUE = 56


def _mxfp4_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of ``rows [R, K]`` (any float dtype and strides): packed uint8
    ``[R, K/2]`` and E8M0 uint8 ``[R, K/32]`` (the rule of :func:`quantize_mxfp4`)."""
    blocks = rows.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    # frexp: amax = m * 2**p with m in [0.5, 1), so floor(log2(amax)) = p - 1 exactly.
    _, p = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))
    exp = torch.where(amax > 0, p.to(torch.int64) - 3, torch.full_like(p, -127, dtype=torch.int64)).clamp(-127, 127)
    scaled = blocks.double()
    del blocks
    scaled = scaled.mul_(_pow2(-exp).unsqueeze(-1)).float()  # exact: a power-of-two scaling
    mags = torch.tensor(E2M1_VALUES, device=rows.device)
    # Nearest representable magnitude; a tie goes to the even code (mantissa bit 0), which
    # is round-to-nearest-even. Distinct candidates differ by >= 0.25, so the 1e-6 bias
    # only decides exact ties.
    dist = scaled.abs().clamp_(max=6.0).unsqueeze(-1) - mags
    odd = (torch.arange(len(E2M1_VALUES), device=rows.device) % 2).float()
    idx = dist.abs_().add_(odd * 1e-6).argmin(dim=-1)
    del dist
    codes = (idx | ((scaled < 0) & (idx > 0)).to(idx.dtype) << 3).to(torch.uint8).flatten(-2)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def _row_prefixes(w: torch.Tensor, prefix: tuple[int, ...] = ()) -> list[tuple[int, ...]]:
    """Leading indices ``p`` such that every ``w[p]`` can be viewed as rows ``[-1, K]``
    without a copy and together they cover ``w`` in order (``[()]`` for a contiguous ``w``)."""
    sub = w[prefix]
    try:
        sub.view(-1, sub.shape[-1])
        return [prefix]
    except RuntimeError:  # not flattenable: one prefix per index of the next leading dim
        return [p for i in range(sub.shape[0]) for p in _row_prefixes(w, (*prefix, i))]


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Weight:
    """Quantize ``w [..., N, K]`` (``K % 32 == 0``) to MXFP4, round-to-nearest-even per value.

    The shared exponent of a block is ``floor(log2(amax)) - 2`` (E2M1's largest exponent),
    as the OCP MX specification describes; values beyond ±6·scale saturate.

    Memory: rows are quantized in chunks, so the extra memory (outputs included) stays
    within the input's own size (``w.numel() * w.element_size()`` bytes) whenever that holds
    a row's working set several times (``K * MXFP4_QUANT_BYTES_PER_VALUE`` bytes; any input
    of a few dozen rows or more); a tiny input goes one row at a time. The result does not
    depend on the chunking (every 32-value block is quantized on its own).
    """
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"quantize_mxfp4: the last dim ({w.shape[-1]}) must be a multiple of {MXFP4_BLOCK}")
    w = w.detach()
    k = w.shape[-1]
    packed = torch.empty((*w.shape[:-1], k // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((*w.shape[:-1], k // MXFP4_BLOCK), dtype=torch.uint8, device=w.device)
    out_bytes = packed.numel() + scales.numel()
    budget = w.numel() * w.element_size() - out_bytes
    rows_per_chunk = max(1, budget // (k * MXFP4_QUANT_BYTES_PER_VALUE)) if k else 1
    for prefix in _row_prefixes(w):
        rows, packed_rows, scale_rows = (t[prefix].view(-1, t.shape[-1]) for t in (w, packed, scales))
        for start in range(0, rows.shape[0], rows_per_chunk):
            chunk = slice(start, start + rows_per_chunk)
            packed_rows[chunk], scale_rows[chunk] = _mxfp4_rows(rows[chunk])
    return MXFP4Weight(packed, scales)


def _expand_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    s_n, s_k = scale.shape[-2], scale.shape[-1]
    if (s_n, s_k) == (1, 1):
        return scale
    if s_k == 1 and s_n == n:
        return scale
    return scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def dequantize_fp8(weight: FP8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values ``data * scale`` of an fp8 weight, in ``dtype``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    n, k = weight.data.shape[-2:]
    return (weight.data.to(compute) * _expand_scale(weight.scale, n, k).to(compute)).to(dtype)


def quantize_fp8(w: torch.Tensor, granularity: str = "channel") -> FP8Weight:
    """Quantize ``w [..., N, K]`` to float8_e4m3fn with amax scaling at ``granularity``
    (``"tensor"``, ``"channel"`` or ``"block"`` = 128x128)."""
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"quantize_fp8: granularity must be one of {FP8_GRANULARITIES}, got {granularity!r}")
    wf = w.detach().float()
    n, k = wf.shape[-2:]
    if granularity == "tensor":
        amax = wf.abs().amax(dim=(-2, -1), keepdim=True)
    elif granularity == "channel":
        amax = wf.abs().amax(dim=-1, keepdim=True)
    else:
        pn, pk = math.ceil(n / FP8_BLOCK) * FP8_BLOCK, math.ceil(k / FP8_BLOCK) * FP8_BLOCK
        padded = torch.nn.functional.pad(wf.abs(), (0, pk - k, 0, pn - n))
        tiles = padded.unflatten(-1, (-1, FP8_BLOCK)).unflatten(-3, (-1, FP8_BLOCK))
        amax = tiles.amax(dim=(-3, -1))
    scale = (amax / FP8_E4M3_MAX).clamp_min(1e-12).float()
    data = (wf / _expand_scale(scale, n, k)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return FP8Weight(data.contiguous(), scale.contiguous())


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (``K % 32 == 0``, any float dtype) to MXFP8 along its last axis.

    Returns ``(data, scales)``: ``data`` float8_e4m3fn ``[..., K]`` (OCP e4m3fn: bias 7, max
    ±448, no infinities) and ``scales`` uint8 ``[..., K/32]``, E8M0 (``2 ** (s - 127)``).
    The real value of element ``k`` is ``data[k] * 2 ** (scales[k // 32] - 127)``.

    The rule (OCP MX v1.0 conversion, with ``emax_elem = 8`` for e4m3), per block of 32
    consecutive values ``v``:

    1. ``amax = max |v|``. The shared exponent is ``e = floor(log2(amax)) - 8``, clamped to
       ``[-127, 127]``; a block of zeros gets ``e = -127`` (scale byte 0).
    2. Each ``v / 2**e`` (exact: a power-of-two scaling) is rounded to the nearest e4m3 value,
       ties to even mantissa (round-to-nearest-even; below ``2**-6`` the e4m3 subnormal
       quantum ``2**-9`` applies), and saturated to ±448. Because ``amax / 2**e`` lies in
       ``[256, 512)``, the block maximum may saturate (values in ``[464, 512) * 2**e`` lose
       up to 12.5 %), exactly as the specification's conversion does.
    3. Signs are kept (``-0.0`` stays ``-0.0``).

    A block holding a NaN or ±inf gets the NaN scale (byte 255) and NaN data. Computed in
    float64, so the result does not depend on the input dtype's arithmetic.
    """
    if x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"quantize_mxfp8: the last dim ({x.shape[-1]}) must be a multiple of {MXFP8_BLOCK}")
    v = x.detach().to(torch.float64).unflatten(-1, (-1, MXFP8_BLOCK))
    amax = v.abs().amax(dim=-1)
    finite = torch.isfinite(amax)
    # frexp: amax = m * 2**p with m in [0.5, 1), so floor(log2(amax)) = p - 1 exactly.
    _, p = torch.frexp(torch.where(finite & (amax > 0), amax, torch.ones_like(amax)))
    exp = torch.where(finite & (amax > 0), p.to(torch.int64) - 1 - E4M3_EMAX, torch.full_like(amax, -127).long())
    exp = exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    scaled = v * _pow2(-exp).unsqueeze(-1)
    mag = scaled.abs().clamp(max=FP8_E4M3_MAX)
    _, pe = torch.frexp(mag)  # mag = m * 2**pe; its e4m3 exponent is pe - 1 (>= -6)
    quantum = _pow2((pe.to(torch.int64) - 1).clamp(min=E4M3_MIN_EXP) - 3)
    rounded = torch.round(mag / quantum) * quantum  # torch.round: half to even
    data = torch.copysign(rounded.clamp(max=FP8_E4M3_MAX), scaled)
    data = torch.where(finite.unsqueeze(-1), data, torch.full_like(data, float("nan")))
    scales = torch.where(finite, exp + 127, torch.full_like(exp, E8M0_NAN)).to(torch.uint8)
    return data.flatten(-2).to(torch.float8_e4m3fn).contiguous(), scales.contiguous()


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real values of MXFP8 ``data [..., K]`` with E8M0 ``scales [..., K/32]``, in ``dtype``
    (computed in float64; scale byte 255 is NaN)."""
    values = data.to(torch.float64).unflatten(-1, (-1, MXFP8_BLOCK))
    factor = _pow2(scales.to(torch.int64) - 127)
    factor = torch.where(scales == E8M0_NAN, torch.full_like(factor, float("nan")), factor)
    return (values * factor.unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantize_mxfp8(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize_mxfp8(*quantize_mxfp8(x))`` in ``dtype`` (default x's dtype): the values a
    kernel multiplies when ``activation_quant="mxfp8"``. Exact in float32/float64 (every MXFP8
    value derived from a float32 input is a float32)."""
    data, scales = quantize_mxfp8(x)
    return dequantize_mxfp8(data, scales, x.dtype if dtype is None else dtype)


def _round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` rounded to the nearest float8_e4m3fn value (ties to even mantissa; the
    subnormal quantum ``2**-9`` below ``2**-6``) and saturated to ±448, still float64."""
    mag = v.abs().clamp(max=FP8_E4M3_MAX)
    _, pe = torch.frexp(mag)  # mag = m * 2**pe; its e4m3 exponent is pe - 1 (>= -6)
    quantum = _pow2((pe.to(torch.int64) - 1).clamp(min=E4M3_MIN_EXP) - 3)
    rounded = torch.round(mag / quantum) * quantum  # torch.round: half to even
    return torch.copysign(rounded.clamp(max=FP8_E4M3_MAX), v)


def quantize_fp8_per_token(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., K]`` (any float dtype, finite) to float8_e4m3fn with one float32 scale
    per row (``group_size=None``: per token) or per row and ``group_size`` consecutive values
    along K (the last group may be shorter). Returns ``(data float8_e4m3fn [..., K],
    scales float32 [..., G])``, real value ``data * scale``.

    The rule (what a kernel serving ``activation_quant="fp8"`` computes, bit for bit):

    1. ``amax = max |v|`` over the group; the scale is the power of two ``2**e`` with the
       smallest ``e`` such that ``amax / 2**e <= 448`` (``e = ceil(log2(amax / 448))``),
       clamped to ``[-100, 126]`` (a zero group gets ``2**-100``). A power of two makes the
       scaling ``v / 2**e`` exact (the DeepSeek "UE8M0" variant of per-token-group fp8), so
       the only rounding is step 2, on any hardware.
    2. ``v / 2**e`` rounded to the nearest e4m3 value, ties to even (saturation to ±448 is
       never reached by construction).

    Computed in float64. Non-finite inputs give unspecified results.
    """
    k = x.shape[-1]
    group = k if group_size is None else group_size
    pad = -k % group
    v = x.detach().to(torch.float64)
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.unflatten(-1, (-1, group))
    amax = v.abs().amax(dim=-1)
    m, p = torch.frexp(amax)  # amax = m * 2**p, m in [0.5, 1)
    exp = torch.where(m <= FP8_E4M3_MAX / 512, p.to(torch.int64) - 9, p.to(torch.int64) - 8)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, FP8_ACT_MIN_EXP)).clamp(FP8_ACT_MIN_EXP, FP8_ACT_MAX_EXP)
    data = _round_e4m3(v * _pow2(-exp).unsqueeze(-1)).flatten(-2)[..., :k]
    scales = _pow2(exp).float()
    return data.to(torch.float8_e4m3fn).contiguous(), scales.contiguous()


def fake_quantize_fp8_per_token(
    x: torch.Tensor, group_size: int | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``data * scale`` of :func:`quantize_fp8_per_token` in ``dtype`` (default x's dtype): the
    values a kernel multiplies when ``activation_quant="fp8"`` (exact in float32/float64)."""
    data, scales = quantize_fp8_per_token(x, group_size)
    k = x.shape[-1]
    group = k if group_size is None else group_size
    factor = scales.double().repeat_interleave(group, dim=-1)[..., :k]
    return (data.to(torch.float64) * factor).to(x.dtype if dtype is None else dtype)
