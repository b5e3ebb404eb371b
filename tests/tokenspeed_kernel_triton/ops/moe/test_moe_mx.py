"""``triton_fused_moe_mx`` (the ``tl.dot_scaled`` MXFP4 main loop): registration and gating,
host-side logic, and numerics.

- Gating: ranked above ``triton_fused_moe`` for MXFP4 weights on every GPU platform (faked
  with ``platform_from_arch``), registered for GPUs only (the CPU is Triton's interpreter,
  which cannot run ``dot_scaled``), MXFP4 + bf16 only.
- Host logic without ``dot_scaled``: the split-K rule and ranges, the plan's scale layout
  against ``dequantize_mxfp4`` (also tile by tile, through the kernel's pointer arithmetic).
- CPU numerics: the real kernel under the interpreter with ``tl.dot_scaled`` emulated in
  float64 (``support.interpret_dot_scaled``): addressing, masks, split-K, the finish kernel
  and the combine against the float64 ``support.naive_moe``. Triton's GPU lowering of
  ``dot_scaled`` is only tested by :func:`test_gpu_numerics` (CUDA only).
"""

import dataclasses

import pytest
import torch
from support import interpret_dot_scaled
from support.moe_checks import (
    GPU_CASES,
    awkward_apply_cases,
    candidate,
    check_bound_runs,
    check_gpu_bound_runs,
    check_rel_err,
    gpu_case_id,
    gpu_public_calls,
)
from support.naive_moe import naive_moe

from tokenspeed_kernel import config, explain, platform
from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.quant import MXFP4Weight, dequantize_mxfp4, quantize_mxfp4
from tokenspeed_kernel.registry import Priority, Request, get_kernel
from tokenspeed_kernel.selector import KernelOverrideError
from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.moe import fused, fused_mx
from tokenspeed_kernel_triton.ops.moe._config import MAX_SPLITS, MIN_SPLIT_STEPS, Tile, split_k, tiles_for
from tokenspeed_kernel_triton.ops.moe._routing import Routing, max_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"  # kernels run on CPU tensors under Triton's interpreter only
NAME = "triton_fused_moe_mx"
SWAP = "triton_fused_moe_mx_swap"  # sm_90's first above 8 tokens (test_moe_mx_swap.py)
REASON = "vendor cpu not in {cuda, rocm}"  # GPUs only: the interpreter cannot run tl.dot_scaled
TOL = 2e-2  # relative Frobenius error: the intermediate is rounded to bf16


# ---------------------------------------------------------------- registration and gating


def test_registration_ranks_above_triton_fused_moe_in_the_portable_band():
    spec, base = get_kernel(NAME), get_kernel("triton_fused_moe")
    assert spec.priority > base.priority and Priority.band(spec.priority) is Priority.PORTABLE
    assert spec.prepare is fused_mx.prepare_moe_mx and spec.available is fused_mx.dot_scaled_missing
    assert {"mxfp4", "bias", "expert_map", "swiglu_oai", "silu"} <= spec.features
    assert "mxfp8_act" not in spec.features and spec.vendors == {"cuda", "rocm"}


@pytest.mark.parametrize("interpreter", [False, True])
def test_the_cpu_is_never_served_with_the_reason(interpreter):
    """Registered for GPUs only, whatever TRITON_INTERPRET says: a CPU platform (with Triton's
    interpreter or without) rejects it with the vendor reason, also for an override."""
    cpu = platform_from_arch("cpu")
    caps = cpu.capabilities - {platform.INTERPRETER_CAPABILITY}
    cpu = dataclasses.replace(cpu, capabilities=caps | ({platform.INTERPRETER_CAPABILITY} if interpreter else set()))
    request = cases.request(awkward_apply_cases()["gpt_oss_like"])
    selection = explain(request, platform=cpu)
    assert candidate(selection, NAME).reasons == (REASON,)
    assert selection.winner is not None and selection.winner.name != NAME
    with pytest.raises(KernelOverrideError, match="vendor cpu not in"):
        explain(request, platform=cpu, override=NAME)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "sm_100", "gfx942", "gfx950"])
def test_wins_over_triton_fused_moe_for_mxfp4_when_available(arch):
    request = cases.request(awkward_apply_cases()["gpt_oss_like"])
    selection = explain(request, platform=platform_from_arch(arch))
    assert candidate(selection, NAME).accepted, candidate(selection, NAME).reasons
    names = [c.spec.name for c in selection.candidates if c.accepted and c.spec.name != SWAP]
    assert names.index(NAME) < names.index("triton_fused_moe") < names.index("torch_moe")
    if arch.startswith("sm_"):  # on AMD the Gluon MoE kernels outrank both Triton kernels
        assert names[0] == NAME
    override = "triton_fused_moe"
    assert explain(request, platform=platform_from_arch(arch), override=override).winner.name == override


