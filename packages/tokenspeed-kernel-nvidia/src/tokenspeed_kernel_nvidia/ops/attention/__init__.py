"""NVIDIA attention kernels: FlashInfer decode/extend/prefill, TensorRT-LLM XQA decode and FMHAv2 prefill
(through FlashInfer), Gluon Hopper decode/prefill (registered on import)."""

from tokenspeed_kernel_nvidia.ops.attention import (  # noqa: F401
    flashinfer_decode,
    flashinfer_extend,
    flashinfer_prefill,
    gluon_decode,
    gluon_prefill,
    trtllm_fmha_prefill,
    trtllm_xqa_decode,
)
