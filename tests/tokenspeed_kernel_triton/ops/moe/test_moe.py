"""Triton MoE kernels against the independent float64 MoE of tests/support.

On a machine without a GPU these run under TRITON_INTERPRET=1 on CPU tensors (set by
tests/conftest.py), where the Triton kernels serve the CPU platform and win selection: the
tests call the public API with no override and assert the Triton kernel ran. Every weight
format, activation, bias and expert-map case of ``awkward_cases``, every tile of the launch
table (NVIDIA and AMD), the plan's repacked weights, the device-side permutation and
run-to-run determinism.
"""

import dataclasses

import pytest
import torch
from support.naive_moe import naive_moe, naive_topk

from tokenspeed_kernel.ops._dispatch import last_kernel
from tokenspeed_kernel.ops.moe import moe_plan
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import fused
from tokenspeed_kernel_triton.ops.moe._config import pick_tile, tiles_for
from tokenspeed_kernel_triton.ops.moe._routing import align_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_MOE = (
    "triton_fused_moe",
    "triton_fused_moe_mx",
    "triton_fused_moe_mx_swap",
    "triton_fused_moe_mx_swap_persistent",
    "triton_moe_gemv",
    "triton_moe_gemv_mx",
)
# Relative Frobenius error bounds: the intermediate activation is rounded to x's dtype.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref.cpu()).norm() / ref.cpu().norm().clamp_min(1e-30))


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "an output element was never written"
    err = _rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"
    tol = 4 * TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), atol=tol * (float(ref.abs().max()) + 1), rtol=tol)


TOPK = [
    pytest.param(c, id=f"{c.name}-{str(d)[6:]}")
    for d in (torch.bfloat16, torch.float32)
    for c in cases.awkward_cases("moe.topk", d)
]


@pytest.mark.parametrize("case", TOPK)
def test_topk_matches_naive(case):
    inputs = cases.make_inputs(case, DEVICE, seed=len(case.name))
    weights, ids = cases.call(case, inputs)
    assert last_kernel() == "triton_moe_topk"
    ref_w, ref_ids = naive_topk(**inputs)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.double().cpu(), ref_w.cpu(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("num_tokens", "num_experts"), [(1, 128), (2, 128), (16, 128), (17, 128), (3, 256), (40, 256)])
def test_topk_tile_per_batch_size(num_tokens, num_experts):
    """The launch sizes its tile to the batch (a T-row tile on one warp for decode batches,
    16 rows on 2-4 warps past that): every size and the partial last tile match naive."""
    case = cases.MoECase("moe.topk", num_tokens, 0, 0, num_experts, 4)
    inputs = cases.make_inputs(case, DEVICE, seed=num_tokens)
    weights, ids = cases.call(case, inputs)
    assert last_kernel() == "triton_moe_topk"
    ref_w, ref_ids = naive_topk(**inputs)
    assert torch.equal(ids.long().cpu(), ref_ids.cpu())
    torch.testing.assert_close(weights.double().cpu(), ref_w.cpu(), atol=1e-6, rtol=1e-5)


# Every case in bf16; the other activation dtypes on a subset (each weight format once).
_SUBSET = ("plain_t5", "bias", "expert_map", "fp8_per_channel", "fp8_block", "gpt_oss_like")
# activation_quant="mxfp8" is not served by the Triton MoE (see test_mxfp8_activations_are_rejected);
# "fp8" is (test_fp8_activations_*).
APPLY = [
    pytest.param(c, id=f"{c.name}-bfloat16")
    for c in cases.awkward_cases("moe.apply", torch.bfloat16)
    if c.activation_quant is None
] + [
    pytest.param(c, id=f"{c.name}-{str(d)[6:]}")
    for d in (torch.float16, torch.float32)
    for c in cases.awkward_cases("moe.apply", d)
    if c.name in _SUBSET
]
FP8_ACT = [c for c in cases.awkward_cases("moe.apply", torch.bfloat16) if c.activation_quant == "fp8"]


