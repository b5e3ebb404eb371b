"""Build FlashInfer's FA3 attention-sink prefill module for sm_90 on this machine (no GPU; nvcc 13).

Why: ``flashinfer_extend`` and ``flashinfer_prefill`` with sinks run FlashInfer's
``BatchAttentionWithAttentionSinkWrapper``, whose module FlashInfer JIT-builds on first use (11
compile steps: ragged and paged kernels for four mask modes, the plan, the binding; minutes on a
fresh device machine, where every call starts bare). Built here, it is carried as
``.whl-nvidia/fi-prefill-so.tar.xz`` and installed by ``ci/device/verify_pending.sh`` as a
FlashInfer AOT module for the steps at head dim 64 with bf16 q/KV (``aot_prefill_on``), so the
device runs FlashInfer's own code without a build.

Usage (repository root; ~20-30 min on 2 cores)::

    python3 ci/device/flashinfer_attention_prebuild.py [--window] [--jobs 2] [--work /tmp/fi-attn-build]

It reuses ``flashinfer_moe_prebuild.py``'s site (FlashInfer from ``.whl-nvidia``, apache-tvm-ffi)
and adds the cuRAND/cuBLAS headers CUTLASS's utilities include; the build is resumable (ninja).
``--window`` builds the sliding-window variant instead. The module is bf16 q/KV/out, head dim 64
for q/k and v, int32 indices, no RoPE: GPT-OSS's shape.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flashinfer_moe_prebuild import BUNDLE, _cuda_home, _libcuda_stub, _run, _setup

HEADERS = ("nvidia-curand", "nvidia-cublas==13.*", "nvidia-cuda-nvrtc==13.*")  # one pip call: --target replaces nvidia/


class _Captured(Exception):
    pass


def _spec(site: Path, work: Path, window: bool):
    """The JitSpec FlashInfer's sink wrapper loads, with the wrapper's own arguments: the
    wrapper is constructed (backend fa3) with FlashInfer's module getter replaced by one that
    records its arguments and stops, so the module's name and template arguments are the
    ones the device looks up (FlashInfer trusts an AOT module by name)."""
    os.environ.update(FLASHINFER_WORKSPACE_BASE=str(work / "ws"), FLASHINFER_CUDA_ARCH_LIST="9.0a")
    sys.path.insert(0, str(site))
    import flashinfer
    import flashinfer.prefill as prefill
    import torch
    from flashinfer.jit.attention import gen_customize_batch_prefill_module

    seen: dict = {}

    def record(backend, *jit_args, **jit_kwargs):
        seen.update(backend=backend, args=jit_args, kwargs=jit_kwargs)
        raise _Captured

    prefill.get_customize_batch_prefill_module = record
    try:
        flashinfer.BatchAttentionWithAttentionSinkWrapper(
            torch.empty(1024, dtype=torch.uint8),
            "NHD",
            backend="fa3",
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            head_dim_qk=64,
            head_dim_vo=64,
            window_left=127 if window else -1,
        )
    except _Captured:
        pass
    spec = gen_customize_batch_prefill_module(seen["backend"], *seen["args"], **seen["kwargs"])
    spec.write_ninja()
    return spec


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", action="store_true", help="the sliding-window module")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fi-attn-build"))
    args = parser.parse_args()
    site = _setup(args.work)
    if not (site / "nvidia" / "cu13" / "include" / "curand_kernel.h").is_file():
        _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(site), *HEADERS])
    spec = _spec(site, args.work, args.window)
    text = spec.ninja_path.read_text()
    text = re.sub(r"^cuda_home = .*$", f"cuda_home = {_cuda_home()}", text, flags=re.M)
    headers = site / "nvidia" / "cu13" / "include"
    if str(headers) not in text:
        text = text.replace("common_cflags = ", f"common_cflags = -isystem {headers} ", 1)
    stub = _libcuda_stub(args.work)  # no driver here: -lcuda resolves to a link-time stub
    if str(stub) not in text:
        text = text.replace("ldflags = -shared ", f"ldflags = -shared -L{stub} ", 1)
    spec.ninja_path.write_text(text)
    subprocess.run(["ninja", "-j", str(args.jobs)], cwd=spec.ninja_path.parent, check=True)
    so = spec.ninja_path.parent / f"{spec.name}.so"
    out = BUNDLE / "fi-prefill-so.tar.xz"
    with tarfile.open(out, "w:xz") as tar:
        tar.add(so, arcname=so.name)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB): {so.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
