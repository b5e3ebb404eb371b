"""The repository root on sys.path, so the tests import ``examples.gpt_oss`` (the examples
are not part of any wheel)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
