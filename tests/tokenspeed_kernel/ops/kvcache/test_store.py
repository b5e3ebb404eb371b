"""store_kvcache: semantics against the naive float64 store, and every bad input."""

import dataclasses
import os

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


@pytest.mark.parametrize("override", [None, "torch_store_kvcache"])
@pytest.mark.parametrize("case_index", range(3))
def test_row_strided_k_and_v_are_stored_in_place(case_index, override):
    """k and v split off a fused qkv projection's rows (row-strided views, NaN after each, as
    the case builder lays out ``strided_rows``) are accepted with the request feature
    ``strided_rows`` and write the cache bit for bit as their contiguous copies do (the Triton
    kernel under the interpreter, and the reference), an fp8 cache included."""
    from tokenspeed_kernel import last_kernel
    from tokenspeed_kernel.ops._dispatch import last_request

    case = dataclasses.replace(cases.awkward_cases("kvcache.store", torch.float32)[case_index], strided_rows=True)
    inputs = cases.make_inputs(case, seed=case_index)
    assert not inputs["k"].is_contiguous() and not inputs["v"].is_contiguous()
    dense = {**inputs, "k": inputs["k"].contiguous(), "v": inputs["v"].contiguous()}
    for name in ("k_cache", "v_cache"):  # separate caches for the two calls
        dense[name] = inputs[name].clone()
    expected_k, expected_v = naive_store(**dense)
    k_cache, v_cache = cases.call(case, inputs, override=override)
    assert "strided_rows" in last_request().features and last_request() == cases.request(case)
    # these inputs are CPU tensors: the Triton store serves them under the interpreter (a CPU
    # host); on a GPU host, where the interpreter is off, only the reference takes them
    default = "triton_store_kvcache" if os.environ.get("TRITON_INTERPRET") == "1" else "torch_store_kvcache"
    assert last_kernel() == (override or default)
    flat_k, flat_v = cases.call(dataclasses.replace(case, strided_rows=False), dense, override=override)
    assert "strided_rows" not in last_request().features
    for got, flat, want in ((k_cache, flat_k, expected_k), (v_cache, flat_v, expected_v)):
        assert torch.equal(got.view(torch.uint8), flat.view(torch.uint8))
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_a_store_kernel_that_needs_contiguous_rows_is_passed_over(temp_kernels):
    """A store kernel without ``strided_rows`` at the top priority serves contiguous k/v and
    is passed over, with its reason, for row-strided ones (the reference serves them)."""
    from tokenspeed_kernel import explain, last_kernel
    from tokenspeed_kernel.registry import Priority

    dense_only = temp_kernels(
        "kvcache.store", name="dense_only", priority=Priority.PLUGIN, vendors=("cpu",), features=("fp8_kv",)
    )
    case = dataclasses.replace(cases.awkward_cases("kvcache.store", torch.float32)[0], strided_rows=True)
    inputs = cases.make_inputs(case)
    cases.call(case, {**inputs, "k": inputs["k"].contiguous(), "v": inputs["v"].contiguous()})
    assert last_kernel() == "dense_only" and len(dense_only.calls) == 1
    cases.call(case, inputs)
    assert last_kernel() == "torch_store_kvcache" and len(dense_only.calls) == 1
    assert "does not support {strided_rows}" in str(explain(cases.request(case)))


BAD = [
    ("k", TypeError, "k must have dtype in", lambda t: t.to(torch.int8)),
    ("v", ValueError, r"v must have shape \[22, 2, \*\]", lambda t: t[:, :1].contiguous()),
    ("k_cache", ValueError, r"k_cache must have shape \[\*, \*, 2, 64\]", lambda t: t[..., :32].contiguous()),
    ("v_cache", TypeError, "v_cache must have dtype in", lambda t: t.half()),
    ("slot_mapping", TypeError, "slot_mapping must have dtype in {int64}", lambda t: t.int()),
    ("slot_mapping", ValueError, r"slot_mapping must have shape \[22\]", lambda t: t[:3]),
    ("k_scale", ValueError, "apply to a float8_e4m3fn cache only", 1.0),
    (
        "k",
        ValueError,
        r"k must be contiguous, or rows \[Hkv, D\] with a row stride of their own",
        lambda t: t.transpose(0, 1).contiguous().transpose(0, 1),
    ),
    (
        "v",
        ValueError,
        r"v must be contiguous, or rows \[Hkv, Dv\] with a row stride of their own",
        lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
    ),
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
