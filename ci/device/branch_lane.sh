#!/usr/bin/env bash
# Another branch in the same device call: a lane that runs a branch's wheels and its ci/, tests/
# and examples/ beside lanes that run main's (one GPU each; ci/device/README.md, "Two branches in
# one call"). Device time counts held time, so an unmerged branch's verification can share a
# two-GPU call with main's measurements instead of taking a call of its own.
#
# HERE:   bash ci/device/branch_lane.sh --pack /work/wt-BRANCH
#         (its wheels, the vLLM plugin's included, and a tar of its ci/, tests/ and examples/ into .whl-branch/, git-ignored;
#         carry ".whl-branch" beside ".whl")
# DEVICE: bash ci/device/branch_lane.sh CMD...
#         (CMD runs in /tmp/branch, the branch's tree, with its wheels installed under
#         /tmp/branch-site first on PYTHONPATH: Python imports them and importlib.metadata, which
#         keeps the first distribution of a name on sys.path, reads their entry points; main's
#         wheels may be installed in the image for the other lanes). Typical:
#         CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash ci/device/branch_lane.sh \
#             env INSTALL=0 OUT=$OUT/branch bash ci/device/verify_pending.sh STEP
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
if [ "${1:-}" = "--pack" ]; then
  tree=$(cd "$2" && pwd)
  rm -rf "$ROOT/.whl-branch" && mkdir -p "$ROOT/.whl-branch/whl"
  (cd "$tree" && python3 -m pip wheel -q --no-deps --no-build-isolation -w "$ROOT/.whl-branch/whl" \
    packages/tokenspeed-kernel packages/tokenspeed-kernel-triton packages/tokenspeed-kernel-nvidia \
    packages/tokenspeed-kernel-amd packages/tokenspeed-kernel-vllm)
  git -C "$tree" archive --format=tar HEAD ci tests examples > "$ROOT/.whl-branch/tree.tar"
  git -C "$tree" rev-parse --short HEAD > "$ROOT/.whl-branch/COMMIT"
  echo "packed $(cat "$ROOT/.whl-branch/COMMIT") of $tree into .whl-branch/"
  exit 0
fi
[ -f "$ROOT/.whl-branch/tree.tar" ] || { echo "branch_lane.sh: no .whl-branch/ carried (pack it here first)" >&2; exit 2; }
if [ ! -d /tmp/branch-site ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/branch-site "$ROOT"/.whl-branch/whl/*.whl
  mkdir -p /tmp/branch && tar -xf "$ROOT/.whl-branch/tree.tar" -C /tmp/branch
  # the carried bundles the branch's device scripts read by relative path (.whl-vllm: vLLM's
  # tree and deps; the branch's own plugin wheel, in /tmp/branch-site, comes first on sys.path)
  for d in .whl-vllm .whl-ogs .whl-nvidia .whl-test; do
    [ -e "$ROOT/$d" ] && ln -sfn "$ROOT/$d" "/tmp/branch/$d"
  done
fi
echo "== branch lane: $(cat "$ROOT/.whl-branch/COMMIT"): $*"
cd /tmp/branch
export PYTHONPATH=/tmp/branch-site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/branch-site/bin:$PATH
exec "$@"
