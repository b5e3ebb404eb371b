"""What each rank of the expert-parallel tests runs (``tests/tokenspeed_kernel/ops/moe/test_ep.py``).

:func:`run` is called on every rank of a gloo process group by
``tokenspeed_kernel_dev.ranks.run_ranks``. It builds the same problem on every rank from a
seed (every rank's tokens and routing, the full expert weights), takes its own slice, runs
the scenarios of :data:`SCENARIOS` in order and returns the names of those it finished; a
failed assertion raises (the parent reports the traceback). Every scenario's numbers are
compared with :func:`support.naive_moe.naive_moe`, the independent float64 MoE run in this
one process over the rank's tokens with every expert: what expert parallelism must reproduce.

Bad-input scenarios check that every rank raises (:func:`every_rank_raises`) and that the
group still works afterwards (the next scenario exchanges again).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from support.naive_moe import naive_moe
from tokenspeed_kernel import config, last_kernel, moe_apply, moe_combine, moe_dispatch, moe_dispatch_plan
from tokenspeed_kernel.ops.moe import ep_wire
from tokenspeed_kernel.ops.moe.args import MoECombineArgs
from tokenspeed_kernel.registry import Priority, register_kernel, unregister_kernel

__all__ = ["SCENARIOS", "Problem", "run"]

H, INTER, K = 16, 8, 3
KERNELS = ("torch_moe_dispatch", "torch_moe_dispatch_padded")
TOL = {"atol": 2e-5, "rtol": 2e-5}


@dataclass
class Problem:
    """One rank's view of an expert-parallel MoE layer: its tokens and routing, its expert map
    and local weights (its experts, at the local ids of its map, plus an unused local slot
    filled with NaN that no call may read), and the full weights for the reference."""

    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_map: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    w13_full: torch.Tensor
    w2_full: torch.Tensor

    def want(self, x: torch.Tensor | None = None) -> torch.Tensor:
        """The float64 MoE of this rank's tokens over every expert."""
        x = self.x if x is None else x
        return naive_moe(x, self.w13_full, self.w2_full, self.topk_weights, self.topk_ids, activation="silu")


def owners_interleaved(num_experts: int, world: int) -> list[int]:
    """Expert e on rank (3e + 1) mod W: no rank holds a contiguous range."""
    return [(3 * e + 1) % world for e in range(num_experts)]


def owners_last_empty(num_experts: int, world: int) -> list[int]:
    """The last rank holds no expert (it receives nothing); the others share E in turn."""
    return [e % (world - 1) for e in range(num_experts)]


