"""Ahead-of-time compilation and AMDGCN inspection of the Gluon kernels (no GPU needed).

``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_amd [gfx942 gfx950]`` compiles every kernel over the
configurations the host-side heuristics can choose and prints one JSON line per compile:
whether it built, the MFMA instructions in the AMDGCN, LDS bytes, VGPRs/AGPRs, spills and
scratch. The test suite calls :func:`compile_kernel` directly.

A Gluon kernel is compiled from a :class:`GluonASTSource` (the Gluon flavour of
``triton.compiler.ASTSource``: same ``fn``/``signature``/``constexprs``, but the frontend
emits TTGIR with the layouts the kernel states) with ``triton.compile(src,
target=GPUTarget("hip", arch, 64))``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from tokenspeed_kernel_amd._arch import ARCHS, arch_config
from tokenspeed_kernel_dev import subprocess_env

__all__ = [
    "FAMILIES",
    "MFMA_16BIT",
    "SCALED_MFMA",
    "CompileReport",
    "compile_kernel",
    "kernel_signature",
    "pointer_type",
    "run_sweep",
    "sweep",
]

FAMILIES = ("attention", "moe")

# The 16-bit MFMA each arch's tiles are built on (K = 16 on CDNA3, 32 on CDNA4).
MFMA_16BIT = {"gfx942": "v_mfma_f32_16x16x16_", "gfx950": "v_mfma_f32_16x16x32_"}

_POINTER = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.uint8: "*u8",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
# The scaled MFMA the gfx950 MXFP4 x MXFP8 GEMM is built on (e4m3 A, e2m1 B, E8M0 scales).
SCALED_MFMA = "v_mfma_scale_f32_16x16x128_f8f6f4"

# torch.float8_e4m3fn is OCP e4m3 on both archs (gfx942's native fp8 is the fnuz flavour;
# the kernels upcast the OCP bytes in registers there).
_FP8 = "*fp8e4nv"


def pointer_type(dtype: torch.dtype) -> str:
    """The Triton signature string of a pointer to ``dtype``."""
    if dtype == torch.float8_e4m3fn:
        return _FP8
    return _POINTER[dtype]


def kernel_signature(fn, types: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """A full signature: ``types`` for runtime arguments, ``"constexpr"`` for the rest."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            raise KeyError(f"{fn.__name__}: no type for runtime argument {name!r}")
    return signature


@dataclass
class CompileReport:
    """What one ahead-of-time compile produced, read from the AMDGCN and the metadata."""

    kernel: str
    arch: str
    ok: bool
    mfma: dict[str, int] = field(default_factory=dict)
    lds_bytes: int = 0
    vgprs: int = 0
    agprs: int = 0
    sgprs: int = 0
    vgpr_spills: int = 0
    sgpr_spills: int = 0
    scratch_bytes: int = 0
    num_warps: int = 0
    error: str = ""

    @property
    def mfma_count(self) -> int:
        return sum(self.mfma.values())

    @property
    def scaled_mfma_count(self) -> int:
        return sum(n for name, n in self.mfma.items() if name.startswith("v_mfma_scale"))

    @property
    def lds_limit(self) -> int:
        return arch_config(self.arch).lds_bytes

    def mfma_problems(self) -> list[str]:
        """What is wrong with the matrix instructions of a kernel built on 16-bit MFMA tiles."""
        if not self.mfma:
            return [f"{self.kernel} on {self.arch}: no v_mfma instruction in the AMDGCN"]
        prefix = MFMA_16BIT[self.arch]
        wrong = sorted(name for name in self.mfma if not name.startswith(prefix))
        return [f"{self.kernel} on {self.arch}: unexpected {wrong} (expected {prefix}*)"] if wrong else []

    def scaled_mfma_problems(self) -> list[str]:
        """What is wrong with the matrix instructions of a kernel built on the scaled MFMA."""
        if self.arch != "gfx950" or not self.mfma:
            return [f"{self.kernel} on {self.arch}: no scaled MFMA (gfx950 only) in the AMDGCN"]
        wrong = sorted(name for name in self.mfma if name != SCALED_MFMA)
        return [f"{self.kernel} on {self.arch}: unexpected {wrong} (expected only {SCALED_MFMA})"] if wrong else []

    def problems(self) -> list[str]:
        """Budget violations: spills, scratch, LDS beyond the arch, > 512 VGPRs+AGPRs."""
        out = []
        if not self.ok:
            out.append(f"did not compile: {self.error}")
            return out
        if self.vgpr_spills or self.sgpr_spills:
            out.append(f"register spills: {self.vgpr_spills} VGPR, {self.sgpr_spills} SGPR")
        if self.scratch_bytes:
            out.append(f"scratch (private segment) of {self.scratch_bytes} bytes")
        if self.lds_bytes > self.lds_limit:
            out.append(f"LDS {self.lds_bytes} B exceeds {self.lds_limit} B on {self.arch}")
        if self.vgprs + self.agprs > 512:
            out.append(f"{self.vgprs} VGPRs + {self.agprs} AGPRs exceed 512")
        return out


