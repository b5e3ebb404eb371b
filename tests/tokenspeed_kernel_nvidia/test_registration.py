"""The NVIDIA backend loads, registers honest metadata, and gates by platform (no GPU needed)."""

import dataclasses
import importlib.util

import pytest
import torch

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.registry import Priority, Request

NVIDIA_KERNELS = {
    "flashinfer_decode": "attention.decode",
    "flashinfer_extend": "attention.extend",
    "flashinfer_prefill": "attention.prefill",
    "gluon_decode_sm90": "attention.decode",
    "gluon_prefill_window_sm90": "attention.prefill",
    "gluon_prefill_fa3_sm90": "attention.prefill",
    "gluon_prefill_fa3_window_sm90": "attention.prefill",
    "gluon_extend_fa3_sm90": "attention.extend",
    "gluon_moe_decode_mx_sm90": "moe.apply",
    "gluon_moe_mma_sm90": "moe.apply",
    "flashinfer_cutlass_moe": "moe.apply",
    "fa4_prefill_sm90": "attention.prefill",
    "trtllm_xqa_decode": "attention.decode",
    "trtllm_fmha_prefill": "attention.prefill",
}
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _decode_request(features=("sinks", "sliding_window"), q_len=1, head_dim=64, kv=torch.bfloat16, batch=None):
    shapes = {"head_dim": head_dim, "head_dim_v": head_dim, "num_q_heads": 64, "num_kv_heads": 8}
    shapes |= {"page_size": 16, "q_len": q_len} | ({} if batch is None else {"batch_bucket": batch})
    return Request.make("attention.decode", {"q": torch.bfloat16, "kv": kv}, shapes, features)


def _verdict(request, arch):
    selection = selector.explain(request, platform=platform_from_arch(arch))
    return {c.spec.name: c.reasons for c in selection.candidates}, selection


def test_backend_loads_and_registers_every_kernel():
    status = {b.name: b for b in registry.backends()}
    assert status["nvidia"].state == "loaded", status["nvidia"].error
    assert set(NVIDIA_KERNELS) <= set(status["nvidia"].kernels)
    for name, op in NVIDIA_KERNELS.items():
        spec = registry.get_kernel(name)
        assert spec.op == op and spec.backend == "nvidia"
        assert spec.vendors == frozenset({"cuda"})


# Measured correct and faster than every portable kernel in their regime on an H100
# (docs/history.md): ranked above the Triton kernels.
PROMOTED = {"gluon_moe_decode_mx_sm90", "gluon_moe_mma_sm90"}


def test_priorities_and_gates_are_honest():
    # Unverified or measured slower (FlashInfer, the Gluon attention kernels) rank below the
    # portable Triton kernels until a device run shows them correct and faster.
    for name in NVIDIA_KERNELS:
        spec = registry.get_kernel(name)
        if name in PROMOTED:
            assert spec.priority >= Priority.PERFORMANT and spec.predicate is not None, (name, spec.priority)
        else:
            assert spec.priority < Priority.PORTABLE, (name, spec.priority)
    gluon = registry.get_kernel("gluon_decode_sm90")
    assert gluon.archs == frozenset({"sm_90"})
    assert "fp8_kv" not in gluon.features and "spec_decode" not in gluon.features


def test_importing_the_backend_does_not_import_flashinfer():
    import sys

    import tokenspeed_kernel_nvidia

    tokenspeed_kernel_nvidia.register()
    if not HAS_FLASHINFER:
        assert "flashinfer" not in sys.modules


@pytest.mark.skipif(HAS_FLASHINFER, reason="flashinfer-python is installed here; the absence path is not testable")
@pytest.mark.parametrize("op", ["attention.decode", "attention.extend", "attention.prefill"])
def test_flashinfer_absent_reason(op):
    request = Request.make(op, {"q": torch.bfloat16, "kv": torch.bfloat16}, {"head_dim": 64})
    reasons, _ = _verdict(request, "sm_90")
    name = "flashinfer_" + op.split(".")[1]
    assert reasons[name] == ("flashinfer-python not installed",)
    trtllm = {"attention.decode": "trtllm_xqa_decode", "attention.prefill": "trtllm_fmha_prefill"}.get(op)
    if trtllm:  # the TensorRT-LLM kernels come through FlashInfer: masked by its absence alike
        assert reasons[trtllm] == ("flashinfer-python not installed",)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_gluon_decode_ranks_first_where_measured_faster_at_head_dim_64(batch):
    # H100 (docs/history.md): faster than triton_decode at these batch buckets, head dim 64.
    reasons, selection = _verdict(_decode_request(batch=batch), "sm_90")
    assert reasons["gluon_decode_sm90"] == ()
    assert selection.winner.name == "gluon_decode_sm90"
    used = {c.spec.name: c.spec.priority_for(selection.request) for c in selection.candidates if c.accepted}
    assert used["gluon_decode_sm90"] == Priority.PERFORMANT > used["triton_decode"]


