"""The MoE kernels compile ahead of time for sm_90, gfx942 and gfx950 (no GPU needed) over
the tiles the launch table can choose and every weight format; the grouped GEMMs use the
matrix units (``mma``/``wgmma`` in PTX, Hopper's ``wgmma`` at the prefill tile; ``v_mfma``
in AMDGCN), fit shared memory and do not spill. Runs
``python -m tokenspeed_kernel_triton.ops.moe._aot`` in subprocesses without TRITON_INTERPRET
(the interpreter replaces the kernels in this process)."""

import json
import os
import subprocess
import sys

import pytest

TARGETS = ("cuda:90", "hip:gfx942", "hip:gfx950")
SHARED_LIMIT = {"cuda:90": 227 * 1024, "hip:gfx942": 64 * 1024, "hip:gfx950": 160 * 1024}


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tokenspeed_kernel_triton.ops.moe._aot", target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for target in TARGETS
    ]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert found, f"the compile sweep printed nothing: {err[-2000:]}"
        rows += found
    return rows


@pytest.mark.parametrize("target", TARGETS)
def test_every_moe_kernel_builds(results, target):
    mine = [r for r in results if r["target"] == target]
    failed = [f"{r['kernel']}: {r['error']}" for r in mine if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert len(mine) >= 16
    assert {"moe_align", "moe_combine", "moe_topk"} <= {r["kernel"] for r in mine}


@pytest.mark.parametrize("target", TARGETS)
def test_moe_gemms_use_matrix_units_and_fit(results, target):
    for r in results:
        if r["target"] != target:
            continue
        assert r["shared_bytes"] <= SHARED_LIMIT[target], r
        assert r["spills"] == 0, r
        if r["kernel"].startswith("moe_gemm["):
            assert r["matrix_instructions"] > 0, f"{r['kernel']} on {target}: no mma/mfma instruction"


def test_hopper_prefill_tiles_use_wgmma(results):
    prefill = [r for r in results if r["target"] == "cuda:90" and "-m128n" in r["kernel"]]
    assert prefill, "no prefill-tile compile for sm_90"
    assert all(r["wgmma"] for r in prefill), [r["kernel"] for r in prefill if not r["wgmma"]]
