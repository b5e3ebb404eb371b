"""Count what one call launches: torch ops by kind, from ``torch.profiler`` on the CPU.

:func:`count_ops` runs a function once under the profiler and sorts the outermost torch ops
it called (an op inside another op is part of it) into

- ``launches``: ops that do work on the tensors' device (a kernel each on a GPU: fills,
  copies, indexing, arithmetic, scans; a ``.to`` that converts counts, a no-op one does not),
- ``collectives``: ``torch.distributed`` collectives (``c10d::*``),
- ``allocations``: ``empty``-like ops (no kernel),
- ``views``: ops that only make a view or read metadata (no kernel).

Run as a script, it prints the table of the expert-parallel exchange kernels (every
``moe.dispatch`` and ``moe.combine`` kernel of a ``moe_dispatch_plan``, on 2 gloo ranks)::

    PYTHONPATH=ci:packages/tokenspeed-kernel/src python3 -m tokenspeed_kernel_dev.op_count [--world 4]
"""

from __future__ import annotations

import argparse
import collections
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OpCount", "count_ops", "ep_counts"]

_VIEWS = frozenset(
    (
        "alias",
        "as_strided",
        "detach",
        "expand",
        "flatten",
        "narrow",
        "permute",
        "promote_types",
        "reshape",
        "select",
        "slice",
        "squeeze",
        "t",
        "transpose",
        "unflatten",
        "unsqueeze",
        "view",
        "_reshape_alias",
        "lift_fresh",
        "resolve_conj",
        "resolve_neg",
    )
)
_ALLOCATIONS = frozenset(("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"))


@dataclass
class OpCount:
    """The outermost ops of one call, by kind (names without the ``aten::`` prefix), in order."""

    launches: list[str] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    allocations: list[str] = field(default_factory=list)
    views: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        return {k: len(getattr(self, k)) for k in ("launches", "collectives", "allocations", "views")}


def _kind(event: Any) -> str:
    name = event.name
    if name.startswith("c10d::"):
        return "collectives"
    short = name.removeprefix("aten::")
    if short in _VIEWS:
        return "views"
    if short in _ALLOCATIONS:
        return "allocations"
    if short in ("to", "_to_copy", "contiguous", "clone", "reshape"):
        # work only when something below copies
        below = _descendants(event)
        return "launches" if any(d.name in ("aten::copy_", "aten::_to_copy") for d in below) else "views"
    return "launches"


def _descendants(event: Any) -> list[Any]:
    out, todo = [], list(event.cpu_children)
    while todo:
        e = todo.pop()
        out.append(e)
        todo.extend(e.cpu_children)
    return out


def _is_op(event: Any) -> bool:
    return event.name.startswith(("aten::", "c10d::"))


def count_ops(fn: Callable[[], object]) -> OpCount:
    """The outermost torch ops of one ``fn()`` (run once before, unprofiled, to warm up)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counted = OpCount()
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        if not _is_op(event):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if _is_op(parent):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            getattr(counted, _kind(event)).append(event.name.removeprefix("aten::"))
    return counted


def _rank_counts(
    rank: int, world: int, tokens: int, hidden: int, experts: int, top_k: int, split: bool
) -> dict[str, Any]:
    """On one gloo rank: every dispatch kernel's and combine kernel's ops for one plan step
    (``split``: the padded dispatch's large-exchange form at any size)."""
    import torch
    import torch.distributed as dist

    if split:
        from tokenspeed_kernel.ops.moe import ep_wire

        ep_wire.PACK_BYTES = 0

    from tokenspeed_kernel import moe_dispatch_plan
    from tokenspeed_kernel.ops.moe.args import MoECombineArgs
    from tokenspeed_kernel.registry import kernels

    per = experts // world
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[rank * per : (rank + 1) * per] = torch.arange(per, dtype=torch.int32)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g)
    table: dict[str, Any] = {}
    for spec in kernels("moe.dispatch"):
        plan = moe_dispatch_plan(
            dist.group.WORLD,
            expert_map,
            max_tokens=tokens,
            hidden=hidden,
            top_k=top_k,
            x_dtype=torch.bfloat16,
            override=spec.name,
        )
        table[spec.name] = count_ops(functools.partial(plan.dispatch, x, ids, weights)).__dict__
        d = plan.dispatch(x, ids, weights)
        args = MoECombineArgs(d.x.clone(), d.handle.route, d.handle.group, torch.empty_like(x))
        for combine in kernels("moe.combine"):
            table[f"{combine.name} (after {spec.name})"] = count_ops(functools.partial(combine.fn, args)).__dict__
    return table


def ep_counts(
    world: int = 2, tokens: int = 64, hidden: int = 64, experts: int = 8, top_k: int = 2, *, split: bool = False
) -> dict[str, Any]:
    """Rank 0's op counts of every expert-parallel kernel (a plan step on ``world`` gloo ranks)."""
    from tokenspeed_kernel_dev.ranks import run_ranks

    env = {"TOKENSPEED_KERNEL_DISABLE_BACKENDS": "triton,nvidia,amd", "OMP_NUM_THREADS": "1"}
    results = run_ranks(
        _rank_counts, world, args=(tokens, hidden, experts, top_k, split), env=env, timeout_s=60, deadline_s=180
    )
    return results[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="op counts of the expert-parallel kernels (gloo, CPU)")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--split", action="store_true", help="the padded dispatch's large-exchange form (2 collectives)")
    p.add_argument("--verbose", action="store_true", help="list every op by kind")
    args = p.parse_args(argv)
    table = ep_counts(args.world, args.tokens, split=args.split)
    print(f"{'kernel':<60} {'launches':>8} {'collectives':>11} {'allocations':>11} {'views':>5}")
    for name, kinds in table.items():
        c = OpCount(**kinds).summary()
        print(f"{name:<60} {c['launches']:>8} {c['collectives']:>11} {c['allocations']:>11} {c['views']:>5}")
        if args.verbose:
            for kind in ("launches", "collectives", "allocations"):
                counts = collections.Counter(kinds[kind])
                print(f"    {kind}: " + ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
