#!/usr/bin/env bash
# Runs HERE, not on the device: packs OpenAI's triton_kernels as vLLM 0.33.0 vendors it
# (vllm/third_party/triton_kernels, its 40 *.py files: 226 KiB, a 56 KiB xz tarball) into
# .whl-ogs/triton_kernels.tar.xz (git-ignored, carried with the run), for the matmul_ogs
# baselines of `bench moe.apply` and of `bench --suite gpt-oss-120b-h100`
# (packages/tokenspeed-kernel/src/tokenspeed_kernel/tools/_ogs.py). A measurement baseline,
# never a dependency: nothing of it enters the repository or our wheels.
#
# The tarball unpacks to triton_kernels/ (the copy imports itself as that top-level package).
# On the device (one line), after our wheels are installed:
#   mkdir -p /tmp/ogs && tar -xJf .whl-ogs/triton_kernels.tar.xz -C /tmp/ogs && export PYTHONPATH=/tmp/ogs:$PYTHONPATH
#
# Source, first found: VLLM_WHEEL=/path/to/vllm-0.33.0-*.whl; the vLLM 0.33.0 installed here
# (found without importing vLLM); else pip downloads the wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=.whl-ogs
VERSION=0.33.0
rm -rf "$OUT" && mkdir -p "$OUT"

src="${VLLM_WHEEL:-}"
if [ -z "$src" ]; then
    src=$(python3 - "$VERSION" <<'EOF'
import importlib.metadata, importlib.util, pathlib, sys

try:
    installed = importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    installed = None
spec = importlib.util.find_spec("vllm") if installed == sys.argv[1] else None
for root in (spec.submodule_search_locations or []) if spec else []:
    if (pathlib.Path(root) / "third_party" / "triton_kernels" / "__init__.py").is_file():
        print(root)
        break
EOF
)
fi
if [ -z "$src" ]; then
    mkdir -p "$OUT/dl"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$OUT/dl" "vllm==$VERSION"
    src=$(ls "$OUT"/dl/vllm-"$VERSION"-*.whl)
fi

python3 - "$src" "$OUT/triton_kernels.tar.xz" <<'EOF'
import io, pathlib, sys, tarfile, zipfile

src, out = sys.argv[1], sys.argv[2]
prefix = "vllm/third_party/triton_kernels/"
if src.endswith(".whl"):
    with zipfile.ZipFile(src) as zf:
        files = {n[len("vllm/third_party/"):]: zf.read(n) for n in zf.namelist() if n.startswith(prefix) and n.endswith(".py")}
else:
    root = pathlib.Path(src) / "third_party"
    files = {p.relative_to(root).as_posix(): p.read_bytes() for p in (root / "triton_kernels").rglob("*.py")}
if "triton_kernels/matmul_ogs.py" not in files:
    sys.exit(f"no triton_kernels/matmul_ogs.py under {src}")
with tarfile.open(out, "w:xz", preset=9) as tar:
    for name, data in sorted(files.items()):
        entry = tarfile.TarInfo(name)
        entry.size = len(data)
        entry.mode = 0o644
        tar.addfile(entry, io.BytesIO(data))
print(f"{out}: {len(files)} files, {sum(map(len, files.values())) // 1024} KiB of source from {src}")
EOF
rm -rf "$OUT/dl"
du -sh "$OUT"
