"""Functional runners of the Gluon TMA attention kernels (no GPU): ``gluon_prefill_window_sm90``,
``gluon_prefill_fa3_sm90``, ``gluon_prefill_fa3_window_sm90`` and ``gluon_extend_fa3_sm90`` run a
runner cached per call key, every
tensor of the call passed per run and their TMA descriptors derived per run from the run's
tensors (``tokenspeed_kernel_triton._runners``). Launches are recorded, nothing runs: three
"layers" of one key, each with its own q/k/v (caches, tables), out, lse and sinks, launch
exactly what a fresh bind of each layer launches (kernel, grid, every tensor and descriptor
base, scalars, constexprs)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import pytest
import torch
from support.launch_recorder import Recorder, assert_same_launches
from support.prefill_args import ragged_prefill_args
from support.strided_q import row_strided

from tokenspeed_kernel.ops.attention.args import ExtendArgs
from tokenspeed_kernel_nvidia.ops.attention import gluon_extend_fa3, gluon_prefill, gluon_prefill_fa3


def _window_args(layer: int, *, sinks=True, lse=False, max_q=None, lens_q=(5, 9), window=127):
    args = ragged_prefill_args(
        lens_q=lens_q, lens_k=(7, 9), hq=8, hkv=2, seed=layer, window_left=window, sinks=sinks, return_lse=lse
    )
    return args if max_q is None else dataclasses.replace(args, max_seqlen_q=max_q)


def _dense_args(layer: int, *, sinks=True, lse=False, max_q=None, lens_q=(5, 9)):
    return _window_args(layer, sinks=sinks, lse=lse, max_q=max_q, lens_q=lens_q, window=-1)


def _extend_args(layer: int, *, sinks=True, lse=False, max_q=None, lens_q=(5, 9), strided=False):
    g = torch.Generator().manual_seed(layer)
    total = sum(lens_q)
    q = torch.randn(total, 8, 64, generator=g).to(torch.bfloat16)
    if strided:  # K|V interleaved per token, as vLLM's pool: 16-byte multiples
        pool = torch.randn(6, 16, 2, 2, 64, generator=g).to(torch.bfloat16)
        k, v = pool[:, :, 0], pool[:, :, 1]
    else:
        k, v = (torch.randn(6, 16, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    table = torch.randperm(6, generator=g).int()[:6].view(2, 3)
    return ExtendArgs(
        q, k, v, table,
        torch.tensor([0, lens_q[0], total], dtype=torch.int32),
        torch.tensor([20, 40], dtype=torch.int32),
        max(lens_q) if max_q is None else max_q, 40, True, 0.125, -1,
        torch.randn(8, generator=g) if sinks else None, 0.0, None, None,
        torch.empty_like(q), torch.empty(total, 8) if lse else None,
    )  # fmt: skip


class Kernel(NamedTuple):
    call: Any  # the functional call (checked, cached)
    runners: Any  # its RunnerCache
    fresh: Any  # the uncached launch (checked, bound afresh)
    key: Any  # its runner key
    make: Any  # args of layer ``i``


KERNELS = {
    "gluon_prefill_window_sm90": Kernel(
        gluon_prefill.gluon_prefill_window, gluon_prefill._RUNNERS, gluon_prefill.launch,
        gluon_prefill._runner_key, _window_args,
    ),
    "gluon_prefill_fa3_sm90": Kernel(
        gluon_prefill_fa3.gluon_prefill_fa3, gluon_prefill_fa3._RUNNERS, gluon_prefill_fa3.launch,
        gluon_prefill_fa3._runner_key, _dense_args,
    ),
    "gluon_prefill_fa3_window_sm90": Kernel(
        gluon_prefill_fa3.gluon_prefill_fa3_window, gluon_prefill_fa3._WINDOW_RUNNERS,
        functools.partial(gluon_prefill_fa3.launch, windowed=True), gluon_prefill_fa3._runner_key, _window_args,
    ),
    "gluon_extend_fa3_sm90": Kernel(
        gluon_extend_fa3.gluon_extend_fa3, gluon_extend_fa3._RUNNERS, gluon_extend_fa3.launch,
        gluon_extend_fa3._runner_key, _extend_args,
    ),
}  # fmt: skip


def _tensors(args) -> list:
    """Every tensor of the call."""
    return [getattr(args, f.name) for f in dataclasses.fields(args) if isinstance(getattr(args, f.name), torch.Tensor)]


def _sm_count(monkeypatch) -> None:
    for module in (gluon_prefill, gluon_prefill_fa3, gluon_extend_fa3):
        monkeypatch.setattr(module, "sm_count", lambda device: 132)


def _run_and_compare(k: Kernel, rec: Recorder, args) -> list:
    """``args`` through the functional call (its cached runner), then through a fresh bind (the
    reference: checked, bound afresh, full arguments): one launch each, the same; returns the
    cached launches."""
    start = len(rec.launches)
    k.call(args)
    cached = rec.since(start)
    k.fresh(args)
    fresh = rec.since(start + len(cached))
    assert len(cached) == len(fresh) == 1
    assert_same_launches(cached, fresh, _tensors(args))
    return cached


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("sinks, lse", [(True, False), (False, True)])
def test_functional_runner_launches_what_a_fresh_bind_launches(monkeypatch, name, sinks, lse):
    """Three layers of one key: one runner, bound once; every launch argument of each layer's
    call (tensors, the descriptors' bases, shapes, strides, block shapes and layouts, scalars,
    constexprs) equals a fresh bind's of that layer. A stale tensor would show as layer 0's."""
    k = KERNELS[name]
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    binds = k.runners.binds
    bases = []
    for layer in range(3):
        cached = _run_and_compare(k, rec, k.make(layer, sinks=sinks, lse=lse))
        bases.append([a.base.data_ptr() for a in cached[0][2] if hasattr(a, "block_shape")])
    assert len(k.runners.runners) == 1, "three layers of one shape share one runner"
    assert k.runners.binds == binds + 1 and rec.bound == 1, "bound once for all three layers"
    assert len(bases[0]) == (2 if name == "gluon_prefill_window_sm90" else 3)
    assert len({tuple(b) for b in bases}) == 3, "each layer's descriptors over its own tensors"


@pytest.mark.parametrize("name", list(KERNELS))
def test_runner_key_follows_the_grid_and_the_options(monkeypatch, name):
    key, make = KERNELS[name].key, KERNELS[name].make
    _sm_count(monkeypatch)
    base = key(make(0))
    assert key(make(1)) == base, "another layer's tensors: the same key"
    assert key(make(0, sinks=False)) != base and key(make(0, lse=True)) != base
    assert key(make(0, lens_q=(5, 10))) != base, "another q shape"
    many = 200 if name == "gluon_prefill_window_sm90" else 300
    assert key(make(0, max_q=many)) != base, "another grid"
    if name == "gluon_extend_fa3_sm90":
        assert key(make(0, strided=True)) != base, "another cache layout"
    if make is _window_args:  # the window is a launch scalar a runner binds
        assert key(make(0, window=4)) != base, "another window"


@pytest.mark.parametrize("name", ["gluon_prefill_window_sm90", "gluon_prefill_fa3_window_sm90"])
def test_a_windowed_runner_launches_its_own_window(monkeypatch, name):
    """Calls alternating two windows of one shape: a runner per window, and each cached launch
    equals a fresh bind's of its call (its window scalar included), never the other window's."""
    k = KERNELS[name]
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    binds = k.runners.binds
    launched = {}
    for layer, window in enumerate((127, 4, 127, 4)):
        cached = _run_and_compare(k, rec, _window_args(layer, window=window))
        launched.setdefault(window, []).append([a for a in cached[0][2] if isinstance(a, int)])
    assert k.runners.binds == binds + 2 and len(k.runners.runners) == 2, "one runner per window"
    assert launched[127][0] == launched[127][1] and launched[4][0] == launched[4][1]
    assert launched[127][0] != launched[4][0], "the window reaches the launch's scalars"


def test_an_empty_batch_launches_nothing(monkeypatch):
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    for k in KERNELS.values():
        args = k.make(0)
        empty = dataclasses.replace(args, q=args.q[:0], out=args.out[:0], lse=None)
        k.call(empty)
    assert rec.launches == []


def test_bad_calls_raise_before_the_runner(monkeypatch):
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    with pytest.raises(ValueError, match="window"):
        gluon_prefill.gluon_prefill_window(_window_args(0, window=-1))
    with pytest.raises(ValueError, match="window"):
        gluon_prefill_fa3.gluon_prefill_fa3(dataclasses.replace(_dense_args(0), window_left=127))
    with pytest.raises(ValueError, match="window"):
        gluon_prefill_fa3.gluon_prefill_fa3_window(_dense_args(0))
    with pytest.raises(ValueError, match="causal"):
        gluon_extend_fa3.gluon_extend_fa3(dataclasses.replace(_extend_args(0), causal=False))
    assert rec.launches == []


# --- a row-strided q (strided_q): a fused qkv's q, read in place ---------------------------

FUSED_EXTRA = 2 * 2 * 64  # the k and v columns of a fused qkv row (Hkv 2, D 64): 256 elements


def _strided_q(args, extra: int = FUSED_EXTRA):
    """``args`` with q moved into rows ``extra`` elements wider (NaN past each row's q); out
    stays contiguous."""
    return dataclasses.replace(args, q=row_strided(args.q, extra))


def _q_launch_facts(name: str, launch) -> tuple:
    """How a launch addresses q: the window prefill's ``Q_ROW`` constexpr; the TMA kernels' q
    descriptor (base address, shape, strides)."""
    _, _, values, kwargs = launch
    if name == "gluon_prefill_window_sm90":
        return (kwargs["Q_ROW"],)
    desc = values[0]
    return desc.base.data_ptr(), list(desc.shape), list(desc.strides)


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_row_strided_q_is_read_in_place_through_its_row_stride(monkeypatch, name):
    """A fused qkv's q (rows of (Hq + 2 Hkv) D = 768 values): a runner key of its own; each
    layer's cached launch equals a fresh bind's; the window prefill's ``Q_ROW`` is q's row
    stride (Hq D = 512 for a contiguous q: the build every contiguous call gets), and the TMA
    kernels' q descriptor has q's own address and row stride over ``[rows, Hq D]`` (so TMA
    never reads the k/v columns)."""
    k = KERNELS[name]
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    plain = k.make(0)
    assert k.key(_strided_q(plain)) != k.key(plain), "another q layout: another runner"
    k.call(plain)
    rows = plain.q.shape[0]
    want_plain = (512,) if name == "gluon_prefill_window_sm90" else (plain.q.data_ptr(), [rows, 512], [512, 1])
    assert _q_launch_facts(name, rec.launches[-1]) == want_plain
    for layer in range(2):
        args = _strided_q(k.make(layer))
        assert args.q.stride() == (768, 64, 1) and args.out.is_contiguous()
        cached = _run_and_compare(k, rec, args)
        want = (768,) if name == "gluon_prefill_window_sm90" else (args.q.data_ptr(), [rows, 512], [768, 1])
        assert _q_launch_facts(name, cached[0]) == want


@pytest.mark.parametrize("name", list(KERNELS))
def test_a_q_row_stride_tma_cannot_read_is_refused_before_any_launch(monkeypatch, name):
    """Rows 4 bf16 elements wider (a row stride of 1032 bytes, 8 dividing): the TMA kernels
    raise ValueError naming the row stride before any launch (the selector already passed
    such a q over: ``unaligned_qkv`` for prefill, ``q_align`` for extend); the window
    prefill, which loads q with plain loads, launches with that row stride."""
    k = KERNELS[name]
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    args = _strided_q(k.make(0), 4)
    if name == "gluon_prefill_window_sm90":
        k.call(args)
        assert _q_launch_facts(name, rec.launches[-1]) == (516,)
        return
    for run in (k.call, k.fresh):
        with pytest.raises(ValueError, match=r"reads q by TMA: its row stride \(516 elements\) must be a multiple"):
            run(args)
    assert rec.launches == []


# --- the step plans' runners (``step_runner``): the base addresses checked per run ----------

_TMA_OPERANDS = {
    "gluon_prefill_fa3_sm90": ("q", "k", "v"),
    "gluon_prefill_fa3_window_sm90": ("q", "k", "v"),
    "gluon_extend_fa3_sm90": ("q", "k_cache", "v_cache"),
}


def _off_by_one_element(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values, shape and strides at a base 2 bytes past a 16-byte boundary."""
    storage = torch.zeros(t.untyped_storage().nbytes() // t.element_size() + 1, dtype=t.dtype)
    moved = storage.as_strided(t.shape, t.stride(), t.storage_offset() + 1)
    moved.copy_(t)
    return moved


@pytest.mark.parametrize("name", list(_TMA_OPERANDS))
def test_a_step_runner_checks_each_runs_tma_bases_before_any_launch(monkeypatch, name):
    """The runner a step plan keeps (the kernel's ``step_runner`` of its first run) launches a
    later layer of the plan's layout as a fresh bind does, and refuses a layer whose q, k or v
    has the plan's layout but a base off the 16-byte grid TMA needs: ValueError naming it,
    before any launch."""
    from tokenspeed_kernel import registry

    k = KERNELS[name]
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    step_runner = registry.get_kernel(name).step_runner
    runner = step_runner(k.make(0))
    for layer in range(2):
        args = k.make(layer + 1)
        start = len(rec.launches)
        runner(args)
        k.fresh(args)
        assert_same_launches(rec.since(start)[:1], rec.since(start)[1:], _tensors(args))
    for operand in _TMA_OPERANDS[name]:
        args = k.make(3)
        moved = _off_by_one_element(getattr(args, operand))
        assert moved.shape == getattr(args, operand).shape and moved.stride() == getattr(args, operand).stride()
        start = len(rec.launches)
        with pytest.raises(ValueError, match=f"needs {operand}[ ']"):
            runner(dataclasses.replace(args, **{operand: moved}))
        assert rec.since(start) == [], f"{operand}: nothing launched"


# --- the window prefill's persistent build (GluonPrefillConfig.persistent, opt-in) -------------


def _same_values(a: tuple, b: tuple) -> bool:
    """Launch arguments alike: the same tensors, descriptors over the same bases, equal scalars."""

    def facts(x):
        if hasattr(x, "block_shape"):  # a descriptor: its base's address, shape and box
            return "desc", x.base.data_ptr(), list(x.shape), list(x.block_shape)
        return ("tensor", id(x)) if isinstance(x, torch.Tensor) else ("value", x)

    return [facts(x) for x in a] == [facts(y) for y in b]


@pytest.mark.parametrize("max_q", [None, 200])
def test_the_persistent_window_build_walks_the_tiled_grid_s_items(monkeypatch, max_q):
    """The persistent build through the uncached launcher: one program per resident slot (6 x
    132 SMs at most, never more than the items), the tiled build's tensors, descriptors and
    scalars followed by the query-tile count and the item count (the tiled grid's programs),
    its constexprs but ``QK_AHEAD`` and the register cap that fits six programs (80). A q whose
    rows ``cp.async`` cannot copy (an odd row stride) gets the tiled build instead."""
    rec = Recorder().install(monkeypatch)
    _sm_count(monkeypatch)
    args = _window_args(0, lse=True, max_q=max_q)
    cfg = gluon_prefill.prefill_config(64, 4)
    persistent = dataclasses.replace(cfg, persistent=6)
    gluon_prefill.launch(args, cfg)
    gluon_prefill.launch(args, persistent)
    (tiled_fn, tiled_grid, tiled_args, tiled_kw), (fn, grid, values, kw) = rec.launches
    assert (tiled_fn, fn) == ("prefill_window_kernel", "prefill_window_persistent_kernel")
    items = tiled_grid[0] * tiled_grid[1] * tiled_grid[2]
    assert grid == (min(items, 6 * 132),) and values[-2:] == (tiled_grid[0], items)
    assert _same_values(values[:-2], tiled_args)
    assert kw == {**{k: v for k, v in tiled_kw.items() if k != "QK_AHEAD"}, "maxnreg": 80}
    gluon_prefill.launch(_strided_q(args, 4), persistent)  # rows of 516 elements: 4-byte copies
    assert rec.launches[-1][0] == "prefill_window_persistent_kernel" and rec.launches[-1][3]["Q_ROW"] == 516
    gluon_prefill.launch(_strided_q(args, 1), persistent)  # rows of 513 elements
    assert rec.launches[-1][0] == "prefill_window_kernel" and rec.launches[-1][3]["Q_ROW"] == 513
