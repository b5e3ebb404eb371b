"""Attention and KV-store cases: one description (:class:`AttentionCase`), its inputs, the
call, and the float64 ground truth. Shared by the test suite, ``check`` and ``bench``.

Lengths per sequence: ``seqlens_q`` are the new tokens (queries; for ``kvcache.store`` the
rows written), ``seqlens_k`` the keys each sequence's queries attend over (for extend and
decode: the cache length INCLUDING the new tokens). Decode uses the same ``q_len`` for all
sequences (``seqlens_q[0]``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed_kernel.ops._checks import kv_align
from tokenspeed_kernel.ops.attention._validate import cache_layout, q_layout
from tokenspeed_kernel.ops.attention.api import attention_request
from tokenspeed_kernel.ops.attention.args import DecodeArgs, ExtendArgs, Heads, PrefillArgs
from tokenspeed_kernel.ops.kvcache.api import store_request
from tokenspeed_kernel.ops.kvcache.args import StoreArgs
from tokenspeed_kernel.registry import KernelSpec, Request

__all__ = [
    "CACHE_LAYOUTS",
    "OPS",
    "AttentionCase",
    "awkward_cases",
    "call",
    "make_inputs",
    "plan_call",
    "plan_paths",
    "reference",
    "relayout",
    "request",
]

OPS = ("attention.prefill", "attention.extend", "attention.decode", "kvcache.store")
# How a paged case stores its caches (the views the public call receives; same values):
#   nhd      contiguous [num_pages, P, Hkv, D] K and V
#   hnd      [num_pages, Hkv, P, D] storage, passed as its transpose(1, 2)
#   vllm     one [num_pages, Hkv, P, D + Dv] tensor, K = .transpose(1, 2)[..., :D] and
#            V = [..., D:] (vLLM's interleaved rows)
#   stacked  one [num_pages, 2, P, Hkv, max(D, Dv)] pool, K = pool[:, 0, ..., :D] and
#            V = pool[:, 1, ..., :Dv] (a stacked NHD K/V pool, split in two)
CACHE_LAYOUTS = ("nhd", "hnd", "vllm", "stacked")
_PAGED = ("attention.extend", "attention.decode", "kvcache.store")
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
_FP8_SCALE = 0.05  # stored = value / scale: unit-variance K/V use a good part of e4m3's range


@dataclass(frozen=True)
class AttentionCase:
    """One attention (or KV-store) problem; see the module docstring for the lengths."""

    op: str
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    head_dim_v: int | None = None
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None
    causal: bool = True
    window_left: int = -1
    sinks: bool = False
    logit_cap: float = 0.0
    return_lse: bool = False
    name: str = ""
    cache_layout: str = "nhd"
    # prefill: q, k and v contiguous but one element past a 16-byte boundary (request feature
    # ``unaligned_qkv``: kernels that need 16-byte aligned operands decline the call)
    misaligned: bool = False
    # prefill, extend, decode with q_len 1: q a row-strided view ``[rows, Hq, D]`` of a wider
    # ``[rows, (Hq + 2 Hkv) D]`` buffer, as a fused qkv projection's q (request feature ``strided_q``)
    strided_q: bool = False
    # kvcache.store: k and v row-strided views of one ``[rows, Hkv D + D + Hkv Dv + D]`` buffer
    # (as a fused qkv projection's k and v), NaN after each (request feature ``strided_rows``)
    strided_rows: bool = False

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"AttentionCase.op must be one of {OPS}, got {self.op!r}")
        if len(self.seqlens_q) != len(self.seqlens_k) or not self.seqlens_q:
            raise ValueError("AttentionCase: seqlens_q and seqlens_k need one entry per sequence")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError("AttentionCase: num_q_heads must be a multiple of num_kv_heads")
        if self.op != "attention.prefill" and any(q > k for q, k in zip(self.seqlens_q, self.seqlens_k)):
            raise ValueError("AttentionCase: the cache must hold the new tokens (seqlens_q <= seqlens_k)")
        if self.op == "attention.decode" and len(set(self.seqlens_q)) != 1:
            raise ValueError("AttentionCase: decode needs the same q_len for every sequence")
        if self.cache_layout not in CACHE_LAYOUTS or (self.cache_layout != "nhd" and self.op not in _PAGED):
            raise ValueError(f"AttentionCase.cache_layout must be one of {CACHE_LAYOUTS} (paged operators only)")
        if self.misaligned and self.op != "attention.prefill":
            raise ValueError("AttentionCase.misaligned applies to attention.prefill only")
        if self.strided_q and (self.op == "kvcache.store" or (self.op == "attention.decode" and self.seqlens_q[0] > 1)):
            raise ValueError("AttentionCase.strided_q applies to a 3-D q (prefill, extend, decode with q_len 1)")
        if self.strided_rows and self.op != "kvcache.store":
            raise ValueError("AttentionCase.strided_rows applies to kvcache.store only")

    @property
    def batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def dv(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    def describe(self) -> str:
        b = self.batch
        lq = f"q={self.seqlens_q[0]}" if len(set(self.seqlens_q)) == 1 else f"q={sum(self.seqlens_q)}total"
        lk = f"k={self.seqlens_k[0]}" if len(set(self.seqlens_k)) == 1 else f"k={sum(self.seqlens_k)}total"
        parts = [
            self.name or self.op,
            f"B={b} {lq} {lk}",
            f"H={self.num_q_heads}/{self.num_kv_heads} D={self.head_dim}" + (f"/{self.dv}" if self.head_dim_v else ""),
            _DTYPE_NAMES.get(self.dtype, str(self.dtype)),
        ]
        if self.op in _PAGED:
            parts.append(f"P={self.page_size}" + ("" if self.cache_layout == "nhd" else f" {self.cache_layout}"))
        if self.kv_dtype is not None:
            parts.append(f"kv={_DTYPE_NAMES.get(self.kv_dtype, str(self.kv_dtype))}")
        if not self.causal:
            parts.append("noncausal")
        if self.window_left >= 0:
            parts.append(f"win={self.window_left}")
        if self.sinks:
            parts.append("sinks")
        if self.logit_cap:
            parts.append(f"cap={self.logit_cap:g}")
        if self.return_lse:
            parts.append("lse")
        if self.misaligned:
            parts.append("misaligned")
        if self.strided_q:
            parts.append("strided_q")
        if self.strided_rows:
            parts.append("strided_rows")
        return " ".join(parts)

    def _visible_pairs(self) -> int:
        """(query, key) pairs that pass the causal and window masks, summed over sequences."""
        total = 0
        for lq, lk in zip(self.seqlens_q, self.seqlens_k):
            for i in range(lq):
                pos = lk - lq + i
                hi = pos if self.causal else lk - 1
                lo = max(0, pos - self.window_left) if self.window_left >= 0 else 0
                total += max(0, min(hi, lk - 1) - lo + 1)
        return total

    def _visible_keys(self) -> int:
        """Distinct keys any query of a sequence can see (what a kernel must read)."""
        total = 0
        for lq, lk in zip(self.seqlens_q, self.seqlens_k):
            if lq == 0:
                continue  # no query reads this sequence's keys
            first_pos = lk - lq
            lo = max(0, first_pos - self.window_left) if self.window_left >= 0 else 0
            total += lk - lo
        return total

    def flops(self) -> float:
        """Useful work: ``2·(D + Dv)`` per visible (query, key) pair per query head."""
        if self.op == "kvcache.store":
            return 0.0
        return 2.0 * (self.head_dim + self.dv) * self.num_q_heads * self._visible_pairs()

    def bytes_moved(self) -> float:
        """Fewest bytes: q read, visible K/V read once per KV head, out (+ lse) written;
        for the store, the rows read and written."""
        act = torch.empty(0, dtype=self.dtype).element_size()
        kv = torch.empty(0, dtype=self.cache_dtype).element_size()
        row_kv = self.num_kv_heads * (self.head_dim + self.dv)
        new = sum(self.seqlens_q)
        if self.op == "kvcache.store":
            return float(new * row_kv * (act + kv))
        q_bytes = new * self.num_q_heads * self.head_dim * act
        out_bytes = new * self.num_q_heads * self.dv * act + (new * self.num_q_heads * 4 if self.return_lse else 0)
        kv_bytes = self._visible_keys() * row_kv * (kv if self.op != "attention.prefill" else act)
        return float(q_bytes + out_bytes + kv_bytes)


def _layout_facts(case: AttentionCase) -> tuple[bool, int | None]:
    """``(strided_kv, kv_align)`` of the case's caches, from views of meta tensors (no memory)."""
    if case.op not in _PAGED:
        return False, None
    shape = (2, case.page_size, case.num_kv_heads)  # two pages: a page stride that matters
    meta = torch.device("meta")
    k = torch.empty(*shape, case.head_dim, dtype=case.cache_dtype, device=meta)
    v = torch.empty(*shape, case.dv, dtype=case.cache_dtype, device=meta)
    return cache_layout(*lay_out_caches(k, v, case.cache_layout))


