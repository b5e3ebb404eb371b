"""TensorRT-LLM's FMHAv2 prefill, through FlashInfer 0.7.2 (``attention.prefill``).

Calls ``flashinfer.prefill.trtllm_fmha_v2_prefill`` with the ``SEPARATE_Q_K_V`` layout, which
is ours: q ``[total_q, Hq, D]``, k ``[total_k, Hkv, D]``, v ``[total_k, Hkv, D]``, contiguous,
with ``cu_seqlens_q`` / ``cu_seqlens_k`` (int32 ``[batch + 1]``) as FlashInfer's
``cum_seq_lens_q`` / ``cum_seq_lens_kv`` and the per-sequence key lengths as ``seq_lens``. On
sm_90 it runs FMHAv2's warp-specialized kernels, meant to place a sequence's queries at its last
positions (``past = Lk - Lq``), but see "Served" below.

Served: self-attention prefill only, ``cu_seqlens_k`` passed as ``cu_seqlens_q`` itself (each
sequence's keys are its queries): the request's ``kv_prefix`` shape must be 0 (the selector's
reason otherwise; ``ValueError`` on a direct call): on the H100 (2026-11-27) cases with
a key prefix missed float64 (both GPU tests, 8 of 9 derived `check` cases) and every
equal-length case passed.

What the conversion does:

- Mask: :data:`MASK_MODES` maps (causal, windowed) to FlashInfer's ``mask_mode``: ``causal``,
  ``sliding_window`` (causal with ``window_left``; FMHAv2's ``sliding_window_size =
  window_left + 1``, the keys a query sees with itself, which is our ``i - j <=
  window_left``) or ``padding`` (no mask). FMHAv2's window is causal only: a window without
  causal is refused (predicate reason, ``ValueError`` on a direct call).
- Scale: ``bmm1_scale = softmax_scale`` (FMHAv2 applies it to ``q.k`` as given; its
  ``scale_softmax`` is fixed at 1.0 by FlashInfer), ``bmm2_scale = 1.0``.
- Sinks: our float32 ``[Hq]`` tensor, passed as the tensor itself. FlashInfer's annotation
  says a list of tensors, but its FFI boundary takes one tensor and rejects a list.
- Workspace: the FlashInfer workspace the other FlashInfer kernels share (scratch only: FMHAv2
  allocates its tile counter there and zeroes it on each launch).

Not served: the log-sum-exp (FMHAv2 saves (max, sum) statistics in its own encoding; not
converted or verified), a logit soft-cap (FlashInfer refuses it for ``SEPARATE_Q_K_V``), an fp8
or fp32 q, head dims other than 64, 128, 256 (FMHAv2 builds more; we claim what the H100 runs
cover), unequal q/k and v head dims.

FlashInfer builds one JIT module per (layout, dtype) holding every FMHAv2 kernel of it: the
first call takes about 2 minutes on the H100 machine. docs/nvidia.md ("TensorRT-LLM kernels")
says how to build it ahead.
"""

from __future__ import annotations

import importlib

from tokenspeed_kernel.kit import equal_head_dims
from tokenspeed_kernel.ops.attention.args import PrefillArgs
from tokenspeed_kernel.registry import Priority, Request, register_kernel
from tokenspeed_kernel_nvidia.ops.attention._common import FLASHINFER_CAPABILITIES, Q_DTYPES, VENDORS
from tokenspeed_kernel_nvidia.ops.attention._flashinfer import check_sinks, flashinfer_missing, workspace

__all__ = ["KEYS_MUST_BE_QUERIES", "LAYOUT", "MASK_MODES", "trtllm_fmha_prefill"]

LAYOUT = "SEPARATE_Q_K_V"
HEAD_DIMS = (64, 128, 256)
# (causal, windowed) -> FlashInfer's mask_mode; (False, True) has none: FMHAv2's window is causal.
MASK_MODES = {(True, False): "causal", (True, True): "sliding_window", (False, False): "padding"}
WINDOW_NEEDS_CAUSAL = "sliding_window with non_causal: FMHAv2's sliding window is causal only"
# H100, 2026-11-27: with a sequence's keys outnumbering its queries (a prefix), FMHAv2 through
# FlashInfer's SEPARATE_Q_K_V missed float64 by up to 0.27 (bottom-right causal) and 0.66
# (non-causal) relative error, while every equal-length case passed; the lengths live on the device, so the
# host asks for the one layout that rules a prefix out: cu_seqlens_k passed as cu_seqlens_q.
KEYS_MUST_BE_QUERIES = (
    "cu_seqlens_k: trtllm_fmha_prefill serves only self-attention prefill (each sequence's keys are its "
    "queries): pass cu_seqlens_q itself as cu_seqlens_k (FMHAv2 missed float64 with a key prefix)"
)


