"""Where an eager decode step's host time goes: our public calls against the model's own glue.

Issue 19 asks for the example's eager decode step at B=1 within 1.5x its CUDA-graph replay.
At B=1 the GPU finishes long before the host has issued the step, so the eager step's wall
time is the host's: this tool times, per step, every public call of the step (``store_kvcache``,
``DecodePlan.run``, ``moe_topk``, ``MoEPlan.apply``) and every piece of the model's own glue
(RMSNorm, the rotary tables and rotation, the projections, the token embedding; plain PyTorch
in :mod:`examples.gpt_oss.model`), each wrapped in a host clock around the call (no device
synchronization inside the loop; one at the end). The rest of the step (the model's Python,
the residual adds, the LM head, the decode runner's table fill, the greedy feedback) is the
remainder.

    python3 -m examples.gpt_oss.host_cost [--batch 1] [--ctx 8192] [--steps 200] [--count-ops] [--json FILE]

``--count-ops`` also runs a few untimed steps under a dispatcher mode that counts, per piece,
the aten operators that do work (views and bare allocations left out): on a GPU each is
about one kernel launch (a cuBLAS GEMM may be more). A Triton or Gluon kernel launched by
our calls is no aten operator, so our pieces' counts hold only the aten work around them; the
glue's and the rest's counts are complete. On the CPU the reference kernels are aten work.

On the CPU (``--tiny``) it runs the reference kernels: a smoke test of the tool, not a
measurement (the op counts hold there too). Each wrapper adds ~0.2 µs per call (a clock
pair), counted in its piece.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import examples.gpt_oss.model as model_module

# The model's glue and our public calls, by the name the step's code reaches them through:
# (module attribute of examples.gpt_oss.model, piece, ours?).
_MODULE_CALLS = (
    ("rms_norm", "rms_norm (torch)", False),
    ("rope_tables", "rope_tables (torch)", False),
    ("apply_rope", "apply_rope (torch)", False),
    ("store_kvcache", "store_kvcache", True),
    ("moe_topk", "moe_topk", True),
)
_F_CALLS = (("linear", "F.linear (torch)"), ("embedding", "F.embedding (torch)"))


# aten operators that launch nothing: allocations without a fill (views are told by is_view)
_NO_WORK = frozenset(
    (
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
        torch.ops.aten.detach.default,
        torch.ops.aten.lift_fresh.default,
    )
)
_REST = "the rest (model Python, table fill, feedback)"


@dataclass
class Piece:
    """Host seconds, calls and (when counted) aten operators of one piece: seconds and calls
    over the timed steps, ``ops`` over the counted ones."""

    seconds: float = 0.0
    calls: int = 0
    ours: bool = False
    ops: int = 0


@dataclass
class HostCost:
    """The breakdown of ``steps`` eager decode steps: wall seconds and each piece's share;
    with ``counted_steps`` > 0, the aten operators per piece over that many more steps
    (``rest_ops``: those outside every piece)."""

    steps: int
    wall_s: float
    pieces: dict[str, Piece] = field(default_factory=dict)
    counted_steps: int = 0
    rest_ops: int = 0

    def ops_per_step(self) -> dict[str, float]:
        """aten operators per step by piece (and the rest), empty when not counted."""
        if not self.counted_steps:
            return {}
        out = {name: p.ops / self.counted_steps for name, p in self.pieces.items()}
        out[_REST] = self.rest_ops / self.counted_steps
        return out

    def rows(self) -> list[tuple[str, float, float, float]]:
        """``(piece, µs per step, calls per step, µs per call)``, the largest first, then the
        remainder."""
        out = [
            (name, p.seconds / self.steps * 1e6, p.calls / self.steps, p.seconds / max(p.calls, 1) * 1e6)
            for name, p in sorted(self.pieces.items(), key=lambda item: -item[1].seconds)
        ]
        rest = self.wall_s - sum(p.seconds for p in self.pieces.values())
        out.append((_REST, rest / self.steps * 1e6, 0.0, 0.0))
        return out

    def table(self) -> str:
        step_us = self.wall_s / self.steps * 1e6
        ours = sum(p.seconds for p in self.pieces.values() if p.ours) / self.steps * 1e6
        ops = self.ops_per_step()
        head = f"{'piece':<46} {'µs/step':>9} {'calls':>6} {'µs/call':>8} {'share':>6}"
        lines = [head + (f" {'ops/step':>8}" if ops else "")]
        for name, us, calls, per in self.rows():
            calls_s = f"{calls:6.0f}" if calls else f"{'':6}"
            per_s = f"{per:8.1f}" if calls else f"{'':8}"
            ops_s = f" {ops[name]:8.0f}" if ops else ""
            lines.append(f"{name:<46} {us:9.1f} {calls_s} {per_s} {us / step_us:6.1%}{ops_s}")
        lines.append(f"{'eager step (wall)':<46} {step_us:9.1f}")
        lines.append(f"our public calls: {ours:.1f} µs of {step_us:.1f} per step ({ours / step_us:.1%})")
        if ops:
            glue = sum(n for name, n in ops.items() if name in self.pieces and not self.pieces[name].ours)
            lines.append(
                f"aten ops per step: {sum(ops.values()):.0f}, the glue's {glue:.0f}, the rest's {ops[_REST]:.0f} "
                f"(over {self.counted_steps} untimed steps; Triton/Gluon launches are not aten ops)"
            )
        return "\n".join(lines)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators that do work into the innermost active piece of ``stack``
    (into ``cost.rest_ops`` outside every piece)."""

    def __init__(self, cost: HostCost, stack: list[Piece]) -> None:
        super().__init__()
        self.cost, self.stack = cost, stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view and func not in _NO_WORK:
            if self.stack:
                self.stack[-1].ops += 1
            else:
                self.cost.rest_ops += 1
        return func(*args, **(kwargs or {}))


