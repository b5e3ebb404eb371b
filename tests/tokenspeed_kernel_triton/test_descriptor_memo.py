"""The launch cache's descriptor memo (``tokenspeed_kernel_triton._launcher``) on CPU: a bound
launch's encoding of a runner's pending descriptor (``_runners.derive_descriptor``), keyed on
what the descriptor depends on, with a fake encoder that counts its calls and returns what it
was asked to encode (a stale encoding would show). A runner's descriptor over one input is
its launch's derived slot instead (end to end on a fake GPU: test_launcher.py,
``test_a_runners_derived_descriptor*`` and ``test_a_derived_slot_*``).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tokenspeed_kernel_triton import _launcher, _runners

_META = {"swizzle": 128, "elem_size": 2, "elem_type": 10, "block_size": [32, 64], "fp4_padded": False}
CPU = -1  # the device index of a CPU tensor (``Tensor.get_device``)


def _layout():
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for([32, 64], gl.bfloat16)


_LAYOUT = _layout()


def _rows(x: torch.Tensor, rows: int, layout, padding: str = "zero"):
    """A descriptor over ``x [n, cols]`` (any strides, stride 1 last), box ``[rows, 64]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [rows, 64], layout, padding)


def _fresh(x: torch.Tensor, rows: int, layout):
    """A descriptor over a buffer it allocates (as ``head_tile_descriptor`` does for an empty
    ``x``): its address is not in the key, so its encoding is never remembered."""
    return _rows(torch.zeros(x.shape, dtype=x.dtype), rows, layout)


def _pending(x: torch.Tensor, rows: int = 32, layout=_LAYOUT, fn=_rows) -> _launcher.PendingDescriptor:
    """What a runner's run passes for ``derive_descriptor(fn, x, rows, layout)``."""
    call = [x, rows, layout]
    head = _runners._descriptor_head(fn, (None, rows, layout))
    return _launcher.PendingDescriptor(_runners._descriptor_key(head, call, (0,)), fn, call)


class _Make:
    """A fake ``make_tensordesc_arg``: counts its calls, encodes what it was asked to."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, desc, meta):
        self.calls += 1
        tensor_map = ("map", desc.base.data_ptr(), desc.base.dtype, tuple(desc.block_shape), desc.padding)
        return [tensor_map, *desc.shape, *desc.strides]


def _slot(make, block=(32, 64), layout=_LAYOUT, width=5) -> tuple:
    """A bound launch's check of a varying descriptor slot (``BoundLaunch._checks``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return (TensorDescriptor, list(block), layout, make, _META, _launcher._meta_token(make, _META), width)


def _encode(pending, make, dtype=torch.bfloat16, block=(32, 64), layout=_LAYOUT):
    return _launcher._descriptor_parts(pending, dtype, _slot(make, block, layout), CPU)


@pytest.fixture(autouse=True)
def _empty_memo():
    _launcher.clear()
    yield
    _launcher.clear()


def _x(rows: int = 64, cols: int = 64, dtype=torch.bfloat16) -> torch.Tensor:
    """``[rows, cols]``, the first half of a buffer twice as long (room for wider strides)."""
    return torch.randn(2 * rows, cols).to(dtype)[:rows]


def test_a_pending_descriptor_is_built_and_encoded_once_per_key():
    make, x = _Make(), _x()
    first = _encode(_pending(x), make)
    again = _encode(_pending(x), make)
    assert make.calls == 1 and list(again) == first, "the second is the memo's encoding"
    assert first[0] == ("map", x.data_ptr(), torch.bfloat16, (32, 64), "zero") and first[1:] == [64, 64, 64, 1]
    assert _launcher.descriptor_memo_stats() == {"hits": 1, "misses": 1, "entries": 1, "limit": 256}


CHANGES = {
    # name: (the changed tensor from x, the slot's dtype and block rows, the block rows keyed)
    "address": (lambda x: x.clone(), torch.bfloat16, 32),
    "shape": (lambda x: x[:48], torch.bfloat16, 32),
    "strides": (lambda x: x.as_strided((64, 64), (128, 1)), torch.bfloat16, 32),
    "dtype": (lambda x: x.view(torch.float16), torch.float16, 32),
    "block shape": (lambda x: x, torch.bfloat16, 16),
}


@pytest.mark.parametrize("name", list(CHANGES))
def test_a_change_of_what_the_encoding_reads_is_another_entry(name):
    """The same memory seen otherwise (or other memory seen alike) is encoded anew, and what
    the launch gets is the encoding of the changed descriptor, never the first's."""
    make, x = _Make(), _x()
    _encode(_pending(x), make)
    change, dtype, rows = CHANGES[name]
    y = change(x)
    got = _encode(_pending(y, rows), make, dtype=dtype, block=(rows, 64))
    assert make.calls == 2 and _launcher.descriptor_memo_stats()["entries"] == 2
    assert list(got) == _Make()(_rows(y, rows, _LAYOUT), _META), "the changed descriptor's own encoding"
    assert list(_encode(_pending(x), make)) == _Make()(_rows(x, 32, _LAYOUT), _META) and make.calls == 2


