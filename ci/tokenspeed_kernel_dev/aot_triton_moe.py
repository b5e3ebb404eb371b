"""Ahead-of-time compile of the MoE kernels for GPUs this machine does not have.

``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton_moe [cuda:90 hip:gfx942 hip:gfx950 ...]``
compiles the grouped GEMM for every weight format and both layers at the decode and the
largest tile of the target's table (and the layer-1 MXFP4 GEMM at every tile), the
``tl.dot_scaled`` GEMM at every tile of its table (split-K and public scales at the decode
tile) and its split-K finish, plus the permutation, combine and top-k kernels, and prints one JSON line per compile: whether it
built, how many matrix instructions the assembly holds (``mma``/``wgmma`` in PTX,
``v_mfma`` in AMDGCN), shared memory and spills. The MXFP4 GEMMs for sm_90 (``moe_mx_gemm``,
``moe_mx_swap``, ``moe_mx_swap_persistent`` at every tile and schedule it can choose) also
report the registers and spill bytes of ``ptxas -v`` and the opcodes of their main loop in
SASS (:func:`main_loop`) and of each innermost loop with wgmma (:func:`mma_loops`: the
persistent kernel's K loops). Must run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

from triton.backends.compiler import GPUTarget

from tokenspeed_kernel_dev.aot_common import (
    SASS_OPCODE,
    amd_spills,
    compile_config,
    disassemble,
    parse_target,
    ptxas_stats,
    sass_loop_spans,
    sass_loops,
    target_label,
)
from tokenspeed_kernel_triton.ops.moe._config import Schedule, Tile, schedules_for, tiles_for
from tokenspeed_kernel_triton.ops.moe._gemm import (
    FP8_BLOCK,
    FP8_ROW,
    MXFP4,
    PLAIN,
    combine_kernel,
    fp8_quant_kernel,
    moe_gemm_kernel,
)
from tokenspeed_kernel_triton.ops.moe._mx_gemm import moe_mx_gemm_kernel, split_finish_kernel
from tokenspeed_kernel_triton.ops.moe._mx_swap_gemm import moe_mx_swap_gemm_kernel
from tokenspeed_kernel_triton.ops.moe._mx_swap_persistent import moe_mx_swap_persistent_kernel
from tokenspeed_kernel_triton.ops.moe._routing import align_kernel
from tokenspeed_kernel_triton.ops.moe.ep import ep_combine_kernel, ep_pack_kernel, ep_route_kernel, ep_unpack_kernel
from tokenspeed_kernel_triton.ops.moe.topk import topk_kernel

_FORMAT_NAMES = {PLAIN: "bf16", FP8_ROW: "fp8_row", FP8_BLOCK: "fp8_block", MXFP4: "mxfp4"}


def _weight_types(fmt: int, target: GPUTarget) -> tuple[str, str]:
    if fmt == PLAIN:
        return "*bf16", "*bf16"
    if fmt == MXFP4:
        return "*u8", "*u8"
    # torch.float8_e4m3fn tensors reach the kernel as fp8e4nv on every target (on gfx942 the
    # conversion to bf16 is done in software: CDNA3's native fp8 is the fnuz variant).
    return "*fp8e4nv", "*fp32"


def gemm_signature(fmt: int, gated: bool, tile: Tile, target: GPUTarget) -> tuple[dict, dict]:
    w_type, s_type = _weight_types(fmt, target)
    pointers = {
        "A": "*bf16",
        "W": w_type,
        "S": s_type,
        "Bias": "*fp32",
        "Out": "*bf16" if gated else "*fp32",
        "SortedIds": "*i32",
        "TileExpert": "*i32",
        "NumTiles": "*i32",
        "TopkWeights": "*fp32",
        "AS": "*fp32",
    }
    consts = {
        "TOP_K": 4,
        "FORMAT": fmt,
        "GATED": gated,
        "ACTIVATION": 2,
        "HAS_BIAS": True,
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_K": 64 if fmt == MXFP4 else tile.block_k,
        "GROUP_M": tile.group_m,
        "EVEN_K": fmt == MXFP4,
        "INTERPRET": False,
        "DOT_PREC": None,
        "MX_HALVES": fmt == MXFP4,
        "MX_BF16": fmt == MXFP4,
        "MX_WORDS": fmt == MXFP4,
        "ATOMIC": False,
        "A_FP8": False,
    }
    consts["stride_wk"] = 1  # the launcher specializes a unit stride to a constant, as here
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in moe_gemm_kernel.arg_names}
    aligned = {*pointers, "N", "K", "stride_am", "stride_we", "stride_wn", "stride_be", "stride_om"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(moe_gemm_kernel.arg_names) if n in aligned}
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return signature, consts | {"_options": options, "_attrs": attrs}


def _hinted(fn, pointers: dict, consts: dict, aligned: set, options: dict) -> tuple[dict, dict]:
    """Signature and constexprs (with ``_options`` and the 16-divisibility ``_attrs`` of the
    ``aligned`` arguments) of ``fn``; arguments not named are int32 scalars."""
    signature = {n: pointers.get(n, "constexpr" if n in consts else "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n in aligned | set(pointers)}
    return signature, consts | {"_options": options, "_attrs": attrs}


def _mx_pointers(gated: bool, split: bool, weight_type: str) -> dict:
    """Pointer types of the MXFP4 grouped GEMMs (weights and scales as ``weight_type``)."""
    return {
        "A": "*bf16",
        "W": weight_type,
        "S": weight_type,
        "Bias": "*fp32",
        "Out": "*bf16" if gated and not split else "*fp32",
        "SortedIds": "*i32",
        "TileExpert": "*i32",
        "NumTiles": "*i32",
        "TopkWeights": "*fp32",
    }


def _mx_consts(gated: bool, tile: Tile, split: bool) -> dict:
    """The constexprs both MXFP4 grouped GEMMs take (GPT-OSS: top-4, swiglu_oai, biases)."""
    return {
        "TOP_K": 4,
        "GATED": gated,
        "ACTIVATION": 2,
        "HAS_BIAS": True,
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "GROUP_M": tile.group_m,
        "SPLIT": split,
    }


def mx_gemm_signature(gated: bool, tile: Tile, *, split: bool, planned: bool) -> tuple[dict, dict]:
    """The dot_scaled GEMM as the launcher specializes it at GPT-OSS shapes (K = 2880: not a
    multiple of 128, so ``EVEN_K`` is off; unit strides constant; 16-divisible sizes)."""
    pointers = _mx_pointers(gated, split, "*u8")
    consts = _mx_consts(gated, tile, split) | {"BLOCK_K": tile.block_k, "EVEN_K": False, "A_FMT": "bf16"}
    consts["stride_wk"] = 1  # the launcher specializes a unit stride to a constant, as here
    consts["stride_sn" if planned else "stride_sk"] = 1  # planned scales are N-contiguous
    aligned = {"N", "K", "k_split", "stride_am", "stride_we", "stride_wn", "stride_be", "stride_om", "stride_os"}
    aligned |= {"stride_se", "stride_sk"} if planned else set()
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return _hinted(moe_mx_gemm_kernel, pointers, consts, aligned, options)


def _mx_configs(vendor: str) -> list[tuple[str, object, dict, dict]]:
    """Every ``mxfp4_dot`` tile, both layers, planned scales; at the decode tile also split-K
    and the functional path's public scales; the split-K finish kernel."""
    out = []
    for index, tile in enumerate(tiles_for(vendor, "mxfp4_dot")):
        variants = [(False, True)] + ([(True, True), (False, False)] if index == 0 else [])
        for split, planned in variants:
            for gated in (True, False):
                layer = "w13" if gated else "w2"
                name = f"moe_mx_gemm[{layer}-{'planned' if planned else 'public'}-m{tile.block_m}n{tile.block_n}"
                name += "-split]" if split else "]"
                out.append((name, moe_mx_gemm_kernel, *mx_gemm_signature(gated, tile, split=split, planned=planned)))
    pointers = {
        "Partial": "*fp32",
        "Bias": "*fp32",
        "Out": "*bf16",
        "SortedIds": "*i32",
        "TileExpert": "*i32",
        "NumTiles": "*i32",
    }
    consts = {"SPLITS": 4, "ACTIVATION": 2, "HAS_BIAS": True, "BLOCK_M": 16, "BLOCK_N": 128}
    aligned = {"N", "stride_ps", "stride_pm", "stride_be", "stride_om"}
    sig, consts = _hinted(split_finish_kernel, pointers, consts, aligned, {"num_warps": 4})
    return [*out, ("moe_mx_split_finish", split_finish_kernel, sig, consts)]


