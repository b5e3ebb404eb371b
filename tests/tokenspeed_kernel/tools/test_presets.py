"""Shape presets: the GPT-OSS-120B workload is what the brief says, small is small, awkward
is the case modules' list, and the window convention is 128 visible keys."""

import dataclasses

import pytest
import torch

from tokenspeed_kernel.tools import cases
from tokenspeed_kernel.tools.cases import AttentionCase
from tokenspeed_kernel.tools.presets import LAYER_KINDS, PRESETS, preset_cases

ATTENTION = ("attention.prefill", "attention.extend", "attention.decode")


def _shapes(op):
    return {(c.batch, c.seqlens_q[0], c.seqlens_k[0]) for c in preset_cases("gpt-oss-120b", op)}


def test_gpt_oss_attention_geometry_and_layer_kinds():
    for op in ATTENTION:
        found = preset_cases("gpt-oss-120b", op)
        assert all((c.num_q_heads, c.num_kv_heads, c.head_dim, c.dtype) == (64, 8, 64, torch.bfloat16) for c in found)
        assert all(len(set(c.seqlens_q)) == 1 and len(set(c.seqlens_k)) == 1 for c in found)
        assert {c.window_left for c in found} == {-1, 127}, op
        full = {c.name: c for c in found if c.window_left < 0}
        windowed = [c for c in found if c.window_left >= 0]
        # every shape appears once per layer kind, the windowed twin named <full>_win128
        assert len(windowed) == len(full)
        for c in windowed:
            twin = full[c.name.removesuffix("_win128")]
            assert (twin.seqlens_q, twin.seqlens_k, twin.sinks, twin.kv_dtype) == (
                c.seqlens_q,
                c.seqlens_k,
                c.sinks,
                c.kv_dtype,
            )
        assert any(c.sinks for c in found) and all(c.causal for c in found)
        if op != "attention.prefill":
            assert {c.page_size for c in found} == {16}


def test_gpt_oss_attention_shapes():
    assert {(1, 8192, 8192), (4, 4096, 4096)} <= _shapes("attention.prefill")
    assert (1, 2048, 8192) in _shapes("attention.extend")  # a 2048 chunk on a 6144 prefix
    assert {(64, 1, 8192), (256, 1, 2048), (1, 1, 8192), (64, 4, 8192)} <= _shapes("attention.decode")
    store = preset_cases("gpt-oss-120b", "kvcache.store")
    assert any(sum(c.seqlens_q) == 64 for c in store)  # a decode step's 64 new tokens
    assert all(c.num_kv_heads == 8 and c.head_dim == 64 and c.window_left == -1 for c in store)
    decode = preset_cases("gpt-oss-120b", "attention.decode")
    assert any(c.kv_dtype == torch.float8_e4m3fn for c in decode)


def test_window_128_means_128_visible_keys():
    ((_, window),) = [kind for kind in LAYER_KINDS if kind[1] >= 0]
    one_query = AttentionCase("attention.prefill", (1,), (300,), 1, 1, 8, window_left=window, dtype=torch.float32)
    no_window = AttentionCase("attention.prefill", (1,), (300,), 1, 1, 8, dtype=torch.float32)
    per_key = 2 * (8 + 8)
    assert one_query.flops() == 128 * per_key and no_window.flops() == 300 * per_key


def test_gpt_oss_moe():
    tokens = (1, 8, 64, 512, 4096)
    apply = preset_cases("gpt-oss-120b", "moe.apply")
    assert {(c.num_tokens, c.weight_format) for c in apply} == {
        (t, fmt) for t in tokens for fmt in ("mxfp4", "plain", "fp8_per_channel")
    }
    for c in apply:
        assert (c.hidden, c.intermediate, c.num_experts, c.top_k) == (2880, 2880, 128, 4)
        assert c.bias and c.activation == "swiglu_oai" and not c.expert_map and c.dtype == torch.bfloat16
    topk = preset_cases("gpt-oss-120b", "moe.topk")
    assert [c.num_tokens for c in topk] == list(tokens)
    assert all((c.num_experts, c.top_k, c.scoring, c.renormalize) == (128, 4, "softmax", True) for c in topk)


