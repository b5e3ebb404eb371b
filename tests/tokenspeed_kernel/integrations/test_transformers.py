"""transformers as a client: a tiny random GPT-OSS served by attn/experts "tokenspeed".

The model is built offline from a ``GptOssConfig`` (2 layers: one sliding-window layer, one
full; sinks; 4 experts top-2) with weights drawn larger than transformers' default init so
attention is far from uniform and routing is decisive. Each check compares our model with
transformers' own eager attention and eager experts on the same weights, and counts the
kernels our calls went to, so a silent fallback to eager cannot pass.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

import tokenspeed_kernel.integrations.transformers as ts_hf  # noqa: E402

VOCAB = 128
WINDOW = 4
LAYERS = 2
PROMPT = 11  # longer than the window, so the sliding layer drops keys
NEW_TOKENS = 4


def _config() -> GptOssConfig:
    return GptOssConfig(
        num_hidden_layers=LAYERS,
        hidden_size=64,
        intermediate_size=48,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.2,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """One float64 state dict every model of this module loads (cast to its dtype)."""
    torch.manual_seed(1234)
    model = GptOssForCausalLM._from_config(_config(), attn_implementation="eager", dtype=torch.float64)
    state = model.state_dict()
    for name, t in state.items():
        if name.endswith("sinks"):
            t.copy_(torch.randn_like(t))  # sinks of order 1: a visible share of each softmax
        elif name.endswith("gate_up_proj_bias") or name.endswith("down_proj_bias"):
            t.copy_(0.3 * torch.randn_like(t))  # nonzero biases, so their layout is checked
    return state


def _model(weights: dict[str, torch.Tensor], dtype: torch.dtype, impl: str) -> GptOssForCausalLM:
    # A fresh config per model: _from_config writes the implementation into the config object.
    model = GptOssForCausalLM._from_config(
        _config(), attn_implementation=impl, experts_implementation=impl, dtype=dtype
    ).eval()
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()})
    assert model.config._attn_implementation == impl and model.config._experts_implementation == impl
    return model


def _prompt(batch: int = 2, length: int = PROMPT, seed: int = 7) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g)


def _expect_our_kernels(forwards: int, decodes: int = 0) -> None:
    """Since the last reset, each of ``forwards`` model calls over several tokens made one
    mha_prefill per layer, each of ``decodes`` one-token calls one mha_decode_with_kvcache
    per layer, and every call one moe_apply per layer; each was served by a recorded kernel."""
    counts = ts_hf.kernel_counts()
    print("kernels:", counts)
    ops = ("attention.prefill", "attention.decode", "moe.apply")
    per_op = {op: sum(n for (o, _), n in counts.items() if o == op) for op in ops}
    want = {"attention.prefill": LAYERS * forwards, "attention.decode": LAYERS * decodes}
    want["moe.apply"] = LAYERS * (forwards + decodes)
    assert per_op == want, counts
    assert all(kernel != "?" for _, kernel in counts), counts


class _RoutingReplay:
    """Records a model's router outputs in call order, then replays them into another model.

    A near tie between two experts' router logits is a discontinuity: bf16 rounding may pick
    either expert, and the two picks give outputs far apart. Comparisons in bf16 therefore
    give both sides the same routing, so what is compared is attention and expert numerics."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []
        self.next = 0
        self.handles: list = []

    def _routers(self, model) -> list[torch.nn.Module]:
        return [layer.mlp.router for layer in model.model.layers]

    def record(self, model) -> _RoutingReplay:
        for router in self._routers(model):
            self.handles.append(router.register_forward_hook(lambda _m, _i, out: self.calls.append(out)))
        return self

    def replay(self, model) -> _RoutingReplay:
        def hook(_m, _i, out):
            logits, scores, ids = self.calls[self.next]
            self.next += 1
            assert ids.shape == out[2].shape
            return logits.to(out[0].dtype), scores.to(out[1].dtype), ids

        for router in self._routers(model):
            self.handles.append(router.register_forward_hook(hook))
        return self

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def test_core_import_does_not_import_transformers():
    code = "import sys, tokenspeed_kernel; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_registered_under_transformers_interfaces():
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["tokenspeed"] is ts_hf.tokenspeed_attention_forward
    assert AttentionMaskInterface._global_mapping["tokenspeed"] is ts_hf.tokenspeed_padding_mask
    assert ExpertsInterface._global_mapping["tokenspeed"] is ts_hf.tokenspeed_experts_forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_logits_match_eager(weights, dtype):
    """Logits of ours and of transformers' eager in ``dtype`` against the float64 eager model
    (in bf16 both replay the float64 model's routing, see :class:`_RoutingReplay`)."""
    ids = _prompt()
    exact = _model(weights, torch.float64, "eager")
    eager = _model(weights, dtype, "eager")
    ours = _model(weights, dtype, "tokenspeed")
    with torch.no_grad():
        routing = _RoutingReplay().record(exact)
        want = exact(ids).logits
        routing.remove()
        if dtype == torch.bfloat16:
            routing.replay(eager)
        base = eager(ids).logits.double()
        routing.remove()
        routing.next = 0
        if dtype == torch.bfloat16:
            routing.replay(ours)
        ts_hf.reset_kernel_counts()
        got = ours(ids).logits.double()
        routing.remove()
    _expect_our_kernels(1)
    scale = want.abs().max().item()
    err_ours = (got - want).abs().max().item()
    err_eager = (base - want).abs().max().item()
    err_vs_eager = (got - base).abs().max().item()
    print(
        f"{dtype}: max|logit|={scale:.3f} ours-f64={err_ours:.2e} eager-f64={err_eager:.2e} ours-eager={err_vs_eager:.2e}"
    )
    if dtype == torch.float32:
        assert err_vs_eager <= 2e-5 * scale, err_vs_eager
        assert err_ours <= 2e-5 * scale, err_ours
    else:
        # bf16: as close to float64 as transformers' own bf16 eager, within bf16 resolution.
        assert err_ours <= 2.0 * err_eager + 4e-3 * scale, (err_ours, err_eager)
        assert err_vs_eager <= 3e-2 * scale, err_vs_eager
    # The check can see the features it claims to: without sinks, or with a wider window,
    # the float64 logits move by far more than the tolerance above.
    for name, change in (("sinks", "sinks"), ("window", "window")):
        other = copy.deepcopy(exact)
        if change == "window":
            other.config.sliding_window = WINDOW + 1  # eager's mask reads the config
        for layer in other.model.layers:
            if change == "sinks":
                layer.self_attn.sinks.data.fill_(-1e4)
            elif layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = WINDOW + 1
        with torch.no_grad():
            moved = (other(ids).logits - want).abs().max().item()
        print(f"  logits move by {moved:.2e} without {name}")
        assert moved > 20 * max(err_ours, 1e-3 * scale), (name, moved)


