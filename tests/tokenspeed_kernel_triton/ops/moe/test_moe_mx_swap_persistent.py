"""``triton_fused_moe_mx_swap_persistent`` (the swapped MXFP4 MoE with persistent grouped GEMMs):
registration, schedules and their checks, and numerics.

- Gating: ``Priority.OPT_IN``, ranked above the swapped kernel from the 4096-token bucket up
  (where a GPU run measured it faster), sm_90 only like the swapped kernel, the same plan hook.
- Schedules: the table, the tail dropped at tiles it does not fit, bad schedules, tiles and
  splits refused before any launch; the grid.
- CPU numerics: the real kernel under the interpreter (the swapped kernel's float32 decode
  path) against the float64 ``naive_moe`` and against ``triton_fused_moe_mx_swap`` on the same
  plan, on routings built to hit every shape of the work list: experts with no pair, with
  exactly a tail, with a tail of one row, with full tiles only, with full tiles and a tail;
  T not a multiple of the tile, N not a multiple of the weight tile, K padded; static and
  dynamic schedules with fewer programs than work items and more; an expert map with remote
  experts; both decodes; bound runs. The GPU path (inline PTX, wgmma) is compiled for sm_90 in
  ``test_aot_compile_moe.py`` and checked by the GPU tests here (CUDA only).
"""

import dataclasses

import pytest
import torch
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
from tokenspeed_kernel.quant import MXFP4Weight
from tokenspeed_kernel.registry import Priority, get_kernel
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import fused, fused_mx_swap
from tokenspeed_kernel_triton.ops.moe import fused_mx_swap_persistent as persistent
from tokenspeed_kernel_triton.ops.moe._config import Schedule, Tile, pick_schedule, pick_tile, tiles_for
from tokenspeed_kernel_triton.ops.moe._routing import Routing, max_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"
NAME = "triton_fused_moe_mx_swap_persistent"
SWAP = "triton_fused_moe_mx_swap"
TOL = 2e-2  # relative Frobenius error: the intermediate is rounded to bf16


# ---------------------------------------------------------------- registration and gating


def test_registration_is_opt_in_with_the_swapped_kernels_metadata():
    spec, swap = get_kernel(NAME), get_kernel(SWAP)
    assert spec.priority == Priority.OPT_IN
    buckets = {persistent.RANKED_FROM_TOKENS << i for i in range(6)}
    ((shapes, rank),) = spec.rank_rules
    assert dict(shapes) == {"num_tokens_bucket": frozenset(buckets)} and min(buckets) == 4096
    assert rank > swap.priority and all(4096 not in dict(s).get("num_tokens_bucket", ()) for s, _ in swap.rank_rules)
    assert spec.prepare is swap.prepare is fused_mx_swap.prepare_moe_mx_swap
    assert spec.bind is persistent.bind_fused_moe_mx_swap_persistent
    assert (spec.vendors, spec.archs, spec.features, spec.dtypes) == (
        swap.vendors,
        swap.archs,
        swap.features,
        swap.dtypes,
    )
    assert spec.graph_safe


@pytest.mark.parametrize("case", ["mxfp4_t33", "gpt_oss_like"])
@pytest.mark.parametrize("bucket", [None, 2048, 4096, 8192])
def test_chosen_over_the_swapped_kernel_from_4096_tokens_only(case, bucket):
    """Accepted on sm_90 (an override picks it at any size); first from the 4096-token bucket,
    below the swapped kernel under it (None: the case's own, small, bucket)."""
    request = cases.request(awkward_apply_cases()[case])
    if bucket is not None:
        shapes = {**dict(request.shapes), "num_tokens_bucket": bucket}
        request = dataclasses.replace(request, shapes=tuple(sorted(shapes.items())))
    selection = explain(request, platform=platform_from_arch("sm_90"))
    names = [c.spec.name for c in selection.candidates if c.accepted]
    first = bucket is not None and bucket >= 4096
    assert NAME in names and (selection.winner.name == NAME) == first
    assert (names.index(NAME) < names.index(SWAP)) == first


def test_the_cpu_is_never_served_with_the_reasons():
    selection = explain(cases.request(awkward_apply_cases()["gpt_oss_like"]), platform=platform_from_arch("cpu"))
    assert candidate(selection, NAME).reasons == (
        "vendor cpu not in {cuda}",
        "arch cpu not in {sm_90}",
        "platform lacks capabilities {wgmma}",
    )


