"""FlashInfer's CUTLASS fused MoE with its default tactic vs autotuned, next to triton_fused_moe
(one call, ~2 min; needs the prebuilt module: ci/device/flashinfer_moe.sh puts it in place).

`bench moe.apply --kernel all` timed `flashinfer_cutlass_moe` 4.5-5x slower than
`triton_fused_moe` at GPT-OSS shapes with bf16 weights (H100, 2026-11-24). FlashInfer picks a
GEMM tactic by profiling only inside ``flashinfer.autotuner.autotune()``; outside it a default
tactic runs. This script times, per token count, the plan's ``apply`` (weights prepared once)
eagerly (the kernel is not capturable) with the default tactic, then after one call under
``autotune(True)``, compares both outputs with `triton_fused_moe` (checked against float64 in its own runs), and times
``triton_fused_moe`` on the same inputs. Prints a table last; ``$OUT/flashinfer_moe_tune.json``.

Usage (device, after ``bash ci/device/flashinfer_moe.sh load``):
``python3 ci/device/flashinfer_moe_tune.py``
"""

from __future__ import annotations

import json
import os
import time

import torch

DEV = torch.device("cuda")
E, H, INTER, K = 128, 2880, 2880, 4  # GPT-OSS-120B MoE layer, bf16 weights
TOKENS = (1, 8, 64, 512, 4096)


def _measure(t, fi, tr, gen, autotune, time_fn) -> dict:
    x = torch.randn(t, H, generator=gen, device=DEV).bfloat16()
    wts, ids = torch.randn(t, E, generator=gen, device=DEV).softmax(-1).topk(K, dim=-1)
    wts, ids = (wts / wts.sum(-1, keepdim=True)).float(), ids.int()
    ref = tr.apply(x, wts, ids).double()  # triton_fused_moe: checked against float64 in its own runs

    def run():
        return fi.apply(x, wts, ids)

    def err(out: torch.Tensor) -> float:
        return float((out.double() - ref).norm() / ref.norm())

    default_out = run()
    default_ms = time_fn(run, DEV, graph=False).median_ms
    start = time.perf_counter()
    with autotune(True):
        run()
    torch.cuda.synchronize()
    tune_s = time.perf_counter() - start
    tuned_out = run()
    tuned_ms = time_fn(run, DEV, graph=False).median_ms
    triton_ms = time_fn(lambda: tr.apply(x, wts, ids), DEV).median_ms
    row = dict(tokens=t, default_ms=default_ms, tuned_ms=tuned_ms, tune_s=tune_s, triton_ms=triton_ms,
               default_err=err(default_out), tuned_err=err(tuned_out))  # fmt: skip
    print(row, flush=True)
    return row


def main() -> None:
    from flashinfer.autotuner import autotune

    from tokenspeed_kernel.ops.moe import moe_plan
    from tokenspeed_kernel.tools.timing import time_fn

    gen = torch.Generator(device=DEV).manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, generator=gen, device=DEV) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=gen, device=DEV) / INTER**0.5).bfloat16()
    b13 = 0.5 * torch.randn(E, 2 * INTER, generator=gen, device=DEV)
    b2 = (0.5 * torch.randn(E, H, generator=gen, device=DEV)).bfloat16()
    common = dict(x_dtype=torch.bfloat16, top_k=K, activation="swiglu_oai", w13_bias=b13, w2_bias=b2)
    fi = moe_plan(w13, w2, override="flashinfer_cutlass_moe", **common)
    tr = moe_plan(w13, w2, override="triton_fused_moe", **common)
    rows = [_measure(t, fi, tr, gen, autotune, time_fn) for t in TOKENS]
    path = os.path.join(os.environ.get("OUT", "/tmp"), "flashinfer_moe_tune.json")
    with open(path, "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1
        )
    print("\n== flashinfer_cutlass_moe (plan.apply, eager) vs triton_fused_moe (graph replay), GPT-OSS bf16 weights")
    for r in rows:
        print(f"T={r['tokens']:5d}  default {r['default_ms']:8.3f} ms  autotuned {r['tuned_ms']:8.3f} ms "
              f"(tuning {r['tune_s']:5.1f} s)  triton_fused_moe {r['triton_ms']:8.3f} ms  "
              f"rel. diff vs Triton {r['default_err']:.1e} / {r['tuned_err']:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
