"""Random MXFP4 MoE problems on the GPU for the Gluon MoE decode tests and the Triton MXFP4
kernels' GPU numerics."""

import torch

from tokenspeed_kernel.quant import MXFP4Weight, quantize_mxfp4


def mx_stack(w: torch.Tensor) -> MXFP4Weight:
    """``[E, N, K]`` float weights -> one MXFP4Weight (each expert quantized on its own)."""
    parts = [quantize_mxfp4(p) for p in w]
    return MXFP4Weight(torch.stack([p.packed for p in parts]), torch.stack([p.scales for p in parts]))


def moe_problem(t, e, h, i, dtype=torch.bfloat16, seed=0, x_scale=1.0):
    """(x ``[t, h]`` in ``dtype`` (times ``x_scale``), w13 ``[e, 2i, h]`` and w2 ``[e, h, i]`` as
    MXFP4, w13 bias in ``dtype``, a float32 w2 bias, router logits ``[t, e]``), seeded."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (x_scale * torch.randn(t, h, generator=gen, device="cuda")).to(dtype)
    w13 = mx_stack(torch.randn(e, 2 * i, h, generator=gen, device="cuda") / h**0.5)
    w2 = mx_stack(torch.randn(e, h, i, generator=gen, device="cuda") / i**0.5)
    b13 = (0.5 * torch.randn(e, 2 * i, generator=gen, device="cuda")).to(dtype)
    b2 = 0.5 * torch.randn(e, h, generator=gen, device="cuda")  # float32 bias
    logits = 2 * torch.randn(t, e, generator=gen, device="cuda")
    return x, w13, w2, b13, b2, logits


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of ``out`` against the float64 ``ref``."""
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-12))


def awkward_gpu_inputs(
    tokens: int,
    experts: int,
    hot: int,
    activation: str,
    bias: bool,
    with_map: bool,
    seed: int,
    hidden: int = 576,
    inter: int = 416,
    weights: str = "mxfp4",
):
    """Awkward GPU-sized inputs: H = ``hidden`` (576) and I = ``inter`` (416; multiples of 32,
    not of 128: masked K tails), routing concentrated on ``hot`` experts (ragged loads, empty
    experts), top-4; ``weights`` ``"mxfp4"`` or ``"bf16"`` (in x's dtype)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    top_k = 4
    num_local = experts // 2 if with_map else experts
    make = quantize_mxfp4 if weights == "mxfp4" else torch.Tensor.bfloat16
    w13 = make(torch.randn(num_local, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5)
    w2 = make(torch.randn(num_local, hidden, inter, device="cuda", generator=gen) / inter**0.5)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    logits[:, :hot] += 6.0
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    expert_map = None
    if with_map:  # the odd experts are remote (-1), the even ones local in reversed order
        expert_map = torch.full((experts,), -1, dtype=torch.int32, device="cuda")
        expert_map[0::2] = torch.arange(num_local - 1, -1, -1, dtype=torch.int32, device="cuda")
    return {
        "x": torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16(),
        "w13": w13,
        "w2": w2,
        "topk_weights": (weights / weights.sum(-1, keepdim=True)).float(),
        "topk_ids": ids.int(),
        "activation": activation,
        "w13_bias": torch.randn(num_local, 2 * inter, device="cuda", generator=gen) if bias else None,
        "w2_bias": torch.randn(num_local, hidden, device="cuda", generator=gen).bfloat16() if bias else None,
        "expert_map": expert_map,
    }
