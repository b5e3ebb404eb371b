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
import json
import math
import sys
import time

import torch
import triton

from tokenspeed_kernel.ops.moe import moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight, quantize_fp8, quantize_mxfp4
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


class Clock:
    def __init__(self, budget: float) -> None:
        self.end = time.time() + budget

    def left(self) -> float:
        return self.end - time.time()


def log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- weights and reference


def make_weights(e: int, h: int, i: int, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=device)
    for j in range(e):
        w13[j] = (torch.randn(2 * i, h, generator=gen, device=device) / math.sqrt(h)).bfloat16()
        w2[j] = (torch.randn(h, i, generator=gen, device=device) / math.sqrt(i)).bfloat16()
    b13 = 0.5 * torch.randn(e, 2 * i, generator=gen, device=device)
    b2 = (0.5 * torch.randn(e, h, generator=gen, device=device)).bfloat16()
    return w13, w2, b13, b2


def quantize(w: torch.Tensor, fmt: str):
    if fmt == "bf16":
        return w
    parts = [quantize_mxfp4(p) if fmt == "mxfp4" else quantize_fp8(p, fmt.removeprefix("fp8_per_").removeprefix("fp8_"))
             for p in w]  # fmt: skip
    if fmt == "mxfp4":
        return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scales for p in parts]))
    return FP8Weight(torch.stack([p.data for p in parts]), torch.stack([p.scale for p in parts]))


def expert64(w, e: int) -> torch.Tensor:
    if isinstance(w, MXFP4Weight):
        return MXFP4Weight(w.packed[e : e + 1], w.scales[e : e + 1]).dequantize(torch.float64)[0]
    if isinstance(w, FP8Weight):
        return FP8Weight(w.data[e : e + 1], w.scale[e : e + 1]).dequantize(torch.float64)[0]
    return w[e].double()


def act64(name: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return g * torch.sigmoid(g) * u
    g = g.clamp(max=7.0)
    return g * torch.sigmoid(1.702 * g) * (u.clamp(-7.0, 7.0) + 1.0)


def reference64(x, w13, w2, b13, b2, weights, ids, activation, expert_map=None, quant=None):
    """float64 MoE on the device, one expert at a time (``quant``: applied to x and to each
    intermediate, e.g. the fake fp8 activation quantization)."""
    x64 = x.double() if quant is None else quant(x.double())
    out = torch.zeros_like(x64)
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    inter = w2.shape[-1]
    for e in torch.unique(local[local >= 0]).tolist():
        rows, cols = torch.nonzero(local == e, as_tuple=True)
        h = x64[rows] @ expert64(w13, e).T
        if b13 is not None:
            h = h + b13[e].double()
        a_ = act64(activation, h[:, :inter], h[:, inter:])
        y = (a_ if quant is None else quant(a_)) @ expert64(w2, e).T
        if b2 is not None:
            y = y + b2[e].double()
        out.index_add_(0, rows, y * weights[rows, cols].double()[:, None])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


# ---------------------------------------------------------------- timing


def time_fn(fn, rot: int, device) -> tuple[float, str]:
    """Milliseconds per call of ``fn`` (which runs ``rot`` calls), through a CUDA graph."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3 / rot, "cpu"
    from triton.testing import do_bench

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        ms = do_bench(graph.replay, warmup=20, rep=80, return_mode="median")
        return ms / rot, "graph"
    except Exception as exc:  # not capturable: eager
        log(f"  (graph capture failed: {str(exc).splitlines()[0][:100]}; eager timing)")
        torch.cuda.synchronize()
        return do_bench(fn, warmup=20, rep=80, return_mode="median") / rot, "eager"


def bench_inputs(t: int, h: int, e: int, k: int, gen, device) -> tuple[int, list, list, float]:
    """``rot`` different inputs and router logits for one timed replay at ``t`` tokens, and
    the mean number of experts their top-``k`` hits."""
    rot = 8 if t <= 64 else 2 if t <= 512 else 1
    xs = [torch.randn(t, h, generator=gen, device=device).bfloat16() for _ in range(rot)]
    ls = [(2 * torch.randn(t, e, generator=gen, device=device)).bfloat16() for _ in range(rot)]
    hit = sum(int(torch.unique(torch.topk(l_.float(), k).indices).numel()) for l_ in ls) / rot
    return rot, xs, ls, hit


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device copy, counting bytes read plus written."""
    if device.type != "cuda":
        return float("nan")
    from triton.testing import do_bench

    src = torch.empty(2**30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    return 2 * 2**30 / (ms * 1e-3)


def torch_pipeline(x, logits, w13, w2, b13, b2, top_k: int, activation: str):
    """The baseline: torch routing, sort by expert, torch._grouped_mm (bf16), no host sync."""
    num_experts, inter = w13.shape[0], w2.shape[-1]
    scores = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    tokens = order // top_k
    experts = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[tokens], w13.transpose(1, 2), offs=offs)
    if b13 is not None:
        h = h + b13[experts].to(h.dtype)
    g, u = h[:, :inter].float(), h[:, inter:].float()
    if activation == "silu":
        a = g * torch.sigmoid(g) * u
    else:
        g = g.clamp(max=7.0)
        a = g * torch.sigmoid(1.702 * g) * (u.clamp(-7.0, 7.0) + 1.0)
    y = torch._grouped_mm(a.to(x.dtype), w2.transpose(1, 2), offs=offs)
    if b2 is not None:
        y = y + b2[experts]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tokens, y.float() * weights.reshape(-1)[order, None])
    return out.to(x.dtype)


