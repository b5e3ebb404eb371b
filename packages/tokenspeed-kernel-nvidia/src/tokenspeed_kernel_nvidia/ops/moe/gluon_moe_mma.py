"""Gluon MXFP4 MoE decode on the tensor cores (``moe.apply``, sm_90 only, T <= 8).

The kernels are in :mod:`._gluon_moe_mma_kernel` (fragments, k order, fp16 operands, split
K). Same contract and the same two launches as :mod:`.gluon_moe_decode`; the difference is
the inner product: ``mma.sync`` m16n8k16 on E2M1 codes decoded to fp16 in registers,
instead of float32 FMAs (25 instructions per 4-byte word in the layer-1 loop instead of 39).

**Numerics.** Products of the E2M1 value and the fp16 activation are exact and summed in
float32 by the tensor core; the E8M0 scale is applied per 32-value group after the MMA.
The activation is rounded to fp16 after a per-token power-of-two rescale (bf16 x; fp16 x is
used as it is), and the intermediate is stored in fp16 with a power of two per 32 columns:
each operand keeps 11 significant bits (bf16 has 8; the FMA kernel keeps a float32
intermediate). float32 x is not served (it would lose 13 bits): the FMA kernel serves it.

**Status.** ``Priority.PERFORMANT + 10``, above ``gluon_moe_decode_mx_sm90`` (which
still serves float32 x): on an H100 (2026-11-23, docs/history.md, MoE decode §7) it
matched float64 as closely as the FMA kernel (rel. err 1.70e-3 vs 1.69e-3 at GPT-OSS-120B
shapes, the bf16 output rounding) and was 1.11-1.19x faster at T = 1..8 (41.4 µs at T = 1,
202.2 µs at T = 8, routing included); staging layer 1's weights through a TMA ring
(:mod:`._gluon_moe_mma_tma_kernel`) took T = 4 and 8 a further 5-6% (111.3 and 190.0 µs,
MoE decode §8). ``normalize`` changed no result there: Hopper's tensor cores take fp16
subnormal inputs. At T = 1 both layers are latency-bound at ~11
warps per SM (Nsight Compute: issue slots 35-40% busy, DRAM 35-50%), not issue-bound.

**Workspace.** ``hid`` fp16 ``[T * top_k, I]`` and ``hs`` float32 ``[T * top_k, I / 32]``,
persistent per shape (stable addresses for CUDA-graph replay).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenspeed_kernel.kit import ACTIVATION_CODES, cdiv, next_pow2
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Priority, register_kernel
from tokenspeed_kernel_nvidia._workspace import workspace
from tokenspeed_kernel_nvidia.ops.moe._common import (
    FEATURES,
    MAX_TOKENS,
    VENDORS,
    decode_predicate,
    mxfp4_routing,
    words,
)
from tokenspeed_kernel_triton._launcher import Launch

__all__ = [
    "FEATURES",
    "GluonMoEMMAConfig",
    "bind_moe_mma",
    "gluon_moe_mma",
    "grids",
    "launch",
    "launches",
    "mma_config",
    "predicate",
]

ACT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GluonMoEMMAConfig:
    """Launch configuration. Layer 1: ``ks1`` warps split the K groups of one program's
    32 intermediate columns (16 gate + 16 up rows per MMA block, two blocks), ``u1`` groups
    per warp per step. Layer 2: ``ks2`` warps per choice split the K groups of ``16 * rb2``
    output rows (``next_pow2(top_k) * ks2`` warps, ``rb2`` 16-row blocks per warp sharing
    each intermediate load), ``u2`` groups per warp per step. ``normalize``:
    multiply the decoded weights by ``2**14`` in fp16 before the MMA (4 ``HMUL2`` per word), so
    the tensor cores see only normal fp16 (for hardware that flushes subnormal MMA inputs;
    without it, codes +-0.5 reach the MMA as fp16 subnormals). ``prefetch``: software-pipeline
    both K loops (the next step's loads issued before this step's MMAs; more registers).
    ``l2_hint``: the weight loads of full K steps carry L2's 256-byte fetch hint (a miss
    also brings the next steps' bytes of the row into L2). ``tma1``: layer 1 stages its
    weight words through a ``stages1``-deep TMA ring in shared memory
    (:mod:`._gluon_moe_mma_tma_kernel`; needs ``ks1 * u1 <= 8``, ignores ``prefetch`` and
    ``l2_hint`` for layer 1). ``tma2``: layer 2 likewise, one box per live choice and step
    (needs ``rb2 == 1`` and ``ks2 * u2 <= 8``). Both match float64 on an H100 (2026-11-23);
    ``tma1`` with 2 stages ships at T = 4 and 8, ``tma2`` was 1.3-2x slower everywhere and
    ships nowhere. An impossible TMA configuration is a ValueError here, at construction."""

    ks1: int = 4
    u1: int = 2
    ks2: int = 2
    u2: int = 2
    rb2: int = 1
    normalize: bool = False
    prefetch: bool = False
    l2_hint: bool = False
    tma1: bool = False
    stages1: int = 4
    tma2: bool = False
    stages2: int = 4

    def __post_init__(self) -> None:
        if self.tma1 and (self.ks1 * self.u1 > 8 or self.stages1 < 1):
            raise ValueError(
                f"tma1 needs ks1 * u1 <= 8 (a TMA box row of at most 128 bytes) and stages1 >= 1; got ks1={self.ks1}, "
                f"u1={self.u1}, stages1={self.stages1}"
            )
        if self.tma2 and (self.rb2 != 1 or self.ks2 * self.u2 > 8 or self.stages2 < 1):
            raise ValueError(
                f"tma2 needs rb2 == 1, ks2 * u2 <= 8 and stages2 >= 1; got rb2={self.rb2}, ks2={self.ks2}, "
                f"u2={self.u2}, stages2={self.stages2}"
            )

    def row_pad(self, hidden: int) -> int:
        """Length of layer 1's activation-row tile: a power of two >= ``hidden`` and >= the
        1-D layout's 8 values x 32 lanes x ``ks1`` warps."""
        return max(next_pow2(hidden), 256 * self.ks1)

    def layouts(self, top_k: int):
        """(L1, XL, L2): layer 1's ``[ks1, u1, 2, 8, 4]`` fragment layout (lanes = the MMA's
        ``(g, c)``), the 1-D activation-row layout of its bf16 prologue, layer 2's
        ``[next_pow2(top_k) * ks2, u2, 1, 8, 4]`` layout."""
        return _layouts(self, top_k)


