"""Records the launches of the Triton wheel's launch helpers (CPU tests of runner caches).

:class:`Recorder` stands in for ``_launcher.jit_launch`` (what ``Launch()`` and an uncached
launch call) and ``_runners.BoundLaunch`` (what a runner's pipeline binds): each launch is
recorded as (kernel name, grid, effective positional arguments, keyword arguments) and nothing
runs. :func:`assert_same_launches` compares a cached runner's launches with a fresh bind's.
"""

from __future__ import annotations

import pytest
import torch


def isolate_runners(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give every runner cache an empty table for the test: runners bound while the test swaps
    kernels or launch helpers (recorders) are dropped with it, and the earlier ones return."""
    from tokenspeed_kernel_triton import _runners

    for cache in _runners._CACHES:
        monkeypatch.setattr(cache, "runners", {})


class Recorder:
    """Install with :meth:`install` (which also isolates the runner caches); ``launches`` lists every launch, ``bound`` counts the
    ``BoundLaunch`` objects made (one per launch of each runner bound), ``values`` lists what
    each bound launch was handed (its varying values: a derived slot's tensor, not its
    descriptor)."""

    def __init__(self) -> None:
        self.launches: list = []
        self.bound = 0
        self.values: list = []  # per bound launch's launch: the varying values as handed to it

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Recorder:
        from tokenspeed_kernel_triton import _launcher, _runners

        isolate_runners(monkeypatch)
        monkeypatch.setattr(_launcher, "jit_launch", self.jit_launch)
        monkeypatch.setattr(_runners, "BoundLaunch", self.bound_launch)
        return self

    def jit_launch(self, fn, grid, *args, **kwargs):
        self.launches.append((fn.__name__, tuple(grid), args, kwargs))

    def bound_launch(self, fn, grid, args, kwargs, varying, derived=()):
        from tokenspeed_kernel_triton._launcher import PendingDescriptor

        self.bound += 1
        recorder = self
        derived = derived or (None,) * len(varying)

        def launch(*values):
            recorder.values.append(values)
            full = list(args)
            for position, value, slot in zip(varying, values, derived, strict=True):
                # A pending descriptor is built, as a launch that is not direct builds it; a
                # derived slot's descriptor is built over the tensor passed there.
                if slot is not None:
                    full[position] = slot.build(value)
                else:
                    full[position] = value.build() if type(value) is PendingDescriptor else value
            recorder.launches.append((fn.__name__, tuple(grid), tuple(full), kwargs))

        return launch

    def since(self, start: int) -> list:
        return self.launches[start:]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    base = getattr(value, "base", None)  # a Gluon TensorDescriptor
    return [base] if isinstance(base, torch.Tensor) else []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _same_arg(got, want, call: set[int]) -> bool:
    """A tensor of the call (one sharing a call tensor's storage): the same memory (address,
    shape, strides, dtype). Any other tensor (a scratch buffer or workspace): the same layout.
    A descriptor: the same of its base tensor, and the same shape, strides, block shape, layout
    and padding. Anything else: equal."""
    got_t, want_t = _tensors(got), _tensors(want)
    if got_t or want_t:
        if len(got_t) != 1 or len(want_t) != 1 or type(got) is not type(want):
            return False
        a, b = got_t[0], want_t[0]
        if not isinstance(got, torch.Tensor) and (
            [list(got.shape), list(got.strides), list(got.block_shape), got.padding]
            != [list(want.shape), list(want.strides), list(want.block_shape), want.padding]
            or got.layout is not want.layout
        ):
            return False
        if _storage(a) in call or _storage(b) in call:
            return a.data_ptr() == b.data_ptr() and _layout(a) == _layout(b)
        return _layout(a) == _layout(b)
    return type(got) is type(want) and got == want


def assert_same_launches(cached: list, fresh: list, call_tensors) -> None:
    """``cached`` launches (a runner's) equal ``fresh`` ones (bound afresh for the same call):
    same kernels, grids, constexprs, scalars, and the call's own tensors at the same positions
    (``call_tensors``: every tensor the call was given)."""
    call = {_storage(t) for t in call_tensors if isinstance(t, torch.Tensor)}
    assert len(cached) == len(fresh), (len(cached), len(fresh))
    for (name, grid, got, kw), (name2, grid2, want, kw2) in zip(cached, fresh, strict=True):
        assert (name, grid) == (name2, grid2)
        assert kw.keys() == kw2.keys() and all(kw[k] is kw2[k] or kw[k] == kw2[k] for k in kw), name
        assert len(got) == len(want), name
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if not _same_arg(a, b, call)]
        assert not bad, f"{name}: arguments {bad} differ from a fresh bind's"