def expert_bytes(w, b13, b2) -> float:
    def size(t):
        return t.numel() * t.element_size()

    parts = (
        [w.packed, w.scales] if isinstance(w, MXFP4Weight) else [w.data, w.scale] if isinstance(w, FP8Weight) else [w]
    )
    total = sum(size(p) for p in parts) / parts[0].shape[0]
    return total


# ---------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--budget", type=float, default=420.0, help="seconds; later steps are skipped past it")
    p.add_argument("--json", default="")
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--no-sweep", action="store_true")
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
    record: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"),
                    "numerics": [], "bench": [], "sweep": [], "combine": [], "fp8_act": []}  # fmt: skip
    log("device", record["device"], "torch", record["torch"], "triton", record["triton"])
    copy_bw = copy_bandwidth(device)
    record["copy_bw"] = copy_bw
    log(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")

    w13, w2, b13, b2 = make_weights(e, h, i, device)
    weights = {"bf16": (w13, w2)}
    for fmt in FORMATS[1:]:
        weights[fmt] = (quantize(w13, fmt), quantize(w2, fmt))
    log(f"weights ready ({time.time() - clock.end + a.budget:.0f}s)")

    # ---- numerics: every format, GPT-OSS shapes, vs float64
    gen = torch.Generator(device=device).manual_seed(1)
    checks = [(fmt, t, "swiglu_oai", True, False) for fmt in FORMATS for t in ((5, 33) if a.dry else (3, 64, 4096))]
    checks += [("bf16", 33 if a.dry else 512, "silu", False, True), ("mxfp4", 17, "silu", False, True)]
    for fmt, t, activation, bias, with_map in checks:
        if clock.left() < 60:
            log("numerics: out of time budget, skipping the rest")
            break
        x = torch.randn(t, h, generator=gen, device=device).bfloat16()
        logits = 2 * torch.randn(t, e, generator=gen, device=device)
        tw, ti = moe_topk(logits.bfloat16(), k)
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
    for t in token_counts:
        if clock.left() < 45:
            log("bench: out of time budget, skipping the rest")
            break
        rot, xs, ls, hit = bench_inputs(t, h, e, k, gen, device)
        flops = 2.0 * t * k * 3 * h * i
        row = {"T": t, "experts_hit": hit}
        if has_grouped_mm:

            def base(xs=xs, ls=ls):
                for x_, l_ in zip(xs, ls):
                    torch_pipeline(x_, l_, w13, w2, b13, b2, k, "swiglu_oai")

            row["torch_ms"], row["torch_mode"] = time_fn(base, rot, device)
        for fmt in BENCH_FORMATS:
            plan = plans[fmt]

            def ours(xs=xs, ls=ls, plan=plan):
                for x_, l_ in zip(xs, ls):
                    tw_, ti_ = moe_topk(l_, k)
                    plan.apply(x_, tw_, ti_)

            ms, mode = time_fn(ours, rot, device)
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
            rot = 8 if t <= 64 else 2 if t <= 512 else 1
            xs = [torch.randn(t, h, generator=gen, device=device).bfloat16() for _ in range(rot)]
            routes = [moe_topk((2 * torch.randn(t, e, generator=gen, device=device)).bfloat16(), k) for _ in range(rot)]
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
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1)
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
            x = torch.randn(t, h, generator=gen, device=device).bfloat16()
            tw, ti = moe_topk((2 * torch.randn(t, e, generator=gen, device=device)).bfloat16(), k)
            out = act_plans[fmt].apply(x, tw, ti)
            group = FP8_BLOCK if fmt == "fp8_block" else None
            ref = reference64(x, *weights[fmt], b13, b2, tw, ti, "swiglu_oai",
                              quant=lambda v, g=group: fake_quantize_fp8_per_token(v, g))  # fmt: skip
            err = rel_err(out, ref)
            ok = bool(not torch.isnan(out).any() and err < 3e-2)
            record["numerics"].append({"format": f"{fmt}+fp8_act", "T": t, "activation": "swiglu_oai", "bias": True,
                                       "expert_map": False, "rel_err": err, "ok": ok})  # fmt: skip
            log(f"numerics {fmt}+fp8_act T={t} rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")
    for t in token_counts:
        if clock.left() < 30:
            log("fp8_act: out of time budget, skipping the rest")
            break
        rot, xs, ls, _ = bench_inputs(t, h, e, k, gen, device)
        row = {"T": t}
        for fmt in FP8_ACT_FORMATS:
            for label, plan in (("bf16act", plans[fmt]), ("fp8act", act_plans[fmt])):

                def ours(xs=xs, ls=ls, plan=plan):
                    for x_, l_ in zip(xs, ls):
                        tw_, ti_ = moe_topk(l_, k)
                        plan.apply(x_, tw_, ti_)

                row[f"{fmt}_{label}_ms"], _ = time_fn(ours, rot, device)
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
        x = torch.randn(t, h, generator=gen, device=device).bfloat16()
        tw, ti = moe_topk((2 * torch.randn(t, e, generator=gen, device=device)).bfloat16(), k)
        args = MoEApplyArgs(x, plan.w13, plan.w2, tw, ti, "swiglu_oai", b13, b2, None, torch.full_like(x, float("nan")),
                            plan.prepared)  # fmt: skip
        fused.fused_moe(args, combine="atomic")
        err = rel_err(args.out, reference64(x, *weights[fmt], b13, b2, tw, ti, "swiglu_oai"))
        ok = bool(not torch.isnan(args.out).any() and err < 2e-2)
        record["numerics"].append({"format": f"{fmt}+atomic", "T": t, "activation": "swiglu_oai", "bias": True,
                                   "expert_map": False, "rel_err": err, "ok": ok})  # fmt: skip
        log(f"numerics {fmt}+atomic T={t} rel_err={err:.2e} {'PASS' if ok else 'FAIL'}")
    for t in token_counts:
        if clock.left() < 30:
            log("combine: out of time budget, skipping the rest")
            break
        rot = 8 if t <= 64 else 2 if t <= 512 else 1
        xs = [torch.randn(t, h, generator=gen, device=device).bfloat16() for _ in range(rot)]
        routes = [moe_topk((2 * torch.randn(t, e, generator=gen, device=device)).bfloat16(), k) for _ in range(rot)]
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


