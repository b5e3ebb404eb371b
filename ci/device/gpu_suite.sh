#!/usr/bin/env bash
# The whole test suite on a GPU machine, in shards. Each shard writes its log and JUnit XML
# under $OUT as it goes: a shard that runs out of time still leaves its partial log.
# Each shard prints its pytest summary, and a one-line-per-shard table comes last.
# Compiled kernels are shared by the shards (Triton's on-disk cache, ~/.triton/cache).
#
# On the lent GPU (`device` tool): carry `.whl` (all four wheels, ci/device/README.md) and
# `.whl-test` (pytest-xdist and execnet, downloaded here:
# `pip download --no-deps -d .whl-test pytest-xdist execnet`); they are installed first.
# Elsewhere (`nox -s gpu`): INSTALL=0 runs against what is installed.
#
#   SHARDS       space-separated subset of the shard names below (default: all six)
#   SHARD_S      time limit of one shard, seconds (default 240)
#   WORKERS      pytest-xdist workers per shard (default 12; Triton compiles on the CPU);
#                without pytest-xdist the shards run in one process each
#   PYTEST_ARGS  extra pytest arguments for every shard (e.g. -x: stop a shard at its first failure)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
if [ "${INSTALL:-1}" != 0 ]; then
  python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl
  [ -d .whl-test ] && python3 -m pip install -q --no-deps --no-index .whl-test/*.whl
fi
SHARD_S=${SHARD_S:-240}
WORKERS=${WORKERS:-12}
PARALLEL=()
if python3 -c "import xdist" 2>/dev/null; then PARALLEL=(-n "$WORKERS"); fi
declare -A PATHS=(
  [core]="tests/tokenspeed_kernel"
  [triton_attn]="tests/tokenspeed_kernel_triton/ops/attention tests/tokenspeed_kernel_triton/ops/kvcache"
  [triton_moe]="tests/tokenspeed_kernel_triton/ops/moe"
  [triton_misc]="tests/tokenspeed_kernel_triton/test_aot_compile_attention.py tests/tokenspeed_kernel_triton/test_aot_compile_moe.py tests/tokenspeed_kernel_triton/test_check_cli.py tests/tokenspeed_kernel_triton/test_launcher.py tests/tokenspeed_kernel_triton/test_launcher_gpu.py"
  [nvidia]="tests/tokenspeed_kernel_nvidia"
  [amd_vllm_examples]="tests/tokenspeed_kernel_amd tests/tokenspeed_kernel_vllm tests/examples"
  [quant]="tests/tokenspeed_kernel/test_quant.py tests/tokenspeed_kernel/test_cli.py tests/tokenspeed_kernel/test_packaging.py tests/tokenspeed_kernel/ops/moe tests/tokenspeed_kernel_triton/ops/moe/test_moe.py tests/tokenspeed_kernel_triton/ops/moe/test_moe_mx.py tests/tokenspeed_kernel_nvidia/test_gluon_moe_decode_gpu.py"
)
# `quant` is not in the default order: a re-run of the quantization references and their users.
ORDER=${SHARDS:-"nvidia triton_attn triton_moe triton_misc core amd_vllm_examples"}
for name in $ORDER; do
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 10 "$SHARD_S" python3 -m pytest ${PATHS[$name]} -v -rs "${PARALLEL[@]}" -p no:cacheprovider \
    --durations=10 ${PYTEST_ARGS:-} --junitxml="$OUT/$name.xml" > "$OUT/$name.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" > "$OUT/$name.rc"
  echo "shard $name: rc $(cut -d' ' -f1 "$OUT/$name.rc"), $(cut -d' ' -f2 "$OUT/$name.rc") s: $(tail -1 "$OUT/$name.log")"
done
echo
echo "| shard | rc | s | result |"
echo "| --- | --- | --- | --- |"
failed=0
for name in $ORDER; do
  read -r rc s < "$OUT/$name.rc"
  [ "$rc" != 0 ] && failed=1
  echo "| $name | $rc | $s | $(tail -1 "$OUT/$name.log" | tr -d '=' | sed 's/^ *//;s/ *$//') |"
done
exit $failed
