"""One device call for the Gluon MXFP4 MoE decode kernels (T <= 8): ``gluon_moe_decode_mx_sm90``
(float32 FMAs) and ``gluon_moe_mma_sm90`` (mma.sync dots, the selector's pick for bf16/fp16 x).

1. Numerics at GPT-OSS-120B shapes (E = 128, top-4, H = I = 2880, MXFP4 weights, bf16
   activations, swiglu_oai + biases) against ``moe_common.reference64`` (float64), outputs
   poisoned with NaN, T = 1, 2, 4, 8: both registered kernels (``moe_apply(override=...)``
   with ``moe_topk`` routing) and the fused-routing entry ``moe_decode_from_logits`` (its ids
   and weights compared with ``moe_topk``'s); for both kernels a CUDA-graph replay equal to
   the eager call.
2. Timings at T = 1, 2, 4, 8 through CUDA-graph replay (``tokenspeed_kernel.tools.timing.time_fn``,
   L2 flushed between replays), routing included for every row: the torch pipeline (bf16
   weights, ``torch._grouped_mm``), ``triton_fused_moe_mx`` and ``triton_moe_gemv_mx``
   (``moe_topk`` + ``moe_apply``), both Gluon kernels (``moe_topk`` + ``moe_apply``: 3
   launches) and ``gluon fused`` (``moe_decode_from_logits``: 2 launches). ``--mma-sweep``
   adds the MMA kernel's ``MMA_SWEEP`` configurations, each compared with float64 first and
   timed only if it passes. ``--breakdown`` prints per-kernel CUDA times (torch.profiler) of
   the ``BREAKDOWN`` rows, including each MMA layer alone and repeated (weights L2-resident).
3. A short table last: µs per call and TB/s over the MXFP4 weight bytes (packed + scales +
   biases) of the distinct experts the routing hits. The goal (issue 5): T = 1 <= 30 µs.

Usage on the device machine (repo root, wheels carried as in ``ci/device/README.md``)::

    python3 ci/device/gluon_moe_bench.py --json $OUT/gluon_moe.json      # ~2 min on an H100
    python3 ci/device/gluon_moe_bench.py --mma-sweep --breakdown --json $OUT/gluon_moe_mma.json  # ~1.5 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from moe_common import attempt, expert_bytes, log, make_weights, quantize, reference64, rel_err, torch_pipeline

from tokenspeed_kernel.ops.moe import moe_apply, moe_topk
from tokenspeed_kernel.tools.timing import time_fn

GLUON = "gluon_moe_decode_mx_sm90"
MMA = "gluon_moe_mma_sm90"
# Launch configurations of the MMA kernel timed with --mma-sweep (GluonMoEMMAConfig fields;
# the default first): split K, groups per step, layer-2 row blocks, the normalized decode,
# the software-pipelined loops.
MMA_SWEEP = (
    {},
    {"ks2": 4, "prefetch": True, "l2_hint": True},
    {"ks2": 2, "prefetch": True, "l2_hint": True},
    # layer 1 staged by TMA (2026-11-23: correct; 2 stages 5% faster at T = 4, 8): ring depth,
    # layer-2 split, narrower boxes (u1 = 1), 8 warps of one group each
    {"ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 2},
    {"ks2": 2, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 2},
    {"ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 3},
    {"ks2": 2, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 3},
    {"ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 1},
    {"u1": 1, "ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 2},
    {"u1": 1, "ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 4},
    {"ks1": 8, "u1": 1, "ks2": 2, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 2},
    # layer 2 staged by TMA: correct but 1.3-2x slower at every T (2026-11-23); one row kept
    {"ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 2, "tma2": True, "stages2": 2},
)
# Rows of --breakdown: (label, override kernel name, "fused", MMA config fields, or
# ("layer", n): one MMA layer alone, repeated, with the selected configuration: its weights
# stay in L2 between calls when they fit, the kernel's floor without DRAM misses)
BREAKDOWN = (
    ("fma routed", GLUON),
    ("mma selected", MMA),
    ("mma tma1 s2", {"ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 2}),
    ("mma tma1 s3", {"ks2": 4, "prefetch": True, "l2_hint": True, "tma1": True, "stages1": 3}),
    ("mma layer 1 alone", ("layer", 1)),
    ("mma layer 2 alone", ("layer", 2)),
)
TOKENS = (1, 2, 4, 8)
GOAL_US = 30.0
E, K, H, INTER = 128, 4, 2880, 2880
ACT = "swiglu_oai"


def _numerics(record, m13, m2, b13, b2, device) -> None:
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits

    gen = torch.Generator(device=device).manual_seed(7)
    for t in TOKENS:
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        logits = (2 * torch.randn(t, E, generator=gen, device=device)).bfloat16()
        tw, ti = moe_topk(logits, K)
        ref = reference64(x, m13, m2, b13, b2, tw, ti, ACT)
        out = torch.full_like(x, float("nan"))
        moe_apply(x, m13, m2, tw, ti, activation=ACT, w13_bias=b13, w2_bias=b2, out=out, override=GLUON)
        torch.cuda.synchronize()
        mma = torch.full_like(x, float("nan"))
        moe_apply(x, m13, m2, tw, ti, activation=ACT, w13_bias=b13, w2_bias=b2, out=mma, override=MMA)
        torch.cuda.synchronize()
        fused = torch.full_like(x, float("nan"))
        fused, fw, fi = moe_decode_from_logits(
            x, logits, m13, m2, K, activation=ACT, w13_bias=b13, w2_bias=b2, out=fused
        )
        torch.cuda.synchronize()
        row = {
            "t": t,
            "rel_err": rel_err(out, ref),
            "nan": bool(out.isnan().any()),
            "mma_rel_err": rel_err(mma, ref),
            "mma_nan": bool(mma.isnan().any()),
            "fused_rel_err": rel_err(fused, ref),
            "fused_ids_equal": bool(torch.equal(fi, ti)),
            "fused_weights_maxdiff": float((fw - tw).abs().max()),
        }
        row["ok"] = (
            row["rel_err"] < 2e-2
            and not row["nan"]
            and row["fused_rel_err"] < 2e-2
            and row["fused_ids_equal"]
            and row["mma_rel_err"] < 2e-2
            and not row["mma_nan"]
        )
        log(f"  numerics T={t}: {row}")
        record["numerics"].append(row)
    # Graph replay equals the eager call (capturable, deterministic); T = 8 runs the MMA
    # kernel's TMA-staged layer 1.
    kw = dict(activation=ACT, w13_bias=b13, w2_bias=b2)
    equal = []
    for t, name in ((2, GLUON), (2, MMA), (8, MMA)):
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        tw, ti = moe_topk(torch.randn(t, E, generator=gen, device=device).bfloat16(), K)
        eager = moe_apply(x, m13, m2, tw, ti, override=name, **kw)
        out = torch.empty_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_apply(x, m13, m2, tw, ti, out=out, override=name, **kw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        equal.append(bool(torch.equal(out, eager)))
    record["graph_equal"] = all(equal)
    log(f"  graph replay == eager: {record['graph_equal']}")


def _bench(record, w13, w2, m13, m2, b13, b2, device, sweep: bool) -> None:
    per_expert = expert_bytes(m13, b13, None) + expert_bytes(m2, None, b2) + (b13[0].numel() + b2[0].numel()) * 2
    gen = torch.Generator(device=device).manual_seed(11)
    for t in TOKENS:
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        logits = (2 * torch.randn(t, E, generator=gen, device=device)).bfloat16()
        _bench_t(record, t, x, logits, w13, w2, m13, m2, b13, b2, per_expert, device, sweep)


def _mma_variant(x, logits, m13, m2, b13, b2, out, cfg):
    from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_mma

    def fn():
        tw, ti = moe_topk(logits, K)
        gluon_moe_mma.launch(x, m13, m2, b13, b2, None, out, ti, tw, K, ACT, cfg)

    return fn


def _bench_t(record, t, x, logits, w13, w2, m13, m2, b13, b2, per_expert, device, sweep) -> None:
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_mma import GluonMoEMMAConfig

    kw = dict(activation=ACT, w13_bias=b13, w2_bias=b2)
    hit = int(torch.unique(torch.topk(logits.float(), K).indices).numel())
    out = torch.empty_like(x)

    def routed(name):
        def fn():
            tw, ti = moe_topk(logits, K)
            moe_apply(x, m13, m2, tw, ti, out=out, override=name, **kw)

        return fn

    rows = {
        "torch (bf16)": lambda: torch_pipeline(x, logits, w13, w2, b13, b2, K, ACT),
        "triton_fused_moe_mx": routed("triton_fused_moe_mx"),
        "triton_moe_gemv_mx": routed("triton_moe_gemv_mx"),
        GLUON: routed(GLUON),
        "gluon fused": lambda: moe_decode_from_logits(x, logits, m13, m2, K, out=out, **kw),
        MMA: routed(MMA),
    }
    if sweep:
        tw, ti = moe_topk(logits, K)
        ref = reference64(x, m13, m2, b13, b2, tw, ti, ACT)
        for fields in MMA_SWEEP:
            cfg = GluonMoEMMAConfig(**fields)
            fn = _mma_variant(x, logits, m13, m2, b13, b2, out, cfg)
            name = "mma " + (",".join(f"{k}={v}" for k, v in fields.items()) or "default")
            out.fill_(float("nan"))
            if attempt(record["errors"], f"T={t} {name} numerics", lambda fn=fn: fn() or True) is None:
                continue
            err = rel_err(out, ref)
            record["sweep_numerics"].append({"t": t, "config": name, "rel_err": err})
            if not err < 2e-2:
                log(f"  T={t} {name}: rel_err {err:.3g} FAILS, not timed")
                continue
            rows[name] = fn
    for name, fn in rows.items():
        timing = attempt(record["errors"], f"T={t} {name}", lambda fn=fn: time_fn(fn, device))
        if timing is None:
            continue
        us = timing.median_ms * 1e3
        tbs = hit * per_expert / (timing.median_ms * 1e-3) / 1e12
        entry = {"t": t, "kernel": name, "us": us, "tbs": tbs, "graph": timing.graph, "experts_hit": hit}
        log(f"  T={t} {name:24s} {us:8.1f} us  {tbs:5.2f} TB/s  (graph={timing.graph}, {hit} experts)")
        record["timings"].append(entry)


def _breakdown_fn(what, x, logits, out, m13, m2, b13, b2):
    """One BREAKDOWN row as a call: the fused FMA decode, a routed override, or an MMA config."""
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_mma import GluonMoEMMAConfig

    kw = dict(activation=ACT, w13_bias=b13, w2_bias=b2)
    if what == "fused":
        return lambda: moe_decode_from_logits(x, logits, m13, m2, K, out=out, **kw)
    if isinstance(what, str):
        return lambda: moe_apply(x, m13, m2, *moe_topk(logits, K), out=out, override=what, **kw)
    if isinstance(what, tuple):
        from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_mma

        tw, ti = moe_topk(logits, K)
        gluon_moe_mma.launch(x, m13, m2, b13, b2, None, out, ti, tw, K, ACT)  # fills the intermediate
        return lambda: gluon_moe_mma.launch(x, m13, m2, b13, b2, None, out, ti, tw, K, ACT, layers=(what[1],))
    return _mma_variant(x, logits, m13, m2, b13, b2, out, GluonMoEMMAConfig(**what))


def _breakdown(record, m13, m2, b13, b2, device) -> None:
    """Per-kernel CUDA time (torch.profiler, 50 calls) of each BREAKDOWN row at each T: where
    the microseconds go (routing, layer 1, layer 2) and how much the launches add on top."""
    from torch.profiler import ProfilerActivity, profile

    log("\n== per-kernel CUDA time (torch.profiler, eager, us per call)")
    gen = torch.Generator(device=device).manual_seed(12)
    for t in TOKENS:
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        logits = (2 * torch.randn(t, E, generator=gen, device=device)).bfloat16()
        out = torch.empty_like(x)
        for label, what in BREAKDOWN:
            fn = _breakdown_fn(what, x, logits, out, m13, m2, b13, b2)
            if attempt(record["errors"], f"breakdown T={t} {label}", lambda fn=fn: (fn(), True)[1]) is None:
                continue
            torch.cuda.synchronize()
            calls = 50
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
            parts = []
            for ev in prof.key_averages():
                us = ev.self_device_time_total / calls
                if us > 0.05:
                    parts.append((ev.key[:40], us))
            parts.sort(key=lambda p: -p[1])
            total = sum(us for _, us in parts)
            record.setdefault("breakdown", []).append({"t": t, "row": label, "kernels": parts, "sum_us": total})
            log(f"  T={t} {label:20s} sum {total:6.1f} us: " + ", ".join(f"{k} {us:.1f}" for k, us in parts))


def _summary(record) -> None:
    log("\n== gluon_moe_decode_mx_sm90 vs baselines (GPT-OSS-120B MoE layer, MXFP4, bf16, routing included)")
    kernels = list(dict.fromkeys(r["kernel"] for r in record["timings"]))
    log("kernel".ljust(26) + "".join(f"T={t:<14d}" for t in TOKENS))
    for k in kernels:
        cells = []
        for t in TOKENS:
            r = next((r for r in record["timings"] if r["kernel"] == k and r["t"] == t), None)
            cells.append(f"{r['us']:6.1f}us {r['tbs']:4.2f}TB/s " if r else "n/a".ljust(15))
        log(k.ljust(26) + "".join(cells))
    t1 = [
        r["us"]
        for r in record["timings"]
        if r["t"] == 1 and (r["kernel"] in (GLUON, "gluon fused", MMA) or r["kernel"].startswith("mma "))
    ]
    if t1:
        log(f"goal T=1 <= {GOAL_US} us: best gluon {min(t1):.1f} us -> {'met' if min(t1) <= GOAL_US else 'NOT met'}")
    ok = all(r["ok"] for r in record["numerics"]) and record.get("graph_equal")
    log(f"numerics: {'PASS' if ok else 'FAIL'}; errors: {len(record['errors'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--mma-sweep", action="store_true", help="time the MMA kernel's MMA_SWEEP configurations")
    parser.add_argument("--breakdown", action="store_true", help="per-kernel CUDA times (torch.profiler)")
    parser.add_argument("--skip-tma", action="store_true", help="leave out the TMA-staged (tma1/tma2) rows")
    parser.add_argument("--tokens", default=None, help="comma-separated T values (default 1,2,4,8)")
    a = parser.parse_args()
    global TOKENS
    if a.skip_tma:
        global MMA_SWEEP, BREAKDOWN
        MMA_SWEEP = tuple(f for f in MMA_SWEEP if not (f.get("tma1") or f.get("tma2")))
        BREAKDOWN = tuple(
            r for r in BREAKDOWN if not (isinstance(r[1], dict) and (r[1].get("tma1") or r[1].get("tma2")))
        )
    if a.tokens:
        TOKENS = tuple(int(t) for t in a.tokens.split(","))
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to run")
        return 0
    device = torch.device("cuda")
    record = {"device": torch.cuda.get_device_name(), "numerics": [], "timings": [], "errors": [], "sweep_numerics": []}
    t0 = time.time()
    w13, w2, b13, b2 = make_weights(E, H, INTER, device)
    b13 = b13.bfloat16()
    m13, m2 = quantize(w13, "mxfp4"), quantize(w2, "mxfp4")
    log(f"weights ready in {time.time() - t0:.1f}s")
    attempt(record["errors"], "numerics", lambda: _numerics(record, m13, m2, b13, b2, device))
    if a.breakdown:
        _breakdown(record, m13, m2, b13, b2, device)
    if not a.no_bench:
        _bench(record, w13, w2, m13, m2, b13, b2, device, a.mma_sweep)
    _summary(record)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
    ok = all(r["ok"] for r in record["numerics"]) and record.get("graph_equal") and not record["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
