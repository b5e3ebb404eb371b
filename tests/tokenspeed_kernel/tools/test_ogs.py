"""The ``matmul_ogs`` baselines of ``moe.apply`` (tools/_ogs.py) on a CPU: the reasons they give
where they cannot run, and everything short of the GPU GEMMs. The weights converted to its
layouts, read back through its own unswizzle and dequantizer, and the routing built from our
ids (its routing kernels, under the Triton interpreter here) drive its torch reference
``matmul_ogs_torch`` to our float64 reference: the interleave, the [E, K, N] orientation, the
biases and gammas are what ``matmul_ogs`` expects."""

from __future__ import annotations

import importlib

import pytest
import torch

from tokenspeed_kernel.tools import _ogs, cases
from tokenspeed_kernel.tools.baselines import baselines_for
from tokenspeed_kernel.tools.cases import MoECase
from tokenspeed_kernel.tools.tolerances import Tolerance, compare

CPU = torch.device("cpu")
NAMES = ("matmul_ogs+sort", "matmul_ogs-presorted")


def _ogs_baselines():
    found = {b.name: b for b in baselines_for("moe.apply")}
    return [found[name] for name in NAMES]


def _mx_case(t: int = 37, **kw) -> MoECase:
    fields = dict(dtype=torch.bfloat16, weight_format="mxfp4", activation="swiglu_oai", bias=True)
    return MoECase("moe.apply", t, 128, 64, 8, 4, **{**fields, **kw})


def _api():
    tk = _ogs.triton_kernels_api()
    if isinstance(tk, str):
        pytest.skip(f"matmul_ogs baseline unavailable here: {tk}")
    return tk


def test_interleave_gate_up_puts_gate_n_then_up_n():
    w = torch.arange(2 * 6 * 3).reshape(2, 6, 3)  # E=2, 2I=6 (gate rows 0-2, up rows 3-5)
    got = _ogs.interleave_gate_up(w)
    assert got.shape == w.shape
    for n in range(3):
        assert torch.equal(got[:, 2 * n], w[:, n]) and torch.equal(got[:, 2 * n + 1], w[:, 3 + n])
    bias = torch.arange(12.0).reshape(2, 6)
    assert _ogs.interleave_gate_up(bias)[1].tolist() == [6.0, 9.0, 7.0, 10.0, 8.0, 11.0]


def test_not_installed_reason(monkeypatch):
    monkeypatch.setattr(_ogs, "triton_kernels_api", lambda: _ogs.NOT_INSTALLED)
    case = _mx_case()
    inputs = cases.make_inputs(case)
    for baseline in _ogs_baselines():
        assert baseline.prepare(case, inputs, CPU) == _ogs.NOT_INSTALLED
    assert "pip install triton_kernels" in _ogs.NOT_INSTALLED and "vLLM" in _ogs.NOT_INSTALLED


def test_resolver_without_vllm_says_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert _ogs._load_vendored() == _ogs.NOT_INSTALLED


def test_needs_a_cuda_device_on_cpu():
    _api()
    case = _mx_case()
    inputs = cases.make_inputs(case)
    for baseline in _ogs_baselines():
        assert baseline.prepare(case, inputs, CPU) == "needs a CUDA device"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (dict(weight_format="plain"), "MXFP4 weights only"),
        (dict(expert_map=True), "no expert_map"),
        (dict(activation="silu"), "swiglu_oai only"),
        (dict(top_k=3), "power of two"),
        (dict(dtype=torch.float16), "bf16 activations only"),
    ],
)
def test_cases_it_cannot_serve_say_why(change, why):
    case = _mx_case(**{k: v for k, v in change.items() if k != "top_k"})
    if "top_k" in change:
        case = MoECase("moe.apply", 5, 128, 64, 8, change["top_k"], torch.bfloat16, "mxfp4", "swiglu_oai")
    inputs = cases.make_inputs(case)
    for baseline in _ogs_baselines():
        assert why in baseline.prepare(case, inputs, CPU)
    odd = MoECase("moe.apply", 5, 96, 64, 8, 2, torch.bfloat16, "mxfp4", "swiglu_oai")
    assert "multiples of 64" in _ogs_baselines()[0].prepare(odd, cases.make_inputs(odd), CPU)


