"""Typed argument objects: what a MoE kernel receives (``moe.topk``, ``moe.apply``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight

__all__ = ["ACTIVATIONS", "ACTIVATION_QUANTS", "ACTIVATION_QUANT_WEIGHTS", "MoEApplyArgs", "TopKArgs", "Weight"]

Weight = torch.Tensor | MXFP4Weight | FP8Weight

ACTIVATIONS = ("silu", "gelu", "swiglu_oai")

# ``activation_quant`` values and the request feature each one adds. "mxfp8": every expert
# GEMM's A operand (x for w13, the activated intermediate for w2) is quantized on the fly
# by :func:`tokenspeed_kernel.quant.quantize_mxfp8` (e4m3 + E8M0 per 32 values along K)
# and the GEMM multiplies the dequantized values. Only with MXFP4 weights. "fp8": the same A
# operands quantized per token (per token and 128-value K group for 128x128 block-scaled
# weights) by :func:`tokenspeed_kernel.quant.quantize_fp8_per_token` (e4m3 + a power-of-two
# float32 scale), so the GEMM runs fp8 x fp8. Only with FP8 weights.
ACTIVATION_QUANTS = {"mxfp8": "mxfp8_act", "fp8": "fp8_act"}
# The weight formats each activation_quant value needs.
ACTIVATION_QUANT_WEIGHTS = {"mxfp8": ("mxfp4",), "fp8": ("fp8_per_tensor", "fp8_per_channel", "fp8_block")}


@dataclass(slots=True)
class TopKArgs:
    """Router scoring and top-k (``moe.topk``).

    Attributes:
        router_logits: ``[T, E]``, bf16/fp16/fp32.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (softmax over all E, then top-k) or ``"sigmoid"``
            (sigmoid per expert, then top-k).
        renormalize: divide the k chosen weights by their sum.
        topk_weights: float32 ``[T, top_k]`` to be written.
        topk_ids: int32 ``[T, top_k]`` to be written (descending weight; ties: lower id).
    """

    router_logits: torch.Tensor
    top_k: int
    scoring: str
    renormalize: bool
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


@dataclass(slots=True)
class MoEApplyArgs:
    """Expert computation and weighted combine (``moe.apply``).

    For each token ``t`` and choice ``j``: ``e = topk_ids[t, j]`` (a global id; with
    ``expert_map`` the local id is ``expert_map[e]`` and ``-1`` contributes nothing),
    ``h = x[t] @ w13[e].T (+ w13_bias[e])``, ``gate, up = h[:I], h[I:]``,
    ``a = act(gate, up)``, ``y = a @ w2[e].T (+ w2_bias[e])``, and
    ``out[t] = sum_j topk_weights[t, j] * y``.

    Activations: ``silu``: ``silu(gate) * up``; ``gelu``: ``gelu(gate) * up`` (tanh-free
    erf GELU); ``swiglu_oai``: ``gate = min(gate, 7)``, ``up = clamp(up, -7, 7)``,
    ``gate * sigmoid(1.702 * gate) * (up + 1)``.

    Attributes:
        x: ``[T, H]``, bf16/fp16/fp32.
        w13: ``[E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up): a tensor in x's dtype,
            an :class:`MXFP4Weight` or an :class:`FP8Weight` of that logical shape.
        w2: ``[E, H, I]``, same kinds as ``w13``.
        topk_weights: float32 ``[T, k]``. topk_ids: int32 ``[T, k]``.
        activation: one of :data:`ACTIVATIONS`.
        w13_bias: ``[E, 2I]`` or None; w2_bias: ``[E, H]`` or None (x's dtype or float32).
        expert_map: int32 ``[E_global]`` or None.
        out: ``[T, H]`` in x's dtype, to be written.
        prepared: what the kernel's ``prepare`` hook made of the weights through
            ``moe_plan`` (e.g. repacked MXFP4), or None on the functional path.
        activation_quant: None (the GEMMs read x and the intermediate as they are) or
            ``"mxfp8"``: before each expert GEMM its A operand, ``x [T, H]`` for ``w13`` and
            the activated intermediate ``a [*, I]`` for ``w2``, is replaced by
            ``fake_quantize_mxfp8(A)`` (:mod:`tokenspeed_kernel.quant`: float8_e4m3fn values,
            one E8M0 scale per 32 consecutive values along K = H or I). Only with MXFP4
            weights (then ``H % 32 == I % 32 == 0``). Kernels see it as the request feature
            ``"mxfp8_act"``. Or ``"fp8"`` (FP8 weights only): the A operands are replaced by
            ``fake_quantize_fp8_per_token(A, 128 if block-scaled weights else None)``;
            request feature ``"fp8_act"``.
    """

    x: torch.Tensor
    w13: Weight
    w2: Weight
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    activation: str
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    expert_map: torch.Tensor | None
    out: torch.Tensor
    prepared: Any = None
    activation_quant: str | None = None
