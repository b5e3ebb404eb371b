"""The grouped-GEMM tile table against the shared memory a block may stage."""

import pytest

from tokenspeed_kernel_triton.ops.moe import _config


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
@pytest.mark.parametrize("weights", ["plain", "mxfp4"])
def test_every_tile_fits_shared_memory_for_every_activation_size(vendor, weights):
    """H100 reported 245760 bytes needed for float32 x at 11 rows per expert (tile 32 x 64 x
    128, 4 stages) against its 232448: float32 rows are now shrunk to the budget, and the
    16-bit rows the table was measured with are kept as they are."""
    budget = _config.SMEM_BUDGET[vendor]
    for rows in (1, 4, 11, 16, 30, 48, 400):
        table_tile = _config.pick_tile(rows * 8, 8, vendor, weights, elem_bytes=2)
        for elem_bytes in (1, 2, 4):
            tile = _config.pick_tile(rows * 8, 8, vendor, weights, elem_bytes=elem_bytes)
            assert _config.staged_bytes(tile, elem_bytes) <= budget, (rows, elem_bytes, tile)
            if elem_bytes <= 2:
                assert tile == table_tile
    shrunk = _config.pick_tile(11 * 4, 4, "cuda", "plain", elem_bytes=4)
    assert (shrunk.block_m, shrunk.block_n, shrunk.block_k, shrunk.num_stages) == (32, 64, 128, 3)
