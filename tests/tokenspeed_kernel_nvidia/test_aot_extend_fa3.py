"""Ahead-of-time compile of ``gluon_extend_fa3_sm90`` for sm_90a (no GPU): every configuration
the launcher can choose builds with no spills, warp-specialized (setmaxnreg 40 / 232), both
products on wgmma with the next Q·Kᵀ awaited while P·V is in flight, and K/V by one 4-D TMA
box per page (per 128-byte column block at D = 128)."""

import re

from support.aot import run_aot


def test_gluon_extend_fa3_compiles_warp_specialized_with_paged_tma():
    (run,) = run_aot("tokenspeed_kernel_dev.aot_nvidia_extend", [[]], timeout=300)
    assert run.returncode == 0, run.stderr
    rows = run.rows
    names = {r["kernel"] for r in rows}
    assert "gluon_extend_fa3-bfloat16-g8-p16-d64-n128-st3-r232.40-sinks" in names  # GPT-OSS's launch
    assert len(rows) == 6
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
