"""Host-side validation of the attention operators, and their selector requests.

``check_prefill``, ``check_extend`` and ``check_decode_call`` are every host check of
``mha_prefill``, ``mha_extend_with_kvcache`` and ``mha_decode_with_kvcache``, in order;
``check_decode`` is what ``mha_decode_with_kvcache`` and ``mha_decode_plan`` share. Each
function raises ``TypeError``/``ValueError`` naming the argument; none reads device memory
except the ``debug_check_*`` functions, which the operators call only under
``TOKENSPEED_KERNEL_DEBUG=1``.
"""

from __future__ import annotations

import itertools
import math

import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops._checks import (
    ACT_DTYPES,
    check_float,
    check_int,
    check_optional_tensor,
    check_override,
    check_paged_layout,
    check_same_device,
    check_tensor,
    dtype_name,
    kv_align,
    pow2_bucket,
)
from tokenspeed_kernel.ops.attention.args import Heads
from tokenspeed_kernel.registry import Request

KV_CACHE_DTYPES = (*ACT_DTYPES, torch.float8_e4m3fn)


def attention_request(
    op: str,
    *,
    q_dtype: torch.dtype,
    kv_dtype: torch.dtype,
    heads: Heads,
    causal: bool = True,
    window_left: int = -1,
    sinks: bool = False,
    logit_cap: float = 0.0,
    return_lse: bool = False,
    page_size: int | None = None,
    q_len: int | None = None,
    capturable: bool = False,
    batch: int | None = None,
    max_seqlen_q: int | None = None,
    strided_kv: bool = False,
    kv_align: int | None = None,
    kv_prefix: bool | None = None,
    unaligned_qkv: bool = False,
    strided_q: bool = False,
    q_align: int | None = None,
) -> Request:
    """The selector request of an attention call, built from plain shapes (public: ask
    ``select``/``explain`` which kernel would serve a model's calls before making them).

    Args:
        op: ``"attention.prefill"``, ``"attention.extend"`` or ``"attention.decode"``.
        q_dtype: the activation dtype. kv_dtype: k/v (prefill) or cache dtype.
        heads: head counts and dims (:class:`~tokenspeed_kernel.ops.attention.args.Heads`).
        causal, window_left, sinks (whether a sinks tensor is passed), logit_cap,
            return_lse: as in the public call (decode is always causal).
        page_size: the cache's page size (extend, decode). q_len: queries per sequence
            (decode; 1 unless speculative).
        capturable: only kernels that can be captured in a CUDA graph may serve it.
        batch: sequences in the batch (decode): adds ``batch_bucket``, the next power of
            two >= ``batch``, which kernels may be ranked by (``rank_when``).
        max_seqlen_q: the longest query length (prefill): adds ``max_seqlen_q_bucket``, the
            next power of two >= ``max_seqlen_q``, which kernels may be ranked by.
        strided_kv: the paged caches are strided views, not contiguous (extend, decode).
        kv_align: the strided caches' byte alignment, a power of two <= 16 (see
            ``tokenspeed_kernel.ops._checks.kv_align``); the public call gives it with
            ``strided_kv`` only.
        kv_prefix: (prefill) whether a sequence's keys may outnumber its queries: the public
            call gives False when ``cu_seqlens_k`` is ``cu_seqlens_q`` itself (each sequence's
            keys are its queries), else True; adds ``kv_prefix`` (0/1), which a kernel that
            serves only self-attention lists as ``(0,)``. None: left out (any kernel serves).
        unaligned_qkv: (prefill) q, k or v is not 16-byte aligned: its byte offset or a byte
            stride but the last is not a multiple of 16 (``tokenspeed_kernel.ops._checks.kv_align``
            of the three, below 16); only kernels that list the feature serve it.
        strided_q: q is 3-D rows ``[Hq, D]`` with a row stride of their own (a view of a fused
            qkv projection), not contiguous (:func:`check_q_rows`); only kernels that list
            the feature serve it.
        q_align: (extend, decode) a row-strided q's byte alignment, a power of two <= 16
            (``tokenspeed_kernel.ops._checks.kv_align`` of q: its byte offset and row stride);
            the public call gives it with ``strided_q`` only, as ``kv_align`` with
            ``strided_kv``. A kernel that reads q by TMA lists ``q_align`` ``(16,)``.

    Features: ``non_causal``, ``sliding_window``, ``sinks``, ``logit_cap``, ``return_lse``,
    ``fp8_kv`` (an fp8 cache), ``spec_decode`` (``q_len > 1``), ``strided_kv``, ``unaligned_qkv``, ``strided_q``. Shapes: head
    dims, head counts, ``window_left`` when windowed, and ``page_size`` / ``kv_align`` /
    ``q_align`` / ``q_len`` where the operator has them, ``batch_bucket`` / ``max_seqlen_q_bucket`` / ``kv_prefix`` when ``batch`` /
    ``max_seqlen_q`` / ``kv_prefix`` is given. It is exactly the request the public call builds for the same arguments.
    """
    flags = (
        ("non_causal", not causal),
        ("sliding_window", window_left >= 0),
        ("sinks", sinks),
        ("logit_cap", logit_cap > 0),
        ("return_lse", return_lse),
        ("fp8_kv", kv_dtype == torch.float8_e4m3fn),
        ("spec_decode", q_len is not None and q_len > 1),
        ("strided_kv", strided_kv),
        ("unaligned_qkv", unaligned_qkv),
        ("strided_q", strided_q),
    )
    shapes = [
        ("head_dim", heads.head_dim),
        ("head_dim_v", heads.head_dim_v),
        ("num_kv_heads", heads.num_kv_heads),
        ("num_q_heads", heads.num_q_heads),
    ]
    optional = (("page_size", page_size), ("kv_align", kv_align), ("q_align", q_align), ("q_len", q_len))
    shapes += [(key, value) for key, value in optional if value is not None]
    if window_left >= 0:
        shapes.append(("window_left", window_left))
    if batch is not None:
        shapes.append(("batch_bucket", pow2_bucket(batch)))
    if max_seqlen_q is not None:
        shapes.append(("max_seqlen_q_bucket", pow2_bucket(max_seqlen_q)))
    if kv_prefix is not None:
        shapes.append(("kv_prefix", int(kv_prefix)))
    return Request(
        op,
        (("kv", kv_dtype), ("q", q_dtype)),
        tuple(sorted(shapes)),
        frozenset(name for name, on in flags if on),
        capturable,
    )


