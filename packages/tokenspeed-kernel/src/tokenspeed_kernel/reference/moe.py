"""Reference MoE kernels in plain PyTorch: ``torch_moe_topk`` (``moe.topk``) and
``torch_moe`` (``moe.apply``).

Correct for every feature, weight format and dtype on any device; they compute in float64
when the input is float64 (the check tool's ground truth) and in float32 otherwise, and
round once when writing the output. ``torch_moe`` groups the (token, choice) pairs by expert
and loops over the experts that were hit only, dequantizing one expert's weights at a time.
With ``activation_quant="mxfp8"`` it replaces each GEMM's A operand (x, then the activated
intermediate) by :func:`~tokenspeed_kernel.quant.fake_quantize_mxfp8` of it, computed in the
compute dtype (float32, or float64 for float64 inputs); with ``activation_quant="fp8"`` by
:func:`~tokenspeed_kernel.quant.fake_quantize_fp8_per_token` (per token, or per token and
128-value K group for block-scaled weights).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenspeed_kernel.ops.moe.args import MoEApplyArgs, TopKArgs, Weight
from tokenspeed_kernel.quant import (
    FP8_BLOCK,
    FP8Weight,
    MXFP4Weight,
    dequantize_fp8,
    dequantize_mxfp4,
    fake_quantize_fp8_per_token,
    fake_quantize_mxfp8,
)
from tokenspeed_kernel.registry import Priority, register_kernel

__all__ = ["ACTIVATION_FUNCTIONS", "torch_moe", "torch_moe_topk"]

_ALL_VENDORS = ("cuda", "rocm", "cpu")


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@register_kernel(
    "moe.topk",
    name="torch_moe_topk",
    solution="torch",
    vendors=_ALL_VENDORS,
    features=("softmax", "sigmoid", "renormalize"),
    priority=Priority.REFERENCE,
)
def torch_moe_topk(args: TopKArgs) -> None:
    """Reference router top-k: softmax/sigmoid scores, stable descending sort, renormalize.

    A padding row (a NaN or +inf logit, or every logit -inf) is scored as all zeros, so it
    picks ids ``0..k-1`` (ties -> lower id), and gets weight 0; renormalizing weights that
    sum to 0 leaves them 0 (docs/api.md)."""
    logits = args.router_logits.to(_compute_dtype(args.router_logits))
    pad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)
    logits = logits.masked_fill(pad[:, None], 0.0)
    scores = torch.softmax(logits, dim=-1) if args.scoring == "softmax" else torch.sigmoid(logits)
    # A stable descending sort keeps equal scores in ascending id order (ties -> lower id).
    values, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    values, ids = values[:, : args.top_k], ids[:, : args.top_k]
    if args.renormalize:
        total = values.sum(dim=-1, keepdim=True)
        values = values / torch.where(total > 0, total, torch.ones_like(total))
    values = values.masked_fill(pad[:, None], 0.0)
    args.topk_weights.copy_(values)
    args.topk_ids.copy_(ids)


def _expert(w: Weight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of a stacked weight as a dense ``[N, K]`` tensor in ``dtype``."""
    if isinstance(w, MXFP4Weight):
        return dequantize_mxfp4(MXFP4Weight(w.packed[e], w.scales[e]), dtype)
    if isinstance(w, FP8Weight):
        return dequantize_fp8(FP8Weight(w.data[e], w.scale[e]), dtype)
    return w[e].to(dtype)


def _silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _gelu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate) * up


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


ACTIVATION_FUNCTIONS = {"silu": _silu, "gelu": _gelu, "swiglu_oai": _swiglu_oai}


def _activation_quantizer(args: MoEApplyArgs) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fake quantization of a GEMM's A operand for ``args.activation_quant``, or None."""
    if args.activation_quant == "mxfp8":
        return fake_quantize_mxfp8
    if args.activation_quant == "fp8":
        group = FP8_BLOCK if isinstance(args.w13, FP8Weight) and args.w13.granularity == "block" else None
        return lambda a: fake_quantize_fp8_per_token(a, group)
    return None


@register_kernel(
    "moe.apply",
    name="torch_moe",
    solution="torch",
    vendors=_ALL_VENDORS,
    features=(
        "silu",
        "gelu",
        "swiglu_oai",
        "bias",
        "expert_map",
        "mxfp4",
        "fp8_per_tensor",
        "fp8_per_channel",
        "fp8_block",
        "mxfp8_act",
        "fp8_act",
    ),
    priority=Priority.REFERENCE,
    graph_safe=False,  # groups pairs by expert with counts read on the host (.tolist())
)
def torch_moe(args: MoEApplyArgs) -> None:
    """Reference MoE: group (token, choice) pairs by expert, one dense GEMM pair per expert."""
    compute = _compute_dtype(args.x)
    x = args.x.to(compute)
    quantize = _activation_quantizer(args)
    if quantize is not None:
        x = quantize(x)
    num_tokens, top_k = args.topk_ids.shape
    experts = args.topk_ids.long()
    if args.expert_map is not None:
        experts = args.expert_map.long()[experts]
    experts = experts.reshape(-1)
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)
    weights = args.topk_weights.reshape(-1).to(compute)
    keep = experts >= 0
    experts, tokens, weights = experts[keep], tokens[keep], weights[keep]
    order = torch.sort(experts, stable=True).indices
    experts, tokens, weights = experts[order], tokens[order], weights[order]
    hit, counts = torch.unique_consecutive(experts, return_counts=True)

    act = ACTIVATION_FUNCTIONS[args.activation]
    inter = args.w2.shape[-1]
    acc = torch.zeros(x.shape, dtype=compute, device=x.device)
    start = 0
    for e, n in zip(hit.tolist(), counts.tolist()):
        tok, wt = tokens[start : start + n], weights[start : start + n]
        start += n
        h = x[tok] @ _expert(args.w13, e, compute).T
        if args.w13_bias is not None:
            h = h + args.w13_bias[e].to(compute)
        a = act(h[:, :inter], h[:, inter:])
        if quantize is not None:
            a = quantize(a)
        y = a @ _expert(args.w2, e, compute).T
        if args.w2_bias is not None:
            y = y + args.w2_bias[e].to(compute)
        acc.index_add_(0, tok, y * wt[:, None])
    args.out.copy_(acc)
