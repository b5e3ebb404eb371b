"""One device call for the Triton MoE: GPU numerics of every weight format against float64,
then GPT-OSS-120B MoE timings (E=128, top-4, H=I=2880, biases, swiglu_oai) against a plain
torch pipeline (torch routing + ``torch._grouped_mm``, bf16 weights) measured in the same run,
a small tile sweep, and a goals table printed last.

Usage on the device machine (repo root), with wheels built here (``pip wheel --no-deps -w
build/moe_whl packages/tokenspeed-kernel packages/tokenspeed-kernel-triton``; the device has no
package index, so an editable install cannot fetch its build backend) carried as ``build/moe_whl``::

    python3 -m pip install -q --no-deps --no-index build/moe_whl/*.whl
    python3 ci/device/moe_bench.py --budget 400 --json $OUT/moe_bench.json

``--dry`` runs the same code paths on tiny shapes (CPU, under TRITON_INTERPRET=1).

``--combine`` adds, at every T, ``triton_fused_moe`` with the deterministic combine kernel
(``combine="reduce"``, the default) next to the combine fused into the w2 epilogue
(``combine="atomic"``: float32 atomics into a ``[T, H]`` buffer), for bf16 and
fp8_per_channel weights (same plans and routings), plus a numerics row per format::

    python3 ci/device/moe_bench.py --combine --no-sweep --json $OUT/moe_combine.json

``--fp8-act`` adds, at every T, fp8_per_channel and fp8_block weights with bf16 activations
(weight-only: the MMA runs in bf16) next to ``activation_quant="fp8"`` (per-token fp8
activations quantized on the fly, fp8 x fp8 MMA), through ``moe_plan`` like the main table,
plus numerics rows against the float64 MoE of the same activation quantization::

    python3 ci/device/moe_bench.py --fp8-act --no-sweep --json $OUT/moe_fp8act.json

``--mx`` (about 3 minutes on an H100) is the promotion check of the opt-in
``triton_fused_moe_mx`` (``tl.dot_scaled`` MXFP4 main loop): its numerics against float64
(awkward T, biases, expert map, forced K splits; outputs poisoned with NaN), then GPT-OSS-120B
timings at T = 1, 8, 64, 512, 4096 next to ``triton_fused_moe`` (MXFP4) and the torch
baseline, a sweep of its tiles and K splits, planned vs public scales, and a table last::

    python3 ci/device/moe_bench.py --mx --json $OUT/moe_mx_bench.json

With ``--dry --mx`` the dot_scaled kernel runs under the interpreter with the float64
emulation of ``tests/support/interpret_dot_scaled.py`` (a smoke test of this script only).

Timing: every measured step is captured in a CUDA graph (eager timing if capture fails) and
replayed with ``triton.testing.do_bench`` (median). At small T each replay runs ``ROT``
different routings/inputs back to back, so the weights of different experts are read and
the 50 MB L2 cannot serve them; the time per call is the replay time over ``ROT``.
"""

from __future__ import annotations

import argparse
import sys

import torch
from moe_common import (  # ci/device/moe_common.py, next to this file
    Clock,
    add_run_args,
    bench_inputs,
    copy_bandwidth,
    expert_bytes,
    log,
    make_weights,
    quantize,
    reference64,
    rel_err,
    rotated_inputs,
    route,
    routed_calls,
    start_record,
    time_fn,
    torch_calls,
    vars_of,
    within_budget,
    write_record,
)

from tokenspeed_kernel.ops.moe import moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel_triton.ops.moe import fused
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile

