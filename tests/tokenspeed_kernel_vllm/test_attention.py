"""The TOKENSPEED backend against float64, through vLLM's own classes.

Each case builds vLLM's real ``Attention`` layer (which constructs our impl from the
backend), vLLM's real ``CommonAttentionMetadata`` for a mixed batch (decodes first, ragged
prompts, chunked prefill on a cached prefix, speculative decodes), our builder's metadata,
and a KV cache laid out by vLLM's layout code. Then it runs what vLLM's
``unified_kv_cache_update`` and ``unified_attention_with_output`` run —
``impl.do_kv_cache_update`` then ``impl.forward`` — into a NaN-poisoned output, and compares
with the independent float64 attention of tests/support. Triton kernels run under the
interpreter; shapes are small.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from support.vllm_attention import (
    cache_kv,
    expected,
    kv_cache_view,
    make_step,
    read_sequences,
    write_prefixes,
)
from support.vllm_env import make_vllm_config

from tokenspeed_kernel import last_kernel

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 32, 16
TOL = 1.6e-2  # bfloat16 activations and cache
_names = itertools.count()


def _layer(vllm_config, *, window: int | None, sinks: bool, logit_cap: float | None):
    """vLLM's Attention layer with the TOKENSPEED backend, built as a model would."""
    import tokenspeed_kernel_vllm
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    tokenspeed_kernel_vllm.register()
    backend = AttentionBackendEnum["TOKENSPEED"].get_class()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            sink = torch.nn.Parameter(torch.full((NUM_HEADS,), float("-inf")), requires_grad=False) if sinks else None
            layer = Attention(
                NUM_HEADS,
                HEAD_SIZE,
                HEAD_SIZE**-0.5,
                num_kv_heads=NUM_KV_HEADS,
                cache_config=vllm_config.cache_config,
                logits_soft_cap=logit_cap,
                per_layer_sliding_window=window,
                prefix=f"model.layers.{next(_names)}.self_attn.attn",
                attn_backend=backend,
                sinks=sink,
            )
    finally:
        torch.set_default_dtype(default)
    if sinks:
        # Loaded weights land in the parameter after construction, as in vLLM.
        layer.sinks = sink
        sink.data.copy_(torch.linspace(-1.0, 2.0, NUM_HEADS))
    layer.process_weights_after_loading(torch.bfloat16)
    return layer


def _step(requests, *, num_blocks: int, seed: int, pad_reqs: int = 0):
    """vLLM's metadata and this layer geometry's tensors for ``requests`` (bf16)."""
    return make_step(
        requests,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_SIZE,
        block_size=BLOCK,
        num_blocks=num_blocks,
        dtype=torch.bfloat16,
        seed=seed,
        pad_reqs=pad_reqs,
    )


def _builder(vllm_config, layer):
    spec = layer.get_kv_cache_spec(vllm_config)
    builder_cls = layer.attn_backend.get_builder_cls()
    return spec, builder_cls(spec, [layer.layer_name], vllm_config, torch.device("cpu"))