def test_without_the_plan_the_registered_kernel_runs_the_dot_scaled_layers(monkeypatch):
    calls = []
    monkeypatch.setattr(persistent, "fused_moe_mx", lambda args: calls.append(("mx", args.prepared)))
    monkeypatch.setattr(persistent, "fused_moe_mx_swap_persistent", lambda args: calls.append(("p", args.prepared)))
    inputs = cases.make_inputs(awkward_apply_cases()["gpt_oss_like"], "cpu", seed=1)
    prepared = fused_mx_swap.PreparedSwap(None, None)  # only its type is read here
    for given in (None, prepared):
        get_kernel(NAME).fn(MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]), prepared=given))
    assert calls == [("mx", None), ("p", prepared)]


# ---------------------------------------------------------------- schedules


def test_schedule_table():
    """At the GPT-OSS regimes (128 experts, top-4): tails at the 64- and 128-row tiles (T = 2048,
    4096), none where the 32-row tiles would spill or the tile is 16 rows; the dynamic counter
    where there are tails (items of unequal cost); as many programs per SM as the table's tile
    fits at once (3, 2, then 1)."""
    expected = {1: (0, 3), 64: (0, 3), 512: (0, 2), 1024: (0, 2), 2048: (32, 1), 4096: (32, 1)}
    for tokens, (tail, per_sm) in expected.items():
        tile = pick_tile(4 * tokens, 128, "cuda", "mxfp4_swap")
        schedule = pick_schedule(4 * tokens, 128, tile)
        assert (schedule.tail_m, schedule.dynamic, schedule.programs_per_sm) == (tail, tail > 0, per_sm), tokens
        persistent.check_schedule(schedule, tile)
    assert pick_schedule(4 * 4096, 128, Tile(32, 128, 128, 8, 4, 4)).tail_m == 0  # the tail must be below block_m


@pytest.mark.parametrize(
    "schedule, message",
    [
        (Schedule(tail_m=8), "tail_m must be 0 or a power of two"),
        (Schedule(tail_m=24), "tail_m must be 0 or a power of two"),
        (Schedule(tail_m=32), "tail_m must be 0 or a power of two"),  # the tile below has 32 rows
        (Schedule(programs_per_sm=0), "programs_per_sm must be >= 1"),
        (Schedule(programs=0), "programs must be None or >= 1"),
    ],
)
def test_bad_schedules_are_refused_before_any_launch(monkeypatch, schedule, message):
    monkeypatch.setattr(persistent, "moe_mx_swap_persistent_kernel", None)  # a launch would fail differently
    inputs = cases.make_inputs(awkward_apply_cases()["mxfp4_t1"], DEVICE, seed=0)
    args = MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]))
    with pytest.raises(ValueError, match=message):
        persistent.fused_moe_mx_swap_persistent(args, tile=Tile(32, 64, 128, 1, 4, 2), schedule=schedule)


def test_bad_tiles_splits_and_schedule_types_are_refused(monkeypatch):
    monkeypatch.setattr(persistent, "moe_mx_swap_persistent_kernel", None)
    inputs = cases.make_inputs(awkward_apply_cases()["mxfp4_t1"], DEVICE, seed=0)
    args = MoEApplyArgs(**inputs, out=torch.empty_like(inputs["x"]))
    with pytest.raises(ValueError, match="tile.block_k must be 128"):
        persistent.fused_moe_mx_swap_persistent(args, tile=Tile(16, 64, 64, 1, 4, 2))
    with pytest.raises(ValueError, match="splits must be None or 1"):
        persistent.fused_moe_mx_swap_persistent(args, splits=2)
    with pytest.raises(TypeError, match="schedule must be a Schedule"):
        persistent.fused_moe_mx_swap_persistent(args, schedule=(1, 32, True))


