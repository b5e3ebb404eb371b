"""Host side of ``gluon_decode_sm90`` (no GPU): the split count against the kernel's own
split arithmetic (each split rounded up to whole ``BLOCK_N`` tiles)."""

import pytest

from tokenspeed_kernel_nvidia.ops.attention.gluon_decode import decode_config, num_splits


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _nonempty(span: int, splits: int, block_n: int) -> int:
    """Splits the kernel gives keys to (``per_split`` as in ``decode_kernel``)."""
    per_split = _cdiv(_cdiv(span, splits), block_n) * block_n
    return sum(1 for s in range(splits) if s * per_split < span)


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("batch", [1, 2, 3, 8, 16, 64, 256])
def test_no_empty_split_and_bounded(batch, block_n):
    for visible in [1, 2, 63, 64, 65, 129, 300, 1000, 2048, 4097, 8192, 131072]:
        splits = num_splits(batch, 8, visible, 132, block_n)
        assert 1 <= splits <= 64
        assert _nonempty(visible, splits, block_n) == splits, (visible, splits)
        tiles = _cdiv(visible, block_n)
        if tiles > 4:  # at least 2 tiles per split beyond a window-sized span
            assert _cdiv(tiles, splits) >= 2, (visible, splits)


def test_measured_gpt_oss_choices():
    """The counts the H100 sweep measured best (docs/history.md, decode split sweep)."""
    assert num_splits(1, 8, 8192, 132, 64) == 32
    assert num_splits(1, 8, 2048, 132, 64) == 16
    assert num_splits(1, 8, 129, 132, 64) == 3  # window 128: one tile per split
    assert num_splits(64, 8, 8192, 132, 64) == 1
    assert num_splits(256, 8, 2048, 132, 64) == 1


@pytest.mark.parametrize(
    "programs, stages",
    [(0, 3), (40, 3), (264, 3), (511, 3), (512, 2), (1024, 2), (1025, 3), (2048, 3)],
)
def test_ring_depth_follows_the_grid(programs, stages):
    # H100 (docs/history.md): 2 stages faster at 512-1024 programs (B=64/128 ctx 8192),
    # 3 stages at the small batches' split grids and at 2048 (B=256 ctx 2048).
    cfg = decode_config(64, 16, programs)
    assert cfg.stages == stages
    assert cfg.block_n == decode_config(64, 16).block_n == 64  # the split count's tile is fixed
    assert decode_config(64, 16, programs) is cfg  # cached: one config object per choice
