"""The ``tokenspeed-kernel`` command (also ``python -m tokenspeed_kernel``).

tokenspeed-kernel platform                        the detected (or overridden) platform
tokenspeed-kernel list [OP]                       backends and registered kernels
tokenspeed-kernel explain OP [--preset P] [--case I]
                                                  the selection table for a preset's cases
tokenspeed-kernel check OP|all [--kernel K] [--preset P] [--device D]
                                                  numerics vs the float64 reference (exit 1 on failure)
tokenspeed-kernel bench OP|all [--kernel K|all] [--preset P | --replay FILE] [--json FILE]
                                                  timings, ceilings, same-run baselines
tokenspeed-kernel profile OP [--preset P] [--kernel K] [--out FILE]
                                                  a torch.profiler Chrome trace
"""

from __future__ import annotations

import argparse
import sys

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.operators import OPERATORS
from tokenspeed_kernel.platform import current_platform

__all__ = ["main"]


def _cmd_platform(args: argparse.Namespace) -> int:
    print(current_platform().describe())
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    print(f"platform: {current_platform().describe()}")
    print("backends:")
    for status in registry.backends():
        detail = f": {status.error}" if status.error else f" ({len(status.kernels)} kernels)"
        print(f"  {status.name:<12} {status.state:<9} {status.target}{detail}")
    for op in [args.op] if args.op else list(OPERATORS):
        print(f"\n{op}: {OPERATORS[op].summary}")
        specs = registry.kernels(op)
        if not specs:
            print("  (none)")
        for spec in specs:
            print(f"  {spec.summary()}")
            if spec.description:
                print(f"      {spec.description}")
    return 0


def _cmd_explain(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools import cases
    from tokenspeed_kernel.tools.presets import preset_cases

    found = preset_cases(args.preset, args.op)
    chosen = found if args.case is None else [found[args.case]]
    for case in chosen:
        print(f"== {case.describe()}")
        print(selector.explain(cases.request(case)).table())
        print()
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools.numerics import check

    report = check(args.op, kernel=args.kernel, preset=args.preset, device=args.device, seed=args.seed)
    if not report.passed:
        print("nothing was checked: no kernel could serve these cases", file=sys.stderr)
    return 0 if report.ok else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools.bench import bench

    bench(
        args.op,
        kernel=args.kernel,
        preset=args.preset,
        replay=args.replay,
        json_path=args.json,
        baselines=not args.no_baselines,
        device=args.device,
    )
    return 0


def _cmd_profile(args: argparse.Namespace) -> int:
    from tokenspeed_kernel.tools.profile import profile

    names = profile(args.op, args.out, preset=args.preset, kernel=args.kernel, device=args.device)
    print(f"wrote {args.out} with {len(names)} traced calls:")
    for name in names:
        print(f"  {name}")
    return 0


def _parser() -> argparse.ArgumentParser:
    ops = list(OPERATORS)
    parser = argparse.ArgumentParser(prog="tokenspeed-kernel", description="tokenspeed-kernel tools")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("platform", help="show the platform").set_defaults(fn=_cmd_platform)

    p = sub.add_parser("list", help="backends and registered kernels")
    p.add_argument("op", nargs="?", choices=ops)
    p.set_defaults(fn=_cmd_list)

    p = sub.add_parser("explain", help="why each kernel is (not) selected for a preset's cases")
    p.add_argument("op", choices=ops)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--case", type=int, default=None, help="index of one case of the preset")
    p.set_defaults(fn=_cmd_explain)

    p = sub.add_parser("check", help="numerics against the float64 reference")
    p.add_argument("op", choices=[*ops, "all"])
    p.add_argument("--kernel", default=None, help="one kernel (default: every registered kernel)")
    p.add_argument("--preset", default="small")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_cmd_check)

    p = sub.add_parser("bench", help="timings vs same-run baselines and the device's ceilings")
    p.add_argument("op", choices=[*ops, "all"])
    p.add_argument("--kernel", default=None, help="a kernel name, or 'all' (default: the selector's choice)")
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--replay", default=None, help="a TOKENSPEED_KERNEL_CAPTURE file to benchmark instead of a preset")
    p.add_argument("--json", default=None, help="also write every row as JSON")
    p.add_argument("--no-baselines", action="store_true")
    p.add_argument("--device", default=None)
    p.set_defaults(fn=_cmd_bench)

    p = sub.add_parser("profile", help="write a torch.profiler Chrome trace")
    p.add_argument("op", choices=ops)
    p.add_argument("--preset", default="gpt-oss-120b")
    p.add_argument("--kernel", default=None)
    p.add_argument("--out", default="tokenspeed_kernel_trace.json")
    p.add_argument("--device", default=None)
    p.set_defaults(fn=_cmd_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    return args.fn(args)
