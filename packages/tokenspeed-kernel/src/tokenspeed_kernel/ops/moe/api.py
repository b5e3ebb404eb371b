"""Public MoE operators: ``moe_topk`` (router scoring + top-k) and ``moe_apply`` (experts + combine).

Each is an :class:`~tokenspeed_kernel.ops._operator.Operator` (``TOPK``, ``APPLY``) whose call
path validates every argument on the host (``TypeError``/``ValueError`` naming it, checks in
:mod:`._validate`) before any launch, remembers the call's plan (:class:`TopKCall`,
:class:`ApplyCall`: the selector request and what else the checks derived) per call key, and
runs it: selection, outputs, the typed arguments of :mod:`tokenspeed_kernel.ops.moe.args`, the
kernel. Under ``torch.compile`` the plan traces the ``torch.ops.tokenspeed_kernel.moe_*`` custom op
instead.

Capture signatures (``TOKENSPEED_KERNEL_CAPTURE``) use the field names of
``tokenspeed_kernel.tools.cases.moe.MoECase``: ``num_tokens``, ``num_experts`` (global, i.e.
the router's expert count), ``top_k``, ``dtype``, and for ``moe.apply`` also ``hidden``,
``intermediate``, ``num_local_experts``, ``weight_format``, ``activation``, ``bias``,
``expert_map`` (and ``activation_quant`` when set); for ``moe.topk`` ``scoring`` and ``renormalize``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import call_key, check_choice, dtype_name
from tokenspeed_kernel.ops._dispatch import dispatch
from tokenspeed_kernel.ops._operator import Operator, Plan
from tokenspeed_kernel.ops.moe import _custom_ops
from tokenspeed_kernel.ops.moe._validate import (
    SCORINGS,
    WeightInfo,
    apply_request,
    apply_signature,
    check_apply,
    check_ids_in_range,
    check_topk,
    topk_request,
)
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs, TopKArgs, Weight
from tokenspeed_kernel.registry import Request

__all__ = [
    "APPLY",
    "SCORINGS",
    "TOPK",
    "WEIGHT_FORMATS",
    "ApplyCall",
    "TopKCall",
    "moe_apply",
    "moe_apply_request",
    "moe_topk",
    "moe_topk_request",
]

# Weight format -> how its values are stored (None: in x's dtype).
WEIGHT_FORMATS: dict[str, torch.dtype | None] = {
    "plain": None,
    "mxfp4": torch.uint8,
    "fp8_per_tensor": torch.float8_e4m3fn,
    "fp8_per_channel": torch.float8_e4m3fn,
    "fp8_block": torch.float8_e4m3fn,
}


def moe_apply_request(
    *,
    x_dtype: torch.dtype,
    num_experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    weight_format: str = "plain",
    activation: str = "silu",
    bias: bool = False,
    expert_map: bool = False,
    activation_quant: str | None = None,
    num_tokens: int | None = None,
) -> Request:
    """The selector request of a ``moe_apply`` call (``num_tokens=None``: of a ``moe_plan``),
    built from plain shapes, so ``select``/``explain`` can say which kernel would serve a
    model's MoE before any weight exists. ``num_experts`` is the experts the weights hold
    (local experts with a map); ``weight_format`` one of :data:`WEIGHT_FORMATS`. It is
    exactly the request the public call builds for the same arguments."""
    check_choice("weight_format", weight_format, tuple(WEIGHT_FORMATS))
    storage = WEIGHT_FORMATS[weight_format] or x_dtype
    info = WeightInfo(num_experts, hidden, intermediate, weight_format, storage, num_experts)
    return apply_request(
        info,
        x_dtype=x_dtype,
        top_k=top_k,
        num_tokens=num_tokens,
        activation=activation,
        has_bias=bias,
        has_map=expert_map,
        activation_quant=activation_quant,
    )


def moe_topk_request(
    *, logits_dtype: torch.dtype, num_experts: int, top_k: int, scoring: str = "softmax", renormalize: bool = True
) -> Request:
    """The selector request of a ``moe_topk`` call, built from plain shapes (see
    :func:`moe_apply_request`)."""
    check_choice("scoring", scoring, SCORINGS)
    return topk_request(
        logits_dtype=logits_dtype, num_experts=num_experts, top_k=top_k, scoring=scoring, renormalize=renormalize
    )


@dataclass(slots=True, eq=False)
class TopKCall(Plan):
    """What the checks of a ``moe_topk`` call derived (see :mod:`tokenspeed_kernel.ops._operator`).

    Attributes:
        request: the selector request (None while tracing: the custom op selects when it runs).
        device: router_logits' device.
        shape: ``(T, top_k)``, the outputs' shape (``T = 0``: nothing is launched).
        signature: builds the capture signature (``TOKENSPEED_KERNEL_CAPTURE``) when asked.
    """

    request: Request | None
    device: torch.device
    shape: tuple[int, int]
    signature: Callable[[], dict[str, Any]]

    @staticmethod
    def key(
        router_logits: object, top_k: object, scoring: object, renormalize: object, override: object
    ) -> Hashable | None:
        return call_key((router_logits,), (top_k, scoring, renormalize, override))

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> TopKCall:
        check_topk(*call)
        router_logits, top_k, scoring, renormalize, _ = call
        num_tokens, num_experts = router_logits.shape
        request: Request | None = None
        signature: Callable[[], dict[str, Any]] = dict  # while tracing: none
        if not compiling:
            request = topk_request(
                logits_dtype=router_logits.dtype,
                num_experts=num_experts,
                top_k=top_k,
                scoring=scoring,
                renormalize=renormalize,
            )
            signature = functools.partial(
                dict,
                num_tokens=num_tokens,
                num_experts=num_experts,
                top_k=top_k,
                dtype=dtype_name(router_logits.dtype),
                scoring=scoring,
                renormalize=renormalize,
            )
        return cls(request, router_logits.device, (num_tokens, top_k), signature)

    def run(
        self, router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, override: str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.request is not None
        spec = dispatch(self.request, self.device, override, self.signature)
        args = TopKArgs(
            router_logits=router_logits,
            top_k=top_k,
            scoring=scoring,
            renormalize=renormalize,
            topk_weights=torch.empty(*self.shape, dtype=torch.float32, device=self.device),
            topk_ids=torch.empty(*self.shape, dtype=torch.int32, device=self.device),
        )
        if self.shape[0]:
            spec.fn(args)
        return args.topk_weights, args.topk_ids

    def trace(self, *call: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.tokenspeed_kernel.moe_topk(*call)


TOPK = Operator("moe.topk", TopKArgs, "torch_moe_topk", "moe_topk", TopKCall)


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    override: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score router logits and choose ``top_k`` experts per token.

    Args:
        router_logits: ``[T, E]`` bf16/fp16/fp32, contiguous.
        top_k: experts per token, ``1 <= top_k <= E``.
        scoring: ``"softmax"`` (softmax over all E experts, then top-k) or ``"sigmoid"``
            (independent sigmoid per expert, then top-k).
        renormalize: divide the chosen weights by their sum (each row then sums to 1).
        override: force a kernel by name (e.g. ``"torch_moe_topk"``).

    Returns:
        ``(topk_weights, topk_ids)``: float32 ``[T, top_k]`` and int32 ``[T, top_k]``, each
        row in descending weight order, ties broken towards the lower expert id. A padding
        row (a NaN or +inf logit, or every logit -inf) gets ids ``0..top_k-1`` and weight 0;
        renormalized weights summing to 0 stay 0 (docs/api.md). ``T = 0`` launches nothing.
    """
    return TOPK.call(router_logits, top_k, scoring, renormalize, override)


