"""``moe_bench.py --mx``: the promotion check of ``triton_fused_moe_mx`` in one device call.

1. Numerics of the ``tl.dot_scaled`` kernel (through ``moe_apply(override=...)``, the plan,
   and forced K splits) against the float64 MoE of ``moe_common.reference64``, outputs poisoned
   with NaN: T = 1, 3, 17, 64, 300, 4096, swiglu_oai + biases, silu + expert map.
2. GPT-OSS-120B timings (E = 128, top-4, H = I = 2880, biases, swiglu_oai) at T = 1, 8, 64,
   512, 4096: torch baseline, ``triton_fused_moe`` (MXFP4, planned) and the new kernel
   (planned), same method as ``moe_bench.py`` (CUDA graphs, ``ROT`` routings per replay).
3. Sweep: the new kernel's tiles and K splits, planned vs public (functional) scales.
4. A table last: times, speedup over ``triton_fused_moe``, and a promotion verdict per T.

Every case runs in its own try/except; a failure is recorded and the run goes on.
"""

from __future__ import annotations

import os
import sys

import torch
from moe_common import (  # ci/device/moe_common.py, next to this file
    Clock,
    attempt,
    attempt_time,
    bench_inputs,
    best_by,
    expert_bytes,
    log,
    log_numerics,
    mx_case,
    mx_run_setup,
    numerics_ok,
    out_path,
    plan_each,
    reference64,
    rel_err,
    rotations,
    route,
    routed_calls,
    torch_calls,
    us_or_na,
    within_budget,
    write_record,
)

from tokenspeed_kernel.ops.moe import moe_apply
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel_triton.ops.moe import fused_mx
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile

MX = "triton_fused_moe_mx"
BASE = "triton_fused_moe"
TOKENS = (1, 8, 64, 512, 4096)
# (T, activation, bias, expert map, forced splits or None)
CHECKS = [(1, "swiglu_oai", True, False, None), (3, "swiglu_oai", True, False, None), (3, "swiglu_oai", True, False, 2),
          (3, "swiglu_oai", True, False, 4), (17, "silu", False, True, None), (64, "swiglu_oai", True, False, None),
          (300, "swiglu_oai", True, True, None), (4096, "swiglu_oai", True, False, None)]  # fmt: skip
# (T, tiles, splits): every tile with the rule's split (None) and, at small T, forced splits.
SWEEP = [
    (1, [Tile(16, 32, 128, 1, 4, 3), Tile(16, 64, 128, 1, 4, 3), Tile(16, 32, 128, 1, 4, 5),
         Tile(16, 32, 64, 1, 4, 4), Tile(16, 32, 256, 1, 4, 2)], (None, 1, 2, 8)),
    (8, [Tile(16, 32, 128, 1, 4, 3), Tile(16, 64, 128, 1, 4, 3), Tile(16, 128, 128, 1, 4, 3)], (None, 2, 4)),
    (64, [Tile(16, 64, 128, 1, 4, 3), Tile(32, 64, 128, 4, 4, 3), Tile(16, 32, 128, 1, 4, 3)], (None,)),
    (512, [Tile(64, 64, 128, 8, 4, 3), Tile(64, 128, 128, 8, 4, 3), Tile(128, 128, 128, 8, 8, 3)], (None,)),
    (4096, [Tile(128, 128, 128, 8, 8, 3), Tile(128, 128, 64, 8, 8, 4), Tile(128, 256, 128, 8, 8, 3),
            Tile(64, 128, 128, 8, 4, 3)], (None,)),
]  # fmt: skip


class _Patch:
    """The ``monkeypatch`` subset ``interpret_dot_scaled.install`` uses (``--dry`` only)."""

    def setattr(self, obj, name, value, raising=True):
        setattr(obj, name, value)


