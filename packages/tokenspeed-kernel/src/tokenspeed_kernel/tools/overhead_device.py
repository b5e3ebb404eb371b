"""``overhead --device cuda``: the host cost of one eager public call with the real kernels.

The CPU mode (:mod:`tokenspeed_kernel.tools.overhead`) times the core alone, behind no-op
kernels. This mode times what an engine pays on a GPU host: every public operator (and
``DecodePlan.run`` / ``MoEPlan.apply``) served by the kernel the selector picks, at
GPT-OSS-120B's attention layout (64 query heads, 8 KV heads, head dim 64, bf16, sinks) and a
small MoE, with the tensors on the GPU. Beside them, in the same process: torch's eager
``scaled_dot_product_attention`` at the decode shape and a small ``torch.matmul``, the
baselines the targets are stated against. After them, per functional call: ``NAME
(portable)``, the call forced onto its portable kernel where the pick is another one, and
``NAME (KERNEL)`` per opt-in kernel that accepts the call on this GPU; the same rows for
``MoEPlan.apply`` (bf16 weights), its plan made with ``override=`` the kernel (e.g.
``MoEPlan.apply (triton_moe_gemv)``: the plan's two bound GEMV launches).

**Host µs per call**: ``number`` back-to-back calls, timed on the host clock *before* the
closing synchronize, divided by ``number``; the median of ``repeats`` runs. The problems are
tiny, so the GPU drains its queue faster than the host fills it and the figure is the host's
own work per call: validation, selection, allocation, argument binding and every launch.
``wall`` (after the synchronize) is printed too; a wall far above host means the GPU, not the
host, bounded the run. The breakdown adds ``kernel`` (code outside the core, torch and the
standard library: the backend wheel's launch code and its compiler's runtime, argument
binding and launcher) to the CPU mode's categories.

    tokenspeed-kernel overhead --device cuda [--op OP] [--top 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools.overhead import (
    CATEGORIES,
    FUNCTIONAL_CALLS,
    PLAN_CALLS,
    OverheadCase,
    baselines,
    cases,
    profile_calls,
    shares,
)

__all__ = ["DeviceRow", "measure_device", "run_device"]


@dataclass(frozen=True)
class DeviceRow:
    """Host and wall µs per eager call of one case, and the kernel that served it."""

    name: str
    op: str
    kernel: str
    host_us: float
    wall_us: float
    breakdown_us: dict[str, float]
    top: str = ""  # with ``top``: the slowest functions of the profiled run, as text


def _host_and_wall(call: Callable[[], object], device: torch.device, number: int) -> tuple[float, float]:
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    return host / number * 1e6, wall / number * 1e6


def measure_device(
    case: OverheadCase,
    device: torch.device,
    *,
    number: int = 300,
    repeats: int = 7,
    profile: bool = True,
    top: int = 0,
) -> DeviceRow:
    """Host and wall µs per call of ``case`` (medians over ``repeats`` runs of ``number``);
    one cProfile run of ``number`` calls gives the breakdown and (``top``) the slowest functions."""
    call = case.make(device)
    for _ in range(20):  # warm: compilation, selection cache, allocator
        call()
    kernel = (last_kernel() or "?") if case.op != "torch" else "torch"
    runs = [_host_and_wall(call, device, number) for _ in range(repeats)]
    host = statistics.median(r[0] for r in runs)
    wall = statistics.median(r[1] for r in runs)
    profiler = profile_calls(call, number) if (profile or top) and case.op != "torch" else None
    torch.cuda.synchronize(device)
    split = shares(profiler) if profile and profiler is not None else {}
    slowest = _top_text(profiler, top) if top and profiler is not None else ""
    return DeviceRow(case.name, case.op, kernel, host, wall, {k: s * host for k, s in split.items()}, slowest)


def _top_text(profiler: cProfile.Profile, top: int) -> str:
    """The ``top`` functions of ``profiler``'s run by self time, as pstats prints them."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue()
    return body[body.find("ncalls") :] if "ncalls" in body else body


def _accepted(case: OverheadCase, device: torch.device) -> tuple[str, list] | None:
    """(the selector's pick, the accepted candidates' specs) for ``case``'s request on this
    platform, or None when the call recorded no request or nothing serves it."""
    from tokenspeed_kernel.ops._dispatch import last_request
    from tokenspeed_kernel.selector import explain

    case.make(device)()
    request = last_request()
    if request is None:
        return None
    selection = explain(request)
    if selection.winner is None:
        return None
    return selection.winner.name, [c.spec for c in selection.candidates if c.accepted]


