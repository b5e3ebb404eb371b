"""Peak extra memory of a PyTorch computation, counted from the tensors its ATen ops create.

:class:`PeakTracker` is a ``TorchDispatchMode``: every tensor an operator returns inside the
``with`` block is recorded under its storage (views share their base's entry), weakly, so a
storage counts from the op that created it until the last Python tensor on it is gone (CPython
frees temporaries by reference counting, i.e. before the next op runs). After each op the live
bytes are summed; ``peak`` is the largest sum. Storages of the ``inputs`` given to the tracker
are not counted (they are not extra memory).

Why this is sound for the bound it tests: every byte a pure-PyTorch function allocates is the
storage of some tensor that an ATen op returned, and the sum is taken right after each op
returned its output, while its inputs are still referenced, which is when live memory is
largest. What it cannot see: scratch memory inside a single ATen kernel and allocator rounding
or caching (a GPU caching allocator may hold freed blocks; it reuses them for the next chunk of
the same size). Works on the ``meta`` device, so a multi-GB shape costs no memory or time.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["PeakTracker"]


class PeakTracker(TorchDispatchMode):
    """``with PeakTracker(*inputs) as t: f(*inputs)``; then ``t.peak`` is the peak extra bytes."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        self._inputs = {t.untyped_storage()._cdata for t in inputs}
        self._live: dict[int, tuple[int, list[weakref.ref]]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self._inputs:
                    self._live.setdefault(storage._cdata, (storage.nbytes(), []))[1].append(weakref.ref(t))
        for key, (_, refs) in list(self._live.items()):
            refs[:] = [r for r in refs if r() is not None]
            if not refs:
                del self._live[key]
        self.peak = max(self.peak, sum(nbytes for nbytes, _ in self._live.values()))
        return out
