"""``triton_moe_gemv`` (bf16/fp16/fp32-weight MoE as two GEMV launches, T <= 8; opt-in):
registration and gating, numerics under the interpreter, the bound plan and functional runner
paths, bad inputs, and (with a GPU) the real kernels.

- Gating: ``Priority.OPT_IN + 10`` (never the pick without an override while ``triton_fused_moe``
  serves), weights in x's dtype only (MXFP4 and fp8 rejected with their reasons), ``T > 8``
  rejected with its reason, a plan request (no token count) accepted.
- Numerics (CPU, ``TRITON_INTERPRET=1``; the real kernels on a GPU host): through
  ``moe_apply(override=)``, outputs poisoned with NaN, against the independent float64
  ``support.naive_moe`` and the core float64 reference (checked against each other): T = 1..8,
  top-k 1..4 (and top-k = E), E not a power of two, H and I not multiples of the tiles
  (masked K and row tails) and multiples of them (the unmasked path), every activation, biases
  on and off (both bias dtypes), an expert map with -1 entries, experts repeated across
  tokens, fp16 and fp32, other tiles; a token with every choice remote gives a zero row and
  two calls are bit-identical (both weight formats of the shared kernels).
- Plans: ``moe_plan(override=)`` binds both launches once per token count; each planned call
  (fresh inputs, poisoned output) equals the functional call bit for bit; counts above 8 run
  ``triton_fused_moe``'s runner (none above its 64). The bound and the functional runners
  launch what the uncached call launches (recorded, nothing run); that the launches depend on
  the shapes only (no host read of a device value) is in ``test_no_host_sync.py``.
- Bad inputs raise ``TypeError``/``ValueError``/``KernelOverrideError`` before any launch.
- GPU (skipped here, with the reason): awkward GPU-sized problems, the plan's bound runs,
  a CUDA-graph capture replayed against eager, GPT-OSS-120B's layer shape.
"""

import dataclasses
import functools
import os

import pytest
import torch
from support.gpu_moe import awkward_gpu_inputs
from support.launch_recorder import Recorder, assert_same_launches
from support.moe_checks import (
    DTYPE_TOL,
    call_override,
    candidate,
    capture,
    check_close,
    check_gpu_bound_runs,
    gemv_case,
    gpt_oss_request,
)
from support.naive_moe import naive_moe

from tokenspeed_kernel import KernelOverrideError, explain
from tokenspeed_kernel.ops.moe import moe_apply, moe_plan
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.quant import FP8Weight, MXFP4Weight, quantize_fp8, quantize_mxfp4
from tokenspeed_kernel.registry import Priority, get_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases.moe import MoECase
from tokenspeed_kernel_triton.ops.moe import fused, gemv

NAME = "triton_moe_gemv"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = DTYPE_TOL


def _request(num_tokens, weight_format="plain", **kw):
    return gpt_oss_request(num_tokens, weight_format, **kw)


T_REASON = "num_tokens_bucket=16 > 8: the GEMV MoE serves T <= 8 tokens"
WEIGHT_KEYS = ("w13", "w2", "w13_bias", "w2_bias", "expert_map")
CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="records launches of CPU tensors (interpreter); the GPU tests run the kernels"
)


_case = functools.partial(gemv_case, "plain")


_check = check_close
_call = functools.partial(call_override, kernel=NAME)


def _plan(inputs: dict, **kw):
    weights = {k: inputs[k] for k in WEIGHT_KEYS}
    x = inputs["x"]
    return moe_plan(
        **weights, x_dtype=x.dtype, top_k=inputs["topk_ids"].shape[1], activation=inputs["activation"], **kw
    )


