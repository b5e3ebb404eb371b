#!/usr/bin/env bash
# Runs HERE, not on the device (no GPU needed): builds .whl-cute/bundle/ (git-ignored), the
# carry for fa4_prefill_sm90, FlashAttention-4's CuTe DSL Hopper forward compiled ahead of time.
#
#   bash ci/device/cutedsl_bundle.sh               # SET=check: 192 variants, ~3.5 MiB, ~6 min on 2 cores
#   SET=serving bash ci/device/cutedsl_bundle.sh   # GPT-OSS only: 16 variants, ~50 s
#
# Why AOT: nvidia-cutlass-dsl-libs-cu13 alone is a 92 MB wheel (61 MiB as xz), too much for
# the 64 MiB carry. CuTe DSL compiles FA4's sm_90a kernels without a GPU (fake tensors, see
# packages/tokenspeed-kernel-nvidia/.../attention/_fa4_build.py); each variant is exported as
# an object (host code + embedded cubin) and all are linked into one fa4_sm90.so, loaded by
# TVM-FFI. At run time that needs only CuTe DSL's runtime library (libcute_dsl_runtime.so,
# 42 MiB, 13 MiB as xz; it links the CUDA runtime statically, needs only libc and the driver)
# and apache-tvm-ffi: neither flash-attn-4 nor the CuTe DSL compiler.
#
# Contents: fa4-aot.tar.xz (fa4/: fa4_sm90.so, libcute_dsl_runtime.so, manifest.json) and the
# cp312 wheel of apache-tvm-ffi (the device image lacks it). The build environment is a
# virtualenv at $VENV (default .whl-cute/venv, over this machine's torch) with the pinned
# cutedsl extra, installed with --no-deps from the package index.
#
# On the device (carry ".whl" with our wheels, see ci/device/README.md, and ".whl-cute/bundle"):
#   python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl .whl-cute/bundle/*.whl
#   tar -xJf .whl-cute/bundle/fa4-aot.tar.xz -C /tmp && export TOKENSPEED_KERNEL_FA4_AOT=/tmp/fa4
#   python3 -m pytest -q tests/tokenspeed_kernel_nvidia/test_fa4_gpu.py
#   tokenspeed-kernel check attention.prefill --kernel fa4_prefill_sm90 --preset awkward
#   tokenspeed-kernel bench attention.prefill --kernel fa4_prefill_sm90,triton_prefill --preset gpt-oss-120b
set -euo pipefail
cd "$(dirname "$0")/../.."

SET=${SET:-check}
JOBS=${JOBS:-2}
VENV=${VENV:-.whl-cute/venv}
OUT=.whl-cute/bundle
# The cutedsl extra, pinned (cp311/cu13 build side), and what importing FA4 needs besides torch.
BUILD=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 cuda-bindings==13.4.4 cuda-pathfinder==1.9.1
  einops typing-extensions)
# The device: Python 3.12, torch 2.11 (CUDA 13); what it lacks of the run time.
RUNTIME=(apache-tvm-ffi==0.1.15.post2)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
    "$VENV/bin/python" -m pip install -q --no-deps "${BUILD[@]}"
fi
rm -rf "$OUT" .whl-cute/fa4 && mkdir -p "$OUT"
"$VENV/bin/python" ci/device/cutedsl_aot.py --out .whl-cute/fa4 --set "$SET" --jobs "$JOBS" 2> >(grep -v -e Warning -e exe_args >&2)
tar -C .whl-cute -cf - fa4 | xz -T0 -9 > "$OUT/fa4-aot.tar.xz"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT" "${RUNTIME[@]}"
ls -la "$OUT"
du -cb "$OUT"/* | tail -1 | awk '{printf "bundle: %.1f MiB (carry limit 64 MiB with the working tree and .whl)\n", $1 / 2^20}'