@pytest.mark.parametrize("case", APPLY)
def test_fused_moe_matches_naive(case):
    inputs = cases.make_inputs(case, DEVICE, seed=len(case.name))
    expected = naive_moe(**inputs)
    poisoned = torch.full((case.num_tokens, case.hidden), float("nan"), dtype=case.dtype, device=DEVICE)
    out = cases.call(case, inputs, out=poisoned)
    # MXFP4 weights at T <= 8 go to the GEMV (test_moe_gemv_mx.py), other weights at T <= 2 to
    # theirs (test_moe_gemv.py); on a GPU, larger T to the tl.dot_scaled kernel (test_moe_mx.py)
    assert last_kernel() in TRITON_MOE, f"selector picked {last_kernel()}"
    assert out.dtype == case.dtype
    _check(out, expected, case.dtype)


def test_mxfp8_activations_are_rejected():
    """The Triton MoE does not declare ``mxfp8_act``: the selector rejects it with that reason."""
    from tokenspeed_kernel import explain

    mxfp8 = [c for c in cases.awkward_cases("moe.apply", torch.bfloat16) if c.activation_quant == "mxfp8"]
    assert mxfp8
    for case in mxfp8:
        selection = explain(cases.request(case))
        triton = next(c for c in selection.candidates if c.spec.name == "triton_fused_moe")
        assert "does not support {mxfp8_act}" in triton.reasons, triton.reasons
        assert selection.winner is not None and selection.winner.name != "triton_fused_moe"


def _args(inputs, out=None, prepared=None) -> MoEApplyArgs:
    x = inputs["x"]
    out = torch.full_like(x, float("nan")) if out is None else out
    return MoEApplyArgs(**inputs, out=out, prepared=prepared)


TILE_CASES = {"plain": ("fp8_block", "odd_sizes", "plain_t33"), "mxfp4": ("mxfp4_k128",)}


@pytest.mark.parametrize("weights", ["plain", "mxfp4"])
@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_every_tile_of_the_table(vendor, weights):
    """Each tile the heuristic can choose (both vendors' tables), on the cases that stress
    formats and masking; the decode/prefill regimes differ only by tile."""
    by_name = {c.name: c for c in cases.awkward_cases("moe.apply", torch.bfloat16)}
    by_name["mxfp4_k128"] = dataclasses.replace(by_name["mxfp4_t33"], hidden=128, intermediate=64, name="mxfp4_k128")
    for tile in tiles_for(vendor, weights):
        for name in TILE_CASES[weights]:
            case = by_name[name]
            inputs = cases.make_inputs(case, DEVICE, seed=3)
            expected = naive_moe(**inputs)
            plans = [None]
            if weights == "mxfp4":  # the functional path (standard layout) and the planned one
                plans.append(fused.prepare_moe(w13=inputs["w13"], w2=inputs["w2"]))
            for prepared in plans:
                args = _args(inputs, prepared=prepared)
                fused.fused_moe(args, tile=tile)
                _check(args.out, expected, case.dtype)


def test_tile_regimes():
    for weights in ("plain", "mxfp4"):
        decode = pick_tile(1 * 4, 128, "cuda", weights)
        prefill = pick_tile(4096 * 4, 128, "cuda", weights)
        assert decode.block_m == 16 and prefill.block_m >= 64
        assert pick_tile(4096 * 4, 128, "rocm", weights).num_stages <= 2


