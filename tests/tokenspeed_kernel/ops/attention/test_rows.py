"""``query_rows``: the three attention operators' typed arguments as one ``QueryRows`` (what the
Triton and AMD attention launches take)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.ops.attention.args import DecodeArgs, ExtendArgs, PrefillArgs
from tokenspeed_kernel.ops.attention.rows import QueryRows, query_rows

HQ, HKV, D, DV, P = 4, 2, 16, 8, 4


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _common(window_left: int = -1) -> dict:
    return {"softmax_scale": 0.25, "window_left": window_left, "sinks": torch.zeros(HQ), "logit_cap": 30.0}


def _prefill(lse: bool = True) -> PrefillArgs:
    return PrefillArgs(
        q=torch.randn(7, HQ, D),
        k=torch.randn(9, HKV, D),
        v=torch.randn(9, HKV, DV),
        cu_seqlens_q=_i32(0, 3, 7),
        cu_seqlens_k=_i32(0, 4, 9),
        max_seqlen_q=4,
        max_seqlen_k=5,
        causal=False,
        out=torch.empty(7, HQ, DV),
        lse=torch.empty(7, HQ) if lse else None,
        **_common(),
    )


def _caches() -> dict:
    return {
        "k_cache": torch.randn(5, P, HKV, D),
        "v_cache": torch.randn(5, P, HKV, DV),
        "page_table": _i32(0, 1, 2, 3, 4, 0).view(2, 3),
        "cache_seqlens": _i32(9, 6),
        "max_seqlen_k": 9,
        "k_scale": torch.ones(1),
        "v_scale": torch.ones(1),
    }


def _extend() -> ExtendArgs:
    return ExtendArgs(
        q=torch.randn(5, HQ, D),
        cu_seqlens_q=_i32(0, 2, 5),
        max_seqlen_q=3,
        causal=True,
        out=torch.empty(5, HQ, DV),
        lse=None,
        **_caches(),
        **_common(window_left=3),
    )


def _decode(q_len: int, window_left: int = -1, lse: bool = True) -> DecodeArgs:
    return DecodeArgs(
        q=torch.randn(2, q_len, HQ, D),
        out=torch.empty(2, q_len, HQ, DV),
        lse=torch.empty(2, q_len, HQ) if lse else None,
        **_caches(),
        **_common(window_left),
    )


def test_prefill_rows_are_the_arguments():
    args = _prefill()
    rows = query_rows(args)
    assert type(rows) is QueryRows
    assert rows.q is args.q and rows.k is args.k and rows.v is args.v and rows.out is args.out and rows.lse is args.lse
    assert rows.cu_seqlens_q is args.cu_seqlens_q and rows.cu_seqlens_k is args.cu_seqlens_k
    assert rows.page_table is rows.cache_seqlens is rows.k_scale is rows.v_scale is None and not rows.paged
    assert (rows.batch, rows.max_q, rows.max_k, rows.q_len, rows.causal) == (2, 4, 5, 0, False)
    assert (rows.softmax_scale, rows.window_left, rows.logit_cap) == (0.25, -1, 30.0) and rows.sinks is args.sinks
    assert rows.visible_keys == 5
    assert query_rows(_prefill(lse=False)).lse is None


def test_extend_rows_read_the_paged_cache():
    args = _extend()
    rows = query_rows(args)
    assert rows.q is args.q and rows.k is args.k_cache and rows.v is args.v_cache and rows.paged
    assert rows.page_table is args.page_table and rows.cache_seqlens is args.cache_seqlens
    assert rows.cu_seqlens_q is args.cu_seqlens_q and rows.cu_seqlens_k is None
    assert rows.k_scale is args.k_scale and rows.v_scale is args.v_scale
    assert (rows.batch, rows.max_q, rows.max_k, rows.q_len, rows.causal) == (2, 3, 9, 0, True)
    assert rows.visible_keys == 3 + 3  # window 3 plus the 3 query rows of the longest chunk


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("lse", [False, True])
def test_decode_rows_view_each_sequences_queries_back_to_back(q_len, lse):
    args = _decode(q_len, lse=lse)
    rows = query_rows(args)
    assert rows.q.shape == (2 * q_len, HQ, D) and rows.out.shape == (2 * q_len, HQ, DV)
    assert rows.q.data_ptr() == args.q.data_ptr() and rows.out.data_ptr() == args.out.data_ptr()  # views: no copy
    assert torch.equal(rows.q[q_len], args.q[1, 0])  # sequence 1's first query
    rows.out.fill_(2.0)
    assert bool((args.out == 2.0).all())
    if lse:
        assert rows.lse.shape == (2 * q_len, HQ) and rows.lse.data_ptr() == args.lse.data_ptr()
    else:
        assert rows.lse is None
    assert rows.cu_seqlens_q is None and rows.cu_seqlens_k is None and rows.paged
    assert (rows.batch, rows.max_q, rows.max_k, rows.q_len, rows.causal) == (2, q_len, 9, q_len, True)


@pytest.mark.parametrize(("window_left", "visible"), [(-1, 9), (0, 3), (4, 7), (6, 9), (100, 9)])
def test_visible_keys_bound_the_split_range(window_left, visible):
    """``max_k``, or the window's width plus the query rows when fewer (the decode split
    heuristics of the Triton and AMD wheels)."""
    assert query_rows(_decode(3, window_left)).visible_keys == visible


def test_anything_else_is_a_type_error():
    with pytest.raises(TypeError, match="args: PrefillArgs, ExtendArgs or DecodeArgs expected, got dict"):
        query_rows({})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="got QueryRows"):
        query_rows(query_rows(_prefill()))  # type: ignore[arg-type]
