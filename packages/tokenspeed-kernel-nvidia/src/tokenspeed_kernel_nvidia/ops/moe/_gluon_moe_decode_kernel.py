"""Gluon (Triton's explicit-layout dialect) MXFP4 MoE decode for Hopper: the kernels.

Two launches (layer 2 needs every intermediate column of layer 1):

:func:`w13_kernel`, grid ``(T * TOP_K, cdiv(I, BN))``, one program per (token, choice) pair
and ``BN`` gate rows (+ the matching ``BN`` up rows) of its expert. With ``ROUTE`` it first
computes its token's routing from the router logits (softmax or sigmoid over ``E`` scores,
top-k by repeated arg-max with ties to the lower id, optional renormalization) inside each
warp (the logits row is replicated per warp, so the reductions are warp shuffles) and the
row-block-0 program of each pair writes the chosen id and weight to a workspace for layer 2.
Then it streams the packed weight rows: a ``[BN, 32, 4]`` int32 tile per K step, lane =
one 32-value MX group = 16 contiguous bytes (one ``ld.global.v4.b32``) and one E8M0 scale,
rows spread over warps and registers. Each int32 word (8 E2M1 codes, low nibble first) is
decoded by :data:`DECODE_ASM` into 8 float32 values ``e2m1 * 2**-14`` (fp16 bit patterns
built with shifts and masks, then ``cvt.f32.f16``), multiplied with the activation in float32,
summed over the group in-thread, and the group sum times ``2**(s - 127)`` is accumulated.
Bias, activation (silu / erf-gelu / swiglu_oai) and the float32 intermediate store follow;
the intermediate is stored *word-permuted* (``hid[pair, j, q] = a[8q + j]``) so that layer 2
reads, for a lane's words, the 8 ``j`` slices as 16-byte vectors.

:func:`w2_kernel`, grid ``(cdiv(H, BN2), T)``: the ``KP`` choices of one token on ``KP``
groups of warps (a ``[KP, BN2, 32, 4]`` tile), each choice's ``BN2`` rows of w2 streamed the
same way; bias, routing weight, and the sum over the choices (a fixed-order reduction, no
atomics: deterministic). A choice whose expert maps to -1 is masked (no bytes are read).
"""

from __future__ import annotations

from triton import language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# One int32 word = 8 E2M1 codes k = 0..7 (code k in bits 4k..4k+3: bit 3 sign, bits 0-2
# magnitude). Codes k and k + 4 become one fp16x2 pattern: magnitude bits at 9-11 (25-27),
# sign at 15 (31), which is e2m1 * 2**-14 exactly (codes 0 and 0.5 are fp16 subnormals);
# ``cvt.f32.f16`` widens each half. Outputs $0..$7 are k = 0..7, input $8.
DECODE_ASM_TEXT = """
{
.reg .b32 m, s, p;
.reg .b16 lo, hi;
shl.b32 m, $8, 9;  and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 12; and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $0, lo; cvt.f32.f16 $4, hi;
shl.b32 m, $8, 5;  and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 8;  and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $1, lo; cvt.f32.f16 $5, hi;
shl.b32 m, $8, 1;  and.b32 m, m, 0x0E000E00; shl.b32 s, $8, 4;  and.b32 s, s, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $2, lo; cvt.f32.f16 $6, hi;
shr.b32 m, $8, 3;  and.b32 m, m, 0x0E000E00; and.b32 s, $8, 0x80008000; or.b32 p, m, s;
mov.b32 {lo, hi}, p; cvt.f32.f16 $3, lo; cvt.f32.f16 $7, hi;
}
"""
DECODE_ASM = gl.constexpr(DECODE_ASM_TEXT)
DECODE_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r,=r,=r,=r,=r,r")


@gluon.jit
def _decode8(words):
    """int32 words -> 8 float32 tensors, k = 0..7 of each word, each ``e2m1 * 2**-14``."""
    return gl.inline_asm_elementwise(
        DECODE_ASM, DECODE_CONSTRAINTS, [words], dtype=(gl.float32,) * 8, is_pure=True, pack=1
    )


@gluon.jit
def _e8m0(s):
    """uint8 E8M0 -> float32 ``2 ** (s - 127)``; 255 is NaN, 0 flushes to 0."""
    si = s.to(gl.int32)
    return gl.where(si == 255, float("nan"), (si << 23).to(gl.float32, bitcast=True))