def owners_for_world(num_experts: int, world: int) -> list[int]:
    """Contiguous ranges of E / world experts: the usual split, for ``world`` ranks."""
    per = -(-num_experts // world)
    return [e // per for e in range(num_experts)]


def expert_map(owners: list[int], rank: int) -> torch.Tensor:
    """This rank's map: its experts at local ids in descending global order, leaving local id
    0 unused (a hole: the NaN slot of :class:`Problem`)."""
    mine = [e for e, r in enumerate(owners) if r == rank]
    table = [-1] * len(owners)
    for local, e in enumerate(reversed(mine), start=1):
        table[e] = local
    return torch.tensor(table, dtype=torch.int32)


def make_problem(
    rank: int,
    world: int,
    seed: int,
    tokens: list[int],
    owners: list[int],
    *,
    skew: Callable[[int], list[int]] | None = None,
) -> Problem:
    """Every rank draws every rank's tokens (``tokens[r]`` of them) from ``seed`` and keeps its
    own. ``skew(r)``, when given, lists the experts rank r's tokens choose from (uneven routing)."""
    num_experts = len(owners)
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, H, generator=g) * 0.3
    w2 = torch.randn(num_experts, H, INTER, generator=g) * 0.3
    mine = None
    for r, t in enumerate(tokens):
        x = torch.randn(t, H, generator=g)
        pool = skew(r) if skew is not None else list(range(num_experts))
        choice = torch.stack([torch.randperm(len(pool), generator=g)[:K] for _ in range(t)]) if t else None
        ids = torch.tensor(pool)[choice].int() if choice is not None else torch.zeros(0, K, dtype=torch.int32)
        weights = torch.rand(t, K, generator=g) + 0.05
        if r == rank:
            mine = (x, ids.contiguous(), weights)
    assert mine is not None
    table = expert_map(owners, rank)
    slots = int(table.max()) + 1
    w13_local = torch.full((max(slots, 1), 2 * INTER, H), float("nan"))
    w2_local = torch.full((max(slots, 1), H, INTER), float("nan"))
    for e, local in enumerate(table.tolist()):
        if local >= 0:
            w13_local[local], w2_local[local] = w13[e], w2[e]
    return Problem(*mine, table, w13_local, w2_local, w13, w2)


def layer(p: Problem, dispatched, combine: Callable[[torch.Tensor, object], torch.Tensor]) -> torch.Tensor:
    """The expert computation on what was delivered, then the way back."""
    y = moe_apply(
        dispatched.x,
        p.w13,
        p.w2,
        dispatched.topk_weights,
        dispatched.topk_ids,
        expert_map=dispatched.expert_map,
        override="torch_moe",
    )
    return combine(y, dispatched.handle)


def functional(p: Problem, kernel: str | None = None) -> tuple[torch.Tensor, object]:
    d = moe_dispatch(p.x, p.topk_ids, p.topk_weights, group=dist.group.WORLD, expert_map=p.expert_map, override=kernel)
    return layer(p, d, moe_combine), d


def every_rank_raises(kind: type[Exception], pattern: str, call: Callable[[], object]) -> str:
    """``call()`` must raise ``kind`` with a message matching ``pattern`` (on this rank; every
    rank runs the same assertion, so every rank raised); returns the message."""
    try:
        call()
    except kind as exc:
        message = str(exc)
        assert re.search(pattern, message), f"{kind.__name__} {message!r} does not match {pattern!r}"
        return message
    raise AssertionError(f"expected {kind.__name__} matching {pattern!r}, nothing was raised")


def _set_debug(on: bool) -> None:
    if on:
        os.environ[config.DEBUG_ENV] = "1"
    else:
        os.environ.pop(config.DEBUG_ENV, None)
    config.refresh()


# --- scenarios ----------------------------------------------------------------------------


def numerics_both_kernels(rank: int, world: int) -> None:
    """Uneven token counts (a rank with none), interleaved ownership with holes in the local
    ids: both kernels equal the float64 MoE, deliver identical rows, and agree exactly."""
    tokens = [5, 0, 3, 7][:world] if world > 2 else [5, 0]
    for owners, seed in ((owners_interleaved(8, world), 1), (owners_last_empty(9, world), 2)):
        p = make_problem(rank, world, seed, tokens, owners)
        results = {kernel: functional(p, kernel) for kernel in KERNELS}
        for out, _ in results.values():
            torch.testing.assert_close(out.double(), p.want(), **TOL)
        (ref_out, ref), (pad_out, pad) = results.values()
        assert ref.handle.route.counts is not None and pad.handle.route.counts is None
        torch.testing.assert_close(ref.topk_ids, pad.topk_ids, rtol=0, atol=0)
        torch.testing.assert_close(ref.topk_weights, pad.topk_weights, rtol=0, atol=0)
        torch.testing.assert_close(ref.handle.route.slots, pad.handle.route.slots, rtol=0, atol=0)
        valid = ref.topk_ids[:, 0] < len(owners)
        torch.testing.assert_close(ref.x[valid], pad.x[valid], rtol=0, atol=0)
        torch.testing.assert_close(ref_out, pad_out, rtol=0, atol=0)
        assert ref.x.shape == (world * max(tokens), H) and ref.expert_map.tolist()[-1] == -1
        if owners == owners_last_empty(len(owners), world) and rank == world - 1:
            assert bool((ref.topk_ids == len(owners)).all()), "the rank holding no expert received rows"


def uneven_routing_and_order(rank: int, world: int) -> None:
    """Every token chooses among rank 0's experts only (rank 0 receives everything, the
    others nothing); with identity experts the combine returns x times the weight sums, in
    each rank's token order."""
    owners = owners_for_world(8, world)
    held_by_0 = [e for e, r in enumerate(owners) if r == 0]
    p = make_problem(rank, world, 3, [4, 6, 1, 5][:world], owners, skew=lambda r: held_by_0 * 2)
    for kernel in KERNELS:
        d = moe_dispatch(
            p.x, p.topk_ids, p.topk_weights, group=dist.group.WORLD, expert_map=p.expert_map, override=kernel
        )
        held = d.expert_map[d.topk_ids.long()] >= 0
        if rank != 0:
            assert not bool(held.any()), "a rank holding none of the chosen experts received rows"
        y = d.x * (d.topk_weights * held).sum(1, keepdim=True)  # identity experts
        out = moe_combine(y, d.handle)
        torch.testing.assert_close(out, p.x * p.topk_weights.sum(1, keepdim=True), **TOL)


def plan_steps(rank: int, world: int) -> None:
    """A plan per kernel (capturable selects the padded one): steps of varying T up to the
    capacity, T = 0 included, each equal to the float64 MoE; stale and reused handles raise."""
    _plan_steps(rank, world, "torch_moe_dispatch", override="torch_moe_dispatch")
    _plan_steps(rank, world, "torch_moe_dispatch_padded", capturable=True)


def _plan_steps(rank: int, world: int, kernel: str, **options: object) -> None:
    owners = owners_interleaved(8, world)
    cap = 6
    base = make_problem(rank, world, 4, [cap] * world, owners)
    plan = moe_dispatch_plan(
        dist.group.WORLD, base.expert_map, max_tokens=cap, hidden=H, top_k=K, x_dtype=torch.float32, **options
    )
    assert plan.kernel == kernel, (plan.kernel, kernel)
    arenas = set()
    for step, tokens in enumerate(([cap] * world, [0, 2, 6, 1][:world], [3] * world)):
        p = make_problem(rank, world, 10 + step, tokens, owners)
        d = plan.dispatch(p.x, p.topk_ids, p.topk_weights)
        assert d.x.data_ptr() == plan.recv_x.data_ptr() and d.x.shape == (world * cap, H)
        out = layer(p, d, plan.combine)
        torch.testing.assert_close(out.double(), p.want(), **TOL)
        arenas.add(tuple(t.data_ptr() for t in (plan.buffers.send, plan.buffers.recv) if t is not None))
    assert len(arenas) == 1, "a plan's steps must reuse its buffers (CUDA-graph replays write the same memory)"
    assert (plan.buffers.send is not None) == (kernel != "torch_moe_dispatch"), "only the padded kernels keep wire rows"
    # A handle serves one combine, before the plan's next dispatch (every rank does the same).
    first = plan.dispatch(base.x, base.topk_ids, base.topk_weights)
    second = plan.dispatch(base.x, base.topk_ids, base.topk_weights)
    y = torch.zeros(world * cap, H)
    every_rank_raises(ValueError, r"dispatched step \d+ since", lambda: plan.combine(y, first.handle))
    plan.combine(y, second.handle)
    every_rank_raises(ValueError, "combined already", lambda: plan.combine(y, second.handle))
    too_many = make_problem(rank, world, 9, [cap + 1] * world, owners)
    every_rank_raises(
        ValueError,
        "more than the plan's max_tokens",
        lambda: plan.dispatch(too_many.x, too_many.topk_ids, too_many.topk_weights),
    )


def bad_inputs_every_rank_raises(rank: int, world: int) -> None:
    """Wrong arguments on one rank, disagreeing ranks, maps that do not cover E or cover it
    twice, handles combined twice: every rank raises, naming the argument (and the rank)."""
    owners = owners_interleaved(8, world)
    p = make_problem(rank, world, 5, [3] * world, owners)
    group = dist.group.WORLD
    last = world - 1

    def dispatch_with(bad: int, **change: torch.Tensor) -> object:
        """``moe_dispatch`` with ``change`` applied on rank ``bad`` only."""
        args = dict(x=p.x, topk_ids=p.topk_ids, topk_weights=p.topk_weights, expert_map=p.expert_map)
        if rank == bad:
            args.update(change)
        return moe_dispatch(
            args["x"], args["topk_ids"], args["topk_weights"], group=group, expert_map=args["expert_map"]
        )

    message = every_rank_raises(
        TypeError, r"topk_ids must have dtype in \{int32\}", lambda: dispatch_with(last, topk_ids=p.topk_ids.long())
    )
    if rank != last:
        assert f"failed on rank {last} of the group's {world}" in message, message
    every_rank_raises(ValueError, r"topk_ids must have shape \[T, k\] with T = 2", lambda: dispatch_with(0, x=p.x[:-1]))
    every_rank_raises(
        ValueError,
        r"hidden size H .* must be the same on every rank of the group, got rank 0: 17",
        lambda: dispatch_with(0, x=torch.zeros(3, H + 1)),
    )
    longer = torch.cat([p.expert_map, p.expert_map.new_full((1,), -1)])
    every_rank_raises(
        ValueError, r"global experts E .* must be the same", lambda: dispatch_with(last, expert_map=longer)
    )
    orphan = p.expert_map.clone()
    orphan[0] = -1  # expert 0: now held by no rank
    every_rank_raises(
        ValueError, r"experts \[0\] \(1\) are held by no rank", lambda: dispatch_with(rank, expert_map=orphan)
    )
    # Maps made for another world size: experts held twice (made for fewer ranks) or by no
    # rank (made for more).
    other = 2 if world > 2 else 4
    wrong = expert_map(owners_for_world(8, other), rank % other)
    every_rank_raises(ValueError, "maps made for another world size", lambda: dispatch_with(rank, expert_map=wrong))
    every_rank_raises(
        TypeError,
        "group must be a torch.distributed.ProcessGroup",
        lambda: moe_dispatch(p.x, p.topk_ids, p.topk_weights, group=None, expert_map=p.expert_map),
    )
    # A handle combined twice, on one rank only (the others combine a fresh one): all raise,
    # and the fresh handles stay usable.
    out_a, a = functional(p)
    torch.testing.assert_close(out_a.double(), p.want(), **TOL)
    b = moe_dispatch(p.x, p.topk_ids, p.topk_weights, group=group, expert_map=p.expert_map)
    y = torch.zeros(b.x.shape)
    stale = a if rank == last else b
    every_rank_raises(ValueError, "combined already", lambda: moe_combine(y, stale.handle))
    assert not b.handle.combined
    every_rank_raises(ValueError, r"y must have shape", lambda: moe_combine(y[:-1] if rank == 0 else y, b.handle))
    moe_combine(y, b.handle)  # the group is still in step
    every_rank_raises(
        ValueError,
        r"max_tokens .* must be the same on every rank",
        lambda: moe_dispatch_plan(
            group, p.expert_map, max_tokens=4 + (rank == 0), hidden=H, top_k=K, x_dtype=torch.float32
        ),
    )


def debug_plan_one_rank(rank: int, world: int) -> None:
    """Under TOKENSPEED_KERNEL_DEBUG=1 a plan's steps check collectively: one rank's bad step
    (too many tokens, ids out of range, a stale handle) makes every rank raise."""
    owners = owners_interleaved(8, world)
    p = make_problem(rank, world, 6, [3] * world, owners)
    plan = moe_dispatch_plan(dist.group.WORLD, p.expert_map, max_tokens=3, hidden=H, top_k=K, x_dtype=torch.float32)
    _set_debug(True)
    try:
        big = make_problem(rank, world, 7, [4] * world, owners)
        x, ids, w = (big.x, big.topk_ids, big.topk_weights) if rank == 1 else (p.x, p.topk_ids, p.topk_weights)
        every_rank_raises(ValueError, "max_tokens", lambda: plan.dispatch(x, ids, w))
        bad_ids = p.topk_ids.clone()
        if rank == 0:
            bad_ids[0, 0] = 99
        every_rank_raises(
            ValueError, r"topk_ids must lie in \[0, ", lambda: plan.dispatch(p.x, bad_ids, p.topk_weights)
        )
        d = plan.dispatch(p.x, p.topk_ids, p.topk_weights)
        old = d.handle
        d = plan.dispatch(p.x, p.topk_ids, p.topk_weights)
        y = torch.zeros(d.x.shape)
        every_rank_raises(ValueError, "dispatched step", lambda: plan.combine(y, old if rank == 0 else d.handle))
        out = layer(p, d, plan.combine)
        torch.testing.assert_close(out.double(), p.want(), **TOL)
    finally:
        _set_debug(False)


def nothing_to_send(rank: int, world: int) -> None:
    """No rank has a token: nothing moves, the outputs are empty."""
    p = make_problem(rank, world, 8, [0] * world, owners_interleaved(8, world))
    out, d = functional(p)
    assert d.x.shape == (0, H) and out.shape == (0, H)


def raising_plugin_is_skipped(rank: int, world: int) -> None:
    """A plugin kernel whose predicate raises rejects only itself: the exchange is served by
    the next kernel of each operator (as test_selector checks for the other operators)."""
    p = make_problem(rank, world, 11, [2] * world, owners_interleaved(8, world))
    names = {}
    for op in ("moe.dispatch", "moe.combine"):
        names[op] = f"t_boom.{op}"
        register_kernel(op, name=names[op], solution="test", priority=Priority.PLUGIN, predicate=lambda r: 1 / 0)(
            lambda args: None
        )
    try:
        d = moe_dispatch(p.x, p.topk_ids, p.topk_weights, group=dist.group.WORLD, expert_map=p.expert_map)
        assert last_kernel() == "torch_moe_dispatch_padded" == d.handle.kernel
        out = layer(p, d, moe_combine)
        assert last_kernel() == "torch_moe_combine"
        torch.testing.assert_close(out.double(), p.want(), **TOL)
    finally:
        for name in names.values():
            unregister_kernel(name)


def wire_rows_round_trip(rank: int, world: int) -> None:
    """The padded dispatch's wire rows deliver exactly what the reference's separate exchanges
    do, packed (activations, ids and weights in one row of bytes, one collective) and split
    (large exchanges: the activations in a collective of their own): bf16/fp16/fp32
    activations of any bits (signed zeros, subnormals, inf, NaN) and H that leaves the
    routing unaligned, ids up to E - 1, weights' bits (subnormal, -0.0); padding rows E and
    0, finite."""
    owners = owners_interleaved(9, world)
    for pack_bytes in (ep_wire.PACK_BYTES, 0):
        for dtype, hidden in ((torch.bfloat16, 17), (torch.float16, 16), (torch.float32, 5)):
            _round_trip(rank, world, owners, dtype, hidden, pack_bytes)
    assert ep_wire.PACK_BYTES >= world * 4 * ep_wire.WireLayout(17, K, torch.bfloat16).row_bytes, "packed not run"


def _round_trip(rank: int, world: int, owners: list[int], dtype: torch.dtype, hidden: int, pack_bytes: int) -> None:
    num_experts = len(owners)
    p = make_problem(rank, world, 20, [4, 1, 0, 3][:world], owners)
    g = torch.Generator().manual_seed(30 + rank)
    bits = torch.randint(-(2**15), 2**15, (p.x.shape[0], hidden), generator=g, dtype=torch.int16)
    x = bits.view(dtype) if dtype != torch.float32 else torch.randn(p.x.shape[0], hidden, generator=g)
    x = x.contiguous()
    special = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-40]).to(dtype)
    if x.shape[0]:
        x[0, : min(hidden, 5)] = special[: min(hidden, 5)]
        p.topk_ids[0, 0] = num_experts - 1
        p.topk_weights[0, :2] = torch.tensor([-0.0, 1e-42])
    from tokenspeed_kernel_dev.op_count import count_ops

    got = {}

    def dispatch(kernel: str) -> None:
        got[kernel] = moe_dispatch(
            x, p.topk_ids, p.topk_weights, group=dist.group.WORLD, expert_map=p.expert_map, override=kernel
        )

    saved, ep_wire.PACK_BYTES = ep_wire.PACK_BYTES, pack_bytes
    try:
        dispatch("torch_moe_dispatch")
        ops = count_ops(lambda: dispatch("torch_moe_dispatch_padded"))
    finally:
        ep_wire.PACK_BYTES = saved
    ref, pad = got["torch_moe_dispatch"], got["torch_moe_dispatch_padded"]
    assert ops.collectives.count("c10d::alltoall_base_") == (1 if pack_bytes else 2), ops.collectives
    as_int = torch.int16 if dtype != torch.float32 else torch.int32
    valid = ref.topk_ids[:, 0] < num_experts
    assert torch.equal(ref.x[valid].view(as_int), pad.x[valid].view(as_int))
    assert torch.equal(ref.topk_ids, pad.topk_ids) and bool((pad.topk_ids[~valid] == num_experts).all())
    assert torch.equal(ref.topk_weights.view(torch.int32), pad.topk_weights.view(torch.int32))
    assert bool((pad.topk_weights[~valid] == 0).all()) and bool(pad.x[~valid].isfinite().all())
    for d in got.values():
        moe_combine(torch.zeros_like(d.x), d.handle)