def _dry_setup() -> None:
    """CPU smoke run: emulate dot_scaled in the interpreter and let the selector accept the kernel."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from support import interpret_dot_scaled

    interpret_dot_scaled.install(_Patch())
    fused_mx.INTERPRET = False


def _numerics(record: dict, w13, w2, b13, b2, dims, device, clock: Clock, dry: bool) -> None:
    e, k, h, _ = dims
    gen = torch.Generator(device=device).manual_seed(1)
    for t, activation, bias, with_map, splits in within_budget(CHECKS, clock, 150, "numerics"):
        t = min(t, 33) if dry else t
        label = f"numerics T={t} {activation} bias={bias} map={with_map} splits={splits}"

        def case(t=t, activation=activation, bias=bias, with_map=with_map, splits=splits, label=label):
            x, tw, ti = route(t, e, h, k, gen, device)
            ww13, ww2, bb13, bb2, emap = mx_case(w13, w2, b13, b2, e, bias, with_map, device)
            out = torch.full_like(x, float("nan"))
            kw = {"activation": activation, "w13_bias": bb13, "w2_bias": bb2, "expert_map": emap}
            if splits is None:
                moe_apply(x, ww13, ww2, tw, ti, **kw, out=out, override=MX)
            else:
                prepared = fused_mx.prepare_moe_mx(w13=ww13, w2=ww2)
                args = MoEApplyArgs(x, ww13, ww2, tw, ti, activation, bb13, bb2, emap, out, prepared)
                fused_mx.fused_moe_mx(args, splits=splits)
            err = rel_err(out, reference64(x, ww13, ww2, bb13, bb2, tw, ti, activation, emap))
            ok = bool(not torch.isnan(out).any() and err < 2e-2)
            record["numerics"].append({"T": t, "activation": activation, "bias": bias, "expert_map": with_map,
                                       "splits": splits, "rel_err": err, "ok": ok})  # fmt: skip
            log(f"{label}: rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")
            return True

        if attempt(record["errors"], label, case) is None:  # an exception counts as a failed check
            record["numerics"].append({"T": t, "splits": splits, "ok": False, "rel_err": float("nan")})


def _bench(record: dict, weights, plans: dict, dims, device, clock: Clock, dry: bool) -> None:
    e, k, h, i = dims
    w13, w2, b13, b2 = weights
    gen = torch.Generator(device=device).manual_seed(2)
    mx_bytes = expert_bytes(plans[MX].w13, b13, b2) + expert_bytes(plans[MX].w2, b13, b2)
    for t in within_budget((1, 8, 33) if dry else TOKENS, clock, 80, "bench"):
        rot, xs, ls, hit = bench_inputs(t, h, e, k, gen, device)
        row: dict = {"T": t, "experts_hit": hit, "flops": 2.0 * t * k * 3 * h * i, "weight_bytes": hit * mx_bytes}
        if device.type == "cuda":
            base = torch_calls(xs, ls, w13, w2, b13, b2, k)
            row["torch"] = attempt_time(record["errors"], f"bench T={t} torch", base, rot, device)
        for name, plan in plans.items():
            ours = routed_calls(xs, ls, plan, k)
            row[name] = attempt_time(record["errors"], f"bench T={t} {name}", ours, rot, device)
        row["mx_tile"] = str(pick_tile(t * k, e, "cuda", "mxfp4_dot"))
        record["bench"].append(row)
        log(f"bench T={t}: " + "  ".join(f"{n} {row[n] * 1e3:.1f}us" if row.get(n) else f"{n} n/a"
                                         for n in ("torch", BASE, MX)))  # fmt: skip


def _sweep(record: dict, plans: dict, weights, dims, device, clock: Clock, dry: bool) -> None:
    e, k, h, _ = dims
    _, _, b13, b2 = weights
    plan = plans[MX]
    gen = torch.Generator(device=device).manual_seed(3)
    public = fused_mx.PreparedMx(fused_mx.mx_operand(plan.w13), fused_mx.mx_operand(plan.w2))
    for t, tiles, splits_list in SWEEP:
        t = min(t, 33) if dry else t
        rot = rotations(t)
        routes = [route(t, e, h, k, gen, device) for _ in range(rot)]
        outs = [torch.empty_like(x_) for x_, _, _ in routes]
        variants = [(tile, s, "planned") for tile in tiles for s in splits_list]
        variants += [(tiles[0], None, "public")]
        for tile, splits, scales in variants:
            if clock.left() < 25:
                log("sweep: out of time budget")
                return
            prepared = plan.prepared if scales == "planned" else public

            def run(tile=tile, splits=splits, prepared=prepared, routes=routes, outs=outs):
                for (x_, tw_, ti_), o_ in zip(routes, outs):
                    args = MoEApplyArgs(x_, plan.w13, plan.w2, tw_, ti_, "swiglu_oai", b13, b2, None, o_, prepared)
                    fused_mx.fused_moe_mx(args, tile=tile, splits=splits)

            label = f"sweep T={t} {tile} splits={splits} {scales}"
            ms = attempt_time(record["errors"], label, run, rot, device)
            if ms is not None:
                record["sweep"].append({"T": t, "tile": str(tile), "splits": splits, "scales": scales, "ms": ms})
                log(f"{label}: {ms * 1e3:.1f} us")


def _summary(record: dict) -> None:
    bad = log_numerics(record, MX, lambda r: f"splits={r.get('splits')}")
    best = best_by(record["sweep"], lambda r: r["T"])
    log("T     torch_us  fused_moe_us  mx_us    mx/fused  mx_TF/s  mx_GB/s  sweep_best_us (tile, splits)")
    for r in record["bench"]:
        speed = r[BASE] / r[MX] if r.get(BASE) and r.get(MX) else float("nan")
        tf = r["flops"] / r[MX] / 1e9 if r.get(MX) else float("nan")
        gbs = r["weight_bytes"] / r[MX] / 1e6 if r.get(MX) else float("nan")
        b = best.get(r["T"])
        bs = f"{b['ms'] * 1e3:.1f} ({b['tile']}, {b['splits']}, {b['scales']})" if b else "-"
        log(
            f"{r['T']:<5d} {us_or_na(r, 'torch'):>8}  {us_or_na(r, BASE):>12}  {us_or_na(r, MX):>7}  {speed:8.2f}  {tf:7.0f}  {gbs:7.0f}  {bs}"
        )
    wins = [r["T"] for r in record["bench"] if r.get(BASE) and r.get(MX) and r[MX] < r[BASE]]
    verdict = "numerics PASS" if not bad and record["numerics"] else "numerics FAIL: keep opt-in"
    log(f"== promotion: {verdict}; {MX} faster than {BASE} at T = {wins or 'none'}")


def run_mx(a) -> int:
    """The ``--mx`` mode of ``moe_bench.py`` (``a``: its parsed arguments)."""
    if a.dry:
        _dry_setup()
    clock = Clock(min(a.budget, 230.0))
    device, dims, record, (w13, w2, b13, b2), (m13, m2) = mx_run_setup(a.dry, "mx", clock)
    k = dims[1]
    _numerics(record, m13, m2, b13, b2, dims, device, clock, a.dry)
    plans = plan_each(record["errors"], (BASE, MX), m13, m2, k, b13, b2)
    if MX in plans:
        _bench(record, (w13, w2, b13, b2), plans, dims, device, clock, a.dry)
        if not a.no_sweep:
            _sweep(record, plans, (w13, w2, b13, b2), dims, device, clock, a.dry)
    write_record(record, out_path(a.json, "moe_mx_bench.json"))
    _summary(record)
    return 0 if numerics_ok(record) else 1