def test_grid_is_programs_per_sm_times_the_sms_at_most_the_work_items():
    tile = Tile(128, 128, 128, 8, 8, 3)
    routing = Routing(None, None, None, max_tiles(4 * 4096, 128, 128), 4 * 4096, None, None)
    cpu = torch.device("cpu")  # off the GPU the SM count is an H100's
    assert persistent.persistent_grid(routing, 2880, tile, Schedule(), cpu) == 132
    assert persistent.persistent_grid(routing, 2880, tile, Schedule(programs_per_sm=2), cpu) == 264
    assert persistent.persistent_grid(routing, 2880, tile, Schedule(programs=7), cpu) == 7
    one = Routing(None, None, None, max_tiles(1, 128, 16), 1, None, None)  # one token, top-1: 1 tile x 45
    assert persistent.persistent_grid(one, 2880, Tile(16, 64, 128, 1, 4, 4), Schedule(), cpu) == 45


# ---------------------------------------------------------------- CPU numerics (the interpreter)


interpreter_only = pytest.mark.skipif(not INTERPRET, reason="runs the kernel under TRITON_INTERPRET=1 (CPU tests)")
TILE = Tile(32, 64, 128, 1, 4, 1)  # small for the interpreter; tails of 16 rows
# Pairs per expert, top-2: no pair (0, 7), exactly a tail (16), a tail of one row (1), one full
# tile (17, 32: 17 is above the tail), full tiles only (64), full tiles and a tail (40, 33):
# 11 token tiles of 32 rows, 5 of them tails; T = 102 tokens (not a multiple of 32).
LOADS = (0, 40, 16, 17, 64, 1, 33, 0, 32, 1)
SCHEDULES = {
    "static-fewer": Schedule(tail_m=0, dynamic=False, programs=3),
    "static-tail-more": Schedule(tail_m=16, dynamic=False, programs=1000),
    "dynamic-tail-fewer": Schedule(tail_m=16, dynamic=True, programs=5),
    "dynamic-more": Schedule(tail_m=0, dynamic=True, programs=1000),
    "static-fewer-tma": Schedule(tail_m=0, dynamic=False, programs=3, w2_tma=True),
    "dynamic-tail-fewer-tma": Schedule(tail_m=16, dynamic=True, programs=5, w2_tma=True),
}


def _routed(loads: tuple[int, ...], top_k: int) -> torch.Tensor:
    """topk_ids int32 ``[T, top_k]`` that give expert ``e`` exactly ``loads[e]`` pairs
    (``T = sum / top_k``; every load at most T): the pairs sorted by expert, token ``t`` takes
    entries ``t, t + T, ...`` (distinct experts per token)."""
    flat = torch.repeat_interleave(torch.arange(len(loads)), torch.tensor(loads))
    return flat.view(top_k, -1).t().contiguous().int()


def _ragged_inputs(activation: str = "swiglu_oai", seed: int = 0) -> dict:
    ids = _routed(LOADS, 2)
    case = cases.MoECase(
        "moe.apply", ids.shape[0], 160, 96, len(LOADS), 2, weight_format="mxfp4", activation=activation, bias=True
    )  # K = 160 and 96 (padded to 256 and 128), N = 96 and 160 (2 and 3 weight tiles of 64)
    inputs = cases.make_inputs(case, DEVICE, seed=seed)
    inputs["topk_ids"] = ids.to(DEVICE)
    return inputs


def _run(fn, inputs, prepared, **options) -> torch.Tensor:
    out = torch.full_like(inputs["x"], float("nan"))
    fn(MoEApplyArgs(**inputs, out=out, prepared=prepared), **options)
    return out


def _agree_to_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to a few bf16 roundings (a tail tile's narrower dot may sum in another order
    under the interpreter's float32 matmul)."""
    scale = float(expected.abs().max()) + 1e-30
    assert float((got.float() - expected.float()).abs().max()) <= 2.0**-6 * scale


def test_routed_loads_are_what_the_test_says():
    ids = _routed(LOADS, 2)
    assert ids.shape == (102, 2) and all(len(set(row.tolist())) == 2 for row in ids)
    assert torch.bincount(ids.flatten().long(), minlength=len(LOADS)).tolist() == list(LOADS)
    tails = [load % 32 for load in LOADS if 0 < load % 32 <= 16]
    assert sum(-(-load // 32) for load in LOADS) == 11 and len(tails) == 5


@interpreter_only
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_ragged_loads_match_float64_and_the_swapped_kernel(name):
    """Every schedule on the designed routing: float64 within tolerance, the swapped kernel's
    output on the same plan bit for bit without tails, to bf16 rounding with them."""
    inputs = _ragged_inputs(seed=len(name))
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    schedule = SCHEDULES[name]
    got = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan, tile=TILE, schedule=schedule)
    check_rel_err(got, naive_moe(**inputs), TOL)
    swap = _run(fused_mx_swap.fused_moe_mx_swap, inputs, plan, tile=TILE, splits=1)
    if schedule.tail_m:
        _agree_to_bf16(got, swap)
    else:
        assert torch.equal(got, swap)


@interpreter_only
def test_layer2_tma_loads_give_the_pointer_loads_bits():
    """``Schedule.w2_tma``: layer 2's full token tiles read the intermediate through a TMA
    descriptor (its padding slots' rows as they are, K past the end as zeros) and give the
    pointer loads' output bit for bit, with and without tails; layer 1 is unchanged."""
    inputs = _ragged_inputs(seed=11)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    for schedule in (Schedule(tail_m=16, programs=5), Schedule(tail_m=0, dynamic=False, programs=1000)):
        pointers = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan, tile=TILE, schedule=schedule)
        tma = dataclasses.replace(schedule, w2_tma=True)
        got = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan, tile=TILE, schedule=tma)
        assert torch.equal(got, pointers), schedule


