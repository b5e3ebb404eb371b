"""Ahead-of-time compile of the Gluon kernels for sm_90 (no GPU): PTX holds the intended
instructions (cp.async gathers, mma.sync tensor-core products)."""

import json
import os
import subprocess
import sys


def test_gluon_decode_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel_nvidia.aot"], capture_output=True, text=True, env=env, timeout=300
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-2000:]
    for row in rows:
        assert row["ok"], row
        assert row["cp_async"] > 0, row
        assert row["mma"] > 0, row
        assert row["spills"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row
    assert proc.returncode == 0, proc.stderr[-2000:]
