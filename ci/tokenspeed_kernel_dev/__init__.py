"""Development tooling of tokenspeed-kernel, not shipped in any wheel.

The ahead-of-time compile-and-inspect sweeps (no GPU needed) used by the test suite, the CI
and the tile sweeps: they compile the kernels of the runtime wheels for ``cuda:90`` /
``hip:gfx942`` / ``hip:gfx950`` and report what the compiler made (registers, spills, LDS,
MMA instructions, SASS loops). The runtime wheels never import this package.

Run from the repository root with ``ci`` on the path, the wheels installed (or their
``src`` directories on the path)::

    PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton hip:gfx942
    PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton_moe cuda:90
    PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_triton_gemv cuda:90
    PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_nvidia decode moe
    PYTHONPATH=ci python -m tokenspeed_kernel_dev.aot_amd gfx942 gfx950

The test suite puts ``ci`` on ``sys.path`` (tests/conftest.py) and runs the sweeps in
subprocesses through :func:`subprocess_env`.

Modules: :mod:`.aot_common` (targets, one compile, spill/register/SASS inspection),
:mod:`.aot_triton` (Triton attention and KV store), :mod:`.aot_triton_moe` (Triton MoE),
:mod:`.aot_triton_gemv` (the Triton MXFP4 GEMV), :mod:`.aot_nvidia` (the Gluon sm_90
kernels), :mod:`.aot_amd` with :mod:`.aot_amd_attention` and :mod:`.aot_amd_moe` (the Gluon
gfx942/gfx950 kernels). Not a compile sweep: :mod:`.ranks` runs a function on W local ranks of a
``torch.distributed`` process group with timeouts (the expert-parallel tests on gloo,
``ci/device/ep_bench.py`` on NCCL).
"""

from __future__ import annotations

import os

__all__ = ["CI_DIR", "subprocess_env"]

CI_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env() -> dict[str, str]:
    """The environment of a compile sweep's subprocess: this one without ``TRITON_INTERPRET``
    (the interpreter replaces the kernels, so nothing could compile) and with ``ci`` first on
    ``PYTHONPATH`` (so ``python -m tokenspeed_kernel_dev.<module>`` resolves)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CI_DIR, env.get("PYTHONPATH", "")) if p)
    return env
