#!/usr/bin/env bash
# Build .whl-nvidia/ (git-ignored): FlashInfer and the runtime packages the device image lacks,
# for a machine with no package index. Run here, then carry ".whl-nvidia" in the device call.
#
#   bash ci/device/flashinfer_bundle.sh            # ~21 MB, about 2 minutes on 2 cores
#
# flashinfer-python's wheel (62 MB, zip) is repacked as tar.xz (17.5 MB): its CUDA/C++ sources
# and headers compress ~25x with xz, so nothing has to be deleted to fit the 64 MiB carry limit
# (deleting sources broke FlashInfer's lazy imports once: see docs/history.md, NVIDIA wheel).
# On the device:
#   mkdir -p /tmp/site && tar -xJf .whl-nvidia/flashinfer-python.tar.xz -C /tmp/site
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-nvidia/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/../.."

FLASHINFER=flashinfer-python==0.7.2.post1
# What the H100 image lacks of FlashInfer's requirements (the rest ships with the image's torch).
DEPS=(apache-tvm-ffi==0.1.15.post2 cuda-tile==1.7.0 cuda-python==13.4.4)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)

OUT=.whl-nvidia
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT" && mkdir -p "$OUT" "$WORK/site"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$OUT" "${DEPS[@]}"
python3 -m pip download -q --no-deps "${PLATFORM[@]}" -d "$WORK" "$FLASHINFER"
unzip -q "$WORK"/flashinfer_python-*.whl -d "$WORK/site"
tar -C "$WORK/site" -cf - . | xz -T0 -6 > "$OUT/flashinfer-python.tar.xz"
ls -la "$OUT"
du -cb "$OUT"/* | tail -1 | awk '{printf "bundle: %.1f MiB (carry limit 64 MiB with the working tree)\n", $1 / 2^20}'
