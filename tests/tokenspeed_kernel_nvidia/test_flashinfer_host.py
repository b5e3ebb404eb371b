"""FlashInfer kernels against a fake ``flashinfer`` module (no GPU, no flashinfer needed).

The fake records every wrapper construction, ``plan`` and ``run``. What is pinned here:
a call with ``sinks`` goes to ``BatchAttentionWithAttentionSinkWrapper`` (built with the
dtypes, head dims, window mode and the backend FlashInfer's rule resolves), is planned once
per layout and run with ``(sinks, sm_scale)`` as the variant's positional arguments and a
natural-log LSE; a call without sinks stays on the decode / paged-prefill wrapper (whose
``run(..., sinks=)`` ignores sinks on FA2/FA3: the H100 bug of 2026-11-23); sinks with a
logit cap are rejected at selection with a reason.
"""

from __future__ import annotations

import importlib.machinery
import math
import sys
import types

import pytest
import torch

from tokenspeed_kernel import config, platform, selector
from tokenspeed_kernel.tools.cases import attention as cases

FP8 = torch.float8_e4m3fn
LSE_WRITTEN = 1.5  # what the fake kernels write into lse


class _Wrapper:
    log: list

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.plans: list = []
        self.runs: list = []
        self.log.append(self)

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))

    def run(self, q, kv, *args, out=None, lse=None, return_lse=False, **kwargs):
        self.runs.append((q, kv, args, {"return_lse": return_lse, **kwargs}))
        out.fill_(0.25)
        if lse is not None:
            lse.fill_(LSE_WRITTEN)


@pytest.fixture
def fake(monkeypatch):
    """A ``flashinfer`` module with recording wrappers, visible to ``find_spec`` (so the
    kernels are available), and selection for sm_90 on this CPU machine."""
    from tokenspeed_kernel_nvidia.ops.attention import _flashinfer, _flashinfer_prefill, flashinfer_decode

    log: list = []
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    for name in (
        "BatchDecodeWithPagedKVCacheWrapper",
        "BatchPrefillWithPagedKVCacheWrapper",
        "BatchAttentionWithAttentionSinkWrapper",
    ):
        setattr(module, name, type(name, (_Wrapper,), {"log": log}))
    utils = types.ModuleType("flashinfer.utils")
    utils.__spec__ = importlib.machinery.ModuleSpec("flashinfer.utils", None)
    backends: list = []

    def determine_attention_backend(device, pos, fp16_qk, custom_mask, q_dtype, kv_dtype, **dims):
        backends.append((pos, fp16_qk, custom_mask, q_dtype, kv_dtype, dims))
        return "fa2" if kv_dtype == FP8 else "fa3"  # FlashInfer's rule on sm_90

    utils.determine_attention_backend = determine_attention_backend
    module.utils = utils
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)
    monkeypatch.setenv(config.PLATFORM_ENV, "sm_90")
    monkeypatch.setattr(_flashinfer, "_sink_modules", {})
    config.refresh()
    platform.refresh()
    selector.clear_cache()
    flashinfer_decode._cache.clear()
    _flashinfer_prefill._cache.clear()
    yield types.SimpleNamespace(log=log, backends=backends)
    flashinfer_decode._cache.clear()
    _flashinfer_prefill._cache.clear()
    monkeypatch.delenv(config.PLATFORM_ENV)
    config.refresh()
    platform.refresh()
    selector.clear_cache()


def _built(log, cls):
    return [w for w in log if type(w).__name__ == cls]


def _decode_case(**kw):
    base = {"page_size": 4, "sinks": True, "return_lse": True}
    return cases.AttentionCase("attention.decode", (1, 1, 1), (9, 1, 30), 8, 2, 64, **(base | kw))


