"""conftest.py's isolation: a Triton test sees only the reference and Triton kernels, whatever
other wheels are installed (here, on CI, the NVIDIA and AMD wheels are)."""

from tokenspeed_kernel import registry


def test_only_reference_and_triton_kernels_are_registered():
    backends = {spec.backend for spec in registry.kernels()}
    assert backends <= {registry.BUILTIN_BACKEND, "triton"} and "triton" in backends, backends
