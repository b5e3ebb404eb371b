"""Host side of the Gluon attention kernels: checks beyond the core's, grids, workspace, launch.

:func:`launch` takes the call as :class:`~tokenspeed_kernel.ops.attention.rows.QueryRows`
(the core's one form of the prefill, extend and decode arguments, also what the Triton
wheel's attention ``launch`` takes) and shares that, the decode's visible-key bound and the
host helpers (:mod:`tokenspeed_kernel.kit`) with the Triton wheel. The rest is kept apart on
purpose (issue 28, section 3): the kernels take different argument lists and strides (this
one addresses K/V through a page stride of 0 for a contiguous batch), the split partials have
another layout (``[splits, tokens, Hq, Dv]`` here, flat ``[tokens * Hq * splits, BLOCK_DV]``
there), the grids differ (``(query blocks, batch x Hkv, splits)`` here), this launch decides
the split count itself from the architecture table (CU count of the flagship part, powers of
two) where the Triton decode passes it in, the tile tables differ, and Gluon kernels launch
directly where the Triton wheel goes through its launch cache (``jit_launch``, which takes
Triton's own path on ROCm anyway).
"""

from __future__ import annotations

import torch

from tokenspeed_kernel.kit import cdiv
from tokenspeed_kernel.ops.attention.rows import QueryRows
from tokenspeed_kernel_amd._arch import arch_config, device_arch
from tokenspeed_kernel_amd.ops.attention._config import (
    HEAD_DIMS,
    MAX_GROUP,
    attention_config,
    combine_constexprs,
    decode_splits,
)
from tokenspeed_kernel_amd.ops.attention._kernel import attention_kernel, combine_kernel

__all__ = ["check_shapes", "launch", "num_m_blocks"]


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_len: int = 1) -> tuple[int, int]:
    """What the kernel assumes beyond the public contract (the selector's predicate already
    keeps other shapes away; this guards direct calls). Returns ``(group, head_dim)``."""
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    group = num_q_heads // num_kv_heads
    if head_dim not in HEAD_DIMS or v.shape[-1] != head_dim:
        raise ValueError(f"q/v: head dims must both be one of {HEAD_DIMS}, got {head_dim} and {v.shape[-1]}")
    if group & (group - 1) or group * q_len > MAX_GROUP:
        raise ValueError(
            f"q: the GQA group ({group} query heads per KV head) times q_len ({q_len}) must be a power of two "
            f"<= {MAX_GROUP}"
        )
    return group, head_dim


def num_m_blocks(max_q: int, group: int, block_m: int) -> int:
    """Programs along the query axis: ``block_m // group`` query tokens each."""
    return cdiv(max(max_q, 1), block_m // group)


def launch(rows: QueryRows, *, regime: str) -> None:
    """Launch on ``rows.q``'s device (``rows``: :func:`tokenspeed_kernel.ops.attention.rows.query_rows`
    of the call's arguments). ``q`` ``[tokens, Hq, D]``, ``out`` ``[tokens, Hq, Dv]``, ``lse``
    float32 ``[tokens, Hq]``; ``k``/``v`` ``[tokens, Hkv, D]`` (prefill) or paged caches
    ``[pages, P, Hkv, D]``. Decode rows are ``batch * q_len`` tokens, ``q_len`` per sequence.
    ``regime``: ``"prefill"``, ``"extend"`` or ``"decode"`` (the kernel's mode)."""
    q, k, v, out, lse, sinks = rows.q, rows.k, rows.v, rows.out, rows.lse, rows.sinks
    k_scale, v_scale, page_table = rows.k_scale, rows.v_scale, rows.page_table
    batch, window_left, logit_cap = rows.batch, rows.window_left, rows.logit_cap
    q_len = max(rows.q_len, 1)  # the kernel's Q_LEN; ragged rows (prefill, extend) count 1
    arch = arch_config(device_arch(q.device.index or 0))
    group, head_dim = check_shapes(q, k, v, q_len if regime == "decode" else 1)
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[-2]
    paged = regime != "prefill"
    splits = 1
    if regime == "decode":
        splits = decode_splits(arch, batch, num_kv_heads, rows.visible_keys)
    cfg = attention_config(
        arch,
        regime=regime,
        head_dim=head_dim,
        head_dim_v=v.shape[-1],
        group=group,
        num_kv_heads=num_kv_heads,
        q_len=q_len,
        page_size=k.shape[1] if paged else 1,
        causal=rows.causal,
        window=window_left >= 0,
        sinks=sinks is not None,
        cap=logit_cap > 0,
        kv_scales=k_scale is not None,
        lse=lse is not None,
        splits=splits,
    )
    f32 = torch.empty(1, dtype=torch.float32, device=q.device)
    i32 = torch.zeros(1, dtype=torch.int32, device=q.device)
    part_out = part_lse = f32
    if splits > 1:
        part_out = torch.empty((splits, num_tokens, num_q_heads, v.shape[-1]), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    grid = (num_m_blocks(rows.max_q, group, cfg.block_m), batch * num_kv_heads, splits)
    attention_kernel[grid](
        q,
        k,
        v,
        out,
        f32 if lse is None else lse,
        part_out,
        part_lse,
        f32 if sinks is None else sinks,
        f32 if k_scale is None else k_scale,
        f32 if v_scale is None else v_scale,
        i32 if page_table is None else page_table,
        i32 if rows.cu_seqlens_q is None else rows.cu_seqlens_q,
        i32 if rows.cu_seqlens_k is None else rows.cu_seqlens_k,
        i32 if rows.cache_seqlens is None else rows.cache_seqlens,
        q.stride(0),
        k.stride(0) if paged else 0,
        k.stride(-3),
        k.stride(-2),
        v.stride(0) if paged else 0,
        v.stride(-3),
        v.stride(-2),
        out.stride(0),
        0 if page_table is None else page_table.stride(0),
        num_tokens,
        float(rows.softmax_scale),
        float(logit_cap),
        int(window_left),
        num_warps=cfg.num_warps,
        **cfg.constexprs,
    )
    if splits > 1:
        consts = combine_constexprs(
            num_q_heads=num_q_heads,
            head_dim_v=v.shape[-1],
            splits=splits,
            sinks=sinks is not None,
            kv_scales=v_scale is not None,
            lse=lse is not None,
        )
        combine_kernel[(num_tokens, num_q_heads)](
            part_out,
            part_lse,
            out,
            f32 if lse is None else lse,
            f32 if sinks is None else sinks,
            f32 if v_scale is None else v_scale,
            out.stride(0),
            num_tokens,
            num_warps=1,
            **consts,
        )
