"""One device call: the GPT-OSS-shaped example (examples/gpt_oss) end to end — prefill and
decode tokens/s of the library model (per forced backend and the selector's choice)
against the plain-PyTorch path, in the same run.

Model: GPT-OSS-120B layer dimensions (hidden 2880, 64 q / 8 KV heads of dim 64, window 128
alternating with full attention, sinks, 128 experts top-4, MXFP4 experts), ``--layers``
layers (default 2: one window-128, one full) and the real vocabulary (201088) for the
embedding and LM head. Random weights; the KV cache is filled with random values (decode
timing does not depend on them), page size 16.

Rows: ``torch`` (examples/gpt_oss/torch_path.py: SDPA over the gathered cache, grouped GEMMs
over bf16 weights dequantized once), ``selector`` (no overrides), ``triton`` / ``reference``
/ ``nvidia`` (kernels forced per operator; nvidia has attention kernels only, MoE stays with
the selector; the reference kernels are not graph-safe, so they run eagerly and only at
small sizes). For each context (1k, 8k) and batch (1, 16, 64, 256):

- decode: one step for the whole batch (every sequence at ``ctx`` tokens), captured in a
  CUDA graph and replayed (``tools.timing.time_fn``: CUDA events, median, L2 flushed
  between replays); eager too at batch 1 (and for the selector row at every batch).
  tokens/s = batch / step time; TPOT = step time; per layer = (step − LM head) / layers.
- prefill: ``min(batch, --prefill-tokens // ctx)`` prompts of ``ctx`` tokens in one
  ``mha_prefill`` forward (a serving engine's token budget per forward), timed eagerly.

Combinations that do not fit in memory or in the time budget are skipped with the reason
printed; every measurement is in its own try/except, so one failure never ends the run.
The JSON goes to ``--json`` (default ``$OUT/e2e.json`` when ``OUT`` is set); a short table
and the goals of issue #7 are printed last.

Usage on the device (repo root; wheels built here with ``pip wheel --no-deps -w .whl
packages/tokenspeed-kernel packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia``
and carried as ``.whl``; the examples/ directory travels with the working tree)::

    python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl && python3 ci/device/e2e_bench.py

CPU smoke test of every code path but CUDA-graph capture (tiny model, Triton under the
interpreter)::

    python3 ci/device/e2e_bench.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ROWS = ("torch", "selector", "triton", "nvidia", "reference")
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny model and sizes (CPU smoke test)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (alternating window / full)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: GPT-OSS 201088; tiny: 128)")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,16,64,256; tiny: 1,3)")
    p.add_argument("--contexts", default=None, help="comma-separated (default 1024,8192; tiny: 16,40)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"subset of {','.join(ROWS)}")
    p.add_argument("--page-size", type=int, default=None, help="KV page size (default 16; tiny: 4)")
    p.add_argument("--prefill-tokens", type=int, default=None, help="token budget of one prefill forward (16384)")
    p.add_argument("--reference-max-tokens", type=int, default=1024,
                   help="run the reference row only where batch*ctx (decode) / prefill tokens <= this")  # fmt: skip
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting measurements after this")
    p.add_argument("--rep-ms", type=float, default=100.0, help="time_fn repetition budget per measurement")
    p.add_argument("--json", default=None, help="output JSON (default $OUT/e2e.json if OUT is set)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    a.rows = [r for r in a.rows.split(",") if r]
    bad = set(a.rows) - set(ROWS)
    if bad:
        p.error(f"unknown rows {sorted(bad)}; choose from {ROWS}")
    a.batches = [int(x) for x in (a.batches or ("1,3" if a.tiny else "1,16,64,256")).split(",")]
    a.contexts = [int(x) for x in (a.contexts or ("16,40" if a.tiny else "1024,8192")).split(",")]
    a.page_size = a.page_size or (4 if a.tiny else 16)
    a.prefill_tokens = a.prefill_tokens or (64 if a.tiny else 16384)
    if a.json is None and os.environ.get("OUT"):
        a.json = os.path.join(os.environ["OUT"], "e2e.json")
    return a


# The heavy imports wait until the arguments are read: on a CPU the Triton kernels must see
# TRITON_INTERPRET=1 before they register.
def setup_env(a: argparse.Namespace) -> None:
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


@dataclass
class Clock:
    budget_s: float
    start: float = field(default_factory=time.time)

    def left(self) -> float:
        return self.budget_s - (time.time() - self.start)


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def cleanup(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception as exc:  # a sticky CUDA error: say so, later rows will fail too
            log(f"  (synchronize after a failure raised {short_error(exc)})")
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- kernels per row


def requests_of(cfg, page_size: int, *, capturable: bool = False) -> dict[str, list]:
    """The selector requests the model issues, per operator (both layer kinds), built from
    plain shapes with the public request builders. ``capturable``: the decode step (decode
    attention and the K/V store) is captured in a CUDA graph."""
    from tokenspeed_kernel import Heads, attention_request, store_request

    heads = Heads(cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    out: dict[str, list] = {}
    for op, paged, q_len in (("prefill", False, None), ("extend", True, None), ("decode", True, 1)):
        out[op] = [
            attention_request(
                f"attention.{op}",
                q_dtype=cfg.dtype,
                kv_dtype=cfg.dtype,
                heads=heads,
                window_left=w,
                sinks=True,
                page_size=page_size if paged else None,
                q_len=q_len,
                capturable=capturable and op == "decode",
            )
            for w in (cfg.sliding_window - 1, -1)
        ]
    out["store"] = [
        store_request(
            kv_dtype=cfg.dtype,
            cache_dtype=cfg.dtype,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            head_dim_v=cfg.head_dim,
            page_size=page_size,
            capturable=capturable,
        )
    ]
    return out


def serves(name: str, requests: list, device) -> str | None:
    """None if kernel ``name`` accepts every request on ``device``'s platform, else why not."""
    from tokenspeed_kernel import platform_for, select

    try:
        for r in requests:
            select(r, platform_for(device), override=name)
    except Exception as exc:  # KernelOverrideError: "override 'x' cannot serve <request> on <arch>: <reasons>"
        return str(exc).rsplit(": ", 1)[-1][:200] or type(exc).__name__
    return None


