"""Helpers shared by the MoE device scripts that sweep and profile (``gluon_moe_bench.py``,
``moe_decode_sweep.py``, ``gluon_moe_ncu.sh``): GPT-OSS-shaped weights and their float64
reference, the torch pipeline baseline (routing included), the MXFP4 bytes per expert, and a
guard that records one case's failure and goes on. Imported as ``moe_common`` (the scripts
run from this folder: ``python3 ci/device/...``).
"""

from __future__ import annotations

import math
import traceback

import torch

from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight, quantize_fp8, quantize_mxfp4


def log(*a) -> None:
    print(*a, flush=True)


def make_weights(e: int, h: int, i: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=device)
    for j in range(e):
        w13[j] = (torch.randn(2 * i, h, generator=gen, device=device) / math.sqrt(h)).bfloat16()
        w2[j] = (torch.randn(h, i, generator=gen, device=device) / math.sqrt(i)).bfloat16()
    b13 = 0.5 * torch.randn(e, 2 * i, generator=gen, device=device)
    b2 = (0.5 * torch.randn(e, h, generator=gen, device=device)).bfloat16()
    return w13, w2, b13, b2


def quantize(w: torch.Tensor, fmt: str):
    if fmt == "bf16":
        return w
    parts = [
        quantize_mxfp4(p) if fmt == "mxfp4" else quantize_fp8(p, fmt.removeprefix("fp8_per_").removeprefix("fp8_"))
        for p in w
    ]
    if fmt == "mxfp4":
        return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scales for p in parts]))
    return FP8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]))


def expert64(w, e: int) -> torch.Tensor:
    if isinstance(w, MXFP4Weight):
        return MXFP4Weight(w.packed[e : e + 1], w.scales[e : e + 1]).dequantize(torch.float64)[0]
    if isinstance(w, FP8Weight):
        return FP8Weight(w.data[e : e + 1], w.scale[e : e + 1]).dequantize(torch.float64)[0]
    return w[e].double()


def act64(name: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return g * torch.sigmoid(g) * u
    g = g.clamp(max=7.0)
    return g * torch.sigmoid(1.702 * g) * (u.clamp(-7.0, 7.0) + 1.0)


def reference64(x, w13, w2, b13, b2, weights, ids, activation, expert_map=None, quant=None):
    """float64 MoE on the device, one expert at a time (``quant``: applied to x and to each
    intermediate, e.g. the fake fp8 activation quantization)."""
    x64 = x.double() if quant is None else quant(x.double())
    out = torch.zeros_like(x64)
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    inter = w2.shape[-1]
    for e in torch.unique(local[local >= 0]).tolist():
        rows, cols = torch.nonzero(local == e, as_tuple=True)
        h = x64[rows] @ expert64(w13, e).T
        if b13 is not None:
            h = h + b13[e].double()
        a_ = act64(activation, h[:, :inter], h[:, inter:])
        y = (a_ if quant is None else quant(a_)) @ expert64(w2, e).T
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, rows, y * weights[rows, cols].double()[:, None])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def torch_pipeline(x, logits, w13, w2, b13, b2, top_k: int, activation: str):
    """The baseline: torch routing, sort by expert, torch._grouped_mm (bf16), no host sync."""
    num_experts, inter = w13.shape[0], w2.shape[-1]
    scores = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    tokens = order // top_k
    experts = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)
    if b13 is not None:
        h = h + b13[experts].to(h.dtype)
    g, u = h[:, :inter].float(), h[:, inter:].float()
    if activation == "silu":
        a = g * torch.sigmoid(g) * u
    else:
        g = g.clamp(max=7.0)
        a = g * torch.sigmoid(1.702 * g) * (u.clamp(-7.0, 7.0) + 1.0)
    y = torch._grouped_mm(a.to(x.dtype), w2.transpose(1, 2), offs=offs)
    if b2 is not None:
        y = y + b2[experts]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def expert_bytes(w, b13, b2) -> float:
    def size(t):
        return t.numel() * t.element_size()

    parts = (
        [w.packed, w.scales] if isinstance(w, MXFP4Weight) else [w.data, w.scale] if isinstance(w, FP8Weight) else [w]
    )
    total = sum(size(p) for p in parts) / parts[0].shape[0]
    return total


def attempt(errors: list, label: str, fn):
    """``fn()``; on an exception log it, record it under ``label`` and return None."""
    try:
        return fn()
    except Exception as exc:  # one failing case must not stop the run
        log(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        errors.append({"case": label, "error": traceback.format_exc()[-1500:]})
        return None