@dataclass(slots=True, eq=False)
class ApplyCall(Plan):
    """What the checks of a ``moe_apply`` call derived (see :mod:`tokenspeed_kernel.ops._operator`).

    Attributes:
        request: the selector request (None while tracing: the custom op selects when it runs).
        device: x's device.
        info: the weights' facts (sizes, format, local and global experts).
        num_tokens: ``T`` (0: nothing is launched).
        activation_quant: the validated ``activation_quant``.
        signature: builds the capture signature (``TOKENSPEED_KERNEL_CAPTURE``) when asked.
    """

    request: Request | None
    device: torch.device
    info: WeightInfo
    num_tokens: int
    activation_quant: str | None
    signature: Callable[[], dict[str, Any]]

    @staticmethod
    def key(
        x: object,
        w13: object,
        w2: object,
        topk_weights: object,
        topk_ids: object,
        activation: object,
        w13_bias: object,
        w2_bias: object,
        expert_map: object,
        out: torch.Tensor | None,
        override: object,
        activation_quant: object,
    ) -> Hashable | None:
        key = call_key(
            (x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, expert_map, out),
            (activation, override, activation_quant),
        )
        # ``out`` must not alias ``x``: a pointer, so checked on every call (the full checks raise).
        if key is None or out is None or out.data_ptr() != x.data_ptr():  # type: ignore[attr-defined]
            return key
        return None

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> ApplyCall:
        info, top_k, activation_quant = check_apply(*call)
        x, _, _, _, _, activation, w13_bias, w2_bias, expert_map = call[:9]
        has_bias, has_map = w13_bias is not None or w2_bias is not None, expert_map is not None
        num_tokens = x.shape[0]
        request: Request | None = None
        signature: Callable[[], dict[str, Any]] = dict  # while tracing: none
        if not compiling:
            request = apply_request(
                info,
                x_dtype=x.dtype,
                top_k=top_k,
                num_tokens=num_tokens,
                activation=activation,
                has_bias=has_bias,
                has_map=has_map,
                activation_quant=activation_quant,
            )
            signature = functools.partial(
                apply_signature, info, num_tokens, top_k, x.dtype, activation, has_bias, has_map, activation_quant
            )
        return cls(request, x.device, info, num_tokens, activation_quant, signature)

    def run(
        self,
        x: torch.Tensor,
        w13: Weight,
        w2: Weight,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: str,
        w13_bias: torch.Tensor | None,
        w2_bias: torch.Tensor | None,
        expert_map: torch.Tensor | None,
        out: torch.Tensor | None,
        override: str | None,
        activation_quant: str | None,
    ) -> torch.Tensor:
        if config.debug():
            check_ids_in_range(topk_ids, expert_map, self.info.num_experts, self.info.num_global_experts)
        assert self.request is not None
        spec = dispatch(self.request, self.device, override, self.signature)
        out = torch.empty_like(x) if out is None else out
        args = MoEApplyArgs(
            x,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation,
            w13_bias,
            w2_bias,
            expert_map,
            out,
            None,
            self.activation_quant,
        )
        if self.num_tokens:
            spec.fn(args)
        return out

    def trace(self, *call: Any) -> torch.Tensor:
        x, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, expert_map, out, override, quant = call
        a13, b13, fmt = _custom_ops.flatten_weight(w13)
        a2, b2, _ = _custom_ops.flatten_weight(w2)
        result = torch.ops.tokenspeed_kernel.moe_apply(
            x,
            a13,
            b13,
            a2,
            b2,
            fmt,
            topk_weights,
            topk_ids,
            activation,
            w13_bias,
            w2_bias,
            expert_map,
            override,
            quant,
        )
        return result if out is None else out.copy_(result)