def test_layer2_tma_launch_carries_a_descriptor_for_layer_2_only(monkeypatch):
    """The launch builder: layer 2 gets ``A_TMA`` and a ``[block_m, 128]`` descriptor of the
    intermediate (keyword arguments), layer 1 and the default schedule neither."""
    launches = []
    monkeypatch.setattr(persistent, "Launch", lambda fn, grid, args, kwargs: launches.append(kwargs))
    inputs = _ragged_inputs(seed=1)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    routing = Routing(*[None] * 3, 11, 204, None, None)
    h = torch.zeros((11 * TILE.block_m, 96), dtype=torch.bfloat16)
    for gated, a, op in ((True, inputs["x"], plan.w13), (False, h, plan.w2)):
        for w2_tma in (False, True):
            persistent._persistent_launch(
                a, op, None, routing, inputs["topk_weights"], h, n=96, k=a.shape[1], top_k=2, tile=TILE, gated=gated,
                activation="swiglu_oai", splits=1, k_split=a.shape[1], schedule=Schedule(w2_tma=w2_tma),
            )  # fmt: skip
    assert ["A_TMA" in kwargs for kwargs in launches] == [False, False, False, True]
    descriptor = launches[-1]["A_desc"]
    assert launches[-1]["A_TMA"] is True and descriptor.base is h
    assert (list(descriptor.shape), list(descriptor.block_shape)) == ([11 * TILE.block_m, 96], [TILE.block_m, 128])


@interpreter_only
@pytest.mark.parametrize("base", ["gpt_oss_like", "mxfp4_t33"])
def test_awkward_cases_under_the_interpreter(base):
    """The awkward preset's cases (``gpt_oss_like``: an expert map with remote experts,
    swiglu_oai, biases), the default schedule and a tail one, with the plan's one-multiply
    decode and the functional path's two-multiply one (bit-identical)."""
    case = dataclasses.replace(awkward_apply_cases()[base], num_tokens=23, hidden=160, intermediate=64, name=base)
    inputs = cases.make_inputs(case, DEVICE, seed=5)
    ref = naive_moe(**inputs)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    assert not plan.w13.big_scales
    for schedule in (None, Schedule(tail_m=16, programs=4)):
        planned = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan, tile=TILE, schedule=schedule)
        check_rel_err(planned, ref, TOL)
        functional = _run(persistent.fused_moe_mx_swap_persistent, inputs, None, tile=TILE, schedule=schedule)
        assert torch.equal(planned, functional), "both decodes give the same products"


@interpreter_only
def test_large_scales_and_gelu_under_the_interpreter():
    """Every E8M0 scale above 128 (the two-multiply decode) with a tail schedule, erf-gelu."""
    inputs = _ragged_inputs("gelu", seed=4)
    for key in ("w13", "w2"):
        w = inputs[key]
        inputs[key] = MXFP4Weight(w.packed, (w.scales.int() + 40).clamp(max=254).to(torch.uint8))
    inputs["x"] = inputs["x"] * 2.0**-40
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    assert plan.w13.big_scales and plan.w2.big_scales
    schedule = Schedule(tail_m=16, programs=6)
    got = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan, tile=TILE, schedule=schedule)
    check_rel_err(got, naive_moe(**inputs), TOL)


