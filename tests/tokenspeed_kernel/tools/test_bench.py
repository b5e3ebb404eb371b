"""The bench tool on CPU: rows, counted work, baselines, selection mark, JSON output."""

import itertools
import json

import pytest
import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.bench import bench
from tokenspeed_kernel.tools.cases import AttentionCase, MoECase
from tokenspeed_kernel.tools.common import PROVENANCE_KEYS

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


def test_bench_a_comma_separated_list_of_kernels(temp_kernels):
    case = AttentionCase("attention.decode", (1,), (24,), 4, 2, 16, page_size=8, dtype=torch.float32, name="u")
    from tokenspeed_kernel.tools import presets

    temp_kernels("attention.decode", name="t_gpu_only", vendors=("cuda",))
    presets.PRESETS["_test"] = lambda op: [case]
    try:
        report = bench(
            "attention.decode",
            kernel="torch_decode, t_gpu_only",
            preset="_test",
            device="cpu",
            baselines=False,
            quiet=True,
        )
        with pytest.raises(
            ValueError, match="no kernel named 'no_such_kernel' is registered; attention.decode kernels"
        ):
            bench("attention.decode", kernel="torch_decode, no_such_kernel", preset="_test", device="cpu", quiet=True)
    finally:
        del presets.PRESETS["_test"]
    rows = {r.impl: r for r in report.rows}
    assert set(rows) == {"torch_decode", "t_gpu_only"}
    assert rows["torch_decode"].ms > 0 and rows["t_gpu_only"].ms is None and "vendor" in rows["t_gpu_only"].note


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


def _baseline(op, name):
    from tokenspeed_kernel.tools.baselines import baselines_for

    (found,) = [b for b in baselines_for(op) if b.name == name]
    return found


@pytest.mark.parametrize("weight_format", ["plain", "mxfp4", "fp8_per_channel"])
def test_moe_baselines_compute_the_reference(weight_format, monkeypatch):
    """A speedup means something only if the baseline does the same work: both MoE pipelines
    (grouped matmul, and the per-expert loop it falls back to) match the float64 reference."""
    from tokenspeed_kernel.tools import baselines
    from tokenspeed_kernel.tools.tolerances import Tolerance, compare

    case = MoECase("moe.apply", 9, 64, 32, 8, 2, torch.bfloat16, weight_format, "swiglu_oai", bias=True)
    inputs = cases.make_inputs(case, "cpu", seed=3)
    ref, _ = cases.reference(case, inputs)
    cpu = torch.device("cpu")
    loop = _baseline("moe.apply", "torch_expert_loop")
    assert "its fallback" in loop.prepare(case, inputs, cpu)  # grouped_mm runs on this CPU
    runners = [_baseline("moe.apply", "torch_grouped_mm").prepare(case, inputs, cpu)]
    monkeypatch.setattr(baselines, "_grouped_mm_missing", lambda *a: "pretend it is missing")
    runners.append(loop.prepare(case, inputs, cpu))
    assert "pretend" in _baseline("moe.apply", "torch_grouped_mm").prepare(case, inputs, cpu)
    for run in runners:
        assert compare(run(), ref, Tolerance(2e-2, 4e-2)).passed
    mapped = MoECase("moe.apply", 4, 64, 32, 8, 2, torch.bfloat16, expert_map=True)
    assert loop.prepare(mapped, cases.make_inputs(mapped), cpu) == "no expert_map in this baseline"


