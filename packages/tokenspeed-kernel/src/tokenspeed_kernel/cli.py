"""The ``tokenspeed-kernel`` command (also ``python -m tokenspeed_kernel``).

tokenspeed-kernel platform                        the detected (or overridden) platform
tokenspeed-kernel list [OP] [--json FILE]         backends and registered kernels
tokenspeed-kernel explain OP [--preset P] [--case-index I] [--platform ARCH] [--capturable] [--json FILE]
                                                  the selection table for a preset's cases
tokenspeed-kernel explain OP [--dtype D|ROLE=D,...] [--head-dim N] [--shape KEY=N ...]
                             [--features F,...] [--platform ARCH] [--capturable]
                                                  the selection table for a request spelled out
                                                  (--capturable: for CUDA-graph capture)
tokenspeed-kernel check OP|all [--kernel K] [--preset P] [--seed S] [--case ID] [--device D] [--json FILE]
                                                  numerics vs the float64 reference on cases derived from
                                                  each kernel's registration (or a preset's), with the
                                                  claims coverage (exit 1 on failure)
tokenspeed-kernel bench OP|all [--kernel K[,K...]|all] [--preset P | --replay FILE] [--json FILE]
                                                  timings, ceilings, same-run baselines
tokenspeed-kernel bench --suite NAME [--preset P] [--budget-s S] [--json FILE] [--plot FILE.png]
                                                  a named suite: check vs float64, then time each case
tokenspeed-kernel bench --plot FILE.png --from-json FILE
                                                  the chart of a saved suite run (its --json)
tokenspeed-kernel profile OP [--preset P] [--kernel K] [--out FILE] [--device D]
                                                  a torch.profiler Chrome trace
tokenspeed-kernel overhead [--op OP ...] [--device cuda] [--top N] [--json FILE]
                                                  host µs per eager public call (no-op kernels; real ones on a GPU)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import torch

from tokenspeed_kernel import config, registry, selector
from tokenspeed_kernel.operators import OPERATORS, operator_schema
from tokenspeed_kernel.ops._checks import dtype_name
from tokenspeed_kernel.platform import KNOWN_ARCHS, Platform, current_platform, platform_from_arch
from tokenspeed_kernel.registry import KernelSpec, Request
from tokenspeed_kernel.selector import NoKernelFoundError
from tokenspeed_kernel.tools.claims import DERIVED
from tokenspeed_kernel.tools.common import resolve_device, write_json
from tokenspeed_kernel.tools.overhead import add_arguments as overhead_arguments

__all__ = ["main"]


def _cmd_platform(args: argparse.Namespace) -> int:
    print(current_platform().describe())
    return 0


def _platform_json(platform: Platform) -> dict[str, Any]:
    return {
        **dataclasses.asdict(platform),
        "capabilities": sorted(platform.capabilities),
        "describe": platform.describe(),
    }


def _spec_json(spec: KernelSpec) -> dict[str, Any]:
    """One kernel's registration metadata as JSON values (the fields ``list`` prints)."""
    return {
        "name": spec.name,
        "op": spec.op,
        "solution": spec.solution,
        "backend": spec.backend,
        "priority": spec.priority,
        "band": spec.band.name.lower(),
        "ranks": spec.describe_rank() or None,
        "vendors": sorted(spec.vendors),
        "archs": sorted(spec.archs) if spec.archs is not None else None,
        "capabilities": sorted(spec.capabilities),
        "vendor_capabilities": {vendor: sorted(tags) for vendor, tags in spec.vendor_capabilities},
        "dtypes": {role: sorted(map(dtype_name, dtypes)) for role, dtypes in spec.dtypes},
        "shapes": {key: sorted(values) for key, values in spec.shapes},
        "features": sorted(spec.features),
        "graph_safe": spec.graph_safe,
        "unseen_safe": spec.unseen_safe,
        "hooks": list(spec.hooks()),
        "description": spec.description,
    }


def _cmd_list(args: argparse.Namespace) -> int:
    platform = current_platform()
    statuses = registry.backends()
    ops = [args.op] if args.op else list(OPERATORS)
    print(f"platform: {platform.describe()}")
    print("backends:")
    for status in statuses:
        detail = f": {status.error}" if status.error else f" ({len(status.kernels)} kernels)"
        print(f"  {status.name:<12} {status.state:<9} {status.target}{detail}")
    for op in ops:
        print(f"\n{op}: {OPERATORS[op].summary}")
        specs = registry.kernels(op)
        if not specs:
            print("  (none)")
        for spec in specs:
            print(f"  {spec.summary()}")
            if spec.description:
                print(f"      {spec.description}")
    if args.json:
        write_json(
            args.json,
            {
                "platform": _platform_json(platform),
                "backends": [dataclasses.asdict(status) for status in statuses],
                "operators": {
                    op: {"summary": OPERATORS[op].summary, "kernels": [_spec_json(s) for s in registry.kernels(op)]}
                    for op in ops
                },
            },
        )
    return 0


