"""Baselines for ``bench``: what a user without this library would run, in plain torch, and
the peer an engine already has where it is installed (``matmul_ogs``, an optional import).

Each baseline prepares, outside the timed region, whatever it needs from a case's inputs
(gathering a paged cache into a contiguous one, dequantizing weights once) and returns the
function to time, or a reason string when it cannot run this case; a function may carry a
``note`` attribute (str), which its row shows (e.g. its agreement with float64, for a peer
``bench`` would otherwise not check). Baselines that cannot
express sinks or a logit cap run the same attention without them (their names say so in
the bench output as ``-nosinks``): that is the work a user would compare against.

    attention.prefill  sdpa_flash, sdpa_cudnn, sdpa_efficient (torch SDPA backends),
                       flex_attention (compiled, block-sparse causal/window mask)
    attention.decode   gather_sdpa (gather the pages, then SDPA),
                       sdpa_contiguous (SDPA over an unpaged cache of the same length)
    moe.topk           torch_topk (softmax/sigmoid + torch.topk)
    moe.apply          torch_grouped_mm (sort by expert + torch._grouped_mm, bf16 weights),
                       torch_expert_loop (the same with one matmul pair per expert, only
                       where torch._grouped_mm cannot run),
                       matmul_ogs+sort, matmul_ogs-presorted (OpenAI's triton_kernels on the
                       same MXFP4 weights, where importable: :mod:`._ogs`)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight
from tokenspeed_kernel.reference.moe import ACTIVATION_FUNCTIONS
from tokenspeed_kernel.tools import _ogs
from tokenspeed_kernel.tools.cases import AttentionCase, Case, MoECase

__all__ = ["BASELINES", "Baseline", "baselines_for"]

Runner = Callable[[], object]


@dataclass(frozen=True)
class Baseline:
    name: str
    prepare: Callable[[Case, dict[str, Any], torch.device], Runner | str]


def _uniform(case: AttentionCase) -> str | None:
    if len(set(case.seqlens_q)) != 1 or len(set(case.seqlens_k)) != 1:
        return "needs equal lengths across the batch"
    return None


def _dense_qkv(case: AttentionCase, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` views of a uniform ragged batch."""
    b = case.batch
    q = inputs["q"].view(b, case.seqlens_q[0], case.num_q_heads, -1).transpose(1, 2)
    k = inputs["k"].view(b, case.seqlens_k[0], case.num_kv_heads, -1).transpose(1, 2)
    v = inputs["v"].view(b, case.seqlens_k[0], case.num_kv_heads, -1).transpose(1, 2)
    return q, k, v


