"""Skip reasons shared by the NVIDIA GPU test files (the Gluon sm_90 kernels)."""

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
