"""The per-op call-key tables (ops/_checks.py): a remembered call never lets a bad one through.

A key stands for what the full checks read (exact types, shapes, dtypes, devices,
contiguity, option values); values that change per call (``max_seqlen_*``, pointers) are
checked on every call; anything else is checked in full and not remembered.
"""

import pytest
import torch

from tokenspeed_kernel import config, mha_decode_with_kvcache, mha_prefill, moe_apply, moe_plan, store_kvcache
from tokenspeed_kernel.ops import _checks
from tokenspeed_kernel.ops.attention import api as attention_api
from tokenspeed_kernel.tools.cases import attention as cases
from tokenspeed_kernel.tools.cases import moe as moe_cases

pytestmark = pytest.mark.usefixtures("only_reference")

PREFILL = cases.AttentionCase("attention.prefill", (5, 9), (5, 12), 4, 2, 16, dtype=torch.float32)
DECODE = cases.AttentionCase("attention.decode", (1, 1), (10, 7), 4, 2, 16, page_size=4, dtype=torch.float32)
STORE_FP8 = cases.AttentionCase(
    "kvcache.store", (3, 2), (3, 2), 4, 2, 16, page_size=4, dtype=torch.float32, kv_dtype=torch.float8_e4m3fn
)


@pytest.fixture(autouse=True)
def _fresh_tables():
    _checks.clear_call_tables()
    yield
    _checks.clear_call_tables()


def _prefill(inputs, **changes):
    args = {**inputs, **changes}
    return mha_prefill(
        args["q"],
        args["k"],
        args["v"],
        args["cu_seqlens_q"],
        args["cu_seqlens_k"],
        args["max_seqlen_q"],
        args["max_seqlen_k"],
        causal=args.get("causal", True),
        window_left=args.get("window_left", -1),
        logit_cap=args.get("logit_cap", 0.0),
    )


def test_a_hit_is_remembered_and_reused():
    inputs = cases.make_inputs(PREFILL)
    first = _prefill(inputs)
    assert len(attention_api._PREFILL_CALLS) == 1
    (checked,) = attention_api._PREFILL_CALLS.values()
    assert torch.equal(_prefill(inputs), first)
    assert list(attention_api._PREFILL_CALLS.values()) == [checked]


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ({"causal": 1}, TypeError, "causal must be a bool"),  # 1 == True, but not a bool
        ({"window_left": True}, TypeError, "window_left must be an int"),
        ({"logit_cap": False}, TypeError, "logit_cap must be a float"),
        ({"max_seqlen_q": -1}, ValueError, "max_seqlen_q must be >= 0"),  # not part of the key
        ({"max_seqlen_k": 3.0}, TypeError, "max_seqlen_k must be an int"),
        ({"max_seqlen_k": True}, TypeError, "max_seqlen_k must be an int"),
    ],
)
def test_values_equal_to_a_remembered_call_but_of_another_type_are_rejected(change, exc, match):
    inputs = cases.make_inputs(PREFILL)
    _prefill(inputs)
    with pytest.raises(exc, match=match):
        _prefill(inputs, **change)


def test_a_tensor_changed_in_place_is_checked_again():
    inputs = cases.make_inputs(PREFILL)
    _prefill(inputs)
    q = inputs["q"]
    q.as_strided_(q.shape, (1, q.shape[0], q.shape[0] * q.shape[1]))  # same shape, not contiguous
    with pytest.raises(ValueError, match="q must be contiguous"):
        _prefill(inputs)


def test_a_tensor_subclass_is_checked_in_full_and_not_remembered():
    inputs = cases.make_inputs(PREFILL)
    expected = _prefill(inputs)
    param = torch.nn.Parameter(inputs["q"].clone(), requires_grad=False)
    with torch.no_grad():
        assert torch.allclose(_prefill(inputs, q=param), expected)
    assert len(attention_api._PREFILL_CALLS) == 1
    with pytest.raises(ValueError, match="q must be 3-D"):
        _prefill(inputs, q=torch.nn.Parameter(inputs["q"][0].clone(), requires_grad=False))


def test_decode_checks_max_seqlen_k_against_q_len_on_every_call():
    inputs = cases.make_inputs(DECODE)
    cases.call(DECODE, inputs)
    args = [inputs[k] for k in ("q", "k_cache", "v_cache", "page_table", "cache_seqlens")]
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 1"):
        mha_decode_with_kvcache(*args, 0)


def test_debug_checks_still_run_on_a_remembered_call(monkeypatch):
    inputs = cases.make_inputs(PREFILL)
    _prefill(inputs)
    monkeypatch.setenv(config.DEBUG_ENV, "1")
    config.refresh()
    try:
        bad = inputs["cu_seqlens_q"].clone()
        bad[-1] += 1
        with pytest.raises(ValueError, match="TOKENSPEED_KERNEL_DEBUG check"):
            _prefill(inputs, cu_seqlens_q=bad)
    finally:
        monkeypatch.delenv(config.DEBUG_ENV)
        config.refresh()


def test_fp8_scales_are_checked_per_value_and_their_tensors_are_per_call():
    inputs = cases.make_inputs(STORE_FP8)
    cases.call(STORE_FP8, inputs)
    for bad, exc, match in (
        (-1.0, ValueError, "k_scale must be > 0"),
        (float("nan"), ValueError, "k_scale must be finite"),
        (torch.ones(2), ValueError, "k_scale must be a float or a one-element float32 tensor"),
        (1, None, None),  # an int scale is valid, and a key of its own
    ):
        if exc is None:
            cases.call(STORE_FP8, {**inputs, "k_scale": bad})
            continue
        with pytest.raises(exc, match=match):
            cases.call(STORE_FP8, {**inputs, "k_scale": bad})
    scale = torch.full((1,), 0.5)
    store_kvcache(*(inputs[k] for k in ("k", "v", "k_cache", "v_cache", "slot_mapping")), k_scale=scale, v_scale=0.5)
    assert all(not isinstance(facts, torch.Tensor) for table in _checks._TABLES for facts in table.values())


def test_moe_out_aliasing_x_is_checked_on_every_call():
    case = moe_cases.MoECase("moe.apply", 5, 64, 32, 8, 2, torch.float32)
    kwargs = moe_cases.make_inputs(case, seed=0)
    moe_apply(**kwargs, out=torch.empty_like(kwargs["x"]))
    with pytest.raises(ValueError, match="out must not alias x"):
        moe_apply(**kwargs, out=kwargs["x"])
    plan = moe_plan(kwargs["w13"], kwargs["w2"], x_dtype=torch.float32, top_k=2)
    routing = (kwargs["x"], kwargs["topk_weights"], kwargs["topk_ids"])
    plan.apply(*routing, out=torch.empty_like(kwargs["x"]))
    with pytest.raises(ValueError, match="out must not alias x"):
        plan.apply(*routing, out=kwargs["x"])


def test_tables_are_bounded(monkeypatch):
    monkeypatch.setattr(_checks, "CALL_CACHE_LIMIT", 4)
    inputs = cases.make_inputs(PREFILL)
    for window in range(10):
        _prefill(inputs, window_left=window)
        assert 1 <= len(attention_api._PREFILL_CALLS) <= 4