def attention_signature(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, heads: Heads, **options: object
) -> dict[str, object]:
    """The capture signature of an attention call (``AttentionCase`` field names plus the
    call's own: ``batch``, ``total_q``, ...; ``TOKENSPEED_KERNEL_CAPTURE``)."""
    return {
        "num_q_heads": heads.num_q_heads,
        "num_kv_heads": heads.num_kv_heads,
        "head_dim": heads.head_dim,
        "head_dim_v": heads.head_dim_v,
        "dtype": dtype_name(q_dtype),
        "kv_dtype": dtype_name(kv_dtype),
        **options,
    }


def kernel_window(window_left: int, max_keys: int) -> int:
    """The window a kernel receives: ``window_left`` capped at ``max_keys``, the most keys a
    sequence can hold (prefill: ``total_k``; paged: page-table columns x page size). A query
    never sits ``max_keys`` or more positions after a key it could see, so the cap changes no
    result; it keeps ``position - window_left`` inside int32 in the kernels."""
    return min(window_left, max_keys)


def check_options(
    q: torch.Tensor,
    heads: Heads,
    *,
    softmax_scale: object,
    window_left: object,
    logit_cap: object,
    return_lse: object,
    override: object,
    sinks: object,
) -> float:
    """Check the options every attention operator shares; return the resolved softmax scale."""
    check_sinks(sinks, heads.num_q_heads, q)
    head_dim = heads.head_dim
    scale = (
        1.0 / math.sqrt(head_dim)
        if softmax_scale is None
        else check_float("softmax_scale", softmax_scale, positive=True)
    )
    check_int("window_left", window_left, min_value=-1)
    check_float("logit_cap", logit_cap, min_value=0.0)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    check_override(override)
    return scale


def check_ragged(max_seqlen_q: object, max_seqlen_k: object, causal: object) -> None:
    """The host bounds and causal flag of the ragged operators (prefill, extend)."""
    check_int("max_seqlen_q", max_seqlen_q, min_value=0)
    check_int("max_seqlen_k", max_seqlen_k, min_value=0)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")