def _portable_kernel(winner: str, accepted: list) -> str | None:
    """The best accepted kernel of the portable band, when the selector picks another one."""
    from tokenspeed_kernel.registry import Priority

    portable = [spec for spec in accepted if Priority.PORTABLE <= spec.priority < Priority.PERFORMANT]
    if not portable:
        return None
    best = max(portable, key=lambda spec: spec.priority)
    return None if best.name == winner else best.name


def _opt_in_kernels(winner: str, accepted: list) -> list[str]:
    """The accepted kernels of the opt-in band that the selector does not pick, by name."""
    from tokenspeed_kernel.registry import Priority

    band = [spec.name for spec in accepted if Priority.OPT_IN <= spec.priority < Priority.PORTABLE]
    return sorted(name for name in band if name != winner)


def portable_cases(chosen: list[OverheadCase], device: torch.device) -> tuple[OverheadCase, ...]:
    """For each functional call among ``chosen`` whose pick on this GPU is not its portable
    kernel: the same call with ``override=`` that kernel (``NAME (portable)``), the host cost
    a GPU without the faster kernel pays (an sm_90 host measures both); and one ``NAME
    (KERNEL)`` row per opt-in kernel that accepts the call here and is not the pick (the host
    cost of naming it by ``override=``). A plan's step among ``chosen`` (``PLAN_CALLS``) gets
    the rows of the functional call with its inputs, the plan made with ``override=``."""
    extra = []
    for case in chosen:
        make = FUNCTIONAL_CALLS.get(case.name)
        twin = case
        if case.name in PLAN_CALLS:
            functional, make = PLAN_CALLS[case.name]
            twin = OverheadCase(functional, case.op, FUNCTIONAL_CALLS[functional])
        if make is None:
            continue
        found = _accepted(twin, device)
        if found is None:
            continue
        portable = _portable_kernel(*found)
        names = ([("portable", portable)] if portable else []) + [(name, name) for name in _opt_in_kernels(*found)]
        for label, kernel in names:
            extra.append(OverheadCase(f"{case.name} ({label})", case.op, functools.partial(make, override=kernel)))
    return tuple(extra)


def run_device(
    device: torch.device,
    ops: list[str] | None = None,
    *,
    number: int = 300,
    repeats: int = 7,
    profile: bool = True,
    top: int = 0,
) -> list[DeviceRow]:
    """Measure the baselines, then every case (of ``ops``, or all), then
    :func:`portable_cases` of those, on ``device``."""
    chosen = [c for c in cases() if ops is None or c.op in ops]
    return [
        measure_device(c, device, number=number, repeats=repeats, profile=profile, top=top)
        for c in baselines() + tuple(chosen) + portable_cases(chosen, device)
    ]


def device_table(rows: list[DeviceRow]) -> str:
    """One line per row: host and wall µs, host over torch SDPA's, the breakdown."""
    sdpa = next((r.host_us for r in rows if r.name.startswith("torch SDPA")), float("nan"))
    head = f"{'call':<26} {'kernel':<24} {'host µs':>8} {'wall µs':>8} {'×SDPA':>6}  " + " ".join(
        f"{c:>10}" for c in CATEGORIES
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        parts = " ".join(f"{r.breakdown_us[c]:>10.2f}" if r.breakdown_us else f"{'':>10}" for c in CATEGORIES)
        lines.append(
            f"{r.name:<26} {r.kernel[:24]:<24} {r.host_us:>8.1f} {r.wall_us:>8.1f} {r.host_us / sdpa:>6.2f}  {parts}"
        )
    return "\n".join(lines)


def run_device_cli(args: argparse.Namespace) -> int:
    """``tokenspeed-kernel overhead --device cuda``: the table, then (``--top N``) profiles."""
    import sys
    from dataclasses import asdict

    from tokenspeed_kernel.tools.common import provenance, write_json

    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"overhead --device {args.device}: no CUDA device here (the CPU mode needs no GPU)", file=sys.stderr)
        return 2
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    number = args.number or 300
    rows = run_device(device, args.op, number=number, repeats=args.repeats, profile=not args.no_breakdown, top=args.top)
    for row in rows:
        if row.top:
            print(f"== {row.name}: top {args.top} functions by self time over {number} calls")
            print(row.top)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, python {sys.version.split()[0]}: host µs "
        f"per eager call, {number} calls per run, median of {args.repeats}"
    )
    print(device_table(rows))
    if args.json:
        write_json(
            args.json, {"device": torch.cuda.get_device_name(device), **provenance(), "rows": [asdict(r) for r in rows]}
        )
    return 0