def test_decode_with_sinks_runs_the_sink_wrapper_in_graph_mode(fake):
    case = _decode_case(window_left=5)
    inputs = cases.make_inputs(case)
    out, lse = cases.call(case, inputs, override="flashinfer_decode")
    cases.call(case, inputs, override="flashinfer_decode")  # same layout tensors: no new plan
    assert _built(fake.log, "BatchDecodeWithPagedKVCacheWrapper") == []
    (wrapper,) = _built(fake.log, "BatchAttentionWithAttentionSinkWrapper")
    kw = wrapper.kwargs
    assert wrapper.args[1] == "NHD"
    assert (kw["q_data_type"], kw["kv_data_type"]) == (torch.bfloat16, torch.bfloat16)
    assert (kw["head_dim_qk"], kw["head_dim_vo"], kw["window_left"], kw["backend"]) == (64, 64, 5, "fa3")
    assert kw["use_cuda_graph"] is True
    assert kw["qo_indptr_buf"].tolist() == [0, 1, 2, 3]
    for name in ("paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf"):
        assert isinstance(kw[name], torch.Tensor)
    assert len(wrapper.plans) == 1 and len(wrapper.runs) == 2
    args, plan_kw = wrapper.plans[0]
    assert args[0] is kw["qo_indptr_buf"] and args[1] is kw["paged_kv_indptr_buf"]
    assert args[1].tolist() == [0, 3, 4, 12]  # pages of 9, 1, 30 tokens at P=4
    assert args[4:8] == (8, 2, 64, 4)
    assert plan_kw["causal"] is True and plan_kw["window_left"] == 5
    assert plan_kw["sm_scale"] == pytest.approx(1 / 8) and "logits_soft_cap" not in plan_kw
    q, kv, extra, run_kw = wrapper.runs[0]
    assert q.shape == (3, 8, 64) and kv == (inputs["k_cache"], inputs["v_cache"])
    assert len(extra) == 2 and extra[0] is inputs["sinks"] and extra[1] == pytest.approx(1 / 8)
    assert run_kw == {"return_lse": True, "lse_base": "ln"}  # no ignored sinks= keyword
    assert torch.all(lse == LSE_WRITTEN)  # natural log from FlashInfer: not rescaled by ln 2
    assert torch.all(out == 0.25)
    inputs["cache_seqlens"].add_(1)  # the layout changed in place: one new plan
    cases.call(case, inputs, override="flashinfer_decode")
    assert len(wrapper.plans) == 2 and len(_built(fake.log, "BatchAttentionWithAttentionSinkWrapper")) == 1


def test_decode_without_sinks_keeps_the_decode_wrapper(fake):
    case = _decode_case(sinks=False)
    inputs = cases.make_inputs(case)
    _, lse = cases.call(case, inputs, override="flashinfer_decode")
    assert _built(fake.log, "BatchAttentionWithAttentionSinkWrapper") == []
    (wrapper,) = _built(fake.log, "BatchDecodeWithPagedKVCacheWrapper")
    assert wrapper.kwargs["backend"] == "fa2" and wrapper.kwargs["use_cuda_graph"] is True
    _, _, extra, run_kw = wrapper.runs[0]
    assert extra == () and "sinks" not in run_kw
    assert torch.allclose(lse, torch.full_like(lse, LSE_WRITTEN * math.log(2.0)))  # base 2 -> ln


def test_decode_sinks_fp8_spec_resolves_fa2_and_scales(fake):
    case = cases.AttentionCase("attention.decode", (2, 2), (9, 30), 8, 2, 64, page_size=4, kv_dtype=FP8, sinks=True)
    inputs = cases.make_inputs(case)
    out = cases.call(case, inputs, override="flashinfer_decode")
    (wrapper,) = _built(fake.log, "BatchAttentionWithAttentionSinkWrapper")
    assert (wrapper.kwargs["kv_data_type"], wrapper.kwargs["backend"]) == (FP8, "fa2")
    assert wrapper.kwargs["window_left"] == -1
    assert wrapper.kwargs["qo_indptr_buf"].tolist() == [0, 2, 4]  # q_len 2 per sequence
    assert fake.backends[-1][:5] == (0, False, False, torch.bfloat16, FP8)
    q, _, extra, run_kw = wrapper.runs[0]
    assert torch.equal(q, (inputs["q"].reshape(4, 8, 64).float() * 0.05).to(torch.bfloat16))  # k_scale in q
    assert run_kw["return_lse"] is False and extra[0] is inputs["sinks"]
    assert torch.allclose(out.float(), torch.full_like(out.float(), 0.25 * 0.05), rtol=1e-2)  # v_scale on out


