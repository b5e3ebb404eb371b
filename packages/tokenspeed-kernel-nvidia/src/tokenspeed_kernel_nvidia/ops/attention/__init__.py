"""NVIDIA attention kernels: FlashInfer decode/extend/prefill, TensorRT-LLM XQA decode and FMHAv2 prefill
(through FlashInfer), Gluon Hopper decode, window prefill, FlashAttention-3-style dense causal prefill and paged extend,
FlashAttention-4 (CuTe DSL) Hopper prefill (registered on import)."""

from tokenspeed_kernel_nvidia.ops.attention import (  # noqa: F401
    fa4_prefill,
    flashinfer_decode,
    flashinfer_extend,
    flashinfer_prefill,
    gluon_decode,
    gluon_extend_fa3,
    gluon_prefill,
    gluon_prefill_fa3,
    trtllm_fmha_prefill,
    trtllm_xqa_decode,
)
