"""The tokenspeed MoE methods inside vLLM's own MoE layer, against float64.

vLLM's ``FusedMoEFactory`` builds the layer (its runner, router and ``RoutedExperts``), which
instantiates our method through vLLM's own hooks: the out-of-tree replacement of
``UnquantizedFusedMoEMethod`` and the ``tokenspeed_mxfp4`` quantization config. Weights are
written in vLLM's layout (``w13 [E, 2I, H]`` with GPT-OSS's interleaved gate/up rows for
``swigluoai``, ``w2 [E, H, I]``; MXFP4 as GPT-OSS's packed bytes and E8M0 scales), then
vLLM's post-load hook runs and the layer is called as a model calls it. The float64
expectation is computed here in vLLM's convention (interleaved rows, vLLM's swigluoai
formula) from the same parameters as they were before loading finished.
"""

from __future__ import annotations

import pytest
import torch
from support.naive_moe import decode_mxfp4, naive_topk

E, TOP_K, HIDDEN, INTER, TOKENS = 4, 2, 64, 64, 5
TOL = 2e-2  # bfloat16 activations


@pytest.fixture
def moe_on(monkeypatch):
    import tokenspeed_kernel_vllm

    monkeypatch.setenv(tokenspeed_kernel_vllm.MOE_ENV, "1")
    tokenspeed_kernel_vllm.register()


def _moe_layer(vllm_config, prefix: str, **kwargs):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            return FusedMoEFactory(
                num_experts=E,
                top_k=TOP_K,
                hidden_size=HIDDEN,
                intermediate_size=INTER,
                tp_size=1,
                dp_size=1,
                pcp_size=1,
                prefix=prefix,
                **kwargs,
            )
    finally:
        torch.set_default_dtype(default)


def _forward(vllm_config, layer, x, logits):
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    with set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        return layer(hidden_states=x, router_logits=logits)


def _vllm_act(name: str, h: torch.Tensor, inter: int) -> torch.Tensor:
    """vLLM's activations on one row ``h [2I]`` in vLLM's row convention (float64)."""
    if name == "swigluoai":  # SwigluOAIAndMul.forward_native: gate/up interleaved
        gate, up = h[0::2].clamp(max=7.0), h[1::2].clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(1.702 * gate)
    gate, up = h[:inter], h[inter:]
    if name == "silu":
        return gate * torch.sigmoid(gate) * up
    raise ValueError(name)


