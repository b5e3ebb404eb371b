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
