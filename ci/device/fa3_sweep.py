"""Launch configurations of ``gluon_prefill_fa3_sm90`` at GPT-OSS-120B prefill sizes, D 64 and 128 (one call).

Issue 20: the FA3-style Gluon prefill aims at >= ~480 TFLOP/s for causal S = 8192 and
B = 4 x 4096 with 64 query / 8 KV heads, head dim 64, bf16, sinks (``triton_prefill`` ~360,
FA4 ~530 on an H200). Each case times every configuration of :data:`CONFIGS` for its head
dim through the module's launcher: the shipped one first, then the opt-in variants
(``ov``: the P·V wait after the softmax; ``ex<k>``: k of every 8 exp2 on the FMA pipe;
``wg3``: three consumer warpgroups, 192-row tiles; ``lz8``: the lazy rescale, threshold 8)
and the older alternatives (K/V tile, ring depth, ping-pong off; ``--variants`` leaves
those out), and
``triton_prefill`` and ``fa4_prefill_sm90`` (when its AOT bundle or JIT extra is present;
else the row says why) through the public call. Every configuration and peer is first
checked against a float64 attention of :data:`CHECK_HEADS` (five heads of four KV heads,
group ends included; relative Frobenius error < 2e-2) and timed only if it passes, by CUDA-graph replay (``tools.timing.time_fn``, L2 flushed by a read).
TFLOP/s count the causal half: ``4 * B * Hq * D * S * (S + 1) / 2``.

``--window W`` times the sliding-window build (``gluon_prefill_fa3_window_sm90``) instead:
its configurations of :data:`WINDOW_CONFIGS` (the shipped 64-key tiles first, then
``pv_overlap`` and 128-key tiles) at window ``W`` with sinks, next to
``gluon_prefill_window_sm90``, ``triton_prefill`` and FA4 (the peers of
:data:`WINDOW_PEERS`), checked against the windowed float64 attention; TFLOP/s count the
pairs a window shows, ``4 * B * Hq * D * sum_i (min(i, W) + 1)``. Issue 20's goal there:
>= 2x ``flex_attention`` at GPT-OSS's window 127 (S = 8192, H200: flex 180.6 us,
``gluon_prefill_window_sm90`` ~120 us).

``--window W --classic`` times ``gluon_prefill_window_sm90`` (the shipped window kernel, GQA
group packed into the tile's rows) instead: its shipped configuration, then the opt-in variants of
``gluon_prefill.window_variants`` (the persistent build at 5 and 6 programs per SM, the tiles it
replaced, ring depth, key tile, the next tile's Q·Kᵀ ahead of the softmax, a register cap)
through its uncached launcher, then the same peers.

``--clean-ab``: the shipped configuration, then the same without the V cleaning
(``Fa3Config.clean_v=False``, tag ``-nocl``: byte-identical to the kernel before the fix, which
leaks unseen NaN; a timing reference only), then the peers: the cleaning's cost in one call.

Usage (repository root, wheels installed): ``python3 ci/device/fa3_sweep.py [--quick |
--variants | --clean-ab] [--head-dim D] [--window W] [--budget-s S] [--json FILE]``
(``--quick``: the shipped configuration and the peers only; ``--head-dim``: only the cases of
that head dim; ``--budget-s``: rows not started within S seconds are
listed as skipped, so the table always prints); the cases run D = 64 first; prints one table last (with each row's
speed relative to the shipped configuration of its case) and writes JSON (default
``$OUT/fa3_sweep.json``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import torch

DEV = torch.device("cuda")
HQ, HKV = 64, 8
CASES = ((1, 8192, 64), (4, 4096, 64), (1, 8192, 128), (4, 4096, 128))  # (batch, seq, head dim)
# head dim -> (Fa3Config keywords, timed under --variants); the first is fa3_config's (D = 64:
# "wide", three consumer warpgroups, gluon_prefill_fa3.WIDE, shipped since 2026-11-28; the
# two-warpgroup build it replaced comes second; D = 128: the lazy rescale, shipped since
# 2026-11-28, then the eager build it replaced). tests/.../test_gluon_prefill_fa3_gpu.py
# checks each of them on awkward shapes.
CONFIGS = {
    64: (
        ({"stages": 3, "wide": True}, True),
        ({"stages": 3}, True),
        ({"stages": 3, "pv_overlap": True}, True),
        ({"stages": 3, "pv_overlap": True, "exp2_poly": 1}, True),
        ({"stages": 3, "exp2_poly": 1}, True),
        ({"stages": 3, "exp2_poly": 2}, True),
        ({"stages": 3, "rescale_threshold": 8.0}, True),
        ({"stages": 3, "wide": True, "exp2_poly": 2}, True),
        ({"stages": 3, "wide": True, "exp2_poly": 2, "rescale_threshold": 8.0}, True),
        ({"stages": 3, "pingpong": False}, False),
        ({"stages": 2}, False),
        ({"block_n": 64, "stages": 4}, False),
    ),
    128: (
        ({"stages": 2, "rescale_threshold": 8.0}, True),
        ({"stages": 2}, True),
        ({"stages": 2, "pv_overlap": True}, True),
        ({"stages": 2, "exp2_poly": 1}, True),
        ({"stages": 2, "pingpong": False}, False),
        ({"block_n": 64, "stages": 3}, False),
    ),
}
PEERS = ("triton_prefill", "fa4_prefill_sm90")
# The sliding-window build (--window), same shape as CONFIGS (every one has window=True); the
# first is fa3_window_config's. tests/.../test_gluon_prefill_fa3_gpu.py checks each of them.
WINDOW_CONFIGS = {
    64: (
        ({"block_n": 64, "stages": 4}, True),
        ({"block_n": 64, "stages": 4, "pv_overlap": True}, True),
        ({"block_n": 128, "stages": 3}, True),
    ),
    128: (
        ({"block_n": 64, "stages": 3}, True),
        ({"block_n": 128, "stages": 2}, True),
    ),
}
WINDOW_PEERS = ("gluon_prefill_window_sm90", "triton_prefill", "fa4_prefill_sm90")
CHECK_HEADS = (0, 7, 8, 31, 63)  # float64 reference heads (several KV heads and group ends)
TOL = 2e-2


def inputs(batch: int, seq: int, d: int):
    g = torch.Generator(device=DEV).manual_seed(batch * 7919 + seq + d)
    total = batch * seq
    q = torch.randn(total, HQ, d, device=DEV, generator=g).bfloat16()
    k, v = (torch.randn(total, HKV, d, device=DEV, generator=g).bfloat16() for _ in range(2))
    cu = torch.arange(0, total + 1, seq, dtype=torch.int32, device=DEV)
    return q, k, v, cu, torch.randn(HQ, device=DEV, generator=g) * 2


def reference(q, k, v, cu, sinks, scale, window: int = -1):
    """float64 causal attention with sinks (and the window, when ``window >= 0``) of the
    :data:`CHECK_HEADS`: ``[total, len(heads), D]``."""
    outs = []
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        n = hi - lo
        mask = torch.ones(n, n, dtype=torch.bool, device=DEV).tril()
        if window >= 0:
            mask = mask.triu(-window)  # key j visible from query i iff 0 <= i - j <= window
        per_head = []
        for h in CHECK_HEADS:
            qh, kh, vh = (x[lo:hi, i].double() for x, i in ((q, h), (k, h // (HQ // HKV)), (v, h // (HQ // HKV))))
            s = (qh @ kh.T * scale).masked_fill(~mask, float("-inf"))
            s = torch.cat([s, torch.full((n, 1), float(sinks[h]), dtype=torch.float64, device=DEV)], 1)
            per_head.append(torch.softmax(s, 1)[:, :n] @ vh)
        outs.append(torch.stack(per_head, 1))
    return torch.cat(outs)


def rel_err(out, ref) -> float:
    got = out[:, list(CHECK_HEADS)].double()
    if torch.isnan(got).any():
        return float("nan")
    return float((got - ref).norm() / ref.norm())


def visible_pairs(seq: int, window: int) -> int:
    """(query, key) pairs one sequence of ``seq`` tokens shows: causal, within ``window``
    when ``window >= 0``."""
    if window < 0 or window >= seq:
        return seq * (seq + 1) // 2
    return (window + 1) * (window + 2) // 2 + (seq - window - 1) * (window + 1)


def sweep_case(
    batch: int, seq: int, d: int, mode: str, deadline: float, window: int = -1, classic: bool = False
) -> list[dict]:
    """Check then time the configurations of head dim ``d`` that ``mode`` picks ("all",
    "variants", "quick", "clean-ab") and the peers on one case (with ``window >= 0``: the windowed
    build's and peers; with ``classic`` too: ``gluon_prefill_window_sm90``'s configurations);
    rows not started by ``deadline`` (``time.monotonic``) are skipped."""
    from tokenspeed_kernel import mha_prefill
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel.tools.timing import time_fn
    from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill_fa3 as fa3

    q, k, v, cu, sinks = inputs(batch, seq, d)
    scale = 1 / math.sqrt(d)
    ref = reference(q, k, v, cu, sinks, scale, window)
    flops = 4 * batch * HQ * d * visible_pairs(seq, window)
    out = torch.empty_like(q)
    runs = []
    configs, peers = (WINDOW_CONFIGS, WINDOW_PEERS) if window >= 0 else (CONFIGS, PEERS)
    args = PrefillArgs(q, k, v, cu, cu, seq, seq, True, scale, window, sinks, 0.0, out, None)
    if classic:
        from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill as gp

        base = gp.prefill_config(d, HQ // HKV)
        variants = [] if mode == "quick" else gp.window_variants(d, HQ // HKV)
        for cfg in (base, *variants):
            runs.append((f"window {cfg.tag}", functools.partial(gp.launch, args, cfg)))
    else:
        shipped = configs[d][0]
        picked = {
            "quick": [shipped],
            "clean-ab": [shipped, ({**shipped[0], "clean_v": False}, False)],
            "variants": [c for c in configs[d] if c[1]],
            "all": configs[d],
        }[mode]
        for kw, _variant in picked:
            cfg = fa3.fa3_variant(d, **kw, **({"window": True} if window >= 0 else {}))
            runs.append((f"fa3 {cfg.tag}", functools.partial(fa3.launch, args, cfg)))
    for peer in peers:
        call = functools.partial(
            mha_prefill, q, k, v, cu, cu, seq, seq, window_left=window, sinks=sinks, out=out, override=peer
        )
        runs.append((peer, call))
    rows = []
    for name, fn in runs:
        row = {"batch": batch, "seq": seq, "head_dim": d, "window": window, "kernel": name}
        if time.monotonic() > deadline:
            row["status"] = "skipped: budget spent"
            rows.append(row)
            continue
        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            row["rel_err"] = err = rel_err(out, ref)
            if not err < TOL:
                row["status"] = f"FAIL rel_err {err:.3g}"
            else:
                ms = time_fn(fn, DEV).median_ms
                row |= {"status": "ok", "ms": ms, "tflops": flops / ms / 1e9}
        except Exception as exc:  # a peer that is not installed, or a launch that fails: say why
            row["status"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    """One line per row: case, kernel, error vs float64, time, TFLOP/s, speed relative to the
    case's first row (the shipped configuration), status."""
    print(f"\n{'case':<16} {'kernel':<44} {'rel_err':>9} {'ms':>8} {'TFLOP/s':>8} {'vs ship':>8}  status")
    for r in rows:
        case = f"B{r['batch']} S{r['seq']} D{r['head_dim']}"
        ship = next(x for x in rows if x["head_dim"] == r["head_dim"] and x["batch"] == r["batch"])  # first row
        ms = f"{r['ms']:.3f}" if "ms" in r else "-"
        tf = f"{r['tflops']:.0f}" if "tflops" in r else "-"
        rel = f"{ship['ms'] / r['ms']:.3f}x" if "ms" in r and "ms" in ship else "-"
        err = r.get("rel_err", float("nan"))
        print(f"{case:<16} {r['kernel']:<44} {err:>9.2e} {ms:>8} {tf:>8} {rel:>8}  {r['status']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the shipped configuration and the peers only")
    mode.add_argument("--variants", action="store_true", help="the shipped configuration, the variants, the peers")
    mode.add_argument(
        "--clean-ab", action="store_true", help="the shipped configuration, the same without V cleaning, the peers"
    )
    parser.add_argument("--head-dim", type=int, choices=(64, 128), help="only the cases of this head dim")
    parser.add_argument("--window", type=int, default=-1, help="time the sliding-window build at this window_left")
    parser.add_argument(
        "--classic", action="store_true", help="with --window: gluon_prefill_window_sm90's configurations"
    )
    parser.add_argument("--budget-s", type=float, default=1e9, help="start no row after this many seconds")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp/out"), "fa3_sweep.json"))
    opts = parser.parse_args()
    if opts.classic and opts.window < 0:
        parser.error("--classic needs --window W")
    print("device:", torch.cuda.get_device_name(), flush=True)
    deadline = time.monotonic() + opts.budget_s
    mode = "quick" if opts.quick else "variants" if opts.variants else "clean-ab" if opts.clean_ab else "all"
    rows = []
    for batch, seq, d in CASES:
        if opts.head_dim and d != opts.head_dim:
            continue
        rows += sweep_case(batch, seq, d, mode, deadline, opts.window, opts.classic)
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
    with open(opts.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print_table(rows)
    return (
        0
        if all(
            r["status"] in ("ok", "skipped: budget spent") for r in rows if r["kernel"].startswith(("fa3", "window"))
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
