"""Gluon MXFP4 MoE decode for Hopper with tensor-core dots (``mma.sync`` m16n8k16): the kernels.

Same two launches as :mod:`._gluon_moe_decode_kernel` (layer 1: gate/up + bias + activation;
layer 2: down + bias + routing weight + combine), but each dot runs on the tensor cores, so
a 4-byte word of 8 E2M1 codes costs its decode (~15 integer ops) plus a quarter of an MMA
instead of decode + 8 conversions + 8 FMAs.

**Fragments.** One warp owns a block of 16 weight rows (the MMA's M). Lane ``(g, c)``
(``g = lane // 4``, ``c = lane % 4``) loads word ``c`` of one 32-value MX group of rows
``g`` and ``g + 8``: a quad of lanes reads the group's 16 contiguous bytes. A word's codes
``k = 0..7`` become four fp16x2 registers ``(k0, k4), (k1, k5), (k2, k6), (k3, k7)`` (bit
patterns ``e2m1 * 2**-14``: shifts and masks, exact; codes +-0.5 are fp16 subnormals,
which Hopper's tensor cores multiply exactly, as measured on an H100; ``NORMALIZE``
rescales them to normal fp16 first, for hardware that would flush them). Two MMAs consume them: the k order inside a
group does not matter to a dot as long as the activation operand uses the same order, so
the B operand of lane ``(g, c)`` is the activation at the same four pairs of positions
``32 G + 8 c + (j, j + 4)``. All 8 MMA columns get the same activation (one token per
program), so every column of D is the group's dot; lane ``(g, c)`` keeps column ``2c``.
The group's E8M0 scale multiplies D after the two MMAs (one FMA per row): a group never
mixes scales inside an MMA.

**fp16 activations.** The MMA takes fp16 on both sides. x in fp16 is used as it is. x in
bf16 is multiplied by a per-token power of two ``2**-e`` (``e`` from the row's largest
magnitude, so it maps into ``[2**14, 2**15)``: no overflow above 65504, no underflow of the
row's large values) before the fp16 rounding; ``2**e`` goes back after the dot. Layer 1
writes the intermediate in fp16 with one such power of two per (pair, 32-column group),
already in the pair order layer 2's B operand reads (``hid[p, 32 G + 8 c + 2 j + h] =
a[32 G + 8 c + j + 4 h]``), and the scales ``hs[p, G] = 2**e``.

**Split K.** Warps of a program split the K groups (``KS``) and their partial sums meet
in the final reductions (``gl.sum`` over the warp axis), so a 16-row block of weights is
streamed by several warps at once (enough loads in flight at T = 1).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_decode_kernel import _activate

# Decode words $2 (row g) and $3 (row g + 8), then D = A0 B0 + A1 B1 over one MX group:
# A0 = {(k0,k4) lo, (k0,k4) hi, (k1,k5) lo, (k1,k5) hi}, B0 = {$4, $5};
# A1 = {(k2,k6) lo, (k2,k6) hi, (k3,k7) lo, (k3,k7) hi}, B1 = {$6, $7}.
# Outputs: $0 = D[g][2c], $1 = D[g + 8][2c]. {NORMALIZE} is empty (A holds e2m1 * 2**-14,
# codes +-0.5 as fp16 subnormals) or multiplies every A register by 2**14 in fp16 (exact:
# A holds e2m1 itself, all normal), for tensor cores that would flush subnormal inputs.
_MMA_ASM_TEMPLATE = """
{
.reg .b32 m, s, k, p0, p1, p2, p3, q0, q1, q2, q3;
.reg .f32 z, d0, d1, d2, d3;
shl.b32 m, $2, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, $2, 12; and.b32 s, s, 0x80008000; or.b32 p0, m, s;
shl.b32 m, $2, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, $2, 8;  and.b32 s, s, 0x80008000; or.b32 p1, m, s;
shl.b32 m, $2, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, $2, 4;  and.b32 s, s, 0x80008000; or.b32 p2, m, s;
shr.b32 m, $2, 3; and.b32 m, m, 0x0E000E00; and.b32 s, $2, 0x80008000; or.b32 p3, m, s;
shl.b32 m, $3, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, $3, 12; and.b32 s, s, 0x80008000; or.b32 q0, m, s;
shl.b32 m, $3, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, $3, 8;  and.b32 s, s, 0x80008000; or.b32 q1, m, s;
shl.b32 m, $3, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, $3, 4;  and.b32 s, s, 0x80008000; or.b32 q2, m, s;
shr.b32 m, $3, 3; and.b32 m, m, 0x0E000E00; and.b32 s, $3, 0x80008000; or.b32 q3, m, s;
{NORMALIZE}
mov.f32 z, 0f00000000;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p0, q0, p1, q1}, {$4, $5}, {z, z, z, z};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p2, q2, p3, q3}, {$6, $7}, {d0, d1, d2, d3};
mov.f32 $0, d0;
mov.f32 $1, d2;
}
"""
_NORMALIZE_TEXT = "mov.b32 k, 0x74007400;\n" + "".join(
    f"mul.rn.f16x2 {r}, {r}, k;\n" for r in ("p0", "p1", "p2", "p3", "q0", "q1", "q2", "q3")
)
MMA_ASM_TEXT = _MMA_ASM_TEMPLATE.replace("{NORMALIZE}", "")
MMA_ASM_NORMALIZED_TEXT = _MMA_ASM_TEMPLATE.replace("{NORMALIZE}", _NORMALIZE_TEXT)
MMA_ASM = gl.constexpr(MMA_ASM_TEXT)
MMA_ASM_NORMALIZED = gl.constexpr(MMA_ASM_NORMALIZED_TEXT)
MMA_CONSTRAINTS = gl.constexpr("=f,=f,r,r,r,r,r,r")

# bf16 x: words $4..$7 = bf16 pairs (x0,x1) (x2,x3) (x4,x5) (x6,x7) (low half first), $8 =
# float32 power of two; outputs fp16x2 (x0,x4) (x1,x5) (x2,x6) (x3,x7), each value * $8.
BF16_B_ASM_TEXT = """
{
.reg .f32 a0, a1, a2, a3, a4, a5, a6, a7;
shl.b32 a0, $4, 16; and.b32 a1, $4, 0xFFFF0000; shl.b32 a2, $5, 16; and.b32 a3, $5, 0xFFFF0000;
shl.b32 a4, $6, 16; and.b32 a5, $6, 0xFFFF0000; shl.b32 a6, $7, 16; and.b32 a7, $7, 0xFFFF0000;
mul.f32 a0, a0, $8; mul.f32 a1, a1, $8; mul.f32 a2, a2, $8; mul.f32 a3, a3, $8;
mul.f32 a4, a4, $8; mul.f32 a5, a5, $8; mul.f32 a6, a6, $8; mul.f32 a7, a7, $8;
cvt.rn.f16x2.f32 $0, a4, a0;
cvt.rn.f16x2.f32 $1, a5, a1;
cvt.rn.f16x2.f32 $2, a6, a2;
cvt.rn.f16x2.f32 $3, a7, a3;
}
"""
BF16_B_ASM = gl.constexpr(BF16_B_ASM_TEXT)
# fp16 x: the same pairing with byte permutes only (no scaling needed).
F16_B_ASM_TEXT = """
{
prmt.b32 $0, $4, $6, 0x5410;
prmt.b32 $1, $4, $6, 0x7632;
prmt.b32 $2, $5, $7, 0x5410;
prmt.b32 $3, $5, $7, 0x7632;
}
"""
F16_B_ASM = gl.constexpr(F16_B_ASM_TEXT)
B_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,r,r,r,r,f")
# 16 bytes (4 int32) from a 16-byte aligned global address, read-only path: one instruction
# where four scalar loads would be four (Gluon vectorizes only along an in-thread axis).
V4_ASM = gl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];")
V4_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,l")
# One int32 on the read-only path with L2's 256-byte fetch hint: a miss brings the next
# K steps' bytes of the row into L2 as well. The predicated form reads nothing (0) where
# $2 is 0.
LD_256_ASM = gl.constexpr("ld.global.nc.L2::256B.b32 $0, [$1];")
LD_256_CONSTRAINTS = gl.constexpr("=r,l")
LD_256_PRED_ASM = gl.constexpr(
    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; @p ld.global.nc.L2::256B.b32 $0, [$1]; }"
)
LD_256_PRED_CONSTRAINTS = gl.constexpr("=r,l,r")


@gluon.jit
def _ax(n: gl.constexpr, L: gl.constexpr, D: gl.constexpr):
    """``arange(n)`` along axis ``D`` of the rank-5 layout ``L``, expanded to rank 5 (the
    other axes sliced away last-first, then restored in the reverse order)."""
    if D == 0:
        v = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(1, gl.SliceLayout(1, gl.SliceLayout(1, L)))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 1), 1), 1), 1)
    elif D == 1:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 2), 3), 4)
    elif D == 2:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, gl.SliceLayout(4, L)))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 3), 4)
    elif D == 3:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(4, L)))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 0), 4)
    else:
        v = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, L)))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(v, 0), 0), 0), 0)


@gluon.jit
def _scale_bits(s, seen):
    """uint8 E8M0 ``s`` -> (float32 ``2 ** (s - 127)`` by a shift, the running max of ``s``).
    255 (NaN) becomes inf here; the kernel turns a row whose max reached 255 into NaN at
    the end (one max per scale instead of a compare and a select); 0 flushes to 0."""
    si = s.to(gl.int32)
    return (si << 23).to(gl.float32, bitcast=True), gl.maximum(seen, si)


@gluon.jit
def _nan_if_seen(v, seen):
    """``v`` where no E8M0 scale of the row was 255, NaN where one was."""
    return gl.where(seen == 255, float("nan"), v)


@gluon.jit
def _pow2(e):
    """float32 ``2 ** e`` for int32 ``e`` in [-126, 127]."""
    return ((e + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _exponent(amax):
    """``floor(log2(amax)) - 14`` clamped to [-100, 100] (0 for a zero row): the power of two
    that maps ``amax`` into ``[2**14, 2**15)``."""
    eb = (amax.to(gl.int32, bitcast=True) >> 23) & 0xFF
    e = gl.where(eb == 0, 0, eb - 127 - 14)
    return gl.minimum(gl.maximum(e, -100), 100)


@gluon.jit
def _group_dot(w_lo, w_hi, b0, b1, b2, b3, NORMALIZE: gl.constexpr):
    """(D[g], D[g + 8]) of one MX group: two MMAs over the decoded words (see the module),
    times ``2**-14`` unless ``NORMALIZE``."""
    if NORMALIZE:
        return gl.inline_asm_elementwise(
            MMA_ASM_NORMALIZED,
            MMA_CONSTRAINTS,
            [w_lo, w_hi, b0, b1, b2, b3],
            dtype=(gl.float32, gl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        return gl.inline_asm_elementwise(
            MMA_ASM,
            MMA_CONSTRAINTS,
            [w_lo, w_hi, b0, b1, b2, b3],
            dtype=(gl.float32, gl.float32),
            is_pure=True,
            pack=1,
        )


@gluon.jit
def _load(p, mask, other, MASKED: gl.constexpr):
    """``p``'s values; where ``MASKED``, ``other`` outside ``mask``. Unmasked steps (every K
    step but the last) issue plain loads: no predicate, no register to pre-fill."""
    if MASKED:
        return gl.load(p, mask=mask, other=other)
    else:
        return gl.load(p)


@gluon.jit
def _live_load(p, live, other, tail, MASKED: gl.constexpr):
    """Layer 2's loads: skipped (no bytes read) for a choice that is not ``live``. Full K
    steps leave those lanes' values undefined (the result of a dead choice is discarded);
    the last step (``MASKED``) also masks the groups past K (``tail``) and fills ``other``."""
    if MASKED:
        return gl.load(p, mask=live & tail, other=other)
    else:
        return gl.load(p, mask=live)


@gluon.jit
def _v4(p):
    """The 4 int32 words at ``p`` (16-byte aligned, always in bounds) in one 16-byte load."""
    return gl.inline_asm_elementwise(V4_ASM, V4_CONSTRAINTS, [p], dtype=(gl.int32,) * 4, is_pure=True, pack=1)


@gluon.jit
def _ld256(p):
    """``p``'s int32 values (always in bounds), with the L2 256-byte fetch hint."""
    return gl.inline_asm_elementwise(LD_256_ASM, LD_256_CONSTRAINTS, [p], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _ld256_if(p, live):
    """``p``'s int32 values where ``live`` (0 elsewhere, nothing read), L2 256-byte hint."""
    on = gl.broadcast(live, p)[0].to(gl.int32)
    return gl.inline_asm_elementwise(
        LD_256_PRED_ASM, LD_256_PRED_CONSTRAINTS, [p, on], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _load4(p, mask, MASKED: gl.constexpr):
    """The 4 int32 words at ``p + (0..3)`` (0 outside ``mask`` where ``MASKED``)."""
    return (
        _load(p, mask, 0, MASKED),
        _load(p + 1, mask, 0, MASKED),
        _load(p + 2, mask, 0, MASKED),
        _load(p + 3, mask, 0, MASKED),
    )


@gluon.jit
def _row_block(w_row, s_row, grp, c, mask, KG: gl.constexpr, MASKED: gl.constexpr, HINT: gl.constexpr):
    """Word ``c`` of group ``grp`` of rows ``g`` and ``g + 8`` (``w_row``/``s_row`` point at
    row ``g``'s words and scales) and the two uint8 E8M0 group scales (outside ``mask`` where
    ``MASKED``: words 0, scales 127 = 1.0)."""
    wo = grp * 4
    if HINT and not MASKED:
        w_lo = _ld256(w_row + wo)
        w_hi = _ld256(w_row + 8 * KG * 4 + wo)
    else:
        w_lo = _load(w_row + wo, mask, 0, MASKED)
        w_hi = _load(w_row + 8 * KG * 4 + wo, mask, 0, MASKED)
    s_lo = _load(s_row + grp + c * 0, mask, 127, MASKED)
    s_hi = _load(s_row + 8 * KG + grp + c * 0, mask, 127, MASKED)
    return w_lo, w_hi, s_lo, s_hi


@gluon.jit
def _unscale(NORMALIZE: gl.constexpr):
    """What D is multiplied by to undo the decode's ``2**-14`` (1 when normalized)."""
    if NORMALIZE:
        return 1.0
    else:
        return 16384.0


@gluon.jit
def _x_operand(p0, p1, p2, p3, scale, X_F16: gl.constexpr):
    """The B operand (4 fp16x2) from the activation's 4 words ``p0..p3`` (bf16 or fp16 pairs
    ``(x0,x1) .. (x6,x7)``), each value times ``scale`` (bf16 only; fp16 is used as it is)."""
    if X_F16:
        return gl.inline_asm_elementwise(
            F16_B_ASM, B_CONSTRAINTS, [p0, p1, p2, p3, scale], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
    else:
        return gl.inline_asm_elementwise(
            BF16_B_ASM, B_CONSTRAINTS, [p0, p1, p2, p3, scale], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )


@gluon.jit
def _max_rows(v):
    """[W, U, R, 8, 4] -> [R, 8]: the maximum over warps, slots and the quad."""
    return gl.max(gl.max(gl.max(v, axis=4), axis=1), axis=0)


@gluon.jit
def _reduce_rows(v):
    """[W, U, R, 8, 4] partial dots -> [R, 8]: sum over warps and slots, one of the 4
    identical columns (the 4 lanes of a quad hold the same D column value)."""
    return gl.sum(gl.sum(gl.sum(v, axis=4), axis=1), axis=0) * 0.25


@gluon.jit
def _w13_load(w_lo, s_lo, x4, grp, c, N: gl.constexpr, KG: gl.constexpr, MASKED: gl.constexpr, HINT: gl.constexpr):
    """The raw operands of one layer-1 K step (groups ``grp``): gate and up words and E8M0
    scales of rows g / g + 8, and the activation's 4 words."""
    g_ok = grp < KG
    wg_lo, wg_hi, sg_lo, sg_hi = _row_block(w_lo, s_lo, grp, c, g_ok, KG, MASKED, HINT)
    wu_lo, wu_hi, su_lo, su_hi = _row_block(w_lo + N * KG * 4, s_lo + N * KG, grp, c, g_ok, KG, MASKED, HINT)
    p0, p1, p2, p3 = _load4(x4 + grp * 16, g_ok, MASKED)
    return wg_lo, wg_hi, sg_lo, sg_hi, wu_lo, wu_hi, su_lo, su_hi, p0, p1, p2, p3


@gluon.jit
def _w13_math(acc, seen, ops, x_scale, X_F16: gl.constexpr, NORMALIZE: gl.constexpr):
    """One layer-1 K step's 4 MMA pairs on the operands of :func:`_w13_load`.
    ``acc``/``seen``: (gate lo, gate hi, up lo, up hi) partial dots and scale maxima."""
    acc_g_lo, acc_g_hi, acc_u_lo, acc_u_hi = acc
    seen_g_lo, seen_g_hi, seen_u_lo, seen_u_hi = seen
    wg_lo, wg_hi, sg_lo, sg_hi, wu_lo, wu_hi, su_lo, su_hi, p0, p1, p2, p3 = ops
    b0, b1, b2, b3 = _x_operand(p0, p1, p2, p3, x_scale, X_F16)
    b0 = gl.broadcast(b0, wg_lo)[0]
    b1 = gl.broadcast(b1, wg_lo)[0]
    b2 = gl.broadcast(b2, wg_lo)[0]
    b3 = gl.broadcast(b3, wg_lo)[0]
    d_lo, d_hi = _group_dot(wg_lo, wg_hi, b0, b1, b2, b3, NORMALIZE)
    f, seen_g_lo = _scale_bits(sg_lo, seen_g_lo)
    acc_g_lo += d_lo * f
    f, seen_g_hi = _scale_bits(sg_hi, seen_g_hi)
    acc_g_hi += d_hi * f
    d_lo, d_hi = _group_dot(wu_lo, wu_hi, b0, b1, b2, b3, NORMALIZE)
    f, seen_u_lo = _scale_bits(su_lo, seen_u_lo)
    acc_u_lo += d_lo * f
    f, seen_u_hi = _scale_bits(su_hi, seen_u_hi)
    acc_u_hi += d_hi * f
    return (acc_g_lo, acc_g_hi, acc_u_lo, acc_u_hi), (seen_g_lo, seen_g_hi, seen_u_lo, seen_u_hi)


@gluon.jit
def _choice_expert(ids_ptr, emap_ptr, pair, HAS_MAP: gl.constexpr):
    """The local expert of (token, choice) ``pair`` (< 0: not on this rank)."""
    e = gl.load(ids_ptr + pair)
    if HAS_MAP:
        e = gl.load(emap_ptr + e)
    return e


@gluon.jit
def _pair_start(
    x_ptr,
    ids_ptr,
    emap_ptr,
    stride_xt,
    pair,
    TOP_K: gl.constexpr,
    HAS_MAP: gl.constexpr,
    X_F16: gl.constexpr,
    KG: gl.constexpr,
    HP: gl.constexpr,
    XL: gl.constexpr,
):
    """Layer 1's prologue for one (token, choice) pair: (the token's x row, the exponent
    ``e`` of its power-of-two rescale (0 for fp16 x), the local expert (< 0: not on this
    rank)). The x row does not depend on the routing: it is read alongside the ids load."""
    x_row = x_ptr + (pair // TOP_K).to(gl.int64) * stride_xt
    if X_F16:
        e_x = pair * 0
    else:
        xo = gl.arange(0, HP, layout=XL)
        xv = gl.load(x_row + xo, mask=xo < KG * 32, other=0.0).to(gl.float32)
        e_x = _exponent(gl.max(gl.abs(xv), axis=0))
    return x_row, e_x, _choice_expert(ids_ptr, emap_ptr, pair, HAS_MAP)


@gluon.jit
def w13_mma_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    hid_ptr,
    hs_ptr,
    ids_ptr,
    emap_ptr,
    stride_xt,
    stride_be,
    N: gl.constexpr,
    KG: gl.constexpr,
    TOP_K: gl.constexpr,
    HAS_MAP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ACTIVATION: gl.constexpr,
    X_F16: gl.constexpr,
    KS: gl.constexpr,
    U: gl.constexpr,
    L: gl.constexpr,
    XL: gl.constexpr,
    HP: gl.constexpr,
    NORMALIZE: gl.constexpr,
    PREFETCH: gl.constexpr,
    L2_HINT: gl.constexpr,
):
    """Layer 1 of one (token, choice) pair (axis 0) for 32 intermediate columns (axis 1).

    x ``[T, H]`` bf16/fp16 (rows contiguous); w: w13 packed as int32 words ``[E, 2N, H/8]``;
    s: E8M0 ``[E, 2N, H/32]``; b ``[E, 2N]``; ids int32 ``[T * TOP_K]``; emap int32
    ``[E_global]``. Writes hid fp16 ``[T * TOP_K, N]`` (pair order, scaled) and hs float32
    ``[T * TOP_K, N / 32]``. ``L``: the ``[KS, U, 2, 8, 4]`` fragment layout (warps along
    axis 0); ``XL``: a 1-D layout for the ``HP`` (power of two >= H) activation row.
    ``L2_HINT``: full K steps load the weight words with L2's 256-byte fetch hint."""
    pair = gl.program_id(0)
    blk = gl.program_id(1)
    x_row, e_x, expert = _pair_start(x_ptr, ids_ptr, emap_ptr, stride_xt, pair, TOP_K, HAS_MAP, X_F16, KG, HP, XL)
    if expert < 0:  # not on this rank: layer 2 masks the pair
        return

    ks = _ax(KS, L, 0)
    u = _ax(U, L, 1)
    bb = _ax(2, L, 2)
    g = _ax(8, L, 3)
    c = _ax(4, L, 4)
    rows = blk * 32 + bb * 16 + g  # [1, 1, 2, 8, 1]: gate rows of the lo half (N % 32 == 0)
    e64 = expert.to(gl.int64)
    w_lo = w_ptr + e64 * (2 * N * KG * 4) + rows.to(gl.int64) * (KG * 4) + c
    s_lo = s_ptr + e64 * (2 * N * KG) + rows.to(gl.int64) * KG
    x4 = x_row.to(gl.pointer_type(gl.int32)) + c * 4 + g * 0  # [1, 1, 1, 8, 4]
    slot = ks * U + u  # [KS, U, 1, 1, 1]
    x_scale = gl.full([KS, U, 1, 8, 4], 1.0, gl.float32, layout=L) * _pow2(-e_x)
    zero = gl.zeros([KS, U, 2, 8, 4], gl.float32, layout=L)
    none = gl.zeros([KS, U, 2, 8, 4], gl.int32, layout=L)
    acc = (zero, zero, zero, zero)
    seen = (none, none, none, none)
    STEP: gl.constexpr = KS * U
    FULL: gl.constexpr = (KG // STEP) * STEP  # steps with every group in range: no masks
    if PREFETCH:  # software pipeline: step j + 1's loads are issued before step j's math
        if FULL > 0:
            ops = _w13_load(w_lo, s_lo, x4, slot, c, N, KG, False, L2_HINT)
            for j in range(STEP, FULL, STEP):
                nxt = _w13_load(w_lo, s_lo, x4, j + slot, c, N, KG, False, L2_HINT)
                acc, seen = _w13_math(acc, seen, ops, x_scale, X_F16, NORMALIZE)
                ops = nxt
            acc, seen = _w13_math(acc, seen, ops, x_scale, X_F16, NORMALIZE)
    else:
        for j in range(0, FULL, STEP):
            ops = _w13_load(w_lo, s_lo, x4, j + slot, c, N, KG, False, L2_HINT)
            acc, seen = _w13_math(acc, seen, ops, x_scale, X_F16, NORMALIZE)
    if FULL < KG:
        ops = _w13_load(w_lo, s_lo, x4, FULL + slot, c, N, KG, True, L2_HINT)
        acc, seen = _w13_math(acc, seen, ops, x_scale, X_F16, NORMALIZE)

    unscale = _unscale(NORMALIZE) * _pow2(e_x)
    # [2, 8]: columns blk * 32 + b * 16 + g (lo) and + 8 (hi)
    gate_lo = _nan_if_seen(_reduce_rows(acc[0]) * unscale, _max_rows(seen[0]))
    gate_hi = _nan_if_seen(_reduce_rows(acc[1]) * unscale, _max_rows(seen[1]))
    up_lo = _nan_if_seen(_reduce_rows(acc[2]) * unscale, _max_rows(seen[2]))
    up_hi = _nan_if_seen(_reduce_rows(acc[3]) * unscale, _max_rows(seen[3]))
    col = _max_rows(rows + ks * 0 + u * 0 + c * 0)  # [2, 8], all < N (N % 32 == 0)
    if HAS_BIAS:
        b_row = b_ptr + e64 * stride_be
        gate_lo += gl.load(b_row + col).to(gl.float32)
        gate_hi += gl.load(b_row + col + 8).to(gl.float32)
        up_lo += gl.load(b_row + N + col).to(gl.float32)
        up_hi += gl.load(b_row + N + col + 8).to(gl.float32)
    a_lo = _activate(gate_lo, up_lo, ACTIVATION)
    a_hi = _activate(gate_hi, up_hi, ACTIVATION)
    amax = gl.maximum(gl.max(gl.max(gl.abs(a_lo), axis=1), axis=0), gl.max(gl.max(gl.abs(a_hi), axis=1), axis=0))
    e_h = _exponent(amax)
    h_scale = _pow2(-e_h)
    # Column b * 16 + g (+ 8) -> pair position: 8-blocks keep their place, inside one
    # j + 4 h -> 2 j + h.
    within = col - blk * 32
    pos = blk * 32 + (within // 8) * 8 + (within % 4) * 2 + (within % 8) // 4
    h_row = hid_ptr + pair.to(gl.int64) * N
    gl.store(h_row + pos, (a_lo * h_scale).to(gl.float16))
    gl.store(h_row + pos + 8, (a_hi * h_scale).to(gl.float16))
    gl.store(hs_ptr + pair.to(gl.int64) * (N // 32) + blk, _pow2(e_h))


@gluon.jit
def _w2_load(w_lo, s_lo, h4, hs_row, live, grp, g, c, KG: gl.constexpr, MASKED: gl.constexpr, HINT: gl.constexpr):
    """The raw operands of one layer-2 K step (groups ``grp``): words and E8M0 scales of rows
    g / g + 8 of every choice, the intermediate's 4 words and its power of two."""
    tail = grp < KG
    wo = grp * 4
    if HINT and not MASKED:
        w_l = _ld256_if(w_lo + wo, live)
        w_h = _ld256_if(w_lo + 8 * KG * 4 + wo, live)
    else:
        w_l = _live_load(w_lo + wo, live, 0, tail, MASKED)
        w_h = _live_load(w_lo + 8 * KG * 4 + wo, live, 0, tail, MASKED)
    s_l = _live_load(s_lo + grp + c * 0, live, 127, tail, MASKED)
    s_h = _live_load(s_lo + 8 * KG + grp + c * 0, live, 127, tail, MASKED)
    hp = h4 + grp * 16
    if MASKED:
        b0 = _live_load(hp, live, 0, tail, MASKED)
        b1 = _live_load(hp + 1, live, 0, tail, MASKED)
        b2 = _live_load(hp + 2, live, 0, tail, MASKED)
        b3 = _live_load(hp + 3, live, 0, tail, MASKED)
    else:  # h4 points at a real pair for every choice (dead ones read a live pair's row)
        b0, b1, b2, b3 = _v4(hp)
    hs = _live_load(hs_row + grp + g * 0 + c * 0, live, 0.0, tail, MASKED)
    return w_l, w_h, s_l, s_h, b0, b1, b2, b3, hs


@gluon.jit
def _w2_math(acc_lo, acc_hi, seen_lo, seen_hi, ops, NORMALIZE: gl.constexpr):
    """One layer-2 K step's MMA pairs on the operands of :func:`_w2_load`."""
    w_l, w_h, s_l, s_h, b0, b1, b2, b3, hs = ops
    b0 = gl.broadcast(b0, w_l)[0]
    b1 = gl.broadcast(b1, w_l)[0]
    b2 = gl.broadcast(b2, w_l)[0]
    b3 = gl.broadcast(b3, w_l)[0]
    d_lo, d_hi = _group_dot(w_l, w_h, b0, b1, b2, b3, NORMALIZE)
    f, seen_lo = _scale_bits(s_l, seen_lo)
    acc_lo += d_lo * (f * hs)
    f, seen_hi = _scale_bits(s_h, seen_hi)
    acc_hi += d_hi * (f * hs)
    return acc_lo, acc_hi, seen_lo, seen_hi


@gluon.jit
def _choice_term(acc, seen, bias, first, live, weight, HAS_BIAS: gl.constexpr, NORMALIZE: gl.constexpr):
    """A layer-2 block's per-lane term: NaN where a scale of the row was 255, times the
    decode's ``2**14`` (unless ``NORMALIZE``), plus the bias (pointers ``bias``) once per
    choice at its ``first`` lanes (x 4: the row reduction takes a quarter of each quad),
    times the routing ``weight``; 0 for a choice that is not ``live`` (not 0 * NaN)."""
    acc = _nan_if_seen(acc, seen) * _unscale(NORMALIZE)
    if HAS_BIAS:
        acc += gl.load(bias, mask=first & live, other=0.0).to(gl.float32) * 4.0
    return gl.where(live, acc * weight, 0.0)


@gluon.jit
def w2_mma_kernel(
    hid_ptr,
    hs_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    ids_ptr,
    tw_ptr,
    emap_ptr,
    stride_be,
    stride_ot,
    N: gl.constexpr,
    KG: gl.constexpr,
    TOP_K: gl.constexpr,
    KP: gl.constexpr,
    KS: gl.constexpr,
    U: gl.constexpr,
    R: gl.constexpr,
    HAS_MAP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    L: gl.constexpr,
    NORMALIZE: gl.constexpr,
    PREFETCH: gl.constexpr,
    L2_HINT: gl.constexpr,
):
    """Layer 2 and the combine of one token (axis 1) for ``16 * R`` output columns (axis 0).

    hid fp16 ``[T * TOP_K, I]`` and hs float32 ``[T * TOP_K, I / 32]`` from
    :func:`w13_mma_kernel` (``I = 32 * KG``); w: w2 as int32 words ``[E, N, I/8]``;
    s ``[E, N, I/32]``; b ``[E, N]``; out ``[T, N]``: ``sum_c tw[c] * (hid[c] @ w2[e_c].T +
    b[e_c])``. ``L``: the ``[KP * KS, U, R, 8, 4]`` fragment layout (``R`` 16-row blocks per warp
    share each B operand load); warp ``w`` serves choice ``w // KS`` and every ``KS``-th
    group slot; fixed-order sums (deterministic). ``L2_HINT``: as in layer 1."""
    blk = gl.program_id(0)
    token = gl.program_id(1).to(gl.int64)
    wv = _ax(KP * KS, L, 0)
    u = _ax(U, L, 1)
    r = _ax(R, L, 2)
    g = _ax(8, L, 3)
    c = _ax(4, L, 4)
    choice = wv // KS
    ks = wv % KS
    pairs = token * TOP_K + choice
    c_ok = choice < TOP_K
    experts = gl.load(ids_ptr + pairs, mask=c_ok, other=-1)
    if HAS_MAP:
        experts = gl.load(emap_ptr + experts, mask=c_ok & (experts >= 0), other=-1)
    live = c_ok & (experts >= 0)  # [W, 1, 1, 1, 1]
    weight = gl.load(tw_ptr + pairs, mask=live, other=0.0)
    e64 = gl.where(live, experts, 0).to(gl.int64)
    rows = blk * (16 * R) + r * 16 + g  # [1, 1, R, 8, 1] (N % (16 R) == 0)
    w_lo = w_ptr + e64 * (N * KG * 4) + rows.to(gl.int64) * (KG * 4) + c
    s_lo = s_ptr + e64 * (N * KG) + rows.to(gl.int64) * KG
    # A choice past top_k reads pair token * TOP_K (in bounds; its result is discarded).
    h4 = hid_ptr.to(gl.pointer_type(gl.int32)) + gl.where(c_ok, pairs, token * TOP_K) * (KG * 16) + c * 4 + g * 0
    hs_row = hs_ptr + pairs * KG
    slot = ks * U + u  # [W, U, 1, 1, 1]
    zero = gl.zeros([KP * KS, U, R, 8, 4], gl.float32, layout=L)
    none = gl.zeros([KP * KS, U, R, 8, 4], gl.int32, layout=L)
    acc_lo = zero
    acc_hi = zero
    seen_lo = none
    seen_hi = none
    STEP: gl.constexpr = KS * U
    FULL: gl.constexpr = (KG // STEP) * STEP
    if PREFETCH:  # software pipeline: step j + 1's loads are issued before step j's math
        if FULL > 0:
            ops = _w2_load(w_lo, s_lo, h4, hs_row, live, slot, g, c, KG, False, L2_HINT)
            for j in range(STEP, FULL, STEP):
                nxt = _w2_load(w_lo, s_lo, h4, hs_row, live, j + slot, g, c, KG, False, L2_HINT)
                acc_lo, acc_hi, seen_lo, seen_hi = _w2_math(acc_lo, acc_hi, seen_lo, seen_hi, ops, NORMALIZE)
                ops = nxt
            acc_lo, acc_hi, seen_lo, seen_hi = _w2_math(acc_lo, acc_hi, seen_lo, seen_hi, ops, NORMALIZE)
    else:
        for j in range(0, FULL, STEP):
            ops = _w2_load(w_lo, s_lo, h4, hs_row, live, j + slot, g, c, KG, False, L2_HINT)
            acc_lo, acc_hi, seen_lo, seen_hi = _w2_math(acc_lo, acc_hi, seen_lo, seen_hi, ops, NORMALIZE)
    if FULL < KG:
        ops = _w2_load(w_lo, s_lo, h4, hs_row, live, FULL + slot, g, c, KG, True, L2_HINT)
        acc_lo, acc_hi, seen_lo, seen_hi = _w2_math(acc_lo, acc_hi, seen_lo, seen_hi, ops, NORMALIZE)
    # Per warp: the bias once per choice, on its ks = 0 warp; a remote choice adds nothing.
    first = (ks == 0) & (u == 0) & (c == 0)
    bias = b_ptr + e64 * stride_be + rows + u * 0 + c * 0
    acc_lo = _choice_term(acc_lo, seen_lo, bias, first, live, weight, HAS_BIAS, NORMALIZE)
    acc_hi = _choice_term(acc_hi, seen_hi, bias + 8, first, live, weight, HAS_BIAS, NORMALIZE)
    y_lo = _reduce_rows(acc_lo)  # [R, 8]
    y_hi = _reduce_rows(acc_hi)
    r_out = _max_rows(rows + wv * 0 + u * 0 + c * 0)  # [R, 8], all < N (N % (16 R) == 0)
    o_row = out_ptr + token * stride_ot
    gl.store(o_row + r_out, y_lo.to(out_ptr.dtype.element_ty))
    gl.store(o_row + r_out + 8, y_hi.to(out_ptr.dtype.element_ty))
