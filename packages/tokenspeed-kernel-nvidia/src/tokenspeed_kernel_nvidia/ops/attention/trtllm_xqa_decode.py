"""TensorRT-LLM's XQA decode kernel, through FlashInfer 0.7.2 (``attention.decode``).

Calls ``flashinfer.decode.xqa_batch_decode_with_kv_cache`` on the paged NHD caches as they
are (``(k_cache, v_cache)``, page table and lengths unchanged). What the conversion does:

- ``seq_lens``: XQA reads uint32 lengths (including the ``q_len`` new tokens, as ours do).
  ``cache_seqlens`` (int32, never negative) is reinterpreted with ``view(torch.uint32)``:
  same storage, no copy, so a graph captured over the call sees the lengths the engine
  writes in place before each replay.
- Workspace: FlashInfer cuts the first 8 MiB (:data:`SEMAPHORE_BYTES`) of the workspace as
  XQA's uint32 semaphores (one per (sequence, KV head) block of a multi-block launch) and
  hands the rest to the kernel as scratch for the split partials. The semaphores must be
  zero before a launch; each launch leaves them zero. So XQA gets its own zero-initialized
  buffer (:func:`xqa_workspace`), never the workspace the other FlashInfer kernels share:
  their split partials (and FMHAv2's tile counter) would leave non-zero words there.
- Scales: XQA's logit scale is FlashInfer's ``bmm1_scale`` (we pass ``softmax_scale``) and
  its output scale ``bmm2_scale`` (1.0).
- Window: FlashInfer's ``window_left`` is ours (a query sees keys ``j`` with ``i - j <=
  window_left``); it hands XQA ``sliding_win_size = window_left + 1`` (the keys in the
  window, the query's own included), -1 meaning none.
- Sinks: float32 ``[Hq]``; FlashInfer reshapes them to XQA's ``[Hkv, Hq / Hkv]``.
- Speculative decode (``q_len > 1``): q/out as ``[batch * q_len, Hq, D]`` rows with
  ``q_len_per_req = q_len``, and the draft mask XQA requires: row ``t`` of every sequence
  sees draft tokens ``0..t`` (:func:`draft_mask`, causal, so the queries are the sequence's
  last positions as our contract says), uint16 ``[batch, q_len, 2 * ceil(q_len / 32)]``
  (32-bit words, bit ``c`` of row ``t`` set when draft token ``c`` is visible). Built once
  per (device, batch, q_len) from device ops and kept.

Not served (no feature, or a predicate reason): an fp8 cache (claimed until its first GPU
check, H100 2026-11-27: 0.034 / 0.032 relative error against float64 for bf16 / fp16 queries,
over the 0.02 every fp8-cache kernel meets; XQA runs its fp8-cache MMAs in fp8), the
log-sum-exp (XQA returns none), a
logit soft-cap (none in XQA), strided caches (not verified), page sizes other than 16, 32,
64, 128 (XQA's ``TOKENS_PER_PAGE`` builds), head dims other than 64, 128, 256. A direct
call with any of them raises ``ValueError`` before FlashInfer is reached.

Each (dtypes, page size, head dim, GQA group, window on/off, q_len) is one XQA JIT module,
built on its first call (outside CUDA-graph capture); later calls are capturable.
"""

from __future__ import annotations

import importlib
import threading

import torch

from tokenspeed_kernel.kit import equal_head_dims
from tokenspeed_kernel.ops.attention.args import DecodeArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia._workspace import workspace
from tokenspeed_kernel_nvidia.ops.attention._common import (
    FLASHINFER_CAPABILITIES,
    Q_DTYPES,
    VENDORS,
)
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import check_sinks, flashinfer_missing

__all__ = ["SEMAPHORE_BYTES", "WORKSPACE_BYTES", "draft_mask", "trtllm_xqa_decode", "xqa_workspace"]

PAGE_SIZES = (16, 32, 64, 128)  # flashinfer.jit.xqa.gen_xqa_module accepts these only
HEAD_DIMS = (64, 128, 256)  # XQA pads other multiples of 16 up to these; we claim the exact ones
SEMAPHORE_BYTES = 8 * 2**20  # xqa_batch_decode_with_kv_cache: workspace[:8 MiB] are the semaphores
WORKSPACE_BYTES = SEMAPHORE_BYTES + 120 * 2**20  # + scratch for the multi-block partials
NO_LSE = "return_lse: XQA returns no log-sum-exp"
NO_CAP = "logit_cap: XQA has no logits soft-cap"

_lock = threading.Lock()
_masks: dict[tuple, torch.Tensor] = {}


def xqa_workspace(device: torch.device) -> torch.Tensor:
    """XQA's own zero-initialized uint8 workspace on ``device``: ``[:SEMAPHORE_BYTES]`` the
    semaphores, the rest scratch (see the module docstring)."""
    return workspace(device, "trtllm_xqa", (WORKSPACE_BYTES,), torch.uint8, zero=True)


