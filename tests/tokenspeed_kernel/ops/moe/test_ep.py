"""Expert parallelism (moe_dispatch / moe_combine / moe_dispatch_plan) on gloo process groups of
2 and 4 spawned CPU ranks, against the single-process float64 MoE (support/ep_worker.py runs
the scenarios on each rank). Every collective times out after 30 s (the group's timeout) and
the ranks are killed if they have not all reported within 150 s: a hang fails, it never blocks."""

import pytest
from support import ep_worker
from tokenspeed_kernel_dev.ranks import run_ranks

# Only the core's kernels in the ranks: each spawned process then imports no backend wheel.
_ENV = {"TOKENSPEED_KERNEL_DISABLE_BACKENDS": "triton,nvidia,amd", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_every_scenario_passes_on_every_rank(world):
    done = run_ranks(ep_worker.run, world, env=_ENV, timeout_s=30, deadline_s=150)
    names = [scenario.__name__ for scenario in ep_worker.SCENARIOS]
    assert done == [names] * world