def test_a_hit_unlike_the_slot_takes_the_full_path():
    """An entry is checked against the slot as a built descriptor would be (here another layout
    object, as a kernel compiled for it would have): None, the launch goes through Triton."""
    make, x = _Make(), _x()
    _encode(_pending(x), make)
    assert _encode(_pending(x), make, layout=_layout()) is None
    assert _encode(_pending(x), make, dtype=torch.float16) is None
    assert _encode(_pending(x), make, block=(16, 64)) is None
    assert make.calls == 1


def _over(x: torch.Tensor, rows: int, layout):
    """A descriptor whose base is ``x`` even when misaligned (Triton's own asserts it)."""
    desc = _rows(torch.zeros(x.shape, dtype=x.dtype), rows, layout)
    object.__setattr__(desc, "base", x)
    return desc


def test_a_misaligned_base_is_refused_and_never_remembered():
    make = _Make()
    x = torch.randn(64 * 64 + 1).to(torch.bfloat16)[1:].view(64, 64)
    assert _encode(_pending(x, fn=_over), make) is None and make.calls == 0
    assert _launcher.descriptor_memo_stats()["entries"] == 0


def test_a_descriptor_over_a_buffer_fn_allocated_is_never_remembered():
    make, x = _Make(), _x()
    for _ in range(2):
        assert _encode(_pending(x, fn=_fresh), make) is not None
    assert make.calls == 2 and _launcher.descriptor_memo_stats()["entries"] == 0


def test_a_launcher_handed_the_base_tensor_is_never_remembered():
    """Without TMA metadata Triton's wrapper passes the base tensor itself: no memo token."""
    make, x = _Make(), _x()
    slot = (*_slot(make)[:4], None, _launcher._meta_token(make, None), 5)
    assert slot[5] is None
    for _ in range(2):
        assert _launcher._descriptor_parts(_pending(x), torch.bfloat16, slot, CPU) is not None
    assert make.calls == 2 and _launcher.descriptor_memo_stats()["entries"] == 0


def test_the_memo_keeps_no_tensor_alive():
    make, x = _Make(), _x()
    pending = _pending(x)
    dead = weakref.ref(x)
    _encode(pending, make)
    del x, pending
    gc.collect()
    assert dead() is None, "the memo holds a tensor"
    assert _launcher.descriptor_memo_stats()["entries"] == 1


def test_the_memo_is_a_bounded_lru(monkeypatch):
    monkeypatch.setattr(_launcher._MEMO, "limit", 3)
    make = _Make()
    xs = [_x() for _ in range(4)]
    for x in xs[:3]:
        _encode(_pending(x), make)
    _encode(_pending(xs[0]), make)  # now the most recent: xs[1] is the least
    _encode(_pending(xs[3]), make)
    assert make.calls == 4 and _launcher.descriptor_memo_stats()["entries"] == 3
    _encode(_pending(xs[0]), make)
    _encode(_pending(xs[3]), make)
    assert make.calls == 4, "kept"
    _encode(_pending(xs[1]), make)
    assert make.calls == 5, "evicted"
    assert _launcher.descriptor_memo_stats()["entries"] == 3


def test_a_derived_descriptor_is_passed_pending_unless_its_launch_derives_it():
    """Over one input, a derived descriptor is its launches' derived slot (nothing computed per
    run); over two inputs it is passed pending, its memo key's head the bound arguments (the
    layout by identity); read by another derived value it is built per run."""
    x, y = _x(), _x()

    def two(a, b, rows, layout):
        return _rows(a, rows, layout)

    desc = _runners.derive_descriptor(_rows, x, 32, _LAYOUT)
    pipe = _runners.pipeline([], (x,), derived=(desc,))
    assert pipe._derived == (), "a derived slot: its launch derives it"
    pair = _runners.derive_descriptor(two, x, y, 32, _LAYOUT)
    pipe = _runners.pipeline([], (x, y), derived=(pair,))
    ((_fn, bound, positions, _slots, head),) = pipe._derived
    assert bound == (None, None, 32, _LAYOUT) and positions == (0, 1)
    assert head == (two, *[(type(None), None)] * 2, (int, 32), (type(_LAYOUT), id(_LAYOUT))), "the layout by identity"
    rows = _runners.derive(lambda d: d.base, desc.value)
    pipe = _runners.pipeline([], (x,), derived=(desc, rows))
    assert pipe._derived[0][4] is None, "built per run: another derived value reads it"
