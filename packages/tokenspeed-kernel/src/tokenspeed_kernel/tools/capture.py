"""Shape capture and replay: turn a ``TOKENSPEED_KERNEL_CAPTURE`` file back into cases.

An engine run with ``TOKENSPEED_KERNEL_CAPTURE=shapes.jsonl`` appends one line per distinct
call signature (``{"op", "kernel", "signature"}``; shapes, dtypes and options, never data).
``bench --replay shapes.jsonl`` benchmarks exactly those signatures (but the expert-parallel
exchange's, which run across ranks: ``cases.NO_CASES``).

Signatures hold totals and maxima, not per-sequence lengths (those live in device tensors
and reading them would synchronize). Replay therefore gives a prefill's or an extend's
first sequence the longest query length (``max_seqlen_q``, so the selector sees the call's
length bucket; a prefill's first sequence also gets ``max_seqlen_k`` keys) and spreads the
rest evenly over the others (the remainder to the first ones), and gives every paged
sequence ``max_seqlen_k`` keys: an upper bound of the work the engine's call did.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from tokenspeed_kernel.tools.cases import NO_CASES, AttentionCase, Case, MoECase

__all__ = ["case_from_signature", "read_capture"]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def _split(total: int, parts: int) -> tuple[int, ...]:
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i < extra else 0) for i in range(parts))


def _split_longest(total: int, parts: int, longest: int) -> tuple[int, ...]:
    """``total`` over ``parts`` sequences, the first one ``longest`` long (as far as the
    total allows), the rest spread evenly."""
    if parts == 1:
        return (total,)
    first = min(longest, total)
    return (first, *_split(total - first, parts - 1))


def _heads(sig: dict[str, Any]) -> dict[str, Any]:
    kv = _DTYPES[sig["kv_dtype"]]
    dtype = _DTYPES[sig["dtype"]]
    return {
        "num_q_heads": sig.get("num_q_heads", sig["num_kv_heads"]),
        "num_kv_heads": sig["num_kv_heads"],
        "head_dim": sig["head_dim"],
        "head_dim_v": sig["head_dim_v"] if sig["head_dim_v"] != sig["head_dim"] else None,
        "dtype": dtype,
        "kv_dtype": kv if kv != dtype else None,
    }


def _options(sig: dict[str, Any]) -> dict[str, Any]:
    return {k: sig[k] for k in ("window_left", "sinks", "logit_cap", "return_lse", "causal") if k in sig}


def _prefill(sig: dict[str, Any]) -> Case:
    b = sig["batch"]
    return AttentionCase(
        "attention.prefill",
        _split_longest(sig["total_q"], b, sig["max_seqlen_q"]),
        _split_longest(sig["total_k"], b, sig["max_seqlen_k"]),
        **_heads(sig),
        **_options(sig),
    )


def _extend(sig: dict[str, Any]) -> Case:
    b = sig["batch"]
    return AttentionCase(
        "attention.extend",
        _split_longest(sig["total_q"], b, sig["max_seqlen_q"]),
        (sig["max_seqlen_k"],) * b,
        page_size=sig["page_size"],
        **_heads(sig),
        **_options(sig),
    )


def _decode(sig: dict[str, Any]) -> Case:
    b = sig["batch"]
    return AttentionCase(
        "attention.decode",
        (sig["q_len"],) * b,
        (sig["max_seqlen_k"],) * b,
        page_size=sig["page_size"],
        **_heads(sig),
        **_options(sig),
    )


def _store(sig: dict[str, Any]) -> Case:
    n = sig["num_tokens"]
    return AttentionCase("kvcache.store", (n,), (n,), page_size=sig["page_size"], **_heads(sig))


def _moe(op: str) -> Callable[[dict[str, Any]], Case]:
    def build(sig: dict[str, Any]) -> Case:
        fields = {k: v for k, v in sig.items() if k in MoECase.__dataclass_fields__}
        fields["dtype"] = _DTYPES[sig["dtype"]]
        fields.setdefault("hidden", 0)
        fields.setdefault("intermediate", 0)
        return MoECase(op=op, **{k: v for k, v in fields.items() if k != "op"})

    return build


_BUILDERS: dict[str, Callable[[dict[str, Any]], Case]] = {
    "attention.prefill": _prefill,
    "attention.extend": _extend,
    "attention.decode": _decode,
    "kvcache.store": _store,
    "moe.topk": _moe("moe.topk"),
    "moe.apply": _moe("moe.apply"),
}


def case_from_signature(op: str, signature: dict[str, Any]) -> Case:
    """The case that replays one captured signature of ``op``."""
    try:
        return _BUILDERS[op](signature)
    except KeyError as exc:
        raise ValueError(f"cannot replay {op}: signature lacks {exc}") from None


def read_capture(path: str) -> list[Case]:
    """The cases of a capture file, one per line, in file order. Lines of an operator with no
    single-process cases (``cases.NO_CASES``: the expert-parallel exchange) are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if record["op"] in NO_CASES:
                    continue
                out.append(case_from_signature(record["op"], record["signature"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a capture record ({exc})") from None
    return out
