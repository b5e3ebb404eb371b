"""tools/timing.py on the CPU: the flush argument is validated, the wall-clock path times."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.tools.timing import FLUSH_MODES, time_fn


def test_time_fn_cpu_counts_calls_and_reports_eager() -> None:
    calls = []
    timing = time_fn(lambda: calls.append(1), torch.device("cpu"), rep_ms=1.0)
    assert timing.median_ms >= 0.0 and timing.min_ms <= timing.median_ms
    assert not timing.graph and timing.reps >= 3 and len(calls) == timing.reps + 2


@pytest.mark.parametrize("mode", FLUSH_MODES)
def test_time_fn_accepts_each_flush_mode(mode: str) -> None:
    assert time_fn(lambda: None, torch.device("cpu"), rep_ms=1.0, flush=mode).reps >= 3


def test_time_fn_rejects_an_unknown_flush_before_running() -> None:
    calls = []
    with pytest.raises(ValueError, match="flush must be one of"):
        time_fn(lambda: calls.append(1), torch.device("cpu"), flush="dirty")
    assert calls == []
