"""FlashInfer plumbing shared by the FlashInfer attention kernels.

- :func:`flashinfer_missing` is every FlashInfer kernel's ``available`` hook: it looks for
  the module without importing it, so the backend loads (and ``explain`` shows the reason)
  on machines without flashinfer-python.
- :func:`flashinfer` imports the module lazily, on a kernel's first call.
- :class:`PlanCache` keeps one FlashInfer wrapper, its index buffers and its plan per
  *static* signature (batch, heads, dims, page size, dtypes, mask options). A wrapper is
  re-planned only when the *layout* tensors it was planned for change: the same tensor
  objects (same storage, same in-place version counter) mean the same lengths, so a
  decode step that hands every layer the same ``page_table``/``cache_seqlens`` costs one
  plan per step, not one per layer. FlashInfer's ``plan`` reads the CSR ``indptr`` on the
  host (one device-to-host copy), so it must run outside CUDA-graph capture; ``run`` is
  capturable. A call that would need a plan while the stream is capturing raises
  ``RuntimeError`` telling the caller to plan first (see docs/nvidia.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel_nvidia.ops.attention._common import FLASHINFER_CAPABILITIES, VENDORS, same_head_dims

__all__ = [
    "LN2",
    "PlanCache",
    "flashinfer",
    "flashinfer_missing",
    "layout_token",
    "workspace",
]

LN2 = math.log(2.0)
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)

_lock = threading.Lock()
_workspaces: dict[torch.device, torch.Tensor] = {}


def flashinfer_missing() -> str | None:
    """``available`` hook: a reason when flashinfer-python cannot be imported, else None."""
    try:
        found = importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "flashinfer-python not installed"


def flashinfer_registration(*, graph_safe: bool) -> dict[str, Any]:
    """The ``register_kernel`` metadata every FlashInfer kernel shares (data, not branches):
    solution, CUDA gates, opt-in priority, the head-dim predicate and the absence hook, plus
    ``graph_safe``, which each kernel states: True only for a wrapper built in CUDA-graph
    mode whose plan is made outside capture (the decode, through its ``prepare_layout``)."""
    return {
        "solution": "flashinfer",
        "vendors": VENDORS,
        "capabilities": FLASHINFER_CAPABILITIES,
        "priority": Priority.OPT_IN,
        "predicate": same_head_dims,
        "available": flashinfer_missing,
        "graph_safe": graph_safe,
    }


def flashinfer() -> Any:
    """The flashinfer module, imported on first use (never at backend load)."""
    return importlib.import_module("flashinfer")


def workspace(device: torch.device) -> torch.Tensor:
    """One zero-initialized float workspace per device, shared by every wrapper (the
    wrappers run one after another on the stream, never concurrently)."""
    with _lock:
        buf = _workspaces.get(device)
        if buf is None:
            buf = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            _workspaces[device] = buf
        return buf


def layout_token(*tensors: torch.Tensor) -> tuple[Any, ...]:
    """What identifies the *contents* of the layout tensors without reading them: the
    objects themselves (kept alive by the cache, so their storage is never reused by a new
    allocation), their data pointers, shapes and in-place version counters."""
    return tuple((t, t.data_ptr(), tuple(t.shape), t._version) for t in tensors)


def _same_layout(a: tuple[Any, ...] | None, b: tuple[Any, ...]) -> bool:
    if a is None or len(a) != len(b):
        return False
    return all(x[0] is y[0] and x[1:] == y[1:] for x, y in zip(a, b))


@dataclass
class PlanEntry:
    """One wrapper with its buffers and the layout it is currently planned for."""

    wrapper: Any
    buffers: Any
    planned_for: tuple[Any, ...] | None = None
    plans: int = 0


@dataclass
class PlanCache:
    """Wrappers per static signature; plans per layout (see the module docstring)."""

    name: str
    entries: dict[Hashable, PlanEntry] = field(default_factory=dict)

    def get(
        self,
        key: Hashable,
        make: Callable[[], PlanEntry],
        layout: tuple[Any, ...],
        plan: Callable[[PlanEntry], None],
    ) -> PlanEntry:
        """The entry for ``key`` (made on first use), planned for ``layout``."""
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = make()
        if not _same_layout(entry.planned_for, layout):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.name}: FlashInfer needs a plan for this batch layout, and plans cannot be "
                    "made during CUDA-graph capture; run the call once eagerly with the same "
                    "page_table/cache_seqlens tensors before capturing (and again, eagerly, after "
                    "updating them and before each replay) — see docs/nvidia.md"
                )
            plan(entry)
            entry.planned_for = layout
            entry.plans += 1
        return entry

    def clear(self) -> None:
        self.entries.clear()
