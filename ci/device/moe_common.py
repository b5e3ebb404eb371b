"""Helpers shared by the MoE device scripts (``moe_bench.py``, ``moe_mx_bench.py``,
``moe_gemv_bench.py``, ``gluon_moe_bench.py``): weights and their float64 reference, the
torch baseline, CUDA-graph timing with rotated routings, the run record and its guards.
Imported as ``moe_common`` (the scripts run from this folder: ``python3 ci/device/...``).
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback

import torch
import triton

from tokenspeed_kernel.ops.moe import moe_plan, moe_topk
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight, quantize_fp8, quantize_mxfp4


class Clock:
    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.end = time.time() + budget

    def elapsed(self) -> float:
        return self.budget - self.left()

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


def rotations(t: int) -> int:
    """How many routings one timed replay at ``t`` tokens runs back to back (``ROT``)."""
    return 8 if t <= 64 else 2 if t <= 512 else 1


def rotated_inputs(t: int, h: int, e: int, gen, device) -> tuple[list, list]:
    """``rotations(t)`` bf16 inputs ``[t, h]``, then as many bf16 router logits ``[t, e]``."""
    rot = rotations(t)
    xs = [torch.randn(t, h, generator=gen, device=device).bfloat16() for _ in range(rot)]
    ls = [(2 * torch.randn(t, e, generator=gen, device=device)).bfloat16() for _ in range(rot)]
    return xs, ls


def bench_inputs(t: int, h: int, e: int, k: int, gen, device) -> tuple[int, list, list, float]:
    """``rot`` different inputs and router logits for one timed replay at ``t`` tokens, and
    the mean number of experts their top-``k`` hits."""
    xs, ls = rotated_inputs(t, h, e, gen, device)
    rot = len(xs)
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


def vars_of(w):
    return (w.packed, w.scales) if isinstance(w, MXFP4Weight) else (w.data, w.scale)


# ---------------------------------------------------------------- run record and guards


def add_run_args(p, budget: float, dry_help: str) -> None:
    """The options every MoE bench takes: ``--budget``, ``--json``, ``--dry``, ``--no-sweep``."""
    p.add_argument("--budget", type=float, default=budget, help="seconds; later steps are skipped past it")
    p.add_argument("--json", default="")
    p.add_argument("--dry", action="store_true", help=dry_help)
    p.add_argument("--no-sweep", action="store_true")


def mx_run_setup(dry: bool, mode: str, clock: Clock):
    """Device, dims ``(E, top_k, H, I)`` (GPT-OSS-120B; tiny with ``dry``), the run record,
    the bf16 weights and biases ``(w13, w2, b13, b2)`` and their MXFP4 ``(m13, m2)``."""
    device = torch.device("cpu" if dry else "cuda")
    dims = (8, 2, 64, 32) if dry else (128, 4, 2880, 2880)  # E, top_k, H, I
    record = start_record(device, "numerics", "bench", "sweep", "errors", mode=mode)
    e, _, h, i = dims
    w13, w2, b13, b2 = make_weights(e, h, i, device)
    m13, m2 = quantize(w13, "mxfp4"), quantize(w2, "mxfp4")
    log(f"weights ready ({clock.elapsed():.0f}s)")
    return device, dims, record, (w13, w2, b13, b2), (m13, m2)


def numerics_ok(record: dict) -> bool:
    return bool(record["numerics"]) and all(r["ok"] for r in record["numerics"])


def start_record(device, *lists: str, mode: str | None = None) -> dict:
    """The run's JSON record (device, ``mode``, versions, date, an empty list per name in
    ``lists``), logged as one line."""
    record: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if mode is not None:
        record["mode"] = mode
    record |= {"torch": torch.__version__, "triton": triton.__version__, "date": time.strftime("%Y-%m-%d")}
    record |= {name: [] for name in lists}
    log("device", record["device"], "torch", record["torch"], "triton", record["triton"])
    return record


def write_record(record: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def out_path(given: str, name: str) -> str:
    """``given``, else ``name`` under ``$OUT`` (``/tmp`` without it)."""
    return given or os.path.join(os.environ.get("OUT", "/tmp"), name)


def within_budget(items, clock: Clock, reserve: float, what: str):
    """``items`` while more than ``reserve`` seconds are left; then a log line and stop."""
    for item in items:
        if clock.left() < reserve:
            log(f"{what}: out of time budget, skipping the rest")
            return
        yield item


def attempt(errors: list, label: str, fn):
    """``fn()``; on an exception log it, record it under ``label`` and return None."""
    try:
        return fn()
    except Exception as exc:  # one failing case must not stop the run
        log(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        errors.append({"case": label, "error": traceback.format_exc()[-1500:]})
        return None


def attempt_time(errors: list, label: str, fn, rot: int, device) -> float | None:
    """``time_fn(fn, rot, device)``'s milliseconds per call through :func:`attempt`."""
    return attempt(errors, label, lambda: time_fn(fn, rot, device)[0])


