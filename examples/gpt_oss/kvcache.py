"""A small paged KV-cache manager and the attention metadata of one forward pass.

Storage per layer: ``k [num_pages, page_size, Hkv, D]`` and ``v`` alike (the API's NHD
paged layout). Every request owns one row of the batch tables and a list of pages:

- ``page_table`` int32 ``[max_batch, max_pages_per_seq]``: the request's page ids in order
  (token ``j`` lives at ``cache[page_table[row, j // P], j % P]``), unused entries 0;
- ``cache_seqlens`` int32 ``[max_batch]``: tokens of the request in the cache.

Both tables are allocated once, so their addresses are fixed and a captured decode step
can read them; the host keeps mirrors (the manager never reads the device tables back)
and copies a row to the device whenever it changes, outside any captured region. Decode
attention plans (``tokenspeed_kernel.mha_decode_plan``) keep views of these tables and are
updated after every in-place change, before the step that reads them.

Pages are reserved up front for the tokens a request may reach (prompt + new tokens):
decode then never allocates, which is what lets a step run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenspeed_kernel import DecodePlan, DecodeStepPlan, ExtendPlan, PrefillPlan

__all__ = ["ForwardBatch", "PagedKVCache", "SeqState"]


@dataclass
class ForwardBatch:
    """Attention metadata of one forward pass over ``T`` new tokens of ``B`` sequences.

    Attributes:
        mode: ``"prefill"`` (contiguous K/V of whole prompts, ``mha_prefill``), ``"extend"``
            (a chunk attending to the paged cache, ``mha_extend_with_kvcache``) or
            ``"decode"`` (one token per sequence, ``mha_decode_with_kvcache``).
        positions: int64 ``[T]`` absolute position of each new token.
        slot_mapping: int64 ``[T]`` cache slot (``page · P + offset``) of each new token.
        cu_seqlens_q: int32 ``[B + 1]`` (prefill, extend), else None.
        cu_seqlens_k: int32 ``[B + 1]`` (prefill: equal to ``cu_seqlens_q``), else None.
        page_table: int32 ``[B, max_pages_per_seq]`` (extend, decode), else None.
        cache_seqlens: int32 ``[B]`` tokens in the cache including these (extend, decode).
        max_seqlen_q / max_seqlen_k: host bounds of the new-token / key counts.
        q_lens / k_lens: host tuples of per-sequence new-token / key counts (prefill, extend;
            empty for decode): the plain PyTorch path loops over sequences with them.
        decode_plans: one ``tokenspeed_kernel.DecodePlan`` per layer over this batch's
            tables (decode; set by ``GptOssModel.plan_decode``), else None (the model then
            calls ``mha_decode_with_kvcache``).
        step_plans: this pass's prefill, extend or eager decode plans by layer kind (window),
            made by the first layer of each kind (``mha_prefill_plan`` / ``mha_extend_plan`` /
            ``mha_decode_step_plan``) and run by every layer.
    """

    mode: str
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    cache_seqlens: torch.Tensor | None = None
    q_lens: tuple[int, ...] = ()
    k_lens: tuple[int, ...] = ()
    decode_plans: list[DecodePlan] | None = None
    step_plans: dict[int, PrefillPlan | ExtendPlan | DecodeStepPlan] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        if self.cache_seqlens is not None:
            return self.cache_seqlens.shape[0]
        return self.cu_seqlens_q.shape[0] - 1


@dataclass
class SeqState:
    """Host bookkeeping of one request: its batch-table row, pages, cached and reserved tokens."""

    rid: int
    row: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    reserved: int = 0


class PagedKVCache:
    """Paged K/V storage for ``num_layers`` layers plus per-request page bookkeeping.

    Args:
        num_layers, num_kv_heads, head_dim: model dims.
        num_pages, page_size: pool size; ``page_size`` is ``P``.
        max_batch: rows of the batch tables (requests alive at once).
        max_pages_per_seq: columns of ``page_table``; ``max_pages_per_seq · P`` is the
            longest sequence (``max_seqlen_k`` of a captured decode step).
        dtype, device: cache storage.
        poison: fill the storage with NaN (tests: reading an unwritten slot shows up).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        max_batch: int,
        max_pages_per_seq: int,
        dtype: torch.dtype,
        device: torch.device | str,
        poison: bool = False,
    ) -> None:
        if min(num_pages, page_size, max_batch, max_pages_per_seq) < 1:
            raise ValueError("num_pages, page_size, max_batch and max_pages_per_seq must be >= 1")
        self.device = torch.device(device)
        self.page_size = page_size
        self.num_pages = num_pages
        self.max_batch = max_batch
        self.max_pages_per_seq = max_pages_per_seq
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        make = (
            (lambda: torch.full(shape, float("nan"), dtype=dtype, device=self.device))
            if poison
            else (lambda: torch.zeros(shape, dtype=dtype, device=self.device))
        )
        self.k = [make() for _ in range(num_layers)]
        self.v = [make() for _ in range(num_layers)]
        self.page_table = torch.zeros(max_batch, max_pages_per_seq, dtype=torch.int32, device=self.device)
        self.cache_seqlens = torch.zeros(max_batch, dtype=torch.int32, device=self.device)
        self._table = torch.zeros(max_batch, max_pages_per_seq, dtype=torch.int32)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest id
        self._free_rows = list(range(max_batch - 1, -1, -1))
        self.seqs: dict[int, SeqState] = {}

    # ------------------------------------------------------------------ bookkeeping

    @property
    def max_seq_len(self) -> int:
        """The longest sequence a request may reach: ``max_pages_per_seq · page_size``."""
        return self.max_pages_per_seq * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def add(self, rid: int, reserve_tokens: int) -> SeqState:
        """Admit request ``rid`` with pages for ``reserve_tokens`` tokens; returns its state.

        Raises ``ValueError`` for a duplicate id or a reservation longer than
        ``max_seq_len``, ``RuntimeError`` when the pool or the batch rows are exhausted
        (nothing is allocated then).
        """
        if rid in self.seqs:
            raise ValueError(f"request {rid} is already in the KV cache")
        if reserve_tokens > self.max_seq_len:
            raise ValueError(
                f"request {rid} reserves {reserve_tokens} tokens but a sequence holds at most "
                f"{self.max_seq_len} (max_pages_per_seq={self.max_pages_per_seq} x page_size={self.page_size})"
            )
        if not self._free_rows:
            raise RuntimeError(f"no free batch row for request {rid}: all {self.max_batch} rows are in use")
        need = self._pages_for(reserve_tokens)
        if need > len(self._free_pages):
            raise RuntimeError(
                f"out of KV pages: request {rid} needs {need} pages for {reserve_tokens} tokens, "
                f"{len(self._free_pages)} of {self.num_pages} are free"
            )
        state = SeqState(rid, self._free_rows.pop())
        self.seqs[rid] = state
        self.reserve(rid, reserve_tokens)
        return state

    def reserve(self, rid: int, total_tokens: int) -> None:
        """Grow request ``rid``'s pages to hold ``total_tokens`` tokens (no-op if they do);
        updates its ``page_table`` row on the device. ``RuntimeError`` when out of pages."""
        state = self.seqs[rid]
        if total_tokens > self.max_seq_len:
            raise ValueError(f"request {rid}: {total_tokens} tokens exceed max_seq_len {self.max_seq_len}")
        need = self._pages_for(total_tokens) - len(state.pages)
        if need > len(self._free_pages):
            raise RuntimeError(
                f"out of KV pages: request {rid} needs {need} more pages for {total_tokens} tokens, "
                f"{len(self._free_pages)} of {self.num_pages} are free"
            )
        if need > 0:
            state.pages += [self._free_pages.pop() for _ in range(need)]
            self._table[state.row, : len(state.pages)] = torch.tensor(state.pages, dtype=torch.int32)
            self.page_table[state.row].copy_(self._table[state.row])
        state.reserved = max(state.reserved, len(state.pages) * self.page_size)

    def free(self, rid: int) -> None:
        """Release request ``rid``'s pages and row (its table row is zeroed)."""
        state = self.seqs.pop(rid)
        self._free_pages.extend(reversed(state.pages))
        self._free_pages.sort(reverse=True)
        self._free_rows.append(state.row)
        self._free_rows.sort(reverse=True)
        self._table[state.row].zero_()
        self.page_table[state.row].zero_()
        self.cache_seqlens[state.row].zero_()

    def slots(self, rid: int, start: int, count: int) -> torch.Tensor:
        """int64 ``[count]`` cache slots of positions ``start .. start+count-1`` of ``rid``
        (host tensor). ``ValueError`` past the reserved pages."""
        state = self.seqs[rid]
        if start + count > len(state.pages) * self.page_size:
            raise ValueError(
                f"request {rid}: positions up to {start + count - 1} are past its {len(state.pages)} reserved pages"
            )
        pos = torch.arange(start, start + count)
        pages = torch.tensor(state.pages, dtype=torch.int64)
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _rows(self, rids: list[int]) -> tuple[list[int], slice | torch.Tensor]:
        rows = [self.seqs[r].row for r in rids]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return rows, slice(rows[0], rows[0] + len(rows))  # a view: fixed address
        return rows, torch.tensor(rows, device=self.device)

    def contiguous_rows(self, rids: list[int]) -> bool:
        """Whether ``rids`` occupy consecutive batch rows in order (a decode graph needs it)."""
        return isinstance(self._rows(rids)[1], slice)

    # ------------------------------------------------------------------ forward metadata

    def chunk_batch(self, rids: list[int], num_new: list[int], *, mode: str = "extend") -> ForwardBatch:
        """Metadata for appending ``num_new[i]`` tokens to request ``rids[i]``; advances the
        requests' lengths (host and device). ``mode="prefill"`` needs every request empty
        (whole prompts, contiguous K/V); ``"extend"`` attends to what is cached too."""
        if mode not in ("prefill", "extend"):
            raise ValueError(f"mode must be 'prefill' or 'extend', got {mode!r}")
        states = [self.seqs[r] for r in rids]
        if mode == "prefill" and any(s.length for s in states):
            raise ValueError("mode='prefill' needs requests with nothing cached; use 'extend'")
        starts = [s.length for s in states]
        slot_mapping = torch.cat([self.slots(r, s, n) for r, s, n in zip(rids, starts, num_new)])
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, num_new)])
        k_lens = tuple(s + n for s, n in zip(starts, num_new))
        for state, total in zip(states, k_lens):
            state.length = total
        cu_q = torch.tensor([0, *num_new], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        _, index = self._rows(rids)
        lens = torch.tensor(k_lens, dtype=torch.int32)
        rows = torch.tensor([s.row for s in states], device=self.device)
        self.cache_seqlens.index_copy_(0, rows, lens.to(self.device))
        batch = ForwardBatch(
            mode=mode,
            positions=positions.to(self.device),
            slot_mapping=slot_mapping.to(self.device),
            max_seqlen_q=max(num_new),
            max_seqlen_k=max(k_lens),
            cu_seqlens_q=cu_q.to(self.device),
            q_lens=tuple(num_new),
            k_lens=k_lens,
        )
        if mode == "prefill":
            batch.cu_seqlens_k = batch.cu_seqlens_q
        else:
            batch.page_table = self.page_table[index]
            batch.cache_seqlens = self.cache_seqlens[index]
        return batch

    def decode_batch(self, rids: list[int]) -> ForwardBatch:
        """Static decode metadata for the requests ``rids`` (consecutive rows, in order).

        ``page_table`` and ``cache_seqlens`` are views of the fixed tables; ``positions`` and
        ``slot_mapping`` are fresh buffers that :meth:`fill_decode` rewrites on the device,
        so a step built on the returned batch can be captured once and replayed.
        ``max_seqlen_k`` is :attr:`max_seq_len` (a captured step's static bound).
        """
        rows, index = self._rows(rids)
        if not isinstance(index, slice):
            raise ValueError(f"decode needs requests in consecutive batch rows, got rows {rows}")
        n = len(rids)
        return ForwardBatch(
            mode="decode",
            positions=torch.zeros(n, dtype=torch.int64, device=self.device),
            slot_mapping=torch.zeros(n, dtype=torch.int64, device=self.device),
            max_seqlen_q=1,
            max_seqlen_k=self.max_seq_len,
            page_table=self.page_table[index],
            cache_seqlens=self.cache_seqlens[index],
        )

    def fill_decode(self, batch: ForwardBatch, *, advance: bool) -> None:
        """Device-only update of a decode batch, capturable: with ``advance`` each
        sequence grows by one token first; then ``positions = cache_seqlens - 1`` and
        ``slot_mapping`` is that position's slot, read through the page table."""
        if advance:
            batch.cache_seqlens.add_(1)
        pos = torch.sub(batch.cache_seqlens, 1, out=batch.positions)  # five ops, each writing once
        page = batch.page_table.gather(1, (pos // self.page_size)[:, None])[:, 0]
        torch.add(pos % self.page_size, page, alpha=self.page_size, out=batch.slot_mapping)

    def check_decode_room(self, rids: list[int], steps: int = 1) -> None:
        """Host check before advancing ``rids`` by ``steps`` tokens (``RuntimeError`` if a
        request would pass its reserved pages: a captured step cannot allocate)."""
        for r in rids:
            s = self.seqs[r]
            if s.length + steps > len(s.pages) * self.page_size:
                raise RuntimeError(
                    f"request {r}: {s.length} cached + {steps} new tokens exceed its reserved "
                    f"{len(s.pages)} pages; reserve more before decoding"
                )

    def advance_host(self, rids: list[int], steps: int = 1) -> None:
        """Mirror on the host that a decode step advanced ``rids`` by ``steps`` tokens."""
        for r in rids:
            self.seqs[r].length += steps

    def set_lengths(self, lengths: dict[int, int]) -> None:
        """Declare how many tokens each request holds (benchmarks fill the cache with random
        K/V instead of running prefill). Lengths must fit the reserved pages."""
        for rid, n in lengths.items():
            self.reserve(rid, n)
            self.seqs[rid].length = n
            self.cache_seqlens[self.seqs[rid].row] = n
