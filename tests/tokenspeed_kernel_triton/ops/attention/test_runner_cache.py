"""The functional calls' runner caches of ``triton_decode``, ``triton_extend`` and ``triton_prefill``.

Calls that share a key (three "layers": other caches, tables, q, out) run one runner, bound
once; each of its launches gets that call's tensors and the same scalars, grids and constexprs
as a fresh bind of the call (launches recorded, nothing run). A changed key (dtype, cache
strides, split count, window, scale, query rows) binds anew. Under the interpreter, calls
through the cache match the float64 attention.
"""

import dataclasses

import pytest
import torch
from support.launch_recorder import Recorder, assert_same_launches
from support.naive_attention import check_case

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel_triton.ops.attention import decode, extend, prefill

MODULES = {"attention.decode": decode, "attention.extend": extend, "attention.prefill": prefill}
KERNEL = {
    "attention.decode": "triton_decode",
    "attention.extend": "triton_extend",
    "attention.prefill": "triton_prefill",
}
DEVICE = "cpu"
# CPU tensors reach the Triton kernels only under the interpreter, which a GPU host's tests run
# without; there test_launcher_gpu.py runs every functional runner on the GPU, bitwise against
# the uncached call over three layers.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="runner-cache tests run CPU tensors under Triton's interpreter; on a GPU: test_launcher_gpu.py",
)

CASES = {
    "decode": cases.AttentionCase("attention.decode", (1, 1, 1), (37, 5, 90), 8, 2, 64, sinks=True, return_lse=True),
    "decode_spec": cases.AttentionCase("attention.decode", (2, 2), (40, 7), 4, 4, 32, window_left=9, logit_cap=20.0),
    "extend": cases.AttentionCase("attention.extend", (3, 17), (40, 90), 8, 2, 64, sinks=True, cache_layout="hnd"),
    "extend_fp8": cases.AttentionCase(
        "attention.extend", (5,), (33,), 4, 1, 64, kv_dtype=torch.float8_e4m3fn, return_lse=True
    ),
    "prefill": cases.AttentionCase("attention.prefill", (20, 9), (20, 9), 8, 2, 64, window_left=5, sinks=True),
    "prefill_prefix": cases.AttentionCase("attention.prefill", (4, 6), (30, 6), 6, 3, 80, causal=False),
}


class _Spy:
    """Stands in for a kernel module's ``_RUNNERS``: remembers each call's rows, then runs it."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.rows: list = []

    def __call__(self, rows) -> None:
        self.rows.append(rows)
        self.cache(rows)


def _row_tensors(rows) -> list:
    return [getattr(rows, f.name) for f in dataclasses.fields(rows) if isinstance(getattr(rows, f.name), torch.Tensor)]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_runner_launches_what_a_fresh_bind_launches(monkeypatch, name, splits):
    case = CASES[name]
    if splits > 1 and case.op != "attention.decode":
        pytest.skip("split-KV is decode's")
    module = MODULES[case.op]
    if case.op == "attention.decode":
        monkeypatch.setattr(module, "num_splits", lambda *a: splits)
    cache = module._RUNNERS
    cache.clear()
    spy = _Spy(cache)
    monkeypatch.setattr(module, "_RUNNERS", spy)
    rec = Recorder().install(monkeypatch)
    binds = cache.binds
    for layer in range(3):
        inputs = cases.make_inputs(case, DEVICE, seed=layer)
        out = torch.full((sum(case.seqlens_q), case.num_q_heads, case.dv), float("nan"), dtype=case.dtype)
        if case.op == "attention.decode" and set(case.seqlens_q) != {1}:
            out = out.view(case.batch, case.seqlens_q[0], case.num_q_heads, case.dv)
        elif case.op == "attention.decode":
            out = out.view(case.batch, case.num_q_heads, case.dv)
        start = len(rec.launches)
        cases.call(case, inputs, out=out)
        cached = rec.since(start)
        rows = spy.rows[-1]
        cache._fresh(rows)  # the reference: bound afresh, full arguments
        fresh = rec.since(start + len(cached))
        assert len(cached) == (2 if splits > 1 else 1)
        assert rows.out.data_ptr() == out.data_ptr()
        assert_same_launches(cached, fresh, _row_tensors(rows))
    assert cache.binds == binds + 1, "three layers of one key: one bind"
    assert rec.bound == len(cached), "each launch of the runner bound once"


def test_one_lengths_tensor_for_queries_and_keys_binds_positions_of_its_own(monkeypatch):
    """A self-attention call passes one ``cu_seqlens`` for queries and keys; the runner it
    binds must still launch a later call's two distinct tensors at their own positions."""
    case = cases.AttentionCase("attention.prefill", (20, 9), (20, 9), 8, 2, 64)
    cache = prefill._RUNNERS
    cache.clear()
    spy = _Spy(cache)
    monkeypatch.setattr(prefill, "_RUNNERS", spy)
    rec = Recorder().install(monkeypatch)
    inputs = cases.make_inputs(case, DEVICE, seed=0)
    assert inputs["cu_seqlens_q"] is inputs["cu_seqlens_k"]
    cases.call(case, inputs)
    inputs = {**inputs, "cu_seqlens_k": inputs["cu_seqlens_q"].clone()}
    start = len(rec.launches)
    cases.call(case, inputs)
    (cached,) = rec.since(start)
    assert cache.binds and len(cache.runners) == 1
    cache._fresh(spy.rows[-1])
    assert_same_launches([cached], rec.since(start + 1), _row_tensors(spy.rows[-1]))
    assert cached[2][12] is inputs["cu_seqlens_k"] and cached[2][11] is inputs["cu_seqlens_q"]


