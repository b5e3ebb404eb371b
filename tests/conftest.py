"""Test-suite setup.

- tests/support is importable as ``support`` (independent float64 computations), and
  ci/tokenspeed_kernel_dev as ``tokenspeed_kernel_dev`` (the ahead-of-time compile tooling).
- On a machine without a GPU, Triton kernels run under the interpreter
  (``TRITON_INTERPRET=1``, set before anything imports triton), so the CPU platform reports
  ``triton_interpreter``, which they require there, and the public calls, ``check`` and the
  selector exercise them on the CPU.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
# ci/tokenspeed_kernel_dev: the ahead-of-time compile tooling (not in any wheel).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ci"))

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The quick subset is `pytest -m "not slow"`: these paths (relative to tests/) are marked slow
# as a whole, besides single tests marked @pytest.mark.slow (wheel builds, inductor). They run
# every kernel under the Triton interpreter at many shapes, compile kernels ahead of time or
# through torch.compile, or drive the engines' integrations.
_SLOW_PATHS = (
    "tokenspeed_kernel_triton/ops/",
    "tokenspeed_kernel_triton/test_aot_",
    "tokenspeed_kernel_triton/test_check_cli.py",
    "tokenspeed_kernel_amd/test_aot_",
    "tokenspeed_kernel_nvidia/test_aot_",
    "tokenspeed_kernel/integrations/",
    "tokenspeed_kernel/ops/test_edge_inputs.py",
    "tokenspeed_kernel/ops/attention/test_compile.py",
    "tokenspeed_kernel/ops/moe/test_compile.py",
    "tokenspeed_kernel_vllm/",
    "examples/",
)


def pytest_collection_modifyitems(config, items):
    import pytest

    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        rel = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        if rel.startswith(_SLOW_PATHS):
            item.add_marker(pytest.mark.slow)
