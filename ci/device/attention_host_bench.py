"""Host overhead and graph-replayed timings of the attention calls (one device call, ~1 min).

Answers two questions the 2026-11-23 ``nvidia_bench.py`` run left open (docs/history.md,
"NVIDIA wheel"): where the ~100 µs between a public ``mha_prefill`` call of the Gluon window
prefill and a direct launch of the same kernel goes, and how fast the kernels are with the
host taken out (CUDA-graph replay through ``tokenspeed_kernel.tools.timing.time_fn``).

1. Host µs per call: tiny shapes (GPU work ~µs), N calls back to back, then one sync; for
   the public calls (``override=``) and the direct Gluon launch; then a cProfile of the
   public Gluon prefill call (top functions by own time).
2. Graph replay at GPT-OSS-120B shapes (64/8 heads, D 64, bf16): window-128 prefill with
   sinks S=8192 (Triton, Gluon public, Gluon launch configurations, flex_attention without
   sinks), decode B=1 ctx 8192 with sinks (Triton, Gluon, SDPA on a contiguous cache).

Usage (repository root, wheels installed): ``python3 ci/device/attention_host_bench.py``;
writes ``$OUT/attention_host_bench.json`` and prints a table last.
"""

from __future__ import annotations

import cProfile
import io
import json
import math
import os
import pstats
import time

import torch
import torch.nn.functional as F

DEV = torch.device("cuda")
HQ, HKV, D = 64, 8, 64
RESULT: dict = {"host_us": {}, "graph_us": {}, "profile": "", "errors": [], "eager_fallback": []}


def log(*a) -> None:
    print(*a, flush=True)


