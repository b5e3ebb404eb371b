"""Sweep the Triton attention tile table on the GPU (one device call), print the best.

For each GPT-OSS-120B case it times every tile variant through the public API (the
variant patched into ``_launch.TILES``), checks each variant's output against the default
variant's, and prints a table: ms, TFLOP/s or TB/s, and the winner. The chosen values go
into ``_launch.TILES`` by hand, with the numbers in docs/benchmarks.md.

    python ci/device/attention_tune.py [prefill|decode|all]
"""

from __future__ import annotations

import itertools
import sys

import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.presets import preset_cases
from tokenspeed_kernel.tools.timing import time_fn
from tokenspeed_kernel_triton.ops.attention import _launch
from tokenspeed_kernel_triton.ops.attention._launch import Tile

DEV = torch.device("cuda")


def _run(case, inputs):
    out = cases.call(case, inputs)
    return out[0] if isinstance(out, tuple) else out


def sweep(regime: str, names: list[str], variants: list[Tile], extra=None) -> None:
    default = _launch.TILES[regime]
    all_cases = {
        c.name: c for op in ("attention.prefill", "attention.decode") for c in preset_cases("gpt-oss-120b", op)
    }
    for name in names:
        case = all_cases[name]
        inputs = cases.make_inputs(case, DEV)
        _launch.TILES[regime] = default
        ref = _run(case, inputs).float()
        rows = []
        for tile in variants:
            for knob in extra or [None]:
                _launch.TILES[regime] = tile
                if knob is not None:
                    _launch.MIN_SPLIT_KEYS = knob
                try:
                    out = _run(case, inputs).float()
                    err = float((out - ref).norm() / ref.norm())
                    ms = time_fn(lambda c=case, i=inputs: cases.call(c, i), DEV, rep_ms=60).median_ms
                except Exception as exc:  # a variant that does not compile or fit
                    rows.append((tile, knob, float("inf"), f"{type(exc).__name__}"))
                    continue
                rows.append((tile, knob, ms, f"err {err:.1e}" if err < 2e-2 else f"WRONG err {err:.1e}"))
        _launch.TILES[regime] = default
        _launch.MIN_SPLIT_KEYS = 256
        rows.sort(key=lambda r: r[2])
        work = case.flops() if regime == "prefill" else case.bytes_moved()
        unit = "TFLOP/s" if regime == "prefill" else "TB/s"
        print(f"\n== {regime} {case.describe()}   (default {default})")
        for tile, knob, ms, note in rows[:8]:
            rate = work / ms / 1e9 if ms != float("inf") else 0
            tag = f" min_split_keys={knob}" if knob else ""
            print(f"  {ms:8.4f} ms {rate:8.2f} {unit}  {tile}{tag}  {note}")


def main(which: str) -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    if which in ("prefill", "all"):
        variants = [
            Tile(rows, bn, w, st)
            for rows, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
            if not (rows == 64 and w == 8)
        ]
        sweep("prefill", ["prefill_b1_s8192", "prefill_b1_s8192_win128"], variants)
    if which in ("decode", "all"):
        variants = [Tile(16, bn, w, st) for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]
        sweep("decode", ["decode_b64_ctx8192", "decode_b256_ctx2048"], variants)
        sweep("decode", ["decode_b1_ctx8192"], variants[::3], extra=[128, 256, 512, 1024])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "all")
