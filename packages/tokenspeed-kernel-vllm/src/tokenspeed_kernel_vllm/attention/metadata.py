"""Per-batch metadata of the TOKENSPEED backend, built from vLLM's ``CommonAttentionMetadata``.

vLLM reorders every batch so that decodes (query length <= ``reorder_batch_threshold``) come
first; vLLM's ``split_decodes_and_prefills`` finds the boundary. The decodes become one
``mha_decode_with_kvcache`` call (or a ``DecodePlan`` run, see below) and the rest one
``mha_extend_with_kvcache`` call:

==========================  ==============================================================
vLLM                        tokenspeed-kernel
==========================  ==============================================================
``query_start_loc``         decode: uniform ``q_len`` (q viewed ``[B, q_len, Hq, D]``);
                            extend: ``cu_seqlens_q`` = ``query_start_loc[d:] - [d]``
``seq_lens``                ``cache_seqlens`` (tokens in the cache, this step's included)
``block_table_tensor``      ``page_table`` (int32, a page per kernel block)
``slot_mapping``            ``store_kvcache``'s ``slot_mapping`` (``do_kv_cache_update``)
``max_seq_len``             ``max_seqlen_k`` (a host bound)
==========================  ==============================================================

The extend part's tables are the same for every layer of a step, and so are the decode
part's: the step's first layer of each kind (window, sinks, scale, cache layout) makes an
``mha_extend_plan`` (and, outside full CUDA graphs, an ``mha_decode_step_plan``): the full
checks and the selection, kept in ``step_plans``; every layer runs them (``plan.run``: the
per-layer tensors' layout checked, then the launch).

CUDA graphs: when vLLM captures full decode graphs (``cudagraph_mode`` FULL_DECODE_ONLY or
FULL_AND_PIECEWISE) a pure-decode batch runs through ``mha_decode_plan`` plans, one per
(layer, batch shape, q layout: a fused qkv's q is planned with its row stride), kept on the persistent ``block_table``/``seq_lens`` buffers vLLM
rewrites in place every step. :meth:`TokenspeedAttentionMetadataBuilder.build` runs
``plan.update()`` (outside capture) before the step's forward replays the graph.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    max_decode_query_len,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheSpec

from tokenspeed_kernel import DecodePlan, DecodeStepPlan, ExtendPlan
from tokenspeed_kernel_vllm.attention import _support

logger = init_logger(__name__)

PlanKey = tuple[int, tuple[int, ...], int, int]


class DecodePlans:
    """The decode plans of one KV-cache group, shared by its builder and its layers' impls.

    Keyed by the batch's table views (addresses and shapes of ``page_table`` and
    ``cache_seqlens``, and ``q_len``); under a key, one plan per layer (owner).
    """

    def __init__(self) -> None:
        self._plans: dict[PlanKey, dict[Any, DecodePlan]] = {}

    @staticmethod
    def key(page_table: torch.Tensor, cache_seqlens: torch.Tensor, q_len: int) -> PlanKey:
        return (page_table.data_ptr(), tuple(page_table.shape), cache_seqlens.data_ptr(), q_len)

    def get(self, key: PlanKey, owner: Any) -> DecodePlan | None:
        return self._plans.get(key, {}).get(owner)

    def add(self, key: PlanKey, owner: Any, plan: DecodePlan) -> None:
        self._plans.setdefault(key, {})[owner] = plan

    def update(self, key: PlanKey) -> None:
        """Re-plan every layer's plan for this batch shape (kernels with a layout hook)."""
        for plan in self._plans.get(key, {}).values():
            if plan.has_layout_hook:
                plan.update()

    def __len__(self) -> int:
        return sum(len(v) for v in self._plans.values())


@dataclass
class TokenspeedAttentionMetadata(AttentionMetadata):
    """One step's batch, split into its decode and extend parts.

    Attributes:
        num_actual_tokens: tokens vLLM scheduled (``query``/``output`` rows beyond are padding).
        num_decodes, num_decode_tokens, decode_q_len: the leading decode requests, their
            tokens (``num_decodes * decode_q_len``) and their uniform query length.
        decode_page_table: int32 ``[num_decodes, max_pages]`` view of vLLM's block table.
        decode_seqlens: int32 ``[num_decodes]`` view of vLLM's ``seq_lens``.
        num_prefills, num_prefill_tokens: the requests after the decodes and their tokens.
        prefill_page_table: int32 ``[num_prefills, max_pages]``.
        prefill_cu_seqlens_q: int32 ``[num_prefills + 1]`` from 0.
        prefill_seqlens: int32 ``[num_prefills]``.
        prefill_max_query_len: longest prefill query (host int).
        max_seq_len: host bound of every ``seq_lens`` entry.
        slot_mapping: int64 ``[tokens]`` (negative: padding).
        decode_plans, decode_plan_key: set when this pure-decode batch runs through plans.
        step_plans: this step's extend (and eager decode) plans by part and layer kind (filled by
            the first layer of each).
        plan_max_seqlen_k: the ``max_seqlen_k`` plans are made with (vLLM's max_model_len).
        plan_capturable: whether plans select only CUDA-graph-capturable kernels.
    """

    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    decode_q_len: int
    decode_page_table: torch.Tensor | None
    decode_seqlens: torch.Tensor | None
    num_prefills: int
    num_prefill_tokens: int
    prefill_page_table: torch.Tensor | None
    prefill_cu_seqlens_q: torch.Tensor | None
    prefill_seqlens: torch.Tensor | None
    prefill_max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor
    decode_plans: DecodePlans | None = None
    decode_plan_key: PlanKey | None = None
    step_plans: dict[Hashable, ExtendPlan | DecodeStepPlan] = field(default_factory=dict)
    plan_max_seqlen_k: int = 0
    plan_capturable: bool = False


