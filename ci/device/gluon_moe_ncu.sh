#!/usr/bin/env bash
# One device call: Nsight Compute on the two layers of gluon_moe_mma_sm90 (and the FMA
# kernel's for comparison) at GPT-OSS-120B shapes, T = ${TOKENS:-1}: speed of light, occupancy,
# warp stall reasons, memory traffic. ncu reads hardware counters on the Firecracker H100
# (KINDS.md); --clock-control none leaves the clocks alone (METHOD.md). Full reports go to
# $OUT/ncu_*.txt, a digest of the key metrics is printed.
# Device: carry [".whl"], command: bash ci/device/gluon_moe_ncu.sh   (~2 min)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl || exit 1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
cat > /tmp/moe_ncu_driver.py <<'EOF'
import os
import sys

import torch

sys.path.insert(0, "ci/device")
from moe_common import make_weights, quantize  # noqa: E402

from tokenspeed_kernel.ops.moe import moe_apply, moe_topk  # noqa: E402

t = int(os.environ.get("TOKENS", "1"))
dev = torch.device("cuda")
w13, w2, b13, b2 = make_weights(128, 2880, 2880, dev)
m13, m2 = quantize(w13, "mxfp4"), quantize(w2, "mxfp4")
gen = torch.Generator(device=dev).manual_seed(3)
x = torch.randn(t, 2880, generator=gen, device=dev).bfloat16()
logits = (2 * torch.randn(t, 128, generator=gen, device=dev)).bfloat16()
tw, ti = moe_topk(logits, 4)
for name in ("gluon_moe_mma_sm90", "gluon_moe_decode_mx_sm90"):
    for _ in range(2):
        moe_apply(x, m13, m2, tw, ti, activation="swiglu_oai", w13_bias=b13.bfloat16(), w2_bias=b2, override=name)
torch.cuda.synchronize()
EOF
# warm the Triton/Gluon caches outside the profiler
TOKENS=${TOKENS:-1} python3 /tmp/moe_ncu_driver.py || exit 1
SECTIONS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
TOKENS=${TOKENS:-1} timeout 400 "$NCU" --clock-control none --target-processes all \
  --kernel-name regex:'w13|w2' --launch-skip 0 --launch-count 8 $SECTIONS \
  python3 /tmp/moe_ncu_driver.py > "$OUT/ncu_t${TOKENS:-1}.txt" 2>&1
echo "ncu rc $?"
grep -E "^  [a-z0-9_]+_kernel|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Block Limit|Issue Slots Busy|Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Warp Cycles Per Issued|Stall|Waves Per SM|Executed Ipc Active" \
  "$OUT/ncu_t${TOKENS:-1}.txt" | head -150
grep -n -i "stalled\|on average, each warp" "$OUT/ncu_t${TOKENS:-1}.txt" | head -30
