"""What both tokenspeed MoE methods share: activation and routing mapping, the plan, apply.

vLLM's MoE runner calls a method in one of two ways:

- modular (``is_monolithic`` False): vLLM's router picks the experts, then
  ``apply(layer, x, topk_weights, topk_ids, ...)``; this plugin asks the router for int32
  ids (``topk_indices_dtype``) and serves the experts with ``MoEPlan.apply``;
- monolithic (``is_monolithic`` True): ``apply_monolithic(layer, x, router_logits)``; the
  routing is ``moe_topk`` (softmax or sigmoid top-k, renormalized or not), then
  ``MoEPlan.apply``.

The methods are monolithic exactly when the layer's routing is one ``moe_topk`` serves
(no grouped top-k, correction bias, custom or hash routing, no LoRA); otherwise vLLM's router
keeps the routing and only the experts run here.

The weights stay vLLM's parameters (``w13 [E, 2I, H]``, ``w2 [E, H, I]``, MXFP4 as packed
bytes plus E8M0 scales along H/I). The one change made to them, once after loading, in
place: GPT-OSS checkpoints interleave gate and up rows in ``w13`` (``swigluoai``);
tokenspeed-kernel wants the gate rows first, so those rows (and their scales and biases) are
de-interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel import MoEPlan, moe_plan, moe_topk

# vLLM's MoEActivation value -> (tokenspeed-kernel activation, w13 rows interleaved).
ACTIVATIONS: dict[str, tuple[str, bool]] = {
    "silu": ("silu", False),
    "gelu": ("gelu", False),
    "swigluoai": ("swiglu_oai", True),
    "swigluoai_uninterleave": ("swiglu_oai", False),
}

# tokenspeed-kernel's swiglu_oai constants (GPT-OSS): alpha, clamp limit, the +1 on up.
_SWIGLU_OAI = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "swiglu_beta": 1.0}

# vLLM's RoutingMethodType name -> (moe_topk scoring, renormalize).
ROUTINGS: dict[str, tuple[str, bool]] = {
    "Default": ("softmax", False),
    "Renormalize": ("softmax", True),
    "RenormalizeNaive": ("softmax", True),
    "Sigmoid": ("sigmoid", False),
    "SigmoidRenorm": ("sigmoid", True),
}


@dataclass(frozen=True)
class Routing:
    """How ``apply_monolithic`` routes: ``moe_topk(logits, top_k, scoring, renormalize)``,
    weights then scaled by ``scale`` (vLLM's ``routed_scaling_factor``)."""

    top_k: int
    scoring: str
    renormalize: bool
    scale: float


def activation_for(layer: Any) -> tuple[str, bool]:
    """The tokenspeed-kernel activation of ``layer`` and whether its w13 rows interleave
    gate/up; ``ValueError`` naming what is not served."""
    name = getattr(layer.activation, "value", layer.activation)
    if name not in ACTIVATIONS:
        raise ValueError(f"tokenspeed MoE: activation {name!r} is not served (served: {', '.join(ACTIVATIONS)})")
    activation, interleaved = ACTIVATIONS[name]
    if activation == "swiglu_oai":
        for attr, want in _SWIGLU_OAI.items():
            got = getattr(layer, attr, None)
            if got is not None and float(got) != want:
                raise ValueError(f"tokenspeed MoE: swiglu_oai is served with {attr}={want}, the layer has {got}")
    if getattr(layer, "apply_router_weight_on_input", False):
        raise ValueError("tokenspeed MoE: apply_router_weight_on_input is not served")
    return activation, interleaved


def routing_for(layer: Any) -> Routing | None:
    """The monolithic routing of ``layer``, or None when vLLM's router must keep it."""
    moe = layer.moe_config
    kind = getattr(moe.routing_method, "name", str(moe.routing_method))
    if (
        kind not in ROUTINGS
        or moe.is_lora_enabled
        or moe.has_hash_routing
        or moe.require_decomposed_backend
        or getattr(layer, "use_grouped_topk", False)
        or getattr(layer, "custom_routing_function", None) is not None
        or getattr(layer, "e_score_correction_bias", None) is not None
        or getattr(layer, "scoring_func", "softmax") not in ("softmax", "sigmoid")
        or moe.moe_parallel_config.enable_eplb
    ):
        return None
    scoring, renormalize = ROUTINGS[kind]
    if scoring != layer.scoring_func or renormalize != bool(layer.renormalize):
        return None
    return Routing(layer.top_k, scoring, renormalize, float(getattr(layer, "routed_scaling_factor", 1.0) or 1.0))


def deinterleave_rows_(*tensors: torch.Tensor | None) -> None:
    """Reorder dim 1 of each ``[E, 2I, ...]`` tensor from gate/up interleaved (rows 0, 2, 4, …
    gate) to gate rows first, in place (the parameters keep their storage)."""
    for t in tensors:
        if t is None:
            continue
        rows = t.shape[1]
        order = torch.cat((torch.arange(0, rows, 2), torch.arange(1, rows, 2))).to(t.device)
        t.data.copy_(t.data.index_select(1, order))


class TokenspeedMoEMixin:
    """apply / apply_monolithic over a :class:`~tokenspeed_kernel.MoEPlan` built once after
    the weights are loaded (:meth:`_make_plan`)."""

    _plan: MoEPlan | None = None
    _routing: Routing | None = None

    @property
    def is_monolithic(self) -> bool:
        return self._routing is not None

    @property
    def topk_indices_dtype(self) -> torch.dtype | None:
        return torch.int32

    @property
    def supports_eplb(self) -> bool:
        return False

    def _make_plan(self, layer: Any, w13: Any, w2: Any, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None):
        activation, _ = activation_for(layer)
        self._routing = routing_for(layer)
        self._plan = moe_plan(
            w13,
            w2,
            x_dtype=layer.moe_config.in_dtype,
            top_k=layer.top_k,
            activation=activation,
            w13_bias=w13_bias,
            w2_bias=w2_bias,
            expert_map=layer.expert_map,
        )

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("tokenspeed MoE: apply before process_weights_after_loading (no plan yet)")
        if topk_weights.dtype != torch.float32:
            topk_weights = topk_weights.to(torch.float32)
        if topk_ids.dtype != torch.int32:
            topk_ids = topk_ids.to(torch.int32)
        x = x if x.is_contiguous() else x.contiguous()
        return self._plan.apply(x, topk_weights, topk_ids)

    def apply(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM routed; ``x [T, H]``, ``topk_weights/ids [T, top_k]`` -> ``[T, H]``. Shared
        experts (if any) are run by vLLM's runner, not here."""
        return self._experts(x, topk_weights, topk_ids)

    def apply_monolithic(
        self,
        layer: Any,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``moe_topk`` on ``router_logits [T, E]``, then the experts -> ``[T, H]``."""
        routing = self._routing
        assert routing is not None
        logits = router_logits if router_logits.is_contiguous() else router_logits.contiguous()
        weights, ids = moe_topk(logits, routing.top_k, scoring=routing.scoring, renormalize=routing.renormalize)
        if routing.scale != 1.0:
            weights = weights * routing.scale
        sink = getattr(layer, "routing_sink", None)
        if sink is not None:  # vLLM's routed-experts capture (monolithic kernels report ids)
            captured = sink.buffer[: ids.shape[0]]
            captured.copy_(ids)
            sink.capture_fn(captured)
        return self._experts(x, weights, ids)
