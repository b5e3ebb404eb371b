"""What the ahead-of-time compile modules share (:mod:`.aot_triton`, :mod:`.aot_triton_moe`,
:mod:`.aot_triton_gemv` and :mod:`.aot_nvidia`): the ``cuda:90`` /
``hip:gfx942`` target syntax, one compile of a configuration (never loaded), the AMDGCN spill
count, and for sm_90 the registers and spills that Triton's bundled ``ptxas -v`` reports (a
compiled object carries no register count without a device) and the SASS of a cubin
(``nvdisasm``) with its loops' opcodes.

A configuration's ``constexprs`` may carry two extra keys: ``_options`` (``num_warps``,
``num_stages``, ...) for :func:`triton.compile` and ``_attrs`` (the ``tt.divisibility``
hints of :class:`triton.compiler.ASTSource`); every other key is a constexpr.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def parse_target(text: str) -> GPUTarget:
    backend, _, arch = text.partition(":")
    if backend == "cuda":
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip":
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"target must look like cuda:90 or hip:gfx942, got {text!r}")


def target_label(target: GPUTarget) -> str:
    return f"{target.backend}:{target.arch}"


def compile_config(fn, signature: dict, constexprs: dict, target: GPUTarget):
    """``triton.compile`` of one configuration for ``target`` (``constexprs`` is not modified)."""
    options = dict(constexprs.get("_options", {}))
    attrs = constexprs.get("_attrs")
    constexprs = {k: v for k, v in constexprs.items() if not k.startswith("_")}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options)


def amd_spills(amdgcn: str) -> int:
    """The ``.vgpr_spill_count`` + ``.sgpr_spill_count`` of the kernel metadata."""
    return sum(map(int, re.findall(r"\.(?:sgpr|vgpr)_spill_count:\s*(\d+)", amdgcn)))


def ptxas_stats(ptx: str, arch: int = 90) -> tuple[int, int]:
    """(registers, spill bytes) of ``ptx`` from Triton's bundled ``ptxas -v`` for ``sm_{arch}a``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(tmp, "k.cubin")]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = max((int(x) for x in re.findall(r"Used (\d+) registers", log)), default=0)
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -c`` of a cubin (the ptxas that Triton bundles ships it alongside)."""
    from triton.backends.nvidia.compiler import get_ptxas

    nvdisasm = os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


SASS_OPCODE = re.compile(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def sass_loop_spans(text: str) -> list[tuple[int, int, list[str]]]:
    """Each loop of ``text`` as (line of its label, line of the branch back to it, its
    instructions: the disassembly lines holding an opcode in between), in the order of those
    branches."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            start = labels[m.group(1)]
            loops.append((start, i, [x for x in lines[start : i + 1] if SASS_OPCODE.search(x)]))
    return loops


def sass_loops(text: str) -> list[list[str]]:
    """The instructions (disassembly lines holding an opcode) of each loop of ``text``, from a
    label to a later branch back to it, in the order of those branches."""
    return [body for _, _, body in sass_loop_spans(text)]
