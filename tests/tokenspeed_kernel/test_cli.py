"""The tokenspeed-kernel command line on CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.tools.common import PROVENANCE_KEYS

pytestmark = pytest.mark.usefixtures("only_reference")


def test_platform_and_list(capsys):
    assert main(["platform"]) == 0
    assert ("cuda" if torch.cuda.is_available() else "cpu") in capsys.readouterr().out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "reference    loaded" in out and "torch_moe [torch, backend=reference" in out
    assert main(["list", "attention.decode"]) == 0
    assert "torch_prefill" not in capsys.readouterr().out


def test_explain_prints_the_table(capsys):
    assert main(["explain", "attention.decode", "--preset", "gpt-oss-120b", "--case", "0"]) == 0
    out = capsys.readouterr().out
    assert "decode_b64_ctx8192" in out and "WINNER   torch_decode" in out and "features=sinks" in out
    assert main(["explain", "attention.prefill", "--case-index", "-1", "--platform", "sm_90"]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 1 and "win=127" in out and "cuda/sm_90" in out


def test_explain_a_request_spelled_out(capsys):
    argv = ["explain", "attention.decode", "--dtype", "bf16", "--head-dim", "64", "--shape", "page_size=16,q_len=4"]
    assert main([*argv, "--features", "sinks,spec_decode", "--platform", "gfx950"]) == 0
    out = capsys.readouterr().out
    assert "request:  attention.decode [kv=bfloat16 q=bfloat16] [head_dim=64 page_size=16 q_len=4]" in out
    assert "features=sinks,spec_decode" in out and "rocm/gfx950" in out and "WINNER   torch_decode" in out
    assert main(["explain", "moe.apply", "--dtype", "x=bf16,weight=mxfp4", "--features", "mxfp4"]) == 0
    assert "[weight=uint8 x=bfloat16]" in capsys.readouterr().out
    # The exchange by request: a capturable one gets the graph-safe kernel only.
    assert main(["explain", "moe.dispatch", "--shape", "world_size=2", "--dtype", "bf16", "--capturable"]) == 0
    out = capsys.readouterr().out
    assert "=> torch_moe_dispatch_padded" in out and "REJECTED torch_moe_dispatch" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "moe.apply", "--features", "sink"], "unknown feature ['sink']"),
        (["explain", "moe.topk", "--dtype", "logits=bf17"], "unknown dtype 'bf17'"),
        (["explain", "moe.topk", "--shape", "top_k=four"], "top_k='four' is not an integer"),
        (["explain", "moe.topk", "--shape", "head_dim=64"], "unknown shape key ['head_dim']"),
        (["explain", "moe.topk", "--preset", "small", "--head-dim", "64"], "give either --preset"),
        (["explain", "moe.topk", "--case-index", "99"], "--case-index 99"),
        (["check", "moe.apply", "--kernel", "torch_decode"], "registered for attention.decode"),
        (["check", "moe.topk", "--preset", "nope"], "unknown preset 'nope'"),
        (["bench", "moe.topk", "--replay", "/nonexistent/shapes.jsonl"], "No such file"),
        # The expert-parallel exchange runs across ranks: no single-process cases, and why.
        (["check", "moe.dispatch"], "runs across the ranks of a process group"),
        (["bench", "moe.combine"], "runs across the ranks of a process group"),
        (["explain", "moe.dispatch"], "runs across the ranks of a process group"),
    ],
)
def test_usage_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tokenspeed-kernel {argv[0]}: error:") and message in err


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


def test_bench_replays_a_capture_without_baselines(capsys, tmp_path, monkeypatch):
    from tokenspeed_kernel import config
    from tokenspeed_kernel.ops import _dispatch
    from tokenspeed_kernel.tools import cases

    shapes = tmp_path / "shapes.jsonl"
    monkeypatch.setenv(config.CAPTURE_ENV, str(shapes))
    config.refresh()
    monkeypatch.setattr(_dispatch, "_captured", set())
    try:
        for op in ("attention.decode", "moe.topk"):
            case = cases.awkward_cases(op, torch.float32)[0]
            cases.call(case, cases.make_inputs(case))
    finally:
        monkeypatch.delenv(config.CAPTURE_ENV)
        config.refresh()
    assert len(shapes.read_text().splitlines()) == 2
    out_json = tmp_path / "replay.json"
    assert main(["bench", "all", "--replay", str(shapes), "--no-baselines", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())["rows"]
    assert [(r["op"], r["impl"], r["kind"]) for r in rows] == [
        ("attention.decode", "torch_decode", "kernel"),
        ("moe.topk", "torch_moe_topk", "kernel"),
    ]
    captured = capsys.readouterr()
    assert "torch_decode" in captured.out
    # progress on stderr, one line per case when it is not a terminal
    assert captured.err.startswith("[1/2] ") and "\n[2/2] " in captured.err


def test_module_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel", "list", "kvcache.store"], capture_output=True, text=True, check=True
    ).stdout
    assert "torch_store_kvcache" in out


def _one_line_error(capsys, command: str) -> str:
    """The stderr of a command that failed with a usage error: exactly one line, no traceback."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"tokenspeed-kernel {command}: error:") and "Traceback" not in captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["bench", "attention.decode", "--kernel", "nosuch_kernel", "--preset", "small"],
            "no kernel named 'nosuch_kernel' is registered; attention.decode kernels: torch_decode",
        ),
        (
            ["bench", "moe.topk", "--kernel", "torch_decode"],
            "kernel 'torch_decode' is registered for attention.decode, not moe.topk; moe.topk kernels: torch_moe_topk",
        ),
        (["bench", "all", "--kernel", "nosuch"], "no kernel named 'nosuch' is registered for attention.prefill, "),
        (["bench", "all", "--kernel", "torch_decode,nosuch"], "moe.topk: torch_moe_topk; moe.apply: torch_moe"),
        (["profile", "moe.topk", "--kernel", "nosuch"], "moe.topk kernels: torch_moe_topk"),
        (["check", "moe.apply", "--kernel", "torch_decode"], "not moe.apply; moe.apply kernels: torch_moe"),
    ],
)
def test_an_unknown_or_foreign_kernel_exits_2_listing_the_operators_kernels(argv, message, capsys):
    assert main(argv) == 2
    assert message in _one_line_error(capsys, argv[0])
    assert capsys.readouterr().out == ""  # nothing was run, no table printed


