"""Ahead-of-time compilation of the Gluon kernels for sm_90 on a machine without a GPU.

``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_nvidia [decode] [prefill] [prefill_fa3] [moe] [moe_mma] [moe_grouped]``
compiles the configurations the Gluon launchers can choose (decode, the window prefill, the
FA3-style dense prefill, the two layers of the MXFP4 MoE decode on FMAs and on mma.sync, the
warp-specialized layer-2 grouped GEMM prototype; all
when no kind is named) for
``GPUTarget("cuda", 90, 32)`` and prints one JSON line each: whether it built, the counts of
the instructions the design relies on in the PTX (``cp.async`` gathers, ``mma.sync`` and
``wgmma`` tensor-core products, ``cp.async.bulk.tensor`` TMA copies, ``.local`` accesses,
16-byte ``ld.global.v4.b32`` loads and ``cvt.f32.f16`` widenings for the MoE decode; for
warp-specialized kernels the ``setmaxnreg`` register counts, ``wgmma.wait_group 1`` waits
(an MMA left in flight), ``mbarrier.arrive``/``try_wait`` and ``fence.proxy.async`` counts), shared memory, and the registers and spill bytes that Triton's bundled ``ptxas -v`` reports
for ``sm_90a`` (the compiled object carries no register count without a device). Must run
without ``TRITON_INTERPRET`` (the test suite runs it in a subprocess).
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.experimental.gluon._runtime import GluonASTSource

from tokenspeed_kernel_dev.aot_common import SASS_OPCODE, disassemble, ptxas_stats, sass_loops
from tokenspeed_kernel_nvidia.ops.attention._gluon_decode_kernel import decode_kernel
from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_fa3_kernel import prefill_fa3_kernel
from tokenspeed_kernel_nvidia.ops.attention._gluon_prefill_kernel import (
    prefill_window_kernel,
    prefill_window_persistent_kernel,
)
from tokenspeed_kernel_nvidia.ops.attention.gluon_decode import decode_config
from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill import GluonPrefillConfig, prefill_config, window_variants
from tokenspeed_kernel_nvidia.ops.attention.gluon_prefill_fa3 import (
    HALF,
    WIDE,
    Fa3Config,
    fa3_config,
    fa3_window_config,
)
from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_decode as gmoe
from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_mma as gmma
from tokenspeed_kernel_nvidia.ops.moe import gluon_mx_grouped as gmx
from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_decode_kernel import w2_kernel, w13_kernel
from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_mma_kernel import w2_mma_kernel, w13_mma_kernel
from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_mma_tma_kernel import w2_mma_tma_kernel, w13_mma_tma_kernel
from tokenspeed_kernel_nvidia.ops.moe._gluon_mx_grouped_kernel import mx_grouped_w2_kernel

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
    local: int = 0
    ld_v4: int = 0
    ld_l2_256: int = 0
    cvt_f16: int = 0
    atom_acq_rel_gpu: int = 0
    ld_cg: int = 0
    setmaxnreg: list = field(default_factory=list)
    wgmma_wait1: int = 0
    mbar_arrive: int = 0
    mbar_wait: int = 0
    fence_async: int = 0
    sass: dict = field(default_factory=dict)
    error: str = ""


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


SASS_OPS = ("LDG.128", "LDG", "LDS", "STS", "LOP3", "SHF", "HADD2.F32", "F2F", "FFMA", "SHFL", "BAR")


def _sass_counts(text: str) -> dict[str, int]:
    """Static SASS opcode counts of the opcodes in :data:`SASS_OPS` in disassembly ``text``:
    ``LDG.128`` = 16-byte global loads, ``LDG`` = all global loads, ``HADD2.F32`` / ``F2F``
    = the two ways ``cvt.f32.f16`` can be lowered. ``LOOP`` = the instructions of the first
    loop (a label to a backward branch), the main K loop of the MoE decode kernels. ``REGS``
    = one past the highest general register named (under ``setmaxnreg`` a partition may use
    more than the launch count ``ptxas -v`` reports)."""
    ops = Counter(SASS_OPCODE.findall(text))
    out = {}
    for name in SASS_OPS:
        if name == "LDG.128":
            out[name] = sum(n for op, n in ops.items() if op.startswith("LDG") and ".128" in op)
        else:
            out[name] = sum(n for op, n in ops.items() if op == name or op.startswith(name + "."))
    out["LOOP"] = _first_loop_length(text)
    out["REGS"] = max((int(r) for r in re.findall(r"\bR(\d+)\b", text)), default=-1) + 1
    out |= _kv_loop_mix(text)
    return out


KV_LOOP_OPS = ("HGMMA", "MUFU.EX2", "FFMA", "FADD", "FMUL", "FMNMX", "IMAD")


def _kv_loop_mix(text: str) -> dict[str, int]:
    """``KV_<op>``: static counts of :data:`KV_LOOP_OPS` in the first loop that holds both
    ``HGMMA`` and ``MUFU.EX2`` (the key-tile loop of an attention kernel's first consumer:
    its masked path included; empty when there is none). The softmax's split between MUFU
    and the FMA pipe reads off ``KV_MUFU.EX2`` and ``KV_FFMA`` / ``KV_FADD``."""
    for ops in sass_loops(text):
        names = Counter(SASS_OPCODE.search(x).group(1) for x in ops)
        counts = {
            op: sum(n for name, n in names.items() if name == op or name.startswith(op + ".")) for op in KV_LOOP_OPS
        }
        if counts["HGMMA"] and counts["MUFU.EX2"]:
            return {f"KV_{op}": n for op, n in counts.items()} | {"KV_EX2_UNDER_PV": _ex2_under_pv(ops)}
    return {}


def _ex2_under_pv(ops: list[str]) -> int:
    """MUFU.EX2 instructions of a key-tile loop (``ops``, in program order) between the wait
    for the scores (``WARPGROUP.DEPBAR.LE gsb0, 0x1``: the P·V group still in flight) and the
    wait for the P·V group (``gsb0, 0x0``): the exponentials that can overlap the P·V product;
    0 when a wait is missing or the P·V wait comes first."""
    try:
        s_wait = next(i for i, x in enumerate(ops) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in x)
        pv_wait = next(i for i, x in enumerate(ops) if i > s_wait and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in x)
    except StopIteration:
        return 0
    return sum(SASS_OPCODE.search(x).group(1) == "MUFU.EX2" for x in ops[s_wait:pv_wait])


def _first_loop_length(text: str) -> int:
    """Instructions from the first label that a later branch jumps back to, through that
    branch; 0 when there is no loop (the one-instruction self-branch ptxas puts after the
    last ``EXIT`` is not a loop)."""
    return next((len(ops) for ops in sass_loops(text) if len(ops) > 1), 0)


def _attrs(signature: dict[str, str]) -> dict:
    """What the JIT specializes at run time: 16-byte aligned pointers (torch allocations)."""
    names = list(signature)
    return {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}


def compile_decode(
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    group: int,
    splits: int,
    cap: bool,
    fused: bool = False,
    programs: int = 0,
    q_row: int = 0,
):
    """Compile one decode configuration for sm_90 (``fused``: the in-kernel merge, with sinks
    and LSE; ``programs``: the grid size the launcher picks the ring depth by; ``q_row``: a
    row-strided q's row stride in elements, 0 for a contiguous q); returns
    (name, compiled or exception)."""
    cfg = decode_config(head_dim, page_size, programs)
    load, smem, mma = cfg.layouts
    t = _TYPE[dtype]
    signature = {
        "q_ptr": t,
        "k_ptr": t,
        "v_ptr": t,
        "page_table_ptr": "*i32",
        "seqlens_ptr": "*i32",
        "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32",
        "sinks_ptr": "*fp32",
        "out_ptr": t,
        "lse_ptr": "*fp32",
        "count_ptr": "*i32",
        "pt_stride": "i32",
        "k_stride_p": "i32",
        "k_stride_t": "i32",
        "k_stride_h": "i32",
        "v_stride_p": "i32",
        "v_stride_t": "i32",
        "v_stride_h": "i32",
        "sm_scale": "fp32",
        "logit_cap": "fp32",
        "window_left": "i32",
    }
    constexprs = {
        "HQ": 8 * group,
        "HKV": 8,
        "G": group,
        "D": head_dim,
        "PAGE": page_size,
        "SPLITS": splits,
        "BLOCK_N": cfg.block_n,
        "STAGES": cfg.stages,
        "HAS_CAP": cap,
        "LOAD": load,
        "SMEM": smem,
        "MMA": mma,
        "FUSED": fused,
        "HAS_SINKS": fused,
        "HAS_LSE": fused,
        "Q_ROW": q_row or 8 * group * head_dim,
    }
    for name in constexprs:
        signature[name] = "constexpr"
    name = f"gluon_decode-{str(dtype)[6:]}-d{head_dim}-p{page_size}-g{group}-s{splits}{'-cap' if cap else ''}"
    name += ("-fused" if fused else "") + ("" if cfg.stages == 3 else f"-st{cfg.stages}") + _q_tag(q_row)
    src = GluonASTSource(decode_kernel, signature, constexprs, _attrs(signature))
    return name, triton_compile(src, target=SM90, options={"num_warps": cfg.num_warps})


def _q_tag(q_row: int) -> str:
    """The name suffix of a build for a row-strided q (``-qs<row stride>``; none: contiguous)."""
    return f"-qs{q_row}" if q_row else ""


def compile_prefill(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    sinks: bool,
    cap: bool,
    lse: bool,
    cfg: GluonPrefillConfig | None = None,
    q_row: int = 0,
):
    """Compile one window-prefill configuration for sm_90 (``cfg`` defaults to the launcher's
    choice; ``q_row``: a row-strided q's row stride in elements, 0 for a contiguous q);
    returns (name, compiled). K/V arrive as TMA descriptors, typed as the JIT types
    the launcher's ``TensorDescriptor`` (block ``[block_n, D]``, the NVMMA layout)."""
    cfg = cfg or prefill_config(head_dim, group)
    io, q_smem, kv_smem, s_mma, o_mma = cfg.layouts
    t = _TYPE[dtype]
    desc = f"tensordesc<{t[1:]}[{cfg.block_n}, {head_dim}],{kv_smem!r}>"
    signature = {
        "q_ptr": t,
        "o_ptr": t,
        "lse_ptr": "*fp32",
        "sinks_ptr": "*fp32",
        "k_desc": desc,
        "v_desc": desc,
        "cu_q_ptr": "*i32",
        "cu_k_ptr": "*i32",
        "sm_scale": "fp32",
        "logit_cap": "fp32",
        "window_left": "i32",
        **({"q_tiles": "i32", "num_items": "i32"} if cfg.persistent else {}),
    }
    constexprs = {
        "HQ": 8 * group,
        "HKV": 8,
        "G": group,
        "G_PAD": cfg.group_pad,
        "D": head_dim,
        "BLOCK_T": cfg.block_t,
        "BLOCK_N": cfg.block_n,
        "STAGES": cfg.stages,
        "QK_AHEAD": cfg.qk_ahead,
        "HAS_SINKS": sinks,
        "HAS_CAP": cap,
        "HAS_LSE": lse,
        "IO": io,
        "Q_SMEM": q_smem,
        "S_MMA": s_mma,
        "O_MMA": o_mma,
        "Q_ROW": q_row or 8 * group * head_dim,
    }
    kernel = prefill_window_kernel
    if cfg.persistent:  # the persistent build: no Q·Kᵀ-ahead loop
        kernel = prefill_window_persistent_kernel
        del constexprs["QK_AHEAD"]
    for name in constexprs:
        signature[name] = "constexpr"
    flags = "".join(f"-{f}" for f, on in (("sinks", sinks), ("cap", cap), ("lse", lse)) if on)
    name = f"gluon_prefill-{str(dtype)[6:]}-d{head_dim}-g{group}-{cfg.tag}{flags}"
    name += _q_tag(q_row)
    src = GluonASTSource(kernel, signature, constexprs, _attrs(signature))
    options = {"num_warps": cfg.num_warps, **({"maxnreg": cfg.register_cap} if cfg.register_cap else {})}
    return name, triton_compile(src, target=SM90, options=options)


def fa3_signature(dtype: torch.dtype, head_dim: int, q_smem, kv_desc: str) -> dict[str, str]:
    """The leading arguments of both FA3-style kernels (the dense prefill's and the paged
    extend's): the Q descriptor (box ``[64, D]``), the K/V descriptors ``kv_desc``, the
    output, LSE and sink pointers and cu_seqlens_q; the callers append their own."""
    t = _TYPE[dtype]
    return {
        "q_desc": f"tensordesc<{t[1:]}[{HALF}, {head_dim}],{q_smem!r}>",
        "k_desc": kv_desc,
        "v_desc": kv_desc,
        "o_ptr": t,
        "lse_ptr": "*fp32",
        "sinks_ptr": "*fp32",
        "cu_q_ptr": "*i32",
    }


def compile_prefill_fa3(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    sinks: bool,
    lse: bool,
    cfg: Fa3Config | None = None,
    tile_list: bool = False,
):
    """Compile one configuration of the FA3-style dense causal prefill for sm_90 (``cfg``
    defaults to the launcher's choice); returns (name, compiled). Q/K/V arrive as TMA
    descriptors (boxes ``[64, D]`` and ``[block_n, D]``); the launch options are the
    launcher's (4 warps for the default partition, ``maxnreg`` for the register split);
    ``tile_list``: the ragged batch's launch, walking the pre-pass's list (``TILE_LIST``)."""
    cfg = cfg or fa3_config(head_dim)
    q_smem, kv_smem, _, _ = cfg.layouts
    kv_desc = f"tensordesc<{_TYPE[dtype][1:]}[{cfg.block_n}, {head_dim}],{kv_smem!r}>"
    signature = fa3_signature(dtype, head_dim, q_smem, kv_desc) | {
        "cu_k_ptr": "*i32",
        "sm_scale": "fp32",
        "n_m": "i32",
        "batch": "i32",
        "window": "i32",
        "tiles_ptr": "*i32",
    }
    constexprs = {
        "HQ": 8 * group,
        "G": group,
        "D": head_dim,
        "HAS_SINKS": sinks,
        "HAS_LSE": lse,
        **cfg.constexprs(),
        "TILE_LIST": tile_list,
    }
    for name in constexprs:
        signature[name] = "constexpr"
    flags = "".join(f"-{f}" for f, on in (("sinks", sinks), ("lse", lse)) if on)
    name = f"gluon_prefill_fa3-{str(dtype)[6:]}-g{group}-{cfg.tag}{flags}{'-tl' if tile_list else ''}"
    src = GluonASTSource(prefill_fa3_kernel, signature, constexprs, _attrs(signature))
    return name, triton_compile(src, target=SM90, options={"num_warps": 4, "maxnreg": cfg.maxnreg})


def compile_moe(
    layer: int,
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    experts: int,
    top_k: int,
    tokens: int,
    route: bool = False,
    bias: bool = True,
    emap: bool = False,
    activation: str = "swiglu_oai",
):
    """Compile one layer (1: w13 [+ routing], 2: w2 + combine) of the Gluon MXFP4 MoE decode
    with the launcher's configuration for ``tokens``; returns (name, compiled)."""
    cfg = gmoe.decode_config(tokens)
    w3, rl, w4 = cfg.layouts(top_k, experts)
    t = _TYPE.get(dtype, "*fp32")
    flags = "".join(f"-{f}" for f, on in (("route", route), ("bias", bias), ("map", emap)) if on)
    if layer == 1:
        signature = {
            "x_ptr": t,
            "w_ptr": "*i32",
            "s_ptr": "*u8",
            "b_ptr": t,
            "hid_ptr": "*fp32",
            "ids_ptr": "*i32",
            "tw_ptr": "*fp32",
            "emap_ptr": "*i32",
            "logits_ptr": t,
            "stride_xt": "i32",
            "stride_lt": "i32",
            "stride_be": "i32",
        }
        constexprs = {
            "N": inter,
            "KG": hidden // 32,
            "TOP_K": top_k,
            "E": experts,
            "EP": max(32, gmoe.next_pow2(experts)),
            "ROUTE": route,
            "SIGMOID": False,
            "RENORM": True,
            "HAS_MAP": emap,
            "HAS_BIAS": bias,
            "ACTIVATION": gmoe.ACTIVATION_CODES[activation],
            "BN": cfg.block_n1,
            "NW": cfg.warps1,
            "W3": w3,
            "RL": rl,
        }
        kernel, warps = w13_kernel, cfg.warps1
        name = f"gluon_moe_w13-{str(dtype)[6:]}-h{hidden}-i{inter}-e{experts}-k{top_k}-t{tokens}-{activation}{flags}"
    else:
        signature = {
            "hid_ptr": "*fp32",
            "w_ptr": "*i32",
            "s_ptr": "*u8",
            "b_ptr": t,
            "out_ptr": t,
            "ids_ptr": "*i32",
            "tw_ptr": "*fp32",
            "emap_ptr": "*i32",
            "stride_be": "i32",
            "stride_ot": "i32",
        }
        constexprs = {
            "N": hidden,
            "KG": inter // 32,
            "TOP_K": top_k,
            "KP": gmoe.next_pow2(top_k),
            "HAS_MAP": emap,
            "HAS_BIAS": bias,
            "BN2": cfg.block_n2,
            "W4": w4,
        }
        kernel, warps = w2_kernel, cfg.warps2(top_k)
        name = f"gluon_moe_w2-{str(dtype)[6:]}-h{hidden}-i{inter}-k{top_k}-t{tokens}{flags}"
    for key in constexprs:
        signature[key] = "constexpr"
    src = GluonASTSource(kernel, signature, constexprs, _attrs(signature))
    return name, triton_compile(src, target=SM90, options={"num_warps": warps})


def compile_moe_mma(
    layer: int,
    dtype: torch.dtype,
    hidden: int,
    inter: int,
    top_k: int,
    tokens: int,
    bias: bool = True,
    emap: bool = False,
    activation: str = "swiglu_oai",
    cfg: gmma.GluonMoEMMAConfig | None = None,
):
    """Compile one layer of the tensor-core MXFP4 MoE decode (``gluon_moe_mma_sm90``) with
    the launcher's configuration for ``tokens`` (or ``cfg``); returns (name, compiled)."""
    cfg = cfg or gmma.mma_config(tokens)
    l1, xl, l2 = cfg.layouts(top_k)
    t = _TYPE[dtype]
    flags = "".join(f"-{f}" for f, on in (("bias", bias), ("map", emap)) if on)
    flags_cfg = "".join(
        f
        for f, on in (
            ("n", cfg.normalize),
            ("p", cfg.prefetch),
            ("h", cfg.l2_hint),
            (f"t{cfg.stages1}", cfg.tma1),
            (f"T{cfg.stages2}", cfg.tma2),
        )
        if on
    )
    tag = f"{cfg.ks1}.{cfg.u1}.{cfg.ks2}.{cfg.u2}.{cfg.rb2}{flags_cfg}"
    if layer == 1:
        signature = {
            "x_ptr": t,
            "w_ptr": "*i32",
            "s_ptr": "*u8",
            "b_ptr": t,
            "hid_ptr": "*fp16",
            "hs_ptr": "*fp32",
            "ids_ptr": "*i32",
            "emap_ptr": "*i32",
            "stride_xt": "i32",
            "stride_be": "i32",
        }
        constexprs = {
            "N": inter,
            "KG": hidden // 32,
            "TOP_K": top_k,
            "HAS_MAP": emap,
            "HAS_BIAS": bias,
            "ACTIVATION": gmoe.ACTIVATION_CODES[activation],
            "X_F16": dtype == torch.float16,
            "KS": cfg.ks1,
            "U": cfg.u1,
            "L": l1,
            "XL": xl,
            "HP": cfg.row_pad(hidden),
            "NORMALIZE": cfg.normalize,
            "PREFETCH": cfg.prefetch,
            "L2_HINT": cfg.l2_hint,
        }
        kernel, warps = w13_mma_kernel, cfg.ks1
        if cfg.tma1:  # the TMA-staged layer 1: a descriptor instead of the word pointer
            box, box_layout = gmma.tma_box(cfg)
            del signature["w_ptr"], constexprs["L"], constexprs["PREFETCH"], constexprs["L2_HINT"]
            signature = {"x_ptr": t, "w_desc": f"tensordesc<i32[{box[0]}, {box[1]}],{box_layout!r}>", **signature}
            constexprs["STAGES"] = cfg.stages1
            kernel = w13_mma_tma_kernel
        name = f"gluon_moe_mma_w13-{str(dtype)[6:]}-h{hidden}-i{inter}-k{top_k}-c{tag}-{activation}{flags}"
    else:
        signature = {
            "hid_ptr": "*fp16",
            "hs_ptr": "*fp32",
            "w_ptr": "*i32",
            "s_ptr": "*u8",
            "b_ptr": "*fp32",
            "out_ptr": t,
            "ids_ptr": "*i32",
            "tw_ptr": "*fp32",
            "emap_ptr": "*i32",
            "stride_be": "i32",
            "stride_ot": "i32",
        }
        constexprs = {
            "N": hidden,
            "KG": inter // 32,
            "TOP_K": top_k,
            "KP": gmma.next_pow2(top_k),
            "KS": cfg.ks2,
            "U": cfg.u2,
            "R": cfg.rb2,
            "HAS_MAP": emap,
            "HAS_BIAS": bias,
            "L": l2,
            "NORMALIZE": cfg.normalize,
            "PREFETCH": cfg.prefetch,
            "L2_HINT": cfg.l2_hint,
        }
        kernel, warps = w2_mma_kernel, gmma.next_pow2(top_k) * cfg.ks2
        if cfg.tma2:  # the TMA-staged layer 2: a descriptor instead of the word pointer
            box, box_layout = gmma.tma_box(cfg, 2)
            del signature["w_ptr"], constexprs["L"], constexprs["PREFETCH"], constexprs["L2_HINT"], constexprs["R"]
            desc = f"tensordesc<i32[{box[0]}, {box[1]}],{box_layout!r}>"
            signature = {"hid_ptr": "*fp16", "hs_ptr": "*fp32", "w_desc": desc, **signature}
            constexprs["STAGES"] = cfg.stages2
            kernel = w2_mma_tma_kernel
        name = f"gluon_moe_mma_w2-{str(dtype)[6:]}-h{hidden}-i{inter}-k{top_k}-c{tag}{flags}"
    for key in constexprs:
        signature[key] = "constexpr"
    src = GluonASTSource(kernel, signature, constexprs, _attrs(signature))
    return name, triton_compile(src, target=SM90, options={"num_warps": warps})


def moe_mma_grid():
    """Both layers of the tensor-core decode at GPT-OSS-120B shapes (bf16 and fp16 x), a
    tiny shape with top-3 (a padded choice warp), an expert map, no bias, silu; the
    normalized decode and two 16-row blocks per layer-2 warp; the TMA-staged layers (T = 8's
    shipped configuration stages layer 1 in 2 stages)."""
    gpt = (torch.bfloat16, 2880, 2880, 4, 1)
    variants = (
        gmma.GluonMoEMMAConfig(),  # not pipelined: the loop-count budget of the AOT test
        gmma.GluonMoEMMAConfig(normalize=True),
        gmma.GluonMoEMMAConfig(ks2=4, rb2=2),
        gmma.GluonMoEMMAConfig(prefetch=True),
        gmma.GluonMoEMMAConfig(ks2=2, prefetch=True, l2_hint=True),
        gmma.GluonMoEMMAConfig(ks2=4, prefetch=True, l2_hint=True, tma1=True),  # layer 1 by TMA, 4 stages
        gmma.GluonMoEMMAConfig(ks2=4, prefetch=True, l2_hint=True, tma1=True, tma2=True),  # both (layer 2: opt-in)
    )
    rows = []
    for layer in (1, 2):
        rows += [
            (layer, *gpt),
            (layer, torch.float16, 2880, 2880, 4, 8),
            (layer, torch.bfloat16, 64, 96, 3, 5, False, True, "silu"),
        ]
        rows += [(layer, *gpt, True, False, "swiglu_oai", cfg) for cfg in variants]
    return rows


def compile_moe_grouped(big_scales: bool = False, cfg: gmx.GroupedW2Config | None = None):
    """Compile the warp-specialized layer-2 grouped GEMM prototype (``gluon_mx_grouped``, not
    registered) for sm_90 with the launcher's descriptors and options; returns (name, compiled)."""
    cfg = cfg or gmx.GroupedW2Config()
    x_l, w_l, s_l = gmx.shared_layouts()
    signature = {
        "x_desc": f"tensordesc<bf16[128, 128],{x_l!r}>",
        "w_desc": f"tensordesc<i32[128, 16],{w_l!r}>",
        "s_desc": f"tensordesc<i32[1, 128],{s_l!r}>",
        "out_ptr": "*fp32",
        "ids_ptr": "*i32",
        "tile_expert_ptr": "*i32",
        "num_tiles_ptr": "*i32",
        "num_pairs": "i32",
        "N": "i32",
        "steps": "i32",
    }
    constexprs = cfg.constexprs(big_scales)
    for key in constexprs:
        signature[key] = "constexpr"
    name = f"gluon_mx_grouped_w2-{cfg.tag}{'-big' if big_scales else ''}"
    src = GluonASTSource(mx_grouped_w2_kernel, signature, constexprs, _attrs(signature))
    return name, triton_compile(src, target=SM90, options={"num_warps": 4, "maxnreg": cfg.maxnreg})


def moe_grouped_grid():
    """The prototype's default build, the two-multiply decode (scales above 2), no ping-pong,
    and a 5-deep ring."""
    return [
        (False,),
        (True,),
        (False, gmx.GroupedW2Config(pingpong=False)),
        (False, gmx.GroupedW2Config(stages=5)),
    ]


def moe_grid():
    """Both layers at GPT-OSS-120B shapes (E 128, top-4, H = I = 2880) for every token bucket
    (routing fused and precomputed, expert map, no bias, the other activations, fp16), and a
    tiny shape (H = I = 64, E 8, top-2)."""
    gpt = (torch.bfloat16, 2880, 2880, 128, 4)
    rows = []
    for layer in (1, 2):
        rows += [(layer, *gpt, t, layer == 1) for t in (1, 2, 4, 8)]
        rows += [
            (layer, *gpt, 1, False, True, True),
            (layer, *gpt, 8, False, False, False),
            (layer, torch.float16, 64, 64, 8, 2, 1, False),
            (layer, torch.float32, 64, 96, 8, 2, 2, layer == 1, True, True),
        ]
    rows += [(1, *gpt, 1, True, True, False, act) for act in ("silu", "gelu")]
    return rows


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
    ] + [
        (torch.bfloat16, 64, 16, 8, 8, True),
        (torch.bfloat16, 64, 16, 8, 32, False, True),
        (torch.float16, 128, 1, 4, 1, True, True),
        (torch.bfloat16, 64, 16, 8, 1, False, True, 512),  # the 2-stage ring of B=64
        # a row-strided q (a fused qkv's q: rows of (Hq + 2 Hkv) D values; strided_q), against
        # the first row and the fused D 128 one
        (torch.bfloat16, 64, 16, 8, 8, False, False, 0, (64 + 16) * 64),
        (torch.float16, 128, 1, 4, 1, True, True, 0, (32 + 16) * 128),
    ]  # fmt: skip


def prefill_grid():
    """Every launcher configuration (D 64/128, G 8/4/16/1 and a padded 6, fp16) and each
    feature branch (sinks, cap, lse), plus the alternatives the device script times
    (``window_variants``), the persistent build on the feature branches and a row-strided q."""
    p6 = replace(prefill_config(64, 8), persistent=6)  # under the shipped 80-register cap
    return [
        (torch.bfloat16, 64, 8, True, False, False, None),
        (torch.bfloat16, 64, 8, False, False, False, None),
        (torch.bfloat16, 64, 4, True, True, True, None),
        (torch.float16, 64, 16, False, False, True, None),
        (torch.bfloat16, 64, 6, True, False, False, None),
        (torch.bfloat16, 64, 1, False, False, False, None),
        (torch.bfloat16, 128, 8, True, False, True, None),
        (torch.bfloat16, 128, 4, True, True, True, None),
        *((torch.bfloat16, 64, 8, True, False, False, cfg) for cfg in window_variants(64, 8)),
        # the persistent build (window_variants' second and third) on the other feature branches: no
        # sinks, cap + LSE with G 4, G 1, a padded G 6, G 8 with sinks (these under the shipped
        # 80-register cap) and its row-strided q, D 128 (one program per SM)
        (torch.bfloat16, 64, 8, False, False, False, p6),
        (torch.bfloat16, 64, 4, True, True, True, replace(prefill_config(64, 4), persistent=6)),
        (torch.bfloat16, 64, 1, False, False, False, replace(prefill_config(64, 1), persistent=5)),
        (torch.bfloat16, 64, 6, True, False, False, replace(prefill_config(64, 6), persistent=6)),
        (torch.bfloat16, 64, 8, True, False, False, p6),
        (torch.bfloat16, 64, 8, True, False, False, p6, (64 + 16) * 64),
        (torch.bfloat16, 128, 8, True, False, True, replace(prefill_config(128, 8), persistent=1)),
        # a row-strided q (a fused qkv's q: rows of (Hq + 2 Hkv) D values; strided_q), against
        # the first row and the D 128 one
        (torch.bfloat16, 64, 8, True, False, False, None, (64 + 16) * 64),
        (torch.bfloat16, 128, 8, True, False, True, None, (64 + 16) * 128),
    ]


def prefill_fa3_grid():
    """The launcher's configurations (D 64: three consumer warpgroups since 2026-11-28; D 128:
    two) with sinks on and off, LSE, fp16, GQA 8 and 1, the D 64 two-consumer build, plus the
    alternatives the device sweep times (D = 64 with 2 stages, 64-key tiles,
    no ping-pong hand-off; the variants: exp2 partly on FMA, three consumer warpgroups, the
    lazy rescale, alone and together; the P·V wait after the softmax, alone and with the others;
    the shipped D 64 build without V cleaning, ``--clean-ab``'s reference), then the
    sliding-window build's."""
    wide = Fa3Config(64, stages=3, **WIDE)
    return [
        (torch.bfloat16, 64, 8, True, False, None),
        (torch.bfloat16, 64, 8, False, False, None),
        (torch.bfloat16, 64, 8, True, True, None),
        (torch.float16, 64, 1, False, True, None),
        (torch.bfloat16, 128, 8, True, False, None),
        (torch.bfloat16, 128, 8, False, True, None),
        (torch.float16, 128, 4, True, True, None),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, block_n=128, stages=2)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, block_n=64, stages=4)),
        (torch.bfloat16, 128, 8, True, False, Fa3Config(128, block_n=64, stages=3)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, block_n=128, stages=3, pingpong=False)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, stages=3, exp2_poly=1)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, stages=3, exp2_poly=2)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, stages=3, rescale_threshold=8.0)),
        # D 64's two-consumer build (shipped until 2026-11-28; None above is now the wide one)
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, stages=3)),
        (torch.float16, 64, 1, False, True, Fa3Config(64, stages=3)),
        (torch.bfloat16, 64, 8, True, False, replace(wide, exp2_poly=2)),
        (torch.bfloat16, 64, 8, True, True, replace(wide, exp2_poly=2, rescale_threshold=8.0)),
        (torch.bfloat16, 128, 8, True, False, Fa3Config(128, exp2_poly=1)),
        # D 128 with every rescale eager (shipped until 2026-11-28; None above now rescales lazily)
        (torch.bfloat16, 128, 8, True, False, Fa3Config(128)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, stages=3, pv_overlap=True)),
        (torch.float16, 64, 1, False, True, Fa3Config(64, stages=3, pv_overlap=True, exp2_poly=1)),
        (torch.bfloat16, 64, 8, True, True, replace(wide, pv_overlap=True)),
        (torch.bfloat16, 128, 8, True, False, Fa3Config(128, pv_overlap=True)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, stages=3, pv_overlap=True, rescale_threshold=8.0)),
        # the shipped D 64 build walking a ragged batch's tile list (TILE_LIST)
        (torch.bfloat16, 64, 8, True, False, None, True),
        # fa3_sweep.py --clean-ab's reference: the shipped D 64 build without the V cleaning
        (torch.bfloat16, 64, 8, True, False, replace(fa3_config(64), clean_v=False)),
        # the sliding-window build (gluon_prefill_fa3_window_sm90): its launcher's configurations
        # and the alternatives the device sweep times (128-key tiles, pv_overlap)
        (torch.bfloat16, 64, 8, True, False, fa3_window_config(64)),
        (torch.bfloat16, 64, 8, False, True, fa3_window_config(64)),
        (torch.float16, 64, 1, True, True, fa3_window_config(64)),
        (torch.bfloat16, 128, 8, True, False, fa3_window_config(128)),
        (torch.bfloat16, 64, 8, True, False, Fa3Config(64, block_n=128, stages=3, window=True)),
        (torch.bfloat16, 64, 8, True, False, replace(fa3_window_config(64), pv_overlap=True)),
    ]