def draft_mask(batch: int, q_len: int, device: torch.device) -> torch.Tensor:
    """The causal draft mask of speculative decode: uint16 ``[batch, q_len, 2 * W]`` with
    ``W = ceil(q_len / 32)`` little-endian 32-bit words per row; bit ``c`` of row ``t`` is set
    iff ``c <= t``. Device ops only (no host copy), kept per (device, batch, q_len)."""
    key = (device, batch, q_len)
    with _lock:
        mask = _masks.get(key)
    if mask is not None:
        return mask
    words = -(-q_len // 32)
    rows = torch.arange(q_len, dtype=torch.int64, device=device)[:, None]
    first = 32 * torch.arange(words, dtype=torch.int64, device=device)[None, :]
    bits = (rows + 1 - first).clamp(0, 32)
    packed = torch.bitwise_left_shift(torch.ones_like(bits), bits) - 1  # low `bits` bits set
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # same bits as int32
    mask = packed.expand(batch, q_len, words).contiguous().view(torch.uint16)
    with _lock:
        return _masks.setdefault(key, mask)


def _predicate(request: Request) -> str | None:
    return equal_head_dims(request)


def _check(args: DecodeArgs) -> None:
    """What XQA cannot compute, as ``ValueError``/``TypeError`` naming the argument, before
    FlashInfer is imported or called (the selector's gates, for direct calls)."""
    batch, _, num_q_heads, head_dim = args.q.shape
    _, page_size, num_kv_heads, _ = args.k_cache.shape
    if args.q.dtype not in Q_DTYPES:
        raise TypeError(f"q: XQA takes bf16/fp16 queries, got {args.q.dtype}")
    if args.k_cache.dtype != args.q.dtype or args.v_cache.dtype != args.q.dtype:
        raise TypeError(
            f"k_cache/v_cache: trtllm_xqa_decode takes q's dtype for both (its fp8 cache missed float64), "
            f"got {args.k_cache.dtype}/{args.v_cache.dtype}"
        )
    if page_size not in PAGE_SIZES:
        raise ValueError(f"k_cache: page size {page_size} not built by XQA (one of {PAGE_SIZES})")
    if head_dim not in HEAD_DIMS or args.v_cache.shape[-1] != head_dim:
        raise ValueError(f"q/v_cache: head dims {head_dim}/{args.v_cache.shape[-1]}: XQA serves equal {HEAD_DIMS}")
    if not (args.k_cache.is_contiguous() and args.v_cache.is_contiguous()):
        raise ValueError("k_cache/v_cache: strided caches are not served by trtllm_xqa_decode")
    if args.cache_seqlens.dtype != torch.int32 or args.page_table.dtype != torch.int32:
        raise TypeError("cache_seqlens/page_table: int32 expected (seq_lens are reinterpreted as uint32)")
    if args.lse is not None:
        raise ValueError(NO_LSE)
    if args.logit_cap > 0:
        raise ValueError(NO_CAP)
    if args.k_scale is not None or args.v_scale is not None:
        raise ValueError("k_scale/v_scale: given for a non-fp8 cache (trtllm_xqa_decode serves no fp8 cache)")
    check_sinks(args.sinks, num_q_heads)
    if num_q_heads % num_kv_heads or batch * num_kv_heads * args.q.shape[1] > SEMAPHORE_BYTES // 4:
        raise ValueError("q/k_cache: heads must group evenly and fit XQA's semaphores")


@register_kernel(
    "attention.decode",
    name="trtllm_xqa_decode",
    solution="trtllm",
    vendors=VENDORS,
    # Run on the H100 only (issue 20); XQA also builds for sm_100/sm_120, not run by us.
    archs=("sm_90",),
    capabilities=FLASHINFER_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    shapes={"head_dim": HEAD_DIMS, "page_size": PAGE_SIZES},
    features=("sinks", "sliding_window", "spec_decode"),  # fp8_kv withdrawn: see the module docstring
    # Opt-in until ranked by measurement (issue 20: 390 vs 383 µs at B=64 ctx 8192, 21.7 vs
    # 17.5 µs at B=1, 35.5 vs 17.1 µs at window 127, against gluon_decode_sm90).
    priority=Priority.OPT_IN,
    predicate=_predicate,
    available=flashinfer_missing,
    # No host sync or plan: captureable once its JIT module is built (first call, eager).
    graph_safe=True,
)
def trtllm_xqa_decode(args: DecodeArgs) -> None:
    """TensorRT-LLM XQA paged decode via FlashInfer; no LSE.

    Sinks, sliding window, speculative ``q_len``; writes ``args.out``
    ``[batch, q_len, Hq, D]`` (see the module docstring for the conversion)."""
    _check(args)
    batch, q_len, num_q_heads, head_dim = args.q.shape
    device = args.q.device
    decode = importlib.import_module("flashinfer.decode")
    decode.xqa_batch_decode_with_kv_cache(
        args.q.reshape(batch * q_len, num_q_heads, head_dim),
        (args.k_cache, args.v_cache),
        xqa_workspace(device),
        args.page_table,
        args.cache_seqlens.view(torch.uint32),
        args.max_seqlen_k,
        bmm1_scale=float(args.softmax_scale),
        bmm2_scale=1.0,
        window_left=args.window_left,
        out=args.out.view(batch * q_len, num_q_heads, -1),
        sinks=args.sinks,
        kv_layout="NHD",
        q_len_per_req=q_len,
        mask=draft_mask(batch, q_len, device) if q_len > 1 else None,
    )