def test_plan_step_and_run_share_the_sink_entry(fake):
    """``mha_decode_plan`` plans the sink wrapper outside capture; the run finds it planned."""
    from tokenspeed_kernel import mha_decode_plan

    case = _decode_case(return_lse=False)
    inputs = cases.make_inputs(case)
    plan = mha_decode_plan(
        inputs["k_cache"],
        inputs["v_cache"],
        inputs["page_table"],
        inputs["cache_seqlens"],
        30,
        num_q_heads=8,
        sinks=inputs["sinks"],
        capturable=True,
        override="flashinfer_decode",
    )
    (wrapper,) = _built(fake.log, "BatchAttentionWithAttentionSinkWrapper")
    assert len(wrapper.plans) == 1 and wrapper.runs == []
    plan.run(inputs["q"])
    inputs["cache_seqlens"].add_(1)
    plan.update()
    plan.run(inputs["q"])
    assert len(wrapper.plans) == 2 and len(wrapper.runs) == 2
    assert len(_built(fake.log, "BatchAttentionWithAttentionSinkWrapper")) == 1


@pytest.mark.parametrize("op", ["attention.extend", "attention.prefill"])
def test_extend_and_prefill_with_sinks_run_the_sink_wrapper(fake, op):
    name = "flashinfer_" + op.split(".")[1]
    # Windows past the keys are capped.
    case = cases.AttentionCase(
        op, (3, 5), (7, 5), 8, 2, 64, page_size=16, sinks=True, return_lse=True, window_left=3, causal=False
    )
    inputs = cases.make_inputs(case)
    _, lse = cases.call(case, inputs, override=name)
    cases.call(case, inputs, override=name)
    assert _built(fake.log, "BatchPrefillWithPagedKVCacheWrapper") == []
    (wrapper,) = _built(fake.log, "BatchAttentionWithAttentionSinkWrapper")
    kw = wrapper.kwargs
    assert (kw["q_data_type"], kw["kv_data_type"], kw["head_dim_qk"], kw["head_dim_vo"]) == (
        torch.bfloat16,
        torch.bfloat16,
        64,
        64,
    )
    assert (kw["window_left"], kw["backend"]) == (3, "fa3") and "use_cuda_graph" not in kw
    assert len(wrapper.plans) == 1 and len(wrapper.runs) == 2
    args, plan_kw = wrapper.plans[0]
    assert args[0] is inputs["cu_seqlens_q"] and args[7] == (16 if op == "attention.extend" else 1)
    assert plan_kw["causal"] is False and plan_kw["window_left"] == 3 and "logits_soft_cap" not in plan_kw
    _, _, extra, run_kw = wrapper.runs[0]
    assert extra[0] is inputs["sinks"] and extra[1] == pytest.approx(1 / 8)
    assert run_kw == {"return_lse": True, "lse_base": "ln"}
    assert torch.all(lse == LSE_WRITTEN)


@pytest.mark.parametrize("op", ["attention.extend", "attention.prefill"])
def test_extend_and_prefill_without_sinks_keep_the_prefill_wrapper(fake, op):
    name = "flashinfer_" + op.split(".")[1]
    case = cases.AttentionCase(op, (3, 5), (7, 5), 8, 2, 64, page_size=16, logit_cap=30.0)
    cases.call(case, cases.make_inputs(case), override=name)
    assert _built(fake.log, "BatchAttentionWithAttentionSinkWrapper") == []
    (wrapper,) = _built(fake.log, "BatchPrefillWithPagedKVCacheWrapper")
    assert wrapper.plans[0][1]["logits_soft_cap"] == 30.0
    _, _, extra, run_kw = wrapper.runs[0]
    assert extra == () and "sinks" not in run_kw


