"""Timing: device events on a GPU, the wall clock on a CPU; medians after warm-up.

On a GPU the call is first captured into a CUDA graph and the graph's replays are timed,
as a serving engine runs a decode step: the number is device time, not Python and launch
overhead (which would dominate a 20 µs kernel). A call that cannot be captured (it
synchronizes with the host, like the reference kernels) is timed eagerly, and
:class:`Timing` says which.

**L2 flush.** Each repetition is preceded, outside the timed region, by a pass over a buffer
larger than the L2 cache, so inputs left in cache by the previous repetition do not flatter
the kernel. The default pass *reads* the buffer (``flush="read"``): the timed call then
starts with a cold L2 holding only clean lines, as a decode step's MoE or attention starts
after other kernels have streamed their weights. ``flush="write"`` zeroes it instead, as the
usual GPU benchmark helpers do; that leaves the L2 full of dirty lines which the timed
call must write back before its own reads can allocate (on an H100: ~50 MB, ~10 µs), a cost
no real workload pays before every kernel and one that swamps kernels of a few tens of µs
(measured side by side in docs/history.md, 2026-11-23 evening). ``flush="none"`` keeps
the L2 warm.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["FLUSH_MODES", "Timing", "time_fn"]

_FLUSH_BYTES = 256 * 2**20
FLUSH_MODES = ("read", "write", "none")


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    reps: int
    graph: bool = False


def _reps(budget_ms: float, one_ms: float, lo: int, hi: int) -> int:
    return int(max(lo, min(hi, budget_ms / max(one_ms, 1e-3))))


def _as_graph(fn: Callable[[], object], device: torch.device) -> Callable[[], object] | None:
    """``fn`` captured into a CUDA graph (its replay), or None if it cannot be captured."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside capture (allocations, compilation)
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception:
        torch.cuda.synchronize(device)
        return None
    return graph.replay


def _flush(buf: torch.Tensor, mode: str) -> None:
    """Empty the L2 by reading ``buf`` (clean lines) or zeroing it (dirty lines)."""
    if mode == "read":
        buf.sum()
    elif mode == "write":
        buf.zero_()


def time_fn(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup_ms: float = 25.0,
    rep_ms: float = 100.0,
    graph: bool = True,
    flush: str = "read",
) -> Timing:
    """Median time of ``fn()`` on ``device`` (ms); on a GPU through a CUDA graph when it can.

    ``flush``: how the L2 is emptied before each timed repetition on a GPU, one of
    :data:`FLUSH_MODES` (see the module docstring); ignored on a CPU."""
    if flush not in FLUSH_MODES:
        raise ValueError(f"flush must be one of {FLUSH_MODES}, got {flush!r}")
    if device.type != "cuda":
        fn()
        start = time.perf_counter()
        fn()
        one = (time.perf_counter() - start) * 1e3
        samples = []
        for _ in range(_reps(rep_ms, one, 3, 50)):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return Timing(statistics.median(samples), min(samples), len(samples))
    buf = torch.zeros(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    replay = _as_graph(fn, device) if graph else None
    captured = replay is not None
    fn = replay or fn
    fn()
    torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    one = begin.elapsed_time(end) / 3
    for _ in range(_reps(warmup_ms, one, 1, 100)):
        fn()
    n = _reps(rep_ms, one, 5, 1000)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        _flush(buf, flush)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(samples), min(samples), n, captured)