def log_numerics(record: dict, kernel: str, detail) -> list:
    """Log the numerics verdict of ``kernel`` (``detail(row)`` per failed row) and the error
    count; return the failed rows."""
    bad = [r for r in record["numerics"] if not r["ok"]]
    log(f"\n== numerics ({kernel} vs float64): {len(record['numerics']) - len(bad)}/{len(record['numerics'])} PASS"
        + "".join(f"; FAIL T={r['T']} {detail(r)} err={r['rel_err']:.1e}" for r in bad))  # fmt: skip
    log(f"== errors: {len(record['errors'])}  device {record['device']}  triton {record['triton']}")
    return bad


def best_by(rows: list, key) -> dict:
    """The fastest (least ``ms``) row of ``rows`` per ``key(row)``."""
    best: dict = {}
    for r in rows:
        if key(r) not in best or r["ms"] < best[key(r)]["ms"]:
            best[key(r)] = r
    return best


def us_or_na(row: dict, name: str) -> str:
    """``row[name]`` (milliseconds) in µs, or ``n/a`` when it was not measured."""
    return f"{row[name] * 1e3:.1f}" if row.get(name) else "n/a"


# ---------------------------------------------------------------- inputs, plans and timed steps


def route(t: int, e: int, h: int, k: int, gen, device):
    """``t`` bf16 tokens and their top-``k`` routing over ``e`` experts (``moe_topk``)."""
    x = torch.randn(t, h, generator=gen, device=device).bfloat16()
    tw, ti = moe_topk((2 * torch.randn(t, e, generator=gen, device=device)).bfloat16(), k)
    return x, tw, ti


def mx_case(m13, m2, b13, b2, e: int, bias: bool, with_map: bool, device):
    """(w13, w2, w13 bias, w2 bias, expert map) of one MXFP4 numerics case: with the map the
    even experts are local, in reversed order, and the odd ones remote (-1)."""
    w13, w2, emap = m13, m2, None
    if with_map:
        emap = torch.full((e,), -1, dtype=torch.int32, device=device)
        emap[0::2] = torch.arange(e // 2 - 1, -1, -1, dtype=torch.int32, device=device)
        w13 = MXFP4Weight(m13.packed[: e // 2], m13.scales[: e // 2])
        w2 = MXFP4Weight(m2.packed[: e // 2], m2.scales[: e // 2])
    bb13, bb2 = (b13[: w13.shape[0]], b2[: w13.shape[0]]) if bias else (None, None)
    return w13, w2, bb13, bb2, emap


def plan_each(errors: list, names, m13, m2, k: int, b13, b2) -> dict:
    """``moe_plan`` (swiglu_oai, biases) per kernel name in ``names``; a failed one is left out."""
    plans = {}
    for name in names:
        plan = attempt(errors, f"plan {name}", lambda name=name: moe_plan(
            m13, m2, x_dtype=torch.bfloat16, top_k=k, activation="swiglu_oai", w13_bias=b13, w2_bias=b2,
            override=name))  # fmt: skip
        if plan is not None:
            plans[name] = plan
    return plans


def routed_calls(xs, ls, plan, k: int):
    """One timed step: ``moe_topk`` + ``plan.apply`` over every rotated input."""

    def run():
        for x_, l_ in zip(xs, ls):
            tw_, ti_ = moe_topk(l_, k)
            plan.apply(x_, tw_, ti_)

    return run


def torch_calls(xs, ls, w13, w2, b13, b2, k: int):
    """One timed step of the torch baseline (swiglu_oai) over every rotated input."""

    def run():
        for x_, l_ in zip(xs, ls):
            torch_pipeline(x_, l_, w13, w2, b13, b2, k, "swiglu_oai")

    return run