@interpreter_only
def test_every_table_tile_with_its_schedule_under_the_interpreter():
    case = dataclasses.replace(awkward_apply_cases()["gpt_oss_like"], num_tokens=40, hidden=160, intermediate=64)
    inputs = cases.make_inputs(case, DEVICE, seed=3)
    ref = naive_moe(**inputs)
    plan = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    for tile in tiles_for("cuda", "mxfp4_swap"):
        schedule = dataclasses.replace(pick_schedule(10**6, 1, tile), programs=3)  # the largest rows' schedule
        tile = dataclasses.replace(tile, num_stages=1)
        got = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan, tile=tile, schedule=schedule)
        check_rel_err(got, ref, TOL)


@interpreter_only
def test_bound_runs_match_the_functional_path_under_the_interpreter():
    """``bind_fused_moe_mx_swap_persistent`` on the plan's weights, one runner per token count
    (T = 1, 5, 1 again, 33), each equal to the functional path bit for bit and to float64."""
    check_bound_runs(
        awkward_apply_cases()["gpt_oss_like"],
        fused_mx_swap.prepare_moe_mx_swap,
        persistent.bind_fused_moe_mx_swap_persistent,
        persistent.fused_moe_mx_swap_persistent,
        TOL,
        DEVICE,
        steps=((1, None), (5, None), (1, None), (33, 1)),
        tile=TILE,
        schedule=Schedule(tail_m=16, programs=4),
    )


def test_bind_leaves_to_fn():
    base = awkward_apply_cases()["gpt_oss_like"]
    small = cases.make_inputs(base, "cpu", seed=0)
    large = cases.make_inputs(dataclasses.replace(base, num_tokens=fused.BIND_MAX_TOKENS + 1), "cpu", seed=0)
    prepared = fused_mx_swap.prepare_moe_mx_swap(w13=small["w13"], w2=small["w2"])
    bind = persistent.bind_fused_moe_mx_swap_persistent
    assert bind(MoEApplyArgs(**large, out=torch.empty_like(large["x"]), prepared=prepared)) is None
    assert bind(MoEApplyArgs(**small, out=torch.empty_like(small["x"]), prepared=None)) is None
    quant = MoEApplyArgs(**small, out=torch.empty_like(small["x"]), prepared=prepared, activation_quant="fp8")
    assert bind(quant) is None


# ---------------------------------------------------------------- GPU numerics


SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
GPU_SCHEDULES = (
    None,
    Schedule(tail_m=0, dynamic=False),
    Schedule(tail_m=16, dynamic=True),
    Schedule(programs=7),
    Schedule(tail_m=0, dynamic=False, w2_tma=True),  # layer 2 by TMA
    Schedule(tail_m=16, dynamic=True, w2_tma=True),
)


@pytest.mark.skipif(not SM90, reason="GPU numerics: needs an sm_90 device (inline PTX bf16x2 multiplies, wgmma)")
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_gpu_numerics(case):
    """Through ``moe_apply`` (functional: the dot_scaled layers), then the plan, every table tile
    and the schedules above against float64; without tails equal to the swapped kernel."""
    inputs, ref, _, plan = gpu_public_calls(case, NAME, TOL)
    check_rel_err(plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"]), ref, TOL)
    for tile in tiles_for("cuda", "mxfp4_swap"):
        swap = _run(fused_mx_swap.fused_moe_mx_swap, inputs, plan.prepared, tile=tile, splits=1)
        for schedule in GPU_SCHEDULES:
            if schedule is not None and schedule.tail_m >= tile.block_m:
                continue
            got = _run(persistent.fused_moe_mx_swap_persistent, inputs, plan.prepared, tile=tile, schedule=schedule)
            check_rel_err(got, ref, TOL)
            if schedule is not None and not schedule.tail_m:
                assert torch.equal(got, swap), (tile, schedule)


@pytest.mark.skipif(not SM90, reason="CUDA-graph capture: needs an sm_90 device")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_cuda_graph_capture_matches_eager(dynamic):
    """The dynamic counters are zeroed by the permutation inside the graph: replays equal eager."""
    from support.gpu_moe import awkward_gpu_inputs

    inputs = awkward_gpu_inputs(300, 32, 3, "swiglu_oai", True, False, seed=7)
    prepared = fused_mx_swap.prepare_moe_mx_swap(w13=inputs["w13"], w2=inputs["w2"])
    out = torch.empty_like(inputs["x"])
    schedule = Schedule(tail_m=16, dynamic=dynamic)
    tile = Tile(64, 128, 128, 8, 8, 3)

    def step():
        persistent.fused_moe_mx_swap_persistent(
            MoEApplyArgs(**inputs, out=out, prepared=prepared), tile=tile, schedule=schedule
        )
        return out.clone()

    eager = step()
    graph, captured = capture(step)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)


