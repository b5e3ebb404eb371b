"""Every bad-input path of moe_topk / moe_apply / moe_plan raises TypeError/ValueError naming
the argument, before any kernel runs; device-sync checks only under TOKENSPEED_KERNEL_DEBUG."""

import pytest
import torch

from tokenspeed_kernel import moe_apply, moe_plan, moe_topk
from tokenspeed_kernel.quant import quantize_fp8, quantize_mxfp4
from tokenspeed_kernel.selector import KernelOverrideError
from tokenspeed_kernel.tools.cases import moe as cases

APPLY = "torch_moe"
TOPK = "torch_moe_topk"


def _valid():
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, bias=True)
    return cases.make_inputs(case, seed=0)


def _noncontig(t):
    return torch.cat([t, t], dim=-1)[..., ::2]


def _set(key, value):
    return lambda d: d.update({key: value(d) if callable(value) else value})


APPLY_BAD = [
    ("x_not_tensor", _set("x", lambda d: d["x"].tolist()), TypeError, "x must be a torch.Tensor"),
    ("x_3d", _set("x", lambda d: d["x"][None]), ValueError, "x must be 2-D"),
    ("x_float64", _set("x", lambda d: d["x"].double()), TypeError, "x must have dtype"),
    ("x_int", _set("x", lambda d: d["x"].int()), TypeError, "x must have dtype"),
    ("x_hidden", _set("x", lambda d: d["x"][:, :32].contiguous()), ValueError, "x must have shape"),
    ("x_noncontig", _set("x", lambda d: _noncontig(d["x"])), ValueError, "x must be contiguous"),
    ("w13_dtype", _set("w13", lambda d: d["w13"].bfloat16()), TypeError, "w13 must be in x's dtype"),
    ("w13_kind", _set("w13", lambda d: d["w13"].tolist()), TypeError, "w13 must be a torch.Tensor, MXFP4Weight"),
    ("w13_2d", _set("w13", lambda d: d["w13"][0]), ValueError, "w13 must be 3-D"),
    (
        "w13_odd_rows",
        _set("w13", lambda d: d["w13"][:, :63].contiguous()),
        ValueError,
        r"w13 must have shape \[E, 2I, H\]",
    ),
    ("w13_noncontig", _set("w13", lambda d: _noncontig(d["w13"])), ValueError, "w13 must be contiguous"),
    ("w2_dtype", _set("w2", lambda d: d["w2"].half()), TypeError, "w2 must be in x's dtype"),
    ("w2_shape", _set("w2", lambda d: d["w2"][:, :, :16].contiguous()), ValueError, r"w2 must have shape \[E, H, I\]"),
    ("w2_experts", _set("w2", lambda d: d["w2"][:4].contiguous()), ValueError, "w2 must have shape"),
    ("formats_differ", _set("w13", lambda d: quantize_mxfp4(d["w13"])), TypeError, "same weight format"),
    (
        "fp8_granularity_differs",
        lambda d: d.update(w13=quantize_fp8(d["w13"], "channel"), w2=quantize_fp8(d["w2"], "tensor")),
        TypeError,
        "same weight format",
    ),
    (
        "mxfp4_packed_noncontig",
        lambda d: d.update(
            w13=type(q := quantize_mxfp4(d["w13"]))(_noncontig(q.packed), q.scales), w2=quantize_mxfp4(d["w2"])
        ),
        ValueError,
        "w13.packed must be contiguous",
    ),
    (
        "topk_weights_dtype",
        _set("topk_weights", lambda d: d["topk_weights"].half()),
        TypeError,
        "topk_weights must have dtype",
    ),
    (
        "topk_weights_shape",
        _set("topk_weights", lambda d: d["topk_weights"][:, :1].contiguous()),
        ValueError,
        "topk_weights must have shape",
    ),
    ("topk_ids_dtype", _set("topk_ids", lambda d: d["topk_ids"].long()), TypeError, "topk_ids must have dtype"),
    (
        "topk_ids_tokens",
        _set("topk_ids", lambda d: d["topk_ids"][:3].contiguous()),
        ValueError,
        "topk_ids must have shape",
    ),
    ("topk_ids_1d", _set("topk_ids", lambda d: d["topk_ids"][:, 0].contiguous()), ValueError, "topk_ids must be 2-D"),
    (
        "top_k_gt_E",
        lambda d: d.update(topk_ids=torch.zeros(5, 9, dtype=torch.int32), topk_weights=torch.ones(5, 9)),
        ValueError,
        "1 <= k <= 8",
    ),
    ("activation", _set("activation", "relu"), ValueError, "activation must be one of"),
    (
        "w13_bias_shape",
        _set("w13_bias", lambda d: d["w13_bias"][:, :32].contiguous()),
        ValueError,
        "w13_bias must have shape",
    ),
    ("w13_bias_dtype", _set("w13_bias", lambda d: d["w13_bias"].half()), TypeError, "w13_bias must have dtype"),
    ("w2_bias_shape", _set("w2_bias", lambda d: d["w2_bias"][:4].contiguous()), ValueError, "w2_bias must have shape"),
    ("w2_bias_kind", _set("w2_bias", 1.0), TypeError, "w2_bias must be a torch.Tensor"),
    ("expert_map_dtype", _set("expert_map", torch.arange(8)), TypeError, "expert_map must have dtype"),
    ("expert_map_2d", _set("expert_map", torch.zeros(2, 4, dtype=torch.int32)), ValueError, "expert_map must be 1-D"),
    ("expert_map_empty", _set("expert_map", torch.zeros(0, dtype=torch.int32)), ValueError, "expert_map must hold"),
    ("out_dtype", _set("out", lambda d: torch.empty(5, 64, dtype=torch.bfloat16)), TypeError, "out must have dtype"),
    ("out_shape", _set("out", lambda d: torch.empty(5, 32)), ValueError, "out must have shape"),
    ("out_aliases_x", _set("out", lambda d: d["x"]), ValueError, "out must not alias x"),
    ("override_type", _set("override", 3), TypeError, "override must be"),
    ("override_unknown", _set("override", "no_such_kernel"), KernelOverrideError, "no_such_kernel"),
    ("x_device", _set("x", lambda d: torch.empty(5, 64, device="meta")), ValueError, "w13 is on cpu but x is on meta"),
    (
        "topk_ids_device",
        _set("topk_ids", lambda d: torch.empty(5, 2, dtype=torch.int32, device="meta")),
        ValueError,
        "topk_ids is on meta",
    ),
    (
        "bias_device",
        _set("w2_bias", lambda d: torch.empty(8, 64, device="meta")),
        ValueError,
        "w2_bias is on meta but x is on cpu",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "exc", "match"), APPLY_BAD, ids=[c[0] for c in APPLY_BAD])
