"""``triton_fused_moe_mx_swap`` beside ``triton_fused_moe_mx`` at GPT-OSS-120B shapes, with a
tile sweep, in one device call (the CLI's ``bench`` times a kernel's table pick only).

GPT-OSS-120B MoE layer: E = 128, top-4, H = I = 2880, MXFP4 weights (``moe_common``'s seeded
weights), biases, ``swiglu_oai``, bf16 x. For T = 1, 8, 64, 512, 4096:

1. the float64 MoE of one routing (``moe_common.reference64``);
2. numerics, outputs poisoned with NaN, relative Frobenius error < 2e-2: the dot_scaled kernel
   (its plan), the swapped kernel's functional path (``moe_apply(override=...)``: repacked per
   call, two-multiply decode) and every swapped configuration of ``SWEEP`` (the plan's
   prepared weights, one-multiply decode; the table's pick first);
3. timings of what passed: CUDA-graph replays of ``moe_topk`` + the MoE over ``ROT`` routings
   (``moe_common``), the dot_scaled kernel through its plan, each swapped configuration
   through ``fused_moe_mx_swap`` with the same prepared weights.

A table last: per T the dot_scaled time, the swapped pick's and the best configuration's,
their ratios, and the weight bytes per second of the best. Exit status 1 if a numerics check
failed. JSON under ``$OUT`` (``moe_mx_swap_sweep.json``).

Usage on the device (repo root; wheels as in ci/device/README.md)::

    python3 ci/device/moe_mx_swap_sweep.py --budget 420

``--no-sweep``: the table's pick only. ``--dry``: tiny shapes on the CPU under the Triton
interpreter (the swapped kernel only; a smoke test of this script).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

if "--dry" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from moe_common import (  # ci/device/moe_common.py, next to this file
    Clock,
    add_run_args,
    attempt,
    attempt_time,
    bench_inputs,
    expert_bytes,
    log,
    mx_run_setup,
    out_path,
    plan_each,
    reference64,
    rel_err,
    route,
    routed_calls,
    within_budget,
    write_record,
)

from tokenspeed_kernel.ops.moe import moe_apply, moe_topk
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel_triton.ops.moe import fused_mx_swap
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile

MX, SWAP = "triton_fused_moe_mx", "triton_fused_moe_mx_swap"
TOL = 2e-2
# (T, configurations, K splits): None = the table's pick / the split rule. Rows per expert at
# T = 1, 8, 64, 512, 4096: 0.03, 0.25, 2, 16, 128. Every tile compiles for sm_90 without
# spills (ptxas -v, checked when this list was written).
SWEEP = [
    (1, [None, Tile(16, 64, 128, 1, 4, 4), Tile(16, 256, 128, 1, 8, 4)], (None, 1, 2, 8)),
    (8, [None, Tile(16, 64, 128, 1, 4, 4), Tile(16, 256, 128, 1, 8, 4)], (None, 1, 4)),
    (64, [None, Tile(16, 64, 128, 1, 4, 4), Tile(16, 256, 128, 4, 8, 4), Tile(16, 128, 128, 4, 4, 3)], (None,)),
    (512, [None, Tile(16, 128, 128, 4, 4, 4), Tile(32, 256, 128, 8, 8, 4), Tile(32, 128, 128, 8, 4, 4),
           Tile(16, 256, 128, 4, 8, 3)], (None,)),
    (4096, [None, Tile(64, 128, 128, 8, 8, 3), Tile(64, 256, 128, 8, 8, 2), Tile(128, 128, 128, 8, 8, 2),
            Tile(128, 128, 128, 8, 8, 4)], (None,)),
]  # fmt: skip


def _swap_run(routes, outs, k, m13, m2, b13, b2, prepared, tile, splits):
    """One step over every routing: ``moe_topk`` (top-``k``) + the swapped kernel with
    ``tile``/``splits``."""

    def run():
        for (x_, l_), o_ in zip(routes, outs):
            tw_, ti_ = moe_topk(l_, k)
            args = MoEApplyArgs(x_, m13, m2, tw_, ti_, "swiglu_oai", b13, b2, None, o_, prepared)
            fused_mx_swap.fused_moe_mx_swap(args, tile=tile, splits=splits)

    return run


def _check(record: dict, label: str, out: torch.Tensor, ref: torch.Tensor, **row) -> bool:
    err = rel_err(out, ref)
    ok = bool(not torch.isnan(out).any() and err < TOL)
    record["numerics"].append({**row, "rel_err": err, "ok": ok})
    log(f"numerics {label}: rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")
    return ok


def run(a) -> int:
    clock = Clock(a.budget)
    device, dims, record, (_, _, b13, b2), (m13, m2) = mx_run_setup(a.dry, "mx_swap", clock)
    e, k, h, _ = dims
    prepared = fused_mx_swap.prepare_moe_mx_swap(w13=m13, w2=m2, w13_bias=b13, w2_bias=b2)
    record["big_scales"] = [prepared.w13.big_scales, prepared.w2.big_scales]
    plans = {} if a.dry else plan_each(record["errors"], (MX,), m13, m2, k, b13, b2)
    mx_bytes = expert_bytes(m13, b13, b2) + expert_bytes(m2, b13, b2)
    gen = torch.Generator(device=device).manual_seed(5)
    for t, configs, splits_list in within_budget(SWEEP, clock, 30, "sweep"):
        t = min(t, 33) if a.dry else t
        configs, splits_list = ([None], (None,)) if a.no_sweep else (configs, splits_list)
        x, tw, ti = route(t, e, h, k, gen, device)
        ref = reference64(x, m13, m2, b13, b2, tw, ti, "swiglu_oai")
        pick = pick_tile(t * k, e, "cuda", "mxfp4_swap")
        row: dict = {"T": t, "pick": str(pick), "configs": []}
        if MX in plans:
            out = plans[MX].apply(x, tw, ti)
            row["mx_ok"] = _check(record, f"T={t} {MX} (plan)", out, ref, T=t, kernel=MX)
        if not a.dry:
            out = torch.full_like(x, float("nan"))
            kw = {"activation": "swiglu_oai", "w13_bias": b13, "w2_bias": b2, "out": out, "override": SWAP}
            call = functools.partial(moe_apply, x, m13, m2, tw, ti, **kw)
            attempt(record["errors"], f"T={t} {SWAP} functional", call)
            _check(record, f"T={t} {SWAP} functional", out, ref, T=t, kernel=SWAP, config="functional")
        rot, xs, ls, hit = bench_inputs(t, h, e, k, gen, device)
        routes, outs = list(zip(xs, ls)), [torch.empty_like(x_) for x_ in xs]
        row["weight_bytes"] = hit * mx_bytes
        if row.get("mx_ok"):
            row[MX] = attempt_time(record["errors"], f"T={t} {MX}", routed_calls(xs, ls, plans[MX], k), rot, device)
        for tile in configs:
            for splits in splits_list:
                label = f"T={t} {tile or 'pick'} splits={splits}"
                if clock.left() < 20:
                    log(f"{label}: out of time budget")
                    break
                out = torch.full_like(x, float("nan"))
                args = MoEApplyArgs(x, m13, m2, tw, ti, "swiglu_oai", b13, b2, None, out, prepared)
                ran = attempt(record["errors"], label, lambda args=args, tile=tile, splits=splits: (
                    fused_mx_swap.fused_moe_mx_swap(args, tile=tile, splits=splits), True)[1])  # fmt: skip
                if not ran or not _check(record, label, out, ref, T=t, kernel=SWAP, config=str(tile), splits=splits):
                    continue
                step = _swap_run(routes, outs, k, m13, m2, b13, b2, prepared, tile, splits)
                ms = attempt_time(record["errors"], label, step, rot, device)
                if ms is not None:
                    row["configs"].append({"tile": str(tile or pick), "pick": tile is None, "splits": splits, "ms": ms})
                    log(f"time {label}: {ms * 1e3:.1f} us" + (f" ({MX} {row[MX] * 1e3:.1f} us)" if row.get(MX) else ""))
        record["bench"].append(row)
    write_record(record, out_path(a.json, "moe_mx_swap_sweep.json"))
    _summary(record)
    return 0 if record["numerics"] and all(r["ok"] for r in record["numerics"]) else 1


def _summary(record: dict) -> None:
    bad = [r for r in record["numerics"] if not r["ok"]]
    log(f"\n== numerics vs float64: {len(record['numerics']) - len(bad)}/{len(record['numerics'])} PASS"
        + "".join(f"; FAIL T={r['T']} {r['kernel']} {r.get('config', '')}" for r in bad))  # fmt: skip
    log(f"== errors: {len(record['errors'])}; big scales (w13, w2): {record.get('big_scales')}")
    log("T     mx_us    swap_pick_us  pick/mx  best_us  best/mx  best_GB/s  best (tile, splits)")
    for r in record["bench"]:
        mx = r.get(MX)
        picks = [c for c in r["configs"] if c["pick"] and c["splits"] is None]
        best = min(r["configs"], key=lambda c: c["ms"], default=None)
        pick_ms, best_ms = picks[0]["ms"] if picks else None, best["ms"] if best else None
        gbs = f"{r['weight_bytes'] / best_ms / 1e6:.0f}" if best else "n/a"
        where = f"({best['tile']}, {best['splits']})" if best else "-"
        log(f"{r['T']:<5d} {_us(mx):>7}  {_us(pick_ms):>12}  {_ratio(mx, pick_ms):>7}  {_us(best_ms):>7}  "
            f"{_ratio(mx, best_ms):>7}  {gbs:>9}  {where}")  # fmt: skip


def _us(ms: float | None) -> str:
    return f"{ms * 1e3:.1f}" if ms else "n/a"


def _ratio(base: float | None, ms: float | None) -> str:
    """How many times faster than ``base`` (both milliseconds)."""
    return f"{base / ms:.2f}x" if base and ms else "n/a"


def main() -> int:
    p = argparse.ArgumentParser()
    add_run_args(p, 420.0, "tiny shapes on the CPU (interpreter; the swapped kernel only)")
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