@gluon.jit
def _group_dot(words, a0, a1, a2, a3, a4, a5, a6, a7, AXIS: gl.constexpr):
    """``sum_{word, k} e2m1(code) * a_k`` over the 4 words of each lane's group (``AXIS``),
    times ``2**-14``; ``a_k`` is the activation at position ``8 * word + k``."""
    w0, w1, w2, w3, w4, w5, w6, w7 = _decode8(words)
    p = w0 * a0 + w1 * a1 + w2 * a2 + w3 * a3 + w4 * a4 + w5 * a5 + w6 * a6 + w7 * a7
    return gl.sum(p, axis=AXIS)


@gluon.jit
def _activate(gate, up, ACTIVATION: gl.constexpr):
    """``act(gate) * up`` in float32: silu (0), erf-gelu (1), swiglu_oai (2). The swiglu_oai
    clamps keep a NaN (as ``torch.clamp`` does): a NaN gate or up stays NaN."""
    if ACTIVATION == 0:
        act = gate / (1.0 + gl.exp(-gate)) * up
    elif ACTIVATION == 1:
        act = 0.5 * gate * (1.0 + gl.erf(gate * 0.7071067811865476)) * up
    else:
        gate = gl.minimum(gate, 7.0, propagate_nan=tl.PropagateNan.ALL)
        up = gl.minimum(gl.maximum(up, -7.0, propagate_nan=tl.PropagateNan.ALL), 7.0, propagate_nan=tl.PropagateNan.ALL)
        act = gate / (1.0 + gl.exp(-1.702 * gate)) * (up + 1.0)
    return act


@gluon.jit
def _route(
    logits_row,
    choice,
    E: gl.constexpr,
    EP: gl.constexpr,
    TOP_K: gl.constexpr,
    SIGMOID: gl.constexpr,
    RENORM: gl.constexpr,
    NW: gl.constexpr,
    ROUTE: gl.constexpr,
):
    """(expert id, weight) of ``choice`` for one token, as ``moe_topk`` defines it. The row
    is a ``[num_warps, EP]`` tile (one copy per warp, reductions along axis 1 stay in a
    warp); the two results are reduced over the warp copies at the end."""
    offs = gl.arange(0, EP, layout=gl.SliceLayout(0, ROUTE))
    ok = gl.expand_dims(offs < E, 0)
    warps = gl.arange(0, NW, layout=gl.SliceLayout(1, ROUTE))
    idx2 = gl.expand_dims(warps * 0, 1) + gl.expand_dims(offs, 0)  # [W, EP]
    v = gl.load(logits_row + idx2, mask=ok, other=float("-inf")).to(gl.float32)
    if SIGMOID:
        score = 1.0 / (1.0 + gl.exp(-v))
    else:
        m = gl.max(v, axis=1)
        p = gl.exp(v - gl.expand_dims(m, 1))
        score = p / gl.expand_dims(gl.sum(p, axis=1), 1)
    score = gl.where(ok, score, float("-inf"))
    my_id = gl.zeros([NW], gl.int32, layout=gl.SliceLayout(1, ROUTE))
    my_w = gl.zeros([NW], gl.float32, layout=gl.SliceLayout(1, ROUTE))
    total = gl.zeros([NW], gl.float32, layout=gl.SliceLayout(1, ROUTE))
    for i in gl.static_range(TOP_K):
        best = gl.max(score, axis=1)
        hit = score == gl.expand_dims(best, 1)
        arg = gl.min(gl.where(hit, idx2, EP), axis=1)
        total += best
        mine = choice == i
        my_id = gl.where(mine, arg, my_id)
        my_w = gl.where(mine, best, my_w)
        score = gl.where(idx2 == gl.expand_dims(arg, 1), float("-inf"), score)
    if RENORM:
        my_w = my_w / total
    return gl.max(my_id, axis=0), gl.max(my_w, axis=0)


@gluon.jit
def _choices(ids_ptr, emap_ptr, pairs, c_ok, HAS_MAP: gl.constexpr):
    """(local expert ids, live mask) of the choices ``pairs`` (masked by ``c_ok``)."""
    experts = gl.load(ids_ptr + pairs, mask=c_ok, other=-1)
    if HAS_MAP:
        experts = gl.load(emap_ptr + experts, mask=c_ok & (experts >= 0), other=-1)
    return experts, c_ok & (experts >= 0)


