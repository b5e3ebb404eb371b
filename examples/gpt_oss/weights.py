"""Random, seeded weights of a GPT-OSS-shaped decoder; MXFP4 expert weights.

Dense weights are in ``cfg.dtype``; the expert GEMM weights are quantized to MXFP4 with the
core's :func:`tokenspeed_kernel.quant.quantize_mxfp4` one expert at a time (bounded
memory at 128 experts); expert biases and attention sinks are float32 (the APIs accept
float32 biases, and sinks must be float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from examples.gpt_oss.config import GptOssConfig
from tokenspeed_kernel.quant import MXFP4Weight, quantize_mxfp4

__all__ = ["LayerWeights", "ModelWeights", "random_weights"]


@dataclass
class LayerWeights:
    """One decoder layer. ``QKV = (Hq + 2·Hkv)·D``.

    Attributes:
        attn_norm: ``[H]`` RMSNorm weight before attention.
        wqkv: ``[QKV, H]`` fused q/k/v projection (rows: q heads, then k heads, then v heads);
            bqkv: ``[QKV]``.
        wo: ``[H, Hq·D]``; bo: ``[H]``.
        sinks: float32 ``[Hq]`` learned per-head sink logits.
        mlp_norm: ``[H]`` RMSNorm weight before the MoE.
        router_w: ``[E, H]``; router_b: ``[E]``.
        w13: MXFP4 ``[E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up); b13: float32 ``[E, 2I]``.
        w2: MXFP4 ``[E, H, I]``; b2: float32 ``[E, H]``.
    """

    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor
    wo: torch.Tensor
    bo: torch.Tensor
    sinks: torch.Tensor
    mlp_norm: torch.Tensor
    router_w: torch.Tensor
    router_b: torch.Tensor
    w13: MXFP4Weight
    b13: torch.Tensor
    w2: MXFP4Weight
    b2: torch.Tensor


@dataclass
class ModelWeights:
    """Embedding ``[V, H]``, layers, final RMSNorm ``[H]`` and the untied LM head ``[V, H]``."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor


def _experts_mxfp4(
    num_experts: int, rows: int, cols: int, std: float, gen: torch.Generator, device: torch.device
) -> MXFP4Weight:
    packed = torch.empty(num_experts, rows, cols // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(num_experts, rows, cols // 32, dtype=torch.uint8, device=device)
    for e in range(num_experts):
        q = quantize_mxfp4(torch.randn(rows, cols, generator=gen, device=device) * std)
        packed[e], scales[e] = q.packed, q.scales
    return MXFP4Weight(packed, scales)


def random_weights(cfg: GptOssConfig, device: torch.device | str = "cpu", seed: int = 0) -> ModelWeights:
    """Seeded random weights for ``cfg`` on ``device`` (the same seed gives the same weights
    on the same device type). Scales keep activations O(1): projections ``~N(0, 1/fan_in)``,
    router logits with a spread of about 2 so top-k choices are not near ties."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, d, dt = cfg.hidden_size, cfg.head_dim, cfg.dtype
    qkv = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * d

    def randn(*shape: int, std: float = 1.0, dtype: torch.dtype = dt) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    def norm_weight() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(h, generator=gen, device=device)).to(dt)

    layers = []
    for _ in range(cfg.num_layers):
        layers.append(
            LayerWeights(
                attn_norm=norm_weight(),
                wqkv=randn(qkv, h, std=1 / math.sqrt(h)),
                bqkv=randn(qkv, std=0.1),
                wo=randn(h, cfg.num_q_heads * d, std=1 / math.sqrt(cfg.num_q_heads * d)),
                bo=randn(h, std=0.1),
                sinks=randn(cfg.num_q_heads, dtype=torch.float32),
                mlp_norm=norm_weight(),
                router_w=randn(cfg.num_experts, h, std=2 / math.sqrt(h)),
                router_b=randn(cfg.num_experts, std=0.1),
                w13=_experts_mxfp4(cfg.num_experts, 2 * cfg.intermediate_size, h, 1 / math.sqrt(h), gen, device),
                b13=randn(cfg.num_experts, 2 * cfg.intermediate_size, std=0.1, dtype=torch.float32),
                w2=_experts_mxfp4(
                    cfg.num_experts, h, cfg.intermediate_size, 1 / math.sqrt(cfg.intermediate_size), gen, device
                ),
                b2=randn(cfg.num_experts, h, std=0.1, dtype=torch.float32),
            )
        )
    return ModelWeights(
        embed=randn(cfg.vocab_size, h),
        layers=layers,
        final_norm=norm_weight(),
        lm_head=randn(cfg.vocab_size, h, std=1 / math.sqrt(h)),
    )
