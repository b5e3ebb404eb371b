"""The same decoder as a user without this library would write it, in plain PyTorch.

- The glue (embedding, RMSNorm, rotary embedding, projections) is the library path's own
  (:mod:`examples.gpt_oss.model`: ``F.rms_norm``, the rotary tables once per forward pass,
  q and k rotated together in place), so the comparison is of attention and MoE only.
- K/V are written to the same paged cache with ``index_copy_`` on the slot mapping (from the
  fused qkv's row-strided views).
- Attention is ``scaled_dot_product_attention`` over K/V gathered from the pages through
  the page table (prefill: over the prompt's own K/V). GQA is folded into the query rows
  (the ``G`` query heads of a KV head become ``G·Lq`` rows), the causal/window structure is
  an additive float mask, and the sink is one extra all-zero key whose mask entry is the
  sink logit (it joins the softmax denominator and adds nothing to the output). Gathered
  slots past a sequence are zeroed (masked keys still enter ``p·v``; an uninitialized slot
  holding NaN would poison it).
- Routing is softmax → top-k → renormalize in float32; experts run as a grouped GEMM
  (``torch._grouped_mm`` on tokens sorted by expert) with the MXFP4 weights dequantized to
  ``cfg.dtype`` once at load; a per-expert loop where grouped GEMMs are unavailable.

Decode has static shapes and no host sync (capturable in a CUDA graph); prefill/extend
loop over sequences with the host lengths carried by :class:`ForwardBatch`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from examples.gpt_oss.config import GptOssConfig
from examples.gpt_oss.kvcache import ForwardBatch, PagedKVCache
from examples.gpt_oss.model import rms_norm, rope_inv_freq, rope_tables, rotated_qkv
from examples.gpt_oss.weights import ModelWeights
from tokenspeed_kernel.quant import MXFP4Weight, dequantize_mxfp4

__all__ = ["TorchGptOss", "dequantize_experts"]

_KEY_ALIGN = 16  # pad the key axis so the mask rows are 16-element aligned (SDPA kernels want it)
_QUERY_CHUNK = 1024  # prefill query rows per SDPA call (bounds the float mask's memory)


def dequantize_experts(w: MXFP4Weight, dtype: torch.dtype) -> torch.Tensor:
    """``[E, N, K]`` in ``dtype`` from an MXFP4 weight, one expert at a time (bounded memory)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    for e in range(w.shape[0]):
        out[e] = dequantize_mxfp4(MXFP4Weight(w.packed[e], w.scales[e]), dtype)
    return out