def test_names_unique_and_counted_work():
    for preset in PRESETS:
        for op in cases.OPS:
            found = preset_cases(preset, op)
            only = {"prefill": "attention.prefill", "extend": "attention.extend", "moe": "moe.apply"}.get(
                preset.split("-")[0], op
            )
            assert bool(found) == (op == only), (preset, op)
            if preset not in ("small", "awkward"):
                assert len({c.name for c in found}) == len(found), (preset, op)
            assert all(c.op == op and c.bytes_moved() > 0 for c in found)


def test_prefill_lengths_sweeps_the_length_bucket_of_full_attention_layers():
    sweep = preset_cases("prefill-lengths", "attention.prefill")
    buckets = {cases.request(c).shape("max_seqlen_q_bucket") for c in sweep}
    assert buckets == {512, 1024, 2048, 4096, 8192, 16384}
    for c in sweep:
        assert (c.num_q_heads, c.num_kv_heads, c.head_dim, c.window_left) == (64, 8, 64, -1)
        assert c.seqlens_q == c.seqlens_k and c.dtype == torch.bfloat16
    assert {(c.sinks, c.causal) for c in sweep} == {(True, True), (False, True), (True, False)}
    assert any(len(set(c.seqlens_q)) > 1 for c in sweep)  # a ragged batch


def test_extend_lengths_sweeps_the_length_bucket_on_a_paged_prefix():
    sweep = preset_cases("extend-lengths", "attention.extend")
    buckets = {cases.request(c).shape("max_seqlen_q_bucket") for c in sweep}
    assert buckets == {16, 64, 256, 512, 1024, 2048}
    for c in sweep:
        assert (c.num_q_heads, c.num_kv_heads, c.head_dim, c.window_left, c.page_size) == (64, 8, 64, -1, 16)
        assert all(k > q for q, k in zip(c.seqlens_q, c.seqlens_k)) and c.sinks and c.dtype == torch.bfloat16
    assert any(len(set(c.seqlens_q)) > 1 for c in sweep)  # a ragged batch


def test_the_d128_sweeps_are_the_sweeps_at_head_dim_128():
    for op, name in (("attention.prefill", "prefill-lengths"), ("attention.extend", "extend-lengths")):
        d64, d128 = preset_cases(name, op), preset_cases(f"{name}-d128", op)
        assert [dataclasses.replace(c, head_dim=64) for c in d128] == d64
        assert {c.head_dim for c in d128} == {128}


def test_moe_decode_bf16_sweeps_the_token_bucket_of_the_gpt_oss_layer_with_bf16_weights():
    sweep = preset_cases("moe-decode-bf16", "moe.apply")
    assert [cases.request(c).shape("num_tokens_bucket") for c in sweep] == [1, 2, 4, 8, 16]
    for c in sweep:
        assert (c.hidden, c.intermediate, c.num_experts, c.top_k) == (2880, 2880, 128, 4)
        assert (c.weight_format, c.dtype, c.activation, c.bias) == ("plain", torch.bfloat16, "swiglu_oai", True)
    bf16_rows = {c.name: c for c in preset_cases("gpt-oss-120b", "moe.apply") if c.name.endswith("_bf16")}
    assert all(bf16_rows[c.name] == c for c in sweep if c.name in bf16_rows), "the serving preset's bf16 rows"


def test_small_is_one_cheap_case_and_awkward_is_the_case_modules_list():
    for op in cases.OPS:
        (small,) = preset_cases("small", op)
        assert small.bytes_moved() < 2**20, small.describe()
        expected = cases.awkward_cases(op, torch.bfloat16) + cases.awkward_cases(op, torch.float16)
        assert preset_cases("awkward", op) == expected
        assert {c.dtype for c in expected} == {torch.bfloat16, torch.float16}


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="unknown preset 'nope'; known presets: gpt-oss-120b"):
        preset_cases("nope", "moe.topk")
    with pytest.raises(ValueError, match="no cases for operator 'moe.nope'"):
        preset_cases("small", "moe.nope")
