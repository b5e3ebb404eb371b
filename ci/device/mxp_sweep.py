"""The swapped MXFP4 MoE's launch choices and opt-in levers against the shipped kernels and
OpenAI's ``matmul_ogs``, in one device call: the persistent kernel's schedules (group ``mxp``,
branch mxp: ~4-6 min on an H100) and the levers of issue 21's gaps (group ``levers``: tile, stage,
warp and per-layer variants of ``triton_fused_moe_mx_swap`` at T = 64 and 1024, layer-2 TMA and
bf16 pair rows of ``triton_fused_moe_mx_swap_persistent`` at T = 4096, T = 512 a control).

For each token count of ``--tokens`` (default 4096, 512, 1024, 64: the largest gap first, in case
the budget ends the run) the GPT-OSS-120B layer
(``gpt_oss_case``: 128 experts top-4, H = I = 2880, MXFP4, biases, swiglu_oai) is drawn once
and its float64 reference computed once. Then, numerics first: every variant of
:data:`VARIANTS` in the chosen ``--group`` that applies at that count runs once through its plan
(``moe_plan`` with the kernel as override, then ``plan.apply``) on a NaN-poisoned output, compared
with the float64 reference by ``check``'s rule (``tools.tolerances``) and with the swapped
kernel's output (bitwise, else the largest difference over the largest swapped value). Then every
variant that passed is timed as ``bench`` times a planned kernel (the plan made outside the
timing, CUDA-graph replay, L2 flushed, median), and so is ``matmul_ogs+sort``
(``tools.baselines``: OpenAI's two MoE GEMMs with their routing built inside the timed call, as
vLLM runs them on Hopper; carry ``.whl-ogs``). With ``--breakdown`` the two shipped rows
(``swap``, ``persistent``) are also timed per layer: each layer's launches replayed alone (the
persistent kernel's work counters zeroed first, a 2-int memset), the rest (permutation, combine)
the full call minus both.

A variant replaces, while its plan is made, checked and timed, what the kernel reads when it
binds (``tiles_sweep._replaced``): the swapped kernel's ``pick_tile`` (both layers: the
replacement answers ``layer=2`` too, so the table's layer-2 tile is not used), the persistent kernel's
``pick_tile`` / ``pick_schedule`` (a :class:`Schedule`'s fields, ``w2_tma`` included), and for
layer 2 alone (``Variant.w2``) ``fused_mx.split_launches`` (layer 2's tile, same token rows, or
its K splits) and ``fused_mx.layer_output`` (layer 2's per-pair rows in bf16 instead of float32:
half the bytes the combine reads). Variants that would run what another already ran at that
count are left out. A table last (us per call, the shipped kernel at each count and the best
variant, ratios), every row as JSON with ``--json``.

Usage (repository root; carry ``.whl`` and ``.whl-ogs``)::

    bash ci/device/verify_pending.sh mxp     # GPU tests of the persistent kernel, then this script
    python3 ci/device/mxp_sweep.py [--group mxp|levers|all] [--tokens 4096,512] [--variants swap,persistent]
        [--breakdown] [--budget-s 420] [--json F]

The levers call (ci/device/README.md, pending item s)::

    python3 ci/device/mxp_sweep.py --group levers --tokens 64,1024,4096,512 --breakdown --budget-s 450 --json $OUT/mxlever.json

CPU smoke test (a small layer under the Triton interpreter, direct calls, no baseline)::

    python3 ci/device/mxp_sweep.py --device cpu --tokens 5,40   # every variant: ~1 min on 2 cores
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
from moe_common import attempt, log
from tiles_sweep import _replaced

from tokenspeed_kernel import config

SWAP = "triton_fused_moe_mx_swap"
PERSISTENT = "triton_fused_moe_mx_swap_persistent"
_MODULE = "tokenspeed_kernel_triton.ops.moe.fused_mx_swap_persistent"
_SWAP_MODULE = "tokenspeed_kernel_triton.ops.moe.fused_mx_swap"
_MX_MODULE = "tokenspeed_kernel_triton.ops.moe.fused_mx"
_OGS = "matmul_ogs+sort"


@dataclass(frozen=True)
class Variant:
    """``kernel`` as shipped, or with ``tile`` (a ``Tile(block_m, block_n, block_k, group_m,
    num_warps, num_stages)`` replacing its table's: both layers), for the persistent kernel
    ``schedule`` (fields replaced in the shipped schedule), and ``w2``: layer 2 alone, ``("tile",
    (...))`` its own tile (same ``block_m``: the permutation's token tiles), ``("splits", S)`` its
    K splits, ``("y", "bf16")`` its per-pair rows in bf16. Run at the token counts ``tokens``
    (empty: every one) when ``group`` is chosen (``base`` rows always)."""

    name: str
    kernel: str
    schedule: tuple[tuple[str, Any], ...] = ()
    tile: tuple[int, ...] | None = None
    tokens: tuple[int, ...] = ()
    w2: tuple[tuple[str, Any], ...] = ()
    group: str = "mxp"


@dataclass(frozen=True)
class Choice:
    """What a variant runs at one token count: the tile and schedule replacing the tables'
    (None: as shipped) and the layer-2 overrides (:attr:`Variant.w2`)."""

    tile: Any = None
    schedule: Any = None
    w2: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        parts = [str(x) for x in (self.tile, self.schedule) if x is not None] + [f"w2 {k}={v}" for k, v in self.w2]
        return ", ".join(parts) or "shipped"


GROUPS = ("mxp", "levers")
# Row 0 is the baseline of the ratios below 4096 tokens (today's kernel there), row 1 the
# persistent kernel as shipped (the kernel from 4096 tokens up).
VARIANTS = (
    Variant("swap", SWAP, group="base"),
    Variant("persistent", PERSISTENT, group="base"),
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
    # Group "levers" (issue 21's gaps on the H200: T = 64 and 1024 ~2.5 % short of 1.2x matmul_ogs,
    # T = 4096 ~19 %). T = 64 (~2 rows per expert, 16 x 64 tiles, 4 CTAs of 4 warps per SM): the
    # H100 -> H200 step gave 3 % (545 -> 530 us) for 43 % more bandwidth, so the loop is issue-bound
    # (~3.4 SASS instructions per weight value in layer 1, 4.2 in layer 2: sm_90a compiles,
    # ptxas -v, no spills in any row below): fewer stages (same occupancy, smaller pipeline), more
    # stages (3 CTAs), two warpgroups sharing the token tile, layer 2 split in two along K. Layer 2
    # on 128 weight rows (3.3 instructions per value at the same 16 warps per SM) won on the H200
    # (2026-11-28, variant t64-w2n128: 514.4 vs 528.8 us, bitwise) and is shipped since
    # (_config._W2_TILES): the "swap" row runs it at T = 64, and t64-w2n64 times the old shared
    # 16 x 64 tile in layer 2. A tile= variant replaces pick_tile for both layers.
    Variant("t64-s3", SWAP, tile=(16, 64, 128, 1, 4, 3), tokens=(64,), group="levers"),
    Variant("t64-s6", SWAP, tile=(16, 64, 128, 1, 4, 6), tokens=(64,), group="levers"),
    Variant("t64-8w", SWAP, tile=(16, 128, 128, 1, 8, 4), tokens=(64,), group="levers"),
    Variant("t64-w2n64", SWAP, w2=(("tile", (16, 64, 128, 1, 4, 4)),), tokens=(64,), group="levers"),
    Variant("t64-w2split2", SWAP, w2=(("splits", 2),), tokens=(64,), group="levers"),
    # T = 1024 (~32 rows per expert, 32 x 128 tiles, 2 CTAs of 4 warps per SM in layer 1: 8 warps
    # to hide the decode's latencies): 8 warps per CTA (16 per SM, 3.45 instead of 2.95 instructions
    # per value), 64 weight rows (3 CTAs), 3 stages; and at 512 / 1024 the layer-2 rows in bf16 (the
    # combine reads 47 MB of float32 rows at T = 1024).
    Variant("t1024-s3", SWAP, tile=(32, 128, 128, 8, 4, 3), tokens=(1024,), group="levers"),
    Variant("t1024-8w", SWAP, tile=(32, 128, 128, 8, 8, 4), tokens=(1024,), group="levers"),
    Variant("t1024-n64", SWAP, tile=(32, 64, 128, 8, 4, 4), tokens=(1024,), group="levers"),
    Variant("t1024-ybf16", SWAP, w2=(("y", "bf16"),), tokens=(512, 1024), group="levers"),
    # T = 4096 (the persistent 128 x 128 tile, 8 warps, 255 / 242 registers): layer 2's full token
    # tiles by TMA (its K loop 275 instead of 300 instructions; 32 bytes of spills outside the K
    # loops), its rows in bf16 (189 MB of float32 rows written and read back at T = 4096), both.
    # Triton 3.6's K-loop options are no levers here (sm_90a SASS byte-identical with
    # warp_specialize, disallow_acc_multi_buffer, flatten; loop_unroll_factor=2 spills 196 / 340
    # bytes), nor are larger tiles (256 weight rows or 256 tokens spill, 128 x 64 on 4 warps
    # spills 380 bytes in layer 1): see ci/device/README.md, item s.
    Variant("p-w2tma", PERSISTENT, (("w2_tma", True),), tokens=(4096,), group="levers"),
    Variant("p-ybf16", PERSISTENT, w2=(("y", "bf16"),), tokens=(4096,), group="levers"),
    Variant("p-w2tma-ybf16", PERSISTENT, (("w2_tma", True),), w2=(("y", "bf16"),), tokens=(4096,), group="levers"),
)


def _case(tokens: int, dev: torch.device):
    from tokenspeed_kernel.tools.cases import MoECase
    from tokenspeed_kernel.tools.cases.moe import gpt_oss_case

    if dev.type == "cuda":
        return gpt_oss_case(tokens)
    return MoECase("moe.apply", tokens, 160, 96, 8, 2, weight_format="mxfp4", activation="swiglu_oai", bias=True)


def _choice(variant: Variant, case) -> Choice:
    """What ``variant`` runs at ``case``; raises ``ValueError`` when the persistent schedule
    cannot run with the tile or layer 2's tile has other token rows."""
    from tokenspeed_kernel_triton.ops.moe import fused_mx_swap_persistent as persistent
    from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_schedule, pick_tile

    pairs = case.num_tokens * case.top_k
    shipped = pick_tile(pairs, case.num_experts, "cuda", "mxfp4_swap")
    tile = Tile(*variant.tile) if variant.tile else None
    w2 = dict(variant.w2)
    if "tile" in w2 and w2["tile"][0] != (tile or shipped).block_m:
        raise ValueError(f"layer 2's tile {w2['tile']} must keep block_m {(tile or shipped).block_m}")
    if variant.kernel != PERSISTENT:
        return Choice(tile, None, variant.w2)
    tile = tile or shipped
    schedule = dataclasses.replace(pick_schedule(pairs, case.num_experts, tile), **dict(variant.schedule))
    persistent.check_schedule(schedule, tile)
    return Choice(tile, schedule, variant.w2)


@contextlib.contextmanager
def _wrapped(module_name: str, name: str, wrap):
    """While inside, ``module.name`` is ``wrap(original)``."""
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    setattr(module, name, wrap(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def _layer2(w2: dict, recorded: list | None):
    """A wrapper of ``fused_mx.split_launches`` (both MXFP4 swapped kernels build each layer's
    launches with it) giving layer 2 its own tile / K splits; every layer's launches are appended
    to ``recorded`` (``--breakdown``) unless None."""
    from tokenspeed_kernel_triton.ops.moe._config import Tile

    def wrap(original):
        def launches(gemm, *args, gated: bool, tile, splits=None, **kwargs):
            if not gated:
                tile = Tile(*w2["tile"]) if "tile" in w2 else tile
                splits = w2.get("splits", splits)
            out, built = original(gemm, *args, gated=gated, tile=tile, splits=splits, **kwargs)
            if recorded is not None:
                recorded.append((gated, built))
            return out, built

        return launches

    return wrap


def _bf16_rows(original):
    """A wrapper of ``fused_mx.layer_output``: layer 2's per-pair rows in bf16 (the combine sums
    them in float32)."""

    def output(a, routing, n, tile, *, gated: bool, splits: int = 1):
        if gated:
            return original(a, routing, n, tile, gated=gated, splits=splits)
        return torch.empty((splits, routing.num_pairs, n), dtype=torch.bfloat16, device=a.device)

    return output


@contextlib.contextmanager
def _running(choice: Choice, recorded: list | None = None):
    """While inside, the kernels run ``choice`` (nothing replaced for the shipped choice; with
    ``recorded``, each layer's launches are recorded there)."""
    with contextlib.ExitStack() as stack:
        if choice.schedule is not None:
            stack.enter_context(_replaced((_MODULE, "pick_tile"), choice.tile, []))
            stack.enter_context(_replaced((_MODULE, "pick_schedule"), choice.schedule, []))
        elif choice.tile is not None:
            stack.enter_context(_replaced((_SWAP_MODULE, "pick_tile"), choice.tile, []))
        w2 = dict(choice.w2)
        if w2.keys() - {"y"} or recorded is not None:
            stack.enter_context(_wrapped(_MX_MODULE, "split_launches", _layer2(w2, recorded)))
        if w2.get("y") == "bf16":
            stack.enter_context(_wrapped(_MX_MODULE, "layer_output", _bf16_rows))
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


def _breakdown(variant: Variant, choice: Choice, case, inputs, dev, full_ms: float) -> dict:
    """Per layer (ms): each layer's launches (the GEMM, and a split layer 1's finish) recorded
    from one planned call and replayed alone as ``time_fn`` times a call (the persistent kernel's
    work counters zeroed first: a 2-int memset in the replay); ``rest`` = ``full_ms`` minus both
    (permutation, combine, launch gaps)."""
    from tokenspeed_kernel.tools.timing import time_fn
    from tokenspeed_kernel_triton.ops.moe._mx_swap_persistent import moe_mx_swap_persistent_kernel

    recorded: list = []
    layers: dict[str, float] = {}
    with _running(choice, recorded):
        _planned(variant.kernel, case, inputs, dev)()
        for gated, launches in recorded[-2:]:  # the last call's layers (a bound plan records once)
            persistent = launches[0].fn is moe_mx_swap_persistent_kernel
            counters = launches[0].args[10] if persistent else None  # Routing.work_counters

            def replay(launches=launches, counters=counters):
                if counters is not None:
                    counters.zero_()
                for launch in launches:
                    launch()

            layers["w13" if gated else "w2"] = time_fn(replay, dev).median_ms
    return {**layers, "rest": full_ms - sum(layers.values())}


def _baseline(case, inputs, dev) -> dict:
    from tokenspeed_kernel.tools.baselines import baselines_for
    from tokenspeed_kernel.tools.timing import time_fn

    baseline = next(b for b in baselines_for("moe.apply") if b.name == _OGS)
    runner = baseline.prepare(case, inputs, dev)
    if isinstance(runner, str):
        return {"status": "not run", "reason": runner}
    return {"status": "timed", "ms": time_fn(runner, dev).median_ms, "reason": getattr(runner, "note", "")}


def _one_count(
    tokens: int,
    variants: tuple[Variant, ...],
    dev: torch.device,
    start: float,
    budget_s: float,
    errors: list,
    breakdown: bool = False,
) -> dict:
    from tokenspeed_kernel.tools import cases

    case = _case(tokens, dev)
    log(f"== T={tokens}: {case.describe()}")
    inputs = cases.make_inputs(case, dev, seed=0)
    ref = cases.reference(case, inputs)[0]
    rows: dict[str, dict] = {}
    choices: dict[str, Choice] = {}
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
        rows[variant.name]["choice"] = str(choice)
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
        if ms is not None and breakdown and variant.group == "base":
            label = f"T={tokens} {variant.name} layers"
            layers = attempt(
                errors, label, lambda v=variant, t=ms: _breakdown(v, choices[v.name], case, inputs, dev, t)
            )
            if layers is not None:
                row["layers_ms"] = layers
                log(f"  {'':<14} {_layers(layers)}")
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


def _layers(layers: dict) -> str:
    return "  ".join(f"{name} {ms * 1e3:.1f}" for name, ms in layers.items()) + " us"


def _table(results: list[dict]) -> str:
    """One row per variant (and ``matmul_ogs+sort``), one column per token count: us per call,
    or why there is no time; then the shipped kernel at each count (``swap`` below
    ``RANKED_FROM_TOKENS``, ``persistent`` from there) against ogs, the fastest variant and its
    ratios (shipped time / its time, ogs time / its time: above 1 it is faster; issue 21's goal
    is 1.2x ogs), and the shipped rows' layers where ``--breakdown`` timed them."""
    from tokenspeed_kernel_triton.ops.moe.fused_mx_swap_persistent import RANKED_FROM_TOKENS

    results = sorted(results, key=lambda r: r["tokens"])
    counts = [f"T={r['tokens']}" for r in results]
    lines = ["", "summary: us per call (CUDA-graph replay, median; plans as bench times them)"]
    lines.append(f"{'':<16}" + "".join(f"{c:>14}" for c in counts))
    for name in [n for n in [v.name for v in VARIANTS] + [_OGS] if any(n in r["rows"] for r in results)]:
        cells = [r["rows"].get(name, {}) for r in results]
        text = [f"{c['ms'] * 1e3:14.1f}" if c.get("ms") else f"{c.get('status', '-')[:13]:>14}" for c in cells]
        lines.append(f"{name:<16}" + "".join(text))
    columns: dict[str, list[str]] = {k: [] for k in ("shipped", "  x ogs", "best", "  x shipped", "  x ogs ")}
    for r in results:
        rows = r["rows"]
        shipped = "persistent" if r["tokens"] >= RANKED_FROM_TOKENS else "swap"
        timed = {n: row["ms"] for n, row in rows.items() if row.get("ms") and n != _OGS}
        name = min(timed, key=timed.__getitem__, default=None)
        ship, ogs = timed.get(shipped), rows.get(_OGS, {}).get("ms")
        columns["shipped"].append(f"{shipped:>14}")
        columns["  x ogs"].append(f"{ogs / ship:14.2f}" if ship and ogs else f"{'-':>14}")
        columns["best"].append(f"{name or '-':>14}")
        columns["  x shipped"].append(f"{ship / timed[name]:14.2f}" if name and ship else f"{'-':>14}")
        columns["  x ogs "].append(f"{ogs / timed[name]:14.2f}" if name and ogs else f"{'-':>14}")
    lines += [f"{label:<16}" + "".join(cells) for label, cells in columns.items()]
    for r in results:
        for name, row in r["rows"].items():
            if "layers_ms" in row:
                lines.append(f"layers T={r['tokens']} {name}: {_layers(row['layers_ms'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tokens", default="4096,512,1024,64", help="token counts, run in this order (the largest gap first)"
    )
    parser.add_argument(
        "--group", choices=(*GROUPS, "all"), default="mxp", help="the variants of this group and the shipped rows"
    )
    parser.add_argument("--variants", help="only these variants (comma-separated names of VARIANTS; any group)")
    parser.add_argument("--breakdown", action="store_true", help="time the shipped rows' layers apart too")
    parser.add_argument("--list", action="store_true", help="print the variants that would run (name, tokens) and stop")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no variant starts after this many seconds")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cpu":
        config.use_cpu_interpreter()  # before the backends load: the Triton kernels then run on the CPU
    groups = {"base", *(GROUPS if args.group == "all" else (args.group,))}
    wanted = args.variants.split(",") if args.variants else [v.name for v in VARIANTS if v.group in groups]
    unknown = set(wanted) - {v.name for v in VARIANTS}
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    variants = tuple(v for v in VARIANTS if v.name in wanted)
    if args.list:
        for v in variants:
            print(f"{v.name:<16} {v.group:<7} {','.join(map(str, v.tokens)) or 'every T'}")
        return 0
    start = time.monotonic()
    errors: list = []
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        result = attempt(
            errors,
            f"T={tokens}",
            lambda t=tokens: _one_count(t, variants, dev, start, args.budget_s, errors, args.breakdown),
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
