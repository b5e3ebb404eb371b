#!/usr/bin/env bash
# One device call: install our wheels (built here with `pip wheel --no-deps -w .whl
# packages/tokenspeed-kernel packages/tokenspeed-kernel-triton`, carried as .whl), check the
# attention kernels against the float64 reference on the GPU, then benchmark them at
# GPT-OSS-120B shapes against torch baselines measured in the same run.
# Usage (device tool): carry [".whl"], command: bash ci/device/attention.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/tokenspeed_kernel-*.whl .whl/tokenspeed_kernel_triton-*.whl || exit 1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
tokenspeed-kernel list attention.decode | head -8
status=0
for op in kvcache.store attention.decode attention.extend attention.prefill; do
  python3 -W ignore -m tokenspeed_kernel check "$op" --preset awkward --device cuda > "$OUT/check_$op.txt" 2>&1 || status=1; tail -1 "$OUT/check_$op.txt"; grep FAIL "$OUT/check_$op.txt"
done
for op in attention.decode attention.prefill attention.extend kvcache.store; do
  timeout 200 python3 -W ignore -m tokenspeed_kernel bench "$op" --preset gpt-oss-120b --json "$OUT/bench_$op.json" 2>&1 | grep -v Warning | tee "$OUT/bench_$op.txt"
done
exit $status
