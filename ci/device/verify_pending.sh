#!/usr/bin/env bash
# One device call that re-verifies one kernel after a change, in named steps (ci/device/README.md):
# its GPU tests, then `tokenspeed-kernel check` and `bench` of it, plus what needs more than the
# CLI (FlashInfer's modules installed as AOT modules, a launch-configuration sweep, the example):
#   moe: triton_fused_moe_mx (tl.dot_scaled MXFP4 MoE): GPU numerics tests, `check` on the awkward
#        preset, `bench moe.apply` next to triton_fused_moe (~3 min)
#   mxswap: triton_fused_moe_mx_swap (opt-in, issue 21): GPU numerics and graph-capture tests, `check` on
#        the awkward preset, `bench moe.apply` next to triton_fused_moe_mx (and matmul_ogs with .whl-ogs
#        carried), then ci/device/tiles_sweep.py on its points until the call's 10 minutes are nearly up
#   mxp: triton_fused_moe_mx_swap_persistent (first from 4096 tokens): its GPU numerics,
#        graph-capture and bound-run tests, then ci/device/mxp_sweep.py (every schedule checked against
#        float64, then timed next to triton_fused_moe_mx_swap and matmul_ogs at T = 64, 512, 1024, 4096;
#        .whl-ogs carried for the matmul_ogs rows) until the call's 10 minutes are nearly up (~6-8 min)
#   nvidia: gluon_prefill_window_sm90: GPU numerics tests, `check` on the awkward preset, `bench
#        attention.prefill` next to triton_prefill (~3 min)
#   winp: gluon_prefill_window_sm90's opt-in window variants and its persistent build (issue 20's 2x flex; branch
#        winp): the variants' and the persistent build's GPU tests (each vs float64; the persistent build also vs
#        the tiled build's bits) (<= 180 s), then ci/device/fa3_sweep.py --window 127 --classic --head-dim 64 (the
#        shipped tiles, then window_variants(), the persistent build at 5 and 6 programs per SM first, then
#        triton_prefill and FA4, at S = 8192 and B = 4 x 4096) (<= 270 s), then `bench attention.prefill --kernel
#        gluon_prefill_window_sm90 --preset gpt-oss-120b` (flex_attention's rows in the same call) on what is left
#        of 570 s: ~8-9.5 min, alone in a call
#   fa3g: gluon_prefill_fa3_sm90 (issue 20, FA3-style dense causal prefill, opt-in): GPU numerics tests, `check`
#        on the awkward preset, `bench attention.prefill` next to triton_prefill and fa4_prefill_sm90 (FA4 rows
#        need .whl-cute/bundle carried), then ci/device/fa3_sweep.py (configs at S=8192 / B=4x4096, D 64 and 128)
#        until the call's 10 minutes are nearly up (~7-9 min)
#   fa3v: gluon_prefill_fa3_sm90's opt-in variants (P·V wait after the softmax, exp2 partly on FMA, three consumer
#        warpgroups, lazy rescale):
#        the sweep-configuration tests of its GPU test file (every configuration and variant vs float64 on
#        awkward shapes; the shipped configuration's own tests are fa3g's), then
#        ci/device/fa3_sweep.py --variants (D = 64 at S = 8192 and B = 4 x 4096 first, then D = 128; each variant
#        vs float64, then timed next to the shipped configuration, triton_prefill and fa4_prefill_sm90; FA4 rows
#        need .whl-cute/bundle carried) on a budget that ends the call by ~4.5 min; one table last (~4-5 min)
#   fa3x: gluon_extend_fa3_sm90 (issue 20, FA3-style paged extend, opt-in, never run on a GPU yet): GPU numerics
#        tests, with the dense kernel's variants the shared consumer gives it (pv_overlap, exp2_poly, lazy
#        rescale: 6 more tests) (130 s), `check attention.extend --preset awkward` (50 s), `bench
#        attention.extend` next to triton_extend on the gpt-oss-120b preset (90 s): under 4.5 minutes, each part
#        on its own clock
#   fa3w: gluon_prefill_fa3_window_sm90 (issue 20, the dense FA3-style prefill's sliding-window build, opt-in, never
#        run on a GPU yet): its GPU numerics tests (windows 0, 4, 127, 200, past the sequence; ragged, Lk > Lq,
#        Lq > Lk, sinks, D 128; the swept alternatives) (<= 120 s), `check attention.prefill --preset awkward`
#        (<= 45 s), `bench attention.prefill` next to gluon_prefill_window_sm90 and triton_prefill on the
#        gpt-oss-120b preset (<= 75 s; the window-127 rows are the goal's), then ci/device/fa3_sweep.py --window 127
#        (the window build's configurations next to those peers and FA4, S = 8192 first) on what is left of
#        4 minutes (at least 30 s): ~4 min, 4.5 at most
#   fa3nan: gluon_prefill_fa3_sm90 and gluon_prefill_fa3_window_sm90 clean V on dirty tiles (unseen NaN/inf leaked
#        through 0 x NaN in wgmma): the GPU tests that poison K and V at keys rows cannot see (one key at a time;
#        every swept configuration too, ~26 compiles on a fresh machine) (<= 150 s), test_edge_inputs.py's
#        prefill invisible-NaN cases on every serving kernel (<= 50 s), then ci/device/fa3_sweep.py --clean-ab
#        --head-dim 64 (the shipped D 64 configuration, the same without the cleaning (byte-identical to the
#        build before the fix), triton_prefill and FA4 at S = 8192 and B = 4 x 4096) (<= 90 s): ~3 min, 5 at most
#   e2e: examples/gpt_oss end to end (short budget; E2E_ROWS picks rows, default torch,selector,nvidia)
#   flashinfer: tests/tokenspeed_kernel_nvidia/test_flashinfer_gpu.py (needs .whl-nvidia)
#   gluonmoe: gluon_moe_decode_mx_sm90 GPU tests, then ci/device/gluon_moe_bench.py (T <= 8, ~3 min)
#   gluonmma: both Gluon MoE decode kernels' GPU tests, then gluon_moe_bench.py --mma-sweep --breakdown (~2 min)
#   prefill: FlashInfer prefill JIT warm-up (first calls timed apart), then
#           `bench attention.prefill --kernel triton_prefill,flashinfer_prefill --preset prefill-lengths`
#           (the length sweep behind flashinfer_prefill's ranking; its rows add the time with a new layout every
#           call, FlashInfer's per-layout plan; needs .whl-nvidia) (~6 min on a fresh machine, ~3 min with
#           .whl-nvidia/fi-prefill-so.tar.xz)
#   fiext: issue 20's extend peer: `bench attention.extend --kernel gluon_extend_fa3_sm90,flashinfer_extend,
#           triton_extend --preset extend-lengths` with FlashInfer's FA3 sink module installed as an AOT module
#           (.whl-nvidia/fi-prefill-so.tar.xz from ci/device/flashinfer_attention_prebuild.py; carry .whl, .whl-nvidia)
#   stepplan: the step plans on the GPU (ci/device/README.md item o): test_step_plan_gpu.py (every bind-hook kernel and
#           the decode step plan's kernels through the plans, bitwise as the call, vs float64), then vllm_compare.py
#           (carry .whl-vllm; the plugin's eager/mixed decodes run through DecodeStepPlan), then the example's eager
#           vs graph at decode B=1 (issue 19's third target) (~6 min)
#   stridedq: `check` of the Triton attention kernels (derived cases), whose feature-strided_q cases
#           (a row-strided q, NaN beyond each row's q) must pass (~3 min)
#   stridedg: the Gluon attention kernels read a row-strided q (ci/device/README.md item q): the strided-q
#           rows of their four GPU test files, against float64 and the contiguous q's bits (<= 300 s)
#   stridedgc: `check` of each of the five (derived cases: feature-strided_q, and q_align=16 for the extend)
#           (<= 80 s each), then of triton_store_kvcache (feature-strided_rows) (<= 60 s); run it in its own
#           call after stridedg on a fresh machine
#   planq: a DecodePlan for a row-strided q (mha_decode_plan(..., q_row_stride=...); ci/device/README.md item u): the
#           strided-q plan rows of test_gluon_decode_gpu.py (the contiguous plan's bits, float64, graph replay) and
#           its bound-plan test (<= 200 s), `check attention.decode --kernel gluon_decode_sm90` (its feature-strided_q
#           case now also through the decode plan, <= 80 s), then vllm_compare.py (carry .whl-vllm: the full-graph
#           decode of a fused qkv's q, "backend (plan, fused-qkv q) vs public", <= 240 s)
#   gemv16: triton_moe_gemv (bf16-weight MoE for T <= 8, two GEMV launches, opt-in, never run on a GPU yet; item r):
#           its GPU tests and the GEMV MXFP4 ones (shared kernels), test_no_host_sync.py, the launch-cache tests of the
#           MoE kernels (<= 240 s and 120 s), `check moe.apply --kernel triton_moe_gemv` (derived cases, <= 120 s),
#           `bench moe.apply --kernel triton_moe_gemv,triton_fused_moe --preset moe-decode-bf16` (<= 150 s),
#           `overhead --device cuda --op moe.apply` (row "MoEPlan.apply (triton_moe_gemv)", <= 90 s), then
#           moe_decode_sweep.py --sections gemv16 on what is left of 580 s: ~8-9.5 min, alone in a call
#   xplan: the step plans' host cost (issue 19; branch xplan: the launch cache's derived slots, inline hook and
#           globals checks, the Gluon TMA kernels' never-read placeholder, the plans' quick layout check): the step
#           plans' GPU tests, the launch cache's (every runner kernel bitwise vs Triton's path, the TMA runners'
#           slot encodings over alternating layers, graph capture) (<= 270 s), the three Gluon TMA kernels' numerics
#           rows vs float64 (<= 240 s), then `check` of gluon_extend_fa3_sm90 through its plan too (<= 60 s): ~7-9 min
#           on a fresh machine, alone in a call; the host-cost A/B is overhead_ab.sh, in a call of its own
#   decode: gluon_decode_sm90 GPU tests, `check --preset awkward`, decode_splits_sweep.py --quick, then
#           `bench attention.decode --kernel all --preset gpt-oss-120b` (does the selector pick the fastest?) (~5 min)
# Each step has its own time budget and never stops the next one; results land in $OUT.
#
# Here:   rm -rf .whl && pip wheel -q --no-deps --no-build-isolation -w .whl packages/tokenspeed-kernel \
#             packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia
#         (optional) bash ci/device/flashinfer_bundle.sh
#         (optional) bash ci/device/triton_kernels_bundle.sh   # .whl-ogs: matmul_ogs rows in `bench moe.apply`
# Device: carry [".whl"] (and ".whl-nvidia", ".whl-ogs", ".whl-cute/bundle"), command: bash ci/device/verify_pending.sh
# STEP... with STEP in moe, mxswap, mxp, gluonmoe, gluonmma, decode, prefill, nvidia, winp, fa3g, fa3v, fa3w, fa3x, fa3nan, fiext, flashinfer, e2e,
# stepplan, stridedq, stridedg, stridedgc, planq, gemv16, xplan
# (default: decode); INSTALL=0 skips installing .whl and unpacking FA4's bundle (done once for every lane of the call). A call may run 10 minutes at most: `moe nvidia` fits one call, `e2e` with either; `mxswap`, `mxp` and `fa3g` alone.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ "${INSTALL:-1}" = 0 ] || python3 -m pip install -q --force-reinstall --no-deps --no-index .whl/*.whl || exit 1
if [ -f .whl-nvidia/flashinfer-python.tar.xz ]; then
  mkdir -p /tmp/site && tar -xJf .whl-nvidia/flashinfer-python.tar.xz -C /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl-nvidia/*.whl
  export PYTHONPATH=/tmp/site
fi
if [ -f .whl-cute/bundle/fa4-aot.tar.xz ]; then  # FA4's AOT bundle: the fa4_prefill_sm90 peer rows
  if [ "${INSTALL:-1}" != 0 ]; then  # INSTALL=0: installed and unpacked once for every lane
    python3 -m pip install -q --no-deps --no-index .whl-cute/bundle/*.whl
    tar -xJf .whl-cute/bundle/fa4-aot.tar.xz -C /tmp
  fi
  export TOKENSPEED_KERNEL_FA4_AOT=/tmp/fa4
fi
if [ -f .whl-ogs/triton_kernels.tar.xz ]; then  # OpenAI's triton_kernels: the matmul_ogs baselines of bench
  mkdir -p /tmp/ogs && tar -xJf .whl-ogs/triton_kernels.tar.xz -C /tmp/ogs
  export PYTHONPATH=/tmp/ogs${PYTHONPATH:+:$PYTHONPATH}
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
steps=${*:-decode}

# GPU tests of one kernel, then `check` (awkward preset) and `bench` (GPT-OSS sizes, next to PEERS)
kernel_step() {  # test_file pytest_k op kernel peers
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider "$1" ${2:+-k "$2"} 2>&1 | tail -15 || status=1
timeout 150 python3 -W ignore -m tokenspeed_kernel check "$3" --kernel "$4" --preset awkward --device cuda \
  2>&1 | tail -14 || status=1
timeout 200 python3 -W ignore -m tokenspeed_kernel bench "$3" --kernel "$4,$5" --preset gpt-oss-120b --device cuda \
  --json "$OUT/bench_$4.json" 2>&1 | tail -60 || status=1
}

moe() {
echo "== triton_fused_moe_mx: GPU tests, check vs float64, bench next to triton_fused_moe"
kernel_step tests/tokenspeed_kernel_triton/ops/moe/test_moe_mx.py gpu_numerics moe.apply triton_fused_moe_mx \
  triton_fused_moe
}

mxswap() {
echo "== triton_fused_moe_mx_swap: GPU tests, check vs float64, bench next to triton_fused_moe_mx, tile sweep"
kernel_step tests/tokenspeed_kernel_triton/ops/moe/test_moe_mx_swap.py "" moe.apply triton_fused_moe_mx_swap \
  triton_fused_moe_mx
# the sweep gets what is left of the call's 600 s ($SECONDS counts from this script's start)
timeout "$(( ${MXSWAP_END_S:-590} - SECONDS ))" python3 -W ignore ci/device/tiles_sweep.py \
  --kernel triton_fused_moe_mx_swap --budget-s "$(( ${MXSWAP_END_S:-590} - 60 - SECONDS ))" \
  --json "$OUT/tiles_mx_swap.json" 2>&1 | tail -45 || status=1
}

mxp() {
echo "== triton_fused_moe_mx_swap_persistent: GPU tests, then every schedule vs float64 and timed (mxp_sweep.py)"
timeout 170 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_triton/ops/moe/test_moe_mx_swap_persistent.py \
  2>&1 | tail -15 || status=1
# the sweep gets what is left of the call's 600 s ($SECONDS counts from this script's start)
timeout "$(( ${MXP_END_S:-590} - SECONDS ))" python3 -W ignore ci/device/mxp_sweep.py \
  --budget-s "$(( ${MXP_END_S:-590} - 90 - SECONDS ))" --json "$OUT/mxp_sweep.json" 2>&1 | tail -60 || status=1
}

nvidia() {
echo "== gluon_prefill_window_sm90: GPU tests, check vs float64, bench next to triton_prefill"
kernel_step tests/tokenspeed_kernel_nvidia/test_gluon_prefill_gpu.py "" attention.prefill gluon_prefill_window_sm90 \
  triton_prefill
}

winp() {
echo "== gluon_prefill_window_sm90: the window variants' and the persistent build's GPU tests, sweep, bench vs flex"
# A hung mbarrier (a ring-phase bug in the persistent walk) must not cost the call: each part on its own clock.
timeout 180 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_prefill_gpu.py \
  -k "variants or persistent" 2>&1 | tail -15 || status=1
timeout 270 python3 -W ignore ci/device/fa3_sweep.py --window 127 --classic --head-dim 64 --budget-s 240 \
  --json "$OUT/window_variants.json" 2>&1 | tail -30 || status=1
# the bench gets what is left of 570 s ($SECONDS counts from this script's start; at least 60 s)
local left=$(( ${WINP_END_S:-570} - SECONDS ))
(( left < 60 )) && left=60
timeout "$left" python3 -W ignore -m tokenspeed_kernel bench attention.prefill --kernel gluon_prefill_window_sm90 \
  --preset gpt-oss-120b --device cuda --json "$OUT/window_bench.json" 2>&1 | tail -30 || status=1
}

fa3g() {
echo "== gluon_prefill_fa3_sm90: GPU tests, check vs float64, bench next to triton_prefill and FA4, config sweep"
# A hung mbarrier (a warp-specialization protocol bug) must not cost the call: each part on its own clock.
kernel_step tests/tokenspeed_kernel_nvidia/test_gluon_prefill_fa3_gpu.py "" attention.prefill gluon_prefill_fa3_sm90 \
  triton_prefill,fa4_prefill_sm90
# the sweep gets what is left of the call's 600 s ($SECONDS counts from this script's start)
timeout "$(( ${FA3G_END_S:-585} - SECONDS ))" python3 -W ignore ci/device/fa3_sweep.py --json "$OUT/fa3_sweep.json" \
  2>&1 | tail -30 || status=1
}

fa3v() {
echo "== gluon_prefill_fa3_sm90 variants: GPU tests (each variant vs float64), then the variant sweep"
# A hung mbarrier (a protocol bug in a variant) must not cost the call: each part on its own clock.
timeout 160 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_prefill_fa3_gpu.py \
  -k "sweep_configs or variants" 2>&1 | tail -12 || status=1
# the sweep gets what is left of ~4.5 minutes ($SECONDS counts from this script's start); rows not started
# 25 s before its end are listed as skipped, so the table always prints
timeout "$(( ${FA3V_END_S:-270} - SECONDS ))" python3 -W ignore ci/device/fa3_sweep.py --variants \
  --budget-s "$(( ${FA3V_END_S:-270} - 25 - SECONDS ))" --json "$OUT/fa3_variants.json" 2>&1 | tail -32 || status=1
}

fa3w() {
echo "== gluon_prefill_fa3_window_sm90: GPU tests, check vs float64, bench next to gluon_prefill_window_sm90, sweep"
# A hung mbarrier (a protocol bug in the windowed walk) must not cost the call: each part on its own clock.
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_prefill_fa3_gpu.py \
  -k window 2>&1 | tail -15 || status=1
timeout 45 python3 -W ignore -m tokenspeed_kernel check attention.prefill --kernel gluon_prefill_fa3_window_sm90 \
  --preset awkward --device cuda 2>&1 | tail -14 || status=1
timeout 75 python3 -W ignore -m tokenspeed_kernel bench attention.prefill \
  --kernel gluon_prefill_fa3_window_sm90,gluon_prefill_window_sm90,triton_prefill --preset gpt-oss-120b \
  --device cuda --json "$OUT/bench_gluon_prefill_fa3_window_sm90.json" 2>&1 | tail -40 || status=1
# the sweep gets what is left of ~4 minutes ($SECONDS counts from this script's start; at least 30 s)
local left=$(( ${FA3W_END_S:-240} - SECONDS ))
(( left < 30 )) && left=30
timeout "$left" python3 -W ignore ci/device/fa3_sweep.py --window 127 --variants --budget-s "$(( left - 20 ))" \
  --json "$OUT/fa3_window_sweep.json" 2>&1 | tail -20 || status=1
}

fa3x() {
echo "== gluon_extend_fa3_sm90: GPU tests, check vs float64, bench next to triton_extend"
# A hung mbarrier (a warp-specialization protocol bug) must not cost the call: each part on its own clock.
timeout 130 python3 -m pytest -q -rs -s -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_extend_fa3_gpu.py \
  2>&1 | tail -32 || status=1
timeout 50 python3 -W ignore -m tokenspeed_kernel check attention.extend --kernel gluon_extend_fa3_sm90 --preset awkward \
  --device cuda 2>&1 | tail -20 || status=1
timeout 90 python3 -W ignore -m tokenspeed_kernel bench attention.extend --kernel gluon_extend_fa3_sm90,triton_extend \
  --preset gpt-oss-120b --device cuda --json "$OUT/bench_gluon_extend_fa3_sm90.json" 2>&1 | tail -30 || status=1
}

fa3nan() {
echo "== gluon_prefill_fa3_sm90 / _window_sm90: unseen NaN/inf never leaks (V cleaned on dirty tiles), the cost"
# A hung mbarrier (a protocol bug in the cleaning's barrier) must not cost the call: each part on its own clock.
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_nvidia/test_gluon_prefill_fa3_gpu.py \
  -k unseen 2>&1 | tail -15 || status=1
timeout 50 python3 -m pytest -q -rs -s -p no:cacheprovider tests/tokenspeed_kernel/ops/test_edge_inputs.py \
  -k "invisible and prefill" 2>&1 | grep -v "^$" | tail -15 || status=1
# rows not started 20 s before the end are listed as skipped, so the table always prints
timeout 90 python3 -W ignore ci/device/fa3_sweep.py --clean-ab --head-dim 64 --budget-s 70 \
  --json "$OUT/fa3_clean_ab.json" 2>&1 | tail -12 || status=1
}

e2e() {
echo "== examples/gpt_oss end to end"
timeout 200 python3 -m examples.gpt_oss.bench --rows "${E2E_ROWS:-torch,selector,nvidia}" --budget-s 90 --rep-ms 60 \
  2>&1 | tail -45 || status=1
}

flashinfer() {
echo "== FlashInfer kernels vs float64 (JIT: 25-100 s per module on first use)"
timeout "${FLASHINFER_TIMEOUT_S:-420}" python3 -m pytest -q -rs -p no:cacheprovider \
  tests/tokenspeed_kernel_nvidia/test_flashinfer_gpu.py 2>&1 | tail -40 || status=1
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

# vllm_compare.py with vLLM from .whl-vllm (installed on first use), or a line saying why not; $1: the step's name
vllm_compare() {
if [ -f .whl-vllm/vllm-py.tar.xz ]; then
  python3 -m pip install -q --no-deps --no-index .whl-vllm/wheels/*.whl
  mkdir -p /tmp/vllm-py && tar -xJf .whl-vllm/vllm-py.tar.xz -C /tmp/vllm-py
  OUT="$OUT" PYTHONPATH=/tmp/vllm-py${PYTHONPATH:+:$PYTHONPATH} timeout 240 python3 ci/device/vllm_compare.py \
    2>&1 | tail -40 || status=1
else
  echo "$1: no .whl-vllm carried: vllm_compare.py not run"
fi
}

stepplan() {
echo "== step plans on the GPU: their GPU tests, vLLM's backend (decode step plans), the example at B=1"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel/ops/attention/test_step_plan_gpu.py \
  2>&1 | tail -12 || status=1
vllm_compare stepplan
timeout 150 python3 -m examples.gpt_oss.bench --rows selector,torch --batches 1 --contexts 8192 2>&1 | tail -25 || status=1
}

xplan() {
echo "== the step plans' host cost (branch xplan): the changed launch path on the GPU"
timeout 270 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel/ops/attention/test_step_plan_gpu.py \
  tests/tokenspeed_kernel_triton/test_launcher_gpu.py 2>&1 | tail -16 || status=1
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider -k "(numerics or matches_float64 or row_strided) and not variants" \
  tests/tokenspeed_kernel_nvidia/test_gluon_extend_fa3_gpu.py tests/tokenspeed_kernel_nvidia/test_gluon_prefill_fa3_gpu.py \
  tests/tokenspeed_kernel_nvidia/test_gluon_prefill_gpu.py 2>&1 | tail -16 || status=1
timeout 60 python3 -W ignore -m tokenspeed_kernel check attention.extend --kernel gluon_extend_fa3_sm90 --device cuda \
  2>&1 | tail -12 || status=1
}

stridedq() {
echo "== row-strided q: check of the Triton attention kernels (derived feature-strided_q cases)"
for op in prefill extend decode; do
  timeout 150 python3 -W ignore -m tokenspeed_kernel check "attention.$op" --kernel "triton_$op" \
    --device cuda --json "$OUT/check_strided_$op.json" 2>&1 | tail -25 || status=1
done
}

stridedg() {
echo "== row-strided q, Gluon kernels: the strided-q rows of their GPU tests"
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -k "strided or tma_cannot" \
  tests/tokenspeed_kernel_nvidia/test_gluon_decode_gpu.py tests/tokenspeed_kernel_nvidia/test_gluon_prefill_gpu.py \
  tests/tokenspeed_kernel_nvidia/test_gluon_prefill_fa3_gpu.py tests/tokenspeed_kernel_nvidia/test_gluon_extend_fa3_gpu.py \
  2>&1 | tail -15 || status=1
}

stridedgc() {
echo "== row-strided q, Gluon kernels: check of the five (derived cases, feature-strided_q among them)"
for pair in "decode gluon_decode_sm90" "prefill gluon_prefill_window_sm90" "prefill gluon_prefill_fa3_sm90" \
    "prefill gluon_prefill_fa3_window_sm90" "extend gluon_extend_fa3_sm90"; do
  set -- $pair
  timeout 80 python3 -W ignore -m tokenspeed_kernel check "attention.$1" --kernel "$2" --device cuda \
    --json "$OUT/check_strided_$2.json" 2>&1 | tail -22 || status=1
done
# store_kvcache's row-strided k/v (feature-strided_rows) on the Triton store
timeout 60 python3 -W ignore -m tokenspeed_kernel check kvcache.store --kernel triton_store_kvcache --device cuda \
  --json "$OUT/check_strided_store.json" 2>&1 | tail -12 || status=1
}

planq() {
echo "== a DecodePlan for a row-strided q: GPU test rows, check of gluon_decode_sm90, vllm_compare.py"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider -k "strided_q_plan or plan_runs_bound" \
  tests/tokenspeed_kernel_nvidia/test_gluon_decode_gpu.py 2>&1 | tail -12 || status=1
timeout 80 python3 -W ignore -m tokenspeed_kernel check attention.decode --kernel gluon_decode_sm90 --device cuda \
  --json "$OUT/check_planq.json" 2>&1 | tail -22 || status=1
vllm_compare planq
}

gemv16() {
echo "== triton_moe_gemv (bf16 weights, T <= 8): GPU tests, check, bench next to triton_fused_moe, overhead, tile sweep"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/tokenspeed_kernel_triton/ops/moe/test_moe_gemv.py \
  tests/tokenspeed_kernel_triton/ops/moe/test_moe_gemv_mx.py tests/tokenspeed_kernel_triton/ops/moe/test_no_host_sync.py \
  2>&1 | tail -15 || status=1
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider -k moe tests/tokenspeed_kernel_triton/test_launcher_gpu.py \
  2>&1 | tail -8 || status=1
timeout 120 python3 -W ignore -m tokenspeed_kernel check moe.apply --kernel triton_moe_gemv --device cuda \
  --json "$OUT/check_gemv16.json" 2>&1 | tail -22 || status=1
timeout 150 python3 -W ignore -m tokenspeed_kernel bench moe.apply --kernel triton_moe_gemv,triton_fused_moe \
  --preset moe-decode-bf16 --device cuda --json "$OUT/bench_gemv16.json" 2>&1 | tail -30 || status=1
timeout 90 python3 -W ignore -m tokenspeed_kernel overhead --device cuda --op moe.apply --json "$OUT/overhead_gemv16.json" \
  2>&1 | tail -16 || status=1
left=$(( ${GEMV16_END_S:-580} - SECONDS ))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 ci/device/moe_decode_sweep.py --sections gemv16 --json "$OUT/moe_decode_bf16.json" \
    2>&1 | tail -14 || status=1
else
  echo "gemv16: ${left} s left of the call: moe_decode_sweep.py --sections gemv16 not run"
fi
}

fiext() {
echo "== extend peers: gluon_extend_fa3_sm90 vs FlashInfer's paged prefill (flashinfer_extend) and triton_extend"
# needs .whl-nvidia with fi-prefill-so.tar.xz holding the FA3 sink module (bf16, head dim 64, no
# window) that ci/device/flashinfer_attention_prebuild.py builds here: no JIT build on the device
aot_prefill_on
timeout "$(( ${FIEXT_END_S:-560} - SECONDS ))" python3 -W ignore -m tokenspeed_kernel bench attention.extend \
  --kernel gluon_extend_fa3_sm90,flashinfer_extend,triton_extend --preset extend-lengths --device cuda --no-baselines \
  --json "$OUT/extend_peers.json" > "$OUT/extend_peers.txt" 2>&1 || status=1
grep -v "INFO" "$OUT/extend_peers.txt" | grep -v "^W1" | tail -60
aot_prefill_off
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

for step in $steps; do
  case $step in
    moe | mxswap | mxp | gluonmoe | gluonmma | decode | prefill | nvidia | winp | fa3g | fa3v | fa3w | fa3x | fa3nan | fiext | flashinfer | e2e | stepplan | stridedq | stridedg | stridedgc | planq | gemv16 | xplan) "$step" ;;
    *) echo "unknown step $step (expected moe, mxswap, mxp, gluonmoe, gluonmma, decode, prefill, nvidia, winp, fa3g, fa3v, fa3w, fa3x, fa3nan, fiext, flashinfer, e2e, stepplan, stridedq, stridedg, stridedgc, planq, gemv16, xplan)"
       status=2 ;;
  esac
done
exit $status