def one_collective_each_way(rank: int, world: int) -> None:
    """A plan step of the padded dispatch runs one collective and at most 15 torch ops (a
    large, split exchange two and 14); its combine one collective and 2 ops for W = 2, W + 1
    for more (``tokenspeed_kernel_dev.op_count``, the profiler)."""
    from tokenspeed_kernel_dev.op_count import count_ops

    p = make_problem(rank, world, 21, [5] * world, owners_interleaved(8, world))
    saved = ep_wire.PACK_BYTES
    try:
        for pack_bytes, collectives, launches in ((saved, 1, 15), (0, 2, 14)):
            ep_wire.PACK_BYTES = pack_bytes
            plan = moe_dispatch_plan(
                dist.group.WORLD, p.expert_map, max_tokens=5, hidden=H, top_k=K, x_dtype=torch.float32, capturable=True
            )
            dispatch = count_ops(lambda plan=plan: plan.dispatch(p.x, p.topk_ids, p.topk_weights))
            assert len(dispatch.collectives) == collectives and len(dispatch.launches) <= launches, dispatch
            d = plan.dispatch(p.x, p.topk_ids, p.topk_weights)
            y = torch.zeros(d.x.shape)
            args = MoECombineArgs(y, d.handle.route, d.handle.group, p.x.new_empty(p.x.shape))
            combine = count_ops(lambda plan=plan, args=args: plan.combine_spec.fn(args))
            assert len(combine.collectives) == 1 and len(combine.launches) <= (2 if world == 2 else world + 1), combine
            plan.combine(y, d.handle)
    finally:
        ep_wire.PACK_BYTES = saved