def host_us(fn, n: int = 300) -> float:
    """Wall µs per call of ``fn`` issued back to back (one sync at the end)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def graph_us(fn) -> float:
    from tokenspeed_kernel.tools.timing import time_fn

    timing = time_fn(fn, DEV)
    if not timing.graph:  # time_fn fell back to eager launches (capture failed)
        RESULT["eager_fallback"].append(getattr(fn, "__qualname__", str(fn)))
    return timing.median_ms * 1e3


def attempt(table: dict, label: str, fn) -> None:
    try:
        table[label] = fn()
        log(f"{label}: {table[label]:.1f} us")
    except Exception as exc:  # recorded, never fatal
        RESULT["errors"].append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
        log(f"{label}: ERROR {type(exc).__name__}: {str(exc)[:300]}")


def prefill_inputs(seq: int):
    g = torch.Generator(device=DEV).manual_seed(seq)
    q = torch.randn(seq, HQ, D, device=DEV, generator=g).bfloat16()
    k = torch.randn(seq, HKV, D, device=DEV, generator=g).bfloat16()
    v = torch.randn(seq, HKV, D, device=DEV, generator=g).bfloat16()
    cu = torch.tensor([0, seq], dtype=torch.int32, device=DEV)
    return q, k, v, cu, torch.randn(HQ, device=DEV, generator=g)


def decode_inputs(batch: int, ctx: int, page: int = 16):
    g = torch.Generator(device=DEV).manual_seed(ctx)
    pages = -(-ctx // page)
    k = torch.randn(batch * pages, page, HKV, D, device=DEV, generator=g).bfloat16()
    v = torch.randn_like(k)
    table = torch.randperm(batch * pages, device=DEV, generator=g).int().view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HQ, D, device=DEV, generator=g).bfloat16()
    return q, k, v, table, lens, torch.randn(HQ, device=DEV, generator=g)


def gluon_args(q, k, v, cu, sinks, window):
    from tokenspeed_kernel.ops.attention.args import PrefillArgs

    seq = q.shape[0]
    return PrefillArgs(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seq, max_seqlen_k=seq, causal=True,
        softmax_scale=1 / math.sqrt(D), window_left=window, sinks=sinks, logit_cap=0.0, out=torch.empty_like(q),
        lse=None,
    )  # fmt: skip


def host_section() -> None:
    from tokenspeed_kernel import mha_decode_with_kvcache, mha_prefill
    from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill as gp

    q, k, v, cu, sk = prefill_inputs(128)
    for name in ("triton_prefill", "gluon_prefill_window_sm90"):
        attempt(RESULT["host_us"], f"prefill S=128 public {name}",
                lambda name=name: host_us(lambda: mha_prefill(q, k, v, cu, cu, 128, 128, window_left=127, sinks=sk,
                                                              override=name)))  # fmt: skip
    args = gluon_args(q, k, v, cu, sk, 127)
    attempt(RESULT["host_us"], "prefill S=128 direct gluon launch", lambda: host_us(lambda: gp.launch(args)))
    dq, dk, dv, table, lens, dsk = decode_inputs(1, 256)
    for name in ("triton_decode", "gluon_decode_sm90"):
        attempt(RESULT["host_us"], f"decode B=1 ctx=256 public {name}",
                lambda name=name: host_us(lambda: mha_decode_with_kvcache(dq, dk, dv, table, lens, 256, sinks=dsk,
                                                                          override=name)))  # fmt: skip
    attempt(RESULT["host_us"], "empty torch op (x.add_(1)) for scale", lambda: host_us(lambda: dq.add_(0)))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        mha_prefill(q, k, v, cu, cu, 128, 128, window_left=127, sinks=sk, override="gluon_prefill_window_sm90")
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    RESULT["profile"] = buf.getvalue()
    log(RESULT["profile"])


def graph_section() -> None:
    from tokenspeed_kernel import mha_decode_with_kvcache, mha_prefill
    from tokenspeed_kernel_nvidia.ops.attention import gluon_prefill as gp

    seq, window = 8192, 127
    q, k, v, cu, sk = prefill_inputs(seq)
    for name in ("triton_prefill", "gluon_prefill_window_sm90"):
        attempt(RESULT["graph_us"], f"window prefill public {name}",
                lambda name=name: graph_us(lambda: mha_prefill(q, k, v, cu, cu, seq, seq, window_left=window,
                                                               sinks=sk, override=name)))  # fmt: skip
    args = gluon_args(q, k, v, cu, sk, window)
    gp.launch(args)
    ref = args.out.clone()
    for warps, block_n, stages in ((4, 64, 3), (8, 64, 3), (4, 32, 4), (8, 32, 4), (4, 128, 2), (8, 128, 2)):
        cfg = gp.GluonPrefillConfig(D, 8, block_n=block_n, stages=stages, num_warps=warps)
        label = f"window prefill gluon launch w{warps} n{block_n} st{stages}"

        def run(cfg=cfg, label=label):
            args.out.fill_(float("nan"))
            gp.launch(args, cfg)
            diff = float((args.out.float() - ref.float()).abs().max())
            if not diff < 1e-2:
                raise AssertionError(f"max diff {diff} vs the default configuration")
            return graph_us(lambda: gp.launch(args, cfg))

        attempt(RESULT["graph_us"], label, run)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        qt, kt, vt = (x.transpose(0, 1)[None] for x in (q, k, v))
        mask = create_block_mask(lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= window), None, None, seq, seq)
        flex = torch.compile(flex_attention)
        flex(qt, kt, vt, block_mask=mask, enable_gqa=True)
        attempt(RESULT["graph_us"], "window prefill flex_attention (no sinks)",
                lambda: graph_us(lambda: flex(qt, kt, vt, block_mask=mask, enable_gqa=True)))  # fmt: skip
    except Exception as exc:
        RESULT["errors"].append(f"flex: {exc}"[:300])
    dq, dk, dv, table, lens, dsk = decode_inputs(1, 8192)
    for name in ("triton_decode", "gluon_decode_sm90"):
        attempt(RESULT["graph_us"], f"decode B=1 ctx=8192 public {name}",
                lambda name=name: graph_us(lambda: mha_decode_with_kvcache(dq, dk, dv, table, lens, 8192, sinks=dsk,
                                                                           override=name)))  # fmt: skip
    kc = dk[table[0].long()].reshape(1, 8192, HKV, D).transpose(1, 2).contiguous()
    vc = dv[table[0].long()].reshape(1, 8192, HKV, D).transpose(1, 2).contiguous()
    qq = dq[:, :, None]
    attempt(RESULT["graph_us"], "decode B=1 ctx=8192 SDPA contiguous (no sinks)",
            lambda: graph_us(lambda: F.scaled_dot_product_attention(qq, kc, vc, enable_gqa=True)))  # fmt: skip


def main() -> None:
    from tokenspeed_kernel import registry

    registry.load_backends()
    RESULT["device"] = torch.cuda.get_device_name()
    RESULT["date"] = time.strftime("%Y-%m-%d")
    host_section()
    graph_section()
    path = os.path.join(os.environ.get("OUT", "/tmp"), "attention_host_bench.json")
    with open(path, "w") as f:
        json.dump(RESULT, f, indent=1)
    log(f"== {RESULT['device']}  torch {torch.__version__}  (host: back-to-back calls; graph: CUDA-graph replay)")
    for section in ("host_us", "graph_us"):
        for label, us in RESULT[section].items():
            log(f"{section:8s} {label:60s} {us:9.1f} us")
    for err in RESULT["errors"]:
        log("error", err)
    if RESULT["eager_fallback"]:
        log("timed eagerly (graph capture failed):", RESULT["eager_fallback"])


if __name__ == "__main__":
    main()