@pytest.mark.parametrize("batch, head_dim", [(1024, 64), (4096, 64), (1, 128), (256, 128)])
def test_gluon_decode_stays_below_triton_outside_its_measured_regime(batch, head_dim):
    _, selection = _verdict(_decode_request(batch=batch, head_dim=head_dim), "sm_90")
    assert selection.winner.name == "triton_decode", (batch, head_dim)


def test_gluon_decode_serves_sm90_only_and_ranks_below_triton():
    request = _decode_request()  # no batch key: the registered OPT_IN priority
    reasons, selection = _verdict(request, "sm_90")
    assert reasons["gluon_decode_sm90"] == ()
    assert selection.winner.name == "triton_decode"
    ranked = [c.spec.name for c in selection.candidates if not c.reasons]
    assert ranked.index("triton_decode") < ranked.index("gluon_decode_sm90")
    for arch in ("sm_100", "sm_80"):
        reasons, selection = _verdict(request, arch)
        assert any("arch" in r and "sm_90" in r for r in reasons["gluon_decode_sm90"])
        assert selection.winner is None or selection.winner.name != "gluon_decode_sm90"


def test_gluon_decode_rejects_what_it_does_not_do():
    reasons, _ = _verdict(_decode_request(q_len=2, features=("spec_decode",)), "sm_90")
    assert reasons["gluon_decode_sm90"]
    reasons, _ = _verdict(_decode_request(kv=torch.float8_e4m3fn, features=("fp8_kv",)), "sm_90")
    assert reasons["gluon_decode_sm90"]
    reasons, _ = _verdict(_decode_request(head_dim=256), "sm_90")
    assert any("head_dim=256" in r for r in reasons["gluon_decode_sm90"])


def test_not_offered_on_rocm_or_cpu():
    for arch in ("gfx942", "cpu"):
        reasons, _ = _verdict(_decode_request(), arch)
        for name in ("flashinfer_decode", "gluon_decode_sm90"):
            assert reasons[name], (name, arch)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer-python not installed: its gates are masked by absence")
def test_flashinfer_gates_with_flashinfer():
    reasons, _ = _verdict(_decode_request(features=("sinks", "fp8_kv")), "sm_90")
    assert reasons["flashinfer_decode"] == ()
    reasons, _ = _verdict(_decode_request(), "sm_80")  # FA2 path: never run by us
    assert any("arch" in r and "sm_90" in r for r in reasons["flashinfer_decode"])


def _prefill_request(
    features=("sinks", "sliding_window"), head_dim=64, hq=64, hkv=8, dtype=torch.bfloat16, window_left=None
):
    shapes = {"head_dim": head_dim, "head_dim_v": head_dim, "num_q_heads": hq, "num_kv_heads": hkv}
    if window_left is not None:
        shapes["window_left"] = window_left
    return Request.make("attention.prefill", {"q": dtype, "kv": dtype}, shapes, features)


def test_gluon_prefill_window_serves_sm90_windows_and_ranks_first_at_gpt_oss_window():
    spec = registry.get_kernel("gluon_prefill_window_sm90")
    assert spec.archs == frozenset({"sm_90"}) and spec.capabilities == frozenset({"tma", "wgmma"})
    assert spec.features == frozenset({"sinks", "sliding_window", "logit_cap", "return_lse", "strided_q"})
    for features in (("sinks", "sliding_window"), ("sliding_window", "logit_cap", "return_lse")):
        reasons, selection = _verdict(_prefill_request(features), "sm_90")
        assert reasons["gluon_prefill_window_sm90"] == ()
        assert selection.winner.name == "triton_prefill"
    reasons, _ = _verdict(_prefill_request(head_dim=128, dtype=torch.float16), "sm_90")
    assert reasons["gluon_prefill_window_sm90"] == ()
    reasons, selection = _verdict(_prefill_request(window_left=127), "sm_90")  # what the public call asks
    assert reasons["gluon_prefill_window_sm90"] == ()
    assert selection.winner.name == "gluon_prefill_window_sm90"  # GPT-OSS's window: measured faster
    for other in ({"window_left": 255}, {"window_left": 127, "head_dim": 128, "dtype": torch.float16}):
        _, selection = _verdict(_prefill_request(**other), "sm_90")
        assert selection.winner.name == "triton_prefill", other
    for arch in ("sm_100", "sm_80", "gfx942", "cpu"):
        reasons, _ = _verdict(_prefill_request(), arch)
        assert reasons["gluon_prefill_window_sm90"], arch


