"""``triton_fused_moe_mx_swap`` (MXFP4 weight decoded in registers as the left MMA operand):
registration and gating, the plan's weight layout, and numerics.

- Gating: PERFORMANT on sm_90 only (above ``triton_fused_moe_mx``, below the Gluon MoE decode
  but in the 8-token bucket), never on the CPU (Triton's interpreter) with its reasons,
  MXFP4 + bf16 only; a call without the plan's repacked weights runs ``triton_fused_moe_mx``'s
  layers.
- Layout: the words and scale words decoded with the kernel's own bit operations (mirrored
  in torch) give ``dequantize_mxfp4`` exactly; the bytes stay within 1.05x the MXFP4 bytes at
  GPT-OSS shapes; the plan's one-time scale check.
- CPU numerics: the real kernel under the interpreter (its float32 decode path: the same
  words, masks and shifts, the bf16x2 multiply done in float32) against the float64
  ``support.naive_moe``: gather, swapped tiles, masks, K padding, split-K and the finish
  kernel, both decodes. The GPU path (inline ``mul.rn.bf16x2``, wgmma) is checked by
  :func:`test_gpu_numerics` (CUDA only) and compiled for sm_90 in ``test_aot_compile_moe.py``.
"""

import dataclasses

import pytest
import torch
from support.gpu_moe import awkward_gpu_inputs
from support.launch_recorder import Recorder
from support.moe_checks import (
    GPU_CASES,
    awkward_apply_cases,
    candidate,
    capture,
    check_bound_runs,
    check_gpu_bound_runs,
    check_rel_err,
    gpu_case_id,
    gpu_public_calls,
)
from support.naive_moe import naive_moe

from tokenspeed_kernel import explain
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.quant import MXFP4Weight, dequantize_mxfp4, quantize_mxfp4
from tokenspeed_kernel.registry import Priority, get_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import _config, fused, fused_mx, fused_mx_swap
from tokenspeed_kernel_triton.ops.moe._config import Tile, pick_tile, tiles_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"  # kernels run on CPU tensors under Triton's interpreter only
NAME = "triton_fused_moe_mx_swap"
TOL = 2e-2  # relative Frobenius error: the intermediate is rounded to bf16


# ---------------------------------------------------------------- registration and gating


def test_registration_ranks_above_the_dot_scaled_kernel():
    spec, mx = get_kernel(NAME), get_kernel("triton_fused_moe_mx")
    # PERFORMANT itself: below gluon_moe_mma_sm90 (PERFORMANT + 10, T <= 8) except in the 8-token
    # bucket, where the H100 measured it faster; above the Triton MXFP4 kernels.
    assert spec.priority == Priority.PERFORMANT and spec.priority > mx.priority
    ((shapes, rank),) = spec.rank_rules
    assert dict(shapes) == {"num_tokens_bucket": frozenset({8})} and rank > Priority.PERFORMANT + 10
    assert spec.prepare is fused_mx_swap.prepare_moe_mx_swap and spec.available is None
    assert spec.bind is fused_mx_swap.bind_fused_moe_mx_swap and mx.bind is fused_mx.bind_fused_moe_mx
    assert spec.vendors == {"cuda"} and spec.archs == {"sm_90"} and spec.features == mx.features
    assert spec.graph_safe


def test_without_the_plan_the_registered_kernel_runs_the_dot_scaled_layers(monkeypatch):
    calls = []
    monkeypatch.setattr(fused_mx_swap, "fused_moe_mx", lambda args: calls.append(("mx", args.prepared)))
    monkeypatch.setattr(fused_mx_swap, "fused_moe_mx_swap", lambda args: calls.append(("swap", args.prepared)))
    inputs = cases.make_inputs(awkward_apply_cases()["gpt_oss_like"], "cpu", seed=1)
    prepared = fused_mx_swap.PreparedSwap(None, None)  # only its type is read here
    kernel = get_kernel(NAME).fn
    kernel(MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]), prepared=None))
    kernel(MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]), prepared=prepared))
    assert calls == [("mx", None), ("swap", prepared)]


