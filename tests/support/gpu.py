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