def test_sinks_and_no_sinks_get_separate_wrappers(fake):
    case = cases.AttentionCase("attention.extend", (3,), (7,), 8, 2, 64, page_size=16)
    inputs = cases.make_inputs(case)
    cases.call(case, inputs, override="flashinfer_extend")
    sink_case = cases.AttentionCase("attention.extend", (3,), (7,), 8, 2, 64, page_size=16, sinks=True)
    cases.call(sink_case, {**inputs, "sinks": cases.make_inputs(sink_case)["sinks"]}, override="flashinfer_extend")
    assert len(_built(fake.log, "BatchPrefillWithPagedKVCacheWrapper")) == 1
    assert len(_built(fake.log, "BatchAttentionWithAttentionSinkWrapper")) == 1


@pytest.mark.parametrize("op", ["attention.decode", "attention.extend", "attention.prefill"])
def test_sinks_with_logit_cap_rejected_with_reason(fake, op):
    from tokenspeed_kernel import explain
    from tokenspeed_kernel_nvidia.ops.attention._flashinfer import SINKS_WITH_LOGIT_CAP

    name = "flashinfer_" + op.split(".")[1]
    lengths = ((1, 1), (9, 5)) if op == "attention.decode" else ((3, 5), (7, 5))
    capped = cases.AttentionCase(op, *lengths, 8, 2, 64, sinks=True, logit_cap=30.0)
    reasons = {c.spec.name: c.reasons for c in explain(cases.request(capped)).candidates}
    assert reasons[name] == (SINKS_WITH_LOGIT_CAP,)
    for served in ({"sinks": True}, {"logit_cap": 30.0}, {"sinks": True, "kv_dtype": FP8}):
        if "kv_dtype" in served and op == "attention.prefill":
            continue
        case = cases.AttentionCase(op, *lengths, 8, 2, 64, **served)
        reasons = {c.spec.name: c.reasons for c in explain(cases.request(case)).candidates}
        assert reasons[name] == (), (served, reasons[name])
    from tokenspeed_kernel.selector import KernelOverrideError

    with pytest.raises(KernelOverrideError, match="has no logits soft-cap"):
        cases.call(capped, cases.make_inputs(capped), override=name)


def test_direct_call_with_sinks_and_cap_raises(fake):
    """Past the selector (a direct kernel call), sinks + cap raise instead of dropping the cap."""
    from tokenspeed_kernel_nvidia.ops.attention import _flashinfer_prefill, flashinfer_decode

    case = _decode_case(logit_cap=30.0)
    inputs = cases.make_inputs(case)
    args = types.SimpleNamespace(sinks=inputs["sinks"], logit_cap=30.0)
    with pytest.raises(ValueError, match="no logits soft-cap"):
        flashinfer_decode._entry(args)
    call = types.SimpleNamespace(
        q=torch.zeros(1, 8, 64), k_cache=torch.zeros(1, 4, 2, 64), sinks=inputs["sinks"], logit_cap=30.0
    )
    with pytest.raises(ValueError, match="no logits soft-cap"):
        _flashinfer_prefill.run_paged_prefill(call)
    assert fake.log == []


def test_sink_module_name_collision_is_refused(fake):
    """FlashInfer 0.7.2 names the sink JIT module without the KV dtype or head dims: a second
    wrapper differing only in those would load the first one's library, so it raises."""
    from tokenspeed_kernel_nvidia.ops.attention._flashinfer import make_sink_wrapper

    common = {"q_dtype": torch.bfloat16, "kv_dtype": torch.bfloat16, "head_dim_vo": 64}
    make_sink_wrapper(torch.device("cpu"), head_dim_qk=64, window_left=-1, **common)
    make_sink_wrapper(torch.device("cpu"), head_dim_qk=64, window_left=-1, **common)  # same module: fine
    make_sink_wrapper(torch.device("cpu"), head_dim_qk=128, window_left=3, **(common | {"head_dim_vo": 128}))
    with pytest.raises(RuntimeError, match="already built in this process"):
        make_sink_wrapper(torch.device("cpu"), head_dim_qk=128, window_left=-1, **(common | {"head_dim_vo": 128}))
    assert len(fake.log) == 3