def swap_gemm_signature(gated: bool, tile: Tile, *, split: bool, big: bool) -> tuple[dict, dict]:
    """The swapped MXFP4 GEMM as the launcher specializes it at GPT-OSS shapes (16-divisible
    sizes and strides; the K step is fixed)."""
    pointers = _mx_pointers(gated, split, "*i32")
    consts = _mx_consts(gated, tile, split) | {"BIG_SCALES": big, "INTERPRET": False}
    aligned = {
        "N",
        "K",
        "stride_am",
        "stride_we",
        "stride_ws",
        "stride_se",
        "stride_ss",
        "stride_be",
        "stride_om",
        "stride_os",
    }
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return _hinted(moe_mx_swap_gemm_kernel, pointers, consts, aligned, options)


def swap_name(gated: bool, tile: Tile, *, split: bool = False, big: bool = False) -> str:
    """The sweep's name of a swapped-GEMM compile: ``moe_mx_swap[w13-m16n128(-split)(-big)]``."""
    return f"moe_mx_swap[{'w13' if gated else 'w2'}-m{tile.block_m}n{tile.block_n}{'-split' if split else ''}" + (
        "-big]" if big else "]"
    )


def _swap_configs(vendor: str) -> list[tuple[str, object, dict, dict]]:
    """Every ``mxfp4_swap`` tile (NVIDIA only: inline PTX), both layers; at the decode tile
    also split-K and the two-multiply decode of large scales (``BIG_SCALES``)."""
    if vendor != "cuda":
        return []
    out = []
    for index, tile in enumerate(tiles_for(vendor, "mxfp4_swap")):
        variants = [(False, False)] + ([(True, False), (False, True)] if index == 0 else [])
        for split, big in variants:
            for gated in (True, False):
                sig, consts = swap_gemm_signature(gated, tile, split=split, big=big)
                out.append((swap_name(gated, tile, split=split, big=big), moe_mx_swap_gemm_kernel, sig, consts))
    return out