def _qkv_unaligned(case: AttentionCase) -> bool:
    """Whether the case's q, k and v are not all 16-byte aligned (the public call's
    ``unaligned_qkv``), from meta tensors laid out as :func:`make_inputs` lays them out."""
    if case.op != "attention.prefill":
        return False
    meta = torch.device("meta")
    shapes = (
        (2, case.num_q_heads, case.head_dim),
        (2, case.num_kv_heads, case.head_dim),
        (2, case.num_kv_heads, case.dv),
    )
    views = [_laid_out(torch.empty(shape, dtype=case.dtype, device=meta), case.misaligned) for shape in shapes]
    return kv_align(*views) < 16


def _q_facts(case: AttentionCase) -> tuple[bool, int | None]:
    """``(strided_q, q_align)`` of the case's q, from a meta tensor laid out as
    :func:`make_inputs` lays it out (prefill's q alignment is in ``unaligned_qkv``)."""
    if not case.strided_q or case.op == "attention.prefill":
        return case.strided_q, None
    meta = torch.empty(2, case.num_q_heads, case.head_dim, dtype=case.dtype, device=torch.device("meta"))
    return q_layout(_q_rows(case, meta))


def copy_at(t: torch.Tensor, pad: int) -> torch.Tensor:
    """A contiguous copy of ``t`` that starts ``pad`` elements past the start of a fresh
    storage (which is 16-byte aligned); a meta tensor's copy holds no values."""
    flat = torch.empty(t.numel() + pad, dtype=t.dtype, device=t.device)
    out = flat[pad:].view(t.shape)
    if t.device.type != "meta":
        out.copy_(t)
    return out