def nvidia_overrides(cfg, page_size: int, device):
    """Overrides forcing, per attention operator, the nvidia wheel's best-ranked kernel that
    serves the model's requests (decode: capturable ones, since the step is graphed; a
    kernel that plans per batch layout is re-planned through ``DecodePlan.update`` before
    every replay), or (None, reason)."""
    from examples.gpt_oss.model import Overrides
    from tokenspeed_kernel import kernels

    reqs = requests_of(cfg, page_size, capturable=device.type == "cuda")
    chosen, why = {}, []
    for op in ("prefill", "extend", "decode"):
        for name in [s.name for s in kernels(f"attention.{op}") if s.backend == "nvidia"]:  # ranked
            reason = serves(name, reqs[op], device)
            if reason is None:
                chosen[op] = name
                break
            why.append(f"{name}: {reason}")
    if not chosen:
        return None, "no nvidia kernel serves these requests" + (
            f" ({'; '.join(why)})" if why else " (wheel not installed)"
        )
    return Overrides(**chosen), None


def selected_kernels(cfg, page_size: int, device, overrides, model, *, capturable: bool) -> dict[str, str]:
    """The kernel each operator runs with ``overrides`` (window layer / full layer)."""
    from tokenspeed_kernel import platform_for, select

    out = {}
    for op, reqs in requests_of(cfg, page_size, capturable=capturable).items():
        try:
            names = {select(r, platform_for(device), override=getattr(overrides, op)).name for r in reqs}
            out[op] = "/".join(sorted(names))
        except Exception as exc:
            out[op] = f"error: {short_error(exc)}"
    out["moe"] = model.plans[0].kernel if hasattr(model, "plans") else "torch"
    return out