SCENARIOS: tuple[Callable[[int, int], None], ...] = (
    numerics_both_kernels,
    uneven_routing_and_order,
    plan_steps,
    bad_inputs_every_rank_raises,
    debug_plan_one_rank,
    nothing_to_send,
    raising_plugin_is_skipped,
    wire_rows_round_trip,
    one_collective_each_way,
)


def run(rank: int, world: int, scenarios: tuple[Callable[[int, int], None], ...] = SCENARIOS) -> list[str]:
    """Every scenario in order on this rank; the names of those finished."""
    done = []
    for scenario in scenarios:
        scenario(rank, world)
        done.append(scenario.__name__)
    return done


# --- the Triton wheel's kernels (tests/tokenspeed_kernel_triton/ops/moe/test_ep.py: ranks with
# the Triton backend under TRITON_INTERPRET=1) ----------------------------------------------


def triton_matches_torch_bitwise(rank: int, world: int) -> None:
    """triton_moe_dispatch / triton_moe_combine deliver the same bits as the core's padded
    dispatch and combine (packed and split wire rows; bf16/fp16/fp32; a rank with no token;
    H that leaves the routing unaligned), with the same collectives."""
    from tokenspeed_kernel_dev.op_count import count_ops

    owners = owners_interleaved(9, world)
    group = dist.group.WORLD
    saved = ep_wire.PACK_BYTES
    try:
        for pack_bytes in (saved, 0):
            ep_wire.PACK_BYTES = pack_bytes
            for dtype, hidden in ((torch.bfloat16, 17), (torch.bfloat16, 16), (torch.float16, 24), (torch.float32, 5)):
                p = make_problem(rank, world, 40 + hidden, [4, 1, 0, 3][:world], owners)
                x = (torch.randn(p.x.shape[0], hidden, generator=torch.Generator().manual_seed(rank)) * 50).to(dtype)
                got = {}
                for kernel in ("torch_moe_dispatch_padded", "triton_moe_dispatch"):
                    got[kernel] = moe_dispatch(
                        x, p.topk_ids, p.topk_weights, group=group, expert_map=p.expert_map, override=kernel
                    )
                ref, tri = got.values()
                as_int = torch.int16 if dtype != torch.float32 else torch.int32
                valid = ref.topk_ids[:, 0] < len(owners)
                assert torch.equal(ref.x[valid].view(as_int), tri.x[valid].view(as_int))
                assert torch.equal(ref.topk_ids, tri.topk_ids)
                assert torch.equal(ref.topk_weights.view(torch.int32), tri.topk_weights.view(torch.int32))
                assert torch.equal(ref.handle.route.slots, tri.handle.route.slots)
                y = (torch.randn(ref.x.shape, generator=torch.Generator().manual_seed(9 + rank)) * 100).to(dtype)
                y[~valid] = float("nan")  # padding rows are never read
                ops = count_ops(functools.partial(_triton_exchange, p, x, y))
                assert ops.collectives.count("c10d::alltoall_base_") == (2 if pack_bytes else 3), ops.collectives
                out_ref = moe_combine(y, ref.handle, override="torch_moe_combine")
                out_tri = moe_combine(y, tri.handle, override="triton_moe_combine")
                assert torch.equal(out_ref.view(as_int), out_tri.view(as_int))
    finally:
        ep_wire.PACK_BYTES = saved