FORMATS = ("bf16", "mxfp4", "fp8_per_tensor", "fp8_per_channel", "fp8_block")
BENCH_FORMATS = ("bf16", "mxfp4", "fp8_per_channel", "fp8_block")
SWEEP = {
    "mx_small": [Tile(16, 32, 64, 1, 4, 4), Tile(16, 64, 64, 1, 4, 4), Tile(16, 32, 64, 1, 4, 6),
                 Tile(16, 64, 64, 1, 4, 6), Tile(16, 128, 64, 1, 4, 4), Tile(16, 32, 64, 1, 2, 4),
                 Tile(16, 16, 64, 1, 2, 6)],
    "mx_mid": [Tile(16, 64, 64, 1, 4, 4), Tile(32, 64, 64, 4, 4, 4), Tile(64, 64, 64, 8, 4, 4),
               Tile(32, 128, 64, 4, 4, 4), Tile(64, 128, 64, 8, 4, 4)],
    "mx_large": [Tile(128, 64, 64, 8, 4, 4), Tile(128, 64, 64, 8, 8, 4), Tile(128, 128, 64, 8, 8, 3),
                 Tile(64, 128, 64, 8, 4, 4), Tile(128, 32, 64, 8, 4, 4)],
    "dense_small": [Tile(16, 32, 128, 1, 4, 4), Tile(16, 64, 128, 1, 4, 4), Tile(16, 32, 256, 1, 4, 3),
                    Tile(16, 64, 64, 1, 4, 4)],
    "dense_mid": [Tile(16, 64, 128, 1, 4, 4), Tile(32, 64, 128, 4, 4, 4), Tile(64, 64, 64, 8, 4, 4),
                  Tile(64, 128, 64, 8, 4, 4), Tile(32, 128, 64, 4, 4, 4)],
    "dense_large": [Tile(128, 128, 64, 8, 8, 3), Tile(128, 128, 64, 8, 8, 4), Tile(128, 256, 64, 8, 8, 3),
                    Tile(64, 256, 64, 8, 4, 3)],
}  # fmt: skip
SWEEP_POINTS = (("mxfp4", 1, "mx_small"), ("mxfp4", 8, "mx_small"), ("mxfp4", 64, "mx_small"),
                ("mxfp4", 512, "mx_mid"), ("mxfp4", 4096, "mx_large"), ("bf16", 512, "dense_mid"),
                ("bf16", 4096, "dense_large"), ("fp8_per_channel", 4096, "dense_large"),
                ("fp8_per_channel", 64, "dense_small"))  # fmt: skip


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser()
    add_run_args(p, 420.0, "tiny shapes on the CPU (interpreter)")
    p.add_argument("--mx", action="store_true", help="promotion check of triton_fused_moe_mx (see the docstring)")
    p.add_argument("--combine", action="store_true", help="time combine='reduce' vs 'atomic' (see the docstring)")
    p.add_argument("--fp8-act", action="store_true", help="time activation_quant='fp8' vs bf16 activations")
    a = p.parse_args()
    if a.mx:
        from moe_mx_bench import run_mx  # ci/device/moe_mx_bench.py, next to this file

        return run_mx(a)
    clock = Clock(a.budget)
    device = torch.device("cpu" if a.dry else "cuda")
    e, k, h, i = (8, 2, 64, 32) if a.dry else (128, 4, 2880, 2880)
    token_counts = (1, 8, 33) if a.dry else (1, 8, 64, 512, 4096)
    record = start_record(device, "numerics", "bench", "sweep", "combine", "fp8_act")
    copy_bw = copy_bandwidth(device)
    record["copy_bw"] = copy_bw
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")

    w13, w2, b13, b2 = make_weights(e, h, i, device)
    weights = {"bf16": (w13, w2)}
    for fmt in FORMATS[1:]:
        weights[fmt] = (quantize(w13, fmt), quantize(w2, fmt))
    log(f"weights ready ({clock.elapsed():.0f}s)")

    # ---- numerics: every format, GPT-OSS shapes, vs float64
    gen = torch.Generator(device=device).manual_seed(1)
    checks = [(fmt, t, "swiglu_oai", True, False) for fmt in FORMATS for t in ((5, 33) if a.dry else (3, 64, 4096))]
    checks += [("bf16", 33 if a.dry else 512, "silu", False, True), ("mxfp4", 17, "silu", False, True)]
    for fmt, t, activation, bias, with_map in within_budget(checks, clock, 60, "numerics"):
        x, tw, ti = route(t, e, h, k, gen, device)
        emap = None
        ww13, ww2 = weights[fmt]
        if with_map:  # the first half of the experts local, in reversed order
            emap = torch.full((e,), -1, dtype=torch.int32, device=device)
            emap[: e // 2] = torch.arange(e // 2 - 1, -1, -1, dtype=torch.int32, device=device)
            ww13 = (
                ww13[: e // 2] if isinstance(ww13, torch.Tensor) else type(ww13)(*(f[: e // 2] for f in vars_of(ww13)))
            )
            ww2 = ww2[: e // 2] if isinstance(ww2, torch.Tensor) else type(ww2)(*(f[: e // 2] for f in vars_of(ww2)))
        bb13, bb2 = (b13[: ww13.shape[0]], b2[: ww13.shape[0]]) if bias else (None, None)
        out = torch.full_like(x, float("nan"))
        moe_apply(x, ww13, ww2, tw, ti, activation=activation, w13_bias=bb13, w2_bias=bb2, expert_map=emap, out=out)
        ref = reference64(x, ww13, ww2, bb13, bb2, tw, ti, activation, emap)
        err = rel_err(out, ref)
        ok = bool(not torch.isnan(out).any() and err < 2e-2)
        row = {"format": fmt, "T": t, "activation": activation, "bias": bias, "expert_map": with_map, "rel_err": err,
               "ok": ok}  # fmt: skip
        record["numerics"].append(row)
        log(f"numerics {fmt:16s} T={t:5d} {activation:10s} bias={bias!s:5s} map={with_map!s:5s} "
            f"rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")  # fmt: skip

    # ---- benchmark
    plans = {fmt: moe_plan(*weights[fmt], x_dtype=torch.bfloat16, top_k=k, activation="swiglu_oai", w13_bias=b13,
                           w2_bias=b2) for fmt in BENCH_FORMATS}  # fmt: skip
    has_grouped_mm = hasattr(torch, "_grouped_mm") and device.type == "cuda"
    for t in within_budget(token_counts, clock, 45, "bench"):
        rot, xs, ls, hit = bench_inputs(t, h, e, k, gen, device)
        flops = 2.0 * t * k * 3 * h * i
        row = {"T": t, "experts_hit": hit}
        if has_grouped_mm:
            row["torch_ms"], row["torch_mode"] = time_fn(torch_calls(xs, ls, w13, w2, b13, b2, k), rot, device)
        for fmt in BENCH_FORMATS:
            ms, mode = time_fn(routed_calls(xs, ls, plans[fmt], k), rot, device)
            wbytes = hit * (expert_bytes(weights[fmt][0], b13, b2) + expert_bytes(weights[fmt][1], b13, b2))
            row[fmt] = {"ms": ms, "mode": mode, "tflops": flops / ms / 1e9, "weight_bytes": wbytes,
                        "bw_frac": wbytes / (ms * 1e-3) / copy_bw, "tile": str(pick_tile(t * k, e, "cuda", fmt))}  # fmt: skip
        record["bench"].append(row)
        log(f"bench T={t}: " + "  ".join(
            [f"torch {row['torch_ms'] * 1e3:.1f}us" if "torch_ms" in row else "torch n/a"]
            + [f"{fmt} {row[fmt]['ms'] * 1e3:.1f}us ({row[fmt]['tflops']:.0f} TF/s, {row[fmt]['bw_frac'] * 100:.0f}% BW)"
               for fmt in BENCH_FORMATS]))  # fmt: skip

    if a.fp8_act:
        bench_fp8_act(a, record, clock, weights, plans, (e, k, h, i), token_counts, b13, b2, gen, device)
    if a.combine:
        bench_combine(a, record, clock, weights, plans, (e, k, h, i), token_counts, b13, b2, gen, device)

    # ---- tile sweep (fused_moe only, fixed routing sets, prepared weights)
    if not a.no_sweep:
        for fmt, t, group in SWEEP_POINTS:
            if a.dry:
                t = min(t, 33)
            xs, ls = rotated_inputs(t, h, e, gen, device)
            rot, routes = len(xs), [moe_topk(l_, k) for l_ in ls]
            plan = plans[fmt]
            for tile in SWEEP[group]:
                if clock.left() < 25:
                    break
                outs = [torch.empty_like(x_) for x_ in xs]

                def run(tile=tile, xs=xs, routes=routes, outs=outs, plan=plan):
                    for x_, (tw_, ti_), o_ in zip(xs, routes, outs):
                        args = MoEApplyArgs(x_, plan.w13, plan.w2, tw_, ti_, "swiglu_oai", b13, b2, None, o_,
                                            plan.prepared)  # fmt: skip
                        fused.fused_moe(args, tile=tile)

                try:
                    ms, _ = time_fn(run, rot, device)
                except Exception as exc:
                    log(f"sweep {fmt} T={t} {tile}: failed {str(exc).splitlines()[0][:120]}")
                    continue
                record["sweep"].append({"format": fmt, "T": t, "tile": str(tile), "ms": ms})
                log(f"sweep {fmt:6s} T={t:5d} {tile}: {ms * 1e3:.1f} us")

    if a.json:
        write_record(record, a.json)
    summary(record)
    return 0 if all(r["ok"] for r in record["numerics"]) else 1


COMBINE_FORMATS = ("bf16", "fp8_per_channel")
FP8_ACT_FORMATS = ("fp8_per_channel", "fp8_block")


def bench_fp8_act(a, record, clock, weights, plans, dims, token_counts, b13, b2, gen, device) -> None:
    """fp8 weights with bf16 activations (the main plans) vs ``activation_quant="fp8"`` plans:
    numerics against the float64 MoE of the same quantization, then times at every T."""
    from tokenspeed_kernel.quant import FP8_BLOCK, fake_quantize_fp8_per_token

    e, k, h, _ = dims
    act_plans = {fmt: moe_plan(*weights[fmt], x_dtype=torch.bfloat16, top_k=k, activation="swiglu_oai", w13_bias=b13,
                               w2_bias=b2, activation_quant="fp8") for fmt in FP8_ACT_FORMATS}  # fmt: skip
    for fmt in FP8_ACT_FORMATS:
        for t in (5, 33) if a.dry else (3, 64, 4096):
            x, tw, ti = route(t, e, h, k, gen, device)
            out = act_plans[fmt].apply(x, tw, ti)
            group = FP8_BLOCK if fmt == "fp8_block" else None
            ref = reference64(x, *weights[fmt], b13, b2, tw, ti, "swiglu_oai",
                              quant=lambda v, g=group: fake_quantize_fp8_per_token(v, g))  # fmt: skip
            err = rel_err(out, ref)
            ok = bool(not torch.isnan(out).any() and err < 3e-2)
            record["numerics"].append({"format": f"{fmt}+fp8_act", "T": t, "activation": "swiglu_oai", "bias": True,
                                       "expert_map": False, "rel_err": err, "ok": ok})  # fmt: skip
            log(f"numerics {fmt}+fp8_act T={t} rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")
    for t in within_budget(token_counts, clock, 30, "fp8_act"):
        rot, xs, ls, _ = bench_inputs(t, h, e, k, gen, device)
        row = {"T": t}
        for fmt in FP8_ACT_FORMATS:
            for label, plan in (("bf16act", plans[fmt]), ("fp8act", act_plans[fmt])):
                row[f"{fmt}_{label}_ms"], _ = time_fn(routed_calls(xs, ls, plan, k), rot, device)
        record["fp8_act"].append(row)
        log(f"fp8_act T={t}: " + "  ".join(
            f"{fmt} bf16-act {row[f'{fmt}_bf16act_ms'] * 1e3:.1f}us fp8-act {row[f'{fmt}_fp8act_ms'] * 1e3:.1f}us "
            f"({row[f'{fmt}_bf16act_ms'] / row[f'{fmt}_fp8act_ms']:.2f}x)" for fmt in FP8_ACT_FORMATS))  # fmt: skip


def bench_combine(a, record, clock, weights, plans, dims, token_counts, b13, b2, gen, device) -> None:
    """``fused.fused_moe`` with ``combine="reduce"`` vs ``"atomic"``: numerics against float64
    once per format, then the time of each at every T (same plan, routings and inputs)."""
    e, k, h, _ = dims
    for fmt in COMBINE_FORMATS:
        plan = plans[fmt]
        t = 33 if a.dry else 64
        x, tw, ti = route(t, e, h, k, gen, device)
        args = MoEApplyArgs(x, plan.w13, plan.w2, tw, ti, "swiglu_oai", b13, b2, None, torch.full_like(x, float("nan")),
                            plan.prepared)  # fmt: skip
        fused.fused_moe(args, combine="atomic")
        err = rel_err(args.out, reference64(x, *weights[fmt], b13, b2, tw, ti, "swiglu_oai"))
        ok = bool(not torch.isnan(args.out).any() and err < 2e-2)
        record["numerics"].append({"format": f"{fmt}+atomic", "T": t, "activation": "swiglu_oai", "bias": True,
                                   "expert_map": False, "rel_err": err, "ok": ok})  # fmt: skip
        log(f"numerics {fmt}+atomic T={t} rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")
    for t in within_budget(token_counts, clock, 30, "combine"):
        xs, ls = rotated_inputs(t, h, e, gen, device)
        rot, routes = len(xs), [moe_topk(l_, k) for l_ in ls]
        row = {"T": t}
        for fmt in COMBINE_FORMATS:
            plan = plans[fmt]
            outs = [torch.empty_like(x_) for x_ in xs]
            for mode in ("reduce", "atomic"):

                def run(mode=mode, xs=xs, routes=routes, outs=outs, plan=plan):
                    for x_, (tw_, ti_), o_ in zip(xs, routes, outs):
                        args = MoEApplyArgs(x_, plan.w13, plan.w2, tw_, ti_, "swiglu_oai", b13, b2, None, o_,
                                            plan.prepared)  # fmt: skip
                        fused.fused_moe(args, combine=mode)

                row[f"{fmt}_{mode}_ms"], row[f"{fmt}_{mode}_mode"] = time_fn(run, rot, device)
        record["combine"].append(row)
        log(f"combine T={t}: " + "  ".join(
            f"{fmt} reduce {row[f'{fmt}_reduce_ms'] * 1e3:.1f}us atomic {row[f'{fmt}_atomic_ms'] * 1e3:.1f}us "
            f"({row[f'{fmt}_reduce_ms'] / row[f'{fmt}_atomic_ms']:.2f}x)" for fmt in COMBINE_FORMATS))  # fmt: skip


def _pair_table(rows: list, formats, first: str, second: str) -> None:
    """Per T and format: the µs of ``{fmt}_{first}_ms`` and ``{fmt}_{second}_ms`` and their ratio."""
    log("T     " + "  ".join(f"{fmt}: {first}_us {second}_us (x)" for fmt in formats))
    for r in rows:
        log(f"{r['T']:<5d} " + "  ".join(
            f"{r[f'{fmt}_{first}_ms'] * 1e3:9.1f} {r[f'{fmt}_{second}_ms'] * 1e3:9.1f} "
            f"({r[f'{fmt}_{first}_ms'] / r[f'{fmt}_{second}_ms']:4.2f})" for fmt in formats))  # fmt: skip


def summary(record: dict) -> None:
    log("\n== numerics: " + ", ".join(f"{r['format']}/T{r['T']}{'/map' if r['expert_map'] else ''}"
                                       f"={r['rel_err']:.1e}{'' if r['ok'] else ' FAIL'}" for r in record["numerics"]))  # fmt: skip
    best: dict = {}
    for r in record["sweep"]:
        key = (r["format"], r["T"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for (fmt, t), r in sorted(best.items()):
        log(f"== sweep best {fmt} T={t}: {r['tile']} {r['ms'] * 1e3:.1f} us")
    log(
        f"== {record['device']}  torch {record['torch']}  triton {record['triton']}  copy {record['copy_bw'] / 1e12:.2f} TB/s"
    )
    log("T     torch_us  bf16_us (x)      mxfp4_us  mx_TF/s mx_BW%  fp8ch_us (x)   fp8blk_us (x)")
    for r in record["bench"]:
        base = r.get("torch_ms", float("nan"))
        b, m, c, bl = r["bf16"], r["mxfp4"], r["fp8_per_channel"], r["fp8_block"]
        log(f"{r['T']:<5d} {base * 1e3:8.1f}  {b['ms'] * 1e3:7.1f} ({base / b['ms']:4.2f})  {m['ms'] * 1e3:8.1f}  "
            f"{m['tflops']:6.0f}  {m['bw_frac'] * 100:5.0f}  {c['ms'] * 1e3:7.1f} ({base / c['ms']:4.2f})  "
            f"{bl['ms'] * 1e3:8.1f} ({base / bl['ms']:4.2f})")  # fmt: skip
    goals = []
    for r in record["bench"]:
        base = r.get("torch_ms", float("nan"))
        goals.append(f"bf16 T={r['T']} {base / r['bf16']['ms']:.2f}x (goal >=1.5)")
        m = r["mxfp4"]
        if r["T"] == 1:
            goals.append(f"mxfp4 T=1 {m['ms'] * 1e3:.1f}us (goal <=60)")
        if r["T"] in (8, 64):
            goals.append(f"mxfp4 T={r['T']} {m['bw_frac'] * 100:.0f}% BW (goal >=60%)")
        if r["T"] == 4096:
            goals.append(f"mxfp4 T=4096 {m['tflops']:.0f} TF/s (goal >=250)")
    log("== goals: " + "; ".join(goals))
    if record.get("fp8_act"):
        _pair_table(record["fp8_act"], FP8_ACT_FORMATS, "bf16act", "fp8act")
    if record.get("combine"):
        _pair_table(record["combine"], COMBINE_FORMATS, "reduce", "atomic")


if __name__ == "__main__":
    sys.exit(main())