# ----------------------------------------------------------------------------- measurements


def kv_bytes(cfg, tokens: int) -> int:
    return 2 * cfg.num_layers * tokens * cfg.num_kv_heads * cfg.head_dim * cfg.dtype.itemsize


def fits(device, need: int, what: str) -> str | None:
    import torch

    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    if need > 0.8 * free:
        return f"{what} needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    return None


def make_kv(cfg, device, batch: int, ctx: int, page_size: int, *, extra: int = 1):
    from examples.gpt_oss.kvcache import PagedKVCache

    pages_per_seq = math.ceil((ctx + extra) / page_size)
    return PagedKVCache(
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        num_pages=batch * pages_per_seq, page_size=page_size, max_batch=batch,
        max_pages_per_seq=pages_per_seq, dtype=cfg.dtype, device=device,
    )  # fmt: skip


def time_ms(fn, device, rep_ms: float) -> float:
    from tokenspeed_kernel.tools.timing import time_fn

    return time_fn(fn, device, warmup_ms=rep_ms / 4, rep_ms=rep_ms, graph=False).median_ms


def bench_decode(model, cfg, device, batch: int, ctx: int, a, *, graph: bool, eager: bool) -> dict[str, Any]:
    """Decode step at ``ctx`` tokens for ``batch`` sequences: graph replay and/or eager ms."""
    import torch

    from examples.gpt_oss.serve import DecodeRunner

    kv = make_kv(cfg, device, batch, ctx, a.page_size)
    for t in kv.k + kv.v:
        t.normal_()
    rids = list(range(batch))
    for rid in rids:
        kv.add(rid, ctx)
    kv.set_lengths({rid: ctx for rid in rids})
    gen = torch.Generator(device=device).manual_seed(1)
    rec: dict[str, Any] = {}
    runner = None
    if graph and device.type == "cuda":
        try:
            runner = DecodeRunner(model, kv, rids, graph=True, advance=False)
        except Exception as exc:
            cleanup(device)
            rec["graph_error"] = short_error(exc)
            log(f"  graph capture failed ({rec['graph_error']}); eager only")
            eager = True
    if runner is None:
        runner = DecodeRunner(model, kv, rids, graph=False, advance=False)
    runner.tokens.copy_(torch.randint(0, cfg.vocab_size, (batch,), generator=gen, device=device))
    tokens0 = runner.tokens.clone()

    def replay() -> None:  # plan update (a no-op unless the kernel plans per layout) + replay
        runner.tokens.copy_(tokens0)
        runner.step()

    def step() -> None:
        runner.tokens.copy_(tokens0)
        runner.step_eager()

    if runner.graph is not None:
        rec["graph_ms"] = time_ms(replay, device, a.rep_ms)
    if eager or runner.graph is None:
        rec["eager_ms"] = time_ms(step, device, a.rep_ms)
    out = runner.logits
    rec["finite"] = bool(torch.isfinite(out).all())
    return rec


def bench_head(model, cfg, device, batch: int, a) -> float:
    """ms of final norm + LM head + argmax for ``batch`` rows (graph-captured on a GPU)."""
    import torch

    from tokenspeed_kernel.tools.timing import time_fn

    hidden = torch.randn(batch, cfg.hidden_size, device=device, dtype=cfg.dtype)
    return time_fn(lambda: model.logits(hidden).argmax(-1), device, rep_ms=a.rep_ms).median_ms


