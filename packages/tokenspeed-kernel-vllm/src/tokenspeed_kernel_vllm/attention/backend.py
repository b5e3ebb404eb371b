"""``TokenspeedAttentionBackend``: what vLLM asks a backend before it builds a layer.

vLLM resolves ``--attention-backend TOKENSPEED`` to this class (the plugin registers the name)
and calls :meth:`validate_configuration`; a non-empty list of reasons stops it with
"Selected backend TOKENSPEED is not valid for this configuration. Reason: [...]". The generic
reasons vLLM's base class produces are replaced by ours, which say what is served.

KV cache: vLLM 0.33 gives every layer a logical ``[num_blocks, Hkv, block_size, D + Dv]`` view
whose physical strides follow the resolved KV cache layout (K and V side by side in the
last axis). The impl hands ``kv_cache.transpose(1, 2)[..., :D]`` and ``[..., D:]`` to the
public calls as K and V — views, last axis contiguous — so any of vLLM's layouts works and
the backend declares no layout preference.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType

from tokenspeed_kernel_vllm.attention import _support

if TYPE_CHECKING:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.kv_cache_interface import KVCacheSpec

    from tokenspeed_kernel_vllm.attention.impl import TokenspeedAttentionImpl
    from tokenspeed_kernel_vllm.attention.metadata import TokenspeedAttentionMetadataBuilder


class TokenspeedAttentionBackend(AttentionBackend):
    """Decoder self-attention (GQA/MQA/MHA) through tokenspeed-kernel's public paged calls:
    sliding windows, sinks, logit soft-cap, fp8 (e4m3) KV with per-tensor scales."""

    supported_dtypes: ClassVar[list[torch.dtype]] = list(_support.ACT_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list] = list(_support.KV_CACHE_DTYPES)
    # The layer writes the cache through do_kv_cache_update (store_kvcache) before forward.
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return "TOKENSPEED"

    @staticmethod
    def get_impl_cls() -> type[TokenspeedAttentionImpl]:
        from tokenspeed_kernel_vllm.attention.impl import TokenspeedAttentionImpl

        return TokenspeedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TokenspeedAttentionMetadataBuilder]:
        from tokenspeed_kernel_vllm.attention.metadata import TokenspeedAttentionMetadataBuilder

        return TokenspeedAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: KVCacheSpec | None = None) -> list[int | MultipleOf]:
        return list(_support.KERNEL_PAGE_SIZES)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return _head_size_reason(head_size) is None

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The builder splits the batch and shapes the decode call (uniform q_len) from the
        # host query_start_loc; adaptive verification's device-trimmed drafts would not match.
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        # The tokenspeed-kernel selector decides per call (supports_combination asks it).
        return True

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        if use_mla or use_sparse or dtype not in _support.ACT_DTYPES:
            return None  # vLLM's own checks name these
        if (
            _support.kv_dtype_reason(kv_cache_dtype)
            or _support.block_size_reason(block_size)
            or _head_size_reason(head_size)
        ):
            return None  # reported by validate_configuration in our words
        num_q_heads, num_kv_heads = _support._PROBE_HEADS
        return _support.kernel_reason(
            dtype=dtype,
            kv_dtype=_support.cache_dtype(kv_cache_dtype or "auto", dtype),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            head_size_v=head_size,
            page_size=_support.kernel_page_size(block_size),
            sinks=has_sink,
        )

    @classmethod
    def validate_configuration(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: str | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: DeviceCapability,
        attn_type: str,
        **kwargs,
    ) -> list[str]:
        """vLLM's checks, with its generic "X not supported" replaced by what is served."""
        reasons = super().validate_configuration(
            head_size,
            dtype,
            kv_cache_dtype,
            block_size,
            use_mla,
            has_sink,
            use_sparse,
            use_mm_prefix,
            use_per_head_quant_scales,
            device_capability,
            attn_type,
            **kwargs,
        )
        ours = {
            "kv_cache_dtype not supported": _support.kv_dtype_reason(kv_cache_dtype),
            "block_size not supported": _support.block_size_reason(block_size),
            "head_size not supported": _head_size_reason(head_size),
            "dtype not supported": (f"TOKENSPEED: activation dtype {dtype} is not served (float16, bfloat16, float32)"),
        }
        reasons = [ours.get(r) or r for r in reasons]
        # An fp8 dtype that vLLM lists but this platform stores differently (fnuz).
        kv_reason = _support.kv_dtype_reason(kv_cache_dtype)
        if kv_reason is not None and kv_reason not in reasons:
            reasons.append(kv_reason)
        return reasons


def _head_size_reason(head_size: int) -> str | None:
    """Why no decode/extend/store kernel serves this head size for a bf16 cache of 16-token
    pages (the finer checks, with the real dtypes, are supports_combination's)."""
    num_q_heads, num_kv_heads = _support._PROBE_HEADS
    return _support.kernel_reason(
        dtype=torch.bfloat16,
        kv_dtype=torch.bfloat16,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        head_size_v=head_size,
        page_size=_support.KERNEL_PAGE_SIZES[0],
    )
