"""Ahead-of-time compilation of the Gluon kernels for sm_90 on a machine without a GPU.

``python -m tokenspeed_kernel_nvidia.aot`` compiles every configuration the Gluon decode
launcher can choose for ``GPUTarget("cuda", 90, 32)`` and prints one JSON line each: whether
it built, the counts of the instructions the design relies on in the PTX (``cp.async``
gathers, ``mma.sync`` tensor-core products, ``wgmma``), shared memory and registers. Must
run without ``TRITON_INTERPRET`` (the test suite runs it in a subprocess).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from dataclasses import asdict, dataclass

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.experimental.gluon._runtime import GluonASTSource

from tokenspeed_kernel_nvidia.ops.attention._gluon_decode_kernel import decode_kernel
from tokenspeed_kernel_nvidia.ops.attention.gluon_decode import decode_config

_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}
SM90 = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    ok: bool
    cp_async: int
    mma: int
    wgmma: int
    tma: int
    shared_bytes: int
    registers: int
    spills: int
    error: str = ""


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


def compile_decode(dtype: torch.dtype, head_dim: int, page_size: int, group: int, splits: int, cap: bool):
    """Compile one decode configuration for sm_90; returns (name, compiled or exception)."""
    cfg = decode_config(head_dim, page_size)
    load, smem, mma = cfg.layouts
    t = _TYPE[dtype]
    signature = {
        "q_ptr": t, "k_ptr": t, "v_ptr": t, "page_table_ptr": "*i32", "seqlens_ptr": "*i32",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "pt_stride": "i32", "sm_scale": "fp32",
        "logit_cap": "fp32", "window_left": "i32",
    }  # fmt: skip
    constexprs = {
        "HQ": 8 * group, "HKV": 8, "G": group, "D": head_dim, "PAGE": page_size, "SPLITS": splits,
        "BLOCK_N": cfg.block_n, "STAGES": cfg.stages, "HAS_CAP": cap, "LOAD": load, "SMEM": smem, "MMA": mma,
    }  # fmt: skip
    for name in constexprs:
        signature[name] = "constexpr"
    name = f"gluon_decode-{str(dtype)[6:]}-d{head_dim}-p{page_size}-g{group}-s{splits}{'-cap' if cap else ''}"
    # What the JIT specializes at run time: 16-byte aligned pointers (torch allocations).
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    src = GluonASTSource(decode_kernel, signature, constexprs, attrs)
    return name, triton_compile(src, target=SM90, options={"num_warps": cfg.num_warps})


def decode_grid():
    return [
        (dtype, d, p, g, s, cap)
        for (dtype, d, p, g, s), cap in itertools.product(
            [
                (torch.bfloat16, 64, 16, 8, 8),
                (torch.bfloat16, 64, 16, 8, 1),
                (torch.float16, 64, 1, 4, 8),
                (torch.bfloat16, 128, 16, 8, 8),
                (torch.bfloat16, 128, 64, 16, 4),
            ],
            (False,),
        )
    ] + [(torch.bfloat16, 64, 16, 8, 8, True)]


def run() -> list[CompileResult]:
    results = []
    for params in decode_grid():
        name = "?"
        try:
            name, compiled = compile_decode(*params)
            ptx = compiled.asm.get("ptx", "")
            results.append(
                CompileResult(
                    kernel=name,
                    ok=True,
                    cp_async=_count(r"\bcp\.async\.(?:ca|cg)\.shared", ptx),
                    mma=_count(r"\bmma\.sync\.aligned", ptx),
                    wgmma=_count(r"\bwgmma\.", ptx),
                    tma=_count(r"\bcp\.async\.bulk\.tensor", ptx),
                    shared_bytes=int(getattr(compiled.metadata, "shared", 0)),
                    registers=int(getattr(compiled, "n_regs", 0) or 0),
                    spills=int(getattr(compiled, "n_spills", 0) or 0),
                )
            )
        except Exception as exc:  # report every configuration, not only the first failure
            results.append(
                CompileResult(f"{name}:{params}", False, 0, 0, 0, 0, 0, 0, 0, f"{type(exc).__name__}: {exc}")
            )
    return results


def main(argv: list[str] | None = None) -> int:
    results = run()
    for r in results:
        print(json.dumps(asdict(r)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
