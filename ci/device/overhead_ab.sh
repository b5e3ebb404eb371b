#!/usr/bin/env bash
# Host cost per eager call, this build against an older one, in one call on the lent GPU:
# `tokenspeed-kernel overhead --device cuda` alternately from the two installs, ROUNDS times
# each, every process pinned to the same CPU core (host timings between processes otherwise
# vary by up to ±30 %), then a table of each call's median over the rounds.
#
# Carry `.whl` (this build: core, triton, nvidia wheels) with the baseline's wheels in
# `.whl/old/`, built here from the older commit:
#   git worktree add --detach /tmp/wt-old <commit> && pip wheel -q --no-deps --no-build-isolation \
#     -w .whl/old /tmp/wt-old/packages/tokenspeed-kernel /tmp/wt-old/packages/tokenspeed-kernel-triton \
#     /tmp/wt-old/packages/tokenspeed-kernel-nvidia
#   ROUNDS (default 3), CORE (default 3), OVERHEAD_ARGS (extra `overhead` arguments)
set -euo pipefail
OUT=${OUT:-/tmp/overhead_ab}
mkdir -p "$OUT"
# Both builds from their own target directory, the same wheels each (the baseline's set), so
# the two sides differ only in our code (a first try with unequal sets measured torch's own
# calls ~25 % slower on one side).
wheels=()
for w in .whl/old/*.whl; do wheels+=(".whl/$(basename "$w")"); done
rm -rf /tmp/ab_new /tmp/ab_old
python3 -m pip install -q --no-deps --no-index --target /tmp/ab_new "${wheels[@]}"
python3 -m pip install -q --no-deps --no-index --target /tmp/ab_old .whl/old/*.whl
ROUNDS=${ROUNDS:-3}
CORE=${CORE:-3}
for i in $(seq 1 "$ROUNDS"); do
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/ab_new taskset -c "$CORE" python3 -m tokenspeed_kernel overhead --device cuda --no-breakdown ${OVERHEAD_ARGS:-} \
    --json "$OUT/new$i.json" > /dev/null
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/ab_old taskset -c "$CORE" python3 -m tokenspeed_kernel overhead --device cuda --no-breakdown \
    ${OVERHEAD_ARGS:-} --json "$OUT/old$i.json" > /dev/null
done
python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(path):  # an object with "rows" and the build's commit; a bare list from builds before it
    data = json.load(open(path))
    return data["rows"] if isinstance(data, dict) else data
runs = {side: [{r["name"]: r for r in rows(f"{out}/{side}{i}.json")} for i in range(1, rounds + 1)]
        for side in ("new", "old")}
commits = {}
for side in ("new", "old"):
    data = json.load(open(f"{out}/{side}1.json"))
    commits[side] = data.get("commit") if isinstance(data, dict) else None
print(f"this build: commit {commits['new'] or 'unknown'}; older build: commit {commits['old'] or 'unknown'}")
table = []
print(f"{'call':26s} {'kernel (this build)':26s} {'this µs':>8s} {'older µs':>9s} {'ratio':>6s}   per round (this / older)")
for name, row in runs["new"][0].items():
    new = [r[name]["host_us"] for r in runs["new"]]
    old = [r[name]["host_us"] for r in runs["old"] if name in r]  # empty: a call the older build lacks
    n = statistics.median(new)
    if old:
        o = statistics.median(old)
        rounds_txt = " ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(new, old))
        print(f"{name:26s} {row['kernel']:26s} {n:8.1f} {o:9.1f} {o / n:5.2f}x   {rounds_txt}")
    else:
        rounds_txt = " ".join(f"{a:.0f}/-" for a in new)
        print(f"{name:26s} {row['kernel']:26s} {n:8.1f} {'-':>9s} {'-':>6s}   {rounds_txt}")
    table.append({"name": name, "kernel": row["kernel"], "this_us": new, "older_us": old})
json.dump({"commits": commits, "rows": table}, open(f"{out}/overhead_ab.json", "w"), indent=1)
PY
rm -f "$OUT"/new*.json "$OUT"/old*.json
