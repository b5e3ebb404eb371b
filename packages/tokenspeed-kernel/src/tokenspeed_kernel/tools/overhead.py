"""``overhead``: the host cost of one eager public call, measured without a GPU.

Every public operator (and the per-step call of each plan) is called at a small shape with
a registered **no-op kernel**, so what is timed is exactly the core's own work per call:
argument validation, the selector request, selection (a cache hit) and the dispatch
bookkeeping, output allocation, the typed argument object and the call into the kernel.
This is the overhead an engine pays per layer per step on the eager path (no CUDA graph),
on top of the kernel launch itself.

The no-op kernels are registered under private names (``_overhead_noop.<op>``) at a
priority above every band for the duration of :func:`noop_kernels` only, then unregistered
(the selector cache is dropped on both edges, as for any (un)registration), so they never
serve a call made outside the benchmark. Run it in its own process::

    tokenspeed-kernel overhead                 # or: python -m tokenspeed_kernel.tools.overhead
    tokenspeed-kernel overhead --op attention.prefill --json overhead.json

Per case it prints the median microseconds per call (over ``repeats`` runs of ``number``
calls) and a breakdown into ``validation`` (argument checks, in ``ops/_checks.py``,
``ops/*/_validate.py`` and the ``check_*`` helpers; on a remembered call, the operator's call
key), ``request`` (building the selector request), ``select`` (selector lookup, platform,
capture guard, ``last_kernel`` bookkeeping), ``launch`` (output allocation, the typed
arguments, the call into the kernel) and ``body`` (the public function, the call path and the
plan's own lines). The breakdown is each category's share of
a ``cProfile`` run (self time; a builtin's time is charged to its caller's category) scaled
to the unprofiled median: the profiler inflates call-heavy parts, so read the shares as
approximate and the total as exact.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import statistics
import sys
import sysconfig
import timeit
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.operators import OPERATORS
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools.common import provenance, resolve_device, write_json

__all__ = [
    "CATEGORIES",
    "FUNCTIONAL_CALLS",
    "NOOP_PREFIX",
    "PLAN_CALLS",
    "OverheadCase",
    "OverheadRow",
    "breakdown",
    "cases",
    "main",
    "measure",
    "noop_kernels",
]

NOOP_PREFIX = "_overhead_noop."
# The highest priority a kernel may register, so the no-op wins selection without an override
# (the engine's path), unless a plugin kernel registers it too and its name sorts first.
_NOOP_PRIORITY = Priority.highest()
CATEGORIES = ("validation", "request", "select", "launch", "body", "kernel")


def _noop(args: object) -> None:
    """Does nothing: the benchmark times the call path, not a kernel."""


@contextlib.contextmanager
def noop_kernels(ops: tuple[str, ...] = tuple(OPERATORS)) -> Iterator[dict[str, str]]:
    """Register a no-op kernel per operator (``{op: kernel name}``) for the block only."""
    registry.load_backends()
    names: dict[str, str] = {}
    try:
        for op in ops:
            name = NOOP_PREFIX + op
            features = OPERATORS[op].features  # every feature: it must win every request
            registry.register_kernel(op, name=name, solution="noop", features=features, priority=_NOOP_PRIORITY)(_noop)
            names[op] = name
        yield names
    finally:
        for name in names.values():
            registry.unregister_kernel(name)


@dataclass(frozen=True)
class OverheadCase:
    """One timed call: ``make(device)`` builds the inputs once and returns the call to time."""

    name: str
    op: str
    make: Callable[[torch.device], Callable[[], object]]


HEADS, KV_HEADS, HEAD_DIM, PAGE = 64, 8, 64, 16  # GPT-OSS-120B attention
DTYPE = torch.bfloat16


def _randn(*shape: int, device: torch.device, dtype: torch.dtype = DTYPE) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=dtype)


def _paged(device: torch.device, batch: int = 1, tokens: int = 256) -> dict[str, torch.Tensor]:
    """A contiguous paged cache holding ``tokens`` keys per sequence, pages in order."""
    per_seq = -(-tokens // PAGE) + 1
    pages = batch * per_seq
    return {
        "k_cache": _randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device),
        "v_cache": _randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device),
        "page_table": torch.arange(pages, dtype=torch.int32, device=device).reshape(batch, per_seq),
        "cache_seqlens": torch.full((batch,), tokens, dtype=torch.int32, device=device),
        "sinks": torch.randn(HEADS, device=device, dtype=torch.float32),
    }


def _prefill(device: torch.device, override: str | None = None, window_left: int = 127) -> Callable[[], object]:
    from tokenspeed_kernel import mha_prefill

    q, k, v = (_randn(64, h, HEAD_DIM, device=device) for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    sinks = torch.randn(HEADS, device=device, dtype=torch.float32)
    return lambda: mha_prefill(q, k, v, cu, cu, 64, 64, window_left=window_left, sinks=sinks, override=override)


# GPT-OSS's full-attention layers (every other layer): causal, no window.
_prefill_full = functools.partial(_prefill, window_left=-1)


def _prefill_plan(device: torch.device) -> Callable[[], object]:
    """``_prefill``'s call (window 128) as one layer of a step planned once (``mha_prefill_plan``)."""
    from tokenspeed_kernel import mha_prefill_plan

    q, k, v = (_randn(64, h, HEAD_DIM, device=device) for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    sinks = torch.randn(HEADS, device=device, dtype=torch.float32)
    plan = mha_prefill_plan(q, k, v, cu, cu, 64, 64, window_left=127, sinks=sinks)
    return lambda: plan.run(q, k, v, sinks=sinks)


def _extend(device: torch.device, override: str | None = None) -> Callable[[], object]:
    from tokenspeed_kernel import mha_extend_with_kvcache

    c = _paged(device)
    q = _randn(16, HEADS, HEAD_DIM, device=device)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    return lambda: mha_extend_with_kvcache(
        q,
        c["k_cache"],
        c["v_cache"],
        c["page_table"],
        cu,
        c["cache_seqlens"],
        16,
        256,
        sinks=c["sinks"],
        override=override,
    )


def _extend_plan(device: torch.device) -> Callable[[], object]:
    """``_extend``'s call as one layer of a step planned once (``mha_extend_plan``)."""
    from tokenspeed_kernel import mha_extend_plan

    c = _paged(device)
    q = _randn(16, HEADS, HEAD_DIM, device=device)
    cu = torch.tensor([0, 16], dtype=torch.int32, device=device)
    caches = (c["k_cache"], c["v_cache"])
    plan = mha_extend_plan(q, *caches, c["page_table"], cu, c["cache_seqlens"], 16, 256, sinks=c["sinks"])
    return lambda: plan.run(q, *caches, sinks=c["sinks"])


def _decode(device: torch.device, override: str | None = None) -> Callable[[], object]:
    from tokenspeed_kernel import mha_decode_with_kvcache

    c = _paged(device)
    q = _randn(1, HEADS, HEAD_DIM, device=device)
    return lambda: mha_decode_with_kvcache(
        q, c["k_cache"], c["v_cache"], c["page_table"], c["cache_seqlens"], 256, sinks=c["sinks"], override=override
    )


def _decode_step_plan(device: torch.device) -> Callable[[], object]:
    """``_decode``'s call as one layer of an eager step planned once (``mha_decode_step_plan``)."""
    from tokenspeed_kernel import mha_decode_step_plan

    c = _paged(device)
    q = _randn(1, HEADS, HEAD_DIM, device=device)
    caches = (c["k_cache"], c["v_cache"])
    plan = mha_decode_step_plan(q, *caches, c["page_table"], c["cache_seqlens"], 256, sinks=c["sinks"])
    return lambda: plan.run(q, *caches, sinks=c["sinks"])


def _decode_plan(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import mha_decode_plan

    c = _paged(device)
    plan = mha_decode_plan(
        c["k_cache"],
        c["v_cache"],
        c["page_table"],
        c["cache_seqlens"],
        256,
        q_dtype=DTYPE,
        num_q_heads=HEADS,
        sinks=c["sinks"],
    )
    q = _randn(1, HEADS, HEAD_DIM, device=device)
    return lambda: plan.run(q)


def _store(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import store_kvcache

    c = _paged(device)
    k, v = (_randn(1, KV_HEADS, HEAD_DIM, device=device) for _ in range(2))
    slots = torch.tensor([256], dtype=torch.int64, device=device)
    return lambda: store_kvcache(k, v, c["k_cache"], c["v_cache"], slots)


def _topk(device: torch.device) -> Callable[[], object]:
    from tokenspeed_kernel import moe_topk

    logits = _randn(4, 128, device=device)
    return lambda: moe_topk(logits, 4)


def _moe(device: torch.device) -> dict[str, torch.Tensor]:
    """4 tokens, 32 experts of hidden 512 / intermediate 512 (bf16), top-4."""
    experts, hidden, inter, tokens, top_k = 32, 512, 512, 4, 4
    return {
        "x": _randn(tokens, hidden, device=device),
        "w13": _randn(experts, 2 * inter, hidden, device=device) / hidden**0.5,
        "w2": _randn(experts, hidden, inter, device=device) / inter**0.5,
        "topk_weights": torch.rand(tokens, top_k, device=device),
        "topk_ids": torch.randperm(experts, device=device)[: tokens * top_k].reshape(tokens, top_k).int(),
    }


def _apply(device: torch.device, override: str | None = None) -> Callable[[], object]:
    from tokenspeed_kernel import moe_apply

    m = _moe(device)
    return lambda: moe_apply(m["x"], m["w13"], m["w2"], m["topk_weights"], m["topk_ids"], override=override)


def _apply_plan(device: torch.device, override: str | None = None) -> Callable[[], object]:
    """``_apply``'s call as a plan's step (``moe_plan`` once, ``override`` naming its kernel)."""
    from tokenspeed_kernel import moe_plan

    m = _moe(device)
    plan = moe_plan(m["w13"], m["w2"], x_dtype=DTYPE, top_k=4, override=override)
    return lambda: plan.apply(m["x"], m["topk_weights"], m["topk_ids"])


def _apply_plan_mxfp4(device: torch.device) -> Callable[[], object]:
    """The plan at GPT-OSS's MoE options: MXFP4 weights, biases, swiglu_oai (the decode path)."""
    from tokenspeed_kernel import moe_plan
    from tokenspeed_kernel.quant import quantize_mxfp4

    m = _moe(device)
    experts, hidden = m["w2"].shape[:2]
    plan = moe_plan(
        quantize_mxfp4(m["w13"]),
        quantize_mxfp4(m["w2"]),
        x_dtype=DTYPE,
        top_k=4,
        activation="swiglu_oai",
        w13_bias=_randn(experts, m["w13"].shape[1], device=device),
        w2_bias=_randn(experts, hidden, device=device),
    )
    return lambda: plan.apply(m["x"], m["topk_weights"], m["topk_ids"])


# The functional calls whose case makers take ``override=`` (``--device cuda`` adds a row per
# call served by its portable kernel where the GPU's pick is another one, and one per opt-in
# kernel that accepts the call there).
FUNCTIONAL_CALLS: dict[str, Callable[..., Callable[[], object]]] = {
    "mha_prefill": _prefill,
    "mha_prefill full": _prefill_full,
    "mha_extend_with_kvcache": _extend,
    "mha_decode_with_kvcache": _decode,
    "moe_apply": _apply,
}


# The plans' steps whose case makers take ``override=``, with the functional call that has
# their inputs (``--device cuda`` adds a row per kernel the functional call gets one for: a
# plan's step forced onto the portable kernel, or onto an opt-in kernel that accepts the call).
PLAN_CALLS: dict[str, tuple[str, Callable[..., Callable[[], object]]]] = {
    "MoEPlan.apply": ("moe_apply", _apply_plan),
}


def cases() -> tuple[OverheadCase, ...]:
    """The timed calls: every public operator and each plan's per-step call, at GPT-OSS-120B's
    attention heads (64 query / 8 KV heads of dim 64, bf16, sinks): prefill 64 tokens with
    window 128 (the window layers; also as a planned step's layer) and without (``full``: the
    full-attention layers); extend
    16 onto 256 cached (also as a planned step's layer); decode B=1 over 256 keys (also through
    both decode plans); store 1 token; top-4 of
    128 over 4 tokens; MoE 4 tokens, 32 experts of 512 x 512, top-4 (bf16 weights; the plan
    also with MXFP4 weights, biases and swiglu_oai)."""
    return (
        OverheadCase("mha_prefill", "attention.prefill", _prefill),
        OverheadCase("mha_prefill full", "attention.prefill", _prefill_full),
        OverheadCase("PrefillPlan.run", "attention.prefill", _prefill_plan),
        OverheadCase("mha_extend_with_kvcache", "attention.extend", _extend),
        OverheadCase("ExtendPlan.run", "attention.extend", _extend_plan),
        OverheadCase("mha_decode_with_kvcache", "attention.decode", _decode),
        OverheadCase("DecodePlan.run", "attention.decode", _decode_plan),
        OverheadCase("DecodeStepPlan.run", "attention.decode", _decode_step_plan),
        OverheadCase("store_kvcache", "kvcache.store", _store),
        OverheadCase("moe_topk", "moe.topk", _topk),
        OverheadCase("moe_apply", "moe.apply", _apply),
        OverheadCase("MoEPlan.apply", "moe.apply", _apply_plan),
        OverheadCase("MoEPlan.apply mxfp4", "moe.apply", _apply_plan_mxfp4),
    )


def _sdpa(device: torch.device) -> Callable[[], object]:
    q = _randn(1, HEADS, 1, HEAD_DIM, device=device)
    k, v = (_randn(1, KV_HEADS, 256, HEAD_DIM, device=device) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return lambda: sdpa(q, k, v, enable_gqa=True)


def _matmul(device: torch.device) -> Callable[[], object]:
    a, b = _randn(64, 64, device=device), _randn(64, 64, device=device)
    return lambda: torch.matmul(a, b)


def baselines() -> tuple[OverheadCase, ...]:
    """torch's own eager calls at comparable sizes (``--device cuda``): SDPA at the decode
    shape (GQA) and a 64 x 64 matmul."""
    return (
        OverheadCase("torch SDPA (baseline)", "torch", _sdpa),
        OverheadCase("torch matmul (baseline)", "torch", _matmul),
    )


@dataclass(frozen=True)
class OverheadRow:
    """One case's result: median/min µs per call and the per-category breakdown (µs)."""

    name: str
    op: str
    kernel: str
    median_us: float
    min_us: float
    breakdown_us: dict[str, float]


# Categories of profiled Python functions, by name, then by the file they live in.
_BY_NAME = {
    **dict.fromkeys(("attention_request", "store_request", "topk_request", "apply_request", "pow2_bucket"), "request"),
    **dict.fromkeys(("make", "features"), "request"),
    # An operator's call key stands for its checks on the hot path (ops/_operator.py).
    "key": "validation",
    **dict.fromkeys(("select", "dispatch", "record", "check_capturable", "is_capturing"), "select"),
    **dict.fromkeys(("_noop", "replace", "_replace", "launch", "_launch"), "launch"),
}
# Builtins and generated methods that the op's own body calls to allocate outputs and build
# the kernel's typed arguments (a dataclass ``__init__``, ``dataclasses.replace``).
_LAUNCH_LEAVES = frozenset({"__init__", "new_empty", "empty", "empty_like", "view", "unsqueeze"})
_BY_FILE = (
    (("registry.py",), "request"),
    (("selector.py", "_dispatch.py", "platform.py", "config.py"), "select"),
    (("_checks.py", "_validate.py"), "validation"),
    (("args.py",), "launch"),
)


# Code outside the core, torch and the standard library: the backend wheels' kernel modules
# and the compilers' runtimes they call (what the device mode's kernels run on the host).
_CORE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_paths = sysconfig.get_paths()
# With the separator: the core's directory is a prefix of its wheels' names.
_NOT_KERNEL_DIRS = tuple(os.path.join(d, "") for d in (_CORE_DIR, os.path.dirname(os.path.abspath(torch.__file__))))
_STDLIB = os.path.join(_paths["stdlib"], "")
_SITE = tuple(os.path.join(_paths[k], "") for k in ("purelib", "platlib"))  # may lie inside the stdlib's


# The kit's helpers (cdiv, sm_count, ...) live in the core but run on a backend's behalf.
_KIT_FILE = os.path.join(_CORE_DIR, "kit.py")


def _is_kernel_code(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path == _KIT_FILE:
        return True
    if path.startswith(_NOT_KERNEL_DIRS):
        return False
    return not path.startswith(_STDLIB) or path.startswith(_SITE)


def _label(code: object) -> tuple[str, str]:
    """``(filename, name)`` of a profiled code object; ``("~", "new_empty")`` for a builtin
    (cProfile names those ``<method 'new_empty' of ... objects>`` or
    ``<built-in method torch.empty>``)."""
    if not isinstance(code, str):
        return code.co_filename, code.co_name  # type: ignore[attr-defined]
    if code.startswith("<method '"):
        return "~", code.split("'")[1]
    if code.startswith("<built-in method "):
        return "~", code.removeprefix("<built-in method ").rstrip(">").split(".")[-1]
    return "~", code


def _own_category(code: object) -> str | None:
    """The category of a profiled Python function; None for a builtin or a generated method
    (a dataclass ``__init__``/``__hash__``), which is charged to its caller's category."""
    filename, name = _label(code)
    if filename == "~" or filename.startswith("<"):
        return None
    if _is_kernel_code(filename):
        return "kernel"
    if name in _BY_NAME:
        return _BY_NAME[name]
    if name.startswith(("check_", "_check", "debug_check")):
        return "validation"
    for suffixes, category in _BY_FILE:
        if filename.endswith(suffixes):
            return category
    return "body"


def _is_harness(code: object) -> bool:
    """The benchmark's own closures and the profiler switch (not part of the call)."""
    filename, name = _label(code)
    return (filename.endswith("overhead.py") and name != "_noop") or name == "disable"


def profile_calls(call: Callable[[], object], calls: int = 2000) -> cProfile.Profile:
    """A cProfile run of ``calls`` calls of ``call``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    return profiler


def breakdown(call: Callable[[], object], calls: int = 2000) -> dict[str, float]:
    """Shares of self time per category in a cProfile run (:func:`shares`)."""
    return shares(profile_calls(call, calls))


def shares(profiler: cProfile.Profile) -> dict[str, float]:
    """Shares of self time per category in ``profiler``'s run. A builtin's or generated
    method's time goes to the category of the caller it was called from (the main caller's,
    recursively, when that caller is itself a builtin or generated)."""
    entries = profiler.getstats()
    callers: dict[object, dict[object, float]] = {}
    for entry in entries:
        for sub in entry.calls or ():
            callers.setdefault(sub.code, {})[entry.code] = sub.inlinetime
    memo: dict[object, str] = {}

    def resolve(code: object, depth: int = 0) -> str:
        if code not in memo:
            own = _own_category(code)
            if own is None:
                mine = callers.get(code)
                own = resolve(max(mine, key=mine.__getitem__), depth + 1) if mine and depth < 8 else "body"
            memo[code] = own
        return memo[code]

    totals = dict.fromkeys(CATEGORIES, 0.0)
    for entry in entries:
        if _is_harness(entry.code):
            continue
        if _own_category(entry.code) is not None:
            totals[resolve(entry.code)] += entry.inlinetime
            continue
        for caller, inline in callers.get(entry.code, {}).items():
            if _is_harness(caller):
                continue
            category = resolve(caller)
            if category == "body" and _label(entry.code)[1] in _LAUNCH_LEAVES:
                category = "launch"  # outputs and the typed arguments, built by the op's body
            totals[category] += inline
    whole = sum(totals.values()) or 1.0
    return {name: value / whole for name, value in totals.items()}


def measure(case: OverheadCase, *, number: int = 2000, repeats: int = 7, profile: bool = True) -> OverheadRow:
    """Time ``case`` (call the no-op kernels must be registered: see :func:`noop_kernels`)."""
    call = case.make(torch.device("cpu"))
    for _ in range(200):  # warm: selection cache, lazy imports, allocator
        call()
    kernel = last_kernel() or "?"
    runs = timeit.repeat(call, number=number, repeat=repeats)
    per_call = [t / number * 1e6 for t in runs]
    median = statistics.median(per_call)
    shares = breakdown(call) if profile else {}
    return OverheadRow(
        case.name,
        case.op,
        kernel,
        median,
        min(per_call),
        {name: share * median for name, share in shares.items()},
    )


def run(
    ops: list[str] | None = None, *, number: int = 2000, repeats: int = 7, profile: bool = True
) -> list[OverheadRow]:
    """Measure every case (of ``ops``, or all) with the no-op kernels registered."""
    chosen = [c for c in cases() if ops is None or c.op in ops]
    with noop_kernels():
        rows = [measure(c, number=number, repeats=repeats, profile=profile) for c in chosen]
    for row in rows:
        if not row.kernel.startswith(NOOP_PREFIX):
            raise RuntimeError(f"{row.name} was served by {row.kernel}, not the no-op kernel")
    return rows


def table(rows: list[OverheadRow]) -> str:
    head = f"{'call':<26} {'µs/call':>8} {'min':>7}  " + " ".join(f"{c:>10}" for c in CATEGORIES)
    lines = [head, "-" * len(head)]
    for row in rows:
        parts = " ".join(f"{row.breakdown_us.get(c, float('nan')):>10.2f}" for c in CATEGORIES)
        lines.append(f"{row.name:<26} {row.median_us:>8.2f} {row.min_us:>7.2f}  {parts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenspeed-kernel overhead", description="host µs per eager public call, with a no-op kernel"
    )
    add_arguments(parser)
    try:
        return run_cli(parser.parse_args(argv))
    except ValueError as exc:  # a bad --device or TOKENSPEED_KERNEL_OVERRIDE: one line, exit 2, as the CLI does
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--op", action="append", choices=list(OPERATORS), help="only these operators (repeatable)")
    parser.add_argument("--number", type=int, default=None, help="calls per timed run (default 2000; 300 on a GPU)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs; the median is reported (default 7)")
    parser.add_argument("--no-breakdown", action="store_true", help="skip the cProfile breakdown")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cpu: the core behind no-op kernels (default); cuda[:N]: the real kernels on a GPU",
    )
    parser.add_argument(
        "--top", type=int, default=0, help="with --device cuda: also print each case's N slowest functions"
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run ``overhead`` for parsed arguments; ``ValueError`` (one line) for an unknown or
    unavailable ``--device`` or an invalid ``TOKENSPEED_KERNEL_OVERRIDE``."""
    selector.env_overrides()
    if resolve_device(args.device).type != "cpu":
        from tokenspeed_kernel.tools.overhead_device import run_device_cli

        return run_device_cli(args)
    rows = run(args.op, number=args.number or 2000, repeats=args.repeats, profile=not args.no_breakdown)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, no-op kernels, median of {args.repeats}")
    print(table(rows))
    if args.json:
        write_json(args.json, {"device": "cpu", **provenance(), "rows": [asdict(r) for r in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
