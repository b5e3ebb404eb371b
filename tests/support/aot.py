"""Run an ahead-of-time compile module (``python -m <module> <args>``) in subprocesses.

The compile sweeps print one JSON object per compiled configuration. They must run without
``TRITON_INTERPRET`` (the interpreter replaces the kernels in the test process), so each
runs in its own interpreter; several argument lists run in parallel.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tokenspeed_kernel_dev import subprocess_env

__all__ = ["AotRun", "run_aot"]


@dataclass(frozen=True)
class AotRun:
    """One sweep: its JSON rows, the tail of its stderr and its exit code."""

    rows: list[dict]
    stderr: str
    returncode: int


def run_aot(module: str, arg_lists: Sequence[Sequence[str]], *, timeout: float = 600) -> list[AotRun]:
    """``python -m module *args`` for each of ``arg_lists``, in parallel, without
    ``TRITON_INTERPRET`` and with ``ci`` on ``PYTHONPATH``; asserts that every sweep printed at least one row."""
    env = subprocess_env()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for args in arg_lists
    ]
    runs = []
    for args, proc in zip(arg_lists, procs):
        stdout, stderr = proc.communicate(timeout=timeout)
        rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        assert rows, f"the compile sweep {module} {' '.join(args)} printed nothing: {stderr[-2000:]}"
        runs.append(AotRun(rows, stderr[-2000:], proc.returncode))
    return runs