_DTYPES: dict[str, torch.dtype] = {
    **{name: dtype for dtype, names in (
        (torch.bfloat16, ("bf16", "bfloat16")),
        (torch.float16, ("fp16", "float16", "half")),
        (torch.float32, ("fp32", "float32", "float")),
        (torch.float64, ("fp64", "float64", "double")),
        (torch.float8_e4m3fn, ("fp8", "float8_e4m3fn", "e4m3")),
        (torch.uint8, ("uint8", "mxfp4")),
    ) for name in names},
}  # fmt: skip


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(f"--dtype: unknown dtype {name!r}; known: {', '.join(_DTYPES)}") from None


def _pairs(flag: str, items: list[str]) -> dict[str, str]:
    """``["a=1,b=2", "c=3"]`` -> ``{"a": "1", "b": "2", "c": "3"}``."""
    out = {}
    for item in (part for chunk in items for part in chunk.split(",") if part.strip()):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _int(flag: str, key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{flag}: {key}={value!r} is not an integer") from None


def _request_from_flags(args: argparse.Namespace) -> Request:
    """The request spelled out by ``--dtype/--head-dim/--shape/--features`` (checked against
    the operator's vocabulary). A bare ``--dtype D`` applies to every dtype role."""
    schema = operator_schema(args.op)
    dtypes: dict[str, torch.dtype] = {}
    for spec in args.dtype:
        if "=" in spec:
            dtypes.update({role: _dtype(name) for role, name in _pairs("--dtype", [spec]).items()})
        else:
            dtypes.update(dict.fromkeys(schema.dtype_roles, _dtype(spec)))
    shapes = {key: _int("--shape", key, value) for key, value in _pairs("--shape", args.shape).items()}
    if args.head_dim is not None:
        shapes["head_dim"] = args.head_dim
    features = {f.strip() for chunk in args.features for f in chunk.split(",") if f.strip()}
    checks = (
        ("dtype role", set(dtypes), schema.dtype_roles),
        ("shape key", set(shapes), schema.shape_keys),
        ("feature", features, schema.features),
    )
    for what, given, known in checks:
        unknown = sorted(given - set(known))
        if unknown:
            raise ValueError(f"{args.op}: unknown {what} {unknown}; expected some of {', '.join(known)}")
    return Request.make(args.op, dtypes, shapes, features, args.capturable)


def _cmd_explain(args: argparse.Namespace) -> int:
    platform = platform_from_arch(args.platform) if args.platform else None
    if args.dtype or args.shape or args.features or args.head_dim is not None:
        if args.preset is not None or args.case_index is not None:
            raise ValueError("explain: give either --preset/--case-index or --dtype/--head-dim/--shape/--features")
        selection = selector.explain(_request_from_flags(args), platform=platform)
        print(selection.table())
        if args.json:
            write_json(args.json, {"op": args.op, "preset": None, "selections": [_selection_json(selection, None)]})
        return 0

    from tokenspeed_kernel.tools import cases
    from tokenspeed_kernel.tools.presets import preset_cases

    found = preset_cases(args.preset or "gpt-oss-120b", args.op)
    if args.case_index is not None and not -len(found) <= args.case_index < len(found):
        raise ValueError(f"--case-index {args.case_index}: the preset has {len(found)} cases for {args.op}")
    chosen = found if args.case_index is None else [found[args.case_index]]
    selections = []
    for case in chosen:
        print(f"== {case.describe()}")
        request = dataclasses.replace(cases.request(case), capturable=args.capturable)
        selection = selector.explain(request, platform=platform)
        print(selection.table())
        print()
        selections.append(_selection_json(selection, case.describe()))
    if args.json:
        write_json(args.json, {"op": args.op, "preset": args.preset or "gpt-oss-120b", "selections": selections})
    return 0


def _selection_json(selection: selector.Selection, case: str | None) -> dict[str, Any]:
    """One ``explain`` verdict as JSON values: the request, the platform, every candidate
    with its reasons, the winner (None when no kernel can serve the request)."""
    request = selection.request
    return {
        "case": case,
        "request": {
            "op": request.op,
            "dtypes": {role: dtype_name(dtype) for role, dtype in request.dtypes},
            "shapes": dict(request.shapes),
            "features": sorted(request.features),
            "capturable": request.capturable,
        },
        "platform": selection.platform.describe(),
        "override": selection.override,
        "winner": selection.winner.name if selection.winner is not None else None,
        "tie_break": dataclasses.asdict(selection.tie_break) if selection.tie_break is not None else None,
        "candidates": [
            {
                "kernel": c.spec.name,
                "solution": c.spec.solution,
                "priority": c.spec.priority_for(request),
                "accepted": c.accepted,
                "graph_safe": c.spec.graph_safe,
                "reasons": list(c.reasons),
            }
            for c in selection.candidates
        ],
    }


def _cmd_check(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools.numerics import check

    if args.interpreting:
        print(f"tokenspeed-kernel check: {config.INTERPRETER_NOTE}", file=sys.stderr)
    report = check(args.op, kernel=args.kernel, preset=args.preset, device=args.device, seed=args.seed, case=args.case)
    if args.json:
        write_json(args.json, report.to_json())
    if not report.passed:
        why = "no kernel could run here" if args.preset == DERIVED else "no kernel could serve these cases"
        print(f"nothing was checked: {why}", file=sys.stderr)
    return 0 if report.ok else 1


_SERVING_PRESET = "gpt-oss-120b"
_CPU_PRESET = "small"


def _timing_preset(args: argparse.Namespace) -> str:
    """The preset ``bench``/``profile`` run: the one given; else the serving sizes on a GPU
    and the small preset on a CPU (the serving sizes would run for many minutes there and
    time nothing a GPU would see)."""
    if args.preset is not None:
        return args.preset
    return _SERVING_PRESET if resolve_device(args.device).type != "cpu" else _CPU_PRESET


def _note_cpu_preset(args: argparse.Namespace, verb: str) -> None:
    """After a run that took the CPU's default preset, say so on stderr (after, so that a
    usage error stays the only line)."""
    if args.preset is None and _timing_preset(args) == _CPU_PRESET:
        print(
            f"tokenspeed-kernel {args.command}: on the CPU without --preset: {verb} the {_CPU_PRESET} preset "
            f"(--preset {_SERVING_PRESET} for the serving sizes)",
            file=sys.stderr,
        )


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.from_json is not None:
        if args.plot is None or args.suite is not None or args.op is not None:
            raise ValueError("--from-json FILE goes with --plot FILE.png only (it redraws a saved suite run)")
        from tokenspeed_kernel.tools.suites import plot_json

        plot_json(args.from_json, args.plot)
        print(f"wrote plot to {os.path.abspath(args.plot)}", file=sys.stderr)
        return 0
    if args.suite is not None:
        from tokenspeed_kernel.tools.suites import run_cli

        return run_cli(args)
    if args.op is None:
        raise ValueError("give an operator (or all), or --suite NAME")
    if args.plot is not None or args.budget_s is not None:
        raise ValueError("--plot and --budget-s go with --suite")
    from tokenspeed_kernel.tools.bench import bench

    bench(
        args.op,
        kernel=args.kernel,
        preset=_timing_preset(args),
        replay=args.replay,
        json_path=args.json,
        baselines=not args.no_baselines,
        device=args.device,
    )
    if args.replay is None:
        _note_cpu_preset(args, "timed")
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools.profile import profile

    names = profile(args.op, args.out, preset=_timing_preset(args), kernel=args.kernel, device=args.device)
    print(f"wrote {args.out} with {len(names)} traced calls:")
    for name in names:
        print(f"  {name}")
    _note_cpu_preset(args, "traced")
    return 0


def _cmd_overhead(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools.overhead import run_cli

    return run_cli(args)


def _parser() -> argparse.ArgumentParser:
    from tokenspeed_kernel.tools.presets import PRESETS
    from tokenspeed_kernel.tools.suites import PLOT_INSTALL, SUITES

    ops = list(OPERATORS)
    presets = ", ".join(PRESETS)
    device_help = "cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    parser = argparse.ArgumentParser(prog="tokenspeed-kernel", description="tokenspeed-kernel tools")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("platform", help="show the platform").set_defaults(fn=_cmd_platform)

    p = sub.add_parser("list", help="backends and registered kernels")
    p.add_argument("op", nargs="?", choices=ops)
    p.add_argument("--json", default=None, metavar="FILE", help="also write the platform, backends and kernels as JSON")
    p.set_defaults(fn=_cmd_list)

    p = sub.add_parser("explain", help="why each kernel is (not) selected for a preset's cases or a request")
    p.add_argument("op", choices=ops)
    p.add_argument("--preset", default=None, help=f"cases to explain: {presets} (default: gpt-oss-120b)")
    p.add_argument("--case-index", "--case", dest="case_index", type=int, default=None, help="one case of the preset")
    p.add_argument("--dtype", action="append", default=[], help="DTYPE for every role, or ROLE=DTYPE[,...]")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--shape", action="append", default=[], help="KEY=N[,...], e.g. page_size=16,num_q_heads=64")
    p.add_argument("--features", action="append", default=[], help="comma-separated, e.g. sinks,sliding_window")
    p.add_argument("--platform", default=None, choices=sorted(KNOWN_ARCHS), help="answer for another platform")
    p.add_argument(
        "--capturable", action="store_true", help="the call is captured in a CUDA graph: graph-safe kernels only"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write every verdict as JSON")
    p.set_defaults(fn=_cmd_explain)

    p = sub.add_parser("check", help="numerics against the float64 reference, and the claims coverage")
    p.add_argument("op", choices=[*ops, "all"])
    p.add_argument(
        "--kernel", default=None, help="one kernel (default: every registered kernel; with all: on its own operator)"
    )
    p.add_argument(
        "--preset",
        default=DERIVED,
        help=f"cases to check: {DERIVED} (each kernel's own, from its registration), {presets} (default: %(default)s)",
    )
    p.add_argument("--device", default=None, help=device_help)
    p.add_argument(
        "--json", default=None, metavar="FILE", help="also write every row (PASS/FAIL/SKIP) and claim as JSON"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the derived cases and of the random inputs (default: %(default)s)"
    )
    p.add_argument(
        "--case",
        default=None,
        metavar="ID",
        help="one derived case of --kernel, by the id its row shows (a failure's reproduce line)",
    )
    p.set_defaults(fn=_cmd_check)

    p = sub.add_parser("bench", help="timings vs same-run baselines and the device's ceilings")
    p.add_argument("op", nargs="?", choices=[*ops, "all"], help="the operator, or all (not with --suite)")
    p.add_argument(
        "--kernel",
        default=None,
        help="a kernel name, several comma-separated, or 'all' (default: the selector's choice)",
    )
    p.add_argument(
        "--preset",
        default=None,
        help=f"cases to time: {presets} (default: {_SERVING_PRESET}; {_CPU_PRESET} on a CPU); "
        "with --suite: replaces each entry's preset",
    )
    p.add_argument("--replay", default=None, help="a TOKENSPEED_KERNEL_CAPTURE file to benchmark instead of a preset")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every row as JSON")
    p.add_argument("--no-baselines", action="store_true", help="time the kernels only, not the torch baselines")
    p.add_argument("--device", default=None, help=device_help)
    p.add_argument(
        "--suite",
        default=None,
        metavar="NAME",
        help=f"run a named suite, each case checked against float64 first: {', '.join(SUITES)} "
        "(--kernel then takes pick, peers or all)",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, metavar="S", help="with --suite: start no case that would end after S s"
    )
    p.add_argument(
        "--plot", default=None, metavar="FILE.png", help=f"with --suite: a bar chart of the speedups ({PLOT_INSTALL})"
    )
    p.add_argument(
        "--from-json",
        default=None,
        metavar="FILE",
        help="with --plot only: draw the chart of a saved suite run (its --json) instead of running",
    )
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("profile", help="write a torch.profiler Chrome trace")
    p.add_argument("op", choices=ops)
    p.add_argument(
        "--preset", default=None, help=f"cases to trace: {presets} (default: {_SERVING_PRESET}; {_CPU_PRESET} on a CPU)"
    )
    p.add_argument("--kernel", default=None, help="one kernel of OP (default: the selector's choice per case)")
    p.add_argument(
        "--out",
        default="tokenspeed_kernel_trace.json",
        metavar="FILE",
        help="the trace to write (default: %(default)s)",
    )
    p.add_argument("--device", default=None, help=device_help)
    p.set_defaults(fn=_cmd_profile)

    p = sub.add_parser(
        "overhead", help="host µs per eager public call: no-op kernels on CPU, or the real kernels with --device cuda"
    )
    overhead_arguments(p)
    p.set_defaults(fn=_cmd_overhead)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 a check failed, 2 a usage error:
    a bad argument, an unknown kernel, preset or device, an invalid TOKENSPEED_KERNEL_OVERRIDE,
    a kernel that cannot serve the request)."""
    args = _parser().parse_args(argv)
    # Without a GPU, `check` runs the kernels that have a CPU interpreter under it; the switch
    # must be set before the backends load (the override check below may load them).
    args.interpreting = args.command == "check" and not registry.backends_loaded() and config.use_cpu_interpreter()
    try:
        selector.env_overrides()  # an invalid TOKENSPEED_KERNEL_OVERRIDE fails every command alike
        if getattr(args, "device", None) is not None:
            resolve_device(args.device)
        return args.fn(args)
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, NoKernelFoundError, OSError) as exc:
        print(f"tokenspeed-kernel {args.command}: error: {exc}", file=sys.stderr)
        return 2