def persistent_signature(gated: bool, tile: Tile, schedule: Schedule, *, big: bool = False) -> tuple[dict, dict]:
    """The persistent swapped GEMM as the launcher specializes it at GPT-OSS shapes (layer 2 with
    ``schedule.w2_tma``: the intermediate's TMA descriptor ``A_desc``, ``[block_m, 128]`` bf16 blocks)."""
    tma = schedule.w2_tma and not gated
    pointers = _mx_pointers(gated, False, "*i32") | {"TileSpan": "*i32", "WorkCounters": "*i32"}
    consts = {k: v for k, v in _mx_consts(gated, tile, False).items() if k not in ("GROUP_M", "SPLIT")}
    consts |= {"TAIL_M": schedule.tail_m, "DYNAMIC": schedule.dynamic, "K_STAGES": tile.num_stages}
    consts |= {"BIG_SCALES": big, "INTERPRET": False, "A_TMA": tma} | ({} if tma else {"A_desc": None})
    aligned = {"N", "K", "stride_am", "stride_we", "stride_ws", "stride_se", "stride_ss", "stride_be", "stride_om"}
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    signature, consts = _hinted(moe_mx_swap_persistent_kernel, pointers, consts, aligned, options)
    if tma:
        signature["A_desc"] = f"tensordesc<bf16[{tile.block_m}, 128]>"
    return signature, consts


