"""Host side of ``gluon_moe_mma_sm90`` on CPU: registration metadata, the selector's verdicts
on a faked sm_90 (and sm_80) platform, the configuration, grids and layouts, the
intermediate's pair order against the B fragment layer 2 reads, and the power-of-two
activation scale."""

import pytest
import torch
from support.moe_checks import gpt_oss_request

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.registry import Priority
from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_mma as gm

NAME = "gluon_moe_mma_sm90"


def _request(num_tokens=1, x_dtype=torch.bfloat16, **kw):
    return gpt_oss_request(num_tokens, x_dtype=x_dtype, **kw)


def _reasons(request, arch="sm_90"):
    selection = selector.explain(request, platform=platform_from_arch(arch))
    return {c.spec.name: c.reasons for c in selection.candidates}[NAME]


def test_registration_metadata():
    spec = registry.get_kernel(NAME)
    assert spec.op == "moe.apply" and spec.backend == "nvidia" and spec.solution == "gluon"
    assert spec.archs == frozenset({"sm_90"}) and spec.vendors == frozenset({"cuda"})
    # Above the FMA kernel: correct and faster on an H100 at T = 1..8 (docs/history.md)
    assert spec.priority == Priority.PERFORMANT + 10
    assert spec.priority > registry.get_kernel("gluon_moe_decode_mx_sm90").priority
    assert {"mxfp4", "bias", "expert_map", "silu", "gelu", "swiglu_oai"} <= spec.features


@pytest.mark.parametrize("num_tokens", [1, 5, 8, None])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_accepted_on_sm90(num_tokens, x_dtype):
    assert _reasons(_request(num_tokens, x_dtype)) == ()


def test_rejections_with_reasons():
    (why,) = _reasons(_request(9))
    assert "num_tokens_bucket=16 > 8" in why
    (why,) = _reasons(_request(1, top_k=16))
    assert "top_k=16 > 8" in why
    assert any("float32" in r for r in _reasons(_request(1, x_dtype=torch.float32)))  # 13 bits lost
    assert _reasons(_request(1), "sm_80")  # arch gate


def test_config_grids_layouts():
    assert set(gm.CONFIGS) == {1, 2, 4, 8} and gm.mma_config(100) is gm.CONFIGS[8]
    cfg = gm.mma_config(1)
    assert cfg.prefetch and cfg.l2_hint and cfg.ks2 == 4 and not cfg.normalize  # the H100 sweep's pick
    # GPT-OSS-120B, T = 1: 4 pairs x 90 blocks of 32 columns; 180 blocks of 16 outputs.
    assert gm.grids(1, 4, 2880, 2880, cfg) == ((4, 90), (180, 1))
    assert gm.grids(8, 4, 2880, 2880, gm.GluonMoEMMAConfig(rb2=2)) == ((32, 90), (90, 8))
    l1, xl, l2 = cfg.layouts(3)
    assert list(xl.warps_per_cta) == [cfg.ks1]
    assert list(l1.threads_per_warp) == [1, 1, 1, 8, 4]  # lane = 4 g + c, the MMA's quads
    assert list(l1.warps_per_cta) == [cfg.ks1, 1, 1, 1, 1]
    assert list(l2.warps_per_cta) == [4 * cfg.ks2, 1, 1, 1, 1]  # top-3 padded to 4 choices
    assert cfg.row_pad(2880) == 4096 and cfg.row_pad(64) == 256 * cfg.ks1


def test_launch_refuses_row_blocks_that_do_not_divide_h():
    """The kernels read whole row blocks unmasked: a layer-2 block must divide H (checked
    before any launch, so this runs without a GPU)."""
    from tokenspeed_kernel.quant import quantize_mxfp4

    e, h, i = 1, 96, 32
    w13 = quantize_mxfp4(torch.randn(e, 2 * i, h))
    w2 = quantize_mxfp4(torch.randn(e, h, i))
    x = torch.randn(1, h, dtype=torch.bfloat16)
    ids, tw = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="H % 64 == 0"):
        gm.launch(x, w13, w2, None, None, None, torch.empty_like(x), ids, tw, 1, "silu", gm.GluonMoEMMAConfig(rb2=4))


