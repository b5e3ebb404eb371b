"""Launch-configuration sweep of the Triton tile tables, one device call (~3-5 min on an H100).

The tables: the attention tiles (``tokenspeed_kernel_triton.ops.attention._launch``:
``CUDA_TILES`` for causal and window-128 prefill and decode) and the MoE GEMM tiles
(``ops.moe._config``: ``triton_fused_moe`` with bf16 weights, ``triton_fused_moe_mx`` and the
opt-in ``triton_fused_moe_mx_swap`` with MXFP4 weights and their K splits). For each point
(a ``gpt-oss-120b`` preset case and a kernel, :data:`POINTS`) the shipped choice is row 0;
every other variant replaces the choice while it runs (the module-level function the kernel
reads its tile from: ``_launch._tile``, ``fused.pick_tile``, ``fused_mx.pick_tile``,
``fused_mx_swap.pick_tile``: both layers, the table's layer-2 tiles included, and
``fused_mx.split_k`` for both MXFP4 kernels). Each is then
checked against the float64 reference exactly as ``tokenspeed-kernel check`` does
(``tools.numerics.check_case``) and, only if it passes, timed exactly as ``bench`` does
(``tools.timing.time_fn``: CUDA-graph replay, L2 flushed, median; the MoE through its plan).
A table last, JSON to ``--json``. The tables' comments cite the sweeps behind the shipped
rows (docs/history.md); change a row only with this script's numbers.

Usage (repository root, our wheels carried as ``.whl`` and installed)::

    python3 ci/device/tiles_sweep.py [--only attention|moe] [--kernel NAME,...] [--budget-s 480] --json $OUT/tiles_sweep.json

CPU smoke test (each point's operator at the ``small`` preset under the Triton interpreter;
the ``tl.dot_scaled`` kernel skips there)::

    python3 ci/device/tiles_sweep.py --device cpu --preset small
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel import config


@dataclass(frozen=True)
class Point:
    """``kernel`` on the ``gpt-oss-120b`` case ``case`` of ``op``; each variant a tile of
    the kernel's table type (and, for the MXFP4 grouped GEMMs, ``splits``: K splits, None =
    the shipped rule)."""

    family: str
    op: str
    case: str
    kernel: str
    variants: tuple[tuple[int, ...], ...]
    splits: tuple[int | None, ...] = (None,)


# Attention Tile(rows, block_n, num_warps, num_stages); MoE Tile(block_m, block_n, block_k,
# group_m, num_warps, num_stages). The variants the sweeps of 2026-11-22/23 tried.
POINTS = (
    Point("attention", "attention.prefill", "prefill_b1_s8192", "triton_prefill",
          ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2))),
    Point("attention", "attention.prefill", "prefill_b1_s8192_win128", "triton_prefill",
          ((64, 16, 4, 2), (128, 32, 8, 2), (128, 32, 4, 2))),
    Point("attention", "attention.decode", "decode_b64_ctx8192", "triton_decode",
          ((16, 32, 4, 2), (16, 64, 4, 2), (16, 128, 4, 3))),
    Point("moe", "moe.apply", "gpt_oss_120b_t8_bf16", "triton_fused_moe",
          ((16, 64, 128, 1, 4, 4), (16, 32, 256, 1, 4, 3), (16, 64, 64, 1, 4, 4))),
    Point("moe", "moe.apply", "gpt_oss_120b_t512_bf16", "triton_fused_moe",
          ((32, 64, 128, 4, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4))),
    Point("moe", "moe.apply", "gpt_oss_120b_t4096_bf16", "triton_fused_moe",
          ((128, 128, 64, 8, 8, 4), (128, 256, 64, 8, 8, 3))),
    Point("moe", "moe.apply", "gpt_oss_120b_t64", "triton_fused_moe_mx",
          ((16, 64, 128, 1, 4, 3), (32, 64, 128, 4, 4, 3), (16, 32, 128, 1, 4, 3)), (None, 1, 2)),
    Point("moe", "moe.apply", "gpt_oss_120b_t512", "triton_fused_moe_mx",
          ((64, 64, 128, 8, 4, 3), (64, 128, 128, 8, 4, 3), (128, 128, 128, 8, 8, 3))),
    Point("moe", "moe.apply", "gpt_oss_120b_t4096", "triton_fused_moe_mx",
          ((128, 128, 128, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 128, 128, 8, 4, 3))),
    # triton_fused_moe_mx_swap (opt-in, issue 21): block_m = token rows, block_n = weight rows,
    # block_k always 128; the table's rows compile for sm_90 without spills (ptxas -v,
    # test_aot_compile_moe.py), the other variants ran on the H100 (2026-11-27 sweeps).
    Point("moe", "moe.apply", "gpt_oss_120b_t1", "triton_fused_moe_mx_swap",
          ((16, 128, 128, 1, 4, 4), (16, 256, 128, 1, 8, 4), (16, 64, 128, 1, 4, 3)), (None, 1, 2, 8)),
    Point("moe", "moe.apply", "gpt_oss_120b_t8", "triton_fused_moe_mx_swap",
          ((16, 128, 128, 1, 4, 4), (16, 256, 128, 1, 8, 4), (16, 64, 128, 1, 4, 3)), (None, 1, 4)),
    Point("moe", "moe.apply", "gpt_oss_120b_t64", "triton_fused_moe_mx_swap",
          ((16, 128, 128, 1, 4, 4), (16, 256, 128, 4, 8, 4), (16, 64, 128, 4, 4, 4))),
    Point("moe", "moe.apply", "gpt_oss_120b_t512", "triton_fused_moe_mx_swap",
          ((16, 256, 128, 4, 8, 4), (32, 128, 128, 8, 4, 3), (64, 128, 128, 8, 4, 4), (32, 64, 128, 8, 4, 4),
           (16, 128, 128, 4, 4, 4))),
    Point("moe", "moe.apply", "gpt_oss_120b_t4096", "triton_fused_moe_mx_swap",
          ((64, 128, 128, 8, 8, 3), (64, 128, 128, 8, 4, 4), (32, 128, 128, 8, 4, 4), (128, 128, 128, 8, 8, 4),
           (128, 64, 128, 8, 4, 4))),
)  # fmt: skip

# Where each kernel reads its tile (and K splits) when it runs: (module, function name).
_TILE_HOOK = {
    "triton_prefill": ("tokenspeed_kernel_triton.ops.attention._launch", "_tile"),
    "triton_decode": ("tokenspeed_kernel_triton.ops.attention._launch", "_tile"),
    "triton_fused_moe": ("tokenspeed_kernel_triton.ops.moe.fused", "pick_tile"),
    "triton_fused_moe_mx": ("tokenspeed_kernel_triton.ops.moe.fused_mx", "pick_tile"),
    "triton_fused_moe_mx_swap": ("tokenspeed_kernel_triton.ops.moe.fused_mx_swap", "pick_tile"),
}
# Both MXFP4 grouped GEMMs take their K splits from fused_mx's rule (fused_mx.split_layer).
_SPLITS_HOOK = {
    name: ("tokenspeed_kernel_triton.ops.moe.fused_mx", "split_k")
    for name in ("triton_fused_moe_mx", "triton_fused_moe_mx_swap")
}
_TILE_TYPE = {
    "attention": ("tokenspeed_kernel_triton.ops.attention._launch", "Tile"),
    "moe": ("tokenspeed_kernel_triton.ops.moe._config", "Tile"),
}


@contextlib.contextmanager
def _replaced(hook: tuple[str, str], value: Any, seen: list) -> Any:
    """While inside, ``module.name(...)`` returns ``value`` (None: what it returns as
    shipped); every value it gave is appended to ``seen``. The functional calls' runner caches
    are emptied on the way in and out (a runner keeps the tile it was bound with)."""
    from tokenspeed_kernel_triton._runners import clear_runners

    clear_runners()
    module = importlib.import_module(hook[0])
    original = getattr(module, hook[1])

    def chosen(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs) if value is None else value
        seen.append(result)
        return result

    setattr(module, hook[1], chosen)
    try:
        yield
    finally:
        setattr(module, hook[1], original)
        clear_runners()


def _case(point: Point, preset: str | None):
    from tokenspeed_kernel.tools.presets import preset_cases

    found = preset_cases(preset or "gpt-oss-120b", point.op)
    named = [case for case in found if case.name == point.case]
    if preset is None and not named:
        raise ValueError(f"preset gpt-oss-120b has no {point.op} case named {point.case!r}")
    return (named or found)[0]


def _variant(point: Point, case, tile: tuple[int, ...] | None, splits: int | None, dev: torch.device) -> dict:
    """Check one variant against float64, then time it if it passed."""
    from tokenspeed_kernel import registry
    from tokenspeed_kernel.tools import cases
    from tokenspeed_kernel.tools.numerics import check_case
    from tokenspeed_kernel.tools.timing import time_fn

    module, name = _TILE_TYPE[point.family]
    value = None if tile is None else getattr(importlib.import_module(module), name)(*tile)
    seen_tiles: list = []
    seen_splits: list = []
    row: dict[str, Any] = {"tile": tile, "splits": splits, "status": "", "rel_l2": None, "ms": None}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_replaced(_TILE_HOOK[point.kernel], value, seen_tiles))
        if point.kernel in _SPLITS_HOOK:
            stack.enter_context(_replaced(_SPLITS_HOOK[point.kernel], splits, seen_splits))
        (check,) = check_case(case, [point.kernel], dev, seed=0)
        row.update(status=check.status, rel_l2=check.rel_l2, reason=check.reason)
        if seen_tiles:  # the swapped kernel asks for each layer's tile (its table may give layer 2 its own)
            row["ran_tile"] = " | ".join(dict.fromkeys(map(str, seen_tiles)))
        if seen_splits:
            row["ran_splits"] = seen_splits[-1]
        if not check.passed:
            return row
        inputs = cases.make_inputs(case, dev, seed=0)
        spec = registry.get_kernel(point.kernel)
        run = (
            cases.planned_call(case, inputs, point.kernel)
            if spec.prepare is not None
            else functools.partial(cases.call, case, inputs, override=point.kernel)
        )
        run()
        timing = time_fn(run, dev, graph=spec.graph_safe)
    row.update(ms=timing.median_ms, tflops=case.flops() / timing.median_ms / 1e9, graph=timing.graph)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("attention", "moe"), help="one family of tables")
    parser.add_argument("--kernel", help="only the points of these kernels (comma-separated)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", help="another preset (its first case of each point's operator): small on a CPU")
    parser.add_argument("--budget-s", type=float, default=480.0, help="no variant starts after this many seconds")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        config.use_cpu_interpreter()  # before the backends load: the Triton kernels then run on the CPU
    start = time.monotonic()
    results = []
    for point in POINTS:
        wanted = args.kernel.split(",") if args.kernel else [point.kernel]
        if (args.only and point.family != args.only) or point.kernel not in wanted:
            continue
        case = _case(point, args.preset)
        print(f"== {point.kernel}: {case.describe()}", flush=True)
        variants = [(None, None)] + [(tile, None) for tile in point.variants]
        variants += [(None, splits) for splits in point.splits if splits is not None]
        rows = []
        for tile, splits in variants:
            if time.monotonic() - start > args.budget_s:
                rows.append({"tile": tile, "splits": splits, "status": "not run (budget)"})
                continue
            try:
                row = _variant(point, case, tile, splits, dev)
            except Exception as exc:  # one variant's failure (e.g. out of shared memory) must not end the run
                row = {"tile": tile, "splits": splits, "status": f"error: {type(exc).__name__}: {str(exc)[:120]}"}
            rows.append(row)
            print(f"  {_line(row, rows[0])}", flush=True)
        results.append({**dataclasses.asdict(point), "case_describe": case.describe(), "rows": rows})
    print("\nsummary (shipped = row 0 of each point; ratio = shipped ms / variant ms, above 1: the variant is faster)")
    for result in results:
        best = min((r for r in result["rows"] if r.get("ms")), key=lambda r: r["ms"], default=None)
        shipped = result["rows"][0]
        print(f"  {result['kernel']:<20} {result['case']:<26} shipped {_ms(shipped)}  best {_line(best, shipped)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": str(dev), "torch": torch.__version__, "points": results}, f, indent=1)
    return 0


def _ms(row: dict | None) -> str:
    return f"{row['ms'] * 1e3:8.1f} us" if row and row.get("ms") else f"{'-':>11}"


def _line(row: dict | None, shipped: dict) -> str:
    if row is None:
        return "none timed"
    what = "shipped" if row["tile"] is None and row["splits"] is None else f"tile={row['tile']} splits={row['splits']}"
    # the shipped choice, as the kernel read it (a variant's tile is the one named)
    ran = f" ({row.get('ran_tile', '?')}, splits {row.get('ran_splits', '-')})" if row["tile"] is None else ""
    ratio = f"  {shipped['ms'] / row['ms']:.2f}x" if row.get("ms") and shipped.get("ms") else ""
    err = f" rel_l2 {row['rel_l2']:.1e}" if row.get("ms") else f" {row.get('reason', '')}"
    return f"{_ms(row)} {row['status']:<5}{err} {what}{ran}{ratio}"


if __name__ == "__main__":
    sys.exit(main())
