"""Typed argument objects: what an attention kernel receives.

The public functions (``mha_prefill``, ``mha_extend_with_kvcache``,
``mha_decode_with_kvcache``) validate and normalize their inputs, allocate the outputs,
and hand a kernel one of these objects. A kernel reads the inputs and writes ``out`` (and
``lse`` when it is not None); it returns nothing.

Notation: ``Hq`` query heads, ``Hkv`` KV heads (``Hq % Hkv == 0``; query head ``h`` reads
KV head ``h // (Hq // Hkv)``), ``D`` the q/k head dim, ``Dv`` the v head dim, ``P`` the
page size. Every tensor is on one device and contiguous, except a 3-D q of a call that asks
for ``strided_q`` (rows ``[Hq, D]`` with a row stride of their own: address it through
``q.stride(0)``; a kernel that needs it contiguous omits the feature) and the paged caches: a
``k_cache``/``v_cache`` may be a strided view (any page, token and head strides; stride 1 in
the head dim), to be read or written through its strides. A kernel that needs contiguous
caches omits the ``strided_kv`` feature; one that needs 16-byte aligned strides restricts
the ``kv_align`` shape key to ``(16,)``. Prefill's q, k and v may start at any address; one
that needs them 16-byte aligned (address and row strides) omits the ``unaligned_qkv`` feature.

Shared semantics: ``logits = softmax_scale * q.k``; if ``logit_cap > 0`` logits become
``logit_cap * tanh(logits / logit_cap)``; a query at absolute position ``i`` sees key ``j``
iff ``j <= i`` (when causal) and ``i - j <= window_left`` (when ``window_left >= 0``);
``sinks[h]`` is an extra logit that joins the softmax denominator only (no value); ``lse``
is the natural-log sum-exp of the (capped, scaled) logits of each query row including the
sink; a row that sees no key and has no sink produces zeros and ``lse = -inf``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DecodeArgs", "ExtendArgs", "Heads", "PrefillArgs"]


@dataclass(frozen=True, slots=True)
class Heads:
    """Head geometry of an attention call (public: request builders take it).

    Attributes:
        num_q_heads: ``Hq``. num_kv_heads: ``Hkv`` (``Hq % Hkv == 0``).
        head_dim: ``D`` of q and k. head_dim_v: ``Dv`` of v (usually ``D``).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int


@dataclass(slots=True)
class PrefillArgs:
    """Ragged-batch attention over contiguous q/k/v (``attention.prefill``).

    Attributes:
        q: ``[total_q, Hq, D]``, bf16/fp16/fp32; sequence ``b`` owns rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``.
        k: ``[total_k, Hkv, D]``, q's dtype; rows per sequence from ``cu_seqlens_k``.
        v: ``[total_k, Hkv, Dv]``, q's dtype.
        cu_seqlens_q: int32 ``[batch + 1]``, prefix sums of query lengths, starting at 0.
        cu_seqlens_k: int32 ``[batch + 1]``, prefix sums of key lengths, starting at 0.
        max_seqlen_q: an upper bound of the query lengths (host int).
        max_seqlen_k: an upper bound of the key lengths (host int).
        causal: bottom-right aligned: with ``Lq <= Lk`` the queries of a sequence are its
            LAST ``Lq`` positions, so query ``i`` sits at absolute position ``Lk - Lq + i``.
        softmax_scale: resolved scale (``1/sqrt(D)`` by default).
        window_left: ``-1`` for no window, else keys with ``i - j > window_left`` are masked.
        sinks: float32 ``[Hq]`` or None.
        logit_cap: ``0.0`` for none.
        out: ``[total_q, Hq, Dv]`` in q's dtype, to be written.
        lse: float32 ``[total_q, Hq]`` to be written, or None when not requested.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float
    window_left: int
    sinks: torch.Tensor | None
    logit_cap: float
    out: torch.Tensor
    lse: torch.Tensor | None


@dataclass(slots=True)
class ExtendArgs:
    """Chunked prefill / prefix reuse against a paged KV cache (``attention.extend``).

    Attributes:
        q: ``[total_q, Hq, D]``; sequence ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
            and they are its LAST positions: query ``t`` of the chunk sits at absolute
            position ``cache_seqlens[b] - q_len_b + t``.
        k_cache: ``[num_pages, P, Hkv, D]``, q's dtype or float8_e4m3fn; possibly strided
            (see the module docstring): address ``k_cache.stride(0..2)``, never assume
            ``Hkv * D`` rows.
        v_cache: ``[num_pages, P, Hkv, Dv]``, k_cache's dtype; its strides may differ from
            k_cache's.
        page_table: int32 ``[batch, max_pages_per_seq]``; token ``j`` of sequence ``b`` lives
            at ``k_cache[page_table[b, j // P], j % P]``. Entries past the sequence are unused.
        cu_seqlens_q: int32 ``[batch + 1]``.
        cache_seqlens: int32 ``[batch]``, tokens of each sequence in the cache INCLUDING
            this chunk (written by ``store_kvcache`` before the call).
        max_seqlen_q / max_seqlen_k: host upper bounds of chunk and cache lengths.
        causal, softmax_scale, window_left, sinks, logit_cap: as in :class:`PrefillArgs`.
        k_scale / v_scale: float32 ``[1]`` dequantization scales for an fp8 cache (real =
            stored * scale), else None.
        out: ``[total_q, Hq, Dv]`` in q's dtype. lse: float32 ``[total_q, Hq]`` or None.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cache_seqlens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float
    window_left: int
    sinks: torch.Tensor | None
    logit_cap: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None


@dataclass(slots=True)
class DecodeArgs:
    """Decode against a paged KV cache (``attention.decode``).

    Attributes:
        q: ``[batch, q_len, Hq, D]`` (the public 3-D form ``[batch, Hq, D]`` arrives with
            ``q_len = 1``). The ``q_len`` queries of sequence ``b`` are its last positions:
            query ``t`` sits at ``cache_seqlens[b] - q_len + t`` and they are causal among
            themselves (speculative decode).
        k_cache / v_cache / page_table / cache_seqlens / k_scale / v_scale: as in
            :class:`ExtendArgs` (``cache_seqlens`` includes the ``q_len`` new tokens).
        max_seqlen_k: host upper bound of ``cache_seqlens``.
        softmax_scale, window_left, sinks, logit_cap: as in :class:`PrefillArgs`.
        out: ``[batch, q_len, Hq, Dv]`` in q's dtype.
        lse: float32 ``[batch, q_len, Hq]`` or None.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    cache_seqlens: torch.Tensor
    max_seqlen_k: int
    softmax_scale: float
    window_left: int
    sinks: torch.Tensor | None
    logit_cap: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    out: torch.Tensor
    lse: torch.Tensor | None
