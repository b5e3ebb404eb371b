"""``bench --suite``: suite data, a CPU run at tiny shapes, the budget, the pick against its
peers, the optional plot, and the end-to-end section (the example decoder, when
``examples.gpt_oss.bench`` imports)."""

import json
import os
import re
import sys
import types

import pytest
import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.reference import attention as reference_attention
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools import cases, suites
from tokenspeed_kernel.tools.common import PROVENANCE_KEYS, provenance
from tokenspeed_kernel.tools.presets import PRESETS
from tokenspeed_kernel.tools.suites import NOT_RUN_BUDGET, SUITES, Suite, SuiteEntry, run_suite, validate_suite

pytestmark = pytest.mark.usefixtures("only_reference")

H100 = "gpt-oss-120b-h100"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
E2E = "examples.gpt_oss.bench"


@pytest.fixture(autouse=True)
def _no_example(monkeypatch):
    """The end-to-end section runs where the example imports, which depends on the directory
    pytest runs in: hidden here (``import`` raises), shown by the ``example`` fixture."""
    monkeypatch.setitem(sys.modules, E2E, None)


@pytest.fixture
def example(monkeypatch):
    """``examples.gpt_oss.bench`` importable (the repository root on ``sys.path``)."""
    monkeypatch.syspath_prepend(ROOT)
    monkeypatch.delitem(sys.modules, E2E)


def test_every_suite_names_operators_presets_cases_and_kernels_that_exist():
    for name, suite in SUITES.items():
        assert suite.name == name and suite.entries
        validate_suite(suite)  # raises on an unknown operator, preset, case or kernel
        for entry in suite.entries:
            assert entry.op in cases.OPS and entry.preset in PRESETS
            assert entry.kernels in suites.KERNEL_SETS or all(
                registry.kernel_op(k.strip()) == entry.op for k in entry.kernels.split(",")
            )
            found = suites._entry_cases(entry)
            assert [c.name for c in found] == list(entry.cases) and all(c.op == entry.op for c in found)