def test_gluon_prefill_fa3_ranks_first_from_the_measured_length():
    """Faster than triton_prefill from 2048 queries up at D = 64 (H200, prefill-lengths), slower
    below; at D = 128 faster from 512 (prefill-lengths-d128; shorter ones unmeasured)."""
    spec = registry.get_kernel("gluon_prefill_fa3_sm90")

    def winner(bucket, head_dim=64):
        request = _prefill_request(features=("sinks",), head_dim=head_dim)
        shapes = {**dict(request.shapes), "max_seqlen_q_bucket": bucket}
        request = Request.make(request.op, dict(request.dtypes), shapes, request.features)
        return selector.explain(request, platform=platform_from_arch("sm_90")).winner.name

    assert spec.priority == Priority.OPT_IN
    for bucket in (1, 512, 1024):
        assert winner(bucket) == "triton_prefill", bucket
    for bucket in (2048, 4096, 8192, 16384, 1 << 18):
        assert winner(bucket) == winner(bucket, head_dim=128) == "gluon_prefill_fa3_sm90", bucket
    assert winner(256, head_dim=128) == "triton_prefill"
    for bucket in (512, 1024):
        assert winner(bucket, head_dim=128) == "gluon_prefill_fa3_sm90", bucket


def test_misaligned_q_k_v_fall_back_to_the_portable_prefill():
    """No NVIDIA prefill kernel claims ``unaligned_qkv`` (TMA and 16-byte vector loads): a
    misaligned call that would reach the FA3 kernel goes to triton_prefill, with the reason."""
    request = _prefill_request(features=("sinks",))
    shapes = {**dict(request.shapes), "max_seqlen_q_bucket": 8192}
    for features, winner in (((), "gluon_prefill_fa3_sm90"), (("unaligned_qkv",), "triton_prefill")):
        asked = Request.make(request.op, dict(request.dtypes), shapes, request.features | set(features))
        reasons, selection = _verdict(asked, "sm_90")
        assert selection.winner.name == winner, features
    for name in ("gluon_prefill_fa3_sm90", "fa4_prefill_sm90", "trtllm_fmha_prefill", "flashinfer_prefill"):
        assert "unaligned_qkv" not in registry.get_kernel(name).features, name
    assert any("unaligned_qkv" in r for r in reasons["gluon_prefill_fa3_sm90"]), reasons["gluon_prefill_fa3_sm90"]


def test_flashinfer_prefill_stays_opt_in_at_every_length():
    """Faster alone from 2048 tokens, but not once its per-layout plan is paid (history.md)."""
    spec = registry.get_kernel("flashinfer_prefill")

    def rank(bucket, **kw):
        request = _prefill_request(**kw)
        shapes = {**dict(request.shapes), "max_seqlen_q_bucket": bucket}
        return spec.priority_for(Request.make(request.op, dict(request.dtypes), shapes, request.features))

    for bucket in (1, 1024, 2048, 8192, 1 << 20):
        assert rank(bucket, features=("sinks",)) == rank(bucket, features=()) == Priority.OPT_IN
    assert rank(8192, window_left=127) == Priority.OPT_IN


@pytest.mark.parametrize(
    "request_kw,needle",
    [
        ({"features": ("sinks",)}, "dense prefill"),
        ({"features": ("sliding_window", "non_causal")}, "non_causal"),
        ({"head_dim": 256}, "head_dim=256"),
        ({"hq": 64, "hkv": 2}, "GQA group of 32"),
        ({"dtype": torch.float32}, "float32"),
        ({"window_left": 1025}, "window_left=1025 > 1024"),
    ],
)
def test_gluon_prefill_window_rejects_with_reasons(request_kw, needle):
    reasons, _ = _verdict(_prefill_request(**request_kw), "sm_90")
    assert any(needle in r for r in reasons["gluon_prefill_window_sm90"]), reasons["gluon_prefill_window_sm90"]


