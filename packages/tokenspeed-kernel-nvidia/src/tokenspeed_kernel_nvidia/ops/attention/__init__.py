"""NVIDIA attention kernels: FlashInfer decode/extend/prefill, Gluon Hopper decode (registered on import)."""

from tokenspeed_kernel_nvidia.ops.attention import (  # noqa: F401
    flashinfer_decode,
    flashinfer_extend,
    flashinfer_prefill,
    gluon_decode,
    gluon_prefill,
)
