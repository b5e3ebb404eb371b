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


# --- functional calls: one runner per key, every tensor passed per run --------------------


def _decode_args(layer: int, max_seqlen_k: int, sinks=True, lse=False, batch=2):
    import torch

    from tokenspeed_kernel.ops.attention.args import DecodeArgs

    g = torch.Generator().manual_seed(layer)
    q = torch.randn(batch, 1, 8, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(32, 16, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(32, 16, 2, 64, generator=g).to(torch.bfloat16)
    table = torch.arange(batch * 16, dtype=torch.int32).reshape(batch, 16) % 32
    lengths = torch.full((batch,), max_seqlen_k, dtype=torch.int32)
    return DecodeArgs(
        q, k, v, table, lengths, max_seqlen_k, 0.125, -1,
        torch.randn(8, generator=g) if sinks else None, 0.0, None, None,
        torch.empty_like(q), torch.empty(batch, 8, 1) if lse else None,
    )  # fmt: skip


@pytest.mark.parametrize("sinks", [True, False])
@pytest.mark.parametrize("lse", [True, False])
@pytest.mark.parametrize("max_seqlen_k", [200, 8192])  # fused merge / a separate merge kernel
def test_functional_runner_launches_what_a_fresh_bind_launches(monkeypatch, sinks, lse, max_seqlen_k):
    """Every call of a key runs one cached runner; each launch gets that call's tensors (another
    layer's caches, page table, lengths, sinks, q, out, lse) and the same scalars and
    constexprs as binding afresh would give."""
    from support.launch_recorder import Recorder, assert_same_launches

    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as mod

    rec = Recorder().install(monkeypatch)
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    mod._RUNNERS.clear()
    binds = mod._RUNNERS.binds
    for layer in range(3):
        args = _decode_args(layer, max_seqlen_k, sinks=sinks, lse=lse)
        start = len(rec.launches)
        mod.gluon_decode(args)
        cached = rec.since(start)
        mod._fresh(args)  # the reference: bound afresh, full arguments
        fresh = rec.since(start + len(cached))
        assert len(cached) == (1 if max_seqlen_k == 200 else 2)
        assert_same_launches(cached, fresh, [args.q, args.k_cache, args.v_cache, args.page_table,
                                             args.cache_seqlens, args.sinks, args.out, args.lse])  # fmt: skip
    assert len(mod._RUNNERS.runners) == 1, "three layers of one shape share one runner"
    assert mod._RUNNERS.binds == binds + 1
    assert rec.bound == (1 if max_seqlen_k == 200 else 2), "bound once (its launches) for all three layers"


def test_functional_runner_key_follows_the_split_count_not_the_length(monkeypatch):
    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as mod

    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    keys = {mod._runner_key(_decode_args(0, n)) for n in (4097, 4100, 4150)}
    assert len(keys) == 1, "lengths with the same split count share a runner"
    assert mod._runner_key(_decode_args(0, 100)) != mod._runner_key(_decode_args(0, 4096))


def test_plan_runner_launches_what_a_fresh_bind_launches(monkeypatch):
    """``bind_decode`` (a ``DecodePlan``'s runner, bound with placeholders for q/out/lse): each
    run launches with its own q, out and lse and the plan's caches and tables."""
    import dataclasses

    import torch
    from support.launch_recorder import Recorder, assert_same_launches

    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as mod

    rec = Recorder().install(monkeypatch)
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    plan = _decode_args(0, 8192, lse=True)
    layout = dataclasses.replace(
        plan,
        q=torch.empty(1, dtype=plan.q.dtype).expand(plan.q.shape),
        out=torch.empty(1, dtype=plan.out.dtype).expand(plan.out.shape),
        lse=torch.empty(1).expand(plan.lse.shape),
    )
    run = mod.bind_decode(layout)
    for _ in range(3):
        args = dataclasses.replace(
            plan, q=torch.randn_like(plan.q), out=torch.empty_like(plan.out), lse=torch.empty_like(plan.lse)
        )
        start = len(rec.launches)
        run(args)
        cached = rec.since(start)
        mod._fresh(args)
        assert_same_launches(cached, rec.since(start + len(cached)), [args.q, args.out, args.lse, plan.k_cache,
                                                                      plan.v_cache, plan.page_table, plan.cache_seqlens,
                                                                      plan.sinks])  # fmt: skip
    assert rec.bound == 2
