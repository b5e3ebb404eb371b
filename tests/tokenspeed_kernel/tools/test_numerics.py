"""The check tool: PASS on correct kernels, FAIL on a wrong one, SKIP with the reason."""

import io

import pytest
import torch

from tokenspeed_kernel import registry
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel.tools.numerics import check
from tokenspeed_kernel.tools.tolerances import Tolerance, compare

pytestmark = pytest.mark.usefixtures("only_reference")


def test_reference_kernels_pass_small_preset_on_every_op():
    stream = io.StringIO()
    report = check("all", preset="small", device="cpu", stream=stream)
    assert report.ok and not report.failed
    assert {r.op for r in report.passed} == {
        "attention.prefill", "attention.extend", "attention.decode", "kvcache.store", "moe.topk", "moe.apply"
    }  # fmt: skip
    assert "6 passed, 0 failed, 0 skipped" in stream.getvalue()


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
