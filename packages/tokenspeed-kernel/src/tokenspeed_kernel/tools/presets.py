"""Named shape presets for check, bench, explain and profile, as data.

``gpt-oss-120b``  the reference workload at serving sizes. Attention: 64 query heads, 8 KV
                  heads, head dim 64, bf16, learned sinks, page size 16; every shape is
                  listed once per layer kind of the model, which alternates full-attention
                  layers and 128-token sliding-window layers (:data:`LAYER_KINDS`). MoE: 128
                  experts top-4, hidden = intermediate = 2880, biases, swiglu_oai, at
                  T = 1, 8, 64, 512, 4096 tokens, with MXFP4 weights (the model's format),
                  bf16 and fp8 (per-channel) weights.
``prefill-lengths``  ``attention.prefill`` only (no cases for the other operators): GPT-OSS
                  heads, bf16, full-attention layers, at query lengths 512 to 16384, one
                  sequence or several, a ragged batch, without sinks, non-causal. The sweep
                  for ranking prefill kernels by length (``max_seqlen_q_bucket``).
``extend-lengths``  ``attention.extend`` only: GPT-OSS heads, bf16, sinks, page size 16,
                  full-attention layers, 16 to 2048 new tokens on a 6144-token paged prefix,
                  a batch of four and a ragged batch. The sweep for ranking extend kernels
                  by length (``max_seqlen_q_bucket``).
``prefill-lengths-d128``, ``extend-lengths-d128``  the two sweeps at head dim 128 (the
                  kernels rank per head dim: a D = 64 measurement does not rank D = 128).
``moe-decode-bf16``  ``moe.apply`` only: GPT-OSS-120B's MoE layer (128 experts top-4, H = I =
                  2880, biases, swiglu_oai) with bf16 weights at T = 1, 2, 4, 8 and 16 (the
                  GEMV kernels' limit and the first count above it). The sweep for ranking the
                  16-bit-weight decode kernels by token count (``num_tokens_bucket``).
``small``         one tiny case per operator (CPU-cheap; the first awkward case in bf16).
``awkward``       the awkward-shape cases of the case modules (ragged lengths, partial
                  pages, GQA ratios, windows, sinks, ...) in bf16 and fp16.

The window convention: GPT-OSS's ``sliding_window = 128`` means a query sees itself and
the 127 keys before it (128 keys in all), which in our API is ``window_left = 127``
(``i - j <= window_left``). ``window_left = 128`` would show 129 keys.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase, Case
from tokenspeed_kernel.tools.cases.moe import gpt_oss_case

__all__ = ["LAYER_KINDS", "PRESETS", "preset_cases"]

_HQ, _HKV, _D, _PAGE = 64, 8, 64, 16

# GPT-OSS layer kinds: (case-name suffix, window_left). See the module docstring.
LAYER_KINDS: tuple[tuple[str, int], ...] = (("", -1), ("_win128", 127))


@dataclasses.dataclass(frozen=True)
class _Shape:
    """One attention shape of the preset: ``batch`` sequences of ``q`` new tokens over ``k``
    keys in all (for the store: ``q`` tokens written per sequence), plus case options."""

    name: str
    batch: int
    q: int
    k: int
    options: tuple[tuple[str, Any], ...] = ()
    windowed: bool = True  # also listed for the sliding-window layers


_FP8 = torch.float8_e4m3fn
_ATTENTION_SHAPES: dict[str, tuple[_Shape, ...]] = {
    "attention.prefill": (
        _Shape("prefill_b1_s8192", 1, 8192, 8192),
        _Shape("prefill_b1_s8192_nosinks", 1, 8192, 8192, (("sinks", False),)),
        _Shape("prefill_b4_s4096", 4, 4096, 4096),
    ),
    "attention.extend": (_Shape("extend_2048_on_6144", 1, 2048, 8192),),
    "attention.decode": (
        _Shape("decode_b64_ctx8192", 64, 1, 8192),
        _Shape("decode_b64_ctx8192_nosinks", 64, 1, 8192, (("sinks", False),)),
        _Shape("decode_b256_ctx2048", 256, 1, 2048),
        _Shape("decode_b1_ctx8192", 1, 1, 8192),
        _Shape("decode_b8_ctx8192", 8, 1, 8192),
        _Shape("decode_b64_ctx8192_spec4", 64, 4, 8192),
        _Shape("decode_b64_ctx8192_fp8kv", 64, 1, 8192, (("kv_dtype", _FP8),)),
    ),
    # The store has no window and its query heads are unused (num_q_heads = Hkv).
    "kvcache.store": (
        _Shape("store_decode_b64", 64, 1, 8192, (("num_q_heads", _HKV), ("sinks", False)), windowed=False),
        _Shape("store_prefill_8192", 1, 8192, 8192, (("num_q_heads", _HKV), ("sinks", False)), windowed=False),
    ),
}


def _attention_case(op: str, shape: _Shape, suffix: str, window_left: int) -> AttentionCase:
    fields: dict[str, Any] = {"num_q_heads": _HQ, "sinks": True, **dict(shape.options)}
    return AttentionCase(
        op,
        (shape.q,) * shape.batch,
        (shape.k,) * shape.batch,
        num_kv_heads=_HKV,
        head_dim=_D,
        page_size=_PAGE,
        window_left=window_left,
        name=shape.name + suffix,
        **fields,
    )


def _gpt_oss_attention(op: str) -> list[Case]:
    return [
        _attention_case(op, shape, suffix, window)
        for suffix, window in LAYER_KINDS
        for shape in _ATTENTION_SHAPES[op]
        if shape.windowed or window < 0
    ]


_MOE_TOKENS = (1, 8, 64, 512, 4096)
# The model's MXFP4 first (names without a suffix), then the same layer with bf16 ("plain")
# and fp8 per-channel weights.
_MOE_FORMATS: dict[str, str] = {"mxfp4": "", "plain": "_bf16", "fp8_per_channel": "_fp8"}


def _gpt_oss_topk(op: str) -> list[Case]:
    return [gpt_oss_case(t, op) for t in _MOE_TOKENS]


def _gpt_oss_apply(op: str) -> list[Case]:
    return [
        dataclasses.replace(gpt_oss_case(t, op), weight_format=fmt, name=f"gpt_oss_120b_t{t}{suffix}")
        for fmt, suffix in _MOE_FORMATS.items()
        for t in _MOE_TOKENS
    ]


_GPT_OSS: dict[str, Callable[[str], list[Case]]] = {
    **{op: _gpt_oss_attention for op in _ATTENTION_SHAPES},
    "moe.topk": _gpt_oss_topk,
    "moe.apply": _gpt_oss_apply,
}


def _gpt_oss(op: str) -> list[Case]:
    return _GPT_OSS[op](op)


_SWEEP_FIELDS: dict[str, Any] = {"num_q_heads": _HQ, "sinks": True}
# (name, query = key lengths per sequence, options): the prefill length sweep.
_LENGTH_SWEEP: tuple[tuple[str, tuple[int, ...], tuple[tuple[str, Any], ...]], ...] = (
    ("prefill_b1_s512", (512,), ()),
    ("prefill_b1_s1024", (1024,), ()),
    ("prefill_b1_s2048", (2048,), ()),
    ("prefill_b1_s4096", (4096,), ()),
    ("prefill_b1_s8192", (8192,), ()),
    ("prefill_b1_s16384", (16384,), ()),
    ("prefill_b8_s1024", (1024,) * 8, ()),
    ("prefill_b8_s2048", (2048,) * 8, ()),
    ("prefill_b4_s4096", (4096,) * 4, ()),
    ("prefill_ragged_8192_2000_300_37", (8192, 2000, 300, 37), ()),
    ("prefill_b1_s2048_nosinks", (2048,), (("sinks", False),)),
    ("prefill_b1_s8192_nosinks", (8192,), (("sinks", False),)),
    ("prefill_b1_s8192_noncausal", (8192,), (("causal", False),)),
)


def _prefill_lengths(op: str, head_dim: int = _D) -> list[Case]:
    """The length sweep (``prefill-lengths``): prefill only, no cases for the other operators."""
    if op != "attention.prefill":
        return []
    return [
        AttentionCase(
            op, lengths, lengths, num_kv_heads=_HKV, head_dim=head_dim, name=name, **{**_SWEEP_FIELDS, **dict(options)}
        )
        for name, lengths, options in _LENGTH_SWEEP
    ]


# (name, new tokens per sequence, keys per sequence = prefix + new): the extend length sweep.
_EXTEND_SWEEP: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = (
    *((f"extend_{q}_on_6144", (q,), (6144 + q,)) for q in (16, 64, 256, 512, 1024, 2048)),
    ("extend_b4_512_on_2048", (512,) * 4, (2560,) * 4),
    ("extend_ragged_1024_300_37_2", (1024, 300, 37, 2), (7168, 2348, 4133, 98)),
)


def _extend_lengths(op: str, head_dim: int = _D) -> list[Case]:
    """The extend length sweep (``extend-lengths``): extend only."""
    if op != "attention.extend":
        return []
    return [
        AttentionCase(op, q, k, num_kv_heads=_HKV, head_dim=head_dim, page_size=_PAGE, name=name, **_SWEEP_FIELDS)
        for name, q, k in _EXTEND_SWEEP
    ]


_MOE_DECODE_TOKENS = (1, 2, 4, 8, 16)


def _moe_decode_bf16(op: str) -> list[Case]:
    """The bf16-weight decode sweep (``moe-decode-bf16``): ``moe.apply`` only."""
    if op != "moe.apply":
        return []
    return [
        dataclasses.replace(gpt_oss_case(t, op), weight_format="plain", name=f"gpt_oss_120b_t{t}_bf16")
        for t in _MOE_DECODE_TOKENS
    ]


def _small(op: str) -> list[Case]:
    return cases.awkward_cases(op, torch.bfloat16)[:1]


def _awkward(op: str) -> list[Case]:
    return cases.awkward_cases(op, torch.bfloat16) + cases.awkward_cases(op, torch.float16)


PRESETS: dict[str, Callable[[str], list[Case]]] = {
    "gpt-oss-120b": _gpt_oss,
    "prefill-lengths": _prefill_lengths,
    "extend-lengths": _extend_lengths,
    "prefill-lengths-d128": functools.partial(_prefill_lengths, head_dim=128),
    "extend-lengths-d128": functools.partial(_extend_lengths, head_dim=128),
    "moe-decode-bf16": _moe_decode_bf16,
    "small": _small,
    "awkward": _awkward,
}


def preset_cases(preset: str, op: str) -> list[Case]:
    """The cases of ``preset`` for ``op``; ``ValueError`` naming the known presets/ops."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    cases.module_for(op)
    return PRESETS[preset](op)
