"""Random MXFP4 MoE problems on the GPU for the Gluon MoE decode tests."""

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
