"""``examples/gpt_oss/bench.py`` on CPU: the suite's section on the tiny model (the selector's
choice = the Triton kernels under the interpreter) against the plain-PyTorch path, the
check of the logits, the budget, the command line and its JSON."""

from __future__ import annotations

import json
import os
import statistics

import pytest
import torch

from examples.gpt_oss import bench
from examples.gpt_oss.bench import E2EConfig, Point


def test_the_suite_section_runs_on_the_tiny_model_and_checks_every_row():
    config = bench.suite_config(tiny=True)
    assert config.tiny and config.rows == ("torch", "selector") and config.eager_batches == (1,)
    report = bench.measure("cpu", config, log=lambda line: None)
    assert [r.point for r in report.rows] == [p for p in config.points for _ in config.rows]
    assert set(report.kernels) == {"torch", "selector"} and report.kernels["selector"]["decode"]
    for point in config.points:
        base, sel = report.find("torch", point), report.find("selector", point)
        assert base.status == sel.status == "run" and base.finite and sel.finite
        assert base.check == sel.check == "PASS" and base.rel_l2_median is None
        assert 0 < sel.rel_l2_median <= sel.rel_l2_max < 3e-2  # bf16 paths: measured ~1e-2 here
        assert sel.baseline_tok_s == base.tok_s and sel.speedup == pytest.approx(sel.tok_s / base.tok_s)
        tokens = point.batch if point.what == "decode" else point.batch * point.ctx
        assert sel.tok_s == pytest.approx(tokens / (sel.ms * 1e-3))
        # no CUDA graph on a CPU: eager only, so no eager/graph ratio
        assert sel.graph_ms is None and sel.ms == sel.eager_ms and sel.eager_over_graph is None
    decode = [r for r in report.rows if r.what == "decode"]
    assert all(r.per_layer_ms is not None and r.batch in report.head_ms for r in decode)
    assert report.goals() == []  # the targets are for GPT-OSS widths on a GPU
    text = report.table()
    assert "decode_b3_ctx40" in text and "prefill_2x16" in text and "PASS" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["check"] == bench.CHECK and len(data["rows"]) == len(report.rows)


def _logits(rows: int, scale: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.randn(rows, 50, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(rows, 50, generator=torch.Generator().manual_seed(1))
    noise = noise / noise.norm(dim=-1, keepdim=True) * base.norm(dim=-1, keepdim=True)
    scale = torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1)
    return base + scale * noise, base


@pytest.mark.parametrize(
    ("rows", "scale", "status"),
    [
        (8, [0.2] + [5e-3] * 7, "PASS"),  # one sequence off (a routing near-tie): the median holds
        (8, [0.05] * 8, "FAIL"),  # every sequence off
        (1, 0.2, "PASS"),  # below 8 sequences the maximum is held, loosely
        (1, 0.5, "FAIL"),
    ],
)
def test_the_check_holds_the_median_over_sequences_or_the_maximum_below_eight(rows, scale, status):
    got, base = _logits(rows, scale)
    row = bench.E2ERow("decode", "selector", rows, 16)
    bench._compare(row, got, base)
    per = scale if isinstance(scale, list) else [scale]
    assert row.check == status and row.finite
    assert row.rel_l2_max == pytest.approx(max(per), rel=1e-5)
    assert row.rel_l2_median == pytest.approx(statistics.median(per), rel=1e-5)


def test_the_check_fails_non_finite_logits_and_says_when_nothing_was_compared():
    got, base = _logits(2, 0.0)
    got[1, 3] = float("nan")
    row = bench.E2ERow("prefill", "selector", 2, 16)
    bench._compare(row, got, base)
    assert (row.check, row.check_note, row.finite) == ("FAIL", "non-finite logits", False)
    row = bench.E2ERow("prefill", "selector", 2, 16)
    bench._compare(row, base, None)
    assert row.check == "-" and "no torch row" in row.check_note


def test_a_budget_of_zero_measures_nothing():
    config = E2EConfig((("decode", 1, 16), ("prefill", 1, 16)), rows=("torch",), tiny=True, page_size=4)
    report = bench.measure("cpu", config, budget_s=0, log=lambda line: None)
    assert [r.status for r in report.rows] == ["skipped: time budget"] * 2 and report.kernels["torch"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"points": ()}, "points must name at least one point"),
        ({"points": (("extend", 1, 8),)}, "points: each is (what in ('decode', 'prefill')"),
        ({"points": (("decode", 0, 8),)}, "points: batch and ctx must be >= 1"),
        ({"rows": ("torch", "vllm")}, "rows must be a non-empty subset of"),
        ({"page_size": 0}, "page_size must be >= 1"),
        ({"rep_ms": 0.0}, "rep_ms must be > 0"),
    ],
)
def test_bad_configurations_raise_naming_the_argument(changes, message):
    args = {"points": (("decode", 1, 8),), **changes}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        E2EConfig(**args)


def test_measure_rejects_a_bad_budget_before_building_anything(monkeypatch):
    monkeypatch.setattr(bench, "_make_kv", lambda *a, **k: pytest.fail("something was built"))
    with pytest.raises(ValueError, match="budget_s must be a number of seconds >= 0"):
        bench.measure("cpu", bench.suite_config(tiny=True), budget_s=-1)


def test_the_full_runs_points_put_the_goal_points_first():
    config = bench.cli_config(batches=[1, 64], contexts=[1024, 8192], prefill_tokens=16384)
    assert config.points == (
        Point("decode", 64, 8192),
        Point("prefill", 2, 8192),
        Point("decode", 1, 1024),
        Point("prefill", 1, 1024),
        Point("decode", 1, 8192),
        Point("prefill", 1, 8192),
        Point("decode", 64, 1024),
        Point("prefill", 16, 1024),
    )


@pytest.fixture
def _env_restored(monkeypatch):
    """``bench.main(["--device", "cpu", ...])`` may turn Triton's interpreter on (on a machine
    without a GPU, through ``config.use_cpu_interpreter``); whatever it does to the variable is
    undone after the test (an interpreter left on in a GPU test process broke a later test of
    its worker on the H100, 2026-11-27, when the command line still set it unconditionally)."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))
    yield


def test_command_line_smoke_writes_the_json(tmp_path, capsys, _env_restored):
    path = tmp_path / "e2e.json"
    argv = ["--device", "cpu", "--tiny", "--rows", "torch,reference", "--batches", "1", "--contexts", "16"]
    assert bench.main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "== e2e: GPT-OSS-shaped decoder, 2 layers, hidden 64" in out and "decode_b1_ctx16" in out
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and "versions" in data and "commit" in data
    assert [(r["what"], r["row"], r["check"]) for r in data["rows"]] == [
        ("decode", "torch", "PASS"),
        ("decode", "reference", "PASS"),
        ("prefill", "torch", "PASS"),
        ("prefill", "reference", "PASS"),
    ]
    assert data["kernels"]["reference"]["decode"] == "torch_decode"


def test_command_line_errors_exit_2(capsys, _env_restored):
    assert bench.main(["--device", "cpu", "--tiny", "--rows", "torch,nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m examples.gpt_oss.bench: error: rows must be a non-empty subset")
