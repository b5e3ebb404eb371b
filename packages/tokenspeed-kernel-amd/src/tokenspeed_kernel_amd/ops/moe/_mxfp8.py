"""MXFP8 activation quantization in Gluon: the rule of ``tokenspeed_kernel.quant.quantize_mxfp8``
in integer/fp32 register ops, and the small kernel that quantizes ``x`` before the GEMMs.

Per block of 32 values along K with ``amax = max |v|`` (fp32):

- shared exponent ``e = max(floor(log2(amax)) - 8, -127)`` read from amax's exponent bits
  (a zero or fp32-subnormal amax gives -127), E8M0 byte ``e + 127``;
- ``v * 2**-e`` (exact) rounded to e4m3: normal range by the round-to-nearest-even carry
  trick on the fp32 bits (keep 3 mantissa bits), below ``2**-6`` to a multiple of ``2**-9``
  with an explicit tie-to-even on the integer part; then saturated to ±448.

Blocks whose amax is below ``2**-118`` need fp32 subnormals for ``2**e`` and may flush to zero
on the device; non-finite inputs give unspecified (non-finite) results. Both differ from the
reference only where the reference itself is degenerate.

``mxfp8_quant_kernel`` (one program = ``BLOCK_R`` rows x one 32-value block): ``FAKE=False``
writes e4m3 codes (uint8 ``[T, K]``) and E8M0 scales (uint8 ``[T, K/32]``) for the gfx950
scaled MFMA; ``FAKE=True`` writes the dequantized values in x's dtype (exact in bf16/fp16:
4 significant bits), which the 16-bit MFMA path multiplies. Quantizing x once here instead of
inside the GEMM saves the redundant work of every N tile and top-k copy re-quantizing the
same rows (45 N tiles x top-4 at GPT-OSS sizes) and halves the bytes the GEMM gathers.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["e4m3_code", "e4m3_round", "fake_quantize", "mx_exponent", "mxfp8_quant_kernel"]


@gluon.jit
def mx_exponent(amax):
    """fp32 block maxima → int32 shared exponents ``max(floor(log2(amax)) - 8, -127)``."""
    bits = amax.to(gl.int32, bitcast=True)
    return gl.maximum(((bits >> 23) & 255) - 135, -127)


@gluon.jit
def _pow2(e):
    """``2 ** e`` for int32 ``e`` in [-127, 127] (2**-127 as the fp32 subnormal it is)."""
    bits = gl.where(e > -127, (e + 127) << 23, 4194304)
    return bits.to(gl.float32, bitcast=True)


@gluon.jit
def e4m3_round(s):
    """fp32 → the nearest float8_e4m3fn value (ties to even), saturated to ±448, as fp32."""
    a = gl.minimum(gl.abs(s), 448.0)
    bits = a.to(gl.int32, bitcast=True)
    normal = ((bits + 524287 + ((bits >> 20) & 1)) & -1048576).to(gl.float32, bitcast=True)
    m = a * 512.0
    mi = m.to(gl.int32)
    frac = m - mi.to(gl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((mi & 1) == 1))
    sub = (mi + up.to(gl.int32)).to(gl.float32) * 0.001953125
    r = gl.minimum(gl.where(a < 0.015625, sub, normal), 448.0)
    return gl.where(s < 0, -r, r)


@gluon.jit
def e4m3_code(r):
    """An fp32 that is exactly an e4m3 value (from :func:`e4m3_round`) → its int32 code."""
    bits = r.to(gl.int32, bitcast=True)
    expb = (bits >> 23) & 255
    normal = ((expb - 120) << 3) | ((bits >> 20) & 7)
    sub = (gl.abs(r) * 512.0).to(gl.int32)
    return ((bits >> 24) & 128) | gl.where(expb >= 121, normal, sub)


@gluon.jit
def fake_quantize(v, amax):
    """``v`` (fp32) quantized to e4m3 with the shared exponent of ``amax`` (broadcast to
    ``v``'s shape) and dequantized again: the value the GEMM multiplies, in fp32."""
    e = mx_exponent(amax)
    return e4m3_round(v * _pow2(-e)) * _pow2(e)


@gluon.jit
def mxfp8_quant_kernel(
    X, Q, Scales, num_rows, stride_xt, stride_qt, stride_st,
    BLOCK_R: gl.constexpr, FAKE: gl.constexpr, LAYOUT: gl.constexpr,
):  # fmt: skip
    """``X [T, K]`` bf16/fp16 → ``Q`` uint8 e4m3 codes ``[T, K]`` + ``Scales`` uint8 E8M0
    ``[T, K/32]`` (``FAKE=False``) or ``Q`` in X's dtype holding the dequantized values
    (``FAKE=True``, ``Scales`` unused). Program ``(r, b)``: rows ``[r*BLOCK_R, ...)``, block b."""
    pid_r = gl.program_id(0)
    blk = gl.program_id(1)
    rows = pid_r * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, LAYOUT))
    cols = blk * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, LAYOUT))
    ok = rows < num_rows
    r64 = rows.to(gl.int64)
    v = gl.load(X + r64[:, None] * stride_xt + cols[None, :], mask=ok[:, None], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(v), axis=1)
    e = mx_exponent(amax)
    r = e4m3_round(v * _pow2(-e)[:, None])
    if FAKE:
        gl.store(
            Q + r64[:, None] * stride_qt + cols[None, :],
            (r * _pow2(e)[:, None]).to(Q.dtype.element_ty),
            mask=ok[:, None],
        )
    else:
        gl.store(Q + r64[:, None] * stride_qt + cols[None, :], e4m3_code(r).to(gl.uint8), mask=ok[:, None])
        gl.store(Scales + r64 * stride_st + blk, (e + 127).to(gl.uint8), mask=ok)
