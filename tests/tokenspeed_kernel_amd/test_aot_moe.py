"""The Gluon MXFP4 MoE kernels compile ahead of time for gfx942 and gfx950 at the GPT-OSS-120B
shapes (H = I = 2880, top-4, swiglu_oai, biases, expert map), both byte orders: grouped GEMMs
on MFMA, warp-decode GEMVs on the vector ALUs; no spills, budgets kept."""

from __future__ import annotations

import pytest

from tokenspeed_kernel_amd.aot import CompileReport, run_sweep

ARCHS = ("gfx942", "gfx950")


def assert_within_budget(report: CompileReport) -> None:
    assert report.ok, f"{report.kernel} on {report.arch} did not compile: {report.error}"
    assert not report.problems(), report.problems()
    assert report.vgprs > 0, f"{report.kernel}: no .vgpr_count in the AMDGCN metadata"
    print(
        f"{report.arch} {report.kernel}: mfma={report.mfma} lds={report.lds_bytes} vgprs={report.vgprs} agprs={report.agprs}"
    )


def assert_mfma(report: CompileReport) -> None:
    assert not report.mfma_problems(), report.mfma_problems()


@pytest.fixture(scope="module")
def reports():
    """Compiled once per module, in a subprocess without TRITON_INTERPRET."""
    reports = run_sweep(list(ARCHS), ("moe",))
    return {arch: {r.kernel: r for r in reports if r.arch == arch} for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_moe_kernel_compiles_within_budget(reports, arch):
    assert len(reports[arch]) == 7
    for report in reports[arch].values():
        assert_within_budget(report)


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_gemm_runs_on_mfma(reports, arch):
    gemms = [r for name, r in reports[arch].items() if name.startswith("moe_gemm[")]
    assert len(gemms) == 3
    for report in gemms:
        assert_mfma(report)
        # w13 has two accumulators (gate, up): twice the MFMAs of w2 per K step
    w13 = reports[arch]["moe_gemm[w13 bf16 halves]"]
    w2 = reports[arch]["moe_gemm[w2 bf16 halves]"]
    assert w13.mfma_count == 2 * w2.mfma_count


@pytest.mark.parametrize("arch", ARCHS)
def test_warp_decode_gemvs_need_no_lds_or_mfma(reports, arch):
    """The tiny-batch GEMVs are memory bound: vector ALU only, no LDS round trip."""
    gemvs = [r for name, r in reports[arch].items() if name.startswith("moe_gemv")]
    assert len(gemvs) == 4
    for report in gemvs:
        assert not report.mfma, report.mfma
        assert report.lds_bytes == 0
