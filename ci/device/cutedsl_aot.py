"""Runs HERE (no GPU): compile FlashAttention-4's sm_90 forward variants ahead of time into an
AOT bundle for ``fa4_prefill_sm90`` (see packages/tokenspeed-kernel-nvidia/.../attention/_fa4.py).

Needs the ``cutedsl`` extra in the running interpreter (``ci/device/cutedsl_bundle.sh`` makes
a virtualenv with it) and a C compiler driver (``cc``). Writes ``<out>/fa4_sm90.so``,
``<out>/libcute_dsl_runtime.so`` and ``<out>/manifest.json``, then loads the library through
``tvm_ffi`` in a child process that never imports CuTe DSL or FA4 and checks that every
variant's function is there (the launch itself needs the GPU).

    python ci/device/cutedsl_aot.py --out .whl-cute/fa4 [--set serving|check] [--jobs 2]

Sets (data): ``serving`` = GPT-OSS attention (bf16, D 64, 8 query heads per KV head) with
every mask option; ``check`` = bf16/fp16 x D 64/128 x group 1/4/8 x every mask option (192
variants; 4 is what ``tokenspeed-kernel check`` draws, 8 GPT-OSS, 1 MHA).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _pkg in ("tokenspeed-kernel", "tokenspeed-kernel-triton", "tokenspeed-kernel-nvidia"):
    sys.path.insert(0, str(ROOT / "packages" / _pkg / "src"))

from tokenspeed_kernel_nvidia.ops.attention import _fa4  # noqa: E402

_MASKS = list(itertools.product((True, False), repeat=4))  # causal, window, sinks, lse
SETS = {
    "serving": [("bfloat16", 64, 8)],
    "check": list(itertools.product(("bfloat16", "float16"), (64, 128), (1, 4, 8))),
}

_CHILD = """
import json, sys, tvm_ffi
mod = tvm_ffi.load_module(sys.argv[1] + "/fa4_sm90.so")
names = [v["symbol"].removeprefix("__tvm_ffi_") for v in json.load(open(sys.argv[1] + "/manifest.json"))["variants"]]
missing = [n for n in names if getattr(mod, n, None) is None]
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "flash_attn"))
print(json.dumps({"functions": len(names) - len(missing), "missing": missing, "leaked": leaked}))
"""


def variants(name: str) -> list[_fa4.Fa4Variant]:
    return [
        _fa4.Fa4Variant(dtype, d, d, group, causal, window, sinks, lse)
        for (dtype, d, group), (causal, window, sinks, lse) in itertools.product(SETS[name], _MASKS)
    ]


def _export(chunk: list[_fa4.Fa4Variant], directory: str) -> list[str]:
    from tokenspeed_kernel_nvidia.ops.attention import _fa4_build

    return [str(_fa4_build.export_variant(v, Path(directory))) for v in chunk]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--set", choices=sorted(SETS), default="check")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ns = parser.parse_args()

    from tokenspeed_kernel_nvidia.ops.attention import _fa4_build

    todo = variants(ns.set)
    ns.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        # each worker imports CuTe DSL once and compiles its share (fake tensors, no GPU)
        chunks = [todo[i :: ns.jobs] for i in range(ns.jobs)]
        with ProcessPoolExecutor(ns.jobs) as pool:
            objects = [Path(p) for done in pool.map(_export, chunks, [tmp] * ns.jobs) for p in done]
        compiled = time.perf_counter() - start
        manifest = _fa4_build.build_bundle(todo, ns.out, objects=objects)
    child = subprocess.run([sys.executable, "-c", _CHILD, str(ns.out)], capture_output=True, text=True, check=True)
    loaded = json.loads(child.stdout.strip().splitlines()[-1])
    sizes = {p.name: p.stat().st_size for p in sorted(ns.out.iterdir()) if p.is_file()}
    print(json.dumps({"variants": len(todo), "compile_s": round(compiled, 1), "sizes": sizes, "load": loaded}))
    print(f"manifest: {manifest}")
    return 0 if not loaded["missing"] and not loaded["leaked"] else 1


if __name__ == "__main__":
    sys.exit(main())
