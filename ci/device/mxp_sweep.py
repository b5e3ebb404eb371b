"""The persistent swapped MXFP4 MoE (``triton_fused_moe_mx_swap_persistent``, branch mxp) against
today's ``triton_fused_moe_mx_swap`` and OpenAI's ``matmul_ogs``, in one device call (~4-6 min
on an H100).

For each token count of ``--tokens`` (default 4096, 512, 1024, 64: the largest gap first, in case
the budget ends the run) the GPT-OSS-120B layer
(``gpt_oss_case``: 128 experts top-4, H = I = 2880, MXFP4, biases, swiglu_oai) is drawn once
and its float64 reference computed once. Then, numerics first: every variant of
:data:`VARIANTS` that applies at that count runs once through its plan (``moe_plan`` with the
kernel as override, then ``plan.apply``) on a NaN-poisoned output, compared with the float64
reference by ``check``'s rule (``tools.tolerances``) and with the swapped kernel's output
(bitwise, else the largest difference over the largest swapped value). Then every variant that
passed is timed as ``bench`` times a planned kernel (the plan made outside the timing, CUDA-graph
replay, L2 flushed, median), and so is ``matmul_ogs+sort`` (``tools.baselines``: OpenAI's two
MoE GEMMs with their routing built inside the timed call, as vLLM runs them on Hopper; carry
``.whl-ogs``). A persistent variant replaces the module-level ``pick_tile`` / ``pick_schedule``
of ``fused_mx_swap_persistent`` (``tiles_sweep._replaced``) while its plan is made, checked and
timed; variants that would run what another already ran at that count are left out. A table
last (us per call, ratios), every row as JSON with ``--json``.

Usage (repository root; the device command of branch mxp, carry ``.whl`` and ``.whl-ogs``)::

    bash ci/device/verify_pending.sh mxp     # GPU tests of the persistent kernel, then this script
    python3 ci/device/mxp_sweep.py [--tokens 4096,512] [--variants swap,persistent] [--budget-s 420] [--json F]

CPU smoke test (a small layer under the Triton interpreter, direct calls, no baseline)::

    python3 ci/device/mxp_sweep.py --device cpu --tokens 5,40   # every variant: ~1 min on 2 cores
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from moe_common import attempt, log
from tiles_sweep import _replaced

from tokenspeed_kernel import config

SWAP = "triton_fused_moe_mx_swap"
PERSISTENT = "triton_fused_moe_mx_swap_persistent"
_MODULE = "tokenspeed_kernel_triton.ops.moe.fused_mx_swap_persistent"
_OGS = "matmul_ogs+sort"


@dataclass(frozen=True)
class Variant:
    """``kernel`` as shipped, or the persistent kernel with ``schedule`` (fields replaced in the
    shipped schedule) and ``tile`` (a ``Tile(block_m, block_n, block_k, group_m, num_warps,
    num_stages)`` replacing the table's), at the token counts ``tokens`` (empty: every one)."""

    name: str
    kernel: str
    schedule: tuple[tuple[str, Any], ...] = ()
    tile: tuple[int, ...] | None = None
    tokens: tuple[int, ...] = ()


# Row 0 is the baseline of the ratios (today's kernel), row 1 the persistent kernel as shipped.
VARIANTS = (
    Variant("swap", SWAP),
    Variant("persistent", PERSISTENT),
    Variant("p-static", PERSISTENT, (("dynamic", False),)),
    Variant("p-dynamic", PERSISTENT, (("dynamic", True),)),
    Variant("p-notail", PERSISTENT, (("tail_m", 0),)),
    Variant("p-tail16", PERSISTENT, (("tail_m", 16),)),
    Variant("p-tail64", PERSISTENT, (("tail_m", 64),), tokens=(4096,)),
    Variant("p-1/sm", PERSISTENT, (("programs_per_sm", 1),), tokens=(64, 512, 1024)),
    Variant("p-2/sm", PERSISTENT, (("programs_per_sm", 2),), tokens=(64,)),  # the table's 3 at T = 64
    Variant("p-4stage", PERSISTENT, tile=(128, 128, 128, 8, 8, 4), tokens=(4096,)),
    # 8 warps: one program per SM fits (at T = 1024 the table's row would give 2)
    Variant("p-64x128", PERSISTENT, (("programs_per_sm", 1),), (64, 128, 128, 8, 8, 3), tokens=(1024, 4096)),
    Variant(  # T = 1024: ~32 rows per expert, so about half the experts fit a 32-row tail
        "p-64x128-t32",
        PERSISTENT,
        (("programs_per_sm", 1), ("tail_m", 32), ("dynamic", True)),
        (64, 128, 128, 8, 8, 3),
        tokens=(1024,),
    ),
)


def _case(tokens: int, dev: torch.device):
    from tokenspeed_kernel.tools.cases import MoECase
    from tokenspeed_kernel.tools.cases.moe import gpt_oss_case

    if dev.type == "cuda":
        return gpt_oss_case(tokens)
    return MoECase("moe.apply", tokens, 160, 96, 8, 2, weight_format="mxfp4", activation="swiglu_oai", bias=True)


def _choice(variant: Variant, case) -> tuple[Any, Any] | None:
    """The (tile, schedule) a persistent variant runs at ``case`` (None for the swapped kernel);
    raises ``ValueError`` when the schedule cannot run with the tile."""
    from tokenspeed_kernel_triton.ops.moe import fused_mx_swap_persistent as persistent
    from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_schedule, pick_tile

    if variant.kernel != PERSISTENT:
        return None
    pairs = case.num_tokens * case.top_k
    tile = Tile(*variant.tile) if variant.tile else pick_tile(pairs, case.num_experts, "cuda", "mxfp4_swap")
    schedule = dataclasses.replace(pick_schedule(pairs, case.num_experts, tile), **dict(variant.schedule))
    persistent.check_schedule(schedule, tile)
    return tile, schedule


@contextlib.contextmanager
def _running(choice: tuple[Any, Any] | None):
    """While inside, the persistent kernel runs ``choice`` (nothing replaced for None)."""
    with contextlib.ExitStack() as stack:
        if choice is not None:
            stack.enter_context(_replaced((_MODULE, "pick_tile"), choice[0], []))
            stack.enter_context(_replaced((_MODULE, "pick_schedule"), choice[1], []))
        yield


def _planned(kernel: str, case, inputs: dict, dev: torch.device):
    """``plan.apply`` of ``kernel``'s plan (``cases.planned_call``); where the selector refuses the
    device (the CPU smoke test), the kernel's ``prepare`` and ``fn`` directly."""
    from tokenspeed_kernel import registry
    from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
    from tokenspeed_kernel.selector import KernelOverrideError
    from tokenspeed_kernel.tools import cases

    try:
        return cases.planned_call(case, inputs, kernel)
    except KernelOverrideError:
        if dev.type == "cuda":
            raise
    spec = registry.get_kernel(kernel)
    prepared = spec.prepare(w13=inputs["w13"], w2=inputs["w2"])
    fields = {k: inputs[k] for k in ("w13", "w2", "activation", "w13_bias", "w2_bias", "expert_map")}

    def run(x, topk_weights, topk_ids, out=None):
        out = torch.empty_like(x) if out is None else out
        spec.fn(MoEApplyArgs(x, topk_weights=topk_weights, topk_ids=topk_ids, out=out, prepared=prepared, **fields))
        return out

    return functools.partial(run, inputs["x"], inputs["topk_weights"], inputs["topk_ids"])


def _numerics(variant: Variant, choice, case, inputs, ref, swap_out, dev) -> tuple[dict, torch.Tensor | None]:
    from tokenspeed_kernel.tools.tolerances import compare, tolerance_for

    with _running(choice):
        run = _planned(variant.kernel, case, inputs, dev)
        out = run(out=torch.full_like(inputs["x"], float("nan")))
    verdict = compare(out, ref, tolerance_for(case))
    row = {"status": "PASS" if verdict.passed else "FAIL", "rel_l2": verdict.rel_l2, "max_abs": verdict.max_abs}
    if verdict.has_nan:
        row["reason"] = "NaN in output (an element never written)"
    if swap_out is not None:
        same = torch.equal(out, swap_out)
        diff = float((out.float() - swap_out.float()).abs().max()) / (float(swap_out.float().abs().max()) + 1e-30)
        row["vs_swap"] = "bitwise" if same else f"{diff:.1e}"
    return row, out


def _time(variant: Variant, choice, case, inputs, dev) -> float:
    from tokenspeed_kernel import registry
    from tokenspeed_kernel.tools.timing import time_fn

    with _running(choice):
        run = _planned(variant.kernel, case, inputs, dev)
        run()
        return time_fn(run, dev, graph=registry.get_kernel(variant.kernel).graph_safe).median_ms


def _baseline(case, inputs, dev) -> dict:
    from tokenspeed_kernel.tools.baselines import baselines_for
    from tokenspeed_kernel.tools.timing import time_fn

    baseline = next(b for b in baselines_for("moe.apply") if b.name == _OGS)
    runner = baseline.prepare(case, inputs, dev)
    if isinstance(runner, str):
        return {"status": "not run", "reason": runner}
    return {"status": "timed", "ms": time_fn(runner, dev).median_ms, "reason": getattr(runner, "note", "")}


def _one_count(
    tokens: int, variants: tuple[Variant, ...], dev: torch.device, start: float, budget_s: float, errors: list
) -> dict:
    from tokenspeed_kernel.tools import cases

    case = _case(tokens, dev)
    log(f"== T={tokens}: {case.describe()}")
    inputs = cases.make_inputs(case, dev, seed=0)
    ref = cases.reference(case, inputs)[0]
    rows: dict[str, dict] = {}
    choices: dict[str, Any] = {}
    outs: dict[str, torch.Tensor] = {}
    ran: dict[str, str] = {}  # what a variant runs -> the first variant that ran it
    for variant in variants:  # numerics first
        if variant.tokens and tokens not in variant.tokens and dev.type == "cuda":
            continue
        if time.monotonic() - start > budget_s:
            rows[variant.name] = {"status": "not run (budget)"}
            continue
        try:
            choice = _choice(variant, case)
        except ValueError as exc:
            rows[variant.name] = {"status": "n/a", "reason": str(exc)}
            continue
        key = f"{variant.kernel} {choice}"
        if key in ran:
            rows[variant.name] = {"status": "same", "reason": f"runs what {ran[key]} runs"}
            continue
        ran[key] = variant.name
        choices[variant.name] = choice
        label = f"T={tokens} {variant.name} numerics"
        got = attempt(
            errors, label, lambda v=variant, c=choice: _numerics(v, c, case, inputs, ref, outs.get("swap"), dev)
        )
        if got is None:
            rows[variant.name] = {"status": "error", "reason": errors[-1]["error"].splitlines()[-1][:160]}
            continue
        rows[variant.name], outs[variant.name] = got
        rows[variant.name]["choice"] = str(choice) if choice else "shipped"
        log(f"  {variant.name:<14} {_numbers(rows[variant.name])}")
    outs.clear()
    for variant in variants:  # then timings, of the variants that passed
        row = rows.get(variant.name)
        if row is None or row["status"] != "PASS":
            continue
        if time.monotonic() - start > budget_s:
            row["status"] = "PASS, not timed (budget)"
            continue
        label = f"T={tokens} {variant.name} timing"
        ms = attempt(errors, label, lambda v=variant: _time(v, choices[v.name], case, inputs, dev))
        if ms is not None:
            row["ms"] = ms
            row["tflops"] = case.flops() / ms / 1e9
            log(f"  {variant.name:<14} {ms * 1e3:9.1f} us  {row['tflops']:6.1f} TFLOP/s")
    if dev.type == "cuda":
        base = attempt(errors, f"T={tokens} {_OGS}", lambda: _baseline(case, inputs, dev))
        rows[_OGS] = base or {"status": "error"}
        if rows[_OGS].get("ms"):
            log(f"  {_OGS:<14} {rows[_OGS]['ms'] * 1e3:9.1f} us  ({rows[_OGS].get('reason', '')})")
        else:
            log(f"  {_OGS:<14} {rows[_OGS].get('reason', rows[_OGS]['status'])}")
    return {"tokens": tokens, "case": case.describe(), "rows": rows}


def _numbers(row: dict) -> str:
    extra = f" vs swap {row['vs_swap']}" if "vs_swap" in row else ""
    return f"{row['status']} rel_l2 {row['rel_l2']:.2e}{extra} {row.get('reason', '')}"


def _table(results: list[dict]) -> str:
    """One row per variant (and ``matmul_ogs+sort``), one column per token count: us per call,
    or why there is no time; then the fastest persistent variant and its ratios (swap time /
    its time, ogs time / its time: above 1 it is faster) and the swapped kernel's against ogs."""
    results = sorted(results, key=lambda r: r["tokens"])
    counts = [f"T={r['tokens']}" for r in results]
    lines = ["", "summary: us per call (CUDA-graph replay, median; plans as bench times them)"]
    lines.append(f"{'':<16}" + "".join(f"{c:>14}" for c in counts))
    for name in [n for n in [v.name for v in VARIANTS] + [_OGS] if any(n in r["rows"] for r in results)]:
        cells = [r["rows"].get(name, {}) for r in results]
        text = [f"{c['ms'] * 1e3:14.1f}" if c.get("ms") else f"{c.get('status', '-')[:13]:>14}" for c in cells]
        lines.append(f"{name:<16}" + "".join(text))
    best, x_swap, x_ogs, swap_ogs = [], [], [], []
    for r in results:
        rows = r["rows"]
        timed = {n: row["ms"] for n, row in rows.items() if row.get("ms") and n not in ("swap", _OGS)}
        name = min(timed, key=timed.__getitem__, default=None)
        swap, ogs = rows.get("swap", {}).get("ms"), rows.get(_OGS, {}).get("ms")
        best.append(f"{name or '-':>14}")
        x_swap.append(f"{swap / timed[name]:14.2f}" if name and swap else f"{'-':>14}")
        x_ogs.append(f"{ogs / timed[name]:14.2f}" if name and ogs else f"{'-':>14}")
        swap_ogs.append(f"{ogs / swap:14.2f}" if swap and ogs else f"{'-':>14}")
    lines.append(f"{'best persistent':<16}" + "".join(best))
    lines.append(f"{'  x swap':<16}" + "".join(x_swap))
    lines.append(f"{'  x ogs':<16}" + "".join(x_ogs))
    lines.append(f"{'swap x ogs':<16}" + "".join(swap_ogs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", default="4096,512,1024,64", help="token counts, run in this order (the largest gap first)"
    )
    parser.add_argument("--variants", help="only these variants (comma-separated names of VARIANTS)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no variant starts after this many seconds")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        config.use_cpu_interpreter()  # before the backends load: the Triton kernels then run on the CPU
    wanted = args.variants.split(",") if args.variants else [v.name for v in VARIANTS]
    unknown = set(wanted) - {v.name for v in VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    variants = tuple(v for v in VARIANTS if v.name in wanted)
    start = time.monotonic()
    errors: list = []
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        result = attempt(
            errors, f"T={tokens}", lambda t=tokens: _one_count(t, variants, dev, start, args.budget_s, errors)
        )
        if result is not None:
            results.append(result)
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the count's inputs, reference and plans are gone
    print(_table(results), flush=True)
    failed = [f"T={r['tokens']} {n}" for r in results for n, row in r["rows"].items() if row.get("status") == "FAIL"]
    if failed or errors:
        print(f"FAILED numerics: {failed}; errors: {[e['case'] for e in errors]}", flush=True)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({**meta, "results": results, "errors": errors}, f, indent=1, default=str)
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
