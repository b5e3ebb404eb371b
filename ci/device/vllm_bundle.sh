#!/usr/bin/env bash
# Runs HERE (PyPI reachable), not on the device: packs what the offline H100 image needs to
# import vLLM 0.33.0's Python code into .whl-vllm/ (git-ignored, carried with the run).
#
#   .whl-vllm/vllm-py.tar.xz   vLLM's *.py files and its dist-info (METADATA, entry points;
#                              vLLM reads its own version); none of its compiled .so files:
#                              they target torch 2.14 and the device image has torch 2.11.
#                              The Triton attention backend and our plugin do not need them.
#   .whl-vllm/wheels/          cp312 wheels of the packages importing vLLM needs that the
#                              image lacks (ci-requirements.txt minus the image's list in
#                              /work/.library/device/KINDS.md), and our plugin's wheel.
#
# On the device (one line; the tarball unpacks to a directory put on PYTHONPATH):
#   python3 -m pip install -q --no-deps --no-index .whl-vllm/wheels/*.whl && mkdir -p /tmp/vllm-py && tar -xJf .whl-vllm/vllm-py.tar.xz -C /tmp/vllm-py && export PYTHONPATH=/tmp/vllm-py:$PYTHONPATH
#
# VLLM_WHEEL=/path/to/vllm-0.33.0-*.whl reuses a wheel already on disk (else pip downloads it).
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT=.whl-vllm
VERSION=0.33.0
rm -rf "$OUT" && mkdir -p "$OUT/wheels" "$OUT/dl"

wheel="${VLLM_WHEEL:-}"
if [ -z "$wheel" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$OUT/dl" "vllm==$VERSION"
    wheel=$(ls "$OUT"/dl/vllm-"$VERSION"-*.whl)
fi

python3 - "$wheel" "$OUT/vllm-py.tar.xz" <<'EOF'
import io, sys, tarfile, zipfile

wheel, out = sys.argv[1], sys.argv[2]
keep = 0
with zipfile.ZipFile(wheel) as zf, tarfile.open(out, "w:xz", preset=9) as tar:
    for info in zf.infolist():
        name = info.filename
        meta = ".dist-info/" in name and name.rsplit("/", 1)[-1] in ("METADATA", "entry_points.txt", "top_level.txt")
        if not (name.endswith(".py") or meta):
            continue
        data = zf.read(info)
        entry = tarfile.TarInfo(name)
        entry.size = len(data)
        entry.mode = 0o644
        tar.addfile(entry, io.BytesIO(data))
        keep += 1
print(f"vllm-py.tar.xz: {keep} files")
EOF

# Packages in ci-requirements.txt that the device image does not have (names normalized).
python3 - packages/tokenspeed-kernel-vllm/ci-requirements.txt > "$OUT/dl/device-requirements.txt" <<'EOF'
import re, sys

IMAGE = {  # /work/.library/device/KINDS.md, "Python packages already there" (cuda image)
    "aiohappyeyeballs", "aiohttp", "aiosignal", "anyio", "attrs", "certifi", "charset-normalizer",
    "cloudpickle", "einops", "filelock", "frozenlist", "h11", "httpcore", "httpx", "huggingface-hub",
    "idna", "multidict", "numpy", "pillow", "prometheus-client", "propcache", "protobuf", "psutil",
    "py-cpuinfo", "pyyaml", "regex", "requests", "safetensors", "sentencepiece", "tiktoken",
    "tokenizers", "tqdm", "transformers", "typing-extensions", "urllib3", "uvloop", "yarl",
}
# Also needed there: pydantic and what it imports (in CI they come with transformers' deps).
EXTRA = ["pydantic==2.13.4", "pydantic_core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2"]
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name = re.split(r"[=<>!~ ]", line, maxsplit=1)[0].lower().replace("_", "-")
    if name not in IMAGE:
        print(line)
for line in EXTRA:
    print(line)
EOF

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform any \
    -d "$OUT/wheels" -r "$OUT/dl/device-requirements.txt"
python3 -m pip wheel -q --no-deps -w "$OUT/wheels" packages/tokenspeed-kernel-vllm
rm -rf "$OUT/dl"
ls "$OUT/wheels" | sed 's/^/  /'
du -sh "$OUT"
