"""Host-side argument checks shared by the public operators.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
device, layout or value) naming the argument and what was expected. None of them reads
device memory: checks that would need a sync live behind ``config.debug()`` in each op.

The hot path (per layer, per step) does not re-run them for a call it has seen: each
operator (:mod:`tokenspeed_kernel.ops._operator`) builds a **call key** from what its checks
read (:func:`call_key` of :func:`arg_key` and :func:`options_key`: a tensor's exact type,
shape, dtype, device, strides and storage offset; an option's exact type and value) and
keeps the call's plan (what its full validation derived: head geometry, resolved scale,
output shapes, selector request) in a bounded plan cache (:func:`remember`). A key is
remembered only after the full checks passed for a call with that key, and every outcome of
those checks is a function of the key, so a hit means the same checks would pass again.
Values that change per call (``max_seqlen_*``, pointers for aliasing) are not in keys (only
a power-of-two bucket of one, where the selector request carries it): they are checked on
every call, and any doubt (a miss, a per-call check failing, an argument of another kind,
tracing under ``torch.compile``) runs the full checks, which raise the precise error.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight

__all__ = [
    "ACT_DTYPES",
    "CALL_CACHE_LIMIT",
    "INT32_MAX",
    "Uncacheable",
    "arg_key",
    "at_least",
    "call_key",
    "call_table",
    "check_choice",
    "check_float",
    "check_index_tensor",
    "check_int",
    "check_optional_tensor",
    "check_override",
    "check_paged_layout",
    "check_same_device",
    "check_tensor",
    "clear_call_tables",
    "dtype_name",
    "kv_align",
    "options_key",
    "pow2_bucket",
    "remember",
]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Integer arguments (lengths, bounds, windows, head counts) reach the kernels as int32.
INT32_MAX = 2**31 - 1


def pow2_bucket(n: int) -> int:
    """The next power of two >= ``n`` (1 for 0 or 1): a request's size bucket
    (``num_tokens_bucket``, ``batch_bucket``), so selections are cached per bucket."""
    return 1 << max(n - 1, 0).bit_length()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(dtype_name(d) for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    shape: Sequence[int | None] | None = None,
    contiguous: bool = True,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given rank, dtype, shape (None = any) and layout
    (``contiguous=False``: any strides)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    got = t.shape  # read once: every access crosses into C++
    if ndim is not None and (len(got) != ndim if isinstance(ndim, int) else len(got) not in ndim):
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        want = " or ".join(f"{n}-D" for n in allowed)
        raise ValueError(f"{name} must be {want}, got shape {tuple(got)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {{{_names(dtypes)}}}, got {dtype_name(t.dtype)}")
    if shape is not None and (len(shape) != len(got) or any(w is not None and w != g for w, g in zip(shape, got))):
        shown = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {shown}, got {list(got)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def check_paged_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """A paged KV cache's layout: any page/token/head strides, but the last (head-dim) axis
    must have stride 1 (each row of ``D`` values contiguous), so kernels load whole rows."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} must have stride 1 in its last (head-dim) dimension, got strides {t.stride()} for shape "
            f"{list(t.shape)}; any page/token/head strides are accepted"
        )
    return t


def kv_align(*caches: torch.Tensor) -> int:
    """The largest power of two <= 16 dividing the byte offset and every byte stride but the
    last of each cache: what a kernel with 16-byte vector or bulk copies needs of a strided
    cache (request shape key ``kv_align``). The storage's own base is taken as 16-byte
    aligned, as every torch allocator returns it."""
    align = 16
    for t in caches:
        size = t.element_size()
        for elements in (t.storage_offset(), *t.stride()[:-1]):
            nbytes = elements * size
            if nbytes:
                align = min(align, int(nbytes & -nbytes))  # ints: called only outside tracing
    return align


def check_optional_tensor(name: str, t: object, **kwargs: Any) -> torch.Tensor | None:
    """:func:`check_tensor` for an argument that may be None."""
    return None if t is None else check_tensor(name, t, **kwargs)


