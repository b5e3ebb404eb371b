"""``moe_bench.py --mx``: the promotion check of ``triton_fused_moe_mx`` in one device call.

1. Numerics of the ``tl.dot_scaled`` kernel (through ``moe_apply(override=...)``, the plan,
   and forced K splits) against the float64 MoE of ``moe_bench.reference64``, outputs poisoned
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
import time
import traceback

import torch
import triton
from moe_bench import (
    Clock,
    bench_inputs,
    expert_bytes,
    log,
    make_weights,
    quantize,
    reference64,
    rel_err,
    time_fn,
    torch_pipeline,
)

from tokenspeed_kernel.ops.moe import moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
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


def _attempt(record: list, label: str, fn) -> object:
    """``fn()``; on an exception, log it, record it under ``label`` and return None."""
    try:
        return fn()
    except Exception as exc:  # one failing case must not stop the run
        log(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        record.append({"case": label, "error": traceback.format_exc()[-1500:]})
        return None


def _inputs(t: int, e: int, h: int, k: int, gen, device):
    x = torch.randn(t, h, generator=gen, device=device).bfloat16()
    tw, ti = moe_topk((2 * torch.randn(t, e, generator=gen, device=device)).bfloat16(), k)
    return x, tw, ti


def _numerics(record: dict, w13, w2, b13, b2, dims, device, clock: Clock, dry: bool) -> None:
    e, k, h, _ = dims
    gen = torch.Generator(device=device).manual_seed(1)
    for t, activation, bias, with_map, splits in CHECKS:
        t = min(t, 33) if dry else t
        if clock.left() < 150:
            log("numerics: out of time budget, skipping the rest")
            break
        label = f"numerics T={t} {activation} bias={bias} map={with_map} splits={splits}"

        def case(t=t, activation=activation, bias=bias, with_map=with_map, splits=splits, label=label):
            x, tw, ti = _inputs(t, e, h, k, gen, device)
            ww13, ww2, emap = w13, w2, None
            if with_map:  # the even experts local, in reversed order; the odd ones remote (-1)
                emap = torch.full((e,), -1, dtype=torch.int32, device=device)
                emap[0::2] = torch.arange(e // 2 - 1, -1, -1, dtype=torch.int32, device=device)
                ww13 = MXFP4Weight(w13.packed[: e // 2], w13.scales[: e // 2])
                ww2 = MXFP4Weight(w2.packed[: e // 2], w2.scales[: e // 2])
            bb13, bb2 = (b13[: ww13.shape[0]], b2[: ww13.shape[0]]) if bias else (None, None)
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

        if _attempt(record["errors"], label, case) is None:  # an exception counts as a failed check
            record["numerics"].append({"T": t, "splits": splits, "ok": False, "rel_err": float("nan")})


def _bench(record: dict, weights, plans: dict, dims, device, clock: Clock, dry: bool) -> None:
    e, k, h, i = dims
    w13, w2, b13, b2 = weights
    gen = torch.Generator(device=device).manual_seed(2)
    mx_bytes = expert_bytes(plans[MX].w13, b13, b2) + expert_bytes(plans[MX].w2, b13, b2)
    for t in (1, 8, 33) if dry else TOKENS:
        if clock.left() < 80:
            log("bench: out of time budget, skipping the rest")
            break
        rot, xs, ls, hit = bench_inputs(t, h, e, k, gen, device)
        row: dict = {"T": t, "experts_hit": hit, "flops": 2.0 * t * k * 3 * h * i, "weight_bytes": hit * mx_bytes}
        if device.type == "cuda":

            def base(xs=xs, ls=ls):
                for x_, l_ in zip(xs, ls):
                    torch_pipeline(x_, l_, w13, w2, b13, b2, k, "swiglu_oai")

            row["torch"] = _attempt(
                record["errors"], f"bench T={t} torch", lambda base=base, rot=rot: time_fn(base, rot, device)[0]
            )
        for name, plan in plans.items():

            def ours(xs=xs, ls=ls, plan=plan):
                for x_, l_ in zip(xs, ls):
                    tw_, ti_ = moe_topk(l_, k)
                    plan.apply(x_, tw_, ti_)

            row[name] = _attempt(
                record["errors"], f"bench T={t} {name}", lambda ours=ours, rot=rot: time_fn(ours, rot, device)[0]
            )
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
        rot = 8 if t <= 64 else 2 if t <= 512 else 1
        routes = [_inputs(t, e, h, k, gen, device) for _ in range(rot)]
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
            ms = _attempt(record["errors"], label, lambda run=run, rot=rot: time_fn(run, rot, device)[0])
            if ms is not None:
                record["sweep"].append({"T": t, "tile": str(tile), "splits": splits, "scales": scales, "ms": ms})
                log(f"{label}: {ms * 1e3:.1f} us")


def _summary(record: dict) -> None:
    bad = [r for r in record["numerics"] if not r["ok"]]
    log(f"\n== numerics ({MX} vs float64): {len(record['numerics']) - len(bad)}/{len(record['numerics'])} PASS"
        + "".join(f"; FAIL T={r['T']} splits={r.get('splits')} err={r['rel_err']:.1e}" for r in bad))  # fmt: skip
    best: dict = {}
    for r in record["sweep"]:
        if r["T"] not in best or r["ms"] < best[r["T"]]["ms"]:
            best[r["T"]] = r
    log(f"== errors: {len(record['errors'])}  device {record['device']}  triton {record['triton']}")
    log("T     torch_us  fused_moe_us  mx_us    mx/fused  mx_TF/s  mx_GB/s  sweep_best_us (tile, splits)")
    for r in record["bench"]:

        def us(name, r=r):
            return f"{r[name] * 1e3:.1f}" if r.get(name) else "n/a"

        speed = r[BASE] / r[MX] if r.get(BASE) and r.get(MX) else float("nan")
        tf = r["flops"] / r[MX] / 1e9 if r.get(MX) else float("nan")
        gbs = r["weight_bytes"] / r[MX] / 1e6 if r.get(MX) else float("nan")
        b = best.get(r["T"])
        bs = f"{b['ms'] * 1e3:.1f} ({b['tile']}, {b['splits']}, {b['scales']})" if b else "-"
        log(f"{r['T']:<5d} {us('torch'):>8}  {us(BASE):>12}  {us(MX):>7}  {speed:8.2f}  {tf:7.0f}  {gbs:7.0f}  {bs}")
    wins = [r["T"] for r in record["bench"] if r.get(BASE) and r.get(MX) and r[MX] < r[BASE]]
    verdict = "numerics PASS" if not bad and record["numerics"] else "numerics FAIL: keep opt-in"
    log(f"== promotion: {verdict}; {MX} faster than {BASE} at T = {wins or 'none'}")


def run_mx(a) -> int:
    """The ``--mx`` mode of ``moe_bench.py`` (``a``: its parsed arguments)."""
    import json

    if a.dry:
        _dry_setup()
    clock = Clock(min(a.budget, 230.0))
    device = torch.device("cpu" if a.dry else "cuda")
    dims = (8, 2, 64, 32) if a.dry else (128, 4, 2880, 2880)  # E, top_k, H, I
    record: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "mode": "mx",
                    "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                    "numerics": [], "bench": [], "sweep": [], "errors": []}  # fmt: skip
    log("device", record["device"], "torch", record["torch"], "triton", record["triton"])
    e, k, h, i = dims
    w13, w2, b13, b2 = make_weights(e, h, i, device)
    m13, m2 = quantize(w13, "mxfp4"), quantize(w2, "mxfp4")
    log(f"weights ready ({230 - clock.left():.0f}s)")
    _numerics(record, m13, m2, b13, b2, dims, device, clock, a.dry)
    plans = {}
    for name in (BASE, MX):
        plan = _attempt(record["errors"], f"plan {name}", lambda name=name: moe_plan(
            m13, m2, x_dtype=torch.bfloat16, top_k=k, activation="swiglu_oai", w13_bias=b13, w2_bias=b2,
            override=name))  # fmt: skip
        if plan is not None:
            plans[name] = plan
    if MX in plans:
        _bench(record, (w13, w2, b13, b2), plans, dims, device, clock, a.dry)
        if not a.no_sweep:
            _sweep(record, plans, (w13, w2, b13, b2), dims, device, clock, a.dry)
    path = a.json or os.path.join(os.environ.get("OUT", "/tmp"), "moe_mx_bench.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    _summary(record)
    return 0 if record["numerics"] and all(r["ok"] for r in record["numerics"]) else 1
