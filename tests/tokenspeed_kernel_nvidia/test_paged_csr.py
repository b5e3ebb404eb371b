"""Page table -> CSR translation (FlashInfer's indptr/indices/last_page_len) on CPU tensors."""

import pytest
import torch

from tokenspeed_kernel_nvidia.ops.attention._paged import allocate_csr, paged_to_csr


def _plain(page_table, seqlens, page_size):
    indptr, indices, last = [0], [], []
    for b, n in enumerate(seqlens.tolist()):
        pages = -(-n // page_size)
        indices += page_table[b, :pages].tolist()
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size if pages else 0)
    return indptr, indices, last


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_matches_plain_python(page_size):
    gen = torch.Generator().manual_seed(page_size)
    batch, max_pages = 5, 7
    page_table = torch.randint(0, 1000, (batch, max_pages), generator=gen, dtype=torch.int32)
    seqlens = torch.tensor([0, 1, page_size, max_pages * page_size, 2 * page_size + 1], dtype=torch.int32)
    csr = paged_to_csr(page_table, seqlens, page_size)
    indptr, indices, last = _plain(page_table, seqlens, page_size)
    assert csr.indptr.dtype == csr.indices.dtype == csr.last_page_len.dtype == torch.int32
    assert csr.indptr.tolist() == indptr
    assert csr.indices[: indptr[-1]].tolist() == indices
    assert csr.last_page_len.tolist() == last


def test_reuses_buffers_in_place():
    page_table = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    bufs = allocate_csr(3, 4, torch.device("cpu"))
    ptrs = (bufs.indptr.data_ptr(), bufs.indices.data_ptr(), bufs.last_page_len.data_ptr())
    for seqlens in ([5, 1, 8], [8, 8, 2]):
        s = torch.tensor(seqlens, dtype=torch.int32)
        out = paged_to_csr(page_table, s, 2, out=bufs)
        assert (out.indptr.data_ptr(), out.indices.data_ptr(), out.last_page_len.data_ptr()) == ptrs
        indptr, indices, last = _plain(page_table, s, 2)
        assert out.indptr.tolist() == indptr and out.indices[: indptr[-1]].tolist() == indices
        assert out.last_page_len.tolist() == last