def _routing(t: int, e: int, k: int, seed: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 weights and distinct int32 ids ``[t, k]`` over ``e`` experts, seeded."""
    gen = torch.Generator(device).manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen, device=device)[:k] for _ in range(t)]).int()
    return torch.rand(t, k, generator=gen, device=device), ids


# ---------------------------------------------------------------- registration and gating


def test_registration_metadata():
    spec = get_kernel(NAME)
    assert spec.priority == Priority.OPT_IN + 10 and spec.band is Priority.OPT_IN
    assert spec.priority < get_kernel("triton_fused_moe").priority
    assert spec.solution == "triton" and spec.graph_safe and spec.prepare is None and spec.available is None
    assert spec.bind is gemv.bind_gemv and spec.bind is get_kernel("triton_moe_gemv_mx").bind
    assert spec.features == frozenset({"silu", "gelu", "swiglu_oai", "bias", "expert_map"})
    assert dict(spec.dtypes)["weight"] == frozenset({torch.bfloat16, torch.float16, torch.float32})
    assert dict(spec.dtypes)["x"] == frozenset({torch.bfloat16, torch.float16, torch.float32})
    # the CPU always, under Triton's interpreter only (whatever TRITON_INTERPRET says at import)
    assert spec.vendors == {"cuda", "rocm", "cpu"} and spec.vendor_capabilities == (("cpu", {"triton_interpreter"}),)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "gfx942"])
def test_first_at_1_and_2_tokens_opt_in_up_to_8(arch):
    """Ranked first at T = 1 and 2 (measured faster on an H200), opt-in (by override) at 3 to 8,
    refused above 8."""
    platform = platform_from_arch(arch)
    for t in (1, 2, 5, 8):
        for dtype in (torch.bfloat16, torch.float16):
            selection = explain(_request(t, x_dtype=dtype), platform=platform)
            assert candidate(selection, NAME).accepted, (t, candidate(selection, NAME).reasons)
            first = NAME if t <= 2 else "triton_fused_moe"
            assert selection.winner.name == first, (t, selection.winner.name)
            assert explain(_request(t, x_dtype=dtype), platform=platform, override=NAME).winner.name == NAME
    assert candidate(explain(_request(9), platform=platform), NAME).reasons == (T_REASON,)
    assert candidate(explain(_request(None), platform=platform), NAME).accepted, "a plan has no token count"
    for fmt, dtype in (("mxfp4", "uint8"), ("fp8_per_channel", "float8_e4m3fn")):
        reasons = candidate(explain(_request(1, fmt), platform=platform), NAME).reasons
        assert any(f"weight dtype {dtype} not in" in r for r in reasons), reasons


# ---------------------------------------------------------------- numerics

NUMERIC_CASES = [
    *(_case(t, act=act, bias=bias, emap=emap)
      for t in (1, 4, 8) for act in ("silu", "gelu", "swiglu_oai") for bias, emap in ((False, False), (True, True))),
    _case(1, h=200, i=72, act="swiglu_oai", bias=True, e=6, k=4),  # E = 6, H and I no tile multiple
    _case(2, h=96, i=40, act="gelu", emap=True, e=12, k=3),  # top-3: KP = 4, one masked choice
    _case(3, h=300, i=136, act="swiglu_oai", bias=True, emap=True, e=5, k=1),  # top-1, K > BLOCK_K
    _case(5, h=136, i=264, act="silu", bias=True, e=7, k=2),  # layer-2 K = 264: three 128-value steps
    _case(6, h=72, i=48, act="swiglu_oai", e=3, k=3),  # top-k = E: every expert on every token
    _case(7, h=160, i=24, act="gelu", bias=True, emap=True, e=10, k=4),  # I < every BLOCK_N and BLOCK_K
    _case(8, h=512, i=256, act="swiglu_oai", bias=True, e=6, k=2),  # multiples of the tiles: EVEN_K
]  # fmt: skip


@pytest.mark.parametrize("case", NUMERIC_CASES, ids=lambda c: c.name)
def test_matches_float64_references(case):
    inputs = cases.make_inputs(case, DEVICE, seed=len(case.name) + case.top_k)
    naive = naive_moe(**inputs)
    core, _ = cases.reference(case, inputs)
    torch.testing.assert_close(core.cpu(), naive.cpu(), rtol=1e-9, atol=1e-9)  # the two references agree
    _check(_call(inputs), naive, case.dtype)
    if case.expert_map and case.top_k > 1:
        assert (inputs["expert_map"] == -1).any() and (inputs["expert_map"][inputs["topk_ids"].long()] == -1).any()


@pytest.mark.parametrize("t", [2, 8])
def test_experts_repeated_across_tokens(t):
    """Every token picks from the same three experts of seven (in different orders), and
    token 0's choices are another token's reversed: each expert is read by many pairs."""
    case = _case(t, h=104, i=56, act="swiglu_oai", bias=True, e=7, k=3)
    inputs = cases.make_inputs(case, DEVICE, seed=5)
    hot = torch.tensor([4, 1, 6], dtype=torch.int32, device=DEVICE)
    inputs["topk_ids"] = torch.stack([hot.roll(j) for j in range(t)])
    inputs["topk_ids"][0] = inputs["topk_ids"][t - 1].flip(0)
    _check(_call(inputs), naive_moe(**inputs), case.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32(dtype):
    case = _case(3, h=96, i=64, act="swiglu_oai", bias=True, emap=True, dtype=dtype, e=6, k=4)
    inputs = cases.make_inputs(case, DEVICE, seed=4)
    out = _call(inputs)
    assert out.dtype == dtype
    _check(out, naive_moe(**inputs), dtype)


def test_bias_dtypes_swapped():
    """``w13_bias`` in x's dtype and ``w2_bias`` float32 (the cases draw the other way round)."""
    case = _case(4, h=80, i=48, act="silu", bias=True, e=5, k=2)
    inputs = cases.make_inputs(case, DEVICE, seed=8)
    inputs["w13_bias"] = inputs["w13_bias"].to(case.dtype)
    inputs["w2_bias"] = inputs["w2_bias"].float()
    _check(_call(inputs), naive_moe(**inputs), case.dtype)


TILE_OVERRIDES = [
    (gemv.GemvTile(64, 64, 4), gemv.GemvTile(64, 64, 4)),  # row tails (N = 96 / 160), 64-value steps
    (gemv.GemvTile(16, 16, 2), gemv.GemvTile(8, 32, 2)),  # many short steps; K tails (160 % 32, 96 % 32 = 0)
    (gemv.GemvTile(8, 512, 8), gemv.GemvTile(32, 512, 8)),  # one step, mostly masked
    (gemv.GemvTile(32, 32, 4), gemv.GemvTile(4, 32, 1)),  # EVEN_K in both layers (160 and 96 % 32 == 0)
]


@pytest.mark.parametrize("tiles", TILE_OVERRIDES, ids=lambda t: f"n{t[0].block_n}k{t[0].block_k}-n{t[1].block_n}")
def test_other_tiles(tiles):
    case = _case(3, h=160, i=96, act="swiglu_oai", bias=True, emap=True, e=6, k=3)
    inputs = cases.make_inputs(case, DEVICE, seed=9)
    out = torch.full_like(inputs["x"], float("nan"))
    gemv.gemv_moe(MoEApplyArgs(**inputs, out=out), tiles=tiles)
    _check(out, naive_moe(**inputs), case.dtype)


def test_tiles_table():
    for vendor in ("cuda", "rocm", "cpu"):
        rows = gemv.TILES["plain"]["rocm" if vendor == "rocm" else "cuda"]
        assert [r.max_tokens for r in rows] == sorted(r.max_tokens for r in rows)
        assert rows[-1].max_tokens == gemv.MAX_TOKENS
        for t in range(1, 10):
            t13, t2 = gemv.pick_gemv_tiles(vendor, 4, t, "plain")
            for tile in (t13, t2):
                assert tile.block_k & (tile.block_k - 1) == 0 and tile.block_n & (tile.block_n - 1) == 0
        assert gemv.pick_gemv_tiles(vendor, 4, 9, "plain") == gemv.pick_gemv_tiles(vendor, 4, 8, "plain")


@pytest.mark.parametrize("kernel, fmt", [(NAME, "plain"), ("triton_moe_gemv_mx", "mxfp4")])
def test_all_choices_remote_give_zero_rows_and_the_call_is_deterministic(kernel, fmt):
    case = gemv_case(fmt, 3, act="swiglu_oai", bias=True, emap=True)
    inputs = cases.make_inputs(case, DEVICE, seed=2)
    remote = int((inputs["expert_map"] == -1).nonzero()[0])
    inputs["topk_ids"][1] = remote  # token 1: every choice off this rank (no bias either)
    first = call_override(inputs, kernel)
    assert torch.equal(first[1], torch.zeros_like(first[1]))
    _check(first, naive_moe(**inputs), case.dtype)
    assert torch.equal(call_override(inputs, kernel), first), "two calls must be bit-identical"


# ---------------------------------------------------------------- plans and runners


@pytest.mark.parametrize("name", ["swiglu_bias_map", "gelu_odd"])
def test_plan_runs_bound_per_token_count_equal_the_functional_call(name):
    """``moe_plan(override=)``: fresh inputs every call (the plan's weights), outputs poisoned;
    each planned call matches float64 and equals ``moe_apply(override=)`` bit for bit (above
    8 tokens: ``triton_fused_moe``'s). Counts up to 8 are bound by ``bind_gemv`` (its runner
    reused on a repeat), 11 by ``triton_fused_moe``'s bind, and 70 (above its 64) by nothing:
    ``fn`` serves it, handing the call to ``triton_fused_moe``."""
    base = {
        "swiglu_bias_map": _case(1, h=96, i=40, act="swiglu_oai", bias=True, emap=True, e=10, k=4),
        "gelu_odd": _case(1, h=136, i=72, act="gelu", bias=True, e=7, k=3),
    }[name]
    weights = {k: v for k, v in cases.make_inputs(base, DEVICE, seed=1).items() if k in WEIGHT_KEYS}
    plan = _plan({**cases.make_inputs(base, DEVICE, seed=1), **weights}, override=NAME)
    assert plan.kernel == NAME and plan.prepared is None
    counts = (1, 5, 1, 8, 3, 5, 11, 70)
    runners = {}
    for seed, num_tokens in enumerate(counts):
        step = cases.make_inputs(dataclasses.replace(base, num_tokens=num_tokens), DEVICE, seed=20 + seed)
        step.update(weights)
        out = torch.full_like(step["x"], float("nan"))
        planned = plan.apply(step["x"], step["topk_weights"], step["topk_ids"], out=out)
        assert planned is out
        _check(planned, naive_moe(**step), base.dtype)
        if num_tokens <= gemv.MAX_TOKENS:
            functional = _call(step)
        else:  # moe_apply refuses the override above 8 tokens; the plan hands them on
            functional = moe_apply(**step, override="triton_fused_moe")
        assert torch.equal(planned, functional), f"T={num_tokens}: the bound run differs from the functional call"
        runners.setdefault(num_tokens, plan.runners[num_tokens])
        assert plan.runners[num_tokens] is runners[num_tokens], "a count is bound once"
    assert set(plan.runners) == set(counts)
    assert all(plan.runners[t] is not None for t in (1, 3, 5, 8, 11)) and plan.runners[70] is None


def _args(case: MoECase, seed: int) -> MoEApplyArgs:
    inputs = cases.make_inputs(case, DEVICE, seed=seed)
    return MoEApplyArgs(**inputs, out=torch.full_like(inputs["x"], float("nan")))


def _tensors(args: MoEApplyArgs) -> list:
    found = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, MXFP4Weight):
            found += [value.packed, value.scales]
        elif isinstance(value, torch.Tensor):
            found.append(value)
    return found


