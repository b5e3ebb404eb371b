"""One device call for the opt-in ``triton_moe_gemv_mx`` (MXFP4 MoE as two GEMV launches, T <= 8).

1. Numerics at GPT-OSS-120B shapes (E = 128, top-4, H = I = 2880, MXFP4 weights, bf16
   activations) against the float64 MoE of ``moe_common.reference64``, outputs poisoned with
   NaN: T = 1, 2, 4, 8 with swiglu_oai + biases through ``moe_apply(override=...)``; T = 8
   with an expert map (odd experts remote) and silu without biases; the plan's result equal
   to the functional one, and a CUDA-graph replay equal to the eager call (capturability).
2. Timings at T = 1, 2, 4, 8 (routing included: ``moe_topk`` + ``plan.apply``), CUDA-graph
   replays of ``ROT`` different routings (``moe_common.time_fn``/``bench_inputs``): the torch
   pipeline (bf16 weights, ``torch._grouped_mm``), ``triton_fused_moe_mx`` and
   ``triton_moe_gemv_mx``, planned.
3. A small sweep of the GEMV tiles at T = 1 and 8 (``gemv_moe(tiles=...)``, no routing).
4. A table last: µs per call, TB/s over the MXFP4 weight bytes of the distinct experts hit
   (the bytes a perfect kernel reads; the GEMV re-requests a repeated expert per pair), and
   the ratio ``triton_fused_moe_mx / triton_moe_gemv_mx``; the goal is T = 1 <= 60 µs.

Usage on the device machine (repo root, wheels carried as for ``moe_bench.py``)::

    python3 ci/device/moe_gemv_bench.py --json $OUT/moe_gemv.json      # ~2 min on an H100

``--dry`` runs the same code on tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (the
``tl.dot_scaled`` kernel and the torch pipeline report n/a there).
"""

from __future__ import annotations

import argparse
import os
import sys

import moe_common as mc  # ci/device/moe_common.py, next to this file
import torch

from tokenspeed_kernel.ops.moe import moe_apply, moe_plan
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel_triton.ops.moe import gemv_mx
from tokenspeed_kernel_triton.ops.moe.gemv_mx import GemvTile

GEMV = "triton_moe_gemv_mx"
MX = "triton_fused_moe_mx"
TOKENS = (1, 2, 4, 8)
GOAL_US = 60.0  # issue 4: MXFP4, bf16 activations, T = 1, routing included
# (T, activation, bias, expert map)
CHECKS = [(1, "swiglu_oai", True, False), (2, "swiglu_oai", True, False), (4, "swiglu_oai", True, False),
          (8, "swiglu_oai", True, False), (8, "swiglu_oai", True, True), (8, "silu", False, False)]  # fmt: skip
# (layer 1, layer 2) tiles for the sweep; the first is the table's choice at top-4.
SWEEP_TILES = [
    (GemvTile(32, 256, 4), GemvTile(16, 256, 4)),
    (GemvTile(16, 256, 4), GemvTile(8, 256, 4)),
    (GemvTile(64, 256, 8), GemvTile(32, 256, 8)),
    (GemvTile(32, 128, 4), GemvTile(16, 128, 4)),
    (GemvTile(32, 512, 8), GemvTile(16, 512, 8)),
    (GemvTile(16, 128, 2), GemvTile(8, 128, 2)),
]


def _tag(tile: GemvTile) -> str:
    return f"n{tile.block_n}k{tile.block_k}w{tile.num_warps}"


