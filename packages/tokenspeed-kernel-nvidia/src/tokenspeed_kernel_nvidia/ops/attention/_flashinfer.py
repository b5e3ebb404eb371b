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
- :func:`make_sink_wrapper` builds FlashInfer's ``BatchAttentionWithAttentionSinkWrapper``
  for every call that has ``sinks``. The standard FA2/FA3 wrappers take ``run(..., sinks=)``
  but forward it only to the trtllm-gen backend: on FA2/FA3 the sinks were silently dropped
  (measured on an H100, 2026-11-23). The sink wrapper is a paged-prefill wrapper whose JIT
  variant ``AttentionSink`` adds the sink to the softmax denominator (and to the LSE); it is
  run as ``run(q, (k, v), sinks, sm_scale, ...)``. The variant has no logits soft-cap, so
  :func:`flashinfer_predicate` rejects sinks + logit_cap at selection.
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

from tokenspeed_kernel.kit import equal_head_dims
from tokenspeed_kernel.registry import Priority, Request
from tokenspeed_kernel_nvidia.ops.attention._common import FLASHINFER_ARCHS, FLASHINFER_CAPABILITIES, VENDORS

__all__ = [
    "LN2",
    "SINKS_WITH_LOGIT_CAP",
    "SINK_BACKEND",
    "PlanCache",
    "check_sinks",
    "flashinfer",
    "flashinfer_missing",
    "flashinfer_predicate",
    "layout_token",
    "make_sink_wrapper",
    "sink_backend",
    "workspace",
    "wrapper_route",
]

LN2 = math.log(2.0)
WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace (split-KV partials)

# The sink wrapper's backend: FlashInfer's own rule picks FA3 on sm_90 for bf16/fp16 q and
# KV (head dims 64/128/256) and FA2 otherwise (an fp8 cache with a bf16/fp16 q, sm_80).
SINK_BACKEND = "auto"
SINKS_WITH_LOGIT_CAP = (
    "sinks with logit_cap: FlashInfer's attention-sink variant (AttentionSink, fa2/fa3) has no "
    "logits soft-cap, and the standard wrappers ignore sinks on fa2/fa3"
)

_lock = threading.Lock()
_workspaces: dict[torch.device, torch.Tensor] = {}
# JIT module name -> what it was built for (see make_sink_wrapper).
_sink_modules: dict[tuple[Any, ...], tuple[Any, ...]] = {}


def flashinfer_missing() -> str | None:
    """``available`` hook: a reason when flashinfer-python cannot be imported, else None."""
    try:
        found = importlib.util.find_spec("flashinfer") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "flashinfer-python not installed"


def flashinfer_registration(*, graph_safe: bool) -> dict[str, Any]:
    """The ``register_kernel`` metadata every FlashInfer kernel shares (data, not branches):
    solution, CUDA gates (the architectures we have run it on, the capabilities it needs), opt-in priority, :func:`flashinfer_predicate` and the absence hook, plus
    ``graph_safe``, which each kernel states: True only for a wrapper built in CUDA-graph
    mode whose plan is made outside capture (the decode, through its ``prepare_layout``)."""
    return {
        "solution": "flashinfer",
        "vendors": VENDORS,
        "archs": FLASHINFER_ARCHS,
        "capabilities": FLASHINFER_CAPABILITIES,
        "priority": Priority.OPT_IN,
        "predicate": flashinfer_predicate,
        "available": flashinfer_missing,
        "graph_safe": graph_safe,
    }


def flashinfer_predicate(request: Request) -> str | None:
    """Predicate of every FlashInfer kernel: equal q/k and v head dims, and no feature
    combination the sink route cannot compute (a reason instead of a wrong answer)."""
    why = equal_head_dims(request)
    if why:
        return why
    if {"sinks", "logit_cap"} <= request.features:
        return SINKS_WITH_LOGIT_CAP
    return None


def check_sinks(sinks: object, num_q_heads: int) -> None:
    """``TypeError`` unless ``sinks`` is None or a float32 ``[num_q_heads]`` tensor: what the
    TensorRT-LLM kernels' FFI boundaries take (FMHAv2's rejects a Python list)."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"sinks: a float32 [{num_q_heads}] tensor expected, got {got}")


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


def sink_backend(
    device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim_qk: int, head_dim_vo: int
) -> str:
    """The concrete backend (``"fa2"``/``"fa3"``) the sink wrapper runs on: ``SINK_BACKEND``,
    with ``"auto"`` resolved by FlashInfer's own rule (no RoPE, no fp16 QK reduction, no
    custom mask), exactly as the wrapper's constructor would resolve it."""
    if SINK_BACKEND != "auto":
        return SINK_BACKEND
    utils = importlib.import_module("flashinfer.utils")
    return utils.determine_attention_backend(
        device, 0, False, False, q_dtype, kv_dtype, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo
    )


def wrapper_route(sinks: torch.Tensor | None, plain: str) -> str:
    """Which wrapper serves a call (part of every plan-cache key): the sink wrapper, whose
    constructor specializes on dtypes, head dims, window on/off and backend (the rest of the
    key), when ``sinks`` is given; else the route named ``plain``."""
    return f"sink:{SINK_BACKEND}" if sinks is not None else plain


def make_sink_wrapper(
    device: torch.device,
    *,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    head_dim_qk: int,
    head_dim_vo: int,
    window_left: int,
    **graph_buffers: Any,
) -> Any:
    """A ``BatchAttentionWithAttentionSinkWrapper`` (NHD) for these dtypes, head dims and
    window mode; ``graph_buffers`` (``use_cuda_graph=True`` and the ``*_buf`` tensors) put it
    in CUDA-graph mode.

    FlashInfer 0.7.2 names the sink JIT module by q dtype, window on/off and backend only
    (``batch_prefill_attention_sink_{q}_swa_{bool}_{backend}``), although it also compiles in
    the KV dtype and the head dims. Two wrappers that differ only in those would share one
    module name, and the second would load the first one's library in this process. Rather
    than run a kernel built for other shapes, the second raises ``RuntimeError``."""
    backend = sink_backend(device, q_dtype, kv_dtype, head_dim_qk, head_dim_vo)
    name = (q_dtype, window_left >= 0, backend)
    built_for = (kv_dtype, head_dim_qk, head_dim_vo)
    with _lock:
        previous = _sink_modules.setdefault(name, built_for)
    if previous != built_for:
        raise RuntimeError(
            f"FlashInfer's attention-sink JIT module for q={q_dtype}, window={window_left >= 0}, "
            f"backend={backend} was already built in this process for kv dtype/head dims {previous}; "
            f"FlashInfer 0.7.2 names that module without them, so {built_for} cannot be loaded "
            "alongside it (use one KV dtype and head dim per q dtype with sinks, or another process)"
        )
    return flashinfer().BatchAttentionWithAttentionSinkWrapper(
        workspace(device),
        "NHD",
        backend=backend,
        q_data_type=q_dtype,
        kv_data_type=kv_dtype,
        head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo,
        window_left=window_left,
        **graph_buffers,
    )


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