def _pair_position(within: torch.Tensor) -> torch.Tensor:
    """Where layer 1 stores column ``within`` (0..31) of a 32-column block (the kernel's ``pos``)."""
    return (within // 8) * 8 + (within % 4) * 2 + (within % 8) // 4


def test_pair_order_matches_the_b_fragment():
    # Layer 2's lane c reads 4 int32 words at fp16 positions 8c + 2j + (0, 1) and uses them as
    # the pairs (k, k + 4) = (8c + j, 8c + j + 4), the order its decoded A registers have.
    within = torch.arange(32)
    pos = _pair_position(within)
    assert sorted(pos.tolist()) == list(range(32))  # a permutation
    stored = torch.empty(32, dtype=torch.long)
    stored[pos] = within
    for c in range(4):
        for j in range(4):
            assert stored[8 * c + 2 * j].item() == 8 * c + j
            assert stored[8 * c + 2 * j + 1].item() == 8 * c + j + 4


@pytest.mark.parametrize("amax", [3e5, 1.0, 1e-6, 6e4])
def test_activation_scale_maps_into_fp16(amax):
    # The kernel's _exponent: e = floor(log2(amax)) - 14, so amax * 2**-e is in [2**14, 2**15).
    bits = torch.tensor([amax], dtype=torch.float32).view(torch.int32)
    e = int(((bits >> 23) & 0xFF).item()) - 127 - 14
    scaled = amax * 2.0**-e
    assert 2.0**14 <= scaled < 2.0**15 < 65504


@pytest.mark.parametrize(
    ("x_dtype", "num_tokens", "chosen"),
    [
        (torch.bfloat16, 1, NAME),
        (torch.float16, 8, NAME),
        (torch.float32, 1, "gluon_moe_decode_mx_sm90"),  # fp16 operands would drop 13 bits
        (torch.bfloat16, 64, None),  # past the decode regime: neither Gluon kernel
    ],
)
def test_selector_ranks_it_first_on_sm90(x_dtype, num_tokens, chosen):
    spec = selector.select(_request(num_tokens, x_dtype), platform=platform_from_arch("sm_90"))
    if chosen is None:
        assert spec.name not in (NAME, "gluon_moe_decode_mx_sm90"), spec.name
    else:
        assert spec.name == chosen


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tma1": True, "ks1": 8, "u1": 2}, "ks1 \\* u1 <= 8"),
        ({"tma1": True, "stages1": 0}, "stages1 >= 1"),
        ({"tma2": True, "rb2": 2}, "rb2 == 1"),
        ({"tma2": True, "ks2": 4, "u2": 4}, "ks2 \\* u2 <= 8"),
    ],
)
def test_tma_config_is_checked_before_launch(fields, needle):
    """The opt-in TMA-staged layers read box rows of 16 * ks * u bytes (at most the 128-byte
    swizzle), layer 2 one 16-row block per warp: anything else is a ValueError (raised by
    the configuration itself), before any launch."""
    from tokenspeed_kernel.quant import quantize_mxfp4

    e, h, i = 1, 64, 32
    w13 = quantize_mxfp4(torch.randn(e, 2 * i, h))
    w2 = quantize_mxfp4(torch.randn(e, h, i))
    x = torch.randn(1, h, dtype=torch.bfloat16)
    ids, tw = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match=needle):
        gm.launch(x, w13, w2, None, None, None, torch.empty_like(x), ids, tw, 1, "silu", gm.GluonMoEMMAConfig(**fields))
    assert gm.tma_box(gm.GluonMoEMMAConfig(tma1=True))[0] == [32, 32]
    assert gm.tma_box(gm.GluonMoEMMAConfig(tma2=True), 2)[0] == [16, 16]
    # measured on an H100: the TMA layer 1 ships where it was faster (T = 4, 8); layer 2 never
    assert [t for t, c in gm.CONFIGS.items() if c.tma1] == [4, 8]
    assert not any(c.tma2 for c in gm.CONFIGS.values())
