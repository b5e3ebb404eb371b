"""What the two Gluon MXFP4 MoE decode kernels (FMA and mma.sync) share: their registration
facts and predicate, MXFP4 weights as int32 words, the routing
tensors of a ``moe_apply`` call."""

from __future__ import annotations

import torch

from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Predicate, Request

VENDORS = ("cuda",)
FEATURES = ("silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4")
MAX_TOKENS = 8
MAX_TOP_K = 8


def words(w: MXFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed bytes as int32 words (a view; 8 E2M1 codes each, low nibble first) and the
    E8M0 scales, both contiguous."""
    packed = w.packed if w.packed.is_contiguous() else w.packed.contiguous()
    scales = w.scales if w.scales.is_contiguous() else w.scales.contiguous()
    return packed.view(torch.int32), scales


def mxfp4_routing(args: MoEApplyArgs, kernel: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(topk_ids int32, topk_weights float32)``, contiguous, of an MXFP4 ``moe_apply`` call
    (None when it has no tokens); a TypeError naming ``kernel`` for other weight formats."""
    if not isinstance(args.w13, MXFP4Weight) or not isinstance(args.w2, MXFP4Weight):
        raise TypeError(f"{kernel} takes MXFP4 weights only")
    if args.topk_ids.shape[0] == 0:
        return None
    ids = args.topk_ids if args.topk_ids.is_contiguous() else args.topk_ids.contiguous()
    tw = args.topk_weights if args.topk_weights.is_contiguous() else args.topk_weights.contiguous()
    return ids, tw


def decode_predicate(decode: str) -> Predicate:
    """The predicate of a T <= 8 MXFP4 decode kernel (``decode`` says how it decodes E2M1, for
    the MXFP4 reason): MXFP4 weights, ``num_tokens_bucket <= 8`` (the next power of two >= T,
    so ``bucket <= 8`` iff ``T <= 8``; a plan has no bucket), ``top_k <= 8``."""

    def predicate(request: Request) -> str | None:
        if "mxfp4" not in request.features:
            return f"MXFP4 weights only ({decode})"
        bucket = request.shape("num_tokens_bucket")
        if bucket is not None and bucket > MAX_TOKENS:
            return f"num_tokens_bucket={bucket} > {MAX_TOKENS}: the Gluon MoE decode serves T <= {MAX_TOKENS} tokens"
        top_k = request.shape("top_k")
        if top_k is not None and top_k > MAX_TOP_K:
            return f"top_k={top_k} > {MAX_TOP_K}: layer 2 gives each choice its own warps"
        return None

    return predicate
