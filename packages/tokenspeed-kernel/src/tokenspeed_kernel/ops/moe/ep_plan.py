"""``moe_dispatch_plan``: expert parallelism with capacity-bounded buffers, for CUDA graphs.

:func:`~tokenspeed_kernel.ops.moe.ep.moe_dispatch` checks collectively on every call (two
all-gathers and host synchronizations) and sizes its buffers by the largest token count of
the step. A plan does that work once: :func:`moe_dispatch_plan` (a collective: every rank
calls it) checks the group's arguments together, exchanges the expert maps once into an
owner table, selects the dispatch and combine kernels, and allocates the receive buffers for
a fixed capacity ``C = max_tokens`` per rank (``[W * C, H]``; every step delivers that many
rows, padding included). Its steps, :meth:`MoEDispatchPlan.dispatch` and
:meth:`MoEDispatchPlan.combine`, check only this rank's arguments on the host (once per call
key, like every operator) and run the kernels: with a graph-safe dispatch kernel
(``capturable=True`` asks for one: ``torch_moe_dispatch_padded`` today) a step never
synchronizes with the host, so an engine can capture ``dispatch -> moe_apply -> combine`` in
a CUDA graph and replay it.

The receive buffers belong to the plan: each dispatch overwrites the previous step's, so a
handle serves one combine, before the plan's next dispatch (an older or reused handle raises).
A step's checks are this rank's alone: a bad argument raises on its rank before any
collective, and the other ranks wait in the exchange until the group's timeout unless they
raise too (the same bug on every rank raises everywhere). With ``TOKENSPEED_KERNEL_DEBUG=1``
each step runs the collective verdict of :mod:`tokenspeed_kernel.ops.moe._collective` first
(and checks the ids), so every rank raises instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import call_key, check_tensor
from tokenspeed_kernel.ops._dispatch import capture_signature, check_capturable, record
from tokenspeed_kernel.ops._operator import Calls, Plan
from tokenspeed_kernel.ops.moe._collective import agree, comm_device, gather_owners, raise_copy
from tokenspeed_kernel.ops.moe._validate import (
    EPFacts,
    check_agreement,
    check_dispatch_agreement,
    check_dispatch_plan,
    check_group,
    check_handle,
    check_handle_state,
    check_plan_dispatch,
    combine_request,
    dispatch_request,
)
from tokenspeed_kernel.ops.moe.args import ExchangeBuffers, MoEDispatched, MoEDispatchHandle
from tokenspeed_kernel.ops.moe.ep import debug_ids_error, extended_map, launch_combine, launch_dispatch, untraceable
from tokenspeed_kernel.platform import platform_for
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import select

__all__ = ["MoEDispatchPlan", "moe_dispatch_plan"]

_plan_ids = itertools.count(1)


@dataclass(eq=False)
class MoEDispatchPlan:
    """The expert-parallel exchange of one process group, planned for ``max_tokens`` tokens per
    rank (see the module docstring). Made by :func:`moe_dispatch_plan`.

    Attributes:
        group: the ``torch.distributed.ProcessGroup``. rank: this rank's index in it.
            world_size: W.
        facts: the sizes every rank agreed on: ``num_tokens`` is the capacity C
            (``max_tokens``), then ``hidden`` H, ``top_k`` k, ``num_experts`` E.
        x_dtype: the activations' dtype. device: ``expert_map``'s device (x's every step).
        owner: int64 ``[E]``: the rank holding each global expert (from every rank's map).
        expert_map: int32 ``[E + 1]``: this rank's map with ``-1`` for the padding id E.
        dispatch_spec, combine_spec: the kernels, selected once; dispatch_request,
            combine_request: their requests.
        recv_x: ``[W * C, H]``, recv_topk_ids: int32 ``[W * C, k]``, recv_topk_weights: float32
            ``[W * C, k]``: the receive buffers every dispatch writes (``MoEDispatched``'s
            layout) and returns.
        buffers: the kernels' own buffers (:class:`~tokenspeed_kernel.ops.moe.args.ExchangeBuffers`:
            the padded dispatch's wire rows, the rows the combine receives back), allocated
            by the first step that needs them and reused by every later one.
        id: the plan's number (its handles carry it). step: dispatches so far.
    """

    group: dist.ProcessGroup
    rank: int
    world_size: int
    facts: EPFacts
    x_dtype: torch.dtype
    device: torch.device
    owner: torch.Tensor
    expert_map: torch.Tensor
    dispatch_spec: KernelSpec
    combine_spec: KernelSpec
    dispatch_request: Request
    combine_request: Request
    recv_x: torch.Tensor
    recv_topk_ids: torch.Tensor
    recv_topk_weights: torch.Tensor
    buffers: ExchangeBuffers = field(default_factory=ExchangeBuffers)
    id: int = field(default_factory=lambda: next(_plan_ids))
    step: int = 0

    @property
    def capacity(self) -> int:
        """C: the most tokens a rank may dispatch in one step (``max_tokens``)."""
        return self.facts.num_tokens

    @property
    def kernel(self) -> str:
        """The dispatch kernel's name."""
        return self.dispatch_spec.name

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> MoEDispatched:
        """``moe_dispatch`` into the plan's buffers (a collective step: every rank calls it).

        Args:
            x: ``[T, H]`` in ``x_dtype`` on the plan's device, ``0 <= T <= C``.
            topk_ids: int32 ``[T, k]`` (global ids). topk_weights: float32 ``[T, k]``.

        Returns:
            The plan's receive buffers (``[W * C, ...]``, overwritten by the next dispatch) as a
            :class:`~tokenspeed_kernel.ops.moe.args.MoEDispatched`, with this step's handle.
        """
        return _PLAN_DISPATCH.call(self, x, topk_ids, topk_weights)

    def combine(self, y: torch.Tensor, handle: MoEDispatchHandle) -> torch.Tensor:
        """``moe_combine`` of this plan's latest dispatch (a collective step).

        Args:
            y: ``[W * C, H]`` in ``x_dtype`` on the plan's device, contiguous.
            handle: the handle of the plan's latest dispatch, not combined yet.

        Returns:
            ``[T, H]`` in ``x_dtype``: each token's summed expert outputs, in this rank's order.
        """
        return _PLAN_COMBINE.call(self, y, handle)


def _debug_verdict(plan: MoEDispatchPlan, step: int, error: Exception | None, what: str) -> None:
    """Under ``TOKENSPEED_KERNEL_DEBUG``: the collective verdict of a step (every rank raises
    when one rank's arguments are wrong), then the ranks must be at the same step."""
    rows = agree(plan.group, plan.device, (step,), error, what)
    check_agreement(what, rows, ((0, "the plan's step"),))


@dataclass(slots=True, eq=False)
class PlanDispatchCall(Plan):
    """What the checks of one :meth:`MoEDispatchPlan.dispatch` derived: its call is the plan and
    the arguments (``(plan, x, topk_ids, topk_weights)``), its key the plan's id and the
    tensors', so every plan's steps share one table (:data:`_PLAN_DISPATCH`).

    Attributes:
        error: this rank's failed check (None: all passed); raised by ``run``, on every rank
            under ``TOKENSPEED_KERNEL_DEBUG``.
        num_tokens: T.
    """

    error: Exception | None
    num_tokens: int

    @staticmethod
    def key(plan: MoEDispatchPlan, x: object, topk_ids: object, topk_weights: object) -> Hashable | None:
        return call_key((plan.id, x, topk_ids, topk_weights))

    @classmethod
    def check(
        cls, compiling: bool, plan: MoEDispatchPlan, x: object, topk_ids: object, topk_weights: object
    ) -> PlanDispatchCall:
        try:
            num_tokens = check_plan_dispatch(
                x, topk_ids, topk_weights, facts=plan.facts, x_dtype=plan.x_dtype, device=plan.device
            )
        except (TypeError, ValueError) as exc:
            return cls(exc.with_traceback(None), 0)
        return cls(None, num_tokens)

    def run(
        self, plan: MoEDispatchPlan, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> MoEDispatched:
        error = self.error
        if config.debug():
            if error is None:
                error = debug_ids_error(topk_ids, plan.facts.num_experts)
            _debug_verdict(plan, plan.step + 1, error, "MoEDispatchPlan.dispatch")
        elif error is not None:
            raise_copy(error)
        spec = plan.dispatch_spec
        check_capturable(spec)
        record(spec, plan.dispatch_request)
        if config.capture_path() is not None:
            capture_signature("moe.dispatch", spec.name, {"world_size": plan.world_size, "num_tokens": self.num_tokens})
        plan.step += 1
        return launch_dispatch(
            spec,
            x,
            topk_ids,
            topk_weights,
            group=plan.group,
            rank=plan.rank,
            owner=plan.owner,
            capacity=plan.capacity,
            outputs=(plan.recv_x, plan.recv_topk_ids, plan.recv_topk_weights),
            expert_map=plan.expert_map,
            step=plan.step,
            plan=plan.id,
            buffers=plan.buffers,
        )

    def trace(self, *call: Any) -> MoEDispatched:
        raise untraceable("MoEDispatchPlan.dispatch")


@dataclass(slots=True, eq=False)
class PlanCombineCall(Plan):
    """What the checks of one :meth:`MoEDispatchPlan.combine` derived (its key: the plan's id
    and y's; the handle is checked on every call).

    Attributes:
        error: this rank's failed check of ``y`` (None: it passed).
    """

    error: Exception | None

    @staticmethod
    def key(plan: MoEDispatchPlan, y: object, handle: object) -> Hashable | None:
        return call_key((plan.id, y))

    @classmethod
    def check(cls, compiling: bool, plan: MoEDispatchPlan, y: object, handle: object) -> PlanCombineCall:
        shape = (plan.world_size * plan.capacity, plan.facts.hidden)
        try:
            y = check_tensor("y", y, ndim=2, dtypes=(plan.x_dtype,), shape=shape)
            if y.device != plan.device:
                raise ValueError(f"y is on {y.device} but the plan's buffers are on {plan.device}")
        except (TypeError, ValueError) as exc:
            return cls(exc.with_traceback(None))
        return cls(None)

    def run(self, plan: MoEDispatchPlan, y: torch.Tensor, handle: MoEDispatchHandle) -> torch.Tensor:
        error = self.error
        if error is None:
            try:
                check_handle_state(check_handle(handle), plan=plan.id, step=plan.step)
            except (TypeError, ValueError) as exc:
                error = exc
        if config.debug():
            _debug_verdict(plan, plan.step, error, "MoEDispatchPlan.combine")
        elif error is not None:
            raise_copy(error)
        spec = plan.combine_spec
        check_capturable(spec)
        record(spec, plan.combine_request)
        return launch_combine(spec, y, handle)

    def trace(self, *call: Any) -> torch.Tensor:
        raise untraceable("MoEDispatchPlan.combine")


# The plan caches of every MoEDispatchPlan's steps: (plan id, tensors) -> the step's plan.
_PLAN_DISPATCH = Calls(PlanDispatchCall)
_PLAN_COMBINE = Calls(PlanCombineCall)


def moe_dispatch_plan(
    group: dist.ProcessGroup,
    expert_map: torch.Tensor,
    *,
    max_tokens: int,
    hidden: int,
    top_k: int,
    x_dtype: torch.dtype,
    capturable: bool = False,
    override: str | None = None,
) -> MoEDispatchPlan:
    """Plan the expert-parallel exchange of ``group`` once (a collective: every rank calls it).

    Args:
        group: the ``torch.distributed.ProcessGroup`` of the expert-parallel ranks.
        expert_map: int32 ``[E]`` on the device of the activations (CUDA for NCCL, the CPU for
            gloo): this rank's experts, global id -> local id, ``-1`` for the experts other
            ranks hold (as for :func:`~tokenspeed_kernel.ops.moe.ep.moe_dispatch`).
        max_tokens: C, the most tokens any rank dispatches in one step (the same on every
            rank): each rank's receive buffers hold ``W * C`` rows.
        hidden: H. top_k: k. x_dtype: the activations' dtype (bf16/fp16/fp32).
        capturable: select only graph-safe kernels (no host synchronization), so the steps can
            be captured in a CUDA graph.
        override: force the dispatch kernel by name.

    Returns:
        A :class:`MoEDispatchPlan`; its ``dispatch``/``combine`` are the per-step calls.

    Every rank checks its arguments, then the ranks compare them (the capacity, H, k, E,
    dtype, and whether the maps give each expert to exactly one rank): every rank raises the
    error when any rank's are wrong. Allocates ``W * C * (H * itemsize + 8k)`` bytes of receive
    buffers on the map's device; the first step adds the kernels' own (``plan.buffers``): with
    the padded dispatch two sets of wire rows, about ``2 * W * C * (H * itemsize + 8k)`` bytes
    more (``ep_wire``), which the combine's returned rows share.
    """
    rank, world = check_group(group)
    device = comm_device(group, expert_map)
    error: Exception | None = None
    try:
        facts = check_dispatch_plan(
            group,
            expert_map,
            max_tokens=max_tokens,
            hidden=hidden,
            top_k=top_k,
            x_dtype=x_dtype,
            capturable=capturable,
            override=override,
        )
    except (TypeError, ValueError) as exc:
        error, facts = exc, EPFacts()
    rows = agree(group, device, facts.values(), error, "moe_dispatch_plan")
    check_dispatch_agreement("moe_dispatch_plan", rows, plan=True)
    owner = gather_owners(group, expert_map, device)
    request = dispatch_request(facts, world, x_dtype, capturable=capturable)
    ask_combine = combine_request(world, hidden, x_dtype, capturable=capturable)
    platform = platform_for(expert_map.device)
    rows_out = world * max_tokens
    return MoEDispatchPlan(
        group=group,
        rank=rank,
        world_size=world,
        facts=facts,
        x_dtype=x_dtype,
        device=expert_map.device,
        owner=owner,
        expert_map=extended_map(expert_map),
        dispatch_spec=select(request, platform, override),
        combine_spec=select(ask_combine, platform),
        dispatch_request=request,
        combine_request=ask_combine,
        recv_x=torch.zeros(rows_out, hidden, dtype=x_dtype, device=expert_map.device),
        recv_topk_ids=torch.zeros(rows_out, top_k, dtype=torch.int32, device=expert_map.device),
        recv_topk_weights=torch.zeros(rows_out, top_k, dtype=torch.float32, device=expert_map.device),
    )
