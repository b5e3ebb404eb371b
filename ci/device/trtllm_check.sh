#!/usr/bin/env bash
# One device call for the TensorRT-LLM kernels of the NVIDIA wheel (issue 20, section 3):
# trtllm_xqa_decode and trtllm_fmha_prefill, both through FlashInfer 0.7.2.
#   1. tests/tokenspeed_kernel_nvidia/test_trtllm_gpu.py (float64 numerics, graph replay); its
#      first calls JIT-build XQA (~20-60 s per module) and FMHAv2 (~2 min per dtype)
#   2. `check` of each kernel (cases derived from its registration; float64 reference)
#   3. `bench --preset gpt-oss-120b` of each against the kernel it would displace:
#      gluon_decode_sm90 (decode), triton_prefill (prefill)
#   fa4. the prefill peers in one bench run (issues 20 and 22): FA4's AOT bundle installed
#      (carry ".whl-cute/bundle" too, built here by cutedsl_bundle.sh), `check` of
#      fa4_prefill_sm90 (its registration's derived claims), then `bench attention.prefill` of
#      fa4_prefill_sm90, trtllm_fmha_prefill and triton_prefill with the SDPA baselines
#      (cuDNN, flash) of the same run; then `check` of trtllm_fmha_prefill (its module built)
# STEPS (default "1 2 3") picks steps, e.g. STEPS="fa4" or STEPS="fa4 1". FlashInfer builds into FLASHINFER_WORKSPACE_BASE=.fi-ws
# (git-ignored): a second call on the same warm machine reuses the modules.
# Here:   rm -rf .whl && pip wheel -q --no-deps --no-build-isolation -w .whl packages/tokenspeed-kernel \
#             packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia
#         bash ci/device/flashinfer_bundle.sh   (if .whl-nvidia is missing)
# Device: carry [".whl", ".whl-nvidia"], command: bash ci/device/trtllm_check.sh
set -uo pipefail
# shellcheck source=ci/device/flashinfer_env.sh
source "$(dirname "$0")/flashinfer_env.sh" || exit 1
# FMHAv2's modules, built by an earlier call and carried back as .whl-nvidia/fi-fmha-v2-so.tar.xz
# (the end of this script writes it): installed where FlashInfer loads AOT modules, so no call
# waits ~80 s per dtype for the JIT. Their names (trtllm_fmha_v2_<layout>_<in>_<out>) say all
# the module was built for; every head dim is inside.
if [ -f .whl-nvidia/fi-fmha-v2-so.tar.xz ]; then
  mkdir -p /tmp/fi-fmha && tar -xJf .whl-nvidia/fi-fmha-v2-so.tar.xz -C /tmp/fi-fmha
  find /tmp/fi-fmha -name "trtllm_fmha_v2_*.so" | while read -r so; do
    name=$(basename "$so" .so); mkdir -p "/tmp/site/flashinfer/data/aot/$name" && cp "$so" "/tmp/site/flashinfer/data/aot/$name/"
    echo "AOT module: $name"
  done
fi
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())"
status=0
steps=" ${STEPS:-1 2 3} "
run() {  # seconds label command...
  local t=$1 label=$2; shift 2
  echo "== $label"
  timeout "$t" "$@" > "$OUT/$label.txt" 2>&1 || { status=1; echo "exit $?"; }
  tail -"${TAIL:-25}" "$OUT/$label.txt"
}
if [[ $steps == *" 1 "* ]]; then
  run 330 gpu_tests python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_trtllm_gpu.py
fi
if [[ $steps == *" 2 "* ]]; then
  TAIL=12 run 120 check_decode python3 -W ignore -m tokenspeed_kernel check attention.decode --kernel trtllm_xqa_decode --device cuda
  TAIL=12 run 120 check_prefill python3 -W ignore -m tokenspeed_kernel check attention.prefill --kernel trtllm_fmha_prefill --device cuda
fi
if [[ $steps == *" 3 "* ]]; then
  TAIL=30 run 150 bench_decode python3 -W ignore -m tokenspeed_kernel bench attention.decode \
    --kernel trtllm_xqa_decode,gluon_decode_sm90 --preset gpt-oss-120b --device cuda
  TAIL=30 run 150 bench_prefill python3 -W ignore -m tokenspeed_kernel bench attention.prefill \
    --kernel trtllm_fmha_prefill,triton_prefill --preset gpt-oss-120b --device cuda
fi
if [[ $steps == *" fa4 "* ]]; then
  python3 -m pip install -q --no-deps --no-index .whl-cute/bundle/*.whl
  tar -xJf .whl-cute/bundle/fa4-aot.tar.xz -C /tmp && export TOKENSPEED_KERNEL_FA4_AOT=/tmp/fa4
  TAIL=12 run 120 check_fa4 python3 -W ignore -m tokenspeed_kernel check attention.prefill \
    --kernel fa4_prefill_sm90 --device cuda
  TAIL=40 run 330 bench_prefill_peers python3 -W ignore -m tokenspeed_kernel bench attention.prefill \
    --kernel fa4_prefill_sm90,trtllm_fmha_prefill,triton_prefill --preset gpt-oss-120b --device cuda \
    --json "$OUT/prefill_peers.json"
  TAIL=12 run 100 check_prefill python3 -W ignore -m tokenspeed_kernel check attention.prefill \
    --kernel trtllm_fmha_prefill --device cuda
fi
# FMHAv2 modules, carried ones and the ones this call JIT-built: returned together, to carry as
# .whl-nvidia/fi-fmha-v2-so.tar.xz next time
mkdir -p /tmp/fi-fmha && find .fi-ws -name "trtllm_fmha_v2_*.so" -exec cp {} /tmp/fi-fmha/ \;
(cd /tmp/fi-fmha && find . -name "trtllm_fmha_v2_*.so" -print0 | tar --null -T - -cf - | xz -T0 -6 \
  > "$OUT/fi-fmha-v2-so.tar.xz") && ls -la "$OUT/fi-fmha-v2-so.tar.xz"
exit $status