def test_platform_override_env(monkeypatch):
    """The same verdict through ``TOKENSPEED_KERNEL_PLATFORM`` (the current platform; sm_100:
    the swapped kernel serves sm_90 only)."""
    monkeypatch.setenv(config.PLATFORM_ENV, "sm_100")
    config.refresh()
    platform.refresh()
    try:
        selection = explain(cases.request(awkward_apply_cases()["mxfp4_t33"]))  # above the GEMV kernels' T <= 8
        assert selection.platform.arch == "sm_100"
        assert selection.winner.name == NAME and candidate(selection, "triton_fused_moe").accepted
    finally:
        monkeypatch.delenv(config.PLATFORM_ENV)
        config.refresh()
        platform.refresh()


def test_serves_mxfp4_bf16_only():
    sm90 = platform_from_arch("sm_90")
    by_name = awkward_apply_cases()
    for name, reason in (
        ("plain_t5", "weight dtype bfloat16 not in {uint8}"),
        ("fp8_per_channel", "weight dtype float8_e4m3fn not in {uint8}"),
        ("mxfp8_act_t1", "does not support {mxfp8_act}"),
    ):
        reasons = candidate(explain(cases.request(by_name[name]), platform=sm90), NAME).reasons
        assert any(reason in r for r in reasons), (name, reasons)
    uint8_not_mx = Request.make("moe.apply", {"x": torch.bfloat16, "weight": torch.uint8}, {}, {"silu"})
    assert candidate(explain(uint8_not_mx, platform=sm90), NAME).reasons == (
        "MXFP4 weights only (tl.dot_scaled e2m1 main loop)",
    )
    fp16 = cases.request(dataclasses.replace(by_name["mxfp4_t1"], dtype=torch.float16))
    assert any("x dtype float16" in r for r in candidate(explain(fp16, platform=sm90), NAME).reasons)


# ---------------------------------------------------------------- host logic (no dot_scaled)


def _gpt_oss_splits(tokens: int, tile: Tile) -> tuple[int, int]:
    """(w13, w2) splits at GPT-OSS-120B shapes (E = 128, top-4, H = I = 2880) on an H100."""
    routing = Routing(None, None, None, max_tiles(tokens * 4, 128, tile.block_m), tokens * 4, None, None)
    return tuple(fused_mx.plan_splits(routing, 2880, 2880, tile, 132) for _ in range(2))


def test_split_rule_at_gpt_oss_shapes():
    decode = fused_mx.pick_tile(4, 128, "cuda", "mxfp4_dot")
    assert decode.block_n == 64  # 45 column blocks of layer 1 (N = 2880), 23 K steps of 128
    assert _gpt_oss_splits(1, decode) == (4, 4)  # 4 tiles x 45 = 180 programs → 4 splits of 6 steps
    assert _gpt_oss_splits(2, decode) == (4, 4)  # 360 programs: 8 splits would leave 3 steps each
    for tokens in (8, 64, 512, 4096):
        tile = fused_mx.pick_tile(tokens * 4, 128, "cuda", "mxfp4_dot")
        assert _gpt_oss_splits(tokens, tile) == (1, 1), tokens


@pytest.mark.parametrize("programs", [1, 4, 90, 360, 1000, 5000])
@pytest.mark.parametrize("k_steps", [1, 3, 8, 23, 64, 1000])
def test_split_rule_invariants(programs, k_steps):
    splits = split_k(programs, k_steps, 132)
    assert splits & (splits - 1) == 0 and 1 <= splits <= MAX_SPLITS
    if splits > 1:  # only small grids, and every split keeps MIN_SPLIT_STEPS steps
        assert programs * splits // 2 < 8 * 132 and -(-k_steps // splits) >= MIN_SPLIT_STEPS


@pytest.mark.parametrize("k", [32, 96, 128, 2880])
@pytest.mark.parametrize("block_k", [64, 128])
def test_split_ranges_cover_k(k, block_k):
    for splits in range(1, 9):
        size = fused_mx.split_size(k, block_k, splits)
        assert size % block_k == 0
        covered = [v for s in range(splits) for v in range(s * size, min(k, (s + 1) * size))]
        assert covered == list(range(k))


def _weight(e: int, n: int, k: int, seed: int) -> MXFP4Weight:
    gen = torch.Generator().manual_seed(seed)
    return quantize_mxfp4(torch.randn(e, n, k, generator=gen) * torch.rand(e, n, 1, generator=gen) * 4)


