"""``fa4_prefill_sm90`` (FlashAttention-4's CuTe DSL Hopper forward) without a GPU: registration,
why it is unavailable, the AOT bundle's checks and variant gate, and the call's arguments.

The compiled kernels themselves are exercised in test_aot_fa4.py (needs the ``cutedsl``
extra or a built bundle) and on a GPU in test_fa4_gpu.py.
"""

import json

import pytest
import torch
from support.prefill_args import ragged_prefill_args

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.ops.attention.api import attention_request
from tokenspeed_kernel.ops.attention.args import Heads
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel_nvidia.ops.attention import _fa4

KERNEL = "fa4_prefill_sm90"
GPT_OSS = _fa4.Fa4Variant("bfloat16", 64, 64, 8, True, True, True, True)
GPT_OSS_HEADS = Heads(64, 8, 64, 64)


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv(_fa4.AOT_ENV, raising=False)
    _fa4._read_bundle.cache_clear()
    yield
    _fa4._read_bundle.cache_clear()


def _request(dtype=torch.bfloat16, heads=GPT_OSS_HEADS, **options):
    return attention_request("attention.prefill", q_dtype=dtype, kv_dtype=dtype, heads=heads, **options)


def _reasons(request, arch="sm_90"):
    selection = selector.explain(request, platform=platform_from_arch(arch))
    return {c.spec.name: c.reasons for c in selection.candidates}[KERNEL]


def _bundle(tmp_path, variants=(GPT_OSS,), fmt=_fa4.MANIFEST_FORMAT):
    for name in (_fa4.LIBRARY, _fa4.RUNTIME):
        (tmp_path / name).write_bytes(b"")
    entries = [v.to_json() | {"symbol": f"__tvm_ffi_{v.name}"} for v in variants]
    (tmp_path / _fa4.MANIFEST).write_text(json.dumps({"format": fmt, "variants": entries}))
    return tmp_path


def test_registration_is_honest():
    spec = registry.get_kernel(KERNEL)
    assert (spec.op, spec.backend, spec.solution) == ("attention.prefill", "nvidia", "cutedsl")
    assert spec.archs == frozenset({"sm_90"}) and spec.vendors == frozenset({"cuda"})
    assert spec.priority == Priority.OPT_IN  # first only where the H100 measured it faster:
    ((shapes, rank),) = spec.rank_rules
    assert rank == Priority.PERFORMANT + 10  # above gluon_prefill_fa3_sm90
    assert rank > registry.get_kernel("gluon_prefill_fa3_sm90").priority
    assert dict(shapes) == {"window_left": frozenset({None}), "head_dim": frozenset({64, 128})}
    assert spec.features == frozenset({"non_causal", "sinks", "sliding_window", "return_lse"})
    assert dict(spec.dtypes) == {
        "q": frozenset({torch.bfloat16, torch.float16}),
        "kv": frozenset({torch.bfloat16, torch.float16}),
    }
    assert spec.available is _fa4.fa4_missing and spec.graph_safe
    # its unseen-NaN leak (H200, 2026-11-28) is declared, and shown by `list`; among the NVIDIA,
    # Triton and reference attention kernels it is the only one (the AMD ones declare theirs)
    assert not spec.unseen_safe and "unseen_safe=no" in spec.summary()
    ops = ("attention.prefill", "attention.extend", "attention.decode")
    leaky = [s.name for op in ops for s in registry.kernels(op) if not s.unseen_safe]
    assert [n for n in leaky if not n.startswith("amd_")] == [KERNEL]


def test_unavailable_without_the_extra_or_a_bundle(monkeypatch):
    monkeypatch.setattr(_fa4, "_find_spec", lambda name: name == "tvm_ffi")
    reason = (
        "flash-attn-4, nvidia-cutlass-dsl not installed (pip install 'tokenspeed-kernel-nvidia[cutedsl]') "
        "and no AOT bundle (TOKENSPEED_KERNEL_FA4_AOT unset)"
    )
    assert _fa4.fa4_missing() == reason
    assert _reasons(_request()) == (reason,)


def test_jit_route_is_available_when_the_extra_is_installed(monkeypatch):
    monkeypatch.setattr(_fa4, "_find_spec", lambda name: True)
    assert _fa4.fa4_missing() is None
    assert _reasons(_request(sinks=True, window_left=127, return_lse=True)) == ()
    assert _reasons(_request(), arch="sm_100")[0] == "arch sm_100 not in {sm_90}"
    assert _reasons(_request(logit_cap=30.0)) == ("does not support {logit_cap}",)
    assert _reasons(_request(heads=Heads(8, 2, 64, 32))) == ("head_dim_v=32 not in {64, 128}",)
    assert _reasons(_request(heads=Heads(8, 2, 128, 64))) == ("head_dim_v=64 differs from head_dim=128",)


