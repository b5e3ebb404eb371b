"""Helpers of the MoE kernel tests (``test_moe_mx.py``, ``test_moe_mx_swap.py``, the GEMV and
Gluon decode tests): the awkward ``moe.apply`` cases by name, GPT-OSS's request, a
selection's candidate by kernel name, the relative
error check against a float64 reference, a CUDA-graph capture of one step, the GPU
numerics cases run through ``moe_apply`` and ``moe_plan``, and the checks of a kernel's
``bind`` hook (bound runs per token count) on the CPU and on the GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from support.gpu_moe import awkward_gpu_inputs
from support.naive_moe import naive_moe
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.tools import cases

__all__ = [
    "BOUND_STEPS",
    "DTYPE_TOL",
    "GPU_CASES",
    "awkward_apply_cases",
    "call_override",
    "candidate",
    "capture",
    "check_bound_runs",
    "check_close",
    "check_gpu_bound_runs",
    "check_rel_err",
    "gemv_case",
    "gpt_oss_request",
    "gpu_case_id",
    "gpu_public_calls",
]

# GPU numerics cases: (T, hot experts of 32, activation, bias, expert map).
GPU_CASES = [(t, hot, act, bias, emap) for t in (1, 3, 17, 300) for hot, act, bias, emap in
             ((2, "swiglu_oai", True, True), (16, "silu", False, False), (3, "swiglu_oai", True, False))]  # fmt: skip


def awkward_apply_cases(dtype: torch.dtype = torch.bfloat16) -> dict:
    """``cases.awkward_cases("moe.apply", dtype)`` by name."""
    return {c.name: c for c in cases.awkward_cases("moe.apply", dtype)}


def gpt_oss_request(
    num_tokens: int | None = 1, weight_format: str = "mxfp4", *, x_dtype: torch.dtype = torch.bfloat16, top_k=4, **kw
):
    """The request ``moe_apply`` builds for GPT-OSS-120B's MoE layer (128 experts, H = I = 2880,
    swiglu_oai, biases) at ``num_tokens`` (None: a plan's) with ``weight_format`` weights."""
    from tokenspeed_kernel.ops.moe import moe_apply_request

    return moe_apply_request(
        x_dtype=x_dtype,
        num_experts=128,
        top_k=top_k,
        hidden=2880,
        intermediate=2880,
        weight_format=weight_format,
        activation="swiglu_oai",
        bias=True,
        num_tokens=num_tokens,
        **kw,
    )


def candidate(selection, name: str):
    """The candidate of kernel ``name`` in an ``explain`` selection."""
    return next(c for c in selection.candidates if c.spec.name == name)


def check_rel_err(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """No NaN in ``out`` (poisoned outputs: every element written) and a relative Frobenius
    error against the float64 ``ref`` below ``tol``."""
    assert not torch.isnan(out).any(), "an output element was never written"
    err = float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())
    assert err < tol, f"relative error {err:.2e}"


# Relative Frobenius error bounds of the GEMV MoE tests per x dtype: the intermediate is rounded to x's dtype.
DTYPE_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """:func:`check_rel_err` with ``dtype``'s bound in :data:`DTYPE_TOL`, and every element
    within 4 times that bound of ``ref`` (relative, or absolute against ``max|ref| + 1``)."""
    tol = DTYPE_TOL[dtype]
    check_rel_err(out, ref, tol)
    tol = 4 * tol
    torch.testing.assert_close(
        out.double().cpu(), ref.double().cpu(), atol=tol * (float(ref.abs().max()) + 1), rtol=tol
    )


def call_override(inputs: dict, kernel: str, **kw) -> torch.Tensor:
    """``moe_apply(**inputs, override=kernel)`` into an output poisoned with NaN; asserts that
    ``kernel`` ran and the output is the one given."""
    from tokenspeed_kernel.ops._dispatch import last_kernel
    from tokenspeed_kernel.ops.moe import moe_apply

    out = torch.full_like(inputs["x"], float("nan"))
    result = moe_apply(**inputs, out=out, override=kernel, **kw)
    assert result is out and last_kernel() == kernel
    return out


def gemv_case(
    weight_format: str,
    t: int,
    h: int = 64,
    i: int = 32,
    act: str = "silu",
    bias: bool = False,
    emap: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    e: int = 8,
    k: int = 2,
) -> cases.MoECase:
    """A small ``moe.apply`` case of the GEMV MoE tests, named after its fields."""
    tags = f"{'_bias' if bias else ''}{'_map' if emap else ''}"
    return cases.MoECase(
        "moe.apply",
        t,
        h,
        i,
        e,
        k,
        dtype=dtype,
        weight_format=weight_format,
        activation=act,
        bias=bias,
        expert_map=emap,
        name=f"gemv_t{t}_h{h}_i{i}_e{e}k{k}_{act}{tags}",
    )


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
    plan = moe_plan(
        inputs["w13"],
        inputs["w2"],
        x_dtype=torch.bfloat16,
        top_k=4,
        activation=activation,
        w13_bias=inputs["w13_bias"],
        w2_bias=inputs["w2_bias"],
        expert_map=inputs["expert_map"],
        override=kernel,
    )
    return inputs, ref, out, plan


WEIGHT_KEYS = ("w13", "w2", "w13_bias", "w2_bias", "expert_map")
# (token count, forced K splits or None for the rule) of check_bound_runs: a count bound, a
# second one, the first again (its runner reused with new inputs), a larger one.
BOUND_STEPS = ((1, 2), (5, None), (1, 2), (33, 3))


def check_bound_runs(
    case: cases.MoECase,
    prepare: Callable[..., Any],
    bind: Callable[..., Any],
    functional: Callable[..., None],
    tol: float,
    device: str,
    steps: tuple[tuple[int, int | None], ...] = BOUND_STEPS,
    **overrides: Any,
) -> None:
    """A kernel's ``bind`` hook called directly with the ``prepare`` hook's weights, one runner
    per token count of ``steps`` (:data:`BOUND_STEPS`; bound at its first call with that step's
    ``splits`` and ``overrides``, e.g. ``tile``): fresh inputs of ``case`` at every call (the
    first call's weights), outputs poisoned with NaN; each run matches the float64
    ``naive_moe`` and equals ``functional`` (same splits and overrides) bit for bit."""
    weights = {k: v for k, v in cases.make_inputs(case, device, seed=1).items() if k in WEIGHT_KEYS}
    prepared = prepare(w13=weights["w13"], w2=weights["w2"])
    runners: dict[int, Any] = {}
    for seed, (num_tokens, splits) in enumerate(steps):
        step = cases.make_inputs(dataclasses.replace(case, num_tokens=num_tokens), device, seed=20 + seed)
        step.update(weights)
        args = MoEApplyArgs(**step, out=torch.full_like(step["x"], float("nan")), prepared=prepared)
        if num_tokens not in runners:
            runners[num_tokens] = bind(args, splits=splits, **overrides)
        runners[num_tokens](args)
        check_rel_err(args.out, naive_moe(**step), tol)
        expected = torch.full_like(step["x"], float("nan"))
        functional(MoEApplyArgs(**step, out=expected, prepared=prepared), splits=splits, **overrides)
        assert torch.equal(args.out, expected), f"T={num_tokens}: the bound run differs from the functional path"


def check_gpu_bound_runs(kernel: str, tol: float, max_tokens: int, weights: str = "mxfp4") -> None:
    """``kernel``'s ``moe_plan`` (``override``) at token counts 1, 5, 1, 33 and ``max_tokens + 1``
    with fresh :func:`awkward_gpu_inputs` (H = 1056: layer 1 is split by the rule at these
    counts, layer 2 with K = 416 is not) and the plan's weights at every call, outputs
    poisoned: each call matches float64 and equals the registered function on the plan's
    prepared weights bit for bit; counts up to ``max_tokens`` are bound, the one above is not.
    ``weights``: ``"mxfp4"`` or ``"bf16"`` (:func:`awkward_gpu_inputs`)."""
    from tokenspeed_kernel.ops.moe import moe_plan

    def inputs(tokens: int, seed: int) -> dict:
        return awkward_gpu_inputs(tokens, 32, 3, "swiglu_oai", True, True, seed=seed, hidden=1056, weights=weights)

    weights = {k: v for k, v in inputs(1, 0).items() if k in WEIGHT_KEYS}
    plan = moe_plan(**weights, x_dtype=torch.bfloat16, top_k=4, activation="swiglu_oai", override=kernel)
    counts = (1, 5, 1, 33, max_tokens + 1)
    for seed, num_tokens in enumerate(counts):
        step = inputs(num_tokens, seed + 1)
        step.update(weights)
        planned = plan.apply(
            step["x"], step["topk_weights"], step["topk_ids"], out=torch.full_like(step["x"], float("nan"))
        )
        check_rel_err(planned, naive_moe(**step), tol)
        expected = torch.full_like(step["x"], float("nan"))
        plan.spec.fn(MoEApplyArgs(**step, out=expected, prepared=plan.prepared))
        assert torch.equal(planned, expected), f"T={num_tokens}: the bound run differs from the functional path"
    assert set(plan.runners) == set(counts) and plan.runners[max_tokens + 1] is None
    assert all(plan.runners[t] is not None for t in counts[:-1])
