"""GPU: the step plans (``mha_prefill_plan``, ``mha_extend_plan``, ``mha_decode_step_plan``) with
every attention kernel that registers a ``step_runner`` hook, named by ``override=``: three
layers of one step (the same lengths and tables; each layer its own q, keys or caches and
sinks), each run into a NaN-poisoned ``out``, bitwise as the functional call and within
float64's bounds; the plan's first run asks for the kernel's step runner, which serves every
run. Skips (with the printed reason) without CUDA, under the
interpreter, and for the Gluon kernels off sm_90.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.gpu import sm90_skip_reason

import tokenspeed_kernel
from tokenspeed_kernel import registry
from tokenspeed_kernel.tools import cases

SKIP = None
if not torch.cuda.is_available():
    SKIP = "no CUDA device: the step plans' kernels run on a GPU here (CPU: test_step_plan.py)"
elif os.environ.get("TRITON_INTERPRET") == "1":
    SKIP = "TRITON_INTERPRET=1: the kernels' runners are bypassed under the interpreter"
if SKIP:
    print(f"test_step_plan_gpu: skipped: {SKIP}")
pytestmark = pytest.mark.skipif(SKIP is not None, reason=SKIP or "")

# GPT-OSS heads, ragged lengths off the 128-row tile, sinks; the window layers' 128 tokens
_PREFILL = dict(num_q_heads=64, num_kv_heads=8, head_dim=64, sinks=True)
PREFILL = cases.AttentionCase("attention.prefill", (300, 37, 129), (300, 37, 129), **_PREFILL)
PREFILL_WINDOW = cases.AttentionCase("attention.prefill", (300, 37, 129), (300, 37, 129), window_left=127, **_PREFILL)
EXTEND = cases.AttentionCase("attention.extend", (200, 1, 70), (2248, 37, 70), 64, 8, 64, sinks=True, return_lse=True)
EXTEND_HND = cases.AttentionCase("attention.extend", (5, 130), (77, 400), 16, 2, 64, sinks=True, cache_layout="hnd")
DECODE = cases.AttentionCase(
    "attention.decode", (1,) * 5, (1, 37, 300, 1000, 8192), 64, 8, 64, window_left=127, sinks=True
)
KERNELS = [
    ("triton_prefill", PREFILL),
    ("gluon_prefill_window_sm90", PREFILL_WINDOW),
    ("gluon_prefill_fa3_sm90", PREFILL),
    ("gluon_prefill_fa3_window_sm90", PREFILL_WINDOW),
    ("triton_extend", EXTEND),
    ("triton_extend", EXTEND_HND),
    ("gluon_extend_fa3_sm90", EXTEND),
    ("gluon_extend_fa3_sm90", EXTEND_HND),
    ("triton_decode", DECODE),
    ("gluon_decode_sm90", DECODE),
]
_PLANS = {
    "attention.prefill": ("mha_prefill_plan", ("q", "k", "v"), ("sinks",)),
    "attention.extend": ("mha_extend_plan", ("q", "k_cache", "v_cache"), ("sinks", "k_scale", "v_scale")),
    "attention.decode": ("mha_decode_step_plan", ("q", "k_cache", "v_cache"), ("sinks", "k_scale", "v_scale")),
}


@pytest.mark.parametrize("kernel,case", KERNELS, ids=lambda x: x if isinstance(x, str) else x.describe())
def test_a_planned_step_runs_each_layer_as_the_call(kernel, case):
    spec = registry.get_kernel(kernel)
    if spec.archs:  # the Gluon kernels: sm_90 only
        reason = sm90_skip_reason()
        if reason:
            print(f"SKIP {kernel}: {reason}")
            pytest.skip(reason)
    assert spec.step_runner is not None, f"{kernel} registers no step_runner hook"
    make, positional, optional = _PLANS[case.op]
    first = cases.make_inputs(case, "cuda", seed=0)
    layers = [first] + [
        {**first, **{k: v for k, v in cases.make_inputs(case, "cuda", seed=s).items() if k in (*positional, *optional)}}
        for s in (1, 2)
    ]
    plan = getattr(tokenspeed_kernel, make)(**first, override=kernel)
    for layer, inputs in enumerate(layers):
        out = torch.full_like(inputs["q"], float("nan"))
        got = plan.run(*(inputs[k] for k in positional), **{k: inputs.get(k) for k in optional}, out=out)
        assert plan._runner and plan._runner[0] is not spec.fn, "the first run asks for the step runner"
        want = cases.call(case, inputs, override=kernel)
        pairs = list(zip(got, want)) if case.return_lse else [(got, want)]
        assert pairs[0][0] is out and not out.isnan().any(), f"layer {layer}: rows left unwritten"
        for a, b in pairs:
            assert torch.equal(a, b), f"layer {layer}: the plan's run differs from the call"
        ref, _ = cases.reference(case, inputs)
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel < 2e-2, f"{kernel} layer {layer}: rel {rel:.2e}"