def check_rows(name: str, t: torch.Tensor, heads: str = "Hq", dim_name: str = "D") -> bool:
    """Whether a 3-D ``t [rows, heads, dim]`` is row-strided: each row's ``heads * dim``
    values contiguous (``t.stride(2) == 1``, ``t.stride(1) == dim``) with a row stride of its
    own, as a view of a fused qkv projection is; False when contiguous. ``ValueError`` naming
    ``name`` (its axes called ``heads`` and ``dim_name``) for any other layout."""
    if t.is_contiguous():
        return False
    rows, _, dim = t.shape
    if t.stride(2) != 1 or t.stride(1) != dim or (rows > 1 and t.stride(0) < t.shape[1] * dim):
        d = dim_name
        raise ValueError(
            f"{name} must be contiguous, or rows [{heads}, {d}] with a row stride of their own "
            f"(strides (S, {d}, 1), S >= {heads} * {d}): got strides {t.stride()} for shape {tuple(t.shape)}"
        )
    return True


def check_q_rows(q: torch.Tensor) -> bool:
    """Whether a 3-D q ``[rows, Hq, D]`` is row-strided (``strided_q``; :func:`check_rows`):
    as a fused qkv projection's q; ``ValueError`` for a layout other than these two."""
    return check_rows("q", q)


def check_heads(q_name: str, q: torch.Tensor, k_name: str, k: torch.Tensor, v_name: str, v: torch.Tensor) -> Heads:
    """Hq % Hkv == 0, k/v agree on Hkv, q/k agree on D. Head axes are the last two."""
    num_q_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    if num_q_heads == 0:
        raise ValueError(f"{q_name} must have at least one query head (its dim -2 is 0)")
    if num_kv_heads == 0:
        raise ValueError(f"{k_name} must have at least one KV head (its dim -2 is 0)")
    if v.shape[-2] != num_kv_heads:
        raise ValueError(f"{v_name} has {v.shape[-2]} KV heads but {k_name} has {num_kv_heads}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"the query heads of {q_name} ({num_q_heads}) must be a multiple of the KV heads of {k_name} ({num_kv_heads})"
        )
    if k.shape[-1] != head_dim:
        raise ValueError(f"{k_name} head dim {k.shape[-1]} must equal {q_name} head dim {head_dim}")
    if head_dim == 0 or v.shape[-1] == 0:
        raise ValueError(f"head dims must be positive, got D={head_dim}, Dv={v.shape[-1]}")
    return Heads(num_q_heads, num_kv_heads, head_dim, v.shape[-1])


def check_sinks(sinks: object, num_q_heads: int, q: torch.Tensor) -> torch.Tensor | None:
    check_optional_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,), shape=(num_q_heads,))
    check_same_device("q", q, sinks=sinks)  # type: ignore[arg-type]
    return sinks  # type: ignore[return-value]


def check_cu_seqlens(name: str, t: object, batch: int | None, q: torch.Tensor) -> torch.Tensor:
    """int32 ``[batch + 1]`` on q's device (batch inferred when None; batch 0 is ``[0]``)."""
    shape = None if batch is None else (batch + 1,)
    check_tensor(name, t, ndim=1, dtypes=(torch.int32,), shape=shape)
    assert isinstance(t, torch.Tensor)
    if t.shape[0] < 1:
        raise ValueError(f"{name} must hold batch + 1 >= 1 entries (it starts at 0), got an empty tensor")
    check_same_device("q", q, **{name: t})
    return t


def check_out(out: object, shape: tuple[int, ...], q: torch.Tensor) -> torch.Tensor | None:
    if out is None:
        return None
    check_tensor("out", out, dtypes=(q.dtype,), shape=shape)
    check_same_device("q", q, out=out)  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


_SCALE_CACHE: dict[tuple[float, torch.device], torch.Tensor] = {}
_SCALE_CACHE_LIMIT = 256


def _scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A float32 ``[1]`` tensor holding ``value`` on ``device``, cached per (value, device) so a
    Python-float scale costs no allocation per call. Not cached while tracing or while a
    device graph is being captured (the fill would only run at replay)."""
    key = (value, device)
    cached = _SCALE_CACHE.get(key)
    if cached is not None:
        return cached
    t = torch.full((1,), value, dtype=torch.float32, device=device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing and not torch.compiler.is_compiling() and len(_SCALE_CACHE) < _SCALE_CACHE_LIMIT:
        _SCALE_CACHE[key] = t
    return t


def check_scale(name: str, scale: object, q: torch.Tensor) -> torch.Tensor:
    """An fp8 dequantization scale: a positive finite float or a one-element float32 tensor on
    q's device; returned as a float32 ``[1]`` tensor."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError(
                f"{name} must be a float or a one-element float32 tensor, got {scale.dtype} {list(scale.shape)}"
            )
        check_same_device("q", q, **{name: scale})
        return scale.reshape(1)
    return _scale_tensor(check_float(name, scale, positive=True), q.device)