@gluon.jit
def _w13_step(w_gate, w_up, s_gate, s_up, row_ok, lane_g, word, c0, N: gl.constexpr, KG: gl.constexpr):
    """One K step's packed gate/up words ``[BN, 32, 4]`` and E8M0 scales ``[BN, 32]`` (groups
    ``c0 .. c0 + 31``; groups past ``KG`` masked)."""
    grp = c0 + lane_g
    g_ok = gl.expand_dims(grp < KG, 0)
    voff = gl.expand_dims(gl.expand_dims(grp * 4, 0), 2) + gl.expand_dims(gl.expand_dims(word, 0), 0)
    wmask = gl.expand_dims(gl.expand_dims(row_ok, 1) & g_ok, 2)
    pg = gl.load(w_gate + voff, mask=wmask, other=0)
    pu = gl.load(w_up + voff, mask=wmask, other=0)
    smask = gl.expand_dims(row_ok, 1) & g_ok
    sg = gl.load(s_gate + gl.expand_dims(grp, 0), mask=smask, other=127)
    su = gl.load(s_up + gl.expand_dims(grp, 0), mask=smask, other=127)
    return pg, pu, sg, su


@gluon.jit
def _w13_math(acc_g, acc_u, pg, pu, sg, su, x_row, xg, word, c0, KG: gl.constexpr):
    """Accumulate one K step: the activation's 32 groups x 8 slices, then both group dots."""
    xk = gl.expand_dims((c0 + xg) * 32, 1) + gl.expand_dims(word * 8, 0)  # [32, 4]
    xm = gl.expand_dims(c0 + xg < KG, 1) & gl.expand_dims(word < 4, 0)
    x0 = gl.expand_dims(gl.load(x_row + xk, mask=xm, other=0.0).to(gl.float32), 0)
    x1 = gl.expand_dims(gl.load(x_row + xk + 1, mask=xm, other=0.0).to(gl.float32), 0)
    x2 = gl.expand_dims(gl.load(x_row + xk + 2, mask=xm, other=0.0).to(gl.float32), 0)
    x3 = gl.expand_dims(gl.load(x_row + xk + 3, mask=xm, other=0.0).to(gl.float32), 0)
    x4 = gl.expand_dims(gl.load(x_row + xk + 4, mask=xm, other=0.0).to(gl.float32), 0)
    x5 = gl.expand_dims(gl.load(x_row + xk + 5, mask=xm, other=0.0).to(gl.float32), 0)
    x6 = gl.expand_dims(gl.load(x_row + xk + 6, mask=xm, other=0.0).to(gl.float32), 0)
    x7 = gl.expand_dims(gl.load(x_row + xk + 7, mask=xm, other=0.0).to(gl.float32), 0)
    acc_g += _group_dot(pg, x0, x1, x2, x3, x4, x5, x6, x7, 2) * _e8m0(sg)
    acc_u += _group_dot(pu, x0, x1, x2, x3, x4, x5, x6, x7, 2) * _e8m0(su)
    return acc_g, acc_u


