"""Expert parallelism: ``moe_dispatch`` sends each token to the ranks that hold its experts,
``moe_combine`` brings the expert outputs back and sums them, over ``torch.distributed``.

Each rank of a process group holds some of the E global experts (its ``expert_map``: global
id -> local id, ``-1`` = held elsewhere; ``moe_apply`` takes the same map). One MoE layer on
every rank::

    d = moe_dispatch(x, topk_ids, topk_weights, group=group, expert_map=expert_map)
    y = moe_apply(d.x, w13, w2, d.topk_weights, d.topk_ids, expert_map=d.expert_map, activation=...)
    out = moe_combine(y, d.handle)  # [T, H]: what moe_apply with every expert would give x

The layout of ``d`` is :class:`~tokenspeed_kernel.ops.moe.args.MoEDispatched`'s: a token goes
to a rank once however many of its experts that rank holds, with its whole routing row, so
``moe_apply`` on the receiving rank computes the weighted sum over the experts it holds, and
the combine sums one row per rank. The kernels only call ``torch.distributed`` collectives
(:mod:`tokenspeed_kernel.reference.moe_ep`).

Each function is an :class:`~tokenspeed_kernel.ops._operator.Operator` (``DISPATCH``,
``COMBINE``) on the usual call path (call key -> plan cache -> checks -> ``run``), with one
addition: the calls are collective, so a rank's failed checks are not raised at once but
kept in the call's plan (the error without its traceback, so a remembered plan keeps no
tensor alive), and ``run`` starts with the collective verdict
(:mod:`tokenspeed_kernel.ops.moe._collective`): every rank raises when any rank's arguments
are wrong, or when the ranks disagree (sizes, dtype, expert maps that do not give each expert
to exactly one rank), and none waits in a collective for a rank that raised. That verdict
and the expert maps' exchange synchronize with the host on every call; the plan form
(:func:`~tokenspeed_kernel.ops.moe.ep_plan.moe_dispatch_plan`) makes them once and its steps
can be captured in a CUDA graph.

``torch.compile`` does not trace these calls (the operators have no custom op): call them
outside the compiled region.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import call_key, dtype_name
from tokenspeed_kernel.ops._dispatch import dispatch
from tokenspeed_kernel.ops._operator import Operator, Plan
from tokenspeed_kernel.ops.moe._collective import agree, comm_device, gather_owners
from tokenspeed_kernel.ops.moe._validate import (
    EPFacts,
    check_agreement,
    check_combine,
    check_dispatch,
    check_dispatch_agreement,
    check_group,
    check_handle,
    check_handle_state,
    check_ids_in_range,
    combine_request,
    dispatch_request,
)
from tokenspeed_kernel.ops.moe.args import (
    ExchangeBuffers,
    ExchangeRoute,
    MoECombineArgs,
    MoEDispatchArgs,
    MoEDispatched,
    MoEDispatchHandle,
)
from tokenspeed_kernel.registry import KernelSpec, Request

__all__ = [
    "COMBINE",
    "DISPATCH",
    "CombineCall",
    "DispatchCall",
    "extended_map",
    "launch_combine",
    "launch_dispatch",
    "moe_combine",
    "moe_dispatch",
]

_steps: dict[tuple[str, int], int] = {}  # (group name, size) -> moe_dispatch calls so far


def untraceable(what: str) -> RuntimeError:
    """The error of an expert-parallel call met while ``torch.compile`` traces."""
    return RuntimeError(
        f"{what} cannot be traced by torch.compile: it exchanges tokens across ranks with collective "
        "checks (host synchronizations) and returns a handle object. Call it outside the compiled "
        "region (e.g. a function wrapped in torch.compiler.disable), or capture a "
        "moe_dispatch_plan's steps in a CUDA graph"
    )


def debug_ids_error(topk_ids: torch.Tensor, num_experts: int) -> ValueError | None:
    """Under ``TOKENSPEED_KERNEL_DEBUG``: the error of ids outside ``[0, E)`` (a device sync)."""
    try:
        check_ids_in_range(topk_ids, None, num_experts, num_experts)
    except ValueError as exc:
        return exc
    return None


def extended_map(expert_map: torch.Tensor) -> torch.Tensor:
    """int32 ``[E + 1]``: ``expert_map`` with ``-1`` for the padding id ``E`` (``MoEDispatched``)."""
    return torch.cat([expert_map, expert_map.new_full((1,), -1)])


def launch_dispatch(
    spec: KernelSpec,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    rank: int,
    owner: torch.Tensor,
    capacity: int,
    outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    expert_map: torch.Tensor,
    step: int,
    plan: int = 0,
    buffers: ExchangeBuffers | None = None,
) -> MoEDispatched:
    """Run the dispatch kernel ``spec`` into ``outputs`` (``recv_x``, ``recv_topk_ids``,
    ``recv_topk_weights``, ``[W * C, ...]``) and wrap them with their handle. ``capacity`` 0
    (no rank has a token) moves nothing. ``expert_map`` is the extended map (:func:`extended_map`).
    ``buffers``: the plan's :class:`ExchangeBuffers` (None: fresh ones for this call, which
    keep only what the combine reuses)."""
    world = group.size()
    recv_x, recv_ids, recv_weights = outputs
    slots = torch.empty(world, x.shape[0], dtype=torch.int64, device=x.device).t()  # [T, W], column-major
    own = buffers if buffers is not None else ExchangeBuffers()
    args = MoEDispatchArgs(
        x, topk_ids, topk_weights, group, rank, world, owner, capacity, recv_x, recv_ids, recv_weights, slots, None, own
    )
    if capacity:
        spec.fn(args)
    if buffers is None:
        own.send = own.send_x = None  # spent; the combine reuses only the receive arena
    route = ExchangeRoute(world, rank, capacity, slots, args.counts, own)
    handle = MoEDispatchHandle(route, group, x.shape[0], x.shape[1], x.dtype, x.device, spec.name, step, plan)
    return MoEDispatched(recv_x, recv_weights, recv_ids, expert_map, handle)


def launch_combine(spec: KernelSpec, y: torch.Tensor, handle: MoEDispatchHandle) -> torch.Tensor:
    """Run the combine kernel ``spec`` for ``handle``'s dispatch; marks the handle combined."""
    out = y.new_empty(handle.num_tokens, handle.hidden)
    handle.combined = True
    if handle.num_rows:
        spec.fn(MoECombineArgs(y, handle.route, handle.group, out))
    return out