def test_bundle_problems_are_reasons(tmp_path, monkeypatch):
    monkeypatch.setattr(_fa4, "_find_spec", lambda name: True)
    monkeypatch.setenv(_fa4.AOT_ENV, str(tmp_path))
    assert _fa4.fa4_missing() == (
        f"FA4 AOT bundle {tmp_path} ({_fa4.AOT_ENV}) lacks manifest.json, fa4_sm90.so, libcute_dsl_runtime.so"
    )
    _fa4._read_bundle.cache_clear()
    _bundle(tmp_path, fmt=0)
    assert _fa4.fa4_missing() == f"FA4 AOT bundle {tmp_path}: manifest format 0, expected 1"
    _fa4._read_bundle.cache_clear()
    (tmp_path / _fa4.MANIFEST).write_text('{"format": 1, "variants": [{"dtype": "bfloat16"}]}')
    assert _fa4.fa4_missing().startswith(f"FA4 AOT bundle {tmp_path}: unreadable manifest.json (bad variant entry")
    _fa4._read_bundle.cache_clear()
    _bundle(tmp_path)
    monkeypatch.setattr(_fa4, "_find_spec", lambda name: name != "tvm_ffi")
    assert _fa4.fa4_missing() == f"FA4 AOT bundle {tmp_path} needs apache-tvm-ffi, which is not installed"


def test_bundle_serves_exactly_its_variants(tmp_path, monkeypatch):
    # a bundle needs neither FA4 nor CuTe DSL: only tvm_ffi
    monkeypatch.setattr(_fa4, "_find_spec", lambda name: name == "tvm_ffi")
    monkeypatch.setenv(_fa4.AOT_ENV, str(_bundle(tmp_path)))
    assert _fa4.fa4_missing() is None
    assert _reasons(_request(sinks=True, window_left=127, return_lse=True)) == ()
    missing = _reasons(_request(sinks=True, window_left=127))  # no LSE variant in this bundle
    assert missing == (
        "no variant in the FA4 AOT bundle for dtype=bfloat16 head_dim=64 head_dim_v=64 group=8 causal=True "
        "window=True sinks=True lse=False (build it with ci/device/cutedsl_aot.py)",
    )
    for request in (
        _request(torch.float16, sinks=True, window_left=127, return_lse=True),
        _request(heads=Heads(32, 8, 64, 64), sinks=True, window_left=127, return_lse=True),  # group 4
        _request(causal=False, sinks=True, window_left=127, return_lse=True),
    ):
        assert _reasons(request)[0].startswith("no variant in the FA4 AOT bundle")


@pytest.mark.parametrize(
    "causal, window, right",
    [(True, 127, 0), (False, 127, None), (True, -1, None), (False, -1, None)],
)
def test_call_args_follow_fa4_order(causal, window, right):
    args = ragged_prefill_args(causal=causal, window_left=window, sinks=True, return_lse=True)
    sinks = args.sinks
    lse_t = torch.empty(16, 8)
    got = _fa4.call_args(args, lse_t)
    assert len(got) == 18
    assert got[:4] == (args.q, args.k, args.v, args.out) and got[4] is lse_t
    assert got[5] == pytest.approx(1 / 8) and got[6] is args.cu_seqlens_q and got[7] is args.cu_seqlens_k
    assert got[8:11] == (None, None, None)
    assert got[11] == (window if window >= 0 else None) and got[12] == right
    assert got[13] is sinks and got[14] is None and got[15] == (None, None) and got[16:] == (None, None)
    variant = _fa4.variant_of(args)
    assert variant == _fa4.Fa4Variant("bfloat16", 64, 64, 8, causal, window >= 0, True, True)
    assert variant.name.startswith("fa4_sm90_bf16_d64x64_g8_") and variant.name.isidentifier()


def test_run_rejects_what_no_variant_computes():
    with pytest.raises(ValueError, match="logit_cap"):
        _fa4.run(ragged_prefill_args(logit_cap=30.0))
    args = ragged_prefill_args()
    args.q = torch.empty(args.q.numel() * 2 + 1, dtype=torch.bfloat16)[1 : 1 + args.q.numel()].view(args.q.shape)
    with pytest.raises(ValueError, match="q must be 16-byte aligned"):
        _fa4.run(args)


def test_no_keys_anywhere_writes_zeros_and_the_sink_without_launching(monkeypatch):
    monkeypatch.setattr(_fa4, "_function", lambda variant: pytest.fail("launched with no keys"))
    args = ragged_prefill_args(lens_k=(0, 0, 0), sinks=True, return_lse=True)
    args.out.fill_(float("nan"))
    _fa4.run(args)
    assert not args.out.float().any()
    torch.testing.assert_close(args.lse, args.sinks.expand(8, 16))
    args = ragged_prefill_args(lens_k=(0, 0, 0), return_lse=True)
    _fa4.run(args)
    assert torch.isneginf(args.lse).all()