def _expected(x, w13, w2, b13, b2, weights, ids, activation):
    """float64 MoE: ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` dense float64, vLLM's conventions."""
    xd = x.double()
    out = torch.zeros_like(xd)
    for t in range(xd.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ xd[t] + (0 if b13 is None else b13[e])
            y = w2[e] @ _vllm_act(activation, h, w2.shape[-1]) + (0 if b2 is None else b2[e])
            out[t] += float(weights[t, j]) * y
    return out


def _check(got, want):
    assert got.shape == want.shape and not torch.isnan(got).any()
    scale = want.abs().max().item() + 1
    torch.testing.assert_close(got.double(), want, atol=TOL * scale, rtol=TOL)


def test_unquantized_gpt_oss_layout_monolithic(vllm_config, moe_on):
    """GPT-OSS-style bf16 experts (swigluoai, interleaved w13, biases, softmax top-k with
    renormalization): vLLM hands router logits to our monolithic path (moe_topk + plan)."""
    from tokenspeed_kernel_vllm.moe.unquantized import TokenspeedUnquantizedFusedMoEMethod

    layer = _moe_layer(
        vllm_config, "model.layers.0.mlp.experts", activation="swigluoai", has_bias=True, renormalize=True
    )
    experts = layer.routed_experts
    assert type(experts.quant_method) is TokenspeedUnquantizedFusedMoEMethod
    gen = torch.Generator().manual_seed(0)
    for _, p in experts.named_parameters():
        p.data.copy_((torch.randn(p.shape, generator=gen) * 0.15).to(p.dtype))
    before = {n: p.detach().double().clone() for n, p in experts.named_parameters()}
    experts.quant_method.process_weights_after_loading(experts)
    assert experts.quant_method.is_monolithic
    x = (torch.randn(TOKENS, HIDDEN, generator=gen)).to(torch.bfloat16)
    logits = torch.randn(TOKENS, E, generator=gen).to(torch.bfloat16)
    got = _forward(vllm_config, layer, x, logits)
    weights, ids = naive_topk(logits, TOP_K, scoring="softmax", renormalize=True)
    want = _expected(
        x, before["w13_weight"], before["w2_weight"], before["w13_bias"], before["w2_bias"], weights, ids, "swigluoai"
    )
    _check(got, want)


def test_unquantized_silu_with_vllm_routing(vllm_config, moe_on):
    """A custom routing function keeps routing in vLLM's router (modular path): our apply
    gets vLLM's top-k weights and ids."""

    def route(hidden_states, gating_output, topk, renormalize):
        scores = gating_output.float()
        weights, ids = torch.topk(scores, topk, dim=-1)
        return torch.sigmoid(weights), ids.to(torch.int32)

    layer = _moe_layer(
        vllm_config, "model.layers.1.mlp.experts", activation="silu", custom_routing_function=route, renormalize=False
    )
    experts = layer.routed_experts
    gen = torch.Generator().manual_seed(1)
    for _, p in experts.named_parameters():
        p.data.copy_((torch.randn(p.shape, generator=gen) * 0.15).to(p.dtype))
    experts.quant_method.process_weights_after_loading(experts)
    assert not experts.quant_method.is_monolithic
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    logits = torch.randn(TOKENS, E, generator=gen).to(torch.bfloat16)
    got = _forward(vllm_config, layer, x, logits)
    weights, ids = route(x, logits, TOP_K, False)
    want = _expected(
        x, experts.w13_weight.double(), experts.w2_weight.double(), None, None, weights.double(), ids, "silu"
    )
    _check(got, want)


def test_mxfp4_config_claims_gpt_oss_only_when_asked(monkeypatch):
    from types import SimpleNamespace

    import tokenspeed_kernel_vllm
    from tokenspeed_kernel_vllm.moe.mxfp4 import TokenspeedMxfp4Config

    gpt_oss, other = SimpleNamespace(model_type="gpt_oss"), SimpleNamespace(model_type="llama")
    cfg = {"quant_method": "mxfp4"}
    claim = TokenspeedMxfp4Config.override_quantization_method
    monkeypatch.delenv(tokenspeed_kernel_vllm.MOE_ENV, raising=False)
    assert claim(cfg, "tokenspeed_mxfp4", hf_config=gpt_oss) == "tokenspeed_mxfp4"
    assert claim(cfg, None, hf_config=gpt_oss) is None  # vLLM's own gpt_oss_mxfp4 keeps it
    assert claim(cfg, "tokenspeed_mxfp4", hf_config=other) is None
    assert claim({"quant_method": "fp8"}, "tokenspeed_mxfp4", hf_config=gpt_oss) is None
    monkeypatch.setenv(tokenspeed_kernel_vllm.MOE_ENV, "1")
    assert claim({"quant_method": "gpt_oss_mxfp4"}, None, hf_config=gpt_oss) == "tokenspeed_mxfp4"
    assert claim(cfg, "mxfp4", hf_config=gpt_oss) is None  # an explicit other choice wins

    # vLLM's own lookup finds the registered method, and its weight loader sees the
    # checkpoint format's name.
    tokenspeed_kernel_vllm.register()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    assert "tokenspeed_mxfp4" in QUANTIZATION_METHODS
    assert get_quantization_config("tokenspeed_mxfp4") is TokenspeedMxfp4Config
    assert TokenspeedMxfp4Config.get_name() == "gpt_oss_mxfp4"


def _random_mxfp4(shape: tuple[int, int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = shape
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(122, 127, (e, n, k // 32), generator=gen, dtype=torch.int32).to(torch.uint8)
    return packed, scales


def test_mxfp4_gpt_oss_experts(vllm_config, moe_on):
    """GPT-OSS's MXFP4 experts: packed bytes + E8M0 scales in vLLM's GPT-OSS layout (w13 rows
    gate/up interleaved), bf16 biases; served by MXFP4Weight views of the parameters."""
    from tokenspeed_kernel_vllm.moe.mxfp4 import TokenspeedMxfp4Config, moe_method_class

    layer = _moe_layer(
        vllm_config,
        "model.layers.2.mlp.experts",
        activation="swigluoai",
        has_bias=True,
        renormalize=True,
        quant_config=TokenspeedMxfp4Config(),
    )
    experts = layer.routed_experts
    method = experts.quant_method
    assert type(method) is moe_method_class() and method.weight_dtype == "gpt_oss_mxfp4"
    assert tuple(experts.w13_weight.shape) == (E, 2 * INTER, HIDDEN // 2)
    assert tuple(experts.w2_weight_scale.shape) == (E, HIDDEN, INTER // 32)
    gen = torch.Generator().manual_seed(2)
    w13, s13 = _random_mxfp4((E, 2 * INTER, HIDDEN), gen)
    w2, s2 = _random_mxfp4((E, HIDDEN, INTER), gen)
    experts.w13_weight.data.copy_(w13)
    experts.w13_weight_scale.data.copy_(s13)
    experts.w2_weight.data.copy_(w2)
    experts.w2_weight_scale.data.copy_(s2)
    experts.w13_bias.data.copy_((torch.randn(E, 2 * INTER, generator=gen) * 0.1).to(torch.bfloat16))
    experts.w2_bias.data.copy_((torch.randn(E, HIDDEN, generator=gen) * 0.1).to(torch.bfloat16))
    b13, b2 = experts.w13_bias.double().clone(), experts.w2_bias.double().clone()
    method.process_weights_after_loading(experts)
    assert method.is_monolithic
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    logits = torch.randn(TOKENS, E, generator=gen).to(torch.bfloat16)
    got = _forward(vllm_config, layer, x, logits)
    weights, ids = naive_topk(logits, TOP_K, scoring="softmax", renormalize=True)
    want = _expected(x, decode_mxfp4(w13, s13), decode_mxfp4(w2, s2), b13, b2, weights, ids, "swigluoai")
    _check(got, want)


def test_unserved_activation_fails_at_load(vllm_config, moe_on):
    layer = _moe_layer(vllm_config, "model.layers.3.mlp.experts", activation="gelu_tanh")
    experts = layer.routed_experts
    with pytest.raises(ValueError, match=r"activation 'gelu_tanh' is not served"):
        experts.quant_method.process_weights_after_loading(experts)