def _field(asm: str, key: str) -> int:
    found = re.search(rf"\.{key}:\s*(\d+)", asm)
    return int(found.group(1)) if found else 0


def compile_kernel(
    fn, types: dict[str, str], constexprs: dict[str, Any], arch: str, *, num_warps: int, name: str = ""
) -> CompileReport:
    """Compile ``fn`` for ``arch`` (``gfx942``/``gfx950``) and read the AMDGCN. Never raises:
    a failed compile is a report with ``ok=False`` and the error."""
    label = name or fn.__name__
    try:
        src = GluonASTSource(fn, kernel_signature(fn, types, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("hip", arch, 64), options={"num_warps": num_warps})
    except Exception as exc:  # report, do not stop a sweep
        return CompileReport(label, arch, False, error=f"{type(exc).__name__}: {str(exc)[-800:]}")
    asm = compiled.asm["amdgcn"]
    return CompileReport(
        kernel=label,
        arch=arch,
        ok=True,
        mfma=dict(Counter(re.findall(r"\b(v_mfma_\w+)", asm))),
        lds_bytes=max(int(getattr(compiled.metadata, "shared", 0) or 0), _field(asm, "group_segment_fixed_size")),
        vgprs=_field(asm, "vgpr_count"),
        agprs=_field(asm, "agpr_count"),
        sgprs=_field(asm, "sgpr_count"),
        vgpr_spills=_field(asm, "vgpr_spill_count"),
        sgpr_spills=_field(asm, "sgpr_spill_count"),
        scratch_bytes=_field(asm, "private_segment_fixed_size"),
        num_warps=num_warps,
    )


def sweep(archs: list[str], families: tuple[str, ...] = FAMILIES) -> list[CompileReport]:
    """Every kernel of ``families`` over its configuration grid, for each arch."""
    from tokenspeed_kernel_dev.aot_amd_attention import attention_reports
    from tokenspeed_kernel_dev.aot_amd_moe import moe_reports

    grids = {"attention": attention_reports, "moe": moe_reports}
    return [report for arch in archs for family in families for report in grids[family](arch)]


def run_sweep(archs: list[str], families: tuple[str, ...] = FAMILIES, timeout: float = 900) -> list[CompileReport]:
    """:func:`sweep` in a fresh interpreter without ``TRITON_INTERPRET`` (which replaces the
    Gluon standard library's jitted helpers, so nothing could compile in a process that has
    it set, as the test suite does on a machine without a GPU)."""
    env = subprocess_env()
    cmd = [sys.executable, "-m", "tokenspeed_kernel_dev.aot_amd", "--families", ",".join(families), *archs]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise RuntimeError(f"the compile sweep printed nothing (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return [CompileReport(**{k: v for k, v in row.items() if k != "problems"}) for row in rows]


def main(argv: list[str]) -> int:
    """``python -m tokenspeed_kernel_dev.aot_amd [--families attention,moe] [gfx942 gfx950]``:
    one JSON line per compile; exit status 1 if any compile broke a budget."""
    families = FAMILIES
    if argv[:1] == ["--families"]:
        families, argv = tuple(argv[1].split(",")), argv[2:]
    archs = argv or list(ARCHS)
    bad = 0
    for report in sweep(archs, families):
        row = asdict(report) | {"problems": report.problems()}
        bad += bool(row["problems"])
        print(json.dumps(row), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