RUNNER_CASES = {
    "plain": _case(5, h=96, i=40, act="swiglu_oai", bias=True, emap=True, e=6, k=3),
    "plain_nobias": _case(2, h=72, i=48, act="silu", e=5, k=2),
    "mxfp4": dataclasses.replace(
        _case(3, h=64, i=64, act="swiglu_oai", bias=True, emap=True), weight_format="mxfp4", name="mx"
    ),
}


def _grid3(launches: list) -> list:
    """Recorded launches with 3-D grids (a plan's ``BoundLaunch`` pads its grid)."""
    return [(name, (*grid, 1, 1)[:3], args, kw) for name, grid, args, kw in launches]


@CPU_ONLY
@pytest.mark.parametrize("name", list(RUNNER_CASES))
def test_runners_launch_what_the_uncached_call_launches(monkeypatch, name):
    """The functional runner (three "layers" of one key: one bind) and the plan's bound runner
    (bound at layer 0, run at each layer with that layer's x, routing and out; the layer-0
    weights) each launch the two kernels with the same grids, constexprs, scalars and the
    call's tensors at the same positions as the uncached ``gemv_moe`` (recorded, nothing run)."""
    case = RUNNER_CASES[name]
    kernel = "triton_moe_gemv_mx" if case.weight_format == "mxfp4" else NAME
    rec = Recorder().install(monkeypatch)
    cache = gemv._RUNNERS[kernel]
    binds = cache.binds
    first = _args(case, seed=0)
    bound = gemv.bind_gemv(first)
    for layer in range(3):
        args = _args(case, seed=layer)
        start = len(rec.launches)
        get_kernel(kernel).fn(args)
        functional = rec.since(start)
        gemv.gemv_moe(args)
        fresh = rec.since(start + 2)
        assert [c[0] for c in functional] == ["gemv_w13_kernel", "gemv_w2_kernel"]
        assert_same_launches(functional, fresh, _tensors(args))
        step = dataclasses.replace(first, **{k: getattr(args, k) for k in ("x", "topk_weights", "topk_ids", "out")})
        start = len(rec.launches)
        bound(step)
        planned = rec.since(start)
        gemv.gemv_moe(step)
        assert_same_launches(_grid3(planned), _grid3(rec.since(start + 2)), _tensors(step))
    assert cache.binds == binds + 1, "three layers of one key: one bind"
    assert rec.bound == 2, "the functional runner's two launches, each bound once (the plan's: Launch.bound)"