def _dense(value, scale, k, n):
    """Read a converted weight back: its layouts' unswizzle, then its torch dequantizer ->
    float32 ``[E, K, N]``."""
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch

    values = value.storage.layout.unswizzle_data(value.storage.data)
    scales = scale.storage.layout.unswizzle_data(scale.storage.data)[:, : k // 32, :n]
    return upcast_from_mxfp_torch(values, scales, torch.float32, axis=1)


@pytest.mark.parametrize("pad_scales", [True, False])
def test_hopper_layouts_read_back_to_our_dequantized_weights(pad_scales):
    tk = _api()
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    case = MoECase("moe.apply", 3, 192, 128, 4, 2, torch.bfloat16, "mxfp4", "swiglu_oai")  # K/32 = 6, 4
    inputs = cases.make_inputs(case, seed=2)
    layouts = ((HopperMXValueLayout, {"mx_axis": 1}), (HopperMXScaleLayout, {"mx_axis": 1, "num_warps": 8}))
    for name, interleave in (("w13", True), ("w2", False)):
        w = inputs[name]
        value, scale = _ogs.mx_weight(tk, w, *layouts, interleave=interleave, pad_scales=pad_scales)
        e, n, k = w.shape
        assert value.shape == [e, k, n] and value.storage.layout.name == "HOPPER_VALUE"
        dense = _dense(value, scale, k, n).transpose(1, 2)  # [E, N, K]
        if interleave:  # undo it: rows 2n (gate n), 2n + 1 (up n)
            dense = torch.cat((dense[:, 0::2], dense[:, 1::2]), dim=1)
        assert torch.equal(dense, w.dequantize(torch.float32)), name


def test_routing_from_our_ids_sorts_pairs_by_expert():
    tk = _api()
    dev = torch.device("cuda") if torch.cuda.is_available() else CPU  # the interpreter on a CPU
    case = MoECase("moe.apply", 37, 64, 64, 40, 4, torch.bfloat16, "mxfp4", "swiglu_oai")
    inputs = cases.make_inputs(case, dev, seed=1)
    ids, weights = inputs["topk_ids"], inputs["topk_weights"]
    data, gather, scatter = _ogs._routing(tk, ids, weights, case.num_experts)
    flat = ids.reshape(-1).long()
    order = gather.src_indx.long()  # sorted position -> (token, slot) pair
    assert torch.equal(data.expt_hist.long(), torch.bincount(flat, minlength=case.num_experts))
    assert torch.equal(order.sort().values, torch.arange(flat.numel(), device=dev))
    assert bool((flat[order].diff() >= 0).all())  # grouped by expert
    assert torch.equal(scatter.src_indx.long()[order], torch.arange(flat.numel(), device=dev))  # its inverse
    assert torch.equal(data.gate_scal, weights.reshape(-1).to(torch.bfloat16)[order])


def test_the_converted_weights_and_routing_compute_our_reference(monkeypatch):
    """matmul_ogs's own torch reference, fed what the baseline feeds the GPU kernels (weights
    read back from the Hopper layouts, interleaved biases, the routing, swiglu on adjacent
    columns, gammas on GEMM 2), matches the float64 reference."""
    tk = _api()
    from triton_kernels.matmul_ogs import matmul_ogs_torch
    from triton_kernels.swiglu import swiglu_torch
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    case = _mx_case(21)
    inputs = cases.make_inputs(case, seed=4)
    layouts = ((HopperMXValueLayout, {"mx_axis": 1}), (HopperMXScaleLayout, {"mx_axis": 1, "num_warps": 8}))
    w = _ogs._weights(tk, inputs, layouts, pad_scales=True)
    e, h, inter = case.num_experts, case.hidden, case.intermediate
    w13 = _dense(w.w13, w.pc13.weight_scale, h, 2 * inter)
    w2 = _dense(w.w2, w.pc2.weight_scale, inter, h)
    data, gather, scatter = _ogs._routing(tk, inputs["topk_ids"], inputs["topk_weights"], e)
    arange = torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, device=None, **kw: arange(*a, **kw))  # it names "cuda"
    mid = matmul_ogs_torch(inputs["x"].float(), w13, w.b13, data, gather_indx=gather)
    act = swiglu_torch(mid, _ogs._SWIGLU_OAI[0], type("Limit", (), {"limit": _ogs._SWIGLU_OAI[1]}))
    out = matmul_ogs_torch(act, w2, w.b2, data, scatter_indx=scatter, gammas=data.gate_scal.float())
    monkeypatch.undo()
    ref, _ = cases.reference(case, inputs)
    got = compare(out, ref, Tolerance(_ogs.MAX_REL_L2, float("inf")))
    assert got.passed and got.rel_l2 < 5e-3, got  # bf16 gammas: ~1e-3


def test_one_time_check_against_float64_notes_or_refuses():
    """prepare's check compares a few tokens' rows with float64 on the experts they hit:
    the reference's own output passes with its rel-l2 as the row's note; a wrong one is
    refused with a reason."""
    case = _mx_case(13)
    inputs = cases.make_inputs(case, seed=5)
    ref = cases.reference(case, inputs)[0].to(torch.bfloat16)
    good = _ogs._checked(case, inputs, lambda: ref)
    assert callable(good) and good.note.startswith("rel-l2 ") and good.note.endswith("vs float64 on 4 of 13 tokens")
    rel = float(good.note.split()[1])
    assert 0 < rel < 5e-3  # bf16 rounding of the output only
    wrong = ref.clone()
    wrong[-1] *= 1.5  # the last token is always among those compared
    why = _ogs._checked(case, inputs, lambda: wrong)
    assert isinstance(why, str) and "disagrees with float64" in why and "not timed" in why
    one = _mx_case(1)
    assert (
        "on 1 of 1 tokens" in _ogs._checked(one, (i := cases.make_inputs(one)), lambda: cases.reference(one, i)[0]).note
    )


def test_a_runner_note_reaches_the_bench_row(monkeypatch):
    from tokenspeed_kernel.tools import baselines
    from tokenspeed_kernel.tools.bench import bench

    def prepare(case, inputs, device):
        def run():
            return inputs["router_logits"].sum()

        run.note = "checked: rel-l2 1e-3"
        return run

    monkeypatch.setitem(baselines.BASELINES, "moe.topk", (baselines.Baseline("noted", prepare),))
    report = bench("moe.topk", preset="small", device="cpu", quiet=True)
    (row,) = [r for r in report.rows if r.kind == "baseline"]
    assert row.impl == "noted" and row.ms is not None and row.note == "checked: rel-l2 1e-3"