def test_moe_apply_rejects(name, mutate, exc, match, cold_and_warm):
    good = {**_valid(), "override": APPLY}
    kwargs = dict(good)
    mutate(kwargs)
    cold_and_warm(lambda: moe_apply(**good), lambda: moe_apply(**kwargs), exc, match)


TOPK_BAD = [
    ("logits_kind", {"router_logits": [[1.0, 2.0]]}, TypeError, "router_logits must be a torch.Tensor"),
    ("logits_1d", {"router_logits": torch.randn(8)}, ValueError, "router_logits must be 2-D"),
    ("logits_dtype", {"router_logits": torch.randn(4, 8).double()}, TypeError, "router_logits must have dtype"),
    ("logits_noncontig", {"router_logits": torch.randn(8, 4).T}, ValueError, "router_logits must be contiguous"),
    ("logits_no_experts", {"router_logits": torch.randn(4, 0)}, ValueError, "router_logits must have at least one"),
    ("top_k_zero", {"top_k": 0}, ValueError, "top_k must be >= 1"),
    ("top_k_gt_E", {"top_k": 9}, ValueError, "top_k must be <= the number of experts"),
    ("top_k_float", {"top_k": 2.0}, TypeError, "top_k must be an int"),
    ("top_k_bool", {"top_k": True}, TypeError, "top_k must be an int"),
    ("scoring", {"scoring": "tanh"}, ValueError, "scoring must be one of"),
    ("renormalize", {"renormalize": 1}, TypeError, "renormalize must be a bool"),
    ("override_type", {"override": 1}, TypeError, "override must be"),
    ("override_wrong_op", {"override": APPLY}, KernelOverrideError, "torch_moe"),
]