def test_the_cpu_is_never_served_with_the_reasons():
    """GPU only (inline PTX bf16x2 multiplies; its tests run the kernel under the interpreter
    directly): the CPU platform, with Triton's interpreter or without, is refused by metadata."""
    selection = explain(cases.request(awkward_apply_cases()["gpt_oss_like"]), platform=platform_from_arch("cpu"))
    assert candidate(selection, NAME).reasons == (
        "vendor cpu not in {cuda}",
        "arch cpu not in {sm_90}",
        "platform lacks capabilities {wgmma}",
    )


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_100", "gfx950"])
def test_first_on_sm90_only(arch):
    request = cases.request(awkward_apply_cases()["mxfp4_t33"])  # T = 33: above the Gluon decode's T <= 8
    platform = platform_from_arch(arch)
    selection = explain(request, platform=platform)
    accepted = candidate(selection, NAME).accepted
    assert accepted == (arch == "sm_90") and (selection.winner.name == NAME) == accepted
    if accepted:
        names = [c.spec.name for c in selection.candidates if c.accepted]
        assert names.index(NAME) < names.index("triton_fused_moe_mx")


def test_serves_mxfp4_bf16_only():
    sm90 = platform_from_arch("sm_90")
    by_name = awkward_apply_cases()
    for name, reason in (
        ("plain_t5", "weight dtype bfloat16 not in {uint8}"),
        ("mxfp8_act_t1", "does not support {mxfp8_act}"),
    ):
        reasons = candidate(explain(cases.request(by_name[name]), platform=sm90), NAME).reasons
        assert any(reason in r for r in reasons), (name, reasons)
    fp16 = cases.request(dataclasses.replace(by_name["mxfp4_t1"], dtype=torch.float16))
    assert any("x dtype float16" in r for r in candidate(explain(fp16, platform=sm90), NAME).reasons)


# ---------------------------------------------------------------- the plan's weight layout


def _bf16_bits_as_f64(bits: torch.Tensor) -> torch.Tensor:
    return (bits << 16).to(torch.int32).view(torch.float32).double()


def _decode_like_kernel(op: fused_mx_swap.SwapOperand, k: int) -> torch.Tensor:
    """The values the kernel multiplies, float64 ``[E, N, K]``, from the operand's words and
    scale words through the kernel's bit operations (``_mx_swap_gemm._decode``), in torch."""
    w = op.words.long() & 0xFFFFFFFF
    e, steps, n, _ = w.shape
    place = 0x81C081C0
    slots = [
        w & place,
        (w << 3) & place,
        (w << 6) & place,
        ((w >> 4) & 0x00C000C0) | ((w >> 5) & 0x01000100) | ((w << 1) & 0x80008000),
    ]
    placed = torch.stack(slots, -1)  # [E, S, N, 16 words, 4 slots]
    values = torch.stack([_bf16_bits_as_f64(placed & 0xFFFF), _bf16_bits_as_f64(placed >> 16)], -1) * 2.0**126
    s = op.scales.long() & 0xFFFFFFFF
    groups = torch.stack([(s >> (8 * i)) & 0xFF for i in range(4)], -1)  # [E, S, N, 4]
    factor = torch.where(groups == 255, float("nan"), torch.pow(2.0, (groups - 127).double()))
    values = values.view(e, steps, n, 4, 4, 2, 2, 2) * factor[:, :, :, None, :, None, None, None]  # q i tj h nib
    return values.permute(0, 2, 1, 4, 5, 6, 3, 7).reshape(e, n, steps * 128)[..., :k]


