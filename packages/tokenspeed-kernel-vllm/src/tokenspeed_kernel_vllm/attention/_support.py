"""What the TOKENSPEED backend serves, decided from tokenspeed-kernel's registry.

vLLM validates a backend before it builds any layer (``AttentionBackend.validate_configuration``
with the head size, model dtype, ``--kv-cache-dtype`` and ``--block-size``). The answers here
are data, not guesses: the KV dtypes this backend can hand to the public calls, the kernel page
sizes it declares, and — for everything else — whether the tokenspeed-kernel selector has a
non-reference kernel for each call the backend makes (``attention.decode``,
``attention.extend``, ``kvcache.store``) on the current device.
"""

from __future__ import annotations

import functools
import os

import torch

from tokenspeed_kernel import (
    Heads,
    KernelOverrideError,
    NoKernelFoundError,
    Priority,
    attention_request,
    select,
    store_request,
)

# vLLM's --kv-cache-dtype strings this backend serves, and the cache dtype the public calls
# see (None: the model dtype). vLLM stores "fp8"/"fp8_e4m3" as uint8 bytes; the backend views
# them as float8_e4m3fn, with the layer's per-tensor k/v scales.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}

# Kernel page sizes declared to vLLM. vLLM accepts a --block-size that is a multiple of one of
# them (it splits a larger block into kernel pages). Pages below 16 tokens are served by the
# kernels but make every paged gather tiny; like vLLM's own Triton backend, TOKENSPEED asks
# for multiples of 16.
KERNEL_PAGE_SIZES: tuple[int, ...] = (16, 32, 64, 128, 256)

ACT_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)

# Head counts used when vLLM validates before the layer exists (its hook gets no head
# counts): a GQA group of 8, GPT-OSS's. The layer re-checks with its real heads.
_PROBE_HEADS = (8, 1)

_OPS = ("attention.decode", "attention.extend", "kvcache.store")


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the public calls see for vLLM's ``kv_cache_dtype`` string."""
    mapped = KV_CACHE_DTYPES[kv_cache_dtype]
    return model_dtype if mapped is None else mapped


def kv_dtype_reason(kv_cache_dtype: str | None) -> str | None:
    """Why ``kv_cache_dtype`` is not served, or None."""
    if kv_cache_dtype is None or kv_cache_dtype in KV_CACHE_DTYPES:
        if kv_cache_dtype in ("fp8", "fp8_e4m3"):
            fp8 = _vllm_fp8_dtype()
            if fp8 is not None and fp8 != torch.float8_e4m3fn:
                return (
                    f"TOKENSPEED: kv_cache_dtype {kv_cache_dtype} is {fp8} on this platform; "
                    "tokenspeed-kernel's fp8 KV cache is float8_e4m3fn (OCP e4m3)"
                )
        return None
    return (
        f"TOKENSPEED: kv_cache_dtype {kv_cache_dtype!r} is not served; tokenspeed-kernel's paged "
        f"caches hold {', '.join(KV_CACHE_DTYPES)} (fp8 = float8_e4m3fn with per-tensor "
        "k/v scales)"
    )


def block_size_reason(block_size: int | None) -> str | None:
    """Why ``block_size`` is not served, or None."""
    if block_size is None or any(block_size % p == 0 for p in KERNEL_PAGE_SIZES):
        return None
    return (
        f"TOKENSPEED: block_size {block_size} is not a multiple of a kernel page size it runs "
        f"({', '.join(map(str, KERNEL_PAGE_SIZES))} tokens)"
    )


def kernel_page_size(block_size: int | None) -> int:
    """The largest declared kernel page size dividing ``block_size`` (16 when unknown)."""
    if block_size is None:
        return KERNEL_PAGE_SIZES[0]
    fitting = [p for p in KERNEL_PAGE_SIZES if block_size % p == 0]
    return max(fitting) if fitting else block_size


def vllm_kv_align(kv_dtype: torch.dtype, head_size: int, head_size_v: int) -> int:
    """The byte alignment (a power of two <= 16) of the K and V views of vLLM's cache: V
    starts ``D`` elements into each ``D + Dv`` row, and every other stride is a multiple of
    that row (the selector's shape key ``kv_align`` for strided caches)."""
    elem = torch.empty((), dtype=kv_dtype).element_size()
    align = 16
    for value in (head_size * elem, (head_size + head_size_v) * elem):
        align = min(align, value & -value)
    return align