def _graph_equal(plan, x, tw, ti, eager: torch.Tensor) -> bool | None:
    """A CUDA-graph replay of ``plan.apply`` equals the eager result (None off CUDA)."""
    if x.device.type != "cuda":
        return None
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.apply(x, tw, ti, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.apply(x, tw, ti, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    return bool(torch.equal(out, eager))


def _numerics(record: dict, m13, m2, b13, b2, dims, device, clock: mc.Clock, dry: bool) -> None:
    e, k, h, _ = dims
    gen = torch.Generator(device=device).manual_seed(1)
    for t, activation, bias, with_map in mc.within_budget(CHECKS, clock, 60, "numerics"):
        label = f"numerics T={t} {activation} bias={bias} map={with_map}"

        def case(t=t, activation=activation, bias=bias, with_map=with_map, label=label):
            x, tw, ti = mc.route(t, e, h, k, gen, device)
            w13, w2, bb13, bb2, emap = mc.mx_case(m13, m2, b13, b2, e, bias, with_map, device)
            kw = {"activation": activation, "w13_bias": bb13, "w2_bias": bb2, "expert_map": emap}
            out = torch.full_like(x, float("nan"))
            moe_apply(x, w13, w2, tw, ti, **kw, out=out, override=GEMV)
            err = mc.rel_err(out, mc.reference64(x, w13, w2, bb13, bb2, tw, ti, activation, emap))
            plan = moe_plan(w13, w2, x_dtype=x.dtype, top_k=k, override=GEMV, **kw)
            same_plan = bool(torch.equal(plan.apply(x, tw, ti), out))
            graph = _graph_equal(plan, x, tw, ti, out)
            ok = bool(not torch.isnan(out).any() and err < 2e-2 and same_plan and graph is not False)
            record["numerics"].append({"T": t, "activation": activation, "bias": bias, "expert_map": with_map,
                                       "rel_err": err, "plan_equal": same_plan, "graph_equal": graph, "ok": ok})  # fmt: skip
            mc.log(f"{label}: rel_err={err:.2e} plan_equal={same_plan} graph_equal={graph} {'PASS' if ok else 'FAIL'}")
            return True

        if mc.attempt(record["errors"], label, case) is None:
            record["numerics"].append({"T": t, "activation": activation, "ok": False, "rel_err": float("nan")})


def _bench(record: dict, weights, plans: dict, dims, device, clock: mc.Clock) -> None:
    e, k, h, _ = dims
    w13, w2, b13, b2 = weights
    gen = torch.Generator(device=device).manual_seed(2)
    plan = plans[GEMV]
    per_expert = mc.expert_bytes(plan.w13, b13, b2) + mc.expert_bytes(plan.w2, b13, b2)
    for t in mc.within_budget(TOKENS, clock, 40, "bench"):
        rot, xs, ls, hit = mc.bench_inputs(t, h, e, k, gen, device)
        row: dict = {"T": t, "experts_hit": hit, "weight_bytes": hit * per_expert}
        if device.type == "cuda":
            base = mc.torch_calls(xs, ls, w13, w2, b13, b2, k)
            row["torch"] = mc.attempt_time(record["errors"], f"bench T={t} torch", base, rot, device)
        for name, p in plans.items():
            ours = mc.routed_calls(xs, ls, p, k)
            row[name] = mc.attempt_time(record["errors"], f"bench T={t} {name}", ours, rot, device)
        record["bench"].append(row)
        mc.log(f"bench T={t}: " + "  ".join(f"{n} {row[n] * 1e3:.1f}us" if row.get(n) else f"{n} n/a"
                                         for n in ("torch", MX, GEMV)))  # fmt: skip


def _sweep(record: dict, plan, weights, dims, device, clock: mc.Clock) -> None:
    e, k, h, _ = dims
    _, _, b13, b2 = weights
    gen = torch.Generator(device=device).manual_seed(3)
    for t in (1, 8):
        routes = [mc.route(t, e, h, k, gen, device) for _ in range(8)]
        outs = [torch.empty_like(x_) for x_, _, _ in routes]
        for tiles in SWEEP_TILES:
            if clock.left() < 20:
                mc.log("sweep: out of time budget")
                return

            def run(tiles=tiles, routes=routes, outs=outs):
                for (x_, tw_, ti_), o_ in zip(routes, outs):
                    args = MoEApplyArgs(x_, plan.w13, plan.w2, tw_, ti_, "swiglu_oai", b13, b2, None, o_)
                    gemv_mx.gemv_moe(args, tiles=tiles)

            label = f"sweep T={t} w13 {_tag(tiles[0])} w2 {_tag(tiles[1])}"
            ms = mc.attempt_time(record["errors"], label, run, 8, device)
            if ms is not None:
                record["sweep"].append({"T": t, "w13": _tag(tiles[0]), "w2": _tag(tiles[1]), "ms": ms})
                mc.log(f"{label}: {ms * 1e3:.1f} us")


def _summary(record: dict) -> None:
    bad = mc.log_numerics(record, GEMV, lambda r: r.get("activation"))
    best = mc.best_by(record["sweep"], lambda r: r["T"])
    mc.log("T   torch_us  fused_mx_us  gemv_us  gemv_TB/s  fused_mx/gemv  sweep_best_us (w13, w2)")
    for r in record["bench"]:
        ratio = r[MX] / r[GEMV] if r.get(MX) and r.get(GEMV) else float("nan")
        tbs = r["weight_bytes"] / (r[GEMV] * 1e-3) / 1e12 if r.get(GEMV) else float("nan")
        b = best.get(r["T"])
        bs = f"{b['ms'] * 1e3:.1f} ({b['w13']}, {b['w2']})" if b else "-"
        mc.log(
            f"{r['T']:<3d} {mc.us_or_na(r, 'torch'):>8}  {mc.us_or_na(r, MX):>11}  {mc.us_or_na(r, GEMV):>7}  {tbs:9.2f}  {ratio:13.2f}  {bs}"
        )
    t1 = next((r for r in record["bench"] if r["T"] == 1 and r.get(GEMV)), None)
    goal = f"T=1 {t1[GEMV] * 1e3:.1f} us vs goal {GOAL_US:.0f} us" if t1 else "T=1 not measured"
    mc.log(f"== {goal}; numerics {'PASS' if record['numerics'] and not bad else 'FAIL: keep opt-in'}")


def main() -> int:
    p = argparse.ArgumentParser()
    mc.add_run_args(p, 200.0, "tiny shapes on the CPU (TRITON_INTERPRET=1)")
    a = p.parse_args()
    if a.dry and os.environ.get("TRITON_INTERPRET") != "1":
        mc.log("--dry needs TRITON_INTERPRET=1 (set it before Python starts)")
        return 2
    clock = mc.Clock(a.budget)
    device, dims, record, (w13, w2, b13, b2), (m13, m2) = mc.mx_run_setup(a.dry, "gemv", clock)
    k = dims[1]
    _numerics(record, m13, m2, b13, b2, dims, device, clock, a.dry)
    # the interpreter cannot run tl.dot_scaled
    plans = mc.plan_each(record["errors"], (GEMV,) if a.dry else (MX, GEMV), m13, m2, k, b13, b2)
    if GEMV in plans:
        _bench(record, (w13, w2, b13, b2), plans, dims, device, clock)
        if not a.no_sweep:
            _sweep(record, plans[GEMV], (w13, w2, b13, b2), dims, device, clock)
    mc.write_record(record, mc.out_path(a.json, "moe_gemv_bench.json"))
    _summary(record)
    return 0 if mc.numerics_ok(record) else 1


if __name__ == "__main__":
    sys.exit(main())