@pytest.mark.parametrize("k", [32, 160, 384, 2880])
def test_words_decode_to_the_public_values(k):
    gen = torch.Generator().manual_seed(k)
    w = quantize_mxfp4(torch.randn(3, 24, k, generator=gen) * torch.rand(3, 24, 1, generator=gen) * 8)
    op = fused_mx_swap.swap_operand(w)
    assert op.words.shape == (3, -(-k // 128), 24, 16) and op.words.dtype == torch.int32 and op.words.is_contiguous()
    assert op.scales.shape == (3, -(-k // 128), 24) and op.scales.is_contiguous()
    assert torch.equal(_decode_like_kernel(op, k), dequantize_mxfp4(w, torch.float64))


def test_every_code_and_scale_survives_the_repack():
    """All 256 bytes at every slot, scales 0 (2**-127), 254 (2**127) and 255 (NaN)."""
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (2, 40, 80), generator=gen, dtype=torch.uint8)
    packed[0, :4].view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    scales = torch.randint(0, 256, (2, 40, 5), generator=gen, dtype=torch.uint8)
    scales[0, 0], scales[0, 1], scales[0, 2] = 0, 254, 255
    w = MXFP4Weight(packed, scales)
    torch.testing.assert_close(
        _decode_like_kernel(fused_mx_swap.swap_operand(w), 160),
        dequantize_mxfp4(w, torch.float64),
        rtol=0,
        atol=0,
        equal_nan=True,
    )


@pytest.mark.parametrize("e, n, k, bound", [(128, 5760, 2880, 1.0223), (128, 2880, 2880, 1.0223), (2, 8, 1920, 1.05)])
def test_repacked_bytes_within_bound(e, n, k, bound):
    """words + scale words over the MXFP4 bytes (packed + scales): ``128 S / K`` (shapes only,
    on the meta device)."""
    w = MXFP4Weight(
        torch.empty(e, n, k // 2, dtype=torch.uint8, device="meta"),
        torch.empty(e, n, k // 32, dtype=torch.uint8, device="meta"),
    )
    words, scales = fused_mx_swap.swap_words(w.packed), fused_mx_swap.swap_scales(w.scales)
    ratio = (words.numel() + scales.numel()) * 4 / (w.packed.numel() + w.scales.numel())
    assert ratio <= bound, ratio


def test_device_built_tables_match_the_documented_layout():
    """The repack builds its tables with device ops (no host copy): they are SLOT_BITS (32
    distinct destination bits) and a permutation of a step's 64 bytes."""
    assert fused_mx_swap._slot_bits(torch.device("cpu")).tolist() == [list(b) for b in fused_mx_swap.SLOT_BITS]
    assert sorted(b for slot in fused_mx_swap.SLOT_BITS for b in slot) == list(range(32))
    assert sorted(fused_mx_swap._word_bytes(torch.device("cpu")).tolist()) == list(range(64))


def test_plan_checks_the_scales_once():
    small = quantize_mxfp4(torch.randn(2, 16, 64))
    big = quantize_mxfp4(torch.randn(2, 16, 64) * 2.0**20)  # scales ~ 2**18: above 2**1
    prepared = fused_mx_swap.prepare_moe_mx_swap(w13=small, w2=big)
    assert not prepared.w13.big_scales and prepared.w2.big_scales
    assert fused_mx_swap.swap_operand(small).big_scales  # the functional path never reads the device


def test_wrong_step_is_rejected_before_any_launch():
    inputs = cases.make_inputs(awkward_apply_cases()["mxfp4_t1"], DEVICE, seed=0)
    args = MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]))
    with pytest.raises(ValueError, match="tile.block_k must be 128"):
        fused_mx_swap.fused_moe_mx_swap(args, tile=Tile(16, 64, 64, 1, 4, 2))
    with pytest.raises(TypeError, match="MXFP4 weights only"):
        fused_mx_swap.swap_operand(inputs["x"])


def test_tile_table_steps_by_128_and_fits_wgmma():
    tiles = tiles_for("cuda", "mxfp4_swap")
    assert tiles and all(t.block_k == 128 and t.block_n % (64 * (t.num_warps // 4)) == 0 for t in tiles)
    assert pick_tile(4 * 4096, 128, "cuda", "mxfp4_swap") == tiles[-1]  # no shrinking by fit_shared
    assert pick_tile(4, 128, "cpu", "mxfp4_swap") == tiles[0]


def test_layer2_tiles_name_a_row_and_keep_its_token_rows():
    """Every layer-2 override names a row of the table and keeps its ``block_m`` (the
    permutation's token tiles serve both layers) and its step; at GPT-OSS's T = 64 (2 rows per
    expert) layer 2 runs 128 weight rows (the H200 sweep), from 16 rows per expert both layers
    share the row's tile; ``tiles_for`` lists each override after its row (the AOT compiles)."""
    rows = {(v, w, bound): tile for v, w, bound, tile in _config._TABLE}
    assert _config._W2_TILES
    for key, w2 in _config._W2_TILES.items():
        assert key in rows and w2.block_m == rows[key].block_m and w2.block_k == rows[key].block_k, (key, w2)
        assert key[1] == "mx_swap", f"{key}: only the swapped kernel reads layer 2's tile"
    t64 = pick_tile(4 * 64, 128, "cuda", "mxfp4_swap")
    assert (t64, pick_tile(4 * 64, 128, "cuda", "mxfp4_swap", layer=2)) == (
        Tile(16, 64, 128, 1, 4, 4),
        Tile(16, 128, 128, 1, 4, 4),
    )
    for tokens in (512, 4096):
        assert pick_tile(4 * tokens, 128, "cuda", "mxfp4_swap", layer=2) == pick_tile(
            4 * tokens, 128, "cuda", "mxfp4_swap"
        )
    assert pick_tile(4, 128, "cuda", "mxfp4_dot", layer=2) == pick_tile(4, 128, "cuda", "mxfp4_dot")  # no override
    assert tiles_for("cuda", "mxfp4_swap")[:2] == (t64, Tile(16, 128, 128, 1, 4, 4))
    assert Tile(16, 128, 128, 1, 4, 4) not in tiles_for("cuda", "mxfp4_swap", w2=False)
    with pytest.raises(ValueError, match="layer must be one of"):
        pick_tile(4, 128, "cuda", "mxfp4_swap", layer=3)


# ---------------------------------------------------------------- CPU numerics (the interpreter)


def _run(inputs, prepared=None, tile=None, splits=None) -> torch.Tensor:
    out = torch.full_like(inputs["x"], float("nan"))
    fused_mx_swap.fused_moe_mx_swap(MoEApplyArgs(**inputs, out=out, prepared=prepared), tile=tile, splits=splits)
    return out


interpreter_only = pytest.mark.skipif(not INTERPRET, reason="runs the kernel under TRITON_INTERPRET=1 (CPU tests)")
SMALL = Tile(16, 64, 128, 1, 4, 1)  # the interpreter's cost grows with the tile

NUMERIC_CASES = {  # name: (awkward case, changes, forced K splits)
    "t1": ("mxfp4_t1", {}, (2,)),
    "gpt_oss_like": ("gpt_oss_like", {}, (2,)),  # swiglu_oai, biases, expert map with -1
    "odd_k_gelu": ("mxfp4_t33", {"num_tokens": 7, "hidden": 160, "intermediate": 96, "activation": "gelu", "bias": True},
                   (3,)),  # K = 160 and 96: padded to 256 and 128
}  # fmt: skip


@interpreter_only
@pytest.mark.parametrize("name", list(NUMERIC_CASES))
def test_kernel_matches_naive_under_the_interpreter(name):
    base, changes, forced = NUMERIC_CASES[name]
    case = dataclasses.replace(awkward_apply_cases()[base], name=name, **changes)
    inputs = cases.make_inputs(case, DEVICE, seed=len(name))
    ref = naive_moe(**inputs)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    assert not plan.w13.big_scales  # the one-multiply decode; the functional path takes the other
    functional = _run(inputs, tile=SMALL)
    check_rel_err(functional, ref, TOL)
    assert torch.equal(_run(inputs, plan, tile=SMALL), functional), "both decodes give the same products"
    for splits in forced:  # split-K: partial buffer + finish kernel (w13), per-split rows (w2)
        check_rel_err(_run(inputs, plan, tile=SMALL, splits=splits), ref, TOL)


@interpreter_only
def test_large_scales_under_the_interpreter():
    """Weights scaled by 2**40: every E8M0 scale above 128, the plan's two-multiply decode."""
    case = dataclasses.replace(awkward_apply_cases()["gpt_oss_like"], name="big", num_tokens=5)
    inputs = cases.make_inputs(case, DEVICE, seed=4)
    for key in ("w13", "w2"):
        w = inputs[key]
        inputs[key] = MXFP4Weight(w.packed, (w.scales.int() + 40).clamp(max=254).to(torch.uint8))
    inputs["x"] = inputs["x"] * 2.0**-40
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    assert plan.w13.big_scales and plan.w2.big_scales
    check_rel_err(_run(inputs, plan, tile=SMALL), naive_moe(**inputs), TOL)


@interpreter_only
def test_every_tile_of_the_table_under_the_interpreter():
    case = dataclasses.replace(
        awkward_apply_cases()["gpt_oss_like"], num_tokens=9, hidden=160, intermediate=64, name="tiles"
    )
    inputs = cases.make_inputs(case, DEVICE, seed=3)
    ref = naive_moe(**inputs)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    for tile in tiles_for("cuda", "mxfp4_swap"):
        check_rel_err(_run(inputs, plan, tile=dataclasses.replace(tile, num_stages=1)), ref, TOL)


@interpreter_only
@pytest.mark.parametrize("name", ["gpt_oss_like", "odd_k_gelu"])
def test_bound_runs_match_the_functional_path_under_the_interpreter(name):
    """``bind_fused_moe_mx_swap`` on the plan's weights, one runner per token count: T = 1 and
    33 with both layers split (forced; the finish kernel), T = 5 unsplit (the rule at this K);
    each run equals :func:`fused_moe_mx_swap` bit for bit and matches float64."""
    base, changes, _ = NUMERIC_CASES[name]
    case = dataclasses.replace(awkward_apply_cases()[base], name=name, **changes)
    check_bound_runs(
        case,
        fused_mx_swap.prepare_moe_mx_swap,
        fused_mx_swap.bind_fused_moe_mx_swap,
        fused_mx_swap.fused_moe_mx_swap,
        TOL,
        DEVICE,
        tile=SMALL,
    )


def _gemm_tiles(launches: list) -> list[tuple[int, int, int]]:
    """(BLOCK_M, BLOCK_N, programs along the grid's first axis) of each recorded swapped-GEMM
    launch, in order."""
    return [
        (kw["BLOCK_M"], kw["BLOCK_N"], grid[0]) for name, grid, _, kw in launches if name == "moe_mx_swap_gemm_kernel"
    ]


@interpreter_only
def test_layer2_gets_its_own_tile_at_decode_rows_under_the_interpreter(monkeypatch):
    """At <= 4 rows per expert (T = 9, top-2 of 8 experts: 2.25) the table gives layer 2 its own
    tile (16 x 128) while layer 1 keeps 16 x 64, on the functional path and in a bound runner
    (recorded launches: layer 2's grid has cdiv(H, 128) weight tiles per token tile); at 17
    tokens (4.25 rows) both layers share the row's tile. Outputs: bitwise the shared 16 x 64
    tile's (each element the same K loop over the same products) and within the float64
    reference's tolerance, bound or not."""
    case = dataclasses.replace(
        awkward_apply_cases()["gpt_oss_like"], num_tokens=9, hidden=160, intermediate=64, expert_map=False, name="w2"
    )
    inputs = cases.make_inputs(case, DEVICE, seed=11)
    assert inputs["w13"].shape[0] == 8
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    shipped, shared = _run(inputs, plan), _run(inputs, plan, tile=Tile(16, 64, 128, 1, 4, 4))
    check_rel_err(shipped, naive_moe(**inputs), TOL)
    assert torch.equal(shipped, shared), "layer 2's own tile changes no bit"
    args = MoEApplyArgs(**inputs, out=torch.full_like(inputs["x"], float("nan")), prepared=plan)
    runner = fused_mx_swap.bind_fused_moe_mx_swap(args)
    runner(args)
    assert torch.equal(args.out, shipped), "the bound runner runs the same launches"

    recorder = Recorder().install(monkeypatch)
    fused_mx_swap.fused_moe_mx_swap(args)
    functional = _gemm_tiles(recorder.since(0))
    start = len(recorder.launches)
    fused_mx_swap.bind_fused_moe_mx_swap(args)(args)
    bound = _gemm_tiles(recorder.since(start))
    (m1, n1, programs1), (m2, n2, programs2) = functional
    assert (m1, n1, m2, n2) == (16, 64, 16, 128) and bound == functional
    # layer 1: N = 64 (the intermediate), one weight tile per token tile; layer 2: cdiv(160, 128)
    assert programs2 == 2 * programs1, (programs1, programs2)
    start = len(recorder.launches)
    more = cases.make_inputs(dataclasses.replace(case, num_tokens=17), DEVICE, seed=12)
    fused_mx_swap.fused_moe_mx_swap(MoEApplyArgs(**more, out=torch.empty_like(more["x"]), prepared=plan))
    assert [t[:2] for t in _gemm_tiles(recorder.since(start))] == [(32, 128), (32, 128)]


def test_layer2_tile_must_keep_the_token_rows():
    """``w2_tile`` with another ``block_m``, or another step, is refused before any launch, on
    both paths; a given ``tile`` without ``w2_tile`` serves both layers."""
    inputs = cases.make_inputs(awkward_apply_cases()["gpt_oss_like"], "cpu", seed=0)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    args = MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]), prepared=plan)
    for run in (fused_mx_swap.fused_moe_mx_swap, fused_mx_swap.bind_fused_moe_mx_swap):
        with pytest.raises(ValueError, match="w2_tile.block_m must be"):
            run(args, tile=Tile(32, 128, 128, 8, 4, 4), w2_tile=Tile(16, 128, 128, 1, 4, 4))
        with pytest.raises(ValueError, match="tile.block_k must be 128"):
            run(args, w2_tile=Tile(32, 128, 64, 8, 4, 4))
        with pytest.raises(TypeError, match="w2_tile must be a Tile"):
            run(args, w2_tile=(32, 128, 128, 8, 4, 4))
    assert fused_mx_swap._swap_tiles(args, Tile(32, 64, 128, 8, 4, 4), None) == (Tile(32, 64, 128, 8, 4, 4),) * 2


@pytest.mark.parametrize("kernel", ["swap", "dot_scaled"])
def test_bind_leaves_to_fn(kernel):
    """No runner (``fn`` serves) above BIND_MAX_TOKENS, with ``activation_quant``, and for the
    swapped kernel without the plan's repacked weights (``fn`` runs the dot_scaled layers)."""
    bind, prepare = {
        "swap": (fused_mx_swap.bind_fused_moe_mx_swap, fused_mx_swap.prepare_moe_mx_swap),
        "dot_scaled": (fused_mx.bind_fused_moe_mx, fused_mx.prepare_moe_mx),
    }[kernel]
    base = awkward_apply_cases()["gpt_oss_like"]
    small = cases.make_inputs(base, "cpu", seed=0)
    large = cases.make_inputs(dataclasses.replace(base, num_tokens=fused.BIND_MAX_TOKENS + 1), "cpu", seed=0)
    prepared = prepare(w13=small["w13"], w2=small["w2"])
    assert bind(MoEApplyArgs(**large, out=torch.empty_like(large["x"]), prepared=prepared)) is None
    quant = MoEApplyArgs(**small, out=torch.empty_like(small["x"]), prepared=prepared, activation_quant="fp8")
    assert bind(quant) is None
    if kernel == "swap":
        assert bind(MoEApplyArgs(**small, out=torch.empty_like(small["x"]), prepared=None)) is None


# ---------------------------------------------------------------- GPU numerics


SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not SM90, reason="GPU numerics: needs an sm_90 device (inline PTX bf16x2 multiplies, wgmma)")
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_gpu_numerics(case):
    """Functional path (repacked per call, two-multiply decode) through ``moe_apply``, then the
    plan (one-multiply decode), every table tile and forced splits, against float64."""
    inputs, ref, _, plan = gpu_public_calls(case, NAME, TOL)
    check_rel_err(plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"]), ref, TOL)
    for tile in tiles_for("cuda", "mxfp4_swap"):
        check_rel_err(_run(inputs, plan.prepared, tile=tile), ref, TOL)
    for splits in (2, 4):
        check_rel_err(_run(inputs, plan.prepared, splits=splits), ref, TOL)


@pytest.mark.skipif(not SM90, reason="CUDA-graph capture: needs an sm_90 device")
@pytest.mark.parametrize("planned", [False, True], ids=["functional", "plan"])
def test_cuda_graph_capture_matches_eager(planned):
    inputs = awkward_gpu_inputs(33, 32, 3, "swiglu_oai", True, False, seed=7)
    prepared = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"]) if planned else None
    out = torch.empty_like(inputs["x"])

    def step():
        fused_mx_swap.fused_moe_mx_swap(MoEApplyArgs(**inputs, out=out, prepared=prepared))
        return out.clone()

    eager = step()
    graph, captured = capture(step)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)


@pytest.mark.skipif(not SM90, reason="bound plan runs: needs an sm_90 device (inline PTX bf16x2 multiplies, wgmma)")
def test_gpu_plan_runs_bound_per_token_count():
    check_gpu_bound_runs(NAME, TOL, fused.BIND_MAX_TOKENS)
