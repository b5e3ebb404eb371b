"""One device call: the L2-flush question, then launch-configuration sweeps of the two MXFP4
MoE decode kernels (T <= 8) at GPT-OSS-120B shapes (~3 min on an H100).

1. **Flush.** ``tokenspeed_kernel.tools.timing.time_fn`` timed every repetition after zeroing
   a 256 MiB buffer (``flush="write"``, as ``triton.testing.do_bench``), which leaves the L2
   full of dirty lines the timed call must write back. The same calls are timed here with
   ``flush="write"``, ``"read"`` (the new default: cold L2, clean lines) and ``"none"``
   (warm): a torch reduction over the bytes a T = 1 MoE reads (a ceiling at that size),
   ``gluon_moe_decode_mx_sm90`` fused from the logits and ``triton_moe_gemv_mx`` at T = 1 and
   8, and the decode attention B = 1 ctx 8192 with sinks (Triton, Gluon).
2. **Gluon sweep.** ``gluon_moe_decode.CONFIGS`` variants (rows per thread and warps of both layers)
   at T = 1, 2, 4, 8 through ``moe_decode_from_logits`` (routing fused, 2 launches):
   each configuration's output against the float64 reference first (rel L2 < 2e-2), then
   the time (``flush="read"``).
3. **GEMV sweep.** ``triton_moe_gemv_mx`` tiles (``gemv_moe(tiles=...)``, routing by
   ``moe_topk`` included) at T = 1, 2, 4, 8, checked the same way.
4. **bf16 GEMV sweep** (``--sections gemv16``, not in the default sections). ``triton_moe_gemv``
   (bf16 weights, the same GPT-OSS layer) tiles at T = 1, 2, 4, 8, 16 next to
   ``triton_fused_moe`` (both through ``moe_apply(override=)`` after ``moe_topk``; a tile by
   ``gemv_moe(tiles=...)``), each checked against float64 first: the table the opt-in kernel's
   ranking (per token bucket) and its tile rows (``gemv.TILES["plain"]``) are read from.
5. A table last: per T the default and the best configuration of each kernel.

Usage (repository root, wheels carried)::

    python3 ci/device/moe_decode_sweep.py --json $OUT/moe_decode_sweep.json
    python3 ci/device/moe_decode_sweep.py --sections gemv16 --json $OUT/moe_decode_bf16.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from moe_common import attempt, expert_bytes, log, make_weights, quantize, reference64, rel_err

from tokenspeed_kernel.ops.moe import moe_topk
from tokenspeed_kernel.tools.timing import time_fn

E, K, H, INTER = 128, 4, 2880, 2880
ACT = "swiglu_oai"
TOKENS = (1, 2, 4, 8)
# (rows1, warps1, rows2, row_warps2). A layer-1 register-prefetch variant was swept too
# (2026-11-23, commit 87dce8e): 1.2x slower at every T, removed.
GLUON_CONFIGS = [(4, 4, 4, 1), (4, 4, 8, 1), (2, 4, 4, 1), (2, 4, 2, 1), (4, 4, 2, 1), (8, 4, 4, 1), (4, 8, 4, 1),
                 (2, 8, 4, 2), (4, 4, 4, 2), (2, 4, 2, 2), (1, 4, 2, 1), (2, 2, 2, 1), (8, 2, 8, 1)]  # fmt: skip
# ((block_n, block_k, warps) layer 1, layer 2)
GEMV_TILES = [((32, 256, 4), (16, 256, 4)), ((16, 256, 4), (8, 256, 4)), ((16, 512, 4), (8, 512, 4)),
              ((8, 256, 2), (8, 256, 2)), ((16, 256, 8), (8, 256, 8)), ((8, 512, 4), (8, 512, 4)),
              ((16, 128, 4), (8, 128, 4)), ((8, 256, 4), (4, 256, 4))]  # fmt: skip


# bf16 weights ((block_n, block_k, warps) layer 1, layer 2 rows per choice at top-4): the
# table's rows first (T <= 2, T = 3..8), then neighbours in rows, K values per step and warps.
GEMV16_TILES = [((8, 256, 4), (4, 256, 4)), ((16, 128, 4), (8, 128, 4)), ((4, 256, 4), (4, 256, 4)),
                ((8, 128, 4), (4, 128, 4)), ((8, 512, 4), (4, 512, 4)), ((16, 256, 4), (8, 256, 4)),
                ((16, 128, 8), (8, 128, 8)), ((32, 64, 4), (16, 64, 4)), ((8, 256, 2), (4, 256, 2))]  # fmt: skip
TOKENS16 = (1, 2, 4, 8, 16)


def _us(fn, device, flush: str = "read") -> float:
    timing = time_fn(fn, device, flush=flush, rep_ms=60.0)
    if not timing.graph:
        raise RuntimeError("not captured into a CUDA graph (timed eagerly)")
    return timing.median_ms * 1e3


def _gemv_call(x, logits, out, m13, m2, b13, b2, tiles=None):
    """``moe_topk`` + the two ``triton_moe_gemv_mx`` launches (``tiles``: None = the table), as
    a no-argument callable returning True."""
    from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
    from tokenspeed_kernel_triton.ops.moe.gemv import gemv_moe

    def run():
        tw, ti = moe_topk(logits, K)
        args = MoEApplyArgs(
            x=x,
            w13=m13,
            w2=m2,
            topk_weights=tw,
            topk_ids=ti,
            activation=ACT,
            w13_bias=b13,
            w2_bias=b2,
            expert_map=None,
            out=out,
        )
        gemv_moe(args, tiles)
        return True

    return run


def _flush_section(rec, device, m13, m2, b13, b2, per_expert) -> None:
    from tokenspeed_kernel_nvidia.ops.moe.gluon_moe_decode import moe_decode_from_logits

    gen = torch.Generator(device=device).manual_seed(3)
    read = torch.randint(0, 100, (int(K * per_expert) // 4,), dtype=torch.int32, device=device, generator=gen)
    rows = {"torch.sum over T=1 weight bytes": lambda: read.sum()}
    for t in (1, 8):
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        logits = (2 * torch.randn(t, E, generator=gen, device=device)).bfloat16()
        out = torch.empty_like(x)
        rows[f"gluon fused T={t}"] = lambda x=x, logits=logits, out=out: moe_decode_from_logits(
            x, logits, m13, m2, K, activation=ACT, w13_bias=b13, w2_bias=b2, out=out
        )

        rows[f"gemv T={t}"] = _gemv_call(x, logits, out, m13, m2, b13, b2)
    rows.update(_decode_rows(device))
    for label, fn in rows.items():
        for mode in ("write", "read", "none"):
            us = attempt(rec["errors"], f"flush {label} {mode}", lambda fn=fn, mode=mode: _us(fn, device, mode))
            if us is not None:
                rec["flush"].append({"label": label, "flush": mode, "us": us})
                log(f"  flush={mode:5s} {label:36s} {us:8.1f} us")


def _decode_rows(device) -> dict:
    from tokenspeed_kernel import mha_decode_with_kvcache

    gen = torch.Generator(device=device).manual_seed(5)
    hq, hkv, d, ctx, page = 64, 8, 64, 8192, 16
    pages = ctx // page
    k = torch.randn(pages, page, hkv, d, device=device, generator=gen).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(pages, device=device, generator=gen).int().view(1, pages)
    lens = torch.full((1,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(1, hq, d, device=device, generator=gen).bfloat16()
    sinks = torch.randn(hq, device=device, generator=gen)
    return {
        f"decode B=1 ctx=8192 {name}": (
            lambda name=name: mha_decode_with_kvcache(q, k, v, table, lens, ctx, sinks=sinks, override=name)
        )
        for name in ("triton_decode", "gluon_decode_sm90")
    }


def _check_and_time(rec, section: str, t: int, tag: str, run, out, ref, device, **extra) -> None:
    """Run ``run`` once (it writes ``out``), compare with ``ref``; time it only if within 2e-2;
    append the row to ``rec[section]``. A failure is recorded and the row skipped."""
    if attempt(rec["errors"], f"{section} {tag} T={t}", run) is None:
        return
    torch.cuda.synchronize()
    err = rel_err(out, ref)
    us = attempt(rec["errors"], f"{section} {tag} T={t} time", lambda: _us(run, device)) if err < 2e-2 else None
    rec[section].append({"t": t, "config": tag, "rel_err": err, "us": us, **extra})
    log(f"  {section} {tag:24s} T={t}: rel {err:.2e}  {us if us is None else round(us, 1)} us")


def _gluon_section(rec, device, m13, m2, b13, b2, cases) -> None:
    from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_decode as gmd

    default = dict(gmd.CONFIGS)
    try:
        for r1, w1, r2, rw2 in GLUON_CONFIGS:
            cfg = gmd.GluonMoEDecodeConfig(rows1=r1, warps1=w1, rows2=r2, row_warps2=rw2)
            tag = f"r{r1}w{w1}/r{r2}w{rw2}"
            for t, (x, logits, ref) in cases.items():
                gmd.CONFIGS[min(t, 8)] = cfg
                out = torch.full_like(x, float("nan"))

                def run(x=x, logits=logits, out=out):
                    return gmd.moe_decode_from_logits(
                        x, logits, m13, m2, K, activation=ACT, w13_bias=b13, w2_bias=b2, out=out
                    )

                _check_and_time(rec, "gluon", t, tag, run, out, ref, device, default=cfg == default[min(t, 8)])
    finally:
        gmd.CONFIGS.clear()
        gmd.CONFIGS.update(default)


def _gemv_section(rec, device, m13, m2, b13, b2, cases) -> None:
    from tokenspeed_kernel_triton.ops.moe.gemv import GemvTile

    for l1, l2 in GEMV_TILES:
        tiles = (GemvTile(*l1), GemvTile(*l2))
        tag = f"n{l1[0]}k{l1[1]}w{l1[2]}/n{l2[0]}k{l2[1]}w{l2[2]}"
        for t, (x, logits, ref) in cases.items():
            out = torch.full_like(x, float("nan"))

            run = _gemv_call(x, logits, out, m13, m2, b13, b2, tiles)
            _check_and_time(rec, "gemv", t, tag, run, out, ref, device)


def _gemv16_runs(t, x, logits, w13, w2, b13, b2) -> dict:
    """The timed calls of one token count: ``triton_fused_moe`` and ``triton_moe_gemv`` (its
    table; the override refuses T > 8) through ``moe_apply``, then each of :data:`GEMV16_TILES`
    through ``gemv_moe``; each ``run(out)`` writes ``out`` and returns True."""
    from tokenspeed_kernel import moe_apply
    from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
    from tokenspeed_kernel_triton.ops.moe.gemv import GemvTile, gemv_moe

    def public(kernel):
        def run(out):
            w, ids = moe_topk(logits, K)
            moe_apply(x, w13, w2, w, ids, activation=ACT, w13_bias=b13, w2_bias=b2, out=out, override=kernel)
            return True

        return run

    def tiled(tiles):
        def run(out):
            w, ids = moe_topk(logits, K)
            gemv_moe(MoEApplyArgs(x, w13, w2, w, ids, ACT, b13, b2, None, out), tiles)
            return True

        return run

    kernels = ("triton_fused_moe", "triton_moe_gemv") if t <= 8 else ("triton_fused_moe",)
    runs = {f"{kernel} (table)": public(kernel) for kernel in kernels}
    for l1, l2 in GEMV16_TILES:
        runs[f"gemv n{l1[0]}k{l1[1]}w{l1[2]}/n{l2[0]}k{l2[1]}w{l2[2]}"] = tiled((GemvTile(*l1), GemvTile(*l2)))
    return runs


def _gemv16_section(rec, device, w13, w2, b13, b2) -> None:
    """bf16 weights: :func:`_gemv16_runs` at :data:`TOKENS16`, each checked against float64
    before it is timed (routing by ``moe_topk`` included)."""
    gen = torch.Generator(device=device).manual_seed(11)
    for t in TOKENS16:
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        logits = (2 * torch.randn(t, E, generator=gen, device=device)).bfloat16()
        tw, ti = moe_topk(logits, K)
        ref = reference64(x, w13, w2, b13, b2, tw, ti, ACT)
        for tag, run in _gemv16_runs(t, x, logits, w13, w2, b13, b2).items():
            out = torch.full_like(x, float("nan"))
            _check_and_time(rec, "gemv16", t, tag, lambda run=run, out=out: run(out), out, ref, device)


def _summary16(rec) -> None:
    log("\n== bf16 weights (flush=read; µs; routing included)")
    log("T    triton_fused_moe   gemv (table)   gemv best")
    for t in TOKENS16:
        rows = [r for r in rec["gemv16"] if r["t"] == t and r["us"] is not None]
        by = {r["config"]: r for r in rows}
        tiles = [r for r in rows if r["config"].startswith("gemv ")]
        best = min(tiles, key=lambda r: r["us"]) if tiles else None

        def us(r):
            return f"{r['us']:8.1f}" if r else "     n/a"

        best_cell = f"{best['us']:8.1f} {best['config']}" if best else "n/a"
        table = by.get("triton_moe_gemv (table)")
        log(f"{t:<4d} {us(by.get('triton_fused_moe (table)')):>16}   {us(table):>12}   {best_cell}")
    bad = [r for r in rec["gemv16"] if r["rel_err"] >= 2e-2]
    log(f"numerics: {'PASS' if not bad else f'FAIL ({len(bad)} configurations)'}")


def _summary(rec) -> None:
    log("\n== flush mode (µs per call, CUDA-graph replay)")
    labels = list(dict.fromkeys(r["label"] for r in rec["flush"]))
    log("call".ljust(38) + "write".rjust(9) + "read".rjust(9) + "none".rjust(9))
    for label in labels:
        cells = {r["flush"]: r["us"] for r in rec["flush"] if r["label"] == label}
        log(label.ljust(38) + "".join(f"{cells.get(m, float('nan')):9.1f}" for m in ("write", "read", "none")))
    log("\n== MoE decode sweeps (flush=read; µs; routing included)")
    log("T   gluon default         gluon best                 gemv first (table)     gemv best")
    for t in TOKENS:
        g = [r for r in rec["gluon"] if r["t"] == t and r["us"] is not None]
        v = [r for r in rec["gemv"] if r["t"] == t and r["us"] is not None]
        gd = next((r for r in g if r["default"]), None)
        gb = min(g, key=lambda r: r["us"]) if g else None
        vd = v[0] if v else None
        vb = min(v, key=lambda r: r["us"]) if v else None

        def cell(r, w=22):
            return (f"{r['us']:6.1f} {r['config']}" if r else "n/a").ljust(w)

        log(f"{t:<3d} {cell(gd)} {cell(gb, 26)} {cell(vd)} {cell(vb, 30)}")
    bad = [r for r in rec["gluon"] + rec["gemv"] if r["rel_err"] >= 2e-2]
    log(f"numerics: {'PASS' if not bad else f'FAIL ({len(bad)} configurations)'}; errors: {len(rec['errors'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sections", default="flush,gluon,gemv")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to run")
        return 0
    from tokenspeed_kernel import registry

    registry.load_backends()
    device = torch.device("cuda")
    rec = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "flush": [],
        "gluon": [],
        "gemv": [],
        "gemv16": [],
        "errors": [],
    }
    w13, w2, b13, b2 = make_weights(E, H, INTER, device)
    b13 = b13.bfloat16()
    sections = a.sections.split(",")
    if "gemv16" in sections:
        attempt(rec["errors"], "gemv16", lambda: _gemv16_section(rec, device, w13, w2, b13, b2))
        _summary16(rec)
        if sections == ["gemv16"]:
            return _finish(rec, a.json)
    m13, m2 = quantize(w13, "mxfp4"), quantize(w2, "mxfp4")
    per_expert = expert_bytes(m13, b13, None) + expert_bytes(m2, None, b2)
    gen = torch.Generator(device=device).manual_seed(7)
    cases = {}
    for t in TOKENS:
        x = torch.randn(t, H, generator=gen, device=device).bfloat16()
        logits = (2 * torch.randn(t, E, generator=gen, device=device)).bfloat16()
        tw, ti = moe_topk(logits, K)
        cases[t] = (x, logits, reference64(x, m13, m2, b13, b2, tw, ti, ACT))
    if "flush" in sections:
        attempt(rec["errors"], "flush", lambda: _flush_section(rec, device, m13, m2, b13, b2, per_expert))
    if "gluon" in sections:
        attempt(rec["errors"], "gluon", lambda: _gluon_section(rec, device, m13, m2, b13, b2, cases))
    if "gemv" in sections:
        attempt(rec["errors"], "gemv", lambda: _gemv_section(rec, device, m13, m2, b13, b2, cases))
    _summary(rec)
    return _finish(rec, a.json)


def _finish(rec, path: str | None) -> int:
    if path:
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
    return 0 if not rec["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