# ---------------------------------------------------------------- bad inputs


def _bad_calls(inputs: dict) -> list:
    """(description, call, exception type, message) for inputs that must be refused."""
    mx = {"w13": quantize_mxfp4(inputs["w13"].float()), "w2": quantize_mxfp4(inputs["w2"].float())}
    fp8 = {"w13": quantize_fp8(inputs["w13"].float(), "channel"), "w2": quantize_fp8(inputs["w2"].float(), "channel")}
    assert isinstance(mx["w13"], MXFP4Weight) and isinstance(fp8["w13"], FP8Weight)
    nine = {**inputs, "x": inputs["x"].repeat(3, 1)[:9]}
    nine["topk_weights"], nine["topk_ids"] = _routing(9, 8, 2, seed=1)
    x = inputs["x"]
    return [
        ("mxfp4 weights", {**inputs, **mx}, KernelOverrideError, "weight dtype uint8 not in"),
        ("fp8 weights", {**inputs, **fp8}, KernelOverrideError, "weight dtype float8_e4m3fn not in"),
        ("9 tokens", nine, KernelOverrideError, "T <= 8"),
        ("weights in another dtype", {**inputs, "w13": inputs["w13"].half()}, TypeError, "w13 must be in x's dtype"),
        ("int64 ids", {**inputs, "topk_ids": inputs["topk_ids"].long()}, TypeError, "topk_ids"),
        ("w2 shape", {**inputs, "w2": inputs["w2"][:, :, :-1].contiguous()}, ValueError, "w2 must have shape"),
        ("x width", {**inputs, "x": x[:, :-1].contiguous()}, ValueError, "x must have shape"),
        ("strided x", {**inputs, "x": x.t().contiguous().t()}, ValueError, "x must be contiguous"),
        ("bias shape", {**inputs, "w13_bias": torch.zeros(8, 3, device=DEVICE)}, ValueError, "w13_bias"),
        ("activation", {**inputs, "activation": "relu"}, ValueError, "activation"),
        ("out aliasing x", {**inputs, "out": x}, ValueError, "out must not alias x"),
    ]


