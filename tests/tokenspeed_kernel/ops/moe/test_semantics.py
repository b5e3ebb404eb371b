"""moe_topk / moe_apply semantics through the reference kernels, against an independent
float64 implementation (tests/support/naive_moe.py) on awkward shapes."""

import pytest
import torch
from support.naive_moe import naive_moe, naive_topk

from tokenspeed_kernel import moe_apply, moe_topk
from tokenspeed_kernel.tools.cases import moe as cases

TOPK = "torch_moe_topk"
APPLY = "torch_moe"

# Output tolerances per activation dtype (the reference computes in float32, rounds once).
TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 1.6e-2},
}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]

TOPK_CASES = cases.awkward_cases("moe.topk")
APPLY_CASES = cases.awkward_cases("moe.apply")

# ------------------------------------------------------------------ moe_topk


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", TOPK_CASES, ids=lambda c: c.name)
def test_topk_matches_naive(case, dtype):
    case = cases.MoECase(**{**case.__dict__, "dtype": dtype})
    inputs = cases.make_inputs(case, seed=11)
    weights, ids = cases.call(case, inputs, override=TOPK)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (case.num_tokens, case.top_k)
    ref_w, ref_ids = naive_topk(inputs["router_logits"], case.top_k, scoring=case.scoring, renormalize=case.renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, atol=1e-6, rtol=1e-5)
    # The float64 ground truth of the tools agrees with the naive implementation.
    gt_w, gt_ids = cases.reference(case, inputs)
    assert torch.equal(gt_ids.long(), ref_ids)
    torch.testing.assert_close(gt_w, ref_w, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_topk_ties_go_to_lower_id_in_descending_order(scoring):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    weights, ids = moe_topk(logits, 3, scoring=scoring, renormalize=False, override=TOPK)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.all(weights[:, :-1] >= weights[:, 1:])


def test_topk_renormalize_and_raw_scores():
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(3))
    w, ids = moe_topk(logits, 4, override=TOPK)
    torch.testing.assert_close(w.sum(-1), torch.ones(9))
    raw, raw_ids = moe_topk(logits, 4, renormalize=False, override=TOPK)
    assert torch.equal(ids, raw_ids)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids.long()))
    sig, sig_ids = moe_topk(logits, 4, scoring="sigmoid", renormalize=False, override=TOPK)
    assert torch.equal(sig_ids, ids)  # sigmoid and softmax are both monotonic in the logit
    torch.testing.assert_close(sig, torch.sigmoid(logits).gather(1, ids.long()))


def test_topk_zero_tokens():
    w, ids = moe_topk(torch.empty(0, 8), 2, override=TOPK)
    assert w.shape == ids.shape == (0, 2)


# ------------------------------------------------------------------ moe_apply


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", APPLY_CASES, ids=lambda c: c.name)
def test_apply_matches_naive(case, dtype):
    case = cases.MoECase(**{**case.__dict__, "dtype": dtype})
    inputs = cases.make_inputs(case, seed=7)
    expected = naive_moe(**inputs)
    assert expected.abs().max() > 0.1, "the case must not be trivially zero"
    poisoned = torch.full_like(inputs["x"], float("nan"))
    out = moe_apply(**inputs, out=poisoned, override=APPLY)
    assert out is poisoned and out.dtype == dtype and out.shape == inputs["x"].shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    # The tools' float64 ground truth (reference kernel on float64 copies) is exact.
    ground_truth, _ = cases.reference(case, inputs)
    torch.testing.assert_close(ground_truth, expected, atol=1e-10, rtol=1e-10)


def test_apply_allocates_out_and_matches_out_path():
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, bias=True)
    inputs = cases.make_inputs(case, seed=1)
    a = moe_apply(**inputs, override=APPLY)
    b = moe_apply(**inputs, out=torch.full_like(inputs["x"], float("nan")), override=APPLY)
    assert torch.equal(a, b)


def test_apply_expert_map_all_remote_gives_zeros():
    case = cases.MoECase("moe.apply", 4, 64, 32, 8, 2, torch.float32, bias=True, expert_map=True)
    inputs = cases.make_inputs(case, seed=2)
    inputs["expert_map"] = torch.full_like(inputs["expert_map"], -1)
    out = moe_apply(**inputs, out=torch.full_like(inputs["x"], float("nan")), override=APPLY)
    assert torch.equal(out, torch.zeros_like(out))


def test_apply_sums_duplicate_choices_and_weights_linearly():
    case = cases.MoECase("moe.apply", 3, 64, 32, 4, 2, torch.float32)
    inputs = cases.make_inputs(case, seed=3)
    inputs["topk_ids"] = torch.tensor([[1, 1], [2, 3], [0, 0]], dtype=torch.int32)
    inputs["topk_weights"] = torch.tensor([[0.25, 0.5], [1.0, 0.0], [2.0, -1.0]])
    out = moe_apply(**inputs, override=APPLY)
    single = dict(inputs, topk_ids=inputs["topk_ids"][:, :1].contiguous())
    single["topk_weights"] = torch.tensor([[0.75], [1.0], [1.0]])
    torch.testing.assert_close(out, moe_apply(**single, override=APPLY))


def test_apply_swiglu_oai_clamps():
    # With huge activations the clamps decide the result: gate -> 7, up -> +-7.
    h, i = 32, 32
    x = torch.ones(1, h)
    w13 = torch.zeros(1, 2 * i, h)
    w13[0, :i] = 1.0  # gate = 32 -> clamped to 7
    w13[0, i:] = -1.0  # up = -32 -> clamped to -7
    w2 = torch.eye(h, i).unsqueeze(0).contiguous()
    out = moe_apply(
        x, w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), activation="swiglu_oai", override=APPLY
    )
    value = 7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item() * (-7.0 + 1.0)
    torch.testing.assert_close(out, torch.full((1, h), value))


def test_apply_zero_tokens():
    case = cases.MoECase("moe.apply", 0, 64, 32, 8, 2, torch.float32)
    out = moe_apply(**cases.make_inputs(case), override=APPLY)
    assert out.shape == (0, 64)


def test_reference_kernel_runs_in_float64():
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, activation="gelu", bias=True)
    inputs = cases.make_inputs(case, seed=4)
    gt, none = cases.reference(case, inputs)
    assert none is None and gt.dtype == torch.float64
    torch.testing.assert_close(gt, naive_moe(**inputs), atol=1e-12, rtol=1e-12)


def test_case_metrics():
    case = cases.MoECase("moe.apply", 16, 64, 32, 8, 2, weight_format="mxfp4", expert_map=True)
    assert case.num_local_experts == 4
    assert case.flops() == pytest.approx(16 * 2 * 2 * (64 * 64 + 32 * 64) * 0.5)
    assert 0 < case.expected_experts_hit() <= 4
    assert case.bytes_moved() > 2 * 16 * 64 * 2
    assert "mxfp4" in case.describe() and "local 4" in case.describe()
    with pytest.raises(ValueError, match="mxfp4"):
        cases.MoECase("moe.apply", 1, 48, 32, 8, 2, weight_format="mxfp4")
    big = cases.gpt_oss_case(1)
    assert big.weight_format == "mxfp4" and big.activation == "swiglu_oai" and big.bias