@functools.cache
def _layouts(cfg: GluonMoEMMAConfig, top_k: int):
    from triton.experimental.gluon import language as gl

    l1 = gl.BlockedLayout([1, cfg.u1, 2, 1, 1], [1, 1, 1, 8, 4], [cfg.ks1, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    xl = gl.BlockedLayout([8], [32], [cfg.ks1], [0])
    l2 = gl.BlockedLayout(
        [1, cfg.u2, 1, 1, 1], [1, 1, 1, 8, 4], [next_pow2(top_k) * cfg.ks2, 1, 1, 1, 1], [4, 3, 2, 1, 0]
    )
    return l1, xl, l2


# From the H100 sweeps of 2026-11-23 (docs/history.md, gluon_moe_bench.py --mma-sweep):
# both register loops software-pipelined with the L2 256-byte hint; layer 2 splits K over 4
# warps per choice at T = 1 and 4, over 2 at T = 2 and 8. At T = 4 and 8 layer 1 stages its
# weights through a 2-deep TMA ring (layer 1 9-10% faster, the layer 5-6%); at T = 1 and 2,
# where one wave holds every program, the ring's shared-memory round trip costs 1-7%.
CONFIGS: dict[int, GluonMoEMMAConfig] = {
    1: GluonMoEMMAConfig(ks2=4, prefetch=True, l2_hint=True),
    2: GluonMoEMMAConfig(ks2=2, prefetch=True, l2_hint=True),
    4: GluonMoEMMAConfig(ks2=4, prefetch=True, l2_hint=True, tma1=True, stages1=2),
    8: GluonMoEMMAConfig(ks2=2, prefetch=True, l2_hint=True, tma1=True, stages1=2),
}


def mma_config(num_tokens: int) -> GluonMoEMMAConfig:
    """The configuration for ``num_tokens`` (its power-of-two bucket, capped at 8)."""
    return CONFIGS[min(next_pow2(max(num_tokens, 1)), MAX_TOKENS)]


def grids(
    num_tokens: int, top_k: int, hidden: int, inter: int, cfg: GluonMoEMMAConfig
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(layer-1 grid, layer-2 grid): ``(T * top_k, I / 32)`` and ``(cdiv(H, 16 * rb2), T)``."""
    return (num_tokens * top_k, inter // 32), (cdiv(hidden, 16 * cfg.rb2), num_tokens)


predicate = decode_predicate("E2M1 decoded to fp16 for mma.sync")


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride along H, 4-byte aligned rows (the kernel reads int32 pairs)."""
    if x.stride(1) != 1 or x.stride(0) % 2 or x.data_ptr() % 4:
        return x.clone(memory_format=torch.contiguous_format)  # a fresh, aligned allocation
    return x


def tma_box(cfg: GluonMoEMMAConfig, layer: int = 1) -> tuple[list[int], object]:
    """(box shape, shared layout) of a layer's TMA copies: ``[32 rows, 4 * ks1 * u1 words]``
    (layer 1) or ``[16 rows, 4 * ks2 * u2 words]`` (layer 2) of int32, swizzled by the box
    row's bytes (128 for ``ks * u = 8``)."""
    from triton.experimental.gluon import language as gl

    rows, width = (32, 4 * cfg.ks1 * cfg.u1) if layer == 1 else (16, 4 * cfg.ks2 * cfg.u2)
    return [rows, width], gl.NVMMASharedLayout(swizzle_byte_width=min(128, 4 * width), element_bitwidth=32, rank=2)


def _descriptor(packed: torch.Tensor, cfg: GluonMoEMMAConfig, layer: int):
    """A TMA descriptor over a layer's int32 words ``[E, rows, K/8]`` (from :func:`words`)
    viewed as ``[E * rows, K/8]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    flat = packed.view(-1, packed.shape[-1])
    box, layout = tma_box(cfg, layer)
    return TensorDescriptor(flat, list(flat.shape), [flat.shape[1], 1], box, layout)


def launches(
    x, w13, w2, b13, b2, emap, out, ids, tw, top_k, activation, cfg: GluonMoEMMAConfig | None = None
) -> tuple[Launch, Launch]:
    """The two launches of :func:`launch` (same arguments), as data. Argument positions that
    change between calls of a plan: layer 1 ``x`` 0, ``ids`` 6; layer 2 ``out`` 5, ``ids``
    6, ``tw`` 7 (x rows must be 4-byte aligned: :func:`launch` copies them if not)."""
    from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_mma_kernel import w2_mma_kernel, w13_mma_kernel

    num_tokens, hidden = x.shape
    inter = w2.shape[-1]
    chosen = cfg is None
    cfg = cfg or mma_config(num_tokens)
    # The kernels read whole row blocks without row masks: MXFP4 makes I and H multiples of
    # 32 (the K of w2 and w13); a layer-2 block of 16 * rb2 rows must divide H as well.
    if inter % 32 or hidden % (16 * cfg.rb2):
        raise ValueError(
            f"gluon_moe_mma_sm90 needs I % 32 == 0 and H % {16 * cfg.rb2} == 0 (rb2={cfg.rb2}); got I={inter}, H={hidden}"
        )
    p13, s13 = words(w13)
    p2, s2 = words(w2)
    for on, name, p in ((cfg.tma1, "w13", p13), (cfg.tma2, "w2", p2)):
        if on and p.data_ptr() % 16:
            if not chosen:  # the caller asked for TMA: say why it cannot run
                raise ValueError(f"a TMA-staged layer needs {name}'s packed words 16-byte aligned; got an offset view")
            cfg = dataclasses.replace(cfg, tma1=False, tma2=False)  # CONFIGS' pick: the register layers serve it
    g1, g2 = grids(num_tokens, top_k, hidden, inter, cfg)
    l1, xl, l2 = cfg.layouts(top_k)
    hid = workspace(x.device, "mma_hid", (num_tokens * top_k, inter), torch.float16)
    hs = workspace(x.device, "mma_hs", (num_tokens * top_k, inter // 32), torch.float32)
    # What the register and the TMA-staged kernel of each layer share (arguments after the
    # weight words or their descriptor, and constexprs). Absent bias and map: a placeholder
    # pointer the kernel never reads (one that stays put between calls).
    rest1 = (
        s13,
        s13 if b13 is None else b13,
        hid,
        hs,
        ids,
        hs if emap is None else emap,
        x.stride(0),
        0 if b13 is None else b13.stride(0),
    )
    meta1 = dict(
        N=inter,
        KG=hidden // 32,
        TOP_K=top_k,
        HAS_MAP=emap is not None,
        HAS_BIAS=b13 is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        X_F16=x.dtype == torch.float16,
        KS=cfg.ks1,
        U=cfg.u1,
        XL=xl,
        HP=cfg.row_pad(hidden),
        NORMALIZE=cfg.normalize,
        num_warps=cfg.ks1,
    )
    rest2 = (
        s2,
        s2 if b2 is None else b2,
        out,
        ids,
        tw,
        hs if emap is None else emap,
        0 if b2 is None else b2.stride(0),
        out.stride(0),
    )
    meta2 = dict(
        N=hidden,
        KG=inter // 32,
        TOP_K=top_k,
        KP=next_pow2(top_k),
        KS=cfg.ks2,
        U=cfg.u2,
        HAS_MAP=emap is not None,
        HAS_BIAS=b2 is not None,
        NORMALIZE=cfg.normalize,
        num_warps=next_pow2(top_k) * cfg.ks2,
    )
    if cfg.tma1:
        from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_mma_tma_kernel import w13_mma_tma_kernel

        first = Launch(w13_mma_tma_kernel, g1, (x, _descriptor(p13, cfg, 1), *rest1), dict(STAGES=cfg.stages1, **meta1))
    else:
        first = Launch(
            w13_mma_kernel, g1, (x, p13, *rest1), dict(L=l1, PREFETCH=cfg.prefetch, L2_HINT=cfg.l2_hint, **meta1)
        )
    if cfg.tma2:
        from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_mma_tma_kernel import w2_mma_tma_kernel

        second = Launch(
            w2_mma_tma_kernel, g2, (hid, hs, _descriptor(p2, cfg, 2), *rest2), dict(STAGES=cfg.stages2, **meta2)
        )
    else:
        second = Launch(
            w2_mma_kernel,
            g2,
            (hid, hs, p2, *rest2),
            dict(R=cfg.rb2, L=l2, PREFETCH=cfg.prefetch, L2_HINT=cfg.l2_hint, **meta2),
        )
    return first, second


def launch(
    x,
    w13,
    w2,
    b13,
    b2,
    emap,
    out,
    ids,
    tw,
    top_k,
    activation,
    cfg: GluonMoEMMAConfig | None = None,
    layers: tuple[int, ...] = (1, 2),
) -> None:
    """Both layers on ``x [T, H]`` (bf16/fp16), MXFP4 ``w13 [E, 2I, H]``, ``w2 [E, H, I]``,
    routing ``ids`` int32 / ``tw`` float32 ``[T, top_k]`` (contiguous), into ``out [T, H]``.
    ``layers`` (benchmarking only): launch just these layers (layer 2 alone reads the
    intermediate the last layer-1 launch of this shape left in the workspace). ``cfg``
    defaults to :func:`mma_config`; where its TMA-staged layer cannot read the weights
    (packed words not 16-byte aligned, e.g. an offset view) the register layers run instead,
    while an explicit ``cfg`` asking for TMA raises a ValueError."""
    first, second = launches(_aligned_rows(x), w13, w2, b13, b2, emap, out, ids, tw, top_k, activation, cfg)
    if 1 in layers:
        first()
    if 2 in layers:
        second()


def bind_moe_mma(args: MoEApplyArgs) -> Callable[[MoEApplyArgs], None] | None:
    """The ``bind`` hook (``MoEPlan``): both launches of this token count keyed once (the TMA
    descriptors built once); a call launches with its x, routing and out. None (``fn``
    serves, raising its own error) for weights other than MXFP4."""
    routing = mxfp4_routing(args, "gluon_moe_mma_sm90") if isinstance(args.w13, MXFP4Weight) else None
    if routing is None:
        return None
    ids, tw = routing
    x = _aligned_rows(args.x)
    first, second = launches(
        x,
        args.w13,
        args.w2,
        args.w13_bias,
        args.w2_bias,
        args.expert_map,
        args.out,
        ids,
        tw,
        ids.shape[1],
        args.activation,
    )
    layer1, layer2 = first.bound(0, 6), second.bound(5, 6, 7)

    def run(a: MoEApplyArgs) -> None:
        layer1(_aligned_rows(a.x), a.topk_ids)
        layer2(a.out, a.topk_ids, a.topk_weights)

    return run


@register_kernel(
    "moe.apply",
    name="gluon_moe_mma_sm90",
    solution="gluon",
    vendors=VENDORS,
    archs=("sm_90",),
    dtypes={"x": ACT_DTYPES, "weight": (torch.uint8,)},
    features=FEATURES,
    priority=Priority.PERFORMANT + 10,
    predicate=predicate,
    bind=bind_moe_mma,
)
def gluon_moe_mma(args: MoEApplyArgs) -> None:
    """MXFP4 MoE for T <= 8 on Hopper with mma.sync dots: two Gluon launches (w13 + bias +
    activation; w2 + bias + routing weight + combine), precomputed routing."""
    routing = mxfp4_routing(args, "gluon_moe_mma_sm90")
    if routing is None:
        return
    ids, tw = routing
    top_k = ids.shape[1]
    launch(
        args.x,
        args.w13,
        args.w2,
        args.w13_bias,
        args.w2_bias,
        args.expert_map,
        args.out,
        ids,
        tw,
        top_k,
        args.activation,
    )
