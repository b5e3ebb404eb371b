"""Shape capture: one JSONL line per distinct signature; replay turns lines into cases."""

import json

import pytest
import torch

from tokenspeed_kernel import config
from tokenspeed_kernel.ops import _dispatch
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.capture import case_from_signature, read_capture

pytestmark = pytest.mark.usefixtures("only_reference")


@pytest.fixture
def capture_file(tmp_path, monkeypatch):
    path = tmp_path / "shapes.jsonl"
    monkeypatch.setenv(config.CAPTURE_ENV, str(path))
    config.refresh()
    _dispatch._captured.clear()
    yield path
    monkeypatch.delenv(config.CAPTURE_ENV)
    config.refresh()


def test_each_distinct_signature_is_written_once_and_replays(capture_file):
    calls = []
    for op in cases.OPS:
        case = cases.awkward_cases(op, torch.float32)[0]
        inputs = cases.make_inputs(case)
        for _ in range(3):  # repeated calls add nothing
            cases.call(case, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()})
        calls.append(case)
    lines = [json.loads(line) for line in capture_file.read_text().splitlines()]
    assert [line["op"] for line in lines] == list(cases.OPS)
    assert all(line["kernel"].startswith("torch_") for line in lines)
    for line in lines:
        text = json.dumps(line["signature"])
        assert "tensor" not in text  # shapes and options only, no data
    replayed = read_capture(str(capture_file))
    for case, again in zip(calls, replayed):
        assert again.op == case.op
        assert cases.request(again) == cases.request(case), case.op
        assert sum(again.seqlens_q if hasattr(again, "seqlens_q") else [again.num_tokens]) == sum(
            case.seqlens_q if hasattr(case, "seqlens_q") else [case.num_tokens]
        )


def test_replay_rejects_garbage(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "attention.decode", "signature": {"batch": 1}}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a capture record"):
        read_capture(str(bad))
    with pytest.raises(ValueError, match="cannot replay"):
        case_from_signature("nope", {})


def test_replay_skips_the_expert_parallel_exchange(tmp_path):
    """Its lines describe calls across ranks: a capture holding them still replays the rest."""
    mixed = tmp_path / "mixed.jsonl"
    lines = [
        {"op": "moe.dispatch", "kernel": "torch_moe_dispatch_padded", "signature": {"world_size": 2}},
        {
            "op": "moe.topk",
            "kernel": "torch_moe_topk",
            "signature": {
                "num_tokens": 3,
                "num_experts": 8,
                "top_k": 2,
                "dtype": "float32",
                "scoring": "softmax",
                "renormalize": True,
            },
        },
        {"op": "moe.combine", "kernel": "torch_moe_combine", "signature": {}},
    ]
    mixed.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (case,) = read_capture(str(mixed))
    assert case.op == "moe.topk" and case.num_tokens == 3


def test_no_capture_without_env(tmp_path):
    config.refresh()
    assert config.capture_path() is None
    case = cases.awkward_cases("moe.topk", torch.float32)[0]
    cases.call(case, cases.make_inputs(case))
    assert not list(tmp_path.iterdir())


def test_decode_plan_run_records_the_functional_signature(capture_file):
    """``DecodePlan.run`` is a public call too: it records the same line as the functional
    decode with the same arguments (so one line for both), and replays to the same request."""
    from tokenspeed_kernel import mha_decode_plan, mha_decode_with_kvcache

    case = cases.awkward_cases("attention.decode", torch.float32)[0]
    inputs = cases.make_inputs(case)
    paged = [inputs[name] for name in ("k_cache", "v_cache", "page_table", "cache_seqlens", "max_seqlen_k")]
    options = {name: inputs[name] for name in ("window_left", "sinks", "logit_cap", "return_lse")}
    plan = mha_decode_plan(*paged, num_q_heads=case.num_q_heads, **options)
    for _ in range(2):
        plan.run(inputs["q"])
    lines = capture_file.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["kernel"] == plan.kernel
    mha_decode_with_kvcache(**inputs)
    assert capture_file.read_text().splitlines() == lines
    (replayed,) = read_capture(str(capture_file))
    assert cases.request(replayed) == cases.request(case)
