"""Every Triton kernel compiles ahead of time for sm_90, gfx942 and gfx950 (no GPU needed),
over the configurations the launch heuristics can choose, and the assembly holds the matrix
instructions it should. Runs `python -m tokenspeed_kernel_triton.aot` in a subprocess
without TRITON_INTERPRET (the interpreter replaces the kernels in this process)."""

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
    proc = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel_triton.aot", *TARGETS],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, f"the compile sweep printed nothing: {proc.stderr[-2000:]}"
    return rows


@pytest.mark.parametrize("target", TARGETS)
def test_every_kernel_builds(results, target):
    mine = [r for r in results if r["target"] == target]
    failed = [f"{r['kernel']}: {r['error']}" for r in mine if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert len(mine) >= 30


@pytest.mark.parametrize("target", TARGETS)
def test_attention_uses_matrix_instructions_and_fits_shared_memory(results, target):
    for r in results:
        if r["target"] != target:
            continue
        assert r["shared_bytes"] <= SHARED_LIMIT[target], r
        if r["kernel"].startswith("attention["):
            assert r["matrix_instructions"] > 0, f"{r['kernel']} on {target}: no mma/mfma instruction"


def test_hopper_prefill_uses_wgmma():
    from tokenspeed_kernel_triton import aot

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "from tokenspeed_kernel_triton import aot\n"
        "from triton.backends.compiler import GPUTarget\n"
        "import triton\nfrom triton.compiler import ASTSource\n"
        "t = GPUTarget('cuda', 90, 32)\n"
        "sig, c = aot._signature(aot.attention_configs()[0], t)\n"
        "opts = c.pop('_options')\n"
        "k = triton.compile(ASTSource(fn=aot.attention_kernel, signature=sig, constexprs=c), target=t, options=opts)\n"
        "print('wgmma' in k.asm['ptx'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip().endswith("True"), out.stderr[-1500:]
    assert aot.attention_configs()[0].regime == "prefill"
