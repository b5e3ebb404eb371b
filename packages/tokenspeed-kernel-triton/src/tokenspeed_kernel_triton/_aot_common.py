"""What the ahead-of-time compile modules share (:mod:`.aot`, :mod:`.ops.moe._aot`,
:mod:`.ops.moe._gemv_aot`): the ``cuda:90`` / ``hip:gfx942`` target syntax, one compile of a
configuration (never loaded) and the AMDGCN spill count.

A configuration's ``constexprs`` may carry two extra keys: ``_options`` (``num_warps``,
``num_stages``, ...) for :func:`triton.compile` and ``_attrs`` (the ``tt.divisibility``
hints of :class:`triton.compiler.ASTSource`); every other key is a constexpr.
"""

from __future__ import annotations

import re

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
