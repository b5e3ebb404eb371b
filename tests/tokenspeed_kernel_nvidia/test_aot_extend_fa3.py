"""Ahead-of-time compile of ``gluon_extend_fa3_sm90`` for sm_90a (no GPU): every configuration
the launcher can choose builds with no spills, warp-specialized (setmaxnreg 40 / 232), both
products on wgmma with the next Q·Kᵀ awaited while P·V is in flight, and K/V by one 4-D TMA
box per page (per 128-byte column block at D = 128). The dense kernel's variants reach it through
the shared consumer (``_gluon_fa3_common``): ``pv_overlap`` moves the P·V wait after the
softmax here too, ``exp2_poly`` moves exponentials off MUFU."""

import re

from support.aot import run_aot


def test_gluon_extend_fa3_compiles_warp_specialized_with_paged_tma():
    (run,) = run_aot("tokenspeed_kernel_dev.aot_nvidia_extend", [[]], timeout=300)
    assert run.returncode == 0, run.stderr
    rows = run.rows
    names = {r["kernel"] for r in rows}
    assert "gluon_extend_fa3-bfloat16-g8-p16-d64-n128-st3-r232.40-sinks" in names  # GPT-OSS's launch
    assert len(rows) == 11
    for row in rows:
        assert row["ok"], row
        assert row["spills"] == 0 and row["local"] == 0, row
        assert row["shared_bytes"] <= 227 * 1024, row
        page, d, n = (int(x) for x in re.search(r"-p(\d+)-d(\d+)-n(\d+)-", row["kernel"]).groups())
        # Two consumer warpgroups: S = Q·Kᵀ as D/16 m64nNk16 steps, O += P·V as N/16 m64nDk16
        # steps, each in the loop and once outside it; no mma.sync, no cp.async gathers.
        assert row["wgmma"] == 2 * 2 * (d // 16 + n // 16), row
        assert row["mma"] == 0 and row["cp_async"] == 0, row
        # TMA only: two Q halves (one box per 64 columns), then one box per page (or per
        # 128-row piece of a larger page) and per 64 columns, for K and for V.
        boxes = n // min(page, n)
        assert row["tma"] == (2 + 2 * boxes) * (d // 64), row
        assert {40, 232} <= set(row["setmaxnreg"]) and row["sass"]["REGS"] <= 232, row
        assert row["wgmma_wait1"] == 2, row
        assert row["fence_async"] == 1 + 2 * 2, row  # the barrier inits; V cleaning at both P·V sites
    # The variants, against GPT-OSS's launch: KV_EX2_UNDER_PV counts the key-tile loop's
    # MUFU.EX2 between the wait for S_i and the wait for P_{i-1}·V_{i-1} (see
    # test_aot_compile.py): none by default (ptxas hoists the P·V wait), all with pv_overlap
    # (one more mbarrier wait per consumer warpgroup, nothing else in the PTX).
    by_name = {r["kernel"]: r for r in rows}
    for d in (64, 128):
        base = by_name[f"gluon_extend_fa3-bfloat16-g8-p16-d{d}-n128-st{4 - d // 64}-r232.40-sinks"]
        ov = by_name[f"gluon_extend_fa3-bfloat16-g8-p16-d{d}-n128-st{4 - d // 64}-r232.40-ov-sinks"]
        assert base["sass"]["KV_EX2_UNDER_PV"] == 0, base
        assert 0 < ov["sass"]["KV_EX2_UNDER_PV"] == ov["sass"]["KV_MUFU.EX2"], ov
        assert ov["mbar_wait"] - base["mbar_wait"] == 2, (base, ov)
        for key in ("wgmma", "wgmma_wait1", "tma", "mbar_arrive", "shared_bytes"):
            assert ov[key] == base[key], (key, base, ov)
    base = by_name["gluon_extend_fa3-bfloat16-g8-p16-d64-n128-st3-r232.40-sinks"]
    ex1 = by_name["gluon_extend_fa3-bfloat16-g8-p16-d64-n128-st3-r232.40-ex1-sinks"]
    assert ex1["sass"]["KV_MUFU.EX2"] == base["sass"]["KV_MUFU.EX2"] - 8, (base, ex1)  # 1 of 8 on the FMA pipe
    # The ragged batch's launch walks the pre-pass's tile list: the same pipeline (matmuls,
    # copies, barriers, registers) with the tile index loaded from the list.
    listed = by_name["gluon_extend_fa3-bfloat16-g8-p16-d64-n128-st3-r232.40-sinks-tl"]
    for key in ("wgmma", "wgmma_wait1", "tma", "mbar_wait", "mbar_arrive", "shared_bytes", "fence_async"):
        assert listed[key] == base[key], (key, base, listed)
    assert listed["sass"]["KV_MUFU.EX2"] == base["sass"]["KV_MUFU.EX2"], (base, listed)