def _predicate(request: Request) -> str | None:
    why = equal_head_dims(request)
    if why:
        return why
    if {"sliding_window", "non_causal"} <= request.features:
        return WINDOW_NEEDS_CAUSAL
    return None


def _check(args: PrefillArgs) -> str:
    """The mask mode of ``args``; ``ValueError``/``TypeError`` naming the argument for what
    FMHAv2 cannot compute, before FlashInfer is imported or called."""
    head_dim = args.q.shape[-1]
    if args.q.dtype not in Q_DTYPES or args.k.dtype != args.q.dtype or args.v.dtype != args.q.dtype:
        raise TypeError(f"q/k/v: FMHAv2 takes one bf16/fp16 dtype, got {args.q.dtype}/{args.k.dtype}/{args.v.dtype}")
    if head_dim not in HEAD_DIMS or args.k.shape[-1] != head_dim or args.v.shape[-1] != head_dim:
        raise ValueError(
            f"q/k/v: head dims {head_dim}/{args.v.shape[-1]}: trtllm_fmha_prefill serves equal {HEAD_DIMS}"
        )
    if not all(t.is_contiguous() for t in (args.q, args.k, args.v, args.out)):
        raise ValueError("q/k/v/out: FMHAv2 derives strides from shapes; contiguous tensors expected")
    if args.lse is not None:
        raise ValueError("return_lse: trtllm_fmha_prefill returns no log-sum-exp")
    if args.logit_cap > 0:
        raise ValueError("logit_cap: FlashInfer refuses a soft-cap for FMHAv2's SEPARATE_Q_K_V layout")
    if args.cu_seqlens_k is not args.cu_seqlens_q:
        raise ValueError(KEYS_MUST_BE_QUERIES)
    check_sinks(args.sinks, args.q.shape[1])
    mode = MASK_MODES.get((bool(args.causal), args.window_left >= 0))
    if mode is None:
        raise ValueError(WINDOW_NEEDS_CAUSAL)
    return mode


@register_kernel(
    "attention.prefill",
    name="trtllm_fmha_prefill",
    solution="trtllm",
    vendors=VENDORS,
    archs=("sm_90",),  # the warp-specialized sm_90 kernels; FMHAv2's sm_120 kernels not run by us
    capabilities=FLASHINFER_CAPABILITIES,
    dtypes={"q": Q_DTYPES, "kv": Q_DTYPES},
    # kv_prefix 0 only: self-attention (cu_seqlens_k passed as cu_seqlens_q; see KEYS_MUST_BE_QUERIES)
    shapes={"head_dim": HEAD_DIMS, "kv_prefix": (0,)},
    features=("sinks", "sliding_window", "non_causal"),
    # Opt-in until ranked by measurement (issue 20, H100: 1.22-1.28x faster than triton_prefill
    # at S=8192; triton_prefill 2.06x faster at window 128 + sinks).
    priority=Priority.OPT_IN,
    predicate=_predicate,
    available=flashinfer_missing,
    graph_safe=False,  # never captured on a device by us; its launcher sets TMA descriptors on the host
)
def trtllm_fmha_prefill(args: PrefillArgs) -> None:
    """TensorRT-LLM FMHAv2 ragged prefill via FlashInfer; no LSE.

    Contiguous q/k/v, ``cu_seqlens_k is cu_seqlens_q``, causal, sliding window, non-causal, sinks; writes
    ``args.out`` ``[total_q, Hq, D]`` (see the module docstring for the conversion)."""
    mode = _check(args)
    if args.q.shape[0] == 0:
        return
    batch = args.cu_seqlens_q.shape[0] - 1
    prefill = importlib.import_module("flashinfer.prefill")
    prefill.trtllm_fmha_v2_prefill(
        (args.q, args.k, args.v),
        LAYOUT,
        workspace(args.q.device),
        args.cu_seqlens_k[1:] - args.cu_seqlens_k[:-1],
        int(args.max_seqlen_q),
        int(args.max_seqlen_k),
        float(args.softmax_scale),
        1.0,
        batch,
        args.cu_seqlens_q,
        args.cu_seqlens_k,
        out=args.out,
        sinks=args.sinks,
        mask_mode=mode,
        window_left=args.window_left if mode == "sliding_window" else -1,
    )