def test_graph_safety_and_layout_hook_are_declared():
    from tokenspeed_kernel_nvidia.ops.attention import flashinfer_decode

    decode = registry.get_kernel("flashinfer_decode")
    assert decode.prepare_layout is flashinfer_decode.plan and decode.graph_safe
    assert "hooks=prepare_layout" in decode.summary() and "graph_safe=yes" in decode.summary()
    for name in ("flashinfer_extend", "flashinfer_prefill"):  # plan per layout on the host, not in graph mode
        assert registry.get_kernel(name).graph_safe is False, name
        assert registry.get_kernel(name).prepare_layout is None
    gluon = registry.get_kernel("gluon_decode_sm90")
    assert gluon.graph_safe and gluon.prepare_layout is None


def test_public_plan_step_reaches_the_flashinfer_plan_with_the_runs_key(monkeypatch):
    """``mha_decode_plan``/``DecodePlan.update`` call ``flashinfer_decode.plan`` with
    placeholder q/out; the wrapper key and layout token it plans for must be the ones the
    captured run later looks up (else a replay would need a plan inside capture)."""
    from tokenspeed_kernel import mha_decode_plan
    from tokenspeed_kernel.tools.cases import attention as cases
    from tokenspeed_kernel_nvidia.ops.attention import _flashinfer, flashinfer_decode

    planned, ran = [], []
    monkeypatch.setattr(flashinfer_decode, "_entry", planned.append)
    case = cases.AttentionCase(
        "attention.decode",
        (1, 1),
        (9, 5),
        8,
        2,
        64,
        page_size=4,
        dtype=torch.bfloat16,
        window_left=3,
        sinks=True,
        logit_cap=5.0,
    )
    inputs = cases.make_inputs(case)
    with registry.isolated():
        registry.register_kernel(
            "attention.decode",
            name="test_flashinfer_hooked",
            solution="test",
            vendors=("cpu",),
            features=("sinks", "sliding_window", "logit_cap"),
            priority=Priority.PLUGIN,
            prepare_layout=flashinfer_decode.plan,
        )(ran.append)
        plan = mha_decode_plan(
            inputs["k_cache"],
            inputs["v_cache"],
            inputs["page_table"],
            inputs["cache_seqlens"],
            9,
            num_q_heads=8,
            window_left=3,
            sinks=inputs["sinks"],
            logit_cap=5.0,
            capturable=True,
        )
        assert plan.kernel == "test_flashinfer_hooked" and len(planned) == 1
        inputs["cache_seqlens"].add_(1)
        plan.update()
        plan.run(inputs["q"])
    assert len(planned) == 2 and len(ran) == 1
    hook_args, run_args = planned[1], ran[0]
    assert flashinfer_decode._key(hook_args) == flashinfer_decode._key(run_args)
    token = _flashinfer.layout_token(hook_args.page_table, hook_args.cache_seqlens)
    assert _flashinfer._same_layout(token, _flashinfer.layout_token(run_args.page_table, run_args.cache_seqlens))


# The Gluon Hopper attention kernels read a row-strided q (a fused qkv's q) in place: the two
# that load q with plain loads at any alignment, the three that read it by TMA (q's own row
# stride in the descriptor) when it is 16-byte aligned.
STRIDED_Q_KERNELS = {
    "gluon_decode_sm90",
    "gluon_prefill_window_sm90",
    "gluon_prefill_fa3_sm90",
    "gluon_prefill_fa3_window_sm90",
    "gluon_extend_fa3_sm90",
}


def _strided_request(op: str, *, window_left: int = -1, q_align: int = 16, unaligned: bool = False) -> Request:
    """GPT-OSS-120B's attention (64 / 8 heads, D 64, bf16, sinks) with a row-strided q; a
    prefill's alignment is ``unaligned_qkv``, an extend's or decode's ``q_align``."""
    from tokenspeed_kernel import Heads, attention_request

    paged = op != "attention.prefill"
    return attention_request(
        op, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, heads=Heads(64, 8, 64, 64), window_left=window_left,
        sinks=True, page_size=16 if paged else None, q_len=1 if op == "attention.decode" else None,
        batch=2 if op == "attention.decode" else None, max_seqlen_q=None if op == "attention.decode" else 2048,
        strided_q=True, q_align=q_align if paged else None, unaligned_qkv=unaligned,
    )  # fmt: skip