def bench_prefill(model, cfg, device, n: int, ctx: int, a) -> dict[str, Any]:
    """One prefill forward of ``n`` prompts of ``ctx`` tokens (+ last-token logits), eager."""
    import torch

    from examples.gpt_oss.serve import Engine

    kv = make_kv(cfg, device, n, ctx, a.page_size, extra=0)
    engine = Engine(model, kv)
    gen = torch.Generator(device=device).manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (ctx,), generator=gen, device=device) for _ in range(n)]
    out: list = []

    def run() -> None:
        rids = engine.add_requests([ctx] * n, 0)
        out[:] = [engine.prefill(rids, prompts)]
        for rid in rids:
            kv.free(rid)

    ms = time_ms(run, device, a.rep_ms)
    finite = bool(torch.isfinite(out[0]).all())
    return {"ms": ms, "tokens": n * ctx, "tok_s": n * ctx / (ms * 1e-3), "finite": finite}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    setup_env(a)
    import torch
    import triton

    import tokenspeed_kernel
    from examples.gpt_oss import GptOssConfig, GptOssModel, TorchGptOss, random_weights
    from examples.gpt_oss.serve import OVERRIDE_PRESETS

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: use --device cpu --tiny")
        return 2
    clock = Clock(a.budget_s)
    if a.tiny:
        cfg = GptOssConfig.tiny(num_layers=a.layers, **({"vocab_size": a.vocab} if a.vocab else {}))
    else:
        cfg = GptOssConfig.gpt_oss_120b(num_layers=a.layers, **({"vocab_size": a.vocab} if a.vocab else {}))
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record: dict[str, Any] = {
        "device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
        "tokenspeed_kernel": tokenspeed_kernel.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
        "config": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in vars(cfg).items()},
        "args": {k: v for k, v in vars(a).items() if k != "json"}, "rows": {}, "decode": [], "prefill": [],
        "head": {}, "skipped": [],
    }  # fmt: skip
    log(f"device {dev_name}  torch {torch.__version__}  triton {triton.__version__}  layers {cfg.num_layers}")
    log(f"backends: {', '.join(f'{b.name}={b.state}' for b in tokenspeed_kernel.backends())}")

    t0 = time.time()
    weights = random_weights(cfg, device, seed=a.seed)
    log(f"weights ready in {time.time() - t0:.1f}s")

    models: dict[str, Any] = {}
    for row in a.rows:
        try:
            t0 = time.time()
            if row == "torch":
                models[row] = TorchGptOss(cfg, weights)
                record["rows"][row] = {"kernels": "plain PyTorch (SDPA, grouped GEMM, bf16 experts)"}
            else:
                if row == "nvidia":
                    overrides, why = nvidia_overrides(cfg, a.page_size, device)
                    if overrides is None:
                        raise RuntimeError(why)
                else:
                    overrides = OVERRIDE_PRESETS[row]
                models[row] = GptOssModel(cfg, weights, overrides)
                graphed = device.type == "cuda" and row != "reference"
                kernels_used = selected_kernels(cfg, a.page_size, device, overrides, models[row], capturable=graphed)
                record["rows"][row] = {"kernels": kernels_used}
            log(f"row {row}: ready in {time.time() - t0:.1f}s: {record['rows'][row]['kernels']}")
        except Exception as exc:
            record["rows"][row] = {"error": short_error(exc)}
            log(f"row {row}: SKIPPED ({short_error(exc)})")
            cleanup(device)

    # the goal points first, so a short budget still measures them
    order = [(8192, 64), (1024, 1), (8192, 1), (1024, 16), (1024, 64), (8192, 16), (1024, 256), (8192, 256)]
    combos = [c for c in order if c[0] in a.contexts and c[1] in a.batches]
    combos += [(c, b) for c in a.contexts for b in a.batches if (c, b) not in combos]
    prefill_done: dict[tuple[str, int, int], dict] = {}
    for ctx, batch in combos:
        need = fits(device, kv_bytes(cfg, batch * (ctx + a.page_size)) * 2, f"B={batch} ctx={ctx} (KV + gathers)")
        if need:
            log(f"B={batch} ctx={ctx}: SKIPPED ({need})")
            record["skipped"].append({"ctx": ctx, "batch": batch, "reason": need})
            continue
        if batch not in record["head"] and models:
            try:
                record["head"][batch] = bench_head(next(iter(models.values())), cfg, device, batch, a)
            except Exception as exc:
                log(f"LM head B={batch}: failed ({short_error(exc)})")
        n_prefill = max(1, min(batch, a.prefill_tokens // ctx))
        for row, model in models.items():
            base = {"row": row, "ctx": ctx, "batch": batch}
            # ---- decode
            if clock.left() < 0:
                record["skipped"].append({**base, "reason": "time budget"})
                log(f"{row} B={batch} ctx={ctx}: SKIPPED (time budget of {a.budget_s:.0f}s spent)")
                continue
            if row == "reference" and batch * ctx > a.reference_max_tokens:
                reason = f"reference kernels are slow; batch*ctx {batch * ctx} > --reference-max-tokens"
                record["skipped"].append({**base, "phase": "decode", "reason": reason})
                log(f"decode  {row:9s} B={batch} ctx={ctx}: SKIPPED ({reason})")
            else:
                try:
                    rec = bench_decode(model, cfg, device, batch, ctx, a, graph=row != "reference",
                                       eager=batch == 1 or row == "selector")  # fmt: skip
                    ms = rec.get("graph_ms", rec.get("eager_ms"))
                    head = record["head"].get(batch, 0.0)
                    rec.update(base, step_ms=ms, tok_s=batch / (ms * 1e-3), tpot_ms=ms,
                               per_layer_ms=(ms - head) / cfg.num_layers)  # fmt: skip
                    record["decode"].append(rec)
                    ratio = f"  graph/eager {rec['eager_ms'] / rec['graph_ms']:.2f}x" if "graph_ms" in rec and "eager_ms" in rec else ""  # fmt: skip
                    log(f"decode  {row:9s} B={batch:<4d} ctx={ctx:<5d} step {ms:8.3f} ms  {rec['tok_s']:9.1f} tok/s  "
                        f"{rec['per_layer_ms']:7.3f} ms/layer  {'graph' if 'graph_ms' in rec else 'eager'}{ratio}"
                        f"{'' if rec['finite'] else '  NON-FINITE LOGITS'}")  # fmt: skip
                except Exception as exc:
                    record["decode"].append({**base, "error": short_error(exc)})
                    log(f"decode  {row:9s} B={batch} ctx={ctx}: FAILED {short_error(exc)}")
                    traceback.print_exc(limit=4)
                    cleanup(device)
            # ---- prefill (once per row, ctx and prompts per forward)
            key = (row, ctx, n_prefill)
            if key in prefill_done:
                continue
            if row == "reference" and n_prefill * ctx > a.reference_max_tokens:
                reason = f"reference kernels are slow; {n_prefill * ctx} tokens > --reference-max-tokens"
                prefill_done[key] = {"skipped": reason}
                record["skipped"].append({**base, "phase": "prefill", "prompts": n_prefill, "reason": reason})
                log(f"prefill {row:9s} {n_prefill} x {ctx}: SKIPPED ({reason})")
                continue
            if clock.left() < 0:
                record["skipped"].append({**base, "phase": "prefill", "reason": "time budget"})
                log(f"prefill {row:9s} {n_prefill} x {ctx}: SKIPPED (time budget of {a.budget_s:.0f}s spent)")
                continue
            try:
                rec = {**base, "prompts": n_prefill, **bench_prefill(model, cfg, device, n_prefill, ctx, a)}
                prefill_done[key] = rec
                record["prefill"].append(rec)
                log(f"prefill {row:9s} {n_prefill} x {ctx} tokens: {rec['ms']:9.2f} ms  {rec['tok_s']:10.0f} tok/s"
                    f"{'' if rec['finite'] else '  NON-FINITE LOGITS'}")  # fmt: skip
            except Exception as exc:
                prefill_done[key] = {"error": short_error(exc)}
                record["prefill"].append({**base, "prompts": n_prefill, "error": short_error(exc)})
                log(f"prefill {row:9s} {n_prefill} x {ctx}: FAILED {short_error(exc)}")
                traceback.print_exc(limit=4)
                cleanup(device)
        cleanup(device)

    record["goals"] = goals(record)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(record, f, indent=1, default=str)
        log(f"wrote {a.json}")
    summary(record, cfg)
    return 0


# ----------------------------------------------------------------------------- report


def _find(rows: list[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items()) and "error" not in r), None)


def goals(record: dict) -> list[str]:
    out = []
    dec, pre = record["decode"], record["prefill"]
    sel, base = _find(dec, row="selector", ctx=8192, batch=64), _find(dec, row="torch", ctx=8192, batch=64)
    if sel and base:
        r = sel["tok_s"] / base["tok_s"]
        out.append(f"decode B=64 ctx=8k: selector {r:.2f}x torch (goal >= 2) {'MET' if r >= 2 else 'MISSED'}")
    else:
        out.append("decode B=64 ctx=8k: not measured")
    for ctx in sorted({r["ctx"] for r in dec}):
        s = _find(dec, row="selector", ctx=ctx, batch=1)
        if s and "graph_ms" in s and "eager_ms" in s:
            r = s["eager_ms"] / s["graph_ms"]
            out.append(f"graph/eager B=1 ctx={ctx}: {r:.2f}x (goal >= 1.3) {'MET' if r >= 1.3 else 'MISSED'}")
    for ctx in sorted({r["ctx"] for r in pre}):
        sel = [r for r in pre if r["row"] == "selector" and r["ctx"] == ctx and "error" not in r]
        for s in sel:
            b = _find(pre, row="torch", ctx=ctx, prompts=s["prompts"])
            if b:
                r = s["tok_s"] / b["tok_s"]
                out.append(f"prefill {s['prompts']}x{ctx}: selector {r:.2f}x torch (goal >= 1.5) {'MET' if r >= 1.5 else 'MISSED'}")  # fmt: skip
    return out


def summary(record: dict, cfg) -> None:
    print("\n== e2e: GPT-OSS-shaped decoder, "
          f"{cfg.num_layers} layers, {record['device']}, torch {record['torch']}, triton {record['triton']}")  # fmt: skip
    for row, info in record["rows"].items():
        print(f"   {row:9s} {info.get('kernels', info.get('error'))}")
    rows = list(record["rows"])
    print("decode: tok/s (graph replay unless marked e) and ms/layer; x = vs torch")
    print(f"{'ctx':>5} {'B':>4}  " + "  ".join(f"{r:>22s}" for r in rows))
    for ctx, batch in sorted({(r["ctx"], r["batch"]) for r in record["decode"]}):
        base = _find(record["decode"], row="torch", ctx=ctx, batch=batch)
        cells = []
        for row in rows:
            r = _find(record["decode"], row=row, ctx=ctx, batch=batch)
            if r is None:
                cells.append(f"{'-':>22s}")
                continue
            x = f" {r['tok_s'] / base['tok_s']:4.2f}x" if base else ""
            mark = "" if "graph_ms" in r else "e"
            cells.append(f"{r['tok_s']:9.0f}{mark:1s} {r['per_layer_ms']:6.3f}{x:>6s}")
        print(f"{ctx:>5} {batch:>4}  " + "  ".join(cells))
    print("prefill: tok/s (prompts x ctx per forward); x = vs torch")
    for ctx, n in sorted({(r["ctx"], r["prompts"]) for r in record["prefill"]}):
        base = _find(record["prefill"], row="torch", ctx=ctx, prompts=n)
        cells = []
        for row in rows:
            r = _find(record["prefill"], row=row, ctx=ctx, prompts=n)
            x = f" {r['tok_s'] / base['tok_s']:4.2f}x" if (r and base) else ""
            cells.append(f"{r['tok_s']:15.0f}{x:>6s}" if r else f"{'-':>21s}")
        print(f"{n:>3} x {ctx:<5}  " + "  ".join(cells))
    for s in record["skipped"]:
        print(f"skipped: {s}")
    print("== goals: " + "; ".join(record["goals"]))


if __name__ == "__main__":
    sys.exit(main())
