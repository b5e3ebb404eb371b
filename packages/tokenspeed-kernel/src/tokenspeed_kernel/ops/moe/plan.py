"""``moe_plan``: select MoE kernels once for fixed weights and let them repack them.

An engine loads its expert weights once and calls ``moe_apply`` with them every step. A
plan moves everything that depends only on the weights out of the hot path: validation of
the weights, kernel selection, and each selected kernel's one-time weight preparation.

**Token-count regimes.** The best kernel depends on the number of tokens (a GEMV kernel for a
decode step of a few tokens, a grouped GEMM for prefill), which a plan does not know. So
:func:`moe_plan` selects once per token bucket ``1, 2, 4, ..., PLAN_MAX_TOKENS`` (the request
``moe_apply`` would build for that many tokens), merges neighbouring buckets that chose the
same kernel into :class:`MoERegime` ranges and prepares each distinct kernel once.
:meth:`MoEPlan.apply` picks the regime by ``x.shape[0]`` (a scan of a tuple of one to three
entries; no selection on the hot path); beyond ``PLAN_MAX_TOKENS`` the last regime serves.
A bucket no kernel serves falls back to the selection without a token count. With
``override`` there is one regime: the named kernel for every token count.

The ``prepare`` hook (``KernelSpec.prepare``, given to ``@register_kernel(prepare=...)``)::

    def prepare(*, w13, w2, w13_bias, w2_bias, expert_map) -> Any

is called once by :func:`moe_plan` with the validated public weights (tensors or
:class:`~tokenspeed_kernel.quant.MXFP4Weight`/:class:`~tokenspeed_kernel.quant.FP8Weight`,
biases and map exactly as given to ``moe_apply``). It returns an opaque object (repacked or
transposed weights, swizzled scales, ...) that the plan keeps and hands to the kernel as
``MoEApplyArgs.prepared`` on every :meth:`MoEPlan.apply`. ``args.w13``/``args.w2`` etc. still
carry the public weights. The kernel must also work with ``prepared=None`` (the functional
``moe_apply`` path). ``prepare`` must not modify its inputs; it may allocate on their device.

**Bound runs.** A kernel may also register a ``bind`` hook (``@register_kernel(bind=...)``)::

    def bind(args: MoEApplyArgs) -> Callable[[MoEApplyArgs], None] | None

:meth:`MoEPlan.apply` calls it on the first eager call with a given token count (never while
a stream is capturing: captured calls run ``fn``), with that call's arguments. The runner it
returns serves every later call of the plan with that count in place of ``fn``: it holds what
depends only on the plan and the count (tile choice, grids, workspaces, compiled launches),
so a call only launches. x, topk_weights, topk_ids and out vary between calls (same shapes,
dtypes and device, all contiguous: the plan's checks guarantee it); the plan's weights,
biases, map and ``prepared`` do not. ``bind`` returns None to leave a count to ``fn`` (for
example one whose workspaces would be too large to keep). A runner's workspaces are shared
by the plan's calls with that count, which the stream orders: calls of one plan must not run
concurrently on different streams. A plan keeps at most :data:`BIND_MAX_COUNTS` runners.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import call_key
from tokenspeed_kernel.ops._dispatch import capture_signature, check_capturable, is_capturing, record
from tokenspeed_kernel.ops._operator import Calls, Plan
from tokenspeed_kernel.ops.moe import _custom_ops
from tokenspeed_kernel.ops.moe._validate import (
    WeightInfo,
    apply_request,
    apply_signature,
    check_ids_in_range,
    check_plan,
    check_plan_apply,
)
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs, Weight
from tokenspeed_kernel.platform import Platform, platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import NoKernelFoundError, select

__all__ = ["BIND_MAX_COUNTS", "PLAN_MAX_TOKENS", "MoEPlan", "MoERegime", "moe_plan"]

PLAN_MAX_TOKENS = 1 << 16  # the largest token bucket a plan selects for
BIND_MAX_COUNTS = 64  # token counts a plan keeps bound runners for (later counts run ``fn``)
Runner = Callable[[MoEApplyArgs], None]


@dataclass(frozen=True, eq=False)
class MoERegime:
    """The kernel a plan runs for ``x.shape[0] <= max_tokens`` (None: any count).

    Attributes:
        max_tokens: the largest token count of the range (a power of two), or None for the
            last regime (every larger count).
        spec: the selected :class:`~tokenspeed_kernel.registry.KernelSpec`.
        request: the request of the range's largest bucket (``num_tokens_bucket`` =
            ``max_tokens``, or :data:`PLAN_MAX_TOKENS` for the last regime).
        prepared: what ``spec.prepare`` made of the weights (None without a hook).
    """

    max_tokens: int | None
    spec: KernelSpec
    request: Request
    prepared: Any = None


@dataclass(frozen=True, eq=False)
class MoEPlan:
    """Kernels chosen for fixed expert weights, with what their ``prepare`` hooks made of them.

    Attributes:
        request: the selection request without ``num_tokens_bucket``.
        x_dtype: the activation dtype every ``apply`` call must use.
        top_k: experts per token every ``apply`` call must use.
        activation: ``"silu"``, ``"gelu"`` or ``"swiglu_oai"``.
        w13: ``[E, 2I, H]`` public weight (tensor or quantized container).
        w2: ``[E, H, I]`` public weight, same format.
        w13_bias: ``[E, 2I]`` or None. w2_bias: ``[E, H]`` or None.
        expert_map: int32 ``[E_global]`` or None.
        info: sizes and weight format read from the weights.
        device: the weights' device (``x`` must be there too).
        regimes: the token-count ranges and their kernels, ``max_tokens`` ascending, the last
            one unbounded (see the module docstring); one regime with an override.
        activation_quant: None, ``"mxfp8"`` or ``"fp8"`` (see :func:`~tokenspeed_kernel.moe_apply`).
        handle: the plan's id for the ``moe_plan_apply`` custom op (torch.compile path).

    ``kernel``, ``spec`` and ``prepared`` are the last (largest-T) regime's.
    """

    request: Request
    x_dtype: torch.dtype
    top_k: int
    activation: str
    w13: Weight
    w2: Weight
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    expert_map: torch.Tensor | None
    info: WeightInfo
    device: torch.device
    regimes: tuple[MoERegime, ...]
    activation_quant: str | None = None
    handle: int = field(default=0, compare=False)
    # Token count -> the bound runner (None: ``fn`` serves that count); see "Bound runs".
    runners: dict[int, Runner | None] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kernel(self) -> str:
        """The name of the kernel of the last regime (the largest token counts)."""
        return self.regimes[-1].spec.name

    @property
    def spec(self) -> KernelSpec:
        """The :class:`~tokenspeed_kernel.registry.KernelSpec` of the last regime."""
        return self.regimes[-1].spec

    @property
    def prepared(self) -> Any:
        """What the last regime's ``prepare`` hook made of the weights (None without a hook)."""
        return self.regimes[-1].prepared

    def regime_for(self, num_tokens: int) -> MoERegime:
        """The regime that serves ``num_tokens`` tokens (the last one is unbounded)."""
        return self.regimes[self._regime_index(num_tokens)]

    def _regime_index(self, num_tokens: int) -> int:
        return next(i for i, r in enumerate(self.regimes) if r.max_tokens is None or num_tokens <= r.max_tokens)

    def kernel_for(self, num_tokens: int) -> str:
        """The name of the kernel :meth:`apply` runs for ``num_tokens`` tokens."""
        return self.regime_for(num_tokens).spec.name

    def apply(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``moe_apply`` with the plan's weights and kernel; validates only x, routing and out.

        Args:
            x: ``[T, H]`` in ``x_dtype`` on the plan's device.
            topk_weights: float32 ``[T, top_k]``. topk_ids: int32 ``[T, top_k]``.
            out: ``[T, H]`` in x's dtype, or None.

        Returns:
            ``[T, H]`` in x's dtype (``out`` when given).
        """
        return _PLAN_APPLY.call(self, x, topk_weights, topk_ids, out)

    def _bind(self, spec: KernelSpec, args: MoEApplyArgs) -> Runner | None:
        """The runner for ``args``' token count from ``spec.bind`` (None: ``fn`` serves it),
        remembered (a None too); nothing is bound without a hook, while the stream is capturing
        or once the plan holds :data:`BIND_MAX_COUNTS` counts."""
        if spec.bind is None or is_capturing() or len(self.runners) >= BIND_MAX_COUNTS:
            return None
        run = self.runners[args.x.shape[0]] = spec.bind(args)
        return run


@dataclass(slots=True, eq=False)
class PlanApplyCall(Plan):
    """What the checks of one :meth:`MoEPlan.apply` call derived: its call is the plan and the
    arguments of ``apply`` (``(plan, x, topk_weights, topk_ids, out)``), its key the plan's
    handle and the activations', so a plan's calls share one table (:data:`_PLAN_APPLY`).

    Attributes:
        regime: the index of the regime that serves the call's token count in the plan's
            ``regimes`` (an index: the table keeps nothing of a plan alive).
        num_tokens: ``T`` (0: nothing is launched).
        signature: builds the capture signature (``TOKENSPEED_KERNEL_CAPTURE``) when asked.
    """

    regime: int
    num_tokens: int
    signature: Callable[[], dict[str, Any]]

    @staticmethod
    def key(plan: MoEPlan, x: torch.Tensor, topk_weights: object, topk_ids: object, out: object) -> Hashable | None:
        key = call_key((plan.handle, x, topk_weights, topk_ids, out))
        # ``out`` must not alias ``x``: a pointer, so checked on every call (the full checks raise).
        if key is None or out is None or out.data_ptr() != x.data_ptr():  # type: ignore[attr-defined]
            return key
        return None

    @classmethod
    def check(
        cls, compiling: bool, plan: MoEPlan, x: object, topk_weights: object, topk_ids: object, out: object
    ) -> PlanApplyCall:
        info = plan.info
        num_tokens = check_plan_apply(
            x, topk_weights, topk_ids, out, info=info, top_k=plan.top_k, x_dtype=plan.x_dtype, device=plan.device
        )
        regime = -1  # while tracing, the custom op runs the plan by its handle
        signature: Callable[[], dict[str, Any]] = dict
        if not compiling:
            regime = plan._regime_index(num_tokens)
            has_bias = plan.w13_bias is not None or plan.w2_bias is not None
            signature = functools.partial(
                apply_signature,
                info,
                num_tokens,
                plan.top_k,
                plan.x_dtype,
                plan.activation,
                has_bias,
                plan.expert_map is not None,
                plan.activation_quant,
            )
        return cls(regime, num_tokens, signature)

    def run(
        self,
        plan: MoEPlan,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        regime = plan.regimes[self.regime]
        if config.debug():
            check_ids_in_range(topk_ids, plan.expert_map, plan.info.num_experts, plan.info.num_global_experts)
        if config.capture_path() is not None:
            capture_signature("moe.apply", regime.spec.name, self.signature())
        out = torch.empty_like(x) if out is None else out
        args = MoEApplyArgs(
            x,
            plan.w13,
            plan.w2,
            topk_weights,
            topk_ids,
            plan.activation,
            plan.w13_bias,
            plan.w2_bias,
            plan.expert_map,
            out,
            regime.prepared,
            plan.activation_quant,
        )
        check_capturable(regime.spec)
        record(regime.spec, regime.request)
        num_tokens = self.num_tokens
        if num_tokens:
            runners = plan.runners
            run = runners[num_tokens] if num_tokens in runners else plan._bind(regime.spec, args)
            (run or regime.spec.fn)(args)
        return out

    def trace(
        self,
        plan: MoEPlan,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        result = torch.ops.tokenspeed_kernel.moe_plan_apply(plan.handle, x, topk_weights, topk_ids)
        return result if out is None else out.copy_(result)


# The plan cache of every MoEPlan.apply: (plan handle, activations) -> PlanApplyCall.
_PLAN_APPLY = Calls(PlanApplyCall)


def moe_plan(
    w13: Weight,
    w2: Weight,
    *,
    x_dtype: torch.dtype,
    top_k: int,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    override: str | None = None,
    activation_quant: str | None = None,
) -> MoEPlan:
    """Validate fixed expert weights, select the kernel once and run its ``prepare`` hook.

    Arguments mean what they mean for :func:`~tokenspeed_kernel.moe_apply`; ``x_dtype`` and
    ``top_k`` fix the activation dtype and experts per token of every later
    :meth:`MoEPlan.apply`, ``activation_quant`` its activation quantization (``"mxfp8"``
    needs MXFP4 weights). Kernel restrictions on ``num_tokens_bucket`` are not consulted.
    """
    info, activation_quant = check_plan(
        w13,
        w2,
        x_dtype=x_dtype,
        top_k=top_k,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        expert_map=expert_map,
        override=override,
        activation_quant=activation_quant,
    )
    device = _custom_ops.flatten_weight(w13)[0].device
    has_bias = w13_bias is not None or w2_bias is not None

    def request_for(num_tokens: int | None) -> Request:
        return apply_request(
            info,
            x_dtype=x_dtype,
            top_k=top_k,
            num_tokens=num_tokens,
            activation=activation,
            has_bias=has_bias,
            has_map=expert_map is not None,
            activation_quant=activation_quant,
        )

    request = request_for(None)
    # Selection without capture: each MoEPlan.apply records its own signature (with T).
    platform = platform_for(device)
    spec = select(request, platform, override)
    hooks: dict[str, Any] = {}

    def prepare(chosen: KernelSpec) -> Any:
        if chosen.prepare is None:
            return None
        if chosen.name not in hooks:
            hooks[chosen.name] = chosen.prepare(
                w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias, expert_map=expert_map
            )
        return hooks[chosen.name]

    chosen = _regimes(request_for, spec, platform) if override is None else (MoERegime(None, spec, request),)
    regimes = tuple(MoERegime(r.max_tokens, r.spec, r.request, prepare(r.spec)) for r in chosen)
    plan = MoEPlan(
        request=request,
        x_dtype=x_dtype,
        top_k=top_k,
        activation=activation,
        w13=w13,
        w2=w2,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        expert_map=expert_map,
        info=info,
        device=device,
        regimes=regimes,
        activation_quant=activation_quant,
    )
    object.__setattr__(plan, "handle", _custom_ops.register_plan(plan))
    return plan


def _regimes(
    request_for: Callable[[int | None], Request], fallback: KernelSpec, platform: Platform
) -> tuple[MoERegime, ...]:
    """One selection per token bucket up to :data:`PLAN_MAX_TOKENS`, neighbours with the same
    kernel merged; a bucket no kernel serves gets ``fallback``. Not yet prepared."""
    chosen: list[MoERegime] = []
    bucket = 1
    while bucket <= PLAN_MAX_TOKENS:
        bucket_request = request_for(bucket)
        try:
            spec = select(bucket_request, platform)
        except NoKernelFoundError:
            spec = fallback
        if chosen and chosen[-1].spec.name == spec.name:
            chosen[-1] = MoERegime(bucket, spec, bucket_request)
        else:
            chosen.append(MoERegime(bucket, spec, bucket_request))
        bucket *= 2
    chosen[-1] = MoERegime(None, chosen[-1].spec, chosen[-1].request)
    return tuple(chosen)
