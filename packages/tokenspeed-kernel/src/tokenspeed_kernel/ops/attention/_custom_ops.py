"""``torch.ops.tokenspeed_kernel.mha_*``: the attention operators as torch.library custom ops.

The public functions route here under ``torch.compile``: the graph holds one opaque op per
call, whose real implementation is the eager path (validation, selection, kernel) and whose
fake implementation only produces output shapes. Each op returns ``(out, lse)``; ``lse``
is an empty tensor when it was not requested.
"""

from __future__ import annotations

import torch

_LIB = "tokenspeed_kernel"


def _lse_like(q: torch.Tensor, tokens: int, heads: int, return_lse: bool) -> torch.Tensor:
    shape = (tokens, heads) if return_lse else (0,)
    return q.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::mha_prefill", mutates_args=())
def _mha_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    sinks: torch.Tensor | None,
    logit_cap: float,
    return_lse: bool,
    override: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenspeed_kernel.ops.attention.api import mha_prefill

    result = mha_prefill(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        return_lse=True,
        override=override,
    )
    out, lse = result
    return out, lse if return_lse else lse.new_empty((0,))


@_mha_prefill.register_fake
def _(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_left,
    sinks,
    logit_cap,
    return_lse,
    override,
):
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[2]))
    return out, _lse_like(q, q.shape[0], q.shape[1], return_lse)


@torch.library.custom_op(f"{_LIB}::mha_extend_with_kvcache", mutates_args=())
def _mha_extend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    window_left: int,
    sinks: torch.Tensor | None,
    logit_cap: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    return_lse: bool,
    override: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenspeed_kernel.ops.attention.api import mha_extend_with_kvcache

    out, lse = mha_extend_with_kvcache(
        q,
        k_cache,
        v_cache,
        page_table,
        cu_seqlens_q,
        cache_seqlens,
        max_seqlen_q,
        max_seqlen_k,
        causal=causal,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=True,
        override=override,
    )
    return out, lse if return_lse else lse.new_empty((0,))


@_mha_extend.register_fake
def _(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    cache_seqlens,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    window_left,
    sinks,
    logit_cap,
    k_scale,
    v_scale,
    return_lse,
    override,
):
    out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[3]))
    return out, _lse_like(q, q.shape[0], q.shape[1], return_lse)


@torch.library.custom_op(f"{_LIB}::mha_decode_with_kvcache", mutates_args=())
def _mha_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_seqlen_k: int,
    softmax_scale: float,
    window_left: int,
    sinks: torch.Tensor | None,
    logit_cap: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    return_lse: bool,
    override: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenspeed_kernel.ops.attention.api import mha_decode_with_kvcache

    out, lse = mha_decode_with_kvcache(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        window_left=window_left,
        sinks=sinks,
        logit_cap=logit_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=True,
        override=override,
    )
    return out, lse if return_lse else lse.new_empty((0,))


@_mha_decode.register_fake
def _(
    q,
    k_cache,
    v_cache,
    page_table,
    cache_seqlens,
    max_seqlen_k,
    softmax_scale,
    window_left,
    sinks,
    logit_cap,
    k_scale,
    v_scale,
    return_lse,
    override,
):
    out = q.new_empty((*q.shape[:-1], v_cache.shape[3]))
    tokens = q.shape[0] * (q.shape[1] if q.dim() == 4 else 1)
    return out, _lse_like(q, tokens, q.shape[-2], return_lse)
