"""The decoder through the public tokenspeed-kernel APIs only.

Attention: ``store_kvcache`` then one ``mha_prefill_plan`` / ``mha_extend_plan`` /
``mha_decode_step_plan`` per pass and layer kind (checked and selected once, run by every
layer with its own tensors; window and sinks per layer), or for a serving decode batch
one ``mha_decode_plan`` per layer (:meth:`GptOssModel.plan_decode`: selected once, planned
for the batch tables, ``plan.run(q)`` per step); MoE: ``moe_topk`` and a ``moe_plan`` per
layer made once at load (the selected kernel may repack the MXFP4 weights there), applied
every step. Embedding, RMSNorm, RoPE, projections and the LM head are plain torch, written
for few launches: ``F.rms_norm``; the rotary tables once per forward pass (three ops), then
per layer q and k rotated together, in place in the fused qkv (three ops); q, k and v stay
views of the qkv rows (the APIs read row-strided q and K/V, the decode plans made with the
rows' stride; a copy only where a call wants a contiguous tensor). Nothing here names a
vendor: kernels are chosen by the selector unless the caller passes :class:`Overrides`
(kernel names per operator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from examples.gpt_oss.config import GptOssConfig
from examples.gpt_oss.kvcache import ForwardBatch, PagedKVCache
from examples.gpt_oss.weights import LayerWeights, ModelWeights
from tokenspeed_kernel import (
    DecodePlan,
    DecodeStepPlan,
    ExtendPlan,
    MoEPlan,
    PrefillPlan,
    mha_decode_plan,
    mha_decode_step_plan,
    mha_extend_plan,
    mha_prefill_plan,
    moe_plan,
    moe_topk,
    store_kvcache,
)

__all__ = ["GptOssModel", "Overrides", "apply_rope", "rms_norm", "rope_inv_freq", "rope_tables", "rotated_qkv"]


@dataclass(frozen=True)
class Overrides:
    """Kernel names forced per operator (None: the selector's choice), passed to each call
    as ``override=``."""

    prefill: str | None = None
    extend: str | None = None
    decode: str | None = None
    store: str | None = None
    topk: str | None = None
    moe: str | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [T, H]`` with ``weight [H]`` (x's dtype), computed in float32 and rounded
    once to x's dtype: ``F.rms_norm``, one fused kernel on CUDA (weight and x of one dtype),
    torch's float32 composite elsewhere."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """float32 ``[D]``: the rotary frequencies ``f_i = theta^(-i / (D/2))``, ``i < D/2``, as
    ``[-f, f]`` (the first half negated: :func:`rope_tables` then yields the sign-folded sine).
    Made once per model."""
    half = head_dim // 2
    freq = theta ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
    return torch.cat([-freq, freq])


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, float32 ``[T, 1, D]``, of int64 ``positions [T]`` for :func:`apply_rope`,
    from :func:`rope_inv_freq`'s ``inv_freq``: angle ``p · f_i`` (rounded to float32), ``cos`` of it
    in both halves, ``sin`` negated in the first half. Made once per forward pass, shared by
    every layer and by q and k (three aten ops)."""
    angles = positions[:, None, None] * inv_freq  # int64 x float32 -> float32 [T, 1, D]
    return angles.cos(), angles.sin()


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotary embedding (rotate-half / NeoX layout: pairs ``(i, i + D/2)``) of ``x [T, heads, D]``
    (rows of any stride, each row's ``heads · D`` values contiguous, as a fused qkv's columns)
    with :func:`rope_tables`' ``cos``/``sin``: ``x · cos + swap_halves(x) · sin`` in float32,
    rounded once to x's dtype, written to ``out`` (x's shape and dtype, any strides; may be
    ``x`` itself: rotated in place) or a new tensor, which is returned. Three aten ops."""
    t, heads, d = x.shape
    swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return torch.addcmul(x * cos, swapped, sin, out=torch.empty_like(x) if out is None else out)


def rotated_qkv(
    qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, rope: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` of a fused projection ``qkv [T, (Hq + 2·Hkv)·D]`` (columns: q heads, k
    heads, v heads; ``D`` from ``rope``'s tables), q and k rotated together in place
    (:func:`apply_rope` over the first ``(Hq + Hkv)·D`` columns): views ``[T, Hq, D]``,
    ``[T, Hkv, D]``, ``[T, Hkv, D]`` whose rows keep qkv's stride (contiguous when ``T == 1``)."""
    t, d = qkv.shape[0], rope[0].shape[-1]
    qk = qkv[:, : (num_q_heads + num_kv_heads) * d].view(t, num_q_heads + num_kv_heads, d)
    apply_rope(qk, *rope, out=qk)
    return qk[:, :num_q_heads], qk[:, num_q_heads:], qkv[:, (num_q_heads + num_kv_heads) * d :].view(t, num_kv_heads, d)


