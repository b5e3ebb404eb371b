"""Page-table translation: our ``page_table``/``cache_seqlens`` to CSR page lists.

FlashInfer describes a paged cache per sequence by a CSR list of pages: ``indptr`` (int32
``[batch + 1]``, prefix sums of pages per sequence), ``indices`` (int32, the page ids of all
sequences back to back) and ``last_page_len`` (int32 ``[batch]``, tokens in each
sequence's last page, ``1..P``; ``0`` for an empty sequence). Our contract hands a padded
table instead (int32 ``[batch, max_pages]``, entries past a sequence unused) and token
counts (int32 ``[batch]``).

:func:`paged_to_csr` builds the CSR form with device tensor ops only (no ``nonzero``, no
boolean indexing, no ``.item()``), so it never synchronizes with the host and can run
inside a CUDA graph capture. It writes into caller-provided buffers so their addresses stay
fixed (what a captured graph needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CsrPages", "allocate_csr", "paged_to_csr"]


@dataclass(frozen=True, slots=True)
class CsrPages:
    """CSR page lists of a batch (all int32, on the cache's device).

    Attributes:
        indptr: ``[batch + 1]``; sequence ``b`` owns ``indices[indptr[b]:indptr[b+1]]``.
        indices: ``[batch * max_pages + 1]``; the first ``indptr[-1]`` entries are valid,
            the rest are scratch (the last slot absorbs writes of unused table entries).
        last_page_len: ``[batch]``, tokens in the last page (``0`` for an empty sequence).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor

    def plan_args(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> tuple:
        """The positional arguments FlashInfer's paged ``plan`` takes after ``qo_indptr`` (the
        prefill wrappers) or first (the decode wrapper): the CSR triple, then the head counts,
        head dim and page size."""
        return (self.indptr, self.indices, self.last_page_len, num_q_heads, num_kv_heads, head_dim, page_size)


def allocate_csr(batch: int, max_pages: int, device: torch.device) -> CsrPages:
    """Buffers for :func:`paged_to_csr` of a ``[batch, max_pages]`` table."""
    return CsrPages(
        indptr=torch.zeros(batch + 1, dtype=torch.int32, device=device),
        indices=torch.zeros(batch * max_pages + 1, dtype=torch.int32, device=device),
        last_page_len=torch.zeros(batch, dtype=torch.int32, device=device),
    )


def paged_to_csr(
    page_table: torch.Tensor, cache_seqlens: torch.Tensor, page_size: int, out: CsrPages | None = None
) -> CsrPages:
    """Translate a padded page table to CSR page lists without a host sync.

    Args:
        page_table: int32 ``[batch, max_pages]``; token ``j`` of sequence ``b`` lives in page
            ``page_table[b, j // page_size]``.
        cache_seqlens: int32 ``[batch]``, tokens per sequence (``<= max_pages * page_size``).
        page_size: tokens per page ``P``.
        out: buffers from :func:`allocate_csr` (same batch and ``max_pages``), or None to
            allocate fresh ones.

    Returns:
        ``out`` (or the new buffers) holding the CSR form (see :class:`CsrPages`).
    """
    batch, max_pages = page_table.shape
    device = page_table.device
    if out is None:
        out = allocate_csr(batch, max_pages, device)
    seqlens = cache_seqlens.to(torch.int64)
    num_pages = torch.div(seqlens + (page_size - 1), page_size, rounding_mode="floor")  # [batch]
    ends = torch.cumsum(num_pages, 0)
    out.indptr[0] = 0
    out.indptr[1:].copy_(ends)
    starts = ends - num_pages
    cols = torch.arange(max_pages, device=device, dtype=torch.int64)
    dest = starts[:, None] + cols[None, :]  # [batch, max_pages]
    scratch = out.indices.numel() - 1
    dest = torch.where(cols[None, :] < num_pages[:, None], dest, torch.full_like(dest, scratch))
    out.indices.scatter_(0, dest.reshape(-1), page_table.reshape(-1).to(torch.int32))
    last = seqlens - (num_pages - 1).clamp(min=0) * page_size
    out.last_page_len.copy_(torch.where(num_pages > 0, last, torch.zeros_like(last)))
    return out
