"""The Triton wheel's expert-parallel kernels (triton_moe_dispatch, triton_moe_combine) on gloo
process groups of 2 and 4 spawned CPU ranks under Triton's interpreter: bitwise equal to the
core's padded dispatch and combine in both wire forms, and a capturable plan's steps equal to
the float64 MoE (support/ep_worker.py, ``TRITON_SCENARIOS``). A hang fails within 300 s."""

import pytest
from support import ep_worker
from tokenspeed_kernel_dev.ranks import run_ranks

# The Triton backend and the core's kernels in the ranks, the kernels interpreted on the CPU.
_ENV = {"TOKENSPEED_KERNEL_DISABLE_BACKENDS": "nvidia,amd,vllm", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_triton_exchange_matches_the_core_bitwise_and_float64(world):
    done = run_ranks(ep_worker.run_triton, world, env=_ENV, timeout_s=60, deadline_s=300)
    assert done == [[scenario.__name__ for scenario in ep_worker.TRITON_SCENARIOS]] * world


def test_the_device_bench_times_the_core_kernels_beside_the_triton_ones(tmp_path):
    """ci/device/ep_bench.py --cpu with the Triton backend (interpreted): the plan picks the
    Triton kernels, and the core's padded dispatch and combine are timed beside them after
    delivering the same bits (what the lead's GPU run compares with the first run's numbers)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[4] / "ci" / "device" / "ep_bench.py"
    out = tmp_path / "ep_bench.json"
    done = subprocess.run(
        [sys.executable, str(bench), "--cpu", "--tokens", "2", "--iters", "1", "--reps", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **_ENV},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert (
        row["ok"] and row["dispatch_kernel"] == "triton_moe_dispatch" and row["combine_kernel"] == "triton_moe_combine"
    )
    assert {"ep_dispatch:torch_moe_dispatch_padded", "ep_combine:torch_moe_combine"} <= set(row["times"])
    assert "bitwise equal to triton_moe_dispatch" in done.stdout and row["wire"] == "packed"
