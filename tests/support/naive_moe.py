"""An independent, deliberately plain float64 MoE, for checking kernels.

Written without ``tokenspeed_kernel.quant`` or the reference kernels: its own activation
formulas, its own MXFP4 decoding from the bit layout, its own fp8 scale expansion, and a
loop over tokens and their choices. Slow; meant for tiny shapes.

Signatures (all results float64 on the inputs' device):

``naive_topk(router_logits, top_k, *, scoring="softmax", renormalize=True)``
    ``router_logits [T, E]`` any float dtype → ``(weights float64 [T, k], ids int64 [T, k])``,
    descending weight, ties → lower id.

``naive_moe(x, w13, w2, topk_weights, topk_ids, *, activation="silu", w13_bias=None,
w2_bias=None, expert_map=None, activation_quant=None)``
    Same arguments as ``tokenspeed_kernel.moe_apply`` (weights may be tensors or
    MXFP4Weight/FP8Weight containers, read only through their public fields) →
    ``out float64 [T, H]``. ``activation_quant="mxfp8"`` passes x and each intermediate
    row through :func:`naive_fake_mxfp8` first; ``"fp8"`` through :func:`naive_fake_fp8_token`
    (groups of 128 along K when the weights carry 128x128 block scales, else whole rows).

``naive_fake_fp8_token(v, group=None)``
    ``v [..., K]`` → float64: each row (or each run of ``group`` values of a row) scaled by
    ``2**-e``, ``e`` the smallest integer with ``amax <= 448 * 2**e`` found by stepping
    (clamped to [-100, 126]; a zero group gets -100), every scaled value replaced by the
    nearest finite e4m3 value (ties → even code), times ``2**e``.

``naive_fake_mxfp8(v)``
    ``v [..., K]`` (K % 32 == 0) → float64: each block of 32 values scaled by
    ``2**e`` with ``e = floor(log2(amax)) - 8`` (clamped to [-127, 127]; ``-127`` for a zero
    block), every scaled value replaced by the NEAREST finite float8_e4m3fn value (enumerated
    from the bit layout; ties → even mantissa code, so beyond ±448 the nearest is ±448),
    times ``2**e``. A block with a non-finite value becomes NaN.

``dense_weight(w)``
    Any weight (tensor, MXFP4Weight, FP8Weight) → float64 dense tensor ``[E, N, K]``.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "decode_e2m1",
    "decode_fp8",
    "decode_mxfp4",
    "dense_weight",
    "e4m3_values",
    "naive_fake_fp8_token",
    "naive_fake_mxfp8",
    "naive_moe",
    "naive_topk",
]


def naive_topk(router_logits, top_k, *, scoring="softmax", renormalize=True):
    logits = router_logits.detach().to("cpu", torch.float64)
    t, e = logits.shape
    weights = torch.zeros(t, top_k, dtype=torch.float64)
    ids = torch.zeros(t, top_k, dtype=torch.int64)
    for row in range(t):
        vals = [float(v) for v in logits[row]]
        if scoring == "softmax":
            m = max(vals)
            exps = [math.exp(v - m) for v in vals]
            total = sum(exps)
            scores = [v / total for v in exps]
        elif scoring == "sigmoid":
            scores = [1.0 / (1.0 + math.exp(-v)) for v in vals]
        else:
            raise ValueError(scoring)
        order = sorted(range(e), key=lambda j: (-scores[j], j))[:top_k]
        chosen = [scores[j] for j in order]
        if renormalize:
            s = sum(chosen)
            chosen = [c / s for c in chosen]
        weights[row] = torch.tensor(chosen, dtype=torch.float64)
        ids[row] = torch.tensor(order)
    return weights.to(router_logits.device), ids.to(router_logits.device)


def decode_e2m1(code: int) -> float:
    """One 4-bit E2M1 code: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp = (code >> 1) & 0b11
    man = code & 0b1
    if exp == 0:
        return sign * 0.5 * man  # subnormal: 0 or 0.5
    return sign * 2.0 ** (exp - 1) * (1.0 + 0.5 * man)


_E2M1_BY_CODE = torch.tensor([decode_e2m1(c) for c in range(16)], dtype=torch.float64)


def decode_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``packed`` uint8 ``[..., N, K/2]`` (low nibble = even element) and E8M0 ``scales``
    uint8 ``[..., N, K/32]`` → float64 ``[..., N, K]``."""
    packed = packed.to("cpu")
    low = (packed & 0xF).long()
    high = (packed >> 4).long()
    codes = torch.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=torch.long)
    codes[..., 0::2] = low
    codes[..., 1::2] = high
    values = _E2M1_BY_CODE[codes]
    exps = scales.to("cpu").double() - 127.0
    block_scale = torch.where(scales.to("cpu") == 255, torch.nan, torch.exp2(exps))
    per_value = block_scale.repeat_interleave(32, dim=-1)
    return values * per_value


def decode_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn ``data [..., N, K]`` times its float32 ``scale`` (``[..., 1, 1]``,
    ``[..., N, 1]`` or 128x128 blocks ``[..., ceil(N/128), ceil(K/128)]``) → float64."""
    values = data.to("cpu").to(torch.float64)
    s = scale.to("cpu").to(torch.float64)
    n, k = values.shape[-2:]
    sn, sk = s.shape[-2:]
    if (sn, sk) == (1, 1) or (sn, sk) == (n, 1):
        return values * s  # broadcasts
    rows = torch.arange(n) // 128
    cols = torch.arange(k) // 128
    expanded = s[..., rows, :][..., :, cols]
    return values * expanded