def kv_scales(
    fp8: bool, k_scale: object, v_scale: object, ref: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The fp8 scale tensors of one call (float32 ``[1]``, see :func:`check_scale`), or
    ``(None, None)`` when the cache is not fp8. Per call on the hot path: the scales' validity
    is part of the call key, so after a hit this never raises (a tensor argument is reshaped,
    a float one comes from the scale cache)."""
    if not fp8:
        return None, None
    return check_scale("k_scale", k_scale, ref), check_scale("v_scale", v_scale, ref)


def check_kv_scales(
    cache_dtype: torch.dtype, k_scale: object, v_scale: object, ref: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``k_scale``/``v_scale`` are given exactly when the cache is float8_e4m3fn, and valid
    (:func:`check_scale`, on ``ref``'s device); returns them as by :func:`kv_scales`."""
    if cache_dtype == torch.float8_e4m3fn:
        if k_scale is None or v_scale is None:
            raise ValueError("k_scale and v_scale are required for a float8_e4m3fn KV cache")
        return kv_scales(True, k_scale, v_scale, ref)
    if k_scale is not None or v_scale is not None:
        raise ValueError(
            f"k_scale/v_scale apply to a float8_e4m3fn cache only; this cache is {dtype_name(cache_dtype)}"
        )
    return None, None


def cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[bool, int | None]:
    """A checked cache pair's layout facts for the selector: whether either cache is strided
    (not contiguous; request feature ``strided_kv``) and, for strided caches only, their byte
    alignment (shape key ``kv_align``). A contiguous cache's alignment follows from its head
    dims and dtype, which the request already carries, so it has no ``kv_align``."""
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        return False, None
    return True, kv_align(k_cache, v_cache)


def q_layout(q: torch.Tensor) -> tuple[bool, int | None]:
    """A checked 3-D or 4-D q's layout facts for the selector (extend, decode): whether it is
    row-strided (:func:`check_q_rows`; request feature ``strided_q``) and, for a row-strided q
    only, its byte alignment (shape key ``q_align``: its byte offset and row stride, as
    :func:`cache_layout` gives a strided cache's). A contiguous q's alignment follows from its
    head dims and dtype, which the request already carries, so it has no ``q_align``."""
    if q.is_contiguous():
        return False, None
    return True, kv_align(q)


def check_paged_cache_pair(k_cache: object, v_cache: object) -> None:
    """Both caches 4-D, of a KV dtype, stride 1 in the head dim (other strides free)."""
    check_tensor("k_cache", k_cache, ndim=4, dtypes=KV_CACHE_DTYPES, contiguous=False)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_CACHE_DTYPES, contiguous=False)
    check_paged_layout("k_cache", k_cache)  # type: ignore[arg-type]
    check_paged_layout("v_cache", v_cache)  # type: ignore[arg-type]


def check_paged_cache(
    q: torch.Tensor,
    k_cache: object,
    v_cache: object,
    page_table: object,
    cache_seqlens: object,
    k_scale: object,
    v_scale: object,
    batch: int,
) -> tuple[Heads, int, torch.Tensor | None, torch.Tensor | None]:
    """Check a paged cache and its tables; return heads, page size and the fp8 scales.

    ``k_cache``/``v_cache`` may be strided views (vLLM's interleaved K|V rows, an HND cache
    transposed, one half of a stacked K/V pool): any page/token/head strides, stride 1 in
    the head dim (:func:`~tokenspeed_kernel.ops._checks.check_paged_layout`)."""
    check_paged_cache_pair(k_cache, v_cache)
    assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(
            f"v_cache dtype {dtype_name(v_cache.dtype)} must equal k_cache dtype {dtype_name(k_cache.dtype)}"
        )
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if not fp8 and k_cache.dtype != q.dtype:
        raise TypeError(
            f"k_cache dtype {dtype_name(k_cache.dtype)} must equal q dtype {dtype_name(q.dtype)} (or be float8_e4m3fn)"
        )
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            f"v_cache {list(v_cache.shape)} must match k_cache {list(k_cache.shape)} in [num_pages, page_size, Hkv]"
        )
    page_size = k_cache.shape[1]
    if page_size < 1:
        raise ValueError(f"k_cache page size (dim 1) must be >= 1, got {page_size}")
    heads = check_heads("q", q, "k_cache", k_cache, "v_cache", v_cache)
    check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,), shape=(batch, None))
    check_tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,), shape=(batch,))
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_seqlens=cache_seqlens)  # type: ignore[arg-type]
    return (heads, page_size, *check_kv_scales(k_cache.dtype, k_scale, v_scale, q))


