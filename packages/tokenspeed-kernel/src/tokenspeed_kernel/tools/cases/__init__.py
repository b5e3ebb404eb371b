"""One front door over the per-family case modules (inputs, call, float64 ground truth).

A *case* is a frozen description of one problem (:class:`AttentionCase`, :class:`MoECase`);
its ``op`` field names the operator, and the functions below dispatch on it through a
table, so the tools never branch on families.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.tools.cases import attention, moe
from tokenspeed_kernel.tools.cases.attention import AttentionCase
from tokenspeed_kernel.tools.cases.moe import MoECase

__all__ = [
    "NO_CASES",
    "OPS",
    "AttentionCase",
    "Case",
    "MoECase",
    "awkward_cases",
    "call",
    "fresh_copies",
    "make_inputs",
    "module_for",
    "plan_call",
    "plan_paths",
    "planned_call",
    "reference",
    "relayout",
    "request",
]

Case = AttentionCase | MoECase

_MODULES: dict[str, ModuleType] = {op: module for module in (attention, moe) for op in module.OPS}
OPS: tuple[str, ...] = tuple(_MODULES)

_ACROSS_RANKS = (
    "the expert-parallel exchange runs across the ranks of a process group, not in one process "
    "(tests/tokenspeed_kernel/ops/moe/test_ep.py checks it on gloo ranks, ci/device/ep_bench.py on GPUs)"
)
# Operators with no single-process cases, and why: check, bench, explain by preset and
# profile say so, and a capture file's lines of them are not replayed.
NO_CASES: dict[str, str] = {"moe.dispatch": _ACROSS_RANKS, "moe.combine": _ACROSS_RANKS}


def module_for(op: str) -> ModuleType:
    """The case module serving ``op``; ``ValueError`` naming the known operators otherwise
    (and why, for an operator of :data:`NO_CASES`)."""
    try:
        return _MODULES[op]
    except KeyError:
        if op in NO_CASES:
            raise ValueError(f"no cases for operator {op!r}: {NO_CASES[op]}") from None
        raise ValueError(f"no cases for operator {op!r}; known: {', '.join(OPS)}") from None


def make_inputs(case: Case, device: torch.device | str = "cpu", seed: int = 0) -> dict[str, Any]:
    return module_for(case.op).make_inputs(case, device, seed)


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` at the same address modulo 16 bytes when ``t`` is contiguous (a case's
    deliberately misaligned q/k/v stay misaligned, so the call builds the same request). A
    strided view (a row-strided q, vLLM's interleaved K|V caches) gets a copy of the storage
    it views, viewed with its offset and strides: the same layout (``Tensor.clone`` would make
    it contiguous, and the call would ask for another kernel) and what lies between its rows
    (NaN in the cases)."""
    if not t.is_contiguous():
        copy = t.new_empty(0)
        return copy.set_(t.untyped_storage().clone(), t.storage_offset(), t.shape, t.stride())
    shift = t.data_ptr() % 16
    if not shift or not t.is_contiguous() or shift % t.element_size():
        return t.clone()
    return attention.copy_at(t, shift // t.element_size())


def fresh_copies(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with every tensor cloned, once per distinct tensor: an input given twice (one
    lengths tensor for queries and keys, as engines pass it) stays one object, and a copy keeps
    its original's address modulo 16 bytes, so the call builds the same request as with the
    originals."""
    clones: dict[int, torch.Tensor] = {}
    fresh = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            if id(value) not in clones:
                clones[id(value)] = _clone(value)
            value = clones[id(value)]
        fresh[name] = value
    return fresh


def call(case: Case, inputs: dict[str, Any], override: str | None = None, out: torch.Tensor | None = None) -> Any:
    """Run the public operator of ``case``; ``out`` (a preallocated output) where it takes one."""
    return module_for(case.op).call(case, inputs, override, out=out)


def planned_call(case: Case, inputs: dict[str, Any], override: str | None = None) -> Callable[[], Any]:
    """A no-argument callable running ``case`` as an engine does every step: weights planned
    once (``moe_plan`` and the kernel's ``prepare`` hook) where the operator has a plan."""
    return module_for(case.op).planned_call(case, inputs, override)


def plan_paths(case: Case, spec: KernelSpec) -> tuple[str, ...]:
    """The per-step plans whose path kernel ``spec``'s hooks claim serves ``case`` as the call
    does (attention: ``"step"`` for a ``step_runner`` hook, ``"decode"`` for a decode plan's
    ``bind``/``prepare_layout``), none where the operator's plan is not a per-call path (the KV
    store, the MoE operators: their plans are ``planned_call``'s)."""
    paths = getattr(module_for(case.op), "plan_paths", None)
    return () if paths is None else paths(case, spec)


def plan_call(case: Case, inputs: dict[str, Any], override: str | None, out: torch.Tensor | None, path: str) -> Any:
    """``case`` through plan ``path`` (one of :func:`plan_paths`) with kernel ``override``, run
    twice so the runner a hook returned serves the second; its result."""
    return module_for(case.op).plan_call(case, inputs, override, out, path)


def relayout(case: Case, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """``inputs`` with new batch-layout tensors of the same values (the next step of an
    engine), or None when the operator takes no layout."""
    return module_for(case.op).relayout(case, inputs)


def request(case: Case) -> Request:
    """The selector request the public operator builds for ``case``."""
    return module_for(case.op).request(case)


def reference(case: Case, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module_for(case.op).reference(case, inputs)


def awkward_cases(op: str, dtype: torch.dtype = torch.bfloat16) -> list[Case]:
    return module_for(op).awkward_cases(op, dtype)