def test_generate_float32_same_tokens(weights):
    ids = _prompt()
    eager = _model(weights, torch.float32, "eager")
    ours = _model(weights, torch.float32, "tokenspeed")
    with torch.no_grad():
        ts_hf.reset_kernel_counts()
        want = eager.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert ts_hf.kernel_counts() == {}  # the eager model never calls us
        got = ours.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    print("eager:", want[:, PROMPT:].tolist(), "ours:", got[:, PROMPT:].tolist())
    _expect_our_kernels(1, NEW_TOKENS - 1)  # the prompt, then one decode per new token
    assert torch.equal(got, want)


def test_generate_bfloat16_greedy(weights):
    """bf16 greedy decoding, ours replaying eager's routing call by call: our tokens equal
    eager's at every step whose top two eager logits differ by more than bf16 resolves, up
    to the first step where the two sequences part (legitimately, at a near tie)."""
    ids = _prompt()
    eager = _model(weights, torch.bfloat16, "eager")
    ours = _model(weights, torch.bfloat16, "tokenspeed")
    with torch.no_grad():
        routing = _RoutingReplay().record(eager)
        result = eager.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        routing.remove()
        want, steps = result.sequences, torch.stack(result.logits, dim=1).double()  # [B, N, V]
        routing.replay(ours)
        ts_hf.reset_kernel_counts()
        got = ours.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        routing.remove()
    _expect_our_kernels(1, NEW_TOKENS - 1)
    assert routing.next == len(routing.calls)  # ours made the same router calls as eager
    print("eager:", want[:, PROMPT:].tolist(), "ours:", got[:, PROMPT:].tolist())
    tol = 2e-2 * steps.abs().max().item()
    resolvable = 0
    for b in range(got.shape[0]):
        for t in range(NEW_TOKENS):
            top2 = steps[b, t].topk(2).values
            if top2[0] - top2[1] > tol:
                resolvable += 1
                assert got[b, PROMPT + t] == want[b, PROMPT + t], (b, t)
            if got[b, PROMPT + t] != want[b, PROMPT + t]:
                break  # a near tie parted the sequences; later steps see different prefixes
    assert resolvable >= NEW_TOKENS  # the check decided something


