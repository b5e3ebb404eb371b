"""``profile``: a torch.profiler Chrome trace of each selected kernel on a preset's cases.

Each call runs inside ``record_function("<op>:<kernel>")`` so the trace names the kernel
the selector picked (or the one forced with ``kernel=``). Open the JSON in
chrome://tracing or Perfetto.

torch's profiler library (Kineto) writes trace markers to file descriptor 2 when a session
starts and stops (``USDT:<date> <time> <pid>:<tid> SyncActivityProfilerHandler.cpp:52]
profiler_start``, and ``STAGE:`` lines at lower log levels), from C++, so Python cannot
redirect them. The profiler's start and stop run with descriptor 2 captured; those marker
lines are dropped and every other line is written back to stderr.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, record_function
from torch.profiler import profile as _profile

from tokenspeed_kernel import selector
from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.common import named_kernels, resolve_device
from tokenspeed_kernel.tools.presets import preset_cases

__all__ = ["profile"]


def profile(
    op: str,
    out_path: str,
    *,
    preset: str = "gpt-oss-120b",
    kernel: str | None = None,
    device: str | torch.device | None = None,
    iterations: int = 3,
) -> list[str]:
    """Write a Chrome trace to ``out_path``; return the ``op:kernel`` names recorded."""
    dev = resolve_device(device)
    selector.env_overrides()
    if kernel is not None:
        named_kernels(op, [kernel])
    work = [(case, cases.make_inputs(case, dev, seed=0)) for case in preset_cases(preset, op)]
    names = []
    for case, inputs in work:  # warm up (compilation, autotuning) outside the trace
        cases.call(case, inputs, override=kernel)
        names.append(f"{op}:{last_kernel()} [{case.describe()}]")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    prof = _profile(activities=activities)
    with _without_profiler_markers():
        prof.start()
    try:
        for _ in range(iterations):
            for (case, inputs), name in zip(work, names):
                with record_function(name):
                    cases.call(case, inputs, override=kernel)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    finally:
        with _without_profiler_markers():
            prof.stop()
    prof.export_chrome_trace(out_path)
    return names


# Kineto's informational log lines: "<LEVEL>:<date> <time> <pid>:<tid> <file>:<line>] <message>".
_MARKER = re.compile(rb"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def _without_profiler_markers() -> Iterator[None]:
    """Capture file descriptor 2 for the block; afterwards write back every line but Kineto's
    ``USDT:``/``STAGE:`` markers (warnings and errors pass through, only delayed). Also drops
    torch's advice that events are cleared between profiler cycles (warned at ``start`` with
    CUDA activity): a trace here is one cycle."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured if not _MARKER.match(line))
            if kept:
                sys.stderr.write(kept.decode(errors="replace"))
                sys.stderr.flush()