def check_decode(
    q: torch.Tensor,
    k_cache: object,
    v_cache: object,
    page_table: object,
    cache_seqlens: object,
    max_seqlen_k: object,
    *,
    q_len: int,
    k_scale: object,
    v_scale: object,
    softmax_scale: object,
    window_left: object,
    logit_cap: object,
    return_lse: object,
    override: object,
    sinks: object,
) -> tuple[Heads, int, float]:
    """The checks ``mha_decode_with_kvcache`` and ``mha_decode_plan`` share: the paged cache
    and tables against ``q`` (``[batch, Hq, D]`` or ``[batch, q_len, Hq, D]``: a real q or a
    placeholder of its shape), ``max_seqlen_k >= q_len``, and the options. Returns heads,
    page size and the resolved softmax scale."""
    heads, page_size, _, _ = check_paged_cache(
        q, k_cache, v_cache, page_table, cache_seqlens, k_scale, v_scale, q.shape[0]
    )
    check_int("max_seqlen_k", max_seqlen_k, min_value=q_len)
    scale = check_options(
        q,
        heads,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    return heads, page_size, scale


def _check_ragged_options(
    q: torch.Tensor,
    heads: Heads,
    max_seqlen_q: object,
    max_seqlen_k: object,
    causal: object,
    softmax_scale: object,
    window_left: object,
    sinks: object,
    logit_cap: object,
    return_lse: object,
    out: object,
    override: object,
) -> float:
    """The checks ``mha_prefill`` and ``mha_extend_with_kvcache`` end with, after their tensors:
    host bounds and ``causal``, the options, ``out`` ``[total_q, Hq, Dv]``; the resolved scale."""
    check_ragged(max_seqlen_q, max_seqlen_k, causal)
    scale = check_options(
        q,
        heads,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    check_out(out, (q.shape[0], heads.num_q_heads, heads.head_dim_v), q)
    return scale


def check_prefill(
    q: object,
    k: object,
    v: object,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    causal: object,
    softmax_scale: object,
    window_left: object,
    sinks: object,
    logit_cap: object,
    return_lse: object,
    out: object,
    override: object,
) -> tuple[Heads, float]:
    """Every host check of ``mha_prefill``, in order; the head geometry and the resolved scale."""
    q = check_tensor("q", q, ndim=3, dtypes=ACT_DTYPES, contiguous=False)
    check_q_rows(q)
    k = check_tensor("k", k, ndim=3, dtypes=(q.dtype,))
    v = check_tensor("v", v, ndim=3, dtypes=(q.dtype,))
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} rows but k has {k.shape[0]}")
    check_same_device("q", q, k=k, v=v)
    heads = check_heads("q", q, "k", k, "v", v)
    cu_seqlens_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0] - 1, q)
    scale = _check_ragged_options(
        q,
        heads,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        window_left,
        sinks,
        logit_cap,
        return_lse,
        out,
        override,
    )
    return heads, scale


def check_extend(
    q: object,
    k_cache: object,
    v_cache: object,
    page_table: object,
    cu_seqlens_q: object,
    cache_seqlens: object,
    max_seqlen_q: object,
    max_seqlen_k: object,
    causal: object,
    softmax_scale: object,
    window_left: object,
    sinks: object,
    logit_cap: object,
    k_scale: object,
    v_scale: object,
    return_lse: object,
    out: object,
    override: object,
) -> tuple[Heads, int, float]:
    """Every host check of ``mha_extend_with_kvcache``, in order; the head geometry, the page
    size and the resolved scale."""
    q = check_tensor("q", q, ndim=3, dtypes=ACT_DTYPES, contiguous=False)
    check_q_rows(q)
    cu_seqlens_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, q)
    batch = cu_seqlens_q.shape[0] - 1
    heads, page_size, _, _ = check_paged_cache(q, k_cache, v_cache, page_table, cache_seqlens, k_scale, v_scale, batch)
    scale = _check_ragged_options(
        q,
        heads,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        window_left,
        sinks,
        logit_cap,
        return_lse,
        out,
        override,
    )
    return heads, page_size, scale


