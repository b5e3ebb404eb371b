"""A dense float64 attention for the GPU tests of the Gluon prefill kernels: per sequence, one
masked softmax over the whole score matrix (fast enough on a GPU for thousands of tokens,
where ``support.naive_attention``'s per-query loops are not); it is itself checked against
``support.naive_attention`` on small shapes (test_gluon_prefill_gpu.py, on any machine)."""

from __future__ import annotations

import torch

__all__ = ["dense_reference"]


def dense_reference(q, k, v, cu_q, cu_k, *, scale, window, sinks=None, cap=0.0):
    """float64 ``(out [Tq, Hq, D], lse [Tq, Hq])``: per sequence, a dense masked softmax with
    the sink as an extra logit column (bottom-right causal, ``0 <= i - j <= window``)."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qb = q[int(cu_q[b]) : int(cu_q[b + 1])]
        kb = k[int(cu_k[b]) : int(cu_k[b + 1])].repeat_interleave(hq // hkv, 1)
        vb = v[int(cu_k[b]) : int(cu_k[b + 1])].repeat_interleave(hq // hkv, 1)
        lq, lk = qb.shape[0], kb.shape[0]
        s = torch.einsum("ihd,jhd->hij", qb, kb) * scale
        if cap > 0:
            s = cap * torch.tanh(s / cap)
        i = torch.arange(lk - lq, lk, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        s = s.masked_fill(~((j <= i) & (i - j <= window))[None], float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(hq, lq, 1)], -1)
        lse = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - lse[..., None]))
        if sinks is not None:
            p = p[..., :-1]
        outs.append(torch.einsum("hij,jhd->ihd", p, vb))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)
