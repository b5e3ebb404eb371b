"""Ahead-of-time compile of the Gluon kernels for sm_90 (no GPU): the PTX holds the intended
instructions (decode: cp.async gathers, mma.sync; window prefill: TMA copies, wgmma), and
ptxas reports no spills."""

import json
import os
import subprocess
import sys

import pytest


def _compile(kind: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel_nvidia.aot", kind],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-2000:]
    for row in rows:
        assert row["ok"], row
        assert row["spills"] == 0 and row["local"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row
    assert proc.returncode == 0, proc.stderr[-2000:]
    return rows


@pytest.fixture(scope="module")
def prefill_rows() -> list[dict]:
    return _compile("prefill")


def test_gluon_decode_compiles_for_sm90():
    for row in _compile("decode"):
        assert row["cp_async"] > 0, row
        assert row["mma"] > 0, row


def test_gluon_prefill_compiles_for_sm90_with_tma_and_wgmma(prefill_rows):
    assert len(prefill_rows) >= 9
    for row in prefill_rows:
        # Both products on wgmma (QK^T and PV: one m64 instruction per 16-wide k step and
        # 64-row half), K/V by TMA, no cp.async gathers or mma.sync left.
        assert row["wgmma"] >= 8, row
        assert row["tma"] >= 4, row
        assert row["cp_async"] == 0 and row["mma"] == 0, row
        assert 0 < row["registers"] <= 255, row


def test_gluon_prefill_d64_default_fits_two_programs_per_sm(prefill_rows):
    # The GPT-OSS configuration: 64 KiB of shared memory (Q tile + 3-stage K/V ring) and
    # <= 255 registers x 128 threads, so two 128-row programs share an SM.
    row = next(r for r in prefill_rows if r["kernel"] == "gluon_prefill-bfloat16-d64-g8-n64-st3-w4-sinks")
    assert row["shared_bytes"] <= 70 * 1024, row
    assert row["registers"] * 128 * 2 <= 65536, row