def _group_key(group: object) -> Hashable | None:
    """What the checks read of ``group`` (None: not a process group; the full checks raise)."""
    if type(group) is not dist.ProcessGroup:
        return None
    return (group.size(), group.rank(), group.name())


def _signature(facts: EPFacts, world: int, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "world_size": world,
        "num_tokens": facts.num_tokens,
        "hidden": facts.hidden,
        "top_k": facts.top_k,
        "num_experts": facts.num_experts,
        "dtype": dtype_name(dtype),
    }


@dataclass(slots=True, eq=False)
class DispatchCall(Plan):
    """What the checks of a ``moe_dispatch`` call derived on this rank (see
    :mod:`tokenspeed_kernel.ops._operator`).

    Attributes:
        error: this rank's failed check, raised by every rank in ``run`` (None: all passed).
        facts: what the checks read (zeros with an error), as the ranks compare them.
        device: the device of the collectives (x's).
        request: the selector request (None with an error).
        rank: this rank's index in the group. world_size: the group's size.
        signature: builds the capture signature (``TOKENSPEED_KERNEL_CAPTURE``) when asked.
    """

    error: Exception | None
    facts: EPFacts
    device: torch.device
    request: Request | None
    rank: int
    world_size: int
    signature: Callable[[], dict[str, Any]]

    @staticmethod
    def key(
        x: object, topk_ids: object, topk_weights: object, group: object, expert_map: object, override: object
    ) -> Hashable | None:
        group_key = _group_key(group)
        key = call_key((x, topk_ids, topk_weights, expert_map), (override,))
        return None if key is None or group_key is None else (key, group_key)

    @classmethod
    def check(cls, compiling: bool, *call: Any) -> DispatchCall:
        x, _, _, group, expert_map, _ = call
        rank, world = check_group(group)
        device = comm_device(group, x, expert_map)
        try:
            facts = check_dispatch(*call)
        except (TypeError, ValueError) as exc:
            return cls(exc.with_traceback(None), EPFacts(), device, None, rank, world, dict)
        request = dispatch_request(facts, world, x.dtype)
        return cls(None, facts, device, request, rank, world, functools.partial(_signature, facts, world, x.dtype))

    def run(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        group: dist.ProcessGroup,
        expert_map: torch.Tensor,
        override: str | None,
    ) -> MoEDispatched:
        error = self.error
        if error is None and config.debug():
            error = debug_ids_error(topk_ids, self.facts.num_experts)
        rows = agree(group, self.device, self.facts.values(), error, "moe_dispatch")
        check_dispatch_agreement("moe_dispatch", rows, plan=False)
        owner = gather_owners(group, expert_map, self.device)
        assert self.request is not None
        spec = dispatch(self.request, x.device, override, self.signature)
        capacity = max(row[0] for row in rows)  # every rank's token count fits a block
        rows_out, k = self.world_size * capacity, topk_ids.shape[1]
        outputs = (
            x.new_empty(rows_out, x.shape[1]),
            topk_ids.new_empty(rows_out, k),
            topk_weights.new_empty(rows_out, k),
        )
        name = (group.group_name, self.world_size)
        step = _steps[name] = _steps.get(name, 0) + 1
        return launch_dispatch(
            spec,
            x,
            topk_ids,
            topk_weights,
            group=group,
            rank=self.rank,
            owner=owner,
            capacity=capacity,
            outputs=outputs,
            expert_map=extended_map(expert_map),
            step=step,
        )

    def trace(self, *call: Any) -> MoEDispatched:
        raise untraceable("moe_dispatch")


