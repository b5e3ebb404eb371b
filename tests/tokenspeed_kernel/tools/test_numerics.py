"""The check tool: PASS on correct kernels, FAIL on a wrong one, SKIP with the reason."""

import dataclasses
import io

import pytest
import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.numerics import check
from tokenspeed_kernel.tools.tolerances import Tolerance, compare

pytestmark = pytest.mark.usefixtures("only_reference")


def test_reference_kernels_pass_small_preset_on_every_op():
    stream = io.StringIO()
    report = check("all", preset="small", device="cpu", stream=stream)
    assert report.ok and not report.failed
    assert {r.op for r in report.passed} == {
        "attention.prefill",
        "attention.extend",
        "attention.decode",
        "kvcache.store",
        "moe.topk",
        "moe.apply",
    }
    assert "6 passed, 0 failed, 0 skipped" in stream.getvalue()


def test_table_shows_the_tolerance_each_row_is_held_to():
    stream = io.StringIO()
    report = check(["attention.decode", "kvcache.store"], preset="small", device="cpu", stream=stream)
    decode, store = report.rows
    assert (decode.tol_rel_l2, decode.tol_max_abs) == (1e-2, 3e-2)  # bf16 attention
    assert (store.tol_rel_l2, store.tol_max_abs) == (0.0, 0.0)  # the store must be exact
    lines = stream.getvalue().splitlines()
    assert "tol l2/abs" in lines[1]
    assert " 0.01/0.03  " in next(line for line in lines if "torch_decode" in line)
    assert " 0/0  " in next(line for line in lines if "torch_store_kvcache" in line)
    assert lines[-2].startswith("pass: no NaN, rel_l2 <= tol l2 and max_abs <= tol abs * (1 + max|ref|)")
    assert lines[-1] == "2 passed, 0 failed, 0 skipped"  # the summary stays last


def test_a_wrong_kernel_fails_and_an_unfit_one_is_skipped(temp_kernels):
    def wrong(args):
        args.out.copy_(torch.zeros_like(args.out))  # forgets the attention entirely

    registry.register_kernel("attention.decode", name="t_wrong", solution="test", features=("sinks", "return_lse"))(
        wrong
    )
    temp_kernels("attention.decode", name="t_unfit", features=(), priority=Priority.PLUGIN)
    report = check("attention.decode", preset="small", device="cpu", quiet=True)
    status = {r.kernel: r for r in report.rows}
    assert status["torch_decode"].status == "PASS"
    assert status["t_wrong"].status == "FAIL" and status["t_wrong"].rel_l2 > 0.5
    assert status["t_unfit"].status == "SKIP" and "does not support" in status["t_unfit"].reason
    assert not report.ok


def test_unwritten_output_is_caught_by_poisoning(temp_kernels):
    registry.register_kernel("moe.apply", name="t_lazy", solution="test", features=("silu",))(lambda args: None)
    report = check("moe.apply", kernel="t_lazy", preset="small", device="cpu", quiet=True)
    (row,) = report.rows
    assert row.status == "FAIL" and row.reason == "NaN in output"


_PLAN_HOOKS = [
    ("attention.prefill", "step_runner", "step"),
    ("attention.extend", "step_runner", "step"),
    ("attention.decode", "step_runner", "step"),
    ("attention.decode", "bind", "decode"),
]


@pytest.mark.parametrize("op,hook,path", _PLAN_HOOKS)
def test_a_plan_hook_is_checked_through_its_plan(temp_kernels, op, hook, path):
    """A kernel whose functional calls are right but whose hook's runner (a step plan's
    ``step_runner``, a decode plan's ``bind``) is wrong fails its rows, the reason naming the
    plan; with a right runner it passes."""
    from tokenspeed_kernel.ops._operator import operator

    reference = operator(op).reference_kernel()
    features = ("sinks", "sliding_window", "logit_cap", "return_lse", "non_causal")
    features = tuple(f for f in features if f in reference.features)
    for name, runner in (("t_bound_right", reference.fn), ("t_bound_wrong", lambda args: args.out.zero_())):
        hooks = {hook: lambda args, run=runner: run}
        registry.register_kernel(op, name=name, solution="test", features=features, **hooks)(reference.fn)
    report = check(op, preset="small", device="cpu", quiet=True)
    rows = {r.kernel: r for r in report.rows}
    assert rows["t_bound_right"].status == "PASS", rows["t_bound_right"]
    wrong = rows["t_bound_wrong"]
    assert wrong.status == "FAIL" and wrong.reason.startswith(f"through its {path} plan"), wrong


def test_a_decode_bind_hook_is_checked_with_a_row_strided_q_through_the_decode_plan(temp_kernels):
    """A decode kernel that lists ``strided_q`` with a ``bind`` hook: its derived strided-q
    case runs through ``mha_decode_plan(..., q_row_stride=...)`` too, so a runner bound wrong
    for that layout fails the row, naming the decode plan; a right one passes."""
    reference = registry.get_kernel("torch_decode")
    features = ("sinks", "strided_q")
    for name, runner in (("t_rows_right", reference.fn), ("t_rows_wrong", lambda args: args.out.zero_())):
        registry.register_kernel(
            "attention.decode", name=name, solution="test", features=features, bind=lambda args, run=runner: run
        )(reference.fn)
    for name, passed in (("t_rows_right", True), ("t_rows_wrong", False)):
        report = check("attention.decode", kernel=name, device="cpu", quiet=True)
        rows = [r for r in report.rows if "strided_q" in r.case]
        assert rows and all(r.passed == passed for r in rows), rows
        assert passed or all(r.reason.startswith("through its decode plan") for r in rows), rows


