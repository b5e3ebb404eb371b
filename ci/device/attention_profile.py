"""Run one GPT-OSS-120B attention case a few times, for a profiler (ncu) to read one launch.

    ncu --kernel-name attention_kernel --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 ci/device/attention_profile.py prefill_win128
"""

from __future__ import annotations

import sys

import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase

CASES = {
    "prefill_win128": AttentionCase(
        "attention.prefill", (8192,), (8192,), 64, 8, 64, sinks=True, window_left=127, name="prefill_win128"
    ),
    "prefill_causal": AttentionCase("attention.prefill", (8192,), (8192,), 64, 8, 64, sinks=True, name="prefill"),
    "decode_b64": AttentionCase("attention.decode", (1,) * 64, (8192,) * 64, 64, 8, 64, sinks=True, name="decode"),
}

if __name__ == "__main__":
    case = CASES[sys.argv[1] if len(sys.argv) > 1 else "prefill_win128"]
    inputs = cases.make_inputs(case, "cuda", seed=0)
    for _ in range(6):
        cases.call(case, inputs)
    torch.cuda.synchronize()
    print("ran", case.describe())