def test_bench_all_with_a_named_kernel_runs_it_on_its_operator_only(capsys):
    assert main(["bench", "all", "--kernel", "torch_moe_topk", "--preset", "small", "--no-baselines"]) == 0
    out = capsys.readouterr().out
    assert "torch_moe_topk" in out and "moe.topk:" in out and "attention.decode:" not in out


@pytest.mark.parametrize("command", ["check moe.topk", "bench moe.topk", "profile moe.topk", "overhead"])
@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda", "device 'cuda' is not available ("),
        ("cuda:7", "device 'cuda:7' is not available ("),
        ("tpu", "unknown device 'tpu'; available here: cpu"),
        ("mps", "device 'mps': the tools run on cpu or cuda only; available here: cpu"),
    ],
)
def test_a_device_not_available_exits_2_naming_it(command, device, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, wherever this runs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    argv = [*command.split(), "--device", device]
    assert main(argv) == 2
    assert message in _one_line_error(capsys, argv[0])


@pytest.mark.parametrize("command", ["platform", "list", "explain moe.topk", "check moe.topk", "bench moe.topk"])
@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "attention.decode=nosuch",
            "TOKENSPEED_KERNEL_OVERRIDE: attention.decode=nosuch: no kernel named 'nosuch' is registered; "
            "attention.decode kernels: torch_decode",
        ),
        (
            "moe.topk=torch_decode",
            "TOKENSPEED_KERNEL_OVERRIDE: moe.topk=torch_decode: 'torch_decode' is a kernel of attention.decode, "
            "not of moe.topk; moe.topk kernels: torch_moe_topk",
        ),
        ("moe.topkk=torch_moe_topk", "TOKENSPEED_KERNEL_OVERRIDE names unknown operators ['moe.topkk']"),
    ],
)
def test_an_invalid_env_override_fails_every_command_alike(command, value, message, capsys, env):
    from tokenspeed_kernel import config

    env(config.OVERRIDE_ENV, value)
    argv = [*command.split(), "--preset", "small"] if command.startswith(("check", "bench")) else command.split()
    assert main(argv) == 2
    assert message in _one_line_error(capsys, argv[0])


