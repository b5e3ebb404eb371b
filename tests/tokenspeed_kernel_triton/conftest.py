"""Tests of the Triton wheel see only its kernels and the reference backend.

On a GPU host other installed wheels register kernels that rank above Triton's for the same
inputs (the NVIDIA wheel's Gluon decode and MoE on sm_90); these tests assert that the Triton
kernel served the call, so they must not depend on which other wheels are installed.
"""

import pytest

from tokenspeed_kernel import registry


@pytest.fixture(autouse=True)
def _only_triton_and_reference():
    with registry.isolated(keep_backends=(registry.BUILTIN_BACKEND, "triton")):
        yield