def check_same_device(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Every given tensor must sit on ``reference``'s device."""
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def check_int(name: str, value: object, *, min_value: int | None = None, max_value: int = INT32_MAX) -> int:
    """``value`` must be a Python int (not bool) in ``[min_value, max_value]``; the default
    upper bound is :data:`INT32_MAX` (kernels take integer arguments as int32)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    if value > max_value:
        raise ValueError(f"{name} must be <= {max_value} (it is passed to kernels as int32), got {value}")
    return value


def check_float(name: str, value: object, *, min_value: float | None = None, positive: bool = False) -> float:
    """``value`` must be a real number (int or float), finite, and in range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    return value


def check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` must be one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value  # type: ignore[return-value]


def check_override(override: object) -> str | None:
    """``override`` must be a kernel name (str) or None."""
    if override is not None and not isinstance(override, str):
        raise TypeError(f"override must be a kernel name (str) or None, got {type(override).__name__}")
    return override


def check_index_tensor(
    name: str, t: object, *, ndim: int, dtype: torch.dtype, shape: Sequence[int | None] | None = None
) -> torch.Tensor:
    """An integer index tensor of one exact dtype (int32 page tables, int64 slots, ...)."""
    return check_tensor(name, t, ndim=ndim, dtypes=(dtype,), shape=shape)


# --- call keys (see the module docstring) ---------------------------------------------------

CALL_CACHE_LIMIT = 1024  # entries per op's table; a full table is emptied (shapes vary per step)
_Tensor = torch.Tensor
_SCALAR_TYPES = frozenset({type(None), bool, int, float, str})
V = TypeVar("V")


class Uncacheable(Exception):
    """An argument a call key cannot stand for (a tensor subclass, a custom object): the
    call is validated in full and nothing is remembered."""


def arg_key(x: object) -> Hashable:
    """What the checks read of one argument: a plain tensor's shape, dtype, device, strides
    and storage offset (contiguity and a strided cache's alignment follow from them); a
    quantized weight container's type and its tensors' keys; a None, bool,
    int, float or str with its exact type (``1`` and ``True`` differ). ``Uncacheable``
    for anything else."""
    kind = type(x)
    if kind is _Tensor:
        return (x.shape, x.dtype, x.device, x.stride(), x.storage_offset())  # type: ignore[attr-defined]
    if kind in _SCALAR_TYPES:
        return (kind, x)
    if kind is MXFP4Weight:
        return (kind, arg_key(x.packed), arg_key(x.scales))  # type: ignore[attr-defined]
    if kind is FP8Weight:
        return (kind, arg_key(x.data), arg_key(x.scale))  # type: ignore[attr-defined]
    raise Uncacheable


def at_least(value: object, lo: int) -> bool:
    """``value`` is a plain int in ``[lo, INT32_MAX]`` (the fast form of :func:`check_int`;
    False sends the call to the full checks, which accept int subclasses and raise the
    precise error)."""
    return type(value) is int and lo <= value <= INT32_MAX


def options_key(*values: object) -> Hashable:
    """:func:`arg_key` of several scalar options at once (exact types and values)."""
    types = tuple(map(type, values))
    if not _SCALAR_TYPES.issuperset(types):
        raise Uncacheable
    return (types, values)


def call_key(args: tuple[object, ...], options: tuple[object, ...] = ()) -> Hashable | None:
    """The call key of one call: :func:`arg_key` of each of ``args`` (tensors, weights, optional
    tensors, a plan's handle) and :func:`options_key` of ``options`` (scalars; none: no entry).
    None, which no table holds, when an argument is :class:`Uncacheable`."""
    try:
        if options:
            return (*map(arg_key, args), options_key(*options))
        return tuple(map(arg_key, args))
    except Uncacheable:
        return None


_TABLES: list[dict] = []


def call_table() -> dict[Hashable, V]:
    """A new table of call key -> plan (cleared by :func:`clear_call_tables`)."""
    table: dict[Hashable, V] = {}
    _TABLES.append(table)
    return table


def clear_call_tables() -> None:
    """Forget every remembered plan (tests; the next call of each key is checked in full)."""
    for table in _TABLES:
        table.clear()


def remember(table: dict[Hashable, V], key: Hashable | None, plan: V) -> V:
    """Store ``plan`` under ``key`` (None: nothing) in a bounded plan cache; return it."""
    if key is not None:
        if len(table) >= CALL_CACHE_LIMIT:
            table.clear()
        table[key] = plan
    return plan
