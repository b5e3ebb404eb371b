"""store_kvcache: semantics against the naive float64 store, and every bad input."""

import pytest
import torch
from support.naive_attention import naive_store

from tokenspeed_kernel import config
from tokenspeed_kernel.tools.cases import attention as cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case_index", range(3))
def test_store_matches_naive(dtype, case_index):
    case = cases.awkward_cases("kvcache.store", dtype)[case_index]
    inputs = cases.make_inputs(case, seed=case_index)
    assert (inputs["slot_mapping"] < 0).any(), "the case should include padding slots"
    expected_k, expected_v = naive_store(**inputs)
    k_cache, v_cache = cases.call(case, inputs)
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))


def test_fp8_store_saturates():
    case = cases.awkward_cases("kvcache.store", torch.float32)[2]
    inputs = cases.make_inputs(case)
    inputs["k"] = inputs["k"] * 1e6
    k_cache, _ = cases.call(case, inputs)
    written = inputs["slot_mapping"][inputs["slot_mapping"] >= 0]
    rows = k_cache.flatten(0, 1)[written].float()
    assert torch.isfinite(rows).all() and rows.abs().max() == 448.0


BAD = [
    ("k", TypeError, "k must have dtype in", lambda t: t.to(torch.int8)),
    ("v", ValueError, r"v must have shape \[22, 2, \*\]", lambda t: t[:, :1].contiguous()),
    ("k_cache", ValueError, r"k_cache must have shape \[\*, \*, 2, 64\]", lambda t: t[..., :32].contiguous()),
    ("v_cache", TypeError, "v_cache must have dtype in", lambda t: t.half()),
    ("slot_mapping", TypeError, "slot_mapping must have dtype in {int64}", lambda t: t.int()),
    ("slot_mapping", ValueError, r"slot_mapping must have shape \[22\]", lambda t: t[:3]),
    ("k_scale", ValueError, "apply to a float8_e4m3fn cache only", 1.0),
    ("k", ValueError, "k must be contiguous", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
    (
        "k_cache",
        ValueError,
        "k_cache must have stride 1 in its last",
        lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
    ),
    (
        "v_cache",
        ValueError,
        "v_cache must have stride 1 in its last",
        lambda t: t.transpose(2, 3).contiguous().transpose(2, 3),
    ),
]


@pytest.mark.parametrize(("arg", "exc", "match", "change"), BAD, ids=[b[0] + "-" + b[2][:15] for b in BAD])
def test_store_rejects(arg, exc, match, change, cold_and_warm):
    case = cases.awkward_cases("kvcache.store", torch.float32)[0]
    inputs = cases.make_inputs(case)
    bad = {**inputs, arg: change(inputs[arg]) if callable(change) else change}
    cold_and_warm(lambda: cases.call(case, inputs), lambda: cases.call(case, bad), exc, match)


def test_store_rejects_bad_overrides():
    case = cases.awkward_cases("kvcache.store", torch.float32)[0]
    inputs = cases.make_inputs(case)
    with pytest.raises(TypeError, match="override must be a kernel name"):
        cases.call(case, inputs, override=3)
    with pytest.raises(ValueError, match="'nope' is not a kernel registered for kvcache.store"):
        cases.call(case, inputs, override="nope")
    with pytest.raises(ValueError, match="'torch_decode' is not a kernel registered for kvcache.store"):
        cases.call(case, inputs, override="torch_decode")


def test_store_debug_mode_checks_slots(monkeypatch):
    case = cases.awkward_cases("kvcache.store", torch.float32)[0]
    inputs = cases.make_inputs(case)
    inputs["slot_mapping"][0] = 10**6
    monkeypatch.setenv(config.DEBUG_ENV, "1")
    config.refresh()
    try:
        with pytest.raises(ValueError, match="slot_mapping holds slot 1000000"):
            cases.call(case, inputs)
    finally:
        monkeypatch.delenv(config.DEBUG_ENV)
        config.refresh()


def test_store_without_rows_or_with_only_padding_leaves_the_cache_alone():
    case = cases.awkward_cases("kvcache.store", torch.float32)[0]
    inputs = cases.make_inputs(case)
    before_k, before_v = inputs["k_cache"].clone(), inputs["v_cache"].clone()
    padding = {**inputs, "slot_mapping": torch.full_like(inputs["slot_mapping"], -1)}
    cases.call(case, padding, override="torch_store_kvcache")
    empty = {**inputs, "k": inputs["k"][:0], "v": inputs["v"][:0], "slot_mapping": inputs["slot_mapping"][:0]}
    cases.call(case, empty, override="torch_store_kvcache")
    assert torch.equal(inputs["k_cache"], before_k) and torch.equal(inputs["v_cache"], before_v)


@pytest.mark.parametrize("arg", ["v", "k_cache", "v_cache", "slot_mapping"])
def test_store_rejects_tensors_on_another_device(arg):
    case = cases.awkward_cases("kvcache.store", torch.float32)[0]
    inputs = cases.make_inputs(case)
    inputs[arg] = torch.empty_like(inputs[arg], device="meta")
    with pytest.raises(ValueError, match=f"{arg} is on meta but k is on cpu"):
        cases.call(case, inputs)


def test_store_fp8_needs_valid_scales():
    case = cases.awkward_cases("kvcache.store", torch.float32)[2]
    inputs = cases.make_inputs(case)
    with pytest.raises(ValueError, match="k_scale and v_scale are required"):
        cases.call(case, {**inputs, "v_scale": None})
    with pytest.raises(ValueError, match="k_scale must be > 0"):
        cases.call(case, {**inputs, "k_scale": 0.0})
    with pytest.raises(ValueError, match="v_scale must be a float or a one-element float32 tensor"):
        cases.call(case, {**inputs, "v_scale": torch.ones(1, dtype=torch.float64)})
    with pytest.raises(TypeError, match="k_cache dtype float16 must equal k dtype float32"):
        fp16 = {**inputs, "k_cache": inputs["k_cache"].half(), "v_cache": inputs["v_cache"].half()}
        cases.call(case, {**fp16, "k_scale": None, "v_scale": None})
