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


# --- a row-strided q (strided_q): a fused qkv's q, read in place ---------------------------


def _strided_q(args, extra: int = 2 * 2 * 64):
    """``args`` with q ``[B, 1, Hq, D]`` moved into rows ``extra`` elements wider (a fused qkv's
    q: the k and v columns of Hkv 2, D 64; NaN past each row's q), viewed 4-D as the core
    views a 3-D q; out stays contiguous."""
    import dataclasses

    from support.strided_q import row_strided

    q3 = row_strided(args.q[:, 0], extra)
    return dataclasses.replace(args, q=q3.view(args.q.shape))


def test_row_stride_is_what_a_kernel_addresses():
    """``_common.row_stride``: a row-strided q's row stride; the dense row of a contiguous
    tensor, of one row (its stride means nothing) and of a plan's broadcast placeholder (its
    stride is 0), so those all take the contiguous build."""
    import torch
    from support.strided_q import row_strided

    from tokenspeed_kernel_nvidia.ops.attention._common import row_stride

    q = torch.randn(5, 8, 64)
    assert row_stride(q) == 512 and row_stride(q.view(5, 1, 8, 64)) == 512
    assert row_stride(row_strided(q, 256)) == 768 and row_stride(row_strided(q, 256).view(5, 1, 8, 64)) == 768
    assert row_stride(row_strided(q[:1], 256)) == 512
    assert row_stride(torch.empty(1).expand(5, 1, 8, 64)) == 512
    assert row_stride(q[:0]) == 512


@pytest.mark.parametrize("max_seqlen_k", [200, 8192])  # fused merge / a separate merge kernel
def test_a_row_strided_q_is_read_in_place_through_its_row_stride(monkeypatch, max_seqlen_k):
    """A fused qkv's q: a runner key of its own; each layer's cached launches equal a fresh
    bind's; the decode kernel's ``Q_ROW`` is q's row stride (768), Hq D (512) for a
    contiguous q (the build every contiguous call gets); the merge kernel reads only the
    float32 partials and is launched alike for both."""
    from support.launch_recorder import Recorder, assert_same_launches

    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as mod

    rec = Recorder().install(monkeypatch)
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    plain = _decode_args(0, max_seqlen_k)
    assert mod._runner_key(_strided_q(plain)) != mod._runner_key(plain)
    mod.gluon_decode(plain)
    plain_launches = list(rec.launches)
    assert plain_launches[0][3]["Q_ROW"] == 512
    for layer in range(2):
        args = _strided_q(_decode_args(layer, max_seqlen_k))
        assert args.q.stride()[0] == 768 and args.out.is_contiguous()
        start = len(rec.launches)
        mod.gluon_decode(args)
        cached = rec.since(start)
        mod._fresh(args)
        fresh = rec.since(start + len(cached))
        assert len(cached) == len(plain_launches) == (1 if max_seqlen_k == 200 else 2)
        assert_same_launches(cached, fresh, [args.q, args.k_cache, args.v_cache, args.page_table,
                                             args.cache_seqlens, args.sinks, args.out, args.lse])  # fmt: skip
        assert cached[0][3]["Q_ROW"] == 768
        assert {k: v for k, v in cached[0][3].items() if k != "Q_ROW"} == {
            k: v for k, v in plain_launches[0][3].items() if k != "Q_ROW"
        }
        assert [launch[3] for launch in cached[1:]] == [launch[3] for launch in plain_launches[1:]]


def test_a_plans_placeholder_q_binds_the_contiguous_build(monkeypatch):
    """``bind_decode`` binds a contiguous q's plan with broadcast placeholders for q (stride 0):
    the contiguous build (``Q_ROW`` = Hq D), which every run's q of such a plan (contiguous, as
    ``DecodePlan.run`` checks) takes."""
    import dataclasses

    import torch

    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as mod

    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    plan = _decode_args(0, 200)
    layout = dataclasses.replace(plan, q=torch.empty(1, dtype=plan.q.dtype).expand(plan.q.shape))
    launches, *_ = mod._launches(layout)
    assert launches[0].kwargs["Q_ROW"] == 512


@pytest.mark.parametrize("max_seqlen_k", [200, 8192])  # fused merge / a separate merge kernel
def test_a_row_strided_plans_placeholder_binds_the_strided_build(monkeypatch, max_seqlen_k):
    """``bind_decode`` with the placeholder ``mha_decode_plan(..., q_row_stride=768)`` binds
    with (``_validate.row_placeholder``, viewed 4-D as a run's q is): the strided build
    (``Q_ROW`` = 768), and each run of a fused qkv's q launches what a fresh bind of that run's
    tensors launches."""
    import dataclasses

    import torch
    from support.launch_recorder import Recorder, assert_same_launches

    from tokenspeed_kernel.ops.attention._validate import placeholder, row_placeholder
    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as mod

    rec = Recorder().install(monkeypatch)
    monkeypatch.setattr(mod, "sm_count", lambda device: 132)
    plan = _decode_args(0, max_seqlen_k, lse=True)
    q_like = row_placeholder((2, 8, 64), 768, plan.q.dtype, plan.q.device).view(plan.q.shape)
    assert q_like.stride() == _strided_q(plan).q.stride()
    out_like, lse_like = (placeholder(t.shape, t.dtype, t.device) for t in (plan.out, plan.lse))
    layout = dataclasses.replace(plan, q=q_like, out=out_like, lse=lse_like)
    assert mod._launches(layout)[0][0].kwargs["Q_ROW"] == 768
    run = mod.bind_decode(layout)
    for layer in range(2):
        step = _strided_q(_decode_args(layer, max_seqlen_k, lse=True))
        args = dataclasses.replace(plan, q=step.q, out=torch.empty_like(plan.out), lse=torch.empty_like(plan.lse))
        start = len(rec.launches)
        run(args)
        cached = rec.since(start)
        mod._fresh(args)
        assert cached[0][3]["Q_ROW"] == 768
        assert_same_launches(cached, rec.since(start + len(cached)), [args.q, args.out, args.lse, plan.k_cache,
                                                                      plan.v_cache, plan.page_table, plan.cache_seqlens,
                                                                      plan.sinks])  # fmt: skip