def test_decode_baselines_compute_the_reference_and_say_why_not():
    from tokenspeed_kernel.tools.tolerances import Tolerance, compare

    case = AttentionCase("attention.decode", (1, 1, 1), (37, 37, 37), 8, 2, 16, page_size=8, dtype=torch.float32)
    inputs = cases.make_inputs(case, "cpu", seed=1)
    ref, _ = cases.reference(case, inputs)
    for name in ("gather_sdpa", "sdpa_contiguous"):
        out = _baseline("attention.decode", name).prepare(case, inputs, torch.device("cpu"))()
        assert compare(out.transpose(1, 2).reshape(ref.shape), ref, Tolerance(1e-5, 1e-4)).passed, name
    ragged = AttentionCase("attention.decode", (1, 1), (5, 9), 8, 2, 16, page_size=8, dtype=torch.float32)
    window = AttentionCase("attention.decode", (1,), (9,), 8, 2, 16, page_size=8, dtype=torch.float32, window_left=3)
    gather = _baseline("attention.decode", "gather_sdpa")
    assert (
        gather.prepare(ragged, cases.make_inputs(ragged), torch.device("cpu")) == "needs equal lengths across the batch"
    )
    assert "sliding window" in gather.prepare(window, cases.make_inputs(window), torch.device("cpu"))
    prefill = AttentionCase("attention.prefill", (4,), (4,), 2, 1, 8, dtype=torch.float32)
    assert _baseline("attention.prefill", "sdpa_flash").prepare(prefill, {}, torch.device("cpu")) == "GPU only"


def test_bench_json_rows_hold_every_field(tmp_path):
    path = tmp_path / "rows.json"
    bench("moe.topk", preset="small", json_path=str(path), device="cpu", quiet=True)
    data = json.loads(path.read_text())
    assert set(data) >= {"device", "torch", "date", "ceilings", "rows", *PROVENANCE_KEYS}
    fields = {"op", "case", "impl", "kind", "ms", "tflops", "tbps", "pct_copy", "pct_matmul", "selected", "speedups"}
    for row in data["rows"]:
        assert fields <= set(row)
    kernel, base = data["rows"]
    assert (kernel["kind"], base["kind"], base["impl"]) == ("kernel", "baseline", "torch_topk")
    assert kernel["speedups"]["torch_topk"] == pytest.approx(base["ms"] / kernel["ms"])
    assert kernel["pct_copy"] is None  # no ceilings on a CPU


def test_rows_give_the_share_of_the_device_ceilings():
    """On a GPU each row is set against the measured ceilings: %copy from TB/s, %mma from TFLOP/s."""
    from tokenspeed_kernel.tools.bench import _row
    from tokenspeed_kernel.tools.ceilings import Ceilings

    case = MoECase("moe.apply", 3, 64, 32, 8, 2, torch.float32)
    row = _row(case, "k", "kernel", 0.5, Ceilings("gpu", copy_tb_s=2.0, matmul_tflop_s=100.0))
    assert row.tflops == pytest.approx(case.flops() / 0.5e-3 / 1e12)
    assert row.tbps == pytest.approx(case.bytes_moved() / 0.5e-3 / 1e12)
    assert row.pct_copy == pytest.approx(100 * row.tbps / 2.0)
    assert row.pct_matmul == pytest.approx(100 * row.tflops / 100.0)
    assert _row(case, "k", "kernel", 0.5, None).pct_copy is None  # CPU: no ceilings


def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_pipe():
    import io

    from tokenspeed_kernel.tools.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    bar = Progress(4, stream=tty, width=8)
    for label in "abcd":
        bar.step(f"case {label}")
    bar.done()
    drawn = tty.getvalue()
    assert "[........] 1/4 case a" in drawn and "[######..] 4/4 case d" in drawn and drawn.endswith("\r")
    piped = io.StringIO()
    lines = Progress(2, stream=piped)
    for label in "ab":
        lines.step(f"case {label}")
    lines.done()
    assert piped.getvalue() == "[1/2] case a\n[2/2] case b\n"  # a log shows how far a run got
    single = io.StringIO()
    Progress(1, stream=single).step("x")
    assert single.getvalue() == ""