def _laid_out(t: torch.Tensor, misaligned: bool) -> torch.Tensor:
    """``t`` itself, or (``misaligned``) its copy one element past a 16-byte boundary."""
    return copy_at(t, 1) if misaligned else t


def request(case: AttentionCase) -> Request:
    """The selector request the public operator builds for this case (no tensors needed)."""
    strided, align = _layout_facts(case)
    strided_q, q_align = _q_facts(case)
    if case.op == "kvcache.store":
        return store_request(
            kv_dtype=case.dtype,
            cache_dtype=case.cache_dtype,
            num_kv_heads=case.num_kv_heads,
            head_dim=case.head_dim,
            head_dim_v=case.dv,
            page_size=case.page_size,
            strided_kv=strided,
            kv_align=align,
            strided_rows=case.strided_rows,
        )
    return attention_request(
        case.op,
        q_dtype=case.dtype,
        kv_dtype=case.cache_dtype,
        heads=Heads(case.num_q_heads, case.num_kv_heads, case.head_dim, case.dv),
        causal=case.causal or case.op == "attention.decode",
        window_left=case.window_left,
        sinks=case.sinks,
        logit_cap=case.logit_cap,
        return_lse=case.return_lse,
        page_size=case.page_size if case.op != "attention.prefill" else None,
        q_len=case.seqlens_q[0] if case.op == "attention.decode" else None,
        batch=len(case.seqlens_q) if case.op == "attention.decode" else None,
        max_seqlen_q=max(case.seqlens_q, default=0) if case.op != "attention.decode" else None,
        strided_kv=strided,
        kv_align=align,
        # make_inputs passes one lengths tensor when the lengths are equal (as engines do)
        kv_prefix=case.seqlens_k != case.seqlens_q if case.op == "attention.prefill" else None,
        unaligned_qkv=_qkv_unaligned(case),
        strided_q=strided_q,
        q_align=q_align,
    )