def vllm_q_align(dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_size: int, head_size_v: int) -> int:
    """The byte alignment (a power of two <= 16) of the q vLLM hands the backend: the first
    ``Hq * D`` columns of the fused qkv projection's rows (``Hq * D + Hkv * (D + Dv)``
    elements), split off and viewed ``[tokens, Hq, D]`` without a copy (the selector's shape
    key ``q_align`` of a row-strided q, ``strided_q``)."""
    row = (num_q_heads * head_size + num_kv_heads * (head_size + head_size_v)) * torch.empty(
        (), dtype=dtype
    ).element_size()
    return min(16, row & -row)


def kernel_reason(
    *,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    page_size: int,
    window_left: int = -1,
    sinks: bool = False,
    logit_cap: float = 0.0,
    q_len: int = 1,
) -> str | None:
    """Why no non-reference tokenspeed-kernel kernel serves one of the backend's calls with
    these shapes on the current device, or None when every call has one.

    The PyTorch reference kernels serve everything but are for checking, not serving (they
    read lengths on the host and cannot be captured); they count only when
    ``TOKENSPEED_KERNEL_OVERRIDE`` names them for that operator.
    """
    return _kernel_reason(
        dtype,
        kv_dtype,
        num_q_heads,
        num_kv_heads,
        head_size,
        head_size_v,
        page_size,
        window_left,
        sinks,
        float(logit_cap),
        q_len,
        os.environ.get("TOKENSPEED_KERNEL_OVERRIDE", ""),
    )


@functools.lru_cache(maxsize=256)
def _kernel_reason(
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    page_size: int,
    window_left: int,
    sinks: bool,
    logit_cap: float,
    q_len: int,
    overrides: str,
) -> str | None:
    heads = Heads(num_q_heads, num_kv_heads, head_size, head_size_v)
    # vLLM's K and V are always strided views (K|V side by side in each row).
    layout = {"strided_kv": True, "kv_align": vllm_kv_align(kv_dtype, head_size, head_size_v)}
    common = {"q_dtype": dtype, "kv_dtype": kv_dtype, "heads": heads, "page_size": page_size, **layout}
    common |= {"window_left": window_left, "sinks": sinks, "logit_cap": logit_cap}
    # q is passed as vLLM hands it over, a row-strided view of the fused qkv projection, to the
    # extend and to a decode of one query per sequence (a 4-D decode q is copied contiguous).
    q_rows = {"strided_q": True, "q_align": vllm_q_align(dtype, num_q_heads, num_kv_heads, head_size, head_size_v)}
    requests = {
        "attention.decode": attention_request(
            "attention.decode", q_len=q_len, **common, **(q_rows if q_len == 1 else {})
        ),
        "attention.extend": attention_request("attention.extend", **common, **q_rows),
        "kvcache.store": store_request(
            kv_dtype=dtype,
            cache_dtype=kv_dtype,
            num_kv_heads=num_kv_heads,
            head_dim=head_size,
            head_dim_v=head_size_v,
            page_size=page_size,
            **layout,
            strided_rows=True,  # k and v as vLLM hands them over: row-strided views of the qkv projection
        ),
    }
    overridden = {item.split("=", 1)[0].strip() for item in overrides.split(",") if "=" in item}
    shape = f"head_size {head_size}, {dtype} activations, {kv_dtype} cache, page {page_size}"
    for op in _OPS:
        try:
            spec = select(requests[op])
        except (NoKernelFoundError, KernelOverrideError) as exc:
            first = str(exc).strip().splitlines()[0]
            return f"TOKENSPEED: no tokenspeed-kernel kernel serves {op} for {shape} ({first})"
        if Priority.band(spec.priority) == Priority.REFERENCE and op not in overridden:
            return (
                f"TOKENSPEED: only the PyTorch reference kernel ({spec.name}) serves {op} for {shape}; "
                "install a vendor wheel (tokenspeed-kernel-triton) that serves it"
            )
    return None


def capturable_decode_reason(
    *,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    head_size_v: int,
    page_size: int,
    q_len: int,
) -> str | None:
    """Why no decode kernel that can be captured in a CUDA graph serves these shapes
    (windows, sinks and logit caps vary per layer: asked for plainly), or None."""
    heads = Heads(num_q_heads, num_kv_heads, head_size, head_size_v)
    request = attention_request(
        "attention.decode",
        q_dtype=dtype,
        kv_dtype=kv_dtype,
        heads=heads,
        page_size=page_size,
        q_len=q_len,
        capturable=True,
        strided_kv=True,
        kv_align=vllm_kv_align(kv_dtype, head_size, head_size_v),
    )
    try:
        select(request)
    except (NoKernelFoundError, KernelOverrideError) as exc:
        return str(exc).strip().splitlines()[0]
    return None


def _vllm_fp8_dtype() -> torch.dtype | None:
    try:
        from vllm.platforms import current_platform

        return current_platform.fp8_dtype()
    except Exception:  # an unspecified platform has no fp8 answer; the kernels decide then
        return None
