"""The tokenspeed-kernel command line on CPU."""

import subprocess
import sys

import pytest

from tokenspeed_kernel import registry
from tokenspeed_kernel.cli import main

pytestmark = pytest.mark.usefixtures("only_reference")


def test_platform_and_list(capsys):
    assert main(["platform"]) == 0
    assert "cpu" in capsys.readouterr().out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "reference    loaded" in out and "torch_moe [torch, backend=reference" in out
    assert main(["list", "attention.decode"]) == 0
    assert "torch_prefill" not in capsys.readouterr().out


def test_explain_prints_the_table(capsys):
    assert main(["explain", "attention.decode", "--preset", "gpt-oss-120b", "--case", "0"]) == 0
    out = capsys.readouterr().out
    assert "decode_b64_ctx8192" in out and "WINNER   torch_decode" in out and "features=sinks" in out


def test_check_exit_codes(capsys, temp_kernels):
    assert main(["check", "all", "--preset", "small", "--device", "cpu"]) == 0
    assert "6 passed, 0 failed" in capsys.readouterr().out
    registry.register_kernel("moe.topk", name="t_bad_topk", solution="test", features=("softmax", "renormalize"))(
        lambda args: (args.topk_weights.fill_(0.5), args.topk_ids.fill_(0))
    )
    assert main(["check", "moe.topk", "--kernel", "t_bad_topk", "--device", "cpu"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_and_profile(capsys, tmp_path):
    assert main(["bench", "moe.topk", "--preset", "small", "--json", str(tmp_path / "b.json")]) == 0
    assert "torch_moe_topk" in capsys.readouterr().out and (tmp_path / "b.json").exists()
    trace = tmp_path / "trace.json"
    assert main(["profile", "moe.apply", "--preset", "small", "--out", str(trace)]) == 0
    assert "moe.apply:torch_moe" in trace.read_text()


def test_module_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel", "list", "kvcache.store"], capture_output=True, text=True, check=True
    ).stdout
    assert "torch_store_kvcache" in out