def check_decode_call(
    q: object,
    k_cache: object,
    v_cache: object,
    page_table: object,
    cache_seqlens: object,
    max_seqlen_k: object,
    softmax_scale: object,
    window_left: object,
    sinks: object,
    logit_cap: object,
    k_scale: object,
    v_scale: object,
    return_lse: object,
    out: object,
    override: object,
) -> tuple[Heads, int, float, int]:
    """Every host check of ``mha_decode_with_kvcache``, in order; the head geometry, the page
    size, the resolved scale and the queries per sequence (``q_len``)."""
    q = check_tensor(
        "q", q, ndim=(3, 4), dtypes=ACT_DTYPES, contiguous=q.dim() == 4 if isinstance(q, torch.Tensor) else True
    )
    if q.dim() == 3:
        check_q_rows(q)
    q_len = q.shape[1] if q.dim() == 4 else 1
    if q_len < 1:
        raise ValueError(f"q must hold at least one query per sequence, got shape {list(q.shape)}")
    heads, page_size, scale = check_decode(
        q,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        q_len=q_len,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    check_out(out, (*q.shape[:-1], heads.head_dim_v), q)
    return heads, page_size, scale, q_len


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``device`` backed by one element (a broadcast
    view): carries shape, dtype and device (to the checks, to a ``prepare_layout`` hook), never
    data."""
    return torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(shape)


# Per device, the bytes the row-strided placeholders of :func:`row_placeholder` are views of
# (grown to the largest asked for: the plans of one model share one buffer, never read or written).
_ROW_BUFFERS: dict[torch.device, torch.Tensor] = {}


def row_placeholder(
    shape: tuple[int, int, int], row_stride: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A placeholder ``[rows, Hq, D]`` of ``dtype`` on ``device`` with strides ``(row_stride, D,
    1)`` and storage offset 0: a row-strided q's layout (``strided_q``) for a plan's hooks, which
    read its shape, strides, dtype and device, never its memory. A view of a buffer per device
    shared by every such placeholder (16-byte aligned, as the allocator returns it)."""
    rows, heads, dim = shape
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = ((max(rows, 1) - 1) * row_stride + heads * dim) * size
    buffer = _ROW_BUFFERS.get(device)
    if buffer is None or buffer.numel() < nbytes:
        buffer = torch.empty(1 << max(nbytes - 1, 1).bit_length(), dtype=torch.uint8, device=device)
        _ROW_BUFFERS[device] = buffer
    return buffer.view(dtype).as_strided(shape, (row_stride, dim, 1), 0)


def check_decode_plan(
    k_cache: object,
    v_cache: object,
    page_table: object,
    cache_seqlens: object,
    max_seqlen_k: object,
    *,
    num_q_heads: object,
    q_len: object,
    q_dtype: object,
    softmax_scale: object,
    window_left: object,
    sinks: object,
    logit_cap: object,
    k_scale: object,
    v_scale: object,
    return_lse: object,
    override: object,
    capturable: object,
    q_row_stride: object,
) -> tuple[torch.dtype, Heads, int, float, int | None]:
    """Every check of ``mha_decode_plan``, in order: :func:`check_decode` against a placeholder
    q of the described shape (the tables' values under ``TOKENSPEED_KERNEL_DEBUG``), then
    ``q_row_stride`` (None, or an int >= ``Hq * D`` with ``q_len == 1``). Returns q's dtype
    (``q_dtype``, default the cache's), heads, page size, the resolved scale and the row
    stride of a row-strided q (``strided_q``): ``q_row_stride``, or None where the runs' q is
    contiguous (no stride given, ``Hq * D``, or at most one row, where torch calls any stride
    contiguous)."""
    check_paged_cache_pair(k_cache, v_cache)
    assert isinstance(k_cache, torch.Tensor)
    page_table = check_tensor("page_table", page_table, ndim=2, dtypes=(torch.int32,))
    num_q_heads = check_int("num_q_heads", num_q_heads, min_value=1)
    q_len = check_int("q_len", q_len, min_value=1)
    if q_dtype is None:
        if k_cache.dtype == torch.float8_e4m3fn:
            raise TypeError("q_dtype is required for a float8_e4m3fn cache (the activations' dtype)")
        q_dtype = k_cache.dtype
    if not isinstance(q_dtype, torch.dtype) or q_dtype not in ACT_DTYPES:
        names = ", ".join(dtype_name(d) for d in ACT_DTYPES)
        raise TypeError(f"q_dtype must be one of {{{names}}}, got {q_dtype}")
    if not isinstance(capturable, bool):
        raise TypeError(f"capturable must be a bool, got {type(capturable).__name__}")
    # q does not exist yet: its placeholder sits on k_cache's device, so the tensors are
    # compared with k_cache here, by name (check_decode would blame "q" instead).
    tensors = (
        ("v_cache", v_cache),
        ("page_table", page_table),
        ("cache_seqlens", cache_seqlens),
        ("sinks", sinks),
        ("k_scale", k_scale),
        ("v_scale", v_scale),
    )
    check_same_device("k_cache", k_cache, **{n: t for n, t in tensors if isinstance(t, torch.Tensor)})
    batch = page_table.shape[0]
    q_like = placeholder((batch, q_len, num_q_heads, k_cache.shape[-1]), q_dtype, k_cache.device)
    heads, page_size, scale = check_decode(
        q_like,
        k_cache,
        v_cache,
        page_table,
        cache_seqlens,
        max_seqlen_k,
        q_len=q_len,
        k_scale=k_scale,
        v_scale=v_scale,
        softmax_scale=softmax_scale,
        window_left=window_left,
        logit_cap=logit_cap,
        return_lse=return_lse,
        override=override,
        sinks=sinks,
    )
    if config.debug():
        assert isinstance(cache_seqlens, torch.Tensor) and isinstance(max_seqlen_k, int)
        debug_check_pages(page_table, cache_seqlens, [q_len] * batch, page_size, k_cache.shape[0], max_seqlen_k)
    if q_row_stride is None:
        return q_dtype, heads, page_size, scale, None
    dense = heads.num_q_heads * heads.head_dim
    q_row_stride = check_int("q_row_stride", q_row_stride, min_value=dense)
    if q_len != 1:
        raise ValueError(f"q_row_stride applies to a 3-D q [batch, Hq, D] (q_len 1), got q_len {q_len}")
    return q_dtype, heads, page_size, scale, q_row_stride if q_row_stride > dense and batch > 1 else None


def _fail(message: str) -> None:
    raise ValueError(f"{message} (TOKENSPEED_KERNEL_DEBUG check)")


def debug_check_cu_seqlens(name: str, cu: torch.Tensor, total: int, max_len: int, max_name: str) -> list[int]:
    """Synchronizing: starts at 0, non-decreasing, ends at ``total``, lengths <= max_len."""
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        _fail(f"{name} must start at 0 and end at {total}, got {values[0]} .. {values[-1]}")
    lengths = [b - a for a, b in itertools.pairwise(values)]
    if not lengths:  # batch 0
        return lengths
    if min(lengths) < 0:
        _fail(f"{name} must be non-decreasing, got {values}")
    if max(lengths) > max_len:
        _fail(f"{max_name}={max_len} is below the longest sequence in {name} ({max(lengths)})")
    return lengths


def debug_check_pages(
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    q_lens: list[int],
    page_size: int,
    num_pages: int,
    max_seqlen_k: int,
) -> None:
    """Synchronizing: each sequence's used pages exist and its length fits its table."""
    lengths = cache_seqlens.tolist()
    max_pages = page_table.shape[1]
    for b, (length, q_len) in enumerate(zip(lengths, q_lens)):
        if length < q_len:
            _fail(f"cache_seqlens[{b}]={length} is below the {q_len} new tokens of sequence {b}")
        if length > max_seqlen_k:
            _fail(f"cache_seqlens[{b}]={length} exceeds max_seqlen_k={max_seqlen_k}")
        used = math.ceil(length / page_size)
        if used > max_pages:
            _fail(f"cache_seqlens[{b}]={length} needs {used} pages but page_table has {max_pages} columns")
        pages = page_table[b, :used]
        if used and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            _fail(f"page_table[{b}] uses page ids outside [0, {num_pages})")