@pytest.mark.skipif(not SM90, reason="bound plan runs: needs an sm_90 device (inline PTX bf16x2 multiplies, wgmma)")
def test_gpu_plan_runs_bound_per_token_count():
    check_gpu_bound_runs(NAME, TOL, fused.BIND_MAX_TOKENS)


@interpreter_only
def test_the_device_sweep_checks_then_times_under_the_interpreter(tmp_path):
    """ci/device/mxp_sweep.py --device cpu on a small layer (what the lead's GPU call runs at the
    GPT-OSS sizes): each variant checked against float64 and the swapped kernel, then timed; a
    variant the tile cannot take is ``n/a``; the table and the JSON rows."""
    done, report = _sweep(tmp_path, "--tokens", "5", "--variants", "swap,persistent,p-static,p-dynamic,p-tail16")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = report["results"]
    rows = result["rows"]
    assert rows["swap"]["status"] == rows["persistent"]["status"] == rows["p-dynamic"]["status"] == "PASS"
    assert rows["persistent"]["vs_swap"] == rows["p-dynamic"]["vs_swap"] == "bitwise"
    assert all(rows[name]["ms"] > 0 for name in ("swap", "persistent", "p-dynamic"))
    assert rows["p-static"] == {"status": "same", "reason": "runs what persistent runs"}  # static at this T
    assert rows["p-tail16"]["status"] == "n/a" and "tail_m" in rows["p-tail16"]["reason"]  # 16-row tile at T = 5
    assert "best" in done.stdout and "x shipped" in done.stdout


def _sweep(tmp_path, *options: str, timeout: int = 300):
    """ci/device/mxp_sweep.py run on the CPU with ``options``: (its process, its JSON or None)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[4] / "ci" / "device" / "mxp_sweep.py"
    out = tmp_path / "mxp.json"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", *options, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    return done, json.loads(out.read_text()) if out.exists() else None


def test_the_device_sweep_lists_the_levers_group(tmp_path):
    """``--group levers --list``: the shipped rows and the levers, each at its token counts."""
    done, _ = _sweep(tmp_path, "--group", "levers", "--list", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()}
    assert list(rows)[:2] == ["swap", "persistent"] and all(r[1] in ("base", "levers") for r in rows.values())
    assert {"t64-w2n64", "t1024-8w", "p-w2tma", "p-ybf16"} <= set(rows) and "p-static" not in rows
    assert rows["p-w2tma"][2] == "4096" and rows["t1024-ybf16"][2] == "512,1024"


@interpreter_only
def test_the_device_sweep_runs_the_levers_under_the_interpreter(tmp_path):
    """ci/device/mxp_sweep.py's levers on a small layer: layer 2's own tile and K splits and the
    persistent kernel's layer-2 TMA loads give the swapped kernel's bits, layer-2 rows in bf16
    pass float64 without them; ``--breakdown`` times the shipped rows' layers."""
    variants = "swap,persistent,t64-w2n64,t64-w2split2,t1024-ybf16,p-w2tma"
    done, report = _sweep(tmp_path, "--tokens", "5", "--variants", variants, "--breakdown")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = report["results"]
    rows = result["rows"]
    assert all(rows[name]["status"] == "PASS" and rows[name]["ms"] > 0 for name in variants.split(","))
    assert all(rows[name]["vs_swap"] == "bitwise" for name in ("persistent", "t64-w2n64", "t64-w2split2", "p-w2tma"))
    assert rows["t1024-ybf16"]["vs_swap"] != "bitwise" and rows["t1024-ybf16"]["choice"] == "w2 y=bf16"
    for name in ("swap", "persistent"):
        assert set(rows[name]["layers_ms"]) == {"w13", "w2", "rest"} and rows[name]["layers_ms"]["w13"] > 0
    assert "best" in done.stdout and "layers T=5 swap" in done.stdout
