"""Split count and launch configuration of ``gluon_decode_sm90`` at small batches (one call, ~2 min).

The issue-5 goal B=1 ctx 8192 <= 15 µs was missed at 15.5 µs (graph replay, cold L2;
docs/history.md). At B=1 the kernel's work is 8 KV heads x 8192 keys: the split count
(``num_splits``: about two programs per SM, never fewer than 4 tiles per split) and the tile
pipeline decide how much memory is in flight. This sweep replaces ``num_splits`` and
``decode_config`` in the host module for each variant, checks the output against a float64
reference (gathered cache, sinks as an extra logit) before timing it, and times the public
call by CUDA-graph replay (``tools.timing.time_fn``, flush="read"), next to ``triton_decode``
and SDPA on a contiguous cache in the same process.

Usage (repository root, wheels installed): ``python3 ci/device/decode_splits_sweep.py
[--quick | --crossover | --large]`` (~2 min; ``--quick``: the shipped launch configuration, with the
second combine launch and with the fused merge, against split counts 1-32 at B = 1-256,
windows included, ~1 min; ``--crossover``: the launcher as shipped against ``triton_decode``
at B = 16-512, ~1 min; ``--large``: launch configurations at B = 32-256 where one split is
left, ~2 min); writes ``$OUT/decode_splits[_quick|_crossover|_large].json`` and prints a
table last.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

DEV = torch.device("cuda")
HQ, HKV, D, PAGE = 64, 8, 64, 16
CASES = ((1, 8192, -1), (4, 8192, -1), (1, 2048, -1), (8, 8192, -1))  # (batch, context, window_left)
SPLITS = (None, 16, 24, 48, 64, 96, 128)  # None: the shipped heuristic
# --quick: the shipped launch configuration only, small split counts, GPT-OSS's window-128
# layers next to the full-context ones, and the large batches the heuristic leaves unsplit
QUICK_CASES = ((1, 2048, -1), (1, 8192, -1), (1, 8192, 128), (8, 8192, 128), (64, 8192, -1), (256, 2048, -1))
QUICK_SPLITS = (None, 1, 2, 4, 8, 16, 32)
# --crossover: the launcher as shipped against triton_decode from B = 16 up, where the
# selector's batch rule (gluon_decode.FIRST_AT_BATCHES) was drawn from these rows
CROSSOVER_CASES = (
    (16, 8192, -1), (32, 8192, -1), (64, 8192, -1), (128, 4096, -1), (128, 8192, -1), (256, 2048, -1),
    (256, 8192, -1), (512, 2048, -1), (16, 8192, 127), (64, 8192, 127), (256, 8192, 127), (512, 2048, 127),
)  # fmt: skip
CONFIGS = (  # (block_n, stages, num_warps, merge in-kernel at every split count or never)
    (64, 3, 4, False),
    (64, 3, 4, True),
    (64, 2, 4, False),
    (64, 4, 4, False),
    (32, 3, 4, False),
    (32, 4, 4, False),
    (64, 3, 8, False),
)
# --large: launch configurations where the heuristic leaves one split (B >= 32), against the
# issue-5 goal of >= 95% of copy at B=64 ctx 8192 and B=256 ctx 2048; merge rule as shipped
LARGE_CASES = ((64, 8192, -1), (256, 2048, -1), (128, 8192, -1), (32, 8192, -1), (64, 8192, 127))
LARGE_CONFIGS = (  # (block_n, stages, num_warps)
    (64, 3, 4), (64, 2, 4), (64, 4, 4), (64, 3, 8), (128, 2, 4), (128, 3, 4), (128, 2, 8), (32, 4, 4),
)  # fmt: skip
TOL = 2e-2  # bf16 inputs and output against float64 (relative Frobenius error)


def inputs(batch: int, ctx: int):
    g = torch.Generator(device=DEV).manual_seed(batch * 100003 + ctx)
    pages = -(-ctx // PAGE)
    k = torch.randn(batch * pages, PAGE, HKV, D, device=DEV, generator=g).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(batch * pages, device=DEV, generator=g).int().view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    lens[0] = ctx - 5  # a partial last page in the first sequence
    q = torch.randn(batch, HQ, D, device=DEV, generator=g).bfloat16()
    return q, k, v, table, lens, torch.randn(HQ, device=DEV, generator=g)


def reference(q, k, v, table, lens, sinks, window: int = -1):
    """float64 decode with sinks (the last ``window + 1`` keys when ``window >= 0``): ``[B, HQ, D]``."""
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        lo = 0 if window < 0 else max(0, n - 1 - window)
        kc = k[table[b].long()].flatten(0, 1)[lo:n].double()  # [n - lo, HKV, D]
        vc = v[table[b].long()].flatten(0, 1)[lo:n].double()
        n -= lo
        qb = q[b].double().view(HKV, HQ // HKV, D)
        s = torch.einsum("hgd,nhd->hgn", qb, kc) / math.sqrt(D)
        s = torch.cat([s, sinks.double().view(HKV, HQ // HKV, 1)], -1)
        p = torch.softmax(s, -1)[..., :n]
        outs.append(torch.einsum("hgn,nhd->hgd", p, vc).reshape(HQ, D))
    return torch.stack(outs)


def graph_us(fn) -> float:
    from tokenspeed_kernel.tools.timing import time_fn

    return time_fn(fn, DEV).median_ms * 1e3


def sweep_case(batch: int, ctx: int, window: int, result: dict, table_rows: list, mode: str) -> None:
    from tokenspeed_kernel import mha_decode_with_kvcache
    from tokenspeed_kernel.kit import sm_count
    from tokenspeed_kernel_nvidia.ops.attention import gluon_decode as gd

    shipped_splits, shipped_config = gd.num_splits, gd.decode_config
    q, k, v, tab, lens, sinks = inputs(batch, ctx)
    ref = reference(q, k, v, tab, lens, sinks, window)

    def call(name, out):
        return mha_decode_with_kvcache(q, k, v, tab, lens, ctx, sinks=sinks, window_left=window, out=out, override=name)

    base = {"triton_decode": graph_us(lambda: call("triton_decode", None))}
    kc = k[tab[0].long()].flatten(0, 1)[None].transpose(1, 2).contiguous()
    vc = v[tab[0].long()].flatten(0, 1)[None].transpose(1, 2).contiguous()
    qq = q[:1, :, None]
    base["SDPA contiguous B=1 (no sinks)"] = graph_us(
        lambda: F.scaled_dot_product_attention(qq, kc, vc, enable_gqa=True)
    )
    label = f"B={batch} ctx={ctx}" + (f" win={window}" if window >= 0 else "")
    print(f"== {label}: " + ", ".join(f"{n} {t:.1f} us" for n, t in base.items()), flush=True)
    visible = ctx if window < 0 else min(ctx, window + 1)

    def measure(tag: str, chosen: int) -> None:
        """Check the public call against float64, then time it (graph replay); one row."""
        try:
            out = torch.full_like(q, float("nan"))
            call("gluon_decode_sm90", out)
            torch.cuda.synchronize()
            err = float((out.double() - ref).norm() / ref.norm())
            ok = not out.isnan().any().item() and err < TOL
            us = graph_us(lambda: call("gluon_decode_sm90", out)) if ok else float("nan")
        except Exception as exc:  # recorded, never fatal
            result["errors"].append(f"{label} {tag}: {type(exc).__name__}: {str(exc)[:200]}")
            print(f"  {tag}: ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        result["rows"].append(dict(case=label, config=tag, splits=chosen, rel_err=err, ok=ok, us=us, **base))
        print(f"  {tag:32s} splits={chosen:4d} err={err:.2e} {'ok ' if ok else 'BAD'} {us:7.1f} us", flush=True)
        table_rows.append((label, tag, chosen, us, base["triton_decode"]))

    measure("shipped", shipped_splits(batch, HKV, visible, sm_count(DEV), shipped_config(D, PAGE).block_n))
    if mode == "crossover":
        return
    if mode == "large":
        for bn, st, nw in LARGE_CONFIGS:
            gd.decode_config = lambda hd, ps, _=0, bn=bn, st=st, nw=nw: gd.GluonDecodeConfig(hd, ps, bn, st, nw)
            try:
                chosen = shipped_splits(batch, HKV, visible, sm_count(DEV), bn)
                measure(f"bn{bn} st{st} w{nw}", chosen)
            finally:
                gd.decode_config = shipped_config
        return
    quick = mode == "quick"
    for bn, st, nw, fused in CONFIGS[:2] if quick else CONFIGS:
        for splits in QUICK_SPLITS if quick else SPLITS:
            gd.decode_config = lambda hd, ps, _=0, bn=bn, st=st, nw=nw, f=fused: gd.GluonDecodeConfig(
                hd, ps, bn, st, nw, fused_max_splits=64 if f else 0
            )
            gd.num_splits = shipped_splits if splits is None else (lambda *a, s=splits: s)
            try:
                chosen = shipped_splits(batch, HKV, visible, sm_count(DEV), bn) if splits is None else splits
                measure(f"bn{bn} st{st} w{nw}{' fused' if fused else ''} splits={splits or 'auto'}", chosen)
            finally:
                gd.num_splits, gd.decode_config = shipped_splits, shipped_config


def main() -> None:
    from tokenspeed_kernel import registry

    registry.load_backends()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": [], "errors": []}
    table_rows: list = []
    mode = next((a[2:] for a in sys.argv[1:] if a in ("--quick", "--crossover", "--large")), "full")
    cases = {"quick": QUICK_CASES, "crossover": CROSSOVER_CASES, "large": LARGE_CASES}.get(mode, CASES)
    for batch, ctx, window in cases:
        sweep_case(batch, ctx, window, result, table_rows, mode)
    path = os.path.join(os.environ.get("OUT", "/tmp"), f"decode_splits{'' if mode == 'full' else '_' + mode}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    if mode == "large":
        print("\n== launch configurations at large batches (graph replay, cold L2; TB/s of K+V read)")
        for label, tag, _, us, triton in table_rows:
            b, ctx = (int(x.split("=")[1]) for x in label.split()[:2])
            win = "win=" in label
            keys = min(ctx, 128) if win else ctx
            tbps = b * keys * HKV * D * 2 * 2 / (us * 1e-6) / 1e12
            print(
                f"{label:22s} {tag:14s} {us:7.1f} us {tbps:5.2f} TB/s  triton_decode {triton:7.1f} us "
                f"gluon/triton {us / triton:.3f}"
            )
        print(f"errors: {len(result['errors'])}")
        return
    if mode == "crossover":
        print("\n== the launcher as shipped vs triton_decode (graph replay, cold L2)")
        for label, _, splits, us, triton in table_rows:
            print(
                f"{label:24s} gluon {us:7.1f} us ({splits} splits)  triton_decode {triton:7.1f} us  "
                f"gluon/triton {us / triton:.3f}"
            )
        print(f"errors: {len(result['errors'])}")
        return
    print(
        "\n== per case (graph replay, cold L2): heuristic split count with each merge, the launcher as shipped, the best"
    )
    for label in dict.fromkeys(r[0] for r in table_rows):
        rows = [r for r in table_rows if r[0] == label and r[3] == r[3]]
        kernel = next((r[3] for r in rows if r[1] == "bn64 st3 w4 splits=auto"), float("nan"))
        fused = next((r[3] for r in rows if r[1] == "bn64 st3 w4 fused splits=auto"), float("nan"))
        shipped = next((r[3] for r in rows if r[1] == "shipped"), float("nan"))
        best = min(rows, key=lambda r: r[3])
        print(
            f"{label:20s} combine launch {kernel:6.1f} us  fused merge {fused:6.1f} us  shipped {shipped:6.1f} us  "
            f"best {best[3]:6.1f} us "
            f"({best[1]}, {best[2]} splits)  triton_decode {best[4]:6.1f} us"
        )
    print(f"errors: {len(result['errors'])}")


if __name__ == "__main__":
    main()