def _tile_as_kernel_reads(op: fused_mx.MxOperand, e: int, n0: int, k0: int, bn: int, bk: int):
    """The ``[bk/2, bn]`` byte tile and ``[bn, bk/32]`` scale tile at (expert e, rows n0.., K
    k0..) through the strides the launcher passes (what ``_mx_step`` addresses)."""
    sw, ss = op.packed.stride(), op.scales.stride()
    w = torch.as_strided(op.packed, (bk // 2, bn), (sw[2], sw[1]), e * sw[0] + n0 * sw[1] + k0 // 2 * sw[2])
    s = torch.as_strided(op.scales, (bn, bk // 32), (ss[1], ss[2]), e * ss[0] + n0 * ss[1] + k0 // 32 * ss[2])
    return w.numpy(), s.numpy()


@pytest.mark.parametrize("plan", [False, True])
def test_operand_layout_matches_public_weight(plan):
    w = _weight(3, 40, 256, seed=7)  # N = 40: not a multiple of the 16-byte scale alignment
    op = fused_mx.mx_operand(w, plan=plan)
    assert op.packed is w.packed, "the packed bytes are used as given"
    if plan:
        n_pad = op.scales.stride(2)
        assert op.scales.stride(1) == 1 and n_pad % 16 == 0 and n_pad >= 40
        assert op.scales.data_ptr() % 16 == 0
    assert torch.equal(dequantize_mxfp4(MXFP4Weight(op.packed, op.scales)), dequantize_mxfp4(w))
    dense = dequantize_mxfp4(w, torch.float64)
    eye = torch.eye(128, dtype=torch.bfloat16).view(torch.int16).numpy().view("uint16")
    for e, n0, k0 in ((0, 0, 0), (2, 8, 128), (1, 24, 128)):
        w_tile, s_tile = _tile_as_kernel_reads(op, e, n0, k0, 16, 128)
        tile = torch.from_numpy(interpret_dot_scaled.emulated_dot_scaled(eye, w_tile, s_tile))  # [K, N]
        assert torch.equal(tile, dense[e, n0 : n0 + 16, k0 : k0 + 128].T)


# ---------------------------------------------------------------- CPU numerics (emulated dot_scaled)


@pytest.fixture
def emulated(monkeypatch):
    if not INTERPRET:
        pytest.skip("the emulation replaces tl.dot_scaled in the interpreter only")
    interpret_dot_scaled.install(monkeypatch)


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    check_rel_err(out, ref, TOL)


def _run(inputs, prepared=None, tile=None, splits=None) -> torch.Tensor:
    out = torch.full_like(inputs["x"], float("nan"))
    fused_mx.fused_moe_mx(MoEApplyArgs(**inputs, out=out, prepared=prepared), tile=tile, splits=splits)
    return out


NUMERIC_CASES = {  # name: (awkward case, changes, forced K splits)
    "t1": ("mxfp4_t1", {}, (2, 4)),
    "gpt_oss_like": ("gpt_oss_like", {}, (2,)),  # swiglu_oai, biases, expert map with -1
    "odd_k_gelu": ("mxfp4_t33", {"num_tokens": 7, "hidden": 160, "intermediate": 96, "activation": "gelu", "bias": True},
                   (3,)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(NUMERIC_CASES))
def test_kernel_matches_naive_with_emulated_dot_scaled(emulated, name):
    base, changes, forced = NUMERIC_CASES[name]
    case = dataclasses.replace(awkward_apply_cases()[base], name=name, **changes)
    inputs = cases.make_inputs(case, DEVICE, seed=len(name))
    ref = naive_moe(**inputs)
    plan = fused_mx.prepare_moe_mx(w13=inputs["w13"], w2=inputs["w2"])
    functional = _run(inputs)
    _check(functional, ref)
    assert torch.equal(_run(inputs, plan), functional), "planned and public scales must agree bit for bit"
    for splits in forced:  # split-K: partial buffer + finish kernel (w13), per-split rows (w2)
        _check(_run(inputs, plan, splits=splits), ref)


@pytest.mark.parametrize("vendor", ["cuda"])  # the AMD rows are the same shapes (16x32, 64x64)
def test_every_tile_of_the_table_with_emulated_dot_scaled(emulated, vendor):
    case = dataclasses.replace(
        awkward_apply_cases()["gpt_oss_like"], num_tokens=9, hidden=160, intermediate=64, name="tiles"
    )
    inputs = cases.make_inputs(case, DEVICE, seed=3)
    ref = naive_moe(**inputs)
    for tile in tiles_for(vendor, "mxfp4_dot"):
        _check(_run(inputs, tile=tile), ref)


@pytest.mark.parametrize("name", ["gpt_oss_like", "odd_k_gelu"])
def test_bound_runs_match_the_functional_path_with_emulated_dot_scaled(emulated, name):
    """``bind_fused_moe_mx`` on the plan's weights, one runner per token count (T = 1 and 33
    split, T = 5 unsplit): each run equals :func:`fused_moe_mx` bit for bit and matches float64."""
    base, changes, _ = NUMERIC_CASES[name]
    case = dataclasses.replace(awkward_apply_cases()[base], name=name, **changes)
    check_bound_runs(case, fused_mx.prepare_moe_mx, fused_mx.bind_fused_moe_mx, fused_mx.fused_moe_mx, TOL, DEVICE)


# ---------------------------------------------------------------- GPU numerics


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU numerics: no CUDA device (tl.dot_scaled needs a GPU)")
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_gpu_numerics(case):
    inputs, ref, out, plan = gpu_public_calls(case, NAME, TOL)
    assert torch.equal(plan.apply(inputs["x"], inputs["topk_weights"], inputs["topk_ids"]), out)
    for splits in (2, 4):
        _check(_run(inputs, plan.prepared, splits=splits), ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bound plan runs: no CUDA device (tl.dot_scaled needs a GPU)")
def test_gpu_plan_runs_bound_per_token_count():
    check_gpu_bound_runs(NAME, TOL, fused.BIND_MAX_TOKENS)