def vars_of(w):
    return (w.packed, w.scales) if isinstance(w, MXFP4Weight) else (w.data, w.scale)


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
        log("T     " + "  ".join(f"{fmt}: bf16act_us fp8act_us (x)" for fmt in FP8_ACT_FORMATS))
        for r in record["fp8_act"]:
            log(f"{r['T']:<5d} " + "  ".join(
                f"{r[f'{fmt}_bf16act_ms'] * 1e3:9.1f} {r[f'{fmt}_fp8act_ms'] * 1e3:9.1f} "
                f"({r[f'{fmt}_bf16act_ms'] / r[f'{fmt}_fp8act_ms']:4.2f})" for fmt in FP8_ACT_FORMATS))  # fmt: skip
    if record.get("combine"):
        log("T     " + "  ".join(f"{fmt}: reduce_us atomic_us (x)" for fmt in COMBINE_FORMATS))
        for r in record["combine"]:
            log(f"{r['T']:<5d} " + "  ".join(
                f"{r[f'{fmt}_reduce_ms'] * 1e3:9.1f} {r[f'{fmt}_atomic_ms'] * 1e3:9.1f} "
                f"({r[f'{fmt}_reduce_ms'] / r[f'{fmt}_atomic_ms']:4.2f})" for fmt in COMBINE_FORMATS))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