def persistent_name(gated: bool, tile: Tile, schedule: Schedule, *, big: bool = False) -> str:
    """The sweep's name of a persistent-GEMM compile:
    ``moe_mx_swap_persistent[w13-m128n128-tail32-dynamic(-big)]``."""
    order = "dynamic" if schedule.dynamic else "static"
    layer = "w13" if gated else "w2"
    tma = "-tma" if schedule.w2_tma and not gated else ""
    return f"moe_mx_swap_persistent[{layer}-m{tile.block_m}n{tile.block_n}-tail{schedule.tail_m}-{order}{tma}" + (
        "-big]" if big else "]"
    )


def persistent_variants(vendor: str) -> list[tuple[Tile, Schedule, bool]]:
    """(tile, schedule, big scales) of the persistent compiles: every ``mxfp4_swap`` tile (the
    rows' own: the persistent kernel runs both layers on them) with every schedule the table can
    give it (:func:`._config.schedules_for`); at the prefill tile
    also its schedule with the other work order (static / dynamic), the two-multiply decode and
    layer 2 with the other ``w2_tma`` (TMA loads; layer 1 compiles as without it).
    One compile per kernel specialization (``programs_per_sm`` sizes the grid, no constexpr)."""
    if vendor != "cuda":
        return []
    tiles = list(dict.fromkeys(tiles_for(vendor, "mxfp4_swap", w2=False)))
    out = [(tile, schedule, False) for tile in tiles for schedule in schedules_for(tile)]
    last = tiles[-1]
    default = schedules_for(last)[-1]
    out += [(last, replace(default, dynamic=not default.dynamic), False), (last, default, True)]
    out += [(last, replace(default, w2_tma=not default.w2_tma), False)]  # layer 2 the other way too
    names = {(persistent_name(True, t, s, big=b), persistent_name(False, t, s, big=b)): (t, s, b) for t, s, b in out}
    return list(names.values())


def _persistent_configs(vendor: str) -> list[tuple[str, object, dict, dict]]:
    """One compile per name (layer 1 of a ``w2_tma`` schedule is the schedule without it)."""
    configs = {
        persistent_name(gated, tile, schedule, big=big): (tile, schedule, big, gated)
        for tile, schedule, big in persistent_variants(vendor)
        for gated in (True, False)
    }
    return [
        (name, moe_mx_swap_persistent_kernel, *persistent_signature(gated, tile, schedule, big=big))
        for name, (tile, schedule, big, gated) in configs.items()
    ]


def _small_kernels() -> list[tuple[str, object, dict, dict]]:
    align = {
        "Ids": "*i32",
        "ExpertMap": "*i32",
        "SortedIds": "*i32",
        "TileExpert": "*i32",
        "NumTiles": "*i32",
        "TileSpan": "*i32",
        "WorkCounters": "*i32",
        "num_pairs": "i32",
        "tiles_bound": "i32",
        "HAS_MAP": "constexpr",
        "BLOCK_M": "constexpr",
        "BLOCK_E": "constexpr",
        "BLOCK_P": "constexpr",
    }
    align_c = {"HAS_MAP": True, "BLOCK_M": 16, "BLOCK_E": 128, "BLOCK_P": 1024, "_options": {"num_warps": 4}}
    combine = {
        "Y": "*fp32",
        "Ids": "*i32",
        "ExpertMap": "*i32",
        "Out": "*bf16",
        "H": "i32",
        "stride_ot": "i32",
        "stride_ys": "i32",
        "TOP_K": "constexpr",
        "HAS_MAP": "constexpr",
        "BLOCK_H": "constexpr",
        "SPLITS": "constexpr",
    }
    combine_c = {"TOP_K": 4, "HAS_MAP": True, "BLOCK_H": 1024, "SPLITS": 1, "_options": {"num_warps": 4}}
    topk = {
        "Logits": "*bf16",
        "Weights": "*fp32",
        "Ids": "*i32",
        "num_tokens": "i32",
        "num_experts": "i32",
        "stride_lt": "i32",
        "TOP_K": "constexpr",
        "SIGMOID": "constexpr",
        "RENORMALIZE": "constexpr",
        "BLOCK_T": "constexpr",
        "BLOCK_E": "constexpr",
        "BLOCK_K": "constexpr",
    }
    topk_c = {
        "TOP_K": 4,
        "SIGMOID": False,
        "RENORMALIZE": True,
        "BLOCK_T": 16,
        "BLOCK_E": 128,
        "BLOCK_K": 4,
        "_options": {"num_warps": 2},
    }
    return [
        ("moe_align", align_kernel, align, align_c),
        ("moe_combine", combine_kernel, combine, combine_c),
        ("moe_topk", topk_kernel, topk, topk_c),
        *_ep_kernels(),
    ]