def _timed(piece: Piece, fn: Callable[..., Any], stack: list[Piece]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        stack.append(piece)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            piece.seconds += time.perf_counter() - t0
            piece.calls += 1
            stack.pop()

    return timed


class _Timed:
    """``obj`` with some methods timed into their pieces (everything else passes through)."""

    def __init__(self, obj: Any, methods: dict[str, Piece], stack: list[Piece]) -> None:
        self._obj = obj
        for method, piece in methods.items():
            setattr(self, method, _timed(piece, getattr(obj, method), stack))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obj, name)


@contextmanager
def timed_pieces(model: Any, batch: Any, pieces: dict[str, Piece], stack: list[Piece] | None = None) -> Iterator[None]:
    """Within the block, the model's glue and our public calls add their host time to
    ``pieces`` (``batch``: the decode runner's :class:`ForwardBatch` with its plans); each
    piece is on ``stack`` while it runs (an :class:`_OpCounter` reads it)."""
    stack = [] if stack is None else stack

    def piece(name: str, ours: bool) -> Piece:
        return pieces.setdefault(name, Piece(ours=ours))

    # a name the model module lacks is left out (an older model.py: this tool times it too)
    saved_module = {name: getattr(model_module, name) for name, _, _ in _MODULE_CALLS if hasattr(model_module, name)}
    saved_f, saved_plans, saved_moe = model_module.F, batch.decode_plans, model.plans
    try:
        for name, label, ours in _MODULE_CALLS:
            if name in saved_module:
                setattr(model_module, name, _timed(piece(label, ours), saved_module[name], stack))
        model_module.F = _Timed(F, {n: piece(label, False) for n, label in _F_CALLS}, stack)
        batch.decode_plans = [_Timed(p, {"run": piece("DecodePlan.run", True)}, stack) for p in saved_plans]
        model.plans = [_Timed(p, {"apply": piece("MoEPlan.apply", True)}, stack) for p in saved_moe]
        yield
    finally:
        for name, fn in saved_module.items():
            setattr(model_module, name, fn)
        model_module.F, batch.decode_plans, model.plans = saved_f, saved_plans, saved_moe