DISPATCH = Operator(
    "moe.dispatch", MoEDispatchArgs, "torch_moe_dispatch", "moe_dispatch", DispatchCall, traceable=False
)


def moe_dispatch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    expert_map: torch.Tensor,
    override: str | None = None,
) -> MoEDispatched:
    """Send each token to the ranks of ``group`` that hold its experts (a collective: every rank
    of the group calls it, each with its own tokens).

    Args:
        x: ``[T, H]`` bf16/fp16/fp32, contiguous, on a device the group has a backend for
            (e.g. CUDA tensors for an NCCL group, CPU tensors for gloo). ``T`` may differ
            between ranks, and be 0.
        topk_ids: int32 ``[T, k]``, global expert ids in ``[0, E)`` (``moe_topk``'s).
        topk_weights: float32 ``[T, k]``.
        group: the ``torch.distributed.ProcessGroup`` of the expert-parallel ranks.
        expert_map: int32 ``[E]`` on x's device: this rank's experts, global id -> local id
            (the index into this rank's ``w13``/``w2``), ``-1`` for the experts other ranks
            hold. Across the group every expert is held by exactly one rank.
        override: force a dispatch kernel by name (e.g. ``"torch_moe_dispatch"``).

    Returns:
        A :class:`~tokenspeed_kernel.ops.moe.args.MoEDispatched`: ``W * C`` rows (``W`` ranks,
        ``C`` the largest ``T`` of any rank), block ``s`` the tokens rank ``s`` routed here in
        its order, then padding; each row's routing; this rank's map with the padding id; and
        the handle for :func:`moe_combine`.

    Every rank checks its arguments, then the ranks compare theirs: when a rank's are wrong,
    or the ranks disagree (``H``, ``k``, ``E``, dtype; maps that leave an expert to no rank or
    give it to two, e.g. maps made for another world size), every rank raises the error
    (``TypeError``/``ValueError`` naming the argument, and the rank), and no rank is left in a
    collective. This costs two small all-gathers and host synchronizations per call; with
    ``TOKENSPEED_KERNEL_DEBUG=1`` the ids are also checked to lie in ``[0, E)``. A bad
    ``group`` raises on its rank alone.
    """
    return DISPATCH.call(x, topk_ids, topk_weights, group, expert_map, override)