@gluon.jit
def w13_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    hid_ptr,
    ids_ptr,
    tw_ptr,
    emap_ptr,
    logits_ptr,
    stride_xt,
    stride_lt,
    stride_be,
    N: gl.constexpr,
    KG: gl.constexpr,
    TOP_K: gl.constexpr,
    E: gl.constexpr,
    EP: gl.constexpr,
    ROUTE: gl.constexpr,
    SIGMOID: gl.constexpr,
    RENORM: gl.constexpr,
    HAS_MAP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    ACTIVATION: gl.constexpr,
    BN: gl.constexpr,
    NW: gl.constexpr,
    W3: gl.constexpr,
    RL: gl.constexpr,
):
    """Layer 1 of one (token, choice) pair (axis 0) for ``BN`` intermediate columns (axis 1).

    x ``[T, H]``; w: w13 packed, contiguous, as int32 words ``[E, 2N, H/8]``; s: E8M0
    ``[E, 2N, H/32]``, contiguous; b: bias ``[E, 2N]``; hid float32 ``[T * TOP_K, 8, N / 8]`` (word-permuted);
    ids/tw: int32/float32 ``[T * TOP_K]``, read (``ROUTE=False``) or written (``ROUTE``);
    emap int32 ``[E_global]``; logits ``[T, E]`` (``ROUTE``). ``KG = H / 32`` groups.
    """
    pair = gl.program_id(0)
    blk = gl.program_id(1)
    token = pair // TOP_K
    if ROUTE:
        expert, weight = _route(
            logits_ptr + token.to(gl.int64) * stride_lt, pair % TOP_K, E, EP, TOP_K, SIGMOID, RENORM, NW, RL
        )
        if blk == 0:
            gl.store(ids_ptr + pair, expert)
            gl.store(tw_ptr + pair, weight)
    else:
        expert = gl.load(ids_ptr + pair)
    if HAS_MAP:
        expert = gl.load(emap_ptr + expert)
    if expert < 0:  # not on this rank: layer 2 masks the pair and never reads its row
        return

    RG: gl.constexpr = gl.SliceLayout(2, W3)  # [BN, 32]
    GW: gl.constexpr = gl.SliceLayout(0, W3)  # [32, 4]
    rows = blk * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, RG))
    row_ok = rows < N
    lane_g = gl.arange(0, 32, layout=gl.SliceLayout(0, RG))
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, GW))
    e64 = expert.to(gl.int64)
    rows64 = rows.to(gl.int64)
    w_gate = w_ptr + e64 * (2 * N * KG * 4) + gl.expand_dims(gl.expand_dims(rows64 * (KG * 4), 1), 2)
    w_up = w_gate + N * KG * 4
    s_gate = s_ptr + e64 * (2 * N * KG) + gl.expand_dims(rows64 * KG, 1)
    s_up = s_gate + N * KG
    x_row = x_ptr + token.to(gl.int64) * stride_xt
    xg = gl.arange(0, 32, layout=gl.SliceLayout(1, GW))

    acc_g = gl.zeros([BN, 32], gl.float32, layout=RG)
    acc_u = gl.zeros([BN, 32], gl.float32, layout=RG)
    # No software prefetch: loading the next step's words before this step's math was 1.2x
    # slower on an H100 at every T (register pressure; the loop is issue-bound, not
    # latency-bound: docs/history.md, commit 87dce8e).
    for c0 in range(0, KG, 32):
        pg, pu, sg, su = _w13_step(w_gate, w_up, s_gate, s_up, row_ok, lane_g, word, c0, N, KG)
        acc_g, acc_u = _w13_math(acc_g, acc_u, pg, pu, sg, su, x_row, xg, word, c0, KG)
    gate = gl.sum(acc_g, axis=1) * 16384.0
    up = gl.sum(acc_u, axis=1) * 16384.0
    if HAS_BIAS:
        b_row = b_ptr + e64 * stride_be
        gate += gl.load(b_row + rows, mask=row_ok, other=0.0).to(gl.float32)
        up += gl.load(b_row + N + rows, mask=row_ok, other=0.0).to(gl.float32)
    act = _activate(gate, up, ACTIVATION)
    h_off = pair.to(gl.int64) * N + (rows % 8) * (N // 8) + rows // 8
    gl.store(hid_ptr + h_off, act, mask=row_ok)


@gluon.jit
def w2_kernel(
    hid_ptr,
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
    HAS_MAP: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BN2: gl.constexpr,
    W4: gl.constexpr,
):
    """Layer 2 and the combine of one token (axis 1) for ``BN2`` output columns (axis 0).

    hid float32 ``[T * TOP_K, 8, I / 8]`` (word-permuted, ``I = 32 * KG``); w: w2 as int32
    words ``[E, N, I/8]``, contiguous; s ``[E, N, I/32]``, contiguous; b ``[E, N]``;
    out ``[T, N]`` in its dtype: ``sum_c tw[c] * (hid[c] @ w2[e_c].T + b[e_c])``, the
    ``TOP_K`` choices (padded to ``KP``) on separate warps, summed in a fixed order.
    """
    blk = gl.program_id(0)
    token = gl.program_id(1).to(gl.int64)
    CRG: gl.constexpr = gl.SliceLayout(3, W4)  # [KP, BN2, 32]
    CR: gl.constexpr = gl.SliceLayout(2, CRG)  # [KP, BN2]
    CGW: gl.constexpr = gl.SliceLayout(1, W4)  # [KP, 32, 4]
    choice = gl.arange(0, KP, layout=gl.SliceLayout(1, CR))
    pairs = token * TOP_K + choice
    experts, live = _choices(ids_ptr, emap_ptr, pairs, choice < TOP_K, HAS_MAP)
    weight = gl.load(tw_ptr + pairs, mask=live, other=0.0)
    e64 = gl.where(live, experts, 0).to(gl.int64)

    rows = blk * BN2 + gl.arange(0, BN2, layout=gl.SliceLayout(0, CR))
    row_ok = rows < N
    ok2 = gl.expand_dims(live, 1) & gl.expand_dims(row_ok, 0)  # [KP, BN2]
    lane_g = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, CRG)))
    word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, CGW)))
    h_word = gl.expand_dims(gl.expand_dims(word, 0), 1)  # [1, 1, 4]
    w_word = gl.expand_dims(h_word, 1)  # [1, 1, 1, 4]
    row_v = gl.expand_dims(e64, 1) * (N * KG * 4) + gl.expand_dims(rows.to(gl.int64) * (KG * 4), 0)
    w_base = w_ptr + gl.expand_dims(gl.expand_dims(row_v, 2), 3)  # [KP, BN2, 1, 1]
    s_base = s_ptr + gl.expand_dims(gl.expand_dims(e64, 1) * (N * KG) + gl.expand_dims(rows.to(gl.int64) * KG, 0), 2)
    # The word-permuted intermediate of each choice: [KP, 32 groups, 4 words] per slice j.
    hc = gl.arange(0, KP, layout=gl.SliceLayout(1, gl.SliceLayout(2, CGW)))
    hg = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, CGW)))
    _, h_ok = _choices(ids_ptr, emap_ptr, token * TOP_K + hc, hc < TOP_K, HAS_MAP)
    h_live = gl.expand_dims(gl.expand_dims(h_ok, 1), 2)
    h_base = hid_ptr + gl.expand_dims(gl.expand_dims((token * TOP_K + hc) * (KG * 32), 1), 2)
    JS: gl.constexpr = KG * 4  # words per j slice (I / 8)

    acc = gl.zeros([KP, BN2, 32], gl.float32, layout=CRG)
    for c0 in range(0, KG, 32):
        grp = c0 + lane_g
        g_ok = grp < KG
        voff = gl.expand_dims(gl.expand_dims(gl.expand_dims(grp * 4, 0), 1), 3) + w_word
        smask = gl.expand_dims(ok2, 2) & gl.expand_dims(gl.expand_dims(g_ok, 0), 1)
        packed = gl.load(w_base + voff, mask=gl.expand_dims(smask, 3), other=0)
        s = gl.load(s_base + gl.expand_dims(gl.expand_dims(grp, 0), 1), mask=smask, other=127)
        hoff = gl.expand_dims(gl.expand_dims((c0 + hg) * 4, 0), 2) + h_word
        hm = h_live & gl.expand_dims(gl.expand_dims(c0 + hg < KG, 0), 2)
        h0 = gl.expand_dims(gl.load(h_base + hoff, mask=hm, other=0.0), 1)
        h1 = gl.expand_dims(gl.load(h_base + JS + hoff, mask=hm, other=0.0), 1)
        h2 = gl.expand_dims(gl.load(h_base + 2 * JS + hoff, mask=hm, other=0.0), 1)
        h3 = gl.expand_dims(gl.load(h_base + 3 * JS + hoff, mask=hm, other=0.0), 1)
        h4 = gl.expand_dims(gl.load(h_base + 4 * JS + hoff, mask=hm, other=0.0), 1)
        h5 = gl.expand_dims(gl.load(h_base + 5 * JS + hoff, mask=hm, other=0.0), 1)
        h6 = gl.expand_dims(gl.load(h_base + 6 * JS + hoff, mask=hm, other=0.0), 1)
        h7 = gl.expand_dims(gl.load(h_base + 7 * JS + hoff, mask=hm, other=0.0), 1)
        acc += _group_dot(packed, h0, h1, h2, h3, h4, h5, h6, h7, 3) * _e8m0(s)
    y = gl.sum(acc, axis=2) * 16384.0  # [KP, BN2]
    if HAS_BIAS:
        bo = gl.expand_dims(e64 * stride_be, 1) + gl.expand_dims(rows, 0)
        y += gl.load(b_ptr + bo, mask=ok2, other=0.0).to(gl.float32)
    y = gl.where(gl.expand_dims(live, 1), y, 0.0)  # a remote choice adds nothing (not 0 * NaN)
    out = gl.sum(y * gl.expand_dims(weight, 1), axis=0)
    gl.store(out_ptr + token * stride_ot + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)