def test_bad_inputs_raise_before_any_launch(monkeypatch):
    case = _case(4, h=64, i=32, act="silu", bias=True)
    inputs = cases.make_inputs(case, DEVICE, seed=0)
    rec = Recorder().install(monkeypatch)
    moe_apply(**inputs, override=NAME)  # a good call first: its key is remembered
    assert len(rec.launches) == 2
    for what, bad, error, message in _bad_calls(inputs):
        with pytest.raises(error, match=message):
            moe_apply(**bad, override=NAME)
        assert len(rec.launches) == 2, f"{what}: launched before raising"
    plan = _plan(inputs, override=NAME)
    for what, x, weights, ids, error, message in (
        ("top_k", inputs["x"], *_routing(4, 8, 3, seed=2), ValueError, "the plan's top_k"),
        ("x dtype", inputs["x"].half(), inputs["topk_weights"], inputs["topk_ids"], TypeError, "the plan's dtype"),
    ):
        with pytest.raises(error, match=message):
            plan.apply(x, weights, ids)
        assert len(rec.launches) == 2, f"plan {what}: launched before raising"
    with pytest.raises(TypeError, match="not FP8Weight"):
        fp8 = quantize_fp8(inputs["w13"].float(), "channel"), quantize_fp8(inputs["w2"].float(), "channel")
        gemv.gemv_moe(MoEApplyArgs(**{**inputs, "w13": fp8[0], "w2": fp8[1]}, out=torch.empty_like(inputs["x"])))
    assert len(rec.launches) == 2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU form: the interpreter serves cpu")