def test_kernels_that_refuse_capture_are_timed_without_a_graph_attempt(monkeypatch):
    """A kernel registered graph_safe=False is timed eagerly: no CUDA-graph capture is tried
    (it would only raise inside the capture and leave an empty graph behind)."""
    from tokenspeed_kernel.tools import bench as bench_module

    graphs = []
    real = bench_module.time_fn

    def recording(fn, device, **kwargs):
        graphs.append(kwargs.get("graph", True))
        return real(fn, device, **kwargs)

    monkeypatch.setattr(bench_module, "time_fn", recording)
    bench(["moe.topk", "attention.decode"], preset="small", baselines=False, device="cpu", quiet=True)
    # torch_moe_topk is graph-safe; torch_decode reads lengths on the host: timed eagerly, then
    # eagerly again with a new layout every call
    assert graphs == [True, False, False]


def test_kernels_with_a_prepare_hook_are_timed_through_their_plan():
    """The hook repacks weights once (moe_plan), not on every timed call."""
    from tokenspeed_kernel import registry
    from tokenspeed_kernel.reference import moe as reference_moe
    from tokenspeed_kernel.registry import Priority

    prepared, calls = [], []

    def prepare(**weights):
        prepared.append(weights["w13"].shape)
        return "repacked"

    def kernel(args):
        calls.append(args.prepared)
        reference_moe.torch_moe(args)

    with registry.isolated():
        registry.register_kernel(
            "moe.apply",
            name="test_prepared_moe",
            solution="test",
            vendors=("cpu",),
            features=("silu", "gelu", "swiglu_oai", "bias", "expert_map"),
            priority=Priority.PLUGIN,
            prepare=prepare,
            graph_safe=False,
        )(kernel)
        report = bench("moe.apply", preset="small", baselines=False, device="cpu", quiet=True)
    row = next(r for r in report.rows if r.impl == "test_prepared_moe")
    assert row.selected and row.ms > 0
    assert len(prepared) == 1  # the plan's one preparation
    # two untimed functional calls (the selector's pick, the override check), then only the plan
    # (its first call untimed too)
    assert calls[:2] == [None, None] and len(calls) > 3 and set(calls[2:]) == {"repacked"}


def test_kernels_that_plan_per_layout_are_also_timed_with_a_new_layout_every_call():
    """A kernel that cannot be captured may plan per batch layout; the row then also gives the
    time when every call brings new layout tensors (so it plans every call)."""
    from tokenspeed_kernel import registry
    from tokenspeed_kernel.reference import attention as reference_attention
    from tokenspeed_kernel.registry import Priority

    layouts, plans = [], []

    def kernel(args):
        token = (id(args.cu_seqlens_q), id(args.cu_seqlens_k))
        if not layouts or layouts[-1] != token:
            plans.append(token)  # what a planning kernel would do: plan when the layout changed
        layouts.append(token)
        reference_attention.torch_prefill(args)

    case = AttentionCase("attention.prefill", (5, 3), (5, 3), 4, 2, 8, dtype=torch.float32, sinks=True, name="p")
    from tokenspeed_kernel.tools import presets

    presets.PRESETS["_test"] = lambda op: [case] if op == "attention.prefill" else []
    try:
        with registry.isolated():
            registry.register_kernel(
                "attention.prefill",
                name="test_planning_prefill",
                solution="test",
                vendors=("cpu",),
                features=("sinks",),
                priority=Priority.PLUGIN,
                graph_safe=False,
            )(kernel)
            report = bench(
                ["attention.prefill", "moe.topk"],
                kernel="all",
                preset="_test",
                baselines=False,
                device="cpu",
                quiet=True,
            )
    finally:
        del presets.PRESETS["_test"]
    rows = {r.impl: r for r in report.rows}
    planning = rows["test_planning_prefill"]
    assert planning.relayout_ms > 0 and "with a new layout every call" in planning.note
    assert rows["torch_prefill"].relayout_ms is not None  # reads lengths on the host: not graph-safe either
    # the alternating phase saw two layouts, one after the other: a plan per call there
    tail = layouts[-6:]
    assert len(set(tail)) == 2 and all(a != b for a, b in itertools.pairwise(tail)) and len(plans) > 6
