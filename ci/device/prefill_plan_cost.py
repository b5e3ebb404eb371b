"""What ``flashinfer_prefill`` costs an engine per call, planning included, next to ``triton_prefill``.

``bench attention.prefill`` times a kernel on one fixed batch layout, so FlashInfer plans once
and every timed call is a pure run. An engine builds a new ``cu_seqlens`` tensor every step;
``flashinfer_prefill`` then plans again (FlashInfer's ``plan`` reads the layout on the host:
a device-to-host copy and host work while the GPU idles), once per step when the layers share
the step's tensors (the plan cache keys on the tensor objects), once per call when they do
not. This times, per case, eagerly through ``mha_prefill`` (``override=`` each kernel):

- ``run``: the same ``cu_seqlens`` tensors every call (what the bench measures),
- ``new layout``: fresh ``cu_seqlens`` tensors every call (a plan per call),
- ``per layer, 18``: fresh tensors every step, shared by 18 calls (GPT-OSS-120B's 18
  full-attention layers, the ones ``flashinfer_prefill`` would serve),
- ``host``: the host time of one call on an idle GPU, with the same and with new tensors
  (their difference: the plan's host time); and a cProfile of FlashInfer's plan at two lengths.

Each is wall-clock time per call over a loop with one synchronize at its end, so a kernel
whose host work hides behind the GPU costs its GPU time. Before timing, each kernel's output
on a fresh layout is compared with ``triton_prefill``'s (max abs difference printed; both were
checked against float64 by ``tokenspeed-kernel check``).

Device: needs FlashInfer (``.whl-nvidia``); run by ``verify_pending.sh prefillplan``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase

KERNELS = ("triton_prefill", "flashinfer_prefill")
LAYERS = 18  # GPT-OSS-120B: 36 layers, every other one full attention
_LENGTHS = (
    (512,), (1024,), (2048,), (4096,), (8192,), (16384,),
    (1024,) * 8, (2048,) * 8, (8192, 2000, 300, 37), (1500, 700, 333, 65, 17, 3),
)  # fmt: skip

_PROFILE = ((512,), (8192,))  # cases whose FlashInfer plan is profiled


@dataclass(frozen=True)
class Row:
    case: str
    kernel: str
    run_us: float
    new_layout_us: float
    per_layer_us: float
    host_us: float
    host_new_layout_us: float
    max_abs_diff: float


def _fresh(case: AttentionCase, inputs: dict, n: int) -> list[dict]:
    """``n`` copies of ``inputs`` with new layout tensors of the same values (``cases.relayout``)."""
    return [cases.relayout(case, inputs) for _ in range(n)]


def _wall_us(make, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the wall time of ``make()()`` divided by ``calls`` (µs);
    ``make`` prepares each repeat's inputs (untimed), so every repeat sees new layouts."""
    times = []
    for _ in range(repeats):
        fn = make()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(times)


def _measure(case: AttentionCase, inputs: dict, kernel: str, calls: int) -> tuple[float, float, float]:
    def run() -> None:
        for _ in range(calls):
            cases.call(case, inputs, override=kernel)

    def new_layout():
        layouts = _fresh(case, inputs, calls)

        def loop() -> None:
            for fresh in layouts:
                cases.call(case, fresh, override=kernel)

        return loop

    steps = max(3, calls // LAYERS)

    def per_layer():
        layouts = _fresh(case, inputs, steps)

        def loop() -> None:
            for fresh in layouts:
                for _ in range(LAYERS):
                    cases.call(case, fresh, override=kernel)

        return loop

    run()  # warm-up (compile/plan)
    return _wall_us(lambda: run, calls), _wall_us(new_layout, calls), _wall_us(per_layer, steps * LAYERS)


def _host_us(case: AttentionCase, inputs: dict, kernel: str, fresh: bool, repeats: int = 7) -> float:
    """Host time of one call on an idle GPU (median µs): until the call returns, not until
    the kernel ends; with ``fresh``, new ``cu_seqlens`` tensors (FlashInfer plans)."""
    times = []
    for _ in range(repeats):
        args = _fresh(case, inputs, 1)[0] if fresh else inputs
        torch.cuda.synchronize()
        start = time.perf_counter()
        cases.call(case, args, override=kernel)
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _profile_plan(case: AttentionCase, inputs: dict, kernel: str) -> None:
    """cProfile of three fresh-layout calls: where the host time of a plan goes."""
    import cProfile
    import pstats

    layouts = _fresh(case, inputs, 3)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for fresh in layouts:
        cases.call(case, fresh, override=kernel)
        torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    args = parser.parse_args()
    dev = torch.device("cuda")
    start = time.perf_counter()
    rows: list[Row] = []
    print(f"{torch.cuda.get_device_name(dev)}  torch {torch.__version__}", flush=True)
    busy = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(200):  # ~1 s of matmuls: clocks up before the first (short) case
        busy @ busy
    del busy
    for lengths in _LENGTHS:
        if time.perf_counter() - start > args.budget_s:
            print(f"budget spent: stopped before {lengths}")
            break
        case = AttentionCase("attention.prefill", lengths, lengths, 64, 8, 64, sinks=True, causal=True)
        name = f"B={len(lengths)} " + (
            "x".join(map(str, sorted(set(lengths)))) if len(set(lengths)) == 1 else "+".join(map(str, lengths))
        )
        inputs = cases.make_inputs(case, dev, seed=0)
        ref = cases.call(case, _fresh(case, inputs, 1)[0], override=KERNELS[0]).float()
        calls = max(18, min(200, int(2e5 / sum(n * n for n in lengths) * 1e3)))
        for kernel in KERNELS:
            out = cases.call(case, _fresh(case, inputs, 1)[0], override=kernel).float()
            diff = (out - ref).abs().max().item()
            run_us, new_us, layer_us = _measure(case, inputs, kernel, calls)
            host, host_new = _host_us(case, inputs, kernel, False), _host_us(case, inputs, kernel, True)
            rows.append(Row(name, kernel, run_us, new_us, layer_us, host, host_new, diff))
            print(f"{name:28s} {kernel:20s} run {run_us:9.1f} us  new layout {new_us:9.1f} us  "
                  f"per layer/{LAYERS} {layer_us:9.1f} us  host {host:7.1f} / new layout {host_new:7.1f} us  "
                  f"|out-triton| {diff:.2e}", flush=True)  # fmt: skip
        if lengths in _PROFILE:
            _profile_plan(case, inputs, KERNELS[1])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=1)
    print("\nwall-clock µs per eager mha_prefill call (GPT-OSS heads, bf16, causal, sinks); "
          "ratio = triton / flashinfer (above 1: FlashInfer faster)")  # fmt: skip
    print(f"{'case':28s} {'triton run':>10s} {'FI run':>8s} {'ratio':>6s} {'FI new':>8s} {'ratio':>6s} "
          f"{'FI /18':>8s} {'ratio':>6s} {'FI plan host':>12s}")  # fmt: skip
    by = {(r.case, r.kernel): r for r in rows}
    for case_name in dict.fromkeys(r.case for r in rows):
        t, f = by.get((case_name, KERNELS[0])), by.get((case_name, KERNELS[1]))
        if t is None or f is None:
            continue
        print(f"{case_name:28s} {t.run_us:10.1f} {f.run_us:8.1f} {t.run_us / f.run_us:6.2f} "
              f"{f.new_layout_us:8.1f} {t.new_layout_us / f.new_layout_us:6.2f} "
              f"{f.per_layer_us:8.1f} {t.per_layer_us / f.per_layer_us:6.2f} "
              f"{f.host_new_layout_us - f.host_us:12.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