def test_check_tool_derived_cases_pass():
    """``tokenspeed-kernel check moe.apply --kernel triton_moe_gemv`` (the derived cases)."""
    from tokenspeed_kernel.tools.numerics import check

    report = check("moe.apply", kernel=NAME, device="cpu")
    assert report.ok and report.rows and all(r.status == "PASS" for r in report.rows), report.rows


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU form: the interpreter serves cpu")
def test_overhead_device_mode_has_the_plan_row():
    """``tokenspeed-kernel overhead --device cuda`` gives ``MoEPlan.apply`` the rows of
    ``moe_apply`` (its functional call, same inputs), the plan made with ``override=``: here
    (the interpreter's platform) ``MoEPlan.apply (triton_moe_gemv)``, the row issue 19's
    25 µs target is read from on an H200."""
    from tokenspeed_kernel.ops._dispatch import last_kernel
    from tokenspeed_kernel.tools import overhead
    from tokenspeed_kernel.tools.overhead_device import portable_cases

    chosen = [c for c in overhead.cases() if c.name in ("moe_apply", "MoEPlan.apply")]
    rows = {row.name: row for row in portable_cases(chosen, torch.device("cpu"))}
    assert {"moe_apply (triton_moe_gemv)", "MoEPlan.apply (triton_moe_gemv)"} <= set(rows), sorted(rows)
    rows["MoEPlan.apply (triton_moe_gemv)"].make(torch.device("cpu"))()
    assert last_kernel() == NAME


# ---------------------------------------------------------------- GPU

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU form: no CUDA device here")


def _gpu_inputs(tokens: int, hot: int, activation: str, bias: bool, with_map: bool, seed: int, **kw):
    """bf16 weights of 32 global experts (16 local with the map), routing on ``hot`` of them."""
    return awkward_gpu_inputs(tokens, 32, hot, activation, bias, with_map, seed, weights="bf16", **kw)


GPU_CASES = [(t, hot, act, bias, emap) for t in (1, 3, 8, 17) for hot, act, bias, emap in
             ((2, "swiglu_oai", True, True), (16, "silu", False, False), (3, "gelu", True, False))]  # fmt: skip


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c[0]}-hot{c[1]}-{c[2]}{'-bias' * c[3]}{'-map' * c[4]}")
def test_gpu_numerics_and_plan(case):
    """The real kernels (T = 17: the plan hands the count to ``triton_fused_moe``, whose own
    functional call is then the one to match; the selector refuses the GEMV above 8 tokens):
    float64 within tolerance; the plan's bound run (its second call) equals the functional
    call bit for bit."""
    inputs = _gpu_inputs(*case, seed=sum(case[:2]))
    ref = naive_moe(**inputs)
    out = _call(inputs) if case[0] <= gemv.MAX_TOKENS else call_override(inputs, kernel="triton_fused_moe")
    _check(out, ref, torch.bfloat16)
    plan = _plan(inputs, override=NAME)
    for _ in range(2):
        assert torch.equal(plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"]), out)
    assert plan.runners[case[0]] is not None


@GPU
@pytest.mark.gpu
def test_gpu_plan_runs_bound_per_token_count():
    """Counts 1 and 5 bound by ``bind_gemv``, 33 by ``triton_fused_moe``'s bind, 65 by none."""
    check_gpu_bound_runs(NAME, TOL[torch.bfloat16], fused.BIND_MAX_TOKENS, weights="bf16")


@GPU
@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_plan():
    """``plan.apply`` captured in a CUDA graph (T = 4) and replayed after new routing was
    written into the captured tensors equals an eager call with that routing."""
    inputs = _gpu_inputs(4, 3, "swiglu_oai", True, True, seed=7)
    plan = _plan(inputs, override=NAME)
    x, weights, ids = inputs["x"], inputs["topk_weights"], inputs["topk_ids"]
    eager = plan.apply(x, weights, ids).clone()
    graph, captured = capture(lambda: plan.apply(x, weights, ids))
    ids.copy_(ids.flip(0))
    weights.copy_(weights.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    again = plan.apply(x, weights, ids)
    assert torch.equal(captured, again) and not torch.equal(captured, eager)


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8])
def test_gpu_gpt_oss_layer_shape(tokens):
    """GPT-OSS-120B's layer shape (H = I = 2880, swiglu_oai, biases, top-4) over 32 experts."""
    inputs = _gpu_inputs(tokens, 2, "swiglu_oai", True, False, seed=tokens, hidden=2880, inter=2880)
    _check(_call(inputs), naive_moe(**inputs), torch.bfloat16)
