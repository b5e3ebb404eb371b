"""An attention call as query rows: one form of the three operators' arguments (public, for
backend wheels).

A kernel that walks rows of query tokens (prefill, extend and decode alike) reads the same
things from :class:`~.args.PrefillArgs`, :class:`~.args.ExtendArgs` and
:class:`~.args.DecodeArgs`, named differently and, for decode, shaped per sequence.
:func:`query_rows` maps any of them to one :class:`QueryRows`: 3-D query rows, the keys
contiguous or paged, the batch's host bounds. No copy: decode's ``q``/``out``/``lse`` are
views of the arguments' tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.ops.attention.args import DecodeArgs, ExtendArgs, PrefillArgs

__all__ = ["QueryRows", "query_rows"]


@dataclass(slots=True)
class QueryRows:
    """One attention call as rows of query tokens (notation of :mod:`.args`).

    Attributes:
        q: ``[rows, Hq, D]``: a ragged batch's rows (prefill, extend), or ``q_len`` rows per
            sequence back to back (decode: a view of ``[batch, q_len, Hq, D]``).
        k / v: ``[total_k, Hkv, D]`` / ``[total_k, Hkv, Dv]`` contiguous (prefill), else the
            paged caches ``[num_pages, P, Hkv, D]`` / ``[num_pages, P, Hkv, Dv]`` (possibly
            strided, as in :class:`~.args.ExtendArgs`).
        out: ``[rows, Hq, Dv]`` in q's dtype, to be written. lse: float32 ``[rows, Hq]`` or None.
        sinks: float32 ``[Hq]`` or None. k_scale / v_scale: float32 ``[1]`` for an fp8 cache, or None.
        page_table: int32 ``[batch, max_pages]``, or None for contiguous k/v (then ``paged`` is False).
        cu_seqlens_q: int32 ``[batch + 1]``, or None when every sequence has ``q_len`` rows (decode).
        cu_seqlens_k: int32 ``[batch + 1]`` for contiguous k/v, else None.
        cache_seqlens: int32 ``[batch]`` for paged k/v (tokens in the cache including the new
            ones), else None.
        batch: sequences. max_q: host bound of any sequence's query rows (decode: ``q_len``).
        max_k: host bound of any sequence's keys.
        q_len: query rows per sequence of a decode (speculative tokens included); 0 when the
            rows are ragged (``cu_seqlens_q`` gives them).
        causal, softmax_scale, window_left, logit_cap: as in :class:`~.args.PrefillArgs`
            (decode is causal).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    page_table: torch.Tensor | None
    cu_seqlens_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor | None
    cache_seqlens: torch.Tensor | None
    batch: int
    max_q: int
    max_k: int
    q_len: int
    causal: bool
    softmax_scale: float
    window_left: int
    logit_cap: float

    @property
    def paged(self) -> bool:
        """Keys and values are read through ``page_table`` (extend, decode)."""
        return self.page_table is not None

    @property
    def visible_keys(self) -> int:
        """A host bound of the keys one sequence's queries see together: ``max_k``, or with a
        window its width plus the query rows (``window_left + max_q``) when that is fewer."""
        return self.max_k if self.window_left < 0 else min(self.max_k, self.window_left + self.max_q)


# The builders below run once per attention call and construct QueryRows positionally, in its
# field order (each line names its field): keyword construction costs ~0.5 µs more per call.


def _ragged_rows(
    args: PrefillArgs | ExtendArgs,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    page_table: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
) -> QueryRows:
    """The rows of a ragged batch (prefill, extend) with these keys."""
    return QueryRows(
        args.q,  # q
        k,  # k
        v,  # v
        args.out,  # out
        args.lse,  # lse
        args.sinks,  # sinks
        k_scale,  # k_scale
        v_scale,  # v_scale
        page_table,  # page_table
        args.cu_seqlens_q,  # cu_seqlens_q
        cu_seqlens_k,  # cu_seqlens_k
        cache_seqlens,  # cache_seqlens
        args.cu_seqlens_q.shape[0] - 1,  # batch
        args.max_seqlen_q,  # max_q
        args.max_seqlen_k,  # max_k
        0,  # q_len: ragged rows
        args.causal,  # causal
        args.softmax_scale,  # softmax_scale
        args.window_left,  # window_left
        args.logit_cap,  # logit_cap
    )


def _prefill_rows(args: PrefillArgs) -> QueryRows:
    # contiguous k/v: no scales, no pages; cu_seqlens_k
    return _ragged_rows(args, args.k, args.v, None, None, None, args.cu_seqlens_k, None)


def _extend_rows(args: ExtendArgs) -> QueryRows:
    # the paged cache: scales, page table, cache lengths; no cu_seqlens_k
    return _ragged_rows(
        args, args.k_cache, args.v_cache, args.k_scale, args.v_scale, args.page_table, None, args.cache_seqlens
    )


def _decode_rows(args: DecodeArgs) -> QueryRows:
    batch, q_len, num_q_heads, head_dim = args.q.shape
    rows = batch * q_len
    return QueryRows(
        args.q.view(rows, num_q_heads, head_dim),  # q
        args.k_cache,  # k
        args.v_cache,  # v
        args.out.view(rows, num_q_heads, args.out.shape[-1]),  # out
        None if args.lse is None else args.lse.view(rows, num_q_heads),  # lse
        args.sinks,  # sinks
        args.k_scale,  # k_scale
        args.v_scale,  # v_scale
        args.page_table,  # page_table
        None,  # cu_seqlens_q: q_len rows per sequence
        None,  # cu_seqlens_k
        args.cache_seqlens,  # cache_seqlens
        batch,  # batch
        q_len,  # max_q
        args.max_seqlen_k,  # max_k
        q_len,  # q_len
        True,  # causal
        args.softmax_scale,  # softmax_scale
        args.window_left,  # window_left
        args.logit_cap,  # logit_cap
    )


_ROWS: dict[type, Callable[..., QueryRows]] = {
    PrefillArgs: _prefill_rows,
    ExtendArgs: _extend_rows,
    DecodeArgs: _decode_rows,
}


def query_rows(args: PrefillArgs | ExtendArgs | DecodeArgs) -> QueryRows:
    """The :class:`QueryRows` of an attention call's typed arguments.

    Args:
        args: what the kernel was given: :class:`~.args.PrefillArgs` (contiguous k/v,
            ``cu_seqlens_k``), :class:`~.args.ExtendArgs` (paged, ragged queries) or
            :class:`~.args.DecodeArgs` (paged, ``q`` ``[batch, q_len, Hq, D]`` viewed as
            ``[batch * q_len, Hq, D]``, ``out``/``lse`` likewise).

    Raises:
        TypeError: ``args`` is none of these.
    """
    build = _ROWS.get(type(args))
    if build is None:
        raise TypeError(f"args: PrefillArgs, ExtendArgs or DecodeArgs expected, got {type(args).__name__}")
    return build(args)