class TorchGptOss:
    """The plain-PyTorch decoder; same interface as :class:`examples.gpt_oss.model.GptOssModel`."""

    def __init__(self, cfg: GptOssConfig, weights: ModelWeights) -> None:
        self.cfg = cfg
        self.w = weights
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, weights.embed.device)
        self.w13 = [dequantize_experts(layer.w13, cfg.dtype) for layer in weights.layers]
        self.w2 = [dequantize_experts(layer.w2, cfg.dtype) for layer in weights.layers]
        self.grouped = hasattr(torch, "_grouped_mm") and (self.device.type == "cpu" or cfg.dtype == torch.bfloat16)

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """Hidden states ``[T, H]`` of the new tokens; writes their K/V to ``kv``."""
        rope = rope_tables(batch.positions, self.inv_freq)
        h = F.embedding(input_ids, self.w.embed)
        for i, layer in enumerate(self.w.layers):
            x = rms_norm(h, layer.attn_norm, self.cfg.rms_eps)
            h = h + self._attention(i, x, batch, kv, rope)
            x = rms_norm(h, layer.mlp_norm, self.cfg.rms_eps)
            h = h + self._moe(i, x)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[N, V]``."""
        return (rms_norm(hidden, self.w.final_norm, self.cfg.rms_eps) @ self.w.lm_head.T).float()

    # ------------------------------------------------------------------ attention

    def _attention(
        self, i: int, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        cfg, layer = self.cfg, self.w.layers[i]
        t, d, hq, hkv = x.shape[0], cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
        q, k, v = rotated_qkv(F.linear(x, layer.wqkv, layer.bqkv), hq, hkv, rope)  # the library path's glue
        flat = (-1, hkv, d)
        kv.k[i].view(flat).index_copy_(0, batch.slot_mapping, k)
        kv.v[i].view(flat).index_copy_(0, batch.slot_mapping, v)
        window = cfg.window_left(i)
        if batch.mode == "decode":
            keys, values = self._gather(kv.k[i], kv.v[i], batch.page_table)
            out = self._sdpa(q.unsqueeze(1), keys, values, batch.cache_seqlens, 1, window, layer.sinks)
            return F.linear(out.reshape(t, hq * d), layer.wo, layer.bo)
        outs = []
        starts = [0]
        for n in batch.q_lens:
            starts.append(starts[-1] + n)
        for b, (q_len, k_len) in enumerate(zip(batch.q_lens, batch.k_lens)):
            qb = q[starts[b] : starts[b + 1]]
            if batch.mode == "prefill":
                keys, values = k[starts[b] : starts[b + 1]], v[starts[b] : starts[b + 1]]
            else:
                pages = -(-k_len // kv.page_size)
                keys, values = self._gather(kv.k[i], kv.v[i], batch.page_table[b : b + 1, :pages])
                keys, values = keys[0, :k_len], values[0, :k_len]
            for c in range(0, q_len, _QUERY_CHUNK):
                qc = qb[c : c + _QUERY_CHUNK]
                lens = torch.full((1,), k_len, dtype=torch.int32, device=q.device)
                first = k_len - q_len + c  # absolute position of the chunk's first query
                upto = min(k_len, first + qc.shape[0])  # keys past the chunk's last query are masked anyway
                o = self._sdpa(
                    qc[None],
                    keys[None, :upto],
                    values[None, :upto],
                    lens.clamp(max=upto),
                    qc.shape[0],
                    window,
                    layer.sinks,
                    first_pos=first,
                )
                outs.append(o[0])
        return F.linear(torch.cat(outs).reshape(t, hq * d), layer.wo, layer.bo)

    @staticmethod
    def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor):
        """``[B, pages·P, Hkv, D]`` K and V of the pages in ``page_table [B, pages]``."""
        b, pages = page_table.shape
        idx = page_table.long().reshape(-1)
        size = (b, pages * k_cache.shape[1], *k_cache.shape[2:])
        return k_cache.index_select(0, idx).view(size), v_cache.index_select(0, idx).view(size)

    def _sdpa(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        lengths: torch.Tensor,
        q_len: int,
        window_left: int,
        sinks: torch.Tensor,
        first_pos: int | None = None,
    ) -> torch.Tensor:
        """Attention of ``q [B, Lq, Hq, D]`` (the last ``Lq`` positions of each sequence, or
        starting at ``first_pos``) over ``keys/values [B, L, Hkv, D]`` of which the first
        ``lengths[b]`` are valid; returns ``[B, Lq, Hq, D]``."""
        b, lq, hq, d = q.shape
        l_keys, hkv = keys.shape[1], keys.shape[2]
        g = hq // hkv
        # queries at absolute positions pos[b, t]; the key j is visible iff j < len, j <= pos, pos - j <= window
        if first_pos is None:
            qpos = lengths.long()[:, None] - lq + torch.arange(lq, device=q.device)[None, :]
        else:
            qpos = first_pos + torch.arange(lq, device=q.device)[None, :].expand(b, lq)
        j = torch.arange(l_keys, device=q.device)
        valid = j[None, :] < lengths.long()[:, None]  # [B, L]
        visible = valid[:, None, :] & (j[None, None, :] <= qpos[:, :, None])  # [B, Lq, L]
        if window_left >= 0:
            visible &= (qpos[:, :, None] - j[None, None, :]) <= window_left
        keys = keys.masked_fill(~valid[:, :, None, None], 0)
        values = values.masked_fill(~valid[:, :, None, None], 0)
        total = math.ceil((l_keys + 1) / _KEY_ALIGN) * _KEY_ALIGN
        pad = total - l_keys  # the sink key plus alignment padding, all zero vectors
        keys = F.pad(keys, (0, 0, 0, 0, 0, pad)).transpose(1, 2)  # [B, Hkv, total, D]
        values = F.pad(values, (0, 0, 0, 0, 0, pad)).transpose(1, 2)
        neg_inf = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)  # no H2D copy: capturable
        base = torch.where(visible, torch.zeros((), dtype=q.dtype, device=q.device), neg_inf)  # [B, Lq, L]
        sink_col = sinks.to(q.dtype).view(1, hkv, g, 1, 1).expand(b, hkv, g, lq, 1)
        mask = torch.cat(
            [
                base[:, None, None].expand(b, hkv, g, lq, l_keys),
                sink_col,
                neg_inf.expand(b, hkv, g, lq, pad - 1),
            ],
            dim=-1,
        ).reshape(b, hkv, g * lq, total)
        # GQA folded into rows: [B, Hkv, G·Lq, D], row (g, t) is query head hkv·G + g at token t
        qf = q.view(b, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)
        out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
        return out.view(b, hkv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, hq, d)

    # ------------------------------------------------------------------ MoE

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg, layer = self.cfg, self.w.layers[i]
        w13, w2 = self.w13[i], self.w2[i]
        inter, top_k = cfg.intermediate_size, cfg.top_k
        scores = torch.softmax(F.linear(x, layer.router_w, layer.router_b).float(), dim=-1)
        weights, ids = torch.topk(scores, top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)
        tokens = order // top_k
        experts = flat[order]
        xs = x[tokens]
        if self.grouped:
            counts = torch.zeros(cfg.num_experts, dtype=torch.int64, device=x.device)
            counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync on a GPU
            offs = counts.cumsum(0).to(torch.int32)
            h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
        else:  # per-expert loop (host sync): fp32 on a GPU, or a torch without grouped GEMMs
            h = torch.empty(xs.shape[0], 2 * inter, dtype=x.dtype, device=x.device)
            for e in torch.unique(experts).tolist():
                rows = experts == e
                h[rows] = xs[rows] @ w13[e].T
        h = h.float() + layer.b13[experts]
        gate, up = h[:, :inter].clamp(max=cfg.swiglu_limit), h[:, inter:].clamp(-cfg.swiglu_limit, cfg.swiglu_limit)
        act = (gate * torch.sigmoid(cfg.swiglu_alpha * gate) * (up + 1)).to(x.dtype)
        if self.grouped:
            y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        else:
            y = torch.empty(act.shape[0], cfg.hidden_size, dtype=x.dtype, device=x.device)
            for e in torch.unique(experts).tolist():
                rows = experts == e
                y[rows] = act[rows] @ w2[e].T
        y = (y.float() + layer.b2[experts]) * weights.reshape(-1)[order, None]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, y)
        return out.to(x.dtype)
