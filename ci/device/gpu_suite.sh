#!/usr/bin/env bash
# The whole test suite on a GPU machine, in shards run in concurrent lanes. Each shard writes
# its log and JUnit XML under $OUT as it goes: a shard that runs out of time still leaves its
# partial log. Each shard prints its pytest summary, and a one-line-per-shard table comes last.
# Compiled kernels are shared by the shards (Triton's on-disk cache, ~/.triton/cache).
#
# Why lanes: one shard alone keeps the machine's CPUs ~30 % busy (worker start-up, imports,
# a long tail of single slow tests), and Triton compiles on the CPU. Lanes run side by side,
# each its shards one after the other, so the whole suite fits one 10-minute device call.
#
# On the lent GPU (`device` tool): carry `.whl` (all four wheels, ci/device/README.md) and
# `.whl-test` (pytest-xdist and execnet, downloaded here:
# `pip download --no-deps -d .whl-test pytest-xdist execnet`); they are installed first.
# Elsewhere (`nox -s gpu`): INSTALL=0 runs against what is installed.
#
#   LANES        lanes separated by '|', each a space-separated list of shard names run in
#                order (default: the three lanes below; `SHARDS="a b"` = one lane, as before)
#   SHARD_S      time limit of one shard, seconds (default 420)
#   DEADLINE_S   time limit of the whole run, seconds: a shard gets at most what is left
#                (default: none)
#   WORKERS      pytest-xdist workers per shard (default: CPU count / lanes, at least 2);
#                without pytest-xdist the shards run in one process each
#   PYTEST_ARGS  extra pytest arguments for every shard (e.g. -x: stop a shard at its first failure)
#   PART         1 or 2: the suite as two device calls (the lanes of each below; LANES overrides);
#                both: the two parts at once on a two-GPU host (below)
set -uo pipefail
# The suite outgrew one 10-minute call (H100, 2026-11-27: core alone 415 s): PART=1, then PART=2
# in a second call, run every shard (DEADLINE_S=560 and 400 fit them); LANES overrides both.
# PART=both on a host with two GPUs (kind nvidia-h100-x2 / nvidia-h200-x2): three lanes on each
# GPU (LANES0, LANES1; core and nvidia halved by file), each GPU with half the CPUs, logs under
# $OUT/part1 and $OUT/part2, every shard allowed the whole DEADLINE_S: the whole suite in one
# call if it fits (not yet run in this form). DRY_RUN=1 prints the lanes' shards and file counts.
install_wheels() {  # our wheels and pytest-xdist, unless INSTALL=0 (installed already)
  [ "${INSTALL:-1}" = 0 ] && return 0
  python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl
  [ -d .whl-test ] && python3 -m pip install -q --no-deps --no-index .whl-test/*.whl
  return 0
}
if [ "${PART:-}" = both ]; then
  BOTH0=${LANES0:-"core_a triton_attn | nvidia_a | triton_misc"}
  BOTH1=${LANES1:-"core_b amd_vllm_examples | nvidia_b | triton_moe"}
  if [ -n "${DRY_RUN:-}" ]; then
    PART= INSTALL=0 LANES=$BOTH0 bash "$0" && PART= INSTALL=0 LANES=$BOTH1 bash "$0"
    exit $?
  fi
  OUT=${OUT:-/tmp/gpu_suite}; mkdir -p "$OUT"
  install_wheels
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
  (( GPUS >= 2 )) || { echo "gpu_suite: PART=both needs two GPUs, this host has $GPUS" >&2; exit 2; }
  HALF_CPUS=$(( $(nproc) / 2 ))
  # Three lanes per GPU, the two largest shards (core, nvidia) halved by file: on 2 x H200
  # (2026-11-28) the two parts' own lanes did not finish in 420 s (core ~575 s, nvidia ~670 s).
  CUDA_VISIBLE_DEVICES=0 PART= INSTALL=0 OUT="$OUT/part1" WORKERS=${WORKERS:-$(( HALF_CPUS / 3 ))} \
    LANES=$BOTH0 \
    DEADLINE_S=${DEADLINE_S:-560} bash "$0" > "$OUT.part1.txt" 2>&1 &
  p1=$!
  CUDA_VISIBLE_DEVICES=1 PART= INSTALL=0 OUT="$OUT/part2" WORKERS=${WORKERS:-$(( HALF_CPUS / 3 ))} \
    LANES=$BOTH1 \
    DEADLINE_S=${DEADLINE_S:-560} bash "$0" > "$OUT.part2.txt" 2>&1 &
  p2=$!
  wait $p1; rc1=$?
  wait $p2; rc2=$?
  cat "$OUT.part1.txt" "$OUT.part2.txt"
  # one archive of the shards' logs and XML (the device returns at most 8 files of $OUT)
  tar -czf "$OUT.logs.tgz" -C "$OUT" part1 part2 && rm -rf "$OUT/part1" "$OUT/part2"
  exit $(( rc1 || rc2 ))
fi
case "${PART:-}" in
  1) LANES=${LANES:-"core | nvidia triton_attn | triton_misc"} ;;
  2) LANES=${LANES:-"triton_moe | amd_vllm_examples"} ;;
  "") ;;
  *) echo "gpu_suite: PART must be 1, 2 or both, got '$PART'" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
[ -z "${DRY_RUN:-}" ] && install_wheels
# The ahead-of-time compile tests (test_aot*.py) are CPU-only and CI runs them on every commit;
# on a GPU host beside the other lanes they outgrew their 300-s compile limit (2026-11-28: four
# errors, nothing else), so the suite leaves them out.
AOT_GLOB='test_aot*.py'
declare -A PATHS=(
  [core]="tests/tokenspeed_kernel"
  [triton_attn]="tests/tokenspeed_kernel_triton/ops/attention tests/tokenspeed_kernel_triton/ops/kvcache"
  [triton_moe]="tests/tokenspeed_kernel_triton/ops/moe"
  # every test module at the Triton tests' top level (a listed subset once missed four)
  [triton_misc]="$(find tests/tokenspeed_kernel_triton -maxdepth 1 -name 'test_*.py' ! -name "$AOT_GLOB" | sort | tr '\n' ' ')"
  [nvidia]="tests/tokenspeed_kernel_nvidia"
  [amd_vllm_examples]="tests/tokenspeed_kernel_amd tests/tokenspeed_kernel_vllm tests/examples"
  [quant]="tests/tokenspeed_kernel/test_quant.py tests/tokenspeed_kernel/test_cli.py tests/tokenspeed_kernel/test_packaging.py tests/tokenspeed_kernel/ops/moe tests/tokenspeed_kernel_triton/ops/moe/test_moe.py tests/tokenspeed_kernel_triton/ops/moe/test_moe_mx.py tests/tokenspeed_kernel_nvidia/test_gluon_moe_decode_gpu.py"
)
# Halves of the two largest shards (PART=both): every other test file, sorted (conftest.py
# files still apply: pytest loads those on each file's path).
_half() { find "$1" -name 'test_*.py' ! -name "$AOT_GLOB" | sort | awk -v parity="$2" 'NR % 2 == parity' | tr '\n' ' '; }
PATHS[core_a]=$(_half tests/tokenspeed_kernel 1)
PATHS[core_b]=$(_half tests/tokenspeed_kernel 0)
PATHS[nvidia_a]=$(_half tests/tokenspeed_kernel_nvidia 1)
PATHS[nvidia_b]=$(_half tests/tokenspeed_kernel_nvidia 0)
# `quant` is in no default lane: a re-run of the quantization references and their users.
# Default lanes: the three that fit one call until 2026-11-25 (core ~210 s alone then; 415 s on
# 2026-11-27, hence PART).
if [ -n "${SHARDS:-}" ]; then LANES=${LANES:-$SHARDS}; fi
LANES=${LANES:-"core | nvidia triton_attn | triton_moe triton_misc amd_vllm_examples"}
IFS='|' read -r -a LANE_LIST <<< "$LANES"
for lane in "${LANE_LIST[@]}"; do
  for name in $lane; do
    [ -n "${PATHS[$name]:-}" ] || { echo "gpu_suite: unknown shard '$name' (known: ${!PATHS[*]})" >&2; exit 2; }
  done
done
CPUS=$(nproc)
WORKERS=${WORKERS:-$(( CPUS / ${#LANE_LIST[@]} > 2 ? CPUS / ${#LANE_LIST[@]} : 2 ))}
SHARD_S=${SHARD_S:-${DEADLINE_S:-420}}
BEGIN=$(date +%s)
PARALLEL=()
if python3 -c "import xdist" 2>/dev/null; then PARALLEL=(-n "$WORKERS"); fi
echo "gpu_suite: ${#LANE_LIST[@]} lane(s) [$LANES], ${PARALLEL[*]:-no xdist}, shard limit ${SHARD_S}s, deadline ${DEADLINE_S:-none}"
if [ -n "${DRY_RUN:-}" ]; then  # the lanes' shards and their test files, nothing run
  for lane in "${LANE_LIST[@]}"; do
    for name in $lane; do
      echo "  shard $name"
      # shellcheck disable=SC2086
      find ${PATHS[$name]} -name 'test_*.py' ! -name "$AOT_GLOB" | sort | sed 's/^/    /'
    done
  done
  find tests -name "$AOT_GLOB" | sort | sed 's/^/    ci-only: /'
  exit 0
fi

run_shard() {  # name -> $OUT/name.{log,xml,rc}; prints one line
  local name=$1 limit=$SHARD_S start
  start=$(date +%s)
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$(( DEADLINE_S - (start - BEGIN) ))
    (( left < limit )) && limit=$left
  fi
  if (( limit <= 0 )); then
    echo "124 0" > "$OUT/$name.rc"
    echo "not run: the run's deadline (DEADLINE_S=$DEADLINE_S) was reached" > "$OUT/$name.log"
  else
    # shellcheck disable=SC2086
    # SIGINT at the limit: pytest stops as on ^C and still prints its summary (failures, skip
    # reasons, durations) and writes the JUnit XML of what ran
    timeout -s INT -k 30 "$limit" python3 -m pytest ${PATHS[$name]} -v -rs "${PARALLEL[@]}" -p no:cacheprovider \
      --durations=10 --ignore-glob="*/$AOT_GLOB" ${PYTEST_ARGS:-} --junitxml="$OUT/$name.xml" > "$OUT/$name.log" 2>&1
    echo "$? $(( $(date +%s) - start ))" > "$OUT/$name.rc"
  fi
  echo "shard $name: rc $(cut -d' ' -f1 "$OUT/$name.rc"), $(cut -d' ' -f2 "$OUT/$name.rc") s: $(tail -1 "$OUT/$name.log")"
}

pids=()
for lane in "${LANE_LIST[@]}"; do
  ( for name in $lane; do run_shard "$name"; done ) &
  pids+=($!)
done
wait "${pids[@]}"

echo
echo "whole run: $(( $(date +%s) - BEGIN )) s"
echo "| shard | rc | s | result |"
echo "| --- | --- | --- | --- |"
failed=0
for lane in "${LANE_LIST[@]}"; do
  for name in $lane; do
    read -r rc s < "$OUT/$name.rc"
    [ "$rc" != 0 ] && failed=1
    echo "| $name | $rc | $s | $(tail -1 "$OUT/$name.log" | tr -d '=' | sed 's/^ *//;s/ *$//') |"
  done
done
exit $failed