def test_an_invalid_env_override_is_a_clear_value_error_in_python(env):
    import tokenspeed_kernel as tk
    from tokenspeed_kernel import config

    env(config.OVERRIDE_ENV, "attention.decode=nosuch")
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"^TOKENSPEED_KERNEL_OVERRIDE: attention.decode=nosuch: .* torch_decode$"):
        tk.moe_topk(logits, 2)  # any operator: the whole variable is checked on the first selection
    env(config.OVERRIDE_ENV, "moe.topk=torch_moe_topk")
    weights, ids = tk.moe_topk(logits, 2)
    assert ids.shape == (3, 2) and torch.isfinite(weights).all()


def test_an_unknown_disabled_backend_is_warned_about_once(env, caplog):
    from tokenspeed_kernel import config

    env(config.DISABLE_BACKENDS_ENV, "nosuch_backend")
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        registry.load_backends(force=True)
        registry.load_backends(force=True)
    warned = [r.getMessage() for r in caplog.records if "nosuch_backend" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].startswith("tokenspeed_kernel: TOKENSPEED_KERNEL_DISABLE_BACKENDS names unknown backends")
    assert "known backends: " in warned[0] and "reference" in warned[0]


def test_an_unknown_disabled_backend_warns_from_the_command_line():
    run = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel", "list", "kvcache.store"],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENSPEED_KERNEL_DISABLE_BACKENDS": "nosuch_backend"},
    )
    assert run.returncode == 0 and "torch_store_kvcache" in run.stdout
    assert "names unknown backends nosuch_backend (ignored); known backends: " in run.stderr


def _help(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps at the terminal width (and may break at a hyphen)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["check", "bench", "profile", "explain"])
def test_help_names_every_preset(command, capsys, monkeypatch):
    from tokenspeed_kernel.tools.presets import PRESETS

    text = _help(command, capsys, monkeypatch)
    assert "--preset PRESET" in text and "prefill-lengths" in text
    assert all(name in text for name in PRESETS)


def test_help_gives_the_defaults(capsys, monkeypatch):
    assert "(default: derived)" in _help("check", capsys, monkeypatch)
    assert "(default: gpt-oss-120b; small on a CPU)" in _help("bench", capsys, monkeypatch)
    text = _help("profile", capsys, monkeypatch)
    assert "--out FILE the trace to write (default: tokenspeed_kernel_trace.json)" in text
    assert "(default: gpt-oss-120b; small on a CPU)" in text


@pytest.mark.parametrize(("command", "verb"), [("bench", "timed"), ("profile", "traced")])
def test_bench_and_profile_take_the_small_preset_on_a_cpu_with_a_note(command, verb, capsys, tmp_path):
    argv = [command, "moe.topk", "--device", "cpu"] + (
        ["--out", str(tmp_path / "t.json")] if command == "profile" else []
    )
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"tokenspeed-kernel {command}: on the CPU without --preset: {verb} the small preset "
        "(--preset gpt-oss-120b for the serving sizes)\n"
    )
    assert "topk_softmax_renorm_t1" in captured.out and "gpt_oss_120b" not in captured.out
    assert main([*argv, "--preset", "small"]) == 0  # a preset given: no note
    assert capsys.readouterr().err == ""


