"""``tokenspeed-kernel check --preset awkward`` passes for every Triton kernel under the
interpreter (the command the device scripts run on the GPU; bf16 and fp16, fp8 KV and every
MoE weight format included)."""

import os

import pytest

from tokenspeed_kernel.cli import main

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
