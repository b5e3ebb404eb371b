"""Model configuration: GPT-OSS-120B layer dimensions, and a tiny variant for CPU tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

__all__ = ["GptOssConfig"]


@dataclass(frozen=True)
class GptOssConfig:
    """Dimensions and options of a GPT-OSS-shaped decoder.

    Layer ``i`` uses a sliding window of ``sliding_window`` tokens (the current token
    included) when ``layer_types[i] == "sliding"`` and full causal attention otherwise;
    GPT-OSS alternates them starting with a sliding layer. Attention has learned per-head
    sinks and biased q/k/v/o projections; the MoE has ``num_experts`` experts, ``top_k`` per
    token (softmax over the router logits, top-k, renormalized), biased expert GEMMs, the
    ``swiglu_oai`` activation and MXFP4 expert weights. RoPE is plain (no YaRN scaling).

    Attributes:
        vocab_size: rows of the embedding and the (untied) LM head.
        hidden_size: ``H``; a multiple of 32 (the MXFP4 block) for the expert weights.
        num_layers: decoder layers.
        num_q_heads / num_kv_heads / head_dim: attention heads (``Hq % Hkv == 0``).
        sliding_window: tokens a sliding layer sees, the current one included
            (``window_left = sliding_window - 1`` in the API's terms).
        num_experts / top_k / intermediate_size: the MoE (``I`` a multiple of 32).
        swiglu_limit / swiglu_alpha: the ``swiglu_oai`` constants (fixed by the API: 7, 1.702).
        rope_theta: RoPE base. rms_eps: RMSNorm epsilon.
        dtype: activation and dense weight dtype (bfloat16 in serving; float32 for tight checks).
    """

    vocab_size: int = 201088
    hidden_size: int = 2880
    num_layers: int = 2
    num_q_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 64
    sliding_window: int = 128
    num_experts: int = 128
    top_k: int = 4
    intermediate_size: int = 2880
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    rope_theta: float = 150000.0
    rms_eps: float = 1e-5
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads {self.num_q_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("hidden_size", "intermediate_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} must be a multiple of 32 (the MXFP4 block), got {getattr(self, name)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must lie in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.sliding_window < 1 or self.num_layers < 1:
            raise ValueError("sliding_window and num_layers must be >= 1")

    @property
    def layer_types(self) -> tuple[str, ...]:
        """``"sliding"`` or ``"full"`` per layer, alternating, the first one sliding."""
        return tuple("sliding" if i % 2 == 0 else "full" for i in range(self.num_layers))

    def window_left(self, layer: int) -> int:
        """The API's ``window_left`` of ``layer``: ``sliding_window - 1`` or ``-1`` (no window)."""
        return self.sliding_window - 1 if self.layer_types[layer] == "sliding" else -1

    def replace(self, **changes) -> GptOssConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def gpt_oss_120b(cls, num_layers: int = 2, **changes) -> GptOssConfig:
        """GPT-OSS-120B dimensions with ``num_layers`` layers (the real model has 36)."""
        return cls(num_layers=num_layers, **changes)

    @classmethod
    def tiny(cls, **changes) -> GptOssConfig:
        """A CPU-test size: 2 layers (window 6, full), hidden 64, 4 q / 2 KV heads of dim 64,
        4 experts top-2 with intermediate 64, vocab 128."""
        base = dict(
            vocab_size=128,
            hidden_size=64,
            num_layers=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=64,
            sliding_window=6,
            num_experts=4,
            top_k=2,
            intermediate_size=64,
            rope_theta=10000.0,
        )
        base.update(changes)
        return cls(**base)