@pytest.mark.parametrize(("name", "change", "exc", "match"), TOPK_BAD, ids=[c[0] for c in TOPK_BAD])
def test_moe_topk_rejects(name, change, exc, match, cold_and_warm):
    good = {"router_logits": torch.randn(4, 8), "top_k": 2, "override": TOPK}
    kwargs = {**good, **change}
    cold_and_warm(lambda: moe_topk(**good), lambda: moe_topk(**kwargs), exc, match)


def test_moe_plan_rejects():
    d = _valid()
    with pytest.raises(TypeError, match=r"x_dtype must be a torch\.dtype"):
        moe_plan(d["w13"], d["w2"], x_dtype="float32", top_k=2)
    with pytest.raises(TypeError, match="x must have dtype"):
        moe_plan(d["w13"], d["w2"], x_dtype=torch.float64, top_k=2)
    with pytest.raises(ValueError, match="top_k must be <="):
        moe_plan(d["w13"], d["w2"], x_dtype=torch.float32, top_k=9)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        moe_plan(d["w13"], d["w2"], x_dtype=torch.float32, top_k=0)
    with pytest.raises(ValueError, match="activation must be one of"):
        moe_plan(d["w13"], d["w2"], x_dtype=torch.float32, top_k=2, activation="tanh")
    with pytest.raises(ValueError, match="w2 must have shape"):
        moe_plan(d["w13"], d["w2"][:, :32].contiguous(), x_dtype=torch.float32, top_k=2)


# ------------------------------------------------------------------ debug-mode value checks


def _mapped():
    case = cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32, expert_map=True)
    return cases.make_inputs(case, seed=0)


@pytest.mark.parametrize(
    ("name", "mutate", "match"),
    [
        ("id_too_big", lambda d: d["topk_ids"].__setitem__((0, 0), 8), r"topk_ids must lie in \[0, E = 8\)"),
        ("id_negative", lambda d: d["topk_ids"].__setitem__((1, 1), -1), r"topk_ids must lie in"),
    ],
)
def test_debug_checks_expert_ids(env, name, mutate, match):
    env("TOKENSPEED_KERNEL_DEBUG", "1")
    d = _valid()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        moe_apply(**d, override=APPLY)


def test_debug_checks_expert_map(env):
    env("TOKENSPEED_KERNEL_DEBUG", "1")
    d = _mapped()
    moe_apply(**d, override=APPLY)  # valid inputs pass the checks
    bad_id = dict(d, topk_ids=d["topk_ids"].clone())
    bad_id["topk_ids"][2, 0] = 8
    with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, len\(expert_map\) = 8\)"):
        moe_apply(**bad_id, override=APPLY)
    for value in (4, -2):
        bad_map = dict(d, expert_map=d["expert_map"].clone())
        bad_map["expert_map"][3] = value
        with pytest.raises(ValueError, match=r"expert_map values must lie in \[-1, E = 4\)"):
            moe_apply(**bad_map, override=APPLY)
        with pytest.raises(ValueError, match="expert_map values"):
            moe_plan(d["w13"], d["w2"], x_dtype=torch.float32, top_k=2, expert_map=bad_map["expert_map"])
    plan = moe_plan(d["w13"], d["w2"], x_dtype=torch.float32, top_k=2, expert_map=d["expert_map"], override=APPLY)
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        plan.apply(d["x"], d["topk_weights"], bad_id["topk_ids"])


def test_no_sync_checks_without_debug(env, monkeypatch):
    env("TOKENSPEED_KERNEL_DEBUG", "0")
    from tokenspeed_kernel.ops.moe import api

    def fail(*args, **kwargs):
        raise AssertionError("value checks must not run without TOKENSPEED_KERNEL_DEBUG")

    monkeypatch.setattr(api, "check_ids_in_range", fail)
    d = _mapped()
    out = moe_apply(**d, override=APPLY)
    assert torch.isfinite(out).all()