def measure(
    device: str,
    *,
    batch: int = 1,
    ctx: int = 8192,
    steps: int = 200,
    layers: int = 2,
    tiny: bool = False,
    count_steps: int = 0,
) -> tuple[HostCost, float]:
    """``steps`` eager decode steps of the example (the selector's kernels) at ``batch`` x
    ``ctx``, broken down by piece; also the untimed eager step's ms (the wrappers' cost is the
    difference). ``count_steps`` > 0: that many more steps, untimed, count the aten operators
    of every piece (:class:`_OpCounter`)."""
    from examples.gpt_oss import GptOssConfig, GptOssModel, random_weights
    from examples.gpt_oss.bench import _make_kv
    from examples.gpt_oss.serve import DecodeRunner

    dev = torch.device(device)
    cfg = GptOssConfig.tiny(num_layers=layers) if tiny else GptOssConfig.gpt_oss_120b(num_layers=layers)
    page = 4 if tiny else 16
    weights = random_weights(cfg, dev, seed=0)
    model = GptOssModel(cfg, weights)
    kv = _make_kv(cfg, dev, batch, ctx, page)
    rids = list(range(batch))
    for rid in rids:
        kv.add(rid, ctx)
    kv.set_lengths({rid: ctx for rid in rids})
    runner = DecodeRunner(model, kv, rids, graph=False, advance=False)

    def run(n: int) -> float:
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            runner.step_eager()
        sync()
        return time.perf_counter() - t0

    run(max(steps // 10, 3))  # warm-up: compiles, plans, allocator
    plain_ms = run(steps) / steps * 1e3
    cost = HostCost(steps, 0.0)
    with timed_pieces(model, runner.batch, cost.pieces):
        cost.wall_s = run(steps)
    if count_steps > 0:
        counted = HostCost(count_steps, 0.0)
        stack: list[Piece] = []
        with timed_pieces(model, runner.batch, counted.pieces, stack), _OpCounter(counted, stack):
            run(count_steps)
        for name, p in counted.pieces.items():
            cost.pieces.setdefault(name, Piece(ours=p.ours)).ops = p.ops
        cost.counted_steps, cost.rest_ops = count_steps, counted.rest_ops
    return cost, plain_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=None, help="context tokens (default 8192; tiny: 40)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--count-ops",
        type=int,
        nargs="?",
        const=5,
        default=0,
        metavar="STEPS",
        help="also count the aten operators of every piece over STEPS more steps (default 5)",
    )
    p.add_argument("--json", default=None, help="also write the breakdown as JSON")
    args = p.parse_args(argv)
    ctx = args.ctx or (40 if args.tiny else 8192)
    cost, plain_ms = measure(
        args.device,
        batch=args.batch,
        ctx=ctx,
        steps=args.steps,
        layers=args.layers,
        tiny=args.tiny,
        count_steps=args.count_ops,
    )
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"eager decode step, B={args.batch} ctx={ctx}, {args.layers} layers, {name}, {args.steps} steps")
    print(cost.table())
    print(f"untimed eager step: {plain_ms:.3f} ms (the wrappers add the difference)")
    if args.json:
        ops = cost.ops_per_step()
        rows = [dict(zip(("piece", "us_per_step", "calls_per_step", "us_per_call"), r)) for r in cost.rows()]
        for row in rows:
            if ops:
                row["aten_ops_per_step"] = ops[row["piece"]]
        record = {"batch": args.batch, "ctx": ctx, "layers": args.layers, "device": name, "rows": rows}
        record["step_us"], record["untimed_step_ms"] = cost.wall_s / cost.steps * 1e6, plain_ms
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