def _run(layer, builder, step, kv_cache):
    """What vLLM runs for one layer in one step, into a NaN-poisoned output."""
    metadata = builder.build(0, step.common)
    layer.impl.do_kv_cache_update(layer, step.k_new, step.v_new, kv_cache, step.common.slot_mapping)
    output = torch.full((step.q.shape[0], NUM_HEADS, HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
    result = layer.impl.forward(layer, step.q, step.k_new, step.v_new, kv_cache, metadata, output=output)
    assert result is output
    return metadata, output


def _check(step, output, kv_cache, layer, *, window, sinks, logit_cap, kv_scale=1.0):
    assert not torch.isnan(output).any(), "an output row was never written"
    # The cache now holds this step's rows (store_kvcache wrote through the views).
    ks, vs = read_sequences(step, kv_cache, HEAD_SIZE, kv_scale)
    starts = torch.cumsum(torch.tensor([0] + [q for _, q in step.requests]), 0)
    for b, (ctx, q_len) in enumerate(step.requests):
        new_k = step.k_new[starts[b] : starts[b] + q_len].to(torch.float64)
        new_v = step.v_new[starts[b] : starts[b] + q_len].to(torch.float64)
        tol = 0.07 if kv_scale != 1.0 else 0  # fp8 e4m3 keeps 3 mantissa bits
        torch.testing.assert_close(ks[b][ctx:], new_k, atol=tol * 2, rtol=tol)
        torch.testing.assert_close(vs[b][ctx:], new_v, atol=tol * 2, rtol=tol)
    sink_values = None if not sinks else layer.sinks.detach().to(torch.float64)
    want = expected(
        step,
        ks,
        vs,
        scale=HEAD_SIZE**-0.5,
        window_left=-1 if window is None else window - 1,
        sinks=sink_values,
        logit_cap=logit_cap or 0.0,
    )
    scale = want.abs().max().item() + 1
    torch.testing.assert_close(output.to(torch.float64), want, atol=TOL * scale, rtol=TOL)


# (cached prefix, query length) per request, decodes first as vLLM orders them:
# two decodes at awkward lengths, then a ragged prompt, a chunk on a cached prefix that
# crosses pages, and a short prompt.
MIXED = [(20, 1), (5, 1), (0, 13), (17, 6), (0, 3)]


@pytest.mark.parametrize(
    ("layout", "window", "sinks", "logit_cap"),
    [
        pytest.param("LBNHC", 8, True, None, id="nhd-window8-sinks"),
        pytest.param("LBHNC", None, False, 30.0, id="hnd-full-softcap"),
    ],
)
def test_mixed_batch_matches_float64(vllm_config, layout, window, sinks, logit_cap):
    layer = _layer(vllm_config, window=window, sinks=sinks, logit_cap=logit_cap)
    spec, builder = _builder(vllm_config, layer)
    kv_cache = kv_cache_view(spec, 24, layout, torch.bfloat16)
    step = _step(MIXED, num_blocks=24, seed=1)
    write_prefixes(step, kv_cache, HEAD_SIZE)
    metadata, output = _run(layer, builder, step, kv_cache)
    assert last_kernel() == "triton_extend"  # strided vLLM caches served in place, not by the reference
    assert (metadata.num_decodes, metadata.num_prefills) == (2, 3)
    assert metadata.num_decode_tokens == 2 and metadata.num_prefill_tokens == 22
    assert metadata.decode_plans is None  # eager vLLM config: the step's decode plan
    _check(step, output, kv_cache, layer, window=window, sinks=sinks, logit_cap=logit_cap)


def test_one_steps_layers_share_the_step_plans_per_kind(vllm_config):
    """GPT-OSS's alternation in one step: two window layers and two full ones, each with its own
    cache and sinks, share the step's metadata; each kind's first layer makes the step's extend
    plan and its eager decode plan, the others run them (four plans in all), every layer
    matching float64."""
    kinds = (8, None, 8, None)
    layers = [_layer(vllm_config, window=window, sinks=True, logit_cap=None) for window in kinds]
    spec, builder = _builder(vllm_config, layers[0])
    step = _step(MIXED, num_blocks=24, seed=2)
    metadata = builder.build(0, step.common)
    for i, (layer, window) in enumerate(zip(layers, kinds)):
        layer.sinks.data.copy_(torch.linspace(-1.0 - i, 2.0 + i, NUM_HEADS))
        layer.process_weights_after_loading(torch.bfloat16)
        kv_cache = kv_cache_view(spec, 24, "LBNHC", torch.bfloat16)
        write_prefixes(step, kv_cache, HEAD_SIZE)
        layer.impl.do_kv_cache_update(layer, step.k_new, step.v_new, kv_cache, step.common.slot_mapping)
        output = torch.full((step.q.shape[0], NUM_HEADS, HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
        layer.impl.forward(layer, step.q, step.k_new, step.v_new, kv_cache, metadata, output=output)
        assert len(metadata.step_plans) == 2 * min(i + 1, 2)
        _check(step, output, kv_cache, layer, window=window, sinks=True, logit_cap=None)
    kinds_planned = sorted((type(p).__name__, p.window_left) for p in metadata.step_plans.values())
    assert kinds_planned == [("DecodeStepPlan", -1), ("DecodeStepPlan", 7), ("ExtendPlan", -1), ("ExtendPlan", 7)]


def test_speculative_decodes_q_len_3(tiny_model_dir):
    """Speculative decoding (ngram, 2 draft tokens): the builder treats q_len <= 3 as decode
    and the decode call serves q_len 3 causally; a prompt follows."""
    from vllm.config import SpeculativeConfig

    config = make_vllm_config(
        tiny_model_dir,
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3),
    )
    layer = _layer(config, window=8, sinks=True, logit_cap=None)
    spec, builder = _builder(config, layer)
    assert builder.reorder_batch_threshold == 3
    kv_cache = kv_cache_view(spec, 16, "LBNHC", torch.bfloat16)
    step = _step([(9, 3), (30, 3), (0, 7)], num_blocks=16, seed=2)
    write_prefixes(step, kv_cache, HEAD_SIZE)
    metadata, output = _run(layer, builder, step, kv_cache)
    assert (metadata.num_decodes, metadata.decode_q_len, metadata.num_prefills) == (2, 3, 1)
    _check(step, output, kv_cache, layer, window=8, sinks=True, logit_cap=None)


def test_full_cudagraph_decode_runs_through_plans(tiny_model_dir):
    """With full decode CUDA graphs configured, a pure-decode batch runs a DecodePlan kept on
    vLLM's persistent tables: the second step rewrites seq_lens/block_table in place, the
    builder re-plans, the same plan serves it; both steps match float64."""
    from vllm.config import CUDAGraphMode

    config = make_vllm_config(tiny_model_dir)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    layer = _layer(config, window=None, sinks=True, logit_cap=None)
    spec, builder = _builder(config, layer)
    assert builder.decode_plans is not None and builder.plan_capturable
    kv_cache = kv_cache_view(spec, 16, "LBNHC", torch.bfloat16)
    requests = [(14, 1), (3, 1), (33, 1)]  # the next token of each stays on an allocated page
    step = _step(requests, num_blocks=16, seed=3)
    write_prefixes(step, kv_cache, HEAD_SIZE)
    metadata, output = _run(layer, builder, step, kv_cache)
    assert metadata.decode_plans is not None and len(metadata.decode_plans) == 1
    assert last_kernel() == "triton_decode"  # a capturable kernel, on vLLM's strided cache
    _check(step, output, kv_cache, layer, window=None, sinks=True, logit_cap=None)

    # Next step: each sequence grew by the token just decoded; vLLM rewrites the same
    # persistent tensors in place.
    k_cache, v_cache = cache_kv(kv_cache, HEAD_SIZE)
    nxt = _step([(c + 1, 1) for c, _ in requests], num_blocks=16, seed=4)
    for b, (ctx, _) in enumerate(requests):
        pos = torch.arange(ctx + 1)
        blocks = step.block_table[b, pos // BLOCK].long()
        nxt.k_prefix[b] = k_cache[blocks, pos % BLOCK].clone()
        nxt.v_prefix[b] = v_cache[blocks, pos % BLOCK].clone()
    step.seq_lens.add_(1)
    slots = [int(step.block_table[b, (c + 1) // BLOCK]) * BLOCK + (c + 1) % BLOCK for b, (c, _) in enumerate(requests)]
    step.common.slot_mapping.copy_(torch.tensor(slots))
    step.common.max_seq_len += 1
    nxt.common = step.common
    nxt.block_table, nxt.seq_lens = step.block_table, step.seq_lens
    metadata2, output2 = _run(layer, builder, nxt, kv_cache)
    assert metadata2.decode_plan_key == metadata.decode_plan_key and len(metadata2.decode_plans) == 1
    _check(nxt, output2, kv_cache, layer, window=None, sinks=True, logit_cap=None)


@pytest.mark.parametrize("strided_kernel", [True, False], ids=["in-place", "fallback-copy"])
def test_full_cudagraph_decode_reads_a_fused_qkv_q_in_place(tiny_model_dir, monkeypatch, strided_kernel):
    """The full-graph decode of a fused qkv's q (rows of (Hq + 2 Hkv) D elements, NaN past
    each row's q): the layer's DecodePlan is made with q's row stride and runs q as vLLM hands
    it over, no copy; where no capturable kernel reads a row-strided q (here: mha_decode_plan
    refusing q_row_stride, as for an override naming such a kernel), the plan is a contiguous
    q's and q is copied. Both match float64."""
    from support.strided_q import row_strided
    from tokenspeed_kernel_vllm.attention import impl
    from vllm.config import CUDAGraphMode

    from tokenspeed_kernel import KernelOverrideError

    copied = []
    monkeypatch.setattr(impl, "_contiguous", lambda t: copied.append(t.stride()) or t.contiguous())
    if not strided_kernel:
        real_plan = impl.mha_decode_plan

        def no_strided_kernel(*args, q_row_stride=None, **kwargs):
            if q_row_stride is not None:
                raise KernelOverrideError("the override names a kernel that does not read a row-strided q (test)")
            return real_plan(*args, **kwargs)

        monkeypatch.setattr(impl, "mha_decode_plan", no_strided_kernel)
    config = make_vllm_config(tiny_model_dir)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    layer = _layer(config, window=8, sinks=True, logit_cap=None)
    spec, builder = _builder(config, layer)
    kv_cache = kv_cache_view(spec, 16, "LBNHC", torch.bfloat16)
    step = _step([(14, 1), (3, 1), (33, 1), (20, 1)], num_blocks=16, seed=8)
    write_prefixes(step, kv_cache, HEAD_SIZE)
    row = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    q = row_strided(step.q, 2 * NUM_KV_HEADS * HEAD_SIZE)
    assert q.stride() == (row, HEAD_SIZE, 1) and torch.equal(q, step.q)
    metadata = builder.build(0, step.common)
    layer.impl.do_kv_cache_update(layer, step.k_new, step.v_new, kv_cache, step.common.slot_mapping)
    for _ in range(2):  # the plan's first run, then a run of the plan kept for the batch shape
        output = torch.full((q.shape[0], NUM_HEADS, HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
        layer.impl.forward(layer, q, step.k_new, step.v_new, kv_cache, metadata, output=output)
        _check(step, output, kv_cache, layer, window=8, sinks=True, logit_cap=None)
    assert metadata.decode_plans is not None and len(metadata.decode_plans) == 1
    (plan,) = metadata.decode_plans._plans[metadata.decode_plan_key].values()
    assert last_kernel() == plan.kernel == "triton_decode"
    if strided_kernel:
        assert plan.q_row_stride == row and "strided_q" in plan.request.features
        assert copied == []  # q reached the plan's run as vLLM handed it over
    else:
        assert plan.q_row_stride is None and "strided_q" not in plan.request.features
        assert copied == [(row, HEAD_SIZE, 1)] * 2  # one copy per forward


def test_fp8_kv_cache_with_scales(tiny_model_dir):
    """--kv-cache-dtype fp8: vLLM's uint8 cache viewed as float8_e4m3fn, the layer's
    per-tensor k/v scales passed through to store and attention."""

    config = make_vllm_config(tiny_model_dir, kv_cache_dtype="fp8")
    layer = _layer(config, window=8, sinks=False, logit_cap=None)
    assert layer.impl.fp8
    layer._k_scale.fill_(0.5)
    layer._v_scale.fill_(0.25)
    spec, builder = _builder(config, layer)
    assert spec.dtype == torch.uint8
    kv_cache = kv_cache_view(spec, 16, "LBNHC", torch.uint8)
    fp8_view = kv_cache.view(torch.float8_e4m3fn)
    step = _step([(12, 1), (0, 9), (18, 4)], num_blocks=16, seed=5)
    k_cache, v_cache = cache_kv(fp8_view, HEAD_SIZE)
    for b, (ctx, _) in enumerate(step.requests):  # prefixes stored as value / scale
        for pos in range(ctx):
            blk, off = int(step.block_table[b, pos // BLOCK]), pos % BLOCK
            k_cache[blk, off] = (step.k_prefix[b][pos].float() / 0.5).to(torch.float8_e4m3fn)
            v_cache[blk, off] = (step.v_prefix[b][pos].float() / 0.25).to(torch.float8_e4m3fn)
    metadata = builder.build(0, step.common)
    layer.impl.do_kv_cache_update(layer, step.k_new, step.v_new, kv_cache, step.common.slot_mapping)
    output = torch.full((step.q.shape[0], NUM_HEADS, HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
    layer.impl.forward(layer, step.q, step.k_new, step.v_new, kv_cache, metadata, output=output)
    assert not torch.isnan(output).any()
    ks, vs = read_sequences(step, fp8_view, HEAD_SIZE, 1.0)
    ks = [k * 0.5 for k in ks]
    vs = [v * 0.25 for v in vs]
    starts = torch.cumsum(torch.tensor([0] + [q for _, q in step.requests]), 0)
    for b, (ctx, q_len) in enumerate(step.requests):  # the new rows went in as value / scale
        torch.testing.assert_close(
            ks[b][ctx:], step.k_new[starts[b] : starts[b] + q_len].double(), atol=0.07, rtol=0.07
        )
    want = expected(step, ks, vs, scale=HEAD_SIZE**-0.5, window_left=7, sinks=None, logit_cap=0.0)
    scale = want.abs().max().item() + 1
    torch.testing.assert_close(output.double(), want, atol=TOL * scale, rtol=TOL)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv"])
def test_through_vllm_attention_forward(vllm_config, fused, monkeypatch):
    """The same mixed batch through vLLM's own Attention.forward (its custom ops, its forward
    context, its KV-update-then-attention order) gives what the direct impl calls give. With
    q, k and v split off one fused qkv projection's rows (as vLLM's models hand them over:
    row-strided views), nothing is copied: q reaches the decode and the extend as it is (both
    step plans were made for a row-strided q, ``strided_q``), k and v reach store_kvcache as
    they are (``strided_rows``)."""
    from tokenspeed_kernel_vllm.attention import impl
    from vllm.forward_context import set_forward_context

    from tokenspeed_kernel.ops._dispatch import last_request

    copied = []
    monkeypatch.setattr(impl, "_contiguous", lambda t: copied.append(tuple(t.shape)) or t.contiguous())
    stores = []  # each store_kvcache call's request

    def store(*args, **kwargs):
        impl_store(*args, **kwargs)
        stores.append(last_request())

    impl_store = impl.store_kvcache
    monkeypatch.setattr(impl, "store_kvcache", store)
    layer = _layer(vllm_config, window=8, sinks=True, logit_cap=None)
    spec, builder = _builder(vllm_config, layer)
    kv_cache = kv_cache_view(spec, 24, "LBNHC", torch.bfloat16)
    step = _step(MIXED, num_blocks=24, seed=1)
    write_prefixes(step, kv_cache, HEAD_SIZE)
    layer.kv_cache = kv_cache
    metadata = builder.build(0, step.common)
    name = layer.layer_name
    q, k, v = (t.flatten(1) for t in (step.q, step.k_new, step.v_new))
    if fused:
        q, k, v = torch.cat((q, k, v), dim=1).split((q.shape[1], k.shape[1], v.shape[1]), dim=1)
        assert q.stride(0) == (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    with set_forward_context({name: metadata}, vllm_config, slot_mapping={name: step.common.slot_mapping}):
        out = layer(q, k, v)
    out = out.view(-1, NUM_HEADS, HEAD_SIZE)
    _check(step, out, kv_cache, layer, window=8, sinks=True, logit_cap=None)
    plans = sorted(metadata.step_plans.values(), key=lambda p: type(p).__name__)
    assert [type(p).__name__ for p in plans] == ["DecodeStepPlan", "ExtendPlan"]
    assert all(("strided_q" in p.request.features) == fused for p in plans)
    assert copied == []  # neither q nor k/v
    assert [("strided_rows" in request.features) for request in stores] == [fused]


def test_padded_full_graph_decode_batch(tiny_model_dir):
    """A captured decode graph replays at its capture size: vLLM pads the batch with requests
    of query length 0, seq_len 0, the null block and slot -1. The real rows match float64,
    the padding rows come out finite (zeros) and nothing is written for them."""
    from vllm.config import CUDAGraphMode

    config = make_vllm_config(tiny_model_dir)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    layer = _layer(config, window=8, sinks=True, logit_cap=None)
    spec, builder = _builder(config, layer)
    kv_cache = kv_cache_view(spec, 16, "LBNHC", torch.bfloat16)
    real = [(9, 1), (20, 1), (2, 1)]
    step = _step(real, num_blocks=16, seed=6, pad_reqs=1)
    write_prefixes(step, kv_cache, HEAD_SIZE)
    null_page = kv_cache[0].clone()
    padded = 4  # capture size: 3 requests + 1 padding request, one token each
    step.common.num_actual_tokens = padded
    step.common.slot_mapping = torch.cat((step.common.slot_mapping, torch.tensor([-1])))
    gen = torch.Generator().manual_seed(7)
    step.q = torch.cat((step.q, torch.randn(1, NUM_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)))
    step.k_new = torch.cat((step.k_new, torch.randn(1, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)))
    step.v_new = torch.cat((step.v_new, torch.randn(1, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)))
    metadata, output = _run(layer, builder, step, kv_cache)
    assert (metadata.num_decodes, metadata.num_decode_tokens, metadata.decode_q_len) == (4, 4, 1)
    assert metadata.decode_plans is not None
    assert torch.isfinite(output[3].float()).all()
    torch.testing.assert_close(kv_cache[0], null_page, equal_nan=True)  # the null block untouched
    step.q, step.k_new, step.v_new = step.q[:3], step.k_new[:3], step.v_new[:3]
    _check(step, output[:3], kv_cache, layer, window=8, sinks=True, logit_cap=None)