def _sdpa(backend_name: str) -> Callable[[Case, dict[str, Any], torch.device], Runner | str]:
    def prepare(case, inputs, device):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if device.type != "cuda":
            return "GPU only"
        why = _uniform(case) or ("no sliding window in SDPA" if case.window_left >= 0 else None)
        if why or case.seqlens_q[0] != case.seqlens_k[0]:
            return why or "needs as many queries as keys"
        q, k, v = _dense_qkv(case, inputs)
        backend = getattr(SDPBackend, backend_name)

        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True)

        try:
            run()
        except RuntimeError as exc:
            return f"{backend_name} cannot run: {str(exc).splitlines()[0][:80]}"
        return run

    return prepare


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(case, inputs, device):
    if device.type != "cuda":
        return "GPU only"
    why = _uniform(case)
    if why or case.seqlens_q[0] != case.seqlens_k[0]:
        return why or "needs as many queries as keys"
    from torch.nn.attention.flex_attention import create_block_mask

    window, causal = case.window_left, case.causal

    def mask(b, h, q_idx, kv_idx):
        keep = (q_idx >= kv_idx) if causal else (q_idx >= 0)
        return keep & (q_idx - kv_idx <= window) if window >= 0 else keep

    q, k, v = _dense_qkv(case, inputs)
    length = case.seqlens_q[0]
    block_mask = create_block_mask(mask, None, None, length, length, device=device)
    flex = _compiled_flex()
    return lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def _gather_cache(case: AttentionCase, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged cache gathered to contiguous ``[B, Hkv, L, D]`` (dequantized if fp8)."""
    length, page = case.seqlens_k[0], case.page_size
    table = inputs["page_table"][:, : (length + page - 1) // page].long()
    out = []
    for name, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        rows = inputs[name][table].flatten(1, 2)[:, :length]
        if name in inputs and rows.dtype == torch.float8_e4m3fn:
            rows = rows.to(case.dtype) * inputs[scale]
        out.append(rows.transpose(1, 2))
    return out[0], out[1]


def _decode_q(case: AttentionCase, inputs: dict[str, Any]) -> torch.Tensor:
    q = inputs["q"]
    return (q.unsqueeze(1) if q.dim() == 3 else q).transpose(1, 2)  # [B, Hq, q_len, D]


def _decode_ok(case: AttentionCase, device: torch.device) -> str | None:
    if case.window_left >= 0:
        return "no sliding window in this baseline"
    if case.seqlens_q[0] != 1:
        return "one query per sequence only"
    return _uniform(case)


def _gather_sdpa(case, inputs, device):
    why = _decode_ok(case, device)
    if why:
        return why
    q = _decode_q(case, inputs)

    def run():
        k, v = _gather_cache(case, inputs)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def _sdpa_contiguous(case, inputs, device):
    why = _decode_ok(case, device)
    if why:
        return why
    q = _decode_q(case, inputs)
    k, v = (t.contiguous() for t in _gather_cache(case, inputs))
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _torch_topk(case, inputs, device):
    logits = inputs["router_logits"]
    k = inputs["top_k"]

    def run():
        scores = torch.softmax(logits.float(), -1) if case.scoring == "softmax" else torch.sigmoid(logits.float())
        w, ids = torch.topk(scores, k, dim=-1)
        return (w / w.sum(-1, keepdim=True) if case.renormalize else w), ids.to(torch.int32)

    return run


def _dense_weight(w: Any, dtype: torch.dtype) -> torch.Tensor:
    return w.dequantize(dtype) if isinstance(w, (MXFP4Weight, FP8Weight)) else w.to(dtype)


@functools.cache
def _grouped_mm_missing(device_type: str, index: int | None) -> str | None:
    """Why ``torch._grouped_mm`` (bf16) cannot run on this device, or None when it can."""
    if not hasattr(torch, "_grouped_mm"):
        return "torch._grouped_mm is not in this torch"
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    try:
        x = torch.ones(16, 32, dtype=torch.bfloat16, device=device)
        w = torch.ones(2, 32, 16, dtype=torch.bfloat16, device=device)
        torch._grouped_mm(x, w, offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch._grouped_mm cannot run here: {str(exc).splitlines()[0][:80]}"
    return None


@dataclass(frozen=True)
class _MoEInputs:
    """A moe.apply case's inputs in bf16, dequantized once, outside the timed region."""

    x: torch.Tensor  # [T, H] bf16
    w13: torch.Tensor  # [E, 2I, H] bf16
    w2: torch.Tensor  # [E, H, I] bf16
    b13: torch.Tensor | None  # [E, 2I]
    b2: torch.Tensor | None  # [E, H]
    ids: torch.Tensor  # int32 [T, k]
    weights: torch.Tensor  # float32 [T, k]
    out_dtype: torch.dtype

    @classmethod
    def of(cls, inputs: dict[str, Any]) -> _MoEInputs:
        dtype = torch.bfloat16
        return cls(
            inputs["x"].to(dtype),
            _dense_weight(inputs["w13"], dtype),
            _dense_weight(inputs["w2"], dtype),
            inputs.get("w13_bias"),
            inputs.get("w2_bias"),
            inputs["topk_ids"],
            inputs["topk_weights"],
            inputs["x"].dtype,
        )


def _moe_sorted(m: _MoEInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token of each routed pair, expert of each pair, pair order), sorted by expert."""
    flat = m.ids.reshape(-1).long()
    order = flat.argsort(stable=True)
    return order // m.ids.shape[1], flat[order], order


def _moe_combine(m: _MoEInputs, y: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(m.x.shape, dtype=torch.float32, device=m.x.device)
    out.index_add_(0, tokens, y.float() * m.weights.reshape(-1)[order, None])
    return out.to(m.out_dtype)


def _moe_unsupported(case: MoECase, inputs: dict[str, Any]) -> str | None:
    if inputs.get("expert_map") is not None:
        return "no expert_map in this baseline"
    if case.num_tokens == 0:
        return "no tokens"
    return None


def _torch_grouped_mm(case, inputs, device):
    why = _moe_unsupported(case, inputs) or _grouped_mm_missing(device.type, device.index)
    if why:
        return why
    m = _MoEInputs.of(inputs)
    num_experts, inter = m.w13.shape[0], m.w2.shape[-1]
    bounds = torch.arange(num_experts, device=m.x.device)
    act = ACTIVATION_FUNCTIONS[case.activation]

    def run():
        tokens, experts, order = _moe_sorted(m)
        # end of each expert's group in the sorted pairs; no host sync, so graph-capturable
        offs = torch.searchsorted(experts, bounds, right=True).to(torch.int32)
        h = torch._grouped_mm(m.x[tokens], m.w13.transpose(1, 2), offs=offs)
        if m.b13 is not None:
            h = h + m.b13[experts].to(h.dtype)
        a = act(h[:, :inter].float(), h[:, inter:].float()).to(h.dtype)
        y = torch._grouped_mm(a, m.w2.transpose(1, 2), offs=offs)
        if m.b2 is not None:
            y = y + m.b2[experts].to(y.dtype)
        return _moe_combine(m, y, tokens, order)

    try:
        run()
    except RuntimeError as exc:
        return f"torch._grouped_mm cannot run: {str(exc).splitlines()[0][:80]}"
    return run


def _torch_expert_loop(case, inputs, device):
    """The fallback where ``torch._grouped_mm`` cannot run: one matmul pair per expert hit
    (reads the per-expert counts on the host, so it is timed eagerly)."""
    why = _moe_unsupported(case, inputs)
    if why:
        return why
    if _grouped_mm_missing(device.type, device.index) is None:
        return "torch._grouped_mm runs here (torch_grouped_mm); this loop is its fallback"
    m = _MoEInputs.of(inputs)
    num_experts, inter = m.w13.shape[0], m.w2.shape[-1]
    act = ACTIVATION_FUNCTIONS[case.activation]

    def run():
        tokens, experts, order = _moe_sorted(m)
        counts = torch.bincount(experts, minlength=num_experts).tolist()
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                rows = tokens[start : start + n]
                h = m.x[rows] @ m.w13[e].T
                if m.b13 is not None:
                    h = h + m.b13[e].to(h.dtype)
                a = act(h[:, :inter].float(), h[:, inter:].float()).to(h.dtype)
                y = a @ m.w2[e].T
                ys.append(y + m.b2[e].to(y.dtype) if m.b2 is not None else y)
                start += n
        return _moe_combine(m, torch.cat(ys), tokens, order)

    return run


BASELINES: dict[str, tuple[Baseline, ...]] = {
    "attention.prefill": (
        Baseline("sdpa_flash", _sdpa("FLASH_ATTENTION")),
        Baseline("sdpa_cudnn", _sdpa("CUDNN_ATTENTION")),
        Baseline("sdpa_efficient", _sdpa("EFFICIENT_ATTENTION")),
        Baseline("flex_attention", _flex),
    ),
    "attention.extend": (),
    "attention.decode": (Baseline("gather_sdpa", _gather_sdpa), Baseline("sdpa_contiguous", _sdpa_contiguous)),
    "kvcache.store": (),
    "moe.topk": (Baseline("torch_topk", _torch_topk),),
    "moe.apply": (
        Baseline("torch_grouped_mm", _torch_grouped_mm),
        Baseline("torch_expert_loop", _torch_expert_loop),
        Baseline("matmul_ogs+sort", _ogs.prepare_sorting),
        Baseline("matmul_ogs-presorted", _ogs.prepare_presorted),
    ),
}


def baselines_for(op: str) -> tuple[Baseline, ...]:
    return BASELINES.get(op, ())
