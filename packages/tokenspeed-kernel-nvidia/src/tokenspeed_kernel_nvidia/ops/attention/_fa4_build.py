"""Compile FlashAttention-4's Hopper forward (CuTe DSL) for one variant, with or without a GPU.

Needs the ``cutedsl`` extra (``flash-attn-4==4.0.0b36``, ``nvidia-cutlass-dsl>=4.8.1`` with
its ``cu13`` libraries); imported only by the JIT route of :mod:`._fa4` and by
``ci/device/cutedsl_aot.py``, never at backend load.

How: FA4's own forward entry (``flash_attn.cute.interface._flash_attn_fwd``) is called under
torch's ``FakeTensorMode`` with fake CUDA tensors of the variant's dtypes and layout. In fake
mode FA4 chooses its tile configuration, compiles the kernel (``cute.compile`` with TVM-FFI)
and skips the launch. The compiled function is taken out of FA4's compile cache (a fresh one
is swapped in for the call, so exactly one entry appears). Without a GPU the target is given
by ``CUTE_DSL_ARCH=sm_90a`` (set here before CuTe DSL is imported) and FA4's ``_arch=90``;
``FLASH_ATTENTION_NUM_SMS`` (132, an H100 SXM) only feeds FA4's split heuristics, which the
sm_90 forward does not use.

Every tensor is compiled with a dynamic layout (stride 1 in the last dim), so one variant
serves every batch, length and head count; what is fixed is :class:`Fa4Variant`. The fake
call uses ``max_seqlen_q = 1024`` and a batch of 2: with ``cu_seqlens_q`` given this selects
FA4's non-persistent varlen scheduler with no batch-lookup hint, which is valid at any batch
size and length (FA4 adds the hint only above 256 sequences, as a speed-up).

The compiled function (and the AOT library's ``__tvm_ffi_<name>`` symbol) takes 18 positional
arguments, in FA4's order (:func:`tokenspeed_kernel_nvidia.ops.attention._fa4.call_args`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tokenspeed_kernel_nvidia.ops.attention._fa4 import LIBRARY, MANIFEST, MANIFEST_FORMAT, RUNTIME, Fa4Variant

__all__ = ["SM90_TARGET", "build_bundle", "compile_variant", "export_variant", "runtime_library"]

SM90_TARGET = "sm_90a"
_FAKE_BATCH = 2
_FAKE_SEQLEN = 1024
_FAKE_KV_HEADS = 2
_FAKE_WINDOW = 127
_NUM_SMS = "132"


def _import_fa4() -> Any:
    """FA4's interface module, imported with CuTe DSL targeting sm_90a when there is no GPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("CUTE_DSL_ARCH", SM90_TARGET)
        os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", _NUM_SMS)
    from flash_attn.cute import interface

    return interface


def compile_variant(variant: Fa4Variant) -> Any:
    """Compile ``variant`` for sm_90a; returns CuTe DSL's TVM-FFI compiled function.

    The function is callable (on an sm_90 GPU) with :func:`._fa4.call_args`'s 18 arguments and
    has ``export_to_c``. Raises ``RuntimeError`` if FA4 compiled other than one kernel.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    interface = _import_fa4()
    from flash_attn.cute.cache_utils import JITCache

    fwd = interface._flash_attn_fwd
    saved, fwd.compile_cache = fwd.compile_cache, JITCache()
    try:
        with FakeTensorMode():
            _fake_call(fwd, variant)
        entries = list(fwd.compile_cache.cache.values())
    finally:
        fwd.compile_cache = saved
    if len(entries) != 1:
        raise RuntimeError(f"FA4 compiled {len(entries)} kernels for {variant.name}, expected 1")
    return entries[0]


def _fake_call(fwd: Any, v: Fa4Variant) -> None:
    hq, hkv = _FAKE_KV_HEADS * v.group, _FAKE_KV_HEADS
    total = _FAKE_BATCH * _FAKE_SEQLEN
    cuda = {"device": "cuda"}
    q = torch.empty(total, hq, v.head_dim, dtype=v.torch_dtype, **cuda)
    k = torch.empty(total, hkv, v.head_dim, dtype=v.torch_dtype, **cuda)
    val = torch.empty(total, hkv, v.head_dim_v, dtype=v.torch_dtype, **cuda)
    cu = torch.empty(_FAKE_BATCH + 1, dtype=torch.int32, **cuda)
    fwd(
        q,
        k,
        val,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=_FAKE_SEQLEN,
        max_seqlen_k=_FAKE_SEQLEN,
        softmax_scale=v.head_dim**-0.5,
        causal=v.causal,
        window_size_left=_FAKE_WINDOW if v.window else None,
        window_size_right=None,
        learnable_sink=torch.empty(hq, dtype=torch.float32, **cuda) if v.sinks else None,
        return_lse=v.lse,
        _arch=90,
    )


def export_variant(variant: Fa4Variant, directory: Path) -> Path:
    """Compile ``variant`` and write its host code + embedded cubin to ``<dir>/<name>.o``."""
    path = Path(directory) / f"{variant.name}.o"
    compile_variant(variant).export_to_c(object_file_path=str(path), function_name=variant.name)
    return path


def runtime_library() -> Path:
    """CuTe DSL's runtime, ``libcute_dsl_runtime.so``, which every exported kernel links to
    (its ``_cuda*`` wrappers over a statically linked CUDA runtime, and the TVM-FFI error hook)."""
    _import_fa4()
    from cutlass.cute.runtime import find_runtime_libraries

    found = [Path(p) for p in find_runtime_libraries(enable_tvm_ffi=False) if p.endswith(RUNTIME)]
    if not found or not found[0].is_file():
        raise FileNotFoundError(f"{RUNTIME} not found: install nvidia-cutlass-dsl-libs-cu13")
    return found[0]


def build_bundle(variants: list[Fa4Variant], directory: Path, objects: list[Path] | None = None) -> Path:
    """Write an AOT bundle to ``directory``: the variants' objects (``export_variant``'s, given
    or made here) linked into ``fa4_sm90.so``, which finds ``libcute_dsl_runtime.so`` beside
    itself (``$ORIGIN``) and resolves its TVM-FFI symbols against the ``tvm_ffi`` module that
    loads it; a copy of that runtime; and ``manifest.json``. Needs a C compiler driver
    (``cc``) here and nothing but ``apache-tvm-ffi`` where it runs. Returns the manifest."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    todo = sorted(set(variants))
    if objects is None:
        objects = [export_variant(v, directory) for v in todo]
    names = {Path(o).stem for o in objects}
    if names != {v.name for v in todo}:
        raise ValueError(f"objects do not match the variants: {sorted(names ^ {v.name for v in todo})}")
    shutil.copy2(runtime_library(), directory / RUNTIME)
    cmd = ["cc", "-shared", "-o", str(directory / LIBRARY), *map(str, objects), f"-L{directory}", "-l:" + RUNTIME]
    subprocess.run([*cmd, "-Wl,-rpath,$ORIGIN"], check=True)
    meta = {
        "format": MANIFEST_FORMAT,
        "target": SM90_TARGET,
        "flash_attn_4": metadata.version("flash-attn-4"),
        "nvidia_cutlass_dsl": metadata.version("nvidia-cutlass-dsl-libs-base"),
        "library": LIBRARY,
        "runtime": RUNTIME,
        "variants": [v.to_json() | {"symbol": f"__tvm_ffi_{v.name}"} for v in todo],
    }
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps(meta, indent=1) + "\n")
    return manifest