_BUILDERS = {
    "decode": (compile_decode, decode_grid),
    "prefill": (compile_prefill, prefill_grid),
    "prefill_fa3": (compile_prefill_fa3, prefill_fa3_grid),
    "moe": (compile_moe, moe_grid),
    "moe_mma": (compile_moe_mma, moe_mma_grid),
    "moe_grouped": (compile_moe_grouped, moe_grouped_grid),
}


def run(kinds: tuple[str, ...] = ("decode", "prefill", "prefill_fa3", "moe", "moe_mma")) -> list[CompileResult]:
    results = []
    for kind in kinds:
        build, configs = _BUILDERS[kind]
        for params in configs():
            name = "?"
            try:
                name, compiled = build(*params)
                ptx = compiled.asm.get("ptx", "")
                registers, spills = ptxas_stats(ptx)
                results.append(
                    CompileResult(
                        kernel=name,
                        ok=True,
                        cp_async=_count(r"\bcp\.async\.(?:ca|cg)\.shared", ptx),
                        mma=_count(r"\bmma\.sync\.aligned", ptx),
                        wgmma=_count(r"\bwgmma\.mma_async", ptx),
                        tma=_count(r"\bcp\.async\.bulk\.tensor", ptx),
                        shared_bytes=int(getattr(compiled.metadata, "shared", 0)),
                        registers=registers,
                        spills=spills,
                        local=_count(r"\.local\b", ptx),
                        ld_v4=_count(r"\bld\.global(?:\.\w+)*\.v4\.b32", ptx),
                        ld_l2_256=_count(r"\bld\.global(?:\.\w+)*\.L2::256B", ptx),
                        cvt_f16=_count(r"\bcvt\.f32\.f16\b", ptx),
                        atom_acq_rel_gpu=_count(r"\batom\.global\.gpu\.acq_rel\.", ptx),
                        ld_cg=_count(r"\bld\.global\.cg\b", ptx),
                        setmaxnreg=sorted(
                            {int(n) for n in re.findall(r"\bsetmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
                        ),
                        wgmma_wait1=_count(r"\bwgmma\.wait_group\.sync\.aligned 1;", ptx),
                        mbar_arrive=_count(r"\bmbarrier\.arrive\.", ptx),
                        mbar_wait=_count(r"\bmbarrier\.try_wait\.", ptx),
                        fence_async=_count(r"\bfence\.proxy\.async\b", ptx),
                        sass=_sass_counts(disassemble(compiled.asm["cubin"])) if "cubin" in compiled.asm else {},
                    )
                )
            except Exception as exc:  # report every configuration, not only the first failure
                results.append(
                    CompileResult(f"{name}:{params}", False, 0, 0, 0, 0, 0, 0, 0, error=f"{type(exc).__name__}: {exc}")
                )
    return results


def main(argv: list[str] | None = None) -> int:
    kinds = tuple(argv or ()) or tuple(_BUILDERS)
    unknown = set(kinds) - set(_BUILDERS)
    if unknown:
        print(f"unknown kind(s) {sorted(unknown)}; expected {sorted(_BUILDERS)}", file=sys.stderr)
        return 2
    results = run(kinds)
    for r in results:
        print(json.dumps(asdict(r)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
