"""Ragged ``PrefillArgs`` (the kernel-level argument object) built directly, for tests that call
a kernel's internals without the public ``mha_prefill``."""

from __future__ import annotations

import math

import torch

from tokenspeed_kernel.ops.attention.args import PrefillArgs

__all__ = ["ragged_prefill_args"]


def ragged_prefill_args(
    lens_q=(3, 0, 5),
    lens_k=(7, 4, 5),
    hq=16,
    hkv=2,
    d=64,
    dtype=torch.bfloat16,
    *,
    device="cpu",
    seed=0,
    causal=True,
    window_left=-1,
    sinks=False,
    return_lse=False,
    logit_cap=0.0,
) -> PrefillArgs:
    """q ``[sum(lens_q), hq, d]``, k/v ``[sum(lens_k), hkv, d]`` random normal in ``dtype``;
    ``sinks`` float32 ``[hq]`` and ``lse`` float32 ``[total_q, hq]`` when asked; ``out`` empty."""
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (lens_q, lens_k)
    )
    q = torch.randn(int(cu_q[-1]), hq, d, generator=g).to(dtype)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, generator=g).to(dtype) for _ in range(2))
    sink = torch.randn(hq, generator=g) if sinks else None
    lse = torch.empty(q.shape[0], hq) if return_lse else None
    q, k, v, cu_q, cu_k = (t.to(device) for t in (q, k, v, cu_q, cu_k))
    return PrefillArgs(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lens_q),
        max(lens_k),
        causal,
        1 / math.sqrt(d),
        window_left,
        None if sink is None else sink.to(device),
        logit_cap,
        torch.empty_like(q),
        None if lse is None else lse.to(device),
    )
