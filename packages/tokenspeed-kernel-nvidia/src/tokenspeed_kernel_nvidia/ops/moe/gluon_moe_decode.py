"""Gluon MXFP4 MoE decode for tiny batches (``moe.apply``, sm_90 only, T <= 8).

See :mod:`._gluon_moe_decode_kernel` for the two kernels. At ``T <= 8`` tokens every
(token, expert) pair is a matrix-vector product bound by the weight bytes (GPT-OSS-120B,
T = 1, top-4: about 53 MB of packed weights and scales), so there are no tensor cores, no
permutation and no host sync: **two launches** (layer 1: gate/up GEMV + bias + activation;
layer 2: down GEMV + bias + routing weight + the combine, in registers), every grid a
function of ``T``, ``top_k``, ``H``, ``I``: CUDA-graph capturable.

**Routing: where it is fused, and where not.** The public ``moe_apply`` receives
``topk_weights``/``topk_ids`` already computed (``moe_topk`` is a separate operator), so the
registered kernel, :func:`gluon_moe_decode_mx`, reads them; routing is *not* fused there.
The fused form the issue asks for is the internal entry :func:`moe_decode_from_logits`
(not registered; no public operator takes router logits and weights together): layer 1
computes each token's softmax (or sigmoid) over the ``E`` router logits, the top-k (ties to
the lower id, descending weight, as ``moe_topk`` defines it) and the renormalization in
every program (the row is replicated per warp, so the reductions are warp shuffles), and
writes the chosen ids/weights to a small workspace that layer 2 reads (and that the
function returns). ``ci/device/gluon_moe_bench.py`` times it end to end from the logits.

**Decode.** Weights are read in the public layout (``packed [E, N, K/2]``, low nibble = even
k), viewed as int32 words: each lane owns one 32-value MX group = 16 contiguous bytes (one
``ld.global.v4.b32``) and its E8M0 scale; a word (8 codes) becomes 8 float32 values through
a short PTX sequence (fp16 bit patterns ``e2m1 * 2**-14`` by shift/mask, ``cvt.f32.f16``),
multiplied with the float32 activation and summed in-thread; the group sum is scaled once.

**Gating.** ``Priority.PERFORMANT``: on an H100 (2026-11-23) its GPU tests pass (36/36) and it
is the fastest MXFP4 MoE we have at T <= 8: T = 1 50.7 µs vs ``triton_moe_gemv_mx`` 79.2 and
``triton_fused_moe_mx`` 86.1, T = 8 243 vs 350 and 384 (routing included, same run;
docs/history.md). The predicate rejects non-MXFP4 weights and ``num_tokens_bucket > 8``;
``moe_plan`` selects per token bucket, so a plan runs it for ``T <= 8`` only. Called with more
tokens (an ``override``) it still runs correctly (each grid grows with T), only without the
GEMV's advantage. ``top_k <= 8`` (layer 2 puts the choices on separate warps, at most 8 of
them), ``E <= 1024`` for the fused routing. The launch configurations (:data:`CONFIGS`) are
the best of a 13-configuration sweep at T = 1, 2, 4, 8 (``ci/device/moe_decode_sweep.py``).
"""

from __future__ import annotations

import functools
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
    MAX_TOP_K,
    VENDORS,
    decode_predicate,
    mxfp4_routing,
    words,
)
from tokenspeed_kernel_triton._launcher import jit_launch

__all__ = [
    "CONFIGS",
    "FEATURES",
    "MAX_TOKENS",
    "MAX_TOP_K",
    "GluonMoEDecodeConfig",
    "decode_config",
    "gluon_moe_decode_mx",
    "grids",
    "moe_decode_from_logits",
    "predicate",
]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROUTED_EXPERTS = 1024


