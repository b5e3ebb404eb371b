"""FlashAttention-4's sm_90 forward compiled without a GPU, and its compiled functions taking the
arguments ``fa4_prefill_sm90`` builds.

- With the ``cutedsl`` extra (flash-attn-4, nvidia-cutlass-dsl): one variant is compiled for
  sm_90a here; its object embeds an sm_90 cubin whose SASS has ``HGMMA`` (wgmma, sm_90a
  only) and TMA loads, and its function accepts ``run``'s arguments.
- With an AOT bundle (``TOKENSPEED_KERNEL_FA4_AOT``, from ``ci/device/cutedsl_aot.py``):
  every variant of the bundle accepts the arguments ``run`` builds for a call it serves.

"Accepts" is checked without a GPU: tensors are passed as CUDA DLPack tensors at fake
addresses (support.fake_cuda), so the TVM-FFI entry checks dtypes, ranks, strides,
alignment and devices exactly as on a GPU, and the call ends at the host code's first CUDA
runtime call (no driver here). On a GPU machine these tests skip: test_fa4_gpu.py runs the
kernel there.
"""

import importlib.util
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from support.fake_cuda import DRIVER_ERROR, fake_cuda_args
from support.prefill_args import ragged_prefill_args

from tokenspeed_kernel_nvidia.ops.attention import _fa4

HAS_FA4 = all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "cutlass"))
NO_FA4 = "flash-attn-4 / nvidia-cutlass-dsl not installed (the cutedsl extra): nothing to compile here"
ON_GPU = "a CUDA device is present: test_fa4_gpu.py runs the kernel itself"
VARIANT = _fa4.Fa4Variant("bfloat16", 64, 64, 8, True, True, True, True)


def _skip_unless(ok: bool, reason: str) -> None:
    if not ok:
        print(f"SKIP fa4_prefill_sm90: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def compiled():
    _skip_unless(HAS_FA4, NO_FA4)
    from tokenspeed_kernel_nvidia.ops.attention import _fa4_build

    return _fa4_build.compile_variant(VARIANT)


def _args_for(variant: _fa4.Fa4Variant):
    """A ragged call (an empty sequence, keys before queries) that ``variant`` serves."""
    return ragged_prefill_args(
        (3, 0, 130),
        (7, 4, 200),
        hq=2 * variant.group,
        hkv=2,
        d=variant.head_dim,
        dtype=variant.torch_dtype,
        causal=variant.causal,
        window_left=31 if variant.window else -1,
        sinks=variant.sinks,
        return_lse=variant.lse,
    )


def _run_faked(monkeypatch, args, function) -> None:
    """``_fa4.run(args)`` with ``function`` as the compiled kernel, fed fake CUDA tensors."""
    monkeypatch.setattr(_fa4, "_function", lambda variant: lambda *a: function(variant)(*fake_cuda_args(a)))
    _fa4.run(args)


def _cubin(obj: bytes) -> bytes:
    """The first embedded ELF (the cubin) of a host object, cut where its last header or section ends."""
    start = obj.index(b"\x7fELF", 1)
    (phoff,) = struct.unpack_from("<Q", obj, start + 0x20)
    (shoff,) = struct.unpack_from("<Q", obj, start + 0x28)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", obj, start + 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    for i in range(shnum):
        (kind,) = struct.unpack_from("<I", obj, start + shoff + i * shentsize + 4)
        offset, size = struct.unpack_from("<QQ", obj, start + shoff + i * shentsize + 0x18)
        end = max(end, offset + (0 if kind == 8 else size))  # SHT_NOBITS takes no file space
    return obj[start : start + end]


def test_object_embeds_sm90a_wgmma_and_tma(compiled, tmp_path):
    nvdisasm = Path(importlib.util.find_spec("triton").origin).parent / "backends/nvidia/bin/nvdisasm"
    _skip_unless(nvdisasm.is_file(), f"no nvdisasm at {nvdisasm}")
    obj = tmp_path / f"{VARIANT.name}.o"
    compiled.export_to_c(object_file_path=str(obj), function_name=VARIANT.name)
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(_cubin(obj.read_bytes()))
    (flags,) = struct.unpack_from("<I", cubin.read_bytes(), 0x30)
    assert (flags >> 8) & 0xFF == 90, hex(flags)  # CUDA 13 cubin ABI: the SM in bits 8-15
    sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    ops = set(re.findall(r"\b(HGMMA|UTMALDG|UTMASTG|WARPGROUP)\b", sass))
    assert ops == {"HGMMA", "UTMALDG", "UTMASTG", "WARPGROUP"}, ops


def test_compiled_function_takes_run_arguments(compiled, monkeypatch):
    _skip_unless(not torch.cuda.is_available(), ON_GPU)
    args = _args_for(VARIANT)
    with pytest.raises(RuntimeError, match=DRIVER_ERROR):
        _run_faked(monkeypatch, args, lambda variant: compiled)
    # the entry checks what it was compiled for: an fp16 q for this bf16 variant is refused
    wrong = _args_for(VARIANT)
    wrong.q = wrong.q.half()
    with pytest.raises(ValueError, match="Mismatched Tensor on argument #0"):
        _run_faked(monkeypatch, wrong, lambda variant: compiled)


def test_bundle_variants_take_run_arguments(monkeypatch):
    _fa4._read_bundle.cache_clear()
    route = _fa4._route()
    _skip_unless(isinstance(route, _fa4._Bundle), f"no usable AOT bundle: {route or f'{_fa4.AOT_ENV} unset'}")
    _skip_unless(not torch.cuda.is_available(), ON_GPU)
    function = _fa4._function
    for variant in sorted(route.variants):
        with pytest.raises(RuntimeError, match=DRIVER_ERROR):
            _run_faked(monkeypatch, _args_for(variant), function)