def _key(case, monkeypatch, splits=1, **changes):
    module = MODULES[case.op]
    if case.op == "attention.decode":
        monkeypatch.setattr(module, "num_splits", lambda *a: splits)
    spy = _Spy(lambda rows: None)
    monkeypatch.setattr(module, "_RUNNERS", spy)
    inputs = cases.make_inputs(case, DEVICE, seed=0)
    inputs.update(changes)
    cases.call(case, inputs)
    from tokenspeed_kernel_triton.ops.attention._launch import _rows_key

    return _rows_key(spy.rows[-1], splits)


def test_a_changed_key_binds_anew(monkeypatch):
    decode_case, extend_case, prefill_case = CASES["decode"], CASES["extend"], CASES["prefill"]
    base = _key(decode_case, monkeypatch)
    assert _key(decode_case, monkeypatch) == base, "same shapes, other tensors: one key"
    changed = [
        _key(dataclasses.replace(decode_case, dtype=torch.float16), monkeypatch),
        _key(dataclasses.replace(decode_case, cache_layout="hnd"), monkeypatch),  # cache strides
        _key(decode_case, monkeypatch, splits=2),
        _key(dataclasses.replace(decode_case, window_left=31), monkeypatch),
        _key(decode_case, monkeypatch, softmax_scale=0.3),
        _key(dataclasses.replace(decode_case, sinks=False), monkeypatch),
        _key(dataclasses.replace(decode_case, return_lse=False), monkeypatch),
    ]
    assert len({base, *changed}) == len(changed) + 1
    # The decode's growing key bound does not change the key; extend's query rows do.
    assert _key(decode_case, monkeypatch, max_seqlen_k=95) == base
    ext = _key(extend_case, monkeypatch)
    assert _key(extend_case, monkeypatch, max_seqlen_q=16) != ext
    pre = _key(prefill_case, monkeypatch)
    assert _key(dataclasses.replace(prefill_case, causal=False), monkeypatch) != pre


@pytest.mark.parametrize("name", ["decode", "decode_spec", "extend", "extend_fp8", "prefill", "prefill_prefix"])
def test_calls_through_the_cache_match_the_float64_attention(name):
    """Three calls of one key, each with its own data, through one runner (interpreter)."""
    case = CASES[name]
    cache = MODULES[case.op]._RUNNERS
    cache.clear()
    binds = cache.binds
    tol = 2e-2 if case.dtype == torch.bfloat16 else 3e-3
    for layer in range(3):
        inputs = cases.make_inputs(case, DEVICE, seed=10 + layer)
        check_case(case, inputs, kernel=KERNEL[case.op], tol=tol, device=DEVICE)
    assert cache.binds == binds + 1


# The step plans and the per-layer arguments of their runs.
_STEP_PLANS = {
    "attention.extend": ("mha_extend_plan", ("q", "k_cache", "v_cache", "sinks", "k_scale", "v_scale")),
    "attention.prefill": ("mha_prefill_plan", ("q", "k", "v", "sinks")),
}


@pytest.mark.parametrize("name", ["extend", "extend_fp8", "prefill", "prefill_prefix"])
def test_a_step_plan_binds_once_and_runs_each_layer_as_the_call(name):
    """``mha_extend_plan`` / ``mha_prefill_plan`` with the Triton kernel: the first run binds
    through the kernel's ``bind`` hook (the runner of the plan's key, shared with the functional
    calls), the later layers (other q, keys or caches, sinks) run that runner without computing
    the key, each bitwise as the functional call and within float64's bounds."""
    import tokenspeed_kernel
    from tokenspeed_kernel_triton._runners import clear_runners

    case = CASES[name]
    make_plan, per_layer = _STEP_PLANS[case.op]
    kernel, module = KERNEL[case.op], MODULES[case.op]
    clear_runners()
    first = cases.make_inputs(case, DEVICE, seed=0)
    layers = [first] + [
        {**first, **{k: v for k, v in cases.make_inputs(case, DEVICE, seed=s).items() if k in per_layer}}
        for s in (1, 2)
    ]
    plan = getattr(tokenspeed_kernel, make_plan)(**first, override=kernel)
    binds, keys, real_key = module._RUNNERS.binds, [], module._RUNNERS._key
    module._RUNNERS._key = lambda rows: keys.append(rows) or real_key(rows)
    try:
        got = [
            plan.run(*(inputs[k] for k in per_layer[:3]), **{k: inputs.get(k) for k in per_layer[3:]})
            for inputs in layers
        ]
    finally:
        module._RUNNERS._key = real_key
    assert len(keys) == 1 and module._RUNNERS.binds == binds + 1, "one key, at the bind; none per run"
    for inputs, result in zip(layers, got):
        want = cases.call(case, inputs, override=kernel)
        pairs = zip(result, want) if case.return_lse else [(result, want)]
        for a, b in pairs:
            assert torch.equal(a, b)
        out = (result[0] if case.return_lse else result).double()
        ref, _ = cases.reference(case, inputs)
        assert float((out - ref).norm() / ref.norm()) < 2e-2, name