def test_plan_repacks_mxfp4_scales_and_matches_functional_path():
    case = dataclasses.replace(
        {c.name: c for c in cases.awkward_cases("moe.apply")}["gpt_oss_like"], num_tokens=9, name="plan"
    )
    inputs = cases.make_inputs(case, DEVICE, seed=11)
    weights = {k: inputs[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
    plan = moe_plan(
        **weights, x_dtype=case.dtype, top_k=case.top_k, activation=case.activation, override="triton_fused_moe"
    )
    assert plan.kernel == "triton_fused_moe"
    assert isinstance(plan.prepared, fused.PreparedMoE)
    scales = plan.prepared.w13.scale
    # int32 words [E, K/128, N], 4 E8M0 scales each (little-endian) → back to [E, N, K/32]
    unpacked = torch.stack([(scales >> (8 * j)) & 255 for j in range(4)], dim=2).flatten(1, 2).transpose(1, 2)
    assert torch.equal(unpacked[..., : case.hidden // 32].to(torch.uint8), inputs["w13"].scales)
    # H = 64: w13 bytes reordered to the "halves" layout; I = 32 is no whole 64-value group.
    assert plan.prepared.w13.mx_halves and not plan.prepared.w2.mx_halves
    assert not torch.equal(plan.prepared.w13.data, inputs["w13"].packed)
    planned = plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"])
    _check(planned, naive_moe(**inputs), case.dtype)
    functional = cases.call(case, inputs)
    assert torch.equal(planned, functional), "plan and functional path must agree bit for bit"


@pytest.mark.parametrize("name", ["gpt_oss_like", "expert_map", "plain_t1"])
def test_plan_runs_bound_per_token_count(name):
    """MoEPlan binds triton_fused_moe's four launches once per token count (fresh inputs
    every call, outputs poisoned first); each call equals the functional path bit for bit
    and matches float64; counts above BIND_MAX_TOKENS are left to fn."""
    base = {c.name: c for c in cases.awkward_cases("moe.apply")}[name]
    inputs = cases.make_inputs(base, DEVICE, seed=3)
    weights = {k: inputs[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
    plan = moe_plan(
        **weights, x_dtype=base.dtype, top_k=base.top_k, activation=base.activation, override="triton_fused_moe"
    )
    counts = (1, 5, 1, 5, fused.BIND_MAX_TOKENS + 1)
    for seed, num_tokens in enumerate(counts):
        step = cases.make_inputs(dataclasses.replace(base, num_tokens=num_tokens), DEVICE, seed=20 + seed)
        step.update(weights)
        out = torch.full_like(step["x"], float("nan"))
        planned = plan.apply(step["x"], step["topk_weights"], step["topk_ids"], out=out)
        _check(planned, naive_moe(**step), base.dtype)
        assert torch.equal(planned, cases.call(dataclasses.replace(base, num_tokens=num_tokens), step))
    assert set(plan.runners) == {1, 5, fused.BIND_MAX_TOKENS + 1}
    assert plan.runners[1] is not None and plan.runners[5] is not None
    assert plan.runners[fused.BIND_MAX_TOKENS + 1] is None


@pytest.mark.parametrize("with_map", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
def test_permutation_groups_pairs_by_expert(with_map, block_m):
    gen = torch.Generator().manual_seed(block_m)
    num_global, top_k, tokens = 12, 3, 37
    ids = torch.stack([torch.randperm(num_global, generator=gen)[:top_k] for _ in range(tokens)]).int()
    mapping = None
    num_local = num_global
    if with_map:
        num_local = 5
        mapping = torch.full((num_global,), -1, dtype=torch.int32)
        mapping[torch.randperm(num_global, generator=gen)[:num_local]] = torch.arange(num_local, dtype=torch.int32)
    r, launch = align_launch(ids.to(DEVICE), None if mapping is None else mapping.to(DEVICE), num_local, block_m)
    r.work_counters.fill_(7)  # a previous call's counts: the permutation zeroes them
    launch()
    flat = ids.flatten().long()
    local = flat if mapping is None else mapping.long()[flat]
    num_tiles = int(r.num_tiles.item())
    assert num_tiles <= r.tiles_bound
    sorted_ids = r.sorted_ids[: num_tiles * block_m].cpu().long()
    tile_expert = r.tile_expert[:num_tiles].cpu().long()
    owner = tile_expert.repeat_interleave(block_m)
    real = sorted_ids < r.num_pairs
    assert sorted(sorted_ids[real].tolist()) == [p for p in range(r.num_pairs) if local[p] >= 0]
    assert torch.equal(local[sorted_ids[real]], owner[real])
    counts = torch.bincount(local[local >= 0], minlength=num_local)
    assert num_tiles == int(((counts + block_m - 1) // block_m).sum())
    for e in range(num_local):  # stable: ascending pair order within an expert
        mine = sorted_ids[real & (owner == e)]
        assert torch.equal(mine, mine.sort().values)
    # The persistent GEMM's work list: each used tile's expert span (first tile, tiles, pairs),
    # and its two work counters zeroed.
    span = r.tile_span[:, :num_tiles].cpu().long()
    tiles_of = (counts + block_m - 1) // block_m
    first_of = torch.cumsum(tiles_of, 0) - tiles_of
    assert torch.equal(span[0], first_of[tile_expert]), span
    assert torch.equal(span[1], tiles_of[tile_expert]) and torch.equal(span[2], counts[tile_expert])
    assert r.work_counters.cpu().tolist() == [0, 0]


def test_combine_is_deterministic():
    case = {c.name: c for c in cases.awkward_cases("moe.apply")}["plain_t33"]
    inputs = cases.make_inputs(case, DEVICE, seed=5)
    first = cases.call(case, inputs)
    assert torch.equal(first, cases.call(case, inputs))


ATOMIC_CASES = ("plain_t1", "plain_t33", "expert_map_t33", "fp8_block", "gpt_oss_like", "topk_eq_e", "odd_sizes")


@pytest.mark.parametrize("name", ATOMIC_CASES)
def test_atomic_combine_matches_naive(name):
    """``combine="atomic"`` (the weighted combine fused into the w2 epilogue with float32
    atomics into a [T, H] buffer) against float64 and against the deterministic combine (same
    float32 sums in another order: equal up to one rounding of x's dtype)."""
    case = {c.name: c for c in cases.awkward_cases("moe.apply")}[name]
    inputs = cases.make_inputs(case, DEVICE, seed=7)
    expected = naive_moe(**inputs)
    atomic = _args(inputs)
    fused.fused_moe(atomic, combine="atomic")
    _check(atomic.out, expected, case.dtype)
    reduce = _args(inputs)
    fused.fused_moe(reduce)
    torch.testing.assert_close(atomic.out, reduce.out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_atomic_combine_every_tile(vendor):
    case = {c.name: c for c in cases.awkward_cases("moe.apply")}["plain_t33"]
    inputs = cases.make_inputs(case, DEVICE, seed=4)
    expected = naive_moe(**inputs)
    for tile in tiles_for(vendor, "plain"):
        args = _args(inputs)
        fused.fused_moe(args, tile=tile, combine="atomic")
        _check(args.out, expected, case.dtype)


def test_combine_mode_is_validated():
    case = {c.name: c for c in cases.awkward_cases("moe.apply")}["plain_t1"]
    with pytest.raises(ValueError, match="combine"):
        fused.fused_moe(_args(cases.make_inputs(case, DEVICE)), combine="scatter")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [0, 128])
def test_fp8_quant_kernel_is_the_core_rule_bit_for_bit(group, dtype):
    """The on-the-fly quantizer writes exactly quantize_fp8_per_token's bytes and scales."""
    from tokenspeed_kernel.quant import quantize_fp8_per_token

    gen = torch.Generator().manual_seed(group)
    x = (torch.randn(9, 300, generator=gen) * torch.logspace(-4, 4, 9)[:, None]).to(dtype).to(DEVICE)
    x[3] = 0
    q, s = fused.quantize_fp8_rows(x, group)
    ref_q, ref_s = quantize_fp8_per_token(x, group or None)
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu())
    assert torch.equal(s.cpu(), ref_s.cpu())


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in FP8_ACT])
def test_fp8_activations_match_naive(case):
    """activation_quant="fp8": the Triton MoE serves it (fp8 x fp8 main loop) and lands on the
    float64 result of the same quantization, clearly closer than to the unquantized one."""
    inputs = cases.make_inputs(case, DEVICE, seed=1)
    expected = naive_moe(**inputs)
    out = cases.call(
        case, inputs, out=torch.full((case.num_tokens, case.hidden), float("nan"), dtype=case.dtype, device=DEVICE)
    )
    assert last_kernel() == "triton_fused_moe"
    assert not torch.isnan(out).any()
    err = _rel_err(out, expected)
    unquantized = _rel_err(out, naive_moe(**{**inputs, "activation_quant": None}))
    assert err < 3e-2 and err < 0.6 * unquantized, (err, unquantized)


@pytest.mark.parametrize("vendor", ["cuda", "rocm"])
def test_fp8_activations_every_tile_and_atomic(vendor):
    for case in FP8_ACT[1:]:
        inputs = cases.make_inputs(case, DEVICE, seed=2)
        expected = naive_moe(**inputs)
        for tile in tiles_for(vendor, "plain"):
            for mode in ("reduce", "atomic"):
                args = _args(inputs)
                fused.fused_moe(args, tile=tile, combine=mode)
                assert _rel_err(args.out, expected) < 3e-2, (case.name, tile, mode)
