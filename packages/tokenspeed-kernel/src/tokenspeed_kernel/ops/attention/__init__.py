"""Attention operators: ``mha_prefill``, ``mha_extend_with_kvcache``, ``mha_decode_with_kvcache``.

Public API and validation in :mod:`.api`; the kernel-facing contract in :mod:`.args`.
"""

from tokenspeed_kernel.ops.attention.api import mha_decode_with_kvcache, mha_extend_with_kvcache, mha_prefill

__all__ = ["mha_decode_with_kvcache", "mha_extend_with_kvcache", "mha_prefill"]
