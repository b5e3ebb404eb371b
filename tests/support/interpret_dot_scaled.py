"""A float64 ``tl.dot_scaled`` for the Triton interpreter (tests only).

The Triton 3.6 interpreter has no ``create_dot_scaled`` (``tl.dot_scaled`` raises
``InterpreterError``). :func:`install` adds one to ``InterpreterBuilder`` for the case the
MoE kernels use: a bf16 lhs without scales times an e2m1 rhs packed two codes per byte
along K (low nibble = even k) with E8M0 scales ``[N, K/32]``, written from the semantics
``tl.dot_scaled`` documents (OCP MX: value = E2M1(code) * 2**(scale - 127), scale 255 =
NaN), in float64, plus the accumulator. It lets the kernel's addressing, masks, split-K
and epilogues run on CPU; how Triton lowers ``dot_scaled`` on a GPU is not tested by it.
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _bf16_bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def emulated_dot_scaled(lhs_bf16_bits: np.ndarray, rhs_packed: np.ndarray, rhs_scale: np.ndarray) -> np.ndarray:
    """``lhs [M, K]`` (bf16 as raw uint16) @ ``rhs`` (uint8 ``[K/2, N]`` e2m1, scales uint8
    ``[N, K/32]``) in float64."""
    codes = np.stack([rhs_packed & 15, rhs_packed >> 4], axis=1).reshape(-1, rhs_packed.shape[1])  # [K, N]
    exps = rhs_scale.astype(np.float64).T - 127.0  # [K/32, N]
    scale = np.where(rhs_scale.T == 255, np.nan, np.exp2(exps))
    w = E2M1[codes] * np.repeat(scale, 32, axis=0)
    return _bf16_bits_to_f64(lhs_bf16_bits) @ w


def install(monkeypatch) -> None:
    """Give the interpreter's builder a ``create_dot_scaled`` (undone by ``monkeypatch``).
    Also wraps plain-string formats as ``tl.constexpr``: the interpreter passes a kernel's
    string literals as ``str``, which ``dot_scaled``'s front end does not accept."""
    from triton import language as tl
    from triton.language import semantic
    from triton.runtime import interpreter

    front_end = semantic.TritonSemantic.dot_scaled

    def dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, *rest):
        return front_end(
            self, lhs, lhs_scale, tl.constexpr(lhs_format), rhs, rhs_scale, tl.constexpr(rhs_format), *rest
        )

    monkeypatch.setattr(semantic.TritonSemantic, "dot_scaled", dot_scaled)

    def create_dot_scaled(
        self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math, lhs_k_pack, rhs_k_pack, acc
    ):
        assert lhs_scale is None and lhs_k_pack and rhs_k_pack, "emulated for bf16 x e2m1 (k-packed) only"
        assert lhs.dtype == tl.bfloat16 and rhs.dtype == tl.uint8 and rhs_scale is not None
        out = emulated_dot_scaled(lhs.data, rhs.data, rhs_scale.data) + acc.data.astype(np.float64)
        return interpreter.TensorHandle(out.astype(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot_scaled", create_dot_scaled, raising=False)
