"""``check``'s default mode: cases derived from a kernel's registration, and the claims
coverage (checked / failed / not exercised / not run here)."""

import json

import pytest
import torch

import tokenspeed_kernel as tk
from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.cli import main
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.claims import derive
from tokenspeed_kernel.tools.numerics import check

pytestmark = pytest.mark.usefixtures("only_reference")

BF16, FP16, FP8 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def _reference_decode(args):
    registry.get_kernel("torch_decode").fn(args)


def _register_plain_decode(name="my_decode", fn=_reference_decode, **meta):
    """The issue's out-of-tree plugin: a plain bf16 paged decode, ``features=()``, vendors
    ``cpu``, registered through the public decorator (wrapping the reference kernel)."""
    meta = {"dtypes": {"q": (BF16,), "kv": (BF16,)}, "features": (), "vendors": ("cpu",), **meta}
    tk.register_kernel("attention.decode", name=name, solution="torch", priority=tk.Priority.PLUGIN, **meta)(fn)


def _claims(path):
    data = json.loads(path.read_text())
    return data, {f"{c['kind']} {c['claim']}": c for c in data["claims"] if c["kernel"] != "torch_decode"}


def test_a_plugin_without_features_gets_checked(capsys, tmp_path):
    _register_plain_decode()
    path = tmp_path / "check.json"
    assert main(["check", "attention.decode", "--kernel", "my_decode", "--device", "cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "SKIP" not in out and "my_decode (attention.decode): 3 claims: 3 checked" in out
    assert out.splitlines()[-1].startswith("2 passed, 0 failed, 0 skipped; claims: 3 checked, 0 failed, ")
    data, by_claim = _claims(path)
    assert data["preset"] == "derived" and data["seed"] == 0 and data["ok"] is True
    assert {k: c["status"] for k, c in by_claim.items()} == {
        "dtype q=bfloat16": "checked",
        "dtype kv=bfloat16": "checked",
        "batch ragged with length-1 rows (no padding row in decode)": "checked",
    }
    assert {r["case"].split()[0] for r in data["rows"]} == {"base", "ragged"}


def test_a_false_claim_fails_with_a_command_that_reproduces_it(capsys, tmp_path):
    def ignores_sinks(args):
        args.sinks = None
        _reference_decode(args)

    _register_plain_decode("my_decode_sinks", ignores_sinks, features=("sinks", "return_lse"))
    path = tmp_path / "check.json"
    argv = ["check", "attention.decode", "--kernel", "my_decode_sinks", "--device", "cpu", "--seed", "7"]
    assert main([*argv, "--json", str(path)]) == 1
    out = capsys.readouterr().out
    _, by_claim = _claims(path)
    assert by_claim["feature sinks"]["status"] == "failed"
    assert by_claim["feature sinks"]["note"] == "failed: feature-sinks, features-all"
    # One lying claim; the others passed in other cases and stand (named with the failing case).
    assert by_claim["feature return_lse"]["status"] == "checked"
    assert by_claim["feature return_lse"]["note"] == "also in failing features-all"
    assert by_claim["dtype q=bfloat16"]["status"] == "checked"
    line = next(x for x in out.splitlines() if x.startswith("reproduce: ") and "feature-sinks" in x)
    assert line == (
        "reproduce: tokenspeed-kernel check attention.decode --kernel my_decode_sinks --seed 7 "
        "--case feature-sinks --device cpu"
    )
    rerun = line.removeprefix("reproduce: tokenspeed-kernel ").split()
    assert main([*rerun, "--json", str(path)]) == 1
    (row,) = json.loads(path.read_text())["rows"]
    assert row["status"] == "FAIL" and row["case"].startswith("feature-sinks ")


def test_a_combination_that_fails_blames_the_claims_of_its_case():
    def wrong_with_sinks_in_a_window(args):
        if args.sinks is not None and args.window_left >= 0:
            args.sinks = None
        _reference_decode(args)

    _register_plain_decode("my_decode_combo", wrong_with_sinks_in_a_window, features=("sinks", "sliding_window"))
    report = check("attention.decode", kernel="my_decode_combo", device="cpu", quiet=True)
    status = {f"{c.kind} {c.claim}": (c.status, c.note) for c in report.claims}
    assert status["feature sinks"] == ("failed", "failed: features-all")  # each passed alone
    assert status["feature sliding_window"] == ("failed", "failed: features-all")
    assert not report.ok and report.failed_claims


def test_derived_cases_stay_inside_the_registration_and_reach_every_claim():
    def wide_window_only(request):
        return None if "sliding_window" in request.features else "windowed calls only"

    _register_plain_decode(
        "my_wide_decode",
        dtypes={"q": (BF16, FP16), "kv": (BF16, FP16, FP8)},
        shapes={"head_dim": (32, 64, 128), "page_size": (1, 8, 64)},
        features=("sinks", "sliding_window", "fp8_kv", "spec_decode", "strided_kv"),
        predicate=wide_window_only,
    )
    spec = registry.get_kernel("my_wide_decode")
    derivation = derive(spec, "cpu", seed=3)
    ids = [c.id for c in derivation.cases]
    for expected in ("base", "dtype-fp16", "dtype-bf16-fp8", "dtype-fp16-fp8", "feature-sinks", "features-all"):
        assert expected in ids
    assert {"head_dim-32", "head_dim-128", "page_size-1", "page_size-64", "ragged"} <= set(ids)
    for derived in derivation.cases:  # nothing is refused: every case inside dtypes, shapes, features, predicate
        request = cases.request(derived.case)
        assert selector.request_reasons(spec, request) == (), derived.id
        assert "sliding_window" in request.features  # the predicate's demand became part of the base
    reached = {claim for c in derivation.cases for claim in c.claims}
    assert set(derivation.claims) == reached and not derivation.notes
    again = derive(spec, "cpu", seed=3)
    assert [c.case for c in again.cases] == [c.case for c in derivation.cases]  # seeded: reproducible
    other = derive(spec, "cpu", seed=4)
    assert [c.case for c in other.cases] != [c.case for c in derivation.cases]


def test_claims_that_cannot_be_exercised_say_why(tmp_path):
    tk.register_kernel(
        "moe.apply",
        name="my_moe",
        solution="torch",
        vendors=("cpu",),
        dtypes={"x": (BF16,), "weight": (BF16, FP8)},  # fp8 weights, but no fp8 format feature
        shapes={"num_tokens_bucket": (1, 2, 4, 8, 16, 32, 64, 128)},
        features=("silu", "fp8_act"),  # fp8 activations need an fp8 weight format
    )(lambda args: registry.get_kernel("torch_moe").fn(args))
    report = check("moe.apply", kernel="my_moe", device="cpu", quiet=True)
    by_claim = {f"{c.kind} {c.claim}": c for c in report.claims}
    assert by_claim["dtype weight=float8_e4m3fn"].status == "not exercised"
    assert "needs feature fp8_per_tensor or fp8_per_channel or fp8_block" in by_claim["dtype weight=float8_e4m3fn"].note
    assert by_claim["feature fp8_act"].status == "not exercised"
    assert "fp8_act needs one of fp8_per_tensor, fp8_per_channel, fp8_block, none declared" in (
        by_claim["feature fp8_act"].note
    )
    assert by_claim["shape num_tokens_bucket=1"].status == "checked"
    far = by_claim["shape num_tokens_bucket=128"]
    assert far.status == "not run here" and "above the CPU cap 64" in far.note  # left to a GPU
    assert by_claim["feature silu"].status == "checked" and report.ok


def test_a_gpu_only_kernel_is_not_run_here_never_passed(capsys, tmp_path):
    _register_plain_decode("my_cuda_decode", vendors=("cuda",), archs=("sm_90",))
    path = tmp_path / "check.json"
    assert (
        main(["check", "attention.decode", "--kernel", "my_cuda_decode", "--device", "cpu", "--json", str(path)]) == 1
    )
    captured = capsys.readouterr()
    assert "nothing was checked: no kernel could run here" in captured.err
    data = json.loads(path.read_text())
    (row,) = data["rows"]
    assert row["status"] == "SKIP" and row["reason"].startswith("not run here: vendor cpu not in {cuda}")
    assert {c["status"] for c in data["claims"]} == {"not run here"}
    assert data["claim_counts"]["checked"] == 0 and data["passed"] == 0


def test_derived_is_the_default_and_the_presets_stay(capsys):
    report = check("moe.topk", device="cpu", quiet=True)
    assert report.preset == "derived" and report.claims and report.ok
    assert {c.status for c in report.claims} == {"checked"}
    report = check("moe.topk", preset="awkward", device="cpu", quiet=True)
    assert report.preset == "awkward" and not report.claims and report.ok


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["check", "attention.decode", "--kernel", "torch_decode", "--case", "nope"],
            "torch_decode has no derived case",
        ),
        (["check", "attention.decode", "--case", "base"], "--case ID picks one derived case of one kernel"),
        (["check", "moe.topk", "--kernel", "torch_moe_topk", "--preset", "small", "--case", "base"], "--case ID"),
        (["check", "all", "--kernel", "nosuch"], "no kernel named 'nosuch' is registered for attention.prefill, "),
        (["check", "moe.apply", "--kernel", "torch_decode"], "not moe.apply; moe.apply kernels: torch_moe"),
    ],
)
def test_bad_check_arguments_exit_2_on_one_line(argv, message, capsys):
    assert main([*argv, "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenspeed-kernel check: error:") and message in lines[0]
    assert captured.out == ""


def test_an_unknown_case_lists_the_kernels_case_ids(capsys):
    assert main(["check", "moe.topk", "--kernel", "torch_moe_topk", "--case", "nope", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "its cases: base, dtype-fp16, dtype-fp32, feature-renormalize, feature-sigmoid, " in err


def test_check_all_with_a_kernel_runs_it_on_its_own_operator(capsys):
    assert main(["check", "all", "--kernel", "torch_moe_topk", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "torch_moe_topk (moe.topk)" in out and "torch_decode" not in out and "torch_moe " not in out
