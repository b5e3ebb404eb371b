"""Host-side code on CPU: MXFP4 pre-shuffle round trip against the core's dequantizer,
expert-sorted routing, launch heuristics, argument checks, and selection on faked
gfx942/gfx950 platforms (these kernels for GPT-OSS-120B shapes, others elsewhere)."""

from __future__ import annotations

import pytest
import torch

from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.quant import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from tokenspeed_kernel.registry import Request
from tokenspeed_kernel.selector import explain
from tokenspeed_kernel_amd._arch import arch_config
from tokenspeed_kernel_amd.ops.attention._config import MAX_SPLITS, attention_config, decode_splits
from tokenspeed_kernel_amd.ops.attention._launch import check_shapes, num_m_blocks
from tokenspeed_kernel_amd.ops.moe._prepare import from_halves, prepare_moe, to_halves
from tokenspeed_kernel_amd.ops.moe._routing import sort_pairs


def _mxfp4(e: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return quantize_mxfp4(torch.randn(e, n, k, generator=gen) * 3)


def _decode_halves(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernels compute from halves-ordered bytes: low nibbles = values j of each
    64-group with scale 2g, high nibbles = values 32 + j with scale 2g + 1 (float64)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float64)
    groups = packed.reshape(*packed.shape[:-1], -1, 32).long()
    s = torch.pow(2.0, scales.double() - 127).reshape(*scales.shape[:-1], -1, 2)
    lo = table[groups & 15] * s[..., 0:1]
    hi = table[groups >> 4] * s[..., 1:2]
    return torch.cat([lo, hi], dim=-1).flatten(-2)


def test_halves_round_trip_and_values():
    w = _mxfp4(3, 40, 192, seed=0)
    halves = to_halves(w.packed)
    assert not torch.equal(halves, w.packed)  # a real reorder
    assert torch.equal(from_halves(halves), w.packed)
    torch.testing.assert_close(_decode_halves(halves, w.scales), dequantize_mxfp4(w, torch.float64), rtol=0, atol=0)


def test_prepare_hook_keeps_inputs_and_rejects_other_formats():
    w13, w2 = _mxfp4(2, 128, 64, 1), _mxfp4(2, 64, 64, 2)
    before = w13.packed.clone()
    prepared = prepare_moe(w13=w13, w2=w2)
    assert torch.equal(w13.packed, before)
    assert torch.equal(from_halves(prepared.w13_packed), w13.packed)
    assert prepared.w2_scales is w2.scales
    with pytest.raises(TypeError, match="w13/w2"):
        prepare_moe(w13=torch.zeros(2, 128, 64), w2=w2)
    with pytest.raises(ValueError, match="multiple of 64"):
        to_halves(_mxfp4(1, 4, 32, 3).packed)


@pytest.mark.parametrize("with_map", [False, True])
def test_routing_tiles_cover_every_local_pair_once(with_map):
    gen = torch.Generator().manual_seed(4)
    num_experts, block_m = 16, 8
    ids = torch.randint(0, 32 if with_map else num_experts, (37, 4), generator=gen, dtype=torch.int32)
    emap = None
    if with_map:  # global 32 experts, this rank holds every other one
        emap = torch.where(torch.arange(32) % 2 == 0, torch.arange(32) // 2, torch.full((32,), -1)).to(torch.int32)
    r = sort_pairs(ids, emap, num_experts, block_m)
    local = ids.flatten().long() if emap is None else emap.long()[ids.flatten().long()]
    seen = []
    for t in range(r.num_tiles):
        rows = int(r.tile_rows[t])
        assert 0 <= rows <= block_m
        if rows == 0:
            continue
        e = int(r.tile_expert[t])
        pairs = r.sorted_pairs[int(r.tile_row[t]) : int(r.tile_row[t]) + rows].long()
        assert torch.all(local[pairs] == e)
        seen += pairs.tolist()
    expected = sorted(torch.nonzero(local >= 0).flatten().tolist())
    assert sorted(seen) == expected


def test_decode_splits_fill_the_machine_and_stay_bounded():
    mi355 = arch_config("gfx950")
    assert decode_splits(mi355, batch=1, num_kv_heads=8, visible_keys=8192) == MAX_SPLITS
    assert decode_splits(mi355, batch=256, num_kv_heads=8, visible_keys=8192) == 1
    assert decode_splits(mi355, batch=1, num_kv_heads=8, visible_keys=128) == 1  # two tiles: no split
    assert decode_splits(mi355, batch=4, num_kv_heads=8, visible_keys=4096) == 16


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_tiles_and_grids(arch):
    cfg = attention_config(arch_config(arch), regime="decode", head_dim=64, head_dim_v=64, group=8, num_kv_heads=8)
    assert cfg.block_m == 16 and cfg.constexprs["MMA"].instr_shape[2] == arch_config(arch).mfma_k
    spec = attention_config(
        arch_config(arch), regime="decode", head_dim=64, head_dim_v=64, group=8, num_kv_heads=8, q_len=4
    )
    assert spec.block_m == 32
    pre = attention_config(arch_config(arch), regime="prefill", head_dim=128, head_dim_v=128, group=8, num_kv_heads=8)
    assert (pre.block_m, pre.num_warps) == (128, 8)
    assert num_m_blocks(1000, 8, 128) == 63  # 16 tokens x 8 heads per program


def test_check_shapes_names_the_argument():
    q, kv = torch.empty(2, 64, 64), torch.empty(2, 8, 64)
    assert check_shapes(q, kv, kv) == (8, 64)
    with pytest.raises(ValueError, match="head dims"):
        check_shapes(torch.empty(2, 64, 256), torch.empty(2, 8, 256), torch.empty(2, 8, 256))
    with pytest.raises(ValueError, match="GQA group"):
        check_shapes(torch.empty(2, 24, 64), kv, kv)
    with pytest.raises(ValueError, match="q_len"):
        check_shapes(q, kv, kv, q_len=16)


_BF16 = torch.bfloat16
_GPT_OSS_ATTN = {"head_dim": 64, "head_dim_v": 64, "num_q_heads": 64, "num_kv_heads": 8}
_GPT_OSS_MOE = {"num_experts": 128, "top_k": 4, "hidden": 2880, "intermediate": 2880}


def _winner(request: Request, arch: str) -> str | None:
    selection = explain(request, platform=platform_from_arch(arch))
    return None if selection.winner is None else selection.winner.name


REQUESTS = {
    "decode": Request.make(
        "attention.decode",
        {"q": _BF16, "kv": _BF16},
        {**_GPT_OSS_ATTN, "page_size": 16, "q_len": 1},
        {"sinks", "sliding_window", "return_lse"},
    ),
    "decode_fp8_spec": Request.make(
        "attention.decode",
        {"q": _BF16, "kv": torch.float8_e4m3fn},
        {**_GPT_OSS_ATTN, "page_size": 64, "q_len": 4},
        {"sinks", "fp8_kv", "spec_decode"},
    ),
    "prefill": Request.make("attention.prefill", {"q": _BF16, "kv": _BF16}, _GPT_OSS_ATTN, {"sinks", "sliding_window"}),
    "extend": Request.make(
        "attention.extend", {"q": _BF16, "kv": _BF16}, {**_GPT_OSS_ATTN, "page_size": 16}, {"sinks", "sliding_window"}
    ),
    "moe": Request.make(
        "moe.apply", {"x": _BF16, "weight": torch.uint8}, _GPT_OSS_MOE, {"swiglu_oai", "bias", "mxfp4"}
    ),
    "moe_decode_bucket": Request.make(
        "moe.apply",
        {"x": _BF16, "weight": torch.uint8},
        {**_GPT_OSS_MOE, "num_tokens_bucket": 1},
        {"swiglu_oai", "bias", "mxfp4", "expert_map"},
    ),
}
AMD_WINNERS = {
    "decode": "amd_gluon_decode",
    "decode_fp8_spec": "amd_gluon_decode",
    "prefill": "amd_gluon_prefill",
    "extend": "amd_gluon_extend",
    "moe": "amd_gluon_moe_mxfp4",
    "moe_decode_bucket": "amd_gluon_moe_mxfp4",
}


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_gpt_oss_selects_amd_kernels_on_cdna(arch, case):
    assert _winner(REQUESTS[case], arch) == AMD_WINNERS[case]


@pytest.mark.parametrize("arch", ["sm_90", "cpu", "gfx90a"])
@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_other_platforms_select_other_kernels(arch, case):
    winner = _winner(REQUESTS[case], arch)
    assert winner is None or not winner.startswith("amd_"), winner


@pytest.mark.parametrize(
    "request_",
    [
        # head dim 256: not tiled here
        Request.make("attention.decode", {"q": _BF16, "kv": _BF16}, {"head_dim": 256, "page_size": 16}),
        # GQA group of 3 (not a power of two)
        Request.make(
            "attention.prefill", {"q": _BF16, "kv": _BF16}, {"head_dim": 64, "num_q_heads": 24, "num_kv_heads": 8}
        ),
        # fp32 queries
        Request.make("attention.decode", {"q": torch.float32, "kv": torch.float32}, {"head_dim": 64}),
        # plain bf16 and fp8 expert weights
        Request.make("moe.apply", {"x": _BF16, "weight": _BF16}, _GPT_OSS_MOE, {"silu"}),
        Request.make(
            "moe.apply", {"x": _BF16, "weight": torch.float8_e4m3fn}, _GPT_OSS_MOE, {"silu", "fp8_per_channel"}
        ),
        # MXFP4 with a K dim that is not a multiple of 64
        Request.make("moe.apply", {"x": _BF16, "weight": torch.uint8}, {**_GPT_OSS_MOE, "hidden": 2848}, {"mxfp4"}),
    ],
    ids=["d256", "group3", "fp32", "moe_bf16", "moe_fp8", "moe_k_not_64"],
)
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_unsupported_requests_fall_through_on_cdna(arch, request_):
    selection = explain(request_, platform=platform_from_arch(arch))
    amd = [c for c in selection.candidates if c.spec.name.startswith("amd_")]
    assert amd and all(not c.accepted for c in amd), selection.table()
    assert selection.winner is None or not selection.winner.name.startswith("amd_")


# ------------------------------------------------ activation_quant="mxfp8" (feature mxfp8_act)

_MOE_MXFP8 = Request.make(
    "moe.apply",
    {"x": _BF16, "weight": torch.uint8},
    {**_GPT_OSS_MOE, "num_tokens_bucket": 64},
    {"swiglu_oai", "bias", "mxfp4", "mxfp8_act"},
)


def _reasons(request: Request, arch: str) -> dict[str, tuple[str, ...]]:
    selection = explain(request, platform=platform_from_arch(arch))
    return {c.spec.name: c.reasons for c in selection.candidates}


@pytest.mark.parametrize(
    "arch, winner",
    [("gfx950", "amd_gluon_moe_mxfp4_scaled"), ("gfx942", "amd_gluon_moe_mxfp4")],
)
def test_mxfp8_activations_select_the_scaled_mfma_kernel_on_gfx950(arch, winner):
    """gfx950: the scaled-MFMA kernel; gfx942 (no scaled MFMA): quantize-dequantize on the
    16-bit kernel. Kernels that do not declare mxfp8_act are rejected with that reason."""
    assert _winner(_MOE_MXFP8, arch) == winner
    reasons = _reasons(_MOE_MXFP8, arch)
    triton = [name for name in reasons if name.startswith("triton_")]
    assert triton, sorted(reasons)
    for name in triton:  # every Triton MoE is rejected; the main one for the feature itself
        assert reasons[name], name
    why = reasons["triton_fused_moe"]
    assert any("does not support {mxfp8_act}" in r for r in why), why
    if arch == "gfx942":
        assert any("gfx942" in r for r in reasons["amd_gluon_moe_mxfp4_scaled"]), reasons["amd_gluon_moe_mxfp4_scaled"]
    assert reasons["torch_moe"] == ()  # the reference serves it everywhere


def test_scaled_kernel_declines_requests_without_mxfp8():
    for request in (REQUESTS["moe"], REQUESTS["moe_decode_bucket"]):
        assert _winner(request, "gfx950") == "amd_gluon_moe_mxfp4"
        why = _reasons(request, "gfx950")["amd_gluon_moe_mxfp4_scaled"]
        assert why == ("serves only activation_quant='mxfp8' (the scaled MFMA needs MX activations)",)


@pytest.mark.parametrize("arch", ["sm_90", "gfx90a", "cpu"])
def test_mxfp8_activations_elsewhere_fall_to_the_reference(arch):
    assert _winner(_MOE_MXFP8, arch) == "torch_moe"


def test_scaled_kernel_argument_checks():
    from tokenspeed_kernel.ops.moe.args import MoEApplyArgs
    from tokenspeed_kernel_amd.ops.moe.fused_scaled import moe_mxfp4_scaled

    w13, w2 = _mxfp4(2, 128, 64, 1), _mxfp4(2, 64, 64, 2)
    x = torch.zeros(16, 64, dtype=_BF16)
    args = MoEApplyArgs(
        x,
        w13,
        w2,
        torch.ones(16, 1),
        torch.zeros(16, 1, dtype=torch.int32),
        "silu",
        None,
        None,
        None,
        torch.empty_like(x),
    )
    with pytest.raises(ValueError, match="activation_quant"):
        moe_mxfp4_scaled(args)
    args.activation_quant = "mxfp8"
    args.w13 = torch.zeros(2, 128, 64, dtype=_BF16)
    with pytest.raises(TypeError, match="w13/w2"):
        moe_mxfp4_scaled(args)


def test_the_attention_kernels_declare_the_unseen_nan_they_do_not_clean():
    """No non-finite V cleaning on gfx950 (it spilled; docs/api.md): each AMD attention kernel
    registers ``unseen_safe=False``, so ``list`` shows it and the edge-input tests report it."""
    from tokenspeed_kernel import registry

    for name in ("amd_gluon_prefill", "amd_gluon_extend", "amd_gluon_decode"):
        spec = registry.get_kernel(name)
        assert not spec.unseen_safe and "unseen_safe=no" in spec.summary(), name
