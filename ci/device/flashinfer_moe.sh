#!/usr/bin/env bash
# FlashInfer's CUTLASS fused MoE on the GPU (`flashinfer_cutlass_moe`), one device call.
#
# FlashInfer JIT-builds `fused_moe_90` on first use from ~250 CUDA files; on the H100 machine
# (16 cores) four calls never finished it (docs/nvidia.md). So the module is built off the
# device, restricted to the bf16/fp16 weights the kernel serves:
#   here:   python3 ci/device/flashinfer_moe_prebuild.py      (~60 min on 2 cores)
#           -> .whl-nvidia/fused_moe_90.so.xz, next to the FlashInfer bundle
# and put where FlashInfer looks for an AOT module (flashinfer/data/aot/<name>/<name>.so),
# so FlashInfer's own loader and Python wrapper run it unchanged. Without the prebuilt file
# the script falls back to the JIT build (BUILD_TIMEOUT_S, default 500 s; resumable on a warm
# machine through FLASHINFER_WORKSPACE_BASE=.fi-ws).
#
# Then: the module loads; test_flashinfer_moe_gpu.py (float64 reference); `check moe.apply
# --kernel flashinfer_cutlass_moe --preset awkward`; `bench moe.apply --kernel all --preset
# gpt-oss-120b` (FlashInfer next to the Triton and Gluon kernels, bf16-weight rows).
#
# Device: carry [".whl", ".whl-nvidia"], command: bash ci/device/flashinfer_moe.sh [STEP...]
# with STEP in load tests check bench (default: all four).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl || exit 1
if [ ! -d /tmp/site/flashinfer ]; then
  mkdir -p /tmp/site && tar -xJf .whl-nvidia/flashinfer-python.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-nvidia/*.whl
fi
export PYTHONPATH=/tmp/site FLASHINFER_WORKSPACE_BASE=$PWD/.fi-ws MAX_JOBS=${MAX_JOBS:-16}
# The module links libnvrtc.so.13 and libcudart.so.13: the copies torch's CUDA wheels ship.
NV_LIB=$(python3 -c "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13', 'lib'))" 2>/dev/null)
export LD_LIBRARY_PATH=${NV_LIB}:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
AOT=/tmp/site/flashinfer/data/aot/fused_moe_90
if [ -f .whl-nvidia/fused_moe_90.so.xz ] && [ ! -f $AOT/fused_moe_90.so ]; then
  mkdir -p $AOT && xz -dc .whl-nvidia/fused_moe_90.so.xz > $AOT/fused_moe_90.so
  echo "prebuilt module: $(du -h $AOT/fused_moe_90.so | cut -f1) at $AOT"
fi
status=0
steps=${*:-load tests check bench}

load() {
echo "== load FlashInfer's fused_moe_90 module (AOT when prebuilt, else the JIT build)"
start=$(date +%s)
if ! timeout "${BUILD_TIMEOUT_S:-500}" python3 -c "
import torch
from flashinfer.fused_moe.core import get_cutlass_fused_moe_module
from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module
print('AOT module:', gen_cutlass_fused_moe_sm90_module().is_aot)
get_cutlass_fused_moe_module('90')
print('module loaded')
" 2>&1 | tail -8; then
  echo "MODULE NOT READY after $(( $(date +%s) - start )) s (a JIT build resumes on the warm machine)"; exit 3
fi
echo "module ready after $(( $(date +%s) - start )) s"
}

tests() {
echo "== test_flashinfer_moe_gpu.py (float64 reference)"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_flashinfer_moe_gpu.py \
  2>&1 | tail -15 || status=1
}

check() {
echo "== tokenspeed-kernel check moe.apply --kernel flashinfer_cutlass_moe --preset awkward"
timeout 200 python3 -W ignore -m tokenspeed_kernel check moe.apply --kernel flashinfer_cutlass_moe --preset awkward \
  --device cuda 2>&1 | tail -30 || status=1
}

bench() {
echo "== tokenspeed-kernel bench moe.apply --kernel all --preset gpt-oss-120b"
timeout 300 python3 -W ignore -m tokenspeed_kernel bench moe.apply --kernel all --preset gpt-oss-120b \
  --device cuda --json "$OUT/moe_bench_all_flashinfer.json" > "$OUT/moe_bench_all_flashinfer.txt" 2>&1 || status=1
# the bf16-weight cases (the ones FlashInfer serves), whole table in $OUT
grep -E "^moe.apply: .*_bf16|flashinfer_cutlass_moe|triton_fused_moe |torch_grouped_mm " "$OUT/moe_bench_all_flashinfer.txt" \
  | grep -v -E "not in \{|does not support" | head -40
}

for step in $steps; do
  case $step in
    load | tests | check | bench) "$step" ;;
    *) echo "unknown step $step (expected load, tests, check, bench)"; status=2 ;;
  esac
done
exit $status
