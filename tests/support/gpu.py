"""Shared by the NVIDIA GPU test files: skip reasons (the Gluon sm_90 kernels), the float64
comparison of an attention case (the FlashInfer and TensorRT-LLM kernels)."""

import os

import torch


def sm90_skip_reason() -> str | None:
    """Why a Gluon sm_90 kernel cannot run here, or None when it can (an sm_90 CUDA device,
    outside the Triton interpreter)."""
    if not torch.cuda.is_available():
        return "no CUDA device: Gluon kernels run only on a GPU (compile-checked by test_aot_compile.py)"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: Gluon does not run under the Triton interpreter"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"sm_{major}{minor} device: the kernel is built for sm_90 only"
    return None


def sharpen_sinks(case, inputs, tol: float) -> None:
    """Doubles ``inputs["sinks"]`` (to ``2·N(0, 1)``) and asserts that the float64 reference
    without sinks is off by more than ``3 * tol`` (relative Frobenius error of the output),
    so a kernel that drops the sinks cannot pass a case checked at ``tol``."""
    from tokenspeed_kernel.tools.cases import attention as cases

    inputs["sinks"].mul_(2.0)
    with_sinks, _ = cases.reference(case, inputs)
    without, _ = cases.reference(case, {**inputs, "sinks": None})
    # a kernel that dropped the sinks would be off by this much: 3x the tolerance is enough
    # (the H100 run of 2026-11-23 drew 0.080 for FlashInfer's non-causal prefill case)
    assert float((without - with_sinks).norm() / with_sinks.norm()) > 3 * tol, "the case cannot tell sinks from none"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the float64 ``b``."""
    return float((a.double() - b).norm() / b.norm())


def check_against_float64(case, override: str, label: str, tol: float) -> None:
    """Run an attention ``case`` on CUDA through kernel ``override`` and compare with the
    float64 reference (``tokenspeed_kernel.tools.cases.attention.reference``): output rel.
    error and, when the case returns it, the LSE (atol/rtol ``tol``). Sinks are drawn
    ``2·N(0, 1)`` and must move the reference by more than ``3 * tol``, so a kernel that drops
    them cannot pass; the output is poisoned with NaN first."""
    from tokenspeed_kernel.tools.cases import attention as cases

    inputs = cases.make_inputs(case, "cuda", seed=len(label))
    if case.sinks:
        sharpen_sinks(case, inputs, tol)
    ref_out, ref_lse = cases.reference(case, inputs)
    q = inputs["q"]
    out = torch.full((*q.shape[:-1], case.dv), float("nan"), dtype=q.dtype, device=q.device)
    result = cases.call(case, inputs, override=override, out=out)
    res, lse = result if case.return_lse else (result, None)
    torch.cuda.synchronize()
    assert not torch.isnan(res).any(), f"{label}: NaN in the output"
    err = rel_err(res, ref_out)
    assert err < tol, f"{label}: rel err {err:.3g}"
    if lse is not None:
        assert not torch.isnan(lse).any(), f"{label}: NaN in the LSE"
        torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


def replay_with_grown_lengths(case, inputs: dict, plan, graph, out: torch.Tensor, lse, tol: float) -> None:
    """Twice: grow the decode ``case``'s ``cache_seqlens`` by one in place, ``plan.update()``,
    replay the captured ``graph`` over a NaN-poisoned ``out``, compare ``out`` (and ``lse``
    when not None) with the float64 reference."""
    from tokenspeed_kernel.tools.cases import attention as cases

    for _ in range(2):
        inputs["cache_seqlens"].add_(1)
        plan.update()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = cases.reference(case, inputs)
        assert rel_err(out, ref_out) < tol
        if lse is not None:
            torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
