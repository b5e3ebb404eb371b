"""The TensorRT-LLM kernels (XQA decode, FMHAv2 prefill) against a fake ``flashinfer``
module (no GPU, no flashinfer needed).

The fake's ``decode.xqa_batch_decode_with_kv_cache`` and ``prefill.trtllm_fmha_v2_prefill``
record their arguments and fill ``out``. What is pinned here: the layouts handed over
(``[batch * q_len, Hq, D]`` rows, the ``(k_cache, v_cache)`` NHD tuple, ``SEPARATE_Q_K_V``),
uint32 ``seq_lens`` sharing the cache lengths' storage, XQA's own zeroed workspace with
the 8 MiB semaphore head, the draft mask of speculative decode, sinks as the tensor itself
(never a list), the window and scale conventions, the selection gates with their reasons,
and that bad inputs raise before FlashInfer is called.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from tokenspeed_kernel import config, explain, platform, selector
from tokenspeed_kernel.tools.cases import attention as cases

FP8 = torch.float8_e4m3fn
XQA = "trtllm_xqa_decode"
FMHA = "trtllm_fmha_prefill"


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


@pytest.fixture
def fake(monkeypatch):
    """``flashinfer`` (visible to ``find_spec``) with recording ``decode``/``prefill``
    submodules, and selection for sm_90 on this CPU machine."""
    from tokenspeed_kernel_nvidia.ops.attention import trtllm_xqa_decode

    calls: list = []

    def xqa(query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len, **kw):
        calls.append(("xqa", (query, kv_cache, workspace_buffer, block_tables, seq_lens, max_seq_len), kw))
        kw["out"].fill_(0.25)
        return kw["out"]

    def fmha(
        qkv,
        input_layout,
        workspace_buffer,
        seq_lens,
        max_q_len,
        max_kv_len,
        bmm1_scale,
        bmm2_scale,
        batch_size,
        cum_seq_lens_q,
        cum_seq_lens_kv,
        **kw,
    ):
        calls.append(
            (
                "fmha",
                (
                    qkv,
                    input_layout,
                    workspace_buffer,
                    seq_lens,
                    max_q_len,
                    max_kv_len,
                    bmm1_scale,
                    bmm2_scale,
                    batch_size,
                    cum_seq_lens_q,
                    cum_seq_lens_kv,
                ),
                kw,
            )
        )
        kw["out"].fill_(0.5)
        return kw["out"]

    root, decode, prefill = _module("flashinfer"), _module("flashinfer.decode"), _module("flashinfer.prefill")
    decode.xqa_batch_decode_with_kv_cache = xqa
    prefill.trtllm_fmha_v2_prefill = fmha
    root.decode, root.prefill = decode, prefill
    for module in (root, decode, prefill):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setenv(config.PLATFORM_ENV, "sm_90")
    monkeypatch.setattr(trtllm_xqa_decode, "_masks", {})
    config.refresh()
    platform.refresh()
    selector.clear_cache()
    yield calls
    monkeypatch.delenv(config.PLATFORM_ENV)
    config.refresh()
    platform.refresh()
    selector.clear_cache()


def _decode(lens_k=(9, 1, 30), q_len=1, **kw):
    base = {"page_size": 16, "sinks": True, "head_dim": 64}
    return cases.AttentionCase("attention.decode", (q_len,) * len(lens_k), tuple(lens_k), 8, 2, **(base | kw))


def _only(calls, kind):
    (call,) = [c for c in calls if c[0] == kind]
    return call[1], call[2]


def test_xqa_decode_hands_over_layouts_uint32_lengths_workspace_and_sinks(fake):
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_xqa_decode import SEMAPHORE_BYTES, xqa_workspace

    case = _decode(window_left=20)
    inputs = cases.make_inputs(case)
    out = cases.call(case, inputs, override=XQA)
    (query, kv, ws, table, seq_lens, max_seq_len), kw = _only(fake, "xqa")
    assert query.shape == (3, 8, 64) and torch.equal(query, inputs["q"].reshape(3, 8, 64))
    assert kv == (inputs["k_cache"], inputs["v_cache"]) and kw["kv_layout"] == "NHD"
    assert table is inputs["page_table"] and max_seq_len == 30
    # uint32 lengths over the same storage: in-place updates reach a captured graph
    assert seq_lens.dtype == torch.uint32 and seq_lens.data_ptr() == inputs["cache_seqlens"].data_ptr()
    assert seq_lens.view(torch.int32).tolist() == [9, 1, 30]
    # XQA's own zeroed workspace, semaphores (first 8 MiB) included; not the shared FlashInfer one
    assert ws is xqa_workspace(ws.device) and ws.dtype == torch.uint8
    assert ws.numel() > SEMAPHORE_BYTES == 8 * 2**20 and not ws[:SEMAPHORE_BYTES].any()
    assert ws.data_ptr() != _shared_workspace_ptr(ws.device)
    assert kw["sinks"] is inputs["sinks"] and kw["sinks"].dtype == torch.float32
    assert kw["window_left"] == 20  # FlashInfer's window_left is ours (it gives XQA 21 keys)
    assert kw["bmm1_scale"] == pytest.approx(1 / 8) and kw["bmm2_scale"] == 1.0  # bf16 cache: no kv scale
    assert kw["q_len_per_req"] == 1 and kw["mask"] is None
    assert kw["out"].shape == (3, 8, 64) and torch.all(out == 0.25)


def _shared_workspace_ptr(device):
    from tokenspeed_kernel_nvidia.ops.attention._flashinfer import workspace

    return workspace(device).data_ptr()


def test_xqa_spec_decode_rows_and_causal_draft_mask(fake):
    case = _decode(lens_k=(9, 40), q_len=3, sinks=False)
    inputs = cases.make_inputs(case)
    out = cases.call(case, inputs, override=XQA)
    (query, *_), kw = _only(fake, "xqa")
    assert query.shape == (6, 8, 64) and kw["q_len_per_req"] == 3 and kw["sinks"] is None
    assert kw["window_left"] == -1 and kw["out"].shape == (6, 8, 64) and out.shape == (2, 3, 8, 64)
    mask = kw["mask"]
    assert mask.dtype == torch.uint16 and mask.shape == (2, 3, 2)  # ((3 + 31) // 32) * 2 uint16 per row
    assert mask.view(torch.int32)[..., 0].tolist() == [[1, 3, 7]] * 2  # row t sees draft tokens 0..t
    cases.call(case, inputs, override=XQA)
    assert fake[-1][2]["mask"] is mask  # built once per (device, batch, q_len)


def test_draft_mask_spans_several_words():
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_xqa_decode import draft_mask

    mask = draft_mask(1, 40, torch.device("cpu")).view(torch.int32)[0]
    assert mask.shape == (40, 2)
    for t in (0, 30, 31, 32, 39):
        bits = [(int(mask[t, c // 32]) >> (c % 32)) & 1 for c in range(40)]
        assert bits == [1] * (t + 1) + [0] * (39 - t), t


def test_xqa_refuses_an_fp8_cache(fake):
    """fp8_kv was withdrawn after its GPU check (0.034 relative error, over 0.02): the selector
    never offers it, and a direct call raises before FlashInfer."""
    from tokenspeed_kernel.ops.attention.args import DecodeArgs
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_xqa_decode import trtllm_xqa_decode

    case = _decode(kv_dtype=FP8, dtype=torch.float16)
    assert "does not support {fp8_kv}" in _reasons(case)[XQA]
    q = torch.zeros(2, 1, 8, 64, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 64, dtype=FP8)
    table, lens = torch.zeros(2, 4, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    args = DecodeArgs(q, cache, cache, table, lens, 1, 0.125, -1, None, 0.0, None, None, torch.empty_like(q), None)
    with pytest.raises(TypeError, match="k_cache/v_cache: trtllm_xqa_decode takes q's dtype"):
        trtllm_xqa_decode(args)
    assert fake == []


@pytest.mark.parametrize(
    "change, error, needle",
    [
        ({"page_size": 8}, ValueError, "page size 8"),
        ({"lse": True}, ValueError, "log-sum-exp"),
        ({"logit_cap": 30.0}, ValueError, "soft-cap"),
        ({"sinks": "list"}, TypeError, "sinks"),
        ({"seqlens": torch.int64}, TypeError, "cache_seqlens"),
        ({"v_scale": True}, ValueError, "non-fp8 cache"),
        ({"strided": True}, ValueError, "strided"),
    ],
)
def test_xqa_bad_inputs_raise_before_flashinfer(fake, change, error, needle):
    from tokenspeed_kernel.ops.attention.args import DecodeArgs
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_xqa_decode import trtllm_xqa_decode

    page = change.get("page_size", 16)
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(4, page, 2, 64 * (2 if "strided" in change else 1), dtype=torch.bfloat16)
    k = k[..., :64] if "strided" in change else k
    sinks = torch.zeros(8) if change.get("sinks") != "list" else [torch.zeros(8)]
    args = DecodeArgs(
        q=q,
        k_cache=k,
        v_cache=k,
        page_table=torch.zeros(2, 4, dtype=torch.int32),
        cache_seqlens=torch.ones(2, dtype=change.get("seqlens", torch.int32)),
        max_seqlen_k=1,
        softmax_scale=0.125,
        window_left=-1,
        sinks=sinks,
        logit_cap=change.get("logit_cap", 0.0),
        k_scale=None,
        v_scale=torch.ones(1) if "v_scale" in change else None,
        out=torch.empty_like(q),
        lse=torch.empty(2, 1, 8) if "lse" in change else None,
    )
    with pytest.raises(error, match=needle):
        trtllm_xqa_decode(args)
    assert fake == []


def _prefill(lens_q=(50, 129, 1), lens_k=None, **kw):
    return cases.AttentionCase(
        "attention.prefill", tuple(lens_q), tuple(lens_k or lens_q), 8, 2, **({"head_dim": 64} | kw)
    )


@pytest.mark.parametrize(
    "options, mode, window",
    [({}, "causal", -1), ({"window_left": 127}, "sliding_window", 127), ({"causal": False}, "padding", -1)],
)
def test_fmha_prefill_layout_mask_scale_and_sinks_tensor(fake, options, mode, window):
    case = _prefill(lens_q=(50, 129, 1), sinks=True, **options)
    inputs = cases.make_inputs(case)
    assert inputs["cu_seqlens_k"] is inputs["cu_seqlens_q"]  # what the kernel asks for (no key prefix)
    out = cases.call(case, inputs, override=FMHA)
    (qkv, layout, ws, seq_lens, max_q, max_kv, bmm1, bmm2, batch, cu_q, cu_k), kw = _only(fake, "fmha")
    assert layout == "SEPARATE_Q_K_V"
    assert len(qkv) == 3 and all(a is b for a, b in zip(qkv, (inputs["q"], inputs["k"], inputs["v"])))
    assert cu_q is inputs["cu_seqlens_q"] and cu_k is inputs["cu_seqlens_k"] and batch == 3
    assert seq_lens.tolist() == [50, 129, 1] and (max_q, max_kv) == (129, 129)
    assert bmm1 == pytest.approx(1 / 8) and bmm2 == 1.0
    # sinks: the float32 [Hq] tensor itself; FlashInfer's FFI rejects a Python list
    assert isinstance(kw["sinks"], torch.Tensor) and kw["sinks"] is inputs["sinks"]
    assert kw["mask_mode"] == mode and kw["window_left"] == window
    assert ws.dtype == torch.uint8 and torch.all(out == 0.5)


@pytest.mark.parametrize("lens_k", [(70, 129, 1), (50, 129, 1)])
def test_fmha_prefill_refuses_a_key_prefix_or_a_second_lengths_tensor(fake, lens_k):
    """Keys beyond the queries (a prefix) missed float64 on the H100; equal lengths in a second
    tensor cannot be told apart from a prefix without reading the device, so both are refused:
    by the selector through the public call (the request's kv_prefix=1), and by the kernel
    itself on a direct call, before FlashInfer is called."""
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_fmha_prefill import KEYS_MUST_BE_QUERIES, trtllm_fmha_prefill

    case = _prefill(lens_q=(50, 129, 1), lens_k=lens_k, sinks=True)
    inputs = cases.make_inputs(case)
    inputs["cu_seqlens_k"] = inputs["cu_seqlens_k"].clone()
    with pytest.raises(ValueError, match=r"cannot serve attention\.prefill .*kv_prefix=1 .*: kv_prefix=1 not in \{0\}"):
        cases.call(case, inputs, override=FMHA)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    args = PrefillArgs(
        q, k, v, inputs["cu_seqlens_q"], inputs["cu_seqlens_k"], 129, max(lens_k), True, 0.125, -1,
        inputs["sinks"], 0.0, torch.empty_like(q), None,
    )  # fmt: skip
    with pytest.raises(ValueError, match="cu_seqlens_k: trtllm_fmha_prefill serves only self-attention") as info:
        trtllm_fmha_prefill(args)
    assert str(info.value) == KEYS_MUST_BE_QUERIES and fake == []
    prefix = _prefill(lens_q=(50, 129, 1), lens_k=(70, 129, 1), sinks=True)  # a request from plain shapes too
    assert "kv_prefix=1 not in {0}" in _reasons(prefix)[FMHA] and _reasons(_prefill(sinks=True))[FMHA] == ()


def test_relayout_keeps_one_lengths_tensor_for_queries_and_keys():
    inputs = cases.make_inputs(_prefill())
    again = cases.relayout(_prefill(), inputs)
    assert again["cu_seqlens_k"] is again["cu_seqlens_q"] and again["cu_seqlens_q"] is not inputs["cu_seqlens_q"]
    assert torch.equal(again["cu_seqlens_q"], inputs["cu_seqlens_q"])


def test_fmha_prefill_without_sinks_and_empty_batch(fake):
    case = _prefill(sinks=False)
    cases.call(case, cases.make_inputs(case), override=FMHA)
    assert _only(fake, "fmha")[1]["sinks"] is None
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_fmha_prefill import trtllm_fmha_prefill

    empty = torch.zeros(0, 8, 64, dtype=torch.bfloat16)
    kv = torch.zeros(0, 2, 64, dtype=torch.bfloat16)
    cu = torch.zeros(2, dtype=torch.int32)
    trtllm_fmha_prefill(PrefillArgs(empty, kv, kv, cu, cu, 0, 0, True, 0.125, -1, None, 0.0, empty, None))
    assert len(fake) == 1  # nothing to compute: FlashInfer not called


@pytest.mark.parametrize(
    "change, error, needle",
    [
        ({"causal": False, "window_left": 5}, ValueError, "causal only"),
        ({"lse": True}, ValueError, "log-sum-exp"),
        ({"logit_cap": 30.0}, ValueError, "soft-cap"),
        ({"sinks": "list"}, TypeError, "sinks"),
        ({"dtype": torch.float32}, TypeError, "bf16/fp16"),
        ({"head_dim": 96}, ValueError, "head dims 96"),
    ],
)
def test_fmha_bad_inputs_raise_before_flashinfer(fake, change, error, needle):
    from tokenspeed_kernel.ops.attention.args import PrefillArgs
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_fmha_prefill import trtllm_fmha_prefill

    dtype, d = change.get("dtype", torch.bfloat16), change.get("head_dim", 64)
    q, k = torch.zeros(5, 8, d, dtype=dtype), torch.zeros(5, 2, d, dtype=dtype)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    sinks = [torch.zeros(8)] if change.get("sinks") == "list" else None
    args = PrefillArgs(
        q,
        k,
        k,
        cu,
        cu,
        5,
        5,
        change.get("causal", True),
        0.125,
        change.get("window_left", -1),
        sinks,
        change.get("logit_cap", 0.0),
        torch.empty_like(q),
        torch.empty(5, 8) if "lse" in change else None,
    )
    with pytest.raises(error, match=needle):
        trtllm_fmha_prefill(args)
    assert fake == []


def _reasons(case):
    return {c.spec.name: c.reasons for c in explain(cases.request(case)).candidates}


def test_selection_gates_with_reasons(fake):
    from tokenspeed_kernel_nvidia.ops.attention.trtllm_fmha_prefill import WINDOW_NEEDS_CAUSAL

    for served in (
        _decode(),
        _decode(lens_k=(9, 4, 30), q_len=4, window_left=127),
    ):
        assert _reasons(served)[XQA] == (), served
    refused_decodes = (_decode(kv_dtype=FP8, dtype=torch.float16), _decode(return_lse=True), _decode(logit_cap=30.0))
    for refused in (*refused_decodes, _decode(page_size=8), _decode(head_dim=96)):
        assert _reasons(refused)[XQA], refused
    assert _reasons(_decode(cache_layout="hnd"))[XQA]  # strided caches: not claimed
    assert _reasons(_prefill(sinks=True, window_left=127))[FMHA] == ()
    assert _reasons(_prefill(causal=False, sinks=True))[FMHA] == ()
    assert _reasons(_prefill(causal=False, window_left=5))[FMHA] == (WINDOW_NEEDS_CAUSAL,)
    for refused in (_prefill(return_lse=True), _prefill(logit_cap=30.0), _prefill(head_dim=96)):
        assert _reasons(refused)[FMHA], refused


def test_opt_in_and_never_chosen_unasked(fake):
    from tokenspeed_kernel.registry import Priority, get_kernel

    for name in (XQA, FMHA):
        spec = get_kernel(name)
        assert spec.priority == Priority.OPT_IN and spec.solution == "trtllm" and spec.archs == frozenset({"sm_90"})
    assert get_kernel(XQA).graph_safe and not get_kernel(FMHA).graph_safe
    assert selector.select(cases.request(_decode())).name != XQA
    assert selector.select(cases.request(_prefill(sinks=True))).name != FMHA


def test_xqa_through_a_capturable_plan(fake):
    """``mha_decode_plan(capturable=True)`` accepts XQA (graph-safe, no layout hook); each run
    reads the lengths through the uint32 view of the same tensor the engine updates."""
    from tokenspeed_kernel import mha_decode_plan

    case = _decode(sinks=True)
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
        override=XQA,
    )
    plan.run(inputs["q"])
    inputs["cache_seqlens"].add_(1)
    plan.update()
    plan.run(inputs["q"])
    runs = [c for c in fake if c[0] == "xqa"]
    assert len(runs) == 2 and runs[1][1][4].view(torch.int32).tolist() == [10, 2, 31]
    assert runs[0][1][4].data_ptr() == inputs["cache_seqlens"].data_ptr()
