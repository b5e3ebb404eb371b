#!/usr/bin/env bash
# One device call: the MoE operators on the GPU through the public tools.
#   check: `tokenspeed-kernel check moe.topk|moe.apply --preset awkward` (every registered
#          kernel against the float64 reference; output in $OUT/check_<op>.txt)
#   bench: `tokenspeed-kernel bench moe.apply --kernel all --preset gpt-oss-120b` (every kernel
#          and the same-run baselines; the selector's pick marked *; $OUT/bench_moe.apply.json)
#   gluon: ci/device/gluon_moe_bench.py (T = 1, 2, 4, 8: Gluon vs Triton GEMV vs torch)
# Usage (device tool): carry [".whl"], command: bash ci/device/moe.sh [check] [bench] [gluon]
# (default: check gluon, ~6 min; bench alone ~5 min).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl || exit 1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
for step in ${*:-check gluon}; do
  case $step in
    check)
      for op in moe.topk moe.apply; do
        timeout "${CHECK_TIMEOUT_S:-300}" python3 -W ignore -m tokenspeed_kernel check "$op" --preset awkward \
          --device cuda > "$OUT/check_$op.txt" 2>&1 || status=1
        tail -2 "$OUT/check_$op.txt"; grep -c PASS "$OUT/check_$op.txt"; grep FAIL "$OUT/check_$op.txt" | head -20
      done ;;
    bench)
      timeout "${BENCH_TIMEOUT_S:-420}" python3 -W ignore -m tokenspeed_kernel bench moe.apply --kernel all \
        --preset gpt-oss-120b --json "$OUT/bench_moe.apply.json" 2>&1 | grep -v Warning | tee "$OUT/bench_moe.apply.txt" \
        | tail -80 || status=1 ;;
    gluon)
      (cd ci/device && timeout 200 python3 gluon_moe_bench.py --json "$OUT/gluon_moe.json" 2>&1 | tail -12) || status=1 ;;
    *) echo "unknown step $step (expected check, bench, gluon)"; status=2 ;;
  esac
done
exit $status
