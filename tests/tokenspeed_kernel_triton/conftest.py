"""Tests of the Triton wheel see only its kernels and the reference backend.

On a GPU host other installed wheels register kernels that rank above Triton's for the same
inputs (the NVIDIA wheel's Gluon decode and MoE on sm_90); these tests assert that the Triton
kernel served the call, so they must not depend on which other wheels are installed.
A module that tests the Triton wheel's machinery on other wheels' kernels too (the launch
cache serves the NVIDIA wheel's Gluon kernels) sets ``ALL_BACKENDS = True`` and sees every
installed kernel.
"""

import pytest

from tokenspeed_kernel import registry


@pytest.fixture(autouse=True)
def _only_triton_and_reference(request):
    if getattr(request.module, "ALL_BACKENDS", False):
        yield
        return
    with registry.isolated(keep_backends=(registry.BUILTIN_BACKEND, "triton")):
        yield
