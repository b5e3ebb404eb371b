"""The layer-2 grouped GEMM prototype (``gluon_mx_grouped``) on an sm_90 GPU: its output rows
against float64 (and bit-for-bit close to its CPU emulation) on awkward expert sizes (0, 1,
127, 128, 129 rows), K not a multiple of 128, N not a multiple of 128, both decodes."""

import pytest
import torch
from support.gpu import sm90_skip_reason
from support.mx_grouped import grouped_case, grouped_reference

from tokenspeed_kernel_nvidia.ops.moe.gluon_mx_grouped import GroupedW2Config, emulate_w2_grouped, launch_w2_grouped

pytestmark = pytest.mark.skipif(sm90_skip_reason() is not None, reason=str(sm90_skip_reason()))


@pytest.mark.parametrize(
    ("n", "k", "cfg", "programs", "big"),
    [
        (2880, 2880, GroupedW2Config(), None, False),
        (2880, 2880, GroupedW2Config(), None, True),  # the two-multiply decode
        (200, 416, GroupedW2Config(), 3, False),  # few programs: each walks several items
        (200, 416, GroupedW2Config(pingpong=False, stages=2), None, False),
        (256, 128, GroupedW2Config(stages=5), 1, True),
    ],
)
def test_matches_float64_on_awkward_experts(n, k, cfg, programs, big):
    case = grouped_case(n, k, device="cuda")
    out = torch.full((case.num_pairs, n), float("nan"), device="cuda")
    num_tiles = torch.tensor([case.num_tiles], dtype=torch.int32, device="cuda")
    launch_w2_grouped(case.x, case.words, case.scales, case.big or big, case.sorted_ids, case.tile_expert, num_tiles, out,
                      cfg, programs)  # fmt: skip
    torch.cuda.synchronize()
    ref = grouped_reference(case)
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "some pair row was not written"
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
    emu = emulate_w2_grouped(case.x.cpu(), case.words.cpu(), case.scales.cpu(), case.sorted_ids.cpu(),
                             case.tile_expert.cpu(), case.num_tiles, case.num_pairs)  # fmt: skip
    torch.testing.assert_close(got.float(), emu, rtol=1e-4, atol=1e-4 * emu.abs().max().item())
