"""The epilogue of an online softmax in float64, as the Gluon prefill kernels compute it: shared by
their host tests' algorithm emulations (checked against ``support.naive_attention``)."""

from __future__ import annotations

import math

import torch

__all__ = ["close_online_softmax"]


def close_online_softmax(m: torch.Tensor, ell: torch.Tensor, sink: torch.Tensor | None):
    """``(inv, lse)`` per row from the running max ``m`` and sum ``ell`` (base 2, float64
    ``[rows]``) and the sink logit in base-2 units (``[rows]`` or None): the sink joins the
    denominator once; ``out = acc * inv``; a row that saw nothing and has no sink gets
    ``inv = 0`` and ``lse = -inf`` (natural log)."""
    if sink is not None:
        m_fin = torch.maximum(m, sink)
        m_use = torch.where(m_fin == float("-inf"), 0.0, m_fin)
        old = torch.exp2(m - m_use)
        ell = ell * old + torch.exp2(sink - m_use)
    else:
        m_use = torch.where(m == float("-inf"), 0.0, m)
        old = torch.ones_like(ell)
    has = ell > 0
    inv = torch.where(has, old / torch.where(has, ell, 1.0), 0.0)
    lse = torch.where(has, (m_use + torch.log2(torch.where(has, ell, 1.0))) * math.log(2), float("-inf"))
    return inv, lse
