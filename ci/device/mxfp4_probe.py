"""Probe (one device call): is Triton's ``tl.dot_scaled`` (bf16 x e2m1 with E8M0 scales) a
faster MXFP4 main loop on Hopper than the in-register decode of the Triton fused MoE?

Single expert GEMM ``y[M, N] = x[M, K] @ W[N, K].T`` at GPT-OSS-120B's w13 shape
(N = 5760, K = 2880), W in the PUBLIC MXFP4 layout of ``tokenspeed_kernel.quant`` (packed
uint8 ``[N, K/2]``, low nibble = even k, which is also ``tl.dot_scaled``'s packing; scales
uint8 ``[N, K/32]``), so no repacking. Rows, same run, same timing (``tools.timing.time_fn``:
CUDA-graph replays, L2 flushed, median):

- ``dot_scaled``: the probe kernel below, best of a small tile sweep per M;
- ``fused_moe``: ``moe_apply`` through the Triton fused MoE with one expert and top-1 (its
  w13 and w2 GEMMs, 1.5x the probe's FLOPs and bytes; reported per FLOP);
- ``cublas_bf16``: ``x @ W_bf16.T`` with W dequantized once (4x the weight bytes).

Numerics: each dot_scaled result against ``x.float() @ W.dequantize().T``.

    python3 ci/device/mxfp4_probe.py      # prints a table; JSON to $OUT/mxfp4_probe.json
"""

from __future__ import annotations

import functools
import json
import os
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _mxfp4_gemm(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """``y[M, N] (bf16) = x[M, K] (bf16, row-major) @ W.T``; ``w`` uint8 ``[N, K/2]``,
    ``s`` uint8 ``[N, K/32]``, both row-major. K is a multiple of 32 (masked to BK)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        rkb = k0 // 2 + tl.arange(0, BK // 2)
        w = tl.load(
            w_ptr + rn[None, :] * (K // 2) + rkb[:, None], mask=(rn[None, :] < N) & (rkb[:, None] < K // 2), other=0
        )
        rks = k0 // 32 + tl.arange(0, BK // 32)
        s = tl.load(
            s_ptr + rn[:, None] * (K // 32) + rks[None, :], mask=(rn[:, None] < N) & (rks[None, :] < K // 32), other=127
        )
        acc = tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _configs(m: int) -> list[dict]:
    if m <= 16:
        return [dict(BM=16, BN=bn, BK=128, num_warps=4, num_stages=st) for bn in (32, 64, 128) for st in (3, 5)]
    if m <= 256:
        return [dict(BM=64, BN=bn, BK=128, num_warps=4, num_stages=3) for bn in (64, 128)]
    return [dict(BM=bm, BN=128, BK=bk, num_warps=8, num_stages=3) for bm in (64, 128) for bk in (64, 128)]


def main() -> None:
    from tokenspeed_kernel import moe_plan
    from tokenspeed_kernel.quant import quantize_mxfp4
    from tokenspeed_kernel.tools.timing import time_fn

    dev = torch.device("cuda")
    n, k = 5760, 2880
    gen = torch.Generator(device=dev).manual_seed(0)
    w_full = torch.randn(1, n, k, device=dev, generator=gen) * 0.05
    w = quantize_mxfp4(w_full)
    w2 = quantize_mxfp4(torch.randn(1, k, n // 2, device=dev, generator=gen) * 0.05)
    w_bf16 = w.dequantize(torch.bfloat16)[0]
    packed, scales = w.packed[0].contiguous(), w.scales[0].contiguous()
    wbytes = packed.numel() + scales.numel()
    plan = moe_plan(w, w2, x_dtype=torch.bfloat16, top_k=1, activation="silu", override="triton_fused_moe")
    rows = []
    for m in (1, 16, 128, 1024, 4096):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        ref = x.float() @ w_bf16.float().T
        flops = 2 * m * n * k
        row: dict = {"M": m}
        best = None
        for cfg in _configs(m):
            y = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)
            grid = (triton.cdiv(m, cfg["BM"]), triton.cdiv(n, cfg["BN"]))
            try:
                t0 = time.time()
                _mxfp4_gemm[grid](x, packed, scales, y, m, n, k, **cfg)
                torch.cuda.synchronize()
                first = time.time() - t0
                err = ((y.float() - ref).norm() / ref.norm()).item()
                launch = functools.partial(_mxfp4_gemm[grid], x, packed, scales, y, m, n, k, **cfg)
                ms = time_fn(launch, dev).median_ms
            except Exception as exc:  # a config that fails to build is reported, not fatal
                print(f"M={m} {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                continue
            print(f"M={m:5d} {cfg}  {ms * 1e3:9.1f} us  err {err:.2e}  first {first:.1f}s", flush=True)
            if best is None or ms < best[0]:
                best = (ms, cfg, err)
        if best is not None:
            ms, cfg, err = best
            row["dot_scaled"] = {"us": ms * 1e3, "cfg": cfg, "rel_err": err, "tflops": flops / ms / 1e9,
                                 "weight_GBps": wbytes / ms / 1e6}  # fmt: skip
        ids = torch.zeros(m, 1, device=dev, dtype=torch.int32)
        wts = torch.ones(m, 1, device=dev, dtype=torch.float32)
        ms = time_fn(functools.partial(plan.apply, x, wts, ids), dev).median_ms
        row["fused_moe"] = {"us": ms * 1e3, "tflops": 1.5 * flops / ms / 1e9, "weight_GBps": 1.5 * wbytes / ms / 1e6}
        ms = time_fn(functools.partial(torch.matmul, x, w_bf16.T), dev).median_ms
        row["cublas_bf16"] = {"us": ms * 1e3, "tflops": flops / ms / 1e9, "weight_GBps": 4 * packed.numel() / ms / 1e6}
        rows.append(row)
    out = os.path.join(os.environ.get("OUT", "/tmp"), "mxfp4_probe.json")
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                   "triton": triton.__version__, "N": n, "K": k, "rows": rows}, f, indent=1)  # fmt: skip
    print(f"\n{torch.cuda.get_device_name(dev)}  N={n} K={k}  (fused_moe: w13+w2 of one expert, per FLOP)")
    print(f"{'M':>5} | {'dot_scaled us':>13} {'TFLOP/s':>8} {'GB/s':>7} {'err':>8} | {'fused_moe us':>12} "
          f"{'TFLOP/s':>8} {'GB/s':>7} | {'cublas bf16 us':>14} {'TFLOP/s':>8} | ds speedup/flop")  # fmt: skip
    for r in rows:
        d, f_, c = r.get("dot_scaled"), r["fused_moe"], r["cublas_bf16"]
        ds = (
            f"{d['us']:13.1f} {d['tflops']:8.1f} {d['weight_GBps']:7.0f} {d['rel_err']:8.1e}"
            if d
            else f"{'failed':>40}"
        )
        sp = f"{d['tflops'] / f_['tflops']:.2f}x" if d else "-"
        print(f"{r['M']:5d} | {ds} | {f_['us']:12.1f} {f_['tflops']:8.1f} {f_['weight_GBps']:7.0f} | "
              f"{c['us']:14.1f} {c['tflops']:8.1f} | {sp}")  # fmt: skip


if __name__ == "__main__":
    main()
