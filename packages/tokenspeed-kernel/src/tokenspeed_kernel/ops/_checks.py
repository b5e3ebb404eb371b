"""Host-side argument checks shared by the public operators.

Every check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape,
device, layout or value) naming the argument and what was expected. None of them reads
device memory: checks that would need a sync live behind ``config.debug()`` in each op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

__all__ = [
    "ACT_DTYPES",
    "check_choice",
    "check_float",
    "check_index_tensor",
    "check_int",
    "check_optional_tensor",
    "check_same_device",
    "check_tensor",
    "dtype_name",
]

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
    """Check that ``t`` is a tensor of the given rank, dtype, shape (None = any) and layout."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            want = " or ".join(f"{n}-D" for n in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {{{_names(dtypes)}}}, got {dtype_name(t.dtype)}")
    if shape is not None:
        if len(shape) != t.dim() or any(want is not None and want != got for want, got in zip(shape, t.shape)):
            shown = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {shown}, got {list(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    return t


def check_optional_tensor(name: str, t: object, **kwargs) -> torch.Tensor | None:
    """:func:`check_tensor` for an argument that may be None."""
    return None if t is None else check_tensor(name, t, **kwargs)


def check_same_device(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Every given tensor must sit on ``reference``'s device."""
    for name, t in tensors.items():
        if t is not None and t.device != reference.device:
            raise ValueError(f"{name} is on {t.device} but {reference_name} is on {reference.device}")


def check_int(name: str, value: object, *, min_value: int | None = None) -> int:
    """``value`` must be a Python int (not bool) at least ``min_value``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
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


def check_index_tensor(name: str, t: object, *, ndim: int, dtype: torch.dtype, shape=None) -> torch.Tensor:
    """An integer index tensor of one exact dtype (int32 page tables, int64 slots, ...)."""
    return check_tensor(name, t, ndim=ndim, dtypes=(dtype,), shape=shape)
