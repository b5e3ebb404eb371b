"""Plain-int host helpers for launch code.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function`` objects in
Triton 3.6: calling one from Python costs microseconds (argument unwrapping), against tens
of nanoseconds for the arithmetic. Host code uses these; kernel bodies keep ``tl.cdiv``.
"""

from __future__ import annotations

__all__ = ["cdiv", "next_pow2"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b > 0`` (``triton.cdiv``)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` for ``n >= 1`` (``triton.next_power_of_2``); 1 for
    ``n <= 1``."""
    return 1 << max(int(n) - 1, 0).bit_length()