@dataclass(slots=True, eq=False)
class CombineCall(Plan):
    """What the checks of a ``moe_combine`` call derived on this rank.

    Attributes:
        error: this rank's failed check, raised by every rank in ``run`` (None: all passed).
        device: the device of the collectives (the dispatch's).
        request: the selector request (None with an error).
    """

    error: Exception | None
    device: torch.device
    request: Request | None

    @staticmethod
    def key(y: object, handle: object, override: object) -> Hashable | None:
        if type(handle) is not MoEDispatchHandle:
            return None
        group_key = _group_key(handle.group)
        key = call_key((y,), (override,))
        facts = (handle.num_rows, handle.hidden, handle.dtype, handle.device, handle.route.world_size)
        return None if key is None or group_key is None else (key, group_key, facts)

    @classmethod
    def check(cls, compiling: bool, y: object, handle: object, override: object) -> CombineCall:
        handle = check_handle(handle)  # raised on this rank alone: without a handle there is no group
        device = comm_device(handle.group, handle.route.slots)
        try:
            check_combine(y, handle, override)
        except (TypeError, ValueError) as exc:
            return cls(exc.with_traceback(None), device, None)
        return cls(None, device, combine_request(handle.route.world_size, handle.hidden, handle.dtype))

    def run(self, y: torch.Tensor, handle: MoEDispatchHandle, override: str | None) -> torch.Tensor:
        error = self.error
        if error is None:
            try:
                check_handle_state(handle)
            except ValueError as exc:
                error = exc
        rows = agree(handle.group, self.device, (handle.step, handle.num_rows), error, "moe_combine")
        check_agreement("moe_combine", rows, ((0, "the handle's dispatch step"), (1, "the dispatch's rows (W * C)")))
        assert self.request is not None
        spec = dispatch(self.request, handle.device, override, dict)
        return launch_combine(spec, y, handle)

    def trace(self, *call: Any) -> torch.Tensor:
        raise untraceable("moe_combine")


COMBINE = Operator("moe.combine", MoECombineArgs, "torch_moe_combine", "moe_combine", CombineCall, traceable=False)


def moe_combine(y: torch.Tensor, handle: MoEDispatchHandle, *, override: str | None = None) -> torch.Tensor:
    """Return each token's expert outputs to its rank and sum them (a collective: every rank
    calls it with its own dispatch's handle).

    Args:
        y: ``[W * C, H]`` in the dispatched dtype, contiguous, on x's device: one row per row
            the dispatch delivered (``moe_apply``'s output on them); padding rows are not read.
        handle: the ``MoEDispatched.handle`` of this rank's dispatch; each handle serves one
            combine.
        override: force a combine kernel by name (e.g. ``"torch_moe_combine"``).

    Returns:
        ``[T, H]`` in x's dtype, in this rank's token order: for each token the sum, in float32
        and in rank order, of the rows the ranks holding its experts computed for it (with
        ``moe_apply``'s weighted sums: ``sum_j topk_weights[t, j] * expert_j(x[t])``).

    A wrong ``y`` on any rank, or a handle combined already, makes every rank raise (as
    :func:`moe_dispatch`'s checks do; one small all-gather and a host synchronization per call);
    a ``handle`` that is not a dispatch's raises on its rank alone.
    """
    return COMBINE.call(y, handle, override)