def test_check_rejects_kernel_of_another_operator():
    with pytest.raises(ValueError, match="registered for attention.decode, not moe.apply"):
        check("moe.apply", kernel="torch_decode", device="cpu", quiet=True)


def test_compare_rules():
    ref = torch.ones(4, dtype=torch.float64)
    tol = Tolerance(1e-2, 1e-2)
    assert compare(ref.float() * 1.001, ref, tol).passed
    assert not compare(ref.float() * 1.1, ref, tol).passed
    nan = ref.clone().float()
    nan[0] = float("nan")
    verdict = compare(nan, ref, tol)
    assert verdict.has_nan and not verdict.passed


def test_awkward_preset_rows_are_typed():
    from tokenspeed_kernel.tools import cases

    report = check("kvcache.store", preset="awkward", device="cpu", quiet=True)
    awkward = cases.awkward_cases("kvcache.store", torch.bfloat16) + cases.awkward_cases("kvcache.store", torch.float16)
    assert len(report.rows) == len(awkward) and report.ok
    row = report.rows[0]
    assert row.passed and row.kernel == "torch_store_kvcache" and row.max_abs == 0.0 and row.max_rel == 0.0
    assert row.tolerance.startswith("rel_l2<=0 ")


def test_a_crashing_kernel_fails_its_rows_and_the_rest_still_run(temp_kernels):
    def crash(args):
        raise RuntimeError("launch failed: out of shared memory")

    registry.register_kernel("moe.topk", name="t_crash", solution="test", features=("softmax", "renormalize"))(crash)
    report = check("moe.topk", preset="small", device="cpu", quiet=True)
    status = {r.kernel: r for r in report.rows}
    assert status["t_crash"].status == "FAIL" and "RuntimeError: launch failed" in status["t_crash"].reason
    assert status["torch_moe_topk"].passed and not report.ok


def test_compare_reports_max_rel():
    ref = torch.tensor([1.0, 100.0], dtype=torch.float64)
    got = torch.tensor([1.5, 100.0])
    verdict = compare(got, ref, Tolerance(1.0, 1.0))
    assert verdict.max_abs == 0.5 and verdict.max_rel == pytest.approx(0.5 / 2.0)
    assert verdict.rel_l2 == pytest.approx(0.5 / float(ref.norm()))


def test_activation_quantized_moe_cases_get_the_8_bit_activation_tolerance():
    from tokenspeed_kernel.tools import cases
    from tokenspeed_kernel.tools.tolerances import TOLERANCES, tolerance_for

    by_name = {c.name: c for c in cases.awkward_cases("moe.apply", torch.bfloat16)}
    assert tolerance_for(by_name["fp8_act_channel_t1"]) == TOLERANCES[("moe", "act8")]
    assert tolerance_for(by_name["mxfp8_act_t1"]) == TOLERANCES[("moe", "act8")]
    assert tolerance_for(by_name["fp8_per_channel"]) == TOLERANCES[("moe", "fp8")]  # weights only: tighter
    assert TOLERANCES[("moe", "act8")].rel_l2 <= 0.1  # still catches a wrong scale (>= 50% off)


def test_derived_cases_reach_a_kernel_that_serves_self_attention_only(temp_kernels):
    """A prefill kernel restricted to ``kv_prefix=0`` (keys are each sequence's queries, one
    lengths tensor for both) is checked, not skipped: the fresh copies each row gets keep
    ``cu_seqlens_k`` the same object as ``cu_seqlens_q`` where the inputs did."""
    reference = registry.get_kernel("torch_prefill").fn
    registry.register_kernel(
        "attention.prefill",
        name="t_self_only",
        solution="test",
        features=("sinks", "sliding_window", "non_causal", "return_lse"),
        shapes={"kv_prefix": (0,)},
    )(reference)
    report = check("attention.prefill", kernel="t_self_only", device="cpu", quiet=True)
    assert report.rows and all(r.status == "PASS" for r in report.rows), [(r.status, r.reason) for r in report.rows]


def test_plan_paths_follow_the_hooks_and_take_a_strided_q_through_the_decode_plan():
    """``cases.plan_paths``: a ``step_runner`` claims the step plan, a decode kernel's ``bind``
    the decode plan, a row-strided q's too (the plan made with its ``q_row_stride``)."""
    gluon_like = registry.get_kernel("torch_decode")
    hooked = dataclasses.replace(gluon_like, bind=lambda args: None, step_runner=lambda args: None)
    plain = cases.AttentionCase("attention.decode", (1, 1), (40, 7), 8, 2, 64)
    strided = dataclasses.replace(plain, strided_q=True)
    assert cases.plan_paths(plain, hooked) == ("step", "decode")
    assert cases.plan_paths(strided, hooked) == ("step", "decode")
    assert cases.plan_paths(plain, gluon_like) == ()