def test_the_h100_suite_holds_the_published_rows():
    """The kernel rows of docs/benchmarks.md: decode B = 1/8/64 at 8k and B = 256 at 2k, full and
    window 128 with sinks; causal prefill S = 8192; window prefill S = 8192 and B = 4 x 4096; extend
    2048 on 6144; MoE MXFP4 and bf16 at T = 1, 8, 64, 512, 4096."""
    suite = SUITES[H100]
    got = {entry.label: suites._entry_cases(entry) for entry in suite.entries}
    decode = {(c.batch, c.seqlens_k[0]) for c in got["decode"]}
    assert decode == {(1, 8192), (8, 8192), (64, 8192), (256, 2048)}
    assert {(c.batch, c.seqlens_k[0]) for c in got["decode window 128"]} == decode
    attention = [c for label, found in got.items() if not label.startswith("MoE") for c in found]
    assert all(c.sinks and c.num_q_heads == 64 and c.num_kv_heads == 8 and c.head_dim == 64 for c in attention)
    assert {c.window_left for c in got["decode window 128"] + got["prefill window 128"]} == {127}
    assert {c.window_left for c in got["decode"] + got["prefill"] + got["extend"]} == {-1}
    assert [(c.batch, c.seqlens_q[0]) for c in got["prefill window 128"]] == [(1, 8192), (4, 4096)]
    assert [(c.seqlens_q[0], c.seqlens_k[0]) for c in got["extend"]] == [(2048, 8192)]
    for label, fmt in (("MoE MXFP4", "mxfp4"), ("MoE bf16", "plain")):
        assert [c.num_tokens for c in got[label]] == [1, 8, 64, 512, 4096]
        assert {(c.weight_format, c.num_experts, c.top_k, c.hidden, c.intermediate) for c in got[label]} == {
            (fmt, 128, 4, 2880, 2880)
        }
    assert all(entry.kernels == "peers" and entry.baselines for entry in suite.entries)
    assert suite.end_to_end and not any("examples/gpt_oss" in why for why in suite.left_out)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (SuiteEntry("x", "attention.nope", "small"), "no cases for operator 'attention.nope'"),
        (SuiteEntry("x", "moe.apply", "nope"), "unknown preset 'nope'"),
        (SuiteEntry("x", "moe.apply", "gpt-oss-120b", ("gpt_oss_120b_t3",)), "no moe.apply cases named"),
        (SuiteEntry("x", "moe.apply", "small", kernels="torch_decode"), "registered for attention.decode"),
    ],
)
def test_a_suite_naming_what_does_not_exist_is_rejected(entry, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_suite(Suite("bad", "", (entry,)))


def test_cpu_run_at_tiny_shapes_writes_the_json(tmp_path, capsys):
    path = tmp_path / "suite.json"
    assert main(["bench", "--suite", H100, "--preset", "small", "--device", "cpu", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    data = json.loads(path.read_text())
    assert data["suite"] == H100 and data["device"] == "cpu" and data["preset"] == "small" and data["ok"]
    assert data["versions"]["torch"] == torch.__version__ and "tokenspeed-kernel" in data["versions"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", data["date"]) and data["started"].startswith(data["date"])
    assert data["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", data["commit"])
    assert {key: data[key] for key in PROVENANCE_KEYS if key != "versions"} == {
        key: value for key, value in provenance().items() if key != "versions"
    }  # the block every tool's JSON carries (test_provenance.py), read from the package, not the cwd
    assert (data["budget_s"], data["stopped_by_budget"], data["not_run"]) == (None, False, [])
    assert [e["label"] for e in data["entries"]] == [e.label for e in SUITES[H100].entries]
    assert [r["entry"] for r in data["rows"]] == [e.label for e in SUITES[H100].entries]  # small: one case each
    for row in data["rows"]:
        assert row["status"] == "run" and row["pick"].startswith("torch_") and row["seconds"] > 0
        assert [(c["kernel"], c["status"], c["passed"]) for c in row["check"]] == [(row["pick"], "PASS", True)]
        assert 0 < row["check"][0]["rel_l2"] <= row["check"][0]["tol_rel_l2"]
        (pick,) = [t for t in row["timings"] if t["kind"] == "kernel"]
        assert pick["impl"] == row["pick"] and pick["selected"] and pick["ms"] > 0 and pick["check"] == "PASS"
        for base in (t for t in row["timings"] if t["kind"] == "baseline"):
            assert base["check"] is None
            if base["ms"] is not None:  # a baseline that ran on the CPU: the pick is set against it
                assert row["speedups"][base["impl"]] == pytest.approx(base["ms"] / pick["ms"])
    moe = [r for r in data["rows"] if r["op"] == "moe.apply"]
    assert moe and all("torch_grouped_mm" in r["speedups"] for r in moe)  # grouped_mm runs on CPUs
    assert f"suite {H100}:" in out and "summary (peer time / pick time" in out and "7 of 7 cases run" in out
    assert "[1/7] decode: " in err and "wrote JSON to" in err


def test_budget_zero_runs_no_case(tmp_path, monkeypatch):
    monkeypatch.setattr(suites, "check_case", lambda *a, **k: pytest.fail("a case ran"))
    path = tmp_path / "suite.json"
    report = run_suite(H100, preset="small", device="cpu", budget_s=0, json_path=str(path), quiet=True)
    assert report.rows and all(row.status == NOT_RUN_BUDGET for row in report.rows)
    data = json.loads(path.read_text())
    assert data["stopped_by_budget"] and data["budget_s"] == 0 and data["ok"]
    assert len(data["not_run"]) == len(data["rows"]) == len(SUITES[H100].entries)
    assert "0 of 7 cases run, 7 not run (budget)" in report.table()


def test_budget_starts_no_case_that_would_end_after_it(monkeypatch):
    """A case starts only while the time left exceeds the longest case of its operator so far."""
    now = [0.0]
    ran = []

    def fake_case(entry, case, which, dev, baselines):
        now[0] += 10.0
        ran.append(entry.label)
        return suites.SuiteRow(entry.label, case.op, case.name, case.describe()), None

    monkeypatch.setattr(suites, "_run_case", fake_case)
    report = run_suite(H100, preset="small", device="cpu", budget_s=25, quiet=True, clock=lambda: now[0])
    # 0 -> 10 -> 20 s: two decode cases; at 20 s 5 s are left, less than the 10 s a case took
    assert ran == ["decode", "decode window 128"]
    assert [row.status for row in report.rows] == ["run", "run"] + [NOT_RUN_BUDGET] * 5
    assert report.to_json()["not_run"][0] == "prefill: mha_ragged"


CPU = torch.device("cpu")  # selection for the CPU platform, on a GPU machine too


def _reference_decode(args):
    reference_attention.torch_decode(args)


def test_peers_are_the_pick_and_accepted_kernels_but_not_the_reference(temp_kernels, tmp_path):
    for name, priority in (("t_fast", Priority.PLUGIN), ("t_other", Priority.PORTABLE)):
        registry.register_kernel(
            "attention.decode",
            name=name,
            solution="test",
            vendors=("cpu",),
            priority=priority,
            features=("sinks", "return_lse", "sliding_window"),
            graph_safe=False,
        )(_reference_decode)
    registry.register_kernel(
        "attention.decode", name="t_gpu", solution="test", vendors=("cuda",), features=("sinks", "return_lse")
    )(_reference_decode)
    small = SuiteEntry("decode", "attention.decode", "small")
    case = suites._entry_cases(small)[0]
    pick, names, rejected = suites._kernel_set(case, "peers", CPU)
    assert (pick, names) == ("t_fast", ["t_fast", "t_other"]) and "vendor" in rejected["t_gpu"]
    assert suites._kernel_set(case, "pick", CPU)[1] == ["t_fast"]
    assert set(suites._kernel_set(case, "all", CPU)[1]) == {"t_fast", "t_other", "t_gpu", "torch_decode"}
    row, _ = suites._run_case(small, case, "peers", torch.device("cpu"), baselines=False)
    assert [(c.kernel, c.status) for c in row.check] == [("t_fast", "PASS"), ("t_other", "PASS")]
    assert set(row.speedups) == {"t_other"} and row.speedups["t_other"] > 0
    assert row.not_accepted == {"t_gpu": rejected["t_gpu"]}


def test_a_kernel_failing_the_check_is_not_timed_and_fails_the_run(temp_kernels, monkeypatch, capsys):
    temp_kernels("attention.decode", name="t_writes_nothing", vendors=("cpu",), features=("sinks", "return_lse"))
    entry = SuiteEntry("decode", "attention.decode", "small", kernels="all", baselines=False)
    monkeypatch.setitem(SUITES, "_t", Suite("_t", "a test suite", (entry,)))
    assert main(["bench", "--suite", "_t", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"\* FAIL .* t_writes_nothing +- +not timed: failed the check \(NaN in output\)", out), out
    report = run_suite("_t", device="cpu", quiet=True)
    (row,) = report.rows
    assert [c.kernel for c in row.failed] == ["t_writes_nothing"] and not report.ok
    assert [t["impl"] for t in row.timings] == ["torch_decode"] and row.speedups == {}  # the pick was not timed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench"], "give an operator (or all), or --suite NAME"),
        (["bench", "moe.topk", "--suite", H100], "give an operator or --suite, not both"),
        (["bench", "--suite", "nope"], f"unknown suite 'nope'; known suites: {H100}"),
        (["bench", "moe.topk", "--budget-s", "5"], "--plot and --budget-s go with --suite"),
        (["bench", "--suite", H100, "--kernel", "torch_decode"], "the kernels are one of pick, peers, all"),
        (["bench", "--suite", H100, "--budget-s", "-1"], "the budget must be a number of seconds >= 0"),
        (["bench", "--suite", H100, "--preset", "nope"], "unknown preset 'nope'"),
    ],
)
def test_suite_usage_errors_exit_2_before_anything_runs(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(suites, "_run_case", lambda *a: pytest.fail("a case ran"))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenspeed-kernel bench: error:") and message in err and err.count("\n") == 1


def test_plot_without_matplotlib_exits_2_with_how_to_install_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setattr(suites, "_run_case", lambda *a: pytest.fail("a case ran"))
    argv = ["bench", "--suite", H100, "--preset", "small", "--device", "cpu", "--plot", str(tmp_path / "s.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "tokenspeed-kernel bench: error: --plot needs matplotlib, which is not installed: "
        "pip install 'tokenspeed-kernel[plot]'\n"
    )
    assert not (tmp_path / "s.png").exists()


class _Recorder:
    """Stands in for matplotlib objects: records every method call as (name, args, kwargs)."""

    def __init__(self, log, prefix):
        self._log, self._prefix = log, prefix

    def __getattr__(self, name):
        def method(*args, **kwargs):
            self._log.append((f"{self._prefix}.{name}", args, kwargs))
            if name == "savefig":
                with open(args[0], "wb") as f:
                    f.write(b"fake image")

        return method


def _fake_matplotlib(monkeypatch, log):
    pyplot = types.ModuleType("matplotlib.pyplot")
    axes = []

    def subplots(rows, cols, **kwargs):
        axes[:] = [[_Recorder(log, f"ax{i}")] for i in range(rows)]
        return _Recorder(log, "fig"), axes

    pyplot.subplots = subplots
    pyplot.close = lambda fig: log.append(("plt.close", (), {}))
    matplotlib = types.ModuleType("matplotlib")
    matplotlib.use = lambda backend: log.append(("matplotlib.use", (backend,), {}))
    matplotlib.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)


def test_plot_draws_the_picks_speedup_over_each_peer_per_case(monkeypatch, tmp_path):
    """matplotlib is optional and may be missing here: a recording stand-in checks what is drawn."""
    log = []
    _fake_matplotlib(monkeypatch, log)
    path = tmp_path / "suite.png"
    report = run_suite(H100, preset="small", device="cpu", plot_path=str(path), quiet=True)
    assert path.read_bytes() == b"fake image" and ("matplotlib.use", ("Agg",), {}) in log
    timed = [row for row in report.rows if row.speedups]  # the MoE entries: torch_grouped_mm ran
    bars = [(name, args) for name, args, _ in log if name.endswith(".bar")]
    assert [name for name, _ in bars] == ["ax0.bar", "ax1.bar"] and len(timed) == 2  # one chart per entry
    for (_, args), row in zip(bars, timed):  # one case, one peer: a bar at x = 0, its height the speedup
        assert args[1] == [row.speedups["torch_grouped_mm"]] and args[0] == [0.0]
    assert sum(name.endswith(".axhline") for name, _, _ in log) == 2
    assert [name for name, _, _ in log][-3:] == ["fig.tight_layout", "fig.savefig", "plt.close"]


def test_plot_with_matplotlib_writes_a_png(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed (optional extra tokenspeed-kernel[plot]); the stand-in test covers it")
    path = tmp_path / "suite.png"
    run_suite(H100, preset="small", device="cpu", plot_path=str(path), quiet=True)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_from_a_saved_run_draws_the_same_bars_without_running(monkeypatch, tmp_path):
    saved = tmp_path / "suite.json"
    report = run_suite(H100, preset="small", device="cpu", json_path=str(saved), quiet=True)
    log = []
    _fake_matplotlib(monkeypatch, log)
    monkeypatch.setattr(suites, "_run_case", lambda *a: pytest.fail("a case ran"))
    path = tmp_path / "again.png"
    assert main(["bench", "--plot", str(path), "--from-json", str(saved)]) == 0
    assert path.read_bytes() == b"fake image"
    bars = [args for name, args, _ in log if name.endswith(".bar")]
    timed = [row for row in report.rows if row.speedups]
    assert [args[1] for args in bars] == [[row.speedups["torch_grouped_mm"]] for row in timed]


def test_from_json_usage_errors(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["bench", "--from-json", str(bad)]) == 2
    assert "--from-json FILE goes with --plot FILE.png only" in capsys.readouterr().err
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: the missing-file error comes after its own (tested above)")
    assert main(["bench", "--plot", str(tmp_path / "x.png"), "--from-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a saved suite run (KeyError" in err


def test_end_to_end_section_on_the_tiny_model_goes_to_the_table_json_and_plot(example, monkeypatch, tmp_path, capsys):
    """The suite at tiny shapes on a CPU with the example importable: the kernel rows, then one
    row per point of the example's section, the selector against the plain-PyTorch path."""
    log = []
    _fake_matplotlib(monkeypatch, log)
    path, png = tmp_path / "suite.json", tmp_path / "suite.png"
    argv = ["bench", "--suite", H100, "--preset", "small", "--device", "cpu", "--json", str(path), "--plot", str(png)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    from examples.gpt_oss import bench as e2e

    points = e2e.suite_config(tiny=True).points
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r["entry"] == suites.E2E_LABEL]
    assert len(data["rows"]) == len(SUITES[H100].entries) + len(points) and data["ok"]
    assert [r["case"] for r in rows] == [p.label for p in points]
    for row, point in zip(rows, points):
        assert row["op"] == f"e2e.{point.what}" and row["status"] == "run" and row["pick"] == "selector"
        assert [(c["kernel"], c["status"]) for c in row["check"]] == [("torch", "PASS"), ("selector", "PASS")]
        assert 0 < row["check"][1]["rel_l2"] < 3e-2 and "not float64" in row["check"][1]["tolerance"]
        times = {t["impl"]: t for t in row["timings"]}
        assert set(times) == {"torch", "selector"} and times["torch"]["kind"] == "baseline"  # CPU: no graph
        assert row["speedups"] == {"torch": pytest.approx(times["torch"]["ms"] / times["selector"]["ms"])}
        tokens = point.batch if point.what == "decode" else point.batch * point.ctx
        assert times["selector"]["tok_s"] == pytest.approx(tokens / (times["selector"]["ms"] * 1e-3))
    meta = data["end_to_end"]
    assert meta["check"] == e2e.CHECK and set(meta["kernels"]) == {"torch", "selector"} and meta["model"]["vocab_size"]
    assert not any("examples/gpt_oss" in why for why in data["left_out"])
    n = len(data["rows"])
    assert f"== {suites.E2E_LABEL}: examples/gpt_oss, 2 layers" in out and f"{n} of {n} cases run" in out
    assert f"[{n}/{n}] {suites.E2E_LABEL}: {points[-1].label}" in err
    charts = [args for name, args, _ in log if name.endswith(".set_title")]
    assert any(args[0].startswith(suites.E2E_LABEL) for args in charts)  # its own chart: the pick over torch


def test_end_to_end_is_left_out_with_the_reason_when_the_example_does_not_import(monkeypatch):
    monkeypatch.setattr(
        suites, "_run_case", lambda entry, case, *a: (suites.SuiteRow(entry.label, case.op, "c", ""), None)
    )
    report = run_suite(H100, preset="small", device="cpu", quiet=True)
    assert suites.E2E_LABEL not in {row.entry for row in report.rows} and report.end_to_end is None
    (why,) = [why for why in report.left_out if "examples/gpt_oss" in why]
    assert why.startswith(
        "end to end, 2-layer decoder: run from the repository root: examples/gpt_oss is not in the installed package"
    )
    assert "ModuleNotFoundError" in why and f"  - {why}" in report.table()
    assert report.to_json()["left_out"] == [*SUITES[H100].left_out, why]


def test_end_to_end_starts_under_the_budget_rule_of_the_cases(example, monkeypatch):
    """After the kernel rows it starts only while the time left exceeds the longest case so far;
    its points are then rows marked not run (budget)."""
    now = [0.0]

    def fake_case(entry, case, which, dev, baselines):
        now[0] += 10.0
        return suites.SuiteRow(entry.label, case.op, case.name, case.describe()), None

    monkeypatch.setattr(suites, "_run_case", fake_case)
    from examples.gpt_oss import bench as e2e

    monkeypatch.setattr(e2e, "measure", lambda *a, **k: pytest.fail("the section ran"))
    report = run_suite(H100, preset="small", device="cpu", budget_s=75, quiet=True, clock=lambda: now[0])
    rows = [row for row in report.rows if row.entry == suites.E2E_LABEL]
    assert [row.case for row in rows] == [p.label for p in e2e.suite_config(tiny=True).points]
    assert {row.status for row in rows} == {NOT_RUN_BUDGET} and report.ok
