"""Ahead-of-time compile of the FA3-style Gluon paged extend (``gluon_extend_fa3_sm90``) for sm_90.

``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_nvidia_extend`` compiles the configurations
the launcher can choose (head dims 64 and 128, page sizes from the smallest the 128-byte
swizzle allows to one larger than a key tile, sinks and LSE on and off, fp16) and prints one
JSON line each, with the counts of :mod:`tokenspeed_kernel_dev.aot_nvidia` (the kind
``extend_fa3`` is added to its table, so the rows are measured the same way). Must run
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import torch
from triton.compiler import compile as triton_compile
from triton.experimental.gluon._runtime import GluonASTSource

from tokenspeed_kernel_dev import aot_nvidia
from tokenspeed_kernel_nvidia.ops.attention._gluon_extend_fa3_kernel import extend_fa3_kernel
from tokenspeed_kernel_nvidia.ops.attention.gluon_extend_fa3 import extend_plan


def compile_extend_fa3(
    dtype: torch.dtype, head_dim: int, page_size: int, group: int, sinks: bool, lse: bool, variant: dict | None = None
):
    """Compile one configuration of the paged extend for sm_90 with the launcher's plan
    (``variant``: ``Fa3Config`` fields for :func:`extend_plan`); returns (name, compiled). Q
    arrives as a 2-D TMA descriptor (box ``[64, D]``), the caches as 4-D ones (box ``[1, 1,
    BOX, D]``)."""
    variant = dict(variant or {})
    tile_list = variant.pop("tile_list", False)  # the ragged batch's launch (a listed walk)
    plan = extend_plan(head_dim, page_size, **variant)
    cfg = plan.cfg
    q_smem, _, _, _, box_smem, _ = plan.layouts
    kv_desc = f"tensordesc<{aot_nvidia._TYPE[dtype][1:]}[1, 1, {plan.box}, 64],{box_smem!r}>"
    signature = aot_nvidia.fa3_signature(dtype, head_dim, q_smem, kv_desc) | {
        "seqlens_ptr": "*i32",
        "table_ptr": "*i32",
        "table_stride": "i32",
        "max_pages": "i32",
        "num_pages": "i32",
        "sm_scale": "fp32",
        "window": "i32",
        "n_m": "i32",
        "batch": "i32",
        "tiles_ptr": "*i32",
    }
    constexprs = plan.constexprs(8 * group, 8, sinks, lse) | {"TILE_LIST": tile_list}
    for name in constexprs:
        signature[name] = "constexpr"
    flags = "".join(f"-{f}" for f, on in (("sinks", sinks), ("lse", lse)) if on)
    name = f"gluon_extend_fa3-{str(dtype)[6:]}-g{group}-p{page_size}-{cfg.tag}{flags}{'-tl' if tile_list else ''}"
    src = GluonASTSource(extend_fa3_kernel, signature, constexprs, aot_nvidia._attrs(signature))
    return name, triton_compile(src, target=aot_nvidia.SM90, options={"num_warps": 4, "maxnreg": cfg.maxnreg})


def extend_fa3_grid():
    """GPT-OSS's launch (D 64, GQA 8, P 16, sinks), the smallest page at D 64 (8) and at
    D 128 (8), a page larger than a key tile (256), LSE, fp16 and GQA 1; then the dense
    kernel's variants on GPT-OSS's launch (``pv_overlap`` at D 64 and 128, ``exp2_poly = 1``,
    ``rescale_threshold = 8``), which the shared consumer gives the extend too; and GPT-OSS's
    launch walking a ragged batch's tile list (``TILE_LIST``)."""
    return [
        (torch.bfloat16, 64, 16, 8, True, False),
        (torch.bfloat16, 64, 8, 8, False, True),
        (torch.bfloat16, 64, 256, 8, True, True),
        (torch.float16, 64, 32, 1, False, False),
        (torch.bfloat16, 128, 16, 8, True, False),
        (torch.bfloat16, 128, 8, 4, False, True),
        (torch.bfloat16, 64, 16, 8, True, False, {"pv_overlap": True}),
        (torch.bfloat16, 128, 16, 8, True, False, {"pv_overlap": True}),
        (torch.bfloat16, 64, 16, 8, True, False, {"exp2_poly": 1}),
        (torch.bfloat16, 64, 16, 8, True, False, {"rescale_threshold": 8.0}),
        (torch.bfloat16, 64, 16, 8, True, False, {"tile_list": True}),
    ]


aot_nvidia._BUILDERS["extend_fa3"] = (compile_extend_fa3, extend_fa3_grid)


def main() -> int:
    results = aot_nvidia.run(("extend_fa3",))
    for r in results:
        print(json.dumps(asdict(r)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
