#!/usr/bin/env bash
# One device call: the NVIDIA wheel's attention kernels through `tokenspeed-kernel check`
# (float64 reference, --preset awkward) on the GPU, and FlashInfer's GPU tests.
#   1. check attention.decode/prefill for the two Gluon kernels (no JIT; ~1 min)
#   2. tests/tokenspeed_kernel_nvidia/test_flashinfer_gpu.py (JIT: 25-100 s per module)
#   3. check attention.decode/extend/prefill for the FlashInfer kernels, in the time left, one
#      after the other (a call that ran them at once, 3 x MAX_JOBS=16 nvcc builds, ended with
#      the machine no longer answering, 2026-11-23; cause not established)
# STEPS (default "1 2 3") picks steps, e.g. STEPS=3 for the FlashInfer checks alone;
# FI_KERNELS (default all three) narrows step 3, e.g. FI_KERNELS=flashinfer_prefill.
# FlashInfer builds into FLASHINFER_WORKSPACE_BASE=.fi-ws (git-ignored, so a second call on
# the same warm machine resumes instead of rebuilding).
# Here:   rm -rf .whl && pip wheel -q --no-deps --no-build-isolation -w .whl packages/tokenspeed-kernel \
#             packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia
#         bash ci/device/flashinfer_bundle.sh   (if .whl-nvidia is missing)
# Device: carry [".whl", ".whl-nvidia"], command: bash ci/device/nvidia_check.sh
set -uo pipefail
# shellcheck source=ci/device/flashinfer_env.sh
source "$(dirname "$0")/flashinfer_env.sh" || exit 1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
start=$(date +%s)
left() { echo $(( ${BUDGET_S:-540} - ($(date +%s) - start) )); }

check() {  # op kernel
  local t; t=$(left)
  if [ "$t" -lt 30 ]; then echo "SKIP check $1 --kernel $2: budget spent"; return; fi
  timeout "$t" python3 -W ignore -m tokenspeed_kernel check "$1" --kernel "$2" --preset awkward --device cuda \
    > "$OUT/check_$1_$2.txt" 2>&1 || status=1
  echo "check $1 $2: $(tail -1 "$OUT/check_$1_$2.txt")"; grep FAIL "$OUT/check_$1_$2.txt" | head -10
}

steps=" ${STEPS:-1 2 3} "
if [[ $steps == *" 1 "* ]]; then
  echo "== 1. Gluon attention kernels"
  check attention.decode gluon_decode_sm90
  check attention.prefill gluon_prefill_window_sm90
fi
if [[ $steps == *" 2 "* ]]; then
  echo "== 2. FlashInfer GPU tests"
  timeout "${FLASHINFER_TIMEOUT_S:-300}" python3 -m pytest -q -rs -p no:cacheprovider \
    tests/tokenspeed_kernel_nvidia/test_flashinfer_gpu.py 2>&1 | tail -25 || status=1
fi
if [[ $steps == *" 3 "* ]]; then
  echo "== 3. FlashInfer kernels through check"
  for pair in "attention.decode flashinfer_decode" "attention.extend flashinfer_extend" "attention.prefill flashinfer_prefill"; do
    [[ " ${FI_KERNELS:-flashinfer_decode flashinfer_extend flashinfer_prefill} " == *" ${pair#* } "* ]] || continue
    # shellcheck disable=SC2086
    check $pair
  done
fi
exit $status