def _ep_kernels() -> list[tuple[str, object, dict, dict]]:
    """The expert-parallel exchange's kernels (``ops/moe/ep.py``) at GPT-OSS's shapes: bf16
    rows of 2880 moved as 720 int64, top-4."""
    route = {"Owner": "*i64", "Ids": "*i32", "SlotsT": "*i64", "RowToken": "*i32", "num_tokens": "i32"}
    route |= {"capacity": "i32", "TOP_K": "constexpr", "BLOCK_T": "constexpr", "BLOCK_K": "constexpr"}
    copy = {"row_elems": "i32", "stride_act": "i32", "stride_meta": "i32"}
    consts = {"TOP_K": 4, "BLOCK_H": 1024, "BLOCK_K": 4, "_options": {"num_warps": 4}}
    pack = {"X": "*i64", "Ids": "*i32", "Weights": "*i32", "RowToken": "*i32", "Act": "*i64", "Meta": "*i32"}
    pack |= {**copy, "pad_id": "i32", "TOP_K": "constexpr", "BLOCK_H": "constexpr", "BLOCK_K": "constexpr"}
    unpack = {"Act": "*i64", "Meta": "*i32", "RecvX": "*i64", "RecvIds": "*i32", "RecvWeights": "*i32", **copy}
    unpack |= {"COPY_ACT": "constexpr", "TOP_K": "constexpr", "BLOCK_H": "constexpr", "BLOCK_K": "constexpr"}
    combine = {"Back": "*bf16", "SlotsT": "*i64", "Out": "*bf16", "num_tokens": "i32", "hidden": "i32"}
    combine |= {"WORLD": "constexpr", "BLOCK_H": "constexpr", "MANUAL_BF16": "constexpr"}
    return [
        ("ep_route", ep_route_kernel, route, {"TOP_K": 4, "BLOCK_T": 1024, "BLOCK_K": 4, "_options": {"num_warps": 4}}),
        ("ep_pack", ep_pack_kernel, pack, consts),
        ("ep_unpack", ep_unpack_kernel, unpack, {**consts, "COPY_ACT": True}),
        *(
            (f"ep_combine_w{world}{'_rne' if manual else ''}", ep_combine_kernel, combine, {
                "WORLD": world, "BLOCK_H": 1024, "MANUAL_BF16": manual, "_options": {"num_warps": 4}
            })
            for world, manual in ((2, False), (4, False), (2, True))
        ),
    ]  # fmt: skip


def _gemm_config(fmt: int, gated: bool, tile: Tile, target: GPUTarget, *, halves: bool):
    sig, consts = gemm_signature(fmt, gated, tile, target)
    consts["MX_HALVES"] = consts["MX_WORDS"] = halves  # the plan's layout, else the standard one
    if fmt == MXFP4 and halves:
        sig["S"] = "*i32"
    layer = "w13" if gated else "w2"
    order = "" if fmt != MXFP4 else "-halves" if halves else "-standard"
    return f"moe_gemm[{layer}-{_FORMAT_NAMES[fmt]}{order}-m{tile.block_m}n{tile.block_n}]", moe_gemm_kernel, sig, consts


