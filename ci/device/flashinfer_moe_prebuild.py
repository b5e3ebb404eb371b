"""Build FlashInfer's CUTLASS fused MoE module for sm_90 on this machine (no GPU; nvcc 13).

Why: FlashInfer JIT-builds ``fused_moe_90`` on first use from ~250 CUDA files (every weight
type, every tile) and four device calls on the 16-core H100 machine never finished it
(docs/nvidia.md, "FlashInfer MoE"). ``flashinfer_cutlass_moe`` only serves bf16 x bf16 and
fp16 x fp16, so this script compiles just what those two need:

- the generated CUTLASS instantiations whose activation and weight types are both bf16 or
  both fp16 (Hopper TMA warp-specialized grouped GEMMs, and the Ampere fused-gated ones
  the tactic list also offers on sm_90);
- the bf16 and fp16 ``MoeGemmRunner`` files, the runner/binding/instantiation files and
  the common helpers.

Everything left out (fp8, fp4, int4/int8 and fp32 runners and their kernels, the fp8
block-scale GEMM) becomes a stub function that prints what is missing and aborts; only a
call with those weight types could reach one, and ``flashinfer_cutlass_moe`` refuses them
before launch. The result is FlashInfer's own module with fewer kernels, loaded through
FlashInfer's AOT path (``flashinfer/data/aot/fused_moe_90/fused_moe_90.so``), so the code
that runs is FlashInfer's, unchanged.

Usage (repository root; ~60 min on 2 cores, ~6 GB memory per compile job)::

    python3 ci/device/flashinfer_moe_prebuild.py [--jobs 2] [--work /tmp/fi-moe-build]

It unpacks ``.whl-nvidia/flashinfer-python.tar.xz`` (``ci/device/flashinfer_bundle.sh``),
installs this Python's apache-tvm-ffi plus the cuBLAS headers and NVRTC library FlashInfer's
sources include, builds with ninja (resumable: run it again after an interruption), links,
checks that no FlashInfer/TensorRT-LLM symbol is left undefined, and writes
``.whl-nvidia/fused_moe_90.so.xz``. On the device ``ci/device/flashinfer_moe.sh`` puts it
in place; the module name has no H20 variant (78 SMs) on the H100.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".whl-nvidia"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"  # the version flashinfer_bundle.sh carries to the device
CUDA_EXTRAS = ("nvidia-cublas==13.*", "nvidia-curand", "nvidia-cuda-nvrtc==13.*")  # headers; libnvrtc to link
PY_EXTRAS = ("nvidia-ml-py", "tqdm")  # imported by flashinfer/__init__

# Non-generated sources kept (file names under FlashInfer's csrc); the rest become stubs.
KEEP_SOURCES = (
    "moe_gemm_tma_warp_specialized_input.cu",
    "moe_gemm_kernels_bf16_bf16.cu",
    "moe_gemm_kernels_fp16_fp16.cu",
    "moe_gemm_mixed_utils.cu",
    "flashinfer_cutlass_fused_moe_binding.cu",
    "deepgemm_jit_setup.cu",
    "cutlass_fused_moe_instantiation.cu",
    "envUtils.cpp",
    "logger.cpp",
    "stringUtils.cpp",
    "tllmException.cpp",
    "memoryUtils.cu",
    "preQuantScaleKernel.cu",
    "cutlass_heuristic.cpp",
    "lora.cpp",
)
# A generated file is kept when every type pair it instantiates is one of these.
KEEP_TYPES = re.compile(r"Sm90, (half, half|__nv_bfloat16, __nv_bfloat16)|<cutlass::(half_t|bfloat16_t), cutlass::\2")
ANY_TYPES = re.compile(r"INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(|template void \w+<")
# Undefined symbols that a left-out file would have defined: FlashInfer's and TensorRT-LLM's
# own C++ (runtime libraries provide every other undefined symbol: CUDA, NVRTC, TVM-FFI, C/C++).
STUB_SYMBOL = re.compile(r"^_Z\w*(12tensorrt_llm|10flashinfer|9deep_gemm)")


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd[:6]), "..." if len(cmd) > 6 else "", flush=True)
    subprocess.run(cmd, check=True, **kw)


def _setup(work: Path) -> Path:
    site = work / "site"
    if not (site / "flashinfer").is_dir():
        site.mkdir(parents=True, exist_ok=True)
        _run(["tar", "-xJf", str(BUNDLE / "flashinfer-python.tar.xz"), "-C", str(site)])
    if not (site / "tvm_ffi").is_dir():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site)]
        _run([*pip, TVM_FFI, *PY_EXTRAS, *CUDA_EXTRAS])
    return site


def _cuda_home() -> Path:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("nvcc not found: this build needs the CUDA 13 toolkit's nvcc")
    text = Path(nvcc).read_text(errors="ignore") if Path(nvcc).stat().st_size < 4096 else ""
    found = re.search(r"(/\S+)/bin/nvcc", text)  # a wrapper script that execs the real nvcc
    return Path(found.group(1)) if found else Path(nvcc).resolve().parents[1]


def _kept(source: Path) -> bool:
    if ".generated." not in source.name:
        return source.name in KEEP_SOURCES
    text = source.read_text()
    pairs = ANY_TYPES.findall(text)
    return bool(pairs) and len(KEEP_TYPES.findall(text)) == len(pairs)


def _spec(site: Path, work: Path):
    os.environ.update(FLASHINFER_WORKSPACE_BASE=str(work / "ws"), FLASHINFER_CUDA_ARCH_LIST="9.0a")
    sys.path.insert(0, str(site))
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    spec = gen_cutlass_fused_moe_sm90_module(use_fast_build=False)
    assert spec.name == "fused_moe_90", spec.name
    spec.write_ninja()
    return spec


def _rewrite_ninja(spec, site: Path, cuda_home: Path) -> list[str]:
    """Point the ninja file at the real toolkit and cuBLAS headers; return the kept objects."""
    text = spec.ninja_path.read_text()
    text = re.sub(r"^cuda_home = .*$", f"cuda_home = {cuda_home}", text, flags=re.M)
    cublas = site / "nvidia" / "cu13" / "include"
    if str(cublas) not in text:
        text = text.replace("common_cflags = ", f"common_cflags = -isystem {cublas} ", 1)
    spec.ninja_path.write_text(text)
    objects = []
    for line in text.splitlines():
        m = re.match(r"build (\S+\.o): \w+ (\S+)$", line)
        if m and _kept(Path(m.group(2))):
            objects.append(m.group(1))
    return objects


def _stub_source(symbols: list[str], path: Path) -> None:
    body = [
        "#include <stdio.h>",
        "#include <stdlib.h>",
        "static void missing(const char *name) {",
        '  fprintf(stderr, "fused_moe_90 (tokenspeed-kernel prebuild, bf16/fp16 weights only): "',
        '          "%s was not built\\n", name);',
        "  abort();",
        "}",
    ]
    body += [f'void {s}(void) {{ missing("{s}"); }}' for s in symbols]
    path.write_text("\n".join(body) + "\n")


def _undefined(path: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--undefined-only", str(path)], capture_output=True, text=True, check=True)
    return sorted({line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()})


def _libcuda_stub(where: Path) -> Path:
    """A directory holding a ``libcuda.so`` to link against on a machine without the driver:
    link-time only, with the soname the driver has (the device's real library is loaded)."""
    libcuda_stub = where / "libcuda-stub"
    libcuda_stub.mkdir(exist_ok=True)
    if not (libcuda_stub / "libcuda.so").exists():
        stub = libcuda_stub / "libcuda.c"
        stub.write_text("void cuGetErrorString(void) {}\n")
        _run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", str(stub), "-o", str(libcuda_stub / "libcuda.so")])
    return libcuda_stub


def _link(objects: list[str], site: Path, cuda_home: Path, out: Path, extra: list[str] = ()) -> None:
    nvrtc = site / "nvidia" / "cu13" / "lib"
    libcuda_stub = _libcuda_stub(out.parent)
    if not (nvrtc / "libnvrtc.so").exists():
        (nvrtc / "libnvrtc.so").symlink_to("libnvrtc.so.13")
    _run(
        [
            "c++",
            *objects,
            *extra,
            "-shared",
            f"-L{cuda_home}/lib64",
            "-lcudart",
            f"-L{nvrtc}",
            "-lnvrtc",
            f"-L{libcuda_stub}",
            "-Wl,--no-as-needed",
            "-lcuda",
            "-o",
            str(out),
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fi-moe-build"))
    args = parser.parse_args()
    work = args.work.resolve()
    site = _setup(work)
    cuda_home = _cuda_home()
    spec = _spec(site, work)
    objects = _rewrite_ninja(spec, site, cuda_home)
    print(f"{len(objects)} of {sum(1 for _ in spec.sources)} sources kept; building with -j{args.jobs}", flush=True)
    _run(["ninja", "-f", str(spec.ninja_path), f"-j{args.jobs}", *objects], cwd=spec.ninja_path.parent)

    so = work / "fused_moe_90.so"
    _link(objects, site, cuda_home, so)
    missing = [s for s in _undefined(so) if STUB_SYMBOL.match(s)]
    print(f"{len(missing)} symbols of left-out files become stubs", flush=True)
    stub_c = work / "fused_moe_90_stubs.c"
    _stub_source(missing, stub_c)
    _run(["cc", "-c", "-fPIC", "-O1", str(stub_c), "-o", str(work / "fused_moe_90_stubs.o")])
    _link(objects, site, cuda_home, so, [str(work / "fused_moe_90_stubs.o")])
    left = [s for s in _undefined(so) if STUB_SYMBOL.match(s)]
    if left:
        print("still undefined:", *left[:20], sep="\n  ")
        return 1
    BUNDLE.mkdir(exist_ok=True)
    target = BUNDLE / "fused_moe_90.so.xz"
    with target.open("wb") as f:
        subprocess.run(["xz", "-T0", "-6", "-c", str(so)], stdout=f, check=True)
    print(f"{so} {so.stat().st_size / 2**20:.1f} MiB -> {target} {target.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
