"""MoE test/check/bench cases: one description (:class:`MoECase`), its inputs, the call,
and the float64 ground truth. Shared by the test suite, ``check`` and ``bench``.

Expert counts: ``num_experts`` is the GLOBAL count (the router's columns). With
``expert_map=True`` this rank holds ``num_experts // 2`` of them (the weights' ``E``), the
others map to ``-1``; without a map the weights hold all ``num_experts``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel.ops.moe._validate import WeightInfo, apply_request, topk_request
from tokenspeed_kernel.ops.moe.args import (
    ACTIVATION_QUANT_WEIGHTS,
    ACTIVATION_QUANTS,
    ACTIVATIONS,
    MoEApplyArgs,
    TopKArgs,
)
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight, quantize_fp8, quantize_mxfp4
from tokenspeed_kernel.registry import Request

__all__ = [
    "OPS",
    "WEIGHT_FORMATS",
    "MoECase",
    "awkward_cases",
    "call",
    "gpt_oss_case",
    "make_inputs",
    "planned_call",
    "reference",
    "relayout",
    "request",
]

OPS = ("moe.topk", "moe.apply")
WEIGHT_FORMATS = ("plain", "mxfp4", "fp8_per_tensor", "fp8_per_channel", "fp8_block")
_FP8_GRANULARITY = {"fp8_per_tensor": "tensor", "fp8_per_channel": "channel", "fp8_block": "block"}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass(frozen=True)
class MoECase:
    """One MoE problem. ``hidden``/``intermediate`` are unused (0 is fine) for ``moe.topk``;
    ``weight_format``/``activation``/``bias``/``expert_map``/``activation_quant`` (None,
    ``"mxfp8"`` with MXFP4 weights or ``"fp8"`` with fp8 weights) apply to ``moe.apply`` and
    ``scoring``/``renormalize`` to ``moe.topk`` (and to how ``moe.apply`` routing is drawn).
    ``padding_rows``: the last rows are padding tokens as the API defines them (``moe.topk``:
    logits with a NaN, a ``+inf``, or all ``-inf``, in turn; ``moe.apply``: routing weights 0
    on experts ``0..k-1``)."""

    op: str
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    dtype: torch.dtype = torch.bfloat16
    weight_format: str = "plain"
    activation: str = "silu"
    bias: bool = False
    expert_map: bool = False
    scoring: str = "softmax"
    renormalize: bool = True
    name: str = ""
    activation_quant: str | None = None
    padding_rows: int = 0

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"MoECase.op must be one of {OPS}, got {self.op!r}")
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"MoECase.weight_format must be one of {WEIGHT_FORMATS}, got {self.weight_format!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoECase.activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if not 1 <= self.top_k <= self.num_experts or self.num_tokens < 0:
            raise ValueError(f"MoECase: need 1 <= top_k <= num_experts and num_tokens >= 0: {self}")
        if not 0 <= self.padding_rows <= self.num_tokens:
            raise ValueError(f"MoECase: need 0 <= padding_rows <= num_tokens: {self}")
        if self.op == "moe.apply":
            if self.hidden < 1 or self.intermediate < 1:
                raise ValueError("MoECase: moe.apply needs hidden >= 1 and intermediate >= 1")
            if self.expert_map and self.num_experts < 2:
                raise ValueError("MoECase: expert_map needs num_experts >= 2")
            if self.weight_format == "mxfp4" and (self.hidden % 32 or self.intermediate % 32):
                raise ValueError("MoECase: mxfp4 needs hidden and intermediate multiples of 32")
            if self.activation_quant is not None and (
                self.activation_quant not in ACTIVATION_QUANTS
                or self.weight_format not in ACTIVATION_QUANT_WEIGHTS[self.activation_quant]
            ):
                raise ValueError(
                    f"MoECase: activation_quant must be None, 'mxfp8' with mxfp4 weights or 'fp8' with fp8 weights: {self}"
                )
            if self.weight_format == "fp8_block" and self.hidden <= 128:
                # With every dim <= 128 a block scale is [.., 1, 1]: indistinguishable from per-tensor.
                raise ValueError("MoECase: fp8_block needs hidden > 128 (else it reads as per-tensor)")

    @property
    def num_local_experts(self) -> int:
        """Experts held by the weights: ``num_experts // 2`` with a map, else all."""
        return self.num_experts // 2 if self.expert_map else self.num_experts

    def describe(self) -> str:
        dt = _DTYPE_NAMES.get(self.dtype, str(self.dtype))
        prefix = f"{self.name}: " if self.name else ""
        pad = f" +pad{self.padding_rows}" if self.padding_rows else ""
        if self.op == "moe.topk":
            renorm = " renorm" if self.renormalize else ""
            return (
                f"{prefix}moe.topk T={self.num_tokens} E={self.num_experts} k={self.top_k} {dt} {self.scoring}{renorm}"
                f"{pad}"
            )
        experts = f"E={self.num_experts}" + (f"(local {self.num_local_experts})" if self.expert_map else "")
        extras = "".join(
            (
                " +bias" if self.bias else "",
                " +map" if self.expert_map else "",
                f" +{self.activation_quant}_act" if self.activation_quant else "",
                pad,
            )
        )
        return (
            f"{prefix}moe.apply T={self.num_tokens} H={self.hidden} I={self.intermediate} {experts} "
            f"k={self.top_k} {dt} {self.weight_format} {self.activation}{extras}"
        )

    def flops(self) -> float:
        """Useful floating-point operations. ``moe.apply``: ``2*T*k*(H*2I + I*H)`` scaled by the
        fraction of experts that are local (with a map, the expected share of routed pairs);
        ``moe.topk``: about ``4*T*E`` (scoring plus selection)."""
        if self.op == "moe.topk":
            return 4.0 * self.num_tokens * self.num_experts
        local = self.num_local_experts / self.num_experts
        per_pair = 2.0 * (self.hidden * 2 * self.intermediate + self.intermediate * self.hidden)
        return self.num_tokens * self.top_k * per_pair * local

    def expected_experts_hit(self) -> float:
        """Expected number of distinct LOCAL experts hit under uniform random routing:
        ``E_local * (1 - (1 - k/E)^T)``."""
        miss = (1.0 - self.top_k / self.num_experts) ** self.num_tokens
        return self.num_local_experts * (1.0 - miss)

    def _expert_bytes(self) -> float:
        h, i = self.hidden, self.intermediate
        elems = 3 * h * i  # w13 [2I, H] + w2 [H, I]
        if self.weight_format == "plain":
            return elems * _itemsize(self.dtype)
        if self.weight_format == "mxfp4":
            return elems / 2 + elems / 32
        scales = {
            "fp8_per_tensor": 2,
            "fp8_per_channel": 2 * i + h,
            "fp8_block": math.ceil(2 * i / 128) * math.ceil(h / 128) + math.ceil(h / 128) * math.ceil(i / 128),
        }[self.weight_format]
        return elems + 4 * scales

    def bytes_moved(self) -> float:
        """Minimum bytes read and written. ``moe.apply``: the weights (in their storage format,
        scales included) and biases of the EXPECTED number of distinct local experts hit
        (:meth:`expected_experts_hit`, not the generated ids, so it needs no inputs), plus
        ``x``, ``out``, ``topk_weights``/``topk_ids`` and the map. ``moe.topk``: logits in,
        weights and ids out."""
        t, k, e = self.num_tokens, self.top_k, self.num_experts
        act = _itemsize(self.dtype)
        routing = t * k * 8
        if self.op == "moe.topk":
            return t * e * act + routing
        per_expert = self._expert_bytes()
        if self.bias:
            per_expert += 2 * self.intermediate * 4 + self.hidden * act  # w13_bias fp32, w2_bias x dtype
        io = 2 * t * self.hidden * act + routing + (4 * e if self.expert_map else 0)
        return self.expected_experts_hit() * per_expert + io


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _routing(case: MoECase, gen: torch.Generator, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    logits = 2.0 * torch.randn(case.num_tokens, case.num_experts, generator=gen, device=device)
    scores = torch.softmax(logits, dim=-1) if case.scoring == "softmax" else torch.sigmoid(logits)
    weights, ids = torch.topk(scores, case.top_k, dim=-1)
    if case.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float().contiguous(), ids.to(torch.int32).contiguous()


def _expert_map(case: MoECase, ids: torch.Tensor, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Half the global experts local (random), the rest -1. Token 0's first choice is made
    local and, with ``top_k > 1``, its second choice remote, so both paths are exercised."""
    e, n_local = case.num_experts, case.num_local_experts
    perm = torch.randperm(e, generator=gen, device=device).tolist()
    must_in = [int(ids[0, 0])] if ids.numel() else []
    must_out = {int(ids[0, 1])} if ids.numel() and case.top_k > 1 else set()
    others = [g for g in perm if g not in must_in and g not in must_out]
    local = (must_in + others)[:n_local]
    mapping = torch.full((e,), -1, dtype=torch.int32)
    mapping[torch.tensor(local, dtype=torch.long)] = torch.arange(n_local, dtype=torch.int32)
    return mapping.to(device)


def _quantize(master: torch.Tensor, case: MoECase) -> Any:
    if case.weight_format == "plain":
        return master.to(case.dtype)
    if case.weight_format == "mxfp4":
        return quantize_mxfp4(master)
    return quantize_fp8(master, _FP8_GRANULARITY[case.weight_format])


def _weight(case: MoECase, rows: int, cols: int, gen: torch.Generator, device: torch.device) -> Any:
    """``[E_local, rows, cols] ~ N(0, 1/cols)`` in the case's format, drawn and quantized one
    expert at a time (bounded memory at GPT-OSS sizes)."""
    parts = [
        _quantize(torch.randn(rows, cols, generator=gen, device=device) / math.sqrt(cols), case)
        for _ in range(case.num_local_experts)
    ]
    if case.weight_format == "plain":
        return torch.stack(parts)
    if case.weight_format == "mxfp4":
        return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scales for p in parts]))
    return FP8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]))


_STORAGE = {
    "mxfp4": torch.uint8,
    "fp8_per_tensor": torch.float8_e4m3fn,
    "fp8_per_channel": torch.float8_e4m3fn,
    "fp8_block": torch.float8_e4m3fn,
}


def request(case: MoECase) -> Request:
    """The selector request the public operator builds for this case (no tensors needed)."""
    if case.op == "moe.topk":
        return topk_request(
            logits_dtype=case.dtype,
            num_experts=case.num_experts,
            top_k=case.top_k,
            scoring=case.scoring,
            renormalize=case.renormalize,
        )
    info = WeightInfo(
        num_experts=case.num_local_experts,
        hidden=case.hidden,
        intermediate=case.intermediate,
        weight_format=case.weight_format,
        storage_dtype=_STORAGE.get(case.weight_format, case.dtype),
        num_global_experts=case.num_experts,
    )
    return apply_request(
        info,
        x_dtype=case.dtype,
        top_k=case.top_k,
        num_tokens=case.num_tokens,
        activation=case.activation,
        has_bias=case.bias,
        has_map=case.expert_map,
        activation_quant=case.activation_quant,
    )


# The padding rows of a ``moe.topk`` case, in turn (the API's three kinds): (columns, value)
# written into the row: a NaN logit, every logit -inf, a +inf logit.
_PADDING_LOGITS = ((0, float("nan")), (slice(None), float("-inf")), (-1, float("inf")))


def make_inputs(case: MoECase, device: torch.device | str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Keyword arguments for the public function of ``case.op`` (without ``override``).

    Drawn on ``device`` from a generator seeded with ``seed`` (deterministic for a given
    seed and device type; CPU and GPU draws differ): ``x ~ N(0, 1)``; weights
    ``w13 ~ N(0, 1/H)``, ``w2 ~ N(0, 1/I)`` (activations stay O(1)), quantized from float32
    one expert at a time for quantized formats; ``w13_bias`` float32 and ``w2_bias`` in x's
    dtype, ``~ N(0, 0.25)``; routing from random logits (``2 * N(0, 1)``) through
    softmax/sigmoid top-k like ``moe_topk``; see :func:`_expert_map` for the map.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    t, e, k = case.num_tokens, case.num_experts, case.top_k
    if case.op == "moe.topk":
        logits = (2.0 * torch.randn(t, e, generator=gen, device=device)).to(case.dtype)
        for i, row in enumerate(range(t - case.padding_rows, t)):
            columns, value = _PADDING_LOGITS[i % len(_PADDING_LOGITS)]
            logits[row, columns] = value
        return {"router_logits": logits, "top_k": k, "scoring": case.scoring, "renormalize": case.renormalize}
    h, i, n = case.hidden, case.intermediate, case.num_local_experts
    x = torch.randn(t, h, generator=gen, device=device).to(case.dtype)
    w13 = _weight(case, 2 * i, h, gen, device)
    w2 = _weight(case, h, i, gen, device)
    topk_weights, topk_ids = _routing(case, gen, device)
    if case.padding_rows:  # what moe_topk returns for a padding token
        topk_weights[t - case.padding_rows :] = 0.0
        topk_ids[t - case.padding_rows :] = torch.arange(k, dtype=torch.int32, device=device)
    inputs: dict[str, Any] = {
        "x": x,
        "w13": w13,
        "w2": w2,
        "topk_weights": topk_weights,
        "topk_ids": topk_ids,
        "activation": case.activation,
        "w13_bias": None,
        "w2_bias": None,
        "expert_map": None,
    }
    if case.bias:
        inputs["w13_bias"] = 0.5 * torch.randn(n, 2 * i, generator=gen, device=device)
        inputs["w2_bias"] = (0.5 * torch.randn(n, h, generator=gen, device=device)).to(case.dtype)
    if case.expert_map:
        inputs["expert_map"] = _expert_map(case, topk_ids, gen, device)
    if case.activation_quant is not None:
        inputs["activation_quant"] = case.activation_quant
    return inputs


def relayout(case: MoECase, inputs: dict[str, Any]) -> None:
    """MoE calls take no batch-layout tensors: nothing to renew (see ``attention.relayout``)."""
    return None


def call(case: MoECase, inputs: dict[str, Any], override: str | None = None, out: torch.Tensor | None = None) -> Any:
    """Run the public operator: ``moe_topk`` → ``(weights, ids)``, ``moe_apply`` → ``out``
    (written into ``out`` when given; ``moe_topk`` takes no ``out``)."""
    from tokenspeed_kernel.ops.moe import moe_apply, moe_topk

    if case.op == "moe.topk":
        return moe_topk(**inputs, override=override)
    return moe_apply(**inputs, out=out, override=override)


def planned_call(case: MoECase, inputs: dict[str, Any], override: str | None = None) -> Callable[[], Any]:
    """``moe_apply`` as an engine runs it every step: the weights planned once here
    (``moe_plan``: validation, selection and the kernel's ``prepare`` hook), then
    ``plan.apply`` per call. ``moe_topk`` has no plan: the public call."""
    from tokenspeed_kernel.ops.moe import moe_plan

    if case.op == "moe.topk":
        return functools.partial(call, case, inputs, override)
    plan = moe_plan(
        inputs["w13"],
        inputs["w2"],
        x_dtype=inputs["x"].dtype,
        top_k=inputs["topk_ids"].shape[1],
        activation=inputs["activation"],
        w13_bias=inputs["w13_bias"],
        w2_bias=inputs["w2_bias"],
        expert_map=inputs["expert_map"],
        override=override,
        activation_quant=inputs.get("activation_quant"),
    )
    return functools.partial(plan.apply, inputs["x"], inputs["topk_weights"], inputs["topk_ids"])


def _dense64(w: Any) -> torch.Tensor:
    if isinstance(w, (MXFP4Weight, FP8Weight)):
        return w.dequantize(torch.float64)  # exact: every stored value and scale fits float64
    return w.to(torch.float64)


def reference(case: MoECase, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 ground truth from the reference kernels run on float64 copies of the inputs.

    ``moe.topk`` → ``(weights float64 [T, k], ids int32 [T, k])``; ``moe.apply`` →
    ``(out float64 [T, H], None)``. Quantized weights are dequantized exactly to float64.
    """
    from tokenspeed_kernel.ops._operator import operator

    ground_truth = operator(case.op).reference_kernel().fn
    if case.op == "moe.topk":
        logits = inputs["router_logits"].to(torch.float64)
        t, k = logits.shape[0], inputs["top_k"]
        topk = TopKArgs(
            router_logits=logits,
            top_k=k,
            scoring=inputs["scoring"],
            renormalize=inputs["renormalize"],
            topk_weights=logits.new_empty((t, k)),
            topk_ids=torch.empty((t, k), dtype=torch.int32, device=logits.device),
        )
        ground_truth(topk)
        return topk.topk_weights, topk.topk_ids
    x = inputs["x"].to(torch.float64)
    bias13, bias2 = inputs.get("w13_bias"), inputs.get("w2_bias")
    args = MoEApplyArgs(
        x=x,
        w13=_dense64(inputs["w13"]),
        w2=_dense64(inputs["w2"]),
        topk_weights=inputs["topk_weights"],
        topk_ids=inputs["topk_ids"],
        activation=inputs.get("activation", "silu"),
        w13_bias=None if bias13 is None else bias13.to(torch.float64),
        w2_bias=None if bias2 is None else bias2.to(torch.float64),
        expert_map=inputs.get("expert_map"),
        out=torch.empty_like(x),
        activation_quant=inputs.get("activation_quant"),
    )
    ground_truth(args)
    return args.out, None


def awkward_cases(op: str, dtype: torch.dtype = torch.bfloat16) -> list[MoECase]:
    """Tiny awkward cases (CPU / interpreter sized) covering every option of ``op``.

    ``moe.topk``: T in {1, 5, 33} x softmax/sigmoid x renormalize on/off (E=8, top-2), plus
    E=128 top-4, top_k = E and E=1. ``moe.apply``: E=8 top-2 H=64 I=32 with T in {1, 5, 33},
    every activation, biases, expert map, every weight format (fp8_block at H=256), a
    GPT-OSS-like combination (T = 33 and T = 5), MXFP4 at odd sizes and top-3 (T = 7), top-1,
    top_k = E, and non-power-of-two sizes.
    """
    if op == "moe.topk":
        cases = [
            MoECase(op, t, 0, 0, 8, 2, dtype, scoring=s, renormalize=r, name=f"topk_{s}{'_renorm' if r else ''}_t{t}")
            for t in (1, 5, 33)
            for s in ("softmax", "sigmoid")
            for r in (True, False)
        ]
        return [
            *cases,
            MoECase(op, 7, 0, 0, 128, 4, dtype, name="topk_e128_k4"),
            MoECase(op, 6, 0, 0, 5, 5, dtype, renormalize=False, name="topk_k_eq_e"),
            MoECase(op, 3, 0, 0, 1, 1, dtype, scoring="sigmoid", name="topk_single_expert"),
        ]
    if op != "moe.apply":
        raise ValueError(f"awkward_cases: op must be one of {OPS}, got {op!r}")

    def c(name: str, t: int = 5, **kw: Any) -> MoECase:
        base: dict[str, Any] = {"hidden": 64, "intermediate": 32, "num_experts": 8, "top_k": 2}
        base.update(kw)
        return MoECase(op, t, dtype=dtype, name=name, **base)

    return [
        c("plain_t1", 1),
        c("plain_t5", 5),
        c("plain_t33", 33),
        c("gelu", activation="gelu"),
        c("swiglu_oai", activation="swiglu_oai"),
        c("bias", bias=True),
        c("expert_map", expert_map=True),
        c("expert_map_t33", 33, expert_map=True),
        c("mxfp4_t1", 1, weight_format="mxfp4"),
        c("mxfp4_t33", 33, weight_format="mxfp4"),
        c("fp8_per_tensor", weight_format="fp8_per_tensor"),
        c("fp8_per_channel", weight_format="fp8_per_channel"),
        c("fp8_block", hidden=256, weight_format="fp8_block"),
        c("gpt_oss_like", 33, weight_format="mxfp4", activation="swiglu_oai", bias=True, expert_map=True),
        # MXFP4 at decode sizes (T <= 8: the GEMV kernels' range) with every option.
        c("gpt_oss_like_t5", 5, weight_format="mxfp4", activation="swiglu_oai", bias=True, expert_map=True),
        c(
            "mxfp4_odd_t7",
            7,
            hidden=96,
            intermediate=64,
            num_experts=6,
            top_k=3,
            weight_format="mxfp4",
            activation="gelu",
            bias=True,
        ),
        c("mxfp8_act_t1", 1, weight_format="mxfp4", activation="swiglu_oai", bias=True, activation_quant="mxfp8"),
        c("mxfp8_act_t33", 33, weight_format="mxfp4", activation="swiglu_oai", bias=True, activation_quant="mxfp8"),
        c(
            "fp8_act_channel_t1",
            1,
            weight_format="fp8_per_channel",
            activation="swiglu_oai",
            bias=True,
            activation_quant="fp8",
        ),
        c("fp8_act_tensor_t33", 33, weight_format="fp8_per_tensor", expert_map=True, activation_quant="fp8"),
        c("fp8_act_block_t5", 5, hidden=256, weight_format="fp8_block", bias=True, activation_quant="fp8"),
        c("fp8_gelu_bias_t1", 1, weight_format="fp8_per_channel", activation="gelu", bias=True),
        c("top1", top_k=1),
        c("topk_eq_e", 3, num_experts=4, top_k=4, activation="swiglu_oai"),
        c("odd_sizes", 7, hidden=96, intermediate=48, num_experts=6, top_k=3, bias=True),
    ]


def gpt_oss_case(num_tokens: int, op: str = "moe.apply", dtype: torch.dtype = torch.bfloat16) -> MoECase:
    """The GPT-OSS-120B MoE layer at ``num_tokens``: 128 experts top-4, H = I = 2880, MXFP4
    weights, biases, swiglu_oai (softmax routing, renormalized)."""
    return MoECase(
        op,
        num_tokens,
        2880,
        2880,
        128,
        4,
        dtype,
        weight_format="mxfp4" if op == "moe.apply" else "plain",
        activation="swiglu_oai",
        bias=op == "moe.apply",
        name=f"gpt_oss_120b_t{num_tokens}",
    )