APPLY = Operator("moe.apply", MoEApplyArgs, "torch_moe", "moe_apply", ApplyCall)


def moe_apply(
    x: torch.Tensor,
    w13: Weight,
    w2: Weight,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    override: str | None = None,
    activation_quant: str | None = None,
) -> torch.Tensor:
    """Run each token through its chosen experts and sum the weighted outputs.

    For token ``t`` and choice ``j``: ``e = topk_ids[t, j]`` (local id ``expert_map[e]`` with
    a map; ``-1`` contributes nothing), ``h = x[t] @ w13[e].T (+ w13_bias[e])``,
    ``gate, up = h[:I], h[I:]``, ``y = act(gate, up) @ w2[e].T (+ w2_bias[e])`` and
    ``out[t] = sum_j topk_weights[t, j] * y`` (see :class:`MoEApplyArgs` for activations).

    Args:
        x: ``[T, H]`` bf16/fp16/fp32, contiguous.
        w13: ``[E, 2I, H]`` (rows ``[0, I)`` gate, ``[I, 2I)`` up): a contiguous tensor in
            x's dtype, or an :class:`~tokenspeed_kernel.quant.MXFP4Weight` /
            :class:`~tokenspeed_kernel.quant.FP8Weight` of that logical shape.
        w2: ``[E, H, I]``, the same kind and format as ``w13``.
        topk_weights: float32 ``[T, k]``. topk_ids: int32 ``[T, k]`` (global expert ids).
        activation: ``"silu"``, ``"gelu"`` or ``"swiglu_oai"``.
        w13_bias: ``[E, 2I]``; w2_bias: ``[E, H]`` (x's dtype or float32), or None.
        expert_map: int32 ``[E_global]`` global -> local expert id, ``-1`` = not on this rank.
        out: ``[T, H]`` in x's dtype to write into (must not alias ``x``), or None.
        override: force a kernel by name (e.g. ``"torch_moe"``).
        activation_quant: None, or ``"mxfp8"`` (opt-in, MXFP4 weights only): each expert
            GEMM's A operand (``x`` for ``w13``; ``act(gate, up)`` ``[*, I]`` for ``w2``) is
            quantized on the fly to MXFP8, float8_e4m3fn with one E8M0 scale per 32
            consecutive values along K, by the rule of
            :func:`tokenspeed_kernel.quant.quantize_mxfp8` (shared exponent
            ``floor(log2(amax)) - 8``, round-to-nearest-even, saturate to ±448), and the GEMM
            multiplies those values (W4A8: what lets gfx950 run MXFP4 x MXFP8 on its scaled
            MFMA). Changes the numerics: relative error per value up to 2^-4 (6.25 %).
            Kernels serve it only if they declare the feature ``"mxfp8_act"``. Or ``"fp8"``
            (opt-in, FP8 weights only): the same A operands quantized per token on the fly to
            float8_e4m3fn with one power-of-two float32 scale per row (per row and 128-value
            K group when the weights are 128x128 block-scaled), by the rule of
            :func:`tokenspeed_kernel.quant.quantize_fp8_per_token`, so the GEMMs run
            fp8 x fp8 (W8A8). Relative error per value up to 2^-4; feature ``"fp8_act"``.

    Returns:
        ``[T, H]`` in x's dtype (``out`` when given).

    With ``TOKENSPEED_KERNEL_DEBUG=1`` also checks (with a device sync) that ``topk_ids``
    lie in ``[0, E_global)`` and ``expert_map`` values in ``[-1, E)``.
    """
    return APPLY.call(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation,
        w13_bias,
        w2_bias,
        expert_map,
        out,
        override,
        activation_quant,
    )
