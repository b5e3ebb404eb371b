"""The operators kernels can register for, and the vocabulary of their requests.

Each operator names the dtype roles, shape keys and features a request for it can carry.
``@register_kernel`` checks a kernel's metadata against this table, so a misspelt feature
(``"sink"`` for ``"sinks"``) fails at registration instead of silently never matching. Every
schema here has one :class:`~tokenspeed_kernel.ops._operator.Operator` (defined with its
public function), which exposes it as ``schema``.

Vocabulary:
    dtype roles   which tensor a dtype constraint applies to.
    shape keys    integer facts about a request that kernels may restrict to a set of values
                  (``head_dim``, ``page_size``, ...). Only small, bounded values are shape
                  keys, so selection results can be cached per request.
    features      optional behaviours a request may need; a kernel serves a request only if
                  it supports every feature the request names.
    layout_hook   the operator has a layout plan step (``mha_decode_plan``), so its kernels
                  may register a ``prepare_layout`` hook.
    binds         the operator's plan calls a kernel's ``bind`` hook (``DecodePlan`` once per
                  layout, ``MoEPlan`` once per token count: the plan's own tensors bound), so
                  its kernels may register one.
    step_runs     the operator has a step plan (``PrefillPlan``, ``ExtendPlan``,
                  ``DecodeStepPlan``) that asks a kernel's ``step_runner`` hook once per step
                  for the runner of the step's layout, so its kernels may register one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OPERATORS", "OperatorSchema", "operator_schema"]


@dataclass(frozen=True)
class OperatorSchema:
    """The request vocabulary of one operator (family + mode)."""

    name: str
    dtype_roles: tuple[str, ...]
    shape_keys: tuple[str, ...]
    features: tuple[str, ...]
    summary: str
    layout_hook: bool = False
    binds: bool = False
    step_runs: bool = False


# strided_q: a 3-D q of rows [Hq, D] with a row stride of their own (a view of a fused qkv
# projection, as vLLM passes it); kernels that address q through its strides list it.
_ATTENTION_FEATURES = ("sinks", "sliding_window", "logit_cap", "return_lse", "strided_q")
# Extend and decode: ``q_align``, the largest power of two <= 16 dividing a row-strided q's
# byte offset and byte strides (present with ``strided_q`` only, as ``kv_align`` is with
# ``strided_kv``); a kernel that reads q by TMA restricts it to {16}. Prefill's q is in
# ``unaligned_qkv`` instead.
_STRIDED_Q_SHAPES = ("q_align",)
# window_left is present only for windowed calls (>= 0), so a predicate can bound it.
_ATTENTION_SHAPES = ("head_dim", "head_dim_v", "num_q_heads", "num_kv_heads", "window_left")
# Paged caches: ``strided_kv`` when either cache is not contiguous (a strided view, e.g.
# vLLM's interleaved K|V rows); then ``kv_align``, the largest power of two <= 16 dividing
# the caches' byte offsets and byte strides (a kernel with 16-byte copies restricts it to
# {16}; absent for contiguous caches, whose alignment follows from head dim and dtype).
_PAGED_SHAPES = ("page_size", "kv_align")

OPERATORS: dict[str, OperatorSchema] = {
    schema.name: schema
    for schema in (
        OperatorSchema(
            "attention.prefill",
            dtype_roles=("q", "kv"),
            # max_seqlen_q_bucket: the next power of two >= max_seqlen_q (ranked by length);
            # kv_prefix: 1 when keys may outnumber queries (cu_seqlens_k is not cu_seqlens_q), else 0
            shape_keys=(*_ATTENTION_SHAPES, "max_seqlen_q_bucket", "kv_prefix"),
            # unaligned_qkv: q, k or v is not 16-byte aligned (address or row strides); kernels
            # that load them with TMA or 16-byte vectors leave it out and decline such calls
            features=(*_ATTENTION_FEATURES, "non_causal", "unaligned_qkv"),
            summary="ragged-batch attention over contiguous q/k/v (mha_prefill, mha_prefill_plan)",
            step_runs=True,
        ),
        OperatorSchema(
            "attention.extend",
            dtype_roles=("q", "kv"),
            shape_keys=(*_ATTENTION_SHAPES, *_PAGED_SHAPES, *_STRIDED_Q_SHAPES),
            features=(*_ATTENTION_FEATURES, "non_causal", "fp8_kv", "strided_kv"),
            summary="chunked prefill against a paged KV cache (mha_extend_with_kvcache, mha_extend_plan)",
            step_runs=True,
        ),
        OperatorSchema(
            "attention.decode",
            dtype_roles=("q", "kv"),
            # batch_bucket: the next power of two >= the batch (kernels ranked by batch size)
            shape_keys=(*_ATTENTION_SHAPES, *_PAGED_SHAPES, *_STRIDED_Q_SHAPES, "q_len", "batch_bucket"),
            features=(*_ATTENTION_FEATURES, "fp8_kv", "spec_decode", "strided_kv"),
            summary="decode against a paged KV cache (mha_decode_with_kvcache, mha_decode_plan, mha_decode_step_plan)",
            layout_hook=True,
            binds=True,
            step_runs=True,
        ),
        OperatorSchema(
            "kvcache.store",
            dtype_roles=("kv", "cache"),
            shape_keys=("head_dim", "head_dim_v", "num_kv_heads", *_PAGED_SHAPES),
            # strided_rows: k and v rows [Hkv, D] with a row stride of their own (a fused qkv
            # projection's k and v, as vLLM passes them); kernels that read them so list it
            features=("fp8_kv", "strided_kv", "strided_rows"),
            summary="write new K/V rows into a paged cache (store_kvcache)",
        ),
        OperatorSchema(
            "moe.topk",
            dtype_roles=("logits",),
            shape_keys=("num_experts", "top_k"),
            features=("softmax", "sigmoid", "renormalize"),
            summary="router scoring and top-k expert choice (moe_topk)",
        ),
        OperatorSchema(
            "moe.apply",
            dtype_roles=("x", "weight"),
            shape_keys=("num_experts", "top_k", "hidden", "intermediate", "num_tokens_bucket"),
            features=(
                "silu",
                "gelu",
                "swiglu_oai",
                "bias",
                "expert_map",
                "mxfp4",
                "fp8_per_tensor",
                "fp8_per_channel",
                "fp8_block",
                "mxfp8_act",
                "fp8_act",
            ),
            summary="mixture-of-experts expert computation and combine (moe_apply)",
            binds=True,
        ),
        # Expert parallelism: the token exchange across the ranks of a process group. x is the
        # activation dtype on both sides (the combine's y is in it too); world_size the group's
        # size, num_experts the global expert count E (len(expert_map)).
        OperatorSchema(
            "moe.dispatch",
            dtype_roles=("x",),
            shape_keys=("world_size", "num_experts", "top_k", "hidden"),
            features=(),
            summary="expert parallelism: each token to the ranks that hold its experts (moe_dispatch, moe_dispatch_plan)",
        ),
        OperatorSchema(
            "moe.combine",
            dtype_roles=("x",),
            shape_keys=("world_size", "hidden"),
            features=(),
            summary="expert parallelism: each token's expert outputs back to its rank, summed (moe_combine)",
        ),
    )
}


def operator_schema(op: str) -> OperatorSchema:
    """The schema of ``op``; ``ValueError`` naming the known operators otherwise."""
    try:
        return OPERATORS[op]
    except KeyError:
        raise ValueError(f"unknown operator {op!r}; known operators: {', '.join(OPERATORS)}") from None
