"""``torch.ops.tokenspeed_kernel.moe_topk`` / ``moe_apply`` / ``moe_plan_apply``: the MoE
operators as torch.library custom ops, so they trace under ``torch.compile`` and CUDA graphs.

The public functions validate and then, when ``torch.compiler.is_compiling()``, call these
ops; their real implementations run the eager path and their fake implementations return
empty tensors of the right shapes. Quantized weight containers cannot cross an op schema,
so each weight is flattened to ``(a, b, format)`` by :func:`flatten_weight`:
``plain`` → ``(w, None)``, ``mxfp4`` → ``(packed, scales)``, ``fp8_*`` → ``(data, scale)``,
and rebuilt by :func:`unflatten_weight`.

``moe_plan_apply`` runs a live :class:`~tokenspeed_kernel.ops.moe.plan.MoEPlan` by its
integer handle (plans are looked up in a weak table), so the prepared weights stay with the
plan and the traced graph only sees ``x`` and the routing tensors.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight

__all__ = ["flatten_weight", "lookup_plan", "register_plan", "unflatten_weight"]


def flatten_weight(w: Any) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """``(a, b, format)`` for a plain tensor or a quantized container (see module docstring)."""
    if isinstance(w, MXFP4Weight):
        return w.packed, w.scales, "mxfp4"
    if isinstance(w, FP8Weight):
        return w.data, w.scale, w.format
    return w, None, "plain"


def unflatten_weight(a: torch.Tensor, b: torch.Tensor | None, fmt: str) -> Any:
    """The inverse of :func:`flatten_weight`."""
    if fmt == "plain":
        return a
    if b is None:
        raise ValueError(f"weight format {fmt!r} needs its scale tensor")
    return MXFP4Weight(a, b) if fmt == "mxfp4" else FP8Weight(a, b)


@torch.library.custom_op("tokenspeed_kernel::moe_topk", mutates_args=())
def _moe_topk_op(
    router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, override: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    from tokenspeed_kernel.ops.moe.api import moe_topk

    return moe_topk(router_logits, top_k, scoring=scoring, renormalize=renormalize, override=override)


@_moe_topk_op.register_fake
def _moe_topk_fake(router_logits, top_k, scoring, renormalize, override):
    shape = (router_logits.shape[0], top_k)
    return (
        router_logits.new_empty(shape, dtype=torch.float32),
        router_logits.new_empty(shape, dtype=torch.int32),
    )


@torch.library.custom_op("tokenspeed_kernel::moe_apply", mutates_args=())
def _moe_apply_op(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2: torch.Tensor,
    w2_scale: torch.Tensor | None,
    weight_format: str,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    expert_map: torch.Tensor | None,
    override: str | None,
    activation_quant: str | None = None,
) -> torch.Tensor:
    from tokenspeed_kernel.ops.moe.api import moe_apply

    return moe_apply(
        x,
        unflatten_weight(w13, w13_scale, weight_format),
        unflatten_weight(w2, w2_scale, weight_format),
        topk_weights,
        topk_ids,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        expert_map=expert_map,
        override=override,
        activation_quant=activation_quant,
    )


@_moe_apply_op.register_fake
def _moe_apply_fake(x, *args):
    return torch.empty_like(x)


_plans: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_next_handle = [0]


def register_plan(plan: Any) -> int:
    """Keep a weak reference to ``plan``; returns its handle for ``moe_plan_apply``."""
    _next_handle[0] += 1
    _plans[_next_handle[0]] = plan
    return _next_handle[0]


def lookup_plan(handle: int) -> Any:
    plan = _plans.get(handle)
    if plan is None:
        raise RuntimeError(f"MoE plan handle {handle} refers to a plan that no longer exists")
    return plan


@torch.library.custom_op("tokenspeed_kernel::moe_plan_apply", mutates_args=())
def _moe_plan_apply_op(
    handle: int, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    return lookup_plan(handle).apply(x, topk_weights, topk_ids)


@_moe_plan_apply_op.register_fake
def _moe_plan_apply_fake(handle, x, topk_weights, topk_ids):
    return torch.empty_like(x)