def test_left_padded_batch(weights):
    """Left (and right) padding: the mask builder hands the key mask to the attention, which
    serves each row's valid tokens as one ragged sequence; valid positions match eager, and
    generate (every step through the padded path) gives eager's tokens."""
    ids = _prompt(batch=3)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # three pad tokens on the left
    mask[2, :7] = 0  # pad longer than the window
    ids = ids.masked_fill(mask == 0, 0)
    eager = _model(weights, torch.float32, "eager")
    ours = _model(weights, torch.float32, "tokenspeed")
    with torch.no_grad():
        want = eager(ids, attention_mask=mask).logits
        ts_hf.reset_kernel_counts()
        got = ours(ids, attention_mask=mask).logits
        _expect_our_kernels(1)
        valid = mask.bool()
        err = (got - want)[valid].abs().max().item()
        print(f"padded forward: max err on valid positions {err:.2e}")
        assert err <= 2e-5 * want.abs().max().item()
        right = mask.clone()
        right[0, -4:] = 0  # a right-padded row in the same batch (a forward only: generate pads left)
        err_right = (ours(ids, attention_mask=right).logits - eager(ids, attention_mask=right).logits)[right.bool()]
        print(f"mixed left/right padding: max err on valid positions {err_right.abs().max().item():.2e}")
        assert err_right.abs().max().item() <= 2e-5 * want.abs().max().item()
        want_gen = eager.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        got_gen = ours.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    print("eager:", want_gen[:, PROMPT:].tolist(), "ours:", got_gen[:, PROMPT:].tolist())
    assert torch.equal(got_gen, want_gen)


def test_moe_topk_router(weights):
    """GPT-OSS's router (top-k logits, softmax over them) through moe_topk gives the same
    model output."""
    ids = _prompt()
    eager = _model(weights, torch.float32, "eager")
    ours = _model(weights, torch.float32, "tokenspeed")
    assert ts_hf.use_moe_topk_router(ours) == LAYERS
    with torch.no_grad():
        want = eager(ids).logits
        ts_hf.reset_kernel_counts()
        got = ours(ids).logits
    counts = ts_hf.kernel_counts()
    print("kernels:", counts)
    assert sum(n for (op, _), n in counts.items() if op == "moe.topk") == LAYERS
    err = (got - want).abs().max().item()
    print(f"moe_topk router: max err {err:.2e}")
    assert err <= 2e-5 * want.abs().max().item()
    with pytest.raises(ValueError, match="experts_implementation"):
        ts_hf.use_moe_topk_router(eager)


def test_default_gate_experts_silu():
    """A model whose experts use transformers' default gate (Mixtral: concatenated [gate; up]
    rows, SiLU, no bias) is served by moe_apply's "silu"."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    cfg = MixtralConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(3)
    experts = MixtralExperts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.down_proj.normal_(0, 0.3)
        x = torch.randn(9, 32)
        ids = torch.stack([torch.randperm(4)[:2] for _ in range(9)])
        w = torch.rand(9, 2).softmax(-1)
        want = experts(x, ids, w)
        ts_hf.reset_kernel_counts()
        got = ts_hf.tokenspeed_experts_forward(experts, x, ids, w)
    assert sum(ts_hf.kernel_counts().values()) == 1
    err = (got - want).abs().max().item()
    print(f"mixtral experts: max err {err:.2e}")
    assert err <= 1e-5 * want.abs().max().item()


def test_bad_input_raises(weights):
    ours = _model(weights, torch.float32, "tokenspeed")
    ids = _prompt()
    with pytest.raises(ValueError, match="inference-only"):
        ours(ids)  # gradients enabled
    attn = ours.model.layers[0].self_attn
    q = torch.randn(2, 4, 5, 16)
    k = torch.randn(2, 2, 5, 16)
    holes = torch.tensor([[True, False, True, True, True], [True] * 5])
    with torch.no_grad(), pytest.raises(ValueError, match="contiguous"):
        ts_hf.tokenspeed_attention_forward(attn, q, k, k, holes)
    with torch.no_grad(), pytest.raises(ValueError, match="StaticCache"):
        ts_hf.tokenspeed_attention_forward(attn, q, k, k, torch.ones(2, 7, dtype=torch.bool))
    packed = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    with torch.no_grad():  # one sequence per row passes (and is remembered as checked) ...
        ts_hf.tokenspeed_attention_forward(attn, q, k, k, None, position_ids=torch.arange(5).expand(2, 5))
    with torch.no_grad(), pytest.raises(ValueError, match="packed"):  # ... which does not hide the next
        ts_hf.tokenspeed_attention_forward(attn, q, k, k, None, position_ids=packed)
    experts = ours.model.layers[0].mlp.experts
    experts.alpha = 1.5
    with torch.no_grad(), pytest.raises(ValueError, match="alpha"):
        ts_hf.tokenspeed_experts_forward(
            experts, torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2)
        )
