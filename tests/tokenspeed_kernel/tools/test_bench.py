"""The bench tool on CPU: rows, counted work, baselines, selection mark, JSON output."""

import json

import pytest
import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.bench import bench
from tokenspeed_kernel.tools.cases import AttentionCase, MoECase

pytestmark = pytest.mark.usefixtures("only_reference")


def test_bench_small_preset_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    report = bench(["attention.decode", "moe.apply"], preset="small", json_path=str(path), device="cpu", quiet=True)
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["torch"] == torch.__version__ and data["date"]
    kernels = [r for r in data["rows"] if r["kind"] == "kernel"]
    assert {r["impl"] for r in kernels} == {"torch_decode", "torch_moe"}
    assert all(r["selected"] and r["ms"] > 0 and r["tbps"] > 0 for r in kernels)
    assert report.table().count("*") == 2


def test_bench_all_kernels_and_uniform_decode_baselines():
    case = AttentionCase("attention.decode", (1, 1), (40, 40), 4, 2, 16, page_size=8, dtype=torch.float32, name="u")
    from tokenspeed_kernel.tools import presets

    presets.PRESETS["_test"] = lambda op: [case]
    try:
        report = bench("attention.decode", kernel="all", preset="_test", device="cpu", quiet=True)
    finally:
        del presets.PRESETS["_test"]
    rows = {r.impl: r for r in report.rows}
    assert rows["gather_sdpa"].ms > 0 and rows["sdpa_contiguous"].ms > 0
    assert set(rows["torch_decode"].speedups) == {"gather_sdpa", "sdpa_contiguous"}


def test_counted_work():
    prefill = AttentionCase("attention.prefill", (4,), (4,), 2, 1, 8, dtype=torch.float32)
    # causal 4x4: 10 visible pairs x 2 heads x 2*(8+8) flops
    assert prefill.flops() == 10 * 2 * 32
    window = AttentionCase("attention.prefill", (4,), (4,), 2, 1, 8, dtype=torch.float32, window_left=1)
    assert window.flops() == 7 * 2 * 32
    decode = AttentionCase("attention.decode", (1,), (10,), 2, 1, 8, dtype=torch.float32, window_left=3)
    # q 2*8*4 + keys 4 visible * 1 kv head * 16 values * 4 bytes + out 2*8*4
    assert decode.bytes_moved() == 64 + 4 * 16 * 4 + 64
    moe = MoECase("moe.apply", 3, 64, 32, 8, 2, torch.float32)
    assert moe.flops() == 2 * 3 * 2 * (64 * 64 + 32 * 64)


def test_ceilings_are_cached(tmp_path, monkeypatch):
    from tokenspeed_kernel.tools import ceilings

    monkeypatch.setenv(ceilings.CACHE_DIR_ENV, str(tmp_path))
    first = ceilings.ceilings(torch.device("cpu"))
    assert first.copy_tb_s > 0 and first.matmul_tflop_s > 0
    assert (tmp_path / "ceilings.json").exists()
    monkeypatch.setattr(ceilings, "_measure", lambda device: pytest.fail("should come from the cache"))
    assert ceilings.ceilings(torch.device("cpu")) == first


def test_every_preset_case_has_counted_work_and_a_request():
    from tokenspeed_kernel.tools.presets import PRESETS, preset_cases

    for preset in PRESETS:
        for op in cases.OPS:
            for case in preset_cases(preset, op):
                assert case.bytes_moved() > 0
                assert cases.request(case).op == op