def _cu(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def lay_out_caches(k: torch.Tensor, v: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous caches ``k [num_pages, P, Hkv, D]``, ``v [num_pages, P, Hkv, Dv]`` as the
    strided views of ``layout`` (:data:`CACHE_LAYOUTS`), holding the same values (public:
    tests and tools build engine-shaped caches with it). The stacked pool's padding past
    ``D``/``Dv`` holds NaN, which no kernel may read."""
    d, dv = k.shape[-1], v.shape[-1]
    if layout == "nhd":
        return k, v
    if layout == "hnd":
        return k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "vllm":
        rows = torch.cat([k, v], dim=-1).transpose(1, 2).contiguous().transpose(1, 2)
        return rows[..., :d], rows[..., d:]
    if layout == "stacked":
        pool = torch.full((k.shape[0], 2, *k.shape[1:3], max(d, dv)), float("nan"), dtype=k.dtype, device=k.device)
        pool[:, 0, ..., :d] = k
        pool[:, 1, ..., :dv] = v
        return pool[:, 0, ..., :d], pool[:, 1, ..., :dv]
    raise ValueError(f"cache layout must be one of {CACHE_LAYOUTS}, got {layout!r}")


def _paged(case: AttentionCase, gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """A paged cache holding each sequence's ``seqlens_k`` tokens on shuffled pages, with
    spare pages and random garbage in unused slots (a kernel reading them gets it wrong)."""
    pages_per_seq = [math.ceil(n / case.page_size) for n in case.seqlens_k]
    max_pages = max(max(pages_per_seq), 1)
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=gen, device=device)
    table = torch.full((case.batch, max_pages + 1), -1, dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[start : start + n].to(torch.int32)
        start += n
    table[table < 0] = order[-1].to(torch.int32)  # unused entries point at a valid spare page
    shape = (num_pages, case.page_size, case.num_kv_heads)
    k = torch.randn(*shape, case.head_dim, generator=gen, device=device)
    v = torch.randn(*shape, case.dv, generator=gen, device=device)
    inputs: dict[str, Any] = {"page_table": table}
    if case.cache_dtype == torch.float8_e4m3fn:
        inputs |= {"k_scale": _FP8_SCALE, "v_scale": _FP8_SCALE}
        k, v = (k / _FP8_SCALE).to(torch.float8_e4m3fn), (v / _FP8_SCALE).to(torch.float8_e4m3fn)
    else:
        k, v = k.to(case.cache_dtype), v.to(case.cache_dtype)
    k, v = lay_out_caches(k, v, case.cache_layout)
    inputs |= {"k_cache": k, "v_cache": v}
    return inputs


def _options(case: AttentionCase, gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    sinks = torch.randn(case.num_q_heads, generator=gen, device=device) if case.sinks else None
    return {"window_left": case.window_left, "sinks": sinks, "logit_cap": case.logit_cap, "return_lse": case.return_lse}


def _q_rows(case: AttentionCase, q: torch.Tensor) -> torch.Tensor:
    """``q`` itself, or (``case.strided_q``) its values in the first ``Hq * D`` columns of a
    ``[rows, (Hq + 2 Hkv) D]`` buffer whose other columns hold NaN (a fused qkv projection's
    layout; a kernel that reads past a row's q fails the float64 comparison)."""
    if not case.strided_q:
        return q
    rows, heads, dim = q.shape
    buf = torch.full((rows, (heads + 2 * case.num_kv_heads) * dim), float("nan"), dtype=q.dtype, device=q.device)
    buf[:, : heads * dim] = q.reshape(rows, heads * dim)
    return buf[:, : heads * dim].view(rows, heads, dim)


def _kv_rows(case: AttentionCase, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` and ``v`` themselves, or (``case.strided_rows``) their values in one buffer of
    rows ``[k | D NaN | v | D NaN]`` (a fused projection's k and v, each row-strided; a kernel
    that reads past a row's k or v stores NaN and fails the comparison)."""
    if not case.strided_rows:
        return k, v
    rows, heads, dim = k.shape
    dim_v = v.shape[2]
    width = heads * dim + dim + heads * dim_v + dim
    buf = torch.full((rows, width), float("nan"), dtype=k.dtype, device=k.device)
    k_at, v_at = buf[:, : heads * dim], buf[:, heads * dim + dim : heads * (dim + dim_v) + dim]
    k_at.copy_(k.reshape(rows, -1))
    v_at.copy_(v.reshape(rows, -1))
    return k_at.view(rows, heads, dim), v_at.view(rows, heads, dim_v)


def make_inputs(case: AttentionCase, device: torch.device | str = "cpu", seed: int = 0) -> dict[str, Any]:
    """Keyword arguments for the public function of ``case.op`` (without ``override``/``out``).

    Values are standard normal (never zeros), drawn on ``device`` from a generator seeded
    with ``seed``; sinks ``N(0, 1)``; fp8 caches store ``N(0, 1) / 0.05`` with scale 0.05;
    pages are shuffled, the last page of a sequence is partial when the length is not a
    multiple of the page size, and unused slots hold garbage.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    total_q = sum(case.seqlens_q)
    if case.op == "attention.prefill":
        total_k = sum(case.seqlens_k)
        cu_q = _cu(case.seqlens_q, device)
        q, k, v = (
            _laid_out(torch.randn(rows, heads, dim, generator=gen, device=device).to(case.dtype), case.misaligned)
            for rows, heads, dim in (
                (total_q, case.num_q_heads, case.head_dim),
                (total_k, case.num_kv_heads, case.head_dim),
                (total_k, case.num_kv_heads, case.dv),
            )
        )
        return {
            "q": _q_rows(case, q),
            "k": k,
            "v": v,
            "cu_seqlens_q": cu_q,
            # Keys as long as the queries (no prefix): one tensor for both, as engines pass it
            # (a kernel may rely on that identity: trtllm_fmha_prefill).
            "cu_seqlens_k": cu_q if case.seqlens_k == case.seqlens_q else _cu(case.seqlens_k, device),
            "max_seqlen_q": max(case.seqlens_q),
            "max_seqlen_k": max(case.seqlens_k),
            "causal": case.causal,
            **_options(case, gen, device),
        }
    paged = _paged(case, gen, device)
    cache_seqlens = torch.tensor(case.seqlens_k, dtype=torch.int32, device=device)
    if case.op == "kvcache.store":
        size = case.page_size
        slots = []
        for b, (new, length) in enumerate(zip(case.seqlens_q, case.seqlens_k)):
            for pos in range(length - new, length):
                slots.append(int(paged["page_table"][b, pos // size]) * size + pos % size)
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        if slots:
            slot_mapping[:: max(2, len(slots) // 2)] = -1  # some padding rows
        k = torch.randn(total_q, case.num_kv_heads, case.head_dim, generator=gen, device=device).to(case.dtype)
        v = torch.randn(total_q, case.num_kv_heads, case.dv, generator=gen, device=device).to(case.dtype)
        k, v = _kv_rows(case, k, v)
        extra: dict[str, Any] = {key: paged[key] for key in ("k_scale", "v_scale") if key in paged}
        return {
            "k": k,
            "v": v,
            "k_cache": paged["k_cache"],
            "v_cache": paged["v_cache"],
            "slot_mapping": slot_mapping,
            **extra,
        }
    common = {
        **paged,
        "cache_seqlens": cache_seqlens,
        "max_seqlen_k": max(case.seqlens_k),
        **_options(case, gen, device),
    }
    if case.op == "attention.extend":
        q = torch.randn(total_q, case.num_q_heads, case.head_dim, generator=gen, device=device).to(case.dtype)
        return {
            "q": _q_rows(case, q),
            "cu_seqlens_q": _cu(case.seqlens_q, device),
            "max_seqlen_q": max(case.seqlens_q),
            "causal": case.causal,
            **common,
        }
    q_len = case.seqlens_q[0]
    shape = (
        (case.batch, case.num_q_heads, case.head_dim)
        if q_len == 1
        else (case.batch, q_len, case.num_q_heads, case.head_dim)
    )
    q = torch.randn(*shape, generator=gen, device=device).to(case.dtype)
    return {"q": _q_rows(case, q) if q.dim() == 3 else q, **common}


def _public(op: str) -> Callable[..., Any]:
    from tokenspeed_kernel.ops.attention import mha_decode_with_kvcache, mha_extend_with_kvcache, mha_prefill
    from tokenspeed_kernel.ops.kvcache import store_kvcache

    public: dict[str, Callable[..., Any]] = {
        "attention.prefill": mha_prefill,
        "attention.extend": mha_extend_with_kvcache,
        "attention.decode": mha_decode_with_kvcache,
        "kvcache.store": store_kvcache,
    }
    return public[op]


def call(
    case: AttentionCase, inputs: dict[str, Any], override: str | None = None, out: torch.Tensor | None = None
) -> Any:
    """Run the public operator. Attention returns ``out`` or ``(out, lse)``; the store
    writes the caches in ``inputs`` in place and returns ``(k_cache, v_cache)``."""
    if case.op == "kvcache.store":
        _public(case.op)(**inputs, override=override)
        return inputs["k_cache"], inputs["v_cache"]
    return _public(case.op)(**inputs, out=out, override=override)


def planned_call(case: AttentionCase, inputs: dict[str, Any], override: str | None = None) -> Callable[[], Any]:
    """The call an engine makes every step; attention kernels keep no weights to plan, so it
    is the public call."""
    return functools.partial(call, case, inputs, override)


# The step plans and the per-layer tensors their runs take (positional, then keyword).
_STEP_PLANS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "attention.prefill": ("mha_prefill_plan", ("q", "k", "v"), ("sinks",)),
    "attention.extend": ("mha_extend_plan", ("q", "k_cache", "v_cache"), ("sinks", "k_scale", "v_scale")),
    "attention.decode": ("mha_decode_step_plan", ("q", "k_cache", "v_cache"), ("sinks", "k_scale", "v_scale")),
}


def plan_paths(case: AttentionCase, spec: KernelSpec) -> tuple[str, ...]:
    """The plans whose path ``spec``'s hooks claim serves ``case`` as the call does: ``"step"``
    (the operator's step plan) for a ``step_runner`` hook, ``"decode"`` (``mha_decode_plan``)
    for a decode kernel's ``bind`` or ``prepare_layout`` hook (a row-strided q included: the
    plan is made with its ``q_row_stride``); none for the KV store."""
    if case.op == "kvcache.store":
        return ()
    step = ("step",) if spec.step_runner is not None else ()
    hooked = spec.bind is not None or spec.prepare_layout is not None
    decode = case.op == "attention.decode" and hooked
    return (*step, *(("decode",) if decode else ()))


def plan_call(
    case: AttentionCase, inputs: dict[str, Any], override: str | None, out: torch.Tensor | None, path: str
) -> Any:
    """``case`` through plan ``path`` (one of :func:`plan_paths`) with kernel ``override``, run
    twice into ``out`` (the first run asks for the kernel's hook's runner, the second is served
    by it): ``"step"`` through the operator's step plan made from the call's own arguments,
    ``"decode"`` through ``mha_decode_plan`` (``plan.run(q)``; a row-strided q's plan made with
    its ``q_row_stride``). Returns the second run's result."""
    import tokenspeed_kernel

    if path == "decode":
        plan = tokenspeed_kernel.mha_decode_plan(
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["page_table"],
            inputs["cache_seqlens"],
            inputs["max_seqlen_k"],
            num_q_heads=case.num_q_heads,
            q_len=case.seqlens_q[0],
            q_dtype=inputs["q"].dtype,
            **{k: inputs[k] for k in ("window_left", "sinks", "logit_cap", "return_lse")},
            **{k: inputs[k] for k in ("k_scale", "v_scale") if k in inputs},
            override=override,
            q_row_stride=inputs["q"].stride(0) if case.strided_q else None,
        )
        plan.run(inputs["q"], out=out)
        return plan.run(inputs["q"], out=out)
    make, positional, keywords = _STEP_PLANS[case.op]
    step = getattr(tokenspeed_kernel, make)(**inputs, override=override)
    layer = [inputs[k] for k in positional]
    options = {k: inputs[k] for k in keywords if k in inputs}
    step.run(*layer, **options, out=out)
    return step.run(*layer, **options, out=out)


# The tensors that describe a batch's layout: what a kernel that plans per layout keys on.
_LAYOUT_KEYS = ("cu_seqlens_q", "cu_seqlens_k", "page_table", "cache_seqlens")


def relayout(case: AttentionCase, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """``inputs`` with new layout tensors (``cu_seqlens_*``, ``page_table``,
    ``cache_seqlens``) holding the same values, as an engine's next step would pass; None for
    the KV store, which takes no layout."""
    if case.op == "kvcache.store":
        return None
    clones: dict[int, Any] = {}  # one clone per tensor: cu_seqlens_k may be cu_seqlens_q itself
    return {
        key: clones.setdefault(id(value), value.clone()) if key in _LAYOUT_KEYS else value
        for key, value in inputs.items()
    }


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.float64)


def _scale64(value: Any, device: torch.device) -> torch.Tensor | None:
    if value is None:
        return None
    return torch.as_tensor(value, dtype=torch.float64, device=device).reshape(1)


def reference(case: AttentionCase, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float64 ground truth by the reference kernels on float64 copies of the inputs.

    Attention → ``(out float64, lse float64 or None)`` shaped like the public outputs; the
    store → the expected ``(k_cache, v_cache)`` (cache dtype; inputs are not modified). fp8
    caches are passed as stored, with their scales, so dequantization is exact.
    """
    from tokenspeed_kernel.ops._operator import operator

    ground_truth = operator(case.op).reference_kernel().fn
    if case.op == "kvcache.store":
        k_cache, v_cache = inputs["k_cache"].clone(), inputs["v_cache"].clone()
        scales = [_scale64(inputs.get(n), k_cache.device) for n in ("k_scale", "v_scale")]
        ground_truth(
            StoreArgs(
                inputs["k"],
                inputs["v"],
                k_cache,
                v_cache,
                inputs["slot_mapping"],
                *[None if s is None else s.float() for s in scales],
            )
        )
        return k_cache, v_cache
    q = inputs["q"].to(torch.float64)
    heads = case.num_q_heads
    scale = 1.0 / math.sqrt(case.head_dim)
    common: dict[str, Any] = {
        "softmax_scale": scale,
        "window_left": case.window_left,
        "sinks": _f64(inputs["sinks"]),
        "logit_cap": float(case.logit_cap),
    }
    if case.op == "attention.prefill":
        out = q.new_empty(q.shape[0], heads, case.dv)
        lse = q.new_empty(q.shape[0], heads)
        ground_truth(
            PrefillArgs(
                q,
                inputs["k"].to(torch.float64),
                inputs["v"].to(torch.float64),
                inputs["cu_seqlens_q"],
                inputs["cu_seqlens_k"],
                inputs["max_seqlen_q"],
                inputs["max_seqlen_k"],
                case.causal,
                out=out,
                lse=lse,
                **common,
            )
        )
        return out, lse if case.return_lse else None
    ks, vs = _scale64(inputs.get("k_scale"), q.device), _scale64(inputs.get("v_scale"), q.device)
    cache = (inputs["k_cache"], inputs["v_cache"], inputs["page_table"])
    if case.op == "attention.extend":
        out = q.new_empty(q.shape[0], heads, case.dv)
        lse = q.new_empty(q.shape[0], heads)
        ground_truth(
            ExtendArgs(
                q,
                *cache,
                inputs["cu_seqlens_q"],
                inputs["cache_seqlens"],
                inputs["max_seqlen_q"],
                inputs["max_seqlen_k"],
                case.causal,
                k_scale=ks,
                v_scale=vs,
                out=out,
                lse=lse,
                **common,
            )
        )
        return out, lse if case.return_lse else None
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    out = q4.new_empty(*q4.shape[:-1], case.dv)
    lse = q4.new_empty(*q4.shape[:-1])
    ground_truth(
        DecodeArgs(
            q4,
            *cache,
            inputs["cache_seqlens"],
            inputs["max_seqlen_k"],
            k_scale=ks,
            v_scale=vs,
            out=out,
            lse=lse,
            **common,
        )
    )
    out = out if q.dim() == 4 else out.squeeze(1)
    return out, lse.flatten(0, 1) if case.return_lse else None


def awkward_cases(op: str, dtype: torch.dtype = torch.bfloat16) -> list[AttentionCase]:
    """Small awkward shapes (CPU / interpreter sized, <= ~300 tokens) covering every option:
    ragged lengths including 1, partial pages, page sizes 1/16/64, GQA 1/4/8 and MQA,
    windows (incl. 0), sinks, logit cap, LSE, Dv != D, non-causal, speculative decode, fp8 KV,
    empty sequences (no queries, or no keys: a row that sees only the sink), strided
    caches (every :data:`CACHE_LAYOUTS` layout but ``nhd``) and misaligned q/k/v (prefill). New cases are
    appended, so the index of an existing case stays put."""
    fp8 = torch.float8_e4m3fn
    if op == "attention.prefill":
        return [
            AttentionCase(op, (1, 17, 40), (1, 17, 40), 4, 4, 64, dtype=dtype, name="mha_ragged"),
            AttentionCase(
                op,
                (5, 33),
                (20, 70),
                8,
                2,
                64,
                dtype=dtype,
                sinks=True,
                return_lse=True,
                name="gqa4_bottom_right_sinks",
            ),
            AttentionCase(op, (48,), (48,), 8, 1, 32, dtype=dtype, window_left=7, sinks=True, name="mqa_window_sinks"),
            AttentionCase(op, (9, 30), (9, 30), 8, 1, 64, dtype=dtype, window_left=0, name="window0"),
            AttentionCase(
                op,
                (12, 3),
                (12, 25),
                4,
                2,
                64,
                32,
                dtype=dtype,
                causal=False,
                logit_cap=5.0,
                return_lse=True,
                name="noncausal_cap_dv",
            ),
            AttentionCase(
                op, (40,), (40,), 16, 2, 128, dtype=dtype, window_left=15, logit_cap=30.0, name="gqa8_d128_window_cap"
            ),
            AttentionCase(
                op,
                (0, 6, 3),
                (0, 0, 11),
                4,
                2,
                32,
                dtype=dtype,
                causal=False,
                sinks=True,
                return_lse=True,
                name="empty_seqs_sink_only",
            ),
            # q/k/v one element past a 16-byte boundary: kernels that need aligned operands
            # (TMA, 16-byte vectors) decline it, the rest must serve it
            AttentionCase(
                op, (7, 64), (7, 64), 8, 2, 64, dtype=dtype, sinks=True, misaligned=True, name="misaligned_qkv"
            ),
        ]
    if op == "attention.extend":
        return [
            AttentionCase(
                op,
                (7, 1, 20),
                (30, 9, 20),
                8,
                2,
                64,
                page_size=16,
                dtype=dtype,
                sinks=True,
                return_lse=True,
                name="ragged_prefix",
            ),
            AttentionCase(op, (16, 5), (50, 5), 4, 4, 64, page_size=1, dtype=dtype, window_left=9, name="page1_window"),
            AttentionCase(
                op, (24,), (90,), 8, 1, 32, page_size=64, dtype=dtype, kv_dtype=fp8, sinks=True, name="fp8_page64_mqa"
            ),
            AttentionCase(
                op,
                (6, 10),
                (33, 10),
                4,
                2,
                64,
                32,
                page_size=4,
                dtype=dtype,
                causal=False,
                logit_cap=5.0,
                name="noncausal_cap_dv",
            ),
            AttentionCase(
                op, (0, 5, 1), (12, 5, 1), 4, 1, 32, page_size=8, dtype=dtype, return_lse=True, name="empty_chunk"
            ),
            AttentionCase(
                op,
                (9, 1),
                (40, 23),
                8,
                2,
                64,
                page_size=16,
                dtype=dtype,
                window_left=15,
                sinks=True,
                name="vllm_interleaved",
                cache_layout="vllm",
            ),
            AttentionCase(
                op,
                (5, 12),
                (21, 12),
                4,
                2,
                64,
                32,
                page_size=8,
                dtype=dtype,
                return_lse=True,
                name="stacked_dv",
                cache_layout="stacked",
            ),
        ]
    if op == "attention.decode":
        return [
            AttentionCase(
                op,
                (1,) * 4,
                (1, 17, 40, 33),
                8,
                2,
                64,
                page_size=16,
                dtype=dtype,
                sinks=True,
                return_lse=True,
                name="ragged_sinks_lse",
            ),
            AttentionCase(
                op, (1,) * 3, (70, 5, 64), 8, 1, 64, page_size=1, dtype=dtype, window_left=12, name="page1_mqa_window"
            ),
            AttentionCase(
                op,
                (4,) * 3,
                (4, 37, 80),
                8,
                2,
                64,
                page_size=16,
                dtype=dtype,
                sinks=True,
                window_left=20,
                name="spec_decode_q4",
            ),
            AttentionCase(
                op,
                (1,) * 2,
                (100, 31),
                4,
                4,
                128,
                page_size=64,
                dtype=dtype,
                kv_dtype=fp8,
                logit_cap=20.0,
                name="fp8_d128_cap",
            ),
            AttentionCase(
                op, (1,) * 3, (9, 16, 45), 16, 2, 64, 32, page_size=8, dtype=dtype, return_lse=True, name="gqa8_dv32"
            ),
            AttentionCase(
                op,
                (1,) * 3,
                (1, 40, 70),
                8,
                2,
                64,
                page_size=16,
                dtype=dtype,
                sinks=True,
                window_left=20,
                return_lse=True,
                name="vllm_interleaved_sinks_window",
                cache_layout="vllm",
            ),
            AttentionCase(
                op, (1,) * 2, (33, 7), 8, 2, 64, page_size=8, dtype=dtype, name="hnd_gqa4", cache_layout="hnd"
            ),
            AttentionCase(
                op,
                (2,) * 2,
                (18, 30),
                4,
                2,
                64,
                page_size=16,
                dtype=dtype,
                kv_dtype=fp8,
                sinks=True,
                name="stacked_fp8_spec",
                cache_layout="stacked",
            ),
        ]
    if op == "kvcache.store":
        return [
            AttentionCase(op, (5, 1, 16), (20, 1, 40), 2, 2, 64, page_size=16, dtype=dtype, name="store_ragged"),
            AttentionCase(op, (7, 3), (7, 9), 1, 1, 32, 16, page_size=1, dtype=dtype, name="store_page1_dv"),
            AttentionCase(op, (9,), (30,), 2, 2, 64, page_size=4, dtype=dtype, kv_dtype=fp8, name="store_fp8"),
            AttentionCase(
                op, (6, 2), (20, 9), 2, 2, 64, page_size=16, dtype=dtype, name="store_vllm", cache_layout="vllm"
            ),
            AttentionCase(
                op, (4,), (11,), 2, 1, 32, 16, page_size=4, dtype=dtype, name="store_stacked_dv", cache_layout="stacked"
            ),
            AttentionCase(
                op,
                (5,),
                (13,),
                2,
                2,
                64,
                page_size=8,
                dtype=dtype,
                kv_dtype=fp8,
                name="store_hnd_fp8",
                cache_layout="hnd",
            ),
        ]
    raise ValueError(f"no attention cases for operator {op!r}; expected one of {OPS}")