@dataclass(frozen=True)
class GluonMoEDecodeConfig:
    """One pair of launch configurations.

    Layer 1: ``rows1`` gate rows (and as many up rows) per thread, ``warps1`` warps along
    rows: ``BN = rows1 * warps1`` columns of the intermediate per program. Layer 2:
    ``rows2`` rows of w2 per thread and choice, ``row_warps2`` warps along rows times
    ``next_pow2(top_k)`` warps along the choices: ``BN2 = rows2 * row_warps2`` outputs."""

    rows1: int = 4
    warps1: int = 4
    rows2: int = 4
    row_warps2: int = 1

    @property
    def block_n1(self) -> int:
        return self.rows1 * self.warps1

    @property
    def block_n2(self) -> int:
        return self.rows2 * self.row_warps2

    def warps2(self, top_k: int) -> int:
        return next_pow2(top_k) * self.row_warps2

    def layouts(self, top_k: int, num_experts: int):
        """(W3, RL, W4): layer 1's ``[BN, 32, 4]`` int32 weight tile (16-byte vectors per lane,
        lanes along the MX groups, warps along rows), the routing tile ``[warps1, EP]`` (one
        copy of the logits row per warp), layer 2's ``[KP, BN2, 32, 4]`` tile (choices on
        warps)."""
        return _layouts(self, top_k, num_experts)


