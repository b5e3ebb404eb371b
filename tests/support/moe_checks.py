"""Helpers of the MXFP4 MoE kernel tests (``test_moe_mx.py``, ``test_moe_mx_swap.py``): the
awkward ``moe.apply`` cases by name, a selection's candidate by kernel name, the relative
error check against a float64 reference, a CUDA-graph capture of one step, and the GPU
numerics cases run through ``moe_apply`` and ``moe_plan``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from support.gpu_moe import awkward_gpu_inputs
from support.naive_moe import naive_moe
from tokenspeed_kernel.tools import cases

__all__ = [
    "GPU_CASES",
    "awkward_apply_cases",
    "candidate",
    "capture",
    "check_rel_err",
    "gpu_case_id",
    "gpu_public_calls",
]

# GPU numerics cases: (T, hot experts of 32, activation, bias, expert map).
GPU_CASES = [(t, hot, act, bias, emap) for t in (1, 3, 17, 300) for hot, act, bias, emap in
             ((2, "swiglu_oai", True, True), (16, "silu", False, False), (3, "swiglu_oai", True, False))]  # fmt: skip


def awkward_apply_cases(dtype: torch.dtype = torch.bfloat16) -> dict:
    """``cases.awkward_cases("moe.apply", dtype)`` by name."""
    return {c.name: c for c in cases.awkward_cases("moe.apply", dtype)}


def candidate(selection, name: str):
    """The candidate of kernel ``name`` in an ``explain`` selection."""
    return next(c for c in selection.candidates if c.spec.name == name)


def check_rel_err(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """No NaN in ``out`` (poisoned outputs: every element written) and a relative Frobenius
    error against the float64 ``ref`` below ``tol``."""
    assert not torch.isnan(out).any(), "an output element was never written"
    err = float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())
    assert err < tol, f"relative error {err:.2e}"


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` warmed up on a side stream (its kernels compile outside capture), then captured
    in a CUDA graph: ``(graph, the tensor step returned while captured)``."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, captured


def gpu_case_id(case: tuple) -> str:
    tokens, hot, activation, bias, with_map = case
    return f"T{tokens}-hot{hot}-{activation}{'-bias' if bias else ''}{'-map' if with_map else ''}"


def gpu_public_calls(case: tuple, kernel: str, tol: float):
    """One of :data:`GPU_CASES` on the GPU (``awkward_gpu_inputs``) through ``moe_apply(override=
    kernel)``, checked against the float64 ``naive_moe``; returns ``(inputs, ref, out, plan)``
    with ``plan`` the kernel's ``moe_plan`` for the caller's own checks."""
    from tokenspeed_kernel.ops.moe import moe_apply, moe_plan

    tokens, hot, activation, bias, with_map = case
    inputs = awkward_gpu_inputs(tokens, 32, hot, activation, bias, with_map, seed=tokens + hot)
    ref = naive_moe(**inputs)
    out = torch.full_like(inputs["x"], float("nan"))
    moe_apply(**inputs, out=out, override=kernel)
    check_rel_err(out, ref, tol)
    plan = moe_plan(inputs["w13"], inputs["w2"], x_dtype=torch.bfloat16, top_k=4, activation=activation,
                    w13_bias=inputs["w13_bias"], w2_bias=inputs["w2_bias"], expert_map=inputs["expert_map"],
                    override=kernel)  # fmt: skip
    return inputs, ref, out, plan