def _heads_and_dtypes(vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec) -> dict[str, Any]:
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    assert isinstance(kv_cache_spec, AttentionSpec)
    kv_dtype = kv_cache_spec.dtype
    if kv_dtype == torch.uint8:  # vLLM stores fp8 KV as bytes
        kv_dtype = torch.float8_e4m3fn
    return {
        "dtype": model_config.dtype,
        "kv_dtype": kv_dtype,
        "num_q_heads": model_config.get_num_attention_heads(parallel),
        "num_kv_heads": kv_cache_spec.num_kv_heads,
        "head_size": kv_cache_spec.head_size,
        "head_size_v": kv_cache_spec.head_size_v,
        "page_size": kv_cache_spec.block_size,
    }


class TokenspeedAttentionMetadataBuilder(AttentionMetadataBuilder[TokenspeedAttentionMetadata]):
    """Builds :class:`TokenspeedAttentionMetadata` once per step for a KV-cache group."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    reorder_batch_threshold: int = 1

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes with q_len up to 1 + num_speculative_tokens go to the decode call
        # (tokenspeed-kernel's decode serves uniform q_len > 1 causally).
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        capturable = self.get_cudagraph_support(vllm_config, kv_cache_spec) != AttentionCGSupport.NEVER
        full_decode = vllm_config.compilation_config.cudagraph_mode.decode_mode() == CUDAGraphMode.FULL
        self.decode_plans: DecodePlans | None = DecodePlans() if full_decode else None
        self.plan_capturable = capturable
        self.plan_max_seqlen_k = vllm_config.model_config.max_model_len

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: KVCacheSpec) -> AttentionCGSupport:
        """UNIFORM_BATCH (pure-decode batches of one q_len, speculative included, replay full
        CUDA graphs through decode plans) when a capturable tokenspeed-kernel decode kernel
        serves the group's shapes; NEVER otherwise. Extend/prefill batches are never captured
        whole: the reference kernels are not capturable, and vLLM runs mixed batches
        piecewise."""
        try:
            shapes = _heads_and_dtypes(vllm_config, kv_cache_spec)
        except (AssertionError, AttributeError):
            return AttentionCGSupport.NEVER
        reason = _support.capturable_decode_reason(q_len=max_decode_query_len(vllm_config), **shapes)
        if reason is not None:
            logger.warning_once(f"TOKENSPEED: no CUDA-graph-capturable decode kernel ({reason}); no full graphs")
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> TokenspeedAttentionMetadata:
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor) or not cm.causal:
            raise ValueError("TOKENSPEED serves causal decoder attention only (got non-causal metadata)")
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold, require_uniform=True
        )
        qsl_cpu = cm.query_start_loc_cpu
        q_len = 1
        decode_page_table = decode_seqlens = None
        if num_decodes:
            q_len = max(int(qsl_cpu[1] - qsl_cpu[0]), 1)
            if num_decode_tokens != num_decodes * q_len:
                raise ValueError(
                    f"TOKENSPEED: {num_decodes} decode requests of q_len {q_len} hold {num_decode_tokens} tokens; "
                    "the decode call needs num_decodes * q_len"
                )
            decode_page_table = cm.block_table_tensor[:num_decodes]
            decode_seqlens = cm.seq_lens[:num_decodes]

        prefill_page_table = prefill_cu = prefill_seqlens = None
        prefill_max_q = 0
        if num_prefills:
            start, end = num_decodes, cm.num_reqs
            prefill_page_table = cm.block_table_tensor[start:end]
            prefill_seqlens = cm.seq_lens[start:end]
            loc = cm.query_start_loc[start : end + 1]
            prefill_cu = (loc - loc[0]).to(torch.int32)
            lens = qsl_cpu[start + 1 : end + 1] - qsl_cpu[start:end]
            prefill_max_q = int(lens.max())
            num_prefill_tokens = int(qsl_cpu[end] - qsl_cpu[start])

        metadata = TokenspeedAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            decode_q_len=q_len,
            decode_page_table=decode_page_table,
            decode_seqlens=decode_seqlens,
            num_prefills=num_prefills,
            num_prefill_tokens=num_prefill_tokens,
            prefill_page_table=prefill_page_table,
            prefill_cu_seqlens_q=prefill_cu,
            prefill_seqlens=prefill_seqlens,
            prefill_max_query_len=prefill_max_q,
            max_seq_len=cm.max_seq_len,
            slot_mapping=cm.slot_mapping,
            plan_max_seqlen_k=self.plan_max_seqlen_k,
            plan_capturable=self.plan_capturable,
        )
        if self.decode_plans is not None and num_decodes and not num_prefills:
            assert decode_page_table is not None and decode_seqlens is not None
            key = DecodePlans.key(decode_page_table, decode_seqlens, q_len)
            self.decode_plans.update(key)  # the tables were rewritten in place for this step
            metadata.decode_plans = self.decode_plans
            metadata.decode_plan_key = key
        return metadata