def _atomic_config(fmt: int, tile: Tile, target: GPUTarget):
    """The w2 GEMM with the fused (atomic) combine: float32 ``[T, H]`` output."""
    name, fn, sig, consts = _gemm_config(fmt, False, tile, target, halves=False)
    consts["ATOMIC"] = True
    return name.replace("-m", "-atomic-m", 1), fn, sig, consts


def _fp8_act_config(fmt: int, gated: bool, tile: Tile, target: GPUTarget):
    """fp8 x fp8 main loop (``activation_quant="fp8"``): A is float8_e4m3fn with float32 scales."""
    name, fn, sig, consts = _gemm_config(fmt, gated, tile, target, halves=False)
    sig["A"] = "*fp8e4nv"
    consts["A_FP8"] = True
    consts["_attrs"] = {
        **consts["_attrs"],
        **{(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("stride_asm",)},
    }
    return name.replace("-m", "-fp8act-m", 1), fn, sig, consts


def _fp8_quant_configs() -> list[tuple[str, object, dict, dict]]:
    out = []
    for group, has_ids in ((0, False), (0, True), (128, False), (128, True)):
        sig = {
            "X": "*bf16",
            "Q": "*fp8e4nv",
            "S": "*fp32",
            "SortedIds": "*i32",
            "num_pairs": "i32",
            "K": "i32",
            "stride_xm": "i32",
            "stride_qm": "i32",
            "stride_sm": "i32",
            "GROUP": "constexpr",
            "BLOCK": "constexpr",
            "HAS_IDS": "constexpr",
            "INTERPRET": "constexpr",
        }
        consts = {
            "GROUP": group,
            "BLOCK": group or 1024,
            "HAS_IDS": has_ids,
            "INTERPRET": False,
            "_options": {"num_warps": 4},
        }
        out.append((f"moe_fp8_quant[g{group}{'-ids' if has_ids else ''}]", fp8_quant_kernel, sig, consts))
    return out


def configs(target: GPUTarget) -> list[tuple[str, object, dict, dict]]:
    """(name, kernel, signature, constexprs) of every compile for ``target``. ``constexprs``
    carries ``_options`` (warps, stages) and ``_attrs`` (the 16-divisibility the launcher
    sees at real shapes: pointers, sizes and strides; without it nothing is pipelined)."""
    vendor = "rocm" if target.backend == "hip" else "cuda"
    out = []
    dense = tiles_for(vendor, "plain")
    for index, tile in enumerate(dense):
        ends = index in (0, len(dense) - 1)
        for fmt in (PLAIN, FP8_ROW, FP8_BLOCK) if ends else (PLAIN,):
            for gated in (True, False) if ends else (True,):
                out.append(_gemm_config(fmt, gated, tile, target, halves=False))
        if ends:
            out.append(_atomic_config(PLAIN, tile, target))
            for fmt in (FP8_ROW, FP8_BLOCK):
                for gated in (True, False):
                    out.append(_fp8_act_config(fmt, gated, tile, target))
    for index, tile in enumerate(tiles_for(vendor, "mxfp4")):
        for gated in (True, False):
            out.append(_gemm_config(MXFP4, gated, tile, target, halves=True))
            if index == 0:  # the functional path's standard byte order
                out.append(_gemm_config(MXFP4, gated, tile, target, halves=False))
    return (
        out
        + _mx_configs(vendor)
        + _swap_configs(vendor)
        + _persistent_configs(vendor)
        + _small_kernels()
        + _fp8_quant_configs()
    )


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    target: str
    ok: bool
    matrix_instructions: int
    wgmma: bool
    shared_bytes: int
    spills: int
    error: str = ""
    registers: int = 0
    loop: dict = field(default_factory=dict)
    k_loops: list = field(default_factory=list)


# Main-loop SASS opcode classes (prefixes; "LDG" = synchronous global loads, not the cp.async
# LDGSTS / LDGDEPBAR).
_LOOP_CLASSES = ("LDS.U8", "LDS.128", "LDS", "STS", "BAR", "HGMMA", "HMUL2", "PRMT", "LDGSTS", "LDG", "UTMALDG")


def main_loop(sass: str) -> dict:
    """Counts in the longest loop of ``sass`` (the K loop of a one-tile program):
    :func:`loop_counts`."""
    loops = sass_loops(sass)
    return loop_counts(max(loops, key=len) if loops else [])


def mma_loops(sass: str) -> list[dict]:
    """:func:`loop_counts` of each innermost loop of ``sass`` that holds an ``HGMMA`` (the K loops
    of a persistent program, whose longest loop is the one over work items), longest first. A
    branch back into the middle of a loop from code placed after it (an mbarrier wait's retry
    path: TMA loads) is no loop: a span that starts inside another loop and ends past it is left out."""
    spans = sass_loop_spans(sass)
    nested = [body for a, b, body in spans if not any(c < a <= d < b for c, d, _ in spans)]
    loops = [body for body in nested if any("HGMMA" in line for line in body)]
    inner = [body for body in loops if not any(set(other) < set(body) for other in loops)]
    return [loop_counts(body) for body in sorted(inner, key=len, reverse=True)]


def loop_counts(body: list[str]) -> dict:
    """Counts in one loop's disassembly lines: ``instructions``, each class of
    :data:`_LOOP_CLASSES` (an opcode counts in the first class it starts with; ``LDG`` only
    plain global loads) and ``hgmma_register_a`` (wgmma reading its A operand from registers:
    ``HGMMA Rd, Ra, gdesc[...]``, against ``HGMMA Rd, gdesc[...]`` for both from shared)."""
    ops = Counter(SASS_OPCODE.search(line).group(1) for line in body)
    out = {"instructions": len(body)}
    for name in _LOOP_CLASSES:
        out[name] = 0
    for op, n in ops.items():
        cls = next((c for c in _LOOP_CLASSES if op == c or op.startswith(c + ".") or op.startswith(c)), None)
        if cls == "LDG" and op.startswith(("LDGSTS", "LDGDEPBAR")):
            cls = "LDGSTS" if op.startswith("LDGSTS") else None
        if cls == "LDS" and op.startswith(("LDS.U8", "LDS.128")):
            cls = op[:6] if op.startswith("LDS.U8") else "LDS.128"
        if cls:
            out[cls] += n
    out["hgmma_register_a"] = sum(1 for line in body if re.search(r"HGMMA\S*\s+R\d+,\s*R\d+,", line))
    return out


def compile_one(fn, signature: dict, constexprs: dict, target: GPUTarget, name: str) -> CompileResult:
    """Compile one configuration for ``target`` (never loaded: no device here)."""
    label = target_label(target)
    try:
        compiled = compile_config(fn, signature, constexprs, target)
    except Exception as exc:  # report, do not stop the sweep
        return CompileResult(name, label, False, 0, False, 0, 0, f"{type(exc).__name__}: {str(exc)[:300]}")
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    if target.backend == "cuda":
        ptx = compiled.asm.get("ptx", "")
        count = len(re.findall(r"\b(?:mma|wgmma)\.", ptx))
        if not name.startswith("moe_mx_"):
            return CompileResult(
                name, label, True, count, "wgmma." in ptx, shared, int(getattr(compiled, "n_spills", 0) or 0)
            )
        registers, spills = ptxas_stats(ptx)
        sass = disassemble(compiled.asm["cubin"])
        return CompileResult(
            name, label, True, count, "wgmma." in ptx, shared, spills, "", registers, main_loop(sass), mma_loops(sass)
        )
    amdgcn = compiled.asm.get("amdgcn", "")
    return CompileResult(name, label, True, len(re.findall(r"\bv_mfma", amdgcn)), False, shared, amd_spills(amdgcn))


def sweep(targets: list[GPUTarget]) -> list[CompileResult]:
    return [compile_one(fn, sig, consts, t, name) for t in targets for name, fn, sig, consts in configs(t)]


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or ["cuda:90", "hip:gfx942", "hip:gfx950"]
    results = sweep([parse_target(n) for n in names])
    for result in results:
        print(json.dumps(asdict(result)), flush=True)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