def test_profile_output_has_no_profiler_markers(tmp_path):
    """torch's profiler library writes ``USDT: ... profiler_start``/``profiler_stop`` lines to
    descriptor 2 from C++; the command's output has none of them (a separate process: pytest's
    capsys does not see descriptor 2)."""

    trace = tmp_path / "trace.json"
    run = subprocess.run(
        [sys.executable, "-m", "tokenspeed_kernel", "profile", "moe.topk", "--preset", "small", "--out", str(trace)],
        capture_output=True,
        text=True,
        env={**os.environ, "KINETO_LOG_LEVEL": "3"},  # also STAGE: lines, the most Kineto says unasked
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr == "" and "profiler_start" not in run.stdout, run.stderr
    assert run.stdout.startswith(f"wrote {trace} with 1 traced calls:") and trace.exists()


def test_profiler_marker_filter_keeps_every_other_line(capfd):
    from tokenspeed_kernel.tools.profile import _without_profiler_markers

    with _without_profiler_markers():
        os.write(2, b"USDT:2026-11-25 11:25:22 3884:3884 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"STAGE:2026-11-25 11:25:22 3884:3884 SyncActivityProfilerHandler.cpp:60] Completed Stage\n")
        os.write(2, b"WARNING:2026-11-25 11:25:22 3884:3884 CuptiActivityApi.cpp:9] a real warning\n")
        os.write(2, b"USDT: a line of someone else\n")
    assert capfd.readouterr().err == (
        "WARNING:2026-11-25 11:25:22 3884:3884 CuptiActivityApi.cpp:9] a real warning\nUSDT: a line of someone else\n"
    )


def test_check_uses_the_cpu_interpreter_only_when_no_gpu_and_not_set(monkeypatch):
    from tokenspeed_kernel import config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(config.INTERPRETER_ENV, raising=False)
    assert config.use_cpu_interpreter() and os.environ[config.INTERPRETER_ENV] == "1"
    monkeypatch.setenv(config.INTERPRETER_ENV, "0")  # the user's choice stands
    assert not config.use_cpu_interpreter() and os.environ[config.INTERPRETER_ENV] == "0"
    monkeypatch.delenv(config.INTERPRETER_ENV)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU: the compiled kernels
    assert not config.use_cpu_interpreter() and config.INTERPRETER_ENV not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", None)  # not installed: nothing to interpret, no note
    assert not config.use_cpu_interpreter() and config.INTERPRETER_ENV not in os.environ


def test_list_json(capsys, tmp_path):
    path = tmp_path / "list.json"
    assert main(["list", "moe.topk", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["platform"]["describe"] in capsys.readouterr().out
    assert any(b["name"] == "reference" and b["state"] == "loaded" for b in data["backends"])
    assert list(data["operators"]) == ["moe.topk"]
    (spec,) = data["operators"]["moe.topk"]["kernels"]
    assert spec["name"] == "torch_moe_topk" and spec["backend"] == "reference" and spec["band"] == "reference"
    assert isinstance(spec["graph_safe"], bool) and isinstance(spec["vendors"], list)
    assert isinstance(spec["unseen_safe"], bool)
    assert spec["vendor_capabilities"] == {}


def test_check_json_has_pass_or_fail_per_kernel_and_case(capsys, tmp_path, temp_kernels):
    registry.register_kernel("moe.topk", name="t_bad_topk", solution="test", features=("softmax", "renormalize"))(
        lambda args: (args.topk_weights.fill_(0.5), args.topk_ids.fill_(0))
    )
    path = tmp_path / "check.json"
    assert main(["check", "moe.topk", "--preset", "small", "--device", "cpu", "--json", str(path)]) == 1
    capsys.readouterr()
    data = json.loads(path.read_text())  # strict JSON: NaN errors of skipped rows would be null
    assert data["device"] == "cpu" and data["ok"] is False and (data["passed"], data["failed"]) == (1, 1)
    assert set(PROVENANCE_KEYS) <= set(data) and data["versions"]["torch"] == torch.__version__
    verdicts = {(r["kernel"], r["case"]): (r["status"], r["passed"]) for r in data["rows"]}
    assert sorted(k for k, _ in verdicts) == ["t_bad_topk", "torch_moe_topk"]
    assert {v for (k, _), v in verdicts.items() if k == "t_bad_topk"} == {("FAIL", False)}
    assert {v for (k, _), v in verdicts.items() if k == "torch_moe_topk"} == {("PASS", True)}


def test_explain_json(capsys, tmp_path):
    path = tmp_path / "explain.json"
    assert main(["explain", "attention.decode", "--case", "0", "--platform", "sm_90", "--json", str(path)]) == 0
    capsys.readouterr()
    data = json.loads(path.read_text())
    assert data["op"] == "attention.decode" and data["preset"] == "gpt-oss-120b"
    (sel,) = data["selections"]
    assert sel["case"].startswith("decode_b64_ctx8192") and sel["winner"] == "torch_decode"
    assert sel["request"]["dtypes"] == {"kv": "bfloat16", "q": "bfloat16"} and "sinks" in sel["request"]["features"]
    assert sel["platform"].startswith("cuda/sm_90") and sel["candidates"][0]["kernel"] == "torch_decode"
    assert main(["explain", "moe.topk", "--dtype", "bf16", "--features", "softmax", "--json", str(path)]) == 0
    (sel,) = json.loads(path.read_text())["selections"]
    assert sel["case"] is None and sel["winner"] == "torch_moe_topk" and sel["candidates"][0]["accepted"] is True


def test_explain_json_records_a_tie_broken_by_name(capsys, tmp_path, temp_kernels):
    features = ("softmax", "renormalize")
    for name in ("t_tie_z", "t_tie_y"):
        temp_kernels("moe.topk", name=name, features=features, priority=registry.Priority.PLUGIN)
    path = tmp_path / "explain.json"
    assert (
        main(["explain", "moe.topk", "--dtype", "bf16", "--features", "softmax,renormalize", "--json", str(path)]) == 0
    )
    assert "=> t_tie_y (tied at plugin(400) with t_tie_z; broken by name" in capsys.readouterr().out
    (sel,) = json.loads(path.read_text())["selections"]
    assert sel["winner"] == "t_tie_y" and sel["tie_break"] == {"priority": 400, "losers": ["t_tie_z"], "rule": "name"}
    assert main(["explain", "moe.topk", "--dtype", "bf16", "--features", "sigmoid", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["selections"][0]["tie_break"] is None  # neither serves it: no tie


def test_every_command_survives_a_plugin_whose_hooks_raise(capsys, tmp_path, temp_kernels, caplog):
    """A plugin whose predicate raises and one whose available hook raises: list, explain,
    check and bench all run, the others serve and are checked, each bug warned about once."""
    features = ("softmax", "renormalize")

    def unavailable():
        raise RuntimeError("driver too old")

    temp_kernels("moe.topk", name="t_pred_boom", features=features, priority=400, predicate=lambda r: 1 // 0)
    temp_kernels("moe.topk", name="t_avail_boom", features=features, priority=401, available=unavailable)
    with caplog.at_level("WARNING", logger="tokenspeed_kernel"):
        assert main(["list", "moe.topk"]) == 0
        assert "t_pred_boom" in capsys.readouterr().out
        assert main(["explain", "moe.topk", "--case-index", "0"]) == 0
        out = capsys.readouterr().out
        assert "REJECTED t_pred_boom" in out and "predicate raised ZeroDivisionError" in out
        assert "REJECTED t_avail_boom" in out and "available raised RuntimeError: driver too old" in out
        assert "WINNER   torch_moe_topk" in out
        path = tmp_path / "check.json"
        assert main(["check", "moe.topk", "--preset", "small", "--device", "cpu", "--json", str(path)]) == 0
        rows = json.loads(path.read_text())["rows"]
        assert {r["status"] for r in rows if r["kernel"] == "torch_moe_topk"} == {"PASS"}
        assert {r["status"] for r in rows if r["kernel"].startswith("t_")} == {"SKIP"}
        assert main(["bench", "moe.topk", "--preset", "small", "--kernel", "all", "--no-baselines"]) == 0
        out = capsys.readouterr().out
        assert "available raised RuntimeError" in out and "* torch_moe_topk" in out
    for name in ("t_pred_boom", "t_avail_boom"):
        assert sum(repr(name) in r.getMessage() for r in caplog.records if r.levelname == "WARNING") == 1, name
