"""``triton_moe_gemv_mx`` (MXFP4 MoE as two GEMV launches, T <= 8): registration and gating,
numerics under the interpreter, and the ahead-of-time compile.

- Gating: PORTABLE + 20 (above ``triton_fused_moe_mx``), MXFP4 weights only, ``T > 8`` rejected with
  its reason (through ``explain`` on the request ``moe_apply`` builds).
- Numerics (CPU, ``TRITON_INTERPRET=1``): the real kernels through ``moe_apply(override=)``
  and ``moe_plan``, outputs poisoned with NaN, against the independent float64
  ``support.naive_moe`` and the core float64 reference: T in {1, 3, 8}, every activation,
  with and without biases, with an expert map holding -1 entries, shapes whose K is below,
  above and not a multiple of ``BLOCK_K`` (masked tails), row tails, fp16/fp32 activations
  (a token with every choice remote, and run-to-run bit equality: ``test_moe_gemv.py``, both
  formats).
- AOT: both layers compile for sm_90, gfx942 and gfx950 at GPT-OSS-120B shapes without
  spills, for both weight formats of the shared kernels (MXFP4 here, bf16 for
  ``triton_moe_gemv``; ``python -m tokenspeed_kernel_dev.aot_triton_gemv`` in a subprocess).
"""

import functools
import os

import pytest
import torch
from support.aot import run_aot
from support.moe_checks import DTYPE_TOL, call_override, candidate, check_close, gemv_case, gpt_oss_request
from support.naive_moe import naive_moe

from tokenspeed_kernel import explain
from tokenspeed_kernel.ops.moe import moe_plan
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.registry import Priority, get_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import gemv

NAME = "triton_moe_gemv_mx"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = DTYPE_TOL
T_REASON = "num_tokens_bucket=16 > 8: the GEMV MoE serves T <= 8 tokens"


_case = functools.partial(gemv_case, "mxfp4")


_check = check_close
_call = functools.partial(call_override, kernel=NAME)


# ---------------------------------------------------------------- registration and gating


def test_registration_metadata():
    spec = get_kernel(NAME)
    assert spec.priority == Priority.PORTABLE + 20 and spec.band is Priority.PORTABLE
    assert spec.priority > get_kernel("triton_fused_moe_mx").priority > get_kernel("triton_fused_moe").priority
    assert spec.solution == "triton" and spec.graph_safe and spec.prepare is None and spec.available is None
    assert spec.bind is gemv.bind_gemv  # shared with triton_moe_gemv (test_moe_gemv.py)
    assert spec.features == frozenset({"silu", "gelu", "swiglu_oai", "bias", "expert_map", "mxfp4"})
    assert dict(spec.dtypes)["weight"] == frozenset({torch.uint8})
    assert {torch.bfloat16, torch.float16} <= dict(spec.dtypes)["x"]
    # the CPU always, under Triton's interpreter only (whatever TRITON_INTERPRET says at import)
    assert spec.vendors == {"cuda", "rocm", "cpu"} and spec.vendor_capabilities == (("cpu", {"triton_interpreter"}),)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_predicate_serves_t_up_to_8_and_rejects_9(arch):
    platform = platform_from_arch(arch)
    for t in (1, 2, 5, 8):
        selection = explain(gpt_oss_request(t), platform=platform)
        assert candidate(selection, NAME).accepted, (t, candidate(selection, NAME).reasons)
        triton = [c.spec for c in selection.candidates if c.accepted and c.spec.solution == "triton"]
        # the first Triton MoE for T <= 8, but for sm_90's swapped kernel (registered for sm_90 only)
        first = "triton_fused_moe_mx_swap" if arch == "sm_90" else NAME
        assert max(triton, key=lambda spec: spec.priority).name == first
        assert explain(gpt_oss_request(t), platform=platform, override=NAME).winner.name == NAME
    assert candidate(explain(gpt_oss_request(9), platform=platform), NAME).reasons == (T_REASON,)
    assert candidate(explain(gpt_oss_request(None), platform=platform), NAME).accepted, "a plan has no token count"
    reasons = candidate(explain(gpt_oss_request(1, "fp8_per_channel"), platform=platform), NAME).reasons
    assert any("weight dtype float8_e4m3fn not in {uint8}" in r for r in reasons), reasons


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU form: the interpreter serves cpu")
def test_public_call_rejects_t9_with_the_reason():
    case = _case(9)
    selection = explain(cases.request(case))
    assert candidate(selection, NAME).reasons == (T_REASON,)
    with pytest.raises(Exception, match="T <= 8"):
        cases.call(case, cases.make_inputs(case, DEVICE, seed=1), override=NAME)


# ---------------------------------------------------------------- numerics (interpreter on CPU)

