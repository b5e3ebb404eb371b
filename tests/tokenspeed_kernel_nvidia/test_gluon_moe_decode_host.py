"""Host side of ``gluon_moe_decode_mx_sm90`` on CPU: registration metadata, the selector's
verdicts on a faked sm_90 (and sm_80) platform, the configuration table and grids, and the
E2M1 bit trick of the kernel's decode (the same shifts and masks, in torch integer ops)."""

import pytest
import torch
from support.moe_checks import gpt_oss_request as _request

from tokenspeed_kernel import registry, selector
from tokenspeed_kernel.platform import platform_from_arch
from tokenspeed_kernel.quant import E2M1_VALUES
from tokenspeed_kernel.registry import Priority, Request
from tokenspeed_kernel_nvidia.ops.moe import gluon_moe_decode as gm

NAME = "gluon_moe_decode_mx_sm90"


def _reasons(request, arch="sm_90"):
    selection = selector.explain(request, platform=platform_from_arch(arch))
    return {c.spec.name: c.reasons for c in selection.candidates}


def test_registration_metadata():
    spec = registry.get_kernel(NAME)
    assert spec.op == "moe.apply" and spec.backend == "nvidia" and spec.solution == "gluon"
    assert spec.archs == frozenset({"sm_90"}) and spec.vendors == frozenset({"cuda"})
    assert spec.priority == Priority.PERFORMANT
    assert {"mxfp4", "bias", "expert_map", "silu", "gelu", "swiglu_oai"} <= spec.features
    assert "mxfp8_act" not in spec.features and "fp8_act" not in spec.features


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 8])
def test_accepted_on_sm90_for_t_le_8(num_tokens):
    assert _reasons(_request(num_tokens))[NAME] == ()


def test_plan_request_without_tokens_is_accepted():
    assert _reasons(_request(None))[NAME] == ()


def test_rejections_with_reasons():
    (why,) = _reasons(_request(9))[NAME]
    assert "num_tokens_bucket=16 > 8" in why
    (why,) = _reasons(_request(1, weight_format="plain"))[NAME]
    assert "weight dtype bfloat16" in why  # the dtype gate speaks first for plain weights
    # uint8 weights that are not MXFP4 (no public format today): the predicate's own reason.
    request = Request.make("moe.apply", {"x": torch.bfloat16, "weight": torch.uint8}, {"top_k": 4}, ("silu",))
    assert "MXFP4 weights only" in gm.predicate(request)
    (why,) = _reasons(_request(1, top_k=16))[NAME]
    assert "top_k=16 > 8" in why
    assert _reasons(_request(1), "sm_80")[NAME]  # not an sm_90 part: arch gate
    assert _reasons(_request(1, activation_quant="mxfp8"))[NAME]  # undeclared feature


def test_config_table_and_grids():
    assert set(gm.CONFIGS) == {1, 2, 4, 8}
    for t in range(1, 9):
        cfg = gm.decode_config(t)
        assert cfg is gm.CONFIGS[gm.next_pow2(t)]
        assert cfg.warps2(4) == 4 * cfg.row_warps2 and cfg.warps2(1) == cfg.row_warps2
    assert gm.decode_config(100) is gm.CONFIGS[8]  # a plan called with more tokens
    cfg = gm.decode_config(1)
    assert (cfg.block_n1, cfg.block_n2) == (16, 8)
    # GPT-OSS-120B, T = 1: 4 pairs x 180 row blocks, 360 blocks of 8 outputs x 1 token.
    assert gm.grids(1, 4, 2880, 2880, cfg) == ((4, 180), (360, 1))
    assert gm.grids(8, 4, 2880, 2880, gm.decode_config(8)) == ((32, 180), (360, 8))
    assert gm.grids(2, 2, 64, 96, gm.decode_config(2)) == ((4, 6), (8, 2))


def test_layouts():
    w3, rl, w4 = gm.decode_config(1).layouts(4, 128)
    assert list(w3.size_per_thread) == [1, 1, 4] and list(w3.threads_per_warp) == [1, 32, 1]
    assert list(rl.size_per_thread) == [1, 4] and list(rl.warps_per_cta) == [4, 1]
    assert list(w4.warps_per_cta) == [4, 1, 1, 1] and list(w4.size_per_thread) == [1, 1, 1, 4]


def _decode_like_kernel(word: torch.Tensor) -> torch.Tensor:
    """The kernel's DECODE_ASM in torch int64 ops: 8 values e2m1 * 2**-14 per int32 word."""
    word = word & 0xFFFFFFFF
    out = []
    for mag_shift, sign_shift in ((9, 12), (5, 8), (1, 4), (-3, 0)):
        m = (word << mag_shift if mag_shift >= 0 else word >> -mag_shift) & 0x0E000E00
        s = (word << sign_shift) & 0x80008000
        p = m | s
        out.append(((p & 0xFFFF).to(torch.int16)).view(torch.float16).float())
        out.append((((p >> 16) & 0xFFFF).to(torch.int32).to(torch.int16)).view(torch.float16).float())
    lo = out[0::2]
    hi = out[1::2]
    return torch.stack(lo + hi, -1)  # k = 0..3 (low halves), 4..7 (high halves)


def test_e2m1_bit_trick_matches_the_table():
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4096, 8), generator=gen, dtype=torch.int64)
    codes[:16, :] = torch.arange(16)[:, None]  # every code at every position
    word = sum(codes[:, k] << (4 * k) for k in range(8))
    got = _decode_like_kernel(word) * 2.0**14
    assert torch.equal(got, table[codes])
