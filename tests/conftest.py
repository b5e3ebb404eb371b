"""Test-suite setup.

- tests/support is importable as ``support`` (independent float64 computations).
- On a machine without a GPU, Triton kernels run under the interpreter
  (``TRITON_INTERPRET=1``, set before anything imports triton), so they register for the
  CPU platform and the public calls, ``check`` and the selector exercise them there.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