NUMERIC_CASES = [
    *(_case(t, act=act, bias=bias, emap=emap)
      for t in (1, 3, 8) for act in ("silu", "gelu", "swiglu_oai") for bias, emap in ((False, False), (True, True))),
    _case(1, h=96, i=96, act="swiglu_oai", bias=True),  # K = 96 < BLOCK_K: masked tail in both layers
    _case(3, h=96, i=96, act="gelu", emap=True),
    _case(5, h=288, i=160, act="swiglu_oai", bias=True, emap=True),  # K > BLOCK_K, not a multiple
    _case(8, h=512, i=64, act="silu", bias=True),  # K = 2 * BLOCK_K: the unmasked path, two steps
    _case(2, h=64, i=32, act="swiglu_oai", bias=True, emap=True, e=16, k=4),  # GPT-OSS's top-4
    _case(4, h=64, i=32, act="silu", bias=True, e=12, k=3),  # top-3: KP = 4, one masked choice
]  # fmt: skip


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.name + f"_e{c.num_experts}k{c.top_k}")
def test_matches_float64_references(case):
    inputs = cases.make_inputs(case, DEVICE, seed=len(case.name) + case.top_k)
    naive = naive_moe(**inputs)
    core, _ = cases.reference(case, inputs)
    torch.testing.assert_close(core.cpu(), naive.cpu(), rtol=1e-9, atol=1e-9)  # the two references agree
    out = _call(inputs)
    _check(out, naive, case.dtype)
    if case.expert_map:
        assert (inputs["expert_map"] == -1).any() and (inputs["expert_map"][inputs["topk_ids"].long()] == -1).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_activations(dtype):
    case = _case(3, h=96, i=64, act="swiglu_oai", bias=True, emap=True, dtype=dtype)
    inputs = cases.make_inputs(case, DEVICE, seed=4)
    out = _call(inputs)
    assert out.dtype == dtype
    _check(out, naive_moe(**inputs), dtype)


TILE_OVERRIDES = [
    (gemv.GemvTile(64, 64, 4), gemv.GemvTile(64, 64, 4)),  # row tails (N = 96 / 160), 64-value steps
    (gemv.GemvTile(16, 32, 2), gemv.GemvTile(8, 128, 2)),  # one group per step; layer-2 K tail
    (gemv.GemvTile(8, 512, 8), gemv.GemvTile(32, 512, 8)),
]


@pytest.mark.parametrize("tiles", TILE_OVERRIDES, ids=lambda t: f"n{t[0].block_n}k{t[0].block_k}-n{t[1].block_n}")
def test_other_tiles(tiles):
    case = _case(3, h=160, i=96, act="swiglu_oai", bias=True, emap=True)
    inputs = cases.make_inputs(case, DEVICE, seed=9)
    out = torch.full_like(inputs["x"], float("nan"))
    gemv.gemv_moe(MoEApplyArgs(**inputs, out=out), tiles=tiles)
    _check(out, naive_moe(**inputs), case.dtype)


def test_plan_matches_functional_path_and_hands_large_t_on():
    case = _case(8, h=96, i=64, act="swiglu_oai", bias=True, emap=True)
    inputs = cases.make_inputs(case, DEVICE, seed=6)
    weights = {k: inputs[k] for k in ("w13", "w2", "w13_bias", "w2_bias", "expert_map")}
    plan = moe_plan(**weights, x_dtype=case.dtype, top_k=case.top_k, activation=case.activation, override=NAME)
    assert plan.kernel == NAME and plan.prepared is None
    planned = plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"])
    assert torch.equal(planned, _call(inputs))
    gen = torch.Generator(DEVICE).manual_seed(0)  # T = 11 tokens, same weights: triton_fused_moe's path
    ids = torch.stack([torch.randperm(case.num_experts, generator=gen, device=DEVICE)[: case.top_k] for _ in range(11)])
    big = {
        **inputs,
        "x": torch.randn(11, case.hidden, generator=gen, device=DEVICE).to(case.dtype),
        "topk_ids": ids.int(),
        "topk_weights": torch.rand(11, case.top_k, generator=gen, device=DEVICE),
    }
    out = plan.apply(big["x"], big["topk_weights"], big["topk_ids"])
    _check(out, naive_moe(**big), case.dtype)


def test_tiles_table():
    for vendor in ("cuda", "rocm", "cpu"):
        rows = gemv.TILES["mxfp4"]["rocm" if vendor == "rocm" else "cuda"]
        assert [r.max_tokens for r in rows] == sorted(r.max_tokens for r in rows)
        assert rows[-1].max_tokens == gemv.MAX_TOKENS
        assert gemv.pick_gemv_tiles(vendor, 4, 1) == (gemv.GemvTile(8, 256, 4), gemv.GemvTile(4, 256, 4))
        assert gemv.pick_gemv_tiles(vendor, 4, 3) == (gemv.GemvTile(16, 128, 4), gemv.GemvTile(8, 128, 4))
        assert gemv.pick_gemv_tiles(vendor, 4, 9) == gemv.pick_gemv_tiles(vendor, 4, 8)  # past the last row
        for t in (1, 2, 3, 8):
            for tile in gemv.pick_gemv_tiles(vendor, 4, t):
                assert tile.block_k % 32 == 0 and tile.block_k & (tile.block_k - 1) == 0
    assert gemv.w2_block_n(2, 32) == 16 and gemv.w2_block_n(8, 32) == 4 and gemv.w2_block_n(16, 16) == 4


# ---------------------------------------------------------------- ahead-of-time compile

TARGETS = ("cuda:90", "hip:gfx942", "hip:gfx950")


@pytest.fixture(scope="module")
def compiled():
    (run,) = run_aot("tokenspeed_kernel_dev.aot_triton_gemv", [TARGETS])
    return run.rows


@pytest.mark.parametrize("target", TARGETS)
def test_aot_compiles_without_spills(compiled, target):
    mine = [r for r in compiled if r["target"] == target]
    assert {r["kernel"].split("[")[0] for r in mine} == {"gemv_w13", "gemv_w2"}
    assert {r["kernel"].split("[")[1].split()[0] for r in mine} == {"mxfp4", "bf16"}
    for r in mine:
        assert r["ok"], r
        assert r["spills"] == 0 and 0 < r["registers"] <= 255, r
        assert r["shared_bytes"] <= 64 * 1024, r
