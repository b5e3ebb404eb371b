# Sourced by the device scripts that run FlashInfer-backed kernels (nvidia_check.sh,
# trtllm_check.sh): installs the carried wheels (.whl), unpacks FlashInfer and its runtime
# packages (.whl-nvidia, from flashinfer_bundle.sh) into /tmp/site once per machine, and
# exports PYTHONPATH, FLASHINFER_WORKSPACE_BASE=.fi-ws (JIT builds kept on a warm machine),
# MAX_JOBS and OUT. Returns 1 when the wheels cannot be installed.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" .fi-ws
python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl || return 1
if [ -f .whl-nvidia/flashinfer-python.tar.xz ] && [ ! -d /tmp/site/flashinfer ]; then
  mkdir -p /tmp/site && tar -xJf .whl-nvidia/flashinfer-python.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-nvidia/*.whl
fi
export PYTHONPATH=/tmp/site FLASHINFER_WORKSPACE_BASE=$PWD/.fi-ws MAX_JOBS=${MAX_JOBS:-16}
