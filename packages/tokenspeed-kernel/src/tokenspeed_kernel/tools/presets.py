"""Named shape presets for check, bench, explain and profile, as data.

``gpt-oss-120b``  the reference workload at serving sizes: attention with 64 query heads,
                  8 KV heads, head dim 64, bf16, learned sinks, layers alternating full
                  attention and a 128-token sliding window (``window_left=127``: a query
                  sees itself and the 127 keys before it), page size 16; the MoE layer with
                  128 experts top-4, hidden = intermediate = 2880, biases, swiglu_oai, in
                  MXFP4 (the model's format), bf16 and fp8 (per-channel) weights.
``small``         one tiny case per operator (CPU-cheap; what ``check all`` runs by default).
``awkward``       the awkward-shape cases of the case modules (ragged, partial pages, ...).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase, Case
from tokenspeed_kernel.tools.cases.moe import gpt_oss_case

__all__ = ["PRESETS", "preset_cases"]

_HQ, _HKV, _D, _WIN, _PAGE = 64, 8, 64, 127, 16


def _att(op: str, batch: int, q: int, k: int, name: str, **kw) -> AttentionCase:
    kw.setdefault("sinks", True)
    return AttentionCase(op, (q,) * batch, (k,) * batch, _HQ, _HKV, _D, page_size=_PAGE, name=name, **kw)


def _gpt_oss_attention(op: str) -> list[Case]:
    if op == "attention.prefill":
        return [
            _att(op, 1, 8192, 8192, "prefill_b1_s8192"),
            _att(op, 1, 8192, 8192, "prefill_b1_s8192_nosinks", sinks=False),
            _att(op, 4, 4096, 4096, "prefill_b4_s4096"),
            _att(op, 1, 8192, 8192, "prefill_b1_s8192_win128", window_left=_WIN),
        ]
    if op == "attention.extend":
        return [
            _att(op, 1, 2048, 8192, "extend_2048_on_6144"),
            _att(op, 1, 2048, 8192, "extend_2048_on_6144_win128", window_left=_WIN),
        ]
    if op == "attention.decode":
        return [
            _att(op, 64, 1, 8192, "decode_b64_ctx8192"),
            _att(op, 64, 1, 8192, "decode_b64_ctx8192_nosinks", sinks=False),
            _att(op, 256, 1, 2048, "decode_b256_ctx2048"),
            _att(op, 1, 1, 8192, "decode_b1_ctx8192"),
            _att(op, 64, 1, 8192, "decode_b64_ctx8192_win128", window_left=_WIN),
            _att(op, 64, 4, 8192, "decode_b64_ctx8192_spec4"),
            _att(op, 64, 1, 8192, "decode_b64_ctx8192_fp8kv", kv_dtype=torch.float8_e4m3fn),
        ]
    return [
        AttentionCase(op, (1,) * 64, (8192,) * 64, _HKV, _HKV, _D, page_size=_PAGE, name="store_decode_b64"),
        AttentionCase(op, (8192,), (8192,), _HKV, _HKV, _D, page_size=_PAGE, name="store_prefill_8192"),
    ]


def _gpt_oss_moe(op: str) -> list[Case]:
    if op == "moe.topk":
        return [gpt_oss_case(t, op) for t in (1, 64, 4096)]
    mx = [gpt_oss_case(t) for t in (1, 8, 64, 512, 4096)]
    other = [
        dataclasses.replace(gpt_oss_case(t), weight_format=fmt, name=f"gpt_oss_120b_t{t}_{fmt}")
        for fmt in ("plain", "fp8_per_channel")
        for t in (1, 64, 4096)
    ]
    return mx + other


def _gpt_oss(op: str) -> list[Case]:
    return _gpt_oss_attention(op) if op in cases.attention.OPS else _gpt_oss_moe(op)


def _small(op: str) -> list[Case]:
    return cases.awkward_cases(op, torch.bfloat16)[:1]


def _awkward(op: str) -> list[Case]:
    return cases.awkward_cases(op, torch.bfloat16) + cases.awkward_cases(op, torch.float16)


PRESETS: dict[str, Callable[[str], list[Case]]] = {
    "gpt-oss-120b": _gpt_oss,
    "small": _small,
    "awkward": _awkward,
}


def preset_cases(preset: str, op: str) -> list[Case]:
    """The cases of ``preset`` for ``op``; ``ValueError`` naming the known presets/ops."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}")
    cases.module_for(op)
    return PRESETS[preset](op)