@functools.cache
def _layouts(cfg: GluonMoEDecodeConfig, top_k: int, num_experts: int):
    from triton.experimental.gluon import language as gl

    ep = max(32, next_pow2(num_experts))
    w3 = gl.BlockedLayout([1, 1, 4], [1, 32, 1], [cfg.warps1, 1, 1], [2, 1, 0])
    rl = gl.BlockedLayout([1, ep // 32], [1, 32], [cfg.warps1, 1], [1, 0])
    w4 = gl.BlockedLayout([1, 1, 1, 4], [1, 1, 32, 1], [next_pow2(top_k), cfg.row_warps2, 1, 1], [3, 2, 1, 0])
    return w3, rl, w4


# Per token-count bucket (1, 2, 4, 8): a thread keeps 8 (layer 1) or 4-8 x top-k (layer 2)
# 16-byte weight loads in flight per K step. Swept on an H100 (13 configurations, 2026-11-23,
# ci/device/moe_decode_sweep.py): this one was the best at every T (by 0.4-1.2% over rows2=4 at T = 1, 2); halving
# the rows per thread costs 30-50%, doubling them 40-75%.
CONFIGS: dict[int, GluonMoEDecodeConfig] = {
    1: GluonMoEDecodeConfig(rows1=4, warps1=4, rows2=8, row_warps2=1),
    2: GluonMoEDecodeConfig(rows1=4, warps1=4, rows2=8, row_warps2=1),
    4: GluonMoEDecodeConfig(rows1=4, warps1=4, rows2=8, row_warps2=1),
    8: GluonMoEDecodeConfig(rows1=4, warps1=4, rows2=8, row_warps2=1),
}


def decode_config(num_tokens: int) -> GluonMoEDecodeConfig:
    """The configuration for ``num_tokens`` (its power-of-two bucket, capped at 8)."""
    return CONFIGS[min(next_pow2(max(num_tokens, 1)), MAX_TOKENS)]


def grids(num_tokens: int, top_k: int, hidden: int, inter: int, cfg: GluonMoEDecodeConfig):
    """(layer-1 grid, layer-2 grid): ``(T * top_k, cdiv(I, BN))`` and ``(cdiv(H, BN2), T)``."""
    return (num_tokens * top_k, cdiv(inter, cfg.block_n1)), (cdiv(hidden, cfg.block_n2), num_tokens)


predicate = decode_predicate("in-register E2M1 GEMV decode")


def _launch(
    x, w13, w2, b13, b2, emap, out, ids, tw, logits, top_k, activation, *, route=False, sigmoid=False, renorm=True
) -> None:
    from tokenspeed_kernel_nvidia.ops.moe._gluon_moe_decode_kernel import w2_kernel, w13_kernel

    num_tokens, hidden = x.shape
    inter = w2.shape[-1]
    num_experts = logits.shape[1] if route else 1
    cfg = decode_config(num_tokens)
    g1, g2 = grids(num_tokens, top_k, hidden, inter, cfg)
    w3, rl, w4 = cfg.layouts(top_k, num_experts)
    p13, s13 = words(w13)
    p2, s2 = words(w2)
    hid = workspace(x.device, "hid", (num_tokens * top_k, inter), torch.float32)
    jit_launch(
        w13_kernel,
        g1,
        x,
        p13,
        s13,
        x if b13 is None else b13,
        hid,
        ids,
        tw,
        ids if emap is None else emap,
        logits if route else x,
        x.stride(0),
        logits.stride(0) if route else 0,
        0 if b13 is None else b13.stride(0),
        N=inter,
        KG=hidden // 32,
        TOP_K=top_k,
        E=num_experts,
        EP=max(32, next_pow2(num_experts)),
        ROUTE=route,
        SIGMOID=sigmoid,
        RENORM=renorm,
        HAS_MAP=emap is not None,
        HAS_BIAS=b13 is not None,
        ACTIVATION=ACTIVATION_CODES[activation],
        BN=cfg.block_n1,
        NW=cfg.warps1,
        W3=w3,
        RL=rl,
        num_warps=cfg.warps1,
    )
    jit_launch(
        w2_kernel,
        g2,
        hid,
        p2,
        s2,
        x if b2 is None else b2,
        out,
        ids,
        tw,
        ids if emap is None else emap,
        0 if b2 is None else b2.stride(0),
        out.stride(0),
        N=hidden,
        KG=inter // 32,
        TOP_K=top_k,
        KP=next_pow2(top_k),
        HAS_MAP=emap is not None,
        HAS_BIAS=b2 is not None,
        BN2=cfg.block_n2,
        W4=w4,
        num_warps=cfg.warps2(top_k),
    )


@register_kernel(
    "moe.apply",
    name="gluon_moe_decode_mx_sm90",
    solution="gluon",
    vendors=VENDORS,
    archs=("sm_90",),
    dtypes={"x": ACT_DTYPES, "weight": (torch.uint8,)},
    features=FEATURES,
    priority=Priority.PERFORMANT,
    predicate=predicate,
)
def gluon_moe_decode_mx(args: MoEApplyArgs) -> None:
    """MXFP4 MoE for T <= 8 on Hopper: two Gluon GEMV launches (w13 + bias + activation;
    w2 + bias + routing weight + combine), precomputed routing (see the module docstring)."""
    routing = mxfp4_routing(args, "gluon_moe_decode_mx_sm90")
    if routing is None:
        return
    ids, tw = routing
    top_k = ids.shape[1]
    _launch(
        args.x,
        args.w13,
        args.w2,
        args.w13_bias,
        args.w2_bias,
        args.expert_map,
        args.out,
        ids,
        tw,
        None,
        top_k,
        args.activation,
    )


def moe_decode_from_logits(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: MXFP4Weight,
    w2: MXFP4Weight,
    top_k: int,
    *,
    activation: str = "swiglu_oai",
    scoring: str = "softmax",
    renormalize: bool = True,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Routing + experts + combine from the router logits in the same two launches.

    ``moe_topk(router_logits, top_k, scoring=..., renormalize=...)`` followed by
    ``moe_apply(x, w13, w2, weights, ids, ...)``, with the top-k computed inside layer 1.
    Internal (not a registered operator; no host checks beyond shapes): returns
    ``(out [T, H], topk_weights float32 [T, k], topk_ids int32 [T, k])``; the two routing
    tensors are a persistent workspace, overwritten by the next call of the same shape."""
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    num_tokens, num_experts = router_logits.shape
    if num_experts > MAX_ROUTED_EXPERTS or not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        raise ValueError(f"fused routing needs E <= {MAX_ROUTED_EXPERTS} and 1 <= top_k <= {MAX_TOP_K}")
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    out = torch.empty_like(x) if out is None else out
    ids = workspace(x.device, "ids", (num_tokens, top_k), torch.int32)
    tw = workspace(x.device, "tw", (num_tokens, top_k), torch.float32)
    if num_tokens:
        _launch(
            x,
            w13,
            w2,
            w13_bias,
            w2_bias,
            expert_map,
            out,
            ids,
            tw,
            router_logits,
            top_k,
            activation,
            route=True,
            sigmoid=scoring == "sigmoid",
            renorm=renormalize,
        )
    return out, tw, ids
