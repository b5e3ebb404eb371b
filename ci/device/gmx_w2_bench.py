"""Time the layer-2 grouped GEMM prototype (``gluon_mx_grouped``, branch gmx) at GPT-OSS-120B
shapes (E 128, top-4, H = I = 2880) on an sm_90 GPU, and check its first tile against float64: ``python ci/device/gmx_w2_bench.py [--tokens 4096]``.

Prints one JSON line per configuration: microseconds (CUDA-graph-free, ``do_bench``
median) and TFLOP/s of ``2 * T * top_k * H * I``. The shipped kernel's layer 2 is timed
by ``ci/device/mxp_sweep.py`` (same shapes) for the comparison."""

from __future__ import annotations

import argparse
import json

import torch
import triton

from tokenspeed_kernel.quant import dequantize_mxfp4, quantize_mxfp4
from tokenspeed_kernel_nvidia.ops.moe.gluon_mx_grouped import GroupedW2Config, launch_w2_grouped
from tokenspeed_kernel_triton.ops.moe._routing import sort_by_expert
from tokenspeed_kernel_triton.ops.moe.fused_mx_swap import swap_operand

CONFIGS = (
    GroupedW2Config(),
    GroupedW2Config(pingpong=False),
    GroupedW2Config(stages=5),
    GroupedW2Config(stages=3),
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2880)
    p.add_argument("--inter", type=int, default=2880)
    a = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    w = quantize_mxfp4(torch.randn(a.experts, a.hidden, a.inter, device=dev) * 0.05)
    op = swap_operand(w, check_scales=True)
    ids = torch.randint(0, a.experts, (a.tokens, a.top_k), device=dev, dtype=torch.int32)
    r = sort_by_expert(ids, None, a.experts, 128)
    x = torch.randn(r.tiles_bound * 128, a.inter, device=dev).to(torch.bfloat16)
    out = torch.zeros(r.num_pairs, a.hidden, device=dev)
    flops = 2 * r.num_pairs * a.hidden * a.inter
    # correctness spot check: the pairs of the first used tile
    launch_w2_grouped(x, op.words, op.scales, op.big_scales, r.sorted_ids, r.tile_expert, r.num_tiles, out)
    e0 = int(r.tile_expert[0])
    ids0 = r.sorted_ids[:128].long()
    ok = ids0 < r.num_pairs
    ref = x[:128][ok].double() @ dequantize_mxfp4(w, torch.float64)[e0].T
    err = ((out[ids0[ok]].double() - ref).abs().max() / ref.abs().max()).item()
    print(json.dumps({"check": "tile 0", "max_rel_err": err}))
    for cfg in CONFIGS:

        def run(cfg=cfg):
            launch_w2_grouped(x, op.words, op.scales, op.big_scales, r.sorted_ids, r.tile_expert, r.num_tiles, out, cfg)

        us = triton.testing.do_bench(run, warmup=25, rep=200) * 1e3
        print(
            json.dumps(
                {"config": cfg.tag, "tokens": a.tokens, "us": round(us, 1), "tflops": round(flops / us / 1e6, 1)}
            )
        )


if __name__ == "__main__":
    main()
