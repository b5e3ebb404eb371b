#!/usr/bin/env bash
# One device call that verifies the opt-in kernels still waiting for a GPU (ci/device/README.md):
#   1. triton_fused_moe_mx (tl.dot_scaled MXFP4 MoE): GPU numerics tests, then moe_bench.py --mx
#   2. gluon_prefill_window_sm90 + gluon_decode_sm90: GPU numerics tests, then nvidia_bench.py
#      (FlashInfer rows too when .whl-nvidia was carried and unpacked by this script)
#   3. examples/gpt_oss end to end (short budget; E2E_ROWS picks rows, default torch,selector,nvidia)
#   host: ci/device/attention_host_bench.py (host overhead of the public calls, graph-replayed timings)
#   moequick: moe_bench.py --mx without the tile sweep (numerics + table, ~2 min)
#   flashinfer: tests/tokenspeed_kernel_nvidia/test_flashinfer_gpu.py (needs .whl-nvidia)
#   moegemv: ci/device/moe_gemv_bench.py (triton_moe_gemv_mx, T <= 8, ~2 min)
#   moefp8: moe_bench.py --fp8-act --combine (activation_quant="fp8", combine="atomic", ~6 min)
#   gluonmoe: gluon_moe_decode_mx_sm90 GPU tests, then ci/device/gluon_moe_bench.py (T <= 8, ~3 min)
#   gluonmma: both Gluon MoE decode kernels' GPU tests, then gluon_moe_bench.py --mma-sweep --breakdown (~2 min)
#   prefill: FlashInfer prefill JIT warm-up (first calls timed apart), then
#           `bench attention.prefill --kernel triton_prefill,flashinfer_prefill --preset prefill-lengths`
#           (the length sweep behind flashinfer_prefill's ranking; needs .whl-nvidia) (~6 min on a fresh machine,
#           ~3 min with .whl-nvidia/fi-prefill-so.tar.xz)
#   prefillplan: ci/device/prefill_plan_cost.py, flashinfer_prefill vs triton_prefill per eager call with
#           FlashInfer's per-layout plan included (needs .whl-nvidia; ~1 min with fi-prefill-so.tar.xz, else
#           ~4 min of JIT first)
#   decode: gluon_decode_sm90 GPU tests, `check --preset awkward`, decode_splits_sweep.py --quick, then
#           `bench attention.decode --kernel all --preset gpt-oss-120b` (does the selector pick the fastest?) (~5 min)
# Each step has its own time budget and never stops the next one; results land in $OUT.
#
# Here:   rm -rf .whl && pip wheel -q --no-deps --no-build-isolation -w .whl packages/tokenspeed-kernel \
#             packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia
#         (optional) bash ci/device/flashinfer_bundle.sh
# Device: carry [".whl"] (and ".whl-nvidia"), command: bash ci/device/verify_pending.sh STEP...
# with STEP in moe, moequick, moegemv, moefp8, gluonmoe, gluonmma, decode, prefill, prefillplan, nvidia, flashinfer, e2e, host (default: moe nvidia e2e). A call may run 10 minutes at most:
# `moe e2e` fits one call (~7 min), `nvidia` another (~6 min, longer with FlashInfer JIT).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl || exit 1
if [ -f .whl-nvidia/flashinfer-python.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .whl-nvidia/flashinfer-python.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-nvidia/*.whl
  export PYTHONPATH=/tmp/site
fi
# The two FlashInfer prefill modules (bf16, head dim 64, no window; with and without sinks) an
# earlier `prefill` step built and returned as fi-ws-so.tar.xz, carried back as
# .whl-nvidia/fi-prefill-so.tar.xz: installed where FlashInfer loads AOT modules, so no JIT.
# FlashInfer trusts an AOT module by its name, and the sink module's name carries neither head
# dim nor KV dtype (docs/nvidia.md, "JIT module name hazard"): only steps at head dim 64 with
# bf16 KV may run with it, so it is installed by those steps and removed after them.
_FI_AOT=/tmp/site/flashinfer/data/aot
aot_prefill_on() {
  [ -f .whl-nvidia/fi-prefill-so.tar.xz ] || return 0
  mkdir -p /tmp/fi-so && tar -xJf .whl-nvidia/fi-prefill-so.tar.xz -C /tmp/fi-so
  find /tmp/fi-so -name "*.so" | while read -r so; do
    name=$(basename "$so" .so); mkdir -p "$_FI_AOT/$name" && cp "$so" "$_FI_AOT/$name/" && echo "AOT module: $name"
  done
}
aot_prefill_off() {
  [ -d /tmp/fi-so ] || return 0
  find /tmp/fi-so -name "*.so" | while read -r so; do rm -rf "${_FI_AOT:?}/$(basename "$so" .so)"; done
}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
steps=${*:-moe nvidia e2e}

moe() {
echo "== 1. triton_fused_moe_mx"
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_triton/ops/moe/test_moe_mx.py \
  -k gpu_numerics 2>&1 | tail -15 || status=1
timeout 260 python3 ci/device/moe_bench.py --mx --budget 230 --json "$OUT/moe_mx.json" 2>&1 | tail -40 || status=1
}

nvidia() {
echo "== 2. Gluon sm_90 kernels (and FlashInfer when present)"
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_prefill_gpu.py \
  2>&1 | tail -15 || status=1
BUDGET_S=${NVIDIA_BUDGET_S:-240} timeout 400 python3 ci/device/nvidia_bench.py 2>&1 | tail -60 || status=1
}

e2e() {
echo "== 3. examples/gpt_oss end to end"
timeout 200 python3 ci/device/e2e_bench.py --rows "${E2E_ROWS:-torch,selector,nvidia}" --budget-s 90 --rep-ms 60 \
  2>&1 | tail -30 || status=1
}

host() {
echo "== attention host overhead and graph-replayed timings"
timeout 200 python3 ci/device/attention_host_bench.py 2>&1 | tail -60 || status=1
}

flashinfer() {
echo "== FlashInfer kernels vs float64 (JIT: 25-100 s per module on first use)"
timeout "${FLASHINFER_TIMEOUT_S:-420}" python3 -m pytest -q -rs -p no:cacheprovider \
  tests/tokenspeed_kernel_nvidia/test_flashinfer_gpu.py 2>&1 | tail -40 || status=1
}

moegemv() {
echo "== triton_moe_gemv_mx (T <= 8): numerics, graph replay, timings vs triton_fused_moe_mx"
timeout 200 python3 ci/device/moe_gemv_bench.py --json "$OUT/moe_gemv.json" 2>&1 | tail -30 || status=1
}

moefp8() {
echo "== triton_fused_moe: activation_quant=fp8 and combine=atomic vs the defaults"
timeout 400 python3 ci/device/moe_bench.py --fp8-act --combine --no-sweep --budget 380 \
  --json "$OUT/moe_fp8act_combine.json" 2>&1 | tail -40 || status=1
}

gluonmoe() {
echo "== gluon_moe_decode_mx_sm90 (T <= 8): GPU numerics tests, then numerics + timings vs Triton/torch"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_moe_decode_gpu.py \
  2>&1 | tail -15 || status=1
timeout 240 python3 ci/device/gluon_moe_bench.py --json "$OUT/gluon_moe.json" 2>&1 | tail -30 || status=1
}

gluonmma() {
echo "== Gluon MoE decode (T <= 8): GPU numerics tests of both kernels, then numerics + timings + MMA config sweep + breakdown"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -k "not tma" tests/tokenspeed_kernel_nvidia/test_gluon_moe_decode_gpu.py \
  2>&1 | tail -15 || status=1
# The opt-in TMA-staged layers on their own clock: a hung mbarrier must not cost the call.
tma_flag=""
if ! timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -k tma tests/tokenspeed_kernel_nvidia/test_gluon_moe_decode_gpu.py \
  2>&1 | tail -15; then
  echo "TMA-staged layers failed or timed out: their sweep and breakdown rows are skipped"; tma_flag="--skip-tma"; status=1
fi
timeout 300 python3 ci/device/gluon_moe_bench.py --mma-sweep --breakdown $tma_flag --json "$OUT/gluon_moe_mma.json" 2>&1 | tail -75 || status=1
}

decode() {
echo "== gluon_decode_sm90: GPU tests, check vs float64, split sweep, then every decode kernel on the preset"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_decode_gpu.py \
  2>&1 | tail -8 || status=1
timeout 120 python3 -W ignore -m tokenspeed_kernel check attention.decode --kernel gluon_decode_sm90 --preset awkward \
  --device cuda 2>&1 | tail -14 || status=1
timeout 120 python3 ci/device/decode_splits_sweep.py --quick 2>&1 | tail -20 || status=1
timeout 200 python3 -W ignore -m tokenspeed_kernel bench attention.decode --kernel all --preset gpt-oss-120b \
  --device cuda --json "$OUT/decode_bench_all.json" 2>&1 | tail -70 || status=1
}

prefill() {
echo "== prefill length sweep: FlashInfer JIT warm-up, then triton_prefill vs flashinfer_prefill by length"
aot_prefill_on
timeout "${PREFILL_WARM_S:-300}" python3 -W ignore ci/device/flashinfer_prefill_warm.py 2>&1 | grep -v "INFO" | tail -8 \
  || status=1
# the bench gets what is left of the call's 600 s ($SECONDS counts from this script's start)
timeout "$(( ${PREFILL_END_S:-575} - SECONDS ))" python3 -W ignore -m tokenspeed_kernel bench attention.prefill \
  --kernel triton_prefill,flashinfer_prefill --preset prefill-lengths --device cuda --json "$OUT/prefill_lengths.json" \
  > "$OUT/prefill_lengths.txt" 2>&1 || status=1
grep -v "INFO" "$OUT/prefill_lengths.txt" | grep -v "^W1" | tail -130
aot_prefill_off
# The JIT-built modules, so a later call can carry them back (FLASHINFER_WORKSPACE_BASE=.fi-ws)
if [ -n "${FLASHINFER_WORKSPACE_BASE:-}" ]; then
  (cd "$FLASHINFER_WORKSPACE_BASE" && find . -name "*.so" -print0 | tar --null -T - -cf - | xz -T0 -6 \
    > "$OUT/fi-ws-so.tar.xz") && ls -la "$OUT/fi-ws-so.tar.xz"
fi
}

prefillplan() {
echo "== flashinfer_prefill vs triton_prefill per eager call, FlashInfer's plan per layout included"
aot_prefill_on
timeout "${PLAN_S:-400}" python3 -W ignore ci/device/prefill_plan_cost.py --json "$OUT/prefill_plan_cost.json" \
  2>&1 | grep -v "INFO" | tee "$OUT/prefill_plan_cost.txt" | tail -40 || status=1
aot_prefill_off
}

moequick() {
echo "== triton_fused_moe_mx numerics + table (no sweep)"
timeout 200 python3 ci/device/moe_bench.py --mx --no-sweep --budget 170 --json "$OUT/moe_mx.json" 2>&1 | tail -16 \
  || status=1
}

for step in $steps; do
  case $step in
    moe | moequick | moegemv | moefp8 | gluonmoe | gluonmma | decode | prefill | prefillplan | nvidia | flashinfer | e2e | host) "$step" ;;
    *) echo "unknown step $step (expected moe, moequick, moegemv, moefp8, gluonmoe, gluonmma, decode, prefill, prefillplan, nvidia, flashinfer, e2e, host)"; status=2 ;;
  esac
done
exit $status