def _triton_exchange(p: Problem, x: torch.Tensor, y: torch.Tensor) -> None:
    """A functional dispatch and combine with the Triton kernels (``y`` for the experts' rows)."""
    d = moe_dispatch(
        x, p.topk_ids, p.topk_weights, group=dist.group.WORLD, expert_map=p.expert_map, override="triton_moe_dispatch"
    )
    moe_combine(y, d.handle, override="triton_moe_combine")


def triton_plan_steps(rank: int, world: int) -> None:
    """A capturable plan selects the Triton kernels (opt-in, above the core's padded dispatch)
    and its steps (varying T, T = 0) equal the float64 MoE."""
    _plan_steps(rank, world, "triton_moe_dispatch", capturable=True)
    owners = owners_interleaved(8, world)
    base = make_problem(rank, world, 4, [2] * world, owners)
    plan = moe_dispatch_plan(
        dist.group.WORLD, base.expert_map, max_tokens=2, hidden=H, top_k=K, x_dtype=torch.float32, capturable=True
    )
    assert plan.combine_spec.name == "triton_moe_combine", plan.combine_spec.name


TRITON_SCENARIOS: tuple[Callable[[int, int], None], ...] = (triton_matches_torch_bitwise, triton_plan_steps)


def run_triton(rank: int, world: int) -> list[str]:
    """The Triton scenarios in order on this rank."""
    return run(rank, world, TRITON_SCENARIOS)
