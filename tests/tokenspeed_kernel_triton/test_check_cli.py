"""``tokenspeed-kernel check --preset awkward`` passes for every Triton kernel under the
interpreter (the command the device scripts run on the GPU; bf16 and fp16, fp8 KV and every
MoE weight format included), and the derived check (every claim of every kernel that runs
here) finds no false claim."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenspeed_kernel.cli import main

ALL_BACKENDS = True  # the derived check covers every installed wheel's kernels (the others pass --kernel)

KERNELS = {
    "kvcache.store": "triton_store_kvcache",
    "attention.decode": "triton_decode",
    "attention.extend": "triton_extend",
    "attention.prefill": "triton_prefill",
    "moe.topk": "triton_moe_topk",
    "moe.apply": "triton_fused_moe",
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU form (the GPU runs ci/device/*)")
@pytest.mark.parametrize("op", list(KERNELS))
def test_check_passes_for_the_triton_kernel(op, capsys):
    code = main(["check", op, "--kernel", KERNELS[op], "--preset", "awkward", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    assert " 0 failed" in summary and not summary.startswith("0 passed"), summary


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU form (on a GPU: check all --device cuda)")
def test_no_kernel_that_runs_here_fails_a_claim(tmp_path):
    """``check all`` in its default (derived) mode over every installed kernel: the reference
    and Triton kernels run (the Triton ones under the interpreter) and none fails a claim;
    the GPU-only kernels (the NVIDIA and AMD wheels' where installed, the ``tl.dot_scaled``
    MoE) are ``not run here``, never passed. About 30-60 s on 2 cores."""
    from tokenspeed_kernel import registry, selector
    from tokenspeed_kernel.platform import platform_for
    from tokenspeed_kernel.tools.cases import NO_CASES

    path = tmp_path / "claims.json"
    assert main(["check", "all", "--device", "cpu", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    failed = [
        f"{c['kernel']}: {c['kind']} {c['claim']} ({c['note']})" for c in data["claims"] if c["status"] == "failed"
    ]
    assert not failed and data["failed"] == 0, failed
    status: dict[str, set[str]] = {}
    for c in data["claims"]:
        status.setdefault(c["kernel"], set()).add(c["status"])
    for kernel in KERNELS.values():  # every claim of each Triton kernel that runs here is checked
        assert status[kernel] == {"checked"}, kernel
    here = platform_for(torch.device("cpu"))
    gpu_only = {s.name for s in registry.kernels() if selector.platform_reasons(s, here)}
    assert "triton_fused_moe_mx" in gpu_only  # tl.dot_scaled: no interpreter
    # every kernel has claims, except the expert-parallel exchange's: it runs across ranks
    # (cases.NO_CASES; tests/tokenspeed_kernel*/ops/moe/test_ep.py run it on gloo ranks)
    assert set(status) == {s.name for s in registry.kernels() if s.op not in NO_CASES}
    for kernel in gpu_only:
        assert status[kernel] <= {"not run here", "not exercised"}, kernel


def _check_in_a_fresh_process(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """``python -m tokenspeed_kernel check moe.topk --preset small`` in a process whose
    environment has no ``TRITON_INTERPRET`` (the test suite's own is set) plus ``env``; its
    exit, stderr and ``{kernel: status}``."""
    path = tmp_path / "check.json"
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel", "check", "moe.topk", "--preset", "small", "--json", str(path)],
        capture_output=True,
        text=True,
        env={**base, **env},
    )
    assert run.returncode == 0, run.stderr
    return run, {row["kernel"]: row["status"] for row in json.loads(path.read_text())["rows"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter default is for machines without a GPU")
def test_check_without_a_gpu_runs_the_triton_kernels_under_the_interpreter(tmp_path):
    run, status = _check_in_a_fresh_process(tmp_path)
    assert status["triton_moe_topk"] == "PASS" and status["torch_moe_topk"] == "PASS"
    assert run.stderr == (
        "tokenspeed-kernel check: no GPU here: the Triton kernels run under Triton's CPU interpreter "
        "(TRITON_INTERPRET=1; TRITON_INTERPRET=0 skips them)\n"
    )
    run, status = _check_in_a_fresh_process(tmp_path, TRITON_INTERPRET="0")  # the user's choice stands
    assert status["triton_moe_topk"] == "SKIP" and status["torch_moe_topk"] == "PASS" and run.stderr == ""
