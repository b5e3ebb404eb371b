"""Ahead-of-time compile of the GEMV MoE kernels (:mod:`.gemv`) for GPUs this machine lacks.

``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton_gemv [cuda:90 hip:gfx942 hip:gfx950 ...]``
compiles both layers at GPT-OSS-120B shapes (top-4, H = I = 2880: ``K % BLOCK_K != 0``, so
the K-tail masks are in; swiglu_oai, biases, expert map; bf16 activations) for both weight
formats (``mxfp4``: ``triton_moe_gemv_mx``; ``bf16``: ``triton_moe_gemv``) with the tiles of
:data:`.gemv.TILES` (every token-count row) and the 16-divisibility hints the launcher sees at
those shapes, and prints one JSON line per compile (kernel ``gemv_w13[FORMAT nNkKwW]``):
whether it built, registers (NVIDIA: ``n_regs``; AMD: ``.vgpr_count``), spills and shared
memory. Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass

from triton.backends.compiler import GPUTarget

from tokenspeed_kernel_dev.aot_common import amd_spills, compile_config, parse_target, target_label
from tokenspeed_kernel_triton.ops.moe.gemv import TILES, GemvTile, gemv_w2_kernel, gemv_w13_kernel, pick_gemv_tiles

TOP_K = 4  # GPT-OSS-120B


def _signature(fn, pointers: dict, consts: dict, aligned: set, options: dict) -> tuple[dict, dict]:
    """Arguments not named are int32 scalars; ``aligned`` ones (and pointers) 16-divisible."""
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned | set(pointers)}
    return signature, consts | {"_options": options, "_attrs": attrs}


def configs(target: GPUTarget) -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, signature, constexprs with ``_options``/``_attrs``) of every compile."""
    vendor = "rocm" if target.backend == "hip" else "cuda"
    return [
        c
        for fmt, weights in FORMATS.items()
        for row in TILES[weights][vendor]
        for c in _configs(fmt, *pick_gemv_tiles(vendor, TOP_K, row.max_tokens, weights))
    ]


# Compiled formats: their name in the kernel label -> the tile table's weight format.
FORMATS = {"mxfp4": "mxfp4", "bf16": "plain"}


def _configs(fmt: str, t13: GemvTile, t2: GemvTile) -> list[tuple[str, object, dict, dict]]:
    """The two compiles (layer 1, layer 2) of one weight format and tile pair."""
    # Unit strides are specialized to constants by the launcher; stride_sk = 1 (public scales).
    # K = N = 2880: 16-divisible. MXFP4: stride_wn = 1440, stride_sn = 90 (not 16-divisible);
    # bf16: stride_wn = 2880, no scales (S is the weight, its strides 0: constants too).
    mx = fmt == "mxfp4"
    w, s = ("*u8", "*u8") if mx else ("*bf16", "*bf16")
    scale_strides = {"stride_sk": 1} if mx else {"stride_se": 0, "stride_sn": 0, "stride_sk": 0}
    aligned_scales = {"stride_se"} if mx else set()
    w13 = _signature(
        gemv_w13_kernel,
        {"X": "*bf16", "W": w, "S": s, "Bias": "*fp32", "Hid": "*bf16", "Ids": "*i32", "ExpertMap": "*i32"},
        {
            "TOP_K": TOP_K,
            "HAS_MAP": True,
            "HAS_BIAS": True,
            "ACTIVATION": 2,
            "MX": mx,
            "BLOCK_N": t13.block_n,
            "BLOCK_K": t13.block_k,
            "EVEN_K": False,
            "stride_wk": 1,
            **scale_strides,
        },
        {"N", "K", "stride_xt", "stride_we", "stride_wn", "stride_be", "stride_ht"} | aligned_scales,
        {"num_warps": t13.num_warps},
    )
    w2 = _signature(
        gemv_w2_kernel,
        {
            "Hid": "*bf16",
            "W": w,
            "S": s,
            "Bias": "*bf16",
            "Out": "*bf16",
            "Ids": "*i32",
            "ExpertMap": "*i32",
            "TopkWeights": "*fp32",
        },
        {
            "TOP_K": TOP_K,
            "KP": TOP_K,
            "HAS_MAP": True,
            "HAS_BIAS": True,
            "MX": mx,
            "BLOCK_N": t2.block_n,
            "BLOCK_K": t2.block_k,
            "EVEN_K": False,
            "stride_wk": 1,
            **scale_strides,
        },
        {"N", "K", "stride_ht", "stride_we", "stride_wn", "stride_be", "stride_ot"} | aligned_scales,
        {"num_warps": t2.num_warps},
    )
    return [
        (f"gemv_w13[{fmt} n{t13.block_n}k{t13.block_k}w{t13.num_warps}]", gemv_w13_kernel, *w13),
        (f"gemv_w2[{fmt} n{t2.block_n}k{t2.block_k}w{t2.num_warps}]", gemv_w2_kernel, *w2),
    ]


@dataclass(frozen=True)
class GemvCompile:
    kernel: str
    target: str
    ok: bool
    registers: int
    spills: int
    shared_bytes: int
    error: str = ""


def compile_one(name: str, fn, signature: dict, constexprs: dict, target: GPUTarget) -> GemvCompile:
    """Compile one configuration for ``target`` (never loaded)."""
    label = target_label(target)
    try:
        compiled = compile_config(fn, signature, constexprs, target)
    except Exception as exc:  # report, do not stop the sweep
        return GemvCompile(name, label, False, 0, 0, 0, f"{type(exc).__name__}: {str(exc)[:300]}")
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    if target.backend == "cuda":
        regs = _ptxas_registers(compiled.asm.get("ptx", ""), target)
        return GemvCompile(name, label, True, regs[0], regs[1], shared)
    amdgcn = compiled.asm.get("amdgcn", "")
    vgprs = max(map(int, re.findall(r"\.vgpr_count:\s*(\d+)", amdgcn)), default=0)
    return GemvCompile(name, label, True, vgprs, amd_spills(amdgcn), shared)


def _ptxas_registers(ptx: str, target: GPUTarget) -> tuple[int, int]:
    """(registers, spill bytes) from ``ptxas -v`` on the PTX (Triton's bundled ptxas)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(target.arch).path
    arch = sm_arch_from_capability(target.arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        res = subprocess.run(
            [ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.o")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = res.stdout + res.stderr
    regs = max(map(int, re.findall(r"Used (\d+) registers", log)), default=0)
    spills = sum(map(int, re.findall(r"(\d+) bytes spill (?:stores|loads)", log)))
    return regs, spills


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or ["cuda:90", "hip:gfx942", "hip:gfx950"]
    ok = True
    for target in map(parse_target, names):
        for name, fn, sig, consts in configs(target):
            result = compile_one(name, fn, sig, consts, target)
            ok &= result.ok
            print(json.dumps(asdict(result)), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
