"""``TokenspeedAttentionImpl``: one attention layer's KV write and forward, through the public
calls of tokenspeed-kernel.

Per layer, from vLLM's ``Attention(...)`` arguments:

- ``sliding_window`` (vLLM: the window INCLUDING the current token) -> ``window_left =
  sliding_window - 1``; ``logits_soft_cap`` -> ``logit_cap``; ``scale`` -> ``softmax_scale``;
- ``sinks`` (the layer's ``[Hq]`` parameter) -> a float32 copy, refreshed after every weight
  load (``process_weights_after_loading``) in place, so decode plans keep its address;
- ``kv_cache_dtype`` fp8/fp8_e4m3 -> the cache viewed as float8_e4m3fn, with the layer's
  per-tensor ``_k_scale``/``_v_scale`` (device tensors) as ``k_scale``/``v_scale``.

The KV cache vLLM passes is ``[num_blocks, Hkv, block_size, D + Dv]`` (logical; physical
strides per the KV cache layout). K and V are the views ``kv_cache.transpose(1, 2)[..., :D]``
and ``[..., D:]``, shaped ``[num_pages, page_size, Hkv, D]`` with a contiguous last axis: no
copy of the cache is ever made. q, which vLLM hands over as a row-strided view of the fused
qkv projection (rows ``[Hq, D]``, a row stride of ``(Hq + 2 Hkv) D``), is passed as it is to
the extend and to a decode of one query per sequence (request feature ``strided_q``: the
kernels read it through its row stride), the full CUDA-graph decode's included: its
``DecodePlan`` is made with q's row stride (``mha_decode_plan(..., q_row_stride=...)``, read
off the q the layer's first warm-up run hands over). A speculative decode's 4-D q is copied
contiguous, and so is a graph decode's q where no capturable kernel serves a row-strided q
(the plan is then made for a contiguous q). The k and v rows,
row-strided views of the same projection, go to ``store_kvcache`` as they are too (request
feature ``strided_rows``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionImpl, AttentionLayer, AttentionType

from tokenspeed_kernel import (
    DecodePlan,
    KernelOverrideError,
    NoKernelFoundError,
    mha_decode_plan,
    mha_decode_step_plan,
    mha_extend_plan,
    store_kvcache,
)
from tokenspeed_kernel_vllm.attention import _support
from tokenspeed_kernel_vllm.attention.metadata import TokenspeedAttentionMetadata


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _row_stride(q: torch.Tensor) -> int | None:
    """The row stride of a row-strided 3-D ``q [tokens, Hq, D]`` (rows contiguous within
    themselves, strides ``(S, D, 1)`` with ``S > Hq * D``: vLLM's view of the fused qkv
    projection's q), which a decode plan can be made for; None for any other q (contiguous, or
    a layout no plan takes: copied)."""
    if q.dim() != 3 or q.is_contiguous():
        return None
    _, heads, dim = q.shape
    if q.stride(2) != 1 or q.stride(1) != dim or q.stride(0) < heads * dim:
        return None
    return q.stride(0)


class TokenspeedAttentionImpl(AttentionImpl[TokenspeedAttentionMetadata]):
    """Decoder self-attention of one layer (see the module docstring for the mapping)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("TOKENSPEED: ALiBi slopes are not served")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"TOKENSPEED: attention type {attn_type} is not served (decoder only)")
        unknown = {k: v for k, v in extra.items() if v not in (None, False, -1)}
        if unknown:
            raise NotImplementedError(f"TOKENSPEED: layer options not served: {sorted(unknown)}")
        reason = _support.kv_dtype_reason(kv_cache_dtype)
        if reason is not None:
            raise ValueError(reason)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"TOKENSPEED: sliding_window must be >= 1 or None, got {sliding_window}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.window_left = -1 if sliding_window is None else sliding_window - 1
        self.logit_cap = 0.0 if not logits_soft_cap else float(logits_soft_cap)
        self.fp8 = _support.KV_CACHE_DTYPES[kv_cache_dtype] == torch.float8_e4m3fn
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"TOKENSPEED: sinks must have shape [{num_heads}], got {list(sinks.shape)}")
        self.sinks = sinks
        self._sinks_f32: torch.Tensor | None = None
        self._kv_source: torch.Tensor | None = None
        self._kv_views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._check_kernels()

    def _check_kernels(self) -> None:
        """Fail at model construction, with the selector's reason, when no tokenspeed-kernel
        kernel serves this layer's exact shapes (real head counts, window, sinks, cap)."""
        config = get_current_vllm_config_or_none()
        model_config = None if config is None else config.model_config
        if model_config is None:
            return
        block_size = config.cache_config.block_size if config.cache_config is not None else None
        dtype = model_config.dtype
        reason = _support.kernel_reason(
            dtype=dtype,
            kv_dtype=_support.cache_dtype(self.kv_cache_dtype, dtype),
            num_q_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            head_size_v=self.head_size,
            page_size=_support.kernel_page_size(block_size),
            window_left=self.window_left,
            sinks=self.sinks is not None,
            logit_cap=self.logit_cap,
        )
        if reason is not None:
            raise ValueError(reason)

    # -- per-layer state -------------------------------------------------------------

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        if self.sinks is not None:
            self._refresh_sinks()

    def _refresh_sinks(self) -> None:
        assert self.sinks is not None
        src = self.sinks.detach()
        if self._sinks_f32 is None or self._sinks_f32.device != src.device:
            self._sinks_f32 = src.to(torch.float32).contiguous()
        else:
            self._sinks_f32.copy_(src)  # same address: decode plans keep reading it

    def _sinks(self) -> torch.Tensor | None:
        if self.sinks is None:
            return None
        if self._sinks_f32 is None or self._sinks_f32.device != self.sinks.device:
            self._refresh_sinks()
        return self._sinks_f32

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_pages, page_size, Hkv, D]`` views of vLLM's layer cache."""
        if self._kv_views is not None and kv_cache is self._kv_source:
            return self._kv_views
        if kv_cache.dim() != 4 or kv_cache.shape[1] != self.num_kv_heads or kv_cache.shape[-1] <= self.head_size:
            raise ValueError(
                f"TOKENSPEED: expected vLLM's KV cache [num_blocks, Hkv={self.num_kv_heads}, block_size, "
                f"D + Dv] with D={self.head_size}, got {list(kv_cache.shape)}"
            )
        kv = kv_cache.transpose(1, 2)
        if self.fp8 and kv.dtype != torch.float8_e4m3fn:
            kv = kv.view(torch.float8_e4m3fn)  # vLLM keeps fp8 KV as bytes
        views = (kv[..., : self.head_size], kv[..., self.head_size :])
        self._kv_source, self._kv_views = kv_cache, views
        return views

    def _scales(self, layer: AttentionLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.fp8:
            return None, None
        return layer._k_scale, layer._v_scale

    # -- vLLM's calls ----------------------------------------------------------------

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write this step's K/V rows: ``store_kvcache`` through the cache views (slot = page *
        page_size + offset; vLLM's padding slots are -1 and are skipped)."""
        if kv_cache.numel() == 0:
            return  # profiling run: no cache yet
        k_cache, v_cache = self._caches(kv_cache)
        n = slot_mapping.shape[0]
        if slot_mapping.dtype != torch.int64:
            slot_mapping = slot_mapping.to(torch.int64)
        k_scale, v_scale = self._scales(layer)
        store_kvcache(
            key[:n],  # as vLLM gives them: row-strided rows are read in place (strided_rows)
            value[:n],
            k_cache,
            v_cache,
            slot_mapping,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TokenspeedAttentionMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query [tokens, Hq, D]`` -> ``output [tokens, Hq, Dv]`` (rows past the scheduled
        tokens are left as they are). The cache already holds this step's K/V."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("TOKENSPEED: fused output quantization is not served")
        if attn_metadata is None:
            return output.fill_(0)  # profiling run
        md = attn_metadata
        k_cache, v_cache = self._caches(kv_cache)
        k_scale, v_scale = self._scales(layer)
        sinks = self._sinks()
        nd = md.num_decode_tokens
        if md.num_decodes:
            self._decode(md, query[:nd], output[:nd], k_cache, v_cache, k_scale, v_scale, sinks)
        if md.num_prefills and md.num_prefill_tokens:
            rows = slice(nd, nd + md.num_prefill_tokens)  # q as vLLM gives it: row-strided is served
            self._step_run(md, "extend", query[rows], output[rows], k_cache, v_cache, k_scale, v_scale, sinks)
        return output

    def _step_run(
        self,
        md: TokenspeedAttentionMetadata,
        part: str,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> None:
        """This layer's ``part`` of the step (``"extend"``, or ``"decode"`` outside full CUDA
        graphs) through the step's plan for this layer's kind: made (checked in full, kernel
        selected) by the step's first layer of the kind, run by the others."""
        key = (
            part,
            q.dim(),
            q.stride(),  # a row-strided q (strided_q) and a contiguous one select apart
            self.window_left,
            self.scale,
            self.logit_cap,
            sinks is None,
            q.dtype,
            k_cache.dtype,
            k_cache.shape,
            k_cache.stride(),
            v_cache.stride(),
            v_cache.storage_offset() - k_cache.storage_offset(),
        )
        plan = md.step_plans.get(key)
        if plan is None:
            options = self._options(sinks, k_scale, v_scale)
            if part == "decode":
                tables: tuple = (md.decode_page_table, md.decode_seqlens, md.max_seq_len)
                plan = mha_decode_step_plan(q, k_cache, v_cache, *tables, **options, out=out)
            else:
                tables = (md.prefill_page_table, md.prefill_cu_seqlens_q, md.prefill_seqlens, md.prefill_max_query_len)
                plan = mha_extend_plan(q, k_cache, v_cache, *tables, md.max_seq_len, causal=True, **options, out=out)
            md.step_plans[key] = plan
        plan.run(q, k_cache, v_cache, sinks=sinks, k_scale=k_scale, v_scale=v_scale, out=out)

    def _decode(
        self,
        md: TokenspeedAttentionMetadata,
        q: torch.Tensor,
        out: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> None:
        batch, q_len = md.num_decodes, md.decode_q_len
        planned = md.decode_plans is not None and md.decode_plan_key is not None
        plan = None
        if planned:  # q as it comes where the plan was made for its row stride, else a copy
            row_stride = _row_stride(q) if q_len == 1 else None
            plan = self._plan(md, q.dtype, row_stride, k_cache, v_cache, k_scale, v_scale, sinks)
            if plan.q_row_stride is None:
                q = _contiguous(q)
        elif q_len > 1:  # a 4-D q must be contiguous
            q = _contiguous(q)
        if q_len > 1:
            q = q.view(batch, q_len, self.num_heads, q.shape[-1])
            out = out.view(batch, q_len, self.num_heads, out.shape[-1])
        if plan is not None:
            plan.run(q, out=out)
            return
        self._step_run(md, "decode", q, out, k_cache, v_cache, k_scale, v_scale, sinks)

    def _options(
        self, sinks: torch.Tensor | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
    ) -> dict[str, object]:
        """The keyword options every attention call of this layer passes (decode, extend, plan)."""
        return {
            "softmax_scale": self.scale,
            "window_left": self.window_left,
            "sinks": sinks,
            "logit_cap": self.logit_cap,
            "k_scale": k_scale,
            "v_scale": v_scale,
        }

    def _plan(
        self,
        md: TokenspeedAttentionMetadata,
        q_dtype: torch.dtype,
        q_row_stride: int | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> DecodePlan:
        """This layer's plan for the batch shape and q's layout (``q_row_stride``: a
        row-strided q's, or None for a contiguous one): made on first sight (vLLM's warm-up
        runs precede capture) and re-planned by the builder every step after. A row-strided
        q's plan falls back to a contiguous q's (its runs then copy q) where no capturable
        kernel reads a row-strided q (or the override names one that does not)."""
        assert md.decode_plans is not None and md.decode_plan_key is not None
        owner = (id(self), k_cache.data_ptr(), q_row_stride)
        plan = md.decode_plans.get(md.decode_plan_key, owner)
        if plan is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "TOKENSPEED: a decode batch shape reached CUDA-graph capture without a warm-up run; "
                    "its decode plan must be made outside capture (keep cudagraph_num_of_warmups >= 1)"
                )
            make = functools.partial(
                mha_decode_plan,
                k_cache,
                v_cache,
                md.decode_page_table,
                md.decode_seqlens,
                md.plan_max_seqlen_k,
                num_q_heads=self.num_heads,
                q_len=md.decode_q_len,
                q_dtype=q_dtype,
                **self._options(sinks, k_scale, v_scale),
                capturable=md.plan_capturable,
            )
            try:
                plan = make(q_row_stride=q_row_stride)
            except (NoKernelFoundError, KernelOverrideError):
                if q_row_stride is None:
                    raise
                plan = make()
            md.decode_plans.add(md.decode_plan_key, owner, plan)
        return plan