class GptOssModel:
    """A GPT-OSS-shaped decoder served through the public APIs.

    Args:
        cfg: dimensions and activation dtype.
        weights: from :func:`examples.gpt_oss.weights.random_weights` (same device).
        overrides: kernels to force per operator (default: the selector decides).
    """

    def __init__(self, cfg: GptOssConfig, weights: ModelWeights, overrides: Overrides | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.overrides = overrides or Overrides()
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, weights.embed.device)
        self.plans: list[MoEPlan] = [
            moe_plan(
                layer.w13,
                layer.w2,
                x_dtype=cfg.dtype,
                top_k=cfg.top_k,
                activation="swiglu_oai",
                w13_bias=layer.b13,
                w2_bias=layer.b2,
                override=self.overrides.moe,
            )
            for layer in weights.layers
        ]

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Hidden states ``[T, H]`` (before the final norm) of the ``T`` new tokens
        ``input_ids`` (int64 ``[T]``, ordered as ``batch``); writes their K/V to ``kv``."""
        rope = rope_tables(batch.positions, self.inv_freq)
        h = F.embedding(input_ids, self.w.embed)
        for i, layer in enumerate(self.w.layers):
            h = h + self._attention(i, layer, rms_norm(h, layer.attn_norm, self.cfg.rms_eps), batch, kv, rope)
            h = h + self._moe(i, layer, rms_norm(h, layer.mlp_norm, self.cfg.rms_eps))
        return h

    def plan_decode(self, batch: ForwardBatch, kv: PagedKVCache, *, capturable: bool = False) -> list[DecodePlan]:
        """One decode plan per layer over ``batch``'s tables (a :meth:`PagedKVCache.decode_batch`),
        stored in ``batch.decode_plans`` so :meth:`forward` runs them. ``capturable``: the
        step will be captured in a CUDA graph (only graph-safe kernels are selected).

        The caller updates the plans (``plan.update()``) after rewriting the tables in place
        and before the step that reads them, outside capture; see ``DecodeRunner``."""
        cfg, ov = self.cfg, self.overrides
        plans = []
        for i, layer in enumerate(self.w.layers):
            plan = mha_decode_plan(
                kv.k[i],
                kv.v[i],
                batch.page_table,
                batch.cache_seqlens,
                batch.max_seqlen_k,
                num_q_heads=cfg.num_q_heads,
                q_dtype=cfg.dtype,
                window_left=cfg.window_left(i),
                sinks=layer.sinks,
                override=ov.decode,
                capturable=capturable,
                q_row_stride=(cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,  # q: a view of qkv's rows
            )
            plans.append(plan)
        batch.decode_plans = plans
        return plans

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, V]`` of hidden states ``[N, H]``."""
        return (rms_norm(hidden, self.w.final_norm, self.cfg.rms_eps) @ self.w.lm_head.T).float()

    def _attention(
        self,
        i: int,
        layer: LayerWeights,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedKVCache,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        cfg, ov = self.cfg, self.overrides
        t, d, hq, hkv = x.shape[0], cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
        q, k, v = rotated_qkv(F.linear(x, layer.wqkv, layer.bqkv), hq, hkv, rope)  # rows with qkv's stride
        if batch.mode == "prefill":  # mha_prefill reads contiguous K/V
            k, v = k.contiguous(), v.contiguous()
        k_cache, v_cache = kv.k[i], kv.v[i]
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping, override=ov.store)  # row-strided K/V too
        common = dict(window_left=cfg.window_left(i), sinks=layer.sinks)
        if batch.decode_plans is not None:
            out = batch.decode_plans[i].run(q)  # planned with qkv's row stride: read in place
        else:  # the step plans read q row-strided, laid out as their first call's
            # one plan per pass and layer kind (the window): the first layer of the kind makes it
            plan = batch.step_plans.get(cfg.window_left(i))
            keys = (k, v) if batch.mode == "prefill" else (k_cache, v_cache)
            if plan is None:
                plan = batch.step_plans[cfg.window_left(i)] = self._step_plan(batch, q, *keys, **common)
            out = plan.run(q, *keys, sinks=layer.sinks)
        return F.linear(out.view(t, hq * d), layer.wo, layer.bo)

    def _step_plan(
        self, batch: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **common
    ) -> PrefillPlan | ExtendPlan | DecodeStepPlan:
        """The pass's prefill plan (``k``, ``v``: this layer's new keys and values), extend or
        eager decode plan (``k``, ``v``: this layer's paged caches) for ``common``'s window and
        sinks."""
        ov = self.overrides
        if batch.mode == "prefill":
            lengths = (batch.cu_seqlens_q, batch.cu_seqlens_k, batch.max_seqlen_q, batch.max_seqlen_k)
            return mha_prefill_plan(q, k, v, *lengths, override=ov.prefill, **common)
        if batch.mode == "decode":
            tables = (batch.page_table, batch.cache_seqlens, batch.max_seqlen_k)
            return mha_decode_step_plan(q, k, v, *tables, override=ov.decode, **common)
        tables = (batch.page_table, batch.cu_seqlens_q, batch.cache_seqlens, batch.max_seqlen_q, batch.max_seqlen_k)
        return mha_extend_plan(q, k, v, *tables, override=ov.extend, **common)

    def _moe(self, i: int, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, layer.router_w, layer.router_b)
        topk_weights, topk_ids = moe_topk(router_logits, self.cfg.top_k, override=self.overrides.topk)
        return self.plans[i].apply(x, topk_weights, topk_ids)
