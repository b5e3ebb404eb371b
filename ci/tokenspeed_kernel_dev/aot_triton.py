"""Ahead-of-time compilation of the Triton kernels for GPUs this machine does not have.

``PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton [--full] [cuda:90 hip:gfx942 hip:gfx950 ...]`` compiles
the attention kernel for the configurations the launch heuristics can choose (regimes, head
dims, dtypes incl. fp8 KV, page sizes, GQA groups, features) plus the split combine and the
KV store, and prints one JSON line per compile: whether it built, whether the matrix
instructions are there (``mma``/``wgmma`` in PTX, ``v_mfma`` in AMDGCN), shared memory,
registers and spills (AMDGCN: VGPR + SGPR spill counts, and scratch bytes). Each target
compiles the tile rows of its vendor (``cuda`` -> ``_launch.CUDA_TILES``, ``hip`` ->
``_launch.ROCM_TILES``).

``python -m tokenspeed_kernel_dev.aot_triton --tiles hip:gfx942 hip:gfx950`` is the candidate
sweep behind the ROCm rows: for every table key it compiles candidate tiles, largest first,
over the grid's configurations of that key, prints spills and LDS per candidate and stops at
the first one that compiles with zero spills and fits LDS on every target given.

Must run without ``TRITON_INTERPRET`` (the interpreter replaces the
kernels); the test suite runs it in a subprocess.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from dataclasses import asdict, astuple, dataclass

import torch
from triton.backends.compiler import GPUTarget

from tokenspeed_kernel_dev.aot_common import amd_spills, compile_config, parse_target, target_label
from tokenspeed_kernel_triton.ops.attention._kernel import attention_kernel, combine_kernel
from tokenspeed_kernel_triton.ops.attention._launch import VENDOR_TILES, Tile, kernel_config, tile_key
from tokenspeed_kernel_triton.ops.kvcache.store import _store_rows

_TYPE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.float8_e4m3fn: "*fp8e4nv"}
_AMD_FP8 = {"gfx942": "*fp8e4b8"}  # CDNA3 has the fnuz fp8; CDNA4 the OCP e4m3
_VENDOR = {"cuda": "cuda", "hip": "rocm"}  # GPUTarget.backend -> the tile table's vendor
SHARED_LIMIT = {"cuda:90": 227 * 1024, "hip:gfx942": 64 * 1024, "hip:gfx950": 160 * 1024}


@dataclass(frozen=True)
class AttentionConfig:
    regime: str  # "prefill" | "extend" | "decode"
    dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    group: int
    page_size: int | None
    splits: int = 1
    q_len: int = 1
    features: tuple[str, ...] = ("sinks", "window", "lse")

    @property
    def key(self) -> str:
        """The ``_launch`` tile-table key this configuration uses."""
        return tile_key("decode" if self.regime == "decode" else "prefill", self.head_dim, "window" in self.features)

    @property
    def name(self) -> str:
        kv = "fp8" if self.kv_dtype == torch.float8_e4m3fn else str(self.kv_dtype)[6:]
        return (
            f"{self.regime}-{str(self.dtype)[6:]}-kv_{kv}-d{self.head_dim}-g{self.group}-p{self.page_size}"
            f"-s{self.splits}-q{self.q_len}-{'+'.join(self.features) or 'plain'}"
        )


def attention_configs(full: bool = False) -> list[AttentionConfig]:
    """The configurations the launch heuristics can choose, kept to distinct compiles.

    The default grid covers every key of the ``_launch`` tile table (prefill, narrow-window
    prefill, decode, each at head dims 64, 128 (96) and 256), every operand dtype class (bf16, fp16, fp8 KV with
    scales), padded head dims, page sizes 1/16/256, split-KV, speculative q_len and every
    feature branch (causal/non-causal, window, sinks, cap, lse) at least once per target, in
    a dozen compiles (what CI runs). ``full=True`` adds the cross product of head dims, GQA
    groups, dtypes and page sizes (``python -m tokenspeed_kernel_dev.aot_triton --full``).
    """
    bf16, fp16, fp8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
    configs = [
        AttentionConfig("prefill", bf16, bf16, 64, 8, None),  # narrow-window tile
        AttentionConfig("prefill", bf16, bf16, 64, 8, None, features=("sinks",)),  # full-attention tile
        AttentionConfig("prefill", fp16, fp16, 128, 1, None, features=("noncausal", "cap", "lse")),
        AttentionConfig("prefill", bf16, bf16, 256, 8, None, features=("sinks", "lse")),
        AttentionConfig("prefill", bf16, bf16, 256, 8, None, features=("window",)),  # narrow window, d256
        AttentionConfig("prefill", fp16, fp16, 96, 4, None),  # padded head dim, padded group
        AttentionConfig("extend", bf16, fp8, 64, 8, 16),
        AttentionConfig("extend", bf16, bf16, 128, 8, 1, features=("cap",)),
        AttentionConfig("decode", bf16, bf16, 64, 8, 16, splits=8),
        AttentionConfig("decode", fp16, fp8, 128, 8, 256, q_len=4, features=("sinks", "lse")),
        AttentionConfig("decode", bf16, bf16, 256, 8, 16),
    ]
    if not full:
        return configs
    for dtype, head_dim, group in itertools.product((bf16, fp16), (64, 128, 256, 80), (8, 1)):
        configs.append(AttentionConfig("prefill", dtype, dtype, head_dim, group, None))
    for head_dim, page in ((64, 16), (128, 1), (64, 256)):
        configs.append(AttentionConfig("extend", bf16, bf16, head_dim, 8, page))
        configs.append(AttentionConfig("extend", bf16, fp8, head_dim, 8, page))
    for (kv, splits, q_len), head_dim in itertools.product(
        ((bf16, 1, 1), (bf16, 8, 1), (fp8, 1, 1), (bf16, 1, 4)),
        (64, 128, 256),
    ):
        configs.append(AttentionConfig("decode", bf16, kv, head_dim, 8, 16, splits, q_len))
    return configs


def _signature(cfg: AttentionConfig, target: GPUTarget, tile: Tile | None = None) -> tuple[dict, dict]:
    num_q_heads = 8 * cfg.group
    consts = kernel_config(
        q_dtype=cfg.dtype,
        num_q_heads=num_q_heads,
        num_kv_heads=8,
        head_dim=cfg.head_dim,
        head_dim_v=cfg.head_dim,
        max_q=cfg.q_len if cfg.regime == "decode" else 4096,
        page_size=cfg.page_size,
        uniform_q=cfg.regime == "decode",
        causal="noncausal" not in cfg.features,
        window="window" in cfg.features,
        narrow_window="window" in cfg.features,
        sinks="sinks" in cfg.features,
        cap="cap" in cfg.features,
        scales=cfg.kv_dtype == torch.float8_e4m3fn,
        lse="lse" in cfg.features,
        splits=cfg.splits,
        regime="decode" if cfg.regime == "decode" else "prefill",
        vendor=_VENDOR[target.backend],
        tile=tile,
    )
    constexprs = {**consts.constexprs, "INTERPRET": False}
    q_type = _TYPE[cfg.dtype]
    kv_type = _TYPE[cfg.kv_dtype]
    if cfg.kv_dtype == torch.float8_e4m3fn and target.backend == "hip":
        kv_type = _AMD_FP8.get(str(target.arch), kv_type)
    pointers = {
        "Q": q_type,
        "K": kv_type,
        "V": kv_type,
        "Out": q_type,
        "Lse": "*fp32",
        "PartOut": "*fp32",
        "PartLse": "*fp32",
        "Sinks": "*fp32",
        "KScale": "*fp32",
        "VScale": "*fp32",
        "PageTable": "*i32",
        "CuSeqlensQ": "*i32",
        "CuSeqlensK": "*i32",
        "CacheSeqlens": "*i32",
    }
    scalars = {name: "i32" for name in attention_kernel.arg_names[14:27]}
    scalars |= {"sm_scale": "fp32", "logit_cap": "fp32", "window_left": "i32"}
    signature = {name: pointers.get(name) or scalars.get(name) or "constexpr" for name in attention_kernel.arg_names}
    return signature, constexprs | {"_options": {"num_warps": consts.num_warps, "num_stages": consts.num_stages}}


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    target: str
    ok: bool
    matrix_instructions: int
    wgmma: int
    shared_bytes: int
    registers: int
    spills: int
    scratch_bytes: int = 0
    tile: str = ""  # the tile-table key (attention only)
    error: str = ""


def _inspect(compiled, target: GPUTarget) -> tuple[int, int, int]:
    asm = compiled.asm
    if target.backend == "cuda":
        ptx = asm.get("ptx", "")
        count = len(re.findall(r"\b(?:mma|wgmma)\.", ptx))
        return count, getattr(compiled.metadata, "shared", 0), getattr(compiled, "n_regs", 0) or 0
    amdgcn = asm.get("amdgcn", "")
    count = len(re.findall(r"\bv_mfma", amdgcn))
    vgprs = re.search(r"\.vgpr_count:\s*(\d+)", amdgcn)
    return count, getattr(compiled.metadata, "shared", 0), int(vgprs.group(1)) if vgprs else 0


def _spills(compiled, target: GPUTarget) -> tuple[int, int]:
    """(spilled registers, scratch bytes). AMDGCN: the ``.vgpr_spill_count`` +
    ``.sgpr_spill_count`` of the kernel metadata and its ``.private_segment_fixed_size``.
    CUDA: not known without loading the cubin (ptxas reports it then), so 0 here."""
    if target.backend == "cuda":
        return int(getattr(compiled, "n_spills", 0) or 0), 0
    amdgcn = compiled.asm.get("amdgcn", "")
    scratch = re.search(r"\.private_segment_fixed_size:\s*(\d+)", amdgcn)
    return amd_spills(amdgcn), int(scratch.group(1)) if scratch else 0


def compile_one(fn, signature: dict, constexprs: dict, target: GPUTarget, name: str, tile: str = "") -> CompileResult:
    label = target_label(target)
    try:
        compiled = compile_config(fn, signature, constexprs, target)
        compiled._init_handles = lambda: None  # never load: no device here
        count, shared, regs = _inspect(compiled, target)
        wgmma = len(re.findall(r"\bwgmma\.mma_async", compiled.asm.get("ptx", "")))
        spills, scratch = _spills(compiled, target)
        return CompileResult(name, label, True, count, wgmma, shared, regs, spills, scratch, tile)
    except Exception as exc:  # report, do not stop the sweep
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
        return CompileResult(name, label, False, 0, 0, 0, 0, 0, 0, tile, error)


def _combine_signature() -> tuple[dict, dict]:
    signature = {
        "PartOut": "*fp32",
        "PartLse": "*fp32",
        "Out": "*bf16",
        "Lse": "*fp32",
        "Sinks": "*fp32",
        "VScale": "*fp32",
        "stride_ot": "i32",
        "stride_oh": "i32",
        "num_q_heads": "i32",
    }
    consts = {
        "NUM_SPLITS": 8,
        "SPLITS_PAD": 8,
        "HEAD_DIM_V": 64,
        "BLOCK_DV": 64,
        "HAS_SINKS": True,
        "HAS_SCALES": True,
        "WRITE_LSE": True,
        "_options": {"num_warps": 1},
    }
    signature |= {k: "constexpr" for k in consts if k != "_options"}
    return signature, consts


def _store_signature(fp8: bool, target: GPUTarget) -> tuple[dict, dict]:
    cache = "*fp8e4nv" if fp8 else "*bf16"
    if fp8 and target.backend == "hip":
        cache = _AMD_FP8.get(str(target.arch), cache)
    signature = {
        "K": "*bf16",
        "V": "*bf16",
        "KCache": cache,
        "VCache": cache,
        "Slots": "*i64",
        "KScale": "*fp32",
        "VScale": "*fp32",
        "stride_kt": "i32",
        "stride_kh": "i32",
        "stride_vt": "i32",
        "stride_vh": "i32",
        "stride_kcp": "i32",
        "stride_kct": "i32",
        "stride_kch": "i32",
        "stride_vcp": "i32",
        "stride_vct": "i32",
        "stride_vch": "i32",
        "num_heads": "i32",
    }
    consts = {
        "PAGE_SIZE": 16,
        "DIM_K": 64,
        "DIM_V": 64,
        "BLOCK_H": 8,
        "BLOCK_D": 64,
        "FP8": fp8,
        "INTERPRET": False,
        "_options": {"num_warps": 1},
    }
    signature |= {k: "constexpr" for k in consts if k != "_options"}
    return signature, consts


def sweep(targets: list[GPUTarget], full: bool = False) -> list[CompileResult]:
    results = []
    for target in targets:
        for cfg in attention_configs(full):
            signature, consts = _signature(cfg, target)
            results.append(compile_one(attention_kernel, signature, consts, target, f"attention[{cfg.name}]", cfg.key))
        signature, consts = _combine_signature()
        results.append(compile_one(combine_kernel, signature, consts, target, "combine"))
        for fp8 in (False, True):
            signature, consts = _store_signature(fp8, target)
            results.append(compile_one(_store_rows, signature, consts, target, f"store[{'fp8' if fp8 else 'bf16'}]"))
    return results


# Candidate tiles of the ROCm sweep, largest first: (rows, block_n) by area, then rows; for
# each size 4 warps before 8; always 2 stages (1 stage compiled to the same VGPR and spill
# counts as 2 in a first probe of the prefill tiles, gfx942/gfx950). Decode rows are q_len x G_PAD (not the
# tile's): only block_n, warps and stages vary there.
_PREFILL_SIZES = ((128, 64), (128, 32), (64, 64), (64, 32), (32, 64), (32, 32), (16, 32), (16, 16))
_DECODE_SIZES = ((16, 64), (16, 32), (16, 16))


def tile_candidates(key: str) -> list[Tile]:
    sizes = _DECODE_SIZES if key.startswith("decode") else _PREFILL_SIZES
    return [Tile(r, n, w, s) for r, n in sizes for s in (2,) for w in (4, 8)]


def tile_sweep(targets: list[GPUTarget], keys: list[str] | None = None) -> dict[str, Tile | None]:
    """For each tile key, the first candidate (largest first) whose compiles for every target
    over the grid's configurations of that key have zero spills, no scratch and fit LDS.
    Prints one line per candidate and target: worst VGPRs, spills, scratch and LDS bytes."""
    by_key: dict[str, list[AttentionConfig]] = {}
    for cfg in attention_configs():
        by_key.setdefault(cfg.key, []).append(cfg)
    chosen = {}
    for key in keys or list(VENDOR_TILES["rocm"] or by_key):
        chosen[key] = None
        for tile in tile_candidates(key):
            fits = True
            notes = []
            for target in targets:
                label = f"{target.backend}:{target.arch}"
                rows = []
                for cfg in by_key[key]:
                    signature, consts = _signature(cfg, target, tile)
                    rows.append(compile_one(attention_kernel, signature, consts, target, cfg.name, key))
                worst = {
                    "ok": all(r.ok for r in rows),
                    "vgprs": max(r.registers for r in rows),
                    "spills": max(r.spills for r in rows),
                    "scratch": max(r.scratch_bytes for r in rows),
                    "lds": max(r.shared_bytes for r in rows),
                }
                fits &= worst["ok"] and not worst["spills"] and not worst["scratch"]
                fits &= worst["lds"] <= SHARED_LIMIT[label]
                notes.append(f"{label} " + " ".join(f"{k}={v}" for k, v in worst.items()))
                if not fits:
                    break
            print(f"{key:20s} {astuple(tile)} {'FITS' if fits else 'no  '} | " + " | ".join(notes), flush=True)
            if fits:
                chosen[key] = tile
                break
    return chosen


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    full = "--full" in args
    if "--tiles" in args:
        names = [a for a in args if a.startswith(("cuda:", "hip:"))] or ["hip:gfx942", "hip:gfx950"]
        keys = [a for a in args if not a.startswith(("cuda:", "hip:", "--"))] or None
        chosen = tile_sweep([parse_target(n) for n in names], keys)
        print(json.dumps({k: astuple(v) if v else None for k, v in chosen.items()}))
        return 0 if all(chosen.values()) else 1
    names = [a for a in args if a != "--full"] or ["cuda:90", "hip:gfx942", "hip:gfx950"]
    results = sweep([parse_target(n) for n in names], full=full)
    for result in results:
        print(json.dumps(asdict(result)))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
