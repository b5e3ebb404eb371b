"""``flashinfer_cutlass_moe`` against a fake ``flashinfer`` module (no GPU, no flashinfer).

The fake ``cutlass_fused_moe`` records its arguments and computes what FlashInfer's CUTLASS
MoE computes from them (fc1 = ``[up; gate]``, ``Swiglu``/``Geglu``/``SwigluBias`` with the
per-expert alpha/beta/limit, ids outside ``[0, E_local)`` skipped), so a wrong conversion of
our layouts shows up as a wrong answer against ``support.naive_moe``. Also pinned: selection
on faked sm_90 / sm_100 / sm_80 with exact reasons, what ``tokenspeed-kernel list`` prints,
the plan's one-time ``prepare`` and the absence reason.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.machinery
import io
import sys
import types

import pytest
import torch
from support.naive_moe import naive_moe

from tokenspeed_kernel import cli, config, platform, registry, selector
from tokenspeed_kernel.ops.moe import moe_apply, moe_apply_request, moe_plan
from tokenspeed_kernel.platform import platform_from_arch

KERNEL = "flashinfer_cutlass_moe"


class ActivationType(enum.IntEnum):  # flashinfer/tllm_enums.py
    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5


def _fake_cutlass_fused_moe(calls):
    def cutlass_fused_moe(
        input,
        token_selected_experts,
        token_final_scales,
        fc1,
        fc2,
        output_dtype,
        quant_scales,
        *,
        fc1_expert_biases=None,
        fc2_expert_biases=None,
        swiglu_alpha=None,
        swiglu_beta=None,
        swiglu_limit=None,
        ep_size=1,
        ep_rank=0,
        output=None,
        activation_type=ActivationType.Swiglu,
        **rest,
    ):
        calls.append(dict(locals()))
        inter = fc2.shape[2]
        acc = torch.zeros(input.shape, dtype=torch.float64)
        for t in range(input.shape[0]):
            for j in range(token_selected_experts.shape[1]):
                e = int(token_selected_experts[t, j])
                if not 0 <= e < fc1.shape[0]:
                    continue
                h = fc1[e].double() @ input[t].double()
                if fc1_expert_biases is not None:
                    h = h + fc1_expert_biases[e].double()
                linear, gate = h[:inter], h[inter:]
                if activation_type == ActivationType.Swiglu:
                    a = torch.nn.functional.silu(gate) * linear
                elif activation_type == ActivationType.Geglu:
                    a = torch.nn.functional.gelu(gate) * linear
                else:
                    assert activation_type == ActivationType.SwigluBias
                    alpha, beta, limit = (float(p[e]) for p in (swiglu_alpha, swiglu_beta, swiglu_limit))
                    g = gate.clamp(max=limit)
                    a = g * torch.sigmoid(alpha * g) * (linear.clamp(-limit, limit) + beta)
                y = fc2[e].double() @ a
                if fc2_expert_biases is not None:
                    y = y + fc2_expert_biases[e].double()
                acc[t] += float(token_final_scales[t, j]) * y
        output.copy_(acc.to(output_dtype))
        return [output]

    return cutlass_fused_moe


def _set_platform(monkeypatch, arch):
    monkeypatch.setenv(config.PLATFORM_ENV, arch)
    config.refresh()
    platform.refresh()
    selector.clear_cache()


@pytest.fixture
def fake(monkeypatch):
    """A findable ``flashinfer`` with a computing ``cutlass_fused_moe`` and an ``autotune``
    context that records its use (``calls`` gets ``("autotune", flag)``), platform sm_90."""
    from tokenspeed_kernel_nvidia.ops.moe import flashinfer_cutlass_moe

    calls: list = []
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.ActivationType = ActivationType
    module.cutlass_fused_moe = _fake_cutlass_fused_moe(calls)

    @contextlib.contextmanager
    def autotune(flag=True):
        calls.append(("autotune", flag))
        yield

    module.autotune = autotune
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_cutlass_moe, "_activation_params", {})
    _set_platform(monkeypatch, "sm_90")
    yield calls
    monkeypatch.delenv(config.PLATFORM_ENV)
    config.refresh()
    platform.refresh()
    selector.clear_cache()


def _request(weight_format="plain", hidden=64, intermediate=32, x_dtype=torch.bfloat16, **kw):
    return moe_apply_request(
        x_dtype=x_dtype,
        num_experts=8,
        top_k=2,
        hidden=hidden,
        intermediate=intermediate,
        weight_format=weight_format,
        **kw,
    )


def _reasons(request, arch):
    selection = selector.explain(request, platform=platform_from_arch(arch))
    return {c.spec.name: c.reasons for c in selection.candidates}[KERNEL]


def test_metadata_is_honest():
    spec = registry.get_kernel(KERNEL)
    assert spec.op == "moe.apply" and spec.backend == "nvidia" and spec.solution == "flashinfer"
    assert spec.archs == frozenset({"sm_90"})  # the one architecture we have tried it on
    assert spec.band.name == "OPT_IN" and spec.graph_safe is False and spec.prepare is not None
    assert spec.features == frozenset({"silu", "gelu", "swiglu_oai", "bias", "expert_map"})


def test_selection_on_faked_platforms(fake):
    request = _request(activation="swiglu_oai", bias=True, expert_map=True)
    assert _reasons(request, "sm_90") == ()
    for arch in ("sm_80", "sm_100"):  # sm_100: FlashInfer builds it, we have never tried
        (why,) = _reasons(request, arch)
        assert arch in why or "arch" in why
    assert _reasons(request, "gfx942")


def test_offered_without_any_switch_once_verified(fake):
    """Verified on the H100 (docs/history.md): flashinfer-python present is all it needs."""
    request = _request(activation="swiglu_oai", bias=True)
    assert _reasons(request, "sm_90") == ()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"weight_format": "mxfp4"}, "does not support {mxfp4}"),
        ({"weight_format": "fp8_per_tensor"}, "does not support {fp8_per_tensor}"),
        ({"weight_format": "fp8_block"}, "weight dtype float8_e4m3fn not in {bfloat16, float16}"),
        ({"weight_format": "mxfp4", "activation_quant": "mxfp8"}, "mxfp8_act"),
        ({"hidden": 60}, "hidden=60 is not a multiple of 8"),
        ({"intermediate": 36}, "intermediate=36 is not a multiple of 8"),
    ],
)
def test_rejections_name_the_reason(fake, kw, needle):
    reasons = _reasons(_request(**kw), "sm_90")
    assert reasons and any(needle in r for r in reasons), reasons


def test_float32_x_is_rejected_by_dtype(fake):
    reasons = _reasons(_request(x_dtype=torch.float32), "sm_90")
    assert reasons and any("float32" in r for r in reasons), reasons


def test_list_prints_the_archs(fake):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(["list", "moe.apply"]) == 0
    (line,) = [ln for ln in buf.getvalue().splitlines() if ln.strip().startswith(KERNEL + " ")]
    assert " archs=sm_90 " in line
    assert "priority=opt_in" in line and "graph_safe=no" in line and "hooks=prepare" in line
    assert "Plain bf16/fp16 weights only" in buf.getvalue()  # the description line


def _problem(t=5, e=8, h=64, i=32, k=2, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype)
    b13 = (0.5 * torch.randn(e, 2 * i, generator=gen)).to(dtype)
    b2 = 0.5 * torch.randn(e, h, generator=gen)  # float32 bias
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    wts = torch.rand(t, k, generator=gen).softmax(-1)
    return x, w13, w2, b13, b2, ids, wts


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("bias", [False, True])
def test_call_converts_layouts_and_matches_reference(fake, activation, bias):
    x, w13, w2, b13, b2, ids, wts = _problem()
    b13, b2 = (b13, b2) if bias else (None, None)
    out = moe_apply(x, w13, w2, wts, ids, activation=activation, w13_bias=b13, w2_bias=b2, override=KERNEL)
    (call,) = fake
    inter = 32
    assert torch.equal(call["fc1"][:, :inter], w13[:, inter:]) and torch.equal(call["fc1"][:, inter:], w13[:, :inter])
    assert call["fc1"].is_contiguous() and call["fc1"].dtype == torch.bfloat16
    assert call["fc2"].shape == (8, 64, 32) and torch.equal(call["fc2"], w2)
    assert call["token_selected_experts"].dtype == torch.int32 and torch.equal(call["token_selected_experts"], ids)
    assert call["token_final_scales"].dtype == torch.float32 and torch.equal(call["token_final_scales"], wts)
    assert call["output_dtype"] == torch.bfloat16 and call["quant_scales"] is None
    assert (call["ep_size"], call["ep_rank"]) == (1, 0)
    assert call["activation_type"] == {"silu": 3, "gelu": 4, "swiglu_oai": 5}[activation]
    if activation == "swiglu_oai":
        for name, value in (("swiglu_alpha", 1.702), ("swiglu_beta", 1.0), ("swiglu_limit", 7.0)):
            p = call[name]
            assert p.dtype == torch.float32 and p.shape == (8,) and torch.all(p == torch.tensor(value))
    else:
        assert call["swiglu_alpha"] is None and call["swiglu_beta"] is None and call["swiglu_limit"] is None
    if bias:
        fb1, fb2 = call["fc1_expert_biases"], call["fc2_expert_biases"]
        assert fb1.dtype == fb2.dtype == torch.bfloat16  # the binding's output dtype
        assert torch.equal(fb1[:, :inter], b13[:, inter:]) and torch.equal(fb1[:, inter:], b13[:, :inter])
        assert torch.equal(fb2, b2.to(torch.bfloat16))
    else:
        assert call["fc1_expert_biases"] is None and call["fc2_expert_biases"] is None
    assert call["output"] is out
    ref = naive_moe(x, w13, w2, wts, ids, activation=activation, w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(out.double(), ref.double(), atol=3e-2, rtol=3e-2)


def test_one_bias_gets_a_zero_partner(fake):
    x, w13, w2, b13, _, ids, wts = _problem()
    moe_apply(x, w13, w2, wts, ids, w13_bias=b13, override=KERNEL)
    (call,) = fake
    assert torch.equal(call["fc2_expert_biases"], torch.zeros(8, 64, dtype=torch.bfloat16))


def test_expert_map_is_remapped_on_the_device(fake):
    x, w13, w2, b13, b2, _, wts = _problem(e=4)
    ids = torch.tensor([[0, 5], [2, 3], [6, 7], [1, 4], [7, 0]], dtype=torch.int32)
    emap = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)  # 8 global -> 4 local
    out = moe_apply(
        x, w13, w2, wts, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap, override=KERNEL
    )
    (call,) = fake
    assert call["token_selected_experts"].tolist() == [[4, 4], [4, 1], [3, 4], [0, 2], [4, 4]]
    assert call["token_selected_experts"].dtype == torch.int32 and call["ep_size"] == 1
    ref = naive_moe(x, w13, w2, wts, ids, activation="swiglu_oai", w13_bias=b13, w2_bias=b2, expert_map=emap)
    torch.testing.assert_close(out.double(), ref.double(), atol=3e-2, rtol=3e-2)
    assert torch.all(out[0] == 0)  # both choices off this rank


def test_plan_prepares_once(fake):
    x, w13, w2, b13, b2, ids, wts = _problem()
    plan = moe_plan(
        w13, w2, x_dtype=torch.bfloat16, top_k=2, activation="silu", w13_bias=b13, w2_bias=b2, override=KERNEL
    )
    assert plan.kernel == KERNEL
    plan.apply(x, wts, ids)
    out = plan.apply(x, wts, ids)
    # the plan's first call runs under FlashInfer's autotuner, the next ones do not
    assert fake[0] == ("autotune", True) and plan.prepared.tuned
    first, second = fake[1:]
    assert first["fc1"] is second["fc1"] is plan.prepared.fc1
    assert first["fc1_expert_biases"] is plan.prepared.fc1_bias
    ref = naive_moe(x, w13, w2, wts, ids, activation="silu", w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(out.double(), ref.double(), atol=3e-2, rtol=3e-2)


def test_absent_flashinfer_is_reported(monkeypatch):
    from tokenspeed_kernel_nvidia.ops.attention import _flashinfer

    monkeypatch.setattr(_flashinfer.importlib.util, "find_spec", lambda name, *a: None)
    selector.clear_cache()
    try:
        assert _reasons(_request(), "sm_90") == ("flashinfer-python not installed",)
    finally:
        selector.clear_cache()


def test_functional_calls_and_the_switch_never_tune(fake, monkeypatch):
    from tokenspeed_kernel_nvidia.ops.moe.flashinfer_cutlass_moe import NO_AUTOTUNE_ENV

    x, w13, w2, b13, b2, ids, wts = _problem()
    moe_apply(x, w13, w2, wts, ids, activation="silu", w13_bias=b13, w2_bias=b2, override=KERNEL)
    monkeypatch.setenv(NO_AUTOTUNE_ENV, "1")
    plan = moe_plan(
        w13, w2, x_dtype=torch.bfloat16, top_k=2, activation="silu", w13_bias=b13, w2_bias=b2, override=KERNEL
    )
    plan.apply(x, wts, ids)
    assert len(fake) == 2 and all(isinstance(c, dict) for c in fake) and not plan.prepared.tuned