def test_the_gluon_attention_kernels_claim_a_row_strided_q_and_the_others_decline_it():
    """Every Gluon Hopper attention kernel lists ``strided_q`` (only the TMA extend also bounds
    ``q_align``); the library kernels (FlashInfer, TensorRT-LLM, FA4), whose wrappers take a
    contiguous q, do not, and their metadata refuses such a call naming the feature."""
    for name, op in NVIDIA_KERNELS.items():
        if not op.startswith("attention."):
            continue
        spec = registry.get_kernel(name)
        assert ("strided_q" in spec.features) == (name in STRIDED_Q_KERNELS), name
        assert ("q_align" in dict(spec.shapes)) == (name == "gluon_extend_fa3_sm90"), name
        if name not in STRIDED_Q_KERNELS:
            reasons = selector.request_reasons(spec, _strided_request(op), predicate=False)
            assert any("strided_q" in r for r in reasons), (name, reasons)


@pytest.mark.parametrize(
    ("op", "window_left", "winner"),
    [
        ("attention.prefill", -1, "gluon_prefill_fa3_sm90"),
        ("attention.prefill", 127, "gluon_prefill_window_sm90"),
        ("attention.extend", -1, "gluon_extend_fa3_sm90"),
        ("attention.decode", -1, "gluon_decode_sm90"),
        ("attention.decode", 127, "gluon_decode_sm90"),
    ],
)
def test_a_row_strided_q_goes_to_the_kernel_a_contiguous_one_gets(op, window_left, winner):
    """On sm_90, GPT-OSS's row-strided q (a fused qkv's q: rows of 80 x 64 bf16, 16-byte
    aligned) is served by the Gluon kernel that serves its contiguous q: no copy, no other
    kernel."""
    strided = _strided_request(op, window_left=window_left)
    contiguous = dataclasses.replace(
        strided,
        features=strided.features - {"strided_q"},
        shapes=tuple((k, v) for k, v in strided.shapes if k != "q_align"),
    )
    assert _verdict(strided, "sm_90")[1].winner.name == winner
    assert _verdict(contiguous, "sm_90")[1].winner.name == winner


@pytest.mark.parametrize(
    ("op", "window_left", "declines", "reason", "winner"),
    [
        ("attention.prefill", -1, "gluon_prefill_fa3_sm90", "does not support {unaligned_qkv}", "triton_prefill"),
        ("attention.prefill", 127, "gluon_prefill_window_sm90", "does not support {unaligned_qkv}", "triton_prefill"),
        ("attention.extend", -1, "gluon_extend_fa3_sm90", "q_align=8 not in {16}", "triton_extend"),
    ],
)
def test_a_q_that_tma_cannot_read_is_passed_over_with_its_reason(op, window_left, declines, reason, winner):
    """A row-strided q whose row stride (or base) is not a 16-byte multiple (bf16 rows of an
    odd number of 4-element groups: an 8-byte multiple): the TMA kernels decline it before
    any launch, naming why (a prefill's q, k and v share ``unaligned_qkv``; the window prefill,
    whose K/V arrive by TMA, declines it too), and the Triton kernel serves it in place. The
    decode kernel loads q with plain loads: it serves any alignment."""
    unaligned = _strided_request(op, window_left=window_left, q_align=8, unaligned=op == "attention.prefill")
    reasons, selection = _verdict(unaligned, "sm_90")
    assert reason in reasons[declines] and selection.winner.name == winner
    decode = _strided_request("attention.decode", q_align=2)
    assert _verdict(decode, "sm_90")[1].winner.name == "gluon_decode_sm90"


def test_check_derives_a_strided_q_case_for_each_kernel_that_claims_it():
    """``tokenspeed-kernel check`` (derived cases, on a GPU) runs each claiming kernel on a
    ``feature-strided_q`` case (a fused qkv's q, NaN past each row's q); for the TMA extend
    that case also exercises its ``q_align=16`` claim."""
    from tokenspeed_kernel.tools import claims
    from tokenspeed_kernel.tools.cases import attention as cases

    for name in sorted(STRIDED_Q_KERNELS):
        derivation = claims.derive(registry.get_kernel(name), "cuda", 0)
        case = derivation.case("feature-strided_q")
        assert case.case.strided_q and "strided_q" in cases.request(case.case).features, name
        exercised = {str(c) for c in case.claims}
        assert "feature strided_q" in exercised, (name, exercised)
        assert ("shape q_align=16" in exercised) == (name == "gluon_extend_fa3_sm90"), (name, exercised)