def dense_weight(w) -> torch.Tensor:
    if hasattr(w, "packed"):
        return decode_mxfp4(w.packed, w.scales)
    if hasattr(w, "data") and not isinstance(w, torch.Tensor):
        return decode_fp8(w.data, w.scale)
    return w.detach().to("cpu", torch.float64)


def e4m3_values() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite float8_e4m3fn value (float64) and its code, from the bit layout: sign bit 7,
    exponent bits 6-3 (bias 7; 0 = subnormal, 2**-6 * m/8), mantissa bits 2-0; 0x7F/0xFF NaN."""
    values, codes = [], []
    for code in range(256):
        exp, man = (code >> 3) & 0xF, code & 0x7
        if exp == 0xF and man == 0x7:
            continue
        mag = 2.0**-6 * man / 8 if exp == 0 else 2.0 ** (exp - 7) * (1 + man / 8)
        values.append(-mag if code & 0x80 else mag)
        codes.append(code)
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


_E4M3, _E4M3_CODES = e4m3_values()


def naive_fake_mxfp8(v: torch.Tensor) -> torch.Tensor:
    blocks = v.detach().to("cpu", torch.float64).reshape(-1, 32)
    amax = [float(a) for a in blocks.abs().amax(dim=1)]
    exps = [
        0 if not math.isfinite(a) else -127 if a == 0 else min(max(math.frexp(a)[1] - 1 - 8, -127), 127) for a in amax
    ]
    factor = torch.tensor([2.0**e for e in exps], dtype=torch.float64)[:, None]
    scaled = blocks / factor
    dist = (scaled[..., None] - _E4M3).abs()  # [blocks, 32, every finite e4m3 value]
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    odd = (_E4M3_CODES & 1).to(torch.float64)
    pick = torch.where(nearest, odd, torch.full_like(dist, 2.0)).argmin(dim=-1)
    out = _E4M3[pick] * factor
    bad = torch.tensor([not math.isfinite(a) for a in amax])
    out[bad] = float("nan")
    return out.reshape(v.shape)


def _nearest_e4m3(scaled: torch.Tensor) -> torch.Tensor:
    dist = (scaled[..., None] - _E4M3).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    odd = (_E4M3_CODES & 1).to(torch.float64)
    return _E4M3[torch.where(nearest, odd, torch.full_like(dist, 2.0)).argmin(dim=-1)]


def naive_fake_fp8_token(v: torch.Tensor, group: int | None = None) -> torch.Tensor:
    rows = v.detach().to("cpu", torch.float64).reshape(-1, v.shape[-1])
    out = torch.empty_like(rows)
    k = rows.shape[1]
    size = k if group is None else group
    for r in range(rows.shape[0]):
        for g0 in range(0, k, size):
            chunk = rows[r, g0 : g0 + size]
            amax = float(chunk.abs().max())
            e = -100
            while e < 126 and amax > 448.0 * 2.0**e:
                e += 1
            out[r, g0 : g0 + size] = _nearest_e4m3(chunk / 2.0**e) * 2.0**e
    return out.reshape(v.shape)


def _activation(name: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return gate / (1.0 + torch.exp(-gate)) * up
    if name == "gelu":
        return 0.5 * gate * (1.0 + torch.erf(gate / math.sqrt(2.0))) * up
    if name == "swiglu_oai":
        g = torch.minimum(gate, torch.full_like(gate, 7.0))
        u = torch.maximum(torch.minimum(up, torch.full_like(up, 7.0)), torch.full_like(up, -7.0))
        return g / (1.0 + torch.exp(-1.702 * g)) * (u + 1.0)
    raise ValueError(name)


def naive_moe(
    x,
    w13,
    w2,
    topk_weights,
    topk_ids,
    *,
    activation="silu",
    w13_bias=None,
    w2_bias=None,
    expert_map=None,
    activation_quant=None,
):
    device = x.device
    xd = x.detach().to("cpu", torch.float64)
    if activation_quant == "mxfp8":
        xd = naive_fake_mxfp8(xd)
    group = 128 if hasattr(w13, "scale") and w13.scale.shape[-1] > 1 else None  # fp8 128x128 block scales
    if activation_quant == "fp8":
        xd = naive_fake_fp8_token(xd, group)
    a = dense_weight(w13)
    b = dense_weight(w2)
    inter = b.shape[-1]
    bias1 = None if w13_bias is None else w13_bias.to("cpu", torch.float64)
    bias2 = None if w2_bias is None else w2_bias.to("cpu", torch.float64)
    mapping = None if expert_map is None else expert_map.to("cpu").tolist()
    ids = topk_ids.to("cpu").tolist()
    wts = topk_weights.to("cpu", torch.float64)
    out = torch.zeros(xd.shape, dtype=torch.float64)
    for t in range(xd.shape[0]):
        for j, e in enumerate(ids[t]):
            local = e if mapping is None else mapping[e]
            if local < 0:
                continue
            h = a[local] @ xd[t]
            if bias1 is not None:
                h = h + bias1[local]
            act = _activation(activation, h[:inter], h[inter:])
            if activation_quant == "mxfp8":
                act = naive_fake_mxfp8(act)
            if activation_quant == "fp8":
                act = naive_fake_fp8_token(act, group)
            y = b[local] @ act
            if bias2 is not None:
                y = y + bias2[local]
            out[t] += wts[t, j] * y
    return out.to(device)
